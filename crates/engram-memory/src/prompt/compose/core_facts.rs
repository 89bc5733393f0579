//! The core block's facts: the working set (NEW and CURRENT facts by tier score), independent
//! of the question, so the block changes only when memory is updated.

use std::borrow::Cow;
use std::collections::HashSet;

use super::block::{Line, Section};
use super::{Fenced, Packing, Ranking, listed};
use crate::config::MemoryConfig;
use crate::lookups::{Lookups, ScoredFact};
use crate::model::{ItemRef, MemoryState, Tier};
use crate::prompt::explain::Reason;
use crate::score::fact_score;

/// Places the working set's facts, best first, in the current stage (core facts' part of
/// CURRENT); returns the tokens they took.
pub(super) fn pack_core_facts(
    packing: &mut Packing<'_>,
    config: &MemoryConfig,
    lookups: Option<&Lookups>,
    pinned_facts: &HashSet<ItemRef>,
) -> u32 {
    let state = packing.state;
    let room = packing.budget.stage_left;
    let rank = || ranked(state, config, lookups);
    let ranked = match lookups {
        Some(lookups) => lookups.core_facts(&config.weights, rank),
        None => Cow::Owned(rank()),
    };
    for &ScoredFact { score, index } in ranked.iter() {
        let Some(fact) = state.facts.get(index) else {
            continue;
        };
        if pinned_facts.contains(&ItemRef::Fact(fact.id)) {
            continue;
        }
        let line = Line::undated(Section::Facts, u64::from(fact.id), ItemRef::Fact(fact.id));
        let tokens = fact.tokens.get(packing.encoding);
        let ranking = Ranking {
            score,
            relevance: None,
            reason: Reason::WorkingSet,
        };
        packing.place(Fenced::Core, line, tokens, ranking);
    }
    room - packing.budget.stage_left
}

/// The working set's active facts other than hard constraints, best first.
fn ranked(
    state: &MemoryState,
    config: &MemoryConfig,
    lookups: Option<&Lookups>,
) -> Vec<ScoredFact> {
    let mut working: Vec<ScoredFact> = listed(state, lookups.map(Lookups::working_facts))
        .into_iter()
        .filter_map(|index| Some((index, state.facts.get(index)?)))
        .filter(|(_, fact)| {
            fact.active && !fact.is_hard_constraint() && fact.tier.tier != Tier::Old
        })
        .map(|(index, _)| ScoredFact {
            score: fact_score(state, &config.weights, index),
            index,
        })
        .collect();
    // Indexes are distinct: a total order, which an unstable sort gives as a stable one would.
    working.sort_unstable_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
    working
}
