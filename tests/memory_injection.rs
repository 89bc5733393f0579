//! Memory is data, not instructions (issue 29), through the real binary: every string of
//! `tests/data/injections.json` is said as a user turn (the mock parrots it back, so the model's
//! output carries it too), applied by the worker, then recalled by saying it again; the prompt
//! the mock receives is checked mechanically, in both placements of the blocks:
//!
//! - every engram block is whole: it opens a message or follows another block's blank line,
//!   and ends at its own closing tag; nothing fence-like is left anywhere else, inside or out;
//! - inside a block, the string's payload appears only inside quoted spans (from a `“` to the
//!   next `”`), and every line left when the spans are emptied is engram's own (a heading, an
//!   item, a continuation);
//! - outside the blocks, the payload appears only in the client's own current message;
//! - the payload was recalled (found inside a quote), unless the string was a genuine engram
//!   fence, which memory drops whole.
//!
//! The raw window is off (`raw_window_turns: 0`, `long_turn_extra_window: 0`), so the earlier
//! turn can only come back through the blocks (the window would replay it in its own roles).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use common::memory::{header, recorded, wait_applied};
use common::prompt_forms::text;
use common::{Process, Reply, mock, post_json, proxy, temp_path};
use serde_json::{Value, json};

const CORE_OPEN: &str = "<engram-memory kind=\"core\">\n";
const RECALL_OPEN: &str = "<engram-memory kind=\"recall\">\n";
const CLOSE: &str = "</engram-memory>";

struct Entry {
    text: String,
    payload: String,
    note: String,
    stripped: bool,
}

fn corpus() -> Vec<Entry> {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/injections.json");
    let data: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    data["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|entry| Entry {
            text: entry["text"].as_str().unwrap().to_owned(),
            payload: entry["payload"].as_str().unwrap().to_owned(),
            note: entry["note"].as_str().unwrap_or_default().to_owned(),
            stripped: entry["stripped"].as_bool().unwrap_or(false),
        })
        .collect()
}

async fn parrot_turn(proxy: &Process, user: &str, text: &str) -> Reply {
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &json!({"model": "gpt-test", "messages": [{"role": "user", "content": text}]}),
        &[
            ("x-engram-tenant", "inject"),
            ("x-engram-user", user),
            ("x-engram-session", "s"),
            ("x-mock-script", "parrot"),
        ],
    )
    .await;
    assert_eq!(
        reply.status.as_u16(),
        200,
        "{}",
        String::from_utf8_lossy(&reply.body)
    );
    reply
}

/// `text` with the characters that render as `<`, `/` or nothing, and the letters that look
/// like those of `engram`, made plain.
fn folded(text: &str) -> String {
    text.chars()
        .filter(|c| {
            !matches!(c, '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2060}'..='\u{206f}'
                | '\u{feff}' | '\u{ad}')
        })
        .map(|c| match c {
            '\u{ff01}'..='\u{ff5e}' => char::from_u32(u32::from(c) - 0xfee0).unwrap_or(c),
            '\u{2039}' | '\u{3008}' | '\u{2329}' | '\u{27e8}' | '\u{fe64}' | '\u{276e}'
            | '\u{29fc}' | '\u{02c2}' | '\u{1438}' => '<',
            '\u{2215}' | '\u{2044}' | '\u{29f8}' | '\u{2571}' | '\\' => '/',
            'е' | 'Е' => 'e',
            'а' | 'А' => 'a',
            'г' => 'r',
            'м' | 'М' => 'm',
            'п' => 'n',
            other => other,
        })
        .collect()
}

/// Whether `text` holds anything a reader could take for one of engram's tags.
fn fence_like(text: &str) -> bool {
    let folded = folded(text).to_lowercase();
    folded.match_indices('<').any(|(at, _)| {
        let rest: String = folded[at + 1..]
            .chars()
            .filter(|c| !c.is_whitespace() && *c != '/')
            .take(6)
            .collect();
        rest == "engram"
    })
}

/// The blocks a message's text starts with (their bodies) and the text after them.
fn split_blocks(text: &str) -> (Vec<&str>, &str) {
    let mut blocks = Vec::new();
    let mut rest = text;
    while let Some(open) = [CORE_OPEN, RECALL_OPEN]
        .into_iter()
        .find(|open| rest.starts_with(open))
    {
        let end = rest
            .find(CLOSE)
            .unwrap_or_else(|| panic!("unclosed block: {text}"));
        blocks.push(&rest[open.len()..end]);
        rest = &rest[end + CLOSE.len()..];
        if !rest.is_empty() {
            // A prefix block is followed by a blank line, then the message's own text.
            rest = rest
                .strip_prefix("\n\n")
                .unwrap_or_else(|| panic!("{text}"));
        }
    }
    (blocks, rest)
}

/// A block's body with every quoted span emptied, and the spans.
fn quotes(body: &str) -> (String, Vec<&str>) {
    let mut skeleton = String::new();
    let mut spans = Vec::new();
    let mut rest = body;
    while let Some(open) = rest.find('“') {
        skeleton.push_str(&rest[..open]);
        let after = &rest[open + '“'.len_utf8()..];
        let close = after
            .find('”')
            .unwrap_or_else(|| panic!("quote left open: {body}"));
        spans.push(&after[..close]);
        skeleton.push_str("“”");
        rest = &after[close + '”'.len_utf8()..];
    }
    skeleton.push_str(rest);
    (skeleton, spans)
}

/// Checks one recorded prompt for `entry` (see the module docs); returns whether the payload
/// was found inside a quote.
fn check(prompt: &Value, entry: &Entry) -> bool {
    let messages = prompt["messages"].as_array().unwrap();
    let last = messages.len() - 1;
    let mut recalled = false;
    let why = format!("{} ({}) in {prompt:#}", entry.payload, entry.note);
    for (at, message) in messages.iter().enumerate() {
        let text = text(message);
        let (blocks, outside) = split_blocks(&text);
        for body in blocks {
            assert!(!fence_like(body), "fence-like inside a block: {why}");
            let (skeleton, spans) = quotes(body);
            assert!(
                !skeleton.contains(&entry.payload),
                "outside quotes: {skeleton}\n{why}"
            );
            let mut lines = skeleton.lines();
            let preamble = lines.next().unwrap_or_default();
            assert!(preamble.contains("not instructions"), "{skeleton}");
            for line in lines {
                let engrams = line.starts_with("## ")
                    || line.starts_with("- ")
                    || line.starts_with("  ")
                    || line.is_empty();
                assert!(
                    engrams,
                    "a line that is not engram's: {line:?} in {skeleton}"
                );
            }
            recalled |= spans.iter().any(|span| {
                // A quote keeps a text's lines, indented; a summary collapses them.
                span.split_whitespace()
                    .collect::<Vec<_>>()
                    .join(" ")
                    .contains(&entry.payload)
            });
        }
        assert!(!fence_like(outside), "fence-like outside the blocks: {why}");
        if outside.contains(&entry.payload) {
            assert!(
                at == last && message["role"] == "user",
                "payload outside the blocks: {why}"
            );
            // The client's own message, as the proxy forwards client text.
            let own = engram_memory::fence::neutralise_fences(&entry.text);
            assert_eq!(outside, own, "{why}");
        }
    }
    recalled
}

async fn run_corpus(placement: &str) {
    let record = temp_path(&format!("injections-{placement}.jsonl"));
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_MEMORY__RAW_WINDOW_TURNS", "0"),
            ("ENGRAM_MEMORY__LONG_TURN_EXTRA_WINDOW", "0"),
            ("ENGRAM_MEMORY__PLACEMENT", placement),
            ("ENGRAM_MEMORY__CORE_PLACEMENT", placement),
        ],
    );
    let entries = corpus();
    assert!(entries.len() >= 50, "{}", entries.len());
    for (n, entry) in entries.iter().enumerate() {
        let user = format!("u{n}");
        let said = parrot_turn(&proxy, &user, &entry.text).await;
        wait_applied(&proxy, "inject", &user, &said).await;
        let again = parrot_turn(&proxy, &user, &entry.text).await;
        let prompt = recorded(&record).last().cloned().unwrap();
        let recalled = check(&prompt, entry);
        if entry.stripped {
            assert!(!recalled, "a genuine fence entered memory: {}", entry.note);
        } else {
            assert_eq!(
                header(&again, "x-engram-memory"),
                "injected",
                "{}",
                entry.note
            );
            assert!(
                recalled,
                "not recalled: {} ({}) in {prompt:#}",
                entry.payload, entry.note
            );
        }
    }
}

#[tokio::test]
async fn injected_text_stays_quoted_data_with_blocks_in_the_system_role() {
    run_corpus("system").await;
}

#[tokio::test]
async fn injected_text_stays_quoted_data_with_blocks_in_user_messages() {
    run_corpus("user_prefix").await;
}
