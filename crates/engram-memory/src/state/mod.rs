//! The memory's data: the per-user state, its layered and chunked containers, the lookups
//! derived from its items, and the per-thread memo of pure text functions.

pub mod layered;
pub mod lookups;
pub mod memo;
pub mod model;
pub mod segmented;
