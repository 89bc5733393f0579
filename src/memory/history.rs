//! Recognising a full-history client's turns: a hash chain over normalised exchanges. Each link
//! hashes the previous link with the exchange's user and assistant text (whitespace collapsed,
//! engram fences removed), so a client's k-th exchange matches a recorded turn only if the whole
//! conversation up to it matches too.

use crate::openai::ChatMessage;

use super::fence::{has_fence_marker, strip_fences};
use super::text::{fnv1a, fnv1a_one_line};

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

/// One client exchange: a user message and the messages that answered it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientExchange {
    /// Index range in the request's messages.
    pub start: usize,
    pub end: usize,
    /// Chain link after this exchange.
    pub chain: u64,
}

/// Where the parts of a request sit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RequestShape {
    /// Leading `system`/`developer` messages: `messages[..system_end]`.
    pub system_end: usize,
    /// The latest user message, if any.
    pub last_user: Option<usize>,
    /// Earlier exchanges the client resent (`messages[system_end..last_user]`).
    pub exchanges: Vec<ClientExchange>,
    /// Chain link after all earlier exchanges: what to record the new exchange under.
    pub prior_chain: u64,
}

fn is_system(message: &ChatMessage) -> bool {
    matches!(message.role.as_str(), "system" | "developer")
}

pub fn request_shape(messages: &[ChatMessage]) -> RequestShape {
    let system_end = messages
        .iter()
        .position(|message| !is_system(message))
        .unwrap_or(messages.len());
    let last_user = messages
        .iter()
        .rposition(|message| message.role == "user")
        .filter(|index| *index >= system_end);
    let conversation_end = last_user.unwrap_or(system_end);
    let mut exchanges = Vec::new();
    let mut chain = CHAIN_ORIGIN;
    let mut index = system_end;
    while index < conversation_end {
        let start = index;
        let user = if messages[index].role == "user" {
            index += 1;
            messages[start].text()
        } else {
            String::new()
        };
        let mut assistant = Vec::new();
        while index < conversation_end && messages[index].role != "user" {
            if messages[index].role == "assistant" {
                assistant.push(messages[index].text());
            }
            index += 1;
        }
        chain = link(chain, &user, &assistant.join("\n"));
        exchanges.push(ClientExchange {
            start,
            end: index,
            chain,
        });
    }
    RequestShape {
        system_end,
        last_user,
        exchanges,
        prior_chain: chain,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn messages(pairs: &[(&str, &str)]) -> Vec<ChatMessage> {
        pairs
            .iter()
            .map(|(role, text)| ChatMessage::new(*role, *text))
            .collect()
    }

    #[test]
    fn shape_splits_system_history_and_question() {
        let request = messages(&[
            ("system", "be brief"),
            ("user", "hi"),
            ("assistant", "hello"),
            ("user", "my name is Ana"),
            ("assistant", "nice to meet you"),
            ("user", "what is my name?"),
        ]);
        let shape = request_shape(&request);
        assert_eq!(shape.system_end, 1);
        assert_eq!(shape.last_user, Some(5));
        assert_eq!(shape.exchanges.len(), 2);
        assert_eq!(shape.exchanges[1].start, 3);
        assert_eq!(shape.exchanges[1].end, 5);
        let first = link(CHAIN_ORIGIN, "hi", "hello");
        assert_eq!(shape.exchanges[0].chain, first);
        assert_eq!(
            shape.prior_chain,
            link(first, "my name is Ana", "nice to meet you")
        );
    }

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
        use crate::memory::text::one_line;
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

    #[test]
    fn stateless_request_has_no_history() {
        let shape = request_shape(&messages(&[("user", "hello")]));
        assert_eq!(shape.last_user, Some(0));
        assert!(shape.exchanges.is_empty());
        assert_eq!(shape.prior_chain, CHAIN_ORIGIN);
    }
}
