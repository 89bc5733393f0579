//! Recorder → job. A recorded exchange must not be lost because the store is briefly down, so
//! the outbox retries the enqueue and, when the store stays unreachable, keeps the job in a
//! local spool (an embedded store in the data directory) and forwards it once the store is
//! back. While anything is spooled, new jobs go to the spool too, so a session's jobs reach
//! the store in the order they were recorded.
//!
//! A session's recordings are placed in the store's queue one after another without waiting for
//! each to be durable ([`Outbox::submit_in_order`]), so they share commits. A failure keeps
//! their order: the store holds back every job placed behind a failed one, those jobs go to
//! the spool in the order they were placed (the failed one first), and placing resumes once
//! each of them has been dealt with, while the spool then takes new jobs until it is empty,
//! placed in its queue the same way. To let it empty under a steady intake, new recordings
//! wait (briefly, `DRAIN_WAIT`) while the forwarder moves what is left in one round
//! ([`Outbox::forward`]), then go to the store behind it. Redis does not place but orders a
//! session's jobs by arrival itself, so there a recording whose arrival note is written is
//! enqueued without waiting for the one before it.
//!
//! With Redis the spool is a file in the data directory, bounded by `store.spool_max_jobs`
//! and `store.spool_max_bytes` ([`SpoolBounds`]). With the embedded store the spool would be
//! on the very disk that is failing, so it is in memory, bounded by [`MEMORY_SPOOL_JOBS`] and
//! [`MEMORY_SPOOL_BYTES`]: a recording survives a full or failing disk, not a crash during it.
//! Past a spool's bound a recording is lost, counted and logged.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use super::Receipt;
use super::journal::Journal;
use super::order::Ticket;
use crate::error::Result;
use engram_runtime::BoxFuture;
use engram_store::{Enqueued, ForgetReport, Job, JobId, Placement, Store, UserKey};

/// Enqueue attempts before a job goes to the spool.
const ATTEMPTS: u32 = 3;
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
const FIRST_BACKOFF: Duration = Duration::from_millis(50);
/// The spool lease: a forwarder that dies mid-forward leaves the job for the next start.
const SPOOL_LEASE: Duration = Duration::from_secs(10);
const FORWARD_RETRY: Duration = Duration::from_millis(500);
/// Spooled jobs the forwarder moves at a time. Everything goes to the spool while it holds
/// anything, so it must drain faster than answers end: one durable commit a job forwarded
/// about 430 a second on a busy core (`cargo bench --bench store`), and at a busier intake a
/// spool, once started, only grew.
const FORWARD_BATCH: usize = 256;
/// How long a recording bound for the spool waits, at most, while the forwarder moves the
/// spool's last round to the store: then it goes to the store behind them, not the spool. Past
/// it the recording is spooled as before (the round is slow or the store failed), and the
/// recordings still waiting go on too.
const DRAIN_WAIT: Duration = Duration::from_millis(200);
/// How long a round may have taken, at most, for recordings to wait for the next: a round
/// slower than [`DRAIN_WAIT`] would keep them waiting for nothing.
const QUICK_ROUND: Duration = Duration::from_millis(50);
/// Jobs an in-memory spool holds at most (a few KB each); beyond it a recording is lost, and
/// counted and logged as such.
pub const MEMORY_SPOOL_JOBS: u64 = 10_000;
/// Bytes of turn text an in-memory spool holds at most, as for its jobs: a user pasting
/// megabyte documents would otherwise fill memory long before 10,000 jobs.
pub const MEMORY_SPOOL_BYTES: u64 = 64 * 1024 * 1024;
/// Recordings held in memory waiting for their enqueue, past which a recording goes straight
/// to the spool instead of retrying the store: requests never wait for the update path, and a
/// backlog is kept as compact jobs. A recording holds its turn's texts only (the recorder
/// drops the request and the captured response first).
pub const MAX_RECORDINGS_IN_FLIGHT: u64 = 8_192;
/// Bytes of turn text (the user's message and the answer) the recordings in flight may hold
/// before a recording goes straight to the spool, as past [`MAX_RECORDINGS_IN_FLIGHT`]: the
/// count alone let 8,192 pasted documents of a megabyte each be held in memory.
pub const MAX_RECORDING_BYTES_IN_FLIGHT: u64 = 64 * 1024 * 1024;
/// Recordings in flight past which requests answer without memory ([`Outbox::shedding_reads`]),
/// before the backlog reaches [`MAX_RECORDINGS_IN_FLIGHT`] and the spool; and their bytes.
pub const SHED_READS_IN_FLIGHT: u64 = MAX_RECORDINGS_IN_FLIGHT / 2;
pub const SHED_READS_BYTES_IN_FLIGHT: u64 = MAX_RECORDING_BYTES_IN_FLIGHT / 2;

/// How much a durable spool holds at most: jobs, and bytes of their turns' texts (as
/// [`turn_bytes`] counts them).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpoolBounds {
    pub jobs: u64,
    pub bytes: u64,
}

/// Where jobs wait while the store will not take them.
pub enum Spool {
    /// A store of its own on another medium (the Redis backend's local file), bounded, that
    /// held `held_bytes` of turn text when the process started (a spool outlives it).
    Durable {
        store: Arc<dyn Store>,
        bounds: SpoolBounds,
        held_bytes: u64,
    },
    /// A store in memory holding at most `capacity` jobs (the embedded backend).
    Memory {
        store: Arc<dyn Store>,
        capacity: u64,
    },
}

impl Spool {
    fn store(&self) -> &Arc<dyn Store> {
        match self {
            Spool::Durable { store, .. } | Spool::Memory { store, .. } => store,
        }
    }
}

/// A placed job whose outcome is not yet dealt with; settled when dropped, so a recording
/// dropped halfway (it should not be: recordings run to completion) cannot hold placing back
/// for good after a failure.
struct Unsettled<'a>(&'a Outbox);

impl Drop for Unsettled<'_> {
    fn drop(&mut self) {
        self.0.settled();
    }
}

pub struct Outbox {
    store: Arc<dyn Store>,
    spool: Spool,
    /// Jobs in the spool, not yet forwarded.
    spooled: AtomicU64,
    /// Bytes of their turns' texts.
    spooled_bytes: AtomicU64,
    /// Bytes an in-memory spool holds at most ([`MEMORY_SPOOL_BYTES`]).
    memory_spool_bytes: u64,
    /// Wakes the local worker when a job was queued.
    queued: Arc<Notify>,
    /// Wakes the forwarder when a job was spooled.
    spooled_signal: Notify,
    /// Set while the forwarder moves what it takes for the spool's last round, after a quick
    /// round the store took whole: recordings bound for the spool wait for it ([`DRAIN_WAIT`];
    /// the first to wait that long clears it). Without it a spool under a steady intake
    /// emptied only when the intake ended: every recording went to it while it held anything,
    /// and each round found new ones.
    closing: AtomicBool,
    /// Wakes the recordings waiting on `closing` when it is cleared.
    closed: Notify,
    stats: OutboxStats,
    /// The jobs of the recordings in flight.
    recording: Mutex<HashSet<JobId>>,
    /// Jobs placed in the store's queue whose outcome is not yet dealt with (durable, or
    /// spooled after a failure); placing resumes after a failure once it is 0.
    unsettled: Mutex<u64>,
    /// Where answers released before their recording was durable are noted: a job forwarded
    /// from the in-memory spool closes its note.
    journal: Option<Arc<Journal>>,
    /// Users forgotten since the forwarder's last claim from the spool: it does not move their
    /// jobs it claimed before the forget, and holds this while it moves jobs into the store
    /// (see [`Outbox::forget_user`]).
    forgotten: tokio::sync::Mutex<Vec<UserKey>>,
}

#[derive(Debug, Default)]
pub struct OutboxStats {
    /// Recordings between the end of their response and their job being durable.
    pub in_flight: AtomicU64,
    /// The bytes of their turns' texts.
    pub in_flight_bytes: AtomicU64,
    pub queued: AtomicU64,
    pub spooled: AtomicU64,
    pub forwarded: AtomicU64,
    pub lost: AtomicU64,
    /// Turns the previous process answered before their recording was durable and never
    /// recorded (see `recorder::journal`).
    pub unrecorded_at_start: AtomicU64,
}

impl Outbox {
    /// `spool` holds jobs the store would not take, until the forwarder moves them on.
    pub async fn new(store: Arc<dyn Store>, spool: Spool, queued: Arc<Notify>) -> Outbox {
        // A durable spool may hold jobs from before a restart.
        let already = spool.store().queue_depth().await.unwrap_or(0);
        let held_bytes = match &spool {
            Spool::Durable { held_bytes, .. } => *held_bytes,
            Spool::Memory { .. } => 0,
        };
        Outbox {
            store,
            spool,
            spooled: AtomicU64::new(already),
            spooled_bytes: AtomicU64::new(held_bytes),
            memory_spool_bytes: MEMORY_SPOOL_BYTES,
            queued,
            spooled_signal: Notify::new(),
            closing: AtomicBool::new(false),
            closed: Notify::new(),
            stats: OutboxStats::default(),
            recording: Mutex::default(),
            unsettled: Mutex::new(0),
            journal: None,
            forgotten: tokio::sync::Mutex::default(),
        }
    }

    /// Notes in `journal` that a job whose answer went with `pending` from the in-memory spool
    /// became durable once forwarded. Without it a restart reported every turn that had gone
    /// through that spool as answered and never recorded.
    pub fn with_journal(mut self, journal: Arc<Journal>) -> Outbox {
        self.journal = Some(journal);
        self
    }

    pub fn stats(&self) -> &OutboxStats {
        &self.stats
    }

    /// Counts the recording of `job`, whose turn's texts are `bytes` long, as in flight until
    /// the guard drops (the admin API reports it, so "nothing in flight and the queue empty"
    /// means every answered turn is applied, and answers `pending` for the job meanwhile).
    pub fn recording(self: &Arc<Self>, job: &JobId, bytes: u64) -> InFlight {
        self.stats.in_flight.fetch_add(1, Ordering::AcqRel);
        self.stats
            .in_flight_bytes
            .fetch_add(bytes, Ordering::AcqRel);
        self.recording
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(job.clone());
        InFlight {
            outbox: Arc::clone(self),
            job: job.clone(),
            bytes,
        }
    }

    /// `count` recordings of `user`, of `bytes` each, marked in flight until the marks drop: a
    /// backlog for tests.
    #[cfg(test)]
    pub(crate) fn backlog(
        self: &Arc<Self>,
        user: &UserKey,
        count: u64,
        bytes: u64,
    ) -> Vec<InFlight> {
        (0..count)
            .map(|n| {
                let job = JobId {
                    user: user.clone(),
                    key: format!("r{n}"),
                };
                self.recording(&job, bytes)
            })
            .collect()
    }

    /// Whether `job` is being recorded by this process (answered, not yet in the store).
    pub fn is_recording(&self, job: &JobId) -> bool {
        self.recording
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .contains(job)
    }

    /// Whether the recordings in flight have passed [`MAX_RECORDINGS_IN_FLIGHT`] or
    /// [`MAX_RECORDING_BYTES_IN_FLIGHT`].
    fn backlogged(&self) -> bool {
        self.in_flight_past(MAX_RECORDINGS_IN_FLIGHT, MAX_RECORDING_BYTES_IN_FLIGHT)
    }

    /// Whether more than `count` recordings, or more than `bytes` of their texts, are in flight.
    fn in_flight_past(&self, count: u64, bytes: u64) -> bool {
        self.stats.in_flight.load(Ordering::Acquire) > count
            || self.stats.in_flight_bytes.load(Ordering::Acquire) > bytes
    }

    /// Whether requests should answer without memory so that recordings catch up: past
    /// [`SHED_READS_IN_FLIGHT`] recordings in flight (or [`SHED_READS_BYTES_IN_FLIGHT`] of
    /// their texts), or while the in-memory spool holds any
    /// (every recording then goes there, and past its bound they are lost). A process short of
    /// CPU otherwise lost turns: one user at 1,000 req/s on a core that could not keep up sent
    /// recordings to the spool, which filled, and 7,419 of 40,000 were lost
    /// (`./benches/history.sh`, 2026-12-06). Reading and composing memory is about half of a
    /// request's CPU there; a recording is the turn itself.
    pub fn shedding_reads(&self) -> bool {
        self.in_flight_past(SHED_READS_IN_FLIGHT, SHED_READS_BYTES_IN_FLIGHT)
            || (matches!(self.spool, Spool::Memory { .. }) && self.spooled() > 0)
    }

    /// An outbox whose in-memory spool holds at most `bytes` (tests).
    #[cfg(test)]
    pub(crate) fn with_memory_spool_bytes(mut self, bytes: u64) -> Outbox {
        self.memory_spool_bytes = bytes;
        self
    }

    /// Jobs waiting in the local spool.
    pub fn spooled(&self) -> u64 {
        self.spooled.load(Ordering::Acquire)
    }

    /// Bytes of their turns' texts.
    pub fn spooled_bytes(&self) -> u64 {
        self.spooled_bytes.load(Ordering::Acquire)
    }

    /// Deletes the user's jobs from this process's local spool (part of forgetting a user,
    /// before the store's records). The forwarder may hold jobs of theirs it claimed before the
    /// delete: the user is marked so it does not move them, and the mark waits for a move in
    /// progress, which so lands in the store before the store's forget. Unmarked, the forwarder
    /// moved them after it once the store took jobs again, and the worker applied a forgotten
    /// user's turns. The user's open notes in the journal close (`Journal::forgotten`).
    pub async fn forget_user(&self, user: &UserKey) -> Result<ForgetReport> {
        let spool = self.spool.store();
        let report = spool.forget_user(user).await?;
        self.forgotten.lock().await.push(user.clone());
        if let Some(journal) = &self.journal {
            journal.forgotten(user);
        }
        let left = spool.queue_depth().await?;
        let before = self.spooled.swap(left, Ordering::AcqRel);
        // The forgotten jobs' sizes are not known here: the bytes shrink in proportion (to 0,
        // exactly, when nothing is left).
        let _ = self
            .spooled_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |bytes| {
                Some(bytes.saturating_mul(left) / before.max(1))
            });
        Ok(report)
    }

    /// Makes the job durable: in the store, or else in the spool; says which. Logs (never
    /// panics) if neither takes it.
    pub async fn submit(&self, job: Job) -> Receipt {
        self.wait_while_closing().await;
        if self.spooled() == 0 && !self.backlogged() && self.enqueue_with_retry(&job).await {
            return self.queued();
        }
        self.spool(job).await
    }

    /// [`Outbox::submit_in_order`] with the session's `ticket` (its turn has come), else
    /// [`Outbox::submit`].
    pub async fn submit_with(&self, job: Job, ticket: Option<Arc<Ticket>>, noted: bool) -> Receipt {
        match ticket {
            Some(ticket) => self.submit_in_order(job, ticket, noted).await,
            None => self.submit(job).await,
        }
    }

    /// [`Outbox::submit`] for the recording that holds its session's `ticket` (its turn has
    /// come): the ticket is released as soon as the job's place in the store's queue is fixed,
    /// so the session's next recording is placed behind it, in the same commit or the next,
    /// rather than one durable commit later; the receipt still waits for the job to be durable.
    /// If a placed job fails, the store holds back the jobs placed behind it; each goes to the
    /// spool in its session's order (`settle`, the ticket's follower). A store that cannot
    /// place is submitted to one job at a time, the ticket held until it is durable; unless it
    /// orders a session's jobs by arrival itself (Redis) and the turn's arrival note is written
    /// (`noted`): then the ticket goes before the enqueue, and the session's recordings are
    /// enqueued concurrently (one at a time, one identity at 1,000 requests a second outran
    /// its enqueues' round trips on a busy core and went to the spool).
    pub async fn submit_in_order(&self, job: Job, ticket: Arc<Ticket>, noted: bool) -> Receipt {
        // Taken while the session's turn is held, so followers go in the session's order.
        let settle = ticket.follower();
        // Holding the session's turn, so its later recordings queue behind this one.
        self.wait_while_closing().await;
        let placement = {
            let mut unsettled = self
                .unsettled
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if self.spooled() > 0 || self.backlogged() {
                Placed::Spool(job)
            } else {
                match self.store.place(job.clone()) {
                    Placement::Placed(answer) => {
                        *unsettled += 1;
                        Placed::Store(answer, job)
                    }
                    Placement::Held(job) => Placed::Spool(job),
                    Placement::Unsupported(job) => Placed::OneAtATime(job),
                }
            }
        };
        match placement {
            Placed::OneAtATime(job) if noted && self.store.orders_by_arrival() => {
                // The store holds the session's later jobs behind this one's note until this
                // one is queued, or spooled and forwarded (within `order_grace`).
                drop(ticket);
                self.submit(job).await
            }
            Placed::OneAtATime(job) => {
                let recorded = self.submit(job).await;
                drop(ticket);
                recorded
            }
            Placed::Spool(job) => {
                // Before the session's next recording.
                after_earlier_failures(&settle).await;
                self.spool_placed(job, ticket, settle).await
            }
            Placed::Store(answer, job) => {
                let _unsettled = Unsettled(self);
                drop(ticket);
                match answer.await {
                    Ok(_) => self.queued(),
                    Err(error) => {
                        tracing::debug!(%error, job = %job.id.key, "a placed enqueue failed; spooling it in order");
                        self.spool_in_order(&settle, job).await
                    }
                }
            }
        }
    }

    /// Waits while the forwarder moves the spool's last round (`closing`), at most
    /// [`DRAIN_WAIT`], if this recording would go to the spool only because it holds jobs.
    async fn wait_while_closing(&self) {
        let deadline = tokio::time::Instant::now() + DRAIN_WAIT;
        loop {
            let closed = self.closed.notified();
            tokio::pin!(closed);
            // Registered before the flag is read, so a clear in between still wakes it.
            closed.as_mut().enable();
            if !self.closing.load(Ordering::Acquire) || self.spooled() == 0 || self.backlogged() {
                return;
            }
            if tokio::time::timeout_at(deadline, closed).await.is_err() {
                // The round is slow or stuck (a store hanging mid-round): the others waiting
                // go on too, and new recordings do not wait for it.
                self.set_closing(false);
                return;
            }
        }
    }

    /// Sets or clears `closing`; a clear wakes the recordings waiting on it.
    fn set_closing(&self, closing: bool) {
        if self.closing.swap(closing, Ordering::AcqRel) && !closing {
            self.closed.notify_waiters();
        }
    }

    /// A placed job's outcome was dealt with; with none left, placing resumes (a no-op unless
    /// a failure held it: the jobs it held are in the spool now, which takes new jobs until
    /// it is empty).
    fn settled(&self) {
        {
            let mut unsettled = self
                .unsettled
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            *unsettled = unsettled.saturating_sub(1);
        }
        self.resume_if_settled();
    }

    /// Resumes placing if no placed job is in doubt. `settled` does it for the last one; the
    /// forwarder does it again when the spool is idle, for a failure that came after every
    /// recording of its jobs had settled (one dropped before its outcome).
    fn resume_if_settled(&self) {
        let unsettled = self
            .unsettled
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *unsettled == 0 {
            self.store.resume_placing();
        }
    }

    fn queued(&self) -> Receipt {
        self.stats.queued.fetch_add(1, Ordering::Relaxed);
        self.queued.notify_one();
        Receipt::Queued
    }

    /// Spools the job after the session's earlier jobs that failed (`settle`, the recording's
    /// follower ticket).
    async fn spool_in_order(&self, settle: &Ticket, job: Job) -> Receipt {
        after_earlier_failures(settle).await;
        self.spool(job).await
    }

    /// Keeps the job in the spool, if it has room.
    async fn spool(&self, job: Job) -> Receipt {
        if let Some(lost) = self.spool_full(&job) {
            return lost;
        }
        let before = self.count_spooled(&job);
        self.spool_counted(job, before).await
    }

    /// [`Outbox::spool`] for a job already counted in the spool's figures
    /// ([`Outbox::count_spooled`], `before` it), taken back if the spool does not take it.
    async fn spool_counted(&self, job: Job, before: u64) -> Receipt {
        match self.spool.store().enqueue(&job).await {
            Ok(enqueued) => self.spool_took(&job, before, &enqueued),
            Err(error) => {
                self.uncount_spooled(&job);
                self.spool_lost(&job, &error)
            }
        }
    }

    /// Counts a job in the spool's figures before the spool holds it, and returns how many
    /// jobs were counted before it. Before, not after: once its write lands the forwarder may
    /// take it off and count it off before the spooling task runs again, and a count made
    /// after that kept the figure one high with the spool empty (so every recording after it
    /// went to the spool; found by a test that failed about once in 30 runs).
    fn count_spooled(&self, job: &Job) -> u64 {
        self.spooled_bytes
            .fetch_add(text_bytes(job), Ordering::AcqRel);
        self.spooled.fetch_add(1, Ordering::AcqRel)
    }

    /// Takes back what [`Outbox::count_spooled`] counted for a job the spool did not take.
    fn uncount_spooled(&self, job: &Job) {
        self.unspool(1, text_bytes(job));
    }

    /// [`Outbox::spool`] for the recording that holds its session's `ticket` and its follower
    /// (`settle`, which the session's next recording bound for the spool waits for), both
    /// released once the job's place in the spool's queue is fixed: a session's recordings
    /// then share the spool's commits. One at a time, one fsync each, one identity's
    /// recordings reached the spool about 300 a second after a Redis stall at 1,000 req/s,
    /// and the rest waited in memory (7 KB each, RSS up to 310 MiB). A placed job that fails,
    /// or is held back behind one that did, is tried once more on its own: a failing spool
    /// may then keep a session's jobs out of order, as it is losing them.
    async fn spool_placed(&self, job: Job, ticket: Arc<Ticket>, settle: Ticket) -> Receipt {
        if let Some(lost) = self.spool_full(&job) {
            return lost;
        }
        let spool = self.spool.store();
        let alone = job.clone();
        // Counted before its placement: the session's next recording must not find the spool
        // empty (and go to the store ahead of this one) while this one's commit is running,
        // and the forwarder may count it off as soon as that commit lands.
        let before = self.count_spooled(&alone);
        let answer = match spool.place(job) {
            Placement::Placed(answer) => answer,
            Placement::Held(job) | Placement::Unsupported(job) => {
                let recorded = self.spool_counted(job, before).await;
                drop((ticket, settle));
                return recorded;
            }
        };
        drop((ticket, settle));
        match answer.await {
            Ok(enqueued) => self.spool_took(&alone, before, &enqueued),
            Err(error) => {
                tracing::debug!(
                    %error,
                    job = %alone.id.key,
                    "placing in the spool failed; trying alone"
                );
                spool.resume_placing();
                self.spool_counted(alone, before).await
            }
        }
    }

    /// `Some(Receipt::Lost)`, counted and logged, when the spool has no room: it holds its
    /// bound in jobs, or `job`'s texts would take it past its bytes. Without a bound a disk
    /// spool would grow for as long as a Redis outage lasts, until the disk or the pod's data
    /// volume is full.
    fn spool_full(&self, job: &Job) -> Option<Receipt> {
        let (max_jobs, max_bytes, spool) = match &self.spool {
            Spool::Durable { bounds, .. } => (bounds.jobs, bounds.bytes, "local spool"),
            Spool::Memory { capacity, .. } => {
                (*capacity, self.memory_spool_bytes, "in-memory spool")
            }
        };
        let bytes = self.spooled_bytes.load(Ordering::Acquire);
        if self.spooled() < max_jobs && bytes.saturating_add(text_bytes(job)) <= max_bytes {
            return None;
        }
        self.stats.lost.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            job = %job.id.key,
            max_jobs,
            max_bytes,
            "the store did not take a recorded exchange and the {spool} is full; it is lost"
        );
        Some(Receipt::Lost)
    }

    /// The receipt of a job the spool answered for, counted in `spooled` (`before` it). One
    /// it had already (`Duplicate`: still there, or forwarded and counted off) is not counted
    /// again, so the count stays the jobs the spool holds.
    fn spool_took(&self, job: &Job, before: u64, enqueued: &Enqueued) -> Receipt {
        if matches!(enqueued, Enqueued::Duplicate(_)) {
            self.uncount_spooled(job);
        }
        self.spooled_receipt(job, before)
    }

    /// The receipt of a job the spool took, counted in `spooled` (`before` it); wakes the
    /// forwarder.
    fn spooled_receipt(&self, job: &Job, before: u64) -> Receipt {
        self.stats.spooled.fetch_add(1, Ordering::Relaxed);
        self.spooled_signal.notify_one();
        // Once per spell: while the spool holds anything every recording goes there, and a
        // line per job at a busy intake was thousands a second.
        if before == 0 {
            tracing::warn!(
                job = %job.id.key,
                "the store did not take a recorded exchange (failing, unreachable or behind); \
                 recordings go to the local spool until it is forwarded"
            );
        } else {
            tracing::debug!(job = %job.id.key, "exchange kept in the local spool");
        }
        match self.spool {
            Spool::Durable { .. } => Receipt::Spooled,
            Spool::Memory { .. } => Receipt::Pending,
        }
    }

    /// Counts and logs a recording neither the store nor the spool took.
    fn spool_lost(&self, job: &Job, error: &crate::error::Error) -> Receipt {
        self.stats.lost.fetch_add(1, Ordering::Relaxed);
        tracing::error!(
            %error,
            job = %job.id.key,
            "neither the store nor the local spool took a recorded exchange; it is lost"
        );
        Receipt::Lost
    }

    async fn enqueue_with_retry(&self, job: &Job) -> bool {
        let mut backoff = FIRST_BACKOFF;
        for attempt in 1..=ATTEMPTS {
            match tokio::time::timeout(ATTEMPT_TIMEOUT, self.store.enqueue(job)).await {
                Ok(Ok(_)) => return true,
                Ok(Err(error)) => {
                    tracing::debug!(%error, attempt, "enqueue failed");
                }
                Err(_) => tracing::debug!(attempt, "enqueue timed out"),
            }
            if attempt < ATTEMPTS {
                tokio::time::sleep(backoff).await;
                backoff *= 4;
            }
        }
        false
    }

    /// Moves spooled jobs to the store, oldest first, until cancelled: up to
    /// 256 at a time (`FORWARD_BATCH`), placed in their order so they share commits. When what
    /// is left fits in one round and the store took the last round whole and quickly, new
    /// recordings wait for this round (`closing`), so the spool empties under a steady intake.
    pub async fn forward(self: Arc<Self>, cancel: CancellationToken) {
        let spool = Arc::clone(self.spool.store());
        let consumer = format!("forwarder-{}", std::process::id());
        // Whether the store took the last round whole within `QUICK_ROUND`: only then do
        // recordings wait for the next (during an outage, or behind a slow store, they would
        // wait for nothing).
        let mut quick_last = false;
        loop {
            if cancel.is_cancelled() {
                self.set_closing(false);
                return;
            }
            let left = self.spooled();
            self.set_closing(quick_last && (1..=FORWARD_BATCH as u64).contains(&left));
            let round = tokio::time::Instant::now();
            // A user forgotten before this point lost their spooled jobs before the claim.
            self.forgotten.lock().await.clear();
            let claimed = match spool
                .claim_batch(&consumer, SPOOL_LEASE, FORWARD_BATCH)
                .await
            {
                Ok(claimed) => claimed,
                Err(error) => {
                    tracing::warn!(%error, "reading the spool failed");
                    Vec::new()
                }
            };
            if claimed.is_empty() {
                // The next job spooled may be the first of an outage.
                quick_last = false;
                self.set_closing(false);
                self.resume_if_settled();
                tokio::select! {
                    () = self.spooled_signal.notified() => {}
                    () = tokio::time::sleep(Duration::from_secs(5)) => {}
                    () = cancel.cancelled() => return,
                }
                continue;
            }
            let mut jobs: Vec<Job> = claimed.into_iter().map(|claimed| claimed.job).collect();
            let forgotten = self.forgotten.lock().await;
            jobs.retain(|job| !forgotten.contains(&job.id.user));
            let placed = self.place_forwarded(&jobs).await;
            self.forwarded(&spool, &jobs[..placed]).await;
            let mut store_took_all = true;
            // The rest in one run where the store can (one that does not place: Redis), then
            // one at a time, each tried until the store takes it, so order is kept; then
            // placing may resume, these having been dealt with. They leave the spool
            // together, before any wait: a write per job, and two round trips per job to
            // Redis, forwarded slower than one user's recordings at 1,000 a second came in,
            // all of which go to the spool while it holds anything. A crash in between
            // forwards them again, which the store's queue takes once.
            let rest = &jobs[placed..];
            let run = match self.store.enqueue_run(rest).await {
                Ok(queued) => queued,
                Err(error) => {
                    tracing::debug!(%error, "store still unreachable; spool kept");
                    store_took_all = false;
                    self.set_closing(false);
                    0
                }
            };
            drop(forgotten);
            let mut cleared = 0;
            for (at, job) in rest.iter().enumerate().skip(run) {
                loop {
                    let forgotten = self.forgotten.lock().await;
                    if forgotten.contains(&job.id.user) {
                        // Forgotten while the store was refusing it: its spool row went with
                        // the forget, and it is not moved.
                        drop(forgotten);
                        self.forwarded(&spool, &rest[cleared..at]).await;
                        cleared = at + 1;
                        break;
                    }
                    match self.store.enqueue(job).await {
                        Ok(_) => break,
                        Err(error) => {
                            drop(forgotten);
                            tracing::debug!(%error, "store still unreachable; spool kept");
                            store_took_all = false;
                            self.set_closing(false);
                            self.forwarded(&spool, &rest[cleared..at]).await;
                            cleared = at;
                            tokio::select! {
                                () = tokio::time::sleep(FORWARD_RETRY) => {}
                                () = cancel.cancelled() => return,
                            }
                        }
                    }
                }
            }
            self.forwarded(&spool, &rest[cleared..]).await;
            if !rest.is_empty() {
                self.resume_if_settled();
            }
            quick_last = store_took_all && round.elapsed() <= QUICK_ROUND;
            if self.spooled() == 0 || !quick_last {
                self.set_closing(false);
            }
        }
    }

    /// Takes `jobs` and `bytes` off the spool's figures, never below 0 (a forget's estimate
    /// may have taken the bytes already); the jobs counted before.
    fn unspool(&self, jobs: u64, bytes: u64) -> u64 {
        let _ = self
            .spooled_bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |left| {
                Some(left.saturating_sub(bytes))
            });
        self.spooled
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                Some(n.saturating_sub(jobs))
            })
            .unwrap_or_default()
    }

    /// Places spooled `jobs` in the store's queue in their order, so they share its commits;
    /// how many of them, from the first, are now durable there. The others were not written:
    /// a failed one holds back every job placed behind it, and a store that held placing back
    /// or does not place takes none.
    async fn place_forwarded(&self, jobs: &[Job]) -> usize {
        let mut answers = Vec::with_capacity(jobs.len());
        for job in jobs {
            match self.store.place(job.clone()) {
                Placement::Placed(answer) => answers.push(answer),
                Placement::Held(_) | Placement::Unsupported(_) => break,
            }
        }
        let mut durable = 0;
        for answer in answers {
            match answer.await {
                Ok(_) => durable += 1,
                Err(error) => {
                    tracing::debug!(%error, "forwarding a spooled job failed; retrying it alone");
                    break;
                }
            }
        }
        durable
    }

    /// `jobs` are in the store: clears them from the spool, in one write where it can.
    async fn forwarded(&self, spool: &Arc<dyn Store>, jobs: &[Job]) {
        if jobs.is_empty() {
            return;
        }
        let ids: Vec<JobId> = jobs.iter().map(|job| job.id.clone()).collect();
        if let Err(error) = spool.clear_forwarded(&ids).await {
            // Forwarded twice at worst; the store queues a job id once.
            tracing::warn!(%error, "could not clear forwarded jobs from the spool");
        }
        // Their answers said `pending` (the in-memory spool is not durable); now they are.
        if let (Spool::Memory { .. }, Some(journal)) = (&self.spool, &self.journal) {
            for job in jobs {
                journal.recorded(&job.id.key);
            }
        }
        let count = jobs.len() as u64;
        let before = self.unspool(count, jobs.iter().map(text_bytes).sum());
        if before > 0 && before <= count {
            tracing::info!("the local spool is forwarded; recordings go to the store again");
        }
        self.stats.forwarded.fetch_add(count, Ordering::Relaxed);
        self.queued.notify_one();
    }
}

/// Bytes of a turn's texts (the user's message and the answer): what the recordings in
/// flight and the in-memory spool are bounded by, counted the same way for both.
pub fn turn_bytes(user_text: &str, assistant_text: &str) -> u64 {
    (user_text.len() + assistant_text.len()) as u64
}

/// [`turn_bytes`] of a job's turn.
fn text_bytes(job: &Job) -> u64 {
    job.exchange.text_bytes() as u64
}

/// Waits until the session's earlier recordings that failed were spooled (`settle`, the
/// recording's follower ticket); past the longest wait, says so and goes on.
async fn after_earlier_failures(settle: &Ticket) {
    if !settle.wait_turn().await {
        tracing::warn!("an earlier failed recording of this session is stuck; spooling anyway");
    }
}

/// Where [`Outbox::submit_in_order`] put a job.
enum Placed {
    /// In the store's queue; the answer says when it is durable. The job is kept for the
    /// spool, should it fail.
    Store(BoxFuture<'static, Result<Enqueued>>, Job),
    /// Bound for the spool (it holds jobs already, the backlog is full, or the store held the
    /// job back after a failure).
    Spool(Job),
    /// The store does not place: submitted one job at a time.
    OneAtATime(Job),
}

/// A recording in flight; see [`Outbox::recording`].
pub struct InFlight {
    outbox: Arc<Outbox>,
    job: JobId,
    bytes: u64,
}

impl Drop for InFlight {
    fn drop(&mut self) {
        self.outbox
            .recording
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.job);
        let stats = &self.outbox.stats;
        stats.in_flight.fetch_sub(1, Ordering::AcqRel);
        stats
            .in_flight_bytes
            .fetch_sub(self.bytes, Ordering::AcqRel);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_memory::ExchangeInput;
    use engram_store::{EmbeddedStore, JobId, JobQueue, JobState};

    fn job(user: &UserKey, key: &str) -> Job {
        Job {
            id: JobId {
                user: user.clone(),
                key: key.to_owned(),
            },
            exchange: ExchangeInput {
                session_id: "s".into(),
                turn_id: key.to_owned(),
                user_text: "remember the zanzibar code".into(),
                ..ExchangeInput::default()
            },
            trace: None,
        }
    }

    const BOUNDS: SpoolBounds = SpoolBounds {
        jobs: 1_000,
        bytes: 1 << 20,
    };

    fn durable(spool: EmbeddedStore, bounds: SpoolBounds, held_bytes: u64) -> Spool {
        Spool::Durable {
            store: Arc::new(spool),
            bounds,
            held_bytes,
        }
    }

    /// An outbox over `store` with an in-memory spool of the shipped size.
    async fn memory_spooled(store: &Arc<dyn Store>) -> Arc<Outbox> {
        let spool = Spool::Memory {
            store: Arc::new(EmbeddedStore::in_memory().unwrap()),
            capacity: MEMORY_SPOOL_JOBS,
        };
        Arc::new(Outbox::new(Arc::clone(store), spool, Arc::new(Notify::new())).await)
    }

    #[tokio::test]
    async fn past_the_backlog_bound_a_recording_goes_to_the_spool_without_waiting() {
        let store_dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(store_dir.path()).unwrap());
        let outbox = memory_spooled(&store).await;
        let user = UserKey::new("t", "u");
        let mut recordings = outbox.backlog(&user, MAX_RECORDINGS_IN_FLIGHT, 1);
        // At the bound: the store takes it.
        outbox.submit(job(&user, "at-bound")).await;
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        assert_eq!(outbox.spooled(), 0);

        // Past it: the spool does, at once, and the forwarder moves it on later.
        recordings.push(outbox.recording(&job(&user, "past").id, 1));
        tokio::time::timeout(
            Duration::from_secs(1),
            outbox.submit(job(&user, "past-bound")),
        )
        .await
        .unwrap();
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        assert_eq!(outbox.spooled(), 1);
        assert_eq!(outbox.stats().spooled.load(Ordering::Relaxed), 1);
        drop(recordings);
    }

    /// Large turns reach the backlog's byte bound long before its count: past it, the next
    /// recording goes to the spool as past the count.
    #[tokio::test]
    async fn past_the_backlog_byte_bound_a_recording_goes_to_the_spool() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let outbox = memory_spooled(&store).await;
        let user = UserKey::new("t", "u");
        let mut recordings = outbox.backlog(&user, 64, MAX_RECORDING_BYTES_IN_FLIGHT / 64);
        outbox.submit(job(&user, "at-bound")).await;
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        assert_eq!(outbox.spooled(), 0);

        recordings.push(outbox.recording(&job(&user, "past").id, 1));
        outbox.submit(job(&user, "past-bound")).await;
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        assert_eq!(outbox.spooled(), 1);

        // The bytes leave with their recordings.
        drop(recordings);
        assert_eq!(outbox.stats().in_flight_bytes.load(Ordering::Acquire), 0);
    }

    /// A job the forwarder takes off the spool before its spooling task runs again (the
    /// spool's write landed; the task had not been polled since) leaves the spool's count at
    /// 0. Counted after the write, the count stayed one high with the spool empty, and every
    /// later recording went to the spool.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_forwarded_before_its_spooling_task_runs_again_is_counted_off() {
        let spool = Arc::new(crate::test_store::ByArrival::new());
        spool.open.add_permits(1);
        spool.answers_held.store(true, Ordering::Release);
        let spool_store: Arc<dyn Store> = spool.clone();
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let in_memory = Spool::Memory {
            store: Arc::clone(&spool_store),
            capacity: 16,
        };
        let outbox =
            Arc::new(Outbox::new(Arc::clone(&store), in_memory, Arc::new(Notify::new())).await);
        let user = UserKey::new("tenant", "ana");
        let mut spooling = tokio::task::JoinSet::new();
        spooling.spawn({
            let outbox = Arc::clone(&outbox);
            let job = job(&user, "early");
            async move { outbox.spool(job).await }
        });
        // The write lands; its answer is held.
        tokio::time::timeout(Duration::from_secs(5), async {
            while spool.queue_depth().await.unwrap() == 0 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the spool's write did not land");

        // The forwarder's step meanwhile: off the spool, into the store, counted off.
        let claimed = spool_store
            .claim("forwarder", Duration::from_secs(10))
            .await
            .unwrap()
            .expect("the spooled job is claimed");
        store.enqueue(&claimed.job).await.unwrap();
        outbox.forwarded(&spool_store, &[claimed.job]).await;

        spool.answer.add_permits(1);
        let receipt = spooling.join_next().await.unwrap().unwrap();
        assert!(matches!(receipt, Receipt::Spooled | Receipt::Pending));
        assert_eq!(spool.queue_depth().await.unwrap(), 0);
        assert_eq!(
            outbox.spooled(),
            0,
            "the count says the empty spool holds a job"
        );
    }

    /// A job spooled again while the spool holds it is counted once: the count is the jobs
    /// the spool holds, and one too many sends every later recording to the spool.
    #[tokio::test]
    async fn a_job_spooled_twice_is_counted_once() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let spool: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let in_memory = Spool::Memory {
            store: Arc::clone(&spool),
            capacity: 16,
        };
        let outbox = Outbox::new(store, in_memory, Arc::new(Notify::new())).await;
        let user = UserKey::new("tenant", "ana");
        for _ in 0..2 {
            assert_eq!(outbox.spool(job(&user, "twice")).await, Receipt::Pending);
        }
        assert_eq!(spool.queue_depth().await.unwrap(), 1);
        assert_eq!(outbox.spooled(), 1);
    }

    /// A job of `bytes` bytes of user text.
    fn sized_job(user: &UserKey, key: &str, bytes: usize) -> Job {
        let mut job = job(user, key);
        job.exchange.user_text = "x".repeat(bytes);
        job
    }

    /// The in-memory spool is bounded by its jobs' bytes as well as their count: a job that
    /// would take it past its bytes is lost (counted), a smaller one still fits, and forwarded
    /// jobs give their bytes back.
    #[tokio::test]
    async fn the_memory_spool_is_bounded_by_its_jobs_bytes() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let spool = Spool::Memory {
            store: Arc::new(EmbeddedStore::in_memory().unwrap()),
            capacity: 1_000,
        };
        let outbox = Outbox::new(Arc::clone(&store), spool, Arc::new(Notify::new()))
            .await
            .with_memory_spool_bytes(100);
        let outbox = Arc::new(outbox);
        let user = UserKey::new("t", "u");
        assert_eq!(
            outbox.spool(sized_job(&user, "a", 60)).await,
            Receipt::Pending
        );
        assert_eq!(outbox.spool(sized_job(&user, "b", 60)).await, Receipt::Lost);
        assert_eq!(outbox.stats().lost.load(Ordering::Relaxed), 1);
        assert_eq!(
            outbox.spool(sized_job(&user, "c", 40)).await,
            Receipt::Pending
        );
        assert_eq!(outbox.spooled(), 2);

        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        forwarded(&outbox, cancel, forwarder).await;
        assert_eq!(
            outbox.spool(sized_job(&user, "d", 90)).await,
            Receipt::Pending
        );
    }

    /// The disk spool is bounded by its jobs and their bytes too, counting what it held when
    /// the process started: past either bound a recording is lost (counted), and a reopened
    /// spool's jobs leave the room they took once forwarded.
    #[tokio::test]
    async fn the_disk_spool_is_bounded_counting_what_it_held_at_start() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let spool_dir = tempfile::tempdir().unwrap();
        let user = UserKey::new("t", "u");
        let spool = EmbeddedStore::open(spool_dir.path()).unwrap();
        spool
            .enqueue(&sized_job(&user, "before", 60))
            .await
            .unwrap();
        drop(spool);
        let spool = EmbeddedStore::open(spool_dir.path()).unwrap();
        let held = spool.queued_turn_bytes().await.unwrap();
        let bounds = SpoolBounds {
            jobs: 3,
            bytes: 150,
        };
        let outbox = Arc::new(
            Outbox::new(
                Arc::clone(&store),
                durable(spool, bounds, held),
                Arc::new(Notify::new()),
            )
            .await,
        );
        assert_eq!((outbox.spooled(), outbox.spooled_bytes()), (1, 60));
        let spool = |key: &str, bytes: usize| outbox.spool(sized_job(&user, key, bytes));
        assert_eq!(spool("a", 60).await, Receipt::Spooled);
        // 180 bytes: past the bound.
        assert_eq!(spool("b", 60).await, Receipt::Lost);
        assert_eq!(spool("c", 30).await, Receipt::Spooled);
        // Three jobs: the bound, however small the next.
        assert_eq!(spool("d", 1).await, Receipt::Lost);
        assert_eq!(outbox.stats().lost.load(Ordering::Relaxed), 2);

        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        forwarded(&outbox, cancel, forwarder).await;
        assert_eq!((outbox.spooled(), outbox.spooled_bytes()), (0, 0));
        assert_eq!(store.queue_depth().await.unwrap(), 3);
        assert_eq!(spool("e", 150).await, Receipt::Spooled);
    }

    /// A journal in `dir`, a store, and an outbox over it with an in-memory spool that notes
    /// in the journal.
    async fn journaled(dir: &std::path::Path) -> (Arc<Journal>, Arc<dyn Store>, Outbox) {
        let journal = Arc::new(Journal::open(dir).unwrap());
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let spool = Spool::Memory {
            store: Arc::new(EmbeddedStore::in_memory().unwrap()),
            capacity: MEMORY_SPOOL_JOBS,
        };
        let outbox = Outbox::new(Arc::clone(&store), spool, Arc::new(Notify::new())).await;
        let outbox = outbox.with_journal(Arc::clone(&journal));
        (journal, store, outbox)
    }

    /// A job forwarded from the in-memory spool closes the note its `pending` answer left in
    /// the journal, so a restart does not report it as answered and never recorded.
    #[tokio::test]
    async fn a_job_forwarded_from_the_memory_spool_closes_its_journal_note() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, store, outbox) = journaled(dir.path()).await;
        let outbox = Arc::new(outbox);
        let user = UserKey::new("t", "u");
        assert_eq!(outbox.spool(job(&user, "spooled")).await, Receipt::Pending);
        // What the recorder notes for a `pending` receipt, and one answer never recorded.
        journal.answered(&user, "spooled");
        journal.answered(&user, "never-recorded");

        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        forwarded(&outbox, cancel, forwarder).await;
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        drop((outbox, journal));
        let reopened = Journal::open(dir.path()).unwrap();
        assert_eq!(reopened.unrecorded_at_start(), ["never-recorded"]);
    }

    /// Forgetting a user closes the journal's notes of their `pending` answers: their spooled
    /// jobs went with the forget, and a restart reported them as turns a crash took.
    #[tokio::test]
    async fn forgetting_a_user_closes_their_journal_notes() {
        let dir = tempfile::tempdir().unwrap();
        let (journal, _store, outbox) = journaled(dir.path()).await;
        let (gone, kept) = (UserKey::new("t", "gone"), UserKey::new("t", "kept"));
        for (user, key) in [(&gone, "a"), (&kept, "b")] {
            assert_eq!(outbox.spool(job(user, key)).await, Receipt::Pending);
            journal.answered(user, key);
        }
        outbox.forget_user(&gone).await.unwrap();
        drop((outbox, journal));
        let reopened = Journal::open(dir.path()).unwrap();
        assert_eq!(reopened.unrecorded_at_start(), ["b"]);
    }

    /// Forgetting a user takes their jobs' bytes off the spool's (in proportion, the sizes of
    /// the forgotten jobs being unknown there), and all of them once the spool is empty.
    #[tokio::test]
    async fn forgetting_a_user_gives_back_their_spooled_bytes() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let outbox = memory_spooled(&store).await;
        let (gone, kept) = (UserKey::new("t", "gone"), UserKey::new("t", "kept"));
        for (user, key) in [(&gone, "a"), (&gone, "b"), (&kept, "c")] {
            outbox.spool(sized_job(user, key, 60)).await;
        }
        assert_eq!(outbox.spooled_bytes(), 3 * 60);
        outbox.forget_user(&gone).await.unwrap();
        assert_eq!(outbox.spooled(), 1);
        assert_eq!(outbox.spooled_bytes(), 60);
        outbox.forget_user(&kept).await.unwrap();
        assert_eq!(outbox.spooled(), 0);
        assert_eq!(outbox.spooled_bytes(), 0);
    }

    /// Reads are shed past half the backlog bound, and while the in-memory spool holds a job.
    #[tokio::test]
    async fn reads_are_shed_past_half_the_backlog_or_while_the_memory_spool_holds_a_job() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let outbox = memory_spooled(&store).await;
        let user = UserKey::new("t", "u");
        let mut recordings = outbox.backlog(&user, SHED_READS_IN_FLIGHT, 1);
        assert!(!outbox.shedding_reads());
        recordings.push(outbox.recording(&job(&user, "past").id, 1));
        assert!(outbox.shedding_reads());
        drop(recordings);
        assert!(!outbox.shedding_reads());

        // A few large turns reach the bytes' half first.
        let large = SHED_READS_BYTES_IN_FLIGHT / 4;
        let mut recordings = outbox.backlog(&user, 4, large);
        assert!(!outbox.shedding_reads());
        recordings.push(outbox.recording(&job(&user, "past").id, 1));
        assert!(outbox.shedding_reads());
        drop(recordings);
        assert!(!outbox.shedding_reads());

        outbox.spool(job(&user, "spooled")).await;
        assert_eq!(outbox.spooled(), 1);
        assert!(outbox.shedding_reads());
    }

    /// Waits (20 s at most) until the forwarder emptied the spool, then stops it.
    async fn forwarded(
        outbox: &Outbox,
        cancel: CancellationToken,
        mut forwarder: tokio::task::JoinSet<()>,
    ) {
        tokio::time::timeout(Duration::from_secs(20), async {
            while outbox.spooled() > 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the spool was not forwarded");
        cancel.cancel();
        while forwarder.join_next().await.is_some() {}
    }

    /// A spool's backlog is forwarded in batches placed in order (sharing commits), and keeps
    /// its order when the store fails a commit in the middle: the jobs placed behind the
    /// failed one are held back and follow it. Placing resumes once they are through.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_spool_backlog_is_forwarded_in_order_through_a_failed_commit() {
        let embedded = Arc::new(EmbeddedStore::in_memory().unwrap());
        let store: Arc<dyn Store> = embedded.clone();
        let spool_store = Arc::new(EmbeddedStore::in_memory().unwrap());
        let user = UserKey::new("t", "u");
        let jobs: Vec<Job> = (0..600).map(|n| job(&user, &format!("j{n:04}"))).collect();
        for job in &jobs {
            spool_store.enqueue(job).await.unwrap();
        }
        // The disk fails the first round's commit and its first job's own.
        embedded.fail_next_enqueue_commits(2);
        let spool = Spool::Memory {
            store: spool_store.clone(),
            capacity: 1_000,
        };
        let outbox =
            Arc::new(Outbox::new(Arc::clone(&store), spool, Arc::new(Notify::new())).await);
        assert_eq!(outbox.spooled(), 600);
        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        forwarded(&outbox, cancel, forwarder).await;
        assert_eq!(outbox.stats().forwarded.load(Ordering::Relaxed), 600);
        assert_eq!(spool_store.queue_depth().await.unwrap(), 0);

        let mut queued = Vec::new();
        while let Some(claimed) = store.claim("test", Duration::from_secs(60)).await.unwrap() {
            queued.push(claimed.job.id.key.clone());
            store.ack(&claimed.job.id).await.unwrap();
        }
        let spooled: Vec<String> = jobs.iter().map(|job| job.id.key.clone()).collect();
        assert_eq!(queued, spooled);
        assert!(matches!(
            store.place(job(&user, "after")),
            Placement::Placed(_)
        ));
    }

    /// A spool on disk under a steady intake empties while the intake goes on: new recordings
    /// wait while the forwarder moves its last round, then go to the store. Without the wait
    /// every round found new jobs (each round's fsyncs take longer than a job's interval) and
    /// the spool emptied only when the intake ended. Job by job, and as the proxy records one
    /// session (each in its turn), whose order the store keeps.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_disk_spool_empties_under_a_steady_intake() {
        steady_intake(false).await;
        let store = steady_intake(true).await;
        let mut queued = Vec::new();
        while let Some(claimed) = store.claim("test", Duration::from_secs(60)).await.unwrap() {
            queued.push(claimed.job.id.key.clone());
            store.ack(&claimed.job.id).await.unwrap();
        }
        let mut in_order = queued.clone();
        in_order.sort();
        assert_eq!(queued.len(), 3_000);
        assert!(
            queued == in_order,
            "the session's jobs reached the store out of order"
        );
    }

    /// 1,000 jobs spooled on disk and 2,000 more recorded at 1,000 a second, `in_order` as one
    /// session or else job by job, while the forwarder runs: the spool must empty during the
    /// intake and the last 500 go (nearly all) to the store. The store they went to.
    async fn steady_intake(in_order: bool) -> Arc<dyn Store> {
        const BACKLOG: usize = 1_000;
        const INTAKE: usize = 2_000;
        let (store_dir, spool_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(store_dir.path()).unwrap());
        let spool = EmbeddedStore::open(spool_dir.path()).unwrap();
        let user = UserKey::new("t", "u");
        let backlog: Vec<Job> = (0..BACKLOG)
            .map(|n| job(&user, &format!("j{n:05}")))
            .collect();
        for jobs in backlog.chunks(256) {
            spool.enqueue_run(jobs).await.unwrap();
        }
        let bounds = SpoolBounds {
            jobs: 100_000,
            bytes: 1 << 30,
        };
        let spool = durable(spool, bounds, 0);
        let outbox =
            Arc::new(Outbox::new(Arc::clone(&store), spool, Arc::new(Notify::new())).await);
        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));

        let order = super::super::order::SessionOrder::new();
        let mut ticks = tokio::time::interval(Duration::from_millis(1));
        let mut submits = tokio::task::JoinSet::new();
        let mut emptied_at = None;
        for n in BACKLOG..BACKLOG + INTAKE {
            ticks.tick().await;
            let submitter = Arc::clone(&outbox);
            let job = job(&user, &format!("j{n:05}"));
            let ticket = in_order.then(|| Arc::new(order.ticket("s".to_owned())));
            submits.spawn(async move {
                if let Some(ticket) = &ticket {
                    ticket.wait_turn().await;
                }
                (n, submitter.submit_with(job, ticket, false).await)
            });
            if emptied_at.is_none() && outbox.spooled() == 0 {
                emptied_at = Some(n);
            }
        }
        let mut receipts = vec![None; BACKLOG + INTAKE];
        while let Some(submitted) = submits.join_next().await {
            let (n, receipt) = submitted.unwrap();
            receipts[n] = Some(receipt);
        }
        assert!(
            emptied_at.is_some(),
            "the spool held jobs through the whole intake ({} left; in order: {in_order})",
            outbox.spooled()
        );
        let last = &receipts[BACKLOG + INTAKE - 500..];
        let queued = last
            .iter()
            .filter(|receipt| **receipt == Some(Receipt::Queued))
            .count();
        assert!(queued >= 450, "{queued} of the last 500 went to the store");
        forwarded(&outbox, cancel, forwarder).await;
        assert_eq!(outbox.stats().lost.load(Ordering::Relaxed), 0);
        store
    }

    /// A recording that waited `DRAIN_WAIT` for the spool's last round goes to the spool and
    /// lifts the wait for every other: a round that is slow or stuck (a store hanging
    /// mid-round) must not hold each recording in turn.
    #[tokio::test]
    async fn a_wait_for_the_last_round_that_times_out_lifts_it() {
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let outbox = memory_spooled(&store).await;
        let user = UserKey::new("t", "u");
        outbox.spool(job(&user, "spooled")).await;
        // As the forwarder sets it before a round that never ends.
        outbox.set_closing(true);
        let started = tokio::time::Instant::now();
        assert_eq!(outbox.submit(job(&user, "first")).await, Receipt::Pending);
        assert!(started.elapsed() >= DRAIN_WAIT);
        assert!(!outbox.closing.load(Ordering::Acquire));
        let started = tokio::time::Instant::now();
        assert_eq!(outbox.submit(job(&user, "second")).await, Receipt::Pending);
        assert!(started.elapsed() < DRAIN_WAIT);
        assert_eq!(outbox.spooled(), 3);
    }

    /// A store that does not place (Redis) takes a spool's backlog in runs (the default run:
    /// one job at a time), in order, each once, through failed enqueues in the middle of a
    /// batch; the jobs it took leave the spool before the forwarder waits to try again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_that_does_not_place_takes_the_spool_in_order_through_failures() {
        let store = Arc::new(crate::test_store::ByArrival::new());
        store.open.add_permits(10_000);
        // The 6th job fails in the run and once more alone; so does the 15th of the second
        // batch of 256 (the first took 258 attempts).
        *store.failing.lock().unwrap() = vec![5, 6, 258 + 14, 258 + 15];
        let spool_store = Arc::new(EmbeddedStore::in_memory().unwrap());
        let user = UserKey::new("t", "u");
        let jobs: Vec<Job> = (0..300).map(|n| job(&user, &format!("j{n:04}"))).collect();
        for job in &jobs {
            spool_store.enqueue(job).await.unwrap();
        }
        let spool = Spool::Memory {
            store: spool_store.clone(),
            capacity: 1_000,
        };
        let outbox = Arc::new(Outbox::new(store.clone(), spool, Arc::new(Notify::new())).await);
        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        // Cleared up to the failed job while the forwarder waits to retry it.
        tokio::time::timeout(Duration::from_secs(5), async {
            while outbox.spooled() != 295 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the jobs before the failed one stayed in the spool");
        forwarded(&outbox, cancel, forwarder).await;
        assert_eq!(outbox.stats().forwarded.load(Ordering::Relaxed), 300);
        assert_eq!(spool_store.queue_depth().await.unwrap(), 0);
        assert_eq!(store.queue_depth().await.unwrap(), 300);

        let mut queued = Vec::new();
        while let Some(claimed) = store.claim("test", Duration::from_secs(60)).await.unwrap() {
            queued.push(claimed.job.id.key.clone());
            store
                .finish(&claimed.job.id, JobState::Applied)
                .await
                .unwrap();
        }
        let spooled: Vec<String> = jobs.iter().map(|job| job.id.key.clone()).collect();
        assert_eq!(queued, spooled);
    }

    /// A user forgotten while the forwarder holds a job of theirs it claimed (the store was
    /// refusing it) loses that job: the forwarder does not move it into the store once the
    /// store takes jobs again, after the store's own forget. Another user's job is moved.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_job_the_forwarder_holds_is_not_moved_after_its_user_is_forgotten() {
        let store = Arc::new(crate::test_store::ByArrival::new());
        // Down: every enqueue is refused until `failing` is emptied.
        *store.failing.lock().unwrap() = (0..10_000).collect();
        store.open.add_permits(100);
        let spool = Spool::Memory {
            store: Arc::new(EmbeddedStore::in_memory().unwrap()),
            capacity: 16,
        };
        let store_dyn: Arc<dyn Store> = store.clone();
        let outbox = Arc::new(Outbox::new(store_dyn, spool, Arc::new(Notify::new())).await);
        let (gone, kept) = (UserKey::new("t", "gone"), UserKey::new("t", "kept"));
        outbox.spool(job(&gone, "a")).await;
        outbox.spool(job(&kept, "b")).await;
        let cancel = CancellationToken::new();
        let mut forwarder = tokio::task::JoinSet::new();
        forwarder.spawn(Arc::clone(&outbox).forward(cancel.clone()));
        // The run, then the first job alone, refused: the forwarder holds both jobs.
        tokio::time::timeout(Duration::from_secs(5), async {
            while store.started.load(Ordering::Acquire) < 2 {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await
        .expect("the forwarder did not try the store");
        // The admin API's order: the spool, then the store.
        outbox.forget_user(&gone).await.unwrap();
        store.forget_user(&gone).await.unwrap();
        store.failing.lock().unwrap().clear();
        let b = job(&kept, "b").id;
        tokio::time::timeout(Duration::from_secs(5), async {
            while store.job_state(&b).await.unwrap().is_none() {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        })
        .await
        .expect("the other user's job was not moved");
        cancel.cancel();
        while forwarder.join_next().await.is_some() {}
        assert_eq!(store.job_state(&job(&gone, "a").id).await.unwrap(), None);
        assert_eq!(store.queue_depth().await.unwrap(), 1);
        assert_eq!(outbox.spooled(), 0);
    }

    #[tokio::test]
    async fn forgetting_a_user_empties_their_part_of_the_spool() {
        let store_dir = tempfile::tempdir().unwrap();
        let spool_dir = tempfile::tempdir().unwrap();
        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::open(store_dir.path()).unwrap());
        let spool = EmbeddedStore::open(spool_dir.path()).unwrap();
        let (gone, kept) = (UserKey::new("t", "gone"), UserKey::new("t", "kept"));
        for job in [job(&gone, "a"), job(&gone, "b"), job(&kept, "c")] {
            spool.enqueue(&job).await.unwrap();
        }
        // One spooled job was forwarded by an earlier release, which left an applied record.
        spool.ack(&job(&gone, "a").id).await.unwrap();
        let outbox = Outbox::new(store, durable(spool, BOUNDS, 0), Arc::new(Notify::new())).await;
        assert_eq!(outbox.spooled(), 2);

        let report = outbox.forget_user(&gone).await.unwrap();
        assert_eq!(report.jobs, 2);
        assert_eq!(outbox.spooled(), 1);
        drop(outbox);
        let rows = EmbeddedStore::dump(spool_dir.path()).unwrap();
        assert!(rows.iter().any(|row| row.key.contains(&"kept".to_owned())));
        for row in rows {
            assert!(!row.key.contains(&"gone".to_owned()), "{row:?}");
            assert!(
                !String::from_utf8_lossy(&row.value).contains("gone"),
                "{row:?}"
            );
        }
    }
}
