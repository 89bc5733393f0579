//! A [`Store`] that times every operation of the store it wraps and counts its errors, by
//! operation and backend. Every method forwards to the wrapped store's own (including those
//! with a provided body), so a backend's optimised `claim_batch` or `commit_jobs` still runs.

use std::sync::Arc;
use std::time::{Duration, Instant};

use prometheus::{Histogram, HistogramVec, IntCounter, IntCounterVec, Registry};

use super::{STORE_BUCKETS, child, counter_vec, histogram_vec, try_array};
use crate::error::{Error, Result};
use crate::memory::{CandidateId, ExchangeInput, MemoryState};
use crate::runtime::BoxFuture;
use crate::store::{
    Appended, ClaimedJob, EncodedState, Enqueued, ForgetReport, HotRecord, Job, JobId, JobQueue,
    JobState, MemoryRecords, Published, RawEntry, Store, UserKey,
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
    Fail,
    CommitJobs,
    JobState,
    QueueDepth,
    ForgetUser,
}

const OPERATIONS: [&str; 18] = [
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

/// Bytes of an exchange's texts.
fn exchange_bytes(exchange: &ExchangeInput) -> usize {
    exchange.user_text.len() + exchange.assistant_text.len()
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

impl MemoryRecords for MeteredStore {
    fn hot_record<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        self.timed_read(
            Operation::HotRecord,
            self.inner.hot_record(user, session_id, cached_version),
        )
    }

    // Every method is forwarded, defaulted ones included: the default would bypass the inner
    // store's own version (Redis notes arrivals here; without it cross-replica order broke).
    fn hot_record_arriving<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
        turn_id: &'a str,
        arrival_us: u64,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        self.timed_read(
            Operation::HotRecord,
            self.inner
                .hot_record_arriving(user, session_id, cached_version, turn_id, arrival_us),
        )
    }

    fn end_arrival<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        turn_id: &'a str,
    ) -> BoxFuture<'a, Result<()>> {
        self.timed(
            Operation::EndArrival,
            self.inner.end_arrival(user, session_id, turn_id),
        )
    }

    fn load_state<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Option<MemoryState>>> {
        self.timed(Operation::LoadState, self.inner.load_state(user))
    }

    fn save_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a MemoryState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        self.timed(
            Operation::SaveState,
            self.inner.save_state(user, state, expected_version),
        )
    }

    fn save_encoded_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a EncodedState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        self.wrote(Operation::SaveEncodedState, state.size());
        self.timed(
            Operation::SaveEncodedState,
            self.inner.save_encoded_state(user, state, expected_version),
        )
    }

    fn save_prefetched<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        candidates: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        self.timed(
            Operation::SavePrefetched,
            self.inner.save_prefetched(user, session_id, candidates),
        )
    }

    fn append_raw<'a>(
        &'a self,
        user: &'a UserKey,
        exchange_id: &'a str,
        exchange: &'a ExchangeInput,
    ) -> BoxFuture<'a, Result<Appended>> {
        self.wrote(Operation::AppendRaw, exchange_bytes(exchange));
        self.timed(
            Operation::AppendRaw,
            self.inner.append_raw(user, exchange_id, exchange),
        )
    }

    fn read_raw<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Vec<RawEntry>>> {
        self.timed(Operation::ReadRaw, self.inner.read_raw(user))
    }
}

impl JobQueue for MeteredStore {
    fn enqueue<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Enqueued>> {
        self.wrote(Operation::Enqueue, exchange_bytes(&job.exchange));
        self.timed(Operation::Enqueue, self.inner.enqueue(job))
    }

    fn claim<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<ClaimedJob>>> {
        self.timed(Operation::Claim, self.inner.claim(consumer, lease))
    }

    fn claim_batch<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
        max: usize,
    ) -> BoxFuture<'a, Result<Vec<ClaimedJob>>> {
        self.timed(
            Operation::ClaimBatch,
            self.inner.claim_batch(consumer, lease, max),
        )
    }

    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>> {
        self.timed(Operation::Finish, self.inner.finish(job, state))
    }

    fn ack<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<bool>> {
        self.timed(Operation::Ack, self.inner.ack(job))
    }

    fn fail<'a>(&'a self, job: &'a JobId, reason: &'a str) -> BoxFuture<'a, Result<bool>> {
        self.timed(Operation::Fail, self.inner.fail(job, reason))
    }

    fn job_state<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<Option<JobState>>> {
        self.timed(Operation::JobState, self.inner.job_state(job))
    }

    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>> {
        self.timed(Operation::QueueDepth, self.inner.queue_depth())
    }
}

impl Store for MeteredStore {
    fn commit_jobs<'a>(
        &'a self,
        jobs: &'a [Job],
        state: &'a EncodedState,
        expected_version: u64,
        prefetched: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        let raw: usize = jobs.iter().map(|job| exchange_bytes(&job.exchange)).sum();
        self.wrote(Operation::CommitJobs, state.size() + raw);
        self.timed(
            Operation::CommitJobs,
            self.inner
                .commit_jobs(jobs, state, expected_version, prefetched),
        )
    }

    fn commit_jobs_then<'a>(
        &'a self,
        jobs: &'a [Job],
        state: &'a EncodedState,
        expected_version: u64,
        prefetched: &'a [CandidateId],
        published: Published,
    ) -> BoxFuture<'a, Result<()>> {
        let raw: usize = jobs.iter().map(|job| exchange_bytes(&job.exchange)).sum();
        self.wrote(Operation::CommitJobs, state.size() + raw);
        self.timed(
            Operation::CommitJobs,
            self.inner
                .commit_jobs_then(jobs, state, expected_version, prefetched, published),
        )
    }

    fn forget_user<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<ForgetReport>> {
        self.timed(Operation::ForgetUser, self.inner.forget_user(user))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::EmbeddedStore;

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
}
