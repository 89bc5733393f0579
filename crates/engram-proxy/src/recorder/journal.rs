//! Answers released before their recording was durable (the receipt said `pending` or `lost`),
//! so that a restart can tell how many answered turns a crash took.
//!
//! A line per event in `<data_dir>/unrecorded.log`: `+<job key>` when such an answer goes to
//! the client, `-<job key>` when its recording became durable after all. Lines are appended
//! with one `write` each and not fsynced: they survive the process being killed (the kernel
//! holds them), not the machine losing power. At start-up every `+` without its `-` is a turn
//! answered but never recorded: counted (`engram_turns_unrecorded_at_start`), logged with its
//! job key, and the file starts over. Nothing is written for a turn whose receipt said
//! `queued` or `spooled`, which is every turn while the store keeps up.

use std::collections::HashSet;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, PoisonError};

use crate::error::Result;

/// The journal's file name in the data directory.
pub const FILE_NAME: &str = "unrecorded.log";

pub struct Journal {
    path: PathBuf,
    file: Mutex<File>,
    /// Turns answered but not recorded before this process started.
    unrecorded_at_start: Vec<String>,
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
            file: Mutex::new(file),
            unrecorded_at_start,
        })
    }

    /// The job keys of turns the previous process answered and never recorded.
    pub fn unrecorded_at_start(&self) -> &[String] {
        &self.unrecorded_at_start
    }

    /// `job_key`'s answer is going to the client before its recording is durable.
    pub fn answered(&self, job_key: &str) {
        self.append('+', job_key);
    }

    /// `job_key`'s recording, whose answer went early, is durable now.
    pub fn recorded(&self, job_key: &str) {
        self.append('-', job_key);
    }

    fn append(&self, mark: char, job_key: &str) {
        let line = format!("{mark}{job_key}\n");
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        // One write of a short line to a file opened for appending lands whole.
        if let Err(error) = file.write_all(line.as_bytes()) {
            tracing::warn!(%error, path = %self.path.display(), "could not note an unrecorded answer");
        }
    }
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

    #[test]
    fn a_restart_counts_the_answers_never_recorded_and_starts_over() {
        let dir = tempfile::tempdir().unwrap();
        let journal = Journal::open(dir.path()).unwrap();
        assert!(journal.unrecorded_at_start().is_empty());
        journal.answered("a");
        journal.answered("b");
        journal.recorded("a");
        journal.answered("c");
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

    #[test]
    fn a_torn_last_line_is_read_as_far_as_it_goes() {
        assert_eq!(unrecorded("+a\n+b\n-a\n+c"), ["b", "c"]);
        assert_eq!(unrecorded("+a\n-"), ["a"]);
        assert!(unrecorded("").is_empty());
    }
}
