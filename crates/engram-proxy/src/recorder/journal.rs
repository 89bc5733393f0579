//! Answers released before their recording was durable (the receipt said `pending` or `lost`),
//! so that a restart can tell how many answered turns a crash took.
//!
//! A line per event in `<data_dir>/unrecorded.log`: `+<job key>` when such an answer goes to
//! the client, `-<job key>` when its recording became durable after all (in the store, or
//! forwarded there from the embedded backend's in-memory spool). Lines are appended
//! with one `write` each and not fsynced: they survive the process being killed (the kernel
//! holds them), not the machine losing power. At start-up every `+` without its `-` is a turn
//! answered but never recorded: counted (`engram_turns_unrecorded_at_start`), logged with its
//! job key, and the file starts over. Nothing is written for a turn whose receipt said
//! `queued` or `spooled`, which is every turn while the store keeps up. Forgetting a user closes
//! their open notes (`-`): their spooled jobs go with the forget, and a restart counted them as
//! turns a crash took.
//!
//! The file is rewritten with only its open notes once it passes [`COMPACT_BYTES`] and they
//! are under half of it: with `capture.receipt_wait_ms: 0` every answer writes two lines, and
//! the file grew by 68 bytes a turn (two lines of a 32-character key) for as long as the
//! process ran.

use std::collections::{HashMap, HashSet, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::error::Result;
use engram_store::UserKey;

/// The journal's file name in the data directory.
pub const FILE_NAME: &str = "unrecorded.log";
/// Bytes past which the file is rewritten with its open notes only (when they are under half
/// of it).
pub const COMPACT_BYTES: u64 = 1 << 20;
/// Keys remembered as recorded before their answer was noted, the newest this many.
const EARLY_RECORDED: usize = 4_096;

pub struct Journal {
    path: PathBuf,
    written: Mutex<Written>,
    /// Turns answered but not recorded before this process started.
    unrecorded_at_start: Vec<String>,
    compact_bytes: u64,
}

/// The file and what it holds.
struct Written {
    file: File,
    /// Its length.
    bytes: u64,
    /// The keys noted as answered and not yet as recorded, each with its note's order (what a
    /// rewrite keeps) and its user (what a forget closes).
    open: HashMap<String, (u64, UserKey)>,
    /// Bytes of their lines.
    open_bytes: u64,
    next: u64,
    /// Keys recorded before their answer was noted, whose note is then not written: the
    /// forwarder may move a job out of the in-memory spool before the recording's task, which
    /// put it there, notes its `pending` answer. Oldest first, the newest [`EARLY_RECORDED`].
    early: VecDeque<String>,
    early_keys: HashSet<String>,
}

impl Journal {
    /// Reads what the previous process left in `data_dir` (see the module docs) and starts the
    /// file over. Blocking; call it at start-up.
    pub fn open(data_dir: &Path) -> Result<Journal> {
        std::fs::create_dir_all(data_dir)?;
        let path = data_dir.join(FILE_NAME);
        let unrecorded_at_start = match std::fs::read_to_string(&path) {
            Ok(text) => unrecorded(&text),
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => Vec::new(),
            Err(error) => return Err(error.into()),
        };
        File::create(&path)?;
        let file = OpenOptions::new().append(true).open(&path)?;
        Ok(Journal {
            path,
            written: Mutex::new(Written {
                file,
                bytes: 0,
                open: HashMap::new(),
                open_bytes: 0,
                next: 0,
                early: VecDeque::new(),
                early_keys: HashSet::new(),
            }),
            unrecorded_at_start,
            compact_bytes: COMPACT_BYTES,
        })
    }

    /// The journal, rewritten past `bytes` instead of [`COMPACT_BYTES`] (tests).
    #[cfg(test)]
    fn compacting_past(mut self, bytes: u64) -> Journal {
        self.compact_bytes = bytes;
        self
    }

    /// The job keys of turns the previous process answered and never recorded.
    pub fn unrecorded_at_start(&self) -> &[String] {
        &self.unrecorded_at_start
    }

    /// `job_key`'s answer (a turn of `user`) is going to the client before its recording is
    /// durable.
    pub fn answered(&self, user: &UserKey, job_key: &str) {
        let mut written = self.lock();
        if written.early_keys.remove(job_key) {
            return;
        }
        let order = written.next;
        written.next += 1;
        let note = (order, user.clone());
        if written.open.insert(job_key.to_owned(), note).is_none() {
            written.open_bytes += line_bytes(job_key);
        }
        self.append(&mut written, '+', job_key);
    }

    /// `job_key`'s recording is durable now; noted only if its answer went early. A key not
    /// noted as answered is remembered a while instead, in case its answer is noted next.
    pub fn recorded(&self, job_key: &str) {
        let mut written = self.lock();
        if written.open.remove(job_key).is_none() {
            if written.early_keys.insert(job_key.to_owned()) {
                written.early.push_back(job_key.to_owned());
            }
            if written.early.len() > EARLY_RECORDED
                && let Some(oldest) = written.early.pop_front()
            {
                written.early_keys.remove(&oldest);
            }
            return;
        }
        written.open_bytes = written.open_bytes.saturating_sub(line_bytes(job_key));
        self.append(&mut written, '-', job_key);
        self.compact_if_due(&mut written);
    }

    /// `user` was forgotten: their open notes close. Their spooled jobs went with the forget,
    /// and a recording still under way lands as a new memory's turn (docs/pipeline.md); either
    /// way no crash took them.
    pub fn forgotten(&self, user: &UserKey) {
        let mut written = self.lock();
        let keys: Vec<String> = written
            .open
            .iter()
            .filter(|(_, (_, of))| of == user)
            .map(|(key, _)| key.clone())
            .collect();
        for key in keys {
            written.open.remove(&key);
            written.open_bytes = written.open_bytes.saturating_sub(line_bytes(&key));
            self.append(&mut written, '-', &key);
        }
        self.compact_if_due(&mut written);
    }

    fn compact_if_due(&self, written: &mut Written) {
        if written.bytes > self.compact_bytes && written.open_bytes * 2 < written.bytes {
            self.compact(written);
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Written> {
        self.written.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn append(&self, written: &mut Written, mark: char, job_key: &str) {
        let line = line(mark, job_key);
        // One write of a short line to a file opened for appending lands whole.
        match written.file.write_all(line.as_bytes()) {
            Ok(()) => written.bytes += line.len() as u64,
            Err(error) => {
                tracing::warn!(%error, path = %self.path.display(), "could not note an unrecorded answer");
            }
        }
    }

    /// Rewrites the file with its open notes, in their order, through a file renamed over it:
    /// a kill at any point leaves the old file or the new one whole.
    fn compact(&self, written: &mut Written) {
        let mut open: Vec<(&u64, &String)> =
            written.open.iter().map(|(k, (o, _))| (o, k)).collect();
        open.sort_unstable();
        let text: String = open.iter().map(|(_, key)| line('+', key)).collect();
        let staged = self.path.with_extension("log.new");
        // Opened before the rename, so the handle appends to the file that takes the name.
        let rewritten = match std::fs::remove_file(&staged) {
            Err(error) if error.kind() != std::io::ErrorKind::NotFound => Err(error),
            _ => OpenOptions::new()
                .append(true)
                .create_new(true)
                .open(&staged),
        }
        .and_then(|mut file| {
            file.write_all(text.as_bytes())?;
            std::fs::rename(&staged, &self.path)?;
            Ok(file)
        });
        match rewritten {
            Ok(file) => {
                written.file = file;
                written.bytes = text.len() as u64;
            }
            Err(error) => {
                // Appending goes on to the old file; the next recorded answer tries again.
                tracing::warn!(%error, path = %self.path.display(), "could not compact the journal of unrecorded answers");
            }
        }
    }
}

/// A note: its mark (`+` answered, `-` recorded) and the job's key, one line.
fn line(mark: char, job_key: &str) -> String {
    format!("{mark}{job_key}\n")
}

/// Bytes of a key's `+` line.
fn line_bytes(job_key: &str) -> u64 {
    job_key.len() as u64 + 2
}

/// The keys noted as answered and never as recorded, in the order they were answered.
fn unrecorded(text: &str) -> Vec<String> {
    let recorded: HashSet<&str> = text
        .lines()
        .filter_map(|line| line.strip_prefix('-'))
        .collect();
    let mut seen = HashSet::new();
    text.lines()
        .filter_map(|line| line.strip_prefix('+'))
        .filter(|key| !recorded.contains(key) && seen.insert(*key))
        .map(str::to_owned)
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    /// Whose turns the tests' notes are.
    fn user() -> UserKey {
        UserKey::new("t", "u")
    }

    #[test]
    fn a_restart_counts_the_answers_never_recorded_and_starts_over() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        assert!(journal.unrecorded_at_start().is_empty());
        journal.answered(&user(), "a");
        journal.answered(&user(), "b");
        journal.recorded("a");
        journal.answered(&user(), "c");
        drop(journal);

        let reopened = Journal::open(dir.path()).unwrap();
        assert_eq!(reopened.unrecorded_at_start(), ["b", "c"]);
        drop(reopened);
        // Counted once: the file started over.
        assert!(
            Journal::open(dir.path())
                .unwrap()
                .unrecorded_at_start()
                .is_empty()
        );
    }

    /// Past its bound the file is rewritten with the open notes only, in their order: it
    /// stays bounded however many answers went early, and a restart still finds those never
    /// recorded.
    #[test]
    fn the_file_keeps_only_open_notes_past_its_bound() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap().compacting_past(4_096);
        let path = dir.path().join(FILE_NAME);
        journal.answered(&user(), "kept-1");
        let mut largest = 0;
        for turn in 0..5_000 {
            let key = format!("turn-{turn:06}");
            journal.answered(&user(), &key);
            if turn == 2_500 {
                journal.answered(&user(), "kept-2");
            }
            journal.recorded(&key);
            largest = largest.max(std::fs::metadata(&path).unwrap().len());
        }
        // 5,000 answers wrote about 150 KB of lines.
        assert!(largest <= 4_096 + 32, "{largest}");
        drop(journal);
        let reopened = Journal::open(dir.path()).unwrap();
        assert_eq!(reopened.unrecorded_at_start(), ["kept-1", "kept-2"]);
    }

    /// A recording noted durable whose answer was not noted writes nothing (the forwarder
    /// notes every job it moves from the in-memory spool), nor does the answer's note if it
    /// comes after (the forwarder was quicker than the recording's task).
    #[test]
    fn a_recording_durable_before_its_answer_was_noted_writes_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        journal.recorded("never-answered-early");
        journal.recorded("forwarded-first");
        journal.answered(&user(), "forwarded-first");
        let text = std::fs::read_to_string(dir.path().join(FILE_NAME)).unwrap();
        assert_eq!(text, "");
        drop(journal);
        assert!(
            Journal::open(dir.path())
                .unwrap()
                .unrecorded_at_start()
                .is_empty()
        );
    }

    /// A forget closes its user's open notes, and no other user's: a restart does not count
    /// a forgotten user's spooled turns as taken by a crash.
    #[test]
    fn a_forget_closes_its_users_notes() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        let gone = UserKey::new("t", "gone");
        journal.answered(&gone, "gone-1");
        journal.answered(&user(), "kept");
        journal.answered(&gone, "gone-2");
        journal.forgotten(&gone);
        drop(journal);
        let reopened = Journal::open(dir.path()).unwrap();
        assert_eq!(reopened.unrecorded_at_start(), ["kept"]);
    }

    #[test]
    fn a_torn_last_line_is_read_as_far_as_it_goes() {
        assert_eq!(unrecorded("+a\n+b\n-a\n+c"), ["b", "c"]);
        assert_eq!(unrecorded("+a\n-"), ["a"]);
        assert!(unrecorded("").is_empty());
    }
}
