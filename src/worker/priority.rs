//! The update path runs on a runtime of its own whose threads (its async thread and its
//! blocking pool, where the engine work and the worker's store writes run) are scheduled with
//! Linux's `SCHED_IDLE` policy: they get the CPU only when the threads serving requests do not
//! want it. On a busy sidecar the worker then lags a little instead of adding to the clients'
//! latency; on an idle one it runs at full speed. Elsewhere, or if the policy cannot be set,
//! the threads run at normal priority.
//!
//! The embedded store's enqueues (the recorder's durable writes, after each answer) run on a
//! blocking pool of their own whose one thread is niced to 19 ([`recorder_pool`]): still ahead
//! of the idle worker, but no longer sharing the request threads' time slices. On the same
//! core, the request path's normal-priority blocking threads ran those commits for up to a slice
//! at a time; measured at 1,000 req/s with memory on, moving them took the added p99 from
//! 2.2–2.6 ms to 1.7–1.8 ms.

use tokio::runtime::{Builder, Runtime};

use crate::error::Result;

/// The worker's runtime. Dropping it (even inside another runtime, where dropping a `Runtime`
/// would panic) lets it wind down in the background.
pub struct WorkerRuntime(Option<Runtime>);

impl WorkerRuntime {
    pub fn handle(&self) -> Option<&tokio::runtime::Handle> {
        self.0.as_ref().map(Runtime::handle)
    }
}

impl Drop for WorkerRuntime {
    fn drop(&mut self) {
        if let Some(runtime) = self.0.take() {
            runtime.shutdown_background();
        }
    }
}

/// A one-thread runtime for the worker; `idle` asks for the idle scheduling policy.
pub fn worker_runtime(idle: bool) -> Result<WorkerRuntime> {
    let mut builder = Builder::new_multi_thread();
    builder
        .worker_threads(1)
        .thread_name("engram-worker")
        .enable_all();
    if idle {
        builder.on_thread_start(lower_priority);
    }
    Ok(WorkerRuntime(Some(builder.build()?)))
}

/// A runtime used only for its blocking pool: one thread, named `name`, at the lowest normal
/// priority (nice 19) where Linux allows it. `Handle::spawn_blocking` on it runs there.
pub fn recorder_pool(name: &str) -> Result<WorkerRuntime> {
    let runtime = Builder::new_current_thread()
        .thread_name(name)
        .max_blocking_threads(1)
        .on_thread_start(nice_lowest)
        .build()?;
    Ok(WorkerRuntime(Some(runtime)))
}

#[cfg(target_os = "linux")]
fn nice_lowest() {
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
        thread_native_id,
    };
    // Raising a thread's nice value needs no privilege; it applies to this thread only.
    let policy = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Other);
    if let Err(error) = set_thread_priority_and_policy(
        thread_native_id(),
        thread_priority::ThreadPriority::Min,
        policy,
    ) {
        tracing::debug!(?error, "could not lower the recorder thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn nice_lowest() {}

#[cfg(target_os = "linux")]
fn lower_priority() {
    use thread_priority::unix::{
        NormalThreadSchedulePolicy, ThreadSchedulePolicy, set_thread_priority_and_policy,
        thread_native_id,
    };
    let policy = ThreadSchedulePolicy::Normal(NormalThreadSchedulePolicy::Idle);
    if let Err(error) = set_thread_priority_and_policy(
        thread_native_id(),
        thread_priority::ThreadPriority::Min,
        policy,
    ) {
        tracing::debug!(?error, "could not lower the worker thread's priority");
    }
}

#[cfg(not(target_os = "linux"))]
fn lower_priority() {}
