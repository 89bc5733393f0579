//! Injected tokens by client shape (issue 28): one 50-turn conversation sent by a client that
//! resends its whole history and by a stateless client (only its latest message), through
//! `engram serve` on a fresh embedded store in front of the mock upstream (`x-mock-script:
//! parrot`, so each answer differs).
//!
//! Each shape runs twice: `instant` sends each turn the moment the answer ends (the worker may
//! be behind), `settled` waits for the worker to apply every recorded turn first. For each, it
//! reports at turns 10, 25 and 50 and in total: the tokens engram injected
//! (`x-engram-memory-tokens`), the tokens of the prompt the mock received and of the client's
//! own messages (cl100k), the turns shown more than once in a prompt, and the turns shown and
//! also named by a fact (`tests/common/prompt_forms.rs` says what counts as a form).
//!
//! Run: `cargo bench --bench client_shapes`. Not a test: it prints numbers and asserts nothing.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark binary: it reports on stdout and stops loudly on a broken setup"
)]

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use engram_memory::Encoding;
use engram_memory::tokens::count_in;
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

#[path = "support/mock_process.rs"]
mod mock_process;
#[path = "../tests/common/prompt_forms.rs"]
mod prompt_forms;

use prompt_forms::{forms_of, text};

const BIN: &str = env!("CARGO_BIN_EXE_engram");
const TURNS: usize = 50;
const ADMIN_TOKEN: &str = "bench-admin-token";
const SYSTEM: &str = "You are a helpful assistant.";

/// A child process killed on drop, with the address it printed.
struct Process {
    child: Child,
    address: String,
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn spawn(args: &[&str], env: &[(&str, &str)], ready: &str) -> Process {
    let mut command = Command::new(mock_process::program(args, BIN));
    command
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().expect("start engram");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let address = loop {
        let line = lines
            .next()
            .expect("the process ended")
            .expect("read stdout");
        if let Some(address) = line.strip_prefix(ready) {
            break address.trim().to_owned();
        }
    };
    // Keep draining stdout so the child never blocks on a full pipe.
    std::thread::spawn(move || for _ in lines {});
    Process { child, address }
}

/// The user's message of a turn: varied statements and questions, each with a marker word.
fn user_text(turn: usize) -> String {
    const PEOPLE: [&str; 5] = [
        "my sister Mia",
        "my friend Omar",
        "my boss",
        "my neighbour",
        "Dad",
    ];
    const PLACES: [&str; 5] = ["Porto", "the lake", "a bakery", "the gym", "the library"];
    const THINGS: [&str; 5] = [
        "a red bike",
        "sourdough",
        "a chess set",
        "tulips",
        "a kayak",
    ];
    let person = PEOPLE[turn % 5];
    let place = PLACES[(turn / 5) % 5];
    let thing = THINGS[(turn / 2) % 5];
    match turn % 4 {
        0 => format!("Today {person} and I went to {place} (note mk{turn}x)."),
        1 => {
            format!("I am thinking of buying {thing} for {person}; is that a good idea? mk{turn}x")
        }
        2 => format!("Remind me what I said about {place} earlier? mk{turn}x"),
        _ => format!("By the way, {person} loves {thing}. mk{turn}x"),
    }
}

fn tokens_of(messages: &[Value]) -> u64 {
    messages
        .iter()
        .map(|message| u64::from(count_in(Encoding::Cl100k, &text(message))) + 4)
        .sum()
}

#[derive(Default, Clone, Copy)]
struct Turn {
    injected: u64,
    prompt: u64,
    client: u64,
    shown_twice: usize,
    /// Turns shown (in one form) and also in a fact or other distilled item.
    also_distilled: usize,
}

struct Run {
    shape: &'static str,
    timing: &'static str,
    turns: Vec<Turn>,
}

async fn post(
    client: &Client<HttpConnector, Full<Bytes>>,
    url: &str,
    body: &Value,
    headers: &[(&str, &str)],
) -> (http::HeaderMap, Value) {
    let mut request = Request::post(url).header("content-type", "application/json");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request
        .body(Full::new(Bytes::from(body.to_string())))
        .unwrap();
    let response = client.request(request).await.expect("request");
    let headers = response.headers().clone();
    let body = response.into_body().collect().await.unwrap().to_bytes();
    (
        headers,
        serde_json::from_slice(&body).unwrap_or(Value::Null),
    )
}

async fn wait_applied(client: &Client<HttpConnector, Full<Bytes>>, proxy: &str) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let request = Request::get(format!("{proxy}/engram/v1/queue"))
            .header("authorization", format!("Bearer {ADMIN_TOKEN}"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let response = client.request(request).await.expect("queue");
        let body = response.into_body().collect().await.unwrap().to_bytes();
        let queue: Value = serde_json::from_slice(&body).unwrap();
        if queue["depth"] == 0 && queue["recorded"]["in_flight"] == 0 {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "the worker did not catch up: {queue}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

async fn run(shape: &'static str, timing: &'static str, work: &Path) -> Run {
    let record = work.join(format!("{shape}-{timing}.jsonl"));
    let data = work.join(format!("{shape}-{timing}-data"));
    let mock = spawn(
        &[
            "mock-upstream",
            "--listen",
            "127.0.0.1:0",
            "--record",
            record.to_str().unwrap(),
        ],
        &[],
        "mock-upstream listening on ",
    );
    let upstream = format!("{}/v1", mock.address);
    let proxy = spawn(
        &["serve", "--listen", "127.0.0.1:0", "--upstream", &upstream],
        &[
            ("ENGRAM_STORE__DATA_DIR", data.to_str().unwrap()),
            ("ENGRAM_ADMIN_TOKEN", ADMIN_TOKEN),
            ("ENGRAM_LOGGING__LEVEL", "warn"),
        ],
        "engram listening on ",
    );
    let client = Client::builder(TokioExecutor::new()).build_http();
    let url = format!("{}/v1/chat/completions", proxy.address);
    let headers = [
        ("x-engram-user", "bench"),
        ("x-engram-session", "s1"),
        ("x-mock-script", "parrot"),
    ];
    let mut history = vec![json!({"role": "system", "content": SYSTEM})];
    let mut turns = Vec::new();
    for turn in 0..TURNS {
        if timing == "settled" {
            wait_applied(&client, &proxy.address).await;
        }
        let asked = json!({"role": "user", "content": user_text(turn)});
        let messages: Vec<Value> = match shape {
            "resend" => history.iter().cloned().chain([asked.clone()]).collect(),
            _ => vec![history[0].clone(), asked.clone()],
        };
        let body = json!({"model": "gpt-4o-mini", "messages": messages});
        let (reply_headers, reply) = post(&client, &url, &body, &headers).await;
        let answer = reply["choices"][0]["message"]["content"]
            .as_str()
            .expect("an answer")
            .to_owned();
        let injected = reply_headers
            .get("x-engram-memory-tokens")
            .and_then(|value| value.to_str().ok())
            .and_then(|value| value.parse().ok())
            .unwrap_or(0);
        turns.push(Turn {
            injected,
            client: tokens_of(&messages),
            ..Turn::default()
        });
        history.push(asked);
        history.push(json!({"role": "assistant", "content": answer}));
    }
    // The prompts as the mock received them, in order.
    let prompts: Vec<Value> = std::fs::read_to_string(&record)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    for (turn, prompt) in turns.iter_mut().zip(&prompts) {
        let messages = prompt["messages"].as_array().unwrap();
        turn.prompt = tokens_of(messages);
        let forms = forms_of(messages);
        turn.shown_twice = forms.shown_twice().len();
        turn.also_distilled = forms
            .distilled
            .iter()
            .filter(|marker| forms.turns.contains_key(*marker))
            .count();
    }
    Run {
        shape,
        timing,
        turns,
    }
}

fn main() {
    mock_process::serve_if_asked();
    let work = tempfile::tempdir().unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mut runs = Vec::new();
    for shape in ["resend", "stateless"] {
        for timing in ["instant", "settled"] {
            eprintln!("{shape}, {timing}: {TURNS} turns");
            runs.push(runtime.block_on(run(shape, timing, work.path())));
        }
    }
    println!(
        "| client | timing | turn | injected tokens | prompt tokens | client's own tokens | turns shown twice | turns shown and in a fact |"
    );
    println!("|---|---|---|---|---|---|---|---|");
    for run in &runs {
        for at in [10, 25, 50] {
            let turn = run.turns[at - 1];
            println!(
                "| {} | {} | {at} | {} | {} | {} | {} | {} |",
                run.shape,
                run.timing,
                turn.injected,
                turn.prompt,
                turn.client,
                turn.shown_twice,
                turn.also_distilled
            );
        }
        let sum = |field: fn(&Turn) -> u64| run.turns.iter().map(field).sum::<u64>();
        println!(
            "| {} | {} | all {TURNS} | {} | {} | {} | {} | {} |",
            run.shape,
            run.timing,
            sum(|turn| turn.injected),
            sum(|turn| turn.prompt),
            sum(|turn| turn.client),
            sum(|turn| turn.shown_twice as u64),
            sum(|turn| turn.also_distilled as u64)
        );
    }
}
