//! Lookups derived from a memory's items, kept beside them so that a turn's work never scans
//! the whole history: turn ids, fact keys, the facts each turn supports, fact signatures (for
//! consolidation), episodes by the terms that rehydrate them, the working set (facts and
//! turn summaries in NEW or CURRENT), the distinct terms of the working set's texts, and the
//! core block's facts in order (computed by the first request after a change).
//!
//! None of it is stored. A copy of the memory builds them from its items the first time it
//! needs them (O(history), once per process and user), then keeps them current from the
//! changes its items record ([`super::segmented::Segmented::pending`]):
//! [`MemoryState::sync_lookups`] applies the changes they have not seen yet. Lists may hold stale entries (an id whose item no longer
//! matches); every user checks the item itself, so a stale entry costs a look, never a wrong
//! answer. They are layered maps ([`LayeredMap`]), so a copy of the memory shares them.

use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::hash::{BuildHasher, Hash, Hasher};
use std::sync::{Arc, OnceLock};

use rustc_hash::{FxBuildHasher, FxHasher};

use super::layered::LayeredMap;
use super::model::{
    EpisodeId, EpisodeManifest, Fact, FactId, ItemRef, MemoryState, SummaryText, Tier,
    TurnLogEntry, TurnSeq,
};
use crate::config::ScoringWeights;
use crate::text::{TermSet, normalise, remembered_terms, terms};

type Strings<V> = LayeredMap<String, V, foldhash::fast::RandomState>;

/// The key of a turn id in [`Lookups::turn_ids`]: a hash seeded once per process, so a client
/// cannot choose ids that share one.
fn turn_id_hash(turn_id: &str) -> u64 {
    static SEED: OnceLock<foldhash::fast::RandomState> = OnceLock::new();
    SEED.get_or_init(foldhash::fast::RandomState::default)
        .hash_one(turn_id)
}

/// Episodes a message's term brings up as rehydration candidates at most: the newest that
/// have it (episode ids grow with time).
pub const EPISODES_PER_TERM: usize = 256;

/// The positions each kind of item recorded as changed, in the order of [`Lookups::seen`].
fn pending(state: &MemoryState) -> [&[u32]; 5] {
    [
        state.raw_turns.pending(),
        state.facts.pending(),
        state.turn_log.pending(),
        state.episodes.pending(),
        state.sessions.pending(),
    ]
}

#[derive(Clone, Default)]
pub struct Lookups {
    built: bool,
    /// How much of each pending-change list (raw turns, facts, turn log, episodes, sessions)
    /// has been applied.
    seen: [usize; 5],
    /// Turn id hash ([`turn_id_hash`]) -> its raw turn. Keyed by a hash, not the id's text:
    /// that was a second copy of every turn id, about 60 bytes a turn. [`Lookups::turn`]
    /// checks the turn's own id, so two ids sharing a hash (one chance in 2^64 a pair, the
    /// seed random per process) cost the older one its look-up: a resent copy of it would be
    /// recorded again, nothing is lost.
    turn_ids: LayeredMap<u64, TurnSeq, FxBuildHasher>,
    session_ids: Strings<u32>,
    /// Normalised key -> facts that had it.
    fact_keys: Strings<Vec<FactId>>,
    /// Raw turn -> facts whose provenance named it.
    facts_by_turn: LayeredMap<TurnSeq, Vec<FactId>, FxBuildHasher>,
    /// Signature (stemmed key and value terms) hash -> facts that had it.
    signatures: LayeredMap<u64, Vec<FactId>, FxBuildHasher>,
    /// Signatures that two facts came to share since the last consolidation.
    collided: BTreeSet<u64>,
    /// Match term -> episodes that had it.
    episode_terms: Strings<Vec<EpisodeId>>,
    /// Fact -> whether it was active and its provenance, as last seen: a manifest lists the
    /// active facts of its turns, so a change of either touches the episodes of the turns it
    /// names before and after.
    fact_membership: LayeredMap<FactId, (bool, Vec<TurnSeq>), FxBuildHasher>,
    /// Episodes whose facts changed since the last consolidation. Not kept across a restart:
    /// a manifest waiting for its refresh then gets it when its facts next change.
    stale_episodes: BTreeSet<EpisodeId>,
    working_facts: BTreeSet<FactId>,
    working_summaries: BTreeSet<TurnSeq>,
    /// Active hard constraints (the core block reserves room for each on every request).
    hard_constraints: BTreeSet<FactId>,
    /// Hashes of the distinct terms of working-set items' texts ([`MemoryState::item_terms`]),
    /// kept from one turn to the next: every turn compares each working-set item with the new
    /// message, and resolving, joining and hashing their texts again was most of that work.
    /// Each is kept with what its text was made from, and used only while the item still has
    /// it; a summary's entry goes when its raw turn changes. Items that leave the working set
    /// keep theirs, since rehydration brings many back within a few turns, until the map
    /// reaches [`KEPT_TERMS`] entries: then only the working set's stay.
    item_terms: HashMap<ItemRef, Arc<KeptTerms>, FxBuildHasher>,
    /// The core block's facts in order, set by the first request that reads this version of
    /// the memory: their scores depend on the memory alone, and scoring and sorting the working
    /// set was a twentieth of every request. `catch_up` clears it.
    core_facts: OnceLock<CoreFacts>,
}

/// A working-set fact and its tier score.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ScoredFact {
    pub score: f32,
    /// Its position in `MemoryState::facts`.
    pub index: usize,
}

/// The core block's candidate facts, best first, and the weights they were scored with.
#[derive(Debug, Clone)]
struct CoreFacts {
    weights: ScoringWeights,
    facts: Vec<ScoredFact>,
}

/// Items whose terms the lookups keep before they drop all but the working set's: about a
/// third of a megabyte for a long history's user. Over the history benchmark's first 3,000
/// turns this leaves 4 misses a turn (1 with no limit, 10 at 512, 17 keeping the working
/// set's only), of about 175 look-ups.
const KEPT_TERMS: usize = 1_024;

/// Bytes of a map entry keyed by a short string (an id or a term) with a small value: the
/// key's `String` and its text, the value, the table's control byte and spare room.
const TEXT_KEYED_ENTRY: usize = 96;
/// Bytes of a map entry keyed by a number with a short list of ids.
const ID_KEYED_ENTRY: usize = 64;
/// Bytes of a map entry keyed by a hash with a number: the slot, its control byte and spare
/// room.
const HASH_KEYED_ENTRY: usize = 24;
/// Bytes of a kept-terms entry besides its hashes and text: the map's slot and the two
/// shared allocations' headers.
const KEPT_TERMS_ENTRY: usize = 112;

/// What an item's text is made from: a fact's key and value, a summary's two sides (which a
/// span resolves against its raw turn, whose changes drop the entry).
#[derive(Clone, PartialEq)]
enum TextSource {
    Fact(String, String),
    Summary(SummaryText, SummaryText),
}

impl TextSource {
    fn of(state: &MemoryState, item: ItemRef) -> Option<TextSource> {
        match item {
            ItemRef::Fact(id) => state
                .fact(id)
                .map(|fact| TextSource::Fact(fact.key.clone(), fact.value.clone())),
            ItemRef::Summary(seq) => state.turn_log.get(seq as usize).map(|entry| {
                TextSource::Summary(entry.user_summary.clone(), entry.assistant_summary.clone())
            }),
            _ => None,
        }
    }

    /// Bytes of text this holds on the heap.
    fn text_bytes(&self) -> usize {
        let side = |text: &SummaryText| match text {
            SummaryText::Text(text) => text.len(),
            SummaryText::Span(_) => 0,
        };
        match self {
            TextSource::Fact(key, value) => key.len() + value.len(),
            TextSource::Summary(user, assistant) => side(user) + side(assistant),
        }
    }

    /// Whether `item` is still made from this.
    fn holds_for(&self, state: &MemoryState, item: ItemRef) -> bool {
        match (self, item) {
            (TextSource::Fact(key, value), ItemRef::Fact(id)) => state
                .fact(id)
                .is_some_and(|fact| fact.key == *key && fact.value == *value),
            (TextSource::Summary(user, assistant), ItemRef::Summary(seq)) => {
                state.turn_log.get(seq as usize).is_some_and(|entry| {
                    entry.user_summary == *user && entry.assistant_summary == *assistant
                })
            }
            _ => false,
        }
    }
}

struct KeptTerms {
    source: TextSource,
    hashes: Arc<[u64]>,
}

impl std::fmt::Debug for Lookups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lookups")
            .field("built", &self.built)
            .field("working_facts", &self.working_facts.len())
            .field("working_summaries", &self.working_summaries.len())
            .finish_non_exhaustive()
    }
}

/// Derived data: two memories with equal items are equal whatever their lookups hold.
impl PartialEq for Lookups {
    fn eq(&self, _: &Lookups) -> bool {
        true
    }
}

/// Stemmed key terms and value terms, each sorted and distinct.
pub type Signature = (Vec<String>, Vec<String>);

/// A fact's consolidation signature: its stemmed key and value terms, sorted and distinct.
/// `None` for a fact whose key has no terms (never merged).
pub fn signature(fact: &Fact) -> Option<Signature> {
    let mut key_terms: Vec<String> = terms(&fact.key).collect();
    key_terms.sort();
    key_terms.dedup();
    if key_terms.is_empty() {
        return None;
    }
    let mut value_terms: Vec<String> = terms(&fact.value).collect();
    value_terms.sort();
    value_terms.dedup();
    Some((key_terms, value_terms))
}

/// A term's hash as [`MemoryState::item_terms`] keeps it. Two distinct terms share one with a
/// chance of about 2^-64, and a text can only ever mislead its own user's memory that way.
pub fn term_hash(term: &str) -> u64 {
    let mut hasher = FxHasher::default();
    term.hash(&mut hasher);
    hasher.finish()
}

fn signature_hash(signature: &Signature) -> u64 {
    let mut hasher = FxHasher::default();
    signature.hash(&mut hasher);
    hasher.finish()
}

/// Adds `id` to the list under `key` unless it is there; true when the list already held
/// another id.
fn add_to<K, S>(map: &mut LayeredMap<K, Vec<u32>, S>, key: K, id: u32) -> bool
where
    K: Hash + Eq + Clone,
    S: std::hash::BuildHasher + Default + Clone,
{
    if let Some(ids) = map.get(&key)
        && ids.contains(&id)
    {
        return ids.len() > 1;
    }
    let mut ids = map.get(&key).cloned().unwrap_or_default();
    let shared = !ids.is_empty();
    ids.push(id);
    map.insert(key, ids);
    shared
}

impl Lookups {
    /// Whether the lookups have been built for this copy (they may still lag its latest
    /// changes until [`MemoryState::sync_lookups`]).
    pub fn is_built(&self) -> bool {
        self.built
    }

    /// The position of session `session_id`.
    pub fn session(&self, state: &MemoryState, session_id: &str) -> Option<u32> {
        let at = *self.session_ids.get(session_id)?;
        state
            .sessions
            .get(at as usize)
            .is_some_and(|session| session.id == session_id)
            .then_some(at)
    }

    /// The raw turn recorded under `turn_id`.
    pub fn turn(&self, state: &MemoryState, turn_id: &str) -> Option<TurnSeq> {
        let seq = *self.turn_ids.get(&turn_id_hash(turn_id))?;
        state
            .raw_turns
            .get(seq as usize)
            .is_some_and(|turn| &*turn.id == turn_id)
            .then_some(seq)
    }

    /// Facts whose key normalises to `normalised_key`, ascending.
    pub fn facts_with_key(&self, state: &MemoryState, normalised_key: &str) -> Vec<FactId> {
        let mut ids: Vec<FactId> = self
            .fact_keys
            .get(normalised_key)
            .map(|ids| {
                ids.iter()
                    .copied()
                    .filter(|id| {
                        state
                            .fact(*id)
                            .is_some_and(|fact| normalise(&fact.key) == normalised_key)
                    })
                    .collect()
            })
            .unwrap_or_default();
        ids.sort_unstable();
        ids
    }

    /// Facts whose provenance names any of `turns`, ascending (active or not).
    pub fn facts_of_turns(&self, state: &MemoryState, turns: &[TurnSeq]) -> Vec<FactId> {
        let mut ids: Vec<FactId> = turns
            .iter()
            .filter_map(|seq| self.facts_by_turn.get(seq))
            .flatten()
            .copied()
            .filter(|id| {
                state
                    .fact(*id)
                    .is_some_and(|fact| fact.provenance.iter().any(|seq| turns.contains(seq)))
            })
            .collect();
        ids.sort_unstable();
        ids.dedup();
        ids
    }

    /// Episodes sharing at least `min` of `terms` with their match terms, as `(bound, id)`
    /// ordered by bound then id, both descending: the bound counts the terms whose lists name
    /// the episode, never fewer than it shares among those lists (a list may still name an
    /// episode whose terms have changed since). Each term names its newest
    /// [`EPISODES_PER_TERM`] episodes only.
    pub fn episodes_with_terms<'a>(
        &self,
        terms: impl Iterator<Item = &'a String>,
        min: usize,
    ) -> Vec<(usize, EpisodeId)> {
        let mut counts: std::collections::HashMap<EpisodeId, usize, FxBuildHasher> =
            std::collections::HashMap::default();
        for term in terms {
            // The newest episodes of each term only: a word the user says every day would
            // otherwise make each turn count thousands of episodes.
            let listed = self
                .episode_terms
                .get(term.as_str())
                .map_or(&[][..], Vec::as_slice);
            for id in listed.iter().rev().take(EPISODES_PER_TERM) {
                *counts.entry(*id).or_default() += 1;
            }
        }
        let mut ranked: Vec<(usize, EpisodeId)> = counts
            .into_iter()
            .filter(|(_, count)| *count >= min.max(1))
            .map(|(id, count)| (count, id))
            .collect();
        ranked.sort_unstable_by(|a, b| b.cmp(a));
        ranked
    }

    /// Groups of active facts with equal signatures that formed since the last call, each
    /// ascending by id; the record starts over.
    pub fn take_collisions(&mut self, state: &MemoryState) -> Vec<Vec<FactId>> {
        let collided = std::mem::take(&mut self.collided);
        let mut groups = Vec::new();
        for hash in collided {
            let Some(ids) = self.signatures.get(&hash) else {
                continue;
            };
            let mut by_signature: Vec<(Signature, FactId)> = ids
                .iter()
                .filter_map(|id| state.fact(*id))
                .filter(|fact| fact.active)
                .filter_map(|fact| Some((signature(fact)?, fact.id)))
                .collect();
            by_signature.sort();
            let mut start = 0;
            while start < by_signature.len() {
                let end = start
                    + by_signature[start..]
                        .iter()
                        .take_while(|(sig, _)| *sig == by_signature[start].0)
                        .count();
                if end - start > 1 {
                    groups.push(by_signature[start..end].iter().map(|(_, id)| *id).collect());
                }
                start = end;
            }
        }
        groups
    }

    /// Episodes whose facts changed since the last call, ascending; the record starts over.
    pub fn take_stale_episodes(&mut self) -> Vec<EpisodeId> {
        std::mem::take(&mut self.stale_episodes)
            .into_iter()
            .collect()
    }

    /// Facts in NEW or CURRENT, ascending.
    pub fn working_facts(&self) -> &BTreeSet<FactId> {
        &self.working_facts
    }

    /// The core block's candidate facts in order, as `rank` gives them for `weights`: kept
    /// from the first call after the memory last changed, computed afresh for other weights.
    pub(crate) fn core_facts(
        &self,
        weights: &ScoringWeights,
        rank: impl Fn() -> Vec<ScoredFact>,
    ) -> Cow<'_, [ScoredFact]> {
        let kept = self.core_facts.get_or_init(|| CoreFacts {
            weights: weights.clone(),
            facts: rank(),
        });
        if kept.weights == *weights {
            Cow::Borrowed(&kept.facts)
        } else {
            Cow::Owned(rank())
        }
    }

    /// Active hard constraints, ascending.
    pub fn hard_constraints(&self) -> &BTreeSet<FactId> {
        &self.hard_constraints
    }

    /// Whether the lookups have taken in every change `state` recorded (a cached memory's
    /// have): a reader that cannot bring them up to date (it holds the memory shared) uses
    /// them only then.
    pub fn is_current(&self, state: &MemoryState) -> bool {
        self.built && self.seen == pending(state).map(<[u32]>::len)
    }

    /// Approximate heap size in bytes, for the cache's budget. Entries are counted at a flat
    /// size each (their keys are ids and short terms; shadowed entries of older layers count
    /// too, and layers shared with an older copy of the memory are counted in each), kept
    /// terms at their length.
    pub fn estimated_bytes(&self) -> usize {
        let keyed_by_text = self.session_ids.stored() + self.fact_keys.stored();
        let episode_terms = self.episode_terms.stored();
        let keyed_by_id =
            self.facts_by_turn.stored() + self.signatures.stored() + self.fact_membership.stored();
        let in_sets = self.collided.len()
            + self.stale_episodes.len()
            + self.working_facts.len()
            + self.working_summaries.len()
            + self.hard_constraints.len()
            + self.core_facts.get().map_or(0, |order| order.facts.len());
        let kept: usize = self
            .item_terms
            .values()
            .map(|kept| KEPT_TERMS_ENTRY + kept.hashes.len() * 8 + kept.source.text_bytes())
            .sum();
        (keyed_by_text + episode_terms) * TEXT_KEYED_ENTRY
            + self.turn_ids.stored() * HASH_KEYED_ENTRY
            + keyed_by_id * ID_KEYED_ENTRY
            + in_sets * 16
            + kept
    }

    /// Whether terms are kept for `item` (see [`MemoryState::item_terms`]).
    pub fn keeps_terms_of(&self, item: ItemRef) -> bool {
        self.item_terms.contains_key(&item)
    }

    /// Turn summaries in NEW or CURRENT, ascending.
    pub fn working_summaries(&self) -> &BTreeSet<TurnSeq> {
        &self.working_summaries
    }

    /// Applies the changes `state` recorded since the last call (or builds everything).
    fn catch_up(&mut self, state: &MemoryState) {
        let pending = pending(state);
        if !self.built {
            *self = Lookups {
                built: true,
                ..Lookups::default()
            };
            for seq in 0..state.raw_turns.len() {
                self.raw_turn(state, seq);
            }
            for id in 0..state.facts.len() {
                self.fact(state, id);
            }
            for seq in 0..state.turn_log.len() {
                self.summary(state, seq);
            }
            for id in 0..state.episodes.len() {
                self.episode(state, id);
            }
            for at in 0..state.sessions.len() {
                self.session_id(state, at);
            }
            // What the stored manifests list stands until their facts change.
            self.stale_episodes.clear();
        } else {
            let unseen = |kind: usize, list: &[u32]| -> Vec<usize> {
                list.get(self.seen[kind]..)
                    .unwrap_or(list)
                    .iter()
                    .map(|at| *at as usize)
                    .collect()
            };
            let (raw, facts, summaries, episodes, sessions) = (
                unseen(0, pending[0]),
                unseen(1, pending[1]),
                unseen(2, pending[2]),
                unseen(3, pending[3]),
                unseen(4, pending[4]),
            );
            sessions
                .into_iter()
                .for_each(|at| self.session_id(state, at));
            raw.into_iter().for_each(|seq| self.raw_turn(state, seq));
            facts.into_iter().for_each(|id| self.fact(state, id));
            summaries
                .into_iter()
                .for_each(|seq| self.summary(state, seq));
            episodes.into_iter().for_each(|id| self.episode(state, id));
        }
        self.seen = pending.map(<[u32]>::len);
        self.core_facts = OnceLock::new();
    }

    fn session_id(&mut self, state: &MemoryState, at: usize) {
        if let Some(session) = state.sessions.get(at) {
            self.session_ids
                .insert(session.id.clone(), u32::try_from(at).unwrap_or(u32::MAX));
        }
    }

    fn raw_turn(&mut self, state: &MemoryState, seq: usize) {
        // A summary kept as a span of its raw turn reads that turn's text.
        self.item_terms.remove(&ItemRef::Summary(
            TurnSeq::try_from(seq).unwrap_or(TurnSeq::MAX),
        ));
        if let Some(turn) = state.raw_turns.get(seq) {
            self.turn_ids.insert(
                turn_id_hash(&turn.id),
                TurnSeq::try_from(seq).unwrap_or(TurnSeq::MAX),
            );
        }
    }

    fn fact(&mut self, state: &MemoryState, id: usize) {
        let Some(fact) = state.facts.get(id) else {
            return;
        };
        add_to(&mut self.fact_keys, normalise(&fact.key), fact.id);
        for seq in &fact.provenance {
            add_to(&mut self.facts_by_turn, *seq, fact.id);
        }
        if fact.active
            && let Some(signature) = signature(fact)
        {
            let hash = signature_hash(&signature);
            if add_to(&mut self.signatures, hash, fact.id) {
                self.collided.insert(hash);
            }
        }
        let membership = (fact.active, fact.provenance.clone());
        let before = self.fact_membership.get(&fact.id);
        if before != Some(&membership) {
            let episode_of = |seq: &TurnSeq| {
                state
                    .turn_log
                    .get(*seq as usize)
                    .and_then(|entry| entry.episode)
            };
            if let Some((_, turns)) = before {
                let touched: Vec<EpisodeId> = turns.iter().filter_map(episode_of).collect();
                self.stale_episodes.extend(touched);
            }
            self.stale_episodes
                .extend(membership.1.iter().filter_map(episode_of));
            self.fact_membership.insert(fact.id, membership);
        }
        if in_working_set(fact) {
            self.working_facts.insert(fact.id);
        } else {
            self.working_facts.remove(&fact.id);
        }
        if fact.active && fact.is_hard_constraint() {
            self.hard_constraints.insert(fact.id);
        } else {
            self.hard_constraints.remove(&fact.id);
        }
    }

    fn summary(&mut self, state: &MemoryState, seq: usize) {
        let Some(entry) = state.turn_log.get(seq) else {
            return;
        };
        if summary_in_working_set(entry) {
            self.working_summaries.insert(entry.turn);
        } else {
            self.working_summaries.remove(&entry.turn);
        }
    }

    fn episode(&mut self, state: &MemoryState, id: usize) {
        let Some(episode) = state.episodes.get(id) else {
            return;
        };
        for term in match_terms(episode) {
            add_to(&mut self.episode_terms, term, episode.id);
        }
    }
}

/// A fact of the working set: active, in NEW or CURRENT.
fn in_working_set(fact: &Fact) -> bool {
    fact.active && fact.tier.tier != Tier::Old
}

/// A turn summary of the working set: in NEW or CURRENT.
fn summary_in_working_set(entry: &TurnLogEntry) -> bool {
    entry.tier.tier != Tier::Old
}

impl MemoryState {
    /// The working set (facts, then turn summaries, each ascending) for a reader that holds
    /// the memory shared: from the lookups' lists when they have seen every change (a cached
    /// memory's have), so the cost is the working set's and not the history's; else by a
    /// walk of the memory.
    pub fn working_set(&self) -> Vec<ItemRef> {
        if self.lookups.is_current(self) {
            let facts = self
                .lookups
                .working_facts
                .iter()
                .copied()
                .map(ItemRef::Fact);
            let summaries = self.lookups.working_summaries.iter().copied();
            facts.chain(summaries.map(ItemRef::Summary)).collect()
        } else {
            let facts = self.facts.iter().filter(|fact| in_working_set(fact));
            let summaries = self
                .turn_log
                .iter()
                .filter(|entry| summary_in_working_set(entry));
            facts
                .map(|fact| ItemRef::Fact(fact.id))
                .chain(summaries.map(|entry| ItemRef::Summary(entry.turn)))
                .collect()
        }
    }

    /// Brings [`MemoryState::lookups`] up to every change made so far; call before reading
    /// them.
    pub fn sync_lookups(&mut self) {
        if self.lookups.is_current(self) {
            return;
        }
        let mut lookups = std::mem::take(&mut self.lookups);
        lookups.catch_up(self);
        self.lookups = lookups;
    }

    /// The [`term_hash`]es of the distinct terms ([`crate::text::distinct_terms`]) of a fact's
    /// text, or of a turn summary's two sides joined by a space; `None` for any other item or one that
    /// does not exist. Kept in the lookups while the item's text stays the same (see
    /// `Lookups::item_terms`). Debug builds check a kept list against the text.
    pub fn item_terms(&mut self, item: ItemRef) -> Option<Arc<[u64]>> {
        self.sync_lookups();
        let hashes = |state: &MemoryState| {
            let text = match item {
                ItemRef::Fact(id) => state.fact(id).map(|fact| fact.text()),
                ItemRef::Summary(seq) => state.turn_log.get(seq as usize).map(|_| {
                    let (user, assistant) = state.summary_texts(seq);
                    format!("{user} {assistant}")
                }),
                _ => None,
            }?;
            // Through the per-thread memo: items that left the working set come back to it
            // (an episode the conversation returns to), and their texts were seen before.
            let terms = remembered_terms(&text);
            Some(
                terms
                    .iter()
                    .map(|term| term_hash(term))
                    .collect::<Arc<[u64]>>(),
            )
        };
        if let Some(kept) = self.lookups.item_terms.get(&item)
            && kept.source.holds_for(self, item)
        {
            debug_assert_eq!(
                Some(&kept.hashes),
                hashes(self).as_ref(),
                "{item:?}: kept terms differ from its text's"
            );
            return Some(Arc::clone(&kept.hashes));
        }
        let (source, hashes) = (TextSource::of(self, item)?, hashes(self)?);
        let kept = Arc::new(KeptTerms {
            source,
            hashes: Arc::clone(&hashes),
        });
        let lookups = &mut self.lookups;
        if lookups.item_terms.len() >= KEPT_TERMS {
            let (facts, summaries) = (&lookups.working_facts, &lookups.working_summaries);
            lookups.item_terms.retain(|item, _| match item {
                ItemRef::Fact(id) => facts.contains(id),
                ItemRef::Summary(seq) => summaries.contains(seq),
                _ => false,
            });
        }
        lookups.item_terms.insert(item, kept);
        Some(hashes)
    }

    /// [`Lookups::take_collisions`], with the lookups brought up to date first.
    pub fn take_fact_collisions(&mut self) -> Vec<Vec<FactId>> {
        self.sync_lookups();
        let mut lookups = std::mem::take(&mut self.lookups);
        let groups = lookups.take_collisions(self);
        self.lookups = lookups;
        groups
    }

    /// [`Lookups::take_stale_episodes`], with the lookups brought up to date first.
    pub fn take_stale_episodes(&mut self) -> Vec<EpisodeId> {
        self.sync_lookups();
        let mut lookups = std::mem::take(&mut self.lookups);
        let ids = lookups.take_stale_episodes();
        self.lookups = lookups;
        ids
    }

    /// Positions of the items changed since the last call, per kind, for a store to write; the
    /// lookups take the changes in first.
    pub fn take_changes(&mut self) -> Changes {
        self.sync_lookups();
        self.lookups.seen = [0; 5];
        Changes {
            sessions: self.sessions.take_dirty(),
            raw_turns: self.raw_turns.take_dirty(),
            facts: self.facts.take_dirty(),
            turn_log: self.turn_log.take_dirty(),
            episodes: self.episodes.take_dirty(),
            artifacts: self.artifacts.take_dirty(),
        }
    }
}

/// Items changed since a memory was last stored, by position.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Changes {
    pub sessions: Vec<u32>,
    pub raw_turns: Vec<u32>,
    pub facts: Vec<u32>,
    pub turn_log: Vec<u32>,
    pub episodes: Vec<u32>,
    pub artifacts: Vec<u32>,
}

impl Changes {
    pub fn is_empty(&self) -> bool {
        self.sessions.is_empty()
            && self.raw_turns.is_empty()
            && self.facts.is_empty()
            && self.turn_log.is_empty()
            && self.episodes.is_empty()
            && self.artifacts.is_empty()
    }

    pub fn len(&self) -> usize {
        self.sessions.len()
            + self.raw_turns.len()
            + self.facts.len()
            + self.turn_log.len()
            + self.episodes.len()
            + self.artifacts.len()
    }
}

/// The stems an incoming message must share with the episode for it to be rehydrated.
pub fn match_terms(manifest: &EpisodeManifest) -> TermSet {
    let mut out = TermSet::default();
    for text in manifest
        .salience_tags
        .iter()
        .chain(manifest.rehydration_hints.iter())
    {
        out.extend(terms(text));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::test_support::push_turn;

    /// Past [`KEPT_TERMS`] entries, only the working set's stay.
    #[test]
    fn kept_terms_stay_bounded() {
        let mut state = MemoryState::new();
        let turns = KEPT_TERMS as TurnSeq + 10;
        for seq in 0..turns {
            // The last ten are in the working set (NEW), the others OLD.
            let tier = if seq + 10 >= turns {
                Tier::New
            } else {
                Tier::Old
            };
            let (user, summary) = (format!("question number {seq}"), format!("question {seq}"));
            push_turn(&mut state, &user, &summary, tier);
        }
        for seq in (0..turns).rev() {
            assert!(state.item_terms(ItemRef::Summary(seq)).is_some());
        }
        // The ten working-set summaries came first, so they survived the one purge, and the
        // oldest summary, looked up last, is kept beside them.
        let kept = state.lookups.item_terms.len();
        assert!(kept < KEPT_TERMS, "{kept}");
        for seq in turns - 10..turns {
            assert!(state.lookups.keeps_terms_of(ItemRef::Summary(seq)));
        }
        assert!(state.lookups.keeps_terms_of(ItemRef::Summary(0)));
        assert!(!state.lookups.keeps_terms_of(ItemRef::Summary(turns - 11)));
    }
}
