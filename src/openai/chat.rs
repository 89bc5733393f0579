//! The request side of `POST /v1/chat/completions`.
//!
//! Only the fields the proxy reads are typed; everything else is kept in `extra` maps and written
//! back unchanged, so a field the proxy does not know (`tools`, `response_format`,
//! `reasoning_effort`, a vendor extension) is never dropped.

use serde::{Deserialize, Deserializer, Serialize};
use serde_json::{Map, Value};

use crate::error::Error;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatRequest {
    pub model: String,
    pub messages: Vec<ChatMessage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream: Option<bool>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stream_options: Option<StreamOptions>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct StreamOptions {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub include_usage: Option<bool>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` when absent; `Some(Value::Null)` when the client sent `"content": null`.
    #[serde(
        default,
        deserialize_with = "present",
        skip_serializing_if = "Option::is_none"
    )]
    pub content: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
}

/// Deserialises a present field, even `null`, as `Some`, so absent and `null` stay distinct.
fn present<'de, D: Deserializer<'de>>(deserializer: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(deserializer).map(Some)
}

impl ChatRequest {
    /// Parses a request body once, naming the byte position or field path of the first problem.
    pub fn from_slice(body: &[u8]) -> Result<Self, Error> {
        let request: ChatRequest = crate::error::decode_json(body)?;
        request.validate()?;
        Ok(request)
    }

    fn validate(&self) -> Result<(), Error> {
        if self.messages.is_empty() {
            return Err(Error::invalid_request(
                "`messages` must contain at least one message.",
                Some("messages"),
            ));
        }
        Ok(())
    }

    pub fn is_stream(&self) -> bool {
        self.stream == Some(true)
    }

    /// Whether the client itself asked for the trailing usage chunk of a stream.
    pub fn client_wants_usage(&self) -> bool {
        self.stream_options
            .as_ref()
            .and_then(|options| options.include_usage)
            == Some(true)
    }

    pub fn to_vec(&self) -> Vec<u8> {
        // A tree of JSON values with string keys always serialises.
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// The body-level end-user id (`user`, or its successor `safety_identifier`).
    pub fn end_user(&self) -> Option<&str> {
        ["user", "safety_identifier"]
            .iter()
            .find_map(|key| self.extra.get(*key).and_then(Value::as_str))
    }

    /// The latest message with role `user`, if any.
    pub fn last_user_message(&self) -> Option<&ChatMessage> {
        self.messages
            .iter()
            .rev()
            .find(|message| message.role == "user")
    }
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, text: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(Value::String(text.into())),
            extra: Map::new(),
        }
    }

    /// The message's text: a string content, or the `text` parts of an array content joined by
    /// newlines. Images, audio and other parts carry no text and are skipped.
    pub fn text(&self) -> String {
        match &self.content {
            Some(Value::String(text)) => text.clone(),
            Some(Value::Array(parts)) => {
                let texts: Vec<&str> = parts
                    .iter()
                    .filter_map(|part| part.get("text").and_then(Value::as_str))
                    .collect();
                texts.join("\n")
            }
            _ => String::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_fields_survive_a_round_trip() {
        let body = serde_json::json!({
            "model": "gpt-4o",
            "messages": [
                {"role": "system", "content": "be brief", "name": "sys"},
                {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:x"}}]},
                {"role": "assistant", "content": null, "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "42"}
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}},
            "logprobs": true, "top_logprobs": 3, "n": 2,
            "reasoning_effort": "high", "reasoning": {"effort": "low"},
            "temperature": 0.7, "seed": 18446744073709551615u64,
            "x_vendor": {"nested": [1, 2.5, "three"]},
            "stream": false
        });
        let parsed = ChatRequest::from_slice(body.to_string().as_bytes()).unwrap();
        let back: Value = serde_json::from_slice(&parsed.to_vec()).unwrap();
        assert_eq!(back, body);
    }

    #[test]
    fn syntax_errors_name_the_position() {
        let error = ChatRequest::from_slice(b"{\"model\": \"m\",\n \"messages\": [}").unwrap_err();
        let text = error.to_string();
        assert!(text.contains("line 2 column"), "{text}");
    }

    #[test]
    fn type_errors_name_the_field_path() {
        let error =
            ChatRequest::from_slice(br#"{"model":"m","messages":[{"role":7}]}"#).unwrap_err();
        match error {
            Error::InvalidJson { param, .. } => {
                assert_eq!(param.as_deref(), Some("messages[0].role"))
            }
            other => panic!("unexpected {other:?}"),
        }
    }

    #[test]
    fn missing_and_empty_messages_are_rejected() {
        assert!(ChatRequest::from_slice(br#"{"model":"m"}"#).is_err());
        assert!(ChatRequest::from_slice(br#"{"model":"m","messages":[]}"#).is_err());
    }

    #[test]
    fn text_joins_text_parts() {
        let message: ChatMessage = serde_json::from_str(
            r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"input_audio"},{"type":"text","text":"b"}]}"#,
        )
        .unwrap();
        assert_eq!(message.text(), "a\nb");
    }
}
