//! Group commit for the embedded store. A durable redb commit costs an fsync and a fixed amount
//! of page bookkeeping whatever it holds, so writes that arrive while one commit is running are
//! gathered and committed together in the next transaction: under load, many recorders' jobs
//! and workers' results share one commit; alone, a write commits at once as before.
//!
//! A store on disk has its rounds run on a thread of their own (`GroupCommit::in_background`),
//! off the request path's blocking threads, which share the request threads' time slices; its
//! rounds may also wait a moment for company (`store.group_commit_ms`, 0 by default since a
//! recorded answer's end waits for its enqueue).
//!
//! Each caller still gets its own result. An operation may fail cleanly (it wrote nothing, e.g.
//! a version conflict) without affecting the others; any other failure aborts the batch, and
//! its operations are then retried one transaction each, so one bad write never fails another.
//!
//! *Ordered* operations (`GroupCommit::place`: a session's recorded jobs, placed one after
//! another without waiting for each to be durable) keep their order through a failure: once
//! one fails, every ordered operation behind it (in its batch, still pending, or placed later)
//! is refused without being written until the caller, having dealt with the failed ones,
//! calls `GroupCommit::resume`. So no ordered operation commits after one before it failed.

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use redb::{Database, WriteTransaction};
use tokio::sync::oneshot;

use super::db_handle::DbHandle;
use engram_runtime::BoxFuture;
use engram_runtime::error::{Error, Result};
use engram_runtime::priority::{self, RecorderPriority, WorkerRuntime};

/// Applies one operation inside a transaction; a clean failure must have written nothing.
pub type Apply<Op, Out> = fn(&WriteTransaction, &Op) -> Result<Out>;

/// What an operation does once its transaction has committed, on the committing thread and
/// before its caller is answered (a job commit tells the store's `CommitListener` there).
pub trait Committed {
    fn committed(self);

    /// What an operation does when it was not committed (it failed, or was refused while the
    /// ordered ones were held), on the committing thread before its caller is answered.
    fn failed(&self) {}
}

pub struct GroupCommit<Op, Out> {
    state: Mutex<Pending<Op, Out>>,
    apply: Apply<Op, Out>,
    /// How long a round waits after its first write before it commits.
    linger: Duration,
    /// Where rounds run; `None`: the submitting runtime's blocking pool.
    pool: Option<WorkerRuntime>,
    /// Transactions left to fail (`fail_next_commits`).
    #[cfg(any(test, feature = "faults"))]
    faults: std::sync::atomic::AtomicU32,
    /// How long an injected failure takes, in µs (`delay_failures`).
    #[cfg(any(test, feature = "faults"))]
    fault_delay_micros: std::sync::atomic::AtomicU64,
}

/// An operation waiting for its round, with its caller's answer.
struct Entry<Op, Out> {
    op: Op,
    /// Placed in order (`GroupCommit::place`): refused while the ordered operations are held.
    ordered: bool,
    answer: oneshot::Sender<Result<Out>>,
}

struct Pending<Op, Out> {
    queue: Vec<Entry<Op, Out>>,
    /// A blocking task is committing; new operations wait for its next round.
    running: bool,
    /// An ordered operation failed: ordered ones are refused until `resume`.
    held: bool,
}

/// An operation's result once its round has run.
pub type Answer<Out> = BoxFuture<'static, Result<Out>>;

impl<Op, Out> GroupCommit<Op, Out>
where
    Op: Committed + Send + 'static,
    Out: Send + 'static,
{
    pub fn new(apply: Apply<Op, Out>) -> Arc<GroupCommit<Op, Out>> {
        Arc::new(GroupCommit::with(apply, Duration::ZERO, None))
    }

    /// A group commit whose rounds run on a thread of their own (`thread` names it), at normal
    /// priority without checkpoints (a recorded answer's end waits for them), and start
    /// `linger` after their first write, so the writes arriving meanwhile share its commit and
    /// its fsync.
    pub fn in_background(
        apply: Apply<Op, Out>,
        linger: Duration,
        thread: &str,
    ) -> Result<Arc<GroupCommit<Op, Out>>> {
        let pool = priority::recorder_pool(thread, RecorderPriority::Answering)?;
        Ok(Arc::new(GroupCommit::with(apply, linger, Some(pool))))
    }

    fn with(
        apply: Apply<Op, Out>,
        linger: Duration,
        pool: Option<WorkerRuntime>,
    ) -> GroupCommit<Op, Out> {
        GroupCommit {
            state: Mutex::new(Pending {
                queue: Vec::new(),
                running: false,
                held: false,
            }),
            apply,
            linger,
            pool,
            #[cfg(any(test, feature = "faults"))]
            faults: std::sync::atomic::AtomicU32::new(0),
            #[cfg(any(test, feature = "faults"))]
            fault_delay_micros: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The thread the rounds run on, when they have one of their own
    /// ([`GroupCommit::in_background`]).
    pub fn thread(&self) -> Option<&tokio::runtime::Handle> {
        self.pool.as_ref().and_then(WorkerRuntime::handle)
    }

    /// Queues `op` for the next commit and waits for its result.
    pub async fn submit(self: &Arc<Self>, db: &Arc<DbHandle>, op: Op) -> Result<Out> {
        self.queue_now(db, op).await
    }

    /// Queues `op` behind every operation queued before it and returns at once with what
    /// will say its result, so a caller can queue its next one meanwhile: operations placed
    /// one after another commit in that order, in one round or in successive ones. Once a
    /// placed operation has failed, the placed ones behind it are answered with an error
    /// without being written, and `place` gives `op` back with that error, until
    /// [`GroupCommit::resume`].
    pub fn place(self: &Arc<Self>, db: &Arc<DbHandle>, op: Op) -> Result<Answer<Out>, (Op, Error)> {
        let receiver = self.queue(db, op, true)?;
        Ok(Box::pin(answered(receiver)))
    }

    /// Queues `op` for the next commit at once, not held by a failure of the placed ones, and
    /// returns what will say its result ([`GroupCommit::submit`] queues it when first polled).
    pub fn queue_now(self: &Arc<Self>, db: &Arc<DbHandle>, op: Op) -> Answer<Out> {
        let receiver = self.queue(db, op, false);
        Box::pin(async move { answered(receiver.map_err(|(_, error)| error)?).await })
    }

    /// Lets placed operations through again after a failure held them.
    pub fn resume(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .held = false;
    }

    #[allow(
        clippy::type_complexity,
        reason = "the operation comes back with its refusal"
    )]
    fn queue(
        self: &Arc<Self>,
        db: &Arc<DbHandle>,
        op: Op,
        ordered: bool,
    ) -> Result<oneshot::Receiver<Result<Out>>, (Op, Error)> {
        let (answer, receiver) = oneshot::channel();
        let lead = {
            let mut pending = self.state.lock().unwrap_or_else(PoisonError::into_inner);
            if ordered && pending.held {
                return Err((op, held()));
            }
            pending.queue.push(Entry {
                op,
                ordered,
                answer,
            });
            !std::mem::replace(&mut pending.running, true)
        };
        if lead {
            let batcher = Arc::clone(self);
            let db = Arc::clone(db);
            let round = move || batcher.drain(db);
            match self.thread() {
                Some(pool) => drop(pool.spawn_blocking(round)),
                None => drop(tokio::task::spawn_blocking(round)),
            }
        }
        Ok(receiver)
    }

    /// Commits rounds until nothing is pending. The last round's results are sent only after
    /// this thread's database handle is dropped, so a caller that closes the store once its writes are
    /// answered can reopen the file at once.
    fn drain(&self, handle: Arc<DbHandle>) {
        let mut handle = Some(handle);
        // Only the first round lingers: later ones hold what arrived during the commit before.
        if !self.linger.is_zero() {
            std::thread::sleep(self.linger);
        }
        let mut batch = self.take_or_stop();
        while let (Some(entries), Some(open)) = (batch, handle.as_ref()) {
            let answers = match open.get_or_reopen() {
                Ok(db) => {
                    let answers = self.commit(&db, entries);
                    if answers
                        .iter()
                        .any(|(_, result)| matches!(result, Err(Error::Store(_))))
                    {
                        // Reopens the file if redb now refuses it (an I/O error).
                        open.recover(db);
                    }
                    answers
                }
                Err(error) => {
                    if entries.iter().any(|entry| entry.ordered) {
                        self.hold();
                    }
                    entries
                        .into_iter()
                        .map(|entry| {
                            entry.op.failed();
                            (entry.answer, Err(Error::Store(error.to_string())))
                        })
                        .collect()
                }
            };
            batch = self.take_or_stop();
            if batch.is_none() {
                handle = None;
            }
            for (answer, result) in answers {
                let _ = answer.send(result);
            }
        }
    }

    /// The pending operations, or `None` (and no longer running) when there are none.
    fn take_or_stop(&self) -> Option<Vec<Entry<Op, Out>>> {
        let mut pending = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if pending.queue.is_empty() {
            pending.running = false;
            None
        } else {
            Some(std::mem::take(&mut pending.queue))
        }
    }

    fn hold(&self) {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .held = true;
    }

    fn is_held(&self) -> bool {
        self.state
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .held
    }

    #[allow(clippy::type_complexity, reason = "pairs each caller with its result")]
    fn commit(
        &self,
        db: &Database,
        batch: Vec<Entry<Op, Out>>,
    ) -> Vec<(oneshot::Sender<Result<Out>>, Result<Out>)> {
        if batch.len() > 1 && !(self.is_held() && batch.iter().any(|entry| entry.ordered)) {
            match self.commit_together(db, &batch) {
                Ok(results) => {
                    return batch
                        .into_iter()
                        .zip(results)
                        .map(|(entry, result)| {
                            if result.is_ok() {
                                entry.op.committed();
                            } else {
                                entry.op.failed();
                            }
                            (entry.answer, result)
                        })
                        .collect();
                }
                Err(error) => {
                    tracing::debug!(%error, size = batch.len(), "group commit failed; committing one by one");
                }
            }
        }
        // One by one, in order; an ordered operation that fails holds the ordered ones behind
        // it (see the module's comment).
        let mut held = self.is_held();
        batch
            .into_iter()
            .map(|entry| {
                if entry.ordered && held {
                    entry.op.failed();
                    return (entry.answer, Err(self::held()));
                }
                let result = self.commit_one(db, &entry.op);
                match &result {
                    Ok(_) => entry.op.committed(),
                    Err(_) if entry.ordered => {
                        entry.op.failed();
                        held = true;
                        self.hold();
                    }
                    Err(_) => entry.op.failed(),
                }
                (entry.answer, result)
            })
            .collect()
    }

    /// One transaction for the whole batch; `Err` when it had to be aborted (also when an
    /// ordered operation failed, even cleanly: those behind it must not commit).
    fn commit_together(&self, db: &Database, batch: &[Entry<Op, Out>]) -> Result<Vec<Result<Out>>> {
        let txn = db.begin_write().map_err(db_error)?;
        let mut results = Vec::with_capacity(batch.len());
        for entry in batch {
            let result = (self.apply)(&txn, &entry.op);
            if let Err(error) = &result
                && (entry.ordered || !is_clean(error))
            {
                // Dropping the transaction aborts it.
                return Err(Error::Store(error.to_string()));
            }
            results.push(result);
            // A round can hold dozens of writes, each tens of µs of encoding and tree inserts.
            priority::checkpoint_step();
        }
        // The commit writes the pages and syncs them. The file yields between page writes and
        // before the sync (`YieldingFile`), but inside each write and the sync a kernel built
        // without preemption (as this VM's) lets no request in.
        priority::yield_to_requests();
        self.fault()?;
        txn.commit().map_err(db_error)?;
        Ok(results)
    }

    fn commit_one(&self, db: &Database, op: &Op) -> Result<Out> {
        let txn = db.begin_write().map_err(db_error)?;
        let out = (self.apply)(&txn, op)?;
        priority::yield_to_requests();
        self.fault()?;
        txn.commit().map_err(db_error)?;
        Ok(out)
    }

    /// Makes the next `commits` transactions fail before they commit (tests: a disk error).
    #[cfg(any(test, feature = "faults"))]
    pub fn fail_next_commits(&self, commits: u32) {
        self.faults
            .store(commits, std::sync::atomic::Ordering::SeqCst);
    }

    /// Injected failures not yet taken by a transaction (tests: how many were attempted).
    #[cfg(test)]
    pub fn faults_left(&self) -> u32 {
        self.faults.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Makes each injected failure take `delay` on the write thread first, as a failing disk's
    /// write would: a test can then act while the failing commit is in flight.
    #[cfg(any(test, feature = "faults"))]
    pub fn delay_failures(&self, delay: Duration) {
        let micros = u64::try_from(delay.as_micros()).unwrap_or(u64::MAX);
        self.fault_delay_micros
            .store(micros, std::sync::atomic::Ordering::SeqCst);
    }

    /// A failure injected by `fail_next_commits`, aborting the transaction.
    fn fault(&self) -> Result<()> {
        #[cfg(any(test, feature = "faults"))]
        if self
            .faults
            .fetch_update(
                std::sync::atomic::Ordering::SeqCst,
                std::sync::atomic::Ordering::SeqCst,
                |left| left.checked_sub(1),
            )
            .is_ok()
        {
            let delay = self
                .fault_delay_micros
                .load(std::sync::atomic::Ordering::SeqCst);
            std::thread::sleep(Duration::from_micros(delay));
            return Err(Error::Store("injected commit failure".to_owned()));
        }
        Ok(())
    }
}

/// What a held operation is answered.
fn held() -> Error {
    Error::Store("held back: an enqueue placed before it failed".to_owned())
}

/// Waits for a queued operation's answer.
async fn answered<Out>(receiver: oneshot::Receiver<Result<Out>>) -> Result<Out> {
    receiver
        .await
        .map_err(|_| Error::Store("the store's writer stopped".to_owned()))?
}

/// Failures that wrote nothing, so the rest of the batch may commit.
fn is_clean(error: &Error) -> bool {
    matches!(error, Error::StoreConflict { .. } | Error::JobGone(_))
}

fn db_error(error: impl Into<redb::Error>) -> Error {
    Error::Store(error.into().to_string())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use redb::{ReadableDatabase, ReadableTable, ReadableTableMetadata, TableDefinition};

    use super::*;

    const ROWS: TableDefinition<u64, u64> = TableDefinition::new("rows");

    /// Writes `key`, or fails cleanly when `conflict`; counts its publications.
    struct Write {
        key: u64,
        conflict: bool,
        published: Arc<AtomicUsize>,
    }

    impl Committed for Write {
        fn committed(self) {
            self.published.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn write(txn: &WriteTransaction, op: &Write) -> Result<()> {
        if op.conflict {
            return Err(Error::StoreConflict {
                expected: 0,
                found: 1,
            });
        }
        txn.open_table(ROWS)
            .map_err(db_error)?
            .insert(op.key, op.key)
            .map_err(db_error)?;
        Ok(())
    }

    /// Writes that arrive within the linger share one transaction; each one that committed is
    /// published, once, and one that failed cleanly is not.
    #[tokio::test]
    async fn a_shared_commit_publishes_each_write_that_committed() {
        let db = Arc::new(DbHandle::in_memory(|_| Ok(())).unwrap());
        let group = Arc::new(GroupCommit::with(write, Duration::from_millis(200), None));
        let published = Arc::new(AtomicUsize::new(0));
        let op = |key, conflict| Write {
            key,
            conflict,
            published: Arc::clone(&published),
        };
        let (first, second, third) = tokio::join!(
            group.submit(&db, op(1, false)),
            group.submit(&db, op(2, true)),
            group.submit(&db, op(3, false)),
        );
        assert!(first.is_ok() && third.is_ok());
        assert!(matches!(second, Err(Error::StoreConflict { .. })));
        assert_eq!(published.load(Ordering::SeqCst), 2);
        let db = db.get_or_reopen().unwrap();
        let txn = db.begin_read().unwrap();
        let rows = txn.open_table(ROWS).unwrap();
        assert_eq!(rows.len().unwrap(), 2);
    }

    /// Placed writes commit in order; once one fails, the placed ones behind it (in its
    /// round, or placed later) are refused without being written until `resume`, while a
    /// write submitted the ordinary way still commits.
    #[tokio::test]
    async fn a_failed_placed_write_holds_back_the_placed_ones_behind_it() {
        let db = Arc::new(DbHandle::in_memory(|_| Ok(())).unwrap());
        let group = Arc::new(GroupCommit::with(write, Duration::from_millis(100), None));
        let published = Arc::new(AtomicUsize::new(0));
        let op = |key| Write {
            key,
            conflict: false,
            published: Arc::clone(&published),
        };
        // The round's shared commit fails, then its first write alone.
        group.fail_next_commits(2);
        let placed: Vec<Answer<()>> = (1..=3)
            .map(|key| {
                group
                    .place(&db, op(key))
                    .map_err(|(_, error)| error)
                    .unwrap()
            })
            .collect();
        let mut results = Vec::new();
        for answer in placed {
            results.push(answer.await);
        }
        assert!(results.iter().all(Result::is_err), "{results:?}");
        // Placed later: refused at once, given back.
        let (refused, _) = group.place(&db, op(4)).err().unwrap();
        assert_eq!(refused.key, 4);
        // Not placed: commits.
        group.submit(&db, op(5)).await.unwrap();
        group.resume();
        group
            .place(&db, op(6))
            .map_err(|(_, error)| error)
            .unwrap()
            .await
            .unwrap();

        let db = db.get_or_reopen().unwrap();
        let txn = db.begin_read().unwrap();
        let rows = txn.open_table(ROWS).unwrap();
        let keys: Vec<u64> = rows
            .iter()
            .unwrap()
            .map(|row| row.unwrap().0.value())
            .collect();
        assert_eq!(keys, vec![5, 6]);
        assert_eq!(published.load(Ordering::SeqCst), 2);
    }
}
