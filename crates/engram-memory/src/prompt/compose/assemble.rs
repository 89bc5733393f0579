//! The prompt written out: each fenced block's text, and the messages in layout order.

use serde_json::Value;

use super::block::{BlockPlan, Line};
use super::window::WindowTurn;
use super::{ComposeRequest, Packing, core_is_prefix};
use crate::config::{MemoryConfig, Placement};
use crate::fence::{has_fence_like, memory_text, neutralise_fences};
use crate::model::{ItemRef, MemoryState, TurnSeq};
use crate::openai::{ChatMessage, OutgoingMessage};
use crate::prompt::explain::Form;
use crate::prompt::history::{RequestShape, answer_words};
use crate::prompt::render::{
    FENCE_CLOSE, Fixed, artifact_full, artifact_reference, date_heading, episode_line, fact_line,
    identity_lines, pin_line, raw_turn_line, summary_line,
};

/// The text of one line.
fn line_text(state: &MemoryState, line: &Line<'_>) -> String {
    let event_time = |seq: TurnSeq| {
        state
            .raw_turns
            .get(seq as usize)
            .and_then(|turn| turn.event_time.as_deref())
    };
    match line.item {
        ItemRef::Identity => state
            .identity
            .as_ref()
            .map(|identity| identity_lines(&identity.text))
            .unwrap_or_default(),
        ItemRef::Pinned(id) => state
            .pinned
            .get(id as usize)
            .map(|pin| pin_line(state.pin_content(pin)))
            .unwrap_or_default(),
        ItemRef::Fact(id) => state.fact(id).map(fact_line).unwrap_or_default(),
        ItemRef::Summary(seq) => state
            .turn_log
            .get(seq as usize)
            .map(|entry| summary_line(entry, state.raw_turns.get(seq as usize)))
            .unwrap_or_default(),
        ItemRef::RawTurn(seq) => state
            .raw_turns
            .get(seq as usize)
            .map(|turn| raw_turn_line(turn, line.form == Form::Clipped))
            .unwrap_or_default(),
        ItemRef::Episode(id) => state.episode(id).map(episode_line).unwrap_or_default(),
        ItemRef::Artifact(id) => state
            .artifacts
            .get(id as usize)
            .map(|artifact| {
                let content = state.artifact_content(artifact);
                match line.form {
                    Form::Reference => {
                        artifact_reference(artifact, content, event_time(artifact.turn))
                    }
                    _ => artifact_full(artifact, content, event_time(artifact.turn)),
                }
            })
            .unwrap_or_default(),
    }
}

/// Room reserved per planned token for a block's text: English runs about four bytes a token,
/// the quotes three bytes each.
const BYTES_PER_TOKEN: usize = 6;

/// The block's text: open tag, preamble, sections in fixed order, lines in their order, close.
fn block_text(
    state: &MemoryState,
    plan: &BlockPlan<'_>,
    open: Fixed,
    preamble: Fixed,
    close: &str,
) -> Option<String> {
    if plan.lines.is_empty() {
        return None;
    }
    // A day's lines stand together, from where its first line would stand; undated ones
    // first, under no date. (Only conversation lines are dated.)
    let mut firsts: Vec<(&str, u64)> = Vec::new();
    for line in &plan.lines {
        let Some(date) = line.date else { continue };
        match firsts.iter_mut().find(|(key, _)| *key == date.key) {
            Some((_, first)) => *first = (*first).min(line.order),
            None => firsts.push((date.key, line.order)),
        }
    }
    let day_order = |line: &Line<'_>| {
        let key = line.date?.key;
        firsts
            .iter()
            .find(|(day, _)| *day == key)
            .map(|(_, first)| *first)
    };
    let mut lines: Vec<(Option<u64>, Line<'_>)> = plan
        .lines
        .iter()
        .map(|line| (day_order(line), *line))
        .collect();
    lines.sort_by(|(a_day, a), (b_day, b)| {
        a.section
            .cmp(&b.section)
            .then(a_day.cmp(b_day))
            .then(a.order.cmp(&b.order))
            .then(a.item.cmp(&b.item))
    });
    // Sized once: grown line by line it was copied a dozen times (a twentieth of compose).
    let mut out = String::with_capacity(plan.tokens as usize * BYTES_PER_TOKEN);
    out.push_str(open.text());
    out.push_str(preamble.text());
    let mut section = None;
    let mut day = None;
    for (_, line) in &lines {
        if section != Some(line.section) {
            out.push_str(line.section.heading().text());
            section = Some(line.section);
            day = None;
        }
        if let Some(date) = line.date
            && day != Some(date.key)
        {
            out.push_str(&date_heading(Some(date.event_time)));
            day = Some(date.key);
        }
        out.push_str(&line_text(state, line));
    }
    out.push_str(close);
    Some(out)
}

/// The client's `source[at]`, forwarded as sent; or, when it carries anything fence-like, a
/// copy with it escaped. Not cloned otherwise: a pasted document can be megabytes.
fn neutralised(source: &[ChatMessage], at: usize) -> OutgoingMessage {
    let Some(message) = source.get(at) else {
        return OutgoingMessage::Client(at);
    };
    if !message.text_parts().any(has_fence_like) {
        return OutgoingMessage::Client(at);
    }
    let mut message = message.clone();
    match &mut message.content {
        Some(Value::String(text)) => *text = neutralise_fences(text).into_owned(),
        Some(Value::Array(parts)) => {
            for part in parts {
                if let Some(Value::String(text)) = part.get_mut("text")
                    && has_fence_like(text)
                {
                    *text = neutralise_fences(text).into_owned();
                }
            }
        }
        _ => {}
    }
    OutgoingMessage::Written(message)
}

/// A message with no text and nothing else: no parts, no tool calls, no name.
fn is_blank(message: &ChatMessage) -> bool {
    let content_blank = match &message.content {
        None | Some(Value::Null) => true,
        Some(Value::String(text)) => text.trim().is_empty(),
        Some(Value::Array(parts)) => parts.iter().all(|part| {
            part.get("type").and_then(Value::as_str) == Some("text")
                && part
                    .get("text")
                    .and_then(Value::as_str)
                    .is_none_or(|text| text.trim().is_empty())
        }),
        Some(_) => false,
    };
    content_blank && message.extra.keys().all(|key| key == "name")
}

fn written(role: &str, text: String) -> OutgoingMessage {
    OutgoingMessage::Written(ChatMessage::new(role, text))
}

fn prefixed(message: &ChatMessage, prefix: &str) -> ChatMessage {
    let mut message = message.clone();
    match &mut message.content {
        Some(Value::String(text)) => {
            *text = format!("{prefix}{text}");
        }
        Some(Value::Array(parts)) => {
            let mut part = serde_json::Map::new();
            part.insert("type".into(), Value::String("text".into()));
            part.insert("text".into(), Value::String(prefix.trim_end().to_string()));
            parts.insert(0, Value::Object(part));
        }
        _ => message.content = Some(Value::String(prefix.trim_end().to_string())),
    }
    message
}

/// The prompt's messages, in layout order: the client's system messages, the core block, the
/// raw window, the client's kept messages, the recall block and the latest user message (and
/// what the client sent after it).
pub(super) fn assemble(
    packing: &Packing<'_>,
    request: &ComposeRequest<'_>,
    shape: &RequestShape,
    keep_from: usize,
    config: &MemoryConfig,
) -> Vec<OutgoingMessage> {
    let state = packing.state;
    let core = &packing.core;
    let window = &packing.window.turns;
    let recall = &packing.recall;
    let source = request.messages;
    let mut out = Vec::with_capacity(source.len() + window.len() * 2 + 2);
    // A blank instruction says nothing, and some providers reject an empty message.
    out.extend(
        (0..shape.system_end)
            .filter(|at| source.get(*at).is_some_and(|message| !is_blank(message)))
            .map(|at| neutralised(source, at)),
    );
    let conversation_start = out.len();
    let core_prefixed = core_is_prefix(config.core_placement, shape);
    let core_close = if core_prefixed {
        Fixed::ClosePrefix.text()
    } else {
        FENCE_CLOSE
    };
    let core_text = block_text(
        state,
        core,
        Fixed::CoreOpen,
        Fixed::CorePreamble,
        core_close,
    );
    if let Some(text) = core_text.as_ref().filter(|_| !core_prefixed) {
        let role = match config.core_placement {
            Placement::System => "system",
            Placement::UserPrefix => "user",
        };
        out.push(written(role, text.clone()));
    }
    for turn in window {
        let (user, assistant) = match *turn {
            WindowTurn::Stored(seq) => match state.raw_turns.get(seq as usize) {
                Some(turn) => (&*turn.user, &*turn.assistant),
                None => continue,
            },
            // Not applied yet, so still as the client sent it: shown as memory would keep it.
            WindowTurn::Unapplied(at) => match request.unapplied.get(at) {
                Some(exchange) => (
                    exchange.user_text.as_str(),
                    exchange.assistant_text.as_str(),
                ),
                None => continue,
            },
        };
        // A turn with one side empty shows the other alone; an agent's tool calls are left
        // out whole (see `answer_words`).
        let assistant = answer_words(assistant);
        let user = memory_text(user);
        if !user.trim().is_empty() {
            out.push(written("user", user.into_owned()));
        }
        let assistant = memory_text(&assistant);
        if !assistant.trim().is_empty() {
            out.push(written("assistant", assistant.into_owned()));
        }
    }
    let last_user = shape.last_user.unwrap_or(source.len());
    let keep_from = keep_from.clamp(shape.system_end, last_user.max(shape.system_end));
    out.extend((keep_from..last_user).map(|at| neutralised(source, at)));
    let Some(user_at) = shape.last_user else {
        out.extend(
            (keep_from.max(shape.system_end)..source.len()).map(|at| neutralised(source, at)),
        );
        return out;
    };
    let user = neutralised(source, user_at);
    match config.placement {
        Placement::System => {
            if let Some(text) = block_text(
                state,
                recall,
                Fixed::RecallOpen,
                Fixed::RecallPreamble,
                FENCE_CLOSE,
            ) {
                out.push(written("system", text));
            }
            out.push(user);
        }
        Placement::UserPrefix => {
            let close = Fixed::ClosePrefix.text();
            match block_text(
                state,
                recall,
                Fixed::RecallOpen,
                Fixed::RecallPreamble,
                close,
            ) {
                Some(text) => {
                    let prefixed = user.resolve(source).map(|user| prefixed(user, &text));
                    out.push(prefixed.map_or(user, OutgoingMessage::Written));
                }
                None => out.push(user),
            }
        }
    }
    out.extend((user_at + 1..source.len()).map(|at| neutralised(source, at)));
    if let Some(text) = core_text.filter(|_| core_prefixed) {
        prefix_first_user(&mut out, source, conversation_start, &text);
    }
    out
}

/// Prefixes `text` to the first user message of `out` from `from` on (the latest user message
/// at the latest, so there is one), before any recall block it already carries. One message
/// more would put two user messages in a row, which some chat templates reject.
fn prefix_first_user(out: &mut [OutgoingMessage], source: &[ChatMessage], from: usize, text: &str) {
    let first = out.iter_mut().skip(from).find(|message| {
        message
            .resolve(source)
            .is_some_and(|message| message.role == "user")
    });
    if let Some(message) = first
        && let Some(with_core) = message.resolve(source).map(|user| prefixed(user, text))
    {
        *message = OutgoingMessage::Written(with_core);
    }
}
