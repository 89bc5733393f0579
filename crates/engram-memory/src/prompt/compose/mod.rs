//! The hot path: rewrite a chat request with budgeted memory (DESIGN.md §5).
//!
//! ```text
//! [client system messages, verbatim]               static prefix, cacheable
//! [core block: identity, hard constraints, pinned, known facts]   changes only on update
//! [raw window turns | the client's own last N turns]
//! [recall block: retrieved facts, dated turns, episodes, artifacts]   next to the question
//! [latest user message]
//! ```
//!
//! Packing order, all charged against one budget so the blocks always fit: reserved items
//! (hard constraints, pinned, identity) first; then the rest is split NEW / CURRENT / OLD; core
//! facts take part of CURRENT; the raw window takes NEW (dropping old turns to summaries when it
//! overflows); recall takes the rest of CURRENT, NEW's leftover and OLD (old raw turns are OLD-tier
//! content), each turn once in the fullest form that fits; episode manifests take what recall
//! left. Only stored token counts are added here; nothing is tokenized.
//!
//! One packer per block, in that order, each adding to the shared `Packing`: `reserved`,
//! `core_facts`, `window` (with the recent context's summaries), `recall`, `episodes`; then
//! `guard` checks the total and `assemble` writes the messages.

mod assemble;
mod block;
mod core_facts;
mod episodes;
mod explained;
mod guard;
mod recall;
mod reserved;
#[cfg(test)]
mod tests;
mod window;

use std::collections::{BTreeSet, HashSet};

use rustc_hash::FxBuildHasher;
use serde::{Deserialize, Serialize};

use self::assemble::assemble;
use self::block::{BlockPlan, Line};
use self::core_facts::pack_core_facts;
use self::episodes::pack_episodes;
use self::explained::explained;
use self::guard::fit_budget;
use self::recall::{left_out, pack_recall, rank_hits};
use self::reserved::pack_reserved;
use self::window::{WindowPlan, pack_recent_context, pack_window};
use super::budget::{Packer, budgets_from_total};
use super::explain::{Block, BlockTokens, Explain, ExplainedItem, Form, Reason};
use super::history::{RequestShape, request_shape};
use super::render::Fixed;
use crate::config::{MemoryConfig, Placement};
use crate::fence::strip_fences;
use crate::index::MemoryIndex;
use crate::model::{CandidateId, ExchangeInput, FactId, ItemRef, MemoryState};
use crate::openai::{ChatMessage, OutgoingMessage};
use crate::retrieve::retrieve_unordered;
use crate::text::excerpt;
use crate::tokens::Encoding;

/// What the proxy knows about the request being rewritten.
#[derive(Debug, Clone, Copy)]
pub struct ComposeRequest<'a> {
    pub session_id: &'a str,
    pub messages: &'a [ChatMessage],
    pub model: &'a str,
    /// The session's recorded exchanges the memory does not hold yet, oldest first
    /// (`engram_store::HotRecord::unapplied`): the newest turns of a stateless client's raw
    /// window, so a follow-up sees the previous exchange before the worker has applied it.
    pub unapplied: &'a [ExchangeInput],
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryOutcome {
    Injected,
    /// Nothing to inject (empty memory, or no room at all).
    Empty,
    /// Identity, hard constraints and pinned items alone exceed the budget; what fit was
    /// injected and the blocks still fit.
    ReservedOverBudget,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Composition {
    /// The prompt to send: the client's messages (by index, forwarded as sent) and engram's.
    pub messages: Vec<OutgoingMessage>,
    pub tokens: BlockTokens,
    /// Items injected.
    pub items: usize,
    pub outcome: MemoryOutcome,
    pub explain: Explain,
    /// Chain link of the client's earlier conversation: pass it as `ExchangeInput::prior_chain`
    /// when recording this exchange.
    pub prior_chain: u64,
    /// Items retrieval ranked for the latest user message, and how many of them were injected.
    pub retrieval_candidates: usize,
    pub retrieval_hits: usize,
}

impl Composition {
    /// The composed prompt as messages, the client's own looked up in `client` (the request's
    /// messages, as given to [`compose`]).
    pub fn prompt<'a>(&'a self, client: &'a [ChatMessage]) -> Vec<&'a ChatMessage> {
        self.messages
            .iter()
            .filter_map(|message| message.resolve(client))
            .collect()
    }
}

/// The latest user message is searched by at most this much of it (head and tail).
const QUERY_MAX_BYTES: usize = 4096;

/// A fenced block a packer adds lines to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fenced {
    Core,
    Recall,
}

impl Fenced {
    fn block(self) -> Block {
        match self {
            Fenced::Core => Block::Core,
            Fenced::Recall => Block::Recall,
        }
    }
}

/// How an item ranked and why it was chosen, as its explanation states them.
#[derive(Debug, Clone, Copy)]
struct Ranking {
    score: f32,
    /// Retrieval's relevance, for a recall hit.
    relevance: Option<f32>,
    reason: Reason,
}

/// What the packers share: the budget left, each block as placed so far, what the prompt
/// shows already, and the explanation being built (one entry per item, in placing order).
struct Packing<'a> {
    state: &'a MemoryState,
    encoding: Encoding,
    /// Tokens left in the whole budget and in the stage being packed.
    budget: Packer,
    core: BlockPlan<'a>,
    window: WindowPlan,
    recall: BlockPlan<'a>,
    /// Items the prompt carries already (core lines, pinned facts, turns the window or the
    /// client's messages hold, recent context): recall does not show them again.
    /// Hashed with Fx: a request looks up a few hundred items in it (SipHash was 1–2 % of
    /// compose), and nothing iterates it in an order that shows.
    in_prompt: HashSet<ItemRef, FxBuildHasher>,
    explained: Vec<ExplainedItem>,
}

impl<'a> Packing<'a> {
    fn new(
        state: &'a MemoryState,
        encoding: Encoding,
        config: &MemoryConfig,
        core_prefixed: bool,
    ) -> Packing<'a> {
        let overhead = config.message_overhead_tokens;
        // A prefix block owns the blank line after it; a block of its own pays a message.
        let core_fixed = Fixed::CoreOpen.tokens(encoding)
            + Fixed::CorePreamble.tokens(encoding)
            + if core_prefixed {
                Fixed::ClosePrefix.tokens(encoding)
            } else {
                Fixed::Close.tokens(encoding) + overhead
            };
        let recall_fixed = Fixed::RecallOpen.tokens(encoding)
            + Fixed::RecallPreamble.tokens(encoding)
            + match config.placement {
                Placement::System => Fixed::Close.tokens(encoding) + overhead,
                Placement::UserPrefix => Fixed::ClosePrefix.tokens(encoding),
            };
        Packing {
            state,
            encoding,
            budget: Packer::new(config.budget_tokens),
            core: BlockPlan::new(core_fixed),
            window: WindowPlan::default(),
            recall: BlockPlan::new(recall_fixed),
            in_prompt: HashSet::default(),
            explained: Vec::new(),
        }
    }

    /// Adds `line` to `block` if what it costs fits the stage, and explains it.
    fn place(&mut self, block: Fenced, line: Line<'a>, tokens: u32, ranking: Ranking) -> bool {
        let plan = match block {
            Fenced::Core => &mut self.core,
            Fenced::Recall => &mut self.recall,
        };
        if !plan.try_add(&mut self.budget, line, tokens, self.encoding) {
            return false;
        }
        self.explain(line.item, line.form, block.block(), tokens, ranking);
        true
    }

    /// Adds `item`'s entry to the explanation.
    fn explain(&mut self, item: ItemRef, form: Form, block: Block, tokens: u32, ranking: Ranking) {
        let entry = explained(self.state, item, form, block, tokens, ranking);
        self.explained.push(entry);
    }
}

/// The facts `list` names, or every fact when the lookups are not current; each is checked
/// by its caller either way.
fn listed(state: &MemoryState, list: Option<&BTreeSet<FactId>>) -> Vec<usize> {
    match list {
        Some(ids) => ids.iter().map(|id| *id as usize).collect(),
        None => (0..state.facts.len()).collect(),
    }
}

/// Rewrites `request.messages` with memory from `state`. `index` should be built from the same
/// state (a stale one only finds less); `prefetched` are the candidates `prefetch` computed
/// after the previous turn.
pub fn compose(
    state: &MemoryState,
    index: &MemoryIndex,
    prefetched: &[CandidateId],
    request: &ComposeRequest<'_>,
    config: &MemoryConfig,
) -> Composition {
    let encoding = Encoding::for_model(request.model);
    let shape = request_shape(request.messages);
    let core_prefixed = core_is_prefix(config.core_placement, &shape);
    let mut packing = Packing::new(state, encoding, config, core_prefixed);

    // Reserved items first, against the whole budget; what they leave is split into shares.
    // Through the lookups when they are current (a cached memory's are), so that a request's
    // cost does not grow with the user's facts.
    let lookups = state.lookups.is_current(state).then_some(&state.lookups);
    let reserved = pack_reserved(&mut packing, lookups);
    let reserved_tokens = config.budget_tokens - packing.budget.total_left;
    let budgets = budgets_from_total(
        packing.budget.total_left,
        config.new_fraction,
        config.current_fraction,
    );

    // Core facts: the working set, query-independent, in their part of CURRENT.
    let core_fact_limit = (budgets.current as f32 * config.core_fact_share.clamp(0.0, 1.0)) as u32;
    packing.budget.stage(core_fact_limit);
    let core_facts_used = pack_core_facts(&mut packing, config, lookups, &reserved.pinned_facts);

    // NEW: the raw window (stateless) or the client's own recent turns, then summaries of the
    // turns just before them. Nothing the core block shows is recalled again.
    packing
        .in_prompt
        .extend(packing.core.lines.iter().map(|line| line.item));
    packing.in_prompt.extend(reserved.pinned_facts);
    packing.budget.stage(budgets.new);
    let conversation = pack_window(&mut packing, request, index, &shape, config);
    pack_recent_context(&mut packing, &conversation.recent_context);
    let new_left = packing.budget.stage_left;

    // CURRENT: recall for the latest user message. A pasted document is searched by its two
    // ends: scoring every word of a 1 MB message against the index cost milliseconds on the
    // hot path.
    let query = shape
        .last_user
        .and_then(|at| request.messages.get(at))
        .map(|message| strip_fences(&excerpt(&message.text_borrowed(), QUERY_MAX_BYTES)))
        .unwrap_or_default();
    let retrieval = if shape.last_user.is_some() {
        retrieve_unordered(state, index, &query, prefetched, &config.retrieval)
    } else {
        Default::default()
    };
    let ranked = rank_hits(&packing, config, &retrieval.hits);
    // The OLD share pays for OLD-tier content too: the raw turns recall finds there (most of
    // an old conversation's evidence) come before the manifests that index them.
    packing.budget.stage(
        budgets
            .current
            .saturating_sub(core_facts_used)
            .saturating_add(new_left)
            .saturating_add(budgets.old),
    );
    pack_recall(&mut packing, &ranked);

    // OLD: episode manifests, in what recall left.
    packing.budget.stage(packing.budget.total_left);
    pack_episodes(&mut packing, &ranked);
    let left_out = left_out(&packing, &ranked);

    let guarded = fit_budget(&mut packing, config.budget_tokens);
    let messages = assemble(&packing, request, &shape, conversation.keep_from, config);
    let items = packing.explained.len() + packing.window.unapplied_shown.len();
    let outcome = if reserved.over_budget {
        MemoryOutcome::ReservedOverBudget
    } else if items == 0 {
        MemoryOutcome::Empty
    } else {
        MemoryOutcome::Injected
    };
    let retrieval_hits = packing
        .explained
        .iter()
        .filter(|item| matches!(item.reason, Reason::Retrieved { .. }))
        .count();
    Composition {
        messages,
        tokens: guarded.tokens,
        items,
        outcome,
        retrieval_candidates: retrieval.hits.len(),
        retrieval_hits,
        explain: Explain {
            encoding,
            budgets,
            reserved_tokens,
            tokens: guarded.tokens,
            client_mode: conversation.client_mode,
            coverage: retrieval.coverage,
            escalated: retrieval.escalated,
            items: packing.explained,
            unapplied_turns: packing.window.unapplied_shown,
            left_out,
            guard_trimmed: guarded.trimmed,
            origin: state.origin(),
        },
        prior_chain: shape.prior_chain,
    }
}

/// Whether the core block prefixes a user message: with `core_placement: user_prefix`, when
/// the request has a user message (the prompt's first user message is then at the latest this
/// one).
fn core_is_prefix(placement: Placement, shape: &RequestShape) -> bool {
    placement == Placement::UserPrefix && shape.last_user.is_some()
}
