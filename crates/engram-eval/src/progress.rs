//! Progress of a long run: an `indicatif` bar on stderr (when it is a terminal) and summary lines
//! on stdout, printed above the bar.

use std::io::Write;
use std::time::Duration;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

#[derive(Clone)]
pub struct Progress {
    bar: ProgressBar,
    /// Print summary lines on stdout.
    lines: bool,
}

impl Progress {
    /// `bar`: draw the bar (stderr); `lines`: print summary lines (stdout).
    pub fn new(bar: bool, lines: bool) -> Progress {
        let target = if bar {
            ProgressDrawTarget::stderr()
        } else {
            ProgressDrawTarget::hidden()
        };
        let progress = ProgressBar::with_draw_target(Some(0), target);
        if let Ok(style) = ProgressStyle::with_template(
            "{elapsed_precise} [{bar:40}] {pos}/{len} requests ({per_sec}, {eta} left)",
        ) {
            progress.set_style(style.progress_chars("=> "));
        }
        Progress {
            bar: progress,
            lines,
        }
    }

    /// Neither bar nor lines (tests).
    pub fn quiet() -> Progress {
        Progress::new(false, false)
    }

    pub fn start(&self, total: u64) {
        self.bar.set_length(total);
        self.bar.set_position(0);
        self.bar.enable_steady_tick(Duration::from_millis(250));
    }

    pub fn inc(&self, steps: u64) {
        self.bar.inc(steps);
    }

    pub fn line(&self, text: &str) {
        if self.lines {
            self.bar.suspend(|| {
                let _ = writeln!(std::io::stdout(), "{text}");
            });
        }
    }

    pub fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
