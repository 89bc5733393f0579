//! The hot path's output: composition under budgets, the exact text of every memory line and
//! block, shapes, a resending client's recognised turns, and the explanation of what
//! was injected.

pub mod budget;
pub mod compose;
pub mod explain;
pub mod history;
pub mod render;
pub mod shape;
