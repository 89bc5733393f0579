//! The response body filter: upstream frames go to the client as they arrive, and a clone of
//! each (a reference count, not a copy) goes to a bounded channel read by the recorder off the
//! hot path. A full channel marks the capture incomplete instead of slowing the client.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};
use hyper::body::Incoming;
use prometheus::Histogram;
use tokio::sync::{mpsc, oneshot};
use tokio::time::{Instant, Sleep};

use super::{Capture, Incomplete, Receipt};
use crate::error::BodyError;
use engram_memory::openai::sse::UsageStripper;
use engram_memory::openai::{AssistantMessage, StreamAccumulator};

/// The first reason the capture became incomplete, shared by the tee and the recorder.
#[derive(Debug, Default)]
pub struct TeeState {
    incomplete: AtomicU8,
}

impl TeeState {
    fn mark(&self, reason: Incomplete) {
        let code = match reason {
            Incomplete::ClientDisconnected => 1,
            Incomplete::UpstreamFailed => 2,
            Incomplete::TeeOverflow => 3,
            Incomplete::TooLarge => 4,
            Incomplete::Malformed => 5,
        };
        // Keep the first reason: it is the cause, later ones are consequences.
        let _ = self
            .incomplete
            .compare_exchange(0, code, Ordering::AcqRel, Ordering::Acquire);
    }

    pub fn incomplete(&self) -> Option<Incomplete> {
        match self.incomplete.load(Ordering::Acquire) {
            1 => Some(Incomplete::ClientDisconnected),
            2 => Some(Incomplete::UpstreamFailed),
            3 => Some(Incomplete::TeeOverflow),
            4 => Some(Incomplete::TooLarge),
            5 => Some(Incomplete::Malformed),
            _ => None,
        }
    }
}

pub struct TeeBody {
    upstream: Incoming,
    /// `None` once the capture stopped (overflow, size limit, end).
    tap: Option<mpsc::Sender<Bytes>>,
    state: Arc<TeeState>,
    stripper: Option<UsageStripper>,
    idle_timeout: Duration,
    idle: Pin<Box<Sleep>>,
    /// Mid-stream failures of an event stream end with an SSE error event rather than a reset.
    event_stream: bool,
    tapped_bytes: usize,
    max_tapped_bytes: usize,
    /// What the end of the body waits for, until the upstream has ended.
    receipt: Option<ReceiptWait>,
    /// The end of the body, held back until the recording is durable.
    holding: Option<Holding>,
    /// Observed when the first data frame goes to the client (time to first token).
    first_frame: Option<FirstFrame>,
    /// The upstream body ended (whole or not).
    ended: bool,
}

/// A recorded stream's end waits for the recording to be durable, so that the client's next
/// request (to this replica or another) finds the exchange, and the receipt comment before the
/// stream's `data: [DONE]` (or after the last frame of a stream without one) says how far it
/// got.
pub struct ReceiptWait {
    pub recorded: oneshot::Receiver<Receipt>,
    /// Longest the end waits (`capture.receipt_wait_ms`); then the receipt says `pending`.
    pub max_wait: Duration,
    /// The receipt comment before its state, e.g. `: engram turn=… job=…`.
    pub comment: String,
    /// Where the end's wait is timed (`engram_memory_phase_seconds{phase="receipt_wait"}`).
    pub waited: Option<Histogram>,
}

struct Holding {
    wait: ReceiptWait,
    /// The last bytes for the client, sent with the receipt comment.
    tail: Bytes,
    /// The tail is the stream's `data: [DONE]`: the comment goes before it.
    tail_is_done: bool,
    deadline: Pin<Box<Sleep>>,
    since: Instant,
}

/// Where the SSE terminator `data: [DONE]` starts in `data`, if an event starts with it (not
/// the same words inside an event's JSON, which holds no raw newline).
fn done_event(data: &[u8]) -> Option<usize> {
    memchr::memmem::find_iter(data, b"data: [DONE]")
        .find(|at| *at == 0 || data.get(at - 1) == Some(&b'\n'))
}

pub struct TeeOptions {
    pub channel_frames: usize,
    pub max_tapped_bytes: usize,
    pub idle_timeout: Duration,
    pub event_stream: bool,
    /// Remove the usage chunk the proxy requested but the client did not.
    pub strip_usage: bool,
    /// Hold the end of the body for the recording's receipt (see [`ReceiptWait`]).
    pub receipt: Option<ReceiptWait>,
    pub first_frame: Option<FirstFrame>,
}

impl TeeBody {
    /// Wraps an upstream body; the receiver gets the copies and closes when the tee is done.
    pub fn new(
        upstream: Incoming,
        options: TeeOptions,
    ) -> (TeeBody, mpsc::Receiver<Bytes>, Arc<TeeState>) {
        let (sender, receiver) = mpsc::channel(options.channel_frames.max(1));
        let state = Arc::new(TeeState::default());
        let body = TeeBody {
            upstream,
            tap: Some(sender),
            state: state.clone(),
            stripper: options.strip_usage.then(UsageStripper::default),
            idle_timeout: options.idle_timeout,
            idle: Box::pin(tokio::time::sleep(options.idle_timeout)),
            event_stream: options.event_stream,
            tapped_bytes: 0,
            max_tapped_bytes: options.max_tapped_bytes,
            receipt: options.receipt,
            holding: None,
            first_frame: options.first_frame,
            ended: false,
        };
        (body, receiver, state)
    }

    fn copy_aside(&mut self, data: &Bytes) {
        let Some(tap) = &self.tap else { return };
        self.tapped_bytes += data.len();
        let stop = if self.tapped_bytes > self.max_tapped_bytes {
            Some(Incomplete::TooLarge)
        } else if tap.try_send(data.clone()).is_err() {
            Some(Incomplete::TeeOverflow)
        } else {
            None
        };
        if let Some(reason) = stop {
            self.state.mark(reason);
            self.tap = None;
        }
    }

    /// A data frame is about to reach the client.
    fn sending_data(&mut self) {
        if let Some(first) = self.first_frame.take() {
            first.observe();
        }
    }

    /// The upstream body ended whole: closes the tap (so the recorder can finish) and returns
    /// any held-back tail.
    fn end(&mut self) -> Bytes {
        self.ended = true;
        self.tap = None;
        self.stripper
            .as_mut()
            .map(UsageStripper::finish)
            .unwrap_or_default()
    }

    fn end_and_hold(&mut self) -> Option<Bytes> {
        let tail = self.end();
        self.hold(tail)
    }

    /// Holds `tail` back for the receipt, if the body waits for one; else gives it back.
    fn hold(&mut self, tail: Bytes) -> Option<Bytes> {
        self.hold_tail(tail, false)
    }

    fn hold_tail(&mut self, tail: Bytes, tail_is_done: bool) -> Option<Bytes> {
        let Some(wait) = self.receipt.take() else {
            return Some(tail);
        };
        let deadline = Box::pin(tokio::time::sleep(wait.max_wait));
        self.holding = Some(Holding {
            wait,
            tail,
            tail_is_done,
            deadline,
            since: Instant::now(),
        });
        None
    }

    /// Holds a stream's `data: [DONE]` (and what follows it in `out`) for the receipt, and
    /// gives back what comes before it. An SDK stops reading at `[DONE]` and may send the
    /// follow-up at once, before the body's end: holding only the end would let that
    /// follow-up overtake the recording. The capture is whole at `[DONE]`, so the tap closes.
    fn hold_from_done(&mut self, out: Bytes) -> Bytes {
        if !self.event_stream || self.receipt.is_none() {
            return out;
        }
        let Some(at) = done_event(&out) else {
            return out;
        };
        self.tap = None;
        let before = out.slice(..at);
        match self.hold_tail(out.slice(at..), true) {
            Some(unheld) => [before, unheld].concat().into(),
            None => before,
        }
    }

    /// The held end once the receipt came (or the wait ran out): the tail and the comment.
    fn poll_held(&mut self, cx: &mut Context<'_>) -> Poll<Bytes> {
        let Some(holding) = &mut self.holding else {
            return Poll::Ready(Bytes::new());
        };
        let receipt = match Pin::new(&mut holding.wait.recorded).poll(cx) {
            Poll::Ready(Ok(receipt)) => receipt,
            // The recorder ended without a word: nothing was recorded.
            Poll::Ready(Err(_)) => Receipt::Unrecorded,
            Poll::Pending if holding.deadline.as_mut().poll(cx).is_ready() => Receipt::Pending,
            Poll::Pending => return Poll::Pending,
        };
        if let Some(waited) = &holding.wait.waited {
            waited.observe(holding.since.elapsed().as_secs_f64());
        }
        let comment = format!("{} state={}\n\n", holding.wait.comment, receipt.as_str());
        let out = if holding.tail_is_done {
            [comment.as_bytes(), holding.tail.as_ref()].concat()
        } else {
            [holding.tail.as_ref(), comment.as_bytes()].concat()
        };
        self.holding = None;
        Poll::Ready(Bytes::from(out))
    }

    /// Ends the body after an upstream failure: an error event for SSE, an error otherwise.
    fn fail(&mut self, message: String) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        self.state.mark(Incomplete::UpstreamFailed);
        self.tap = None;
        self.ended = true;
        tracing::warn!(error = %message, "upstream body failed mid-response");
        if self.event_stream {
            let event = serde_json::json!({"error": {
                "message": format!("The upstream stream failed: {message}"),
                "type": "upstream_error",
                "param": null,
                "code": "upstream_stream_failed",
            }});
            Poll::Ready(Some(Ok(Frame::data(Bytes::from(format!(
                "data: {event}\n\n"
            ))))))
        } else {
            Poll::Ready(Some(Err(message.into())))
        }
    }
}

impl Body for TeeBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        loop {
            if this.holding.is_some() {
                return this.poll_held(cx).map(|out| {
                    this.sending_data();
                    Some(Ok(Frame::data(out)))
                });
            }
            if this.ended {
                return Poll::Ready(None);
            }
            match Pin::new(&mut this.upstream).poll_frame(cx) {
                Poll::Ready(Some(Ok(frame))) => {
                    let deadline = Instant::now() + this.idle_timeout;
                    this.idle.as_mut().reset(deadline);
                    let data = match frame.into_data() {
                        Ok(data) => data,
                        Err(trailers) => return Poll::Ready(Some(Ok(trailers))),
                    };
                    this.copy_aside(&data);
                    let out = match &mut this.stripper {
                        Some(stripper) => stripper.push(&data),
                        None => data,
                    };
                    let mut out = this.hold_from_done(out);
                    // A body with a known length ends with its last data frame: hyper will not
                    // poll again, so the end is recorded here rather than on `None`.
                    if this.upstream.is_end_stream() {
                        let tail = this.end();
                        if !tail.is_empty() {
                            out = [out, tail].concat().into();
                        }
                        match this.hold(out) {
                            Some(unheld) => out = unheld,
                            None => continue,
                        }
                    }
                    if out.is_empty() {
                        continue;
                    }
                    this.sending_data();
                    return Poll::Ready(Some(Ok(Frame::data(out))));
                }
                Poll::Ready(None) => {
                    let Some(tail) = this.end_and_hold() else {
                        continue;
                    };
                    return if tail.is_empty() {
                        Poll::Ready(None)
                    } else {
                        this.sending_data();
                        Poll::Ready(Some(Ok(Frame::data(tail))))
                    };
                }
                Poll::Ready(Some(Err(error))) => return this.fail(error.to_string()),
                Poll::Pending => {
                    if this.idle.as_mut().poll(cx).is_ready() {
                        let message = format!("no data for {:?}", this.idle_timeout);
                        return this.fail(message);
                    }
                    return Poll::Pending;
                }
            }
        }
    }

    fn is_end_stream(&self) -> bool {
        self.ended && self.holding.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        if self.is_end_stream() {
            SizeHint::with_exact(0)
        } else if self.stripper.is_none() && self.receipt.is_none() && self.holding.is_none() {
            self.upstream.size_hint()
        } else {
            SizeHint::default()
        }
    }
}

impl Drop for TeeBody {
    fn drop(&mut self) {
        // Dropped before its end: hyper gave up on the client (disconnect, reset).
        if !self.ended {
            self.state.mark(Incomplete::ClientDisconnected);
        }
        // The tap sender drops after this, so the recorder sees the mark before the close.
    }
}

/// The recorder's side of the tee: rebuilds the answer from the copies, once the tee is done.
pub async fn collect(
    mut copies: mpsc::Receiver<Bytes>,
    state: Arc<TeeState>,
    streamed: bool,
) -> Capture {
    let (message, parse_problem) = if streamed {
        let mut accumulator = StreamAccumulator::default();
        while let Some(bytes) = copies.recv().await {
            accumulator.push(&bytes);
        }
        let summary = accumulator.finish();
        let whole = summary.saw_done && summary.malformed_events == 0;
        (summary.message, !whole)
    } else {
        let mut body = Vec::new();
        while let Some(bytes) = copies.recv().await {
            body.extend_from_slice(&bytes);
        }
        match AssistantMessage::from_completion(&body) {
            Ok(message) => (message, false),
            Err(_) => (AssistantMessage::default(), true),
        }
    };
    let incomplete = state
        .incomplete()
        .or(parse_problem.then_some(Incomplete::Malformed));
    Capture {
        message,
        incomplete,
        streamed,
    }
}

/// A body read in part already: `prefix`, then the rest of `rest`.
pub struct PrefixedBody {
    prefix: Option<Bytes>,
    rest: TeeBody,
}

impl PrefixedBody {
    pub fn new(prefix: Bytes, rest: TeeBody) -> PrefixedBody {
        PrefixedBody {
            prefix: Some(prefix),
            rest,
        }
    }
}

impl Body for PrefixedBody {
    type Data = Bytes;
    type Error = BodyError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BodyError>>> {
        let this = self.get_mut();
        if let Some(prefix) = this.prefix.take() {
            return Poll::Ready(Some(Ok(Frame::data(prefix))));
        }
        Pin::new(&mut this.rest).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.prefix.is_none() && self.rest.is_end_stream()
    }
}

/// Observes the time to the first body frame the client gets; made by `metrics::HttpMetrics::first_frame`.
pub struct FirstFrame {
    since: std::time::Instant,
    histogram: Histogram,
}

impl FirstFrame {
    /// Times from `since` into `histogram`.
    pub fn new(since: std::time::Instant, histogram: Histogram) -> FirstFrame {
        FirstFrame { since, histogram }
    }

    pub fn observe(self) {
        self.histogram.observe(self.since.elapsed().as_secs_f64());
    }
}
