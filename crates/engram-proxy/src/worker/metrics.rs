//! The worker's own observations: job lag and apply time. The histograms are registered
//! (named, described) by `metrics`; this is what the worker observes into.

use prometheus::Histogram;

use crate::recorder::ids::turn_time_micros;
use engram_runtime::now_micros;

/// The worker's own observations.
#[derive(Clone)]
pub struct WorkerMetrics {
    job_lag: Histogram,
    apply: Histogram,
}

impl WorkerMetrics {
    /// Observes job lags into `job_lag` and each job's share of its run's time into `apply`.
    pub fn new(job_lag: Histogram, apply: Histogram) -> WorkerMetrics {
        WorkerMetrics { job_lag, apply }
    }

    /// A run of `jobs` jobs took `elapsed` to apply: each job observes its share.
    pub fn applied_run(&self, jobs: usize, elapsed: std::time::Duration) {
        let share = elapsed.as_secs_f64() / jobs.max(1) as f64;
        for _ in 0..jobs {
            self.apply.observe(share);
        }
    }

    /// A job was applied: observes its lag from the turn id's time (see
    /// [`turn_time_micros`]); ids this proxy did not make are not observed.
    pub fn applied(&self, turn_id: &str) {
        if let Some(made) = turn_time_micros(turn_id) {
            self.job_lag.observe(lag_seconds(made, now_micros()));
        }
    }
}

/// Clock skew between the proxy that made the id and this worker can make it negative: 0.
fn lag_seconds(made_micros: u64, now_micros: u64) -> f64 {
    now_micros.saturating_sub(made_micros) as f64 / 1e6
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lag_never_goes_negative() {
        assert_eq!(lag_seconds(2_500_000, 4_000_000), 1.5);
        assert_eq!(lag_seconds(4_000_000, 2_500_000), 0.0);
    }
}
