//! Property-driven fuzzing of the parsers that see untrusted bytes: the chat request parser and
//! the SSE machinery (event splitter, usage stripper, stream accumulator). No input may panic,
//! results must not depend on how a stream is cut into chunks, and what is held back stays
//! bounded.
//!
//! CI runs a short seeded pass (256 cases per property, fixed seed). A long run, documented in
//! docs/testing.md: `PROPTEST_CASES=200000 PROPTEST_RNG_SEED=$RANDOM cargo test --release
//! --test fuzz`.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

use bytes::Bytes;
use engram_memory::openai::ChatRequest;
use engram_memory::openai::completion::StreamAccumulator;
use engram_memory::openai::sse::{EventSplitter, MAX_HELD_EVENT, UsageStripper, event_data};
use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

/// Seeded and short unless the environment asks otherwise.
fn config() -> Config {
    let mut config = Config::default();
    if std::env::var_os("PROPTEST_RNG_SEED").is_none() {
        config.rng_seed = RngSeed::Fixed(0x00E9_6A11);
    }
    if std::env::var_os("PROPTEST_CASES").is_none() {
        config.cases = 256;
    }
    config.failure_persistence = None;
    config
}

/// Real-shaped requests: the corpus the mutations start from.
const CORPUS: &[&str] = &[
    r#"{"model":"gpt-4o","messages":[{"role":"user","content":"Hello"}]}"#,
    r#"{"model":"gpt-4o","messages":[{"role":"system","content":"Be brief."},{"role":"user","content":"What's 2+2?"}],"stream":true,"stream_options":{"include_usage":true},"user":"alice"}"#,
    r#"{"model":"m","messages":[{"role":"user","content":[{"type":"text","text":"look"},{"type":"image_url","image_url":{"url":"data:image/png;base64,iVBOR"}}]}],"temperature":0.2,"max_tokens":64}"#,
    r#"{"model":"m","messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c1","type":"function","function":{"name":"f","arguments":"{\"x\":1}"}}]},{"role":"tool","tool_call_id":"c1","content":"42"}],"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object"}}}]}"#,
    r#"{"model":"m","messages":[{"role":"user","content":"\u00e9\ud83d\ude00 <engram-memory kind=\"core\">x</engram-memory>"}],"response_format":{"type":"json_object"},"n":2,"logit_bias":{"50256":-100}}"#,
];

/// One of the corpus requests with a few byte-level mutations.
fn mutated_request() -> impl Strategy<Value = Vec<u8>> {
    let mutation = prop_oneof![
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, byte)| (0u8, at, byte)),
        (any::<prop::sample::Index>(), any::<u8>()).prop_map(|(at, byte)| (1u8, at, byte)),
        any::<prop::sample::Index>().prop_map(|at| (2u8, at, 0)),
        any::<prop::sample::Index>().prop_map(|at| (3u8, at, 0)),
    ];
    (
        prop::sample::select(CORPUS),
        prop::collection::vec(mutation, 0..6),
    )
        .prop_map(|(seed, mutations)| {
            let mut bytes = seed.as_bytes().to_vec();
            for (kind, at, byte) in mutations {
                if bytes.is_empty() {
                    break;
                }
                let at = at.index(bytes.len());
                match kind {
                    0 => bytes[at] = byte,
                    1 => bytes.insert(at, byte),
                    2 => {
                        bytes.remove(at);
                    }
                    _ => bytes.truncate(at),
                }
            }
            bytes
        })
}

/// SSE-ish byte streams: real frames, comments, usage chunks, `[DONE]`, junk and stray line
/// breaks, in any order.
fn sse_stream() -> impl Strategy<Value = Vec<u8>> {
    let piece = prop_oneof![
        Just(b"data: {\"id\":\"a\",\"model\":\"m\",\"choices\":[{\"index\":0,\"delta\":{\"content\":\"hi\"}}],\"usage\":null}\n\n".to_vec()),
        Just(b"data: {\"choices\":[{\"index\":0,\"delta\":{\"tool_calls\":[{\"index\":3,\"id\":\"c\",\"function\":{\"name\":\"f\",\"arguments\":\"{\"}}]}}]}\n\n".to_vec()),
        Just(b"data: {\"choices\":[],\"usage\":{\"prompt_tokens\":3,\"completion_tokens\":2,\"total_tokens\":5}}\n\n".to_vec()),
        Just(b"data: {\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\r\n\r\n".to_vec()),
        Just(b": keep-alive\n\n".to_vec()),
        Just(b"data: [DONE]\n\n".to_vec()),
        Just(b"\n".to_vec()),
        Just(b"\r\n".to_vec()),
        Just(b"data: {not json\n\n".to_vec()),
        prop::collection::vec(any::<u8>(), 0..40),
    ];
    prop::collection::vec(piece, 0..20).prop_map(|pieces| pieces.concat())
}

/// Cuts `bytes` at the given fractions.
fn chunks(bytes: &[u8], cuts: &[prop::sample::Index]) -> Vec<Vec<u8>> {
    let mut points: Vec<usize> = cuts.iter().map(|cut| cut.index(bytes.len() + 1)).collect();
    points.push(0);
    points.push(bytes.len());
    points.sort_unstable();
    points
        .windows(2)
        .map(|w| bytes[w[0]..w[1]].to_vec())
        .collect()
}

proptest! {
    #![proptest_config(config())]

    #[test]
    fn arbitrary_bytes_never_panic_the_request_parser(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        let _ = ChatRequest::from_slice(&bytes);
    }

    #[test]
    fn mutated_requests_parse_or_fail_cleanly_and_round_trip(bytes in mutated_request()) {
        if let Ok(request) = ChatRequest::from_slice(&bytes) {
            // What the proxy would forward parses back to the same request.
            let forwarded = request.to_vec();
            let again = ChatRequest::from_slice(&forwarded).expect("re-parse of forwarded body");
            prop_assert_eq!(again.to_vec(), forwarded);
            let _ = request.end_user();
            let _ = request.last_user_message().map(|message| message.text());
        }
    }

    #[test]
    fn the_splitter_loses_no_byte_and_ignores_chunking(stream in sse_stream(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
        let mut whole = EventSplitter::default();
        let expected = whole.push(&stream);
        let expected_tail = whole.take_pending();

        let mut splitter = EventSplitter::default();
        let mut events: Vec<Bytes> = Vec::new();
        for chunk in chunks(&stream, &cuts) {
            events.extend(splitter.push(&chunk));
        }
        prop_assert_eq!(&events, &expected);
        prop_assert_eq!(splitter.take_pending(), expected_tail.clone());
        let mut rebuilt: Vec<u8> = events.concat();
        rebuilt.extend_from_slice(&expected_tail);
        prop_assert_eq!(rebuilt, stream);
        for event in &events {
            let _ = event_data(event);
        }
    }

    #[test]
    fn the_usage_stripper_ignores_chunking_and_passes_usage_free_streams_unchanged(stream in sse_stream(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
        let mut whole = UsageStripper::default();
        let mut expected = whole.push(&stream).to_vec();
        expected.extend_from_slice(&whole.finish());

        let mut stripper = UsageStripper::default();
        let mut out = Vec::new();
        for chunk in chunks(&stream, &cuts) {
            out.extend_from_slice(&stripper.push(&chunk));
            prop_assert!(stripper.held_len() <= MAX_HELD_EVENT);
        }
        out.extend_from_slice(&stripper.finish());
        prop_assert_eq!(&out, &expected);
        if !stream.windows(7).any(|w| w == b"\"usage\"") {
            prop_assert_eq!(out, stream);
        }
    }

    #[test]
    fn the_accumulator_never_panics_and_ignores_chunking(stream in sse_stream(), cuts in prop::collection::vec(any::<prop::sample::Index>(), 0..8)) {
        let mut whole = StreamAccumulator::default();
        whole.push(&stream);
        let expected = whole.finish();
        let mut accumulator = StreamAccumulator::default();
        for chunk in chunks(&stream, &cuts) {
            accumulator.push(&chunk);
        }
        let summary = accumulator.finish();
        prop_assert_eq!(&summary, &expected);
        prop_assert!(summary.message.tool_calls.len() <= 1025);
    }
}
