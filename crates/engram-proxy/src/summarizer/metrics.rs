//! The LLM summarizer's health: calls, failures by reason, tokens, latency. The counters are
//! registered (named, described) by `metrics`; this is what the summarizer counts into.

use std::time::Duration;

use prometheus::{Histogram, IntCounter};

use super::SummaryFailure;
use engram_memory::openai::Usage;

/// Every reason a summarizer extraction can fail (`SummaryFailure::as_str`), in the order of
/// [`SummarizerMetrics::new`]'s `failures`.
pub const FAILURES: [SummaryFailure; 9] = [
    SummaryFailure::NotConfigured,
    SummaryFailure::InvalidJson,
    SummaryFailure::Timeout,
    SummaryFailure::RateLimited,
    SummaryFailure::TokenBudget,
    SummaryFailure::UpstreamStatus(429),
    SummaryFailure::UpstreamStatus(500),
    SummaryFailure::UpstreamStatus(400),
    SummaryFailure::Transport,
];

#[derive(Clone)]
pub struct SummarizerMetrics {
    calls: IntCounter,
    failures: [IntCounter; 9],
    /// Prompt, completion.
    tokens: [IntCounter; 2],
    latency: Histogram,
}

impl SummarizerMetrics {
    /// Counts into these: calls, failures by [`FAILURES`], tokens (prompt, completion), and
    /// the latency of a call.
    pub fn new(
        calls: IntCounter,
        failures: [IntCounter; 9],
        tokens: [IntCounter; 2],
        latency: Histogram,
    ) -> SummarizerMetrics {
        SummarizerMetrics {
            calls,
            failures,
            tokens,
            latency,
        }
    }

    /// One call to the model, answered or not, and the tokens its reply reports.
    pub fn call(&self, elapsed: Duration, usage: Option<Usage>) {
        self.calls.inc();
        self.latency.observe(elapsed.as_secs_f64());
        if let Some(usage) = usage {
            self.tokens[0].inc_by(usage.prompt_tokens);
            self.tokens[1].inc_by(usage.completion_tokens);
        }
    }

    /// An extraction that fell back (or a background retry that failed).
    pub fn failed(&self, reason: SummaryFailure) {
        let label = reason.as_str();
        if let Some(counter) = FAILURES
            .iter()
            .position(|known| known.as_str() == label)
            .and_then(|index| self.failures.get(index))
        {
            counter.inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_failure_reason_has_its_own_series() {
        let counter = |name: &str| IntCounter::new(name, "test").unwrap();
        let metrics = SummarizerMetrics::new(
            counter("calls"),
            std::array::from_fn(|index| counter(&format!("failures_{index}"))),
            [counter("prompt"), counter("completion")],
            Histogram::with_opts(prometheus::HistogramOpts::new("latency", "test")).unwrap(),
        );
        let labels: std::collections::HashSet<_> =
            FAILURES.iter().map(SummaryFailure::as_str).collect();
        assert_eq!(labels.len(), FAILURES.len());
        metrics.failed(SummaryFailure::UpstreamStatus(503));
        metrics.failed(SummaryFailure::UpstreamStatus(502));
        metrics.failed(SummaryFailure::InvalidJson);
        assert_eq!(metrics.failures[6].get(), 2);
        assert_eq!(metrics.failures[1].get(), 1);
        metrics.call(
            Duration::from_millis(40),
            Some(Usage {
                prompt_tokens: 300,
                completion_tokens: 50,
                total_tokens: 350,
            }),
        );
        metrics.call(Duration::from_millis(10), None);
        assert_eq!(metrics.calls.get(), 2);
        assert_eq!(
            (metrics.tokens[0].get(), metrics.tokens[1].get()),
            (300, 50)
        );
        assert_eq!(metrics.latency.get_sample_count(), 2);
    }
}
