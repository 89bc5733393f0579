//! A small HTTP client for the summarizer's one endpoint: hyper over rustls (ring, webpki roots)
//! with TCP_NODELAY, like the upstream client, but with its own pool, URL and key.

use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderValue};
use http::{Request, StatusCode, Uri};
use http_body_util::{BodyExt, Full, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;

use crate::error::Error;

/// A summary reply is a few hundred bytes; anything near this is not one.
const MAX_RESPONSE_BYTES: usize = 1024 * 1024;

pub(super) struct ChatClient {
    http: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    uri: Uri,
    authorization: Option<HeaderValue>,
}

impl ChatClient {
    /// `base_url` was validated by `SummarizerConfig::validate`.
    pub(super) fn new(
        base_url: &str,
        api_key: Option<&str>,
        connect_timeout: Duration,
    ) -> Result<ChatClient, Error> {
        crate::upstream::install_crypto_provider();
        let invalid = |path: &str, message: &str| Error::Config {
            path: path.into(),
            message: message.into(),
        };
        let uri: Uri = format!("{}/chat/completions", base_url.trim_end_matches('/'))
            .parse()
            .map_err(|_| invalid("summarizer.base_url", "not a URL"))?;

        let https = crate::upstream::connector(connect_timeout);
        let http = crate::upstream::client_builder()
            .pool_idle_timeout(Duration::from_secs(90))
            .build(https);

        let authorization = match api_key {
            Some(key) => {
                let mut value =
                    HeaderValue::try_from(format!("Bearer {}", key.trim())).map_err(|_| {
                        invalid(
                            "summarizer.api_key_env",
                            "the key holds characters not allowed in a header",
                        )
                    })?;
                value.set_sensitive(true);
                Some(value)
            }
            None => None,
        };
        Ok(ChatClient {
            http,
            uri,
            authorization,
        })
    }

    /// POSTs a JSON body to `/chat/completions`; returns the status and the whole body. The
    /// caller bounds the time. Errors are transport failures, described without the payload.
    pub(super) async fn post(&self, body: Bytes) -> Result<(StatusCode, Bytes), String> {
        let mut request = Request::post(self.uri.clone())
            .header(header::CONTENT_TYPE, "application/json")
            .header(header::ACCEPT, "application/json")
            .body(Full::new(body))
            .map_err(|error| error.to_string())?;
        if let Some(authorization) = &self.authorization {
            request
                .headers_mut()
                .insert(header::AUTHORIZATION, authorization.clone());
        }
        let response = self
            .http
            .request(request)
            .await
            .map_err(|error| innermost(&error))?;
        let status = response.status();
        let body = Limited::new(response.into_body(), MAX_RESPONSE_BYTES)
            .collect()
            .await
            .map_err(|error| error.to_string())?
            .to_bytes();
        Ok((status, body))
    }
}

/// The innermost cause reads best ("Connection refused (os error 111)").
fn innermost(error: &(dyn std::error::Error + 'static)) -> String {
    let mut source = error;
    while let Some(next) = source.source() {
        source = next;
    }
    source.to_string()
}
