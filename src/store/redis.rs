//! The Redis backend: every per-user record under `<prefix>:{<tag>}:<kind>`, where the tag is
//! the hex-encoded tenant and user joined by `:` (hex has no `:`, so `("t1:u", "x")` and
//! `("t1", "u:x")` get different tags, and any byte is safe). One user's keys share the hash tag
//! and so one cluster slot.
//!
//! Each call is one round trip: a single command or one Lua script, so the multi-key updates
//! (version check, idempotent appends, queue moves) are atomic.
//!
//! The job queue is global, in keys of its own (`<prefix>:queue*`): a sorted set of queued job
//! refs by queue position, plus hashes of leases, attempts and sessions. Scripts that move a job
//! touch both the queue keys and the user's keys, which a Redis Cluster would reject as
//! cross-slot; cluster mode is for the scale-out work (see docs/storage.md).

use std::time::Duration;

use redis::aio::ConnectionManager;
use redis::{AsyncCommands, Script};
use serde::{Deserialize, Serialize};

use super::{
    Appended, ClaimedJob, Enqueued, ForgetReport, HotRecord, Job, JobId, JobState, RawEntry, Store,
    UserKey, decode, now_ms,
};
use crate::error::{Error, Result};
use crate::memory::{CandidateId, ExchangeInput, MemoryState};
use crate::pipeline::BoxFuture;

/// The key prefix when none is given.
pub const DEFAULT_PREFIX: &str = "engram";

/// A raw-log element; its seq is its list index.
#[derive(Serialize, Deserialize)]
struct StoredRawEntry {
    exchange_id: String,
    exchange: ExchangeInput,
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
const ENQUEUE: &str = r"
local known = redis.call('HGET', KEYS[2], ARGV[1])
if known then
  return known
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
local position = redis.call('INCR', KEYS[4])
redis.call('ZADD', KEYS[3], position, ARGV[4])
redis.call('HSET', KEYS[5], ARGV[4], ARGV[5])
return false
";

/// Leases the oldest queued job without a live lease whose session has no earlier job under a
/// live lease. Returns {job ref, attempt, exchange JSON} or nil. ARGV: now ms, lease ms, prefix.
const CLAIM: &str = r"
local now = tonumber(ARGV[1])
local busy = {}
-- In pages, so a claim near the head of a long queue does not read all of it.
local start = 0
while true do
  local members = redis.call('ZRANGE', KEYS[1], start, start + 99)
  if #members == 0 then
    return false
  end
  for _, member in ipairs(members) do
    local session = redis.call('HGET', KEYS[4], member) or member
    local until_ms = tonumber(redis.call('HGET', KEYS[2], member) or '0')
    if until_ms > now then
      busy[session] = true
    elseif not busy[session] then
      redis.call('HSET', KEYS[2], member, now + tonumber(ARGV[2]))
      local attempt = redis.call('HINCRBY', KEYS[3], member, 1)
      local space = string.find(member, ' ', 1, true)
      local tag = string.sub(member, 1, space - 1)
      local key = string.sub(member, space + 1)
      local exchange = redis.call('HGET', ARGV[3] .. ':{' .. tag .. '}:jobs', key)
      return {member, attempt, exchange}
    end
  end
  start = start + 100
end
";

/// Records a job's final state and takes it off the queue; 0 when the job is unknown.
const FINISH: &str = r"
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
redis.call('ZREM', KEYS[2], ARGV[2])
redis.call('HDEL', KEYS[3], ARGV[2])
redis.call('HDEL', KEYS[4], ARGV[2])
redis.call('HDEL', KEYS[5], ARGV[2])
return 1
";

/// Deletes every key of one user and their queue entries; returns counts per kind.
/// KEYS: state, version, prefetched, raw, raw ids, jobs, job states, queue, leases, attempts,
/// sessions. ARGV: the user's tag.
const FORGET: &str = r"
local states = redis.call('EXISTS', KEYS[1])
local prefetched = redis.call('HLEN', KEYS[3])
local raw = redis.call('LLEN', KEYS[4])
local jobs = redis.call('HKEYS', KEYS[7])
for _, key in ipairs(jobs) do
  local member = ARGV[1] .. ' ' .. key
  redis.call('ZREM', KEYS[8], member)
  redis.call('HDEL', KEYS[9], member)
  redis.call('HDEL', KEYS[10], member)
  redis.call('HDEL', KEYS[11], member)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7])
return {states, prefetched, raw, #jobs}
";

#[derive(Clone)]
pub struct RedisStore {
    connection: ConnectionManager,
    prefix: String,
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
    /// Connects to `url` (e.g. `redis://127.0.0.1:6379`); every key starts with `prefix`, so
    /// several stores (tests, deployments) can share one server.
    pub async fn connect(url: &str, prefix: &str) -> Result<RedisStore> {
        let client = redis::Client::open(url).map_err(redis_error)?;
        let connection = ConnectionManager::new(client).await.map_err(redis_error)?;
        Ok(RedisStore {
            connection,
            prefix: prefix.to_owned(),
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

    /// A key of one user: `<prefix>:{<tag>}:<kind>`.
    fn user_key(&self, user: &UserKey, kind: &str) -> String {
        format!("{}:{{{}}}:{kind}", self.prefix, user_tag(user))
    }

    /// A key of the global queue.
    fn queue_key(&self, kind: &str) -> String {
        format!("{}:{kind}", self.prefix)
    }

    fn queue_keys(&self) -> [String; 4] {
        [
            self.queue_key("queue"),
            self.queue_key("queue_leases"),
            self.queue_key("queue_attempts"),
            self.queue_key("queue_sessions"),
        ]
    }

    fn connection(&self) -> ConnectionManager {
        self.connection.clone()
    }
}

/// The hash-tag content of a user: hex tenant, `:`, hex user.
fn user_tag(user: &UserKey) -> String {
    format!("{}:{}", hex(&user.tenant), hex(&user.user))
}

/// A job's member in the queue keys: the user's tag, a space, the job key.
fn job_ref(job: &JobId) -> String {
    format!("{} {}", user_tag(&job.user), job.key)
}

fn parse_job_ref(member: &str) -> Result<JobId> {
    let malformed = || Error::Store(format!("malformed job ref in the queue: {member:?}"));
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

    fn save_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a MemoryState,
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
                .arg(encode(state)?)
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
            // Jobs of one session share this; claim passes over a busy session's later jobs.
            let session = format!("{} {}", user_tag(user), hex(&job.exchange.session_id));
            let known: Option<Vec<u8>> = self
                .scripts
                .enqueue
                .key(self.user_key(user, "jobs"))
                .key(self.user_key(user, "job_states"))
                .key(self.queue_key("queue"))
                .key(self.queue_key("queue_next_position"))
                .key(self.queue_key("queue_sessions"))
                .arg(&job.id.key)
                .arg(encode(&job.exchange)?)
                .arg(encode(&JobState::Queued)?)
                .arg(job_ref(&job.id))
                .arg(session)
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
        // The consumer is not stored: a lease is only its end time.
        let _ = consumer;
        Box::pin(async move {
            let [queue, leases, attempts, sessions] = self.queue_keys();
            let lease_ms = u64::try_from(lease.as_millis()).unwrap_or(u64::MAX);
            let claimed: Option<(String, u32, Vec<u8>)> = self
                .scripts
                .claim
                .key(queue)
                .key(leases)
                .key(attempts)
                .key(sessions)
                .arg(now_ms())
                .arg(lease_ms)
                .arg(&self.prefix)
                .invoke_async(&mut self.connection())
                .await
                .map_err(redis_error)?;
            let Some((member, attempt, exchange)) = claimed else {
                return Ok(None);
            };
            Ok(Some(ClaimedJob {
                job: Job {
                    id: parse_job_ref(&member)?,
                    exchange: decode(&exchange)?,
                },
                attempt,
            }))
        })
    }

    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>> {
        Box::pin(async move {
            let [queue, leases, attempts, sessions] = self.queue_keys();
            let finished: i64 = self
                .scripts
                .finish
                .key(self.user_key(&job.user, "job_states"))
                .key(queue)
                .key(leases)
                .key(attempts)
                .key(sessions)
                .arg(&job.key)
                .arg(job_ref(job))
                .arg(encode(&state)?)
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
                .hget(self.user_key(&job.user, "job_states"), &job.key)
                .await
                .map_err(redis_error)?;
            state.as_deref().map(decode).transpose()
        })
    }

    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>> {
        Box::pin(async move {
            self.connection()
                .zcard(self.queue_key("queue"))
                .await
                .map_err(redis_error)
        })
    }

    fn forget_user<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<ForgetReport>> {
        Box::pin(async move {
            let [queue, leases, attempts, sessions] = self.queue_keys();
            let mut invocation = self.scripts.forget.prepare_invoke();
            for kind in [
                "state",
                "version",
                "prefetched",
                "raw",
                "raw_ids",
                "jobs",
                "job_states",
            ] {
                invocation.key(self.user_key(user, kind));
            }
            let (memory_states, prefetched_sessions, raw_entries, jobs): (u64, u64, u64, u64) =
                invocation
                    .key(queue)
                    .key(leases)
                    .key(attempts)
                    .key(sessions)
                    .arg(user_tag(user))
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
}
