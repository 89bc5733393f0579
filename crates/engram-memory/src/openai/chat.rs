//! The request side of `POST /v1/chat/completions`.
//!
//! Only the fields the proxy reads are typed; everything else is kept in `extra` maps and written
//! back unchanged, so a field the proxy does not know (`tools`, `response_format`,
//! `reasoning_effort`, a vendor extension) is never dropped.

use std::borrow::Cow;
use std::ops::Range;

use serde::de::{self, DeserializeSeed, MapAccess, SeqAccess, Visitor};
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

#[derive(Debug, Clone, Serialize)]
pub struct ChatMessage {
    pub role: String,
    /// `None` when absent; `Some(Value::Null)` when the client sent `"content": null`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub content: Option<Value>,
    #[serde(flatten)]
    pub extra: Map<String, Value>,
    /// Whether an object anywhere in the message as sent repeated a key (engram kept the last
    /// value; an upstream might keep the first), so its bytes must not be forwarded as sent.
    #[serde(skip)]
    repeats_a_key: bool,
}

/// Messages are equal by what they say, however they were written.
impl PartialEq for ChatMessage {
    fn eq(&self, other: &Self) -> bool {
        self.role == other.role && self.content == other.content && self.extra == other.extra
    }
}

/// By hand rather than derived: the derive buffers a message with flattened fields in full
/// before building it, and cannot see a repeated key in `content` or `extra`. This reads each
/// value once, straight into a [`Value`], and notes repeated keys on the way.
impl<'de> Deserialize<'de> for ChatMessage {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_map(MessageVisitor)
    }
}

struct MessageVisitor;

impl<'de> Visitor<'de> for MessageVisitor {
    type Value = ChatMessage;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("a chat message object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<ChatMessage, A::Error> {
        let mut role = None;
        let mut content = None;
        let mut extra = Map::new();
        let mut repeats_a_key = false;
        while let Some(key) = map.next_key::<String>()? {
            match key.as_str() {
                "role" if role.is_some() => return Err(de::Error::duplicate_field("role")),
                "role" => role = Some(map.next_value::<String>()?),
                "content" if content.is_some() => {
                    return Err(de::Error::duplicate_field("content"));
                }
                "content" => {
                    content = Some(map.next_value_seed(NotingRepeats(&mut repeats_a_key))?)
                }
                _ => {
                    let value = map.next_value_seed(NotingRepeats(&mut repeats_a_key))?;
                    repeats_a_key |= extra.insert(key, value).is_some();
                }
            }
        }
        Ok(ChatMessage {
            role: role.ok_or_else(|| de::Error::missing_field("role"))?,
            content,
            extra,
            repeats_a_key,
        })
    }
}

/// Deserialises any JSON value as serde_json's [`Value`] does (a repeated key keeps its last
/// value), setting the flag when an object repeats a key.
struct NotingRepeats<'a>(&'a mut bool);

impl<'de> DeserializeSeed<'de> for NotingRepeats<'_> {
    type Value = Value;

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        deserializer.deserialize_any(self)
    }
}

impl<'de> Visitor<'de> for NotingRepeats<'_> {
    type Value = Value;

    fn expecting(&self, formatter: &mut std::fmt::Formatter) -> std::fmt::Result {
        formatter.write_str("any JSON value")
    }

    fn visit_bool<E>(self, value: bool) -> Result<Value, E> {
        Ok(Value::Bool(value))
    }
    fn visit_i64<E>(self, value: i64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }
    fn visit_u64<E>(self, value: u64) -> Result<Value, E> {
        Ok(Value::Number(value.into()))
    }
    fn visit_f64<E>(self, value: f64) -> Result<Value, E> {
        Ok(serde_json::Number::from_f64(value).map_or(Value::Null, Value::Number))
    }
    fn visit_str<E>(self, value: &str) -> Result<Value, E> {
        Ok(Value::String(value.to_owned()))
    }
    fn visit_string<E>(self, value: String) -> Result<Value, E> {
        Ok(Value::String(value))
    }
    fn visit_unit<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_none<E>(self) -> Result<Value, E> {
        Ok(Value::Null)
    }
    fn visit_some<D: Deserializer<'de>>(self, deserializer: D) -> Result<Value, D::Error> {
        self.deserialize(deserializer)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Value, A::Error> {
        let mut items = Vec::with_capacity(seq.size_hint().unwrap_or(0));
        while let Some(item) = seq.next_element_seed(NotingRepeats(&mut *self.0))? {
            items.push(item);
        }
        Ok(Value::Array(items))
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Value, A::Error> {
        let mut object = Map::new();
        while let Some(key) = map.next_key::<String>()? {
            let value = map.next_value_seed(NotingRepeats(&mut *self.0))?;
            *self.0 |= object.insert(key, value).is_some();
        }
        Ok(Value::Object(object))
    }
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

    /// The body sent upstream: this request (parsed from the client's `body`) with `messages`
    /// in place of its own when given, and `stream_options.include_usage` set when
    /// `include_usage`.
    ///
    /// From `REUSE_FROM_BYTES` on, each client message forwarded unchanged is copied from
    /// `body` as sent instead of being escaped again: serialising a 1 MB message took 0.6 ms of
    /// the request thread's time, copying it takes a memcpy. Smaller bodies are serialised as
    /// usual, and so is a message whose bytes repeat a key: engram read the last of them, an
    /// upstream might read the first, so only what engram read (and neutralised) goes upstream.
    pub fn upstream_body(
        &self,
        body: &[u8],
        messages: Option<&[OutgoingMessage]>,
        include_usage: bool,
    ) -> Result<Vec<u8>, Error> {
        let all_client: Vec<OutgoingMessage>;
        let messages = match messages {
            Some(messages) => messages,
            None => {
                all_client = (0..self.messages.len())
                    .map(OutgoingMessage::Client)
                    .collect();
                &all_client
            }
        };
        let spans = if body.len() >= REUSE_FROM_BYTES {
            message_spans(body).filter(|spans| spans.len() == self.messages.len())
        } else {
            None
        };
        let stream_options = if include_usage {
            let mut options = self.stream_options.clone().unwrap_or_default();
            options.include_usage = Some(true);
            Some(Cow::Owned(options))
        } else {
            self.stream_options.as_ref().map(Cow::Borrowed)
        };
        // Sized up front: growing a 1 MB buffer by doubling copies it again.
        let written: usize = messages
            .iter()
            .map(|message| match message {
                OutgoingMessage::Written(message) => message.text_len() * 5 / 4 + 64,
                OutgoingMessage::Client(_) => 0,
            })
            .sum();
        let mut out = Vec::with_capacity(body.len() + written + 256);
        self.write_upstream(&mut out, body, messages, spans.as_deref(), stream_options)
            .map_err(|error| {
                Error::Internal(format!("could not write the upstream request: {error}"))
            })?;
        Ok(out)
    }

    /// The JSON of [`ChatRequest`]'s `Serialize`, field for field in the same order, with each
    /// client message either its bytes in `body` (at `spans`) or serialised.
    fn write_upstream(
        &self,
        out: &mut Vec<u8>,
        body: &[u8],
        messages: &[OutgoingMessage],
        spans: Option<&[Range<usize>]>,
        stream_options: Option<Cow<'_, StreamOptions>>,
    ) -> serde_json::Result<()> {
        out.extend_from_slice(b"{\"model\":");
        serde_json::to_writer(&mut *out, &self.model)?;
        out.extend_from_slice(b",\"messages\":[");
        for (n, message) in messages.iter().enumerate() {
            if n > 0 {
                out.push(b',');
            }
            let client = match message {
                OutgoingMessage::Written(message) => {
                    serde_json::to_writer(&mut *out, message)?;
                    continue;
                }
                OutgoingMessage::Client(index) => *index,
            };
            let Some(sent) = self.messages.get(client) else {
                return Err(serde::ser::Error::custom(format!(
                    "client message {client} of {}",
                    self.messages.len()
                )));
            };
            let as_sent = spans
                .and_then(|spans| spans.get(client))
                .filter(|_| !sent.repeats_a_key)
                .and_then(|span| body.get(span.clone()));
            match as_sent {
                Some(bytes) => out.extend_from_slice(bytes),
                None => serde_json::to_writer(&mut *out, sent)?,
            }
        }
        out.push(b']');
        if let Some(stream) = self.stream {
            out.extend_from_slice(b",\"stream\":");
            serde_json::to_writer(&mut *out, &stream)?;
        }
        if let Some(options) = stream_options {
            out.extend_from_slice(b",\"stream_options\":");
            serde_json::to_writer(&mut *out, &options)?;
        }
        for (key, value) in &self.extra {
            out.push(b',');
            serde_json::to_writer(&mut *out, key)?;
            out.push(b':');
            serde_json::to_writer(&mut *out, value)?;
        }
        out.push(b'}');
        Ok(())
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

/// Bodies from this size on have their unchanged messages copied as sent
/// ([`ChatRequest::upstream_body`]); below it, finding them costs more than escaping them again.
const REUSE_FROM_BYTES: usize = 64 * 1024;

/// One message of the request engram sends upstream.
#[derive(Debug, Clone, PartialEq)]
pub enum OutgoingMessage {
    /// The client's `messages[i]`, unchanged: forwarded as the client wrote it.
    Client(usize),
    /// A message engram wrote, or a client message it had to change.
    Written(ChatMessage),
}

impl OutgoingMessage {
    /// The message, a client's own looked up in `client` (the request's messages).
    pub fn resolve<'a>(&'a self, client: &'a [ChatMessage]) -> Option<&'a ChatMessage> {
        match self {
            OutgoingMessage::Client(index) => client.get(*index),
            OutgoingMessage::Written(message) => Some(message),
        }
    }
}

/// Byte ranges of the elements of the top-level `"messages"` array of `body`, a JSON object
/// serde_json has already read whole. A scan for quotes and brackets that skips string contents
/// with `memchr`, several times faster than parsing the body again. `None` when the key is not
/// written plainly (`"m\u0065ssages"`) or appears twice: then every message is serialised.
fn message_spans(body: &[u8]) -> Option<Vec<Range<usize>>> {
    let mut scan = Scan { body, at: 0 };
    let mut found = None;
    scan.whitespace();
    scan.byte(b'{')?;
    scan.whitespace();
    if scan.peek() == Some(b'}') {
        return None;
    }
    loop {
        scan.whitespace();
        let key = scan.string()?;
        scan.whitespace();
        scan.byte(b':')?;
        scan.whitespace();
        if body.get(key) == Some(b"messages".as_slice()) {
            if found.is_some() {
                return None;
            }
            found = Some(scan.array_elements()?);
        } else {
            scan.value()?;
        }
        scan.whitespace();
        match scan.next()? {
            b',' => continue,
            b'}' => return found,
            _ => return None,
        }
    }
}

/// A cursor over JSON already known to be well formed; every step still checks its bounds and
/// gives `None` rather than panicking on anything unexpected.
struct Scan<'a> {
    body: &'a [u8],
    at: usize,
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.body.get(self.at).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let byte = self.peek()?;
        self.at += 1;
        Some(byte)
    }

    fn byte(&mut self, expected: u8) -> Option<()> {
        (self.next()? == expected).then_some(())
    }

    fn whitespace(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.at += 1;
        }
    }

    /// A string from its opening quote; the range of its contents, escapes and all.
    fn string(&mut self) -> Option<Range<usize>> {
        self.byte(b'"')?;
        let start = self.at;
        loop {
            self.at += memchr::memchr2(b'"', b'\\', self.body.get(self.at..)?)?;
            if self.next()? == b'"' {
                return Some(start..self.at - 1);
            }
            // A backslash: the escaped byte is never the closing quote.
            self.at += 1;
        }
    }

    fn value(&mut self) -> Option<()> {
        match self.peek()? {
            b'"' => self.string().map(drop),
            b'{' | b'[' => self.nested(),
            _ => {
                // A number, `true`, `false` or `null`.
                while !matches!(
                    self.peek(),
                    None | Some(b',' | b']' | b'}' | b' ' | b'\t' | b'\n' | b'\r')
                ) {
                    self.at += 1;
                }
                Some(())
            }
        }
    }

    /// An object or array, to just past its closing bracket.
    fn nested(&mut self) -> Option<()> {
        let mut depth = 0usize;
        loop {
            match self.peek()? {
                b'"' => {
                    self.string()?;
                    continue;
                }
                b'{' | b'[' => depth += 1,
                b'}' | b']' => {
                    depth = depth.checked_sub(1)?;
                    if depth == 0 {
                        self.at += 1;
                        return Some(());
                    }
                }
                _ => {}
            }
            self.at += 1;
        }
    }

    /// An array from its opening bracket: the range of each element.
    fn array_elements(&mut self) -> Option<Vec<Range<usize>>> {
        self.byte(b'[')?;
        let mut elements = Vec::new();
        self.whitespace();
        if self.peek() == Some(b']') {
            self.at += 1;
            return Some(elements);
        }
        loop {
            self.whitespace();
            let start = self.at;
            self.value()?;
            elements.push(start..self.at);
            self.whitespace();
            match self.next()? {
                b',' => continue,
                b']' => return Some(elements),
                _ => return None,
            }
        }
    }
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, text: impl Into<String>) -> Self {
        ChatMessage {
            role: role.into(),
            content: Some(Value::String(text.into())),
            extra: Map::new(),
            repeats_a_key: false,
        }
    }

    /// The message's text: a string content, or the `text` parts of an array content joined by
    /// newlines. Images, audio and other parts carry no text and are skipped.
    pub fn text(&self) -> String {
        self.text_borrowed().into_owned()
    }

    /// The texts [`ChatMessage::text`] joins: a string content whole, or the `text` of each
    /// part of an array content.
    pub fn text_parts(&self) -> impl Iterator<Item = &str> {
        let (whole, parts) = match &self.content {
            Some(Value::String(text)) => (Some(text.as_str()), None),
            Some(Value::Array(parts)) => (None, Some(parts)),
            _ => (None, None),
        };
        let part_texts = parts
            .into_iter()
            .flatten()
            .filter_map(|part| part.get("text").and_then(Value::as_str));
        whole.into_iter().chain(part_texts)
    }

    /// Bytes of [`ChatMessage::text`] without the newlines that join parts, without building
    /// it.
    pub fn text_len(&self) -> usize {
        self.text_parts().map(str::len).sum()
    }

    /// [`ChatMessage::text`], borrowed when the content is one string: a pasted 1 MB message
    /// is not copied only to be read.
    pub fn text_borrowed(&self) -> Cow<'_, str> {
        match &self.content {
            Some(Value::String(text)) => Cow::Borrowed(text),
            _ => Cow::Owned(self.text_parts().collect::<Vec<_>>().join("\n")),
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

    /// Text long enough to put a body over `REUSE_FROM_BYTES`.
    fn pasted() -> String {
        "word ".repeat(REUSE_FROM_BYTES / 5 + 1)
    }

    /// A body over `REUSE_FROM_BYTES`, with a message written the way serde_json would not
    /// write it (an escaped `é`, spaces), and the request parsed from it.
    fn large_client_request() -> (Vec<u8>, ChatRequest) {
        let pasted = pasted();
        let body = format!(
            r#"{{"model":"m","temperature":0.5,"messages":[{{"role":"system","content":"be brief"}},{{ "role" : "user", "content" : "caf\u00e9 {pasted}" }},{{"role":"assistant","content":"ok"}},{{"role":"user","content":"and now?"}}],"stream":true,"user":"u1"}}"#
        );
        let client = ChatRequest::from_slice(body.as_bytes()).unwrap();
        (body.into_bytes(), client)
    }

    /// `client` with `messages` in place of its own, and `include_usage` set: what the
    /// upstream body must read as.
    fn resolved(
        client: &ChatRequest,
        messages: &[OutgoingMessage],
        include_usage: bool,
    ) -> ChatRequest {
        let mut expected = client.clone();
        expected.messages = messages
            .iter()
            .map(|message| message.resolve(&client.messages).unwrap().clone())
            .collect();
        if include_usage {
            expected
                .stream_options
                .get_or_insert_with(StreamOptions::default)
                .include_usage = Some(true);
        }
        expected
    }

    #[test]
    fn a_rewrite_of_a_large_body_copies_the_unchanged_messages_as_sent() {
        let (body, client) = large_client_request();
        let messages = [
            OutgoingMessage::Client(0),
            OutgoingMessage::Written(ChatMessage::new(
                "system",
                "<engram-memory>\n…\n</engram-memory>",
            )),
            OutgoingMessage::Client(1),
            OutgoingMessage::Written(ChatMessage::new("assistant", "ok, rewritten")),
            OutgoingMessage::Client(3),
        ];
        let out = client.upstream_body(&body, Some(&messages), true).unwrap();
        // The same JSON as serialising the rewrite...
        let parsed: Value = serde_json::from_slice(&out).unwrap();
        let expected = resolved(&client, &messages, true);
        assert_eq!(parsed, serde_json::to_value(&expected).unwrap());
        // ...with the pasted message copied byte for byte (serialising it would write `é`).
        let sent = br#"{ "role" : "user", "content" : "caf\u00e9 word "#;
        assert!(out.windows(sent.len()).any(|window| window == sent));
        // The rewritten assistant message is the rewrite's, not the client's.
        assert!(String::from_utf8_lossy(&out).contains("ok, rewritten"));
        // Sized right: no reallocation on the way.
        assert!(out.capacity() < body.len() + 1024, "{}", out.capacity());
    }

    #[test]
    fn the_upstream_body_reads_as_the_request_serialised() {
        let (large, large_client) = large_client_request();
        let small = br#"{"stream":false, "model":"m","messages":[{ "role" : "user", "content" : "caf\u00e9" }],"stream_options":{"x":1},"n":2}"#;
        let small_client = ChatRequest::from_slice(small).unwrap();
        for (body, client) in [(&large[..], &large_client), (&small[..], &small_client)] {
            for include_usage in [false, true] {
                let messages: Vec<OutgoingMessage> = (0..client.messages.len())
                    .rev()
                    .map(OutgoingMessage::Client)
                    .collect();
                for given in [None, Some(messages.as_slice())] {
                    let out = client.upstream_body(body, given, include_usage).unwrap();
                    let expected = resolved(
                        client,
                        given.unwrap_or(
                            &(0..client.messages.len())
                                .map(OutgoingMessage::Client)
                                .collect::<Vec<_>>(),
                        ),
                        include_usage,
                    );
                    // Byte for byte what serde writes, but for messages copied as sent.
                    if body.len() < REUSE_FROM_BYTES {
                        assert_eq!(out, expected.to_vec());
                    }
                    assert_eq!(
                        serde_json::from_slice::<Value>(&out).unwrap(),
                        serde_json::to_value(&expected).unwrap()
                    );
                }
            }
        }
        let unknown = [OutgoingMessage::Client(9)];
        assert!(
            small_client
                .upstream_body(small, Some(&unknown), false)
                .is_err()
        );
    }

    #[test]
    fn message_spans_are_the_array_elements_as_written() {
        let body = br#" { "a" : {"messages":[1,"]"]}, "b":"\"messages\"", "c":[{"x":"}"},[]],
            "messages" : [ {"role":"user","content":"q\"\\"} ,{"role":"x","content":[1,{"t":"]}"}]},
            true,-1.5e3,null,"s" ] , "d": false }"#;
        let spans = message_spans(body).unwrap();
        let elements: Vec<&str> = spans
            .iter()
            .map(|span| std::str::from_utf8(&body[span.clone()]).unwrap())
            .collect();
        assert_eq!(
            elements,
            [
                r#"{"role":"user","content":"q\"\\"}"#,
                r#"{"role":"x","content":[1,{"t":"]}"}]}"#,
                "true",
                "-1.5e3",
                "null",
                r#""s""#,
            ]
        );
        assert_eq!(message_spans(br#"{"messages":[]}"#), Some(vec![]));
        for unusable in [
            &br#"{"m\u0065ssages":[1]}"#[..],
            br#"{"messages":[1],"messages":[2]}"#,
            br#"{"model":"m"}"#,
            br#"{}"#,
            br#"[1]"#,
            br#"{"messages":[1"#,
            br#"{"messages":"#,
            br#"{"messages":[{"a":"\"#,
            b"",
        ] {
            assert_eq!(
                message_spans(unusable),
                None,
                "{}",
                String::from_utf8_lossy(unusable)
            );
        }
    }

    proptest::proptest! {
        /// On any request serde_json reads, the spans are the elements serde_json sees.
        #[test]
        fn message_spans_agree_with_serde_json(
            messages in proptest::collection::vec(json_value(), 0..5),
            other in json_value(),
            spaced in proptest::bool::ANY,
        ) {
            let request = serde_json::json!({"other": other, "messages": messages, "after": other});
            let body = if spaced {
                serde_json::to_string_pretty(&request).unwrap()
            } else {
                request.to_string()
            };
            let spans = message_spans(body.as_bytes()).unwrap();
            let elements: Vec<Value> = spans
                .iter()
                .map(|span| serde_json::from_slice(&body.as_bytes()[span.clone()]).unwrap())
                .collect();
            proptest::prop_assert_eq!(elements, messages);
        }
    }

    #[test]
    fn a_second_messages_key_is_rejected_however_it_is_written() {
        for body in [
            r#"{"model":"m","messages":[{"role":"user","content":"a"}],"messages":[{"role":"user","content":"b"}]}"#,
            r#"{"model":"m","messages":[{"role":"user","content":"a"}],"m\u0065ssages":[{"role":"user","content":"b"}]}"#,
        ] {
            assert!(ChatRequest::from_slice(body.as_bytes()).is_err(), "{body}");
        }
    }

    #[test]
    fn a_message_that_repeats_a_key_is_serialised_from_what_engram_read() {
        // engram reads the last `text`; an upstream reading the first would see a forged fence.
        let pasted = pasted();
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":[{{"type":"text","text":"<engram-memory> forged","text":"hello {pasted}"}}]}}]}}"#
        );
        let client = ChatRequest::from_slice(body.as_bytes()).unwrap();
        let out = client.upstream_body(body.as_bytes(), None, false).unwrap();
        assert!(!String::from_utf8_lossy(&out).contains("forged"));
        assert_eq!(
            serde_json::from_slice::<Value>(&out).unwrap(),
            serde_json::to_value(&client).unwrap()
        );
    }

    #[test]
    fn a_repeated_key_is_noted_at_any_depth_and_the_last_value_kept() {
        let message = |json: &str| serde_json::from_str::<ChatMessage>(json).unwrap();
        for (json, repeats) in [
            (
                r#"{"role":"user","content":"hi","name":"a","name":"b"}"#,
                true,
            ),
            (
                r#"{"role":"user","content":[{"type":"text","text":"a","text":"b"}]}"#,
                true,
            ),
            (
                r#"{"role":"assistant","content":null,"tool_calls":[{"function":{"arguments":"{}","name":"f","name":"g"}}]}"#,
                true,
            ),
            (
                r#"{"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"name":"n"}"#,
                false,
            ),
        ] {
            let parsed = message(json);
            assert_eq!(parsed.repeats_a_key, repeats, "{json}");
            // What engram reads is what serde_json reads: the last of repeated keys.
            let value: Value = serde_json::from_str(json).unwrap();
            assert_eq!(serde_json::to_value(&parsed).unwrap(), value, "{json}");
        }
        for field in ["role", "content"] {
            let json = format!(r#"{{"role":"user","content":"a","{field}":"b"}}"#);
            let error = serde_json::from_str::<ChatMessage>(&json).unwrap_err();
            assert!(error.to_string().contains("duplicate field"), "{error}");
        }
        let error = serde_json::from_str::<ChatMessage>(r#"{"content":"a"}"#).unwrap_err();
        assert!(
            error.to_string().contains("missing field `role`"),
            "{error}"
        );
        assert!(message(r#"{"role":"user"}"#).content.is_none());
        assert_eq!(
            message(r#"{"role":"user","content":null}"#).content,
            Some(Value::Null)
        );
    }

    proptest::proptest! {
        /// Any JSON as `content` or an extra field reads as serde_json's own `Value`.
        #[test]
        fn message_values_read_as_serde_json_reads_them(value in json_value()) {
            let json = serde_json::json!({"role": "user", "content": value, "x": value});
            let text = json.to_string();
            let parsed: ChatMessage = serde_json::from_str(&text).unwrap();
            proptest::prop_assert!(!parsed.repeats_a_key);
            proptest::prop_assert_eq!(parsed.content.as_ref(), Some(&value));
            proptest::prop_assert_eq!(serde_json::to_value(&parsed).unwrap(), json);
        }
    }

    fn json_value() -> impl proptest::strategy::Strategy<Value = Value> {
        use proptest::prelude::*;
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(Value::from),
            any::<u64>().prop_map(Value::from),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(Value::from),
            ".{0,12}".prop_map(Value::String),
        ];
        leaf.prop_recursive(4, 32, 6, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..6).prop_map(Value::Array),
                proptest::collection::vec(("[a-c]{1,2}", inner), 0..6)
                    .prop_map(|pairs| Value::Object(pairs.into_iter().collect())),
            ]
        })
    }

    #[test]
    fn small_bodies_and_unreadable_ones_are_serialised_as_usual() {
        let body = br#"{"model":"m","messages":[{ "role" : "user", "content" : "caf\u00e9" }]}"#;
        let client = ChatRequest::from_slice(body).unwrap();
        assert_eq!(
            client.upstream_body(body, None, false).unwrap(),
            client.to_vec()
        );

        let (_, large) = large_client_request();
        let not_the_body = vec![b' '; REUSE_FROM_BYTES];
        assert_eq!(
            large.upstream_body(&not_the_body, None, false).unwrap(),
            large.to_vec()
        );
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
