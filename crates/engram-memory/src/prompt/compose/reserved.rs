//! The reserved items: hard constraints, pinned items and identity, in the core block before
//! anything else and against the whole budget.

use std::collections::HashSet;

use super::block::{Line, Section};
use super::{Fenced, Packing, Ranking, listed};
use crate::lookups::Lookups;
use crate::model::{ItemRef, PinContent};
use crate::prompt::explain::Reason;

/// What packing the reserved items leaves to the packers after it.
pub(super) struct Reserved {
    /// Facts a pin shows: not shown again among the core facts, nor recalled.
    pub(super) pinned_facts: HashSet<ItemRef>,
    /// A reserved item did not fit.
    pub(super) over_budget: bool,
}

/// A reserved item's line, before it is placed.
struct ReservedLine {
    section: Section,
    item: ItemRef,
    tokens: u32,
    reason: Reason,
}

/// Places the reserved items in the core block, in order: hard constraints (most important
/// first), pins, identity.
pub(super) fn pack_reserved(packing: &mut Packing<'_>, lookups: Option<&Lookups>) -> Reserved {
    let state = packing.state;
    let encoding = packing.encoding;
    let mut reserved: Vec<ReservedLine> = Vec::new();
    let mut constraints: Vec<_> = listed(state, lookups.map(Lookups::hard_constraints))
        .into_iter()
        .filter_map(|index| state.facts.get(index))
        .filter(|fact| fact.active && fact.is_hard_constraint())
        .collect();
    constraints.sort_by(|a, b| b.importance.total_cmp(&a.importance).then(a.id.cmp(&b.id)));
    for fact in constraints {
        reserved.push(ReservedLine {
            section: Section::Constraints,
            item: ItemRef::Fact(fact.id),
            tokens: fact.tokens.get(encoding),
            reason: Reason::HardConstraint,
        });
    }
    // A pin of a fact shows the fact's current revision, once: not again for a second pin of
    // it, nor beside its hard-constraint line, nor among the other facts.
    let mut pinned_facts: HashSet<ItemRef> = HashSet::new();
    for pin in state.pinned.iter().filter(|pin| pin.active) {
        let content = state.pin_content(pin);
        match content {
            PinContent::Text(_) => {}
            PinContent::Fact(fact) => {
                if !pinned_facts.insert(ItemRef::Fact(fact.id)) || fact.is_hard_constraint() {
                    continue;
                }
            }
            PinContent::Nothing => continue,
        }
        reserved.push(ReservedLine {
            section: Section::Pinned,
            item: ItemRef::Pinned(pin.id),
            tokens: content.tokens().get(encoding),
            reason: Reason::Pinned,
        });
    }
    if let Some(identity) = &state.identity {
        reserved.push(ReservedLine {
            section: Section::Identity,
            item: ItemRef::Identity,
            tokens: identity.tokens.get(encoding),
            reason: Reason::Identity,
        });
    }
    let mut over_budget = false;
    // In the order reserved, whatever their section: the block sorts its lines by section.
    for (order, reserved) in (1u64..).zip(reserved) {
        let line = Line::undated(reserved.section, order, reserved.item);
        let ranking = Ranking {
            score: 1.0,
            relevance: None,
            reason: reserved.reason,
        };
        if !packing.place(Fenced::Core, line, reserved.tokens, ranking) {
            over_budget = true;
        }
    }
    Reserved {
        pinned_facts,
        over_budget,
    }
}
