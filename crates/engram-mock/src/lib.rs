//! `engram-mock`: an OpenAI-compatible upstream for tests, benchmarks and the quickstart, a
//! development tool outside the sidecar (its binary, `engram-mock`, takes the options of
//! [`MockArgs`]). Output is deterministic (fixed ids and timestamps) so a response can be compared
//! byte for byte with the same response through the proxy.
//!
//! Per-request knobs, as request headers (the proxy forwards them):
//! - `x-mock-latency-ms: N` — wait before the response headers;
//! - `x-mock-chunks: N` — content chunks of a stream;
//! - `x-mock-chunk-delay-ms: N` — delay between streamed chunks;
//! - `x-mock-status: CODE` — answer with an OpenAI-shaped error of that status (429 adds
//!   `retry-after: 1`);
//! - `x-mock-fault: reset | malformed | hang` — a stream that breaks its connection half-way,
//!   sends an event that is not JSON and no `[DONE]`, or stops sending after its first chunk.
//!
//! - `x-mock-script: parrot` — answer `You said: <the last user message>`, so each turn of a
//!   conversation gets its own answer;
//! - `x-mock-script: tool:NAME` — an agent's tool: a request whose last message is not a tool
//!   result gets a call of `NAME` (arguments `{"query": <last user message>}`, finish reason
//!   `tool_calls`, streamed as OpenAI streams tool calls); one whose last message is a tool
//!   result gets the answer `NAME says: <the result>`.
//!
//! `MockOptions::reply` (`--reply TEXT`) makes every chat completion, streamed or not, answer
//! with exactly that content (summarizer tests script a model's JSON this way).
//!
//! `MockOptions::forward` (`--forward URL`) makes it no mock at all but a bare pass-through to
//! that upstream (hyper's pooled client, `TCP_NODELAY` both ways, nothing parsed): the floor a
//! proxy's added latency is measured against on the same machine (`benches/overhead.sh`'s
//! `floor` system).
//!
//! Every response reflects the `Authorization` its request carried in
//! `x-mock-received-authorization`, so tests can see which key reached the upstream, and a
//! received W3C `traceparent` in `x-mock-received-traceparent`.

use std::convert::Infallible;
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full, Limited, channel::Channel};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

pub use cli::{LISTENING, MockArgs, MockThread};

mod cli;

/// Logs to stderr at `warn` (or `RUST_LOG`), as the binary does.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
}

/// Errors that can end a response body mid-way.
type BodyError = Box<dyn std::error::Error + Send + Sync>;

/// The body type of every response.
type ProxyBody = BoxBody<Bytes, BodyError>;

fn full_body(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

const CREATED: u64 = 1_700_000_000;
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, Clone)]
pub struct MockOptions {
    pub listen: SocketAddr,
    /// Delay before response headers.
    pub latency: Duration,
    /// Content chunks per streamed reply.
    pub chunks: usize,
    /// Characters per content chunk.
    pub chunk_size: usize,
    /// Delay between streamed chunks.
    pub chunk_delay: Duration,
    /// Reply with the received messages (as JSON text) instead of filler text.
    pub echo: bool,
    /// Append every received chat request to this JSON-lines file.
    pub record: Option<PathBuf>,
    /// Answer every chat completion with exactly this content (overrides `echo`).
    pub reply: Option<String>,
    /// Forward every request to this base URL (`http://host:port`) instead of answering it.
    pub forward: Option<String>,
}

impl Default for MockOptions {
    fn default() -> Self {
        MockOptions {
            listen: SocketAddr::from(([127, 0, 0, 1], 0)),
            latency: Duration::ZERO,
            chunks: 8,
            chunk_size: 16,
            chunk_delay: Duration::ZERO,
            echo: false,
            record: None,
            reply: None,
            forward: None,
        }
    }
}

struct Mock {
    options: MockOptions,
    record: Option<Mutex<std::fs::File>>,
    tasks: TaskTracker,
    forward: Option<Forward>,
}

/// A bare pass-through: the request as received, to the same path on another server.
struct Forward {
    /// Scheme and authority, e.g. `http://127.0.0.1:8080`.
    base: String,
    client: Client<HttpConnector, Incoming>,
}

impl Forward {
    fn new(base: &str) -> Forward {
        let mut connector = HttpConnector::new();
        // Without it, a pass-through showed a p99 of 8 ms at 1,000 req/s (DESIGN.md §8a).
        connector.set_nodelay(true);
        Forward {
            base: base.trim_end_matches('/').to_owned(),
            client: Client::builder(TokioExecutor::new()).build(connector),
        }
    }

    async fn send(&self, request: Request<Incoming>) -> Response<ProxyBody> {
        let (mut parts, body) = request.into_parts();
        let path = parts
            .uri
            .path_and_query()
            .map_or("/", http::uri::PathAndQuery::as_str);
        parts.uri = match format!("{}{path}", self.base).parse() {
            Ok(uri) => uri,
            Err(error) => return error_response(StatusCode::BAD_GATEWAY, &error.to_string()),
        };
        parts.headers.remove(header::HOST);
        match self.client.request(Request::from_parts(parts, body)).await {
            Ok(response) => response.map(|body| body.map_err(BodyError::from).boxed()),
            Err(error) => error_response(StatusCode::BAD_GATEWAY, &error.to_string()),
        }
    }
}

pub struct MockServer {
    listener: TcpListener,
    mock: Arc<Mock>,
}

impl MockServer {
    pub async fn bind(options: MockOptions) -> std::io::Result<MockServer> {
        let listener = TcpListener::bind(options.listen).await?;
        let record = match &options.record {
            Some(path) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(path)?,
            )),
            None => None,
        };
        let forward = options.forward.as_deref().map(Forward::new);
        Ok(MockServer {
            listener,
            mock: Arc::new(Mock {
                options,
                record,
                tasks: TaskTracker::new(),
                forward,
            }),
        })
    }

    pub fn local_addr(&self) -> std::io::Result<SocketAddr> {
        self.listener.local_addr()
    }

    pub async fn run(self) -> std::io::Result<()> {
        let connections = auto::Builder::new(TokioExecutor::new());
        loop {
            let (stream, _) = match self.listener.accept().await {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "mock accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let _ = stream.set_nodelay(true);
            let mock = self.mock.clone();
            let service = service_fn(move |request| {
                let mock = mock.clone();
                async move { Ok::<_, Infallible>(mock.route(request).await) }
            });
            let connection = connections
                .serve_connection(TokioIo::new(stream), service)
                .into_owned();
            self.mock.tasks.spawn(async move {
                let _ = connection.await;
            });
        }
    }
}

impl Mock {
    async fn route(&self, request: Request<Incoming>) -> Response<ProxyBody> {
        if let Some(forward) = &self.forward {
            return forward.send(request).await;
        }
        let reflected = [
            ("traceparent", "x-mock-received-traceparent"),
            ("authorization", "x-mock-received-authorization"),
        ]
        .map(|(name, reflection)| (reflection, request.headers().get(name).cloned()));
        let mut response = self.respond(request).await;
        for (reflection, value) in reflected {
            if let Some(value) = value {
                response.headers_mut().insert(reflection, value);
            }
        }
        response
    }

    async fn respond(&self, request: Request<Incoming>) -> Response<ProxyBody> {
        let knobs = Knobs::from_headers(request.headers(), &self.options);
        if !knobs.latency.is_zero() {
            tokio::time::sleep(knobs.latency).await;
        }
        if let Some(status) = knobs.status {
            return error_response(status, "mock error requested by x-mock-status");
        }
        let path = request.uri().path().to_owned();
        match (request.method().clone(), path.as_str()) {
            (Method::POST, "/v1/chat/completions") => self.chat_response(request, knobs).await,
            (Method::GET, "/v1/models") => json_response(
                StatusCode::OK,
                json!({"object": "list", "data": [
                    {"id": "mock-model", "object": "model", "created": CREATED, "owned_by": "engram"}
                ]}),
            ),
            // Streams any body straight back, for pass-through tests.
            (_, "/v1/echo") => {
                let content_type = request.headers().get(header::CONTENT_TYPE).cloned();
                let mut response =
                    Response::new(request.into_body().map_err(BodyError::from).boxed());
                if let Some(content_type) = content_type {
                    response
                        .headers_mut()
                        .insert(header::CONTENT_TYPE, content_type);
                }
                response
            }
            _ => error_response(StatusCode::NOT_FOUND, &format!("no mock route for {path}")),
        }
    }

    async fn chat_response(&self, request: Request<Incoming>, knobs: Knobs) -> Response<ProxyBody> {
        let body = match Limited::new(request.into_body(), MAX_REQUEST_BYTES)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(error) => return error_response(StatusCode::BAD_REQUEST, &error.to_string()),
        };
        let parsed: Value = match serde_json::from_slice(&body) {
            Ok(value) => value,
            Err(error) => return error_response(StatusCode::BAD_REQUEST, &error.to_string()),
        };
        if let Some(record) = &self.record
            && let Ok(mut file) = record.lock()
        {
            let mut line = serde_json::to_vec(&parsed).unwrap_or_default();
            line.push(b'\n');
            // One write per line keeps lines whole when several requests record at once.
            let _ = file.write_all(&line);
        }
        let model = parsed
            .get("model")
            .and_then(Value::as_str)
            .unwrap_or("mock-model")
            .to_owned();
        let messages = parsed.get("messages").cloned().unwrap_or(Value::Null);
        let (content, tool_call) = if let Some(script) = &knobs.script {
            script.answer(&messages)
        } else if let Some(reply) = &self.options.reply {
            (reply.clone(), None)
        } else if self.options.echo {
            (messages.to_string(), None)
        } else {
            (filler(knobs.chunks * self.options.chunk_size), None)
        };
        let prompt_tokens = (messages.to_string().len() / 4) as u64;
        let reply = Reply {
            model,
            content,
            prompt_tokens,
            chunks: knobs.chunks.max(1),
            tool_call,
        };
        let stream = parsed.get("stream").and_then(Value::as_bool) == Some(true);
        if !stream {
            return json_response(StatusCode::OK, reply.completion());
        }
        let include_usage = parsed
            .pointer("/stream_options/include_usage")
            .and_then(Value::as_bool)
            == Some(true);
        self.stream(reply, include_usage, &knobs)
    }

    fn stream(&self, reply: Reply, include_usage: bool, knobs: &Knobs) -> Response<ProxyBody> {
        let (mut sender, body) = Channel::<Bytes, BodyError>::new(4);
        let delay = knobs.chunk_delay;
        let fault = knobs.fault;
        self.tasks.spawn(async move {
            let events = reply.events(include_usage);
            let cut = events.len() / 2;
            for (index, event) in events.into_iter().enumerate() {
                match fault {
                    Some(Fault::Reset) if index == cut => {
                        sender.abort("mock reset".into());
                        return;
                    }
                    Some(Fault::Hang) if index == 1 => {
                        // Hold the connection open without sending until the peer gives up.
                        sender.send_data(Bytes::new()).await.ok();
                        tokio::time::sleep(Duration::from_secs(3600)).await;
                        return;
                    }
                    Some(Fault::Malformed) if index == cut => {
                        let _ = sender
                            .send_data(Bytes::from_static(b"data: {not json\n\n"))
                            .await;
                        return;
                    }
                    _ => {}
                }
                if index > 0 && !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                if sender.send(Frame::data(event)).await.is_err() {
                    return;
                }
            }
        });
        let mut response = Response::new(body.boxed());
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        response
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    Reset,
    Malformed,
    Hang,
}

struct Knobs {
    latency: Duration,
    chunks: usize,
    chunk_delay: Duration,
    status: Option<StatusCode>,
    fault: Option<Fault>,
    script: Option<Script>,
}

enum Script {
    Parrot,
    Tool(String),
}

impl Knobs {
    fn from_headers(headers: &HeaderMap, options: &MockOptions) -> Knobs {
        let number = |name: &str| {
            headers
                .get(name)
                .and_then(|value| value.to_str().ok())
                .and_then(|value| value.parse::<u64>().ok())
        };
        Knobs {
            latency: number("x-mock-latency-ms").map_or(options.latency, Duration::from_millis),
            chunks: number("x-mock-chunks").map_or(options.chunks, |n| n.min(100_000) as usize),
            chunk_delay: number("x-mock-chunk-delay-ms")
                .map_or(options.chunk_delay, Duration::from_millis),
            status: number("x-mock-status")
                .and_then(|code| u16::try_from(code).ok())
                .and_then(|code| StatusCode::from_u16(code).ok()),
            fault: match headers.get("x-mock-fault").map(HeaderValue::as_bytes) {
                Some(b"reset") => Some(Fault::Reset),
                Some(b"malformed") => Some(Fault::Malformed),
                Some(b"hang") => Some(Fault::Hang),
                _ => None,
            },
            script: match headers.get("x-mock-script").and_then(|v| v.to_str().ok()) {
                Some("parrot") => Some(Script::Parrot),
                Some(script) => script
                    .strip_prefix("tool:")
                    .map(|name| Script::Tool(name.to_owned())),
                None => None,
            },
        }
    }
}

struct Reply {
    model: String,
    content: String,
    prompt_tokens: u64,
    chunks: usize,
    /// A tool call instead of content: `(id, name, arguments)`.
    tool_call: Option<(String, String, String)>,
}

/// The text of a message's `content` (a string, or the texts of its parts).
fn content_text(message: &Value) -> String {
    match message.get("content") {
        Some(Value::String(text)) => text.clone(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|part| part.get("text").and_then(Value::as_str))
            .collect::<Vec<_>>()
            .join("\n"),
        _ => String::new(),
    }
}

impl Script {
    /// The scripted answer to `messages`: content, or a tool call.
    fn answer(&self, messages: &Value) -> (String, Option<(String, String, String)>) {
        let messages = messages.as_array().map(Vec::as_slice).unwrap_or_default();
        let last_user = messages
            .iter()
            .rev()
            .find(|message| message.get("role").and_then(Value::as_str) == Some("user"))
            .map(content_text)
            .unwrap_or_default();
        match self {
            Script::Parrot => (format!("You said: {last_user}"), None),
            Script::Tool(name) => match messages.last() {
                Some(last) if last.get("role").and_then(Value::as_str) == Some("tool") => {
                    (format!("{name} says: {}", content_text(last)), None)
                }
                _ => {
                    let id = format!("call_{}", messages.len());
                    let arguments = json!({ "query": last_user }).to_string();
                    (String::new(), Some((id, name.clone(), arguments)))
                }
            },
        }
    }
}

impl Reply {
    fn usage(&self) -> Value {
        let completion_tokens = self.chunks as u64;
        json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        })
    }

    fn message(&self) -> Value {
        match &self.tool_call {
            Some((id, name, arguments)) => json!({
                "role": "assistant", "content": null, "refusal": null,
                "tool_calls": [{"id": id, "type": "function",
                                "function": {"name": name, "arguments": arguments}}],
            }),
            None => json!({"role": "assistant", "content": self.content, "refusal": null}),
        }
    }

    fn finish_reason(&self) -> &'static str {
        if self.tool_call.is_some() {
            "tool_calls"
        } else {
            "stop"
        }
    }

    fn completion(&self) -> Value {
        json!({
            "id": "chatcmpl-mock",
            "object": "chat.completion",
            "created": CREATED,
            "model": self.model,
            "choices": [{
                "index": 0,
                "message": self.message(),
                "logprobs": null,
                "finish_reason": self.finish_reason(),
            }],
            "usage": self.usage(),
            "system_fingerprint": null,
        })
    }

    /// The SSE events of a streamed reply, as OpenAI sends them.
    fn events(&self, include_usage: bool) -> Vec<Bytes> {
        let chunk = |delta: Value, finish_reason: Value| {
            let mut value = json!({
                "id": "chatcmpl-mock",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": self.model,
                "system_fingerprint": null,
                "choices": [{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}],
            });
            if include_usage && let Some(object) = value.as_object_mut() {
                object.insert("usage".into(), Value::Null);
            }
            event(&value)
        };
        let mut events = Vec::new();
        match &self.tool_call {
            Some((id, name, arguments)) => {
                events.push(chunk(
                    json!({"role": "assistant", "content": null, "tool_calls": [{
                        "index": 0, "id": id, "type": "function",
                        "function": {"name": name, "arguments": ""}}]}),
                    Value::Null,
                ));
                for piece in split_chars(arguments, self.chunks) {
                    events.push(chunk(
                        json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
                        Value::Null,
                    ));
                }
            }
            None => {
                events.push(chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                ));
                for piece in split_chars(&self.content, self.chunks) {
                    events.push(chunk(json!({"content": piece}), Value::Null));
                }
            }
        }
        events.push(chunk(json!({}), json!(self.finish_reason())));
        if include_usage {
            events.push(event(&json!({
                "id": "chatcmpl-mock",
                "object": "chat.completion.chunk",
                "created": CREATED,
                "model": self.model,
                "system_fingerprint": null,
                "choices": [],
                "usage": self.usage(),
            })));
        }
        events.push(Bytes::from_static(b"data: [DONE]\n\n"));
        events
    }
}

fn event(value: &Value) -> Bytes {
    Bytes::from(format!("data: {value}\n\n"))
}

/// Splits text into `parts` pieces of about equal length, on character boundaries.
fn split_chars(text: &str, parts: usize) -> Vec<String> {
    let chars: Vec<char> = text.chars().collect();
    let size = chars.len().div_ceil(parts.max(1)).max(1);
    chars
        .chunks(size)
        .map(|piece| piece.iter().collect())
        .collect()
}

fn filler(len: usize) -> String {
    const WORDS: &str = "the quick brown fox jumps over the lazy dog ";
    WORDS.chars().cycle().take(len).collect()
}

fn json_response(status: StatusCode, value: Value) -> Response<ProxyBody> {
    let body = serde_json::to_vec(&value).unwrap_or_default();
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    response
}

fn error_response(status: StatusCode, message: &str) -> Response<ProxyBody> {
    let mut response = json_response(
        status,
        json!({"error": {"message": message, "type": "mock_error", "param": null, "code": status.as_u16().to_string()}}),
    );
    if status == StatusCode::TOO_MANY_REQUESTS {
        response
            .headers_mut()
            .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_memory::openai::StreamAccumulator;

    fn reply(content: &str, chunks: usize) -> Reply {
        Reply {
            model: "m".into(),
            content: content.into(),
            prompt_tokens: 3,
            chunks,
            tool_call: None,
        }
    }

    #[test]
    fn streamed_events_rebuild_the_reply() {
        let reply = reply("héllo wörld, this is a reply", 5);
        let mut accumulator = StreamAccumulator::default();
        for event in reply.events(true) {
            accumulator.push(&event);
        }
        let summary = accumulator.finish();
        assert!(summary.saw_done);
        assert_eq!(summary.message.content, "héllo wörld, this is a reply");
        assert_eq!(summary.message.usage.unwrap().completion_tokens, 5);
    }

    #[test]
    fn the_tool_script_calls_then_answers_from_the_result() {
        let script = Script::Tool("lookup".into());
        let asked = json!([{"role": "user", "content": "capital of Peru?"}]);
        let (_, call) = script.answer(&asked);
        let (id, name, arguments) = call.clone().unwrap();
        assert_eq!((id.as_str(), name.as_str()), ("call_1", "lookup"));
        assert_eq!(arguments, r#"{"query":"capital of Peru?"}"#);
        // Streamed, the call rebuilds as the proxy's accumulator reads it.
        let mut calling = reply("", 3);
        calling.tool_call = call;
        let mut accumulator = StreamAccumulator::default();
        for event in calling.events(false) {
            accumulator.push(&event);
        }
        let message = accumulator.finish().message;
        assert_eq!(message.finish_reason.as_deref(), Some("tool_calls"));
        assert_eq!(message.tool_calls[0].name, "lookup");
        assert_eq!(message.tool_calls[0].arguments, arguments);

        let answered = json!([
            {"role": "user", "content": "capital of Peru?"},
            {"role": "assistant", "content": null, "tool_calls": []},
            {"role": "tool", "tool_call_id": "call_1", "content": "Lima"}
        ]);
        assert_eq!(
            script.answer(&answered),
            ("lookup says: Lima".to_owned(), None)
        );
    }

    #[test]
    fn usage_null_appears_only_when_asked() {
        let reply = reply("abc", 2);
        let with: Vec<Bytes> = reply.events(true);
        let without: Vec<Bytes> = reply.events(false);
        assert!(
            with.iter()
                .all(|e| e.ends_with(b"[DONE]\n\n")
                    || memchr::memmem::find(e, b"\"usage\"").is_some())
        );
        assert!(
            without
                .iter()
                .all(|e| memchr::memmem::find(e, b"usage").is_none())
        );
        assert_eq!(with.len(), without.len() + 1);
    }

    /// `(status, reflected authorization, body)` of a chat completion posted to `address`.
    async fn post_chat(address: SocketAddr) -> (StatusCode, Option<HeaderValue>, Bytes) {
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build(HttpConnector::new());
        let request = Request::post(format!("http://{address}/v1/chat/completions"))
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::AUTHORIZATION, "Bearer sk-forwarded")
            .body(Full::new(Bytes::from_static(
                br#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            )))
            .unwrap();
        let response = client.request(request).await.unwrap();
        let status = response.status();
        let reflected = response
            .headers()
            .get("x-mock-received-authorization")
            .cloned();
        let body = response.into_body().collect().await.unwrap().to_bytes();
        (status, reflected, body)
    }

    #[tokio::test]
    async fn forward_passes_requests_and_answers_through_untouched() {
        use clap::Parser as _;
        let upstream = MockArgs::parse_from(["engram-mock", "--reply", "from upstream"])
            .start_thread()
            .unwrap();
        let upstream_url = format!("http://{}", upstream.local_addr());
        let forward = MockArgs::parse_from(["engram-mock", "--forward", upstream_url.as_str()])
            .start_thread()
            .unwrap();
        let direct = post_chat(upstream.local_addr()).await;
        let through = post_chat(forward.local_addr()).await;
        assert_eq!(direct.0, StatusCode::OK);
        assert!(memchr::memmem::find(&through.2, b"from upstream").is_some());
        // The mock's answers are deterministic: the same bytes, and the same key reached it.
        assert_eq!(through, direct);
        assert_eq!(
            through.1,
            Some(HeaderValue::from_static("Bearer sk-forwarded"))
        );

        // With nothing behind it: an OpenAI-shaped 502, not a hang or a dropped connection.
        let dead = format!("http://{}", upstream.local_addr());
        drop(upstream);
        let orphan = MockArgs::parse_from(["engram-mock", "--forward", dead.as_str()])
            .start_thread()
            .unwrap();
        let (status, _, body) = post_chat(orphan.local_addr()).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY);
        let error: Value = serde_json::from_slice(&body).unwrap();
        assert!(error["error"]["message"].is_string(), "{error}");
    }

    #[test]
    fn split_keeps_every_character() {
        for parts in 1..10 {
            assert_eq!(split_chars("abcdéfgh", parts).concat(), "abcdéfgh");
        }
    }
}
