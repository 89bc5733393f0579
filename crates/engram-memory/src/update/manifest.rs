//! Episode manifests (seed 000's OLD tier): topic, date range, a ≤256-character summary,
//! salience tags, links into the raw log, rehydration hints and a size estimate, computed from
//! the episode's turns. Pure functions of the state, so a refresh rebuilds them exactly.

use std::cell::RefCell;
use std::collections::{BTreeMap, HashSet};
use std::rc::Rc;

use crate::lookups::match_terms;
use crate::memo::{TextMemo, memoised};
use crate::model::{EpisodeId, EpisodeManifest, FactId, MemoryState, TurnSeq};
use crate::render::recount_episode;
use crate::text::{TermSet, clip_chars, is_stop_word, stem, words};
use crate::tokens::Encoding;

pub const SUMMARY_CHARS: usize = 256;
const TAGS: usize = 8;
const ENTITY_HINTS: usize = 4;

/// Builds the manifest of episode `id` over `links` (its turns, any order).
pub fn build_manifest(
    state: &MemoryState,
    id: EpisodeId,
    session: u32,
    links: &[TurnSeq],
    rehydrated_at: Vec<TurnSeq>,
) -> EpisodeManifest {
    let mut links = links.to_vec();
    links.sort_unstable();
    links.dedup();

    // Each turn's words first, so the counts below borrow their strings instead of copying
    // every salient word of the episode on every rebuild.
    let mut turns = Vec::with_capacity(links.len());
    let mut summaries = Vec::new();
    let mut size = 0u32;
    for seq in &links {
        let Some(entry) = state.turn_log.get(*seq as usize) else {
            continue;
        };
        let raw = state.raw_turns.get(*seq as usize);
        let (user_summary, assistant_summary) = entry.texts(raw);
        let raw_user = raw.map_or("", |turn| &*turn.user);
        turns.push(turn_words(&user_summary, &assistant_summary, raw_user));
        summaries.push(user_summary.into_owned());
        if let Some(turn) = raw {
            size = size
                .saturating_add(turn.tokens.user.get(Encoding::O200k))
                .saturating_add(turn.tokens.assistant.get(Encoding::O200k));
        }
    }
    // Salient terms: stem -> (count, first position, first surface form).
    let mut counts: BTreeMap<&str, (u32, usize, &str)> = BTreeMap::new();
    let mut position = 0usize;
    let mut entities: BTreeMap<&str, (u32, usize)> = BTreeMap::new();
    for turn_words in &turns {
        for (offset, term, word) in &turn_words.salient {
            let slot = counts
                .entry(term.as_str())
                .or_insert((0, position + offset, word.as_str()));
            slot.0 += 1;
        }
        position += turn_words.count;
        for entity in &turn_words.entities {
            let slot = entities.entry(entity.as_str()).or_insert((0, position));
            slot.0 += 1;
        }
    }
    let mut ranked: Vec<(u32, usize, &str)> = counts.into_values().collect();
    ranked.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
    let salience_tags: Vec<String> = ranked
        .into_iter()
        .take(TAGS)
        .map(|(_, _, word)| word.to_owned())
        .collect();
    let topic = salience_tags
        .iter()
        .take(3)
        .cloned()
        .collect::<Vec<_>>()
        .join(", ");

    let mut ranked_entities: Vec<(&str, u32, usize)> = entities
        .into_iter()
        .map(|(entity, (count, first))| (entity, count, first))
        .collect();
    ranked_entities.sort_by(|a, b| b.1.cmp(&a.1).then(a.2.cmp(&b.2)));
    let mut rehydration_hints: Vec<String> = Vec::new();
    for (entity, _, _) in ranked_entities.into_iter().take(ENTITY_HINTS) {
        push_unique(&mut rehydration_hints, entity.to_owned());
    }
    for tag in salience_tags
        .iter()
        .take(TAGS - rehydration_hints.len().min(TAGS))
    {
        if rehydration_hints.len() >= 6 {
            break;
        }
        push_unique(&mut rehydration_hints, tag.clone());
    }

    let first = links.first().and_then(|seq| state.turn_date(*seq));
    let last = links.last().and_then(|seq| state.turn_date(*seq));
    let facts = episode_facts(state, &links);

    let mut manifest = EpisodeManifest {
        id,
        session,
        topic,
        date_range: (first, last),
        summary: clip_chars(&summaries.join("; "), SUMMARY_CHARS),
        salience_tags: salience_tags.iter().collect(),
        links,
        facts,
        rehydration_hints: rehydration_hints.iter().collect(),
        size_estimate_tokens: size,
        rehydrated_at,
        tokens: Default::default(),
        erased: false,
    };
    recount_episode(&mut manifest);
    manifest
}

/// What one turn lends its episode's manifest: its salient words (1-based position among the
/// turn's words, stem, surface form), how many words it has, and its capitalised names.
struct TurnWords {
    salient: Vec<(usize, String, String)>,
    count: usize,
    entities: Vec<String>,
}

thread_local! {
    static TURN_WORDS: RefCell<TextMemo<TurnWords>> = RefCell::default();
}

/// The [`TurnWords`] of a turn, remembered per thread: an episode's manifest is rebuilt from
/// all its turns each time one joins or changes.
fn turn_words(user_summary: &str, assistant_summary: &str, raw_user: &str) -> Rc<TurnWords> {
    // The raw message's length first, so the key names each part unambiguously.
    let key = format!(
        "{}:{raw_user}{user_summary} {assistant_summary}",
        raw_user.len()
    );
    memoised(&TURN_WORDS, &key, || {
        let text = format!("{user_summary} {assistant_summary} {raw_user}");
        let mut salient = Vec::new();
        let mut count = 0;
        for word in words(&text) {
            count += 1;
            if word.len() < 3 || is_stop_word(&word) || word.chars().all(|c| c.is_ascii_digit()) {
                continue;
            }
            salient.push((count, stem(&word), word));
        }
        TurnWords {
            salient,
            count,
            entities: capitalised_words(raw_user),
        }
    })
}

/// The active facts whose provenance names one of `links` (sorted and distinct), as a
/// manifest lists them.
pub fn episode_facts(state: &MemoryState, links: &[TurnSeq]) -> Vec<FactId> {
    // Through the lookups when they are built (the caller brought them up to date), so a
    // rebuild costs the episode's size, not the memory's.
    if state.lookups.is_built() {
        state
            .lookups
            .facts_of_turns(state, links)
            .into_iter()
            .filter(|id| state.fact(*id).is_some_and(|fact| fact.active))
            .collect()
    } else {
        let link_set: HashSet<TurnSeq> = links.iter().copied().collect();
        state
            .facts
            .iter()
            .filter(|fact| fact.active && fact.provenance.iter().any(|seq| link_set.contains(seq)))
            .map(|fact| fact.id)
            .collect()
    }
}

fn push_unique(list: &mut Vec<String>, item: String) {
    if !list
        .iter()
        .any(|existing| existing.eq_ignore_ascii_case(&item))
    {
        list.push(item);
    }
}

/// Capitalised words that do not start a sentence: names of people, places, products.
fn capitalised_words(text: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut sentence_start = true;
    for raw in text.split_whitespace() {
        let word = raw.trim_matches(|c: char| !c.is_alphanumeric());
        let upper = word.chars().next().is_some_and(char::is_uppercase);
        if upper
            && !sentence_start
            && word.len() > 1
            && word != "I"
            && !is_stop_word(&word.to_lowercase())
        {
            out.push(word.to_string());
        }
        sentence_start = raw.ends_with(['.', '!', '?']);
    }
    out
}

thread_local! {
    static MATCH_TERMS: RefCell<TextMemo<TermSet>> = RefCell::default();
}

/// [`match_terms`], remembered per thread: each turn weighs the same candidate episodes for
/// rehydration.
pub fn remembered_match_terms(manifest: &EpisodeManifest) -> Rc<TermSet> {
    // The terms are those of every tag and hint together, and a newline separates terms
    // anyway: however the key splits into tags and hints, it names one answer.
    let key = format!(
        "{}\n\n{}",
        manifest.salience_tags.as_lines(),
        manifest.rehydration_hints.as_lines()
    );
    memoised(&MATCH_TERMS, &key, || match_terms(manifest))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Tier;
    use crate::model::test_support::push_turn;

    /// OLD turns dated a day apart from 2024-03-01.
    fn state_with(turns: &[(&str, &str)]) -> MemoryState {
        let mut state = MemoryState::new();
        for (user, summary) in turns {
            let seq = push_turn(&mut state, user, summary, Tier::Old);
            if let Some(turn) = state.raw_turns.get_mut(seq as usize) {
                turn.event_time = Some(format!("2024-03-0{}T10:00:00Z", seq + 1).into());
            }
        }
        state
    }

    #[test]
    fn manifest_summarises_its_turns() {
        let state = state_with(&[
            (
                "My sourdough starter from Lyon smells odd",
                "Sourdough starter smells of acetone",
            ),
            (
                "Should I feed the sourdough starter rye?",
                "Asked about rye flour for the starter",
            ),
            (
                "The sourdough loaf was flat",
                "Sourdough loaf came out flat",
            ),
        ]);
        let manifest = build_manifest(&state, 0, 0, &[2, 0, 1], vec![]);
        assert_eq!(manifest.links, [0, 1, 2]);
        assert_eq!(manifest.salience_tags.first(), Some("sourdough"));
        assert!(
            manifest.topic.starts_with("sourdough, starter"),
            "{}",
            manifest.topic
        );
        assert_eq!(
            manifest.date_range,
            (Some("2024-03-01".into()), Some("2024-03-03".into()))
        );
        assert!(manifest.summary.chars().count() <= SUMMARY_CHARS);
        assert!(manifest.rehydration_hints.contains("Lyon"));
        assert!(match_terms(&manifest).contains(&stem("sourdough")));
        assert!(manifest.tokens.0 > 0);
    }

    #[test]
    fn long_summaries_are_clipped_to_256_chars() {
        let long = "word ".repeat(80);
        let state = state_with(&[("a", &long), ("b", &long)]);
        let manifest = build_manifest(&state, 0, 0, &[0, 1], vec![]);
        assert!(manifest.summary.chars().count() <= SUMMARY_CHARS);
    }
}
