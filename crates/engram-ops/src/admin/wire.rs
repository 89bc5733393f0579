//! Request and response plumbing of the management API: path and query decoding, bounded JSON
//! bodies, JSON responses.

use bytes::Bytes;
use http::{Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::Value;

use crate::error::{Error, ProxyBody, decode_json, full_body};

/// Largest admin request body.
pub const MAX_BODY_BYTES: usize = 64 * 1024;

/// Decodes `%XX` escapes (and, in a query, `+` as a space); the result must be UTF-8.
pub fn percent_decode(text: &str, plus_is_space: bool) -> Result<String, Error> {
    let bad = || Error::invalid_request(format!("invalid percent-encoding in `{text}`"), None);
    let bytes = text.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        match bytes[at] {
            b'%' => {
                let hex = text.get(at + 1..at + 3).ok_or_else(bad)?;
                out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
                at += 3;
            }
            b'+' if plus_is_space => {
                out.push(b' ');
                at += 1;
            }
            byte => {
                out.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// The query's `name=value` pairs, decoded, each name at most once and among `known`.
pub fn query_params(query: Option<&str>, known: &[&str]) -> Result<Vec<(String, String)>, Error> {
    let mut params: Vec<(String, String)> = Vec::new();
    for pair in query
        .unwrap_or("")
        .split('&')
        .filter(|pair| !pair.is_empty())
    {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let name = percent_decode(name, true)?;
        if !known.contains(&name.as_str()) {
            return Err(Error::invalid_request(
                format!(
                    "Unknown query parameter `{name}`; this route takes {}.",
                    if known.is_empty() {
                        "none".to_owned()
                    } else {
                        known.join(", ")
                    }
                ),
                Some(&name),
            ));
        }
        if params.iter().any(|(known, _)| *known == name) {
            return Err(Error::invalid_request(
                format!("Query parameter `{name}` is given twice."),
                Some(&name),
            ));
        }
        let value = percent_decode(value, true)?;
        params.push((name, value));
    }
    Ok(params)
}

/// Reads a JSON body of at most `MAX_BODY_BYTES`.
pub async fn read_json<T: serde::de::DeserializeOwned>(
    request: Request<Incoming>,
) -> Result<T, Error> {
    let body = http_body_util::Limited::new(request.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
        .map_err(|error| {
            if error.is::<http_body_util::LengthLimitError>() {
                Error::PayloadTooLarge {
                    limit: MAX_BODY_BYTES as u64,
                }
            } else {
                Error::invalid_request(format!("could not read the request body: {error}"), None)
            }
        })?
        .to_bytes();
    decode_json(&body)
}

pub fn json_response(status: StatusCode, body: &Value) -> Response<ProxyBody> {
    bytes_response(status, Bytes::from(body.to_string()))
}

pub fn bytes_response(status: StatusCode, body: impl Into<Bytes>) -> Response<ProxyBody> {
    let mut response = Response::new(full_body(body.into()));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_and_queries_are_percent_decoded() {
        assert_eq!(percent_decode("a%40b.c", false).unwrap(), "a@b.c");
        assert_eq!(percent_decode("fact%3A3", false).unwrap(), "fact:3");
        assert_eq!(percent_decode("a+b", false).unwrap(), "a+b");
        assert_eq!(percent_decode("a+b%20c", true).unwrap(), "a b c");
        assert!(percent_decode("a%4", false).is_err());
        assert!(percent_decode("a%zz", false).is_err());
        assert!(percent_decode("%ff", false).is_err());
    }

    #[test]
    fn queries_take_known_names_once() {
        let params = query_params(Some("q=sour+dough&limit=5"), &["q", "limit"]).unwrap();
        assert_eq!(
            params,
            [
                ("q".to_owned(), "sour dough".to_owned()),
                ("limit".to_owned(), "5".to_owned())
            ]
        );
        assert!(query_params(None, &[]).unwrap().is_empty());
        assert!(query_params(Some("lmit=5"), &["limit"]).is_err());
        assert!(query_params(Some("q=a&q=b"), &["q"]).is_err());
    }
}
