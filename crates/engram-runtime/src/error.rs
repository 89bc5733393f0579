//! One error type for the whole proxy. Each variant says, in one place, its HTTP status, its
//! OpenAI error `type`/`code`, and the level it is logged at; rendering it as a response logs it,
//! so an error that reaches a client can never go unlogged.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full, combinators::BoxBody};
use serde::Serialize;

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The body type every response of the proxy uses.
pub type ProxyBody = BoxBody<Bytes, BodyError>;

/// Errors that can end a response body mid-way (upstream reset, idle timeout).
pub type BodyError = Box<dyn std::error::Error + Send + Sync>;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("We could not parse the JSON body of your request: {message}")]
    InvalidJson {
        message: String,
        /// Dotted path of the offending field, when the JSON was well-formed but a field was not.
        param: Option<String>,
    },
    #[error("{message}")]
    InvalidRequest {
        message: String,
        param: Option<String>,
    },
    #[error("Unsupported content type `{0}`; send `application/json`.")]
    UnsupportedMediaType(String),
    #[error("The request body is larger than the configured limit of {limit} bytes.")]
    PayloadTooLarge { limit: u64 },
    #[error("Unknown route: {method} {path}")]
    NotFound { method: String, path: String },
    /// A route that exists, naming a record that does not (an unknown job, say).
    #[error("{0}")]
    ResourceNotFound(String),
    #[error("Method {method} is not allowed on {path}.")]
    MethodNotAllowed { method: String, path: String },
    #[error("Missing or invalid bearer token.")]
    Unauthorized,
    /// A proxied request without a known client key (`identity.trust: client_keys`); shaped
    /// like OpenAI's answer to a bad key, so SDKs raise their authentication error.
    #[error("{0}")]
    InvalidApiKey(String),
    /// A proxied request whose `x-engram-identity` is missing where required, malformed,
    /// expired or badly signed (`identity.trust: signed`).
    #[error("{0}")]
    InvalidIdentity(String),
    /// A valid credential that does not reach this resource (a tenant's admin token used for
    /// another tenant).
    #[error("{0}")]
    Forbidden(String),
    /// The request contradicts the current state of the resource.
    #[error("{0}")]
    Conflict(String),
    #[error("Rate limit exceeded; retry after {retry_after_secs} s.")]
    RateLimited { retry_after_secs: u64 },
    #[error("The upstream could not be reached: {0}")]
    UpstreamUnreachable(String),
    #[error("The upstream did not respond within {0:?}.")]
    UpstreamTimeout(Duration),
    #[error("The upstream failed mid-response: {0}")]
    UpstreamFailed(String),
    #[error("The proxy is shutting down.")]
    ShuttingDown,
    /// At `server.max_connections`: a connection from the reserve gets only the ops routes.
    #[error("The proxy is at its limit of {max_connections} connections; retry shortly.")]
    TooManyConnections { max_connections: usize },
    #[error("invalid configuration at `{path}`: {message}")]
    Config { path: String, message: String },
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    #[error("internal error: {0}")]
    Internal(String),
    /// The memory store failed (I/O, corrupt record, a blocking task that died).
    #[error("store error: {0}")]
    Store(String),
    /// An optimistic write lost a race: the stored memory version moved since it was read.
    #[error("store conflict: expected memory version {expected}, found {found}")]
    StoreConflict { expected: u64, found: u64 },
    /// A job being committed no longer exists: its user was forgotten meanwhile.
    #[error("job {0} no longer exists (its user was forgotten)")]
    JobGone(String),
}

/// OpenAI's error envelope: `{"error":{"message","type","param","code"}}`.
#[derive(Debug, Serialize)]
pub struct ErrorEnvelope<'a> {
    pub error: ErrorObject<'a>,
}

#[derive(Debug, Serialize)]
pub struct ErrorObject<'a> {
    pub message: String,
    #[serde(rename = "type")]
    pub kind: &'a str,
    pub param: Option<&'a str>,
    pub code: Option<&'a str>,
}

impl Error {
    pub fn invalid_request(message: impl Into<String>, param: Option<&str>) -> Self {
        Error::InvalidRequest {
            message: message.into(),
            param: param.map(str::to_owned),
        }
    }

    pub fn status_code(&self) -> StatusCode {
        match self {
            Error::InvalidJson { .. } | Error::InvalidRequest { .. } => StatusCode::BAD_REQUEST,
            Error::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Error::PayloadTooLarge { .. } => StatusCode::PAYLOAD_TOO_LARGE,
            Error::NotFound { .. } | Error::ResourceNotFound(_) => StatusCode::NOT_FOUND,
            Error::MethodNotAllowed { .. } => StatusCode::METHOD_NOT_ALLOWED,
            Error::Unauthorized | Error::InvalidApiKey(_) | Error::InvalidIdentity(_) => {
                StatusCode::UNAUTHORIZED
            }
            Error::Forbidden(_) => StatusCode::FORBIDDEN,
            Error::Conflict(_) => StatusCode::CONFLICT,
            Error::RateLimited { .. } => StatusCode::TOO_MANY_REQUESTS,
            Error::UpstreamUnreachable(_) | Error::UpstreamFailed(_) => StatusCode::BAD_GATEWAY,
            Error::UpstreamTimeout(_) => StatusCode::GATEWAY_TIMEOUT,
            Error::ShuttingDown | Error::TooManyConnections { .. } => {
                StatusCode::SERVICE_UNAVAILABLE
            }
            Error::Config { .. }
            | Error::Io(_)
            | Error::Internal(_)
            | Error::Store(_)
            | Error::StoreConflict { .. }
            | Error::JobGone(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// A low-cardinality name of the error for traces and metrics: its OpenAI `code`, else
    /// its `type`.
    pub fn error_type(&self) -> &'static str {
        self.code().unwrap_or_else(|| self.kind())
    }

    /// OpenAI's `error.type`.
    fn kind(&self) -> &'static str {
        match self {
            Error::InvalidJson { .. }
            | Error::InvalidRequest { .. }
            | Error::UnsupportedMediaType(_)
            | Error::PayloadTooLarge { .. }
            | Error::NotFound { .. }
            | Error::ResourceNotFound(_)
            | Error::MethodNotAllowed { .. }
            | Error::Conflict(_)
            | Error::InvalidApiKey(_)
            | Error::InvalidIdentity(_) => "invalid_request_error",
            Error::Unauthorized => "authentication_error",
            Error::Forbidden(_) => "permission_error",
            Error::RateLimited { .. } => "rate_limit_error",
            Error::UpstreamUnreachable(_)
            | Error::UpstreamTimeout(_)
            | Error::UpstreamFailed(_) => "upstream_error",
            Error::ShuttingDown | Error::TooManyConnections { .. } => "service_unavailable",
            Error::Config { .. }
            | Error::Io(_)
            | Error::Internal(_)
            | Error::Store(_)
            | Error::StoreConflict { .. }
            | Error::JobGone(_) => "server_error",
        }
    }

    /// OpenAI's `error.code`.
    fn code(&self) -> Option<&'static str> {
        Some(match self {
            Error::InvalidJson { .. } => "invalid_json",
            Error::InvalidRequest { .. } => return None,
            Error::UnsupportedMediaType(_) => "unsupported_media_type",
            Error::PayloadTooLarge { .. } => "request_too_large",
            Error::NotFound { .. } | Error::ResourceNotFound(_) => "not_found",
            Error::MethodNotAllowed { .. } => "method_not_allowed",
            Error::Unauthorized | Error::InvalidApiKey(_) => "invalid_api_key",
            Error::InvalidIdentity(_) => "invalid_identity",
            Error::Forbidden(_) => "forbidden",
            Error::Conflict(_) => "conflict",
            Error::RateLimited { .. } => "rate_limit_exceeded",
            Error::UpstreamUnreachable(_) => "upstream_unreachable",
            Error::UpstreamFailed(_) => "upstream_stream_failed",
            Error::UpstreamTimeout(_) => "upstream_timeout",
            Error::ShuttingDown => "shutting_down",
            Error::TooManyConnections { .. } => "too_many_connections",
            Error::Store(_) => "store_error",
            Error::StoreConflict { .. } => "store_conflict",
            Error::JobGone(_) => "job_gone",
            Error::Config { .. } | Error::Io(_) | Error::Internal(_) => return None,
        })
    }

    fn param(&self) -> Option<&str> {
        match self {
            Error::InvalidJson { param, .. } | Error::InvalidRequest { param, .. } => {
                param.as_deref()
            }
            _ => None,
        }
    }

    fn log(&self) {
        let status = self.status_code().as_u16();
        if self.status_code().is_server_error() {
            tracing::warn!(status, error = %self, "request failed");
        } else {
            tracing::debug!(status, error = %self, "request rejected");
        }
    }

    /// The OpenAI-shaped JSON body of this error.
    pub fn to_json(&self) -> Vec<u8> {
        let envelope = ErrorEnvelope {
            error: ErrorObject {
                message: self.to_string(),
                kind: self.kind(),
                param: self.param(),
                code: self.code(),
            },
        };
        // Serialising a struct of strings cannot fail; fall back to a fixed body all the same.
        serde_json::to_vec(&envelope)
            .unwrap_or_else(|_| br#"{"error":{"message":"internal error"}}"#.to_vec())
    }

    /// Renders (and logs) the error as an HTTP response.
    pub fn into_response(self) -> Response<ProxyBody> {
        self.log();
        let mut response = Response::new(full_body(self.to_json()));
        *response.status_mut() = self.status_code();
        response.headers_mut().insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        if let Error::RateLimited { retry_after_secs } = self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(retry_after_secs));
        }
        response
    }
}

/// Parses a JSON request body, naming the byte position or the field path of the first problem
/// (`InvalidJson`, a 400).
pub fn decode_json<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T> {
    Ok(engram_memory::error::decode_json(body)?)
}

/// The engine's errors (a chat request the wire types reject) as the proxy's.
impl From<engram_memory::Error> for Error {
    fn from(error: engram_memory::Error) -> Self {
        match error {
            engram_memory::Error::InvalidJson { message, param } => {
                Error::InvalidJson { message, param }
            }
            engram_memory::Error::InvalidRequest { message, param } => {
                Error::InvalidRequest { message, param }
            }
            engram_memory::Error::Internal(message) => Error::Internal(message),
        }
    }
}

/// A complete in-memory body in the proxy's body type.
pub fn full_body(bytes: impl Into<Bytes>) -> ProxyBody {
    Full::new(bytes.into())
        .map_err(|never| match never {})
        .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_with_data_after_its_json_is_malformed() {
        #[derive(serde::Deserialize)]
        struct Body {
            #[allow(dead_code, reason = "only decoded")]
            model: String,
        }
        assert!(decode_json::<Body>(br#"{"model":"m"} "#).is_ok());
        for body in [&br#"{"model":"m"}{"model":"n"}"#[..], br#"{"model":"m"} x"#] {
            match decode_json::<Body>(body) {
                Err(Error::InvalidJson { message, .. }) => {
                    assert!(message.contains("trailing"), "{message}");
                }
                Err(error) => panic!("{error}"),
                Ok(_) => panic!("accepted {}", String::from_utf8_lossy(body)),
            }
        }
    }

    #[test]
    fn renders_openai_shape_with_status() {
        let error = Error::InvalidJson {
            message: "expected value at line 1 column 2".into(),
            param: None,
        };
        assert_eq!(error.status_code(), StatusCode::BAD_REQUEST);
        let value: serde_json::Value = serde_json::from_slice(&error.to_json()).unwrap();
        assert_eq!(value["error"]["type"], "invalid_request_error");
        assert_eq!(value["error"]["code"], "invalid_json");
        assert!(value["error"]["param"].is_null());
        assert!(
            value["error"]["message"]
                .as_str()
                .unwrap()
                .contains("line 1 column 2")
        );
    }

    #[test]
    fn rate_limit_carries_retry_after() {
        let response = Error::RateLimited {
            retry_after_secs: 3,
        }
        .into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "3");
    }

    #[test]
    fn every_status_matches_its_variant() {
        let cases = [
            (Error::UnsupportedMediaType("text/plain".into()), 415),
            (Error::PayloadTooLarge { limit: 1 }, 413),
            (Error::UpstreamUnreachable("refused".into()), 502),
            (Error::UpstreamFailed("reset".into()), 502),
            (Error::UpstreamTimeout(Duration::from_secs(1)), 504),
            (Error::Unauthorized, 401),
            (Error::InvalidApiKey("bad key".into()), 401),
            (Error::InvalidIdentity("expired".into()), 401),
        ];
        for (error, status) in cases {
            assert_eq!(error.status_code().as_u16(), status, "{error}");
        }
    }
}
