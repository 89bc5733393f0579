//! engram: an OpenAI-compatible sidecar proxy that gives LLM applications long-term memory.

pub mod error;
pub mod openai;
pub mod cli;
pub mod config;
pub mod mock;
pub mod pipeline;
pub mod server;
pub mod upstream;
