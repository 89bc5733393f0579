//! The default store: one redb file in the data directory, zero setup.
//!
//! Every write is one committed redb transaction (durability `Immediate`: fsync before commit
//! returns), so a killed process loses nothing it reported as written. The one exception is a
//! claim's lease, committed without fsync: losing it in a crash only frees the job earlier. redb calls block, so
//! each runs on tokio's blocking pool. A placed job is durable earlier, in the intake log
//! beside the file (see `intake`), and pending in memory until its commit.
//!
//! Keys are redb tuples beginning with `(tenant, user)`, so no escaping is needed and a user's
//! records of one kind are one contiguous range.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use redb::{
    Database, Durability, ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition,
    TableHandle, WriteTransaction,
};
use serde::{Deserialize, Serialize};

use super::db_handle::DbHandle;
use super::group_commit::{Committed, GroupCommit};
use super::intake::{Intake, Replay};
use super::layout::{self, Change, Delta, ItemKey, ItemKind, MemoryUpdate, Stored};
use super::{
    Appended, ClaimedJob, CommitListener, EncodedState, Enqueued, ForgetReport, HotRecord, Job,
    JobId, JobQueue, JobState, MemoryRecords, Placement, RawEntry, Store, UNAPPLIED_BYTES,
    UNAPPLIED_TURNS, UserKey, commit_owner, decode, now_ms,
};
use crate::TraceParent;
use engram_memory::{CandidateId, ExchangeInput, MemoryState};
use engram_runtime::BoxFuture;
use engram_runtime::error::{Error, Result};

/// The file name inside the data directory.
pub const FILE_NAME: &str = "engram.redb";
/// How long a recorder's enqueue waits for others to share its commit, unless configured
/// (`store.group_commit_ms`). A durable commit costs an fsync; at 1,000 recorded requests/s one
/// commit per enqueue took ~15 % of the proxy's CPU samples, 7 % with a 2 ms wait, when no
/// client waited for it. Now the end of a recorded answer waits for its commit, and enqueues
/// arriving while a commit runs share the next one anyway: no wait (docs/benchmarks-log.md).
const ENQUEUE_LINGER: Duration = Duration::ZERO;

/// While a logged job's enqueue has failed, placing queues the failed jobs again at most this
/// often (each placed turn asked it to; the spool's forwarder retries on its own pace).
const PLACE_RETRY_EVERY: Duration = Duration::from_millis(100);

/// (tenant, user) → the memory state as JSON.
const STATES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("memory_state");
/// A memory's items (see `layout`): (tenant, user, kind, position) -> JSON.
const ITEMS: TableDefinition<(&str, &str, u8, u32), &[u8]> = TableDefinition::new("memory_items");
/// A memory's change ring as one value, one `layout::Change` a line: what releases before
/// `CHANGE_LOG` wrote. Never read; the table is dropped whole when the store opens.
const CHANGES: TableDefinition<(&str, &str), &[u8]> = TableDefinition::new("memory_changes");
/// A memory's change ring, one row a write: (tenant, user, version written) -> the encoded
/// `layout::Change`; the newest `layout::RING` are kept. A write adds one row instead of
/// rewriting the whole ring (64 lines of every item each write touched: about 34 KB a job for
/// a user whose turns each touch ~80 items), and a reader one write behind reads one row.
const CHANGE_LOG: TableDefinition<(&str, &str, u64), &[u8]> =
    TableDefinition::new("memory_change_log");
/// (tenant, user) → memory version; kept apart so the hot path reads it without the state.
const VERSIONS: TableDefinition<(&str, &str), u64> = TableDefinition::new("memory_version");
/// (tenant, user, session) → prefetched candidates as JSON.
const PREFETCHED: TableDefinition<(&str, &str, &str), &[u8]> = TableDefinition::new("prefetched");
/// (tenant, user, seq) → raw entry as JSON.
const RAW_LOG: TableDefinition<(&str, &str, u64), &[u8]> = TableDefinition::new("raw_log");
/// (tenant, user, exchange id) → seq, for idempotent appends.
const RAW_IDS: TableDefinition<(&str, &str, &str), u64> = TableDefinition::new("raw_log_ids");
/// (tenant, user, job key) → job record as JSON.
const JOBS: TableDefinition<(&str, &str, &str), &[u8]> = TableDefinition::new("jobs");
/// (tenant, user, job key) → a job's exchange as JSON, while it is queued or leased, or after it
/// failed. Kept apart from the record so a lease or a finish rewrites a few bytes, not the
/// exchange (a pasted document makes it megabytes); removed when the job is applied (the raw
/// log has it then).
const JOB_EXCHANGES: TableDefinition<(&str, &str, &str), &[u8]> =
    TableDefinition::new("job_exchanges");
/// queue position → (tenant, user, job key) of a queued job; a job leaves on ack or fail.
const QUEUE: TableDefinition<u64, (&str, &str, &str)> = TableDefinition::new("job_queue");
/// (tenant, user, session, queue position) → job key of a job still queued: the session's
/// recorded exchanges the worker has not applied yet, which the hot path reads (see
/// `HotRecord::unapplied`), and by which a claim finds a session's jobs. Jobs queued before it
/// existed join it when the store opens (`index_queue`).
const SESSION_QUEUE: TableDefinition<(&str, &str, &str, u64), &str> =
    TableDefinition::new("session_queue");
/// queue position → (tenant, user, session) of each session's oldest queued job: the sessions
/// a claim looks at, oldest first, without walking the jobs queued behind a busy session's head
/// (a claim walked the whole queue and decoded each job's record: O(backlog) per claim, which
/// with one user sending fast was most of the worker's time). Rebuilt from `SESSION_QUEUE` when
/// the store opens (see `index_queue`).
const SESSION_HEADS: TableDefinition<u64, (&str, &str, &str)> =
    TableDefinition::new("job_session_heads");
/// Named counters (the next queue position).
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");

const NEXT_QUEUE_POSITION: &str = "next_queue_position";

#[derive(Debug, Serialize, Deserialize)]
struct JobRecord {
    queue_position: u64,
    state: JobState,
    /// Claims so far.
    attempts: u32,
    #[serde(default)]
    lease: Option<Lease>,
    /// The job's session, so a claim can keep a session's jobs in order without reading their
    /// exchanges. Absent in records written before it, which hold the exchange instead.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    session: Option<String>,
    /// Records written before `JOB_EXCHANGES` hold the exchange here; a claim moves it there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    exchange: Option<ExchangeInput>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    trace: Option<TraceParent>,
}

impl JobRecord {
    /// Moves the exchange of a record written before `JOB_EXCHANGES` into that table under
    /// `key`, noting its session, and returns it; `None` for a record without one.
    fn set_aside_exchange(
        &mut self,
        exchanges: &mut redb::Table<(&'static str, &'static str, &'static str), &'static [u8]>,
        key: (&str, &str, &str),
    ) -> Result<Option<ExchangeInput>> {
        let Some(exchange) = self.exchange.take() else {
            return Ok(None);
        };
        self.session = Some(exchange.session_id.clone());
        exchanges
            .insert(key, encode(&exchange)?.as_slice())
            .map_err(db_error)?;
        Ok(Some(exchange))
    }

    fn session(&self) -> &str {
        match (&self.session, &self.exchange) {
            (Some(session), _) => session,
            (None, Some(exchange)) => &exchange.session_id,
            (None, None) => "",
        }
    }
}

/// A [`RawEntry`] as written, borrowing the exchange (it can be megabytes).
#[derive(Serialize)]
struct RawEntryRef<'a> {
    seq: u64,
    exchange_id: &'a str,
    exchange: &'a ExchangeInput,
}

#[derive(Debug, Serialize, Deserialize)]
struct Lease {
    consumer: String,
    /// Milliseconds since the Unix epoch at which another consumer may take the job.
    until_ms: u64,
}

#[derive(Clone)]
pub struct EmbeddedStore {
    /// Reopened after an I/O error (see `db_handle`).
    db: Arc<DbHandle>,
    /// Recorders' enqueues and workers' job commits, group-committed together (see
    /// `group_commit`) on the store's one normal-priority write thread (on disk).
    writes: Arc<GroupCommit<Write, Written>>,
    /// Told of each job commit on the committing thread (see [`CommitListener`]).
    listener: Option<Arc<dyn CommitListener>>,
    /// Where a recorded job is durable before the database's commit holds it (on disk; see
    /// `intake`).
    intake: Option<Arc<Intake>>,
}

impl std::fmt::Debug for EmbeddedStore {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("EmbeddedStore")
            .field("path", &self.db.path())
            .finish_non_exhaustive()
    }
}

impl EmbeddedStore {
    /// Opens (or creates) `engram.redb` in `data_dir`, creating the directory if needed.
    /// Blocking; call it at start-up.
    pub fn open(data_dir: &Path) -> Result<EmbeddedStore> {
        EmbeddedStore::open_with_linger(data_dir, ENQUEUE_LINGER)
    }

    /// [`EmbeddedStore::open`] whose enqueues wait `linger` for company (group commit).
    pub fn open_with_linger(data_dir: &Path, linger: Duration) -> Result<EmbeddedStore> {
        EmbeddedStore::open_with(data_dir, linger, true)
    }

    /// A spool on disk (Redis's, see `engram_proxy::recorder::outbox`): a store without the
    /// intake log, whose receipts wait for the database's commit. A spool's forwarded jobs
    /// leave its database, so a log replayed after them could queue them again.
    pub fn open_spool(data_dir: &Path, linger: Duration) -> Result<EmbeddedStore> {
        EmbeddedStore::open_with(data_dir, linger, false)
    }

    fn open_with(data_dir: &Path, linger: Duration, logged: bool) -> Result<EmbeddedStore> {
        std::fs::create_dir_all(data_dir)?;
        let db = DbHandle::open(&data_dir.join(FILE_NAME), create_tables)?;
        if let Some(database) = db.current() {
            let converted = convert_legacy(&database)?;
            if converted > 0 {
                tracing::info!(
                    memories = converted,
                    "converted memories stored as one value to the item layout"
                );
            }
            let indexed = index_queue(&database)?;
            if indexed > 0 {
                tracing::info!(
                    jobs = indexed,
                    "indexed queued jobs by session (queued by an earlier release)"
                );
            }
            let released = release_leases(&database)?;
            if released > 0 {
                tracing::info!(
                    jobs = released,
                    "released the leases of jobs a previous process was applying"
                );
            }
            let replay = if logged {
                Intake::read(data_dir)?
            } else {
                Replay::default()
            };
            let enqueued = enqueue_logged(&database, &replay.jobs)?;
            if enqueued > 0 {
                tracing::info!(
                    jobs = enqueued,
                    "queued the jobs the intake log held (recorded before the process stopped)"
                );
            }
        }
        // Started only once what the log held is in the database: starting empties the file.
        let intake = match db.current() {
            Some(_) if logged => Some(Intake::start(data_dir)?),
            _ => None,
        };
        Ok(EmbeddedStore {
            intake,
            db: Arc::new(db),
            // One group commit for both, at normal priority: each holds redb's one write lock,
            // so as two they took turns, and a recorded answer's enqueue could wait for a job
            // commit's fsync and then for its own; together a round's one fsync serves both
            // (docs/benchmarks-log.md, 2026-12-05).
            writes: GroupCommit::in_background(write_one, linger, "engram-writer")?,
            listener: None,
        })
    }

    /// A store in memory, lost with the process: the embedded backend's spool, which keeps
    /// recorded exchanges while the store on disk refuses writes.
    pub fn in_memory() -> Result<EmbeddedStore> {
        Ok(EmbeddedStore {
            db: Arc::new(DbHandle::in_memory(create_tables)?),
            writes: GroupCommit::new(write_one),
            listener: None,
            intake: None,
        })
    }

    /// The store, telling `listener` of each job commit once it is durable, on the thread
    /// that committed it and before the commit is answered.
    pub fn with_commit_listener(mut self, listener: Arc<dyn CommitListener>) -> EmbeddedStore {
        self.listener = Some(listener);
        self
    }

    /// The session's jobs only the intake log holds yet, oldest first, with their keys.
    fn logged(&self, user: &UserKey, session_id: &str) -> Vec<(String, ExchangeInput)> {
        self.intake
            .as_ref()
            .map(|intake| intake.session_jobs(user, session_id, UNAPPLIED_TURNS))
            .unwrap_or_default()
    }

    /// Queues again the logged jobs whose database enqueue failed, oldest first, in one write
    /// not held by the failure (they were answered `queued`, so they come before anything
    /// recorded after them); what says when they are committed, if there are any. If it
    /// fails they stay failed, for the next call (or a restart, which enqueues them from the
    /// log). One write, not one each: a first that failed again alone let the second commit
    /// ahead of it, and a session's turns reached the queue swapped (a full disk freed between
    /// the two commits, `faults::a_full_disk_…` in CI).
    fn retry_logged(&self) -> Option<BoxFuture<'static, Result<Written>>> {
        let intake = self.intake.as_ref()?;
        let failed = intake.failed_jobs();
        if failed.is_empty() {
            return None;
        }
        let write = Write::Retry(failed, Arc::clone(intake));
        Some(self.writes.queue_now(&self.db, write))
    }

    /// Whether the database holds a job of this id (queued, applied or failed): then the
    /// job is not logged, and not shown as pending beside the applied one. On an error,
    /// `false`: the database's enqueue finds the job then, and writes nothing.
    fn holds_job(&self, id: &JobId) -> bool {
        let Some(db) = self.db.current() else {
            return false;
        };
        let Ok(txn) = db.begin_read() else {
            return false;
        };
        let Ok(jobs) = txn.open_table(JOBS) else {
            return false;
        };
        matches!(jobs.get(job_key(id)), Ok(Some(_)))
    }

    /// The database file; `None` in memory.
    pub fn path(&self) -> Option<&Path> {
        self.db.path()
    }

    /// Deletes the records of jobs no longer queued (applied or failed), with their exchanges;
    /// how many. For a spool only, once, at start-up: releases before `clear_forwarded` kept
    /// an applied record of every job a spool forwarded, for good. (A store's own records
    /// answer reads of a job's state, and stay.)
    pub async fn drop_finished_jobs(&self) -> Result<u64> {
        self.blocking_write(|db| {
            let txn = db.begin_write().map_err(db_error)?;
            let mut finished: Vec<JobId> = Vec::new();
            {
                let jobs = txn.open_table(JOBS).map_err(db_error)?;
                for entry in jobs.iter().map_err(db_error)? {
                    let (key, record) = entry.map_err(db_error)?;
                    let record: JobRecord = decode(record.value())?;
                    if record.state != JobState::Queued {
                        let (tenant, user, job) = key.value();
                        finished.push(JobId {
                            user: UserKey::new(tenant, user),
                            key: job.to_owned(),
                        });
                    }
                }
            }
            if finished.is_empty() {
                return Ok(0);
            }
            for id in &finished {
                write_clear(&txn, id)?;
            }
            txn.commit().map_err(db_error)?;
            Ok(finished.len() as u64)
        })
        .await
    }

    /// Bytes of the turn texts (the user's message and the answer) of the jobs queued or
    /// leased: what a spool left by an earlier process holds, for its bound. Reads every
    /// such job's exchange, so call it once, at start-up.
    pub async fn queued_turn_bytes(&self) -> Result<u64> {
        self.blocking(|db| {
            let txn = db.begin_read().map_err(db_error)?;
            let queue = txn.open_table(QUEUE).map_err(db_error)?;
            let jobs = txn.open_table(JOBS).map_err(db_error)?;
            let exchanges = txn.open_table(JOB_EXCHANGES).map_err(db_error)?;
            let mut bytes = 0u64;
            for entry in queue.iter().map_err(db_error)? {
                let (_, key) = entry.map_err(db_error)?;
                let key = key.value();
                let exchange: Option<ExchangeInput> = match exchanges.get(key).map_err(db_error)? {
                    Some(row) => Some(decode(row.value())?),
                    // A record written before `JOB_EXCHANGES` holds its exchange.
                    None => decode_job(jobs.get(key).map_err(db_error)?)?
                        .and_then(|record| record.exchange),
                };
                if let Some(exchange) = exchange {
                    bytes = bytes.saturating_add(exchange.text_bytes() as u64);
                }
            }
            Ok(bytes)
        })
        .await
    }

    /// Makes the next `commits` transactions of the write thread fail (tests: a disk error
    /// mid-stream; the `faults` feature). Enqueues and job commits share them: a job commit
    /// committing meanwhile takes its share of the failures. The next `commits` appends to the
    /// intake log fail too, so a failing disk fails the receipt.
    #[cfg(any(test, feature = "faults"))]
    pub fn fail_next_enqueue_commits(&self, commits: u32) {
        self.writes.fail_next_commits(commits);
        if let Some(intake) = &self.intake {
            intake.fail_next_appends(commits);
        }
    }

    /// Makes each injected commit failure take `delay` on the write thread first (the
    /// `faults` feature).
    #[cfg(any(test, feature = "faults"))]
    pub fn delay_failed_commits(&self, delay: Duration) {
        self.writes.delay_failures(delay);
    }

    /// Runs a blocking redb read on the caller's runtime's blocking pool; writes go through
    /// [`EmbeddedStore::blocking_write`].
    fn blocking<T, F>(&self, operation: F) -> BoxFuture<'static, Result<T>>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T> + Send + 'static,
    {
        self.blocking_on(None, operation)
    }

    /// A redb write transaction (a claim, a finish, a raw-log append, a state or prefetch save,
    /// a forget), run on the thread of the job commits at normal priority whoever asks:
    /// on the worker's idle-priority pool it could hold redb's one write lock while the
    /// requests keep the core, and every recorded answer's enqueue would wait.
    fn blocking_write<T, F>(&self, operation: F) -> BoxFuture<'static, Result<T>>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T> + Send + 'static,
    {
        self.blocking_on(self.writes.thread().cloned(), operation)
    }

    /// Runs `operation` on `thread`'s blocking pool, or the caller's runtime's.
    fn blocking_on<T, F>(
        &self,
        thread: Option<tokio::runtime::Handle>,
        operation: F,
    ) -> BoxFuture<'static, Result<T>>
    where
        T: Send + 'static,
        F: FnOnce(&Database) -> Result<T> + Send + 'static,
    {
        let handle = Arc::clone(&self.db);
        let run = move || {
            let db = handle.get_or_reopen()?;
            let result = operation(&db);
            if matches!(result, Err(Error::Store(_))) {
                handle.recover(db);
            }
            result
        };
        Box::pin(async move {
            match thread {
                Some(thread) => thread.spawn_blocking(run).await,
                None => tokio::task::spawn_blocking(run).await,
            }
            .map_err(|error| Error::Store(format!("store task failed: {error}")))?
        })
    }

    /// One transaction, one fsync, shared with the other workers' commits.
    async fn commit(
        &self,
        jobs: &[Job],
        state: &EncodedState,
        expected: u64,
        prefetched: &[CandidateId],
    ) -> Result<()> {
        let commit = JobCommit {
            jobs: jobs.to_vec(),
            state: state.clone(),
            expected,
            prefetched: encode(prefetched)?,
            listener: self.listener.clone(),
        };
        match self.writes.submit(&self.db, Write::Commit(commit)).await? {
            Written::Committed => Ok(()),
            Written::Enqueued(_) => Err(mismatched_write()),
        }
    }
}

/// The hot-path read in one read transaction. `None` when the caller would need the whole
/// memory and `read_whole` is false: decoding a whole memory takes milliseconds, never on a
/// request thread (the items changed since the caller's version are a few, and are read here).
fn read_hot_record(
    db: &Database,
    user: &UserKey,
    session_id: &str,
    cached_version: Option<u64>,
    read_whole: bool,
    logged: Vec<(String, ExchangeInput)>,
) -> Result<Option<HotRecord>> {
    // `logged` was read before this snapshot: a job a commit took from it since is here.
    let txn = db.begin_read().map_err(db_error)?;
    let key = (user.tenant.as_str(), user.user.as_str());
    let version = txn
        .open_table(VERSIONS)
        .map_err(db_error)?
        .get(key)
        .map_err(db_error)?
        .map_or(0, |guard| guard.value());
    let mut bytes_read = 0;
    let update = if version == 0 || cached_version == Some(version) {
        None
    } else {
        let states = txn.open_table(STATES).map_err(db_error)?;
        let items = txn.open_table(ITEMS).map_err(db_error)?;
        let changed = match cached_version {
            Some(cached) => {
                let ring = read_ring(
                    &txn.open_table(CHANGE_LOG).map_err(db_error)?,
                    key,
                    cached,
                    version,
                )?;
                layout::changed_between(&ring, cached, version)
            }
            None => None,
        };
        match changed {
            Some(changed) => {
                let (delta, bytes) = read_delta(&states, &items, key, &changed)?;
                bytes_read += bytes;
                Some(MemoryUpdate::Delta(delta))
            }
            None if read_whole => read_memory(&states, &items, key)?.map(|(state, bytes)| {
                bytes_read += bytes;
                MemoryUpdate::Whole(Box::new(state))
            }),
            None => return Ok(None),
        }
    };
    let prefetched = match txn
        .open_table(PREFETCHED)
        .map_err(db_error)?
        .get((key.0, key.1, session_id))
        .map_err(db_error)?
    {
        Some(guard) => {
            bytes_read += guard.value().len();
            decode::<Vec<CandidateId>>(guard.value())?
        }
        None => Vec::new(),
    };
    let unapplied = read_unapplied(&txn, key, session_id, logged, &mut bytes_read)?;
    Ok(Some(HotRecord {
        version,
        update,
        prefetched,
        unapplied,
        bytes_read: u64::try_from(bytes_read).unwrap_or(u64::MAX),
    }))
}

/// The session's queued exchanges, oldest first (see `HotRecord::unapplied`): those the
/// database holds and, after them, those only the intake log holds yet (`logged`, each with
/// its job key, oldest first); one seek when there are none.
fn read_unapplied(
    txn: &redb::ReadTransaction,
    key: UserKeyRef,
    session_id: &str,
    logged: Vec<(String, ExchangeInput)>,
    bytes_read: &mut usize,
) -> Result<Vec<ExchangeInput>> {
    let session_queue = txn.open_table(SESSION_QUEUE).map_err(db_error)?;
    let range = (key.0, key.1, session_id, 0)..=(key.0, key.1, session_id, u64::MAX);
    let mut rows = session_queue
        .range(range)
        .map_err(db_error)?
        .rev()
        .peekable();
    if rows.peek().is_none() && logged.is_empty() {
        return Ok(Vec::new());
    }
    let exchanges = txn.open_table(JOB_EXCHANGES).map_err(db_error)?;
    // Newest first: the logged jobs the database does not hold yet (a commit may have taken
    // some since they were read), then the database's.
    let mut newest_first: Vec<(usize, ExchangeInput)> = Vec::new();
    for (job, exchange) in logged.into_iter().rev() {
        if exchanges
            .get((key.0, key.1, job.as_str()))
            .map_err(db_error)?
            .is_none()
        {
            newest_first.push((exchange.text_bytes(), exchange));
        }
    }
    let mut taken: usize = newest_first.iter().map(|(bytes, _)| bytes).sum();
    if newest_first.len() < UNAPPLIED_TURNS && taken < UNAPPLIED_BYTES {
        for row in rows.take(UNAPPLIED_TURNS - newest_first.len()) {
            let (_, job) = row.map_err(db_error)?;
            let Some(guard) = exchanges
                .get((key.0, key.1, job.value()))
                .map_err(db_error)?
            else {
                continue;
            };
            taken += guard.value().len();
            *bytes_read += guard.value().len();
            newest_first.push((0, decode::<ExchangeInput>(guard.value())?));
            if taken >= UNAPPLIED_BYTES {
                break;
            }
        }
    }
    newest_first.truncate(UNAPPLIED_TURNS);
    Ok(newest_first
        .into_iter()
        .rev()
        .map(|(_, exchange)| exchange)
        .collect())
}

type UserKeyRef<'k> = (&'k str, &'k str);

/// The ring's entries that wrote a version after `cached`, up to `version`, oldest first.
fn read_ring(
    log: &impl ReadableTable<(&'static str, &'static str, u64), &'static [u8]>,
    key: UserKeyRef,
    cached: u64,
    version: u64,
) -> Result<Vec<Change>> {
    let mut ring = Vec::new();
    if cached >= version {
        return Ok(ring);
    }
    for row in log
        .range((key.0, key.1, cached + 1)..=(key.0, key.1, version))
        .map_err(db_error)?
    {
        let (_, text) = row.map_err(db_error)?;
        if let Some(change) = Change::decode(&String::from_utf8_lossy(text.value())) {
            ring.push(change);
        }
    }
    Ok(ring)
}

/// The hot state and the listed items.
fn read_delta(
    states: &impl ReadableTable<(&'static str, &'static str), &'static [u8]>,
    table: &impl ReadableTable<(&'static str, &'static str, u8, u32), &'static [u8]>,
    key: UserKeyRef,
    items: &std::collections::BTreeSet<ItemKey>,
) -> Result<(Delta, usize)> {
    let Some(guard) = states.get(key).map_err(db_error)? else {
        return Err(Error::Store("memory version without its hot state".into()));
    };
    let mut bytes = guard.value().len();
    let Stored::Meta(meta) = Stored::decode(guard.value())? else {
        return Err(Error::Store(
            "a memory in the earlier layout has a change ring".into(),
        ));
    };
    let mut read = Vec::with_capacity(items.len());
    for item in items {
        let found = table
            .get((key.0, key.1, item.kind.code(), item.pos))
            .map_err(db_error)?;
        match found {
            Some(json) => {
                bytes += json.value().len();
                read.push((*item, json.value().to_vec()));
            }
            None => {
                return Err(Error::Store(format!(
                    "memory item {} is missing",
                    item.field()
                )));
            }
        }
    }
    Ok((Delta { meta, items: read }, bytes))
}

/// The whole memory of `key`, from its hot state and every item.
fn read_memory(
    states: &impl ReadableTable<(&'static str, &'static str), &'static [u8]>,
    table: &impl ReadableTable<(&'static str, &'static str, u8, u32), &'static [u8]>,
    key: UserKeyRef,
) -> Result<Option<(MemoryState, usize)>> {
    let Some(guard) = states.get(key).map_err(db_error)? else {
        return Ok(None);
    };
    let mut bytes = guard.value().len();
    let meta = match Stored::decode(guard.value())? {
        Stored::Meta(meta) => meta,
        Stored::Legacy(state) => return Ok(Some((*state, bytes))),
    };
    // The range yields items in key order (kind, then position), so each is placed as it is
    // read rather than copied out first.
    let mut assembly = layout::Assembly::new();
    for row in table
        .range((key.0, key.1, 0u8, 0u32)..=(key.0, key.1, u8::MAX, u32::MAX))
        .map_err(db_error)?
    {
        let (item, json) = row.map_err(db_error)?;
        let (_, _, kind, pos) = item.value();
        let Some(kind) = ItemKind::from_code(kind) else {
            return Err(Error::Store(format!("unknown memory item kind {kind}")));
        };
        bytes += json.value().len();
        assembly.place(ItemKey { kind, pos }, json.value())?;
    }
    let state = assembly.finish(meta)?;
    Ok(Some((state, bytes)))
}

/// Rewrites every memory stored by an earlier release as one value into the layout of
/// `layout` (hot state and items), each in its own transaction; returns how many. Runs when
/// the store opens.
fn convert_legacy(db: &Database) -> Result<usize> {
    let legacy: Vec<(String, String)> = {
        let txn = db.begin_read().map_err(db_error)?;
        let states = txn.open_table(STATES).map_err(db_error)?;
        let mut keys = Vec::new();
        for row in states.iter().map_err(db_error)? {
            let (key, value) = row.map_err(db_error)?;
            if matches!(Stored::decode(value.value())?, Stored::Legacy(_)) {
                let (tenant, user) = key.value();
                keys.push((tenant.to_owned(), user.to_owned()));
            }
        }
        keys
    };
    for (tenant, user) in &legacy {
        let txn = db.begin_write().map_err(db_error)?;
        {
            let key = (tenant.as_str(), user.as_str());
            let state = {
                let states = txn.open_table(STATES).map_err(db_error)?;
                let items = txn.open_table(ITEMS).map_err(db_error)?;
                read_memory(&states, &items, key)?
            };
            if let Some((state, _)) = state {
                let encoded = EncodedState::of(&state)?;
                write_layout(&txn, key, &encoded, None)?;
            }
        }
        txn.commit().map_err(db_error)?;
    }
    Ok(legacy.len())
}

/// Enqueues the jobs an earlier process left in the intake log, in their order, in one
/// durable commit; a job the database holds already is left as it is. How many were queued.
fn enqueue_logged(db: &Database, jobs: &[Job]) -> Result<usize> {
    if jobs.is_empty() {
        return Ok(0);
    }
    let txn = db.begin_write().map_err(db_error)?;
    let mut queued = 0;
    for job in jobs {
        if matches!(write_enqueue(&txn, job)?, Enqueued::Queued) {
            queued += 1;
        }
    }
    txn.commit().map_err(db_error)?;
    Ok(queued)
}

/// Completes the queue's indexes when the store opens, and returns how many jobs it added: a
/// job queued by a release before `SESSION_QUEUE` joins it, and `SESSION_HEADS` is rebuilt
/// from it (a release before the heads kept the session index but not them). Walks the
/// session index (and, only when it misses jobs, the queue), without decoding an exchange.
fn index_queue(db: &Database) -> Result<usize> {
    let txn = db.begin_write().map_err(db_error)?;
    let mut added = 0;
    {
        let queue = txn.open_table(QUEUE).map_err(db_error)?;
        let jobs = txn.open_table(JOBS).map_err(db_error)?;
        let mut session_queue = txn.open_table(SESSION_QUEUE).map_err(db_error)?;
        if session_queue.len().map_err(db_error)? != queue.len().map_err(db_error)? {
            for row in queue.iter().map_err(db_error)? {
                let (position, value) = row.map_err(db_error)?;
                let (tenant, user, key) = value.value();
                let Some(record) = decode_job(jobs.get((tenant, user, key)).map_err(db_error)?)?
                else {
                    continue;
                };
                let index = (tenant, user, record.session(), position.value());
                if session_queue.get(index).map_err(db_error)?.is_none() {
                    session_queue.insert(index, key).map_err(db_error)?;
                    added += 1;
                }
            }
        }
        let mut heads = txn.open_table(SESSION_HEADS).map_err(db_error)?;
        heads.retain(|_, _| false).map_err(db_error)?;
        let mut previous: Option<(String, String, String)> = None;
        for row in session_queue.iter().map_err(db_error)? {
            let (index, _) = row.map_err(db_error)?;
            let (tenant, user, session, position) = index.value();
            let same = previous.as_ref().is_some_and(|(t, u, s)| {
                (t.as_str(), u.as_str(), s.as_str()) == (tenant, user, session)
            });
            if !same {
                heads
                    .insert(position, (tenant, user, session))
                    .map_err(db_error)?;
                previous = Some((tenant.to_owned(), user.to_owned(), session.to_owned()));
            }
        }
    }
    txn.commit().map_err(db_error)?;
    Ok(added)
}

/// Clears every lease. The file is open in one process at a time, so a lease found at open
/// belongs to a process that is gone (killed mid-job): its jobs are free at once instead of
/// after the lease, which would hold each of their sessions back for `worker.lease_ms`.
fn release_leases(db: &Database) -> Result<usize> {
    let txn = db.begin_write().map_err(db_error)?;
    let mut released = 0;
    {
        let queue = txn.open_table(QUEUE).map_err(db_error)?;
        let mut jobs = txn.open_table(JOBS).map_err(db_error)?;
        for row in queue.iter().map_err(db_error)? {
            let (_, value) = row.map_err(db_error)?;
            let key = value.value();
            let Some(mut record) = decode_job(jobs.get(key).map_err(db_error)?)? else {
                continue;
            };
            if record.lease.take().is_some() {
                jobs.insert(key, encode(&record)?.as_slice())
                    .map_err(db_error)?;
                released += 1;
            }
        }
    }
    txn.commit().map_err(db_error)?;
    Ok(released)
}

/// Creates every table up front, so read transactions never meet a missing one.
fn create_tables(db: &Database) -> Result<()> {
    let txn = db.begin_write().map_err(db_error)?;
    txn.open_table(STATES).map_err(db_error)?;
    txn.open_table(ITEMS).map_err(db_error)?;
    // An earlier release's rings, at once rather than one lookup on every write.
    txn.delete_table(CHANGES).map_err(db_error)?;
    txn.open_table(CHANGE_LOG).map_err(db_error)?;
    txn.open_table(VERSIONS).map_err(db_error)?;
    txn.open_table(PREFETCHED).map_err(db_error)?;
    txn.open_table(RAW_LOG).map_err(db_error)?;
    txn.open_table(RAW_IDS).map_err(db_error)?;
    txn.open_table(JOBS).map_err(db_error)?;
    txn.open_table(JOB_EXCHANGES).map_err(db_error)?;
    txn.open_table(QUEUE).map_err(db_error)?;
    txn.open_table(SESSION_QUEUE).map_err(db_error)?;
    txn.open_table(SESSION_HEADS).map_err(db_error)?;
    txn.open_table(COUNTERS).map_err(db_error)?;
    txn.commit().map_err(db_error)
}

/// One row of an embedded store file, for inspection (tests check what a forget left).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredRow {
    pub table: String,
    /// The key's parts as text.
    pub key: Vec<String>,
    /// The value as stored (numbers and tuples as text).
    pub value: Vec<u8>,
}

impl EmbeddedStore {
    /// Every row of every table of the store file in `data_dir` (the file must not be open in
    /// another process). Fails if the file holds a table this function does not read, so a
    /// table added later cannot escape inspection.
    pub fn dump(data_dir: &Path) -> Result<Vec<StoredRow>> {
        let db = Database::open(data_dir.join(FILE_NAME)).map_err(db_error)?;
        let txn = db.begin_read().map_err(db_error)?;
        let known = [
            STATES.name(),
            ITEMS.name(),
            CHANGE_LOG.name(),
            VERSIONS.name(),
            PREFETCHED.name(),
            RAW_LOG.name(),
            RAW_IDS.name(),
            JOBS.name(),
            JOB_EXCHANGES.name(),
            QUEUE.name(),
            SESSION_QUEUE.name(),
            SESSION_HEADS.name(),
            COUNTERS.name(),
        ];
        for table in txn.list_tables().map_err(db_error)? {
            if !known.contains(&table.name()) {
                return Err(Error::Store(format!(
                    "table {} is not covered by EmbeddedStore::dump",
                    table.name()
                )));
            }
        }
        if txn
            .list_multimap_tables()
            .map_err(db_error)?
            .next()
            .is_some()
        {
            return Err(Error::Store(
                "multimap tables are not covered by dump".into(),
            ));
        }
        let mut rows = Vec::new();
        let bytes = |value: &[u8]| value.to_vec();
        let text = |value: u64| value.to_string().into_bytes();
        dump_table(&txn, STATES, &mut rows, |(tenant, user), value| {
            (vec![tenant.into(), user.into()], bytes(value))
        })?;
        dump_table(
            &txn,
            CHANGE_LOG,
            &mut rows,
            |(tenant, user, version), value| {
                (
                    vec![tenant.into(), user.into(), version.to_string()],
                    bytes(value),
                )
            },
        )?;
        dump_table(
            &txn,
            ITEMS,
            &mut rows,
            |(tenant, user, kind, pos), value| {
                let key = vec![
                    tenant.into(),
                    user.into(),
                    kind.to_string(),
                    pos.to_string(),
                ];
                (key, bytes(value))
            },
        )?;
        dump_table(&txn, VERSIONS, &mut rows, |(tenant, user), value| {
            (vec![tenant.into(), user.into()], text(value))
        })?;
        for definition in [PREFETCHED, JOBS, JOB_EXCHANGES] {
            dump_table(
                &txn,
                definition,
                &mut rows,
                |(tenant, user, rest), value| {
                    (vec![tenant.into(), user.into(), rest.into()], bytes(value))
                },
            )?;
        }
        dump_table(&txn, RAW_LOG, &mut rows, |(tenant, user, seq), value| {
            (
                vec![tenant.into(), user.into(), seq.to_string()],
                bytes(value),
            )
        })?;
        dump_table(&txn, RAW_IDS, &mut rows, |(tenant, user, id), value| {
            (vec![tenant.into(), user.into(), id.into()], text(value))
        })?;
        dump_table(&txn, QUEUE, &mut rows, |position, (tenant, user, job)| {
            let value = format!("{tenant}\u{0}{user}\u{0}{job}").into_bytes();
            (vec![position.to_string()], value)
        })?;
        dump_table(
            &txn,
            SESSION_QUEUE,
            &mut rows,
            |(tenant, user, session, position), job| {
                let key = vec![
                    tenant.into(),
                    user.into(),
                    session.into(),
                    position.to_string(),
                ];
                (key, job.as_bytes().to_vec())
            },
        )?;
        dump_table(
            &txn,
            SESSION_HEADS,
            &mut rows,
            |position, (tenant, user, session)| {
                let value = format!("{tenant}\u{0}{user}\u{0}{session}").into_bytes();
                (vec![position.to_string()], value)
            },
        )?;
        dump_table(&txn, COUNTERS, &mut rows, |name, value| {
            (vec![name.to_owned()], text(value))
        })?;
        Ok(rows)
    }
}

/// Appends every row of `definition` to `rows`, as `row` renders its key and value.
fn dump_table<K: redb::Key + 'static, V: redb::Value + 'static>(
    txn: &redb::ReadTransaction,
    definition: TableDefinition<K, V>,
    rows: &mut Vec<StoredRow>,
    row: impl for<'a> Fn(K::SelfType<'a>, V::SelfType<'a>) -> (Vec<String>, Vec<u8>),
) -> Result<()> {
    for entry in txn
        .open_table(definition)
        .map_err(db_error)?
        .iter()
        .map_err(db_error)?
    {
        let (key, value) = entry.map_err(db_error)?;
        let (key, value) = row(key.value(), value.value());
        rows.push(StoredRow {
            table: definition.name().to_owned(),
            key,
            value,
        });
    }
    Ok(())
}

fn db_error(error: impl Into<redb::Error>) -> Error {
    Error::Store(error.into().to_string())
}

fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|error| Error::Store(format!("encode: {error}")))
}

/// The jobs table key of a job.
fn job_key(id: &JobId) -> (&str, &str, &str) {
    (
        id.user.tenant.as_str(),
        id.user.user.as_str(),
        id.key.as_str(),
    )
}

fn decode_job(guard: Option<redb::AccessGuard<'_, &'static [u8]>>) -> Result<Option<JobRecord>> {
    guard.map(|guard| decode(guard.value())).transpose()
}

impl MemoryRecords for EmbeddedStore {
    fn hot_record<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        // A warm read (the caller's state cached, the file open) is a few tens of µs of cached
        // page reads, while handing it to a blocking thread and back cost about 70 µs more on
        // the 2-core VM (two thread wake-ups; docs/benchmarks-log.md): it runs here. A state to
        // decode, an error or a closed file go to a blocking thread, which also recovers.
        if cached_version.is_some()
            && let Some(db) = self.db.current()
            && let Ok(Some(record)) = read_hot_record(
                &db,
                user,
                session_id,
                cached_version,
                false,
                self.logged(user, session_id),
            )
        {
            return Box::pin(std::future::ready(Ok(record)));
        }
        let logged = self.logged(user, session_id);
        let user = user.clone();
        let session_id = session_id.to_owned();
        self.blocking(move |db| {
            read_hot_record(db, &user, &session_id, cached_version, true, logged)?
                .ok_or_else(|| Error::Store("hot record read gave up on its state".into()))
        })
    }

    fn load_state<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Option<MemoryState>>> {
        let user = user.clone();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(db_error)?;
            let states = txn.open_table(STATES).map_err(db_error)?;
            let items = txn.open_table(ITEMS).map_err(db_error)?;
            Ok(
                read_memory(&states, &items, (user.tenant.as_str(), user.user.as_str()))?
                    .map(|(state, _)| state),
            )
        })
    }

    fn save_encoded_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a EncodedState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        let user = user.clone();
        let encoded = state.clone();
        self.blocking_write(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            // On a conflict the transaction is dropped, which aborts it: nothing is written.
            write_state(&txn, &user, &encoded, expected_version)?;
            txn.commit().map_err(db_error)
        })
    }

    fn save_prefetched<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        candidates: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        let user = user.clone();
        let session_id = session_id.to_owned();
        let encoded = encode(candidates);
        self.blocking_write(move |db| {
            let encoded = encoded?;
            let txn = db.begin_write().map_err(db_error)?;
            write_prefetched(&txn, &user, &session_id, &encoded)?;
            txn.commit().map_err(db_error)
        })
    }

    fn append_raw<'a>(
        &'a self,
        user: &'a UserKey,
        exchange_id: &'a str,
        exchange: &'a ExchangeInput,
    ) -> BoxFuture<'a, Result<Appended>> {
        let user = user.clone();
        let exchange_id = exchange_id.to_owned();
        let exchange = exchange.clone();
        self.blocking_write(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            let appended = write_raw(&txn, &user, &exchange_id, &exchange)?;
            if !appended.duplicate {
                txn.commit().map_err(db_error)?;
            }
            Ok(appended)
        })
    }

    fn read_raw<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Vec<RawEntry>>> {
        let user = user.clone();
        self.blocking(move |db| {
            let (tenant, user_id) = (user.tenant.as_str(), user.user.as_str());
            let txn = db.begin_read().map_err(db_error)?;
            let log = txn.open_table(RAW_LOG).map_err(db_error)?;
            let mut entries = Vec::new();
            for row in log
                .range((tenant, user_id, 0)..=(tenant, user_id, u64::MAX))
                .map_err(db_error)?
            {
                let (_, value) = row.map_err(db_error)?;
                entries.push(decode(value.value())?);
            }
            Ok(entries)
        })
    }
}

impl JobQueue for EmbeddedStore {
    fn enqueue<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Enqueued>> {
        // Logged jobs whose enqueue failed were answered `queued` before this one was
        // recorded: they go first, and while one still fails this one waits (the caller, the
        // spool's forwarder, tries it again).
        let retry = self.retry_logged();
        Box::pin(async move {
            if let Some(retry) = retry {
                retry.await?;
            }
            enqueued(
                self.writes
                    .submit(&self.db, Write::Enqueue(job.clone(), None))
                    .await,
            )
        })
    }

    fn place(&self, job: Job) -> Placement {
        // While a logged job's enqueue has failed, jobs recorded after it are held back, as
        // behind any failed placement; the caller spools them and forwards them after it.
        if let Some(intake) = self.intake.as_ref().filter(|intake| intake.has_failed()) {
            if intake.retry_due(Instant::now(), PLACE_RETRY_EVERY) {
                drop(self.retry_logged());
            }
            return Placement::Held(job);
        }
        // On disk the job goes to the intake log too, and its receipt waits for the log's sync
        // instead of the database's commit (see `intake`); a job the database holds already
        // (the same exchange sent again) is answered by the database, as before.
        let logged = match &self.intake {
            Some(intake) if !self.holds_job(&job.id) => match intake.log(&job) {
                Some(durable) => Some((Arc::clone(intake), durable)),
                None => {
                    let pending = Enqueued::Duplicate(JobState::Queued);
                    return Placement::Placed(Box::pin(std::future::ready(Ok(pending))));
                }
            },
            _ => None,
        };
        let (id, session) = (job.id.clone(), job.exchange.session_id.clone());
        let write = Write::Enqueue(job, logged.as_ref().map(|(intake, _)| Arc::clone(intake)));
        match self.writes.place(&self.db, write) {
            Ok(answer) => match logged {
                Some((intake, durable)) => Placement::Placed(Box::pin(async move {
                    if let Ok(Ok(())) = durable.await {
                        return Ok(Enqueued::Queued);
                    }
                    // The log failed: the database's commit is the receipt, as without one.
                    let result = enqueued(answer.await);
                    if result.is_err() {
                        // The caller keeps the job (it spools it): not pending here.
                        intake.returned(&id, &session);
                    }
                    result
                })),
                None => Placement::Placed(Box::pin(async move { enqueued(answer.await) })),
            },
            Err((Write::Enqueue(job, intake), _)) => {
                if let Some(intake) = intake {
                    intake.returned(&job.id, &job.exchange.session_id);
                }
                Placement::Held(job)
            }
            // Only an enqueue was placed, so only one comes back; answered, not a panic.
            Err((Write::Commit(_) | Write::Retry(..), error)) => {
                Placement::Placed(Box::pin(std::future::ready(Err(error))))
            }
        }
    }

    fn resume_placing(&self) {
        self.writes.resume();
        drop(self.retry_logged());
    }

    fn claims_whole_runs(&self) -> bool {
        true
    }

    fn claim<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<ClaimedJob>>> {
        let batch = self.claim_batch(consumer, lease, 1);
        Box::pin(async move { Ok(batch.await?.into_iter().next()) })
    }

    fn claim_batch<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        self.claim_runs(consumer, lease, max, usize::MAX)
    }

    fn claim_runs<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        max: usize,
        sessions: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        let consumer = consumer.to_owned();
        // On the commit thread at normal priority, like every other write: on the idle worker's
        // own pool a claim the busy cores preempted held redb's one write lock for seconds, and
        // every commit and enqueue waited behind it (`tests/worker_lag.rs`). A claim skips the
        // fsync, so it holds the lock briefly. The idle loop may still be starved after it
        // claims: the catch-up then takes its runs over (the proxy's `worker::held`).
        self.blocking_write(move |db| {
            let now = now_ms();
            let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
            let mut txn = db.begin_write().map_err(db_error)?;
            // A lease is soft state: if the process dies before a durable commit, the lease is
            // simply gone and the job can be claimed again at once, which is what a dead
            // holder's lease would come to anyway. So claims skip the fsync; the next durable
            // commit (the job's own) persists them.
            txn.set_durability(Durability::None).map_err(db_error)?;
            let claimed = write_claims(&txn, &consumer, now, lease_ms, max, sessions)?;
            if !claimed.is_empty() {
                txn.commit().map_err(db_error)?;
            }
            Ok(claimed)
        })
    }

    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>> {
        let id = job.clone();
        self.blocking_write(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            if !write_finish(&txn, &id, state)? {
                return Ok(false);
            }
            txn.commit().map_err(db_error)?;
            Ok(true)
        })
    }

    fn clear_forwarded<'a>(&'a self, jobs: &'a [JobId]) -> BoxFuture<'a, Result<usize>> {
        let ids = jobs.to_vec();
        self.blocking_write(move |db| {
            let txn = db.begin_write().map_err(db_error)?;
            let mut known = 0;
            for id in &ids {
                if write_clear(&txn, id)? {
                    known += 1;
                }
            }
            txn.commit().map_err(db_error)?;
            Ok(known)
        })
    }

    fn job_state<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<Option<JobState>>> {
        if self
            .intake
            .as_ref()
            .is_some_and(|intake| intake.holds_id(job))
        {
            return Box::pin(std::future::ready(Ok(Some(JobState::Queued))));
        }
        let id = job.clone();
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(db_error)?;
            let jobs = txn.open_table(JOBS).map_err(db_error)?;
            let record = decode_job(jobs.get(job_key(&id)).map_err(db_error)?)?;
            Ok(record.map(|record| record.state))
        })
    }

    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>> {
        // Jobs only the intake log holds are queued too (their receipts said so); one whose
        // commit has just landed may count twice until its callback runs.
        let logged = self
            .intake
            .as_ref()
            .map_or(0, |intake| intake.pending_count());
        self.blocking(move |db| {
            let txn = db.begin_read().map_err(db_error)?;
            let held = txn
                .open_table(QUEUE)
                .map_err(db_error)?
                .len()
                .map_err(db_error)?;
            Ok(held + logged)
        })
    }
}

impl Store for EmbeddedStore {
    fn commit_jobs<'a>(
        &'a self,
        jobs: &'a [Job],
        state: &'a EncodedState,
        expected_version: u64,
        prefetched: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.commit(jobs, state, expected_version, prefetched))
    }

    fn forget_user<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<ForgetReport>> {
        // The tombstone first: a restart must not enqueue the user's logged jobs again.
        let tombstone = self.intake.as_ref().map(|intake| intake.forget(user));
        let user = user.clone();
        Box::pin(async move {
            if let Some(tombstone) = tombstone {
                tombstone
                    .await
                    .map_err(|_| Error::Store("the intake log stopped".into()))??;
            }
            self.forget_stored(user).await
        })
    }
}

impl EmbeddedStore {
    /// [`Store::forget_user`]'s delete of the user's records in the database.
    fn forget_stored(&self, user: UserKey) -> BoxFuture<'static, Result<ForgetReport>> {
        self.blocking_write(move |db| {
            let (tenant, user_id) = (user.tenant.as_str(), user.user.as_str());
            let mut report = ForgetReport::default();
            let txn = db.begin_write().map_err(db_error)?;
            {
                if txn
                    .open_table(STATES)
                    .map_err(db_error)?
                    .remove((tenant, user_id))
                    .map_err(db_error)?
                    .is_some()
                {
                    report.memory_states = 1;
                }
                txn.open_table(VERSIONS)
                    .map_err(db_error)?
                    .remove((tenant, user_id))
                    .map_err(db_error)?;
                drop_changes_through(
                    &mut txn.open_table(CHANGE_LOG).map_err(db_error)?,
                    (tenant, user_id),
                    u64::MAX,
                )?;
                txn.open_table(ITEMS)
                    .map_err(db_error)?
                    .extract_from_if(
                        (tenant, user_id, 0u8, 0u32)..=(tenant, user_id, u8::MAX, u32::MAX),
                        |_, _| true,
                    )
                    .map_err(db_error)?
                    .for_each(drop);

                let mut prefetched = txn.open_table(PREFETCHED).map_err(db_error)?;
                for session in string_keys_of(&prefetched, &user)? {
                    prefetched
                        .remove((tenant, user_id, session.as_str()))
                        .map_err(db_error)?;
                    report.prefetched_sessions += 1;
                }

                let mut ids = txn.open_table(RAW_IDS).map_err(db_error)?;
                for exchange_id in string_keys_of(&ids, &user)? {
                    ids.remove((tenant, user_id, exchange_id.as_str()))
                        .map_err(db_error)?;
                }
                let mut log = txn.open_table(RAW_LOG).map_err(db_error)?;
                let removed = log
                    .extract_from_if(
                        (tenant, user_id, 0)..=(tenant, user_id, u64::MAX),
                        |_, _| true,
                    )
                    .map_err(db_error)?
                    .count();
                report.raw_entries = u64::try_from(removed).unwrap_or(u64::MAX);

                let mut jobs = txn.open_table(JOBS).map_err(db_error)?;
                let mut exchanges = txn.open_table(JOB_EXCHANGES).map_err(db_error)?;
                let mut queue = txn.open_table(QUEUE).map_err(db_error)?;
                for key in string_keys_of(&exchanges, &user)? {
                    exchanges
                        .remove((tenant, user_id, key.as_str()))
                        .map_err(db_error)?;
                }
                for key in string_keys_of(&jobs, &user)? {
                    let removed = jobs
                        .remove((tenant, user_id, key.as_str()))
                        .map_err(db_error)?;
                    if let Some(guard) = removed {
                        let record: JobRecord = decode(guard.value())?;
                        if record.state == JobState::Queued {
                            queue.remove(record.queue_position).map_err(db_error)?;
                        }
                    }
                    report.jobs += 1;
                }
                let mut session_queue = txn.open_table(SESSION_QUEUE).map_err(db_error)?;
                let mut entries = Vec::new();
                for row in session_queue
                    .range((tenant, user_id, "", 0)..)
                    .map_err(db_error)?
                {
                    let (key, _) = row.map_err(db_error)?;
                    let (row_tenant, row_user, session, position) = key.value();
                    if row_tenant != tenant || row_user != user_id {
                        break;
                    }
                    entries.push((session.to_owned(), position));
                }
                let mut heads = txn.open_table(SESSION_HEADS).map_err(db_error)?;
                for (session, position) in entries {
                    session_queue
                        .remove((tenant, user_id, session.as_str(), position))
                        .map_err(db_error)?;
                    heads.remove(position).map_err(db_error)?;
                }
            }
            txn.commit().map_err(db_error)?;
            Ok(report)
        })
    }
}

/// Writes the memory (hot state, items, change ring) and its version if the stored version is
/// `expected`; else `StoreConflict`.
fn write_state(
    txn: &WriteTransaction,
    user: &UserKey,
    encoded: &EncodedState,
    expected: u64,
) -> Result<()> {
    let key = (user.tenant.as_str(), user.user.as_str());
    let mut versions = txn.open_table(VERSIONS).map_err(db_error)?;
    let found = versions
        .get(key)
        .map_err(db_error)?
        .map_or(0, |guard| guard.value());
    if found != expected {
        return Err(Error::StoreConflict { expected, found });
    }
    versions.insert(key, encoded.version).map_err(db_error)?;
    write_layout(txn, key, encoded, Some(expected))
}

/// Writes the hot state and items; with `previous`, appends the write to the change ring
/// (without, the ring starts over: a conversion).
fn write_layout(
    txn: &WriteTransaction,
    key: UserKeyRef,
    encoded: &EncodedState,
    previous: Option<u64>,
) -> Result<()> {
    txn.open_table(STATES)
        .map_err(db_error)?
        .insert(key, encoded.meta.as_ref())
        .map_err(db_error)?;
    let mut items = txn.open_table(ITEMS).map_err(db_error)?;
    for (item, json) in &encoded.items {
        items
            .insert((key.0, key.1, item.kind.code(), item.pos), json.as_ref())
            .map_err(db_error)?;
    }
    let mut log = txn.open_table(CHANGE_LOG).map_err(db_error)?;
    let Some(previous) = previous else {
        // The ring starts over.
        return drop_changes_through(&mut log, key, u64::MAX);
    };
    log.insert(
        (key.0, key.1, encoded.version),
        encoded.change(previous).encode().as_bytes(),
    )
    .map_err(db_error)?;
    // Drop what is older than the newest `RING` (usually one row).
    let oldest_dropped = log
        .range((key.0, key.1, 0u64)..=(key.0, key.1, u64::MAX))
        .map_err(db_error)?
        .rev()
        .nth(layout::RING)
        .transpose()
        .map_err(db_error)?
        .map(|(version, _)| version.value().2);
    match oldest_dropped {
        Some(last) => drop_changes_through(&mut log, key, last),
        None => Ok(()),
    }
}

/// Removes a memory's change-ring rows up to the one that wrote version `last`.
fn drop_changes_through(
    log: &mut redb::Table<(&'static str, &'static str, u64), &'static [u8]>,
    key: UserKeyRef,
    last: u64,
) -> Result<()> {
    log.extract_from_if((key.0, key.1, 0u64)..=(key.0, key.1, last), |_, _| true)
        .map_err(db_error)?
        .for_each(drop);
    Ok(())
}

fn write_prefetched(
    txn: &WriteTransaction,
    user: &UserKey,
    session_id: &str,
    encoded: &[u8],
) -> Result<()> {
    txn.open_table(PREFETCHED)
        .map_err(db_error)?
        .insert(
            (user.tenant.as_str(), user.user.as_str(), session_id),
            encoded,
        )
        .map_err(db_error)?;
    Ok(())
}

/// Appends once per exchange id; a duplicate writes nothing.
fn write_raw(
    txn: &WriteTransaction,
    user: &UserKey,
    exchange_id: &str,
    exchange: &ExchangeInput,
) -> Result<Appended> {
    let (tenant, user_id) = (user.tenant.as_str(), user.user.as_str());
    let mut ids = txn.open_table(RAW_IDS).map_err(db_error)?;
    let known = ids
        .get((tenant, user_id, exchange_id))
        .map_err(db_error)?
        .map(|guard| guard.value());
    if let Some(seq) = known {
        return Ok(Appended {
            seq,
            duplicate: true,
        });
    }
    let mut log = txn.open_table(RAW_LOG).map_err(db_error)?;
    let seq = log
        .range((tenant, user_id, 0)..=(tenant, user_id, u64::MAX))
        .map_err(db_error)?
        .next_back()
        .transpose()
        .map_err(db_error)?
        .map_or(0, |(key, _)| key.value().2 + 1);
    let entry = RawEntryRef {
        seq,
        exchange_id,
        exchange,
    };
    log.insert((tenant, user_id, seq), encode(&entry)?.as_slice())
        .map_err(db_error)?;
    ids.insert((tenant, user_id, exchange_id), seq)
        .map_err(db_error)?;
    Ok(Appended {
        seq,
        duplicate: false,
    })
}

/// Leases up to `max` of the oldest queued jobs without a live lease whose session has no
/// earlier job under a live lease (a session's jobs apply in order, even across consumers). A
/// session's later jobs join the batch behind its first, consecutive and in order, so a worker
/// that has fallen behind applies them together.
///
/// Looks at the sessions by their oldest queued job (`SESSION_HEADS`) and reads at most `max`
/// of each session's jobs, stopping at a live lease: a busy session costs one record, whatever
/// its backlog.
fn write_claims(
    txn: &WriteTransaction,
    consumer: &str,
    now: u64,
    lease_ms: u64,
    max: usize,
    max_sessions: usize,
) -> Result<Vec<ClaimedJob>> {
    let heads = txn.open_table(SESSION_HEADS).map_err(db_error)?;
    let session_queue = txn.open_table(SESSION_QUEUE).map_err(db_error)?;
    let mut jobs = txn.open_table(JOBS).map_err(db_error)?;
    let mut exchanges = txn.open_table(JOB_EXCHANGES).map_err(db_error)?;
    // The claimable jobs of the sessions looked at so far, by queue position, at most `max`.
    let mut found: Vec<(u64, JobId, JobRecord)> = Vec::new();
    // Sessions with a claimable job looked at so far: they come in the order of their heads,
    // so the first `max_sessions` of them are the ones a batch by queue position would hold.
    let mut sessions = 0;
    for head in heads.iter().map_err(db_error)? {
        let (head, session) = head.map_err(db_error)?;
        let head = head.value();
        // This session's jobs and those of every session after it were queued after `head`:
        // once `max` jobs queued before it are found, none of theirs can join.
        if max == 0
            || sessions >= max_sessions
            || (found.len() >= max && found.last().is_some_and(|(last, ..)| *last < head))
        {
            break;
        }
        let before = found.len();
        let (tenant, user, session) = session.value();
        let range = (tenant, user, session, head)..=(tenant, user, session, u64::MAX);
        for row in session_queue.range(range).map_err(db_error)?.take(max) {
            let (index, key) = row.map_err(db_error)?;
            let (position, key) = (index.value().3, key.value());
            let Some(guard) = jobs.get((tenant, user, key)).map_err(db_error)? else {
                continue;
            };
            let record: JobRecord = decode(guard.value())?;
            if record
                .lease
                .as_ref()
                .is_some_and(|held| held.until_ms > now)
            {
                // Held elsewhere: the session's later jobs wait for it.
                break;
            }
            // Free, or its earlier jobs are in this batch: it follows them.
            let id = JobId {
                user: UserKey::new(tenant, user),
                key: key.to_owned(),
            };
            found.push((position, id, record));
        }
        if found.len() > before {
            sessions += 1;
        }
        found.sort_unstable_by_key(|(position, ..)| *position);
        found.truncate(max);
    }
    let found = found.into_iter().map(|(_, id, record)| (id, record));
    let mut claimed = Vec::with_capacity(found.len());
    for (id, mut record) in found {
        record.attempts += 1;
        record.lease = Some(Lease {
            consumer: consumer.to_owned(),
            until_ms: now.saturating_add(lease_ms),
        });
        let exchange = match record.set_aside_exchange(&mut exchanges, job_key(&id))? {
            Some(exchange) => exchange,
            None => match exchanges.get(job_key(&id)).map_err(db_error)? {
                Some(guard) => decode(guard.value())?,
                None => {
                    return Err(Error::Store(format!(
                        "queued job {} has no exchange",
                        id.key
                    )));
                }
            },
        };
        jobs.insert(job_key(&id), encode(&record)?.as_slice())
            .map_err(db_error)?;
        claimed.push(ClaimedJob {
            attempt: record.attempts,
            job: Job {
                id,
                exchange,
                trace: record.trace,
            },
        });
    }
    Ok(claimed)
}

/// A write of the store's write thread: a recorded job (with the intake log that holds it
/// until this commit, on disk), the logged jobs whose enqueue failed, tried again together
/// (all or none, so they stay in order), or a worker's applied jobs.
enum Write {
    Enqueue(Job, Option<Arc<Intake>>),
    Retry(Vec<Job>, Arc<Intake>),
    Commit(JobCommit),
}

enum Written {
    Enqueued(Enqueued),
    Committed,
}

fn write_one(txn: &WriteTransaction, write: &Write) -> Result<Written> {
    match write {
        // Its user was forgotten after it was logged (see `Intake::is_pending`): the forget
        // settled it, and nothing is written.
        Write::Enqueue(job, Some(intake)) if !intake.is_pending(job) => {
            Ok(Written::Enqueued(Enqueued::Queued))
        }
        Write::Enqueue(job, _) => write_enqueue(txn, job).map(Written::Enqueued),
        Write::Retry(jobs, intake) => {
            for job in jobs.iter().filter(|job| intake.is_pending(job)) {
                write_enqueue(txn, job)?;
            }
            Ok(Written::Enqueued(Enqueued::Queued))
        }
        Write::Commit(commit) => write_commit(txn, commit).map(|()| Written::Committed),
    }
}

impl Committed for Write {
    fn committed(self) {
        match self {
            Write::Commit(commit) => commit.committed(),
            Write::Enqueue(job, Some(intake)) => {
                intake.committed(&job.id, &job.exchange.session_id);
            }
            Write::Retry(jobs, intake) => {
                for job in &jobs {
                    intake.committed(&job.id, &job.exchange.session_id);
                }
            }
            Write::Enqueue(_, None) => {}
        }
    }

    fn failed(&self) {
        match self {
            Write::Enqueue(job, Some(intake)) => intake.failed(job),
            // Still among the failed ones, in their order.
            Write::Retry(..) | Write::Enqueue(_, None) | Write::Commit(_) => {}
        }
    }
}

/// An enqueue's result from its write's.
fn enqueued(written: Result<Written>) -> Result<Enqueued> {
    match written? {
        Written::Enqueued(enqueued) => Ok(enqueued),
        Written::Committed => Err(mismatched_write()),
    }
}

/// A write answered with another kind's result: a bug, reported rather than a panic.
fn mismatched_write() -> Error {
    Error::Internal("the store answered a write with another kind's result".to_owned())
}

/// Queues a job once per id.
fn write_enqueue(txn: &WriteTransaction, job: &Job) -> Result<Enqueued> {
    let key = job_key(&job.id);
    let mut jobs = txn.open_table(JOBS).map_err(db_error)?;
    if let Some(record) = decode_job(jobs.get(key).map_err(db_error)?)? {
        return Ok(Enqueued::Duplicate(record.state));
    }
    let mut counters = txn.open_table(COUNTERS).map_err(db_error)?;
    let position = counters
        .get(NEXT_QUEUE_POSITION)
        .map_err(db_error)?
        .map_or(0, |guard| guard.value());
    counters
        .insert(NEXT_QUEUE_POSITION, position + 1)
        .map_err(db_error)?;
    let record = JobRecord {
        queue_position: position,
        state: JobState::Queued,
        attempts: 0,
        lease: None,
        session: Some(job.exchange.session_id.clone()),
        exchange: None,
        trace: job.trace,
    };
    jobs.insert(key, encode(&record)?.as_slice())
        .map_err(db_error)?;
    txn.open_table(JOB_EXCHANGES)
        .map_err(db_error)?
        .insert(key, encode(&job.exchange)?.as_slice())
        .map_err(db_error)?;
    txn.open_table(QUEUE)
        .map_err(db_error)?
        .insert(position, key)
        .map_err(db_error)?;
    let session = job.exchange.session_id.as_str();
    let mut session_queue = txn.open_table(SESSION_QUEUE).map_err(db_error)?;
    // Positions only grow: the session's first queued job is its head.
    let first = session_queue
        .range((key.0, key.1, session, 0)..(key.0, key.1, session, position))
        .map_err(db_error)?
        .next()
        .is_none();
    session_queue
        .insert((key.0, key.1, session, position), key.2)
        .map_err(db_error)?;
    if first {
        txn.open_table(SESSION_HEADS)
            .map_err(db_error)?
            .insert(position, (key.0, key.1, session))
            .map_err(db_error)?;
    }
    Ok(Enqueued::Queued)
}

/// The worker's write for applied jobs of one session (see `Store::commit_jobs`).
struct JobCommit {
    jobs: Vec<Job>,
    state: EncodedState,
    expected: u64,
    prefetched: Vec<u8>,
    listener: Option<Arc<dyn CommitListener>>,
}

impl Committed for JobCommit {
    fn committed(self) {
        if let (Some(listener), Some(first)) = (&self.listener, self.jobs.first()) {
            listener.committed(&first.id.user, self.expected, &self.state);
        }
    }
}

fn write_commit(txn: &WriteTransaction, commit: &JobCommit) -> Result<()> {
    let Some((user, first)) = commit_owner(&commit.jobs)? else {
        return Ok(());
    };
    // The checks first, so a failed one writes nothing and the rest of a group commits. A job
    // whose record is gone was forgotten with its user while it was being applied: writing
    // its state would bring the forgotten memory back.
    {
        let jobs = txn.open_table(JOBS).map_err(db_error)?;
        for job in &commit.jobs {
            if jobs.get(job_key(&job.id)).map_err(db_error)?.is_none() {
                return Err(Error::JobGone(job.id.key.clone()));
            }
        }
    }
    // The state first: its version check is the last check, and it writes only when it passes.
    write_state(txn, user, &commit.state, commit.expected)?;
    for job in &commit.jobs {
        write_raw(txn, user, &job.id.key, &job.exchange)?;
    }
    write_prefetched(txn, user, &first.exchange.session_id, &commit.prefetched)?;
    for job in &commit.jobs {
        write_finish(txn, &job.id, JobState::Applied)?;
    }
    Ok(())
}

/// Records a job's final state and takes it off the queue; false when the job is unknown.
fn write_finish(txn: &WriteTransaction, id: &JobId, state: JobState) -> Result<bool> {
    let key = job_key(id);
    let mut jobs = txn.open_table(JOBS).map_err(db_error)?;
    let known = decode_job(jobs.get(key).map_err(db_error)?)?;
    let Some(mut record) = known else {
        return Ok(false);
    };
    dequeue(txn, key, &record)?;
    // The raw log keeps an applied exchange; a failed one stays with its job, the only copy.
    if state == JobState::Applied {
        txn.open_table(JOB_EXCHANGES)
            .map_err(db_error)?
            .remove(key)
            .map_err(db_error)?;
    } else {
        let mut exchanges = txn.open_table(JOB_EXCHANGES).map_err(db_error)?;
        record.set_aside_exchange(&mut exchanges, key)?;
    }
    record.state = state;
    record.lease = None;
    record.exchange = None;
    jobs.insert(key, encode(&record)?.as_slice())
        .map_err(db_error)?;
    Ok(true)
}

/// Deletes a job and everything kept for it (its record, its exchange, its place in the
/// queue); false when the job is unknown.
fn write_clear(txn: &WriteTransaction, id: &JobId) -> Result<bool> {
    let key = job_key(id);
    let mut jobs = txn.open_table(JOBS).map_err(db_error)?;
    let Some(record) = decode_job(jobs.remove(key).map_err(db_error)?)? else {
        return Ok(false);
    };
    dequeue(txn, key, &record)?;
    txn.open_table(JOB_EXCHANGES)
        .map_err(db_error)?
        .remove(key)
        .map_err(db_error)?;
    Ok(true)
}

/// Takes the job `record` describes off the queue and its session's index, if it is queued.
fn dequeue(txn: &WriteTransaction, key: (&str, &str, &str), record: &JobRecord) -> Result<()> {
    if record.state != JobState::Queued {
        return Ok(());
    }
    txn.open_table(QUEUE)
        .map_err(db_error)?
        .remove(record.queue_position)
        .map_err(db_error)?;
    dequeue_session(txn, key, record.session(), record.queue_position)
}

/// Takes a job that leaves the queue out of its session's index; when it was the session's head,
/// the session's next queued job (if any) becomes the head.
fn dequeue_session(
    txn: &WriteTransaction,
    key: (&str, &str, &str),
    session: &str,
    position: u64,
) -> Result<()> {
    let mut session_queue = txn.open_table(SESSION_QUEUE).map_err(db_error)?;
    session_queue
        .remove((key.0, key.1, session, position))
        .map_err(db_error)?;
    let mut heads = txn.open_table(SESSION_HEADS).map_err(db_error)?;
    if heads.remove(position).map_err(db_error)?.is_none() {
        return Ok(());
    }
    let next = session_queue
        .range((key.0, key.1, session, position)..=(key.0, key.1, session, u64::MAX))
        .map_err(db_error)?
        .next()
        .transpose()
        .map_err(db_error)?
        .map(|(index, _)| index.value().3);
    if let Some(next) = next {
        heads
            .insert(next, (key.0, key.1, session))
            .map_err(db_error)?;
    }
    Ok(())
}

/// The third key part of every row of a `(tenant, user, string)` table that belongs to `user`.
fn string_keys_of<V, T>(table: &T, user: &UserKey) -> Result<Vec<String>>
where
    V: redb::Value + 'static,
    T: ReadableTable<(&'static str, &'static str, &'static str), V>,
{
    let (tenant, user_id) = (user.tenant.as_str(), user.user.as_str());
    let mut keys = Vec::new();
    for row in table.range((tenant, user_id, "")..).map_err(db_error)? {
        let (key, _) = row.map_err(db_error)?;
        let (row_tenant, row_user, rest) = key.value();
        if row_tenant != tenant || row_user != user_id {
            break;
        }
        keys.push(rest.to_owned());
    }
    Ok(keys)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;
    use crate::intake;

    #[test]
    fn job_records_written_before_traces_still_decode() {
        let old = br#"{"queue_position":3,"state":"queued","attempts":0,"lease":null,
            "exchange":{"session_id":"s1","turn_id":"t1","user_text":"hi","assistant_text":"yo"}}"#;
        let record: JobRecord = decode(old).unwrap();
        assert_eq!(record.trace, None);
        assert_eq!(record.session(), "s1");
        assert_eq!(record.exchange.as_ref().unwrap().turn_id, "t1");
        // And a record without a trace is written as before.
        assert!(
            !String::from_utf8(encode(&record).unwrap())
                .unwrap()
                .contains("trace")
        );
    }

    /// An earlier release's change rings (one value a user) are never read: opening the store
    /// drops them, and the file then holds nothing `dump` does not cover.
    #[test]
    fn opening_drops_the_rings_an_earlier_release_wrote() {
        let dir = tempfile::tempdir().unwrap();
        {
            let db = Database::create(dir.path().join(FILE_NAME)).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(CHANGES)
                .unwrap()
                .insert(("t", "u"), b"1 2 r0".as_slice())
                .unwrap();
            txn.commit().unwrap();
        }
        drop(EmbeddedStore::open(dir.path()).unwrap());
        let db = Database::open(dir.path().join(FILE_NAME)).unwrap();
        let txn = db.begin_read().unwrap();
        let tables: Vec<String> = txn
            .list_tables()
            .unwrap()
            .map(|table| table.name().to_owned())
            .collect();
        assert!(!tables.contains(&CHANGES.name().to_owned()), "{tables:?}");
        drop(txn);
        drop(db);
        EmbeddedStore::dump(dir.path()).unwrap();
    }

    #[test]
    fn a_raw_entry_is_written_as_it_is_read() {
        let exchange = exchange("s1", "t1", "I live in Oslo.");
        let written = encode(&RawEntryRef {
            seq: 4,
            exchange_id: "x4",
            exchange: &exchange,
        })
        .unwrap();
        let read: RawEntry = decode(&written).unwrap();
        assert_eq!(
            read,
            RawEntry {
                seq: 4,
                exchange_id: "x4".into(),
                exchange,
            }
        );
    }

    fn exchange(session: &str, turn: &str, user_text: &str) -> ExchangeInput {
        ExchangeInput {
            session_id: session.into(),
            turn_id: turn.into(),
            user_text: user_text.into(),
            assistant_text: "Noted.".into(),
            ..ExchangeInput::default()
        }
    }

    fn job(key: &str, user_text: &str) -> Job {
        Job {
            id: JobId {
                user: UserKey::new("acme", "alice"),
                key: key.into(),
            },
            exchange: exchange("s1", key, user_text),
            trace: None,
        }
    }

    /// The stored bytes of a job's record and of its exchange row.
    fn job_rows(store: &EmbeddedStore, id: &JobId) -> (Option<Vec<u8>>, Option<Vec<u8>>) {
        let db = store.db.get_or_reopen().unwrap();
        let txn = db.begin_read().unwrap();
        let read = |table: TableDefinition<(&str, &str, &str), &[u8]>| {
            txn.open_table(table)
                .unwrap()
                .get(job_key(id))
                .unwrap()
                .map(|guard| guard.value().to_vec())
        };
        (read(JOBS), read(JOB_EXCHANGES))
    }

    const LEASE: Duration = Duration::from_secs(30);

    /// One write takes a forwarded batch off the queue, queued or leased, and keeps nothing of
    /// it; an unknown job is not counted, and the jobs left are claimed as before.
    #[tokio::test]
    async fn clearing_forwarded_jobs_leaves_nothing_of_them() {
        let store = EmbeddedStore::in_memory().unwrap();
        let jobs: Vec<Job> = (0..3).map(|n| job(&format!("k{n}"), "a")).collect();
        for job in &jobs {
            store.enqueue(job).await.unwrap();
        }
        // The first is leased, as a forwarder holds what it claimed.
        assert_eq!(store.claim_batch("w", LEASE, 1).await.unwrap().len(), 1);
        let mut ids: Vec<JobId> = jobs[..2].iter().map(|job| job.id.clone()).collect();
        ids.push(job("never-queued", "b").id);
        assert_eq!(store.clear_forwarded(&ids).await.unwrap(), 2);
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        for id in &ids[..2] {
            assert_eq!(job_rows(&store, id), (None, None));
            assert_eq!(store.job_state(id).await.unwrap(), None);
        }
        let left = store.claim_batch("w", LEASE, 4).await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].job.id, jobs[2].id);
        // Spooled again later (a forward that crashed before its clear), a job is taken anew.
        assert_eq!(store.enqueue(&jobs[0]).await.unwrap(), Enqueued::Queued);
    }

    /// A spool's applied records (kept by releases before `clear_forwarded`) go at start-up;
    /// its queued jobs stay and are claimed as before.
    #[tokio::test]
    async fn finished_jobs_are_dropped_and_queued_ones_kept() {
        let store = EmbeddedStore::in_memory().unwrap();
        let jobs: Vec<Job> = (0..3).map(|n| job(&format!("k{n}"), "a")).collect();
        for job in &jobs {
            store.enqueue(job).await.unwrap();
        }
        store.ack(&jobs[0].id).await.unwrap();
        store.fail(&jobs[1].id, "gave up").await.unwrap();
        assert_eq!(store.drop_finished_jobs().await.unwrap(), 2);
        for job in &jobs[..2] {
            assert_eq!(job_rows(&store, &job.id), (None, None));
        }
        assert_eq!(store.drop_finished_jobs().await.unwrap(), 0);
        let left = store.claim_batch("w", LEASE, 4).await.unwrap();
        assert_eq!(left.len(), 1);
        assert_eq!(left[0].job.id, jobs[2].id);
    }

    /// A reopened spool knows its jobs' text bytes: the queued and the leased count, a job
    /// taken off does not.
    #[tokio::test]
    async fn queued_turn_bytes_counts_the_jobs_still_in_the_queue() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(store.queued_turn_bytes().await.unwrap(), 0);
        let jobs: Vec<Job> = ["one", "three", "fifty"]
            .iter()
            .map(|text| job(text, &text.repeat(10)))
            .collect();
        for job in &jobs {
            store.enqueue(job).await.unwrap();
        }
        assert_eq!(store.claim_batch("w", LEASE, 1).await.unwrap().len(), 1);
        store.clear_forwarded(&[jobs[1].id.clone()]).await.unwrap();
        drop(store);
        let reopened = EmbeddedStore::open(dir.path()).unwrap();
        // "Noted." is each job's answer.
        let expected = "one".len() * 10 + "fifty".len() * 10 + 2 * "Noted.".len();
        assert_eq!(reopened.queued_turn_bytes().await.unwrap(), expected as u64);
    }

    #[tokio::test]
    async fn a_lease_of_a_process_that_died_is_released_when_the_store_opens() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let job = job("k1", "remember the code");
        store.enqueue(&job).await.unwrap();
        assert_eq!(store.claim_batch("gone", LEASE, 4).await.unwrap().len(), 1);
        // Another consumer must wait for the lease...
        assert!(store.claim_batch("w", LEASE, 4).await.unwrap().is_empty());
        // ...unless the process holding it is gone: the next process finds it free.
        drop(store);
        let reopened = EmbeddedStore::open(dir.path()).unwrap();
        let claimed = reopened.claim_batch("w", LEASE, 4).await.unwrap();
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].job.id, job.id);
        assert_eq!(claimed[0].attempt, 2);
    }

    #[tokio::test]
    async fn a_job_keeps_its_exchange_apart_from_its_record_until_it_is_applied() {
        let store = EmbeddedStore::in_memory().unwrap();
        let document = "A pasted report line. ".repeat(5_000);
        let job = job("k1", &document);
        assert_eq!(store.enqueue(&job).await.unwrap(), Enqueued::Queued);
        let (record, exchange) = job_rows(&store, &job.id);
        let record = record.unwrap();
        assert!(record.len() < 200, "{}", String::from_utf8_lossy(&record));
        assert_eq!(
            decode::<ExchangeInput>(&exchange.unwrap()).unwrap(),
            job.exchange
        );

        let claimed = store.claim_batch("w1", LEASE, 4).await.unwrap();
        assert_eq!(claimed.len(), 1);
        assert_eq!(claimed[0].job, job);
        // The lease rewrote the record only.
        let (record, exchange) = job_rows(&store, &job.id);
        let record: JobRecord = decode(&record.unwrap()).unwrap();
        assert!(record.lease.is_some() && record.exchange.is_none());
        assert!(exchange.is_some());

        let state = engram_memory::MemoryState {
            version: 1,
            ..Default::default()
        };
        store
            .commit_jobs(
                std::slice::from_ref(&job),
                &EncodedState::of(&state).unwrap(),
                0,
                &[],
            )
            .await
            .unwrap();
        let (record, exchange) = job_rows(&store, &job.id);
        let record: JobRecord = decode(&record.unwrap()).unwrap();
        assert_eq!(record.state, JobState::Applied);
        assert_eq!(exchange, None, "the raw log holds an applied exchange");
        let raw = store.read_raw(&job.id.user).await.unwrap();
        assert_eq!(raw.len(), 1);
        assert_eq!(raw[0].exchange, job.exchange);
    }

    /// A commit writes one user's memory: jobs of two users are refused, and nothing is
    /// written for either.
    #[tokio::test]
    async fn a_commit_of_two_users_jobs_writes_nothing() {
        let store = EmbeddedStore::in_memory().unwrap();
        let alice = job("k1", "I live in Oslo.");
        let mut bob = job("k2", "I live in Rome.");
        bob.id.user = UserKey::new("acme", "bob");
        for job in [&alice, &bob] {
            store.enqueue(job).await.unwrap();
        }
        let state = engram_memory::MemoryState {
            version: 1,
            ..Default::default()
        };
        let refused = store
            .commit_jobs(
                &[alice.clone(), bob.clone()],
                &EncodedState::of(&state).unwrap(),
                0,
                &[],
            )
            .await;
        assert!(matches!(refused, Err(Error::Internal(_))), "{refused:?}");
        for job in [&alice, &bob] {
            assert!(store.read_raw(&job.id.user).await.unwrap().is_empty());
            assert_eq!(
                store.job_state(&job.id).await.unwrap(),
                Some(JobState::Queued)
            );
        }
    }

    #[tokio::test]
    async fn a_failed_job_keeps_its_exchange() {
        let store = EmbeddedStore::in_memory().unwrap();
        let job = job("k1", "I live in Oslo.");
        store.enqueue(&job).await.unwrap();
        store.claim_batch("w1", LEASE, 1).await.unwrap();
        assert!(store.fail(&job.id, "gave up").await.unwrap());
        let (_, exchange) = job_rows(&store, &job.id);
        assert_eq!(
            decode::<ExchangeInput>(&exchange.unwrap()).unwrap(),
            job.exchange
        );
        assert_eq!(store.queue_depth().await.unwrap(), 0);
    }

    /// The session heads a claim walks are rebuilt when the store opens: a store whose heads
    /// are missing (a release before them kept only the session index) still has every
    /// session's jobs claimed, in order, a busy session's skipped whatever its backlog.
    #[tokio::test]
    async fn session_heads_are_rebuilt_when_the_store_opens() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let in_session = |session: &str, key: &str| {
            let mut job = job(key, "I live in Oslo.");
            job.exchange.session_id = session.into();
            job
        };
        let queued = [
            in_session("a", "a1"),
            in_session("b", "b1"),
            in_session("a", "a2"),
            in_session("b", "b2"),
            in_session("c", "c1"),
        ];
        for job in &queued {
            store.enqueue(job).await.unwrap();
        }
        {
            let db = store.db.get_or_reopen().unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(SESSION_HEADS)
                .unwrap()
                .retain(|_, _| false)
                .unwrap();
            txn.commit().unwrap();
        }
        drop(store);
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let keys = |claimed: Vec<ClaimedJob>| -> Vec<String> {
            claimed
                .into_iter()
                .map(|claimed| claimed.job.id.key)
                .collect()
        };
        // Oldest first across sessions, each session's jobs in order.
        assert_eq!(
            keys(store.claim_batch("w1", LEASE, 3).await.unwrap()),
            ["a1", "b1", "a2"]
        );
        // a and b are leased: only c's job is free; b2 waits behind b1.
        assert_eq!(
            keys(store.claim_batch("w2", LEASE, 4).await.unwrap()),
            ["c1"]
        );
        // Applying b1 makes b2 its session's head, free to claim.
        assert!(store.ack(&queued[1].id).await.unwrap());
        assert_eq!(
            keys(store.claim_batch("w2", LEASE, 4).await.unwrap()),
            ["b2"]
        );
        assert!(store.claim_batch("w3", LEASE, 4).await.unwrap().is_empty());
    }

    /// A store written before the exchanges table keeps its queued jobs: a claim reads the
    /// exchange from the record and moves it to the table, and applying the job removes it.
    #[tokio::test]
    async fn a_queued_record_holding_its_exchange_is_claimed_and_applied() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let older = job("k0", "I live in Rome.");
        let job = job("k1", "I live in Oslo.");
        {
            let db = store.db.get_or_reopen().unwrap();
            let txn = db.begin_write().unwrap();
            for (position, queued) in [&older, &job].into_iter().enumerate() {
                let position = position as u64;
                let record = format!(
                    r#"{{"queue_position":{position},"state":"queued","attempts":0,"lease":null,"exchange":{}}}"#,
                    String::from_utf8(encode(&queued.exchange).unwrap()).unwrap()
                );
                txn.open_table(JOBS)
                    .unwrap()
                    .insert(job_key(&queued.id), record.as_bytes())
                    .unwrap();
                txn.open_table(QUEUE)
                    .unwrap()
                    .insert(position, job_key(&queued.id))
                    .unwrap();
            }
            txn.open_table(COUNTERS)
                .unwrap()
                .insert(NEXT_QUEUE_POSITION, 2)
                .unwrap();
            txn.commit().unwrap();
        }
        // Opening the file indexes them by session.
        drop(store);
        let store = EmbeddedStore::open(dir.path()).unwrap();
        // Both belong to session s1: the batch holds them in order.
        let claimed = store.claim_batch("w1", LEASE, 4).await.unwrap();
        let jobs: Vec<&Job> = claimed.iter().map(|claimed| &claimed.job).collect();
        assert_eq!(jobs, [&older, &job]);
        let (record, exchange) = job_rows(&store, &job.id);
        let record: JobRecord = decode(&record.unwrap()).unwrap();
        assert_eq!((record.session(), record.exchange.is_none()), ("s1", true));
        assert_eq!(
            decode::<ExchangeInput>(&exchange.unwrap()).unwrap(),
            job.exchange
        );
        assert!(store.ack(&job.id).await.unwrap());
        assert_eq!(job_rows(&store, &job.id).1, None);
    }

    /// What the session's next request sees of its queued exchanges.
    async fn unapplied_texts(store: &EmbeddedStore) -> Vec<String> {
        let user = UserKey::new("acme", "alice");
        store
            .hot_record(&user, "s1", None)
            .await
            .unwrap()
            .unapplied
            .into_iter()
            .map(|exchange| exchange.user_text)
            .collect()
    }

    fn placed(store: &EmbeddedStore, job: Job) -> BoxFuture<'static, Result<Enqueued>> {
        match store.place(job) {
            Placement::Placed(answer) => answer,
            Placement::Held(_) | Placement::Unsupported(_) => panic!("not placed"),
        }
    }

    /// Places `job` while the write thread's next `failures` commits fail: answered `queued`
    /// (the intake log holds it), then waits until its database enqueue has failed.
    async fn logged_and_failed(store: &EmbeddedStore, job: &Job, failures: u32) {
        store.writes.fail_next_commits(failures);
        assert_eq!(placed(store, job.clone()).await.unwrap(), Enqueued::Queued);
        let intake = store.intake.as_ref().unwrap();
        let mut waited = 0;
        while !intake.has_failed() && waited < 400 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            waited += 1;
        }
        assert!(intake.has_failed(), "the database's enqueue did not fail");
    }

    /// A job whose database enqueue fails after the intake log took it is answered as queued
    /// (the log holds it), is seen by the session's next request and by `job_state`, and
    /// reaches the database when placing resumes.
    #[tokio::test]
    async fn a_logged_job_is_seen_before_the_database_holds_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let logged = job("k1", "I live in Oslo.");
        // The database's enqueue has failed once its round ran; the job is still pending.
        logged_and_failed(&store, &logged, 1).await;
        assert_eq!(job_rows(&store, &logged.id), (None, None));
        assert_eq!(unapplied_texts(&store).await, ["I live in Oslo."]);
        assert_eq!(
            store.job_state(&logged.id).await.unwrap(),
            Some(JobState::Queued)
        );
        // Placing is held behind the failure (and tries the logged job again); a plain
        // enqueue (the spool's forwarder) waits for the logged job to be committed first.
        let next = job("k2", "I work at the harbour.");
        let held = match store.place(next) {
            Placement::Held(job) => job,
            _ => panic!("placing was not held"),
        };
        store.resume_placing();
        assert_eq!(store.enqueue(&held).await.unwrap(), Enqueued::Queued);
        assert!(!store.intake.as_ref().unwrap().holds_id(&logged.id));
        let claimed = store.claim_batch("w1", LEASE, 4).await.unwrap();
        let texts: Vec<&str> = claimed
            .iter()
            .map(|claimed| claimed.job.exchange.user_text.as_str())
            .collect();
        assert_eq!(texts, ["I live in Oslo.", "I work at the harbour."]);
    }

    /// Logged jobs whose enqueue failed are tried again together, in one write: when it
    /// fails, none of them is queued, and the next try queues them in their order. Tried one
    /// write each, the first failed again alone and the second committed ahead of it (a full
    /// disk freed between the two commits, `faults::a_full_disk_…`, once in CI).
    #[tokio::test]
    async fn logged_jobs_tried_again_keep_their_order_through_a_failure() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open_with_linger(dir.path(), Duration::from_millis(50)).unwrap();
        let intake = Arc::clone(store.intake.as_ref().unwrap());
        // The round of both placed jobs fails whole, then its first job alone; the second is
        // held back behind it.
        store.writes.fail_next_commits(2);
        let first = placed(&store, job("k1", "I live in Oslo."));
        let second = placed(&store, job("k2", "I work at the harbour."));
        assert_eq!(first.await.unwrap(), Enqueued::Queued);
        assert_eq!(second.await.unwrap(), Enqueued::Queued);
        let mut waited = 0;
        while intake.failed_jobs().len() < 2 && waited < 2_000 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            waited += 1;
        }
        assert_eq!(intake.failed_jobs().len(), 2, "both enqueues did not fail");
        // Tried again, twice failing: one write each, the second of those failures took the
        // first job alone.
        store.writes.fail_next_commits(2);
        store.resume_placing();
        // The spool's forwarder enqueues the next job, trying until the store takes it: the
        // logged ones go first.
        let next = job("k3", "And I cycle.");
        let mut tries = 0;
        while store.enqueue(&next).await.is_err() && tries < 10 {
            tries += 1;
        }
        assert_eq!(store.writes.faults_left(), 0, "the failures were not taken");
        assert!(!intake.has_failed());
        let claimed = store.claim_batch("w1", LEASE, 4).await.unwrap();
        let keys: Vec<&str> = claimed.iter().map(|c| c.job.id.key.as_str()).collect();
        assert_eq!(keys, ["k1", "k2", "k3"]);
    }

    /// A forget that runs between a job's logging and its database enqueue's write (`place`
    /// logs it, then queues the write: a forget on another thread can run in between) leaves
    /// nothing of the job: before, the enqueue committed it after the forget's delete, so the
    /// worker would apply a forgotten user's turn. Another user's job is queued as before.
    #[tokio::test]
    async fn a_forget_between_a_jobs_logging_and_its_enqueue_leaves_nothing_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let intake = Arc::clone(store.intake.as_ref().unwrap());
        let forgotten = job("k1", "I live in Oslo.");
        let mut kept = job("k2", "I work at the harbour.");
        kept.id.user = UserKey::new("acme", "bob");
        let durable = intake.log(&forgotten).unwrap();
        store.forget_user(&forgotten.id.user).await.unwrap();
        let enqueue = Write::Enqueue(forgotten.clone(), Some(Arc::clone(&intake)));
        let Ok(written) = store.writes.place(&store.db, enqueue) else {
            panic!("placing was held");
        };
        assert!(durable.await.unwrap().is_ok());
        assert_eq!(enqueued(written.await).unwrap(), Enqueued::Queued);
        assert_eq!(
            placed(&store, kept.clone()).await.unwrap(),
            Enqueued::Queued
        );
        // Its receipt came from the log; its enqueue commits just after.
        let mut waited = 0;
        while job_rows(&store, &kept.id).0.is_none() && waited < 400 {
            tokio::time::sleep(Duration::from_millis(5)).await;
            waited += 1;
        }
        assert_eq!(job_rows(&store, &forgotten.id), (None, None));
        let claimed = store.claim_batch("w1", LEASE, 4).await.unwrap();
        let keys: Vec<&str> = claimed.iter().map(|c| c.job.id.key.as_str()).collect();
        assert_eq!(keys, ["k2"]);
        assert_eq!(intake.pending_count(), 0);
    }

    /// The same for a logged job whose enqueue failed and is tried again after the forget.
    #[tokio::test]
    async fn a_forget_before_a_failed_jobs_retry_leaves_nothing_of_it() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let intake = Arc::clone(store.intake.as_ref().unwrap());
        let failed = job("k1", "I live in Oslo.");
        logged_and_failed(&store, &failed, 1).await;
        // The retry read the failed jobs before the forget dropped them, and is written after
        // it: what `retry_logged` can meet when a forget runs between its read and its write.
        let retry = Write::Retry(intake.failed_jobs(), Arc::clone(&intake));
        store.forget_user(&failed.id.user).await.unwrap();
        store.writes.queue_now(&store.db, retry).await.unwrap();
        assert_eq!(job_rows(&store, &failed.id), (None, None));
        assert!(store.claim_batch("w1", LEASE, 4).await.unwrap().is_empty());
    }

    /// When the intake log cannot take a job, the database's commit answers its receipt, as
    /// without a log: the job is queued once, not left pending, and the next job is logged.
    #[tokio::test]
    async fn a_job_the_log_cannot_take_is_answered_by_the_database() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let intake = Arc::clone(store.intake.as_ref().unwrap());
        intake.fail_next_appends(1);
        let first = job("k1", "I live in Oslo.");
        assert_eq!(
            placed(&store, first.clone()).await.unwrap(),
            Enqueued::Queued
        );
        // The receipt came from the database's commit: the database holds the job already.
        assert!(job_rows(&store, &first.id).0.is_some());
        assert!(!intake.holds_id(&first.id));
        assert_eq!(intake.pending_count(), 0);
        let second = job("k2", "I work at the harbour.");
        assert_eq!(
            placed(&store, second.clone()).await.unwrap(),
            Enqueued::Queued
        );
        assert_eq!(Intake::read(dir.path()).unwrap().jobs.len(), 1);
        let claimed = store.claim_batch("w1", LEASE, 4).await.unwrap();
        let keys: Vec<&str> = claimed.iter().map(|c| c.job.id.key.as_str()).collect();
        assert_eq!(keys, ["k1", "k2"]);
    }

    /// A disk on which every database commit fails while the log still takes jobs: the job
    /// logged before the failure counts in the queue's depth and is seen by the next request,
    /// placing is held, the failed job is tried again at most once per `PLACE_RETRY_EVERY`
    /// however many turns are recorded meanwhile, and once the disk recovers every job
    /// reaches the queue in order.
    #[tokio::test]
    async fn a_disk_that_stays_broken_holds_placing_and_paces_its_retries() {
        let dir = tempfile::tempdir().unwrap();
        let store = EmbeddedStore::open(dir.path()).unwrap();
        let intake = Arc::clone(store.intake.as_ref().unwrap());
        const BROKEN: u32 = 1_000_000;
        let logged = job("k0", "I live in Oslo.");
        logged_and_failed(&store, &logged, BROKEN).await;
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        assert_eq!(unapplied_texts(&store).await, ["I live in Oslo."]);
        // A burst of recorded turns: each is held, and they queue the failed job again a few
        // times at most, not once each.
        let mut held = Vec::new();
        for n in 1..=1_000 {
            match store.place(job(&format!("k{n}"), "and then?")) {
                Placement::Held(job) => held.push(job),
                _ => panic!("placing was not held"),
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
        let attempted = BROKEN - store.writes.faults_left();
        assert!(attempted < 20, "{attempted} transactions were tried");
        // The disk recovers; the caller (the spool's forwarder) enqueues what was held.
        store.writes.fail_next_commits(0);
        store.resume_placing();
        for job in &held {
            assert_eq!(store.enqueue(job).await.unwrap(), Enqueued::Queued);
        }
        assert!(!intake.has_failed());
        assert_eq!(intake.pending_count(), 0);
        assert_eq!(store.queue_depth().await.unwrap(), 1_001);
        let claimed = store.claim_batch("w1", LEASE, 3).await.unwrap();
        let keys: Vec<&str> = claimed.iter().map(|c| c.job.id.key.as_str()).collect();
        assert_eq!(keys, ["k0", "k1", "k2"]);
    }

    /// Jobs the log held when the process stopped are queued when the store opens, in order,
    /// once each, without those of a user forgotten after them.
    #[tokio::test]
    async fn opening_queues_what_the_intake_log_held() {
        let dir = tempfile::tempdir().unwrap();
        drop(EmbeddedStore::open(dir.path()).unwrap());
        let bob = Job {
            id: JobId {
                user: UserKey::new("acme", "bob"),
                key: "b1".into(),
            },
            ..job("b1", "I am Bob.")
        };
        {
            // A process that logged these and stopped before its database held them.
            let log = Intake::start(dir.path()).unwrap();
            for logged in [job("k1", "first"), bob.clone(), job("k2", "second")] {
                log.log(&logged).unwrap().await.unwrap().unwrap();
            }
            log.forget(&bob.id.user).await.unwrap().unwrap();
            log.log(&job("k3", "third"))
                .unwrap()
                .await
                .unwrap()
                .unwrap();
        }
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(unapplied_texts(&store).await, ["first", "second", "third"]);
        assert_eq!(store.job_state(&bob.id).await.unwrap(), None);
        assert_eq!(store.queue_depth().await.unwrap(), 3);
        // Opened again, nothing is queued twice: the log was emptied.
        drop(store);
        assert!(Intake::read(dir.path()).unwrap().jobs.is_empty());
        let store = EmbeddedStore::open(dir.path()).unwrap();
        assert_eq!(store.queue_depth().await.unwrap(), 3);
    }

    /// A spool on disk keeps no intake log: its receipts are the database's commits.
    #[tokio::test]
    async fn a_spool_keeps_no_intake_log() {
        let dir = tempfile::tempdir().unwrap();
        let spool = EmbeddedStore::open_spool(dir.path(), Duration::ZERO).unwrap();
        assert!(spool.intake.is_none());
        assert_eq!(
            placed(&spool, job("k1", "hi")).await.unwrap(),
            Enqueued::Queued
        );
        assert!(job_rows(&spool, &job("k1", "hi").id).0.is_some());
        for name in intake::FILE_NAMES {
            assert!(!dir.path().join(name).exists());
        }
    }
}
