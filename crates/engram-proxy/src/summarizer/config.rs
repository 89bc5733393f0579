//! The summarizer's configuration: which OpenAI-compatible model writes the turn summaries and
//! fact diffs, and the limits it runs under. No `base_url` means the heuristic extractor only.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SummarizerConfig {
    /// OpenAI-compatible base URL, e.g. `https://api.openai.com/v1` (`/chat/completions` is
    /// appended). None: the heuristic extractor, no network.
    pub base_url: Option<String>,
    pub model: String,
    /// Name of the environment variable holding the key, sent as `Authorization: Bearer`.
    pub api_key_env: Option<String>,
    /// Budget for one extraction, the invalid-JSON retry included.
    pub timeout_ms: u64,
    /// Summarizer requests allowed per minute (bursts up to the same number); 0 = unlimited.
    pub requests_per_minute: u32,
    /// Cap on the exchange text sent to the model, user and assistant sides together.
    pub max_input_chars: usize,
    /// How long the worker waits before retrying a turn that fell back for a transient reason.
    pub background_retry_delay_ms: u64,
}

impl Default for SummarizerConfig {
    fn default() -> Self {
        SummarizerConfig {
            base_url: None,
            model: "gpt-4o-mini".into(),
            api_key_env: None,
            timeout_ms: 8_000,
            requests_per_minute: 600,
            max_input_chars: 16_000,
            background_retry_delay_ms: 30_000,
        }
    }
}

/// Below this the model sees too little of an exchange to summarise it.
const MIN_INPUT_CHARS: usize = 256;

impl SummarizerConfig {
    /// Checks the values serde cannot; the message starts with the offending key.
    pub fn validate(&self) -> Result<(), String> {
        if let Some(url) = &self.base_url {
            let parsed: Option<http::Uri> = url.parse().ok();
            let absolute_http = parsed.as_ref().is_some_and(|uri| {
                uri.host().is_some()
                    && uri.scheme_str().is_some_and(|scheme| {
                        scheme.eq_ignore_ascii_case("http") || scheme.eq_ignore_ascii_case("https")
                    })
            });
            if !absolute_http {
                return Err("base_url: must be an absolute http(s) URL".into());
            }
            if parsed.as_ref().and_then(http::Uri::query).is_some() {
                return Err("base_url: must not have a query string".into());
            }
        }
        if self.model.trim().is_empty() {
            return Err("model: must not be empty".into());
        }
        if let Some(name) = &self.api_key_env
            && (name.is_empty() || name.contains('='))
        {
            return Err(
                "api_key_env: must name an environment variable (the key itself never goes in the file)"
                    .into(),
            );
        }
        if self.timeout_ms == 0 {
            return Err("timeout_ms: must be greater than 0".into());
        }
        if self.max_input_chars < MIN_INPUT_CHARS {
            return Err(format!(
                "max_input_chars: must be at least {MIN_INPUT_CHARS}"
            ));
        }
        Ok(())
    }

    pub fn is_configured(&self) -> bool {
        self.base_url.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_url(url: &str) -> SummarizerConfig {
        SummarizerConfig {
            base_url: Some(url.into()),
            ..SummarizerConfig::default()
        }
    }

    #[test]
    fn defaults_are_heuristic_only_and_valid() {
        let config = SummarizerConfig::default();
        assert!(!config.is_configured());
        assert_eq!(config.timeout_ms, 8_000);
        assert_eq!(config.validate(), Ok(()));
    }

    #[test]
    fn bad_values_name_their_key() {
        assert_eq!(with_url("https://api.openai.com/v1").validate(), Ok(()));
        assert_eq!(with_url("http://127.0.0.1:9/v1/").validate(), Ok(()));
        for url in [
            "ftp://host/v1",
            "api.openai.com/v1",
            "/v1",
            "http://h/v1?x=1",
        ] {
            let error = with_url(url).validate().unwrap_err();
            assert!(error.starts_with("base_url:"), "{url}: {error}");
        }
        let config = SummarizerConfig {
            timeout_ms: 0,
            ..SummarizerConfig::default()
        };
        assert!(config.validate().unwrap_err().starts_with("timeout_ms:"));
        let config = SummarizerConfig {
            api_key_env: Some("KEY=sk-123".into()),
            ..SummarizerConfig::default()
        };
        assert!(config.validate().unwrap_err().starts_with("api_key_env:"));
    }

    #[test]
    fn unknown_keys_are_rejected() {
        let parsed: Result<SummarizerConfig, _> =
            serde_json::from_str(r#"{"base_url": "http://x/v1", "modle": "m"}"#);
        assert!(parsed.is_err());
        let parsed: SummarizerConfig =
            serde_json::from_str(r#"{"base_url": "http://x/v1"}"#).unwrap();
        assert_eq!(parsed.model, "gpt-4o-mini");
    }
}
