//! The `telemetry` section: where OpenTelemetry traces go, and what they may contain.

use serde::Deserialize;

/// The per-signal variable wins over the generic one, which gets `/v1/traces` appended
/// (the OTLP exporter specification's rules).
pub const TRACES_ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT";
pub const ENDPOINT_ENV: &str = "OTEL_EXPORTER_OTLP_ENDPOINT";
const TRACES_PATH: &str = "/v1/traces";

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TelemetryConfig {
    /// Base URL of an OTLP/HTTP (protobuf) collector, e.g. `http://otel-collector:4318`;
    /// spans go to `<otlp_endpoint>/v1/traces`. `None`: the standard `OTEL_EXPORTER_OTLP_*`
    /// variables if set, else tracing is off.
    pub otlp_endpoint: Option<String>,
    /// `service.name` of the exported spans.
    pub service_name: String,
    /// `gen_ai.provider.name` of chat spans: who serves the upstream API.
    pub provider_name: String,
    /// Share of traces started here that are recorded (0.0 to 1.0). A caller's sampling
    /// decision, sent in its `traceparent`, is followed instead.
    pub sample_ratio: f64,
    /// Record prompts and answers on chat spans (`gen_ai.input.messages`,
    /// `gen_ai.output.messages`). Credentials are never recorded.
    pub capture_content: bool,
}

impl Default for TelemetryConfig {
    fn default() -> Self {
        TelemetryConfig {
            otlp_endpoint: None,
            service_name: "engram".to_owned(),
            provider_name: "openai".to_owned(),
            sample_ratio: 1.0,
            capture_content: false,
        }
    }
}

impl TelemetryConfig {
    /// Checks what types cannot; the message starts with the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(endpoint) = &self.otlp_endpoint
            && !is_http_url(endpoint)
        {
            return Err("otlp_endpoint: must be an absolute http:// or https:// URL".into());
        }
        if self.service_name.trim().is_empty() {
            return Err("service_name: must not be empty".into());
        }
        if self.provider_name.trim().is_empty() {
            return Err("provider_name: must not be empty".into());
        }
        if !(0.0..=1.0).contains(&self.sample_ratio) {
            return Err("sample_ratio: must be between 0.0 and 1.0".into());
        }
        Ok(())
    }

    /// The URL spans are exported to, or `None` when tracing is off: `otlp_endpoint`, else
    /// `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` (as is), else `OTEL_EXPORTER_OTLP_ENDPOINT`.
    pub fn traces_url(
        &self,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<String>, String> {
        let (url, source) = if let Some(base) = &self.otlp_endpoint {
            (traces_path(base), "telemetry.otlp_endpoint")
        } else if let Some(url) = env(TRACES_ENDPOINT_ENV).filter(|url| !url.trim().is_empty()) {
            (url.trim().to_owned(), TRACES_ENDPOINT_ENV)
        } else if let Some(base) = env(ENDPOINT_ENV).filter(|url| !url.trim().is_empty()) {
            (traces_path(base.trim()), ENDPOINT_ENV)
        } else {
            return Ok(None);
        };
        if is_http_url(&url) {
            Ok(Some(url))
        } else {
            Err(format!(
                "{source}: must be an absolute http:// or https:// URL"
            ))
        }
    }
}

fn traces_path(base: &str) -> String {
    format!("{}{TRACES_PATH}", base.trim_end_matches('/'))
}

fn is_http_url(url: &str) -> bool {
    url.parse::<http::Uri>().is_ok_and(|uri| {
        matches!(uri.scheme_str(), Some("http" | "https")) && uri.authority().is_some()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(key, _)| *key == name)
                .map(|(_, value)| (*value).to_owned())
        }
    }

    #[test]
    fn without_an_endpoint_tracing_is_off() {
        let config = TelemetryConfig::default();
        assert_eq!(config.traces_url(env(&[])).unwrap(), None);
        assert_eq!(
            config.traces_url(env(&[(ENDPOINT_ENV, " ")])).unwrap(),
            None
        );
    }

    #[test]
    fn the_configured_endpoint_wins_and_gets_the_traces_path() {
        let config = TelemetryConfig {
            otlp_endpoint: Some("http://collector:4318/".into()),
            ..TelemetryConfig::default()
        };
        let vars = [(ENDPOINT_ENV, "http://other:4318")];
        assert_eq!(
            config.traces_url(env(&vars)).unwrap().as_deref(),
            Some("http://collector:4318/v1/traces")
        );
    }

    #[test]
    fn the_standard_variables_follow_the_otlp_rules() {
        let config = TelemetryConfig::default();
        let generic = [(ENDPOINT_ENV, "https://collector:4318")];
        assert_eq!(
            config.traces_url(env(&generic)).unwrap().as_deref(),
            Some("https://collector:4318/v1/traces")
        );
        let both = [
            (ENDPOINT_ENV, "https://collector:4318"),
            (TRACES_ENDPOINT_ENV, "http://traces:9999/custom"),
        ];
        assert_eq!(
            config.traces_url(env(&both)).unwrap().as_deref(),
            Some("http://traces:9999/custom")
        );
        let bad = [(ENDPOINT_ENV, "collector:4318")];
        let error = config.traces_url(env(&bad)).unwrap_err();
        assert!(error.starts_with(ENDPOINT_ENV), "{error}");
    }

    #[test]
    fn bad_values_name_their_key() {
        for (config, key) in [
            (
                TelemetryConfig {
                    otlp_endpoint: Some("grpc://collector".into()),
                    ..TelemetryConfig::default()
                },
                "otlp_endpoint",
            ),
            (
                TelemetryConfig {
                    sample_ratio: 1.5,
                    ..TelemetryConfig::default()
                },
                "sample_ratio",
            ),
            (
                TelemetryConfig {
                    service_name: " ".into(),
                    ..TelemetryConfig::default()
                },
                "service_name",
            ),
        ] {
            let error = config.validate().unwrap_err();
            assert!(error.starts_with(key), "{error}");
        }
        assert_eq!(TelemetryConfig::default().validate(), Ok(()));
    }
}
