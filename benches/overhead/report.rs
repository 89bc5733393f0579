//! What one run measured, and how it is reported: the markdown tables, the targets of issue 8
//! and the comparison with LiteLLM. Pure (no processes, no clock), so it has unit tests
//! (`tests/bench_harness.rs`).

use std::fmt::Write as _;

use serde::Serialize;

/// The latency percentiles every table reports.
pub const PERCENTILES: [f64; 4] = [50.0, 90.0, 99.0, 99.9];

/// A run counts as sustained below this error rate...
pub const MAX_ERROR_RATE: f64 = 0.01;
/// ...and when it completed at least this share of the offered rate.
pub const MIN_THROUGHPUT_SHARE: f64 = 0.95;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum System {
    Direct,
    /// A bare hyper pass-through (`engram-mock --forward`): what one more hop costs on this
    /// machine, the floor for engram's added latency.
    Floor,
    Off,
    Embedded,
    Redis,
    Litellm,
}

impl System {
    pub const ALL: [System; 6] = [
        System::Direct,
        System::Floor,
        System::Off,
        System::Embedded,
        System::Redis,
        System::Litellm,
    ];

    pub fn name(self) -> &'static str {
        match self {
            System::Direct => "direct",
            System::Floor => "floor",
            System::Off => "off",
            System::Embedded => "embedded",
            System::Redis => "redis",
            System::Litellm => "litellm",
        }
    }

    pub fn label(self) -> &'static str {
        match self {
            System::Direct => "direct (absolute)",
            System::Floor => "bare hyper pass-through (the floor)",
            System::Off => "engram, memory off",
            System::Embedded => "engram, memory on (embedded)",
            System::Redis => "engram, memory on (Redis)",
            System::Litellm => "LiteLLM proxy",
        }
    }

    pub fn parse(name: &str) -> Option<System> {
        System::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Requests carry a user, so engram reads, injects and records memory.
    pub fn memory(self) -> bool {
        matches!(self, System::Embedded | System::Redis)
    }

    pub fn is_engram(self) -> bool {
        matches!(self, System::Off | System::Embedded | System::Redis)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scenario {
    /// Non-streaming, open loop at stepped rates.
    Rates,
    /// Non-streaming, closed loop: the most a system completes.
    Saturation,
    /// Streaming, time to first chunk.
    Stream,
    /// Large request bodies.
    Body,
    /// Many streams open at once against a slow upstream.
    Inflight,
}

impl Scenario {
    pub const ALL: [Scenario; 5] = [
        Scenario::Rates,
        Scenario::Saturation,
        Scenario::Stream,
        Scenario::Body,
        Scenario::Inflight,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Scenario::Rates => "rates",
            Scenario::Saturation => "saturation",
            Scenario::Stream => "stream",
            Scenario::Body => "body",
            Scenario::Inflight => "inflight",
        }
    }

    pub fn parse(name: &str) -> Option<Scenario> {
        Scenario::ALL.into_iter().find(|s| s.name() == name)
    }

    /// Streams report time to first chunk as their latency.
    pub fn streams(self) -> bool {
        matches!(self, Scenario::Stream | Scenario::Inflight)
    }
}

/// One system measured at one step of a scenario.
#[derive(Debug, Clone, Serialize)]
pub struct Measurement {
    pub system: System,
    pub scenario: Scenario,
    /// The step within the scenario, e.g. "1,000 req/s" or "100 KB at 50 req/s".
    pub load: String,
    /// Offered rate of an open-loop run (req/s); `None` for the closed-loop saturation run.
    pub offered_rate: Option<f64>,
    pub generator: String,
    /// p50/p90/p99/p99.9 in µs: with oha from when each request was due (latency correction),
    /// with the built-in client from when it went out (see `load::open_loop`); for streams, to
    /// the first body chunk.
    pub latency_us: [f64; 4],
    /// Streams only: the whole stream.
    pub stream_us: Option<[f64; 4]>,
    /// Completed requests per second.
    pub throughput: f64,
    pub ok: u64,
    pub errors: u64,
    /// Connections of a closed-loop run.
    pub connections: Option<usize>,
    /// Peak resident set of the system's processes (MiB); `None` for direct.
    pub peak_rss_mib: Option<f64>,
    /// CPU seconds (user + system) of the system's processes per 1,000 completed requests.
    pub cpu_per_1k: Option<f64>,
    pub notes: Vec<String>,
    /// Why it was not run, if it was not.
    pub skipped: Option<String>,
    /// The paired direct baseline: the same load sent straight to the mock during this run,
    /// which `Report::added` subtracts. `None` for direct itself, the closed loop, and runs
    /// without pairing (`--no-pairing`); those are compared with the step's direct run.
    pub baseline: Option<Baseline>,
}

/// What the paired direct baseline saw: requests straight to the mock, over the same seconds
/// as the system's.
#[derive(Debug, Clone, Serialize)]
pub struct Baseline {
    /// p50/p90/p99/p99.9 in µs, counted as the measurement's own `latency_us`.
    pub latency_us: [f64; 4],
    /// Streams only: the whole stream.
    pub stream_us: Option<[f64; 4]>,
    pub throughput: f64,
    pub ok: u64,
    pub errors: u64,
    pub notes: Vec<String>,
}

impl Measurement {
    pub fn new(system: System, scenario: Scenario, load: &str) -> Measurement {
        Measurement {
            system,
            scenario,
            load: load.to_owned(),
            offered_rate: None,
            generator: String::new(),
            latency_us: [f64::NAN; 4],
            stream_us: None,
            throughput: 0.0,
            ok: 0,
            errors: 0,
            connections: None,
            peak_rss_mib: None,
            cpu_per_1k: None,
            notes: Vec::new(),
            skipped: None,
            baseline: None,
        }
    }

    pub fn skipped(system: System, scenario: Scenario, load: &str, why: &str) -> Measurement {
        Measurement {
            skipped: Some(why.to_owned()),
            ..Measurement::new(system, scenario, load)
        }
    }

    /// `None` when the system kept up with the load; otherwise why its numbers mean nothing.
    pub fn saturation(&self) -> Option<String> {
        if let Some(why) = &self.skipped {
            return Some(why.clone());
        }
        fell_behind(self.ok, self.errors, self.throughput, self.offered_rate)
    }

    pub fn sustained(&self) -> bool {
        self.saturation().is_none()
    }

    /// The paired baseline kept up with the same offered rate: the mock and the generator were
    /// not overloaded while this system ran.
    pub fn baseline_sustained(&self) -> bool {
        self.baseline
            .as_ref()
            .is_some_and(|b| fell_behind(b.ok, b.errors, b.throughput, self.offered_rate).is_none())
    }
}

fn error_rate(ok: u64, errors: u64) -> f64 {
    let total = ok + errors;
    if total == 0 {
        1.0
    } else {
        errors as f64 / total as f64
    }
}

/// Why a run did not keep up with its offered rate, if it did not.
fn fell_behind(ok: u64, errors: u64, throughput: f64, offered: Option<f64>) -> Option<String> {
    if ok == 0 {
        return Some("no successful request".into());
    }
    let error_rate = error_rate(ok, errors);
    if error_rate >= MAX_ERROR_RATE {
        return Some(format!("saturated: {:.1} % errors", error_rate * 100.0));
    }
    match offered {
        Some(offered) if throughput < offered * MIN_THROUGHPUT_SHARE => Some(format!(
            "saturated: {} of {} req/s",
            thousands(throughput),
            thousands(offered)
        )),
        _ => None,
    }
}

/// Percentile of sorted samples (nearest rank); NaN when there are none.
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

pub fn percentiles(sorted: &[f64]) -> [f64; 4] {
    PERCENTILES.map(|p| percentile(sorted, p))
}

/// `1234.4` → `1,234`.
pub fn thousands(value: f64) -> String {
    if !value.is_finite() {
        return "—".into();
    }
    let rounded = value.round() as i64;
    let digits = rounded.unsigned_abs().to_string();
    let mut out = String::new();
    for (i, digit) in digits.chars().enumerate() {
        if i > 0 && (digits.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    if rounded < 0 {
        out.insert(0, '-');
    }
    out
}

/// Microseconds as milliseconds with three decimals; `—` when unknown.
pub fn ms(us: f64) -> String {
    if us.is_finite() {
        format!("{:.3}", us / 1000.0)
    } else {
        "—".into()
    }
}

/// Bytes as the label of a body size: `100 KB`, `1 MB`, `512 B`.
pub fn size_label(bytes: usize) -> String {
    if bytes >= 1_000_000 && bytes.is_multiple_of(100_000) {
        format!("{} MB", trim_float(bytes as f64 / 1e6))
    } else if bytes >= 1_000 && bytes.is_multiple_of(100) {
        format!("{} KB", trim_float(bytes as f64 / 1e3))
    } else {
        format!("{bytes} B")
    }
}

fn trim_float(value: f64) -> String {
    let text = format!("{value:.1}");
    text.strip_suffix(".0").unwrap_or(&text).to_owned()
}

pub fn rate_label(rate: u64) -> String {
    format!("{} req/s", thousands(rate as f64))
}

/// Everything one run measured, and the context needed to read it.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Machine, pinning, command: printed above the tables.
    pub context: Vec<String>,
    pub measurements: Vec<Measurement>,
}

/// Target of issue 8: engram's added p99 at least this many times lower than LiteLLM's.
pub const LITELLM_FACTOR: f64 = 10.0;

impl Report {
    /// The direct run of the same step, measured alone before the other systems.
    pub fn direct_for(&self, m: &Measurement) -> Option<&Measurement> {
        self.measurements
            .iter()
            .find(|d| d.system == System::Direct && d.scenario == m.scenario && d.load == m.load)
    }

    /// What `m` is compared with, as (latency, whole stream): its paired baseline when it has
    /// one, else the step's direct run; `None` when that did not keep up with the load.
    fn baseline_of(&self, m: &Measurement) -> Option<([f64; 4], Option<[f64; 4]>)> {
        if let Some(baseline) = &m.baseline {
            return m
                .baseline_sustained()
                .then_some((baseline.latency_us, baseline.stream_us));
        }
        let direct = self.direct_for(m)?;
        direct
            .sustained()
            .then_some((direct.latency_us, direct.stream_us))
    }

    /// Latency added over direct, per percentile (µs), when both kept up with the load: over
    /// the paired baseline when `m` has one, else over the step's direct run.
    pub fn added(&self, m: &Measurement) -> Option<[f64; 4]> {
        if !m.sustained() || m.system == System::Direct {
            return None;
        }
        let (base, _) = self.baseline_of(m)?;
        Some(std::array::from_fn(|i| m.latency_us[i] - base[i]))
    }

    pub fn added_stream(&self, m: &Measurement) -> Option<[f64; 4]> {
        if !m.sustained() || m.system == System::Direct {
            return None;
        }
        let (Some(mine), (_, Some(base))) = (m.stream_us, self.baseline_of(m)?) else {
            return None;
        };
        Some(std::array::from_fn(|i| mine[i] - base[i]))
    }

    fn in_scenario(&self, scenario: Scenario) -> impl Iterator<Item = &Measurement> {
        self.measurements
            .iter()
            .filter(move |m| m.scenario == scenario)
    }

    pub fn markdown(&self) -> String {
        let mut out = String::from("# engram overhead benchmark\n\n");
        for line in &self.context {
            let _ = writeln!(out, "- {line}");
        }
        out.push_str(
            "\nLatencies in ms, open loop: with oha counted from when each request was due \
             (latency correction), with the built-in client from when it went out (its timer \
             sends about 1 ms late; the notes say how late). Rows of engram and LiteLLM show \
             the latency **added over direct**: their percentile less that of a paired direct \
             baseline, the same load sent straight to the mock during the same run (the built-in \
             client sends each baseline request half an interval after the system's; with oha a \
             second oha runs alongside). Each row's notes give its baseline; a row without one \
             is compared with the step's direct row. The direct row shows direct's absolute \
             latency, measured alone. A system that did not keep up (errors ≥ 1 %, or under 95 % \
             of the offered rate) is reported as saturated, without latency figures; so is a row \
             whose baseline did not keep up (\"baseline saturated\").\n",
        );
        for scenario in Scenario::ALL {
            if self.in_scenario(scenario).next().is_none() {
                continue;
            }
            out.push('\n');
            match scenario {
                Scenario::Saturation => self.saturation_table(&mut out),
                _ => self.latency_table(scenario, &mut out),
            }
        }
        out.push_str("\n## Against the targets of issue 8\n\n");
        for line in self.targets() {
            let _ = writeln!(out, "- {line}");
        }
        out.push_str("\n## engram against LiteLLM: added p99\n\n");
        out.push_str(&self.litellm_comparison());
        out
    }

    fn latency_table(&self, scenario: Scenario, out: &mut String) {
        let (title, first, what) = match scenario {
            Scenario::Rates => (
                "Non-streaming, stepped rates",
                "offered rate",
                "full response",
            ),
            Scenario::Stream => ("Streaming", "offered rate", "time to first chunk"),
            Scenario::Body => (
                "Large request bodies, non-streaming",
                "body",
                "full response",
            ),
            _ => (
                "Many streams in flight against a slow upstream",
                "load",
                "time to first chunk",
            ),
        };
        let generator = self
            .in_scenario(scenario)
            .find(|m| !m.generator.is_empty())
            .map_or("", |m| m.generator.as_str());
        let _ = writeln!(out, "## {title} ({what}; {generator})\n");
        let stream = scenario.streams();
        let _ = write!(out, "| {first} | system | p50 | p90 | p99 | p99.9 |");
        if stream {
            out.push_str(" whole stream p99 |");
        }
        out.push_str(
            " throughput (req/s) | errors | peak RSS (MiB) | CPU s / 1,000 req | notes |\n",
        );
        let columns = 11 + usize::from(stream);
        let _ = writeln!(out, "|{}", "---|".repeat(columns));
        for m in self.in_scenario(scenario) {
            let (latency, whole) = if m.system == System::Direct && m.sustained() {
                (Some(m.latency_us), m.stream_us)
            } else {
                (self.added(m), self.added_stream(m))
            };
            let mut cells = vec![m.load.clone(), m.system.label().to_owned()];
            match (latency, m.saturation()) {
                (Some(latency), _) => cells.extend(latency.map(ms)),
                (None, Some(why)) => {
                    cells.push(why);
                    cells.extend(["".to_owned(), "".to_owned(), "".to_owned()]);
                }
                (None, None) => {
                    cells.push(if m.baseline.is_some() {
                        "baseline saturated".into()
                    } else {
                        "direct saturated".into()
                    });
                    cells.extend(["".to_owned(), "".to_owned(), "".to_owned()]);
                }
            }
            if stream {
                cells.push(whole.map_or_else(|| "—".into(), |w| ms(w[2])));
            }
            self.resource_cells(m, &mut cells);
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
    }

    fn resource_cells(&self, m: &Measurement, cells: &mut Vec<String>) {
        let ran = m.skipped.is_none();
        cells.push(if ran {
            thousands(m.throughput)
        } else {
            "—".into()
        });
        cells.push(if ran { errors_cell(m) } else { "—".into() });
        cells.push(
            m.peak_rss_mib
                .map_or_else(|| "—".into(), |r| format!("{r:.1}")),
        );
        cells.push(
            m.cpu_per_1k
                .map_or_else(|| "—".into(), |c| format!("{c:.3}")),
        );
        let mut notes = m.notes.clone();
        if let Some(note) = baseline_note(m) {
            notes.insert(0, note);
        }
        cells.push(notes.join("; "));
    }

    fn saturation_table(&self, out: &mut String) {
        let generator = self
            .in_scenario(Scenario::Saturation)
            .find(|m| !m.generator.is_empty())
            .map_or("", |m| m.generator.as_str());
        let _ = writeln!(
            out,
            "## Saturation: the most each system completes (non-streaming, closed loop; {generator})\n"
        );
        out.push_str(
            "| system | max sustained throughput (req/s) | connections | errors | p50 (absolute) | \
             p99 (absolute) | peak RSS (MiB) | CPU s / 1,000 req | notes |\n",
        );
        out.push_str("|---|---|---|---|---|---|---|---|---|\n");
        let direct = self
            .in_scenario(Scenario::Saturation)
            .find(|m| m.system == System::Direct);
        for m in self.in_scenario(Scenario::Saturation) {
            let mut notes = m.notes.clone();
            if let Some(why) = m.saturation() {
                notes.insert(0, why);
            } else if let Some(direct) = direct
                && m.system != System::Direct
                && m.throughput >= direct.throughput * 0.9
            {
                notes.insert(
                    0,
                    "≈ direct: bounded by the mock and load generator's core, not by this system"
                        .into(),
                );
            }
            let ran = m.skipped.is_none();
            let cells = [
                m.system.label().to_owned(),
                if ran {
                    thousands(m.throughput)
                } else {
                    "—".into()
                },
                m.connections.map_or_else(|| "—".into(), |c| c.to_string()),
                if ran { errors_cell(m) } else { "—".into() },
                ms(m.latency_us[0]),
                ms(m.latency_us[2]),
                m.peak_rss_mib
                    .map_or_else(|| "—".into(), |r| format!("{r:.1}")),
                m.cpu_per_1k
                    .map_or_else(|| "—".into(), |c| format!("{c:.3}")),
                notes.join("; "),
            ];
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
    }

    fn find(&self, system: System, scenario: Scenario, load: &str) -> Option<&Measurement> {
        self.measurements
            .iter()
            .find(|m| m.system == system && m.scenario == scenario && m.load == load)
    }

    /// One line per target of issue 8, each with its figure and ✓ / ✗, or why it is unknown.
    pub fn targets(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let at_1000 = rate_label(1000);
        let off = self
            .find(System::Off, Scenario::Rates, &at_1000)
            .and_then(|m| self.added(m));
        lines.push(match off {
            Some(added) => format!(
                "memory off at 1,000 req/s, added p50 < 0.3 ms: {} ms {}; added p99 < 1 ms: {} ms {}",
                ms(added[0]),
                mark(added[0] < 300.0),
                ms(added[2]),
                mark(added[2] < 1000.0)
            ),
            None => "memory off at 1,000 req/s: not measured (or saturated)".into(),
        });
        let embedded: Vec<String> = self
            .in_scenario(Scenario::Rates)
            .filter(|m| m.system == System::Embedded)
            .map(|m| match self.added(m) {
                Some(added) => {
                    format!("{} {} ms {}", m.load, ms(added[2]), mark(added[2] < 2000.0))
                }
                None => format!("{} saturated ✗", m.load),
            })
            .collect();
        lines.push(if embedded.is_empty() {
            "memory on (embedded), added p99 < 2 ms: not measured".into()
        } else {
            format!(
                "memory on (embedded), added p99 < 2 ms: {}",
                embedded.join(", ")
            )
        });
        // The inflight scenario has its own target, below.
        let off_rss = self
            .measurements
            .iter()
            .filter(|m| m.system == System::Off && m.scenario != Scenario::Inflight)
            .filter_map(|m| m.peak_rss_mib)
            .fold(None, |peak: Option<f64>, r| {
                Some(peak.map_or(r, |p| p.max(r)))
            });
        lines.push(match off_rss {
            Some(rss) => format!(
                "peak RSS, memory off, < 50 MB: {:.1} MiB ({:.1} MB) at most, over every scenario but inflight {}",
                rss,
                rss * 1.048_576,
                mark(rss * 1.048_576 < 50.0)
            ),
            None => "peak RSS, memory off: not measured".into(),
        });
        let in_flight: Vec<String> = self
            .in_scenario(Scenario::Inflight)
            .filter(|m| m.system.is_engram())
            .filter_map(|m| {
                let rss = m.peak_rss_mib?;
                Some(format!(
                    "{} {:.1} MiB {}",
                    m.system.name(),
                    rss,
                    mark(rss * 1.048_576 < 200.0 && m.sustained())
                ))
            })
            .collect();
        lines.push(if in_flight.is_empty() {
            "peak RSS with many streams in flight, < 200 MB: not measured".into()
        } else {
            format!(
                "peak RSS with the inflight scenario's streams open, < 200 MB: {}",
                in_flight.join(", ")
            )
        });
        let comparisons = self.litellm_ratios();
        lines.push(if comparisons.is_empty() {
            "added p99 ≥ 10× lower than LiteLLM's at every load LiteLLM sustains: not computable \
             (LiteLLM not measured, or it sustained none of the loads)"
                .into()
        } else {
            let misses: Vec<String> = comparisons
                .iter()
                .filter(|c| !c.met())
                .map(|c| format!("{} {} ({})", c.scenario.name(), c.load, c.system.name()))
                .collect();
            format!(
                "added p99 ≥ 10× lower than LiteLLM's at every load LiteLLM sustains ({} comparisons): {}",
                comparisons.len(),
                if misses.is_empty() {
                    "met ✓".to_owned()
                } else {
                    format!("missed at {} ✗", misses.join(", "))
                }
            )
        });
        lines
    }

    /// Every engram system against LiteLLM, at each step (closed loop aside) both sustained.
    pub fn litellm_ratios(&self) -> Vec<Comparison> {
        let mut comparisons = Vec::new();
        for peer in self
            .measurements
            .iter()
            .filter(|m| m.system == System::Litellm && m.scenario != Scenario::Saturation)
        {
            let Some(peer_added) = self.added(peer) else {
                continue;
            };
            for ours in self.measurements.iter().filter(|m| {
                m.system.is_engram() && m.scenario == peer.scenario && m.load == peer.load
            }) {
                comparisons.push(Comparison {
                    scenario: peer.scenario,
                    load: peer.load.clone(),
                    system: ours.system,
                    litellm_p99_us: peer_added[2],
                    engram_p99_us: self.added(ours).map(|a| a[2]),
                });
            }
        }
        comparisons
    }

    fn litellm_comparison(&self) -> String {
        let comparisons = self.litellm_ratios();
        if comparisons.is_empty() {
            return "LiteLLM was not measured, or it sustained none of the loads: nothing to \
                    compare.\n"
                .into();
        }
        let mut out = String::from(
            "At every step LiteLLM sustained (closed-loop saturation aside), its added p99 against \
             each engram configuration's. Target: engram's at least 10× lower.\n\n\
             | scenario | load | LiteLLM added p99 (ms) | engram system | engram added p99 (ms) | \
             LiteLLM ÷ engram | ≥ 10× |\n|---|---|---|---|---|---|---|\n",
        );
        for c in &comparisons {
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                c.scenario.name(),
                c.load,
                ms(c.litellm_p99_us),
                c.system.label(),
                c.engram_p99_us.map_or_else(|| "saturated".into(), ms),
                c.ratio_label(),
                mark(c.met())
            );
        }
        out
    }
}

/// engram's added p99 against LiteLLM's at one step.
#[derive(Debug, Clone)]
pub struct Comparison {
    pub scenario: Scenario,
    pub load: String,
    pub system: System,
    pub litellm_p99_us: f64,
    /// `None` when engram did not sustain a load LiteLLM did.
    pub engram_p99_us: Option<f64>,
}

impl Comparison {
    /// An added latency at or below zero (within noise of direct) meets any factor.
    pub fn met(&self) -> bool {
        self.engram_p99_us
            .is_some_and(|ours| ours.max(0.0) * LITELLM_FACTOR <= self.litellm_p99_us)
    }

    pub fn ratio_label(&self) -> String {
        match self.engram_p99_us {
            None => "—".into(),
            Some(ours) if ours <= 0.0 => "∞ (engram within noise of direct)".into(),
            Some(ours) => format!("{:.0}×", self.litellm_p99_us / ours),
        }
    }
}

/// Which baseline a row's added figures are over: its paired one, with its p50/p99 and how many
/// requests they rest on, or the step's direct run.
pub fn baseline_note(m: &Measurement) -> Option<String> {
    if m.system == System::Direct || m.skipped.is_some() {
        return None;
    }
    let Some(b) = &m.baseline else {
        return m
            .sustained()
            .then(|| "no paired baseline: added over the step's direct row".into());
    };
    let errors = if b.errors > 0 {
        format!(", {} errors", thousands(b.errors as f64))
    } else {
        String::new()
    };
    Some(format!(
        "paired direct baseline: p50/p99 {} / {} ms ({} requests{errors})",
        ms(b.latency_us[0]),
        ms(b.latency_us[2]),
        thousands(b.ok as f64),
    ))
}

/// Errors out of all requests: the count also says how many samples the percentiles rest on.
fn errors_cell(m: &Measurement) -> String {
    format!(
        "{} of {}",
        thousands(m.errors as f64),
        thousands((m.ok + m.errors) as f64)
    )
}

fn mark(met: bool) -> &'static str {
    if met { "✓" } else { "✗" }
}
