//! What the history benchmark measured, and how it is reported: the markdown tables and the
//! targets of issue 26 (shown as met or missed, never asserted). Pure: no processes, no clock.

use std::fmt::Write as _;

use serde::Serialize;

use crate::args::Backend;
use crate::preload::Preload;
use crate::report::{MAX_ERROR_RATE, MIN_THROUGHPUT_SHARE, ms, thousands};
use crate::scrape::Quantile;

/// Targets of issue 26.
pub const TARGET_ADDED_P99_MS: f64 = 1.0;
pub const TARGET_RATE: u64 = 200;
pub const TARGET_SIZE: u64 = 50_000;
pub const TARGET_SMALL_SIZE: u64 = 100;
pub const TARGET_GROWTH_MS: f64 = 0.2;
pub const TARGET_APPLY_P99_MS: f64 = 5.0;
pub const TARGET_LAG_P99_S: f64 = 1.0;
pub const TARGET_RSS_MB: f64 = 150.0;

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// Machine, commit, method: printed above the tables.
    pub context: Vec<String>,
    pub rate: u64,
    pub duration_secs: u64,
    pub adversarial_rate: u64,
    pub adversarial_secs: u64,
    /// A bare pass-through at the sizes' rate, measured before them.
    pub floor: Option<Floor>,
    pub sizes: Vec<SizeResult>,
    pub adversarial: Vec<AdversarialResult>,
}

/// One history size: its preload and its measured run.
#[derive(Debug, Clone, Serialize)]
pub struct SizeResult {
    pub turns: u64,
    pub preload: Option<Preload>,
    /// Why there is no measured run, if there is none.
    pub skipped: Option<String>,
    pub run: Option<Run>,
}

/// A bare hyper pass-through on engram's core (`engram-mock --forward`), at the sizes' rate,
/// with its own paired direct baseline: what one more hop costs on this machine.
#[derive(Debug, Clone, Serialize)]
pub struct Floor {
    pub offered_rate: u64,
    pub duration_secs: u64,
    /// p50/p90/p99/p99.9 in µs (oha, latency correction).
    pub latency_us: [f64; 4],
    pub baseline_us: Option<[f64; 4]>,
    pub ok: u64,
    pub errors: u64,
}

impl Floor {
    /// Latency added over the paired baseline, per percentile, in µs.
    pub fn added_us(&self) -> Option<[f64; 4]> {
        added_over(&self.latency_us, self.baseline_us)
    }

    /// One line: the rate, the length, the added p50 / p99 and the errors.
    pub fn summary(&self) -> String {
        let added = self.added_us().map_or_else(
            || "no paired baseline".to_owned(),
            |added| format!("added p50 / p99 {} / {} ms", ms(added[0]), ms(added[2])),
        );
        format!(
            "bare pass-through at {} for {} s: {added}, {} errors of {}",
            crate::report::rate_label(self.offered_rate),
            self.duration_secs,
            thousands(self.errors as f64),
            thousands((self.ok + self.errors) as f64)
        )
    }
}

/// `latency` less `baseline`, per percentile; `None` without a baseline.
fn added_over(latency: &[f64; 4], baseline: Option<[f64; 4]>) -> Option<[f64; 4]> {
    let baseline = baseline?;
    Some(std::array::from_fn(|i| latency[i] - baseline[i]))
}

/// The adversarial case on one store.
#[derive(Debug, Clone, Serialize)]
pub struct AdversarialResult {
    pub system: Backend,
    pub skipped: Option<String>,
    pub run: Option<Run>,
}

/// Bytes the store read and wrote during a run (`engram_store_bytes_total`), split between the
/// hot path (per chat request) and the worker (per applied job).
#[derive(Debug, Clone, Serialize)]
pub struct StoreBytes {
    pub per_request_read: f64,
    pub per_request_written: f64,
    pub per_job_read: f64,
    pub per_job_written: f64,
    /// (operation, bytes read, bytes written) over the run.
    pub by_operation: Vec<(String, f64, f64)>,
}

/// One measured open-loop run against engram, with its paired direct baseline, and what
/// engram's `/metrics` said about it.
#[derive(Debug, Clone, Serialize)]
pub struct Run {
    pub offered_rate: u64,
    pub duration_secs: u64,
    /// engram's p50/p90/p99/p99.9 in µs (oha, latency correction).
    pub latency_us: [f64; 4],
    /// The paired direct baseline's, when it ran.
    pub baseline_us: Option<[f64; 4]>,
    pub baseline_ok: u64,
    pub baseline_errors: u64,
    pub baseline_throughput: f64,
    pub throughput: f64,
    pub ok: u64,
    pub errors: u64,
    /// Chat completions engram counted over the run (`engram_requests_total`).
    pub chat_requests: Option<u64>,
    /// `engram_memory_fail_open_total`, all reasons, over the run.
    pub fail_opens: Option<u64>,
    pub fail_open_reasons: Vec<(String, u64)>,
    /// Answers with `x-engram-memory: degraded` (`engram_requests_total{memory="degraded"}`).
    pub degraded: Option<u64>,
    /// Answers with `x-engram-memory: injected`.
    pub injected: Option<u64>,
    /// Jobs applied from the scrape before the run to the one after the queue drained.
    pub jobs_applied: Option<u64>,
    /// Runs the worker committed over the same span (`engram_worker_runs_total`), when engram
    /// exports it: `jobs_applied` over this is the mean run length.
    pub runs: Option<u64>,
    /// `engram_worker_apply_seconds`, when engram exports it.
    pub apply_p50: Option<Quantile>,
    pub apply_p99: Option<Quantile>,
    /// Share of applies at or under the target, when it is a bucket bound.
    pub apply_within_target: Option<f64>,
    /// `engram_job_lag_seconds`, counting the jobs never applied (`still_queued`).
    pub lag_p50: Option<Quantile>,
    pub lag_p99: Option<Quantile>,
    pub lag_max: Option<Quantile>,
    /// Jobs whose lag was observed.
    pub lag_observed: u64,
    /// Share of the run's jobs (observed, plus any still queued, counted as late) whose lag
    /// was at most the target.
    pub lag_within_target: Option<f64>,
    pub store_bytes: Option<StoreBytes>,
    /// Jobs queued or leased when the load stopped (`engram_queue_depth`).
    pub queue_depth_end: Option<u64>,
    /// Seconds from the end of the load to an empty queue, or `None` when it did not empty
    /// within the drain timeout.
    pub drained_secs: Option<f64>,
    /// Jobs still queued when the drain wait gave up: their lag is unobserved, and at least
    /// `unobserved_lag_at_least` seconds (from the end of the load to the last scrape). The
    /// lag quantiles count them.
    pub still_queued: Option<u64>,
    pub unobserved_lag_at_least: f64,
    pub drain_timeout_secs: u64,
    pub peak_rss_mib: Option<f64>,
    /// CPU seconds of the engram process per 1,000 answered requests, drain included.
    pub cpu_per_1k: Option<f64>,
    /// `engram_memory_phase_seconds` over the run, by phase, then the store's `enqueue` and
    /// `commit_jobs` (`engram_store_operation_duration_seconds`), those engram exports.
    pub phases: Vec<Phase>,
    pub notes: Vec<String>,
}

/// One phase of the requests' time over a run (`engram_memory_phase_seconds{phase}`), or one
/// of the store's commits (`store enqueue`, `store commit_jobs`).
#[derive(Debug, Clone, Serialize)]
pub struct Phase {
    /// The phase's label, or `store ` and the operation's.
    pub phase: String,
    pub p50: Option<Quantile>,
    pub p99: Option<Quantile>,
}

impl Run {
    /// Added latency over the paired baseline per percentile (µs), when both kept up.
    pub fn added_us(&self) -> Option<[f64; 4]> {
        if self.saturation().is_some() || self.baseline_saturation().is_some() {
            return None;
        }
        self.raw_added_us()
    }

    /// Added latency whatever the load did (for the JSON and for runs that fell behind).
    pub fn raw_added_us(&self) -> Option<[f64; 4]> {
        added_over(&self.latency_us, self.baseline_us)
    }

    /// Why engram did not keep up with the offered rate, if it did not.
    pub fn saturation(&self) -> Option<String> {
        fell_behind(self.ok, self.errors, self.throughput, self.offered_rate)
    }

    pub fn baseline_saturation(&self) -> Option<String> {
        match self.baseline_us {
            None => Some("no paired baseline".into()),
            Some(_) => fell_behind(
                self.baseline_ok,
                self.baseline_errors,
                self.baseline_throughput,
                self.offered_rate,
            ),
        }
    }

    pub fn peak_rss_mb(&self) -> Option<f64> {
        self.peak_rss_mib.map(|mib| mib * 1.048_576)
    }
}

fn fell_behind(ok: u64, errors: u64, throughput: f64, offered: u64) -> Option<String> {
    if ok == 0 {
        return Some("no successful request".into());
    }
    let error_rate = errors as f64 / (ok + errors) as f64;
    if error_rate >= MAX_ERROR_RATE {
        return Some(format!("{:.1} % errors", error_rate * 100.0));
    }
    (throughput < offered as f64 * MIN_THROUGHPUT_SHARE).then(|| {
        format!(
            "did not keep up: {} of {} req/s",
            thousands(throughput),
            thousands(offered as f64)
        )
    })
}

/// A histogram quantile as the bucket it falls in: `≤ upper` (or `> lower` past the largest
/// bound), in the histogram's unit times `scale`, with `decimals`.
fn bucket_label(q: Option<Quantile>, scale: f64, decimals: usize) -> String {
    match q {
        None => "n/a".into(),
        Some(q) if q.is_open() => format!("> {:.*}", decimals, q.lower * scale),
        Some(q) => format!("≤ {:.*}", decimals, q.upper * scale),
    }
}

/// Seconds as milliseconds.
pub fn q_ms(q: Option<Quantile>) -> String {
    bucket_label(q, 1000.0, 3)
}

/// Seconds.
pub fn q_s(q: Option<Quantile>) -> String {
    bucket_label(q, 1.0, 2)
}

/// `512 B`, `12.3 KB`, `4.56 MB` (decimal units).
pub fn bytes_label(bytes: f64) -> String {
    if !bytes.is_finite() {
        "—".into()
    } else if bytes >= 1e6 {
        format!("{:.2} MB", bytes / 1e6)
    } else if bytes >= 1e3 {
        format!("{:.1} KB", bytes / 1e3)
    } else {
        format!("{bytes:.0} B")
    }
}

fn mark(met: bool) -> &'static str {
    if met { "met ✓" } else { "missed ✗" }
}

fn opt_count(value: Option<u64>) -> String {
    value.map_or_else(|| "n/a".into(), |v| thousands(v as f64))
}

impl Report {
    fn size(&self, turns: u64) -> Option<&SizeResult> {
        self.sizes.iter().find(|s| s.turns == turns)
    }

    pub fn markdown(&self) -> String {
        let mut out = String::from("# engram history benchmark (issue 26)\n\n");
        for line in &self.context {
            let _ = writeln!(out, "- {line}");
        }
        if !self.sizes.is_empty() {
            self.sizes_table(&mut out);
        }
        if !self.adversarial.is_empty() {
            self.adversarial_table(&mut out);
        }
        self.store_bytes_section(&mut out);
        out.push_str("\n## Against the targets of issue 26\n\n");
        for line in self.targets() {
            let _ = writeln!(out, "- {line}");
        }
        out
    }

    fn sizes_table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\n## History sizes: one user at {} for {} s (embedded store, non-streaming, oha open loop)\n",
            crate::report::rate_label(self.rate),
            self.duration_secs
        );
        out.push_str(
            "Added latency in ms: engram's percentile less its paired direct baseline's. Worker \
             apply and job lag come from histograms on engram's /metrics, so each is shown as \
             the upper bound of the bucket it falls in (`≤`; `>` past the largest bound, or for \
             jobs not applied when the queue was last read); the JSON has Prometheus-style \
             estimates within the bucket. n/a where engram does not export the metric. Store \
             bytes: hot-path operations per chat request, the worker's per applied job.\n\n",
        );
        out.push_str(
            "| history (turns) | preload | added p50 | added p99 | throughput (req/s) | errors | \
             fail-opens | degraded answers | worker apply p50 / p99 (ms) | store read / written \
             per request | per job | job lag p50 / p99 (s) | peak RSS (MiB) | notes |\n",
        );
        let _ = writeln!(out, "|{}", "---|".repeat(14));
        for size in &self.sizes {
            let preload = match &size.preload {
                Some(p) if p.gave_up.is_none() => format!(
                    "{:.1} s, {} jobs/s ({} jobs/s at the end)",
                    p.secs,
                    thousands(p.rate),
                    thousands(p.final_rate)
                ),
                Some(p) => format!(
                    "gave up at {} of {} turns ({:.0} s)",
                    thousands(p.applied as f64),
                    thousands(p.turns as f64),
                    p.secs
                ),
                None => "—".into(),
            };
            let mut cells = vec![thousands(size.turns as f64), preload];
            match &size.run {
                Some(run) => {
                    run_cells(run, &mut cells);
                    cells.push(format!("{} / {}", q_ms(run.apply_p50), q_ms(run.apply_p99)));
                    cells.push(run.store_bytes.as_ref().map_or_else(
                        || "n/a".into(),
                        |b| {
                            format!(
                                "{} / {}",
                                bytes_label(b.per_request_read),
                                bytes_label(b.per_request_written)
                            )
                        },
                    ));
                    cells.push(run.store_bytes.as_ref().map_or_else(
                        || "n/a".into(),
                        |b| {
                            format!(
                                "{} / {}",
                                bytes_label(b.per_job_read),
                                bytes_label(b.per_job_written)
                            )
                        },
                    ));
                    cells.push(format!("{} / {}", q_s(run.lag_p50), q_s(run.lag_p99)));
                    cells.push(
                        run.peak_rss_mib
                            .map_or_else(|| "—".into(), |r| format!("{r:.1}")),
                    );
                    cells.push(notes(run, false));
                }
                None => {
                    cells.push(
                        size.skipped
                            .clone()
                            .unwrap_or_else(|| "not measured".into()),
                    );
                    cells.extend(std::iter::repeat_n(String::new(), 11));
                }
            }
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
        if let Some(floor) = &self.floor {
            let _ = writeln!(
                out,
                "\nThe floor, measured before the sizes: a {} (`engram-mock --forward`, one \
                 thread on engram's core, the same bodies): one more hop on this machine, which \
                 every added figure above includes.",
                floor.summary()
            );
        }
    }

    fn adversarial_table(&self, out: &mut String) {
        let _ = writeln!(
            out,
            "\n## Adversarial: one user at {} for {} s from an empty store (non-streaming, oha open loop)\n",
            crate::report::rate_label(self.adversarial_rate),
            self.adversarial_secs
        );
        out.push_str(
            "| store | added p50 | added p99 | throughput (req/s) | errors | fail-opens | \
             degraded answers | job lag p50 / p99 / max (s) | queue depth at end | drained | \
             peak RSS (MiB) | notes |\n",
        );
        let _ = writeln!(out, "|{}", "---|".repeat(12));
        for a in &self.adversarial {
            let mut cells = vec![a.system.name().to_owned()];
            match &a.run {
                Some(run) => {
                    run_cells(run, &mut cells);
                    cells.push(format!(
                        "{} / {} / {}",
                        q_s(run.lag_p50),
                        q_s(run.lag_p99),
                        q_s(run.lag_max)
                    ));
                    cells.push(opt_count(run.queue_depth_end));
                    cells.push(drained_cell(run));
                    cells.push(
                        run.peak_rss_mib
                            .map_or_else(|| "—".into(), |r| format!("{r:.1}")),
                    );
                    cells.push(notes(run, true));
                }
                None => {
                    cells.push(a.skipped.clone().unwrap_or_else(|| "not measured".into()));
                    cells.extend(std::iter::repeat_n(String::new(), 10));
                }
            }
            let _ = writeln!(out, "| {} |", cells.join(" | "));
        }
    }

    /// Bytes by store operation, for the runs where engram exports them.
    fn store_bytes_section(&self, out: &mut String) {
        let runs: Vec<(String, &Run)> = self
            .sizes
            .iter()
            .filter_map(|s| {
                s.run
                    .as_ref()
                    .map(|r| (format!("{} turns", thousands(s.turns as f64)), r))
            })
            .chain(self.adversarial.iter().filter_map(|a| {
                a.run
                    .as_ref()
                    .map(|r| (format!("adversarial, {}", a.system.name()), r))
            }))
            .filter(|(_, r)| r.store_bytes.is_some())
            .collect();
        if runs.is_empty() {
            return;
        }
        out.push_str(
            "\n## Store bytes by operation (read / written over the run, drain included)\n\n",
        );
        for (label, run) in runs {
            let Some(bytes) = &run.store_bytes else {
                continue;
            };
            let parts: Vec<String> = bytes
                .by_operation
                .iter()
                .filter(|(_, r, w)| *r > 0.0 || *w > 0.0)
                .map(|(op, r, w)| format!("{op} {} / {}", bytes_label(*r), bytes_label(*w)))
                .collect();
            let _ = writeln!(out, "- {label}: {}", parts.join(", "));
        }
    }

    /// One line per target of issue 26, with its figure and met / missed, or why it is unknown.
    pub fn targets(&self) -> Vec<String> {
        let mut lines = Vec::new();
        let p99_of = |turns: u64| -> Result<f64, String> {
            let size = self
                .size(turns)
                .ok_or_else(|| format!("{} turns not in --sizes", thousands(turns as f64)))?;
            let run = size.run.as_ref().ok_or_else(|| {
                size.skipped
                    .clone()
                    .unwrap_or_else(|| "not measured".into())
            })?;
            match run.added_us() {
                Some(added) => Ok(added[2] / 1000.0),
                None => Err(run
                    .saturation()
                    .or_else(|| run.baseline_saturation().map(|b| format!("baseline: {b}")))
                    .unwrap_or_else(|| "no figure".into())),
            }
        };
        let at_rate = self.rate == TARGET_RATE;
        let rate_note = if at_rate {
            String::new()
        } else {
            format!(
                " (this run offered {}, not {TARGET_RATE} req/s)",
                crate::report::rate_label(self.rate)
            )
        };
        let big = p99_of(TARGET_SIZE);
        let floor_note = self
            .floor
            .as_ref()
            .and_then(Floor::added_us)
            .map(|added| {
                format!(
                    " (a bare pass-through adds {} ms at p99 here)",
                    ms(added[2])
                )
            })
            .unwrap_or_default();
        lines.push(match &big {
            Ok(p99) => format!(
                "added p99 ≤ {TARGET_ADDED_P99_MS} ms at {TARGET_RATE} req/s with {} turns: {p99:.3} ms, {}{rate_note}{floor_note}",
                thousands(TARGET_SIZE as f64),
                mark(*p99 <= TARGET_ADDED_P99_MS && at_rate)
            ),
            Err(why) if why.starts_with("did not keep up") || why.contains("errors") => format!(
                "added p99 ≤ {TARGET_ADDED_P99_MS} ms at {TARGET_RATE} req/s with {} turns: {why}, {}{floor_note}",
                thousands(TARGET_SIZE as f64),
                mark(false)
            ),
            Err(why) => format!(
                "added p99 ≤ {TARGET_ADDED_P99_MS} ms at {TARGET_RATE} req/s with {} turns: not measured ({why}){floor_note}",
                thousands(TARGET_SIZE as f64)
            ),
        });
        let small = p99_of(TARGET_SMALL_SIZE);
        lines.push(match (&big, &small) {
            (Ok(big), Ok(small)) => format!(
                "added p99 with {} turns within {TARGET_GROWTH_MS} ms of {} turns': {big:.3} against {small:.3} ms ({:+.3} ms), {}{rate_note}",
                thousands(TARGET_SIZE as f64),
                thousands(TARGET_SMALL_SIZE as f64),
                big - small,
                mark(big - small <= TARGET_GROWTH_MS && at_rate)
            ),
            (Err(why), _) | (_, Err(why)) => format!(
                "added p99 with {} turns within {TARGET_GROWTH_MS} ms of {} turns': not computable ({why})",
                thousands(TARGET_SIZE as f64),
                thousands(TARGET_SMALL_SIZE as f64)
            ),
        });
        let applies: Vec<(u64, Option<Quantile>)> = self
            .sizes
            .iter()
            .filter_map(|s| s.run.as_ref().map(|r| (s.turns, r.apply_p99)))
            .collect();
        lines.push(if applies.is_empty() {
            format!("worker apply p99 ≤ {TARGET_APPLY_P99_MS} ms at every size: not measured")
        } else if applies.iter().all(|(_, q)| q.is_none()) {
            format!(
                "worker apply p99 ≤ {TARGET_APPLY_P99_MS} ms at every size: n/a (engram does not export engram_worker_apply_seconds)"
            )
        } else {
            let target = TARGET_APPLY_P99_MS / 1000.0;
            // Met when the bucket lies under the target, missed when over it; when the target
            // falls inside the bucket, the estimate decides.
            let within = |q: &Quantile| {
                q.upper <= target || (q.lower < target && !q.is_open() && q.estimate <= target)
            };
            let all = applies.iter().all(|(_, q)| q.as_ref().is_some_and(within));
            let unmeasured = self.sizes.iter().any(|s| s.run.is_none());
            let parts: Vec<String> = applies
                .iter()
                .map(|(turns, q)| format!("{} turns {} ms", thousands(*turns as f64), q_ms(*q)))
                .collect();
            format!(
                "worker apply p99 ≤ {TARGET_APPLY_P99_MS} ms at every size: {}, {}{}",
                parts.join(", "),
                mark(all),
                if unmeasured {
                    " (of the sizes measured)"
                } else {
                    ""
                }
            )
        });
        if self.adversarial.is_empty() {
            lines.push("adversarial case: not run".into());
        }
        for a in &self.adversarial {
            let label = format!(
                "adversarial ({}, {} for {} s)",
                a.system.name(),
                crate::report::rate_label(self.adversarial_rate),
                self.adversarial_secs
            );
            let Some(run) = &a.run else {
                lines.push(format!(
                    "{label}: not measured ({})",
                    a.skipped.clone().unwrap_or_default()
                ));
                continue;
            };
            let fail_opens = run.fail_opens.map_or_else(
                || "fail-opens: n/a (no engram_memory_fail_open_total)".to_owned(),
                |n| format!("zero fail-opens: {}, {}", thousands(n as f64), mark(n == 0)),
            );
            let lag = match (run.lag_within_target, run.lag_p99) {
                (Some(share), p99) => format!(
                    "job lag p99 ≤ {TARGET_LAG_P99_S} s: {} s ({:.2} % of the run's jobs within {TARGET_LAG_P99_S} s{}), {}",
                    q_s(p99),
                    share * 100.0,
                    if run.still_queued.unwrap_or(0) > 0 {
                        ", jobs never drained counted as late"
                    } else {
                        ""
                    },
                    mark(share >= 0.99)
                ),
                (None, Some(p99)) => format!(
                    "job lag p99 ≤ {TARGET_LAG_P99_S} s: {} s, {}",
                    q_s(Some(p99)),
                    mark(p99.upper <= TARGET_LAG_P99_S)
                ),
                (None, None) => "job lag: n/a".into(),
            };
            let rss = run.peak_rss_mb().map_or_else(
                || "RSS: n/a".to_owned(),
                |mb| {
                    format!(
                        "peak RSS ≤ {TARGET_RSS_MB} MB: {mb:.1} MB, {}",
                        mark(mb <= TARGET_RSS_MB)
                    )
                },
            );
            lines.push(format!("{label}: {fail_opens}; {lag}; {rss}"));
        }
        lines
    }
}

/// The cells every run's row starts with: added p50, added p99, throughput, errors, fail-opens,
/// degraded answers.
fn run_cells(run: &Run, cells: &mut Vec<String>) {
    match (run.added_us(), run.raw_added_us()) {
        (Some(added), _) => {
            cells.push(ms(added[0]));
            cells.push(ms(added[2]));
        }
        (None, Some(raw)) => {
            // Fell behind: the figures are queueing, shown but marked.
            cells.push(format!("({})", ms(raw[0])));
            cells.push(format!("({})", ms(raw[2])));
        }
        (None, None) => {
            cells.push("—".into());
            cells.push("—".into());
        }
    }
    cells.push(thousands(run.throughput));
    cells.push(format!(
        "{} of {}",
        thousands(run.errors as f64),
        thousands((run.ok + run.errors) as f64)
    ));
    cells.push(opt_count(run.fail_opens));
    cells.push(opt_count(run.degraded));
}

fn drained_cell(run: &Run) -> String {
    match (run.drained_secs, run.still_queued) {
        (Some(secs), _) => format!("in {secs:.1} s"),
        (None, Some(left)) => format!(
            "no, {} still queued after {} s",
            thousands(left as f64),
            run.drain_timeout_secs
        ),
        (None, None) => "unknown".into(),
    }
}

/// A run's notes; `queue_in_columns` when the row already shows the queue at the end and
/// the drain.
fn notes(run: &Run, queue_in_columns: bool) -> String {
    let mut notes = Vec::new();
    if let Some(why) = run.saturation() {
        notes.push(format!("{why}: added figures in brackets are queueing"));
    } else if let Some(why) = run.baseline_saturation() {
        notes.push(format!("baseline {why}"));
    }
    if let Some(b) = run.baseline_us {
        notes.push(format!(
            "paired direct baseline p50/p99 {} / {} ms",
            ms(b[0]),
            ms(b[2])
        ));
    }
    if let Some(injected) = run.injected {
        notes.push(format!(
            "memory injected into {} of {} answers",
            thousands(injected as f64),
            opt_count(run.chat_requests)
        ));
    }
    if !run.phases.is_empty() {
        let phases: Vec<String> = run
            .phases
            .iter()
            .map(|phase| {
                format!(
                    "{} {} / {}",
                    phase.phase.replace('_', " "),
                    q_ms(phase.p50),
                    q_ms(phase.p99)
                )
            })
            .collect();
        notes.push(format!(
            "phases and store commits p50 / p99 (ms, bucket bounds): {}",
            phases.join(", ")
        ));
    }
    if !run.fail_open_reasons.is_empty() {
        let reasons: Vec<String> = run
            .fail_open_reasons
            .iter()
            .map(|(reason, n)| format!("{reason} {}", thousands(*n as f64)))
            .collect();
        notes.push(format!("fail-opens by reason: {}", reasons.join(", ")));
    }
    if !queue_in_columns {
        notes.push(format!(
            "queue depth at the end of the load {}, drained: {}",
            opt_count(run.queue_depth_end),
            drained_cell(run)
        ));
    }
    if let Some(jobs) = run.jobs_applied {
        let runs = match run.runs {
            Some(runs) if runs > 0 => format!(
                " in {} runs ({:.1} jobs a run)",
                thousands(runs as f64),
                jobs as f64 / runs as f64
            ),
            _ => String::new(),
        };
        notes.push(format!(
            "{} jobs applied{runs}, lag observed for {}",
            thousands(jobs as f64),
            thousands(run.lag_observed as f64)
        ));
    }
    if let Some(cpu) = run.cpu_per_1k {
        notes.push(format!(
            "engram CPU {cpu:.3} s / 1,000 req (drain included)"
        ));
    }
    notes.extend(run.notes.iter().cloned());
    notes.join("; ")
}
