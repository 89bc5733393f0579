//! Whether the idle loop's computations get a core (`worker.max_lag_ms`, see [`super::lag`]).
//!
//! The lag monitor's probe says whether the idle runtime's async thread runs when woken. On a
//! node whose other processes keep every core busy it often does: a waking thread is placed
//! ahead of the busy loops. The blocking thread computing a run (the engine's work, nothing but
//! CPU) stays runnable instead, and waits behind them for seconds. In `tests/worker_lag.rs`
//! (2026-12-06) a run stalled so for half a second before any probe was late; 19 jobs had
//! queued by then, and five were applied past the bound. So the monitor also reads how long
//! each computing thread ran between two looks (Linux's `schedstat`).

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use engram_runtime::priority;

use super::lag::PROMPT;

/// The idle loop's computations in flight, each with the kernel's id of the thread running it.
#[derive(Debug, Default)]
pub struct Computing {
    running: Mutex<BTreeMap<u64, u32>>,
    next: AtomicU64,
}

/// Marks a computation in flight until dropped.
#[derive(Debug)]
pub struct InFlight {
    computing: Arc<Computing>,
    id: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.computing.running().remove(&self.id);
    }
}

impl Computing {
    /// Marks the calling thread as computing until the mark drops; `None` where the thread's
    /// id cannot be read (not Linux), and then nothing is watched.
    pub fn enter(self: &Arc<Self>) -> Option<InFlight> {
        let thread = priority::thread_id()?;
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        self.running().insert(id, thread);
        Some(InFlight {
            computing: Arc::clone(self),
            id,
        })
    }

    fn running(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, u32>> {
        self.running.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// What the monitor saw of each computation at its last look: when, and how long its thread
/// had run by then.
#[derive(Debug, Default)]
pub struct Stalls {
    seen: HashMap<u64, (Instant, Duration)>,
}

impl Stalls {
    /// Whether a computation in flight at this look and the last, at least [`PROMPT`] apart,
    /// ran less than a quarter of the time between them: it needs nothing but a core, so it
    /// spent the rest waiting for one.
    pub fn look(&mut self, computing: &Computing, now: Instant) -> bool {
        let threads: Vec<(u64, u32)> = computing
            .running()
            .iter()
            .map(|(id, thread)| (*id, *thread))
            .collect();
        let ran = threads
            .into_iter()
            .filter_map(|(id, thread)| Some((id, priority::thread_run_time(thread)?)));
        self.update(ran, now)
    }

    fn update(&mut self, ran: impl Iterator<Item = (u64, Duration)>, now: Instant) -> bool {
        let mut stalled = false;
        let mut seen = HashMap::with_capacity(self.seen.len());
        for (id, total) in ran {
            if let Some((then, before)) = self.seen.get(&id) {
                let interval = now.saturating_duration_since(*then);
                stalled |= interval >= PROMPT && total.saturating_sub(*before) * 4 < interval;
            }
            seen.insert(id, (now, total));
        }
        self.seen = seen;
        stalled
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn a_computation_that_ran_under_a_quarter_of_the_time_between_looks_stalled() {
        let start = Instant::now();
        let mut stalls = Stalls::default();
        // The first look only records.
        assert!(!stalls.update([(1, ms(10))].into_iter(), start));
        // 100 ms later it ran 30 ms: a quarter or more, so it got its share of a core.
        assert!(!stalls.update([(1, ms(40))].into_iter(), start + ms(100)));
        // The next 100 ms it ran 20 ms.
        assert!(stalls.update([(1, ms(60))].into_iter(), start + ms(200)));
        // Looks closer than a probe's allowance say nothing.
        assert!(!stalls.update([(1, ms(60))].into_iter(), start + ms(240)));
    }

    #[test]
    fn only_a_computation_seen_at_both_looks_counts() {
        let start = Instant::now();
        let mut stalls = Stalls::default();
        assert!(!stalls.update([(1, ms(0))].into_iter(), start));
        // 1 ended; 2 started since the last look and has not run yet.
        assert!(!stalls.update([(2, ms(0))].into_iter(), start + ms(100)));
        // A computation that ended is forgotten: its id back would be a new one.
        assert!(!stalls.update([(1, ms(0))].into_iter(), start + ms(200)));
        assert!(stalls.update([(1, ms(0)), (3, ms(0))].into_iter(), start + ms(300)));
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_computing_thread_is_watched_while_it_computes_and_runs() {
        let computing = Arc::new(Computing::default());
        let mut stalls = Stalls::default();
        let start = Instant::now();
        let in_flight = computing.enter().unwrap();
        assert_eq!(computing.running().len(), 1);
        assert!(!stalls.look(&computing, Instant::now()));
        // Spinning, this thread runs nearly all of the 60 ms (a loaded machine may take some).
        let mut spins = 0_u64;
        while start.elapsed() < ms(60) {
            spins = std::hint::black_box(spins + 1);
        }
        let seen = stalls.seen.values().next().copied().unwrap();
        let ran = priority::thread_run_time(priority::thread_id().unwrap()).unwrap();
        assert!(
            ran > seen.1,
            "its run time grows: {ran:?} after {:?}",
            seen.1
        );
        drop(in_flight);
        assert!(computing.running().is_empty());
        // Ended, it is no longer looked at.
        assert!(!stalls.look(&computing, Instant::now()));
        assert!(stalls.seen.is_empty());
    }
}
