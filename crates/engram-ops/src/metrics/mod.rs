//! Prometheus metrics, served at `GET /metrics` in the text exposition format.
//!
//! One [`Metrics`] per running engram, owning its own [`Registry`] rather than the crate's
//! process-global one: two engrams in one process (tests, an embedding app) each count their own
//! traffic, and nothing registered by a library engram links ends up on our page.
//!
//! Hot path: every labelled series a request touches is resolved once, here, at start-up, and
//! kept as a plain handle (an `Arc` around atomics); a request only adds to atomics — no label
//! lookup, no allocation. Counts the rest of engram already keeps (the worker's and the outbox's
//! stats) are read when scraped instead of being counted twice (see `queue.rs`).
//!
//! Each part of engram gets only its own handles: [`HttpMetrics`] and [`MemoryMetrics`] the
//! server, [`WorkerMetrics`] the worker, [`SummarizerMetrics`] the summarizer, [`MeteredStore`]
//! wraps the store. The metric table is in `docs/operations.md`.

mod http;
mod memory;
mod queue;
mod store;

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, Opts,
    Registry, TextEncoder,
};

use crate::error::{Error, Result};
pub use engram_proxy::ratelimit::{RateLimitKind, RateLimitMetrics};
use engram_proxy::recorder::outbox::Outbox;
use engram_proxy::summarizer;
use engram_proxy::worker::Worker;
use engram_store::Store;

pub use engram_proxy::summarizer::SummarizerMetrics;
pub use engram_proxy::worker::WorkerMetrics;
pub use http::{HttpMetrics, Route, Timing};
pub use memory::MemoryMetrics;
pub use store::MeteredStore;

/// The content type of the text exposition format.
pub const CONTENT_TYPE: &str = prometheus::TEXT_FORMAT;

/// How long a scrape waits for the store's queue depth; past it the gauge keeps its last value,
/// so a dead store never holds up `/metrics`.
pub const QUEUE_DEPTH_TIMEOUT: Duration = Duration::from_millis(250);

pub struct Metrics {
    registry: Registry,
    pub http: HttpMetrics,
    pub memory: MemoryMetrics,
    pub worker: WorkerMetrics,
    pub summarizer: SummarizerMetrics,
    pub rate_limits: RateLimitMetrics,
    store: store::StoreFamilies,
    queue_depth: IntGauge,
    /// Where the queue depth is read from on a scrape; set by [`Metrics::watch`].
    queue: OnceLock<Arc<dyn Store>>,
}

impl Metrics {
    pub fn new() -> Result<Metrics> {
        let registry = Registry::new();
        let build = IntGauge::with_opts(
            Opts::new("engram_build_info", "Always 1; the version is a label.")
                .const_label("version", env!("CARGO_PKG_VERSION")),
        )
        .map_err(metrics_error)?;
        build.set(1);
        register(&registry, build)?;
        let rate_limited = counter_vec(
            &registry,
            "engram_rate_limited_total",
            "Requests (kind=requests) and summarizer calls (kind=summarizer_tokens) turned away by engram's own rate limits.",
            &["kind"],
        )?;
        let rate_limits = RateLimitMetrics::new(try_array(|index| {
            child(&rate_limited, &[RateLimitKind::ALL[index].as_str()])
        })?);
        let queue_depth = IntGauge::new(
            "engram_queue_depth",
            "Jobs queued or leased in the store, all users (the last value read; refreshed on each scrape).",
        )
        .map_err(metrics_error)?;
        register(&registry, queue_depth.clone())?;
        Ok(Metrics {
            http: HttpMetrics::new(&registry)?,
            memory: MemoryMetrics::new(&registry)?,
            worker: WorkerMetrics::new(
                histogram(
                    &registry,
                    "engram_job_lag_seconds",
                    "From a request's arrival to its exchange being applied to memory by the worker (recording, queue wait, summarizer, commit).",
                    LAG_BUCKETS,
                )?,
                histogram(
                    &registry,
                    "engram_worker_apply_seconds",
                    "The worker's time per applied job: its run's extraction, engine pass, encoding and commit, shared among the run's jobs.",
                    STORE_BUCKETS,
                )?,
            ),
            summarizer: summarizer_metrics(&registry)?,
            store: store::StoreFamilies::new(&registry)?,
            rate_limits,
            queue_depth,
            queue: OnceLock::new(),
            registry,
        })
    }

    /// Counts one rejection by engram's rate limits (`engram_rate_limited_total{kind}`).
    pub fn rate_limited(&self, kind: RateLimitKind) {
        self.rate_limits.rejected(kind);
    }

    /// Wraps `store` so its operations are timed and its errors counted under
    /// `backend` (`embedded`, `redis`, `spool`).
    pub fn metered_store(
        &self,
        store: Arc<dyn Store>,
        backend: &'static str,
    ) -> Result<Arc<dyn Store>> {
        Ok(Arc::new(MeteredStore::new(store, &self.store, backend)?))
    }

    /// Exports what the outbox and the worker count themselves, and reads the queue depth from
    /// `store` on each scrape. Call once.
    pub fn watch(
        &self,
        store: Arc<dyn Store>,
        outbox: Arc<Outbox>,
        worker: Option<Arc<Worker>>,
    ) -> Result<()> {
        let collector = queue::StatsCollector::new(outbox, worker)?;
        self.registry
            .register(Box::new(collector))
            .map_err(metrics_error)?;
        let _ = self.queue.set(store);
        Ok(())
    }

    /// The metrics page. Refreshes the queue depth first, waiting at most
    /// [`QUEUE_DEPTH_TIMEOUT`].
    pub async fn render(&self) -> Result<String> {
        if let Some(store) = self.queue.get() {
            match tokio::time::timeout(QUEUE_DEPTH_TIMEOUT, store.queue_depth()).await {
                Ok(Ok(depth)) => self
                    .queue_depth
                    .set(i64::try_from(depth).unwrap_or(i64::MAX)),
                Ok(Err(error)) => {
                    tracing::debug!(%error, "queue depth unavailable for /metrics");
                }
                Err(_) => tracing::debug!("queue depth read timed out for /metrics"),
            }
        }
        let mut page = Vec::with_capacity(16 * 1024);
        TextEncoder::new()
            .encode(&self.registry.gather(), &mut page)
            .map_err(metrics_error)?;
        String::from_utf8(page).map_err(|error| Error::Internal(format!("metrics page: {error}")))
    }
}

/// The summarizer's counters, registered.
fn summarizer_metrics(registry: &Registry) -> Result<SummarizerMetrics> {
    let failures = counter_vec(
        registry,
        "engram_summarizer_failures_total",
        "Summarizer extractions that could not use the model (the heuristic extraction stood in), by reason.",
        &["reason"],
    )?;
    let tokens = counter_vec(
        registry,
        "engram_summarizer_tokens_total",
        "Tokens the summarizer model reported using, by kind (prompt, completion).",
        &["kind"],
    )?;
    Ok(SummarizerMetrics::new(
        counter(
            registry,
            "engram_summarizer_calls_total",
            "HTTP calls to the summarizer model (an invalid-JSON reply is retried once: two calls).",
        )?,
        try_array(|index| child(&failures, &[summarizer::FAILURES[index].as_str()]))?,
        try_array(|index| child(&tokens, &[if index == 0 { "prompt" } else { "completion" }]))?,
        histogram(
            registry,
            "engram_summarizer_latency_seconds",
            "One summarizer call, sent to its whole reply read (or its failure).",
            MODEL_BUCKETS,
        )?,
    ))
}

fn metrics_error(error: prometheus::Error) -> Error {
    Error::Internal(format!("metrics: {error}"))
}

fn register<C: prometheus::core::Collector + 'static>(registry: &Registry, c: C) -> Result<()> {
    registry.register(Box::new(c)).map_err(metrics_error)
}

fn counter(registry: &Registry, name: &str, help: &str) -> Result<IntCounter> {
    let counter = IntCounter::new(name, help).map_err(metrics_error)?;
    register(registry, counter.clone())?;
    Ok(counter)
}

fn counter_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
) -> Result<IntCounterVec> {
    let family = IntCounterVec::new(Opts::new(name, help), labels).map_err(metrics_error)?;
    register(registry, family.clone())?;
    Ok(family)
}

fn histogram(registry: &Registry, name: &str, help: &str, buckets: &[f64]) -> Result<Histogram> {
    let histogram = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets.to_vec()))
        .map_err(metrics_error)?;
    register(registry, histogram.clone())?;
    Ok(histogram)
}

fn histogram_vec(
    registry: &Registry,
    name: &str,
    help: &str,
    labels: &[&str],
    buckets: &[f64],
) -> Result<HistogramVec> {
    let family = HistogramVec::new(
        HistogramOpts::new(name, help).buckets(buckets.to_vec()),
        labels,
    )
    .map_err(metrics_error)?;
    register(registry, family.clone())?;
    Ok(family)
}

/// The series of `family` with these label values, resolved once.
fn child<T: prometheus::core::MetricVecBuilder>(
    family: &prometheus::core::MetricVec<T>,
    values: &[&str],
) -> Result<T::M> {
    family
        .get_metric_with_label_values(values)
        .map_err(metrics_error)
}

/// An array whose elements are built, in order, by a fallible function of their index.
fn try_array<T, const N: usize>(mut make: impl FnMut(usize) -> Result<T>) -> Result<[T; N]> {
    let items = (0..N).map(&mut make).collect::<Result<Vec<T>>>()?;
    items
        .try_into()
        .map_err(|_| Error::Internal("metrics: wrong number of series".into()))
}

/// Engram's own time (the proxy overhead): fine-grained where it should live, below a
/// millisecond.
const OVERHEAD_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_15, 0.000_2, 0.000_3, 0.000_5, 0.000_75, 0.001, 0.0015, 0.002, 0.003,
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
];
/// A model's time: the upstream, time to first token, the summarizer.
const MODEL_BUCKETS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0,
];
/// One store operation: a local redb read to a slow Redis round trip.
const STORE_BUCKETS: &[f64] = &[
    0.000_05, 0.000_1, 0.000_25, 0.000_5, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5,
];
/// From a request to its job being applied: the request itself, the queue, the summarizer.
const LAG_BUCKETS: &[f64] = &[
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
];
/// Tokens of one memory block.
const TOKEN_BUCKETS: &[f64] = &[
    0.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0, 8192.0,
];

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn two_instances_do_not_share_series_and_the_page_is_text_format() {
        let first = Metrics::new().unwrap();
        let second = Metrics::new().unwrap();
        first.rate_limited(RateLimitKind::Requests);
        first.rate_limited(RateLimitKind::Requests);
        second.rate_limited(RateLimitKind::SummarizerTokens);
        let page = first.render().await.unwrap();
        assert!(
            page.contains("engram_rate_limited_total{kind=\"requests\"} 2"),
            "{page}"
        );
        assert!(page.contains("engram_rate_limited_total{kind=\"summarizer_tokens\"} 0"));
        assert!(page.contains("# TYPE engram_proxy_overhead_seconds histogram"));
        assert!(page.contains("engram_build_info{version="));
        let page = second.render().await.unwrap();
        assert!(page.contains("engram_rate_limited_total{kind=\"summarizer_tokens\"} 1"));
        assert!(page.contains("engram_rate_limited_total{kind=\"requests\"} 0"));
    }

    #[test]
    fn buckets_ascend() {
        for buckets in [
            OVERHEAD_BUCKETS,
            MODEL_BUCKETS,
            STORE_BUCKETS,
            LAG_BUCKETS,
            TOKEN_BUCKETS,
        ] {
            assert!(
                buckets.windows(2).all(|pair| pair[0] < pair[1]),
                "{buckets:?}"
            );
        }
    }
}
