//! A store for the tests of the recorder and the hot path: an in-memory embedded store that
//! says it orders a session's jobs by arrival, as Redis does, and can hold its enqueues and
//! reads back.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Semaphore;

use engram_memory::{CandidateId, ExchangeInput, MemoryState};
use engram_runtime::BoxFuture;
use engram_runtime::error::{Error, Result};
use engram_store::{
    Appended, ClaimedJob, EmbeddedStore, EncodedState, Enqueued, ForgetReport, HotRecord, Job,
    JobId, JobQueue, JobState, MemoryRecords, RawEntry, Store, UserKey,
};

/// Orders by arrival (it says so; the embedded queue underneath orders by enqueue). Each
/// enqueue is counted in `started`, then waits for a permit of `open`, and fails if its count
/// (from 0) is in `failing`. Hot reads wait while `reads_hang`; a read for a caller catching
/// up does not, brings no update (as Redis's), and is counted in `catching_up_reads`. While
/// `answers_held`, an enqueue that wrote its job waits for a permit of `answer` before it
/// answers (the job is in the queue before its caller knows).
pub struct ByArrival {
    inner: EmbeddedStore,
    pub started: AtomicUsize,
    pub open: Semaphore,
    pub answers_held: AtomicBool,
    pub answer: Semaphore,
    pub failing: Mutex<Vec<usize>>,
    pub reads_hang: AtomicBool,
    pub catching_up_reads: AtomicUsize,
}

impl ByArrival {
    /// Enqueues held (no permits), reads answering.
    pub fn new() -> ByArrival {
        ByArrival {
            inner: EmbeddedStore::in_memory().expect("an in-memory store opens"),
            started: AtomicUsize::new(0),
            open: Semaphore::new(0),
            answers_held: AtomicBool::new(false),
            answer: Semaphore::new(0),
            failing: Mutex::default(),
            reads_hang: AtomicBool::new(false),
            catching_up_reads: AtomicUsize::new(0),
        }
    }
}

impl MemoryRecords for ByArrival {
    fn hot_record<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: Option<u64>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        Box::pin(async move {
            while self.reads_hang.load(Ordering::Acquire) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            self.inner
                .hot_record(user, session_id, cached_version)
                .await
        })
    }

    fn hot_record_catching_up<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        cached_version: u64,
        _arriving: Option<(&'a str, u64)>,
    ) -> BoxFuture<'a, Result<HotRecord>> {
        Box::pin(async move {
            self.catching_up_reads.fetch_add(1, Ordering::AcqRel);
            let mut record = self
                .inner
                .hot_record(user, session_id, Some(cached_version))
                .await?;
            record.update = None;
            Ok(record)
        })
    }

    fn load_state<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Option<MemoryState>>> {
        self.inner.load_state(user)
    }

    fn save_encoded_state<'a>(
        &'a self,
        user: &'a UserKey,
        state: &'a EncodedState,
        expected_version: u64,
    ) -> BoxFuture<'a, Result<()>> {
        self.inner.save_encoded_state(user, state, expected_version)
    }

    fn save_prefetched<'a>(
        &'a self,
        user: &'a UserKey,
        session_id: &'a str,
        candidates: &'a [CandidateId],
    ) -> BoxFuture<'a, Result<()>> {
        self.inner.save_prefetched(user, session_id, candidates)
    }

    fn append_raw<'a>(
        &'a self,
        user: &'a UserKey,
        exchange_id: &'a str,
        exchange: &'a ExchangeInput,
    ) -> BoxFuture<'a, Result<Appended>> {
        self.inner.append_raw(user, exchange_id, exchange)
    }

    fn read_raw<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<Vec<RawEntry>>> {
        self.inner.read_raw(user)
    }
}

impl JobQueue for ByArrival {
    fn enqueue<'a>(&'a self, job: &'a Job) -> BoxFuture<'a, Result<Enqueued>> {
        Box::pin(async move {
            let count = self.started.fetch_add(1, Ordering::AcqRel);
            let _permit = self.open.acquire().await;
            if self
                .failing
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .contains(&count)
            {
                return Err(Error::Store("refused, as the test asked".into()));
            }
            let written = self.inner.enqueue(job).await;
            if self.answers_held.load(Ordering::Acquire) {
                let _answer = self.answer.acquire().await;
            }
            written
        })
    }

    fn orders_by_arrival(&self) -> bool {
        true
    }

    fn claim<'a>(
        &'a self,
        consumer: &'a str,
        lease: Duration,
    ) -> BoxFuture<'a, Result<Option<ClaimedJob>>> {
        self.inner.claim(consumer, lease)
    }

    fn finish<'a>(&'a self, job: &'a JobId, state: JobState) -> BoxFuture<'a, Result<bool>> {
        self.inner.finish(job, state)
    }

    fn job_state<'a>(&'a self, job: &'a JobId) -> BoxFuture<'a, Result<Option<JobState>>> {
        self.inner.job_state(job)
    }

    fn queue_depth(&self) -> BoxFuture<'_, Result<u64>> {
        self.inner.queue_depth()
    }
}

impl Store for ByArrival {
    fn forget_user<'a>(&'a self, user: &'a UserKey) -> BoxFuture<'a, Result<ForgetReport>> {
        self.inner.forget_user(user)
    }
}
