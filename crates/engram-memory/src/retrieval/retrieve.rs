//! Retrieval for the hot path and prefetch for the update path.
//!
//! `retrieve` scores the prefetched candidates against the new message (a re-rank: one postings
//! lookup per term and candidate) and searches every segment of the index. Raw turns are
//! first-class: they are searched directly, their neighbours in the same session are pulled in
//! at a discount, and when the summary tier (facts, turn summaries, manifests) covers too little
//! of the query's term weight, retrieval escalates (seed 003): the raw turns the best summary
//! hits link to are pulled in, and raw hits keep their full weight.

use std::collections::{BTreeMap, HashMap};

use rustc_hash::FxBuildHasher;

use serde::{Deserialize, Serialize};

use super::embed::{self, Vector};
use super::index::{Bm25, MemoryIndex, Segment, SegmentKind, TermId, segment_of};
use crate::config::{RetrievalConfig, RetrievalMode};
use crate::model::{CandidateId, ItemRef, MemoryState, TurnSeq};

/// Why an item was retrieved.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum HitSource {
    /// Found by searching the index for the new message.
    Search,
    /// Prefetched after the previous turn and re-ranked against the new message.
    Prefetch,
    /// A raw turn next to a raw-turn hit in the same session.
    Neighbour,
    /// A raw turn a summary-tier hit links to, pulled in because summaries covered too little.
    Escalation,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Hit {
    pub item: ItemRef,
    /// About `0..1`: BM25 normalised by the query's ceiling, plus the prefetch context bonus.
    pub relevance: f32,
    pub source: HitSource,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Retrieval {
    /// Best first; ties by item (in no particular order from `retrieve_unordered`, for compose).
    pub hits: Vec<Hit>,
    /// Share of the query's term weight found in the top summary-tier hits.
    pub coverage: f32,
    pub escalated: bool,
    /// Distinct query terms, and how many the index knows.
    pub query_terms: usize,
    pub known_terms: usize,
}

/// Bonus a prefetched candidate gets for being part of the recent context, scaled by its
/// prefetch rank (first: full bonus).
const PREFETCH_CONTEXT_BONUS: f32 = 0.1;
/// A linked raw turn inherits this share of its summary hit's relevance.
const ESCALATION_INHERIT: f32 = 0.9;
/// Feedback skips words found in more than one raw turn in this many: they tell little about a
/// topic, and their long postings are most of the second search's cost.
const FEEDBACK_COMMON_DIVISOR: usize = 10;
/// Feedback never skips a word for being common in a memory this small (in documents).
const FEEDBACK_MIN_COMMON: usize = 8;
/// Summary-tier hits whose coverage and links are considered.
const COVERAGE_HITS: usize = 8;
/// A query is searched by at most this many of its known terms, the rarest. A pasted
/// document's excerpt has hundreds, and each term costs a postings walk in every segment
/// (most of compose's 0.2 ms with a 100 KB message), while its commonest words add little to
/// any score. Questions have far fewer.
pub const MAX_QUERY_TERMS: usize = 64;

/// The query is embedded from at most its last this many bytes: a question usually follows
/// whatever was pasted before it, and a 16 KB message would cost the hot path ~0.1 ms more.
const QUERY_EMBED_BYTES: usize = 2048;

fn bm25(config: &RetrievalConfig) -> Bm25 {
    Bm25 {
        k1: config.bm25_k1,
        b: config.bm25_b,
        postings_per_term: config.postings_per_term,
        postings_per_query: config.postings_per_query,
    }
}

/// Each item's best relevance so far and where it came from. A hash map: a request offers a few
/// hundred items (the B-tree's comparisons were a tenth of compose), and the hits are sorted by
/// a total order at the end, so the map's order never shows.
type Best = HashMap<ItemRef, (f32, HitSource), FxBuildHasher>;

/// Items a request or a prefetch usually offers.
const OFFERED: usize = 512;

fn offer(best: &mut Best, item: ItemRef, relevance: f32, source: HitSource) {
    if relevance <= 0.0 {
        return;
    }
    let slot = best.entry(item).or_insert((relevance, source));
    if relevance > slot.0 {
        *slot = (relevance, source);
    }
}

/// Retrieves memory for `query` (the new user message), best hits first.
pub fn retrieve(
    state: &MemoryState,
    index: &MemoryIndex,
    query: &str,
    prefetched: &[CandidateId],
    config: &RetrievalConfig,
) -> Retrieval {
    let mut retrieval = retrieve_unordered(state, index, query, prefetched, config);
    // Items are distinct, so the order is total and an unstable sort gives the same.
    retrieval.hits.sort_unstable_by(|a, b| {
        b.relevance
            .total_cmp(&a.relevance)
            .then(a.item.cmp(&b.item))
    });
    retrieval
}

/// [`retrieve`] with the hits in no particular order, for compose, which ranks them by a score
/// of its own (sorting a few hundred hits twice was a twentieth of compose).
pub(crate) fn retrieve_unordered(
    state: &MemoryState,
    index: &MemoryIndex,
    query: &str,
    prefetched: &[CandidateId],
    config: &RetrievalConfig,
) -> Retrieval {
    let (mut terms, total) = index.query_terms(query);
    index.keep_rarest(&mut terms, MAX_QUERY_TERMS);
    let params = bm25(config);
    let semantic = query_vector(query, config);
    let semantic = semantic.as_ref();
    let mut best = Best::with_capacity_and_hasher(OFFERED, FxBuildHasher);

    // Re-rank the prefetched candidates against the actual message.
    let count = prefetched.len().max(1) as f32;
    let scorer = index.item_scorer(&terms, params);
    for (rank, candidate) in prefetched.iter().enumerate() {
        if !exists(state, *candidate) {
            continue;
        }
        let relevance = scorer.score(*candidate);
        let context = PREFETCH_CONTEXT_BONUS * (1.0 - rank as f32 / count);
        offer(
            &mut best,
            *candidate,
            relevance + context,
            HitSource::Prefetch,
        );
    }

    // Search the summary tier.
    let mut summary_hits: Vec<(ItemRef, f32)> = Vec::new();
    for (kind, top, wrap) in [
        (
            SegmentKind::Fact,
            config.top_facts,
            ItemRef::Fact as fn(u32) -> ItemRef,
        ),
        (SegmentKind::Summary, config.top_summaries, ItemRef::Summary),
        (SegmentKind::Episode, config.top_episodes, ItemRef::Episode),
    ] {
        let segment = index.segment(kind);
        let semantic = semantic.filter(|_| kind.compared_by_meaning());
        let found = hybrid(
            segment,
            semantic,
            segment.search(&terms, params, top),
            config,
            top,
        );
        for (key, relevance) in found {
            let item = wrap(key);
            if exists(state, item) {
                summary_hits.push((item, relevance));
                offer(&mut best, item, relevance, HitSource::Search);
            }
        }
    }
    summary_hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    summary_hits.truncate(COVERAGE_HITS);

    let coverage = coverage(index, &terms, &summary_hits);
    let escalated = !terms.is_empty() && coverage < config.escalate_below_coverage;

    // Raw turns: always searched; discounted when the summaries already answer.
    let raw_weight = if escalated {
        1.0
    } else {
        config.raw_weight_when_covered
    };
    let mut raw_hits = index.raw.search(&terms, params, config.top_raw_turns);
    if config.feedback_turns > 0 && config.feedback_weight > 0.0 {
        raw_hits = with_feedback(index, &terms, &raw_hits, config);
    }
    let raw_hits = hybrid(&index.raw, semantic, raw_hits, config, config.top_raw_turns);
    for (key, relevance) in raw_hits {
        offer(
            &mut best,
            ItemRef::RawTurn(key),
            relevance * raw_weight,
            HitSource::Search,
        );
    }
    if escalated {
        for (item, relevance) in &summary_hits {
            for seq in linked_turns(state, index, *item, &terms, params) {
                offer(
                    &mut best,
                    ItemRef::RawTurn(seq),
                    relevance * ESCALATION_INHERIT,
                    HitSource::Escalation,
                );
            }
        }
    }
    let artifact_hits = index.artifacts.search(&terms, params, config.top_artifacts);
    let artifact_hits = hybrid(
        &index.artifacts,
        semantic,
        artifact_hits,
        config,
        config.top_artifacts,
    );
    for (key, relevance) in artifact_hits {
        offer(
            &mut best,
            ItemRef::Artifact(key),
            relevance,
            HitSource::Search,
        );
    }

    expand_to_neighbours(state, &mut best, config.neighbour_weight);

    let hits: Vec<Hit> = best
        .into_iter()
        .map(|(item, (relevance, source))| Hit {
            item,
            relevance,
            source,
        })
        .collect();
    Retrieval {
        hits,
        coverage,
        escalated,
        query_terms: total,
        known_terms: terms.len(),
    }
}

/// The query's vector when retrieval is hybrid.
fn query_vector(query: &str, config: &RetrievalConfig) -> Option<Vector> {
    if config.mode != RetrievalMode::Hybrid {
        return None;
    }
    let mut start = query.len().saturating_sub(QUERY_EMBED_BYTES);
    while !query.is_char_boundary(start) {
        start += 1;
    }
    embed::model()?.embed(query.get(start..)?)
}

/// A segment's lexical hits mixed with its nearest items by cosine: `w`·BM25 + (1 − `w`)·cosine,
/// BM25 scaled by its best hit and cosine min–max over the items compared (0..1 each, per
/// query), the sum put back on the best BM25 hit's scale so segments still compare as before.
/// The `top` best of both lists, best first, ties by key. Lexical hits as they are when there
/// is no query vector.
fn hybrid(
    segment: &Segment,
    query: Option<&Vector>,
    lexical: Vec<(u32, f32)>,
    config: &RetrievalConfig,
    top: usize,
) -> Vec<(u32, f32)> {
    let Some(query) = query else {
        return lexical;
    };
    let nearest = segment.nearest(
        query,
        config.semantic_candidates,
        config.semantic_scan_items,
        top,
    );
    let Some(best) = nearest.best.first() else {
        return lexical;
    };
    let (high, low) = (best.1, nearest.lowest);
    let scaled = |cosine: f32| {
        if high > low {
            ((cosine - low) / (high - low)).clamp(0.0, 1.0)
        } else {
            0.0
        }
    };
    let lexical_best = lexical.iter().fold(0.0f32, |best, hit| best.max(hit.1));
    // With no lexical hit the best semantic one scores its cosine: weak matches stay weak
    // against other segments' hits.
    let scale = if lexical_best > 0.0 {
        lexical_best
    } else {
        high.max(0.0)
    };
    let w = config.lexical_weight;
    let mut mixed: BTreeMap<u32, f32> = BTreeMap::new();
    for (key, relevance) in &lexical {
        let lexical = if lexical_best > 0.0 {
            relevance / lexical_best
        } else {
            0.0
        };
        let cosine = segment.cosine(*key, query).map_or(0.0, scaled);
        mixed.insert(*key, scale * (w * lexical + (1.0 - w) * cosine));
    }
    for (key, cosine) in &nearest.best {
        mixed
            .entry(*key)
            .or_insert(scale * (1.0 - w) * scaled(*cosine));
    }
    let mut out: Vec<(u32, f32)> = mixed.into_iter().filter(|(_, s)| *s > 0.0).collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    out.truncate(top);
    out
}

/// Pseudo-relevance feedback over raw turns (RM3-like): the words that the best raw hits share,
/// weighted by the hit's score and the word's rarity, are added to the query at a fraction of a
/// message word's weight, and the raw turns are searched again. Scores stay on the original
/// query's scale. A turn that matches only the added words ranks below one that matches the
/// message, but can now be found at all.
fn with_feedback(
    index: &MemoryIndex,
    terms: &[TermId],
    hits: &[(u32, f32)],
    config: &RetrievalConfig,
) -> Vec<(u32, f32)> {
    let lent = feedback_words(index, terms, hits, config);
    let Some(strongest) = lent.first().map(|(_, weight)| *weight).filter(|w| *w > 0.0) else {
        return hits.to_vec();
    };
    // Added words score on the message's own scale (divided by its ceiling), so a turn that
    // shares many words with the best hits can outrank one that shares a single message word.
    let params = bm25(config);
    let mut query: Vec<(TermId, f32)> = terms.iter().map(|term| (*term, 1.0)).collect();
    query.extend(
        lent.into_iter()
            .map(|(word, weight)| (word, config.feedback_weight * weight / strongest)),
    );
    let ceiling = index.raw.ceiling(terms, params);
    index
        .raw
        .search_weighted(&query, ceiling, params, config.top_raw_turns)
}

/// The words feedback lends, strongest first: the best hits' words that are not the query's
/// own and not common in this memory, weighted by hit score and rarity.
fn feedback_words(
    index: &MemoryIndex,
    terms: &[TermId],
    hits: &[(u32, f32)],
    config: &RetrievalConfig,
) -> Vec<(TermId, f32)> {
    let mut lent: BTreeMap<TermId, f32> = BTreeMap::new();
    let common = (index.raw.len() / FEEDBACK_COMMON_DIVISOR).max(FEEDBACK_MIN_COMMON);
    // A pasted document's query has hundreds of terms and its hits thousands of words each:
    // a linear `contains` per word cost 0.2 ms on the hot path. Both lists are sorted, so one
    // walk along the query's terms skips them.
    let mut asked = terms.to_vec();
    asked.sort_unstable();
    for (seq, relevance) in hits.iter().take(config.feedback_turns) {
        let words = index.raw.terms_of(*seq);
        let share = relevance / words.len().max(1) as f32;
        let mut unasked = asked.iter().peekable();
        for word in words.iter().filter(|word| {
            while unasked.next_if(|term| term < word).is_some() {}
            unasked.peek() != Some(word) && index.raw.doc_freq(**word) <= common
        }) {
            *lent.entry(*word).or_default() += share * index.raw.idf(*word);
        }
    }
    let mut lent: Vec<(TermId, f32)> = lent.into_iter().collect();
    lent.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    lent.truncate(config.feedback_terms);
    lent
}

/// Whether `item` is in memory and may be injected (not retired, unpinned or deleted).
pub fn exists(state: &MemoryState, item: ItemRef) -> bool {
    match item {
        ItemRef::Fact(id) => state.fact(id).is_some_and(|fact| fact.active),
        ItemRef::Summary(seq) => state
            .turn_log
            .get(seq as usize)
            .is_some_and(|entry| !entry.erased),
        ItemRef::RawTurn(seq) => (seq as usize) < state.raw_turns.len(),
        ItemRef::Episode(id) => state
            .episodes
            .get(id as usize)
            .is_some_and(|episode| !episode.erased),
        ItemRef::Artifact(id) => state
            .artifacts
            .get(id as usize)
            .is_some_and(|artifact| !artifact.erased),
        ItemRef::Pinned(id) => state.pinned.get(id as usize).is_some_and(|pin| pin.active),
        ItemRef::Identity => state.identity.is_some(),
    }
}

/// Share of the query's weight (raw-segment idf, the largest collection) present in at least
/// one of the top summary-tier hits.
fn coverage(index: &MemoryIndex, terms: &[TermId], hits: &[(ItemRef, f32)]) -> f32 {
    let mut total = 0.0;
    let mut covered = 0.0;
    for term in terms {
        let weight = index.raw.idf(*term).max(0.1);
        total += weight;
        let found = hits.iter().any(|(item, _)| {
            segment_of(*item).is_some_and(|(kind, key)| index.segment(kind).contains(key, *term))
        });
        if found {
            covered += weight;
        }
    }
    if total > 0.0 { covered / total } else { 0.0 }
}

/// Raw turns behind a summary-tier item: a summary's own turn, a fact's provenance, an
/// episode's three most relevant linked turns.
fn linked_turns(
    state: &MemoryState,
    index: &MemoryIndex,
    item: ItemRef,
    terms: &[TermId],
    params: Bm25,
) -> Vec<TurnSeq> {
    match item {
        ItemRef::Summary(seq) => vec![seq],
        ItemRef::Fact(id) => state
            .fact(id)
            .map(|fact| fact.provenance.iter().rev().take(3).copied().collect())
            .unwrap_or_default(),
        ItemRef::Episode(id) => {
            let Some(episode) = state.episodes.get(id as usize) else {
                return Vec::new();
            };
            let scorer = index.raw.scorer(terms, params);
            let mut scored: Vec<(TurnSeq, f32)> = episode
                .links
                .iter()
                .map(|seq| (*seq, scorer.score(*seq)))
                .filter(|(_, score)| *score > 0.0)
                .collect();
            scored.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
            scored.into_iter().take(3).map(|(seq, _)| seq).collect()
        }
        _ => Vec::new(),
    }
}

/// The turns just before and after `seq` in the same session.
/// Every raw hit lends `weight` of its relevance to its session neighbours.
fn expand_to_neighbours(state: &MemoryState, best: &mut Best, weight: f32) {
    let raw_hits: Vec<(TurnSeq, f32)> = best
        .iter()
        .filter_map(|(item, (relevance, _))| match item {
            ItemRef::RawTurn(seq) => Some((*seq, *relevance)),
            _ => None,
        })
        .collect();
    for (seq, relevance) in raw_hits {
        for neighbour in neighbours(state, seq) {
            offer(
                best,
                ItemRef::RawTurn(neighbour),
                relevance * weight,
                HitSource::Neighbour,
            );
        }
    }
}

pub fn neighbours(state: &MemoryState, seq: TurnSeq) -> Vec<TurnSeq> {
    const SCAN: usize = 64;
    let Some(turn) = state.raw_turns.get(seq as usize) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let same_session = |at: &usize| {
        state
            .raw_turns
            .get(*at)
            .is_some_and(|other| other.session == turn.session)
    };
    let before = (0..seq as usize).rev().take(SCAN).find(same_session);
    let after = (seq as usize + 1..state.raw_turns.len())
        .take(SCAN)
        .find(same_session);
    for at in [before, after].into_iter().flatten() {
        if let Ok(at) = TurnSeq::try_from(at) {
            out.push(at);
        }
    }
    out
}

/// The candidates for the next turn of `session_id`, computed after its latest exchange: what
/// the index finds for that exchange (both sides), the raw neighbours of those hits, and the
/// active working set. Best first, at most `prefetch_limit`.
pub fn prefetch(
    state: &MemoryState,
    index: &MemoryIndex,
    session_id: &str,
    config: &RetrievalConfig,
) -> Vec<CandidateId> {
    let Some(session) = state.session_index(session_id) else {
        return Vec::new();
    };
    let Some(last) = state.session_turns_rev(session).next() else {
        return Vec::new();
    };
    let turn = &state.raw_turns[last as usize];
    let text = format!("{} {}", turn.user, turn.assistant);
    let (terms, _) = index.query_terms(&text);
    let params = bm25(config);
    let mut best = Best::with_capacity_and_hasher(OFFERED, FxBuildHasher);
    for (kind, top, wrap) in [
        (
            SegmentKind::Fact,
            config.top_facts * 2,
            ItemRef::Fact as fn(u32) -> ItemRef,
        ),
        (
            SegmentKind::Summary,
            config.top_summaries * 2,
            ItemRef::Summary,
        ),
        (
            SegmentKind::Episode,
            config.top_episodes * 2,
            ItemRef::Episode,
        ),
        (SegmentKind::Raw, config.top_raw_turns * 2, ItemRef::RawTurn),
        (
            SegmentKind::Artifact,
            config.top_artifacts * 2,
            ItemRef::Artifact,
        ),
    ] {
        for (key, relevance) in index.segment(kind).search(&terms, params, top) {
            let item = wrap(key);
            // The exchange itself is in the raw window next turn.
            if item == ItemRef::RawTurn(last) {
                continue;
            }
            if exists(state, item) {
                offer(&mut best, item, relevance, HitSource::Search);
            }
        }
    }
    expand_to_neighbours(state, &mut best, config.neighbour_weight);
    // The working set rides along at a small weight, so a terse follow-up still has context.
    // (The worker's memory has current lookups, so a job does not walk the whole history.)
    for item in state.working_set() {
        offer(&mut best, item, 0.01, HitSource::Prefetch);
    }
    let mut ranked: Vec<(ItemRef, f32)> = best
        .into_iter()
        .map(|(item, (relevance, _))| (item, relevance))
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    ranked.truncate(config.prefetch_limit);
    ranked.into_iter().map(|(item, _)| item).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MemoryConfig;
    use crate::model::Tier;
    use crate::record::test_support::recorded_with;

    /// Each turn in a session of its own, so no turn is another's neighbour.
    fn recorded(turns: &[(&str, &str)]) -> MemoryState {
        recorded_with(turns, |n| format!("s{n}"), |_| None)
    }

    /// Rank of raw turn `seq` among the raw-turn hits.
    fn raw_rank(retrieval: &Retrieval, seq: TurnSeq) -> Option<usize> {
        retrieval
            .hits
            .iter()
            .filter(|hit| matches!(hit.item, ItemRef::RawTurn(_)))
            .position(|hit| hit.item == ItemRef::RawTurn(seq))
    }

    /// The worker's prefetch takes the working set from the lookups' lists instead of walking
    /// the whole history: the same candidates as the walk, once part of the history is OLD.
    #[test]
    fn prefetch_takes_the_working_set_from_the_lookups() {
        let turns: Vec<(String, String)> = (0..240)
            .map(|n| {
                (
                    format!(
                        "Day {n}: I repaired bicycle number {n} with a blue chain{}.",
                        n % 7
                    ),
                    format!("Noted: bicycle {n} fixed, chain{} fitted.", n % 7),
                )
            })
            .collect();
        let pairs: Vec<(&str, &str)> = turns
            .iter()
            .map(|(user, assistant)| (user.as_str(), assistant.as_str()))
            .collect();
        let mut state = recorded_with(&pairs, |n| format!("s{}", n / 40), |_| None);
        state.sync_lookups();
        assert!(state.lookups.is_current(&state));
        assert!(
            state
                .turn_log
                .iter()
                .any(|entry| entry.tier.tier == Tier::Old),
            "part of the history must be OLD for the lists to matter"
        );
        let index = MemoryIndex::build(&state);
        let config = MemoryConfig::default().retrieval;
        let listed = prefetch(&state, &index, "s5", &config);
        let mut walked = state.clone();
        walked.lookups = Default::default();
        assert!(!walked.lookups.is_current(&walked));
        assert_eq!(prefetch(&walked, &index, "s5", &config), listed);
        assert!(!listed.is_empty());
    }

    /// A query with more known terms than `MAX_QUERY_TERMS` is searched by its rarest: the
    /// turn that alone holds a word is still found, behind a hundred words every turn holds.
    #[test]
    fn a_long_query_is_searched_by_its_rarest_terms() {
        let common: Vec<String> = (0..100).map(|n| format!("zorb{n}x")).collect();
        let everywhere = common.join(" ");
        let state = recorded(&[
            (&everywhere, "noted"),
            (&everywhere, "noted"),
            (&format!("{everywhere} pelican"), "noted"),
        ]);
        let index = MemoryIndex::build(&state);
        let config = MemoryConfig::default();
        let retrieval = retrieve(
            &state,
            &index,
            &format!("{everywhere} pelican?"),
            &[],
            &config.retrieval,
        );
        assert_eq!(retrieval.known_terms, MAX_QUERY_TERMS);
        assert!(retrieval.query_terms > MAX_QUERY_TERMS);
        assert_eq!(raw_rank(&retrieval, 2), Some(0));
    }

    /// Turn 1 shares no word with the question, but shares "pottery" and "clay" with turn 0,
    /// which does: feedback finds it, and ranks it below the turn that matches the question.
    /// Each turn is its own session, so neighbour expansion cannot be what finds it.
    #[test]
    fn feedback_finds_a_turn_that_shares_no_word_with_the_question() {
        let state = recorded(&[
            (
                "How do you destress after work these days?",
                "Pottery class: shaping clay on the wheel calms me down completely.",
            ),
            (
                "I glazed the clay bowl from my pottery class yesterday.",
                "Lovely, a glazed bowl is a great first piece.",
            ),
            (
                "My car needs new tyres before winter.",
                "Winter tyres grip better.",
            ),
            (
                "The train to Leeds was late again.",
                "Trains are often late.",
            ),
        ]);
        let index = MemoryIndex::build(&state);
        let question = "What does she do to destress?";
        let mut config = MemoryConfig::default().retrieval;
        // Feedback alone: semantic recall would find every turn of so small a memory.
        config.mode = RetrievalMode::Lexical;
        config.feedback_turns = 0;
        let without = retrieve(&state, &index, question, &[], &config);
        assert_eq!(raw_rank(&without, 0), Some(0));
        assert_eq!(raw_rank(&without, 1), None, "{without:?}");

        config.feedback_turns = 6;
        let with = retrieve(&state, &index, question, &[], &config);
        let (first, second) = (raw_rank(&with, 0), raw_rank(&with, 1));
        assert!(first.is_some() && second.is_some(), "{with:?}");
        assert!(first < second, "{with:?}");
        assert_eq!(
            raw_rank(&with, 2),
            None,
            "unrelated turns stay out: {with:?}"
        );
        assert_eq!(
            raw_rank(&with, 3),
            None,
            "unrelated turns stay out: {with:?}"
        );
    }

    /// Hybrid retrieval finds a turn that shares no word with the question nor with any
    /// turn that does (feedback cannot), by meaning; lexical retrieval does not.
    #[test]
    fn hybrid_finds_a_turn_by_meaning_alone() {
        let state = recorded(&[
            (
                "Pottery is like therapy for me, it calms me down after a long week.",
                "That sounds lovely.",
            ),
            (
                "My car needs new tyres before winter.",
                "Winter tyres grip better.",
            ),
            (
                "The train to Leeds was late again.",
                "Trains are often late.",
            ),
        ]);
        let index = MemoryIndex::build(&state);
        let question = "How does Tom destress?";
        let mut config = MemoryConfig::default().retrieval;
        config.mode = RetrievalMode::Lexical;
        let lexical = retrieve(&state, &index, question, &[], &config);
        assert_eq!(raw_rank(&lexical, 0), None, "{lexical:?}");
        config.mode = RetrievalMode::Hybrid;
        let hybrid = retrieve(&state, &index, question, &[], &config);
        assert_eq!(raw_rank(&hybrid, 0), Some(0), "{hybrid:?}");
    }

    /// Lexical evidence still counts in hybrid: of two turns about the same thing, the one
    /// naming the question's rare word ranks first at the default weight.
    #[test]
    fn hybrid_keeps_the_lexical_match_first() {
        let state = recorded(&[
            ("I went hiking in the hills last weekend.", "Nice walk!"),
            ("We hiked up Helvellyn on Saturday.", "What a climb!"),
            ("My car needs new tyres.", "Winter tyres grip better."),
        ]);
        let index = MemoryIndex::build(&state);
        let config = MemoryConfig::default().retrieval;
        let hybrid = retrieve(&state, &index, "When did we climb Helvellyn?", &[], &config);
        assert_eq!(raw_rank(&hybrid, 1), Some(0), "{hybrid:?}");
    }

    /// Feedback lends the hits' other words, never the query's own (they already count in
    /// full), whichever of the hit's words the query holds.
    #[test]
    fn feedback_lends_only_words_the_query_lacks() {
        let state = recorded(&[
            (
                "Pottery class: shaping clay on the wheel, then glazing the bowl.",
                "Kilns fire the glazed clay bowl overnight.",
            ),
            ("My car needs new tyres.", "Winter tyres grip better."),
        ]);
        let index = MemoryIndex::build(&state);
        let config = MemoryConfig::default().retrieval;
        let hit_words = index.raw.terms_of(0);
        // Every other word of the hit, so asked words sit before, between and after lent ones.
        for parity in [0, 1] {
            let asked: Vec<TermId> = hit_words
                .iter()
                .enumerate()
                .filter(|(at, _)| at % 2 == parity)
                .map(|(_, term)| *term)
                .rev()
                .collect();
            let lent = feedback_words(&index, &asked, &[(0, 1.0)], &config);
            assert!(!lent.is_empty(), "parity {parity}");
            for (word, _) in &lent {
                assert!(!asked.contains(word), "lent an asked word: {word}");
                assert!(hit_words.contains(word));
            }
            assert_eq!(lent.len(), hit_words.len() - asked.len(), "parity {parity}");
        }
    }
}
