//! What a composition injected and why: every item, its block, tier, score, tokens, reason and
//! provenance. Serialisable, for the management API's "explain a turn".

use serde::{Deserialize, Serialize};

use super::budget::Budgets;
use crate::model::{ItemRef, MemoryState, Tier, TurnSeq};
use crate::retrieve::HitSource;
use crate::tokens::Encoding;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Block {
    Core,
    /// Raw turns the engine supplied as chat messages.
    Window,
    Recall,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "why", rename_all = "snake_case")]
pub enum Reason {
    Identity,
    HardConstraint,
    Pinned,
    /// A NEW or CURRENT fact, packed by tier score.
    WorkingSet,
    /// One of the session's last raw turns.
    RawWindow,
    /// A summary of a session turn just older than the window (or of a replaced client turn).
    RecentContext,
    Retrieved {
        source: HitSource,
    },
}

/// How an item was rendered.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Form {
    Full,
    /// A long raw turn cut to its first words per side.
    Clipped,
    /// An artifact too long to include, named so the model knows it exists.
    Reference,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ExplainedItem {
    pub item: ItemRef,
    pub block: Block,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tier: Option<Tier>,
    /// The ranking score: tier score for core items, relevance + blended tier score for recall.
    pub score: f32,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub relevance: Option<f32>,
    pub tokens: u32,
    pub reason: Reason,
    pub form: Form,
    /// The raw turns the item comes from, by sequence number, as composed. A turn's number
    /// keeps naming it while the memory lives (the raw log only grows; a forget drops this
    /// process's explanations with the memory, and [`Explain::origin`] tells another
    /// replica's memory begun again), so the hot path keeps these and
    /// [`Explain::name_turns`] looks their ids up when the explanation is read: copying each
    /// placed fact's (up to 16) ids was 8 % of compose at 20,000 turns.
    #[serde(skip)]
    pub provenance_turns: Vec<TurnSeq>,
    /// The ids of `provenance_turns`, once [`Explain::name_turns`] has named them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub provenance: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
}

/// How the client sent its conversation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "mode", rename_all = "snake_case")]
pub enum ClientMode {
    /// Only the new message: the engine supplied the raw window.
    Stateless,
    /// The whole conversation: `recognised` leading exchanges matched recorded turns, of which
    /// the `replaced` oldest were dropped in favour of memory.
    FullHistory {
        resent: usize,
        recognised: usize,
        replaced: usize,
    },
    /// No user message to answer (nothing recalled).
    NoUserMessage,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockTokens {
    pub core: u32,
    pub window: u32,
    pub recall: u32,
    pub total: u32,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Explain {
    pub encoding: Encoding,
    /// Shares of what was left after the reserved items.
    pub budgets: Budgets,
    pub reserved_tokens: u32,
    pub tokens: BlockTokens,
    pub client_mode: ClientMode,
    pub coverage: f32,
    pub escalated: bool,
    pub items: Vec<ExplainedItem>,
    /// Turn ids of recorded exchanges the worker had not applied yet, shown in the raw window.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unapplied_turns: Vec<String>,
    /// Candidates that ranked but did not fit (at most 16, best first).
    pub left_out: Vec<ItemRef>,
    /// The final guard had to drop a block (a packing bug if it ever shows up).
    pub guard_trimmed: bool,
    /// Which memory the provenance turns' numbers belong to ([`MemoryState::origin`]): a
    /// memory forgotten and begun again under the same user numbers its turns from 0 again,
    /// and a forget on another replica does not reach this process's explanations.
    #[serde(skip)]
    pub origin: u64,
}

/// What [`Explain::name_turns`] found of an explanation's provenance turns.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provenance {
    /// Every turn cited is named (or none is cited).
    Named,
    /// Some are left out: the memory read is a version older than the one composed from.
    Partial,
    /// None is named: the memory composed from has been forgotten since (nothing is stored,
    /// or a memory begun again under the same user numbers other turns the same).
    Forgotten,
}

impl Explain {
    /// Names each item's provenance turns by their ids in `state` (the memory composed from,
    /// or any later version of it), and says what it found: a turn `state` does not hold yet
    /// (an older version) is left out, and so is every turn when `state` is another memory
    /// (the one composed from was forgotten since; an empty `state` when nothing is stored).
    pub fn name_turns(&mut self, state: &MemoryState) -> Provenance {
        // Another memory holds none of the turns composed from.
        let same_memory = self.origin == state.origin();
        let (mut cited, mut found) = (0usize, 0usize);
        for item in &mut self.items {
            item.provenance = item
                .provenance_turns
                .iter()
                .filter_map(|seq| {
                    let id = same_memory
                        .then(|| state.turn_id(*seq))
                        .flatten()
                        .map(str::to_owned);
                    cited += 1;
                    found += usize::from(id.is_some());
                    id
                })
                .collect();
        }
        match (found == cited, same_memory) {
            (true, _) => Provenance::Named,
            (false, true) => Provenance::Partial,
            (false, false) => Provenance::Forgotten,
        }
    }
}
