//! Persistence for memory: the store traits (`MemoryRecords`, `JobQueue`, `Store`) and their
//! backends.
//!
//! Everything is keyed by a [`UserKey`] (tenant, user): every per-user call takes one, so no
//! call made for one user can read or change another user's records. The job queue is the one
//! shared structure; a worker claims jobs of any user, and each job carries its own key.
//!
//! What is stored, per user:
//! - the [`MemoryState`] (JSON) and its version, written with an optimistic version check;
//!   artifacts live inside the state for now (`MemoryState::artifacts`), not in a table of
//!   their own;
//! - the candidates prefetched for each session after its last turn;
//! - the immutable raw log of exchanges, append-only, idempotent by exchange id;
//! - the jobs that recorded exchanges became (queued, applied or failed).
//!
//! Backends: [`embedded::EmbeddedStore`] (redb, the default) and [`redis::RedisStore`]; both
//! pass the same suite (the workspace root's `tests/store_suite/`).

mod db_handle;
pub mod embedded;
mod group_commit;
pub mod intake;
pub mod layout;
pub mod redis;
mod trace;

use std::time::Duration;

use serde::{Deserialize, Serialize};

use engram_memory::{CandidateId, ExchangeInput, MemoryState};
use engram_runtime::BoxFuture;
use engram_runtime::error::{Error, Result};

pub use self::redis::{RedisOptions, RedisStore};
pub use embedded::EmbeddedStore;
pub use layout::{EncodedState, MemoryUpdate};
pub use trace::TraceParent;

/// Whose memory a record belongs to.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct UserKey {
    pub tenant: String,
    pub user: String,
}

impl UserKey {
    pub fn new(tenant: impl Into<String>, user: impl Into<String>) -> UserKey {
        UserKey {
            tenant: tenant.into(),
            user: user.into(),
        }
    }
}

/// The longest tenant, user or session id.
pub const MAX_ID_LEN: usize = 128;

/// Letters, digits and `. _ - @ +`, at most 128 bytes, not dots alone: safe inside a storage
/// key segment (no `:` separator, no `{}` hash-tag braces, no whitespace or control
/// characters) and never a `.`/`..` path segment in a management URL or an export's file name.
/// `name` is the header or field the value came from, for the error.
pub fn checked_id(name: &str, value: &str) -> Result<String> {
    let valid = !value.is_empty()
        && value.len() <= MAX_ID_LEN
        && value
            .bytes()
            .all(|byte| byte.is_ascii_alphanumeric() || b"._-@+".contains(&byte))
        && !value.bytes().all(|byte| byte == b'.');
    if valid {
        Ok(value.to_owned())
    } else {
        Err(Error::invalid_request(
            format!(
                "Invalid `{name}`: it must be 1-128 characters of letters, digits and . _ - @ +, \
                 not dots alone."
            ),
            Some(name),
        ))
    }
}

/// What the hot path needs for one request, fetched in a single read.
#[derive(Debug, Default)]
pub struct HotRecord {
    /// The user's memory version; 0 when nothing is stored.
    pub version: u64,
    /// What the caller needs to reach `version`: nothing when it holds `version` already (its
    /// `cached_version`) or nothing is stored; the items changed since its version when the
    /// change ring still leads from it; else the whole memory.
    pub update: Option<MemoryUpdate>,
    /// Candidates the worker prefetched for this session after its last turn.
    pub prefetched: Vec<CandidateId>,
    /// The session's recorded exchanges that `version` does not hold yet (queued for the
    /// worker), oldest first: the newest [`UNAPPLIED_TURNS`] of them, read in the same snapshot
    /// as the version, so the next request of a session carries the previous exchange however
    /// far behind the worker is.
    pub unapplied: Vec<ExchangeInput>,
    /// Bytes of stored memory values the read took (hot state, items, prefetched candidates,
    /// unapplied exchanges), for the store's byte metrics.
    pub bytes_read: u64,
}

/// The most unapplied exchanges of a session a hot-path read returns (newest first, and no
/// more once [`UNAPPLIED_BYTES`] were read): more than the raw window shows.
pub const UNAPPLIED_TURNS: usize = 8;
/// Stored bytes of unapplied exchanges past which a hot-path read takes no older one (a
/// pasted document is megabytes).
pub const UNAPPLIED_BYTES: usize = 1 << 20;

/// One exchange of the raw log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawEntry {
    /// Position in the user's log, from 0, in append order.
    pub seq: u64,
    pub exchange_id: String,
    pub exchange: ExchangeInput,
}

/// The result of a raw-log append.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Appended {
    /// Where the exchange sits in the log (its first position if it was already there).
    pub seq: u64,
    /// The exchange id was already in the log; nothing was written.
    pub duplicate: bool,
}

/// A job: one recorded exchange for the worker to apply.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct JobId {
    pub user: UserKey,
    /// A hash of the exchange, so a replayed exchange maps to the same job and applies once.
    pub key: String,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub exchange: ExchangeInput,
    /// The span of the request that recorded it, so the worker's span can link to it; `None`
    /// when tracing was off (and in records written before jobs carried it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceParent>,
}

/// A job leased to one consumer; if it is not acknowledged (or failed) before the lease ends,
/// another consumer may claim it again.
#[derive(Debug, Clone, PartialEq)]
pub struct ClaimedJob {
    pub job: Job,
    /// 1 on the first claim; higher when a lease expired and the job was claimed again.
    pub attempt: u32,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum JobState {
    /// Waiting, or leased to a consumer that has not acknowledged it yet.
    Queued,
    Applied,
    Failed {
        reason: String,
    },
}

/// The result of an enqueue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Enqueued {
    Queued,
    /// A job with this id exists already; nothing was written.
    Duplicate(JobState),
}

/// Where [`JobQueue::place`] put a job.
pub enum Placement {
    /// In the queue's order, behind every job placed before it; the future says when it is
    /// durable, or that it failed or was held back (then nothing of it was written).
    Placed(BoxFuture<'static, Result<Enqueued>>),
    /// Held back without being written: a job placed before it failed, and
    /// [`JobQueue::resume_placing`] was not called since.
    Held(Job),
    /// The store cannot fix a job's place before it is durable: enqueue one at a time.
    Unsupported(Job),
}

/// Records deleted by [`Store::forget_user`], per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ForgetReport {
    /// 1 when the user had a memory state.
    pub memory_states: u64,
    /// Sessions whose prefetched candidates were deleted.
    pub prefetched_sessions: u64,
    pub raw_entries: u64,
    /// Jobs of any state; queued ones leave the queue too.
    pub jobs: u64,
}

impl ForgetReport {
    pub fn total(&self) -> u64 {
        self.memory_states + self.prefetched_sessions + self.raw_entries + self.jobs
    }
}

/// A user's memory records: the state with its version, the session's prefetched candidates, the
/// raw log. Object-safe (boxed futures), like [`JobQueue`] and [`Store`].
pub trait MemoryRecords: Send + Sync + 'static {
    /// The hot-path read, in one store operation: the user's memory version, the state unless
    /// the caller's `cached_version` is current, and the session's prefetched candidates.
    fn hot_record<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
    ) -> BoxFuture<'a, Result<HotRecord>>;

    /// [`Self::hot_record`] for a request whose exchange will be recorded as `turn_id`, which
    /// arrived at `arrival_us` (µs since the epoch, the recording process's clock). A store
    /// shared by several processes (Redis) also notes the turn as arriving, in the same round
    /// trip, so that the session's later jobs wait for its job rather than overtake it when
    /// another process records it (see docs/scaling.md). The default is `hot_record`.
    fn hot_record_arriving<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
        turn_id: &'a str,
        arrival_us: u64,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        let _ = (turn_id, arrival_us);
        self.hot_record(user, session_id, cached_version)
    }

    /// [`Self::hot_record`], or with `arriving` (turn id, arrival µs)
    /// [`Self::hot_record_arriving`], for a caller already bringing its copy at
    /// `cached_version` up to date by another read:
    /// a memory that moved on by a write that is not the caller's in flight comes back with no
    /// update (`update: None` at the store's version), where sending one is costly (Redis: the
    /// items changed since, to every request in flight). The default reads as usual.
    fn hot_record_catching_up<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: u64,
        arriving: Option<(&'a str, u64)>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        match arriving {
            Some((turn_id, arrival_us)) => self.hot_record_arriving(
                user,
                session_id,
                Some(cached_version),
                turn_id,
                arrival_us,
            ),
            None => self.hot_record(user, session_id, Some(cached_version)),
        }
    }

    /// Ends the arrival note of a turn that will not be recorded (its request failed), so the
    /// session's later jobs stop waiting for it. The default does nothing.
    fn end_arrival<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        turn_id: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        let _ = (user, session_id, turn_id);
        Box::pin(std::future::ready(Ok(())))
    }

    /// The user's memory state; `None` when nothing is stored.
    fn load_state<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Option<MemoryState>>>;

    /// Writes the state if the stored version still equals `expected_version` (0 when nothing
    /// was stored); otherwise fails with `Error::StoreConflict` and writes nothing. The stored
    /// version becomes `state.version`, which the memory engine bumps on every change.
    fn save_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a MemoryState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let encoded = EncodedState::of(state)?;
            self.save_encoded_state(user, &encoded, expected_version)
                .await
        })
    }

    /// [`Self::save_state`] with the state already encoded (the worker encodes off the async
    /// threads).
    fn save_encoded_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a EncodedState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>>;

    /// Replaces the session's prefetched candidates (the worker computes them after a turn).
    fn save_prefetched<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        candidates: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>>;

    /// Appends an exchange to the user's raw log, once per `exchange_id`.
    fn append_raw<'a>(
        &'a self,
        user: &'a UserKey,
        exchange_id: &'a str,
        exchange: &'a ExchangeInput,
    ) -> BoxFuture<'a, Result<Appended>>;

    /// The user's raw log in append order.
    fn read_raw<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Vec<RawEntry>>>;
}

/// The job queue shared by all users: recorded exchanges waiting for the worker. Object-safe
/// (boxed futures).
pub trait JobQueue: Send + Sync + 'static {
    /// Queues a job, once per job id.
    fn enqueue<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Enqueued>>;

    /// Queues `jobs` in their order, as [`Self::enqueue`] of each one after another would;
    /// how many of them, from the first, are queued (or were already). It stops at the first
    /// that fails, leaving it and the rest unwritten (an error when none was queued). For a
    /// store that does not place (the outbox forwards a spool's backlog with it); the default
    /// enqueues one at a time.
    fn enqueue_run<'a>(&'a self, jobs: &'a [Job]) -> BoxFuture<'a, Result<usize>> {
        Box::pin(async move {
            for (queued, job) in jobs.iter().enumerate() {
                if let Err(error) = self.enqueue(job).await {
                    if queued == 0 {
                        return Err(error);
                    }
                    return Ok(queued);
                }
            }
            Ok(jobs.len())
        })
    }

    /// [`Self::enqueue`] in two steps, for a caller that keeps jobs in order (the recorder, a
    /// session's recordings) without waiting for each to be durable before placing the next:
    /// when `place` returns, the job's place is fixed behind every job placed before it, and
    /// jobs placed one after another share commits. Once a placed job fails, every job placed
    /// behind it fails too (held back, nothing written), and later ones come back
    /// [`Placement::Held`], until [`Self::resume_placing`]: no placed job is queued after an
    /// earlier one failed. The embedded store places in its group commit's queue; the default
    /// (Redis, which orders a session's jobs by their arrival itself) does not place.
    fn place(&self, job: Job) -> Placement {
        Placement::Unsupported(job)
    }

    /// Lets placed jobs through again after a failure held them back; the caller has dealt
    /// with every job placed before (made them durable elsewhere, in their order).
    fn resume_placing(&self) {}

    /// Whether the queue orders a session's jobs by their turns' arrival
    /// ([`ExchangeInput::arrival`]) whatever order they are enqueued in, and holds a session's
    /// head while a turn that arrived before it is noted as arriving
    /// ([`MemoryRecords::hot_record_arriving`]): then a caller may enqueue the session's jobs
    /// concurrently once each turn's note is written (Redis; the recorder's one job at a time
    /// held one identity's recordings to one round trip each).
    fn orders_by_arrival(&self) -> bool {
        false
    }

    /// Leases the oldest queued job that no live lease holds, for `lease`, skipping jobs of a
    /// session whose earlier job is leased (a session's jobs apply in order). A consumer that
    /// dies holding a job loses it when the lease ends. "Oldest" is by enqueue time in the
    /// embedded store; Redis orders a session's jobs by their turns' arrival
    /// ([`ExchangeInput::arrival`]) and serves sessions in the order they got work, one queue
    /// shard at a time (see docs/storage.md).
    fn claim<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<ClaimedJob>>>;

    /// Leases up to `max` jobs at once, by the rules of [`Self::claim`]. A batch may hold
    /// several jobs of one session, consecutive and in order (the holder applies them in that
    /// order); the provided loop holds at most one per session. Backends that can do it in one
    /// step override this loop.
    fn claim_batch<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        Box::pin(async move {
            let mut claimed = Vec::new();
            while claimed.len() < max {
                match self.claim(consumer, lease).await? {
                    Some(job) => claimed.push(job),
                    None => break,
                }
            }
            Ok(claimed)
        })
    }

    /// Like [`Self::claim_batch`], from at most `sessions` sessions: up to `jobs` jobs, in runs
    /// of one session each, no more runs than the caller can start at once. The provided body
    /// is right for a backend whose batch holds one job per session.
    fn claim_runs<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        jobs: usize,
        sessions: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        self.claim_batch(consumer, lease, jobs.min(sessions))
    }

    /// Whether [`Self::claim_runs`] takes a session's queued jobs as one run (up to its `jobs`):
    /// then a claim that comes back short took all there was. The provided body leases one job
    /// per session per claim, and Redis returns once one queue shard gave jobs (and a run stops
    /// before a turn still arriving): both come back short with more queued behind.
    fn claims_whole_runs(&self) -> bool {
        false
    }

    /// Ends a job: records its final state and takes it off the queue. False when the job is
    /// unknown.
    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>>;

    /// Marks a job applied and removes it from the queue. False when the job is unknown.
    fn ack<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<bool>> {
        self.finish(job, JobState::Applied)
    }

    /// Takes jobs another store now holds off this queue, leaving nothing of them: what a
    /// spool's forwarder does with a batch it forwarded; how many were known. A record kept
    /// for each (as [`Self::ack`] keeps one) would grow a spool by every job it ever held.
    /// The provided loop acks one at a time (Redis lets a finished job's record expire); the
    /// embedded store deletes the batch in one write.
    fn clear_forwarded<'a>(&'a self, jobs: &'a [JobId]) -> BoxFuture<'a, Result<usize>> {
        Box::pin(async move {
            let mut known = 0;
            for job in jobs {
                if self.ack(job).await? {
                    known += 1;
                }
            }
            Ok(known)
        })
    }

    /// Marks a job failed and removes it from the queue. False when the job is unknown.
    fn fail<'a>(&'a self, job: &'a JobId, reason: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.finish(
            job,
            JobState::Failed {
                reason: reason.to_owned(),
            },
        )
    }

    fn job_state<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<Option<JobState>>>;

    /// Jobs queued or leased, of all users.
    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>>;
}

/// Persistent memory: a user's [`MemoryRecords`] and the [`JobQueue`], plus the operations that
/// span both (the worker's atomic write of applied jobs, and forgetting a user). Object-safe
/// (boxed futures) so the proxy can hold an `Arc<dyn Store>` chosen by configuration; code that
/// needs only one side can take that trait instead.
pub trait Store: MemoryRecords + JobQueue {
    /// The worker's whole write for applied jobs of one session (in order): their raw-log
    /// appends, the state after them (with the version check of `save_state`), the session's
    /// prefetched candidates, and the jobs marked applied. Fails with `Error::JobGone`, writing
    /// nothing, if a job no longer exists (its user was forgotten while it was applied). Both
    /// backends override this with one atomic step. In the provided sequence every step is
    /// idempotent, so a worker that dies half-way and a re-claim that repeats it apply each job
    /// once; but its job check is a separate read, so a forget landing between it and the
    /// writes can slip through.
    fn commit_jobs<'a>(
        &'a self,
        jobs: &'a [Job],
        state: &'a EncodedState,
        expected_version: u64,
        prefetched: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let Some((user, first)) = commit_owner(jobs)? else {
                return Ok(());
            };
            // A forgotten user's in-flight job must not bring its memory back.
            for job in jobs {
                if self.job_state(&job.id).await?.is_none() {
                    return Err(Error::JobGone(job.id.key.clone()));
                }
            }
            for job in jobs {
                self.append_raw(user, &job.id.key, &job.exchange).await?;
            }
            self.save_encoded_state(user, state, expected_version)
                .await?;
            self.save_prefetched(user, &first.exchange.session_id, prefetched)
                .await?;
            for job in jobs {
                self.ack(&job.id).await?;
            }
            Ok(())
        })
    }

    /// Deletes every record of the user: state, prefetched candidates, raw log, jobs.
    fn forget_user<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<ForgetReport>>;
}

/// Whose memory a commit of `jobs` writes, and its first job (whose session gets the
/// prefetched candidates): `None` when there are no jobs, an error when they are more than one
/// user's. Every backend's commit starts here.
fn commit_owner(jobs: &[Job]) -> Result<Option<(&UserKey, &Job)>> {
    let Some(first) = jobs.first() else {
        return Ok(None);
    };
    let user = &first.id.user;
    if jobs.iter().any(|job| job.id.user != *user) {
        return Err(Error::Internal(
            "commit_jobs was given jobs of more than one user".into(),
        ));
    }
    Ok(Some((user, first)))
}

/// Told of each job commit ([`Store::commit_jobs`]) once it is durable, on the thread that
/// committed it and before the commit is answered. The hot path's cache listens: the worker
/// leaves the memory it computed there before committing, and the cache takes it as the
/// user's current memory when told that its write committed, so a request that reads the new
/// version finds it cached instead of decoding it (which a busy core could otherwise make
/// happen while the idle-priority worker waits to be woken). A backend takes its listener
/// when it is built ([`EmbeddedStore::with_commit_listener`], [`RedisStore::with_commit_listener`]):
/// the embedded store tells it on its commit thread, Redis as soon as a hot read finds the
/// commit landed or the commit's answer comes back. Without one, the worker caches the state
/// itself once the commit returns.
pub trait CommitListener: Send + Sync + 'static {
    /// `user`'s memory went from `expected_version` to `state` (what the commit wrote). Redis
    /// may tell of one commit more than once.
    fn committed(&self, user: &UserKey, expected_version: u64, state: &EncodedState);
}

/// Reads a stored JSON record; a record that does not decode is a store error, not a panic.
fn decode<T: for<'de> Deserialize<'de>>(bytes: &[u8]) -> Result<T> {
    serde_json::from_slice(bytes).map_err(|error| Error::Store(format!("decode: {error}")))
}

/// Wall-clock milliseconds, for job leases.
fn now_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| {
            u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
        })
}
