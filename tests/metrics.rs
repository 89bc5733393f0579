//! `/metrics` through the real binary: traffic on every path moves the metrics it should, and
//! every metric the Grafana dashboard and alert rules query is exported.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use common::memory::{header, say, wait_applied, wait_drained};
use common::{Process, mock, post_json, proxy, send};
use serde_json::{Value, json};

const DASHBOARD: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/grafana/engram-dashboard.json"
);

const ALERTS: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/deploy/grafana/engram-alerts.yaml"
);

/// A scraped page: each family's type, and each sample's value by its full series name
/// (`name{label="value",...}` exactly as printed).
struct Scrape {
    types: HashMap<String, String>,
    samples: HashMap<String, f64>,
}

impl Scrape {
    fn parse(page: &str) -> Scrape {
        let mut types = HashMap::new();
        let mut samples = HashMap::new();
        for line in page.lines() {
            if let Some(declaration) = line.strip_prefix("# TYPE ") {
                let (name, kind) = declaration.split_once(' ').unwrap();
                types.insert(name.to_owned(), kind.to_owned());
            } else if !line.starts_with('#') && !line.is_empty() {
                let (series, value) = line.rsplit_once(' ').unwrap();
                samples.insert(series.to_owned(), value.parse().unwrap());
            }
        }
        Scrape { types, samples }
    }

    /// The value of one series; 0 when absent.
    fn value(&self, series: &str) -> f64 {
        self.samples.get(series).copied().unwrap_or(0.0)
    }

    /// The sum of every series of `name` whose labels include all of `labels`.
    fn sum(&self, name: &str, labels: &[&str]) -> f64 {
        self.samples
            .iter()
            .filter(|(series, _)| {
                let (series_name, series_labels) =
                    series.split_once('{').unwrap_or((series.as_str(), ""));
                series_name == name && labels.iter().all(|label| series_labels.contains(label))
            })
            .map(|(_, value)| value)
            .sum()
    }

    /// True when the page has samples of family `name` (a histogram's come as `_bucket`, ...).
    fn exports(&self, name: &str) -> bool {
        let prefix = |series: &str| {
            series
                .split_once('{')
                .map_or(series, |(name, _)| name)
                .to_owned()
        };
        self.types.contains_key(name)
            && self.samples.keys().any(|series| {
                let series = prefix(series);
                series == name
                    || ["_bucket", "_sum", "_count"]
                        .iter()
                        .any(|suffix| series == format!("{name}{suffix}"))
            })
    }
}

async fn scrape(proxy: &Process) -> Scrape {
    let reply = send("GET", &proxy.url("/metrics"), &[], "").await;
    assert_eq!(reply.status.as_u16(), 200);
    assert_eq!(
        reply.headers["content-type"], "text/plain; version=0.0.4",
        "the Prometheus text format"
    );
    Scrape::parse(std::str::from_utf8(&reply.body).unwrap())
}

/// Every `engram_*` metric the dashboard's queries name (`_bucket`, `_sum` and `_count` of a
/// histogram as the histogram's own name), from every `expr` and template variable query.
fn dashboard_metrics(scrape: &Scrape) -> BTreeSet<String> {
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(DASHBOARD).unwrap())
        .expect("the dashboard is JSON");
    let mut queries = Vec::new();
    collect_queries(&dashboard, &mut queries);
    assert!(queries.len() > 20, "{queries:?}");
    metric_names(scrape, &queries)
}

/// Every `engram_*` metric the Grafana alert rules query.
fn alert_metrics(scrape: &Scrape) -> BTreeSet<String> {
    let alerts: Value = serde_saphyr::from_str(&std::fs::read_to_string(ALERTS).unwrap())
        .expect("the alert rules are YAML");
    let mut queries = Vec::new();
    collect_queries(&alerts, &mut queries);
    assert_eq!(queries.len(), 2, "{queries:?}");
    metric_names(scrape, &queries)
}

fn metric_names(scrape: &Scrape, queries: &[String]) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for query in queries {
        let mut rest = query.as_str();
        while let Some(at) = rest.find("engram_") {
            let tail = &rest[at..];
            let end = tail
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(tail.len());
            let name = &tail[..end];
            let base = ["_bucket", "_sum", "_count"]
                .iter()
                .find_map(|suffix| name.strip_suffix(suffix))
                .filter(|base| scrape.types.get(*base).map(String::as_str) == Some("histogram"))
                .unwrap_or(name);
            names.insert(base.to_owned());
            rest = &tail[end..];
        }
    }
    names
}

fn collect_queries(value: &Value, out: &mut Vec<String>) {
    match value {
        Value::Object(object) => {
            for (key, value) in object {
                match (key.as_str(), value) {
                    ("expr" | "definition", Value::String(query)) => out.push(query.clone()),
                    _ => collect_queries(value, out),
                }
            }
        }
        Value::Array(items) => items.iter().for_each(|item| collect_queries(item, out)),
        _ => {}
    }
}

#[tokio::test]
async fn traffic_moves_the_metrics_and_every_dashboard_metric_is_exported() {
    let upstream = mock(&[]);
    // The mock as the summarizer too: its filler reply is not the JSON the prompt asks for, so
    // every extraction makes two calls and falls back, which the summarizer metrics show.
    let summarizer = format!("{}/v1", upstream.address);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_SUMMARIZER__BASE_URL", summarizer.as_str())],
    );

    // Session one: facts to remember.
    let first = say(
        &proxy,
        "acme",
        "alice",
        "s1",
        "My sister Maria lives in Lisbon and works as an architect.",
    )
    .await;
    assert_eq!(header(&first, "x-engram-memory"), "skipped");
    wait_applied(&proxy, "acme", "alice", &first).await;
    let second = say(&proxy, "acme", "alice", "s1", "I'm allergic to peanuts.").await;
    wait_applied(&proxy, "acme", "alice", &second).await;

    // Session two, not streamed: memory of session one is injected and recalled.
    let asked = say(
        &proxy,
        "acme",
        "alice",
        "s2",
        "Where does my sister Maria live and what does she do?",
    )
    .await;
    assert_eq!(header(&asked, "x-engram-memory"), "injected");

    // Streamed.
    let streamed = post_json(
        &proxy.url("/v1/chat/completions"),
        &json!({
            "model": "gpt-test",
            "messages": [{"role": "user", "content": "Suggest a snack for my hike."}],
            "stream": true,
        }),
        &[
            ("x-engram-user", "alice"),
            ("x-engram-tenant", "acme"),
            ("x-engram-session", "s2"),
        ],
    )
    .await;
    assert_eq!(streamed.status.as_u16(), 200);
    assert_eq!(header(&streamed, "x-engram-memory"), "injected");
    wait_applied(&proxy, "acme", "alice", &streamed).await;

    // Read-only: memory is read, nothing is recorded.
    let read_only = post_json(
        &proxy.url("/v1/chat/completions"),
        &common::chat_body(false),
        &[
            ("x-engram-user", "alice"),
            ("x-engram-tenant", "acme"),
            ("x-engram-mode", "read-only"),
        ],
    )
    .await;
    assert_eq!(read_only.status.as_u16(), 200);
    assert!(read_only.headers.get("x-engram-job-id").is_none());

    // An upstream error, no user at all, a pass-through route, an unknown route.
    let failed = post_json(
        &proxy.url("/v1/chat/completions"),
        &common::chat_body(false),
        &[
            ("x-engram-user", "alice"),
            ("x-engram-tenant", "acme"),
            ("x-mock-status", "503"),
        ],
    )
    .await;
    assert_eq!(failed.status.as_u16(), 503);
    let anonymous = post_json(
        &proxy.url("/v1/chat/completions"),
        &common::chat_body(false),
        &[],
    )
    .await;
    assert_eq!(header(&anonymous, "x-engram-memory-reason"), "no_user");
    assert_eq!(
        send("GET", &proxy.url("/v1/models"), &[], "")
            .await
            .status
            .as_u16(),
        200
    );
    assert_eq!(
        send("GET", &proxy.url("/nowhere"), &[], "")
            .await
            .status
            .as_u16(),
        404
    );
    wait_drained(&proxy, Duration::from_secs(30)).await;

    // The worker counts a job just after committing it (on its low-priority threads), so the
    // last count may trail the store by a moment.
    let deadline = Instant::now() + Duration::from_secs(30);
    let scrape = loop {
        let scrape = scrape(&proxy).await;
        let applied = scrape.value("engram_jobs_total{result=\"applied\"}");
        if applied >= 4.0 && scrape.value("engram_job_lag_seconds_count") >= 4.0 {
            break scrape;
        }
        assert!(Instant::now() < deadline, "jobs applied: {applied}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };

    // Every metric the dashboard queries is on the page.
    let used = dashboard_metrics(&scrape);
    assert!(used.len() >= 25, "{used:?}");
    let missing: Vec<_> = used.iter().filter(|name| !scrape.exports(name)).collect();
    assert!(
        missing.is_empty(),
        "dashboard metrics not exported: {missing:?}"
    );
    let alerted = alert_metrics(&scrape);
    assert!(alerted.contains("engram_job_lag_seconds"), "{alerted:?}");
    let missing: Vec<_> = alerted
        .iter()
        .filter(|name| !scrape.exports(name))
        .collect();
    assert!(
        missing.is_empty(),
        "alerted metrics not exported: {missing:?}"
    );
    // Not on the dashboard, but documented in docs/operations.md.
    assert!(scrape.exports("engram_yields_held_back_total"));

    // Requests by route, status class and memory outcome.
    let chat = |status: &str, memory: &str| {
        scrape.value(&format!(
            "engram_requests_total{{memory=\"{memory}\",route=\"chat_completions\",status=\"{status}\"}}"
        ))
    };
    // asked, streamed, read-only (alice has memory by then) and the 503 (its memory was read
    // before the upstream failed).
    assert!(
        chat("2xx", "injected") >= 3.0,
        "{}",
        chat("2xx", "injected")
    );
    assert_eq!(
        chat("5xx", "injected") + chat("5xx", "degraded") + chat("5xx", "skipped"),
        1.0
    );
    assert!(chat("2xx", "skipped") >= 2.0);
    assert_eq!(
        scrape.value("engram_requests_total{memory=\"none\",route=\"passthrough\",status=\"2xx\"}"),
        1.0
    );
    assert_eq!(
        scrape.value("engram_requests_total{memory=\"none\",route=\"not_found\",status=\"4xx\"}"),
        1.0
    );

    // Engram's own time, the upstream's, time to first token.
    for route in ["chat_completions", "passthrough"] {
        let label = format!("route=\"{route}\"");
        assert!(
            scrape.sum("engram_proxy_overhead_seconds_count", &[&label]) >= 1.0,
            "{route}"
        );
        assert!(
            scrape.sum("engram_upstream_latency_seconds_count", &[&label]) >= 1.0,
            "{route}"
        );
    }
    assert_eq!(
        scrape.sum(
            "engram_proxy_overhead_seconds_count",
            &["route=\"chat_completions\""]
        ),
        7.0,
        "every chat completion the upstream answered"
    );
    assert!(
        scrape.sum(
            "engram_time_to_first_token_seconds_count",
            &["stream=\"true\""]
        ) >= 1.0
    );
    assert!(
        scrape.sum(
            "engram_time_to_first_token_seconds_count",
            &["stream=\"false\""]
        ) >= 1.0
    );

    // The phases memory adds: every request that read memory (both of session one, the one
    // asked, the stream, read-only and the 503) loaded and composed it; the four recorded
    // answers (three whole, one streamed) waited for their receipts.
    let phase = |phase: &str| {
        scrape.value(&format!(
            "engram_memory_phase_seconds_count{{phase=\"{phase}\"}}"
        ))
    };
    assert_eq!(
        (phase("load"), phase("compose"), phase("receipt_wait")),
        (6.0, 6.0, 4.0)
    );
    assert!(scrape.value("engram_memory_phase_seconds_sum{phase=\"compose\"}") > 0.0);

    // Memory: tokens per block, items, the history they stand for, retrieval, reasons.
    assert!(scrape.sum("engram_memory_injected_tokens_sum", &["block=\"core\""]) > 0.0);
    assert!(scrape.sum("engram_memory_injected_tokens_count", &["block=\"recall\""]) >= 3.0);
    assert!(scrape.value("engram_memory_injected_items_total") >= 3.0);
    let history = scrape.value("engram_memory_history_tokens_total");
    assert!(history > 0.0, "{history}");
    assert!(scrape.value("engram_retrieval_candidates_total") > 0.0);
    assert!(
        scrape.value("engram_retrieval_hits_total") > 0.0,
        "session one recalled in session two"
    );
    assert!(
        scrape.value("engram_retrieval_hits_total")
            <= scrape.value("engram_retrieval_candidates_total")
    );
    assert_eq!(
        scrape.value("engram_memory_skipped_total{reason=\"no_user\"}"),
        1.0
    );
    assert_eq!(
        scrape.value("engram_memory_skipped_total{reason=\"empty\"}"),
        1.0
    );
    assert_eq!(scrape.sum("engram_memory_fail_open_total", &[]), 0.0);

    // The update path: four recorded exchanges, applied, with their lag; nothing queued now.
    assert_eq!(scrape.value("engram_jobs_total{result=\"applied\"}"), 4.0);
    assert_eq!(scrape.value("engram_job_lag_seconds_count"), 4.0);
    assert_eq!(
        scrape.value("engram_outbox_jobs_total{result=\"queued\"}"),
        4.0
    );
    assert_eq!(scrape.value("engram_queue_depth"), 0.0);
    assert_eq!(scrape.value("engram_recordings_in_flight"), 0.0);

    // The summarizer: two calls per extraction (the invalid-JSON retry), each failed once.
    assert_eq!(scrape.value("engram_summarizer_calls_total"), 8.0);
    assert_eq!(scrape.value("engram_summarizer_latency_seconds_count"), 8.0);
    assert_eq!(
        scrape.value("engram_summarizer_failures_total{reason=\"invalid_json\"}"),
        4.0
    );
    assert!(scrape.value("engram_summarizer_tokens_total{kind=\"prompt\"}") > 0.0);
    assert!(scrape.value("engram_summarizer_tokens_total{kind=\"completion\"}") > 0.0);

    // The store, timed per operation and backend.
    assert!(
        scrape.sum(
            "engram_store_operation_duration_seconds_count",
            &["operation=\"hot_record\"", "backend=\"embedded\""]
        ) >= 6.0
    );
    assert!(
        scrape.sum(
            "engram_store_operation_duration_seconds_count",
            &["operation=\"commit_jobs\"", "backend=\"embedded\""]
        ) >= 1.0
    );
    assert_eq!(scrape.sum("engram_store_errors_total", &[]), 0.0);

    // Nothing was rate limited; the series exist at zero for the dashboard.
    assert_eq!(scrape.sum("engram_rate_limited_total", &[]), 0.0);
    assert!(
        scrape
            .samples
            .contains_key("engram_rate_limited_total{kind=\"requests\"}")
    );
}
