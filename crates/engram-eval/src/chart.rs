//! The chart: evidence recall against mean prompt tokens (log scale), one point per system and
//! budget (full history and the window do not depend on the budget: one point each). Written
//! as plain SVG.

use std::fmt::Write as _;

use super::report::{BM25, ENGRAM, ENGRAM_LEXICAL, FULL_HISTORY, Report, SweepPoint, WINDOW};

const WIDTH: f64 = 760.0;
const HEIGHT: f64 = 480.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 60.0;

struct Style {
    system: &'static str,
    colour: &'static str,
    /// Marker: circle, square, diamond or triangle.
    marker: &'static str,
    /// Whether a point's budget label sits left of the marker (so two systems' labels at the
    /// same point do not overlap).
    label_left: bool,
}

const STYLES: [Style; 5] = [
    Style {
        system: ENGRAM,
        colour: "#1f6feb",
        marker: "circle",
        label_left: false,
    },
    Style {
        system: ENGRAM_LEXICAL,
        colour: "#8250df",
        marker: "circle",
        label_left: true,
    },
    Style {
        system: BM25,
        colour: "#d9822b",
        marker: "square",
        label_left: true,
    },
    Style {
        system: FULL_HISTORY,
        colour: "#6e7781",
        marker: "diamond",
        label_left: false,
    },
    Style {
        system: WINDOW,
        colour: "#2da44e",
        marker: "triangle",
        label_left: false,
    },
];

fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
}

fn marker(out: &mut String, shape: &str, x: f64, y: f64, colour: &str) {
    let _ = match shape {
        "square" => writeln!(
            out,
            r#"<rect x="{:.1}" y="{:.1}" width="9" height="9" fill="{colour}"/>"#,
            x - 4.5,
            y - 4.5
        ),
        "diamond" => writeln!(
            out,
            r#"<polygon points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1} {:.1},{:.1}" fill="{colour}"/>"#,
            x,
            y - 6.0,
            x + 6.0,
            y,
            x,
            y + 6.0,
            x - 6.0,
            y
        ),
        "triangle" => writeln!(
            out,
            r#"<polygon points="{:.1},{:.1} {:.1},{:.1} {:.1},{:.1}" fill="{colour}"/>"#,
            x,
            y - 6.0,
            x + 6.0,
            y + 5.0,
            x - 6.0,
            y + 5.0
        ),
        _ => writeln!(
            out,
            r#"<circle cx="{x:.1}" cy="{y:.1}" r="5" fill="{colour}"/>"#
        ),
    };
}

pub fn svg(report: &Report) -> String {
    let points: Vec<&SweepPoint> = report
        .sweep
        .iter()
        .filter(|point| point.tokens.mean > 0.0)
        .collect();
    let low = points
        .iter()
        .map(|point| point.tokens.mean)
        .fold(f64::INFINITY, f64::min);
    let high = points
        .iter()
        .map(|point| point.tokens.mean)
        .fold(0.0f64, f64::max);
    let (low, high) = if points.is_empty() {
        (1.0, 10.0)
    } else {
        (
            10f64.powf(low.log10().floor()),
            10f64.powf(high.log10().ceil().max(low.log10().floor() + 1.0)),
        )
    };
    let plot_width = WIDTH - LEFT - RIGHT;
    let plot_height = HEIGHT - TOP - BOTTOM;
    let x_of = |tokens: f64| {
        LEFT + (tokens.max(low).log10() - low.log10()) / (high.log10() - low.log10()) * plot_width
    };
    let y_of = |recall: f64| TOP + (1.0 - recall.clamp(0.0, 1.0)) * plot_height;

    let mut out = String::new();
    let _ = writeln!(
        out,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(
        out,
        r##"<rect width="{WIDTH}" height="{HEIGHT}" fill="#ffffff"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="24" font-size="15" text-anchor="middle">LoCoMo: evidence recall against prompt tokens</text>"#,
        LEFT + plot_width / 2.0
    );
    // Grid and axes.
    for step in 0..=10 {
        let recall = f64::from(step) / 10.0;
        let y = y_of(recall);
        let _ = writeln!(
            out,
            r##"<line x1="{LEFT}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#e6e6e6"/>"##,
            LEFT + plot_width
        );
        if step % 2 == 0 {
            let _ = writeln!(
                out,
                r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{recall:.1}</text>"#,
                LEFT - 8.0,
                y + 4.0
            );
        }
    }
    let mut decade = low;
    while decade <= high * 1.0001 {
        for multiple in [1.0, 2.0, 5.0] {
            let tokens = decade * multiple;
            if tokens > high * 1.0001 {
                break;
            }
            let x = x_of(tokens);
            let _ = writeln!(
                out,
                r##"<line x1="{x:.1}" y1="{TOP}" x2="{x:.1}" y2="{:.1}" stroke="#{}"/>"##,
                TOP + plot_height,
                if multiple == 1.0 { "d0d0d0" } else { "f0f0f0" }
            );
            let _ = writeln!(
                out,
                r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{}</text>"#,
                TOP + plot_height + 18.0,
                tokens.round()
            );
        }
        decade *= 10.0;
    }
    let _ = writeln!(
        out,
        r##"<rect x="{LEFT}" y="{TOP}" width="{plot_width:.1}" height="{plot_height:.1}" fill="none" stroke="#888888"/>"##
    );
    let _ = writeln!(
        out,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">mean prompt tokens (cl100k, log scale)</text>"#,
        LEFT + plot_width / 2.0,
        HEIGHT - 16.0
    );
    let _ = writeln!(
        out,
        r#"<text x="18" y="{:.1}" text-anchor="middle" transform="rotate(-90 18 {:.1})">evidence recall</text>"#,
        TOP + plot_height / 2.0,
        TOP + plot_height / 2.0
    );
    // Series: a line through a system's budgets, a marker and a budget label per point.
    let present = STYLES
        .iter()
        .filter(|style| points.iter().any(|point| point.system == style.system));
    for (row, style) in present.enumerate() {
        let mut series: Vec<&&SweepPoint> = points
            .iter()
            .filter(|point| point.system == style.system)
            .collect();
        series.sort_by(|a, b| a.tokens.mean.total_cmp(&b.tokens.mean));
        if series.len() > 1 {
            let path: Vec<String> = series
                .iter()
                .map(|point| {
                    format!(
                        "{:.1},{:.1}",
                        x_of(point.tokens.mean),
                        y_of(point.evidence_recall)
                    )
                })
                .collect();
            let _ = writeln!(
                out,
                r#"<polyline points="{}" fill="none" stroke="{}" stroke-width="1.5"/>"#,
                path.join(" "),
                style.colour
            );
        }
        for point in &series {
            let (x, y) = (x_of(point.tokens.mean), y_of(point.evidence_recall));
            marker(&mut out, style.marker, x, y, style.colour);
            if let Some(budget) = point.budget {
                let (dx, anchor) = if style.label_left {
                    (-7.0, "end")
                } else {
                    (7.0, "start")
                };
                let _ = writeln!(
                    out,
                    r#"<text x="{:.1}" y="{:.1}" font-size="10" text-anchor="{anchor}" fill="{}">{budget}</text>"#,
                    x + dx,
                    y - 7.0,
                    style.colour
                );
            }
        }
        let legend_y = TOP + 10.0 + row as f64 * 22.0;
        let legend_x = LEFT + plot_width + 20.0;
        marker(&mut out, style.marker, legend_x, legend_y, style.colour);
        let _ = writeln!(
            out,
            r#"<text x="{:.1}" y="{:.1}">{}</text>"#,
            legend_x + 12.0,
            legend_y + 4.0,
            escape(style.system)
        );
    }
    let _ = writeln!(
        out,
        r##"<text x="{:.1}" y="{:.1}" font-size="10" fill="#555555">labels: budget in tokens</text>"##,
        LEFT + plot_width + 20.0,
        TOP + 10.0 + 4.0 * 22.0 + 4.0
    );
    out.push_str("</svg>\n");
    out
}
