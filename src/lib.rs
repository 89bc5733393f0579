//! engram: an OpenAI-compatible sidecar proxy that gives LLM applications long-term memory.

pub mod admin;
pub mod app;
pub mod cache;
pub mod cli;
pub mod config;
pub mod credentials;
pub mod error;
pub mod eval;
pub mod memory;
pub mod metrics;
pub mod mock;
pub mod openai;
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
