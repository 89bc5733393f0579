//! The Redis store: the shared store suite against a real `redis-server`, one server per case
//! on a free loopback port, killed when the case ends; then the queue's Redis side (the stream,
//! its pending list, retention) looked at directly.
//!
//! Without `redis-server` on PATH the cases are skipped, unless `ENGRAM_REQUIRE_REDIS=1`
//! (set by `scripts/test.sh`, so CI never skips silently).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;
mod store_suite;

use std::time::Duration;

use common::redis::RedisServer;
use engram_memory::ItemRef;
use engram_store::redis::{DEFAULT_FINISHED_JOB_TTL, LEASE_HORIZON_MS, queue_tag};
use engram_store::{
    Enqueued, Job, JobQueue, JobState, MemoryRecords, RedisOptions, RedisStore, Store, UserKey,
};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use store_suite::{exchange, job, job_in, large_job, state_with};

/// Starts a server on a free port; `None` when redis-server is missing and not required.
async fn start_server() -> Option<(String, RedisServer)> {
    let server = RedisServer::start().await?;
    Some((server.url(), server))
}

const PREFIX: &str = "engram-test";

/// The one queue shard's stream of a store with the default options.
fn stream() -> String {
    format!("{PREFIX}:{{{}}}:tokens", queue_tag(0, 1))
}

async fn fresh_store() -> Option<(RedisStore, RedisServer)> {
    let (url, server) = start_server().await?;
    let store = RedisStore::connect(&url, PREFIX).await.unwrap();
    Some((store, server))
}

store_suite!(optional fresh_store);

/// A store with the given options (the test prefix), and a plain connection to look at its
/// keys.
async fn store_with(
    options: RedisOptions,
) -> Option<(RedisStore, MultiplexedConnection, RedisServer)> {
    let (url, server) = start_server().await?;
    let options = RedisOptions {
        prefix: PREFIX.to_owned(),
        ..options
    };
    let store = RedisStore::connect_with(&url, options).await.unwrap();
    let connection = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    Some((store, connection, server))
}

/// A store with the given retention, and a plain connection to look at its keys.
async fn store_and_connection(
    finished_job_ttl: Option<Duration>,
) -> Option<(RedisStore, MultiplexedConnection, RedisServer)> {
    store_with(RedisOptions {
        finished_job_ttl,
        ..RedisOptions::default()
    })
    .await
}

/// The hash tag of a user, as the store writes it.
fn tag(user: &UserKey) -> String {
    let hex = |text: &str| -> String { text.bytes().map(|byte| format!("{byte:02x}")).collect() };
    format!("{}:{}", hex(&user.tenant), hex(&user.user))
}

fn hex(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

/// The stream's pending list: (entry id, consumer, idle ms, deliveries).
async fn pending(connection: &mut MultiplexedConnection) -> Vec<(String, String, u64, u32)> {
    redis::cmd("XPENDING")
        .arg(stream())
        .arg("workers")
        .arg("-")
        .arg("+")
        .arg(100)
        .query_async(connection)
        .await
        .unwrap()
}

/// The tokens on the stream, oldest first: (user tag, hex session).
async fn tokens(connection: &mut MultiplexedConnection) -> Vec<(String, String)> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(stream())
        .arg("-")
        .arg("+")
        .query_async(connection)
        .await
        .unwrap();
    entries
        .into_iter()
        .map(|(_, fields)| {
            let field = |name: &str| {
                fields
                    .iter()
                    .find(|(field, _)| field == name)
                    .unwrap()
                    .1
                    .clone()
            };
            (field("u"), field("s"))
        })
        .collect()
}

fn token(user: &UserKey, session: &str) -> (String, String) {
    (tag(user), hex(session))
}

/// Every key matching `pattern`.
async fn keys_matching(connection: &mut MultiplexedConnection, pattern: &str) -> Vec<String> {
    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(pattern)
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await
            .unwrap();
        keys.extend(found);
        if next == 0 {
            return keys;
        }
        cursor = next;
    }
}

/// A key of `user`: `<prefix>:{<tag>}:<kind>`.
fn user_key(user: &UserKey, kind: &str) -> String {
    format!("{PREFIX}:{{{}}}:{kind}", tag(user))
}

/// The raw log's elements as stored (whole entries or references).
async fn raw_elements(
    connection: &mut MultiplexedConnection,
    user: &UserKey,
) -> Vec<serde_json::Value> {
    let stored: Vec<String> = connection
        .lrange(user_key(user, "raw"), 0, -1)
        .await
        .unwrap();
    stored
        .iter()
        .map(|element| serde_json::from_str(element).unwrap())
        .collect()
}

/// Enqueues job `key` in `session` of `user`, claims it and records its exchange in `state`:
/// the claimed job and the state to commit for it.
async fn claim_and_record(
    store: &RedisStore,
    user: &UserKey,
    session: &str,
    key: &str,
    state: &mut engram_memory::MemoryState,
) -> (Job, engram_store::EncodedState) {
    store.enqueue(&job_in(user, session, key)).await.unwrap();
    let claimed = store
        .claim("w", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    engram_memory::record_exchange(
        state,
        &claimed.job.exchange,
        &engram_memory::HeuristicExtractor,
        &engram_memory::MemoryConfig::default(),
    );
    (claimed.job, engram_store::EncodedState::of(state).unwrap())
}

/// A state large enough to be staged.
fn large_state(user: &UserKey) -> engram_memory::MemoryState {
    let mut state = state_with(&["I live in Lisbon."]);
    for key in ["earlier-1", "earlier-2", "earlier-3"] {
        engram_memory::record_exchange(
            &mut state,
            &large_job(user, "s0", key).exchange,
            &engram_memory::HeuristicExtractor,
            &engram_memory::MemoryConfig::default(),
        );
    }
    state
}

#[tokio::test]
async fn a_dead_consumers_token_is_autoclaimed_once_its_lease_ends() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let queued = job(&alice, "hash-1");
    store.enqueue(&queued).await.unwrap();

    let claimed = store
        .claim("worker-a", Duration::from_millis(500))
        .await
        .unwrap()
        .unwrap();
    assert_eq!((claimed.job, claimed.attempt), (queued.clone(), 1));
    // The token's lease is its idle time, 500 ms short of the horizon.
    let [(_, consumer, idle, deliveries)] = pending(&mut connection).await.try_into().unwrap();
    assert_eq!((consumer.as_str(), deliveries), ("worker-a", 1));
    assert!(
        (LEASE_HORIZON_MS - 500..LEASE_HORIZON_MS).contains(&idle),
        "{idle}"
    );
    let lease = Duration::from_secs(30);
    assert!(store.claim("worker-b", lease).await.unwrap().is_none());

    // worker-a never acknowledges; XAUTOCLAIM hands the token to worker-b, and the job's own
    // lease (in the user's slot) has ended too.
    tokio::time::sleep(Duration::from_millis(650)).await;
    let again = store.claim("worker-b", lease).await.unwrap().unwrap();
    assert_eq!(
        (again.job.id.clone(), again.attempt),
        (queued.id.clone(), 2)
    );
    let [(_, consumer, idle, deliveries)] = pending(&mut connection).await.try_into().unwrap();
    assert_eq!((consumer.as_str(), deliveries), ("worker-b", 2));
    assert!(idle < LEASE_HORIZON_MS - 29_000, "{idle}");

    // The acknowledgement takes the token off the pending list and the stream.
    assert!(store.ack(&queued.id).await.unwrap());
    assert!(pending(&mut connection).await.is_empty());
    assert!(tokens(&mut connection).await.is_empty());
    assert_eq!(store.queue_depth().await.unwrap(), 0);
}

#[tokio::test]
async fn tokens_are_interchangeable_and_surplus_ones_are_dropped() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let bob = UserKey::new("acme", "bob");
    let alice_jobs: Vec<Job> = ["a1", "a2", "a3"]
        .into_iter()
        .map(|key| job_in(&alice, "s1", key))
        .collect();
    let bob_job = job_in(&bob, "s1", "b1");
    for queued in alice_jobs.iter().chain([&bob_job]) {
        store.enqueue(queued).await.unwrap();
    }
    // One token per job; the backlog (in Alice's slot) holds the order.
    let alice_s1 = token(&alice, "s1");
    let bob_s1 = token(&bob, "s1");
    assert_eq!(
        tokens(&mut connection).await,
        [
            alice_s1.clone(),
            alice_s1.clone(),
            alice_s1.clone(),
            bob_s1.clone()
        ]
    );
    assert_eq!(store.queue_depth().await.unwrap(), 4);

    // Alice's head goes first; her other tokens find it leased and are dropped on the way to
    // Bob's.
    let lease = Duration::from_secs(30);
    let first = store.claim("worker-a", lease).await.unwrap().unwrap();
    assert_eq!(first.job.id, alice_jobs[0].id);
    let second = store.claim("worker-a", lease).await.unwrap().unwrap();
    assert_eq!(second.job.id, bob_job.id);
    assert_eq!(
        tokens(&mut connection).await,
        [alice_s1.clone(), bob_s1.clone()]
    );
    assert!(store.claim("worker-a", lease).await.unwrap().is_none());

    // Finishing the head swaps its token for a fresh one, since the session has jobs left.
    store.ack(&first.job.id).await.unwrap();
    assert_eq!(
        tokens(&mut connection).await,
        [bob_s1.clone(), alice_s1.clone()]
    );
    let next = store.claim("worker-a", lease).await.unwrap().unwrap();
    assert_eq!(next.job.id, alice_jobs[1].id);
    assert_eq!(store.queue_depth().await.unwrap(), 3);
}

/// A store whose arrival notes hold a session's later jobs for `grace`.
async fn store_with_grace(grace: Duration) -> Option<(RedisStore, RedisServer)> {
    let options = RedisOptions {
        order_grace: grace,
        ..RedisOptions::default()
    };
    let (store, _connection, server) = store_with(options).await?;
    Some((store, server))
}

/// A job of `user`'s session s1 whose turn arrived at `arrival` (µs since the epoch).
fn arrived(user: &UserKey, key: &str, arrival: u64) -> Job {
    let mut job = job_in(user, "s1", key);
    job.exchange.arrival = Some(arrival);
    job
}

#[tokio::test]
async fn a_sessions_jobs_apply_in_arrival_order_and_wait_for_a_turn_still_recording() {
    let Some((store, _server)) = store_with_grace(Duration::from_millis(400)).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let lease = Duration::from_secs(30);
    let arriving = |key: &str, arrival: u64| arrived(&alice, key, arrival);
    let now = engram_proxy::cache::first_version();

    // Recorded out of order (another replica was slower): applied in arrival order.
    let (early, late) = (arriving("t1", now), arriving("t2", now + 1_000));
    store.enqueue(&late).await.unwrap();
    store.enqueue(&early).await.unwrap();
    let first = store.claim("w", lease).await.unwrap().unwrap();
    assert_eq!(first.job.id, early.id);
    store.ack(&early.id).await.unwrap();
    let second = store.claim("w", lease).await.unwrap().unwrap();
    assert_eq!(second.job.id, late.id);
    store.ack(&late.id).await.unwrap();

    // t3 arrived (the hot path noted it) but is still being recorded; t4, which arrived after
    // it, waits for its job…
    let at = now + 10_000;
    store
        .hot_record_arriving(&alice, "s1", None, "t3", at)
        .await
        .unwrap();
    let t4 = arriving("t4", at + 1_000);
    store.enqueue(&t4).await.unwrap();
    assert!(store.claim("w", lease).await.unwrap().is_none());
    let t3 = arriving("t3", at);
    store.enqueue(&t3).await.unwrap();
    assert_eq!(
        store.claim("w", lease).await.unwrap().unwrap().job.id,
        t3.id
    );
    store.ack(&t3.id).await.unwrap();
    assert_eq!(
        store.claim("w", lease).await.unwrap().unwrap().job.id,
        t4.id
    );
    store.ack(&t4.id).await.unwrap();

    // A turn whose request failed ends its note, and holds nothing back. (It "arrives" 10 s
    // ahead, so only ending the note, not the grace, can release the job behind it.)
    let failed_at = now + 10_000_000;
    store
        .hot_record_arriving(&alice, "s1", None, "failed", failed_at)
        .await
        .unwrap();
    let after_failed = arriving("after-failed", failed_at + 1_000);
    store.enqueue(&after_failed).await.unwrap();
    assert!(store.claim("w", lease).await.unwrap().is_none());
    store.end_arrival(&alice, "s1", "failed").await.unwrap();
    let nudge = arriving("nudge", failed_at + 2_000);
    store.enqueue(&nudge).await.unwrap();
    let claimed = store.claim("w", lease).await.unwrap().unwrap();
    assert_eq!(claimed.job.id, after_failed.id);
    store.ack(&after_failed.id).await.unwrap();
    assert_eq!(
        store.claim("w", lease).await.unwrap().unwrap().job.id,
        nudge.id
    );
    store.ack(&nudge.id).await.unwrap();

    // …and a turn whose replica died holds the next one back for the grace at most.
    let later = engram_proxy::cache::first_version();
    store
        .hot_record_arriving(&alice, "s1", None, "t5", later)
        .await
        .unwrap();
    let t6 = arriving("t6", later + 1_000);
    store.enqueue(&t6).await.unwrap();
    assert!(store.claim("w", lease).await.unwrap().is_none());
    tokio::time::sleep(Duration::from_millis(600)).await;
    assert_eq!(
        store.claim("w", lease).await.unwrap().unwrap().job.id,
        t6.id
    );
}

/// A run of a session's jobs stops before a job that a turn still being recorded arrived
/// before, so that turn's job still applies in its place.
#[tokio::test]
async fn a_run_stops_before_a_turn_still_recording() {
    let Some((store, _server)) = store_with_grace(Duration::from_secs(60)).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let lease = Duration::from_secs(30);
    let arriving = |key: &str, arrival: u64| arrived(&alice, key, arrival);
    let at = engram_proxy::cache::first_version();
    let (t1, t2) = (arriving("t1", at), arriving("t2", at + 1_000));
    store.enqueue(&t1).await.unwrap();
    store.enqueue(&t2).await.unwrap();
    store
        .hot_record_arriving(&alice, "s1", None, "t3", at + 2_000)
        .await
        .unwrap();
    let t4 = arriving("t4", at + 3_000);
    store.enqueue(&t4).await.unwrap();
    let keys = |run: &[engram_store::ClaimedJob]| -> Vec<String> {
        run.iter()
            .map(|claimed| claimed.job.id.key.clone())
            .collect()
    };
    let run = store.claim_runs("w", lease, 10, 1).await.unwrap();
    assert_eq!(keys(&run), ["t1", "t2"], "t4 waits for t3");
    for claimed in &run {
        store.ack(&claimed.job.id).await.unwrap();
    }
    let t3 = arriving("t3", at + 2_000);
    store.enqueue(&t3).await.unwrap();
    let run = store.claim_runs("w", lease, 10, 1).await.unwrap();
    assert_eq!(keys(&run), ["t3", "t4"]);
}

#[tokio::test]
async fn consumers_that_left_are_pruned() {
    let Some((store, mut connection, _server)) = store_with(RedisOptions {
        consumer_idle: Duration::from_millis(200),
        ..RedisOptions::default()
    })
    .await
    else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let lease = Duration::from_secs(30);
    for (key, session) in [("a1", "s1"), ("a2", "s2")] {
        store.enqueue(&job_in(&alice, session, key)).await.unwrap();
    }
    // `gone` finished its job and stopped; `holding` still holds one.
    let done = store.claim("gone", lease).await.unwrap().unwrap();
    store.ack(&done.job.id).await.unwrap();
    store.claim("holding", lease).await.unwrap().unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(store.prune_consumers().await.unwrap(), 1);
    let consumers: Vec<Vec<redis::Value>> = redis::cmd("XINFO")
        .arg("CONSUMERS")
        .arg(stream())
        .arg("workers")
        .query_async(&mut connection)
        .await
        .unwrap();
    let names: Vec<String> = consumers
        .iter()
        .map(|fields| redis::from_redis_value(&fields[1]).unwrap())
        .collect();
    assert_eq!(names, ["holding"]);
}

#[tokio::test]
async fn with_wait_an_enqueue_needs_a_replica() {
    let Some((url, _server)) = start_server().await else {
        return;
    };
    let options = RedisOptions {
        prefix: PREFIX.to_owned(),
        wait_replicas: 1,
        wait_timeout: Duration::from_millis(100),
        ..RedisOptions::default()
    };
    let store = RedisStore::connect_with(&url, options).await.unwrap();
    let alice = UserKey::new("acme", "alice");
    let queued = job(&alice, "hash-1");
    // No replica acknowledges: the enqueue fails (the outbox would retry, then spool it)…
    let error = store.enqueue(&queued).await.unwrap_err();
    assert!(error.to_string().contains("replicas"), "{error}");

    // …and with one, the retry goes through.
    let port = url.rsplit(':').next().unwrap();
    let Some(_replica) = RedisServer::start_replica_of(port.parse().unwrap()).await else {
        return;
    };
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match store.enqueue(&queued).await {
            Ok(outcome) => {
                assert_eq!(outcome, Enqueued::Duplicate(JobState::Queued));
                break;
            }
            Err(error) => assert!(std::time::Instant::now() < deadline, "{error}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let claimed = store
        .claim("w", Duration::from_secs(30))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(claimed.job, queued);
}

#[tokio::test]
async fn several_queue_shards_serve_every_session() {
    let Some((store, mut connection, _server)) = store_with(RedisOptions {
        queue_shards: 4,
        ..RedisOptions::default()
    })
    .await
    else {
        return;
    };
    store_suite::random_operations_follow_a_model_of_sessions(&store).await;
    store_suite::concurrent_claims_never_share_a_job(&store).await;
    // Users' tokens spread over the shards.
    for user in 0..16 {
        let user = UserKey::new("spread", format!("u{user}"));
        store.enqueue(&job(&user, "k")).await.unwrap();
    }
    let mut used = 0;
    for shard in 0..4 {
        let length: u64 = redis::cmd("XLEN")
            .arg(format!("{PREFIX}:{{{}}}:tokens", queue_tag(shard, 4)))
            .query_async(&mut connection)
            .await
            .unwrap();
        used += usize::from(length > 0);
    }
    assert!(used >= 3, "{used}");
    // A batch comes from one shard; the next batches serve the others.
    let mut claimed = 0;
    for _ in 0..4 {
        let batch = store
            .claim_batch("w", Duration::from_secs(30), 100)
            .await
            .unwrap();
        assert!(!batch.is_empty());
        claimed += batch.len();
    }
    assert_eq!(claimed, 16);
    assert!(
        store
            .claim_batch("w", Duration::from_secs(30), 100)
            .await
            .unwrap()
            .is_empty()
    );
}

#[tokio::test]
async fn finished_jobs_expire_after_the_retention() {
    let ttl = Duration::from_millis(500);
    let Some((store, mut connection, _server)) = store_and_connection(Some(ttl)).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let lease = Duration::from_secs(30);
    let first = job(&alice, "hash-1");
    store.enqueue(&first).await.unwrap();
    store.claim("worker-a", lease).await.unwrap().unwrap();
    store.ack(&first.id).await.unwrap();

    let record = format!("{PREFIX}:{{{}}}:job:hash-1", tag(&alice));
    let left: i64 = connection.pttl(&record).await.unwrap();
    assert!((1..=500).contains(&left), "{left}");
    assert_eq!(
        store.enqueue(&first).await.unwrap(),
        Enqueued::Duplicate(JobState::Applied)
    );

    // After the retention the job is unknown, and the user's job index forgets it on the
    // user's next finish.
    tokio::time::sleep(Duration::from_millis(650)).await;
    assert_eq!(store.job_state(&first.id).await.unwrap(), None);
    let second = job(&alice, "hash-2");
    store.enqueue(&second).await.unwrap();
    store.claim("worker-a", lease).await.unwrap().unwrap();
    store.fail(&second.id, "gave up").await.unwrap();
    let index: Vec<String> = connection
        .zrange(format!("{PREFIX}:{{{}}}:job_index", tag(&alice)), 0, -1)
        .await
        .unwrap();
    assert_eq!(index, ["hash-2"]);
    // A replay after the retention is queued again (applying it twice is harmless).
    assert_eq!(store.enqueue(&first).await.unwrap(), Enqueued::Queued);
}

#[tokio::test]
async fn finished_jobs_are_kept_without_a_retention() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let first = job(&alice, "hash-1");
    store.enqueue(&first).await.unwrap();
    store.ack(&first.id).await.unwrap();
    let record = format!("{PREFIX}:{{{}}}:job:hash-1", tag(&alice));
    let left: i64 = connection.pttl(&record).await.unwrap();
    assert_eq!(left, -1);
    assert_eq!(
        store.job_state(&first.id).await.unwrap(),
        Some(JobState::Applied)
    );
}

#[tokio::test]
async fn default_retention_is_a_week() {
    let Some((url, _server)) = start_server().await else {
        return;
    };
    let store = RedisStore::connect(&url, PREFIX).await.unwrap();
    let alice = UserKey::new("acme", "alice");
    let first = job(&alice, "hash-1");
    store.enqueue(&first).await.unwrap();
    store.ack(&first.id).await.unwrap();
    let mut connection = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let left: i64 = connection
        .pttl(format!("{PREFIX}:{{{}}}:job:hash-1", tag(&alice)))
        .await
        .unwrap();
    let week = i64::try_from(DEFAULT_FINISHED_JOB_TTL.as_millis()).unwrap();
    assert!((week - 10_000..=week).contains(&left), "{left}");
}

#[tokio::test]
async fn forget_leaves_no_key_and_no_entry_of_the_user() {
    let Some((store, mut connection, _server)) =
        store_and_connection(Some(Duration::from_secs(60))).await
    else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let bob = UserKey::new("acme", "bob");
    store
        .save_state(&alice, &state_with(&["My name is Alice."]), 0)
        .await
        .unwrap();
    store
        .save_prefetched(&alice, "s1", &[ItemRef::Fact(0)])
        .await
        .unwrap();
    store
        .append_raw(&alice, "x1", &exchange("s1", "x1", "hello"))
        .await
        .unwrap();
    // A long exchange's entry keeps it under a key of its own.
    store
        .append_raw(&alice, "x2", &large_job(&alice, "s1", "x2").exchange)
        .await
        .unwrap();
    // Alice: a leased head with a long job waiting behind it, a finished job, and a long job
    // that failed (which keeps its exchange).
    for queued in [
        job_in(&alice, "s1", "a1"),
        large_job(&alice, "s1", "a2"),
        job_in(&alice, "s2", "a3"),
        large_job(&alice, "s3", "a4"),
    ] {
        store.enqueue(&queued).await.unwrap();
    }
    let lease = Duration::from_secs(30);
    let mut leased = Vec::new();
    for _ in 0..3 {
        leased.push(store.claim("worker-a", lease).await.unwrap().unwrap());
    }
    leased.sort_by(|a, b| a.job.id.key.cmp(&b.job.id.key));
    let [leased, finished, failed] = <[_; 3]>::try_from(leased).unwrap();
    store.ack(&finished.job.id).await.unwrap();
    store.fail(&failed.job.id, "gave up").await.unwrap();
    assert_eq!(failed.job.id.key, "a4");
    let mut moved = keys_matching(&mut connection, &user_key(&alice, "jobx:*")).await;
    moved.extend(keys_matching(&mut connection, &user_key(&alice, "rawx:*")).await);
    moved.sort();
    assert_eq!(
        moved,
        ["jobx:a2", "jobx:a4", "rawx:x2"].map(|kind| user_key(&alice, kind))
    );
    let bob_job = job_in(&bob, "s1", "b1");
    store.enqueue(&bob_job).await.unwrap();
    assert_eq!(pending(&mut connection).await.len(), 1);

    let report = store.forget_user(&alice).await.unwrap();
    assert_eq!(
        (report.memory_states, report.raw_entries, report.jobs),
        (1, 2, 4)
    );

    let keys = keys_matching(&mut connection, &format!("*{}*", tag(&alice))).await;
    assert!(keys.is_empty(), "{keys:?}");
    assert_eq!(tokens(&mut connection).await, [token(&bob, "s1")]);
    assert!(pending(&mut connection).await.is_empty(), "{leased:?}");
    assert_eq!(store.queue_depth().await.unwrap(), 1);
    // A late acknowledgement from the worker that held Alice's job changes nothing.
    assert!(!store.ack(&leased.job.id).await.unwrap());
    let next = store.claim("worker-a", lease).await.unwrap().unwrap();
    assert_eq!(next.job, bob_job);
}

/// Large values never pass through a script: a long exchange is staged and renamed to
/// `jobx:<key>`, read with a plain GET by the claim, renamed to `rawx:<key>` by the commit
/// (whose raw-log element is then a reference), and no staged key is left behind. A short one
/// stays a field of its record and a whole raw-log element.
#[tokio::test]
async fn large_values_move_by_rename_and_leave_no_staged_key() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let (long, short) = (
        large_job(&alice, "s1", "long"),
        job_in(&alice, "s2", "short"),
    );
    for queued in [&long, &short, &long] {
        store.enqueue(queued).await.unwrap();
    }
    let inline = |key: &str| user_key(&alice, &format!("job:{key}"));
    let field: Option<String> = connection.hget(inline("long"), "exchange").await.unwrap();
    assert!(field.is_none());
    let field: Option<String> = connection.hget(inline("short"), "exchange").await.unwrap();
    assert!(field.is_some());
    let stored: usize = connection
        .strlen(user_key(&alice, "jobx:long"))
        .await
        .unwrap();
    assert!(stored > long.exchange.user_text.len(), "{stored}");

    let lease = Duration::from_secs(30);
    let mut claimed = store.claim_batch("worker-a", lease, 2).await.unwrap();
    claimed.sort_by(|a, b| a.job.id.key.cmp(&b.job.id.key));
    let jobs: Vec<Job> = claimed.into_iter().map(|claimed| claimed.job).collect();
    assert_eq!(jobs, [long.clone(), short.clone()]);
    let state = large_state(&alice);
    let encoded = engram_store::EncodedState::of(&state).unwrap();
    store
        .commit_jobs(std::slice::from_ref(&long), &encoded, 0, &[])
        .await
        .unwrap();
    store.ack(&short.id).await.unwrap();
    store
        .append_raw(&alice, "short", &short.exchange)
        .await
        .unwrap();

    let elements = raw_elements(&mut connection, &alice).await;
    assert_eq!(elements[0], serde_json::json!({"exchange_id": "long"}));
    assert_eq!(elements[1]["exchange_id"], "short");
    assert_eq!(elements[1]["exchange"]["user_text"], "message of short");
    assert_eq!(
        keys_matching(&mut connection, &user_key(&alice, "*x:*")).await,
        [user_key(&alice, "rawx:long")]
    );
    assert_eq!(
        keys_matching(&mut connection, &format!("{PREFIX}*staging*")).await,
        Vec::<String>::new()
    );
    assert_eq!(store.load_state(&alice).await.unwrap().unwrap(), state);
    let log = store.read_raw(&alice).await.unwrap();
    assert_eq!(log[0].exchange, long.exchange);
    assert_eq!(log[1].exchange, short.exchange);
}

/// A failed job's exchange is then its only copy: it stays, inline or under its own key, as
/// long as the record; an applied one goes.
#[tokio::test]
async fn a_failed_jobs_exchange_stays_as_long_as_its_record() {
    let ttl = Duration::from_secs(60);
    let Some((store, mut connection, _server)) = store_and_connection(Some(ttl)).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let jobs = [
        large_job(&alice, "s1", "long-failed"),
        job_in(&alice, "s2", "short-failed"),
        large_job(&alice, "s3", "long-applied"),
    ];
    for queued in &jobs {
        store.enqueue(queued).await.unwrap();
    }
    let claimed = store
        .claim_batch("worker-a", Duration::from_secs(30), 3)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 3);
    store.fail(&jobs[0].id, "gave up").await.unwrap();
    store.fail(&jobs[1].id, "gave up").await.unwrap();
    store.ack(&jobs[2].id).await.unwrap();

    let left: i64 = connection
        .pttl(user_key(&alice, "jobx:long-failed"))
        .await
        .unwrap();
    assert!((1..=60_000).contains(&left), "{left}");
    let stored: String = connection
        .get(user_key(&alice, "jobx:long-failed"))
        .await
        .unwrap();
    let stored: serde_json::Value = serde_json::from_str(&stored).unwrap();
    assert_eq!(stored["user_text"], jobs[0].exchange.user_text);
    let field: Option<String> = connection
        .hget(user_key(&alice, "job:short-failed"), "exchange")
        .await
        .unwrap();
    assert!(field.unwrap().contains("message of short-failed"));
    let applied: bool = connection
        .exists(user_key(&alice, "jobx:long-applied"))
        .await
        .unwrap();
    assert!(!applied);
}

/// A long job whose record holds its exchange inline (queued by an older version) is claimed
/// and applied, its raw-log entry a reference like any long one; one whose stored exchange has
/// gone since the claim is committed with its entry whole.
#[tokio::test]
async fn long_jobs_apply_whichever_way_their_exchange_is_stored() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let (inline, vanished) = (
        large_job(&alice, "s1", "inline"),
        large_job(&alice, "s2", "vanished"),
    );
    for queued in [&inline, &vanished] {
        store.enqueue(queued).await.unwrap();
    }
    // The older layout: the exchange is a field of the record.
    let stored: String = connection
        .get(user_key(&alice, "jobx:inline"))
        .await
        .unwrap();
    let () = connection
        .hset(user_key(&alice, "job:inline"), "exchange", stored)
        .await
        .unwrap();
    let () = connection
        .del(user_key(&alice, "jobx:inline"))
        .await
        .unwrap();

    let mut claimed = store
        .claim_batch("worker-a", Duration::from_secs(30), 2)
        .await
        .unwrap();
    claimed.sort_by(|a, b| a.job.id.key.cmp(&b.job.id.key));
    let jobs: Vec<Job> = claimed.into_iter().map(|claimed| claimed.job).collect();
    assert_eq!(jobs, [inline.clone(), vanished.clone()]);
    let () = connection
        .del(user_key(&alice, "jobx:vanished"))
        .await
        .unwrap();

    let state = large_state(&alice);
    let encoded = engram_store::EncodedState::of(&state).unwrap();
    store
        .commit_jobs(std::slice::from_ref(&inline), &encoded, 0, &[])
        .await
        .unwrap();
    let mut next = state.clone();
    next.version += 1;
    let encoded = engram_store::EncodedState::of(&next).unwrap();
    store
        .commit_jobs(
            std::slice::from_ref(&vanished),
            &encoded,
            state.version,
            &[],
        )
        .await
        .unwrap();

    let elements = raw_elements(&mut connection, &alice).await;
    assert_eq!(elements[0], serde_json::json!({"exchange_id": "inline"}));
    assert_eq!(elements[1]["exchange"]["session_id"], "s2");
    let log = store.read_raw(&alice).await.unwrap();
    assert_eq!(log[0].exchange, inline.exchange);
    assert_eq!(log[1].exchange, vanished.exchange);
    let field: Option<String> = connection
        .hget(user_key(&alice, "job:inline"), "exchange")
        .await
        .unwrap();
    assert!(field.is_none());
    assert_eq!(
        store.job_state(&vanished.id).await.unwrap(),
        Some(JobState::Applied)
    );
}

/// A memory stored by engram 0.1 as one value under `state` is converted to the item layout on
/// its first read: the reader gets it whole, and the keys then hold a hot state and items.
#[tokio::test]
async fn a_memory_in_the_earlier_layout_is_converted_on_first_read() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let user = UserKey::new("acme", "alice");
    let state = state_with(&["I'm allergic to peanuts.", "My name is Alice."]);
    let prefix = format!("{PREFIX}:{{{}}}:", tag(&user));
    let () = connection
        .set(
            format!("{prefix}state"),
            serde_json::to_vec(&state).unwrap(),
        )
        .await
        .unwrap();
    let () = connection
        .set(format!("{prefix}version"), state.version.to_string())
        .await
        .unwrap();

    let hot = store.hot_record(&user, "s1", None).await.unwrap();
    assert_eq!(hot.version, state.version);
    let Some(engram_store::MemoryUpdate::Whole(read)) = hot.update else {
        panic!("a legacy memory did not come whole");
    };
    assert_eq!(*read, state);
    let meta: Vec<u8> = connection.get(format!("{prefix}state")).await.unwrap();
    let meta: serde_json::Value = serde_json::from_slice(&meta).unwrap();
    assert_eq!(meta["layout"], 2, "{meta}");
    let items: usize = connection.hlen(format!("{prefix}items")).await.unwrap();
    assert_eq!(items, 1 + 2 * 2 + state.facts.len());
    assert_eq!(store.load_state(&user).await.unwrap().unwrap(), state);
}

/// A worker committing one user's turns faster than a whole read takes: the optimistic reads
/// (version before and after) keep seeing a change, and the store falls back to one script
/// reading the memory at once instead of failing the request.
#[tokio::test]
async fn a_whole_read_of_a_memory_that_keeps_changing_still_succeeds() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let state = large_state(&alice);
    store.save_state(&alice, &state, 0).await.unwrap();
    // Every read of the version sees a new one: nothing else changes, so the state read is
    // whole, but the plain reads can never prove it.
    let version_key = user_key(&alice, "version");
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut bumping = tokio::task::JoinSet::new();
    bumping.spawn({
        let stop = std::sync::Arc::clone(&stop);
        let mut connection = connection.clone();
        let version_key = version_key.clone();
        async move {
            let mut bumps = 0_u64;
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                let _: u64 = connection.incr(&version_key, 1).await.unwrap();
                bumps += 1;
            }
            bumps
        }
    });
    for _ in 0..20 {
        let loaded = store.load_state(&alice).await.unwrap().unwrap();
        assert_eq!(loaded, state);
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    assert!(bumping.join_next().await.unwrap().unwrap() > 0);
    let _: () = connection.del(&version_key).await.unwrap();
}

/// Records what a store tells its commit listener: (user, expected version, new version).
#[derive(Default)]
struct HeardCommits(std::sync::Mutex<Vec<(UserKey, u64, u64)>>);

impl engram_store::CommitListener for HeardCommits {
    fn committed(&self, user: &UserKey, expected_version: u64, state: &engram_store::EncodedState) {
        self.0
            .lock()
            .unwrap()
            .push((user.clone(), expected_version, state.version));
    }
}

/// A hot read that Redis runs after this process's own job commit, before the commit's answer
/// is back, finds the commit landed: it tells the listener (once: the answer does not tell it
/// again) and carries none of the commit's items back (a long run's would cost Redis a
/// millisecond or more for every request in flight). The commit waits behind a busy script,
/// and the read is sent after it on the store's one connection, so Redis runs them in order.
#[tokio::test]
async fn a_read_behind_our_own_commit_takes_no_delta() {
    // Ordering, not timeouts: the busy script took past the default 2 s on a loaded machine,
    // and the commit and the read behind it timed out.
    let options = RedisOptions {
        response_timeout: Duration::from_secs(20),
        ..RedisOptions::default()
    };
    let Some((store, mut connection, _server)) = store_with(options).await else {
        return;
    };
    let heard = std::sync::Arc::new(HeardCommits::default());
    let store = std::sync::Arc::new(store.with_commit_listener(heard.clone()));
    let alice = UserKey::new("acme", "alice");
    let mut state = engram_memory::MemoryState::new();
    state.version = engram_proxy::cache::first_version();
    // Nothing stored yet: the first commit expects version 0.
    let start = 0;
    let mut applied = Vec::new();
    for (key, session) in [("a1", "s1"), ("a2", "s2")] {
        let before = state.version;
        let (job, encoded) = claim_and_record(&store, &alice, session, key, &mut state).await;
        applied.push((job, encoded, before));
    }
    let (second, second_state, first_version) = applied.pop().unwrap();
    let (first, first_state, _) = applied.pop().unwrap();
    // The first commit is answered as usual, and loads the scripts (a script load would be a
    // round trip the read could overtake).
    store
        .commit_jobs(std::slice::from_ref(&first), &first_state, start, &[])
        .await
        .unwrap();
    let read = store
        .hot_record(&alice, "s1", Some(first_version))
        .await
        .unwrap();
    assert!(read.update.is_none());
    assert_eq!(
        *heard.0.lock().unwrap(),
        [(alice.clone(), start, first_version)]
    );

    // Redis busy for a while on another connection; the commit queues behind it, then the read.
    let tasks = tokio_util::task::TaskTracker::new();
    let mut busy_connection = connection.clone();
    let busy = tasks.spawn(async move {
        redis::cmd("EVAL")
            .arg("local i = 0 while i < 150000000 do i = i + 1 end return 1")
            .arg(0)
            .query_async::<i64>(&mut busy_connection)
            .await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let commit = tasks.spawn({
        let store = std::sync::Arc::clone(&store);
        let (second, second_state) = (second.clone(), second_state.clone());
        async move {
            store
                .commit_jobs(
                    std::slice::from_ref(&second),
                    &second_state,
                    first_version,
                    &[],
                )
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(
        !busy.is_finished(),
        "the busy script ended too soon to order the calls"
    );
    let read = store
        .hot_record(&alice, "s1", Some(first_version))
        .await
        .unwrap();
    assert_eq!(read.version, second_state.version);
    assert!(
        read.update.is_none(),
        "the read carried the commit back: {:?}",
        read.update
            .map(|update| matches!(update, engram_store::MemoryUpdate::Delta(_)))
    );
    commit.await.unwrap().unwrap();
    busy.await.unwrap().unwrap();
    assert_eq!(
        *heard.0.lock().unwrap(),
        [
            (alice.clone(), start, first_version),
            (alice.clone(), first_version, second_state.version)
        ]
    );
    assert_eq!(
        store.load_state(&alice).await.unwrap().unwrap().version,
        second_state.version
    );
    // The key that names the last commit goes with the user.
    assert_eq!(
        keys_matching(&mut connection, &user_key(&alice, "committed")).await,
        [user_key(&alice, "committed")]
    );
    forget_leaves_no_key(&store, &mut connection, &alice).await;
}

/// The response timeout of the stall tests' stores...
const QUICK_TIMEOUT: Duration = Duration::from_millis(200);
/// ...and how long they stall the server: past three timeouts.
const STALL: Duration = Duration::from_millis(700);

/// A store whose commands time out after [`QUICK_TIMEOUT`], and a plain connection.
async fn store_timing_out() -> Option<(RedisStore, MultiplexedConnection, RedisServer)> {
    store_with(RedisOptions {
        response_timeout: QUICK_TIMEOUT,
        ..RedisOptions::default()
    })
    .await
}

/// Stalls the server for `stall`: it runs no client's command meanwhile, then runs them in
/// the order they came.
async fn pause(connection: &mut MultiplexedConnection, stall: Duration) {
    let () = redis::cmd("CLIENT")
        .arg("PAUSE")
        .arg(u64::try_from(stall.as_millis()).unwrap())
        .arg("ALL")
        .query_async(connection)
        .await
        .unwrap();
}

/// Forgets `user` and checks that no key of theirs is left.
async fn forget_leaves_no_key(
    store: &RedisStore,
    connection: &mut MultiplexedConnection,
    user: &UserKey,
) {
    store.forget_user(user).await.unwrap();
    let keys = keys_matching(connection, &format!("*{}*", tag(user))).await;
    assert!(keys.is_empty(), "{keys:?}");
}

/// A job commit whose answer times out (Redis stalled) but which Redis then runs has landed:
/// the committer learns so from the `answer` the commit left, counts it done, and runs its
/// queue step, so its jobs leave the depth and their tokens the stream. Before, it returned
/// the timeout, and the run's jobs stayed in the depth long after the stall.
#[tokio::test]
async fn a_commit_whose_answer_timed_out_but_landed_is_done() {
    let Some((store, mut connection, _server)) = store_timing_out().await else {
        return;
    };
    let heard = std::sync::Arc::new(HeardCommits::default());
    let store = store.with_commit_listener(heard.clone());
    let alice = UserKey::new("acme", "alice");
    let mut state = engram_memory::MemoryState::new();
    state.version = engram_proxy::cache::first_version();
    let mut expected = 0;
    for key in ["a1", "a2"] {
        let (job, encoded) = claim_and_record(&store, &alice, "s1", key, &mut state).await;
        if key == "a2" {
            // The first commit loaded the script; now Redis stalls past three timeouts.
            pause(&mut connection, STALL).await;
        }
        let started = std::time::Instant::now();
        store
            .commit_jobs(std::slice::from_ref(&job), &encoded, expected, &[])
            .await
            .unwrap();
        if key == "a2" {
            assert!(
                started.elapsed() > QUICK_TIMEOUT,
                "the commit was answered in time ({:?}): nothing timed out",
                started.elapsed()
            );
        }
        assert_eq!(
            store.job_state(&job.id).await.unwrap(),
            Some(JobState::Applied)
        );
        expected = encoded.version;
    }
    assert_eq!(store.queue_depth().await.unwrap(), 0);
    assert!(tokens(&mut connection).await.is_empty());
    assert!(pending(&mut connection).await.is_empty());
    assert_eq!(heard.0.lock().unwrap().len(), 2, "both commits were heard");
    assert_eq!(
        store.load_state(&alice).await.unwrap().unwrap().version,
        expected
    );
    // The stored answer goes with the user.
    forget_leaves_no_key(&store, &mut connection, &alice).await;
}

/// An enqueue whose user step times out (Redis stalled) but which Redis then runs has queued
/// its jobs without their queue step, so nothing counted them in the depth; the retry finds
/// them queued and counts them then, once. Before, the depth read low until the queue emptied
/// (a backlog after a stall reported drained with runs still queued).
#[tokio::test]
async fn an_enqueue_that_timed_out_but_landed_is_counted_by_its_retry() {
    let Some((store, mut connection, _server)) = store_timing_out().await else {
        return;
    };
    let (alice, bob) = (UserKey::new("acme", "alice"), UserKey::new("acme", "bob"));
    let lease = Duration::from_secs(30);
    let drain = async || {
        while let Some(claimed) = store.claim("w", lease).await.unwrap() {
            store.ack(&claimed.job.id).await.unwrap();
        }
    };
    // Both enqueue scripts loaded first (a load would not survive the timeout).
    store.enqueue(&job_in(&bob, "s1", "w1")).await.unwrap();
    store
        .enqueue_run(&[job_in(&bob, "s1", "w2")])
        .await
        .unwrap();
    drain().await;
    assert_eq!(store.queue_depth().await.unwrap(), 0);

    let single = job_in(&alice, "s1", "a1");
    let run = [job_in(&alice, "s2", "b1"), job_in(&alice, "s2", "b2")];
    pause(&mut connection, STALL).await;
    let paused = std::time::Instant::now();
    assert!(store.enqueue(&single).await.is_err());
    assert!(store.enqueue_run(&run).await.is_err());
    assert!(
        paused.elapsed() < STALL,
        "the enqueues did not time out within the pause"
    );
    tokio::time::sleep(STALL.saturating_sub(paused.elapsed())).await;
    assert_eq!(
        store.queue_depth().await.unwrap(),
        0,
        "the user steps landed without their queue steps"
    );
    assert_eq!(
        store.enqueue(&single).await.unwrap(),
        Enqueued::Duplicate(JobState::Queued)
    );
    assert_eq!(store.enqueue_run(&run).await.unwrap(), 2);
    assert_eq!(store.queue_depth().await.unwrap(), 3);
    // Counted once: another retry adds nothing.
    store.enqueue(&single).await.unwrap();
    assert_eq!(store.enqueue_run(&run).await.unwrap(), 2);
    assert_eq!(store.queue_depth().await.unwrap(), 3);
    drain().await;
    assert_eq!(store.queue_depth().await.unwrap(), 0);
    for job in [&single, &run[0], &run[1]] {
        assert_eq!(
            store.job_state(&job.id).await.unwrap(),
            Some(JobState::Applied)
        );
    }
}

/// A claim whose answer times out (Redis stalled) but which Redis then runs has leased a
/// token: the claimer learns which from the note the claim left and takes its run, rather than
/// leaving the token, and with it the session, leased to nobody until the lease ends.
#[tokio::test]
async fn a_claim_whose_answer_timed_out_still_takes_its_run() {
    let Some((store, mut connection, _server)) = store_timing_out().await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let lease = Duration::from_secs(30);
    // Both claim scripts loaded first (a load would not survive the timeout).
    store.enqueue(&job_in(&alice, "s0", "w1")).await.unwrap();
    let warm = store.claim("w", lease).await.unwrap().unwrap();
    store.ack(&warm.job.id).await.unwrap();

    let job = job_in(&alice, "s1", "a1");
    store.enqueue(&job).await.unwrap();
    pause(&mut connection, STALL).await;
    let started = std::time::Instant::now();
    let claimed = store.claim("w", lease).await.unwrap().unwrap();
    assert!(
        started.elapsed() > QUICK_TIMEOUT,
        "the claim was answered in time ({:?}): nothing timed out",
        started.elapsed()
    );
    assert_eq!((claimed.job.id, claimed.attempt), (job.id.clone(), 1));
    store.ack(&job.id).await.unwrap();
    assert_eq!(store.queue_depth().await.unwrap(), 0);
    assert!(pending(&mut connection).await.is_empty());
    assert!(store.claim("w", lease).await.unwrap().is_none());
}

/// A reader catching its copy up by another read (`hot_record_catching_up`) gets no changes
/// for a memory that moved on, just its version: each request in flight fetching the same
/// changes kept Redis saturated after a stall (see `MemoryCache::catch_up`). A plain read
/// still gets them, and an arriving turn is still noted.
#[tokio::test]
async fn a_read_catching_up_takes_no_delta() {
    let Some((store, mut connection, _server)) = store_with(RedisOptions::default()).await else {
        return;
    };
    let alice = UserKey::new("acme", "alice");
    let mut state = engram_memory::MemoryState::new();
    state.version = engram_proxy::cache::first_version();
    // Nothing stored yet: the first commit expects version 0.
    let mut expected = 0;
    let mut committed = Vec::new();
    for key in ["a1", "a2"] {
        let (job, encoded) = claim_and_record(&store, &alice, "s1", key, &mut state).await;
        store
            .commit_jobs(std::slice::from_ref(&job), &encoded, expected, &[])
            .await
            .unwrap();
        expected = state.version;
        committed.push(state.version);
    }
    let (behind, current) = (committed[0], committed[1]);
    assert_ne!(behind, current);

    let lean = store
        .hot_record_catching_up(&alice, "s1", behind, Some(("t9", 1)))
        .await
        .unwrap();
    assert_eq!(lean.version, current);
    assert!(lean.update.is_none());
    let arriving: Vec<String> = connection
        .zrange(user_key(&alice, "arriving"), 0, -1)
        .await
        .unwrap();
    assert_eq!(arriving.len(), 1, "the turn was not noted as arriving");
    let full = store.hot_record(&alice, "s1", Some(behind)).await.unwrap();
    assert_eq!(full.version, current);
    assert!(matches!(
        full.update,
        Some(engram_store::MemoryUpdate::Delta(_))
    ));
    // Up to date: nothing either way.
    let current_read = store
        .hot_record_catching_up(&alice, "s1", current, None)
        .await
        .unwrap();
    assert_eq!(current_read.version, current);
    assert!(current_read.update.is_none());
}

/// A process that dies between a finish's two steps leaves the shard's depth counter too high
/// (its decrement is lost), and the worker's lag estimate then reads a queue that never
/// shrinks. A claim that finds the shard without a token sets it back to 0; while a token is
/// there (a job queued or leased), the counter is left as it is.
#[tokio::test]
async fn a_depth_left_too_high_is_reset_once_the_shard_has_no_token() {
    let Some((store, mut connection, _server)) = store_and_connection(None).await else {
        return;
    };
    let depth_key = format!("{PREFIX}:{{{}}}:depth", queue_tag(0, 1));
    let alice = UserKey::new("acme", "alice");
    let lease = Duration::from_secs(30);
    let lost_decrement = async |connection: &mut MultiplexedConnection| {
        let _: i64 = connection.incr(&depth_key, 3).await.unwrap();
    };
    store.enqueue(&job_in(&alice, "s1", "a1")).await.unwrap();
    lost_decrement(&mut connection).await;
    assert_eq!(store.queue_depth().await.unwrap(), 4);
    let claimed = store.claim("w", lease).await.unwrap().unwrap();
    assert!(store.claim("w", lease).await.unwrap().is_none());
    assert_eq!(
        store.queue_depth().await.unwrap(),
        4,
        "a leased job's token is still there"
    );
    store.ack(&claimed.job.id).await.unwrap();
    assert_eq!(store.queue_depth().await.unwrap(), 3);
    assert!(store.claim("w", lease).await.unwrap().is_none());
    assert_eq!(store.queue_depth().await.unwrap(), 0);
}
