//! The update path: recording an exchange (extraction, base-truth diffs, size-adaptive depth,
//! tier maintenance, episode manifests).

pub mod depth;
pub mod diff;
pub mod extract;
pub mod manifest;
pub mod patterns;
pub mod record;
pub mod tiers;
