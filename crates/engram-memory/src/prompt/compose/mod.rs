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

mod assemble;
mod block;
mod explained;

use std::collections::{BTreeSet, HashMap, HashSet};

use serde::{Deserialize, Serialize};

use self::assemble::assemble;
use self::block::{BlockPlan, Line, Section, dated, overlaps, shows};
use self::explained::explained;

use super::budget::{Packer, budgets_from_total};
use super::explain::{Block, BlockTokens, ClientMode, Explain, ExplainedItem, Form, Reason};
use super::fence::strip_fences;
use super::history::{answer_words, request_shape};
use super::render::Fixed;
use crate::config::{MemoryConfig, Placement};
use crate::depth::code_blocks;
use crate::index::MemoryIndex;
use crate::lookups::Lookups;
use crate::model::{
    ArtifactKind, CandidateId, Depth, FactId, ItemRef, MemoryState, PinContent, Tier, TurnSeq,
};
use crate::openai::{ChatMessage, OutgoingMessage};
use crate::record::ExchangeInput;
use crate::retrieve::retrieve;
use crate::score::{fact_score, summary_score};
use crate::text::excerpt;
use crate::tokens::Encoding;

/// What the proxy knows about the request being rewritten.
#[derive(Debug, Clone, Copy)]
pub struct ComposeRequest<'a> {
    pub session_id: &'a str,
    pub messages: &'a [ChatMessage],
    pub model: &'a str,
    /// The session's recorded exchanges the memory does not hold yet, oldest first
    /// (the sidecar's `store::HotRecord::unapplied`): the newest turns of a stateless client's raw
    /// window, so a follow-up sees the previous exchange before the worker has applied it.
    pub unapplied: &'a [ExchangeInput],
}

/// A turn of the raw window: stored in the memory, or recorded and not applied yet (an index
/// into [`ComposeRequest::unapplied`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum WindowTurn {
    Stored(TurnSeq),
    Unapplied(usize),
}

/// An unapplied exchange's text is counted exactly up to this size; a longer one is charged
/// its byte length (never fewer than its tokens), which keeps the hot path from tokenizing a
/// pasted document. It rarely fits the raw window either way.
const UNAPPLIED_COUNT_BYTES: usize = 16 * 1024;

fn unapplied_tokens(encoding: Encoding, text: &str) -> u32 {
    if text.len() > UNAPPLIED_COUNT_BYTES {
        u32::try_from(text.len()).unwrap_or(u32::MAX)
    } else {
        crate::tokens::count_in(encoding, text)
    }
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

/// The group a hit's relevance is compared within for the relative cutoff: facts, turns (raw
/// or summarised), episodes, artifacts.
fn cutoff_kind(item: ItemRef) -> usize {
    match item {
        ItemRef::RawTurn(_) | ItemRef::Summary(_) => 1,
        ItemRef::Episode(_) => 2,
        ItemRef::Artifact(_) => 3,
        _ => 0,
    }
}

/// A retrieval hit that passed the cutoffs, and how it ranks for recall.
#[derive(Debug, Clone, Copy)]
struct RankedHit {
    item: ItemRef,
    ranking: Ranking,
}

/// How an item ranked and why it was chosen, as its explanation states them.
#[derive(Debug, Clone, Copy)]
struct Ranking {
    score: f32,
    /// Retrieval's relevance, for a recall hit.
    relevance: Option<f32>,
    reason: Reason,
}

/// Packs ranked recall candidates (episodes excepted) that are not shown yet, each in the first
/// of its forms that fits.
fn pack_recall<'a>(
    state: &'a MemoryState,
    ranked: &[RankedHit],
    recall: &mut BlockPlan<'a>,
    packer: &mut Packer,
    encoding: Encoding,
    explain_items: &mut Vec<ExplainedItem>,
) {
    for hit in ranked {
        if matches!(hit.item, ItemRef::Episode(_)) || shows(state, recall, hit.item) {
            continue;
        }
        for option in render_options(state, hit.item, encoding) {
            let line = option.line(state, encoding);
            if recall.contains(line.item) || overlaps(state, recall, &line) {
                continue;
            }
            // A turn already shown as its summary (the recent context) is shown once: its raw
            // line takes the summary's place when the difference fits.
            if let ItemRef::RawTurn(seq) = line.item
                && recall.contains(ItemRef::Summary(seq))
            {
                if recall.replace(packer, ItemRef::Summary(seq), line, option.tokens) {
                    let upgraded = explained(
                        state,
                        line.item,
                        line.form,
                        Block::Recall,
                        option.tokens,
                        hit.ranking,
                    );
                    match explain_items
                        .iter_mut()
                        .find(|entry| entry.item == ItemRef::Summary(seq))
                    {
                        Some(entry) => *entry = upgraded,
                        None => explain_items.push(upgraded),
                    }
                    break;
                }
                continue;
            }
            if recall.try_add(packer, line, option.tokens, encoding) {
                explain_items.push(explained(
                    state,
                    line.item,
                    line.form,
                    Block::Recall,
                    option.tokens,
                    hit.ranking,
                ));
                break;
            }
        }
    }
}

/// What a turn the prompt carries as messages stands for: its raw line, its summary and the
/// artifacts those messages show, none of which recall shows again. The client's own messages
/// carry all of a turn; the raw window leaves an agent's tool calls and results out
/// (`history::answer_words`), so code in those stays for recall.
fn carried_items(state: &MemoryState, seq: TurnSeq, in_window: bool) -> Vec<ItemRef> {
    let mut items = vec![ItemRef::RawTurn(seq), ItemRef::Summary(seq)];
    let (Some(entry), Some(turn)) = (
        state.turn_log.get(seq as usize),
        state.raw_turns.get(seq as usize),
    ) else {
        return items;
    };
    if entry.artifacts.is_empty() {
        return items;
    }
    let shown: Vec<String> = if in_window {
        code_blocks(&turn.user)
            .into_iter()
            .chain(code_blocks(&answer_words(&turn.assistant)))
            .map(|(_, code)| code)
            .collect()
    } else {
        Vec::new()
    };
    for id in &entry.artifacts {
        let carried = state.artifacts.get(*id as usize).is_some_and(|artifact| {
            !in_window || artifact.kind == ArtifactKind::Draft || shown.contains(&artifact.content)
        });
        if carried {
            items.push(ItemRef::Artifact(*id));
        }
    }
    items
}

/// The [`pair`](crate::history::pair) hash of the exchange a raw turn or its summary
/// shows, and the turn.
fn turn_pair(state: &MemoryState, item: ItemRef) -> Option<(u64, TurnSeq)> {
    let (ItemRef::RawTurn(seq) | ItemRef::Summary(seq)) = item else {
        return None;
    };
    state
        .raw_turns
        .get(seq as usize)
        .map(|turn| (turn.pair(), seq))
}

/// A reserved item's line, before it is placed.
struct ReservedLine {
    section: Section,
    item: ItemRef,
    tokens: u32,
    reason: Reason,
}

/// A working-set fact and its tier score.
struct ScoredFact {
    score: f32,
    /// Its position in `MemoryState::facts`.
    index: usize,
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
    let overhead = config.message_overhead_tokens;
    let shape = request_shape(request.messages);
    let mut packer = Packer::new(config.budget_tokens);
    let mut explain_items: Vec<ExplainedItem> = Vec::new();

    // ---- reserved: hard constraints, pinned, identity ----
    // A prefix block owns the blank line after it; a block of its own pays a message.
    let core_prefixed = core_is_prefix(config.core_placement, &shape);
    let core_fixed = Fixed::CoreOpen.tokens(encoding)
        + Fixed::CorePreamble.tokens(encoding)
        + if core_prefixed {
            Fixed::ClosePrefix.tokens(encoding)
        } else {
            Fixed::Close.tokens(encoding) + overhead
        };
    let mut core = BlockPlan::new(core_fixed);
    let mut reserved_over_budget = false;
    let mut order = 0u64;
    let mut reserved: Vec<ReservedLine> = Vec::new();
    // Through the lookups when they are current (a cached memory's are), so that a request's
    // cost does not grow with the user's facts; each fact is checked either way.
    let lookups = state.lookups.is_current(state).then_some(&state.lookups);
    let listed = |list: Option<&BTreeSet<FactId>>| -> Vec<usize> {
        match list {
            Some(ids) => ids.iter().map(|id| *id as usize).collect(),
            None => (0..state.facts.len()).collect(),
        }
    };
    let mut constraints: Vec<_> = listed(lookups.map(Lookups::hard_constraints))
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
    let mut pinned_sources: HashSet<ItemRef> = HashSet::new();
    for pin in state.pinned.iter().filter(|pin| pin.active) {
        let content = state.pin_content(pin);
        match content {
            PinContent::Text(_) => {}
            PinContent::Fact(fact) => {
                if !pinned_sources.insert(ItemRef::Fact(fact.id)) || fact.is_hard_constraint() {
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
    for reserved in reserved {
        order += 1;
        let line = Line {
            section: reserved.section,
            order,
            item: reserved.item,
            form: Form::Full,
            date: None,
        };
        if core.try_add(&mut packer, line, reserved.tokens, encoding) {
            let ranking = Ranking {
                score: 1.0,
                relevance: None,
                reason: reserved.reason,
            };
            explain_items.push(explained(
                state,
                reserved.item,
                Form::Full,
                Block::Core,
                reserved.tokens,
                ranking,
            ));
        } else {
            reserved_over_budget = true;
        }
    }
    let reserved_tokens = config.budget_tokens - packer.total_left;
    let budgets = budgets_from_total(
        packer.total_left,
        config.new_fraction,
        config.current_fraction,
    );

    // ---- core facts: the working set, query-independent ----
    let core_fact_limit = (budgets.current as f32 * config.core_fact_share.clamp(0.0, 1.0)) as u32;
    packer.stage(core_fact_limit);
    let core_fact_room = packer.stage_left;
    let mut working: Vec<ScoredFact> = listed(lookups.map(Lookups::working_facts))
        .into_iter()
        .filter_map(|index| Some((index, state.facts.get(index)?)))
        .filter(|(_, fact)| {
            fact.active
                && !fact.is_hard_constraint()
                && fact.tier.tier != Tier::Old
                && !pinned_sources.contains(&ItemRef::Fact(fact.id))
        })
        .map(|(index, _)| ScoredFact {
            score: fact_score(state, &config.weights, index),
            index,
        })
        .collect();
    working.sort_by(|a, b| b.score.total_cmp(&a.score).then(a.index.cmp(&b.index)));
    for ScoredFact { score, index } in working {
        let fact = &state.facts[index];
        let tokens = fact.tokens.get(encoding);
        let line = Line {
            section: Section::Facts,
            order: u64::from(fact.id),
            item: ItemRef::Fact(fact.id),
            form: Form::Full,
            date: None,
        };
        if core.try_add(&mut packer, line, tokens, encoding) {
            let ranking = Ranking {
                score,
                relevance: None,
                reason: Reason::WorkingSet,
            };
            explain_items.push(explained(
                state,
                line.item,
                Form::Full,
                Block::Core,
                tokens,
                ranking,
            ));
        }
    }
    let core_facts_used = core_fact_room - packer.stage_left;

    // ---- NEW: the raw window (stateless) or the client's own recent turns ----
    let recall_fixed = Fixed::RecallOpen.tokens(encoding)
        + Fixed::RecallPreamble.tokens(encoding)
        + match config.placement {
            Placement::System => Fixed::Close.tokens(encoding) + overhead,
            Placement::UserPrefix => Fixed::ClosePrefix.tokens(encoding),
        };
    let mut recall = BlockPlan::new(recall_fixed);
    let mut in_prompt: HashSet<ItemRef> = core.lines.iter().map(|line| line.item).collect();
    in_prompt.extend(pinned_sources.iter().copied());
    packer.stage(budgets.new);
    let mut window: Vec<WindowTurn> = Vec::new();
    let mut window_tokens = 0u32;
    let mut unapplied_shown: Vec<String> = Vec::new();
    let mut recent_context: Vec<TurnSeq> = Vec::new();
    let mut keep_from = shape.last_user.unwrap_or(request.messages.len());
    let client_mode = match shape.last_user {
        None => {
            keep_from = shape.system_end;
            ClientMode::NoUserMessage
        }
        Some(_) if shape.exchanges.is_empty() => {
            let session = state.session_index(request.session_id);
            let stored: Vec<TurnSeq> = match session {
                Some(session) => state
                    .session_turns_rev(session)
                    .take(config.raw_window_turns + config.new_ttl_turns as usize)
                    .collect(),
                None => Vec::new(),
            };
            // A read that raced the worker may list an exchange the memory already holds.
            let applied: HashSet<&str> = stored
                .iter()
                .filter_map(|seq| state.turn_id(*seq))
                .collect();
            let candidates = request
                .unapplied
                .iter()
                .enumerate()
                .rev()
                .filter(|(_, exchange)| {
                    let said = !(exchange.user_text.trim().is_empty()
                        && exchange.assistant_text.trim().is_empty());
                    said && !applied.contains(exchange.turn_id.as_str())
                })
                .map(|(at, _)| WindowTurn::Unapplied(at))
                .chain(stored.iter().map(|seq| WindowTurn::Stored(*seq)));
            let mut overflowed = false;
            for (age, candidate) in candidates.enumerate() {
                let seq = match candidate {
                    WindowTurn::Stored(seq) => seq,
                    WindowTurn::Unapplied(at) => {
                        // Not applied, so no summary: shown whole in the window, or not at all.
                        if age >= config.raw_window_turns || overflowed {
                            continue;
                        }
                        let exchange = &request.unapplied[at];
                        let messages = if exchange.assistant_text.is_empty() {
                            1
                        } else {
                            2
                        };
                        let cost = unapplied_tokens(encoding, &exchange.user_text)
                            .saturating_add(unapplied_tokens(encoding, &exchange.assistant_text))
                            .saturating_add(messages * overhead);
                        if packer.take(cost) {
                            window.push(candidate);
                            window_tokens += cost;
                            unapplied_shown.push(exchange.turn_id.clone());
                        } else {
                            overflowed = true;
                        }
                        continue;
                    }
                };
                let turn = &state.raw_turns[seq as usize];
                let long = matches!(turn.depth, Depth::Long | Depth::Code);
                let in_window = age < config.raw_window_turns
                    || (long && age < config.raw_window_turns + config.long_turn_extra_window);
                if !in_window || overflowed {
                    recent_context.push(seq);
                    continue;
                }
                let messages = if turn.assistant.is_empty() { 1 } else { 2 };
                let cost = turn.tokens.user.get(encoding)
                    + turn.tokens.assistant.get(encoding)
                    + messages * overhead;
                if packer.take(cost) {
                    window.push(candidate);
                    window_tokens += cost;
                    in_prompt.extend(carried_items(state, seq, true));
                    let ranking = Ranking {
                        score: 1.0,
                        relevance: None,
                        reason: Reason::RawWindow,
                    };
                    explain_items.push(explained(
                        state,
                        ItemRef::RawTurn(seq),
                        Form::Full,
                        Block::Window,
                        cost,
                        ranking,
                    ));
                } else {
                    // NEW is trimmed aggressively: this turn and older ones fall back to summaries.
                    overflowed = true;
                    recent_context.push(seq);
                }
            }
            window.reverse();
            ClientMode::Stateless
        }
        Some(_) => {
            let resent = shape.exchanges.len();
            // By the whole conversation up to it, or else by its own texts: a client that
            // trimmed the front of its history or edited a message still carries the
            // exchanges it kept, and those are never injected again.
            let carried: Vec<Option<TurnSeq>> = shape
                .exchanges
                .iter()
                .map(|exchange| {
                    index
                        .turn_for_chain(exchange.chain)
                        .or_else(|| index.turn_for_pair(exchange.pair))
                })
                .collect();
            // Only a recognised run from the first exchange on is replaced by summaries, so
            // what the client sent stays in order.
            let leading = carried.iter().take_while(|seq| seq.is_some()).count();
            let replaced = leading.min(resent.saturating_sub(config.raw_window_turns));
            if let Some(first_kept) = shape.exchanges.get(replaced) {
                keep_from = first_kept.start;
            }
            for seq in carried[replaced..].iter().flatten() {
                in_prompt.extend(carried_items(state, *seq, false));
            }
            recent_context.extend(
                carried[..replaced]
                    .iter()
                    .flatten()
                    .rev()
                    .take(config.new_ttl_turns as usize),
            );
            ClientMode::FullHistory {
                resent,
                recognised: carried.iter().flatten().count(),
                replaced,
            }
        }
    };
    // Summaries of the turns just before the window keep the thread (seed 001's turn log).
    for (age, seq) in recent_context.iter().enumerate() {
        let Some(entry) = state
            .turn_log
            .get(*seq as usize)
            .filter(|entry| !entry.erased)
        else {
            continue;
        };
        let item = ItemRef::Summary(*seq);
        if in_prompt.contains(&item) {
            continue;
        }
        let tokens = entry.tokens.get(encoding);
        let line = Line {
            section: Section::Conversation,
            order: u64::from(*seq) * 2 + 1,
            item,
            form: Form::Full,
            date: dated(state, item, encoding),
        };
        if recall.try_add(&mut packer, line, tokens, encoding) {
            in_prompt.insert(item);
            let ranking = Ranking {
                score: 1.0 - age as f32 / (recent_context.len() as f32 + 1.0),
                relevance: None,
                reason: Reason::RecentContext,
            };
            explain_items.push(explained(
                state,
                item,
                Form::Full,
                Block::Recall,
                tokens,
                ranking,
            ));
        }
    }
    let new_left = packer.stage_left;

    // ---- CURRENT: recall for the latest user message ----
    // A pasted document is searched by its two ends: scoring every word of a 1 MB message
    // against the index cost milliseconds on the hot path.
    let query = shape
        .last_user
        .and_then(|at| request.messages.get(at))
        .map(|message| strip_fences(&excerpt(&message.text_borrowed(), QUERY_MAX_BYTES)))
        .unwrap_or_default();
    let retrieval = if shape.last_user.is_some() {
        retrieve(state, index, &query, prefetched, &config.retrieval)
    } else {
        Default::default()
    };
    // Each segment is normalised on its own, so a hit is compared with the best of its kind: a
    // broad episode manifest scoring high must not cut every raw turn.
    let mut best = [0.0f32; 4];
    for hit in &retrieval.hits {
        let kind = &mut best[cutoff_kind(hit.item)];
        *kind = kind.max(hit.relevance);
    }
    // A turn whose exchange the prompt shows already as another turn, word for word, is not
    // shown again: one user's sessions that say the same things (an app replaying one script
    // per session) keep a copy each. (The same turn may still go from summary to raw line.)
    let mut shown_pairs: HashMap<u64, Vec<TurnSeq>> = HashMap::new();
    for item in &in_prompt {
        if let Some((pair, seq)) = turn_pair(state, *item) {
            shown_pairs.entry(pair).or_default().push(seq);
        }
    }
    let mut ranked: Vec<RankedHit> = retrieval
        .hits
        .iter()
        .filter(|hit| {
            hit.relevance >= best[cutoff_kind(hit.item)] * config.retrieval.min_relative_score
                && !in_prompt.contains(&hit.item)
                && !turn_pair(state, hit.item).is_some_and(|(pair, seq)| {
                    shown_pairs
                        .get(&pair)
                        .is_some_and(|shown| shown.iter().any(|other| *other != seq))
                })
        })
        .map(|hit| {
            let tier = item_tier_score(state, config, hit.item);
            RankedHit {
                item: hit.item,
                ranking: Ranking {
                    score: hit.relevance + config.retrieval.tier_score_blend * tier,
                    relevance: Some(hit.relevance),
                    reason: Reason::Retrieved { source: hit.source },
                },
            }
        })
        .collect();
    ranked.sort_by(|a, b| {
        b.ranking
            .score
            .total_cmp(&a.ranking.score)
            .then(a.item.cmp(&b.item))
    });
    // The OLD share pays for OLD-tier content too: the raw turns recall finds there (most of
    // an old conversation's evidence) come before the manifests that index them.
    packer.stage(
        budgets
            .current
            .saturating_sub(core_facts_used)
            .saturating_add(new_left)
            .saturating_add(budgets.old),
    );
    pack_recall(
        state,
        &ranked,
        &mut recall,
        &mut packer,
        encoding,
        &mut explain_items,
    );

    // ---- OLD: episode manifests, in what recall left ----
    packer.stage(packer.total_left);
    for hit in &ranked {
        let item = hit.item;
        let ItemRef::Episode(id) = item else {
            continue;
        };
        let Some(episode) = state.episodes.get(id as usize) else {
            continue;
        };
        let tokens = episode.tokens.get(encoding);
        let line = Line {
            section: Section::Episodes,
            order: u64::from(id),
            item,
            form: Form::Full,
            date: None,
        };
        if recall.try_add(&mut packer, line, tokens, encoding) {
            explain_items.push(explained(
                state,
                item,
                Form::Full,
                Block::Recall,
                tokens,
                hit.ranking,
            ));
        }
    }

    let left_out: Vec<ItemRef> = ranked
        .iter()
        .map(|hit| hit.item)
        .filter(|item| !shows(state, &recall, *item))
        .take(16)
        .collect();

    // ---- final guard: the blocks fit the budget, always ----
    let mut tokens = BlockTokens {
        core: core.tokens,
        window: window_tokens,
        recall: recall.tokens,
        total: core.tokens + window_tokens + recall.tokens,
    };
    let mut guard_trimmed = false;
    let drop_order = [Block::Recall, Block::Window, Block::Core];
    for block in drop_order {
        if tokens.total <= config.budget_tokens {
            break;
        }
        guard_trimmed = true;
        match block {
            Block::Recall => {
                recall.lines.clear();
                recall.dates.clear();
                recall.line_tokens.clear();
                tokens.recall = 0;
            }
            Block::Window => {
                window.clear();
                unapplied_shown.clear();
                tokens.window = 0;
            }
            Block::Core => {
                core.lines.clear();
                core.dates.clear();
                core.line_tokens.clear();
                tokens.core = 0;
            }
        }
        explain_items.retain(|item| item.block != block);
        tokens.total = tokens.core + tokens.window + tokens.recall;
    }

    // ---- render ----
    let messages = assemble(
        state, request, &shape, keep_from, &core, &window, &recall, config,
    );
    let items = explain_items.len() + unapplied_shown.len();
    let outcome = if reserved_over_budget {
        MemoryOutcome::ReservedOverBudget
    } else if items == 0 {
        MemoryOutcome::Empty
    } else {
        MemoryOutcome::Injected
    };
    let retrieval_hits = explain_items
        .iter()
        .filter(|item| matches!(item.reason, Reason::Retrieved { .. }))
        .count();
    Composition {
        messages,
        tokens,
        items,
        outcome,
        retrieval_candidates: retrieval.hits.len(),
        retrieval_hits,
        explain: Explain {
            encoding,
            budgets,
            reserved_tokens,
            tokens,
            client_mode,
            coverage: retrieval.coverage,
            escalated: retrieval.escalated,
            items: explain_items,
            unapplied_turns: unapplied_shown,
            left_out,
            guard_trimmed,
        },
        prior_chain: shape.prior_chain,
    }
}

/// Whether the core block prefixes a user message: with `core_placement: user_prefix`, when
/// the request has a user message (the prompt's first user message is then at the latest this
/// one).
fn core_is_prefix(placement: Placement, shape: &super::history::RequestShape) -> bool {
    placement == Placement::UserPrefix && shape.last_user.is_some()
}

/// A summary or artifact hit is shown as its raw turn when the raw line costs at most this many
/// times the hit's own line: the raw text is what was said (around the artifact, too), and
/// short exchanges summarise to nearly the same length.
const RAW_FOR_HIT_COST: u32 = 2;

/// The latest user message is searched by at most this much of it (head and tail).
const QUERY_MAX_BYTES: usize = 4096;

/// One way to show a hit in the recall block.
#[derive(Debug, Clone, Copy)]
struct RenderOption {
    /// What the line shows: the hit itself, or the raw turn that holds it.
    shown: ItemRef,
    section: Section,
    order: u64,
    form: Form,
    tokens: u32,
}

impl RenderOption {
    fn line(self, state: &MemoryState, encoding: Encoding) -> Line<'_> {
        Line {
            section: self.section,
            order: self.order,
            item: self.shown,
            form: self.form,
            date: match self.section {
                Section::Conversation => dated(state, self.shown, encoding),
                _ => None,
            },
        }
    }
}

/// The ways an item can be shown in the recall block, preferred first. A turn is shown once, in
/// the fullest form that fits: its raw line, the raw line clipped, or its summary. An artifact
/// is shown as its turn's raw line (which holds it), whole, or as a reference.
fn render_options(state: &MemoryState, item: ItemRef, encoding: Encoding) -> Vec<RenderOption> {
    match item {
        ItemRef::Fact(id) => state
            .fact(id)
            .map(|fact| {
                vec![RenderOption {
                    shown: item,
                    section: Section::RelevantFacts,
                    order: u64::from(id),
                    form: Form::Full,
                    tokens: fact.tokens.get(encoding),
                }]
            })
            .unwrap_or_default(),
        ItemRef::RawTurn(seq) | ItemRef::Summary(seq) => {
            let Some(turn) = state.raw_turns.get(seq as usize) else {
                return Vec::new();
            };
            let raw = ItemRef::RawTurn(seq);
            let full = turn.tokens.line.get(encoding);
            let clipped = turn.tokens.clipped_line.get(encoding);
            let summary = state
                .turn_log
                .get(seq as usize)
                .map(|entry| entry.tokens.get(encoding));
            let order = u64::from(seq) * 2;
            let conversation = |shown, order, form, tokens| RenderOption {
                shown,
                section: Section::Conversation,
                order,
                form,
                tokens,
            };
            let mut options = Vec::new();
            let affordable = |tokens: u32| match (item, summary) {
                (ItemRef::Summary(_), Some(summary)) => {
                    tokens <= summary.saturating_mul(RAW_FOR_HIT_COST)
                }
                _ => true,
            };
            if affordable(full) {
                options.push(conversation(raw, order, Form::Full, full));
            }
            if clipped < full && affordable(clipped) {
                options.push(conversation(raw, order, Form::Clipped, clipped));
            }
            if let Some(summary) = summary {
                options.push(conversation(
                    ItemRef::Summary(seq),
                    order + 1,
                    Form::Full,
                    summary,
                ));
            }
            options
        }
        ItemRef::Artifact(id) => {
            let Some(artifact) = state.artifacts.get(id as usize) else {
                return Vec::new();
            };
            let full = artifact.tokens.get(encoding);
            let shown_as_itself = |form, tokens| RenderOption {
                shown: item,
                section: Section::Artifacts,
                order: u64::from(id),
                form,
                tokens,
            };
            let mut options = Vec::new();
            if let Some(turn) = state.raw_turns.get(artifact.turn as usize) {
                let raw = turn.tokens.line.get(encoding);
                if raw <= full.saturating_mul(RAW_FOR_HIT_COST) {
                    options.push(RenderOption {
                        shown: ItemRef::RawTurn(artifact.turn),
                        section: Section::Conversation,
                        order: u64::from(artifact.turn) * 2,
                        form: Form::Full,
                        tokens: raw,
                    });
                }
            }
            options.push(shown_as_itself(Form::Full, full));
            options.push(shown_as_itself(
                Form::Reference,
                artifact.reference_tokens.get(encoding),
            ));
            options
        }
        ItemRef::Episode(_) | ItemRef::Identity | ItemRef::Pinned(_) => Vec::new(),
    }
}

fn item_tier_score(state: &MemoryState, config: &MemoryConfig, item: ItemRef) -> f32 {
    match item {
        ItemRef::Fact(id) => fact_score(state, &config.weights, id as usize),
        ItemRef::Summary(seq) | ItemRef::RawTurn(seq) => state
            .turn_log
            .get(seq as usize)
            .map_or(0.0, |entry| summary_score(state, &config.weights, entry)),
        _ => 0.0,
    }
}

#[cfg(test)]
mod tests;
