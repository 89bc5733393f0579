//! Command-line arguments only; `main.rs` runs them.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "engram",
    version,
    about = "An OpenAI-compatible proxy that gives LLM apps long-term memory"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run the proxy.
    Serve(ServeArgs),
    /// Run an OpenAI-compatible mock upstream (tests, benchmarks, quickstart).
    MockUpstream(MockArgs),
    /// Measure memory quality (see docs/evaluation.md).
    Eval(EvalArgs),
}

#[derive(Debug, Args)]
pub struct EvalArgs {
    #[command(subcommand)]
    pub benchmark: EvalBenchmark,
}

#[derive(Debug, Subcommand)]
pub enum EvalBenchmark {
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

#[derive(Debug, Args)]
pub struct ServeArgs {
    /// YAML config file; without one the built-in defaults apply (see config.yaml).
    #[arg(long, env = "ENGRAM_CONFIG")]
    pub config: Option<PathBuf>,
    /// Overrides server.listen (port 0 picks a free port).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Overrides upstream.base_url.
    #[arg(long)]
    pub upstream: Option<String>,
    /// Validate the configuration, print it, and exit.
    #[arg(long)]
    pub check_config: bool,
}

#[derive(Debug, Args)]
pub struct MockArgs {
    #[arg(long, default_value = "127.0.0.1:0")]
    pub listen: SocketAddr,
    /// Delay before the response headers, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub latency_ms: u64,
    /// Content chunks per streamed reply.
    #[arg(long, default_value_t = 8)]
    pub chunks: usize,
    /// Characters per content chunk.
    #[arg(long, default_value_t = 16)]
    pub chunk_size: usize,
    /// Delay between streamed chunks, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub chunk_delay_ms: u64,
    /// Reply with the received messages as JSON text.
    #[arg(long)]
    pub echo: bool,
    /// Append every received chat request to this JSON-lines file.
    #[arg(long)]
    pub record: Option<PathBuf>,
    /// Answer every chat completion (streamed or not) with exactly this content.
    #[arg(long)]
    pub reply: Option<String>,
    /// Tokio worker threads; 0 means one per core.
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
}
