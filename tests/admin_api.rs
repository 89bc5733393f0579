//! The management API through the real binary: identity, pins, items (list, search, edit,
//! delete), forget, explain, the OpenAPI routes, tokens, and what the upstream then sees.

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
use common::{Mock, Process, Reply, mock, proxy, send, temp_path};
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
    explain_names_a_probes_items_and_sources(&[]).await;
}

/// The explanation keeps its provenance turns by number and names them when read: from the
/// stored memory when this process has none cached (a budget no memory fits in).
#[tokio::test]
async fn explain_names_the_source_turns_from_the_store_when_nothing_is_cached() {
    explain_names_a_probes_items_and_sources(&[("ENGRAM_WORKER__CACHE_BYTES", "1")]).await;
}

async fn explain_names_a_probes_items_and_sources(env: &[(&str, &str)]) {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, env);
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

fn item<'a>(list: &'a Value, id: &str) -> &'a Value {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["id"] == id)
        .unwrap_or_else(|| panic!("no {id} in {list}"))
}

fn ids(list: &Value) -> Vec<String> {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|item| item["id"].as_str().unwrap().to_owned())
        .collect()
}

/// The id of the fact whose text contains `needle`.
fn fact_id(list: &Value, needle: &str) -> String {
    list["items"]
        .as_array()
        .unwrap()
        .iter()
        .find(|item| item["kind"] == "fact" && item["text"].as_str().unwrap().contains(needle))
        .unwrap_or_else(|| panic!("no fact with {needle} in {list}"))["id"]
        .as_str()
        .unwrap()
        .to_owned()
}

#[tokio::test]
async fn a_pinned_fact_follows_the_conversation() {
    let record = temp_path("admin-pin-follows.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);
    let items = "/engram/v1/users/kai/items";
    let first = say(&proxy, "acme", "kai", "s", "Please call me Ana.").await;
    wait_applied(&proxy, "acme", "kai", &first).await;
    let name = fact_id(&admin(&proxy, items, "acme").await.json(), "name: Ana");
    let pinned = admin_send(
        &proxy,
        "POST",
        "/engram/v1/users/kai/pins",
        "acme",
        json!({"item": name}),
    )
    .await;
    assert_eq!(pinned.status.as_u16(), 201);
    let pin = pinned.json()["item"].as_str().unwrap().to_owned();

    let second = say(&proxy, "acme", "kai", "s", "Actually, call me Jay.").await;
    wait_applied(&proxy, "acme", "kai", &second).await;
    say(&proxy, "acme", "kai", "s", "What should we talk about?").await;
    let prompt = recorded(&record).last().unwrap().clone();
    let core = prompt["messages"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|message| message["content"].as_str())
        .find(|text| text.contains("<engram-memory kind=\"core\">"))
        .unwrap_or_else(|| panic!("no core block in {prompt}"))
        .to_owned();
    assert!(core.contains("## Pinned\n- “name: Jay”"), "{core}");
    assert!(!core.contains("Ana"), "{core}");
    let memory = memory_part(&prompt);
    assert_eq!(memory.matches("name: Jay").count(), 1, "{memory}");
    assert!(!memory.contains("name: Ana"), "{memory}");

    // The admin API lists the pin as the fact's current revision, and so does the export.
    let pins = admin(&proxy, &format!("{items}?kind=pinned"), "acme")
        .await
        .json();
    assert_eq!(item(&pins, &pin)["text"], "name: Jay", "{pins}");
    assert_eq!(item(&pins, &pin)["source"], name.as_str(), "{pins}");
    let exported = export(&proxy, "acme", "kai").await;
    assert_eq!(item(&exported, &pin)["text"], "name: Jay");
    assert!(!exported.to_string().contains("name: Ana"), "{exported}");
}

#[tokio::test]
async fn items_are_listed_searched_read_edited_and_deleted() {
    let record = temp_path("admin-items.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);
    let first = say(
        &proxy,
        "acme",
        "ines",
        "s",
        "I live in Lisbon and my cat is called Miso. I am allergic to peanuts.",
    )
    .await;
    wait_applied(&proxy, "acme", "ines", &first).await;
    let turn = common::memory::header(&first, "x-engram-turn-id").to_owned();
    let items = "/engram/v1/users/ines/items";

    // Every kind with its tier, tokens and provenance.
    let all = admin(&proxy, items, "acme").await;
    assert_eq!(all.status.as_u16(), 200);
    let all = all.json();
    assert_eq!(all["total"].as_u64().unwrap() as usize, ids(&all).len());
    for id in ["raw_turn:0", "summary:0"] {
        let entry = item(&all, id);
        assert_eq!(entry["tier"], "new", "{entry}");
        assert_eq!(entry["provenance"][0]["turn_id"], turn.as_str(), "{entry}");
        assert!(entry["tokens"].as_u64().unwrap() > 0, "{entry}");
    }
    let lives = fact_id(&all, "Lisbon");
    let cat = fact_id(&all, "Miso");
    let allergy = fact_id(&all, "peanuts");
    assert_eq!(item(&all, &allergy)["fact"]["category"], "hard_constraint");

    let facts = admin(
        &proxy,
        &format!("{items}?kind=fact&tier=new&limit=2"),
        "acme",
    )
    .await
    .json();
    assert_eq!(facts["total"], 3, "{facts}");
    assert_eq!(ids(&facts).len(), 2);
    assert!(
        facts["items"]
            .as_array()
            .unwrap()
            .iter()
            .all(|i| i["kind"] == "fact")
    );
    let old = admin(&proxy, &format!("{items}?tier=old"), "acme")
        .await
        .json();
    assert_eq!(old["total"], 0, "{old}");

    // Search ranks by the retrieval terms (stemmed: "peanut" finds "peanuts").
    let found = admin(&proxy, &format!("{items}?q=peanut"), "acme")
        .await
        .json();
    assert_eq!(found["items"][0]["id"], allergy.as_str(), "{found}");
    assert!(found["items"][0]["score"].as_f64().unwrap() > 0.0);
    assert!(ids(&found).contains(&"raw_turn:0".to_owned()), "{found}");
    let raw = admin(&proxy, &format!("{items}?q=peanut&kind=raw_turn"), "acme")
        .await
        .json();
    assert_eq!(ids(&raw), ["raw_turn:0"], "{raw}");
    let none = admin(&proxy, &format!("{items}?q=zeppelin"), "acme")
        .await
        .json();
    assert_eq!(none["total"], 0);

    // Edit: a new revision without turns; the next prompt carries the new value.
    let edited = admin_send(
        &proxy,
        "PATCH",
        &format!("{items}/{lives}"),
        "acme",
        json!({"text": "lives in: Porto"}),
    )
    .await;
    assert_eq!(
        edited.status.as_u16(),
        200,
        "{}",
        String::from_utf8_lossy(&edited.body)
    );
    let edited = edited.json();
    assert_eq!(edited["item"]["text"], "lives in: Porto");
    assert_eq!(edited["item"]["provenance"], json!([]));
    assert_eq!(edited["item"]["fact"]["edited"], true);
    let memory = export(&proxy, "acme", "ines").await;
    // The export holds every layer with provenance: tiers, the turn log, manifests, the raw
    // log (store) and raw turns (state), and the items view with turn ids.
    let state = &memory["memory"];
    assert_eq!(state["turn_log"][0]["tier"]["t"], "new", "{state}");
    assert!(state["episodes"].is_array() && state["artifacts"].is_array());
    assert_eq!(state["raw_turns"][0]["id"], turn.as_str());
    assert_eq!(memory["raw_log"][0]["exchange"]["turn_id"], turn.as_str());
    assert!(ids(&memory).contains(&"summary:0".to_owned()), "{memory}");
    let index: usize = lives.trim_start_matches("fact:").parse().unwrap();
    let history = &memory["memory"]["facts"][index]["history"][0];
    assert_eq!(history["ended_by"], "edited", "{history}");
    assert_eq!(history["value"], "Lisbon");
    assert_eq!(history["provenance"], json!([0]));
    say(&proxy, "acme", "ines", "s", "Where should I eat tonight?").await;
    assert!(last_memory(&record).contains("lives in: Porto"));

    // Pin the cat fact, then delete the fact: the pin goes with it.
    let pinned = admin_send(
        &proxy,
        "POST",
        "/engram/v1/users/ines/pins",
        "acme",
        json!({"item": cat}),
    )
    .await;
    assert_eq!(
        pinned.status.as_u16(),
        201,
        "{}",
        String::from_utf8_lossy(&pinned.body)
    );
    let pin_item = pinned.json()["item"].as_str().unwrap().to_owned();
    let cat_item = admin(&proxy, &format!("{items}/{cat}"), "acme")
        .await
        .json();
    assert_eq!(cat_item["item"]["pinned"], true, "{cat_item}");
    let pins = admin(&proxy, &format!("{items}?kind=pinned"), "acme")
        .await
        .json();
    assert_eq!(item(&pins, &pin_item)["source"], cat.as_str());
    let deleted = admin_send(
        &proxy,
        "DELETE",
        &format!("{items}/{cat}"),
        "acme",
        Value::Null,
    )
    .await;
    assert_eq!(deleted.status.as_u16(), 200);
    assert_eq!(deleted.json()["deleted"], json!([cat, pin_item]));
    common::assert_openai_error(&admin(&proxy, &format!("{items}/{cat}"), "acme").await, 404);
    let again = admin_send(
        &proxy,
        "DELETE",
        &format!("{items}/{cat}"),
        "acme",
        Value::Null,
    )
    .await;
    common::assert_openai_error(&again, 404);
    say(&proxy, "acme", "ines", "s", "Any plans for the weekend?").await;
    let memory = last_memory(&record);
    assert!(!memory.contains("cat named Miso"), "{memory}");
    let exported = export(&proxy, "acme", "ines").await.to_string();
    assert!(!exported.contains("cat named"), "{exported}");

    // A summary can be deleted; the raw log cannot, item by item.
    let gone = admin_send(
        &proxy,
        "DELETE",
        &format!("{items}/summary:0"),
        "acme",
        Value::Null,
    )
    .await;
    assert_eq!(gone.json()["deleted"], json!(["summary:0"]));
    let summaries = admin(&proxy, &format!("{items}?kind=summary"), "acme")
        .await
        .json();
    assert!(
        !ids(&summaries).contains(&"summary:0".to_owned()),
        "{summaries}"
    );

    // Identity through the item routes.
    let missing = admin_send(
        &proxy,
        "DELETE",
        &format!("{items}/identity"),
        "acme",
        Value::Null,
    )
    .await;
    common::assert_openai_error(&missing, 404);
    let set = admin_send(
        &proxy,
        "PATCH",
        &format!("{items}/identity"),
        "acme",
        json!({"text": "Ines, a pilot."}),
    )
    .await;
    assert_eq!(set.json()["item"]["text"], "Ines, a pilot.");
    let cleared = admin_send(
        &proxy,
        "DELETE",
        &format!("{items}/identity"),
        "acme",
        Value::Null,
    )
    .await;
    assert_eq!(cleared.json()["deleted"], json!(["identity"]));

    // Refusals.
    for (method, path, body, status) in [
        (
            "PATCH",
            format!("{items}/{allergy}"),
            json!({"text": "lives in: Faro"}),
            409,
        ),
        (
            "PATCH",
            format!("{items}/{allergy}"),
            json!({"text": " "}),
            400,
        ),
        (
            "PATCH",
            format!("{items}/{allergy}"),
            json!({"txt": "x"}),
            400,
        ),
        (
            "PATCH",
            format!("{items}/summary:1"),
            json!({"text": "x"}),
            400,
        ),
        (
            "PATCH",
            format!("{items}/fact:99"),
            json!({"text": "a: b"}),
            404,
        ),
        ("DELETE", format!("{items}/raw_turn:0"), Value::Null, 400),
        ("DELETE", format!("{items}/raw_turn:99"), Value::Null, 404),
        ("GET", format!("{items}/fact"), Value::Null, 400),
        ("GET", format!("{items}/fact:x"), Value::Null, 400),
        ("GET", format!("{items}?tier=hot"), Value::Null, 400),
        ("GET", format!("{items}?kind=memo"), Value::Null, 400),
        ("GET", format!("{items}?limit=0"), Value::Null, 400),
        ("GET", format!("{items}?limit=1001"), Value::Null, 400),
        ("GET", format!("{items}?q="), Value::Null, 400),
        ("GET", format!("{items}?lmit=3"), Value::Null, 400),
        ("GET", format!("{items}?q=a&q=b"), Value::Null, 400),
        ("POST", items.to_owned(), Value::Null, 405),
        (
            "POST",
            "/engram/v1/users/ines/pins".to_owned(),
            json!({"item": "summary:1"}),
            400,
        ),
        (
            "POST",
            "/engram/v1/users/ines/pins".to_owned(),
            json!({"item": "fact:1", "text": "x"}),
            400,
        ),
        (
            "POST",
            "/engram/v1/users/ines/pins".to_owned(),
            json!({"item": "fact:98"}),
            404,
        ),
    ] {
        let reply = admin_send(&proxy, method, &path, "acme", body).await;
        common::assert_openai_error(&reply, status);
    }
}

#[tokio::test]
async fn the_openapi_document_is_served_and_every_route_it_names_answers() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = admin(&proxy, "/engram/v1/openapi.json", "default").await;
    assert_eq!(reply.status.as_u16(), 200);
    let document = reply.json();
    assert!(document["openapi"].as_str().unwrap().starts_with("3.1"));

    let mut operations = 0;
    for (path, operations_of) in document["paths"].as_object().unwrap() {
        let concrete = path
            .replace("{user}", "probe")
            .replace("{job}", "j-1")
            .replace("{item}", "fact:0")
            .replace("{pin}", "0")
            .replace("{turn}", "t-1");
        for method in operations_of.as_object().unwrap().keys() {
            if method == "parameters" {
                continue;
            }
            operations += 1;
            let method = method.to_uppercase();
            let body = if matches!(method.as_str(), "PUT" | "POST" | "PATCH") {
                json!({"text": "probe"})
            } else {
                Value::Null
            };
            let served = admin_send(&proxy, &method, &concrete, "default", body).await;
            let text = String::from_utf8_lossy(&served.body).into_owned();
            assert!(
                !text.contains("Unknown route") && served.status != 405,
                "{method} {concrete}: {} {text}",
                served.status
            );
            // Without a token, or with a wrong one, every route is 401.
            for auth in [None, Some("Bearer wrong-token")] {
                let mut headers = vec![("content-type", "application/json")];
                headers.extend(auth.map(|value| ("authorization", value)));
                let refused = send(&method, &proxy.url(&concrete), &headers, "{}").await;
                common::assert_openai_error(&refused, 401);
            }
        }
    }
    assert_eq!(operations, 13);
}

#[tokio::test]
async fn without_any_token_the_api_is_off() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[("ENGRAM_ADMIN_TOKEN", "")]);
    for path in ["/engram/v1/openapi.json", "/engram/v1/users/u/items"] {
        common::assert_openai_error(&admin(&proxy, path, "default").await, 404);
    }
}

#[tokio::test]
async fn a_tenant_token_reaches_its_own_tenant_only() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_ADMIN_TENANT_TOKENS", "t1=token-one,t2=token-two")],
    );
    for tenant in ["t1", "t2"] {
        let reply = say(
            &proxy,
            tenant,
            "uma",
            "s",
            &format!("I work at the {tenant} lab."),
        )
        .await;
        wait_applied(&proxy, tenant, "uma", &reply).await;
    }
    let call = |method: &'static str,
                path: &'static str,
                token: &'static str,
                tenant: Option<&'static str>| {
        let proxy = &proxy;
        async move {
            let auth = format!("Bearer {token}");
            let mut headers = vec![
                ("authorization", auth.as_str()),
                ("content-type", "application/json"),
            ];
            headers.extend(tenant.map(|tenant| ("x-engram-tenant", tenant)));
            send(method, &proxy.url(path), &headers, "").await
        }
    };
    // Its own tenant, named or implied.
    for tenant in [Some("t1"), None] {
        let own = call("GET", "/engram/v1/users/uma/memory", "token-one", tenant).await;
        assert_eq!(own.status.as_u16(), 200);
        let own = own.json();
        assert_eq!(own["tenant"], "t1");
        assert!(own.to_string().contains("t1 lab"), "{own}");
        assert!(!own.to_string().contains("t2 lab"), "{own}");
    }
    // Another tenant: 403 on every per-user route, reads and writes alike.
    for (method, path) in [
        ("GET", "/engram/v1/users/uma/memory"),
        ("GET", "/engram/v1/users/uma/items"),
        ("GET", "/engram/v1/users/uma/items/fact:0"),
        ("DELETE", "/engram/v1/users/uma/items/fact:0"),
        ("DELETE", "/engram/v1/users/uma"),
    ] {
        let refused = call(method, path, "token-one", Some("t2")).await;
        let body = common::assert_openai_error(&refused, 403);
        assert_eq!(body["error"]["type"], "permission_error");
    }
    // The global route is the global token's.
    common::assert_openai_error(
        &call("GET", "/engram/v1/queue", "token-two", None).await,
        403,
    );
    assert_eq!(
        call("GET", "/engram/v1/openapi.json", "token-two", None)
            .await
            .status,
        200
    );
    // t2's memory is untouched; the global token still reaches both tenants.
    let kept = export(&proxy, "t2", "uma").await;
    assert!(kept.to_string().contains("t2 lab"));
    let forgot = call("DELETE", "/engram/v1/users/uma", "token-two", None).await;
    assert_eq!(forgot.status.as_u16(), 200);
    assert!(export(&proxy, "t2", "uma").await["memory"].is_null());
    assert!(!export(&proxy, "t1", "uma").await["memory"].is_null());
}

/// A proxy (and its mock upstream) with an admin token for tenant t1 only, and one applied turn
/// of t1's user uma.
async fn t1_with_memory() -> (Mock, Process) {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_ADMIN_TENANT_TOKENS", "t1=token-one")],
    );
    let reply = say(&proxy, "t1", "uma", "s", "I work at the t1 lab.").await;
    wait_applied(&proxy, "t1", "uma", &reply).await;
    (upstream, proxy)
}

#[tokio::test]
async fn any_case_of_the_bearer_scheme_is_accepted() {
    let (_upstream, proxy) = t1_with_memory().await;
    let url = proxy.url("/engram/v1/users/uma/memory");
    // The scheme is case-insensitive (RFC 7235); the token is not.
    for (auth, status) in [
        ("bearer token-one", 200),
        ("BEARER token-one", 200),
        (&*format!("bEaReR {}", common::ADMIN_TOKEN), 200),
        ("bearer TOKEN-ONE", 401),
    ] {
        let headers = [("authorization", auth), ("x-engram-tenant", "t1")];
        let reply = send("GET", &url, &headers, "").await;
        assert_eq!(reply.status.as_u16(), status, "{auth}");
    }
}

#[tokio::test]
async fn a_repeated_tenant_header_is_a_400_as_on_the_chat_path() {
    let (_upstream, proxy) = t1_with_memory().await;
    let chat = common::post_json(
        &proxy.url("/v1/chat/completions"),
        &common::chat_body(false),
        &[
            ("x-engram-user", "uma"),
            ("x-engram-tenant", "t1"),
            ("x-engram-tenant", "t2"),
        ],
    )
    .await;
    let chat = common::assert_openai_error(&chat, 400);
    // Ambiguous whichever value comes first, even when both agree.
    let url = proxy.url("/engram/v1/users/uma/memory");
    let global = format!("Bearer {}", common::ADMIN_TOKEN);
    for token in [global.as_str(), "Bearer token-one"] {
        for tenants in [["t1", "t2"], ["t2", "t1"], ["t1", "t1"]] {
            let headers = [
                ("authorization", token),
                ("x-engram-tenant", tenants[0]),
                ("x-engram-tenant", tenants[1]),
            ];
            let reply = send("GET", &url, &headers, "").await;
            let error = common::assert_openai_error(&reply, 400);
            assert_eq!(error["error"]["param"], "x-engram-tenant", "{error}");
            assert_eq!(error["error"]["message"], chat["error"]["message"]);
            assert!(!error.to_string().contains("t1 lab"));
        }
    }
}
