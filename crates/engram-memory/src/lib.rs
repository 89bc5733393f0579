//! The memory engine: pure functions from (memory state, input) to (new state, rewritten
//! prompt). No I/O, no clock, no async: the proxy and the storage layer pass time and turn
//! numbers in and persist the state themselves.
//!
//! Update path (worker): `record_exchange` → `MemoryIndex::refresh` → `prefetch`.
//! Hot path (per request): `compose` with the cached index and the prefetched candidates.
//!
//! The crate at the bottom of the workspace: besides the engine it holds what the engine needs
//! below it, the OpenAI wire types ([`openai`]) and the update path's yield points
//! ([`yielding`]), and its own small [`Error`]. Its dependencies hold no async runtime, clock
//! or I/O (`tests/layers.rs` checks its `cargo tree` for tokio).

pub mod config;
pub mod error;
pub mod manage;
pub mod openai;
pub mod prompt;
pub mod retrieval;
pub mod state;
pub mod tokenize;
pub mod update;
pub mod yielding;

// Each module also at its path from before the folders, so `memory::compose` and the like
// still name it.
pub use prompt::{budget, compose, explain, history, render, shape};
pub use retrieval::{embed, index, retrieve, score};
pub use state::{chain, layered, lookups, model, segmented};
pub use tokenize::{bpe, code, fence, memo, text, tokens};
pub use update::{depth, diff, extract, manifest, record, tiers};

pub use budget::{Budgets, budgets_from_total};
pub use compose::{ComposeRequest, Composition, MemoryOutcome, compose};
pub use config::{MemoryConfig, Placement, ScoringWeights};
pub use diff::{DiffReport, FactDiff, FactEdit, apply_diff};
pub use error::Error;
pub use explain::{Block, BlockTokens, ClientMode, Explain, ExplainedItem, Provenance, Reason};
pub use extract::{Extraction, Extractor, HeuristicExtractor, Precomputed};
pub use fence::strip_fences;
pub use index::MemoryIndex;
pub use model::{CandidateId, ExchangeInput, ItemRef, MemoryState, Tier};
pub use record::{
    ConsolidationReport, RecordOutcome, consolidate, pin, pin_fact, record_exchange, set_identity,
    unpin,
};
pub use retrieve::prefetch;
pub use tiers::TierReport;
pub use tokens::Encoding;

/// Loads both encodings (a few hundred milliseconds, once per process), the counts of
/// engram's fixed block text and the extractor's tables, so the first request does not pay
/// for them (and a table that does not parse is logged at start-up). Call at start-up.
pub fn warm_up() {
    tokens::warm_up();
    render::warm_up_fixed();
    update::patterns::patterns();
}
