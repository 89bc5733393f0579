//! Forgetting a user through the real binary leaves nothing of theirs: no Redis key (scanned),
//! no stream entry or value that names them, no row in the embedded store's file (every table
//! read back after the proxy stopped); other users keep theirs.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use std::time::{Duration, Instant};

use common::memory::{admin, admin_request, export, header, say, wait_applied};
use common::redis::{RedisServer, store_env};
use common::{Process, mock, proxy};
use engram_store::EmbeddedStore;
use serde_json::Value;

const TENANT: &str = "acme";
/// The forgotten user, and a word only their turns contain.
const GONE: &str = "zed-forget-me";
const MARKER: &str = "zanzibar";
const KEPT: &str = "kim";

/// Records turns of the forgotten user in two sessions and one of the kept user, then waits
/// until every recording is queued. Returns the forgotten user's turn ids.
async fn record_turns(proxy: &Process, turns: usize, expected_depth: u64) -> Vec<String> {
    let mut ids = Vec::new();
    for turn in 0..turns {
        let session = if turn % 2 == 0 { "s1" } else { "s2" };
        let text = format!("My {MARKER} code for turn {turn} is {turn}{turn}.");
        let reply = say(proxy, TENANT, GONE, session, &text).await;
        ids.push(header(&reply, "x-engram-turn-id").to_owned());
    }
    say(proxy, TENANT, KEPT, "s", "I collect stamps.").await;
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let queue = admin(proxy, "/engram/v1/queue", TENANT).await.json();
        if queue["recorded"]["in_flight"] == 0 && queue["depth"] == expected_depth {
            return ids;
        }
        assert!(Instant::now() < deadline, "not queued: {queue}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Applies three turns of the forgotten user (state, raw log, applied jobs, prefetched) and
/// edits their memory through the API.
async fn applied_memory(proxy: &Process) -> Vec<String> {
    let mut turns = Vec::new();
    for turn in 0..3 {
        let text = format!("Remember my {MARKER} locker number is 4{turn}.");
        let reply = say(proxy, TENANT, GONE, "s1", &text).await;
        wait_applied(proxy, TENANT, GONE, &reply).await;
        turns.push(header(&reply, "x-engram-turn-id").to_owned());
    }
    for (method, path, body) in [
        ("PUT", "identity", format!(r#"{{"text": "{MARKER} fan"}}"#)),
        ("POST", "pins", format!(r#"{{"text": "{MARKER} first"}}"#)),
    ] {
        let path = format!("/engram/v1/users/{GONE}/{path}");
        let reply = admin_request(proxy, method, &path, TENANT, &body).await;
        assert!(
            reply.status.is_success(),
            "{method} {path}: {}",
            reply.status
        );
    }
    turns
}

async fn forget(proxy: &Process) -> Value {
    let reply = admin_request(
        proxy,
        "DELETE",
        &format!("/engram/v1/users/{GONE}"),
        TENANT,
        "",
    )
    .await;
    assert_eq!(reply.status.as_u16(), 200);
    reply.json()
}

fn stop(mut proxy: Process) {
    proxy.signal("TERM");
    assert!(
        proxy.wait_exit(Duration::from_secs(20)).is_some(),
        "proxy did not stop"
    );
}

#[tokio::test]
async fn forget_leaves_no_row_of_the_user_in_the_embedded_store() {
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().display().to_string();
    let upstream = mock(&[]);
    let store = [("ENGRAM_STORE__DATA_DIR", data_dir.as_str())];

    let first = proxy(&upstream.address, &store);
    applied_memory(&first).await;
    stop(first);
    // A proxy without a worker: the next turns stay queued.
    let no_worker = [store[0], ("ENGRAM_WORKER__ENABLED", "false")];
    let second = proxy(&upstream.address, &no_worker);
    record_turns(&second, 3, 4).await;

    let report = forget(&second).await;
    let deleted = &report["deleted"];
    assert_eq!(deleted["memory_states"], 1, "{report}");
    assert_eq!(deleted["raw_entries"], 3, "{report}");
    assert_eq!(deleted["jobs"], 6, "{report}");
    assert!(deleted["explanations"].as_u64().unwrap() >= 3, "{report}");
    let queue = admin(&second, "/engram/v1/queue", TENANT).await.json();
    assert_eq!(
        queue["depth"], 1,
        "the kept user's job stays queued: {queue}"
    );
    assert!(export(&second, TENANT, GONE).await["memory"].is_null());
    stop(second);

    let rows = EmbeddedStore::dump(data.path()).unwrap();
    assert!(
        rows.iter()
            .any(|row| row.key.iter().any(|part| part == KEPT)),
        "the kept user's rows are gone too: {rows:?}"
    );
    for row in &rows {
        let value = String::from_utf8_lossy(&row.value);
        assert!(
            !row.key.iter().any(|part| part == GONE),
            "row of the forgotten user left in {}: {row:?}",
            row.table
        );
        assert!(
            !value.contains(GONE) && !value.contains(MARKER),
            "value naming the forgotten user left in {}: {value}",
            row.table
        );
    }
}

#[tokio::test]
async fn forget_leaves_no_key_stream_entry_or_value_of_the_user_in_redis() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let url = redis.url();
    let upstream = mock(&[]);
    let backend = store_env(&url);
    let first = proxy(&upstream.address, &backend);
    applied_memory(&first).await;
    drop(first);
    let no_worker = [backend[0], backend[1], ("ENGRAM_WORKER__ENABLED", "false")];
    let second = proxy(&upstream.address, &no_worker);
    // Two sessions: each has a token on the queue shard's stream and its jobs in its backlog.
    let turns = record_turns(&second, 3, 4).await;
    let explain = format!("/engram/v1/users/{GONE}/turns/{}/explain", turns[0]);
    assert_eq!(admin(&second, &explain, TENANT).await.status.as_u16(), 200);
    let tag = format!("{}:{}", hex(TENANT), hex(GONE));
    let mut connection = redis::Client::open(url.as_str())
        .unwrap()
        .get_multiplexed_async_connection()
        .await
        .unwrap();
    let before = scan(&mut connection).await;
    assert!(
        before.iter().any(|(key, _)| key.contains(&tag)),
        "{before:?}"
    );
    assert!(
        before
            .iter()
            .any(|(key, value)| key.ends_with(":tokens") && value.contains(&tag)),
        "no queue-shard stream entry of the user before the forget: {before:?}"
    );

    let report = forget(&second).await;
    assert_eq!(report["deleted"]["memory_states"], 1, "{report}");
    assert_eq!(report["deleted"]["raw_entries"], 3, "{report}");
    assert_eq!(report["deleted"]["jobs"], 6, "{report}");

    let after = scan(&mut connection).await;
    for (key, value) in &after {
        assert!(!key.contains(&tag), "key of the forgotten user left: {key}");
        assert!(
            !value.contains(&tag) && !value.contains(GONE) && !value.contains(MARKER),
            "{key} still names the forgotten user: {value}"
        );
    }
    assert!(
        after.iter().any(|(key, _)| key.contains(&hex(KEPT))),
        "the kept user's keys are gone too: {after:?}"
    );
    let queue = admin(&second, "/engram/v1/queue", TENANT).await.json();
    assert_eq!(queue["depth"], 1, "{queue}");
    // The turns this process explained are forgotten with the rest.
    common::assert_openai_error(&admin(&second, &explain, TENANT).await, 404);
}

/// A forget on one replica does not reach another's explanations: once the other has read the
/// memory begun again, it names none of that memory's turns as the old explanation's sources,
/// and says the memory it came from was forgotten.
#[tokio::test]
async fn an_explanation_says_its_memory_was_forgotten_on_another_replica() {
    let Some(redis) = RedisServer::start().await else {
        return;
    };
    let url = redis.url();
    let upstream = mock(&[]);
    let backend = store_env(&url);
    let (first, second) = (
        proxy(&upstream.address, &backend),
        proxy(&upstream.address, &backend),
    );
    let old_turns = applied_memory(&first).await;
    let question = say(&first, TENANT, GONE, "s1", "What is my locker number?").await;
    let turn = header(&question, "x-engram-turn-id").to_owned();
    let explain = format!("/engram/v1/users/{GONE}/turns/{turn}/explain");
    let named = |body: &Value| -> Vec<String> {
        body["explain"]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .flat_map(|item| item["provenance"].as_array().cloned().unwrap_or_default())
            .filter_map(|id| id.as_str().map(str::to_owned))
            .collect()
    };
    let before = admin(&first, &explain, TENANT).await.json();
    assert_eq!(before["provenance"], "named", "{before}");
    assert!(
        named(&before).iter().any(|id| old_turns.contains(id)),
        "no item names an earlier turn: {before}"
    );

    forget(&second).await;
    let reply = say(&second, TENANT, GONE, "s1", "I moved to a new gym.").await;
    wait_applied(&second, TENANT, GONE, &reply).await;
    // The first replica reads the new memory on its next turn of the user.
    say(&first, TENANT, GONE, "s1", "Which gym do I go to?").await;

    let after = admin(&first, &explain, TENANT).await.json();
    assert_eq!(after["provenance"], "forgotten", "{after}");
    assert!(named(&after).is_empty(), "{after}");
    // The same items, without their sources' ids.
    let items = |body: &Value| -> Vec<Value> {
        body["explain"]["items"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|item| item["item"].clone())
            .collect()
    };
    assert_eq!(items(&after), items(&before));
}

fn hex(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

/// Every key (by SCAN) with its whole content as text.
async fn scan(connection: &mut redis::aio::MultiplexedConnection) -> Vec<(String, String)> {
    let mut keys: Vec<String> = Vec::new();
    let mut cursor = 0u64;
    loop {
        let (next, batch): (u64, Vec<String>) = redis::cmd("SCAN")
            .arg(cursor)
            .arg("COUNT")
            .arg(1000)
            .query_async(connection)
            .await
            .unwrap();
        keys.extend(batch);
        if next == 0 {
            break;
        }
        cursor = next;
    }
    let mut out = Vec::new();
    for key in keys {
        let kind: String = redis::cmd("TYPE")
            .arg(&key)
            .query_async(connection)
            .await
            .unwrap();
        let mut command = match kind.as_str() {
            "string" => redis::cmd("GET"),
            "hash" => redis::cmd("HGETALL"),
            "list" | "zset" => redis::cmd(if kind == "list" { "LRANGE" } else { "ZRANGE" }),
            "set" => redis::cmd("SMEMBERS"),
            "stream" => redis::cmd("XRANGE"),
            "none" => continue,
            other => panic!("{key}: unexpected type {other}"),
        };
        command.arg(&key);
        match kind.as_str() {
            "list" | "zset" => {
                command.arg(0).arg(-1);
            }
            "stream" => {
                command.arg("-").arg("+");
            }
            _ => {}
        }
        let value: redis::Value = command.query_async(connection).await.unwrap();
        out.push((key, flatten(&value)));
    }
    out
}

fn flatten(value: &redis::Value) -> String {
    match value {
        redis::Value::BulkString(bytes) => String::from_utf8_lossy(bytes).into_owned(),
        redis::Value::SimpleString(text) => text.clone(),
        redis::Value::Int(number) => number.to_string(),
        redis::Value::Array(items) | redis::Value::Set(items) => {
            items.iter().map(flatten).collect::<Vec<_>>().join(" ")
        }
        redis::Value::Map(pairs) => pairs
            .iter()
            .map(|(key, value)| format!("{} {}", flatten(key), flatten(value)))
            .collect::<Vec<_>>()
            .join(" "),
        other => format!("{other:?}"),
    }
}
