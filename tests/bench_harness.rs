//! The overhead benchmark's own logic (benches/overhead/): argument parsing, when a run counts
//! as saturated, the added-latency arithmetic, the targets and LiteLLM comparison, and the SVG.
//! The benchmark itself never runs in tests.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]
#![allow(
    dead_code,
    reason = "the benchmark's modules hold more than these tests use"
)]

#[path = "../benches/overhead/args.rs"]
mod args;
#[path = "../benches/overhead/chart.rs"]
mod chart;
#[path = "../benches/overhead/report.rs"]
mod report;

use std::time::Duration;

use report::{Measurement, Report, Scenario, System};

fn strings(args: &[&str]) -> Vec<String> {
    args.iter().map(|s| (*s).to_owned()).collect()
}

#[test]
fn defaults_cover_every_system_and_scenario() {
    let parsed = args::parse(&strings(&["--bench"])).unwrap();
    assert_eq!(parsed.systems, System::ALL.to_vec());
    assert_eq!(parsed.scenarios, Scenario::ALL.to_vec());
    assert_eq!(parsed.rates, vec![25, 50, 100, 500, 1000, 2000]);
    assert_eq!(parsed.body_sizes, vec![100_000, 1_000_000]);
    assert_eq!(parsed.duration, Duration::from_secs(20));
    assert_eq!(parsed.in_flight_rate(), 1000);
    assert!(!parsed.quick);
}

#[test]
fn low_rates_run_until_they_have_sent_the_minimum_of_requests() {
    let parsed = args::parse(&strings(&["--min-requests", "1500"])).unwrap();
    // 1,500 requests at 25 req/s take 60 s; at 100 req/s the 20 s run already sends 2,000.
    assert_eq!(parsed.run_length(25), Duration::from_secs(60));
    assert_eq!(parsed.run_length(33), Duration::from_secs(46));
    assert_eq!(parsed.run_length(100), Duration::from_secs(20));
    let quick = args::parse(&strings(&["--quick"])).unwrap();
    assert_eq!(quick.run_length(25), quick.duration);
}

#[test]
fn quick_shortens_runs_and_explicit_flags_still_win() {
    let parsed = args::parse(&strings(&["--duration-secs", "3", "--quick"])).unwrap();
    assert!(parsed.quick);
    assert_eq!(parsed.duration, Duration::from_secs(3));
    assert_eq!(
        parsed.out_dir,
        std::path::PathBuf::from("target/bench-quick")
    );
    assert!(parsed.rates.len() < 5);
}

#[test]
fn systems_always_include_direct_in_report_order() {
    let parsed = args::parse(&strings(&["--systems", "litellm,off"])).unwrap();
    assert_eq!(
        parsed.systems,
        vec![System::Direct, System::Off, System::Litellm]
    );
    let parsed = args::parse(&strings(&["--scenarios", "stream,rates"])).unwrap();
    assert_eq!(parsed.scenarios, vec![Scenario::Rates, Scenario::Stream]);
}

/// Only a run of every system and scenario writes the report in docs/ by default.
#[test]
fn a_partial_run_writes_its_report_elsewhere() {
    let out = |flags: &[&str]| args::parse(&strings(flags)).unwrap().out_dir;
    assert_eq!(
        out(&["--bench"]),
        std::path::PathBuf::from("docs/benchmarks")
    );
    assert_eq!(
        out(&["--scenarios", "body"]),
        std::path::PathBuf::from("target/bench-partial")
    );
    assert_eq!(
        out(&["--systems", "off"]),
        std::path::PathBuf::from("target/bench-partial")
    );
    assert_eq!(
        out(&["--systems", "off", "--out", "docs/benchmarks"]),
        std::path::PathBuf::from("docs/benchmarks")
    );
    assert_eq!(
        out(&["--body-sizes", "1m"]),
        std::path::PathBuf::from("docs/benchmarks")
    );
}

#[test]
fn lists_are_sorted_and_sizes_take_suffixes() {
    let parsed = args::parse(&strings(&[
        "--rates",
        "2000,100,100,500",
        "--body-sizes",
        "1m,100k,512",
    ]))
    .unwrap();
    assert_eq!(parsed.rates, vec![100, 500, 2000]);
    assert_eq!(parsed.body_sizes, vec![1_000_000, 100_000, 512]);
    assert_eq!(args::parse_size("1M"), Ok(1_000_000));
}

#[test]
fn bad_arguments_are_explained() {
    for bad in [
        vec!["--systems", "nginx"],
        vec!["--scenarios", "soak"],
        vec!["--rates", "fast"],
        vec!["--rates", "0"],
        vec!["--duration-secs"],
        vec!["--body-sizes", "12q"],
        vec!["--frobnicate"],
    ] {
        let error = args::parse(&strings(&bad)).unwrap_err();
        assert!(!error.is_empty(), "{bad:?}");
    }
    assert!(
        args::parse(&strings(&["--duration-secs", "--quick"]))
            .unwrap_err()
            .contains("needs a value")
    );
}

#[test]
fn percentiles_use_the_nearest_rank() {
    let sorted: Vec<f64> = (1..=1000).map(f64::from).collect();
    assert_eq!(report::percentile(&sorted, 50.0), 501.0);
    assert_eq!(report::percentile(&sorted, 99.0), 990.0);
    assert_eq!(report::percentile(&sorted, 99.9), 999.0);
    assert!(report::percentile(&[], 50.0).is_nan());
}

#[test]
fn labels_read_well() {
    assert_eq!(report::thousands(1234567.4), "1,234,567");
    assert_eq!(report::thousands(999.0), "999");
    assert_eq!(report::thousands(-1500.0), "-1,500");
    assert_eq!(report::ms(1234.0), "1.234");
    assert_eq!(report::ms(f64::NAN), "—");
    assert_eq!(report::size_label(100_000), "100 KB");
    assert_eq!(report::size_label(1_000_000), "1 MB");
    assert_eq!(report::size_label(512), "512 B");
    assert_eq!(report::rate_label(2000), "2,000 req/s");
}

fn run(system: System, rate: u64, p: [f64; 4], throughput: f64, errors: u64) -> Measurement {
    Measurement {
        offered_rate: Some(rate as f64),
        latency_us: p,
        throughput,
        ok: (throughput * 10.0) as u64,
        errors,
        peak_rss_mib: (system != System::Direct).then_some(12.0),
        cpu_per_1k: (system != System::Direct).then_some(0.08),
        generator: "oha".into(),
        ..Measurement::new(system, Scenario::Rates, &report::rate_label(rate))
    }
}

#[test]
fn a_run_that_falls_behind_or_fails_is_saturated() {
    let kept_up = run(System::Off, 1000, [100.0; 4], 990.0, 0);
    assert!(kept_up.sustained());
    let behind = run(System::Litellm, 1000, [100.0; 4], 80.0, 0);
    assert!(behind.saturation().unwrap().contains("80 of 1,000"));
    let failing = run(System::Off, 1000, [100.0; 4], 1000.0, 500);
    assert!(failing.saturation().unwrap().contains("errors"));
    let skipped = Measurement::skipped(System::Litellm, Scenario::Rates, "x", "not installed");
    assert_eq!(skipped.saturation().as_deref(), Some("not installed"));
}

fn sample_report() -> Report {
    Report {
        context: vec!["machine: test".into()],
        measurements: vec![
            run(System::Direct, 50, [100.0, 120.0, 200.0, 400.0], 50.0, 0),
            run(System::Off, 50, [250.0, 300.0, 500.0, 900.0], 50.0, 0),
            run(
                System::Embedded,
                50,
                [500.0, 600.0, 1200.0, 2000.0],
                50.0,
                0,
            ),
            run(
                System::Litellm,
                50,
                [14_000.0, 16_000.0, 18_200.0, 30_000.0],
                50.0,
                0,
            ),
            run(
                System::Direct,
                1000,
                [100.0, 120.0, 200.0, 400.0],
                1000.0,
                0,
            ),
            run(System::Off, 1000, [250.0, 300.0, 500.0, 900.0], 1000.0, 0),
            run(
                System::Embedded,
                1000,
                [500.0, 600.0, 2500.0, 4000.0],
                1000.0,
                0,
            ),
            run(System::Litellm, 1000, [1e6; 4], 85.0, 0),
        ],
    }
}

#[test]
fn added_latency_is_the_difference_from_direct_in_the_same_step() {
    let report = sample_report();
    let off = &report.measurements[1];
    assert_eq!(report.added(off), Some([150.0, 180.0, 300.0, 500.0]));
    // Saturated: no latency figures at all.
    assert_eq!(report.added(&report.measurements[7]), None);
}

#[test]
fn targets_and_litellm_comparison_are_computed() {
    let report = sample_report();
    let targets = report.targets();
    assert!(targets[0].contains("0.150 ms ✓"), "{}", targets[0]);
    assert!(targets[0].contains("0.300 ms ✓"), "{}", targets[0]);
    assert!(
        targets[1].contains("1,000 req/s 2.300 ms ✗"),
        "{}",
        targets[1]
    );
    assert!(targets[2].contains("12.0 MiB"), "{}", targets[2]);
    // LiteLLM sustained only 50 req/s: off (0.3 ms vs 18 ms) and embedded (1.0 ms) compared.
    let comparisons = report.litellm_ratios();
    assert_eq!(comparisons.len(), 2);
    assert!(comparisons[0].met(), "{comparisons:?}");
    assert!(comparisons[1].met(), "{comparisons:?}");
    assert_eq!(comparisons[0].ratio_label(), "60×");
    assert!(targets[4].contains("met ✓"), "{}", targets[4]);
    let markdown = report.markdown();
    assert!(markdown.contains("| 1,000 req/s | LiteLLM proxy | saturated: 85 of 1,000 req/s |"));
    assert!(markdown.contains("| 50 req/s | engram, memory off | 0.150 | 0.180 | 0.300 | 0.500 |"));
    assert!(markdown.contains("| 50 req/s | direct (absolute) | 0.100 |"));
}

#[test]
fn a_slower_engram_misses_the_litellm_target() {
    let mut report = sample_report();
    report.measurements[2].latency_us[2] = 5000.0; // embedded added p99 4.8 ms vs 18 ms
    let comparisons = report.litellm_ratios();
    assert!(!comparisons[1].met());
    assert!(report.targets()[4].contains("missed at rates 50 req/s (embedded)"));
}

#[test]
fn the_chart_plots_sustained_rates_and_marks_saturation() {
    let report = sample_report();
    let series = chart::series(&report);
    let litellm = &series
        .iter()
        .find(|(s, _)| *s == System::Litellm)
        .unwrap()
        .1;
    assert_eq!(litellm[0], (50.0, Some(18.0)));
    assert_eq!(litellm[1], (1000.0, None));
    let svg = chart::added_p99_svg(&report, "a <title>");
    assert!(svg.starts_with("<svg"));
    assert!(svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("a &lt;title&gt;"));
    assert!(svg.contains("saturated at 1,000 req/s"));
    assert_eq!(svg.matches("<circle").count(), 5);
}

#[test]
fn pairing_is_on_unless_turned_off() {
    assert!(args::parse(&strings(&["--quick"])).unwrap().pairing);
    assert!(!args::parse(&strings(&["--no-pairing"])).unwrap().pairing);
}

/// `m` with a paired direct baseline that saw `p` and completed `throughput` req/s.
fn paired(mut m: Measurement, p: [f64; 4], throughput: f64, errors: u64) -> Measurement {
    m.baseline = Some(report::Baseline {
        latency_us: p,
        stream_us: None,
        throughput,
        ok: (throughput * 10.0) as u64,
        errors,
        notes: Vec::new(),
    });
    m
}

#[test]
fn added_latency_is_over_the_paired_baseline_when_there_is_one() {
    let mut report = sample_report();
    // The step's direct row says 100/120/200/400; the baseline paired with this run says less.
    report.measurements[1] = paired(
        report.measurements[1].clone(),
        [90.0, 110.0, 180.0, 350.0],
        50.0,
        0,
    );
    assert_eq!(
        report.added(&report.measurements[1]),
        Some([160.0, 190.0, 320.0, 550.0])
    );
    // Embedded at the same step has no baseline: over the direct row.
    assert_eq!(
        report.added(&report.measurements[2]),
        Some([400.0, 480.0, 1000.0, 1600.0])
    );
    let markdown = report.markdown();
    assert!(
        markdown.contains("| 50 req/s | engram, memory off | 0.160 | 0.190 | 0.320 | 0.550 |"),
        "{markdown}"
    );
    assert!(markdown.contains("paired direct baseline: p50/p99 0.090 / 0.180 ms (500 requests)"));
    assert!(markdown.contains("no paired baseline: added over the step's direct row"));
    // A paired run needs no direct row at all.
    report.measurements.remove(0);
    assert_eq!(
        report.added(&report.measurements[0]),
        Some([160.0, 190.0, 320.0, 550.0])
    );
    assert_eq!(report.added(&report.measurements[1]), None);
}

#[test]
fn a_saturated_system_or_baseline_gets_no_added_figures() {
    let mut report = sample_report();
    // LiteLLM completed 85 of 1,000 req/s; its baseline kept up, which changes nothing.
    report.measurements[7] = paired(report.measurements[7].clone(), [90.0; 4], 1000.0, 0);
    assert_eq!(report.added(&report.measurements[7]), None);
    assert!(
        report
            .markdown()
            .contains("| 1,000 req/s | LiteLLM proxy | saturated: 85 of 1,000 req/s |")
    );
    // The system kept up but its baseline did not (2 % errors): no figures, though the step's
    // direct row kept up.
    report.measurements[5] = paired(report.measurements[5].clone(), [90.0; 4], 1000.0, 200);
    assert!(report.measurements[5].sustained());
    assert_eq!(report.added(&report.measurements[5]), None);
    assert!(
        report
            .markdown()
            .contains("| 1,000 req/s | engram, memory off | baseline saturated |")
    );
    assert!(report.targets()[0].contains("not measured (or saturated)"));
}

#[test]
fn whole_stream_added_is_over_the_paired_baseline_too() {
    let stream = |system: System, whole: [f64; 4]| Measurement {
        stream_us: Some(whole),
        scenario: Scenario::Stream,
        ..run(system, 25, [1000.0; 4], 25.0, 0)
    };
    let mut off = paired(
        stream(System::Off, [5000.0, 5100.0, 5300.0, 5400.0]),
        [800.0; 4],
        25.0,
        0,
    );
    off.baseline.as_mut().unwrap().stream_us = Some([4000.0, 4100.0, 4200.0, 4300.0]);
    let report = Report {
        context: Vec::new(),
        measurements: vec![stream(System::Direct, [4500.0; 4]), off],
    };
    let off = &report.measurements[1];
    assert_eq!(report.added(off), Some([200.0; 4]));
    assert_eq!(
        report.added_stream(off),
        Some([1000.0, 1000.0, 1100.0, 1100.0])
    );
}
