//! Idle connections. hyper closes an HTTP/1.1 connection that waits too long for headers, but
//! an HTTP/2 connection whose client answers keep-alive pings would stay open forever with no
//! stream on it. [`Activity`] counts the requests open on one connection (each until its
//! response body ends or is dropped, so a long stream is never idle) and when the last ended;
//! the connection's task closes it gracefully once it has been idle for `server.idle_timeout_ms`.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::Response;
use http_body_util::BodyExt;
use hyper::body::{Body, Frame, SizeHint};
use tokio::time::Instant;

use crate::error::ProxyBody;

/// The requests open on one connection and when the last one ended.
#[derive(Debug)]
pub struct Activity {
    /// Where `idle_since_ms` counts from.
    origin: Instant,
    open: AtomicUsize,
    /// Milliseconds from `origin` to the end of the last request (0: none yet).
    idle_since_ms: AtomicU64,
}

impl Activity {
    pub fn new() -> Arc<Activity> {
        Arc::new(Activity {
            origin: Instant::now(),
            open: AtomicUsize::new(0),
            idle_since_ms: AtomicU64::new(0),
        })
    }

    /// A request has begun; it is open until the guard is dropped.
    pub fn begin(self: &Arc<Self>) -> OpenRequest {
        self.open.fetch_add(1, Ordering::AcqRel);
        OpenRequest(Arc::clone(self))
    }

    /// When the connection will have been idle for `timeout`, if no request is open.
    fn idle_deadline(&self, timeout: Duration) -> Option<Instant> {
        if self.open.load(Ordering::Acquire) > 0 {
            return None;
        }
        let since = Duration::from_millis(self.idle_since_ms.load(Ordering::Acquire));
        Some(self.origin + since + timeout)
    }

    /// Resolves once the connection has had no request open for `timeout`.
    pub async fn idle_for(&self, timeout: Duration) {
        loop {
            match self.idle_deadline(timeout) {
                Some(deadline) if deadline <= Instant::now() => return,
                Some(deadline) => tokio::time::sleep_until(deadline).await,
                // A request is open: it cannot end idle sooner than `timeout` from now.
                None => tokio::time::sleep(timeout).await,
            }
        }
    }
}

/// One open request of a connection's [`Activity`].
#[derive(Debug)]
pub struct OpenRequest(Arc<Activity>);

impl Drop for OpenRequest {
    fn drop(&mut self) {
        let activity = &self.0;
        let now = u64::try_from(activity.origin.elapsed().as_millis()).unwrap_or(u64::MAX);
        // Stamped before the count drops, so a reader that sees no request open sees this end.
        activity.idle_since_ms.fetch_max(now, Ordering::AcqRel);
        activity.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// `response` with its request kept open until the body has been sent in full or dropped.
pub fn held_open(response: Response<ProxyBody>, open: OpenRequest) -> Response<ProxyBody> {
    response.map(|body| {
        HeldBody {
            inner: body,
            _open: open,
        }
        .boxed()
    })
}

struct HeldBody {
    inner: ProxyBody,
    _open: OpenRequest,
}

impl Body for HeldBody {
    type Data = Bytes;
    type Error = <ProxyBody as Body>::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        context: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.inner).poll_frame(context)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[tokio::test]
    async fn idle_only_after_the_last_request_ends() {
        let activity = Activity::new();
        let timeout = Duration::from_millis(100);
        let open = activity.begin();
        // A request open for three timeouts: not idle.
        assert!(
            tokio::time::timeout(timeout * 3, activity.idle_for(timeout))
                .await
                .is_err()
        );
        drop(open);
        let ended = Instant::now();
        activity.idle_for(timeout).await;
        let waited = ended.elapsed();
        // Stamps are whole milliseconds, cut down.
        assert!(
            waited + Duration::from_millis(2) >= timeout && waited < timeout * 3,
            "{waited:?}"
        );
    }

    #[tokio::test]
    async fn a_body_keeps_its_request_open_until_dropped() {
        let activity = Activity::new();
        let body = http_body_util::Full::new(Bytes::from_static(b"x"))
            .map_err(|never| match never {})
            .boxed();
        let response = held_open(Response::new(body), activity.begin());
        assert!(activity.idle_deadline(Duration::from_secs(1)).is_none());
        let collected = response.into_body().collect().await.unwrap();
        assert_eq!(collected.to_bytes(), Bytes::from_static(b"x"));
        assert!(activity.idle_deadline(Duration::from_secs(1)).is_some());
    }
}
