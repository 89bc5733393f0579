//! The processes of a run: the mock upstream, and one system under test at a time (a bare
//! pass-through, engram in its three configurations, LiteLLM's proxy), each pinned to its core, with its CPU and memory
//! read from /proc.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::report::System;
use crate::support;

const BIN: &str = env!("CARGO_BIN_EXE_engram");

/// The first 12 hex digits of the `engram` binary's sha256, for a report's header: the
/// repository's HEAD names the source, and an A/B run may swap the binary under one harness.
pub fn binary_hash() -> String {
    command_output("sha256sum", &[BIN])
        .and_then(|text| {
            let hash = text.split_whitespace().next()?;
            (hash.len() == 64)
                .then(|| hash.get(..12))
                .flatten()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".to_owned())
}

/// What `program args` printed, trimmed, for a report's header; `<program> unavailable` when
/// it failed or printed nothing.
pub fn command_line(program: &str, args: &[&str]) -> String {
    command_output(program, args).unwrap_or_else(|| format!("{program} unavailable"))
}

fn command_output(program: &str, args: &[&str]) -> Option<String> {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        .filter(|text| !text.is_empty())
}

/// The peer, pinned so a rerun measures the same code.
pub const LITELLM_REQUIREMENT: &str = "litellm[proxy]==1.106.2";
pub const LITELLM_VENV: &str = ".venv-bench";
/// The model name clients send; LiteLLM maps it to `openai/gpt-bench` at the mock.
pub const MODEL: &str = "gpt-bench";

pub fn has_taskset() -> bool {
    Command::new("taskset")
        .arg("-V")
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `command` run through `taskset -c core` when pinning is possible.
fn pinned(core: Option<&str>, program: impl AsRef<std::ffi::OsStr>) -> Command {
    match core {
        Some(core) => {
            let mut command = Command::new("taskset");
            command.arg("-c").arg(core).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// Starts `engram` (or, for `mock-upstream` arguments, the mock) with `args`, its warnings
/// going to `log` (or nowhere); returns the child and the address it printed.
pub fn start_engram(
    core: Option<&str>,
    args: &[&str],
    env: &[(String, String)],
    log: Option<&Path>,
) -> Result<(Child, String), String> {
    let mut command = pinned(core, crate::mock_process::program(args, BIN));
    let stderr = log
        .and_then(|path| std::fs::File::create(path).ok())
        .map_or_else(Stdio::null, Stdio::from);
    command
        .args(args)
        .stdout(Stdio::piped())
        .stderr(stderr)
        .env("ENGRAM_LOGGING__LEVEL", "warn");
    for (key, value) in env {
        command.env(key, value);
    }
    let mut child = command
        .spawn()
        .map_err(|e| format!("engram did not start: {e}"))?;
    let mut line = String::new();
    if let Some(stdout) = child.stdout.take() {
        let _ = BufReader::new(stdout).read_line(&mut line);
    }
    match line.trim().rsplit(' ').next() {
        Some(address) if address.starts_with("http") => Ok((child, address.to_owned())),
        _ => {
            let _ = child.kill();
            let _ = child.wait();
            Err(format!("engram {} did not print its address", args[0]))
        }
    }
}

/// The mock upstream, alive for one scenario.
pub struct Mock {
    child: Child,
    pub address: String,
}

impl Mock {
    pub fn start(core: Option<&str>, chunks: usize, latency_ms: u64) -> Result<Mock, String> {
        let (chunks, latency) = (chunks.to_string(), latency_ms.to_string());
        let (child, address) =
            start_mock_process(core, &["--chunks", &chunks, "--latency-ms", &latency])?;
        Ok(Mock { child, address })
    }
}

impl Drop for Mock {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One system under test, started fresh for one step and stopped when dropped.
pub struct Running {
    pub base_url: String,
    child: Option<Child>,
    redis: Option<Child>,
    /// Processes whose CPU and memory count as the system's.
    pub pids: Vec<u32>,
    pub redis_pid: Option<u32>,
    /// The admin token, when the system is engram with memory (for its queue report).
    pub admin_token: Option<&'static str>,
    /// engram's warnings (one per request answered without memory because of the store).
    log: Option<PathBuf>,
    scratch: Option<PathBuf>,
}

/// The floor: the mock's own binary as a bare pass-through to `upstream` (`--forward`), one
/// thread, on `core`; returns the child and the address it printed.
pub fn start_floor(core: Option<&str>, upstream: &str) -> Result<(Child, String), String> {
    start_mock_process(core, &["--forward", upstream])
}

/// The mock's binary on a free port with one thread, on `core`, with `options` besides.
fn start_mock_process(core: Option<&str>, options: &[&str]) -> Result<(Child, String), String> {
    let mut args = vec![
        crate::mock_process::ARG,
        "--listen",
        "127.0.0.1:0",
        "--worker-threads",
        "1",
    ];
    args.extend_from_slice(options);
    start_engram(core, &args, &[], None)
}

impl Running {
    /// A system of one process, no store and no log of its own.
    fn alone(child: Child, base_url: String, scratch: Option<PathBuf>) -> Running {
        Running {
            base_url,
            pids: vec![child.id()],
            child: Some(child),
            redis: None,
            redis_pid: None,
            admin_token: None,
            log: None,
            scratch,
        }
    }

    fn direct(mock: &Mock) -> Running {
        Running {
            base_url: mock.address.clone(),
            child: None,
            redis: None,
            pids: Vec::new(),
            redis_pid: None,
            admin_token: None,
            log: None,
            scratch: None,
        }
    }
}

impl Running {
    /// Requests engram has answered without memory because the store failed or missed the
    /// hot-path deadline (it warns once for each).
    pub fn degraded_so_far(&self) -> u64 {
        self.log.as_ref().map_or(0, |log| {
            std::fs::read_to_string(log)
                .unwrap_or_default()
                .matches("answering without memory")
                .count() as u64
        })
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            // LiteLLM runs in its own process group: stop the group, in case it forked.
            let _ = Command::new("kill")
                .args(["-KILL", "--", &format!("-{}", child.id())])
                .stderr(Stdio::null())
                .status();
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(redis) = &mut self.redis {
            let _ = redis.kill();
            let _ = redis.wait();
        }
        if let Some(scratch) = &self.scratch {
            let _ = std::fs::remove_dir_all(scratch);
        }
    }
}

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("engram-bench-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::create_dir_all(&dir);
    dir
}

/// Where the systems run: the system under test alone on one core, everything else (mock,
/// load generators, Redis) on the other.
#[derive(Clone, Copy)]
pub struct Cores {
    pub system: Option<&'static str>,
    pub rest: Option<&'static str>,
}

pub fn start(
    system: System,
    mock: &Mock,
    cores: Cores,
    litellm: Option<&Path>,
) -> Result<Running, String> {
    let upstream = format!("{}/v1", mock.address);
    match system {
        System::Direct => Ok(Running::direct(mock)),
        System::Floor => {
            let (child, address) = start_floor(cores.system, &mock.address)?;
            Ok(Running::alone(child, address, None))
        }
        System::Off | System::Embedded | System::Redis => {
            let scratch = scratch_dir(system.name());
            let mut env = vec![
                ("ENGRAM_SERVER__WORKER_THREADS".to_owned(), "1".to_owned()),
                (
                    "ENGRAM_STORE__DATA_DIR".to_owned(),
                    scratch.join("data").display().to_string(),
                ),
                ("ENGRAM_ADMIN_TOKEN".to_owned(), "bench-admin".to_owned()),
            ];
            let mut redis = None;
            if system == System::Redis {
                let launcher: &[&str] = match cores.rest {
                    Some(core) => &["taskset", "-c", core],
                    None => &[],
                };
                let (child, port) = support::start_redis(launcher)
                    .ok_or("redis-server is not installed or did not start")?;
                redis = Some(child);
                env.push(("ENGRAM_STORE__BACKEND".to_owned(), "redis".to_owned()));
                env.push((
                    "ENGRAM_STORE__REDIS_URL".to_owned(),
                    format!("redis://127.0.0.1:{port}"),
                ));
            }
            let log = scratch.join("engram.log");
            let (child, address) = start_engram(
                cores.system,
                &["serve", "--listen", "127.0.0.1:0", "--upstream", &upstream],
                &env,
                Some(&log),
            )?;
            Ok(Running {
                base_url: address,
                pids: vec![child.id()],
                redis_pid: redis.as_ref().map(Child::id),
                child: Some(child),
                redis,
                admin_token: system.memory().then_some("bench-admin"),
                log: Some(log),
                scratch: Some(scratch),
            })
        }
        System::Litellm => {
            let litellm = litellm.ok_or("LiteLLM is not installed")?;
            start_litellm(litellm, &upstream, cores.system)
        }
    }
}

/// LiteLLM's proxy, one worker, with no database, no telemetry, no callbacks and the bundled
/// model cost map, so it starts and runs offline. Its log goes to `litellm.log` in the scratch
/// directory (printed when it fails to start).
fn start_litellm(litellm: &Path, upstream: &str, core: Option<&str>) -> Result<Running, String> {
    use std::os::unix::process::CommandExt as _;
    let scratch = scratch_dir("litellm");
    let config = scratch.join("config.yaml");
    std::fs::write(&config, litellm_config(upstream))
        .map_err(|e| format!("writing LiteLLM's config: {e}"))?;
    let port = free_port()?;
    let log = std::fs::File::create(scratch.join("litellm.log"))
        .map_err(|e| format!("LiteLLM log: {e}"))?;
    let log_err = log.try_clone().map_err(|e| e.to_string())?;
    let mut command = pinned(core, litellm);
    command
        .args(["--config", &config.display().to_string()])
        .args(["--host", "127.0.0.1", "--port", &port.to_string()])
        .args(["--num_workers", "1"])
        .env_remove("DATABASE_URL")
        .env("LITELLM_MASTER_KEY", crate::load::API_KEY)
        .env("LITELLM_LOCAL_MODEL_COST_MAP", "True")
        .env("LITELLM_LOG", "ERROR")
        .env("LITELLM_MODE", "PRODUCTION")
        .env("DISABLE_ADMIN_UI", "True")
        .env("NO_DOCS", "True")
        .env("NO_REDOC", "True")
        .current_dir(&scratch)
        .stdin(Stdio::null())
        .stdout(log)
        .stderr(log_err)
        .process_group(0);
    let child = command
        .spawn()
        .map_err(|e| format!("LiteLLM did not start: {e}"))?;
    let mut running = Running::alone(
        child,
        format!("http://127.0.0.1:{port}"),
        Some(scratch.clone()),
    );
    let started = Instant::now();
    while started.elapsed() < Duration::from_secs(180) {
        if let Some(child) = &mut running.child
            && let Ok(Some(status)) = child.try_wait()
        {
            return Err(format!(
                "LiteLLM exited ({status}) while starting: {}",
                log_tail(&scratch.join("litellm.log"))
            ));
        }
        if http_get_ok(port, "/health/liveliness") {
            running.pids = process_tree(running.pids[0]);
            return Ok(running);
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    Err(format!(
        "LiteLLM did not answer within 180 s: {}",
        log_tail(&scratch.join("litellm.log"))
    ))
}

pub fn litellm_config(upstream: &str) -> String {
    format!(
        "model_list:
  - model_name: {MODEL}
    litellm_params:
      model: openai/{MODEL}
      api_base: {upstream}
      api_key: sk-bench
litellm_settings:
  telemetry: false
  drop_params: true
  set_verbose: false
  json_logs: false
  callbacks: []
  success_callback: []
  failure_callback: []
  request_timeout: 60
general_settings:
  disable_spend_logs: true
  disable_error_logs: true
  background_health_checks: false
  store_model_in_db: false
  disable_reset_budget: true
"
    )
}

fn free_port() -> Result<u16, String> {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|listener| listener.local_addr())
        .map(|address| address.port())
        .map_err(|e| format!("no free port: {e}"))
}

/// A plain blocking GET on loopback; true on a 200.
fn http_get_ok(port: u16, path: &str) -> bool {
    use std::io::Write as _;
    let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", port)) else {
        return false;
    };
    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
    let request = format!("GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).is_err() {
        return false;
    }
    let mut status = [0u8; 12];
    stream.read_exact(&mut status).is_ok() && status.ends_with(b"200")
}

fn log_tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(15)..].join("\n")
}

/// Installs LiteLLM's proxy into its own venv when missing; returns its `litellm` command.
pub fn ensure_litellm() -> Result<PathBuf, String> {
    let bin = Path::new(LITELLM_VENV).join("bin");
    let litellm = bin.join("litellm");
    let installed = Command::new(bin.join("pip"))
        .args(["show", "litellm"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .unwrap_or_default();
    let wanted = LITELLM_REQUIREMENT.rsplit("==").next().unwrap_or_default();
    // Absolute: LiteLLM runs from its scratch directory.
    let absolute = |path: PathBuf| std::fs::canonicalize(&path).unwrap_or(path);
    if litellm.exists() && installed.lines().any(|l| l == format!("Version: {wanted}")) {
        return Ok(absolute(litellm));
    }
    println!("installing {LITELLM_REQUIREMENT} into {LITELLM_VENV} (once)");
    if !bin.join("python").exists() {
        let status = Command::new("python3")
            .args(["-m", "venv", LITELLM_VENV])
            .status()
            .map_err(|e| format!("python3 -m venv: {e}"))?;
        if !status.success() {
            return Err("python3 -m venv failed (is python3-venv installed?)".into());
        }
    }
    let status = Command::new(bin.join("pip"))
        .args(["install", "--quiet", "--disable-pip-version-check"])
        .arg(LITELLM_REQUIREMENT)
        .status()
        .map_err(|e| format!("pip: {e}"))?;
    if status.success() && litellm.exists() {
        Ok(absolute(litellm))
    } else {
        Err(format!("pip install {LITELLM_REQUIREMENT} failed"))
    }
}

pub fn litellm_version(litellm: &Path) -> String {
    let pip = litellm.with_file_name("pip");
    Command::new(pip)
        .args(["show", "litellm"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        .and_then(|text| {
            text.lines()
                .find_map(|l| l.strip_prefix("Version: ").map(str::to_owned))
        })
        .unwrap_or_else(|| "unknown".into())
}

/// `pid` and its descendants.
fn process_tree(pid: u32) -> Vec<u32> {
    let mut parents: Vec<(u32, u32)> = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(child) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            let stat = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
            let parent = stat_fields(&stat)
                .get(1)
                .and_then(|p| p.parse().ok())
                .unwrap_or(0);
            parents.push((child, parent));
        }
    }
    let mut tree = vec![pid];
    let mut i = 0;
    while i < tree.len() {
        let parent = tree[i];
        tree.extend(
            parents
                .iter()
                .filter(|(_, p)| *p == parent)
                .map(|(c, _)| *c),
        );
        i += 1;
    }
    tree
}

/// The fields of /proc/PID/stat after the command name (which may hold spaces): state first.
fn stat_fields(stat: &str) -> Vec<&str> {
    stat.rsplit_once(')')
        .map_or("", |(_, rest)| rest)
        .split_whitespace()
        .collect()
}

/// User + system CPU seconds used so far by `pids`.
pub fn cpu_seconds(pids: &[u32]) -> f64 {
    let ticks: f64 = pids
        .iter()
        .map(|pid| {
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
            let fields = stat_fields(&stat);
            // utime and stime: fields 14 and 15 of stat, 11 and 12 after the name.
            fields.get(11..13).map_or(0.0, |f| {
                f.iter().filter_map(|v| v.parse::<f64>().ok()).sum()
            })
        })
        .sum();
    ticks / clock_ticks_per_second()
}

fn clock_ticks_per_second() -> f64 {
    Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
        .unwrap_or(100.0)
}

fn status_kib(pid: u32, key: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .unwrap_or_default()
        .lines()
        .find(|line| line.starts_with(key))
        .and_then(|line| line.split_whitespace().nth(1))
        .and_then(|value| value.parse().ok())
        .unwrap_or(0)
}

/// Samples the summed resident set of some processes every 100 ms until stopped; the peak is
/// the larger of that and the main process's own high-water mark (VmHWM).
pub struct RssSampler {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<u64>>,
    pids: Vec<u32>,
}

impl RssSampler {
    pub fn start(pids: &[u32]) -> RssSampler {
        let stop = Arc::new(AtomicBool::new(false));
        let thread = (!pids.is_empty()).then(|| {
            let (stop, pids) = (stop.clone(), pids.to_vec());
            std::thread::spawn(move || {
                let mut peak = 0;
                while !stop.load(Ordering::Relaxed) {
                    let rss: u64 = pids.iter().map(|pid| status_kib(*pid, "VmRSS:")).sum();
                    peak = peak.max(rss);
                    std::thread::sleep(Duration::from_millis(100));
                }
                peak
            })
        });
        RssSampler {
            stop,
            thread,
            pids: pids.to_vec(),
        }
    }

    /// Peak in MiB; `None` when there was nothing to sample.
    pub fn finish(mut self) -> Option<f64> {
        self.stop.store(true, Ordering::Relaxed);
        let sampled = self.thread.take()?.join().unwrap_or(0);
        let hwm = self
            .pids
            .first()
            .map_or(0, |pid| status_kib(*pid, "VmHWM:"));
        Some(sampled.max(hwm) as f64 / 1024.0)
    }
}

impl Drop for RssSampler {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Peak resident set of one process so far, MiB.
pub fn peak_rss_mib(pid: u32) -> f64 {
    status_kib(pid, "VmHWM:") as f64 / 1024.0
}
