//! The baselines engram is compared with, built from the same data in the same run. Each yields,
//! per question, the context a prompt would carry besides the question, its cl100k tokens, and
//! which dialogue turns it holds:
//!
//! - **full history**: every exchange so far as chat messages (what a full-history client sends);
//! - **window**: the last `WINDOW_EXCHANGES` exchanges as chat messages;
//! - **BM25**: raw dialogue turns (indexed with their session's date, in words too, as engram
//!   indexes its raw turns) ranked by BM25 against the question, each a dated line, best first
//!   while the lines fit a token target (engram's mean prompt tokens at the same budget).

use std::collections::HashSet;

use super::bm25::Bm25Index;
use super::dataset::{Conversation, TurnPos};
use super::metrics::normalise;
use engram_memory::text::date_search_text;
use engram_memory::tokens::{Encoding, count_in};

/// Exchanges the window baseline keeps (engram's default raw window is 6 turns).
pub const WINDOW_EXCHANGES: usize = 6;

/// A baseline's prompt for one question.
#[derive(Debug, Clone)]
pub struct BaselinePrompt {
    /// Normalised context.
    pub context: String,
    pub tokens: u32,
    pub turns: HashSet<TurnPos>,
}

/// Everything the baselines need from one conversation, computed once.
pub struct ConversationBaselines {
    pub full_history: BaselinePrompt,
    pub window: BaselinePrompt,
    bm25: Bm25Index,
    /// Per dialogue turn (in conversation order): its position, its BM25 line and its tokens.
    lines: Vec<(TurnPos, String, u32)>,
}

fn chat_prompt(
    conversation: &Conversation,
    exchanges: &[(usize, usize)],
    encoding: Encoding,
) -> BaselinePrompt {
    let mut contents = Vec::new();
    let mut turns = HashSet::new();
    for (session, exchange) in exchanges {
        let exchange_ref = &conversation.sessions[*session].exchanges[*exchange];
        contents.push(exchange_ref.user.as_str());
        if !exchange_ref.assistant.is_empty() {
            contents.push(exchange_ref.assistant.as_str());
        }
        for turn in exchange_ref
            .user_turns
            .iter()
            .chain(&exchange_ref.assistant_turns)
        {
            turns.insert((*session, *turn));
        }
    }
    BaselinePrompt {
        context: normalise(&contents.join("\n")),
        tokens: contents.iter().map(|text| count_in(encoding, text)).sum(),
        turns,
    }
}

impl ConversationBaselines {
    pub fn new(conversation: &Conversation) -> ConversationBaselines {
        let encoding = Encoding::Cl100k;
        let all: Vec<(usize, usize)> = conversation
            .sessions
            .iter()
            .enumerate()
            .flat_map(|(s, session)| (0..session.exchanges.len()).map(move |e| (s, e)))
            .collect();
        let recent = &all[all.len().saturating_sub(WINDOW_EXCHANGES)..];
        let mut lines = Vec::new();
        for (s, session) in conversation.sessions.iter().enumerate() {
            let date = session.event_time.get(..10).unwrap_or_default();
            for (t, turn) in session.turns.iter().enumerate() {
                let line = format!("- [{date}] {}\n", turn.rendered().replace('\n', " "));
                let tokens = count_in(encoding, &line);
                lines.push(((s, t), line, tokens));
            }
        }
        // Indexed with the date in words too, as engram indexes its raw turns.
        let documents: Vec<String> = conversation
            .sessions
            .iter()
            .flat_map(|session| {
                let date = date_search_text(&session.event_time);
                session
                    .turns
                    .iter()
                    .map(move |turn| format!("{} {date}", turn.rendered()))
            })
            .collect();
        let bm25 = Bm25Index::new(documents.iter().map(String::as_str));
        ConversationBaselines {
            full_history: chat_prompt(conversation, &all, encoding),
            window: chat_prompt(conversation, recent, encoding),
            bm25,
            lines,
        }
    }

    /// The BM25 baseline's prompt: the best-ranked turns whose lines fit `target` tokens in
    /// total (a turn that does not fit is skipped and the next one tried), in conversation order.
    pub fn bm25(&self, question: &str, target: u32) -> BaselinePrompt {
        let mut chosen = Vec::new();
        let mut tokens = 0u32;
        for (doc, _) in self.bm25.rank(question) {
            let Some((_, _, line_tokens)) = self.lines.get(doc) else {
                continue;
            };
            if tokens + line_tokens <= target {
                tokens += line_tokens;
                chosen.push(doc);
            }
        }
        chosen.sort_unstable();
        let text: String = chosen
            .iter()
            .map(|doc| self.lines[*doc].1.as_str())
            .collect();
        BaselinePrompt {
            context: normalise(&text),
            tokens,
            turns: chosen.iter().map(|doc| self.lines[*doc].0).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dataset::parse;

    fn conversation() -> Conversation {
        let turns: Vec<serde_json::Value> = (1..=16)
            .map(|k| {
                let speaker = if k % 2 == 1 { "Ann" } else { "Bob" };
                serde_json::json!({"speaker": speaker, "dia_id": format!("D1:{k}"),
                    "text": format!("message number {k} about topic{k}")})
            })
            .collect();
        let text = serde_json::json!([{
            "sample_id": "c",
            "conversation": {"session_1_date_time": "1:56 pm on 8 May, 2023", "session_1": turns},
            "qa": []
        }])
        .to_string();
        parse(&text).unwrap().remove(0)
    }

    #[test]
    fn full_history_and_window() {
        let conversation = conversation();
        let baselines = ConversationBaselines::new(&conversation);
        assert_eq!(baselines.full_history.turns.len(), 16);
        assert!(
            baselines
                .full_history
                .context
                .starts_with("ann: message number 1 ")
        );
        // 8 exchanges of one turn per side; the window keeps the last 6, turns 5..16.
        assert_eq!(baselines.window.turns.len(), 12);
        assert!(!baselines.window.turns.contains(&(0, 3)));
        assert!(baselines.window.turns.contains(&(0, 4)));
        let per_message = count_in(Encoding::Cl100k, "Ann: message number 1 about topic1");
        assert!(baselines.full_history.tokens > 16 * (per_message - 2));
    }

    #[test]
    fn bm25_fills_up_to_the_target() {
        let conversation = conversation();
        let baselines = ConversationBaselines::new(&conversation);
        let line = &baselines.lines[2];
        let one = baselines.bm25("topic3", line.2);
        assert_eq!(one.turns.len(), 1);
        assert!(one.turns.contains(&(0, 2)));
        assert_eq!(one.tokens, line.2);
        assert!(
            one.context
                .contains("[2023-05-08] ann: message number 3 about topic3")
        );
        let none = baselines.bm25("topic3", line.2 - 1);
        assert!(none.turns.is_empty());
        assert_eq!(none.tokens, 0);
        let many = baselines.bm25("message topic3", 10_000);
        assert_eq!(many.turns.len(), 16);
    }
}
