//! Configuration: `config.yaml`, then `ENGRAM_SECTION__KEY` environment overrides, then CLI flags.
//!
//! The file is read into a JSON value tree first, so env overrides are merged generically; the
//! tree is then deserialised with unknown keys denied and `serde_path_to_error`, so a typo or a
//! bad value is rejected at start naming its key path. `validate()` checks what types cannot.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;
use serde_json::{Map, Value};

use crate::error::Error;
use engram_memory::MemoryConfig;
use engram_proxy::pipeline::identity::IdentityConfig;
use engram_proxy::pipeline::trust::Trust;
use engram_proxy::ratelimit::RateLimitConfig;
use engram_proxy::summarizer::SummarizerConfig;
use engram_proxy::telemetry::TelemetryConfig;
pub use engram_proxy::upstream::UpstreamConfig;
pub use engram_proxy::worker::WorkerConfig;
use engram_store::redis::{self, RedisOptions};

const ENV_PREFIX: &str = "ENGRAM_";
const ENV_SEPARATOR: &str = "__";

#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    pub server: ServerConfig,
    pub upstream: UpstreamConfig,
    pub capture: CaptureConfig,
    pub identity: IdentityConfig,
    pub memory: MemoryConfig,
    pub store: StoreConfig,
    pub worker: WorkerConfig,
    pub summarizer: SummarizerConfig,
    pub rate_limits: RateLimitConfig,
    pub logging: LoggingConfig,
    pub telemetry: TelemetryConfig,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct StoreConfig {
    /// Which backend holds memory.
    pub backend: StoreBackend,
    /// Directory of the embedded store's file (`engram.redb`); created if missing.
    pub data_dir: PathBuf,
    /// The Redis server of the `redis` backend; with `redis_cluster`, one or more nodes of the
    /// cluster, comma-separated.
    pub redis_url: String,
    /// `redis_url` names nodes of a Redis Cluster.
    pub redis_cluster: bool,
    /// Prefix of every Redis key.
    pub redis_prefix: String,
    /// How long Redis keeps an applied or failed job's record (its state for read-your-writes
    /// and replay detection); 0 keeps it until the user is forgotten.
    pub redis_finished_job_ttl_secs: u64,
    /// Each connection attempt to a Redis node gives up after this.
    pub redis_connect_timeout_ms: u64,
    /// A Redis command (with its retries, on a cluster) fails after this without an answer.
    pub redis_response_timeout_ms: u64,
    /// Streams the job queue is spread over, each in its own hash slot.
    pub redis_queue_shards: u32,
    /// Replicas that must acknowledge (`WAIT`) a recorded exchange before its enqueue counts
    /// as done, and a job commit before its queue token is released; 0 does not wait.
    pub redis_wait_replicas: u32,
    /// The longest `WAIT`; past it the enqueue fails (retried, then spooled locally).
    pub redis_wait_timeout_ms: u64,
    /// The longest a session's job waits for the job of an earlier turn still in flight
    /// (being answered or recorded, on any replica).
    pub redis_order_grace_ms: u64,
    /// How long the embedded store's first enqueue of a commit waits for others to share its
    /// transaction and fsync (group commit); a recorded answer's end waits for that commit.
    pub group_commit_ms: u64,
    /// The hot path's store read must answer within this; past it (or on an error) the request
    /// goes upstream without memory (fail open).
    pub hot_path_deadline_ms: u64,
    /// Jobs the Redis backend's local spool holds at most; past it a recording is lost.
    pub spool_max_jobs: u64,
    /// Bytes of turn text the Redis backend's local spool holds at most; past it a recording
    /// is lost.
    pub spool_max_bytes: u64,
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StoreBackend {
    /// One redb file in `data_dir`, zero setup.
    #[default]
    Embedded,
    /// A Redis server at `redis_url`, shared by several proxies and workers.
    Redis,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    /// Address to listen on; port 0 picks a free port (the chosen address is printed).
    pub listen: SocketAddr,
    /// A second address serving only `/healthz`, `/readyz` and `/metrics`, so the proxy itself
    /// can listen on loopback in a sidecar while the kubelet and Prometheus reach these.
    pub ops_listen: Option<SocketAddr>,
    /// Largest accepted `/v1/chat/completions` body; larger gets 413.
    pub max_body_bytes: u64,
    /// How long in-flight requests and background tasks get to finish after SIGTERM/SIGINT.
    pub drain_timeout_ms: u64,
    /// Tokio worker threads; 0 means one per core.
    pub worker_threads: usize,
    /// Longest a client may take to send a request's headers, and (HTTP/1.1) the longest a
    /// connection may sit idle between requests; past it the connection is closed.
    pub header_read_timeout_ms: u64,
    /// HTTP/2: the interval of keep-alive pings on a connection; one unanswered within
    /// `header_read_timeout_ms` closes it.
    pub http2_keep_alive_interval_ms: u64,
    /// A connection (HTTP/1.1 or HTTP/2) with no request open for this long is closed
    /// gracefully. A client answering HTTP/2 pings would otherwise hold it forever.
    pub idle_timeout_ms: u64,
    /// Client connections served in full; past it (or past what the process's open-file limit
    /// leaves) a connection gets only `/healthz`, `/readyz` and `/metrics` (anything else: 503)
    /// and is closed after one answer.
    pub max_connections: usize,
    /// Connections past `max_connections` kept for those routes; past them a connection is
    /// closed at once.
    pub ops_reserve_connections: usize,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CaptureConfig {
    /// Frames the tee may queue for the recorder before the capture is marked incomplete
    /// (the client is never slowed down to wait for the recorder).
    pub channel_frames: usize,
    /// Largest response body the recorder keeps; past it the capture is marked incomplete.
    pub max_response_bytes: usize,
    /// Longest the end of a recorded answer waits for its recording to be durable (see
    /// `pipeline::Receipt`); past it the answer ends with the receipt `pending`.
    pub receipt_wait_ms: u64,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// A `tracing` filter, e.g. `info` or `engram=debug,info`. `RUST_LOG` wins when set.
    pub level: String,
    pub format: LogFormat,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LogFormat {
    Text,
    Json,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            ops_listen: None,
            max_body_bytes: 10 * 1024 * 1024,
            drain_timeout_ms: 30_000,
            worker_threads: 0,
            header_read_timeout_ms: 30_000,
            http2_keep_alive_interval_ms: 20_000,
            idle_timeout_ms: 60_000,
            max_connections: 10_000,
            ops_reserve_connections: 32,
        }
    }
}

impl Default for CaptureConfig {
    fn default() -> Self {
        CaptureConfig {
            channel_frames: 1024,
            max_response_bytes: 4 * 1024 * 1024,
            receipt_wait_ms: 1000,
        }
    }
}

impl StoreConfig {
    /// The Redis store's options these settings give.
    pub fn redis_options(&self) -> RedisOptions {
        RedisOptions {
            prefix: self.redis_prefix.clone(),
            finished_job_ttl: (self.redis_finished_job_ttl_secs > 0)
                .then(|| Duration::from_secs(self.redis_finished_job_ttl_secs)),
            connect_timeout: Duration::from_millis(self.redis_connect_timeout_ms),
            response_timeout: Duration::from_millis(self.redis_response_timeout_ms),
            cluster: self.redis_cluster,
            queue_shards: self.redis_queue_shards,
            wait_replicas: self.redis_wait_replicas,
            wait_timeout: Duration::from_millis(self.redis_wait_timeout_ms),
            order_grace: Duration::from_millis(self.redis_order_grace_ms),
            ..RedisOptions::default()
        }
    }
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            backend: StoreBackend::Embedded,
            data_dir: PathBuf::from("data"),
            redis_url: "redis://127.0.0.1:6379".to_owned(),
            redis_cluster: false,
            redis_prefix: redis::DEFAULT_PREFIX.to_owned(),
            redis_finished_job_ttl_secs: redis::DEFAULT_FINISHED_JOB_TTL.as_secs(),
            redis_connect_timeout_ms: 2000,
            redis_response_timeout_ms: 2000,
            redis_queue_shards: 1,
            redis_wait_replicas: 0,
            redis_wait_timeout_ms: 200,
            redis_order_grace_ms: 60_000,
            group_commit_ms: 0,
            hot_path_deadline_ms: 20,
            spool_max_jobs: 100_000,
            spool_max_bytes: 128 << 20,
        }
    }
}

impl Default for LoggingConfig {
    fn default() -> Self {
        LoggingConfig {
            level: "info".to_owned(),
            format: LogFormat::Text,
        }
    }
}

impl Config {
    /// Loads the file (if given), applies `ENGRAM_…__…` overrides from `env`, and validates.
    pub fn load(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, Error> {
        let mut tree = match path {
            Some(path) => {
                let text = std::fs::read_to_string(path).map_err(|error| Error::Config {
                    path: path.display().to_string(),
                    message: format!("cannot read the config file: {error}"),
                })?;
                parse_yaml(&text)?
            }
            None => Value::Object(Map::new()),
        };
        apply_env_overrides(&mut tree, env)?;
        Config::from_tree(tree)
    }

    pub fn from_yaml(text: &str) -> Result<Config, Error> {
        Config::from_tree(parse_yaml(text)?)
    }

    fn from_tree(tree: Value) -> Result<Config, Error> {
        let config: Config =
            serde_path_to_error::deserialize(tree).map_err(|error| Error::Config {
                path: error.path().to_string(),
                message: error.into_inner().to_string(),
            })?;
        config.validate()?;
        Ok(config)
    }

    pub fn validate(&self) -> Result<(), Error> {
        let invalid = |path: &str, message: &str| {
            Err(Error::Config {
                path: path.to_owned(),
                message: message.to_owned(),
            })
        };
        let base = &self.upstream.base_url;
        match base.parse::<http::Uri>() {
            Ok(uri)
                if matches!(uri.scheme_str(), Some("http" | "https"))
                    && uri.authority().is_some()
                    && uri.query().is_none() => {}
            _ => {
                return invalid(
                    "upstream.base_url",
                    "must be an absolute http:// or https:// URL without a query",
                );
            }
        }
        if let Some(name) = &self.upstream.api_key_env
            && (name.is_empty() || name.contains('='))
        {
            return invalid(
                "upstream.api_key_env",
                "must name an environment variable (the key itself never goes in the file)",
            );
        }
        if self.server.max_body_bytes == 0 {
            return invalid("server.max_body_bytes", "must be greater than 0");
        }
        if self.server.max_connections == 0 {
            return invalid("server.max_connections", "must be greater than 0");
        }
        for (path, value) in [
            (
                "server.header_read_timeout_ms",
                self.server.header_read_timeout_ms,
            ),
            (
                "server.http2_keep_alive_interval_ms",
                self.server.http2_keep_alive_interval_ms,
            ),
            ("server.idle_timeout_ms", self.server.idle_timeout_ms),
        ] {
            if !(100..=3_600_000).contains(&value) {
                return invalid(path, "must be between 100 and 3600000 (one hour)");
            }
        }
        for (path, value) in [
            (
                "upstream.connect_timeout_ms",
                self.upstream.connect_timeout_ms,
            ),
            ("upstream.read_timeout_ms", self.upstream.read_timeout_ms),
        ] {
            if value == 0 {
                return invalid(path, "must be greater than 0");
            }
        }
        if self.capture.channel_frames == 0 {
            return invalid("capture.channel_frames", "must be greater than 0");
        }
        if self.store.group_commit_ms > 100 {
            return invalid(
                "store.group_commit_ms",
                "must be at most 100 (every recorded answer's end waits for it)",
            );
        }
        if self.capture.receipt_wait_ms > 60_000 {
            return invalid(
                "capture.receipt_wait_ms",
                "must be at most 60000 (an answer's end held longer looks like a hung upstream)",
            );
        }
        if self.store.data_dir.as_os_str().is_empty() {
            return invalid("store.data_dir", "must name a directory");
        }
        let redis_urls: Vec<&str> = self.store.redis_url.split(',').map(str::trim).collect();
        if self.store.redis_cluster {
            if !redis_urls
                .iter()
                .all(|url| url.starts_with("redis://") || url.starts_with("rediss://"))
            {
                return invalid(
                    "store.redis_url",
                    "with redis_cluster, must list redis:// or rediss:// URLs of cluster nodes, comma-separated",
                );
            }
        } else if redis_urls.len() != 1
            || !["redis://", "rediss://", "unix://"]
                .iter()
                .any(|scheme| self.store.redis_url.starts_with(scheme))
        {
            return invalid(
                "store.redis_url",
                "must be a redis://, rediss:// or unix:// URL (several only with redis_cluster)",
            );
        }
        if !(1..=1024).contains(&self.store.redis_queue_shards) {
            return invalid("store.redis_queue_shards", "must be between 1 and 1024");
        }
        for (path, value) in [
            (
                "store.redis_connect_timeout_ms",
                self.store.redis_connect_timeout_ms,
            ),
            (
                "store.redis_response_timeout_ms",
                self.store.redis_response_timeout_ms,
            ),
            (
                "store.redis_wait_timeout_ms",
                self.store.redis_wait_timeout_ms,
            ),
        ] {
            if value == 0 {
                return invalid(path, "must be greater than 0");
            }
        }
        if self.store.redis_wait_replicas > 0
            && self.store.redis_wait_timeout_ms >= self.store.redis_response_timeout_ms
        {
            return invalid(
                "store.redis_wait_timeout_ms",
                "must be shorter than store.redis_response_timeout_ms",
            );
        }
        if self.store.redis_prefix.is_empty() || self.store.redis_prefix.contains(['{', '}', ' ']) {
            return invalid(
                "store.redis_prefix",
                "must be non-empty, without braces or spaces",
            );
        }
        if self.store.hot_path_deadline_ms == 0 {
            return invalid("store.hot_path_deadline_ms", "must be greater than 0");
        }
        if let Err(error) = engram_proxy::pipeline::identity::checked_id(
            "identity.default_tenant",
            &self.identity.default_tenant,
        ) {
            return invalid("identity.default_tenant", &error.to_string());
        }
        self.validate_trust()?;
        if let Err((path, message)) = self.memory.validate() {
            return invalid(&format!("memory.{path}"), &message);
        }
        for (path, value) in [
            ("worker.concurrency", self.worker.concurrency as u64),
            ("worker.run_jobs", self.worker.run_jobs as u64),
            ("worker.lease_ms", self.worker.lease_ms),
            ("worker.poll_interval_ms", self.worker.poll_interval_ms),
            ("worker.max_attempts", u64::from(self.worker.max_attempts)),
            ("worker.cache_users", self.worker.cache_users as u64),
            ("worker.cache_bytes", self.worker.cache_bytes as u64),
            ("store.spool_max_jobs", self.store.spool_max_jobs),
            ("store.spool_max_bytes", self.store.spool_max_bytes),
        ] {
            if value == 0 {
                return invalid(path, "must be greater than 0");
            }
        }
        if let Err(message) = self.summarizer.validate() {
            let key = message.split(':').next().unwrap_or_default();
            let why = message
                .split_once(':')
                .map_or(message.as_str(), |(_, why)| why.trim());
            return invalid(&format!("summarizer.{key}"), why);
        }
        if let Err(message) = self.telemetry.validate() {
            let (key, why) = message.split_once(": ").unwrap_or(("", message.as_str()));
            return invalid(&format!("telemetry.{key}"), why);
        }
        if let Err(error) = tracing_subscriber::EnvFilter::try_new(&self.logging.level) {
            return invalid("logging.level", &error.to_string());
        }
        Ok(())
    }

    /// `identity.trust` against where the proxy listens and what it sends upstream.
    fn validate_trust(&self) -> Result<(), Error> {
        let identity = &self.identity;
        let listen = self.server.listen;
        if identity.trust == Trust::Headers
            && !listen.ip().is_loopback()
            && !identity.allow_headers_off_loopback
        {
            return Err(Error::Config {
                path: "identity.trust".into(),
                message: format!(
                    "`headers` believes the x-engram-* identity headers of every client, so any \
                     client that reaches server.listen ({listen}) could read any user's memory; \
                     it needs a loopback server.listen (a sidecar). Use identity.trust: \
                     client_keys or signed, or set identity.allow_headers_off_loopback: true if \
                     only trusted clients can reach {listen}"
                ),
            });
        }
        if identity.trust == Trust::ClientKeys && self.upstream.api_key_env.is_none() {
            return Err(Error::Config {
                path: "upstream.api_key_env".into(),
                message: "identity.trust: client_keys needs engram's own upstream key: a client \
                          key is a credential for engram and is never forwarded upstream"
                    .into(),
            });
        }
        Ok(())
    }

    pub fn hot_path_deadline(&self) -> Duration {
        Duration::from_millis(self.store.hot_path_deadline_ms)
    }

    pub fn drain_timeout(&self) -> Duration {
        Duration::from_millis(self.server.drain_timeout_ms)
    }
}

fn parse_yaml(text: &str) -> Result<Value, Error> {
    if text.trim().is_empty() {
        return Ok(Value::Object(Map::new()));
    }
    let value: Value = serde_saphyr::from_str(text).map_err(|error| Error::Config {
        path: "<file>".to_owned(),
        message: error.to_string(),
    })?;
    match value {
        Value::Null => Ok(Value::Object(Map::new())),
        Value::Object(_) => Ok(value),
        _ => Err(Error::Config {
            path: "<file>".to_owned(),
            message: "the top level must be a mapping of sections".to_owned(),
        }),
    }
}

/// `ENGRAM_SERVER__LISTEN=0.0.0.0:8080` sets `server.listen`. Variables without the `__`
/// separator (such as `ENGRAM_ADMIN_TOKEN`) are not config keys and are left alone.
fn apply_env_overrides(
    tree: &mut Value,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<(), Error> {
    let mut overrides: Vec<(String, String)> = env
        .into_iter()
        .filter(|(key, _)| key.starts_with(ENV_PREFIX) && key.contains(ENV_SEPARATOR))
        .collect();
    overrides.sort();
    for (key, raw) in overrides {
        let path: Vec<String> = key[ENV_PREFIX.len()..]
            .split(ENV_SEPARATOR)
            .map(str::to_ascii_lowercase)
            .collect();
        let mut node = &mut *tree;
        for (depth, segment) in path.iter().enumerate() {
            let Value::Object(map) = node else {
                return Err(Error::Config {
                    path: path[..depth].join("."),
                    message: format!("{key} descends into a value that is not a section"),
                });
            };
            node = map
                .entry(segment.clone())
                .or_insert_with(|| Value::Object(Map::new()));
        }
        *node = scalar(&raw);
    }
    Ok(())
}

/// Reads an env value the way YAML would read a plain scalar.
fn scalar(raw: &str) -> Value {
    match raw {
        "" | "null" | "~" => Value::Null,
        "true" => Value::Bool(true),
        "false" => Value::Bool(false),
        _ => raw
            .parse::<u64>()
            .map(Value::from)
            .or_else(|_| raw.parse::<i64>().map(Value::from))
            .or_else(|_| raw.parse::<f64>().map(Value::from))
            .unwrap_or_else(|_| Value::String(raw.to_owned())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn no_env() -> Vec<(String, String)> {
        Vec::new()
    }

    #[test]
    fn the_documented_config_file_is_exactly_the_defaults() {
        // The repository's config.yaml, two folders above this crate.
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../config.yaml");
        let config = Config::load(Some(&path), no_env()).unwrap();
        assert_eq!(config, Config::default());
    }

    #[test]
    fn unknown_keys_are_rejected_with_their_path() {
        let error = Config::from_yaml("server:\n  listne: 1.2.3.4:5\n").unwrap_err();
        let text = error.to_string();
        assert!(text.contains("server"), "{text}");
        assert!(text.contains("listne"), "{text}");
    }

    #[test]
    fn bad_values_are_rejected_with_their_path() {
        let error = Config::from_yaml("upstream:\n  connect_timeout_ms: soon\n").unwrap_err();
        assert!(
            error.to_string().contains("upstream.connect_timeout_ms"),
            "{error}"
        );
        let error = Config::from_yaml("upstream:\n  base_url: ftp://x\n").unwrap_err();
        assert!(error.to_string().contains("upstream.base_url"), "{error}");
        let error = Config::from_yaml("logging:\n  format: xml\n").unwrap_err();
        assert!(error.to_string().contains("logging.format"), "{error}");
        let error = Config::from_yaml("store:\n  data_dir: ''\n").unwrap_err();
        assert!(error.to_string().contains("store.data_dir"), "{error}");
        let error = Config::from_yaml("store:\n  backend: postgres\n").unwrap_err();
        assert!(error.to_string().contains("store.backend"), "{error}");
        let error = Config::from_yaml("store:\n  redis_url: localhost:6379\n").unwrap_err();
        assert!(error.to_string().contains("store.redis_url"), "{error}");
        let error = Config::from_yaml("memory:\n  new_fraction: 1.5\n").unwrap_err();
        assert!(error.to_string().contains("memory.new_fraction"), "{error}");
        let error =
            Config::from_yaml("memory:\n  depth:\n    max_message_bytes: 100\n").unwrap_err();
        assert!(
            error.to_string().contains("memory.depth.max_message_bytes"),
            "{error}"
        );
        let error = Config::from_yaml("memory:\n  weights:\n    recnecy: 1\n").unwrap_err();
        assert!(error.to_string().contains("memory.weights"), "{error}");
        let error = Config::from_yaml("summarizer:\n  base_url: nowhere\n").unwrap_err();
        assert!(error.to_string().contains("summarizer.base_url"), "{error}");
        let error = Config::from_yaml("store:\n  spool_max_bytes: 0\n").unwrap_err();
        assert!(
            error.to_string().contains("store.spool_max_bytes"),
            "{error}"
        );
        let error = Config::from_yaml("worker:\n  concurrency: 0\n").unwrap_err();
        assert!(error.to_string().contains("worker.concurrency"), "{error}");
        let error = Config::from_yaml("telemetry:\n  sample_ratio: 2\n").unwrap_err();
        assert!(
            error.to_string().contains("telemetry.sample_ratio"),
            "{error}"
        );
        let error = Config::from_yaml("identity:\n  default_tenant: 'a b'\n").unwrap_err();
        assert!(
            error.to_string().contains("identity.default_tenant"),
            "{error}"
        );
    }

    #[test]
    fn the_redis_backend_can_be_chosen_from_the_environment() {
        let env = vec![
            ("ENGRAM_STORE__BACKEND".to_owned(), "redis".to_owned()),
            (
                "ENGRAM_STORE__REDIS_URL".to_owned(),
                "redis://cache:6380".to_owned(),
            ),
        ];
        let config = Config::load(None, env).unwrap();
        assert_eq!(config.store.backend, StoreBackend::Redis);
        assert_eq!(config.store.redis_url, "redis://cache:6380");
    }

    #[test]
    fn a_redis_cluster_is_a_list_of_nodes_and_only_a_cluster_takes_several() {
        let env = |cluster: &str, url: &str| {
            vec![
                ("ENGRAM_STORE__REDIS_CLUSTER".to_owned(), cluster.to_owned()),
                ("ENGRAM_STORE__REDIS_URL".to_owned(), url.to_owned()),
            ]
        };
        let nodes = "redis://10.0.0.1:6379, redis://10.0.0.2:6379";
        let config = Config::load(None, env("true", nodes)).unwrap();
        assert!(config.store.redis_cluster);
        let error = Config::load(None, env("false", nodes)).unwrap_err();
        assert!(error.to_string().contains("store.redis_url"), "{error}");
        let error = Config::load(None, env("true", "unix:///tmp/redis.sock")).unwrap_err();
        assert!(error.to_string().contains("store.redis_url"), "{error}");
        let error = Config::from_yaml("store:\n  redis_queue_shards: 0\n").unwrap_err();
        assert!(error.to_string().contains("redis_queue_shards"), "{error}");
        let error =
            Config::from_yaml("store:\n  redis_wait_replicas: 1\n  redis_wait_timeout_ms: 5000\n")
                .unwrap_err();
        assert!(
            error.to_string().contains("redis_wait_timeout_ms"),
            "{error}"
        );
    }

    #[test]
    fn the_data_directory_can_come_from_the_environment() {
        let env = vec![(
            "ENGRAM_STORE__DATA_DIR".to_owned(),
            "/var/lib/engram".to_owned(),
        )];
        let config = Config::load(None, env).unwrap();
        assert_eq!(config.store.data_dir, PathBuf::from("/var/lib/engram"));
    }

    #[test]
    fn env_overrides_win_over_the_file_and_ignore_plain_vars() {
        let env = vec![
            (
                "ENGRAM_SERVER__LISTEN".to_owned(),
                "127.0.0.2:9999".to_owned(),
            ),
            (
                "ENGRAM_UPSTREAM__READ_TIMEOUT_MS".to_owned(),
                "1234".to_owned(),
            ),
            ("ENGRAM_ADMIN_TOKEN".to_owned(), "secret".to_owned()),
            ("OTHER__THING".to_owned(), "x".to_owned()),
        ];
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.yaml");
        std::fs::write(&file, "server:\n  listen: 127.0.0.1:1\n").unwrap();
        let config = Config::load(Some(&file), env).unwrap();
        assert_eq!(config.server.listen.port(), 9999);
        assert_eq!(config.upstream.read_timeout_ms, 1234);
    }

    #[test]
    fn headers_trust_needs_a_loopback_listen_unless_forced() {
        let env = |pairs: &[(&str, &str)]| {
            pairs
                .iter()
                .map(|(key, value)| ((*key).to_owned(), (*value).to_owned()))
                .collect::<Vec<_>>()
        };
        let open = ("ENGRAM_SERVER__LISTEN", "0.0.0.0:8080");
        let error = Config::load(None, env(&[open])).unwrap_err().to_string();
        for needle in [
            "identity.trust",
            "0.0.0.0:8080",
            "client_keys",
            "allow_headers_off_loopback",
        ] {
            assert!(error.contains(needle), "{error}");
        }
        let forced = ("ENGRAM_IDENTITY__ALLOW_HEADERS_OFF_LOOPBACK", "true");
        assert!(Config::load(None, env(&[open, forced])).is_ok());
        for loopback in ["127.0.0.1:8080", "[::1]:8080"] {
            let listen = ("ENGRAM_SERVER__LISTEN", loopback);
            assert!(Config::load(None, env(&[listen])).is_ok(), "{loopback}");
        }
        // Other modes may listen anywhere; client keys need engram's own upstream key.
        let keys = ("ENGRAM_IDENTITY__TRUST", "client_keys");
        let error = Config::load(None, env(&[open, keys])).unwrap_err();
        assert!(
            error.to_string().contains("upstream.api_key_env"),
            "{error}"
        );
        let upstream_key = ("ENGRAM_UPSTREAM__API_KEY_ENV", "UPSTREAM_API_KEY");
        let config = Config::load(None, env(&[open, keys, upstream_key])).unwrap();
        assert_eq!(config.identity.trust, Trust::ClientKeys);
        let signed = ("ENGRAM_IDENTITY__TRUST", "signed");
        assert!(Config::load(None, env(&[open, signed])).is_ok());
        let error = Config::from_yaml("identity:\n  trust: anyone\n").unwrap_err();
        assert!(error.to_string().contains("identity.trust"), "{error}");
    }

    #[test]
    fn a_mistyped_env_override_is_rejected_by_name() {
        let env = vec![("ENGRAM_SERVER__LISTNE".to_owned(), "x".to_owned())];
        let error = Config::load(None, env).unwrap_err();
        assert!(error.to_string().contains("listne"), "{error}");
    }
}
