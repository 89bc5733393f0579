//! OpenAI wire types: the chat request the proxy rewrites, and the response it captures.

pub mod chat;
pub mod completion;
pub mod sse;

pub use chat::{ChatMessage, ChatRequest, OutgoingMessage, StreamOptions};
pub use completion::{AssistantMessage, StreamAccumulator, StreamSummary, ToolCall, Usage};
