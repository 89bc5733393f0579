//! Every `/v1/*` route other than chat completions: bodies stream both ways, untouched.

use std::sync::Arc;

use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;

use super::AppState;
use crate::error::{BodyError, Error, ProxyBody};
use crate::metrics::{Route, Timing};
use crate::telemetry::RequestTrace;
use crate::upstream::without_hop_by_hop;

pub async fn handle(
    state: Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, Error> {
    let mut trace =
        state
            .telemetry
            .http_request(request.method(), request.uri().path(), request.headers());
    let result = forward(&state, request, &mut trace).await;
    match &result {
        Ok(response) => trace.answered(response.status()),
        Err(error) => trace.fail(error),
    }
    result
}

/// Bodies stream through untouched, so the spans end with the response headers.
async fn forward(
    state: &AppState,
    request: Request<Incoming>,
    trace: &mut RequestTrace,
) -> Result<Response<ProxyBody>, Error> {
    let mut timing = Timing::start();
    let (parts, body) = request.into_parts();
    // A client key or a signed identity is also what lets a request spend engram's upstream
    // key, on these routes as on chat.
    let vouched = state.authenticate(&parts.headers)?;
    state.admit(&parts.headers, &vouched, None)?;
    let rest = parts
        .uri
        .path_and_query()
        .map_or("/", |p| p.as_str())
        .strip_prefix("/v1")
        .unwrap_or("/");
    let mut upstream_request = Request::new(body.map_err(BodyError::from).boxed());
    *upstream_request.method_mut() = parts.method;
    *upstream_request.uri_mut() = state.upstream.uri_for(rest)?;
    *upstream_request.headers_mut() = state.upstream.request_headers(&parts.headers);
    trace.start_upstream(&mut upstream_request);

    timing.sent();
    let response = state.upstream.send(upstream_request).await?;
    timing.answered();
    trace.upstream_answered(response.status());
    let (mut parts, body) = response.into_parts();
    parts.headers = without_hop_by_hop(&parts.headers);
    state.metrics.http.observe(Route::Passthrough, &timing);
    Ok(Response::from_parts(
        parts,
        body.map_err(BodyError::from).boxed(),
    ))
}
