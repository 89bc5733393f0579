//! Words and tokens: text helpers (word tokenising, stemming, clipping, excerpts) and token
//! counting with tiktoken's vocabularies through the compact BPE counter.

pub mod bpe;
pub mod text;
pub mod tokens;
