//! The two load generators: oha (non-streaming runs, open and closed loop) and a built-in
//! open-loop client (streams, whose time to first chunk oha cannot see, and large bodies).

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::task::{JoinError, JoinSet};
use tokio::time::Instant;

use crate::report::percentiles;

/// What a load run saw, before it becomes a `Measurement`.
#[derive(Debug, Default)]
pub struct LoadResult {
    pub latency_us: [f64; 4],
    pub stream_us: Option<[f64; 4]>,
    pub throughput: f64,
    pub ok: u64,
    pub errors: u64,
    /// Answers that carried memory (`x-engram-memory: injected`).
    pub injected: u64,
    pub notes: Vec<String>,
    /// The paired direct baseline: the same load sent straight to the mock during this run.
    pub baseline: Option<Box<LoadResult>>,
}

/// The bearer token every request carries; LiteLLM is started with it as its master key (it
/// refuses to start without one), engram forwards it, the mock ignores it.
pub const API_KEY: &str = "sk-bench-5f0c1a7e9d3b48c2a6e4f1b0c9d8e7a6";

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

pub fn client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(8192)
        .build(connector)
}

/// One kind of request: where, what, and whose memory.
#[derive(Clone)]
pub struct RequestSpec {
    pub url: String,
    pub body: Bytes,
    /// With memory on, request `i` belongs to `bench-user-{i % users}`.
    pub users: Option<u32>,
}

impl RequestSpec {
    fn build(&self, i: u64) -> Option<http::Request<Full<Bytes>>> {
        let mut request = http::Request::post(&self.url)
            .header("content-type", "application/json")
            .header("authorization", format!("Bearer {API_KEY}"));
        if let Some(users) = self.users {
            request = request
                .header(
                    "x-engram-user",
                    format!("bench-user-{}", i % u64::from(users)),
                )
                .header("x-engram-session", "bench");
        }
        request.body(Full::new(self.body.clone())).ok()
    }
}

struct Sample {
    /// From when the request went out to the end of the body.
    total_us: f64,
    /// From when the request went out to the first non-empty body chunk.
    first_us: f64,
    injected: bool,
    finished: Instant,
}

async fn one_request(
    client: HttpClient,
    request: http::Request<Full<Bytes>>,
    sent: Instant,
) -> Option<Sample> {
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
            first = Some(sent.elapsed());
        }
    }
    let finished = Instant::now();
    let total = finished - sent;
    Some(Sample {
        total_us: total.as_secs_f64() * 1e6,
        first_us: first.unwrap_or(total).as_secs_f64() * 1e6,
        injected,
        finished,
    })
}

/// `count` requests, `concurrency` at a time, not measured: fills the connection pools, loads
/// the code paths, and for memory gives users something to recall. Returns (ok, injected).
pub async fn warm_up(
    client: &HttpClient,
    spec: &RequestSpec,
    count: u64,
    concurrency: u64,
) -> (u64, u64) {
    let mut tasks: JoinSet<Result<Option<Sample>, tokio::time::error::Elapsed>> = JoinSet::new();
    let (mut ok, mut injected) = (0, 0);
    for i in 0..count {
        if tasks.len() as u64 >= concurrency
            && let Some(Ok(Ok(Some(sample)))) = tasks.join_next().await
        {
            ok += 1;
            injected += u64::from(sample.injected);
        }
        if let Some(request) = spec.build(i) {
            tasks.spawn(tokio::time::timeout(
                Duration::from_secs(30),
                one_request(client.clone(), request, Instant::now()),
            ));
        }
    }
    while let Some(result) = tasks.join_next().await {
        if let Ok(Ok(Some(sample))) = result {
            ok += 1;
            injected += u64::from(sample.injected);
        }
    }
    (ok, injected)
}

/// Open loop: request `i` is due at `start + i / rate` and goes out then, whatever happened to
/// earlier ones. Requests past `timeout` are errors; so are requests not sent because
/// `max_in_flight` were already open (the system fell behind).
///
/// Latency counts from when a request went out, not from when it was due. tokio's timer has
/// millisecond ticks and fires at the tick after a deadline, so on this client requests went
/// out about 1 ms late (p50 0.9-1.0 ms, p99 1.4 ms at 25 req/s), by an amount that varied from
/// run to run and request to request. Counted from the due time, that lateness sat in every
/// figure of the built-in client, and "added over direct" subtracted two runs' different
/// lateness. Nothing here waits for an answer before sending the next request, so the
/// lateness is the generator's own, not the system's; it is noted.
///
/// `twin`, when given, is the paired direct baseline: twin `i` is due half an interval after
/// request `i` (`start + (i + 0.5) / rate`), goes out the same way on the same client, and is
/// summarised on its own into the result's `baseline`. The two then see the same seconds of
/// this machine and of the mock (which answers both, so twice the offered rate), where the
/// step's direct run saw others minutes earlier. Without a twin, schedule and result are
/// what they were before pairing.
#[expect(
    clippy::too_many_arguments,
    reason = "one run's schedule and targets, passed once from run_step"
)]
pub async fn open_loop(
    client: &HttpClient,
    spec: &RequestSpec,
    twin: Option<&RequestSpec>,
    rate: u64,
    duration: Duration,
    max_in_flight: usize,
    timeout: Duration,
    stream: bool,
) -> LoadResult {
    let total = (rate as f64 * duration.as_secs_f64()).round() as u64;
    let interval = Duration::from_secs_f64(1.0 / rate as f64);
    let start = Instant::now() + Duration::from_millis(20);
    // Each target counts its own requests in flight against `max_in_flight`: a system that
    // falls behind must not hold back its baseline's requests, nor the baseline the system's.
    let mut system = Target::new(spec, total);
    let mut baseline = twin.map(|twin| Target::new(twin, total));
    for i in 0..total {
        let due = start + interval.mul_f64(i as f64);
        system.send(client, i, due, max_in_flight, timeout).await;
        if let Some(baseline) = &mut baseline {
            let due = start + interval.mul_f64(i as f64 + 0.5);
            baseline.send(client, i, due, max_in_flight, timeout).await;
        }
    }
    let mut result = system.finish(start, stream, max_in_flight).await;
    if let Some(baseline) = baseline {
        let twin_start = start + interval.mul_f64(0.5);
        result.baseline = Some(Box::new(
            baseline.finish(twin_start, stream, max_in_flight).await,
        ));
    }
    result
}

/// A request's sample, `None` when it failed, or its timeout.
type Outcome = Result<Option<Sample>, tokio::time::error::Elapsed>;

/// One destination of an open-loop run: its requests in flight and what they saw.
struct Target<'a> {
    spec: &'a RequestSpec,
    in_flight: JoinSet<Outcome>,
    samples: Vec<Sample>,
    errors: u64,
    not_sent: u64,
    lateness_us: Vec<f64>,
}

impl<'a> Target<'a> {
    fn new(spec: &'a RequestSpec, total: u64) -> Target<'a> {
        Target {
            spec,
            in_flight: JoinSet::new(),
            samples: Vec::with_capacity(total as usize),
            errors: 0,
            not_sent: 0,
            lateness_us: Vec::with_capacity(total as usize),
        }
    }

    fn reap(&mut self, result: Result<Outcome, JoinError>) {
        match result {
            Ok(Ok(Some(sample))) => self.samples.push(sample),
            _ => self.errors += 1,
        }
    }

    /// Waits until `due`, then sends request `i` unless `max_in_flight` are already open.
    async fn send(
        &mut self,
        client: &HttpClient,
        i: u64,
        due: Instant,
        max_in_flight: usize,
        timeout: Duration,
    ) {
        tokio::time::sleep_until(due).await;
        let sent = Instant::now();
        self.lateness_us
            .push(sent.saturating_duration_since(due).as_secs_f64() * 1e6);
        while let Some(result) = self.in_flight.try_join_next() {
            self.reap(result);
        }
        if self.in_flight.len() >= max_in_flight {
            self.not_sent += 1;
            return;
        }
        let Some(request) = self.spec.build(i) else {
            self.not_sent += 1;
            return;
        };
        self.in_flight.spawn(tokio::time::timeout(
            timeout,
            one_request(client.clone(), request, sent),
        ));
    }

    async fn finish(mut self, start: Instant, stream: bool, max_in_flight: usize) -> LoadResult {
        while let Some(result) = self.in_flight.join_next().await {
            self.reap(result);
        }
        let mut result = summarise(self.samples, self.errors + self.not_sent, start, stream);
        if self.not_sent > 0 {
            result.notes.push(format!(
                "{} requests not sent: {max_in_flight} already in flight",
                self.not_sent
            ));
        }
        let mut lateness_us = self.lateness_us;
        lateness_us.sort_by(f64::total_cmp);
        let [p50, _, p99, _] = percentiles(&lateness_us);
        let max = lateness_us.last().copied().unwrap_or(0.0);
        result.notes.push(format!(
            "requests went out after they were due by p50 {} / p99 {} / max {} ms (timer ticks, not counted)",
            crate::report::ms(p50),
            crate::report::ms(p99),
            crate::report::ms(max)
        ));
        result
    }
}

fn summarise(samples: Vec<Sample>, errors: u64, start: Instant, stream: bool) -> LoadResult {
    let ok = samples.len() as u64;
    let injected = samples.iter().filter(|s| s.injected).count() as u64;
    // Completed per second over the run, less the fastest answer's latency (so a 1 s upstream
    // does not read as a shortfall): equals the offered rate when the system keeps up.
    let last = samples.iter().map(|s| s.finished).max().unwrap_or(start);
    let fastest = samples
        .iter()
        .map(|s| s.total_us)
        .fold(f64::INFINITY, f64::min);
    let span = (last.saturating_duration_since(start).as_secs_f64()
        - if fastest.is_finite() {
            fastest / 1e6
        } else {
            0.0
        })
    .max(1e-3);
    let mut first: Vec<f64> = samples.iter().map(|s| s.first_us).collect();
    let mut total: Vec<f64> = samples.iter().map(|s| s.total_us).collect();
    first.sort_by(f64::total_cmp);
    total.sort_by(f64::total_cmp);
    LoadResult {
        latency_us: percentiles(if stream { &first } else { &total }),
        stream_us: stream.then(|| percentiles(&total)),
        throughput: ok as f64 / span,
        ok,
        errors,
        injected,
        notes: Vec::new(),
        baseline: None,
    }
}

pub fn oha_path() -> String {
    let home_bin = format!(
        "{}/.cargo/bin/oha",
        std::env::var("HOME").unwrap_or_default()
    );
    if Path::new(&home_bin).exists() {
        home_bin
    } else {
        "oha".to_owned()
    }
}

/// An oha run: open loop at `rate` with latency correction, or closed loop (`rate` `None`) with
/// `connections` connections each sending its next request when the last one is answered.
/// `body_lines`: each request takes a random line of the file as its body (oha's `-Z`).
/// `headers`: extra `name: value` headers every request carries.
pub struct OhaRun<'a> {
    pub url: &'a str,
    pub body_file: &'a Path,
    pub body_lines: bool,
    pub headers: &'a [&'a str],
    pub rate: Option<u64>,
    pub connections: usize,
    pub duration: Duration,
    pub pin_core: Option<&'a str>,
}

fn oha_command(run: &OhaRun) -> Command {
    let oha = oha_path();
    let mut command = match run.pin_core {
        Some(core) => {
            let mut command = Command::new("taskset");
            command.args(["-c", core, &oha]);
            command
        }
        None => Command::new(&oha),
    };
    command
        .args(["--no-tui", "--output-format", "json"])
        .args(["-z", &format!("{}s", run.duration.as_secs())])
        .args(["-c", &run.connections.to_string(), "-m", "POST"])
        .args(["-H", "content-type: application/json"])
        .args(["-H", &format!("authorization: Bearer {API_KEY}")])
        .args(["-t", "30s"]);
    for header in run.headers {
        command.args(["-H", header]);
    }
    if let Some(rate) = run.rate {
        command.args(["-q", &rate.to_string(), "--latency-correction"]);
    }
    command
        .arg(if run.body_lines { "-Z" } else { "-D" })
        .arg(run.body_file)
        .arg(run.url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    command
}

fn spawn_oha(run: &OhaRun) -> Result<Child, String> {
    oha_command(run)
        .spawn()
        .map_err(|e| format!("oha did not start ({e}): run ./benches/overhead.sh"))
}

fn oha_output(child: Child, duration: Duration) -> Result<LoadResult, String> {
    let output = child
        .wait_with_output()
        .map_err(|e| format!("oha did not finish: {e}"))?;
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).map_err(|e| {
        format!(
            "oha output is not JSON ({e}): {}",
            String::from_utf8_lossy(&output.stderr)
        )
    })?;
    Ok(oha_result(&report, duration))
}

/// `run`, and with `twin` (the paired direct baseline, an open-loop run against the mock) a
/// second oha alongside it, into the result's `baseline`. oha cannot shift its schedule, so
/// the twin starts half an interval after `run`, as the built-in client's twin does; process
/// start-up jitter blurs that at high rates. A twin that fails leaves a note, not an error:
/// the step's direct run is then the baseline.
pub fn run_oha(run: &OhaRun, twin: Option<&OhaRun>) -> Result<LoadResult, String> {
    let child = spawn_oha(run)?;
    let twin_child = twin.map(|twin| {
        if let Some(rate) = twin.rate {
            std::thread::sleep(Duration::from_secs_f64(0.5 / rate.max(1) as f64));
        }
        spawn_oha(twin)
    });
    // Read one after the other: oha writes its report when its run is over, so a twin kept
    // waiting on a full pipe has already measured everything.
    let mut result = oha_output(child, run.duration);
    let twin_result = twin_child.map(|c| c.and_then(|c| oha_output(c, run.duration)));
    if let Ok(result) = &mut result {
        match twin_result {
            Some(Ok(baseline)) => result.baseline = Some(Box::new(baseline)),
            Some(Err(why)) => result
                .notes
                .push(format!("paired direct baseline failed: {why}")),
            None => {}
        }
    }
    result
}

/// Reads oha's JSON report. Requests cut off by the end of the run ("aborted due to deadline")
/// are neither answers nor errors; every other error, and any status but 200, is an error.
pub fn oha_result(report: &serde_json::Value, duration: Duration) -> LoadResult {
    let at = |key: &str| {
        report["latencyPercentiles"][key]
            .as_f64()
            .unwrap_or(f64::NAN)
            * 1e6
    };
    let codes = report["statusCodeDistribution"].as_object();
    let ok = codes
        .and_then(|codes| codes.get("200"))
        .and_then(serde_json::Value::as_u64)
        .unwrap_or(0);
    let bad_status: u64 = codes.map_or(0, |codes| {
        codes
            .iter()
            .filter(|(code, _)| *code != "200")
            .filter_map(|(_, n)| n.as_u64())
            .sum()
    });
    let mut notes = Vec::new();
    let mut aborted = 0;
    let mut failed = 0;
    if let Some(errors) = report["errorDistribution"].as_object() {
        for (error, count) in errors {
            let count = count.as_u64().unwrap_or(0);
            if error.contains("aborted due to deadline") {
                aborted += count;
            } else {
                failed += count;
                notes.push(format!("{count}× {error}"));
            }
        }
    }
    if aborted > 0 {
        notes.push(format!("{aborted} cut off by the end of the run"));
    }
    LoadResult {
        latency_us: [at("p50"), at("p90"), at("p99"), at("p99.9")],
        stream_us: None,
        throughput: ok as f64 / duration.as_secs_f64(),
        ok,
        errors: bad_status + failed,
        injected: 0,
        notes,
        baseline: None,
    }
}
