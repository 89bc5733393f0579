//! OpenTelemetry traces with the GenAI semantic conventions; see `docs/operations.md#traces`.
//!
//! A [`Telemetry`] handle is cloned into the server, the memory layer and the worker. Tracing is
//! off unless an OTLP endpoint is configured: the handle is then empty, every call on it (and on
//! the [`RequestTrace`] and [`SpanGuard`] it hands out) is one branch, and the hot path builds
//! no attribute and allocates nothing. When on, finished spans go to the provider the handle was
//! built with ([`Telemetry::with_provider`]): operations (`engram_ops::telemetry`) build one
//! with a batch processor on the tokio runtime that exports them over OTLP/HTTP (protobuf,
//! through hyper); [`Telemetry::shutdown`] flushes it at the end of a graceful shutdown.

mod config;
mod propagation;
mod spans;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use engram_store::TraceParent;
use opentelemetry::context::FutureExt as _;
use opentelemetry::trace::{Link, SpanKind, TraceContextExt, Tracer as _, TracerProvider as _};
use opentelemetry::{Context, InstrumentationScope, KeyValue, StringValue};
use opentelemetry_sdk::trace::{SdkTracer, SdkTracerProvider};

pub use config::{ENDPOINT_ENV, TRACES_ENDPOINT_ENV, TelemetryConfig};
pub use propagation::{TRACEPARENT, TRACESTATE};
pub use spans::{MemorySpan, RequestTrace, SpanGuard, attributes};

/// How long shutdown waits for the last spans to be exported.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// Tracing, or nothing: cheap to clone; `Default` is off.
#[derive(Clone, Default)]
pub struct Telemetry {
    inner: Option<Arc<Tracing>>,
}

struct Tracing {
    provider: SdkTracerProvider,
    tracer: SdkTracer,
    /// `gen_ai.provider.name`.
    provider_name: StringValue,
    capture_content: bool,
}

impl Telemetry {
    /// Tracing into a provider the caller built (tests use an in-memory exporter); sampling and
    /// export are the provider's, the rest comes from `config`.
    pub fn with_provider(provider: SdkTracerProvider, config: &TelemetryConfig) -> Telemetry {
        let scope = InstrumentationScope::builder("engram")
            .with_version(env!("CARGO_PKG_VERSION"))
            .build();
        let tracer = provider.tracer_with_scope(scope);
        Telemetry {
            inner: Some(Arc::new(Tracing {
                provider,
                tracer,
                provider_name: config.provider_name.clone().into(),
                capture_content: config.capture_content,
            })),
        }
    }

    pub fn is_enabled(&self) -> bool {
        self.inner.is_some()
    }

    /// Exports what is left and stops the exporter; later spans are dropped. Waits at most a
    /// few seconds for a slow collector.
    pub async fn shutdown(&self) {
        let Some(tracing) = &self.inner else { return };
        let provider = tracing.provider.clone();
        // The SDK blocks the calling thread until its export task (on this runtime) is done.
        let flushed = tokio::task::spawn_blocking(move || provider.shutdown());
        match tokio::time::timeout(SHUTDOWN_TIMEOUT, flushed).await {
            Ok(Ok(Ok(()))) => {}
            Ok(Ok(Err(error))) => tracing::warn!(%error, "flushing traces failed"),
            Ok(Err(error)) => tracing::warn!(%error, "flushing traces failed"),
            Err(_) => tracing::warn!("flushing traces timed out; the last spans may be lost"),
        }
    }

    /// A span for a child step of whatever request is current (memory load, compose, record);
    /// nothing when tracing is off or the request is not sampled.
    pub fn child(&self, name: &'static str) -> SpanGuard {
        let Some(tracing) = &self.inner else {
            return SpanGuard::off();
        };
        Context::map_current(|cx| {
            // Sampled rather than recording: the record step starts after the request span
            // has ended.
            if !cx.span().span_context().is_sampled() {
                return SpanGuard::off();
            }
            SpanGuard::on(
                tracing
                    .tracer
                    .span_builder(name)
                    .with_kind(SpanKind::Internal)
                    .start_with_context(&tracing.tracer, cx),
            )
        })
    }

    /// Names the conversation (`gen_ai.conversation.id`) on the current request's span.
    pub fn set_conversation_id(&self, session: &str) {
        if self.inner.is_none() {
            return;
        }
        Context::map_current(|cx| {
            let span = cx.span();
            if span.is_recording() {
                span.set_attribute(KeyValue::new(
                    attributes::CONVERSATION_ID,
                    session.to_owned(),
                ));
            }
        });
    }

    /// The current request's span as a job keeps it, for the worker's link.
    pub fn current_trace_parent(&self) -> Option<TraceParent> {
        self.inner.as_ref()?;
        TraceParent::current()
    }

    /// The worker's span for applying a run of `jobs` jobs of one session: a new trace, linked
    /// to the request span of every job that carries one (`traces`).
    pub fn memory_update(
        &self,
        jobs: usize,
        session: Option<&str>,
        traces: impl Iterator<Item = TraceParent>,
    ) -> SpanGuard {
        let Some(tracing) = &self.inner else {
            return SpanGuard::off();
        };
        let links = traces
            .map(|trace| Link::with_context(trace.span_context()))
            .collect();
        let mut attributes = vec![KeyValue::new(
            attributes::JOBS,
            i64::try_from(jobs).unwrap_or(i64::MAX),
        )];
        if let Some(session) = session {
            attributes.push(KeyValue::new(
                attributes::CONVERSATION_ID,
                session.to_owned(),
            ));
        }
        SpanGuard::on(
            tracing
                .tracer
                .span_builder(spans::MEMORY_UPDATE)
                .with_kind(SpanKind::Consumer)
                .with_links(links)
                .with_attributes(attributes)
                .start_with_context(&tracing.tracer, &Context::new()),
        )
    }
}

/// Runs `future` inside the trace context `cx` (so [`Telemetry::child`] spans started in it
/// are its children); without one, just runs it.
pub async fn traced<F: Future>(cx: Option<Context>, future: F) -> F::Output {
    match cx {
        Some(cx) => future.with_context(cx).await,
        None => future.await,
    }
}
