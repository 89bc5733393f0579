//! Worker throughput: jobs applied per second with the heuristic extractor, on the embedded
//! store and (when `redis-server` is installed) on Redis.
//!
//! Run with `cargo bench --bench worker -- [--users N] [--turns N] [--concurrency N]
//! [--run-jobs N]`. It queues `users × turns` recorded exchanges (one session per user,
//! realistic sentences with facts in them), then starts the real worker and times it until the
//! queue is empty. The enqueue rate (the recorder's side) is reported too.
//!
//! Not a test: it prints numbers and asserts nothing.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "a benchmark binary: it reports on stdout and stops loudly on a broken setup"
)]

#[path = "support/redis.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use engram_memory::{ExchangeInput, MemoryConfig};
use engram_proxy::cache::MemoryCache;
use engram_proxy::summarizer::Summarizer;
use engram_proxy::worker::{Worker, WorkerConfig};
use engram_store::{CommitListener, EmbeddedStore, Job, JobId, RedisStore, Store, UserKey};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

const SENTENCES: [&str; 8] = [
    "I live in Porto and work as a nurse at the city hospital.",
    "My daughter Ana starts school in September, so mornings will be busy.",
    "I'm allergic to penicillin, please keep that in mind.",
    "Can you suggest a weekend hike near the coast that is not too steep?",
    "We adopted a dog called Biscuit last spring and he loves long walks.",
    "I prefer vegetarian recipes that take less than thirty minutes.",
    "My sister Rita is visiting from Lisbon on the 14th of June.",
    "Remind me that the car needs its inspection before the end of the month.",
];

fn job(user: usize, turn: usize) -> Job {
    let exchange = ExchangeInput {
        session_id: "s".to_owned(),
        turn_id: format!("u{user}-t{turn}"),
        user_text: SENTENCES[(user + turn) % SENTENCES.len()].to_owned(),
        assistant_text: "Thanks for telling me. Here is a short, practical answer with two \
                         suggestions and one question back to you about your plans."
            .to_owned(),
        event_time: None,
        prior_chain: None,
        incomplete: false,
        arrival: None,
    };
    Job {
        id: JobId {
            user: UserKey::new("bench", format!("user-{user}")),
            key: format!("{user:08x}{turn:08x}"),
        },
        exchange,
        trace: None,
    }
}

fn arg(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|at| args.get(at + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// `cache` is the worker's, and the embedded store's commit listener.
async fn run(
    label: &str,
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    users: usize,
    turns: usize,
    concurrency: usize,
    run_jobs: usize,
) {
    let total = users * turns;
    let started = Instant::now();
    for turn in 0..turns {
        for user in 0..users {
            store.enqueue(&job(user, turn)).await.unwrap();
        }
    }
    let enqueue = started.elapsed();

    let tasks = TaskTracker::new();
    let cancel = CancellationToken::new();
    let config = WorkerConfig {
        concurrency,
        run_jobs,
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    };
    let worker = Arc::new(Worker::new(
        Arc::clone(&store),
        cache,
        Arc::new(MemoryConfig::default()),
        config,
        Arc::new(Summarizer::heuristic()),
        Arc::new(Notify::new()),
        tasks.clone(),
        cancel.clone(),
    ));
    let started = Instant::now();
    worker.start(&tokio::runtime::Handle::current(), None);
    while store.queue_depth().await.unwrap() > 0 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let applied = started.elapsed();
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    let stats = worker.stats();
    println!(
        "| {label:<9} | {total:>6} | {users:>5} | {concurrency:>11} | {run_jobs:>8} | {:>10.0} | {:>12.0} | {:>9} |",
        total as f64 / enqueue.as_secs_f64(),
        total as f64 / applied.as_secs_f64(),
        stats.conflicts.load(std::sync::atomic::Ordering::Relaxed),
    );
}

fn main() {
    if std::env::args().any(|arg| arg == "--test") {
        println!("worker benchmark: skipped in test mode (cargo bench --bench worker)");
        return;
    }
    let users = arg("--users", 200);
    let turns = arg("--turns", 10);
    let concurrency = arg("--concurrency", 8);
    let run_jobs = arg("--run-jobs", WorkerConfig::default().run_jobs);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .unwrap();
    println!("# engram worker throughput (heuristic extractor)");
    println!(
        "machine: {} cores; {users} users x {turns} turns, one session each; tokio default threads",
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    println!(
        "\n| store     |   jobs | users | concurrency | run jobs | enqueue/s  | applied/s    | conflicts |"
    );
    println!(
        "|-----------|--------|-------|-------------|----------|------------|--------------|-----------|"
    );
    runtime.block_on(async {
        let dir = tempfile::tempdir().unwrap();
        let cache = Arc::new(MemoryCache::new(users.max(1), usize::MAX));
        let embedded: Arc<dyn Store> = Arc::new(
            EmbeddedStore::open(dir.path())
                .unwrap()
                .with_commit_listener(Arc::clone(&cache) as Arc<dyn CommitListener>),
        );
        run(
            "embedded",
            embedded,
            cache,
            users,
            turns,
            concurrency,
            run_jobs,
        )
        .await;
        match support::start_redis(&[]) {
            Some((mut child, port)) => {
                let url = format!("redis://127.0.0.1:{port}");
                let redis: Arc<dyn Store> =
                    Arc::new(RedisStore::connect(&url, "bench").await.unwrap());
                let cache = Arc::new(MemoryCache::new(users.max(1), usize::MAX));
                run("redis", redis, cache, users, turns, concurrency, run_jobs).await;
                let _ = child.kill();
                let _ = child.wait();
            }
            None => println!("| redis     | skipped: redis-server is not installed |"),
        }
    });
}
