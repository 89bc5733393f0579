//! Base-truth diffs (seed 001): `{add, update, remove}`, applied remove → update → add. An
//! update is matched by key (the text before the first `:`); an update with an unknown key is
//! an add; an add whose key already exists is an update. A changed value is a contradiction: the
//! new value replaces the old one, the old one moves to the fact's history with its provenance.
//!
//! Application is idempotent: a diff is first collapsed to one final operation per key (the one
//! the ordered application would leave in force), and confirming a value a turn already
//! confirmed changes nothing, so a re-applied job (a re-claimed worker job) is harmless.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::model::{
    Fact, FactCategory, FactId, FactRevision, MemoryState, RevisionEnd, TierState, TurnSeq,
};
use crate::render::recount_fact;
use crate::score::default_importance;
use crate::text::{normalise, one_line, terms};

/// One diff entry: a string (what an LLM summarizer returns) or an object with a category.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(from = "FactEditWire")]
pub struct FactEdit {
    pub text: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category: Option<FactCategory>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub importance: Option<f32>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum FactEditWire {
    Text(String),
    Full {
        text: String,
        #[serde(default)]
        category: Option<FactCategory>,
        #[serde(default)]
        importance: Option<f32>,
    },
}

impl From<FactEditWire> for FactEdit {
    fn from(wire: FactEditWire) -> FactEdit {
        match wire {
            FactEditWire::Text(text) => FactEdit::new(text),
            FactEditWire::Full {
                text,
                category,
                importance,
            } => FactEdit {
                text,
                category,
                importance,
            },
        }
    }
}

impl FactEdit {
    pub fn new(text: impl Into<String>) -> FactEdit {
        FactEdit {
            text: text.into(),
            category: None,
            importance: None,
        }
    }

    pub fn with_category(text: impl Into<String>, category: FactCategory) -> FactEdit {
        FactEdit {
            text: text.into(),
            category: Some(category),
            importance: None,
        }
    }

    /// `(key, value)`: the text before the first `:` and the rest, trimmed, on one line.
    pub fn key_value(&self) -> (String, String) {
        split_key_value(&self.text)
    }
}

impl From<&str> for FactEdit {
    fn from(text: &str) -> FactEdit {
        FactEdit::new(text)
    }
}

pub fn split_key_value(text: &str) -> (String, String) {
    let text = one_line(text);
    match text.split_once(':') {
        Some((key, value)) if !key.trim().is_empty() => {
            (key.trim().to_string(), value.trim().to_string())
        }
        _ => (text.trim().to_string(), String::new()),
    }
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct FactDiff {
    pub add: Vec<FactEdit>,
    pub update: Vec<FactEdit>,
    pub remove: Vec<FactEdit>,
}

impl FactDiff {
    pub fn is_empty(&self) -> bool {
        self.add.is_empty() && self.update.is_empty() && self.remove.is_empty()
    }
}

/// What applying a diff did.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct DiffReport {
    pub added: Vec<FactId>,
    /// Facts whose value changed (the old value is in their history).
    pub updated: Vec<FactId>,
    pub removed: Vec<FactId>,
    /// Facts restated with the same value.
    pub confirmed: Vec<FactId>,
    /// Entries that matched nothing (a remove of an unknown fact) or were empty.
    pub ignored: Vec<String>,
}

impl DiffReport {
    pub fn changed(&self) -> bool {
        !(self.added.is_empty() && self.updated.is_empty() && self.removed.is_empty())
    }

    /// Facts this diff touched in any way.
    pub fn touched(&self) -> impl Iterator<Item = FactId> + '_ {
        self.added
            .iter()
            .chain(&self.updated)
            .chain(&self.removed)
            .chain(&self.confirmed)
            .copied()
    }
}

/// The final effect a diff has on one key.
#[derive(Debug, Clone)]
enum KeyOp {
    /// Remove: unconditionally (`None`), or only if the current value is one of these.
    Remove {
        values: Option<Vec<String>>,
    },
    Set {
        edit: FactEdit,
        value: String,
    },
}

/// Collapses the diff to one operation per normalised key, in remove → update → add order: a
/// later operation on the same key overrides an earlier one, exactly as applying the lists in
/// that order would. Keys come out sorted, so application order is deterministic.
fn collapse(diff: &FactDiff) -> (BTreeMap<String, (String, KeyOp)>, Vec<String>) {
    let mut ops: BTreeMap<String, (String, KeyOp)> = BTreeMap::new();
    let mut ignored = Vec::new();
    for edit in &diff.remove {
        let (key, value) = edit.key_value();
        if key.is_empty() {
            ignored.push(edit.text.clone());
            continue;
        }
        // Removes of one key combine as the sequence would: any unconditional remove wins,
        // otherwise the fact goes if it holds any of the listed values.
        let values = match (ops.remove(&normalise(&key)), value.is_empty()) {
            (_, true) | (Some((_, KeyOp::Remove { values: None })), _) => None,
            (
                Some((
                    _,
                    KeyOp::Remove {
                        values: Some(mut earlier),
                    },
                )),
                false,
            ) => {
                earlier.push(value);
                Some(earlier)
            }
            (_, false) => Some(vec![value]),
        };
        ops.insert(normalise(&key), (key, KeyOp::Remove { values }));
    }
    for edit in diff.update.iter().chain(&diff.add) {
        let (key, value) = edit.key_value();
        if key.is_empty() {
            ignored.push(edit.text.clone());
            continue;
        }
        ops.insert(
            normalise(&key),
            (
                key,
                KeyOp::Set {
                    edit: edit.clone(),
                    value,
                },
            ),
        );
    }
    (ops, ignored)
}

/// Applies `diff` to the base truth. `source` is the raw turn the diff came from (None for
/// management edits); it becomes the provenance of every value the diff sets.
pub fn apply_diff(state: &mut MemoryState, diff: &FactDiff, source: Option<TurnSeq>) -> DiffReport {
    let (ops, ignored) = collapse(diff);
    let mut report = DiffReport {
        ignored,
        ..DiffReport::default()
    };
    let now = state.now();
    let date = source.and_then(|seq| state.turn_date(seq));
    let mut reconfirmed = false;
    for (normalised_key, (key, op)) in ops {
        let existing = find_fact(state, &normalised_key);
        match op {
            KeyOp::Remove { values } => {
                let Some(index) = existing.filter(|index| state.facts[*index].active) else {
                    report.ignored.push(key);
                    continue;
                };
                let fact = &mut state.facts[index];
                if let Some(values) = values
                    && !values
                        .iter()
                        .any(|value| normalise(value) == normalise(&fact.value))
                {
                    // A remove of a value the fact no longer holds is stale.
                    report.ignored.push(key);
                    continue;
                }
                let revision = revision_of(fact, RevisionEnd::Removed, source);
                push_revision(&mut fact.history, revision);
                fact.active = false;
                fact.version += 1;
                report.removed.push(fact.id);
            }
            KeyOp::Set { edit, value } => match existing {
                Some(index) => {
                    let fact = &mut state.facts[index];
                    if fact.active && normalise(&fact.value) == normalise(&value) {
                        if let Some(seq) = source
                            && !fact.provenance.contains(&seq)
                        {
                            push_provenance(&mut fact.provenance, seq);
                            fact.tier.frequency += 1;
                            fact.tier.last_touched_turn = now;
                            reconfirmed = true;
                        }
                        report.confirmed.push(fact.id);
                        continue;
                    }
                    let end = if fact.active {
                        RevisionEnd::Replaced
                    } else {
                        RevisionEnd::Removed
                    };
                    // A removed fact's history already holds its last value.
                    if fact.active {
                        let revision = revision_of(fact, end, source);
                        push_revision(&mut fact.history, revision);
                    }
                    fact.value = value;
                    fact.active = true;
                    fact.version += 1;
                    fact.provenance = source.into_iter().collect();
                    fact.date = date.clone();
                    if let Some(category) = edit.category {
                        fact.category = category;
                    }
                    if let Some(importance) = edit.importance {
                        fact.importance = importance.clamp(0.0, 1.0);
                    }
                    fact.tier = TierState {
                        frequency: fact.tier.frequency + 1,
                        ..TierState::fresh(now)
                    };
                    recount_fact(fact);
                    report.updated.push(fact.id);
                }
                None => {
                    let id = FactId::try_from(state.facts.len()).unwrap_or(FactId::MAX);
                    let category = edit
                        .category
                        .unwrap_or_else(|| infer_category(&key, &value));
                    let mut fact = Fact {
                        id,
                        key,
                        value,
                        category,
                        importance: edit
                            .importance
                            .unwrap_or_else(|| default_importance(category))
                            .clamp(0.0, 1.0),
                        version: 1,
                        provenance: source.into_iter().collect(),
                        date: date.clone(),
                        history: Vec::new(),
                        active: true,
                        tier: TierState::fresh(now),
                        tokens: Default::default(),
                    };
                    recount_fact(&mut fact);
                    state.facts.push(fact);
                    report.added.push(id);
                }
            },
        }
    }
    if report.changed() {
        state.facts_version += 1;
        state.version += 1;
    } else if reconfirmed {
        state.version += 1;
    }
    report
}

fn find_fact(state: &mut MemoryState, normalised_key: &str) -> Option<usize> {
    // Prefer the active fact; a retired one with the same key is revived rather than duplicated.
    state.sync_lookups();
    let mut retired = None;
    for id in state.lookups.facts_with_key(state, normalised_key) {
        let Some(fact) = state.fact(id) else {
            continue;
        };
        if fact.active {
            return Some(id as usize);
        }
        // Merged facts stay retired (their survivor carries the key), deleted ones gone.
        if !matches!(
            fact.history.last().map(|revision| revision.ended_by),
            Some(RevisionEnd::MergedInto(_) | RevisionEnd::Deleted)
        ) {
            retired = Some(id as usize);
        }
    }
    retired
}

/// Turns a fact's provenance keeps: the one that established it and the latest that confirmed
/// it. A fact the user repeats every day would otherwise grow with the history, and with it
/// every write of the fact.
pub const MAX_PROVENANCE: usize = 16;

/// Earlier values a fact keeps, the latest ones.
pub const MAX_REVISIONS: usize = 16;

/// Adds a confirming turn, dropping the oldest confirmation past [`MAX_PROVENANCE`] (the first
/// turn stays).
pub fn push_provenance(provenance: &mut Vec<TurnSeq>, seq: TurnSeq) {
    provenance.push(seq);
    if provenance.len() > MAX_PROVENANCE {
        provenance.remove(1);
    }
}

/// Adds an ended revision, dropping the oldest past [`MAX_REVISIONS`].
pub fn push_revision(history: &mut Vec<FactRevision>, revision: FactRevision) {
    history.push(revision);
    if history.len() > MAX_REVISIONS {
        history.remove(0);
    }
}

fn revision_of(fact: &Fact, ended_by: RevisionEnd, at: Option<TurnSeq>) -> FactRevision {
    FactRevision {
        value: fact.value.clone(),
        version: fact.version,
        provenance: fact.provenance.clone(),
        date: fact.date.clone(),
        ended_by,
        ended_at_turn: at,
        key: None,
    }
}

/// Guesses a category for a diff entry that did not name one (LLM summarizer output).
pub fn infer_category(key: &str, value: &str) -> FactCategory {
    let text = format!("{key} {value}").to_lowercase();
    const HARD: &[&str] = &[
        "never",
        "must not",
        "mustn't",
        "do not",
        "don't ever",
        "allerg",
        "deadline",
        "cannot eat",
        "can't eat",
        "intoleran",
    ];
    if HARD.iter().any(|marker| text.contains(marker)) {
        FactCategory::HardConstraint
    } else {
        FactCategory::General
    }
}

/// Keeps only diff entries grounded in the exchange: at least half of the entry's value terms
/// (its key terms when it has no value) must occur in `exchange_text`. Removes are kept (they
/// only act on facts that exist). Returns the dropped entries.
pub fn retain_grounded(diff: &mut FactDiff, exchange_text: &str) -> Vec<String> {
    let known: std::collections::HashSet<String> = terms(exchange_text).collect();
    let mut dropped = Vec::new();
    let mut keep = |edit: &FactEdit| {
        let (key, value) = edit.key_value();
        let basis = if value.is_empty() { key } else { value };
        let wanted: Vec<String> = terms(&basis).collect();
        let found = wanted.iter().filter(|term| known.contains(*term)).count();
        // Entries made of stop-words only ("yes") carry nothing to check; keep them out too.
        let grounded = !wanted.is_empty() && found * 2 >= wanted.len();
        if !grounded {
            dropped.push(edit.text.clone());
        }
        grounded
    };
    diff.add.retain(&mut keep);
    diff.update.retain(&mut keep);
    dropped
}

#[cfg(test)]
mod tests {
    use super::*;

    fn diff(add: &[&str], update: &[&str], remove: &[&str]) -> FactDiff {
        FactDiff {
            add: add.iter().map(|text| FactEdit::new(*text)).collect(),
            update: update.iter().map(|text| FactEdit::new(*text)).collect(),
            remove: remove.iter().map(|text| FactEdit::new(*text)).collect(),
        }
    }

    fn active(state: &MemoryState) -> Vec<String> {
        state.active_facts().map(Fact::text).collect()
    }

    #[test]
    fn diff_entries_parse_from_strings_or_objects() {
        let parsed: FactDiff = serde_json::from_str(
            r#"{"add": ["likes jazz", {"text": "never call before 9", "category": "hard_constraint"}],
                "remove": ["old: x"]}"#,
        )
        .unwrap();
        assert_eq!(parsed.add[0], FactEdit::new("likes jazz"));
        assert_eq!(parsed.add[1].category, Some(FactCategory::HardConstraint));
        assert!(parsed.update.is_empty());
        assert_eq!(parsed.remove[0].key_value(), ("old".into(), "x".into()));
    }

    #[test]
    fn seed_example_applies_in_order() {
        let mut state = MemoryState::new();
        apply_diff(
            &mut state,
            &diff(
                &[
                    "User open to recursive approaches",
                    "Sorting function: recursive",
                ],
                &[],
                &[],
            ),
            None,
        );
        let report = apply_diff(
            &mut state,
            &diff(
                &["User prefers iterative over recursive solutions"],
                &["Sorting function: now iterative quicksort, O(n log n)"],
                &["User open to recursive approaches"],
            ),
            None,
        );
        assert_eq!(report.removed.len(), 1);
        assert_eq!(report.updated.len(), 1);
        assert_eq!(report.added.len(), 1);
        assert_eq!(
            active(&state),
            [
                "Sorting function: now iterative quicksort, O(n log n)",
                "User prefers iterative over recursive solutions"
            ]
        );
        let sorting = state
            .facts
            .iter()
            .find(|fact| fact.key == "Sorting function")
            .unwrap();
        assert_eq!(sorting.version, 2);
        assert_eq!(sorting.history[0].value, "recursive");
        assert_eq!(sorting.history[0].ended_by, RevisionEnd::Replaced);
    }

    #[test]
    fn unknown_update_becomes_add_and_known_add_becomes_update() {
        let mut state = MemoryState::new();
        let report = apply_diff(&mut state, &diff(&[], &["lives in: Paris"], &[]), None);
        assert_eq!(report.added.len(), 1);
        let report = apply_diff(&mut state, &diff(&["Lives in: Berlin"], &[], &[]), None);
        assert_eq!(report.updated, [0]);
        assert_eq!(active(&state), ["lives in: Berlin"]);
        assert_eq!(state.facts[0].history[0].value, "Paris");
    }

    #[test]
    fn remove_then_add_of_the_same_key_leaves_the_add() {
        let mut state = MemoryState::new();
        apply_diff(&mut state, &diff(&["pet: cat"], &[], &[]), None);
        apply_diff(&mut state, &diff(&["pet: dog"], &[], &["pet"]), None);
        assert_eq!(active(&state), ["pet: dog"]);
    }

    #[test]
    fn stale_value_remove_is_ignored() {
        let mut state = MemoryState::new();
        apply_diff(&mut state, &diff(&["lives in: Berlin"], &[], &[]), None);
        let report = apply_diff(&mut state, &diff(&[], &[], &["lives in: Paris"]), None);
        assert!(report.removed.is_empty());
        assert_eq!(active(&state), ["lives in: Berlin"]);
    }

    #[test]
    fn reapplying_is_a_no_op() {
        let mut state = MemoryState::new();
        apply_diff(&mut state, &diff(&["a: 1", "b: 2"], &[], &[]), None);
        let change = diff(&["c: 3", "a: 9"], &["b: 5"], &["a", "b: 2"]);
        apply_diff(&mut state, &change, None);
        let once = state.clone();
        apply_diff(&mut state, &change, None);
        assert_eq!(state.facts, once.facts);
        assert_eq!(state.facts_version, once.facts_version);
    }

    #[test]
    fn removed_fact_is_revived_not_duplicated() {
        let mut state = MemoryState::new();
        apply_diff(&mut state, &diff(&["job: nurse"], &[], &[]), None);
        apply_diff(&mut state, &diff(&[], &[], &["job"]), None);
        assert!(active(&state).is_empty());
        apply_diff(&mut state, &diff(&["job: teacher"], &[], &[]), None);
        assert_eq!(state.facts.len(), 1);
        assert_eq!(active(&state), ["job: teacher"]);
        assert_eq!(state.facts[0].history.len(), 1);
        assert_eq!(state.facts[0].version, 3);
    }

    #[test]
    fn categories_are_inferred_for_plain_strings() {
        assert_eq!(
            infer_category("allergic to peanuts", ""),
            FactCategory::HardConstraint
        );
        assert_eq!(
            infer_category("Never schedule calls on Friday", ""),
            FactCategory::HardConstraint
        );
        assert_eq!(infer_category("likes jazz", ""), FactCategory::General);
    }

    #[test]
    fn ungrounded_entries_are_dropped() {
        let mut change = diff(
            &["lives in: Berlin", "owns a yacht", "ok"],
            &["job: pilot"],
            &["x"],
        );
        let dropped = retain_grounded(&mut change, "I just moved to Berlin, I work as a nurse");
        assert_eq!(change.add, [FactEdit::new("lives in: Berlin")]);
        assert!(change.update.is_empty());
        assert_eq!(change.remove.len(), 1);
        assert_eq!(dropped, ["owns a yacht", "ok", "job: pilot"]);
    }
}
