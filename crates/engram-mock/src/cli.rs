//! The mock's command line (`engram-mock [OPTIONS]`), and running it: in a process of its own
//! ([`MockArgs::run`], the binary and the benchmarks), or on a thread of the calling process
//! ([`MockArgs::start_thread`], the integration tests).

use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use tokio::sync::oneshot;

use crate::{MockOptions, MockServer};

/// What the binary prints first, with the address after it; tests and scripts read it.
pub const LISTENING: &str = "mock-upstream listening on ";

#[derive(Debug, Parser)]
#[command(
    name = "engram-mock",
    version,
    about = "An OpenAI-compatible mock upstream (engram's tests, benchmarks, quickstart)"
)]
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
    /// Forward every request, untouched, to this base URL (`http://host:port`) instead of
    /// answering it: a bare pass-through, the floor for a proxy's added latency.
    #[arg(long, value_name = "URL")]
    pub forward: Option<String>,
    /// Tokio worker threads; 0 means one per core.
    #[arg(long, default_value_t = 0)]
    pub worker_threads: usize,
}

impl MockArgs {
    pub fn options(&self) -> MockOptions {
        MockOptions {
            listen: self.listen,
            latency: Duration::from_millis(self.latency_ms),
            chunks: self.chunks,
            chunk_size: self.chunk_size,
            chunk_delay: Duration::from_millis(self.chunk_delay_ms),
            echo: self.echo,
            record: self.record.clone(),
            reply: self.reply.clone(),
            forward: self.forward.clone(),
        }
    }

    /// Serves until SIGINT or SIGTERM, after printing [`LISTENING`] and the address on stdout.
    pub fn run(self) -> std::io::Result<()> {
        let options = self.options();
        runtime(self.worker_threads)?.block_on(async move {
            let server = MockServer::bind(options).await?;
            let address = server.local_addr()?;
            let mut stdout = std::io::stdout();
            let _ = writeln!(stdout, "{LISTENING}http://{address}");
            let _ = stdout.flush();
            tokio::select! {
                result = server.run() => result,
                () = shutdown_signal() => Ok(()),
            }
        })
    }

    /// Serves on a thread of its own (with its own runtime, so it may be called from inside
    /// another) until the returned handle is dropped; the listener is bound when this returns.
    pub fn start_thread(self) -> std::io::Result<MockThread> {
        let options = self.options();
        let worker_threads = self.worker_threads;
        let (stop, stopped) = oneshot::channel::<()>();
        let (ready, bound) = std::sync::mpsc::channel::<std::io::Result<SocketAddr>>();
        let thread = std::thread::Builder::new()
            .name("engram-mock".into())
            .spawn(move || {
                let runtime = match runtime(worker_threads) {
                    Ok(runtime) => runtime,
                    Err(error) => {
                        let _ = ready.send(Err(error));
                        return;
                    }
                };
                runtime.block_on(async move {
                    let server = match MockServer::bind(options).await {
                        Ok(server) => server,
                        Err(error) => {
                            let _ = ready.send(Err(error));
                            return;
                        }
                    };
                    let _ = ready.send(server.local_addr());
                    tokio::select! {
                        _ = server.run() => {}
                        _ = stopped => {}
                    }
                });
                // Dropping the runtime here ends every connection still open.
                drop(runtime);
            })?;
        let address = bound
            .recv()
            .map_err(|_| std::io::Error::other("the mock's thread ended before it listened"))??;
        Ok(MockThread {
            address,
            stop: Some(stop),
            thread: Some(thread),
        })
    }
}

fn runtime(worker_threads: usize) -> std::io::Result<tokio::runtime::Runtime> {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    builder.enable_all();
    if worker_threads > 0 {
        builder.worker_threads(worker_threads);
    }
    builder.build()
}

/// A mock served on a thread of this process; dropping it stops the mock, closes its
/// connections and frees its port before returning.
pub struct MockThread {
    address: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl MockThread {
    pub fn local_addr(&self) -> SocketAddr {
        self.address
    }
}

impl Drop for MockThread {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// SIGINT (Ctrl-C) or, on Unix, SIGTERM.
async fn shutdown_signal() {
    let interrupt = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        () = interrupt => {}
        () = terminate => {}
    }
}
