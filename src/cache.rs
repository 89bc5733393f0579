//! Each user's memory and its search index, kept in process so the hot path does not decode the
//! state and rebuild the index on every request. An entry is valid for one memory version: the
//! hot path's store read returns the stored version, and only a different one brings the state.
//!
//! Shared by the hot path, which reads it, and the worker, which puts what it applied in it; it
//! sits below both, so neither imports the other for it.
//!
//! Versions never repeat for a user (a new memory starts at its creation time in microseconds,
//! see [`first_version`]), so an entry cached before a `forget` cannot match the memory that
//! replaces it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use crate::error::{Error, Result};
use crate::store::{MemoryUpdate, UserKey};
use engram_memory::tokens::TokenCount;
use engram_memory::{MemoryIndex, MemoryState};

/// One user's memory at one version, with its index.
#[derive(Debug)]
pub struct CachedMemory {
    pub state: MemoryState,
    pub index: MemoryIndex,
    /// Tokens of every raw turn's messages (what a client resending the whole history would
    /// send), kept up to date turn by turn for the metrics.
    pub history_tokens: TokenCount,
    /// Approximate heap size of the state and index, for the cache's byte budget.
    pub bytes: usize,
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
        let grown = state.estimated_bytes_from(previous.state.item_counts())
            + index
                .estimated_bytes()
                .saturating_sub(previous.index.estimated_bytes());
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
            bytes: previous.bytes + grown,
        }
    }

    fn with_index(
        state: MemoryState,
        index: MemoryIndex,
        history_tokens: TokenCount,
    ) -> CachedMemory {
        let bytes = state.estimated_bytes_from([0; 5]) + index.estimated_bytes();
        CachedMemory {
            state,
            index,
            history_tokens,
            bytes,
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
    capacity: usize,
    budget_bytes: usize,
    clock: AtomicU64,
}

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
            capacity: capacity.max(1),
            budget_bytes,
            clock: AtomicU64::new(0),
        }
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
    crate::runtime::now_micros()
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
        use engram_memory::tokens::count_in;
        use engram_memory::{Encoding, ExchangeInput, HeuristicExtractor, MemoryConfig};

        let exchanges = [
            ("My sister lives in Lisbon.", "Lovely city!"),
            ("I'm allergic to peanuts.", "Noted, no peanuts."),
        ];
        let mut state = MemoryState::new();
        let mut expected = 0;
        let mut previous: Option<CachedMemory> = None;
        for (n, (user, assistant)) in exchanges.iter().enumerate() {
            let exchange = ExchangeInput {
                session_id: "s".into(),
                turn_id: format!("t{n}"),
                user_text: (*user).into(),
                assistant_text: (*assistant).into(),
                ..ExchangeInput::default()
            };
            engram_memory::record_exchange(
                &mut state,
                &exchange,
                &HeuristicExtractor,
                &MemoryConfig::default(),
            );
            expected += count_in(Encoding::Cl100k, user) + count_in(Encoding::Cl100k, assistant);
            let cached = CachedMemory::advanced(previous.as_ref(), state.clone());
            assert_eq!(cached.history_tokens.get(Encoding::Cl100k), expected);
            previous = Some(cached);
        }
        assert_eq!(CachedMemory::new(MemoryState::new()).history_tokens.0, 0);
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

    #[test]
    fn first_versions_grow_with_time() {
        let a = first_version();
        std::thread::sleep(std::time::Duration::from_millis(2));
        assert!(first_version() > a);
    }
}
