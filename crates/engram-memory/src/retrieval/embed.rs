//! Static word-piece embeddings for semantic recall: a text's vector is the weighted mean of
//! its BERT word pieces' vectors (a model2vec-style distillation of all-MiniLM-L6-v2, built by
//! `scripts/build-embeddings.py` into `models/minilm-static-256.bin` and embedded in the binary).
//! Microseconds per text, so the worker embeds every item and the hot path embeds the query.
//!
//! Pure: the model is parsed once from bytes compiled into the binary; no I/O, no clock.
//!
//! A query's vector is int8 with one scale (256 bytes + 4) and a 256-bit sign code. An item's
//! vector is kept packed, 4 bits a component ([`Packed`], 164 bytes in all): it is held for
//! every item of every cached memory, and the half it saves cost 0.002 of evidence recall at
//! 2,048 tokens on LoCoMo's development split (docs/evaluation.md). A long history is first
//! ranked by Hamming distance between sign codes (a popcount per word) and only the closest
//! few hundred are scored by their dot product.

use std::collections::HashMap;
use std::sync::LazyLock;

use super::embed_tables::{ACCENTED, FORMAT, NONSPACING_MARKS, PUNCTUATION};

/// Dimensions of a vector.
pub const DIMS: usize = 256;
/// Words of a sign code.
const CODE_WORDS: usize = DIMS / 64;
/// BERT's limit: a longer word is one unknown token.
const MAX_WORD_CHARS: usize = 100;
/// Texts are embedded from at most this many bytes: a pasted document's vector is its opening's
/// (and a turn's cost in the worker stays bounded).
pub const MAX_EMBED_BYTES: usize = 16 * 1024;

static MODEL_BYTES: &[u8] = include_bytes!("../../../../models/minilm-static-256.bin");

/// The shipped model, parsed on first use; `None` if the embedded file is malformed (a build
/// bug, caught by the tests; retrieval then stays lexical rather than failing requests).
static MODEL: LazyLock<Option<StaticModel>> =
    LazyLock::new(|| StaticModel::parse(MODEL_BYTES).ok());

/// The shipped model.
pub fn model() -> Option<&'static StaticModel> {
    MODEL.as_ref()
}

/// sha256 of `models/minilm-static-256.bin`, as `scripts/build-embeddings.py` prints it.
pub const MODEL_SHA256: &str = "4934faa18d9a55e914c2f444e6f4e90fe71ceb4cd76d11ca446ff41ac993eae8";

/// Why a model file was rejected.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadModel(pub &'static str);

/// A static embedding model: a word-piece vocabulary and one int8 row (with its scale) per
/// piece.
pub struct StaticModel {
    /// Word piece (continuations with their `##`) -> row.
    rows: HashMap<Box<str>, u32, foldhash::fast::FixedState>,
    /// Row -> the piece's id in the upstream `tokenizer.json` (for tests against it).
    token_ids: Vec<u16>,
    scales: Vec<f32>,
    /// The int8 rows, read in place from the file's bytes (the shipped model is in the
    /// binary): a copy would be 7.5 MB more of every process's memory.
    weights: &'static [u8],
    unknown: Option<u32>,
}

impl std::fmt::Debug for StaticModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StaticModel")
            .field("rows", &self.scales.len())
            .finish_non_exhaustive()
    }
}

/// A cursor over the model file.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], BadModel> {
        if self.bytes.len() < n {
            return Err(BadModel("truncated"));
        }
        let (head, tail) = self.bytes.split_at(n);
        self.bytes = tail;
        Ok(head)
    }

    fn u32(&mut self) -> Result<u32, BadModel> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

impl StaticModel {
    /// Parses the layout `scripts/build-embeddings.py` writes (see there).
    pub fn parse(bytes: &'static [u8]) -> Result<StaticModel, BadModel> {
        let mut r = Reader { bytes };
        if r.take(4)? != b"EGSM" {
            return Err(BadModel("not an engram static model"));
        }
        if r.u32()? != 1 {
            return Err(BadModel("unknown version"));
        }
        let rows = r.u32()? as usize;
        if r.u32()? as usize != DIMS {
            return Err(BadModel("dimensions differ from DIMS"));
        }
        let mut vocab = HashMap::with_capacity_and_hasher(rows, Default::default());
        let mut token_ids = Vec::with_capacity(rows);
        for row in 0..rows {
            let head = r.take(3)?;
            token_ids.push(u16::from_le_bytes([head[0], head[1]]));
            let text = std::str::from_utf8(r.take(usize::from(head[2]))?)
                .map_err(|_| BadModel("token is not UTF-8"))?;
            vocab.insert(Box::from(text), u32::try_from(row).unwrap_or(u32::MAX));
        }
        let scales = r
            .take(rows * 4)?
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let weights = r.take(rows * DIMS)?;
        if !r.bytes.is_empty() {
            return Err(BadModel("trailing bytes"));
        }
        let unknown = vocab.get("[UNK]").copied();
        Ok(StaticModel {
            rows: vocab,
            token_ids,
            scales,
            weights,
            unknown,
        })
    }

    pub fn rows(&self) -> usize {
        self.scales.len()
    }

    /// The rows of `text`'s word pieces, as BERT's uncased tokenizer splits it (unknown words
    /// as `[UNK]`'s row).
    pub fn tokenize(&self, text: &str) -> Vec<u32> {
        let mut out = Vec::new();
        for word in pre_tokenize(&normalize(text)) {
            self.word_pieces(&word, &mut out);
        }
        out
    }

    /// `tokenize` as the upstream tokenizer's ids.
    pub fn token_ids(&self, text: &str) -> Vec<u32> {
        self.tokenize(text)
            .into_iter()
            .filter_map(|row| self.token_ids.get(row as usize).map(|id| u32::from(*id)))
            .collect()
    }

    /// Greedy longest-match-first word pieces of one word; all of it unknown if any part is.
    fn word_pieces(&self, word: &str, out: &mut Vec<u32>) {
        let unknown = |out: &mut Vec<u32>| out.extend(self.unknown);
        if word.chars().count() > MAX_WORD_CHARS {
            unknown(out);
            return;
        }
        let before = out.len();
        let mut piece = String::with_capacity(word.len() + 2);
        let mut start = 0;
        while start < word.len() {
            let mut end = word.len();
            let mut found = None;
            while end > start {
                piece.clear();
                if start > 0 {
                    piece.push_str("##");
                }
                piece.push_str(&word[start..end]);
                if let Some(row) = self.rows.get(piece.as_str()) {
                    found = Some(*row);
                    break;
                }
                // Back off one character, not one byte.
                end = word[..end]
                    .char_indices()
                    .next_back()
                    .map_or(start, |(at, _)| at);
            }
            match found {
                Some(row) => {
                    out.push(row);
                    start = end;
                }
                None => {
                    out.truncate(before);
                    unknown(out);
                    return;
                }
            }
        }
    }

    /// The unit vector of `text`: its known pieces' rows, each times its scale, summed and
    /// normalised; `None` when no piece is known (empty or all unknown).
    pub fn embed(&self, text: &str) -> Option<Vector> {
        let text = clip(text, MAX_EMBED_BYTES);
        let mut sum = [0f32; DIMS];
        let mut any = false;
        for row in self.tokenize(text) {
            if Some(row) == self.unknown {
                continue;
            }
            let row = row as usize;
            let (Some(scale), Some(weights)) = (
                self.scales.get(row),
                self.weights.get(row * DIMS..(row + 1) * DIMS),
            ) else {
                continue;
            };
            for (slot, weight) in sum.iter_mut().zip(weights) {
                *slot += scale * f32::from(i8::from_le_bytes([*weight]));
            }
            any = true;
        }
        any.then(|| Vector::from_f32(&sum)).flatten()
    }
}

/// The longest prefix of `text` of at most `max` bytes ending on a character boundary.
fn clip(text: &str, max: usize) -> &str {
    if text.len() <= max {
        return text;
    }
    let mut end = max;
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    &text[..end]
}

/// A unit vector as int8 components with one scale, and the signs of its components.
#[derive(Debug, Clone, PartialEq)]
pub struct Vector {
    pub scale: f32,
    pub values: Box<[i8; DIMS]>,
    pub code: Code,
    /// The sum of `values` (see [`PACKED_OFFSET`]).
    sum: i32,
}

/// One bit per dimension: set where the component is positive.
pub type Code = [u64; CODE_WORDS];

impl Vector {
    /// Normalises and quantises; `None` for a zero vector.
    pub fn from_f32(values: &[f32; DIMS]) -> Option<Vector> {
        let norm = values.iter().map(|v| v * v).sum::<f32>().sqrt();
        let peak = values.iter().fold(0f32, |peak, v| peak.max(v.abs()));
        if !(norm > 0.0 && peak > 0.0 && norm.is_finite()) {
            return None;
        }
        let step = peak / 127.0;
        let mut quantised = Box::new([0i8; DIMS]);
        let mut code = [0u64; CODE_WORDS];
        for (at, (slot, value)) in quantised.iter_mut().zip(values).enumerate() {
            // Within ±127 by construction of `step`.
            *slot = (value / step).round().clamp(-127.0, 127.0) as i8;
            if *value > 0.0 {
                code[at / 64] |= 1 << (at % 64);
            }
        }
        Some(Vector {
            scale: step / norm,
            sum: quantised.iter().map(|value| i32::from(*value)).sum(),
            values: quantised,
            code,
        })
    }

    /// Cosine similarity with `other` (both unit vectors, up to quantisation).
    pub fn cosine(&self, other: &Vector) -> f32 {
        dot(&self.values, &other.values) as f32 * self.scale * other.scale
    }

    /// Dimensions whose signs differ: a cheap stand-in for the angle between the two.
    pub fn hamming(&self, code: &Code) -> u32 {
        self.code
            .iter()
            .zip(code)
            .map(|(a, b)| (a ^ b).count_ones())
            .sum()
    }
}

/// The largest magnitude of a packed component: 4 bits, signed, kept symmetric.
const PACKED_PEAK: f32 = 7.0;

/// What a packed component is stored plus: `v + 8` (1..=15) needs no sign extended when it is
/// unpacked, only a mask or a shift, and the query's dot product with the offsets is 8 times
/// the sum of its components, taken off once.
const PACKED_OFFSET: i32 = 8;

/// An item's unit vector as stored in an index segment: components in 4 bits each (−7..=7,
/// stored plus 8, `PACKED_OFFSET`; byte `i` holding component `i` in its low half and
/// `i + DIMS/2` in its high half, so both halves meet the query's components in order), its
/// scale, and the sign code of the original. Compared with a query [`Vector`] only.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    scale: f32,
    nibbles: [u8; DIMS / 2],
    pub code: Code,
}

impl Packed {
    /// `vector` requantised to 4 bits a component (its sign code kept).
    pub fn of(vector: &Vector) -> Packed {
        let peak = vector
            .values
            .iter()
            .fold(0i32, |peak, v| peak.max(i32::from(*v).abs()))
            .max(1) as f32;
        let quantise = |v: i8| {
            // Within ±7 by construction of `peak`.
            (f32::from(v) * PACKED_PEAK / peak)
                .round()
                .clamp(-PACKED_PEAK, PACKED_PEAK) as i8
        };
        let mut nibbles = [0u8; DIMS / 2];
        let mut norm = 0i32;
        let (low, high) = vector.values.split_at(DIMS / 2);
        for ((byte, lo), hi) in nibbles.iter_mut().zip(low).zip(high) {
            let (lo, hi) = (quantise(*lo), quantise(*hi));
            norm += i32::from(lo) * i32::from(lo) + i32::from(hi) * i32::from(hi);
            // Within 1..=15 by construction of `quantise`.
            let stored = |v: i8| (i32::from(v) + PACKED_OFFSET) as u8;
            *byte = stored(lo) | (stored(hi) << 4);
        }
        Packed {
            scale: if norm > 0 {
                1.0 / (norm as f32).sqrt()
            } else {
                0.0
            },
            nibbles,
            code: vector.code,
        }
    }

    /// Cosine similarity with the query `query` (up to quantisation).
    pub fn cosine(&self, query: &Vector) -> f32 {
        let dot = dot_packed(&query.values, &self.nibbles) - PACKED_OFFSET * query.sum;
        dot as f32 * query.scale * self.scale
    }
}

/// A query's int8 components times packed 4-bit ones as stored (plus [`PACKED_OFFSET`]),
/// summed in i32: per byte, the low half meets component `i`, the high half component
/// `i + DIMS/2`, in 16 lane sums as in [`dot`] (127·15 twice fits an i16). Unsigned halves
/// measured a third faster than sign-extending them (16 against 24 ns a product, 4,096
/// vectors; a query widened to i16 beforehand vectorised badly, 70 ns).
fn dot_packed(query: &[i8; DIMS], nibbles: &[u8; DIMS / 2]) -> i32 {
    let (low, high) = query.split_at(DIMS / 2);
    let mut lanes = [0i32; 16];
    for ((lo, hi), packed) in low
        .chunks_exact(16)
        .zip(high.chunks_exact(16))
        .zip(nibbles.chunks_exact(16))
    {
        for (((lane, q_lo), q_hi), byte) in lanes.iter_mut().zip(lo).zip(hi).zip(packed) {
            let n_lo = i16::from(*byte & 0x0F);
            let n_hi = i16::from(*byte >> 4);
            *lane += i32::from(i16::from(*q_lo) * n_lo + i16::from(*q_hi) * n_hi);
        }
    }
    lanes.iter().sum()
}

/// Reads one byte of every cache line of each vector, so that their cache misses overlap
/// before any is scored. Scoring a few hundred vectors scattered over a long history one
/// after another stalled on each one's first line: in a profile at 20,000 turns, three
/// fifths of the dot products' time sat on that load. This loop has no work besides the
/// loads, so the processor keeps many of them in flight at once.
pub fn warm<'a>(vectors: impl Iterator<Item = &'a Packed>) {
    let mut seen = 0u8;
    for vector in vectors {
        for at in (0..DIMS / 2).step_by(64).chain([DIMS / 2 - 1]) {
            seen ^= vector.nibbles[at];
        }
        seen ^= vector.code[0] as u8;
    }
    // Keeps the loads: their result is otherwise unused.
    std::hint::black_box(seen);
}

/// i8·i8 summed in i32. Products taken in i16 (|127·127| and 128·128 fit) into 16 lane
/// sums that stay in vector registers, added together once at the end: the shape LLVM turns
/// into multiply-add instructions without target flags (the plain i32 form measured ~3×
/// slower, a horizontal sum per block of 32 about 1.5×).
fn dot(a: &[i8; DIMS], b: &[i8; DIMS]) -> i32 {
    let mut lanes = [0i32; 16];
    for (x, y) in a.chunks_exact(16).zip(b.chunks_exact(16)) {
        for ((lane, p), q) in lanes.iter_mut().zip(x).zip(y) {
            *lane += i32::from(i16::from(*p) * i16::from(*q));
        }
    }
    lanes.iter().sum()
}

fn in_ranges(table: &[(u32, u32)], c: char) -> bool {
    let c = c as u32;
    table
        .binary_search_by(|(lo, hi)| {
            if *hi < c {
                std::cmp::Ordering::Less
            } else if *lo > c {
                std::cmp::Ordering::Greater
            } else {
                std::cmp::Ordering::Equal
            }
        })
        .is_ok()
}

fn is_control(c: char) -> bool {
    !matches!(c, '\t' | '\n' | '\r') && (c.is_control() || in_ranges(FORMAT, c))
}

fn is_punctuation(c: char) -> bool {
    c.is_ascii_punctuation() || (!c.is_ascii() && in_ranges(PUNCTUATION, c))
}

/// CJK ideographs, which BERT splits one by one (not hiragana, katakana or hangul).
fn is_cjk(c: char) -> bool {
    matches!(c as u32,
        0x4E00..=0x9FFF | 0x3400..=0x4DBF | 0x20000..=0x2A6DF | 0x2A700..=0x2B73F
        | 0x2B740..=0x2B81F | 0x2B920..=0x2CEAF | 0xF900..=0xFAFF | 0x2F800..=0x2FA1F)
}

/// The accent-free form of a precomposed letter (NFD, marks removed), for the scripts the
/// table covers; other decomposable letters (e.g. Hangul syllables) are left whole, a known
/// difference from BERT's NFD that only changes how such words split.
fn strip_accent(c: char) -> char {
    let code = c as u32;
    match ACCENTED.binary_search_by_key(&code, |(from, _)| *from) {
        Ok(at) => ACCENTED
            .get(at)
            .and_then(|(_, to)| char::from_u32(*to))
            .unwrap_or(c),
        Err(_) => c,
    }
}

/// BERT's uncased normaliser: control characters removed, whitespace to spaces, CJK
/// ideographs spaced apart, accents stripped, lowercased.
fn normalize(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        if c == '\0' || c == '\u{FFFD}' || is_control(c) {
            continue;
        }
        if c.is_whitespace() {
            out.push(' ');
        } else if is_cjk(c) {
            out.push(' ');
            out.push(c);
            out.push(' ');
        } else if in_ranges(NONSPACING_MARKS, c) {
            continue;
        } else {
            out.extend(strip_accent(c).to_lowercase());
        }
    }
    out
}

/// Words split on whitespace, each punctuation character a word of its own.
fn pre_tokenize(text: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    for c in text.chars() {
        if c.is_whitespace() || is_punctuation(c) {
            if !word.is_empty() {
                words.push(std::mem::take(&mut word));
            }
            if !c.is_whitespace() {
                words.push(c.to_string());
            }
        } else {
            word.push(c);
        }
    }
    if !word.is_empty() {
        words.push(word);
    }
    words
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shipped() -> &'static StaticModel {
        model().expect("the embedded model parses")
    }

    #[test]
    fn the_shipped_model_is_the_one_the_script_built() {
        use std::fmt::Write;
        let digest = ring::digest::digest(&ring::digest::SHA256, MODEL_BYTES);
        let hex = digest.as_ref().iter().fold(String::new(), |mut out, b| {
            let _ = write!(out, "{b:02x}");
            out
        });
        assert_eq!(hex, MODEL_SHA256);
        assert_eq!(shipped().rows(), 29_528);
    }

    /// Token ids the upstream `tokenizer.json` produced for these strings (generated by
    /// `scripts/build-embeddings.py --token-ids` with the `tokenizers` package).
    #[test]
    fn tokenizes_like_the_upstream_tokenizer() {
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(include_str!("../../tests/data/wordpiece-ids.json")).unwrap();
        assert!(cases.len() >= 10);
        for case in cases {
            let text = case["text"].as_str().unwrap();
            let want: Vec<u32> = case["ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|id| id.as_u64().unwrap() as u32)
                .collect();
            assert_eq!(shipped().token_ids(text), want, "{text:?}");
        }
    }

    #[test]
    fn similar_texts_are_closer_than_unrelated_ones() {
        let model = shipped();
        let embed = |text: &str| model.embed(text).unwrap();
        let question = embed("What does Tom do to destress?");
        let pottery = embed("Pottery is like therapy for me, it calms me down after work.");
        let tyres = embed("My car needs new tyres before the winter.");
        assert!(
            question.cosine(&pottery) > question.cosine(&tyres),
            "{} vs {}",
            question.cosine(&pottery),
            question.cosine(&tyres)
        );
        let again = embed("What does Tom do to destress?");
        assert_eq!(again, question);
        assert!((question.cosine(&question) - 1.0).abs() < 0.01);
        assert_eq!(question.hamming(&question.code), 0);
        assert!(model.embed("").is_none());
        assert!(
            model.embed("🌅 ~~~").is_some(),
            "punctuation is in the vocabulary"
        );
        assert!(model.embed("🌅🌅").is_none());
    }

    /// A stored (packed) vector compares with a query as its int8 original does, to within
    /// what 4 bits a component lose, and keeps the original's sign code.
    #[test]
    fn a_packed_vector_keeps_its_cosines_and_order() {
        let model = shipped();
        let embed = |text: &str| model.embed(text).unwrap();
        let query = embed("What does Tom do to destress?");
        let texts = [
            "Pottery is like therapy for me, it calms me down after work.",
            "My car needs new tyres before the winter.",
            "Tom goes running by the river every evening to unwind.",
            "What does Tom do to destress?",
        ];
        let mut exact = Vec::new();
        let mut packed = Vec::new();
        for text in texts {
            let vector = embed(text);
            let stored = Packed::of(&vector);
            assert_eq!(stored.code, vector.code);
            let (a, b) = (vector.cosine(&query), stored.cosine(&query));
            assert!((a - b).abs() < 0.05, "{text:?}: {a} against {b}");
            exact.push(a);
            packed.push(b);
        }
        assert!((packed[3] - 1.0).abs() < 0.02, "{}", packed[3]);
        let order = |cosines: &[f32]| {
            let mut at: Vec<usize> = (0..cosines.len()).collect();
            at.sort_by(|x, y| cosines[*y].total_cmp(&cosines[*x]));
            at
        };
        assert_eq!(order(&exact), order(&packed));
        // Held inline in a segment's slots, without a heap allocation of its own.
        assert!(std::mem::size_of::<Option<Packed>>() <= 176);
    }

    /// Both halves of a byte and both signs unpack as they were packed.
    #[test]
    fn packed_components_unpack_with_their_signs() {
        let mut values = [0f32; DIMS];
        values[0] = 1.0;
        values[DIMS / 2] = -1.0;
        values[1] = -0.5;
        values[DIMS - 1] = 0.5;
        let vector = Vector::from_f32(&values).unwrap();
        let stored = Packed::of(&vector);
        assert!((stored.cosine(&vector) - 1.0).abs() < 0.01);
        let mut flipped = values;
        flipped[DIMS / 2] = 1.0;
        let other = Vector::from_f32(&flipped).unwrap();
        // 0.2 exactly; 0.5 as a packed component is 4/7 of the peak, not 3.5/7.
        let (exact, packed) = (vector.cosine(&other), stored.cosine(&other));
        assert!((exact - 0.2).abs() < 0.01, "{exact}");
        assert!((packed - exact).abs() < 0.05, "{packed} against {exact}");
    }

    /// The stored components, as signed values.
    fn unpacked(stored: &Packed) -> Vec<i32> {
        let half = |shift: u32| {
            stored
                .nibbles
                .iter()
                .map(move |byte| i32::from((byte >> shift) & 0x0F) - PACKED_OFFSET)
        };
        half(0).chain(half(4)).collect()
    }

    proptest::proptest! {
        /// The packed dot product is exactly the query's components times the stored signed
        /// ones, which stay within ±7 and keep the original's signs.
        #[test]
        fn the_packed_dot_product_is_exact(
            item in proptest::collection::vec(-1.0f32..1.0, DIMS),
            query in proptest::collection::vec(-1.0f32..1.0, DIMS),
        ) {
            let array = |values: &[f32]| {
                let mut out = [0f32; DIMS];
                out.copy_from_slice(values);
                out
            };
            let (Some(item), Some(query)) =
                (Vector::from_f32(&array(&item)), Vector::from_f32(&array(&query)))
            else {
                return Ok(());
            };
            let stored = Packed::of(&item);
            let components = unpacked(&stored);
            let exact: i32 = components
                .iter()
                .zip(query.values.iter())
                .map(|(c, q)| c * i32::from(*q))
                .sum();
            proptest::prop_assert_eq!(
                dot_packed(&query.values, &stored.nibbles) - PACKED_OFFSET * query.sum,
                exact
            );
            for (c, v) in components.iter().zip(item.values.iter()) {
                proptest::prop_assert!(c.abs() <= 7);
                proptest::prop_assert!(*c == 0 || (*c > 0) == (*v > 0), "{} from {}", c, v);
            }
        }
    }

    #[test]
    fn long_words_and_long_texts_are_bounded() {
        let model = shipped();
        assert_eq!(model.token_ids(&"a".repeat(101)), vec![100]);
        let long = "café ".repeat(MAX_EMBED_BYTES);
        assert!(model.embed(&long).is_some());
        assert_eq!(clip("aé", 2), "a");
    }

    #[test]
    fn rejects_malformed_files() {
        assert_eq!(
            StaticModel::parse(b"nope").err(),
            Some(BadModel("not an engram static model"))
        );
        let truncated = &MODEL_BYTES[..MODEL_BYTES.len() - 1];
        assert!(StaticModel::parse(truncated).is_err());
        assert!(StaticModel::parse(&MODEL_BYTES[..20]).is_err());
    }
}
