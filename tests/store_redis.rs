//! The Redis store: the shared store suite against a real `redis-server`, one server per case
//! on a free loopback port, killed when the case ends.
//!
//! Without `redis-server` on PATH the cases are skipped, unless `ENGRAM_REQUIRE_REDIS=1`
//! (set by `scripts/test.sh`, so CI never skips silently).

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "tests: a failure should fail the test loudly"
)]

mod store_suite;

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use engram::store::RedisStore;

/// A `redis-server` child process, killed on drop.
struct RedisServer {
    child: Child,
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn redis_server_installed() -> bool {
    Command::new("redis-server")
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|status| status.success())
}

fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn fresh_store() -> Option<(RedisStore, RedisServer)> {
    if !redis_server_installed() {
        if std::env::var("ENGRAM_REQUIRE_REDIS").is_ok_and(|value| value == "1") {
            panic!("ENGRAM_REQUIRE_REDIS=1 but redis-server is not on PATH; install redis-server");
        }
        println!("SKIPPED: redis-server not installed");
        return None;
    }
    let port = free_port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string()])
        .args(["--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let server = RedisServer { child };
    let url = format!("redis://127.0.0.1:{port}");
    // The server takes a moment to listen; poll the port (the client's own reconnects back
    // off for seconds).
    for _ in 0..200 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            let store = RedisStore::connect(&url, "engram-test").await.unwrap();
            return Some((store, server));
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!("redis-server on port {port} did not accept connections within 5s");
}

store_suite!(optional fresh_store);
