//! The memory engine: pure functions from (memory state, input) to (new state, rewritten
//! prompt). No I/O, no clock, no async: the proxy and the storage layer pass time and turn
//! numbers in and persist the state themselves.

pub mod config;
pub mod depth;
pub mod diff;
pub mod extract;
pub mod fence;
pub mod history;
pub mod manifest;
pub mod model;
pub mod record;
pub mod render;
pub mod score;
pub mod text;
pub mod tiers;
pub mod tokens;
