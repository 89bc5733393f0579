//! The LLM summarizer (seed 001): a separate OpenAI-compatible model turns one exchange into turn
//! summaries and a base-truth diff. It never fails: without a `base_url` it is the heuristic
//! extractor, and every failure (invalid JSON after one retry, timeout, its own rate limit, an
//! upstream error) falls back to the heuristic, flagged for a background retry when transient.
//! The model's diff passes the grounding check before it leaves here.

pub mod config;

mod client;
mod metrics;
mod prompt;

use std::num::NonZeroU32;
use std::time::Duration;

use bytes::Bytes;
use governor::{DefaultDirectRateLimiter, Quota, RateLimiter};
use serde::{Serialize, Serializer};
use tokio::time::{Instant, timeout_at};

use crate::error::Error;
use engram_memory::config::DepthConfig;
use engram_memory::depth::classify;
use engram_memory::diff::retain_grounded;
use engram_memory::extract::{ExchangeView, Extraction, Extractor, HeuristicExtractor};
use engram_memory::fence::memory_text;
use engram_memory::model::Depth;

use client::ChatClient;
pub use config::SummarizerConfig;
pub use metrics::{FAILURES, SummarizerMetrics};
pub use prompt::SYSTEM_PROMPT;

/// What `Summarizer::extract` produced, and how.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Summary {
    pub extraction: Extraction,
    pub source: SummarySource,
    /// The fallback was transient: retry with `extract_llm` after `background_retry_delay`.
    pub retry_later: bool,
    /// The model's diff entries the grounding check dropped (not supported by the exchange).
    pub ungrounded: Vec<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum SummarySource {
    /// No summarizer configured: the heuristic extractor is the summarizer.
    Heuristic,
    Llm,
    /// The model was configured but could not be used this time.
    Fallback {
        reason: SummaryFailure,
    },
}

/// Why the model's answer could not be used. Renders as a short snake_case string for logs and
/// metric labels (`as_str`); the HTTP status, when there is one, is kept apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.as_str())]
pub enum SummaryFailure {
    /// No `base_url` (only `extract_llm` reports this).
    NotConfigured,
    /// The reply was not the JSON the prompt asks for, twice.
    InvalidJson,
    /// No usable answer within `timeout_ms`.
    Timeout,
    /// engram's own limit (`requests_per_minute`) was reached.
    RateLimited,
    /// The tenant's summarizer token budget (`rate_limits.tenant_summarizer_tokens_per_minute`)
    /// was spent; the model was not called.
    TokenBudget,
    /// The summarizer answered with a non-2xx status.
    UpstreamStatus(u16),
    /// Connecting, sending or reading failed.
    Transport,
}

impl SummaryFailure {
    pub fn as_str(&self) -> &'static str {
        match self {
            SummaryFailure::NotConfigured => "not_configured",
            SummaryFailure::InvalidJson => "invalid_json",
            SummaryFailure::Timeout => "timeout",
            SummaryFailure::RateLimited => "rate_limited",
            SummaryFailure::TokenBudget => "token_budget",
            SummaryFailure::UpstreamStatus(429) => "upstream_rate_limited",
            SummaryFailure::UpstreamStatus(status) if *status >= 500 => "upstream_error",
            SummaryFailure::UpstreamStatus(_) => "upstream_rejected",
            SummaryFailure::Transport => "transport",
        }
    }

    /// Worth retrying later: the same request may well succeed then.
    pub fn is_transient(&self) -> bool {
        match self {
            SummaryFailure::Timeout
            | SummaryFailure::RateLimited
            | SummaryFailure::TokenBudget
            | SummaryFailure::Transport => true,
            SummaryFailure::UpstreamStatus(status) => {
                *status == 408 || *status == 429 || *status >= 500
            }
            SummaryFailure::NotConfigured | SummaryFailure::InvalidJson => false,
        }
    }

    pub fn status(&self) -> Option<u16> {
        match self {
            SummaryFailure::UpstreamStatus(status) => Some(*status),
            _ => None,
        }
    }
}

impl Serialize for SummaryFailure {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.serialize_str(self.as_str())
    }
}

pub struct Summarizer {
    llm: Option<Llm>,
    depth: DepthConfig,
    background_retry_delay: Duration,
}

struct Llm {
    client: ChatClient,
    model: String,
    timeout: Duration,
    max_input_chars: usize,
    /// None: unlimited.
    limiter: Option<DefaultDirectRateLimiter>,
    metrics: Option<SummarizerMetrics>,
}

/// The exchange as the summarizer works on it: engram's fences stripped, forged ones
/// neutralised (as `record_exchange` stores it).
struct Exchange {
    user: String,
    assistant: String,
    depth: Depth,
}

impl Summarizer {
    /// The summarizer `config` describes, reading the key from the env var it names.
    pub fn from_config(config: &SummarizerConfig) -> Result<Summarizer, Error> {
        let api_key = match (&config.base_url, &config.api_key_env) {
            (Some(_), Some(name)) => match std::env::var(name) {
                Ok(key) if !key.trim().is_empty() => Some(key),
                _ => {
                    return Err(Error::Config {
                        path: "summarizer.api_key_env".into(),
                        message: format!("environment variable {name} is not set"),
                    });
                }
            },
            _ => None,
        };
        Summarizer::new(config, api_key)
    }

    /// Like `from_config` with the key already read (None: send no `Authorization`).
    pub fn new(config: &SummarizerConfig, api_key: Option<String>) -> Result<Summarizer, Error> {
        config.validate().map_err(|message| Error::Config {
            path: "summarizer".into(),
            message,
        })?;
        let timeout = Duration::from_millis(config.timeout_ms);
        let llm = match &config.base_url {
            None => None,
            Some(base_url) => Some(Llm {
                client: ChatClient::new(base_url, api_key.as_deref(), timeout)?,
                model: config.model.clone(),
                timeout,
                max_input_chars: config.max_input_chars,
                limiter: NonZeroU32::new(config.requests_per_minute)
                    .map(|rate| RateLimiter::direct(Quota::per_minute(rate))),
                metrics: None,
            }),
        };
        Ok(Summarizer {
            llm,
            depth: DepthConfig::default(),
            background_retry_delay: Duration::from_millis(config.background_retry_delay_ms),
        })
    }

    /// The heuristic extractor alone (what `SummarizerConfig::default()` gives).
    pub fn heuristic() -> Summarizer {
        Summarizer {
            llm: None,
            depth: DepthConfig::default(),
            background_retry_delay: Duration::from_millis(
                SummarizerConfig::default().background_retry_delay_ms,
            ),
        }
    }

    /// Uses the memory engine's depth thresholds (the default ones otherwise).
    pub fn with_depth(mut self, depth: DepthConfig) -> Summarizer {
        self.depth = depth;
        self
    }

    /// Counts the model's calls, failures, tokens and latency.
    pub fn with_metrics(mut self, metrics: SummarizerMetrics) -> Summarizer {
        if let Some(llm) = &mut self.llm {
            llm.metrics = Some(metrics);
        }
        self
    }

    pub fn is_configured(&self) -> bool {
        self.llm.is_some()
    }

    pub fn background_retry_delay(&self) -> Duration {
        self.background_retry_delay
    }

    /// Summaries and a grounded diff for one exchange. Never fails: see `Summary::source`.
    pub async fn extract(&self, user_text: &str, assistant_text: &str) -> Summary {
        match self.answer(user_text, assistant_text).await {
            Ok(summary) => summary,
            Err(reason) => self.after_failure(user_text, assistant_text, reason),
        }
    }

    /// The model's summary (without a model, the heuristic extraction's), or why the model
    /// gave none, counted and logged here: [`Summarizer::extract`] without its fallback, which
    /// costs CPU and no tokens, so a caller may make it elsewhere.
    pub async fn answer(
        &self,
        user_text: &str,
        assistant_text: &str,
    ) -> Result<Summary, SummaryFailure> {
        let exchange = self.prepare(user_text, assistant_text);
        let Some(llm) = &self.llm else {
            return Ok(heuristic(&exchange, SummarySource::Heuristic, false));
        };
        llm.extract(&exchange).await.inspect_err(|reason| {
            tracing::warn!(
                reason = reason.as_str(),
                status = reason.status(),
                retry_later = reason.is_transient(),
                "summarizer fell back to the heuristic extractor"
            );
        })
    }

    /// The heuristic extraction, marked as a fallback for `reason` (and retried later when the
    /// reason is transient), after [`Summarizer::answer`] gave `reason`.
    pub fn after_failure(
        &self,
        user_text: &str,
        assistant_text: &str,
        reason: SummaryFailure,
    ) -> Summary {
        let exchange = self.prepare(user_text, assistant_text);
        heuristic(
            &exchange,
            SummarySource::Fallback { reason },
            reason.is_transient(),
        )
    }

    /// Counts a model call not made for `reason` (the tenant's summarizer tokens spent).
    pub fn refused(&self, reason: SummaryFailure) {
        if let Some(metrics) = self.llm.as_ref().and_then(|llm| llm.metrics.as_ref()) {
            metrics.failed(reason);
        }
    }

    /// The input tokens a model call for this exchange would send, estimated at four bytes a
    /// token after the `max_input_chars` cap, plus the system prompt; `None` without a model.
    /// An estimate on purpose: it is charged before the call, off the hot path, and counting
    /// exactly would cost a tokenizer pass per exchange.
    pub fn estimated_input_tokens(&self, user_text: &str, assistant_text: &str) -> Option<u32> {
        let llm = self.llm.as_ref()?;
        let sent = user_text.len().min(llm.max_input_chars)
            + assistant_text.len().min(llm.max_input_chars)
            + prompt::SYSTEM_PROMPT.len();
        Some(u32::try_from(sent.div_ceil(4)).unwrap_or(u32::MAX))
    }

    /// One model extraction (with its invalid-JSON retry) and no fallback, for the worker's
    /// background retry. The `Summary` is always `SummarySource::Llm`.
    pub async fn extract_llm(
        &self,
        user_text: &str,
        assistant_text: &str,
    ) -> Result<Summary, SummaryFailure> {
        let llm = self.llm.as_ref().ok_or(SummaryFailure::NotConfigured)?;
        llm.extract(&self.prepare(user_text, assistant_text)).await
    }

    fn prepare(&self, user_text: &str, assistant_text: &str) -> Exchange {
        let user = memory_text(user_text).into_owned();
        let assistant = memory_text(assistant_text).into_owned();
        let depth = classify(&user, &assistant, &self.depth);
        Exchange {
            user,
            assistant,
            depth,
        }
    }
}

fn heuristic(exchange: &Exchange, source: SummarySource, retry_later: bool) -> Summary {
    let extraction = HeuristicExtractor.extract(&ExchangeView {
        user: &exchange.user,
        assistant: &exchange.assistant,
        depth: exchange.depth,
    });
    Summary {
        extraction,
        source,
        retry_later,
        ungrounded: Vec::new(),
    }
}

impl Llm {
    async fn extract(&self, exchange: &Exchange) -> Result<Summary, SummaryFailure> {
        let result = self.extract_once(exchange).await;
        if let (Err(reason), Some(metrics)) = (&result, &self.metrics) {
            metrics.failed(*reason);
        }
        result
    }

    async fn extract_once(&self, exchange: &Exchange) -> Result<Summary, SummaryFailure> {
        // One deadline for both attempts: the caller waits at most `timeout` in all.
        let deadline = Instant::now() + self.timeout;
        let (user, assistant) =
            prompt::cap(&exchange.user, &exchange.assistant, self.max_input_chars);
        let body = prompt::request_body(&self.model, &user, &assistant, exchange.depth);
        let body = Bytes::from(body.to_string());
        tracing::debug!(
            model = %self.model,
            user_bytes = user.len(),
            assistant_bytes = assistant.len(),
            request_bytes = body.len(),
            "summarizer request"
        );
        let mut extraction = match self.attempt(deadline, body.clone()).await {
            Err(SummaryFailure::InvalidJson) => {
                tracing::debug!("summarizer reply was not the expected JSON; retrying once");
                self.attempt(deadline, body).await?
            }
            other => other?,
        };
        let exchange_text = format!("{}\n{}", exchange.user, exchange.assistant);
        let ungrounded = retain_grounded(&mut extraction.diff, &exchange_text);
        if !ungrounded.is_empty() {
            tracing::debug!(
                dropped = ungrounded.len(),
                "summarizer diff entries not grounded in the exchange"
            );
        }
        Ok(Summary {
            extraction,
            source: SummarySource::Llm,
            retry_later: false,
            ungrounded,
        })
    }

    async fn attempt(&self, deadline: Instant, body: Bytes) -> Result<Extraction, SummaryFailure> {
        if let Some(limiter) = &self.limiter
            && limiter.check().is_err()
        {
            return Err(SummaryFailure::RateLimited);
        }
        let started = Instant::now();
        let answer = timeout_at(deadline, self.client.post(body)).await;
        if let Some(metrics) = &self.metrics {
            let usage = match &answer {
                Ok(Ok((_, reply))) => prompt::usage(reply),
                _ => None,
            };
            metrics.call(started.elapsed(), usage);
        }
        let (status, reply) = match answer {
            Err(_) => return Err(SummaryFailure::Timeout),
            Ok(Err(error)) => {
                tracing::warn!(%error, "summarizer request failed");
                return Err(SummaryFailure::Transport);
            }
            Ok(Ok(answer)) => answer,
        };
        tracing::debug!(
            status = status.as_u16(),
            response_bytes = reply.len(),
            elapsed_ms = started.elapsed().as_millis() as u64,
            "summarizer response"
        );
        if !status.is_success() {
            return Err(SummaryFailure::UpstreamStatus(status.as_u16()));
        }
        prompt::parse_completion(&reply).map_err(|error| {
            // The parse error names a position and an expectation, never the reply's text.
            let (part, detail) = match &error {
                prompt::ParseError::Envelope(detail) => ("envelope", detail),
                prompt::ParseError::Content(detail) => ("content", detail),
            };
            tracing::debug!(part, %detail, "summarizer reply rejected");
            SummaryFailure::InvalidJson
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn failures_render_as_short_labels() {
        assert_eq!(SummaryFailure::InvalidJson.to_string(), "invalid_json");
        assert_eq!(
            SummaryFailure::UpstreamStatus(503).as_str(),
            "upstream_error"
        );
        assert_eq!(
            serde_json::to_value(SummarySource::Fallback {
                reason: SummaryFailure::RateLimited
            })
            .unwrap(),
            serde_json::json!({"kind": "fallback", "reason": "rate_limited"})
        );
        assert!(SummaryFailure::UpstreamStatus(429).is_transient());
        assert!(!SummaryFailure::UpstreamStatus(401).is_transient());
        assert!(!SummaryFailure::InvalidJson.is_transient());
    }

    #[tokio::test]
    async fn unconfigured_is_the_heuristic_extractor() {
        let summarizer = Summarizer::from_config(&SummarizerConfig::default()).unwrap();
        assert!(!summarizer.is_configured());
        let summary = summarizer
            .extract("I'm allergic to peanuts.", "Noted, no peanuts.")
            .await;
        assert_eq!(summary.source, SummarySource::Heuristic);
        assert!(!summary.retry_later);
        assert!(!summary.extraction.diff.is_empty());
        assert_eq!(
            summarizer.extract_llm("a", "b").await,
            Err(SummaryFailure::NotConfigured)
        );
    }

    #[test]
    fn a_missing_key_variable_is_a_config_error() {
        let config = SummarizerConfig {
            base_url: Some("http://127.0.0.1:9/v1".into()),
            api_key_env: Some("ENGRAM_TEST_SURELY_UNSET_SUMMARIZER_KEY".into()),
            ..SummarizerConfig::default()
        };
        let error = Summarizer::from_config(&config).err().unwrap();
        assert!(error.to_string().contains("api_key_env"), "{error}");
    }
}
