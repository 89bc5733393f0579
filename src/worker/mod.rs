//! The update path: claims recorded exchanges from the store's job queue and applies them to
//! the user's memory, off the hot path.
//!
//! Per job: extract (summarizer or heuristic) → `memory::record_exchange` on the latest state
//! (turn log, base-truth diff, tiers, consolidation every N turns) → index refresh → prefetch of
//! the session's next-turn candidates → one `Store::commit_job` (raw log, state with its version
//! check, prefetched, job applied). A version conflict (another worker changed the user's
//! memory meanwhile) re-runs the job on the newer state. The applied memory goes into the
//! process's cache, so the next request of the user does not decode it again.
//!
//! Exactly once: the raw log is idempotent by job key and the state by turn id, so a job
//! re-claimed after a worker died (before or after its commit) applies once.

pub mod outbox;

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::WorkerConfig;
use crate::error::{Error, Result};
use crate::memory::{self, HeuristicExtractor, MemoryConfig, MemoryState};
use crate::pipeline::cache::{CachedMemory, MemoryCache, first_version};
use crate::store::{ClaimedJob, Job, Store};

pub use outbox::Outbox;

/// Version conflicts tolerated per job before it is left for a later claim.
const CONFLICT_RETRIES: u32 = 8;
const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(2);

pub struct Worker {
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    memory: Arc<MemoryConfig>,
    config: WorkerConfig,
    /// Signalled when this process queued a job.
    wake: Arc<Notify>,
    consumer: String,
    stats: WorkerStats,
}

#[derive(Debug, Default)]
pub struct WorkerStats {
    pub applied: AtomicU64,
    /// Jobs whose exchange was already in memory (a re-claim after a crash).
    pub duplicates: AtomicU64,
    pub conflicts: AtomicU64,
    pub errors: AtomicU64,
    pub failed: AtomicU64,
}

/// What applying one job did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Recorded { version: u64 },
    Duplicate,
}

impl Worker {
    pub fn new(
        store: Arc<dyn Store>,
        cache: Arc<MemoryCache>,
        memory: Arc<MemoryConfig>,
        config: WorkerConfig,
        wake: Arc<Notify>,
    ) -> Worker {
        let consumer = format!(
            "{}-{}-{:x}",
            hostname(),
            std::process::id(),
            first_version()
        );
        Worker {
            store,
            cache,
            memory,
            config,
            wake,
            consumer,
            stats: WorkerStats::default(),
        }
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// Starts `concurrency` claim loops on `tasks`; they stop when `cancel` fires, each after
    /// finishing the job in hand.
    pub fn start(self: &Arc<Self>, tasks: &TaskTracker, cancel: &CancellationToken) {
        for slot in 0..self.config.concurrency {
            let worker = Arc::clone(self);
            let cancel = cancel.clone();
            tasks.spawn(async move { worker.run(slot, cancel).await });
        }
    }

    async fn run(&self, slot: usize, cancel: CancellationToken) {
        let consumer = format!("{}-{slot}", self.consumer);
        let lease = Duration::from_millis(self.config.lease_ms);
        let poll = Duration::from_millis(self.config.poll_interval_ms);
        let mut backoff = poll;
        while !cancel.is_cancelled() {
            match self.store.claim(&consumer, lease).await {
                Ok(Some(claimed)) => {
                    backoff = poll;
                    self.process(claimed).await;
                    continue;
                }
                Ok(None) => backoff = poll,
                Err(error) => {
                    tracing::warn!(%error, "claiming a job failed");
                    backoff = (backoff * 2).min(ERROR_BACKOFF_MAX);
                }
            }
            tokio::select! {
                () = self.wake.notified() => {}
                () = tokio::time::sleep(backoff) => {}
                () = cancel.cancelled() => {}
            }
        }
    }

    async fn process(&self, claimed: ClaimedJob) {
        let job = &claimed.job;
        if claimed.attempt > self.config.max_attempts {
            let reason = format!("gave up after {} attempts", self.config.max_attempts);
            self.stats.failed.fetch_add(1, Ordering::Relaxed);
            tracing::error!(job = %job.id.key, %reason, "job failed");
            if let Err(error) = self.store.fail(&job.id, &reason).await {
                tracing::warn!(%error, "could not mark a job failed");
            }
            return;
        }
        match self.apply(job).await {
            Ok(Applied::Recorded { version }) => {
                self.stats.applied.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(job = %job.id.key, version, attempt = claimed.attempt, "job applied");
            }
            Ok(Applied::Duplicate) => {
                self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(job = %job.id.key, "job was already applied");
            }
            Err(error) => {
                // Left leased: another claim retries it once the lease ends.
                self.stats.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(%error, job = %job.id.key, attempt = claimed.attempt, "applying a job failed; it will be retried");
            }
        }
    }

    /// Applies one job to the user's memory and commits it.
    pub async fn apply(&self, job: &Job) -> Result<Applied> {
        let user = &job.id.user;
        let exchange = &job.exchange;
        for _ in 0..CONFLICT_RETRIES {
            let cached = self.cache.get(user);
            let record = self
                .store
                .hot_record(
                    user,
                    &exchange.session_id,
                    cached.as_ref().map(|m| m.version()),
                )
                .await?;
            let (mut state, base) = match (record.version, record.state, cached) {
                (0, _, _) => {
                    let mut state = MemoryState::new();
                    state.version = first_version();
                    (state, None)
                }
                (_, Some(state), cached) => (state, cached),
                (version, None, Some(cached)) if cached.version() == version => {
                    (cached.state.clone(), Some(cached))
                }
                (_, None, _) => match self.store.load_state(user).await? {
                    Some(state) => (state, None),
                    None => continue,
                },
            };
            let expected = if record.version == 0 {
                0
            } else {
                state.version
            };
            let outcome =
                memory::record_exchange(&mut state, exchange, &HeuristicExtractor, &self.memory);
            if outcome.duplicate {
                // The state has it; make sure the raw log and the job say so too.
                self.store.append_raw(user, &job.id.key, exchange).await?;
                self.store.ack(&job.id).await?;
                return Ok(Applied::Duplicate);
            }
            let applied = CachedMemory::after(base.as_deref(), state);
            let prefetched = memory::prefetch(
                &applied.state,
                &applied.index,
                &exchange.session_id,
                &self.memory.retrieval,
            );
            match self
                .store
                .commit_job(&job.id, exchange, &applied.state, expected, &prefetched)
                .await
            {
                Ok(()) => {
                    let version = applied.version();
                    self.cache.put(user, Arc::new(applied));
                    return Ok(Applied::Recorded { version });
                }
                Err(Error::StoreConflict { .. }) => {
                    self.stats.conflicts.fetch_add(1, Ordering::Relaxed);
                }
                Err(error) => return Err(error),
            }
        }
        Err(Error::Store(format!(
            "memory kept changing: {CONFLICT_RETRIES} version conflicts in a row"
        )))
    }
}

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "engram".to_owned())
}
