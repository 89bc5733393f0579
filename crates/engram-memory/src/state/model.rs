//! The per-user memory state: identity (L0), base-truth facts (L1), pinned items, the raw log,
//! the turn log, episode manifests and artifacts. It is plain data, serialised as JSON by the
//! storage layer; every function that changes it lives in another module.
//!
//! Ids are positions: a fact's id is its index in `facts`, a turn's sequence number is its
//! index in `raw_turns` (and `turn_log`), and so on. Nothing is ever removed from these vectors
//! (demotion and retirement are flags), so ids stay valid and provenance always resolves.

use std::borrow::Cow;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::lookups::Lookups;
use super::segmented::Segmented;
use crate::text::{fnv1a, one_line, one_line_prefix};
use crate::tokens::TokenCount;

/// Position of a turn in the user's raw log (0-based, across all sessions).
pub type TurnSeq = u32;
pub type FactId = u32;
pub type EpisodeId = u32;
pub type ArtifactId = u32;
pub type PinId = u32;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    New,
    Current,
    Old,
}

/// Where an item sits in the tier hierarchy and how it has been used (seed 000). Serialised
/// with one-letter keys: it is stored on every item, thousands of times per user.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TierState {
    #[serde(rename = "t")]
    pub tier: Tier,
    /// Turn the item entered its current tier.
    #[serde(rename = "s")]
    pub since_turn: TurnSeq,
    #[serde(rename = "l")]
    pub last_touched_turn: TurnSeq,
    /// How often the conversation came back to the item.
    #[serde(rename = "f")]
    pub frequency: u32,
}

impl TierState {
    pub fn fresh(turn: TurnSeq) -> TierState {
        TierState {
            tier: Tier::New,
            since_turn: turn,
            last_touched_turn: turn,
            frequency: 1,
        }
    }
}

/// A reference to any memory item: what prefetch returns, what the explain lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(tag = "kind", content = "id", rename_all = "snake_case")]
pub enum ItemRef {
    Identity,
    Pinned(PinId),
    Fact(FactId),
    Summary(TurnSeq),
    RawTurn(TurnSeq),
    Episode(EpisodeId),
    Artifact(ArtifactId),
}

/// Prefetched candidates are item references.
pub type CandidateId = ItemRef;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct MemoryState {
    /// Bumped by every change; the retrieval index and caches key on it.
    pub version: u64,
    /// Bumped when a fact's text or status changes (the index rebuilds its fact part).
    pub facts_version: u64,
    /// Bumped when an episode manifest changes.
    pub episodes_version: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub identity: Option<Identity>,
    #[serde(default)]
    pub facts: Segmented<Fact>,
    #[serde(default)]
    pub pinned: Vec<PinnedItem>,
    #[serde(default)]
    pub raw_turns: Segmented<RawTurn>,
    /// One entry per raw turn, same index.
    #[serde(default)]
    pub turn_log: Segmented<TurnLogEntry>,
    /// Each manifest shared on its own between copies: a chunk copied for one changed manifest
    /// cloned 64 of them, a fifth of the worker's time at 10,000 turns (rehydration and
    /// folding change old episodes every turn; docs/benchmarks-log.md, 2026-11-27).
    #[serde(default)]
    pub episodes: Segmented<Arc<EpisodeManifest>>,
    #[serde(default)]
    pub artifacts: Segmented<Artifact>,
    #[serde(default)]
    pub sessions: Segmented<SessionState>,
    /// Bumped when a management deletion rewrites a turn summary or an artifact in place: the
    /// index, which only appends to those segments, rebuilds them.
    #[serde(default)]
    pub rewrites: u64,
    /// Derived from the items, never stored (see [`super::lookups`]).
    #[serde(skip)]
    pub lookups: Lookups,
}

impl MemoryState {
    pub fn new() -> MemoryState {
        MemoryState::default()
    }

    /// The latest recorded turn's sequence number (0 before any): items are stamped with it,
    /// and ages are counted from it.
    pub fn now(&self) -> TurnSeq {
        TurnSeq::try_from(self.raw_turns.len().saturating_sub(1)).unwrap_or(TurnSeq::MAX)
    }

    /// The client-visible id of a raw turn, for provenance.
    pub fn turn_id(&self, seq: TurnSeq) -> Option<&str> {
        self.raw_turns.get(seq as usize).map(|turn| &*turn.id)
    }

    /// Which memory this is, for as long as it lives: a hash of its first turn's id (0 before
    /// any turn). Its turns' numbers name the same turns in every later version; a memory
    /// forgotten and begun again has another first turn.
    pub fn origin(&self) -> u64 {
        self.turn_id(0).map_or(0, |id| fnv1a(0, id.as_bytes()))
    }

    /// The position of session `session_id`: through the lookups when they are built (every
    /// cached memory's are), else by a scan.
    pub fn session_index(&self, session_id: &str) -> Option<u32> {
        if self.lookups.is_built() {
            return self.lookups.session(self, session_id);
        }
        self.sessions
            .iter()
            .position(|session| session.id == session_id)
            .and_then(|index| u32::try_from(index).ok())
    }

    /// The raw turns of session `session`, newest first: its recent tail, then (for a window
    /// longer than the tail, or a memory stored before tails were kept) a scan back through the
    /// log from before the tail's oldest turn.
    pub fn session_turns_rev(&self, session: u32) -> impl Iterator<Item = TurnSeq> + '_ {
        let recent = self
            .sessions
            .get(session as usize)
            .map_or(&[][..], |state| state.recent.as_slice());
        let recent: &[TurnSeq] = recent;
        let scan_from = recent
            .first()
            .map_or(self.raw_turns.len(), |oldest| *oldest as usize);
        let older = (0..scan_from).rev().filter(move |seq| {
            self.raw_turns
                .get(*seq)
                .is_some_and(|turn| turn.session == session)
        });
        recent
            .iter()
            .rev()
            .copied()
            .chain(older.filter_map(|seq| TurnSeq::try_from(seq).ok()))
    }

    /// Approximate heap size in bytes of the items from the given positions on (raw turns,
    /// turn log, facts, episodes, artifacts); all of them from `[0; 5]`. Raw turns, most of
    /// a memory and never changed once written, and episodes are counted as what they hold
    /// (the item and each allocation as the allocator rounds it); the others by their texts
    /// and a fixed size. Episodes change after they are written (turns fold into them): see
    /// [`MemoryState::changed_bytes`].
    pub fn estimated_bytes_from(&self, from: [usize; 5]) -> usize {
        let raw: usize = (from[0]..self.raw_turns.len())
            .filter_map(|seq| self.raw_turns.get(seq))
            .map(|turn| {
                std::mem::size_of::<RawTurn>()
                    + allocation(turn.id.len())
                    + allocation(turn.user.len())
                    + allocation(turn.assistant.len())
                    + turn
                        .event_time
                        .as_ref()
                        .map_or(0, |time| allocation(time.len()))
            })
            .sum();
        let facts: usize = (from[2]..self.facts.len())
            .filter_map(|id| self.facts.get(id))
            .map(|fact| fact.key.len() + fact.value.len() + fact.provenance.len() * 4 + 200)
            .sum();
        let artifacts: usize = (from[4]..self.artifacts.len())
            .filter_map(|id| self.artifacts.get(id))
            .map(|artifact| artifact.content.len() + 120)
            .sum();
        let episodes: usize = (from[3]..self.episodes.len())
            .filter_map(|id| self.episodes.get(id))
            .map(|episode| episode.heap_bytes())
            .sum();
        raw + facts + artifacts + episodes + self.turn_log.len().saturating_sub(from[1]) * 128
    }

    /// How many bytes the episodes `previous` also holds grew (or shrank) by in this copy: with
    /// [`MemoryState::estimated_bytes_from`] for the new items, a copy's size follows from its
    /// predecessor's without sizing every item. A flat size per episode was half of what one
    /// takes after 20,000 turns (1.6 KB against 900 bytes), as its links grow. Compared by
    /// identity in the chunks the two copies no longer share (change records would miss a
    /// store's delta, whose items are put without one).
    pub fn changed_bytes(&self, previous: &MemoryState) -> isize {
        let size = |episode: &EpisodeManifest| episode.heap_bytes() as isize;
        self.episodes
            .unshared_positions(&previous.episodes)
            .filter_map(|id| {
                let now = self.episodes.get(id)?;
                let before = previous.episodes.get(id)?;
                (!Arc::ptr_eq(now, before)).then(|| size(now) - size(before))
            })
            .sum()
    }

    /// Item counts per kind, in the order [`MemoryState::estimated_bytes_from`] takes them.
    pub fn item_counts(&self) -> [usize; 5] {
        [
            self.raw_turns.len(),
            self.turn_log.len(),
            self.facts.len(),
            self.episodes.len(),
            self.artifacts.len(),
        ]
    }

    pub fn active_facts(&self) -> impl Iterator<Item = &Fact> {
        self.facts.iter().filter(|fact| fact.active)
    }

    pub fn fact(&self, id: FactId) -> Option<&Fact> {
        self.facts.get(id as usize)
    }

    pub fn episode(&self, id: EpisodeId) -> Option<&EpisodeManifest> {
        self.episodes.get(id as usize).map(|episode| &**episode)
    }

    /// Episode `id` for changing: copied first if another copy of the memory shares it.
    pub fn episode_mut(&mut self, id: EpisodeId) -> Option<&mut EpisodeManifest> {
        self.episodes.get_mut(id as usize).map(Arc::make_mut)
    }

    /// What fact `id` became: itself while active, else the fact it was merged into (through
    /// any merges after that); `None` once removed or deleted. A value the conversation changed
    /// keeps its fact (see [`crate::diff`]), so this is a lookup by id, plus one per merge.
    pub fn current_fact(&self, mut id: FactId) -> Option<&Fact> {
        // Merges go into an older fact, so a chain is never longer than the facts.
        for _ in 0..=self.facts.len() {
            let fact = self.fact(id)?;
            if fact.active {
                return Some(fact);
            }
            match fact.history.last().map(|revision| revision.ended_by) {
                Some(RevisionEnd::MergedInto(into)) => id = into,
                _ => return None,
            }
        }
        None
    }

    /// What a pin shows now (see [`PinnedItem`]).
    pub fn pin_content<'a>(&'a self, pin: &'a PinnedItem) -> PinContent<'a> {
        match pin.source {
            Some(ItemRef::Fact(id)) => self
                .current_fact(id)
                .map_or(PinContent::Nothing, PinContent::Fact),
            _ => PinContent::Text(pin),
        }
    }

    /// A turn's user and assistant summaries (see `TurnLogEntry::texts`).
    pub fn summary_texts(&self, seq: TurnSeq) -> (Cow<'_, str>, Cow<'_, str>) {
        self.turn_log
            .get(seq as usize)
            .map_or((Cow::Borrowed(""), Cow::Borrowed("")), |entry| {
                entry.texts(self.raw_turns.get(seq as usize))
            })
    }

    /// An artifact's text: its own, or the side of its raw turn it is.
    pub fn artifact_content<'a>(&'a self, artifact: &'a Artifact) -> &'a str {
        match artifact.side {
            Some(side) => self
                .raw_turns
                .get(artifact.turn as usize)
                .map_or("", |turn| turn.side(side).trim()),
            None => &artifact.content,
        }
    }

    /// The date a raw turn happened, in display form.
    pub fn turn_date(&self, seq: TurnSeq) -> Option<String> {
        self.raw_turns
            .get(seq as usize)
            .and_then(|turn| turn.event_time.as_deref())
            .and_then(crate::text::display_date)
    }
}

/// L0: a short, user-written profile, set through the management API.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Identity {
    pub text: String,
    /// Tokens of the rendered identity lines.
    pub tokens: TokenCount,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FactCategory {
    /// "never X", allergies, deadlines: always injected, never pruned or demoted.
    HardConstraint,
    /// Name, age, where the user lives or works.
    Identity,
    Preference,
    Relation,
    Possession,
    Plan,
    /// Something the user explicitly asked to be remembered.
    Explicit,
    General,
}

/// A base-truth fact `key: value` (or a bare `key` statement such as "allergic to peanuts").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Fact {
    pub id: FactId,
    pub key: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub value: String,
    pub category: FactCategory,
    /// User priority in `0..=1`.
    pub importance: f32,
    /// Bumped by each change of value or status.
    pub version: u32,
    /// Raw turns that established or confirmed the current value.
    pub provenance: Vec<TurnSeq>,
    /// Display date of the turn that set the current value.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    /// Earlier values, oldest first, each with its own provenance.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<FactRevision>,
    /// False once removed by a diff or merged into another fact; kept for provenance.
    pub active: bool,
    pub tier: TierState,
    /// Tokens of the rendered fact line.
    pub tokens: TokenCount,
}

impl Fact {
    /// `key: value`, or `key` alone.
    pub fn text(&self) -> String {
        if self.value.is_empty() {
            self.key.clone()
        } else {
            format!("{}: {}", self.key, self.value)
        }
    }

    pub fn is_hard_constraint(&self) -> bool {
        self.category == FactCategory::HardConstraint
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FactRevision {
    pub value: String,
    pub version: u32,
    pub provenance: Vec<TurnSeq>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub date: Option<String>,
    /// What ended this revision, and in which turn (None for management edits).
    pub ended_by: RevisionEnd,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ended_at_turn: Option<TurnSeq>,
    /// The fact's key during this revision, when a management edit changed the key after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub key: Option<String>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RevisionEnd {
    /// A new value contradicted it.
    Replaced,
    Removed,
    MergedInto(FactId),
    /// A management edit set a new text; the new value has no provenance turns.
    Edited,
    /// A management deletion erased the fact: key, value and history are gone, the slot stays
    /// so ids keep resolving.
    Deleted,
}

/// An item the user or app pinned: always injected. A pin is a text of its own, or a pin of a
/// fact: a projection that shows the fact's current revision ([`MemoryState::pin_content`]),
/// while the fact stays where it is and keeps changing with the conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct PinnedItem {
    pub id: PinId,
    /// The pinned text; empty for a pin of a fact. (Pins of facts made by earlier releases
    /// hold the fact's text as it was then; nothing reads it.)
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub source: Option<ItemRef>,
    pub active: bool,
    /// Tokens of the rendered text line; a pin of a fact is charged its fact's line.
    pub tokens: TokenCount,
}

/// What a pin shows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum PinContent<'a> {
    /// Its own text.
    Text(&'a PinnedItem),
    /// The current revision of its fact.
    Fact(&'a Fact),
    /// Nothing: its fact was removed (until the conversation states it again) or deleted.
    Nothing,
}

impl PinContent<'_> {
    /// The text the management API shows: the pin's, or its fact's `key: value`.
    pub fn text(&self) -> Cow<'_, str> {
        match self {
            PinContent::Text(pin) => Cow::Borrowed(&pin.text),
            PinContent::Fact(fact) => Cow::Owned(fact.text()),
            PinContent::Nothing => Cow::Borrowed(""),
        }
    }

    /// Tokens of the line it is injected as.
    pub fn tokens(&self) -> TokenCount {
        match self {
            PinContent::Text(pin) => pin.tokens,
            PinContent::Fact(fact) => fact.tokens,
            PinContent::Nothing => TokenCount::default(),
        }
    }
}

/// How deeply an exchange is kept (seed 001's size-adaptive depth).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Depth {
    /// Both sides short: a summary is enough.
    Short,
    Medium,
    /// A long message: kept raw in the window a little longer; a long reply becomes a draft.
    Long,
    /// Contains code: always diffed, code stored whole as artifacts.
    Code,
}

/// One exchange of the immutable raw log, the ground truth every summary links back to.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RawTurn {
    /// The stable id the proxy gave the exchange. The texts are boxed, not `String`s: never
    /// changed once written, and the four capacity words were 32 bytes of every turn.
    pub id: Box<str>,
    /// Index into `MemoryState::sessions`.
    pub session: u32,
    pub user: Box<str>,
    pub assistant: Box<str>,
    /// As given (RFC 3339 or a preformatted date).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_time: Option<Box<str>>,
    /// Hash chain link over the normalised conversation up to and including this exchange.
    pub chain: u64,
    /// [`pair`](crate::chain::pair) of the exchange as sent (before any excerpt); 0 in turns
    /// recorded before it was kept, whose pair is taken from the stored texts.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pair: u64,
    pub depth: Depth,
    /// The answer did not finish streaming (client disconnect).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub incomplete: bool,
    pub tokens: RawTurnTokens,
}

/// The heap bytes a text holds.
fn held(text: &String) -> usize {
    allocation(text.capacity())
}

/// The heap bytes a vector's buffer holds (not what its items point to).
fn held_items<T>(items: &Vec<T>) -> usize {
    allocation(items.capacity() * std::mem::size_of::<T>())
}

/// The bytes an allocation of `len` takes: jemalloc (the sidecar's allocator) rounds a small
/// request up to a multiple of 16 to 128 bytes, then to one of four classes per doubling.
fn allocation(len: usize) -> usize {
    match len {
        0 => 0,
        1..=128 => len.next_multiple_of(16),
        _ => len.next_multiple_of(len.next_power_of_two() / 8),
    }
}

fn is_zero(value: &u64) -> bool {
    *value == 0
}

impl EpisodeManifest {
    /// Heap bytes of the manifest as the state holds it (its own allocation behind an `Arc`,
    /// and each text and list in it).
    pub fn heap_bytes(&self) -> usize {
        let (first, last) = &self.date_range;
        allocation(2 * std::mem::size_of::<usize>() + std::mem::size_of::<EpisodeManifest>())
            + held(&self.topic)
            + first.as_ref().map_or(0, held)
            + last.as_ref().map_or(0, held)
            + held(&self.summary)
            + self.salience_tags.heap_bytes()
            + held_items(&self.links)
            + held_items(&self.facts)
            + self.rehydration_hints.heap_bytes()
            + held_items(&self.rehydrated_at)
    }
}

impl RawTurn {
    /// The exchange's [`pair`](crate::chain::pair) hash.
    pub fn pair(&self) -> u64 {
        match self.pair {
            0 => crate::chain::pair(&self.user, &self.assistant),
            pair => pair,
        }
    }

    pub fn side(&self, side: Side) -> &str {
        match side {
            Side::User => &self.user,
            Side::Assistant => &self.assistant,
        }
    }
}

/// Stored on every raw turn; one-letter keys keep the per-user JSON small.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct RawTurnTokens {
    /// Message contents, for the raw window.
    #[serde(rename = "u")]
    pub user: TokenCount,
    #[serde(rename = "a")]
    pub assistant: TokenCount,
    /// The full recall line, and the clipped one used when the full one does not fit.
    #[serde(rename = "l")]
    pub line: TokenCount,
    #[serde(rename = "c")]
    pub clipped_line: TokenCount,
    /// The [`date_heading`](crate::render::date_heading) above the turn's group of recall
    /// lines, paid once per group (0 in turns counted before lines left their date out, whose
    /// stored lines counted it).
    #[serde(rename = "d", default)]
    pub date: TokenCount,
}

/// One side of a turn summary: its own text, or the span of the raw side it was cut from. Most
/// heuristic summaries are a contiguous stretch of the (one-lined) raw text, and storing the
/// span instead of a copy keeps the per-user state small. Serialised as a string or as
/// `[start, end]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum SummaryText {
    /// Boxed, not a `String`: 16 bytes a side of every turn-log entry instead of 24.
    Text(Box<str>),
    /// Byte range `[start, end)` of `one_line(raw side)`.
    Span([u32; 2]),
}

impl SummaryText {
    /// A span when `summary` occurs in the raw side, the text otherwise.
    pub fn of(summary: String, raw: &str) -> SummaryText {
        let line = one_line(raw);
        match line.find(summary.as_str()) {
            Some(start) if !summary.is_empty() => {
                let span = u32::try_from(start)
                    .ok()
                    .zip(u32::try_from(start + summary.len()).ok());
                match span {
                    Some((start, end)) => SummaryText::Span([start, end]),
                    None => SummaryText::Text(summary.into_boxed_str()),
                }
            }
            _ => SummaryText::Text(summary.into_boxed_str()),
        }
    }

    pub fn resolve<'a>(&'a self, raw: &str) -> Cow<'a, str> {
        match self {
            SummaryText::Text(text) => Cow::Borrowed(text),
            SummaryText::Span([start, end]) => Cow::Owned(
                one_line_prefix(raw, *end as usize)
                    .get(*start as usize..*end as usize)
                    .unwrap_or_default()
                    .to_string(),
            ),
        }
    }
}

impl From<&str> for SummaryText {
    fn from(text: &str) -> SummaryText {
        SummaryText::Text(text.into())
    }
}

/// The turn-log entry of one exchange (seed 001): ≤25-word user and ≤30-word assistant
/// summaries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnLogEntry {
    pub turn: TurnSeq,
    pub user_summary: SummaryText,
    pub assistant_summary: SummaryText,
    /// Facts this turn added or changed (the summary's dependencies). Boxed slices, not
    /// vectors: every turn has an entry, most lists are empty or one long, and a vector's
    /// capacity word was 16 bytes an entry.
    #[serde(default, skip_serializing_if = "<[FactId]>::is_empty")]
    pub facts: Box<[FactId]>,
    #[serde(default, skip_serializing_if = "<[ArtifactId]>::is_empty")]
    pub artifacts: Box<[ArtifactId]>,
    pub tier: TierState,
    /// The episode this entry was folded into when it was demoted to OLD.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub episode: Option<EpisodeId>,
    pub tokens: TokenCount,
    /// Deleted through the management API: both summaries are empty and the entry sits in OLD
    /// outside any episode, so nothing injects it again (its raw turn stays).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub erased: bool,
}

impl TurnLogEntry {
    /// The user and assistant summaries as text (`raw` is this entry's raw turn).
    pub fn texts<'a>(&'a self, raw: Option<&RawTurn>) -> (Cow<'a, str>, Cow<'a, str>) {
        (
            self.user_summary
                .resolve(raw.map_or("", |turn| &*turn.user)),
            self.assistant_summary
                .resolve(raw.map_or("", |turn| &*turn.assistant)),
        )
    }
}

/// OLD tier: a compact index entry over a run of demoted turns (seed 000, 002).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodeManifest {
    pub id: EpisodeId,
    pub session: u32,
    pub topic: String,
    /// First and last display dates of the episode's turns, when known.
    pub date_range: (Option<String>, Option<String>),
    /// At most 256 characters.
    pub summary: String,
    pub salience_tags: Words,
    /// Raw turns of the episode (provenance into the raw log).
    pub links: Vec<TurnSeq>,
    /// Facts first established in the episode's turns.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub facts: Vec<FactId>,
    pub rehydration_hints: Words,
    /// Tokens the episode's raw turns would take in full.
    pub size_estimate_tokens: u32,
    /// The latest turns at which the conversation returned to the episode, oldest first (at
    /// most [`crate::tiers::REHYDRATIONS_KEPT`]).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rehydrated_at: Vec<TurnSeq>,
    pub tokens: TokenCount,
    /// Deleted through the management API: emptied, without links, never rebuilt or extended.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub erased: bool,
}

/// A short list of words or names held as one text, one per line: an episode's tags and
/// hints. A `Vec<String>` took a vector and an allocation per item, about 460 bytes more a
/// manifest (3.5 MiB at 60,000 turns). Serialised as the list of strings it replaced. An
/// item's own line breaks become spaces, and empty items are left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Words(Box<str>);

impl Words {
    pub fn iter(&self) -> impl Iterator<Item = &str> + '_ {
        (!self.0.is_empty())
            .then(|| self.0.split('\n'))
            .into_iter()
            .flatten()
    }

    pub fn len(&self) -> usize {
        self.iter().count()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn first(&self) -> Option<&str> {
        self.iter().next()
    }

    pub fn contains(&self, word: &str) -> bool {
        self.iter().any(|item| item == word)
    }

    /// The items with `separator` between them.
    pub fn join(&self, separator: &str) -> String {
        self.iter().collect::<Vec<_>>().join(separator)
    }

    /// The items one a line, as held: what `join("\n")` gives, without building it.
    pub fn as_lines(&self) -> &str {
        &self.0
    }

    pub fn clear(&mut self) {
        self.0 = Box::default();
    }

    /// Heap bytes of the text.
    pub fn heap_bytes(&self) -> usize {
        allocation(self.0.len())
    }
}

impl<S: AsRef<str>> FromIterator<S> for Words {
    fn from_iter<I: IntoIterator<Item = S>>(items: I) -> Words {
        let mut text = String::new();
        for item in items {
            let item = item.as_ref();
            if item.is_empty() {
                continue;
            }
            if !text.is_empty() {
                text.push('\n');
            }
            text.extend(item.chars().map(|c| if c == '\n' { ' ' } else { c }));
        }
        Words(text.into_boxed_str())
    }
}

impl Serialize for Words {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeSeq;
        let mut seq = serializer.serialize_seq(Some(self.len()))?;
        for item in self.iter() {
            seq.serialize_element(item)?;
        }
        seq.end()
    }
}

impl<'de> Deserialize<'de> for Words {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Words, D::Error> {
        Ok(Vec::<String>::deserialize(deserializer)?
            .into_iter()
            .collect())
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ArtifactKind {
    Code,
    Draft,
}

/// One side of an exchange.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Side {
    User,
    Assistant,
}

/// Code and long drafts, kept whole and never summarised (seed 001).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Artifact {
    pub id: ArtifactId,
    pub turn: TurnSeq,
    pub kind: ArtifactKind,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub language: Option<String>,
    /// Empty when `side` is set: read it through [`MemoryState::artifact_content`].
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub content: String,
    /// A draft that is the whole of one side of its raw turn (a long reply, a long pasted
    /// message) is that side's text, trimmed, and keeps no copy of it: a long paste would
    /// otherwise be stored twice in the state that every commit rewrites.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub side: Option<Side>,
    /// Tokens of the full rendering, and of the one-line reference used when it does not fit.
    pub tokens: TokenCount,
    pub reference_tokens: TokenCount,
    /// Deleted through the management API: the content is gone (its raw turn stays).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub erased: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SessionState {
    pub id: String,
    /// Chain link of the session's latest exchange.
    pub last_chain: u64,
    /// The session's latest raw turns, oldest first, at most [`SESSION_TAIL`]: the raw window
    /// reads them without scanning the log. Empty in memories stored before it was kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub recent: Vec<TurnSeq>,
}

/// Raw turns a session keeps the positions of (see [`SessionState::recent`]).
pub const SESSION_TAIL: usize = 64;

/// One exchange to record, as the proxy saw it.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ExchangeInput {
    pub session_id: String,
    /// Stable id of the exchange (re-recording the same id is a no-op).
    pub turn_id: String,
    pub user_text: String,
    pub assistant_text: String,
    /// RFC 3339 or a preformatted date; None for "unknown".
    #[serde(default)]
    pub event_time: Option<String>,
    /// `Composition::prior_chain` of the request that produced this exchange; None continues
    /// the session's own chain.
    #[serde(default)]
    pub prior_chain: Option<u64>,
    /// The answer did not finish streaming.
    #[serde(default)]
    pub incomplete: bool,
    /// When the request arrived (µs since the epoch, the recording process's clock). The
    /// memory engine does not read it; the Redis store orders a session's jobs by it, so
    /// turns recorded by different replicas apply in the order they happened.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub arrival: Option<u64>,
}

impl ExchangeInput {
    /// Bytes of the turn's texts (the user's message and the answer): what the stores and the
    /// recorder size an exchange by.
    pub fn text_bytes(&self) -> usize {
        self.user_text.len() + self.assistant_text.len()
    }
}

/// Memories built by hand for tests.
#[cfg(test)]
pub(crate) mod test_support {
    use super::{Depth, MemoryState, RawTurn, Tier, TierState, TurnLogEntry, TurnSeq};

    /// Appends a raw turn saying `user` (answered "ok") and its turn-log entry summarised as
    /// `summary`, in `tier` from now on; returns its sequence number. It has no date and
    /// belongs to no episode: callers set what their test needs.
    pub fn push_turn(state: &mut MemoryState, user: &str, summary: &str, tier: Tier) -> TurnSeq {
        let seq = state.raw_turns.len() as TurnSeq;
        state.raw_turns.push(RawTurn {
            id: format!("t{seq}").into(),
            session: 0,
            user: user.into(),
            assistant: "ok".into(),
            event_time: None,
            chain: 0,
            pair: 0,
            depth: Depth::Short,
            incomplete: false,
            tokens: Default::default(),
        });
        state.turn_log.push(TurnLogEntry {
            turn: seq,
            user_summary: summary.into(),
            assistant_summary: "answered".into(),
            facts: Box::default(),
            artifacts: Box::default(),
            tier: TierState {
                tier,
                ..TierState::fresh(seq)
            },
            episode: None,
            tokens: Default::default(),
            erased: false,
        });
        seq
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_keep_their_items_and_their_stored_form() {
        let stored = r#"["sourdough","New York","","two\nlines"]"#;
        let words: Words = serde_json::from_str(stored).unwrap_or_default();
        assert_eq!(words.len(), 3);
        assert_eq!(words.first(), Some("sourdough"));
        assert!(words.contains("New York"));
        assert!(!words.contains("New"));
        assert_eq!(words.join(", "), "sourdough, New York, two lines");
        assert_eq!(words.as_lines(), words.join("\n"));
        let again = serde_json::to_string(&words).unwrap_or_default();
        assert_eq!(again, r#"["sourdough","New York","two lines"]"#);
        let mut words = words;
        words.clear();
        assert!(words.is_empty());
        assert_eq!(words.iter().count(), 0);
        assert_eq!(serde_json::to_string(&words).unwrap_or_default(), "[]");
        assert_eq!(
            Words::default(),
            serde_json::from_str("[]").unwrap_or(words)
        );
    }

    /// jemalloc's small size classes: 16-byte steps to 128, then four per doubling.
    #[test]
    fn allocations_round_to_the_allocators_classes() {
        let classes: Vec<usize> = [0, 1, 16, 17, 128, 129, 160, 161, 256, 257, 300, 513, 4000]
            .into_iter()
            .map(allocation)
            .collect();
        assert_eq!(
            classes,
            [0, 16, 16, 32, 128, 160, 160, 192, 256, 320, 320, 640, 4096]
        );
    }

    /// A copy's episodes that grew count, whether the change was recorded (the worker's) or
    /// put clean (a store's delta applied to the cached copy).
    #[test]
    fn changed_bytes_follow_an_episodes_growth_however_it_was_put() {
        let episode = |links: u32| {
            Arc::new(EpisodeManifest {
                id: 0,
                session: 0,
                topic: "trips".into(),
                date_range: (None, None),
                summary: "Trips to Lisbon and Porto.".into(),
                salience_tags: ["lisbon"].into_iter().collect(),
                links: (0..links).collect(),
                facts: vec![],
                rehydration_hints: Words::default(),
                size_estimate_tokens: 0,
                rehydrated_at: vec![],
                tokens: Default::default(),
                erased: false,
            })
        };
        let mut previous = MemoryState::new();
        for _ in 0..70 {
            previous.episodes.push(episode(2));
        }
        previous.episodes.take_dirty();
        assert_eq!(previous.clone().changed_bytes(&previous), 0);
        let grown = episode(300).heap_bytes() as isize - episode(2).heap_bytes() as isize;
        assert!(grown >= 298 * 4);
        let mut recorded = previous.clone();
        recorded.episodes[65] = episode(300);
        assert_eq!(recorded.changed_bytes(&previous), grown);
        let mut put = previous.clone();
        assert!(put.episodes.put_clean(3, episode(300)));
        assert!(!put.episodes.has_changes());
        assert_eq!(put.changed_bytes(&previous), grown);
        // New episodes are sized with the new items, not here.
        put.episodes.push(episode(9));
        assert_eq!(put.changed_bytes(&previous), grown);
    }

    #[test]
    fn item_refs_serialise_as_tagged_ids() {
        let json = serde_json::to_string(&ItemRef::Fact(3)).unwrap();
        assert_eq!(json, r#"{"kind":"fact","id":3}"#);
        let back: ItemRef = serde_json::from_str(r#"{"kind":"raw_turn","id":7}"#).unwrap();
        assert_eq!(back, ItemRef::RawTurn(7));
        let identity: ItemRef = serde_json::from_str(r#"{"kind":"identity"}"#).unwrap();
        assert_eq!(identity, ItemRef::Identity);
    }

    #[test]
    fn fact_text_joins_key_and_value() {
        let mut fact = Fact {
            id: 0,
            key: "lives in".into(),
            value: "Berlin".into(),
            category: FactCategory::Identity,
            importance: 0.5,
            version: 1,
            provenance: vec![0],
            date: None,
            history: vec![],
            active: true,
            tier: TierState::fresh(0),
            tokens: TokenCount::default(),
        };
        assert_eq!(fact.text(), "lives in: Berlin");
        fact.value.clear();
        assert_eq!(fact.text(), "lives in");
    }
}
