//! Preloading one user's history through the library, as `benches/worker.rs` does: recorded
//! exchanges are enqueued as `Job`s into an `EmbeddedStore` opened on the size's data
//! directory, and the real `engram_proxy::worker::Worker` applies them in-process, so the history is
//! loaded at the rate the worker sustains and is stored exactly as the proxy would have stored
//! it. The store is closed afterwards, so `engram serve` can open the file.

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::{Duration, Instant};

use engram_memory::MemoryConfig;
use engram_proxy::cache::MemoryCache;
use engram_proxy::summarizer::Summarizer;
use engram_proxy::worker::{Worker, WorkerConfig};
use engram_store::{CommitListener, EmbeddedStore, Job, JobId, JobQueue, Store, UserKey};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::text;

/// The one user and session every history-size run measures.
pub const TENANT: &str = "default";
pub const USER: &str = "solo";
pub const SESSION: &str = "history";

/// Jobs enqueued ahead of the worker at most, so the queue stays short.
const AHEAD: u64 = 2_048;
/// Jobs enqueued at once: the embedded store commits concurrent enqueues together, where one
/// at a time each waits for its own commit (which would be the preload's bottleneck).
const CHUNK: u64 = 256;
/// How often progress is printed.
const PROGRESS_EVERY: Duration = Duration::from_secs(10);

/// What preloading one size did.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Preload {
    /// Turns asked for.
    pub turns: u64,
    /// Jobs the worker applied (all of them, unless it gave up).
    pub applied: u64,
    pub secs: f64,
    /// Jobs applied per second over the whole preload.
    pub rate: f64,
    /// Jobs per second over the last progress interval (the rate at the largest history).
    pub final_rate: f64,
    /// Why it stopped before the end, if it did.
    pub gave_up: Option<String>,
    /// Size of the store's directory afterwards.
    pub store_mib: f64,
}

fn job(user: &UserKey, n: u64) -> Job {
    let turn_id = format!("preload-{n:08}");
    Job {
        id: JobId {
            user: user.clone(),
            key: format!("{:016x}{n:016x}", 0x6869_7374_6f72_7900_u64),
        },
        exchange: text::exchange(n, SESSION, turn_id),
        trace: None,
    }
}

/// Preloads `turns` turns for the one user into the embedded store in `dir` (created fresh by
/// the caller), giving up after `timeout`.
pub fn preload(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    turns: u64,
    timeout: Duration,
) -> Result<Preload, String> {
    let cache = Arc::new(MemoryCache::new(16, usize::MAX));
    let store: Arc<dyn Store> = Arc::new(
        EmbeddedStore::open(dir)
            .map_err(|e| format!("opening the embedded store: {e}"))?
            .with_commit_listener(Arc::clone(&cache) as Arc<dyn CommitListener>),
    );
    let result = runtime.block_on(run(Arc::clone(&store), cache, turns, timeout));
    // The worker's tasks have stopped: this is the last handle, and dropping it closes the
    // file for `engram serve`.
    drop(store);
    let mut preload = result?;
    preload.store_mib = dir_bytes(dir) as f64 / 1024.0 / 1024.0;
    Ok(preload)
}

/// `cache` is the worker's, and the store's commit listener.
async fn run(
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    turns: u64,
    timeout: Duration,
) -> Result<Preload, String> {
    let user = UserKey::new(TENANT, USER);
    let tasks = TaskTracker::new();
    let cancel = CancellationToken::new();
    let wake = Arc::new(Notify::new());
    let config = WorkerConfig {
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    };
    let worker = Arc::new(Worker::new(
        Arc::clone(&store),
        cache,
        Arc::new(MemoryConfig::default()),
        config,
        Arc::new(Summarizer::heuristic()),
        Arc::clone(&wake),
        tasks.clone(),
        cancel.clone(),
    ));
    worker.start(&tokio::runtime::Handle::current(), None);
    let done = |worker: &Worker| {
        let stats = worker.stats();
        stats.applied.load(Ordering::Relaxed)
            + stats.duplicates.load(Ordering::Relaxed)
            + stats.failed.load(Ordering::Relaxed)
    };
    let started = Instant::now();
    let mut enqueued = 0;
    let mut last = (started, 0u64);
    let mut final_rate = 0.0;
    let mut gave_up = None;
    let mut error = None;
    loop {
        let finished = done(&worker);
        if enqueued < turns && enqueued < finished + AHEAD {
            let end = (enqueued + CHUNK).min(turns).min(finished + AHEAD);
            let jobs: Vec<Job> = (enqueued..end).map(|n| job(&user, n)).collect();
            if let Err(e) = enqueue_all(store.as_ref(), &jobs).await {
                error = Some(format!("enqueue failed: {e}"));
                break;
            }
            enqueued = end;
            wake.notify_one();
        } else {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let finished = done(&worker);
        if enqueued == turns && finished >= turns {
            match store.queue_depth().await {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    error = Some(format!("queue depth: {e}"));
                    break;
                }
            }
        }
        let elapsed = started.elapsed();
        if last.0.elapsed() >= PROGRESS_EVERY {
            final_rate = (finished - last.1) as f64 / last.0.elapsed().as_secs_f64();
            println!(
                "  preloading {} turns: {} applied in {:.0} s, {:.0} jobs/s (last {:.0} s: {:.0} jobs/s)",
                thousands(turns),
                thousands(finished),
                elapsed.as_secs_f64(),
                finished as f64 / elapsed.as_secs_f64(),
                PROGRESS_EVERY.as_secs_f64(),
                final_rate
            );
            last = (Instant::now(), finished);
        }
        if elapsed > timeout {
            gave_up = Some(format!(
                "gave up preloading after {:.0} s (--preload-timeout-secs) with {} of {} turns applied, {:.0} jobs/s at the end",
                elapsed.as_secs_f64(),
                thousands(finished),
                thousands(turns),
                final_rate
            ));
            break;
        }
    }
    let secs = started.elapsed().as_secs_f64();
    cancel.cancel();
    tasks.close();
    // Jobs in hand finish; bounded, in case one never does.
    if tokio::time::timeout(Duration::from_secs(120), tasks.wait())
        .await
        .is_err()
    {
        return Err("the preload worker did not stop within 120 s".into());
    }
    if let Some(error) = error {
        return Err(error);
    }
    let applied = done(&worker);
    if last.1 == 0 {
        // Finished before the first progress line: the whole preload is the last interval.
        final_rate = applied as f64 / secs;
    }
    Ok(Preload {
        turns,
        applied,
        secs,
        rate: applied as f64 / secs,
        final_rate,
        gave_up,
        store_mib: 0.0,
    })
}

/// Enqueues `jobs` concurrently, each first polled in order (so they reach the store in
/// order); the first error stops it.
async fn enqueue_all(store: &dyn JobQueue, jobs: &[Job]) -> Result<(), String> {
    let mut pending: Vec<_> = jobs.iter().map(|job| Some(store.enqueue(job))).collect();
    std::future::poll_fn(|cx| {
        let mut all_done = true;
        for slot in &mut pending {
            if let Some(future) = slot {
                match future.as_mut().poll(cx) {
                    Poll::Ready(Ok(_)) => *slot = None,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e.to_string())),
                    Poll::Pending => all_done = false,
                }
            }
        }
        if all_done {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await
}

fn thousands(n: u64) -> String {
    crate::report::thousands(n as f64)
}

/// Bytes of the files under `dir`.
pub fn dir_bytes(dir: &Path) -> u64 {
    std::fs::read_dir(dir).map_or(0, |entries| {
        entries
            .flatten()
            .map(|entry| match entry.metadata() {
                Ok(meta) if meta.is_dir() => dir_bytes(&entry.path()),
                Ok(meta) => meta.len(),
                Err(_) => 0,
            })
            .sum()
    })
}
