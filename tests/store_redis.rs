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
use engram::memory::ItemRef;
use engram::store::redis::{DEFAULT_FINISHED_JOB_TTL, LEASE_HORIZON_MS};
use engram::store::{Enqueued, Job, JobId, JobState, RedisOptions, RedisStore, Store, UserKey};
use redis::AsyncCommands;
use redis::aio::MultiplexedConnection;
use store_suite::{exchange, job, job_in, state_with};

/// Starts a server on a free port; `None` when redis-server is missing and not required.
async fn start_server() -> Option<(String, RedisServer)> {
    let server = RedisServer::start().await?;
    Some((server.url(), server))
}

const PREFIX: &str = "engram-test";
const STREAM: &str = "engram-test:{queue}:jobs";

async fn fresh_store() -> Option<(RedisStore, RedisServer)> {
    let (url, server) = start_server().await?;
    let store = RedisStore::connect(&url, PREFIX).await.unwrap();
    Some((store, server))
}

store_suite!(optional fresh_store);

/// A store with the given retention, and a plain connection to look at its keys.
async fn store_and_connection(
    finished_job_ttl: Option<Duration>,
) -> Option<(RedisStore, MultiplexedConnection, RedisServer)> {
    let (url, server) = start_server().await?;
    let options = RedisOptions {
        prefix: PREFIX.to_owned(),
        finished_job_ttl,
        ..RedisOptions::default()
    };
    let store = RedisStore::connect_with(&url, options).await.unwrap();
    let connection = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    Some((store, connection, server))
}

/// The hash tag of a user, as the store writes it.
fn tag(user: &UserKey) -> String {
    let hex = |text: &str| -> String { text.bytes().map(|byte| format!("{byte:02x}")).collect() };
    format!("{}:{}", hex(&user.tenant), hex(&user.user))
}

/// The stream's pending list: (entry id, consumer, idle ms, deliveries).
async fn pending(connection: &mut MultiplexedConnection) -> Vec<(String, String, u64, u32)> {
    redis::cmd("XPENDING")
        .arg(STREAM)
        .arg("workers")
        .arg("-")
        .arg("+")
        .arg(100)
        .query_async(connection)
        .await
        .unwrap()
}

/// The job refs on the stream, oldest first.
async fn stream_refs(connection: &mut MultiplexedConnection) -> Vec<String> {
    let entries: Vec<(String, Vec<(String, String)>)> = redis::cmd("XRANGE")
        .arg(STREAM)
        .arg("-")
        .arg("+")
        .query_async(connection)
        .await
        .unwrap();
    entries
        .into_iter()
        .map(|(_, fields)| {
            fields
                .into_iter()
                .find(|(name, _)| name == "job")
                .unwrap()
                .1
        })
        .collect()
}

fn job_ref(id: &JobId) -> String {
    format!("{} {}", tag(&id.user), id.key)
}

#[tokio::test]
async fn a_dead_consumers_job_is_autoclaimed_once_its_lease_ends() {
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
    // The lease is the entry's idle time, 500 ms short of the horizon.
    let [(_, consumer, idle, deliveries)] = pending(&mut connection).await.try_into().unwrap();
    assert_eq!((consumer.as_str(), deliveries), ("worker-a", 1));
    assert!(
        (LEASE_HORIZON_MS - 500..LEASE_HORIZON_MS).contains(&idle),
        "{idle}"
    );
    let lease = Duration::from_secs(30);
    assert!(store.claim("worker-b", lease).await.unwrap().is_none());

    // worker-a never acknowledges; XAUTOCLAIM hands the entry to worker-b.
    tokio::time::sleep(Duration::from_millis(650)).await;
    let again = store.claim("worker-b", lease).await.unwrap().unwrap();
    assert_eq!(
        (again.job.id.clone(), again.attempt),
        (queued.id.clone(), 2)
    );
    let [(_, consumer, idle, deliveries)] = pending(&mut connection).await.try_into().unwrap();
    assert_eq!((consumer.as_str(), deliveries), ("worker-b", 2));
    assert!(idle < LEASE_HORIZON_MS - 29_000, "{idle}");

    // The acknowledgement takes the entry off the pending list and the stream.
    assert!(store.ack(&queued.id).await.unwrap());
    assert!(pending(&mut connection).await.is_empty());
    assert!(stream_refs(&mut connection).await.is_empty());
    assert_eq!(store.queue_depth().await.unwrap(), 0);
}

#[tokio::test]
async fn only_each_sessions_head_is_on_the_stream() {
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
    assert_eq!(
        stream_refs(&mut connection).await,
        [job_ref(&alice_jobs[0].id), job_ref(&bob_job.id)]
    );
    assert_eq!(store.queue_depth().await.unwrap(), 4);

    // Finishing the head appends the session's next job: sessions take turns in the order
    // their jobs became next, so Bob's job goes before Alice's second.
    let lease = Duration::from_secs(30);
    let first = store.claim("worker-a", lease).await.unwrap().unwrap();
    assert_eq!(first.job.id, alice_jobs[0].id);
    store.ack(&first.job.id).await.unwrap();
    assert_eq!(
        stream_refs(&mut connection).await,
        [job_ref(&bob_job.id), job_ref(&alice_jobs[1].id)]
    );
    let next: Vec<JobId> = [
        store.claim("worker-a", lease).await.unwrap(),
        store.claim("worker-a", lease).await.unwrap(),
        store.claim("worker-a", lease).await.unwrap(),
    ]
    .into_iter()
    .flatten()
    .map(|claimed| claimed.job.id)
    .collect();
    assert_eq!(next, [bob_job.id.clone(), alice_jobs[1].id.clone()]);
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
    // Alice: a leased head with a job waiting behind it, and a finished job.
    for queued in [
        job_in(&alice, "s1", "a1"),
        job_in(&alice, "s1", "a2"),
        job_in(&alice, "s2", "a3"),
    ] {
        store.enqueue(&queued).await.unwrap();
    }
    let lease = Duration::from_secs(30);
    let leased = store.claim("worker-a", lease).await.unwrap().unwrap();
    let finished = store.claim("worker-a", lease).await.unwrap().unwrap();
    store.ack(&finished.job.id).await.unwrap();
    let bob_job = job_in(&bob, "s1", "b1");
    store.enqueue(&bob_job).await.unwrap();
    assert_eq!(pending(&mut connection).await.len(), 1);

    let report = store.forget_user(&alice).await.unwrap();
    assert_eq!(
        (report.memory_states, report.raw_entries, report.jobs),
        (1, 1, 3)
    );

    let mut keys = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, found): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("MATCH")
            .arg(format!("*{}*", tag(&alice)))
            .arg("COUNT")
            .arg(1000)
            .query_async(&mut connection)
            .await
            .unwrap();
        keys.extend(found);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    assert!(keys.is_empty(), "{keys:?}");
    assert_eq!(stream_refs(&mut connection).await, [job_ref(&bob_job.id)]);
    assert!(pending(&mut connection).await.is_empty(), "{leased:?}");
    assert_eq!(store.queue_depth().await.unwrap(), 1);
    // A late acknowledgement from the worker that held Alice's job changes nothing.
    assert!(!store.ack(&leased.job.id).await.unwrap());
    let next = store.claim("worker-a", lease).await.unwrap().unwrap();
    assert_eq!(next.job, bob_job);
}
