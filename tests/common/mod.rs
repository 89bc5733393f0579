//! Test harness: starts the real `engram` binary on port 0, reads the address it prints,
//! collects its stderr, and kills it on drop; and the mock upstream (`engram-mock`, a crate of
//! its own) on a thread of the test process, stopped on drop.

#![allow(
    dead_code,
    reason = "each test binary uses a different part of the harness"
)]
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    reason = "test harness: a failure should fail the test loudly; skips are printed"
)]

pub mod memory;
pub mod prompt_forms;
pub mod python;
pub mod redis;
pub mod redis_cluster;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::Value;

pub const BIN: &str = env!("CARGO_BIN_EXE_engram");

pub struct Process {
    child: Child,
    pub address: String,
    stderr: Arc<Mutex<Vec<String>>>,
    /// The proxy's own data directory, removed with the process, unless the test chose one.
    data_dir: Option<tempfile::TempDir>,
}

/// The admin token every test proxy gets, unless the test sets another.
pub const ADMIN_TOKEN: &str = "test-admin-token";

impl Process {
    fn spawn(args: &[&str], env: &[(&str, &str)], prefix: &str) -> Process {
        Process::spawn_limited(args, env, prefix, None)
    }

    /// [`Process::spawn`] with the open-file limit set to `open_files` before the binary
    /// starts (through `sh`'s `ulimit -n`, which then `exec`s it: the same process).
    fn spawn_limited(
        args: &[&str],
        env: &[(&str, &str)],
        prefix: &str,
        open_files: Option<u64>,
    ) -> Process {
        let mut command = match open_files {
            Some(limit) => {
                let mut command = Command::new("sh");
                command.args([
                    "-c",
                    "ulimit -n \"$0\" && exec \"$@\"",
                    &limit.to_string(),
                    BIN,
                ]);
                command
            }
            None => Command::new(BIN),
        };
        command
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .env_remove("RUST_LOG");
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("start engram");
        let stdout = child.stdout.take().expect("stdout");
        let mut lines = BufReader::new(stdout).lines();
        let first = lines
            .next()
            .expect("engram printed nothing")
            .expect("read stdout");
        let address = first
            .strip_prefix(prefix)
            .unwrap_or_else(|| panic!("unexpected first line {first:?}"))
            .trim()
            .to_owned();
        // Keep draining stdout so the child never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        let stderr = Arc::new(Mutex::new(Vec::new()));
        let sink = stderr.clone();
        let pipe = child.stderr.take().expect("stderr");
        std::thread::spawn(move || {
            for line in BufReader::new(pipe).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Process {
            child,
            address,
            stderr,
            data_dir: None,
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    pub fn signal(&self, name: &str) {
        let status = Command::new("kill")
            .arg(format!("-{name}"))
            .arg(self.pid().to_string())
            .status()
            .expect("kill");
        assert!(status.success());
    }

    /// Waits for the process to exit; `None` if it is still running after `timeout`.
    pub fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = Instant::now() + timeout;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                return Some(status);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    pub fn stderr_lines(&self) -> Vec<String> {
        self.stderr.lock().unwrap().clone()
    }

    /// JSON log lines (the proxy logs JSON in tests) whose message is `message`.
    pub fn log_events(&self, message: &str) -> Vec<Value> {
        self.stderr_lines()
            .iter()
            .filter_map(|line| serde_json::from_str::<Value>(line).ok())
            .filter(|event| event["fields"]["message"] == message)
            .collect()
    }

    /// Polls the log until `count` events with `message` appeared.
    pub async fn wait_for_log(&self, message: &str, count: usize) -> Vec<Value> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let events = self.log_events(message);
            if events.len() >= count || Instant::now() > deadline {
                return events;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The mock upstream, served on a thread of this process (with its own runtime) until dropped.
pub struct Mock {
    pub address: String,
    _thread: engram_mock::MockThread,
}

impl Mock {
    pub fn url(&self, path: &str) -> String {
        format!("{}{}", self.address, path)
    }
}

/// A mock upstream; `args` are `engram-mock`'s options.
pub fn mock(args: &[&str]) -> Mock {
    mock_at("127.0.0.1:0", args)
}

/// A mock on a given address (to replace one that was stopped, on the same port).
pub fn mock_at(listen: &str, args: &[&str]) -> Mock {
    use clap::Parser;
    let mut all = vec!["engram-mock", "--listen", listen];
    all.extend_from_slice(args);
    let thread = engram_mock::MockArgs::try_parse_from(all)
        .unwrap_or_else(|error| panic!("mock options {args:?}: {error}"))
        .start_thread()
        .expect("start the mock upstream");
    Mock {
        address: format!("http://{}", thread.local_addr()),
        _thread: thread,
    }
}

/// Starts the proxy in front of `upstream` (a process address) with extra env settings. It
/// gets a fresh embedded store (unless `env` names `ENGRAM_STORE__DATA_DIR`), the admin API
/// with [`ADMIN_TOKEN`] (unless `env` sets `ENGRAM_ADMIN_TOKEN`) and a 5 s hot-path deadline.
pub fn proxy(upstream: &str, env: &[(&str, &str)]) -> Process {
    proxy_args(upstream, &[], env)
}

/// [`proxy`] with more `engram serve` arguments (they win over the env settings; a `--listen`
/// among them replaces the default `127.0.0.1:0`).
pub fn proxy_args(upstream: &str, args: &[&str], env: &[(&str, &str)]) -> Process {
    proxy_limited(upstream, args, env, None)
}

/// [`proxy_args`] started with at most `open_files` descriptors (`ulimit -n`), when given.
pub fn proxy_limited(
    upstream: &str,
    args: &[&str],
    env: &[(&str, &str)],
    open_files: Option<u64>,
) -> Process {
    let base = format!("{upstream}/v1");
    let data_dir = tempfile::tempdir().unwrap();
    let data_path = data_dir.path().display().to_string();
    let mut all_env = vec![
        ("ENGRAM_LOGGING__FORMAT", "json"),
        ("ENGRAM_LOGGING__LEVEL", "engram=debug,info"),
        ("ENGRAM_STORE__DATA_DIR", data_path.as_str()),
        ("ENGRAM_ADMIN_TOKEN", ADMIN_TOKEN),
        // Debug builds on a loaded 2-core CI machine can miss the 20 ms production deadline,
        // and a fail-open answer would make memory assertions flaky; tests of the deadline
        // itself set their own.
        ("ENGRAM_STORE__HOT_PATH_DEADLINE_MS", "5000"),
    ];
    all_env.extend_from_slice(env);
    let mut all_args = vec!["serve", "--upstream", &base];
    if !args.contains(&"--listen") {
        all_args.extend(["--listen", "127.0.0.1:0"]);
    }
    all_args.extend_from_slice(args);
    let mut process =
        Process::spawn_limited(&all_args, &all_env, "engram listening on ", open_files);
    process.data_dir = Some(data_dir);
    process
}

/// Runs the binary to completion (a CLI command), with `env` added to the environment.
pub fn run(args: &[&str], env: &[(&str, &str)]) -> std::process::Output {
    let mut command = Command::new(BIN);
    command
        .args(args)
        .stdin(Stdio::null())
        .env_remove("RUST_LOG");
    for (key, value) in env {
        command.env(key, value);
    }
    command.output().expect("run engram")
}

/// A scratch file of this test process, under `engram-tests-<pid>` in the temp directory.
/// A run's files stay there for a look after it fails; the first call in a process removes
/// the directories of test processes that have exited, so they do not pile up run after run.
pub fn temp_path(name: &str) -> PathBuf {
    static SWEEP: std::sync::Once = std::sync::Once::new();
    SWEEP.call_once(sweep_exited_scratch_dirs);
    let dir = std::env::temp_dir().join(format!("engram-tests-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    let _ = std::fs::remove_file(&path);
    path
}

/// Removes `engram-tests-<pid>` directories whose process is gone. Only where `/proc` tells
/// (Linux): elsewhere a live process's directory could not be told from a dead one's.
fn sweep_exited_scratch_dirs() {
    if !std::path::Path::new("/proc/self").exists() {
        return;
    }
    let Ok(entries) = std::fs::read_dir(std::env::temp_dir()) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|name| name.strip_prefix("engram-tests-"))
            .and_then(|pid| pid.parse::<u32>().ok())
        else {
            continue;
        };
        if pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

pub struct Reply {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }
}

pub fn client() -> Client<HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

pub async fn send(
    method: &str,
    url: &str,
    headers: &[(&str, &str)],
    body: impl Into<Bytes>,
) -> Reply {
    let mut builder = Request::builder().method(method).uri(url);
    for (name, value) in headers {
        builder = builder.header(*name, *value);
    }
    let request = builder.body(Full::new(body.into())).unwrap();
    let response = client().request(request).await.expect("request failed");
    let (parts, body) = response.into_parts();
    let body = body.collect().await.expect("read body").to_bytes();
    Reply {
        status: parts.status,
        headers: parts.headers,
        body,
    }
}

pub async fn post_json(url: &str, body: &Value, headers: &[(&str, &str)]) -> Reply {
    let mut all = vec![("content-type", "application/json")];
    all.extend_from_slice(headers);
    send("POST", url, &all, body.to_string()).await
}

pub fn chat_body(stream: bool) -> Value {
    serde_json::json!({
        "model": "gpt-test",
        "messages": [{"role": "user", "content": "Hello there"}],
        "stream": stream,
    })
}

/// Asserts an OpenAI-shaped error body and returns it.
pub fn assert_openai_error(reply: &Reply, status: u16) -> Value {
    assert_eq!(
        reply.status.as_u16(),
        status,
        "body: {}",
        String::from_utf8_lossy(&reply.body)
    );
    let body = reply.json();
    let error = &body["error"];
    assert!(error["message"].is_string(), "{body}");
    assert!(error["type"].is_string(), "{body}");
    assert!(error.get("param").is_some(), "{body}");
    assert!(error.get("code").is_some(), "{body}");
    body
}

/// Reads from a raw HTTP/1.1 connection until `needle` has arrived.
pub fn read_until(stream: &mut TcpStream, needle: &str) -> String {
    let mut seen = Vec::new();
    let mut buffer = [0u8; 4096];
    let deadline = Instant::now() + Duration::from_secs(60);
    while !String::from_utf8_lossy(&seen).contains(needle) {
        assert!(
            Instant::now() < deadline,
            "timed out waiting for {needle:?}"
        );
        let n = stream.read(&mut buffer).unwrap();
        assert!(n > 0, "connection closed before {needle:?}");
        seen.extend_from_slice(&buffer[..n]);
    }
    String::from_utf8_lossy(&seen).into_owned()
}

pub fn open_stream(proxy: &Process, extra_headers: &str) -> TcpStream {
    let mut stream = TcpStream::connect(proxy.address.trim_start_matches("http://")).unwrap();
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let body = chat_body(true).to_string();
    let request = format!(
        "POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: {}\r\n{extra_headers}\r\n{body}",
        body.len()
    );
    stream.write_all(request.as_bytes()).unwrap();
    stream
}
