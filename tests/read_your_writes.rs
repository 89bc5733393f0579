//! Read-your-writes through the real binary: a stateless client's follow-up, sent the moment
//! the previous answer ended, carries that exchange verbatim, whatever the worker's lag — on
//! the embedded store, on Redis, and on two replicas of a Redis Cluster answering in turn; and
//! with an LLM summarizer that takes seconds per turn.
//!
//! Without `redis-server` on PATH the Redis cases are skipped, unless `ENGRAM_REQUIRE_REDIS=1`
//! (set by `scripts/test.sh`).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods,
    reason = "tests: a failure should fail the test loudly; client tasks need no tracker"
)]

mod common;

use std::collections::HashMap;
use std::path::Path;
use std::time::Duration;

use common::memory::{chat_turn, header, recorded};
use common::redis::RedisServer;
use common::redis_cluster::RedisCluster;
use common::{Process, Reply, mock, post_json, proxy, temp_path};
use serde_json::{Value, json};
use tokio::task::JoinSet;

const SESSIONS: usize = 100;
const TURNS: usize = 20;

/// The answers' end waits for the durable append up to this long. A debug build serving 100
/// sessions on a loaded 2-core machine can take longer than the 1 s default; what is checked
/// here is what a `queued` receipt promises, not how fast it comes.
const RECEIPT_WAIT: (&str, &str) = ("ENGRAM_CAPTURE__RECEIPT_WAIT_MS", "15000");

/// The cases here each run 100 sessions at once, or time an answer; one at a time keeps the
/// machine's load (and so the test) about the follow-ups rather than about CPU starvation. The
/// slow-summarizer case took no turn: started beside the timed case, its debug proxy's start
/// made the timed answer take 2 s instead of milliseconds on 2 cores, every full run.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

fn user_text(session: usize, turn: usize) -> String {
    if turn == 0 {
        format!("Hi! In session {session} my code word is zeta-{session}-0.")
    } else {
        format!(
            "Session {session} turn {turn}: what did you just answer? My code word is \
             zeta-{session}-{turn}."
        )
    }
}

/// One stateless turn of the one user: only the new message.
async fn ask(address: &str, session: usize, text: &str, stream: bool) -> Reply {
    let session_id = format!("s{session}");
    chat_turn(address, "ryw", "solo", &session_id, text, stream).await
}

/// The answer's text, from a whole completion or a stream.
fn answer_text(reply: &Reply) -> String {
    let body = String::from_utf8_lossy(&reply.body);
    if let Ok(completion) = serde_json::from_str::<Value>(&body) {
        return completion["choices"][0]["message"]["content"]
            .as_str()
            .unwrap()
            .to_owned();
    }
    body.lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter(|data| *data != "[DONE]")
        .filter_map(|data| serde_json::from_str::<Value>(data).ok())
        .filter_map(|chunk| {
            chunk["choices"][0]["delta"]["content"]
                .as_str()
                .map(str::to_owned)
        })
        .collect()
}

/// The receipt of a recorded answer: the header of a whole one, the closing comment of a stream.
fn receipt(reply: &Reply) -> String {
    if let Some(value) = reply.headers.get("x-engram-job-state") {
        return value.to_str().unwrap().to_owned();
    }
    let body = String::from_utf8_lossy(&reply.body);
    let comment = body
        .lines()
        .rev()
        .find(|line| line.starts_with(": engram "))
        .unwrap_or_else(|| panic!("no receipt in {body}"));
    comment
        .split_whitespace()
        .find_map(|field| field.strip_prefix("state="))
        .unwrap()
        .to_owned()
}

/// `SESSIONS` sessions of one user at once, each `TURNS` turns sent back to back (the next the
/// moment the previous answer ended), turn `k` to `addresses[k % len]`, streams and whole
/// answers alternating. Returns each session's answers in order.
async fn converse(addresses: &[String], sessions: usize) -> Vec<Vec<(String, String)>> {
    let mut tasks = JoinSet::new();
    for session in 0..sessions {
        let addresses = addresses.to_vec();
        tasks.spawn(async move {
            let mut answers = Vec::new();
            for turn in 0..TURNS {
                let address = &addresses[turn % addresses.len()];
                let stream = (session + turn) % 2 == 1;
                let reply = ask(address, session, &user_text(session, turn), stream).await;
                assert_eq!(receipt(&reply), "queued", "session {session} turn {turn}");
                let memory = ["x-engram-memory", "x-engram-memory-reason"]
                    .map(|name| {
                        reply
                            .headers
                            .get(name)
                            .map_or("", |value| value.to_str().unwrap())
                            .to_owned()
                    })
                    .join(" ");
                answers.push((answer_text(&reply), memory));
            }
            (session, answers)
        });
    }
    let mut answers = vec![Vec::new(); sessions];
    while let Some(done) = tasks.join_next().await {
        let (session, session_answers) = done.unwrap();
        answers[session] = session_answers;
    }
    answers
}

/// Every prompt after a session's first carries the previous exchange verbatim, as the user and
/// assistant messages just before the new question.
fn assert_each_prompt_carries_the_previous_exchange(
    record: &Path,
    answers: &[Vec<(String, String)>],
    sessions: usize,
    proxies: &[&Process],
) {
    let prompts: HashMap<String, Value> = recorded(record)
        .into_iter()
        .map(|prompt| {
            let messages = prompt["messages"].as_array().unwrap();
            let last = messages.last().unwrap()["content"]
                .as_str()
                .unwrap()
                .to_owned();
            (last, prompt)
        })
        .collect();
    let mut missing = Vec::new();
    for (session, session_answers) in answers.iter().enumerate().take(sessions) {
        for turn in 1..TURNS {
            let prompt = &prompts[&user_text(session, turn)];
            let messages = prompt["messages"].as_array().unwrap();
            let texts: Vec<(&str, &str)> = messages
                .iter()
                .map(|message| {
                    (
                        message["role"].as_str().unwrap(),
                        message["content"].as_str().unwrap_or_default(),
                    )
                })
                .collect();
            let previous = [
                ("user", user_text(session, turn - 1)),
                ("assistant", session_answers[turn - 1].0.clone()),
            ];
            let carried = texts.windows(2).any(|pair| {
                pair[0] == (previous[0].0, previous[0].1.as_str())
                    && pair[1] == (previous[1].0, previous[1].1.as_str())
            });
            if !carried {
                missing.push(format!(
                    "session {session} turn {turn} (memory: {}): {texts:?}",
                    session_answers[turn].1
                ));
            }
        }
    }
    // A degraded answer says why only in the proxy's log.
    let warnings: Vec<String> = proxies
        .iter()
        .flat_map(|proxy| proxy.stderr_lines())
        .filter(|line| line.contains("WARN") || line.contains("ERROR"))
        .collect();
    assert!(
        missing.is_empty(),
        "{} of {} follow-ups lacked the previous exchange; first: {}; the proxies warned: {warnings:#?}",
        missing.len(),
        sessions * (TURNS - 1),
        missing.first().map_or("", String::as_str)
    );
}

#[tokio::test]
async fn instant_follow_ups_carry_the_previous_exchange_on_the_embedded_store() {
    let record = temp_path("ryw-embedded.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let _one = ONE_AT_A_TIME.lock().await;
    let proxy = proxy(&upstream.address, &[RECEIPT_WAIT]);
    let answers = converse(&[proxy.url("")], SESSIONS).await;
    assert_each_prompt_carries_the_previous_exchange(&record, &answers, SESSIONS, &[&proxy]);
}

#[tokio::test]
async fn without_a_worker_follow_ups_still_carry_the_previous_exchange() {
    let record = temp_path("ryw-no-worker.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let _one = ONE_AT_A_TIME.lock().await;
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_WORKER__ENABLED", "false"), RECEIPT_WAIT],
    );
    let answers = converse(&[proxy.url("")], 10).await;
    assert_each_prompt_carries_the_previous_exchange(&record, &answers, 10, &[&proxy]);
}

#[tokio::test]
async fn instant_follow_ups_carry_the_previous_exchange_on_redis() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let record = temp_path("ryw-redis.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let url = redis.url();
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_STORE__BACKEND", "redis"),
            ("ENGRAM_STORE__REDIS_URL", url.as_str()),
            RECEIPT_WAIT,
        ],
    );
    let answers = converse(&[proxy.url("")], SESSIONS).await;
    assert_each_prompt_carries_the_previous_exchange(&record, &answers, SESSIONS, &[&proxy]);
}

#[tokio::test]
async fn two_replicas_on_a_redis_cluster_answering_in_turn_each_see_the_others_exchange() {
    let _one = ONE_AT_A_TIME.lock().await;
    let Some(cluster) = RedisCluster::start().await else {
        return;
    };
    let record = temp_path("ryw-cluster.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let urls = cluster.urls();
    let env = [
        ("ENGRAM_STORE__BACKEND", "redis"),
        ("ENGRAM_STORE__REDIS_URL", urls.as_str()),
        ("ENGRAM_STORE__REDIS_CLUSTER", "true"),
        ("ENGRAM_STORE__REDIS_QUEUE_SHARDS", "3"),
        RECEIPT_WAIT,
    ];
    let replicas: Vec<Process> = (0..2).map(|_| proxy(&upstream.address, &env)).collect();
    let addresses: Vec<String> = replicas.iter().map(|replica| replica.url("")).collect();
    let answers = converse(&addresses, SESSIONS).await;
    let proxies: Vec<&Process> = replicas.iter().collect();
    assert_each_prompt_carries_the_previous_exchange(&record, &answers, SESSIONS, &proxies);
}

#[tokio::test]
async fn a_follow_up_while_a_slow_summarizer_works_carries_the_previous_exchange() {
    let _one = ONE_AT_A_TIME.lock().await;
    // The summarizer answers after 5 s; the worker waits for it before applying the turn.
    let summarizer = mock(&["--latency-ms", "5000"]);
    let summarizer_url = format!("{}/v1", summarizer.address);
    let record = temp_path("ryw-summarizer.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_SUMMARIZER__BASE_URL", summarizer_url.as_str()),
            ("ENGRAM_SUMMARIZER__TIMEOUT_MS", "20000"),
        ],
    );
    let address = proxy.url("");
    let first = ask(&address, 0, &user_text(0, 0), false).await;
    assert_eq!(header(&first, "x-engram-job-state"), "queued");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let follow_up = ask(&address, 0, &user_text(0, 1), true).await;
    assert_eq!(receipt(&follow_up), "queued");
    // The worker is still waiting for the summarizer: nothing of the first turn is applied.
    let memory = common::memory::export(&proxy, "ryw", "solo").await;
    assert!(
        memory["memory"]["raw_turns"]
            .as_array()
            .is_none_or(Vec::is_empty),
        "{memory}"
    );
    let prompts = recorded(&record);
    assert_eq!(prompts.len(), 2);
    let messages = prompts[1]["messages"].as_array().unwrap();
    let roles: Vec<&str> = messages
        .iter()
        .map(|message| message["role"].as_str().unwrap())
        .collect();
    assert!(roles.ends_with(&["user", "assistant", "user"]), "{roles:?}");
    let n = messages.len();
    assert_eq!(messages[n - 3]["content"], user_text(0, 0));
    assert_eq!(messages[n - 2]["content"], answer_text(&first).as_str());
}

#[tokio::test]
async fn an_answer_beside_a_longer_one_of_its_session_ends_at_once_and_is_pending_until_recorded() {
    let _one = ONE_AT_A_TIME.lock().await;
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[RECEIPT_WAIT]);
    let headers = [
        ("x-engram-tenant", "ryw"),
        ("x-engram-user", "solo"),
        ("x-engram-session", "side"),
    ];
    // A stream of 2.4 s, and beside it a short answer of the same session: its recording waits
    // for the stream's (a session's jobs queue in arrival order), but its answer does not.
    let url = proxy.url("/v1/chat/completions");
    let long_body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": true,
    });
    let long_url = url.clone();
    let long = tokio::spawn(async move {
        let mut with_delay = headers.to_vec();
        with_delay.extend([("x-mock-chunks", "8"), ("x-mock-chunk-delay-ms", "300")]);
        post_json(&long_url, &long_body, &with_delay).await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let short_body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "And what time is it?"}],
    });
    let started = std::time::Instant::now();
    let short = post_json(&url, &short_body, &headers).await;
    assert!(
        started.elapsed() < Duration::from_millis(1500),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(header(&short, "x-engram-job-state"), "pending");
    let job = header(&short, "x-engram-job-id").to_owned();
    let state =
        common::memory::admin(&proxy, &format!("/engram/v1/users/solo/jobs/{job}"), "ryw").await;
    assert_eq!(state.json()["state"], "pending", "{}", state.json());
    let long = long.await.unwrap();
    assert_eq!(receipt(&long), "queued");
    common::memory::wait_applied(&proxy, "ryw", "solo", &short).await;
}
