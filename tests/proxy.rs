//! End-to-end tests of the pass-through proxy: the real binary on port 0 in front of the real
//! mock upstream.

mod common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use common::*;
use serde_json::{Value, json};

#[tokio::test]
async fn non_streaming_is_byte_identical_to_direct() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let body = chat_body(false);
    let direct = post_json(&upstream.url("/v1/chat/completions"), &body, &[]).await;
    let proxied = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(direct.status, 200);
    assert_eq!(proxied.status, 200);
    assert_eq!(proxied.body, direct.body);
    assert_eq!(proxied.headers["content-type"], "application/json");
    assert_eq!(proxied.headers["x-engram-memory"], "skipped");

    let captured = proxy.wait_for_log("exchange captured", 1).await;
    assert_eq!(captured[0]["fields"]["complete"], true, "{captured:?}");
    assert_eq!(captured[0]["fields"]["streamed"], false);
    assert_eq!(captured[0]["fields"]["finish_reason"], "stop");
}

#[tokio::test]
async fn streaming_is_byte_identical_to_direct_and_usage_is_captured() {
    let upstream = mock(&["--chunks", "50"]);
    let proxy = proxy(&upstream.address, &[]);
    let body = chat_body(true);
    let direct = post_json(&upstream.url("/v1/chat/completions"), &body, &[]).await;
    let proxied = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(proxied.status, 200);
    assert!(direct.body.ends_with(b"data: [DONE]\n\n"));
    assert_eq!(
        String::from_utf8_lossy(&proxied.body),
        String::from_utf8_lossy(&direct.body)
    );
    assert_eq!(proxied.headers["content-type"], "text/event-stream");

    // The proxy asked upstream for usage even though the client did not.
    let captured = proxy.wait_for_log("exchange captured", 1).await;
    let fields = &captured[0]["fields"];
    assert_eq!(fields["complete"], true, "{fields}");
    assert_eq!(fields["completion_tokens"], 50);
}

#[tokio::test]
async fn a_client_that_asks_for_usage_gets_it_unchanged() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let mut body = chat_body(true);
    body["stream_options"] = json!({"include_usage": true});
    let direct = post_json(&upstream.url("/v1/chat/completions"), &body, &[]).await;
    let proxied = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_eq!(proxied.body, direct.body);
    assert!(String::from_utf8_lossy(&proxied.body).contains("\"total_tokens\""));
}

#[tokio::test]
async fn unknown_fields_reach_the_upstream() {
    let record = temp_path("unknown-fields.jsonl");
    let upstream = mock(&["--record", record.to_str().unwrap()]);
    let proxy = proxy(&upstream.address, &[]);
    let mut body = json!({
        "model": "gpt-test",
        "messages": [
            {"role": "developer", "content": "be terse", "name": "dev"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "42"}
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
        "response_format": {"type": "json_object"},
        "logprobs": true, "top_logprobs": 2, "n": 2,
        "reasoning_effort": "low", "reasoning": {"summary": "auto"},
        "temperature": 0.3, "max_completion_tokens": 77,
        "x_vendor_extension": {"deep": [1, {"x": null}]},
        "stream": false
    });
    post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    body["stream"] = json!(true);
    post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;

    let lines: Vec<Value> = std::fs::read_to_string(&record)
        .unwrap()
        .lines()
        .map(|line| serde_json::from_str(line).unwrap())
        .collect();
    assert_eq!(lines.len(), 2);
    body["stream"] = json!(false);
    assert_eq!(
        lines[0], body,
        "non-streaming request must arrive unchanged"
    );
    // Streaming: the only change is the usage request the proxy adds.
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    assert_eq!(lines[1], body);
}

#[tokio::test]
async fn malformed_json_is_400_with_its_position() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        "{\"model\": \"m\",\n \"messages\": [}",
    )
    .await;
    let body = assert_openai_error(&reply, 400);
    let message = body["error"]["message"].as_str().unwrap();
    assert!(message.contains("line 2 column"), "{message}");

    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &json!({"model": "m", "messages": [{"role": 1}]}),
        &[],
    )
    .await;
    let body = assert_openai_error(&reply, 400);
    assert_eq!(body["error"]["param"], "messages[0].role");

    let reply = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("content-type", "application/json")],
        vec![0xff, 0xfe, b'{'],
    )
    .await;
    assert_openai_error(&reply, 400);
}

#[tokio::test]
async fn wrong_content_type_is_415() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = send(
        "POST",
        &proxy.url("/v1/chat/completions"),
        &[("content-type", "text/plain")],
        chat_body(false).to_string(),
    )
    .await;
    let body = assert_openai_error(&reply, 415);
    assert_eq!(body["error"]["code"], "unsupported_media_type");
}

#[tokio::test]
async fn a_body_over_the_limit_is_413() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_SERVER__MAX_BODY_BYTES", "1000")],
    );
    let mut body = chat_body(false);
    body["messages"][0]["content"] = json!("x".repeat(2000));
    let reply = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_openai_error(&reply, 413);

    // Also when the length is not declared up front (chunked upload).
    let mut stream = TcpStream::connect(proxy.address.trim_start_matches("http://")).unwrap();
    let payload = body.to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ntransfer-encoding: chunked\r\nconnection: close\r\n\r\n{:x}\r\n{}\r\n0\r\n\r\n",
        payload.len(),
        payload
    );
    stream.write_all(request.as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    assert!(response.starts_with("HTTP/1.1 413"), "{response}");
}

#[tokio::test]
async fn an_unreachable_upstream_is_502() {
    // Bind and drop a listener to get a port nobody listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let proxy = proxy(&format!("http://127.0.0.1:{port}"), &[]);
    let reply = post_json(&proxy.url("/v1/chat/completions"), &chat_body(false), &[]).await;
    let body = assert_openai_error(&reply, 502);
    assert_eq!(body["error"]["code"], "upstream_unreachable");
}

#[tokio::test]
async fn a_slow_upstream_is_504() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_UPSTREAM__READ_TIMEOUT_MS", "200")],
    );
    let started = Instant::now();
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &chat_body(false),
        &[("x-mock-latency-ms", "3000")],
    )
    .await;
    let body = assert_openai_error(&reply, 504);
    assert_eq!(body["error"]["code"], "upstream_timeout");
    assert!(started.elapsed() < Duration::from_secs(2));
}

#[tokio::test]
async fn upstream_errors_are_forwarded_as_sent() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    for status in ["429", "500", "401"] {
        let headers = [("x-mock-status", status)];
        let direct = post_json(
            &upstream.url("/v1/chat/completions"),
            &chat_body(false),
            &headers,
        )
        .await;
        let proxied = post_json(
            &proxy.url("/v1/chat/completions"),
            &chat_body(false),
            &headers,
        )
        .await;
        assert_eq!(proxied.status.as_str(), status);
        assert_eq!(proxied.body, direct.body);
        if status == "429" {
            assert_eq!(proxied.headers["retry-after"], "1");
        }
    }
}

#[tokio::test]
async fn unknown_routes_and_methods_get_openai_errors() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = send("GET", &proxy.url("/nope"), &[], "").await;
    assert_openai_error(&reply, 404);
    let reply = send("GET", &proxy.url("/v1/chat/completions"), &[], "").await;
    assert_openai_error(&reply, 405);
}

#[tokio::test]
async fn other_v1_routes_pass_through_with_bodies_both_ways() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let direct = send("GET", &upstream.url("/v1/models"), &[], "").await;
    let proxied = send("GET", &proxy.url("/v1/models"), &[], "").await;
    assert_eq!(proxied.status, 200);
    assert_eq!(proxied.body, direct.body);

    // 8 MiB each way through /v1/echo: not subject to the chat body limit, not buffered whole.
    let payload: Vec<u8> = (0..8 * 1024 * 1024).map(|i| (i % 251) as u8).collect();
    let proxied = send(
        "PUT",
        &proxy.url("/v1/echo?x=1"),
        &[("content-type", "application/octet-stream")],
        payload.clone(),
    )
    .await;
    assert_eq!(proxied.status, 200);
    assert_eq!(proxied.headers["content-type"], "application/octet-stream");
    assert!(proxied.body == payload, "echoed body differs");

    // The upstream's own 404 for a route it does not have comes back as sent.
    let proxied = send("GET", &proxy.url("/v1/unknown"), &[], "").await;
    assert_eq!(proxied.status, 404);
    assert_eq!(proxied.json()["error"]["type"], "mock_error");
}

#[tokio::test]
async fn health_and_readiness() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = send("GET", &proxy.url("/healthz"), &[], "").await;
    assert_eq!(reply.status, 200);
    assert_eq!(reply.json()["status"], "ok");
    let reply = send("GET", &proxy.url("/readyz"), &[], "").await;
    assert_eq!(reply.status, 200);
}

#[tokio::test]
async fn the_ops_listener_serves_health_readiness_and_metrics_only() {
    let upstream = mock(&[]);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let ops_listen = format!("127.0.0.1:{port}");
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_SERVER__OPS_LISTEN", ops_listen.as_str())],
    );
    let ops = format!("http://{ops_listen}");
    for path in ["/healthz", "/readyz", "/metrics"] {
        let reply = send("GET", &format!("{ops}{path}"), &[], "").await;
        assert_eq!(reply.status, 200, "{path}");
    }
    // Nothing else: no proxying, no memory, no management API on that address.
    let reply = post_json(
        &format!("{ops}/v1/chat/completions"),
        &chat_body(false),
        &[],
    )
    .await;
    assert_openai_error(&reply, 404);
    for path in ["/v1/models", "/engram/v1/queue"] {
        let reply = send("GET", &format!("{ops}{path}"), &[], "").await;
        assert_openai_error(&reply, 404);
    }
    // The proxy's own address serves everything as before.
    let reply = post_json(&proxy.url("/v1/chat/completions"), &chat_body(false), &[]).await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        send("GET", &proxy.url("/metrics"), &[], "").await.status,
        200
    );
}

#[tokio::test]
async fn http2_cleartext_is_served() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .http2_only(true)
        .build_http::<http_body_util::Full<bytes::Bytes>>();
    let request = http::Request::post(proxy.url("/v1/chat/completions"))
        .header("content-type", "application/json")
        .body(http_body_util::Full::new(bytes::Bytes::from(
            chat_body(true).to_string(),
        )))
        .unwrap();
    let response = client.request(request).await.unwrap();
    assert_eq!(response.version(), http::Version::HTTP_2);
    assert_eq!(response.status(), 200);
    let body = http_body_util::BodyExt::collect(response.into_body())
        .await
        .unwrap()
        .to_bytes();
    assert!(body.ends_with(b"data: [DONE]\n\n"));
}

#[tokio::test]
async fn a_client_disconnect_mid_stream_is_recorded_as_incomplete() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let mut stream = open_stream(&proxy, "x-mock-chunks: 40\r\nx-mock-chunk-delay-ms: 50\r\n");
    let seen = read_until(&mut stream, "\"content\":\"the");
    assert!(seen.starts_with("HTTP/1.1 200"));
    drop(stream);

    let captured = proxy.wait_for_log("exchange captured", 1).await;
    assert_eq!(captured.len(), 1, "{:?}", proxy.stderr_lines());
    let fields = &captured[0]["fields"];
    assert_eq!(fields["complete"], false, "{fields}");
    assert_eq!(fields["incomplete"], "ClientDisconnected");
    // What arrived before the disconnect is kept.
    assert!(fields["content_chars"].as_u64().unwrap() > 0, "{fields}");
}

#[tokio::test]
async fn an_upstream_reset_mid_stream_ends_with_an_error_event_and_is_recorded() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &chat_body(true),
        &[("x-mock-fault", "reset")],
    )
    .await;
    assert_eq!(reply.status, 200);
    let text = String::from_utf8_lossy(&reply.body);
    assert!(
        text.contains("\"code\":\"upstream_stream_failed\""),
        "{text}"
    );
    let captured = proxy.wait_for_log("exchange captured", 1).await;
    assert_eq!(captured[0]["fields"]["incomplete"], "UpstreamFailed");
}

#[tokio::test]
async fn a_stalled_stream_ends_at_the_read_timeout() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[("ENGRAM_UPSTREAM__READ_TIMEOUT_MS", "300")],
    );
    let started = Instant::now();
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &chat_body(true),
        &[("x-mock-fault", "hang")],
    )
    .await;
    assert!(started.elapsed() < Duration::from_secs(5));
    assert!(String::from_utf8_lossy(&reply.body).contains("upstream_stream_failed"));
}

#[tokio::test]
async fn malformed_sse_is_forwarded_and_recorded_as_malformed() {
    let upstream = mock(&[]);
    let proxy = proxy(&upstream.address, &[]);
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &chat_body(true),
        &[("x-mock-fault", "malformed")],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert!(String::from_utf8_lossy(&reply.body).contains("data: {not json"));
    let captured = proxy.wait_for_log("exchange captured", 1).await;
    assert_eq!(captured[0]["fields"]["incomplete"], "Malformed");
}

#[tokio::test]
async fn sigterm_lets_an_in_flight_stream_finish() {
    let upstream = mock(&[]);
    let mut proxy = proxy(&upstream.address, &[]);
    // 20 chunks, 60 ms apart: about 1.2 s of stream.
    let mut stream = open_stream(
        &proxy,
        "x-mock-chunks: 20\r\nx-mock-chunk-delay-ms: 60\r\nconnection: close\r\n",
    );
    read_until(&mut stream, "\"content\":\"the");
    proxy.signal("TERM");

    // New connections are refused once the listener is closed.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(TcpStream::connect(proxy.address.trim_start_matches("http://")).is_err());

    let rest = read_until(&mut stream, "data: [DONE]");
    assert!(rest.contains("\"finish_reason\":\"stop\""));
    let status = proxy
        .wait_exit(Duration::from_secs(10))
        .expect("proxy did not exit after draining");
    assert!(status.success(), "{status:?}");
    // The recorder ran before exit.
    let captured = proxy.log_events("exchange captured");
    assert_eq!(captured.len(), 1);
    assert_eq!(captured[0]["fields"]["complete"], true);
}

#[tokio::test]
async fn echo_mode_replies_with_what_the_upstream_received() {
    let upstream = mock(&["--echo"]);
    let proxy = proxy(&upstream.address, &[]);
    let body = chat_body(false);
    let reply = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    let content = reply.json()["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    let received: Value = serde_json::from_str(&content).unwrap();
    assert_eq!(received, body["messages"]);
}

#[tokio::test]
async fn a_configured_upstream_key_replaces_the_client_key_and_is_never_logged() {
    let upstream = mock(&[]);
    let proxy = proxy(
        &upstream.address,
        &[
            ("ENGRAM_UPSTREAM__API_KEY_ENV", "ENGRAM_TEST_UPSTREAM_KEY"),
            ("ENGRAM_TEST_UPSTREAM_KEY", "sk-very-secret-value"),
        ],
    );
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &chat_body(false),
        &[("authorization", "Bearer sk-client")],
    )
    .await;
    assert_eq!(reply.status, 200);
    assert_eq!(
        reply.headers["x-mock-received-authorization"],
        "Bearer sk-very-secret-value"
    );
    proxy.wait_for_log("exchange captured", 1).await;
    for line in proxy.stderr_lines() {
        assert!(!line.contains("sk-very-secret-value"), "{line}");
        assert!(!line.contains("sk-client"), "{line}");
    }
}

#[tokio::test]
async fn a_missing_key_variable_stops_the_start_with_a_clear_message() {
    let output = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env(
            "ENGRAM_UPSTREAM__API_KEY_ENV",
            "ENGRAM_TEST_KEY_THAT_IS_NOT_SET",
        )
        .env_remove("ENGRAM_TEST_KEY_THAT_IS_NOT_SET")
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("upstream.api_key_env"), "{stderr}");
    assert!(
        stderr.contains("ENGRAM_TEST_KEY_THAT_IS_NOT_SET"),
        "{stderr}"
    );

    let output = std::process::Command::new(BIN)
        .args(["serve", "--listen", "127.0.0.1:0"])
        .env("ENGRAM_SERVER__LISTNE", "x")
        .output()
        .unwrap();
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("listne"));
}
