//! Client patterns of real apps, played by the official `openai` Python SDK
//! (`tests/python/conformance.py`) through the real binary in front of the mock upstream; each
//! test reads the exact prompts the mock received and checks what any prompt must hold:
//!
//! - a valid message sequence (instructions first; every assistant `tool_calls` answered by its
//!   `tool` messages, and no `tool` message without its call; no empty message; no two user
//!   messages in a row);
//! - each turn shown once, in one form (the client's own messages, a window turn, or one memory
//!   item of the conversation or artifacts), never twice (`common::prompt_forms`);
//! - code intact: line 7 of the user's script, wherever it appears, is a whole line with its
//!   indentation (plus the two spaces of a memory item's continuation lines);
//! - the budget respected (`x-engram-memory-tokens` ≤ `memory.budget_tokens`).
//!
//! Skips, saying why, without a Python that has the `openai` package (the README's test command
//! sets one up).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use std::collections::HashSet;
use std::process::Command;
use std::time::Duration;

use common::memory::{applied_turn_ids, export, recorded, wait_drained};
use common::prompt_forms::{forms_of, is_memory_block, text};
use common::*;
use serde_json::Value;

/// `memory.budget_tokens`' default.
const BUDGET_TOKENS: u64 = 2048;

/// Line 7 of the script in `conformance.py`, with its indentation.
const LINE_7: &str = "        result += float(row[\"price\"]) * int(row[\"qty\"])  # line 7";

/// What one pattern left behind: the prompts the mock received and the client's reports.
struct Played {
    prompts: Vec<Value>,
    reports: Vec<Value>,
    proxy: Process,
    _upstream: Mock,
}

async fn play(pattern: &str) -> Option<Played> {
    let python = python::python_with_openai()?;
    let record = temp_path(&format!("conformance-{pattern}.jsonl"));
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/python/conformance.py");
    let base = proxy.url("/v1");
    let name = pattern.to_owned();
    let output = tokio::task::spawn_blocking(move || {
        Command::new(python)
            .args([script, &name, &base])
            .env("ENGRAM_ADMIN_TOKEN", ADMIN_TOKEN)
            .output()
            .expect("run python")
    })
    .await
    .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "{pattern}: stdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let reports: Vec<Value> = stdout
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    let prompts = recorded(&record);
    assert_eq!(prompts.len(), reports.len(), "one prompt per request");
    for (prompt, report) in prompts.iter().zip(&reports) {
        check_prompt(prompt);
        let tokens = report["headers"]["x-engram-memory-tokens"]
            .as_str()
            .map_or(0, |tokens| tokens.parse::<u64>().unwrap());
        assert!(tokens <= BUDGET_TOKENS, "over budget: {report}");
    }
    Some(Played {
        prompts,
        reports,
        proxy,
        _upstream: upstream,
    })
}

fn messages(prompt: &Value) -> &[Value] {
    prompt["messages"].as_array().expect("messages")
}

fn check_prompt(prompt: &Value) {
    let messages = messages(prompt);
    let shown = serde_json::to_string_pretty(prompt).unwrap();
    let last_user = messages
        .iter()
        .rposition(|message| message["role"] == "user")
        .expect("a user message");
    let mut open_calls: HashSet<String> = HashSet::new();
    let mut previous_role = "";
    for (at, message) in messages.iter().enumerate() {
        let role = message["role"].as_str().expect("role");
        let has_calls = message["tool_calls"]
            .as_array()
            .is_some_and(|calls| !calls.is_empty());
        assert!(
            !text(message).trim().is_empty() || has_calls,
            "empty message {at}:\n{shown}"
        );
        match role {
            "system" | "developer" => {
                let leading = messages[..at].iter().all(|earlier| {
                    matches!(earlier["role"].as_str(), Some("system" | "developer"))
                });
                let recall_before_question = at + 1 == last_user && is_memory_block(message);
                assert!(
                    leading || recall_before_question,
                    "instruction in the middle, at {at}:\n{shown}"
                );
            }
            "tool" => {
                let id = message["tool_call_id"].as_str().unwrap_or_default();
                assert!(
                    open_calls.remove(id),
                    "tool message {at} without its call:\n{shown}"
                );
            }
            "user" => {
                assert_ne!(previous_role, "user", "two user messages at {at}:\n{shown}");
            }
            _ => {}
        }
        if role != "tool" {
            assert!(
                open_calls.is_empty(),
                "calls not answered before {at}:\n{shown}"
            );
        }
        if has_calls {
            for call in message["tool_calls"].as_array().unwrap() {
                open_calls.insert(call["id"].as_str().unwrap().to_owned());
            }
        }
        previous_role = role;
    }
    let all: String = messages.iter().map(text).collect::<Vec<_>>().join("\n");
    if all.contains("# line 7") {
        // As sent, or inside a memory item, whose lines are indented two spaces past its `- `.
        let whole_line = all
            .lines()
            .any(|line| line == LINE_7 || line.strip_prefix("  ") == Some(LINE_7));
        assert!(whole_line, "line 7 lost its shape:\n{shown}");
    }
    let forms = forms_of(messages);
    let twice = forms.shown_twice();
    assert!(
        twice.is_empty(),
        "turns shown more than once {twice:?}:\n{shown}"
    );
}

/// The user's memory once every recording is applied.
async fn memory_of(played: &Played, user: &str) -> Value {
    wait_drained(&played.proxy, Duration::from_secs(30)).await;
    export(&played.proxy, "default", user).await
}

fn turns_recorded(memory: &Value) -> usize {
    applied_turn_ids(memory).len()
}

#[tokio::test]
async fn a_client_that_resends_its_history_gets_each_turn_once() {
    let Some(played) = play("resend").await else {
        return;
    };
    // What the client carries is never injected again (checked on every prompt above); once
    // the worker has the turns, the oldest resent ones are replaced by their summaries.
    assert_eq!(turns_recorded(&memory_of(&played, "resender").await), 10);
    let last = played.prompts.last().unwrap();
    assert!(messages(last).iter().any(is_memory_block));
}

#[tokio::test]
async fn a_streaming_client_that_resends_its_history_gets_each_turn_once() {
    let Some(played) = play("resend-stream").await else {
        return;
    };
    assert_eq!(turns_recorded(&memory_of(&played, "streamer").await), 10);
}

#[tokio::test]
async fn a_client_that_resends_a_sliding_window_gets_each_turn_once() {
    let Some(played) = play("resend-window").await else {
        return;
    };
    // The exchanges it still carries are never injected again (every prompt, above); those it
    // dropped are what memory gives back.
    assert_eq!(turns_recorded(&memory_of(&played, "window").await), 10);
    let last = played.prompts.last().unwrap();
    let memory: String = messages(last)
        .iter()
        .filter(|message| is_memory_block(message))
        .map(text)
        .collect();
    assert!(memory.contains("mk0x"), "{memory}");
}

#[tokio::test]
async fn a_stateless_client_gets_its_previous_turn_at_once() {
    let Some(played) = play("stateless").await else {
        return;
    };
    // Each follow-up, sent the instant the answer ended, carries the turn before it.
    for (turn, prompt) in played.prompts.iter().enumerate().skip(1) {
        let all: String = messages(prompt).iter().map(text).collect();
        let previous = format!("mk{}x", turn - 1);
        assert!(all.contains(&previous), "turn {turn} lacks {previous}");
    }
    assert_eq!(turns_recorded(&memory_of(&played, "stateless").await), 10);
}

/// The reports of an agent run: (turn, round, receipt state).
fn rounds(played: &Played) -> Vec<(u64, u64, String)> {
    played
        .reports
        .iter()
        .map(|report| {
            (
                report["turn"].as_u64().unwrap(),
                report["round"].as_u64().unwrap(),
                report["headers"]["x-engram-job-state"]
                    .as_str()
                    .unwrap_or_default()
                    .to_owned(),
            )
        })
        .collect()
}

async fn check_agent(played: &Played) {
    // The round that calls the tool is deferred; the round that answers records the turn.
    for (turn, round, state) in rounds(played) {
        let expected = if round == 0 { "deferred" } else { "queued" };
        if state.is_empty() {
            continue; // a streamed round says it in its closing comment, not a header
        }
        assert_eq!(state, expected, "turn {turn} round {round}");
    }
    let memory = memory_of(played, "agent").await;
    // One exchange per user turn, not per round, with its tool call and result.
    let turns = memory["memory"]["raw_turns"].as_array().unwrap();
    assert_eq!(turns.len(), 4, "{memory}");
    for (n, turn) in turns.iter().enumerate() {
        let answer = turn["assistant"].as_str().unwrap();
        assert!(answer.contains("[called lookup"), "{answer}");
        assert!(answer.contains(&format!("mk{n}x")), "{answer}");
        assert!(answer.contains("lookup says: "), "{answer}");
    }
}

#[tokio::test]
async fn a_tool_calling_agent_is_recorded_once_per_turn() {
    let Some(played) = play("agent").await else {
        return;
    };
    check_agent(&played).await;
}

#[tokio::test]
async fn a_stateless_agent_gets_no_broken_tool_sequence() {
    let Some(played) = play("agent-stateless").await else {
        return;
    };
    check_agent(&played).await;
    // The window gives earlier turns without their calls (they could not be valid there).
    for prompt in &played.prompts {
        let messages = messages(prompt);
        let question = messages
            .iter()
            .rposition(|message| message["role"] == "user")
            .unwrap();
        for message in &messages[..question] {
            if message["role"] == "assistant" {
                assert!(!text(message).contains("[called "), "{prompt}");
            }
        }
    }
}

#[tokio::test]
async fn parallel_sessions_of_one_user_each_stay_valid() {
    let Some(played) = play("parallel").await else {
        return;
    };
    assert_eq!(turns_recorded(&memory_of(&played, "parallel").await), 16);
}

#[tokio::test]
async fn an_app_that_sets_user_gets_memory_for_it() {
    let Some(played) = play("user-field").await else {
        return;
    };
    for (turn, report) in played.reports.iter().enumerate().skip(1) {
        assert_eq!(report["headers"]["x-engram-memory"], "injected", "{report}");
        let all: String = messages(&played.prompts[turn]).iter().map(text).collect();
        assert!(all.contains(&format!("mk{}x", turn - 1)), "turn {turn}");
    }
}
