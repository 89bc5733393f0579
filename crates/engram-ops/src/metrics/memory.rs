//! What the memory phase did to each chat completion: tokens injected per block, items,
//! the stored history they stand in for, retrieval, and why memory was skipped or failed open.

use prometheus::{Histogram, IntCounter, Registry};

use super::{
    OVERHEAD_BUCKETS, TOKEN_BUCKETS, child, counter, counter_vec, histogram_vec, try_array,
};
use crate::error::Result;
use engram_proxy::pipeline::{MemoryOutcome, Rewrite};

/// `x-engram-memory-reason` values of a degraded answer (the store failed open).
const FAIL_OPEN_REASONS: [&str; 6] = [
    "store_error",
    "store_timeout",
    "store_race",
    "memory_loading",
    "recording_backlog",
    "other",
];
/// `x-engram-memory-reason` values of a skipped one.
const SKIP_REASONS: [&str; 5] = ["no_user", "mode_off", "disabled", "empty", "other"];
const BLOCKS: [&str; 3] = ["core", "window", "recall"];
/// The phases of a request that engram's memory adds to it, timed apiece.
const PHASES: [&str; 3] = ["load", "compose", "receipt_wait"];

#[derive(Clone)]
pub struct MemoryMetrics {
    /// By [`BLOCKS`].
    injected_tokens: [Histogram; 3],
    injected_items: IntCounter,
    history_tokens: IntCounter,
    candidates: IntCounter,
    hits: IntCounter,
    fail_open: [IntCounter; FAIL_OPEN_REASONS.len()],
    skipped: [IntCounter; SKIP_REASONS.len()],
    /// By [`PHASES`].
    phases: [Histogram; 3],
}

impl MemoryMetrics {
    pub(super) fn new(registry: &Registry) -> Result<MemoryMetrics> {
        let injected_tokens = histogram_vec(
            registry,
            "engram_memory_injected_tokens",
            "Tokens injected per request into each memory block (core: identity, constraints, pinned, facts; window: recent raw turns; recall: retrieved items), for requests that got memory.",
            &["block"],
            TOKEN_BUCKETS,
        )?;
        let fail_open = counter_vec(
            registry,
            "engram_memory_fail_open_total",
            "Chat completions answered without memory because the store failed or was too slow, by x-engram-memory-reason.",
            &["reason"],
        )?;
        let skipped = counter_vec(
            registry,
            "engram_memory_skipped_total",
            "Chat completions that did not use memory by design, by x-engram-memory-reason.",
            &["reason"],
        )?;
        let phases = histogram_vec(
            registry,
            "engram_memory_phase_seconds",
            "Time per request in each phase memory adds: load (reading the memory: the cache, the store's one read, catching the cached copy up), compose (the rewritten prompt), receipt_wait (a recorded answer's end held for its durable recording, capture.receipt_wait_ms at most).",
            &["phase"],
            OVERHEAD_BUCKETS,
        )?;
        Ok(MemoryMetrics {
            phases: try_array(|index| child(&phases, &[PHASES[index]]))?,
            injected_tokens: try_array(|index| child(&injected_tokens, &[BLOCKS[index]]))?,
            injected_items: counter(
                registry,
                "engram_memory_injected_items_total",
                "Memory items injected into requests.",
            )?,
            history_tokens: counter(
                registry,
                "engram_memory_history_tokens_total",
                "For requests that got memory: tokens of the user's whole stored conversation history (every recorded exchange's messages), which the injected memory stands in for.",
            )?,
            candidates: counter(
                registry,
                "engram_retrieval_candidates_total",
                "Items retrieval ranked as relevant to the latest user message.",
            )?,
            hits: counter(
                registry,
                "engram_retrieval_hits_total",
                "Retrieved items that were injected (the recall block).",
            )?,
            fail_open: try_array(|index| child(&fail_open, &[FAIL_OPEN_REASONS[index]]))?,
            skipped: try_array(|index| child(&skipped, &[SKIP_REASONS[index]]))?,
        })
    }

    /// Counts what the memory phase did to one request.
    pub fn observe(&self, rewrite: &Rewrite) {
        let measures = &rewrite.measures;
        match rewrite.outcome {
            MemoryOutcome::Injected => {
                let blocks = measures.blocks;
                for (histogram, tokens) in
                    self.injected_tokens
                        .iter()
                        .zip([blocks.core, blocks.window, blocks.recall])
                {
                    histogram.observe(f64::from(tokens));
                }
                self.injected_items
                    .inc_by(u64::from(rewrite.injected_items));
                self.history_tokens.inc_by(measures.history_tokens);
            }
            MemoryOutcome::Degraded => {
                self.fail_open[index_of(&FAIL_OPEN_REASONS, rewrite.reason)].inc();
            }
            MemoryOutcome::Skipped => {
                self.skipped[index_of(&SKIP_REASONS, rewrite.reason)].inc();
            }
        }
        self.candidates
            .inc_by(u64::from(measures.retrieval_candidates));
        self.hits.inc_by(u64::from(measures.retrieval_hits));
        for (histogram, took) in self.phases.iter().zip([measures.load, measures.compose]) {
            if let Some(took) = took {
                histogram.observe(took.as_secs_f64());
            }
        }
    }

    /// Where a recorded stream's end times its wait for the receipt (the tee observes it).
    pub fn receipt_wait(&self) -> Histogram {
        self.phases[2].clone()
    }

    /// A recorded whole answer's end waited `took` for its receipt.
    pub fn receipt_waited(&self, took: std::time::Duration) {
        self.phases[2].observe(took.as_secs_f64());
    }
}

/// The position of `reason` among `known`, or of the last entry, `other`.
fn index_of(known: &[&str], reason: Option<&str>) -> usize {
    let last = known.len() - 1;
    reason
        .and_then(|reason| known[..last].iter().position(|known| *known == reason))
        .unwrap_or(last)
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_memory::BlockTokens;
    use engram_proxy::pipeline::MemoryMeasures;

    #[test]
    fn an_injected_request_counts_its_blocks_history_and_retrieval() {
        let metrics = MemoryMetrics::new(&Registry::new()).unwrap();
        metrics.observe(&Rewrite {
            outcome: MemoryOutcome::Injected,
            injected_tokens: 130,
            injected_items: 7,
            measures: MemoryMeasures {
                blocks: BlockTokens {
                    core: 100,
                    window: 0,
                    recall: 30,
                    total: 130,
                },
                history_tokens: 5000,
                retrieval_candidates: 9,
                retrieval_hits: 2,
                load: Some(std::time::Duration::from_micros(40)),
                compose: Some(std::time::Duration::from_micros(300)),
            },
            ..Rewrite::default()
        });
        assert_eq!(metrics.injected_tokens[0].get_sample_sum(), 100.0);
        assert_eq!(metrics.injected_tokens[1].get_sample_count(), 1);
        assert_eq!(metrics.injected_tokens[2].get_sample_sum(), 30.0);
        assert_eq!(metrics.injected_items.get(), 7);
        assert_eq!(metrics.history_tokens.get(), 5000);
        assert_eq!((metrics.candidates.get(), metrics.hits.get()), (9, 2));
        assert!(metrics.fail_open.iter().all(|counter| counter.get() == 0));
        // Each phase in its own series; the receipt's wait comes from the answer's end.
        let [load, compose, receipt_wait] = &metrics.phases;
        assert_eq!(load.get_sample_sum(), 40e-6);
        assert_eq!(compose.get_sample_sum(), 300e-6);
        assert_eq!(receipt_wait.get_sample_count(), 0);
        metrics.receipt_waited(std::time::Duration::from_micros(500));
        assert_eq!(receipt_wait.get_sample_sum(), 500e-6);
    }

    #[test]
    fn a_request_answered_without_memory_times_no_phase() {
        let metrics = MemoryMetrics::new(&Registry::new()).unwrap();
        metrics.observe(&Rewrite {
            outcome: MemoryOutcome::Degraded,
            reason: Some("store_timeout"),
            ..Rewrite::default()
        });
        assert!(metrics.phases.iter().all(|h| h.get_sample_count() == 0));
    }

    #[test]
    fn reasons_map_to_their_series_and_unknown_ones_to_other() {
        let metrics = MemoryMetrics::new(&Registry::new()).unwrap();
        for (outcome, reason) in [
            (MemoryOutcome::Degraded, Some("store_timeout")),
            (MemoryOutcome::Degraded, Some("recording_backlog")),
            (MemoryOutcome::Degraded, Some("something_new")),
            (MemoryOutcome::Skipped, Some("no_user")),
            (MemoryOutcome::Skipped, None),
        ] {
            metrics.observe(&Rewrite {
                outcome,
                reason,
                ..Rewrite::default()
            });
        }
        let fail_open: Vec<u64> = metrics.fail_open.iter().map(IntCounter::get).collect();
        assert_eq!(fail_open, [0, 1, 0, 0, 1, 1]);
        let skipped: Vec<u64> = metrics.skipped.iter().map(IntCounter::get).collect();
        assert_eq!(skipped, [1, 0, 0, 0, 1]);
        assert_eq!(metrics.injected_tokens[0].get_sample_count(), 0);
    }
}
