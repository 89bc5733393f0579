//! Yield points of the update path: the engine's long loops call [`checkpoint`], and on a
//! thread the sidecar marked as background work (its worker and recorder threads, see
//! `engram_runtime::priority`) a checkpoint gives the core to a waiting request thread once the
//! thread has run a slice (`BACKGROUND_SLICE`); on any other thread it does nothing. Only a
//! thread-local slice and `std::thread::yield_now`: the scheduling policies and the runtimes
//! that start those threads stay in the sidecar's runtime crate.

use std::cell::Cell;
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
        std::thread::yield_now();
        current.since = Instant::now();
    }
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
