//! The HTTP layer: accept loop, graceful shutdown, and the route table. Handlers stay thin; the
//! work lives in `upstream`, `openai`, and the memory layer behind `pipeline`.

mod chat;
mod idle;
mod layers;
mod passthrough;
mod router;

use std::convert::Infallible;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use http::HeaderMap;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::error::Error;
use engram_ops::admin::AdminApi;
use engram_ops::config::Config;
use engram_ops::metrics::Metrics;
use engram_proxy::pipeline::MemoryLayer;
use engram_proxy::pipeline::trust::{Gate, Vouched};
use engram_proxy::ratelimit::RequestLimits;
use engram_proxy::telemetry::Telemetry;
use engram_proxy::upstream::Upstream;

/// Everything a request handler needs, shared behind one `Arc`.
pub struct AppState {
    pub config: Config,
    pub upstream: Upstream,
    pub memory: Arc<dyn MemoryLayer>,
    pub metrics: Arc<Metrics>,
    /// Who vouches for a proxied request's identity (`identity.trust`).
    pub gate: Gate,
    /// The management API; `None` serves 404 under `/engram/`.
    pub admin: Option<Arc<AdminApi>>,
    /// Per-tenant and per-user request rates; `None` when no limit is configured.
    pub limits: Option<RequestLimits>,
    /// Spans of proxied requests; off by default.
    pub telemetry: Telemetry,
    /// Connections, recorders and any other background work; shutdown waits for all of it.
    pub tasks: TaskTracker,
    draining: AtomicBool,
}

impl AppState {
    pub fn new(
        config: Config,
        upstream: Upstream,
        memory: Arc<dyn MemoryLayer>,
        metrics: Arc<Metrics>,
        gate: Gate,
    ) -> Self {
        AppState {
            limits: RequestLimits::from_config(&config.rate_limits),
            config,
            upstream,
            memory,
            metrics,
            gate,
            admin: None,
            telemetry: Telemetry::default(),
            tasks: TaskTracker::new(),
            draining: AtomicBool::new(false),
        }
    }

    pub fn with_admin(mut self, admin: Arc<AdminApi>) -> Self {
        self.admin = Some(admin);
        self
    }

    pub fn with_telemetry(mut self, telemetry: Telemetry) -> Self {
        self.telemetry = telemetry;
        self
    }

    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// The request's credential checked against the identity it names (`identity.trust`):
    /// the first thing a proxied request goes through, before its body is read.
    fn authenticate(&self, headers: &HeaderMap) -> Result<Vouched, Error> {
        self.gate
            .check(headers, engram_proxy::pipeline::trust::unix_now())
    }
}

pub struct Server {
    listener: TcpListener,
    /// `server.ops_listen`: health, readiness and metrics only.
    ops_listener: Option<TcpListener>,
    state: Arc<AppState>,
}

impl Server {
    pub async fn bind(state: AppState) -> Result<Server, Error> {
        let listener = bind(state.config.server.listen, "server.listen").await?;
        let ops_listener = match state.config.server.ops_listen {
            Some(address) => Some(bind(address, "server.ops_listen").await?),
            None => None,
        };
        Ok(Server {
            listener,
            ops_listener,
            state: Arc::new(state),
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr, Error> {
        Ok(self.listener.local_addr()?)
    }

    /// The ops listener's address, when there is one.
    pub fn ops_addr(&self) -> Result<Option<SocketAddr>, Error> {
        Ok(match &self.ops_listener {
            Some(listener) => Some(listener.local_addr()?),
            None => None,
        })
    }

    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Serves until `shutdown` resolves, then drains: stops accepting, lets in-flight requests
    /// and streams finish, then waits for background tasks, all within the drain timeout.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<(), Error> {
        let Server {
            listener,
            ops_listener,
            state,
        } = self;
        let server = &state.config.server;
        let header_read_timeout = Duration::from_millis(server.header_read_timeout_ms);
        let mut connections = auto::Builder::new(TokioExecutor::new());
        // hyper starts the header timer also while a kept-alive connection waits for its next
        // request, so one timeout bounds slow headers and idle HTTP/1.1 connections.
        connections
            .http1()
            .keep_alive(true)
            .max_buf_size(256 * 1024)
            .timer(TokioTimer::new())
            .header_read_timeout(header_read_timeout);
        connections
            .http2()
            .timer(TokioTimer::new())
            .keep_alive_interval(Duration::from_millis(server.http2_keep_alive_interval_ms))
            .keep_alive_timeout(header_read_timeout);
        let gate = Arc::new(ConnectionGate::new(
            server.max_connections,
            server.ops_reserve_connections,
        ));
        let idle_timeout = Duration::from_millis(server.idle_timeout_ms);
        // Connections, apart from the other tasks, so the drain can wait for them first.
        let open_connections = TaskTracker::new();
        let (close_all, _) = tokio::sync::watch::channel(false);
        tokio::pin!(shutdown);

        loop {
            let (accepted, ops) = tokio::select! {
                accepted = listener.accept() => (accepted, false),
                accepted = accept_if_any(ops_listener.as_ref()) => (accepted, true),
                () = &mut shutdown => break,
            };
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // EMFILE and friends: back off instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(admitted) = gate.admit() else {
                // Past the reserve too: closed at once, so the descriptor is free again.
                continue;
            };
            let reserved = admitted.reserved.then_some(gate.max);
            // A reserve place is for a health check or a scrape, which asks at once: one held
            // idle is given back soon, so a client holding many connections cannot keep
            // the reserve too.
            let idle_limit = if admitted.reserved {
                idle_timeout.min(RESERVE_IDLE_TIMEOUT)
            } else {
                idle_timeout
            };
            let _ = stream.set_nodelay(true);
            let activity = idle::Activity::new();
            let handler_state = state.clone();
            let requests = Arc::clone(&activity);
            let service = service_fn(move |request| {
                let state = handler_state.clone();
                let open = requests.begin();
                async move {
                    let response = match reserved {
                        Some(max_connections) => {
                            router::route_reserved(state, request, max_connections).await
                        }
                        None if ops => router::route_ops(state, request).await,
                        None => router::route(state, request).await,
                    };
                    Ok::<_, Infallible>(idle::held_open(response, open))
                }
            });
            let connection = connections
                .serve_connection_with_upgrades(TokioIo::new(stream), service)
                .into_owned();
            let counted = open_connections.token();
            let mut close_signal = close_all.subscribe();
            state.tasks.spawn(async move {
                let _admitted = admitted;
                let _counted = counted;
                tokio::pin!(connection);
                // Asked to close by shutdown or by idleness: the connection finishes its open
                // requests and streams, then ends (HTTP/2 with a GOAWAY).
                let mut asked_to_close = false;
                let ended = loop {
                    tokio::select! {
                        ended = connection.as_mut() => break ended,
                        _ = close_signal.changed(), if !asked_to_close => {
                            asked_to_close = true;
                            connection.as_mut().graceful_shutdown();
                        }
                        () = activity.idle_for(idle_limit), if !asked_to_close => {
                            asked_to_close = true;
                            connection.as_mut().graceful_shutdown();
                        }
                    }
                };
                if let Err(error) = ended {
                    tracing::debug!(%peer, error = %error, "connection ended with an error");
                }
            });
        }

        drop(listener);
        drop(ops_listener);
        state.draining.store(true, Ordering::Release);
        let drain = state.config.drain_timeout();
        let started = tokio::time::Instant::now();
        tracing::info!(
            connections = open_connections.len(),
            ?drain,
            "shutting down: draining"
        );
        close_all.send_replace(true);
        open_connections.close();
        if tokio::time::timeout(drain, open_connections.wait())
            .await
            .is_err()
        {
            tracing::warn!("drain timeout reached with connections still open; closing them");
        }
        state.tasks.close();
        let left = drain
            .saturating_sub(started.elapsed())
            .max(Duration::from_millis(100));
        if tokio::time::timeout(left, state.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!(
                tasks = state.tasks.len(),
                "background tasks still running at exit"
            );
        }
        tracing::info!("shutdown complete");
        Ok(())
    }
}

/// Counts open client connections against `server.max_connections`, lowered to what the
/// process's open-file limit leaves, so the reserve still has descriptors to answer health
/// checks when a client holds many connections open.
struct ConnectionGate {
    open: AtomicUsize,
    /// Connections served in full.
    max: usize,
    /// Connections past `max` served only the ops routes.
    reserve: usize,
}

/// Descriptors kept for everything but client connections: the store, the upstream pool, logs.
const DESCRIPTORS_FOR_THE_REST: usize = 128;

/// How long a connection admitted from the ops reserve may stay without a request open.
const RESERVE_IDLE_TIMEOUT: Duration = Duration::from_secs(1);

impl ConnectionGate {
    fn new(max: usize, reserve: usize) -> ConnectionGate {
        let max = match open_file_limit() {
            Some(limit) => {
                let room = limit
                    .saturating_sub(DESCRIPTORS_FOR_THE_REST + reserve)
                    .max(1);
                if room < max {
                    tracing::warn!(
                        max_connections = max,
                        open_file_limit = limit,
                        effective = room,
                        "server.max_connections lowered to what the open-file limit leaves"
                    );
                }
                max.min(room)
            }
            None => max,
        };
        ConnectionGate {
            open: AtomicUsize::new(0),
            max,
            reserve,
        }
    }

    /// A place for one more connection; `None` past the reserve.
    fn admit(self: &Arc<Self>) -> Option<Admitted> {
        let before = self.open.fetch_add(1, Ordering::AcqRel);
        let admitted = Admitted {
            gate: Arc::clone(self),
            reserved: before >= self.max,
        };
        (before < self.max.saturating_add(self.reserve)).then_some(admitted)
    }
}

/// One open connection; dropping it frees its place.
struct Admitted {
    gate: Arc<ConnectionGate>,
    /// Past `max_connections`: only the ops routes, then closed.
    reserved: bool,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.gate.open.fetch_sub(1, Ordering::AcqRel);
    }
}

/// The soft limit on open files (`/proc/self/limits`), where there is one to read.
fn open_file_limit() -> Option<usize> {
    let limits = std::fs::read_to_string("/proc/self/limits").ok()?;
    let line = limits
        .lines()
        .find(|line| line.starts_with("Max open files"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}

async fn bind(address: SocketAddr, key: &str) -> Result<TcpListener, Error> {
    TcpListener::bind(address)
        .await
        .map_err(|error| Error::Config {
            path: key.to_owned(),
            message: format!("cannot listen on {address}: {error}"),
        })
}

/// The next connection on `listener`; never, without one.
async fn accept_if_any(
    listener: Option<&TcpListener>,
) -> std::io::Result<(tokio::net::TcpStream, SocketAddr)> {
    match listener {
        Some(listener) => listener.accept().await,
        None => std::future::pending().await,
    }
}

/// Resolves on SIGTERM or SIGINT.
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(error) => {
                tracing::warn!(%error, "cannot listen for SIGTERM; only SIGINT stops the server");
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    {
        let _ = interrupt.await;
    }
}
