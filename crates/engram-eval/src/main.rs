//! The `engram-eval` binary: `engram-eval locomo --data PATH …` (see docs/evaluation.md).

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use engram_eval::cli::{Benchmark, Cli};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("warn"));
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .try_init();
    let result = match cli.benchmark {
        Benchmark::Locomo(args) => args.run(&mut std::io::stdout()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "engram-eval: {error}");
            ExitCode::FAILURE
        }
    }
}
