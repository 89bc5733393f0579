//! Command-line options of the history benchmark. Pure: parsed from a list of strings.

use std::path::PathBuf;
use std::time::Duration;

pub const USAGE: &str = "\
engram history benchmark (issue 26): one user's added latency, worker apply time, store bytes
and job lag as their stored history grows, and one user sending at a high rate from an empty
store.

usage: ./benches/history.sh [options]

  --quick                      smoke test: sizes 100,1000, 5 s runs, adversarial 10 s, output in
                               target/bench-quick
  --sizes LIST                 history sizes, in turns preloaded for the one user, k = 1,000
                               (default 100,1000,10000,50000)
  --rate N                     offered rate of the history-size runs, req/s (default 200)
  --duration-secs N            seconds per history-size run (default 20)
  --preload-timeout-secs N     give up preloading a size after this (default 900); larger sizes
                               are then skipped too (their preload passes through this one)
  --scenarios LIST             of sizes,adversarial (default both)
  --systems LIST               stores of the adversarial case, of embedded,redis (default both)
  --adversarial-rate N         offered rate of the adversarial case, req/s (default 1000)
  --adversarial-secs N         seconds of the adversarial run (default 60)
  --drain-timeout-secs N       after a run, how long to wait for the worker to empty the queue
                               (default 120; 30 with --quick)
  --busy-cores                 one busy loop per core (normal priority) through each measured run
                               and its drain, as on a node whose other pods keep every core
                               busy; compare with a run without it
  --resent-history-bytes N     every measured request resends about N bytes of earlier
                               conversation before its new message, as a client that keeps the
                               history does (k = 1,000; default none)
  --out DIR                    where history.md, history.json and history.svg go (default
                               docs/benchmarks; target/bench-quick with --quick, and
                               target/bench-partial when --sizes, --scenarios or --systems
                               differ from the defaults or --busy-cores or
                               --resent-history-bytes is given, so a partial
                               run never replaces the full report)
  --help                       this text
";

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    Sizes,
    Adversarial,
}

impl Scenario {
    pub const ALL: [Scenario; 2] = [Scenario::Sizes, Scenario::Adversarial];

    fn parse(name: &str) -> Option<Scenario> {
        match name {
            "sizes" => Some(Scenario::Sizes),
            "adversarial" => Some(Scenario::Adversarial),
            _ => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    Embedded,
    Redis,
}

impl Backend {
    pub const ALL: [Backend; 2] = [Backend::Embedded, Backend::Redis];

    pub fn name(self) -> &'static str {
        match self {
            Backend::Embedded => "embedded",
            Backend::Redis => "redis",
        }
    }

    fn parse(name: &str) -> Option<Backend> {
        Backend::ALL.into_iter().find(|b| b.name() == name)
    }
}

pub const DEFAULT_SIZES: [u64; 4] = [100, 1_000, 10_000, 50_000];

#[derive(Debug, Clone, PartialEq)]
pub struct Args {
    /// Turns preloaded for the one user, ascending.
    pub sizes: Vec<u64>,
    pub rate: u64,
    pub duration: Duration,
    pub preload_timeout: Duration,
    pub scenarios: Vec<Scenario>,
    pub systems: Vec<Backend>,
    pub adversarial_rate: u64,
    pub adversarial_duration: Duration,
    pub drain_timeout: Duration,
    /// One busy loop per core through each measured run and its drain.
    pub busy_cores: bool,
    /// Bytes of earlier conversation every measured request resends before its new message
    /// (0: the new message alone).
    pub resent_history_bytes: u64,
    pub out_dir: PathBuf,
    pub quick: bool,
    pub help: bool,
}

impl Args {
    fn full() -> Args {
        Args {
            sizes: DEFAULT_SIZES.to_vec(),
            rate: 200,
            duration: Duration::from_secs(20),
            preload_timeout: Duration::from_secs(900),
            scenarios: Scenario::ALL.to_vec(),
            systems: Backend::ALL.to_vec(),
            adversarial_rate: 1000,
            adversarial_duration: Duration::from_secs(60),
            drain_timeout: Duration::from_secs(120),
            busy_cores: false,
            resent_history_bytes: 0,
            out_dir: PathBuf::from("docs/benchmarks"),
            quick: false,
            help: false,
        }
    }

    fn quick() -> Args {
        Args {
            sizes: vec![100, 1_000],
            duration: Duration::from_secs(5),
            adversarial_duration: Duration::from_secs(10),
            drain_timeout: Duration::from_secs(30),
            out_dir: PathBuf::from("target/bench-quick"),
            quick: true,
            ..Args::full()
        }
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
            "--busy-cores" => {
                parsed.busy_cores = true;
                takes_value = false;
            }
            "--help" | "-h" => {
                parsed.help = true;
                takes_value = false;
            }
            "--sizes" => {
                let mut sizes = list(value()?)
                    .map(|size| parse_count(flag, size))
                    .collect::<Result<Vec<_>, _>>()?;
                sizes.sort_unstable();
                sizes.dedup();
                if sizes.is_empty() {
                    return Err("--sizes needs at least one size".into());
                }
                parsed.sizes = sizes;
            }
            "--rate" => parsed.rate = positive(flag, value()?)?,
            "--duration-secs" => parsed.duration = Duration::from_secs(positive(flag, value()?)?),
            "--preload-timeout-secs" => {
                parsed.preload_timeout = Duration::from_secs(positive(flag, value()?)?);
            }
            "--scenarios" => {
                let mut scenarios = Vec::new();
                for name in list(value()?) {
                    let scenario = Scenario::parse(name)
                        .ok_or_else(|| format!("unknown scenario {name:?} (sizes, adversarial)"))?;
                    scenarios.push(scenario);
                }
                scenarios.sort();
                scenarios.dedup();
                parsed.scenarios = scenarios;
            }
            "--systems" => {
                let mut systems = Vec::new();
                for name in list(value()?) {
                    let system = Backend::parse(name)
                        .ok_or_else(|| format!("unknown system {name:?} (embedded, redis)"))?;
                    systems.push(system);
                }
                systems.sort();
                systems.dedup();
                parsed.systems = systems;
            }
            "--adversarial-rate" => parsed.adversarial_rate = positive(flag, value()?)?,
            "--adversarial-secs" => {
                parsed.adversarial_duration = Duration::from_secs(positive(flag, value()?)?);
            }
            "--resent-history-bytes" => {
                parsed.resent_history_bytes = parse_count(flag, value()?)?;
            }
            "--drain-timeout-secs" => {
                parsed.drain_timeout = Duration::from_secs(positive(flag, value()?)?);
            }
            "--out" => {
                parsed.out_dir = PathBuf::from(value()?);
                out_given = true;
            }
            _ => return Err(format!("unknown option {flag:?}; see --help")),
        }
        i += if takes_value { 2 } else { 1 };
    }
    let partial = parsed.sizes != DEFAULT_SIZES
        || parsed.scenarios != Scenario::ALL
        || parsed.systems != Backend::ALL
        || parsed.busy_cores
        || parsed.resent_history_bytes > 0;
    if partial && !parsed.quick && !out_given {
        parsed.out_dir = PathBuf::from("target/bench-partial");
    }
    Ok(parsed)
}

fn list(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|v| !v.is_empty())
}

fn positive(flag: &str, value: &str) -> Result<u64, String> {
    match value.replace('_', "").parse::<u64>() {
        Ok(0) => Err(format!("{flag} must be at least 1")),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{flag}: {value:?} is not a whole number")),
    }
}

/// `100`, `10k` (10,000), `50_000`.
fn parse_count(flag: &str, value: &str) -> Result<u64, String> {
    let lower = value.to_ascii_lowercase().replace('_', "");
    let (digits, unit) = match lower.strip_suffix('k') {
        Some(digits) => (digits.to_owned(), 1_000),
        None => (lower.clone(), 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0)
        .and_then(|n| n.checked_mul(unit))
        .ok_or_else(|| format!("{flag}: {value:?}: expected e.g. 100, 10000 or 10k"))
}
