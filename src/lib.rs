//! engram: an OpenAI-compatible sidecar proxy that gives LLM applications long-term memory.

pub mod error;
pub mod memory;
pub mod openai;
