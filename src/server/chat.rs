//! `POST /v1/chat/completions`, the interception point, as named phases in request order.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Request, Response};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;
use tokio::sync::oneshot;

use super::AppState;
use crate::error::{BodyError, Error, ProxyBody, full_body};
use crate::metrics::{Route, Timing};
use crate::openai::ChatRequest;
use crate::pipeline::{Exchange, Incomplete, Receipt, Rewrite};
use crate::recorder::tee::{self, PrefixedBody, ReceiptWait, TeeBody, TeeOptions};
use crate::telemetry::{self, RequestTrace};
use crate::upstream::without_hop_by_hop;

pub async fn handle(
    state: Arc<AppState>,
    request: Request<Incoming>,
) -> Result<Response<ProxyBody>, Error> {
    let mut trace = state.telemetry.chat_request(request.headers());
    let cx = trace.context();
    let result = telemetry::traced(cx, proxy(&state, request, &mut trace)).await;
    if let Err(error) = &result {
        trace.fail(error);
    }
    result
}

async fn proxy(
    state: &AppState,
    request: Request<Incoming>,
    trace: &mut RequestTrace,
) -> Result<Response<ProxyBody>, Error> {
    let mut timing = Timing::start();
    if state.is_draining() {
        return Err(Error::ShuttingDown);
    }
    // Phase 1: request filter — credential, content type, size, one parse.
    let (parts, body) = request.into_parts();
    let vouched = state.authenticate(&parts.headers)?;
    check_content_type(&parts.headers)?;
    let body = read_body(body, &parts.headers, state.config.server.max_body_bytes).await?;
    let original = ChatRequest::from_slice(&body)?;
    trace.chat(&original);
    state.admit(&parts.headers, &vouched, Some(&original))?;

    // Phase 2: memory rewrite.
    let mut rewrite = state
        .memory
        .rewrite(&parts.headers, &vouched, &original)
        .await?;
    state.metrics.memory.observe(&rewrite);
    trace.memory(rewrite.span());

    // Phase 3: upstream request. Ask for usage on streams so the recorder sees token counts.
    let strip_usage = original.is_stream() && !original.client_wants_usage();
    let upstream_body = match rewrite.messages.take() {
        None if !strip_usage => body,
        messages => Bytes::from(original.upstream_body(&body, messages.as_deref(), strip_usage)?),
    };
    let mut upstream_request = upstream_request(state, &parts, upstream_body)?;
    trace.start_upstream(&mut upstream_request);
    timing.sent();
    let response = state.upstream.send(upstream_request).await?;
    timing.answered();
    trace.upstream_answered(response.status());

    // Phase 4: response filter. Upstream errors go back exactly as the upstream sent them.
    let (mut response_parts, upstream_body) = response.into_parts();
    response_parts.headers = without_hop_by_hop(&response_parts.headers);
    add_memory_headers(&mut response_parts.headers, &rewrite);
    if !response_parts.status.is_success() {
        trace.take().answered(response_parts.status);
        let body = upstream_body.map_err(BodyError::from).boxed();
        state.metrics.http.observe(Route::ChatCompletions, &timing);
        return Ok(Response::from_parts(response_parts, body));
    }
    // Only an answered request names its turn (whose explanation the management API keeps)
    // and, if it is recorded, its job. Both ids are hex and ASCII, always valid header values.
    let job = rewrite.record.as_ref().map(|plan| &plan.job.key);
    for (name, value) in [
        ("x-engram-turn-id", rewrite.turn_id.as_ref()),
        ("x-engram-job-id", job),
    ] {
        if let Some(value) = value.and_then(|value| HeaderValue::from_str(value).ok()) {
            response_parts.headers.insert(name, value);
        }
    }
    let event_stream = is_event_stream(&response_parts.headers);
    // A recorded answer ends only once its recording is durable (or the wait ran out), so the
    // session's next request finds it; the receipt says which. A stream's receipt is an SSE
    // comment just before its `data: [DONE]`, which SSE clients ignore and a client that wants
    // to read its own writes can parse; a whole answer's is the `x-engram-job-state` header.
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
            };
            (Some(wait), None)
        }
        (_, receipt) => (None, receipt),
    };
    if (strip_usage || stream_receipt.is_some()) && event_stream {
        response_parts.headers.remove(header::CONTENT_LENGTH);
    }

    // Phase 5: response body filter — the tee — and, after it, the recorder.
    let capture = &state.config.capture;
    let (body, copies, tee_state) = TeeBody::new(
        upstream_body,
        TeeOptions {
            channel_frames: capture.channel_frames,
            max_tapped_bytes: capture.max_response_bytes,
            idle_timeout: state.upstream.read_timeout(),
            event_stream,
            strip_usage: strip_usage && event_stream,
            receipt: stream_receipt,
            first_frame: Some(state.metrics.http.first_frame(&timing, event_stream)),
        },
    );
    let memory = state.memory.clone();
    let client_headers = parts.headers;
    let record = rewrite.record;
    // The spans end with the body, when the recorder has read the usage.
    let trace = trace.take();
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
            let (receipt, body) = whole_with_receipt(body, recorded, max_wait, capture).await?;
            if let Some(receipt) = receipt {
                response_parts.headers.insert(
                    "x-engram-job-state",
                    HeaderValue::from_static(receipt.as_str()),
                );
            }
            body
        }
        None => BodyExt::boxed(body),
    };
    state.metrics.http.observe(Route::ChatCompletions, &timing);
    Ok(Response::from_parts(response_parts, body))
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
    capture: &crate::config::CaptureConfig,
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
    let receipt = match tokio::time::timeout(max_wait, recorded).await {
        Ok(Ok(receipt)) => receipt,
        Ok(Err(_)) => Receipt::Unrecorded,
        Err(_) => Receipt::Pending,
    };
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
