//! The route table: path → handler, nothing else.

use std::sync::Arc;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;

use super::{AppState, chat, passthrough};
use crate::error::{Error, ProxyBody, full_body};
use engram_ops::metrics::{self, Route};

pub async fn route(state: Arc<AppState>, request: Request<Incoming>) -> Response<ProxyBody> {
    let path = request.uri().path();
    let (route, result) = match (request.method(), path) {
        (&Method::POST, "/v1/chat/completions") => (
            Route::ChatCompletions,
            chat::handle(state.clone(), request).await,
        ),
        (_, "/v1/chat/completions") => (
            Route::ChatCompletions,
            Err(Error::MethodNotAllowed {
                method: request.method().to_string(),
                path: path.to_owned(),
            }),
        ),
        (_, path) if path.starts_with("/v1/") => (
            Route::Passthrough,
            passthrough::handle(state.clone(), request).await,
        ),
        (_, path) if path.starts_with(engram_ops::admin::PREFIX) => (
            Route::Admin,
            match state.admin.clone() {
                Some(admin) => admin.handle(request).await,
                None => Err(Error::NotFound {
                    method: request.method().to_string(),
                    path: path.to_owned(),
                }),
            },
        ),
        (&Method::GET | &Method::HEAD, "/healthz") => (
            Route::Health,
            Ok(json(StatusCode::OK, r#"{"status":"ok"}"#)),
        ),
        (&Method::GET | &Method::HEAD, "/readyz") => (
            Route::Health,
            Ok(if state.is_draining() {
                json(StatusCode::SERVICE_UNAVAILABLE, r#"{"status":"draining"}"#)
            } else {
                json(StatusCode::OK, r#"{"status":"ready"}"#)
            }),
        ),
        (&Method::GET | &Method::HEAD, "/metrics") => (Route::Metrics, metrics_page(&state).await),
        (method, path) => (
            Route::NotFound,
            Err(Error::NotFound {
                method: method.to_string(),
                path: path.to_owned(),
            }),
        ),
    };
    let response = result.unwrap_or_else(Error::into_response);
    state
        .metrics
        .http
        .count(route, response.status(), response.headers());
    response
}

/// The ops listener's table (`server.ops_listen`): health, readiness and metrics, nothing else,
/// so that address can be open to the kubelet and Prometheus while the proxy stays on loopback.
pub async fn route_ops(state: Arc<AppState>, request: Request<Incoming>) -> Response<ProxyBody> {
    if matches!(request.uri().path(), "/healthz" | "/readyz" | "/metrics") {
        return route(state, request).await;
    }
    let response = Error::NotFound {
        method: request.method().to_string(),
        path: request.uri().path().to_owned(),
    }
    .into_response();
    state
        .metrics
        .http
        .count(Route::NotFound, response.status(), response.headers());
    response
}

/// A connection from the reserve past `server.max_connections`: the ops routes answer, so
/// probes and scraping still work; anything else is a 503. Either way the connection closes
/// after the answer, giving its place back.
pub async fn route_reserved(
    state: Arc<AppState>,
    request: Request<Incoming>,
    max_connections: usize,
) -> Response<ProxyBody> {
    let path = request.uri().path();
    let mut response = if matches!(path, "/healthz" | "/readyz" | "/metrics") {
        route(state, request).await
    } else {
        // Counted under the route asked for, as a 503.
        let asked = if path == "/v1/chat/completions" {
            Route::ChatCompletions
        } else if path.starts_with("/v1/") {
            Route::Passthrough
        } else if path.starts_with(engram_ops::admin::PREFIX) {
            Route::Admin
        } else {
            Route::NotFound
        };
        let response = Error::TooManyConnections { max_connections }.into_response();
        state
            .metrics
            .http
            .count(asked, response.status(), response.headers());
        response
    };
    response
        .headers_mut()
        .insert(header::CONNECTION, http::HeaderValue::from_static("close"));
    response
}

/// Prometheus text format; unauthenticated, like `/healthz` (a sidecar's port is not public).
async fn metrics_page(state: &AppState) -> Result<Response<ProxyBody>, Error> {
    let page = state.metrics.render().await?;
    let mut response = Response::new(full_body(page));
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static(metrics::CONTENT_TYPE),
    );
    Ok(response)
}

fn json(status: StatusCode, body: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(full_body(body));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("application/json"),
    );
    response
}
