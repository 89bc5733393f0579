//! The memory engine: pure functions from (memory state, input) to (new state, rewritten
//! prompt). No I/O, no clock, no async: the proxy and the storage layer pass time and turn
//! numbers in and persist the state themselves.
//!
//! Update path (worker): `record_exchange` → `MemoryIndex::refresh` → `prefetch`.
//! Hot path (per request): `compose` with the cached index and the prefetched candidates.

pub mod bpe;
pub mod budget;
pub mod compose;
pub mod config;
pub mod depth;
pub mod diff;
pub mod embed;
mod embed_tables;
pub mod explain;
pub mod extract;
pub mod fence;
pub mod history;
pub mod index;
pub mod layered;
pub mod lookups;
pub mod manage;
pub mod manifest;
pub mod memo;
pub mod model;
pub mod record;
pub mod render;
pub mod retrieve;
pub mod score;
pub mod segmented;
pub mod shape;
pub mod text;
pub mod tiers;
pub mod tokens;

pub use budget::{Budgets, budgets_from_total};
pub use compose::{ComposeRequest, Composition, MemoryOutcome, compose};
pub use config::{MemoryConfig, Placement, ScoringWeights};
pub use diff::{DiffReport, FactDiff, FactEdit, apply_diff};
pub use explain::{Block, BlockTokens, ClientMode, Explain, ExplainedItem, Reason};
pub use extract::{Extraction, Extractor, HeuristicExtractor, Precomputed};
pub use fence::strip_fences;
pub use index::MemoryIndex;
pub use model::{CandidateId, ItemRef, MemoryState, Tier};
pub use record::{
    ConsolidationReport, ExchangeInput, RecordOutcome, consolidate, pin, pin_fact, record_exchange,
    set_identity, unpin,
};
pub use retrieve::prefetch;
pub use tiers::TierReport;
pub use tokens::{Encoding, warm_up};
