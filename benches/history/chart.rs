//! The SVG chart: added p99 and worker apply p99 against history size, both axes logarithmic,
//! with the targets of issue 26 as dashed lines. Hand-written SVG in the overhead chart's
//! style, no dependency. Pure.

use std::fmt::Write as _;

use crate::report::thousands;
use crate::results::{Report, TARGET_ADDED_P99_MS, TARGET_APPLY_P99_MS};

const WIDTH: f64 = 840.0;
const HEIGHT: f64 = 460.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 250.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;
/// Values at or below this (ms), noise included, are drawn on the bottom edge.
const FLOOR_MS: f64 = 0.01;

const ADDED: &str = "#2166ac";
const APPLY: &str = "#b2182b";

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

/// (history size, value in ms) for each measured size; `None` where there is no figure.
type Series = Vec<(f64, Option<f64>)>;

fn series(report: &Report) -> (Series, Series) {
    let mut added = Vec::new();
    let mut apply = Vec::new();
    for size in &report.sizes {
        let turns = size.turns as f64;
        let run = size.run.as_ref();
        added.push((turns, run.and_then(|r| r.added_us()).map(|a| a[2] / 1000.0)));
        apply.push((
            turns,
            run.and_then(|r| r.apply_p99).map(|q| q.estimate * 1000.0),
        ));
    }
    (added, apply)
}

pub fn svg(report: &Report, title: &str) -> String {
    let (added, apply) = series(report);
    let sizes: Vec<f64> = report.sizes.iter().map(|s| s.turns as f64).collect();
    let (min_x, max_x) = sizes.iter().fold((f64::INFINITY, 0.0_f64), |(lo, hi), s| {
        (lo.min(*s), hi.max(*s))
    });
    let (min_x, max_x) = if sizes.is_empty() {
        (10.0, 100_000.0)
    } else {
        (min_x / 2.0, max_x * 2.0)
    };
    let max_ms = added
        .iter()
        .chain(apply.iter())
        .filter_map(|p| p.1)
        .fold(TARGET_APPLY_P99_MS, f64::max);
    let y_low = FLOOR_MS.log10().floor() as i32;
    let y_high = (max_ms.max(FLOOR_MS * 10.0).log10().ceil() as i32).max(y_low + 1);
    let plot_w = WIDTH - LEFT - RIGHT;
    let plot_h = HEIGHT - TOP - BOTTOM;
    let x = |turns: f64| LEFT + (turns.ln() - min_x.ln()) / (max_x.ln() - min_x.ln()) * plot_w;
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
        r#"<text x="{LEFT}" y="24" font-size="15" font-weight="bold">{}</text>"#,
        escape(title)
    );
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
    let mut ticks = sizes.clone();
    ticks.sort_by(f64::total_cmp);
    ticks.dedup();
    for turns in &ticks {
        let px = x(*turns);
        let _ = writeln!(
            svg,
            r##"<line x1="{px:.1}" y1="{TOP}" x2="{px:.1}" y2="{:.1}" stroke="#eeeeee"/><text x="{px:.1}" y="{:.1}" text-anchor="middle">{}</text>"##,
            TOP + plot_h,
            TOP + plot_h + 16.0,
            thousands(*turns)
        );
    }
    let _ = writeln!(
        svg,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#333333"/>"##
    );
    let _ = writeln!(
        svg,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">history of the one user (turns preloaded, log scale)</text>"#,
        LEFT + plot_w / 2.0,
        HEIGHT - 18.0
    );
    let _ = writeln!(
        svg,
        r#"<text transform="translate(18 {:.1}) rotate(-90)" text-anchor="middle">ms (log scale)</text>"#,
        TOP + plot_h / 2.0
    );
    // The targets, dashed, in their series' colours.
    for (target, colour) in [(TARGET_ADDED_P99_MS, ADDED), (TARGET_APPLY_P99_MS, APPLY)] {
        let py = y(target);
        let _ = writeln!(
            svg,
            r#"<line x1="{LEFT}" y1="{py:.1}" x2="{:.1}" y2="{py:.1}" stroke="{colour}" stroke-width="1" stroke-dasharray="6 4" opacity="0.6"/>"#,
            LEFT + plot_w
        );
    }
    let labels = [
        (
            &added,
            ADDED,
            format!("added p99, {}", crate::report::rate_label(report.rate)),
        ),
        (&apply, APPLY, "worker apply p99".to_owned()),
    ];
    for (index, (points, colour, label)) in labels.iter().enumerate() {
        let mut path = String::new();
        let mut pen_down = false;
        for (turns, value) in points.iter() {
            match value {
                Some(value) => {
                    let _ = write!(
                        path,
                        "{}{:.1},{:.1} ",
                        if pen_down { "L" } else { "M" },
                        x(*turns),
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
        for (turns, value) in points.iter() {
            if let Some(value) = value {
                let _ = writeln!(
                    svg,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="4" fill="{colour}"><title>{}: {} turns, {value:.3} ms</title></circle>"#,
                    x(*turns),
                    y(*value),
                    escape(label),
                    thousands(*turns)
                );
            }
        }
        let ly = TOP + 10.0 + 22.0 * index as f64;
        let lx = LEFT + plot_w + 16.0;
        let missing = if points.iter().all(|p| p.1.is_none()) {
            " (n/a)"
        } else {
            ""
        };
        let _ = writeln!(
            svg,
            r#"<line x1="{lx:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{colour}" stroke-width="2"/><text x="{:.1}" y="{:.1}">{}{missing}</text>"#,
            lx + 22.0,
            lx + 28.0,
            ly + 4.0,
            escape(label)
        );
    }
    let lx = LEFT + plot_w + 16.0;
    let note_y = TOP + 10.0 + 22.0 * 2.0 + 8.0;
    let _ = writeln!(
        svg,
        r##"<text x="{lx:.1}" y="{note_y:.1}" fill="#555555">dashed: targets ({TARGET_ADDED_P99_MS} ms, {TARGET_APPLY_P99_MS} ms)</text><text x="{lx:.1}" y="{:.1}" fill="#555555">bottom edge: ≤ {FLOOR_MS} ms (noise)</text><text x="{lx:.1}" y="{:.1}" fill="#555555">no point: not measured, or</text><text x="{lx:.1}" y="{:.1}" fill="#555555">engram did not keep up</text>"##,
        note_y + 16.0,
        note_y + 32.0,
        note_y + 48.0
    );
    svg.push_str("</svg>\n");
    svg
}
