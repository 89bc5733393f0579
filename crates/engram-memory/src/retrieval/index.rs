//! An in-memory BM25 index over a user's whole memory: raw turns, turn summaries, facts,
//! episode manifests and artifacts, one [`Segment`] each (each with its own statistics).
//!
//! The proxy caches one per user, and the worker refreshes it after every turn, so it is built
//! to change in O(turn), not O(history): each segment is an LSM of immutable parts shared
//! between copies plus a small mutable head. A new document goes into the head; a full head is
//! sealed into a part; parts of similar size are merged. A document whose text changed (a fact
//! updated, an episode rebuilt) is added again and its old copy goes stale: searches skip it,
//! and the statistics leave it out (per-term counts of stale documents), so scores are exactly
//! those of an index built afresh. Merges drop stale copies.
//!
//! `refresh` finds what to index from the state: items appended since the last refresh, and the
//! items the state records as changed since it was last stored ([`Segmented::pending`]); an
//! item whose text did not change (only its tier moved) is left as it is.

use std::cell::Cell;
use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use rustc_hash::{FxBuildHasher, FxHasher};

use super::embed::{self, Packed, Vector};
use crate::layered::LayeredMap;
use crate::model::{ItemRef, MemoryState, TurnSeq};
use crate::segmented::Segmented;
use crate::text::{date_search_text, distinct_terms, terms};

pub type TermId = u32;

/// Documents the mutable head of a segment holds before it is sealed into a part.
const HEAD_DOCS: usize = 128;

thread_local! {
    /// `Segment::search_weighted`'s score per document of a part, all zeros between searches
    /// and as long as the largest part searched on this thread.
    static SCORES: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// A document of a part and how often a term occurs in it, in one word (half what a pair of
/// `u32` takes; postings are a fifth of a memory's heap): the document's number in the low
/// [`DOC_BITS`] bits, the count in the rest, capped at 4,095. BM25's term frequency part
/// saturates long before (k1 1.2: 4,095 and 10,000 occurrences score within 6 % of each other
/// even in a document 500 times the average length).
#[derive(Debug, Clone, Copy)]
struct Posting(u32);

const DOC_BITS: u32 = 20;
const DOC_MASK: u32 = (1 << DOC_BITS) - 1;
const TF_MAX: u32 = u32::MAX >> DOC_BITS;
/// Documents a part may hold, so that a posting can number them: merges stop short of it.
const PART_DOCS_MAX: usize = 1 << DOC_BITS;

impl Posting {
    fn new(doc: u32, tf: usize) -> Posting {
        let tf = u32::try_from(tf).map_or(TF_MAX, |tf| tf.min(TF_MAX));
        Posting((tf << DOC_BITS) | (doc & DOC_MASK))
    }

    fn doc(self) -> u32 {
        self.0 & DOC_MASK
    }

    fn tf(self) -> u32 {
        self.0 >> DOC_BITS
    }
}

/// Whether the two newest parts, of `older` and `newer` documents, merge into one: once the
/// newer has grown to half the older (so a segment holds a logarithmic number of parts), and
/// only into a part its postings can number.
fn merges(older: usize, newer: usize) -> bool {
    newer * 2 >= older && older + newer <= PART_DOCS_MAX
}

/// Where the live copy of a key's document is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct DocLoc {
    /// The part's id; [`ABSENT`] when the key has no document (an inactive fact).
    part: u32,
    doc: u32,
    /// A hash of the indexed text, so an unchanged item is not indexed again.
    fingerprint: u64,
}

const ABSENT: u32 = u32::MAX;

impl DocLoc {
    const NONE: DocLoc = DocLoc {
        part: ABSENT,
        doc: 0,
        fingerprint: 0,
    };
}

/// One BM25 posting collection over some documents of a segment. Sealed parts never change
/// (copies share them); the head is the one part that grows.
#[derive(Debug, Clone, Default)]
struct Part {
    id: u32,
    doc_keys: Vec<u32>,
    doc_len: Vec<u32>,
    /// Postings sorted by document. Keyed by a multiplicative hash, not SipHash: a long query
    /// looks up hundreds of terms in every part on the hot path, and term ids are numbers this
    /// index hands out in sequence, never chosen by a client (the vocabulary, keyed by the
    /// client's words, keeps a seeded hash).
    postings: HashMap<TermId, Vec<Posting>, FxBuildHasher>,
    /// The forward index, for query expansion from the best hits without re-reading their
    /// text on the hot path, and for the stale counts: each document's distinct said terms,
    /// ascending, then its distinct context terms that are not among them (a raw turn's date
    /// words), one document after another. One buffer per part, not two boxes per document:
    /// the boxes' headers and rounding were about 40 bytes a document. Empty in a segment
    /// kept without one ([`Segment::without_forward_index`]).
    doc_terms: Vec<TermId>,
    /// Per document, where its said terms and where all its terms end in `doc_terms`.
    doc_ends: Vec<[u32; 2]>,
    /// Approximate heap size, kept as documents are added.
    bytes: usize,
}

/// Approximate heap bytes of one document's forward-index entry in a part.
fn forward_bytes(terms: usize) -> usize {
    8 + terms * 4
}

/// Heap bytes of one document's key and length in a part.
const DOC_BYTES: usize = 8;

const POSTING_BYTES: usize = std::mem::size_of::<Posting>();
const POSTING_LIST_BYTES: usize = 48;

impl Part {
    fn len(&self) -> usize {
        self.doc_keys.len()
    }

    /// Adds a document, to the forward index too when `forward`; returns its number in this
    /// part.
    fn add(&mut self, key: u32, said: Vec<TermId>, context: Vec<TermId>, forward: bool) -> u32 {
        if forward {
            let mut distinct = said.clone();
            distinct.sort_unstable();
            distinct.dedup();
            let mut context_only = context.clone();
            context_only.sort_unstable();
            context_only.dedup();
            context_only.retain(|term| distinct.binary_search(term).is_err());
            self.push_terms(&distinct, &context_only);
        }
        self.bytes += DOC_BYTES;
        let mut term_ids = said;
        term_ids.extend(context);
        let doc = u32::try_from(self.doc_keys.len()).unwrap_or(u32::MAX);
        self.doc_keys.push(key);
        self.doc_len
            .push(u32::try_from(term_ids.len()).unwrap_or(u32::MAX));
        term_ids.sort_unstable();
        let mut index = 0;
        while index < term_ids.len() {
            let term = term_ids[index];
            let run = term_ids[index..].iter().take_while(|t| **t == term).count();
            let list = self.postings.entry(term).or_default();
            if list.is_empty() {
                self.bytes += POSTING_LIST_BYTES;
            }
            list.push(Posting::new(doc, run));
            self.bytes += POSTING_BYTES;
            index += run;
        }
        doc
    }

    /// Appends a document's forward-index entry: its distinct said terms, then its context-only
    /// ones. Offsets are `u32`: a part never holds 4 billion terms (it is bounded in documents,
    /// and the cache in bytes), and one past that would read as empty, never panic.
    fn push_terms(&mut self, said: &[TermId], context_only: &[TermId]) {
        self.bytes += forward_bytes(said.len() + context_only.len());
        self.doc_terms.extend_from_slice(said);
        let said_end = u32::try_from(self.doc_terms.len()).unwrap_or(u32::MAX);
        self.doc_terms.extend_from_slice(context_only);
        let end = u32::try_from(self.doc_terms.len()).unwrap_or(u32::MAX);
        self.doc_ends.push([said_end, end]);
    }

    /// Where a document's terms start in `doc_terms`, where its said terms end, where it ends.
    fn term_bounds(&self, doc: usize) -> Option<[usize; 3]> {
        let [said_end, end] = *self.doc_ends.get(doc)?;
        let start = match doc.checked_sub(1) {
            Some(before) => self.doc_ends.get(before)?[1],
            None => 0,
        };
        Some([start as usize, said_end as usize, end as usize])
    }

    /// A document's distinct said terms, ascending (empty when absent).
    fn said_terms(&self, doc: usize) -> &[TermId] {
        self.term_bounds(doc)
            .and_then(|[start, said_end, _]| self.doc_terms.get(start..said_end))
            .unwrap_or(&[])
    }

    /// A document's context terms that are not among its said terms.
    fn context_only_terms(&self, doc: usize) -> &[TermId] {
        self.term_bounds(doc)
            .and_then(|[_, said_end, end]| self.doc_terms.get(said_end..end))
            .unwrap_or(&[])
    }

    fn doc_freq(&self, term: TermId) -> usize {
        self.postings.get(&term).map_or(0, Vec::len)
    }

    fn all_terms(&self, doc: usize) -> &[TermId] {
        self.term_bounds(doc)
            .and_then(|[start, _, end]| self.doc_terms.get(start..end))
            .unwrap_or(&[])
    }

    /// The terms a document is posted under, from the postings: what the forward index would
    /// give, for a part kept without one (a walk of the part's vocabulary).
    fn posted_terms(&self, doc: u32) -> Vec<TermId> {
        self.postings
            .iter()
            .filter(|(_, postings)| {
                postings
                    .binary_search_by_key(&doc, |posting| posting.doc())
                    .is_ok()
            })
            .map(|(term, _)| *term)
            .collect()
    }

    fn has(&self, doc: u32, term: TermId) -> bool {
        self.postings.get(&term).is_some_and(|postings| {
            postings
                .binary_search_by_key(&doc, |posting| posting.doc())
                .is_ok()
        })
    }
}

/// BM25 parameters.
#[derive(Debug, Clone, Copy)]
pub struct Bm25 {
    pub k1: f32,
    pub b: f32,
    /// A query term finds and scores documents in at most this many of its postings, the
    /// newest (`usize::MAX`: all). Bounds a query's work whatever the history: a word found in
    /// more documents than this counts in its newest mentions only (its rarity, the idf, still
    /// counts all of them).
    pub postings_per_term: usize,
    /// A query's terms together walk at most this many postings (`usize::MAX`: no bound),
    /// shared out rarest first (see `Segment::allowances`).
    pub postings_per_query: usize,
}

impl Bm25 {
    /// k1 1.2, b 0.75, every posting.
    pub const STANDARD: Bm25 = Bm25 {
        k1: 1.2,
        b: 0.75,
        postings_per_term: usize::MAX,
        postings_per_query: usize::MAX,
    };
}

/// One BM25 collection, whose documents are keyed by a turn sequence number or an id.
#[derive(Debug, Clone, Default)]
pub struct Segment {
    /// Sealed parts, oldest first.
    parts: Vec<Arc<Part>>,
    head: Part,
    next_part: u32,
    /// Key -> its live document.
    live: Segmented<DocLoc>,
    /// Live documents and their summed length.
    docs: u32,
    total_len: u64,
    /// Stale documents (replaced or removed, not yet merged away) per term they are posted
    /// under, so document frequencies count live documents only.
    stale: HashMap<TermId, u32, FxBuildHasher>,
    stale_docs: u32,
    /// Key -> the unit vector of its text (semantic recall), kept beside the postings rather
    /// than in the parts: it is replaced in place when the text changes, never goes stale.
    vectors: Segmented<Option<Packed>>,
    /// Keys with a vector.
    vector_count: u32,
    /// Parts keep no forward index: the segment's terms are never read back (see
    /// [`Segment::without_forward_index`]).
    no_forward_index: bool,
}

impl Segment {
    /// A segment whose parts keep no forward index, for documents whose words are never read
    /// back (only raw turns' are, for query expansion) and that are seldom replaced: a
    /// replaced or removed document's terms are then found by walking its part's postings.
    /// Turn summaries: most are spans of their raw turn, and their forward index was 2.3 MiB
    /// of a 20,000-turn memory's 32.
    pub fn without_forward_index() -> Segment {
        Segment {
            no_forward_index: true,
            ..Segment::default()
        }
    }

    /// Live documents.
    pub fn len(&self) -> usize {
        self.docs as usize
    }

    pub fn is_empty(&self) -> bool {
        self.docs == 0
    }

    /// Keys `0..keys()` have been looked at (indexed, or found to have no document).
    fn keys(&self) -> usize {
        self.live.len()
    }

    fn average_len(&self) -> f32 {
        if self.docs == 0 {
            1.0
        } else {
            (self.total_len as f32 / self.docs as f32).max(1.0)
        }
    }

    fn all_parts(&self) -> impl Iterator<Item = &Part> + '_ {
        self.parts
            .iter()
            .map(|part| &**part)
            .chain(std::iter::once(&self.head))
    }

    fn part(&self, id: u32) -> Option<&Part> {
        self.all_parts().find(|part| part.id == id)
    }

    /// Live documents holding `term`.
    pub fn doc_freq(&self, term: TermId) -> usize {
        let posted: usize = self.all_parts().map(|part| part.doc_freq(term)).sum();
        posted.saturating_sub(self.stale.get(&term).copied().unwrap_or(0) as usize)
    }

    pub fn idf(&self, term: TermId) -> f32 {
        let n = self.docs as f32;
        let df = self.doc_freq(term) as f32;
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

    fn term_score(idf: f32, tf: u32, len: u32, average: f32, bm25: Bm25) -> f32 {
        let tf = tf as f32;
        let norm = bm25.k1 * (1.0 - bm25.b + bm25.b * len as f32 / average);
        idf * tf * (bm25.k1 + 1.0) / (tf + norm)
    }

    fn is_live(&self, part: &Part, doc: u32) -> bool {
        // No stale copy anywhere: every posted document is its key's live one.
        self.stale_docs == 0
            || part
                .doc_keys
                .get(doc as usize)
                .and_then(|key| self.live.get(*key as usize))
                .is_some_and(|loc| loc.part == part.id && loc.doc == doc)
    }

    /// The `top` best documents for `query` as `(key, normalised score)`, best first, ties by
    /// key.
    pub fn search(&self, query: &[TermId], bm25: Bm25, top: usize) -> Vec<(u32, f32)> {
        let weighted: Vec<(TermId, f32)> = query.iter().map(|term| (*term, 1.0)).collect();
        self.search_weighted(&weighted, self.ceiling(query, bm25), bm25, top)
    }

    /// `search` with a weight per query term, scores divided by `ceiling` (the caller's
    /// normaliser: an expanded query keeps its original query's scale).
    ///
    /// Term at a time, with MaxScore pruning, so that a long history's common words do not
    /// make every query walk tens of thousands of postings: terms are taken by the most they
    /// can add to a document (largest first), and once the `top` best documents found so far
    /// all score more than the remaining terms could give a document not yet found, those
    /// terms only add to the documents still in the running (looked up in their postings
    /// instead of walking them). The result equals scoring every document under the same
    /// `postings_per_term` rule: each document's score adds its terms in the same order
    /// either way.
    pub fn search_weighted(
        &self,
        query: &[(TermId, f32)],
        ceiling: f32,
        bm25: Bm25,
        top: usize,
    ) -> Vec<(u32, f32)> {
        if self.docs == 0 || query.is_empty() || top == 0 || ceiling <= 0.0 {
            return Vec::new();
        }
        let average = self.average_len();
        // (term, weight, idf, postings it may use), largest bound first; the sort is stable,
        // so ties keep the query's order.
        let mut terms: Vec<(TermId, f32, f32, usize)> = query
            .iter()
            .zip(self.allowances(query, bm25))
            .map(|((term, weight), allowed)| (*term, *weight, self.idf(*term), allowed))
            .filter(|(_, weight, idf, _)| *weight > 0.0 && *idf > 0.0)
            .collect();
        let bound =
            |(_, weight, idf, _): &(TermId, f32, f32, usize)| weight * idf * (bm25.k1 + 1.0);
        terms.sort_by(|a, b| bound(b).total_cmp(&bound(a)));
        // rest[i]: the most terms i.. can add to one document (BM25's tf part stays below
        // k1 + 1).
        let mut rest = vec![0.0f32; terms.len() + 1];
        for i in (0..terms.len()).rev() {
            rest[i] = rest[i + 1] + bound(&terms[i]);
        }
        // The best live documents so far, as (key, raw score); at most `top` after each part.
        let mut hits: Vec<(u32, f32)> = Vec::new();
        // Taken, not borrowed: a search that unwound would otherwise leave scores behind.
        let mut scores = SCORES.take();
        let mut touched: Vec<u32> = Vec::new();
        let mut dropped: Vec<u32> = Vec::new();
        let mut running: Vec<f32> = Vec::new();
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        // Postings each term may still use: parts are taken newest first, and each part's
        // postings from its newest (a posting list is in document order). Stale copies count
        // too, so past the cap what is searched depends on when parts were merged.
        let mut left: Vec<usize> = terms.iter().map(|term| term.3).collect();
        let mut parts: Vec<&Part> = self.all_parts().collect();
        parts.reverse();
        for part in parts {
            let postings_of = |i: usize, left: &[usize]| -> Option<&[Posting]> {
                let all = part.postings.get(&terms[i].0)?;
                Some(&all[all.len().saturating_sub(left[i])..])
            };
            // Dense accumulation, no hashing on the hot path. The array is all zeros between
            // parts and searches, and only the documents a part touched are zeroed after it:
            // zeroing it whole for each part made every search cost the history's length.
            if scores.len() < part.len() {
                scores.resize(part.len(), 0.0);
            }
            touched.clear();
            dropped.clear();
            let score = |posting: &Posting, weight: f32, idf: f32| {
                let len = part
                    .doc_len
                    .get(posting.doc() as usize)
                    .copied()
                    .unwrap_or(0);
                weight * Segment::term_score(idf, posting.tf(), len, average, bm25)
            };
            let mut walked = terms.len();
            for (i, (_, weight, idf, _)) in terms.iter().enumerate() {
                let Some(postings) = postings_of(i, &left) else {
                    continue;
                };
                // Finding the bar costs a pass over the documents found; only worth it
                // before a walk at least as long.
                if postings.len() >= touched.len().max(top) {
                    let bar = self.bar(part, &scores, &touched, &hits, top, &mut running);
                    if rest[i] < bar {
                        walked = i;
                        break;
                    }
                }
                left[i] -= postings.len();
                for posting in postings {
                    let slot = &mut scores[posting.doc() as usize];
                    if *slot == 0.0 {
                        touched.push(posting.doc());
                    }
                    *slot += score(posting, *weight, *idf);
                }
            }
            if walked < terms.len() {
                // Documents that cannot reach the bar any more leave the running (below zero,
                // so no term adds to them); the rest take the remaining terms in order.
                let bar = self.bar(part, &scores, &touched, &hits, top, &mut running);
                touched.retain(|doc| {
                    let slot = &mut scores[*doc as usize];
                    let stays = *slot + rest[walked] >= bar;
                    if !stays {
                        *slot = f32::NEG_INFINITY;
                        dropped.push(*doc);
                    }
                    stays
                });
                for (i, (_, weight, idf, _)) in terms.iter().enumerate().skip(walked) {
                    let Some(postings) = postings_of(i, &left) else {
                        continue;
                    };
                    left[i] -= postings.len();
                    if postings.len() <= touched.len() {
                        for posting in postings {
                            let slot = &mut scores[posting.doc() as usize];
                            if *slot > 0.0 {
                                *slot += score(posting, *weight, *idf);
                            }
                        }
                    } else {
                        for doc in &touched {
                            if let Ok(at) = postings.binary_search_by_key(doc, |p| p.doc()) {
                                scores[*doc as usize] += score(&postings[at], *weight, *idf);
                            }
                        }
                    }
                }
            }
            for doc in &touched {
                if !self.is_live(part, *doc) {
                    continue;
                }
                let key = part
                    .doc_keys
                    .get(*doc as usize)
                    .copied()
                    .unwrap_or(u32::MAX);
                hits.push((key, scores[*doc as usize]));
            }
            for doc in touched.iter().chain(&dropped) {
                scores[*doc as usize] = 0.0;
            }
            if hits.len() > top {
                hits.select_nth_unstable_by(top - 1, order);
                hits.truncate(top);
            }
        }
        SCORES.set(scores);
        for hit in &mut hits {
            hit.1 /= ceiling;
        }
        hits.sort_by(order);
        hits
    }

    /// Postings each entry of `query` may use, in its order: its newest `postings_per_term`
    /// and, when the entries together have more than `postings_per_query`, that many shared
    /// out rarest first: an entry with fewer than an even share of what is left keeps all of
    /// its own, the commoner ones split the rest evenly (their newest). So a query's walk is
    /// bounded however many common words it has and however long the history, while the rare
    /// words, which decide the ranking, are walked whole. An entry of weight 0 gets none.
    fn allowances(&self, query: &[(TermId, f32)], bm25: Bm25) -> Vec<usize> {
        let posted: Vec<usize> = query
            .iter()
            .map(|(term, weight)| {
                if *weight > 0.0 {
                    let all: usize = self.all_parts().map(|part| part.doc_freq(*term)).sum();
                    all.min(bm25.postings_per_term)
                } else {
                    0
                }
            })
            .collect();
        let total = posted.iter().fold(0usize, |sum, n| sum.saturating_add(*n));
        if total <= bm25.postings_per_query {
            return posted;
        }
        let mut rarest_first: Vec<usize> = (0..posted.len()).collect();
        rarest_first.sort_by_key(|at| (posted[*at], *at));
        let mut allowed = vec![0; posted.len()];
        let mut budget = bm25.postings_per_query;
        for (taken, at) in rarest_first.iter().enumerate() {
            let share = budget / (rarest_first.len() - taken);
            allowed[*at] = posted[*at].min(share);
            budget -= allowed[*at];
        }
        allowed
    }

    /// The score a document must reach to be among the `top` best: the `top`-th best of the
    /// earlier parts' live hits and this part's live documents' scores so far (each only
    /// grows); 0 while fewer are known.
    fn bar(
        &self,
        part: &Part,
        scores: &[f32],
        touched: &[u32],
        hits: &[(u32, f32)],
        top: usize,
        running: &mut Vec<f32>,
    ) -> f32 {
        running.clear();
        running.extend(hits.iter().map(|(_, score)| *score));
        running.extend(
            touched
                .iter()
                .filter(|doc| self.is_live(part, **doc))
                .map(|doc| scores[*doc as usize]),
        );
        if running.len() < top {
            return 0.0;
        }
        let (_, kth, _) = running.select_nth_unstable_by(top - 1, |a, b| b.total_cmp(a));
        *kth
    }

    /// The live document of `key`: its part and number.
    fn locate(&self, key: u32) -> Option<(&Part, u32)> {
        let loc = self.live.get(key as usize)?;
        if loc.part == ABSENT {
            return None;
        }
        Some((self.part(loc.part)?, loc.doc))
    }

    /// Normalised score of one document (by key) for `query`; 0 when absent. To score many
    /// documents for one query, make a [`Segment::scorer`] once.
    pub fn score_key(&self, key: u32, query: &[TermId], bm25: Bm25) -> f32 {
        self.scorer(query, bm25).score(key)
    }

    /// `query` prepared for scoring documents one by one: each part's postings of each term,
    /// and the idfs and ceiling, looked up once rather than per document (re-ranking a hundred
    /// prefetched candidates spent half of `compose` on them).
    pub fn scorer(&self, query: &[TermId], bm25: Bm25) -> KeyScorer<'_> {
        let idfs: Vec<(TermId, f32)> = query
            .iter()
            .filter(|term| self.doc_freq(**term) > 0)
            .map(|term| (*term, self.idf(*term)))
            .collect();
        let parts = self
            .all_parts()
            .map(|part| {
                let terms = idfs
                    .iter()
                    .filter_map(|(term, idf)| Some((part.postings.get(term)?.as_slice(), *idf)))
                    .collect();
                (part, terms)
            })
            .collect();
        KeyScorer {
            segment: self,
            parts,
            ceiling: self.ceiling(query, bm25),
            average: self.average_len(),
            bm25,
        }
    }

    /// The distinct terms of the document with `key`, ascending (empty when absent).
    pub fn terms_of(&self, key: u32) -> &[TermId] {
        self.locate(key)
            .map_or(&[], |(part, doc)| part.said_terms(doc as usize))
    }

    /// Whether the document with `key` contains `term`.
    pub fn contains(&self, key: u32, term: TermId) -> bool {
        self.locate(key)
            .is_some_and(|(part, doc)| part.has(doc, term))
    }

    /// Whether `key`'s live document was indexed from text with this fingerprint (callers
    /// check it before they tokenize).
    fn holds(&self, key: u32, fingerprint: u64) -> bool {
        self.live
            .get(key as usize)
            .is_some_and(|loc| loc.part != ABSENT && loc.fingerprint == fingerprint)
    }

    /// Indexes `key`, replacing its earlier document, if any (callers skip a key whose text is
    /// unchanged, see [`Segment::holds`]). `text` is `None` for a key without a document.
    fn put(&mut self, key: u32, text: Option<(Vec<TermId>, Vec<TermId>)>, fingerprint: u64) {
        let current = self.live.get(key as usize).copied();
        if current.is_none_or(|loc| loc.part == ABSENT) && text.is_none() {
            self.set_live(key, DocLoc::NONE);
            return;
        }
        if let Some(current) = current {
            self.retire(current);
        }
        let loc = match text {
            Some((said, context)) => {
                let len = (said.len() + context.len()) as u64;
                let doc = self.head.add(key, said, context, !self.no_forward_index);
                self.docs += 1;
                self.total_len += len;
                DocLoc {
                    part: self.head.id,
                    doc,
                    fingerprint,
                }
            }
            None => DocLoc::NONE,
        };
        self.set_live(key, loc);
        if self.head.len() >= HEAD_DOCS {
            self.seal();
        }
    }

    fn set_live(&mut self, key: u32, loc: DocLoc) {
        let key = key as usize;
        while self.live.len() < key {
            self.live.push(DocLoc::NONE);
        }
        if key == self.live.len() {
            self.live.push(loc);
        } else if let Some(slot) = self.live.get_mut(key) {
            *slot = loc;
        }
        // The index keeps no record of its own changes.
        self.live.take_dirty();
    }

    /// Takes a live document out of the statistics; its copy stays in its part until a merge.
    fn retire(&mut self, loc: DocLoc) {
        if loc.part == ABSENT {
            return;
        }
        let Some(part) = self.part(loc.part) else {
            return;
        };
        let doc = loc.doc as usize;
        let len = part.doc_len.get(doc).copied().unwrap_or(0);
        let terms = if self.no_forward_index {
            part.posted_terms(loc.doc)
        } else {
            part.all_terms(doc).to_vec()
        };
        for term in terms {
            *self.stale.entry(term).or_default() += 1;
        }
        self.stale_docs += 1;
        self.docs = self.docs.saturating_sub(1);
        self.total_len = self.total_len.saturating_sub(u64::from(len));
    }

    /// Seals the head into a part, then merges the newest parts while the newer has grown to
    /// half the older; a part holding mostly stale copies is compacted.
    fn seal(&mut self) {
        let head = std::mem::take(&mut self.head);
        self.head.id = self.fresh_part_id();
        let sealed = self.merge(&[&head]);
        self.parts.push(Arc::new(sealed));
        while let [.., older, newer] = self.parts.as_slice()
            && merges(older.len(), newer.len())
        {
            let (Some(newer), Some(older)) = (self.parts.pop(), self.parts.pop()) else {
                break;
            };
            let merged = self.merge(&[&older, &newer]);
            self.parts.push(Arc::new(merged));
        }
        if self.stale_docs as usize * 4 > self.docs as usize + HEAD_DOCS {
            let parts = std::mem::take(&mut self.parts);
            let merged: Vec<Arc<Part>> = parts
                .iter()
                .map(|part| Arc::new(self.merge(&[part])))
                .collect();
            self.parts = merged;
        }
    }

    fn fresh_part_id(&mut self) -> u32 {
        self.next_part += 1;
        self.next_part
    }

    /// One new part holding the live documents of `parts`, in order; stale copies are dropped
    /// (and leave the stale counts), live ones are pointed at their new place.
    fn merge(&mut self, parts: &[&Part]) -> Part {
        let mut merged = Part {
            id: self.fresh_part_id(),
            ..Part::default()
        };
        for part in parts {
            let mut renumbered: Vec<Option<u32>> = Vec::with_capacity(part.len());
            for doc in 0..part.len() {
                let key = part.doc_keys[doc];
                let live = self
                    .live
                    .get(key as usize)
                    .is_some_and(|loc| loc.part == part.id && loc.doc as usize == doc);
                if !live {
                    // Its terms leave the stale counts below, from its postings.
                    self.stale_docs = self.stale_docs.saturating_sub(1);
                    renumbered.push(None);
                    continue;
                }
                let at = u32::try_from(merged.doc_keys.len()).unwrap_or(u32::MAX);
                merged.doc_keys.push(key);
                merged.doc_len.push(part.doc_len[doc]);
                merged.bytes += DOC_BYTES;
                if !self.no_forward_index {
                    merged.push_terms(part.said_terms(doc), part.context_only_terms(doc));
                }
                if let Some(slot) = self.live.get_mut(key as usize) {
                    slot.part = merged.id;
                    slot.doc = at;
                }
                renumbered.push(Some(at));
            }
            for (term, postings) in &part.postings {
                let mut dropped = 0u32;
                let mut moved = postings
                    .iter()
                    .filter_map(|posting| {
                        match renumbered.get(posting.doc() as usize).copied().flatten() {
                            Some(doc) => Some(Posting::new(doc, posting.tf() as usize)),
                            None => {
                                dropped += 1;
                                None
                            }
                        }
                    })
                    .peekable();
                if moved.peek().is_some() {
                    let list = merged.postings.entry(*term).or_default();
                    let before = list.len();
                    if before == 0 {
                        merged.bytes += POSTING_LIST_BYTES;
                    }
                    list.extend(moved);
                    merged.bytes += (list.len() - before) * POSTING_BYTES;
                }
                // A posting of a dropped (stale) copy is one stale count of its term: the
                // same terms the copy's retirement counted.
                if dropped > 0
                    && let Some(count) = self.stale.get_mut(term)
                {
                    *count = count.saturating_sub(dropped);
                    if *count == 0 {
                        self.stale.remove(term);
                    }
                }
            }
        }
        self.live.take_dirty();
        // Sealed parts never grow: the room their lists grew into is given back (it was a
        // quarter of the index's heap, and the cache's byte estimate did not count it).
        for list in merged.postings.values_mut() {
            list.shrink_to_fit();
        }
        merged.postings.shrink_to_fit();
        merged.doc_keys.shrink_to_fit();
        merged.doc_len.shrink_to_fit();
        merged.doc_terms.shrink_to_fit();
        merged.doc_ends.shrink_to_fit();
        merged
    }

    fn estimated_bytes(&self) -> usize {
        self.all_parts().map(|part| part.bytes).sum::<usize>()
            + self.live.len() * 16
            + self.stale.len() * 8
            + self.vectors.len() * std::mem::size_of::<Option<Packed>>()
    }

    /// Sets `key`'s vector (`None`: it has none). Public for benchmarks; the index sets its
    /// own when it indexes an item.
    pub fn set_vector(&mut self, key: u32, vector: Option<Vector>) {
        let key = key as usize;
        // Segments compared by words alone (summaries, episodes) would otherwise keep a slot
        // (176 bytes) per key for nothing: 3.4 MiB at 20,000 turns.
        if vector.is_none() && key >= self.vectors.len() {
            return;
        }
        while self.vectors.len() <= key {
            self.vectors.push(None);
        }
        if let Some(slot) = self.vectors.get_mut(key) {
            self.vector_count = self
                .vector_count
                .saturating_add(u32::from(vector.is_some()))
                .saturating_sub(u32::from(slot.is_some()));
            *slot = vector.as_ref().map(Packed::of);
        }
        self.vectors.take_dirty();
    }

    /// Cosine similarity of `key`'s vector with `query`; `None` when it has none.
    pub fn cosine(&self, key: u32, query: &Vector) -> Option<f32> {
        self.vectors
            .get(key as usize)?
            .as_ref()
            .map(|vector| vector.cosine(query))
    }

    /// The `top` items nearest to `query` among the newest `scan` keys: every one of them
    /// with a vector when there are at most `pool`, else the `pool` whose sign codes differ from
    /// the query's in the fewest dimensions (ties: the newest), rescored by their int8 dot
    /// product. So a query costs at most one popcount pass over `scan` 32-byte codes and `pool`
    /// dot products, whatever the history; older items are found by their words.
    pub fn nearest(&self, query: &Vector, pool: usize, scan: usize, top: usize) -> Nearest {
        let keyed = |key: usize| u32::try_from(key).unwrap_or(u32::MAX);
        let from = self.vectors.len().saturating_sub(scan);
        // The items to compare in full, gathered before any is scored (see `embed::warm`).
        let mut picked: Vec<(u32, &Packed)> = Vec::new();
        if self.vector_count as usize <= pool {
            picked.reserve(self.vector_count as usize);
            for (key, vector) in self.vectors.iter_from(from) {
                if let Some(vector) = vector {
                    picked.push((keyed(key), vector));
                }
            }
        } else {
            // One popcount pass: every item's distance (`NONE` without a vector), counted by
            // distance to find the one below which fewer than `pool` items lie.
            const NONE: u16 = u16::MAX;
            let mut histogram = [0usize; embed::DIMS + 1];
            let mut distances: Vec<u16> = Vec::with_capacity(self.vectors.len() - from);
            for (_, vector) in self.vectors.iter_from(from) {
                let distance = vector.as_ref().map_or(NONE, |vector| {
                    u16::try_from(query.hamming(&vector.code)).unwrap_or(NONE)
                });
                if let Some(count) = histogram.get_mut(usize::from(distance)) {
                    *count += 1;
                }
                distances.push(distance);
            }
            let mut below = 0;
            let mut limit = embed::DIMS;
            for (distance, count) in histogram.iter().enumerate() {
                if below + count >= pool {
                    limit = distance;
                    break;
                }
                below += count;
            }
            // Everything nearer than `limit`, then the newest at `limit` up to `pool`.
            let limit = u16::try_from(limit).unwrap_or(NONE);
            let mut at_limit = pool.saturating_sub(below);
            picked.reserve(pool);
            for (offset, distance) in distances.iter().enumerate().rev() {
                if *distance < limit || (*distance == limit && at_limit > 0) {
                    if *distance == limit {
                        at_limit -= 1;
                    }
                    let key = from + offset;
                    if let Some(Some(vector)) = self.vectors.get(key) {
                        picked.push((keyed(key), vector));
                    }
                }
            }
        }
        embed::warm(picked.iter().map(|(_, vector)| *vector));
        let mut scored: Vec<(u32, f32)> = picked
            .iter()
            .map(|(key, vector)| (*key, vector.cosine(query)))
            .collect();
        let lowest = scored.iter().map(|hit| hit.1).reduce(f32::min);
        // Only the best `top` are wanted in order: select them, then sort those.
        let order = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if scored.len() > top && top > 0 {
            scored.select_nth_unstable_by(top - 1, order);
        }
        scored.truncate(top);
        scored.sort_unstable_by(order);
        Nearest {
            best: scored,
            lowest: lowest.unwrap_or(0.0),
        }
    }

    /// Sealed parts, for tests and sizing.
    pub fn part_count(&self) -> usize {
        self.parts.len()
    }
}

/// The items of a segment nearest to a query vector.
#[derive(Debug, Clone, Default)]
pub struct Nearest {
    /// `(key, cosine)`, best first, ties by key.
    pub best: Vec<(u32, f32)>,
    /// The lowest cosine among the items compared (0 when none was).
    pub lowest: f32,
}

/// One query term's postings in a part, with the term's idf.
type TermPostings<'a> = (&'a [Posting], f32);

/// A query ready to score single documents of one segment (see [`Segment::scorer`]).
pub struct KeyScorer<'a> {
    segment: &'a Segment,
    /// Per part, the query's terms present in it.
    parts: Vec<(&'a Part, Vec<TermPostings<'a>>)>,
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
        let Some(loc) = self.segment.live.get(key as usize) else {
            return 0.0;
        };
        let Some((part, terms)) = self.parts.iter().find(|(part, _)| part.id == loc.part) else {
            return 0.0;
        };
        let doc = loc.doc;
        let len = part.doc_len.get(doc as usize).copied().unwrap_or(0);
        let mut score = 0.0;
        for (postings, idf) in terms {
            if let Ok(at) = postings.binary_search_by_key(&doc, |posting| posting.doc()) {
                score += Segment::term_score(*idf, postings[at].tf(), len, self.average, self.bm25);
            }
        }
        score / self.ceiling
    }
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

/// Which segment an item lives in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SegmentKind {
    Raw,
    Summary,
    Fact,
    Episode,
    Artifact,
}

impl SegmentKind {
    /// Whether hybrid retrieval compares this segment's items with the query by meaning, and
    /// so whether they get a vector. Not summaries and episodes: they are made of raw turns,
    /// which are compared already, and comparing them too cost a third of compose's time.
    pub fn compared_by_meaning(self) -> bool {
        matches!(
            self,
            SegmentKind::Raw | SegmentKind::Fact | SegmentKind::Artifact
        )
    }
}

type Vocabulary = LayeredMap<String, TermId, foldhash::fast::RandomState>;

#[derive(Debug, Clone)]
pub struct MemoryIndex {
    /// The state version this index reflects.
    pub state_version: u64,
    rewrites: u64,
    /// Keyed by the client's words, so by a hash seeded per process (foldhash: the default
    /// SipHash cost a long query a hundred microseconds of lookups).
    vocabulary: Vocabulary,
    terms: u32,
    /// Approximate heap size of the vocabulary.
    vocabulary_bytes: usize,
    pub raw: Segment,
    pub summaries: Segment,
    pub facts: Segment,
    pub episodes: Segment,
    pub artifacts: Segment,
    /// Chain link -> raw turn, for recognising a full-history client's turns.
    chains: LayeredMap<u64, TurnSeq, FxBuildHasher>,
    /// Exchange pair hash -> its latest raw turn, for a client that trimmed or edited the
    /// history it resends.
    pairs: LayeredMap<u64, TurnSeq, FxBuildHasher>,
}

impl Default for MemoryIndex {
    fn default() -> Self {
        MemoryIndex {
            state_version: 0,
            rewrites: 0,
            vocabulary: Vocabulary::default(),
            terms: 0,
            vocabulary_bytes: 0,
            raw: Segment::default(),
            // Only raw turns' words are read back, and a summary is replaced only when the
            // management API erases it.
            summaries: Segment::without_forward_index(),
            facts: Segment::default(),
            episodes: Segment::default(),
            artifacts: Segment::default(),
            chains: LayeredMap::default(),
            pairs: LayeredMap::default(),
        }
    }
}

const ARTIFACT_INDEX_CHARS: usize = 4000;

fn fingerprint(parts: &[&str]) -> u64 {
    let mut hasher = FxHasher::default();
    for part in parts {
        part.hash(&mut hasher);
    }
    hasher.finish()
}

/// Keys to look at in a segment of `len` items: those the state changed since it was stored,
/// and those appended since the segment last looked.
fn keys_to_index(pending: &[u32], indexed: usize, len: usize) -> Vec<u32> {
    let mut keys: Vec<u32> = pending
        .iter()
        .copied()
        .filter(|key| (*key as usize) < indexed.min(len))
        .collect();
    keys.sort_unstable();
    keys.dedup();
    keys.extend((indexed..len).filter_map(|key| u32::try_from(key).ok()));
    keys
}

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
            && self.raw.keys() == state.raw_turns.len()
    }

    /// Brings the index up to `state`, a later version of the memory it reflects (or builds it
    /// afresh when `state` is not): indexes the items appended since, and those `state` records
    /// as changed since it was last stored whose text changed.
    pub fn refresh(&mut self, state: &MemoryState) {
        if self.raw.keys() > state.raw_turns.len()
            || self.summaries.keys() > state.turn_log.len()
            || self.artifacts.keys() > state.artifacts.len()
            || self.facts.keys() > state.facts.len()
            || self.episodes.keys() > state.episodes.len()
            || self.rewrites != state.rewrites
        {
            // Not a later version of the same state, or a deletion rewrote text in place:
            // start over.
            *self = MemoryIndex {
                rewrites: state.rewrites,
                ..MemoryIndex::default()
            };
        }
        for seq in keys_to_index(
            state.raw_turns.pending(),
            self.raw.keys(),
            state.raw_turns.len(),
        ) {
            let Some(turn) = state.raw_turns.get(seq as usize) else {
                continue;
            };
            let date = turn
                .event_time
                .as_deref()
                .map(date_search_text)
                .unwrap_or_default();
            let said = format!("{} {}", turn.user, turn.assistant);
            let print = fingerprint(&[&said, &date]);
            if self.raw.holds(seq, print) {
                continue;
            }
            let text = (self.term_ids(&said), self.term_ids(&date));
            self.raw.put(seq, Some(text), print);
            self.raw.set_vector(seq, embed_text(&said));
            self.chains.insert(turn.chain, seq);
            self.pairs.insert(turn.pair(), seq);
        }
        for seq in keys_to_index(
            state.turn_log.pending(),
            self.summaries.keys(),
            state.turn_log.len(),
        ) {
            let (user, assistant) = state.summary_texts(seq);
            let text = format!("{user} {assistant}");
            self.put_text(SegmentKind::Summary, seq, Some(&text));
        }
        for id in keys_to_index(
            state.artifacts.pending(),
            self.artifacts.keys(),
            state.artifacts.len(),
        ) {
            let Some(artifact) = state.artifacts.get(id as usize) else {
                continue;
            };
            let head: String = state
                .artifact_content(artifact)
                .chars()
                .take(ARTIFACT_INDEX_CHARS)
                .collect();
            let text = format!("{} {head}", artifact.language.as_deref().unwrap_or(""));
            self.put_text(SegmentKind::Artifact, id, Some(&text));
        }
        for id in keys_to_index(state.facts.pending(), self.facts.keys(), state.facts.len()) {
            let text = state.fact(id).filter(|fact| fact.active).map(|fact| {
                let mut text = fact.text();
                // Earlier values answer "where did I live before?".
                for revision in &fact.history {
                    text.push(' ');
                    text.push_str(&revision.value);
                }
                text
            });
            self.put_text(SegmentKind::Fact, id, text.as_deref());
        }
        for id in keys_to_index(
            state.episodes.pending(),
            self.episodes.keys(),
            state.episodes.len(),
        ) {
            let Some(episode) = state.episodes.get(id as usize) else {
                continue;
            };
            let text = format!(
                "{} {} {} {}",
                episode.topic,
                episode.summary,
                episode.salience_tags.join(" "),
                episode.rehydration_hints.join(" ")
            );
            self.put_text(SegmentKind::Episode, id, Some(&text));
        }
        self.state_version = state.version;
    }

    fn put_text(&mut self, kind: SegmentKind, key: u32, text: Option<&str>) {
        let print = text.map_or(0, |text| fingerprint(&[text]));
        if text.is_some() && self.segment(kind).holds(key, print) {
            return;
        }
        let terms = text.map(|text| (self.term_ids(text), Vec::new()));
        let vector = text
            .filter(|_| kind.compared_by_meaning())
            .and_then(embed_text);
        let segment = self.segment_mut(kind);
        segment.put(key, terms, print);
        segment.set_vector(key, vector);
    }

    fn term_ids(&mut self, text: &str) -> Vec<TermId> {
        let mut ids = Vec::new();
        for term in terms(text) {
            let id = match self.vocabulary.get(term.as_str()) {
                Some(id) => *id,
                None => {
                    let id = self.terms;
                    self.terms = self.terms.saturating_add(1);
                    self.vocabulary_bytes += term.len() + 40;
                    self.vocabulary.insert(term, id);
                    id
                }
            };
            ids.push(id);
        }
        ids
    }

    /// The query's known terms (deduplicated, in first-seen order) and how many terms it had.
    pub fn query_terms(&self, text: &str) -> (Vec<TermId>, usize) {
        let terms = distinct_terms(text);
        let ids = terms
            .iter()
            .filter_map(|term| self.vocabulary.get(term.as_str()).copied())
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

    fn segment_mut(&mut self, kind: SegmentKind) -> &mut Segment {
        match kind {
            SegmentKind::Raw => &mut self.raw,
            SegmentKind::Summary => &mut self.summaries,
            SegmentKind::Fact => &mut self.facts,
            SegmentKind::Episode => &mut self.episodes,
            SegmentKind::Artifact => &mut self.artifacts,
        }
    }

    /// The raw turn a chain link was recorded under.
    pub fn turn_for_chain(&self, chain: u64) -> Option<TurnSeq> {
        self.chains.get(&chain).copied()
    }

    /// The latest raw turn with this exchange [`pair`](crate::chain::pair) hash.
    pub fn turn_for_pair(&self, pair: u64) -> Option<TurnSeq> {
        self.pairs.get(&pair).copied()
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

    /// Approximate heap size in bytes (for the per-user memory report and the cache's budget).
    pub fn estimated_bytes(&self) -> usize {
        self.vocabulary_bytes
            + (self.chains.stored() + self.pairs.stored()) * 24
            + self.raw.estimated_bytes()
            + self.summaries.estimated_bytes()
            + self.facts.estimated_bytes()
            + self.episodes.estimated_bytes()
            + self.artifacts.estimated_bytes()
    }
}

/// The vector of an item's text, when the shipped model parses (it always does; see
/// `embed::model`).
fn embed_text(text: &str) -> Option<Vector> {
    embed::model().and_then(|model| model.embed(text))
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
            segment.put(key as u32, Some((ids, Vec::new())), fingerprint(&[doc]));
        }
        (index, segment)
    }

    const BM25: Bm25 = Bm25::STANDARD;

    /// Past `pool` vectors, the sign-code prefilter keeps the nearest: the exact answer's best
    /// items are found, and every item is scored when the pool covers them all.
    #[test]
    fn nearest_prefilters_by_sign_codes_and_keeps_the_best() {
        let topics = [
            "pottery class with clay and a wheel",
            "my car needs new winter tyres",
            "the train to Leeds was late",
            "baking sourdough bread at home",
        ];
        let mut segment = Segment::default();
        for key in 0..400u32 {
            let text = format!("{} number {key}", topics[key as usize % topics.len()]);
            segment.set_vector(key, embed_text(&text));
        }
        let query = embed_text("I love shaping clay on the pottery wheel").unwrap();
        let exact = segment.nearest(&query, 1_000, usize::MAX, usize::MAX).best;
        assert_eq!(exact.len(), 400);
        let pre = segment.nearest(&query, 64, usize::MAX, usize::MAX).best;
        assert_eq!(pre.len(), 64);
        // Every one of the prefilter's picks is a pottery turn, as are the exact top 64.
        assert!(pre.iter().all(|(key, _)| key % 4 == 0), "{pre:?}");
        assert!(exact.iter().take(64).all(|(key, _)| key % 4 == 0));
        assert_eq!(pre[0], exact[0]);
        segment.set_vector(0, None);
        assert_eq!(segment.cosine(0, &query), None);
        let all = segment.nearest(&query, 1_000, usize::MAX, usize::MAX).best;
        assert_eq!(all.len(), 399);
        let top = segment.nearest(&query, 1_000, usize::MAX, 5);
        assert_eq!(top.best[..], all[..5]);
        assert_eq!(top.lowest, all[398].1);
        // A scan bound compares the newest keys only, exactly or through the prefilter.
        for pool in [1_000, 16] {
            let newest = segment.nearest(&query, pool, 100, usize::MAX).best;
            assert_eq!(newest.len(), pool.min(100));
            assert!(newest.iter().all(|(key, _)| *key >= 300), "{newest:?}");
        }
    }

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
            index
                .raw
                .put(key as u32, Some((ids, Vec::new())), fingerprint(&[doc]));
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

    /// Past the query's budget, the rare word keeps all its postings and the common words
    /// split the rest; within it, every word keeps its own.
    #[test]
    fn a_query_budget_is_shared_out_rarest_first() {
        let mut docs: Vec<String> = (0..100)
            .map(|n| format!("apple banana filler{n}"))
            .collect();
        docs.extend((0..3).map(|n| format!("quince apple note{n}")));
        let docs: Vec<&str> = docs.iter().map(String::as_str).collect();
        let (index, segment) = segment(&docs);
        let (terms, _) = index.query_terms("apple banana quince");
        let query: Vec<(TermId, f32)> = terms.iter().map(|term| (*term, 1.0)).collect();
        let budget = |postings_per_query| Bm25 {
            postings_per_query,
            ..BM25
        };
        assert_eq!(
            segment.allowances(&query, budget(usize::MAX)),
            [103, 100, 3]
        );
        assert_eq!(segment.allowances(&query, budget(50)), [24, 23, 3]);
        let zero_weight = [(terms[0], 0.0), (terms[1], 1.0), (terms[2], 1.0)];
        assert_eq!(segment.allowances(&zero_weight, budget(50)), [0, 47, 3]);
        // The rare word's documents still rank first.
        let hits = segment.search(&terms, budget(50), 3);
        assert!(hits.iter().all(|(key, _)| *key >= 100), "{hits:?}");
    }

    #[test]
    fn stemming_matches_inflections() {
        let (index, segment) = segment(&["we went hiking in the alps", "taxes are due"]);
        let (query, _) = index.query_terms("hikes");
        assert_eq!(segment.search(&query, BM25, 5)[0].0, 0);
    }

    /// Every live document's score by brute force, in the query's order, each term counting
    /// in its newest `bm25.postings_per_term` postings only: what the pruned search must equal.
    fn exhaustive(
        segment: &Segment,
        query: &[(TermId, f32)],
        ceiling: f32,
        bm25: Bm25,
        top: usize,
    ) -> Vec<(u32, f32)> {
        let average = segment.average_len();
        let parts: Vec<&Part> = segment.all_parts().collect();
        // (query entry, part id, document) of the postings each entry may use.
        let mut usable = std::collections::HashSet::new();
        let allowed = segment.allowances(query, bm25);
        for (entry, (term, _)) in query.iter().enumerate() {
            let newest_first = parts.iter().rev().flat_map(|part| {
                let postings = part.postings.get(term).map_or(&[][..], Vec::as_slice);
                postings.iter().rev().map(|p| (part.id, p.doc()))
            });
            for (part, doc) in newest_first.take(allowed[entry]) {
                usable.insert((entry, part, doc));
            }
        }
        let mut hits = Vec::new();
        for part in parts {
            for doc in 0..part.len() as u32 {
                if !segment.is_live(part, doc) {
                    continue;
                }
                let mut total = 0.0;
                let mut found = false;
                for (entry, (term, weight)) in query.iter().enumerate() {
                    let posted = part
                        .postings
                        .get(term)
                        .and_then(|postings| postings.iter().find(|p| p.doc() == doc))
                        .filter(|_| usable.contains(&(entry, part.id, doc)));
                    if let Some(posting) = posted {
                        let len = part.doc_len[doc as usize];
                        let idf = segment.idf(*term);
                        total +=
                            weight * Segment::term_score(idf, posting.tf(), len, average, bm25);
                        found = true;
                    }
                }
                if found {
                    hits.push((part.doc_keys[doc as usize], total / ceiling));
                }
            }
        }
        hits.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        hits.truncate(top);
        hits
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(48))]

        /// The pruned search finds the same best documents with the same scores as scoring
        /// every document, over several parts, replaced documents and skewed word counts,
        /// with and without a cap on each term's postings and on the query's.
        #[test]
        fn pruned_search_equals_scoring_every_document(
            docs in proptest::collection::vec(
                (0u32..400, proptest::collection::vec(0usize..1_600, 1..14)),
                1..700,
            ),
            query in proptest::collection::vec((0usize..1_600, 1u32..8), 1..24),
            top in 1usize..30,
            cap in proptest::prop_oneof![proptest::strategy::Just(usize::MAX), 1usize..60],
            budget in proptest::prop_oneof![proptest::strategy::Just(usize::MAX), 1usize..200],
        ) {
            let bm25 = Bm25 {
                postings_per_term: cap,
                postings_per_query: budget,
                ..BM25
            };
            // Squaring skews the vocabulary: low words are common, high ones rare.
            let word = |n: usize| format!("w{}", n * n / 16_000);
            let mut index = MemoryIndex::default();
            let mut segment = Segment::default();
            for (key, words) in &docs {
                let text: Vec<String> = words.iter().map(|n| word(*n)).collect();
                let text = text.join(" ");
                let ids = index.term_ids(&text);
                segment.put(*key, Some((ids, Vec::new())), fingerprint(&[&text]));
            }
            let query: Vec<(TermId, f32)> = query
                .iter()
                .filter_map(|(n, weight)| {
                    let (ids, _) = index.query_terms(&word(*n));
                    Some((*ids.first()?, *weight as f32 / 4.0))
                })
                .collect();
            let ceiling = 3.0;
            let pruned = segment.search_weighted(&query, ceiling, bm25, top);
            let every = exhaustive(&segment, &query, ceiling, bm25, top);
            proptest::prop_assert_eq!(pruned.len(), every.len());
            let close = |a: f32, b: f32| (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1.0);
            for (found, wanted) in pruned.iter().zip(&every) {
                // Same scores rank by rank (summing in another order moves the last bits)...
                proptest::prop_assert!(close(found.1, wanted.1), "{:?} vs {:?}", pruned, every);
            }
            // ...and each document found has the score the brute force gives it.
            for (key, score) in &pruned {
                let own = exhaustive(&segment, &query, ceiling, bm25, usize::MAX)
                    .into_iter()
                    .find(|(other, _)| other == key)
                    .map(|(_, score)| score);
                proptest::prop_assert!(own.is_some_and(|own| close(own, *score)), "key {}", key);
            }
        }
    }

    proptest::proptest! {
        #![proptest_config(proptest::test_runner::Config::with_cases(48))]

        /// Across replacements, removals, seals and merges, each live key's forward index holds
        /// its latest text's distinct said words (not its context words), and a word's
        /// document frequency counts the live documents posted under it, said or context,
        /// with or without a forward index.
        #[test]
        fn the_forward_index_and_frequencies_follow_the_live_documents(
            forward in proptest::bool::ANY,
            puts in proptest::collection::vec(
                (
                    0u32..300,
                    proptest::option::weighted(
                        0.9,
                        (
                            proptest::collection::vec(0u32..40, 1..10),
                            proptest::collection::vec(0u32..40, 0..4),
                        ),
                    ),
                ),
                1..900,
            ),
        ) {
            let mut segment = if forward {
                Segment::default()
            } else {
                Segment::without_forward_index()
            };
            let mut latest: std::collections::BTreeMap<u32, (Vec<TermId>, Vec<TermId>)> =
                std::collections::BTreeMap::new();
            for (n, (key, text)) in puts.iter().enumerate() {
                match text {
                    Some(text) => latest.insert(*key, text.clone()),
                    None => latest.remove(key),
                };
                segment.put(*key, text.clone(), n as u64 + 1);
            }
            for (key, (said, _)) in &latest {
                let mut distinct = said.clone();
                distinct.sort_unstable();
                distinct.dedup();
                if !forward {
                    distinct.clear();
                }
                proptest::prop_assert_eq!(segment.terms_of(*key), distinct.as_slice());
            }
            proptest::prop_assert_eq!(segment.len(), latest.len());
            for word in 0u32..40 {
                let live = latest
                    .values()
                    .filter(|(said, context)| {
                        said.contains(&word) || context.contains(&word)
                    })
                    .count();
                proptest::prop_assert_eq!(segment.doc_freq(word), live, "word {}", word);
            }
        }
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
            crate::record::record_exchange(
                &mut state,
                &crate::model::ExchangeInput {
                    session_id: "s".into(),
                    turn_id: format!("t{n}"),
                    user_text: "We went to the lake.".into(),
                    assistant_text: "Sounds fun.".into(),
                    event_time: Some(time.into()),
                    ..Default::default()
                },
                &crate::extract::HeuristicExtractor,
                &crate::config::MemoryConfig::default(),
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

    #[test]
    fn a_posting_holds_its_document_and_a_capped_count() {
        let last = PART_DOCS_MAX as u32 - 1;
        for (doc, tf) in [(0, 1), (7, 3), (last, 1), (last, TF_MAX as usize)] {
            let posting = Posting::new(doc, tf);
            assert_eq!((posting.doc(), posting.tf() as usize), (doc, tf));
        }
        assert_eq!(Posting::new(9, 1_000_000).tf(), TF_MAX);
        assert_eq!(Posting::new(9, 1_000_000).doc(), 9);
        assert_eq!(std::mem::size_of::<Posting>(), 4);
    }

    #[test]
    fn parts_merge_only_into_parts_a_posting_can_number() {
        assert!(merges(128, 128));
        assert!(merges(256, 128));
        assert!(!merges(512, 128));
        let half = PART_DOCS_MAX / 2;
        assert!(merges(half, half));
        assert!(!merges(half, half + 1));
        assert!(!merges(PART_DOCS_MAX, PART_DOCS_MAX));
    }

    /// Only the segments hybrid retrieval compares by meaning hold vectors: a summary's or an
    /// episode's would never be read.
    #[test]
    fn vectors_are_kept_for_the_segments_compared_by_meaning_only() {
        let said = [
            "My sister lives in Lisbon.",
            "I'm allergic to peanuts.",
            "I work as a nurse in Porto.",
        ];
        let turns: Vec<(&str, &str)> = (0..12)
            .map(|n| (said[n % said.len()], "Noted, I will keep that in mind."))
            .collect();
        let state = crate::record::test_support::recorded_with(&turns, |_| "s".into(), |_| None);
        let index = MemoryIndex::build(&state);
        let query = embed_text("where does my sister live").unwrap();
        assert!(index.raw.cosine(0, &query).is_some());
        let keys = |segment: &Segment| (0..segment.keys() as u32).collect::<Vec<u32>>();
        assert!(!index.facts.is_empty(), "no facts");
        assert!(!index.summaries.is_empty(), "no summaries");
        for key in keys(&index.facts) {
            assert!(index.facts.cosine(key, &query).is_some(), "fact {key}");
        }
        for key in keys(&index.summaries) {
            assert!(
                index.summaries.cosine(key, &query).is_none(),
                "summary {key}"
            );
        }
        for key in keys(&index.episodes) {
            assert!(
                index.episodes.cosine(key, &query).is_none(),
                "episode {key}"
            );
        }
        // Nor a slot per key to say so.
        assert_eq!(index.summaries.vectors.len(), 0);
        assert_eq!(index.episodes.vectors.len(), 0);
        assert_eq!(index.raw.vectors.len(), index.raw.keys());
    }
}
