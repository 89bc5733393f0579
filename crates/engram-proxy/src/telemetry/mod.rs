//! OpenTelemetry traces with the GenAI semantic conventions; see `docs/operations.md#traces`.
//!
//! A [`Telemetry`] handle is cloned into the server, the memory layer and the worker. Tracing is
//! off unless an OTLP endpoint is configured: the handle is then empty, every call on it (and on
//! the [`RequestTrace`] and [`SpanGuard`] it hands out) is one branch, and the hot path builds
//! no attribute and allocates nothing. When on, finished spans go to a batch processor on the
//! tokio runtime that exports them over OTLP/HTTP (protobuf, through hyper);
//! [`Telemetry::shutdown`] flushes it at the end of a graceful shutdown.

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
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{Sampler, SdkTracer, SdkTracerProvider};

use crate::error::Error;

pub use config::{ENDPOINT_ENV, TRACES_ENDPOINT_ENV, TelemetryConfig};
pub use propagation::{TRACEPARENT, TRACESTATE};
pub use spans::{MemorySpan, RequestTrace, SpanGuard, attributes};

/// How long one export to the collector may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);
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
    /// Tracing as `config.telemetry` (and the standard `OTEL_EXPORTER_OTLP_*` variables) say:
    /// off without an endpoint. Must run inside the tokio runtime that will export the spans.
    pub fn from_config(settings: &TelemetryConfig) -> Result<Telemetry, Error> {
        Telemetry::from_config_and_env(settings, |name| std::env::var(name).ok())
    }

    fn from_config_and_env(
        settings: &TelemetryConfig,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Telemetry, Error> {
        let url = settings.traces_url(env).map_err(|message| {
            let (path, why) = message.split_once(": ").unwrap_or(("telemetry", &message));
            Error::Config {
                path: path.to_owned(),
                message: why.to_owned(),
            }
        })?;
        let Some(url) = url else {
            return Ok(Telemetry::default());
        };
        // The exporter's client: hyper over the connector the upstream uses (rustls, so an
        // https collector works), instead of a second HTTP stack.
        let connector = crate::upstream::connector(EXPORT_TIMEOUT);
        let client = opentelemetry_http::hyper::HyperClient::new(connector, EXPORT_TIMEOUT, None);
        let exporter = opentelemetry_otlp::SpanExporter::builder()
            .with_http()
            .with_http_client(client)
            .with_endpoint(url.clone())
            .with_timeout(EXPORT_TIMEOUT)
            .build()
            .map_err(|error| Error::Config {
                path: "telemetry.otlp_endpoint".into(),
                message: format!("cannot build the OTLP exporter for {url}: {error}"),
            })?;
        let processor =
            BatchSpanProcessor::builder(exporter, opentelemetry_sdk::runtime::Tokio).build();
        let provider = SdkTracerProvider::builder()
            .with_span_processor(processor)
            .with_sampler(Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(
                settings.sample_ratio,
            ))))
            .with_resource(
                Resource::builder()
                    .with_service_name(settings.service_name.clone())
                    .with_attribute(KeyValue::new("service.version", env!("CARGO_PKG_VERSION")))
                    .build(),
            )
            .build();
        tracing::info!(endpoint = %url, sample_ratio = settings.sample_ratio, "exporting traces over OTLP/HTTP");
        Ok(Telemetry::with_provider(provider, settings))
    }

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_endpoint_nothing_is_traced() {
        let telemetry =
            Telemetry::from_config_and_env(&TelemetryConfig::default(), |_| None).unwrap();
        assert!(!telemetry.is_enabled());
        let mut headers = http::HeaderMap::new();
        let trace = telemetry.chat_request(&headers);
        assert!(trace.context().is_none());
        let mut request = http::Request::new(());
        let mut trace = trace;
        trace.start_upstream(&mut request);
        assert!(request.headers().get(TRACEPARENT).is_none());
        headers.insert(TRACEPARENT, http::HeaderValue::from_static("x"));
        assert!(telemetry.chat_request(&headers).context().is_none());
        assert!(telemetry.child("engram.memory.load").is_off());
        assert!(
            telemetry
                .memory_update(0, None, std::iter::empty())
                .is_off()
        );
        assert_eq!(telemetry.current_trace_parent(), None);
    }
}
