//! The LLM summarizer's health: calls, failures by reason, tokens, latency.

use std::time::Duration;

use prometheus::{Histogram, IntCounter, Registry};

use super::{MODEL_BUCKETS, child, counter, counter_vec, histogram, try_array};
use crate::error::Result;
use crate::openai::Usage;
use crate::summarizer::SummaryFailure;

/// Every reason a summarizer extraction can fail (`SummaryFailure::as_str`).
const FAILURES: [SummaryFailure; 9] = [
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
    pub(super) fn new(registry: &Registry) -> Result<SummarizerMetrics> {
        let failures = counter_vec(
            registry,
            "engram_summarizer_failures_total",
            "Summarizer extractions that could not use the model (the heuristic extraction stood in), by reason.",
            &["reason"],
        )?;
        let tokens = counter_vec(
            registry,
            "engram_summarizer_tokens_total",
            "Tokens the summarizer model reported using, by kind (prompt, completion).",
            &["kind"],
        )?;
        Ok(SummarizerMetrics {
            calls: counter(
                registry,
                "engram_summarizer_calls_total",
                "HTTP calls to the summarizer model (an invalid-JSON reply is retried once: two calls).",
            )?,
            failures: try_array(|index| child(&failures, &[FAILURES[index].as_str()]))?,
            tokens: try_array(|index| {
                child(&tokens, &[if index == 0 { "prompt" } else { "completion" }])
            })?,
            latency: histogram(
                registry,
                "engram_summarizer_latency_seconds",
                "One summarizer call, sent to its whole reply read (or its failure).",
                MODEL_BUCKETS,
            )?,
        })
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
        let metrics = SummarizerMetrics::new(&Registry::new()).unwrap();
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
