//! How a user's memory is laid out in a store (both backends), so that applying a turn writes
//! what the turn changed and a request reads what changed since the version it holds, never
//! the whole memory.
//!
//! - The **hot state** ([`Meta`]): versions, identity, pins and the number of items of each
//!   kind. Small, and bounded by what the user set, not by how much they said.
//! - **Items**, one record each, keyed by kind and position ([`ItemKey`]): sessions (with their
//!   recent turns), raw turns, turn-log entries, facts, episode manifests, artifacts. Items are
//!   never removed (ids are positions), so a memory's item set only grows and changes in place.
//! - The **change ring**: for each of the last [`RING`] writes, the version it replaced, the
//!   version it wrote and the items it touched. A reader holding version `v` follows the ring
//!   from `v` to the stored version and reads only those items ([`MemoryUpdate::Delta`]); one
//!   whose version has left the ring reads the whole memory once ([`MemoryUpdate::Whole`]).
//!
//! A memory stored by an earlier release as one value decodes as [`Stored::Legacy`]; the
//! backends convert it to this layout (the embedded store when it opens, Redis on first read).

use std::collections::BTreeSet;

use bytes::Bytes;
use serde::{Deserialize, Serialize};

use engram_memory::MemoryState;
use engram_memory::lookups::Changes;
use engram_memory::model::{Identity, PinnedItem};
use engram_memory::segmented::Segmented;
use engram_runtime::error::{Error, Result};

/// The layout version written into every [`Meta`]; a stored value without it is a legacy state.
pub const LAYOUT: u32 = 2;

/// Writes the change ring remembers.
pub const RING: usize = 64;

/// The hot state: everything of a memory but its items.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Meta {
    pub layout: u32,
    pub version: u64,
    pub facts_version: u64,
    pub episodes_version: u64,
    #[serde(default)]
    pub rewrites: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<Identity>,
    #[serde(default)]
    pub pinned: Vec<PinnedItem>,
    /// Items of each kind, in [`ItemKind::ALL`] order.
    pub counts: [u32; 6],
}

impl Meta {
    pub fn of(state: &MemoryState) -> Meta {
        let count = |len: usize| u32::try_from(len).unwrap_or(u32::MAX);
        Meta {
            layout: LAYOUT,
            version: state.version,
            facts_version: state.facts_version,
            episodes_version: state.episodes_version,
            rewrites: state.rewrites,
            identity: state.identity.clone(),
            pinned: state.pinned.clone(),
            counts: [
                count(state.sessions.len()),
                count(state.raw_turns.len()),
                count(state.turn_log.len()),
                count(state.facts.len()),
                count(state.episodes.len()),
                count(state.artifacts.len()),
            ],
        }
    }

    /// Sets the state's own fields (not its items) to these.
    fn apply_to(self, state: &mut MemoryState) {
        state.version = self.version;
        state.facts_version = self.facts_version;
        state.episodes_version = self.episodes_version;
        state.rewrites = self.rewrites;
        state.identity = self.identity;
        state.pinned = self.pinned;
    }
}

/// A stored state value: this layout's hot state, or an earlier release's whole memory.
#[derive(Debug)]
pub enum Stored {
    Meta(Meta),
    Legacy(Box<MemoryState>),
}

impl Stored {
    pub fn decode(bytes: &[u8]) -> Result<Stored> {
        #[derive(Deserialize)]
        struct Probe {
            #[serde(default)]
            layout: u32,
        }
        let probe: Probe = super::decode(bytes)?;
        if probe.layout >= LAYOUT {
            Ok(Stored::Meta(super::decode(bytes)?))
        } else {
            Ok(Stored::Legacy(Box::new(super::decode(bytes)?)))
        }
    }
}

/// The kinds of item, in the order [`Meta::counts`] lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum ItemKind {
    Session,
    RawTurn,
    TurnLog,
    Fact,
    Episode,
    Artifact,
}

impl ItemKind {
    pub const ALL: [ItemKind; 6] = [
        ItemKind::Session,
        ItemKind::RawTurn,
        ItemKind::TurnLog,
        ItemKind::Fact,
        ItemKind::Episode,
        ItemKind::Artifact,
    ];

    pub fn code(self) -> u8 {
        self as u8
    }

    pub fn from_code(code: u8) -> Option<ItemKind> {
        ItemKind::ALL.get(code as usize).copied()
    }

    fn letter(self) -> char {
        ['s', 'r', 'l', 'f', 'e', 'a'][self as usize]
    }
}

/// Where an item is stored: its kind and position.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ItemKey {
    pub kind: ItemKind,
    pub pos: u32,
}

impl ItemKey {
    /// The item's name in a Redis hash and in the change ring: a letter and the position.
    pub fn field(self) -> String {
        format!("{}{}", self.kind.letter(), self.pos)
    }

    pub fn parse(field: &str) -> Option<ItemKey> {
        let mut chars = field.chars();
        let letter = chars.next()?;
        let kind = ItemKind::ALL
            .into_iter()
            .find(|kind| kind.letter() == letter)?;
        Some(ItemKey {
            kind,
            pos: chars.as_str().parse().ok()?,
        })
    }
}

/// A memory ready to write: its hot state and the items to write with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EncodedState {
    pub version: u64,
    /// The [`Meta`] as JSON.
    pub meta: Bytes,
    /// Items as JSON, each with its key, ascending.
    pub items: Vec<(ItemKey, Bytes)>,
}

impl EncodedState {
    /// The whole memory: every item (a new memory, a conversion, a management edit's
    /// fallback).
    pub fn of(state: &MemoryState) -> Result<EncodedState> {
        let all = |len: usize| (0..u32::try_from(len).unwrap_or(u32::MAX)).collect::<Vec<u32>>();
        let changes = Changes {
            sessions: all(state.sessions.len()),
            raw_turns: all(state.raw_turns.len()),
            turn_log: all(state.turn_log.len()),
            facts: all(state.facts.len()),
            episodes: all(state.episodes.len()),
            artifacts: all(state.artifacts.len()),
        };
        EncodedState::changes(state, &changes)
    }

    /// The items `changes` names (positions since the memory was last stored), with the hot
    /// state.
    pub fn changes(state: &MemoryState, changes: &Changes) -> Result<EncodedState> {
        let mut items = Vec::with_capacity(changes.len());
        encode_items(
            &mut items,
            ItemKind::Session,
            &state.sessions,
            &changes.sessions,
        )?;
        encode_items(
            &mut items,
            ItemKind::RawTurn,
            &state.raw_turns,
            &changes.raw_turns,
        )?;
        encode_items(
            &mut items,
            ItemKind::TurnLog,
            &state.turn_log,
            &changes.turn_log,
        )?;
        encode_items(&mut items, ItemKind::Fact, &state.facts, &changes.facts)?;
        encode_items(
            &mut items,
            ItemKind::Episode,
            &state.episodes,
            &changes.episodes,
        )?;
        encode_items(
            &mut items,
            ItemKind::Artifact,
            &state.artifacts,
            &changes.artifacts,
        )?;
        Ok(EncodedState {
            version: state.version,
            meta: encode(&Meta::of(state))?.into(),
            items,
        })
    }

    /// Bytes this write carries.
    pub fn size(&self) -> usize {
        self.meta.len() + self.items.iter().map(|(_, json)| json.len()).sum::<usize>()
    }

    /// A hash of this write over `previous` (versions, hot state, items), which tells it from
    /// another process's write of the same version from the same one (different turns
    /// applied); an equal hash is the same memory.
    pub fn fingerprint(&self, previous: u64) -> u64 {
        use std::hash::{Hash, Hasher};
        let mut hasher = std::collections::hash_map::DefaultHasher::new();
        (previous, self.version).hash(&mut hasher);
        self.meta.as_ref().hash(&mut hasher);
        for (key, json) in &self.items {
            key.hash(&mut hasher);
            json.as_ref().hash(&mut hasher);
        }
        hasher.finish()
    }

    /// The change-ring entry of this write over `previous`.
    pub fn change(&self, previous: u64) -> Change {
        Change {
            previous,
            version: self.version,
            items: self.items.iter().map(|(key, _)| *key).collect(),
        }
    }
}

fn encode_items<T: Serialize + Clone>(
    out: &mut Vec<(ItemKey, Bytes)>,
    kind: ItemKind,
    items: &Segmented<T>,
    positions: &[u32],
) -> Result<()> {
    for pos in positions {
        if let Some(item) = items.get(*pos as usize) {
            out.push((ItemKey { kind, pos: *pos }, encode(item)?.into()));
        }
    }
    Ok(())
}

fn encode<T: Serialize + ?Sized>(value: &T) -> Result<Vec<u8>> {
    serde_json::to_vec(value).map_err(|error| Error::Store(format!("encode: {error}")))
}

/// One entry of the change ring: a write from `previous` to `version` touched `items`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Change {
    pub previous: u64,
    pub version: u64,
    pub items: Vec<ItemKey>,
}

impl Change {
    /// `previous version field,field,…`: the form both backends store.
    pub fn encode(&self) -> String {
        let fields: Vec<String> = self.items.iter().map(|key| key.field()).collect();
        format!("{} {} {}", self.previous, self.version, fields.join(","))
    }

    pub fn decode(text: &str) -> Option<Change> {
        let mut parts = text.splitn(3, ' ');
        let previous = parts.next()?.parse().ok()?;
        let version = parts.next()?.parse().ok()?;
        let items = parts
            .next()
            .unwrap_or("")
            .split(',')
            .filter(|field| !field.is_empty())
            .map(ItemKey::parse)
            .collect::<Option<Vec<ItemKey>>>()?;
        Some(Change {
            previous,
            version,
            items,
        })
    }
}

/// The items changed between `cached` and `current` by following the ring (oldest entry first);
/// `None` when the ring does not lead from one to the other (the reader must read everything).
pub fn changed_between(ring: &[Change], cached: u64, current: u64) -> Option<BTreeSet<ItemKey>> {
    let start = ring.iter().position(|change| change.previous == cached)?;
    let mut at = cached;
    let mut items = BTreeSet::new();
    for change in &ring[start..] {
        if change.previous != at {
            return None;
        }
        items.extend(change.items.iter().copied());
        at = change.version;
        if at == current {
            return Some(items);
        }
    }
    None
}

/// What a reader holding an older version (or none) gets.
#[derive(Debug)]
pub enum MemoryUpdate {
    /// The whole memory (no cached version, or one the ring no longer reaches).
    Whole(Box<MemoryState>),
    /// The hot state and the items changed since the reader's version.
    Delta(Delta),
}

#[derive(Debug)]
pub struct Delta {
    pub meta: Meta,
    pub items: Vec<(ItemKey, Vec<u8>)>,
}

impl Delta {
    /// `base` (the reader's version) with the delta applied: the changed items are set through
    /// the state's change record, so an index refreshed from the result sees them (and they
    /// must be taken before the state is written back).
    pub fn apply(mut self, base: &MemoryState) -> Result<MemoryState> {
        let mut state = base.clone();
        // In position order, so appended items land in turn (a backend may list them in
        // another order: Redis sorts fields as text, `r10` before `r9`).
        self.items.sort_by_key(|(key, _)| *key);
        for (key, json) in self.items {
            if !place(&mut state, key, &json, Note::Changed)? {
                return Err(missing_before(key));
            }
        }
        let counts = self.meta.counts;
        self.meta.apply_to(&mut state);
        check_counts(&state, counts)?;
        Ok(state)
    }
}

/// Whether a placed item is recorded as changed (a delta: the index and lookups must see it)
/// or not (a memory read whole: nothing to refresh or write back).
#[derive(Clone, Copy, PartialEq, Eq)]
enum Note {
    Changed,
    Clean,
}

/// Sets the item at `key` (or appends it at the end of its kind); false when its position is
/// past the end.
fn place(state: &mut MemoryState, key: ItemKey, json: &[u8], note: Note) -> Result<bool> {
    match key.kind {
        ItemKind::Session => place_in(&mut state.sessions, key.pos, json, note),
        ItemKind::RawTurn => place_in(&mut state.raw_turns, key.pos, json, note),
        ItemKind::TurnLog => place_in(&mut state.turn_log, key.pos, json, note),
        ItemKind::Fact => place_in(&mut state.facts, key.pos, json, note),
        ItemKind::Episode => place_in(&mut state.episodes, key.pos, json, note),
        ItemKind::Artifact => place_in(&mut state.artifacts, key.pos, json, note),
    }
}

fn place_in<T: Clone + for<'de> Deserialize<'de>>(
    items: &mut Segmented<T>,
    pos: u32,
    json: &[u8],
    note: Note,
) -> Result<bool> {
    let item: T = super::decode(json)?;
    let pos = pos as usize;
    if note == Note::Clean {
        return Ok(items.put_clean(pos, item));
    }
    if pos == items.len() {
        items.push(item);
        Ok(true)
    } else if let Some(slot) = items.get_mut(pos) {
        *slot = item;
        Ok(true)
    } else {
        Ok(false)
    }
}

fn missing_before(key: ItemKey) -> Error {
    Error::Store(format!(
        "stored memory is missing items before {}",
        key.field()
    ))
}

/// A whole memory from its hot state and every item, in any order.
pub fn assemble<'a>(
    meta: Meta,
    items: impl IntoIterator<Item = (ItemKey, &'a [u8])>,
) -> Result<MemoryState> {
    let mut sorted: Vec<(ItemKey, &[u8])> = items.into_iter().collect();
    sorted.sort_by_key(|(key, _)| *key);
    let mut assembly = Assembly::new();
    for (key, json) in sorted {
        assembly.place(key, json)?;
    }
    assembly.finish(meta)
}

/// A whole memory built item by item in key order, as an ordered scan of the stored items
/// yields them: each item is decoded as it is read, so no copy of a long memory's stored bytes
/// (tens of MB) is held beside the memory it becomes.
pub struct Assembly {
    state: MemoryState,
}

impl Assembly {
    pub fn new() -> Assembly {
        Assembly {
            state: MemoryState::new(),
        }
    }

    /// The next item, in key order; an error if one before it is missing.
    pub fn place(&mut self, key: ItemKey, json: &[u8]) -> Result<()> {
        if place(&mut self.state, key, json, Note::Clean)? {
            Ok(())
        } else {
            Err(missing_before(key))
        }
    }

    /// The memory, with its hot state; an error if it does not hold the items `meta` counts.
    pub fn finish(self, meta: Meta) -> Result<MemoryState> {
        let mut state = self.state;
        let counts = meta.counts;
        meta.apply_to(&mut state);
        check_counts(&state, counts)?;
        Ok(state)
    }
}

impl Default for Assembly {
    fn default() -> Assembly {
        Assembly::new()
    }
}

fn check_counts(state: &MemoryState, counts: [u32; 6]) -> Result<()> {
    let found = [
        state.sessions.len(),
        state.raw_turns.len(),
        state.turn_log.len(),
        state.facts.len(),
        state.episodes.len(),
        state.artifacts.len(),
    ];
    for ((kind, expected), found) in ItemKind::ALL.iter().zip(counts).zip(found) {
        if found != expected as usize {
            return Err(Error::Store(format!(
                "stored memory has {found} {kind:?} items where its hot state says {expected}"
            )));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use engram_memory::{ExchangeInput, HeuristicExtractor, MemoryConfig, record_exchange};

    /// The ring after a write: its newest `RING` changes, as the backends keep it.
    fn push_change(ring: &mut Vec<Change>, change: Change) {
        ring.push(change);
        if ring.len() > RING {
            let extra = ring.len() - RING;
            ring.drain(..extra);
        }
    }

    fn recorded(turns: usize) -> MemoryState {
        let mut state = MemoryState::new();
        for n in 0..turns {
            record_exchange(
                &mut state,
                &ExchangeInput {
                    session_id: format!("s{}", n % 3),
                    turn_id: format!("t{n}"),
                    user_text: format!("My sister Rita visits on day {n}. I live in Porto."),
                    assistant_text: "Noted.".into(),
                    ..ExchangeInput::default()
                },
                &HeuristicExtractor,
                &MemoryConfig::default(),
            );
        }
        state
    }

    fn items(encoded: &EncodedState) -> Vec<(ItemKey, &[u8])> {
        encoded
            .items
            .iter()
            .map(|(key, json)| (*key, json.as_ref()))
            .collect()
    }

    /// A memory of `turns` turns, as stored: its hot state and its items.
    fn stored(turns: usize) -> (MemoryState, EncodedState, Meta) {
        let state = recorded(turns);
        let encoded = EncodedState::of(&state).unwrap();
        let Stored::Meta(meta) = Stored::decode(&encoded.meta).unwrap() else {
            panic!("not this layout");
        };
        (state, encoded, meta)
    }

    #[test]
    fn a_memory_reassembles_from_its_hot_state_and_items() {
        let (state, encoded, meta) = stored(40);
        let back = assemble(meta, items(&encoded)).unwrap();
        assert_eq!(back, state);
        assert!(!back.raw_turns.has_changes());
    }

    /// Items placed one by one in key order (an ordered scan) give the memory `assemble`
    /// gives; an item whose predecessor never came is refused, not placed at the wrong spot.
    #[test]
    fn an_assembly_in_key_order_is_the_whole_memory_and_refuses_a_gap() {
        let (state, encoded, meta) = stored(40);
        let mut sorted = items(&encoded);
        sorted.sort_by_key(|(key, _)| *key);
        let mut assembly = Assembly::new();
        for (key, json) in &sorted {
            assembly.place(*key, json).unwrap();
        }
        assert_eq!(assembly.finish(meta).unwrap(), state);

        let mut gap = Assembly::new();
        let raw: Vec<&(ItemKey, &[u8])> = sorted
            .iter()
            .filter(|(key, _)| key.kind == ItemKind::RawTurn)
            .collect();
        gap.place(raw[0].0, raw[0].1).unwrap();
        assert!(gap.place(raw[2].0, raw[2].1).is_err());
    }

    #[test]
    fn a_turn_writes_only_what_it_changed_and_a_delta_brings_a_reader_up_to_date() {
        let mut state = recorded(200);
        state.take_changes();
        let base = state.clone();
        let before = state.version;
        let mut ring = Vec::new();
        let mut next = state.clone();
        for n in 200..203 {
            let previous = next.version;
            record_exchange(
                &mut next,
                &ExchangeInput {
                    session_id: "s0".into(),
                    turn_id: format!("t{n}"),
                    user_text: "Actually I moved to Lisbon.".into(),
                    assistant_text: "Got it.".into(),
                    ..ExchangeInput::default()
                },
                &HeuristicExtractor,
                &MemoryConfig::default(),
            );
            let changes = next.take_changes();
            let encoded = EncodedState::changes(&next, &changes).unwrap();
            // A turn's write is a few items, not the memory (hundreds here): its own, and the
            // summaries in CURRENT that depend on the fact it changed (about 36: CURRENT holds
            // 1,024 tokens of them, so the count moves with the length of a summary's line).
            assert!(encoded.items.len() < 50, "{}", encoded.items.len());
            assert!(encoded.size() < EncodedState::of(&next).unwrap().size() / 5);
            push_change(&mut ring, encoded.change(previous));
        }
        let wanted = changed_between(&ring, before, next.version).unwrap();
        let whole = EncodedState::of(&next).unwrap();
        let delta = Delta {
            meta: Meta::of(&next),
            items: whole
                .items
                .iter()
                .filter(|(key, _)| wanted.contains(key))
                .map(|(key, json)| (*key, json.to_vec()))
                // Out of order, as a backend may list them.
                .rev()
                .collect(),
        };
        let mut updated = delta.apply(&base).unwrap();
        assert!(updated.raw_turns.has_changes());
        updated.take_changes();
        assert_eq!(updated, next);
        // A version the ring does not lead from reads everything.
        assert_eq!(changed_between(&ring, 12345, next.version), None);
    }

    #[test]
    fn the_ring_keeps_its_latest_entries_and_decodes_what_it_stores() {
        let mut ring = Vec::new();
        for version in 1..=(RING as u64 + 10) {
            let change = Change {
                previous: version - 1,
                version,
                items: vec![
                    ItemKey {
                        kind: ItemKind::Fact,
                        pos: version as u32,
                    },
                    ItemKey {
                        kind: ItemKind::RawTurn,
                        pos: 7,
                    },
                ],
            };
            push_change(&mut ring, change);
        }
        assert_eq!(ring.len(), RING);
        assert_eq!(ring[0].previous, 10);
        for change in &ring {
            assert_eq!(Change::decode(&change.encode()).as_ref(), Some(change));
        }
        assert!(changed_between(&ring, 9, RING as u64 + 10).is_none());
        // Facts 71 and 72, and raw turn 7 once though both writes touched it.
        assert_eq!(
            changed_between(&ring, 70, 72).map(|items| items.len()),
            Some(3)
        );
        assert_eq!(
            ItemKey::parse("e42").map(|key| key.kind),
            Some(ItemKind::Episode)
        );
        assert_eq!(ItemKey::parse("x1"), None);
    }

    #[test]
    fn an_earlier_release_state_decodes_as_legacy() {
        let state = recorded(3);
        let legacy = serde_json::to_vec(&state).unwrap();
        assert!(matches!(
            Stored::decode(&legacy).unwrap(),
            Stored::Legacy(_)
        ));
    }
}
