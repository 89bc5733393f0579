//! Token counting with tiktoken's vocabularies, through the compact counter in `bpe.rs`. Every
//! memory item is counted once, when it is written, in both encodings engram serves (o200k for
//! current OpenAI models, cl100k otherwise); the hot path only adds stored counts.
//!
//! Counts of memory lines add up exactly: every rendered item (or heading) is whole lines that
//! end with a newline and start with a non-space character other than `/` (`- `, `## `; the
//! indented lines of a multi-line text, see `shape`, are inside an item, never at its edge), and
//! tiktoken's pre-tokenizer never joins a newline with such a character, so
//! `tokens(a + b) == tokens(a) + tokens(b)` for rendered items.
//! The property is checked by a test below and by the budget property tests.

use std::sync::LazyLock;

use serde::{Deserialize, Serialize};

use super::bpe::Bpe;

/// The BPE encoding of a request's model.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Encoding {
    O200k,
    Cl100k,
}

impl Encoding {
    /// o200k for gpt-4o, gpt-4.1, gpt-4.5, gpt-5, gpt-oss and the o-series; cl100k otherwise.
    pub fn for_model(model: &str) -> Encoding {
        // "ft:gpt-4o:org::id" and "openai/gpt-4o" name the same base model.
        let base = model.strip_prefix("ft:").unwrap_or(model);
        let base = base.rsplit('/').next().unwrap_or(base).to_ascii_lowercase();
        const O200K_PREFIXES: &[&str] = &[
            "gpt-4o",
            "chatgpt-4o",
            "gpt-4.1",
            "gpt-4.5",
            "gpt-5",
            "gpt-oss",
            "o1",
            "o3",
            "o4",
            "codex-",
        ];
        if O200K_PREFIXES.iter().any(|prefix| base.starts_with(prefix)) {
            Encoding::O200k
        } else {
            Encoding::Cl100k
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Encoding::O200k => "o200k_base",
            Encoding::Cl100k => "cl100k_base",
        }
    }

    pub(crate) fn bpe(self) -> &'static Bpe {
        static O200K: LazyLock<Bpe> = LazyLock::new(|| {
            Bpe::from_tables(
                include_bytes!(concat!(env!("OUT_DIR"), "/o200k.bytes")),
                include_bytes!(concat!(env!("OUT_DIR"), "/o200k.starts")),
                O200K_PATTERN,
            )
        });
        static CL100K: LazyLock<Bpe> = LazyLock::new(|| {
            Bpe::from_tables(
                include_bytes!(concat!(env!("OUT_DIR"), "/cl100k.bytes")),
                include_bytes!(concat!(env!("OUT_DIR"), "/cl100k.starts")),
                CL100K_PATTERN,
            )
        });
        match self {
            Encoding::O200k => &O200K,
            Encoding::Cl100k => &CL100K,
        }
    }
}

/// The pre-tokenizers tiktoken-rs builds `o200k_base` and `cl100k_base` with, as the
/// `regex` crate runs them (see `bpe::Pretokenizer`): tiktoken's `\s+(?!\S)|\s+` (o200k)
/// and `\s+(?!\S)|\s` (cl100k) become `\s+`, and cl100k's possessive quantifiers plain
/// ones. The tests keep tiktoken's own patterns and check the pieces against them.
const O200K_PATTERN: &str = "[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n/]*|\\s*[\\r\\n]+|\\s+";
const CL100K_PATTERN: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s+$|\\s*[\\r\\n]|\\s+";

/// A text's token count in both encodings, stored next to the text (serialised as `[o200k,
/// cl100k]`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TokenCount(pub u32, pub u32);

impl TokenCount {
    /// Counts `text` in both encodings. Costs a tokenizer pass: call it on the write path only.
    pub fn of(text: &str) -> TokenCount {
        TokenCount(
            count_in(Encoding::O200k, text),
            count_in(Encoding::Cl100k, text),
        )
    }

    pub fn get(self, encoding: Encoding) -> u32 {
        match encoding {
            Encoding::O200k => self.0,
            Encoding::Cl100k => self.1,
        }
    }
}

impl std::ops::Add for TokenCount {
    type Output = TokenCount;
    fn add(self, other: TokenCount) -> TokenCount {
        TokenCount(
            self.0.saturating_add(other.0),
            self.1.saturating_add(other.1),
        )
    }
}

/// Tokens of `text` in one encoding (special-token text is counted as ordinary text).
pub fn count_in(encoding: Encoding, text: &str) -> u32 {
    if text.is_empty() {
        return 0;
    }
    u32::try_from(encoding.bpe().count(text)).unwrap_or(u32::MAX)
}

/// Loads both encodings (a few hundred milliseconds, once per process); [`crate::warm_up`]
/// warms the rest of the engine too.
pub fn warm_up() {
    for encoding in [Encoding::O200k, Encoding::Cl100k] {
        let _ = count_in(encoding, "warm up");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// tiktoken's own cl100k pattern (tiktoken-rs does not export it).
    const TIKTOKEN_CL100K: &str = "'(?i:[sdmt]|ll|ve|re)|[^\\r\\n\\p{L}\\p{N}]?+\\p{L}++|\\p{N}{1,3}+| ?[^\\s\\p{L}\\p{N}]++[\\r\\n]*+|\\s++$|\\s*[\\r\\n]|\\s+(?!\\S)|\\s";

    /// Pieces as tiktoken's own patterns split `text` (with `fancy-regex`, as tiktoken-rs
    /// runs them) and as the counter splits it.
    fn both_splits(encoding: Encoding, text: &str) -> (Vec<String>, Vec<String>) {
        static ORIGINALS: LazyLock<[fancy_regex::Regex; 2]> = LazyLock::new(|| {
            [tiktoken_rs::O200K_BASE_PAT_STR, TIKTOKEN_CL100K]
                .map(|pattern| fancy_regex::Regex::new(pattern).unwrap())
        });
        let original = match encoding {
            Encoding::O200k => &ORIGINALS[0],
            Encoding::Cl100k => &ORIGINALS[1],
        };
        let expected = original
            .find_iter(text)
            .map(|piece| piece.unwrap().as_str().to_string())
            .collect();
        (expected, encoding.bpe().pieces(text))
    }

    #[test]
    fn patterns_are_tiktokens_without_the_look_ahead() {
        // Everything before the look-ahead is tiktoken's (cl100k's possessive `?+`, `++`,
        // `*+` and `{1,3}+` made plain).
        let o200k = tiktoken_rs::O200K_BASE_PAT_STR;
        assert_eq!(O200K_PATTERN, o200k.replace("|\\s+(?!\\S)|\\s+", "|\\s+"));
        let cl100k = TIKTOKEN_CL100K
            .replace("|\\s+(?!\\S)|\\s", "|\\s+")
            .replace("?+", "?")
            .replace("++", "+")
            .replace("*+", "*")
            .replace("{1,3}+", "{1,3}");
        assert_eq!(CL100K_PATTERN, cl100k);
    }

    #[test]
    fn splits_whitespace_as_the_look_ahead_does() {
        for text in [
            "a  b",
            "a b",
            "a \tb",
            "a   ",
            "  ",
            " ",
            "x\u{a0}\u{a0}y",
            "x \u{3000}y",
            "x  \n  y",
            "x \r\n\t z",
            "x\u{2028} y",
            "x\u{85}\u{85}1",
            "  !?",
            "\t\t'll",
            "1  2   3    ",
        ] {
            for encoding in [Encoding::O200k, Encoding::Cl100k] {
                let (expected, pieces) = both_splits(encoding, text);
                assert_eq!(pieces, expected, "{encoding:?} on {text:?}");
            }
        }
    }

    proptest::proptest! {
        #[test]
        fn splits_as_tiktoken(text in "([a-zA-Z]{1,6}|[0-9]{1,5}|[ \t\n\r\u{b}\u{c}\u{85}\u{a0}\u{2028}\u{3000}]{1,4}|['’][sStTdDmMlLvVrReE]{0,2}|[.,!?;:\"()\\-/]{1,3}|[ſKǅʰ\u{301}\u{300}éüßøçÉ٣²Ⅻ]|[東京語]|[\u{1F600}-\u{1F64F}]|[^\u{0}-\u{7f}]){0,40}") {
            for encoding in [Encoding::O200k, Encoding::Cl100k] {
                let (expected, pieces) = both_splits(encoding, &text);
                proptest::prop_assert_eq!(pieces, expected, "{:?}", encoding);
            }
        }
    }

    #[test]
    fn models_map_to_their_encoding() {
        for model in [
            "gpt-4o",
            "gpt-4o-mini-2024-07-18",
            "gpt-4.1",
            "o3-mini",
            "o1",
            "gpt-5",
            "ft:gpt-4o:org::abc",
            "openai/gpt-4o",
        ] {
            assert_eq!(Encoding::for_model(model), Encoding::O200k, "{model}");
        }
        for model in ["gpt-4", "gpt-3.5-turbo", "llama-3-70b", "mistral-large", ""] {
            assert_eq!(Encoding::for_model(model), Encoding::Cl100k, "{model}");
        }
    }

    #[test]
    fn counts_are_real_tokenizer_counts() {
        let count = TokenCount::of("hello world");
        assert_eq!(count, TokenCount(2, 2));
        assert_eq!(TokenCount::of(""), TokenCount(0, 0));
        assert_eq!(count.get(Encoding::Cl100k), 2);
    }

    #[test]
    fn rendered_lines_add_up() {
        let lines = [
            "- allergy: peanuts [2023-05-08]\n",
            "- [8 May, 2023] user: I can't eat nuts!! | assistant: Noted.\n",
            "## Known facts\n",
            "- a3 (rust code from turn t5):\n```rust\n    fn main() {}\n```\n",
            "- 東京に住んでいます。\n",
            "- ends with punctuation ...\n",
            "- [2024-01-02] user: Fix this:\n  ```rust\n  fn main() {\n      let _ = \"/\";\n  }\n  ```\n\n  assistant: Done.\n",
            "- artifact 3 (code):\n  ````\n  ```\n  ````\n",
            "- Rules:\n  - be brief\n\n  [… 4 lines left out …]\n",
        ];
        for encoding in [Encoding::O200k, Encoding::Cl100k] {
            let joined: String = lines.concat();
            let sum: u32 = lines.iter().map(|line| count_in(encoding, line)).sum();
            assert_eq!(count_in(encoding, &joined), sum, "{encoding:?}");
        }
    }
}
