//! LoCoMo's conversations, read from its JSON and turned into what the replay sends: sessions of
//! exchanges (user message, scripted assistant reply) with their event times, and the questions
//! with their gold evidence resolved to dialogue turns.
//!
//! The generated annotations (`observation`, `session_summary`, `event_summary`) are never read:
//! a memory system under evaluation must not see them.

use std::collections::HashMap;
use std::path::Path;

use serde::Serialize;
use serde_json::Value;

use engram::error::{Error, Result};

/// One dialogue turn as LoCoMo gives it.
#[derive(Debug, Clone, PartialEq)]
pub struct Turn {
    /// `D<session>:<k>`.
    pub dia_id: String,
    pub speaker: String,
    pub text: String,
    /// The caption of a shared photo, if any.
    pub caption: Option<String>,
}

impl Turn {
    /// The turn as the replay writes it: `<speaker>: <text>`, with ` [shares a photo: …]` when
    /// it has a caption.
    pub fn rendered(&self) -> String {
        match &self.caption {
            Some(caption) => format!(
                "{}: {} [shares a photo: {caption}]",
                self.speaker, self.text
            ),
            None => format!("{}: {}", self.speaker, self.text),
        }
    }

    /// The text evidence recall looks for in a prompt: `<speaker>: <text>` (the caption is an
    /// addition of the replay, not the turn's words).
    pub fn evidence_text(&self) -> String {
        format!("{}: {}", self.speaker, self.text)
    }
}

/// One exchange of a session: a run of the session's first speaker (the user message) and the
/// run of the other speaker that follows (the assistant reply, possibly empty at the end).
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    /// Indices into the session's turns.
    pub user_turns: Vec<usize>,
    pub assistant_turns: Vec<usize>,
    pub user: String,
    pub assistant: String,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Session {
    /// `session_<n>`.
    pub id: String,
    pub number: u32,
    /// As given, e.g. `1:56 pm on 8 May, 2023`.
    pub date_time: String,
    /// RFC 3339, for `x-engram-event-time`.
    pub event_time: String,
    pub turns: Vec<Turn>,
    pub exchanges: Vec<Exchange>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Category {
    MultiHop = 1,
    Temporal = 2,
    OpenDomain = 3,
    SingleHop = 4,
    Adversarial = 5,
}

impl Category {
    pub const EVALUATED: [Category; 4] = [
        Category::MultiHop,
        Category::Temporal,
        Category::OpenDomain,
        Category::SingleHop,
    ];

    fn from_number(number: u64) -> Option<Category> {
        match number {
            1 => Some(Category::MultiHop),
            2 => Some(Category::Temporal),
            3 => Some(Category::OpenDomain),
            4 => Some(Category::SingleHop),
            5 => Some(Category::Adversarial),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Category::MultiHop => "multi-hop",
            Category::Temporal => "temporal",
            Category::OpenDomain => "open-domain",
            Category::SingleHop => "single-hop",
            Category::Adversarial => "adversarial",
        }
    }
}

/// A dialogue turn's place: session index (into `Conversation::sessions`) and turn index.
pub type TurnPos = (usize, usize);

#[derive(Debug, Clone, PartialEq)]
pub struct Question {
    pub question: String,
    /// Integers in the data are written as text.
    pub answer: String,
    pub category: Category,
    /// The gold evidence turns that exist in the conversation, deduplicated, in given order.
    pub evidence: Vec<TurnPos>,
    /// Evidence ids that name no turn of the conversation (malformed or missing in the data).
    pub unresolved_evidence: Vec<String>,
}

#[derive(Debug, Clone, PartialEq)]
pub struct Conversation {
    pub sample_id: String,
    pub sessions: Vec<Session>,
    /// Every question, adversarial ones included (the replay asks categories 1–4).
    pub questions: Vec<Question>,
}

impl Conversation {
    pub fn turn(&self, (session, turn): TurnPos) -> Option<&Turn> {
        self.sessions.get(session)?.turns.get(turn)
    }

    pub fn exchange_count(&self) -> usize {
        self.sessions
            .iter()
            .map(|session| session.exchanges.len())
            .sum()
    }

    pub fn evaluated_questions(&self) -> impl Iterator<Item = &Question> {
        self.questions
            .iter()
            .filter(|question| question.category != Category::Adversarial)
    }
}

pub fn load(path: &Path) -> Result<Vec<Conversation>> {
    let text = std::fs::read_to_string(path).map_err(|error| {
        Error::Io(std::io::Error::new(
            error.kind(),
            format!("cannot read {}: {error}", path.display()),
        ))
    })?;
    parse(&text)
}

fn bad(message: impl Into<String>) -> Error {
    Error::Internal(format!("LoCoMo data: {}", message.into()))
}

pub fn parse(text: &str) -> Result<Vec<Conversation>> {
    let root: Value = serde_json::from_str(text).map_err(|error| bad(error.to_string()))?;
    let Value::Array(samples) = root else {
        return Err(bad("expected a JSON array of conversations"));
    };
    samples.iter().map(conversation).collect()
}

fn string(value: &Value, key: &str, within: &str) -> Result<String> {
    value
        .get(key)
        .and_then(Value::as_str)
        .map(str::to_owned)
        .ok_or_else(|| bad(format!("{within}: missing text field `{key}`")))
}

fn conversation(sample: &Value) -> Result<Conversation> {
    let sample_id = string(sample, "sample_id", "conversation")?;
    let body = sample
        .get("conversation")
        .and_then(Value::as_object)
        .ok_or_else(|| bad(format!("{sample_id}: missing `conversation`")))?;
    let mut numbers: Vec<u32> = body
        .keys()
        .filter_map(|key| key.strip_prefix("session_"))
        .filter_map(|rest| rest.parse().ok())
        .collect();
    numbers.sort_unstable();
    let mut sessions = Vec::new();
    for number in numbers {
        let id = format!("session_{number}");
        let Some(Value::Array(raw_turns)) = body.get(&id) else {
            continue;
        };
        let date_time = body
            .get(&format!("{id}_date_time"))
            .and_then(Value::as_str)
            .ok_or_else(|| bad(format!("{sample_id}: {id} has no date_time")))?
            .to_owned();
        let event_time = parse_date_time(&date_time)
            .ok_or_else(|| bad(format!("{sample_id}: cannot read the date `{date_time}`")))?;
        let mut turns = Vec::new();
        for raw in raw_turns {
            let within = format!("{sample_id} {id}");
            turns.push(Turn {
                dia_id: string(raw, "dia_id", &within)?,
                speaker: string(raw, "speaker", &within)?,
                text: string(raw, "text", &within)?,
                caption: raw
                    .get("blip_caption")
                    .and_then(Value::as_str)
                    .map(str::trim)
                    .filter(|caption| !caption.is_empty())
                    .map(str::to_owned),
            });
        }
        if turns.is_empty() {
            continue;
        }
        let exchanges = exchanges(&turns);
        sessions.push(Session {
            id,
            number,
            date_time,
            event_time,
            turns,
            exchanges,
        });
    }
    let positions: HashMap<&str, TurnPos> = sessions
        .iter()
        .enumerate()
        .flat_map(|(s, session)| {
            session
                .turns
                .iter()
                .enumerate()
                .map(move |(t, turn)| (turn.dia_id.as_str(), (s, t)))
        })
        .collect();
    let mut questions = Vec::new();
    if let Some(Value::Array(qa)) = sample.get("qa") {
        for item in qa {
            let Some(category) = item
                .get("category")
                .and_then(Value::as_u64)
                .and_then(Category::from_number)
            else {
                continue;
            };
            let question = string(item, "question", &sample_id)?;
            let answer = match item.get("answer") {
                Some(Value::String(text)) => text.clone(),
                Some(Value::Number(number)) => number.to_string(),
                _ => String::new(),
            };
            let mut evidence = Vec::new();
            let mut unresolved = Vec::new();
            for id in evidence_ids(item.get("evidence")) {
                match positions.get(id.as_str()) {
                    Some(position) if !evidence.contains(position) => evidence.push(*position),
                    Some(_) => {}
                    None => unresolved.push(id),
                }
            }
            questions.push(Question {
                question,
                answer,
                category,
                evidence,
                unresolved_evidence: unresolved,
            });
        }
    }
    Ok(Conversation {
        sample_id,
        sessions,
        questions,
    })
}

/// Evidence ids, split where the data joins several in one string (`"D8:6; D9:17"`) and with a
/// stray colon after the `D` repaired (`"D:11:26"`).
fn evidence_ids(value: Option<&Value>) -> Vec<String> {
    let Some(Value::Array(items)) = value else {
        return Vec::new();
    };
    items
        .iter()
        .filter_map(Value::as_str)
        .flat_map(|item| item.split(|c: char| c == ';' || c == ',' || c.is_whitespace()))
        .filter(|id| !id.is_empty())
        .map(|id| match id.strip_prefix("D:") {
            Some(rest) => format!("D{rest}"),
            None => id.to_owned(),
        })
        .collect()
}

/// Groups a session's turns into exchanges: a maximal run of the first speaker's turns, then
/// the maximal run of the other's. Turns of a run are joined by a newline.
pub fn exchanges(turns: &[Turn]) -> Vec<Exchange> {
    let Some(first) = turns.first().map(|turn| turn.speaker.as_str()) else {
        return Vec::new();
    };
    let join = |indices: &[usize]| {
        indices
            .iter()
            .map(|index| turns[*index].rendered())
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut out = Vec::new();
    let mut at = 0;
    while at < turns.len() {
        let mut user_turns = Vec::new();
        while at < turns.len() && turns[at].speaker == first {
            user_turns.push(at);
            at += 1;
        }
        let mut assistant_turns = Vec::new();
        while at < turns.len() && turns[at].speaker != first {
            assistant_turns.push(at);
            at += 1;
        }
        out.push(Exchange {
            user: join(&user_turns),
            assistant: join(&assistant_turns),
            user_turns,
            assistant_turns,
        });
    }
    out
}

/// `1:56 pm on 8 May, 2023` → `2023-05-08T13:56:00Z`.
pub fn parse_date_time(text: &str) -> Option<String> {
    let (time, date) = text.split_once(" on ")?;
    let time = time.trim().to_ascii_lowercase();
    let (clock, meridiem) = time.split_once(' ')?;
    let (hour, minute) = clock.split_once(':')?;
    let (hour, minute): (u32, u32) = (hour.parse().ok()?, minute.parse().ok()?);
    if !(1..=12).contains(&hour) || minute > 59 {
        return None;
    }
    let hour = match meridiem.trim() {
        "am" => hour % 12,
        "pm" => hour % 12 + 12,
        _ => return None,
    };
    let mut fields = date
        .split(|c: char| c == ',' || c.is_whitespace())
        .filter(|part| !part.is_empty());
    let day: u32 = fields.next()?.parse().ok()?;
    let month = month_number(fields.next()?)?;
    let year: u32 = fields.next()?.parse().ok()?;
    if !(1..=31).contains(&day) || fields.next().is_some() {
        return None;
    }
    Some(format!(
        "{year:04}-{month:02}-{day:02}T{hour:02}:{minute:02}:00Z"
    ))
}

fn month_number(name: &str) -> Option<u32> {
    const MONTHS: [&str; 12] = [
        "january",
        "february",
        "march",
        "april",
        "may",
        "june",
        "july",
        "august",
        "september",
        "october",
        "november",
        "december",
    ];
    let name = name.to_ascii_lowercase();
    MONTHS
        .iter()
        .position(|month| *month == name || (name.len() >= 3 && month.starts_with(&name)))
        .and_then(|index| u32::try_from(index + 1).ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn turn(dia_id: &str, speaker: &str, text: &str) -> Turn {
        Turn {
            dia_id: dia_id.into(),
            speaker: speaker.into(),
            text: text.into(),
            caption: None,
        }
    }

    #[test]
    fn dates_become_rfc3339() {
        assert_eq!(
            parse_date_time("1:56 pm on 8 May, 2023").as_deref(),
            Some("2023-05-08T13:56:00Z")
        );
        assert_eq!(
            parse_date_time("12:09 am on 13 September, 2023").as_deref(),
            Some("2023-09-13T00:09:00Z")
        );
        assert_eq!(
            parse_date_time("12:30 pm on 1 Jan, 2024").as_deref(),
            Some("2024-01-01T12:30:00Z")
        );
        assert_eq!(parse_date_time("yesterday"), None);
        assert_eq!(parse_date_time("13:00 pm on 1 May, 2023"), None);
    }

    #[test]
    fn runs_of_speakers_become_exchanges() {
        let mut turns = vec![
            turn("D1:1", "Ann", "Hi!"),
            turn("D1:2", "Ann", "Guess what."),
            turn("D1:3", "Bob", "What?"),
            turn("D1:4", "Ann", "I adopted a cat."),
            turn("D1:5", "Bob", "Lovely."),
            turn("D1:6", "Bob", "Name?"),
            turn("D1:7", "Ann", "Tom."),
        ];
        turns[4].caption = Some("a photo of a cat".into());
        let got = exchanges(&turns);
        assert_eq!(got.len(), 3);
        assert_eq!(got[0].user, "Ann: Hi!\nAnn: Guess what.");
        assert_eq!(got[0].assistant, "Bob: What?");
        assert_eq!(got[1].user_turns, [3]);
        assert_eq!(got[1].assistant_turns, [4, 5]);
        assert_eq!(
            got[1].assistant,
            "Bob: Lovely. [shares a photo: a photo of a cat]\nBob: Name?"
        );
        assert_eq!(got[2].user, "Ann: Tom.");
        assert_eq!(got[2].assistant, "");
    }

    #[test]
    fn evidence_ids_are_split_and_repaired() {
        let value = serde_json::json!(["D8:6; D9:17", "D:11:26", "D1:2", "D"]);
        assert_eq!(
            evidence_ids(Some(&value)),
            ["D8:6", "D9:17", "D11:26", "D1:2", "D"]
        );
    }

    #[test]
    fn conversations_parse_with_integer_answers_and_unknown_evidence() {
        let text = serde_json::json!([{
            "sample_id": "c1",
            "conversation": {
                "speaker_a": "Ann", "speaker_b": "Bob",
                "session_1_date_time": "1:56 pm on 8 May, 2023",
                "session_1": [
                    {"speaker": "Ann", "dia_id": "D1:1", "text": "I was born in 1990."},
                    {"speaker": "Bob", "dia_id": "D1:2", "text": "Nice.",
                     "blip_caption": "a photo", "img_url": ["x"]}
                ]
            },
            "qa": [
                {"question": "When?", "answer": 1990, "evidence": ["D1:1; D7:1"], "category": 2},
                {"question": "Trick?", "adversarial_answer": "x", "evidence": [], "category": 5}
            ],
            "observation": {"ignored": true}
        }])
        .to_string();
        let conversations = parse(&text).unwrap();
        let conversation = &conversations[0];
        assert_eq!(conversation.sessions[0].event_time, "2023-05-08T13:56:00Z");
        assert_eq!(
            conversation.sessions[0].exchanges[0].assistant,
            "Bob: Nice. [shares a photo: a photo]"
        );
        let question = &conversation.questions[0];
        assert_eq!(question.answer, "1990");
        assert_eq!(question.evidence, [(0, 0)]);
        assert_eq!(question.unresolved_evidence, ["D7:1"]);
        assert_eq!(conversation.evaluated_questions().count(), 1);
    }
}
