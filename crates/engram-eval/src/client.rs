//! The harness's HTTP client: chat requests to the proxy as a stateless client, and the
//! management API calls (queue, explain, export, forget).

use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

use engram::error::{Error, Result};

#[derive(Debug)]
pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|value| value.to_str().ok())
    }

    pub fn json(&self) -> Result<Value> {
        serde_json::from_slice(&self.body)
            .map_err(|error| Error::Internal(format!("the proxy answered with bad JSON: {error}")))
    }
}

#[derive(Clone)]
pub struct ProxyClient {
    http: Client<HttpConnector, Full<Bytes>>,
    base: String,
    admin_token: String,
}

impl ProxyClient {
    /// `base` is the proxy's address (`http://host:port`, no trailing slash).
    pub fn new(base: &str, admin_token: &str) -> ProxyClient {
        let mut connector = HttpConnector::new();
        connector.set_nodelay(true);
        ProxyClient {
            http: Client::builder(TokioExecutor::new()).build(connector),
            base: base.trim_end_matches('/').to_owned(),
            admin_token: admin_token.to_owned(),
        }
    }

    pub async fn send(
        &self,
        method: Method,
        path: &str,
        headers: &[(&str, &str)],
        body: Bytes,
    ) -> Result<Reply> {
        let mut request = Request::builder()
            .method(method)
            .uri(format!("{}{path}", self.base));
        for (name, value) in headers {
            request = request.header(*name, *value);
        }
        let request = request
            .body(Full::new(body))
            .map_err(|error| Error::Internal(format!("building a request: {error}")))?;
        let response = self
            .http
            .request(request)
            .await
            .map_err(|error| Error::UpstreamUnreachable(format!("the proxy: {error}")))?;
        let (parts, body) = response.into_parts();
        let body = body
            .collect()
            .await
            .map_err(|error| Error::UpstreamUnreachable(format!("the proxy's answer: {error}")))?
            .to_bytes();
        Ok(Reply {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }

    /// A chat completion with these headers and only `text` as the user message.
    pub async fn chat(&self, model: &str, text: &str, headers: &[(&str, &str)]) -> Result<Reply> {
        let body = serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": text}],
        });
        let mut all = vec![("content-type", "application/json")];
        all.extend_from_slice(headers);
        let reply = self
            .send(
                Method::POST,
                "/v1/chat/completions",
                &all,
                Bytes::from(body.to_string()),
            )
            .await?;
        if reply.status != StatusCode::OK {
            return Err(Error::Internal(format!(
                "the proxy answered a chat request with {}: {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            )));
        }
        Ok(reply)
    }

    /// A management API call; errors unless it answers 2xx.
    pub async fn admin(&self, method: Method, path: &str) -> Result<Value> {
        let auth = format!("Bearer {}", self.admin_token);
        let reply = self
            .send(
                method,
                &format!("/engram/v1/{path}"),
                &[("authorization", auth.as_str())],
                Bytes::new(),
            )
            .await?;
        if !reply.status.is_success() {
            return Err(Error::Internal(format!(
                "the management API answered {path} with {} (is ENGRAM_ADMIN_TOKEN right?): {}",
                reply.status,
                String::from_utf8_lossy(&reply.body)
            )));
        }
        reply.json()
    }

    /// Waits until the job is applied (a failed job is an error).
    pub async fn wait_job(&self, user: &str, job: &str, within: Duration) -> Result<()> {
        let deadline = Instant::now() + within;
        loop {
            let path = format!("/engram/v1/users/{user}/jobs/{job}");
            let auth = format!("Bearer {}", self.admin_token);
            let reply = self
                .send(
                    Method::GET,
                    &path,
                    &[("authorization", auth.as_str())],
                    Bytes::new(),
                )
                .await?;
            // 404 until the recorder has queued it.
            if reply.status == StatusCode::OK {
                let state = reply.json()?;
                match state["state"].as_str() {
                    Some("applied") => return Ok(()),
                    Some("failed") => {
                        return Err(Error::Internal(format!("job {job} failed: {state}")));
                    }
                    _ => {}
                }
            } else if reply.status != StatusCode::NOT_FOUND {
                return Err(Error::Internal(format!(
                    "the management API answered {path} with {}: {}",
                    reply.status,
                    String::from_utf8_lossy(&reply.body)
                )));
            }
            if Instant::now() > deadline {
                return Err(Error::Internal(format!(
                    "job {job} was not applied within {within:?}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// The queue report (`GET /engram/v1/queue`).
    pub async fn queue(&self) -> Result<Value> {
        self.admin(Method::GET, "queue").await
    }

    /// Waits until the worker has applied (or recognised as duplicates) `applied` jobs in total,
    /// nothing is in flight, queued or spooled.
    pub async fn wait_applied(&self, applied: u64, within: Duration) -> Result<Value> {
        let deadline = Instant::now() + within;
        loop {
            let queue = self.queue().await?;
            let done = queue["worker"]["applied"].as_u64().unwrap_or(0)
                + queue["worker"]["duplicates"].as_u64().unwrap_or(0);
            if done >= applied
                && queue["depth"] == 0
                && queue["spooled"] == 0
                && queue["recorded"]["in_flight"] == 0
            {
                return Ok(queue);
            }
            if queue["worker"].is_null() {
                return Err(Error::Internal(
                    "the proxy runs no worker, so the replay can never be applied".into(),
                ));
            }
            if Instant::now() > deadline {
                return Err(Error::Internal(format!(
                    "the queue did not drain within {within:?}: {queue}"
                )));
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
    }
}
