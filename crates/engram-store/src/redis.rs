//! The Redis backend, on one server or a Redis Cluster (see docs/storage.md and
//! docs/scaling.md).
//!
//! Every per-user record is under `<prefix>:{<tag>}:<kind>`, where the tag is the hex-encoded
//! tenant and user joined by `:` (hex has no `:`, so `("t1:u", "x")` and `("t1", "u:x")` get
//! different tags, and any byte is safe). One user's keys share the hash tag and so one cluster
//! slot, and every script touches one slot only: one user's, or one queue shard's.
//!
//! The job queue is split between the two. The user's slot holds the truth: each job's record
//! and exchange, each session's backlog (ranked by the turns' arrival times) and the session's
//! lease. A queue shard (`<prefix>:{queue-<n>-…}:tokens`, a Stream read by the consumer group
//! `workers`; a user always maps to the same shard) holds *tokens*: "this session has work".
//! A claim leases a token, then, in the user's slot, leases a run of the session's jobs from its
//! head (one job for `claim_batch`); a token that finds the session empty, or its head leased
//! under another token, is dropped. Finishing a leased job passes the session's lease on to the
//! run's next job; finishing the run's last drops its token and, when the session has jobs
//! left, adds a fresh one. So each session with work has a token (tokens are interchangeable:
//! any of them serves the session's head), a session's runs apply one at a time in arrival
//! order, and a claim never looks at jobs waiting in a backlog.
//!
//! Leases: a token's lease is its pending-list entry, whose idle time a claim sets so that it
//! reaches [`LEASE_HORIZON_MS`] exactly when the lease ends, so one `XAUTOCLAIM` with
//! min-idle-time = horizon finds the tokens whose holder died; the job's lease (token and end)
//! is in its record. Writes that span the two slots go user slot first, then queue shard, and
//! each step is safe to repeat, so a process that dies between them leaves nothing stuck for
//! longer than a lease (see docs/storage.md for the one exception).

mod connection;
mod scripts;

use std::collections::HashSet;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use redis::{AsyncCommands, ScriptInvocation};
use serde::{Deserialize, Serialize};

use self::connection::{Connection, Target};
use self::scripts::Scripts;
use super::layout::{self, Delta, ItemKey, MemoryUpdate, Stored};
use super::{
    Appended, ClaimedJob, CommitListener, EncodedState, Enqueued, ForgetReport, HotRecord, Job,
    JobId, JobQueue, JobState, MemoryRecords, RawEntry, Store, UNAPPLIED_BYTES, UNAPPLIED_TURNS,
    UserKey, commit_owner, decode, now_ms,
};
use crate::TraceParent;
use engram_memory::{CandidateId, ExchangeInput, MemoryState};
use engram_runtime::BoxFuture;
use engram_runtime::error::{Error, Result};
use engram_runtime::priority::{self, RecorderPriority, WorkerRuntime};

pub use self::connection::{queue_tag, slot};

/// The key prefix when none is given.
pub const DEFAULT_PREFIX: &str = "engram";

/// Jobs of one user an enqueue run sends in one script: a spool's batch is 256, and a script
/// holds Redis for as long as it runs.
const ENQUEUE_RUN: usize = 64;

/// Exchanges with more text than this are encoded for the enqueue on the recorder's thread;
/// smaller ones encode faster than a hand-off to that thread takes.
const ENCODE_IN_BACKGROUND_BYTES: usize = 64 * 1024;

/// A value this large or larger (an exchange's JSON, a state's) does not travel as a script
/// argument: it is staged with a plain `SET` (see `RedisStore::stage`) and the script renames
/// it into place. Redis hashes every byte of each string that enters a script (about 1.5 ms per
/// MB in the benchmark's profile, 58 % of the server's CPU with 1 MB bodies), and runs nothing
/// else meanwhile, not even the hot path's reads.
const STAGE_FROM_BYTES: usize = 32 * 1024;

/// How long a staged value waits for its script, one round trip later, before it expires.
const STAGED_TTL_MS: u64 = 10 * 60 * 1000;

/// A raw-log element; its seq is its list index. Without `exchange` it is a reference: the
/// exchange is under `rawx:<exchange id>` (large exchanges, which go there without passing
/// through a script).
#[derive(Deserialize)]
struct StoredRawEntry {
    exchange_id: String,
    #[serde(default)]
    exchange: Option<ExchangeInput>,
}

/// A raw-log element as written: the whole entry, or a reference.
#[derive(Serialize)]
struct RawElement<'a> {
    exchange_id: &'a str,
    #[serde(skip_serializing_if = "Option::is_none")]
    exchange: Option<&'a ExchangeInput>,
}

/// Whether an exchange is large enough for its raw-log entry to be a reference (and so, at
/// the enqueue, for its JSON to have been staged into `jobx:<key>`).
fn is_large(exchange: &ExchangeInput) -> bool {
    exchange.text_bytes() >= STAGE_FROM_BYTES
}

/// A queued job's exchange as the job record and stream entry hold it: the exchange's own
/// fields, plus the recording request's trace context when there is one (records written
/// before it existed decode with none).
#[derive(Serialize)]
struct QueuedExchange<'a> {
    #[serde(flatten)]
    exchange: &'a ExchangeInput,
    #[serde(skip_serializing_if = "Option::is_none")]
    trace: Option<TraceParent>,
}

#[derive(Deserialize)]
struct ClaimedExchange {
    #[serde(flatten)]
    exchange: ExchangeInput,
    #[serde(default)]
    trace: Option<TraceParent>,
}

/// The consumer group every worker claims through.
const GROUP: &str = "workers";

/// The idle time at which a pending entry's lease has ended: 10^12 ms, about 31.7 years, so
/// also the longest lease. XCLAIM sets an entry's delivery time to the server's clock minus
/// `IDLE`, which stays positive as long as that clock is past 2001 (10^12 ms since the epoch).
pub const LEASE_HORIZON_MS: u64 = 1_000_000_000_000;

/// The longest retention (about 31.7 years); Redis rejects expire times that overflow.
const MAX_TTL_MS: u64 = 1_000_000_000_000;

/// How long a finished job's record is kept when [`RedisOptions`] do not say.
pub const DEFAULT_FINISHED_JOB_TTL: Duration = Duration::from_secs(7 * 24 * 60 * 60);

/// Tokens one claim looks at in one shard before it moves on (each dropped token costs two
/// round trips; the rest are dropped by later claims).
const TOKENS_PER_CLAIM: usize = 32;

/// Exchanges of raw-log references one `MGET` of `read_raw` reads.
const READ_RAW_BATCH: usize = 64;

/// Stream entries one forget step reads.
const FORGET_CHUNK: usize = 1000;

/// How often a process removes idle consumers from the group.
const PRUNE_EVERY_MS: u64 = 5 * 60 * 1000;

/// The most jobs [`RedisStore`] remembers as possibly enqueued without their depth (see
/// `uncounted`); past it a timed-out user step is forgotten, leaving the depth short.
const UNCOUNTED_MAX: usize = 65_536;

/// Reads after a script's answer timed out (a commit's `answer`, a claim's token), or asks of
/// a claim's lease step, before giving up: each waits up to the response timeout, so with the
/// default 2 s about half a minute of a stalled server.
const ANSWER_READS: usize = 15;

/// Settings of a [`RedisStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RedisOptions {
    /// Every key starts with it, so several stores (tests, deployments) can share one server.
    pub prefix: String,
    /// How long an applied or failed job's record is kept: while it is, `job_state` reports
    /// it and a replayed exchange is a duplicate. `None` keeps it until the user is forgotten.
    pub finished_job_ttl: Option<Duration>,
    /// Each connection attempt gives up after this.
    pub connect_timeout: Duration,
    /// A command without an answer within this fails (a stalled server must not hang the
    /// worker or the recorder; the hot path has its own, shorter deadline). On a cluster it
    /// bounds a command with its retries (a slot moving, a failover).
    pub response_timeout: Duration,
    /// The URL (or the comma-separated URLs) name nodes of a Redis Cluster.
    pub cluster: bool,
    /// Streams the job queue is spread over (each its own hash slot).
    pub queue_shards: u32,
    /// Replicas that must acknowledge a write that records or applies exchanges (`WAIT`)
    /// before it counts as done; 0 does not wait.
    pub wait_replicas: u32,
    /// The longest `WAIT`.
    pub wait_timeout: Duration,
    /// The longest a session's job waits for the job of an earlier turn that is still in
    /// flight (answered or being recorded, by any replica); a turn in flight for longer is
    /// applied after the turns behind it.
    pub order_grace: Duration,
    /// Consumers idle this long without a lease leave the group.
    pub consumer_idle: Duration,
}

impl Default for RedisOptions {
    fn default() -> RedisOptions {
        RedisOptions {
            prefix: DEFAULT_PREFIX.to_owned(),
            finished_job_ttl: Some(DEFAULT_FINISHED_JOB_TTL),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
            cluster: false,
            queue_shards: 1,
            wait_replicas: 0,
            wait_timeout: Duration::from_millis(200),
            order_grace: Duration::from_secs(60),
            consumer_idle: Duration::from_secs(60 * 60),
        }
    }
}

#[derive(Clone)]
pub struct RedisStore {
    /// Reads, leases and the queue's claims.
    connection: Connection,
    /// Writes that may be followed by `WAIT`, which blocks its connection while it waits: a
    /// connection of their own when waiting is on, so reads never queue behind a `WAIT`.
    writer: Connection,
    prefix: String,
    /// The retention in ms as a script argument; empty keeps finished records.
    finished_job_ttl_ms: String,
    /// Each shard's key prefix, `<prefix>:{<queue tag>}:`.
    shards: Arc<Vec<String>>,
    /// Where the next claim starts, so shards take turns.
    next_shard: Arc<AtomicUsize>,
    wait: Option<(u32, Duration)>,
    order_grace: Duration,
    consumer_idle: Duration,
    /// When this process next removes idle consumers (ms since the epoch).
    next_prune_ms: Arc<AtomicU64>,
    scripts: Arc<Scripts>,
    /// A thread niced to 19 that encodes large exchanges for the enqueue: serialising 1 MB of
    /// text took about 0.6 ms in the benchmark's profile, which on the request threads would
    /// delay the requests that arrive meanwhile.
    encoder: Arc<WorkerRuntime>,
    /// Names this process's staged keys (random, so replicas never pick the same)...
    staging_id: Arc<str>,
    /// ...with a counter.
    next_staged: Arc<AtomicU64>,
    /// Numbers this process's claims (after `staging_id`), so a claimer whose answer timed out
    /// knows its own (see CLAIM_TOKEN).
    next_claim: Arc<AtomicU64>,
    /// Told of each job commit of this process the moment one of its reads, or the commit's
    /// own answer, shows it landed (see [`InFlight`]).
    listener: Option<Arc<dyn CommitListener>>,
    /// This process's job commits sent and not yet answered, when there is a listener.
    in_flight: Arc<Mutex<Vec<InFlight>>>,
    /// Jobs (record keys) whose user step timed out here: it may have landed later without
    /// its queue step, so an enqueue of one that finds it queued counts it in the depth.
    uncounted: Arc<Mutex<HashSet<String>>>,
}

/// A job commit sent and not yet answered. A hot read that finds it landed (the user's
/// `committed` key names it) tells the listener at once and takes no delta: the worker holds
/// that memory already, and a long run's changed items sent back to every request in flight
/// cost Redis a millisecond or more each (with one user at 1,000 req/s and runs of 64 jobs,
/// enough to saturate it).
struct InFlight {
    user: UserKey,
    expected_version: u64,
    state: Arc<EncodedState>,
    /// `<version>:<fingerprint>`, as the commit writes it to `committed`.
    landed: String,
}

/// Takes a commit out of the ones in flight when dropped (see [`RedisStore::commit_in_flight`]).
struct InFlightGuard<'a> {
    store: &'a RedisStore,
    landed: String,
}

impl InFlightGuard<'_> {
    /// The commit's answer said it landed.
    fn landed(self) {
        self.store.landed(&self.landed);
    }
}

impl Drop for InFlightGuard<'_> {
    fn drop(&mut self) {
        let mut in_flight = self.store.in_flight_list();
        if let Some(at) = in_flight
            .iter()
            .position(|commit| commit.landed == self.landed)
        {
            in_flight.swap_remove(at);
        }
    }
}

/// The lease step's answer: status, the wait in ms ('wait'), then per leased job its key,
/// attempt and exchange JSON (`None` when the record does not hold it).
type LeaseReply = (
    String,
    Option<String>,
    Vec<String>,
    Vec<u32>,
    Vec<Option<Vec<u8>>>,
);

/// A token's fate, settled with the next claim step.
enum Settle {
    Nothing,
    Drop(String),
    Postpone(String, Duration),
}

impl RedisStore {
    /// Connects to `url` (e.g. `redis://127.0.0.1:6379`) with every key under `prefix` and the
    /// default options.
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisStore> {
        let options = RedisOptions {
            prefix: prefix.to_owned(),
            ..RedisOptions::default()
        };
        RedisStore::connect_with(url, options).await
    }

    /// Connects to `url` with the given options; with `options.cluster`, `url` lists one or
    /// more nodes of the cluster, comma-separated.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<RedisStore> {
        let target = Target {
            urls: url
                .split(',')
                .map(str::trim)
                .filter(|url| !url.is_empty())
                .map(str::to_owned)
                .collect(),
            cluster: options.cluster,
            connect_timeout: options.connect_timeout,
            response_timeout: options.response_timeout,
        };
        let connection = Connection::open(&target).await.map_err(redis_error)?;
        let wait = (options.wait_replicas > 0).then_some((
            options.wait_replicas,
            options.wait_timeout.max(Duration::from_millis(1)),
        ));
        let writer = match wait {
            Some(_) => Connection::open(&target).await.map_err(redis_error)?,
            None => connection.clone(),
        };
        let shards = options.queue_shards.max(1);
        Ok(RedisStore {
            connection,
            writer,
            shards: Arc::new(
                (0..shards)
                    .map(|shard| format!("{}:{{{}}}:", options.prefix, queue_tag(shard, shards)))
                    .collect(),
            ),
            prefix: options.prefix,
            finished_job_ttl_ms: options
                .finished_job_ttl
                // At least 1 ms: PEXPIRE 0 would delete the record at once.
                .map(|ttl| duration_ms(ttl).clamp(1, MAX_TTL_MS).to_string())
                .unwrap_or_default(),
            next_shard: Arc::default(),
            wait,
            order_grace: options.order_grace,
            consumer_idle: options.consumer_idle,
            next_prune_ms: Arc::new(AtomicU64::new(now_ms() + PRUNE_EVERY_MS)),
            scripts: Arc::new(Scripts::new()),
            encoder: Arc::new(priority::recorder_pool(
                "engram-recorder",
                RecorderPriority::Lowest,
            )?),
            staging_id: random_id().into(),
            next_staged: Arc::default(),
            next_claim: Arc::default(),
            listener: None,
            in_flight: Arc::default(),
            uncounted: Arc::default(),
        })
    }

    /// Tells `listener` of each job commit as soon as this process learns it landed: from each
    /// hot read that finds it (then without reading its changes back), and from the commit's
    /// answer; so at least once, and maybe more than once, per commit.
    pub fn with_commit_listener(mut self, listener: Arc<dyn CommitListener>) -> RedisStore {
        self.listener = Some(listener);
        self
    }

    /// Registers a job commit about to be sent, `landed` its [`commit_marker`]; the guard
    /// takes it out again (answered, failed or dropped). `None` without a listener, which has
    /// no use for it.
    fn commit_in_flight(
        &self,
        user: &UserKey,
        expected_version: u64,
        state: &EncodedState,
        landed: &str,
    ) -> Option<InFlightGuard<'_>> {
        self.listener.as_ref()?;
        self.in_flight_list().push(InFlight {
            user: user.clone(),
            expected_version,
            state: Arc::new(state.clone()),
            landed: landed.to_owned(),
        });
        Some(InFlightGuard {
            store: self,
            landed: landed.to_owned(),
        })
    }

    /// After a job commit's answer timed out: its queue step (queued jobs finished, released
    /// tokens) if the commit named `landed` landed, read from the `answer` it left; `None` if
    /// it did not, or if that cannot be told. A timeout leaves the connection open, and the
    /// read follows the commit on it, so the read is answered after the commit ran (a stalled
    /// server, a long script ahead of it); it is retried while it too times out. Without this
    /// a commit that landed late went uncounted, and its jobs stayed in the queue's depth
    /// (its tokens were dropped later by the claims that found them).
    async fn answer_of_landed(&self, user: &UserKey, landed: &str) -> Option<(u64, Vec<String>)> {
        let key = self.user_key(user, "answer");
        let answer = read_after_timeout(self.writer(), &key, landed, "a job commit").await?;
        let mut lines = answer.split('\n');
        let queued = lines.next()?.parse().ok()?;
        tracing::info!("a job commit's answer timed out, but the commit had landed");
        Some((queued, lines.map(str::to_owned).collect()))
    }

    fn in_flight_list(&self) -> std::sync::MutexGuard<'_, Vec<InFlight>> {
        self.in_flight
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `user`'s commits in flight, as HOT_RECORD takes them.
    fn in_flight_of(&self, user: &UserKey) -> String {
        if self.listener.is_none() {
            return String::new();
        }
        let in_flight = self.in_flight_list();
        let mut listed = String::new();
        for commit in in_flight.iter().filter(|commit| commit.user == *user) {
            if !listed.is_empty() {
                listed.push(',');
            }
            listed.push_str(&commit.landed);
        }
        listed
    }

    /// The commit `landed` names has landed: tells the listener, if it is still in flight (once
    /// its guard dropped, the answer has told it).
    fn landed(&self, landed: &str) {
        let Some(listener) = &self.listener else {
            return;
        };
        // Told by every read that finds it, and by its answer; the entry goes only with the
        // commit's guard. Taking it out at the first telling let later reads find neither it
        // nor the cached memory while the teller was still on its way to the cache: the
        // commit's answer is handled on the idle-priority worker thread, which a busy core can
        // leave waiting for a long while (at 500 req/s, 297 requests in 60 s answered without
        // memory).
        let commit = self
            .in_flight_list()
            .iter()
            .find(|commit| commit.landed == landed)
            .map(|commit| {
                (
                    commit.user.clone(),
                    commit.expected_version,
                    Arc::clone(&commit.state),
                )
            });
        if let Some((user, expected_version, state)) = commit {
            listener.committed(&user, expected_version, &state);
        }
    }

    /// The keys and arguments of `job`'s user step (`enqueue_job` in the scripts), added to
    /// `invocation`; a large exchange is staged first.
    async fn user_step(&self, invocation: &mut ScriptInvocation<'_>, job: &Job) -> Result<()> {
        let user = &job.id.user;
        let exchange = &job.exchange;
        let session = hex(&exchange.session_id);
        let queued = self.encode_queued(job).await?;
        let (inline, staged) = self.inline_or_staged(user, queued.as_bytes()).await?;
        invocation
            .key(self.job_record_key(&job.id))
            .key(self.user_key(user, "job_index"))
            .key(self.user_key(user, &format!("session:{session}")))
            .key(self.user_key(user, "arriving"))
            .key(staged)
            .key(self.job_exchange_key(&job.id))
            .arg(&job.id.key)
            .arg(inline)
            .arg(encode(&JobState::Queued)?)
            .arg(&session)
            .arg(
                exchange
                    .arrival
                    .map(|us| us.to_string())
                    .unwrap_or_default(),
            )
            .arg(arrival_marker(&exchange.session_id, &exchange.turn_id));
        Ok(())
    }

    /// Notes that `jobs`' user step failed with `error`: when it timed out, Redis may still run
    /// it (a stall), and the queue step that counts them in the depth never ran.
    fn user_step_failed(&self, jobs: &[Job], error: &redis::RedisError) {
        if !error.is_timeout() {
            return;
        }
        let mut uncounted = self.uncounted_list();
        for job in jobs {
            if uncounted.len() >= UNCOUNTED_MAX {
                tracing::warn!(
                    "too many timed-out enqueues to remember; the queue depth may read low"
                );
                return;
            }
            uncounted.insert(self.job_record_key(&job.id));
        }
    }

    /// How many jobs an enqueue's answer `code` (0 new, 1 queued already, 2 finished) adds to
    /// the depth: a new one, or one queued already by a user step of ours that timed out.
    fn counted(&self, job: &Job, code: u8) -> u64 {
        let late = {
            let mut uncounted = self.uncounted_list();
            !uncounted.is_empty() && uncounted.remove(&self.job_record_key(&job.id))
        };
        u64::from(code == 0 || (late && code == 1))
    }

    fn uncounted_list(&self) -> std::sync::MutexGuard<'_, HashSet<String>> {
        self.uncounted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The queue step of an enqueue of `job` after its user step: a token for its session,
    /// counting `new` jobs in the depth; both steps wait for the replicas when configured.
    async fn queue_step(&self, job: &Job, new: u64) -> Result<()> {
        let user = &job.id.user;
        if !self.replicated(&self.job_record_key(&job.id)).await? {
            return Err(Error::Store(
                "redis: the job was not acknowledged by the replicas in time".into(),
            ));
        }
        let tag = user_tag(user);
        let shard = self.shard_of(&tag);
        let stream = self.shard_key(shard, "tokens");
        let _: i64 = self
            .scripts
            .add_token
            .key(&stream)
            .key(self.shard_key(shard, "depth"))
            .arg(GROUP)
            .arg(&tag)
            .arg(hex(&job.exchange.session_id))
            .arg(new)
            .invoke_async(&mut self.writer())
            .await
            .map_err(redis_error)?;
        if !self.replicated(&stream).await? {
            return Err(Error::Store(
                "redis: the job's token was not acknowledged by the replicas in time".into(),
            ));
        }
        Ok(())
    }

    /// [`JobQueue::enqueue_run`] for jobs of one user: one script for their user steps, then
    /// one queue step per session that has a job still queued among them. How many of them,
    /// from the first, are queued (or were already).
    async fn enqueue_chunk(&self, jobs: &[Job]) -> Result<usize> {
        let mut invocation = self.scripts.enqueue_many.prepare_invoke();
        for job in jobs {
            self.user_step(&mut invocation, job).await?;
        }
        let replies: Vec<redis::Value> = match invocation.invoke_async(&mut self.writer()).await {
            Ok(replies) => replies,
            Err(error) => {
                self.user_step_failed(jobs, &error);
                return Err(redis_error(error));
            }
        };
        // Per session: its last job still queued, and how many of them are new.
        let mut sessions: Vec<(&Job, u64)> = Vec::new();
        let mut taken = 0;
        for (job, reply) in jobs.iter().zip(&replies) {
            let redis::Value::Array(outcome) = reply else {
                let error = redis::from_redis_value::<String>(reply).unwrap_or_default();
                tracing::debug!(%error, job = %job.id.key, "an enqueue in a run failed");
                break;
            };
            let code: u8 = outcome
                .first()
                .map(redis::from_redis_value)
                .transpose()
                .map_err(redis_error)?
                .unwrap_or(2);
            taken += 1;
            let new = self.counted(job, code);
            if code == 2 {
                continue;
            }
            match sessions
                .iter_mut()
                .find(|(last, _)| last.exchange.session_id == job.exchange.session_id)
            {
                Some(entry) => *entry = (job, entry.1 + new),
                None => sessions.push((job, new)),
            }
        }
        for (job, new) in sessions {
            self.queue_step(job, new).await?;
        }
        Ok(taken)
    }

    /// Puts `value` under a fresh key of `user`'s slot, for a script to rename into place (see
    /// [`STAGE_FROM_BYTES`]); a key no script took expires after [`STAGED_TTL_MS`].
    async fn stage(&self, user: &UserKey, value: &[u8]) -> Result<String> {
        let key = format!(
            "{}staging:{}-{}",
            self.user_prefix(user),
            self.staging_id,
            self.next_staged.fetch_add(1, Ordering::Relaxed)
        );
        let () = self
            .writer()
            .pset_ex(&key, value, STAGED_TTL_MS)
            .await
            .map_err(redis_error)?;
        Ok(key)
    }

    /// A script's (inline argument, staged key) for `value`: a small value goes as the
    /// argument (with the name of a key that is never written), a large one is staged and the
    /// argument is empty, which no JSON value is.
    async fn inline_or_staged<'v>(
        &self,
        user: &UserKey,
        value: &'v [u8],
    ) -> Result<(&'v [u8], String)> {
        if value.len() < STAGE_FROM_BYTES {
            return Ok((value, self.never_staged(user)));
        }
        Ok((&[], self.stage(user, value).await?))
    }

    /// The staged-key argument of a script given its value inline: a name no write uses.
    fn never_staged(&self, user: &UserKey) -> String {
        format!("{}staging:-", self.user_prefix(user))
    }

    /// A job's exchange as its record holds it; a large one is encoded on [`Self::encoder`].
    async fn encode_queued(&self, job: &Job) -> Result<String> {
        let text_bytes = job.exchange.text_bytes();
        let pool = self.encoder.handle();
        let Some(pool) = pool.filter(|_| text_bytes > ENCODE_IN_BACKGROUND_BYTES) else {
            return queued_json(&job.exchange, job.trace);
        };
        let (exchange, trace) = (job.exchange.clone(), job.trace);
        pool.spawn_blocking(move || queued_json(&exchange, trace))
            .await
            .map_err(|error| {
                Error::Store(format!("encode: the recorder's thread failed: {error}"))
            })?
    }

    /// The start of every key of one user: `<prefix>:{<tag>}:`.
    fn user_prefix(&self, user: &UserKey) -> String {
        self.tag_prefix(&user_tag(user))
    }

    fn tag_prefix(&self, tag: &str) -> String {
        format!("{}:{{{tag}}}:", self.prefix)
    }

    /// A key of one user: `<prefix>:{<tag>}:<kind>`.
    fn user_key(&self, user: &UserKey, kind: &str) -> String {
        format!("{}{kind}", self.user_prefix(user))
    }

    /// A job's record: a hash of its state and, while queued, its session, exchange and lease.
    fn job_record_key(&self, job: &JobId) -> String {
        format!("{}job:{}", self.user_prefix(&job.user), job.key)
    }

    /// A queued or leased job's exchange when it is too large for its record (see
    /// [`STAGE_FROM_BYTES`]); the scripts name it `jobx:<key>` too.
    fn job_exchange_key(&self, job: &JobId) -> String {
        format!("{}jobx:{}", self.user_prefix(&job.user), job.key)
    }

    /// The queue shard of a user's tokens: a hash of the tag, so it never changes.
    fn shard_of(&self, tag: &str) -> usize {
        let hash = tag.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| {
            (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
        });
        usize::try_from(hash % self.shards.len() as u64).unwrap_or(0)
    }

    fn shard_key(&self, shard: usize, kind: &str) -> String {
        format!("{}{kind}", self.shards[shard % self.shards.len()])
    }

    fn connection(&self) -> Connection {
        self.connection.clone()
    }

    fn writer(&self) -> Connection {
        self.writer.clone()
    }

    /// Waits until the configured number of replicas hold the writer's writes to `key`'s node.
    /// True when they do or waiting is off.
    async fn replicated(&self, key: &str) -> Result<bool> {
        let Some((replicas, timeout)) = self.wait else {
            return Ok(true);
        };
        let acknowledged = self
            .writer()
            .wait_for_replicas(key, replicas, timeout)
            .await
            .map_err(redis_error)?;
        Ok(acknowledged >= replicas)
    }

    /// [`RedisStore::replicated`] for writes whose failure to replicate is logged, not
    /// returned: they are done on the master, and a failover that lost them is repaired by
    /// the jobs staying claimable.
    async fn replicated_or_warn(&self, key: &str, what: &str) -> bool {
        match self.replicated(key).await {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(what, "a write was not acknowledged by the replicas in time");
                false
            }
            Err(error) => {
                tracing::warn!(%error, what, "waiting for the replicas failed");
                false
            }
        }
    }

    /// Up to `jobs` jobs from at most `sessions` sessions, in runs of at most `run` jobs of one
    /// session each. Shards take turns being looked at first, and the call returns once a shard
    /// gave jobs (the worker calls again as soon as it has room, so an idle shard costs a call
    /// only when the ones before it had nothing). A shard that fails is skipped; the call fails
    /// only when nothing was claimed and a shard failed.
    async fn claim_from_shards(
        &self,
        consumer: &str,
        lease: Duration,
        jobs: usize,
        sessions: usize,
        run: usize,
    ) -> Result<Vec<ClaimedJob>> {
        self.prune_now_and_then().await;
        let shards = self.shards.len();
        let start = self.next_shard.fetch_add(1, Ordering::Relaxed);
        let mut claimed = Vec::new();
        let mut runs = 0;
        let mut failure = None;
        for offset in 0..shards {
            let shard = (start + offset) % shards;
            while claimed.len() < jobs && runs < sessions {
                let room = run.min(jobs - claimed.len());
                match self.claim_from_shard(shard, consumer, lease, room).await {
                    Ok(taken) if taken.is_empty() => break,
                    Ok(taken) => {
                        claimed.extend(taken);
                        runs += 1;
                    }
                    Err(error) => {
                        failure.get_or_insert(error);
                        break;
                    }
                }
            }
            if !claimed.is_empty() {
                break;
            }
        }
        match failure {
            Some(error) if claimed.is_empty() => Err(error),
            _ => Ok(claimed),
        }
    }

    /// One claim from one shard: leases tokens until one yields a run of up to `jobs` of its
    /// session's jobs, or the shard has none left (or [`TOKENS_PER_CLAIM`] were looked at).
    async fn claim_from_shard(
        &self,
        shard: usize,
        consumer: &str,
        lease: Duration,
        jobs: usize,
    ) -> Result<Vec<ClaimedJob>> {
        let mut settle = Settle::Nothing;
        for _ in 0..TOKENS_PER_CLAIM {
            let Some((entry, tag, session)) = self
                .claim_token(shard, consumer, lease, &settle, false)
                .await?
            else {
                return Ok(Vec::new());
            };
            let Some(user) = parse_tag(&tag) else {
                tracing::warn!(entry, "malformed token on the job queue; dropped");
                settle = Settle::Drop(entry);
                continue;
            };
            let prefix = self.tag_prefix(&tag);
            let (status, wait_ms, keys, attempts, exchanges) = self
                .lease_run(&prefix, &session, &entry, lease, jobs)
                .await?;
            match status.as_str() {
                "job" if !keys.is_empty() => {
                    let mut run = Vec::with_capacity(keys.len());
                    for ((key, attempt), exchange) in keys.into_iter().zip(attempts).zip(exchanges)
                    {
                        let id = JobId {
                            user: user.clone(),
                            key,
                        };
                        let exchange = match exchange {
                            Some(exchange) => exchange,
                            None => self.stored_exchange(&id).await?,
                        };
                        let claimed: ClaimedExchange = decode(&exchange)?;
                        run.push(ClaimedJob {
                            job: Job {
                                id,
                                exchange: claimed.exchange,
                                trace: claimed.trace,
                            },
                            attempt,
                        });
                    }
                    return Ok(run);
                }
                "wait" => {
                    let wait = wait_ms
                        .and_then(|wait_ms| wait_ms.parse().ok())
                        .map_or(self.order_grace, Duration::from_millis);
                    settle = Settle::Postpone(entry, wait);
                }
                _ => settle = Settle::Drop(entry),
            }
        }
        // Looked at enough tokens for one claim: settle the last one and move on.
        self.claim_token(shard, consumer, lease, &settle, true)
            .await?;
        Ok(Vec::new())
    }

    /// The lease step of a claim under the token `entry`: a run of up to `jobs` of the
    /// session's jobs (see LEASE). Asked again while its answer times out: under the same token
    /// a lease that landed is taken again, with no attempt counted, and one that did not is
    /// made; without this, a run leased in a stall waited for nobody until its lease ended.
    async fn lease_run(
        &self,
        prefix: &str,
        session: &str,
        entry: &str,
        lease: Duration,
        jobs: usize,
    ) -> Result<LeaseReply> {
        until_answered(|| async move {
            self.scripts
                .lease
                .key(format!("{prefix}session:{session}"))
                .key(format!("{prefix}leases"))
                .key(format!("{prefix}arriving"))
                .arg(prefix)
                .arg(session)
                .arg(entry)
                .arg(duration_ms(lease))
                .arg(duration_us(self.order_grace))
                .arg(jobs.max(1))
                .invoke_async(&mut self.connection())
                .await
        })
        .await
        .map_err(redis_error)
    }

    /// A leased job's large exchange, which its record does not hold: read with a plain
    /// `GET`, not in the lease script (see [`STAGE_FROM_BYTES`]).
    async fn stored_exchange(&self, job: &JobId) -> Result<Vec<u8>> {
        let stored: Option<Vec<u8>> = self
            .connection()
            .get(self.job_exchange_key(job))
            .await
            .map_err(redis_error)?;
        stored.ok_or_else(|| Error::Store(format!("redis: job {:?} has no exchange", job.key)))
    }

    /// Settles the previous token, then (unless `settle_only`) leases the shard's next one:
    /// (entry id, user tag, hex session).
    async fn claim_token(
        &self,
        shard: usize,
        consumer: &str,
        lease: Duration,
        settle: &Settle,
        settle_only: bool,
    ) -> Result<Option<(String, String, String)>> {
        let (drop, postpone, postpone_idle) = match settle {
            Settle::Nothing => ("", "", 0),
            Settle::Drop(entry) => (entry.as_str(), "", 0),
            Settle::Postpone(entry, wait) => ("", entry.as_str(), lease_idle_ms(*wait)),
        };
        // A key per claim: the worker's claim loops share a consumer, and one claim's note
        // must not overwrite another's.
        let claim = format!(
            "{}-{}",
            self.staging_id,
            self.next_claim.fetch_add(1, Ordering::Relaxed)
        );
        let claimed = self.shard_key(shard, &format!("claimed:{claim}"));
        let answer: redis::RedisResult<Option<(String, String, String)>> = self
            .scripts
            .claim_token
            .key(self.shard_key(shard, "tokens"))
            .key(self.shard_key(shard, "depth"))
            .key(&claimed)
            .arg(GROUP)
            .arg(consumer)
            .arg(LEASE_HORIZON_MS)
            .arg(lease_idle_ms(lease))
            .arg(drop)
            .arg(postpone)
            .arg(postpone_idle)
            .arg(if settle_only { "1" } else { "0" })
            .arg(&claim)
            .invoke_async(&mut self.connection())
            .await;
        match answer {
            Ok(token) => Ok(token),
            // The token it leased would wait for nobody until the lease ended, and with it
            // the session's work (28 s of a 30 s lease after a stall in `memory_redis`).
            Err(error) if error.is_timeout() && !settle_only => {
                let left = read_after_timeout(self.connection(), &claimed, &claim, "a claim");
                let Some(entry) = left.await else {
                    return Err(redis_error(error));
                };
                // The entry's fields, if it is still there (a forget deletes it).
                let entries: Vec<(String, Vec<String>)> = redis::cmd("XRANGE")
                    .arg(self.shard_key(shard, "tokens"))
                    .arg(&entry)
                    .arg(&entry)
                    .query_async(&mut self.connection())
                    .await
                    .map_err(redis_error)?;
                let token = entries.into_iter().next().map(|(entry, fields)| {
                    let field = |name: &str| {
                        fields
                            .chunks(2)
                            .find(|pair| pair.first().map(String::as_str) == Some(name))
                            .and_then(|pair| pair.get(1).cloned())
                            .unwrap_or_default()
                    };
                    let (tag, session) = (field("u"), field("s"));
                    (entry, tag, session)
                });
                Ok(token)
            }
            Err(error) => Err(redis_error(error)),
        }
    }

    /// The queue step after jobs of `user` finished: drops the released tokens (adding fresh
    /// ones for sessions with jobs left) and lowers the depth. Logged, not returned, when it
    /// fails: the jobs are finished, and a token left behind is dropped by the claim that
    /// finds it once its lease ends.
    async fn release_tokens(&self, user: &UserKey, queued: u64, released: &[String]) {
        if queued == 0 && released.is_empty() {
            return;
        }
        let tag = user_tag(user);
        let shard = self.shard_of(&tag);
        let mut invocation = self.scripts.release_tokens.prepare_invoke();
        invocation
            .key(self.shard_key(shard, "tokens"))
            .key(self.shard_key(shard, "depth"))
            .arg(GROUP)
            .arg(&tag)
            .arg(queued);
        for field in released {
            invocation.arg(field);
        }
        let result: redis::RedisResult<i64> = invocation.invoke_async(&mut self.writer()).await;
        if let Err(error) = result {
            tracing::warn!(%error, "releasing finished jobs' tokens failed; they expire with their lease");
        }
    }

    /// Removes consumers that left (no lease, idle for `consumer_idle`) from every shard's
    /// group; returns how many. Claims call it every few minutes.
    pub async fn prune_consumers(&self) -> Result<u64> {
        let mut removed = 0;
        for shard in 0..self.shards.len() {
            let count: u64 = self
                .scripts
                .prune_consumers
                .key(self.shard_key(shard, "tokens"))
                .arg(GROUP)
                .arg(duration_ms(self.consumer_idle))
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            removed += count;
        }
        Ok(removed)
    }

    async fn prune_now_and_then(&self) {
        let now = now_ms();
        let due = self.next_prune_ms.load(Ordering::Relaxed);
        if now < due
            || self
                .next_prune_ms
                .compare_exchange(
                    due,
                    now + PRUNE_EVERY_MS,
                    Ordering::AcqRel,
                    Ordering::Relaxed,
                )
                .is_err()
        {
            return;
        }
        match self.prune_consumers().await {
            Ok(0) => {}
            Ok(removed) => tracing::info!(removed, "removed idle consumers from the job queue"),
            Err(error) => tracing::debug!(%error, "removing idle consumers failed"),
        }
    }

    async fn hot_record_with(
        &self,
        user: &UserKey,
        session_id: &str,
        cached_version: Option<u64>,
        arriving: Option<(&str, u64)>,
        catching_up: bool,
    ) -> Result<HotRecord> {
        let (marker, arrival) = match arriving {
            Some((turn_id, arrival_us)) => {
                (arrival_marker(session_id, turn_id), arrival_us.to_string())
            }
            None => (String::new(), String::new()),
        };
        type Reply = (
            String,
            String,
            Option<Vec<u8>>,
            Vec<String>,
            Vec<Option<Vec<u8>>>,
            Option<Vec<u8>>,
            Vec<Vec<u8>>,
        );
        let session = hex(session_id);
        let (version, status, meta, fields, values, prefetched, unapplied): Reply = self
            .scripts
            .hot_record
            .key(self.user_key(user, "version"))
            .key(self.user_key(user, "state"))
            .key(self.user_key(user, "items"))
            .key(self.user_key(user, "changes"))
            .key(self.user_key(user, "prefetched"))
            .key(self.user_key(user, "arriving"))
            .key(self.user_key(user, &format!("session:{session}")))
            .key(self.user_key(user, "committed"))
            .arg(
                cached_version
                    .map(|version| version.to_string())
                    .unwrap_or_default(),
            )
            .arg(session_id)
            .arg(marker)
            .arg(arrival)
            // Markers live for the grace; the key goes once its last marker is this old.
            .arg(duration_ms(self.order_grace).max(1) * 2)
            .arg(self.user_prefix(user))
            .arg(UNAPPLIED_TURNS)
            .arg(UNAPPLIED_BYTES)
            // Only with a copy to build on: without one (a new memory's first commit, or one
            // the cache would not keep) there is nothing for the listener to make current.
            .arg(if cached_version.is_some() {
                self.in_flight_of(user)
            } else {
                String::new()
            })
            .arg(if catching_up { "1" } else { "0" })
            .invoke_async(&mut self.connection())
            .await
            .map_err(redis_error)?;
        let mut version = parse_version(&version)?;
        let mut bytes_read = meta.as_ref().map_or(0, Vec::len)
            + values.iter().flatten().map(Vec::len).sum::<usize>()
            + prefetched.as_ref().map_or(0, Vec::len)
            + unapplied.iter().map(Vec::len).sum::<usize>();
        let update = match status.as_str() {
            // Behind: the caller is catching up by another read.
            "none" | "behind" => None,
            "landed" => {
                // Our own commit: the listener caches the memory it wrote, now.
                let landed = meta.as_deref().map(String::from_utf8_lossy);
                bytes_read -= meta.as_ref().map_or(0, Vec::len);
                self.landed(landed.as_deref().unwrap_or_default());
                None
            }
            "delta" => {
                let Some(meta) = meta else {
                    return Err(Error::Store("memory version without its hot state".into()));
                };
                let Stored::Meta(meta) = Stored::decode(&meta)? else {
                    return Err(Error::Store(
                        "a memory in the earlier layout has a change ring".into(),
                    ));
                };
                let mut items = Vec::with_capacity(fields.len());
                for (field, value) in fields.iter().zip(values) {
                    let (Some(key), Some(value)) = (ItemKey::parse(field), value) else {
                        return Err(Error::Store(format!("memory item {field} is missing")));
                    };
                    items.push((key, value));
                }
                Some(MemoryUpdate::Delta(Delta { meta, items }))
            }
            _ => match self.read_memory(user).await? {
                Some((read_version, state, bytes)) => {
                    version = read_version;
                    bytes_read += bytes;
                    Some(MemoryUpdate::Whole(Box::new(state)))
                }
                None => {
                    version = 0;
                    None
                }
            },
        };
        Ok(HotRecord {
            version,
            update,
            prefetched: match prefetched {
                Some(bytes) => decode(&bytes)?,
                None => Vec::new(),
            },
            unapplied: unapplied
                .iter()
                .map(|json| decode::<ClaimedExchange>(json).map(|queued| queued.exchange))
                .collect::<Result<_>>()?,
            bytes_read: u64::try_from(bytes_read).unwrap_or(u64::MAX),
        })
    }

    /// The whole memory with its version, read consistently without a script (a large memory's
    /// values would all be hashed on their way through Lua). A memory stored by an earlier
    /// release as one value is converted to the item layout here, on its first read.
    /// Also returns the bytes read. Plain commands (a cluster connection takes no `MULTI`),
    /// made consistent by reading the version before and after: every write sets the version
    /// last, in the script that writes the hot state and items, so an unchanged version means
    /// no write came in between; a changed one reads again, and after a few tries (a worker
    /// committing this user's turns faster than the reads take) one script reads it at once.
    async fn read_memory(&self, user: &UserKey) -> Result<Option<(u64, MemoryState, usize)>> {
        const ATTEMPTS: usize = 5;
        let version_key = self.user_key(user, "version");
        let mut connection = self.connection();
        let mut read = None;
        for _ in 0..ATTEMPTS {
            let before: Option<String> = connection.get(&version_key).await.map_err(redis_error)?;
            let state: Option<Vec<u8>> = connection
                .get(self.user_key(user, "state"))
                .await
                .map_err(redis_error)?;
            let items: Vec<(String, Vec<u8>)> = connection
                .hgetall(self.user_key(user, "items"))
                .await
                .map_err(redis_error)?;
            let after: Option<String> = connection.get(&version_key).await.map_err(redis_error)?;
            if before == after {
                read = Some((before, state, items));
                break;
            }
        }
        let (version, state, items) = match read {
            Some(read) => read,
            // The field/value list decodes into pairs as `hgetall`'s does.
            None => self
                .scripts
                .read_whole
                .key(&version_key)
                .key(self.user_key(user, "state"))
                .key(self.user_key(user, "items"))
                .invoke_async(&mut connection)
                .await
                .map_err(redis_error)?,
        };
        let (Some(version), Some(state)) = (version, state) else {
            return Ok(None);
        };
        let version = parse_version(&version)?;
        let bytes = state.len()
            + items
                .iter()
                .map(|(field, json)| field.len() + json.len())
                .sum::<usize>();
        match Stored::decode(&state)? {
            Stored::Meta(meta) => {
                let mut rows = Vec::with_capacity(items.len());
                for (field, json) in &items {
                    let Some(key) = ItemKey::parse(field) else {
                        return Err(Error::Store(format!("unknown memory item {field}")));
                    };
                    rows.push((key, json.as_slice()));
                }
                Ok(Some((version, layout::assemble(meta, rows)?, bytes)))
            }
            Stored::Legacy(state) => {
                let encoded = EncodedState::of(&state)?;
                match self.write_memory(user, &encoded, version, None).await {
                    Ok(()) => {
                        tracing::info!("converted a memory stored as one value to the item layout")
                    }
                    Err(Error::StoreConflict { .. }) => {}
                    Err(error) => return Err(error),
                }
                Ok(Some((version, *state, bytes)))
            }
        }
    }

    /// The save script: the memory written if the stored version is `expected`. With
    /// `previous`, the write joins the change ring; without, the ring starts over.
    async fn write_memory(
        &self,
        user: &UserKey,
        encoded: &EncodedState,
        expected: u64,
        previous: Option<u64>,
    ) -> Result<()> {
        let version_key = self.user_key(user, "version");
        let mut invocation = self.scripts.save_state.prepare_invoke();
        invocation
            .key(&version_key)
            .key(self.user_key(user, "state"))
            .key(self.user_key(user, "items"))
            .key(self.user_key(user, "changes"))
            .arg(expected.to_string())
            .arg(encoded.version.to_string())
            .arg(encoded.meta.as_ref())
            .arg(previous.map_or_else(String::new, |previous| encoded.change(previous).encode()))
            .arg(layout::RING);
        for (key, json) in &encoded.items {
            invocation.arg(key.field()).arg(json.as_ref());
        }
        let found: Option<String> = invocation
            .invoke_async(&mut self.writer())
            .await
            .map_err(redis_error)?;
        match found {
            None => {
                self.replicated_or_warn(&version_key, "memory state").await;
                Ok(())
            }
            Some(found) => Err(Error::StoreConflict {
                expected,
                found: parse_version(&found)?,
            }),
        }
    }
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

fn duration_us(duration: Duration) -> u64 {
    u64::try_from(duration.as_micros()).unwrap_or(u64::MAX)
}

/// The idle time a claim gives its entry, so it reaches the horizon when the lease ends.
fn lease_idle_ms(lease: Duration) -> u64 {
    LEASE_HORIZON_MS - duration_ms(lease).min(LEASE_HORIZON_MS)
}

/// The hash-tag content of a user: hex tenant, `:`, hex user.
fn user_tag(user: &UserKey) -> String {
    format!("{}:{}", hex(&user.tenant), hex(&user.user))
}

fn parse_tag(tag: &str) -> Option<UserKey> {
    let (tenant, user) = tag.split_once(':')?;
    Some(UserKey::new(unhex(tenant)?, unhex(user)?))
}

/// A turn being recorded, in the user's `arriving` set: hex session, space, turn id.
fn arrival_marker(session_id: &str, turn_id: &str) -> String {
    format!("{} {turn_id}", hex(session_id))
}

fn hex(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

fn unhex(text: &str) -> Option<String> {
    if !text.len().is_multiple_of(2) {
        return None;
    }
    let bytes = text
        .as_bytes()
        .chunks(2)
        .map(|pair| {
            std::str::from_utf8(pair)
                .ok()
                .and_then(|digits| u8::from_str_radix(digits, 16).ok())
        })
        .collect::<Option<Vec<u8>>>()?;
    String::from_utf8(bytes).ok()
}

/// 64 random bits in hex: std's `RandomState` draws its keys from the operating system.
fn random_id() -> String {
    use std::hash::BuildHasher;
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_nanos());
    format!(
        "{:016x}",
        std::collections::hash_map::RandomState::new().hash_one(nanos)
    )
}

/// After a script's answer timed out on `connection`: the rest of what it left under `key`
/// if its first line is `id` (the script ran), else `None` (it did not, or that cannot be
/// told). A timeout leaves the connection open, and this read follows the script on it, so it
/// is answered after the script ran (a stalled server, a long script ahead of it); it is
/// retried while it too times out, up to [`ANSWER_READS`] times.
async fn read_after_timeout(
    connection: Connection,
    key: &str,
    id: &str,
    what: &str,
) -> Option<String> {
    let read: redis::RedisResult<Option<String>> = until_answered(|| {
        let mut connection = connection.clone();
        async move { connection.get(key).await }
    })
    .await;
    let left = match read {
        Ok(left) => left?,
        Err(error) => {
            tracing::warn!(%error, what, "could not tell whether a timed-out script ran");
            return None;
        }
    };
    let (first, rest) = left.split_once('\n')?;
    (first == id).then(|| rest.to_owned())
}

/// Sends `command` again while its answer times out, [`ANSWER_READS`] times at most, for
/// commands that tell what an earlier one on the same connection did (each runs after it) or
/// that may run twice.
async fn until_answered<T, F, Fut>(mut command: F) -> redis::RedisResult<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = redis::RedisResult<T>>,
{
    let mut sent = 1;
    loop {
        match command().await {
            Err(error) if error.is_timeout() && sent < ANSWER_READS => sent += 1,
            answer => return answer,
        }
    }
}

/// A job commit's `<version>:<fingerprint>`, which it writes to `committed` and `answer`.
fn commit_marker(expected_version: u64, state: &EncodedState) -> String {
    format!(
        "{}:{:016x}",
        state.version,
        state.fingerprint(expected_version)
    )
}

fn redis_error(error: redis::RedisError) -> Error {
    Error::Store(format!("redis: {error}"))
}

fn encode<T: Serialize + ?Sized>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|error| Error::Store(format!("encode: {error}")))
}

/// A raw-log element: the whole entry, or (without `exchange`) a reference.
fn raw_element(exchange_id: &str, exchange: Option<&ExchangeInput>) -> Result<String> {
    encode(&RawElement {
        exchange_id,
        exchange,
    })
}

/// A queued job's exchange as its record holds it.
fn queued_json(exchange: &ExchangeInput, trace: Option<TraceParent>) -> Result<String> {
    encode(&QueuedExchange { exchange, trace })
}

fn parse_version(text: &str) -> Result<u64> {
    text.parse()
        .map_err(|_| Error::Store(format!("stored version is not a number: {text:?}")))
}

impl MemoryRecords for RedisStore {
    fn hot_record<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        Box::pin(self.hot_record_with(user, session_id, cached_version, None, false))
    }

    /// A memory that moved by another's write answers 'behind', without the changed items.
    fn hot_record_catching_up<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: u64,
        arriving: Option<(&'a str, u64)>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        Box::pin(self.hot_record_with(user, session_id, Some(cached_version), arriving, true))
    }

    fn hot_record_arriving<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
        turn_id: &'a str,
        arrival_us: u64,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        Box::pin(self.hot_record_with(
            user,
            session_id,
            cached_version,
            Some((turn_id, arrival_us)),
            false,
        ))
    }

    fn end_arrival<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        turn_id: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let _: i64 = self
                .connection()
                .zrem(
                    self.user_key(user, "arriving"),
                    arrival_marker(session_id, turn_id),
                )
                .await
                .map_err(redis_error)?;
            Ok(())
        })
    }

    fn load_state<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Option<MemoryState>>> {
        Box::pin(async move { Ok(self.read_memory(user).await?.map(|(_, state, _)| state)) })
    }

    fn save_encoded_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a EncodedState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(self.write_memory(user, state, expected_version, Some(expected_version)))
    }

    fn save_prefetched<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        candidates: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let () = self
                .connection()
                .hset(
                    self.user_key(user, "prefetched"),
                    session_id,
                    encode(candidates)?,
                )
                .await
                .map_err(redis_error)?;
            Ok(())
        })
    }

    fn append_raw<'a>(
        &'a self,
        user: &'a UserKey,
        exchange_id: &'a str,
        exchange: &'a ExchangeInput,
    ) -> BoxFuture<'a, Result<Appended>> {
        Box::pin(async move {
            let reference = is_large(exchange);
            let (element, staged) = if reference {
                let staged = self.stage(user, encode(exchange)?.as_bytes()).await?;
                (raw_element(exchange_id, None)?, staged)
            } else {
                let unused = self.never_staged(user);
                (raw_element(exchange_id, Some(exchange))?, unused)
            };
            let (seq, duplicate): (u64, u8) = self
                .scripts
                .append_raw
                .key(self.user_key(user, "raw"))
                .key(self.user_key(user, "raw_ids"))
                .key(staged)
                .key(self.user_key(user, &format!("rawx:{exchange_id}")))
                .arg(exchange_id)
                .arg(element)
                .arg(if reference { "1" } else { "0" })
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            Ok(Appended {
                seq,
                duplicate: duplicate == 1,
            })
        })
    }

    fn read_raw<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Vec<RawEntry>>> {
        Box::pin(async move {
            let stored: Vec<Vec<u8>> = self
                .connection()
                .lrange(self.user_key(user, "raw"), 0, -1)
                .await
                .map_err(redis_error)?;
            let entries: Vec<StoredRawEntry> = stored
                .iter()
                .map(|bytes| decode(bytes))
                .collect::<Result<_>>()?;
            // References: their exchanges, a batch of keys per round trip.
            let references: Vec<&str> = entries
                .iter()
                .filter(|entry| entry.exchange.is_none())
                .map(|entry| entry.exchange_id.as_str())
                .collect();
            let mut referenced = Vec::with_capacity(references.len());
            for batch in references.chunks(READ_RAW_BATCH) {
                let keys: Vec<String> = batch
                    .iter()
                    .map(|id| self.user_key(user, &format!("rawx:{id}")))
                    .collect();
                let found: Vec<Option<Vec<u8>>> = redis::cmd("MGET")
                    .arg(&keys)
                    .query_async(&mut self.connection())
                    .await
                    .map_err(redis_error)?;
                for (id, exchange) in batch.iter().zip(found) {
                    let exchange = exchange.ok_or_else(|| {
                        Error::Store(format!("redis: raw entry {id:?} has no exchange"))
                    })?;
                    referenced.push(decode::<ExchangeInput>(&exchange)?);
                }
            }
            let mut referenced = referenced.into_iter();
            entries
                .into_iter()
                .zip(0u64..)
                .map(|(entry, seq)| {
                    let exchange = match entry.exchange {
                        Some(exchange) => exchange,
                        None => referenced.next().ok_or_else(|| {
                            Error::Internal("read_raw: a reference without its exchange".into())
                        })?,
                    };
                    Ok(RawEntry {
                        seq,
                        exchange_id: entry.exchange_id,
                        exchange,
                    })
                })
                .collect()
        })
    }
}

impl JobQueue for RedisStore {
    /// User step (record, backlog), then queue step (a token); each waits for the replicas
    /// when configured, and a write they did not acknowledge fails the enqueue (the outbox
    /// retries it, then keeps it in the local spool). A repeated enqueue of a job still queued
    /// adds a token again, in case the first one's queue step was lost.
    fn enqueue<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Enqueued>> {
        Box::pin(async move {
            let mut invocation = self.scripts.enqueue.prepare_invoke();
            self.user_step(&mut invocation, job).await?;
            let answer: redis::RedisResult<(u8, Option<Vec<u8>>)> =
                invocation.invoke_async(&mut self.writer()).await;
            let (outcome, state) = answer.map_err(|error| {
                self.user_step_failed(std::slice::from_ref(job), &error);
                redis_error(error)
            })?;
            let result = match state {
                None => Enqueued::Queued,
                Some(state) => Enqueued::Duplicate(decode(&state)?),
            };
            let new = self.counted(job, outcome);
            if outcome != 2 {
                self.queue_step(job, new).await?;
            }
            Ok(result)
        })
    }

    /// Consecutive jobs of one user go in one script (up to `ENQUEUE_RUN`, 64, at a time), then
    /// one token per session: a spool's backlog forwarded one job at a time, two round trips
    /// each on a busy core, went slower than one user's recordings came in.
    fn enqueue_run<'a>(&'a self, jobs: &'a [Job]) -> BoxFuture<'a, Result<usize>> {
        Box::pin(async move {
            let mut queued = 0;
            for chunk in jobs
                .chunk_by(|a, b| a.id.user == b.id.user)
                .flat_map(|same_user| same_user.chunks(ENQUEUE_RUN))
            {
                let taken = match self.enqueue_chunk(chunk).await {
                    Ok(taken) => taken,
                    Err(error) if queued == 0 => return Err(error),
                    Err(error) => {
                        tracing::debug!(%error, queued, "an enqueue run stopped");
                        0
                    }
                };
                queued += taken;
                if taken < chunk.len() {
                    break;
                }
            }
            Ok(queued)
        })
    }

    /// The backlog's score is the turn's arrival, and a claim waits for a noted earlier turn.
    fn orders_by_arrival(&self) -> bool {
        true
    }

    fn claim<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<ClaimedJob>>> {
        Box::pin(async move { Ok(self.claim_batch(consumer, lease, 1).await?.pop()) })
    }

    /// At most one job per session (its head); see [`RedisStore::claim_runs`].
    fn claim_batch<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        Box::pin(self.claim_from_shards(consumer, lease, max, max, 1))
    }

    /// Up to `jobs` jobs, in runs of one session's consecutive jobs from its head, from at most
    /// `sessions` sessions.
    fn claim_runs<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        jobs: usize,
        sessions: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        Box::pin(self.claim_from_shards(consumer, lease, jobs, sessions, jobs))
    }

    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let record_key = self.job_record_key(job);
            let finished: Option<(u64, Option<String>, Option<String>, u64)> = self
                .scripts
                .finish
                .key(&record_key)
                .arg(self.user_prefix(&job.user))
                .arg(&job.key)
                .arg(encode(&state)?)
                .arg(&self.finished_job_ttl_ms)
                // A failed job's exchange is then its only copy.
                .arg(if matches!(state, JobState::Failed { .. }) {
                    "1"
                } else {
                    "0"
                })
                .invoke_async(&mut self.writer())
                .await
                .map_err(redis_error)?;
            let Some((queued, token, session, left)) = finished else {
                return Ok(false);
            };
            // An unreplicated finish keeps its token: if a failover loses the finish, the
            // token brings the job back.
            let released = match (token, session) {
                (Some(token), Some(session))
                    if self.replicated_or_warn(&record_key, "job finish").await =>
                {
                    vec![token, session, left.to_string()]
                }
                _ => Vec::new(),
            };
            self.release_tokens(&job.user, queued, &released).await;
            Ok(true)
        })
    }

    fn job_state<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<Option<JobState>>> {
        Box::pin(async move {
            let state: Option<Vec<u8>> = self
                .connection()
                .hget(self.job_record_key(job), "state")
                .await
                .map_err(redis_error)?;
            state.as_deref().map(decode).transpose()
        })
    }

    /// The sum of the shards' counters (exact unless a process died between the two steps of
    /// an enqueue or a finish).
    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let mut total = 0u64;
            for shard in 0..self.shards.len() {
                let depth: Option<i64> = self
                    .connection()
                    .get(self.shard_key(shard, "depth"))
                    .await
                    .map_err(redis_error)?;
                total += depth.map_or(0, |depth| u64::try_from(depth).unwrap_or(0));
            }
            Ok(total)
        })
    }
}

impl Store for RedisStore {
    /// One script in the user's slot (job check, raw log, state, prefetched, jobs applied),
    /// then the queue step that releases the tokens.
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
            let version_key = self.user_key(user, "version");
            // Large exchanges are referenced, not sent: the script moves each from its job's
            // record to the raw log. If one has gone missing, the entries go whole.
            let mut whole = false;
            let landed = commit_marker(expected_version, state);
            let in_flight = self.commit_in_flight(user, expected_version, state, &landed);
            let (queued, released) = loop {
                let mut invocation = self.scripts.commit.prepare_invoke();
                invocation
                    .key(&version_key)
                    .key(self.user_key(user, "state"))
                    .key(self.user_key(user, "raw"))
                    .key(self.user_key(user, "raw_ids"))
                    .key(self.user_key(user, "prefetched"))
                    .key(self.user_key(user, "items"))
                    .key(self.user_key(user, "changes"))
                    .key(self.user_key(user, "committed"))
                    .key(self.user_key(user, "answer"))
                    .arg(self.user_prefix(user))
                    .arg(expected_version.to_string())
                    .arg(state.version.to_string())
                    .arg(state.meta.as_ref())
                    .arg(&first.exchange.session_id)
                    .arg(encode(prefetched)?)
                    .arg(encode(&JobState::Applied)?)
                    .arg(&self.finished_job_ttl_ms)
                    .arg(state.change(expected_version).encode())
                    .arg(layout::RING)
                    .arg(state.items.len())
                    .arg(&landed);
                for (key, json) in &state.items {
                    invocation.arg(key.field()).arg(json.as_ref());
                }
                for job in jobs {
                    let reference = !whole && is_large(&job.exchange);
                    let exchange = (!reference).then_some(&job.exchange);
                    invocation
                        .arg(&job.id.key)
                        .arg(raw_element(&job.id.key, exchange)?)
                        .arg(if reference { "1" } else { "0" });
                }
                let answer: redis::RedisResult<(String, String, u64, Vec<String>)> =
                    invocation.invoke_async(&mut self.writer()).await;
                let (status, detail, queued, released) = match answer {
                    Ok(answer) => answer,
                    Err(error) if error.is_timeout() => {
                        match self.answer_of_landed(user, &landed).await {
                            Some((queued, released)) => {
                                ("ok".to_owned(), String::new(), queued, released)
                            }
                            None => return Err(redis_error(error)),
                        }
                    }
                    Err(error) => return Err(redis_error(error)),
                };
                match status.as_str() {
                    "ok" => break (queued, released),
                    "gone" => return Err(Error::JobGone(detail)),
                    "conflict" => {
                        return Err(Error::StoreConflict {
                            expected: expected_version,
                            found: parse_version(&detail)?,
                        });
                    }
                    "lost" if !whole => {
                        tracing::warn!(
                            job = detail,
                            "a job's stored exchange is missing; sending the raw entries whole"
                        );
                        whole = true;
                    }
                    other => {
                        return Err(Error::Store(format!("redis: commit said {other:?}")));
                    }
                }
            };
            if let Some(in_flight) = in_flight {
                in_flight.landed();
            }
            let released = if self.replicated_or_warn(&version_key, "job commit").await {
                released
            } else {
                Vec::new()
            };
            self.release_tokens(user, queued, &released).await;
            Ok(())
        })
    }

    /// One script deletes the user's keys; then the user's tokens leave their shard's stream,
    /// a chunk at a time.
    fn forget_user<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<ForgetReport>> {
        Box::pin(async move {
            let mut invocation = self.scripts.forget.prepare_invoke();
            for kind in [
                "state",
                "version",
                "prefetched",
                "raw",
                "raw_ids",
                "job_index",
                "leases",
                "arriving",
                "items",
                "changes",
                "committed",
                "answer",
            ] {
                invocation.key(self.user_key(user, kind));
            }
            let (memory_states, prefetched_sessions, raw_entries, jobs, queued): (
                u64,
                u64,
                u64,
                u64,
                u64,
            ) = invocation
                .arg(self.user_prefix(user))
                .invoke_async(&mut self.writer())
                .await
                .map_err(redis_error)?;
            self.replicated_or_warn(&self.user_key(user, "state"), "forget")
                .await;
            let tag = user_tag(user);
            let shard = self.shard_of(&tag);
            let mut start = "-".to_owned();
            let mut decrement = queued;
            loop {
                let next: Option<String> = self
                    .scripts
                    .forget_tokens
                    .key(self.shard_key(shard, "tokens"))
                    .key(self.shard_key(shard, "depth"))
                    .arg(GROUP)
                    .arg(&tag)
                    .arg(decrement)
                    .arg(&start)
                    .arg(FORGET_CHUNK)
                    .invoke_async(&mut self.writer())
                    .await
                    .map_err(redis_error)?;
                decrement = 0;
                match next {
                    Some(next) => start = next,
                    None => break,
                }
            }
            Ok(ForgetReport {
                memory_states,
                prefetched_sessions,
                raw_entries,
                jobs,
            })
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn tags_round_trip_any_bytes() {
        for (tenant, user) in [
            ("acme", "alice"),
            ("t1:u", "x"),
            ("t1", "u:x"),
            ("", ""),
            ("t\u{0}}{", "ü ser"),
        ] {
            let key = UserKey::new(tenant, user);
            assert_eq!(parse_tag(&user_tag(&key)).unwrap(), key);
        }
        assert_eq!(parse_tag("zz:00"), None);
        assert_eq!(parse_tag("no-colon"), None);
    }

    #[test]
    fn tags_keep_colons_inside_tenant_and_user_apart() {
        let left = user_tag(&UserKey::new("t1:u", "x"));
        let right = user_tag(&UserKey::new("t1", "u:x"));
        assert_ne!(left, right);
        assert!(!left.contains(['{', '}', ' ']));
        assert_eq!(unhex("abc"), None);
    }

    #[test]
    fn a_lease_reaches_the_horizon_when_it_ends() {
        assert_eq!(lease_idle_ms(Duration::ZERO), LEASE_HORIZON_MS);
        assert_eq!(
            lease_idle_ms(Duration::from_secs(30)),
            LEASE_HORIZON_MS - 30_000
        );
        // Longer leases are cut to the horizon rather than wrapping around.
        assert_eq!(lease_idle_ms(Duration::MAX), 0);
    }

    #[test]
    fn queued_exchanges_carry_a_trace_and_old_ones_decode_without() {
        let exchange = ExchangeInput {
            session_id: "s1".into(),
            turn_id: "t1".into(),
            prior_chain: Some(u64::MAX),
            ..ExchangeInput::default()
        };
        let old = encode(&exchange).unwrap();
        let decoded: ClaimedExchange = decode(old.as_bytes()).unwrap();
        assert_eq!((decoded.exchange, decoded.trace), (exchange.clone(), None));

        let trace = TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01");
        let new = queued_json(&exchange, trace).unwrap();
        let decoded: ClaimedExchange = decode(new.as_bytes()).unwrap();
        assert_eq!((decoded.exchange, decoded.trace), (exchange.clone(), trace));
        // Without a trace the stored form is the old one.
        let untraced = queued_json(&exchange, None).unwrap();
        assert_eq!(untraced, old);
    }

    #[test]
    fn options_default_to_the_production_prefix_a_week_of_retention_and_no_wait() {
        let options = RedisOptions::default();
        assert_eq!(options.prefix, "engram");
        assert_eq!(options.finished_job_ttl, Some(Duration::from_secs(604_800)));
        assert_eq!((options.queue_shards, options.wait_replicas), (1, 0));
    }

    #[test]
    fn a_users_keys_and_markers_share_one_slot_and_never_the_queues() {
        let user = UserKey::new("acme", "alice");
        let prefix = format!("engram:{{{}}}:", user_tag(&user));
        let slots: Vec<u16> = ["state", "job:abc", "session:7331", "arriving"]
            .iter()
            .map(|kind| slot(format!("{prefix}{kind}").as_bytes()))
            .collect();
        assert!(slots.windows(2).all(|pair| pair[0] == pair[1]), "{slots:?}");
        assert!(arrival_marker("s 1", "t-1").starts_with(&format!("{} ", hex("s 1"))));
        assert!(
            !queue_tag(0, 1).contains(':'),
            "user tags always have a ':'"
        );
    }
}
