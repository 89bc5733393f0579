//! The management API under `/engram/v1/`: bearer token from `ENGRAM_ADMIN_TOKEN`; without a
//! token the API is off (every route is 404). JSON in and out, errors in OpenAI's shape.
//!
//! Routes so far:
//! - `GET /engram/v1/queue`: queue depth, the local spool, the worker's counters;
//! - `GET /engram/v1/users/{user}/jobs/{job}`: a job's state (queued, applied, failed), so a
//!   client can wait to read its own write (the job id is the `x-engram-job-id` header or the
//!   stream's `: engram … job=…` receipt);
//! - `GET /engram/v1/users/{user}/memory`: the user's whole memory and raw log;
//! - `GET /engram/v1/users/{user}/turns/{turn}/explain`: what a turn's prompt was given (items,
//!   blocks, tiers, scores, tokens, reasons, provenance), while this process keeps it;
//! - `DELETE /engram/v1/users/{user}`: forget the user (every record, every kind), with a
//!   deletion report;
//! - `PUT /engram/v1/users/{user}/identity` `{"text": …}`: set (or, empty, clear) the identity;
//! - `POST /engram/v1/users/{user}/pins` `{"text": …}` and
//!   `DELETE /engram/v1/users/{user}/pins/{id}`: pin and unpin.
//!
//! Edits are version-checked like the worker's commits, so an edit and a job never overwrite
//! each other.
//!
//! The tenant is the `x-engram-tenant` header, or the configured default tenant.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use http::{HeaderMap, Method, Request, Response, StatusCode, header};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::error::{Error, ProxyBody, decode_json, full_body};
use crate::memory;
use crate::pipeline::cache::MemoryCache;
use crate::pipeline::explain_log::ExplainLog;
use crate::pipeline::identity::{self, IdentityConfig};
use crate::store::{JobId, JobState, Store, UserKey};
use crate::worker::{Outbox, Worker, edit_memory};

/// Largest admin request body.
const MAX_BODY_BYTES: usize = 64 * 1024;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TextBody {
    text: String,
}

/// The environment variable holding the admin token.
pub const TOKEN_ENV: &str = "ENGRAM_ADMIN_TOKEN";
pub const PREFIX: &str = "/engram/v1/";

pub struct AdminApi {
    token: Option<String>,
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    explains: Arc<ExplainLog>,
    outbox: Arc<Outbox>,
    worker: Option<Arc<Worker>>,
    identity: IdentityConfig,
}

impl AdminApi {
    pub fn new(
        token: Option<String>,
        store: Arc<dyn Store>,
        cache: Arc<MemoryCache>,
        explains: Arc<ExplainLog>,
        outbox: Arc<Outbox>,
        worker: Option<Arc<Worker>>,
        identity: IdentityConfig,
    ) -> AdminApi {
        AdminApi {
            token: token.filter(|token| !token.is_empty()),
            store,
            cache,
            explains,
            outbox,
            worker,
            identity,
        }
    }

    pub async fn handle(&self, request: Request<Incoming>) -> Result<Response<ProxyBody>, Error> {
        let not_found = || Error::NotFound {
            method: request.method().to_string(),
            path: request.uri().path().to_owned(),
        };
        let Some(token) = &self.token else {
            return Err(not_found());
        };
        if !authorized(request.headers(), token) {
            return Err(Error::Unauthorized);
        }
        let path = request.uri().path();
        let rest = path.strip_prefix(PREFIX).ok_or_else(not_found)?;
        let segments: Vec<&str> = rest.split('/').collect();
        match (request.method(), segments.as_slice()) {
            (&Method::GET, ["queue"]) => self.queue().await,
            (&Method::GET, ["users", user, "jobs", job]) => {
                let user = self.user_key(request.headers(), user)?;
                self.job(user, job).await
            }
            (&Method::GET, ["users", user, "memory"]) => {
                let user = self.user_key(request.headers(), user)?;
                self.export(user).await
            }
            (&Method::GET, ["users", user, "turns", turn, "explain"]) => {
                let user = self.user_key(request.headers(), user)?;
                let turn = percent_decode(turn)?;
                let Some(explain) = self.explains.get(&user, &turn) else {
                    return Err(Error::ResourceNotFound(format!(
                        "No explanation for turn {turn}: explanations are kept by the process \
                         that served the turn, for its last {} turns.",
                        crate::app::EXPLAINED_TURNS
                    )));
                };
                Ok(json_response(
                    StatusCode::OK,
                    &json!({ "turn": turn, "explain": &*explain }),
                ))
            }
            (&Method::DELETE, ["users", user]) => {
                let user = self.user_key(request.headers(), user)?;
                self.forget(user).await
            }
            (&Method::PUT, ["users", user, "identity"]) => {
                let user = self.user_key(request.headers(), user)?;
                let body: TextBody = read_json(request).await?;
                let (_, version) = edit_memory(&*self.store, &self.cache, &user, |state| {
                    memory::set_identity(state, &body.text)
                })
                .await?;
                Ok(json_response(
                    StatusCode::OK,
                    &json!({ "version": version }),
                ))
            }
            (&Method::POST, ["users", user, "pins"]) => {
                let user = self.user_key(request.headers(), user)?;
                let body: TextBody = read_json(request).await?;
                if body.text.trim().is_empty() {
                    return Err(Error::invalid_request(
                        "`text` must not be empty.",
                        Some("text"),
                    ));
                }
                let (pin, version) = edit_memory(&*self.store, &self.cache, &user, |state| {
                    memory::pin(state, &body.text, None)
                })
                .await?;
                Ok(json_response(
                    StatusCode::CREATED,
                    &json!({ "pin": pin, "version": version }),
                ))
            }
            (&Method::DELETE, ["users", user, "pins", pin]) => {
                let user = self.user_key(request.headers(), user)?;
                let pin: u32 = pin
                    .parse()
                    .map_err(|_| Error::invalid_request("The pin id must be a number.", None))?;
                let (unpinned, version) = edit_memory(&*self.store, &self.cache, &user, |state| {
                    memory::unpin(state, pin)
                })
                .await?;
                if !unpinned {
                    return Err(Error::ResourceNotFound(format!("No active pin {pin}.")));
                }
                Ok(json_response(
                    StatusCode::OK,
                    &json!({ "version": version }),
                ))
            }
            (
                _,
                ["queue"]
                | ["users", _]
                | ["users", _, "jobs", _]
                | ["users", _, "memory" | "identity" | "pins"]
                | ["users", _, "pins", _]
                | ["users", _, "turns", _, "explain"],
            ) => Err(Error::MethodNotAllowed {
                method: request.method().to_string(),
                path: path.to_owned(),
            }),
            _ => Err(not_found()),
        }
    }

    /// Forgets the user: every record in the store, and the cached memory of this process.
    async fn forget(&self, user: UserKey) -> Result<Response<ProxyBody>, Error> {
        let report = self.store.forget_user(&user).await?;
        self.cache.remove(&user);
        tracing::info!(records = report.total(), "user forgotten");
        Ok(json_response(
            StatusCode::OK,
            &json!({
                "forgotten": true,
                "deleted": report,
                "total": report.total(),
            }),
        ))
    }

    fn user_key(&self, headers: &HeaderMap, user: &str) -> Result<UserKey, Error> {
        let user = identity::checked_id("user", &percent_decode(user)?)?;
        let tenant = match headers.get(identity::TENANT_HEADER) {
            Some(value) => identity::checked_id(
                identity::TENANT_HEADER,
                value
                    .to_str()
                    .map_err(|_| Error::invalid_request("x-engram-tenant must be ASCII", None))?,
            )?,
            None => self.identity.default_tenant.clone(),
        };
        Ok(UserKey::new(tenant, user))
    }

    async fn queue(&self) -> Result<Response<ProxyBody>, Error> {
        // Reported even while the store is down: the spool and the counters are local.
        let (depth, store_error) = match self.store.queue_depth().await {
            Ok(depth) => (Some(depth), None),
            Err(error) => (None, Some(error.to_string())),
        };
        let outbox = self.outbox.stats();
        let mut body = json!({
            "depth": depth,
            "store_error": store_error,
            "spooled": self.outbox.spooled(),
            "recorded": {
                "in_flight": outbox.in_flight.load(Ordering::Relaxed),
                "queued": outbox.queued.load(Ordering::Relaxed),
                "spooled": outbox.spooled.load(Ordering::Relaxed),
                "forwarded": outbox.forwarded.load(Ordering::Relaxed),
                "lost": outbox.lost.load(Ordering::Relaxed),
            },
            "worker": Value::Null,
        });
        if let Some(worker) = &self.worker {
            let stats = worker.stats();
            body["worker"] = json!({
                "applied": stats.applied.load(Ordering::Relaxed),
                "duplicates": stats.duplicates.load(Ordering::Relaxed),
                "conflicts": stats.conflicts.load(Ordering::Relaxed),
                "errors": stats.errors.load(Ordering::Relaxed),
                "failed": stats.failed.load(Ordering::Relaxed),
                "summarizer_fallbacks": stats.summarizer_fallbacks.load(Ordering::Relaxed),
                "summarizer_refined": stats.summarizer_refined.load(Ordering::Relaxed),
            });
        }
        Ok(json_response(StatusCode::OK, &body))
    }

    async fn job(&self, user: UserKey, job: &str) -> Result<Response<ProxyBody>, Error> {
        let key = percent_decode(job)?;
        let id = JobId { user, key };
        let Some(state) = self.store.job_state(&id).await? else {
            return Err(Error::ResourceNotFound(format!(
                "No job {} for this user (it may not be recorded yet).",
                id.key
            )));
        };
        let mut body = json!({ "job": id.key, "state": state_name(&state) });
        if let JobState::Failed { reason } = state {
            body["reason"] = Value::String(reason);
        }
        Ok(json_response(StatusCode::OK, &body))
    }

    async fn export(&self, user: UserKey) -> Result<Response<ProxyBody>, Error> {
        let state = self.store.load_state(&user).await?;
        let raw = self.store.read_raw(&user).await?;
        let body = json!({
            "tenant": user.tenant,
            "user": user.user,
            "version": state.as_ref().map_or(0, |state| state.version),
            "memory": state,
            "raw_log": raw,
        });
        Ok(json_response(StatusCode::OK, &body))
    }
}

fn state_name(state: &JobState) -> &'static str {
    match state {
        JobState::Queued => "queued",
        JobState::Applied => "applied",
        JobState::Failed { .. } => "failed",
    }
}

/// Compares the bearer token in constant time for equal lengths.
fn authorized(headers: &HeaderMap, token: &str) -> bool {
    let Some(given) = headers
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
    else {
        return false;
    };
    let (given, token) = (given.trim().as_bytes(), token.as_bytes());
    given.len() == token.len()
        && given
            .iter()
            .zip(token)
            .fold(0u8, |diff, (a, b)| diff | (a ^ b))
            == 0
}

/// Decodes `%XX` escapes of one path segment; ids are ASCII, so anything else is rejected.
fn percent_decode(segment: &str) -> Result<String, Error> {
    let bad = || Error::invalid_request(format!("invalid path segment `{segment}`"), None);
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        if bytes[at] == b'%' {
            let hex = segment.get(at + 1..at + 3).ok_or_else(bad)?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| bad())?);
            at += 3;
        } else {
            out.push(bytes[at]);
            at += 1;
        }
    }
    String::from_utf8(out).map_err(|_| bad())
}

/// Reads a JSON body of at most `MAX_BODY_BYTES`.
async fn read_json<T: serde::de::DeserializeOwned>(request: Request<Incoming>) -> Result<T, Error> {
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

fn json_response(status: StatusCode, body: &Value) -> Response<ProxyBody> {
    let mut response = Response::new(full_body(Bytes::from(body.to_string())));
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
    fn tokens_must_match_exactly() {
        let mut headers = HeaderMap::new();
        assert!(!authorized(&headers, "secret"));
        headers.insert(header::AUTHORIZATION, "Bearer secret".parse().unwrap());
        assert!(authorized(&headers, "secret"));
        assert!(!authorized(&headers, "secret2"));
        assert!(!authorized(&headers, "secreT"));
        headers.insert(header::AUTHORIZATION, "Basic secret".parse().unwrap());
        assert!(!authorized(&headers, "secret"));
    }

    #[test]
    fn path_segments_are_percent_decoded_and_checked() {
        assert_eq!(percent_decode("a%40b.c").unwrap(), "a@b.c");
        assert!(percent_decode("a%4").is_err());
        assert!(percent_decode("a%zz").is_err());
        assert!(percent_decode("%ff").is_err());
    }
}
