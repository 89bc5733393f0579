//! Memory through the real binary: the hot-path rewrite, the recorder, the worker and the
//! store, end to end against the mock upstream (which records the prompts it receives).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods,
    reason = "tests: a failure should fail the test loudly; client tasks need no tracker"
)]

mod common;

use std::collections::HashSet;
use std::time::{Duration, Instant};

use common::memory::{
    admin, export, header, memory_part, recorded, say, wait_applied, wait_drained,
};
use common::{Process, mock, mock_at, post_json, proxy, send, temp_path};
use serde_json::{Value, json};

#[tokio::test]
async fn a_constraint_from_session_one_reaches_the_upstream_thirty_turns_later_in_session_two() {
    let record = temp_path("allergy.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);

    let first = say(&proxy, "acme", "alice", "s1", "I'm allergic to peanuts.").await;
    assert_eq!(header(&first, "x-engram-memory"), "skipped");
    assert_eq!(header(&first, "x-engram-memory-reason"), "empty");
    wait_applied(&proxy, "acme", "alice", &first).await;

    let topics = [
        "the weather in Lisbon",
        "how tides work",
        "a good name for a cat",
        "the history of the bicycle",
        "why the sky is blue",
    ];
    let mut last = None;
    for turn in 0..30 {
        let text = format!("Tell me about {} (question {turn}).", topics[turn % 5]);
        last = Some(say(&proxy, "acme", "alice", "s2", &text).await);
    }
    let last = last.unwrap();
    wait_applied(&proxy, "acme", "alice", &last).await;

    let reply = say(
        &proxy,
        "acme",
        "alice",
        "s2",
        "Suggest a snack for my hike.",
    )
    .await;
    assert_eq!(header(&reply, "x-engram-memory"), "injected");
    let tokens: u32 = header(&reply, "x-engram-memory-tokens").parse().unwrap();
    assert!(tokens > 0 && tokens <= 2048, "{tokens}");
    let prompts = recorded(&record);
    assert_eq!(prompts.len(), 32);
    let prompt = prompts.last().unwrap();
    let memory = memory_part(prompt).to_lowercase();
    assert!(
        memory.contains("peanut"),
        "constraint missing from: {memory}"
    );
    assert!(memory.contains("<engram-memory"), "{memory}");
    // The client's own message arrives last and unchanged.
    let messages = prompt["messages"].as_array().unwrap();
    assert_eq!(
        messages.last().unwrap()["content"],
        "Suggest a snack for my hike."
    );
    // Another user of the same tenant sees none of it.
    let stranger = say(&proxy, "acme", "bob", "s1", "Suggest a snack for my hike.").await;
    assert_ne!(header(&stranger, "x-engram-memory"), "injected");
    let prompts = recorded(&record);
    assert!(!memory_part(prompts.last().unwrap()).contains("peanut"));
}

#[tokio::test]
async fn receipts_name_the_turn_and_job_and_the_admin_api_reports_the_job() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);

    let reply = say(&proxy, "default", "carol", "s", "My name is Carol.").await;
    let turn = header(&reply, "x-engram-turn-id").to_owned();
    let job = header(&reply, "x-engram-job-id").to_owned();
    assert!(turn.starts_with('t'), "{turn}");
    assert_eq!(job.len(), 32);
    // The answer ended once the exchange was durable in the store.
    assert_eq!(header(&reply, "x-engram-job-state"), "queued");
    wait_applied(&proxy, "default", "carol", &reply).await;

    // A stream ends with the receipt comment, then the upstream's `data: [DONE]`.
    let body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "And I live in Oslo."}],
        "stream": true,
    });
    let streamed = post_json(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-engram-user", "carol"), ("x-engram-session", "s")],
    )
    .await;
    let text = String::from_utf8(streamed.body.to_vec()).unwrap();
    let stream_job = header(&streamed, "x-engram-job-id").to_owned();
    // Just before `data: [DONE]`, where an SDK stops reading: held until the job is durable.
    let mut last_lines = text.lines().rev().filter(|line| !line.is_empty());
    assert_eq!(last_lines.next(), Some("data: [DONE]"), "{text}");
    assert_eq!(
        last_lines.next().unwrap(),
        format!(
            ": engram turn={} job={stream_job} state=queued",
            header(&streamed, "x-engram-turn-id")
        )
    );
    wait_applied(&proxy, "default", "carol", &streamed).await;

    // Unknown jobs, other users' jobs and bad tokens.
    let missing = admin(&proxy, "/engram/v1/users/carol/jobs/ffff", "default").await;
    common::assert_openai_error(&missing, 404);
    let other = admin(
        &proxy,
        &format!("/engram/v1/users/dave/jobs/{job}"),
        "default",
    )
    .await;
    common::assert_openai_error(&other, 404);
    let other_tenant = admin(&proxy, &format!("/engram/v1/users/carol/jobs/{job}"), "t2").await;
    common::assert_openai_error(&other_tenant, 404);
    let unauthorized = send(
        "GET",
        &proxy.url(&format!("/engram/v1/users/carol/jobs/{job}")),
        &[("authorization", "Bearer wrong")],
        "",
    )
    .await;
    common::assert_openai_error(&unauthorized, 401);
    let anonymous = send("GET", &proxy.url("/engram/v1/queue"), &[], "").await;
    common::assert_openai_error(&anonymous, 401);

    let memory = export(&proxy, "default", "carol").await;
    assert_eq!(memory["raw_log"].as_array().unwrap().len(), 2);
    assert_eq!(memory["raw_log"][0]["exchange"]["turn_id"], turn.as_str());
}

#[tokio::test]
async fn read_only_and_off_modes_record_nothing_and_bad_identity_headers_are_rejected() {
    let record = temp_path("modes.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);
    let first = say(&proxy, "default", "erin", "s", "I work as a pilot.").await;
    wait_applied(&proxy, "default", "erin", &first).await;

    let body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "What do I do for work?"}],
    });
    let probe = post_json(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-engram-user", "erin"), ("x-engram-mode", "read-only")],
    )
    .await;
    assert_eq!(header(&probe, "x-engram-memory"), "injected");
    assert!(probe.headers.get("x-engram-job-id").is_none());
    assert!(memory_part(recorded(&record).last().unwrap()).contains("pilot"));

    let off = post_json(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-engram-user", "erin"), ("x-engram-mode", "off")],
    )
    .await;
    assert_eq!(header(&off, "x-engram-memory"), "skipped");
    assert_eq!(header(&off, "x-engram-memory-reason"), "mode_off");
    let prompts = recorded(&record);
    assert_eq!(
        prompts.last().unwrap()["messages"]
            .as_array()
            .unwrap()
            .len(),
        1
    );

    let anonymous = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(header(&anonymous, "x-engram-memory-reason"), "no_user");

    wait_drained(&proxy, Duration::from_secs(10)).await;
    let memory = export(&proxy, "default", "erin").await;
    assert_eq!(memory["raw_log"].as_array().unwrap().len(), 1);

    for (name, value) in [
        ("x-engram-user", "../etc/passwd"),
        ("x-engram-user", "a b"),
        ("x-engram-mode", "sometimes"),
        ("x-engram-event-time", "yesterday"),
    ] {
        let reply = post_json(&proxy.url("/v1/chat/completions"), &body, &[(name, value)]).await;
        let error = common::assert_openai_error(&reply, 400);
        assert!(
            error["error"]["message"].as_str().unwrap().contains(name),
            "{error}"
        );
    }
}

const IDENTITIES: [(&str, &str); 4] = [("t1", "u1"), ("t1", "u2"), ("t2", "u1"), ("t2", "u2")];

fn secret(tenant: &str, user: &str) -> String {
    format!("zq{tenant}x{user}secret")
}

/// Every identity sends `turns` messages at once with the others (streams and not).
async fn hammer(proxy: &Process, turns: usize, round: &str) {
    let mut tasks = Vec::new();
    for (tenant, user) in IDENTITIES {
        let url = proxy.url("/v1/chat/completions");
        let round = round.to_owned();
        tasks.push(tokio::spawn(async move {
            for turn in 0..turns {
                let text = format!(
                    "[{tenant}/{user}] My favourite word is {}. {round} turn {turn}.",
                    secret(tenant, user)
                );
                let body = json!({
                    "model": "gpt-test",
                    "messages": [{"role": "user", "content": text}],
                    "stream": turn % 2 == 0,
                });
                let headers = [
                    ("x-engram-tenant", tenant),
                    ("x-engram-user", user),
                    ("x-engram-session", "s"),
                ];
                let reply = post_json(&url, &body, &headers).await;
                assert_eq!(reply.status.as_u16(), 200);
            }
        }));
    }
    for task in tasks {
        task.await.unwrap();
    }
}

/// Checks that no recorded prompt carries another identity's secret; returns how many carried
/// memory at all.
fn assert_no_crossing(prompts: &[Value]) -> usize {
    let mut injected = 0;
    for prompt in prompts {
        let messages = prompt["messages"].as_array().unwrap();
        let own = messages.last().unwrap()["content"].as_str().unwrap();
        let (tenant, user) = IDENTITIES
            .iter()
            .copied()
            .find(|(tenant, user)| own.starts_with(&format!("[{tenant}/{user}]")))
            .unwrap();
        let memory = memory_part(prompt);
        if memory.contains(&secret(tenant, user)) {
            injected += 1;
        }
        for (other_tenant, other_user) in IDENTITIES {
            if (other_tenant, other_user) != (tenant, user) {
                assert!(
                    !memory.contains(&secret(other_tenant, other_user)),
                    "{tenant}/{user} saw {other_tenant}/{other_user}: {memory}"
                );
            }
        }
    }
    injected
}

#[tokio::test]
async fn two_tenants_and_two_users_hammered_at_once_never_see_each_others_items() {
    let record = temp_path("isolation.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);

    // Writes and reads interleaved while the worker applies the jobs behind them.
    hammer(&proxy, 12, "first").await;
    wait_drained(&proxy, Duration::from_secs(30)).await;
    let prompts = recorded(&record);
    assert_eq!(prompts.len(), 48);
    assert_no_crossing(&prompts);

    // Now every identity has memory: each prompt carries its own and only its own.
    hammer(&proxy, 6, "second").await;
    let prompts = recorded(&record);
    assert_eq!(assert_no_crossing(&prompts[48..]), 24);
    wait_drained(&proxy, Duration::from_secs(30)).await;

    for (tenant, user) in IDENTITIES {
        let memory = export(&proxy, tenant, user).await;
        assert_eq!(
            memory["raw_log"].as_array().unwrap().len(),
            18,
            "{tenant}/{user}"
        );
        let text = memory.to_string();
        assert!(text.contains(&secret(tenant, user)));
        for (other_tenant, other_user) in IDENTITIES {
            if (other_tenant, other_user) != (tenant, user) {
                assert!(!text.contains(&secret(other_tenant, other_user)));
            }
        }
    }
}

/// Replies with a valid summarizer diff, slowly, so the worker is mid-job when it is killed.
const SLOW_SUMMARY: &str = r#"{"user_summary":"The user shared a number.","assistant_summary":"The assistant acknowledged it.","add":[],"update":[],"remove":[]}"#;

#[tokio::test]
async fn a_worker_killed_mid_job_applies_every_recorded_turn_exactly_once_after_restart() {
    let upstream = mock(&[]);
    let summarizer = mock(&["--reply", SLOW_SUMMARY, "--latency-ms", "150"]);
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().display().to_string();
    let summarizer_url = format!("{}/v1", summarizer.address);
    let env = [
        ("ENGRAM_STORE__DATA_DIR", data_dir.as_str()),
        ("ENGRAM_SUMMARIZER__BASE_URL", summarizer_url.as_str()),
        ("ENGRAM_WORKER__CONCURRENCY", "1"),
        ("ENGRAM_WORKER__LEASE_MS", "1500"),
    ];
    let first = proxy(&upstream.address, &env);
    let turns = 24;
    let mut turn_ids = Vec::new();
    for turn in 0..turns {
        let reply = say(
            &first,
            "default",
            "kim",
            "s",
            &format!("Remember number {turn}."),
        )
        .await;
        turn_ids.push(header(&reply, "x-engram-turn-id").to_owned());
    }
    // Every exchange is queued (the outbox counts them) and some, not all, are applied.
    kill_while_applying(first, turns, 2).await;

    let second = proxy(&upstream.address, &env);
    wait_drained(&second, Duration::from_secs(60)).await;
    let memory = export(&second, "default", "kim").await;
    let raw = common::memory::raw_turn_ids(&memory);
    assert_eq!(raw, turn_ids, "raw log: each turn once, in order");
    let applied = common::memory::applied_turn_ids(&memory);
    assert_eq!(applied.len(), turns);
    assert_eq!(applied.iter().collect::<HashSet<_>>().len(), turns);
    assert_eq!(applied, turn_ids, "memory: each turn once, in order");
}

/// Kills the proxy once its worker has applied at least `applied` of the `queued` jobs it was
/// sent and some are still queued: mid-way through the worker's run of jobs, whose index
/// refreshes seal and merge parts every 128 turns.
async fn kill_while_applying(mut proxy: Process, queued: usize, applied: u64) {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let queue = admin(&proxy, "/engram/v1/queue", "default").await.json();
        if queue["recorded"]["queued"] == queued
            && queue["worker"]["applied"].as_u64() >= Some(applied)
        {
            assert!(queue["depth"].as_u64().unwrap() > 0, "{queue}");
            break;
        }
        assert!(Instant::now() < deadline, "{queue}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    proxy.signal("KILL");
    assert!(proxy.wait_exit(Duration::from_secs(5)).is_some());
}

/// A long history crosses several index merges; the process is killed twice while its worker
/// applies (at a moment that varies from run to run), and restarted: every turn is in memory
/// exactly once, in order, and the rebuilt index still finds the oldest and the newest ones.
#[tokio::test]
async fn killed_twice_during_index_merges_every_turn_stays_once_and_findable() {
    let record = temp_path("merges.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    // A summarizer answering in 20 ms keeps the worker (at most 50 jobs a second) behind the
    // requests, so each kill lands while jobs are still being applied.
    let summarizer = mock(&["--reply", SLOW_SUMMARY, "--latency-ms", "20"]);
    let summarizer_url = format!("{}/v1", summarizer.address);
    let data = tempfile::tempdir().unwrap();
    let data_dir = data.path().display().to_string();
    let env = [
        ("ENGRAM_STORE__DATA_DIR", data_dir.as_str()),
        ("ENGRAM_SUMMARIZER__BASE_URL", summarizer_url.as_str()),
        ("ENGRAM_WORKER__CONCURRENCY", "1"),
        ("ENGRAM_WORKER__LEASE_MS", "1000"),
    ];
    let word = |turn: usize| format!("quillon{turn}");
    let jitter = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    let mut turn_ids = Vec::new();
    let mut sent = 0;
    for (batch, kill_after) in [(300, 60 + jitter % 200), (200, 40 + jitter / 7 % 120)] {
        let proxy = proxy(&upstream.address, &env);
        for turn in sent..sent + batch {
            let text = format!("Note {turn}: the code word for today is {}.", word(turn));
            let reply = say(&proxy, "default", "solo", "s", &text).await;
            turn_ids.push(header(&reply, "x-engram-turn-id").to_owned());
        }
        sent += batch;
        kill_while_applying(proxy, batch, kill_after).await;
    }

    let proxy = proxy(&upstream.address, &env);
    wait_drained(&proxy, Duration::from_secs(120)).await;
    let memory = export(&proxy, "default", "solo").await;
    assert_eq!(
        common::memory::raw_turn_ids(&memory),
        turn_ids,
        "raw log: each turn once, in order"
    );
    let applied = common::memory::applied_turn_ids(&memory);
    assert_eq!(applied, turn_ids, "memory: each turn once, in order");
    for turn in [3, 150, sent - 5] {
        say(
            &proxy,
            "default",
            "solo",
            "other",
            &format!("Which note had the code word {}?", word(turn)),
        )
        .await;
        let prompt = recorded(&record).pop().unwrap();
        assert!(
            memory_part(&prompt).contains(&format!("Note {turn}:")),
            "turn {turn} not recalled: {}",
            memory_part(&prompt)
        );
    }
}

/// A summarizer reply with one grounded fact and one the exchange never mentions.
const SUMMARY_WITH_HALLUCINATION: &str = r#"{"user_summary":"The user named their greyhound.","assistant_summary":"The assistant liked the name.","add":["dog name: Comet","boat: a yacht in Monaco"],"update":[],"remove":[]}"#;

async fn facts_of(proxy: &Process, user: &str) -> Vec<String> {
    let memory = export(proxy, "default", user).await;
    memory["memory"]["facts"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|fact| fact["active"] == true)
        .map(|fact| {
            format!(
                "{}: {}",
                fact["key"].as_str().unwrap(),
                fact["value"].as_str().unwrap_or_default()
            )
        })
        .collect()
}

/// The summarizer's grounded fact is in memory, its hallucinated one is not.
async fn assert_grounded_facts_only(proxy: &Process, user: &str) {
    let facts = facts_of(proxy, user).await;
    assert!(
        facts.iter().any(|fact| fact == "dog name: Comet"),
        "{facts:?}"
    );
    assert!(
        !facts.iter().any(|fact| fact.contains("yacht")),
        "{facts:?}"
    );
}

#[tokio::test]
async fn the_llm_summarizers_grounded_facts_reach_memory_and_hallucinated_ones_do_not() {
    let upstream = mock(&[]);
    let summarizer = mock(&["--reply", SUMMARY_WITH_HALLUCINATION]);
    let summarizer_url = format!("{}/v1", summarizer.address);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_SUMMARIZER__BASE_URL", summarizer_url.as_str())],
    );
    let reply = say(
        &proxy,
        "default",
        "quinn",
        "s",
        "Our greyhound is called Comet.",
    )
    .await;
    wait_applied(&proxy, "default", "quinn", &reply).await;
    assert_grounded_facts_only(&proxy, "quinn").await;
    let queue = admin(&proxy, "/engram/v1/queue", "default").await.json();
    assert_eq!(queue["worker"]["summarizer_fallbacks"], 0, "{queue}");
}

#[tokio::test]
async fn a_summarizer_timeout_records_the_heuristic_now_and_applies_the_model_later() {
    let upstream = mock(&[]);
    // Slower than the summarizer's timeout at first …
    let slow = mock(&[
        "--reply",
        SUMMARY_WITH_HALLUCINATION,
        "--latency-ms",
        "2000",
    ]);
    let listen = slow.address.trim_start_matches("http://").to_owned();
    let summarizer_url = format!("{}/v1", slow.address);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_SUMMARIZER__BASE_URL", summarizer_url.as_str()),
            ("ENGRAM_SUMMARIZER__TIMEOUT_MS", "300"),
            // Long enough for the fast mock to be up on a loaded CI machine: the retry happens
            // once, and a retry that met the dead address would leave the heuristic in place.
            ("ENGRAM_SUMMARIZER__BACKGROUND_RETRY_DELAY_MS", "5000"),
        ],
    );
    let reply = say(
        &proxy,
        "default",
        "ravi",
        "s",
        "Our greyhound is called Comet.",
    )
    .await;
    wait_applied(&proxy, "default", "ravi", &reply).await;
    let queue = admin(&proxy, "/engram/v1/queue", "default").await.json();
    assert_eq!(queue["worker"]["summarizer_fallbacks"], 1, "{queue}");
    assert!(
        !facts_of(&proxy, "ravi")
            .await
            .iter()
            .any(|fact| fact == "dog name: Comet")
    );

    // … then answering in time, on the same address, before the background retry.
    drop(slow); // stops the mock and frees its port
    let _fast = mock_at(&listen, &["--reply", SUMMARY_WITH_HALLUCINATION]);
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let queue = admin(&proxy, "/engram/v1/queue", "default").await.json();
        if queue["worker"]["summarizer_refined"] == 1 {
            break;
        }
        assert!(Instant::now() < deadline, "{queue}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_grounded_facts_only(&proxy, "ravi").await;
}

#[tokio::test]
async fn an_upstream_error_is_forwarded_and_records_nothing() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "I live in Oslo."}],
    });
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("x-engram-user", "sam"), ("x-mock-status", "503")],
    )
    .await;
    assert_eq!(reply.status.as_u16(), 503);
    assert!(reply.headers.get("x-engram-job-id").is_none());
    assert!(reply.headers.get("x-engram-turn-id").is_none());
    // The next answered turn of the session is not held up behind the failed one.
    let ok = say(&proxy, "default", "sam", "default", "I work as a baker.").await;
    wait_applied(&proxy, "default", "sam", &ok).await;
    wait_drained(&proxy, Duration::from_secs(10)).await;
    let memory = export(&proxy, "default", "sam").await;
    let raw = memory["raw_log"].as_array().unwrap();
    assert_eq!(raw.len(), 1);
    assert_eq!(raw[0]["exchange"]["user_text"], "I work as a baker.");
}

#[tokio::test]
async fn any_body_user_an_app_already_sends_gets_a_memory_of_its_own() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let url = proxy.url("/v1/chat/completions");
    let ask = |user: &'static str, text: &'static str| {
        let url = url.clone();
        async move {
            let body = json!({
                "model": "gpt-test",
                "messages": [{"role": "user", "content": text}],
                "user": user,
            });
            post_json(&url, &body, &[]).await
        }
    };
    for (user, id) in [
        ("user:123", "enc+757365723a313233"),
        ("a b", "enc+612062"),
        ("josé", "enc+6a6f73c3a9"),
    ] {
        let reply = ask(user, "My favourite colour is teal.").await;
        assert_eq!(
            reply.status,
            200,
            "{user}: {}",
            String::from_utf8_lossy(&reply.body)
        );
        wait_applied(&proxy, "default", id, &reply).await;
        let memory = export(&proxy, "default", id).await;
        assert!(memory.to_string().contains("teal"), "{user}: {memory}");
        assert_eq!(memory["user_as_sent"], user, "{memory}");
        // The management API finds the same memory by the value the app sent.
        let by_value = export(&proxy, "default", &percent_encoded(user)).await;
        assert_eq!(by_value["user"], id, "{by_value}");
    }
    // An empty `user` names nobody: no memory, no error.
    let reply = ask("", "Hello.").await;
    assert_eq!(reply.status, 200);
    assert_eq!(header(&reply, "x-engram-memory-reason"), "no_user");
}

/// `text` percent-encoded as a path segment (every byte outside the unreserved set).
fn percent_encoded(text: &str) -> String {
    text.bytes()
        .map(|byte| match byte {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(byte).to_string()
            }
            _ => format!("%{byte:02X}"),
        })
        .collect()
}
