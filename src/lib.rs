//! engram: an OpenAI-compatible sidecar proxy that gives LLM applications long-term memory.
//!
//! The sidecar crate of the workspace: it stands on `engram-proxy` (the proxy: upstream
//! client, spans, cache, credentials, rate limits, summarizer, recorder, hot path, worker),
//! `engram-store` (storage), `engram-runtime` (the one error type and the runtime helpers) and
//! `engram-memory` (the pure engine and the OpenAI wire types), and the development tools
//! (`engram-mock`, `engram-eval`) stand on it; docs/architecture.md has the map.

// The one error type of the sidecar is the runtime crate's, where storage can use it too; it
// stays `engram::error` here.
pub use engram_runtime::error;

pub mod admin;
pub mod app;
pub mod cli;
pub mod config;
pub mod metrics;
pub mod server;
