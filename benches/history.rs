//! Memory that stays fast as it grows (issue 26): one user's added latency, worker apply time,
//! store bytes and job lag as their stored history grows, and one user sending at a high rate
//! from an empty store.
//!
//! Run with `./benches/history.sh [options]` (see `--help`). For each history size, a fresh
//! embedded store is preloaded with that many turns of one user through the library (the real
//! `Worker`, in-process, as `benches/worker.rs` does), closed, and `engram serve` is started on
//! it, pinned alone on core 1 with the mock upstream, oha and the paired direct baseline on
//! core 0 (as the overhead benchmark does). That one user then sends new short messages at
//! `--rate` in an open loop, each recorded as a new turn, while a second oha sends the same
//! load straight to the mock. Worker apply time, store bytes, job lag and fail-opens come from
//! engram's `/metrics`. The adversarial case sends one user at `--adversarial-rate` from an
//! empty store, embedded and on Redis. It prints a markdown report and writes it, with the
//! figures as JSON and an SVG chart, to `--out`.
//!
//! Not a test: it prints numbers and asserts nothing; targets are shown as met or missed.

#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::print_stdout,
    clippy::print_stderr,
    reason = "a benchmark binary: it reports on stdout and stops loudly on a broken setup"
)]

#[path = "history/args.rs"]
mod args;
#[path = "history/chart.rs"]
mod chart;
#[allow(
    dead_code,
    reason = "the overhead benchmark's load generators: this one uses its oha runs only"
)]
#[path = "overhead/load.rs"]
mod load;
#[path = "support/mock_process.rs"]
mod mock_process;
#[path = "history/preload.rs"]
mod preload;
#[allow(
    dead_code,
    reason = "the overhead benchmark's report: this one uses its helpers and constants"
)]
#[path = "overhead/report.rs"]
mod report;
#[path = "history/results.rs"]
mod results;
#[path = "history/scrape.rs"]
mod scrape;
#[path = "support/redis.rs"]
mod support;
#[allow(
    dead_code,
    reason = "the overhead benchmark's processes: this one starts engram and the mock only"
)]
#[path = "overhead/systems.rs"]
mod systems;
#[path = "history/text.rs"]
mod text;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};

use args::{Args, Backend, Scenario};
use load::OhaRun;
use report::{ms, rate_label, thousands};
use results::{AdversarialResult, Report, Run, SizeResult, StoreBytes};
use scrape::Scrape;
use systems::{Cores, Mock, RssSampler};

/// Requests each engram gets before its measured run (applied before it starts).
const WARM_UP: u64 = 20;
/// oha's connections for an open-loop run, as in the overhead benchmark.
const CONNECTIONS: usize = 64;
/// Seeds the warm-up's messages apart from the preloaded turns' and the measured requests'
/// (`text::REQUEST_SEED`).
const WARM_UP_SEED: u64 = 1 << 40;
/// Longest wait for the warm-up's jobs to be applied.
const WARM_UP_DRAIN: Duration = Duration::from_secs(60);
/// Distinct request bodies in a run's body file (oha picks a line per request).
const MAX_BODIES: u64 = 20_000;
/// Store operations on the hot path (counted per chat request); the rest are the worker's
/// (counted per applied job).
const REQUEST_OPERATIONS: [&str; 4] = [
    "hot_record",
    "hot_record_arriving",
    "end_arrival",
    "enqueue",
];
const USER_WARM_UP: &str = "warmup";

struct Context<'a> {
    args: &'a Args,
    cores: Cores,
    scratch: PathBuf,
    runtime: &'a tokio::runtime::Runtime,
    mock: &'a Mock,
    client: load::HttpClient,
}

fn main() {
    mock_process::serve_if_asked();
    // `cargo test --all-targets` runs harness-less benches with `--test`: nothing to do here.
    let raw: Vec<String> = std::env::args().skip(1).collect();
    if raw.iter().any(|a| a == "--test") {
        println!("history benchmark: skipped in test mode (run ./benches/history.sh)");
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
        // This process (the preloading worker, the scrapes), the mock and oha share core 0;
        // engram gets core 1.
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
    let scratch = std::env::temp_dir().join(format!("engram-history-{}", std::process::id()));
    std::fs::create_dir_all(&scratch).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let mock = match Mock::start(cores.rest, 8, 0) {
        Ok(mock) => mock,
        Err(why) => {
            eprintln!("the mock upstream did not start: {why}");
            std::process::exit(1);
        }
    };
    let context = Context {
        args: &args,
        cores,
        scratch: scratch.clone(),
        runtime: &runtime,
        mock: &mock,
        client: load::client(),
    };
    let mut report = Report {
        context: describe(&args, pinned, &raw),
        rate: args.rate,
        duration_secs: args.duration.as_secs(),
        adversarial_rate: args.adversarial_rate,
        adversarial_secs: args.adversarial_duration.as_secs(),
        floor: None,
        sizes: Vec::new(),
        adversarial: Vec::new(),
    };
    for line in &report.context {
        println!("{line}");
    }
    let started = Instant::now();
    if args.scenarios.contains(&Scenario::Sizes) {
        report.floor = match floor(&context) {
            Ok(floor) => {
                println!("[floor] {}", floor.summary());
                Some(floor)
            }
            Err(why) => {
                println!("[floor] not measured: {why}");
                None
            }
        };
        report.sizes = sizes(&context);
    }
    if args.scenarios.contains(&Scenario::Adversarial) {
        for &system in &args.systems {
            report.adversarial.push(adversarial(&context, system));
        }
    }
    report.context.push(format!(
        "whole run: {:.0} s",
        started.elapsed().as_secs_f64()
    ));
    let markdown = report.markdown();
    println!("\n{markdown}");
    write_outputs(&args.out_dir, &report, &markdown);
    drop(mock);
    let _ = std::fs::remove_dir_all(&scratch);
}

/// A shell's busy loop on every core (pinned to it when the run is pinned), at normal
/// priority: the node whose other pods keep every core busy. Stopped when dropped.
struct BusyCores(Vec<Child>);

impl BusyCores {
    fn start(pinned: bool) -> BusyCores {
        const LOOP: &str = "while :; do :; done";
        let loops = (0..cores())
            .filter_map(|core| {
                let mut command = if pinned {
                    let mut command = Command::new("taskset");
                    command.args(["-c", &core.to_string(), "sh", "-c", LOOP]);
                    command
                } else {
                    let mut command = Command::new("sh");
                    command.args(["-c", LOOP]);
                    command
                };
                command
                    .stdin(Stdio::null())
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .spawn()
                    .ok()
            })
            .collect();
        BusyCores(loops)
    }

    /// Stops the loops; how many ran.
    fn stop(self) -> usize {
        self.0.len()
    }
}

impl Drop for BusyCores {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Cores of the machine (not of this process, which may already be pinned to one).
fn cores() -> usize {
    std::fs::read_to_string("/proc/cpuinfo")
        .map(|info| info.matches("processor\t").count())
        .ok()
        .filter(|n| *n > 0)
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, usize::from))
}

fn describe(args: &Args, pinned: bool, raw: &[String]) -> Vec<String> {
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
    let dirty = Command::new("git")
        .args([
            "status",
            "--porcelain",
            "--",
            "src",
            "crates",
            "Cargo.toml",
            "Cargo.lock",
        ])
        .output()
        .is_ok_and(|o| !o.stdout.is_empty());
    let binary = systems::binary_hash();
    let oha = systems::command_line(&load::oha_path(), &["--version"]);
    let redis = systems::command_line("redis-server", &["--version"]);
    let redis = redis
        .split_whitespace()
        .find_map(|w| w.strip_prefix("v="))
        .map_or(redis.clone(), |v| format!("redis-server {v}"));
    let mut lines = vec![
        format!(
            "machine: {} cores ({cpu}), {memory_gib:.0} GiB RAM, Linux {kernel}",
            cores()
        ),
        format!(
            "engram {commit}{} (release profile; the binary's sha256 {binary}…), 1 tokio worker \
             thread, its memory worker on the same core at idle priority (as shipped); heuristic \
             extractor; {oha}; {redis}",
            if dirty {
                " with uncommitted changes to src/, crates/ or Cargo.lock"
            } else {
                ""
            }
        ),
        format!(
            "pinning: {}",
            if pinned {
                "engram alone on core 1; the mock upstream (1 thread), oha, the paired baseline, \
                 Redis and this process (the preloading worker) on core 0"
            } else {
                "none (taskset missing or a single core)"
            }
        ),
    ];
    if args.scenarios.contains(&Scenario::Sizes) {
        lines.push(format!(
            "history sizes: for each size a fresh embedded store in which one user (tenant \
             default, user `solo`, one session) is preloaded with that many turns of \
             deterministic, varied text through the library (jobs enqueued into an \
             EmbeddedStore, applied by the real Worker in-process, concurrency 8, giving up \
             after {} s); the store is closed, `engram serve` started on it, warmed with {WARM_UP} \
             requests of that user (applied before the run), then oha sends that user new short \
             messages at {} for {} s, open loop with latency correction, non-streaming, {CONNECTIONS} \
             connections; every request is recorded as a new turn, so the history grows by up to \
             {} turns during the run",
            args.preload_timeout.as_secs(),
            rate_label(args.rate),
            args.duration.as_secs(),
            thousands((args.rate * args.duration.as_secs()) as f64)
        ));
    }
    if args.busy_cores {
        lines.push(
            "busy cores: a shell's busy loop on every core (normal priority, pinned one a core \
             when pinned) from the start of each measured load to the end of its drain, as on a \
             node whose other pods keep every core busy; the preload and warm-up run without"
                .to_owned(),
        );
    }
    if args.resent_history_bytes > 0 {
        lines.push(format!(
            "resent history: every measured request carries about {} bytes of earlier \
             conversation (user and assistant messages in turn, the same for every request) \
             before its new message, as a client that keeps its history does; the warm-up \
             requests do not",
            thousands(args.resent_history_bytes as f64)
        ));
    }
    if args.scenarios.contains(&Scenario::Adversarial) {
        lines.push(format!(
            "adversarial: one user (`solo`) at {} for {} s from an empty store ({}); the \
             {WARM_UP} warm-up requests go to another user",
            rate_label(args.adversarial_rate),
            args.adversarial_duration.as_secs(),
            args.systems
                .iter()
                .map(|s| s.name())
                .collect::<Vec<_>>()
                .join(" and ")
        ));
    }
    lines.push(
        "paired baseline: a second oha sends the same load straight to the mock during each \
         run, started half an interval later; added latency = engram's percentile less the \
         baseline's"
            .into(),
    );
    lines.push(format!(
        "from engram's /metrics, differences between a scrape before the run and one after the \
         queue drained (at most {} s after the load): fail-opens \
         (engram_memory_fail_open_total), degraded answers (engram_requests_total with \
         memory=\"degraded\", the x-engram-memory header's value), worker apply time \
         (engram_worker_apply_seconds), job lag (engram_job_lag_seconds), store bytes \
         (engram_store_bytes_total, divided by chat requests and by applied jobs \
         (engram_jobs_total{{result=\"applied\"}})); queue depth at the end of the load \
         (engram_queue_depth); peak RSS of the engram process from /proc",
        args.drain_timeout.as_secs()
    ));
    lines.push(format!(
        "command: ./benches/history.sh{}",
        raw.iter()
            .filter(|a| *a != "--bench")
            .fold(String::new(), |acc, a| acc + " " + a)
    ));
    lines
}

/// The history-size scenario: preload, then measure, size by size.
fn sizes(context: &Context) -> Vec<SizeResult> {
    let args = context.args;
    let mut results = Vec::new();
    let mut gave_up_at: Option<u64> = None;
    for &turns in &args.sizes {
        let head = format!("[sizes · {} turns]", thousands(turns as f64));
        if let Some(smaller) = gave_up_at {
            let why = format!(
                "not preloaded: preloading {} turns already gave up, and this preload passes \
                 through that one",
                thousands(smaller as f64)
            );
            println!("{head} {why}");
            results.push(SizeResult {
                turns,
                preload: None,
                skipped: Some(why),
                run: None,
            });
            continue;
        }
        let dir = context.scratch.join(format!("size-{turns}"));
        let _ = std::fs::remove_dir_all(&dir);
        let data = dir.join("data");
        println!(
            "{head} preloading {} turns through the worker",
            thousands(turns as f64)
        );
        let preload = match preload::preload(context.runtime, &data, turns, args.preload_timeout) {
            Ok(preload) => preload,
            Err(why) => {
                println!("{head} preload failed: {why}");
                results.push(SizeResult {
                    turns,
                    preload: None,
                    skipped: Some(format!("preload failed: {why}")),
                    run: None,
                });
                let _ = std::fs::remove_dir_all(&dir);
                continue;
            }
        };
        println!(
            "{head} preloaded {} of {} turns in {:.1} s: {:.0} jobs/s ({:.0} jobs/s at the end), store {:.1} MiB",
            thousands(preload.applied as f64),
            thousands(turns as f64),
            preload.secs,
            preload.rate,
            preload.final_rate,
            preload.store_mib
        );
        if let Some(why) = preload.gave_up.clone() {
            println!("{head} {why}; not measured");
            gave_up_at = Some(turns);
            results.push(SizeResult {
                turns,
                preload: Some(preload),
                skipped: Some(why),
                run: None,
            });
            let _ = std::fs::remove_dir_all(&dir);
            continue;
        }
        let run = measure(
            context,
            Backend::Embedded,
            &data,
            preload::USER,
            args.rate,
            args.duration,
        );
        let (run, skipped) = match run {
            Ok(mut run) => {
                run.notes.push(format!(
                    "store {:.1} MiB after the preload, {:.1} MiB after the run",
                    preload.store_mib,
                    preload::dir_bytes(&data) as f64 / 1024.0 / 1024.0
                ));
                println!("{head} {}", progress(&run));
                (Some(run), None)
            }
            Err(why) => {
                println!("{head} not measured: {why}");
                (None, Some(why))
            }
        };
        results.push(SizeResult {
            turns,
            preload: Some(preload),
            skipped,
            run,
        });
        let _ = std::fs::remove_dir_all(&dir);
    }
    results
}

/// A bare hyper pass-through (`engram-mock --forward`) on engram's core, at the sizes' rate and
/// length with the same bodies and its own paired baseline: what one more hop costs on this
/// machine, the part of every added figure that no memory change can take away.
fn floor(context: &Context) -> Result<results::Floor, String> {
    let args = context.args;
    let (mut child, base) = systems::start_floor(context.cores.system, &context.mock.address)?;
    let measured = (|| {
        let body_file = context.scratch.join("floor-bodies.jsonl");
        write_bodies(
            &body_file,
            (args.rate * args.duration.as_secs()).clamp(1_000, MAX_BODIES),
            args.resent_history_bytes,
        )?;
        let warmed =
            context
                .runtime
                .block_on(warm_up(&context.client, &base, preload::USER, WARM_UP));
        if warmed == 0 {
            return Err("no successful warm-up request".to_owned());
        }
        let (result, _) = run_paired(context, &base, &body_file, args.rate, args.duration, false);
        let result = result?;
        Ok(results::Floor {
            offered_rate: args.rate,
            duration_secs: args.duration.as_secs(),
            latency_us: result.latency_us,
            baseline_us: result.baseline.as_deref().map(|b| b.latency_us),
            ok: result.ok,
            errors: result.errors,
        })
    })();
    let _ = child.kill();
    let _ = child.wait();
    measured
}

/// One open-loop oha run of the user's chat requests against `base`, with its paired direct
/// baseline: the same rate, length, core, bodies and headers sent straight to the mock (which
/// ignores engram's headers). With `busy_cores`, busy loops run through it; they are returned
/// still running, for the caller to stop after its drain.
fn run_paired(
    context: &Context,
    base: &str,
    body_file: &Path,
    rate: u64,
    duration: Duration,
    busy_cores: bool,
) -> (Result<load::LoadResult, String>, Option<BusyCores>) {
    let url = format!("{base}/v1/chat/completions");
    let twin_url = format!("{}/v1/chat/completions", context.mock.address);
    let headers = headers(preload::USER);
    let header_refs: Vec<&str> = headers.iter().map(String::as_str).collect();
    let run = OhaRun {
        url: &url,
        body_file,
        body_lines: true,
        headers: &header_refs,
        rate: Some(rate),
        connections: CONNECTIONS,
        duration,
        pin_core: context.cores.rest,
    };
    let twin = OhaRun {
        url: &twin_url,
        ..run
    };
    let busy = busy_cores.then(|| BusyCores::start(context.cores.system.is_some()));
    (load::run_oha(&run, Some(&twin)), busy)
}

fn adversarial(context: &Context, system: Backend) -> AdversarialResult {
    let args = context.args;
    let head = format!(
        "[adversarial · {} · {}]",
        system.name(),
        rate_label(args.adversarial_rate)
    );
    let dir = context
        .scratch
        .join(format!("adversarial-{}", system.name()));
    let _ = std::fs::remove_dir_all(&dir);
    println!("{head} starting from an empty store");
    let run = measure(
        context,
        system,
        &dir.join("data"),
        USER_WARM_UP,
        args.adversarial_rate,
        args.adversarial_duration,
    );
    let _ = std::fs::remove_dir_all(&dir);
    match run {
        Ok(run) => {
            println!("{head} {}", progress(&run));
            AdversarialResult {
                system,
                skipped: None,
                run: Some(run),
            }
        }
        Err(why) => {
            println!("{head} not measured: {why}");
            AdversarialResult {
                system,
                skipped: Some(why),
                run: None,
            }
        }
    }
}

fn progress(run: &Run) -> String {
    let added = run.raw_added_us().unwrap_or([f64::NAN; 4]);
    format!(
        "added p50/p99 {} / {} ms{}, {} req/s, {} errors, fail-opens {}, worker apply p99 {}, \
         job lag p99 {}, queue at end {}, peak RSS {}",
        ms(added[0]),
        ms(added[2]),
        run.saturation()
            .map_or_else(String::new, |why| format!(" ({why})")),
        thousands(run.throughput),
        run.errors,
        run.fail_opens
            .map_or_else(|| "n/a".into(), |n| n.to_string()),
        with_unit(results::q_ms(run.apply_p99), "ms"),
        with_unit(results::q_s(run.lag_p99), "s"),
        run.queue_depth_end
            .map_or_else(|| "n/a".into(), |n| n.to_string()),
        run.peak_rss_mib
            .map_or_else(|| "—".into(), |r| format!("{r:.1} MiB")),
    )
}

fn with_unit(value: String, unit: &str) -> String {
    if value == "n/a" {
        value
    } else {
        format!("{value} {unit}")
    }
}

/// A running `engram serve` (and, on Redis, its redis-server), stopped when dropped.
struct Engram {
    child: Child,
    base_url: String,
    log: PathBuf,
    redis: Option<Child>,
}

impl Engram {
    fn start(context: &Context, system: Backend, data_dir: &Path) -> Result<Engram, String> {
        let upstream = format!("{}/v1", context.mock.address);
        let mut redis = None;
        let store = match system {
            Backend::Embedded => format!("embedded:{}", data_dir.display()),
            Backend::Redis => {
                let launcher: &[&str] = match context.cores.rest {
                    Some(core) => &["taskset", "-c", core],
                    None => &[],
                };
                let (child, port) = support::start_redis(launcher)
                    .ok_or("redis-server is not installed or did not start")?;
                redis = Some(child);
                format!("redis://127.0.0.1:{port}")
            }
        };
        let _ = std::fs::create_dir_all(data_dir);
        let log = data_dir.with_file_name("engram.log");
        let env = [
            ("ENGRAM_SERVER__WORKER_THREADS".to_owned(), "1".to_owned()),
            // The embedded store's directory, or Redis's local spool.
            (
                "ENGRAM_STORE__DATA_DIR".to_owned(),
                data_dir.display().to_string(),
            ),
        ];
        let started = systems::start_engram(
            context.cores.system,
            &[
                "serve",
                "--listen",
                "127.0.0.1:0",
                "--upstream",
                &upstream,
                "--store",
                &store,
            ],
            &env,
            Some(&log),
        );
        match started {
            Ok((child, base_url)) => Ok(Engram {
                child,
                base_url,
                log,
                redis,
            }),
            Err(why) => {
                if let Some(mut redis) = redis {
                    let _ = redis.kill();
                    let _ = redis.wait();
                }
                Err(format!("{why}: {}", log_tail(&log)))
            }
        }
    }

    fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Engram {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        if let Some(redis) = &mut self.redis {
            let _ = redis.kill();
            let _ = redis.wait();
        }
    }
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(5)..].join(" / ")
}

/// A non-streaming chat request: `history` (earlier messages the client resends), then one
/// user message.
fn chat_body(history: &[serde_json::Value], text: &str) -> String {
    let mut messages = history.to_vec();
    messages.push(serde_json::json!({"role": "user", "content": text}));
    serde_json::json!({
        "model": systems::MODEL,
        "messages": messages,
        "stream": false,
    })
    .to_string()
}

/// Seeds the resent history's turns apart from the recorded and the measured ones.
const HISTORY_SEED: u64 = 1 << 42;
/// The most a run's body file holds; with a resent history, fewer distinct lines.
const MAX_BODY_FILE_BYTES: u64 = 64 << 20;

/// Earlier turns as chat messages, user and assistant in turn, about `bytes` of text.
fn resent_history(bytes: u64) -> Vec<serde_json::Value> {
    let mut messages = Vec::new();
    let mut written = 0;
    let mut n = HISTORY_SEED;
    while written < bytes {
        for (role, content) in [
            ("user", text::user_text(n)),
            ("assistant", text::assistant_text(n)),
        ] {
            written += content.len() as u64;
            messages.push(serde_json::json!({"role": role, "content": content}));
        }
        n += 1;
    }
    messages
}

/// The run's request bodies, one per line, each a different short message after the
/// history every request resends (`history_bytes`, 0 for none): up to `count` lines, fewer
/// when a long history would make the file larger than `MAX_BODY_FILE_BYTES`.
fn write_bodies(path: &Path, count: u64, history_bytes: u64) -> Result<(), String> {
    let history = resent_history(history_bytes);
    let count = count.min((MAX_BODY_FILE_BYTES / (history_bytes + 1_000)).max(100));
    let mut lines = String::new();
    for i in 0..count {
        lines.push_str(&chat_body(
            &history,
            &text::user_text(text::REQUEST_SEED + i),
        ));
        lines.push('\n');
    }
    std::fs::write(path, lines).map_err(|e| format!("writing {}: {e}", path.display()))
}

fn headers(user: &str) -> [String; 2] {
    [
        format!("x-engram-user: {user}"),
        format!("x-engram-session: {}", preload::SESSION),
    ]
}

/// `count` requests of `user`, one at a time; returns how many were answered with a 2xx.
async fn warm_up(client: &load::HttpClient, base_url: &str, user: &str, count: u64) -> u64 {
    let mut ok = 0;
    for i in 0..count {
        let body = chat_body(&[], &text::user_text(WARM_UP_SEED + i));
        let Ok(request) = http::Request::post(format!("{base_url}/v1/chat/completions"))
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {}", load::API_KEY))
            .header("x-engram-user", user)
            .header("x-engram-session", preload::SESSION)
            .body(Full::new(Bytes::from(body)))
        else {
            continue;
        };
        let answered = tokio::time::timeout(Duration::from_secs(15), async {
            let response = client.request(request).await.ok()?;
            let success = response.status().is_success();
            response.into_body().collect().await.ok()?;
            Some(success)
        })
        .await;
        if let Ok(Some(true)) = answered {
            ok += 1;
        }
    }
    ok
}

/// engram's `/metrics`, parsed.
async fn scrape(client: &load::HttpClient, base_url: &str) -> Result<Scrape, String> {
    let request = http::Request::get(format!("{base_url}/metrics"))
        .body(Full::new(Bytes::new()))
        .map_err(|e| e.to_string())?;
    let page = tokio::time::timeout(Duration::from_secs(10), async {
        let response = client.request(request).await.map_err(|e| e.to_string())?;
        if !response.status().is_success() {
            return Err(format!("/metrics answered {}", response.status()));
        }
        let body = response
            .into_body()
            .collect()
            .await
            .map_err(|e| e.to_string())?
            .to_bytes();
        Ok(String::from_utf8_lossy(&body).into_owned())
    })
    .await
    .map_err(|_| "/metrics did not answer within 10 s".to_owned())??;
    Ok(Scrape::parse(&page))
}

/// Waits until the queue is empty and nothing is being recorded, at most `limit`. Returns the
/// seconds it took, or `None` and the jobs still queued (or recording) when it gave up.
async fn drain(
    client: &load::HttpClient,
    base_url: &str,
    limit: Duration,
) -> (Option<f64>, Option<u64>) {
    let started = Instant::now();
    let mut left = None;
    loop {
        if let Ok(page) = scrape(client, base_url).await {
            let depth = page.sum("engram_queue_depth", &[]).unwrap_or(0.0);
            let recording = page.sum("engram_recordings_in_flight", &[]).unwrap_or(0.0);
            let spooled = page.sum("engram_outbox_spooled_jobs", &[]).unwrap_or(0.0);
            let pending = (depth + recording + spooled) as u64;
            if pending == 0 {
                return (Some(started.elapsed().as_secs_f64()), None);
            }
            left = Some(pending);
        }
        if started.elapsed() >= limit {
            return (None, left);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// `name`'s sum over `filter` in `after` less in `before`, when `after` has it.
fn delta(before: &Scrape, after: &Scrape, name: &str, filter: &[(&str, &str)]) -> Option<u64> {
    let now = after.sum(name, filter)?;
    let then = before.sum(name, filter).unwrap_or(0.0);
    Some((now - then).max(0.0).round() as u64)
}

fn store_bytes(before: &Scrape, after: &Scrape, requests: u64, jobs: u64) -> Option<StoreBytes> {
    const NAME: &str = "engram_store_bytes_total";
    if !after.has(NAME) {
        return None;
    }
    let mut operations: Vec<String> = after
        .by_label(NAME, "operation", &[])
        .into_iter()
        .map(|(op, _)| op)
        .collect();
    operations.sort();
    let mut by_operation = Vec::new();
    let (mut request_read, mut request_written, mut job_read, mut job_written) =
        (0.0, 0.0, 0.0, 0.0);
    for op in operations {
        let bytes = |direction: &str| {
            let filter = [("operation", op.as_str()), ("direction", direction)];
            let now = after.sum(NAME, &filter).unwrap_or(0.0);
            let then = before.sum(NAME, &filter).unwrap_or(0.0);
            (now - then).max(0.0)
        };
        let (read, written) = (bytes("read"), bytes("written"));
        if REQUEST_OPERATIONS.contains(&op.as_str()) {
            request_read += read;
            request_written += written;
        } else {
            job_read += read;
            job_written += written;
        }
        by_operation.push((op, read, written));
    }
    let per = |bytes: f64, count: u64| {
        if count == 0 {
            f64::NAN
        } else {
            bytes / count as f64
        }
    };
    Some(StoreBytes {
        per_request_read: per(request_read, requests),
        per_request_written: per(request_written, requests),
        per_job_read: per(job_read, jobs),
        per_job_written: per(job_written, jobs),
        by_operation,
    })
}

/// Starts engram on `system` (the embedded store in `data_dir`, or a fresh Redis), warms it
/// with requests of `warm_user`, and measures one open-loop run of the one user at `rate` for
/// `duration` with its paired direct baseline.
fn measure(
    context: &Context,
    system: Backend,
    data_dir: &Path,
    warm_user: &str,
    rate: u64,
    duration: Duration,
) -> Result<Run, String> {
    let args = context.args;
    let runtime = context.runtime;
    let client = &context.client;
    let engram = Engram::start(context, system, data_dir)?;
    let base = engram.base_url.clone();
    let body_file = data_dir.with_file_name("bodies.jsonl");
    write_bodies(
        &body_file,
        (rate * duration.as_secs()).clamp(1_000, MAX_BODIES),
        args.resent_history_bytes,
    )?;
    let mut notes = Vec::new();
    let warmed = runtime.block_on(warm_up(client, &base, warm_user, WARM_UP));
    if warmed == 0 {
        return Err(format!(
            "no successful warm-up request: {}",
            log_tail(&engram.log)
        ));
    }
    if let (None, left) = runtime.block_on(drain(client, &base, WARM_UP_DRAIN)) {
        notes.push(format!(
            "the warm-up's jobs were not applied within {} s ({} left)",
            WARM_UP_DRAIN.as_secs(),
            left.map_or_else(|| "?".into(), |n| n.to_string())
        ));
    }
    let before = runtime.block_on(scrape(client, &base))?;
    let cpu_before = systems::cpu_seconds(&[engram.pid()]);
    let sampler = RssSampler::start(&[engram.pid()]);
    let (result, busy) = run_paired(context, &base, &body_file, rate, duration, args.busy_cores);
    let load_ended = Instant::now();
    let at_end = runtime.block_on(scrape(client, &base)).unwrap_or_default();
    let (drained, still_queued) = runtime.block_on(drain(client, &base, args.drain_timeout));
    let after = runtime.block_on(scrape(client, &base)).unwrap_or_default();
    let waited = load_ended.elapsed().as_secs_f64();
    let peak_rss_mib = sampler.finish();
    let cpu = systems::cpu_seconds(&[engram.pid()]) - cpu_before;
    if let Some(busy) = busy {
        notes.push(format!(
            "{} busy loops (one per core, normal priority) ran through the load and the drain",
            busy.stop()
        ));
    }
    let degraded_logged = std::fs::read_to_string(&engram.log)
        .unwrap_or_default()
        .matches("answering without memory")
        .count();
    drop(engram);
    let result = result?;
    if let (None, Some(left)) = (drained, still_queued) {
        notes.push(format!(
            "{} jobs not applied {waited:.0} s after the load ended: the job lag figures count \
             them as more than {waited:.0} s",
            thousands(left as f64)
        ));
    }
    if degraded_logged > 0 {
        notes.push(format!(
            "\"answering without memory\" warnings in engram's log: {degraded_logged} (warm-up included)"
        ));
    }
    notes.extend(result.notes.iter().cloned());

    let chat = [("route", "chat_completions")];
    let chat_requests = delta(&before, &after, "engram_requests_total", &chat);
    let jobs_applied = delta(
        &before,
        &after,
        "engram_jobs_total",
        &[("result", "applied")],
    );
    let runs = delta(&before, &after, "engram_worker_runs_total", &[]);
    let fail_opens = delta(&before, &after, "engram_memory_fail_open_total", &[]);
    // A recording the store would not take goes to the spool, and past its capacity is lost:
    // the jobs applied count only those that reached the store.
    let outbox = |result: &str| {
        delta(
            &before,
            &after,
            "engram_outbox_jobs_total",
            &[("result", result)],
        )
    };
    if let (Some(lost), Some(spooled)) = (outbox("lost"), outbox("spooled")) {
        notes.push(format!(
            "recordings spooled {}, lost {} (engram_outbox_jobs_total)",
            thousands(spooled as f64),
            thousands(lost as f64)
        ));
    }
    let fail_open_reasons: Vec<(String, u64)> = after
        .by_label("engram_memory_fail_open_total", "reason", &[])
        .into_iter()
        .filter_map(|(reason, now)| {
            let then = before
                .sum("engram_memory_fail_open_total", &[("reason", &reason)])
                .unwrap_or(0.0);
            let n = (now - then).max(0.0).round() as u64;
            (n > 0).then_some((reason, n))
        })
        .collect();
    let outcome = |memory: &str| {
        delta(
            &before,
            &after,
            "engram_requests_total",
            &[("route", "chat_completions"), ("memory", memory)],
        )
    };
    let apply = after
        .histogram("engram_worker_apply_seconds")
        .map(|h| h.since(before.histogram("engram_worker_apply_seconds").as_ref()));
    let lag = after
        .histogram("engram_job_lag_seconds")
        .map(|h| h.since(before.histogram("engram_job_lag_seconds").as_ref()));
    let lag_observed = lag.as_ref().map_or(0.0, scrape::Histogram::total) as u64;
    // Where a request's time went, phase by phase (`engram_memory_phase_seconds`), and the
    // store's two commits a receipt's wait is made of: its own enqueue, and the worker's job
    // commits it may queue behind.
    let phases = [
        ("engram_memory_phase_seconds", "phase", "load"),
        ("engram_memory_phase_seconds", "phase", "compose"),
        ("engram_memory_phase_seconds", "phase", "receipt_wait"),
        (
            "engram_store_operation_duration_seconds",
            "operation",
            "enqueue",
        ),
        (
            "engram_store_operation_duration_seconds",
            "operation",
            "commit_jobs",
        ),
    ]
    .into_iter()
    .filter_map(|(name, label, phase)| {
        let filter = [(label, phase)];
        let histogram = after
            .histogram_of(name, &filter)?
            .since(before.histogram_of(name, &filter).as_ref());
        Some(results::Phase {
            phase: match label {
                "operation" => format!("store {phase}"),
                _ => phase.to_owned(),
            },
            p50: histogram.quantile(0.5),
            p99: histogram.quantile(0.99),
        })
    })
    .collect();
    // Jobs still queued when the drain wait ended arrived before the load ended.
    let unobserved = still_queued.unwrap_or(0);
    let lag_quantile = |q: f64| {
        lag.as_ref()
            .and_then(|h| h.quantile_with_unobserved(q, unobserved, waited))
    };
    let lag_within_target = lag.as_ref().and_then(|h| {
        let share = h.share_within(results::TARGET_LAG_P99_S)?;
        let within = share * h.total();
        let all = h.total() + unobserved as f64;
        (all > 0.0).then(|| within / all)
    });
    let baseline = result.baseline.as_deref();
    Ok(Run {
        offered_rate: rate,
        duration_secs: duration.as_secs(),
        latency_us: result.latency_us,
        baseline_us: baseline.map(|b| b.latency_us),
        baseline_ok: baseline.map_or(0, |b| b.ok),
        baseline_errors: baseline.map_or(0, |b| b.errors),
        baseline_throughput: baseline.map_or(0.0, |b| b.throughput),
        throughput: result.throughput,
        ok: result.ok,
        errors: result.errors,
        chat_requests,
        fail_opens,
        fail_open_reasons,
        degraded: outcome("degraded"),
        injected: outcome("injected"),
        jobs_applied,
        runs,
        apply_p50: apply.as_ref().and_then(|h| h.quantile(0.5)),
        apply_p99: apply.as_ref().and_then(|h| h.quantile(0.99)),
        apply_within_target: apply
            .as_ref()
            .and_then(|h| h.share_within(results::TARGET_APPLY_P99_MS / 1000.0)),
        lag_p50: lag_quantile(0.5),
        lag_p99: lag_quantile(0.99),
        lag_max: lag.as_ref().and_then(|h| h.max_bound(unobserved, waited)),
        lag_observed,
        lag_within_target,
        store_bytes: store_bytes(
            &before,
            &after,
            chat_requests.unwrap_or(0),
            jobs_applied.unwrap_or(0),
        ),
        queue_depth_end: at_end
            .sum("engram_queue_depth", &[])
            .map(|d| d.max(0.0) as u64),
        drained_secs: drained,
        still_queued,
        unobserved_lag_at_least: waited,
        drain_timeout_secs: args.drain_timeout.as_secs(),
        peak_rss_mib,
        cpu_per_1k: (result.ok > 0).then(|| cpu / result.ok as f64 * 1000.0),
        phases,
        notes,
    })
}

fn write_outputs(out_dir: &Path, report: &Report, markdown: &str) {
    if let Err(error) = std::fs::create_dir_all(out_dir) {
        eprintln!("cannot create {}: {error}", out_dir.display());
        return;
    }
    let svg = chart::svg(
        report,
        "engram with one user's growing history: added p99 and worker apply p99",
    );
    let json = serde_json::to_string_pretty(report).unwrap_or_default();
    for (name, contents) in [
        ("history.md", markdown),
        ("history.svg", svg.as_str()),
        ("history.json", json.as_str()),
    ] {
        let path = out_dir.join(name);
        match std::fs::write(&path, contents) {
            Ok(()) => println!("wrote {}", path.display()),
            Err(error) => eprintln!("cannot write {}: {error}", path.display()),
        }
    }
}
