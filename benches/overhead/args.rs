//! Command-line options of the overhead benchmark. Pure: parsed from a list of strings, so the
//! parsing has unit tests (`tests/bench_harness.rs`).

use std::path::PathBuf;
use std::time::Duration;

use crate::report::{Scenario, System};

pub const USAGE: &str = "\
engram overhead benchmark: engram (memory off, memory on embedded, memory on Redis) and
LiteLLM's proxy against the same mock upstream, added latency over direct per percentile.

usage: ./benches/overhead.sh [options]

  --quick                      smoke test: 2 s per run, fewer steps, output in target/bench-quick
  --duration-secs N            seconds per measured run (default 20)
  --min-requests N             open-loop runs at low rates last until they have sent N
                               requests, so a p99 rests on N / 100 of them (default 1500;
                               60 s at 25 req/s; 0 with --quick)
  --systems LIST               of direct,floor,off,embedded,redis,litellm (default all;
                               direct is always measured, it is the baseline; floor is a
                               bare hyper pass-through on engram's core)
  --scenarios LIST             of rates,saturation,stream,body,inflight (default all)
  --rates LIST                 non-streaming open-loop rates, req/s
                               (default 25,50,100,500,1000,2000)
  --stream-rates LIST          streaming (50 chunks) rates, req/s (default 25,200)
  --body-sizes LIST            request body sizes, k/m = 1,000/1,000,000 bytes (default 100k,1m)
  --body-rates LIST            rates of the body-size runs, req/s (default 25,100)
  --in-flight N                in-flight streams of the inflight scenario (default 1000)
  --in-flight-latency-ms N     mock latency of the inflight scenario (default 1000)
  --connections N              connections of the closed-loop saturation run (default 64)
  --users N                    users taking turns in memory-on runs (default 100)
  --chunks N                   chunks per streamed reply (default 50)
  --timeout-secs N             per-request timeout of the built-in client (default 15)
  --out DIR                    where overhead.md, overhead.svg and overhead.json go
                               (default docs/benchmarks; target/bench-quick with --quick, and
                               target/bench-partial when --systems or --scenarios leave
                               something out, so a partial run never replaces the full report)
  --no-pairing                 no paired direct baseline: added latency is over the step's
                               direct run, measured separately (as before pairing)
  --help                       this text
";

#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    /// Length of each measured run...
    pub duration: Duration,
    /// ...or, for an open-loop run, long enough to send this many requests.
    pub min_requests: u64,
    /// Systems to measure, in report order; always starts with `System::Direct`.
    pub systems: Vec<System>,
    /// Scenarios to run, in report order.
    pub scenarios: Vec<Scenario>,
    /// Offered rates of the non-streaming runs (req/s), ascending.
    pub rates: Vec<u64>,
    /// Offered rates of the streaming runs (req/s), ascending.
    pub stream_rates: Vec<u64>,
    /// Request body sizes of the body runs, in bytes.
    pub body_sizes: Vec<usize>,
    /// Offered rates of the body runs (req/s), ascending.
    pub body_rates: Vec<u64>,
    /// Streams kept in flight by the inflight scenario.
    pub in_flight: u64,
    pub in_flight_latency_ms: u64,
    /// Connections of the closed-loop saturation run.
    pub connections: usize,
    /// Users taking turns when memory is on.
    pub users: u32,
    /// Content chunks per streamed reply.
    pub chunks: usize,
    /// Per-request timeout of the built-in client; past it a request counts as an error.
    pub timeout: Duration,
    pub out_dir: PathBuf,
    /// Open-loop runs of the other systems send the same load to the mock alongside, and
    /// added latency is over that paired baseline.
    pub pairing: bool,
    pub quick: bool,
    pub help: bool,
}

impl Args {
    fn full() -> Args {
        Args {
            duration: Duration::from_secs(20),
            // 500 requests (20 s at 25 req/s) put a p99 on the fifth slowest: in runs at that
            // rate it moved between 0.3 and 4.4 ms from one run to the next.
            min_requests: 1500,
            systems: System::ALL.to_vec(),
            scenarios: Scenario::ALL.to_vec(),
            // The low rates are where LiteLLM still keeps up (DESIGN.md §8a), so the two can be
            // compared; the high ones are engram's.
            rates: vec![25, 50, 100, 500, 1000, 2000],
            stream_rates: vec![25, 200],
            body_sizes: vec![100_000, 1_000_000],
            body_rates: vec![25, 100],
            in_flight: 1000,
            in_flight_latency_ms: 1000,
            connections: 64,
            users: 100,
            chunks: 50,
            timeout: Duration::from_secs(15),
            out_dir: PathBuf::from("docs/benchmarks"),
            pairing: true,
            quick: false,
            help: false,
        }
    }

    fn quick() -> Args {
        Args {
            duration: Duration::from_secs(2),
            min_requests: 0,
            rates: vec![25, 1000],
            stream_rates: vec![25],
            body_rates: vec![25],
            out_dir: PathBuf::from("target/bench-quick"),
            quick: true,
            ..Args::full()
        }
    }

    /// How long an open-loop run at `rate` req/s lasts: `duration`, or longer when that would
    /// send fewer than `min_requests`.
    pub fn run_length(&self, rate: u64) -> Duration {
        let for_requests = Duration::from_secs(self.min_requests.div_ceil(rate.max(1)));
        self.duration.max(for_requests)
    }

    /// The rate that keeps `in_flight` requests open against a mock answering after the latency.
    pub fn in_flight_rate(&self) -> u64 {
        (self.in_flight * 1000)
            .checked_div(self.in_flight_latency_ms)
            .unwrap_or(self.in_flight)
            .max(1)
    }
}

/// Parses the arguments after the program name. `--bench` (added by `cargo bench`) is ignored.
pub fn parse(args: &[String]) -> Result<Args, String> {
    let mut parsed = if args.iter().any(|a| a == "--quick") {
        Args::quick()
    } else {
        Args::full()
    };
    let mut out_given = false;
    let mut i = 0;
    while i < args.len() {
        let flag = args[i].as_str();
        let value = || {
            args.get(i + 1)
                .filter(|v| !v.starts_with("--"))
                .map(String::as_str)
                .ok_or_else(|| format!("{flag} needs a value"))
        };
        let mut takes_value = true;
        match flag {
            "--quick" | "--bench" => takes_value = false,
            "--no-pairing" => {
                parsed.pairing = false;
                takes_value = false;
            }
            "--help" | "-h" => {
                parsed.help = true;
                takes_value = false;
            }
            "--duration-secs" => {
                let secs = number(flag, value()?)?;
                if secs == 0 {
                    return Err("--duration-secs must be at least 1".into());
                }
                parsed.duration = Duration::from_secs(secs);
            }
            "--min-requests" => parsed.min_requests = number(flag, value()?)?,
            "--systems" => {
                let mut systems = vec![System::Direct];
                for name in list(value()?) {
                    let system = System::parse(name).ok_or_else(|| {
                        format!(
                            "unknown system {name:?} (direct, floor, off, embedded, redis, litellm)"
                        )
                    })?;
                    if !systems.contains(&system) {
                        systems.push(system);
                    }
                }
                systems.sort();
                parsed.systems = systems;
            }
            "--scenarios" => {
                let mut scenarios = Vec::new();
                for name in list(value()?) {
                    let scenario = Scenario::parse(name).ok_or_else(|| {
                        format!(
                            "unknown scenario {name:?} (rates, saturation, stream, body, inflight)"
                        )
                    })?;
                    if !scenarios.contains(&scenario) {
                        scenarios.push(scenario);
                    }
                }
                scenarios.sort();
                parsed.scenarios = scenarios;
            }
            "--rates" => parsed.rates = rates(flag, value()?)?,
            "--stream-rates" => parsed.stream_rates = rates(flag, value()?)?,
            "--body-sizes" => {
                parsed.body_sizes = list(value()?).map(parse_size).collect::<Result<_, _>>()?;
            }
            "--body-rates" => parsed.body_rates = rates(flag, value()?)?,
            "--in-flight" => parsed.in_flight = positive(flag, value()?)?,
            "--in-flight-latency-ms" => parsed.in_flight_latency_ms = number(flag, value()?)?,
            "--connections" => parsed.connections = positive(flag, value()?)? as usize,
            "--users" => {
                parsed.users = u32::try_from(positive(flag, value()?)?)
                    .map_err(|_| "--users is too large".to_owned())?;
            }
            "--chunks" => parsed.chunks = positive(flag, value()?)? as usize,
            "--timeout-secs" => {
                parsed.timeout = Duration::from_secs(positive(flag, value()?)?);
            }
            "--out" => {
                parsed.out_dir = PathBuf::from(value()?);
                out_given = true;
            }
            _ => return Err(format!("unknown option {flag:?}; see --help")),
        }
        i += if takes_value { 2 } else { 1 };
    }
    let partial = parsed.systems != System::ALL || parsed.scenarios != Scenario::ALL;
    if partial && !parsed.quick && !out_given {
        parsed.out_dir = PathBuf::from("target/bench-partial");
    }
    Ok(parsed)
}

fn list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|v| !v.is_empty())
}

fn number(flag: &str, value: &str) -> Result<u64, String> {
    value
        .replace('_', "")
        .parse()
        .map_err(|_| format!("{flag}: {value:?} is not a whole number"))
}

fn positive(flag: &str, value: &str) -> Result<u64, String> {
    match number(flag, value)? {
        0 => Err(format!("{flag} must be at least 1")),
        n => Ok(n),
    }
}

fn rates(flag: &str, value: &str) -> Result<Vec<u64>, String> {
    let mut rates = list(value)
        .map(|rate| positive(flag, rate))
        .collect::<Result<Vec<_>, _>>()?;
    rates.sort_unstable();
    rates.dedup();
    Ok(rates)
}

/// `100k` = 100,000 bytes, `1m` = 1,000,000 bytes, `512` = 512 bytes.
pub fn parse_size(value: &str) -> Result<usize, String> {
    let lower = value.to_ascii_lowercase();
    let (digits, unit) = match lower.strip_suffix(['k', 'm']) {
        Some(digits) if lower.ends_with('k') => (digits, 1_000),
        Some(digits) => (digits, 1_000_000),
        None => (lower.as_str(), 1),
    };
    digits
        .parse::<usize>()
        .ok()
        .filter(|n| *n > 0)
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("body size {value:?}: expected e.g. 512, 100k or 1m"))
}
