//! The update path: record one exchange (raw log, artifacts, turn log, base-truth diff, tiers),
//! consolidate, and the small management edits (identity, pins). Pure: the caller passes the
//! exchange, its time and id, and persists the state afterwards.

use std::borrow::Cow;

use serde::{Deserialize, Serialize};

use super::depth::{FoundArtifact, classify, find_artifacts};
use super::diff::{DiffReport, apply_diff, retain_grounded};
use super::extract::{ASSISTANT_SUMMARY_WORDS, ExchangeView, Extractor, USER_SUMMARY_WORDS};
use super::tiers::{TierReport, maintain, refresh_episode_facts, rehydrate, touch_related};
use crate::chain::link;
use crate::config::MemoryConfig;
use crate::fence::memory_text;
use crate::model::{
    Artifact, ArtifactId, ArtifactKind, Depth, ExchangeInput, FactCategory, FactId, Identity,
    ItemRef, MemoryState, PinId, PinnedItem, RawTurn, RevisionEnd, SESSION_TAIL, SessionState,
    SummaryText, TierState, TurnLogEntry, TurnSeq,
};
use crate::render::{
    counted_artifact, recount_fact, recount_identity, recount_pinned, recount_raw_turn,
    recount_summary,
};
use crate::text::{TermSet, clip_words, excerpt, normalise, terms, word_count};

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RecordOutcome {
    /// The new turn's sequence number; None when the turn id was already recorded.
    pub turn: Option<TurnSeq>,
    pub duplicate: bool,
    pub depth: Option<Depth>,
    pub diff: DiffReport,
    /// Diff entries dropped because the exchange does not support them.
    pub ungrounded: Vec<String>,
    pub artifacts: Vec<ArtifactId>,
    pub tiers: TierReport,
    pub consolidation: Option<ConsolidationReport>,
}

/// Appends the exchange to the raw log and updates every memory layer from it.
pub fn record_exchange(
    state: &mut MemoryState,
    exchange: &ExchangeInput,
    extractor: &dyn Extractor,
    config: &MemoryConfig,
) -> RecordOutcome {
    state.sync_lookups();
    if state.lookups.turn(state, &exchange.turn_id).is_some() {
        return RecordOutcome {
            duplicate: true,
            ..RecordOutcome::default()
        };
    }
    // Memory is never re-extracted from its own echo, and forged fences stay inert. A very long
    // message enters memory as an excerpt (the raw log keeps it whole).
    let kept = |text: &str| {
        let text = memory_text(text).into_owned();
        match excerpt(&text, config.depth.max_message_bytes) {
            Cow::Owned(cut) => cut,
            Cow::Borrowed(_) => text,
        }
    };
    let user = kept(&exchange.user_text);
    let assistant = kept(&exchange.assistant_text);

    let session = match state.session_index(&exchange.session_id) {
        Some(index) => index,
        None => {
            state.sessions.push(SessionState {
                id: exchange.session_id.clone(),
                last_chain: crate::chain::CHAIN_ORIGIN,
                recent: Vec::new(),
            });
            u32::try_from(state.sessions.len() - 1).unwrap_or(u32::MAX)
        }
    };
    let prior = exchange.prior_chain.unwrap_or_else(|| {
        state
            .sessions
            .get(session as usize)
            .map_or(crate::chain::CHAIN_ORIGIN, |session| session.last_chain)
    });
    let chain = link(prior, &exchange.user_text, &exchange.assistant_text);
    if let Some(slot) = state.sessions.get_mut(session as usize) {
        slot.last_chain = chain;
    }

    let depth = classify(&user, &assistant, &config.depth);
    let seq = TurnSeq::try_from(state.raw_turns.len()).unwrap_or(TurnSeq::MAX);
    let mut raw = RawTurn {
        id: exchange.turn_id.as_str().into(),
        session,
        user: user.as_str().into(),
        assistant: assistant.as_str().into(),
        event_time: exchange.event_time.as_deref().map(Box::from),
        chain,
        pair: crate::chain::pair(&exchange.user_text, &exchange.assistant_text),
        depth,
        incomplete: exchange.incomplete,
        tokens: Default::default(),
    };
    recount_raw_turn(&mut raw);
    state.raw_turns.push(raw);
    if let Some(slot) = state.sessions.get_mut(session as usize) {
        slot.recent.push(seq);
        if slot.recent.len() > SESSION_TAIL {
            slot.recent.remove(0);
        }
    }

    let mut extraction = extractor.extract(&ExchangeView {
        user: &user,
        assistant: &assistant,
        depth,
    });
    let ungrounded = if config.ground_diffs {
        retain_grounded(&mut extraction.diff, &format!("{user}\n{assistant}"))
    } else {
        Vec::new()
    };
    let diff = apply_diff(state, &extraction.diff, Some(seq));

    let mut artifacts = Vec::new();
    for found in find_artifacts(&user, &assistant, &config.depth) {
        let id = ArtifactId::try_from(state.artifacts.len()).unwrap_or(ArtifactId::MAX);
        let (kind, language, content, side) = match found {
            FoundArtifact::Code { language, content } => {
                (ArtifactKind::Code, language, content, None)
            }
            FoundArtifact::Draft(side) => (ArtifactKind::Draft, None, String::new(), Some(side)),
        };
        let mut artifact = Artifact {
            id,
            turn: seq,
            kind,
            language,
            content,
            side,
            tokens: Default::default(),
            reference_tokens: Default::default(),
            erased: false,
        };
        (artifact.tokens, artifact.reference_tokens) = counted_artifact(
            &artifact,
            state.artifact_content(&artifact),
            exchange.event_time.as_deref(),
        );
        state.artifacts.push(artifact);
        artifacts.push(id);
    }

    let user_summary = bounded_summary(&extraction.user_summary, USER_SUMMARY_WORDS, "");
    let assistant_summary = bounded_summary(
        &extraction.assistant_summary,
        ASSISTANT_SUMMARY_WORDS,
        &artifact_note(&artifacts),
    );
    let mut entry = TurnLogEntry {
        turn: seq,
        user_summary: SummaryText::of(user_summary, &user),
        assistant_summary: SummaryText::of(assistant_summary, &assistant),
        facts: diff.added.iter().chain(&diff.updated).copied().collect(),
        artifacts: artifacts.as_slice().into(),
        tier: TierState::fresh(seq),
        episode: None,
        tokens: Default::default(),
        erased: false,
    };
    recount_summary(&mut entry, state.raw_turns.last());
    state.turn_log.push(entry);

    let mut tiers = TierReport::default();
    let user_terms: TermSet = terms(&user).collect();
    tiers.touched = touch_related(state, &user_terms, seq);
    tiers.rehydrated = rehydrate(state, &user_terms, seq, config);
    maintain(state, config, &mut tiers);

    let consolidation = (config.consolidate_every_turns > 0
        && (seq + 1) % config.consolidate_every_turns == 0)
        .then(|| consolidate(state));

    state.version += 1;
    RecordOutcome {
        turn: Some(seq),
        duplicate: false,
        depth: Some(depth),
        diff,
        ungrounded,
        artifacts,
        tiers,
        consolidation,
    }
}

fn artifact_note(artifacts: &[ArtifactId]) -> String {
    match artifacts {
        [] => String::new(),
        [one] => format!("[artifact {one}]"),
        many => format!(
            "[artifacts {}]",
            many.iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Holds any summary (an LLM's too) to its word limit, keeping room for the artifact note.
fn bounded_summary(summary: &str, max_words: usize, note: &str) -> String {
    let room = max_words.saturating_sub(word_count(note));
    let mut text = if word_count(summary) > room {
        clip_words(summary, room.saturating_sub(1))
    } else {
        crate::text::one_line(summary)
    };
    if !note.is_empty() {
        if !text.is_empty() {
            text.push(' ');
        }
        text.push_str(note);
    }
    text
}

#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ConsolidationReport {
    /// `(merged, into)` pairs.
    pub merged_facts: Vec<(FactId, FactId)>,
    pub refreshed_episodes: usize,
}

/// Sleep-time consolidation (seeds 001, 002): merges active facts that say the same thing
/// (equal stemmed key and value terms) into the oldest one, and rebuilds the manifests whose
/// facts changed.
pub fn consolidate(state: &mut MemoryState) -> ConsolidationReport {
    let mut report = ConsolidationReport::default();
    // The groups that formed since the last consolidation (every earlier one was merged then),
    // so the cost is that of the facts changed since, not of the whole base truth.
    let mut merges: Vec<(FactId, FactId)> = state
        .take_fact_collisions()
        .iter()
        .flat_map(|group| {
            let keeper = group[0];
            group[1..].iter().map(move |merged| (*merged, keeper))
        })
        .collect();
    merges.sort_unstable();
    for (merged, into) in merges {
        let Some(source) = state.facts.get(merged as usize).cloned() else {
            continue;
        };
        if let Some(keeper) = state.facts.get_mut(into as usize) {
            for seq in &source.provenance {
                if !keeper.provenance.contains(seq) {
                    keeper.provenance.push(*seq);
                }
            }
            keeper.provenance.sort_unstable();
            if keeper.provenance.len() > super::diff::MAX_PROVENANCE {
                let extra = keeper.provenance.len() - super::diff::MAX_PROVENANCE;
                keeper.provenance.drain(1..=extra);
            }
            keeper.tier.frequency += source.tier.frequency;
            keeper.tier.last_touched_turn = keeper
                .tier
                .last_touched_turn
                .max(source.tier.last_touched_turn);
            keeper.importance = keeper.importance.max(source.importance);
            if source.is_hard_constraint() {
                keeper.category = FactCategory::HardConstraint;
            }
            recount_fact(keeper);
        }
        if let Some(fact) = state.facts.get_mut(merged as usize) {
            let revision = crate::model::FactRevision {
                value: fact.value.clone(),
                version: fact.version,
                provenance: fact.provenance.clone(),
                date: fact.date.clone(),
                ended_by: RevisionEnd::MergedInto(into),
                ended_at_turn: None,
                key: None,
            };
            super::diff::push_revision(&mut fact.history, revision);
            fact.active = false;
            fact.version += 1;
        }
        report.merged_facts.push((merged, into));
    }
    // Manifests list the facts of their turns: bring those lists up to date where facts
    // changed since the last consolidation.
    let ids = state.take_stale_episodes();
    for id in &ids {
        refresh_episode_facts(state, *id);
    }
    report.refreshed_episodes = ids.len();
    if !report.merged_facts.is_empty() {
        state.facts_version += 1;
    }
    state.episodes_version += 1;
    state.version += 1;
    report
}

/// Sets (or clears, with an empty text) the user's identity (L0).
pub fn set_identity(state: &mut MemoryState, text: &str) {
    let text = memory_text(text).trim().to_string();
    state.identity = if text.is_empty() {
        None
    } else {
        let mut identity = Identity {
            text,
            tokens: Default::default(),
        };
        recount_identity(&mut identity);
        Some(identity)
    };
    state.version += 1;
}

/// Pins a text of its own.
pub fn pin(state: &mut MemoryState, text: &str) -> PinId {
    let text = memory_text(text).trim().to_string();
    push_pin(state, text, None)
}

/// Pins an active fact: the pin shows the fact's current revision, whatever the conversation
/// or an edit later makes of it, and keeps no copy of the text.
pub fn pin_fact(state: &mut MemoryState, fact: FactId) -> Option<PinId> {
    state.fact(fact).filter(|fact| fact.active)?;
    Some(push_pin(state, String::new(), Some(ItemRef::Fact(fact))))
}

/// Adds an active pin. A text's line is counted here; a pin of a fact is charged its fact's.
fn push_pin(state: &mut MemoryState, text: String, source: Option<ItemRef>) -> PinId {
    let id = PinId::try_from(state.pinned.len()).unwrap_or(PinId::MAX);
    let mut item = PinnedItem {
        id,
        text,
        source,
        active: true,
        tokens: Default::default(),
    };
    if source.is_none() {
        recount_pinned(&mut item);
    }
    state.pinned.push(item);
    state.version += 1;
    id
}

pub fn unpin(state: &mut MemoryState, id: PinId) -> bool {
    match state.pinned.get_mut(id as usize) {
        Some(item) if item.active => {
            item.active = false;
            state.version += 1;
            true
        }
        _ => false,
    }
}

/// Whether two fact keys name the same slot (exposed for the management API's edits).
pub fn same_key(a: &str, b: &str) -> bool {
    normalise(a) == normalise(b)
}

/// For other modules' tests: a state built by recording turns the way the worker does.
#[cfg(test)]
pub(crate) mod test_support {
    use super::{ExchangeInput, MemoryState, record_exchange};
    use crate::config::MemoryConfig;
    use crate::extract::HeuristicExtractor;

    /// Records `turns` (user, assistant) in order with the heuristic extractor and the default
    /// config; turn `n` is `t{n}`, in session `session(n)`, at `event_time(n)`.
    pub fn recorded_with(
        turns: &[(&str, &str)],
        session: impl Fn(usize) -> String,
        event_time: impl Fn(usize) -> Option<String>,
    ) -> MemoryState {
        let mut state = MemoryState::new();
        for (n, (user, assistant)) in turns.iter().enumerate() {
            record_turn(&mut state, (user, assistant), session(n), event_time(n));
        }
        state
    }

    /// Records one more turn as [`recorded_with`] does: the `n`-th turn of the log is `t{n}`.
    pub fn record_turn(
        state: &mut MemoryState,
        (user, assistant): (&str, &str),
        session: String,
        event_time: Option<String>,
    ) {
        let exchange = ExchangeInput {
            session_id: session,
            turn_id: format!("t{}", state.raw_turns.len()),
            user_text: user.to_string(),
            assistant_text: assistant.to_string(),
            event_time,
            prior_chain: None,
            incomplete: false,
            arrival: None,
        };
        record_exchange(
            state,
            &exchange,
            &HeuristicExtractor,
            &MemoryConfig::default(),
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::extract::HeuristicExtractor;
    use crate::model::Tier;

    fn exchange(n: usize, user: &str, assistant: &str) -> ExchangeInput {
        ExchangeInput {
            session_id: "s1".into(),
            turn_id: format!("turn-{n}"),
            user_text: user.into(),
            assistant_text: assistant.into(),
            event_time: Some(format!("2024-05-{:02}T09:00:00Z", (n % 28) + 1)),
            prior_chain: None,
            incomplete: false,
            arrival: None,
        }
    }

    /// Conversations that keep coming back to earlier topics rehydrate episodes, whose turns
    /// are then demoted into them again; their manifests must stay what a rebuild from their
    /// turns gives (debug builds also check each returning turn's episode as it happens).
    #[test]
    fn manifests_stay_as_rebuilt_when_rehydrated_turns_return() {
        let topics = [
            (
                "my sourdough starter from Lyon smells of acetone",
                "feed it rye flour twice daily",
            ),
            (
                "the pottery wheel in Porto keeps wobbling",
                "level the wheel head and recentre clay",
            ),
            (
                "winter tyres for the Volvo before the Alps trip",
                "fit studless tyres by November",
            ),
            (
                "marathon training in Leeds, my knee aches",
                "rest two days and ice the knee",
            ),
            (
                "learning Portuguese verbs for the Lisbon move",
                "practise the preterite daily",
            ),
        ];
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let mut rehydrated = 0;
        for n in 0..600 {
            // Runs of five turns per topic, the topics taken in turn: each run returns to a
            // topic last seen four runs before.
            let (user, assistant) = topics[(n / 5) % topics.len()];
            let outcome = record_exchange(
                &mut state,
                &exchange(
                    n,
                    &format!("{user}, question {n} about it"),
                    &format!("{assistant}; answer {n}"),
                ),
                &HeuristicExtractor,
                &config,
            );
            rehydrated += outcome.tiers.rehydrated.len();
        }
        assert!(rehydrated > 0, "no episode was rehydrated");
        state.sync_lookups();
        let live: Vec<_> = state
            .episodes
            .iter()
            .filter(|e| !e.erased)
            .cloned()
            .collect();
        assert!(live.len() > 1);
        for episode in live {
            let mut rebuilt = crate::manifest::build_manifest(
                &state,
                episode.id,
                episode.session,
                &episode.links,
                episode.rehydrated_at.clone(),
            );
            // Fact lists may wait for the next consolidation; the rest may not.
            rebuilt.facts.clone_from(&episode.facts);
            assert_eq!(*episode, rebuilt, "episode {}", episode.id);
        }
    }

    /// The terms the lookups keep for working-set items are those of the items' texts as they
    /// are now: after a fact's value changes, after a turn touches them, after a raw turn
    /// changes under its summary.
    #[test]
    fn kept_item_terms_follow_their_items_texts() {
        use crate::lookups::term_hash;
        use crate::model::ItemRef;
        use crate::text::distinct_terms;

        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        record_exchange(
            &mut state,
            &exchange(
                0,
                "Hi, I'm allergic to peanuts. Any snack ideas?",
                "Try apple slices.",
            ),
            &HeuristicExtractor,
            &config,
        );
        let hashes = |text: &str| -> Vec<u64> {
            distinct_terms(text)
                .iter()
                .map(|term| term_hash(term))
                .collect()
        };
        let fact_id = state.active_facts().next().unwrap().id;
        let summary_text = |state: &MemoryState| {
            let (user, assistant) = state.summary_texts(0);
            format!("{user} {assistant}")
        };
        let kept = |state: &mut MemoryState, item| state.item_terms(item).unwrap().to_vec();
        assert_eq!(
            kept(&mut state, ItemRef::Fact(fact_id)),
            hashes("allergic to peanuts")
        );
        let summary = summary_text(&state);
        assert_eq!(kept(&mut state, ItemRef::Summary(0)), hashes(&summary));

        // A fact's value changes in place: its kept terms are not used again.
        state.facts.get_mut(fact_id as usize).unwrap().value = "shellfish and walnuts".into();
        let text = state.fact(fact_id).unwrap().text();
        assert_eq!(kept(&mut state, ItemRef::Fact(fact_id)), hashes(&text));

        // A later turn on the same topic touches both; their terms stay the texts' own.
        for n in 1..4 {
            record_exchange(
                &mut state,
                &exchange(n, "More snack ideas without peanuts, please", "Rice cakes."),
                &HeuristicExtractor,
                &config,
            );
        }
        let text = state.fact(fact_id).unwrap().text();
        assert_eq!(kept(&mut state, ItemRef::Fact(fact_id)), hashes(&text));
        assert_eq!(kept(&mut state, ItemRef::Summary(0)), hashes(&summary));
        assert!(state.item_terms(ItemRef::RawTurn(0)).is_none());
        assert!(state.item_terms(ItemRef::Summary(99)).is_none());

        // Out of the working set the entry stays (rehydration brings items back), and its
        // raw turn changing drops it.
        state.turn_log.get_mut(0).unwrap().tier.tier = Tier::Old;
        state.sync_lookups();
        assert!(state.lookups.keeps_terms_of(ItemRef::Summary(0)));
        state.raw_turns.get_mut(0).unwrap().user = "something else entirely".into();
        state.sync_lookups();
        assert!(!state.lookups.keeps_terms_of(ItemRef::Summary(0)));
        assert!(state.lookups.keeps_terms_of(ItemRef::Fact(fact_id)));
    }

    #[test]
    fn records_raw_turn_summary_and_facts() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let outcome = record_exchange(
            &mut state,
            &exchange(
                0,
                "Hi, I'm allergic to peanuts. Can you suggest a snack?",
                "Try apple slices.",
            ),
            &HeuristicExtractor,
            &config,
        );
        assert_eq!(outcome.turn, Some(0));
        assert_eq!(outcome.depth, Some(Depth::Short));
        assert_eq!(state.raw_turns.len(), 1);
        assert_eq!(state.turn_log.len(), 1);
        let fact = state.active_facts().next().unwrap();
        assert_eq!(fact.text(), "allergic to peanuts");
        assert!(fact.is_hard_constraint());
        assert_eq!(fact.provenance, [0]);
        assert_eq!(fact.date.as_deref(), Some("2024-05-01"));
        assert_eq!(*state.turn_log[0].facts, [fact.id]);
        assert!(state.version > 0);
    }

    #[test]
    fn a_very_long_message_enters_memory_as_an_excerpt_of_both_ends() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let limit = config.depth.max_message_bytes;
        let middle = "The report covers quarterly figures in detail. ".repeat(20_000);
        let user =
            format!("I'm allergic to peanuts. {middle}Please summarise the lighthouse memo.");
        let input = exchange(0, &user, "Done.");
        record_exchange(&mut state, &input, &HeuristicExtractor, &config);
        let raw = &state.raw_turns[0];
        assert!(raw.user.len() < limit + 64, "{}", raw.user.len());
        assert!(raw.user.starts_with("I'm allergic to peanuts."));
        assert!(raw.user.ends_with("Please summarise the lighthouse memo."));
        assert!(raw.user.contains("bytes left out"));
        // Extraction still saw the statement at the head.
        assert!(
            state
                .facts
                .iter()
                .any(|fact| fact.text().contains("peanuts")),
            "{:?}",
            state.facts
        );
        // The history chain is of the message as sent, so a client resending it is recognised.
        assert_eq!(
            state.sessions[0].last_chain,
            link(crate::chain::CHAIN_ORIGIN, &user, "Done.")
        );
        // A message within the limit is kept as it is.
        let short = exchange(1, "I live in Oslo.", "Nice.");
        record_exchange(&mut state, &short, &HeuristicExtractor, &config);
        assert_eq!(&*state.raw_turns[1].user, "I live in Oslo.");
    }

    #[test]
    fn same_turn_id_is_recorded_once() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let input = exchange(0, "I live in Oslo.", "Nice.");
        record_exchange(&mut state, &input, &HeuristicExtractor, &config);
        let once = state.clone();
        let outcome = record_exchange(&mut state, &input, &HeuristicExtractor, &config);
        assert!(outcome.duplicate);
        assert_eq!(state, once);
    }

    #[test]
    fn code_is_kept_whole_as_an_artifact() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let code = "```python\ndef add(a, b):\n    return a + b\n```";
        let outcome = record_exchange(
            &mut state,
            &exchange(0, "Write an add function", &format!("Here it is:\n{code}")),
            &HeuristicExtractor,
            &config,
        );
        assert_eq!(outcome.depth, Some(Depth::Code));
        assert_eq!(outcome.artifacts, [0]);
        assert_eq!(
            state.artifacts[0].content,
            "def add(a, b):\n    return a + b"
        );
        assert_eq!(state.artifacts[0].language.as_deref(), Some("python"));
        let (_, assistant_summary) = state.summary_texts(0);
        assert!(assistant_summary.ends_with("[artifact 0]"));
    }

    /// A long pasted message is its raw turn's text and its draft's: the state holds it once,
    /// and the draft reads it from the raw turn.
    #[test]
    fn a_long_draft_is_stored_once_and_read_from_its_raw_turn() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let pasted = "The quarterly report covers the northern lighthouse budget. ".repeat(60);
        record_exchange(
            &mut state,
            &exchange(0, &format!("  {pasted}  "), "Noted."),
            &HeuristicExtractor,
            &config,
        );
        let artifact = &state.artifacts[0];
        assert_eq!(
            (artifact.kind, artifact.side, artifact.content.as_str()),
            (ArtifactKind::Draft, Some(crate::model::Side::User), "")
        );
        assert_eq!(state.artifact_content(artifact), pasted.trim());
        let event_time = state.raw_turns[0].event_time.as_deref();
        let (full, reference) = counted_artifact(artifact, pasted.trim(), event_time);
        assert_eq!(
            (artifact.tokens, artifact.reference_tokens),
            (full, reference)
        );
        assert!(full.get(crate::tokens::Encoding::O200k) > 500);
        let json = serde_json::to_string(&state).unwrap();
        assert_eq!(json.matches("northern lighthouse budget").count(), 60);

        // A draft stored with its own copy (before `side`) still reads as before.
        let older: Artifact = serde_json::from_str(
            r#"{"id":0,"turn":0,"kind":"draft","content":"Dear team,","tokens":[1,1],"reference_tokens":[1,1]}"#,
        )
        .unwrap();
        assert_eq!(state.artifact_content(&older), "Dear team,");
    }

    #[test]
    fn echoed_fences_are_not_extracted() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let user = "<engram-memory kind=\"recall\">\n- allergic to cats\n</engram-memory>\n\nI live in Rome.";
        record_exchange(
            &mut state,
            &exchange(0, user, "ok"),
            &HeuristicExtractor,
            &config,
        );
        let facts: Vec<String> = state.active_facts().map(|fact| fact.text()).collect();
        assert_eq!(facts, ["lives in: Rome"]);
        assert_eq!(&*state.raw_turns[0].user, "I live in Rome.");
    }

    #[test]
    fn new_items_age_into_current_then_old() {
        let mut state = MemoryState::new();
        let config = MemoryConfig {
            working_set_tokens: 60,
            ..MemoryConfig::default()
        };
        for n in 0..30 {
            record_exchange(
                &mut state,
                &exchange(n, &format!("Let's discuss topic{n} now"), "An answer."),
                &HeuristicExtractor,
                &config,
            );
        }
        let tiers: Vec<Tier> = state.turn_log.iter().map(|entry| entry.tier.tier).collect();
        assert_eq!(tiers[29], Tier::New);
        assert_eq!(tiers[0], Tier::Old);
        assert!(tiers.contains(&Tier::Current));
        // Demotion never deletes: every turn is still in the log and in an episode.
        assert_eq!(state.raw_turns.len(), 30);
        for entry in state
            .turn_log
            .iter()
            .filter(|entry| entry.tier.tier == Tier::Old)
        {
            let episode = entry.episode.expect("demoted turns belong to an episode");
            assert!(state.episodes[episode as usize].links.contains(&entry.turn));
        }
    }

    #[test]
    fn summaries_cut_from_the_raw_text_are_stored_as_spans() {
        let mut state = MemoryState::new();
        let config = MemoryConfig::default();
        let reply = "Bake at 230 degrees for forty minutes with steam.";
        record_exchange(
            &mut state,
            &exchange(0, "How  hot\nshould the oven be?", reply),
            &HeuristicExtractor,
            &config,
        );
        let entry = &state.turn_log[0];
        assert_eq!(entry.user_summary, SummaryText::Span([0, 27]));
        assert!(matches!(entry.assistant_summary, SummaryText::Span(_)));
        let (user, assistant) = state.summary_texts(0);
        assert_eq!(user, "How hot should the oven be?");
        assert_eq!(
            assistant,
            "Bake at 230 degrees for forty minutes with steam."
        );
        let json = serde_json::to_string(entry).unwrap();
        let back: TurnLogEntry = serde_json::from_str(&json).unwrap();
        assert_eq!(&back, entry);
    }

    #[test]
    fn consolidation_merges_equivalent_facts() {
        let mut state = MemoryState::new();
        apply_diff(
            &mut state,
            &crate::diff::FactDiff {
                add: vec!["allergic to peanuts".into(), "Allergic to peanut".into()],
                ..Default::default()
            },
            None,
        );
        assert_eq!(state.active_facts().count(), 2);
        let report = consolidate(&mut state);
        assert_eq!(report.merged_facts.len(), 1);
        assert_eq!(state.active_facts().count(), 1);
    }

    #[test]
    fn identity_and_pins() {
        let mut state = MemoryState::new();
        set_identity(&mut state, "I am Ana, a nurse in Porto.");
        assert!(state.identity.as_ref().unwrap().tokens.0 > 0);
        let id = pin(&mut state, "Always answer in Portuguese");
        assert!(state.pinned[id as usize].active);
        assert!(unpin(&mut state, id));
        assert!(!unpin(&mut state, id));
    }
}
