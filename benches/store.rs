//! Embedded store benchmark: one user with 2,000 recorded turns, in a redb file in a temporary
//! directory. Prints percentiles of the hot-record read (warm: the caller holds the current
//! version; cold: the state is decoded), of state saves and raw-log appends, and the job
//! queue's enqueue → claim → ack throughput. Every write is a committed, synced transaction.
//!
//! Then, what a recorded answer's end waits for when the worker is busy: enqueues timed one
//! every 2 ms while a worker task claims, applies and commits the jobs as the sidecar's worker
//! does (one user's memory of 2,000 turns growing by each job). Last, a spool's backlog drained
//! while answers keep ending, in memory and on disk, through the metrics' wrapper.
//!
//! `cargo bench --bench store`

#![expect(
    clippy::print_stdout,
    clippy::unwrap_used,
    reason = "a benchmark reports its figures on stdout and stops at the first failure"
)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use engram_memory::{
    ExchangeInput, HeuristicExtractor, ItemRef, MemoryConfig, MemoryState, record_exchange,
};
use engram_ops::metrics::Metrics;
use engram_proxy::recorder::order::SessionOrder;
use engram_proxy::recorder::outbox::{MEMORY_SPOOL_JOBS, Outbox, Spool, SpoolBounds};
use engram_store::{
    EmbeddedStore, EncodedState, Job, JobId, JobQueue, MemoryRecords, Store, UserKey,
};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

const TURNS: usize = 2_000;

const TOPICS: [&str; 8] = [
    "I'm allergic to peanuts and I cook a lot of Thai food at home",
    "My sister Ana lives in Porto and visits every summer",
    "We are moving the billing service from Python to Rust this quarter",
    "I run 10 km on Sundays and I'm training for the Lisbon half marathon",
    "The deadline for the grant proposal is March 14",
    "I prefer short answers with code examples in Rust",
    "Our team uses PostgreSQL 16 and Redis for caching",
    "My daughter starts school in September and needs a new laptop",
];

fn exchange(index: usize) -> ExchangeInput {
    let topic = TOPICS[index % TOPICS.len()];
    ExchangeInput {
        session_id: format!("s{}", index / 100),
        turn_id: format!("turn-{index}"),
        user_text: format!("{topic}. Question {index}: what should I do next about it?"),
        assistant_text: format!(
            "Here is a plan for step {index}: first review what you told me ({topic}), then \
             write down the next three actions, and check back tomorrow."
        ),
        event_time: Some("2026-11-23T10:00:00Z".into()),
        ..ExchangeInput::default()
    }
}

fn percentiles(mut samples: Vec<Duration>) -> String {
    samples.sort();
    let at = |q: f64| {
        let index = ((samples.len() as f64 - 1.0) * q).round() as usize;
        samples[index].as_secs_f64() * 1e3
    };
    format!(
        "p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms  (n={})",
        at(0.5),
        at(0.99),
        at(1.0),
        samples.len()
    )
}

async fn timed<F: Future>(future: F) -> (F::Output, Duration) {
    let start = Instant::now();
    let output = future.await;
    (output, start.elapsed())
}

async fn run() {
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let user = UserKey::new("acme", "alice");

    let mut state = MemoryState::new();
    let config = MemoryConfig::default();
    for index in 0..TURNS {
        record_exchange(&mut state, &exchange(index), &HeuristicExtractor, &config);
    }
    let state_bytes = serde_json::to_vec(&state).unwrap().len();
    println!(
        "state: {TURNS} turns, {} facts, {:.1} MiB as JSON",
        state.facts.len(),
        state_bytes as f64 / (1024.0 * 1024.0)
    );

    let mut samples = Vec::new();
    let mut stored = 0;
    for round in 0..20 {
        let mut next = state.clone();
        next.version += round + 1;
        let (result, elapsed) = timed(store.save_state(&user, &next, stored)).await;
        result.unwrap();
        stored = next.version;
        samples.push(elapsed);
    }
    println!("save_state        {}", percentiles(samples));

    let candidates: Vec<ItemRef> = (0..32).map(ItemRef::RawTurn).collect();
    store
        .save_prefetched(&user, "s19", &candidates)
        .await
        .unwrap();

    let mut samples = Vec::new();
    for _ in 0..5_000 {
        let (result, elapsed) = timed(store.hot_record(&user, "s19", Some(stored))).await;
        assert!(result.unwrap().update.is_none());
        samples.push(elapsed);
    }
    println!("hot_record warm   {}", percentiles(samples));

    let mut samples = Vec::new();
    for _ in 0..20 {
        let (result, elapsed) = timed(store.hot_record(&user, "s19", None)).await;
        assert!(result.unwrap().update.is_some());
        samples.push(elapsed);
    }
    println!("hot_record cold   {}", percentiles(samples));

    let mut samples = Vec::new();
    for index in 0..500 {
        let id = format!("x{index}");
        let (result, elapsed) = timed(store.append_raw(&user, &id, &exchange(index))).await;
        result.unwrap();
        samples.push(elapsed);
    }
    println!("append_raw        {}", percentiles(samples));

    const JOBS: usize = 1_000;
    let start = Instant::now();
    for index in 0..JOBS {
        let job = Job {
            id: JobId {
                user: UserKey::new("acme", format!("user{}", index % 50)),
                key: format!("job-{index}"),
            },
            exchange: exchange(index),
            trace: None,
        };
        store.enqueue(&job).await.unwrap();
    }
    let enqueued = start.elapsed();
    let start = Instant::now();
    while let Some(claimed) = store.claim("bench", Duration::from_secs(30)).await.unwrap() {
        store.ack(&claimed.job.id).await.unwrap();
    }
    let drained = start.elapsed();
    println!(
        "jobs: enqueue {:.0}/s, claim+ack {:.0}/s, all three {:.0} jobs/s",
        JOBS as f64 / enqueued.as_secs_f64(),
        JOBS as f64 / drained.as_secs_f64(),
        JOBS as f64 / (enqueued + drained).as_secs_f64()
    );

    enqueue_beside_the_worker(state).await;
    spool_drain_under_intake(false, false).await;
    spool_drain_under_intake(true, false).await;
    spool_drain_under_intake(true, true).await;
}

/// A spool of `BACKLOG` jobs drained while `INTAKE` more arrive at 1,000 a second: the
/// embedded backend's in-memory spool, or (`on_disk`) the Redis backend's spool file, whose
/// store here is an embedded one on disk too. Both wrapped in the metrics as the proxy wraps
/// them: a wrapper that did not pass the batch clear on cost a commit per forwarded job. The
/// intake is submitted job by job, or (`in_order`) as the proxy records one session's turns:
/// each in its turn, placed so that consecutive ones share the spool's commits.
async fn spool_drain_under_intake(on_disk: bool, in_order: bool) {
    const BACKLOG: usize = 5_000;
    const INTAKE: usize = 5_000;
    let dir = tempfile::tempdir().unwrap();
    let spool_dir = tempfile::tempdir().unwrap();
    let metrics = Metrics::new().unwrap();
    let store = metrics
        .metered_store(
            Arc::new(EmbeddedStore::open(dir.path()).unwrap()),
            "embedded",
        )
        .unwrap();
    let spool_store = if on_disk {
        EmbeddedStore::open(spool_dir.path()).unwrap()
    } else {
        EmbeddedStore::in_memory().unwrap()
    };
    let user = UserKey::new("acme", "bob");
    let backlog: Vec<Job> = (0..BACKLOG).map(|index| job(&user, index)).collect();
    for jobs in backlog.chunks(256) {
        spool_store.enqueue_run(jobs).await.unwrap();
    }
    let held_bytes = spool_store.queued_turn_bytes().await.unwrap();
    let spool_store = metrics
        .metered_store(Arc::new(spool_store), "spool")
        .unwrap();
    let spool = if on_disk {
        Spool::Durable {
            store: spool_store,
            bounds: SpoolBounds {
                jobs: 100_000,
                bytes: 128 << 20,
            },
            held_bytes,
        }
    } else {
        Spool::Memory {
            store: spool_store,
            capacity: MEMORY_SPOOL_JOBS,
        }
    };
    let outbox = Arc::new(Outbox::new(Arc::clone(&store), spool, Arc::new(Notify::new())).await);
    let cancel = CancellationToken::new();
    let started = Instant::now();
    let mut forwarder = tokio::task::JoinSet::new();
    forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
    let mut ticks = tokio::time::interval(Duration::from_millis(1));
    let mut submits = tokio::task::JoinSet::new();
    let (mut peak, mut emptied) = (0, None);
    let mut watch = |outbox: &Outbox| {
        let spooled = outbox.spooled();
        peak = peak.max(spooled);
        if spooled == 0 && emptied.is_none() {
            emptied = Some(started.elapsed());
        }
    };
    let order = SessionOrder::new();
    for index in BACKLOG..BACKLOG + INTAKE {
        ticks.tick().await;
        let submitter = Arc::clone(&outbox);
        let job = job(&user, index);
        let ticket = in_order.then(|| Arc::new(order.ticket("s".to_owned())));
        submits.spawn(async move {
            if let Some(ticket) = &ticket {
                ticket.wait_turn().await;
            }
            submitter.submit_with(job, ticket, false).await
        });
        watch(&outbox);
    }
    while submits.join_next().await.is_some() {}
    let intake_ended = started.elapsed();
    while outbox.spooled() > 0 && started.elapsed() < Duration::from_secs(120) {
        watch(&outbox);
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    watch(&outbox);
    cancel.cancel();
    while forwarder.join_next().await.is_some() {}
    let stats = outbox.stats();
    println!(
        "spool drain ({}): {BACKLOG} spooled, {INTAKE} more at 1,000/s (over {:.1} s): {}, \
         peak {peak} spooled, {} forwarded, {} lost",
        match (on_disk, in_order) {
            (false, _) => "in memory",
            (true, false) => "on disk",
            (true, true) => "on disk, one session in order",
        },
        intake_ended.as_secs_f64(),
        emptied.map_or_else(
            || "NOT empty after 120 s".to_owned(),
            |at| format!("empty at {:.2} s", at.as_secs_f64())
        ),
        stats.forwarded.load(Ordering::Relaxed),
        stats.lost.load(Ordering::Relaxed),
    );
}

fn job(user: &UserKey, index: usize) -> Job {
    Job {
        id: JobId {
            user: user.clone(),
            key: format!("beside-{index}"),
        },
        exchange: exchange(index),
        trace: None,
    }
}

/// Enqueues, one every 2 ms, timed while a worker task applies and commits them: the worker's
/// commits and the recorders' enqueues share redb's one writer.
async fn enqueue_beside_the_worker(mut state: MemoryState) {
    const ENQUEUES: usize = 2_000;
    let dir = tempfile::tempdir().unwrap();
    let store = EmbeddedStore::open(dir.path()).unwrap();
    let user = UserKey::new("acme", "bob");
    // The memory's first commit writes it whole.
    let first = job(&user, 0);
    store.enqueue(&first).await.unwrap();
    state.take_changes();
    store
        .commit_jobs(
            std::slice::from_ref(&first),
            &EncodedState::of(&state).unwrap(),
            0,
            &[],
        )
        .await
        .unwrap();

    let stop = AtomicBool::new(false);
    // Two futures of one task (the enqueues' timer and the worker's store calls both wait
    // most of the time); the worker computes on the blocking pool, as the sidecar's does on
    // threads of its own.
    let worker = async {
        let config = MemoryConfig::default();
        let mut commits = Vec::new();
        while !stop.load(Ordering::Relaxed) {
            let claimed = store
                .claim_batch("worker", Duration::from_secs(30), 8)
                .await
                .unwrap();
            if claimed.is_empty() {
                tokio::time::sleep(Duration::from_millis(1)).await;
                continue;
            }
            let jobs: Vec<Job> = claimed.into_iter().map(|claimed| claimed.job).collect();
            let expected = state.version;
            let (next, encoded) = {
                let (mut next, jobs) = (state.clone(), jobs.clone());
                let config = config.clone();
                tokio::task::spawn_blocking(move || {
                    for job in &jobs {
                        record_exchange(&mut next, &job.exchange, &HeuristicExtractor, &config);
                    }
                    let changes = next.take_changes();
                    let encoded = EncodedState::changes(&next, &changes).unwrap();
                    (next, encoded)
                })
                .await
                .unwrap()
            };
            let (result, elapsed) = timed(store.commit_jobs(&jobs, &encoded, expected, &[])).await;
            result.unwrap();
            commits.push(elapsed);
            state = next;
        }
        commits
    };
    let enqueues = async {
        let mut samples = Vec::with_capacity(ENQUEUES);
        let mut ticks = tokio::time::interval(Duration::from_millis(2));
        for index in 1..=ENQUEUES {
            ticks.tick().await;
            let (result, elapsed) = timed(store.enqueue(&job(&user, index))).await;
            result.unwrap();
            samples.push(elapsed);
        }
        stop.store(true, Ordering::Relaxed);
        samples
    };
    let (commits, samples) = tokio::join!(worker, enqueues);
    println!("beside the worker: enqueue {}", percentiles(samples));
    println!("                   job commit {}", percentiles(commits));
}

fn main() {
    // `cargo test --all-targets` runs harness-less benches with `--test`: nothing to check here.
    if std::env::args().any(|arg| arg == "--test") {
        return;
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(run());
}
