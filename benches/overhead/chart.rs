//! The SVG chart: added p99 against offered rate, one line per system, both axes logarithmic.
//! Hand-written SVG, no dependency. Pure, so it has unit tests (`tests/bench_harness.rs`).

use std::fmt::Write as _;

use crate::report::{Report, Scenario, System, thousands};

const WIDTH: f64 = 840.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
/// Added latencies at or below this (ms), noise included, are drawn on the bottom edge.
const FLOOR_MS: f64 = 0.01;

fn colour(system: System) -> &'static str {
    match system {
        System::Direct => "#777777",
        System::Floor => "#bbbbbb",
        System::Off => "#1b7837",
        System::Embedded => "#2166ac",
        System::Redis => "#b2182b",
        System::Litellm => "#e08214",
    }
}

/// A point of one system's line: offered rate, added p99 in ms, or `None` where it saturated.
pub type Point = (f64, Option<f64>);

/// Each system's points from the stepped-rates scenario, in rate order.
pub fn series(report: &Report) -> Vec<(System, Vec<Point>)> {
    let mut lines: Vec<(System, Vec<Point>)> = Vec::new();
    for m in report
        .measurements
        .iter()
        .filter(|m| m.scenario == Scenario::Rates && m.system != System::Direct)
    {
        let Some(rate) = m.offered_rate else { continue };
        let point = (rate, report.added(m).map(|added| added[2] / 1000.0));
        match lines.iter_mut().find(|(system, _)| *system == m.system) {
            Some((_, points)) => points.push(point),
            None => lines.push((m.system, vec![point])),
        }
    }
    for (_, points) in &mut lines {
        points.sort_by(|a, b| a.0.total_cmp(&b.0));
    }
    lines
}

/// Decades spanning `low..=high`, as exponents of ten.
fn decades(low: f64, high: f64) -> (i32, i32) {
    let low = low.max(f64::MIN_POSITIVE).log10().floor() as i32;
    let high = high.max(f64::MIN_POSITIVE).log10().ceil() as i32;
    (low, high.max(low + 1))
}

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

pub fn added_p99_svg(report: &Report, title: &str) -> String {
    let lines = series(report);
    let rates: Vec<f64> = lines
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .collect();
    let (min_rate, max_rate) = rates.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), r| {
        (lo.min(*r), hi.max(*r))
    });
    let (min_rate, max_rate) = if rates.is_empty() {
        (10.0, 1000.0)
    } else {
        (min_rate / 1.5, max_rate * 1.5)
    };
    let max_ms = lines
        .iter()
        .flat_map(|(_, points)| points.iter().filter_map(|p| p.1))
        .fold(1.0_f64, f64::max);
    let (y_low, y_high) = decades(FLOOR_MS, max_ms);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x =
        |rate: f64| LEFT + (rate.ln() - min_rate.ln()) / (max_rate.ln() - min_rate.ln()) * plot_w;
    let y = |value_ms: f64| {
        let v = value_ms.max(FLOOR_MS).log10();
        TOP + plot_h - (v - f64::from(y_low)) / f64::from(y_high - y_low) * plot_h
    };

    let mut svg = String::new();
    let _ = writeln!(
        svg,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        svg,
        r#"<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>"#
    );
    let _ = writeln!(
        svg,
        r#"<text x="{}" y="24" font-size="15" font-weight="bold">{}</text>"#,
        LEFT,
        escape(title)
    );
    // Horizontal grid, one line per decade.
    for exponent in y_low..=y_high {
        let value = 10f64.powi(exponent);
        let py = y(value);
        let label = if exponent < 0 {
            format!("{value:.*}", exponent.unsigned_abs() as usize)
        } else {
            thousands(value)
        };
        let _ = writeln!(
            svg,
            r##"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="#dddddd"/><text x="{:.1}" y="{:.1}" text-anchor="end">{label}</text>"##,
            LEFT + plot_w,
            LEFT - 6.0,
            py + 4.0
        );
    }
    // Vertical grid at each measured rate.
    let mut ticks = rates.clone();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    for rate in &ticks {
        let px = x(*rate);
        let _ = writeln!(
            svg,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#eeeeee"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 16.0,
            thousands(*rate)
        );
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">offered rate (req/s, log scale)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 18.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">added p99 over direct (ms, log scale)</text>"#,
        TOP + plot_h / 2.0
    );
    for (index, (system, points)) in lines.iter().enumerate() {
        let colour = colour(*system);
        // Sustained points joined while consecutive; a saturated rate ends the line.
        let mut path = String::new();
        let mut pen_down = false;
        for (rate, value) in points {
            match value {
                Some(value) => {
                    let _ = write!(
                        path,
                        "{}{:.1},{:.1} ",
                        if pen_down { "L" } else { "M" },
                        x(*rate),
                        y(*value)
                    );
                    pen_down = true;
                }
                None => pen_down = false,
            }
        }
        if !path.is_empty() {
            let _ = writeln!(
                svg,
                r#"<path d="{}" fill="none" stroke="{colour}" stroke-width="2"/>"#,
                path.trim_end()
            );
        }
        for (rate, value) in points {
            let px = x(*rate);
            match value {
                Some(value) => {
                    let _ = writeln!(
                        svg,
                        r#"<circle cx="{px:.1}" cy="{:.1}" r="4" fill="{colour}"><title>{}: {} req/s, added p99 {value:.3} ms</title></circle>"#,
                        y(*value),
                        escape(system.label()),
                        thousands(*rate)
                    );
                }
                None => {
                    // Saturated: a cross on the top edge, offset per system so they stay apart.
                    let py = TOP + 8.0 + 6.0 * index as f64;
                    let _ = writeln!(
                        svg,
                        r#"<path d="M{:.1},{:.1} l8,8 m0,-8 l-8,8" stroke="{colour}" stroke-width="2"><title>{}: saturated at {} req/s</title></path>"#,
                        px - 4.0,
                        py - 4.0,
                        escape(system.label()),
                        thousands(*rate)
                    );
                }
            }
        }
        let ly = TOP + 10.0 + 22.0 * index as f64;
        let lx = LEFT + plot_w + 16.0;
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            escape(system.label())
        );
    }
    let note_y = TOP + 10.0 + 22.0 * lines.len() as f64 + 8.0;
    let lx = LEFT + plot_w + 16.0;
    let _ = writeln!(
        svg,
        r##"<text x="{lx:.1}" y="{note_y:.1}" fill="#555555">× on the top edge: saturated</text><text x="{lx:.1}" y="{:.1}" fill="#555555">bottom edge: ≤ {FLOOR_MS} ms (noise)</text>"##,
        note_y + 16.0
    );
    svg.push_str("</svg>\n");
    svg
}
