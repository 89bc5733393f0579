//! Assembles a running engram from its configuration: the store, the memory layer on the hot
//! path, the recorder's outbox, the worker, the management API and the HTTP server; and shuts
//! them down in order (stop accepting → drain requests and recorders → stop the worker → flush
//! the last trace spans).

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
use crate::server::{AppState, Server};
use engram_ops::admin::{AdminApi, AdminAuth};
use engram_ops::config::{Config, StoreBackend, StoreConfig};
use engram_ops::metrics::Metrics;
use engram_proxy::cache::MemoryCache;
use engram_proxy::pipeline::explain_log::ExplainLog;
use engram_proxy::pipeline::store_memory::StoreMemory;
use engram_proxy::pipeline::trust::Gate;
use engram_proxy::ratelimit::{PRUNE_INTERVAL, TokenBudget};
use engram_proxy::recorder::Recorder;
use engram_proxy::recorder::journal::{self, Journal};
use engram_proxy::recorder::outbox::{MEMORY_SPOOL_JOBS, Outbox, Spool, SpoolBounds};
use engram_proxy::summarizer::Summarizer;
use engram_proxy::telemetry::Telemetry;
use engram_proxy::upstream::Upstream;
use engram_proxy::worker::Worker;
use engram_runtime::priority;
use engram_store::{CommitListener, EmbeddedStore, RedisStore, Store};

/// Turns whose explanation this process keeps for the management API. A full 2,048-token
/// block explains ~57 items at ~200 bytes each: with 1,024 turns kept, one user at 1,000 req/s
/// peaked 13.5 MiB higher than with none (benchmarks-log.md, 2026-12-05), a twelfth of the
/// process. 256 turns is still the last second of a busy proxy and minutes of a quiet one.
pub const EXPLAINED_TURNS: usize = 256;

/// The directory, inside `store.data_dir`, of the Redis backend's local spool.
pub const SPOOL_DIR: &str = "spool";

/// The secrets engram reads from the environment at start, never from the config file.
#[derive(Debug)]
pub struct Credentials {
    /// The value of the variable `upstream.api_key_env` names.
    pub upstream_key: Option<String>,
    /// The management API's tokens.
    pub admin: AdminAuth,
    /// The client keys or signing secret of `identity.trust`.
    pub gate: Gate,
}

impl Credentials {
    /// Reads every secret the config asks for (`var` looks a variable up); one that is
    /// missing, malformed, or set for a mode not configured is a start-up error.
    pub fn from_env(config: &Config, var: impl Fn(&str) -> Option<String>) -> Result<Credentials> {
        let upstream_key = match &config.upstream.api_key_env {
            Some(name) => Some(var(name).ok_or_else(|| Error::Config {
                path: "upstream.api_key_env".into(),
                message: format!("the environment variable {name} is not set"),
            })?),
            None => None,
        };
        let admin = AdminAuth::from_env(&var)?;
        let gate = Gate::from_env(
            config.identity.trust,
            upstream_key.is_some(),
            &admin.tokens(),
            &var,
        )?;
        Ok(Credentials {
            upstream_key,
            admin,
            gate,
        })
    }

    /// No upstream key, `identity.trust: headers`, and these management tokens (tests, the
    /// evaluation harness).
    pub fn admin_only(admin: AdminAuth) -> Credentials {
        Credentials {
            upstream_key: None,
            admin,
            gate: Gate::headers(),
        }
    }
}

pub struct Engram {
    server: Server,
    worker: Option<Arc<Worker>>,
    /// The worker's own runtime (low-priority threads); `None` without a worker.
    worker_runtime: Option<priority::WorkerRuntime>,
    /// The catch-up's runtime (normal priority) that bounds the idle worker's lag; `None`
    /// without a worker at idle priority or with `worker.max_lag_ms: 0`.
    catch_up_runtime: Option<priority::WorkerRuntime>,
    outbox: Arc<Outbox>,
    token_budget: Option<Arc<TokenBudget>>,
    background: TaskTracker,
    cancel: CancellationToken,
    telemetry: Telemetry,
}

impl Engram {
    /// Opens the store and binds the listener; nothing runs until [`Engram::run`]. Traces go
    /// where `config.telemetry` says.
    pub async fn build(config: Config, credentials: Credentials) -> Result<Engram> {
        let telemetry = engram_ops::telemetry::from_config(&config.telemetry)?;
        Engram::build_with_telemetry(config, credentials, telemetry).await
    }

    /// [`Engram::build`] with the caller's tracing (tests pass an in-memory exporter's).
    pub async fn build_with_telemetry(
        config: Config,
        credentials: Credentials,
        telemetry: Telemetry,
    ) -> Result<Engram> {
        let Credentials {
            upstream_key,
            admin,
            gate,
        } = credentials;
        let upstream = Upstream::new(&config.upstream, upstream_key)?;
        // The tokenizers and the embedding model load on the first request that names a user,
        // not here: a proxy whose requests never use memory stays small (the RSS
        // budget). Measured 2026-12-05: RSS 25.5 MiB before that request, 31.7 MiB after.
        let metrics = Arc::new(Metrics::new()?);
        let cache = Arc::new(
            MemoryCache::new(config.worker.cache_users, config.worker.cache_bytes)
                .loading_on(tokio::runtime::Handle::current()),
        );
        let (store, spool) =
            open_store(&config.store, Arc::clone(&cache) as Arc<dyn CommitListener>).await?;
        let backend = match config.store.backend {
            StoreBackend::Embedded => "embedded",
            StoreBackend::Redis => "redis",
        };
        let store = metrics.metered_store(store, backend)?;
        let spool = match spool {
            Spool::Durable {
                store,
                bounds,
                held_bytes,
            } => Spool::Durable {
                store: metrics.metered_store(store, "spool")?,
                bounds,
                held_bytes,
            },
            Spool::Memory { store, capacity } => Spool::Memory {
                store: metrics.metered_store(store, "spool")?,
                capacity,
            },
        };
        let wake = Arc::new(Notify::new());
        let journal = open_journal(&config.store.data_dir)?;
        let outbox = Outbox::new(Arc::clone(&store), spool, Arc::clone(&wake))
            .await
            .with_journal(Arc::clone(&journal));
        outbox.stats().unrecorded_at_start.store(
            journal.unrecorded_at_start().len() as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
        let outbox = Arc::new(outbox);
        let memory_config = Arc::new(config.memory.clone());
        let background = TaskTracker::new();
        let cancel = CancellationToken::new();
        let idle_priority = config.worker.idle_priority;
        let catch_up = idle_priority && config.worker.max_lag_ms > 0;
        let token_budget = TokenBudget::from_config(&config.rate_limits)
            .map(|budget| Arc::new(budget.with_metrics(metrics.rate_limits.clone())));
        let worker = if config.worker.enabled {
            let summarizer = Summarizer::from_config(&config.summarizer)?
                .with_depth(config.memory.depth.clone())
                .with_metrics(metrics.summarizer.clone());
            Some(Arc::new(
                Worker::new(
                    Arc::clone(&store),
                    Arc::clone(&cache),
                    Arc::clone(&memory_config),
                    config.worker.clone(),
                    Arc::new(summarizer),
                    wake,
                    background.clone(),
                    cancel.clone(),
                )
                .with_token_budget(token_budget.clone())
                .with_metrics(metrics.worker.clone())
                .with_telemetry(telemetry.clone()),
            ))
        } else {
            None
        };
        let explains = Arc::new(ExplainLog::new(EXPLAINED_TURNS));
        let recorder = Recorder::new(
            Arc::clone(&outbox),
            Duration::from_millis(config.capture.receipt_wait_ms),
        )
        .with_journal(journal)
        .with_telemetry(telemetry.clone());
        let memory = StoreMemory::new(
            Arc::clone(&store),
            Arc::clone(&cache),
            recorder,
            memory_config,
            config.identity.clone(),
            config.hot_path_deadline(),
            Arc::clone(&explains),
        )
        .with_telemetry(telemetry.clone())
        .with_background(background.clone());
        metrics.watch(Arc::clone(&store), Arc::clone(&outbox), worker.clone())?;
        let admin = AdminApi::new(
            admin,
            store,
            cache,
            explains,
            Arc::clone(&outbox),
            worker.clone(),
            &config,
        );
        let state = AppState::new(config, upstream, Arc::new(memory), metrics, gate)
            .with_admin(Arc::new(admin))
            .with_telemetry(telemetry.clone());
        let server = Server::bind(state).await?;
        let worker_runtime = match &worker {
            Some(_) => Some(priority::worker_runtime(idle_priority)?),
            None => None,
        };
        let catch_up_runtime = match &worker {
            Some(_) if catch_up => Some(priority::catch_up_runtime()?),
            _ => None,
        };
        Ok(Engram {
            server,
            worker,
            worker_runtime,
            catch_up_runtime,
            outbox,
            token_budget,
            background,
            cancel,
            telemetry,
        })
    }

    pub fn local_addr(&self) -> Result<SocketAddr> {
        self.server.local_addr()
    }

    /// The address of `server.ops_listen`, when configured.
    pub fn ops_addr(&self) -> Result<Option<SocketAddr>> {
        self.server.ops_addr()
    }

    /// Serves until `shutdown`, drains, then stops the worker after the job in hand.
    pub async fn run(self, shutdown: impl Future<Output = ()>) -> Result<()> {
        let Engram {
            server,
            worker,
            worker_runtime,
            catch_up_runtime,
            outbox,
            token_budget,
            background,
            cancel,
            telemetry,
        } = self;
        if let (Some(worker), Some(handle)) = (
            &worker,
            worker_runtime
                .as_ref()
                .and_then(priority::WorkerRuntime::handle),
        ) {
            let catch_up = catch_up_runtime
                .as_ref()
                .and_then(priority::WorkerRuntime::handle);
            worker.start(handle, catch_up);
        }
        // The tokenizers load lazily (a few hundred ms, more in a debug build); loaded now, the
        // first requests do not wait for them.
        background.spawn_blocking(engram_memory::warm_up);
        background.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        background.spawn(prune_limits(server.state(), token_budget, cancel.clone()));
        let drain = server.state().config.drain_timeout();
        let started = tokio::time::Instant::now();
        let served = server.run(shutdown).await;
        // Recorders have finished (the server waited for them): every job is queued or spooled.
        cancel.cancel();
        background.close();
        let left = drain
            .saturating_sub(started.elapsed())
            .max(Duration::from_secs(1));
        if tokio::time::timeout(left, background.wait()).await.is_err() {
            tracing::warn!(
                "the worker did not stop in time; its leased jobs will be claimed again"
            );
        }
        telemetry.shutdown().await;
        served
    }
}

/// Drops idle keys from the rate limiters every `PRUNE_INTERVAL`, so tenant and user ids,
/// which clients choose, cannot grow them without bound.
async fn prune_limits(
    state: Arc<AppState>,
    token_budget: Option<Arc<TokenBudget>>,
    cancel: CancellationToken,
) {
    if state.limits.is_none() && token_budget.is_none() {
        return;
    }
    let mut ticks = tokio::time::interval(PRUNE_INTERVAL);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = cancel.cancelled() => return,
        }
        if let Some(limits) = &state.limits {
            limits.prune();
        }
        if let Some(budget) = &token_budget {
            budget.prune();
        }
    }
}

/// The configured store and the spool that keeps recorded exchanges while it refuses them: a
/// local file for Redis, memory for the embedded store (whose disk is the one failing). The
/// store tells `commits` of each job commit: the embedded store on its committing thread, Redis
/// as soon as a read or the commit's answer shows it landed.
pub async fn open_store(
    config: &StoreConfig,
    commits: Arc<dyn CommitListener>,
) -> Result<(Arc<dyn Store>, Spool)> {
    match config.backend {
        StoreBackend::Embedded => {
            let linger = Duration::from_millis(config.group_commit_ms);
            let store = open_embedded(config.data_dir.clone(), "store.data_dir", linger, false)
                .await?
                .with_commit_listener(commits);
            let spool = Spool::Memory {
                store: Arc::new(EmbeddedStore::in_memory()?),
                capacity: MEMORY_SPOOL_JOBS,
            };
            Ok((Arc::new(store), spool))
        }
        StoreBackend::Redis => {
            let options = config.redis_options();
            let store = RedisStore::connect_with(&config.redis_url, options)
                .await
                .map_err(|error| Error::Config {
                    path: "store.redis_url".into(),
                    message: format!("cannot connect to Redis: {error}"),
                })?
                .with_commit_listener(commits);
            let spool_dir = config.data_dir.join(SPOOL_DIR);
            let linger = Duration::from_millis(config.group_commit_ms);
            let spool = open_embedded(spool_dir, "store.data_dir", linger, true).await?;
            let dropped = spool.drop_finished_jobs().await?;
            if dropped > 0 {
                tracing::info!(
                    records = dropped,
                    "dropped the records of jobs the spool forwarded before this release"
                );
            }
            // Counted once: what an earlier process left in the spool takes its room.
            let held_bytes = spool.queued_turn_bytes().await?;
            let spool = Spool::Durable {
                store: Arc::new(spool),
                bounds: SpoolBounds {
                    jobs: config.spool_max_jobs,
                    bytes: config.spool_max_bytes,
                },
                held_bytes,
            };
            Ok((Arc::new(store), spool))
        }
    }
}

/// The journal of answers released before their recording was durable; logs the turns the
/// previous process answered and never recorded.
fn open_journal(data_dir: &std::path::Path) -> Result<Arc<Journal>> {
    let journal = Journal::open(data_dir).map_err(|error| Error::Config {
        path: "store.data_dir".into(),
        message: format!(
            "cannot open {} in {}: {error}",
            journal::FILE_NAME,
            data_dir.display()
        ),
    })?;
    let lost = journal.unrecorded_at_start();
    if !lost.is_empty() {
        tracing::error!(
            turns = lost.len(),
            jobs = %lost.iter().take(20).cloned().collect::<Vec<_>>().join(","),
            "the previous process stopped with answered turns not yet recorded; they are lost"
        );
    }
    Ok(Arc::new(journal))
}

async fn open_embedded(
    dir: std::path::PathBuf,
    key: &str,
    linger: Duration,
    spool: bool,
) -> Result<EmbeddedStore> {
    let shown = dir.display().to_string();
    tokio::task::spawn_blocking(move || {
        if spool {
            EmbeddedStore::open_spool(&dir, linger)
        } else {
            EmbeddedStore::open_with_linger(&dir, linger)
        }
    })
    .await
    .map_err(|error| Error::Internal(format!("opening the store: {error}")))?
    .map_err(|error| Error::Config {
        path: key.to_owned(),
        message: format!("cannot open the embedded store in {shown}: {error}"),
    })
}
