//! The `engram` binary: parse arguments, load config, start the runtime, run.

use std::io::{IsTerminal, Write};
use std::process::ExitCode;

use clap::Parser;
use engram::app::{Credentials, Engram};
use engram::error::Error;
use engram::server::shutdown_signal;
use engram_ops::cli::{AdminArgs, Cli, Command, ServeArgs, StoreFlag};
use engram_ops::config::{Config, LogFormat, StoreBackend};
use tracing_subscriber::EnvFilter;

// jemalloc, not glibc's malloc: with memory on, glibc's per-thread arenas kept ~150 MB of RSS
// beyond the live heap (state-sized allocations freed on other threads); jemalloc took peak RSS
// with 1,000 streams in flight from 306 to 221 MiB (docs/benchmarks-log.md). mimalloc made it worse.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Serve(args) => serve(args),
        Command::Admin(args) => return admin(args),
        Command::Eval(_) => return moved("eval", "engram-eval"),
        Command::MockUpstream(_) => return moved("mock-upstream", "engram-mock"),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let _ = writeln!(std::io::stderr(), "engram: {error}");
            ExitCode::FAILURE
        }
    }
}

/// A command that left the sidecar's binary: where it went, as a usage error.
fn moved(command: &str, binary: &str) -> ExitCode {
    let _ = writeln!(
        std::io::stderr(),
        "engram: `engram {command}` is a development tool of its own now, outside the sidecar: \
         run `{binary}` with the same arguments (from the repository: `cargo run --release -p \
         {binary} -- ARGS`)"
    );
    ExitCode::from(2)
}

fn runtime(worker_threads: usize) -> Result<tokio::runtime::Runtime, Error> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if worker_threads > 0 {
        builder.worker_threads(worker_threads);
    }
    Ok(builder.build()?)
}

fn init_logging(level: &str, format: LogFormat) {
    let filter = EnvFilter::try_from_default_env()
        .or_else(|_| EnvFilter::try_new(level))
        .unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal());
    let _ = match format {
        LogFormat::Json => builder.json().try_init(),
        LogFormat::Text => builder.try_init(),
    };
}

fn serve(args: ServeArgs) -> Result<(), Error> {
    let mut config = Config::load(args.config.as_deref(), std::env::vars())?;
    if let Some(listen) = args.listen {
        config.server.listen = listen;
    }
    if let Some(upstream) = args.upstream {
        config.upstream.base_url = upstream;
    }
    match args.store {
        Some(StoreFlag::Embedded(dir)) => {
            config.store.backend = StoreBackend::Embedded;
            config.store.data_dir = dir;
        }
        Some(StoreFlag::Redis(url)) => {
            config.store.backend = StoreBackend::Redis;
            config.store.redis_url = url;
        }
        None => {}
    }
    config.validate()?;
    if args.check_config {
        let _ = writeln!(std::io::stdout(), "configuration is valid:\n{config:#?}");
        return Ok(());
    }
    init_logging(&config.logging.level, config.logging.format);
    let credentials = Credentials::from_env(&config, |name| std::env::var(name).ok())?;
    runtime(config.server.worker_threads)?.block_on(async move {
        let base_url = config.upstream.base_url.clone();
        let backend = config.store.backend;
        let admin_api = credentials.admin.is_enabled();
        let trust = config.identity.trust;
        let engram = Engram::build(config, credentials).await?;
        let address = engram.local_addr()?;
        tracing::info!(%address, upstream = %base_url, store = ?backend, admin_api, ?trust, "engram listening");
        // Tests and scripts read this (first) line to find the port.
        let _ = writeln!(std::io::stdout(), "engram listening on http://{address}");
        if let Some(ops) = engram.ops_addr()? {
            tracing::info!(address = %ops, "health, readiness and metrics listening");
            let _ = writeln!(std::io::stdout(), "engram ops listening on http://{ops}");
        }
        let _ = std::io::stdout().flush();
        engram.run(shutdown_signal()).await
    })
}

/// Runs one management API call against a running proxy: the JSON answer on stdout; a non-2xx
/// answer's error message (or why there was none) on stderr, and a failing exit.
fn admin(args: AdminArgs) -> ExitCode {
    let failed = |message: &dyn std::fmt::Display| {
        let _ = writeln!(std::io::stderr(), "engram: {message}");
        ExitCode::FAILURE
    };
    let call = match engram_ops::admin::client::call_for(&args.command) {
        Ok(call) => call,
        Err(error) => return failed(&error),
    };
    let base_url = match args.url {
        Some(url) => url,
        None => match Config::load(args.config.as_deref(), std::env::vars()) {
            Ok(config) => {
                let mut listen = config.server.listen;
                if listen.ip().is_unspecified() {
                    listen.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
                }
                format!("http://{listen}")
            }
            Err(error) => return failed(&error),
        },
    };
    let token = std::env::var(engram_ops::admin::TOKEN_ENV).ok();
    let reply = runtime(1).and_then(|runtime| {
        runtime.block_on(engram_ops::admin::client::send(
            &base_url,
            token.as_deref(),
            args.tenant.as_deref(),
            &call,
        ))
    });
    match reply {
        Ok(reply) if reply.status.is_success() => {
            let mut stdout = std::io::stdout().lock();
            if writeln!(stdout, "{}", reply.pretty())
                .and_then(|()| stdout.flush())
                .is_err()
            {
                return ExitCode::FAILURE;
            }
            ExitCode::SUCCESS
        }
        Ok(reply) => failed(&reply.error_message()),
        Err(error) => failed(&error),
    }
}
