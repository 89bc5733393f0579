//! A run's summaries, made once whichever pass applies it.
//!
//! A job's summary can cost a model call and its tenant's summarizer tokens. A run is applied
//! again after a store error (`STORE_RETRIES`), and a run taken over from a starved idle loop
//! is applied by both loops (see [`super::held`]): each pass asked the summarizer again, so one
//! turn cost up to two model calls and twice its tokens (with both cores busy,
//! `rate_limits::a_spent_summarizer_token_budget_…` read two refusals for one turn). So each
//! job of a run has a slot here, shared by every pass over the run in this process: the first
//! pass to reach a job makes its summary, the others take it.
//!
//! A model's answer is waited for off the idle threads ([`RunSummaries::get_or_make_on`]): a
//! task on the catch-up's normal-priority runtime holds the slot while it waits for the model,
//! so a starved idle loop cannot keep it, and the pass that took its run over waits for that
//! answer instead of asking the model again.

use std::collections::HashMap;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Mutex;
use tokio_util::task::TaskTracker;

use engram_store::ClaimedJob;

/// One job's summary (`T`), once a pass made it; held while one makes it.
type Slot<T> = Arc<Mutex<Option<T>>>;

/// One slot per job of a run, by job key.
#[derive(Debug)]
pub struct RunSummaries<T> {
    slots: HashMap<String, Slot<T>>,
}

impl<T: Clone + Send + 'static> RunSummaries<T> {
    pub fn new(run: &[ClaimedJob]) -> RunSummaries<T> {
        let slots = run
            .iter()
            .map(|claimed| (claimed.job.id.key.clone(), Slot::default()))
            .collect();
        RunSummaries { slots }
    }

    /// The summary of the job keyed `key`: the one a pass over the run made already, else
    /// `make`'s, kept for the others. While another pass is making it, waits for that one; for
    /// at most `wait` when given, then makes its own and does not keep it, since the other
    /// pass may be a starved idle task, which is what the taken-over pass must not wait on.
    /// A key the run does not hold is made each time.
    pub async fn get_or_make<F, Fut>(&self, key: &str, wait: Option<Duration>, make: F) -> T
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = T>,
    {
        let Some(slot) = self.slots.get(key) else {
            return make().await;
        };
        let held = match wait {
            Some(wait) => tokio::time::timeout(wait, slot.lock()).await.ok(),
            None => Some(slot.lock().await),
        };
        let Some(mut held) = held else {
            return make().await;
        };
        kept_or_made(&mut held, make).await
    }

    /// [`RunSummaries::get_or_make`] for what waits on a model (a network call, little CPU): a
    /// task on `runtime` (normal priority) takes the slot, makes it and keeps it, and every pass
    /// waits for that task however long it takes, since no starved thread can hold the slot. If
    /// the task does not finish (the runtime shutting down), `make` is called here.
    pub async fn get_or_make_on<F, Fut>(
        &self,
        key: &str,
        runtime: &tokio::runtime::Handle,
        tasks: &TaskTracker,
        make: F,
    ) -> T
    where
        F: Fn() -> Fut + Send + Sync + 'static,
        Fut: Future<Output = T> + Send + 'static,
    {
        let Some(slot) = self.slots.get(key) else {
            return make().await;
        };
        let (slot, make) = (Arc::clone(slot), Arc::new(make));
        let maker = Arc::clone(&make);
        let made = tasks.spawn_on(
            async move {
                let mut held = slot.lock_owned().await;
                kept_or_made(&mut held, || maker()).await
            },
            runtime,
        );
        match made.await {
            Ok(summary) => summary,
            Err(_) => make().await,
        }
    }
}

/// What the held slot keeps, else `make`'s, kept there. Made while the slot is held, so a
/// pass arriving meanwhile waits for it; a pass dropped mid-way leaves the slot empty for the
/// next.
async fn kept_or_made<T: Clone, Fut: Future<Output = T>>(
    held: &mut Option<T>,
    make: impl FnOnce() -> Fut,
) -> T {
    if let Some(kept) = held.as_ref() {
        return kept.clone();
    }
    let made = make().await;
    *held = Some(made.clone());
    made
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::sync::Arc;
    use std::sync::atomic::{AtomicU32, Ordering};

    use super::*;
    use crate::summarizer::{Summarizer, Summary};

    /// A run of one job per key, keyed as `worker::tests::job` keys user `u`'s turns.
    fn run(turns: &[usize]) -> Vec<ClaimedJob> {
        turns
            .iter()
            .map(|turn| ClaimedJob {
                job: super::super::tests::job("u", *turn),
                attempt: 1,
            })
            .collect()
    }

    fn key(turn: usize) -> String {
        super::super::tests::job("u", turn).id.key
    }

    /// A summary made by counting into `made`.
    async fn counted(made: &AtomicU32) -> Summary {
        made.fetch_add(1, Ordering::SeqCst);
        Summarizer::heuristic()
            .extract("I moved to Oslo.", "Noted.")
            .await
    }

    #[tokio::test]
    async fn each_job_is_summarized_once_by_every_pass_over_the_run() {
        let summaries = RunSummaries::<Summary>::new(&run(&[0, 1]));
        let made = AtomicU32::new(0);
        for _pass in 0..3 {
            for turn in [0, 1] {
                summaries
                    .get_or_make(&key(turn), None, || counted(&made))
                    .await;
            }
        }
        assert_eq!(made.load(Ordering::SeqCst), 2);
        // A key outside the run is not kept.
        summaries
            .get_or_make(&key(2), None, || counted(&made))
            .await;
        summaries
            .get_or_make(&key(2), None, || counted(&made))
            .await;
        assert_eq!(made.load(Ordering::SeqCst), 4);
    }

    /// A pass that arrives while another makes the summary takes that one; one that may wait
    /// only briefly makes its own once the wait is over, and the slot keeps the first.
    #[tokio::test]
    async fn a_pass_waits_for_the_summary_being_made_at_most_its_wait() {
        let tasks = tokio_util::task::TaskTracker::new();
        let summaries = Arc::new(RunSummaries::<Summary>::new(&run(&[0])));
        let made = Arc::new(AtomicU32::new(0));
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let slow = {
            let (summaries, made) = (Arc::clone(&summaries), Arc::clone(&made));
            tasks.spawn(async move {
                summaries
                    .get_or_make(&key(0), None, || async {
                        released.await.unwrap();
                        counted(&made).await
                    })
                    .await
            })
        };
        tokio::task::yield_now().await;
        // Brief: it gives up on the slow pass and makes its own.
        let brief = Some(Duration::from_millis(20));
        summaries
            .get_or_make(&key(0), brief, || counted(&made))
            .await;
        assert_eq!(made.load(Ordering::SeqCst), 1);
        // Patient: it waits for the slow pass and takes its summary.
        let patient = {
            let (summaries, made) = (Arc::clone(&summaries), Arc::clone(&made));
            tasks.spawn(async move {
                summaries
                    .get_or_make(&key(0), None, || counted(&made))
                    .await
            })
        };
        tokio::task::yield_now().await;
        release.send(()).unwrap();
        slow.await.unwrap();
        patient.await.unwrap();
        assert_eq!(made.load(Ordering::SeqCst), 2);
    }

    /// A model's summary is made by a task on the given runtime, which holds the slot: a pass
    /// that started it and then got no CPU (a starved idle task, here a future polled once and
    /// left) does not hold the slot, so the pass that took the run over waits for that summary
    /// instead of making a second (which `get_or_make`'s brief wait does, above).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_model_summary_started_by_a_starved_pass_is_made_once() {
        let tasks = tokio_util::task::TaskTracker::new();
        let runtime = tokio::runtime::Handle::current();
        let summaries = RunSummaries::<Summary>::new(&run(&[0]));
        let made = Arc::new(AtomicU32::new(0));
        let (release, released) = tokio::sync::watch::channel(false);
        let make = {
            let made = Arc::clone(&made);
            move || {
                let (made, mut released) = (Arc::clone(&made), released.clone());
                async move {
                    let _ = released.wait_for(|open| *open).await;
                    counted(&made).await
                }
            }
        };
        let key = key(0);
        let mut starved =
            std::pin::pin!(summaries.get_or_make_on(&key, &runtime, &tasks, make.clone()));
        std::future::poll_fn(|cx| {
            assert!(starved.as_mut().poll(cx).is_pending());
            std::task::Poll::Ready(())
        })
        .await;
        let taken_over = summaries.get_or_make_on(&key, &runtime, &tasks, make);
        let opened = async {
            // Past the brief wait a taken-over pass gave the old slot holder.
            tokio::time::sleep(Duration::from_millis(150)).await;
            release.send(true).unwrap();
        };
        let (summary, ()) = tokio::join!(taken_over, opened);
        assert_eq!(made.load(Ordering::SeqCst), 1);
        assert_eq!(starved.await, summary);
        assert_eq!(made.load(Ordering::SeqCst), 1);
    }
}
