//! In how many forms a prompt shows each turn, by the marker word (`mk<N>x`) each test turn
//! carries. Shared by `tests/conformance.rs` and `benches/client_shapes.rs`.
//!
//! A turn's forms are: the prompt's messages outside memory blocks (the client's own, or the
//! raw window's; a turn's user message and its answer are one exchange, so one form), and each
//! item of a memory block's *Earlier conversation* or *Artifacts* (a raw line, a summary line,
//! an artifact: a line starting `- ` with the lines under it). Facts, identity, constraints,
//! pins and episodes are distilled from turns rather than forms of one; a marker found there is
//! reported apart.

use std::collections::{BTreeMap, BTreeSet, HashSet};

use serde_json::Value;

/// What a prompt shows of its turns.
#[derive(Debug, Default)]
pub struct Forms {
    /// Marker → forms of its turn.
    pub turns: BTreeMap<String, usize>,
    /// Markers also found in a distilled item (a fact line, say).
    pub distilled: BTreeSet<String>,
}

impl Forms {
    /// Turns shown in more than one form.
    pub fn shown_twice(&self) -> Vec<(&String, usize)> {
        self.turns
            .iter()
            .filter(|(_, forms)| **forms > 1)
            .map(|(marker, forms)| (marker, *forms))
            .collect()
    }
}

pub fn text(message: &Value) -> String {
    match &message["content"] {
        Value::String(text) => text.clone(),
        Value::Array(parts) => parts
            .iter()
            .filter_map(|part| part["text"].as_str())
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

pub fn is_memory_block(message: &Value) -> bool {
    text(message).contains("<engram-memory kind=")
}

pub fn forms_of(messages: &[Value]) -> Forms {
    let mut forms = Forms::default();
    let mut in_messages: HashSet<String> = HashSet::new();
    for message in messages {
        let text = text(message);
        if !is_memory_block(message) {
            in_messages.extend(markers(&text));
            continue;
        }
        let mut turn_section = false;
        let mut item = String::new();
        for line in text.lines().chain(std::iter::once("## end")) {
            let heading = line.starts_with("## ") || line.starts_with("</engram");
            if heading || line.starts_with("- ") {
                for marker in markers(&item) {
                    if turn_section {
                        *forms.turns.entry(marker).or_default() += 1;
                    } else {
                        forms.distilled.insert(marker);
                    }
                }
                item.clear();
            }
            if heading {
                turn_section =
                    line.starts_with("## Earlier conversation") || line.starts_with("## Artifacts");
                continue;
            }
            item.push_str(line);
            item.push('\n');
        }
    }
    for marker in in_messages {
        *forms.turns.entry(marker).or_default() += 1;
    }
    forms
}

pub fn markers(text: &str) -> HashSet<String> {
    text.match_indices("mk")
        .filter_map(|(at, _)| {
            let rest = &text[at + 2..];
            let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
            let marked = !digits.is_empty() && rest[digits.len()..].starts_with('x');
            marked.then(|| format!("mk{digits}x"))
        })
        .collect()
}
