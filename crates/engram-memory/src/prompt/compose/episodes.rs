//! OLD: episode manifests, in what recall left of the budget.

use super::block::{Line, Section};
use super::recall::RankedHit;
use super::{Fenced, Packing};
use crate::model::ItemRef;

/// Places the ranked episode hits, best first, in the recall block.
pub(super) fn pack_episodes(packing: &mut Packing<'_>, ranked: &[RankedHit]) {
    for hit in ranked {
        let ItemRef::Episode(id) = hit.item else {
            continue;
        };
        let Some(episode) = packing.state.episodes.get(id as usize) else {
            continue;
        };
        let line = Line::undated(Section::Episodes, u64::from(id), hit.item);
        let tokens = episode.tokens.get(packing.encoding);
        packing.place(Fenced::Recall, line, tokens, hit.ranking);
    }
}
