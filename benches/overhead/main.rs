//! engram's overhead, side by side with direct-to-mock and with LiteLLM's proxy, in one run.
//!
//! Run with `./benches/overhead.sh [options]` (see `--help`, or docs/benchmarks.md). Against
//! one mock upstream (`engram-mock`, one thread), it measures direct, engram with
//! memory off, with memory on (embedded store, and Redis), and LiteLLM's proxy (one worker),
//! each started fresh for every step and pinned alone on core 1 while the mock, the load
//! generators and Redis share core 0. Scenarios: non-streaming at stepped rates and at
//! saturation (oha), streaming time to first chunk, large request bodies, and many streams in
//! flight against a slow upstream (the built-in open-loop client). Each open-loop run of a
//! system other than direct also sends the same load straight to the mock, a paired direct
//! baseline, and the system's added latency is over that rather than over the step's direct
//! run minutes earlier. It prints a markdown report and writes it, with an SVG chart and the
//! raw figures as JSON, to `--out`.
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

mod args;
mod chart;
mod load;
#[path = "../support/mock_process.rs"]
mod mock_process;
#[path = "../support/prose.rs"]
mod prose;
mod report;
#[path = "../support/redis.rs"]
mod support;
mod systems;

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use args::Args;
use load::{LoadResult, OhaRun, RequestSpec};
use prose::prose;
use report::{Measurement, Report, Scenario, System, rate_label, size_label, thousands};
use systems::{Cores, Mock, RssSampler, Running};

/// One step of a scenario: the load every system gets in turn.
#[derive(Debug, Clone)]
struct Step {
    scenario: Scenario,
    load: String,
    kind: Kind,
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    /// Non-streaming, oha open loop at this rate.
    Rate(u64),
    /// Non-streaming, oha closed loop.
    Closed,
    /// Streaming, built-in client at this rate.
    Stream(u64),
    /// Non-streaming with a body of this many bytes, built-in client at this rate.
    Body(usize, u64),
    /// Streaming against the slow mock, built-in client at this rate.
    Inflight(u64),
}

fn steps(args: &Args, scenario: Scenario) -> Vec<Step> {
    let step = |load: String, kind| Step {
        scenario,
        load,
        kind,
    };
    match scenario {
        Scenario::Rates => args
            .rates
            .iter()
            .map(|&r| step(rate_label(r), Kind::Rate(r)))
            .collect(),
        Scenario::Saturation => vec![step("closed loop".into(), Kind::Closed)],
        Scenario::Stream => args
            .stream_rates
            .iter()
            .map(|&r| step(rate_label(r), Kind::Stream(r)))
            .collect(),
        Scenario::Body => args
            .body_sizes
            .iter()
            .flat_map(|&b| args.body_rates.iter().map(move |&r| (b, r)))
            .map(|(b, r)| {
                step(
                    format!("{} at {}", size_label(b), rate_label(r)),
                    Kind::Body(b, r),
                )
            })
            .collect(),
        Scenario::Inflight => vec![step(
            format!(
                "{} streams in flight ({} ms upstream latency, {})",
                thousands(args.in_flight as f64),
                thousands(args.in_flight_latency_ms as f64),
                rate_label(args.in_flight_rate())
            ),
            Kind::Inflight(args.in_flight_rate()),
        )],
    }
}

/// A chat request of about `size` bytes (the user message padded with words), or the usual
/// ~230-byte two-message request when `size` is 0.
fn chat_body(stream: bool, size: usize, user: Option<&str>) -> Bytes {
    let mut body = serde_json::json!({
        "model": systems::MODEL,
        "messages": [
            {"role": "system", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Summarise the plot of a short story about a lighthouse keeper in two sentences."}
        ],
        "stream": stream,
    });
    if let Some(user) = user {
        body["user"] = user.into();
    }
    let base = body.to_string().len();
    if size > base + 1 {
        let question = body["messages"][1]["content"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        body["messages"][1]["content"] = format!("{} {question}", prose(size - base - 1)).into();
    }
    Bytes::from(body.to_string())
}

/// Everything a step needs besides the system.
struct Context<'a> {
    args: &'a Args,
    cores: Cores,
    litellm: Result<PathBuf, String>,
    scratch: PathBuf,
    runtime: &'a tokio::runtime::Runtime,
}

fn main() {
    mock_process::serve_if_asked();
    // `cargo test --all-targets` runs harness-less benches with `--test`: nothing to do here.
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.iter().any(|a| a == "--test") {
        println!("overhead benchmark: skipped in test mode (run ./benches/overhead.sh)");
        return;
    }
    let args = match args::parse(&raw) {
        Ok(args) => args,
        Err(error) => {
            eprintln!("{error}\n\n{}", args::USAGE);
            std::process::exit(2);
        }
    };
    if args.help {
        print!("{}", args::USAGE);
        return;
    }
    let pinned = systems::has_taskset() && cores() >= 2;
    let cores = if pinned {
        // The load generators share core 0 with the mock; the system under test gets core 1.
        let _ = Command::new("taskset")
            .args(["-a", "-p", "-c", "0", &std::process::id().to_string()])
            .stdout(Stdio::null())
            .status();
        Cores {
            system: Some("1"),
            rest: Some("0"),
        }
    } else {
        Cores {
            system: None,
            rest: None,
        }
    };
    let litellm = if args.systems.contains(&System::Litellm) {
        systems::ensure_litellm()
    } else {
        Err("not requested".into())
    };
    if let Err(error) = &litellm
        && args.systems.contains(&System::Litellm)
    {
        println!("LiteLLM will be skipped: {error}");
    }
    let scratch = std::env::temp_dir().join(format!("engram-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let context = Context {
        args: &args,
        cores,
        litellm,
        scratch: scratch.clone(),
        runtime: &runtime,
    };
    let mut report = Report {
        context: describe(&context, pinned, &raw),
        measurements: Vec::new(),
    };
    for line in &report.context {
        println!("{line}");
    }
    let started = Instant::now();
    for &scenario in &args.scenarios {
        // The mock's defaults (8 chunks) except where the scenario says otherwise.
        let (chunks, latency_ms) = match scenario {
            Scenario::Stream => (args.chunks, 0),
            Scenario::Inflight => (8, args.in_flight_latency_ms),
            _ => (8, 0),
        };
        let mock = Mock::start(cores.rest, chunks, latency_ms).unwrap();
        for step in steps(&args, scenario) {
            for &system in &args.systems {
                let measurement = match skip_reason(&report, &context, system, &step) {
                    Some(why) => Measurement::skipped(system, scenario, &step.load, &why),
                    None => run_step(&context, system, &step, &mock),
                };
                report.measurements.push(measurement);
                if let Some(m) = report.measurements.last() {
                    println!("{}", progress_line(&report, m));
                }
            }
        }
    }
    report.context.push(format!(
        "whole run: {:.0} s",
        started.elapsed().as_secs_f64()
    ));
    let markdown = report.markdown();
    println!("\n{markdown}");
    write_outputs(&args.out_dir, &report, &markdown);
    let _ = std::fs::remove_dir_all(&scratch);
}

/// Cores of the machine (not of this process, which may already be pinned to one).
fn cores() -> usize {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|info| info.matches("processor\t").count())
        .ok()
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

fn describe(context: &Context, pinned: bool, raw: &[String]) -> Vec<String> {
    let args = context.args;
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find(|line| line.starts_with("model name"))
        .and_then(|line| line.split(':').nth(1))
        .map_or_else(|| "unknown CPU".to_owned(), |m| m.trim().to_owned());
    let memory_gib = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find(|l| l.starts_with("MemTotal:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|kib| kib.parse::<f64>().ok())
        .map_or(0.0, |kib| kib / 1024.0 / 1024.0);
    let kernel = systems::command_line("uname", &["-r"]);
    let commit = systems::command_line("git", &["rev-parse", "--short", "HEAD"]);
    let oha = systems::command_line(&load::oha_path(), &["--version"]);
    let litellm = match &context.litellm {
        Ok(path) => format!("LiteLLM {}", systems::litellm_version(path)),
        Err(why) => format!("LiteLLM not run ({why})"),
    };
    vec![
        format!(
            "machine: {} cores ({cpu}), {memory_gib:.0} GiB RAM, Linux {kernel}",
            cores()
        ),
        format!(
            "pinning: {}",
            if pinned {
                "system under test alone on core 1; mock, load generators and Redis on core 0"
            } else {
                "none (taskset missing or a single core)"
            }
        ),
        format!(
            "engram {commit} (release profile; the binary's sha256 {}…), 1 worker thread; mock upstream 1 thread; {oha}; {litellm} (1 worker)",
            systems::binary_hash()
        ),
        format!(
            "{} per measured run{}, each system started fresh for every step and warmed with 200 requests; memory on: {} users taking turns",
            humantime(args.duration),
            match (args.min_requests, lowest_rate(args)) {
                (0, _) | (_, None) => String::new(),
                (n, Some(rate)) => format!(
                    " and, open loop, at least {} requests ({} at {})",
                    thousands(n as f64),
                    humantime(args.run_length(rate)),
                    rate_label(rate),
                ),
            },
            args.users
        ),
        if args.pairing {
            "added latency: over a paired direct baseline, the same load sent to the mock during each open-loop run".into()
        } else {
            "added latency: over the step's direct run, measured separately (--no-pairing)".into()
        },
        format!(
            "command: ./benches/overhead.sh {}",
            raw.iter()
                .filter(|a| *a != "--bench")
                .cloned()
                .collect::<Vec<_>>()
                .join(" ")
        ),
    ]
}

/// The lowest offered rate of any open-loop run.
fn lowest_rate(args: &Args) -> Option<u64> {
    [&args.rates, &args.stream_rates, &args.body_rates]
        .into_iter()
        .flatten()
        .copied()
        .min()
}

fn humantime(duration: Duration) -> String {
    format!("{} s", duration.as_secs())
}

/// Why `system` is not run at `step`, if it is not.
fn skip_reason(report: &Report, context: &Context, system: System, step: &Step) -> Option<String> {
    if system == System::Litellm
        && let Err(why) = &context.litellm
    {
        return Some(format!("LiteLLM unavailable: {why}"));
    }
    // Stepped rates: past the first rate a system could not sustain, higher ones are skipped.
    let rate_of = |m: &Measurement| m.offered_rate.unwrap_or(f64::INFINITY);
    let (Kind::Rate(rate) | Kind::Stream(rate)) = step.kind else {
        return None;
    };
    report
        .measurements
        .iter()
        .filter(|m| m.system == system && m.scenario == step.scenario && m.skipped.is_none())
        .find(|m| !m.sustained() && rate_of(m) < rate as f64)
        .map(|m| format!("not run: saturated at {}", m.load))
}

fn run_step(context: &Context, system: System, step: &Step, mock: &Mock) -> Measurement {
    let args = context.args;
    let mut measurement = Measurement::new(system, step.scenario, &step.load);
    let running = match systems::start(system, mock, context.cores, context.litellm.as_deref().ok())
    {
        Ok(running) => running,
        Err(why) => {
            println!("{}: {why}", system.label());
            measurement.skipped = Some(format!("did not start: {why}"));
            return measurement;
        }
    };
    let users = system.memory().then_some(args.users);
    let (stream, body_size) = match step.kind {
        Kind::Stream(_) | Kind::Inflight(_) => (true, 0),
        Kind::Body(size, _) => (false, size),
        Kind::Rate(_) | Kind::Closed => (false, 0),
    };
    let spec = RequestSpec {
        url: format!("{}/v1/chat/completions", running.base_url),
        body: chat_body(stream, body_size, None),
        users,
    };
    // The paired direct baseline: the same requests (the mock ignores engram's headers) sent
    // straight to the mock during the system's run. Direct itself is measured alone, and the
    // closed loop reports absolute figures.
    let twin = (args.pairing && system != System::Direct && !matches!(step.kind, Kind::Closed))
        .then(|| RequestSpec {
            url: format!("{}/v1/chat/completions", mock.address),
            ..spec.clone()
        });
    let client = load::client();
    // Warm up; for LiteLLM, also prove it answers with the mock's reply. Large bodies get fewer
    // (with memory on, each is a turn the worker must apply before the measured run).
    // Few at a time too: the warm-up must not set the peak resident set.
    let (count, concurrency) = if body_size > 0 { (20, 2) } else { (200, 50) };
    let (warm_ok, injected) =
        context
            .runtime
            .block_on(load::warm_up(&client, &spec, count, concurrency));
    if warm_ok == 0 {
        measurement.skipped = Some("no successful warm-up request".into());
        return measurement;
    }
    // The built-in client's connections to the mock, as direct's own run has them warm.
    if let Some(twin) = twin
        .as_ref()
        .filter(|_| !matches!(step.kind, Kind::Rate(_)))
    {
        context
            .runtime
            .block_on(load::warm_up(&client, twin, count, concurrency));
    }
    if system == System::Litellm
        && let Err(why) = context
            .runtime
            .block_on(check_proxies_to_mock(&client, &running, mock))
    {
        measurement.skipped = Some(why);
        return measurement;
    }
    if let Some(token) = running.admin_token {
        // The warm-up's turns are applied before the measured run, so its CPU is not counted.
        let drained = context.runtime.block_on(worker_lag(&running, token, args));
        measurement.notes.push(format!(
            "warm-up: memory injected into {injected} of {warm_ok} answers, {drained}"
        ));
    }
    let degraded_before = running.degraded_so_far();
    let cpu_before = systems::cpu_seconds(&running.pids);
    let redis_cpu_before = running.redis_pid.map(|pid| systems::cpu_seconds(&[pid]));
    let sampler = RssSampler::start(&running.pids);
    let result = match step.kind {
        Kind::Rate(rate) => oha_step(
            context,
            system,
            &running,
            Some(rate),
            args.connections,
            twin.as_ref().map(|t| t.url.as_str()),
        ),
        Kind::Closed => closed_loop(context, system, &running),
        Kind::Stream(rate) | Kind::Inflight(rate) | Kind::Body(_, rate) => {
            let latency = match step.kind {
                Kind::Inflight(_) => Duration::from_millis(args.in_flight_latency_ms),
                _ => Duration::ZERO,
            };
            // Room for four times the expected in-flight requests before the client stops
            // sending (the system is then far behind, and reported as saturated).
            let expected = rate as f64 * (latency.as_secs_f64() + 0.1);
            let max_in_flight = (expected * 4.0).max(1024.0) as usize;
            Ok(context.runtime.block_on(load::open_loop(
                &client,
                &spec,
                twin.as_ref(),
                rate,
                args.run_length(rate),
                max_in_flight,
                args.timeout,
                stream,
            )))
        }
    };
    let mut result = match result {
        Ok(result) => result,
        Err(why) => {
            measurement.skipped = Some(why);
            return measurement;
        }
    };
    if system.memory() {
        let degraded = running.degraded_so_far() - degraded_before;
        if degraded > 0 {
            result.notes.push(format!(
                "{degraded} requests answered without memory (store error or read past the hot-path deadline)"
            ));
        }
    }
    if let Some(token) = running.admin_token {
        result
            .notes
            .push(context.runtime.block_on(worker_lag(&running, token, args)));
    }
    measurement.generator = match step.kind {
        Kind::Rate(_) | Kind::Closed => "oha".into(),
        _ => "built-in open-loop client".into(),
    };
    measurement.offered_rate = match step.kind {
        Kind::Rate(rate) | Kind::Stream(rate) | Kind::Inflight(rate) | Kind::Body(_, rate) => {
            Some(rate as f64)
        }
        Kind::Closed => None,
    };
    if matches!(step.kind, Kind::Closed) {
        measurement.connections = result
            .notes
            .iter()
            .find_map(|n| n.strip_prefix("connections ").and_then(|c| c.parse().ok()));
        result.notes.retain(|n| !n.starts_with("connections "));
    }
    if !running.pids.is_empty() {
        let cpu = systems::cpu_seconds(&running.pids) - cpu_before;
        measurement.cpu_per_1k = Some(cpu / result.ok.max(1) as f64 * 1000.0);
        measurement.peak_rss_mib = sampler.finish();
    }
    if let (Some(pid), Some(before)) = (running.redis_pid, redis_cpu_before) {
        let cpu = systems::cpu_seconds(&[pid]) - before;
        result.notes.push(format!(
            "redis-server: {:.3} CPU s / 1,000 req, peak RSS {:.1} MiB (not included)",
            cpu / result.ok.max(1) as f64 * 1000.0,
            systems::peak_rss_mib(pid)
        ));
    }
    measurement.baseline = result.baseline.map(|b| report::Baseline {
        latency_us: b.latency_us,
        stream_us: b.stream_us,
        throughput: b.throughput,
        ok: b.ok,
        errors: b.errors,
        notes: b.notes,
    });
    measurement.latency_us = result.latency_us;
    measurement.stream_us = result.stream_us;
    measurement.throughput = result.throughput;
    measurement.ok = result.ok;
    measurement.errors = result.errors;
    if system.memory() && result.injected > 0 {
        measurement.notes.push(format!(
            "memory injected into {} of {} answers",
            result.injected, result.ok
        ));
    }
    measurement.notes.extend(result.notes);
    measurement
}

/// oha against the system: memory on sends a random user's body per request (the `user`
/// field, which engram reads when there is no `x-engram-user`). With `twin` (the mock's URL),
/// a second oha sends the same load there alongside, the paired direct baseline.
fn oha_step(
    context: &Context,
    system: System,
    running: &Running,
    rate: Option<u64>,
    connections: usize,
    twin: Option<&str>,
) -> Result<LoadResult, String> {
    let args = context.args;
    let body_file = context.scratch.join(format!("body-{}.json", system.name()));
    let body_lines = system.memory();
    let contents: Vec<u8> = if body_lines {
        (0..args.users)
            .map(|u| {
                let body = chat_body(false, 0, Some(&format!("bench-user-{u}")));
                String::from_utf8_lossy(&body).into_owned() + "\n"
            })
            .collect::<String>()
            .into_bytes()
    } else {
        chat_body(false, 0, None).to_vec()
    };
    std::fs::write(&body_file, contents).map_err(|e| e.to_string())?;
    let url = format!("{}/v1/chat/completions", running.base_url);
    let run = OhaRun {
        url: &url,
        body_file: &body_file,
        body_lines,
        headers: &[],
        rate,
        connections,
        duration: rate.map_or(args.duration, |rate| args.run_length(rate)),
        pin_core: context.cores.rest,
    };
    // Same rate, length, core and body file: the mock ignores the `user` field.
    let twin = twin.map(|url| OhaRun { url, ..run });
    load::run_oha(&run, twin.as_ref())
}

/// Closed loop with `--connections` connections; while the error rate is 1 % or more, again
/// with half as many, so the figure is the most the system completes with errors under 1 %.
fn closed_loop(context: &Context, system: System, running: &Running) -> Result<LoadResult, String> {
    let mut connections = context.args.connections;
    loop {
        let mut result = oha_step(context, system, running, None, connections, None)?;
        let total = result.ok + result.errors;
        let error_rate = result.errors as f64 / total.max(1) as f64;
        if error_rate < report::MAX_ERROR_RATE || connections == 1 {
            result.notes.push(format!("connections {connections}"));
            return Ok(result);
        }
        println!(
            "  {}: {:.1} % errors with {connections} connections, retrying with {}",
            system.label(),
            error_rate * 100.0,
            connections / 2
        );
        connections /= 2;
    }
}

/// LiteLLM must answer with the mock's own reply, byte for byte in the content, or the figures
/// would measure something else.
async fn check_proxies_to_mock(
    client: &load::HttpClient,
    running: &Running,
    mock: &Mock,
) -> Result<(), String> {
    let content = |url: String| {
        let client = client.clone();
        async move {
            let request = http::Request::post(url)
                .header("content-type", "application/json")
                .header("authorization", format!("Bearer {}", load::API_KEY))
                .body(Full::new(chat_body(false, 0, None)))
                .map_err(|e| e.to_string())?;
            let response = client.request(request).await.map_err(|e| e.to_string())?;
            let status = response.status();
            let body = response
                .into_body()
                .collect()
                .await
                .map_err(|e| e.to_string())?
                .to_bytes();
            let value: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
            match value["choices"][0]["message"]["content"].as_str() {
                Some(content) if status.is_success() => Ok(content.to_owned()),
                _ => Err(format!(
                    "status {status}: {}",
                    String::from_utf8_lossy(&body[..body.len().min(300)])
                )),
            }
        }
    };
    let expected = content(format!("{}/v1/chat/completions", mock.address)).await?;
    let got = content(format!("{}/v1/chat/completions", running.base_url)).await?;
    if got == expected {
        Ok(())
    } else {
        Err(format!(
            "LiteLLM's answer is not the mock's: {got:?} instead of {expected:?}"
        ))
    }
}

/// How far the worker was behind when the load stopped, and how long it took to catch up
/// (at most 30 s are waited; the CPU figure includes that time).
async fn worker_lag(running: &Running, token: &str, args: &Args) -> String {
    let report = || async {
        let request = http::Request::get(format!("{}/engram/v1/queue", running.base_url))
            .header("authorization", format!("Bearer {token}"))
            .body(Full::new(Bytes::new()))
            .ok()?;
        let response = load::client().request(request).await.ok()?;
        let body = response.into_body().collect().await.ok()?.to_bytes();
        serde_json::from_slice::<serde_json::Value>(&body).ok()
    };
    let Some(at_end) = report().await else {
        return "worker: queue report unavailable".into();
    };
    let waited = Instant::now();
    let limit = if args.quick {
        Duration::from_secs(10)
    } else {
        Duration::from_secs(30)
    };
    let mut last = at_end.clone();
    while waited.elapsed() < limit {
        if last["depth"] == 0 && last["recorded"]["in_flight"] == 0 {
            return format!(
                "worker: {} jobs queued at the end, drained in {:.1} s ({} applied in all)",
                at_end["depth"],
                waited.elapsed().as_secs_f64(),
                last["worker"]["applied"]
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
        if let Some(now) = report().await {
            last = now;
        }
    }
    format!(
        "worker: {} jobs queued at the end, {} still queued {:.0} s later ({} applied in all)",
        at_end["depth"],
        last["depth"],
        limit.as_secs_f64(),
        last["worker"]["applied"]
    )
}

fn progress_line(report: &Report, m: &Measurement) -> String {
    let head = format!("[{} · {}] {}", m.scenario.name(), m.load, m.system.label());
    let absolute = m.system == System::Direct || m.scenario == Scenario::Saturation;
    if let Some(why) = m.saturation() {
        return format!("{head}: {why} ({} ok, {} errors)", m.ok, m.errors);
    }
    let latency = if absolute {
        m.latency_us
    } else {
        report.added(m).unwrap_or([f64::NAN; 4])
    };
    format!(
        "{head}: {} p50/p99 {} / {} ms, {} req/s, {} errors, RSS {}, CPU {} s/1k",
        if absolute { "absolute" } else { "added" },
        report::ms(latency[0]),
        report::ms(latency[2]),
        thousands(m.throughput),
        m.errors,
        m.peak_rss_mib
            .map_or_else(|| "—".into(), |r| format!("{r:.1} MiB")),
        m.cpu_per_1k
            .map_or_else(|| "—".into(), |c| format!("{c:.3}")),
    )
}

fn write_outputs(out_dir: &Path, report: &Report, markdown: &str) {
    if let Err(error) = std::fs::create_dir_all(out_dir) {
        eprintln!("cannot create {}: {error}", out_dir.display());
        return;
    }
    let svg = chart::added_p99_svg(
        report,
        "engram vs LiteLLM: added p99 latency over direct, non-streaming",
    );
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    for (name, contents) in [
        ("overhead.md", markdown),
        ("overhead.svg", svg.as_str()),
        ("overhead.json", json.as_str()),
    ] {
        let path = out_dir.join(name);
        match std::fs::write(&path, contents) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(error) => eprintln!("cannot write {}: {error}", path.display()),
        }
    }
}
