//! Connection hygiene through the binary, over raw TCP: a client that sends its headers slowly
//! or keeps a connection idle (an HTTP/2 one answering pings included) cannot hold it forever,
//! while a long stream is never cut for idleness, and a client holding many connections
//! open cannot keep `/healthz` from answering.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::disallowed_methods,
    reason = "tests: a failure should fail the test loudly; a client's driver task is spawned"
)]

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use bytes::Bytes;
use common::{Process, chat_body, mock, proxy};
use http::Request;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};

fn connect(proxy: &Process) -> TcpStream {
    let stream = TcpStream::connect(proxy.address.trim_start_matches("http://")).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(20)))
        .unwrap();
    stream
}

/// How long until the server closes `stream` (reads until end of stream), sending nothing.
fn closed_after(stream: &mut TcpStream) -> Duration {
    let started = Instant::now();
    let mut buffer = [0u8; 4096];
    loop {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return started.elapsed(),
            Ok(_) => {}
        }
    }
}

/// One whole request and its answer's head.
fn ask(stream: &mut TcpStream, path: &str) -> String {
    try_ask(stream, path).unwrap_or_else(|| panic!("closed before an answer to {path}"))
}

/// [`ask`], or `None` when the server closed (or reset) the connection before answering.
fn try_ask(stream: &mut TcpStream, path: &str) -> Option<String> {
    let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
    stream.write_all(request.as_bytes()).ok()?;
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    while !String::from_utf8_lossy(&seen).contains("\r\n\r\n") {
        match stream.read(&mut buffer) {
            Ok(0) | Err(_) => return None,
            Ok(n) => seen.extend_from_slice(&buffer[..n]),
        }
    }
    Some(String::from_utf8_lossy(&seen).into_owned())
}

#[tokio::test]
async fn slow_headers_and_idle_connections_are_closed_after_the_header_timeout() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_SERVER__HEADER_READ_TIMEOUT_MS", "500")],
    );
    // A request line sent a byte at a time, one byte every 200 ms, never finished.
    let mut slow = connect(&proxy);
    let started = Instant::now();
    for byte in b"GET /healthz HTTP/1.1\r\nhost: x\r\n" {
        if slow.write_all(&[*byte]).is_err() {
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
        if started.elapsed() > Duration::from_secs(5) {
            break;
        }
    }
    let held = started.elapsed() + closed_after(&mut slow);
    assert!(held < Duration::from_secs(3), "held {held:?}");

    // A kept-alive connection, idle after its answer.
    let mut idle = connect(&proxy);
    assert!(ask(&mut idle, "/healthz").starts_with("HTTP/1.1 200"));
    let idle_for = closed_after(&mut idle);
    assert!(idle_for < Duration::from_secs(3), "idle for {idle_for:?}");
}

#[tokio::test]
async fn past_the_connection_limit_health_checks_still_answer() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_SERVER__MAX_CONNECTIONS", "4"),
            ("ENGRAM_SERVER__OPS_RESERVE_CONNECTIONS", "2"),
        ],
    );
    // A client holds every place open.
    let mut held: Vec<TcpStream> = (0..4).map(|_| connect(&proxy)).collect();
    // Give the proxy time to accept them all.
    std::thread::sleep(Duration::from_millis(300));

    // From the reserve: health, readiness and metrics answer, then the connection closes.
    for path in ["/healthz", "/readyz", "/metrics"] {
        let mut probe = connect(&proxy);
        let head = ask(&mut probe, path);
        assert!(head.starts_with("HTTP/1.1 200"), "{path}: {head}");
        assert!(head.to_lowercase().contains("connection: close"), "{head}");
        closed_after(&mut probe);
    }
    let mut refused = connect(&proxy);
    let head = ask(&mut refused, "/v1/models");
    assert!(head.starts_with("HTTP/1.1 503"), "{head}");
    // Its place is free once the proxy has closed it (and dropped its count, just after).
    closed_after(&mut refused);
    std::thread::sleep(Duration::from_millis(100));

    // Past the reserve too: closed at once, without an answer.
    let reserve: Vec<TcpStream> = (0..2).map(|_| connect(&proxy)).collect();
    std::thread::sleep(Duration::from_millis(300));
    let mut past = connect(&proxy);
    let _ = past.write_all(b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n");
    let mut buffer = [0u8; 64];
    let read = past.read(&mut buffer).unwrap_or(0);
    assert_eq!(read, 0, "{}", String::from_utf8_lossy(&buffer[..read]));

    // Once the client lets go, every route answers again.
    drop(reserve);
    held.clear();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        // Until the proxy has counted the closed connections out, a new one may still be past
        // the reserve and closed at once (a reset, since the request was sent): not yet.
        let mut again = connect(&proxy);
        let head = try_ask(&mut again, "/v1/models").unwrap_or_default();
        if head.starts_with("HTTP/1.1 200") {
            break;
        }
        assert!(Instant::now() < deadline, "still refused: {head}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One HTTP/2 connection (prior knowledge), its driver task ending when the server closes it.
async fn h2_connect(
    proxy: &Process,
) -> (
    hyper::client::conn::http2::SendRequest<Full<Bytes>>,
    tokio::task::JoinHandle<()>,
) {
    let stream = tokio::net::TcpStream::connect(proxy.address.trim_start_matches("http://"))
        .await
        .unwrap();
    let (sender, connection) = hyper::client::conn::http2::Builder::new(TokioExecutor::new())
        .handshake(TokioIo::new(stream))
        .await
        .unwrap();
    // The client side answers the server's pings while it is driven.
    let driver = tokio::spawn(async move {
        let _ = connection.await;
    });
    (sender, driver)
}

#[tokio::test]
async fn an_idle_http2_connection_answering_pings_is_closed_but_a_long_stream_is_not() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_SERVER__IDLE_TIMEOUT_MS", "500"),
            ("ENGRAM_SERVER__HTTP2_KEEP_ALIVE_INTERVAL_MS", "100"),
        ],
    );
    let (mut sender, driver) = h2_connect(&proxy).await;
    let request = Request::get(proxy.url("/healthz"))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    response.into_body().collect().await.unwrap();
    let answered = Instant::now();
    tokio::time::timeout(Duration::from_secs(10), driver)
        .await
        .expect("an idle HTTP/2 connection stayed open")
        .unwrap();
    let idle_for = answered.elapsed();
    assert!(
        idle_for >= Duration::from_millis(400) && idle_for < Duration::from_secs(3),
        "closed after {idle_for:?} idle"
    );

    // A stream silent for longer than the idle timeout between its chunks ends whole.
    let (mut sender, _driver) = h2_connect(&proxy).await;
    let request = Request::post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .header("x-mock-chunks", "4")
        .header("x-mock-chunk-delay-ms", "600")
        .body(Full::new(Bytes::from(chat_body(true).to_string())))
        .unwrap();
    let started = Instant::now();
    let response = sender.send_request(request).await.unwrap();
    assert_eq!(response.status(), 200);
    let body = response.into_body().collect().await.unwrap().to_bytes();
    let body = String::from_utf8_lossy(&body);
    assert!(started.elapsed() >= Duration::from_millis(1800));
    assert!(body.trim_end().ends_with("data: [DONE]"), "{body}");
}

/// The probe: with 256 descriptors, a client holding 300 idle connections open once
/// made accept fail (EMFILE) and `/healthz` time out. The connection limit is lowered to what
/// the open-file limit leaves, so the reserve still answers health checks.
#[tokio::test]
async fn at_the_open_file_limit_health_checks_still_answer() {
    let upstream = mock(&[]);
    let proxy = common::proxy_limited(&upstream.address, &[], &[], Some(256));
    let mut held = Vec::new();
    for _ in 0..300 {
        match TcpStream::connect(proxy.address.trim_start_matches("http://")) {
            Ok(stream) => held.push(stream),
            Err(_) => break,
        }
    }
    assert!(held.len() >= 256, "only {} connections opened", held.len());
    // The reserve places the flood took are given back within a second; a probe retries, as
    // a kubelet's does, while the client still holds every other connection.
    for path in ["/healthz", "/readyz", "/metrics"] {
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let mut probe = connect(&proxy);
            let request = format!("GET {path} HTTP/1.1\r\nhost: x\r\n\r\n");
            let mut answer = [0u8; 64];
            let read = probe
                .write_all(request.as_bytes())
                .and_then(|()| probe.read(&mut answer))
                .unwrap_or(0);
            let head = String::from_utf8_lossy(&answer[..read]).into_owned();
            if head.starts_with("HTTP/1.1 200") {
                break;
            }
            assert!(Instant::now() < deadline, "{path} never answered: {head:?}");
            std::thread::sleep(Duration::from_millis(200));
        }
    }
    assert!(
        proxy
            .stderr_lines()
            .iter()
            .any(|line| line.contains("server.max_connections lowered")),
        "{:#?}",
        proxy.stderr_lines()
    );
}
