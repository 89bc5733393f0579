//! Size-adaptive depth (seed 001): how much of an exchange is kept, and which parts are stored
//! whole as artifacts (fenced code blocks always; a long reply without code as a draft).

use crate::code::code_blocks;
use crate::config::DepthConfig;
use crate::model::{Depth, Side};
use crate::text::words_up_to;

/// A fenced code block or a long draft found in an exchange, before it gets an id.
#[derive(Debug, Clone, PartialEq)]
pub enum FoundArtifact {
    Code {
        language: Option<String>,
        content: String,
    },
    /// The whole of one side, trimmed.
    Draft(Side),
}

pub fn classify(user: &str, assistant: &str, config: &DepthConfig) -> Depth {
    if has_code(user) || has_code(assistant) {
        return Depth::Code;
    }
    // Counting stops at `long_words`: past it the depth is Long, and a pasted document is
    // not walked word by word to find that out.
    let longest =
        words_up_to(user, config.long_words).max(words_up_to(assistant, config.long_words));
    if longest >= config.long_words {
        Depth::Long
    } else if longest < config.short_words {
        Depth::Short
    } else {
        Depth::Medium
    }
}

fn has_code(text: &str) -> bool {
    !code_blocks(text).is_empty()
}

fn has_words(text: &str, count: usize) -> bool {
    words_up_to(text, count) >= count
}

/// Artifacts to keep whole: every code block of either side, and a long code-free reply (or a
/// long pasted user message) as a draft.
pub fn find_artifacts(user: &str, assistant: &str, config: &DepthConfig) -> Vec<FoundArtifact> {
    let mut found = Vec::new();
    for (side, text) in [(Side::User, user), (Side::Assistant, assistant)] {
        let blocks = code_blocks(text);
        if blocks.is_empty() {
            if has_words(text, config.long_words) {
                found.push(FoundArtifact::Draft(side));
            }
            continue;
        }
        for (language, content) in blocks {
            found.push(FoundArtifact::Code { language, content });
        }
    }
    found
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn depth_follows_size_and_code() {
        let config = DepthConfig::default();
        assert_eq!(classify("hi", "hello!", &config), Depth::Short);
        let medium = "word ".repeat(60);
        assert_eq!(classify(&medium, "ok", &config), Depth::Medium);
        let long = "word ".repeat(250);
        assert_eq!(classify("write it", &long, &config), Depth::Long);
        assert_eq!(
            classify("fix", "```rust\nfn main() {}\n```", &config),
            Depth::Code
        );
    }

    #[test]
    fn long_replies_become_drafts() {
        let config = DepthConfig::default();
        let long = "word ".repeat(250);
        let found = find_artifacts("draft my essay", &long, &config);
        assert_eq!(found, [FoundArtifact::Draft(Side::Assistant)]);
        assert_eq!(
            find_artifacts(&long, "Done.", &config),
            [FoundArtifact::Draft(Side::User)]
        );
        assert!(find_artifacts("hi", "hello", &config).is_empty());
    }
}
