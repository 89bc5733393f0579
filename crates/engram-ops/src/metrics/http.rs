//! Requests by route, status class and memory outcome; engram's own time per request (the
//! overhead), the upstream's, and the time to the first body frame.

use std::time::Instant;

use http::{HeaderMap, StatusCode};
use prometheus::{Histogram, IntCounter, Registry};

use super::{MODEL_BUCKETS, OVERHEAD_BUCKETS, child, counter_vec, histogram_vec, try_array};
use crate::error::Result;
use engram_proxy::recorder::tee::FirstFrame;

/// The route label: what the router dispatched a request to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Route {
    ChatCompletions,
    /// Every other `/v1/*` route.
    Passthrough,
    Admin,
    /// `/healthz` and `/readyz`.
    Health,
    Metrics,
    NotFound,
}

impl Route {
    pub const ALL: [Route; 6] = [
        Route::ChatCompletions,
        Route::Passthrough,
        Route::Admin,
        Route::Health,
        Route::Metrics,
        Route::NotFound,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Route::ChatCompletions => "chat_completions",
            Route::Passthrough => "passthrough",
            Route::Admin => "admin",
            Route::Health => "health",
            Route::Metrics => "metrics",
            Route::NotFound => "not_found",
        }
    }

    /// Index among the routes that go upstream (the overhead and upstream histograms).
    fn proxied(self) -> Option<usize> {
        match self {
            Route::ChatCompletions => Some(0),
            Route::Passthrough => Some(1),
            _ => None,
        }
    }
}

const STATUS_CLASSES: [&str; 5] = ["1xx", "2xx", "3xx", "4xx", "5xx"];
/// The `memory` label: the `x-engram-memory` header of the answer, `none` without one.
const MEMORY_OUTCOMES: [&str; 4] = ["injected", "skipped", "degraded", "none"];
const PROXIED: [Route; 2] = [Route::ChatCompletions, Route::Passthrough];

/// The moments of one proxied request that split engram's time from the upstream's.
#[derive(Debug, Clone, Copy)]
pub struct Timing {
    arrived: Instant,
    sent: Option<Instant>,
    answered: Option<Instant>,
}

impl Timing {
    /// The request arrived (the handler started).
    pub fn start() -> Timing {
        Timing {
            arrived: Instant::now(),
            sent: None,
            answered: None,
        }
    }

    /// The upstream request is about to be sent.
    pub fn sent(&mut self) {
        self.sent = Some(Instant::now());
    }

    /// The upstream's response headers arrived.
    pub fn answered(&mut self) {
        self.answered = Some(Instant::now());
    }

    /// Engram's time: arrival → upstream request sent, plus upstream headers → `now`; and the
    /// upstream's: sent → headers. `None` unless the upstream answered.
    fn split(&self, now: Instant) -> Option<(f64, f64)> {
        let (sent, answered) = (self.sent?, self.answered?);
        let before = sent.saturating_duration_since(self.arrived);
        let after = now.saturating_duration_since(answered);
        let upstream = answered.saturating_duration_since(sent);
        Some(((before + after).as_secs_f64(), upstream.as_secs_f64()))
    }
}

#[derive(Clone)]
pub struct HttpMetrics {
    /// Chat completions by [status class][memory outcome].
    chat: [[IntCounter; 4]; 5],
    /// The other routes by [route − 1][status class].
    other: [[IntCounter; 5]; 5],
    /// By [`Route::proxied`].
    overhead: [Histogram; 2],
    upstream: [Histogram; 2],
    /// By `stream` (false, true).
    first_frame: [Histogram; 2],
}

impl HttpMetrics {
    pub(super) fn new(registry: &Registry) -> Result<HttpMetrics> {
        let requests = counter_vec(
            registry,
            "engram_requests_total",
            "Requests answered, by route, status class and memory outcome (x-engram-memory; none where memory does not apply).",
            &["route", "status", "memory"],
        )?;
        let chat = try_array(|class| {
            try_array(|outcome| {
                child(
                    &requests,
                    &[
                        Route::ChatCompletions.as_str(),
                        STATUS_CLASSES[class],
                        MEMORY_OUTCOMES[outcome],
                    ],
                )
            })
        })?;
        let other = try_array(|route| {
            try_array(|class| {
                child(
                    &requests,
                    &[
                        Route::ALL[route + 1].as_str(),
                        STATUS_CLASSES[class],
                        "none",
                    ],
                )
            })
        })?;
        let overhead = histogram_vec(
            registry,
            "engram_proxy_overhead_seconds",
            "Time spent in engram per proxied request, excluding the upstream: arrival to upstream request sent, plus upstream response headers to the response handed back.",
            &["route"],
            OVERHEAD_BUCKETS,
        )?;
        let upstream = histogram_vec(
            registry,
            "engram_upstream_latency_seconds",
            "Upstream request sent to its response headers received.",
            &["route"],
            MODEL_BUCKETS,
        )?;
        let first_frame = histogram_vec(
            registry,
            "engram_time_to_first_token_seconds",
            "Chat completion arrival to the first body frame forwarded to the client (the first token of a stream).",
            &["stream"],
            MODEL_BUCKETS,
        )?;
        Ok(HttpMetrics {
            chat,
            other,
            overhead: try_array(|index| child(&overhead, &[PROXIED[index].as_str()]))?,
            upstream: try_array(|index| child(&upstream, &[PROXIED[index].as_str()]))?,
            first_frame: try_array(|index| {
                child(&first_frame, &[if index == 1 { "true" } else { "false" }])
            })?,
        })
    }

    /// Counts an answered request.
    pub fn count(&self, route: Route, status: StatusCode, headers: &HeaderMap) {
        let class = usize::from(status.as_u16() / 100).clamp(1, 5) - 1;
        let counter = match route {
            Route::ChatCompletions => &self.chat[class][memory_outcome(headers)],
            // `Route::ALL` is in declaration order, chat completions first.
            other => &self.other[other as usize - 1][class],
        };
        counter.inc();
    }

    /// Observes the overhead and the upstream latency of a proxied request whose response is
    /// being handed back now.
    pub fn observe(&self, route: Route, timing: &Timing) {
        let (Some(index), Some((overhead, upstream))) =
            (route.proxied(), timing.split(Instant::now()))
        else {
            return;
        };
        self.overhead[index].observe(overhead);
        self.upstream[index].observe(upstream);
    }

    /// A timer for the first body frame of a chat completion that arrived at `timing`.
    pub fn first_frame(&self, timing: &Timing, stream: bool) -> FirstFrame {
        FirstFrame::new(
            timing.arrived,
            self.first_frame[usize::from(stream)].clone(),
        )
    }
}

fn memory_outcome(headers: &HeaderMap) -> usize {
    match headers.get("x-engram-memory").map(|value| value.as_bytes()) {
        Some(b"injected") => 0,
        Some(b"skipped") => 1,
        Some(b"degraded") => 2,
        _ => 3,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn overhead_excludes_the_upstream_time() {
        let arrived = Instant::now();
        let timing = Timing {
            arrived,
            sent: Some(arrived + Duration::from_micros(300)),
            answered: Some(arrived + Duration::from_millis(800)),
        };
        let (overhead, upstream) = timing
            .split(arrived + Duration::from_micros(800_200))
            .unwrap();
        assert!((overhead - 0.000_5).abs() < 1e-9, "{overhead}");
        assert!((upstream - 0.799_7).abs() < 1e-9, "{upstream}");
        // No upstream answer, no observation.
        let mut unanswered = Timing::start();
        unanswered.sent();
        assert_eq!(unanswered.split(Instant::now()), None);
    }

    #[test]
    fn requests_are_counted_by_route_class_and_memory_outcome() {
        let registry = Registry::new();
        let metrics = HttpMetrics::new(&registry).unwrap();
        let mut headers = HeaderMap::new();
        headers.insert("x-engram-memory", "degraded".parse().unwrap());
        metrics.count(Route::ChatCompletions, StatusCode::OK, &headers);
        metrics.count(
            Route::ChatCompletions,
            StatusCode::BAD_GATEWAY,
            &HeaderMap::new(),
        );
        // A passthrough answer's header (from an upstream engram, say) is not ours.
        metrics.count(Route::Passthrough, StatusCode::NOT_FOUND, &headers);
        metrics.count(Route::NotFound, StatusCode::NOT_FOUND, &HeaderMap::new());
        metrics.count(
            Route::Health,
            StatusCode::SERVICE_UNAVAILABLE,
            &HeaderMap::new(),
        );
        assert_eq!(metrics.chat[1][2].get(), 1);
        assert_eq!(metrics.chat[4][3].get(), 1);
        assert_eq!(metrics.other[0][3].get(), 1);
        assert_eq!(metrics.other[4][3].get(), 1);
        assert_eq!(metrics.other[2][4].get(), 1);
        let total: u64 = registry
            .gather()
            .iter()
            .flat_map(|family| family.get_metric().iter())
            .map(|metric| metric.get_counter().get_value() as u64)
            .sum();
        assert_eq!(total, 5);
    }
}
