//! The engine's tunables, deserialisable from the `memory:` section of `config.yaml`. Every field
//! has a default, so an empty section is a valid configuration.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MemoryConfig {
    /// The whole injected size in tokens: core block + engine-supplied raw window + recall block.
    pub budget_tokens: u32,
    /// Share of the budget left after reserved items (identity, hard constraints, pinned) that
    /// goes to the NEW tier (raw window and fresh items).
    pub new_fraction: f32,
    /// Share that goes to the CURRENT tier (working-set facts and recalled items); the rest is
    /// for OLD episode manifests.
    pub current_fraction: f32,
    /// Of the CURRENT share, the part the query-independent core facts may use; the rest (and
    /// whatever they leave) is for query-dependent recall.
    pub core_fact_share: f32,
    /// Raw turns the engine supplies to stateless clients, and full-history client turns kept.
    pub raw_window_turns: usize,
    /// Extra window turns a long or code-heavy exchange stays raw for (seed 001).
    pub long_turn_extra_window: usize,
    /// Turns an item stays in NEW before it is demoted to CURRENT.
    pub new_ttl_turns: u32,
    /// Turns a turn summary may stay in CURRENT without the conversation coming back to it
    /// (seed 000 applies a TTL to the working set). Facts are bounded by capacity only: base
    /// truth stays in the core block while it fits.
    pub current_ttl_turns: u32,
    /// Token capacity of the CURRENT working set; lower-scored items beyond it are demoted to OLD
    /// and folded into episode manifests.
    pub working_set_tokens: u32,
    /// Where the recall block goes: a system message before the latest user message, or a prefix
    /// of that message for providers that reject mid-conversation system messages.
    pub placement: Placement,
    /// Where the core block goes: a system message after the client's own, or a prefix of the
    /// prompt's first user message, for providers or policies that keep memory out of the
    /// system role (a request with no user message gets it as a user message of its own).
    pub core_placement: Placement,
    /// Tokens a chat message costs beyond its content (role and separators).
    pub message_overhead_tokens: u32,
    /// Consolidation (merge duplicate facts, refresh manifests) runs every this many turns.
    pub consolidate_every_turns: u32,
    /// Drop diff entries whose value does not appear in the exchange (hallucination check).
    pub ground_diffs: bool,
    pub weights: ScoringWeights,
    pub depth: DepthConfig,
    pub retrieval: RetrievalConfig,
    pub episodes: EpisodeConfig,
}

impl Default for MemoryConfig {
    fn default() -> Self {
        MemoryConfig {
            budget_tokens: 2048,
            new_fraction: 0.2,
            current_fraction: 0.6,
            core_fact_share: 0.1,
            raw_window_turns: 6,
            long_turn_extra_window: 2,
            new_ttl_turns: 8,
            current_ttl_turns: 24,
            working_set_tokens: 1024,
            placement: Placement::System,
            core_placement: Placement::System,
            message_overhead_tokens: 4,
            consolidate_every_turns: 16,
            ground_diffs: true,
            weights: ScoringWeights::default(),
            depth: DepthConfig::default(),
            retrieval: RetrievalConfig::default(),
            episodes: EpisodeConfig::default(),
        }
    }
}

impl MemoryConfig {
    /// Checks what the types cannot; the error names the offending key (relative to the
    /// section) and why.
    pub fn validate(&self) -> Result<(), (String, String)> {
        let fail = |key: &str, why: &str| Err((key.to_owned(), why.to_owned()));
        if self.budget_tokens == 0 {
            return fail("budget_tokens", "must be greater than 0");
        }
        for (key, value) in [
            ("new_fraction", self.new_fraction),
            ("current_fraction", self.current_fraction),
            ("core_fact_share", self.core_fact_share),
            (
                "retrieval.neighbour_weight",
                self.retrieval.neighbour_weight,
            ),
            (
                "retrieval.escalate_below_coverage",
                self.retrieval.escalate_below_coverage,
            ),
            (
                "retrieval.min_relative_score",
                self.retrieval.min_relative_score,
            ),
            (
                "episodes.min_topic_overlap",
                self.episodes.min_topic_overlap,
            ),
            ("retrieval.feedback_weight", self.retrieval.feedback_weight),
            ("retrieval.lexical_weight", self.retrieval.lexical_weight),
        ] {
            if !(0.0..=1.0).contains(&value) {
                return fail(key, "must be between 0 and 1");
            }
        }
        if self.new_fraction + self.current_fraction > 1.0 {
            return fail(
                "current_fraction",
                "new_fraction + current_fraction must not exceed 1",
            );
        }
        if self.depth.short_words > self.depth.long_words {
            return fail("depth.short_words", "must not exceed depth.long_words");
        }
        if self.depth.max_message_bytes < 1024 {
            return fail("depth.max_message_bytes", "must be at least 1024");
        }
        if self.retrieval.semantic_candidates == 0 {
            return fail("retrieval.semantic_candidates", "must be greater than 0");
        }
        if self.retrieval.semantic_scan_items == 0 {
            return fail("retrieval.semantic_scan_items", "must be greater than 0");
        }
        if self.retrieval.postings_per_query == 0 {
            return fail("retrieval.postings_per_query", "must be greater than 0");
        }
        if self.retrieval.postings_per_term == 0 {
            return fail("retrieval.postings_per_term", "must be greater than 0");
        }
        if self.episodes.max_turns == 0 {
            return fail("episodes.max_turns", "must be greater than 0");
        }
        Ok(())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Placement {
    System,
    UserPrefix,
}

/// Seed 000's score: `recency·exp(-decay·Δturns) + frequency·min(freq/cap, 1) + user_priority·p
/// + dependency·d − size·min(tokens/size_scale, 1)`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScoringWeights {
    pub recency: f32,
    pub frequency: f32,
    pub user_priority: f32,
    pub dependency: f32,
    pub size: f32,
    pub recency_decay: f32,
    pub frequency_cap: f32,
    pub size_scale_tokens: f32,
}

impl Default for ScoringWeights {
    fn default() -> Self {
        ScoringWeights {
            recency: 0.40,
            frequency: 0.20,
            user_priority: 0.25,
            dependency: 0.20,
            size: 0.15,
            recency_decay: 0.35,
            frequency_cap: 5.0,
            size_scale_tokens: 200.0,
        }
    }
}

/// Size-adaptive depth thresholds (seed 001), in words.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DepthConfig {
    /// Both sides under this: summary only (the extractor is told it may skip the diff).
    pub short_words: usize,
    /// Either side at or over this: kept raw longer, and a long reply is stored as a draft.
    pub long_words: usize,
    /// A message longer than this (in bytes) enters memory as an excerpt of about this size,
    /// its head and tail (`text::excerpt`); the raw log keeps it whole. Bounds what one turn
    /// costs the worker: at 25 req/s of 100 KB pastes, token counting and extraction of the
    /// whole text kept one core busy and the queue only grew.
    pub max_message_bytes: usize,
}

impl Default for DepthConfig {
    fn default() -> Self {
        DepthConfig {
            short_words: 40,
            long_words: 200,
            max_message_bytes: 16_384,
        }
    }
}

/// How recall ranks memory for a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RetrievalMode {
    /// BM25 mixed with the cosine of static embeddings (`lexical_weight`).
    #[default]
    Hybrid,
    /// BM25 only.
    Lexical,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RetrievalConfig {
    /// `hybrid` (default) or `lexical`.
    pub mode: RetrievalMode,
    /// Hybrid: an item's score is `lexical_weight`·BM25 + (1 − `lexical_weight`)·cosine, each
    /// scaled to 0..1 per query and segment (BM25 by its best hit, cosine min–max over the
    /// items compared), then put back on the segment's BM25 scale.
    pub lexical_weight: f32,
    /// Hybrid: a segment with more vectors than this is compared by 256-bit sign codes first,
    /// and only this many nearest are scored in full.
    pub semantic_candidates: usize,
    /// Hybrid: a query is compared by meaning with at most this many of a segment's items, the
    /// newest: bounds a request's semantic pass whatever the history (older items are found
    /// by their words, as `postings_per_term` bounds the lexical pass).
    pub semantic_scan_items: usize,
    pub bm25_k1: f32,
    pub bm25_b: f32,
    /// A query word finds and scores documents in at most this many of its postings per
    /// segment, the newest: bounds a request's search whatever the history (a word said in
    /// more turns than this counts in its newest mentions only).
    pub postings_per_term: usize,
    /// A query's words together find and score documents in at most this many postings per
    /// segment, shared out rarest first (rare words are walked whole, common ones in their
    /// newest mentions): bounds a request's search however many common words it has.
    pub postings_per_query: usize,
    /// Hits taken from each part of the index per query.
    pub top_raw_turns: usize,
    pub top_summaries: usize,
    pub top_facts: usize,
    pub top_episodes: usize,
    pub top_artifacts: usize,
    /// A raw-turn hit lends this fraction of its score to the turns just before and after it in
    /// the same session (answers often span a question and its reply's neighbours).
    pub neighbour_weight: f32,
    /// Escalate to raw turns when the summary tier covers less than this share of the query's
    /// term weight (seed 003).
    pub escalate_below_coverage: f32,
    /// Raw-turn hits are scaled by this when the summary tier already covers the query (1: not
    /// at all, since a summary hit is shown as its raw turn when that fits anyway).
    pub raw_weight_when_covered: f32,
    /// How much the tier score adds to relevance when ranking recall candidates.
    pub tier_score_blend: f32,
    /// Hits below this share of the best hit's score are not injected.
    pub min_relative_score: f32,
    /// Candidates `prefetch` returns at most.
    pub prefetch_limit: usize,
    /// Pseudo-relevance feedback: the best this many raw-turn hits lend their most telling
    /// other words to a second raw-turn search (0: off). Finds evidence that shares no word with
    /// the question but shares words with the turns that do.
    pub feedback_turns: usize,
    /// Words added to the query by feedback.
    pub feedback_terms: usize,
    /// Weight of the best added word, relative to a word of the message (the others scale down).
    pub feedback_weight: f32,
}

impl Default for RetrievalConfig {
    fn default() -> Self {
        RetrievalConfig {
            mode: RetrievalMode::Hybrid,
            lexical_weight: 0.6,
            semantic_candidates: 512,
            semantic_scan_items: 2_048,
            bm25_k1: 1.2,
            bm25_b: 0.75,
            postings_per_term: 512,
            postings_per_query: 2_048,
            top_raw_turns: 24,
            top_summaries: 12,
            top_facts: 16,
            top_episodes: 4,
            top_artifacts: 2,
            neighbour_weight: 0.7,
            escalate_below_coverage: 0.6,
            raw_weight_when_covered: 1.0,
            tier_score_blend: 0.1,
            min_relative_score: 0.15,
            prefetch_limit: 96,
            feedback_turns: 6,
            feedback_terms: 96,
            feedback_weight: 0.3,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EpisodeConfig {
    /// An episode closes at this many turns.
    pub max_turns: usize,
    /// A turn joins the open episode only if its session turn follows within this many turns.
    pub max_gap_turns: u32,
    /// Once an episode has 3 turns, a turn sharing less than this share of its terms with the
    /// episode's tags starts a new episode.
    pub min_topic_overlap: f32,
    /// Salient terms of the new user message that must match an OLD episode's tags and hints
    /// for it to be rehydrated into NEW.
    pub rehydrate_min_matches: usize,
}

impl Default for EpisodeConfig {
    fn default() -> Self {
        EpisodeConfig {
            max_turns: 12,
            max_gap_turns: 4,
            min_topic_overlap: 0.15,
            rehydrate_min_matches: 2,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_section_gives_defaults() {
        let config: MemoryConfig = serde_json::from_str("{}").unwrap();
        assert_eq!(config, MemoryConfig::default());
        assert_eq!(config.weights.recency, 0.40);
        assert_eq!(config.new_ttl_turns, 8);
    }

    #[test]
    fn unknown_keys_are_rejected_and_partial_sections_merge() {
        assert!(serde_json::from_str::<MemoryConfig>(r#"{"budget": 1}"#).is_err());
        let config: MemoryConfig = serde_json::from_str(
            r#"{"budget_tokens": 512, "placement": "user_prefix", "core_placement": "user_prefix",
                "weights": {"size": 0.3}}"#,
        )
        .unwrap();
        assert_eq!(config.budget_tokens, 512);
        assert_eq!(config.placement, Placement::UserPrefix);
        assert_eq!(config.core_placement, Placement::UserPrefix);
        assert_eq!(config.weights.size, 0.3);
        assert_eq!(config.weights.recency, 0.40);
    }
}
