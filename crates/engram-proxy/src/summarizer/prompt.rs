//! The prompt contract: what the summarizer model is sent (a system prompt and the exchange as a
//! JSON object) and how its reply becomes an `Extraction`.

use serde::Deserialize;
use serde_json::json;

use engram_memory::diff::{FactDiff, FactEdit};
use engram_memory::extract::{ASSISTANT_SUMMARY_WORDS, Extraction, USER_SUMMARY_WORDS};
use engram_memory::model::Depth;
use engram_memory::openai::Usage;
use engram_memory::text::clip_words;

pub const SYSTEM_PROMPT: &str = "\
You maintain the long-term memory of a chat assistant. You receive one exchange as a JSON object \
{\"user_message\", \"assistant_reply\", \"depth\"}. Reply with ONLY this JSON object, no prose and \
no code fence:
{\"user_summary\": string, \"assistant_summary\": string, \"add\": [string], \"update\": [string], \"remove\": [string]}

Rules:
- user_summary: at most 25 words. The user's intent and key specifics (names, types, constraints).
- assistant_summary: at most 30 words. What was decided or produced, not the process.
- Facts are about the user and their work, each one string \"key: value\", e.g. \"lives in: Berlin\", \
\"allergy: peanuts\", \"project language: Rust 1.89\".
- add: facts, preferences, constraints or decisions newly established in this exchange.
- update: a fact that changed, as the complete new \"key: value\" (not a description of the change).
- remove: \"key\" or \"key: old value\" for a fact the exchange says is no longer true.
- Use only what the exchange states. Never guess or infer; do not record the assistant's \
suggestions as facts unless the user accepted them.
- Always capture hard constraints (never, must, cannot, always, allergies, deadlines), wherever \
they appear in a message, the start of a long message included.
- Keep technical specifics exactly: library names, versions, types, function signatures.
- When depth is \"short\" or nothing lasting was said, leave the arrays empty unless the user \
stated a fact or constraint.";

/// The chat-completions request body. `user` and `assistant` are already fence-free and capped.
pub fn request_body(model: &str, user: &str, assistant: &str, depth: Depth) -> serde_json::Value {
    let depth = match depth {
        Depth::Short => "short",
        Depth::Medium => "medium",
        Depth::Long => "long",
        Depth::Code => "code",
    };
    // The exchange travels JSON-encoded, so its text cannot close a delimiter and pose as
    // instructions.
    let exchange = json!({"user_message": user, "assistant_reply": assistant, "depth": depth});
    json!({
        "model": model,
        "temperature": 0,
        "response_format": {"type": "json_object"},
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": exchange.to_string()},
        ],
    })
}

/// Caps the two sides at `max_chars` together: each side keeps at least half, and a side
/// shorter than its half leaves the rest to the other. Heads are kept (seed 001: constraints
/// often come first).
pub fn cap(user: &str, assistant: &str, max_chars: usize) -> (String, String) {
    let user_len = user.chars().count();
    let assistant_len = assistant.chars().count();
    if user_len + assistant_len <= max_chars {
        return (user.to_owned(), assistant.to_owned());
    }
    let half = max_chars / 2;
    let user_budget = user_len.min(half.max(max_chars.saturating_sub(assistant_len)));
    let assistant_budget = max_chars - user_budget;
    (head(user, user_budget), head(assistant, assistant_budget))
}

const CUT_MARK: &str = " […]";

fn head(text: &str, max_chars: usize) -> String {
    match text.char_indices().nth(max_chars) {
        None => text.to_owned(),
        Some((end, _)) => {
            let keep = max_chars.saturating_sub(CUT_MARK.chars().count());
            let end = text.char_indices().nth(keep).map_or(end, |(at, _)| at);
            format!("{}{CUT_MARK}", &text[..end])
        }
    }
}

#[derive(Deserialize)]
struct Completion {
    choices: Vec<Choice>,
}

#[derive(Deserialize)]
struct Choice {
    message: Message,
}

#[derive(Deserialize)]
struct Message {
    content: Option<String>,
}

/// The model's JSON. Arrays may be missing or null; a nested `diff`/`base_truth_diff` object
/// (seed 001's shape) is accepted too.
#[derive(Deserialize)]
struct ModelReply {
    user_summary: String,
    assistant_summary: String,
    #[serde(default)]
    add: Option<Vec<FactEdit>>,
    #[serde(default)]
    update: Option<Vec<FactEdit>>,
    #[serde(default)]
    remove: Option<Vec<FactEdit>>,
    #[serde(default, alias = "base_truth_diff")]
    diff: Option<FactDiff>,
}

/// Why a reply could not be used; never holds the reply text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ParseError {
    /// The response is not a chat completion with a text message.
    Envelope(String),
    /// The message is not the JSON object the prompt asks for.
    Content(String),
}

#[derive(Deserialize)]
struct UsageEnvelope {
    #[serde(default)]
    usage: Option<Usage>,
}

/// The token usage a chat-completions response body reports, if any (for the metrics).
pub fn usage(body: &[u8]) -> Option<Usage> {
    serde_json::from_slice::<UsageEnvelope>(body)
        .ok()
        .and_then(|envelope| envelope.usage)
}

/// A chat-completions response body → the extraction its message holds.
pub fn parse_completion(body: &[u8]) -> Result<Extraction, ParseError> {
    let completion: Completion =
        serde_json::from_slice(body).map_err(|error| ParseError::Envelope(error.to_string()))?;
    let content = completion
        .choices
        .into_iter()
        .next()
        .and_then(|choice| choice.message.content)
        .ok_or_else(|| ParseError::Envelope("no message content".into()))?;
    parse_content(&content)
}

/// The model's message → an `Extraction`, tolerating a ```json fence around the object.
pub fn parse_content(content: &str) -> Result<Extraction, ParseError> {
    let reply: ModelReply = serde_json::from_str(unfence(content))
        .map_err(|error| ParseError::Content(error.to_string()))?;
    let mut diff = reply.diff.unwrap_or_default();
    diff.add.extend(reply.add.unwrap_or_default());
    diff.update.extend(reply.update.unwrap_or_default());
    diff.remove.extend(reply.remove.unwrap_or_default());
    for list in [&mut diff.add, &mut diff.update, &mut diff.remove] {
        list.retain(|edit| !edit.text.trim().is_empty());
    }
    Ok(Extraction {
        user_summary: clip_words(&reply.user_summary, USER_SUMMARY_WORDS),
        assistant_summary: clip_words(&reply.assistant_summary, ASSISTANT_SUMMARY_WORDS),
        diff,
    })
}

fn unfence(content: &str) -> &str {
    let trimmed = content.trim();
    let Some(rest) = trimmed.strip_prefix("```") else {
        return trimmed;
    };
    // Drop the info string ("json") up to the end of the opening line.
    let body = rest.split_once('\n').map_or("", |(_, body)| body);
    body.trim_end().strip_suffix("```").unwrap_or(body).trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_and_fenced_json_parse() {
        let json = r#"{"user_summary": "Said they moved", "assistant_summary": "Congratulated",
                       "add": ["lives in: Berlin"], "update": [], "remove": ["lives in: Paris"]}"#;
        let plain = parse_content(json).unwrap();
        assert_eq!(plain.diff.add, [FactEdit::new("lives in: Berlin")]);
        assert_eq!(plain.diff.remove, [FactEdit::new("lives in: Paris")]);
        let fenced = parse_content(&format!("```json\n{json}\n```\n")).unwrap();
        assert_eq!(fenced, plain);
        let bare_fence = parse_content(&format!("```\n{json}```")).unwrap();
        assert_eq!(bare_fence, plain);
    }

    #[test]
    fn seed_shape_and_nulls_are_accepted() {
        let parsed = parse_content(
            r#"{"user_summary": "a", "assistant_summary": "b", "add": null,
                "base_truth_diff": {"add": ["pet: cat"], "update": ["job: nurse"]}}"#,
        )
        .unwrap();
        assert_eq!(parsed.diff.add, [FactEdit::new("pet: cat")]);
        assert_eq!(parsed.diff.update, [FactEdit::new("job: nurse")]);
    }

    #[test]
    fn wrong_shapes_are_errors() {
        for bad in [
            "not json",
            "{\"add\": []}",
            "{\"user_summary\": \"a\", \"assistant_summary\": \"b\", \"add\": 3}",
            "[1, 2]",
            "",
        ] {
            assert!(
                matches!(parse_content(bad), Err(ParseError::Content(_))),
                "{bad}"
            );
        }
        assert!(matches!(
            parse_completion(br#"{"choices": []}"#),
            Err(ParseError::Envelope(_))
        ));
        assert!(matches!(
            parse_completion(br#"{"choices": [{"message": {"content": null}}]}"#),
            Err(ParseError::Envelope(_))
        ));
    }

    #[test]
    fn usage_is_read_when_reported() {
        let body = br#"{"choices": [], "usage": {"prompt_tokens": 120, "completion_tokens": 30}}"#;
        let reported = usage(body).unwrap();
        assert_eq!(
            (reported.prompt_tokens, reported.completion_tokens),
            (120, 30)
        );
        assert_eq!(usage(br#"{"choices": []}"#), None);
        assert_eq!(usage(br#"{"usage": null}"#), None);
        assert_eq!(usage(b"not json"), None);
    }

    #[test]
    fn summaries_are_clipped_to_their_word_limits() {
        let long = "word ".repeat(60);
        let parsed = parse_content(
            &json!({"user_summary": long, "assistant_summary": long, "add": ["", "a: b"]})
                .to_string(),
        )
        .unwrap();
        // The limit plus the ellipsis.
        assert_eq!(
            parsed.user_summary.split_whitespace().count(),
            USER_SUMMARY_WORDS + 1
        );
        assert_eq!(
            parsed.assistant_summary.split_whitespace().count(),
            ASSISTANT_SUMMARY_WORDS + 1
        );
        assert_eq!(parsed.diff.add, [FactEdit::new("a: b")]);
    }

    #[test]
    fn cap_shares_the_budget() {
        let (user, assistant) = cap("short", "reply", 100);
        assert_eq!((user.as_str(), assistant.as_str()), ("short", "reply"));

        let long = "é".repeat(1000);
        let (user, assistant) = cap("short question", &long, 300);
        assert_eq!(user, "short question");
        assert_eq!(user.chars().count() + assistant.chars().count(), 300);
        assert!(assistant.ends_with(CUT_MARK));

        let (user, assistant) = cap(&long, &long, 300);
        assert_eq!(user.chars().count(), 150);
        assert_eq!(assistant.chars().count(), 150);
    }

    #[test]
    fn the_request_asks_for_a_json_object() {
        let body = request_body("m", "I live in Berlin", "Nice!", Depth::Short);
        assert_eq!(body["response_format"]["type"], "json_object");
        assert_eq!(body["temperature"], 0);
        let exchange: serde_json::Value =
            serde_json::from_str(body["messages"][1]["content"].as_str().unwrap()).unwrap();
        assert_eq!(exchange["user_message"], "I live in Berlin");
        assert_eq!(exchange["depth"], "short");
    }
}
