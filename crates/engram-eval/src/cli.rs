//! The command line (`engram-eval locomo …`) and running it.

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};
use engram::error::{Error, Result};
use engram_ops::config::Config;

use crate::locomo::EvalOptions;
use crate::progress::Progress;

#[derive(Debug, Parser)]
#[command(
    name = "engram-eval",
    version,
    about = "Measure engram's memory quality (see docs/evaluation.md)"
)]
pub struct Cli {
    #[command(subcommand)]
    pub benchmark: Benchmark,
}

#[derive(Debug, Subcommand)]
pub enum Benchmark {
    /// Replay LoCoMo conversations through the proxy and score the prompts against baselines.
    Locomo(LocomoArgs),
}

#[derive(Debug, Args)]
pub struct LocomoArgs {
    /// LoCoMo JSON (an array of conversations, like locomo10.json).
    #[arg(long)]
    pub data: PathBuf,
    /// Memory budget of the headline table; default: memory.budget_tokens of the config.
    #[arg(long)]
    pub budget: Option<u32>,
    /// Budgets of the chart (the headline budget is always measured too).
    #[arg(long, value_delimiter = ',', default_value = "512,1024,2048,4096")]
    pub sweep: Vec<u32>,
    /// Where locomo.md, locomo.json and locomo.svg are written.
    #[arg(long, default_value = "target/eval-locomo")]
    pub out: PathBuf,
    /// YAML config of the in-process proxy (memory settings); listen address, upstream, store
    /// and budget are set by the harness.
    #[arg(long, env = "ENGRAM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Use this running proxy instead of an in-process one. Its upstream must be the harness's
    /// scripted upstream (--mock-listen), its management API on (ENGRAM_ADMIN_TOKEN); only its
    /// own budget is measured, and the conversations' users are forgotten first.
    #[arg(long)]
    pub proxy: Option<String>,
    /// Where the scripted upstream listens.
    #[arg(long, default_value = "127.0.0.1:0")]
    pub mock_listen: SocketAddr,
    /// No progress bar (summary lines are still printed).
    #[arg(long)]
    pub no_progress: bool,
    /// Also write locomo-trace.jsonl: each question's prompt and explanation at the headline
    /// budget (it holds the data's text: keep it out of the repository).
    #[arg(long)]
    pub trace: bool,
}

impl LocomoArgs {
    /// Runs the evaluation and writes its report to `stdout` (the markdown tables, the files
    /// written, the runtime). An error if the replay protocol did not hold.
    pub fn run(self, stdout: &mut dyn Write) -> Result<()> {
        let config = Config::load(self.config.as_deref(), std::env::vars())?;
        let budget = self.budget.unwrap_or(config.memory.budget_tokens);
        let bar = !self.no_progress && std::io::IsTerminal::is_terminal(&std::io::stderr());
        let options = EvalOptions {
            data: self.data,
            budget,
            sweep: self.sweep,
            out: Some(self.out),
            proxy: self.proxy,
            mock_listen: self.mock_listen,
            admin_token: std::env::var(engram_ops::admin::TOKEN_ENV).ok(),
            config,
            progress: Progress::new(bar, true),
            trace: self.trace,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()?;
        let output = runtime.block_on(crate::locomo::run(options))?;
        let _ = writeln!(stdout, "\n{}", output.markdown);
        for path in &output.written {
            let _ = writeln!(stdout, "wrote {}", path.display());
        }
        let _ = writeln!(
            stdout,
            "total runtime {:.1} s",
            output.report.timing.total_seconds
        );
        if !output.report.protocol_holds {
            return Err(Error::Internal(
                "the replay protocol check failed (see the report's protocol section)".into(),
            ));
        }
        Ok(())
    }
}
