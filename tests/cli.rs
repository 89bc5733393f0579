//! The command line against the real binary: `engram admin …` calling a running proxy, and
//! `engram serve --store`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use std::process::Output;

use common::memory::{export, say, wait_applied};
use common::redis::RedisServer;
use common::{ADMIN_TOKEN, Process, mock, proxy, proxy_args, run};
use serde_json::Value;

/// Runs `engram admin --url <proxy> --tenant acme ARGS` with the test token.
fn admin_cli(proxy: &Process, args: &[&str]) -> Output {
    admin_cli_with(proxy, args, ADMIN_TOKEN)
}

fn admin_cli_with(proxy: &Process, args: &[&str], token: &str) -> Output {
    let mut all = vec!["admin", "--url", proxy.address.as_str(), "--tenant", "acme"];
    all.extend_from_slice(args);
    run(&all, &[("ENGRAM_ADMIN_TOKEN", token)])
}

/// The JSON a successful command printed.
fn printed(output: &Output) -> Value {
    assert!(
        output.status.success(),
        "exit {:?}, stderr: {}",
        output.status.code(),
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).unwrap_or_else(|error| {
        panic!(
            "not JSON ({error}): {}",
            String::from_utf8_lossy(&output.stdout)
        )
    })
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[test]
fn the_dev_tools_that_left_the_binary_say_where_they_went() {
    for (args, binary) in [
        (&["eval", "locomo", "--data", "x.json"][..], "engram-eval"),
        (
            &["mock-upstream", "--listen", "127.0.0.1:0"][..],
            "engram-mock",
        ),
    ] {
        let output = run(args, &[]);
        assert_eq!(output.status.code(), Some(2), "{}", stderr(&output));
        assert!(
            stderr(&output).contains(&format!("cargo run --release -p {binary} --")),
            "{}",
            stderr(&output)
        );
    }
}

#[tokio::test]
async fn admin_commands_call_the_api_and_print_its_json() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = say(&proxy, "acme", "lea", "s", "I am allergic to peanuts.").await;
    wait_applied(&proxy, "acme", "lea", &reply).await;

    let exported = printed(&admin_cli(&proxy, &["export", "lea"]));
    assert_eq!(exported["tenant"], "acme");
    assert_eq!(exported["raw_log"].as_array().unwrap().len(), 1);
    // Pretty-printed, one field per line.
    let output = admin_cli(&proxy, &["queue"]);
    assert!(String::from_utf8_lossy(&output.stdout).lines().count() > 5);

    let pinned = printed(&admin_cli(&proxy, &["pin", "lea", "Answer in French."]));
    assert_eq!(pinned["item"], "pinned:0");
    let items = printed(&admin_cli(&proxy, &["items", "lea", "--kind", "pinned"]));
    assert_eq!(items["items"][0]["text"], "Answer in French.");
    let found = printed(&admin_cli(
        &proxy,
        &["search", "lea", "peanut", "--kind", "fact"],
    ));
    let fact = found["items"][0]["id"].as_str().unwrap().to_owned();
    assert!(
        found["items"][0]["text"]
            .as_str()
            .unwrap()
            .contains("peanuts")
    );
    let edited = printed(&admin_cli(
        &proxy,
        &["item", "edit", "lea", &fact, "allergic to cashews"],
    ));
    assert_eq!(edited["item"]["text"], "allergic to cashews");
    let read = printed(&admin_cli(&proxy, &["item", "get", "lea", &fact]));
    assert_eq!(read["item"]["fact"]["edited"], true);
    printed(&admin_cli(&proxy, &["identity", "lea", "Lea, a chef."]));
    printed(&admin_cli(&proxy, &["unpin", "lea", "0"]));
    let deleted = printed(&admin_cli(&proxy, &["item", "delete", "lea", &fact]));
    assert_eq!(deleted["deleted"][0], fact.as_str());
    let job = common::memory::header(&reply, "x-engram-job-id").to_owned();
    assert_eq!(
        printed(&admin_cli(&proxy, &["job", "lea", &job]))["state"],
        "applied"
    );
    let second = say(&proxy, "acme", "lea", "s", "What should I cook tonight?").await;
    wait_applied(&proxy, "acme", "lea", &second).await;
    let turn = common::memory::header(&second, "x-engram-turn-id").to_owned();
    assert!(printed(&admin_cli(&proxy, &["explain", "lea", &turn]))["explain"].is_object());
    let document = printed(&admin_cli(&proxy, &["openapi"]));
    assert!(document["paths"].is_object());

    // Forget asks for a confirmation, then reports.
    let unconfirmed = admin_cli(&proxy, &["forget", "lea"]);
    assert!(!unconfirmed.status.success());
    assert!(
        stderr(&unconfirmed).contains("--yes"),
        "{}",
        stderr(&unconfirmed)
    );
    let forgot = printed(&admin_cli(&proxy, &["forget", "lea", "--yes"]));
    assert_eq!(forgot["deleted"]["memory_states"], 1, "{forgot}");
    assert!(export(&proxy, "acme", "lea").await["memory"].is_null());

    // API errors: a failing exit, the API's message on stderr, nothing on stdout.
    for (output, needle) in [
        (
            admin_cli_with(&proxy, &["export", "lea"], "wrong"),
            "401 Unauthorized: Missing or invalid bearer token.",
        ),
        (
            admin_cli(&proxy, &["item", "get", "lea", "fact:42"]),
            "404 Not Found: No item fact:42",
        ),
        (
            admin_cli(&proxy, &["items", "lea", "--tier", "hot"]),
            "400 Bad Request: Unknown tier",
        ),
    ] {
        assert_eq!(output.status.code(), Some(1));
        assert!(output.stdout.is_empty());
        assert!(stderr(&output).contains(needle), "{}", stderr(&output));
    }
    let unreachable = run(
        &["admin", "--url", "http://127.0.0.1:9", "queue"],
        &[("ENGRAM_ADMIN_TOKEN", ADMIN_TOKEN)],
    );
    assert_eq!(unreachable.status.code(), Some(1));
    assert!(
        stderr(&unreachable).contains("cannot reach"),
        "{}",
        stderr(&unreachable)
    );
}

#[tokio::test]
async fn admin_finds_the_proxy_from_the_config_without_url() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let listen = proxy.address.trim_start_matches("http://").to_owned();
    let output = run(
        &["admin", "queue"],
        &[
            ("ENGRAM_ADMIN_TOKEN", ADMIN_TOKEN),
            ("ENGRAM_SERVER__LISTEN", listen.as_str()),
        ],
    );
    assert_eq!(printed(&output)["depth"], 0);
}

#[tokio::test]
async fn serve_store_flag_picks_the_backend_and_its_place() {
    let upstream = mock(&[]);
    // embedded:DIR wins over the data directory the environment names.
    let dir = tempfile::tempdir().unwrap();
    let flag = format!("embedded:{}", dir.path().join("flagged").display());
    let embedded = proxy_args(&upstream.address, &["--store", &flag], &[]);
    let reply = say(&embedded, "acme", "noa", "s", "I like green tea.").await;
    wait_applied(&embedded, "acme", "noa", &reply).await;
    assert!(dir.path().join("flagged").join("engram.redb").is_file());
    drop(embedded);

    if let Some(redis) = RedisServer::start().await {
        let flag = redis.url();
        let proxy = proxy_args(&upstream.address, &["--store", &flag], &[]);
        let reply = say(&proxy, "acme", "noa", "s", "I like green tea.").await;
        wait_applied(&proxy, "acme", "noa", &reply).await;
        let mut connection = redis::Client::open(flag.as_str())
            .unwrap()
            .get_multiplexed_async_connection()
            .await
            .unwrap();
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("engram:*")
            .query_async(&mut connection)
            .await
            .unwrap();
        assert!(keys.iter().any(|key| key.ends_with(":state")), "{keys:?}");
    }

    for bad in ["postgres://db", "embedded:", "redis://"] {
        let output = run(&["serve", "--store", bad, "--check-config"], &[]);
        assert_eq!(output.status.code(), Some(2), "{bad}");
        let message = stderr(&output);
        assert!(
            message.contains("--store") && message.contains("embedded:DIR or redis://HOST:PORT"),
            "{bad}: {message}"
        );
    }
    let checked = run(
        &["serve", "--store", "redis://cache:6380", "--check-config"],
        &[],
    );
    let shown = String::from_utf8_lossy(&checked.stdout);
    assert!(checked.status.success(), "{}", stderr(&checked));
    assert!(
        shown.contains("backend: Redis") && shown.contains("redis://cache:6380"),
        "{shown}"
    );
}
