//! Client-side helpers for memory tests: a stateless chat turn, the admin API, waiting for the
//! worker, and reading what the mock upstream recorded.

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::{ADMIN_TOKEN, Process, Reply, post_json, send};

/// One chat turn as a stateless client: only the new user message.
pub async fn say(proxy: &Process, tenant: &str, user: &str, session: &str, text: &str) -> Reply {
    chat_turn(&proxy.url(""), tenant, user, session, text, false).await
}

/// [`say`] at a proxy's address (`http://host:port`), streamed or not; the answer must be 200.
pub async fn chat_turn(
    address: &str,
    tenant: &str,
    user: &str,
    session: &str,
    text: &str,
    stream: bool,
) -> Reply {
    let mut body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": text}],
    });
    if stream {
        body["stream"] = json!(true);
    }
    let reply = post_json(
        &format!("{address}/v1/chat/completions"),
        &body,
        &[
            ("x-engram-tenant", tenant),
            ("x-engram-user", user),
            ("x-engram-session", session),
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

pub async fn admin(proxy: &Process, path: &str, tenant: &str) -> Reply {
    admin_request(proxy, "GET", path, tenant, "").await
}

/// A management API call with the test token, as `tenant`, with a JSON body.
pub async fn admin_request(
    proxy: &Process,
    method: &str,
    path: &str,
    tenant: &str,
    body: &str,
) -> Reply {
    let auth = format!("Bearer {ADMIN_TOKEN}");
    send(
        method,
        &proxy.url(path),
        &[
            ("authorization", auth.as_str()),
            ("x-engram-tenant", tenant),
            ("content-type", "application/json"),
        ],
        body.to_owned(),
    )
    .await
}

pub fn header<'a>(reply: &'a Reply, name: &str) -> &'a str {
    reply
        .headers
        .get(name)
        .unwrap_or_else(|| panic!("no {name} header"))
        .to_str()
        .unwrap()
}

/// Waits until the job the reply names is applied.
pub async fn wait_applied(proxy: &Process, tenant: &str, user: &str, reply: &Reply) {
    let job = header(reply, "x-engram-job-id").to_owned();
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let state = admin(
            proxy,
            &format!("/engram/v1/users/{user}/jobs/{job}"),
            tenant,
        )
        .await;
        if state.status == 200 && state.json()["state"] == "applied" {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "job {job} not applied: {}",
            String::from_utf8_lossy(&state.body)
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Waits until no recording is in flight and the queue and the local spool are empty.
pub async fn wait_drained(proxy: &Process, within: Duration) -> Value {
    let deadline = Instant::now() + within;
    loop {
        let queue = admin(proxy, "/engram/v1/queue", "default").await;
        if queue.status == 200 {
            let body = queue.json();
            if body["depth"] == 0 && body["spooled"] == 0 && body["recorded"]["in_flight"] == 0 {
                return body;
            }
            assert!(Instant::now() < deadline, "queue not drained: {body}");
        } else {
            assert!(
                Instant::now() < deadline,
                "queue endpoint: {}",
                queue.status
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub async fn export(proxy: &Process, tenant: &str, user: &str) -> Value {
    let reply = admin(proxy, &format!("/engram/v1/users/{user}/memory"), tenant).await;
    assert_eq!(reply.status.as_u16(), 200);
    reply.json()
}

/// The turn ids of an exported memory's raw log, in log order.
pub fn raw_turn_ids(memory: &Value) -> Vec<String> {
    memory["raw_log"]
        .as_array()
        .expect("raw_log")
        .iter()
        .map(|entry| {
            entry["exchange"]["turn_id"]
                .as_str()
                .expect("turn id")
                .to_owned()
        })
        .collect()
}

/// The ids of the turns applied to an exported memory, in memory order.
pub fn applied_turn_ids(memory: &Value) -> Vec<String> {
    memory["memory"]["raw_turns"]
        .as_array()
        .expect("raw_turns")
        .iter()
        .map(|turn| turn["id"].as_str().expect("turn id").to_owned())
        .collect()
}

/// The requests the mock recorded, in arrival order.
pub fn recorded(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect()
}

/// Every message of a recorded prompt except the last one (the client's own new message).
pub fn memory_part(prompt: &Value) -> String {
    let messages = prompt["messages"].as_array().unwrap();
    messages[..messages.len() - 1]
        .iter()
        .map(|message| message["content"].as_str().unwrap_or_default())
        .collect::<Vec<_>>()
        .join("\n")
}
