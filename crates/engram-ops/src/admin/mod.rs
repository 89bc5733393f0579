//! The management API under `/engram/v1/`: JSON in and out, errors in OpenAI's shape, bearer
//! tokens from the environment (see [`auth`]); without any token the API is off (every route
//! is 404). The routes are the table in [`routes`], described by `openapi.json` (served at
//! `GET /engram/v1/openapi.json`, token required like every route):
//!
//! - `GET queue`: queue depth, the local spool, the worker's counters (global token only);
//! - `GET users/{user}/jobs/{job}`: a job's state (queued, applied, failed), so a client can
//!   wait to read its own write;
//! - `GET users/{user}/memory`: the user's whole memory (every tier, manifests, provenance),
//!   the raw log, and the items view;
//! - `GET users/{user}/items` (`q`, `kind`, `tier`, `limit`), `GET|PATCH|DELETE
//!   users/{user}/items/{item}`: list, search, read, edit and delete items (see
//!   [`engram_memory::manage`] for what an edit or a deletion does);
//! - `PUT users/{user}/identity`, `POST users/{user}/pins`, `DELETE users/{user}/pins/{id}`;
//! - `GET users/{user}/turns/{turn}/explain`: what a turn's prompt was given, while this
//!   process keeps it;
//! - `DELETE users/{user}`: forget the user (store, local spool, cache, explanations), with a
//!   deletion report.
//!
//! Edits go through [`edit_memory`]: version-checked like the worker's commits, so an edit and
//! a job never overwrite each other. The tenant is the `x-engram-tenant` header, read by the
//! chat path's rule (`identity::named_tenant`: sent twice is a 400), or the configured default
//! tenant (the token's own tenant for a tenant token; naming another is 403).

pub mod auth;
pub mod client;
pub mod routes;
mod wire;

use std::sync::Arc;
use std::sync::atomic::Ordering;

use http::{HeaderMap, Request, Response, StatusCode};
use hyper::body::Incoming;
use serde_json::{Value, json};

use crate::config::Config;
use crate::error::{Error, ProxyBody};
use engram_memory::index::Bm25;
use engram_memory::manage::{self, ItemFilter, ItemKind, ManageError};
use engram_memory::{self as memory, Explain, ItemRef, Provenance, Tier};
use engram_proxy::cache::{CachedMemory, MemoryCache};
use engram_proxy::pipeline::explain_log::ExplainLog;
use engram_proxy::pipeline::identity::{self, IdentityConfig};
use engram_proxy::recorder::outbox::Outbox;
use engram_proxy::worker::{Worker, edit_memory};
use engram_store::{JobId, JobState, Store, UserKey};

use auth::Access;
pub use auth::{AdminAuth, TENANT_TOKENS_ENV, TENANT_TOKENS_FILE_ENV, TOKEN_ENV};
use routes::{Endpoint, Matched};
use wire::{bytes_response, json_response, percent_decode, query_params, read_json};

pub const PREFIX: &str = "/engram/v1/";

/// The OpenAPI 3.1 document of every route in [`routes::ROUTES`].
pub const OPENAPI: &str = include_str!("openapi.json");

/// Items a listing returns unless `limit` says otherwise, and the most it may ask for.
const DEFAULT_LIMIT: usize = 100;
const MAX_LIMIT: usize = 1000;

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct TextBody {
    text: String,
}

/// A pin: a text of its own, or a fact (`{"item": "fact:3"}`), whose current revision the pin
/// then shows.
#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct PinBody {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    item: Option<String>,
}

pub struct AdminApi {
    auth: AdminAuth,
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    explains: Arc<ExplainLog>,
    outbox: Arc<Outbox>,
    worker: Option<Arc<Worker>>,
    identity: IdentityConfig,
    bm25: Bm25,
}

impl AdminApi {
    pub fn new(
        auth: AdminAuth,
        store: Arc<dyn Store>,
        cache: Arc<MemoryCache>,
        explains: Arc<ExplainLog>,
        outbox: Arc<Outbox>,
        worker: Option<Arc<Worker>>,
        config: &Config,
    ) -> AdminApi {
        AdminApi {
            auth,
            store,
            cache,
            explains,
            outbox,
            worker,
            identity: config.identity.clone(),
            // The admin search ranks a whole memory for an operator: every posting counts.
            bm25: Bm25 {
                k1: config.memory.retrieval.bm25_k1,
                b: config.memory.retrieval.bm25_b,
                postings_per_term: usize::MAX,
                postings_per_query: usize::MAX,
            },
        }
    }

    pub async fn handle(&self, request: Request<Incoming>) -> Result<Response<ProxyBody>, Error> {
        let path = request.uri().path().to_owned();
        let not_found = || Error::NotFound {
            method: request.method().to_string(),
            path: path.clone(),
        };
        if !self.auth.is_enabled() {
            return Err(not_found());
        }
        let Some(access) = self.auth.access(request.headers()) else {
            return Err(Error::Unauthorized);
        };
        let (route, raw_parameters) = match routes::find(request.method(), &path) {
            Matched::Route(route, parameters) => (route, parameters),
            Matched::WrongMethod => {
                return Err(Error::MethodNotAllowed {
                    method: request.method().to_string(),
                    path: path.clone(),
                });
            }
            Matched::NoPath => return Err(not_found()),
        };
        if route.global_only && access != Access::All {
            return Err(Error::Forbidden(
                "This route reports on every tenant; it takes the global admin token.".into(),
            ));
        }
        let parameters = raw_parameters
            .iter()
            .map(|segment| percent_decode(segment, false))
            .collect::<Result<Vec<String>, Error>>()?;
        let query = query_params(request.uri().query(), route.query)?;
        let parameter = |at: usize| {
            parameters
                .get(at)
                .map(String::as_str)
                .ok_or_else(|| Error::Internal(format!("route {} lacks a parameter", route.path)))
        };
        match route.endpoint {
            Endpoint::OpenApi => return Ok(bytes_response(StatusCode::OK, OPENAPI)),
            Endpoint::Queue => return self.queue().await,
            _ => {}
        }
        let user = self.user_key(request.headers(), &access, parameter(0)?)?;
        match route.endpoint {
            Endpoint::OpenApi | Endpoint::Queue => Err(not_found()),
            Endpoint::Job => self.job(user, parameter(1)?).await,
            Endpoint::Export => self.export(user).await,
            Endpoint::Forget => self.forget(user).await,
            Endpoint::Explain => self.explain(&user, parameter(1)?).await,
            Endpoint::Items => self.items(user, &query).await,
            Endpoint::Item => {
                let item = item_ref(parameter(1)?)?;
                let state = self.store.load_state(&user).await?;
                let view = state
                    .as_ref()
                    .and_then(|state| manage::view(state, item))
                    .ok_or_else(|| no_item(item))?;
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"version": state.map_or(0, |state| state.version), "item": view}),
                ))
            }
            Endpoint::EditItem => {
                let item = item_ref(parameter(1)?)?;
                let body: TextBody = read_json(request).await?;
                let (edited, version) = edit_memory(&*self.store, &self.cache, &user, |state| {
                    manage::edit(state, item, &body.text).map(|()| manage::view(state, item))
                })
                .await?;
                let view = edited.map_err(|error| manage_error(item, error))?;
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"version": version, "item": view}),
                ))
            }
            Endpoint::DeleteItem => {
                let item = item_ref(parameter(1)?)?;
                let (deleted, version) = edit_memory(&*self.store, &self.cache, &user, |state| {
                    manage::delete(state, item)
                })
                .await?;
                let deleted = deleted.map_err(|error| manage_error(item, error))?;
                let ids: Vec<String> = deleted.into_iter().map(manage::item_id).collect();
                Ok(json_response(
                    StatusCode::OK,
                    &json!({"version": version, "deleted": ids}),
                ))
            }
            Endpoint::Identity => {
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
            Endpoint::Pin => {
                let body: PinBody = read_json(request).await?;
                let (pin, version) = match (body.text, body.item) {
                    (Some(text), None) => {
                        if text.trim().is_empty() {
                            return Err(Error::invalid_request(
                                "`text` must not be empty.",
                                Some("text"),
                            ));
                        }
                        edit_memory(&*self.store, &self.cache, &user, |state| {
                            memory::pin(state, &text)
                        })
                        .await?
                    }
                    (None, Some(item)) => {
                        let ItemRef::Fact(fact) = item_ref(&item)? else {
                            return Err(Error::invalid_request(
                                "Only facts are pinned by item; pin other text with `text`.",
                                Some("item"),
                            ));
                        };
                        let (pin, version) =
                            edit_memory(&*self.store, &self.cache, &user, |state| {
                                memory::pin_fact(state, fact)
                            })
                            .await?;
                        (pin.ok_or_else(|| no_item(ItemRef::Fact(fact)))?, version)
                    }
                    _ => {
                        return Err(Error::invalid_request(
                            "Give either `text` or `item` (a fact to pin).",
                            None,
                        ));
                    }
                };
                Ok(json_response(
                    StatusCode::CREATED,
                    &json!({ "pin": pin, "item": manage::item_id(ItemRef::Pinned(pin)), "version": version }),
                ))
            }
            Endpoint::Unpin => {
                let pin: u32 = parameter(1)?
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
        }
    }

    /// The user a per-user route names, in the tenant the request may reach.
    fn user_key(&self, headers: &HeaderMap, access: &Access, user: &str) -> Result<UserKey, Error> {
        let user = identity::admin_user_id(user)?;
        let tenant = match (access, identity::named_tenant(headers)?) {
            (Access::All, Some(tenant)) => tenant,
            (Access::All, None) => self.identity.default_tenant.clone(),
            (Access::Tenant(own), None) => own.clone(),
            (Access::Tenant(own), Some(tenant)) if *own == tenant => tenant,
            (Access::Tenant(_), Some(tenant)) => {
                return Err(Error::Forbidden(format!(
                    "This admin token does not reach tenant {tenant}."
                )));
            }
        };
        Ok(UserKey::new(tenant, user))
    }

    /// Forgets the user: every record in the store and in this process's spool, the cached
    /// memory and the kept explanations.
    async fn forget(&self, user: UserKey) -> Result<Response<ProxyBody>, Error> {
        // The spool first: a job the forwarder moves meanwhile lands in the store before the
        // store's records go, and one it holds from before is not moved after (the outbox's
        // forget marks the user, waiting for a move in progress).
        let spooled = self.outbox.forget_user(&user).await?.total();
        let report = self.store.forget_user(&user).await?;
        self.cache.remove(&user);
        let explanations = self.explains.forget(&user) as u64;
        let total = report.total() + spooled + explanations;
        tracing::info!(records = total, "user forgotten");
        let mut deleted = serde_json::to_value(report)
            .map_err(|error| Error::Internal(format!("encoding the report: {error}")))?;
        deleted["spooled_jobs"] = json!(spooled);
        deleted["explanations"] = json!(explanations);
        Ok(json_response(
            StatusCode::OK,
            &json!({ "forgotten": true, "deleted": deleted, "total": total }),
        ))
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

    async fn job(&self, user: UserKey, key: &str) -> Result<Response<ProxyBody>, Error> {
        let id = JobId {
            user,
            key: key.to_owned(),
        };
        let Some(state) = self.store.job_state(&id).await? else {
            // Answered by this process and on its way to the store.
            if self.outbox.is_recording(&id) {
                return Ok(json_response(
                    StatusCode::OK,
                    &json!({ "job": id.key, "state": "pending" }),
                ));
            }
            return Err(Error::ResourceNotFound(format!(
                "No job {} for this user (another replica may still be recording it).",
                id.key
            )));
        };
        let mut body = json!({ "job": id.key, "state": state_name(&state) });
        if let JobState::Failed { reason } = state {
            body["reason"] = Value::String(reason);
        }
        Ok(json_response(StatusCode::OK, &body))
    }

    async fn explain(&self, user: &UserKey, turn: &str) -> Result<Response<ProxyBody>, Error> {
        let Some(explain) = self.explains.get(user, turn) else {
            return Err(Error::ResourceNotFound(format!(
                "No explanation for turn {turn}: explanations are kept by the process that \
                 served the turn, for its last {} turns.",
                self.explains.capacity()
            )));
        };
        // The explanation names its provenance turns by number; their ids are in the memory
        // it was composed from and every later version, this process's cached one first.
        // A forget on another replica does not reach this process's explanations: then the
        // stored memory is another (or none), and `provenance` says the turns were forgotten.
        let mut explain = Explain::clone(&explain);
        let cached = self
            .cache
            .get(user)
            .map(|memory| explain.name_turns(&memory.state));
        let provenance = match cached {
            Some(Provenance::Named) => Provenance::Named,
            _ => {
                let stored = self.store.load_state(user).await?.unwrap_or_default();
                explain.name_turns(&stored)
            }
        };
        Ok(json_response(
            StatusCode::OK,
            &json!({ "turn": turn, "provenance": provenance, "explain": explain }),
        ))
    }

    async fn export(&self, user: UserKey) -> Result<Response<ProxyBody>, Error> {
        let state = self.store.load_state(&user).await?;
        let raw = self.store.read_raw(&user).await?;
        let items = state
            .as_ref()
            .map_or_else(Vec::new, |state| manage::list(state, ItemFilter::default()));
        let body = json!({
            "tenant": user.tenant,
            "user": user.user,
            // The body `user` an app sent, when the id was made from it and can be read back.
            "user_as_sent": identity::body_user_of(&user.user),
            "version": state.as_ref().map_or(0, |state| state.version),
            "memory": state,
            "raw_log": raw,
            "items": items,
        });
        Ok(json_response(StatusCode::OK, &body))
    }

    /// Lists items (filtered), or with `q` ranks them by relevance.
    async fn items(
        &self,
        user: UserKey,
        query: &[(String, String)],
    ) -> Result<Response<ProxyBody>, Error> {
        let value = |name: &str| {
            query
                .iter()
                .find(|(known, _)| known == name)
                .map(|(_, value)| value.as_str())
        };
        let mut filter = ItemFilter::default();
        if let Some(kind) = value("kind") {
            filter.kind = Some(ItemKind::parse(kind).ok_or_else(|| {
                Error::invalid_request(
                    format!(
                        "Unknown kind `{kind}`; one of {}.",
                        ItemKind::ALL.map(ItemKind::name).join(", ")
                    ),
                    Some("kind"),
                )
            })?);
        }
        if let Some(tier) = value("tier") {
            filter.tier = Some(match tier {
                "new" => Tier::New,
                "current" => Tier::Current,
                "old" => Tier::Old,
                _ => {
                    return Err(Error::invalid_request(
                        format!("Unknown tier `{tier}`; one of new, current, old."),
                        Some("tier"),
                    ));
                }
            });
        }
        let limit = match value("limit") {
            None => DEFAULT_LIMIT,
            Some(limit) => limit
                .parse::<usize>()
                .ok()
                .filter(|limit| (1..=MAX_LIMIT).contains(limit))
                .ok_or_else(|| {
                    Error::invalid_request(
                        format!("`limit` must be a number from 1 to {MAX_LIMIT}."),
                        Some("limit"),
                    )
                })?,
        };
        let search = value("q").map(str::trim);
        if search.is_some_and(str::is_empty) {
            return Err(Error::invalid_request("`q` must not be empty.", Some("q")));
        }
        let mut body = json!({ "tenant": user.tenant, "user": user.user });
        let (version, matching) = match search {
            None => match self.store.load_state(&user).await? {
                Some(state) => {
                    let items = manage::list(&state, filter);
                    let values: Vec<Value> = items.into_iter().map(|item| json!(item)).collect();
                    (state.version, values)
                }
                None => (0, Vec::new()),
            },
            Some(text) => match self.memory(&user).await? {
                Some(memory) => {
                    let hits = manage::search(&memory.state, &memory.index, text, self.bm25);
                    let values = hits
                        .into_iter()
                        .filter_map(|(item, score)| {
                            let view = manage::view(&memory.state, item)?;
                            filter.keeps(&view).then(|| {
                                let mut value = json!(view);
                                value["score"] = json!(score);
                                value
                            })
                        })
                        .collect();
                    (memory.version(), values)
                }
                None => (0, Vec::new()),
            },
        };
        body["version"] = json!(version);
        body["total"] = json!(matching.len());
        if let Some(text) = search {
            body["query"] = json!(text);
        }
        body["items"] = Value::Array(matching.into_iter().take(limit).collect());
        Ok(json_response(StatusCode::OK, &body))
    }

    /// The user's memory with its search index, from this process's cache when it holds the
    /// stored version (and cached for the hot path otherwise).
    async fn memory(&self, user: &UserKey) -> Result<Option<Arc<CachedMemory>>, Error> {
        let Some(state) = self.store.load_state(user).await? else {
            return Ok(None);
        };
        let cached = self.cache.get(user);
        if let Some(cached) = &cached
            && cached.version() == state.version
            && cached.index.is_current(&cached.state)
        {
            return Ok(Some(Arc::clone(cached)));
        }
        // Indexing a large memory is CPU work: off the async threads.
        let memory = tokio::task::spawn_blocking(move || Arc::new(CachedMemory::new(state)))
            .await
            .map_err(|error| Error::Internal(format!("indexing task failed: {error}")))?;
        self.cache.put(user, Arc::clone(&memory));
        Ok(Some(memory))
    }
}

fn item_ref(text: &str) -> Result<ItemRef, Error> {
    manage::parse_item_id(text).ok_or_else(|| {
        Error::invalid_request(
            format!(
                "Invalid item id `{text}`: expected `kind:number` (kinds: {}) or `identity`.",
                ItemKind::ALL.map(ItemKind::name).join(", ")
            ),
            Some("item"),
        )
    })
}

fn no_item(item: ItemRef) -> Error {
    Error::ResourceNotFound(format!(
        "No item {} in this user's memory.",
        manage::item_id(item)
    ))
}

fn manage_error(item: ItemRef, error: ManageError) -> Error {
    match error {
        ManageError::NotFound => no_item(item),
        ManageError::KeyTaken(_) | ManageError::PinnedFactRemoved(_) => {
            Error::Conflict(format!("{error}."))
        }
        ManageError::EmptyText => Error::invalid_request(format!("{error}."), Some("text")),
        ManageError::NotEditable(_) | ManageError::Immutable => {
            Error::invalid_request(format!("{error}."), None)
        }
    }
}

fn state_name(state: &JobState) -> &'static str {
    match state {
        JobState::Queued => "queued",
        JobState::Applied => "applied",
        JobState::Failed { .. } => "failed",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// `(METHOD, path)` of every operation in the OpenAPI document.
    fn documented() -> BTreeSet<(String, String)> {
        let document: Value = serde_json::from_str(OPENAPI).unwrap();
        let mut operations = BTreeSet::new();
        for (path, item) in document["paths"].as_object().unwrap() {
            for (method, _) in item.as_object().unwrap() {
                if method != "parameters" {
                    operations.insert((method.to_uppercase(), path.clone()));
                }
            }
        }
        operations
    }

    #[test]
    fn the_openapi_document_describes_exactly_the_served_routes() {
        let served: BTreeSet<(String, String)> = routes::ROUTES
            .iter()
            .map(|route| (route.method.to_string(), route.path.to_owned()))
            .collect();
        // And each operation's query parameters are exactly the ones the route takes.
        let document: Value = serde_json::from_str(OPENAPI).unwrap();
        for route in &routes::ROUTES {
            let operation =
                &document["paths"][route.path][route.method.as_str().to_lowercase().as_str()];
            let mut documented: Vec<&str> = operation["parameters"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|parameter| parameter["in"] == "query")
                .filter_map(|parameter| parameter["name"].as_str())
                .collect();
            let mut taken = route.query.to_vec();
            documented.sort_unstable();
            taken.sort_unstable();
            assert_eq!(documented, taken, "{} {}", route.method, route.path);
        }
        let documented = documented();
        let undocumented: Vec<_> = served.difference(&documented).collect();
        let unserved: Vec<_> = documented.difference(&served).collect();
        assert!(
            undocumented.is_empty(),
            "served, not documented: {undocumented:?}"
        );
        assert!(unserved.is_empty(), "documented, not served: {unserved:?}");
    }

    #[test]
    fn the_openapi_document_is_3_1_with_the_bearer_scheme_and_the_error_shape() {
        let document: Value = serde_json::from_str(OPENAPI).unwrap();
        assert!(document["openapi"].as_str().unwrap().starts_with("3.1"));
        assert_eq!(
            document["components"]["securitySchemes"]["bearer"]["scheme"],
            "bearer"
        );
        assert_eq!(document["security"][0]["bearer"], json!([]));
        let error = &document["components"]["schemas"]["Error"];
        for field in ["message", "type", "param", "code"] {
            assert!(
                error["properties"]["error"]["properties"][field].is_object(),
                "{field}"
            );
        }
        // Every $ref resolves, and every operation documents its errors.
        let text = OPENAPI;
        for reference in text.split("\"$ref\": \"").skip(1) {
            let target = reference.split('"').next().unwrap();
            let pointer = target.trim_start_matches('#');
            assert!(document.pointer(pointer).is_some(), "dangling {target}");
        }
        for (path, item) in document["paths"].as_object().unwrap() {
            for (method, operation) in item.as_object().unwrap() {
                if method == "parameters" {
                    continue;
                }
                let responses = operation["responses"].as_object().unwrap();
                assert!(responses.contains_key("401"), "{method} {path}: no 401");
                assert!(
                    responses.keys().any(|status| status.starts_with('2')),
                    "{method} {path}: no success response"
                );
                // Every path parameter of the template is declared.
                for name in path
                    .split('/')
                    .filter_map(|segment| segment.strip_prefix('{')?.strip_suffix('}'))
                {
                    let declared = item["parameters"]
                        .as_array()
                        .into_iter()
                        .chain(operation["parameters"].as_array())
                        .flatten()
                        .any(|parameter| {
                            let parameter = match parameter["$ref"].as_str() {
                                Some(target) => {
                                    document.pointer(target.trim_start_matches('#')).unwrap()
                                }
                                None => parameter,
                            };
                            parameter["name"] == name && parameter["in"] == "path"
                        });
                    assert!(declared, "{method} {path}: parameter {name} not declared");
                }
            }
        }
    }
}
