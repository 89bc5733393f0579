//! The `engram admin …` client: turns a subcommand into a call of a running proxy's management
//! API, over the same pooled hyper client engram uses upstream.

use std::time::Duration;

use bytes::Bytes;
use http::{Method, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

use crate::cli::{AdminCommand, ItemAction, ItemFilterArgs};
use crate::error::Error;

const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// A forget or an export of a large memory takes a while; a call past this has hung.
const CALL_TIMEOUT: Duration = Duration::from_secs(120);

/// One management API call.
#[derive(Debug, Clone, PartialEq)]
pub struct ApiCall {
    pub method: Method,
    /// Path and query, from `/engram/v1/`.
    pub path: String,
    pub body: Option<Value>,
}

impl ApiCall {
    fn get(path: String) -> ApiCall {
        ApiCall {
            method: Method::GET,
            path,
            body: None,
        }
    }

    fn with(method: Method, path: String, body: Option<Value>) -> ApiCall {
        ApiCall { method, path, body }
    }
}

/// The call a subcommand makes.
pub fn call_for(command: &AdminCommand) -> Result<ApiCall, Error> {
    let user = |user: &str| format!("/engram/v1/users/{}", encode(user));
    Ok(match command {
        AdminCommand::Queue => ApiCall::get("/engram/v1/queue".into()),
        AdminCommand::Openapi => ApiCall::get("/engram/v1/openapi.json".into()),
        AdminCommand::Job { user: id, job } => {
            ApiCall::get(format!("{}/jobs/{}", user(id), encode(job)))
        }
        AdminCommand::Export { user: id } => ApiCall::get(format!("{}/memory", user(id))),
        AdminCommand::Items { user: id, filter } => {
            ApiCall::get(format!("{}/items{}", user(id), query(None, filter)))
        }
        AdminCommand::Search {
            user: id,
            query: text,
            filter,
        } => ApiCall::get(format!("{}/items{}", user(id), query(Some(text), filter))),
        AdminCommand::Item { action } => match action {
            ItemAction::Get { user: id, item } => {
                ApiCall::get(format!("{}/items/{}", user(id), encode(item)))
            }
            ItemAction::Edit {
                user: id,
                item,
                text,
            } => ApiCall::with(
                Method::PATCH,
                format!("{}/items/{}", user(id), encode(item)),
                Some(json!({ "text": text })),
            ),
            ItemAction::Delete { user: id, item } => ApiCall::with(
                Method::DELETE,
                format!("{}/items/{}", user(id), encode(item)),
                None,
            ),
        },
        AdminCommand::Pin {
            user: id,
            text,
            item,
        } => ApiCall::with(
            Method::POST,
            format!("{}/pins", user(id)),
            Some(match (text, item) {
                (_, Some(item)) => json!({ "item": item }),
                (text, None) => json!({ "text": text.as_deref().unwrap_or_default() }),
            }),
        ),
        AdminCommand::Unpin { user: id, pin } => {
            ApiCall::with(Method::DELETE, format!("{}/pins/{pin}", user(id)), None)
        }
        AdminCommand::Identity { user: id, text } => ApiCall::with(
            Method::PUT,
            format!("{}/identity", user(id)),
            Some(json!({ "text": text })),
        ),
        AdminCommand::Forget { user: id, yes } => {
            if !yes {
                return Err(Error::invalid_request(
                    format!("forget deletes every record of {id}; pass --yes to confirm"),
                    None,
                ));
            }
            ApiCall::with(Method::DELETE, user(id), None)
        }
        AdminCommand::Explain { user: id, turn } => {
            ApiCall::get(format!("{}/turns/{}/explain", user(id), encode(turn)))
        }
    })
}

fn query(text: Option<&str>, filter: &ItemFilterArgs) -> String {
    let mut pairs = Vec::new();
    if let Some(text) = text {
        pairs.push(format!("q={}", encode(text)));
    }
    if let Some(kind) = &filter.kind {
        pairs.push(format!("kind={}", encode(kind)));
    }
    if let Some(tier) = &filter.tier {
        pairs.push(format!("tier={}", encode(tier)));
    }
    if let Some(limit) = filter.limit {
        pairs.push(format!("limit={limit}"));
    }
    if pairs.is_empty() {
        String::new()
    } else {
        format!("?{}", pairs.join("&"))
    }
}

/// Percent-encodes everything but RFC 3986's unreserved characters (and `:` and `@`, which
/// item ids and user ids use and a path segment allows).
fn encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || b"-._~:@".contains(&byte) {
            out.push(char::from(byte));
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// The answer to a call.
#[derive(Debug)]
pub struct ApiReply {
    pub status: StatusCode,
    pub body: Bytes,
}

impl ApiReply {
    /// The body pretty-printed when it is JSON, as sent otherwise.
    pub fn pretty(&self) -> String {
        match serde_json::from_slice::<Value>(&self.body) {
            Ok(value) => serde_json::to_string_pretty(&value)
                .unwrap_or_else(|_| String::from_utf8_lossy(&self.body).into_owned()),
            Err(_) => String::from_utf8_lossy(&self.body).into_owned(),
        }
    }

    /// The error message of a non-2xx answer (OpenAI's `error.message`, or the body).
    pub fn error_message(&self) -> String {
        let message = serde_json::from_slice::<Value>(&self.body)
            .ok()
            .and_then(|value| value["error"]["message"].as_str().map(str::to_owned))
            .unwrap_or_else(|| String::from_utf8_lossy(&self.body).trim().to_owned());
        format!("{}: {message}", self.status)
    }
}

/// Sends `call` to the proxy at `base_url`.
pub async fn send(
    base_url: &str,
    token: Option<&str>,
    tenant: Option<&str>,
    call: &ApiCall,
) -> Result<ApiReply, Error> {
    let url = format!("{}{}", base_url.trim_end_matches('/'), call.path);
    let mut builder = Request::builder().method(call.method.clone()).uri(&url);
    if let Some(token) = token {
        builder = builder.header(header::AUTHORIZATION, format!("Bearer {token}"));
    }
    if let Some(tenant) = tenant {
        builder = builder.header(engram_proxy::pipeline::identity::TENANT_HEADER, tenant);
    }
    let body = match &call.body {
        Some(body) => {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
            Bytes::from(body.to_string())
        }
        None => Bytes::new(),
    };
    let request = builder.body(Full::new(body)).map_err(|error| {
        Error::invalid_request(format!("invalid request to {url}: {error}"), None)
    })?;
    let client: Client<_, Full<Bytes>> = Client::builder(TokioExecutor::new())
        .build(engram_proxy::upstream::connector(CONNECT_TIMEOUT));
    let unreachable = |error: String| {
        Error::Io(std::io::Error::other(format!(
            "cannot reach {url}: {error}"
        )))
    };
    let response = tokio::time::timeout(CALL_TIMEOUT, client.request(request))
        .await
        .map_err(|_| Error::UpstreamTimeout(CALL_TIMEOUT))?
        .map_err(|error| unreachable(error.to_string()))?;
    let status = response.status();
    let body = response
        .into_body()
        .collect()
        .await
        .map_err(|error| unreachable(error.to_string()))?
        .to_bytes();
    Ok(ApiReply { status, body })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn filter() -> ItemFilterArgs {
        ItemFilterArgs {
            kind: None,
            tier: None,
            limit: None,
        }
    }

    #[test]
    fn subcommands_become_calls_with_encoded_parts() {
        let search = call_for(&AdminCommand::Search {
            user: "ana@example.com".into(),
            query: "sour dough & rye".into(),
            filter: ItemFilterArgs {
                kind: Some("fact".into()),
                tier: None,
                limit: Some(5),
            },
        })
        .unwrap();
        assert_eq!(
            search.path,
            "/engram/v1/users/ana@example.com/items?q=sour%20dough%20%26%20rye&kind=fact&limit=5"
        );
        let edit = call_for(&AdminCommand::Item {
            action: ItemAction::Edit {
                user: "u".into(),
                item: "fact:3".into(),
                text: "lives in: Porto".into(),
            },
        })
        .unwrap();
        assert_eq!(edit.method, Method::PATCH);
        assert_eq!(edit.path, "/engram/v1/users/u/items/fact:3");
        assert_eq!(edit.body, Some(json!({"text": "lives in: Porto"})));
        let items = call_for(&AdminCommand::Items {
            user: "a/b".into(),
            filter: filter(),
        })
        .unwrap();
        assert_eq!(items.path, "/engram/v1/users/a%2Fb/items");
        assert!(
            call_for(&AdminCommand::Forget {
                user: "u".into(),
                yes: false
            })
            .is_err()
        );
        let forget = call_for(&AdminCommand::Forget {
            user: "u".into(),
            yes: true,
        })
        .unwrap();
        assert_eq!(
            (forget.method, forget.path.as_str()),
            (Method::DELETE, "/engram/v1/users/u")
        );
    }

    #[test]
    fn errors_show_the_status_and_the_api_message() {
        let reply = ApiReply {
            status: StatusCode::UNAUTHORIZED,
            body: Bytes::from_static(
                br#"{"error":{"message":"Missing or invalid bearer token.","type":"x","param":null,"code":null}}"#,
            ),
        };
        assert_eq!(
            reply.error_message(),
            "401 Unauthorized: Missing or invalid bearer token."
        );
        assert!(reply.pretty().contains("\n"));
    }
}
