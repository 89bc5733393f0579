//! `POST /v1/chat/completions`, the interception point, as named phases in request order, in
//! the spirit of Pingora's `ProxyHttp`: [`identify`], admit, [`load_memory`], [`forward`],
//! [`filter_response`], [`tee_and_record`]. [`handle`] builds the stack that runs them: what
//! applies around the phases (the request's span and metrics, refusing work while draining,
//! admission under the rate limits) is a layer of its own (`super::layers`), and what the span
//! and the metrics see of each phase passes through one [`Observed`].

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::response;
use http::{Request, Response, StatusCode};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use opentelemetry::Context;
use tokio::sync::oneshot;

use super::AppState;
use super::layers::{
    Admission, Answered, Handler, Identified, Observe, Observer, RefuseWhileDraining,
};
use crate::error::{BodyError, Error, ProxyBody, full_body};
use engram_memory::openai::ChatRequest;
use engram_ops::metrics::{Route, Timing};
use engram_proxy::pipeline::trust::Vouched;
use engram_proxy::pipeline::{Exchange, Incomplete, Receipt, Rewrite};
use engram_proxy::recorder::tee::{
    self, FirstFrame, PrefixedBody, ReceiptWait, TeeBody, TeeOptions,
};
use engram_proxy::telemetry::{self, RequestTrace};
use engram_proxy::upstream::without_hop_by_hop;

/// The chat route's stack, outermost first: the request's span and metrics ([`Observed`]),
/// refusing work while draining, [`identify`] (phase 1), admission under the rate limits
/// (phase 2, which needs the identified user), then phases 3 to 6 ([`Phases`]).
pub async fn handle(
    state: Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, Error> {
    let stack = Observe::<Observed<'_>, _>::new(RefuseWhileDraining(Identify(Admission(Phases))));
    stack.serve(&state, request).await
}

/// Phase 1 as a layer: the request identified, then given to `H`.
struct Identify<H>(H);

impl<'s, H: Handler<Chat, Observed<'s>>> Handler<Request<Incoming>, Observed<'s>> for Identify<H> {
    async fn call(
        &self,
        state: &AppState,
        request: Request<Incoming>,
        observed: &mut Observed<'s>,
    ) -> Answered {
        let chat = identify(state, request).await?;
        observed.identified(&chat.request);
        self.0.call(state, chat, observed).await
    }
}

/// The phases after admission, in order; a phase's error ends the request with that error.
struct Phases;

impl<'s> Handler<Chat, Observed<'s>> for Phases {
    async fn call(
        &self,
        state: &AppState,
        mut chat: Chat,
        observed: &mut Observed<'s>,
    ) -> Answered {
        let mut rewrite = load_memory(state, &chat).await?;
        observed.memory_loaded(&rewrite);
        let strip_usage = chat.request.is_stream() && !chat.request.client_wants_usage();
        let response = forward(state, &mut chat, &mut rewrite, strip_usage, observed).await?;
        let answer = match filter_response(state, response, &rewrite, strip_usage) {
            Filtered::UpstreamError(response) => {
                observed.answered_with_error(response.status());
                return Ok(response);
            }
            Filtered::Answer(answer) => answer,
        };
        let response = tee_and_record(state, chat, rewrite, answer, observed).await?;
        observed.answered();
        Ok(response)
    }
}

/// A chat request that passed [`identify`].
struct Chat {
    parts: Parts,
    vouched: Vouched,
    /// The body as the client sent it, until [`forward`] sends it on (or what replaces it).
    body: Bytes,
    request: ChatRequest,
}

/// Phase 1, identify: the credential checked against the identity it names
/// (`identity.trust`), before the body is read; then the content type, the size, and one
/// parse.
async fn identify(state: &AppState, request: Request<Incoming>) -> Result<Chat, Error> {
    let (parts, body) = request.into_parts();
    let vouched = state.authenticate(&parts.headers)?;
    check_content_type(&parts.headers)?;
    let body = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    let request = ChatRequest::from_slice(&body)?;
    Ok(Chat {
        parts,
        vouched,
        body,
        request,
    })
}

/// Phase 2, admit: the tenant's and the user's rate limits (a 429 with `retry-after`), by the
/// [`Admission`] layer, which reads who is asking from here.
impl Identified for Chat {
    fn headers(&self) -> &HeaderMap {
        &self.parts.headers
    }

    fn vouched(&self) -> &Vouched {
        &self.vouched
    }

    fn chat(&self) -> Option<&ChatRequest> {
        Some(&self.request)
    }
}

/// Phase 3, load memory: identity, the bounded store read, the cached memory and the
/// composed prompt ([`engram_proxy::pipeline::MemoryLayer::rewrite`]); a store that fails or is slow
/// gives a rewrite without memory, not an error.
async fn load_memory(state: &AppState, chat: &Chat) -> Result<Rewrite, Error> {
    state
        .memory
        .rewrite(&chat.parts.headers, &chat.vouched, &chat.request)
        .await
}

/// Phase 4, forward: the upstream request (the rewritten messages, usage asked for on streams
/// so the recorder sees token counts), sent; returns the upstream's response headers. The
/// client's body is not kept past it.
async fn forward(
    state: &AppState,
    chat: &mut Chat,
    rewrite: &mut Rewrite,
    strip_usage: bool,
    observed: &mut Observed<'_>,
) -> Result<Response<Incoming>, Error> {
    let body = std::mem::take(&mut chat.body);
    let upstream_body = match rewrite.messages.take() {
        None if !strip_usage => body,
        messages => Bytes::from(chat.request.upstream_body(
            &body,
            messages.as_deref(),
            strip_usage,
        )?),
    };
    let mut upstream_request = upstream_request(state, &chat.parts, upstream_body)?;
    observed.forwarding(&mut upstream_request);
    let response = state.upstream.send(upstream_request).await?;
    observed.upstream_answered(response.status());
    Ok(response)
}

/// What [`filter_response`] made of the upstream's response.
enum Filtered {
    /// An upstream error, to go back exactly as the upstream sent it.
    UpstreamError(Response<ProxyBody>),
    Answer(Answer),
}

/// A successful answer's head, and how its body will go back.
struct Answer {
    head: response::Parts,
    body: Incoming,
    event_stream: bool,
    strip_usage: bool,
    /// Told once the recording is durable (or failed); `None` when nothing is recorded.
    receipt_sender: Option<oneshot::Sender<Receipt>>,
    /// A stream's receipt: the SSE comment before its `data: [DONE]`.
    stream_receipt: Option<ReceiptWait>,
    /// A whole answer's receipt: the `x-engram-job-state` header.
    whole_receipt: Option<oneshot::Receiver<Receipt>>,
    max_wait: Duration,
}

/// Phase 5, response filter: hop-by-hop headers out, the memory headers in; an upstream error
/// goes back as it came. Only an answered request names its turn (whose explanation the
/// management API keeps) and, if it is recorded, its job. A recorded answer ends only once its
/// recording is durable (or the wait ran out), so the session's next request finds it; the
/// receipt says which. A stream's receipt is an SSE comment just before its `data: [DONE]`,
/// which SSE clients ignore and a client that wants to read its own writes can parse; a whole
/// answer's is the `x-engram-job-state` header.
fn filter_response(
    state: &AppState,
    response: Response<Incoming>,
    rewrite: &Rewrite,
    strip_usage: bool,
) -> Filtered {
    let (mut head, body) = response.into_parts();
    head.headers = without_hop_by_hop(&head.headers);
    add_memory_headers(&mut head.headers, rewrite);
    if !head.status.is_success() {
        let body = body.map_err(BodyError::from).boxed();
        return Filtered::UpstreamError(Response::from_parts(head, body));
    }
    // Both ids are hex and ASCII, always valid header values.
    let job = rewrite.record.as_ref().map(|plan| &plan.job.key);
    for (name, value) in [
        ("x-engram-turn-id", rewrite.turn_id.as_ref()),
        ("x-engram-job-id", job),
    ] {
        if let Some(value) = value.and_then(|value| HeaderValue::from_str(value).ok()) {
            head.headers.insert(name, value);
        }
    }
    let event_stream = is_event_stream(&head.headers);
    let (receipt_sender, receipt) = match &rewrite.record {
        Some(_) => {
            let (sender, receiver) = oneshot::channel();
            (Some(sender), Some(receiver))
        }
        None => (None, None),
    };
    // The recorder releases the answer at `receipt_wait_ms` (noting it in its journal); this
    // later bound only covers a recorder that never answers.
    let max_wait = Duration::from_millis(state.config.capture.receipt_wait_ms) + RECEIPT_BACKSTOP;
    let (stream_receipt, whole_receipt) = match (&rewrite.record, receipt) {
        (Some(plan), Some(recorded)) if event_stream => {
            let comment = format!(": engram turn={} job={}", plan.turn_id, plan.job.key);
            let wait = ReceiptWait {
                recorded,
                max_wait,
                comment,
                waited: Some(state.metrics.memory.receipt_wait()),
            };
            (Some(wait), None)
        }
        (_, receipt) => (None, receipt),
    };
    if (strip_usage || stream_receipt.is_some()) && event_stream {
        head.headers.remove(header::CONTENT_LENGTH);
    }
    Filtered::Answer(Answer {
        head,
        body,
        event_stream,
        strip_usage,
        receipt_sender,
        stream_receipt,
        whole_receipt,
        max_wait,
    })
}

/// Phase 6, tee and record: the body goes back untouched while the tee copies it aside; once
/// it has ended, the recorder gets the exchange (on the tracked task set that shutdown drains)
/// and the request's span ends with what the recorder read. A whole answer that is recorded
/// goes back once its receipt is in.
async fn tee_and_record(
    state: &AppState,
    chat: Chat,
    rewrite: Rewrite,
    answer: Answer,
    observed: &mut Observed<'_>,
) -> Result<Response<ProxyBody>, Error> {
    let Answer {
        mut head,
        body,
        event_stream,
        strip_usage,
        receipt_sender,
        stream_receipt,
        whole_receipt,
        max_wait,
    } = answer;
    let capture = &state.config.capture;
    let (body, copies, tee_state) = TeeBody::new(
        body,
        TeeOptions {
            channel_frames: capture.channel_frames,
            max_tapped_bytes: capture.max_response_bytes,
            idle_timeout: state.upstream.read_timeout(),
            event_stream,
            strip_usage: strip_usage && event_stream,
            receipt: stream_receipt,
            first_frame: Some(observed.first_frame(event_stream)),
        },
    );
    let memory = state.memory.clone();
    let original = chat.request;
    let client_headers = chat.parts.headers;
    let record = rewrite.record;
    // The spans end with the body, when the recorder has read the usage.
    let trace = observed.trace.take();
    let cx = trace.context();
    state.tasks.spawn(telemetry::traced(cx, async move {
        let capture = tee::collect(copies, tee_state, event_stream).await;
        trace.finish(&capture.message, capture.incomplete.map(Incomplete::as_str));
        let exchange = Exchange {
            request: original,
            client_headers,
            capture,
            record,
            receipt: receipt_sender,
        };
        memory.record(exchange).await;
    }));
    let body = match whole_receipt {
        Some(recorded) => {
            let waited = |took: Duration| state.metrics.memory.receipt_waited(took);
            let (receipt, body) =
                whole_with_receipt(body, recorded, max_wait, capture, waited).await?;
            if let Some(receipt) = receipt {
                head.headers.insert(
                    "x-engram-job-state",
                    HeaderValue::from_static(receipt.as_str()),
                );
            }
            body
        }
        None => BodyExt::boxed(body),
    };
    Ok(Response::from_parts(head, body))
}

/// What the request's span and its metrics see of the phases: each phase reports here, once,
/// and this passes it on to both.
struct Observed<'a> {
    trace: RequestTrace,
    timing: Timing,
    state: &'a AppState,
}

impl<'a> Observer<'a> for Observed<'a> {
    fn start<B>(state: &'a AppState, request: &Request<B>) -> Observed<'a> {
        let trace = state.telemetry.chat_request(request.headers());
        Observed {
            trace,
            timing: Timing::start(),
            state,
        }
    }

    fn context(&self) -> Option<Context> {
        self.trace.context()
    }

    /// A failed request's spans end with its error.
    fn finish(&mut self, answered: &Answered) {
        if let Err(error) = answered {
            self.trace.fail(error);
        }
    }
}

impl Observed<'_> {
    fn identified(&mut self, request: &ChatRequest) {
        self.trace.chat(request);
    }

    fn memory_loaded(&mut self, rewrite: &Rewrite) {
        self.state.metrics.memory.observe(rewrite);
        self.trace.memory(rewrite.span());
    }

    /// The upstream request is about to go: its span's context goes with it.
    fn forwarding(&mut self, request: &mut Request<ProxyBody>) {
        self.trace.start_upstream(request);
        self.timing.sent();
    }

    fn upstream_answered(&mut self, status: StatusCode) {
        self.timing.answered();
        self.trace.upstream_answered(status);
    }

    /// The upstream's error goes back as it came: the spans end here.
    fn answered_with_error(&mut self, status: StatusCode) {
        self.trace.take().answered(status);
        self.answered();
    }

    /// The time to the answer's first body frame, observed when the tee passes it on.
    fn first_frame(&self, stream: bool) -> FirstFrame {
        self.state.metrics.http.first_frame(&self.timing, stream)
    }

    /// The response head is ready: engram's time and the upstream's.
    fn answered(&self) {
        self.state
            .metrics
            .http
            .observe(Route::ChatCompletions, &self.timing);
    }
}

/// How much longer than `capture.receipt_wait_ms` an answer's end waits for the recorder.
const RECEIPT_BACKSTOP: Duration = Duration::from_secs(1);

/// A recorded answer that is not a stream: read whole (it is one JSON value), then sent once
/// its recording is durable or `max_wait` ran out, with the receipt. One larger than
/// `capture.max_response_bytes` goes on as it comes, without a receipt.
async fn whole_with_receipt(
    mut body: TeeBody,
    recorded: oneshot::Receiver<Receipt>,
    max_wait: Duration,
    capture: &engram_ops::config::CaptureConfig,
    waited: impl FnOnce(Duration),
) -> Result<(Option<Receipt>, ProxyBody), Error> {
    let mut read = Vec::new();
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|error| Error::UpstreamFailed(error.to_string()))?;
        if let Ok(data) = frame.into_data() {
            read.extend_from_slice(&data);
        }
        if read.len() > capture.max_response_bytes {
            let rest = PrefixedBody::new(Bytes::from(read), body);
            return Ok((None, BodyExt::boxed(rest)));
        }
    }
    let since = std::time::Instant::now();
    let receipt = match tokio::time::timeout(max_wait, recorded).await {
        Ok(Ok(receipt)) => receipt,
        Ok(Err(_)) => Receipt::Unrecorded,
        Err(_) => Receipt::Pending,
    };
    waited(since.elapsed());
    Ok((Some(receipt), full_body(Bytes::from(read))))
}

fn check_content_type(headers: &HeaderMap) -> Result<(), Error> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        // Lenient like OpenAI itself: a body without a content type is read as JSON.
        return Ok(());
    };
    let media_type = value
        .to_str()
        .unwrap_or_default()
        .split(';')
        .next()
        .unwrap_or_default()
        .trim()
        .to_ascii_lowercase();
    if media_type == "application/json" || media_type.ends_with("+json") {
        Ok(())
    } else {
        Err(Error::UnsupportedMediaType(
            String::from_utf8_lossy(value.as_bytes()).into_owned(),
        ))
    }
}

async fn read_body(body: Incoming, headers: &HeaderMap, limit: u64) -> Result<Bytes, Error> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.parse::<u64>().ok());
    if declared.is_some_and(|length| length > limit) {
        return Err(Error::PayloadTooLarge { limit });
    }
    let limit_usize = usize::try_from(limit).unwrap_or(usize::MAX);
    match Limited::new(body, limit_usize).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(error) if error.is::<http_body_util::LengthLimitError>() => {
            Err(Error::PayloadTooLarge { limit })
        }
        Err(error) => Err(Error::invalid_request(
            format!("could not read the request body: {error}"),
            None,
        )),
    }
}

fn upstream_request(
    state: &AppState,
    client: &Parts,
    body: Bytes,
) -> Result<Request<ProxyBody>, Error> {
    let rest = client
        .uri
        .path_and_query()
        .map_or("/chat/completions", |p| p.as_str())
        .strip_prefix("/v1")
        .unwrap_or("/chat/completions");
    let mut headers = state.upstream.request_headers(&client.headers);
    // The body may have changed size; hyper sets the length from the body itself.
    headers.remove(header::CONTENT_LENGTH);
    // The recorder must read the answer, so ask for it uncompressed.
    headers.remove(header::ACCEPT_ENCODING);
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let mut request = Request::new(full_body(body));
    *request.method_mut() = http::Method::POST;
    *request.uri_mut() = state.upstream.uri_for(rest)?;
    *request.headers_mut() = headers;
    Ok(request)
}

fn is_event_stream(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|value| value.to_str().ok())
        .is_some_and(|value| value.starts_with("text/event-stream"))
}

fn add_memory_headers(headers: &mut HeaderMap, rewrite: &Rewrite) {
    headers.insert(
        "x-engram-memory",
        HeaderValue::from_static(rewrite.outcome.as_str()),
    );
    if let Some(reason) = rewrite.reason {
        headers.insert("x-engram-memory-reason", HeaderValue::from_static(reason));
    }
    if rewrite.reserved_over_budget {
        headers.insert(
            "x-engram-memory-over-budget",
            HeaderValue::from_static("reserved"),
        );
    }
    if rewrite.injected_items > 0 {
        headers.insert(
            "x-engram-memory-tokens",
            HeaderValue::from(rewrite.injected_tokens),
        );
        headers.insert(
            "x-engram-memory-items",
            HeaderValue::from(rewrite.injected_items),
        );
    }
}
