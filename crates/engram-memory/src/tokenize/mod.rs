//! Words and tokens: text helpers (word tokenising, stemming, clipping, excerpts), fenced code
//! and engram's own fences in text, the per-thread memo of pure text functions, and token
//! counting with tiktoken's vocabularies through the compact BPE counter.

pub mod bpe;
pub mod code;
pub mod fence;
pub mod memo;
pub mod text;
pub mod tokens;
