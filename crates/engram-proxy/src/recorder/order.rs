//! Keeps a session's jobs in the order its requests arrived. A recorder enqueues only after the
//! answer has streamed back, so a fast answer to a later request could otherwise overtake a
//! slow earlier one. Each memory request takes a numbered ticket at rewrite time; the recorder
//! waits for the session's earlier tickets to be released before it enqueues. A ticket is
//! released when dropped, so a request that ends without a recording (an upstream error, a
//! client gone before the headers) never holds up the ones behind it.
//!
//! Across processes (replicas sharing Redis) the store keeps the order: the hot path notes each
//! recorded turn as arriving, and the store holds the session's later jobs until its job is
//! queued. An [`Arrival`] ends the note when the request ends without a recording, so it does
//! not hold them up either.

use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use tokio::sync::Notify;

use engram_store::{MemoryRecords, UserKey};

/// Longest a recorder waits for an earlier one of its session; past it, it goes ahead (and
/// says so), rather than hold a recording back forever.
const MAX_WAIT: Duration = Duration::from_secs(60);

#[derive(Debug, Default)]
pub struct SessionOrder {
    sessions: Mutex<HashMap<String, Turnstile>>,
}

#[derive(Debug)]
struct Turnstile {
    issued: u64,
    /// The ticket allowed to go now.
    next: u64,
    /// Tickets released ahead of `next`.
    released: BTreeSet<u64>,
    /// The wake-up of each ticket not yet released, by number: a release wakes only the ticket
    /// whose turn it makes. One wake-up for the whole session woke every waiting recording at
    /// each release, O(waiting) per recording: with one user at 1,000 req/s, 50,000 recordings
    /// waited in memory (docs/benchmarks-log.md).
    wakers: HashMap<u64, Arc<Notify>>,
}

impl SessionOrder {
    pub fn new() -> Arc<SessionOrder> {
        Arc::new(SessionOrder::default())
    }

    /// The next ticket of `session` (any key that names one session of one user).
    pub fn ticket(self: &Arc<Self>, session: String) -> Ticket {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        let turnstile = sessions
            .entry(session.clone())
            .or_insert_with(|| Turnstile {
                issued: 0,
                next: 0,
                released: BTreeSet::new(),
                wakers: HashMap::new(),
            });
        let number = turnstile.issued;
        turnstile.issued += 1;
        let notify = Arc::new(Notify::new());
        turnstile.wakers.insert(number, Arc::clone(&notify));
        Ticket {
            order: Arc::clone(self),
            session,
            number,
            notify,
        }
    }

    fn is_turn(&self, session: &str, number: u64) -> bool {
        let sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        sessions
            .get(session)
            .is_none_or(|turnstile| turnstile.next >= number)
    }

    fn release(&self, session: &str, number: u64) {
        let mut sessions = self.sessions.lock().unwrap_or_else(PoisonError::into_inner);
        let Some(turnstile) = sessions.get_mut(session) else {
            return;
        };
        turnstile.wakers.remove(&number);
        if number != turnstile.next {
            turnstile.released.insert(number);
            return;
        }
        turnstile.next += 1;
        while turnstile.released.remove(&turnstile.next) {
            turnstile.next += 1;
        }
        // Only the ticket now at `next` became free to go: those before it are released.
        if let Some(waker) = turnstile.wakers.get(&turnstile.next) {
            // Kept as a permit if it is not waiting yet.
            waker.notify_one();
        }
        if turnstile.next == turnstile.issued {
            sessions.remove(session);
        }
    }

    /// Sessions with tickets outstanding.
    pub fn len(&self) -> usize {
        self.sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A place in a session's order; dropping it lets the next one go.
#[derive(Debug)]
pub struct Ticket {
    order: Arc<SessionOrder>,
    session: String,
    number: u64,
    /// Told when the ticket's turn comes (see `Turnstile::wakers`).
    notify: Arc<Notify>,
}

impl Ticket {
    /// Whether every earlier ticket of the session was released already.
    pub fn is_turn(&self) -> bool {
        self.order.is_turn(&self.session, self.number)
    }

    /// A ticket of a second order of the session, taken now: taken by each recording while it
    /// holds its turn, such tickets follow the session's order too, after this one has been
    /// released (the outbox settles placed jobs' failures in it).
    pub fn follower(&self) -> Ticket {
        self.order.ticket(format!("{}\u{0}settle", self.session))
    }

    /// Waits until every earlier ticket of the session was released. False if it gave up
    /// after the longest wait.
    pub async fn wait_turn(&self) -> bool {
        let waited = tokio::time::timeout(MAX_WAIT, async {
            // A release between the check and the wait leaves a permit: it is not missed.
            while !self.order.is_turn(&self.session, self.number) {
                self.notify.notified().await;
            }
        })
        .await;
        waited.is_ok()
    }
}

impl PartialEq for Ticket {
    fn eq(&self, other: &Ticket) -> bool {
        self.session == other.session && self.number == other.number
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        self.order.release(&self.session, self.number);
    }
}

/// A recorded turn noted in the store as arriving (`MemoryRecords::hot_record_arriving`). Dropped
/// without [`Arrival::recorded`], it ends the note in the background, so a request that ends
/// without a job does not hold the session's later jobs back.
pub struct Arrival {
    store: Arc<dyn MemoryRecords>,
    user: UserKey,
    session: String,
    turn_id: String,
    /// The store answered the read that wrote the note.
    noted: std::sync::atomic::AtomicBool,
    recorded: std::sync::atomic::AtomicBool,
}

impl Arrival {
    pub fn new(
        store: Arc<dyn MemoryRecords>,
        user: UserKey,
        session: String,
        turn_id: String,
    ) -> Arrival {
        Arrival {
            store,
            user,
            session,
            turn_id,
            noted: std::sync::atomic::AtomicBool::new(false),
            recorded: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// The note is written: the read that writes it answered (a read that failed or missed
    /// its deadline may or may not have written it).
    pub fn noted(&self) {
        self.noted.store(true, std::sync::atomic::Ordering::Release);
    }

    /// Whether the note is known to be written, so that the store holds the session's later
    /// jobs behind this turn's.
    pub fn is_noted(&self) -> bool {
        self.noted.load(std::sync::atomic::Ordering::Acquire)
    }

    /// The turn's job is on its way to the store (its enqueue ends the note).
    pub fn recorded(&self) {
        self.recorded
            .store(true, std::sync::atomic::Ordering::Release);
    }
}

impl Drop for Arrival {
    fn drop(&mut self) {
        if self.recorded.load(std::sync::atomic::Ordering::Acquire) {
            return;
        }
        // Not on the shared TaskTracker: shutdown need not wait for it, since a note left
        // behind expires after the grace. Without a runtime (shutdown) it simply expires.
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        let store = Arc::clone(&self.store);
        let user = self.user.clone();
        let session = std::mem::take(&mut self.session);
        let turn_id = std::mem::take(&mut self.turn_id);
        runtime.spawn(async move {
            if let Err(error) = store.end_arrival(&user, &session, &turn_id).await {
                tracing::debug!(%error, "could not end a turn's arrival note; it expires");
            }
        });
    }
}

impl std::fmt::Debug for Arrival {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter
            .debug_struct("Arrival")
            .field("turn_id", &self.turn_id)
            .finish_non_exhaustive()
    }
}

impl PartialEq for Arrival {
    fn eq(&self, other: &Arrival) -> bool {
        self.user == other.user && self.session == other.session && self.turn_id == other.turn_id
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn later_tickets_wait_for_earlier_ones_and_dropped_ones_do_not_block() {
        let order = SessionOrder::new();
        let first = order.ticket("s".into());
        let second = order.ticket("s".into());
        let third = order.ticket("s".into());
        let other = order.ticket("other".into());
        assert!(first.wait_turn().await);
        assert!(other.wait_turn().await);
        let tasks = tokio_util::task::TaskTracker::new();
        let waiting = tasks.spawn(async move {
            let ok = third.wait_turn().await;
            drop(third);
            ok
        });
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        // The second never records (say, the upstream failed): released out of order.
        drop(second);
        tokio::time::sleep(Duration::from_millis(20)).await;
        assert!(!waiting.is_finished());
        drop(first);
        assert!(waiting.await.unwrap());
        drop(other);
        assert!(order.is_empty());
    }

    /// Thousands of one session's recordings waiting their turn go through in order, each
    /// release waking the next one only: when every release woke every waiter, 20,000 waiting
    /// tickets took about 2·10^8 wake-ups (minutes); now 2·10^4.
    #[tokio::test]
    async fn many_waiting_tickets_go_in_order_one_wake_up_each() {
        const TICKETS: usize = 20_000;
        let order = SessionOrder::new();
        let tickets: Vec<Ticket> = (0..TICKETS).map(|_| order.ticket("s".into())).collect();
        let went = Arc::new(Mutex::new(Vec::with_capacity(TICKETS)));
        let mut waiting = tokio::task::JoinSet::new();
        // Started newest first, so each waits rather than finding its turn at once.
        for ticket in tickets.into_iter().rev() {
            let went = Arc::clone(&went);
            waiting.spawn(async move {
                let ok = ticket.wait_turn().await;
                went.lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .push(ticket.number);
                drop(ticket);
                ok
            });
        }
        let all = tokio::time::timeout(Duration::from_secs(10), async {
            while let Some(ok) = waiting.join_next().await {
                assert!(ok.unwrap_or(false));
            }
        })
        .await;
        assert!(
            all.is_ok(),
            "the waiting tickets did not all go within 10 s"
        );
        let went = went.lock().unwrap_or_else(PoisonError::into_inner).clone();
        assert_eq!(went, (0..TICKETS as u64).collect::<Vec<_>>());
        assert!(order.is_empty());
    }
}
