//! Every `/v1/*` route other than chat completions: bodies stream both ways, untouched.

use std::sync::Arc;

use http::request::Parts;
use http::{HeaderMap, Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use opentelemetry::Context;

use super::AppState;
use super::layers::{Admission, Answered, Handler, Identified, Observe, Observer};
use crate::error::{BodyError, Error, ProxyBody};
use engram_memory::openai::ChatRequest;
use engram_ops::metrics::{Route, Timing};
use engram_proxy::pipeline::trust::Vouched;
use engram_proxy::telemetry::RequestTrace;
use engram_proxy::upstream::without_hop_by_hop;

/// The stack, outermost first: the request's span and metrics ([`Watched`]), the credential,
/// admission under the tenant's rate limit, then the request sent on. Unlike chat, a draining
/// server still forwards these.
pub async fn handle(
    state: Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, Error> {
    let stack = Observe::<Watched<'_>, _>::new(Authenticate(Admission(Forward)));
    stack.serve(&state, request).await
}

/// A request whose credential passed.
struct Authenticated {
    parts: Parts,
    body: Incoming,
    vouched: Vouched,
}

impl Identified for Authenticated {
    fn headers(&self) -> &HeaderMap {
        &self.parts.headers
    }

    fn vouched(&self) -> &Vouched {
        &self.vouched
    }

    fn chat(&self) -> Option<&ChatRequest> {
        None
    }
}

/// A client key or a signed identity is also what lets a request spend engram's upstream key,
/// on these routes as on chat: checked, then the request given to `H`.
struct Authenticate<H>(H);

impl<O: Send, H: Handler<Authenticated, O>> Handler<Request<Incoming>, O> for Authenticate<H> {
    async fn call(
        &self,
        state: &AppState,
        request: Request<Incoming>,
        observer: &mut O,
    ) -> Answered {
        let (parts, body) = request.into_parts();
        let vouched = state.authenticate(&parts.headers)?;
        let request = Authenticated {
            parts,
            body,
            vouched,
        };
        self.0.call(state, request, observer).await
    }
}

/// The request sent on; bodies stream through untouched, so the spans end with the response
/// headers.
struct Forward;

impl<'s> Handler<Authenticated, Watched<'s>> for Forward {
    async fn call(
        &self,
        state: &AppState,
        request: Authenticated,
        watched: &mut Watched<'s>,
    ) -> Answered {
        let Authenticated { parts, body, .. } = request;
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
        watched.trace.start_upstream(&mut upstream_request);

        watched.timing.sent();
        let response = state.upstream.send(upstream_request).await?;
        watched.timing.answered();
        watched.trace.upstream_answered(response.status());
        let (mut parts, body) = response.into_parts();
        parts.headers = without_hop_by_hop(&parts.headers);
        Ok(Response::from_parts(
            parts,
            body.map_err(BodyError::from).boxed(),
        ))
    }
}

/// What the request's span and its metrics see: the engram's and the upstream's time, counted
/// once the response headers are back.
struct Watched<'s> {
    trace: RequestTrace,
    timing: Timing,
    state: &'s AppState,
}

impl<'s> Observer<'s> for Watched<'s> {
    fn start<B>(state: &'s AppState, request: &Request<B>) -> Watched<'s> {
        let trace =
            state
                .telemetry
                .http_request(request.method(), request.uri().path(), request.headers());
        Watched {
            trace,
            timing: Timing::start(),
            state,
        }
    }

    /// Runs in the caller's context; the upstream request carries the span's own.
    fn context(&self) -> Option<Context> {
        None
    }

    fn finish(&mut self, answered: &Answered) {
        match answered {
            Ok(response) => {
                self.state
                    .metrics
                    .http
                    .observe(Route::Passthrough, &self.timing);
                self.trace.take().answered(response.status());
            }
            Err(error) => self.trace.fail(error),
        }
    }
}
