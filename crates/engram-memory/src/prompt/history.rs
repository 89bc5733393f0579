//! Recognising a full-history client's turns by the two hashes of [`crate::chain`] over
//! normalised exchanges (whitespace collapsed, engram fences removed):
//! - a chain: each link hashes the previous link with the exchange's user and answer text, so a
//!   client's k-th exchange matches a recorded turn only if the whole conversation up to it
//!   matches too;
//! - a pair: the exchange's own texts alone, so a client that trims the front of its history (a
//!   sliding window) or edits one message still matches every exchange it kept unchanged.
//!
//! An exchange's answer is every message between its user message and the next one: the
//! assistant's texts, and in an agent's tool loop its tool calls and their results, rendered by
//! [`AnswerText`] the same way here and when the recorder records the turn.

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::Value;

use crate::openai::{ChatMessage, ToolCall};

use crate::chain::{CHAIN_ORIGIN, link, pair};
use crate::code::fence_info;

/// Tool results and arguments up to this size, on one line, stay inline; longer ones are fenced
/// so the memory keeps them whole as artifacts.
const INLINE_TOOL_BYTES: usize = 200;

/// The answer side of an exchange as text: the assistant's words, its tool calls and their
/// results, in order, one part per line. What the recorder stores as the turn's answer, and what
/// a resent exchange is hashed with, so an agent's earlier turns are recognised when resent.
#[derive(Debug, Default)]
pub struct AnswerText {
    text: String,
    /// Tool call id → function name, to name a result by the call it answers.
    names: HashMap<String, String>,
}

impl AnswerText {
    /// Adds a message that followed the user message: an assistant message (text and tool
    /// calls) or a tool result; others (a system note) say nothing of the answer.
    pub fn message(&mut self, message: &ChatMessage) {
        match message.role.as_str() {
            "assistant" => {
                self.words(&message.text_borrowed());
                let calls = message.extra.get("tool_calls").and_then(Value::as_array);
                for call in calls.into_iter().flatten() {
                    let id = call.get("id").and_then(Value::as_str).unwrap_or_default();
                    let function = call.get("function");
                    let field = |key| {
                        function
                            .and_then(|function| function.get(key))
                            .and_then(Value::as_str)
                            .unwrap_or_default()
                    };
                    self.call(id, field("name"), field("arguments"));
                }
                // The legacy single `function_call`.
                if let Some(call) = message.extra.get("function_call") {
                    let field = |key| call.get(key).and_then(Value::as_str).unwrap_or_default();
                    self.call("", field("name"), field("arguments"));
                }
            }
            "tool" | "function" => {
                let by_id = message
                    .extra
                    .get("tool_call_id")
                    .and_then(Value::as_str)
                    .and_then(|id| self.names.get(id))
                    .cloned();
                let name = by_id
                    .or_else(|| {
                        message
                            .extra
                            .get("name")
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                    })
                    .unwrap_or_else(|| "tool".to_owned());
                let result = message.text_borrowed();
                self.part(&format!("{name} returned"), &result);
            }
            _ => {}
        }
    }

    /// Adds the answer the upstream gave (the round being recorded).
    pub fn reply(&mut self, content: &str, calls: &[ToolCall]) {
        self.words(content);
        for call in calls {
            self.call(&call.id, &call.name, &call.arguments);
        }
    }

    pub fn finish(self) -> String {
        self.text
    }

    /// The assistant's words as they were said (a plain answer is recorded byte for byte).
    fn words(&mut self, text: &str) {
        if !text.trim().is_empty() {
            self.line(text);
        }
    }

    fn call(&mut self, id: &str, name: &str, arguments: &str) {
        if !id.is_empty() {
            self.names.insert(id.to_owned(), name.to_owned());
        }
        self.part(&format!("called {name}"), arguments);
    }

    /// `[label: body]` on one line, or the label and the body fenced below it.
    fn part(&mut self, label: &str, body: &str) {
        let body = body.trim();
        if body.is_empty() {
            self.line(&format!("[{label}]"));
        } else if body.len() <= INLINE_TOOL_BYTES && !body.contains('\n') {
            self.line(&format!("[{label}: {body}]"));
        } else {
            let language = if body.starts_with('{') || body.starts_with('[') {
                "json"
            } else {
                ""
            };
            // A body with code fences of its own keeps them (the memory keeps its code
            // blocks): `~~~`, which no line of it can close, wraps it instead.
            let fence = if body.lines().any(|line| fence_info(line).is_some()) {
                "~~~"
            } else {
                "```"
            };
            self.line(&format!("[{label}:]\n{fence}{language}\n{body}\n{fence}"));
        }
    }

    fn line(&mut self, text: &str) {
        if !self.text.is_empty() {
            self.text.push('\n');
        }
        self.text.push_str(text);
    }
}

/// An answer [`AnswerText`] wrote with its tool calls and results left out: what the raw window
/// shows a stateless client, which could not be given a valid tool-call sequence from text
/// (an assistant message with `tool_calls` needs its `tool` messages after it). The calls and
/// results stay in memory for recall.
pub fn answer_words(answer: &str) -> Cow<'_, str> {
    if !answer.contains(" returned") && !answer.contains("[called ") {
        return Cow::Borrowed(answer);
    }
    let mut kept: Vec<&str> = Vec::new();
    let mut dropped = false;
    let mut lines = answer.lines().peekable();
    while let Some(line) = lines.next() {
        let part = line
            .strip_prefix('[')
            .and_then(|rest| rest.strip_suffix(']'));
        let Some(part) = part else {
            kept.push(line);
            continue;
        };
        let label = part.split_once(':').map_or(part, |(label, _)| label);
        let is_tool = label.starts_with("called ") || label.ends_with(" returned");
        if !is_tool {
            kept.push(line);
            continue;
        }
        dropped = true;
        // `[label:]` introduces a fenced body: skip it to its closing fence.
        let fence = part
            .ends_with(':')
            .then(|| lines.peek())
            .flatten()
            .and_then(|open| {
                ["```", "~~~"]
                    .into_iter()
                    .find(|fence| open.starts_with(fence))
            });
        if let Some(fence) = fence {
            lines.next();
            for body in lines.by_ref() {
                if body == fence {
                    break;
                }
            }
        }
    }
    if !dropped {
        // Words that merely look like a part ("he returned home") keep the answer as said.
        return Cow::Borrowed(answer);
    }
    Cow::Owned(kept.join("\n"))
}

/// One client exchange: a user message and the messages that answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientExchange {
    /// Index range in the request's messages.
    pub start: usize,
    pub end: usize,
    /// Chain link after this exchange.
    pub chain: u64,
    /// [`pair`] of this exchange.
    pub pair: u64,
}

/// Where the parts of a request sit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestShape {
    /// Leading `system`/`developer` messages: `messages[..system_end]`.
    pub system_end: usize,
    /// The latest user message, if any.
    pub last_user: Option<usize>,
    /// Earlier exchanges the client resent (`messages[system_end..last_user]`).
    pub exchanges: Vec<ClientExchange>,
    /// Chain link after all earlier exchanges: what to record the new exchange under.
    pub prior_chain: u64,
}

fn is_system(message: &ChatMessage) -> bool {
    matches!(message.role.as_str(), "system" | "developer")
}

pub fn request_shape(messages: &[ChatMessage]) -> RequestShape {
    let system_end = messages
        .iter()
        .position(|message| !is_system(message))
        .unwrap_or(messages.len());
    let last_user = messages
        .iter()
        .rposition(|message| message.role == "user")
        .filter(|index| *index >= system_end);
    let conversation_end = last_user.unwrap_or(system_end);
    let mut exchanges = Vec::new();
    let mut chain = CHAIN_ORIGIN;
    let mut index = system_end;
    while index < conversation_end {
        let start = index;
        let user = if messages[index].role == "user" {
            index += 1;
            messages[start].text()
        } else {
            String::new()
        };
        let mut answer = AnswerText::default();
        while index < conversation_end && messages[index].role != "user" {
            answer.message(&messages[index]);
            index += 1;
        }
        let answer = answer.finish();
        chain = link(chain, &user, &answer);
        exchanges.push(ClientExchange {
            start,
            end: index,
            chain,
            pair: pair(&user, &answer),
        });
    }
    RequestShape {
        system_end,
        last_user,
        exchanges,
        prior_chain: chain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, text)| ChatMessage::new(*role, *text))
            .collect()
    }

    #[test]
    fn shape_splits_system_history_and_question() {
        let request = messages(&[
            ("system", "be brief"),
            ("user", "hi"),
            ("assistant", "hello"),
            ("user", "my name is Ana"),
            ("assistant", "nice to meet you"),
            ("user", "what is my name?"),
        ]);
        let shape = request_shape(&request);
        assert_eq!(shape.system_end, 1);
        assert_eq!(shape.last_user, Some(5));
        assert_eq!(shape.exchanges.len(), 2);
        assert_eq!(shape.exchanges[1].start, 3);
        assert_eq!(shape.exchanges[1].end, 5);
        let first = link(CHAIN_ORIGIN, "hi", "hello");
        assert_eq!(shape.exchanges[0].chain, first);
        assert_eq!(
            shape.prior_chain,
            link(first, "my name is Ana", "nice to meet you")
        );
    }

    #[test]
    fn a_tool_result_with_code_fences_of_its_own_stays_whole() {
        let readme = "# Usage\n```sh\ncargo run\n```\nThat is all.";
        let mut answer = AnswerText::default();
        answer.message(&ChatMessage::new("tool", readme));
        answer.reply("The README says to run it with cargo.", &[]);
        let text = answer.finish();
        // Its own code block is still one block, and the wrapper is not read as code.
        let blocks = crate::code::code_blocks(&text);
        assert_eq!(
            blocks,
            vec![(Some("sh".to_owned()), "cargo run".to_owned())]
        );
        assert_eq!(answer_words(&text), "The README says to run it with cargo.");
        // A line after a label that opens no fence is kept.
        assert_eq!(answer_words("[x returned:]\nplain"), "plain");
        // An answer with no part is kept byte for byte, however it reads.
        let said = "He returned home.\r\nThe end.\n";
        assert!(matches!(answer_words(said), Cow::Borrowed(text) if text == said));
    }

    #[test]
    fn stateless_request_has_no_history() {
        let shape = request_shape(&messages(&[("user", "hello")]));
        assert_eq!(shape.last_user, Some(0));
        assert!(shape.exchanges.is_empty());
        assert_eq!(shape.prior_chain, CHAIN_ORIGIN);
    }
}
