//! The seams where memory plugs into the proxy. The chat request's phases (`server/chat.rs`)
//! are, in order: identify (credential, content type, size, one parse), admit (rate limits),
//! load memory — **`MemoryLayer::rewrite`**, the prompt rewrite before the upstream request is
//! built — forward, filter the response, and tee and record: the bytes pass on untouched while
//! a copy goes aside, and after the response has streamed back (or the client left),
//! **`MemoryLayer::record`** runs off the hot path, on the tracked task set that shutdown
//! drains.

pub mod explain_log;
pub mod identity;
pub mod store_memory;
pub mod trust;

use std::time::Duration;

use http::HeaderMap;
use serde::Serialize;

use crate::error::Error;
pub use crate::recorder::{Capture, Exchange, Incomplete, Receipt, RecordPlan, log_capture};
use crate::telemetry::MemorySpan;
use engram_memory::BlockTokens;
use engram_memory::openai::{ChatRequest, OutgoingMessage};
pub use engram_runtime::BoxFuture;
use trust::Vouched;

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

impl Rewrite {
    /// What the request's span records of the memory phase.
    pub fn span(&self) -> MemorySpan {
        MemorySpan {
            outcome: self.outcome.as_str(),
            injected: (self.outcome == MemoryOutcome::Injected)
                .then_some((self.injected_tokens, self.injected_items)),
            reason: self.reason,
        }
    }
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
    /// How long reading the memory took (the cache, the store's one read, bringing the cached
    /// copy up to date), when the read succeeded; `None` when it failed open or was not read.
    pub load: Option<Duration>,
    /// How long composing the prompt took, when memory was composed.
    pub compose: Option<Duration>,
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

/// The memory behaviour of the proxy: [`store_memory::StoreMemory`] in `engram serve`;
/// [`NoMemory`] passes every request through (a server embedded without a store).
pub trait MemoryLayer: Send + Sync + 'static {
    /// Rewrites the request on the hot path, for the identity its headers name within what
    /// `vouched` allows. Fails only for bad client input (a malformed identity header); store
    /// trouble gives a `Degraded` outcome without a rewritten request.
    fn rewrite<'a>(
        &'a self,
        client_headers: &'a HeaderMap,
        vouched: &'a Vouched,
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
        _vouched: &'a Vouched,
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
