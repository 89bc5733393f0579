//! A fenced block as it is packed: its lines, their sections and days, and what it costs.

use crate::model::{ArtifactId, ArtifactKind, ItemRef, MemoryState};
use crate::prompt::budget::Packer;
use crate::prompt::explain::Form;
use crate::prompt::render::Fixed;
use crate::text::date_key;
use crate::tokens::Encoding;

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(super) enum Section {
    Identity,
    Constraints,
    Pinned,
    Facts,
    RelevantFacts,
    Conversation,
    Episodes,
    Artifacts,
}

impl Section {
    pub(super) fn heading(self) -> Fixed {
        match self {
            Section::Identity => Fixed::IdentityHeading,
            Section::Constraints => Fixed::ConstraintsHeading,
            Section::Pinned => Fixed::PinnedHeading,
            Section::Facts => Fixed::FactsHeading,
            Section::RelevantFacts => Fixed::RelevantFactsHeading,
            Section::Conversation => Fixed::ConversationHeading,
            Section::Episodes => Fixed::EpisodesHeading,
            Section::Artifacts => Fixed::ArtifactsHeading,
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub(super) struct Line<'a> {
    pub(super) section: Section,
    /// Order within the section.
    pub(super) order: u64,
    pub(super) item: ItemRef,
    pub(super) form: Form,
    /// The day a conversation line is dated by (none for other lines and undated turns).
    pub(super) date: Option<Dated<'a>>,
}

impl Line<'_> {
    /// A line shown whole and undated: a core line, a fact or an episode.
    pub(super) fn undated(section: Section, order: u64, item: ItemRef) -> Line<'static> {
        Line {
            section,
            order,
            item,
            form: Form::Full,
            date: None,
        }
    }
}

/// A conversation line's day: the lines of one day are shown together under one
/// [`date_heading`](crate::prompt::render::date_heading), which the first of them pays for.
#[derive(Debug, Clone, Copy)]
pub(super) struct Dated<'a> {
    pub(super) key: &'a str,
    /// The turn's event time, which the heading shows.
    pub(super) event_time: &'a str,
    /// The heading's tokens.
    heading: u32,
}

/// The day of the turn `item` shows (a raw turn or its summary), if it has one.
pub(super) fn dated(state: &MemoryState, item: ItemRef, encoding: Encoding) -> Option<Dated<'_>> {
    let (ItemRef::RawTurn(seq) | ItemRef::Summary(seq)) = item else {
        return None;
    };
    let turn = state.raw_turns.get(seq as usize)?;
    let event_time = turn.event_time.as_deref()?;
    Some(Dated {
        key: date_key(event_time)?,
        event_time,
        heading: turn.tokens.date.get(encoding),
    })
}

/// A fenced block being packed: its lines and what it has cost so far.
pub(super) struct BlockPlan<'a> {
    /// Open tag, preamble, close tag and message overhead (or prefix separator).
    fixed: u32,
    headings: Vec<Section>,
    /// The days whose heading is paid for.
    dates: Vec<&'a str>,
    pub(super) lines: Vec<Line<'a>>,
    /// Each line's own tokens, by position in `lines`.
    line_tokens: Vec<u32>,
    pub(super) tokens: u32,
}

impl<'a> BlockPlan<'a> {
    pub(super) fn new(fixed: u32) -> BlockPlan<'a> {
        BlockPlan {
            fixed,
            headings: Vec::new(),
            dates: Vec::new(),
            lines: Vec::new(),
            line_tokens: Vec::new(),
            tokens: 0,
        }
    }

    fn cost(&self, line: &Line<'a>, tokens: u32, encoding: Encoding) -> u32 {
        let mut cost = tokens;
        if !self.headings.contains(&line.section) {
            cost = cost.saturating_add(line.section.heading().tokens(encoding));
        }
        if let Some(date) = line.date
            && !self.dates.contains(&date.key)
        {
            cost = cost.saturating_add(date.heading);
        }
        if self.lines.is_empty() {
            cost = cost.saturating_add(self.fixed);
        }
        cost
    }

    pub(super) fn try_add(
        &mut self,
        packer: &mut Packer,
        line: Line<'a>,
        tokens: u32,
        encoding: Encoding,
    ) -> bool {
        let cost = self.cost(&line, tokens, encoding);
        if !packer.take(cost) {
            return false;
        }
        if !self.headings.contains(&line.section) {
            self.headings.push(line.section);
        }
        if let Some(date) = line.date
            && !self.dates.contains(&date.key)
        {
            self.dates.push(date.key);
        }
        self.lines.push(line);
        self.line_tokens.push(tokens);
        self.tokens = self.tokens.saturating_add(cost);
        true
    }

    /// Shows `line` in place of the line showing `old` (same section and day), if what it
    /// costs more fits: a turn shown as its summary becomes its raw line, and is still shown
    /// once.
    pub(super) fn replace(
        &mut self,
        packer: &mut Packer,
        old: ItemRef,
        line: Line<'a>,
        tokens: u32,
    ) -> bool {
        let Some(at) = self.lines.iter().position(|shown| shown.item == old) else {
            return false;
        };
        let was = self.line_tokens[at];
        if !packer.take(tokens.saturating_sub(was)) {
            return false;
        }
        self.lines[at] = line;
        self.line_tokens[at] = tokens;
        self.tokens = self.tokens.saturating_sub(was).saturating_add(tokens);
        true
    }

    /// Drops every line (the final guard's last resort): the block is then not rendered.
    pub(super) fn clear(&mut self) {
        self.headings.clear();
        self.dates.clear();
        self.lines.clear();
        self.line_tokens.clear();
        self.tokens = 0;
    }

    pub(super) fn contains(&self, item: ItemRef) -> bool {
        self.lines.iter().any(|line| line.item == item)
    }

    /// Whether the block already shows what `item` would add: a summary is covered by its raw
    /// turn too (a raw hit still adds the raw text to a turn shown as a summary), an artifact by
    /// its turn's raw line when that holds it.
    pub(super) fn shows(&self, state: &MemoryState, item: ItemRef) -> bool {
        match item {
            ItemRef::Summary(seq) => {
                self.contains(ItemRef::RawTurn(seq)) || self.contains(ItemRef::Summary(seq))
            }
            ItemRef::Artifact(id) => {
                self.contains(item) || self.lines.iter().any(|shown| holds(state, shown, id))
            }
            _ => self.contains(item),
        }
    }

    /// Whether `line` would show text that the block shows already: a turn's text is shown
    /// once, as its raw line or beside it as its artifacts, never both.
    pub(super) fn overlaps(&self, state: &MemoryState, line: &Line<'_>) -> bool {
        match line.item {
            ItemRef::Artifact(id) => self.lines.iter().any(|shown| holds(state, shown, id)),
            ItemRef::RawTurn(seq) => state.turn_log.get(seq as usize).is_some_and(|entry| {
                entry
                    .artifacts
                    .iter()
                    .any(|id| self.contains(ItemRef::Artifact(*id)) && holds(state, line, *id))
            }),
            _ => false,
        }
    }
}

/// Whether `line`, a turn's raw line, shows (part of) `artifact`: a full raw line holds all of
/// its turn's artifacts; a clipped one the start of a draft (it stops before any code block).
fn holds(state: &MemoryState, line: &Line<'_>, artifact: ArtifactId) -> bool {
    let ItemRef::RawTurn(seq) = line.item else {
        return false;
    };
    state
        .artifacts
        .get(artifact as usize)
        .is_some_and(|artifact| {
            artifact.turn == seq
                && (line.form == Form::Full || artifact.kind == ArtifactKind::Draft)
        })
}
