//! The Redis backend: every per-user record under `<prefix>:{<tag>}:<kind>`, where the tag is
//! the hex-encoded tenant and user joined by `:` (hex has no `:`, so `("t1:u", "x")` and
//! `("t1", "u:x")` get different tags, and any byte is safe). One user's keys share the hash tag
//! and so one cluster slot.
//!
//! Each call is one round trip: a single command or one Lua script, so the multi-key updates
//! (version check, idempotent appends, queue moves) are atomic.
//!
//! The job queue is a Redis Stream, `<prefix>:{queue}:jobs`, read by the consumer group
//! `workers`. Per-session order is kept by putting only each session's *head* (its oldest
//! unfinished job) on the stream: later jobs wait in the session's backlog list (a user key),
//! and finishing the head (XACK + XDEL) appends the next one. So every stream entry is
//! claimable the moment no live lease holds it, and a claim is O(1) plus the pending list.
//!
//! Leases live in the pending-entries list. A claim sets the entry's idle time to
//! [`LEASE_HORIZON_MS`] minus the lease, so the entry reaches the horizon exactly when the
//! lease ends, and one `XAUTOCLAIM` with min-idle-time = horizon finds the entries whose
//! consumer died, whatever lease each was given. The attempt is the entry's delivery count.
//! Lease ends are the Redis server's clock, one clock for every worker.
//!
//! Cluster: `claim` and `queue_depth` touch only the queue's keys (one slot, `{queue}`);
//! `enqueue`, `finish` and `forget_user` touch one user's keys and the queue's, which a Redis
//! Cluster rejects as cross-slot (see docs/storage.md).

use std::time::Duration;

use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::{AsyncCommands, Script};
use serde::{Deserialize, Serialize};

use super::{
    Appended, ClaimedJob, EncodedState, Enqueued, ForgetReport, HotRecord, Job, JobId, JobState,
    RawEntry, Store, UserKey, decode,
};
use crate::error::{Error, Result};
use crate::memory::{CandidateId, ExchangeInput, MemoryState};
use crate::pipeline::BoxFuture;
use crate::telemetry::TraceParent;

/// The key prefix when none is given.
pub const DEFAULT_PREFIX: &str = "engram";

/// A raw-log element; its seq is its list index.
#[derive(Serialize, Deserialize)]
struct StoredRawEntry {
    exchange_id: String,
    exchange: ExchangeInput,
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

/// Version, then state unless current or absent, then the session's prefetched candidates.
const HOT_RECORD: &str = r"
local version = redis.call('GET', KEYS[1]) or '0'
local state = false
if version ~= '0' and version ~= ARGV[1] then
  state = redis.call('GET', KEYS[2]) or false
end
local prefetched = redis.call('HGET', KEYS[3], ARGV[2]) or false
return {version, state, prefetched}
";

/// Writes state and version if the stored version equals ARGV[1]; else returns the found one.
const SAVE_STATE: &str = r"
local found = redis.call('GET', KEYS[1]) or '0'
if found ~= ARGV[1] then
  return found
end
redis.call('SET', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], ARGV[3])
return false
";

/// Appends once per exchange id; returns {seq, duplicate (0/1)}.
const APPEND_RAW: &str = r"
local known = redis.call('HGET', KEYS[2], ARGV[1])
if known then
  return {tonumber(known), 1}
end
local seq = redis.call('RPUSH', KEYS[1], ARGV[2]) - 1
redis.call('HSET', KEYS[2], ARGV[1], seq)
return {seq, 0}
";

/// Queues a job once per id; returns the existing job's state (JSON) for a duplicate.
/// KEYS: job record, job index, session backlog, stream, depth. ARGV: job key, exchange JSON,
/// queued state JSON, job ref, hex session, group.
const ENQUEUE: &str = r"
local known = redis.call('HGET', KEYS[1], 'state')
if known then
  return known
end
redis.call('ZADD', KEYS[2], '+inf', ARGV[1])
redis.call('INCR', KEYS[5])
if redis.call('RPUSH', KEYS[3], ARGV[1]) == 1 then
  -- Nothing of the session is unfinished: the job is its head and goes on the stream.
  if redis.call('EXISTS', KEYS[4]) == 0 then
    redis.call('XGROUP', 'CREATE', KEYS[4], ARGV[6], '0', 'MKSTREAM')
  end
  local entry = redis.call('XADD', KEYS[4], '*', 'job', ARGV[4], 'exchange', ARGV[2])
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'session', ARGV[5], 'entry', entry)
else
  -- Waits in the backlog, exchange and all, until the jobs before it finish.
  redis.call('HSET', KEYS[1], 'state', ARGV[3], 'session', ARGV[5], 'exchange', ARGV[2])
end
return false
";

/// Leases a stream entry: first one whose lease ended (XAUTOCLAIM), else a new one
/// (XREADGROUP); then sets its idle time so that it reaches the horizon when this lease ends.
/// Returns {job ref, attempt, exchange JSON} or nil.
/// KEYS: stream. ARGV: group, consumer, lease horizon ms, idle to set (horizon − lease).
const CLAIM: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
local entry = false
-- XAUTOCLAIM scans a bounded part of the pending list per call; go on until it is done.
local cursor = '0-0'
repeat
  local reply = redis.call('XAUTOCLAIM', KEYS[1], ARGV[1], ARGV[2], ARGV[3], cursor, 'COUNT', 1)
  cursor = reply[1]
  entry = reply[2][1] or false
until entry or cursor == '0-0'
if not entry then
  local reply = redis.call('XREADGROUP', 'GROUP', ARGV[1], ARGV[2], 'COUNT', 1,
    'STREAMS', KEYS[1], '>')
  if not reply then
    return false
  end
  entry = reply[1][2][1]
end
local id = entry[1]
-- JUSTID leaves the delivery count alone: it counts XREADGROUP and XAUTOCLAIM deliveries.
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[4], 'JUSTID')
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], id, id, 1)
local fields = {}
for index = 1, #entry[2], 2 do
  fields[entry[2][index]] = entry[2][index + 1]
end
return {fields['job'], pending[1][4], fields['exchange']}
";

/// Records a job's final state; a queued job leaves its session's backlog and, if it was the
/// head, the stream (XACK + XDEL), and the session's next job goes on the stream. Finished
/// records expire after the retention. Returns 0 when the job is unknown.
/// KEYS: job record, job index, stream, depth. ARGV: job key, state JSON, group, user key
/// prefix (`<prefix>:{tag}:`), user tag, retention ms ('' keeps the record).
const FINISH: &str = r"
local record = redis.call('HMGET', KEYS[1], 'state', 'session', 'entry')
if not record[1] then
  return 0
end
local session, entry = record[2], record[3]
if session then
  local backlog = ARGV[4] .. 'session:' .. session
  redis.call('LREM', backlog, 1, ARGV[1])
  redis.call('DECR', KEYS[4])
  if entry then
    redis.call('XACK', KEYS[3], ARGV[3], entry)
    redis.call('XDEL', KEYS[3], entry)
    local next_key = redis.call('LINDEX', backlog, 0)
    if next_key then
      local next_record = ARGV[4] .. 'job:' .. next_key
      local exchange = redis.call('HGET', next_record, 'exchange')
      local next_entry = redis.call('XADD', KEYS[3], '*', 'job', ARGV[5] .. ' ' .. next_key,
        'exchange', exchange)
      redis.call('HSET', next_record, 'entry', next_entry)
      redis.call('HDEL', next_record, 'exchange')
    end
  end
  redis.call('HDEL', KEYS[1], 'session', 'entry', 'exchange')
end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
local time = redis.call('TIME')
local now = tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
if ARGV[6] == '' then
  redis.call('ZADD', KEYS[2], '+inf', ARGV[1])
else
  redis.call('PEXPIRE', KEYS[1], ARGV[6])
  redis.call('ZADD', KEYS[2], now + tonumber(ARGV[6]), ARGV[1])
end
-- Index entries of records that have expired by now.
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', '(' .. now)
return 1
";

/// Deletes every key of one user and their stream entries; returns counts per kind.
/// KEYS: state, version, prefetched, raw, raw ids, job index, stream, depth.
/// ARGV: user key prefix (`<prefix>:{tag}:`), group.
const FORGET: &str = r"
local states = redis.call('EXISTS', KEYS[1])
local prefetched = redis.call('HLEN', KEYS[3])
local raw = redis.call('LLEN', KEYS[4])
local jobs, queued = 0, 0
for _, key in ipairs(redis.call('ZRANGE', KEYS[6], 0, -1)) do
  local record = ARGV[1] .. 'job:' .. key
  local fields = redis.call('HMGET', record, 'session', 'entry')
  if fields[1] then
    queued = queued + 1
    redis.call('DEL', ARGV[1] .. 'session:' .. fields[1])
  end
  if fields[2] then
    redis.call('XACK', KEYS[7], ARGV[2], fields[2])
    redis.call('XDEL', KEYS[7], fields[2])
  end
  jobs = jobs + redis.call('DEL', record)
end
if queued > 0 then
  redis.call('DECRBY', KEYS[8], queued)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6])
return {states, prefetched, raw, jobs}
";

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
    /// worker or the recorder; the hot path has its own, shorter deadline).
    pub response_timeout: Duration,
}

impl Default for RedisOptions {
    fn default() -> RedisOptions {
        RedisOptions {
            prefix: DEFAULT_PREFIX.to_owned(),
            finished_job_ttl: Some(DEFAULT_FINISHED_JOB_TTL),
            connect_timeout: Duration::from_secs(2),
            response_timeout: Duration::from_secs(2),
        }
    }
}

#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: String,
    /// The retention in ms as a script argument; empty keeps finished records.
    finished_job_ttl_ms: String,
    scripts: std::sync::Arc<Scripts>,
}

struct Scripts {
    hot_record: Script,
    save_state: Script,
    append_raw: Script,
    enqueue: Script,
    claim: Script,
    finish: Script,
    forget: Script,
}

impl RedisStore {
    /// Connects to `url` (e.g. `redis://127.0.0.1:6379`) with every key under `prefix` and the
    /// default retention of finished jobs.
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisStore> {
        let options = RedisOptions {
            prefix: prefix.to_owned(),
            ..RedisOptions::default()
        };
        RedisStore::connect_with(url, options).await
    }

    /// Connects to `url` with the given options.
    pub async fn connect_with(url: &str, options: RedisOptions) -> Result<RedisStore> {
        let client = redis::Client::open(url).map_err(redis_error)?;
        // Reconnects back off from 10 ms up to 1 s, so a restarted server is found quickly.
        let config = ConnectionManagerConfig::new()
            .set_connection_timeout(options.connect_timeout)
            .set_response_timeout(options.response_timeout)
            .set_exponent_base(2)
            .set_factor(10)
            .set_max_delay(1000)
            .set_number_of_retries(6);
        let connection = ConnectionManager::new_with_config(client, config)
            .await
            .map_err(redis_error)?;
        Ok(RedisStore {
            connection,
            prefix: options.prefix,
            finished_job_ttl_ms: options
                .finished_job_ttl
                // At least 1 ms: PEXPIRE 0 would delete the record at once.
                .map(|ttl| duration_ms(ttl).clamp(1, MAX_TTL_MS).to_string())
                .unwrap_or_default(),
            scripts: std::sync::Arc::new(Scripts {
                hot_record: Script::new(HOT_RECORD),
                save_state: Script::new(SAVE_STATE),
                append_raw: Script::new(APPEND_RAW),
                enqueue: Script::new(ENQUEUE),
                claim: Script::new(CLAIM),
                finish: Script::new(FINISH),
                forget: Script::new(FORGET),
            }),
        })
    }

    /// The start of every key of one user: `<prefix>:{<tag>}:`.
    fn user_prefix(&self, user: &UserKey) -> String {
        format!("{}:{{{}}}:", self.prefix, user_tag(user))
    }

    /// A key of one user: `<prefix>:{<tag>}:<kind>`.
    fn user_key(&self, user: &UserKey, kind: &str) -> String {
        format!("{}{kind}", self.user_prefix(user))
    }

    /// A job's record: a hash of its state and, while queued, its session and stream entry.
    fn job_record_key(&self, job: &JobId) -> String {
        format!("{}job:{}", self.user_prefix(&job.user), job.key)
    }

    /// A key of the queue; `{queue}` keeps them on one cluster slot (no user tag is `queue`,
    /// as tags are hex).
    fn queue_key(&self, kind: &str) -> String {
        format!("{}:{{queue}}:{kind}", self.prefix)
    }

    fn connection(&self) -> ConnectionManager {
        self.connection.clone()
    }
}

fn duration_ms(duration: Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}

/// The idle time a claim gives its entry, so it reaches the horizon when the lease ends.
fn lease_idle_ms(lease: Duration) -> u64 {
    LEASE_HORIZON_MS - duration_ms(lease).min(LEASE_HORIZON_MS)
}

/// The hash-tag content of a user: hex tenant, `:`, hex user.
fn user_tag(user: &UserKey) -> String {
    format!("{}:{}", hex(&user.tenant), hex(&user.user))
}

/// A job's ref in its stream entry: the user's tag, a space, the job key.
fn job_ref(job: &JobId) -> String {
    format!("{} {}", user_tag(&job.user), job.key)
}

fn parse_job_ref(member: &str) -> Result<JobId> {
    let malformed = || Error::Store(format!("malformed job ref on the stream: {member:?}"));
    let (tag, key) = member.split_once(' ').ok_or_else(malformed)?;
    let (tenant, user) = tag.split_once(':').ok_or_else(malformed)?;
    Ok(JobId {
        user: UserKey::new(
            unhex(tenant).ok_or_else(malformed)?,
            unhex(user).ok_or_else(malformed)?,
        ),
        key: key.to_owned(),
    })
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

fn redis_error(error: redis::RedisError) -> Error {
    Error::Store(format!("redis: {error}"))
}

fn encode<T: Serialize + ?Sized>(value: &T) -> Result<String> {
    serde_json::to_string(value).map_err(|error| Error::Store(format!("encode: {error}")))
}

fn parse_version(text: &str) -> Result<u64> {
    text.parse()
        .map_err(|_| Error::Store(format!("stored version is not a number: {text:?}")))
}

impl Store for RedisStore {
    fn hot_record<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        Box::pin(async move {
            let (version, state, prefetched): (String, Option<Vec<u8>>, Option<Vec<u8>>) = self
                .scripts
                .hot_record
                .key(self.user_key(user, "version"))
                .key(self.user_key(user, "state"))
                .key(self.user_key(user, "prefetched"))
                .arg(
                    cached_version
                        .map(|version| version.to_string())
                        .unwrap_or_default(),
                )
                .arg(session_id)
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            Ok(HotRecord {
                version: parse_version(&version)?,
                state: state.as_deref().map(decode).transpose()?,
                prefetched: match prefetched {
                    Some(bytes) => decode(&bytes)?,
                    None => Vec::new(),
                },
            })
        })
    }

    fn load_state<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Option<MemoryState>>> {
        Box::pin(async move {
            let state: Option<Vec<u8>> = self
                .connection()
                .get(self.user_key(user, "state"))
                .await
                .map_err(redis_error)?;
            state.as_deref().map(decode).transpose()
        })
    }

    fn save_encoded_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a EncodedState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move {
            let found: Option<String> = self
                .scripts
                .save_state
                .key(self.user_key(user, "version"))
                .key(self.user_key(user, "state"))
                .arg(expected_version.to_string())
                .arg(state.version.to_string())
                .arg(state.json.as_slice())
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            match found {
                None => Ok(()),
                Some(found) => Err(Error::StoreConflict {
                    expected: expected_version,
                    found: parse_version(&found)?,
                }),
            }
        })
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
            let entry = StoredRawEntry {
                exchange_id: exchange_id.to_owned(),
                exchange: exchange.clone(),
            };
            let (seq, duplicate): (u64, u8) = self
                .scripts
                .append_raw
                .key(self.user_key(user, "raw"))
                .key(self.user_key(user, "raw_ids"))
                .arg(exchange_id)
                .arg(encode(&entry)?)
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
            stored
                .iter()
                .zip(0u64..)
                .map(|(bytes, seq)| {
                    let entry: StoredRawEntry = decode(bytes)?;
                    Ok(RawEntry {
                        seq,
                        exchange_id: entry.exchange_id,
                        exchange: entry.exchange,
                    })
                })
                .collect()
        })
    }

    fn enqueue<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Enqueued>> {
        Box::pin(async move {
            let user = &job.id.user;
            let session = hex(&job.exchange.session_id);
            let known: Option<Vec<u8>> = self
                .scripts
                .enqueue
                .key(self.job_record_key(&job.id))
                .key(self.user_key(user, "job_index"))
                .key(self.user_key(user, &format!("session:{session}")))
                .key(self.queue_key("jobs"))
                .key(self.queue_key("depth"))
                .arg(&job.id.key)
                .arg(encode(&QueuedExchange {
                    exchange: &job.exchange,
                    trace: job.trace,
                })?)
                .arg(encode(&JobState::Queued)?)
                .arg(job_ref(&job.id))
                .arg(session)
                .arg(GROUP)
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            match known {
                None => Ok(Enqueued::Queued),
                Some(state) => Ok(Enqueued::Duplicate(decode(&state)?)),
            }
        })
    }

    fn claim<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<ClaimedJob>>> {
        Box::pin(async move {
            let claimed: Option<(String, u32, Vec<u8>)> = self
                .scripts
                .claim
                .key(self.queue_key("jobs"))
                .arg(GROUP)
                .arg(consumer)
                .arg(LEASE_HORIZON_MS)
                .arg(lease_idle_ms(lease))
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            let Some((job_ref, attempt, exchange)) = claimed else {
                return Ok(None);
            };
            let claimed: ClaimedExchange = decode(&exchange)?;
            Ok(Some(ClaimedJob {
                job: Job {
                    id: parse_job_ref(&job_ref)?,
                    exchange: claimed.exchange,
                    trace: claimed.trace,
                },
                attempt,
            }))
        })
    }

    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let finished: i64 = self
                .scripts
                .finish
                .key(self.job_record_key(job))
                .key(self.user_key(&job.user, "job_index"))
                .key(self.queue_key("jobs"))
                .key(self.queue_key("depth"))
                .arg(&job.key)
                .arg(encode(&state)?)
                .arg(GROUP)
                .arg(self.user_prefix(&job.user))
                .arg(user_tag(&job.user))
                .arg(&self.finished_job_ttl_ms)
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            Ok(finished == 1)
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

    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            let depth: Option<i64> = self
                .connection()
                .get(self.queue_key("depth"))
                .await
                .map_err(redis_error)?;
            Ok(depth.map_or(0, |depth| u64::try_from(depth).unwrap_or(0)))
        })
    }

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
            ] {
                invocation.key(self.user_key(user, kind));
            }
            let (memory_states, prefetched_sessions, raw_entries, jobs): (u64, u64, u64, u64) =
                invocation
                    .key(self.queue_key("jobs"))
                    .key(self.queue_key("depth"))
                    .arg(self.user_prefix(user))
                    .arg(GROUP)
                    .invoke_async(&mut self.connection())
                    .await
                    .map_err(redis_error)?;
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
    fn job_refs_round_trip_any_bytes() {
        for (tenant, user, key) in [
            ("acme", "alice", "hash-1"),
            ("t1:u", "x", "k"),
            ("t1", "u:x", "k"),
            ("", "", ""),
            ("t\u{0}}{", "ü ser", "key with spaces"),
        ] {
            let id = JobId {
                user: UserKey::new(tenant, user),
                key: key.to_owned(),
            };
            assert_eq!(parse_job_ref(&job_ref(&id)).unwrap(), id);
        }
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
        let new = encode(&QueuedExchange {
            exchange: &exchange,
            trace,
        })
        .unwrap();
        let decoded: ClaimedExchange = decode(new.as_bytes()).unwrap();
        assert_eq!((decoded.exchange, decoded.trace), (exchange.clone(), trace));
        // Without a trace the stored form is the old one.
        let untraced = encode(&QueuedExchange {
            exchange: &exchange,
            trace: None,
        })
        .unwrap();
        assert_eq!(untraced, old);
    }

    #[test]
    fn options_default_to_the_production_prefix_and_a_week_of_retention() {
        let options = RedisOptions::default();
        assert_eq!(options.prefix, "engram");
        assert_eq!(options.finished_job_ttl, Some(Duration::from_secs(604_800)));
    }
}
