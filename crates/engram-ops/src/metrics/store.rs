//! A [`Store`] that times every operation of the store it wraps and counts its errors, by
//! operation and backend. Every method forwards to the wrapped store's own (including those
//! with a provided body), so a backend's optimised `claim_batch` or `commit_jobs` still runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, Registry};

use super::{STORE_BUCKETS, child, counter_vec, histogram_vec, try_array};
use crate::error::{Error, Result};
use engram_memory::{CandidateId, ExchangeInput, MemoryState};
use engram_runtime::BoxFuture;
use engram_store::{
    Appended, ClaimedJob, EncodedState, Enqueued, ForgetReport, HotRecord, Job, JobId, JobQueue,
    JobState, MemoryRecords, Placement, RawEntry, Store, UserKey,
};

/// The `operation` label, one per method of the store traits (`MemoryRecords`, `JobQueue`,
/// `Store`).
#[derive(Debug, Clone, Copy)]
enum Operation {
    HotRecord,
    EndArrival,
    LoadState,
    SaveState,
    SaveEncodedState,
    SavePrefetched,
    AppendRaw,
    ReadRaw,
    Enqueue,
    Claim,
    ClaimBatch,
    Finish,
    Ack,
    ClearForwarded,
    Fail,
    CommitJobs,
    JobState,
    QueueDepth,
    ForgetUser,
}

const OPERATIONS: [&str; 19] = [
    "hot_record",
    "end_arrival",
    "load_state",
    "save_state",
    "save_encoded_state",
    "save_prefetched",
    "append_raw",
    "read_raw",
    "enqueue",
    "claim",
    "claim_batch",
    "finish",
    "ack",
    "clear_forwarded",
    "fail",
    "commit_jobs",
    "job_state",
    "queue_depth",
    "forget_user",
];

/// The registered families; [`MeteredStore::new`] resolves a backend's series from them.
pub(super) struct StoreFamilies {
    latency: HistogramVec,
    errors: IntCounterVec,
    bytes: IntCounterVec,
}

impl StoreFamilies {
    pub(super) fn new(registry: &Registry) -> Result<StoreFamilies> {
        Ok(StoreFamilies {
            latency: histogram_vec(
                registry,
                "engram_store_operation_duration_seconds",
                "One store operation, by operation and backend (embedded, redis, spool); an operation abandoned by its caller's deadline counts up to that point.",
                &["operation", "backend"],
                STORE_BUCKETS,
            )?,
            errors: counter_vec(
                registry,
                "engram_store_errors_total",
                "Store operations that failed, by operation and backend (lost optimistic-version races and jobs of forgotten users are outcomes, not errors).",
                &["operation", "backend"],
            )?,
            bytes: counter_vec(
                registry,
                "engram_store_bytes_total",
                "Memory bytes a store operation read or wrote, by operation, backend and direction: hot states and items read by the hot path, items and exchanges written by the recorder and the worker.",
                &["operation", "backend", "direction"],
            )?,
        })
    }
}

struct Series {
    latency: Histogram,
    errors: IntCounter,
    read: IntCounter,
    written: IntCounter,
}

pub struct MeteredStore {
    inner: Arc<dyn Store>,
    /// By `Operation as usize`.
    series: [Series; OPERATIONS.len()],
}

impl MeteredStore {
    pub(super) fn new(
        inner: Arc<dyn Store>,
        families: &StoreFamilies,
        backend: &'static str,
    ) -> Result<MeteredStore> {
        Ok(MeteredStore {
            inner,
            series: try_array(|index| {
                let labels = [OPERATIONS[index], backend];
                Ok(Series {
                    latency: child(&families.latency, &labels)?,
                    errors: child(&families.errors, &labels)?,
                    read: child(&families.bytes, &[OPERATIONS[index], backend, "read"])?,
                    written: child(&families.bytes, &[OPERATIONS[index], backend, "written"])?,
                })
            })?,
        })
    }

    fn timed<'a, T: 'a>(
        &'a self,
        operation: Operation,
        future: BoxFuture<'a, Result<T>>,
    ) -> BoxFuture<'a, Result<T>> {
        Box::pin(async move {
            let series = &self.series[operation as usize];
            let _timer = Timer {
                latency: &series.latency,
                started: Instant::now(),
            };
            let result = future.await;
            if let Err(error) = &result
                && !matches!(error, Error::StoreConflict { .. } | Error::JobGone(_))
            {
                series.errors.inc();
            }
            result
        })
    }
}

impl MeteredStore {
    fn wrote(&self, operation: Operation, bytes: usize) {
        self.series[operation as usize]
            .written
            .inc_by(u64::try_from(bytes).unwrap_or(u64::MAX));
    }

    /// [`MeteredStore::timed`] for the hot-path read, counting the bytes it read.
    fn timed_read<'a>(
        &'a self,
        operation: Operation,
        future: BoxFuture<'a, Result<HotRecord>>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        let timed = self.timed(operation, future);
        Box::pin(async move {
            let record = timed.await?;
            self.series[operation as usize]
                .read
                .inc_by(record.bytes_read);
            Ok(record)
        })
    }
}

/// Observes on drop, so an operation its caller gave up on (the hot-path deadline) is timed
/// too, up to the moment it was abandoned.
struct Timer<'a> {
    latency: &'a Histogram,
    started: Instant,
}

impl Drop for Timer<'_> {
    fn drop(&mut self) {
        self.latency.observe(self.started.elapsed().as_secs_f64());
    }
}

/// Writes each method of a store trait as a call to the wrapped store's own, timed under its
/// operation (`timed`, or `timed_read` to count the bytes read), after counting the bytes it
/// writes. Every method is listed, defaulted ones included: the default would bypass the inner
/// store's own version (Redis notes arrivals in `hot_record_arriving`; without it,
/// cross-replica order broke).
macro_rules! forward_metered {
    ($(fn $name:ident($($arg:ident: $ty:ty),*) -> $out:ty
        = $timer:ident($operation:ident) $(, wrote $bytes:expr)?;)*) => {$(
        fn $name<'a>(&'a self, $($arg: $ty),*) -> BoxFuture<'a, Result<$out>> {
            $(self.wrote(Operation::$operation, $bytes);)?
            self.$timer(Operation::$operation, self.inner.$name($($arg),*))
        }
    )*};
}

impl MemoryRecords for MeteredStore {
    forward_metered! {
        fn hot_record(user: &'a UserKey, session_id: &'a str, cached_version: Option<u64>)
            -> HotRecord = timed_read(HotRecord);
        fn hot_record_arriving(
            user: &'a UserKey,
            session_id: &'a str,
            cached_version: Option<u64>,
            turn_id: &'a str,
            arrival_us: u64
        ) -> HotRecord = timed_read(HotRecord);
        fn hot_record_catching_up(
            user: &'a UserKey,
            session_id: &'a str,
            cached_version: u64,
            arriving: Option<(&'a str, u64)>
        ) -> HotRecord = timed_read(HotRecord);
        fn end_arrival(user: &'a UserKey, session_id: &'a str, turn_id: &'a str)
            -> () = timed(EndArrival);
        fn load_state(user: &'a UserKey) -> Option<MemoryState> = timed(LoadState);
        fn save_state(user: &'a UserKey, state: &'a MemoryState, expected_version: u64)
            -> () = timed(SaveState);
        fn save_encoded_state(user: &'a UserKey, state: &'a EncodedState, expected_version: u64)
            -> () = timed(SaveEncodedState), wrote state.size();
        fn save_prefetched(user: &'a UserKey, session_id: &'a str, candidates: &'a [CandidateId])
            -> () = timed(SavePrefetched);
        fn append_raw(user: &'a UserKey, exchange_id: &'a str, exchange: &'a ExchangeInput)
            -> Appended = timed(AppendRaw), wrote exchange.text_bytes();
        fn read_raw(user: &'a UserKey) -> Vec<RawEntry> = timed(ReadRaw);
    }
}

impl JobQueue for MeteredStore {
    forward_metered! {
        fn enqueue(job: &'a Job) -> Enqueued = timed(Enqueue), wrote job.exchange.text_bytes();
        fn enqueue_run(jobs: &'a [Job]) -> usize = timed(Enqueue),
            wrote jobs_bytes(jobs);
        fn claim(consumer: &'a str, lease: Duration) -> Option<ClaimedJob> = timed(Claim);
        fn claim_batch(consumer: &'a str, lease: Duration, max: usize)
            -> Vec<ClaimedJob> = timed(ClaimBatch);
        fn claim_runs(consumer: &'a str, lease: Duration, jobs: usize, sessions: usize)
            -> Vec<ClaimedJob> = timed(ClaimBatch);
        fn finish(job: &'a JobId, state: JobState) -> bool = timed(Finish);
        fn ack(job: &'a JobId) -> bool = timed(Ack);
        fn clear_forwarded(jobs: &'a [JobId]) -> usize = timed(ClearForwarded);
        fn fail(job: &'a JobId, reason: &'a str) -> bool = timed(Fail);
        fn job_state(job: &'a JobId) -> Option<JobState> = timed(JobState);
        fn queue_depth() -> u64 = timed(QueueDepth);
    }

    /// Timed as an enqueue, from the placement to the answer.
    fn place(&self, job: Job) -> Placement {
        let series = &self.series[Operation::Enqueue as usize];
        let bytes = job.exchange.text_bytes();
        let started = Instant::now();
        match self.inner.place(job) {
            Placement::Placed(answer) => {
                self.wrote(Operation::Enqueue, bytes);
                let latency = series.latency.clone();
                let errors = series.errors.clone();
                Placement::Placed(Box::pin(async move {
                    let _timer = Timer {
                        latency: &latency,
                        started,
                    };
                    let result = answer.await;
                    if result.is_err() {
                        errors.inc();
                    }
                    result
                }))
            }
            other => other,
        }
    }

    fn resume_placing(&self) {
        self.inner.resume_placing();
    }

    fn claims_whole_runs(&self) -> bool {
        self.inner.claims_whole_runs()
    }

    fn orders_by_arrival(&self) -> bool {
        self.inner.orders_by_arrival()
    }
}

impl Store for MeteredStore {
    forward_metered! {
        fn commit_jobs(
            jobs: &'a [Job],
            state: &'a EncodedState,
            expected_version: u64,
            prefetched: &'a [CandidateId]
        ) -> () = timed(CommitJobs), wrote state.size() + jobs_bytes(jobs);
        fn forget_user(user: &'a UserKey) -> ForgetReport = timed(ForgetUser);
    }
}

/// Bytes of the jobs' exchanges.
fn jobs_bytes(jobs: &[Job]) -> usize {
    jobs.iter().map(|job| job.exchange.text_bytes()).sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_store::EmbeddedStore;

    #[test]
    fn operation_labels_follow_the_enum() {
        assert_eq!(OPERATIONS[Operation::HotRecord as usize], "hot_record");
        assert_eq!(OPERATIONS[Operation::EndArrival as usize], "end_arrival");
        assert_eq!(OPERATIONS[Operation::CommitJobs as usize], "commit_jobs");
        assert_eq!(OPERATIONS[Operation::ForgetUser as usize], "forget_user");
        // The last variant indexes the last label, so every variant has its series.
        assert_eq!(Operation::ForgetUser as usize, OPERATIONS.len() - 1);
    }

    #[tokio::test]
    async fn operations_are_timed_and_conflicts_are_not_errors() {
        let dir = tempfile::tempdir().unwrap();
        let families = StoreFamilies::new(&Registry::new()).unwrap();
        let store = MeteredStore::new(
            Arc::new(EmbeddedStore::open(dir.path()).unwrap()),
            &families,
            "embedded",
        )
        .unwrap();
        let user = UserKey::new("t", "u");
        let record = store.hot_record(&user, "s", None).await.unwrap();
        assert_eq!(record.version, 0);
        let mut state = MemoryState::new();
        state.version = 5;
        store.save_state(&user, &state, 0).await.unwrap();
        // A stale expected version: a lost race, not a store error.
        assert!(matches!(
            store.save_state(&user, &state, 1).await,
            Err(Error::StoreConflict { .. })
        ));
        let series = |operation: Operation| &store.series[operation as usize];
        assert_eq!(series(Operation::HotRecord).latency.get_sample_count(), 1);
        assert_eq!(series(Operation::SaveState).latency.get_sample_count(), 2);
        assert_eq!(series(Operation::SaveState).errors.get(), 0);
        // The provided `save_state` of the wrapped store calls its own `save_encoded_state`,
        // not the wrapper's.
        assert_eq!(
            series(Operation::SaveEncodedState)
                .latency
                .get_sample_count(),
            0
        );
    }

    /// A forwarder's clear reaches the wrapped store's own, one write for the batch: through
    /// the provided loop it was an ack, a commit and (on disk) an fsync per job.
    #[tokio::test]
    async fn clearing_forwarded_jobs_is_the_wrapped_stores_one_write() {
        let families = StoreFamilies::new(&Registry::new()).unwrap();
        let inner = Arc::new(EmbeddedStore::in_memory().unwrap());
        let store =
            MeteredStore::new(Arc::clone(&inner) as Arc<dyn Store>, &families, "spool").unwrap();
        let user = UserKey::new("t", "u");
        let mut ids = Vec::new();
        for n in 0..3 {
            let job = Job {
                id: JobId {
                    user: user.clone(),
                    key: format!("k{n}"),
                },
                exchange: ExchangeInput {
                    session_id: "s".into(),
                    turn_id: format!("e{n}"),
                    user_text: "hello".into(),
                    assistant_text: "hi".into(),
                    ..ExchangeInput::default()
                },
                trace: None,
            };
            store.enqueue(&job).await.unwrap();
            ids.push(job.id);
        }
        assert_eq!(store.clear_forwarded(&ids).await.unwrap(), 3);
        let series = |operation: Operation| &store.series[operation as usize];
        assert_eq!(
            series(Operation::ClearForwarded).latency.get_sample_count(),
            1
        );
        assert_eq!(series(Operation::Ack).latency.get_sample_count(), 0);
        // The embedded store's own clear keeps nothing; the provided loop left applied records.
        assert_eq!(inner.job_state(&ids[0]).await.unwrap(), None);
    }
}
