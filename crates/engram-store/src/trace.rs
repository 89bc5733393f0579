//! The W3C `traceparent` a job keeps, so the worker's span can link back to the request that
//! recorded it. Reading and writing the trace context of requests is the sidecar's
//! (`telemetry`); this is only the stored form.

use std::fmt;

use opentelemetry::Context;
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A span's identity as a W3C `traceparent` value (`00-<trace id>-<span id>-<flags>`), the form
/// a job stores. Trace state is not kept: a link needs only the ids.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceParent {
    trace_id: TraceId,
    span_id: SpanId,
    flags: TraceFlags,
}

impl TraceParent {
    /// `None` for an invalid (all-zero) span context.
    pub fn of(span: &SpanContext) -> Option<TraceParent> {
        span.is_valid().then(|| TraceParent {
            trace_id: span.trace_id(),
            span_id: span.span_id(),
            flags: span.trace_flags(),
        })
    }

    pub fn parse(value: &str) -> Option<TraceParent> {
        let mut parts = value.trim().split('-');
        let (Some("00"), Some(trace), Some(span), Some(flags), None) = (
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
            parts.next(),
        ) else {
            return None;
        };
        if trace.len() != 32 || span.len() != 16 || flags.len() != 2 {
            return None;
        }
        let parsed = TraceParent {
            trace_id: TraceId::from_hex(trace).ok()?,
            span_id: SpanId::from_hex(span).ok()?,
            flags: TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        };
        parsed.span_context().is_valid().then_some(parsed)
    }

    /// The span context to link to (remote: it was recorded elsewhere, or earlier).
    pub fn span_context(&self) -> SpanContext {
        SpanContext::new(
            self.trace_id,
            self.span_id,
            self.flags,
            true,
            TraceState::default(),
        )
    }

    pub fn trace_id(&self) -> TraceId {
        self.trace_id
    }

    pub fn span_id(&self) -> SpanId {
        self.span_id
    }

    /// The span of the current context (the request being recorded), if there is one.
    pub fn current() -> Option<TraceParent> {
        Context::map_current(|cx| TraceParent::of(cx.span().span_context()))
    }
}

impl fmt::Display for TraceParent {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "00-{:032x}-{:016x}-{:02x}",
            self.trace_id, self.span_id, self.flags
        )
    }
}

impl Serialize for TraceParent {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for TraceParent {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let text = String::deserialize(deserializer)?;
        TraceParent::parse(&text).ok_or_else(|| serde::de::Error::custom("not a W3C traceparent"))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    const VALUE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn a_traceparent_round_trips_through_text_and_json() {
        let parsed = TraceParent::parse(VALUE).unwrap();
        assert_eq!(parsed.to_string(), VALUE);
        assert_eq!(
            parsed.trace_id(),
            TraceId::from_hex("0af7651916cd43dd8448eb211c80319c").unwrap()
        );
        assert!(parsed.span_context().is_sampled());
        assert!(parsed.span_context().is_remote());
        let json = serde_json::to_string(&parsed).unwrap();
        assert_eq!(json, format!("\"{VALUE}\""));
        assert_eq!(serde_json::from_str::<TraceParent>(&json).unwrap(), parsed);
    }

    #[test]
    fn malformed_values_are_refused() {
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
            "00-0af7651916cd43dd8448eb211c8031-b7ad6b7169203331-01",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01-extra",
            "00-zzf7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad}");
        }
        assert!(serde_json::from_str::<TraceParent>("\"nope\"").is_err());
    }
}
