//! The update path: job lag (observed by the worker) and, read on each scrape, the counts the
//! outbox and the worker already keep for the management API — exported from those atomics
//! rather than counted a second time.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use prometheus::core::{Collector, Desc};
use prometheus::proto::{self, LabelPair, MetricFamily, MetricType};

use super::metrics_error;
use crate::error::Result;
use engram_proxy::recorder::outbox::Outbox;
use engram_proxy::worker::Worker;
use engram_runtime::priority;

const JOB_RESULTS: [&str; 4] = ["applied", "duplicate", "retried", "failed"];
const OUTBOX_RESULTS: [&str; 4] = ["queued", "spooled", "forwarded", "lost"];

/// Exports `OutboxStats` and `WorkerStats` as they are when scraped.
pub(super) struct StatsCollector {
    outbox: Arc<Outbox>,
    worker: Option<Arc<Worker>>,
    outbox_jobs: Desc,
    spooled: Desc,
    spooled_bytes: Desc,
    in_flight: Desc,
    in_flight_bytes: Desc,
    unrecorded_at_start: Desc,
    yields_held_back: Desc,
    /// Only with a worker: jobs, runs, conflicts, summarizer refinements, the catch-up's jobs
    /// and whether it is on.
    worker_descs: Option<[Desc; 7]>,
}

impl StatsCollector {
    pub(super) fn new(outbox: Arc<Outbox>, worker: Option<Arc<Worker>>) -> Result<StatsCollector> {
        let worker_descs = match worker {
            Some(_) => Some([
                desc(
                    "engram_jobs_total",
                    "Jobs the worker finished, by result: applied; duplicate (already in memory, a re-claim); retried (applying failed, left for a later claim); failed (gave up after worker.max_attempts).",
                    Some("result"),
                )?,
                desc(
                    "engram_worker_runs_total",
                    "Runs the worker committed: a run is one session's claimed jobs (up to worker.run_jobs), applied in one pass and one commit. engram_jobs_total{result=\"applied\"} over this is the mean run length.",
                    None,
                )?,
                desc(
                    "engram_job_conflicts_total",
                    "Job commits that lost an optimistic version race and were re-run on the newer memory.",
                    None,
                )?,
                desc(
                    "engram_summarizer_refined_total",
                    "Background summarizer retries whose diff was applied to an already recorded turn.",
                    None,
                )?,
                desc(
                    "engram_worker_catch_up_jobs_total",
                    "Jobs applied by the normal-priority catch-up (worker.max_lag_ms) because the idle-priority worker fell behind; counted in engram_jobs_total too.",
                    None,
                )?,
                desc(
                    "engram_worker_taken_over_runs_total",
                    "Runs the idle-priority worker had claimed and the catch-up applied instead, because the busy cores starved the idle worker before it finished them.",
                    None,
                )?,
                desc(
                    "engram_worker_catch_up_active",
                    "1 while the catch-up claims the jobs at normal priority (the job lag reached half of worker.max_lag_ms, or a quarter while the idle threads get no CPU), else 0.",
                    None,
                )?,
            ]),
            None => None,
        };
        Ok(StatsCollector {
            outbox,
            worker,
            outbox_jobs: desc(
                "engram_outbox_jobs_total",
                "Recorded exchanges by what became of them: queued in the store, spooled locally (store unreachable), forwarded from the spool, lost.",
                Some("result"),
            )?,
            spooled: desc(
                "engram_outbox_spooled_jobs",
                "Jobs waiting in the local spool for the store to come back.",
                None,
            )?,
            spooled_bytes: desc(
                "engram_outbox_spooled_bytes",
                "Bytes of the spooled jobs' turn texts; the embedded backend's in-memory spool holds at most 64 MiB (and 10,000 jobs), past which a recording is lost.",
                None,
            )?,
            in_flight: desc(
                "engram_recordings_in_flight",
                "Answered exchanges not yet durable as jobs.",
                None,
            )?,
            in_flight_bytes: desc(
                "engram_recordings_in_flight_bytes",
                "Bytes of the turns' texts (the user's message and the answer) the recordings in flight hold; past 64 MiB a recording goes to the local spool and past 32 MiB requests answer without memory (recording_backlog).",
                None,
            )?,
            unrecorded_at_start: desc(
                "engram_turns_unrecorded_at_start",
                "Turns the previous process answered (receipt pending or lost) and never recorded: lost by a crash or a failing store before this start.",
                None,
            )?,
            yields_held_back: desc(
                "engram_yields_held_back_total",
                "Times a recorder, committer or catch-up thread's yield gave the core to another process rather than to this one's requests, after which that thread made no yields for 100 ms: the node's other processes keep its cores busy.",
                None,
            )?,
            worker_descs,
        })
    }
}

impl Collector for StatsCollector {
    fn desc(&self) -> Vec<&Desc> {
        let mut descs = vec![
            &self.outbox_jobs,
            &self.spooled,
            &self.spooled_bytes,
            &self.in_flight,
            &self.in_flight_bytes,
            &self.unrecorded_at_start,
            &self.yields_held_back,
        ];
        if let Some(worker) = &self.worker_descs {
            descs.extend(worker.iter());
        }
        descs
    }

    fn collect(&self) -> Vec<MetricFamily> {
        let load = |value: &std::sync::atomic::AtomicU64| value.load(Ordering::Relaxed);
        let outbox = self.outbox.stats();
        let mut families = vec![
            counters(
                &self.outbox_jobs,
                &OUTBOX_RESULTS,
                [
                    load(&outbox.queued),
                    load(&outbox.spooled),
                    load(&outbox.forwarded),
                    load(&outbox.lost),
                ],
            ),
            gauge(&self.spooled, self.outbox.spooled()),
            gauge(&self.spooled_bytes, self.outbox.spooled_bytes()),
            gauge(&self.in_flight, load(&outbox.in_flight)),
            gauge(&self.in_flight_bytes, load(&outbox.in_flight_bytes)),
            gauge(&self.unrecorded_at_start, load(&outbox.unrecorded_at_start)),
            counters(
                &self.yields_held_back,
                &[""],
                [priority::yields_held_back_total()],
            ),
        ];
        if let (
            Some(worker),
            Some(
                [
                    jobs,
                    runs,
                    conflicts,
                    refined,
                    catch_up_jobs,
                    taken_over,
                    catch_up_active,
                ],
            ),
        ) = (&self.worker, &self.worker_descs)
        {
            let stats = worker.stats();
            families.push(counters(
                jobs,
                &JOB_RESULTS,
                [
                    load(&stats.applied),
                    load(&stats.duplicates),
                    load(&stats.errors),
                    load(&stats.failed),
                ],
            ));
            families.push(counters(runs, &[""], [load(&stats.runs)]));
            families.push(counters(conflicts, &[""], [load(&stats.conflicts)]));
            families.push(counters(refined, &[""], [load(&stats.summarizer_refined)]));
            families.push(counters(
                catch_up_jobs,
                &[""],
                [load(&stats.catch_up_applied)],
            ));
            families.push(counters(taken_over, &[""], [load(&stats.taken_over)]));
            families.push(gauge(catch_up_active, load(&stats.catch_up_active)));
        }
        families
    }
}

fn desc(name: &str, help: &str, label: Option<&str>) -> Result<Desc> {
    Desc::new(
        name.to_owned(),
        help.to_owned(),
        label.into_iter().map(str::to_owned).collect(),
        HashMap::new(),
    )
    .map_err(metrics_error)
}

/// A counter family: one series per label value (one unlabelled series for `[""]`).
fn counters<const N: usize>(desc: &Desc, values: &[&str; N], counts: [u64; N]) -> MetricFamily {
    let metrics = values
        .iter()
        .zip(counts)
        .map(|(value, count)| {
            let labels = match desc.variable_labels.first() {
                Some(name) => {
                    let mut pair = LabelPair::default();
                    pair.set_name(name.clone());
                    pair.set_value((*value).to_owned());
                    vec![pair]
                }
                None => Vec::new(),
            };
            let mut metric = proto::Metric::from_label(labels);
            let mut counter = proto::Counter::default();
            counter.set_value(count as f64);
            metric.set_counter(counter);
            metric
        })
        .collect();
    family(desc, MetricType::COUNTER, metrics)
}

fn gauge(desc: &Desc, value: u64) -> MetricFamily {
    let mut gauge = proto::Gauge::default();
    gauge.set_value(value as f64);
    family(
        desc,
        MetricType::GAUGE,
        vec![proto::Metric::from_gauge(gauge)],
    )
}

fn family(desc: &Desc, kind: MetricType, metrics: Vec<proto::Metric>) -> MetricFamily {
    let mut family = MetricFamily::default();
    family.set_name(desc.fq_name.clone());
    family.set_help(desc.help.clone());
    family.set_field_type(kind);
    family.set_metric(metrics);
    family
}

#[cfg(test)]
mod tests {
    use prometheus::{Encoder, TextEncoder};
    use tokio::sync::Notify;

    use prometheus::Registry;

    use super::*;
    use engram_store::{EmbeddedStore, Store};

    #[tokio::test]
    async fn outbox_counts_are_exported_as_they_are_when_scraped() {
        let dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(dir.path()).unwrap());
        let spool = engram_proxy::recorder::outbox::Spool::Memory {
            store: Arc::new(EmbeddedStore::in_memory().unwrap()),
            capacity: 10,
        };
        let outbox = Arc::new(Outbox::new(store, spool, Arc::new(Notify::new())).await);
        let registry = Registry::new();
        registry
            .register(Box::new(
                StatsCollector::new(Arc::clone(&outbox), None).unwrap(),
            ))
            .unwrap();
        outbox.stats().queued.store(3, Ordering::Relaxed);
        outbox.stats().lost.store(1, Ordering::Relaxed);
        let job = engram_store::JobId {
            user: engram_store::UserKey::new("t", "u"),
            key: "k".into(),
        };
        let _recording = outbox.recording(&job, 42);
        outbox
            .stats()
            .unrecorded_at_start
            .store(2, Ordering::Relaxed);
        let mut page = Vec::new();
        TextEncoder::new()
            .encode(&registry.gather(), &mut page)
            .unwrap();
        let page = String::from_utf8(page).unwrap();
        assert!(
            page.contains("engram_outbox_jobs_total{result=\"queued\"} 3"),
            "{page}"
        );
        assert!(page.contains("engram_outbox_jobs_total{result=\"lost\"} 1"));
        assert!(page.contains("engram_recordings_in_flight 1"));
        assert!(page.contains("engram_recordings_in_flight_bytes 42"));
        assert!(page.contains("engram_outbox_spooled_jobs 0"));
        assert!(page.contains("engram_outbox_spooled_bytes 0"));
        assert!(page.contains("engram_turns_unrecorded_at_start 2"));
        // No worker in this process: no worker series.
        assert!(!page.contains("engram_jobs_total"));
    }
}
