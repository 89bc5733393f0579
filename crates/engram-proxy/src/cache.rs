//! Each user's memory and its search index, kept in process so the hot path does not decode the
//! state and rebuild the index on every request. An entry is valid for one memory version: the
//! hot path's store read returns the stored version, and only a different one brings the state.
//!
//! Shared by the hot path, which reads it, and the worker, which puts what it applied in it; it
//! sits below both, so neither imports the other for it. The worker leaves the memory it
//! computed here before committing it ([`MemoryCache::stage`]), and the store tells the cache
//! when that write landed ([`CommitListener`]: the embedded store's commit thread before the
//! commit is answered; Redis as soon as a read or the answer shows it): the memory is cached
//! then, without the store carrying anything of the cache.
//!
//! Versions never repeat for a user (a new memory starts at its creation time in microseconds,
//! see [`first_version`]), so an entry cached before a `forget` cannot match the memory that
//! replaces it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::watch;
use tokio_util::task::TaskTracker;

use crate::error::{Error, Result};
use engram_memory::tokens::TokenCount;
use engram_memory::{MemoryIndex, MemoryState};
use engram_store::{CommitListener, EncodedState, MemoryUpdate, Store, UserKey};

/// One user's memory at one version, with its index.
#[derive(Debug)]
pub struct CachedMemory {
    pub state: MemoryState,
    pub index: MemoryIndex,
    /// Tokens of every raw turn's messages (what a client resending the whole history would
    /// send), kept up to date turn by turn for the metrics.
    pub history_tokens: TokenCount,
    /// Approximate heap size of the state, its lookups and the index, for the cache's byte
    /// budget.
    pub bytes: usize,
    /// The share of `bytes` that is the state's items, which mostly grow, so a new version adds
    /// its new items' and its changed episodes' growth to it; the index and lookups, which also
    /// shrink (merges, dropped kept terms), are sized whole for each version.
    items_bytes: usize,
}

impl CachedMemory {
    /// Indexes `state` afresh (a memory read whole from the store, or a new one). Changes the
    /// state still records are left for the caller to take (a new memory's are its first
    /// write).
    pub fn new(state: MemoryState) -> CachedMemory {
        let index = MemoryIndex::build(&state);
        let history_tokens = turn_tokens(&state, 0);
        CachedMemory::with_index(state, index, history_tokens)
    }

    /// The memory the store's answer leads to from `cached` (the caller's copy at the version
    /// it asked with): the cached one when nothing changed, `cached` with the changed items
    /// applied for a delta, a fresh index over a whole memory. `None` when the store sent
    /// nothing but `cached` is not at `version` (it moved during the read). CPU-bound for a
    /// whole memory: call it off the async threads then.
    pub fn resolve(
        cached: Option<Arc<CachedMemory>>,
        version: u64,
        update: Option<MemoryUpdate>,
    ) -> Result<Option<Arc<CachedMemory>>> {
        let mut memory = match (update, cached) {
            (None, Some(cached)) if cached.version() == version => return Ok(Some(cached)),
            (None, _) => return Ok(None),
            (Some(MemoryUpdate::Whole(state)), _) => CachedMemory::new(*state),
            (Some(MemoryUpdate::Delta(delta)), Some(cached)) => {
                let state = delta.apply(&cached.state)?;
                CachedMemory::advanced(Some(&cached), state)
            }
            (Some(MemoryUpdate::Delta(_)), None) => {
                return Err(Error::Store(
                    "the store sent changes to a memory this process does not hold".into(),
                ));
            }
        };
        // Stored already: nothing to write back.
        memory.state.take_changes();
        Ok(Some(Arc::new(memory)))
    }

    /// The memory after `previous` changed into `state` in this process: `state` still records
    /// its changes since `previous` (they have not been taken for a store write yet), so the
    /// index is refreshed with them rather than rebuilt. `None` indexes afresh.
    pub fn advanced(previous: Option<&CachedMemory>, state: MemoryState) -> CachedMemory {
        let Some(previous) = previous else {
            return CachedMemory::new(state);
        };
        let mut index = previous.index.clone();
        index.refresh(&state);
        let items_bytes = (previous.items_bytes
            + state.estimated_bytes_from(previous.state.item_counts()))
        .saturating_add_signed(state.changed_bytes(&previous.state));
        let bytes = items_bytes + index.estimated_bytes() + state.lookups.estimated_bytes();
        let history_tokens = if state.rewrites == previous.state.rewrites
            && state.raw_turns.len() >= previous.state.raw_turns.len()
        {
            previous.history_tokens + turn_tokens(&state, previous.state.raw_turns.len())
        } else {
            turn_tokens(&state, 0)
        };
        CachedMemory {
            state,
            index,
            history_tokens,
            bytes,
            items_bytes,
        }
    }

    fn with_index(
        state: MemoryState,
        index: MemoryIndex,
        history_tokens: TokenCount,
    ) -> CachedMemory {
        let items_bytes = state.estimated_bytes_from([0; 5]);
        let bytes = items_bytes + index.estimated_bytes() + state.lookups.estimated_bytes();
        CachedMemory {
            state,
            index,
            history_tokens,
            bytes,
            items_bytes,
        }
    }

    pub fn version(&self) -> u64 {
        self.state.version
    }
}

/// Tokens of the raw turns from `from` on.
fn turn_tokens(state: &MemoryState, from: usize) -> TokenCount {
    (from..state.raw_turns.len())
        .filter_map(|seq| state.raw_turns.get(seq))
        .fold(TokenCount::default(), |sum, turn| {
            sum + turn.tokens.user + turn.tokens.assistant
        })
}

/// Bounded map of users to their cached memory, by users and by bytes; the least recently used
/// go first. A memory larger than the whole byte budget is not kept (its user's requests read
/// it from the store each time), so the cache never holds more than its budget.
#[derive(Debug)]
pub struct MemoryCache {
    entries: Mutex<Entries>,
    /// Memories the worker computed whose commits have not been answered yet, one per commit
    /// in flight.
    staged: Mutex<Vec<StagedMemory>>,
    /// Users whose whole memory is being read into the cache, each with word of the end.
    cold_loads: Loads,
    /// Users whose cached memory is being brought up to date by a read of its own (see
    /// [`MemoryCache::catch_up`]), each with word of the end.
    catch_ups: Loads,
    /// Where cold loads run whoever starts them; `None`: the caller's runtime.
    load_runtime: Option<tokio::runtime::Handle>,
    capacity: usize,
    budget_bytes: usize,
    clock: AtomicU64,
}

/// Reads into the cache in flight, one per user, each with word of its end.
type Loads = Arc<Mutex<HashMap<UserKey, watch::Receiver<bool>>>>;

#[derive(Debug, Default)]
struct Entries {
    map: HashMap<UserKey, Entry>,
    /// Sum of the entries' `CachedMemory::bytes`.
    bytes: usize,
}

#[derive(Debug)]
struct Entry {
    memory: Arc<CachedMemory>,
    last_used: u64,
}

impl MemoryCache {
    /// At most `capacity` users and `budget_bytes` of memories (estimated).
    pub fn new(capacity: usize, budget_bytes: usize) -> MemoryCache {
        MemoryCache {
            entries: Mutex::new(Entries::default()),
            staged: Mutex::new(Vec::new()),
            cold_loads: Loads::default(),
            catch_ups: Loads::default(),
            load_runtime: None,
            capacity: capacity.max(1),
            budget_bytes,
            clock: AtomicU64::new(0),
        }
    }

    /// Runs cold loads on `runtime` (the requests'), whoever starts them: the worker's runtime
    /// runs at idle priority, and requests wait for a load it started.
    pub fn loading_on(mut self, runtime: tokio::runtime::Handle) -> MemoryCache {
        self.load_runtime = Some(runtime);
        self
    }

    /// Word of the end of a cold load of `user`'s memory into the cache: the one in flight, or
    /// a new one, tracked by `background` (and run where [`MemoryCache::loading_on`] says).
    /// One whole read per user at a time, however many requests find the cache cold and
    /// whether or not the worker does too, and it runs to the end (filling the cache) even
    /// when they stop waiting: requests that each started their own read of a 50,000-turn
    /// memory and dropped it at their deadline held a gigabyte between them, and the worker
    /// reading and indexing a copy of its own beside the requests' load took a long memory's
    /// start-up peak of RSS from about 150 to 230 MiB.
    pub fn cold_load(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        user: &UserKey,
        background: &TaskTracker,
    ) -> watch::Receiver<bool> {
        let store = Arc::clone(store);
        let cache = Arc::clone(self);
        let reader = user.clone();
        self.once(&self.cold_loads, user, background, async move {
            let Some(state) = store.load_state(&reader).await? else {
                return Ok(());
            };
            let version = state.version;
            let update = Some(MemoryUpdate::Whole(Box::new(state)));
            cache.resolve_and_put(&reader, None, version, update).await
        })
    }

    /// Word of the end of a read that brings `user`'s cached memory (`from`) up to date: the
    /// one in flight, or a new one, run to the end like a cold load. Started when a request's
    /// read missed its deadline; while it runs, requests read without asking for the changes
    /// (`Store::hot_record_catching_up`) and wait for it. Each asking for them instead cost
    /// Redis a millisecond or more once the memory had moved by a write the cache was not told
    /// of: after Redis stalled for 8 s under one user at 1,000 req/s, every request's read
    /// asked for the same changes, none came back within its deadline, so none brought the
    /// cache up to date, and Redis stayed saturated until the load ended.
    pub fn catch_up(
        self: &Arc<Self>,
        store: &Arc<dyn Store>,
        user: &UserKey,
        from: Arc<CachedMemory>,
        background: &TaskTracker,
    ) -> watch::Receiver<bool> {
        let store = Arc::clone(store);
        let cache = Arc::clone(self);
        let reader = user.clone();
        self.once(&self.catch_ups, user, background, async move {
            // No session: nothing of one is wanted.
            let record = store.hot_record(&reader, "", Some(from.version())).await?;
            if record.version == 0 {
                // Forgotten: the next request finds that out itself.
                return Ok(());
            }
            cache
                .resolve_and_put(&reader, Some(from), record.version, record.update)
                .await
        })
    }

    /// Word of the end of the catch-up of `user`'s memory in flight, if one is.
    pub fn catching_up(&self, user: &UserKey) -> Option<watch::Receiver<bool>> {
        self.catch_ups
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(user)
            .cloned()
    }

    /// Caches what the store's answer leads to from `cached` (see [`CachedMemory::resolve`]),
    /// indexing a whole memory on a blocking thread.
    async fn resolve_and_put(
        &self,
        user: &UserKey,
        cached: Option<Arc<CachedMemory>>,
        version: u64,
        update: Option<MemoryUpdate>,
    ) -> Result<()> {
        let memory = if matches!(update, Some(MemoryUpdate::Whole(_))) {
            tokio::task::spawn_blocking(move || CachedMemory::resolve(cached, version, update))
                .await
                .map_err(|error| Error::Internal(format!("indexing task failed: {error}")))??
        } else {
            CachedMemory::resolve(cached, version, update)?
        };
        if let Some(memory) = memory {
            self.put(user, memory);
        }
        Ok(())
    }

    /// Runs `work` for `user` unless `loads` holds one in flight for them, tracked by
    /// `background` (where [`MemoryCache::loading_on`] says) and to the end whoever waits;
    /// word of the end of the one in flight.
    fn once(
        &self,
        loads: &Loads,
        user: &UserKey,
        background: &TaskTracker,
        work: impl Future<Output = Result<()>> + Send + 'static,
    ) -> watch::Receiver<bool> {
        let mut in_flight = loads.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(done) = in_flight.get(user) {
            return done.clone();
        }
        let (finished, done) = watch::channel(false);
        in_flight.insert(user.clone(), done.clone());
        drop(in_flight);
        let user = user.clone();
        let loads = Arc::clone(loads);
        let run = async move {
            if let Err(error) = work.await {
                tracing::warn!(%error, "reading a memory into the cache failed");
            }
            loads
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .remove(&user);
            let _ = finished.send(true);
        };
        match &self.load_runtime {
            Some(runtime) => drop(background.spawn_on(run, runtime)),
            None => drop(background.spawn(run)),
        }
        done
    }

    pub fn get(&self, user: &UserKey) -> Option<Arc<CachedMemory>> {
        let tick = self.clock.fetch_add(1, Ordering::Relaxed);
        let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
        let entry = entries.map.get_mut(user)?;
        entry.last_used = tick;
        Some(Arc::clone(&entry.memory))
    }

    /// Caches `memory` unless a newer version of the user's memory is cached already (a
    /// request and the worker may race to cache the same user), then evicts the least recently
    /// used until the cache is within its bounds.
    pub fn put(&self, user: &UserKey, memory: Arc<CachedMemory>) {
        let tick = self.clock.fetch_add(1, Ordering::Relaxed);
        // What leaves the cache is dropped after the lock is released: freeing a large memory
        // must not hold up the requests waiting on the lock.
        let mut replaced = Vec::new();
        if memory.bytes > self.budget_bytes {
            tracing::warn!(
                bytes = memory.bytes,
                budget = self.budget_bytes,
                "a memory is larger than the whole cache budget: not cached"
            );
            let removed = {
                let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
                entries.take(user)
            };
            drop(removed);
            return;
        }
        {
            let mut entries = self.entries.lock().unwrap_or_else(PoisonError::into_inner);
            let entries = &mut *entries;
            if let Some(entry) = entries.map.get_mut(user) {
                if entry.memory.version() <= memory.version() {
                    entries.bytes = entries.bytes - entry.memory.bytes + memory.bytes;
                    replaced.push(std::mem::replace(&mut entry.memory, memory));
                } else {
                    replaced.push(memory);
                }
                entry.last_used = tick;
            } else {
                entries.bytes += memory.bytes;
                entries.map.insert(
                    user.clone(),
                    Entry {
                        memory,
                        last_used: tick,
                    },
                );
            }
            if entries.map.len() > self.capacity || entries.bytes > self.budget_bytes {
                replaced.extend(entries.evict(self.capacity, self.budget_bytes, user));
            }
        }
        drop(replaced);
    }

    /// Leaves `memory` (the user's memory after a write from `expected_version` that encodes
    /// to `state`) to be cached the moment the store tells of that write's commit
    /// ([`CommitListener`]), which may be before the writer hears back. The writer
    /// calls [`Staged::publish`] once its commit returned, which caches it if the store did not
    /// tell (a store without a listener); dropping the guard instead (the commit failed)
    /// forgets it. The memory stays staged until then, however often the store tells.
    pub fn stage<'a>(
        &'a self,
        user: &'a UserKey,
        expected_version: u64,
        state: &EncodedState,
        memory: Arc<CachedMemory>,
    ) -> Staged<'a> {
        self.staged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(StagedMemory {
                user: user.clone(),
                expected_version,
                state: state.clone(),
                memory: Arc::clone(&memory),
                told: false,
            });
        Staged {
            cache: self,
            user,
            memory,
        }
    }

    /// Takes `memory` out of the staged ones: whether the store told of its commit, `None`
    /// when it was not staged.
    fn unstage(&self, memory: &Arc<CachedMemory>) -> Option<bool> {
        let mut staged = self.staged.lock().unwrap_or_else(PoisonError::into_inner);
        let at = staged
            .iter()
            .position(|staged| Arc::ptr_eq(&staged.memory, memory))?;
        Some(staged.swap_remove(at).told)
    }

    pub fn remove(&self, user: &UserKey) {
        let removed = self
            .entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(user);
        drop(removed);
    }

    pub fn len(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .map
            .len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Estimated bytes of the cached memories.
    pub fn bytes(&self) -> usize {
        self.entries
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .bytes
    }
}

/// A memory staged for its commit (see [`MemoryCache::stage`]).
#[derive(Debug)]
struct StagedMemory {
    user: UserKey,
    expected_version: u64,
    /// What the commit writes: with the user and the version it starts from, it names the
    /// commit exactly (versions never repeat for a user, so the stored memory at
    /// `expected_version` is one memory).
    state: EncodedState,
    memory: Arc<CachedMemory>,
    /// The store told of its commit (and it was cached then).
    told: bool,
}

/// The guard of a staged memory: [`Staged::publish`] once the commit returned; dropped
/// without it, the memory is forgotten.
#[must_use = "dropping the guard forgets the staged memory"]
pub struct Staged<'a> {
    cache: &'a MemoryCache,
    user: &'a UserKey,
    memory: Arc<CachedMemory>,
}

impl Staged<'_> {
    /// After the commit returned: caches the memory unless the store told of the commit.
    pub fn publish(self) {
        // Not again when the store told: the user may have been forgotten since.
        if self.cache.unstage(&self.memory) == Some(false) {
            self.cache.put(self.user, Arc::clone(&self.memory));
        }
    }
}

impl Drop for Staged<'_> {
    fn drop(&mut self) {
        self.cache.unstage(&self.memory);
    }
}

/// The store's word that a write committed: the memory staged for exactly that write, if any,
/// becomes the user's cached memory, here on the telling thread.
impl CommitListener for MemoryCache {
    fn committed(&self, user: &UserKey, expected_version: u64, state: &EncodedState) {
        // Left staged: the store may tell of one commit more than once (Redis: each read that
        // finds it), and the writer's guard takes it out.
        let committed = self
            .staged
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .iter_mut()
            .find(|staged| {
                staged.user == *user
                    && staged.expected_version == expected_version
                    && staged.state == *state
            })
            .map(|staged| {
                staged.told = true;
                Arc::clone(&staged.memory)
            });
        if let Some(memory) = committed {
            self.put(user, memory);
        }
    }
}

impl Entries {
    fn take(&mut self, user: &UserKey) -> Option<Arc<CachedMemory>> {
        let entry = self.map.remove(user)?;
        self.bytes -= entry.memory.bytes;
        Some(entry.memory)
    }

    /// Takes out the least recently used (never `keep`, the entry just put) until within both
    /// bounds with room to spare (an eighth of the capacity, an eighth of the budget), so
    /// eviction's scan is paid once per many inserts.
    fn evict(
        &mut self,
        capacity: usize,
        budget_bytes: usize,
        keep: &UserKey,
    ) -> Vec<Arc<CachedMemory>> {
        let mut by_age: Vec<(u64, UserKey)> = self
            .map
            .iter()
            .filter(|(user, _)| *user != keep)
            .map(|(user, entry)| (entry.last_used, user.clone()))
            .collect();
        by_age.sort_unstable_by_key(|(age, _)| *age);
        let users = if self.map.len() > capacity {
            capacity + 1 - (capacity / 8).max(1)
        } else {
            capacity
        };
        let bytes = if self.bytes > budget_bytes {
            budget_bytes - budget_bytes / 8
        } else {
            budget_bytes
        };
        let mut out = Vec::new();
        for (_, user) in by_age {
            if self.map.len() <= users && self.bytes <= bytes {
                break;
            }
            out.extend(self.take(&user));
        }
        out
    }
}

/// The version a user's first memory starts from: the current time in microseconds. Versions
/// then grow by one per change, so a memory created after a `forget` never reuses a version of
/// the forgotten one (which would let a cache serve forgotten memory).
pub fn first_version() -> u64 {
    engram_runtime::now_micros()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn memory(version: u64) -> Arc<CachedMemory> {
        let mut state = MemoryState::new();
        state.version = version;
        Arc::new(CachedMemory::new(state))
    }

    #[test]
    fn history_tokens_are_every_recorded_message_and_follow_new_versions() {
        use engram_memory::Encoding;
        use engram_memory::tokens::count_in;

        let exchanges = [
            ("My sister lives in Lisbon.", "Lovely city!"),
            ("I'm allergic to peanuts.", "Noted, no peanuts."),
        ];
        let mut state = MemoryState::new();
        let mut expected = 0;
        let mut previous: Option<CachedMemory> = None;
        for (n, (user, assistant)) in exchanges.iter().enumerate() {
            record(&mut state, "s", n, user, assistant);
            expected += count_in(Encoding::Cl100k, user) + count_in(Encoding::Cl100k, assistant);
            let cached = CachedMemory::advanced(previous.as_ref(), state.clone());
            assert_eq!(cached.history_tokens.get(Encoding::Cl100k), expected);
            previous = Some(cached);
        }
        assert_eq!(CachedMemory::new(MemoryState::new()).history_tokens.0, 0);
    }

    /// A memory's bytes count its lookups (built by the recording, kept in the cache), and
    /// following it version by version gives what sizing it afresh gives (the index and the
    /// lookups shrink at times: a merge, dropped kept terms).
    #[test]
    fn a_memorys_bytes_count_its_lookups_version_by_version() {
        let mut state = MemoryState::new();
        let mut previous: Option<CachedMemory> = None;
        for n in 0..200 {
            let user = format!(
                "My colleague number {n} moved to city {} last spring.",
                n % 7
            );
            let assistant = format!("Noted: colleague {n} and city {}.", n % 7);
            record(&mut state, &format!("s{}", n / 20), n, &user, &assistant);
            previous = Some(CachedMemory::advanced(previous.as_ref(), state.clone()));
        }
        let Some(memory) = previous else {
            unreachable!("200 versions were made")
        };
        let lookups = memory.state.lookups.estimated_bytes();
        assert!(lookups > 0, "the recording built the lookups");
        // Episodes grow after they are made, as later turns fold into them.
        assert!(
            memory.state.episodes.len() > 1,
            "turns were folded into episodes"
        );
        let afresh = CachedMemory::with_index(
            memory.state.clone(),
            memory.index.clone(),
            memory.history_tokens,
        );
        assert_eq!(memory.bytes, afresh.bytes);
        let mut unbuilt = memory.state.clone();
        unbuilt.lookups = Default::default();
        let without =
            CachedMemory::with_index(unbuilt, memory.index.clone(), memory.history_tokens);
        assert_eq!(without.bytes + lookups, memory.bytes);
    }

    #[test]
    fn a_newer_version_replaces_an_older_one_but_not_the_reverse() {
        let cache = MemoryCache::new(8, usize::MAX);
        let user = UserKey::new("t", "u");
        cache.put(&user, memory(5));
        cache.put(&user, memory(3));
        assert_eq!(cache.get(&user).map(|m| m.version()), Some(5));
        cache.put(&user, memory(7));
        assert_eq!(cache.get(&user).map(|m| m.version()), Some(7));
    }

    #[test]
    fn users_are_kept_apart_and_the_least_recently_used_go_first() {
        let cache = MemoryCache::new(4, usize::MAX);
        for n in 0..4 {
            cache.put(&UserKey::new("t", format!("u{n}")), memory(n + 1));
        }
        // u0 is used again, so u1 is now the least recently used.
        assert!(cache.get(&UserKey::new("t", "u0")).is_some());
        cache.put(&UserKey::new("t", "u4"), memory(9));
        assert_eq!(cache.len(), 4);
        assert!(cache.get(&UserKey::new("t", "u1")).is_none());
        assert!(cache.get(&UserKey::new("t", "u0")).is_some());
        assert_eq!(
            cache.get(&UserKey::new("t", "u4")).map(|m| m.version()),
            Some(9)
        );
        assert!(cache.get(&UserKey::new("other", "u0")).is_none());
    }

    fn sized(version: u64, bytes: usize) -> Arc<CachedMemory> {
        let mut state = MemoryState::new();
        state.version = version;
        let mut memory = CachedMemory::new(state);
        memory.bytes = bytes;
        Arc::new(memory)
    }

    #[test]
    fn the_cache_stays_within_its_byte_budget_with_one_huge_user_and_many_small_ones() {
        const BUDGET: usize = 10_000_000;
        let cache = MemoryCache::new(1_000, BUDGET);
        for n in 0..500 {
            cache.put(&UserKey::new("t", format!("small{n}")), sized(1, 50_000));
            assert!(cache.bytes() <= BUDGET);
        }
        // A huge user pushes the least recently used small ones out, not past the budget.
        let huge = UserKey::new("t", "huge");
        cache.put(&huge, sized(1, 8_000_000));
        assert!(cache.bytes() <= BUDGET, "{}", cache.bytes());
        assert!(cache.get(&huge).is_some());
        assert!(cache.get(&UserKey::new("t", "small499")).is_some());
        assert!(cache.get(&UserKey::new("t", "small0")).is_none());
        // It grows: still within the budget, and it stays.
        cache.put(&huge, sized(2, 9_500_000));
        assert!(cache.bytes() <= BUDGET, "{}", cache.bytes());
        assert_eq!(cache.get(&huge).map(|memory| memory.version()), Some(2));
        // Past the whole budget it is not kept at all.
        cache.put(&huge, sized(3, BUDGET + 1));
        assert!(cache.get(&huge).is_none());
        assert!(cache.bytes() <= BUDGET);
        for n in 0..500 {
            cache.put(&UserKey::new("t", format!("again{n}")), sized(1, 50_000));
        }
        assert!(cache.bytes() <= BUDGET);
        assert!(cache.len() <= BUDGET / 50_000);
    }

    /// Records one exchange into `state` (heuristic extractor, default settings).
    fn record(state: &mut MemoryState, session: &str, turn: usize, user: &str, assistant: &str) {
        let exchange = engram_memory::ExchangeInput {
            session_id: session.into(),
            turn_id: format!("t{turn}"),
            user_text: user.into(),
            assistant_text: assistant.into(),
            ..engram_memory::ExchangeInput::default()
        };
        engram_memory::record_exchange(
            state,
            &exchange,
            &engram_memory::HeuristicExtractor,
            &engram_memory::MemoryConfig::default(),
        );
    }

    /// A memory after one recorded exchange, and what its write encodes to.
    fn written(version: u64, text: &str) -> (Arc<CachedMemory>, EncodedState) {
        let mut state = MemoryState::new();
        state.version = version;
        record(&mut state, "s", 0, text, "Noted.");
        let encoded = EncodedState::of(&state).unwrap();
        (Arc::new(CachedMemory::new(state)), encoded)
    }

    /// A staged memory is cached when the store tells of exactly its write (user, version it
    /// started from, what it wrote), as often as it tells, and not on another write that
    /// reached the same version; its writer's `publish` then caches nothing more, and a dropped
    /// guard forgets it.
    #[test]
    fn a_staged_memory_is_cached_on_its_own_commit_only() {
        let cache = MemoryCache::new(8, usize::MAX);
        let user = UserKey::new("t", "u");
        let (memory, encoded) = written(10, "I live in Lisbon.");
        let (_, rival) = written(10, "I live in Madrid.");
        assert_eq!(encoded.version, rival.version);

        let staged = cache.stage(&user, 10, &encoded, Arc::clone(&memory));
        cache.committed(&user, 10, &rival);
        cache.committed(&user, 9, &encoded);
        cache.committed(&UserKey::new("t", "other"), 10, &encoded);
        assert!(cache.is_empty());
        cache.committed(&user, 10, &encoded);
        assert!(
            cache
                .get(&user)
                .is_some_and(|cached| Arc::ptr_eq(&cached, &memory))
        );
        // Told again (Redis: another read found the commit): still staged, cached again.
        cache.remove(&user);
        cache.committed(&user, 10, &encoded);
        assert!(!cache.is_empty(), "a second telling finds it staged");
        cache.remove(&user);
        staged.publish();
        assert!(cache.is_empty(), "published twice");

        // A commit that failed: the guard is dropped and a later word of that write is ignored.
        let staged = cache.stage(&user, 10, &encoded, Arc::clone(&memory));
        drop(staged);
        cache.committed(&user, 10, &encoded);
        assert!(cache.is_empty());

        // A store that tells nothing: the writer's `publish` caches it.
        cache
            .stage(&user, 10, &encoded, Arc::clone(&memory))
            .publish();
        assert!(
            cache
                .get(&user)
                .is_some_and(|cached| Arc::ptr_eq(&cached, &memory))
        );
    }

    /// The cache, told slowly: a store that answered a commit before telling its listener
    /// would let the commit return before the memory is cached.
    struct Slow(Arc<MemoryCache>);

    impl CommitListener for Slow {
        fn committed(&self, user: &UserKey, expected_version: u64, state: &EncodedState) {
            std::thread::sleep(std::time::Duration::from_millis(50));
            self.0.committed(user, expected_version, state);
        }
    }

    /// With the cache as the embedded store's commit listener, a staged memory is in the cache
    /// when its job commit returns, before its writer publishes it: a request that reads the new
    /// version finds its memory cached.
    #[tokio::test]
    async fn the_embedded_store_caches_a_staged_memory_before_its_commit_returns() {
        use engram_store::{EmbeddedStore, Job, JobId, JobQueue, Store};

        let cache = Arc::new(MemoryCache::new(8, usize::MAX));
        let store = EmbeddedStore::in_memory()
            .unwrap()
            .with_commit_listener(Arc::new(Slow(Arc::clone(&cache))));
        let user = UserKey::new("t", "u");
        let job = Job {
            id: JobId {
                user: user.clone(),
                key: "k".into(),
            },
            exchange: engram_memory::ExchangeInput {
                session_id: "s".into(),
                turn_id: "t0".into(),
                ..engram_memory::ExchangeInput::default()
            },
            trace: None,
        };
        store.enqueue(&job).await.unwrap();
        let (memory, encoded) = written(10, "I live in Lisbon.");
        let staged = cache.stage(&user, 0, &encoded, Arc::clone(&memory));
        store
            .commit_jobs(std::slice::from_ref(&job), &encoded, 0, &[])
            .await
            .unwrap();
        assert!(
            cache
                .get(&user)
                .is_some_and(|cached| Arc::ptr_eq(&cached, &memory))
        );
        staged.publish();
        assert_eq!(cache.len(), 1);
    }

    /// Everyone who finds a user's memory missing while it is being read (requests and the
    /// worker alike) waits for the one read in flight; once it is done, the memory is cached
    /// and a later miss starts a new read.
    #[tokio::test]
    async fn a_cold_load_in_flight_is_shared() {
        use engram_store::{EmbeddedStore, Store};

        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let user = UserKey::new("t", "u");
        let (memory, _) = written(10, "I live in Lisbon.");
        store.save_state(&user, &memory.state, 0).await.unwrap();
        let cache = Arc::new(MemoryCache::new(8, usize::MAX));
        let background = TaskTracker::new();
        // One thread: the first read cannot start before the second caller asks.
        let first = cache.cold_load(&store, &user, &background);
        let mut second = cache.cold_load(&store, &user, &background);
        assert!(first.same_channel(&second));
        second.wait_for(|done| *done).await.unwrap();
        assert!(cache.get(&user).is_some_and(|memory| memory.version() > 0));

        let third = cache.cold_load(&store, &user, &background);
        assert!(!third.same_channel(&first));
    }

    /// A copy behind the store by a write the cache was not told of is brought up to date by
    /// one read, however many callers ask while it runs; meanwhile `catching_up` says so.
    #[tokio::test]
    async fn one_read_catches_a_copy_up() {
        use engram_store::{EmbeddedStore, Store};

        let store: Arc<dyn Store> = Arc::new(EmbeddedStore::in_memory().unwrap());
        let user = UserKey::new("t", "u");
        let (memory, _) = written(10, "I live in Lisbon.");
        store.save_state(&user, &memory.state, 0).await.unwrap();
        let cache = Arc::new(MemoryCache::new(8, usize::MAX));
        cache.put(&user, Arc::clone(&memory));
        let mut newer = memory.state.clone();
        record(&mut newer, "s", 1, "I moved to Porto.", "Noted.");
        assert!(newer.version > memory.version());
        store
            .save_state(&user, &newer, memory.version())
            .await
            .unwrap();

        assert!(cache.catching_up(&user).is_none());
        let background = TaskTracker::new();
        // One thread: the read cannot end before the second caller asks.
        let first = cache.catch_up(&store, &user, Arc::clone(&memory), &background);
        let mut second = cache.catch_up(&store, &user, Arc::clone(&memory), &background);
        assert!(first.same_channel(&second));
        assert!(cache.catching_up(&user).is_some());
        second.wait_for(|done| *done).await.unwrap();
        assert_eq!(
            cache.get(&user).map(|cached| cached.version()),
            Some(newer.version)
        );
        assert!(cache.catching_up(&user).is_none());
    }

    #[test]
    fn first_versions_grow_with_time() {
        let a = first_version();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(first_version() > a);
    }
}
