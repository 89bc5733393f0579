//! engram: an OpenAI-compatible sidecar proxy that gives LLM applications long-term memory.
//!
//! The sidecar's top crate, HTTP and wiring (`server`, `app`) and the `engram` binary: it stands
//! on `engram-ops` (metrics, configuration, command line, management API), `engram-proxy` (the
//! proxy: upstream client, spans, cache, credentials, rate limits, summarizer, recorder, hot
//! path, worker), `engram-store` (storage), `engram-runtime` (the one error type and the
//! runtime helpers) and `engram-memory` (the pure engine and the OpenAI wire types), and the
//! evaluation (`engram-eval`) stands on it; docs/architecture.md has the map.

// The one error type of the sidecar is the runtime crate's, where storage can use it too; it
// stays `engram::error` here.
pub use engram_runtime::error;

pub mod app;
pub mod server;
