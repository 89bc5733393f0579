//! engram on a real Redis Cluster (3 masters + 3 replicas on loopback, started per test by
//! `common::redis_cluster`): the store suite through the cluster client, then several engram
//! replicas sharing one memory — a conversation sent round-robin lands once and in order, a
//! fact written through one replica reaches a question on another, a master killed mid-load
//! fails over without losing a turn, and a replica killed mid-job leaves the job to another.
//!
//! Without `redis-server`/`redis-cli` on PATH the tests are skipped, unless
//! `ENGRAM_REQUIRE_REDIS=1` (set by `scripts/test.sh`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;
mod store_suite;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::memory::{admin, export, header, memory_part, recorded, say, wait_applied};
use common::redis_cluster::RedisCluster;
use common::{Process, mock, proxy, temp_path};
use engram_store::redis::{queue_tag, slot};
use engram_store::{RedisOptions, RedisStore};
use serde_json::Value;
use tokio::task::JoinSet;

async fn cluster_store(cluster: &RedisCluster, prefix: &str, options: RedisOptions) -> RedisStore {
    let options = RedisOptions {
        prefix: prefix.to_owned(),
        cluster: true,
        ..options
    };
    RedisStore::connect_with(&cluster.urls(), options)
        .await
        .unwrap()
}

/// Each case gets a key prefix of its own on the one cluster, so its own queue.
async fn suite_store(cluster: &RedisCluster, case: &str) -> (RedisStore, ()) {
    let store = cluster_store(cluster, &format!("suite-{case}"), RedisOptions::default()).await;
    (store, ())
}

store_suite!(shared RedisCluster::start, suite_store);

#[tokio::test]
async fn queue_shards_spread_over_the_masters_and_wait_finds_each_keys_replica() {
    let Some(cluster) = RedisCluster::start().await else {
        return;
    };
    let options = RedisOptions {
        queue_shards: 6,
        wait_replicas: 1,
        // What is tested is that WAIT reaches each key's replica, not how fast: 500 ms timed
        // out once in a CI run, with the suite's other cases writing to the same cluster.
        wait_timeout: Duration::from_secs(5),
        ..RedisOptions::default()
    };
    let store = cluster_store(&cluster, "shards", options.clone()).await;
    // Every shard on a master of its own share of the slots: all three masters serve some.
    let masters: HashSet<usize> = (0..6)
        .map(|shard| cluster.master_of_slot(slot(queue_tag(shard, 6).as_bytes())))
        .collect();
    assert_eq!(masters.len(), 3, "{masters:?}");
    // With WAIT on every write, the suite's model of sessions holds across shards and slots.
    store_suite::random_operations_follow_a_model_of_sessions(&store).await;
    let store = cluster_store(&cluster, "shards-forget", options).await;
    store_suite::forget_deletes_one_user_and_counts(&store).await;
}

/// The engram settings of a replica on `cluster`.
fn replica_env(cluster_urls: &str) -> Vec<(&'static str, String)> {
    vec![
        ("ENGRAM_STORE__BACKEND", "redis".into()),
        ("ENGRAM_STORE__REDIS_URL", cluster_urls.to_owned()),
        ("ENGRAM_STORE__REDIS_CLUSTER", "true".into()),
        ("ENGRAM_STORE__REDIS_QUEUE_SHARDS", "3".into()),
        ("ENGRAM_WORKER__LEASE_MS", "1500".into()),
    ]
}

fn start_replica(upstream: &str, env: &[(&'static str, String)]) -> Process {
    let env: Vec<(&str, &str)> = env
        .iter()
        .map(|(key, value)| (*key, value.as_str()))
        .collect();
    proxy(upstream, &env)
}

/// The turn ids of the user's raw log, in order.
fn raw_turns(memory: &Value) -> Vec<String> {
    memory["raw_log"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| entry["exchange"]["turn_id"].as_str().unwrap().to_owned())
        .collect()
}

/// Polls the export until the raw log holds `count` turns (or the deadline passes).
async fn wait_raw_log(proxy: &Process, tenant: &str, user: &str, count: usize) -> Vec<String> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let reply = admin(proxy, &format!("/engram/v1/users/{user}/memory"), tenant).await;
        let turns = if reply.status == 200 {
            raw_turns(&reply.json())
        } else {
            Vec::new()
        };
        if turns.len() >= count {
            return turns;
        }
        assert!(
            Instant::now() < deadline,
            "{user}: {} of {count} turns in the raw log",
            turns.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn three_replicas_keep_a_conversation_in_order_and_share_one_memory() {
    let Some(cluster) = RedisCluster::start().await else {
        return;
    };
    let record = temp_path("cluster-shared.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let env = replica_env(&cluster.urls());
    let replicas: Vec<Process> = (0..3)
        .map(|_| start_replica(&upstream.address, &env))
        .collect();

    // A stateless client sends each turn as soon as the last one is answered, to the next
    // replica: the replicas record (and apply) neighbouring turns at the same time.
    let mut turn_ids = Vec::new();
    for turn in 0..12 {
        let reply = say(
            &replicas[turn % 3],
            "acme",
            "rita",
            "s",
            &format!("Turn {turn}: please note the number {turn}."),
        )
        .await;
        turn_ids.push(header(&reply, "x-engram-turn-id").to_owned());
    }
    let raw = wait_raw_log(&replicas[1], "acme", "rita", turn_ids.len()).await;
    assert_eq!(raw, turn_ids, "every turn once, in the order it happened");
    let memory = export(&replicas[2], "acme", "rita").await;
    let applied = common::memory::applied_turn_ids(&memory);
    assert_eq!(applied, turn_ids, "applied in order");

    // Two requests of one session at once, on two replicas: the first is slow upstream, so
    // the second is answered and recorded first, yet it is applied after the first.
    let slow_upstream = mock(&["--latency-ms", "800"]);
    let slow = start_replica(&slow_upstream.address, &env);
    let (first, second) = tokio::join!(
        say_at(&slow.address, "rita", "s4", "Concurrent turn one."),
        async {
            tokio::time::sleep(Duration::from_millis(200)).await;
            say_at(&replicas[1].address, "rita", "s4", "Concurrent turn two.").await
        }
    );
    let (first, second) = (
        header_of(&first, "x-engram-turn-id"),
        header_of(&second, "x-engram-turn-id"),
    );
    let raw = wait_raw_log(&replicas[1], "acme", "rita", turn_ids.len() + 2).await;
    assert_eq!(
        raw[turn_ids.len()..],
        [first, second],
        "applied in arrival order"
    );

    // A fact written through replica 1 reaches a question on replica 3, whose cache holds an
    // older version of the user's memory.
    let fact = say(
        &replicas[0],
        "acme",
        "rita",
        "s2",
        "I'm allergic to shellfish.",
    )
    .await;
    wait_applied(&replicas[0], "acme", "rita", &fact).await;
    let question = say(
        &replicas[2],
        "acme",
        "rita",
        "s3",
        "What should I avoid eating?",
    )
    .await;
    assert_eq!(
        header(&question, "x-engram-memory"),
        "injected",
        "{}",
        header(&question, "x-engram-memory-reason")
    );
    assert!(memory_part(recorded(&record).last().unwrap()).contains("shellfish"));
}

#[tokio::test]
async fn a_master_killed_mid_load_fails_over_and_no_answered_turn_is_lost() {
    let Some(mut cluster) = RedisCluster::start().await else {
        return;
    };
    let upstream = mock(&[]);
    let mut env = replica_env(&cluster.urls());
    // Durable mode: an exchange counts as queued once a replica has it; until then it is
    // retried, then kept in the replica's local spool.
    env.push(("ENGRAM_STORE__REDIS_WAIT_REPLICAS", "1".into()));
    env.push(("ENGRAM_STORE__REDIS_WAIT_TIMEOUT_MS", "300".into()));
    // A shorter hot-path deadline, so requests routed to the dead master fail open quickly.
    env.push(("ENGRAM_STORE__HOT_PATH_DEADLINE_MS", "1000".into()));
    let replicas: Vec<Process> = (0..3)
        .map(|_| start_replica(&upstream.address, &env))
        .collect();
    let users: Vec<String> = (0..6).map(|n| format!("load-{n}")).collect();
    // The victim: the master holding the first user's keys.
    let key = format!("engram:{{{}:{}}}:state", hex("acme"), hex(&users[0]));
    let victim = cluster.master_of_slot(slot(key.as_bytes()));

    // Each user sends turn after turn, round-robin over the replicas, until told to stop: so
    // turns are answered before, during and after the failover.
    let addresses: Vec<String> = replicas.iter().map(|r| r.address.clone()).collect();
    let answered = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let degraded = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut load = JoinSet::new();
    for (index, user) in users.iter().enumerate() {
        let user = user.clone();
        let addresses = addresses.clone();
        let (answered, degraded, stop) = (answered.clone(), degraded.clone(), stop.clone());
        load.spawn(async move {
            let mut turn_ids = Vec::new();
            for turn in 0.. {
                if stop.load(std::sync::atomic::Ordering::Relaxed) && turn >= 4 {
                    break;
                }
                let address = &addresses[(index + turn) % addresses.len()];
                let reply = say_at(address, &user, "s", &format!("Turn {turn} of {user}.")).await;
                turn_ids.push(header_of(&reply, "x-engram-turn-id"));
                if header_of(&reply, "x-engram-memory") == "degraded" {
                    degraded.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                }
                answered.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (user, turn_ids)
        });
    }
    // Mid-load: kill the master, let the cluster fail over, then bring the node back (it
    // rejoins as the new master's replica, so waiting for a replica works again).
    let deadline = Instant::now() + Duration::from_secs(30);
    while answered.load(std::sync::atomic::Ordering::Relaxed) < users.len() * 4 {
        assert!(Instant::now() < deadline, "the load did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    cluster.kill(victim);
    cluster.wait_healthy(Duration::from_secs(30)).await;
    cluster.restart(victim).await;
    cluster.wait_replicated(Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);

    let mut sent = Vec::new();
    while let Some(done) = load.join_next().await {
        sent.push(done.unwrap());
    }
    cluster.wait_healthy(Duration::from_secs(30)).await;
    for (user, turn_ids) in &sent {
        let raw = wait_raw_log(&replicas[0], "acme", user, turn_ids.len()).await;
        let mut seen = HashSet::new();
        assert!(
            raw.iter().all(|turn| seen.insert(turn.clone())),
            "{user}: a turn twice in {raw:?}"
        );
        let expected: HashSet<String> = turn_ids.iter().cloned().collect();
        assert_eq!(seen, expected, "{user}: every answered turn once");
    }
    let (mut lost, mut spooled) = (0, 0);
    for replica in &replicas {
        let queue = admin(replica, "/engram/v1/queue", "default").await.json();
        lost += queue["recorded"]["lost"].as_u64().unwrap_or(0);
        spooled += queue["recorded"]["spooled"].as_u64().unwrap_or(0);
    }
    println!(
        "failover: {} turns answered, {} without memory, {spooled} recorded through the spool",
        answered.load(std::sync::atomic::Ordering::Relaxed),
        degraded.load(std::sync::atomic::Ordering::Relaxed),
    );
    assert_eq!(lost, 0);
    // The failover was felt: requests answered without memory while the slot moved.
    assert!(degraded.load(std::sync::atomic::Ordering::Relaxed) > 0);
}

#[tokio::test]
async fn a_replica_killed_mid_job_leaves_the_job_to_another() {
    let Some(cluster) = RedisCluster::start().await else {
        return;
    };
    let upstream = mock(&[]);
    // The first replica's summarizer answers slowly, so its worker is mid-job when killed.
    let summaries = temp_path("cluster-slow-summarizer.jsonl");
    let slow = mock(&[
        "--reply",
        r#"{"user_summary":"The user shared a number.","assistant_summary":"Noted.","add":[],"update":[],"remove":[]}"#,
        "--latency-ms",
        "5000",
        "--record",
        summaries.to_str().unwrap(),
    ]);
    let mut env = replica_env(&cluster.urls());
    let mut slow_env = env.clone();
    slow_env.push((
        "ENGRAM_SUMMARIZER__BASE_URL",
        format!("{}/v1", slow.address),
    ));
    let mut first = start_replica(&upstream.address, &slow_env);
    // The second one's own lease is long: a debug build's first job can outlast a short one.
    env.retain(|(key, _)| *key != "ENGRAM_WORKER__LEASE_MS");

    let reply = say(&first, "acme", "lena", "s", "My locker number is 4711.").await;
    let turn_id = header(&reply, "x-engram-turn-id").to_owned();
    // The first replica claimed the job (its record counts the attempt) and now waits 5 s
    // for its summarizer.
    let record = format!(
        "engram:{{{}:{}}}:job:{}",
        hex("acme"),
        hex("lena"),
        header(&reply, "x-engram-job-id")
    );
    let deadline = Instant::now() + Duration::from_secs(20);
    while cluster.command(&["HGET", &record, "attempts"]).trim() != "1" {
        assert!(Instant::now() < deadline, "the job was never claimed");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    first.signal("KILL");
    assert!(first.wait_exit(Duration::from_secs(5)).is_some());

    // Another replica claims it once the lease ends and applies it, once.
    let second = start_replica(&upstream.address, &env);
    wait_applied(&second, "acme", "lena", &reply).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // The worker counts the job just after its commit, which the job state shows.
        let queue = admin(&second, "/engram/v1/queue", "default").await.json();
        if queue["worker"]["applied"] == 1 {
            assert_eq!(queue["worker"]["duplicates"], 0, "{queue}");
            break;
        }
        assert!(Instant::now() < deadline, "{queue}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        recorded(&summaries).is_empty(),
        "the first replica never got its summary"
    );
    assert_eq!(cluster.command(&["HGET", &record, "attempts"]).trim(), "");
    let memory = export(&second, "acme", "lena").await;
    assert_eq!(raw_turns(&memory), [turn_id]);
}

fn hex(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

/// One stateless turn of `user` (tenant `acme`) in `session` at a replica's address.
async fn say_at(address: &str, user: &str, session: &str, text: &str) -> common::Reply {
    common::memory::chat_turn(address, "acme", user, session, text, false).await
}

fn header_of(reply: &common::Reply, name: &str) -> String {
    reply.headers[name].to_str().unwrap().to_owned()
}
