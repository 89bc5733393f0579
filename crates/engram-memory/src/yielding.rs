//! Yield points of the update path: the engine's long loops call [`checkpoint`], and on a
//! thread the sidecar marked as background work (its worker and recorder threads, see
//! `engram_runtime::priority`) a checkpoint gives the core to a waiting request thread once the
//! thread has run a slice (`BACKGROUND_SLICE`); on any other thread it does nothing. Only a
//! thread-local slice and `std::thread::yield_now`: the scheduling policies and the runtimes
//! that start those threads stay in the sidecar's runtime crate.
//!
//! A yield cannot choose who gets the core. On a node whose other processes keep every core
//! busy, it went to them for a whole scheduler slice (1.5–3 ms here), not to a request of this
//! process: every recorded answer's end waited that long behind its commit's yield
//! (docs/benchmarks-log.md). So on a thread that asks for it
//! ([`hold_back_after_foreign_yields`]), a yield that waited long while this process got little
//! CPU ([`gave_way_to_another_process`]) stops the thread's yields for [`FOREIGN_BACKOFF`]; the
//! next one after that looks again. That needs the process's CPU clock, which the sidecar
//! installs ([`set_process_clock`]); without it every yield is made.

use std::cell::Cell;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

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
    give_way();
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
/// recorder thread that has run `BACKGROUND_SLICE` since it last yielded, yields to a waiting
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
        give_way();
        current.since = Instant::now();
    }
}

/// A yield that waited at least this long is looked at: a yield with no one else runnable
/// returns in microseconds.
const LONG_YIELD: Duration = Duration::from_micros(500);

/// How long a thread makes no yields after one gave the core to another process.
pub const FOREIGN_BACKOFF: Duration = Duration::from_millis(100);

/// The process's CPU time (all its threads), installed once by the sidecar.
static PROCESS_CLOCK: OnceLock<fn() -> Option<Duration>> = OnceLock::new();

/// Back-offs started in this process (see [`yields_held_back_total`]).
static HELD_BACK: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Until when this thread makes no yields (see the module documentation).
    static NO_YIELDS_UNTIL: Cell<Option<Instant>> = const { Cell::new(None) };
    /// After how many yields in a row went to another process this thread holds its yields
    /// back; 0: never.
    static HOLDS_BACK: Cell<u32> = const { Cell::new(0) };
    /// The yields in a row, up to now, that went to another process.
    static FOREIGN_STREAK: Cell<u32> = const { Cell::new(0) };
}

/// Makes the calling thread hold its yields back for [`FOREIGN_BACKOFF`] once `in_a_row` of
/// them in a row went to another process. For the threads a recorded answer's end waits for (its enqueue, the
/// commits that hold the write lock it needs), and for the catch-up while it is behind, which
/// applies the jobs when other processes keep the cores busy: the idle worker's threads keep
/// every yield, which keeps requests first while they compute.
///
/// `in_a_row` yields must have gone to another process before the thread holds back. The
/// kernel's threads take a yield now and then (at 1,000 req/s on a node with nothing else
/// running, about 120 of the catch-up's in 40 s); a busy process takes every one. 0: the
/// thread keeps every yield again.
pub fn hold_back_after_foreign_yields(in_a_row: u32) {
    HOLDS_BACK.with(|holds| holds.set(in_a_row));
    FOREIGN_STREAK.with(|streak| streak.set(0));
}

/// Whether the calling thread holds its yields back ([`hold_back_after_foreign_yields`]).
pub fn holds_back_after_foreign_yields() -> bool {
    HOLDS_BACK.with(Cell::get) > 0
}

/// Installs the process's CPU clock (`None` when it cannot be read), which lets a yield tell
/// whether it helped this process. The first clock installed stays.
pub fn set_process_clock(clock: fn() -> Option<Duration>) {
    let _ = PROCESS_CLOCK.set(clock);
}

/// Whether a yield that waited `waited` while this process's threads ran for `ours` gave the
/// core to another process: it waited long, and this process had under half of that time.
pub fn gave_way_to_another_process(waited: Duration, ours: Duration) -> bool {
    waited >= LONG_YIELD && ours < waited / 2
}

/// Yields the core, unless a recent yield of this thread went to another process.
fn give_way() {
    let started = Instant::now();
    if NO_YIELDS_UNTIL
        .with(Cell::get)
        .is_some_and(|until| started < until)
    {
        return;
    }
    // Only a thread that holds its yields back reads the clock (two system calls a yield).
    let clock = PROCESS_CLOCK
        .get()
        .filter(|_| holds_back_after_foreign_yields());
    let cpu_before = clock.and_then(|clock| clock());
    std::thread::yield_now();
    if let (Some(clock), Some(cpu_before)) = (clock, cpu_before)
        && let Some(cpu_after) = clock()
    {
        let waited = started.elapsed();
        after_yield(waited, cpu_after.saturating_sub(cpu_before), Instant::now());
    }
}

/// Starts a back-off once the yields just made gave the core to another process as many times
/// in a row as this thread asked.
fn after_yield(waited: Duration, ours: Duration, now: Instant) {
    let in_a_row = HOLDS_BACK.with(Cell::get);
    if in_a_row == 0 {
        return;
    }
    if !gave_way_to_another_process(waited, ours) {
        FOREIGN_STREAK.with(|streak| streak.set(0));
        return;
    }
    let streak = FOREIGN_STREAK.with(|streak| {
        streak.set(streak.get().saturating_add(1));
        streak.get()
    });
    if streak >= in_a_row {
        FOREIGN_STREAK.with(|streak| streak.set(0));
        NO_YIELDS_UNTIL.with(|until| until.set(Some(now + FOREIGN_BACKOFF)));
        HELD_BACK.fetch_add(1, Ordering::Relaxed);
    }
}

/// How many times a thread of this process held its yields back because one went to another
/// process: a node whose other processes keep the cores busy.
pub fn yields_held_back_total() -> u64 {
    HELD_BACK.load(Ordering::Relaxed)
}

/// Whether this thread's yields are held back now, after one went to another process.
#[cfg(test)]
fn yields_held_back() -> bool {
    NO_YIELDS_UNTIL
        .with(Cell::get)
        .is_some_and(|until| Instant::now() < until)
}

/// Makes [`checkpoint`] yield on the calling thread: the sidecar calls it as each worker and
/// recorder thread starts.
pub fn mark_background() {
    start_slice(Instant::now());
}

/// Whether the calling thread was marked a background thread ([`mark_background`]).
pub fn is_background() -> bool {
    SLICE.with(Cell::get).is_some()
}

/// When the calling background thread last yielded; `None` on any other thread.
pub fn last_yield() -> Option<Instant> {
    SLICE.with(Cell::get).map(|slice| slice.since)
}

/// Starts the calling thread's slice at `since`, marking it a background thread.
pub fn start_slice(since: Instant) {
    SLICE.with(|slice| {
        slice.set(Some(Slice {
            countdown: CHECKPOINTS_PER_CLOCK_READ,
            since,
        }));
    });
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn a_yield_that_went_to_another_process_holds_the_next_ones_back() {
        let ms = Duration::from_millis;
        // Short yields are not looked at; long ones count when this process had under half.
        assert!(!gave_way_to_another_process(
            Duration::from_micros(100),
            Duration::ZERO
        ));
        assert!(gave_way_to_another_process(ms(3), ms(1)));
        assert!(!gave_way_to_another_process(ms(3), ms(2)));
        std::thread::spawn(move || {
            // A thread that did not ask holds nothing back.
            after_yield(ms(3), Duration::ZERO, Instant::now());
            assert!(!yields_held_back());
            hold_back_after_foreign_yields(1);
            // The core went to this process's own threads: yields go on.
            after_yield(ms(3), ms(3), Instant::now());
            assert!(!yields_held_back());
            // It went elsewhere: none for the back-off, then they resume.
            let counted = yields_held_back_total();
            after_yield(ms(3), Duration::ZERO, Instant::now());
            assert!(yields_held_back());
            assert!(yields_held_back_total() > counted);
            mark_background();
            let before = last_yield().unwrap();
            std::thread::sleep(ms(1));
            yield_to_requests();
            assert!(
                last_yield().unwrap() > before,
                "a held-back yield still starts a slice"
            );
            let long_ago = Instant::now().checked_sub(FOREIGN_BACKOFF * 2).unwrap();
            after_yield(ms(3), Duration::ZERO, long_ago);
            assert!(!yields_held_back());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_thread_can_ask_for_several_foreign_yields_in_a_row_before_holding_back() {
        let ms = Duration::from_millis;
        std::thread::spawn(move || {
            hold_back_after_foreign_yields(3);
            let now = Instant::now();
            after_yield(ms(3), Duration::ZERO, now);
            after_yield(ms(3), Duration::ZERO, now);
            // One that went to this process breaks the row.
            after_yield(ms(3), ms(3), now);
            after_yield(ms(3), Duration::ZERO, now);
            after_yield(ms(3), Duration::ZERO, now);
            assert!(!yields_held_back());
            after_yield(ms(3), Duration::ZERO, now);
            assert!(yields_held_back());
            // Asked for none, it keeps every yield again.
            hold_back_after_foreign_yields(0);
            let later = now + FOREIGN_BACKOFF * 2;
            for _ in 0..5 {
                after_yield(ms(3), Duration::ZERO, later);
            }
            assert!(!holds_back_after_foreign_yields());
            assert!(
                NO_YIELDS_UNTIL
                    .with(Cell::get)
                    .is_none_or(|until| until <= later)
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn checkpoints_yield_on_background_threads_once_a_slice_has_passed() {
        // A thread that was never marked (a request thread) keeps no slice.
        checkpoint();
        assert!(!is_background());

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
                Some(a_slice_ago),
                "yielded before reading the clock"
            );
            checkpoint();
            let yielded = last_yield().unwrap();
            assert!(yielded > a_slice_ago, "a slice passed without a yield");

            // Within a slice the checkpoints only count.
            for _ in 0..=CHECKPOINTS_PER_CLOCK_READ {
                checkpoint();
            }
            if yielded.elapsed() < BACKGROUND_SLICE {
                assert_eq!(last_yield(), Some(yielded), "yielded within a slice");
            }
            // An explicit yield starts a new slice.
            start_slice(a_slice_ago);
            yield_to_requests();
            assert!(
                last_yield().unwrap() > a_slice_ago,
                "a yield did not start a new slice"
            );
            // So does a yield for background threads, on one.
            start_slice(a_slice_ago);
            yield_if_background();
            assert!(
                last_yield().unwrap() > a_slice_ago,
                "a background thread's yield did not start a new slice"
            );
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_step_checkpoint_looks_at_the_clock_every_time() {
        checkpoint_step();
        assert!(!is_background());

        std::thread::spawn(|| {
            let a_slice_ago = Instant::now().checked_sub(2 * BACKGROUND_SLICE).unwrap();
            start_slice(a_slice_ago);
            // The first one already: no counting down.
            checkpoint_step();
            let yielded = last_yield().unwrap();
            assert!(yielded > a_slice_ago, "a slice passed without a yield");
            checkpoint_step();
            if yielded.elapsed() < BACKGROUND_SLICE {
                assert_eq!(last_yield(), Some(yielded), "yielded within a slice");
            }
        })
        .join()
        .unwrap();
    }

    #[test]
    fn a_yield_for_background_threads_leaves_other_threads_alone() {
        std::thread::spawn(|| {
            yield_if_background();
            assert!(!is_background());
        })
        .join()
        .unwrap();
    }
}
