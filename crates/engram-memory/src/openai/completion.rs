//! The response side: rebuilding the assistant message from a non-streaming completion body or
//! from the SSE chunks of a stream.

use serde::{Deserialize, Serialize};

use super::sse::{EventSplitter, event_data};

/// What the upstream answered, rebuilt for the recorder (first choice only).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct AssistantMessage {
    pub model: Option<String>,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub refusal: Option<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    pub finish_reason: Option<String>,
    pub usage: Option<Usage>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub name: String,
    pub arguments: String,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    #[serde(default)]
    pub prompt_tokens: u64,
    #[serde(default)]
    pub completion_tokens: u64,
    #[serde(default)]
    pub total_tokens: u64,
}

// Wire shapes, read leniently: unknown fields are ignored, missing ones default.

#[derive(Deserialize)]
struct Completion {
    model: Option<String>,
    #[serde(default)]
    choices: Vec<CompletionChoice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct CompletionChoice {
    #[serde(default)]
    index: u32,
    message: Option<CompletionMessage>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct CompletionMessage {
    content: Option<String>,
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireToolCall>,
}

#[derive(Deserialize)]
struct WireToolCall {
    #[serde(default)]
    index: Option<usize>,
    id: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    function: Option<WireFunction>,
}

#[derive(Deserialize)]
struct WireFunction {
    name: Option<String>,
    arguments: Option<String>,
}

#[derive(Deserialize)]
struct Chunk {
    model: Option<String>,
    #[serde(default)]
    choices: Vec<ChunkChoice>,
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct ChunkChoice {
    #[serde(default)]
    index: u32,
    delta: Option<Delta>,
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Delta {
    content: Option<String>,
    refusal: Option<String>,
    #[serde(default)]
    tool_calls: Vec<WireToolCall>,
}

impl AssistantMessage {
    /// Reads a non-streaming `chat.completion` body.
    pub fn from_completion(body: &[u8]) -> Result<Self, serde_json::Error> {
        let completion: Completion = serde_json::from_slice(body)?;
        let mut message = AssistantMessage {
            model: completion.model,
            usage: completion.usage,
            ..AssistantMessage::default()
        };
        if let Some(choice) = completion.choices.into_iter().find(|c| c.index == 0) {
            message.finish_reason = choice.finish_reason;
            if let Some(wire) = choice.message {
                message.content = wire.content.unwrap_or_default();
                message.refusal = wire.refusal;
                for call in wire.tool_calls {
                    let mut tool_call = ToolCall::default();
                    merge_tool_call(&mut tool_call, call);
                    message.tool_calls.push(tool_call);
                }
            }
        }
        Ok(message)
    }
}

fn merge_tool_call(into: &mut ToolCall, delta: WireToolCall) {
    if let Some(id) = delta.id {
        into.id = id;
    }
    if let Some(kind) = delta.kind {
        into.kind = kind;
    }
    if let Some(function) = delta.function {
        if let Some(name) = function.name {
            into.name.push_str(&name);
        }
        if let Some(arguments) = function.arguments {
            into.arguments.push_str(&arguments);
        }
    }
}

/// Rebuilds the assistant message from a `text/event-stream` body fed in arbitrary chunks.
#[derive(Debug, Default)]
pub struct StreamAccumulator {
    splitter: EventSplitter,
    message: AssistantMessage,
    saw_done: bool,
    malformed_events: u32,
}

/// The end state of a stream: the message, and whether it ended the way a whole stream does.
#[derive(Debug, Clone, PartialEq)]
pub struct StreamSummary {
    pub message: AssistantMessage,
    /// `data: [DONE]` arrived.
    pub saw_done: bool,
    /// Events whose data was not a JSON chunk, plus an unterminated tail.
    pub malformed_events: u32,
}

impl StreamAccumulator {
    pub fn push(&mut self, chunk: &[u8]) {
        for event in self.splitter.push(chunk) {
            self.read_event(&event);
        }
    }

    fn read_event(&mut self, event: &[u8]) {
        let Some(data) = event_data(event) else {
            return;
        };
        if data.trim() == "[DONE]" {
            self.saw_done = true;
            return;
        }
        match serde_json::from_str::<Chunk>(&data) {
            Ok(chunk) => self.apply(chunk),
            Err(_) => self.malformed_events += 1,
        }
    }

    fn apply(&mut self, chunk: Chunk) {
        if self.message.model.is_none() {
            self.message.model = chunk.model;
        }
        if chunk.usage.is_some() {
            self.message.usage = chunk.usage;
        }
        for choice in chunk.choices.into_iter().filter(|c| c.index == 0) {
            if choice.finish_reason.is_some() {
                self.message.finish_reason = choice.finish_reason;
            }
            let Some(delta) = choice.delta else { continue };
            if let Some(content) = delta.content {
                self.message.content.push_str(&content);
            }
            if let Some(refusal) = delta.refusal {
                self.message
                    .refusal
                    .get_or_insert_with(String::new)
                    .push_str(&refusal);
            }
            for call in delta.tool_calls {
                let slot = call.index.unwrap_or(self.message.tool_calls.len());
                if self.message.tool_calls.len() <= slot {
                    // Tool call indexes are small and dense; a gap is filled with empty calls.
                    self.message
                        .tool_calls
                        .resize_with(slot.min(1024) + 1, ToolCall::default);
                }
                if let Some(existing) = self.message.tool_calls.get_mut(slot) {
                    merge_tool_call(existing, call);
                }
            }
        }
    }

    pub fn finish(mut self) -> StreamSummary {
        if self.splitter.pending_len() > 0 {
            let tail = self.splitter.take_pending();
            // A final event without its blank line still counts if it parses.
            let before = self.malformed_events;
            self.read_event(&tail);
            if self.malformed_events == before && event_data(&tail).is_none() {
                self.malformed_events += 1;
            }
        }
        StreamSummary {
            message: self.message,
            saw_done: self.saw_done,
            malformed_events: self.malformed_events,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rebuilds_content_tool_calls_finish_and_usage_from_chunks() {
        let stream = concat!(
            "data: {\"id\":\"c\",\"model\":\"gpt-x\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"Hel\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":1,\"delta\":{\"content\":\"other choice\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"lo\"}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"id\":\"call_1\",\"type\":\"function\",\"function\":{\"name\":\"get_\",\"arguments\":\"{\\\"a\\\"\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":0,\"function\":{\"name\":\"weather\",\"arguments\":\":1}\"}}]}}]}\n\n",
            "data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"tool_calls\"}]}\n\n",
            "data: {\"choices\":[],\"usage\":{\"prompt_tokens\":5,\"completion_tokens\":2,\"total_tokens\":7}}\n\n",
            "data: [DONE]\n\n",
        );
        for cut in [1, 7, 50, 200, stream.len()] {
            let mut accumulator = StreamAccumulator::default();
            for piece in stream.as_bytes().chunks(cut) {
                accumulator.push(piece);
            }
            let summary = accumulator.finish();
            assert!(summary.saw_done);
            assert_eq!(summary.malformed_events, 0);
            let message = summary.message;
            assert_eq!(message.model.as_deref(), Some("gpt-x"));
            assert_eq!(message.content, "Hello");
            assert_eq!(message.finish_reason.as_deref(), Some("tool_calls"));
            assert_eq!(message.tool_calls.len(), 1);
            assert_eq!(message.tool_calls[0].name, "get_weather");
            assert_eq!(message.tool_calls[0].arguments, "{\"a\":1}");
            assert_eq!(message.tool_calls[0].id, "call_1");
            assert_eq!(message.usage.unwrap().total_tokens, 7);
        }
    }

    #[test]
    fn malformed_events_are_counted_not_fatal() {
        let mut accumulator = StreamAccumulator::default();
        accumulator.push(b"data: {not json}\n\ndata: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"ok\"}}]}\n\ndata: {\"cho");
        let summary = accumulator.finish();
        assert_eq!(summary.message.content, "ok");
        assert!(!summary.saw_done);
        assert_eq!(summary.malformed_events, 2);
    }

    #[test]
    fn reads_a_non_streaming_completion() {
        let body = br#"{"id":"x","object":"chat.completion","model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hi","tool_calls":[{"id":"t","type":"function","function":{"name":"f","arguments":"{}"}}]},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,"completion_tokens":1,"total_tokens":2,"prompt_tokens_details":{"cached_tokens":0}}}"#;
        let message = AssistantMessage::from_completion(body).unwrap();
        assert_eq!(message.content, "hi");
        assert_eq!(message.tool_calls[0].name, "f");
        assert_eq!(message.finish_reason.as_deref(), Some("stop"));
        assert_eq!(message.usage.unwrap().prompt_tokens, 1);
    }
}
