//! The scale-out benchmark (docs/scaling.md): three engram replicas on a local Redis Cluster at
//! stepped rates (`--cluster-rates`), with added latency, job lag, Redis load and bytes per turn.
//!
//! Run with `./benches/cluster.sh [--duration-secs N] [--cluster-rates 100,200,400] [--users N]
//! [--replicas 3]`. It grew out of the earlier single-file overhead benchmark (the one-run
//! comparison with LiteLLM is now `benches/overhead/`) and can still run that benchmark's
//! memory-off and single-store memory-on parts (`--rates`, `--memory embedded,redis`); by default
//! it runs only the cluster.
//!
//! Not a test: it prints numbers and asserts nothing.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark binary: it reports on stdout and stops loudly on a broken setup"
)]

#[path = "support/mock_process.rs"]
mod mock_process;
#[path = "support/redis.rs"]
mod support;

/// The Redis Cluster launcher of the tests (`redis_cluster` needs its sibling `redis`).
#[path = "../tests/common"]
mod cluster_support {
    #[allow(
        dead_code,
        reason = "only the cluster launcher's helpers are used here"
    )]
    pub mod redis;
    pub mod redis_cluster;
}

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::JoinSet;

const BIN: &str = env!("CARGO_BIN_EXE_engram");

struct Process {
    child: Child,
    address: String,
}

impl Process {
    fn start(core: Option<&str>, args: &[&str], env: &[(&str, &str)]) -> Process {
        let mut command = match core {
            Some(core) if has_taskset() => {
                let mut command = Command::new("taskset");
                command
                    .arg("-c")
                    .arg(core)
                    .arg(mock_process::program(args, BIN));
                command
            }
            _ => Command::new(mock_process::program(args, BIN)),
        };
        command
            .args(args)
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .env("ENGRAM_LOGGING__LEVEL", "warn");
        for (key, value) in env {
            command.env(key, value);
        }
        let mut child = command.spawn().expect("start engram");
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let address = line
            .rsplit(' ')
            .next()
            .expect("listening line")
            .trim()
            .to_owned();
        Process { child, address }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Peak resident set size in MiB (VmHWM).
    fn peak_rss_mib(&self) -> f64 {
        proc_status_kib(self.pid(), "VmHWM:") as f64 / 1024.0
    }

    /// User + system CPU seconds used so far.
    fn cpu_seconds(&self) -> f64 {
        let stat =
            std::fs::read_to_string(format!("/proc/{}/stat", self.pid())).unwrap_or_default();
        // Fields after the command name (which may contain spaces) start after ')'.
        let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
        let fields: Vec<&str> = after.split_whitespace().collect();
        let ticks: f64 = fields
            .get(11..13)
            .map(|f| f.iter().filter_map(|v| v.parse::<f64>().ok()).sum())
            .unwrap_or(0.0);
        ticks / 100.0
    }
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn proc_status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|line| line.starts_with(key))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

fn has_taskset() -> bool {
    Command::new("taskset")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

#[derive(Default)]
struct Samples {
    /// Full response time, send to last byte, in microseconds.
    total_us: Vec<f64>,
    /// Send to first body chunk, in microseconds.
    first_chunk_us: Vec<f64>,
    errors: u64,
    /// Responses that carried memory (`x-engram-memory: injected`).
    injected: u64,
    /// How late the generator started requests against its schedule (its own health).
    max_send_lag_us: f64,
    elapsed: Duration,
}

fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

const PERCENTILES: [f64; 4] = [50.0, 90.0, 99.0, 99.9];

type HttpClient = Client<HttpConnector, Full<Bytes>>;
type Headers = &'static [(&'static str, &'static str)];

fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(4096)
        .build(connector)
}

async fn one_request(
    client: HttpClient,
    url: String,
    body: Bytes,
    headers: Headers,
    user: Option<String>,
) -> Option<(f64, f64, bool)> {
    let mut request = http::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench");
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    if let Some(user) = user {
        request = request
            .header("x-engram-user", user)
            .header("x-engram-session", "bench");
    }
    let request = request.body(Full::new(body)).ok()?;
    let started = Instant::now();
    let response = client.request(request).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let injected = response
        .headers()
        .get("x-engram-memory")
        .is_some_and(|value| value == "injected");
    let mut body = response.into_body();
    let mut first = None;
    while let Some(frame) = body.frame().await {
        let frame = frame.ok()?;
        if first.is_none() && frame.data_ref().is_some_and(|d| !d.is_empty()) {
            first = Some(started.elapsed());
        }
    }
    let total = started.elapsed();
    let first = first.unwrap_or(total);
    Some((
        total.as_secs_f64() * 1e6,
        first.as_secs_f64() * 1e6,
        injected,
    ))
}

/// The user of request `i` when memory is benchmarked: `users` users take turns.
fn bench_user(users: Option<u32>, i: u64) -> Option<String> {
    users.map(|users| format!("bench-user-{}", i % u64::from(users)))
}

/// Open loop: request `i` is sent at `start + i / rate`, whatever happened to earlier ones.
/// With `users`, requests carry `x-engram-user` for that many users in turn.
async fn open_loop(
    url: &str,
    body: &Bytes,
    headers: Headers,
    rate: u64,
    duration: Duration,
    users: Option<u32>,
) -> Samples {
    let client = client();
    // Warm the pool and both processes.
    for i in 0..200 {
        let user = bench_user(users, i);
        let _ = one_request(client.clone(), url.to_owned(), body.clone(), headers, user).await;
    }
    let total = (rate as f64 * duration.as_secs_f64()) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let mut in_flight = JoinSet::new();
    let mut samples = Samples::default();
    for i in 0..total {
        let scheduled = start + interval.mul_f64(i as f64);
        tokio::time::sleep_until(scheduled).await;
        let lag = tokio::time::Instant::now().saturating_duration_since(scheduled);
        samples.max_send_lag_us = samples.max_send_lag_us.max(lag.as_secs_f64() * 1e6);
        in_flight.spawn(one_request(
            client.clone(),
            url.to_owned(),
            body.clone(),
            headers,
            bench_user(users, i),
        ));
    }
    while let Some(result) = in_flight.join_next().await {
        match result {
            Ok(Some((total, first, injected))) => {
                samples.total_us.push(total);
                samples.first_chunk_us.push(first);
                samples.injected += u64::from(injected);
            }
            _ => samples.errors += 1,
        }
    }
    samples.elapsed = start.elapsed();
    samples.total_us.sort_by(f64::total_cmp);
    samples.first_chunk_us.sort_by(f64::total_cmp);
    samples
}

/// What oha reports for one run, in microseconds.
struct OhaRun {
    percentiles_us: [f64; 4],
    requests_per_sec: f64,
    ok: u64,
    errors: u64,
}

fn oha_path() -> String {
    let home_bin = format!(
        "{}/.cargo/bin/oha",
        std::env::var("HOME").unwrap_or_default()
    );
    if std::path::Path::new(&home_bin).exists() {
        home_bin
    } else {
        "oha".to_owned()
    }
}

/// Open-loop load from oha at a fixed rate, with latency correction (latency counted from when
/// each request was due, not when it went out), pinned to core 0.
fn run_oha(url: &str, body: &Bytes, rate: u64, duration: Duration) -> OhaRun {
    let body_path = std::env::temp_dir().join("engram-bench-body.json");
    std::fs::write(&body_path, body).unwrap();
    let mut command = if has_taskset() {
        let mut c = Command::new("taskset");
        c.args(["-c", "0", &oha_path()]);
        c
    } else {
        Command::new(oha_path())
    };
    let output = command
        .args([
            "--no-tui",
            "--output-format",
            "json",
            "--latency-correction",
        ])
        .args(["-z", &format!("{}s", duration.as_secs())])
        .args(["-q", &rate.to_string(), "-c", "64", "-m", "POST"])
        .args([
            "-H",
            "content-type: application/json",
            "-H",
            "authorization: Bearer sk-bench",
        ])
        .arg("-D")
        .arg(&body_path)
        .arg(url)
        .output()
        .expect("oha is missing: run ./benches/overhead.sh, which installs it");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap_or_else(|e| {
        panic!(
            "oha output is not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    let at = |key: &str| {
        report["latencyPercentiles"][key]
            .as_f64()
            .unwrap_or(f64::NAN)
            * 1e6
    };
    let ok = report["statusCodeDistribution"]["200"]
        .as_u64()
        .unwrap_or(0);
    let errors = report["statusCodeDistribution"]
        .as_object()
        .map_or(0, |codes| {
            codes
                .iter()
                .filter(|(code, _)| *code != "200")
                .filter_map(|(_, n)| n.as_u64())
                .sum()
        })
        + report["errorDistribution"].as_object().map_or(0, |errors| {
            errors.values().filter_map(serde_json::Value::as_u64).sum()
        });
    OhaRun {
        percentiles_us: [at("p50"), at("p90"), at("p99"), at("p99.9")],
        requests_per_sec: report["summary"]["requestsPerSec"].as_f64().unwrap_or(0.0),
        ok,
        errors,
    }
}

fn chat_body(stream: bool) -> Bytes {
    Bytes::from(
        serde_json::json!({
            "model": "gpt-bench",
            "messages": [
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "Summarise the plot of a short story about a lighthouse keeper in two sentences."}
            ],
            "stream": stream,
        })
        .to_string(),
    )
}

fn row(label: &str, values: impl IntoIterator<Item = f64>) {
    let cells: Vec<String> = values
        .into_iter()
        .map(|v| format!("{:>8.3}", v / 1000.0))
        .collect();
    println!("| {label:<28} | {} |", cells.join(" | "));
}

fn report(rate: u64, metric: &str, direct: &[f64], proxied: &[f64]) {
    println!("\n{metric} at {rate} req/s (ms, built-in open-loop client)");
    table(
        &PERCENTILES.map(|p| percentile(direct, p)),
        &PERCENTILES.map(|p| percentile(proxied, p)),
    );
}

fn table(direct: &[f64; 4], proxied: &[f64; 4]) {
    println!(
        "| {:<28} | {:>8} | {:>8} | {:>8} | {:>8} |",
        "", "p50", "p90", "p99", "p99.9"
    );
    println!("|{}|", "-".repeat(30) + &"|----------".repeat(4));
    row("direct", *direct);
    row("through engram", *proxied);
    row(
        "added by engram",
        std::array::from_fn::<f64, 4, _>(|i| proxied[i] - direct[i]),
    );
}

struct Args {
    duration: Duration,
    rates: Vec<u64>,
    stream_rate: u64,
    /// Rate of the memory-on runs.
    memory_rate: u64,
    /// Users taking turns in the memory-on runs.
    users: u32,
    /// Memory-on backends to run: `embedded`, `redis`, `redis-cluster`; empty skips memory.
    backends: Vec<String>,
    /// Stepped rates (all replicas together) of the `redis-cluster` run.
    cluster_rates: Vec<u64>,
    /// engram replicas in the `redis-cluster` run.
    replicas: usize,
}

fn parse_args() -> Args {
    let mut parsed = Args {
        duration: Duration::from_secs(10),
        rates: Vec::new(),
        stream_rate: 200,
        memory_rate: 500,
        users: 100,
        backends: vec!["redis-cluster".to_owned()],
        cluster_rates: vec![100, 200, 400],
        replicas: 3,
    };
    let args: Vec<String> = std::env::args().collect();
    let mut i = 1;
    while i < args.len() {
        let value = || args.get(i + 1).cloned().unwrap_or_default();
        match args[i].as_str() {
            "--duration-secs" => {
                parsed.duration = Duration::from_secs(value().parse().expect("seconds"));
                i += 1;
            }
            "--rates" => {
                parsed.rates = value()
                    .split(',')
                    .filter(|r| !r.is_empty())
                    .map(|r| r.parse().expect("rate"))
                    .collect();
                i += 1;
            }
            "--stream-rate" => {
                parsed.stream_rate = value().parse().expect("rate");
                i += 1;
            }
            "--memory-rate" => {
                parsed.memory_rate = value().parse().expect("rate");
                i += 1;
            }
            "--users" => {
                parsed.users = value().parse().expect("users");
                i += 1;
            }
            "--cluster-rates" => {
                parsed.cluster_rates = value()
                    .split(',')
                    .filter(|r| !r.is_empty())
                    .map(|r| r.parse().expect("rate"))
                    .collect();
                i += 1;
            }
            "--replicas" => {
                parsed.replicas = value().parse().expect("replicas");
                i += 1;
            }
            "--memory" => {
                parsed.backends = value()
                    .split(',')
                    .filter(|b| !b.is_empty() && *b != "none")
                    .map(str::to_owned)
                    .collect();
                i += 1;
            }
            _ => {} // cargo passes --bench
        }
        i += 1;
    }
    parsed
}

/// The proxy's admin queue report (the worker's progress), as JSON.
async fn queue_report(proxy: &Process) -> serde_json::Value {
    let request = http::Request::get(format!("{}/engram/v1/queue", proxy.address))
        .header("authorization", "Bearer bench-admin")
        .body(Full::new(Bytes::new()))
        .unwrap();
    match client().request(request).await {
        Ok(response) => {
            let body = response.into_body().collect().await.unwrap().to_bytes();
            serde_json::from_slice(&body).unwrap_or_default()
        }
        Err(_) => serde_json::Value::Null,
    }
}

/// Memory on: the proxy reads, injects and records for `users` users taking turns; its worker
/// applies the jobs on the same core meanwhile.
async fn memory_run(mock: &Process, backend: &str, args: &Args, direct: &Samples) {
    let data = std::env::temp_dir().join(format!("engram-bench-{}-{backend}", std::process::id()));
    let _ = std::fs::remove_dir_all(&data);
    let data_dir = data.display().to_string();
    let mut redis = None;
    let mut env = vec![
        ("ENGRAM_SERVER__WORKER_THREADS".to_owned(), "1".to_owned()),
        ("ENGRAM_STORE__DATA_DIR".to_owned(), data_dir),
        ("ENGRAM_ADMIN_TOKEN".to_owned(), "bench-admin".to_owned()),
    ];
    if backend == "redis" {
        let Some((child, port)) = support::start_redis(if has_taskset() {
            &["taskset", "-c", "0"]
        } else {
            &[]
        }) else {
            println!(
                "
memory on ({backend}): skipped, redis-server is not installed"
            );
            return;
        };
        redis = Some(child);
        env.push(("ENGRAM_STORE__BACKEND".to_owned(), "redis".to_owned()));
        env.push((
            "ENGRAM_STORE__REDIS_URL".to_owned(),
            format!("redis://127.0.0.1:{port}"),
        ));
    }
    let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (k.as_str(), v.as_str())).collect();
    let upstream = format!("{}/v1", mock.address);
    let proxy = Process::start(
        Some("1"),
        &["serve", "--listen", "127.0.0.1:0", "--upstream", &upstream],
        &env,
    );
    let url = format!("{}/v1/chat/completions", proxy.address);
    let body = chat_body(false);
    let cpu_before = proxy.cpu_seconds();
    let proxied = open_loop(
        &url,
        &body,
        &[],
        args.memory_rate,
        args.duration,
        Some(args.users),
    )
    .await;
    let cpu = proxy.cpu_seconds() - cpu_before;
    let end = queue_report(&proxy).await;
    // Let the worker finish, to report its lag.
    let drained_at = Instant::now();
    let mut drained = end.clone();
    while drained_at.elapsed() < Duration::from_secs(60) {
        drained = queue_report(&proxy).await;
        if drained["depth"] == 0 && drained["recorded"]["in_flight"] == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    println!(
        "
memory on ({backend} store), non-streaming at {} req/s, {} users taking turns (ms, built-in open-loop client)",
        args.memory_rate, args.users
    );
    table(
        &PERCENTILES.map(|p| percentile(&direct.total_us, p)),
        &PERCENTILES.map(|p| percentile(&proxied.total_us, p)),
    );
    println!(
        "errors {} direct, {} proxied; memory injected into {} of {} answers; proxy CPU {:.3} s per 1,000 requests (worker included); max send lag {:.0} µs",
        direct.errors,
        proxied.errors,
        proxied.injected,
        proxied.total_us.len(),
        cpu / proxied.total_us.len().max(1) as f64 * 1000.0,
        proxied.max_send_lag_us,
    );
    println!(
        "worker: {} jobs applied, queue depth {} when the load stopped, drained {:.1} s later; proxy peak RSS {:.1} MiB",
        drained["worker"]["applied"],
        end["depth"],
        drained_at.elapsed().as_secs_f64(),
        proxy.peak_rss_mib(),
    );
    drop(proxy);
    if let Some(mut redis) = redis {
        let _ = redis.kill();
        let _ = redis.wait();
    }
    let _ = std::fs::remove_dir_all(&data);
}

/// One recorded request of the cluster run: its latency, when its response ended (ms since the
/// epoch) and its job.
struct Recorded {
    total_us: f64,
    end_ms: u64,
    user: String,
    job: String,
}

/// Like `one_request` with memory on, keeping the job id and the wall-clock end.
async fn one_recorded_request(
    client: HttpClient,
    url: String,
    body: Bytes,
    user: String,
) -> Option<Recorded> {
    let request = http::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench")
        .header("x-engram-user", user.as_str())
        .header("x-engram-session", "bench")
        .body(Full::new(body))
        .ok()?;
    let started = Instant::now();
    let response = client.request(request).await.ok()?;
    if !response.status().is_success() {
        return None;
    }
    let job = response
        .headers()
        .get("x-engram-job-id")
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)?;
    response.into_body().collect().await.ok()?;
    let total_us = started.elapsed().as_secs_f64() * 1e6;
    Some(Recorded {
        total_us,
        end_ms: epoch_ms(),
        user,
        job,
    })
}

fn epoch_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |elapsed| elapsed.as_millis() as u64)
}

/// Open loop over several replicas: request `i` goes to replica `i % n` for user `i % users`.
async fn open_loop_replicas(
    urls: &[String],
    body: &Bytes,
    rate: u64,
    duration: Duration,
    users: u32,
) -> (Vec<Recorded>, u64) {
    let client = client();
    let total = (rate as f64 * duration.as_secs_f64()) as u64;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let start = tokio::time::Instant::now() + Duration::from_millis(20);
    let mut in_flight = JoinSet::new();
    for i in 0..total {
        tokio::time::sleep_until(start + interval.mul_f64(i as f64)).await;
        in_flight.spawn(one_recorded_request(
            client.clone(),
            urls[i as usize % urls.len()].clone(),
            body.clone(),
            format!("cluster-user-{}", i % u64::from(users)),
        ));
    }
    let (mut recorded, mut errors) = (Vec::new(), 0);
    while let Some(result) = in_flight.join_next().await {
        match result {
            Ok(Some(request)) => recorded.push(request),
            _ => errors += 1,
        }
    }
    (recorded, errors)
}

fn hex(text: &str) -> String {
    text.bytes().map(|byte| format!("{byte:02x}")).collect()
}

/// Three (`--replicas`) engram replicas, workers on, on a local Redis Cluster (3 masters + 3
/// replicas), at stepped rates: added latency per percentile against the mock alone, job lag
/// (response end → job applied, from the finished jobs' index scores), Redis operations per
/// second (masters' INFO commandstats), engram CPU, summarizer calls, and Redis memory.
async fn cluster_run(mock: &Process, args: &Args) {
    let Some(cluster) = cluster_support::redis_cluster::RedisCluster::start_with(3, 1, &[]).await
    else {
        println!("\nmemory on (redis-cluster): skipped, redis-server or redis-cli is missing");
        return;
    };
    let summaries = std::env::temp_dir().join(format!(
        "engram-bench-{}-summaries.jsonl",
        std::process::id()
    ));
    let _ = std::fs::remove_file(&summaries);
    let summarizer = Process::start(
        None,
        &[
            "mock-upstream",
            "--listen",
            "127.0.0.1:0",
            "--worker-threads",
            "1",
            "--reply",
            r#"{"user_summary":"The user asked for a summary.","assistant_summary":"The assistant summarised a story.","add":[],"update":[],"remove":[]}"#,
            "--record",
            summaries.to_str().unwrap(),
        ],
        &[],
    );
    let urls = cluster.urls();
    let upstream = format!("{}/v1", mock.address);
    let summarizer_url = format!("{}/v1", summarizer.address);
    let replicas: Vec<Process> = (0..args.replicas)
        .map(|n| {
            let data = std::env::temp_dir()
                .join(format!("engram-bench-{}-replica-{n}", std::process::id()))
                .display()
                .to_string();
            Process::start(
                None,
                &["serve", "--listen", "127.0.0.1:0", "--upstream", &upstream],
                &[
                    ("ENGRAM_SERVER__WORKER_THREADS", "1"),
                    ("ENGRAM_STORE__DATA_DIR", &data),
                    ("ENGRAM_ADMIN_TOKEN", "bench-admin"),
                    ("ENGRAM_STORE__BACKEND", "redis"),
                    ("ENGRAM_STORE__REDIS_CLUSTER", "true"),
                    ("ENGRAM_STORE__REDIS_URL", &urls),
                    ("ENGRAM_STORE__REDIS_QUEUE_SHARDS", "3"),
                    ("ENGRAM_SUMMARIZER__BASE_URL", &summarizer_url),
                    ("ENGRAM_SUMMARIZER__REQUESTS_PER_MINUTE", "0"),
                ],
            )
        })
        .collect();
    let replica_urls: Vec<String> = replicas
        .iter()
        .map(|replica| format!("{}/v1/chat/completions", replica.address))
        .collect();
    let body = chat_body(false);
    let direct_url = format!("{}/v1/chat/completions", mock.address);
    // Warm the replicas (their first requests load the tokenizer).
    let _ = open_loop_replicas(&replica_urls, &body, 50, Duration::from_secs(1), args.users).await;
    let wait_drained = async || {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(120) {
            let mut drained = true;
            for replica in &replicas {
                let queue = queue_report(replica).await;
                drained &= queue["depth"] == 0 && queue["recorded"]["in_flight"] == 0;
            }
            if drained {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    };
    wait_drained().await;
    let memory_before = cluster.used_memory_of_masters();
    let redis = redis::cluster::ClusterClient::new(urls.split(',').collect::<Vec<_>>())
        .unwrap()
        .get_async_connection()
        .await
        .unwrap();
    let calls = |stats: &[(String, u64)], name: Option<&str>| -> u64 {
        stats
            .iter()
            .filter(|(command, _)| name.is_none_or(|name| command == name))
            .map(|(_, calls)| calls)
            .sum()
    };
    println!(
        "\nmemory on, {} replicas on a Redis Cluster (3 masters + 3 replicas, 3 queue shards), summarizer mocked, {} users taking turns, non-streaming, {:?} per rate (ms, built-in open-loop client; all processes share the machine's cores, so figures are noisy)",
        args.replicas, args.users, args.duration
    );
    // What idle replicas cost Redis: their workers poll every queue shard.
    let idle_before = cluster.command_calls();
    let idle_cpu_before = cluster.cpu_seconds_of_masters();
    let idle_started = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let idle_ops = calls(&cluster.command_calls(), None) - calls(&idle_before, None);
    let idle_seconds = idle_started.elapsed().as_secs_f64();
    let idle_rate = idle_ops as f64 / idle_seconds;
    let idle_cpu_rate = (cluster.cpu_seconds_of_masters() - idle_cpu_before) / idle_seconds;
    println!(
        "idle (no requests): {idle_rate:.0} Redis commands/s and {:.1} % of a core on the masters, from {} replicas' workers polling 3 queue shards every 100 ms",
        idle_cpu_rate * 100.0,
        args.replicas
    );
    println!(
        "| rate (req/s) | added p50 | added p90 | added p99 | added p99.9 | job lag p50 | job lag p99 | Redis commands/s | EVALSHA/s | commands/request (net of idle) | EVALSHA/request (net) | engram CPU s/1,000 req | Redis masters' CPU s/1,000 req (net of idle) | summarizer calls/turn | errors |"
    );
    println!("|{}", "---|".repeat(15));
    let idle_evalsha_rate = {
        let before = cluster.command_calls();
        let started = Instant::now();
        tokio::time::sleep(Duration::from_secs(1)).await;
        (calls(&cluster.command_calls(), Some("evalsha")) - calls(&before, Some("evalsha"))) as f64
            / started.elapsed().as_secs_f64()
    };
    let mut turns = 0u64;
    for &rate in &args.cluster_rates {
        let direct = open_loop(&direct_url, &body, &[], rate, args.duration, None).await;
        let stats_before = cluster.command_calls();
        let cpu_before: f64 = replicas.iter().map(Process::cpu_seconds).sum();
        let redis_cpu_before = cluster.cpu_seconds_of_masters();
        let summaries_before = std::fs::read_to_string(&summaries)
            .unwrap_or_default()
            .lines()
            .count();
        let started = Instant::now();
        let (recorded, errors) =
            open_loop_replicas(&replica_urls, &body, rate, args.duration, args.users).await;
        wait_drained().await;
        let elapsed = started.elapsed().as_secs_f64();
        let stats_after = cluster.command_calls();
        let cpu = replicas.iter().map(Process::cpu_seconds).sum::<f64>() - cpu_before;
        let redis_cpu = cluster.cpu_seconds_of_masters() - redis_cpu_before;
        let summarizer_calls = std::fs::read_to_string(&summaries)
            .unwrap_or_default()
            .lines()
            .count()
            - summaries_before;
        turns += recorded.len() as u64;
        // Each applied job's index score is when its record expires: finished + retention.
        let retention_ms = 7 * 24 * 60 * 60 * 1000u64;
        let mut lags = Vec::new();
        let mut connection = redis.clone();
        for request in &recorded {
            let index = format!(
                "engram:{{{}:{}}}:job_index",
                hex("default"),
                hex(&request.user)
            );
            let score: Option<f64> = redis::cmd("ZSCORE")
                .arg(&index)
                .arg(&request.job)
                .query_async(&mut connection)
                .await
                .unwrap_or(None);
            if let Some(score) = score.filter(|score| score.is_finite()) {
                let finished = score as u64 - retention_ms;
                lags.push(finished.saturating_sub(request.end_ms) as f64 * 1000.0);
            }
        }
        lags.sort_by(f64::total_cmp);
        let mut proxied: Vec<f64> = recorded.iter().map(|request| request.total_us).collect();
        proxied.sort_by(f64::total_cmp);
        let added = PERCENTILES
            .map(|p| (percentile(&proxied, p) - percentile(&direct.total_us, p)) / 1000.0);
        let total_ops = calls(&stats_after, None) - calls(&stats_before, None);
        let evalsha = calls(&stats_after, Some("evalsha")) - calls(&stats_before, Some("evalsha"));
        let requests = recorded.len().max(1) as f64;
        println!(
            "| {rate} | {:.3} | {:.3} | {:.3} | {:.3} | {:.1} | {:.1} | {:.0} | {:.0} | {:.1} | {:.1} | {:.3} | {:.3} | {:.2} | {} |",
            added[0],
            added[1],
            added[2],
            added[3],
            percentile(&lags, 50.0) / 1000.0,
            percentile(&lags, 99.0) / 1000.0,
            total_ops as f64 / elapsed,
            evalsha as f64 / elapsed,
            (total_ops as f64 - idle_rate * elapsed).max(0.0) / requests,
            (evalsha as f64 - idle_evalsha_rate * elapsed).max(0.0) / requests,
            cpu / requests * 1000.0,
            (redis_cpu - idle_cpu_rate * elapsed).max(0.0) / requests * 1000.0,
            summarizer_calls as f64 / requests,
            errors + direct.errors,
        );
    }
    // Bytes per user and per turn, from the keys of a sample of users (MEMORY USAGE).
    let (mut sampled_bytes, mut sampled_turns, mut sampled_users) = (0u64, 0u64, 0u64);
    // Bytes by kind: memory (hot state, items, change ring), raw log (with its id index),
    // finished job records (with the job index), the rest. Large raw entries kept apart
    // (`rawx:`) are not sampled.
    let mut by_kind = [0u64; 4];
    let mut connection = redis.clone();
    for user in 0..args.users.min(50) {
        let prefix = format!(
            "engram:{{{}:{}}}:",
            hex("default"),
            hex(&format!("cluster-user-{user}"))
        );
        let jobs: Vec<String> = redis::cmd("ZRANGE")
            .arg(format!("{prefix}job_index"))
            .arg(0)
            .arg(-1)
            .query_async(&mut connection)
            .await
            .unwrap_or_default();
        let raw: u64 = redis::cmd("LLEN")
            .arg(format!("{prefix}raw"))
            .query_async(&mut connection)
            .await
            .unwrap_or(0);
        let mut keys: Vec<String> = [
            "state",
            "items",
            "changes",
            "version",
            "committed",
            "answer",
            "prefetched",
            "raw",
            "raw_ids",
            "job_index",
            "leases",
            "arriving",
        ]
        .iter()
        .map(|kind| format!("{prefix}{kind}"))
        .collect();
        keys.extend(jobs.iter().map(|job| format!("{prefix}job:{job}")));
        for key in keys {
            let bytes: Option<u64> = redis::cmd("MEMORY")
                .arg("USAGE")
                .arg(&key)
                .arg("SAMPLES")
                .arg(0)
                .query_async(&mut connection)
                .await
                .unwrap_or(None);
            let bytes = bytes.unwrap_or(0);
            sampled_bytes += bytes;
            let kind = &key[prefix.len()..];
            let slot = match kind {
                // The hot state, its items and change ring (docs/storage.md, key layout).
                "state" | "items" | "changes" | "version" | "committed" => 0,
                "raw" | "raw_ids" => 1,
                _ if kind == "job_index" || kind.starts_with("job:") => 2,
                _ => 3,
            };
            by_kind[slot] += bytes;
        }
        sampled_turns += raw;
        sampled_users += 1;
    }
    let per_turn = |bytes: u64| bytes as f64 / sampled_turns.max(1) as f64;
    println!(
        "Redis bytes per user (MEMORY USAGE of {sampled_users} users' keys): {:.0} bytes per user with {:.1} turns each, {:.0} bytes per turn: memory (hot state, items, change ring) {:.0}, raw log {:.0}, finished job records {:.0}, other {:.0}",
        sampled_bytes as f64 / sampled_users.max(1) as f64,
        sampled_turns as f64 / sampled_users.max(1) as f64,
        per_turn(sampled_bytes),
        per_turn(by_kind[0]),
        per_turn(by_kind[1]),
        per_turn(by_kind[2]),
        per_turn(by_kind[3]),
    );
    let memory_after = cluster.used_memory_of_masters();
    let grown = memory_after.saturating_sub(memory_before) as f64;
    println!(
        "Redis memory (masters' used_memory): +{:.1} MiB for {turns} turns of {} users: {:.0} bytes per turn, {:.0} bytes per user (their memory states, raw logs, job records kept for the 7-day retention)",
        grown / 1048576.0,
        args.users,
        grown / turns.max(1) as f64,
        grown / f64::from(args.users.max(1)),
    );
    let stats = cluster.command_calls();
    let mut busiest: Vec<&(String, u64)> = stats.iter().collect();
    busiest.sort_by_key(|entry| std::cmp::Reverse(entry.1));
    println!(
        "commands over the whole run (masters): {}",
        busiest
            .iter()
            .take(12)
            .map(|(command, calls)| format!("{command} {calls}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    for n in 0..args.replicas {
        let _ = std::fs::remove_dir_all(
            std::env::temp_dir().join(format!("engram-bench-{}-replica-{n}", std::process::id())),
        );
    }
    let _ = std::fs::remove_file(&summaries);
}

fn main() {
    mock_process::serve_if_asked();
    // `cargo test --all-targets` runs harness-less benches with `--test`: nothing to check here.
    if std::env::args().any(|arg| arg == "--test") {
        println!("cluster benchmark: skipped in test mode (run ./benches/cluster.sh)");
        return;
    }
    let args = parse_args();
    let (duration, rates, stream_rate) = (args.duration, args.rates.clone(), args.stream_rate);
    let pinned = has_taskset();
    if pinned {
        // The generator shares core 0 with the mock; the proxy gets core 1 to itself.
        let _ = Command::new("taskset")
            .args(["-a", "-p", "-c", "0", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .status();
    }
    let mock = Process::start(
        Some("0"),
        &[
            "mock-upstream",
            "--listen",
            "127.0.0.1:0",
            "--worker-threads",
            "1",
        ],
        &[],
    );
    let upstream = format!("{}/v1", mock.address);
    let off_data_dir = std::env::temp_dir()
        .join(format!("engram-bench-{}-off", std::process::id()))
        .display()
        .to_string();
    let proxy = Process::start(
        Some("1"),
        &["serve", "--listen", "127.0.0.1:0", "--upstream", &upstream],
        &[
            ("ENGRAM_SERVER__WORKER_THREADS", "1"),
            ("ENGRAM_STORE__DATA_DIR", &off_data_dir),
        ],
    );
    println!("# engram overhead benchmark");
    println!(
        "machine: {} cores, {}; pinned: {}; duration per run: {:?}",
        std::fs::read_to_string("/proc/cpuinfo")
            .unwrap_or_default()
            .matches("processor\t")
            .count(),
        cpu_model(),
        if pinned {
            "proxy on core 1, mock + load generator on core 0"
        } else {
            "no (taskset missing)"
        },
        duration
    );
    println!(
        "proxy: 1 worker thread, memory off (requests without a user) unless stated; mock: 1 worker thread"
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let direct_url = format!("{}/v1/chat/completions", mock.address);
        let proxy_url = format!("{}/v1/chat/completions", proxy.address);
        let body = chat_body(false);
        for &rate in &rates {
            let direct = run_oha(&direct_url, &body, rate, duration);
            let cpu_before = proxy.cpu_seconds();
            let proxied = run_oha(&proxy_url, &body, rate, duration);
            let cpu = proxy.cpu_seconds() - cpu_before;
            println!("\nnon-streaming, full response at {rate} req/s (ms, oha, latency-corrected)");
            table(&direct.percentiles_us, &proxied.percentiles_us);
            println!(
                "throughput {:.0} req/s direct, {:.0} req/s proxied; errors {} direct, {} proxied; proxy CPU {:.3} s per 1,000 requests",
                direct.requests_per_sec,
                proxied.requests_per_sec,
                direct.errors,
                proxied.errors,
                cpu / proxied.ok.max(1) as f64 * 1000.0,
            );
        }

        let body = chat_body(true);
        let fifty_chunks: Headers = &[("x-mock-chunks", "50")];
        let direct = open_loop(&direct_url, &body, fifty_chunks, stream_rate, duration, None).await;
        let proxied = open_loop(&proxy_url, &body, fifty_chunks, stream_rate, duration, None).await;
        report(stream_rate, "streaming (50 chunks), time to first chunk", &direct.first_chunk_us, &proxied.first_chunk_us);
        report(stream_rate, "streaming (50 chunks), full stream", &direct.total_us, &proxied.total_us);
        println!("errors {} direct, {} proxied", direct.errors, proxied.errors);
        println!("\nproxy peak RSS: {:.1} MiB", proxy.peak_rss_mib());

        if !args.backends.is_empty() {
            let body = chat_body(false);
            let direct = open_loop(&direct_url, &body, &[], args.memory_rate, duration, Some(args.users)).await;
            for backend in &args.backends {
                if backend == "redis-cluster" {
                    cluster_run(&mock, &args).await;
                } else {
                    memory_run(&mock, backend, &args, &direct).await;
                }
            }
        }
    });
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split(':').nth(1))
        .map_or_else(|| "unknown CPU".to_owned(), |m| m.trim().to_owned())
}
