//! Text helpers shared by retrieval, extraction and rendering: word tokenising, a light stemmer,
//! stop-words, whitespace normalising, word-bounded clipping, excerpts of very long texts and
//! date display.

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::HashSet;
use std::rc::Rc;

use crate::memo::{TextMemo, memoised};

/// English function words that carry no retrieval signal.
const STOP_WORDS: &[&str] = &[
    "a",
    "about",
    "above",
    "after",
    "again",
    "all",
    "also",
    "am",
    "an",
    "and",
    "any",
    "are",
    "as",
    "at",
    "be",
    "been",
    "before",
    "being",
    "both",
    "but",
    "by",
    "can",
    "could",
    "d",
    "did",
    "do",
    "does",
    "doing",
    "don",
    "down",
    "during",
    "each",
    "even",
    "few",
    "for",
    "from",
    "further",
    "get",
    "got",
    "had",
    "has",
    "have",
    "having",
    "he",
    "hello",
    "her",
    "here",
    "hers",
    "herself",
    "hey",
    "hi",
    "him",
    "himself",
    "his",
    "how",
    "i",
    "if",
    "in",
    "into",
    "is",
    "it",
    "its",
    "itself",
    "just",
    "know",
    "let",
    "like",
    "ll",
    "m",
    "many",
    "me",
    "more",
    "most",
    "much",
    "my",
    "myself",
    "no",
    "nor",
    "not",
    "now",
    "of",
    "off",
    "oh",
    "ok",
    "okay",
    "on",
    "once",
    "only",
    "or",
    "other",
    "our",
    "ours",
    "ourselves",
    "out",
    "over",
    "own",
    "please",
    "re",
    "really",
    "s",
    "same",
    "she",
    "should",
    "so",
    "some",
    "such",
    "t",
    "than",
    "thank",
    "thanks",
    "that",
    "the",
    "their",
    "theirs",
    "them",
    "themselves",
    "then",
    "there",
    "these",
    "they",
    "think",
    "this",
    "those",
    "through",
    "to",
    "too",
    "under",
    "until",
    "up",
    "ve",
    "very",
    "was",
    "we",
    "well",
    "were",
    "what",
    "when",
    "where",
    "which",
    "while",
    "who",
    "whom",
    "why",
    "will",
    "with",
    "would",
    "yeah",
    "yes",
    "you",
    "your",
    "yours",
    "yourself",
    "yourselves",
];

/// Where the stop words of each first byte start and end in `STOP_WORDS` (sorted), so a lookup
/// compares the word with a handful of them. The worker checks every word of every item it
/// relates to a new turn; a binary search over the whole list was 14 % of its time at
/// 1,000 req/s.
const STOP_WORD_RANGES: [(u8, u8); 256] = stop_word_ranges();

const fn stop_word_ranges() -> [(u8, u8); 256] {
    assert!(STOP_WORDS.len() < u8::MAX as usize);
    let mut ranges = [(0, 0); 256];
    let mut index = 0;
    while index < STOP_WORDS.len() {
        let first = STOP_WORDS[index].as_bytes()[0] as usize;
        if ranges[first].1 == 0 {
            ranges[first].0 = index as u8;
        }
        ranges[first].1 = index as u8 + 1;
        index += 1;
    }
    ranges
}

pub fn is_stop_word(word: &str) -> bool {
    let Some(&first) = word.as_bytes().first() else {
        return false;
    };
    let (start, end) = STOP_WORD_RANGES[usize::from(first)];
    STOP_WORDS[usize::from(start)..usize::from(end)].contains(&word)
}

/// Lower-cased alphanumeric words of `text`, in order (stop-words included).
pub fn words(text: &str) -> impl Iterator<Item = String> + '_ {
    text.split(|c: char| !c.is_alphanumeric())
        .filter(|word| !word.is_empty())
        .map(str::to_lowercase)
}

/// A set of terms. Hashed with foldhash (seeded per process, as the index's vocabulary is):
/// the worker looks every working-set item's terms up in a message's set on every turn, and
/// the standard library's SipHash made those look-ups a tenth of its time.
pub type TermSet = std::collections::HashSet<String, foldhash::fast::RandomState>;

/// Retrieval terms: lower-cased, stop-words removed, lightly stemmed.
pub fn terms(text: &str) -> impl Iterator<Item = String> + '_ {
    words(text)
        .filter(|word| !is_stop_word(word))
        .map(|word| stem(&word))
        .filter(|term| !term.is_empty())
}

/// The distinct terms of `text` in first-seen order: `terms(text)` without repeats. Each
/// distinct spelling is normalised once, since a long message repeats its words: normalising
/// every occurrence made a 1 MB message cost tens of milliseconds on the hot path. The sets
/// use foldhash (seeded per process, like the default hasher, but faster on short words): SipHash
/// was half the cost of turning a 4 KB query into terms.
pub fn distinct_terms(text: &str) -> Vec<String> {
    let mut spellings: HashSet<&str, foldhash::fast::RandomState> = HashSet::default();
    let mut seen: HashSet<String, foldhash::fast::RandomState> = HashSet::default();
    let mut out = Vec::new();
    for word in text
        .split(|c: char| !c.is_alphanumeric())
        .filter(|word| !word.is_empty())
    {
        if !spellings.insert(word) {
            continue;
        }
        let word = word.to_lowercase();
        if is_stop_word(&word) {
            continue;
        }
        let term = stem(&word);
        if !term.is_empty() && seen.insert(term.clone()) {
            out.push(term);
        }
    }
    out
}

thread_local! {
    static DISTINCT_TERMS: RefCell<TextMemo<Vec<String>>> = RefCell::default();
}

/// [`distinct_terms`], remembered per thread: the worker asks for the terms of the same
/// working-set items on every turn.
pub fn remembered_terms(text: &str) -> Rc<Vec<String>> {
    memoised(&DISTINCT_TERMS, text, || distinct_terms(text))
}

/// A light suffix-stripping stemmer: plurals, `-ies`/`-ied`, `-ing`, `-ed`, then a final silent
/// `-e`. It only needs to map query and document forms onto the same key, and it is applied to
/// both sides identically ("hike", "hikes", "hiked", "hiking" -> "hik").
pub fn stem(word: &str) -> String {
    if word.len() <= 3 || !word.is_ascii() {
        return word.to_string();
    }
    let base = strip_inflection(word);
    match base.strip_suffix('e') {
        Some(shorter) if base.len() >= 4 => shorter.to_string(),
        _ => base,
    }
}

fn strip_inflection(w: &str) -> String {
    if let Some(base) = w.strip_suffix("ies")
        && base.len() >= 2
    {
        return format!("{base}y");
    }
    if let Some(base) = w.strip_suffix("ied")
        && base.len() >= 2
    {
        return format!("{base}y");
    }
    if let Some(base) = w.strip_suffix("sses") {
        return format!("{base}ss");
    }
    if let Some(base) = w.strip_suffix("ing")
        && base.len() >= 3
    {
        return undouble(base);
    }
    if let Some(base) = w.strip_suffix("ed")
        && base.len() >= 3
    {
        return undouble(base);
    }
    if w.ends_with("ss") || w.ends_with("us") || w.ends_with("is") {
        return w.to_string();
    }
    if let Some(base) = w.strip_suffix("es")
        && (base.ends_with("ch") || base.ends_with("sh") || base.ends_with('x'))
    {
        return base.to_string();
    }
    if let Some(base) = w.strip_suffix('s') {
        return base.to_string();
    }
    w.to_string()
}

/// "running" -> "runn" -> "run"; keeps "ll"/"ss"/"zz" ("falling" -> "fall").
fn undouble(base: &str) -> String {
    let bytes = base.as_bytes();
    let n = bytes.len();
    if n >= 2 && bytes[n - 1] == bytes[n - 2] && !matches!(bytes[n - 1], b'l' | b's' | b'z') {
        return base[..n - 1].to_string();
    }
    base.to_string()
}

/// Collapses every run of whitespace (newlines included) into one space and trims the ends, so
/// a rendered memory line never spans lines.
pub fn one_line(text: &str) -> String {
    // Most texts are one line already: copying them is several times cheaper than rebuilding
    // them word by word, and a composed prompt renders dozens.
    if is_one_line(text) {
        return text.to_owned();
    }
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

/// Whether `one_line(text)` is `text`: no whitespace but single spaces between words.
pub fn is_one_line(text: &str) -> bool {
    if text.starts_with(' ') || text.ends_with(' ') {
        return false;
    }
    if text.is_ascii() {
        // ASCII whitespace is ' ' and \t, \n, \x0b, \x0c, \r: checked byte by byte, folded
        // without an early exit so that the loops run in vector registers (as `any` over bytes
        // and pairs they were a twentieth of compose, which checks every line it renders).
        let bytes = text.as_bytes();
        let control = bytes
            .iter()
            .fold(0u8, |seen, b| seen | u8::from(b.wrapping_sub(0x09) < 5));
        let doubled = bytes
            .iter()
            .zip(bytes.get(1..).unwrap_or_default())
            .fold(0u8, |seen, (a, b)| {
                seen | (u8::from(*a == b' ') & u8::from(*b == b' '))
            });
        return control | doubled == 0;
    }
    let mut after_space = false;
    for c in text.chars() {
        if c == ' ' {
            if after_space {
                return false;
            }
            after_space = true;
        } else if c.is_whitespace() {
            return false;
        } else {
            after_space = false;
        }
    }
    true
}

/// `one_line(text)` up to at least its first `len` bytes (all of it when shorter), computed
/// only that far: a summary span near the start of a long raw turn needs no more.
pub fn one_line_prefix(text: &str, len: usize) -> String {
    let mut out = String::with_capacity(len.min(text.len()));
    for word in text.split_whitespace() {
        if out.len() >= len {
            break;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

pub fn word_count(text: &str) -> usize {
    text.split_whitespace().count()
}

/// `word_count(text).min(max)`, without reading past the `max`th word.
pub fn words_up_to(text: &str, max: usize) -> usize {
    text.split_whitespace().take(max).count()
}

/// The first `max_words` words of `text` on one line, with an ellipsis when something was cut.
pub fn clip_words(text: &str, max_words: usize) -> String {
    let mut out = String::new();
    for (taken, word) in text.split_whitespace().enumerate() {
        if taken == max_words {
            out.push_str(" …");
            return out;
        }
        if taken > 0 {
            out.push(' ');
        }
        out.push_str(word);
    }
    out
}

/// At most `max_chars` characters, cut at a word boundary, with an ellipsis when cut.
pub fn clip_chars(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_string();
    }
    let mut out = String::new();
    for word in text.split_whitespace() {
        let extra = usize::from(!out.is_empty()) + word.chars().count();
        // Leave room for the ellipsis.
        if out.chars().count() + extra + 1 > max_chars {
            break;
        }
        if !out.is_empty() {
            out.push(' ');
        }
        out.push_str(word);
    }
    out.push('…');
    out
}

/// `text` when it is at most `max_bytes` long; otherwise an excerpt of about that size: its
/// head (three quarters) and its tail, on character boundaries, joined by a line saying how
/// many bytes were left out. A pasted document's own words are mostly at its two ends, and the
/// memory engine's costs (token counts, extraction, indexing) grow with the text it is given.
pub fn excerpt(text: &str, max_bytes: usize) -> Cow<'_, str> {
    if text.len() <= max_bytes {
        return Cow::Borrowed(text);
    }
    let head_end = floor_boundary(text, max_bytes / 4 * 3);
    let tail_start = ceil_boundary(text, text.len() - (max_bytes / 4));
    let left_out = tail_start - head_end;
    Cow::Owned(format!(
        "{}\n[… {left_out} bytes left out …]\n{}",
        &text[..head_end],
        &text[tail_start..]
    ))
}

fn floor_boundary(text: &str, mut index: usize) -> usize {
    while !text.is_char_boundary(index) {
        index -= 1;
    }
    index
}

fn ceil_boundary(text: &str, mut index: usize) -> usize {
    while !text.is_char_boundary(index) {
        index += 1;
    }
    index
}

/// The display form of an event time: the calendar date of an RFC 3339 stamp
/// (`2023-05-08T13:56:00Z` -> `2023-05-08`), or a preformatted date as given (one line, at most
/// 40 characters).
pub fn display_date(event_time: &str) -> Option<String> {
    let trimmed = event_time.trim();
    if trimmed.is_empty() {
        return None;
    }
    if let Some(day) = calendar_day(trimmed) {
        return Some(day.to_string());
    }
    Some(clip_chars(&one_line(trimmed), 40))
}

/// The `YYYY-MM-DD` an RFC 3339 time starts with.
fn calendar_day(trimmed: &str) -> Option<&str> {
    let bytes = trimmed.as_bytes();
    let looks_rfc3339 = bytes.len() >= 10
        && bytes[..4].iter().all(u8::is_ascii_digit)
        && bytes[4] == b'-'
        && bytes[5..7].iter().all(u8::is_ascii_digit)
        && bytes[7] == b'-'
        && bytes[8..10].iter().all(u8::is_ascii_digit);
    looks_rfc3339.then(|| trimmed.get(..10)).flatten()
}

/// What makes two event times one day as [`display_date`] shows them: an RFC 3339 time's
/// calendar date, else the trimmed text; none when blank. Borrowed: the hot path groups lines
/// by it.
pub fn date_key(event_time: &str) -> Option<&str> {
    let trimmed = event_time.trim();
    if trimmed.is_empty() {
        return None;
    }
    calendar_day(trimmed).or(Some(trimmed))
}

/// The words a dated item is searched by: its display date and, for a calendar date, the same
/// day in words (`2023-05-08` → `2023-05-08 8 May 2023`), so "what did she do in May 2023?"
/// or "on 8 May, 2023" finds it.
pub fn date_search_text(event_time: &str) -> String {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    let Some(date) = display_date(event_time) else {
        return String::new();
    };
    let parts: Vec<&str> = date.split('-').collect();
    let words = match parts.as_slice() {
        [year, month, day] if year.len() == 4 && month.len() == 2 && day.len() == 2 => month
            .parse::<usize>()
            .ok()
            .and_then(|month| MONTHS.get(month.wrapping_sub(1)))
            .zip(day.parse::<u32>().ok())
            .map(|(month, day)| format!(" {day} {month} {year}")),
        _ => None,
    };
    format!("{date}{}", words.unwrap_or_default())
}

/// FNV-1a, 64-bit: a stable hash (unlike std's randomly seeded one) for chains and dedup keys.
pub fn fnv1a(seed: u64, bytes: &[u8]) -> u64 {
    let mut hash = if seed == 0 {
        0xcbf2_9ce4_8422_2325
    } else {
        seed
    };
    fnv1a_feed(&mut hash, bytes);
    hash
}

/// `fnv1a(seed, one_line(text).as_bytes())` without building the line: a pasted document can be
/// megabytes, and the recorder hashes every exchange. One pass over the bytes (whitespace is
/// `char::is_whitespace`, as `split_whitespace` has it): the word iterator it replaces cost about
/// twice the hashing itself.
pub fn fnv1a_one_line(seed: u64, text: &str) -> u64 {
    let mut hash = fnv1a(seed, b"");
    let bytes = text.as_bytes();
    // A separator is owed once a word has been hashed and whitespace followed it.
    let (mut in_word, mut owes_space, mut words) = (false, false, 0u32);
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        let (whitespace, len) = if byte.is_ascii() {
            (matches!(byte, b'\t'..=b'\r' | b' '), 1)
        } else {
            let c = text
                .get(at..)
                .and_then(|rest| rest.chars().next())
                .unwrap_or(' ');
            (c.is_whitespace(), c.len_utf8())
        };
        if whitespace {
            owes_space |= in_word;
            in_word = false;
        } else {
            if owes_space {
                fnv1a_feed(&mut hash, b" ");
                owes_space = false;
                words += 1;
                // A pasted document is a million bytes to hash, byte by byte, on the worker.
                if words % 256 == 0 {
                    crate::yielding::checkpoint();
                }
            }
            in_word = true;
            fnv1a_feed(&mut hash, bytes.get(at..at + len).unwrap_or_default());
        }
        at += len;
    }
    hash
}

fn fnv1a_feed(hash: &mut u64, bytes: &[u8]) {
    for byte in bytes {
        *hash ^= u64::from(*byte);
        *hash = hash.wrapping_mul(0x0100_0000_01b3);
    }
}

/// The matching form of a key or value: lower-case, single spaces, no trailing punctuation.
pub fn normalise(text: &str) -> String {
    one_line(text)
        .to_lowercase()
        .trim_end_matches(['.', '!', '?', ',', ';'])
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    proptest::proptest! {
        /// The ASCII shortcut and the character walk agree with the definition: a text is one
        /// line when collapsing its whitespace leaves it as it is.
        #[test]
        fn a_one_line_text_is_what_collapsing_leaves_alone(
            text in "[a ]{0,3}[ \t\n\x0b\x0c\r\x1c\x1f\u{85}\u{a0}\u{2028}]{0,2}[a ]{0,3}",
        ) {
            let collapsed = text.split_whitespace().collect::<Vec<_>>().join(" ");
            proptest::prop_assert_eq!(is_one_line(&text), collapsed == text);
            proptest::prop_assert_eq!(one_line(&text), collapsed);
        }

        #[test]
        fn counting_up_to_a_bound_is_the_count_capped(
            text in "([a-z]{0,3}[ \t\n\u{a0}]{0,2}){0,12}",
            max in 0usize..10,
        ) {
            proptest::prop_assert_eq!(words_up_to(&text, max), word_count(&text).min(max));
        }

        #[test]
        fn hashing_a_line_in_place_is_hashing_the_line(
            text in "([a-zé東\u{1F600}]{0,4}[ \t\n\r\u{b}\u{c}\u{85}\u{a0}\u{2003}\u{3000}]{0,3}){0,8}",
            seed in proptest::prop_oneof![proptest::strategy::Just(0u64), proptest::num::u64::ANY],
        ) {
            proptest::prop_assert_eq!(
                fnv1a_one_line(seed, &text),
                fnv1a(seed, one_line(&text).as_bytes())
            );
        }
    }

    #[test]
    fn an_excerpt_keeps_both_ends_of_a_long_text_on_char_boundaries() {
        assert_eq!(excerpt("short", 8), "short");
        let text = format!("{}{}", "é".repeat(3000), "z".repeat(1000));
        let cut = excerpt(&text, 1000);
        assert!(
            cut.starts_with("éé") && cut.ends_with(&"z".repeat(250)),
            "{cut}"
        );
        // 750 bytes of head is 375 two-byte characters; 250 bytes of tail are all 'z'.
        assert_eq!(cut.matches('é').count(), 375);
        assert!(cut.contains(&format!("[… {} bytes left out …]", 7000 - 750 - 250)));
        assert!(cut.len() < 1100, "{}", cut.len());
        // An odd cut point inside a character moves to its edge.
        let wide = "é".repeat(1000);
        let odd = excerpt(&wide, 101);
        assert!(odd.starts_with(&"é".repeat(37)), "{odd}");
    }

    #[test]
    fn stop_words_are_sorted_for_binary_search() {
        let mut sorted = STOP_WORDS.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted, STOP_WORDS);
    }

    #[test]
    fn stop_words_are_found_by_their_first_byte_and_nothing_else_is() {
        for word in STOP_WORDS {
            assert!(is_stop_word(word), "{word}");
        }
        for word in [
            "", "abou", "abouts", "th", "theirz", "zebra", "Ä", "About", "y",
        ] {
            assert!(!is_stop_word(word), "{word:?}");
        }
    }

    #[test]
    fn distinct_terms_are_terms_without_repeats() {
        let text = "Hiking, hikes and HIKING: the dogs hiked; dogs! Über über 42 42";
        let mut expected: Vec<String> = Vec::new();
        for term in terms(text) {
            if !expected.contains(&term) {
                expected.push(term);
            }
        }
        assert_eq!(distinct_terms(text), expected);
        assert_eq!(distinct_terms(text), ["hik", "dog", "über", "42"]);
    }

    proptest::proptest! {
        #[test]
        fn one_line_matches_word_by_word_joining(text in "([a-zé]{0,5}[ \n\t\u{a0}\u{3000}]{0,3}){0,30}") {
            let joined = text.split_whitespace().collect::<Vec<_>>().join(" ");
            proptest::prop_assert_eq!(one_line(&text), joined);
        }

        #[test]
        fn one_line_prefix_is_a_prefix_of_one_line(text in "([a-zé]{0,5}[ \n\t]{0,3}){0,30}", len in 0usize..120) {
            let full = one_line(&text);
            let prefix = one_line_prefix(&text, len);
            proptest::prop_assert!(full.starts_with(&prefix));
            proptest::prop_assert!(prefix.len() >= len.min(full.len()));
        }

        #[test]
        fn distinct_terms_match_deduplicated_terms(text in "([A-Za-zé0-9]{1,6}[ ,.!]{1,2}){0,40}") {
            let mut expected: Vec<String> = Vec::new();
            for term in terms(&text) {
                if !expected.contains(&term) {
                    expected.push(term);
                }
            }
            proptest::prop_assert_eq!(distinct_terms(&text), expected);
        }
    }

    #[test]
    fn stemming_joins_inflections() {
        assert_eq!(stem("hiking"), stem("hikes"));
        assert_eq!(stem("hiked"), stem("hike"));
        assert_eq!(stem("running"), "run");
        assert_eq!(stem("allergies"), stem("allergy"));
        assert_eq!(stem("peanuts"), "peanut");
        assert_eq!(stem("classes"), "class");
        assert_eq!(stem("boxes"), "box");
        assert_eq!(stem("falling"), "fall");
        assert_eq!(stem("bus"), "bus");
    }

    #[test]
    fn terms_drop_stop_words_and_stem() {
        let got: Vec<String> = terms("I went hiking with my dogs in the Alps").collect();
        assert_eq!(got, ["went", "hik", "dog", "alp"]);
    }

    #[test]
    fn clipping_respects_limits() {
        assert_eq!(clip_words("a b c d", 2), "a b …");
        assert_eq!(clip_words("a b", 2), "a b");
        let clipped = clip_chars("alpha beta gamma delta", 12);
        assert!(clipped.chars().count() <= 12, "{clipped}");
        assert!(clipped.ends_with('…'));
    }

    #[test]
    fn dates_display_as_calendar_days() {
        assert_eq!(
            display_date("2023-05-08T13:56:00Z").as_deref(),
            Some("2023-05-08")
        );
        assert_eq!(
            display_date(" 1:56 pm on 8 May, 2023 ").as_deref(),
            Some("1:56 pm on 8 May, 2023")
        );
        assert_eq!(display_date("  "), None);
    }

    #[test]
    fn times_of_one_day_share_a_date_key() {
        assert_eq!(date_key("2023-05-08T13:56:00Z"), Some("2023-05-08"));
        assert_eq!(date_key(" 2023-05-08T08:00:00+02:00"), Some("2023-05-08"));
        assert_eq!(date_key("2023-05-09T08:00:00Z"), Some("2023-05-09"));
        assert_eq!(
            date_key(" 1:56 pm on 8 May, 2023 "),
            Some("1:56 pm on 8 May, 2023")
        );
        assert_eq!(date_key(" "), None);
    }

    #[test]
    fn dates_are_searchable_in_words() {
        assert_eq!(
            date_search_text("2023-05-08T13:56:00Z"),
            "2023-05-08 8 May 2023"
        );
        assert_eq!(date_search_text("last spring"), "last spring");
        assert_eq!(date_search_text(""), "");
    }

    #[test]
    fn one_line_collapses_whitespace() {
        assert_eq!(one_line("  a\n\n b\t c "), "a b c");
    }

    #[test]
    fn fnv_is_stable() {
        assert_eq!(fnv1a(0, b""), 0xcbf2_9ce4_8422_2325);
        assert_ne!(fnv1a(0, b"a"), fnv1a(0, b"b"));
    }
}
