//! The heuristic extractor's tables as data: its word lists and trigger phrases live in
//! `patterns.json` beside this file, compiled in and parsed once, so they can be reviewed and
//! extended without reading the code that applies them. Each table says in its `about` what
//! it is for.
//!
//! The file is part of the build, not of the input: only a change to it can break it, and the
//! tests below parse it, so a malformed file fails the suite. Should one ship anyway, the
//! extractor logs the error once and runs with empty tables (no facts, summaries still made)
//! rather than failing the exchange; `crate::warm_up` parses the file at start-up, so the
//! error shows then rather than at the first exchange.

use std::ops::Deref;
use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde::Deserialize;
use serde::de::IgnoredAny;

/// The tables, parsed on first use.
pub fn patterns() -> &'static Patterns {
    &PATTERNS
}

static PATTERNS: LazyLock<Patterns> = LazyLock::new(|| {
    parse().unwrap_or_else(|error| {
        tracing::error!(
            %error,
            "the extractor's patterns.json does not parse: the heuristic extractor finds no facts"
        );
        Patterns::default()
    })
});

const SOURCE: &str = include_str!("patterns.json");

fn parse() -> Result<Patterns, serde_json::Error> {
    serde_json::from_str(SOURCE)
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Patterns {
    #[serde(rename = "about")]
    _about: IgnoredAny,
    pub words: Words,
    pub triggers: Triggers,
    /// A trigger and the relationship status it states.
    pub relationship_statuses: Table<(Phrase, String)>,
}

/// Word lists: what ends a phrase, what a noun may be, what says nothing.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Words {
    pub filler: Table,
    pub boundary: Table,
    pub list_boundary: Table,
    pub plan_boundary: Table,
    pub job_suffixes: Table,
    pub not_jobs: Table,
    pub jobs: Table,
    pub single_relations: Table,
    pub multi_relations: Table,
    pub not_possessions: Table,
    pub event_verbs: Table,
    pub scheduled: Table,
    pub statement_words: Table,
    pub not_allergens: Table,
    pub diets: Table,
    pub due_subject_stops: Table,
    pub not_objects: Table,
    pub counts: Table,
    pub counted: Table,
    pub not_plans: Table,
}

/// Trigger phrases, each introducing one kind of fact.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Triggers {
    pub name: Table<Phrase>,
    pub called: Table<Phrase>,
    pub age: Table<Phrase>,
    pub moved_from: Table<Phrase>,
    pub lives_in: Table<Phrase>,
    pub from: Table<Phrase>,
    pub works_at: Table<Phrase>,
    pub lost_job: Table<Phrase>,
    pub job: Table<Phrase>,
    pub job_if_noun: Table<Phrase>,
    pub studies: Table<Phrase>,
    pub born: Table<Phrase>,
    pub not_allergic: Table<Phrase>,
    pub cannot_eat: Table<Phrase>,
    pub instruction_openings: Table<Phrase>,
    pub instructions: Table<Phrase>,
    pub do_not: Table<Phrase>,
    pub remember: Table<Phrase>,
    pub likes: Table<Phrase>,
    pub dislikes: Table<Phrase>,
    pub prefers: Table<Phrase>,
    pub favorite: Table<Phrase>,
    pub has_named: Table<Phrase>,
    pub has_count: Table<Phrase>,
    pub owns: Table<Phrase>,
    pub plans: Table<Phrase>,
}

/// A phrase the extractor looks for, with its searcher built once: a sentence is searched for
/// a few hundred phrases, and building a searcher for each search (`memmem::find`) was 7.7 %
/// of recording a turn (`apply_growth`'s profile at 10,000 turns, 2026-12-07).
#[derive(Debug, Clone)]
pub struct Phrase {
    text: String,
    finder: Finder<'static>,
}

impl Phrase {
    pub fn new(text: String) -> Phrase {
        let finder = Finder::new(text.as_bytes()).into_owned();
        Phrase { text, finder }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// The phrase's searcher.
    pub fn finder(&self) -> &Finder<'static> {
        &self.finder
    }
}

impl<'de> Deserialize<'de> for Phrase {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Phrase, D::Error> {
        String::deserialize(deserializer).map(Phrase::new)
    }
}

/// One table: what it is for (`about`, for the reader of the file) and its entries, in the
/// order they are tried.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Table<T = String> {
    #[serde(rename = "about")]
    _about: IgnoredAny,
    entries: Vec<T>,
}

impl<T> Default for Table<T> {
    fn default() -> Self {
        Table {
            _about: IgnoredAny,
            entries: Vec::new(),
        }
    }
}

impl Table {
    /// Whether `word` is one of the entries.
    pub fn has(&self, word: &str) -> bool {
        self.entries.iter().any(|entry| entry == word)
    }
}

impl<T> Deref for Table<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        &self.entries
    }
}

#[cfg(test)]
mod tests {
    use serde_json::Value;

    use super::*;

    #[test]
    fn the_patterns_file_parses() {
        let patterns = parse().unwrap();
        assert!(patterns.words.boundary.has("because"));
        assert_eq!(patterns.triggers.name[0].as_str(), "my name is ");
        assert!(!patterns.relationship_statuses.is_empty());
    }

    /// Entries are lowercase, none is empty, none repeats within its table, and every table
    /// says what it is for.
    #[test]
    fn every_table_is_documented_lowercase_and_without_repeats() {
        let file: Value = serde_json::from_str(SOURCE).unwrap();
        let mut tables = 0;
        for group in ["words", "triggers"] {
            for (name, table) in file[group].as_object().unwrap() {
                tables += 1;
                assert!(
                    table["about"]
                        .as_str()
                        .is_some_and(|about| !about.is_empty()),
                    "{name}"
                );
                let entries: Vec<&str> = table["entries"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|entry| entry.as_str().unwrap())
                    .collect();
                assert!(!entries.is_empty(), "{name}");
                for (at, entry) in entries.iter().enumerate() {
                    assert!(!entry.trim().is_empty(), "{name}: an empty entry");
                    assert_eq!(*entry, entry.to_lowercase(), "{name}: {entry:?}");
                    assert!(!entries[..at].contains(entry), "{name}: {entry:?} twice");
                }
            }
        }
        assert_eq!(tables, 20 + 26);
    }

    #[test]
    fn a_malformed_file_is_an_error_not_a_panic() {
        for broken in [
            "",
            "{",
            r#"{"about": "", "words": {}, "triggers": {}}"#,
            &SOURCE.replace("\"entries\"", "\"entry\""),
        ] {
            assert!(serde_json::from_str::<Patterns>(broken).is_err());
        }
    }
}
