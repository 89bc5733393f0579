//! An in-memory BM25 index over a user's whole memory: raw turns, turn summaries, facts,
//! episode manifests and artifacts, one segment each (each with its own statistics). The proxy
//! caches one per user and calls `refresh`, which appends new turns incrementally and rebuilds
//! only the small fact and episode segments when they changed.

use std::collections::HashMap;

use rustc_hash::FxBuildHasher;

use super::model::{ItemRef, MemoryState, TurnSeq};
use super::text::{date_search_text, distinct_terms, terms};

pub type TermId = u32;

#[derive(Debug, Clone, Copy)]
struct Posting {
    doc: u32,
    tf: u32,
}

/// One BM25 collection. Document `i` has key `doc_keys[i]` (a turn sequence number or an id).
#[derive(Debug, Clone, Default)]
pub struct Segment {
    doc_keys: Vec<u32>,
    doc_len: Vec<u32>,
    total_len: u64,
    /// Postings sorted by document. Keyed by a multiplicative hash, not SipHash: a long query
    /// looks up hundreds of terms in every segment on the hot path, and term ids are numbers
    /// this index hands out in sequence, never chosen by a client (the vocabulary, keyed by
    /// the client's words, keeps a seeded hash).
    postings: HashMap<TermId, Vec<Posting>, FxBuildHasher>,
    /// Each document's distinct terms (the forward index), for query expansion from the best
    /// hits without re-reading their text on the hot path.
    doc_terms: Vec<Box<[TermId]>>,
}

/// BM25 parameters.
#[derive(Debug, Clone, Copy)]
pub struct Bm25 {
    pub k1: f32,
    pub b: f32,
}

/// A query ready to score items of every segment (see [`MemoryIndex::item_scorer`]).
pub struct ItemScorer<'a> {
    raw: KeyScorer<'a>,
    summaries: KeyScorer<'a>,
    facts: KeyScorer<'a>,
    episodes: KeyScorer<'a>,
    artifacts: KeyScorer<'a>,
}

impl ItemScorer<'_> {
    /// Normalised relevance of `item`; 0 for items outside the index.
    pub fn score(&self, item: ItemRef) -> f32 {
        let Some((kind, key)) = segment_of(item) else {
            return 0.0;
        };
        let scorer = match kind {
            SegmentKind::Raw => &self.raw,
            SegmentKind::Summary => &self.summaries,
            SegmentKind::Fact => &self.facts,
            SegmentKind::Episode => &self.episodes,
            SegmentKind::Artifact => &self.artifacts,
        };
        scorer.score(key)
    }
}

/// A query ready to score single documents of one segment (see [`Segment::scorer`]).
pub struct KeyScorer<'a> {
    segment: &'a Segment,
    /// The query's terms present in the segment: postings and idf.
    terms: Vec<(&'a [Posting], f32)>,
    ceiling: f32,
    average: f32,
    bm25: Bm25,
}

impl KeyScorer<'_> {
    /// Normalised score of the document with `key`; 0 when absent.
    pub fn score(&self, key: u32) -> f32 {
        if self.ceiling <= 0.0 {
            return 0.0;
        }
        let Some(doc) = self.segment.doc_of(key) else {
            return 0.0;
        };
        let mut score = 0.0;
        for (postings, idf) in &self.terms {
            if let Ok(at) = postings.binary_search_by_key(&doc, |posting| posting.doc) {
                let tf = postings[at].tf;
                score += self
                    .segment
                    .term_score(*idf, tf, doc, self.average, self.bm25);
            }
        }
        score / self.ceiling
    }
}

impl Segment {
    fn add(&mut self, key: u32, term_ids: Vec<TermId>) {
        self.add_with_context(key, term_ids, Vec::new());
    }

    /// Adds a document whose `context` terms (a raw turn's date words) are searchable but left
    /// out of its forward index: they say when, not what, and would lend every turn of that day
    /// to query expansion.
    fn add_with_context(&mut self, key: u32, said: Vec<TermId>, context: Vec<TermId>) {
        let mut distinct = said.clone();
        distinct.sort_unstable();
        distinct.dedup();
        self.doc_terms.push(distinct.into_boxed_slice());
        let mut term_ids = said;
        term_ids.extend(context);
        let doc = u32::try_from(self.doc_keys.len()).unwrap_or(u32::MAX);
        self.doc_keys.push(key);
        self.doc_len
            .push(u32::try_from(term_ids.len()).unwrap_or(u32::MAX));
        self.total_len += term_ids.len() as u64;
        term_ids.sort_unstable();
        let mut index = 0;
        while index < term_ids.len() {
            let term = term_ids[index];
            let run = term_ids[index..].iter().take_while(|t| **t == term).count();
            self.postings.entry(term).or_default().push(Posting {
                doc,
                tf: u32::try_from(run).unwrap_or(u32::MAX),
            });
            index += run;
        }
    }

    pub fn len(&self) -> usize {
        self.doc_keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.doc_keys.is_empty()
    }

    fn average_len(&self) -> f32 {
        if self.doc_keys.is_empty() {
            1.0
        } else {
            (self.total_len as f32 / self.doc_keys.len() as f32).max(1.0)
        }
    }

    /// Documents holding `term`.
    pub fn doc_freq(&self, term: TermId) -> usize {
        self.postings.get(&term).map_or(0, Vec::len)
    }

    pub fn idf(&self, term: TermId) -> f32 {
        let n = self.doc_keys.len() as f32;
        let df = self.postings.get(&term).map_or(0, Vec::len) as f32;
        if df == 0.0 {
            return 0.0;
        }
        (1.0 + (n - df + 0.5) / (df + 0.5)).ln()
    }

    /// The best score any document could reach for `query`: normalises scores to about `0..1`
    /// so segments can be compared.
    pub fn ceiling(&self, query: &[TermId], bm25: Bm25) -> f32 {
        query
            .iter()
            .map(|term| self.idf(*term) * (bm25.k1 + 1.0))
            .sum()
    }

    fn term_score(&self, idf: f32, tf: u32, doc: u32, average: f32, bm25: Bm25) -> f32 {
        let tf = tf as f32;
        let len = self.doc_len.get(doc as usize).copied().unwrap_or(0) as f32;
        let norm = bm25.k1 * (1.0 - bm25.b + bm25.b * len / average);
        idf * tf * (bm25.k1 + 1.0) / (tf + norm)
    }

    /// The `top` best documents for `query` as `(key, normalised score)`, best first, ties by
    /// key.
    pub fn search(&self, query: &[TermId], bm25: Bm25, top: usize) -> Vec<(u32, f32)> {
        let weighted: Vec<(TermId, f32)> = query.iter().map(|term| (*term, 1.0)).collect();
        self.search_weighted(&weighted, self.ceiling(query, bm25), bm25, top)
    }

    /// `search` with a weight per query term, scores divided by `ceiling` (the caller's
    /// normaliser: an expanded query keeps its original query's scale).
    pub fn search_weighted(
        &self,
        query: &[(TermId, f32)],
        ceiling: f32,
        bm25: Bm25,
        top: usize,
    ) -> Vec<(u32, f32)> {
        if self.doc_keys.is_empty() || query.is_empty() || top == 0 || ceiling <= 0.0 {
            return Vec::new();
        }
        let average = self.average_len();
        // Dense accumulation: a few kilobytes per query, no hashing on the hot path.
        let mut scores = vec![0.0f32; self.doc_keys.len()];
        let mut touched: Vec<u32> = Vec::new();
        for (term, weight) in query {
            let Some(postings) = self.postings.get(term) else {
                continue;
            };
            let idf = self.idf(*term);
            for posting in postings {
                let slot = &mut scores[posting.doc as usize];
                if *slot == 0.0 {
                    touched.push(posting.doc);
                }
                *slot += weight * self.term_score(idf, posting.tf, posting.doc, average, bm25);
            }
        }
        let mut hits: Vec<(u32, f32)> = touched
            .into_iter()
            .map(|doc| {
                let key = self.doc_keys.get(doc as usize).copied().unwrap_or(u32::MAX);
                (key, scores[doc as usize] / ceiling)
            })
            .collect();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if hits.len() > top {
            hits.select_nth_unstable_by(top - 1, order);
            hits.truncate(top);
        }
        hits.sort_by(order);
        hits
    }

    fn doc_of(&self, key: u32) -> Option<u32> {
        self.doc_keys
            .binary_search(&key)
            .ok()
            .and_then(|doc| u32::try_from(doc).ok())
    }

    /// Normalised score of one document (by key) for `query`; 0 when absent. To score many
    /// documents for one query, make a [`Segment::scorer`] once.
    pub fn score_key(&self, key: u32, query: &[TermId], bm25: Bm25) -> f32 {
        self.scorer(query, bm25).score(key)
    }

    /// `query` prepared for scoring documents one by one: each term's postings and idf, and
    /// the ceiling, looked up once rather than per document (re-ranking a hundred prefetched
    /// candidates spent half of `compose` on them).
    pub fn scorer(&self, query: &[TermId], bm25: Bm25) -> KeyScorer<'_> {
        let terms: Vec<(&[Posting], f32)> = query
            .iter()
            .filter_map(|term| {
                let postings = self.postings.get(term)?;
                Some((postings.as_slice(), self.idf(*term)))
            })
            .collect();
        KeyScorer {
            segment: self,
            terms,
            ceiling: self.ceiling(query, bm25),
            average: self.average_len(),
            bm25,
        }
    }

    /// The distinct terms of the document with `key`, ascending (empty when absent).
    pub fn terms_of(&self, key: u32) -> &[TermId] {
        self.doc_of(key)
            .and_then(|doc| self.doc_terms.get(doc as usize))
            .map_or(&[], |terms| terms)
    }

    /// Whether the document with `key` contains `term`.
    pub fn contains(&self, key: u32, term: TermId) -> bool {
        let Some(doc) = self.doc_of(key) else {
            return false;
        };
        self.postings.get(&term).is_some_and(|postings| {
            postings
                .binary_search_by_key(&doc, |posting| posting.doc)
                .is_ok()
        })
    }
}

/// Which segment an item lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    Raw,
    Summary,
    Fact,
    Episode,
    Artifact,
}

#[derive(Debug, Clone, Default)]
pub struct MemoryIndex {
    /// The state version this index reflects.
    pub state_version: u64,
    facts_version: u64,
    rewrites: u64,
    episodes_version: u64,
    /// Keyed by the client's words, so by a hash seeded per process (foldhash: the default
    /// SipHash cost a long query a hundred microseconds of lookups).
    vocabulary: HashMap<String, TermId, foldhash::fast::RandomState>,
    pub raw: Segment,
    pub summaries: Segment,
    pub facts: Segment,
    pub episodes: Segment,
    pub artifacts: Segment,
    /// Chain link -> raw turn, for recognising a full-history client's turns.
    chains: HashMap<u64, TurnSeq>,
}

const ARTIFACT_INDEX_CHARS: usize = 4000;

impl MemoryIndex {
    pub fn build(state: &MemoryState) -> MemoryIndex {
        let mut index = MemoryIndex::default();
        index.refresh(state);
        index
    }

    /// Whether the index reflects `state` exactly.
    pub fn is_current(&self, state: &MemoryState) -> bool {
        self.state_version == state.version
            && self.rewrites == state.rewrites
            && self.raw.len() == state.raw_turns.len()
            && self.facts_version == state.facts_version
            && self.episodes_version == state.episodes_version
    }

    /// Brings the index up to `state` (of the same user): appends new raw turns, summaries and
    /// artifacts; rebuilds the fact and episode segments if their versions moved.
    pub fn refresh(&mut self, state: &MemoryState) {
        if self.raw.len() > state.raw_turns.len()
            || self.summaries.len() > state.turn_log.len()
            || self.artifacts.len() > state.artifacts.len()
            || self.rewrites != state.rewrites
        {
            // Not a later version of the same state, or a deletion rewrote text the
            // append-only segments hold: start over.
            *self = MemoryIndex {
                rewrites: state.rewrites,
                ..MemoryIndex::default()
            };
        }
        for seq in self.raw.len()..state.raw_turns.len() {
            let turn = &state.raw_turns[seq];
            let date = turn
                .event_time
                .as_deref()
                .map(date_search_text)
                .unwrap_or_default();
            let said = self.term_ids(&format!("{} {}", turn.user, turn.assistant));
            let date = self.term_ids(&date);
            let key = u32::try_from(seq).unwrap_or(u32::MAX);
            self.raw.add_with_context(key, said, date);
            self.chains.insert(turn.chain, key);
        }
        for seq in self.summaries.len()..state.turn_log.len() {
            let (user, assistant) = state.summary_texts(u32::try_from(seq).unwrap_or(u32::MAX));
            let text = format!("{user} {assistant}");
            let ids = self.term_ids(&text);
            self.summaries
                .add(u32::try_from(seq).unwrap_or(u32::MAX), ids);
        }
        for id in self.artifacts.len()..state.artifacts.len() {
            let artifact = &state.artifacts[id];
            let head: String = state
                .artifact_content(artifact)
                .chars()
                .take(ARTIFACT_INDEX_CHARS)
                .collect();
            let text = format!("{} {head}", artifact.language.as_deref().unwrap_or(""));
            let ids = self.term_ids(&text);
            self.artifacts
                .add(u32::try_from(id).unwrap_or(u32::MAX), ids);
        }
        if self.facts_version != state.facts_version || self.facts.is_empty() {
            self.facts = Segment::default();
            for fact in state.facts.iter().filter(|fact| fact.active) {
                let mut text = fact.text();
                // Earlier values answer "where did I live before?".
                for revision in &fact.history {
                    text.push(' ');
                    text.push_str(&revision.value);
                }
                let ids = self.term_ids(&text);
                self.facts.add(fact.id, ids);
            }
            self.facts_version = state.facts_version;
        }
        if self.episodes_version != state.episodes_version || self.episodes.is_empty() {
            self.episodes = Segment::default();
            for episode in &state.episodes {
                let text = format!(
                    "{} {} {} {}",
                    episode.topic,
                    episode.summary,
                    episode.salience_tags.join(" "),
                    episode.rehydration_hints.join(" ")
                );
                let ids = self.term_ids(&text);
                self.episodes.add(episode.id, ids);
            }
            self.episodes_version = state.episodes_version;
        }
        self.state_version = state.version;
    }

    fn term_ids(&mut self, text: &str) -> Vec<TermId> {
        let mut ids = Vec::new();
        for term in terms(text) {
            let next = TermId::try_from(self.vocabulary.len()).unwrap_or(TermId::MAX);
            let id = *self.vocabulary.entry(term).or_insert(next);
            ids.push(id);
        }
        ids
    }

    /// The query's known terms (deduplicated, in first-seen order) and how many terms it had.
    pub fn query_terms(&self, text: &str) -> (Vec<TermId>, usize) {
        let terms = distinct_terms(text);
        let ids = terms
            .iter()
            .filter_map(|term| self.vocabulary.get(term).copied())
            .collect();
        (ids, terms.len())
    }

    /// Keeps at most `max` of `terms`: the rarest in this memory (fewest documents over all
    /// segments, the earlier term on ties), in their original order.
    pub fn keep_rarest(&self, terms: &mut Vec<TermId>, max: usize) {
        if terms.len() <= max {
            return;
        }
        let segments = [
            &self.raw,
            &self.summaries,
            &self.facts,
            &self.episodes,
            &self.artifacts,
        ];
        let mut ranked: Vec<(usize, usize)> = terms
            .iter()
            .enumerate()
            .map(|(at, term)| (segments.iter().map(|s| s.doc_freq(*term)).sum(), at))
            .collect();
        ranked.sort_unstable();
        ranked.truncate(max);
        ranked.sort_unstable_by_key(|&(_, at)| at);
        *terms = ranked.iter().map(|&(_, at)| terms[at]).collect();
    }

    pub fn segment(&self, kind: SegmentKind) -> &Segment {
        match kind {
            SegmentKind::Raw => &self.raw,
            SegmentKind::Summary => &self.summaries,
            SegmentKind::Fact => &self.facts,
            SegmentKind::Episode => &self.episodes,
            SegmentKind::Artifact => &self.artifacts,
        }
    }

    /// The raw turn a chain link was recorded under.
    pub fn turn_for_chain(&self, chain: u64) -> Option<TurnSeq> {
        self.chains.get(&chain).copied()
    }

    /// `query` ready to score items of any segment, one by one.
    pub fn item_scorer(&self, query: &[TermId], bm25: Bm25) -> ItemScorer<'_> {
        ItemScorer {
            raw: self.raw.scorer(query, bm25),
            summaries: self.summaries.scorer(query, bm25),
            facts: self.facts.scorer(query, bm25),
            episodes: self.episodes.scorer(query, bm25),
            artifacts: self.artifacts.scorer(query, bm25),
        }
    }

    /// Approximate heap size in bytes (for the per-user memory report).
    pub fn estimated_bytes(&self) -> usize {
        let segment = |segment: &Segment| {
            segment.doc_keys.len() * 8
                + segment
                    .doc_terms
                    .iter()
                    .map(|terms| terms.len() * 4 + 16)
                    .sum::<usize>()
                + segment
                    .postings
                    .values()
                    .map(|postings| postings.len() * 8 + 48)
                    .sum::<usize>()
        };
        self.vocabulary
            .keys()
            .map(|term| term.len() + 40)
            .sum::<usize>()
            + self.chains.len() * 24
            + segment(&self.raw)
            + segment(&self.summaries)
            + segment(&self.facts)
            + segment(&self.episodes)
            + segment(&self.artifacts)
    }
}

/// The segment and document key of an item, if it is indexed.
pub fn segment_of(item: ItemRef) -> Option<(SegmentKind, u32)> {
    match item {
        ItemRef::RawTurn(seq) => Some((SegmentKind::Raw, seq)),
        ItemRef::Summary(seq) => Some((SegmentKind::Summary, seq)),
        ItemRef::Fact(id) => Some((SegmentKind::Fact, id)),
        ItemRef::Episode(id) => Some((SegmentKind::Episode, id)),
        ItemRef::Artifact(id) => Some((SegmentKind::Artifact, id)),
        ItemRef::Identity | ItemRef::Pinned(_) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn segment(docs: &[&str]) -> (MemoryIndex, Segment) {
        let mut index = MemoryIndex::default();
        let mut segment = Segment::default();
        for (key, doc) in docs.iter().enumerate() {
            let ids = index.term_ids(doc);
            segment.add(key as u32, ids);
        }
        (index, segment)
    }

    const BM25: Bm25 = Bm25 { k1: 1.2, b: 0.75 };

    #[test]
    fn bm25_ranks_rare_terms_higher() {
        let (index, segment) = segment(&[
            "the cat sat on the mat",
            "dogs and cats are pets",
            "my sourdough starter smells of acetone",
            "the cat likes the sourdough",
        ]);
        let (query, total) = index.query_terms("why does my sourdough starter smell?");
        assert_eq!(total, 3);
        let hits = segment.search(&query, BM25, 10);
        assert_eq!(hits[0].0, 2);
        assert_eq!(hits[1].0, 3);
        assert_eq!(hits.len(), 2);
        assert!(hits[0].1 > 0.0 && hits[0].1 <= 1.0);
        let single = segment.score_key(2, &query, BM25);
        assert!((single - hits[0].1).abs() < 1e-6);
        assert_eq!(segment.score_key(0, &query, BM25), 0.0);
    }

    #[test]
    fn a_long_query_keeps_its_rarest_terms_in_their_order() {
        let mut index = MemoryIndex::default();
        for (key, doc) in [
            "kettle walrus",
            "kettle banjo",
            "kettle zither",
            "walrus kettle",
        ]
        .iter()
        .enumerate()
        {
            let ids = index.term_ids(doc);
            index.raw.add(key as u32, ids);
        }
        // Documents holding each: kettle 4, walrus 2, banjo 1, zither 1.
        let (all, _) = index.query_terms("kettle walrus banjo zither");
        assert_eq!(all.len(), 4);
        for (max, kept) in [
            (2, vec![all[2], all[3]]),
            (3, all[1..].to_vec()),
            (9, all.clone()),
        ] {
            let mut terms = all.clone();
            index.keep_rarest(&mut terms, max);
            assert_eq!(terms, kept, "max {max}");
        }
    }

    #[test]
    fn stemming_matches_inflections() {
        let (index, segment) = segment(&["we went hiking in the alps", "taxes are due"]);
        let (query, _) = index.query_terms("hikes");
        assert_eq!(segment.search(&query, BM25, 5)[0].0, 0);
    }

    #[test]
    fn top_k_is_deterministic_on_ties() {
        let (index, segment) = segment(&["apple pie", "apple pie", "apple pie", "pear"]);
        let (query, _) = index.query_terms("apple");
        let hits = segment.search(&query, BM25, 2);
        assert_eq!(hits.iter().map(|hit| hit.0).collect::<Vec<_>>(), [0, 1]);
    }

    #[test]
    fn raw_turns_are_found_by_their_date_in_words() {
        let mut state = MemoryState::new();
        for (n, time) in ["2023-05-08T13:56:00Z", "2023-06-20T10:00:00Z"]
            .into_iter()
            .enumerate()
        {
            crate::memory::record::record_exchange(
                &mut state,
                &crate::memory::record::ExchangeInput {
                    session_id: "s".into(),
                    turn_id: format!("t{n}"),
                    user_text: "We went to the lake.".into(),
                    assistant_text: "Sounds fun.".into(),
                    event_time: Some(time.into()),
                    ..Default::default()
                },
                &crate::memory::extract::HeuristicExtractor,
                &crate::memory::config::MemoryConfig::default(),
            );
        }
        let index = MemoryIndex::build(&state);
        let (query, _) = index.query_terms("What did we do on 20 June, 2023?");
        let hits = index.raw.search(&query, BM25, 5);
        assert_eq!(hits[0].0, 1, "{hits:?}");

        // The forward index holds what was said, not the date words.
        let (said, _) = index.query_terms("We went to the lake. Sounds fun.");
        let (date, _) = index.query_terms("20 June 2023");
        let mut expected = said.clone();
        expected.sort_unstable();
        assert_eq!(index.raw.terms_of(1), expected.as_slice());
        assert!(
            date.iter()
                .all(|term| !index.raw.terms_of(1).contains(term))
        );
        assert!(index.raw.terms_of(7).is_empty());
    }
}
