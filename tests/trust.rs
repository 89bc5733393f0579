//! `identity.trust` through the binary: client keys confine a client to its tenant and never
//! reach the upstream, signed identities name tenant and user until they expire, and `headers`
//! refuses to start off loopback unless forced.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    reason = "tests fail loudly"
)]

mod common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::memory::{admin, export, header, wait_drained};
use common::{Mock, Process, Reply, assert_openai_error, mock, post_json, proxy, proxy_args, send};
use engram_proxy::pipeline::trust::{IDENTITY_HEADER, sign, unix_now};
use serde_json::json;

const UPSTREAM_KEY: &str = "sk-engram-own-upstream-key";
const KEY_ACME: &str = "ck-acme-7f3a9c";
const KEY_GLOBEX: &str = "ck-globex-51d2e8";
const CLIENT_KEYS: &str = "acme=ck-acme-7f3a9c, globex=ck-globex-51d2e8";
const SECRET: &str = "test-identity-secret-of-at-least-32-bytes";

/// engram's own upstream key, from the variable `upstream.api_key_env` names.
const UPSTREAM_KEY_ENV: [(&str, &str); 2] = [
    ("ENGRAM_UPSTREAM__API_KEY_ENV", "TEST_UPSTREAM_KEY"),
    ("TEST_UPSTREAM_KEY", UPSTREAM_KEY),
];

fn client_keys_proxy(upstream: &Mock) -> Process {
    let mut env = vec![
        ("ENGRAM_IDENTITY__TRUST", "client_keys"),
        ("ENGRAM_CLIENT_KEYS", CLIENT_KEYS),
    ];
    env.extend(UPSTREAM_KEY_ENV);
    proxy(&upstream.address, &env)
}

fn signed_proxy(upstream: &Mock, holds_upstream_key: bool) -> Process {
    let mut env = vec![
        ("ENGRAM_IDENTITY__TRUST", "signed"),
        ("ENGRAM_IDENTITY_SECRET", SECRET),
    ];
    if holds_upstream_key {
        env.extend(UPSTREAM_KEY_ENV);
    }
    proxy(&upstream.address, &env)
}

fn bearer(key: &str) -> String {
    format!("Bearer {key}")
}

/// A signed identity valid for `ttl` seconds from now (negative: expired that long ago).
fn identity(tenant: &str, user: &str, ttl: i64) -> String {
    let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, SECRET.as_bytes());
    let expiry = unix_now().saturating_add_signed(ttl);
    sign(&key, tenant, user, expiry)
}

async fn chat(proxy: &Process, text: &str, headers: &[(&str, &str)]) -> Reply {
    let body = json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": text}],
    });
    post_json(&proxy.url("/v1/chat/completions"), &body, headers).await
}

fn text(reply: &Reply) -> String {
    String::from_utf8_lossy(&reply.body).into_owned()
}

fn assert_refused(reply: &Reply, status: u16, code: &str) {
    let body = assert_openai_error(reply, status);
    assert_eq!(body["error"]["code"], code, "{body}");
    // Refused by engram: the upstream never saw the request.
    assert!(
        reply.headers.get("x-mock-received-authorization").is_none(),
        "{body}"
    );
}

#[tokio::test]
async fn client_keys_refuse_a_request_without_a_known_key_on_every_proxied_route() {
    let upstream = mock(&[]);
    let proxy = client_keys_proxy(&upstream);
    let models = proxy.url("/v1/models");
    let admin_key = bearer(common::ADMIN_TOKEN);
    let unknown = bearer("ck-nobody");
    for auth in [None, Some(unknown.as_str()), Some(admin_key.as_str())] {
        let headers: Vec<(&str, &str)> = auth
            .map(|auth| ("authorization", auth))
            .into_iter()
            .collect();
        let reply = chat(&proxy, "hi", &headers).await;
        assert_refused(&reply, 401, "invalid_api_key");
        let body = reply.json();
        // What OpenAI answers for a bad key, so SDKs raise their authentication error.
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(!text(&reply).contains("ck-nobody"), "{body}");
        // Nor may such a client reach the upstream with engram's key another way.
        let reply = send("GET", &models, &headers, "").await;
        assert_refused(&reply, 401, "invalid_api_key");
    }
    // Probes and scraping need no identity.
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(send("GET", &proxy.url(path), &[], "").await.status, 200);
    }
}

#[tokio::test]
async fn a_client_key_is_never_forwarded_upstream() {
    let upstream = mock(&[]);
    let proxy = client_keys_proxy(&upstream);
    let acme = bearer(KEY_ACME);
    let engram_key = bearer(UPSTREAM_KEY);
    let reply = chat(&proxy, "hi", &[("authorization", &acme)]).await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    assert_eq!(header(&reply, "x-mock-received-authorization"), engram_key);
    let models = proxy.url("/v1/models");
    let reply = send("GET", &models, &[("authorization", &acme)], "").await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    assert_eq!(header(&reply, "x-mock-received-authorization"), engram_key);
}

#[tokio::test]
async fn a_client_key_confines_memory_to_its_tenant() {
    let upstream = mock(&["--echo"]);
    let proxy = client_keys_proxy(&upstream);
    let acme = bearer(KEY_ACME);
    let globex = bearer(KEY_GLOBEX);
    // The same user id in two tenants, each stating its own secret.
    for (auth, secret) in [(&acme, "zq-acme-secret"), (&globex, "zq-globex-secret")] {
        let said = format!("Remember my code word: {secret}.");
        let reply = chat(
            &proxy,
            &said,
            &[("authorization", auth), ("x-engram-user", "u1")],
        )
        .await;
        assert_eq!(reply.status, 200, "{}", text(&reply));
    }
    // Naming its own tenant is fine; naming another is refused before anything is read.
    let own = [
        ("authorization", acme.as_str()),
        ("x-engram-user", "u1"),
        ("x-engram-tenant", "acme"),
    ];
    assert_eq!(chat(&proxy, "hello", &own).await.status, 200);
    let other = [
        ("authorization", acme.as_str()),
        ("x-engram-user", "u1"),
        ("x-engram-tenant", "globex"),
    ];
    let reply = chat(&proxy, "What is my code word?", &other).await;
    assert_refused(&reply, 403, "forbidden");

    wait_drained(&proxy, Duration::from_secs(60)).await;
    // Each key's memory landed under its own tenant, and only there.
    let memory = export(&proxy, "acme", "u1").await.to_string();
    assert!(memory.contains("zq-acme-secret") && !memory.contains("zq-globex-secret"));
    let memory = export(&proxy, "globex", "u1").await.to_string();
    assert!(memory.contains("zq-globex-secret") && !memory.contains("zq-acme-secret"));
    let default = admin(&proxy, "/engram/v1/users/u1/memory", "default").await;
    assert!(!text(&default).contains("zq-"), "{}", text(&default));
    // A recall probe: acme's u1 gets its own secret back, never globex's.
    let probe = [("authorization", acme.as_str()), ("x-engram-user", "u1")];
    let reply = chat(&proxy, "What is my code word?", &probe).await;
    assert_eq!(reply.status, 200);
    assert!(text(&reply).contains("zq-acme-secret"), "{}", text(&reply));
    assert!(
        !text(&reply).contains("zq-globex-secret"),
        "{}",
        text(&reply)
    );
}

/// An echo mock, a signed proxy in front of it, and jane's identity (tenant acme), under which
/// she has stated her code word `zq-jane`.
async fn janes_signed_proxy(holds_upstream_key: bool) -> (Mock, Process, String) {
    let upstream = mock(&["--echo"]);
    let proxy = signed_proxy(&upstream, holds_upstream_key);
    let jane = identity("acme", "jane", 300);
    let said = "My code word is zq-jane.";
    let reply = chat(&proxy, said, &[(IDENTITY_HEADER, &jane)]).await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    (upstream, proxy, jane)
}

/// The question, with jane as the body's `user` and no identity header.
fn asked_as_body_user() -> serde_json::Value {
    json!({
        "model": "gpt-test", "user": "jane",
        "messages": [{"role": "user", "content": "What is my code word?"}],
    })
}

#[tokio::test]
async fn a_signed_identity_names_tenant_and_user_until_it_expires() {
    let (_upstream, proxy, jane) = janes_signed_proxy(true).await;
    let reply = chat(&proxy, "hello", &[(IDENTITY_HEADER, &jane)]).await;
    assert_eq!(
        header(&reply, "x-mock-received-authorization"),
        bearer(UPSTREAM_KEY)
    );
    // Repeating the signed tenant and user is fine.
    let same = [
        (IDENTITY_HEADER, jane.as_str()),
        ("x-engram-tenant", "acme"),
        ("x-engram-user", "jane"),
    ];
    assert_eq!(chat(&proxy, "hello", &same).await.status, 200);

    let expired = identity("acme", "jane", -1);
    let reply = chat(&proxy, "hi", &[(IDENTITY_HEADER, &expired)]).await;
    assert_refused(&reply, 401, "invalid_identity");
    assert!(text(&reply).contains("expired"), "{}", text(&reply));
    for tampered in [
        jane.replace(":jane:", ":john:"),
        jane.replace("v1:acme:", "v1:globex:"),
        // The signature's last hex digit changed: to `1` where it is `0` (one run in sixteen
        // signed a tag ending in `0`, which this left valid).
        format!(
            "{}{}",
            &jane[..jane.len() - 1],
            if jane.ends_with('0') { '1' } else { '0' }
        ),
        "jane".to_owned(),
    ] {
        let reply = chat(&proxy, "hi", &[(IDENTITY_HEADER, &tampered)]).await;
        assert_refused(&reply, 401, "invalid_identity");
    }
    for conflict in [("x-engram-user", "john"), ("x-engram-tenant", "globex")] {
        let reply = chat(&proxy, "hi", &[(IDENTITY_HEADER, &jane), conflict]).await;
        assert_refused(&reply, 403, "forbidden");
    }
    // Holding engram's upstream key, the proxy serves nothing unsigned: no chat, even with a
    // body user, and no other route.
    let body = asked_as_body_user();
    let reply = post_json(&proxy.url("/v1/chat/completions"), &body, &[]).await;
    assert_refused(&reply, 401, "invalid_identity");
    let reply = send("GET", &proxy.url("/v1/models"), &[], "").await;
    assert_refused(&reply, 401, "invalid_identity");

    wait_drained(&proxy, Duration::from_secs(60)).await;
    let memory = export(&proxy, "acme", "jane").await.to_string();
    assert!(memory.contains("zq-jane"), "{memory}");
    let reply = chat(&proxy, "What is my code word?", &[(IDENTITY_HEADER, &jane)]).await;
    assert!(text(&reply).contains("zq-jane"), "{}", text(&reply));
}

#[tokio::test]
async fn without_an_upstream_key_an_unsigned_request_passes_with_no_memory() {
    let (_upstream, proxy, _jane) = janes_signed_proxy(false).await;
    wait_drained(&proxy, Duration::from_secs(60)).await;

    // The body's user is no identity here: no memory read, none recorded; the client's own
    // key goes upstream, as it would without engram.
    let body = asked_as_body_user();
    let own = bearer("sk-client-own");
    let reply = post_json(
        &proxy.url("/v1/chat/completions"),
        &body,
        &[("authorization", &own)],
    )
    .await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
    assert_eq!(header(&reply, "x-engram-memory"), "skipped");
    assert!(reply.headers.get("x-engram-job-id").is_none());
    assert!(!text(&reply).contains("zq-jane"), "{}", text(&reply));
    assert_eq!(header(&reply, "x-mock-received-authorization"), own);
    // An unsigned claim is refused, not ignored.
    for claim in [("x-engram-user", "jane"), ("x-engram-tenant", "acme")] {
        let reply = chat(&proxy, "What is my code word?", &[claim]).await;
        assert_refused(&reply, 401, "invalid_identity");
    }
    assert_eq!(
        send("GET", &proxy.url("/v1/models"), &[], "").await.status,
        200
    );
}

/// Runs `engram serve` that must fail at start; its stderr.
fn start_fails(args: &[&str], env: &[(&str, &str)]) -> String {
    let data_dir = tempfile::tempdir().unwrap();
    let mut command = Command::new(common::BIN);
    command
        .arg("serve")
        .args(args)
        .args(["--upstream", "http://127.0.0.1:9/v1"])
        .env("ENGRAM_STORE__DATA_DIR", data_dir.path())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("engram started with {args:?} {env:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let output = child.wait_with_output().unwrap();
    assert!(!output.status.success());
    String::from_utf8_lossy(&output.stderr).into_owned()
}

#[tokio::test]
async fn headers_trust_off_loopback_starts_only_when_forced() {
    let stderr = start_fails(&["--listen", "0.0.0.0:0"], &[]);
    for needle in ["identity.trust", "allow_headers_off_loopback", "0.0.0.0:0"] {
        assert!(stderr.contains(needle), "{stderr}");
    }
    let upstream = mock(&[]);
    let forced = proxy_args(
        &upstream.address,
        &["--listen", "0.0.0.0:0"],
        &[("ENGRAM_IDENTITY__ALLOW_HEADERS_OFF_LOOPBACK", "true")],
    );
    assert!(forced.address.contains("0.0.0.0"), "{}", forced.address);
    let reply = chat(&forced, "hi", &[("x-engram-user", "u1")]).await;
    assert_eq!(reply.status, 200, "{}", text(&reply));
}

#[tokio::test]
async fn an_authenticated_mode_without_its_credentials_does_not_start() {
    let keys = ("ENGRAM_IDENTITY__TRUST", "client_keys");
    let upstream_key = [
        ("ENGRAM_UPSTREAM__API_KEY_ENV", "TEST_UPSTREAM_KEY"),
        ("TEST_UPSTREAM_KEY", UPSTREAM_KEY),
    ];
    let stderr = start_fails(&[], &[keys, ("ENGRAM_CLIENT_KEYS", CLIENT_KEYS)]);
    assert!(stderr.contains("upstream.api_key_env"), "{stderr}");
    let stderr = start_fails(&[], &[keys, upstream_key[0], upstream_key[1]]);
    assert!(stderr.contains("ENGRAM_CLIENT_KEYS"), "{stderr}");
    let stderr = start_fails(&[], &[("ENGRAM_IDENTITY__TRUST", "signed")]);
    assert!(stderr.contains("ENGRAM_IDENTITY_SECRET"), "{stderr}");
    // Keys set but the mode left at `headers`: the operator would believe the proxy locked.
    let stderr = start_fails(&[], &[("ENGRAM_CLIENT_KEYS", CLIENT_KEYS)]);
    assert!(stderr.contains("identity.trust"), "{stderr}");
    assert!(!stderr.contains(KEY_ACME), "{stderr}");
}
