//! An explanation entry for an item placed: its tier, score, tokens, reason and provenance.

use super::Ranking;
use crate::model::{ItemRef, MemoryState, PinContent, Tier, TurnSeq};
use crate::prompt::explain::{Block, ExplainedItem, Form};

fn item_tier(state: &MemoryState, item: ItemRef) -> Option<Tier> {
    match item {
        ItemRef::Fact(id) => state.fact(id).map(|fact| fact.tier.tier),
        ItemRef::Summary(seq) | ItemRef::RawTurn(seq) => state
            .turn_log
            .get(seq as usize)
            .map(|entry| entry.tier.tier),
        ItemRef::Episode(_) => Some(Tier::Old),
        _ => None,
    }
}

fn provenance(state: &MemoryState, item: ItemRef) -> (Vec<TurnSeq>, Option<String>) {
    match item {
        ItemRef::Fact(id) => state
            .fact(id)
            .map(|fact| (fact.provenance.clone(), fact.date.clone()))
            .unwrap_or_default(),
        ItemRef::Summary(seq) | ItemRef::RawTurn(seq) => (vec![seq], state.turn_date(seq)),
        ItemRef::Episode(id) => state
            .episodes
            .get(id as usize)
            .map(|episode| (episode.links.clone(), episode.date_range.1.clone()))
            .unwrap_or_default(),
        ItemRef::Artifact(id) => state
            .artifacts
            .get(id as usize)
            .map(|artifact| (vec![artifact.turn], state.turn_date(artifact.turn)))
            .unwrap_or_default(),
        ItemRef::Pinned(id) => match state
            .pinned
            .get(id as usize)
            .map(|pin| state.pin_content(pin))
        {
            Some(PinContent::Fact(fact)) => provenance(state, ItemRef::Fact(fact.id)),
            _ => (Vec::new(), None),
        },
        ItemRef::Identity => (Vec::new(), None),
    }
}

pub(super) fn explained(
    state: &MemoryState,
    item: ItemRef,
    form: Form,
    block: Block,
    tokens: u32,
    ranking: Ranking,
) -> ExplainedItem {
    let (turns, date) = provenance(state, item);
    ExplainedItem {
        item,
        block,
        tier: item_tier(state, item),
        score: ranking.score,
        relevance: ranking.relevance,
        tokens,
        reason: ranking.reason,
        form,
        provenance_turns: turns,
        provenance: Vec::new(),
        date,
    }
}
