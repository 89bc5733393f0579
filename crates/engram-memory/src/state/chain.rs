//! The hashes that recognise an exchange over normalised text (whitespace collapsed, engram
//! fences removed): a chain, each link hashing the previous link with the exchange's user and
//! answer text, so a client's k-th exchange matches a recorded turn only if the whole
//! conversation up to it matches too; and a pair, the exchange's own texts alone, wherever it
//! sits. The recorder links each turn it records; `history` recognises a resent conversation
//! by them.

use crate::fence::{has_fence_marker, strip_fences};
use crate::text::{fnv1a, fnv1a_one_line};

/// The link before the first exchange of a conversation.
pub const CHAIN_ORIGIN: u64 = 0x9e37_79b9_7f4a_7c15;

/// `fnv1a(seed, one_line(strip_fences(text)))`, copying the text only when it holds a fence.
fn hash_normalised(seed: u64, text: &str) -> u64 {
    if has_fence_marker(text) {
        fnv1a_one_line(seed, &strip_fences(text))
    } else {
        fnv1a_one_line(seed, text)
    }
}

/// The chain link after an exchange.
pub fn link(previous: u64, user: &str, assistant: &str) -> u64 {
    let hash = fnv1a(0, &previous.to_le_bytes());
    let hash = fnv1a(hash, b"u:");
    let hash = hash_normalised(hash, user);
    let hash = fnv1a(hash, b"\0a:");
    hash_normalised(hash, assistant)
}

/// The link before the first exchange of a pair hash ([`pair`]); any constant other than
/// [`CHAIN_ORIGIN`] keeps pairs and first links apart.
const PAIR_ORIGIN: u64 = 0x5851_f42d_4c95_7f2d;

/// The hash of one exchange's texts alone, wherever it sits in a conversation.
pub fn pair(user: &str, assistant: &str) -> u64 {
    link(PAIR_ORIGIN, user, assistant)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chain_ignores_whitespace_and_fences_but_not_order() {
        let a = link(CHAIN_ORIGIN, "hi  there\n", "hello");
        let b = link(
            CHAIN_ORIGIN,
            "<engram-memory kind=\"recall\">x</engram-memory>\n\nhi there",
            " hello ",
        );
        assert_eq!(a, b);
        let ab = link(link(CHAIN_ORIGIN, "a", "1"), "b", "2");
        let ba = link(link(CHAIN_ORIGIN, "b", "2"), "a", "1");
        assert_ne!(ab, ba);
    }

    #[test]
    fn links_are_the_hash_of_the_normalised_texts_that_stored_chains_were_made_with() {
        use crate::text::one_line;
        // Chains are stored with each turn: how a link is computed must not change its value.
        for (user, assistant) in [
            ("hi  there\n", "hello"),
            ("<engram-memory kind=\"core\">x</engram-memory> q", " a\tb "),
            ("", ""),
        ] {
            let expected = fnv1a(
                fnv1a(
                    fnv1a(
                        fnv1a(fnv1a(0, &CHAIN_ORIGIN.to_le_bytes()), b"u:"),
                        one_line(&strip_fences(user)).as_bytes(),
                    ),
                    b"\0a:",
                ),
                one_line(&strip_fences(assistant)).as_bytes(),
            );
            assert_eq!(link(CHAIN_ORIGIN, user, assistant), expected);
        }
    }
}
