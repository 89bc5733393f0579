//! Tracing's setup: the OTLP/HTTP exporter `config.telemetry` (and the standard
//! `OTEL_EXPORTER_OTLP_*` variables) ask for, behind the proxy's [`Telemetry`] handle; see
//! `docs/operations.md#traces`. The proxy itself holds only the spans and their propagation.

use std::time::Duration;

use engram_proxy::telemetry::{Telemetry, TelemetryConfig};
use engram_proxy::upstream;
use opentelemetry::KeyValue;
use opentelemetry_otlp::{WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor;
use opentelemetry_sdk::trace::{Sampler, SdkTracerProvider};

use crate::error::Error;

/// How long one export to the collector may take.
const EXPORT_TIMEOUT: Duration = Duration::from_secs(10);

/// Tracing as `config.telemetry` (and the standard `OTEL_EXPORTER_OTLP_*` variables) say:
/// off without an endpoint. Must run inside the tokio runtime that will export the spans.
pub fn from_config(settings: &TelemetryConfig) -> Result<Telemetry, Error> {
    from_config_and_env(settings, |name| std::env::var(name).ok())
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
    let connector = upstream::connector(EXPORT_TIMEOUT);
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

#[cfg(test)]
mod tests {
    use engram_proxy::telemetry::TRACEPARENT;

    use super::*;

    #[test]
    fn without_an_endpoint_nothing_is_traced() {
        let telemetry = from_config_and_env(&TelemetryConfig::default(), |_| None).unwrap();
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
