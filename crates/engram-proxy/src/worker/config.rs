//! `worker.*`: how the update path runs.

use serde::Deserialize;

/// The update path: the in-process worker that applies recorded exchanges to memory.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct WorkerConfig {
    /// Run the worker in this process. Off for a proxy that only records (another process, or
    /// another replica on the same Redis, applies the jobs).
    pub enabled: bool,
    /// Runs applied at once (a run is one session's claimed jobs, applied in order).
    pub concurrency: usize,
    /// Jobs claimed at once, so the longest run: a run's jobs share one state read, one prefetch,
    /// one encode and one commit, so a session with a backlog is applied in long runs. With an
    /// LLM summarizer a run's jobs wait for their model calls one after another, so the claim
    /// is then `concurrency` jobs instead.
    pub run_jobs: usize,
    /// How long a claimed job stays leased; a worker that dies holding it loses it after this.
    pub lease_ms: u64,
    /// How often an idle worker looks for jobs recorded by other processes. Jobs recorded by
    /// this process wake it at once.
    pub poll_interval_ms: u64,
    /// Claims of one job before it is marked failed.
    pub max_attempts: u32,
    /// Users whose memory and search index stay cached in this process.
    pub cache_users: usize,
    /// Bytes (estimated) the cached memories and indexes may take in all; least recently used
    /// out. A memory larger than this is not cached.
    pub cache_bytes: usize,
    /// Run the worker's threads with the idle scheduling policy (Linux), so applying memory
    /// never takes CPU from serving requests.
    pub idle_priority: bool,
    /// With `idle_priority`: the job lag to keep under. When the idle threads fall behind (every
    /// core busy, so they get no CPU), a catch-up on a normal-priority thread applies the jobs
    /// once they have waited half of this (a quarter, while the idle threads are starved). 0
    /// turns the catch-up off.
    pub max_lag_ms: u64,
}

impl Default for WorkerConfig {
    fn default() -> Self {
        WorkerConfig {
            enabled: true,
            concurrency: 8,
            run_jobs: 64,
            lease_ms: 30_000,
            poll_interval_ms: 100,
            max_attempts: 5,
            cache_users: 4096,
            cache_bytes: 256 * 1024 * 1024,
            idle_priority: true,
            max_lag_ms: 1000,
        }
    }
}
