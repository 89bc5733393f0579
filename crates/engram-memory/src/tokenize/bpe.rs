//! A compact byte-pair-encoding token counter with tiktoken's counts in a fraction of its memory.
//!
//! tiktoken-rs keeps every token's bytes three times (encoder, decoder, sorted list), each its
//! own allocation: about 40 MiB of heap for o200k and cl100k together, the largest single part of
//! the proxy's memory. Here a vocabulary is one byte arena and its rank offsets, written from
//! tiktoken-rs's own tables at build time (`build.rs`) and read in place from the binary, plus
//! one open-addressing table of ranks built at first use (2 MiB for o200k). The merge loops are
//! tiktoken's (MIT licence), counting parts instead of collecting ranks. The tests check every
//! token and count against tiktoken-rs.

use std::cell::RefCell;
use std::collections::BinaryHeap;
use std::hash::Hasher;
use std::sync::atomic::{AtomicU32, Ordering};

use regex::Regex;
use rustc_hash::FxHasher;

use crate::yielding;

const NO_RANK: u32 = u32::MAX;
/// tiktoken merges pieces this long or longer with a heap, shorter ones in a flat array.
const LARGE_PIECE: usize = 100;
/// Merged pieces up to this many bytes (most words) are remembered per thread, as Hugging
/// Face's BPE caches words: a word's count never changes, and in a long text the same words
/// come back again and again, while merging one costs a rank lookup per pair and per merge.
const CACHED_PIECE: usize = 23;
/// Slots of each thread's cache of merged pieces (32 bytes each, so 256 KiB), shared by the
/// vocabularies; a new piece overwrites whatever shares its slot.
const CACHE_SLOTS: usize = 8192;

/// Each vocabulary's own number, so cached counts are never read across vocabularies.
static NEXT_VOCABULARY: AtomicU32 = AtomicU32::new(1);

/// A merged piece's count, with the piece itself (so a hash collision is a miss, never a
/// wrong count) and the vocabulary that counted it (0: a free slot).
#[derive(Clone, Copy)]
struct CachedPiece {
    vocabulary: u32,
    count: u32,
    len: u8,
    bytes: [u8; CACHED_PIECE],
}

const FREE_SLOT: CachedPiece = CachedPiece {
    vocabulary: 0,
    count: 0,
    len: 0,
    bytes: [0; CACHED_PIECE],
};

thread_local! {
    /// Allocated on a thread's first merge of a short piece; only threads that count (the
    /// worker's, the admin API's) ever hold one.
    static MERGED_PIECES: RefCell<Vec<CachedPiece>> = const { RefCell::new(Vec::new()) };
}

/// tiktoken's pre-tokenizer on the `regex` crate's automata. tiktoken's patterns end in
/// `\s+(?!\S)|\s+` (o200k) or `\s+(?!\S)|\s` (cl100k), and that look-ahead needs a
/// backtracking engine (`fancy-regex`), which took two thirds of counting's time. Here the
/// pattern ends in a plain `\s+` instead, and a match of it is cut as the look-ahead would
/// cut it: a run of two or more whitespace characters that a non-whitespace character follows
/// loses its last one (which starts the next piece, as in `" word"`). Only that alternative
/// matches whitespace alone that neither ends the text nor ends in `\r` or `\n` (an
/// alternative before it takes every run that holds a line break, up to its last break; a run
/// that reaches the end is cl100k's `\s+$` or, in o200k, this one, and is never cut). The
/// patterns carry no possessive quantifiers either: in tiktoken's, none could give anything
/// back to what follows them. A test checks the pieces against `fancy-regex` on tiktoken's
/// own patterns.
struct Pretokenizer {
    regex: Regex,
}

impl Pretokenizer {
    fn new(pattern: &str) -> Option<Pretokenizer> {
        Regex::new(pattern).ok().map(|regex| Pretokenizer { regex })
    }

    /// The pieces of `text`. One `find_iter` runs until a match is cut, and a new one starts
    /// where the cut left off (the patterns have no look-behind, so a search of the rest finds
    /// what a search from that position of the whole would): each search takes a cache from
    /// the regex's pool, which from any thread but the first to use it costs a lock, too much
    /// per piece.
    fn pieces<'t>(&'t self, text: &'t str) -> impl Iterator<Item = &'t str> + 't {
        let mut base = 0;
        let mut matches = self.regex.find_iter(text);
        std::iter::from_fn(move || {
            let found = matches.next()?;
            let piece = found.as_str();
            let start = base + found.start();
            let mut end = base + found.end();
            if end < text.len()
                && !piece.ends_with(['\r', '\n'])
                && piece.chars().all(char::is_whitespace)
                && let Some((last, _)) = piece.char_indices().next_back()
                && last > 0
            {
                end = start + last;
                base = end;
                matches = self.regex.find_iter(text.get(end..).unwrap_or_default());
            }
            text.get(start..end)
        })
    }
}

pub struct Bpe {
    /// This vocabulary's number in the per-thread cache of merged pieces.
    vocabulary: u32,
    /// The pre-tokenizer; `None` only if the pattern failed to compile, when every byte counts
    /// as a token (an upper bound, so budgets still hold).
    pretokenizer: Option<Pretokenizer>,
    /// Every token's bytes, in rank order.
    bytes: &'static [u8],
    /// Token `rank` is `bytes[start(rank)..start(rank + 1)]` (empty for unused ranks); the
    /// starts are little-endian u32s, read in place.
    starts: &'static [u8],
    /// Open addressing by the hash of a token's bytes: a rank, or `NO_RANK` for a free slot.
    slots: Vec<u32>,
}

impl Bpe {
    /// The counter over tables `build.rs` wrote; `pattern` must be the pre-tokenizer pattern
    /// of the encoding they were read from, as the pre-tokenizer takes it (`Pretokenizer`).
    pub fn from_tables(bytes: &'static [u8], starts: &'static [u8], pattern: &str) -> Bpe {
        let tokens = (starts.len() / 4).saturating_sub(1);
        let mut bpe = Bpe {
            vocabulary: NEXT_VOCABULARY.fetch_add(1, Ordering::Relaxed),
            pretokenizer: Pretokenizer::new(pattern),
            bytes,
            starts,
            slots: vec![NO_RANK; (tokens * 2).next_power_of_two().max(2)],
        };
        for rank in 0..tokens {
            let Ok(rank) = u32::try_from(rank) else { break };
            let token = bpe.token(rank);
            if token.is_empty() {
                continue;
            }
            let mut slot = bpe.home_slot(token);
            while bpe.slots[slot] != NO_RANK {
                slot = (slot + 1) & (bpe.slots.len() - 1);
            }
            bpe.slots[slot] = rank;
        }
        bpe
    }

    /// The pre-tokenizer's pieces of `text`.
    #[cfg(test)]
    pub fn pieces(&self, text: &str) -> Vec<String> {
        self.pretokenizer
            .iter()
            .flat_map(|pretokenizer| pretokenizer.pieces(text))
            .map(str::to_string)
            .collect()
    }

    /// Tokens in the vocabulary (special tokens not included).
    #[cfg(test)]
    pub fn vocabulary_len(&self) -> usize {
        self.slots.iter().filter(|&&rank| rank != NO_RANK).count()
    }

    /// Tokens of `text`, as tiktoken's `count_ordinary` counts them (special-token text is
    /// ordinary text).
    pub fn count(&self, text: &str) -> usize {
        let Some(pretokenizer) = &self.pretokenizer else {
            return text.len();
        };
        let mut count = 0;
        for piece in pretokenizer.pieces(text) {
            count += self.piece_count(piece.as_bytes());
            // Long texts take milliseconds to count; on the worker, requests come first.
            yielding::checkpoint();
        }
        count
    }

    fn piece_count(&self, piece: &[u8]) -> usize {
        if piece.len() <= 1 || self.rank(piece) != NO_RANK {
            piece.len().min(1)
        } else if piece.len() <= CACHED_PIECE {
            self.merge_cached(piece)
        } else if piece.len() < LARGE_PIECE {
            self.merge_small(piece)
        } else {
            self.merge_large(piece)
        }
    }

    fn token(&self, rank: u32) -> &[u8] {
        let rank = rank as usize;
        match (self.start(rank), self.start(rank + 1)) {
            (Some(start), Some(end)) => self.bytes.get(start..end).unwrap_or_default(),
            _ => &[],
        }
    }

    fn start(&self, rank: usize) -> Option<usize> {
        let at = rank.checked_mul(4)?;
        let word = self.starts.get(at..at.checked_add(4)?)?;
        Some(u32::from_le_bytes(word.try_into().ok()?) as usize)
    }

    fn home_slot(&self, bytes: &[u8]) -> usize {
        let mut hasher = FxHasher::default();
        hasher.write(bytes);
        (hasher.finish() as usize) & (self.slots.len() - 1)
    }

    /// The rank of the token with exactly these bytes, or `NO_RANK`.
    fn rank(&self, bytes: &[u8]) -> u32 {
        let mask = self.slots.len() - 1;
        let mut slot = self.home_slot(bytes);
        loop {
            let rank = self.slots[slot];
            if rank == NO_RANK || self.token(rank) == bytes {
                return rank;
            }
            slot = (slot + 1) & mask;
        }
    }

    /// `merge_small` through this thread's cache of merged pieces.
    fn merge_cached(&self, piece: &[u8]) -> usize {
        let slot = self.home_slot(piece) & (CACHE_SLOTS - 1);
        let hit = MERGED_PIECES.with_borrow(|cache| {
            cache.get(slot).and_then(|cached| {
                let len = usize::from(cached.len);
                (cached.vocabulary == self.vocabulary && cached.bytes.get(..len) == Some(piece))
                    .then_some(cached.count as usize)
            })
        });
        if let Some(count) = hit {
            return count;
        }
        let count = self.merge_small(piece);
        let mut bytes = [0; CACHED_PIECE];
        bytes[..piece.len()].copy_from_slice(piece);
        MERGED_PIECES.with_borrow_mut(|cache| {
            if cache.is_empty() {
                cache.resize(CACHE_SLOTS, FREE_SLOT);
            }
            cache[slot] = CachedPiece {
                vocabulary: self.vocabulary,
                count: u32::try_from(count).unwrap_or(u32::MAX),
                len: piece.len() as u8,
                bytes,
            };
        });
        count
    }

    /// tiktoken's `_byte_pair_merge`: parts are (start, rank of the pair starting there); the
    /// lowest-ranked pair merges first, leftmost on ties, until no pair is a token.
    fn merge_small(&self, piece: &[u8]) -> usize {
        let mut parts = [(0usize, NO_RANK); LARGE_PIECE + 1];
        let mut len = 0;
        let mut min = (NO_RANK, usize::MAX);
        for start in 0..piece.len() - 1 {
            let rank = self.rank(&piece[start..start + 2]);
            if rank < min.0 {
                min = (rank, start);
            }
            parts[len] = (start, rank);
            len += 1;
        }
        parts[len] = (piece.len() - 1, NO_RANK);
        parts[len + 1] = (piece.len(), NO_RANK);
        len += 2;

        // The rank of part `i` merged with the next: the bytes up to the part after next, as
        // part `i + 1` is still there when this is asked.
        let rank_after_merge = |parts: &[(usize, u32)], len: usize, i: usize| {
            if i + 3 < len {
                self.rank(&piece[parts[i].0..parts[i + 3].0])
            } else {
                NO_RANK
            }
        };
        while min.0 != NO_RANK {
            let i = min.1;
            if i > 0 {
                parts[i - 1].1 = rank_after_merge(&parts, len, i - 1);
            }
            parts[i].1 = rank_after_merge(&parts, len, i);
            parts.copy_within(i + 2..len, i + 1);
            len -= 1;
            min = (NO_RANK, usize::MAX);
            for (i, &(_, rank)) in parts[..len - 1].iter().enumerate() {
                if rank < min.0 {
                    min = (rank, i);
                }
            }
        }
        len - 1
    }

    /// tiktoken's `_byte_pair_merge_large`: the same merges in the same order, found with a
    /// heap so a long piece (a run of spaces or symbols) costs O(n log n), not O(n²).
    fn merge_large(&self, piece: &[u8]) -> usize {
        struct Part {
            prev: usize,
            end: usize,
            next_end: usize,
            next_rank: u32,
        }
        #[derive(PartialEq, Eq)]
        struct Merge {
            start: usize,
            rank: u32,
        }
        impl Ord for Merge {
            // Lowest rank first, then leftmost: BinaryHeap pops the greatest.
            fn cmp(&self, other: &Self) -> std::cmp::Ordering {
                other
                    .rank
                    .cmp(&self.rank)
                    .then_with(|| other.start.cmp(&self.start))
            }
        }
        impl PartialOrd for Merge {
            fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
                Some(self.cmp(other))
            }
        }

        let mut parts: Vec<Part> = (0..piece.len())
            .map(|start| Part {
                prev: start.wrapping_sub(1),
                end: start + 1,
                next_end: start + 2,
                next_rank: NO_RANK,
            })
            .collect();
        let mut heap = BinaryHeap::with_capacity(piece.len());
        for start in 0..piece.len() - 1 {
            let rank = self.rank(&piece[start..start + 2]);
            if rank != NO_RANK {
                heap.push(Merge { start, rank });
                parts[start].next_rank = rank;
            }
        }
        let offer =
            |parts: &mut [Part], heap: &mut BinaryHeap<Merge>, start: usize, next_end: usize| {
                parts[start].next_end = next_end;
                parts[start].next_rank = NO_RANK;
                if next_end <= piece.len() {
                    let rank = self.rank(&piece[start..next_end]);
                    if rank != NO_RANK {
                        heap.push(Merge { start, rank });
                        parts[start].next_rank = rank;
                    }
                }
            };
        while let Some(left) = heap.pop() {
            if left.rank != parts[left.start].next_rank {
                continue; // invalidated by an earlier merge
            }
            let left_start = left.start;
            let right_start = parts[left_start].end;
            let right_end = parts[left_start].next_end;
            let right_next_end = parts[right_start].next_end;
            parts[left_start].end = right_end;
            offer(&mut parts, &mut heap, left_start, right_next_end);
            if right_end < parts.len() {
                parts[right_end].prev = left_start;
            }
            if left_start > 0 {
                let prev_start = parts[left_start].prev;
                offer(&mut parts, &mut heap, prev_start, right_end);
            }
            parts[right_start].next_rank = NO_RANK;
        }

        let mut count = 0;
        let mut start = 0;
        while start < parts.len() {
            count += 1;
            start = parts[start].end;
        }
        count
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tokens::Encoding;
    use proptest::prelude::*;
    use tiktoken_rs::CoreBPE;

    fn both() -> [(Encoding, &'static CoreBPE); 2] {
        [
            (Encoding::O200k, tiktoken_rs::o200k_base_singleton()),
            (Encoding::Cl100k, tiktoken_rs::cl100k_base_singleton()),
        ]
    }

    fn assert_same_counts(text: &str) {
        for (encoding, tiktoken) in both() {
            assert_eq!(
                encoding.bpe().count(text),
                tiktoken.count_ordinary(text),
                "{encoding:?} on {text:?}"
            );
        }
    }

    #[test]
    fn vocabularies_are_tiktokens_without_the_special_tokens() {
        assert_eq!(Encoding::O200k.bpe().vocabulary_len(), 199_998);
        assert_eq!(Encoding::Cl100k.bpe().vocabulary_len(), 100_256);
        for (encoding, tiktoken) in both() {
            let bpe = encoding.bpe();
            let special = tiktoken.special_tokens();
            for rank in 0..(1 << 18) {
                let token = tiktoken
                    .decode_bytes(&[rank])
                    .ok()
                    .filter(|token| !std::str::from_utf8(token).is_ok_and(|t| special.contains(t)))
                    .unwrap_or_default();
                assert_eq!(bpe.token(rank), token, "{encoding:?} rank {rank}");
                if !token.is_empty() {
                    assert_eq!(bpe.rank(&token), rank, "{encoding:?} rank {rank}");
                }
            }
        }
    }

    #[test]
    fn counts_match_tiktoken_on_real_shaped_text() {
        for text in [
            "",
            "hello world",
            "I'm allergic to peanuts; my sister's flat in Lisbon is at 221B Baker St.",
            "- [8 May, 2023] user: I can't eat nuts!! | assistant: Noted.\n",
            "```rust\nfn main() {\n    println!(\"{}\", 1_000_000);\n}\n```\n",
            "東京に住んでいます。 Ich wohne in München. 🎉🎉 ÉCOLE    \t\n\n  ",
            "<|endoftext|> is ordinary text here",
            "https://example.com/a/b?c=d&e=f#g",
        ] {
            assert_same_counts(text);
        }
    }

    #[test]
    fn remembered_pieces_keep_each_vocabularys_count() {
        // Words that both vocabularies split, in both orders, so each encoding meets pieces
        // the other one left in the thread's cache (same bytes, same slot).
        let text = "kalomiren stavoth ulpedri ansogel martuix kalomiren stavoth ulpedri";
        for _ in 0..3 {
            assert_same_counts(text);
            for (encoding, tiktoken) in both().into_iter().rev() {
                assert_eq!(encoding.bpe().count(text), tiktoken.count_ordinary(text));
            }
        }
        // Cached pieces are at most CACHED_PIECE bytes; one byte longer is merged every time.
        assert_same_counts(&"x".repeat(CACHED_PIECE + 1));
        assert_same_counts(&"qz".repeat(CACHED_PIECE));
    }

    #[test]
    fn long_pieces_take_the_heap_merge_and_still_match() {
        // Single pre-tokenizer pieces of 100+ bytes: symbols, spaces, one long word, digits.
        for text in [
            "!@#$%^&*()_+-=[]{}|;:,.<>?/~`".repeat(8),
            " ".repeat(300),
            "Supercalifragilisticexpialidocious".repeat(6),
            "\u{1F600}\u{1F4A9}".repeat(40),
            "9".repeat(250),
            "ab".repeat(2_000),
        ] {
            assert_same_counts(&text);
        }
    }

    proptest! {
        #[test]
        fn counts_match_tiktoken(text in "([a-zA-Z]{1,12}|[0-9]{1,5}|[ \t\n\r]{1,4}|[.,!?;:'\"()\\-/]{1,3}|[éüßøçÉ]|[東京語]|[\u{1F600}-\u{1F64F}]|[^\u{0}-\u{7f}]){0,60}") {
            assert_same_counts(&text);
        }

        #[test]
        fn counts_match_tiktoken_on_long_runs(unit in "[a-z!? \u{e9}\u{6771}]{1,3}", repeat in 30usize..200) {
            assert_same_counts(&unit.repeat(repeat));
        }
    }
}
