//! The update path runs on a runtime of its own whose threads (its async thread and its
//! blocking pool, where the engine work and the worker's store writes run) are scheduled with
//! Linux's `SCHED_IDLE` policy: they get the CPU only when the threads serving requests do not
//! want it. On a busy sidecar the worker then lags a little instead of adding to the clients'
//! latency; on an idle one it runs at full speed. Elsewhere, or if the policy cannot be set,
//! the threads run at normal priority.

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
