//! The update path: claims recorded exchanges from the store's job queue and applies them to
//! the user's memory, off the hot path.
//!
//! Jobs are claimed in batches; a session's jobs in a batch form a run applied together. Per
//! run: extract each exchange (the LLM summarizer, or the heuristic extractor) →
//! `memory::record_exchange` for each, in order, on the latest state
//! (turn log, base-truth diff, tiers, consolidation every N turns) → index refresh → prefetch of
//! the session's next-turn candidates → one `Store::commit_jobs` (raw log, state with its version
//! check, prefetched, job applied). A version conflict (another worker changed the user's
//! memory meanwhile) re-runs the job on the newer state. The applied memory goes into the
//! process's cache, so the next request of the user does not decode it again: staged there
//! before the commit, it is cached on the store's commit thread when the store tells the cache
//! of the commit (`engram_store::CommitListener`), else once the commit returns.
//!
//! Exactly once: the raw log is idempotent by job key and the state by turn id, so a job
//! re-claimed after a worker died (before or after its commit) applies once.
//!
//! When the summarizer fell back for a transient reason (timeout, rate limit, upstream down),
//! the turn is recorded with the heuristic extraction now and the summarizer is asked again
//! after `background_retry_delay_ms`; its grounded diff is then applied to the turn. That retry
//! lives in memory only: if the process stops first, the heuristic extraction stands.

mod config;
mod held;
pub mod lag;
mod metrics;
mod stall;
mod summaries;

pub use config::WorkerConfig;
pub use metrics::WorkerMetrics;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::{Notify, Semaphore, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::cache::{CachedMemory, MemoryCache, first_version};
use crate::error::{Error, Result};
use crate::ratelimit::TokenBudget;
use crate::summarizer::{Summarizer, Summary, SummaryFailure, SummarySource};
use crate::telemetry::{Telemetry, attributes};
use engram_memory::{
    self as memory, CandidateId, ExchangeInput, MemoryConfig, MemoryState, Precomputed,
};
use engram_runtime::priority;
use engram_store::{ClaimedJob, EncodedState, Job, MemoryRecords, MemoryUpdate, Store, UserKey};

use held::HeldRuns;
use lag::{Claimer, LagGate, OwnCpu, Progress};
use stall::{Computing, Stalls};
use summaries::RunSummaries;

/// Version conflicts tolerated per job before it is left for a later claim.
const CONFLICT_RETRIES: u32 = 8;
const ERROR_BACKOFF_MAX: Duration = Duration::from_secs(2);
/// Waits before a run whose store failed is applied again, its lease still held: left leased,
/// a session's jobs waited for the whole lease (30 s by default) after a Redis stall.
const STORE_RETRIES: [Duration; 3] = [
    Duration::from_millis(200),
    Duration::from_millis(400),
    Duration::from_millis(800),
];

/// Who applies a run: the claim loop that claimed it, or the catch-up taking it over from a
/// starved idle loop (see [`held`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Applier {
    Claimed(Claimer),
    TakenOver,
}

impl Applier {
    /// Whether the run is applied at normal priority, by the catch-up.
    fn is_catch_up(self) -> bool {
        matches!(
            self,
            Applier::Claimed(Claimer::CatchUp) | Applier::TakenOver
        )
    }

    /// How the thread computing the run holds its yields back, given whether the lag is a
    /// quarter of the bound or more (`None`: as it is). The catch-up holds them back after
    /// foreign ones only while behind: on a node whose other processes keep the cores busy, a
    /// yield hands the core to them for a slice, and yielding every 100 µs it fell behind at
    /// 200 req/s; caught up, it gives way to requests at every yield, as the idle worker does,
    /// since holding back then only made requests wait (added p50 5–13 ms in some runs,
    /// against 1.5).
    fn hold_back(self, behind: bool) -> Option<u32> {
        match (self.is_catch_up(), behind) {
            (true, true) => Some(priority::CATCH_UP_FOREIGN_YIELDS),
            (true, false) => Some(0),
            (false, _) => None,
        }
    }
}

pub struct Worker {
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    memory: Arc<MemoryConfig>,
    config: WorkerConfig,
    summarizer: Arc<Summarizer>,
    /// Signalled when this process queued a job.
    wake: Arc<Notify>,
    consumer: String,
    /// Shared with the background summarizer retries.
    stats: Arc<WorkerStats>,
    /// The claim loops and background summarizer retries.
    tasks: TaskTracker,
    cancel: CancellationToken,
    /// Per-tenant summarizer tokens; `None` is unlimited.
    token_budget: Option<Arc<TokenBudget>>,
    metrics: Option<WorkerMetrics>,
    telemetry: Telemetry,
    /// What the catch-up's monitor reads: both claim loops report their applied jobs.
    progress: Progress,
    /// With a catch-up: the idle loop's runs in hand, which the catch-up takes over while
    /// the idle threads are starved (see [`held`]).
    held: HeldRuns,
    /// The idle loop's runs being computed, which the monitor watches (see [`stall`]).
    computing: Arc<Computing>,
    /// Set by the catch-up's monitor while the idle threads count as starved.
    idle_starved: AtomicBool,
    /// Set by the catch-up's monitor while it is behind ([`LagGate::behind`]).
    behind: AtomicBool,
    /// With a catch-up and a model summarizer: the catch-up's (normal-priority) runtime, where
    /// every pass's model summaries are made (see [`summaries`]).
    model_runtime: std::sync::OnceLock<tokio::runtime::Handle>,
    /// One user's runs of different sessions apply one at a time in this process (a stripe per
    /// user hash): run side by side they each read the same version and all but one commit
    /// conflicted, and after a restart with a backlog, eight conflicts in a row left a job to
    /// wait out its lease.
    applying: Arc<[tokio::sync::Mutex<()>]>,
}

/// Stripes of [`Worker::applying`].
const APPLY_STRIPES: usize = 64;

#[derive(Debug, Default)]
pub struct WorkerStats {
    pub applied: AtomicU64,
    /// Runs committed (a run: one session's claimed jobs, applied in one pass); `applied` over
    /// this is the mean run length.
    pub runs: AtomicU64,
    /// Jobs whose exchange was already in memory (a re-claim after a crash).
    pub duplicates: AtomicU64,
    pub conflicts: AtomicU64,
    pub errors: AtomicU64,
    pub failed: AtomicU64,
    /// Turns recorded with the heuristic extraction because the summarizer failed.
    pub summarizer_fallbacks: AtomicU64,
    /// Background summarizer retries whose diff was applied.
    pub summarizer_refined: AtomicU64,
    /// Jobs applied by the catch-up (see [`lag`]), among `applied`.
    pub catch_up_applied: AtomicU64,
    /// 1 while the catch-up claims the jobs, else 0.
    pub catch_up_active: AtomicU64,
    /// Runs of the idle loop the catch-up took over from its starved threads.
    pub taken_over: AtomicU64,
}

/// Spends the job's estimated summarizer tokens from its tenant's budget; true when the model
/// may be called (always, without a budget or a model).
fn within_budget(summarizer: &Summarizer, budget: Option<&TokenBudget>, job: &Job) -> bool {
    let (Some(budget), Some(tokens)) = (
        budget,
        summarizer.estimated_input_tokens(&job.exchange.user_text, &job.exchange.assistant_text),
    ) else {
        return true;
    };
    budget.spend(&job.id.user.tenant, tokens)
}

/// What the summarizer gave for a job: its summary, or why the model gave none (the pass then
/// takes the heuristic extraction, `Summarizer::after_failure`).
type Answer = std::result::Result<Summary, SummaryFailure>;

/// The summarizer's answer for the job; a refusal when its tenant's summarizer tokens are
/// spent (counted here).
async fn answer(summarizer: &Summarizer, budget: Option<&TokenBudget>, job: &Job) -> Answer {
    let (user_text, assistant_text) = (&job.exchange.user_text, &job.exchange.assistant_text);
    if within_budget(summarizer, budget, job) {
        summarizer.answer(user_text, assistant_text).await
    } else {
        let reason = SummaryFailure::TokenBudget;
        summarizer.refused(reason);
        Err(reason)
    }
}

/// What applying one job did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Applied {
    Recorded {
        version: u64,
    },
    Duplicate,
    /// Its user was forgotten while it was applied; nothing was written.
    Forgotten,
}

impl Worker {
    /// `tasks` runs the claim loops and background retries; `cancel` stops them.
    #[allow(
        clippy::too_many_arguments,
        reason = "the worker's dependencies, wired once at start-up"
    )]
    pub fn new(
        store: Arc<dyn Store>,
        cache: Arc<MemoryCache>,
        memory: Arc<MemoryConfig>,
        config: WorkerConfig,
        summarizer: Arc<Summarizer>,
        wake: Arc<Notify>,
        tasks: TaskTracker,
        cancel: CancellationToken,
    ) -> Worker {
        // Names the holder of a lease (and, in Redis, a consumer of the group). Host and
        // process are enough: a lease, not the name, decides who may apply a job.
        let consumer = format!("{}-{}", hostname(), std::process::id());
        Worker {
            store,
            cache,
            memory,
            config,
            summarizer,
            wake,
            consumer,
            stats: Arc::default(),
            tasks,
            cancel,
            token_budget: None,
            metrics: None,
            telemetry: Telemetry::default(),
            progress: Progress::default(),
            held: HeldRuns::default(),
            computing: Arc::default(),
            idle_starved: AtomicBool::new(false),
            behind: AtomicBool::new(false),
            model_runtime: std::sync::OnceLock::new(),
            applying: (0..APPLY_STRIPES)
                .map(|_| tokio::sync::Mutex::new(()))
                .collect(),
        }
    }

    /// Charges summarizer calls to each tenant's token budget.
    pub fn with_token_budget(mut self, budget: Option<Arc<TokenBudget>>) -> Worker {
        self.token_budget = budget;
        self
    }

    /// Observes each applied job's lag (the counts are read from [`Worker::stats`]).
    pub fn with_metrics(mut self, metrics: WorkerMetrics) -> Worker {
        self.metrics = Some(metrics);
        self
    }

    /// A span per applied run of jobs, linked to the requests that recorded them.
    pub fn with_telemetry(mut self, telemetry: Telemetry) -> Worker {
        self.telemetry = telemetry;
        self
    }

    pub fn stats(&self) -> &WorkerStats {
        &self.stats
    }

    /// Starts the claim loop on `idle` (see [`priority`]) and, with `catch_up` (a
    /// normal-priority runtime), the catch-up's claim loop and its lag monitor there (see
    /// [`lag`]). They stop when the cancel token fires, and jobs in hand finish. What each loop
    /// spawns runs on its own runtime.
    pub fn start(
        self: &Arc<Self>,
        idle: &tokio::runtime::Handle,
        catch_up: Option<&tokio::runtime::Handle>,
    ) {
        let max_lag = Duration::from_millis(self.config.max_lag_ms);
        let Some(catch_up) = catch_up.filter(|_| !max_lag.is_zero()) else {
            self.spawn_dispatch(Claimer::Idle, None, idle);
            return;
        };
        if self.summarizer.is_configured() {
            let _ = self.model_runtime.set(catch_up.clone());
        }
        let (turns, turn) = watch::channel(Claimer::Idle);
        self.spawn_dispatch(Claimer::Idle, Some(turn.clone()), idle);
        self.spawn_dispatch(Claimer::CatchUp, Some(turn), catch_up);
        let worker = Arc::clone(self);
        let (idle, cancel) = (idle.clone(), self.cancel.clone());
        self.tasks.spawn_on(
            async move { worker.monitor(turns, idle, max_lag, cancel).await },
            catch_up,
        );
    }

    fn spawn_dispatch(
        self: &Arc<Self>,
        me: Claimer,
        turn: Option<watch::Receiver<Claimer>>,
        runtime: &tokio::runtime::Handle,
    ) {
        let worker = Arc::clone(self);
        let cancel = self.cancel.clone();
        self.tasks.spawn_on(
            async move { worker.dispatch(me, turn, cancel).await },
            runtime,
        );
    }

    /// Keeps up to `concurrency` runs in flight: once one can start, claims up to `run_jobs`
    /// jobs of as many sessions as there is room for in one store call (so they can share
    /// commits), splits them into runs of one session each and applies each on its own task.
    /// With a `turn`, claims only while it names `me`.
    async fn dispatch(
        self: Arc<Self>,
        me: Claimer,
        mut turn: Option<watch::Receiver<Claimer>>,
        cancel: CancellationToken,
    ) {
        let lease = Duration::from_millis(self.config.lease_ms);
        let poll = Duration::from_millis(self.config.poll_interval_ms);
        let room = Arc::new(Semaphore::new(self.config.concurrency));
        // Told when a run of jobs ends, freeing its session and its permit.
        let run_ended = Arc::new(Notify::new());
        let mut backoff = poll;
        // The catch-up, caught up, lets jobs gather this long between claims. Claimed as they
        // came (two or so at a time, as a busy core runs it), each few cost a claim and a commit
        // on the store's one write lock, which the recorded answers' enqueues wait for: with
        // the other processes' load, those transactions took the core and answers waited
        // seconds. A backlog is claimed as fast as before: a full claim does not wait, nor
        // does any claim of a store whose claims come back short with more queued (Redis,
        // which returns once one queue shard gave jobs): waiting after each, when Redis leased
        // one job a session, held one user's catch-up to ten jobs a second.
        let gather = Duration::from_millis(self.config.max_lag_ms / 10);
        let short_claims_took_all = self.store.claims_whole_runs();
        let mut next_claim: Option<Instant> = None;
        // The idle loop's runs are open to the catch-up when there is one.
        let holding = me == Claimer::Idle && turn.is_some();
        loop {
            tokio::select! {
                open = turn_is(&mut turn, |claimer| claimer == me) => if !open { return },
                () = cancel.cancelled() => return,
            }
            let first = tokio::select! {
                permit = Arc::clone(&room).acquire_owned() => permit,
                () = cancel.cancelled() => return,
            };
            let Ok(first) = first else { return };
            // No more sessions than runs can start now: a claimed run that waited for room would
            // hold its session's lease meanwhile, on a starved idle thread for as long as that.
            let sessions = room.available_permits() + 1;
            // A run's jobs wait for their model calls one after another: with an LLM summarizer
            // a claim takes only what can start at once, as short runs.
            let batch = if self.summarizer.is_configured() {
                sessions
            } else {
                self.config.run_jobs.max(1)
            };
            let mut filled = false;
            match self
                .store
                .claim_runs(&self.consumer, lease, batch, sessions)
                .await
            {
                Ok(claimed) if !claimed.is_empty() => {
                    backoff = poll;
                    filled = claimed.len() == batch;
                    next_claim = (me == Claimer::CatchUp && !filled && short_claims_took_all)
                        .then(|| Instant::now() + gather);
                    // Only this loop takes permits, and the claim held no more sessions than
                    // there were free: every run has one.
                    let mut first = Some(first);
                    for run in runs(claimed) {
                        let permit = first
                            .take()
                            .or_else(|| Arc::clone(&room).try_acquire_owned().ok());
                        let worker = Arc::clone(&self);
                        let run_ended = Arc::clone(&run_ended);
                        let summaries = Arc::new(RunSummaries::new(&run));
                        let hold =
                            holding.then(|| self.held.hold(&run, &summaries, Instant::now()));
                        self.tasks.spawn(async move {
                            // Not if the catch-up took it over before it started.
                            if hold.is_none_or(|id| worker.held.is_held(id)) {
                                let applier = Applier::Claimed(me);
                                worker.process(run, &summaries, applier).await;
                            }
                            if let Some(id) = hold {
                                worker.held.release(id);
                            }
                            drop(permit);
                            run_ended.notify_one();
                        });
                    }
                }
                Ok(_) => {
                    drop(first);
                    backoff = poll;
                }
                Err(error) => {
                    drop(first);
                    tracing::warn!(%error, "claiming jobs failed");
                    backoff = (backoff * 2).min(ERROR_BACKOFF_MAX);
                }
            }
            if filled {
                // There may be more to claim at once.
                continue;
            }
            // The claim took all there was. While runs are in flight, what is left waits
            // behind them (a session's jobs apply in order, so a busy session's are not
            // claimable): claiming again at every enqueue would walk the whole backlog for
            // nothing, and with one user sending fast that was once per request. The next run's
            // end is when a claim can find more; the poll interval bounds the wait of another
            // session's new job.
            let in_flight = room.available_permits() < self.config.concurrency;
            tokio::select! {
                () = self.wake.notified(), if !in_flight => {}
                () = run_ended.notified(), if in_flight => {}
                () = tokio::time::sleep(backoff) => {}
                // Our turn ended: stop waiting on the wake-ups, they are the other loop's now.
                _ = turn_is(&mut turn, |claimer| claimer != me) => {}
                () = cancel.cancelled() => return,
            }
            if let Some(until) = next_claim {
                tokio::select! {
                    () = tokio::time::sleep_until(until.into()) => {}
                    _ = turn_is(&mut turn, |claimer| claimer != me) => {}
                    () = cancel.cancelled() => return,
                }
            }
        }
    }

    /// Every [`lag::TICK`]: estimates the job lag, probes whether the idle threads get the CPU
    /// (a probe task must run promptly, and a run being computed must have run; see [`stall`]),
    /// and tells the claim loops whose turn it is (see [`LagGate`]).
    async fn monitor(
        self: Arc<Self>,
        turns: watch::Sender<Claimer>,
        idle: tokio::runtime::Handle,
        max_lag: Duration,
        cancel: CancellationToken,
    ) {
        let mut gate = LagGate::new(max_lag);
        let mut probe = Probe::default();
        let mut own_cpu = OwnCpu::default();
        let mut stalls = Stalls::default();
        let mut ticks = tokio::time::interval(lag::TICK);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                _ = ticks.tick() => {}
                () = cancel.cancelled() => return,
            }
            let late = probe.starved(&idle);
            let depth = match self.store.queue_depth().await {
                Ok(depth) => depth,
                Err(error) => {
                    tracing::debug!(%error, "the lag monitor could not read the queue depth");
                    continue;
                }
            };
            let now = Instant::now();
            let stalled = stalls.look(&self.computing, now);
            let starved = late || stalled;
            // The share since the last look, which a late probe waited through.
            let own_share = own_cpu.share(now);
            let own = own_share.is_some_and(|share| share >= lag::OWN_BUSY);
            let lag = self.progress.estimate(depth, now);
            let claimer = gate.update(lag, starved, own, now);
            self.behind.store(gate.behind(lag), Ordering::Relaxed);
            let idle_starved = gate.starved(now);
            self.idle_starved.store(idle_starved, Ordering::Relaxed);
            if idle_starved {
                self.take_over_held_runs(max_lag / 4);
            }
            let changed =
                turns.send_if_modified(|current| std::mem::replace(current, claimer) != claimer);
            if changed {
                let active = claimer == Claimer::CatchUp;
                self.stats
                    .catch_up_active
                    .store(u64::from(active), Ordering::Relaxed);
                tracing::info!(
                    claimer = ?claimer,
                    lag_ms = lag.as_millis() as u64,
                    depth,
                    late,
                    stalled,
                    own_cpu = own_share.unwrap_or(0.0),
                    "update path: claims moved"
                );
            }
        }
    }

    /// On the catch-up's runtime, while the idle threads count as starved (whoever may claim):
    /// applies the runs the idle loop has held for `age` or longer (see [`held`]), a quarter of
    /// the lag bound, which leaves the rest for the apply. Sooner, the catch-up would take runs
    /// from an idle loop that our own requests delay only briefly. Their permits stay with the
    /// idle loop.
    fn take_over_held_runs(self: &Arc<Self>, age: Duration) {
        for (run, summaries) in self.held.take_older_than(age, Instant::now()) {
            let Some(first) = run.first() else { continue };
            tracing::info!(
                first = %first.job.id.key,
                jobs = run.len(),
                "update path: the catch-up took over a run the starved idle loop held"
            );
            self.stats.taken_over.fetch_add(1, Ordering::Relaxed);
            let worker = Arc::clone(self);
            self.tasks.spawn(async move {
                worker.process(run, &summaries, Applier::TakenOver).await;
            });
        }
    }

    /// Applies a run of one session's jobs, in order; `summaries` are the run's, shared with
    /// any other pass over it.
    async fn process(
        &self,
        run: Vec<ClaimedJob>,
        summaries: &RunSummaries<Answer>,
        applier: Applier,
    ) {
        let mut jobs = Vec::with_capacity(run.len());
        for claimed in run {
            if claimed.attempt > self.config.max_attempts {
                let reason = format!("gave up after {} attempts", self.config.max_attempts);
                self.stats.failed.fetch_add(1, Ordering::Relaxed);
                tracing::error!(job = %claimed.job.id.key, %reason, "job failed");
                if let Err(error) = self.store.fail(&claimed.job.id, &reason).await {
                    tracing::warn!(%error, "could not mark a job failed");
                }
            } else {
                jobs.push(claimed.job);
            }
        }
        if jobs.is_empty() {
            return;
        }
        let mut span = self.telemetry.memory_update(
            jobs.len(),
            jobs.first().map(|job| job.exchange.session_id.as_str()),
            jobs.iter().filter_map(|job| job.trace),
        );
        let started = std::time::Instant::now();
        let mut result = self.apply_run(&jobs, summaries, applier).await;
        for wait in STORE_RETRIES {
            if !matches!(result, Err(Error::Store(_))) {
                break;
            }
            tokio::time::sleep(wait).await;
            result = self.apply_run(&jobs, summaries, applier).await;
        }
        match result {
            Ok(applied) => {
                self.stats.runs.fetch_add(1, Ordering::Relaxed);
                if let Some(metrics) = &self.metrics {
                    metrics.applied_run(jobs.len(), started.elapsed());
                }
                if !span.is_off() {
                    let duplicates = applied
                        .iter()
                        .filter(|applied| **applied == Applied::Duplicate)
                        .count();
                    span.set_int(attributes::JOBS_DUPLICATE, duplicates as u64);
                }
                for (job, applied) in jobs.iter().zip(applied) {
                    match applied {
                        Applied::Recorded { version } => {
                            self.stats.applied.fetch_add(1, Ordering::Relaxed);
                            if applier.is_catch_up() {
                                self.stats.catch_up_applied.fetch_add(1, Ordering::Relaxed);
                            }
                            if let Some(lag) = lag::turn_lag(&job.exchange.turn_id) {
                                self.progress.applied(lag, Instant::now());
                            }
                            if let Some(metrics) = &self.metrics {
                                metrics.applied(&job.exchange.turn_id);
                            }
                            tracing::debug!(job = %job.id.key, version, "job applied");
                        }
                        Applied::Duplicate => {
                            self.stats.duplicates.fetch_add(1, Ordering::Relaxed);
                            tracing::debug!(job = %job.id.key, "job was already applied");
                        }
                        Applied::Forgotten => {}
                    }
                }
            }
            Err(error) => {
                span.fail(error.error_type());
                // Left leased (after `STORE_RETRIES` for a failing store): another claim
                // retries them once the lease ends.
                self.stats
                    .errors
                    .fetch_add(jobs.len() as u64, Ordering::Relaxed);
                tracing::warn!(%error, jobs = jobs.len(), first = %jobs[0].id.key, "applying jobs failed; they will be retried");
            }
        }
    }

    /// Applies jobs of one session, in order, and commits them together: one state read,
    /// one engine pass, one write, whatever the run's length.
    async fn apply_run(
        &self,
        jobs: &[Job],
        summaries: &RunSummaries<Answer>,
        applier: Applier,
    ) -> Result<Vec<Applied>> {
        let mut extractions = Vec::with_capacity(jobs.len());
        // Per job: why the summarizer fell back, and whether to ask it again later.
        let mut fallbacks = Vec::with_capacity(jobs.len());
        // The taken-over pass waits a tick at most for a summary the idle task is making (a
        // model's is made on the catch-up's runtime, and waited for).
        let wait = (applier == Applier::TakenOver).then_some(lag::TICK);
        for job in jobs {
            let answer = match self.model_runtime.get() {
                Some(runtime) => {
                    let (summarizer, budget) =
                        (Arc::clone(&self.summarizer), self.token_budget.clone());
                    let owned = Arc::new(job.clone());
                    let make = move || {
                        let (summarizer, budget, job) =
                            (Arc::clone(&summarizer), budget.clone(), Arc::clone(&owned));
                        async move { answer(&summarizer, budget.as_deref(), &job).await }
                    };
                    summaries
                        .get_or_make_on(&job.id.key, runtime, &self.tasks, make)
                        .await
                }
                None => {
                    let make = || answer(&self.summarizer, self.token_budget.as_deref(), job);
                    summaries.get_or_make(&job.id.key, wait, make).await
                }
            };
            // The fallback here, on this loop's thread: CPU, and no tokens.
            let summary = answer.unwrap_or_else(|reason| {
                let exchange = &job.exchange;
                let (user_text, assistant_text) = (&exchange.user_text, &exchange.assistant_text);
                self.summarizer
                    .after_failure(user_text, assistant_text, reason)
            });
            let reason = match summary.source {
                SummarySource::Fallback { reason } => Some(reason),
                SummarySource::Heuristic | SummarySource::Llm => None,
            };
            fallbacks.push((reason, summary.retry_later));
            extractions.push(Precomputed(summary.extraction));
        }
        let applied = {
            let user = self.applying_user(&jobs[0].id.user).lock();
            // The starved idle task of a run taken over may hold the stripe, mid-apply, for as
            // long as it gets no CPU (seconds on a busy node), and with it every later run of
            // its user: so while the idle threads are starved the catch-up waits a tick at
            // most, then goes on. The commit's version check keeps the two apart; the lock
            // only spares a conflict.
            let brief = applier == Applier::TakenOver
                || (applier.is_catch_up() && self.idle_starved.load(Ordering::Relaxed));
            let _user = if brief {
                tokio::time::timeout(lag::TICK, user).await.ok()
            } else {
                Some(user.await)
            };
            let hold_back = applier.hold_back(self.behind.load(Ordering::Relaxed));
            self.apply_with(jobs, &extractions, hold_back).await?
        };
        // Counted, and refined later, for the jobs this pass recorded only: a run taken over
        // from a starved idle loop is applied by both passes, and the pass that loses finds its
        // jobs applied (a fallback counted per pass read 2 for one turn, with both cores busy).
        for ((job, outcome), (reason, retry_later)) in jobs.iter().zip(&applied).zip(fallbacks) {
            if !matches!(outcome, Applied::Recorded { .. }) {
                continue;
            }
            if let Some(reason) = reason {
                self.stats
                    .summarizer_fallbacks
                    .fetch_add(1, Ordering::Relaxed);
                tracing::info!(job = %job.id.key, reason = reason.as_str(), "summarizer fell back to the heuristic extractor");
            }
            if retry_later {
                self.schedule_refinement(job.clone());
            }
        }
        Ok(applied)
    }

    /// The stripe of [`Worker::applying`] that `user`'s applies take.
    fn applying_user(&self, user: &UserKey) -> &tokio::sync::Mutex<()> {
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        std::hash::Hash::hash(user, &mut hasher);
        let stripe = std::hash::Hasher::finish(&hasher) as usize % self.applying.len();
        &self.applying[stripe]
    }

    /// Asks the summarizer again later and applies its diff to the recorded turn.
    fn schedule_refinement(&self, job: Job) {
        let delay = self.summarizer.background_retry_delay();
        let summarizer = Arc::clone(&self.summarizer);
        let store = Arc::clone(&self.store);
        let cache = Arc::clone(&self.cache);
        let cancel = self.cancel.clone();
        let stats = Arc::clone(&self.stats);
        let budget = self.token_budget.clone();
        self.tasks.spawn(async move {
            tokio::select! {
                () = tokio::time::sleep(delay) => {}
                () = cancel.cancelled() => return,
            }
            if !within_budget(&summarizer, budget.as_deref(), &job) {
                tracing::info!(job = %job.id.key, "tenant's summarizer token budget is spent; the heuristic extraction stands");
                return;
            }
            let exchange = &job.exchange;
            let summary = match summarizer
                .extract_llm(&exchange.user_text, &exchange.assistant_text)
                .await
            {
                Ok(summary) => summary,
                Err(reason) => {
                    tracing::info!(job = %job.id.key, reason = reason.as_str(), "summarizer retry failed; the heuristic extraction stands");
                    return;
                }
            };
            match refine(&*store, &cache, &job.id.user, &exchange.turn_id, &summary.extraction.diff).await {
                Ok(true) => {
                    stats.summarizer_refined.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(job = %job.id.key, "summarizer retry applied");
                }
                Ok(false) => {}
                Err(error) => tracing::warn!(%error, job = %job.id.key, "applying the summarizer retry failed"),
            }
        });
    }

    /// `hold_back`: how the compute's thread holds its yields back (see
    /// [`engram_memory::yielding::hold_back_after_foreign_yields`]); `None` leaves it as is.
    async fn apply_with(
        &self,
        jobs: &[Job],
        extractions: &[Precomputed],
        hold_back: Option<u32>,
    ) -> Result<Vec<Applied>> {
        let Some(first) = jobs.first() else {
            return Ok(Vec::new());
        };
        let user = &first.id.user;
        let session = &first.exchange.session_id;
        if self.cache.get(user).is_none() {
            // The requests' cold load, shared (see `MemoryCache::cold_load`); a memory the
            // cache does not keep (past its budget) is then read below as before.
            let mut loaded = self.cache.cold_load(&self.store, user, &self.tasks);
            let _ = loaded.wait_for(|done| *done).await;
        }
        for _ in 0..CONFLICT_RETRIES {
            let mut cached = self.cache.get(user);
            let record = self
                .store
                .hot_record(user, session, cached.as_ref().map(|m| m.version()))
                .await?;
            if record.update.is_none()
                && cached.as_ref().map(|m| m.version()) != Some(record.version)
            {
                // Cached during the read (see the hot path's same check).
                cached = self.cache.get(user);
            }
            let start = match (record.version, record.update, cached) {
                (0, _, _) => Start::Fresh,
                (_, Some(MemoryUpdate::Whole(state)), _) => Start::Loaded(state),
                (version, None, Some(cached)) if cached.version() == version => {
                    Start::Cached(cached)
                }
                (version, update @ Some(MemoryUpdate::Delta(_)), Some(cached)) => {
                    match CachedMemory::resolve(Some(cached), version, update)? {
                        Some(memory) => {
                            self.cache.put(user, Arc::clone(&memory));
                            Start::Cached(memory)
                        }
                        None => continue,
                    }
                }
                (_, _, _) => match self.store.load_state(user).await? {
                    Some(state) => Start::Loaded(Box::new(state)),
                    None => continue,
                },
            };
            let expected = record.version;
            // Held until the commit has returned. Once the cache holds the new memory it lets
            // go of this one on the store's write thread, which every enqueue, claim and job
            // commit goes through; if that were the last reference, freeing it (what the two
            // versions do not share, and a reference count per chunk of the history: 8 % of
            // that thread's time at 50,000 turns) would run there. Here it runs on the
            // worker's own thread.
            let previous = match &start {
                Start::Cached(memory) => Some(Arc::clone(memory)),
                Start::Fresh | Start::Loaded(_) => None,
            };
            // The engine's work and the encoding are CPU-bound: off the async threads.
            let memory = Arc::clone(&self.memory);
            let inputs: Vec<ExchangeInput> = jobs.iter().map(|job| job.exchange.clone()).collect();
            let extractors = extractions.to_vec();
            // The idle loop's (which leaves the yields as they are) are watched for stalls.
            let computing = hold_back.is_none().then(|| Arc::clone(&self.computing));
            let computed = tokio::task::spawn_blocking(move || {
                if let Some(in_a_row) = hold_back {
                    engram_memory::yielding::hold_back_after_foreign_yields(in_a_row);
                }
                let _in_flight = computing.as_ref().and_then(Computing::enter);
                compute(start, &inputs, &extractors, &memory)
            })
            .await
            .map_err(|error| Error::Internal(format!("worker task failed: {error}")))??;
            let Computed { outcomes, written } = computed;
            let Some((state, prefetched, encoded)) = written else {
                // The state has every exchange; make sure the raw log and the jobs say so too.
                for job in jobs {
                    self.store
                        .append_raw(user, &job.id.key, &job.exchange)
                        .await?;
                    self.store.ack(&job.id).await?;
                }
                return Ok(outcomes);
            };
            // The state goes into the cache as soon as it has committed: on the store's commit
            // thread, told by the store (`CommitListener`), or here once the commit returns.
            let staged = self.cache.stage(user, expected, &encoded, Arc::new(state));
            let committed = self
                .store
                .commit_jobs(jobs, &encoded, expected, &prefetched)
                .await;
            drop(previous);
            match committed {
                Ok(()) => {
                    staged.publish();
                    return Ok(outcomes);
                }
                Err(Error::StoreConflict { .. }) => {
                    self.stats.conflicts.fetch_add(1, Ordering::Relaxed);
                }
                Err(Error::JobGone(job)) => {
                    // Forgotten while it was applied: nothing to write, nothing to retry.
                    tracing::info!(%job, "job dropped: its user was forgotten");
                    return Ok(vec![Applied::Forgotten; jobs.len()]);
                }
                Err(error) => return Err(error),
            }
        }
        Err(Error::Store(format!(
            "memory kept changing: {CONFLICT_RETRIES} version conflicts in a row"
        )))
    }
}

/// Waits until `turn` satisfies `is`; at once without a turn. False when the turn's sender is
/// gone (the worker is stopping).
async fn turn_is(
    turn: &mut Option<watch::Receiver<Claimer>>,
    is: impl Fn(Claimer) -> bool,
) -> bool {
    match turn {
        Some(turn) => turn.wait_for(|claimer| is(*claimer)).await.is_ok(),
        None => true,
    }
}

/// Whether the idle runtime gets the CPU: a task sent there must run within [`lag::PROMPT`].
#[derive(Default)]
struct Probe {
    /// The probe in flight: when it was sent, and where it says when it ran.
    sent: Option<(Instant, oneshot::Receiver<Instant>)>,
    starved: bool,
}

impl Probe {
    /// Reads the probe in flight and sends the next one once it has answered.
    fn starved(&mut self, idle: &tokio::runtime::Handle) -> bool {
        if let Some((sent, mut answer)) = self.sent.take() {
            match answer.try_recv() {
                Ok(ran) => self.starved = ran.saturating_duration_since(sent) > lag::PROMPT,
                Err(oneshot::error::TryRecvError::Empty) => {
                    self.starved |= sent.elapsed() > lag::PROMPT;
                    self.sent = Some((sent, answer));
                }
                // The idle runtime is shutting down.
                Err(oneshot::error::TryRecvError::Closed) => {}
            }
        }
        if self.sent.is_none() {
            let (ran, answer) = oneshot::channel();
            // Not on the task tracker: a starved runtime may never run it, and shutdown must
            // not wait for that.
            drop(idle.spawn(async move {
                let _ = ran.send(Instant::now());
            }));
            self.sent = Some((Instant::now(), answer));
        }
        self.starved
    }
}

/// Splits a claimed batch into runs of one session each, keeping each run's order.
fn runs(claimed: Vec<ClaimedJob>) -> Vec<Vec<ClaimedJob>> {
    let mut runs: Vec<Vec<ClaimedJob>> = Vec::new();
    for job in claimed {
        let same = |run: &Vec<ClaimedJob>| {
            run.first().is_some_and(|head| {
                head.job.id.user == job.job.id.user
                    && head.job.exchange.session_id == job.job.exchange.session_id
            })
        };
        match runs.iter_mut().find(|run| same(run)) {
            Some(run) => run.push(job),
            None => runs.push(vec![job]),
        }
    }
    runs
}

/// Where a job's state comes from.
enum Start {
    /// Nothing stored: a new memory.
    Fresh,
    /// Read whole from the store.
    Loaded(Box<MemoryState>),
    /// The cached memory is current.
    Cached(Arc<CachedMemory>),
}

struct Computed {
    outcomes: Vec<Applied>,
    /// The new memory, the session's prefetched candidates and the encoded state; `None`
    /// when the state already had every exchange.
    written: Option<(CachedMemory, Vec<CandidateId>, EncodedState)>,
}

/// Records the exchanges on the state in order, refreshes the index, prefetches the session's
/// next candidates and encodes the result.
fn compute(
    start: Start,
    exchanges: &[ExchangeInput],
    extractors: &[Precomputed],
    config: &MemoryConfig,
) -> Result<Computed> {
    let (mut state, base) = match start {
        Start::Fresh => {
            let mut state = MemoryState::new();
            state.version = first_version();
            (state, None)
        }
        // Read whole from the store: indexed afresh.
        Start::Loaded(state) => (*state, None),
        // A copy shares the cached memory's items and changes only what the turns touch.
        Start::Cached(cached) => (cached.state.clone(), Some(cached)),
    };
    let mut outcomes = Vec::with_capacity(exchanges.len());
    for (exchange, extractor) in exchanges.iter().zip(extractors) {
        priority::yield_to_requests();
        let outcome = memory::record_exchange(&mut state, exchange, extractor, config);
        outcomes.push(if outcome.duplicate {
            Applied::Duplicate
        } else {
            Applied::Recorded {
                version: state.version,
            }
        });
    }
    if outcomes
        .iter()
        .all(|outcome| *outcome == Applied::Duplicate)
    {
        return Ok(Computed {
            outcomes,
            written: None,
        });
    }
    let session = exchanges
        .first()
        .map(|exchange| exchange.session_id.as_str())
        .unwrap_or_default();
    priority::yield_to_requests();
    let mut memory = CachedMemory::advanced(base.as_deref(), state);
    // The index has seen the turns' changes; the store writes just those items.
    let changes = memory.state.take_changes();
    priority::yield_to_requests();
    let prefetched = memory::prefetch(&memory.state, &memory.index, session, &config.retrieval);
    priority::yield_to_requests();
    let encoded = EncodedState::changes(&memory.state, &changes)?;
    priority::yield_to_requests();
    Ok(Computed {
        outcomes,
        written: Some((memory, prefetched, encoded)),
    })
}

/// Applies a later, better diff to an already recorded turn (found by its turn id). False when
/// the turn is gone (forgotten) or the diff changed nothing.
async fn refine(
    store: &dyn MemoryRecords,
    cache: &MemoryCache,
    user: &UserKey,
    turn_id: &str,
    diff: &memory::FactDiff,
) -> Result<bool> {
    let (refined, _) = edit_memory(store, cache, user, |state| {
        state.sync_lookups();
        let Some(seq) = state.lookups.turn(state, turn_id) else {
            return false;
        };
        let before = state.version;
        memory::apply_diff(state, diff, Some(seq));
        state.version != before
    })
    .await?;
    Ok(refined)
}

/// Applies `change` to the user's latest memory (a new, empty one when nothing is stored) and
/// saves it with the same version check as a job's commit, retrying on a conflict; the saved
/// memory goes into this process's cache. Returns what `change` returned and the memory version
/// after it (0 when nothing is stored). A change that does not bump the version writes nothing.
pub async fn edit_memory<T>(
    store: &dyn MemoryRecords,
    cache: &MemoryCache,
    user: &UserKey,
    change: impl Fn(&mut MemoryState) -> T,
) -> Result<(T, u64)> {
    for _ in 0..CONFLICT_RETRIES {
        // From the cached memory when it is the stored version (a copy shares its items and
        // index), else read whole.
        let cached = cache.get(user);
        let stored = store
            .hot_record(user, "", cached.as_ref().map(|memory| memory.version()))
            .await?;
        let (mut state, expected, base) = if stored.version == 0 {
            let mut state = MemoryState::new();
            state.version = first_version();
            (state, 0, None)
        } else {
            let version = stored.version;
            match CachedMemory::resolve(cached, version, stored.update)? {
                Some(memory) => (memory.state.clone(), version, Some(memory)),
                None => continue,
            }
        };
        let before = state.version;
        let out = change(&mut state);
        if state.version == before {
            return Ok((out, expected));
        }
        let mut memory = CachedMemory::advanced(base.as_deref(), state);
        let changes = memory.state.take_changes();
        let encoded = EncodedState::changes(&memory.state, &changes)?;
        match store.save_encoded_state(user, &encoded, expected).await {
            Ok(()) => {
                let version = memory.version();
                cache.put(user, Arc::new(memory));
                return Ok((out, version));
            }
            Err(Error::StoreConflict { .. }) => continue,
            Err(error) => return Err(error),
        }
    }
    Err(Error::Store(format!(
        "memory kept changing: {CONFLICT_RETRIES} version conflicts in a row"
    )))
}

#[cfg(test)]
mod tests;

fn hostname() -> String {
    std::env::var("HOSTNAME")
        .ok()
        .filter(|name| !name.is_empty())
        .unwrap_or_else(|| "engram".to_owned())
}
