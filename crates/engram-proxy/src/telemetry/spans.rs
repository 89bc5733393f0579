//! The spans of a request: `chat {model}` (or `{METHOD}` for a pass-through route) around the
//! whole exchange, and its upstream call; and [`SpanGuard`], one span of a smaller step.

use std::borrow::Cow;
use std::sync::Arc;

use http::{Method, Request, StatusCode};
use opentelemetry::trace::{Span as _, SpanKind, Status, TraceContextExt, Tracer as _};
use opentelemetry::{Array, Context, KeyValue, StringValue, Value};
use opentelemetry_sdk::trace::Span;
use serde_json::json;

use super::{Telemetry, Tracing, propagation};
use crate::error::Error;
use engram_memory::openai::{AssistantMessage, ChatRequest};

/// Attribute names: the OpenTelemetry semantic conventions' (GenAI, HTTP, error) and engram's.
pub mod attributes {
    pub const OPERATION_NAME: &str = "gen_ai.operation.name";
    pub const PROVIDER_NAME: &str = "gen_ai.provider.name";
    pub const REQUEST_MODEL: &str = "gen_ai.request.model";
    pub const REQUEST_MAX_TOKENS: &str = "gen_ai.request.max_tokens";
    pub const REQUEST_TEMPERATURE: &str = "gen_ai.request.temperature";
    pub const REQUEST_TOP_P: &str = "gen_ai.request.top_p";
    pub const RESPONSE_MODEL: &str = "gen_ai.response.model";
    pub const RESPONSE_FINISH_REASONS: &str = "gen_ai.response.finish_reasons";
    pub const INPUT_TOKENS: &str = "gen_ai.usage.input_tokens";
    pub const OUTPUT_TOKENS: &str = "gen_ai.usage.output_tokens";
    pub const CONVERSATION_ID: &str = "gen_ai.conversation.id";
    pub const INPUT_MESSAGES: &str = "gen_ai.input.messages";
    pub const OUTPUT_MESSAGES: &str = "gen_ai.output.messages";
    pub const SERVER_ADDRESS: &str = "server.address";
    pub const SERVER_PORT: &str = "server.port";
    pub const HTTP_METHOD: &str = "http.request.method";
    pub const HTTP_STATUS: &str = "http.response.status_code";
    pub const URL_PATH: &str = "url.path";
    pub const URL_FULL: &str = "url.full";
    pub const ERROR_TYPE: &str = "error.type";
    pub const MEMORY_OUTCOME: &str = "engram.memory.outcome";
    pub const MEMORY_TOKENS_INJECTED: &str = "engram.memory.tokens_injected";
    pub const MEMORY_ITEMS: &str = "engram.memory.items";
    pub const MEMORY_REASON: &str = "engram.memory.reason";
    /// Why the recorder's copy of the answer is not whole (`client_disconnected`, ...).
    pub const CAPTURE_INCOMPLETE: &str = "engram.capture.incomplete";
    /// Jobs applied together by one `engram.memory.update` span.
    pub const JOBS: &str = "engram.jobs";
    pub const JOBS_DUPLICATE: &str = "engram.jobs.duplicate";
}

use attributes as attr;

pub const MEMORY_UPDATE: &str = "engram.memory.update";
const CHAT: &str = "chat";
const CHAT_PATH: &str = "/v1/chat/completions";

/// What the memory phase did, as the request's span records it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemorySpan {
    pub outcome: &'static str,
    /// Tokens and items injected, when memory was.
    pub injected: Option<(u32, u32)>,
    pub reason: Option<&'static str>,
}

/// The spans of one proxied request; empty (every call a no-op) when tracing is off.
#[derive(Default)]
pub struct RequestTrace {
    inner: Option<Box<Traced>>,
}

struct Traced {
    tracing: Arc<Tracing>,
    /// The request span, as the context its children start from.
    cx: Context,
    upstream: Option<Span>,
    /// A chat span, where any answer but a 2xx is a failed operation; an HTTP server span
    /// fails on 5xx only.
    chat: bool,
}

impl Telemetry {
    /// Starts the `chat` span of a chat completion, in the caller's trace when its headers
    /// carry one. Its kind is `SERVER`: it is the span of the request engram serves, from
    /// arrival to the last byte of the answer; the `CLIENT` span is its upstream call.
    pub fn chat_request(&self, headers: &http::HeaderMap) -> RequestTrace {
        let Some(tracing) = &self.inner else {
            return RequestTrace::default();
        };
        let attributes = vec![
            KeyValue::new(attr::OPERATION_NAME, CHAT),
            KeyValue::new(attr::PROVIDER_NAME, tracing.provider_name.clone()),
            KeyValue::new(attr::HTTP_METHOD, "POST"),
            KeyValue::new(attr::URL_PATH, CHAT_PATH),
        ];
        RequestTrace::start(tracing, headers, CHAT, attributes, true)
    }

    /// Starts the span of a pass-through request, named by its method as HTTP server spans
    /// are when no route template applies.
    pub fn http_request(
        &self,
        method: &Method,
        path: &str,
        headers: &http::HeaderMap,
    ) -> RequestTrace {
        let Some(tracing) = &self.inner else {
            return RequestTrace::default();
        };
        let method = method_name(method);
        let attributes = vec![
            KeyValue::new(attr::HTTP_METHOD, method),
            KeyValue::new(attr::URL_PATH, path.to_owned()),
        ];
        RequestTrace::start(tracing, headers, method, attributes, false)
    }
}

impl RequestTrace {
    fn start(
        tracing: &Arc<Tracing>,
        headers: &http::HeaderMap,
        name: &'static str,
        attributes: Vec<KeyValue>,
        chat: bool,
    ) -> RequestTrace {
        let parent = propagation::extract(headers);
        let span = tracing
            .tracer
            .span_builder(name)
            .with_kind(SpanKind::Server)
            .with_attributes(attributes)
            .start_with_context(&tracing.tracer, &parent);
        RequestTrace {
            inner: Some(Box::new(Traced {
                tracing: Arc::clone(tracing),
                cx: parent.with_span(span),
                upstream: None,
                chat,
            })),
        }
    }

    /// The context to run the request's work in, so its steps' spans become children.
    pub fn context(&self) -> Option<Context> {
        self.inner.as_ref().map(|traced| traced.cx.clone())
    }

    /// Moves the spans out (to the task that sees the end of the answer).
    pub fn take(&mut self) -> RequestTrace {
        std::mem::take(self)
    }

    /// Names the span after the requested model and records the request's settings.
    pub fn chat(&self, request: &ChatRequest) {
        let Some(traced) = self.recording() else {
            return;
        };
        let span = traced.cx.span();
        span.update_name(format!("{CHAT} {}", request.model));
        span.set_attribute(KeyValue::new(attr::REQUEST_MODEL, request.model.clone()));
        let number = |key: &str| request.extra.get(key).and_then(serde_json::Value::as_f64);
        for (name, key) in [
            (attr::REQUEST_TEMPERATURE, "temperature"),
            (attr::REQUEST_TOP_P, "top_p"),
        ] {
            if let Some(value) = number(key) {
                span.set_attribute(KeyValue::new(name, value));
            }
        }
        let max_tokens = ["max_completion_tokens", "max_tokens"]
            .iter()
            .find_map(|key| request.extra.get(*key).and_then(serde_json::Value::as_i64));
        if let Some(max_tokens) = max_tokens {
            span.set_attribute(KeyValue::new(attr::REQUEST_MAX_TOKENS, max_tokens));
        }
        if traced.tracing.capture_content {
            let messages: Vec<serde_json::Value> = request
                .messages
                .iter()
                .map(|message| {
                    json!({"role": message.role, "parts": [{"type": "text", "content": message.text()}]})
                })
                .collect();
            span.set_attribute(KeyValue::new(
                attr::INPUT_MESSAGES,
                serde_json::Value::Array(messages).to_string(),
            ));
        }
    }

    /// What the memory phase did.
    pub fn memory(&self, memory: MemorySpan) {
        let Some(traced) = self.recording() else {
            return;
        };
        let span = traced.cx.span();
        span.set_attribute(KeyValue::new(attr::MEMORY_OUTCOME, memory.outcome));
        if let Some((tokens, items)) = memory.injected {
            span.set_attribute(KeyValue::new(
                attr::MEMORY_TOKENS_INJECTED,
                i64::from(tokens),
            ));
            span.set_attribute(KeyValue::new(attr::MEMORY_ITEMS, i64::from(items)));
        }
        if let Some(reason) = memory.reason {
            span.set_attribute(KeyValue::new(attr::MEMORY_REASON, reason));
        }
    }

    /// Starts the `CLIENT` span of the upstream call and puts its context in the request's
    /// `traceparent`/`tracestate`, replacing the client's. Without tracing, the client's
    /// headers go up untouched.
    pub fn start_upstream<B>(&mut self, request: &mut Request<B>) {
        let Some(traced) = self.inner.as_deref_mut() else {
            return;
        };
        let tracer = &traced.tracing.tracer;
        let method = method_name(request.method());
        let mut builder = tracer.span_builder(method).with_kind(SpanKind::Client);
        let parent = traced.cx.span();
        if parent.is_recording() {
            let uri = request.uri();
            let address = KeyValue::new(
                attr::SERVER_ADDRESS,
                uri.host().unwrap_or_default().to_owned(),
            );
            let port = KeyValue::new(
                attr::SERVER_PORT,
                uri.port_u16().map_or_else(
                    || {
                        if uri.scheme_str() == Some("http") {
                            80
                        } else {
                            443
                        }
                    },
                    i64::from,
                ),
            );
            // The GenAI server behind engram, on the chat span too.
            if traced.chat {
                parent.set_attribute(address.clone());
                parent.set_attribute(port.clone());
            }
            // Scheme, host and path only: a query string may carry a key.
            let url = format!(
                "{}://{}{}",
                uri.scheme_str().unwrap_or("http"),
                uri.authority().map_or("", |authority| authority.as_str()),
                uri.path()
            );
            builder = builder.with_attributes(vec![
                KeyValue::new(attr::HTTP_METHOD, method),
                address,
                port,
                KeyValue::new(attr::URL_FULL, url),
            ]);
        }
        let span = builder.start_with_context(tracer, &traced.cx);
        let upstream_cx = Context::new().with_remote_span_context(span.span_context().clone());
        propagation::inject(&upstream_cx, request.headers_mut());
        traced.upstream = Some(span);
    }

    /// The upstream's response headers arrived with `status`, which engram passes on.
    pub fn upstream_answered(&mut self, status: StatusCode) {
        let Some(traced) = self.inner.as_deref_mut() else {
            return;
        };
        let code = KeyValue::new(attr::HTTP_STATUS, i64::from(status.as_u16()));
        let request = traced.cx.span();
        if request.is_recording() {
            request.set_attribute(code.clone());
        }
        let Some(span) = traced.upstream.as_mut().filter(|span| span.is_recording()) else {
            return;
        };
        span.set_attribute(code);
        if status.is_client_error() || status.is_server_error() {
            fail(span, status_type(status));
        }
    }

    /// Ends the spans of a request answered with `status` and a body that is passed on as is
    /// (an upstream error, a pass-through route).
    pub fn answered(mut self, status: StatusCode) {
        let Some(mut traced) = self.inner.take() else {
            return;
        };
        if let Some(mut upstream) = traced.upstream.take() {
            upstream.end();
        }
        let span = traced.cx.span();
        if span.is_recording() {
            span.set_attribute(KeyValue::new(attr::HTTP_STATUS, i64::from(status.as_u16())));
            let failed = if traced.chat {
                !status.is_success()
            } else {
                status.is_server_error()
            };
            if failed {
                let error_type = status_type(status);
                span.set_attribute(KeyValue::new(attr::ERROR_TYPE, error_type.clone()));
                span.set_status(Status::error(error_type));
            }
        }
        span.end();
    }

    /// Ends the spans of a chat answer once its body is done, with what the recorder read from
    /// it: response model, usage, finish reason, and why it is incomplete (the recorder's
    /// snake_case name; `upstream_failed` fails the spans).
    pub fn finish(mut self, message: &AssistantMessage, incomplete: Option<&'static str>) {
        let Some(mut traced) = self.inner.take() else {
            return;
        };
        let failed = (incomplete == Some("upstream_failed")).then_some("upstream_stream_failed");
        if let Some(mut upstream) = traced.upstream.take() {
            if let Some(error_type) = failed {
                fail(&mut upstream, error_type);
            }
            upstream.end();
        }
        let span = traced.cx.span();
        if span.is_recording() {
            if let Some(model) = &message.model {
                span.set_attribute(KeyValue::new(attr::RESPONSE_MODEL, model.clone()));
            }
            if let Some(usage) = message.usage {
                span.set_attribute(KeyValue::new(
                    attr::INPUT_TOKENS,
                    saturating(usage.prompt_tokens),
                ));
                span.set_attribute(KeyValue::new(
                    attr::OUTPUT_TOKENS,
                    saturating(usage.completion_tokens),
                ));
            }
            if let Some(reason) = &message.finish_reason {
                let reasons: Vec<StringValue> = vec![reason.clone().into()];
                span.set_attribute(KeyValue::new(
                    attr::RESPONSE_FINISH_REASONS,
                    Value::Array(Array::String(reasons)),
                ));
            }
            if let Some(incomplete) = incomplete {
                span.set_attribute(KeyValue::new(attr::CAPTURE_INCOMPLETE, incomplete));
            }
            if traced.tracing.capture_content {
                let output = json!([{
                    "role": "assistant",
                    "parts": [{"type": "text", "content": message.content}],
                    "finish_reason": message.finish_reason,
                }]);
                span.set_attribute(KeyValue::new(attr::OUTPUT_MESSAGES, output.to_string()));
            }
            if let Some(error_type) = failed {
                span.set_attribute(KeyValue::new(attr::ERROR_TYPE, error_type));
                span.set_status(Status::error(error_type));
            }
        }
        span.end();
    }

    /// Ends the spans of a request that failed with `error` (answered by engram itself).
    pub fn fail(&mut self, error: &Error) {
        let Some(mut traced) = self.inner.take() else {
            return;
        };
        let error_type = error.error_type();
        if let Some(mut upstream) = traced.upstream.take() {
            fail(&mut upstream, error_type);
            upstream.end();
        }
        let span = traced.cx.span();
        if span.is_recording() {
            let status = error.status_code();
            span.set_attribute(KeyValue::new(attr::HTTP_STATUS, i64::from(status.as_u16())));
            if traced.chat || status.is_server_error() {
                span.set_attribute(KeyValue::new(attr::ERROR_TYPE, error_type));
                span.set_status(Status::error(error_type));
            }
        }
        span.end();
    }

    fn recording(&self) -> Option<&Traced> {
        self.inner
            .as_deref()
            .filter(|traced| traced.cx.span().is_recording())
    }
}

/// One span of a step (memory load, compose, record, the worker's update); empty when tracing
/// is off or the request is not sampled. Ends when dropped.
pub struct SpanGuard(Option<Span>);

impl SpanGuard {
    pub(super) fn off() -> SpanGuard {
        SpanGuard(None)
    }

    pub(super) fn on(span: Span) -> SpanGuard {
        SpanGuard(Some(span).filter(|span| span.is_recording()))
    }

    pub fn is_off(&self) -> bool {
        self.0.is_none()
    }

    pub fn set_int(&mut self, key: &'static str, value: u64) {
        if let Some(span) = &mut self.0 {
            span.set_attribute(KeyValue::new(key, saturating(value)));
        }
    }

    pub fn set_str(&mut self, key: &'static str, value: &'static str) {
        if let Some(span) = &mut self.0 {
            span.set_attribute(KeyValue::new(key, value));
        }
    }

    /// Marks the step failed with a low-cardinality `error.type`.
    pub fn fail(&mut self, error_type: &'static str) {
        if let Some(span) = &mut self.0 {
            fail(span, error_type);
        }
    }

    pub fn end(self) {}
}

impl Drop for SpanGuard {
    fn drop(&mut self) {
        if let Some(span) = &mut self.0 {
            span.end();
        }
    }
}

fn fail(span: &mut Span, error_type: impl Into<Cow<'static, str>>) {
    let error_type = error_type.into();
    span.set_attribute(KeyValue::new(attr::ERROR_TYPE, error_type.clone()));
    span.set_status(Status::error(error_type));
}

/// `error.type` of an HTTP status: its code, as the conventions say.
fn status_type(status: StatusCode) -> Cow<'static, str> {
    Cow::Owned(status.as_str().to_owned())
}

fn method_name(method: &Method) -> &'static str {
    match *method {
        Method::GET => "GET",
        Method::POST => "POST",
        Method::PUT => "PUT",
        Method::DELETE => "DELETE",
        Method::PATCH => "PATCH",
        Method::HEAD => "HEAD",
        Method::OPTIONS => "OPTIONS",
        // The conventions' name for a method outside the known set.
        _ => "_OTHER",
    }
}

fn saturating(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}
