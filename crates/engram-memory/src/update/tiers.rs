//! Tier maintenance after each recorded turn (seed 000, 002): items the conversation touches
//! are refreshed; NEW items older than the TTL are demoted to CURRENT; CURRENT is packed by score
//! into the working-set capacity and what falls out is demoted to OLD and folded into an episode
//! manifest; an OLD episode the conversation returns to is rehydrated into NEW. Demotion never
//! deletes anything: items keep their text and provenance, manifests keep their links.

use std::collections::{BTreeSet, HashSet};
use std::sync::Arc;

use rustc_hash::FxBuildHasher;
use serde::{Deserialize, Serialize};

use super::manifest::{build_manifest, episode_facts, remembered_match_terms};
use crate::config::MemoryConfig;
use crate::lookups::term_hash;
use crate::model::{
    EpisodeId, EpisodeManifest, FactId, ItemRef, MemoryState, Tier, TierState, TurnSeq,
};
use crate::score::{fact_score, summary_score};
use crate::text::{TermSet, remembered_terms};
use crate::tokens::Encoding;
use crate::yielding;

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TierReport {
    /// Items the exchange came back to (frequency and recency refreshed).
    pub touched: Vec<ItemRef>,
    pub demoted_to_current: Vec<ItemRef>,
    pub demoted_to_old: Vec<ItemRef>,
    pub episodes_created: Vec<EpisodeId>,
    pub episodes_extended: Vec<EpisodeId>,
    pub rehydrated: Vec<EpisodeId>,
}

/// Items one message refreshes at most. A backend that sends all its traffic under one identity
/// repeats itself, so a message can relate to most of the working set (about 100 summaries at
/// the default 1,024 tokens), and every touched item is rewritten in the store and re-read by
/// each cached copy: measured at 1,000 turns of such a user, 100 turn-log entries and 14 KB a
/// job. The closest ones keep the refresh.
const MAX_TOUCHED: usize = 32;

/// Refreshes active (NEW/CURRENT) facts and summaries the user's message comes back to: they
/// share at least two of its terms (all, for a one-term item) and at least 30 % of their own.
/// Items created by the exchange itself (`turn`) are skipped. At most `MAX_TOUCHED`, those
/// sharing the largest share of their terms (ties: the most recent, by a summary's turn or a
/// fact's last touch).
pub fn touch_related(state: &mut MemoryState, user_terms: &TermSet, turn: TurnSeq) -> Vec<ItemRef> {
    let user_terms: HashSet<u64, FxBuildHasher> =
        user_terms.iter().map(|term| term_hash(term)).collect();
    // The share of an item's terms the message has, when it counts as related.
    let related = |item_terms: &[u64]| {
        let shared = item_terms
            .iter()
            .filter(|term| user_terms.contains(*term))
            .count();
        let share = shared as f32 / item_terms.len().max(1) as f32;
        (!item_terms.is_empty() && shared >= item_terms.len().min(2) && share >= 0.3)
            .then_some(share)
    };
    // The working set only: OLD items are never touched (an episode's rehydration brings them
    // back), so a turn's cost does not grow with the history. Each item's terms are kept in
    // the lookups from turn to turn (`MemoryState::item_terms`).
    state.sync_lookups();
    let mut related_items: Vec<(f32, ItemRef)> = Vec::new();
    let facts: Vec<FactId> = state.lookups.working_facts().iter().copied().collect();
    for id in facts {
        yielding::checkpoint();
        let candidate = state.fact(id).is_some_and(|fact| {
            fact.active
                && !matches!(fact.tier.tier, Tier::Old)
                && fact.tier.last_touched_turn != turn
        });
        let item = ItemRef::Fact(id);
        if candidate && let Some(share) = state.item_terms(item).and_then(|terms| related(&terms)) {
            related_items.push((share, item));
        }
    }
    let summaries: Vec<TurnSeq> = state.lookups.working_summaries().iter().copied().collect();
    for seq in summaries {
        yielding::checkpoint();
        let candidate = state
            .turn_log
            .get(seq as usize)
            .is_some_and(|entry| !matches!(entry.tier.tier, Tier::Old) && entry.turn != turn);
        let item = ItemRef::Summary(seq);
        if candidate && let Some(share) = state.item_terms(item).and_then(|terms| related(&terms)) {
            related_items.push((share, item));
        }
    }
    let newest = |item: &ItemRef| match item {
        ItemRef::Fact(id) => state
            .fact(*id)
            .map_or(0, |fact| fact.tier.last_touched_turn),
        ItemRef::Summary(seq) => *seq,
        _ => 0,
    };
    related_items.sort_by(|a, b| {
        b.0.total_cmp(&a.0)
            .then_with(|| newest(&b.1).cmp(&newest(&a.1)))
            .then(a.1.cmp(&b.1))
    });
    related_items.truncate(MAX_TOUCHED);
    let mut touched = Vec::with_capacity(related_items.len());
    for (_, item) in related_items {
        match item {
            ItemRef::Fact(id) => {
                if let Some(fact) = state.facts.get_mut(id as usize) {
                    fact.tier.last_touched_turn = turn;
                    fact.tier.frequency += 1;
                    touched.push(ItemRef::Fact(fact.id));
                }
            }
            ItemRef::Summary(seq) => {
                if let Some(entry) = state.turn_log.get_mut(seq as usize) {
                    entry.tier.last_touched_turn = turn;
                    entry.tier.frequency += 1;
                    touched.push(ItemRef::Summary(entry.turn));
                }
            }
            _ => {}
        }
    }
    // Facts, then summaries, each ascending, as they were found.
    touched.sort_unstable();
    touched
}

/// The rehydrations an episode lists: its newest. An episode a user keeps coming back to is
/// rewritten at each return, so an unbounded list made that write grow with the history (one
/// repetitive user's episodes gained about one entry per ten turns each).
pub const REHYDRATIONS_KEPT: usize = 16;

/// Brings back the OLD episodes the new user message returns to: their turn summaries and
/// facts re-enter NEW. At most `MAX_REHYDRATED` per turn, those sharing the most salient terms.
pub fn rehydrate(
    state: &mut MemoryState,
    user_terms: &TermSet,
    turn: TurnSeq,
    config: &MemoryConfig,
) -> Vec<EpisodeId> {
    const MAX_REHYDRATED: usize = 3;
    let mut matching: Vec<(usize, EpisodeId)> = Vec::new();
    if config.episodes.rehydrate_min_matches == 0 {
        for episode in &state.episodes {
            if dormant(state, episode.id).is_some() {
                let matches = remembered_match_terms(episode)
                    .intersection(user_terms)
                    .count();
                matching.push((matches, episode.id));
            }
        }
    } else {
        // Candidates from the term lists, best (bound, id) first: once three episodes are
        // found, one whose bound is below the third's count cannot place, nor one whose bound
        // equals it with a lower id (it would lose the tie), and every later candidate ranks
        // lower still. So the walk stops there rather than going through every episode that
        // shares a word with the message: with a small vocabulary (a backend's templated
        // prompts) that was every episode of the newest lists, thousands per turn.
        state.sync_lookups();
        let candidates = state
            .lookups
            .episodes_with_terms(user_terms.iter(), config.episodes.rehydrate_min_matches);
        for (bound, id) in candidates {
            if matching.len() >= MAX_REHYDRATED {
                matching.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
                matching.truncate(MAX_REHYDRATED);
                if matching.last().is_some_and(|third| (bound, id) < *third) {
                    break;
                }
            }
            let Some(episode) = dormant(state, id) else {
                continue;
            };
            let matches = remembered_match_terms(episode)
                .intersection(user_terms)
                .count();
            if matches >= config.episodes.rehydrate_min_matches {
                matching.push((matches, episode.id));
            }
        }
    }
    matching.sort_by(|a, b| b.0.cmp(&a.0).then(b.1.cmp(&a.1)));
    matching.truncate(MAX_REHYDRATED);
    let mut rehydrated = Vec::new();
    for (_, id) in matching {
        let Some(episode) = state.episode_mut(id) else {
            continue;
        };
        episode.rehydrated_at.push(turn);
        let over = episode
            .rehydrated_at
            .len()
            .saturating_sub(REHYDRATIONS_KEPT);
        episode.rehydrated_at.drain(..over);
        let links = episode.links.clone();
        let facts = episode.facts.clone();
        let revive = |tier: &mut TierState| {
            *tier = TierState {
                frequency: tier.frequency + 1,
                ..TierState::fresh(turn)
            };
        };
        for seq in links {
            if let Some(entry) = state.turn_log.get_mut(seq as usize) {
                revive(&mut entry.tier);
            }
        }
        for fact_id in facts {
            // Looked at before it is taken for changing: that copies its chunk of 64 facts when
            // the published memory shares it, and marks the fact for the store's write.
            let revives = state
                .facts
                .get(fact_id as usize)
                .is_some_and(|fact| fact.active && fact.tier.tier == Tier::Old);
            if revives && let Some(fact) = state.facts.get_mut(fact_id as usize) {
                revive(&mut fact.tier);
            }
        }
        rehydrated.push(id);
    }
    if !rehydrated.is_empty() {
        state.episodes_version += 1;
    }
    rehydrated.sort_unstable();
    rehydrated
}

/// The episode, if any of its turns is in OLD (it can be rehydrated).
fn dormant(state: &MemoryState, id: EpisodeId) -> Option<&EpisodeManifest> {
    state.episode(id).filter(|episode| {
        episode.links.iter().any(|seq| {
            state
                .turn_log
                .get(*seq as usize)
                .is_some_and(|entry| entry.tier.tier == Tier::Old)
        })
    })
}

/// Ages NEW into CURRENT; demotes to OLD the turn summaries the conversation has not come back
/// to within the CURRENT TTL and whatever does not fit the working-set capacity by score; folds
/// demoted turn summaries into episodes.
pub fn maintain(state: &mut MemoryState, config: &MemoryConfig, report: &mut TierReport) {
    let now = state.now();
    let ttl = config.new_ttl_turns;
    // Only the working set can age or be packed: OLD items stay where they are.
    state.sync_lookups();
    let facts: Vec<FactId> = state.lookups.working_facts().iter().copied().collect();
    let summaries: Vec<TurnSeq> = state.lookups.working_summaries().iter().copied().collect();
    for id in &facts {
        let ages = state.fact(*id).is_some_and(|fact| {
            fact.active
                && fact.tier.tier == Tier::New
                && now.saturating_sub(fact.tier.since_turn) >= ttl
        });
        if ages && let Some(fact) = state.facts.get_mut(*id as usize) {
            fact.tier.tier = Tier::Current;
            fact.tier.since_turn = now;
            report.demoted_to_current.push(ItemRef::Fact(fact.id));
        }
    }
    for seq in &summaries {
        let ages = state.turn_log.get(*seq as usize).is_some_and(|entry| {
            entry.tier.tier == Tier::New && now.saturating_sub(entry.tier.since_turn) >= ttl
        });
        if ages && let Some(entry) = state.turn_log.get_mut(*seq as usize) {
            entry.tier.tier = Tier::Current;
            entry.tier.since_turn = now;
            report.demoted_to_current.push(ItemRef::Summary(entry.turn));
        }
    }

    // Pack CURRENT by score. Hard constraints are never demoted (they are always injected).
    let mut working: Vec<(f32, u32, ItemRef)> = Vec::new();
    for id in &facts {
        let Some(fact) = state.fact(*id) else {
            continue;
        };
        if fact.active && fact.tier.tier == Tier::Current && !fact.is_hard_constraint() {
            let score = fact_score(state, &config.weights, *id as usize);
            working.push((
                score,
                fact.tokens.get(Encoding::O200k),
                ItemRef::Fact(fact.id),
            ));
        }
    }
    let mut expired = Vec::new();
    for seq in &summaries {
        let Some(entry) = state.turn_log.get(*seq as usize) else {
            continue;
        };
        if entry.tier.tier != Tier::Current {
            continue;
        }
        if now.saturating_sub(entry.tier.last_touched_turn) > config.current_ttl_turns {
            expired.push(ItemRef::Summary(entry.turn));
        } else {
            let score = summary_score(state, &config.weights, entry);
            working.push((
                score,
                entry.tokens.get(Encoding::O200k),
                ItemRef::Summary(entry.turn),
            ));
        }
    }
    working.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.2.cmp(&b.2)));
    let mut used = 0u32;
    let mut evicted = expired;
    for (_, tokens, item) in working {
        if used.saturating_add(tokens) <= config.working_set_tokens {
            used += tokens;
        } else {
            evicted.push(item);
        }
    }
    evicted.sort();
    let mut evicted_turns = Vec::new();
    for item in &evicted {
        match *item {
            ItemRef::Fact(id) => {
                if let Some(fact) = state.facts.get_mut(id as usize) {
                    fact.tier.tier = Tier::Old;
                    fact.tier.since_turn = now;
                }
            }
            ItemRef::Summary(seq) => {
                if let Some(entry) = state.turn_log.get_mut(seq as usize) {
                    entry.tier.tier = Tier::Old;
                    entry.tier.since_turn = now;
                    evicted_turns.push(seq);
                }
            }
            _ => {}
        }
    }
    report.demoted_to_old.extend(evicted);
    fold_into_episodes(state, &evicted_turns, config, report);
}

/// Puts each demoted turn into an episode: back into its own if it was rehydrated from one,
/// else into its session's latest episode when it continues it (close in turns, on topic, not
/// full), else into a new episode. An episode a turn joins is rebuilt; one a rehydrated turn
/// returns to has only its facts list refreshed (nothing else of it can have changed).
fn fold_into_episodes(
    state: &mut MemoryState,
    turns: &[TurnSeq],
    config: &MemoryConfig,
    report: &mut TierReport,
) {
    let mut dirty: BTreeSet<EpisodeId> = BTreeSet::new();
    for seq in turns {
        let Some(entry) = state.turn_log.get(*seq as usize) else {
            continue;
        };
        if let Some(id) = entry.episode {
            dirty.insert(id);
            continue;
        }
        let session = state
            .raw_turns
            .get(*seq as usize)
            .map_or(0, |turn| turn.session);
        let (user, assistant) = entry.texts(state.raw_turns.get(*seq as usize));
        // Distinct already: its length is its set's size.
        let entry_terms = remembered_terms(&format!("{user} {assistant}"));
        let open = state
            .episodes
            .iter()
            .rev()
            .find(|episode| episode.session == session && !episode.erased);
        let joins = open.filter(|episode| {
            let last = episode.links.last().copied().unwrap_or(0);
            let close = *seq > last && seq - last <= config.episodes.max_gap_turns;
            let room = episode.links.len() < config.episodes.max_turns;
            let on_topic = episode.links.len() < 3 || {
                let episode_terms = episode_terms(state, &episode.links);
                let shared = entry_terms
                    .iter()
                    .filter(|term| episode_terms.contains(term.as_str()))
                    .count();
                !entry_terms.is_empty()
                    && shared as f32 / entry_terms.len() as f32 >= config.episodes.min_topic_overlap
            };
            close && room && on_topic
        });
        let id = match joins {
            Some(episode) => {
                let id = episode.id;
                if !report.episodes_created.contains(&id) && !report.episodes_extended.contains(&id)
                {
                    report.episodes_extended.push(id);
                }
                id
            }
            None => {
                let id = EpisodeId::try_from(state.episodes.len()).unwrap_or(EpisodeId::MAX);
                state.episodes.push(Arc::new(build_manifest(
                    state,
                    id,
                    session,
                    &[],
                    Vec::new(),
                )));
                report.episodes_created.push(id);
                id
            }
        };
        if let Some(episode) = state.episode_mut(id) {
            episode.links.push(*seq);
        }
        if let Some(entry) = state.turn_log.get_mut(*seq as usize) {
            entry.episode = Some(id);
        }
        // Rebuild now so the next turn's topic check sees this one's terms.
        refresh_episode(state, id);
        dirty.remove(&id);
    }
    // A turn that comes back to its own episode (after a rehydration) leaves the episode's
    // links and their texts as they were: a summary is written when its turn is recorded and
    // otherwise only erased, which rebuilds its episode there. So only the episode's list of
    // facts can have moved since its last rebuild. Rebuilding whole was most of the worker's
    // manifest time: in 3,000 turns of the history benchmark, 12,584 such rebuilds gave 12,579
    // identical manifests, and the other 5 differed in their facts alone.
    for id in dirty {
        refresh_episode_facts(state, id);
        // Checked in debug builds (the whole test suite): the list is all that was stale.
        if cfg!(debug_assertions)
            && let Some(rebuilt) = rebuilt_manifest(state, id)
        {
            debug_assert_eq!(
                state.episodes.get(id as usize).map(|episode| &**episode),
                Some(&rebuilt),
                "episode {id}: a returning turn changed more than its facts"
            );
        }
    }
    if !turns.is_empty() {
        state.episodes_version += 1;
    }
}

/// Terms of an episode's turn summaries (broader than its tags, for the topic check).
fn episode_terms(state: &MemoryState, links: &[TurnSeq]) -> TermSet {
    let mut terms = TermSet::default();
    for seq in links {
        let (user, assistant) = state.summary_texts(*seq);
        terms.extend(
            remembered_terms(&format!("{user} {assistant}"))
                .iter()
                .cloned(),
        );
    }
    terms
}

/// Brings an episode's list of facts up to date (after facts of its turns changed); the rest
/// of a manifest comes from its turns' text, which a fact change leaves as it was.
pub fn refresh_episode_facts(state: &mut MemoryState, id: EpisodeId) {
    state.sync_lookups();
    let Some(episode) = state.episodes.get(id as usize).filter(|e| !e.erased) else {
        return;
    };
    let facts = episode_facts(state, &episode.links);
    // Unchanged lists leave the episode unwritten.
    if facts != episode.facts
        && let Some(slot) = state.episode_mut(id)
    {
        slot.facts = facts;
    }
}

/// Rebuilds an episode's manifest from its links.
pub fn refresh_episode(state: &mut MemoryState, id: EpisodeId) {
    // A deleted episode stays empty.
    state.sync_lookups();
    let Some(rebuilt) = rebuilt_manifest(state, id) else {
        return;
    };
    // Replaced, not changed in place: the old manifest is not copied first.
    if let Some(slot) = state.episodes.get_mut(id as usize) {
        *slot = Arc::new(rebuilt);
    }
}

/// Episode `id`'s manifest built afresh from its links (the lookups up to date); `None` for a
/// deleted or unknown episode.
fn rebuilt_manifest(state: &MemoryState, id: EpisodeId) -> Option<EpisodeManifest> {
    let episode = state.episodes.get(id as usize).filter(|e| !e.erased)?;
    Some(build_manifest(
        state,
        id,
        episode.session,
        &episode.links,
        episode.rehydrated_at.clone(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::lookups::match_terms;
    use crate::model::test_support::push_turn;
    use crate::text::terms;

    /// OLD turns, two per episode, every episode about the same few words (a templated
    /// backend's prompts) and some with one or two words more.
    fn state_with_episodes(episodes: u32) -> MemoryState {
        let mut state = MemoryState::new();
        for seq in 0..episodes * 2 {
            let episode = seq / 2;
            let extra = match episode % 7 {
                0 => " Lisbon",
                3 => " Lisbon Porto",
                _ => "",
            };
            let user = format!("the sourdough starter recipe from the bakery{extra}");
            push_turn(&mut state, &user, &user, Tier::Old);
            if let Some(entry) = state.turn_log.get_mut(seq as usize) {
                entry.episode = Some(episode);
            }
        }
        for episode in 0..episodes {
            let links = [episode * 2, episode * 2 + 1];
            let manifest = build_manifest(&state, episode, 0, &links, vec![]);
            state.episodes.push(Arc::new(manifest));
        }
        state
    }

    /// A message related to more of the working set than the bound touches the closest: the
    /// summaries sharing the largest share of their terms, then the newest of the rest.
    #[test]
    fn a_message_touches_at_most_the_bound_closest_items() {
        const SHORT: TurnSeq = 20;
        let mut state = MemoryState::new();
        let words = ["kiwi", "mango", "papaya", "lychee", "guava", "quince"];
        for seq in 0..40 {
            // The first 20 name one word besides the two the message has, the rest three.
            let extra = if seq < SHORT {
                words[seq as usize % 6].to_owned()
            } else {
                format!("{} {} {}", words[0], words[1], words[2 + seq as usize % 4])
            };
            let summary = format!("sourdough starter {extra}");
            push_turn(&mut state, &summary, &summary, Tier::Current);
        }
        let user_terms: TermSet = terms("how is my sourdough starter doing").collect();
        let mut touched = touch_related(&mut state, &user_terms, 40);
        assert_eq!(touched.len(), MAX_TOUCHED);
        touched.retain(|item| matches!(item, ItemRef::Summary(seq) if *seq >= SHORT));
        // All 20 of the closer ones, and the 12 newest of the others.
        let expected: Vec<ItemRef> = (28..40).map(ItemRef::Summary).collect();
        assert_eq!(touched, expected);
        for seq in 0..40 {
            let entry = state.turn_log.get(seq as usize).expect("entry");
            let refreshed = !(SHORT..28).contains(&seq);
            assert_eq!(
                entry.tier.last_touched_turn == 40,
                refreshed,
                "summary {seq}"
            );
        }
    }

    #[test]
    fn rehydration_picks_the_best_three_however_many_episodes_tie() {
        let config = MemoryConfig::default();
        let message =
            "any news on the sourdough starter recipe from the bakery in Lisbon or Porto?";
        let user_terms: TermSet = terms(message).collect();
        for episodes in [3, 10, 40, 300] {
            let mut state = state_with_episodes(episodes);
            // The reference: every dormant episode's matches, best (count, id) first.
            let mut expected: Vec<(usize, EpisodeId)> = (0..episodes)
                .filter_map(|id| {
                    let matches = match_terms(state.episode(id)?)
                        .intersection(&user_terms)
                        .count();
                    (matches >= config.episodes.rehydrate_min_matches).then_some((matches, id))
                })
                .collect();
            expected.sort_by(|a, b| b.cmp(a));
            let mut expected: Vec<EpisodeId> = expected.iter().take(3).map(|(_, id)| *id).collect();
            expected.sort_unstable();
            let turn = episodes * 2;
            let rehydrated = rehydrate(&mut state, &user_terms, turn, &config);
            assert_eq!(rehydrated, expected, "{episodes} episodes");
            // Past ten episodes, the winners are the newest of those naming both cities.
            if episodes > 10 {
                assert!(rehydrated.iter().all(|id| id % 7 == 3), "{rehydrated:?}");
            }
            for id in rehydrated {
                let episode = state.episode(id).expect("rehydrated episode");
                assert_eq!(episode.rehydrated_at, [turn]);
            }
        }
    }

    /// A rehydrated episode revives its OLD facts and leaves the others as they were: not
    /// copied, not marked for the store's write.
    #[test]
    fn rehydration_changes_only_the_facts_it_revives() {
        let config = MemoryConfig::default();
        let user_terms: TermSet = terms("the sourdough starter recipe from the bakery").collect();
        let mut state = state_with_episodes(1);
        // Fact 0 OLD, 1 CURRENT, 2 OLD but retired; the episode lists all three.
        for (id, tier, active) in [
            (0, Tier::Old, true),
            (1, Tier::Current, true),
            (2, Tier::Old, false),
        ] {
            state.facts.push(crate::model::Fact {
                id,
                key: format!("fact {id}"),
                value: "value".into(),
                category: crate::model::FactCategory::General,
                importance: 0.5,
                version: 1,
                provenance: Vec::new(),
                date: None,
                history: Vec::new(),
                active,
                tier: TierState {
                    tier,
                    ..TierState::fresh(0)
                },
                tokens: Default::default(),
            });
        }
        if let Some(episode) = state.episode_mut(0) {
            episode.facts = vec![0, 1, 2];
        }
        state.facts.take_dirty();
        assert_eq!(rehydrate(&mut state, &user_terms, 9, &config), [0]);
        assert_eq!(state.facts.take_dirty(), [0]);
        let tiers: Vec<(Tier, TurnSeq)> = (0..3)
            .filter_map(|id| {
                state
                    .fact(id)
                    .map(|fact| (fact.tier.tier, fact.tier.last_touched_turn))
            })
            .collect();
        assert_eq!(tiers, [(Tier::New, 9), (Tier::Current, 0), (Tier::Old, 0)]);
    }

    #[test]
    fn an_episode_lists_its_newest_rehydrations_only() {
        let config = MemoryConfig::default();
        let user_terms: TermSet = terms("the sourdough starter recipe from the bakery").collect();
        let mut state = state_with_episodes(1);
        let returns: Vec<TurnSeq> = (0..40).map(|at| 10 + at * 3).collect();
        for turn in &returns {
            // Dormant again since the last return.
            for seq in 0..2 {
                if let Some(entry) = state.turn_log.get_mut(seq) {
                    entry.tier.tier = Tier::Old;
                }
            }
            assert_eq!(rehydrate(&mut state, &user_terms, *turn, &config), [0]);
        }
        let episode = state.episode(0).expect("episode");
        assert_eq!(
            episode.rehydrated_at,
            returns[returns.len() - REHYDRATIONS_KEPT..]
        );
    }
}
