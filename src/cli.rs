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
