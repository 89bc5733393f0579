//! OpenTelemetry traces, in process: engram built with an in-memory span exporter in front of
//! the mock upstream, and with a real OTLP exporter in front of a fake collector. Checks the
//! GenAI attributes, the span tree, W3C propagation both ways, the worker's link back to the
//! request, that nothing secret is recorded, and that without an endpoint nothing is traced.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests: a failure should fail the test loudly"
)]

mod common;

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Reply, post_json, send};
use engram::app::{Credentials, Engram};
use engram_mock::{MockOptions, MockServer};
use engram_ops::admin::AdminAuth;
use engram_ops::config::Config;
use engram_proxy::telemetry::{Telemetry, TelemetryConfig};
use engram_store::TraceParent;
use http::{HeaderMap, Response};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use opentelemetry::trace::{SpanId, SpanKind, Status, TraceId};
use opentelemetry::{KeyValue, Value};
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use serde_json::json;
use tokio::sync::oneshot;
use tokio_util::task::TaskTracker;

const CALLER: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
const SECRET: &str = "sk-very-secret-key";
const PROMPT: &str = "My favourite colour is teal and I live in Porto.";

/// An engram and its mock upstream, in this process.
struct Running {
    url: String,
    stop: Option<oneshot::Sender<()>>,
    tasks: TaskTracker,
    served: Option<oneshot::Receiver<engram::error::Result<()>>>,
    _data: tempfile::TempDir,
}

impl Running {
    async fn start(edit: impl FnOnce(&mut Config), telemetry: Option<Telemetry>) -> Running {
        let tasks = TaskTracker::new();
        let mock = MockServer::bind(MockOptions::default()).await.unwrap();
        let upstream = mock.local_addr().unwrap();
        tasks.spawn(mock.run());

        let data = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.server.listen = SocketAddr::from(([127, 0, 0, 1], 0));
        config.upstream.base_url = format!("http://{upstream}/v1");
        config.store.data_dir = data.path().to_owned();
        config.store.hot_path_deadline_ms = 5_000;
        config.worker.idle_priority = false;
        config.server.drain_timeout_ms = 5_000;
        edit(&mut config);
        let engram = match telemetry {
            Some(telemetry) => {
                Engram::build_with_telemetry(
                    config,
                    Credentials::admin_only(AdminAuth::default()),
                    telemetry,
                )
                .await
            }
            None => Engram::build(config, Credentials::admin_only(AdminAuth::default())).await,
        }
        .unwrap();
        let url = format!("http://{}", engram.local_addr().unwrap());
        let (stop, stopped) = oneshot::channel::<()>();
        let (done, served) = oneshot::channel();
        tasks.spawn(async move {
            let result = engram
                .run(async {
                    let _ = stopped.await;
                })
                .await;
            let _ = done.send(result);
        });
        Running {
            url,
            stop: Some(stop),
            tasks,
            served: Some(served),
            _data: data,
        }
    }

    fn url(&self, path: &str) -> String {
        format!("{}{path}", self.url)
    }

    /// Graceful shutdown, as on SIGTERM.
    async fn shut_down(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(served) = self.served.take() {
            let result = tokio::time::timeout(Duration::from_secs(20), served)
                .await
                .expect("engram did not stop")
                .expect("engram's task died");
            result.unwrap();
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        self.tasks.close();
    }
}

fn in_memory(config: &TelemetryConfig) -> (Telemetry, InMemorySpanExporter) {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    (Telemetry::with_provider(provider, config), exporter)
}

/// Waits until a finished span matches `wanted`.
async fn span_where(
    exporter: &InMemorySpanExporter,
    wanted: impl Fn(&SpanData) -> bool,
) -> SpanData {
    let deadline = Instant::now() + Duration::from_secs(15);
    loop {
        let spans = exporter.get_finished_spans().unwrap();
        if let Some(span) = spans.into_iter().find(|span| wanted(span)) {
            return span;
        }
        assert!(
            Instant::now() < deadline,
            "no such span among {:#?}",
            exporter
                .get_finished_spans()
                .unwrap()
                .iter()
                .map(|span| span.name.clone())
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

fn attribute(span: &SpanData, key: &str) -> Option<Value> {
    span.attributes
        .iter()
        .find(|kv: &&KeyValue| kv.key.as_str() == key)
        .map(|kv| kv.value.clone())
}

fn int(span: &SpanData, key: &str) -> i64 {
    match attribute(span, key) {
        Some(Value::I64(value)) => value,
        other => panic!("{key} is {other:?} on {}", span.name),
    }
}

fn text(span: &SpanData, key: &str) -> String {
    match attribute(span, key) {
        Some(Value::String(value)) => value.to_string(),
        other => panic!("{key} is {other:?} on {}", span.name),
    }
}

fn received_traceparent(reply: &Reply) -> TraceParent {
    let value = reply
        .headers
        .get("x-mock-received-traceparent")
        .expect("the upstream got no traceparent")
        .to_str()
        .unwrap();
    TraceParent::parse(value).unwrap()
}

fn header_u64(headers: &HeaderMap, name: &str) -> i64 {
    headers[name].to_str().unwrap().parse().unwrap()
}

fn is_child_of(span: &SpanData, parent: &SpanData) -> bool {
    span.parent_span_id == parent.span_context.span_id()
        && span.span_context.trace_id() == parent.span_context.trace_id()
}

/// No attribute of any span holds the key or (unless content capture is on) the prompt.
fn assert_nothing_secret(exporter: &InMemorySpanExporter, prompt_allowed: bool) {
    for span in exporter.get_finished_spans().unwrap() {
        for kv in &span.attributes {
            let value = kv.value.to_string();
            assert!(!value.contains(SECRET), "{} on {}", kv.key, span.name);
            assert!(!value.contains("Bearer"), "{} on {}", kv.key, span.name);
            if !prompt_allowed {
                assert!(!value.contains("teal"), "{} on {}", kv.key, span.name);
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn chat_requests_are_traced_with_the_genai_conventions() {
    let (telemetry, exporter) = in_memory(&TelemetryConfig::default());
    let mut engram = Running::start(|_| {}, Some(telemetry)).await;
    let chat = engram.url("/v1/chat/completions");
    let auth = format!("Bearer {SECRET}");
    let identity = [
        ("x-engram-user", "alice"),
        ("x-engram-session", "trip-planning"),
        ("authorization", auth.as_str()),
    ];

    // 1. Not streamed, inside the caller's trace.
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}]});
    let mut headers = identity.to_vec();
    headers.push(("traceparent", CALLER));
    let reply = post_json(&chat, &body, &headers).await;
    assert_eq!(reply.status, 200);
    let usage = reply.json()["usage"].clone();
    let caller = TraceParent::parse(CALLER).unwrap();

    let request = span_where(&exporter, |span| span.name == "chat gpt-test").await;
    assert_eq!(request.span_kind, SpanKind::Server);
    assert_eq!(request.span_context.trace_id(), caller.trace_id());
    assert_eq!(request.parent_span_id, caller.span_id());
    assert_eq!(text(&request, "gen_ai.operation.name"), "chat");
    assert_eq!(text(&request, "gen_ai.provider.name"), "openai");
    assert_eq!(text(&request, "gen_ai.request.model"), "gpt-test");
    assert_eq!(text(&request, "gen_ai.response.model"), "gpt-test");
    assert_eq!(
        int(&request, "gen_ai.usage.input_tokens"),
        usage["prompt_tokens"].as_i64().unwrap()
    );
    assert_eq!(
        int(&request, "gen_ai.usage.output_tokens"),
        usage["completion_tokens"].as_i64().unwrap()
    );
    assert_eq!(text(&request, "gen_ai.conversation.id"), "trip-planning");
    assert_eq!(int(&request, "http.response.status_code"), 200);
    assert_eq!(text(&request, "server.address"), "127.0.0.1");
    assert!(int(&request, "server.port") > 0);
    assert_eq!(text(&request, "engram.memory.outcome"), "skipped");
    assert_eq!(text(&request, "engram.memory.reason"), "empty");
    assert_eq!(attribute(&request, "engram.memory.tokens_injected"), None);
    assert_eq!(attribute(&request, "error.type"), None);
    assert_eq!(request.status, Status::Unset);

    // Its steps are its children; the upstream got the upstream span's context.
    let upstream = span_where(&exporter, |span| {
        span.span_kind == SpanKind::Client && is_child_of(span, &request)
    })
    .await;
    assert_eq!(upstream.name, "POST");
    assert_eq!(int(&upstream, "http.response.status_code"), 200);
    assert!(text(&upstream, "url.full").ends_with("/v1/chat/completions"));
    let sent = received_traceparent(&reply);
    assert_eq!(sent.trace_id(), caller.trace_id());
    assert_eq!(sent.span_id(), upstream.span_context.span_id());
    for step in [
        "engram.memory.load",
        "engram.memory.compose",
        "engram.memory.record",
    ] {
        let span = span_where(&exporter, |span| span.name == step).await;
        assert!(is_child_of(&span, &request), "{step} is not a child");
    }

    // The worker applies the job in a trace of its own, linked to the request.
    let update = span_where(&exporter, |span| span.name == "engram.memory.update").await;
    assert_eq!(update.span_kind, SpanKind::Consumer);
    assert_ne!(update.span_context.trace_id(), caller.trace_id());
    assert_eq!(update.parent_span_id, SpanId::INVALID);
    let links: Vec<_> = update
        .links
        .iter()
        .map(|link| link.span_context.clone())
        .collect();
    assert_eq!(links.len(), 1, "{links:?}");
    assert_eq!(links[0].trace_id(), caller.trace_id());
    assert_eq!(links[0].span_id(), request.span_context.span_id());
    assert_eq!(int(&update, "engram.jobs"), 1);
    assert_eq!(text(&update, "gen_ai.conversation.id"), "trip-planning");

    // 2. Streamed, a new trace; memory of turn 1 is injected. Usage is read after the stream.
    let body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "Where do I live?"}],
        "stream": true,
        "stream_options": {"include_usage": true},
    });
    let reply = post_json(&chat, &body, &identity).await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.headers["x-engram-memory"], "injected");
    let text_body = String::from_utf8_lossy(&reply.body).into_owned();
    let usage = text_body
        .lines()
        .filter_map(|line| line.strip_prefix("data: "))
        .filter_map(|data| serde_json::from_str::<serde_json::Value>(data).ok())
        .find_map(|event| {
            event
                .get("usage")
                .filter(|usage| usage.is_object())
                .cloned()
        })
        .expect("no usage event");
    let sent = received_traceparent(&reply);
    let streamed = span_where(&exporter, |span| {
        span.name == "chat gpt-test" && span.span_context.trace_id() == sent.trace_id()
    })
    .await;
    assert_ne!(sent.trace_id(), caller.trace_id());
    assert_eq!(streamed.parent_span_id, SpanId::INVALID);
    assert_eq!(text(&streamed, "engram.memory.outcome"), "injected");
    assert_eq!(
        int(&streamed, "engram.memory.tokens_injected"),
        header_u64(&reply.headers, "x-engram-memory-tokens")
    );
    assert_eq!(
        int(&streamed, "engram.memory.items"),
        header_u64(&reply.headers, "x-engram-memory-items")
    );
    assert_eq!(
        int(&streamed, "gen_ai.usage.input_tokens"),
        usage["prompt_tokens"].as_i64().unwrap()
    );
    assert_eq!(
        int(&streamed, "gen_ai.usage.output_tokens"),
        usage["completion_tokens"].as_i64().unwrap()
    );
    assert_eq!(text(&streamed, "gen_ai.response.model"), "gpt-test");
    assert_eq!(text(&streamed, "gen_ai.conversation.id"), "trip-planning");
    let update = span_where(&exporter, |span| {
        span.name == "engram.memory.update"
            && span
                .links
                .iter()
                .any(|link| link.span_context.span_id() == streamed.span_context.span_id())
    })
    .await;
    assert_eq!(update.status, Status::Unset);

    // 3. An upstream error ends the span as a failed operation.
    let mut headers = identity.to_vec();
    headers.push(("x-mock-status", "429"));
    let reply = post_json(&chat, &body, &headers).await;
    assert_eq!(reply.status, 429);
    let sent = received_traceparent(&reply);
    let failed = span_where(&exporter, |span| {
        span.span_kind == SpanKind::Server && span.span_context.trace_id() == sent.trace_id()
    })
    .await;
    assert_eq!(text(&failed, "error.type"), "429");
    assert_eq!(int(&failed, "http.response.status_code"), 429);
    assert!(matches!(failed.status, Status::Error { .. }));

    // 4. A pass-through route: its own server span, and the caller's trace goes on upstream.
    let reply = send(
        "GET",
        &engram.url("/v1/models"),
        &[("traceparent", CALLER)],
        "",
    )
    .await;
    assert_eq!(reply.status, 200);
    let sent = received_traceparent(&reply);
    assert_eq!(sent.trace_id(), caller.trace_id());
    let server = span_where(&exporter, |span| {
        span.name == "GET" && span.span_kind == SpanKind::Server
    })
    .await;
    assert_eq!(server.parent_span_id, caller.span_id());
    let client = span_where(&exporter, |span| {
        span.span_kind == SpanKind::Client && is_child_of(span, &server)
    })
    .await;
    assert_eq!(client.span_context.span_id(), sent.span_id());

    assert_nothing_secret(&exporter, false);

    // Graceful shutdown flushes and stops the exporter.
    engram.shut_down().await;
    assert!(exporter.is_shutdown_called());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn content_is_recorded_only_when_enabled_and_credentials_never() {
    let (telemetry, exporter) = in_memory(&TelemetryConfig {
        capture_content: true,
        ..TelemetryConfig::default()
    });
    let engram = Running::start(|_| {}, Some(telemetry)).await;
    let auth = format!("Bearer {SECRET}");
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}]});
    let reply = post_json(
        &engram.url("/v1/chat/completions"),
        &body,
        &[("authorization", auth.as_str()), ("x-api-key", SECRET)],
    )
    .await;
    assert_eq!(reply.status, 200);
    let answer = reply.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let span = span_where(&exporter, |span| span.name == "chat gpt-test").await;
    let input: serde_json::Value =
        serde_json::from_str(&text(&span, "gen_ai.input.messages")).unwrap();
    assert_eq!(input[0]["role"], "user");
    assert_eq!(input[0]["parts"][0]["content"], PROMPT);
    let output: serde_json::Value =
        serde_json::from_str(&text(&span, "gen_ai.output.messages")).unwrap();
    assert_eq!(output[0]["parts"][0]["content"], answer.as_str());
    assert_eq!(output[0]["finish_reason"], "stop");
    // No user: no memory, no conversation id.
    assert_eq!(attribute(&span, "gen_ai.conversation.id"), None);
    assert_nothing_secret(&exporter, true);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_endpoint_nothing_is_traced_and_trace_headers_pass_through() {
    assert!(
        std::env::var_os(engram_proxy::telemetry::ENDPOINT_ENV).is_none()
            && std::env::var_os(engram_proxy::telemetry::TRACES_ENDPOINT_ENV).is_none(),
        "this test needs the OTLP endpoint variables unset"
    );
    assert!(
        !engram_ops::telemetry::from_config(&Config::default().telemetry)
            .unwrap()
            .is_enabled()
    );
    let mut engram = Running::start(|_| {}, None).await;
    let chat = engram.url("/v1/chat/completions");
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}]});

    let reply = post_json(&chat, &body, &[("x-engram-user", "bob")]).await;
    assert_eq!(reply.status, 200);
    assert!(reply.headers.get("x-mock-received-traceparent").is_none());
    // A caller's context reaches the upstream exactly as sent.
    let reply = post_json(&chat, &body, &[("traceparent", CALLER)]).await;
    assert_eq!(reply.headers["x-mock-received-traceparent"], CALLER);
    let reply = send(
        "GET",
        &engram.url("/v1/models"),
        &[("traceparent", CALLER)],
        "",
    )
    .await;
    assert_eq!(reply.headers["x-mock-received-traceparent"], CALLER);
    engram.shut_down().await;
}

/// A stand-in OTLP/HTTP collector: keeps every request's headers and body.
type Received = Arc<Mutex<Vec<(String, HeaderMap, Bytes)>>>;

async fn collector(tasks: &TaskTracker) -> (String, Received) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let address = listener.local_addr().unwrap();
    let received: Received = Arc::default();
    let sink = Arc::clone(&received);
    let connections = tasks.clone();
    tasks.spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let sink = Arc::clone(&sink);
            let service =
                hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    let sink = Arc::clone(&sink);
                    async move {
                        let (parts, body) = request.into_parts();
                        let body = body
                            .collect()
                            .await
                            .map(|body| body.to_bytes())
                            .unwrap_or_default();
                        let path = parts.uri.path().to_owned();
                        sink.lock().unwrap().push((path, parts.headers, body));
                        Ok::<_, Infallible>(Response::new(Full::new(Bytes::new())))
                    }
                });
            connections.spawn(async move {
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    (format!("http://{address}"), received)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn spans_reach_an_otlp_collector_by_shutdown() {
    let tasks = TaskTracker::new();
    let (endpoint, received) = collector(&tasks).await;
    let mut engram = Running::start(
        |config| config.telemetry.otlp_endpoint = Some(endpoint.clone()),
        None,
    )
    .await;
    let body = json!({"model": "gpt-test", "messages": [{"role": "user", "content": PROMPT}]});
    let reply = post_json(
        &engram.url("/v1/chat/completions"),
        &body,
        &[("x-engram-user", "carol"), ("traceparent", CALLER)],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        received_traceparent(&reply).trace_id(),
        TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap()
    );
    // The batch waits seconds before exporting; the graceful shutdown flushes it at once.
    engram.shut_down().await;
    let received = received.lock().unwrap().clone();
    assert!(!received.is_empty(), "nothing was exported");
    let (path, headers, _) = &received[0];
    assert_eq!(path, "/v1/traces");
    assert_eq!(headers["content-type"], "application/x-protobuf");
    let all: Vec<u8> = received
        .iter()
        .flat_map(|(_, _, body)| body.to_vec())
        .collect();
    let contains = |needle: &[u8]| all.windows(needle.len()).any(|window| window == needle);
    assert!(contains(b"chat gpt-test"));
    assert!(contains(b"gen_ai.usage.output_tokens"));
    assert!(contains(b"engram"), "the service name is missing");
    // The caller's trace id, as raw bytes in the protobuf.
    let trace_id = TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").unwrap();
    assert!(contains(&trace_id.to_bytes()));
    assert!(!contains(PROMPT.as_bytes()));
    tasks.close();
}
