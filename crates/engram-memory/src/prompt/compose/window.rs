//! NEW: the raw window a stateless client is given, or the turns a full-history client resends,
//! and the summaries of the turns just before them (the recent context, in the recall block).

use std::cell::RefCell;
use std::collections::HashSet;

use super::block::{Line, Section, dated};
use super::{Fenced, Packing, Ranking};
use crate::code::code_blocks;
use crate::config::MemoryConfig;
use crate::index::MemoryIndex;
use crate::memo::{TextMemo, memoised};
use crate::model::{ArtifactKind, Depth, ItemRef, MemoryState, RawTurn, TurnSeq};
use crate::prompt::compose::ComposeRequest;
use crate::prompt::explain::{Block, ClientMode, Form, Reason};
use crate::prompt::history::{RequestShape, answer_words};
use crate::tokens::Encoding;

/// A turn of the raw window: stored in the memory, or recorded and not applied yet (an index
/// into [`ComposeRequest::unapplied`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum WindowTurn {
    Stored(TurnSeq),
    Unapplied(usize),
}

/// The raw window as placed.
#[derive(Debug, Default)]
pub(super) struct WindowPlan {
    /// Oldest first once packed.
    pub(super) turns: Vec<WindowTurn>,
    pub(super) tokens: u32,
    /// Turn ids of the unapplied exchanges among `turns`.
    pub(super) unapplied_shown: Vec<String>,
}

impl WindowPlan {
    /// Drops every turn (the final guard).
    pub(super) fn clear(&mut self) {
        self.turns.clear();
        self.tokens = 0;
        self.unapplied_shown.clear();
    }
}

/// How the request carries the conversation before its latest user message.
pub(super) struct Conversation {
    pub(super) client_mode: ClientMode,
    /// The first of the client's messages after its system messages that is forwarded.
    pub(super) keep_from: usize,
    /// Turns just older than the window, newest first: their summaries keep the thread.
    pub(super) recent_context: Vec<TurnSeq>,
}

/// An unapplied exchange's text is counted exactly up to this size; a longer one is charged
/// its byte length (never fewer than its tokens), which keeps the hot path from tokenizing a
/// pasted document. It rarely fits the raw window either way.
const UNAPPLIED_COUNT_BYTES: usize = 16 * 1024;

/// Unapplied texts remembered per thread: 64 to 128 of them, at most 16 KiB each.
const UNAPPLIED_MEMO_TEXTS: usize = 64;

/// One memo per encoding, keyed by the text alone.
type UnappliedMemo = RefCell<TextMemo<u32, UNAPPLIED_MEMO_TEXTS>>;

thread_local! {
    static UNAPPLIED_O200K: UnappliedMemo = RefCell::default();
    static UNAPPLIED_CL100K: UnappliedMemo = RefCell::default();
}

/// Counted once per thread, not per request: while one identity sends faster than its turns are
/// applied, every request shows the same few unapplied exchanges again, and counting them was
/// about a tenth of the hot path's time (one user at 200 req/s, perf).
fn unapplied_tokens(encoding: Encoding, text: &str) -> u32 {
    if text.len() > UNAPPLIED_COUNT_BYTES {
        u32::try_from(text.len()).unwrap_or(u32::MAX)
    } else {
        let memo = match encoding {
            Encoding::O200k => &UNAPPLIED_O200K,
            Encoding::Cl100k => &UNAPPLIED_CL100K,
        };
        *memoised(memo, text, || crate::tokens::count_in(encoding, text))
    }
}

/// Places the raw window for a stateless client, or recognises the turns a full-history client
/// resends; either way in the current stage (NEW).
pub(super) fn pack_window(
    packing: &mut Packing<'_>,
    request: &ComposeRequest<'_>,
    index: &MemoryIndex,
    shape: &RequestShape,
    config: &MemoryConfig,
) -> Conversation {
    match shape.last_user {
        None => Conversation {
            client_mode: ClientMode::NoUserMessage,
            keep_from: shape.system_end,
            recent_context: Vec::new(),
        },
        Some(last_user) if shape.exchanges.is_empty() => Conversation {
            client_mode: ClientMode::Stateless,
            keep_from: last_user,
            recent_context: pack_raw_window(packing, request, config),
        },
        Some(last_user) => recognise_history(packing, index, shape, config, last_user),
    }
}

/// Places the session's last turns, newest first, the unapplied ones before the stored ones;
/// returns the turns that fall back to summaries (older ones, and all from the first that did
/// not fit), newest first.
fn pack_raw_window(
    packing: &mut Packing<'_>,
    request: &ComposeRequest<'_>,
    config: &MemoryConfig,
) -> Vec<TurnSeq> {
    let state = packing.state;
    let overhead = config.message_overhead_tokens;
    let mut recent_context = Vec::new();
    let stored: Vec<TurnSeq> = match state.session_index(request.session_id) {
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
                if age < config.raw_window_turns && !overflowed {
                    overflowed = !place_unapplied(packing, request, at, overhead);
                }
                continue;
            }
        };
        let Some(turn) = state.raw_turns.get(seq as usize) else {
            continue;
        };
        let long = matches!(turn.depth, Depth::Long | Depth::Code);
        let in_window = age < config.raw_window_turns
            || (long && age < config.raw_window_turns + config.long_turn_extra_window);
        if in_window && !overflowed {
            if place_stored(packing, seq, turn, overhead) {
                continue;
            }
            // NEW is trimmed aggressively: this turn and older ones fall back to summaries.
            overflowed = true;
        }
        recent_context.push(seq);
    }
    packing.window.turns.reverse();
    recent_context
}

/// Places unapplied exchange `at` whole in the window; false when it does not fit.
fn place_unapplied(
    packing: &mut Packing<'_>,
    request: &ComposeRequest<'_>,
    at: usize,
    overhead: u32,
) -> bool {
    let Some(exchange) = request.unapplied.get(at) else {
        return true;
    };
    let messages = if exchange.assistant_text.is_empty() {
        1
    } else {
        2
    };
    let cost = unapplied_tokens(packing.encoding, &exchange.user_text)
        .saturating_add(unapplied_tokens(packing.encoding, &exchange.assistant_text))
        .saturating_add(messages * overhead);
    if !packing.budget.take(cost) {
        return false;
    }
    packing.window.turns.push(WindowTurn::Unapplied(at));
    packing.window.tokens += cost;
    packing
        .window
        .unapplied_shown
        .push(exchange.turn_id.clone());
    true
}

/// Places stored turn `seq` whole in the window, and explains it; false when it does not fit.
fn place_stored(packing: &mut Packing<'_>, seq: TurnSeq, turn: &RawTurn, overhead: u32) -> bool {
    let encoding = packing.encoding;
    let messages = if turn.assistant.is_empty() { 1 } else { 2 };
    let cost =
        turn.tokens.user.get(encoding) + turn.tokens.assistant.get(encoding) + messages * overhead;
    if !packing.budget.take(cost) {
        return false;
    }
    packing.window.turns.push(WindowTurn::Stored(seq));
    packing.window.tokens += cost;
    packing
        .in_prompt
        .extend(carried_items(packing.state, seq, true));
    let ranking = Ranking {
        score: 1.0,
        relevance: None,
        reason: Reason::RawWindow,
    };
    packing.explain(
        ItemRef::RawTurn(seq),
        Form::Full,
        Block::Window,
        cost,
        ranking,
    );
    true
}

/// Recognises the exchanges a full-history client resends: the oldest recognised ones beyond
/// the raw window are replaced by their summaries, the rest are forwarded as sent.
fn recognise_history(
    packing: &mut Packing<'_>,
    index: &MemoryIndex,
    shape: &RequestShape,
    config: &MemoryConfig,
    last_user: usize,
) -> Conversation {
    let resent = shape.exchanges.len();
    // By the whole conversation up to it, or else by its own texts: a client that trimmed the
    // front of its history or edited a message still carries the exchanges it kept, and those
    // are never injected again.
    let carried: Vec<Option<TurnSeq>> = shape
        .exchanges
        .iter()
        .map(|exchange| {
            index
                .turn_for_chain(exchange.chain)
                .or_else(|| index.turn_for_pair(exchange.pair))
        })
        .collect();
    // Only a recognised run from the first exchange on is replaced by summaries, so what the
    // client sent stays in order.
    let leading = carried.iter().take_while(|seq| seq.is_some()).count();
    let replaced = leading.min(resent.saturating_sub(config.raw_window_turns));
    let keep_from = shape
        .exchanges
        .get(replaced)
        .map_or(last_user, |first_kept| first_kept.start);
    for seq in carried[replaced..].iter().flatten() {
        packing
            .in_prompt
            .extend(carried_items(packing.state, *seq, false));
    }
    let recent_context = carried[..replaced]
        .iter()
        .flatten()
        .rev()
        .take(config.new_ttl_turns as usize)
        .copied()
        .collect();
    Conversation {
        client_mode: ClientMode::FullHistory {
            resent,
            recognised: carried.iter().flatten().count(),
            replaced,
        },
        keep_from,
        recent_context,
    }
}

/// Places the summaries of the turns just before the window in the recall block, in the
/// current stage (what NEW has left): they keep the thread (seed 001's turn log).
pub(super) fn pack_recent_context(packing: &mut Packing<'_>, recent_context: &[TurnSeq]) {
    let state = packing.state;
    for (age, seq) in recent_context.iter().enumerate() {
        let Some(entry) = state
            .turn_log
            .get(*seq as usize)
            .filter(|entry| !entry.erased)
        else {
            continue;
        };
        let item = ItemRef::Summary(*seq);
        if packing.in_prompt.contains(&item) {
            continue;
        }
        let line = Line {
            section: Section::Conversation,
            order: u64::from(*seq) * 2 + 1,
            item,
            form: Form::Full,
            date: dated(state, item, packing.encoding),
        };
        let ranking = Ranking {
            score: 1.0 - age as f32 / (recent_context.len() as f32 + 1.0),
            relevance: None,
            reason: Reason::RecentContext,
        };
        if packing.place(
            Fenced::Recall,
            line,
            entry.tokens.get(packing.encoding),
            ranking,
        ) {
            packing.in_prompt.insert(item);
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::count_in;

    /// The memo answers what counting gives, per encoding: a text counted for one encoding is
    /// not charged that count under the other.
    #[test]
    fn unapplied_counts_are_remembered_per_encoding() {
        let text = "Das Frühstück in Köln: 12 Brötchen, ½ Liter Kaffee — und ein Croissant 🥐";
        let (o200k, cl100k) = (
            count_in(Encoding::O200k, text),
            count_in(Encoding::Cl100k, text),
        );
        assert_ne!(o200k, cl100k, "pick a text the encodings count differently");
        for _ in 0..2 {
            assert_eq!(unapplied_tokens(Encoding::O200k, text), o200k);
            assert_eq!(unapplied_tokens(Encoding::Cl100k, text), cl100k);
        }
        let long = "word ".repeat(UNAPPLIED_COUNT_BYTES);
        assert_eq!(
            unapplied_tokens(Encoding::O200k, &long) as usize,
            long.len()
        );
    }
}
