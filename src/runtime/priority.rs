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
//! a recorder that yields that often was starved at full load. The Redis store's encoding of
//! large exchanges, one long call without checkpoints, runs on a thread niced to 19.
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

use std::cell::Cell;
use std::time::{Duration, Instant};

use tokio::runtime::{Builder, Runtime};

use crate::error::Result;

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

/// The catch-up's runtime (see [`super::lag`]): one async thread and one blocking thread at
/// normal priority, so it takes a core at most, both passing [`checkpoint`]s as background
/// threads so a waiting request gets the core within a slice. Normal priority because an
/// unprivileged thread cannot leave `SCHED_IDLE` once the worker's threads are in it.
pub fn catch_up_runtime() -> Result<WorkerRuntime> {
    let runtime = Builder::new_multi_thread()
        .worker_threads(1)
        .max_blocking_threads(1)
        .thread_name("engram-catch-up")
        .on_thread_start(mark_background)
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
/// `priority` asks where Linux allows it, and passing [`checkpoint`]s as a background thread.
/// `Handle::spawn_blocking` on it runs there.
pub fn recorder_pool(name: &str, priority: RecorderPriority) -> Result<WorkerRuntime> {
    let start: fn() = match priority {
        RecorderPriority::Normal => mark_background,
        RecorderPriority::Answering => || {},
        RecorderPriority::Lowest => nice_lowest,
    };
    let runtime = Builder::new_current_thread()
        .thread_name(name)
        .max_blocking_threads(1)
        .on_thread_start(start)
        .build()?;
    Ok(WorkerRuntime(Some(runtime)))
}

/// Offers the core to a runnable request thread before the next step of background work.
///
/// A low policy alone does not keep a background thread from delaying requests. In a 3 s
/// `perf sched` trace at 1,000 req/s with memory on, 53 of the request runtime's 120 waits over
/// 0.3 ms were spent while the idle worker or the niced recorder ran on, until it blocked or
/// the next tick (1 ms at `HZ=1000`) took the core back; the rest followed other threads of the
/// request runtime. Under Linux's EEVDF scheduler a thread that wakes having had more than its
/// share is not yet eligible, which is the likely reason. The worker runs its steps (each
/// engine pass, the index refresh, the prefetch, the encoding, each commit) between yields; a
/// yield with nobody waiting returns at once. With them, the same trace showed no wait over
/// 0.3 ms.
pub fn yield_to_requests() {
    std::thread::yield_now();
    SLICE.with(|slice| {
        if let Some(mut current) = slice.get() {
            current.since = Instant::now();
            slice.set(Some(current));
        }
    });
}

/// [`yield_to_requests`] on a worker or recorder thread; on any other thread, nothing.
pub fn yield_if_background() {
    if SLICE.with(Cell::get).is_some() {
        yield_to_requests();
    }
}

/// How long a background thread runs before a [`checkpoint`] yields. Some steps are long: with
/// 100 KB or 1 MB exchanges one engine pass counts the tokens of 16 KiB excerpts in two
/// encodings and runs the extractor over every sentence, which takes milliseconds.
const BACKGROUND_SLICE: Duration = Duration::from_micros(100);

/// Checkpoints between two looks at the clock: reading it costs about as much as counting a
/// short piece of text, so most checkpoints only count down.
const CHECKPOINTS_PER_CLOCK_READ: u32 = 32;

#[derive(Clone, Copy)]
struct Slice {
    /// Checkpoints left before the next look at the clock.
    countdown: u32,
    /// When this thread last yielded.
    since: Instant,
}

thread_local! {
    /// `Some` on the worker's and the recorder's threads (set as they start); on every other
    /// thread (the request threads among them) a checkpoint does nothing.
    static SLICE: Cell<Option<Slice>> = const { Cell::new(None) };
}

/// A point inside a long loop of background work where it may give way: on a worker or
/// recorder thread that has run [`BACKGROUND_SLICE`] since it last yielded, yields to a waiting
/// request thread; elsewhere, or sooner, returns at once. The engine's long loops (token
/// counting, the extractor's sentences, relating items to a new turn) call it, so a request
/// waits for a slice at most, not for a whole step.
pub fn checkpoint() {
    SLICE.with(|slice| {
        let Some(mut current) = slice.get() else {
            return;
        };
        if current.countdown > 0 {
            current.countdown -= 1;
        } else {
            current.countdown = CHECKPOINTS_PER_CLOCK_READ;
            yield_once_the_slice_is_over(&mut current);
        }
        slice.set(Some(current));
    });
}

/// [`checkpoint`] between steps of microseconds or more (a page read or write, one write of a
/// group commit), where counting down would let dozens pass between looks at the clock: it
/// looks every time. In a `perf` trace at 2,000 req/s with memory on, a recorder round ran
/// 1–1.7 ms of writes and page reads (30–40 misses of redb's cache, served by the kernel's)
/// before its first look, while request threads waited.
pub fn checkpoint_step() {
    SLICE.with(|slice| {
        let Some(mut current) = slice.get() else {
            return;
        };
        yield_once_the_slice_is_over(&mut current);
        slice.set(Some(current));
    });
}

fn yield_once_the_slice_is_over(current: &mut Slice) {
    if current.since.elapsed() >= BACKGROUND_SLICE {
        std::thread::yield_now();
        current.since = Instant::now();
    }
}

/// Makes [`checkpoint`] yield on the calling thread.
fn mark_background() {
    start_slice(Instant::now());
}

/// Starts the calling thread's slice at `since`, marking it a background thread.
pub(crate) fn start_slice(since: Instant) {
    SLICE.with(|slice| {
        slice.set(Some(Slice {
            countdown: CHECKPOINTS_PER_CLOCK_READ,
            since,
        }));
    });
}

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

/// When the calling background thread last yielded.
#[cfg(test)]
#[allow(clippy::unwrap_used, reason = "tests")]
pub(crate) fn last_yield() -> Instant {
    SLICE.with(Cell::get).unwrap().since
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
    fn the_worker_runs_at_idle_policy_and_recorders_as_asked() {
        let worker = worker_runtime(true).unwrap();
        let worker = worker.handle().unwrap();
        let async_thread = worker.block_on(worker.spawn(async { own_stat_field(POLICY) }));
        let blocking_thread = worker.block_on(worker.spawn_blocking(|| own_stat_field(POLICY)));
        assert_eq!(async_thread.unwrap(), SCHED_IDLE);
        assert_eq!(blocking_thread.unwrap(), SCHED_IDLE);
        let checkpoints_on = |handle: &tokio::runtime::Handle| {
            handle
                .block_on(handle.spawn_blocking(|| SLICE.with(Cell::get).is_some()))
                .unwrap()
        };
        assert!(checkpoints_on(worker));

        let recorder = recorder_pool("test-recorder", RecorderPriority::Normal).unwrap();
        let recorder = recorder.handle().unwrap();
        let scheduling = recorder
            .block_on(recorder.spawn_blocking(|| (own_stat_field(POLICY), own_stat_field(NICE))));
        // Not lowered: as the thread that started it (nice 0 unless the tests run niced).
        assert_eq!(scheduling.unwrap(), (0, own_stat_field(NICE)));
        assert!(checkpoints_on(recorder));
        let encoder = recorder_pool("test-encoder", RecorderPriority::Lowest).unwrap();
        let encoder = encoder.handle().unwrap();
        let nice = encoder.block_on(encoder.spawn_blocking(|| own_stat_field(NICE)));
        assert_eq!(nice.unwrap(), 19);
        assert!(checkpoints_on(encoder));
        // And a worker runtime asked for normal priority stays there.
        let normal = worker_runtime(false).unwrap();
        let normal = normal.handle().unwrap();
        let policy = normal.block_on(normal.spawn(async { own_stat_field(POLICY) }));
        assert_eq!(policy.unwrap(), 0);
        assert!(!checkpoints_on(normal));
    }

    #[test]
    fn checkpoints_yield_on_background_threads_once_a_slice_has_passed() {
        // A thread that was never marked (a request thread) keeps no slice.
        checkpoint();
        assert!(SLICE.with(Cell::get).is_none());

        std::thread::spawn(|| {
            mark_background();
            let a_slice_ago = Instant::now().checked_sub(2 * BACKGROUND_SLICE).unwrap();
            start_slice(a_slice_ago);
            // The clock is read once per CHECKPOINTS_PER_CLOCK_READ + 1 checkpoints.
            for _ in 0..CHECKPOINTS_PER_CLOCK_READ {
                checkpoint();
            }
            assert_eq!(
                last_yield(),
                a_slice_ago,
                "yielded before reading the clock"
            );
            checkpoint();
            let yielded = last_yield();
            assert!(yielded > a_slice_ago, "a slice passed without a yield");

            // Within a slice the checkpoints only count.
            for _ in 0..=CHECKPOINTS_PER_CLOCK_READ {
                checkpoint();
            }
            if yielded.elapsed() < BACKGROUND_SLICE {
                assert_eq!(last_yield(), yielded, "yielded within a slice");
            }
            // An explicit yield starts a new slice.
            start_slice(a_slice_ago);
            yield_to_requests();
            assert!(
                last_yield() > a_slice_ago,
                "a yield did not start a new slice"
            );
            // So does a yield for background threads, on one.
            start_slice(a_slice_ago);
            yield_if_background();
            assert!(
                last_yield() > a_slice_ago,
                "a background thread's yield did not start a new slice"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_step_checkpoint_looks_at_the_clock_every_time() {
        checkpoint_step();
        assert!(SLICE.with(Cell::get).is_none());

        std::thread::spawn(|| {
            let a_slice_ago = Instant::now().checked_sub(2 * BACKGROUND_SLICE).unwrap();
            start_slice(a_slice_ago);
            // The first one already: no counting down.
            checkpoint_step();
            let yielded = last_yield();
            assert!(yielded > a_slice_ago, "a slice passed without a yield");
            checkpoint_step();
            if yielded.elapsed() < BACKGROUND_SLICE {
                assert_eq!(last_yield(), yielded, "yielded within a slice");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_yield_for_background_threads_leaves_other_threads_alone() {
        std::thread::spawn(|| {
            yield_if_background();
            assert!(SLICE.with(Cell::get).is_none());
        })
        .join()
        .unwrap();
    }
}
