//! W3C trace context: read from a client's headers and written into the upstream's. A job
//! keeps its request's span as an `engram_store::TraceParent`, so the worker's span can link
//! back to the request that recorded it.

use http::HeaderMap;
use opentelemetry::Context;
use opentelemetry::propagation::TextMapPropagator;
use opentelemetry_http::{HeaderExtractor, HeaderInjector};
use opentelemetry_sdk::propagation::TraceContextPropagator;

/// The headers of the W3C trace context.
pub const TRACEPARENT: &str = "traceparent";
pub const TRACESTATE: &str = "tracestate";

/// The caller's context from `traceparent`/`tracestate`; an empty context (a new trace) when
/// they are absent or malformed.
pub fn extract(headers: &HeaderMap) -> Context {
    TraceContextPropagator::new().extract(&HeaderExtractor(headers))
}

/// Replaces any trace context in `headers` (the client's, forwarded) with `cx`'s span.
pub fn inject(cx: &Context, headers: &mut HeaderMap) {
    headers.remove(TRACEPARENT);
    headers.remove(TRACESTATE);
    TraceContextPropagator::new().inject_context(cx, &mut HeaderInjector(headers));
    // The propagator writes an empty `tracestate` when there is none.
    if headers
        .get(TRACESTATE)
        .is_some_and(|value| value.is_empty())
    {
        headers.remove(TRACESTATE);
    }
}

#[cfg(test)]
mod tests {
    use engram_store::TraceParent;
    use opentelemetry::trace::TraceContextExt;

    use super::*;

    const VALUE: &str = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";

    #[test]
    fn the_client_context_is_read_and_replaced_on_the_way_up() {
        let mut headers = HeaderMap::new();
        headers.insert(TRACEPARENT, VALUE.parse().unwrap());
        headers.insert(TRACESTATE, "vendor=1".parse().unwrap());
        let cx = extract(&headers);
        let caller = cx.span().span_context().clone();
        assert_eq!(TraceParent::of(&caller).unwrap().to_string(), VALUE);
        assert_eq!(caller.trace_state().header(), "vendor=1");

        let ours =
            TraceParent::parse("00-0af7651916cd43dd8448eb211c80319c-00f067aa0ba902b7-01").unwrap();
        let cx = Context::new().with_remote_span_context(ours.span_context());
        inject(&cx, &mut headers);
        assert_eq!(headers[TRACEPARENT], ours.to_string().as_str());
        assert!(headers.get(TRACESTATE).is_none());
        // A caller's trace state travels on with the trace.
        inject(
            &Context::new().with_remote_span_context(caller),
            &mut headers,
        );
        assert_eq!(headers[TRACESTATE], "vendor=1");
        assert_eq!(headers.get_all(TRACEPARENT).iter().count(), 1);
    }

    #[test]
    fn without_headers_a_new_trace_starts() {
        let cx = extract(&HeaderMap::new());
        assert!(!cx.span().span_context().is_valid());
    }
}
