//! The idle loop's runs, open to the catch-up (`worker.max_lag_ms`, see [`super::lag`]).
//!
//! A run the idle loop claimed is leased to this process until it commits, and its session's
//! later jobs wait behind it. When the busy cores starve the idle threads after the claim, the
//! run waits until they get the CPU again: seconds, or the whole lease, with its session's later
//! jobs behind it, however fast the catch-up is. So the idle loop holds each run here until
//! it ends, and the catch-up, while the idle threads count as starved, takes over the runs held
//! for a quarter of the lag bound and applies them itself. An idle task whose run was taken
//! before it started skips it; one taken mid-way commits late, conflicts, and its retry finds
//! the jobs applied (duplicates, as after a crash).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant};

use engram_store::ClaimedJob;

use super::Answer;
use super::summaries::RunSummaries;

/// The runs the idle loop claimed and has not finished, by id (in the order they were held).
#[derive(Debug, Default)]
pub struct HeldRuns {
    runs: Mutex<BTreeMap<u64, Held>>,
    next: AtomicU64,
}

#[derive(Debug)]
struct Held {
    since: Instant,
    jobs: Vec<ClaimedJob>,
    /// Shared with the idle task, so a taken-over run is not summarized twice.
    summaries: Arc<RunSummaries<Answer>>,
}

impl HeldRuns {
    /// Holds a run claimed at `now`, with the summaries its claimer makes; the id ends the
    /// hold ([`HeldRuns::release`]).
    pub fn hold(
        &self,
        jobs: &[ClaimedJob],
        summaries: &Arc<RunSummaries<Answer>>,
        now: Instant,
    ) -> u64 {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let held = Held {
            since: now,
            jobs: jobs.to_vec(),
            summaries: Arc::clone(summaries),
        };
        self.runs().insert(id, held);
        id
    }

    /// Whether the run is still held: false once the catch-up took it over.
    pub fn is_held(&self, id: u64) -> bool {
        self.runs().contains_key(&id)
    }

    /// Ends the hold of a run its claimer finished.
    pub fn release(&self, id: u64) {
        self.runs().remove(&id);
    }

    /// Takes the runs held for `age` or longer, oldest first, each with its summaries; nobody
    /// else can take them then.
    pub fn take_older_than(
        &self,
        age: Duration,
        now: Instant,
    ) -> Vec<(Vec<ClaimedJob>, Arc<RunSummaries<Answer>>)> {
        let mut runs = self.runs();
        // In id order, so oldest first.
        let old: Vec<u64> = runs
            .iter()
            .filter(|(_, held)| now.saturating_duration_since(held.since) >= age)
            .map(|(id, _)| *id)
            .collect();
        old.iter()
            .filter_map(|id| runs.remove(id))
            .map(|held| (held.jobs, held.summaries))
            .collect()
    }

    fn runs(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Held>> {
        self.runs.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use engram_memory::ExchangeInput;
    use engram_store::{Job, JobId, UserKey};

    use super::*;

    fn claimed(key: &str) -> ClaimedJob {
        ClaimedJob {
            job: Job {
                id: JobId {
                    user: UserKey::new("t", "u"),
                    key: key.to_owned(),
                },
                exchange: ExchangeInput {
                    session_id: "s".to_owned(),
                    turn_id: key.to_owned(),
                    user_text: "hello".to_owned(),
                    assistant_text: "hi".to_owned(),
                    event_time: None,
                    prior_chain: None,
                    incomplete: false,
                    arrival: None,
                },
                trace: None,
            },
            attempt: 1,
        }
    }

    fn keys(runs: &[(Vec<ClaimedJob>, Arc<RunSummaries<Answer>>)]) -> Vec<Vec<&str>> {
        runs.iter()
            .map(|(run, _)| run.iter().map(|job| job.job.id.key.as_str()).collect())
            .collect()
    }

    /// Holds `run` with summaries of its own.
    fn hold(held: &HeldRuns, run: &[ClaimedJob], now: Instant) -> u64 {
        held.hold(run, &Arc::new(RunSummaries::new(run)), now)
    }

    #[test]
    fn only_runs_held_long_enough_are_taken_and_each_once() {
        let held = HeldRuns::default();
        let start = Instant::now();
        let first = hold(&held, &[claimed("a"), claimed("b")], start);
        let second = hold(&held, &[claimed("c")], start + Duration::from_millis(50));
        let later = start + Duration::from_millis(120);
        // Only the first has been held 100 ms.
        let taken = held.take_older_than(Duration::from_millis(100), later);
        assert_eq!(keys(&taken), [["a", "b"]]);
        assert!(!held.is_held(first));
        assert!(held.is_held(second));
        assert!(
            held.take_older_than(Duration::from_millis(100), later)
                .is_empty()
        );
        // A released run is never taken.
        held.release(second);
        let much_later = start + Duration::from_secs(10);
        assert!(held.take_older_than(Duration::ZERO, much_later).is_empty());
    }

    #[test]
    fn runs_are_taken_oldest_first() {
        let held = HeldRuns::default();
        let now = Instant::now();
        for key in ["a", "b", "c"] {
            hold(&held, &[claimed(key)], now);
        }
        let taken = held.take_older_than(Duration::ZERO, now);
        assert_eq!(keys(&taken), [["a"], ["b"], ["c"]]);
    }
}
