//! `upstream.*`: where requests go and how long they may take.

use serde::Deserialize;

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// OpenAI-compatible base URL, including its `/v1` (or equivalent) prefix.
    pub base_url: String,
    /// Name of an environment variable holding the upstream API key. When set, the key replaces
    /// the client's `Authorization` header; when unset, the client's header is forwarded as is.
    pub api_key_env: Option<String>,
    pub connect_timeout_ms: u64,
    /// Longest wait for the upstream's response headers, and for each body chunk after them.
    pub read_timeout_ms: u64,
    pub pool_idle_timeout_ms: u64,
    pub pool_max_idle_per_host: usize,
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            base_url: "https://api.openai.com/v1".to_owned(),
            api_key_env: None,
            connect_timeout_ms: 5_000,
            read_timeout_ms: 300_000,
            pool_idle_timeout_ms: 90_000,
            pool_max_idle_per_host: 256,
        }
    }
}
