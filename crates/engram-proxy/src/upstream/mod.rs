//! The upstream client: pooled hyper connections over rustls (ring), with the configured
//! timeouts, and the header rules for what crosses from the client to the upstream and back.

use std::time::Duration;

use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Request, Response, Uri};
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};

use crate::error::{Error, ProxyBody};

mod config;

pub use config::UpstreamConfig;

/// What in `path` could take it out of the upstream's base path, on an upstream (or a proxy in
/// front of it) that normalises or decodes paths: a `.` or `..` segment (also percent-encoded,
/// or with `;` parameters, which some servers drop before resolving), an encoded slash or
/// backslash, a backslash, or an empty segment (`//`). `None` for a plain path; a trailing
/// slash is fine.
pub fn escape_in_path(path: &str) -> Option<&'static str> {
    if path.contains('\\') {
        return Some("a backslash");
    }
    if path.contains("//") {
        return Some("an empty segment");
    }
    let lower = path.to_ascii_lowercase();
    if lower.contains("%2f") || lower.contains("%5c") {
        return Some("an encoded slash");
    }
    let dot_segment = path.split('/').any(|segment| {
        let name = segment.split_once(';').map_or(segment, |(name, _)| name);
        matches!(percent_decoded(name).as_slice(), b"." | b"..")
    });
    dot_segment.then_some("a dot segment")
}

/// `text` with every `%XX` escape decoded (a malformed one kept as it is).
fn percent_decoded(text: &str) -> Vec<u8> {
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let escaped = (bytes[at] == b'%')
            .then(|| text.get(at + 1..at + 3))
            .flatten()
            .and_then(|hex| u8::from_str_radix(hex, 16).ok());
        match escaped {
            Some(byte) => {
                out.push(byte);
                at += 3;
            }
            None => {
                out.push(bytes[at]);
                at += 1;
            }
        }
    }
    out
}

/// Headers that describe one hop, never the request itself (RFC 9110 §7.6.1).
const HOP_BY_HOP: [HeaderName; 8] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHENTICATE,
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
];

/// Installs rustls' ring provider as the process default; call once at start.
pub fn install_crypto_provider() {
    // Err means a provider is already installed, which is what we want either way.
    let _ = rustls::crypto::ring::default_provider().install_default();
}

pub struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, ProxyBody>,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// The base URL's path without its trailing slash, e.g. `/v1`.
    path_prefix: String,
    api_key: Option<HeaderValue>,
    read_timeout: Duration,
}

impl Upstream {
    /// `api_key` is the value of the env var named by `upstream.api_key_env`, already read.
    pub fn new(config: &UpstreamConfig, api_key: Option<String>) -> Result<Self, Error> {
        install_crypto_provider();
        let base: Uri = config.base_url.parse().map_err(|_| Error::Config {
            path: "upstream.base_url".into(),
            message: "not a URL".into(),
        })?;
        let parts = base.into_parts();
        let (Some(scheme), Some(authority)) = (parts.scheme, parts.authority) else {
            return Err(Error::Config {
                path: "upstream.base_url".into(),
                message: "must be absolute".into(),
            });
        };
        let path_prefix = parts
            .path_and_query
            .map(|p| p.path().trim_end_matches('/').to_owned())
            .unwrap_or_default();

        let https = connector(Duration::from_millis(config.connect_timeout_ms));
        let client = client_builder()
            .pool_idle_timeout(Duration::from_millis(config.pool_idle_timeout_ms))
            .pool_max_idle_per_host(config.pool_max_idle_per_host)
            .build(https);

        let api_key =
            match api_key {
                Some(key) => {
                    let mut value = HeaderValue::try_from(format!("Bearer {}", key.trim()))
                        .map_err(|_| Error::Config {
                            path: "upstream.api_key_env".into(),
                            message: "the key holds characters not allowed in a header".into(),
                        })?;
                    value.set_sensitive(true);
                    Some(value)
                }
                None => None,
            };
        Ok(Upstream {
            client,
            scheme,
            authority,
            path_prefix,
            api_key,
            read_timeout: Duration::from_millis(config.read_timeout_ms),
        })
    }

    pub fn read_timeout(&self) -> Duration {
        self.read_timeout
    }

    /// Maps the part of a client path after `/v1` (e.g. `/chat/completions?x=1`) onto the base.
    /// A path that could leave the base (see [`escape_in_path`]) is a 400.
    pub fn uri_for(&self, rest: &str) -> Result<Uri, Error> {
        let path = rest.split_once('?').map_or(rest, |(path, _)| path);
        if let Some(what) = escape_in_path(path) {
            return Err(Error::invalid_request(
                format!(
                    "Invalid path: it holds {what}; engram forwards only plain paths, so a \
                     request cannot leave the upstream's base path."
                ),
                None,
            ));
        }
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.path_prefix, rest))
            .build()
            .map_err(|error| Error::invalid_request(format!("invalid path: {error}"), None))
    }

    /// The client's headers as they should reach the upstream: hop-by-hop headers, `host` and
    /// engram's own `x-engram-*` headers removed, and the configured key, if any, as
    /// `Authorization`.
    pub fn request_headers(&self, client: &HeaderMap) -> HeaderMap {
        let mut headers = without_hop_by_hop(client);
        headers.remove(header::HOST);
        let engram_headers: Vec<HeaderName> = headers
            .keys()
            .filter(|name| name.as_str().starts_with("x-engram-"))
            .cloned()
            .collect();
        for name in engram_headers {
            headers.remove(name);
        }
        if let Some(key) = &self.api_key {
            headers.insert(header::AUTHORIZATION, key.clone());
        }
        headers
    }

    /// Sends a request; waits at most the read timeout for the response headers.
    pub async fn send(&self, request: Request<ProxyBody>) -> Result<Response<Incoming>, Error> {
        match tokio::time::timeout(self.read_timeout, self.client.request(request)).await {
            Err(_) => Err(Error::UpstreamTimeout(self.read_timeout)),
            Ok(Ok(response)) => Ok(response),
            Ok(Err(error)) => Err(Error::UpstreamUnreachable(describe(&error))),
        }
    }
}

/// The innermost cause reads best ("Connection refused (os error 111)").
fn describe(error: &hyper_util::client::legacy::Error) -> String {
    let mut source: &dyn std::error::Error = error;
    while let Some(next) = source.source() {
        source = next;
    }
    if error.is_connect() {
        format!("connect failed: {source}")
    } else {
        source.to_string()
    }
}

/// A copy of `headers` without hop-by-hop headers, including any that `Connection` names.
pub fn without_hop_by_hop(headers: &HeaderMap) -> HeaderMap {
    let mut out = headers.clone();
    for value in headers.get_all(header::CONNECTION) {
        if let Ok(list) = value.to_str() {
            for name in list.split(',') {
                if let Ok(name) = HeaderName::try_from(name.trim()) {
                    out.remove(name);
                }
            }
        }
    }
    for name in &HOP_BY_HOP {
        out.remove(name);
    }
    out.remove(header::UPGRADE);
    out
}

/// A pooled client builder on tokio. The timer matters: without one the pool checks idleness
/// only when it hands a connection out, so idle connections were never closed (a burst left
/// `pool_max_idle_per_host` sockets open for good).
pub fn client_builder() -> hyper_util::client::legacy::Builder {
    let mut builder = Client::builder(TokioExecutor::new());
    builder.pool_timer(TokioTimer::new());
    builder
}

/// The outbound connector engram's HTTP clients share (upstream, summarizer): http or https
/// (rustls, webpki roots, HTTP/1.1 and HTTP/2 by ALPN), TCP_NODELAY, keep-alive.
pub fn connector(connect_timeout: Duration) -> HttpsConnector<HttpConnector> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    // Without TCP_NODELAY small requests wait on Nagle + delayed ACK (p99 of 8 ms measured).
    http.set_nodelay(true);
    http.set_connect_timeout(Some(connect_timeout));
    http.set_keepalive(Some(Duration::from_secs(60)));
    HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1()
        .enable_http2()
        .wrap_connector(http)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn upstream(base: &str, key: Option<&str>) -> Upstream {
        let config = UpstreamConfig {
            base_url: base.into(),
            ..UpstreamConfig::default()
        };
        Upstream::new(&config, key.map(str::to_owned)).unwrap()
    }

    #[tokio::test]
    async fn paths_are_joined_onto_the_base() {
        let up = upstream("http://127.0.0.1:9/v1/", None);
        assert_eq!(
            up.uri_for("/chat/completions?a=1").unwrap().to_string(),
            "http://127.0.0.1:9/v1/chat/completions?a=1"
        );
        let up = upstream("https://example.com", None);
        assert_eq!(
            up.uri_for("/models").unwrap().to_string(),
            "https://example.com/models"
        );
    }

    #[tokio::test]
    async fn paths_that_could_leave_the_base_are_refused() {
        let up = upstream("http://127.0.0.1:9/tenant-a/v1", None);
        for rest in [
            "/../../tenant-b/v1/models",
            "/./models",
            "/models/..",
            "/models/.",
            "/%2e%2e/tenant-b",
            "/%2E%2E/tenant-b",
            "/.%2e/x",
            "/%2e/x",
            "/..;/x",
            "/.;x=1/y",
            "/models%2f..%2fx",
            "/models%2F..",
            "/a%5cb",
            "/a%5C..%5Cb",
            "/a\\..\\b",
            "//models",
            "/models//x",
            "/../x?y=1",
        ] {
            let error = up.uri_for(rest).unwrap_err();
            assert_eq!(error.status_code(), 400, "{rest}");
            assert!(error.to_string().contains("Invalid path"), "{error}");
        }
        for rest in [
            "/models",
            "/models/",
            "/",
            "/files/file-abc.jsonl/content",
            "/models/gpt-4o...",
            "/.well-known",
            "/a%2eb",
            "/models?next=../..",
            "/models?x=a//b",
        ] {
            assert!(up.uri_for(rest).is_ok(), "{rest}");
        }
        assert_eq!(
            up.uri_for("/models?after=a%2Fb").unwrap().to_string(),
            "http://127.0.0.1:9/tenant-a/v1/models?after=a%2Fb"
        );
    }

    #[tokio::test]
    async fn client_authorization_is_kept_unless_a_key_is_configured() {
        let mut client = HeaderMap::new();
        client.insert(
            header::AUTHORIZATION,
            HeaderValue::from_static("Bearer client"),
        );
        client.insert(
            header::CONNECTION,
            HeaderValue::from_static("keep-alive, x-drop"),
        );
        client.insert("x-drop", HeaderValue::from_static("1"));
        client.insert("x-engram-user", HeaderValue::from_static("alice"));
        client.insert("x-keep", HeaderValue::from_static("1"));
        client.insert(header::HOST, HeaderValue::from_static("engram:8080"));

        let forwarded = upstream("http://127.0.0.1:9/v1", None).request_headers(&client);
        assert_eq!(forwarded[header::AUTHORIZATION], "Bearer client");
        assert!(forwarded.get("x-drop").is_none());
        assert!(forwarded.get(header::CONNECTION).is_none());
        assert!(forwarded.get("x-engram-user").is_none());
        assert!(forwarded.get(header::HOST).is_none());
        assert_eq!(forwarded["x-keep"], "1");

        let forwarded =
            upstream("http://127.0.0.1:9/v1", Some("sk-server")).request_headers(&client);
        assert_eq!(forwarded[header::AUTHORIZATION], "Bearer sk-server");
        assert!(forwarded[header::AUTHORIZATION].is_sensitive());
    }

    #[tokio::test]
    async fn a_refused_connection_is_a_502() {
        // Port 9 (discard) on loopback is closed on test machines.
        let up = upstream("http://127.0.0.1:9/v1", None);
        let request = Request::get(up.uri_for("/models").unwrap())
            .body(crate::error::full_body(""))
            .unwrap();
        let error = up.send(request).await.unwrap_err();
        assert_eq!(
            error.status_code(),
            http::StatusCode::BAD_GATEWAY,
            "{error}"
        );
    }
}
