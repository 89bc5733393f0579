//! The update path runs on a runtime of its own whose threads (its async thread and its
//! blocking pool, where the engine work and the worker's store writes run) are scheduled with
//! Linux's `SCHED_IDLE` policy: they get the CPU only when the threads serving requests do not
//! want it. On a busy sidecar the worker then lags a little instead of adding to the clients'
//! latency; on an idle one it runs at full speed. Elsewhere, or if the policy cannot be set,
//! the threads run at normal priority.
//!
//! The embedded store's enqueues (the recorder's durable writes, which the end of each
//! recorded answer waits for) run on a blocking pool of their own whose one thread
//! ([`recorder_pool`], [`RecorderPriority::Answering`]) runs at normal priority without
//! checkpoints: while no client waited for them they gave way at every step, and once the
//! answers waited, those yields only made them wait longer (docs/benchmarks-log.md). Niced to 19,
//! a recorder that yields that often was starved at full load. The embedded store's job
//! commits, and every other write transaction of its after start-up (the worker's claims
//! among them), run on that same thread: they hold redb's one write lock, and on the worker's
//! idle-priority threads the requests could keep them from letting it go while every recorded
//! answer's enqueue waited. Such a pool starts its thread as it is built (see
//! [`recorder_pool`]).
//! The Redis store's encoding of large exchanges, one long call without checkpoints, runs on
//! a thread niced to 19.
//!
//! Neither policy stops a background thread that the scheduler has already picked from keeping
//! the core until the next tick, so the worker also yields between its steps
//! ([`yield_to_requests`]). With those yields the added p99 at 1,000 req/s fell to 0.5–0.6 ms,
//! and at 2,000 req/s to 0.8–1.0 ms (20 s runs of `benches/overhead.sh`). With 100 KB and 1 MB
//! exchanges one step takes milliseconds, so the engine's long loops also pass
//! [`checkpoint`]s, which yield once a background thread has run 100 µs: at 100 KB and
//! 100 req/s the added p99 fell from 3.4–4.6 ms to 0.84 ms (embedded). So do the embedded
//! store's commits, at each write of a round and each page read and write (`YieldingFile`): a
//! waking request thread does not take the core from the recorder, it waits for a yield.
//!
//! A yield cannot choose who gets the core: on a node whose other processes keep every core
//! busy it handed the core to them for a scheduler slice, and a recorded answer's end waited
//! that long behind its commit's yield. So each [`recorder_pool`]'s thread holds its yields
//! back for a while after one went to another process, which the process's CPU clock
//! ([`process_cpu_time`]) tells (see `engram_memory::yielding`). So do the catch-up's, while it
//! is behind (the worker sets that per run): with every yield kept it got a few per cent of
//! such a core and fell behind. The idle worker's threads keep every yield; on such a node the
//! catch-up does their work.

use std::time::Duration;

#[cfg(target_os = "linux")]
use engram_memory::yielding::set_process_clock;
use engram_memory::yielding::{hold_back_after_foreign_yields, mark_background};
use tokio::runtime::{Builder, Runtime};

use crate::error::Result;

// The yield points themselves are the engine's (it calls them in its long loops); the store,
// recorder and worker name them here, beside the threads they apply to.
pub use engram_memory::yielding::{
    checkpoint, checkpoint_step, start_slice, yield_if_background, yield_to_requests,
    yields_held_back_total,
};

/// The worker's runtime. Dropping it (even inside another runtime, where dropping a `Runtime`
/// would panic) lets it wind down in the background.
pub struct WorkerRuntime(Option<Runtime>);

impl WorkerRuntime {
    pub fn handle(&self) -> Option<&tokio::runtime::Handle> {
        self.0.as_ref().map(Runtime::handle)
    }
}

impl Drop for WorkerRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// This process's CPU time, all its threads together; `None` where it cannot be read (the
/// call that fails rather than panics, for a kernel or sandbox that refuses the clock).
pub fn process_cpu_time() -> Option<Duration> {
    #[cfg(target_os = "linux")]
    {
        use rustix::time::{ClockId, DynamicClockId, clock_gettime_dynamic};
        let now = clock_gettime_dynamic(DynamicClockId::Known(ClockId::ProcessCPUTime)).ok()?;
        Some(Duration::new(
            u64::try_from(now.tv_sec).ok()?,
            u32::try_from(now.tv_nsec).ok()?,
        ))
    }
    #[cfg(not(target_os = "linux"))]
    {
        None
    }
}

/// The kernel's id of the calling thread, read once per thread from `/proc/thread-self`; `None`
/// where `/proc` does not tell (not Linux).
pub fn thread_id() -> Option<u32> {
    thread_local! {
        static ID: Option<u32> = std::fs::read_link("/proc/thread-self")
            .ok()
            .and_then(|link| link.file_name()?.to_str()?.parse().ok());
    }
    ID.with(|id| *id)
}

/// How long thread `id` of this process has run on a core: the first field of
/// `/proc/self/task/<id>/schedstat`, in ns. `None` where that cannot be read (not Linux, a
/// kernel without scheduler statistics, or the thread is gone).
pub fn thread_run_time(id: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/self/task/{id}/schedstat")).ok()?;
    let nanos = stat.split_whitespace().next()?.parse().ok()?;
    Some(Duration::from_nanos(nanos))
}

/// Lets the yields of the threads that hold them back tell whether they helped this process
/// (Linux only: elsewhere every yield is made).
fn install_process_clock() {
    #[cfg(target_os = "linux")]
    set_process_clock(process_cpu_time);
}

/// A one-thread runtime for the worker; `idle` asks for the idle scheduling policy.
pub fn worker_runtime(idle: bool) -> Result<WorkerRuntime> {
    let mut builder = Builder::new_multi_thread();
    builder
        .worker_threads(1)
        .thread_name("engram-worker")
        .enable_all();
    if idle {
        builder.on_thread_start(lower_priority);
    }
    Ok(WorkerRuntime(Some(builder.build()?)))
}

/// How many of the catch-up's yields in a row must go to another process before it holds its
/// yields back. At one, on a node with nothing else running, yields that went elsewhere (to
/// the kernel's own threads) set it off about 120 times in a 40 s run at 1,000 req/s, and
/// requests waited behind it: added p50 8.2–9.1 ms against 4.9–5.2.
pub const CATCH_UP_FOREIGN_YIELDS: u32 = 3;

/// The catch-up's runtime (see `worker::lag`): one async thread and one blocking thread at
/// normal priority, so it takes a core at most, both passing [`checkpoint`]s as background
/// threads so a waiting request gets the core within a slice, and holding their yields back
/// for a while after [`CATCH_UP_FOREIGN_YIELDS`] in a row went to another process (the worker
/// turns that off on the computing thread while the catch-up is not behind). Normal priority
/// because an unprivileged thread cannot leave `SCHED_IDLE` once the worker's threads are in
/// it.
pub fn catch_up_runtime() -> Result<WorkerRuntime> {
    install_process_clock();
    let runtime = Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .thread_name("engram-catch-up")
        .on_thread_start(|| {
            mark_background();
            hold_back_after_foreign_yields(CATCH_UP_FOREIGN_YIELDS);
        })
        .enable_all()
        .build()?;
    Ok(WorkerRuntime(Some(runtime)))
}

/// How a [`recorder_pool`]'s thread is scheduled.
#[derive(Clone, Copy)]
pub enum RecorderPriority {
    /// Normal priority, for work that passes a checkpoint at every step (the embedded store's
    /// commits): a lower priority would let a busy core starve it.
    Normal,
    /// The lowest normal priority (nice 19), for long calls without checkpoints (encoding a
    /// large exchange), which would otherwise hold the core for a whole time slice.
    Lowest,
    /// Normal priority without checkpoints, for work requests wait for (the embedded store's
    /// enqueues, which a recorded answer's end waits for): giving way at every step only made
    /// those requests wait longer.
    Answering,
}

/// A runtime used only for its blocking pool: one thread, named `name`, scheduled as
/// `priority` asks where Linux allows it, passing [`checkpoint`]s as a background thread, and
/// holding its yields back for a while after one went to another process.
/// `Handle::spawn_blocking` on it runs there.
///
/// The thread starts here, on the caller's thread, and lives as long as the pool. A new thread
/// takes its creator's policy, and tokio starts a pool's thread in the first `spawn_blocking`
/// that finds none (and again after 10 s without work): when that was the idle worker's
/// thread (the first job commit it led), the embedded store's commit thread ran at
/// `SCHED_IDLE`, which an unprivileged thread cannot leave. On a node whose other processes
/// kept both cores busy, every commit, claim and enqueue then waited seconds for a core
/// (`tests/worker_lag.rs`: commits of 1.4–4 s).
pub fn recorder_pool(name: &str, priority: RecorderPriority) -> Result<WorkerRuntime> {
    install_process_clock();
    let start: fn() = match priority {
        RecorderPriority::Normal => mark_background,
        RecorderPriority::Answering => || {},
        RecorderPriority::Lowest => nice_lowest,
    };
    let runtime = Builder::new_current_thread()
        .thread_name(name)
        .max_blocking_threads(1)
        .thread_keep_alive(POOL_THREAD_LIFETIME)
        .on_thread_start(move || {
            start();
            hold_back_after_foreign_yields(1);
        })
        .build()?;
    // Starts the one thread now, from this thread (its join handle is not needed).
    drop(runtime.spawn_blocking(|| {}));
    Ok(WorkerRuntime(Some(runtime)))
}

/// How long a [`recorder_pool`]'s thread may wait for work before it ends: as long as the
/// process, in effect (a year).
const POOL_THREAD_LIFETIME: Duration = Duration::from_secs(365 * 24 * 3600);

/// A [`RecorderPriority::Lowest`] thread: `SCHED_OTHER` at nice 19. Raising a thread's nice
/// value needs no privilege, and on Linux it applies to the calling thread only.
fn nice_lowest() {
    lowest_in(Policy::Other, "recorder");
    mark_background();
}

/// The worker's threads: `SCHED_IDLE`.
fn lower_priority() {
    lowest_in(Policy::Idle, "worker");
    mark_background();
}

/// The normal scheduling policies this module uses.
enum Policy {
    Other,
    Idle,
}

/// Puts the calling thread in `policy` at its lowest priority; on failure (or off Linux) the
/// thread keeps running at normal priority.
#[cfg(target_os = "linux")]
fn lowest_in(policy: Policy, thread: &str) {
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
        thread_native_id,
    };
    let policy = ThreadSchedulePolicy::Normal(match policy {
        Policy::Other => NormalThreadSchedulePolicy::Other,
        Policy::Idle => NormalThreadSchedulePolicy::Idle,
    });
    if let Err(error) = set_thread_priority_and_policy(
        thread_native_id(),
        thread_priority::ThreadPriority::Min,
        policy,
    ) {
        tracing::debug!(?error, thread, "could not lower the thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn lowest_in(_policy: Policy, _thread: &str) {}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    /// Field `n` of the calling thread's stat line, numbered as in proc(5).
    fn own_stat_field(n: usize) -> i64 {
        let stat = std::fs::read_to_string("/proc/thread-self/stat").unwrap();
        // The fields after the command's closing parenthesis start at field 3.
        let after = stat.rsplit_once(')').unwrap().1;
        after
            .split_whitespace()
            .nth(n - 3)
            .unwrap()
            .parse()
            .unwrap()
    }

    const POLICY: usize = 41;
    const NICE: usize = 19;
    const SCHED_IDLE: i64 = 5;

    #[test]
    fn the_process_clock_counts_every_threads_cpu() {
        let before = process_cpu_time().unwrap();
        // Another thread spins until the clock has counted 20 ms, or gives up after 5 s.
        let counted = std::thread::spawn(move || {
            let started = std::time::Instant::now();
            let mut spent = Duration::ZERO;
            while spent < Duration::from_millis(20) && started.elapsed() < Duration::from_secs(5) {
                spent = process_cpu_time().unwrap().saturating_sub(before);
            }
            spent
        })
        .join()
        .unwrap();
        assert!(counted >= Duration::from_millis(20), "{counted:?}");
    }

    #[test]
    fn the_worker_runs_at_idle_policy_and_recorders_as_asked() {
        let worker = worker_runtime(true).unwrap();
        let worker = worker.handle().unwrap();
        let async_thread = worker.block_on(worker.spawn(async { own_stat_field(POLICY) }));
        let blocking_thread = worker.block_on(worker.spawn_blocking(|| own_stat_field(POLICY)));
        assert_eq!(async_thread.unwrap(), SCHED_IDLE);
        assert_eq!(blocking_thread.unwrap(), SCHED_IDLE);
        let checkpoints_on = |handle: &tokio::runtime::Handle| {
            handle
                .block_on(handle.spawn_blocking(engram_memory::yielding::is_background))
                .unwrap()
        };
        assert!(checkpoints_on(worker));
        let holds_back = |handle: &tokio::runtime::Handle| {
            handle
                .block_on(
                    handle.spawn_blocking(engram_memory::yielding::holds_back_after_foreign_yields),
                )
                .unwrap()
        };
        // The idle worker keeps every yield (requests first while it computes); the recorders
        // hold theirs back after one went to another process, the catch-up after three.
        assert!(!holds_back(worker));

        let recorder = recorder_pool("test-recorder", RecorderPriority::Normal).unwrap();
        let recorder = recorder.handle().unwrap();
        let scheduling = recorder
            .block_on(recorder.spawn_blocking(|| (own_stat_field(POLICY), own_stat_field(NICE))));
        // Not lowered: as the thread that started it (nice 0 unless the tests run niced).
        assert_eq!(scheduling.unwrap(), (0, own_stat_field(NICE)));
        assert!(checkpoints_on(recorder));
        assert!(holds_back(recorder));
        let encoder = recorder_pool("test-encoder", RecorderPriority::Lowest).unwrap();
        let encoder = encoder.handle().unwrap();
        let nice = encoder.block_on(encoder.spawn_blocking(|| own_stat_field(NICE)));
        assert_eq!(nice.unwrap(), 19);
        assert!(checkpoints_on(encoder));
        // A pool first used from an idle-policy thread (the idle worker leading a commit) still
        // runs at the policy it was built with: its thread started with it, on this thread.
        let pool = recorder_pool("test-first-use", RecorderPriority::Answering).unwrap();
        let pool = pool.handle().unwrap().clone();
        let first_use = std::thread::spawn(move || {
            lowest_in(Policy::Idle, "test");
            assert_eq!(own_stat_field(POLICY), SCHED_IDLE);
            pool.block_on(pool.spawn_blocking(|| own_stat_field(POLICY)))
        });
        assert_eq!(first_use.join().unwrap().unwrap(), 0);
        let answering = recorder_pool("test-answering", RecorderPriority::Answering).unwrap();
        assert!(holds_back(answering.handle().unwrap()));
        // The catch-up too, on its async thread and its blocking one.
        let catch_up = catch_up_runtime().unwrap();
        let catch_up = catch_up.handle().unwrap();
        assert!(holds_back(catch_up));
        let on_async_thread = catch_up.block_on(
            catch_up.spawn(async { engram_memory::yielding::holds_back_after_foreign_yields() }),
        );
        assert!(on_async_thread.unwrap());
        // And a worker runtime asked for normal priority stays there.
        let normal = worker_runtime(false).unwrap();
        let normal = normal.handle().unwrap();
        let policy = normal.block_on(normal.spawn(async { own_stat_field(POLICY) }));
        assert_eq!(policy.unwrap(), 0);
        assert!(!checkpoints_on(normal));
    }
}
