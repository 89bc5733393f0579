//! The memory's data: the per-user state, its layered and chunked containers, the lookups
//! derived from its items, and the hashes that recognise an exchange.

pub mod chain;
pub mod layered;
pub mod lookups;
pub mod model;
pub mod segmented;
