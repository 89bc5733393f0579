//! Server-sent events, byte-level: finding event boundaries in a stream of chunks that may cut an
//! event anywhere, and reading an event's `data` field.

use bytes::{Bytes, BytesMut};
use memchr::memmem;

/// Splits a byte stream into complete SSE events (each returned with its blank-line terminator,
/// byte for byte as received). Holds at most one incomplete event.
#[derive(Debug, Default)]
pub struct EventSplitter {
    pending: BytesMut,
}

impl EventSplitter {
    /// Feeds a chunk; returns the events it completed, in order.
    pub fn push(&mut self, chunk: &[u8]) -> Vec<Bytes> {
        let mut events = Vec::new();
        // Search only where a terminator could newly end: the last 3 old bytes plus the chunk.
        let mut search_from = self.pending.len().saturating_sub(3);
        self.pending.extend_from_slice(chunk);
        while let Some(end) = event_end(&self.pending[search_from..]) {
            let event = self.pending.split_to(search_from + end).freeze();
            events.push(event);
            search_from = 0;
        }
        events
    }

    /// Bytes of an event that never got its terminator (the stream ended mid-event).
    pub fn pending_len(&self) -> usize {
        self.pending.len()
    }

    /// Takes the unterminated tail, leaving the splitter empty.
    pub fn take_pending(&mut self) -> Bytes {
        self.pending.split().freeze()
    }
}

/// Offset just past the first blank line (`\n\n` or `\r\n\r\n`) in `bytes`.
fn event_end(bytes: &[u8]) -> Option<usize> {
    let lf = memmem::find(bytes, b"\n\n").map(|at| at + 2);
    let crlf = memmem::find(bytes, b"\r\n\r\n").map(|at| at + 4);
    match (lf, crlf) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, b) => a.or(b),
    }
}

/// The `data` field of one event: its `data:` lines with one optional leading space removed,
/// joined by newlines. `None` for events without data (comments, keep-alives).
pub fn event_data(event: &[u8]) -> Option<String> {
    let mut data: Option<String> = None;
    for line in event.split(|&byte| byte == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let Some(value) = line.strip_prefix(b"data:") else {
            continue;
        };
        let value = value.strip_prefix(b" ").unwrap_or(value);
        let value = String::from_utf8_lossy(value);
        match &mut data {
            Some(existing) => {
                existing.push('\n');
                existing.push_str(&value);
            }
            None => data = Some(value.into_owned()),
        }
    }
    data
}

/// Removes the usage that the proxy asked for on the client's behalf: the trailing usage-only
/// chunk (`"choices":[]` with a `usage` object) and the `"usage":null` that every other chunk
/// then carries. Everything else passes byte for byte; an event is held only until its end.
///
/// An event that grows past [`MAX_HELD_EVENT`] without ending is let through as it is, and so
/// is the rest of that stream: holding it would buffer without bound, and the worst a client
/// then sees is a usage chunk it did not ask for.
#[derive(Debug, Default)]
pub struct UsageStripper {
    splitter: EventSplitter,
    passing_through: bool,
}

/// The most the stripper holds back of one unfinished event.
pub const MAX_HELD_EVENT: usize = 1024 * 1024;

impl UsageStripper {
    pub fn push(&mut self, chunk: &[u8]) -> Bytes {
        if self.passing_through {
            return Bytes::copy_from_slice(chunk);
        }
        let events = self.splitter.push(chunk);
        let mut out = if events.len() == 1 {
            strip_usage(&events[0]).unwrap_or_default()
        } else {
            let mut out = BytesMut::new();
            for event in events {
                if let Some(kept) = strip_usage(&event) {
                    out.extend_from_slice(&kept);
                }
            }
            out.freeze()
        };
        if self.splitter.pending_len() > MAX_HELD_EVENT {
            self.passing_through = true;
            let mut joined = BytesMut::from(&out[..]);
            joined.extend_from_slice(&self.splitter.take_pending());
            out = joined.freeze();
        }
        out
    }

    /// Bytes held back: the unfinished event, never more than [`MAX_HELD_EVENT`].
    pub fn held_len(&self) -> usize {
        self.splitter.pending_len()
    }

    /// What is left when the stream ends: an unterminated tail, passed on as it came.
    pub fn finish(&mut self) -> Bytes {
        self.splitter.take_pending()
    }
}

const USAGE_NULL: [&[u8]; 4] = [
    b",\"usage\":null",
    b",\"usage\": null",
    b"\"usage\":null,",
    b"\"usage\": null,",
];

/// `None` drops the event.
fn strip_usage(event: &Bytes) -> Option<Bytes> {
    if memmem::find(event, b"\"usage\"").is_none() {
        return Some(event.clone());
    }
    if is_usage_only_chunk(event) {
        return None;
    }
    let mut kept = event.to_vec();
    for pattern in USAGE_NULL {
        while let Some(at) = memmem::find(&kept, pattern) {
            kept.drain(at..at + pattern.len());
        }
    }
    Some(Bytes::from(kept))
}

fn is_usage_only_chunk(event: &[u8]) -> bool {
    let Some(data) = event_data(event) else {
        return false;
    };
    let Ok(value) = serde_json::from_str::<serde_json::Value>(&data) else {
        return false;
    };
    value.get("usage").is_some_and(serde_json::Value::is_object)
        && value
            .get("choices")
            .and_then(serde_json::Value::as_array)
            .is_some_and(Vec::is_empty)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splits_events_cut_anywhere() {
        let stream = b"data: {\"a\":1}\n\n: keep-alive\n\ndata: [DONE]\r\n\r\n";
        for cut in 0..stream.len() {
            let mut splitter = EventSplitter::default();
            let mut events = splitter.push(&stream[..cut]);
            events.extend(splitter.push(&stream[cut..]));
            let joined: Vec<u8> = events.concat();
            assert_eq!(joined, stream.to_vec(), "cut at {cut}");
            assert_eq!(events.len(), 3);
            assert_eq!(splitter.pending_len(), 0);
        }
    }

    #[test]
    fn byte_by_byte_feeding_finds_every_event() {
        let stream = b"data: x\n\ndata: y\ndata: z\n\n";
        let mut splitter = EventSplitter::default();
        let events: Vec<Bytes> = stream.iter().flat_map(|b| splitter.push(&[*b])).collect();
        assert_eq!(events.len(), 2);
        assert_eq!(event_data(&events[1]).as_deref(), Some("y\nz"));
    }

    #[test]
    fn reads_data_and_ignores_comments() {
        assert_eq!(event_data(b"data: hello\n\n").as_deref(), Some("hello"));
        assert_eq!(event_data(b"data:hello\r\n\r\n").as_deref(), Some("hello"));
        assert_eq!(event_data(b": comment\n\n"), None);
        assert_eq!(event_data(b"event: x\ndata: 1\n\n").as_deref(), Some("1"));
    }

    #[test]
    fn unterminated_tail_is_kept() {
        let mut splitter = EventSplitter::default();
        assert!(splitter.push(b"data: partial").is_empty());
        assert_eq!(splitter.pending_len(), 13);
        assert_eq!(&splitter.take_pending()[..], b"data: partial");
        assert_eq!(splitter.pending_len(), 0);
    }
}

#[cfg(test)]
mod stripper_tests {
    use super::*;

    #[test]
    fn an_event_that_never_ends_is_let_through_not_buffered() {
        let mut stripper = UsageStripper::default();
        let mut out = stripper.push(b"data: {\"a\":1,\"usage\":null}\n\ndata: ");
        assert_eq!(&out[..], b"data: {\"a\":1}\n\n");
        let blob = vec![b'x'; 64 * 1024];
        let mut sent = 6;
        while stripper.held_len() + blob.len() <= MAX_HELD_EVENT {
            out = stripper.push(&blob);
            assert!(out.is_empty());
            sent += blob.len();
        }
        // The push that crosses the cap releases everything held, and later bytes pass as sent.
        out = stripper.push(&blob);
        assert_eq!(out.len(), sent + blob.len());
        assert_eq!(stripper.held_len(), 0);
        let tail = b"\n\ndata: {\"choices\":[],\"usage\":{\"total_tokens\":2}}\n\n";
        assert_eq!(&stripper.push(tail)[..], tail);
    }

    #[test]
    fn drops_the_usage_chunk_and_null_usage_fields_only() {
        let upstream = concat!(
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n",
            "data: {\"id\":\"a\",\"choices\":[],\"usage\":{\"prompt_tokens\":1,\"completion_tokens\":1,\"total_tokens\":2}}\n\n",
            "data: [DONE]\n\n",
        );
        let expected = concat!(
            "data: {\"id\":\"a\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}]}\n\n",
            "data: [DONE]\n\n",
        );
        for cut in 1..upstream.len() {
            let mut stripper = UsageStripper::default();
            let mut out = Vec::new();
            for piece in upstream.as_bytes().chunks(cut) {
                out.extend_from_slice(&stripper.push(piece));
            }
            out.extend_from_slice(&stripper.finish());
            assert_eq!(String::from_utf8(out).unwrap(), expected, "cut {cut}");
        }
    }

    #[test]
    fn content_mentioning_usage_is_untouched() {
        let event = "data: {\"choices\":[{\"index\":0,\"delta\":{\"content\":\"the \\\"usage\\\" word\"}}]}\n\n";
        let mut stripper = UsageStripper::default();
        assert_eq!(&stripper.push(event.as_bytes())[..], event.as_bytes());
    }
}
