//! The intake log: where a recorded answer's job is durable before the database holds it.
//!
//! A recorded answer ends once its job is durable (the receipt). In redb that took a commit
//! on the store's one writer, behind whatever job commit was running; with one user's long
//! history those take longer (p99 about 19 ms at 50,000 turns), and the receipt's wait with
//! them, while a write and `fdatasync` of a small file stays near 0.3 ms whatever the
//! history (docs/benchmarks-log.md, 2026-12-07). So on disk a job is written here first, in a
//! file of its own with its own thread, and the receipt waits for that; the database's enqueue
//! runs behind it as before, off the answer's path.
//!
//! From its placing until the database's commit holds it, a job is also kept in memory (the
//! *pending* jobs), so the session's next request sees it among the unapplied exchanges at
//! once. When the store opens, the jobs the log holds are enqueued (a job the database holds
//! already is left as it is) and the log emptied. A forget writes a tombstone first, so a
//! user's jobs logged before it are not enqueued again from the log.
//!
//! The log is two files written in turn. Each is written in place, never grown by an append:
//! it is extended with zeros a chunk at a time, and a record overwrites what is there, so a
//! record's `fdatasync` syncs its data only (an append that grew the file also committed
//! ext4's journal for the new size, behind the database's own commits). A file starts with a
//! header (a magic number and a generation), and records follow: a little-endian `u32`
//! length, a `u64` FNV-1a checksum of the generation and the payload, and the payload (the
//! JSON of a job, or of a forget's tombstone). Once the file being written is full, the log
//! turns to the other if every job logged there is settled (committed, handed back or
//! forgotten), writing a new generation into its header: its old records then fail their
//! checksums, as do zeros and a record a crash cut short (never acknowledged), and reading
//! stops at the first that fails.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::Read;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use tokio::sync::oneshot;

use super::{Job, JobId, UserKey};
use engram_memory::ExchangeInput;
use engram_runtime::error::{Error, Result};

/// The log's two files inside the data directory, written in turn.
pub const FILE_NAMES: [&str; 2] = ["intake.0.log", "intake.1.log"];

/// Once the file being written holds this much, the log turns to the other file if every job
/// logged there is settled (committed, handed back or forgotten); else it goes on in this one.
const TURN_AT: u64 = 4 << 20;

/// Each file's size from the start (zeros, synced), and how much it is extended by when a
/// write would pass its end; a file grows to about [`TURN_AT`] and is then reused.
const CHUNK: u64 = 1 << 20;

/// The header: [`MAGIC`], then the generation (little-endian `u64`).
const HEADER: u64 = 16;
const MAGIC: &[u8; 8] = b"engramIL";

/// A record's length and checksum.
const FRAME: usize = 12;

/// One record of the file, as read.
#[derive(Debug, Deserialize)]
enum Record {
    Job(Box<Job>),
    /// The user was forgotten: their jobs before it are not enqueued from the file.
    Forget(UserKey),
}

/// One record of the file, as written (the same encoding, borrowed).
#[derive(Serialize)]
enum RecordRef<'a> {
    Job(&'a Job),
    Forget(&'a UserKey),
}

/// What the log thread is asked to do, in order.
enum Message {
    Append {
        /// The record's payload (its JSON); the log thread frames it.
        payload: Vec<u8>,
        /// The append's number ([`Pending::appended`] when it was sent).
        number: u64,
        done: oneshot::Sender<Result<()>>,
    },
    /// Every append numbered up to `through` is settled: a file holding only those may be
    /// written over.
    Settled { through: u64 },
}

/// Jobs logged and not yet committed to the database.
#[derive(Default)]
struct Pending {
    /// By (tenant, user, session), oldest first: what the hot path adds to the session's
    /// unapplied exchanges.
    sessions: HashMap<(String, String, String), Vec<(u64, Job)>>,
    /// The append numbers of the jobs `sessions` holds.
    numbers: std::collections::BTreeSet<u64>,
    /// Appends sent to the log thread so far.
    appended: u64,
    /// The last [`Message::Settled`] sent.
    settled: u64,
    /// Jobs whose database enqueue failed after they were logged, oldest first, until a
    /// commit holds them ([`Intake::failed_jobs`]).
    failed: Vec<Job>,
    /// When placing last queued the failed jobs again ([`Intake::retry_due`]).
    retried_at: Option<Instant>,
}

pub struct Intake {
    pending: Mutex<Pending>,
    log: Mutex<mpsc::Sender<Message>>,
    /// Appends left to fail (`fail_next_appends`).
    #[cfg(any(test, feature = "faults"))]
    faults: std::sync::atomic::AtomicU32,
}

impl std::fmt::Debug for Intake {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_struct("Intake").finish_non_exhaustive()
    }
}

/// What the file held when the store opened.
#[derive(Debug, Default)]
pub struct Replay {
    /// The jobs to enqueue, in the order they were logged, without those of users forgotten
    /// after them.
    pub jobs: Vec<Job>,
}

impl Intake {
    /// Reads what an earlier process left in `data_dir`'s log (see [`Replay`]); the caller
    /// enqueues it and then calls [`Intake::start`], which empties the log.
    pub fn read(data_dir: &Path) -> Result<Replay> {
        let mut files: Vec<(u64, Vec<Record>)> = Vec::new();
        for name in FILE_NAMES {
            let mut bytes = Vec::new();
            match File::open(data_dir.join(name)) {
                Ok(mut file) => {
                    file.read_to_end(&mut bytes)?;
                }
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => continue,
                Err(error) => return Err(error.into()),
            }
            if let Some(generation) = header_generation(&bytes) {
                files.push((generation, parse(&bytes[HEADER as usize..], generation).0));
            }
        }
        // The older file's records came first.
        files.sort_by_key(|(generation, _)| *generation);
        let mut jobs: Vec<Job> = Vec::new();
        for record in files.into_iter().flat_map(|(_, records)| records) {
            match record {
                Record::Job(job) => jobs.push(*job),
                Record::Forget(user) => jobs.retain(|job| job.id.user != user),
            }
        }
        Ok(Replay { jobs })
    }

    /// Empties `data_dir`'s log (its jobs are in the database now: each file gets a new
    /// generation) and starts its thread.
    pub fn start(data_dir: &Path) -> Result<Arc<Intake>> {
        let (first, first_generation) = LogFile::open(&data_dir.join(FILE_NAMES[0]))?;
        let (second, second_generation) = LogFile::open(&data_dir.join(FILE_NAMES[1]))?;
        let mut log = Log {
            files: [first, second],
            active: 0,
            generation: first_generation.max(second_generation),
            settled: 0,
        };
        for at in [1, 0] {
            log.files[at].extend(CHUNK)?;
            log.generation += 1;
            log.files[at].reset(log.generation)?;
        }
        let (sender, receiver) = mpsc::channel();
        std::thread::Builder::new()
            .name("engram-intake".to_owned())
            .spawn(move || run(log, receiver))?;
        Ok(Arc::new(Intake {
            pending: Mutex::new(Pending::default()),
            log: Mutex::new(sender),
            #[cfg(any(test, feature = "faults"))]
            faults: std::sync::atomic::AtomicU32::new(0),
        }))
    }

    /// Logs `job` and keeps it pending until a database commit holds it
    /// ([`Intake::committed`]), it is handed back ([`Intake::returned`]) or its user is
    /// forgotten; the receiver says when it is durable. `None` when it is pending already (the
    /// same exchange recorded twice). A job the log cannot take is pending too, its receiver
    /// failing: the database's commit is its receipt then, and that commit writes only a job
    /// still pending ([`Intake::is_pending`]).
    pub fn log(&self, job: &Job) -> Option<oneshot::Receiver<Result<()>>> {
        let (done, receiver) = oneshot::channel();
        let payload = encode_record(&RecordRef::Job(job));
        let mut pending = self.lock();
        let session = session_key(&job.id.user, &job.exchange.session_id);
        if pending.holds(&session, &job.id) {
            return None;
        }
        pending.appended += 1;
        let number = pending.appended;
        pending
            .sessions
            .entry(session)
            .or_default()
            .push((number, job.clone()));
        pending.numbers.insert(number);
        #[cfg(any(test, feature = "faults"))]
        if self.take_fault() {
            let _ = done.send(Err(Error::Store("injected intake log failure".into())));
            return Some(receiver);
        }
        match payload {
            // Sent under the lock, so the log thread sees appends in their numbers' order.
            Ok(payload) => self.send(Message::Append {
                payload,
                number,
                done,
            }),
            Err(error) => {
                let _ = done.send(Err(error));
            }
        }
        Some(receiver)
    }

    /// Logs that `user` was forgotten and drops their pending jobs; the receiver says when the
    /// tombstone is durable.
    pub fn forget(&self, user: &UserKey) -> oneshot::Receiver<Result<()>> {
        let (done, receiver) = oneshot::channel();
        let payload = match encode_record(&RecordRef::Forget(user)) {
            Ok(payload) => payload,
            Err(error) => {
                let _ = done.send(Err(error));
                return receiver;
            }
        };
        let mut pending = self.lock();
        let mut dropped = Vec::new();
        pending.sessions.retain(|(tenant, id, _), jobs| {
            let theirs = *tenant == user.tenant && *id == user.user;
            if theirs {
                dropped.extend(jobs.iter().map(|(number, _)| *number));
            }
            !theirs
        });
        for number in dropped {
            pending.numbers.remove(&number);
        }
        pending.failed.retain(|job| job.id.user != *user);
        // A tombstone settles at once: it only matters while the jobs before it are kept.
        pending.appended += 1;
        let number = pending.appended;
        self.send(Message::Append {
            payload,
            number,
            done,
        });
        self.tell_settled(&mut pending);
        receiver
    }

    /// Whether `job` is pending: logged, and since then neither committed, handed back nor
    /// dropped by a forget of its user. The database's enqueue of a logged job writes it only
    /// then, inside its transaction: a forget that ran between the logging and that commit
    /// (its own delete behind the redb writer, or done before) would find nothing of it, and
    /// the enqueue would bring the forgotten user's turn back.
    pub fn is_pending(&self, job: &Job) -> bool {
        let session = session_key(&job.id.user, &job.exchange.session_id);
        self.lock().holds(&session, &job.id)
    }

    /// The database's commit holds `job` now: it is no longer pending.
    pub fn committed(&self, job: &JobId, session: &str) {
        let mut pending = self.lock();
        if pending.remove(job, session) {
            self.tell_settled(&mut pending);
        }
    }

    /// The database's enqueue of `job` failed: it stays pending (and in the log), among the
    /// failed ones, until a commit holds it.
    pub fn failed(&self, job: &Job) {
        let mut pending = self.lock();
        let session = session_key(&job.id.user, &job.exchange.session_id);
        if pending.holds(&session, &job.id) && !pending.failed.iter().any(|held| held.id == job.id)
        {
            pending.failed.push(job.clone());
        }
    }

    /// `job` was handed back to its caller unwritten (placing was held): the caller keeps it.
    pub fn returned(&self, job: &JobId, session: &str) {
        self.committed(job, session);
    }

    /// The jobs whose database enqueue failed and no commit holds yet, oldest first.
    pub fn failed_jobs(&self) -> Vec<Job> {
        self.lock().failed.clone()
    }

    /// Whether a job's database enqueue failed and no commit holds it yet.
    pub fn has_failed(&self) -> bool {
        !self.lock().failed.is_empty()
    }

    /// Whether placing, held by a failure, may queue the failed jobs again now: once per
    /// `every`. On a disk that stays broken, each recorded turn queued every failed job
    /// again: a burst of 1,000 turns made about 1,000 failing transactions on the one write
    /// thread (the embedded store's broken-disk test).
    pub fn retry_due(&self, now: Instant, every: Duration) -> bool {
        let mut pending = self.lock();
        let due = pending
            .retried_at
            .is_none_or(|at| now.saturating_duration_since(at) >= every);
        if due {
            pending.retried_at = Some(now);
        }
        due
    }

    /// How many jobs are pending: logged, and not yet held by a database commit.
    pub fn pending_count(&self) -> u64 {
        self.lock().numbers.len() as u64
    }

    /// Whether a job of this id is pending, in any session.
    pub fn holds_id(&self, job: &JobId) -> bool {
        self.lock()
            .sessions
            .values()
            .any(|jobs| jobs.iter().any(|(_, held)| held.id == *job))
    }

    /// The session's newest `newest` pending jobs, oldest first (each job's key with its
    /// exchange): a session's jobs commit in the order they were placed, so those not
    /// committed yet are its newest.
    pub fn session_jobs(
        &self,
        user: &UserKey,
        session: &str,
        newest: usize,
    ) -> Vec<(String, ExchangeInput)> {
        let pending = self.lock();
        if pending.numbers.is_empty() {
            return Vec::new();
        }
        pending
            .sessions
            .get(&session_key(user, session))
            .map(|jobs| {
                jobs[jobs.len().saturating_sub(newest)..]
                    .iter()
                    .map(|(_, job)| (job.id.key.clone(), job.exchange.clone()))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// Makes the next `appends` log appends fail (the `faults` feature).
    #[cfg(any(test, feature = "faults"))]
    pub fn fail_next_appends(&self, appends: u32) {
        self.faults
            .store(appends, std::sync::atomic::Ordering::SeqCst);
    }

    #[cfg(any(test, feature = "faults"))]
    fn take_fault(&self) -> bool {
        use std::sync::atomic::Ordering;
        self.faults
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
                left.checked_sub(1)
            })
            .is_ok()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Pending> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Tells the log thread how far every append is settled, when that moved: up to the
    /// oldest pending job's, or every append when none is pending.
    fn tell_settled(&self, pending: &mut Pending) {
        let through = pending
            .numbers
            .first()
            .map_or(pending.appended, |oldest| oldest - 1);
        if through > pending.settled {
            pending.settled = through;
            self.send(Message::Settled { through });
        }
    }

    /// Sends to the log thread; if it is gone (it only stops when the intake is dropped, or
    /// on a panic) an append's sender is dropped and its caller sees the log fail.
    fn send(&self, message: Message) {
        let log = self.log.lock().unwrap_or_else(PoisonError::into_inner);
        let _ = log.send(message);
    }
}

impl Pending {
    /// Whether `job` is pending in `session` (a [`session_key`]).
    fn holds(&self, session: &(String, String, String), job: &JobId) -> bool {
        self.sessions
            .get(session)
            .is_some_and(|jobs| jobs.iter().any(|(_, held)| held.id == *job))
    }

    fn remove(&mut self, job: &JobId, session: &str) -> bool {
        let key = session_key(&job.user, session);
        let Some(jobs) = self.sessions.get_mut(&key) else {
            return false;
        };
        let Some(at) = jobs.iter().position(|(_, held)| held.id == *job) else {
            return false;
        };
        let (number, _) = jobs.remove(at);
        if jobs.is_empty() {
            self.sessions.remove(&key);
        }
        self.numbers.remove(&number);
        self.failed.retain(|held| held.id != *job);
        true
    }
}

fn session_key(user: &UserKey, session: &str) -> (String, String, String) {
    (user.tenant.clone(), user.user.clone(), session.to_owned())
}

/// One of the log's files, as the log thread writes it.
struct LogFile {
    file: File,
    /// The file's length (zeros past the records).
    size: u64,
    /// In the header and in every record's checksum.
    generation: u64,
    /// Where the next record goes.
    offset: u64,
    /// The number of the last append written here.
    last: u64,
}

impl LogFile {
    /// Opens (or creates) the file at `path`, with the generation its header holds (0 when it
    /// has none); it is written from the start once reset.
    fn open(path: &Path) -> Result<(LogFile, u64)> {
        let mut file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(path)?;
        let size = file.metadata()?.len();
        let mut generation = 0;
        if size >= HEADER {
            let mut header = [0u8; HEADER as usize];
            file.read_exact(&mut header)?;
            generation = header_generation(&header).unwrap_or(0);
        }
        let log_file = LogFile {
            file,
            size,
            generation: 0,
            offset: HEADER,
            last: 0,
        };
        Ok((log_file, generation))
    }

    /// Empties the file: `generation` in its header, synced, and records from the start.
    fn reset(&mut self, generation: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let mut header = [0u8; HEADER as usize];
        header[..8].copy_from_slice(MAGIC);
        header[8..].copy_from_slice(&generation.to_le_bytes());
        self.file.write_all_at(&header, 0)?;
        self.file.sync_data()?;
        self.generation = generation;
        self.offset = HEADER;
        Ok(())
    }

    /// Makes the file at least `size` long with zeros (not a hole: a later overwrite then
    /// changes no metadata), synced.
    fn extend(&mut self, size: u64) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        if size <= self.size {
            return Ok(());
        }
        let zeros = vec![0u8; usize::try_from(size - self.size).unwrap_or(0)];
        self.file.write_all_at(&zeros, self.size)?;
        self.file.sync_all()?;
        self.size = size;
        Ok(())
    }

    /// Writes `buffer` (framed records) after the records and syncs it.
    fn append(&mut self, buffer: &[u8]) -> std::io::Result<()> {
        use std::os::unix::fs::FileExt as _;
        let end = self.offset + buffer.len() as u64;
        if end > self.size {
            self.extend(end.max(self.size + CHUNK))?;
        }
        self.file.write_all_at(buffer, self.offset)?;
        self.file.sync_data()?;
        self.offset = end;
        Ok(())
    }
}

/// The log: two files written in turn, so one can be written over once every job logged in
/// it is settled while the other takes new records.
struct Log {
    files: [LogFile; 2],
    /// The file being written.
    active: usize,
    /// The newest generation given to a file.
    generation: u64,
    /// Every append numbered up to this is settled ([`Message::Settled`]).
    settled: u64,
}

impl Log {
    /// Writes `payloads` as records (numbered up to `last`) and syncs them, first turning to
    /// the other file when this one is full and the other's appends are all settled.
    fn append(&mut self, payloads: &[Vec<u8>], last: u64) -> std::io::Result<()> {
        let other = 1 - self.active;
        if self.files[self.active].offset >= TURN_AT && self.files[other].last <= self.settled {
            self.generation += 1;
            self.files[other].reset(self.generation)?;
            self.active = other;
        }
        let file = &mut self.files[self.active];
        let mut buffer = Vec::new();
        for payload in payloads {
            let length = u32::try_from(payload.len()).map_err(|_| {
                std::io::Error::new(std::io::ErrorKind::InvalidInput, "a record too large")
            })?;
            buffer.extend_from_slice(&length.to_le_bytes());
            buffer.extend_from_slice(&checksum(file.generation, payload).to_le_bytes());
            buffer.extend_from_slice(payload);
        }
        // A failed write leaves the offset where it was: the next overwrites what it left.
        file.append(&buffer)?;
        file.last = last;
        Ok(())
    }
}

/// The log thread: takes every message waiting, writes the appends, syncs once for all of
/// them and answers them (a group commit).
fn run(mut log: Log, receiver: mpsc::Receiver<Message>) {
    while let Ok(first) = receiver.recv() {
        let mut payloads = Vec::new();
        let mut waiting = Vec::new();
        let mut last = 0;
        for message in std::iter::once(first).chain(receiver.try_iter()) {
            match message {
                Message::Append {
                    payload,
                    number,
                    done,
                } => {
                    payloads.push(payload);
                    last = number;
                    waiting.push(done);
                }
                Message::Settled { through } => log.settled = log.settled.max(through),
            }
        }
        if payloads.is_empty() {
            continue;
        }
        let result = log.append(&payloads, last);
        for done in waiting {
            let answer = match &result {
                Ok(()) => Ok(()),
                Err(error) => Err(Error::Store(format!("intake log: {error}"))),
            };
            let _ = done.send(answer);
        }
    }
}

fn encode_record(record: &RecordRef) -> Result<Vec<u8>> {
    serde_json::to_vec(record).map_err(|error| Error::Store(format!("encode: {error}")))
}

/// The generation in a header, if `bytes` start with one.
fn header_generation(bytes: &[u8]) -> Option<u64> {
    let header = bytes.get(..HEADER as usize)?;
    if &header[..8] != MAGIC {
        return None;
    }
    let mut generation = [0u8; 8];
    generation.copy_from_slice(&header[8..]);
    Some(u64::from_le_bytes(generation))
}

/// The whole records of `generation` at the start of `bytes` (the records after the header),
/// and how many bytes they took.
fn parse(bytes: &[u8], generation: u64) -> (Vec<Record>, usize) {
    let mut records = Vec::new();
    let mut at = 0;
    while let Some(frame) = bytes.get(at..at + FRAME) {
        let mut length = [0u8; 4];
        length.copy_from_slice(&frame[..4]);
        let mut sum = [0u8; 8];
        sum.copy_from_slice(&frame[4..]);
        let end = at + FRAME + u32::from_le_bytes(length) as usize;
        let Some(payload) = bytes.get(at + FRAME..end) else {
            break;
        };
        if checksum(generation, payload) != u64::from_le_bytes(sum) {
            break;
        }
        match serde_json::from_slice::<Record>(payload) {
            Ok(record) => records.push(record),
            Err(_) => break,
        }
        at = end;
    }
    (records, at)
}

/// A record's checksum: FNV-1a over its generation and its payload.
fn checksum(generation: u64, payload: &[u8]) -> u64 {
    let hash = fnv1a(0xcbf2_9ce4_8422_2325, &generation.to_le_bytes());
    fnv1a(hash, payload)
}

/// FNV-1a, 64 bits, from `hash`: enough to tell a record a crash cut short, or one of an
/// earlier generation, from a whole one.
fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for byte in bytes {
        hash ^= u64::from(*byte);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn job(user: &str, key: &str) -> Job {
        Job {
            id: JobId {
                user: UserKey::new("acme", user),
                key: key.into(),
            },
            exchange: ExchangeInput {
                session_id: "s1".into(),
                turn_id: key.into(),
                user_text: format!("{user} says {key}"),
                ..ExchangeInput::default()
            },
            trace: None,
        }
    }

    fn keys(replay: &Replay) -> Vec<&str> {
        replay.jobs.iter().map(|job| job.id.key.as_str()).collect()
    }

    /// `key`'s job as a record of `generation`, framed as the log thread writes it.
    fn framed(generation: u64, key: &str) -> Vec<u8> {
        let payload = encode_record(&RecordRef::Job(&job("ann", key))).unwrap();
        let mut bytes = (payload.len() as u32).to_le_bytes().to_vec();
        bytes.extend(checksum(generation, &payload).to_le_bytes());
        bytes.extend(payload);
        bytes
    }

    #[test]
    fn records_read_back_until_one_is_cut_short_altered_or_older() {
        let mut bytes = Vec::new();
        for key in ["a", "b", "c"] {
            bytes.extend(framed(7, key));
        }
        let whole = bytes.len();
        let (records, read) = parse(&bytes, 7);
        assert_eq!((records.len(), read), (3, whole));
        // Cut short anywhere in the last record: the first two read.
        let last = framed(7, "c").len();
        for cut in [1, 11, 12, last - 1] {
            let (records, read) = parse(&bytes[..whole - cut], 7);
            assert_eq!((records.len(), read), (2, whole - last), "cut {cut}");
        }
        // Zeros after them (the file's unwritten space) end the reading too.
        let mut zeroed = bytes.clone();
        zeroed.extend([0u8; 64]);
        assert_eq!(parse(&zeroed, 7).1, whole);
        // Records of an earlier generation (the file emptied since) are not read.
        let mut reused = framed(8, "d");
        reused.extend(&bytes);
        assert_eq!(parse(&reused, 8).0.len(), 1);
        assert_eq!(parse(&bytes, 8).0.len(), 0);
        // A changed byte in the second record's payload ends the reading before it.
        let first = framed(7, "a").len();
        bytes[first + 20] ^= 1;
        assert_eq!(parse(&bytes, 7).0.len(), 1);
    }

    #[tokio::test]
    async fn a_forget_drops_the_users_jobs_logged_before_it_only() {
        let dir = tempfile::tempdir().unwrap();
        let log = Intake::start(dir.path()).unwrap();
        for logged in [job("ann", "a1"), job("bob", "b1"), job("ann", "a2")] {
            log.log(&logged).unwrap().await.unwrap().unwrap();
        }
        log.forget(&UserKey::new("acme", "ann"))
            .await
            .unwrap()
            .unwrap();
        assert!(
            log.session_jobs(&UserKey::new("acme", "ann"), "s1", 8)
                .is_empty()
        );
        log.log(&job("ann", "a3")).unwrap().await.unwrap().unwrap();
        drop(log);
        let replay = Intake::read(dir.path()).unwrap();
        assert_eq!(keys(&replay), ["b1", "a3"]);
    }

    #[tokio::test]
    async fn a_job_is_pending_until_committed_and_logged_once() {
        let dir = tempfile::tempdir().unwrap();
        let log = Intake::start(dir.path()).unwrap();
        let first = job("ann", "a1");
        log.log(&first).unwrap().await.unwrap().unwrap();
        // The same exchange again while it is pending: not logged twice.
        assert!(log.log(&first).is_none());
        let ann = UserKey::new("acme", "ann");
        assert_eq!(log.session_jobs(&ann, "s1", 8).len(), 1);
        assert!(log.holds_id(&first.id));
        log.failed(&first);
        log.failed(&first);
        assert_eq!(log.failed_jobs(), std::slice::from_ref(&first));
        log.committed(&first.id, "s1");
        assert!(!log.holds_id(&first.id));
        assert!(log.failed_jobs().is_empty());
        assert!(log.session_jobs(&ann, "s1", 8).is_empty());
        // The hot path takes a session's newest pending jobs only.
        for key in ["a2", "a3", "a4"] {
            log.log(&job("ann", key)).unwrap().await.unwrap().unwrap();
        }
        let newest: Vec<String> = log
            .session_jobs(&ann, "s1", 2)
            .into_iter()
            .map(|(key, _)| key)
            .collect();
        assert_eq!(newest, ["a3", "a4"]);
    }

    fn big(key: &str) -> Job {
        let small = job("ann", key);
        Job {
            exchange: ExchangeInput {
                user_text: "x".repeat(TURN_AT as usize),
                ..small.exchange.clone()
            },
            ..small
        }
    }

    /// The log turns to its other file once the one it writes is full and every job logged
    /// in the other is settled; the files stay the size they grew to.
    #[tokio::test]
    async fn the_log_writes_over_a_file_once_its_jobs_are_settled() {
        let dir = tempfile::tempdir().unwrap();
        let log = Intake::start(dir.path()).unwrap();
        let read = || keys(&Intake::read(dir.path()).unwrap()).join(" ");
        let first = big("a1");
        for logged in [first.clone(), job("ann", "a2"), job("ann", "a3")] {
            log.log(&logged).unwrap().await.unwrap().unwrap();
        }
        // a1 filled the first file; a2 and a3 went to the second.
        assert_eq!(read(), "a1 a2 a3");
        for logged in [big("a4"), job("ann", "a5")] {
            log.log(&logged).unwrap().await.unwrap().unwrap();
        }
        // The second is full too, but a1 is pending: the first is not written over.
        assert_eq!(read(), "a1 a2 a3 a4 a5");
        log.committed(&first.id, "s1");
        log.log(&job("ann", "a6")).unwrap().await.unwrap().unwrap();
        assert_eq!(read(), "a2 a3 a4 a5 a6");
        let sizes: Vec<u64> = FILE_NAMES
            .iter()
            .map(|name| std::fs::metadata(dir.path().join(name)).unwrap().len())
            .collect();
        for size in sizes {
            assert!(size <= TURN_AT + 2 * CHUNK, "{size}");
        }
        // Started again, the log is empty.
        drop(log);
        drop(Intake::start(dir.path()).unwrap());
        assert_eq!(read(), "");
    }
}
