//! The scripted upstream of the replay: an OpenAI-compatible chat endpoint that answers each
//! request with the reply the harness scripted for it and records the prompt it received.
//!
//! The harness names the script entry in the `x-eval-exchange` request header, which the proxy
//! forwards (it drops only hop-by-hop and `x-engram-*` headers). Replies are answered whole
//! (not streamed).

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http::{Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, Limited};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::task::TaskTracker;

use engram::error::{Error, Result};
use engram_memory::openai::ChatMessage;

/// The header naming the script entry of a request.
pub const EXCHANGE_HEADER: &str = "x-eval-exchange";
const MAX_REQUEST_BYTES: usize = 64 * 1024 * 1024;

#[derive(Default)]
struct Script {
    replies: Mutex<HashMap<String, String>>,
    prompts: Mutex<HashMap<String, Vec<ChatMessage>>>,
    requests: AtomicU64,
    unscripted: AtomicU64,
}

/// A running scripted upstream; stops when dropped.
pub struct ScriptedUpstream {
    address: SocketAddr,
    script: Arc<Script>,
    task: JoinHandle<()>,
}

impl ScriptedUpstream {
    pub async fn start(listen: SocketAddr) -> Result<ScriptedUpstream> {
        let listener = TcpListener::bind(listen).await?;
        let address = listener.local_addr()?;
        let script = Arc::new(Script::default());
        let serving = Arc::clone(&script);
        let tracker = TaskTracker::new();
        let connections_tracker = tracker.clone();
        let task = tracker.spawn(async move {
            let connections = auto::Builder::new(TokioExecutor::new());
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let _ = stream.set_nodelay(true);
                let script = Arc::clone(&serving);
                let service = service_fn(move |request| {
                    let script = Arc::clone(&script);
                    async move { Ok::<_, Infallible>(script.answer(request).await) }
                });
                let connection = connections
                    .serve_connection(TokioIo::new(stream), service)
                    .into_owned();
                connections_tracker.spawn(async move {
                    let _ = connection.await;
                });
            }
        });
        Ok(ScriptedUpstream {
            address,
            script,
            task,
        })
    }

    /// The base URL to configure as the proxy's upstream.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.address)
    }

    /// The reply the request named `key` gets.
    pub fn script(&self, key: &str, reply: &str) {
        lock(&self.script.replies).insert(key.to_owned(), reply.to_owned());
    }

    /// The prompt the request named `key` arrived with (taken: asked once).
    pub fn take_prompt(&self, key: &str) -> Option<Vec<ChatMessage>> {
        lock(&self.script.replies).remove(key);
        lock(&self.script.prompts).remove(key)
    }

    /// Chat requests received, and how many named no script entry.
    pub fn counts(&self) -> (u64, u64) {
        (
            self.script.requests.load(Ordering::Relaxed),
            self.script.unscripted.load(Ordering::Relaxed),
        )
    }
}

impl Drop for ScriptedUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn respond(status: StatusCode, body: &Value) -> Response<Full<Bytes>> {
    let mut response = Response::new(Full::new(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

fn error(status: StatusCode, message: &str) -> Response<Full<Bytes>> {
    let body = Error::invalid_request(message, None).to_json();
    let mut response = Response::new(Full::new(Bytes::from(body)));
    *response.status_mut() = status;
    response
}

impl Script {
    async fn answer(&self, request: Request<Incoming>) -> Response<Full<Bytes>> {
        if request.method() != Method::POST || request.uri().path() != "/v1/chat/completions" {
            return error(StatusCode::NOT_FOUND, "the scripted upstream only chats");
        }
        self.requests.fetch_add(1, Ordering::Relaxed);
        let key = request
            .headers()
            .get(EXCHANGE_HEADER)
            .and_then(|value| value.to_str().ok())
            .map(str::to_owned);
        let body = match Limited::new(request.into_body(), MAX_REQUEST_BYTES)
            .collect()
            .await
        {
            Ok(collected) => collected.to_bytes(),
            Err(problem) => return error(StatusCode::BAD_REQUEST, &problem.to_string()),
        };
        let parsed: engram_memory::openai::ChatRequest = match serde_json::from_slice(&body) {
            Ok(parsed) => parsed,
            Err(problem) => return error(StatusCode::BAD_REQUEST, &problem.to_string()),
        };
        let reply = key
            .as_ref()
            .and_then(|key| lock(&self.replies).get(key).cloned());
        let Some(key) = key.filter(|_| reply.is_some()) else {
            self.unscripted.fetch_add(1, Ordering::Relaxed);
            return error(
                StatusCode::BAD_REQUEST,
                "no scripted reply for this request",
            );
        };
        let model = parsed.model.clone();
        lock(&self.prompts).insert(key, parsed.messages);
        respond(
            StatusCode::OK,
            &json!({
                "id": "chatcmpl-eval",
                "object": "chat.completion",
                "created": 1_700_000_000u64,
                "model": model,
                "choices": [{
                    "index": 0,
                    "message": {"role": "assistant", "content": reply.unwrap_or_default()},
                    "finish_reason": "stop"
                }],
                "usage": {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
            }),
        )
    }
}
