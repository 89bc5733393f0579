//! What wraps a route's handler, tower-style: a [`Handler`] takes a request and answers it, and
//! each layer here is a handler holding the one inside it, doing one thing around it.
//!
//! - [`Observe`], outermost: starts the request's [`Observer`] (its span and timing), runs
//!   everything inside in the span's context, and ends a failed request's span with its error.
//!   The handlers inside get the observer with each call, to report their phases to it.
//! - [`RefuseWhileDraining`]: once shutdown has begun, a 503 (`shutting_down`) instead of the
//!   handler inside.
//! - [`Admission`]: the tenant's and the user's rate limits; a request over one gets a 429 with
//!   `retry-after` and is counted in `engram_rate_limited_total{kind="requests"}`. It needs to
//!   know who is asking, so it sits inside the route's identification step, which turns the
//!   HTTP request into an [`Identified`] one.
//!
//! A route builds its stack in one expression, outermost first (see `chat::handle`). The layers
//! hold no state: the state is the [`AppState`] every call is given.

use std::future::Future;
use std::marker::PhantomData;

use http::{HeaderMap, Request, Response};
use opentelemetry::Context;

use super::AppState;
use crate::error::{Error, ProxyBody};
use engram_memory::openai::ChatRequest;
use engram_ops::metrics::RateLimitKind;
use engram_proxy::pipeline::identity;
use engram_proxy::pipeline::trust::Vouched;
use engram_proxy::telemetry;

/// What a layer answers with: the response, or the error the route table renders.
pub(super) type Answered = Result<Response<ProxyBody>, Error>;

/// Answers a request of type `R`, reporting to the request's observer `O` as it goes.
pub(super) trait Handler<R, O>: Send + Sync {
    fn call(
        &self,
        state: &AppState,
        request: R,
        observer: &mut O,
    ) -> impl Future<Output = Answered> + Send;
}

/// What watches one request for its span and its metrics: started before anything else,
/// told the result last.
pub(super) trait Observer<'s>: Send + Sized {
    fn start<B>(state: &'s AppState, request: &Request<B>) -> Self;

    /// The span's context the handlers run in; `None` runs them in the caller's.
    fn context(&self) -> Option<Context>;

    /// The handlers' result, once they have answered.
    fn finish(&mut self, answered: &Answered);
}

/// The outermost layer: the request's [`Observer`] around the handler `H`.
pub(super) struct Observe<O, H> {
    inner: H,
    observer: PhantomData<fn() -> O>,
}

impl<O, H> Observe<O, H> {
    pub(super) fn new(inner: H) -> Self {
        Observe {
            inner,
            observer: PhantomData,
        }
    }

    pub(super) async fn serve<'s, B>(&self, state: &'s AppState, request: Request<B>) -> Answered
    where
        O: Observer<'s>,
        H: Handler<Request<B>, O>,
    {
        let mut observer = O::start(state, &request);
        let cx = observer.context();
        let answered = telemetry::traced(cx, self.inner.call(state, request, &mut observer)).await;
        observer.finish(&answered);
        answered
    }
}

/// Refuses work once the server is draining (`Error::ShuttingDown`, a 503), else runs `H`.
pub(super) struct RefuseWhileDraining<H>(pub(super) H);

impl<R: Send, O: Send, H: Handler<R, O>> Handler<R, O> for RefuseWhileDraining<H> {
    async fn call(&self, state: &AppState, request: R, observer: &mut O) -> Answered {
        if state.is_draining() {
            return Err(Error::ShuttingDown);
        }
        self.0.call(state, request, observer).await
    }
}

/// A request whose caller is known: what [`Admission`] reads to find the tenant and the user.
pub(super) trait Identified {
    fn headers(&self) -> &HeaderMap;
    fn vouched(&self) -> &Vouched;
    /// The chat request, which may name the user in its body; `None` on other routes.
    fn chat(&self) -> Option<&ChatRequest>;
}

/// Admits a request under the tenant's (and, for a chat request naming one, the user's) rate
/// limit, or turns it away with a 429 and `retry-after`; then runs `H`.
pub(super) struct Admission<H>(pub(super) H);

impl<R, O, H> Handler<R, O> for Admission<H>
where
    R: Identified + Send,
    O: Send,
    H: Handler<R, O>,
{
    async fn call(&self, state: &AppState, request: R, observer: &mut O) -> Answered {
        admit(state, &request)?;
        self.0.call(state, request, observer).await
    }
}

fn admit(state: &AppState, request: &impl Identified) -> Result<(), Error> {
    let Some(limits) = &state.limits else {
        return Ok(());
    };
    let (tenant, user) = identity::tenant_and_user(
        request.headers(),
        request.vouched(),
        request.chat(),
        &state.config.identity,
    )?;
    limits
        .check(&tenant, user.as_deref())
        .map_err(|(_scope, error)| {
            state.metrics.rate_limited(RateLimitKind::Requests);
            error
        })
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::Ordering;
    use std::sync::{Arc, Mutex};

    use http::StatusCode;

    use super::*;
    use crate::error::full_body;
    use engram_ops::config::Config;
    use engram_ops::metrics::Metrics;
    use engram_proxy::pipeline::NoMemory;
    use engram_proxy::pipeline::trust::Gate;
    use engram_proxy::upstream::Upstream;

    /// A tenant may send one request, then waits a second.
    fn state() -> AppState {
        let mut config = Config::default();
        config.rate_limits.tenant_requests_per_second = 1;
        config.rate_limits.tenant_burst = 1;
        let upstream = Upstream::new(&config.upstream, None).unwrap();
        let metrics = Arc::new(Metrics::new().unwrap());
        AppState::new(
            config,
            upstream,
            Arc::new(NoMemory),
            metrics,
            Gate::headers(),
        )
    }

    /// What each step saw, in order; the request carries it in its extensions.
    #[derive(Clone, Default)]
    struct Seen(Arc<Mutex<Vec<String>>>);

    impl Seen {
        fn push(&self, step: String) {
            self.0.lock().unwrap().push(step);
        }
    }

    struct Log(Seen);

    impl<'s> Observer<'s> for Log {
        fn start<B>(_state: &'s AppState, request: &Request<B>) -> Self {
            let seen = request.extensions().get::<Seen>().cloned().unwrap();
            seen.push(format!("start {}", request.uri().path()));
            Log(seen)
        }

        fn context(&self) -> Option<Context> {
            None
        }

        fn finish(&mut self, answered: &Answered) {
            self.0.push(match answered {
                Ok(response) => format!("finish {}", response.status()),
                Err(error) => format!("finish {}", error.status_code()),
            });
        }
    }

    /// The request as the route's identification step would give it.
    struct Asked(Request<()>);

    impl Identified for Asked {
        fn headers(&self) -> &HeaderMap {
            self.0.headers()
        }

        fn vouched(&self) -> &Vouched {
            &Vouched::Headers
        }

        fn chat(&self) -> Option<&ChatRequest> {
            None
        }
    }

    struct Identify<H>(H);

    impl<O: Send, H: Handler<Asked, O>> Handler<Request<()>, O> for Identify<H> {
        async fn call(&self, state: &AppState, request: Request<()>, observer: &mut O) -> Answered {
            self.0.call(state, Asked(request), observer).await
        }
    }

    /// The innermost handler: notes that it ran and answers 200.
    struct Answer;

    impl Handler<Asked, Log> for Answer {
        async fn call(&self, _state: &AppState, _request: Asked, log: &mut Log) -> Answered {
            log.0.push("handler".to_owned());
            Ok(Response::new(full_body("{}")))
        }
    }

    /// The chat route's order: observed, draining refused, identified, admitted, handled.
    async fn serve(state: &AppState, tenant: &str) -> (Vec<String>, Answered) {
        let stack = Observe::<Log, _>::new(RefuseWhileDraining(Identify(Admission(Answer))));
        let seen = Seen::default();
        let request = Request::builder()
            .uri("/v1/chat/completions")
            .header("x-engram-tenant", tenant)
            .extension(seen.clone())
            .body(())
            .unwrap();
        let answered = stack.serve(state, request).await;
        let seen = seen.0.lock().unwrap().clone();
        (seen, answered)
    }

    #[tokio::test]
    async fn the_layers_run_outermost_first_and_the_handler_last() {
        let state = state();
        let (seen, answered) = serve(&state, "acme").await;
        assert_eq!(answered.unwrap().status(), StatusCode::OK);
        assert_eq!(
            seen,
            ["start /v1/chat/completions", "handler", "finish 200 OK"]
        );
    }

    #[tokio::test]
    async fn admission_turns_away_a_tenant_over_its_limit_before_the_handler() {
        let state = state();
        let (_, first) = serve(&state, "acme").await;
        assert!(first.is_ok());
        let (seen, second) = serve(&state, "acme").await;
        let error = second.unwrap_err();
        assert!(matches!(error, Error::RateLimited { .. }), "{error:?}");
        let response = error.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(response.headers().contains_key("retry-after"));
        assert_eq!(
            seen,
            ["start /v1/chat/completions", "finish 429 Too Many Requests"]
        );
        // Another tenant still passes.
        assert!(serve(&state, "globex").await.1.is_ok());
    }

    #[tokio::test]
    async fn a_draining_server_refuses_before_admission_spends_a_token() {
        let state = state();
        state.draining.store(true, Ordering::Release);
        let (seen, answered) = serve(&state, "acme").await;
        let error = answered.unwrap_err();
        assert!(matches!(error, Error::ShuttingDown), "{error:?}");
        assert_eq!(
            error.into_response().status(),
            StatusCode::SERVICE_UNAVAILABLE
        );
        assert_eq!(
            seen,
            [
                "start /v1/chat/completions",
                "finish 503 Service Unavailable"
            ]
        );
        // The refused request spent nothing of the tenant's limit.
        state.draining.store(false, Ordering::Release);
        assert!(serve(&state, "acme").await.1.is_ok());
    }
}
