//! The memory layer over a [`Store`]: the hot-path rewrite and the recorder.
//!
//! Hot path: resolve identity → one store read (the hot record), bounded by the hot-path
//! deadline → the user's cached memory and index (rebuilt only when the version moved) →
//! `memory::compose`. Any store trouble sends the request upstream without memory (fail open).
//!
//! Recording: handed to the [`Recorder`] (the captured exchange becomes a durable job in the
//! session's tail); the worker applies it later.

use std::sync::Arc;
use std::time::Duration;

use http::HeaderMap;
use tokio_util::task::TaskTracker;

use super::explain_log::ExplainLog;
use super::identity::{self, IdentityConfig, RequestIdentity};
use super::trust::Vouched;
use super::{BoxFuture, Exchange, MemoryLayer, MemoryMeasures, MemoryOutcome, RecordPlan, Rewrite};
use crate::cache::{CachedMemory, MemoryCache};
use crate::error::Error;
use crate::recorder::Recorder;
use crate::recorder::ids::{TurnIds, job_key};
use crate::recorder::order::{Arrival, SessionOrder};
use crate::telemetry::Telemetry;
use engram_memory::openai::ChatRequest;
use engram_memory::{self as memory, ComposeRequest, MemoryConfig, MemoryState};
use engram_runtime::now_micros;
use engram_store::{JobId, MemoryUpdate, Store, UserKey};

pub struct StoreMemory {
    store: Arc<dyn Store>,
    cache: Arc<MemoryCache>,
    recorder: Recorder,
    config: Arc<MemoryConfig>,
    identity: IdentityConfig,
    deadline: Duration,
    /// Memory of a user with nothing stored yet (a full-history client's turns still chain).
    empty: Arc<CachedMemory>,
    turn_ids: TurnIds,
    order: Arc<SessionOrder>,
    explains: Arc<ExplainLog>,
    telemetry: Telemetry,
    /// What tracks the cold loads this layer starts (they run where the cache says), so they
    /// finish (and fill the cache) after their request gave up, and shutdown waits for them.
    background: TaskTracker,
}

impl StoreMemory {
    pub fn new(
        store: Arc<dyn Store>,
        cache: Arc<MemoryCache>,
        recorder: Recorder,
        config: Arc<MemoryConfig>,
        identity: IdentityConfig,
        deadline: Duration,
        explains: Arc<ExplainLog>,
    ) -> StoreMemory {
        StoreMemory {
            store,
            cache,
            recorder,
            config,
            identity,
            deadline,
            empty: Arc::new(CachedMemory::new(MemoryState::new())),
            turn_ids: TurnIds::new(),
            order: SessionOrder::new(),
            explains,
            telemetry: Telemetry::default(),
            background: TaskTracker::new(),
        }
    }

    /// Tracks cold loads with `background` (the app's tracked task set, drained at shutdown).
    pub fn with_background(mut self, background: TaskTracker) -> StoreMemory {
        self.background = background;
        self
    }

    /// Spans for the memory steps of traced requests.
    pub fn with_telemetry(mut self, telemetry: Telemetry) -> StoreMemory {
        self.telemetry = telemetry;
        self
    }

    async fn rewrite_for(
        &self,
        resolved: RequestIdentity,
        request: &ChatRequest,
    ) -> Result<Rewrite, Error> {
        let Some(identity) = resolved.identity.clone() else {
            return Ok(skipped("no_user"));
        };
        if !resolved.reads_memory() {
            return Ok(skipped("mode_off"));
        }
        let user = UserKey::new(identity.tenant, identity.user);
        let session = identity.session;
        let turn_id = self.turn_ids.next();
        let arrival_us = now_micros();
        let plan = resolved.records().then(|| RecordPlan {
            job: JobId {
                key: job_key(&user, &session, &turn_id),
                user: user.clone(),
            },
            session: session.clone(),
            turn_id: turn_id.clone(),
            arrival_us,
            event_time: resolved.event_time.clone(),
            prior_chain: None,
            ticket: Some(Arc::new(
                self.order
                    .ticket(format!("{}\u{0}{}\u{0}{session}", user.tenant, user.user)),
            )),
            arrival: Some(Arc::new(Arrival::new(
                Arc::<dyn Store>::clone(&self.store),
                user.clone(),
                session.clone(),
                turn_id.clone(),
            ))),
        });

        if self.recorder.shedding_reads() {
            // A recorded turn is still recorded; only the memory read is left out.
            tracing::debug!("recordings are behind; answering without memory");
            return Ok(degraded("recording_backlog", turn_id, plan));
        }
        let mut load = self.telemetry.child("engram.memory.load");
        let mut cached = self.cache.get(&user);
        let started = tokio::time::Instant::now();
        if cached.is_none() {
            let mut done = self.cache.cold_load(&self.store, &user, &self.background);
            if tokio::time::timeout(self.deadline, done.wait_for(|done| *done))
                .await
                .is_err()
            {
                load.fail("memory_loading");
                tracing::info!("memory is being read into the cache; answering without it");
                return Ok(degraded("memory_loading", turn_id, plan));
            }
            cached = self.cache.get(&user);
        }
        let deadline = self.deadline.saturating_sub(started.elapsed());
        let cached_version = cached.as_ref().map(|m| m.version());
        // A turn that will be recorded is noted as arriving in the same read, so the session's
        // later turns, whichever replica records them, queue behind its job.
        let arriving = plan
            .as_ref()
            .map(|plan| (plan.turn_id.as_str(), arrival_us));
        let hot_record = match (&cached, self.cache.catching_up(&user)) {
            // Another read is bringing the cached copy up to date: not the changes again.
            (Some(memory), Some(_)) => {
                self.store
                    .hot_record_catching_up(&user, &session, memory.version(), arriving)
            }
            _ => match arriving {
                Some((turn_id, arrival_us)) => self.store.hot_record_arriving(
                    &user,
                    &session,
                    cached_version,
                    turn_id,
                    arrival_us,
                ),
                None => self.store.hot_record(&user, &session, cached_version),
            },
        };
        let read = tokio::time::timeout(deadline, hot_record).await;
        let mut record = match read {
            Ok(Ok(record)) => {
                if let Some(arrival) = plan.as_ref().and_then(|plan| plan.arrival.as_ref()) {
                    arrival.noted();
                }
                record
            }
            Ok(Err(error)) => {
                load.fail("store_error");
                tracing::warn!(%error, "memory read failed; answering without memory");
                return Ok(degraded("store_error", turn_id, plan));
            }
            Err(_) => {
                load.fail("store_timeout");
                // Whatever kept the read, the copy may be behind by a write this process was
                // not told of (one whose answer never came): one read catches it up, and the
                // requests meanwhile read without asking for the changes.
                if let Some(memory) = &cached {
                    self.cache
                        .catch_up(&self.store, &user, Arc::clone(memory), &self.background);
                }
                tracing::warn!(
                    deadline_ms = self.deadline.as_millis() as u64,
                    "memory read missed the hot-path deadline; answering without memory"
                );
                return Ok(degraded("store_timeout", turn_id, plan));
            }
        };
        if record.update.is_none()
            && record.version != 0
            && cached.as_ref().map(|memory| memory.version()) != Some(record.version)
        {
            // The store told the cache of the commit that made this version during the read
            // (Redis: the read found this process's own commit landed, see `CommitListener`),
            // or of a later one since (a busy core can poll the read after the next commit
            // landed): a newer memory serves as well, since the window leaves out the
            // unapplied exchanges that it holds.
            let newer = |cache: &MemoryCache| {
                cache
                    .get(&user)
                    .filter(|memory| memory.version() >= record.version)
            };
            let mut current = newer(&self.cache);
            if let (None, Some(memory)) = (&current, &cached) {
                // Behind by a write the cache was not told of (another process's, or one whose
                // answer never came): wait for the one read that catches the copy up.
                let mut done =
                    self.cache
                        .catch_up(&self.store, &user, Arc::clone(memory), &self.background);
                let left = self.deadline.saturating_sub(started.elapsed());
                if tokio::time::timeout(left, done.wait_for(|done| *done))
                    .await
                    .is_err()
                {
                    load.fail("store_timeout");
                    tracing::info!("memory is being brought up to date; answering without it");
                    return Ok(degraded("store_timeout", turn_id, plan));
                }
                current = newer(&self.cache);
            }
            if let Some(current) = current {
                record.version = current.version();
                cached = Some(current);
            }
        }
        let memory = if record.version == 0 {
            if cached.is_some() {
                // Forgotten since it was cached.
                self.cache.remove(&user);
            }
            Arc::clone(&self.empty)
        } else {
            let whole = matches!(record.update, Some(MemoryUpdate::Whole(_)));
            let version = record.version;
            let resolved = if whole {
                // Indexing a whole memory (a cold cache) is CPU work: off the async threads.
                let update = record.update;
                tokio::task::spawn_blocking(move || CachedMemory::resolve(cached, version, update))
                    .await
                    .map_err(|error| Error::Internal(format!("indexing task failed: {error}")))?
            } else {
                CachedMemory::resolve(cached, version, record.update)
            };
            match resolved {
                Ok(Some(memory)) => {
                    self.cache.put(&user, Arc::clone(&memory));
                    memory
                }
                Ok(None) => {
                    // The version moved between the cache check and the read; rare, not worth
                    // a second round trip on the hot path.
                    tracing::debug!(
                        version,
                        "memory changed during the read; answering without it"
                    );
                    return Ok(degraded("store_race", turn_id, plan));
                }
                Err(error) => {
                    load.fail("store_error");
                    tracing::warn!(%error, "memory read failed; answering without memory");
                    return Ok(degraded("store_error", turn_id, plan));
                }
            }
        };

        load.end();
        let loaded = started.elapsed();
        let compose = self.telemetry.child("engram.memory.compose");
        let composing = std::time::Instant::now();
        let composition = memory::compose(
            &memory.state,
            &memory.index,
            &record.prefetched,
            &ComposeRequest {
                session_id: &session,
                messages: &request.messages,
                model: &request.model,
                unapplied: &record.unapplied,
            },
            &self.config,
        );
        compose.end();
        let composed = composing.elapsed();
        let plan = plan.map(|plan| RecordPlan {
            prior_chain: Some(composition.prior_chain),
            ..plan
        });
        let measures = MemoryMeasures {
            blocks: composition.tokens,
            history_tokens: u64::from(memory.history_tokens.get(composition.explain.encoding)),
            retrieval_candidates: u32::try_from(composition.retrieval_candidates)
                .unwrap_or(u32::MAX),
            retrieval_hits: u32::try_from(composition.retrieval_hits).unwrap_or(u32::MAX),
            load: Some(loaded),
            compose: Some(composed),
        };
        self.explains.put(&user, &turn_id, composition.explain);
        if composition.outcome == memory::MemoryOutcome::Empty {
            return Ok(Rewrite {
                outcome: MemoryOutcome::Skipped,
                reason: Some("empty"),
                turn_id: Some(turn_id),
                record: plan,
                measures,
                ..Rewrite::default()
            });
        }
        Ok(Rewrite {
            outcome: MemoryOutcome::Injected,
            messages: Some(composition.messages),
            injected_tokens: composition.tokens.total,
            injected_items: u32::try_from(composition.items).unwrap_or(u32::MAX),
            reason: None,
            turn_id: Some(turn_id),
            reserved_over_budget: composition.outcome == memory::MemoryOutcome::ReservedOverBudget,
            record: plan,
            measures,
        })
    }
}

impl MemoryLayer for StoreMemory {
    fn rewrite<'a>(
        &'a self,
        client_headers: &'a HeaderMap,
        vouched: &'a Vouched,
        request: &'a ChatRequest,
    ) -> BoxFuture<'a, Result<Rewrite, Error>> {
        Box::pin(async move {
            let resolved = identity::resolve(client_headers, vouched, request, &self.identity)?;
            if let Some(identity) = &resolved.identity {
                self.telemetry.set_conversation_id(&identity.session);
            }
            self.rewrite_for(resolved, request).await
        })
    }

    fn record(&self, exchange: Exchange) -> BoxFuture<'static, ()> {
        self.recorder.record(exchange)
    }
}

/// Memory not used for this request, which is not recorded either.
fn skipped(reason: &'static str) -> Rewrite {
    Rewrite {
        outcome: MemoryOutcome::Skipped,
        reason: Some(reason),
        ..Rewrite::default()
    }
}

/// The store failed or was slow: no memory now, but the exchange is still recorded.
fn degraded(reason: &'static str, turn_id: String, plan: Option<RecordPlan>) -> Rewrite {
    Rewrite {
        outcome: MemoryOutcome::Degraded,
        reason: Some(reason),
        turn_id: Some(turn_id),
        record: plan,
        ..Rewrite::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pipeline::identity::{Identity, Mode};
    use crate::recorder::outbox::{Outbox, Spool};
    use crate::test_store::ByArrival;
    use engram_memory::openai::ChatMessage;
    use engram_store::{EmbeddedStore, MemoryRecords};
    use std::sync::atomic::Ordering;

    async fn layer(store: Arc<ByArrival>) -> StoreMemory {
        let outbox = outbox(&store).await;
        layer_with(store, outbox)
    }

    async fn outbox(store: &Arc<ByArrival>) -> Arc<Outbox> {
        let spool = Spool::Memory {
            store: Arc::new(EmbeddedStore::in_memory().unwrap()),
            capacity: 16,
        };
        let queued = Arc::new(tokio::sync::Notify::new());
        Arc::new(Outbox::new(store.clone(), spool, queued).await)
    }

    fn layer_with(store: Arc<ByArrival>, outbox: Arc<Outbox>) -> StoreMemory {
        StoreMemory::new(
            store,
            Arc::new(MemoryCache::new(16, 1 << 20)),
            Recorder::new(outbox, Duration::from_secs(1)),
            Arc::new(MemoryConfig::default()),
            IdentityConfig::default(),
            Duration::from_millis(50),
            Arc::new(ExplainLog::new(16)),
        )
    }

    /// A store holding one memory: user `ana` lives in Lisbon.
    async fn lisbon_stored() -> (Arc<ByArrival>, UserKey, MemoryState) {
        let store = Arc::new(ByArrival::new());
        let user = UserKey::new("t", "ana");
        let mut state = MemoryState::new();
        remember(&mut state, "t0", "I live in Lisbon.");
        store.save_state(&user, &state, 0).await.unwrap();
        (store, user, state)
    }

    /// While recordings are behind (half the backlog bound in flight), a request answers
    /// without memory, and its turn is still planned for recording; once they catch up,
    /// memory comes back.
    #[tokio::test]
    async fn while_recordings_are_behind_requests_answer_without_memory_and_still_record() {
        use crate::recorder::outbox::SHED_READS_IN_FLIGHT;
        let (store, user, _) = lisbon_stored().await;
        let outbox = outbox(&store).await;
        let layer = layer_with(Arc::clone(&store), Arc::clone(&outbox));
        let behind = outbox.backlog(&user, SHED_READS_IN_FLIGHT + 1, 1);
        let (resolved, request) = turn();
        let shed = layer.rewrite_for(resolved, &request).await.unwrap();
        assert_eq!(shed.outcome, MemoryOutcome::Degraded);
        assert_eq!(shed.reason, Some("recording_backlog"));
        assert!(shed.record.is_some(), "the turn is still recorded");

        drop(behind);
        let (resolved, request) = turn();
        let answered = layer.rewrite_for(resolved, &request).await.unwrap();
        assert_eq!(answered.outcome, MemoryOutcome::Injected);
    }

    /// A read that misses its deadline starts one read that catches the cached copy up to
    /// a write it was not told of; the requests meanwhile read without asking for the changes
    /// and wait for that one (without memory past their deadline), and once it is done they
    /// answer with the memory that write made.
    #[tokio::test]
    async fn after_a_missed_read_one_read_catches_the_copy_up() {
        let (store, user, mut state) = lisbon_stored().await;
        let layer = layer(Arc::clone(&store)).await;
        let (resolved, request) = turn();
        layer.rewrite_for(resolved, &request).await.unwrap();
        let cached = layer.cache.get(&user).map(|memory| memory.version());
        assert_eq!(cached, Some(state.version));

        // Written by another process: this one's cache is not told.
        let before = state.version;
        remember(&mut state, "t1", "I moved to Porto.");
        store.save_state(&user, &state, before).await.unwrap();

        store.reads_hang.store(true, Ordering::Release);
        let (resolved, request) = turn();
        let missed = layer.rewrite_for(resolved, &request).await.unwrap();
        assert_eq!(missed.reason, Some("store_timeout"));
        assert!(layer.cache.catching_up(&user).is_some());
        // The catch-up's own read hangs too: the next request does not ask for the changes,
        // and gives up waiting for the catch-up at its deadline.
        let (resolved, request) = turn();
        let waited = layer.rewrite_for(resolved, &request).await.unwrap();
        assert_eq!(waited.reason, Some("store_timeout"));
        assert_eq!(store.catching_up_reads.load(Ordering::Acquire), 1);

        store.reads_hang.store(false, Ordering::Release);
        let caught_up = tokio::time::timeout(Duration::from_secs(5), async {
            while layer.cache.catching_up(&user).is_some() {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        assert!(caught_up.is_ok(), "the catch-up never ended");
        let (resolved, request) = turn();
        let answered = layer.rewrite_for(resolved, &request).await.unwrap();
        assert_eq!(answered.outcome, MemoryOutcome::Injected);
        let cached = layer.cache.get(&user).map(|memory| memory.version());
        assert_eq!(cached, Some(state.version));
    }

    /// Records the user's `text` as turn `turn_id` of session `s` into `state`.
    fn remember(state: &mut MemoryState, turn_id: &str, text: &str) {
        let exchange = memory::ExchangeInput {
            session_id: "s".into(),
            turn_id: turn_id.into(),
            user_text: text.into(),
            assistant_text: "Noted.".into(),
            ..memory::ExchangeInput::default()
        };
        let config = MemoryConfig::default();
        memory::record_exchange(state, &exchange, &memory::HeuristicExtractor, &config);
    }

    fn turn() -> (RequestIdentity, ChatRequest) {
        let resolved = RequestIdentity {
            identity: Some(Identity {
                tenant: "t".into(),
                user: "ana".into(),
                session: "s".into(),
            }),
            mode: Mode::Normal,
            event_time: None,
        };
        let request = ChatRequest {
            model: "m".into(),
            messages: vec![ChatMessage::new("user", "I like tea.")],
            stream: None,
            stream_options: None,
            extra: serde_json::Map::new(),
        };
        (resolved, request)
    }

    /// The recorder lets a turn's session go on before its enqueue only once the store holds
    /// the session's later jobs behind it: so a turn is noted as arriving only when the read
    /// that writes the note answered, not when it failed or missed its deadline.
    #[tokio::test]
    async fn a_turn_is_noted_as_arriving_only_when_its_read_answered() {
        for answers in [true, false] {
            let store = Arc::new(ByArrival::new());
            let memory = layer(Arc::clone(&store)).await;
            // Read once, so that the cold load is done and the turn's read is the hot one.
            let (resolved, request) = turn();
            memory.rewrite_for(resolved, &request).await.unwrap();
            store.reads_hang.store(!answers, Ordering::Release);
            let (resolved, request) = turn();
            let rewrite = memory.rewrite_for(resolved, &request).await.unwrap();
            let answered = rewrite.outcome != MemoryOutcome::Degraded;
            assert_eq!(answered, answers, "{:?}", rewrite.reason);
            let plan = rewrite.record.expect("the turn is recorded either way");
            let arrival = plan.arrival.expect("a recorded turn has an arrival note");
            assert_eq!(arrival.is_noted(), answers);
        }
    }
}
