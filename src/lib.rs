//! engram: an OpenAI-compatible sidecar proxy that gives LLM applications long-term memory.
//!
//! The sidecar crate of the workspace: it stands on `engram-memory` (the pure engine and the
//! OpenAI wire types), and the development tools (`engram-mock`, `engram-eval`) stand on it;
//! docs/architecture.md has the map.

pub mod admin;
pub mod app;
pub mod cache;
pub mod cli;
pub mod config;
pub mod credentials;
pub mod error;
pub mod metrics;
pub mod pipeline;
pub mod ratelimit;
pub mod recorder;
pub mod runtime;
pub mod server;
pub mod store;
pub mod summarizer;
pub mod telemetry;
pub mod upstream;
pub mod worker;
