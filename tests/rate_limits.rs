//! Rate limits against the real binary: a burst over a tenant's or a user's limit gets 429s in
//! OpenAI's shape with `retry-after` while everyone else passes; a spent summarizer token budget
//! records the turn with the heuristic extractor without calling the model.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use common::memory::{admin, say, wait_applied};
use common::{Reply, assert_openai_error, chat_body, mock, post_json, proxy, send};

async fn chat(proxy: &common::Process, tenant: &str, user: Option<&str>) -> Reply {
    let mut headers = vec![("x-engram-tenant", tenant)];
    if let Some(user) = user {
        headers.push(("x-engram-user", user));
    }
    post_json(
        &proxy.url("/v1/chat/completions"),
        &chat_body(false),
        &headers,
    )
    .await
}

/// Sends `count` chat requests at once.
async fn burst(
    proxy: &common::Process,
    count: usize,
    tenant: &str,
    user: Option<&str>,
) -> Vec<Reply> {
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..count {
        let url = proxy.url("/v1/chat/completions");
        let tenant = tenant.to_owned();
        let user = user.map(str::to_owned);
        tasks.spawn(async move {
            let mut headers = vec![("x-engram-tenant", tenant.as_str())];
            if let Some(user) = &user {
                headers.push(("x-engram-user", user.as_str()));
            }
            post_json(&url, &chat_body(false), &headers).await
        });
    }
    tasks.join_all().await
}

/// `engram_rate_limited_total{kind}` from the proxy's `/metrics`.
async fn rate_limited(proxy: &common::Process, kind: &str) -> u64 {
    let scrape = send("GET", &proxy.url("/metrics"), &[], "").await;
    let text = String::from_utf8_lossy(&scrape.body).into_owned();
    let series = format!("engram_rate_limited_total{{kind=\"{kind}\"}} ");
    text.lines()
        .find_map(|line| line.strip_prefix(&series))
        .and_then(|value| value.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {series} in {text}"))
}

/// Splits replies into passed (200) and rejected (429, checked for shape and `retry-after`).
fn tally(replies: &[Reply]) -> (usize, usize) {
    let mut passed = 0;
    let mut rejected = 0;
    for reply in replies {
        match reply.status.as_u16() {
            200 => passed += 1,
            429 => {
                let body = assert_openai_error(reply, 429);
                assert_eq!(body["error"]["code"], "rate_limit_exceeded", "{body}");
                let retry_after: u64 = reply.headers["retry-after"]
                    .to_str()
                    .unwrap()
                    .parse()
                    .unwrap();
                assert!(retry_after >= 1, "retry-after {retry_after}");
                rejected += 1;
            }
            status => panic!("unexpected status {status}"),
        }
    }
    (passed, rejected)
}

#[tokio::test]
async fn a_burst_over_the_tenant_limit_gets_429s_and_other_tenants_pass() {
    let upstream = mock(&[]);
    // One request a second with a burst of five: of twelve sent at once, five pass, plus one
    // for each second the twelve took to arrive.
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_RATE_LIMITS__TENANT_REQUESTS_PER_SECOND", "1"),
            ("ENGRAM_RATE_LIMITS__TENANT_BURST", "5"),
        ],
    );
    let started = std::time::Instant::now();
    let burst = burst(&proxy, 12, "noisy", None).await;
    let (passed, rejected) = tally(&burst);
    // Five at once, plus one per second the burst took to arrive (a loaded machine is slow).
    let refilled = started.elapsed().as_secs() as usize + 1;
    assert!(
        passed >= 5 && passed <= 5 + refilled && rejected > 0,
        "passed {passed} of 12 in {:?}",
        started.elapsed()
    );
    assert_eq!(passed + rejected, 12);
    assert_eq!(
        rate_limited(&proxy, "requests").await,
        rejected as u64,
        "every 429 is counted"
    );

    // Another tenant has its own allowance, on chat and pass-through routes alike.
    let quiet = chat(&proxy, "quiet", Some("ann")).await;
    assert_eq!(quiet.status, 200);
    let models = send(
        "GET",
        &proxy.url("/v1/models"),
        &[("x-engram-tenant", "quiet")],
        "",
    )
    .await;
    assert_eq!(models.status, 200);
    // Pass-through routes count against the tenant too: the bucket refills one a second, so
    // of eight at once at least one is turned away.
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let url = proxy.url("/v1/models");
        tasks.spawn(async move { send("GET", &url, &[("x-engram-tenant", "noisy")], "").await });
    }
    let models = tasks.join_all().await;
    let refused: Vec<&Reply> = models.iter().filter(|reply| reply.status == 429).collect();
    assert!(!refused.is_empty(), "no pass-through request was limited");
    assert_openai_error(refused[0], 429);
}

#[tokio::test]
async fn a_user_over_their_limit_is_turned_away_and_records_nothing() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_RATE_LIMITS__USER_REQUESTS_PER_SECOND", "1"),
            ("ENGRAM_RATE_LIMITS__USER_BURST", "2"),
        ],
    );
    let started = std::time::Instant::now();
    let burst = burst(&proxy, 6, "t", Some("alice")).await;
    let (passed, rejected) = tally(&burst);
    let refilled = started.elapsed().as_secs() as usize + 1;
    assert!(
        passed >= 2 && passed <= 2 + refilled && rejected > 0,
        "passed {passed} of 6 in {:?}",
        started.elapsed()
    );
    assert_eq!(passed + rejected, 6);
    // Rejected requests never reached the recorder: only the passed ones are queued.
    let recorded = burst
        .iter()
        .filter(|reply| reply.headers.contains_key("x-engram-job-id"))
        .count();
    assert_eq!(recorded, passed);

    // Other users of the tenant, and requests without a user, are not limited by alice.
    for user in ["bob", "carol"] {
        assert_eq!(chat(&proxy, "t", Some(user)).await.status, 200);
    }
    assert_eq!(chat(&proxy, "t", None).await.status, 200);
}

#[tokio::test]
async fn a_spent_summarizer_token_budget_falls_back_without_calling_the_model() {
    let upstream = mock(&[]);
    let record = common::temp_path("rate-limited-summarizer.jsonl");
    let record_arg = record.display().to_string();
    let summarizer = mock(&[
        "--reply",
        r#"{"user_summary":"x","assistant_summary":"y","add":[],"update":[],"remove":[]}"#,
        "--record",
        &record_arg,
    ]);
    let summarizer_url = format!("{}/v1", summarizer.address);
    // Ten tokens a minute cannot cover one call (the system prompt alone is more).
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_SUMMARIZER__BASE_URL", summarizer_url.as_str()),
            (
                "ENGRAM_RATE_LIMITS__TENANT_SUMMARIZER_TOKENS_PER_MINUTE",
                "10",
            ),
        ],
    );
    let reply = say(&proxy, "default", "uma", "s", "I'm allergic to peanuts.").await;
    wait_applied(&proxy, "default", "uma", &reply).await;
    let queue = admin(&proxy, "/engram/v1/queue", "default").await.json();
    assert_eq!(queue["worker"]["summarizer_fallbacks"], 1, "{queue}");
    assert!(
        std::fs::read_to_string(&record)
            .unwrap_or_default()
            .is_empty(),
        "the summarizer was called despite the spent budget"
    );
    assert_eq!(rate_limited(&proxy, "summarizer_tokens").await, 1);
    // The heuristic extraction still recorded the constraint.
    let memory = admin(&proxy, "/engram/v1/users/uma/memory", "default")
        .await
        .json();
    assert!(memory.to_string().contains("peanut"), "{memory}");
}
