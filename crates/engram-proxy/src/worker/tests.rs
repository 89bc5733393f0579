//! The claim loops against a real embedded store: how a backlog is split into runs, and how the
//! catch-up takes over from a starved idle loop.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use engram_memory::{ExchangeInput, MemoryConfig};
use engram_store::{CommitListener, EmbeddedStore, Job, JobId, JobQueue, Store, UserKey};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::summaries::RunSummaries;
use super::{Applier, Claimer, Worker, WorkerConfig};
use crate::cache::MemoryCache;
use crate::ratelimit::{RateLimitConfig, RateLimitMetrics, TokenBudget};
use crate::summarizer::{Summarizer, SummarizerConfig};
use engram_runtime::priority;

pub(super) fn job(user: &str, turn: usize) -> Job {
    Job {
        id: JobId {
            user: UserKey::new("t", user),
            key: format!("{user}-{turn:08}"),
        },
        exchange: ExchangeInput {
            session_id: "s".to_owned(),
            turn_id: format!("{user}-turn-{turn}"),
            user_text: format!("My locker number at the gym is {turn}, please remember it."),
            assistant_text: "Noted, I will remember your locker number.".to_owned(),
            event_time: None,
            prior_chain: None,
            incomplete: false,
            arrival: None,
        },
        trace: None,
    }
}

/// An embedded store in a temporary directory (kept while the first value lives) that tells
/// the cache of its commits, with `turns` jobs queued for each of `users` (one session each),
/// and that cache.
async fn queued_store(
    users: &[&str],
    turns: usize,
) -> (tempfile::TempDir, Arc<MemoryCache>, Arc<dyn Store>) {
    let (dir, cache, store) = queued_embedded(users, turns).await;
    (dir, cache, store)
}

/// [`queued_store`], the store as itself (for its fault injection).
async fn queued_embedded(
    users: &[&str],
    turns: usize,
) -> (tempfile::TempDir, Arc<MemoryCache>, Arc<EmbeddedStore>) {
    let dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(MemoryCache::new(16, usize::MAX));
    let store = Arc::new(
        EmbeddedStore::open(dir.path())
            .unwrap()
            .with_commit_listener(Arc::clone(&cache) as Arc<dyn CommitListener>),
    );
    for turn in 0..turns {
        for user in users {
            store.enqueue(&job(user, turn)).await.unwrap();
        }
    }
    (dir, cache, store)
}

/// A worker over `store` with the default memory settings, not started, with the tracker of
/// its tasks and the token that stops them.
fn worker(
    store: &Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    config: WorkerConfig,
    summarizer: Summarizer,
) -> (Arc<Worker>, TaskTracker, CancellationToken) {
    let (tasks, cancel) = (TaskTracker::new(), CancellationToken::new());
    let worker = Arc::new(Worker::new(
        Arc::clone(store),
        cache,
        Arc::new(MemoryConfig::default()),
        config,
        Arc::new(summarizer),
        Arc::new(Notify::new()),
        tasks.clone(),
        cancel.clone(),
    ));
    (worker, tasks, cancel)
}

/// Queues `turns` jobs for each of `users` (one session each), then starts a worker with
/// `config` and the heuristic extractor and waits until it has applied them all. Returns the
/// jobs applied and the runs.
async fn apply_backlog(config: WorkerConfig, users: &[&str], turns: usize) -> (u64, u64) {
    apply_backlog_with(config, Summarizer::heuristic(), users, turns).await
}

async fn apply_backlog_with(
    config: WorkerConfig,
    summarizer: Summarizer,
    users: &[&str],
    turns: usize,
) -> (u64, u64) {
    let (_dir, cache, store) = queued_store(users, turns).await;
    let (worker, tasks, cancel) = worker(&store, cache, config, summarizer);
    worker.start(&tokio::runtime::Handle::current(), None);
    let total = (users.len() * turns) as u64;
    let deadline = Instant::now() + Duration::from_secs(60);
    while worker.stats().applied.load(Ordering::Relaxed) < total {
        assert!(
            Instant::now() < deadline,
            "the backlog was not applied in time"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    assert_eq!(store.queue_depth().await.unwrap(), 0);
    let stats = worker.stats();
    assert_eq!(stats.duplicates.load(Ordering::Relaxed), 0);
    assert_eq!(stats.conflicts.load(Ordering::Relaxed), 0);
    (
        stats.applied.load(Ordering::Relaxed),
        stats.runs.load(Ordering::Relaxed),
    )
}

/// Room for two runs at once, claims of up to `run_jobs` jobs, and a quick poll.
fn two_runs_at_once(run_jobs: usize) -> WorkerConfig {
    WorkerConfig {
        concurrency: 2,
        run_jobs,
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sessions_backlog_is_applied_in_runs_of_run_jobs_not_of_concurrency() {
    let config = two_runs_at_once(40);
    // 40 + 40 + 20: the run length is the claim's, not the number of runs at once.
    assert_eq!(apply_backlog(config, &["solo"], 100).await, (100, 3));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn many_sessions_are_claimed_as_room_frees_each_in_one_run() {
    let config = two_runs_at_once(64);
    let users = ["a", "b", "c", "d", "e", "f", "g", "h", "i", "j"];
    // A claim takes the jobs of as many sessions as there is room for (two at first, then one
    // as each run ends), and each session's five jobs go in one run.
    assert_eq!(apply_backlog(config, &users, 5).await, (50, 10));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_an_llm_summarizer_a_claim_takes_only_what_can_start_at_once() {
    let config = two_runs_at_once(40);
    let summarizer = unreachable_summarizer();
    // A run's model calls go one after another, so runs stay as short as the room: at most 2
    // jobs each, so at least 10 runs for 20 jobs (the heuristic alone took them in one).
    let (applied, runs) = apply_backlog_with(config, summarizer, &["solo"], 20).await;
    assert_eq!(applied, 20);
    assert!(runs >= 10, "{runs} runs for 20 jobs");
}

/// A model summarizer nothing listens for: every call fails at once and the heuristic
/// extraction stands (its retry waits past a test's end).
fn unreachable_summarizer() -> Summarizer {
    let summarizer = Summarizer::new(
        &SummarizerConfig {
            base_url: Some("http://127.0.0.1:1/v1".to_owned()),
            timeout_ms: 500,
            background_retry_delay_ms: 600_000,
            ..SummarizerConfig::default()
        },
        None,
    )
    .unwrap();
    assert!(summarizer.is_configured());
    summarizer
}

/// The idle loop claimed a run and then got no CPU (its one thread is blocked here, as the busy
/// cores of a shared node keep an idle-policy thread off them): the catch-up takes the run over
/// and applies it, then the session's next job, which waited behind it. Without the take-over
/// the run's lease (a minute here) holds the session and nothing is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catch_up_takes_over_a_run_the_starved_idle_loop_holds() {
    assert_eq!(starved_idle_loop_holding_a_run(false).await, (2, 1));
}

/// The same, with the starved idle task mid-apply: it holds its user's stripe of the apply
/// lock, as long as it gets no CPU. The catch-up applies the taken-over run and the session's
/// next job anyway; while its own runs waited for that lock, one user's jobs sat for seconds
/// behind the starved task (`./benches/history.sh --busy-cores`, 2026-12-05).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_starved_idle_task_holding_its_users_lock_does_not_hold_up_the_catch_up() {
    assert_eq!(starved_idle_loop_holding_a_run(true).await, (2, 1));
}

/// Two jobs of one session: the idle loop claims the first, then its one thread is blocked
/// (holding the user's apply lock when `mid_apply`). Returns the jobs applied within 10 s and
/// the runs taken over.
async fn starved_idle_loop_holding_a_run(mid_apply: bool) -> (u64, u64) {
    let (_dir, cache, store) = queued_store(&["solo"], 2).await;
    let config = WorkerConfig {
        max_lag_ms: 400,
        lease_ms: 60_000,
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    };
    let lease = Duration::from_millis(config.lease_ms);
    let (worker, tasks, cancel) = worker(&store, cache, config, Summarizer::heuristic());
    // What the idle loop does before the cores are taken: it claims the session's head.
    let claimed = store
        .claim_runs(&worker.consumer, lease, 1, 1)
        .await
        .unwrap();
    assert_eq!(claimed.len(), 1);
    let summaries = Arc::new(RunSummaries::new(&claimed));
    worker.held.hold(&claimed, &summaries, Instant::now());
    let stripe = mid_apply.then(|| worker.applying_user(&UserKey::new("t", "solo")));
    let held_lock = match stripe {
        Some(stripe) => Some(stripe.lock().await),
        None => None,
    };
    let (idle, release) = starved_idle_runtime().await;
    let catch_up = priority::catch_up_runtime().unwrap();
    worker.start(idle.handle().unwrap(), catch_up.handle());

    let deadline = Instant::now() + Duration::from_secs(10);
    while worker.stats().applied.load(Ordering::Relaxed) < 2 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let stats = worker.stats();
    let (applied, taken_over) = (
        stats.applied.load(Ordering::Relaxed),
        stats.taken_over.load(Ordering::Relaxed),
    );
    drop(held_lock);
    release.send(()).unwrap();
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    if applied == 2 {
        assert_eq!(store.queue_depth().await.unwrap(), 0);
    }
    (applied, taken_over)
}

/// The idle loop's runtime, its one thread kept busy until `release` is sent to or dropped, as
/// the busy cores of a shared node keep an idle-policy thread off them.
async fn starved_idle_runtime() -> (priority::WorkerRuntime, std::sync::mpsc::Sender<()>) {
    let idle = priority::worker_runtime(false).unwrap();
    let (release, blocked) = std::sync::mpsc::channel::<()>();
    let (started, running) = tokio::sync::oneshot::channel();
    drop(idle.handle().unwrap().spawn(async move {
        let _ = started.send(());
        let _ = blocked.recv();
    }));
    running.await.unwrap();
    (idle, release)
}

/// Caught up on a starved node, the catch-up lets jobs gather between claims: one user's turns
/// arriving every 10 ms are applied in runs of several, not in a claim and a commit each
/// (which, on a busy core, kept the store's write lock from the answers' enqueues).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_catch_up_caught_up_lets_jobs_gather_between_claims() {
    const TURNS: u64 = 100;
    let (_dir, cache, store) = queued_store(&["solo"], 0).await;
    let config = WorkerConfig {
        max_lag_ms: 400,
        poll_interval_ms: 5,
        ..WorkerConfig::default()
    };
    let gather = Duration::from_millis(config.max_lag_ms / 10);
    let (worker, tasks, cancel) = worker(&store, cache, config, Summarizer::heuristic());
    let (idle, release) = starved_idle_runtime().await;
    let catch_up = priority::catch_up_runtime().unwrap();
    worker.start(idle.handle().unwrap(), catch_up.handle());

    let started = Instant::now();
    for turn in 0..TURNS {
        store.enqueue(&job("solo", turn as usize)).await.unwrap();
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    while worker.stats().applied.load(Ordering::Relaxed) < TURNS && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let elapsed = started.elapsed();
    let stats = worker.stats();
    let (applied, by_catch_up, runs) = (
        stats.applied.load(Ordering::Relaxed),
        stats.catch_up_applied.load(Ordering::Relaxed),
        stats.runs.load(Ordering::Relaxed),
    );
    release.send(()).unwrap();
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    assert_eq!((applied, by_catch_up), (TURNS, TURNS));
    // A partial claim is followed by the next one a gathering interval later at the soonest.
    let bound = elapsed.as_millis() / gather.as_millis() + 2;
    assert!(u128::from(runs) <= bound, "{runs} runs in {elapsed:?}");
}

/// A run taken over mid-way is applied by both loops at once: one commit lands, the other
/// conflicts and its retry finds the jobs recorded, so each job is applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_applied_by_both_loops_at_once_is_recorded_once() {
    let (_dir, store, worker) = applied_by_both_loops(Summarizer::heuristic()).await;
    let stats = worker.stats();
    assert_eq!(stats.applied.load(Ordering::Relaxed), 3);
    assert_eq!(stats.duplicates.load(Ordering::Relaxed), 3);
    assert_eq!(store.queue_depth().await.unwrap(), 0);
    let user = UserKey::new("t", "solo");
    let state = store.load_state(&user).await.unwrap().unwrap();
    assert_eq!(state.turn_log.len(), 3, "each turn once");
}

/// The summarizer's fallbacks of a run applied by both loops at once are counted once per
/// turn, by the pass that recorded it: counted per pass, a turn read 2 (with both cores busy,
/// `memory_pipeline::a_summarizer_timeout_…`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_applied_by_both_loops_counts_each_fallback_once() {
    let (_dir, _store, worker) = applied_by_both_loops(unreachable_summarizer()).await;
    let stats = worker.stats();
    assert_eq!(stats.applied.load(Ordering::Relaxed), 3);
    assert_eq!(stats.summarizer_fallbacks.load(Ordering::Relaxed), 3);
}

/// Both passes over a taken-over run take one summary per job: a tenant whose summarizer
/// tokens are spent is refused once per turn, not once per pass (with both cores busy,
/// `rate_limits::a_spent_summarizer_token_budget_…` read 2 for one turn); so too when the
/// summaries are made on the catch-up's runtime.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_applied_by_both_loops_asks_the_summarizer_once_per_job() {
    for model_runtime in [false, true] {
        let (refused, budget) = spent_token_budget();
        let (_dir, _store, worker) =
            applied_by_both_loops_with(unreachable_summarizer(), Some(budget), model_runtime).await;
        let stats = worker.stats();
        assert_eq!(stats.applied.load(Ordering::Relaxed), 3);
        assert_eq!(refused.get(), 3, "model runtime: {model_runtime}");
    }
}

/// A run whose commit fails on a store error is applied again without asking the summarizer
/// again: each retry did, so a store hiccup cost a turn another model call and more tokens.
#[tokio::test]
async fn a_run_applied_again_after_a_store_error_is_summarized_once() {
    let (_dir, cache, embedded) = queued_embedded(&["solo"], 2).await;
    let store: Arc<dyn Store> = Arc::clone(&embedded) as Arc<dyn Store>;
    let (refused, budget) = spent_token_budget();
    let (worker, _, _) = worker(
        &store,
        cache,
        WorkerConfig::default(),
        unreachable_summarizer(),
    );
    let worker = with_budget(worker, Some(budget));
    let run = store
        .claim_runs(&worker.consumer, Duration::from_secs(60), 2, 1)
        .await
        .unwrap();
    assert_eq!(run.len(), 2);
    // The run's commit fails once; the first retry commits it.
    embedded.fail_next_enqueue_commits(1);
    let summaries = RunSummaries::new(&run);
    worker
        .process(run, &summaries, Applier::Claimed(Claimer::Idle))
        .await;
    let stats = worker.stats();
    assert_eq!(stats.applied.load(Ordering::Relaxed), 2);
    assert_eq!(stats.errors.load(Ordering::Relaxed), 0);
    assert_eq!(refused.get(), 2, "one refusal per turn");
}

/// `worker` (not started, so held only here) charging its summarizer calls to `budget`.
fn with_budget(worker: Arc<Worker>, budget: Option<Arc<TokenBudget>>) -> Arc<Worker> {
    Arc::new(Arc::into_inner(worker).unwrap().with_token_budget(budget))
}

/// A token budget no job fits (one token a minute), and the counter of its refusals.
fn spent_token_budget() -> (prometheus::IntCounter, Arc<TokenBudget>) {
    let config = RateLimitConfig {
        tenant_summarizer_tokens_per_minute: 1,
        ..RateLimitConfig::default()
    };
    let refused = prometheus::IntCounter::new("refused", "summarizer calls refused").unwrap();
    let requests = prometheus::IntCounter::new("requests", "requests refused").unwrap();
    let metrics = RateLimitMetrics::new([requests, refused.clone()]);
    let budget = TokenBudget::from_config(&config)
        .unwrap()
        .with_metrics(metrics);
    (refused, Arc::new(budget))
}

/// Three queued jobs of one session claimed as one run, which a worker with `summarizer` (not
/// started) then applies on both loops' behalf at once; the store (kept while the first value
/// lives) and the worker.
async fn applied_by_both_loops(
    summarizer: Summarizer,
) -> (tempfile::TempDir, Arc<dyn Store>, Arc<Worker>) {
    applied_by_both_loops_with(summarizer, None, false).await
}

/// With `model_runtime`, the worker makes model summaries on this test's runtime, as on the
/// catch-up's when started with one.
async fn applied_by_both_loops_with(
    summarizer: Summarizer,
    budget: Option<Arc<TokenBudget>>,
    model_runtime: bool,
) -> (tempfile::TempDir, Arc<dyn Store>, Arc<Worker>) {
    let (dir, cache, store) = queued_store(&["solo"], 3).await;
    let (worker, _, _) = worker(&store, cache, WorkerConfig::default(), summarizer);
    let worker = with_budget(worker, budget);
    if model_runtime {
        worker
            .model_runtime
            .set(tokio::runtime::Handle::current())
            .unwrap();
    }
    let lease = Duration::from_secs(60);
    let run = store
        .claim_runs(&worker.consumer, lease, 3, 1)
        .await
        .unwrap();
    assert_eq!(run.len(), 3);
    // As the idle task holds it: the take-over shares its summaries.
    let summaries = RunSummaries::new(&run);
    tokio::join!(
        worker.process(run.clone(), &summaries, Applier::Claimed(Claimer::Idle)),
        worker.process(run, &summaries, Applier::TakenOver),
    );
    (dir, store, worker)
}

/// The monitor counts the idle threads as starved when a run they compute gets no CPU, though
/// the idle runtime answers every probe at once: here the computing thread sleeps, which is
/// to the monitor what waiting behind busy cores is (`super::stall`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_computation_that_gets_no_cpu_starves_the_idle_threads_though_probes_answer() {
    let (_dir, cache, store) = queued_store(&["solo"], 0).await;
    let config = WorkerConfig {
        max_lag_ms: 400,
        ..WorkerConfig::default()
    };
    let (worker, tasks, cancel) = worker(&store, cache, config, Summarizer::heuristic());
    // Normal priority: its probes run at once.
    let idle = priority::worker_runtime(false).unwrap();
    let catch_up = priority::catch_up_runtime().unwrap();
    worker.start(idle.handle().unwrap(), catch_up.handle());

    let computing = Arc::clone(&worker.computing);
    let (done, finished) = std::sync::mpsc::channel::<()>();
    let stalled_thread = std::thread::spawn(move || {
        let _in_flight = computing.enter();
        // Up to 3 s, or until the test has seen what it waits for.
        let _ = finished.recv_timeout(Duration::from_secs(3));
    });
    let deadline = Instant::now() + Duration::from_secs(3);
    while !worker.idle_starved.load(Ordering::Relaxed) && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let starved = worker.idle_starved.load(Ordering::Relaxed);
    let _ = done.send(());
    stalled_thread.join().unwrap();
    cancel.cancel();
    tasks.close();
    tasks.wait().await;
    assert!(starved, "a computing thread that never ran was not seen");
}

#[test]
fn only_the_catch_up_holds_its_yields_back_and_only_while_behind() {
    use super::{Applier, Claimer};
    let catch_up = [Applier::Claimed(Claimer::CatchUp), Applier::TakenOver];
    for applier in catch_up {
        assert_eq!(
            applier.hold_back(true),
            Some(priority::CATCH_UP_FOREIGN_YIELDS)
        );
        assert_eq!(applier.hold_back(false), Some(0));
    }
    for behind in [true, false] {
        assert_eq!(Applier::Claimed(Claimer::Idle).hold_back(behind), None);
    }
}

/// Tells the cache of each commit after noting who else holds the user's cached memory, the
/// one the commit replaces.
struct HoldersOfTheReplaced {
    cache: Arc<MemoryCache>,
    holders: std::sync::Mutex<Vec<usize>>,
}

impl CommitListener for HoldersOfTheReplaced {
    fn committed(&self, user: &UserKey, expected_version: u64, state: &engram_store::EncodedState) {
        if let Some(replaced) = self.cache.get(user) {
            // Besides the one just taken.
            let others = Arc::strong_count(&replaced) - 1;
            drop(replaced);
            self.holders.lock().unwrap().push(others);
        }
        self.cache.committed(user, expected_version, state);
    }
}

/// The memory a run starts from is freed on the worker's thread, not on the store's write
/// thread that tells the cache of the commit (and that every recorded answer waits behind):
/// while the cache lets go of it there, the worker still holds it.
#[tokio::test]
async fn the_replaced_memory_is_not_freed_on_the_write_thread() {
    let dir = tempfile::tempdir().unwrap();
    let cache = Arc::new(MemoryCache::new(16, usize::MAX));
    let listener = Arc::new(HoldersOfTheReplaced {
        cache: Arc::clone(&cache),
        holders: std::sync::Mutex::new(Vec::new()),
    });
    let store: Arc<dyn Store> = Arc::new(
        EmbeddedStore::open(dir.path())
            .unwrap()
            .with_commit_listener(Arc::clone(&listener) as Arc<dyn CommitListener>),
    );
    let (worker, _, _) = worker(
        &store,
        cache,
        WorkerConfig::default(),
        Summarizer::heuristic(),
    );
    for turn in 0..3 {
        store.enqueue(&job("solo", turn)).await.unwrap();
        let run = store
            .claim_runs(&worker.consumer, Duration::from_secs(60), 1, 1)
            .await
            .unwrap();
        let summaries = RunSummaries::new(&run);
        worker
            .process(run, &summaries, Applier::Claimed(Claimer::Idle))
            .await;
    }
    assert_eq!(worker.stats().applied.load(Ordering::Relaxed), 3);
    // The first commit replaced nothing; the cache and the worker held the others'.
    let holders = listener.holders.lock().unwrap().clone();
    assert_eq!(holders.len(), 2, "{holders:?}");
    assert!(holders.iter().all(|held| *held >= 2), "{holders:?}");
}
