//! Extraction: an exchange → turn-log summaries + a base-truth diff. The heuristic extractor is
//! the offline default (no network, microseconds); an LLM summarizer returns the same
//! `Extraction` and is plugged in through `Precomputed`.

use std::sync::LazyLock;

use memchr::memmem::Finder;
use serde::{Deserialize, Serialize};

use super::diff::{FactDiff, FactEdit};
use super::patterns::{Phrase, Table, patterns};
use crate::code::without_code;
use crate::model::{Depth, FactCategory};
use crate::text::{clip_words, excerpt, one_line, word_count};
use crate::yielding;

/// The exchange as the extractor sees it (engram's own fences already stripped).
#[derive(Debug, Clone, Copy)]
pub struct ExchangeView<'a> {
    pub user: &'a str,
    pub assistant: &'a str,
    /// `Depth::Short` tells an LLM summarizer it may skip the diff (seed 001).
    pub depth: Depth,
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Extraction {
    /// At most 25 words.
    pub user_summary: String,
    /// At most 30 words.
    pub assistant_summary: String,
    #[serde(default)]
    pub diff: FactDiff,
}

pub const USER_SUMMARY_WORDS: usize = 25;
pub const ASSISTANT_SUMMARY_WORDS: usize = 30;

pub trait Extractor {
    fn extract(&self, exchange: &ExchangeView<'_>) -> Extraction;
}

/// An extraction computed elsewhere (the LLM summarizer on the worker), replayed as-is.
#[derive(Debug, Clone, Default)]
pub struct Precomputed(pub Extraction);

impl Extractor for Precomputed {
    fn extract(&self, _exchange: &ExchangeView<'_>) -> Extraction {
        self.0.clone()
    }
}

/// Pattern-based extraction of the user's own statements: names, age, places, work, allergies
/// and diets, "never"/"always" rules, explicit "remember" requests, preferences, relations,
/// possessions, plans, dated events and deadlines. The patterns are high-precision and cheap, so
/// unlike an LLM summarizer it runs them on short exchanges too: a short "I'm allergic to
/// peanuts" is exactly the constraint seed 003 warns summaries drop.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeuristicExtractor;

/// The heuristic extractor reads at most this much of each side (head and tail, see
/// `text::excerpt`). With 100 KB pastes its patterns were half of the worker's CPU samples;
/// a person's own statements around a pasted document sit at its ends.
pub const HEURISTIC_MAX_BYTES: usize = 4096;

impl Extractor for HeuristicExtractor {
    fn extract(&self, exchange: &ExchangeView<'_>) -> Extraction {
        let user = excerpt(exchange.user, HEURISTIC_MAX_BYTES);
        let assistant = excerpt(exchange.assistant, HEURISTIC_MAX_BYTES);
        let mut diff = FactDiff::default();
        for sentence in sentences(&normalise_quotes(&user)) {
            extract_sentence(&sentence, &mut diff);
            yielding::checkpoint();
        }
        Extraction {
            user_summary: summarise(&user, USER_SUMMARY_WORDS),
            assistant_summary: summarise(&assistant, ASSISTANT_SUMMARY_WORDS),
            diff,
        }
    }
}

fn normalise_quotes(text: &str) -> String {
    text.replace(['\u{2019}', '\u{2018}'], "'")
}

/// Sentences of `text`, split at `.`, `!`, `?`, `;` followed by a space or the end, and at
/// newlines. Code blocks are dropped first.
pub fn sentences(text: &str) -> Vec<String> {
    let prose = without_code(text);
    let mut out = Vec::new();
    let mut current = String::new();
    let mut chars = prose.chars().peekable();
    while let Some(c) = chars.next() {
        if c == '\n' {
            push_sentence(&mut out, &mut current);
            continue;
        }
        current.push(c);
        if matches!(c, '.' | '!' | '?' | ';')
            && chars.peek().is_none_or(|next| next.is_whitespace())
        {
            push_sentence(&mut out, &mut current);
        }
    }
    push_sentence(&mut out, &mut current);
    out
}

fn push_sentence(out: &mut Vec<String>, current: &mut String) {
    let sentence = one_line(current);
    if !sentence.is_empty() {
        out.push(sentence);
    }
    current.clear();
}

fn is_filler(sentence: &str) -> bool {
    let bare = sentence
        .trim_matches(|c: char| !c.is_alphanumeric())
        .to_lowercase();
    word_count(&bare) <= 3
        && (bare.is_empty()
            || patterns()
                .words
                .filler
                .iter()
                .any(|filler| bare == *filler || bare.starts_with(&format!("{filler} "))))
}

/// A summary of at most `max_words` words: the first informative sentence, the first question
/// if it is a different one, then following sentences while they fit.
pub fn summarise(text: &str, max_words: usize) -> String {
    let all = sentences(&normalise_quotes(text));
    let informative: Vec<&String> = all.iter().filter(|s| !is_filler(s)).collect();
    let pool: Vec<&String> = if informative.is_empty() {
        all.iter().collect()
    } else {
        informative
    };
    let Some(first) = pool.first() else {
        return String::new();
    };
    if word_count(first) >= max_words {
        return clip_words(first, max_words - 1);
    }
    let mut chosen = vec![0usize];
    let mut used = word_count(first);
    if let Some(question) = pool.iter().position(|s| s.ends_with('?'))
        && question != 0
        && used + word_count(pool[question]) <= max_words
    {
        chosen.push(question);
        used += word_count(pool[question]);
    }
    for (index, sentence) in pool.iter().enumerate().skip(1) {
        if chosen.contains(&index) {
            continue;
        }
        let words = word_count(sentence);
        if used + words > max_words {
            break;
        }
        chosen.push(index);
        used += words;
    }
    chosen.sort_unstable();
    let picked: Vec<&str> = chosen.iter().map(|index| pool[*index].as_str()).collect();
    picked.join(" ")
}

// ---- fact patterns ----

/// Up to `max_words` words of `rest`, stopping at a boundary word or clause punctuation.
fn phrase(rest: &str, max_words: usize, boundary: &Table) -> String {
    let mut words: Vec<&str> = Vec::new();
    for raw in rest.split_whitespace() {
        if words.len() == max_words {
            break;
        }
        let word = raw.trim_end_matches(|c: char| ",;:.!?)\"".contains(c));
        let lower = word.to_ascii_lowercase();
        if boundary.has(&lower) && !words.is_empty() {
            break;
        }
        if !word.is_empty() {
            words.push(word);
        }
        if word.len() != raw.len() {
            break;
        }
    }
    words.join(" ")
}

/// The original-case text after the first whole-word occurrence of `trigger` in `sentence`.
fn after<'a>(sentence: &'a str, lower: &str, trigger: &str) -> Option<&'a str> {
    // memchr's searcher, not `str::find`: std sets up a two-way searcher for every call, which
    // with a few dozen triggers per sentence was most of the extractor's time on long texts.
    after_found(sentence, lower, &Finder::new(trigger))
}

/// [`after`] for a phrase of the tables, whose searcher is built once.
fn after_phrase<'a>(sentence: &'a str, lower: &str, phrase: &Phrase) -> Option<&'a str> {
    after_found(sentence, lower, phrase.finder())
}

/// The text after the first match of `finder`'s needle in `lower` that begins a word. A match
/// of a whole UTF-8 needle always starts on a character boundary.
fn after_found<'a>(sentence: &'a str, lower: &str, finder: &Finder) -> Option<&'a str> {
    let len = finder.needle().len();
    let mut from = 0;
    while let Some(found) = lower
        .as_bytes()
        .get(from..)
        .and_then(|rest| finder.find(rest))
    {
        let start = from + found;
        let boundary_before = lower[..start]
            .chars()
            .next_back()
            .is_none_or(|c| !c.is_alphanumeric() && c != '\'');
        if boundary_before {
            return sentence.get(start + len..);
        }
        from = start + len;
    }
    None
}

fn after_any<'a>(sentence: &'a str, lower: &str, phrases: &[Phrase]) -> Option<&'a str> {
    phrases
        .iter()
        .find_map(|phrase| after_phrase(sentence, lower, phrase))
}

/// A statement is worth keeping if it has a key, and a value when it has a colon.
fn well_formed(text: &str) -> bool {
    let (key, value) = super::diff::split_key_value(text);
    !key.is_empty() && (!text.contains(':') || !value.is_empty())
}

fn add(diff: &mut FactDiff, text: String, category: FactCategory) {
    if well_formed(&text) {
        diff.add.push(FactEdit::with_category(text, category));
    }
}

fn update(diff: &mut FactDiff, text: String, category: FactCategory) {
    if well_formed(&text) {
        diff.update.push(FactEdit::with_category(text, category));
    }
}

fn remove(diff: &mut FactDiff, text: String) {
    if well_formed(&text) {
        diff.remove.push(FactEdit::new(text));
    }
}

fn starts_upper(word: &str) -> bool {
    word.chars().next().is_some_and(char::is_uppercase)
}

/// Items of a list phrase: "peanuts, shellfish and eggs" -> three items.
fn list_items(phrase: &str) -> Vec<String> {
    phrase
        .replace(" and ", ",")
        .replace(" or ", ",")
        .split(',')
        .map(|item| item.trim().trim_start_matches("and ").trim().to_string())
        .filter(|item| !item.is_empty())
        .collect()
}

fn looks_like_job(noun: &str) -> bool {
    let words = &patterns().words;
    let noun = noun.to_ascii_lowercase();
    !words.not_jobs.has(&noun)
        && (words
            .job_suffixes
            .iter()
            .any(|suffix| noun.ends_with(suffix.as_str()))
            || words.jobs.has(&noun))
}

fn extract_sentence(sentence: &str, diff: &mut FactDiff) {
    let lower = sentence.to_ascii_lowercase();
    identity_patterns(sentence, &lower, diff);
    constraint_patterns(sentence, &lower, diff);
    explicit_patterns(sentence, &lower, diff);
    preference_patterns(sentence, &lower, diff);
    relation_patterns(sentence, &lower, diff);
    possession_patterns(sentence, &lower, diff);
    plan_and_event_patterns(sentence, &lower, diff);
}

fn identity_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    if let Some(rest) = after_any(sentence, lower, &p.triggers.name) {
        let name = name_words(rest, false);
        update(diff, format!("name: {name}"), FactCategory::Identity);
    } else if let Some(rest) = after_any(sentence, lower, &p.triggers.called) {
        let name = name_words(rest, true);
        update(diff, format!("name: {name}"), FactCategory::Identity);
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.age) {
        let mut words = rest.split_whitespace();
        if let (Some(number), Some(unit)) = (words.next(), words.next())
            && number.chars().all(|c| c.is_ascii_digit())
            && (unit.starts_with("years") || unit.starts_with("yo"))
        {
            update(diff, format!("age: {number}"), FactCategory::Identity);
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.moved_from) {
        let rest_lower = rest.to_ascii_lowercase();
        match after(rest, &rest_lower, "to ") {
            Some(destination) => {
                let place = phrase(destination, 4, &p.words.boundary);
                update(diff, format!("lives in: {place}"), FactCategory::Identity);
            }
            None => remove(
                diff,
                format!("lives in: {}", phrase(rest, 4, &p.words.boundary)),
            ),
        }
    } else if let Some(rest) = after_any(sentence, lower, &p.triggers.lives_in) {
        let place = phrase(rest, 4, &p.words.boundary);
        update(diff, format!("lives in: {place}"), FactCategory::Identity);
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.from) {
        let place = phrase(rest, 4, &p.words.boundary);
        update(diff, format!("from: {place}"), FactCategory::Identity);
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.works_at) {
        let employer = phrase(rest, 5, &p.words.boundary);
        update(
            diff,
            format!("works at: {employer}"),
            FactCategory::Identity,
        );
    }
    if after_any(sentence, lower, &p.triggers.lost_job).is_some() {
        remove(diff, "works at".to_string());
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.job) {
        let job = phrase(rest, 4, &p.words.boundary);
        update(diff, format!("job: {job}"), FactCategory::Identity);
    } else if let Some(rest) = after_any(sentence, lower, &p.triggers.job_if_noun) {
        // "I'm a nurse", "I'm a software engineer": the head noun must look like a job.
        let candidate = phrase(rest, 3, &p.words.boundary);
        if candidate
            .split_whitespace()
            .last()
            .is_some_and(looks_like_job)
        {
            update(diff, format!("job: {candidate}"), FactCategory::Identity);
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.studies) {
        let subject = phrase(rest, 4, &p.words.boundary);
        update(diff, format!("studies: {subject}"), FactCategory::Identity);
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.born) {
        let when = phrase(rest, 4, &p.words.plan_boundary);
        update(diff, format!("born: {when}"), FactCategory::Identity);
    }
    for (trigger, status) in p.relationship_statuses.iter() {
        if after_phrase(sentence, lower, trigger).is_some() {
            update(
                diff,
                format!("relationship status: {status}"),
                FactCategory::Identity,
            );
            break;
        }
    }
}

/// 1–3 name words; `capitalised_only` for triggers that also introduce non-names ("call me
/// tomorrow").
fn name_words(rest: &str, capitalised_only: bool) -> String {
    let mut words = Vec::new();
    for raw in rest.split_whitespace().take(3) {
        let word = raw.trim_matches(|c: char| !c.is_alphanumeric() && c != '-' && c != '\'');
        if word.is_empty() || (!starts_upper(word) && (capitalised_only || !words.is_empty())) {
            break;
        }
        words.push(word);
        if raw.len() != word.len() {
            break;
        }
    }
    words.join(" ")
}

/// Whether `word` (lowercase), after a sentence's opening "never" or "always", can begin an
/// instruction ("Never book me…", "Always answer…") rather than a statement whose subject is
/// left out ("Never had a chance to…", "Always been into…", "Always here to help"): not a past
/// form, an auxiliary or a word that is no verb. A hard constraint is shown in every prompt,
/// so a statement taken for one costs every request its tokens.
fn instruction_verb(word: &str) -> bool {
    let word = word.trim_matches(|c: char| !c.is_alphanumeric() && c != '\'');
    let past = word.len() > 4 && word.ends_with("ed") && !word.ends_with("eed") && word != "embed";
    !word.is_empty() && !past && !patterns().words.statement_words.has(word)
}

fn constraint_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    let negated_allergy = after_any(sentence, lower, &p.triggers.not_allergic);
    if let Some(rest) = negated_allergy {
        for item in list_items(&phrase(rest, 6, &p.words.list_boundary)) {
            remove(diff, format!("allergic to {item}"));
        }
    } else if let Some(start) = lower.find("allergic to ") {
        let rest = sentence.get(start + "allergic to ".len()..).unwrap_or("");
        let subject = allergy_subject(&lower[..start]);
        for item in list_items(&phrase(rest, 6, &p.words.list_boundary)) {
            let text = match &subject {
                None => format!("allergic to {item}"),
                Some(subject) => format!("{subject} is allergic to {item}"),
            };
            add(diff, text, FactCategory::HardConstraint);
        }
    } else if let Some(start) = lower.find(" allergy") {
        // "I have a severe peanut allergy": the word before "allergy".
        let before = &sentence[..start];
        if let Some(item) = before.split_whitespace().last()
            && !p.words.not_allergens.has(item)
        {
            add(
                diff,
                format!("allergic to {item}"),
                FactCategory::HardConstraint,
            );
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.cannot_eat) {
        for item in list_items(&phrase(rest, 5, &p.words.list_boundary)) {
            add(
                diff,
                format!("does not eat {item}"),
                FactCategory::HardConstraint,
            );
        }
    }
    for (diet, stated) in DIET_PHRASES.iter() {
        if after_any(sentence, lower, stated).is_some() {
            update(diff, format!("diet: {diet}"), FactCategory::HardConstraint);
        }
    }
    // Instructions: "Never book me on red-eye flights", "please always answer in French".
    let bare = lower
        .trim_start_matches("please ")
        .trim_start_matches("and ");
    let instruction = p
        .triggers
        .instruction_openings
        .iter()
        .filter_map(|start| bare.strip_prefix(start.as_str()))
        .any(|rest| rest.split_whitespace().next().is_some_and(instruction_verb))
        || after_any(sentence, lower, &p.triggers.instructions).is_some();
    if instruction {
        let from = p
            .triggers
            .instruction_openings
            .iter()
            .filter_map(|word| lower.find(word.as_str()))
            .min()
            .unwrap_or(0);
        let rule = clip_words(sentence[from..].trim_end_matches(['.', '!']), 20);
        add(diff, rule, FactCategory::HardConstraint);
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.do_not)
        && !instruction
    {
        let start = sentence.len() - rest.len();
        let verb = sentence[..start]
            .trim_end()
            .rsplit(|c: char| c.is_whitespace())
            .next()
            .unwrap_or("");
        let object = phrase(rest, 8, &p.words.plan_boundary);
        add(
            diff,
            format!("do not {} {object}", verb.to_ascii_lowercase()),
            FactCategory::HardConstraint,
        );
    }
    deadline_patterns(sentence, lower, diff);
}

/// "The deadline for the grant is March 3", "the report is due by Friday".
fn deadline_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    if let Some(start) = lower.find("deadline")
        && let Some(is_at) = lower[start..].find(" is ")
    {
        let between = &sentence[start + "deadline".len()..start + is_at];
        let topic = between
            .trim()
            .trim_start_matches("for ")
            .trim_start_matches("the ")
            .trim();
        let when = phrase(&sentence[start + is_at + 4..], 5, &p.words.plan_boundary);
        let text = if topic.is_empty() {
            format!("deadline: {when}")
        } else {
            format!("deadline for {topic}: {when}")
        };
        update(diff, text, FactCategory::HardConstraint);
        return;
    }
    if let Some(at) = lower.find(" is due ") {
        let rest = &sentence[at + " is due ".len()..];
        let rest = rest
            .strip_prefix("by ")
            .or_else(|| rest.strip_prefix("on "))
            .unwrap_or(rest);
        let subject: Vec<&str> = sentence[..at]
            .split_whitespace()
            .rev()
            .take_while(|word| !p.words.due_subject_stops.has(&word.to_ascii_lowercase()))
            .take(3)
            .collect();
        let subject: Vec<&str> = subject.into_iter().rev().collect();
        let when = phrase(rest, 5, &p.words.plan_boundary);
        if !subject.is_empty() {
            update(
                diff,
                format!("deadline for {}: {when}", subject.join(" ")),
                FactCategory::HardConstraint,
            );
        }
    }
}

/// "my son is allergic to" -> Some("my son"); "I'm allergic to" -> None (the user).
fn allergy_subject(before: &str) -> Option<String> {
    let before = before.trim_end();
    let subject = before
        .strip_suffix(" is")
        .or_else(|| before.strip_suffix(" are"))?;
    let words: Vec<&str> = subject.split_whitespace().collect();
    let start = words.iter().rposition(|word| *word == "my")?;
    Some(words[start..].join(" "))
}

fn explicit_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    if let Some(rest) = after_any(sentence, lower, &p.triggers.remember) {
        let note = clip_words(rest.trim_end_matches(['.', '!']), USER_SUMMARY_WORDS - 1);
        // Keep the colon out so the whole statement is the key.
        let note = note.replace(':', " -");
        let category = match super::diff::infer_category(&note, "") {
            FactCategory::HardConstraint => FactCategory::HardConstraint,
            _ => FactCategory::Explicit,
        };
        add(diff, note, category);
    }
}

fn preference_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    if let Some(rest) = after_any(sentence, lower, &p.triggers.likes) {
        let object = phrase(rest, 6, &p.words.boundary);
        let lower_object = object.to_ascii_lowercase();
        if !object.is_empty() && !p.words.not_objects.has(&lower_object) {
            add(diff, format!("likes {object}"), FactCategory::Preference);
            remove(diff, format!("dislikes {object}"));
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.dislikes) {
        let object = phrase(rest, 6, &p.words.boundary);
        let lower_object = object.to_ascii_lowercase();
        if !object.is_empty() && !p.words.not_objects.has(&lower_object) {
            add(diff, format!("dislikes {object}"), FactCategory::Preference);
            remove(diff, format!("likes {object}"));
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.prefers) {
        let object = phrase(rest, 8, &p.words.plan_boundary);
        add(diff, format!("prefers {object}"), FactCategory::Preference);
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.favorite) {
        let rest_lower = rest.to_ascii_lowercase();
        if let Some(split) = rest_lower.find(" is ") {
            let what = rest[..split].trim();
            let value = phrase(&rest[split + 4..], 6, &p.words.boundary);
            if !what.is_empty() && word_count(what) <= 3 {
                update(
                    diff,
                    format!("favorite {}: {value}", what.to_ascii_lowercase()),
                    FactCategory::Preference,
                );
            }
        }
    }
}

/// Each word with the phrases made of it, `forms` of (before, after) it, searchers built once.
fn phrases_of<const N: usize>(
    words: impl Iterator<Item = &'static String>,
    forms: [(&str, &str); N],
) -> Vec<(&'static str, [Phrase; N])> {
    words
        .map(|word| {
            let phrases =
                forms.map(|(before, after)| Phrase::new(format!("{before}{word}{after}")));
            (word.as_str(), phrases)
        })
        .collect()
}

/// Each relation word with the phrases that name one, in the order tried.
static RELATION_PHRASES: LazyLock<Vec<(&str, [Phrase; 4])>> = LazyLock::new(|| {
    let words = &patterns().words;
    let relations = words
        .single_relations
        .iter()
        .chain(words.multi_relations.iter());
    let forms = [
        ("my ", " is named "),
        ("my ", " is called "),
        ("my ", "'s name is "),
        ("my ", " "),
    ];
    phrases_of(relations, forms)
});

/// Each diet with the phrases that state it, in the order tried.
static DIET_PHRASES: LazyLock<Vec<(&str, [Phrase; 6])>> = LazyLock::new(|| {
    let forms = [
        ("i'm ", ""),
        ("i am ", ""),
        ("i'm a ", ""),
        ("i am a ", ""),
        ("i eat ", ""),
        ("i keep ", ""),
    ];
    phrases_of(patterns().words.diets.iter(), forms)
});

/// Each scheduled thing with the phrases that say when it is, in the order tried.
static SCHEDULED_PHRASES: LazyLock<Vec<(&str, [Phrase; 4])>> = LazyLock::new(|| {
    let forms = [
        ("my ", " is on "),
        ("my ", " is at "),
        ("my ", " is in "),
        ("my ", " is "),
    ];
    phrases_of(patterns().words.scheduled.iter(), forms)
});

/// Each event verb with the phrases that say it happened, in the order tried.
static EVENT_PHRASES: LazyLock<Vec<(&str, [Phrase; 3])>> = LazyLock::new(|| {
    let forms = [("i ", " "), ("we ", " "), ("i just ", " ")];
    phrases_of(patterns().words.event_verbs.iter(), forms)
});

fn relation_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    for (relation, naming) in RELATION_PHRASES.iter() {
        let Some(rest) = after_any(sentence, lower, naming) else {
            continue;
        };
        let name = name_words(rest, true);
        if name.is_empty() {
            continue;
        }
        if p.words.single_relations.has(relation) {
            update(diff, format!("{relation}: {name}"), FactCategory::Relation);
        } else {
            add(
                diff,
                format!("has a {relation} named {name}"),
                FactCategory::Relation,
            );
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.has_named) {
        let rest_lower = rest.to_ascii_lowercase();
        if let Some(split) = rest_lower
            .find(" named ")
            .or_else(|| rest_lower.find(" called "))
        {
            let what = &rest[..split];
            let name = name_words(&rest[split + 7..], true);
            if !name.is_empty() && word_count(what) <= 3 {
                add(
                    diff,
                    format!("has a {} named {name}", what.trim()),
                    FactCategory::Relation,
                );
            }
        }
    }
    if let Some(rest) = after_any(sentence, lower, &p.triggers.has_count) {
        let mut words = rest.split_whitespace();
        if let (Some(count), Some(what)) = (words.next(), words.next()) {
            let what = what
                .trim_end_matches(|c: char| !c.is_alphanumeric())
                .to_ascii_lowercase();
            if p.words.counts.has(&count.to_ascii_lowercase()) && p.words.counted.has(&what) {
                update(
                    diff,
                    format!("number of {what}: {count}"),
                    FactCategory::Relation,
                );
            }
        }
    }
}

fn possession_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    let Some(rest) = after_any(sentence, lower, &p.triggers.owns) else {
        return;
    };
    let object = phrase(rest, 5, &p.words.boundary);
    let first = object
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_ascii_lowercase();
    let rest_lower = rest.to_ascii_lowercase();
    // "I have a dog named Rex" is a relation; "I have a question" is not a possession.
    if object.is_empty()
        || p.words.not_possessions.has(&first)
        || rest_lower.contains(" named ")
        || rest_lower.contains(" called ")
        || object.to_ascii_lowercase().ends_with("allergy")
    {
        return;
    }
    add(diff, format!("owns a {object}"), FactCategory::Possession);
}

fn plan_and_event_patterns(sentence: &str, lower: &str, diff: &mut FactDiff) {
    let p = patterns();
    if let Some(rest) = after_any(sentence, lower, &p.triggers.plans) {
        let plan = phrase(rest, 10, &p.words.plan_boundary);
        let first = plan
            .split_whitespace()
            .next()
            .unwrap_or("")
            .to_ascii_lowercase();
        if word_count(&plan) >= 2 && !p.words.not_plans.has(&first) {
            add(diff, format!("plans to {plan}"), FactCategory::Plan);
        }
    }
    for (thing, timed) in SCHEDULED_PHRASES.iter() {
        let Some(rest) = after_any(sentence, lower, timed) else {
            continue;
        };
        let when = phrase(rest, 5, &p.words.plan_boundary);
        if !when.is_empty() {
            update(diff, format!("{thing}: {when}"), FactCategory::Plan);
        }
    }
    for (verb, happened) in EVENT_PHRASES.iter() {
        let Some(rest) = after_any(sentence, lower, happened) else {
            continue;
        };
        let object = phrase(rest, 8, &p.words.boundary);
        if word_count(&object) >= 1 {
            add(diff, format!("{verb} {object}"), FactCategory::General);
        }
        break;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extract(user: &str) -> Extraction {
        HeuristicExtractor.extract(&ExchangeView {
            user,
            assistant: "Noted.",
            depth: Depth::Short,
        })
    }

    fn texts(edits: &[FactEdit]) -> Vec<&str> {
        edits.iter().map(|edit| edit.text.as_str()).collect()
    }

    #[test]
    fn identity_facts() {
        let got = extract("Hi! My name is Maria Lopez and I'm 34 years old. I live in Lyon.");
        assert_eq!(
            texts(&got.diff.update),
            ["name: Maria Lopez", "age: 34", "lives in: Lyon"]
        );
        let got = extract("I work at Acme Robotics as a welder. I'm a software engineer.");
        assert_eq!(
            texts(&got.diff.update),
            ["works at: Acme Robotics", "job: software engineer"]
        );
        let got = extract("I'm a bit tired today.");
        assert!(got.diff.is_empty(), "{got:?}");
    }

    #[test]
    fn moving_updates_the_place() {
        let got = extract("I moved from Paris to Berlin last spring.");
        assert_eq!(texts(&got.diff.update), ["lives in: Berlin"]);
        let got = extract("I don't live in Paris anymore, I moved from Paris.");
        assert_eq!(texts(&got.diff.remove), ["lives in: Paris"]);
    }

    #[test]
    fn allergies_and_rules_are_hard_constraints() {
        let got = extract("Just so you know, I'm allergic to peanuts and shellfish.");
        assert_eq!(
            texts(&got.diff.add),
            ["allergic to peanuts", "allergic to shellfish"]
        );
        assert!(
            got.diff
                .add
                .iter()
                .all(|edit| edit.category == Some(FactCategory::HardConstraint))
        );
        let got = extract("My son is allergic to eggs.");
        assert_eq!(texts(&got.diff.add), ["my son is allergic to eggs"]);
        let got = extract("I have a severe peanut allergy.");
        assert_eq!(texts(&got.diff.add), ["allergic to peanut"]);
        let got = extract("Never book me on a red-eye flight. I'm vegetarian.");
        assert_eq!(texts(&got.diff.add), ["Never book me on a red-eye flight"]);
        assert_eq!(texts(&got.diff.update), ["diet: vegetarian"]);
        let got = extract("Always answer in French. Never feed the cat after midnight.");
        assert_eq!(
            texts(&got.diff.add),
            [
                "Always answer in French",
                "Never feed the cat after midnight"
            ]
        );
        // A statement with its subject left out is no rule for the assistant.
        for statement in [
            "Never had a chance to visit it.",
            "Always been interested in other cultures.",
            "Always here to help!",
            "Never saw this coming.",
            "Never imagined it would happen.",
        ] {
            let got = extract(statement);
            assert!(
                got.diff
                    .add
                    .iter()
                    .all(|edit| edit.category != Some(FactCategory::HardConstraint)),
                "{statement}: {:?}",
                texts(&got.diff.add)
            );
        }
        let got = extract("Please don't suggest pork dishes.");
        assert_eq!(texts(&got.diff.add), ["do not suggest pork dishes"]);
        let got = extract("Good news: I'm no longer allergic to peanuts!");
        assert_eq!(texts(&got.diff.remove), ["allergic to peanuts"]);
    }

    #[test]
    fn explicit_remember_requests() {
        let got = extract("Please remember that my locker code is 4512.");
        assert_eq!(texts(&got.diff.add), ["my locker code is 4512"]);
        assert_eq!(got.diff.add[0].category, Some(FactCategory::Explicit));
    }

    #[test]
    fn preferences_relations_possessions() {
        let got = extract("I love hiking in the Alps. My favorite band is Radiohead.");
        assert_eq!(texts(&got.diff.add), ["likes hiking in the Alps"]);
        assert_eq!(texts(&got.diff.remove), ["dislikes hiking in the Alps"]);
        assert_eq!(texts(&got.diff.update), ["favorite band: Radiohead"]);
        let got = extract("My wife Anna and I have a dog named Rex.");
        assert_eq!(texts(&got.diff.update), ["wife: Anna"]);
        assert_eq!(texts(&got.diff.add), ["has a dog named Rex"]);
        let got = extract("I just bought a red Tesla. I have a question though.");
        assert_eq!(texts(&got.diff.add), ["owns a red Tesla"]);
    }

    #[test]
    fn plans_dates_and_events() {
        let got = extract("I'm planning to visit Japan next April with my sister.");
        assert_eq!(
            texts(&got.diff.add),
            ["plans to visit Japan next April with my sister"]
        );
        let got = extract("My interview is on Friday at 10am.");
        assert_eq!(texts(&got.diff.update), ["interview: Friday at 10am"]);
        let got = extract("Yesterday I went to a LGBTQ support group, it was powerful.");
        assert_eq!(texts(&got.diff.add), ["went to a LGBTQ support group"]);
        let got = extract("The deadline for the grant is March 3.");
        assert_eq!(texts(&got.diff.update), ["deadline for grant: March 3"]);
    }

    #[test]
    fn small_talk_yields_no_facts() {
        for text in [
            "How are you today?",
            "Can you explain how a hash map works?",
            "I'm going to be honest, that was confusing.",
            "I like it.",
            "Call me tomorrow if you can.",
        ] {
            let got = extract(text);
            assert!(got.diff.is_empty(), "{text}: {:?}", got.diff);
        }
    }

    #[test]
    fn summaries_respect_word_limits() {
        let long_user = "Hi there! I have been trying to get my sourdough starter to rise for \
            two weeks and it smells like acetone every morning, even after feeding it twice a \
            day with rye flour. What am I doing wrong? Also the kitchen is cold.";
        let got = HeuristicExtractor.extract(&ExchangeView {
            user: long_user,
            assistant: &"The starter is hungry. ".repeat(20),
            depth: Depth::Medium,
        });
        assert!(
            word_count(&got.user_summary) <= USER_SUMMARY_WORDS,
            "{}",
            got.user_summary
        );
        assert!(word_count(&got.assistant_summary) <= ASSISTANT_SUMMARY_WORDS);
        assert!(
            got.user_summary.contains("sourdough"),
            "{}",
            got.user_summary
        );
        assert!(!got.user_summary.starts_with("Hi"), "{}", got.user_summary);
        let short = summarise("What is BM25? Thanks!", USER_SUMMARY_WORDS);
        assert_eq!(short, "What is BM25?");
    }

    #[test]
    fn question_is_kept_in_summary() {
        let got = summarise(
            "I run a small bakery. We sell bread. Which oven should I buy for baguettes?",
            USER_SUMMARY_WORDS,
        );
        assert!(got.contains("Which oven"), "{got}");
    }
}
