//! The seams where memory plugs into the proxy, in the order of a request's phases:
//!
//! 1. request filter (server: content type, size, parse once),
//! 2. **`MemoryLayer::rewrite`** — the prompt rewrite, before the upstream request is built,
//! 3. upstream request (headers, `stream_options.include_usage`),
//! 4. response body filter (the tee: bytes pass on untouched, a copy goes aside),
//! 5. **`MemoryLayer::record`** — after the response has streamed back (or the client left),
//!    off the hot path, on the tracked task set that shutdown drains.

pub mod cache;
pub mod explain_log;
pub mod identity;
pub mod order;
pub mod store_memory;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use http::HeaderMap;
use serde::Serialize;

use crate::error::Error;
use crate::memory::BlockTokens;
use crate::openai::{AssistantMessage, ChatRequest, OutgoingMessage};
use crate::store::JobId;

pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// What the memory phase did to a request; rendered as `x-engram-*` response headers.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Rewrite {
    pub outcome: MemoryOutcome,
    /// The messages to send instead of the client's; `None` forwards the client's as sent.
    pub messages: Option<Vec<OutgoingMessage>>,
    pub injected_tokens: u32,
    pub injected_items: u32,
    /// Why memory was skipped or degraded (`x-engram-memory-reason`).
    pub reason: Option<&'static str>,
    /// The id of this turn (`x-engram-turn-id`), for every request that read memory; its
    /// explanation is kept for the management API.
    pub turn_id: Option<String>,
    /// Identity, hard constraints and pinned items alone exceeded the budget.
    pub reserved_over_budget: bool,
    /// How the exchange will be recorded; `None` records nothing (no user, `off`, `read-only`).
    pub record: Option<RecordPlan>,
    /// What the memory read and injected, for the metrics.
    pub measures: MemoryMeasures,
}

/// Counts from a request's memory phase, for `/metrics`; all zero unless memory was read.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct MemoryMeasures {
    /// Injected tokens per block (`total` is `Rewrite::injected_tokens`).
    pub blocks: BlockTokens,
    /// Tokens of every exchange in the user's stored history, in the request's encoding: what
    /// the injected memory stands in for.
    pub history_tokens: u64,
    /// Items retrieval ranked for the latest user message, and how many of them were injected.
    pub retrieval_candidates: u32,
    pub retrieval_hits: u32,
}

/// Everything the recorder needs that the hot path already resolved.
#[derive(Debug, Clone, PartialEq)]
pub struct RecordPlan {
    pub session: String,
    /// The exchange's id, returned to the client as `x-engram-turn-id`.
    pub turn_id: String,
    /// When the request arrived (µs since the epoch); orders the session's jobs across
    /// replicas ([`crate::memory::ExchangeInput::arrival`]).
    pub arrival_us: u64,
    /// The job the exchange becomes (with the user it belongs to); its key hashes the
    /// exchange's identity, so a replayed exchange maps to the same job and applies once.
    pub job: JobId,
    pub event_time: Option<String>,
    /// The chain link of the conversation the client sent (full-history clients).
    pub prior_chain: Option<u64>,
    /// The request's place in its session's order; the recorder enqueues in that order.
    pub ticket: Option<Arc<order::Ticket>>,
    /// The turn's arrival note in the store (the order across replicas); ended when the
    /// request ends without a recording.
    pub arrival: Option<Arc<order::Arrival>>,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum MemoryOutcome {
    /// Memory was injected.
    Injected,
    /// Memory was not used: no user identity, `x-engram-mode: off`, or memory disabled.
    #[default]
    Skipped,
    /// The store failed or was too slow; the request went upstream without memory.
    Degraded,
}

impl MemoryOutcome {
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryOutcome::Injected => "injected",
            MemoryOutcome::Skipped => "skipped",
            MemoryOutcome::Degraded => "degraded",
        }
    }
}

/// Why a capture is not the whole answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Incomplete {
    /// The client went away before the response ended.
    ClientDisconnected,
    /// The upstream connection failed or went idle past the read timeout mid-body.
    UpstreamFailed,
    /// The recorder fell behind the client and frames were not copied.
    TeeOverflow,
    /// The response was larger than `capture.max_response_bytes`.
    TooLarge,
    /// The body could not be read as a completion (bad JSON, or a stream without `[DONE]`).
    Malformed,
}

/// The assistant's answer as the recorder saw it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Capture {
    pub message: AssistantMessage,
    /// `None` when the whole response arrived and was read.
    pub incomplete: Option<Incomplete>,
    pub streamed: bool,
}

/// One request and its captured answer, handed to the recorder.
#[derive(Debug)]
pub struct Exchange {
    /// The request as the client sent it (before any rewrite).
    pub request: ChatRequest,
    pub client_headers: HeaderMap,
    pub capture: Capture,
    pub record: Option<RecordPlan>,
    /// Told how far the recording got, once it is durable (or failed); the end of the answer
    /// waits for it (see [`Receipt`]).
    pub receipt: Option<tokio::sync::oneshot::Sender<Receipt>>,
}

/// How far an exchange's recording had got when the end of its answer went to the client:
/// the `state` of a stream's closing receipt comment and the `x-engram-job-state` header.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Receipt {
    /// Durable in the store (fsynced on the embedded store; acknowledged by Redis and the
    /// replicas `store.redis.wait_replicas` asks for): the next request of the session sees
    /// it, and a crash does not lose it.
    Queued,
    /// Durable in the local spool (the Redis backend's spool file); the store gets it once it
    /// answers again.
    Spooled,
    /// Not durable yet: the store did not take it within `capture.receipt_wait_ms`, or only
    /// the in-memory spool did. The recording goes on after the answer.
    Pending,
    /// Neither the store nor the spool took it.
    Lost,
    /// Nothing to record (an empty exchange).
    Unrecorded,
}

impl Receipt {
    pub fn as_str(self) -> &'static str {
        match self {
            Receipt::Queued => "queued",
            Receipt::Spooled => "spooled",
            Receipt::Pending => "pending",
            Receipt::Lost => "lost",
            Receipt::Unrecorded => "unrecorded",
        }
    }
}

/// The memory behaviour of the proxy: [`store_memory::StoreMemory`] in `engram serve`;
/// [`NoMemory`] passes every request through (a server embedded without a store).
pub trait MemoryLayer: Send + Sync + 'static {
    /// Rewrites the request on the hot path. Fails only for bad client input (a malformed
    /// identity header); store trouble gives a `Degraded` outcome without a rewritten request.
    fn rewrite<'a>(
        &'a self,
        client_headers: &'a HeaderMap,
        request: &'a ChatRequest,
    ) -> BoxFuture<'a, Result<Rewrite, Error>>;

    /// Records a finished exchange; runs after the response, off the hot path.
    fn record(&self, exchange: Exchange) -> BoxFuture<'static, ()>;
}

/// No memory: requests pass through unchanged; captured exchanges are only logged.
#[derive(Debug, Default)]
pub struct NoMemory;

impl MemoryLayer for NoMemory {
    fn rewrite<'a>(
        &'a self,
        _client_headers: &'a HeaderMap,
        _request: &'a ChatRequest,
    ) -> BoxFuture<'a, Result<Rewrite, Error>> {
        Box::pin(std::future::ready(Ok(Rewrite {
            reason: Some("disabled"),
            ..Rewrite::default()
        })))
    }

    fn record(&self, exchange: Exchange) -> BoxFuture<'static, ()> {
        log_capture(&exchange);
        Box::pin(std::future::ready(()))
    }
}

/// One debug line per captured exchange: sizes and state, never the text itself.
pub fn log_capture(exchange: &Exchange) {
    let capture = &exchange.capture;
    tracing::debug!(
        model = %exchange.request.model,
        streamed = capture.streamed,
        complete = capture.incomplete.is_none(),
        incomplete = capture.incomplete.map(|reason| format!("{reason:?}")),
        content_chars = capture.message.content.chars().count(),
        tool_calls = capture.message.tool_calls.len(),
        finish_reason = capture.message.finish_reason.as_deref(),
        completion_tokens = capture.message.usage.map(|usage| usage.completion_tokens),
        "exchange captured"
    );
}
