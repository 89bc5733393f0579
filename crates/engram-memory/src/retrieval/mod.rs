//! Finding what is relevant: the lexical index over a memory's items, the static embeddings,
//! seed 000's item score, and retrieval for the hot path and prefetch for the update path.

pub mod embed;
mod embed_tables;
pub mod index;
pub mod retrieve;
pub mod score;
