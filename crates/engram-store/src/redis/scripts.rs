//! The Lua scripts of the Redis store. Each touches the keys of one hash slot only: either one
//! user's (`<prefix>:{<user tag>}:…`) or one queue shard's (`<prefix>:{queue-…}:…`), so each
//! runs on a Redis Cluster as it does on one server. Keys a script derives from the user prefix
//! it is given (a job record, a session backlog) share the user's hash tag.
//!
//! Numbers that leave Lua as command arguments go through `int()`: Lua 5.1 prints large
//! numbers (microsecond times) in exponent notation with 14 digits otherwise.

use redis::Script;

/// Helpers prepended to the scripts that need them.
const COMMON: &str = r"
local function int(n)
  return string.format('%.0f', n)
end
local function clock()
  local time = redis.call('TIME')
  local seconds, micros = tonumber(time[1]), tonumber(time[2])
  return seconds * 1000 + math.floor(micros / 1000), seconds * 1000000 + micros
end
";

/// Ends one job (ARGV-independent, shared by FINISH and COMMIT): records its final state; a
/// queued job leaves its session's backlog, and if it held the session's lease, the lease ends
/// and its token is returned for the queue step. Its exchange goes, unless `keep_exchange` (a
/// failed job's is then the only copy): it stays, inline or under `jobx:<key>`, as long as the
/// record. Finished records expire after the retention. Returns nil for an unknown job, else
/// {queued (0/1), token or false, session or false, jobs left in the session}.
const FINISH_JOB: &str = r"
local function finish_job(prefix, key, state, retention, now_ms, keep_exchange)
  local record = prefix .. 'job:' .. key
  local stored = prefix .. 'jobx:' .. key
  local fields = redis.call('HMGET', record, 'state', 'session')
  if not fields[1] then
    return nil
  end
  local queued, token, session, left = 0, false, fields[2] or false, 0
  if session then
    queued = 1
    local backlog = prefix .. 'session:' .. session
    redis.call('ZREM', backlog, key)
    if redis.call('HGET', prefix .. 'leases', session) == key then
      -- A run's lease moves on to its next job, which is the new head, while the run's
      -- lease on it is live; the token is released with the run's last job.
      local held = redis.call('HGET', record, 'token')
      local following = redis.call('ZRANGE', backlog, 0, 0)[1]
      local lease = following
        and redis.call('HMGET', prefix .. 'job:' .. following, 'token', 'until')
      if held and lease and lease[1] == held and lease[2] and tonumber(lease[2]) > now_ms then
        redis.call('HSET', prefix .. 'leases', session, following)
      else
        redis.call('HDEL', prefix .. 'leases', session)
        token = held or false
      end
    end
    left = redis.call('ZCARD', backlog)
    redis.call('HDEL', record, 'session', 'attempts', 'token', 'until')
    if not keep_exchange then
      redis.call('HDEL', record, 'exchange')
      redis.call('DEL', stored)
    end
  end
  redis.call('HSET', record, 'state', state)
  local index = prefix .. 'job_index'
  if retention == '' then
    redis.call('ZADD', index, '+inf', key)
  else
    redis.call('PEXPIRE', record, retention)
    redis.call('PEXPIRE', stored, retention)
    redis.call('ZADD', index, int(now_ms + tonumber(retention)), key)
  end
  -- Index entries of records that have expired by now.
  redis.call('ZREMRANGEBYSCORE', index, '-inf', '(' .. int(now_ms))
  return {queued, token, session, left}
end
";

/// Takes a value the client staged under its own key (see `RedisStore::stage`) or, when the
/// argument is not empty, the argument itself: writes it to `key` with no expiry. A staged
/// value is renamed into place, never read, because every string that enters Lua is hashed
/// byte by byte, and the server runs nothing else meanwhile.
const PLACE: &str = r"
local function place(key, inline, staged)
  if inline ~= '' then
    redis.call('SET', key, inline)
  else
    redis.call('RENAME', staged, key)
    redis.call('PERSIST', key)
  end
end
local function staged_missing(inline, staged)
  return inline == '' and redis.call('EXISTS', staged) == 0
end
local STAGED_EXPIRED = 'staged value expired before its script ran'
";

/// Creates the shard's stream and consumer group when missing.
const ENSURE_GROUP: &str = r"
local function ensure_group(stream, group)
  if redis.call('EXISTS', stream) == 0 then
    redis.call('XGROUP', 'CREATE', stream, group, '0', 'MKSTREAM')
  end
end
";

/// Version; when the caller's cached version is older, what brings it up to date: the hot
/// state and the items changed since (`delta`), found by following the change ring from the
/// cached version, or word that it must read the whole memory (`whole`: no cached version, or
/// one the ring no longer reaches); then the session's prefetched candidates. With a marker,
/// notes the turn as arriving (its job will follow) and keeps the arrivals key alive for the
/// grace. Returns {version, 'none'|'delta'|'whole', hot state or false, fields, values,
/// prefetched or false, unapplied}: `unapplied` is the newest jobs of the session's backlog
/// (at most ARGV[7] of them, no older one once ARGV[8] bytes were taken), oldest first, each
/// its queued exchange JSON. When the newest job commit is one the caller has in flight
/// (`committed` holds one of the `<version>:<fingerprint>` it lists, at the current version),
/// the status is 'landed' and the hot state's place holds that entry: the caller has the memory
/// already, and a long run's items need not travel back to the process that wrote them. With
/// ARGV[10] = '1' (the caller is catching its copy up by another read) and a cached version,
/// a memory that moved otherwise answers 'behind', with nothing to bring it up to date.
/// KEYS: version, state, items, changes, prefetched, arriving, session backlog, committed.
/// ARGV: cached version or '', session id, marker or '', arrival µs, marker ttl ms, user
/// prefix, most jobs, most bytes, the caller's job commits in flight (comma-separated) or '',
/// '1' for no update.
const HOT_RECORD: &str = r"
local version = redis.call('GET', KEYS[1]) or '0'
local status, meta, fields, values = 'none', false, {}, {}
local landed = false
if version ~= '0' and version ~= ARGV[1] and ARGV[9] ~= '' then
  landed = redis.call('GET', KEYS[8])
  if not (landed and string.sub(landed, 1, #version + 1) == version .. ':'
    and string.find(',' .. ARGV[9] .. ',', ',' .. landed .. ',', 1, true)) then
    landed = false
  end
end
if landed then
  status, meta = 'landed', landed
elseif version ~= '0' and version ~= ARGV[1] and ARGV[1] ~= '' and ARGV[10] == '1' then
  status = 'behind'
elseif version ~= '0' and version ~= ARGV[1] then
  status = 'whole'
  if ARGV[1] ~= '' then
    -- Back from the newest write, a few entries at a time, to the one written on the cached
    -- version: a reader is usually a write or two behind, so it need not copy all of the
    -- ring's entries into the script.
    local want, wanted = version, {}
    local last = redis.call('LLEN', KEYS[4]) - 1
    while status == 'whole' and last >= 0 do
      local first = math.max(0, last - 7)
      local entries = redis.call('LRANGE', KEYS[4], first, last)
      for index = #entries, 1, -1 do
        local previous, written, list = string.match(entries[index], '^(%d+) (%d+) ?(.*)$')
        if written ~= want then
          first = 0
          break
        end
        for field in string.gmatch(list or '', '[^,]+') do
          wanted[field] = true
        end
        if previous == ARGV[1] then
          status = 'delta'
          break
        end
        want = previous
      end
      last = first - 1
    end
    if status == 'delta' then
      meta = redis.call('GET', KEYS[2]) or false
      for field in pairs(wanted) do
        table.insert(fields, field)
      end
      table.sort(fields)
      for from = 1, #fields, 500 do
        local chunk = {}
        for index = from, math.min(from + 499, #fields) do
          table.insert(chunk, fields[index])
        end
        for _, value in ipairs(redis.call('HMGET', KEYS[3], unpack(chunk))) do
          table.insert(values, value)
        end
      end
    end
  end
end
local prefetched = redis.call('HGET', KEYS[5], ARGV[2]) or false
if ARGV[3] ~= '' then
  redis.call('ZADD', KEYS[6], ARGV[4], ARGV[3])
  redis.call('PEXPIRE', KEYS[6], ARGV[5])
end
local unapplied = {}
local newest = redis.call('ZRANGE', KEYS[7], -tonumber(ARGV[7]), -1)
local taken = 0
for index = #newest, 1, -1 do
  local exchange = redis.call('HGET', ARGV[6] .. 'job:' .. newest[index], 'exchange')
    or redis.call('GET', ARGV[6] .. 'jobx:' .. newest[index])
  if exchange then
    table.insert(unapplied, 1, exchange)
    taken = taken + #exchange
    if taken >= tonumber(ARGV[8]) then
      break
    end
  end
end
return {version, status, meta, fields, values, prefetched, unapplied}
";

/// Writes a memory's hot state and items, and records the write in the change ring (an empty
/// `change` starts the ring over: a conversion from the earlier layout).
const WRITE_MEMORY: &str = r"
local function write_memory(state, items, changes, meta, change, ring, args, from, to)
  redis.call('SET', state, meta)
  for index = from, to, 2 do
    redis.call('HSET', items, args[index], args[index + 1])
  end
  if change == '' then
    redis.call('DEL', changes)
  else
    redis.call('RPUSH', changes, change)
    redis.call('LTRIM', changes, -tonumber(ring), -1)
  end
end
";

/// Writes the memory (see `write_memory`) and version if the stored version equals ARGV[1];
/// else returns the found one.
/// KEYS: version, state, items, changes. ARGV: expected version, new version, hot state JSON,
/// change entry or '', ring size, then (field, item JSON) per item.
const SAVE_STATE: &str = r"
local found = redis.call('GET', KEYS[1]) or '0'
if found ~= ARGV[1] then
  return found
end
write_memory(KEYS[2], KEYS[3], KEYS[4], ARGV[3], ARGV[4], ARGV[5], ARGV, 6, #ARGV)
redis.call('SET', KEYS[1], ARGV[2])
return false
";

/// Appends once per exchange id; returns {seq, duplicate (0/1)}. The element is a whole entry,
/// or (ARGV[3] = '1') a reference whose exchange was staged and moves to the entry's key.
/// KEYS: raw, raw ids, staged exchange, entry key. ARGV: exchange id, element JSON, reference.
const APPEND_RAW: &str = r"
local known = redis.call('HGET', KEYS[2], ARGV[1])
if known then
  redis.call('DEL', KEYS[3])
  return {tonumber(known), 1}
end
if ARGV[3] == '1' then
  if redis.call('EXISTS', KEYS[3]) == 0 then
    return redis.error_reply(STAGED_EXPIRED)
  end
  place(KEYS[4], '', KEYS[3])
end
local seq = redis.call('RPUSH', KEYS[1], ARGV[2]) - 1
redis.call('HSET', KEYS[2], ARGV[1], seq)
return {seq, 0}
";

/// The user step of an enqueue: the job record and its place in the session's backlog, ranked
/// by arrival time (or, without one, after the backlog's last job); the turn's arrival marker
/// goes. A small exchange is a field of the record; a large one was staged and moves to
/// `jobx:<key>`. Returns {0} for a new job, {1, state} for a known job still queued, {2, state}
/// for a finished one, or an error reply (nothing written).
/// k: job record, job index, session backlog, arriving, staged exchange, job exchange.
/// a: job key, exchange JSON or '' (staged), queued state JSON, hex session, arrival µs or '',
/// marker.
const ENQUEUE_JOB: &str = r"
local function enqueue_job(k, a)
  local known = redis.call('HMGET', k[1], 'state', 'session')
  if known[1] then
    redis.call('DEL', k[5])
    if known[2] then
      return {1, known[1]}
    end
    return {2, known[1]}
  end
  if staged_missing(a[2], k[5]) then
    return redis.error_reply(STAGED_EXPIRED)
  end
  redis.call('ZREM', k[4], a[6])
  local score = tonumber(a[5])
  if not score then
    local _, now_us = clock()
    score = now_us
    local last = redis.call('ZRANGE', k[3], -1, -1, 'WITHSCORES')
    if last[2] and tonumber(last[2]) >= score then
      score = tonumber(last[2]) + 1
    end
  end
  redis.call('ZADD', k[2], '+inf', a[1])
  redis.call('ZADD', k[3], int(score), a[1])
  redis.call('HSET', k[1], 'state', a[3], 'session', a[4])
  if a[2] ~= '' then
    redis.call('HSET', k[1], 'exchange', a[2])
  else
    place(k[6], '', k[5])
  end
  return {0, false}
end
";

/// One job's user step (see `enqueue_job`). KEYS and ARGV: its six each.
const ENQUEUE: &str = r"
return enqueue_job(KEYS, ARGV)
";

/// The user steps of several jobs of one user, in order (see `enqueue_job`), six keys and six
/// arguments each; stops at the first that fails. Returns {outcome, state or false} per job
/// written, then the failure's message if one failed (the jobs after it are not tried).
const ENQUEUE_MANY: &str = r"
local results = {}
for first = 1, #KEYS, 6 do
  local result = enqueue_job(
    {unpack(KEYS, first, first + 5)},
    {unpack(ARGV, first, first + 5)})
  if result.err then
    table.insert(results, result.err)
    return results
  end
  table.insert(results, {result[1], result[2] or false})
end
return results
";

/// The queue step of an enqueue: a token saying the session has work, and the depth.
/// KEYS: stream, depth. ARGV: group, user tag, hex session, new jobs to count.
const ADD_TOKEN: &str = r"
ensure_group(KEYS[1], ARGV[1])
redis.call('XADD', KEYS[1], '*', 'u', ARGV[2], 's', ARGV[3])
if tonumber(ARGV[4]) > 0 then
  redis.call('INCRBY', KEYS[2], ARGV[4])
end
return 1
";

/// Settles the previous token of a claim (drops it, or postpones it by setting its idle time),
/// then, unless ARGV[8] is '1', leases the next one: first one whose lease ended
/// (XAUTOCLAIM), else a new one (XREADGROUP); its idle time is set so that it reaches the
/// horizon when this lease ends. Returns {entry id, user tag, hex session} or nil. A shard
/// left with no token has no job queued or leased (a session with work holds one until its
/// last job's finish releases it, in the step that lowers the depth), so its depth is set to
/// 0: a process that died between the two steps of a finish left it too high, and the lag
/// estimate read a queue that never shrank. The token leased is also noted under the claim's
/// own `claimed` key (the claim's id and the entry id, one per line, nothing of the user, so
/// a forget leaves nothing behind; two minutes, while the reads after a timeout take up to 15
/// response timeouts), so a claimer whose answer timed out can learn which token it holds
/// instead of leaving it leased to nobody.
/// KEYS: stream, depth, claimed. ARGV: group, consumer, lease horizon ms, idle to set (horizon
/// − lease), drop id or '', postpone id or '', postpone idle, settle only, claim id.
const CLAIM_TOKEN: &str = r"
if ARGV[5] ~= '' then
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[5])
  redis.call('XDEL', KEYS[1], ARGV[5])
end
if ARGV[6] ~= '' then
  redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[6], 'IDLE', ARGV[7], 'JUSTID')
end
if redis.call('XLEN', KEYS[1]) == 0 then
  if tonumber(redis.call('GET', KEYS[2]) or '0') ~= 0 then
    redis.call('SET', KEYS[2], 0)
  end
  return false
end
if ARGV[8] == '1' then
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
-- JUSTID leaves the delivery count alone.
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, id, 'IDLE', ARGV[4], 'JUSTID')
local fields = {}
for index = 1, #entry[2], 2 do
  fields[entry[2][index]] = entry[2][index + 1]
end
redis.call('SET', KEYS[3], ARGV[9] .. '\n' .. id, 'PX', 120000)
return {id, fields['u'] or '', fields['s'] or ''}
";

/// The user step of a claim, for a token of the session: leases a run of the session's jobs
/// from its head, up to ARGV[6] of them, unless the session has no job ('empty'), another
/// token's lease on it is live ('busy'), or a turn of the session that arrived before the head
/// is still being recorded ('wait', ms: until its marker is older than the grace). The run
/// stops before a job that such a turn arrived before. `leases` names the run's first job,
/// and moves on as its jobs finish (`finish_job`). Leasing again under a token whose lease on
/// a job is live (a claimer whose answer timed out, asking again) does not count an attempt.
/// Returns {'job', false, {key, …}, {attempt,
/// …}, {exchange JSON, …}} otherwise, with false for an exchange that is not a field of its
/// record: the client reads a large one from `jobx:<key>` with a plain GET, which copies it
/// once instead of hashing it in Lua.
/// KEYS: session backlog, leases, arriving. ARGV: user prefix, hex session, token, lease ms,
/// grace µs, jobs at most.
const LEASE: &str = r"
local head = redis.call('ZRANGE', KEYS[1], 0, math.max(1, tonumber(ARGV[6])) - 1, 'WITHSCORES')
if not head[1] then
  return {'empty', false, {}, {}, {}}
end
local now_ms, now_us = clock()
local held = redis.call('HGET', KEYS[2], ARGV[2])
if held then
  local lease = redis.call('HMGET', ARGV[1] .. 'job:' .. held, 'token', 'until')
  if lease[1] and lease[1] ~= ARGV[3] and tonumber(lease[2]) > now_ms then
    return {'busy', false, {}, {}, {}}
  end
end
local grace = tonumber(ARGV[5])
redis.call('ZREMRANGEBYSCORE', KEYS[3], '-inf', '(' .. int(now_us - grace))
-- The session's earliest turn still being recorded: the run ends before the jobs after it.
local mine = ARGV[2] .. ' '
local last = head[#head]
local recording = false
local earlier = redis.call('ZRANGEBYSCORE', KEYS[3], '-inf', '(' .. last, 'WITHSCORES')
for index = 1, #earlier, 2 do
  if string.sub(earlier[index], 1, #mine) == mine then
    recording = tonumber(earlier[index + 1])
    break
  end
end
if recording and recording < tonumber(head[2]) then
  local wait_us = recording + grace - now_us
  return {'wait', math.max(1, math.ceil(wait_us / 1000)), {}, {}, {}}
end
local keys, attempts, exchanges = {}, {}, {}
local until_ms = int(now_ms + tonumber(ARGV[4]))
for index = 1, #head, 2 do
  if recording and recording < tonumber(head[index + 1]) then
    break
  end
  local key = head[index]
  local record = ARGV[1] .. 'job:' .. key
  table.insert(keys, key)
  local live = redis.call('HMGET', record, 'token', 'until', 'attempts')
  if live[1] == ARGV[3] and tonumber(live[2] or '0') > now_ms then
    table.insert(attempts, tonumber(live[3] or '1'))
  else
    table.insert(attempts, redis.call('HINCRBY', record, 'attempts', 1))
  end
  redis.call('HSET', record, 'token', ARGV[3], 'until', until_ms)
  table.insert(exchanges, redis.call('HGET', record, 'exchange') or false)
end
redis.call('HSET', KEYS[2], ARGV[2], head[1])
return {'job', false, keys, attempts, exchanges}
";

/// Ends one job. Returns nil when it is unknown, else what `finish_job` returns.
/// KEYS: job record. ARGV: user prefix, job key, state JSON, retention ms ('' keeps it), keep
/// the exchange ('1'/'0').
const FINISH: &str = r"
local now_ms = clock()
return finish_job(ARGV[1], ARGV[2], ARGV[3], ARGV[4], now_ms, ARGV[5] == '1') or false
";

/// The worker's whole write for applied jobs, atomically: every job must still exist, the
/// version must match; then the raw-log appends, the memory (hot state, changed items, change
/// ring: see `write_memory`), version, prefetched candidates, and the jobs marked applied. A
/// raw-log element is a whole entry, or a reference: the job's stored exchange then moves
/// (renamed, or for a record that holds it inline, copied) to the entry's key, so a large
/// exchange is not sent again. Returns {'gone', job key, 0, {}}, {'conflict', found version, 0,
/// {}}, {'lost', job key, 0, {}} (a reference whose job has no stored exchange: nothing was
/// written, send the entry whole) or {'ok', '', queued jobs finished, {token, session, jobs
/// left, …}}.
/// `committed` takes the commit's `<version>:<fingerprint>`, by which the committing process's
/// hot reads know their own commit (see HOT_RECORD). `answer` keeps that and the 'ok' answer's
/// queue step (one line each: queued, then token, session, jobs left per lease) for ten
/// minutes, so a committer whose answer timed out can learn that the commit landed.
/// KEYS: version, state, raw, raw ids, prefetched, items, changes, committed, answer. ARGV: user
/// prefix, expected version, new version, hot state JSON, prefetched session, prefetched JSON,
/// applied state JSON, retention, change entry, ring size, item count N, the commit's
/// `<version>:<fingerprint>`, then (field, item JSON) per item, then (job key, raw-log element
/// JSON, reference '1'/'0') per job.
const COMMIT: &str = r"
local items_to = 12 + 2 * tonumber(ARGV[11])
local jobs_from = items_to + 1
for index = jobs_from, #ARGV, 3 do
  if redis.call('EXISTS', ARGV[1] .. 'job:' .. ARGV[index]) == 0 then
    return {'gone', ARGV[index], 0, {}}
  end
end
local found = redis.call('GET', KEYS[1]) or '0'
if found ~= ARGV[2] then
  return {'conflict', found, 0, {}}
end
for index = jobs_from, #ARGV, 3 do
  local key = ARGV[index]
  if ARGV[index + 2] == '1' and not redis.call('HGET', KEYS[4], key)
    and redis.call('EXISTS', ARGV[1] .. 'jobx:' .. key) == 0
    and redis.call('HEXISTS', ARGV[1] .. 'job:' .. key, 'exchange') == 0 then
    return {'lost', key, 0, {}}
  end
end
for index = jobs_from, #ARGV, 3 do
  local key = ARGV[index]
  if not redis.call('HGET', KEYS[4], key) then
    if ARGV[index + 2] == '1' then
      local entry = ARGV[1] .. 'rawx:' .. key
      local stored = ARGV[1] .. 'jobx:' .. key
      if redis.call('EXISTS', stored) == 1 then
        place(entry, '', stored)
      else
        place(entry, redis.call('HGET', ARGV[1] .. 'job:' .. key, 'exchange'), stored)
      end
    end
    local seq = redis.call('RPUSH', KEYS[3], ARGV[index + 1]) - 1
    redis.call('HSET', KEYS[4], key, seq)
  end
end
write_memory(KEYS[2], KEYS[6], KEYS[7], ARGV[4], ARGV[9], ARGV[10], ARGV, 13, items_to)
redis.call('SET', KEYS[1], ARGV[3])
redis.call('SET', KEYS[8], ARGV[12])
redis.call('HSET', KEYS[5], ARGV[5], ARGV[6])
local now_ms = clock()
local queued, tokens = 0, {}
for index = jobs_from, #ARGV, 3 do
  local finished = finish_job(ARGV[1], ARGV[index], ARGV[7], ARGV[8], now_ms, false)
  if finished then
    queued = queued + finished[1]
    if finished[2] then
      table.insert(tokens, finished[2])
      table.insert(tokens, finished[3])
      table.insert(tokens, finished[4])
    end
  end
end
local answer = ARGV[12] .. '\n' .. queued
if #tokens > 0 then
  answer = answer .. '\n' .. table.concat(tokens, '\n')
end
redis.call('SET', KEYS[9], answer, 'PX', 600000)
return {'ok', '', queued, tokens}
";

/// The queue step after jobs finished: their tokens leave the stream (a session with jobs left
/// gets a fresh token in their place) and the depth goes down.
/// KEYS: stream, depth. ARGV: group, user tag, finished queued jobs, then (token, hex session,
/// jobs left) per released lease.
const RELEASE_TOKENS: &str = r"
ensure_group(KEYS[1], ARGV[1])
for index = 4, #ARGV, 3 do
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[index])
  redis.call('XDEL', KEYS[1], ARGV[index])
  if tonumber(ARGV[index + 2]) > 0 then
    redis.call('XADD', KEYS[1], '*', 'u', ARGV[2], 's', ARGV[index + 1])
  end
end
if tonumber(ARGV[3]) > 0 then
  if redis.call('DECRBY', KEYS[2], ARGV[3]) < 0 then
    redis.call('SET', KEYS[2], 0)
  end
end
return 1
";

/// Deletes every key of one user; returns counts per kind and the queued jobs among them.
/// KEYS: state, version, prefetched, raw, raw ids, job index, leases, arriving, items,
/// changes, committed, answer. ARGV: user prefix.
const FORGET: &str = r"
local states = redis.call('EXISTS', KEYS[1])
local prefetched = redis.call('HLEN', KEYS[3])
local raw = redis.call('LLEN', KEYS[4])
for _, id in ipairs(redis.call('HKEYS', KEYS[5])) do
  redis.call('DEL', ARGV[1] .. 'rawx:' .. id)
end
local jobs, queued = 0, 0
for _, key in ipairs(redis.call('ZRANGE', KEYS[6], 0, -1)) do
  local record = ARGV[1] .. 'job:' .. key
  local session = redis.call('HGET', record, 'session')
  if session then
    queued = queued + 1
    redis.call('DEL', ARGV[1] .. 'session:' .. session)
  end
  redis.call('DEL', ARGV[1] .. 'jobx:' .. key)
  jobs = jobs + redis.call('DEL', record)
end
redis.call('DEL', KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6], KEYS[7], KEYS[8])
redis.call('DEL', KEYS[9], KEYS[10], KEYS[11], KEYS[12])
return {states, prefetched, raw, jobs, queued}
";

/// The queue step of a forget, one chunk of the stream at a time: deletes the user's tokens
/// (leased or not) and, on the first chunk, lowers the depth. Returns the exclusive start of
/// the next chunk, or nil at the end.
/// KEYS: stream, depth. ARGV: group, user tag, decrement, start, count.
const FORGET_TOKENS: &str = r"
if tonumber(ARGV[3]) > 0 then
  if redis.call('DECRBY', KEYS[2], ARGV[3]) < 0 then
    redis.call('SET', KEYS[2], 0)
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then
  return false
end
local entries = redis.call('XRANGE', KEYS[1], ARGV[4], '+', 'COUNT', ARGV[5])
for _, entry in ipairs(entries) do
  local fields = entry[2]
  for index = 1, #fields, 2 do
    if fields[index] == 'u' and fields[index + 1] == ARGV[2] then
      redis.call('XACK', KEYS[1], ARGV[1], entry[1])
      redis.call('XDEL', KEYS[1], entry[1])
    end
  end
end
if #entries < tonumber(ARGV[5]) then
  return false
end
return '(' .. entries[#entries][1]
";

/// Removes consumers of the group that hold no token and have been idle at least ARGV[2] ms
/// (workers that stopped); returns how many.
/// KEYS: stream. ARGV: group, idle ms.
const PRUNE_CONSUMERS: &str = r"
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local removed = 0
for _, consumer in ipairs(redis.call('XINFO', 'CONSUMERS', KEYS[1], ARGV[1])) do
  local fields = {}
  for index = 1, #consumer, 2 do
    fields[consumer[index]] = consumer[index + 1]
  end
  if fields['pending'] == 0 and fields['idle'] >= tonumber(ARGV[2]) then
    redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], fields['name'])
    removed = removed + 1
  end
end
return removed
";

/// A whole memory read at once, for a memory that kept changing between plain reads: every
/// value passes through Lua, so it is the fallback, not the rule.
/// KEYS: version, state, items. Returns {version or nil, state or nil, flat field/value list}.
const READ_WHOLE: &str = r"
return {redis.call('GET', KEYS[1]), redis.call('GET', KEYS[2]), redis.call('HGETALL', KEYS[3])}
";

pub struct Scripts {
    pub hot_record: Script,
    pub read_whole: Script,
    pub save_state: Script,
    pub append_raw: Script,
    pub enqueue: Script,
    pub enqueue_many: Script,
    pub add_token: Script,
    pub claim_token: Script,
    pub lease: Script,
    pub finish: Script,
    pub commit: Script,
    pub release_tokens: Script,
    pub forget: Script,
    pub forget_tokens: Script,
    pub prune_consumers: Script,
}

impl Scripts {
    pub fn new() -> Scripts {
        let with = |parts: &[&str]| Script::new(&parts.concat());
        Scripts {
            hot_record: Script::new(HOT_RECORD),
            read_whole: Script::new(READ_WHOLE),
            save_state: with(&[WRITE_MEMORY, SAVE_STATE]),
            append_raw: with(&[PLACE, APPEND_RAW]),
            enqueue: with(&[COMMON, PLACE, ENQUEUE_JOB, ENQUEUE]),
            enqueue_many: with(&[COMMON, PLACE, ENQUEUE_JOB, ENQUEUE_MANY]),
            add_token: with(&[ENSURE_GROUP, ADD_TOKEN]),
            claim_token: Script::new(CLAIM_TOKEN),
            lease: with(&[COMMON, LEASE]),
            finish: with(&[COMMON, FINISH_JOB, FINISH]),
            commit: with(&[COMMON, FINISH_JOB, PLACE, WRITE_MEMORY, COMMIT]),
            release_tokens: with(&[ENSURE_GROUP, RELEASE_TOKENS]),
            forget: Script::new(FORGET),
            forget_tokens: Script::new(FORGET_TOKENS),
            prune_consumers: Script::new(PRUNE_CONSUMERS),
        }
    }
}
