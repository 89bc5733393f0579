//! The management API's view of one user's memory: item ids, the item view, listing and
//! lexical search, and edits and deletions with their cascade through provenance. Pure, like
//! the rest of the engine; the admin layer loads, calls and saves.
//!
//! Items are identity, pinned items, facts, turn summaries, episode manifests, artifacts and
//! raw turns, named `kind:id` (`fact:3`, `raw_turn:12`; the identity is `identity`).
//!
//! - Pins: a pin of a fact shows the fact's current revision (the fact it was merged into,
//!   after a merge), in listings, search and the prompt alike; nothing while the fact is
//!   removed. It keeps no text of its own.
//! - Edits: the identity, a pinned item and a fact. A fact edit is a new revision: the old value
//!   moves to the fact's history, ended by `edited` (with the old key if the key changed), and
//!   the new value has no provenance turns (no turn said it). Editing a pin of a fact edits the
//!   fact it shows. Summaries, episodes and artifacts are derived from the raw log and are
//!   deleted, not edited.
//! - Deletions erase the text and keep the slot (ids are positions and must keep resolving),
//!   then cascade to what was derived only from the deleted item: a fact takes the facts merged
//!   into it and the pins projecting it; a summary leaves its episode (an episode left without
//!   turns goes too). The raw log is the immutable ground truth (DESIGN.md §2): its turns are
//!   not deleted one by one; forgetting the user erases it.

use std::collections::{BTreeSet, HashSet};

use serde::Serialize;

use super::diff::split_key_value;
use super::fence::memory_text;
use super::index::{Bm25, MemoryIndex, SegmentKind};
use super::model::{
    ArtifactId, ArtifactKind, EpisodeId, FactCategory, FactId, FactRevision, ItemRef, MemoryState,
    PinContent, PinId, RevisionEnd, SummaryText, Tier, TurnSeq,
};
use super::record::set_identity;
use super::render::{recount_fact, recount_pinned};
use super::retrieve::exists;
use super::text::{normalise, one_line, terms};
use super::tiers::refresh_episode;
use super::tokens::{Encoding, TokenCount};

/// The item kinds, as named in item ids and the `kind` filter.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ItemKind {
    Identity,
    Pinned,
    Fact,
    Summary,
    Episode,
    Artifact,
    RawTurn,
}

impl ItemKind {
    pub const ALL: [ItemKind; 7] = [
        ItemKind::Identity,
        ItemKind::Pinned,
        ItemKind::Fact,
        ItemKind::Summary,
        ItemKind::Episode,
        ItemKind::Artifact,
        ItemKind::RawTurn,
    ];

    pub fn name(self) -> &'static str {
        match self {
            ItemKind::Identity => "identity",
            ItemKind::Pinned => "pinned",
            ItemKind::Fact => "fact",
            ItemKind::Summary => "summary",
            ItemKind::Episode => "episode",
            ItemKind::Artifact => "artifact",
            ItemKind::RawTurn => "raw_turn",
        }
    }

    pub fn parse(name: &str) -> Option<ItemKind> {
        ItemKind::ALL.into_iter().find(|kind| kind.name() == name)
    }

    pub fn of(item: ItemRef) -> ItemKind {
        match item {
            ItemRef::Identity => ItemKind::Identity,
            ItemRef::Pinned(_) => ItemKind::Pinned,
            ItemRef::Fact(_) => ItemKind::Fact,
            ItemRef::Summary(_) => ItemKind::Summary,
            ItemRef::Episode(_) => ItemKind::Episode,
            ItemRef::Artifact(_) => ItemKind::Artifact,
            ItemRef::RawTurn(_) => ItemKind::RawTurn,
        }
    }
}

/// `fact:3`, `identity`.
pub fn item_id(item: ItemRef) -> String {
    let kind = ItemKind::of(item).name();
    match item {
        ItemRef::Identity => kind.to_owned(),
        ItemRef::Pinned(id)
        | ItemRef::Fact(id)
        | ItemRef::Summary(id)
        | ItemRef::Episode(id)
        | ItemRef::Artifact(id)
        | ItemRef::RawTurn(id) => format!("{kind}:{id}"),
    }
}

/// The inverse of [`item_id`]; `None` for anything else.
pub fn parse_item_id(text: &str) -> Option<ItemRef> {
    if text == "identity" {
        return Some(ItemRef::Identity);
    }
    let (kind, id) = text.split_once(':')?;
    if id.is_empty() || !id.bytes().all(|byte| byte.is_ascii_digit()) {
        return None;
    }
    let id: u32 = id.parse().ok()?;
    Some(match ItemKind::parse(kind)? {
        ItemKind::Identity => return None,
        ItemKind::Pinned => ItemRef::Pinned(id),
        ItemKind::Fact => ItemRef::Fact(id),
        ItemKind::Summary => ItemRef::Summary(id),
        ItemKind::Episode => ItemRef::Episode(id),
        ItemKind::Artifact => ItemRef::Artifact(id),
        ItemKind::RawTurn => ItemRef::RawTurn(id),
    })
}

/// A raw turn an item comes from: its position and the id the proxy gave the exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SourceTurn {
    pub seq: TurnSeq,
    pub turn_id: String,
}

/// One item as the management API shows it. Memory time is counted in turns (the engine has
/// no clock); dates come from the turns' event times.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ItemView {
    pub id: String,
    pub kind: ItemKind,
    /// NEW, CURRENT or OLD; none for the identity, pins and artifacts (outside the tiers). A
    /// raw turn shows its summary's tier.
    pub tier: Option<Tier>,
    pub text: String,
    /// Tokens of the item as injected, in the o200k encoding.
    pub tokens: u32,
    /// Pinned items, and items an active pin projects.
    pub pinned: bool,
    /// The raw turns the item comes from (a pin: its source's).
    pub provenance: Vec<SourceTurn>,
    /// A pin's source item.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub source: Option<String>,
    /// Display date of the turn the item comes from (an episode: its last turn).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_turn: Option<TurnSeq>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_touched_turn: Option<TurnSeq>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency: Option<u32>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fact: Option<FactDetails>,
    /// A raw turn's session id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub session: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifact_kind: Option<ArtifactKind>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FactDetails {
    pub category: FactCategory,
    /// Rounded to three decimals (stored as `f32`).
    pub importance: f64,
    pub version: u32,
    /// Earlier values kept in the fact's history.
    pub revisions: usize,
    /// The current value was set by a management edit.
    pub edited: bool,
}

/// Which items a listing keeps.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ItemFilter {
    pub kind: Option<ItemKind>,
    pub tier: Option<Tier>,
}

impl ItemFilter {
    pub fn keeps(&self, view: &ItemView) -> bool {
        self.kind.is_none_or(|kind| kind == view.kind)
            && self.tier.is_none_or(|tier| view.tier == Some(tier))
    }
}

/// Every item in memory (not retired, unpinned or deleted), by kind then id.
pub fn list(state: &MemoryState, filter: ItemFilter) -> Vec<ItemView> {
    all_items(state)
        .into_iter()
        .filter_map(|item| view(state, item))
        .filter(|view| filter.keeps(view))
        .collect()
}

fn all_items(state: &MemoryState) -> Vec<ItemRef> {
    let ids = |len: usize| (0..len).filter_map(|at| u32::try_from(at).ok());
    let mut items = vec![ItemRef::Identity];
    items.extend(ids(state.pinned.len()).map(ItemRef::Pinned));
    items.extend(ids(state.facts.len()).map(ItemRef::Fact));
    items.extend(ids(state.turn_log.len()).map(ItemRef::Summary));
    items.extend(ids(state.episodes.len()).map(ItemRef::Episode));
    items.extend(ids(state.artifacts.len()).map(ItemRef::Artifact));
    items.extend(ids(state.raw_turns.len()).map(ItemRef::RawTurn));
    items
}

/// Ranks the items for `query` with the retrieval index's BM25 (the same stemmed terms and
/// per-segment normalisation as recall, so scores are about `0..1`); the identity and pins,
/// which the index does not hold, score the share of the query's terms they contain. Best
/// first, ties by item.
pub fn search(
    state: &MemoryState,
    index: &MemoryIndex,
    query: &str,
    bm25: Bm25,
) -> Vec<(ItemRef, f32)> {
    let (query_ids, _) = index.query_terms(query);
    let mut hits: Vec<(ItemRef, f32)> = Vec::new();
    for (kind, wrap) in [
        (SegmentKind::Fact, ItemRef::Fact as fn(u32) -> ItemRef),
        (SegmentKind::Summary, ItemRef::Summary),
        (SegmentKind::Episode, ItemRef::Episode),
        (SegmentKind::Artifact, ItemRef::Artifact),
        (SegmentKind::Raw, ItemRef::RawTurn),
    ] {
        let segment = index.segment(kind);
        for (key, score) in segment.search(&query_ids, bm25, segment.len()) {
            let item = wrap(key);
            if exists(state, item) {
                hits.push((item, score));
            }
        }
    }
    let query_terms: BTreeSet<String> = terms(query).collect();
    let share = |text: &str| {
        let found: HashSet<String> = terms(text).collect();
        let shared = query_terms
            .iter()
            .filter(|term| found.contains(*term))
            .count();
        shared as f32 / query_terms.len().max(1) as f32
    };
    if let Some(identity) = &state.identity {
        hits.push((ItemRef::Identity, share(&identity.text)));
    }
    for pin in state.pinned.iter().filter(|pin| pin.active) {
        hits.push((
            ItemRef::Pinned(pin.id),
            share(&state.pin_content(pin).text()),
        ));
    }
    hits.retain(|(_, score)| *score > 0.0);
    hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    hits
}

/// The view of one item in memory; `None` when there is no such item (or it was retired,
/// unpinned or deleted).
pub fn view(state: &MemoryState, item: ItemRef) -> Option<ItemView> {
    if !exists(state, item) {
        return None;
    }
    let turns = |seqs: &[TurnSeq]| -> Vec<SourceTurn> {
        seqs.iter()
            .filter_map(|seq| {
                state.turn_id(*seq).map(|id| SourceTurn {
                    seq: *seq,
                    turn_id: id.to_owned(),
                })
            })
            .collect()
    };
    let pinned = state.pinned.iter().any(|pin| {
        pin.active
            && matches!(state.pin_content(pin), PinContent::Fact(fact) if item == ItemRef::Fact(fact.id))
    });
    let mut view = ItemView {
        id: item_id(item),
        kind: ItemKind::of(item),
        tier: None,
        text: String::new(),
        tokens: 0,
        pinned,
        provenance: Vec::new(),
        source: None,
        date: None,
        since_turn: None,
        last_touched_turn: None,
        frequency: None,
        fact: None,
        session: None,
        artifact_kind: None,
        language: None,
    };
    let o200k = |count: TokenCount| count.get(Encoding::O200k);
    match item {
        ItemRef::Identity => {
            let identity = state.identity.as_ref()?;
            view.text.clone_from(&identity.text);
            view.tokens = o200k(identity.tokens);
        }
        ItemRef::Pinned(id) => {
            let pin = state.pinned.get(id as usize)?;
            let content = state.pin_content(pin);
            view.text = content.text().into_owned();
            view.tokens = o200k(content.tokens());
            view.pinned = true;
            // The fact the pin shows now (after a merge, the one it was merged into).
            let source = match content {
                PinContent::Fact(fact) => Some(ItemRef::Fact(fact.id)),
                _ => pin.source,
            };
            view.source = source.map(item_id);
            if let Some(source) = source.and_then(|source| self::view(state, source)) {
                view.provenance = source.provenance;
                view.date = source.date;
            }
        }
        ItemRef::Fact(id) => {
            let fact = state.fact(id)?;
            view.text = fact.text();
            view.tokens = o200k(fact.tokens);
            view.tier = Some(fact.tier.tier);
            view.provenance = turns(&fact.provenance);
            view.date.clone_from(&fact.date);
            view.since_turn = Some(fact.tier.since_turn);
            view.last_touched_turn = Some(fact.tier.last_touched_turn);
            view.frequency = Some(fact.tier.frequency);
            view.fact = Some(FactDetails {
                category: fact.category,
                importance: (f64::from(fact.importance) * 1000.0).round() / 1000.0,
                version: fact.version,
                revisions: fact.history.len(),
                edited: fact
                    .history
                    .last()
                    .is_some_and(|revision| revision.ended_by == RevisionEnd::Edited),
            });
        }
        ItemRef::Summary(seq) => {
            let entry = state.turn_log.get(seq as usize)?;
            let (user, assistant) = entry.texts(state.raw_turns.get(seq as usize));
            view.text = format!(
                "user: {} | assistant: {}",
                one_line(&user),
                one_line(&assistant)
            );
            view.tokens = o200k(entry.tokens);
            view.tier = Some(entry.tier.tier);
            view.provenance = turns(&[seq]);
            view.date = state.turn_date(seq);
            view.since_turn = Some(entry.tier.since_turn);
            view.last_touched_turn = Some(entry.tier.last_touched_turn);
            view.frequency = Some(entry.tier.frequency);
        }
        ItemRef::Episode(id) => {
            let episode = state.episodes.get(id as usize)?;
            view.text = format!("{}: {}", episode.topic, episode.summary);
            view.tokens = o200k(episode.tokens);
            view.tier = Some(Tier::Old);
            view.provenance = turns(&episode.links);
            view.date.clone_from(&episode.date_range.1);
        }
        ItemRef::Artifact(id) => {
            let artifact = state.artifacts.get(id as usize)?;
            view.text = state.artifact_content(artifact).to_owned();
            view.tokens = o200k(artifact.tokens);
            view.provenance = turns(&[artifact.turn]);
            view.date = state.turn_date(artifact.turn);
            view.artifact_kind = Some(artifact.kind);
            view.language.clone_from(&artifact.language);
        }
        ItemRef::RawTurn(seq) => {
            let turn = state.raw_turns.get(seq as usize)?;
            view.text = if turn.assistant.is_empty() {
                format!("user: {}", one_line(&turn.user))
            } else {
                format!(
                    "user: {} | assistant: {}",
                    one_line(&turn.user),
                    one_line(&turn.assistant)
                )
            };
            view.tokens = o200k(turn.tokens.line);
            view.provenance = turns(&[seq]);
            view.date = state.turn_date(seq);
            view.session = state
                .sessions
                .get(turn.session as usize)
                .map(|session| session.id.clone());
            if let Some(entry) = state.turn_log.get(seq as usize) {
                view.tier = Some(entry.tier.tier);
                view.since_turn = Some(entry.tier.since_turn);
                view.last_touched_turn = Some(entry.tier.last_touched_turn);
                view.frequency = Some(entry.tier.frequency);
            }
        }
    }
    Some(view)
}

/// Why an edit or a deletion was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ManageError {
    /// No such item in memory.
    NotFound,
    /// This kind of item is not edited (summaries, episodes, artifacts, raw turns).
    NotEditable(ItemKind),
    /// Raw turns are not deleted one by one.
    Immutable,
    EmptyText,
    /// Another active fact already holds the edited key.
    KeyTaken(FactId),
    /// The pin shows a fact the conversation removed, so there is nothing to edit.
    PinnedFactRemoved(FactId),
}

impl std::fmt::Display for ManageError {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ManageError::NotFound => formatter.write_str("no such item in this user's memory"),
            ManageError::NotEditable(kind) => write!(
                formatter,
                "{} items are derived from the raw log and are not edited (delete them \
                 instead); the identity, pinned items and facts are",
                kind.name()
            ),
            ManageError::Immutable => formatter.write_str(
                "the raw log is immutable ground truth and its turns are not deleted one by \
                 one; forget the user to erase it",
            ),
            ManageError::EmptyText => formatter.write_str("`text` must not be empty"),
            ManageError::KeyTaken(other) => write!(
                formatter,
                "fact {other} already holds that key; edit or delete that fact instead"
            ),
            ManageError::PinnedFactRemoved(fact) => write!(
                formatter,
                "the pin shows fact {fact}, which the conversation removed, so it shows nothing \
                 until the fact is stated again; unpin it, or pin a text instead"
            ),
        }
    }
}

/// Replaces an item's text (see the module docs for what each kind does). An edit that
/// changes nothing leaves the version alone.
pub fn edit(state: &mut MemoryState, item: ItemRef, text: &str) -> Result<(), ManageError> {
    if !matches!(
        item,
        ItemRef::Identity | ItemRef::Pinned(_) | ItemRef::Fact(_)
    ) {
        return Err(ManageError::NotEditable(ItemKind::of(item)));
    }
    // Memory text is never taken from its own echo, and forged fences stay inert.
    let text = memory_text(text).trim().to_string();
    if text.is_empty() {
        return Err(ManageError::EmptyText);
    }
    if !exists(state, item) && item != ItemRef::Identity {
        return Err(ManageError::NotFound);
    }
    match item {
        ItemRef::Identity => {
            if state.identity.as_ref().map(|identity| &identity.text) != Some(&text) {
                set_identity(state, &text);
            }
            Ok(())
        }
        ItemRef::Pinned(id) => {
            let pin = state.pinned.get(id as usize).ok_or(ManageError::NotFound)?;
            match state.pin_content(pin) {
                PinContent::Fact(fact) => return edit_fact(state, fact.id, &text),
                PinContent::Nothing => {
                    let fact = match pin.source {
                        Some(ItemRef::Fact(fact)) => fact,
                        _ => return Err(ManageError::NotFound),
                    };
                    return Err(ManageError::PinnedFactRemoved(fact));
                }
                PinContent::Text(_) => {}
            }
            let pin = state
                .pinned
                .get_mut(id as usize)
                .ok_or(ManageError::NotFound)?;
            if pin.text != text {
                pin.text = text;
                recount_pinned(pin);
                state.version += 1;
            }
            Ok(())
        }
        ItemRef::Fact(id) => edit_fact(state, id, &text),
        other => Err(ManageError::NotEditable(ItemKind::of(other))),
    }
}

fn edit_fact(state: &mut MemoryState, id: FactId, text: &str) -> Result<(), ManageError> {
    let (key, value) = split_key_value(text);
    let normalised = normalise(&key);
    if let Some(other) = state
        .active_facts()
        .find(|fact| fact.id != id && normalise(&fact.key) == normalised)
    {
        return Err(ManageError::KeyTaken(other.id));
    }
    let fact = state
        .facts
        .get_mut(id as usize)
        .ok_or(ManageError::NotFound)?;
    if fact.key == key && fact.value == value {
        return Ok(());
    }
    let renamed = fact.key != key;
    fact.history.push(FactRevision {
        value: std::mem::take(&mut fact.value),
        version: fact.version,
        provenance: std::mem::take(&mut fact.provenance),
        date: fact.date.take(),
        ended_by: RevisionEnd::Edited,
        ended_at_turn: None,
        key: renamed.then(|| fact.key.clone()),
    });
    fact.key = key;
    fact.value = value;
    fact.version += 1;
    recount_fact(fact);
    state.facts_version += 1;
    state.version += 1;
    Ok(())
}

/// Deletes an item and what was derived only from it; returns every item deleted, the
/// requested one first. Retired facts and unpinned items still hold their text, so they can
/// be deleted too.
pub fn delete(state: &mut MemoryState, item: ItemRef) -> Result<Vec<ItemRef>, ManageError> {
    let mut deleted = Vec::new();
    match item {
        ItemRef::Identity => {
            if state.identity.take().is_none() {
                return Err(ManageError::NotFound);
            }
            deleted.push(item);
        }
        ItemRef::Pinned(id) => {
            if !pin_holds_text(state, id) {
                return Err(ManageError::NotFound);
            }
            erase_pin(state, id, &mut deleted);
        }
        ItemRef::Fact(id) => {
            if !fact_holds_text(state, id) {
                return Err(ManageError::NotFound);
            }
            erase_facts(state, id, &mut deleted);
        }
        ItemRef::Summary(seq) => {
            if !exists(state, item) {
                return Err(ManageError::NotFound);
            }
            erase_summary(state, seq, &mut deleted);
        }
        ItemRef::Episode(id) => {
            if !exists(state, item) {
                return Err(ManageError::NotFound);
            }
            erase_episode(state, id, &mut deleted);
        }
        ItemRef::Artifact(id) => {
            if !exists(state, item) {
                return Err(ManageError::NotFound);
            }
            erase_artifact(state, id, &mut deleted);
        }
        ItemRef::RawTurn(seq) => {
            return Err(if (seq as usize) < state.raw_turns.len() {
                ManageError::Immutable
            } else {
                ManageError::NotFound
            });
        }
    }
    state.version += 1;
    Ok(deleted)
}

/// Whether a pin is still pinned or holds text of its own (an unpinned pin of a fact holds
/// none).
fn pin_holds_text(state: &MemoryState, id: PinId) -> bool {
    state
        .pinned
        .get(id as usize)
        .is_some_and(|pin| pin.active || !pin.text.is_empty())
}

fn fact_holds_text(state: &MemoryState, id: FactId) -> bool {
    state.fact(id).is_some_and(|fact| {
        fact.history
            .last()
            .is_none_or(|revision| revision.ended_by != RevisionEnd::Deleted)
    })
}

fn erase_pin(state: &mut MemoryState, id: PinId, deleted: &mut Vec<ItemRef>) {
    if let Some(pin) = state.pinned.get_mut(id as usize) {
        pin.text.clear();
        pin.active = false;
        pin.tokens = TokenCount::default();
        deleted.push(ItemRef::Pinned(id));
    }
}

/// Erases the fact, then the facts merged into it (they said the same thing) and the pins
/// projecting any of them; drops them from turn summaries' and episodes' dependency lists.
fn erase_facts(state: &mut MemoryState, first: FactId, deleted: &mut Vec<ItemRef>) {
    let mut pending = vec![first];
    let mut episodes: BTreeSet<EpisodeId> = BTreeSet::new();
    while let Some(id) = pending.pop() {
        if !fact_holds_text(state, id) {
            continue;
        }
        if let Some(fact) = state.facts.get_mut(id as usize) {
            fact.history = vec![FactRevision {
                value: String::new(),
                version: fact.version,
                provenance: Vec::new(),
                date: None,
                ended_by: RevisionEnd::Deleted,
                ended_at_turn: None,
                key: None,
            }];
            fact.key.clear();
            fact.value.clear();
            fact.provenance.clear();
            fact.date = None;
            fact.active = false;
            fact.version += 1;
            fact.tokens = TokenCount::default();
        }
        deleted.push(ItemRef::Fact(id));
        pending.extend(
            state
                .facts
                .iter()
                .filter(|fact| {
                    fact.history.last().map(|revision| revision.ended_by)
                        == Some(RevisionEnd::MergedInto(id))
                })
                .map(|fact| fact.id),
        );
        let pins: Vec<PinId> = state
            .pinned
            .iter()
            .filter(|pin| pin.source == Some(ItemRef::Fact(id)) && pin_holds_text(state, pin.id))
            .map(|pin| pin.id)
            .collect();
        for pin in pins {
            erase_pin(state, pin, deleted);
        }
        // Only the entries that name it change (and are written again).
        for seq in 0..state.turn_log.len() {
            if state.turn_log[seq].facts.contains(&id)
                && let Some(entry) = state.turn_log.get_mut(seq)
            {
                entry.facts = without(&entry.facts, id);
            }
        }
        episodes.extend(
            state
                .episodes
                .iter()
                .filter(|episode| episode.facts.contains(&id))
                .map(|episode| episode.id),
        );
    }
    for id in &episodes {
        refresh_episode(state, *id);
    }
    if !episodes.is_empty() {
        state.episodes_version += 1;
    }
    state.facts_version += 1;
}

/// A turn-log entry's list of ids (boxed: entries never grow one) without `id`.
fn without(ids: &[u32], id: u32) -> Box<[u32]> {
    ids.iter().copied().filter(|other| *other != id).collect()
}

/// Empties the summary and moves it to OLD outside any episode, so nothing injects it again;
/// its episode is rebuilt without it (and goes when it has no turn left).
fn erase_summary(state: &mut MemoryState, seq: TurnSeq, deleted: &mut Vec<ItemRef>) {
    let now = state.now();
    let Some(entry) = state.turn_log.get_mut(seq as usize) else {
        return;
    };
    entry.user_summary = SummaryText::Text(Box::default());
    entry.assistant_summary = SummaryText::Text(Box::default());
    entry.facts = Box::default();
    entry.artifacts = Box::default();
    entry.tier.tier = Tier::Old;
    entry.tier.since_turn = now;
    entry.tokens = TokenCount::default();
    entry.erased = true;
    let episode = entry.episode.take();
    deleted.push(ItemRef::Summary(seq));
    if let Some(id) = episode
        && let Some(manifest) = state.episode_mut(id)
    {
        manifest.links.retain(|link| *link != seq);
        if manifest.links.is_empty() {
            erase_episode(state, id, deleted);
        } else {
            refresh_episode(state, id);
        }
        state.episodes_version += 1;
    }
    state.rewrites += 1;
}

/// Empties the manifest; its turns stay (in OLD, outside any episode, still searchable).
fn erase_episode(state: &mut MemoryState, id: EpisodeId, deleted: &mut Vec<ItemRef>) {
    let Some(episode) = state.episode_mut(id) else {
        return;
    };
    let links = std::mem::take(&mut episode.links);
    episode.topic.clear();
    episode.date_range = (None, None);
    episode.summary.clear();
    episode.salience_tags.clear();
    episode.facts.clear();
    episode.rehydration_hints.clear();
    episode.size_estimate_tokens = 0;
    episode.rehydrated_at.clear();
    episode.tokens = TokenCount::default();
    episode.erased = true;
    for seq in links {
        if let Some(entry) = state.turn_log.get_mut(seq as usize)
            && entry.episode == Some(id)
        {
            entry.episode = None;
        }
    }
    deleted.push(ItemRef::Episode(id));
    state.episodes_version += 1;
}

fn erase_artifact(state: &mut MemoryState, id: ArtifactId, deleted: &mut Vec<ItemRef>) {
    let Some(artifact) = state.artifacts.get_mut(id as usize) else {
        return;
    };
    artifact.content.clear();
    artifact.side = None;
    artifact.language = None;
    artifact.tokens = TokenCount::default();
    artifact.reference_tokens = TokenCount::default();
    artifact.erased = true;
    let turn = artifact.turn;
    if let Some(entry) = state.turn_log.get_mut(turn as usize) {
        entry.artifacts = without(&entry.artifacts, id);
    }
    deleted.push(ItemRef::Artifact(id));
    state.rewrites += 1;
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MemoryConfig;
    use crate::diff::{FactDiff, FactEdit, apply_diff};
    use crate::extract::HeuristicExtractor;
    use crate::index::MemoryIndex;
    use crate::model::ExchangeInput;
    use crate::record::test_support::record_turn;
    use crate::record::{consolidate, pin, pin_fact, record_exchange};

    const BM25: Bm25 = Bm25::STANDARD;

    fn recorded(turns: &[&str]) -> MemoryState {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        for (n, text) in turns.iter().enumerate() {
            record_exchange(
                &mut state,
                &ExchangeInput {
                    session_id: "s".into(),
                    turn_id: format!("turn-{n}"),
                    user_text: (*text).into(),
                    assistant_text: "Noted.".into(),
                    ..ExchangeInput::default()
                },
                &HeuristicExtractor,
                &config,
            );
        }
        state
    }

    fn add_fact(state: &mut MemoryState, text: &str, source: Option<TurnSeq>) -> FactId {
        let diff = FactDiff {
            add: vec![FactEdit::new(text)],
            ..FactDiff::default()
        };
        let report = apply_diff(state, &diff, source);
        report.added[0]
    }

    #[test]
    fn item_ids_round_trip_and_reject_anything_else() {
        for item in [
            ItemRef::Identity,
            ItemRef::Pinned(0),
            ItemRef::Fact(3),
            ItemRef::Summary(12),
            ItemRef::Episode(1),
            ItemRef::Artifact(7),
            ItemRef::RawTurn(4_000_000_000),
        ] {
            assert_eq!(parse_item_id(&item_id(item)), Some(item));
        }
        for bad in [
            "",
            "fact",
            "fact:",
            "fact:-1",
            "fact:+1",
            "fact:1x",
            "identity:0",
            "nope:1",
            "fact:99999999999",
        ] {
            assert_eq!(parse_item_id(bad), None, "{bad}");
        }
    }

    #[test]
    fn listing_shows_every_kind_with_provenance_and_filters() {
        let mut state = recorded(&["I live in Lisbon.", "My cat is called Miso."]);
        set_identity(&mut state, "Ana, a nurse.");
        let fact = add_fact(&mut state, "favourite tea: oolong", Some(1));
        pin_fact(&mut state, fact);
        let items = list(&state, ItemFilter::default());
        let kinds: BTreeSet<ItemKind> = items.iter().map(|item| item.kind).collect();
        for kind in [
            ItemKind::Identity,
            ItemKind::Pinned,
            ItemKind::Fact,
            ItemKind::Summary,
            ItemKind::RawTurn,
        ] {
            assert!(kinds.contains(&kind), "{kind:?} missing in {items:?}");
        }
        let tea = items
            .iter()
            .find(|item| item.id == format!("fact:{fact}"))
            .unwrap();
        assert!(tea.pinned);
        assert_eq!(tea.provenance[0].turn_id, "turn-1");
        assert_eq!(tea.tier, Some(Tier::New));
        assert!(tea.tokens > 0);
        let pinned = items
            .iter()
            .find(|item| item.kind == ItemKind::Pinned)
            .unwrap();
        assert_eq!(pinned.source.as_deref(), Some(tea.id.as_str()));
        assert_eq!(pinned.provenance, tea.provenance);

        let facts = list(
            &state,
            ItemFilter {
                kind: Some(ItemKind::Fact),
                tier: Some(Tier::New),
            },
        );
        assert!(!facts.is_empty());
        assert!(facts.iter().all(|item| item.kind == ItemKind::Fact));
        let old = list(
            &state,
            ItemFilter {
                kind: None,
                tier: Some(Tier::Old),
            },
        );
        assert!(old.is_empty(), "{old:?}");
    }

    #[test]
    fn search_ranks_by_the_retrieval_terms_and_covers_pins() {
        let mut state = recorded(&[
            "My sourdough starter smells of acetone.",
            "We went hiking in the Alps last summer.",
        ]);
        pin(&mut state, "Always mention the sourdough schedule.");
        let index = MemoryIndex::build(&state);
        let hits = search(&state, &index, "sourdough", BM25);
        let ids: Vec<String> = hits.iter().map(|(item, _)| item_id(*item)).collect();
        assert!(ids.contains(&"raw_turn:0".to_owned()), "{ids:?}");
        assert!(ids.contains(&"pinned:0".to_owned()), "{ids:?}");
        assert!(!ids.contains(&"raw_turn:1".to_owned()), "{ids:?}");
        assert!(hits.windows(2).all(|pair| pair[0].1 >= pair[1].1));
        // Stemming: "hikes" finds "hiking".
        let hikes = search(&state, &index, "hikes", BM25);
        assert!(hikes.iter().any(|(item, _)| *item == ItemRef::RawTurn(1)));
        assert!(search(&state, &index, "zeppelin", BM25).is_empty());
    }

    #[test]
    fn a_fact_edit_is_a_revision_without_turns_and_pins_follow() {
        let mut state = recorded(&["Hello there."]);
        let fact = add_fact(&mut state, "lives in: Lisbon", Some(0));
        let other = add_fact(&mut state, "works at: the clinic", Some(0));
        let pin_id = pin_fact(&mut state, fact).unwrap();
        let before = state.version;

        edit(&mut state, ItemRef::Fact(fact), "lives in: Porto").unwrap();
        let edited = state.fact(fact).unwrap();
        assert_eq!(edited.text(), "lives in: Porto");
        assert!(edited.provenance.is_empty());
        let revision = edited.history.last().unwrap();
        assert_eq!(revision.ended_by, RevisionEnd::Edited);
        assert_eq!(
            (revision.value.as_str(), revision.key.as_deref()),
            ("Lisbon", None)
        );
        assert_eq!(revision.provenance, [0]);
        let pinned = view(&state, ItemRef::Pinned(pin_id)).unwrap();
        assert_eq!(pinned.text, "lives in: Porto");
        assert!(state.version > before);
        assert!(
            view(&state, ItemRef::Fact(fact))
                .unwrap()
                .fact
                .unwrap()
                .edited
        );

        // A new key keeps the old one in the revision; a key another fact holds is refused.
        edit(&mut state, ItemRef::Fact(fact), "home town: Porto").unwrap();
        let renamed = state.fact(fact).unwrap().history.last().unwrap().clone();
        assert_eq!(renamed.key.as_deref(), Some("lives in"));
        assert_eq!(
            edit(&mut state, ItemRef::Fact(fact), "Works at: a school"),
            Err(ManageError::KeyTaken(other))
        );
        // The same text changes nothing.
        let version = state.version;
        edit(&mut state, ItemRef::Fact(fact), "home town: Porto").unwrap();
        assert_eq!(state.version, version);

        assert_eq!(
            edit(&mut state, ItemRef::Summary(0), "x"),
            Err(ManageError::NotEditable(ItemKind::Summary))
        );
        assert_eq!(
            edit(&mut state, ItemRef::Fact(fact), "  "),
            Err(ManageError::EmptyText)
        );
        assert_eq!(
            edit(&mut state, ItemRef::Fact(99), "a: b"),
            Err(ManageError::NotFound)
        );
    }

    #[test]
    fn deleting_a_fact_erases_it_with_its_merged_copies_and_pins() {
        let mut state = recorded(&["Hello there.", "Thanks a lot."]);
        let keeper = add_fact(&mut state, "allergic to: peanuts", Some(0));
        // Another key with the same terms: consolidation merges it into the first.
        let twin = add_fact(&mut state, "allergic-to: peanuts", Some(1));
        assert_ne!(twin, keeper);
        let merged = consolidate(&mut state);
        assert_eq!(merged.merged_facts, [(twin, keeper)]);
        let pin_id = pin_fact(&mut state, keeper).unwrap();
        state.turn_log[0].facts = [keeper].into();

        let deleted = delete(&mut state, ItemRef::Fact(keeper)).unwrap();
        assert_eq!(deleted[0], ItemRef::Fact(keeper));
        assert!(deleted.contains(&ItemRef::Pinned(pin_id)));
        assert!(deleted.contains(&ItemRef::Fact(twin)));
        let erased = state.fact(keeper).unwrap();
        assert!(!erased.active && erased.key.is_empty() && erased.value.is_empty());
        assert_eq!(erased.history.len(), 1);
        assert_eq!(erased.history[0].ended_by, RevisionEnd::Deleted);
        assert!(state.pinned[pin_id as usize].text.is_empty());
        assert!(!state.turn_log[0].facts.contains(&keeper));
        let json = serde_json::to_string(&state).unwrap();
        assert!(!json.contains("peanuts"), "{json}");
        // A diff naming the key again makes a new fact; the deleted slot is never revived.
        let again = add_fact(&mut state, "allergic to: peanuts", Some(1));
        assert_ne!(again, keeper);
        assert_eq!(
            delete(&mut state, ItemRef::Fact(keeper)),
            Err(ManageError::NotFound)
        );
    }

    #[test]
    fn deleting_a_summary_keeps_its_raw_turn_and_leaves_the_index() {
        let mut state = recorded(&["Let's plan the trip to Kyoto.", "What about the weather?"]);
        let mut index = MemoryIndex::build(&state);
        let before = search(&state, &index, "Kyoto", BM25);
        assert!(
            before.iter().any(|(item, _)| *item == ItemRef::Summary(0)),
            "{before:?}"
        );
        let deleted = delete(&mut state, ItemRef::Summary(0)).unwrap();
        assert_eq!(deleted, [ItemRef::Summary(0)]);
        assert!(!index.is_current(&state));
        index.refresh(&state);
        let hits = search(&state, &index, "Kyoto", BM25);
        assert!(hits.iter().all(|(item, _)| *item != ItemRef::Summary(0)));
        assert!(hits.iter().any(|(item, _)| *item == ItemRef::RawTurn(0)));
        assert!(view(&state, ItemRef::Summary(0)).is_none());
        assert_eq!(state.turn_log[0].tier.tier, Tier::Old);
        assert_eq!(
            delete(&mut state, ItemRef::RawTurn(0)),
            Err(ManageError::Immutable)
        );
        assert_eq!(
            delete(&mut state, ItemRef::RawTurn(9)),
            Err(ManageError::NotFound)
        );
    }

    #[test]
    fn deleted_summaries_are_never_injected_again() {
        let turns: Vec<String> = (0..12)
            .map(|n| format!("Tell me about the harbour walk number {n}."))
            .collect();
        let turns: Vec<&str> = turns.iter().map(String::as_str).collect();
        let mut state = recorded(&turns);
        // A question recall finds nothing for: the turns before the window are shown as their
        // summaries (the recent context). One recall found would show raw instead. Lexical, so
        // that no turn is found by a cosine that happens to be above zero.
        let mut config = MemoryConfig::default();
        config.retrieval.mode = crate::config::RetrievalMode::Lexical;
        let messages = [crate::openai::ChatMessage::new(
            "user",
            "What should I cook tonight?",
        )];
        let request = crate::ComposeRequest {
            session_id: "s",
            messages: &messages,
            model: "gpt-4o",
            unapplied: &[],
        };
        let summaries = |state: &MemoryState| -> Vec<ItemRef> {
            let index = MemoryIndex::build(state);
            crate::compose(state, &index, &[], &request, &config)
                .explain
                .items
                .iter()
                .map(|item| item.item)
                .filter(|item| matches!(item, ItemRef::Summary(_)))
                .collect()
        };
        let before = summaries(&state);
        assert!(!before.is_empty(), "older turns come back as summaries");
        for item in before {
            delete(&mut state, item).unwrap();
        }
        assert!(summaries(&state).is_empty());
    }

    #[test]
    fn an_episode_left_without_turns_goes_and_is_never_extended() {
        let mut state = recorded(&["The sourdough starter smells odd."]);
        state.turn_log[0].tier.tier = Tier::Old;
        state.turn_log[0].episode = Some(0);
        state
            .episodes
            .push(std::sync::Arc::new(crate::manifest::build_manifest(
                &state,
                0,
                0,
                &[0],
                Vec::new(),
            )));
        assert!(view(&state, ItemRef::Episode(0)).is_some());
        let deleted = delete(&mut state, ItemRef::Summary(0)).unwrap();
        assert_eq!(deleted, [ItemRef::Summary(0), ItemRef::Episode(0)]);
        let episode = &state.episodes[0];
        assert!(episode.erased && episode.links.is_empty() && episode.topic.is_empty());
        refresh_episode(&mut state, 0);
        assert!(state.episodes[0].erased && state.episodes[0].summary.is_empty());
    }

    #[test]
    fn deleting_an_artifact_or_a_pin_erases_its_text() {
        let mut state = recorded(&["Here is my script:\n```python\nprint('secret sauce')\n```"]);
        assert!(
            !state.artifacts.is_empty(),
            "the code block became an artifact"
        );
        delete(&mut state, ItemRef::Artifact(0)).unwrap();
        assert!(state.artifacts[0].content.is_empty() && state.artifacts[0].erased);
        assert!(state.turn_log[0].artifacts.is_empty());
        // A draft that is its raw turn's text stops reading it (the raw turn stays).
        let pasted = "The lighthouse budget memo, paragraph after paragraph. ".repeat(40);
        let mut state = recorded(&[pasted.as_str()]);
        assert_eq!(state.artifacts[0].side, Some(crate::model::Side::User));
        delete(&mut state, ItemRef::Artifact(0)).unwrap();
        assert_eq!(state.artifact_content(&state.artifacts[0]), "");
        assert_eq!(&*state.raw_turns[0].user, pasted);
        let pin_id = pin(&mut state, "Call me Ana.");
        crate::record::unpin(&mut state, pin_id);
        // Unpinned, it still holds its text: deleting erases it.
        delete(&mut state, ItemRef::Pinned(pin_id)).unwrap();
        assert!(state.pinned[pin_id as usize].text.is_empty());
        assert_eq!(
            delete(&mut state, ItemRef::Pinned(pin_id)),
            Err(ManageError::NotFound)
        );
        assert_eq!(
            delete(&mut state, ItemRef::Identity),
            Err(ManageError::NotFound)
        );
    }

    #[test]
    fn a_pin_of_a_fact_shows_and_edits_the_facts_current_revision() {
        let mut state = MemoryState::new();
        let say = |state: &mut MemoryState, text: &str| {
            record_turn(state, (text, "Noted."), "s".into(), None);
        };
        say(&mut state, "Please call me Ana.");
        let name = state
            .active_facts()
            .find(|fact| fact.key == "name")
            .unwrap()
            .id;
        let pin_id = pin_fact(&mut state, name).unwrap();
        say(&mut state, "Actually, call me Jay.");

        let pinned = view(&state, ItemRef::Pinned(pin_id)).unwrap();
        let fact = view(&state, ItemRef::Fact(name)).unwrap();
        assert_eq!(pinned.text, "name: Jay");
        assert_eq!(pinned.tokens, fact.tokens);
        assert_eq!(pinned.source.as_deref(), Some(fact.id.as_str()));
        assert_eq!(pinned.provenance[0].turn_id, "t1");
        assert!(fact.pinned);
        let pins = list(
            &state,
            ItemFilter {
                kind: Some(ItemKind::Pinned),
                tier: None,
            },
        );
        assert_eq!(pins, [pinned]);
        let index = MemoryIndex::build(&state);
        let found = |query: &str| search(&state, &index, query, BM25);
        let finds_pin = |query: &str| {
            found(query)
                .iter()
                .any(|(item, _)| *item == ItemRef::Pinned(pin_id))
        };
        assert!(finds_pin("Jay") && !finds_pin("Ana"));
        // The pin keeps no copy of the text to go stale.
        let stored = serde_json::to_string(&state.pinned).unwrap();
        assert!(
            !stored.contains("Ana") && !stored.contains("Jay"),
            "{stored}"
        );

        // Editing the pin edits the fact it shows: a new revision of the fact.
        edit(&mut state, ItemRef::Pinned(pin_id), "name: Jo").unwrap();
        let edited = state.fact(name).unwrap();
        assert_eq!(edited.value, "Jo");
        assert_eq!(edited.history.last().unwrap().ended_by, RevisionEnd::Edited);

        // Removed by the conversation, the fact leaves the pin in place showing nothing.
        let removal = FactDiff {
            remove: vec![FactEdit::new("name")],
            ..FactDiff::default()
        };
        apply_diff(&mut state, &removal, Some(1));
        let pinned = view(&state, ItemRef::Pinned(pin_id)).unwrap();
        assert_eq!((pinned.text.as_str(), pinned.tokens), ("", 0));
        assert_eq!(
            edit(&mut state, ItemRef::Pinned(pin_id), "name: Jo"),
            Err(ManageError::PinnedFactRemoved(name))
        );
        // Deleting the pin unpins it; unpinned, a pin of a fact holds nothing to delete.
        assert_eq!(
            delete(&mut state, ItemRef::Pinned(pin_id)),
            Ok(vec![ItemRef::Pinned(pin_id)])
        );
        assert_eq!(
            delete(&mut state, ItemRef::Pinned(pin_id)),
            Err(ManageError::NotFound)
        );
    }
}
