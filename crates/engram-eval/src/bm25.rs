//! A plain BM25 ranker over a conversation's raw dialogue turns, for the BM25 baseline. It uses
//! engram's own term function (lower-case, stop-words dropped, light stemming), so the baseline
//! and engram tokenize text the same way and differ only in what they do with it.

use std::collections::HashMap;

use engram_memory::text::terms;

pub struct Bm25Index {
    k1: f64,
    b: f64,
    doc_len: Vec<f64>,
    average_len: f64,
    /// term -> (document, term frequency), documents ascending.
    postings: HashMap<String, Vec<(usize, u32)>>,
}

impl Bm25Index {
    /// Indexes `documents`; document `i` is ranked as `i`.
    pub fn new<'a>(documents: impl IntoIterator<Item = &'a str>) -> Bm25Index {
        let mut doc_len = Vec::new();
        let mut postings: HashMap<String, Vec<(usize, u32)>> = HashMap::new();
        for (doc, text) in documents.into_iter().enumerate() {
            let mut counts: HashMap<String, u32> = HashMap::new();
            let mut length = 0usize;
            for term in terms(text) {
                *counts.entry(term).or_default() += 1;
                length += 1;
            }
            doc_len.push(length as f64);
            for (term, tf) in counts {
                postings.entry(term).or_default().push((doc, tf));
            }
        }
        let average_len = if doc_len.is_empty() {
            0.0
        } else {
            doc_len.iter().sum::<f64>() / doc_len.len() as f64
        };
        Bm25Index {
            k1: 1.2,
            b: 0.75,
            doc_len,
            average_len,
            postings,
        }
    }

    /// Documents matching at least one query term, best first (ties by position).
    pub fn rank(&self, query: &str) -> Vec<(usize, f64)> {
        let n = self.doc_len.len() as f64;
        let mut query_terms: Vec<String> = terms(query).collect();
        query_terms.sort();
        query_terms.dedup();
        let mut scores: HashMap<usize, f64> = HashMap::new();
        for term in &query_terms {
            let Some(postings) = self.postings.get(term) else {
                continue;
            };
            let df = postings.len() as f64;
            let idf = (1.0 + (n - df + 0.5) / (df + 0.5)).ln();
            for (doc, tf) in postings {
                let tf = f64::from(*tf);
                let norm = 1.0 - self.b + self.b * self.doc_len[*doc] / self.average_len.max(1e-9);
                *scores.entry(*doc).or_default() +=
                    idf * tf * (self.k1 + 1.0) / (tf + self.k1 * norm);
            }
        }
        let mut ranked: Vec<(usize, f64)> = scores.into_iter().collect();
        ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        ranked
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rare_matching_terms_rank_first() {
        let index = Bm25Index::new([
            "Ann: I adopted a cat named Tom.",
            "Bob: The weather is nice today.",
            "Ann: My cat sleeps all day, the cat is lazy.",
            "Bob: I went hiking.",
        ]);
        let ranked = index.rank("What is the name of the cat Ann adopted?");
        let order: Vec<usize> = ranked.iter().map(|(doc, _)| *doc).collect();
        assert_eq!(order, [0, 2]);
        assert!(ranked[0].1 > ranked[1].1);
        assert!(index.rank("zebra").is_empty());
    }
}
