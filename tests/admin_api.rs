//! The management API's memory edits through the real binary: identity, pins, forget, and
//! what the upstream then sees.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use std::time::Duration;

use common::memory::{
    admin, admin_request, export, memory_part, recorded, say, wait_applied, wait_drained,
};
use common::{Process, Reply, mock, proxy, send, temp_path};
use serde_json::{Value, json};

async fn admin_send(proxy: &Process, method: &str, path: &str, tenant: &str, body: Value) -> Reply {
    admin_request(proxy, method, path, tenant, &body.to_string()).await
}

fn last_memory(record: &std::path::Path) -> String {
    memory_part(recorded(record).last().unwrap())
}

#[tokio::test]
async fn identity_and_pins_reach_the_prompt_and_unpinning_removes_them() {
    let record = temp_path("admin-edits.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);

    let set = admin_send(
        &proxy,
        "PUT",
        "/engram/v1/users/tess/identity",
        "acme",
        json!({"text": "Tess is a marine biologist in Bergen."}),
    )
    .await;
    assert_eq!(
        set.status.as_u16(),
        200,
        "{}",
        String::from_utf8_lossy(&set.body)
    );
    let pinned = admin_send(
        &proxy,
        "POST",
        "/engram/v1/users/tess/pins",
        "acme",
        json!({"text": "Always answer in metric units."}),
    )
    .await;
    assert_eq!(pinned.status.as_u16(), 201);
    let pin = pinned.json()["pin"].as_u64().unwrap();

    say(&proxy, "acme", "tess", "s", "How far is the fjord?").await;
    let memory = last_memory(&record);
    assert!(memory.contains("marine biologist"), "{memory}");
    assert!(memory.contains("metric units"), "{memory}");

    let unpinned = admin_send(
        &proxy,
        "DELETE",
        &format!("/engram/v1/users/tess/pins/{pin}"),
        "acme",
        Value::Null,
    )
    .await;
    assert_eq!(unpinned.status.as_u16(), 200);
    let again = admin_send(
        &proxy,
        "DELETE",
        &format!("/engram/v1/users/tess/pins/{pin}"),
        "acme",
        Value::Null,
    )
    .await;
    common::assert_openai_error(&again, 404);
    say(&proxy, "acme", "tess", "s", "And how deep is it?").await;
    let memory = last_memory(&record);
    assert!(!memory.contains("metric units"), "{memory}");
    assert!(memory.contains("marine biologist"), "{memory}");

    // Bad bodies are 400s.
    for body in [json!({"txt": "x"}), json!({"text": "  "}), json!("text")] {
        let bad = admin_send(&proxy, "POST", "/engram/v1/users/tess/pins", "acme", body).await;
        common::assert_openai_error(&bad, 400);
    }
}

#[tokio::test]
async fn forget_deletes_every_record_of_one_user_in_one_tenant_only() {
    let record = temp_path("admin-forget.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);

    for tenant in ["t1", "t2"] {
        let reply = say(&proxy, tenant, "uma", "s", "I'm allergic to walnuts.").await;
        wait_applied(&proxy, tenant, "uma", &reply).await;
    }
    let forgot = admin_send(&proxy, "DELETE", "/engram/v1/users/uma", "t1", Value::Null).await;
    assert_eq!(forgot.status.as_u16(), 200);
    let report = forgot.json();
    assert_eq!(report["deleted"]["memory_states"], 1, "{report}");
    assert_eq!(report["deleted"]["raw_entries"], 1, "{report}");
    assert_eq!(report["deleted"]["jobs"], 1, "{report}");

    let gone = export(&proxy, "t1", "uma").await;
    assert!(gone["memory"].is_null(), "{gone}");
    assert_eq!(gone["raw_log"].as_array().unwrap().len(), 0);
    let kept = export(&proxy, "t2", "uma").await;
    assert_eq!(kept["raw_log"].as_array().unwrap().len(), 1);

    // The forgotten memory is never served again, though this process had it cached.
    say(&proxy, "t1", "uma", "s", "Suggest a snack.").await;
    assert!(!last_memory(&record).contains("walnut"));
    say(&proxy, "t2", "uma", "s", "Suggest a snack.").await;
    assert!(last_memory(&record).contains("walnut"));
    wait_drained(&proxy, Duration::from_secs(10)).await;

    let wrong = send(
        "DELETE",
        &proxy.url("/engram/v1/users/uma"),
        &[("authorization", "Bearer nope")],
        "",
    )
    .await;
    common::assert_openai_error(&wrong, 401);
    let queue = admin(&proxy, "/engram/v1/queue", "t1").await;
    assert_eq!(queue.status.as_u16(), 200);
}

#[tokio::test]
async fn explain_names_what_a_turn_was_given_and_where_it_came_from() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let first = say(&proxy, "acme", "vik", "s1", "I'm allergic to sesame.").await;
    wait_applied(&proxy, "acme", "vik", &first).await;
    let source_turn = first.headers["x-engram-turn-id"]
        .to_str()
        .unwrap()
        .to_owned();

    // A read-only probe is not recorded but still has a turn id and an explanation.
    let probe = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[
            ("content-type", "application/json"),
            ("x-engram-tenant", "acme"),
            ("x-engram-user", "vik"),
            ("x-engram-session", "probe"),
            ("x-engram-mode", "read-only"),
        ],
        json!({"model": "gpt-test", "messages": [{"role": "user", "content": "What should I avoid?"}]})
            .to_string(),
    )
    .await;
    assert_eq!(probe.status.as_u16(), 200);
    assert!(probe.headers.get("x-engram-job-id").is_none());
    let turn = probe.headers["x-engram-turn-id"]
        .to_str()
        .unwrap()
        .to_owned();

    let explained = admin(
        &proxy,
        &format!("/engram/v1/users/vik/turns/{turn}/explain"),
        "acme",
    )
    .await;
    assert_eq!(explained.status.as_u16(), 200);
    let explain = &explained.json()["explain"];
    let items = explain["items"].as_array().unwrap();
    let constraint = items
        .iter()
        .find(|item| item["reason"]["why"] == "hard_constraint")
        .unwrap_or_else(|| panic!("no hard constraint in {explain}"));
    assert_eq!(constraint["block"], "core", "{constraint}");
    assert!(constraint["tokens"].as_u64().unwrap() > 0);
    assert!(
        constraint["provenance"]
            .as_array()
            .unwrap()
            .iter()
            .any(|id| id == source_turn.as_str()),
        "{constraint}"
    );
    assert!(explain["tokens"]["total"].as_u64().unwrap() > 0);

    for (path, tenant) in [
        (
            "/engram/v1/users/vik/turns/t0-0-0/explain".to_owned(),
            "acme",
        ),
        (
            format!("/engram/v1/users/vik/turns/{turn}/explain"),
            "other",
        ),
        (format!("/engram/v1/users/ola/turns/{turn}/explain"), "acme"),
    ] {
        common::assert_openai_error(&admin(&proxy, &path, tenant).await, 404);
    }
}
