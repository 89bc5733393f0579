//! CURRENT: recall for the latest user message. Retrieval's hits are ranked, then each is
//! placed in the recall block in the fullest of its forms that fits (episode manifests wait for
//! `episodes`, in what recall leaves).

use std::collections::HashMap;

use rustc_hash::FxBuildHasher;

use super::block::{Line, Section, dated};
use super::explained::explained;
use super::{Fenced, Packing, Ranking};
use crate::config::MemoryConfig;
use crate::model::{ItemRef, MemoryState, TurnSeq};
use crate::prompt::explain::{Block, Form, Reason};
use crate::retrieve::Hit;
use crate::score::{fact_score, summary_score};
use crate::tokens::Encoding;

/// A summary or artifact hit is shown as its raw turn when the raw line costs at most this many
/// times the hit's own line: the raw text is what was said (around the artifact, too), and
/// short exchanges summarise to nearly the same length.
const RAW_FOR_HIT_COST: u32 = 2;

/// At most this many of the hits recall did not show are named in the explanation.
const LEFT_OUT_NAMED: usize = 16;

/// A retrieval hit that passed the cutoffs, and how it ranks for recall.
#[derive(Debug, Clone, Copy)]
pub(super) struct RankedHit {
    pub(super) item: ItemRef,
    pub(super) ranking: Ranking,
}

/// The group a hit's relevance is compared within for the relative cutoff: facts, turns (raw
/// or summarised), episodes, artifacts.
fn cutoff_kind(item: ItemRef) -> usize {
    match item {
        ItemRef::RawTurn(_) | ItemRef::Summary(_) => 1,
        ItemRef::Episode(_) => 2,
        ItemRef::Artifact(_) => 3,
        _ => 0,
    }
}

/// The [`pair`](crate::chain::pair) hash of the exchange a raw turn or its summary
/// shows, and the turn.
fn turn_pair(state: &MemoryState, item: ItemRef) -> Option<(u64, TurnSeq)> {
    let (ItemRef::RawTurn(seq) | ItemRef::Summary(seq)) = item else {
        return None;
    };
    state
        .raw_turns
        .get(seq as usize)
        .map(|turn| (turn.pair(), seq))
}

/// The hits worth showing, best first: relevant enough next to the best of their kind, not in
/// the prompt already, by relevance blended with tier score.
pub(super) fn rank_hits(
    packing: &Packing<'_>,
    config: &MemoryConfig,
    hits: &[Hit],
) -> Vec<RankedHit> {
    let state = packing.state;
    // Each segment is normalised on its own, so a hit is compared with the best of its kind: a
    // broad episode manifest scoring high must not cut every raw turn.
    let mut best = [0.0f32; 4];
    for hit in hits {
        let kind = &mut best[cutoff_kind(hit.item)];
        *kind = kind.max(hit.relevance);
    }
    // A turn whose exchange the prompt shows already as another turn, word for word, is not
    // shown again: one user's sessions that say the same things (an app replaying one script
    // per session) keep a copy each. (The same turn may still go from summary to raw line.)
    let mut shown_pairs: HashMap<u64, Vec<TurnSeq>, FxBuildHasher> = HashMap::default();
    for item in &packing.in_prompt {
        if let Some((pair, seq)) = turn_pair(state, *item) {
            shown_pairs.entry(pair).or_default().push(seq);
        }
    }
    let mut ranked: Vec<RankedHit> = hits
        .iter()
        .filter(|hit| {
            hit.relevance >= best[cutoff_kind(hit.item)] * config.retrieval.min_relative_score
                && !packing.in_prompt.contains(&hit.item)
                && !turn_pair(state, hit.item).is_some_and(|(pair, seq)| {
                    shown_pairs
                        .get(&pair)
                        .is_some_and(|shown| shown.iter().any(|other| *other != seq))
                })
        })
        .map(|hit| {
            let tier = item_tier_score(state, config, hit.item);
            RankedHit {
                item: hit.item,
                ranking: Ranking {
                    score: hit.relevance + config.retrieval.tier_score_blend * tier,
                    relevance: Some(hit.relevance),
                    reason: Reason::Retrieved { source: hit.source },
                },
            }
        })
        .collect();
    // Hits are of distinct items: a total order, so an unstable sort gives the same.
    ranked.sort_unstable_by(|a, b| {
        b.ranking
            .score
            .total_cmp(&a.ranking.score)
            .then(a.item.cmp(&b.item))
    });
    ranked
}

/// The tier score blended into a hit's ranking (facts and turns have one).
fn item_tier_score(state: &MemoryState, config: &MemoryConfig, item: ItemRef) -> f32 {
    match item {
        ItemRef::Fact(id) => fact_score(state, &config.weights, id as usize),
        ItemRef::Summary(seq) | ItemRef::RawTurn(seq) => state
            .turn_log
            .get(seq as usize)
            .map_or(0.0, |entry| summary_score(state, &config.weights, entry)),
        _ => 0.0,
    }
}

/// Places the ranked hits (episodes excepted) that the recall block does not show yet, each in
/// the first of its forms that fits the current stage.
pub(super) fn pack_recall(packing: &mut Packing<'_>, ranked: &[RankedHit]) {
    let state = packing.state;
    let encoding = packing.encoding;
    for hit in ranked {
        if matches!(hit.item, ItemRef::Episode(_)) || packing.recall.shows(state, hit.item) {
            continue;
        }
        for option in render_options(state, hit.item, encoding) {
            // A line costs at least its tokens, unless it takes its turn's summary's place: one
            // that cannot fit is skipped before it is dated and compared (once recall is full,
            // that is most hits).
            let replaces = |seq| packing.recall.contains(ItemRef::Summary(seq));
            if !packing.budget.fits(option.tokens)
                && !matches!(option.shown, ItemRef::RawTurn(seq) if replaces(seq))
            {
                continue;
            }
            let line = option.line(state, encoding);
            if packing.recall.contains(line.item) || packing.recall.overlaps(state, &line) {
                continue;
            }
            // A turn already shown as its summary (the recent context) is shown once: its raw
            // line takes the summary's place when the difference fits.
            if let ItemRef::RawTurn(seq) = line.item
                && packing.recall.contains(ItemRef::Summary(seq))
            {
                if replace_summary(packing, seq, line, option.tokens, hit.ranking) {
                    break;
                }
                continue;
            }
            if packing.place(Fenced::Recall, line, option.tokens, hit.ranking) {
                break;
            }
        }
    }
}

/// Shows `line`, turn `seq`'s raw line, in place of the turn's summary if what it costs more
/// fits, and explains it in the summary's place.
fn replace_summary<'a>(
    packing: &mut Packing<'a>,
    seq: TurnSeq,
    line: Line<'a>,
    tokens: u32,
    ranking: Ranking,
) -> bool {
    let summary = ItemRef::Summary(seq);
    if !packing
        .recall
        .replace(&mut packing.budget, summary, line, tokens)
    {
        return false;
    }
    let upgraded = explained(
        packing.state,
        line.item,
        line.form,
        Block::Recall,
        tokens,
        ranking,
    );
    match packing
        .explained
        .iter_mut()
        .find(|entry| entry.item == summary)
    {
        Some(entry) => *entry = upgraded,
        None => packing.explained.push(upgraded),
    }
    true
}

/// The ranked hits the recall block does not show, best first, for the explanation.
pub(super) fn left_out(packing: &Packing<'_>, ranked: &[RankedHit]) -> Vec<ItemRef> {
    ranked
        .iter()
        .map(|hit| hit.item)
        .filter(|item| !packing.recall.shows(packing.state, *item))
        .take(LEFT_OUT_NAMED)
        .collect()
}

/// One way to show a hit in the recall block.
#[derive(Debug, Clone, Copy)]
struct RenderOption {
    /// What the line shows: the hit itself, or the raw turn that holds it.
    shown: ItemRef,
    section: Section,
    order: u64,
    form: Form,
    tokens: u32,
}

impl RenderOption {
    fn line(self, state: &MemoryState, encoding: Encoding) -> Line<'_> {
        Line {
            section: self.section,
            order: self.order,
            item: self.shown,
            form: self.form,
            date: match self.section {
                Section::Conversation => dated(state, self.shown, encoding),
                _ => None,
            },
        }
    }
}

/// The ways an item can be shown in the recall block, preferred first. A turn is shown once, in
/// the fullest form that fits: its raw line, the raw line clipped, or its summary. An artifact
/// is shown as its turn's raw line (which holds it), whole, or as a reference.
fn render_options(state: &MemoryState, item: ItemRef, encoding: Encoding) -> Vec<RenderOption> {
    match item {
        ItemRef::Fact(id) => state
            .fact(id)
            .map(|fact| {
                vec![RenderOption {
                    shown: item,
                    section: Section::RelevantFacts,
                    order: u64::from(id),
                    form: Form::Full,
                    tokens: fact.tokens.get(encoding),
                }]
            })
            .unwrap_or_default(),
        ItemRef::RawTurn(seq) | ItemRef::Summary(seq) => {
            let Some(turn) = state.raw_turns.get(seq as usize) else {
                return Vec::new();
            };
            let raw = ItemRef::RawTurn(seq);
            let full = turn.tokens.line.get(encoding);
            let clipped = turn.tokens.clipped_line.get(encoding);
            let summary = state
                .turn_log
                .get(seq as usize)
                .map(|entry| entry.tokens.get(encoding));
            let order = u64::from(seq) * 2;
            let conversation = |shown, order, form, tokens| RenderOption {
                shown,
                section: Section::Conversation,
                order,
                form,
                tokens,
            };
            let mut options = Vec::new();
            let affordable = |tokens: u32| match (item, summary) {
                (ItemRef::Summary(_), Some(summary)) => {
                    tokens <= summary.saturating_mul(RAW_FOR_HIT_COST)
                }
                _ => true,
            };
            if affordable(full) {
                options.push(conversation(raw, order, Form::Full, full));
            }
            if clipped < full && affordable(clipped) {
                options.push(conversation(raw, order, Form::Clipped, clipped));
            }
            if let Some(summary) = summary {
                options.push(conversation(
                    ItemRef::Summary(seq),
                    order + 1,
                    Form::Full,
                    summary,
                ));
            }
            options
        }
        ItemRef::Artifact(id) => {
            let Some(artifact) = state.artifacts.get(id as usize) else {
                return Vec::new();
            };
            let full = artifact.tokens.get(encoding);
            let shown_as_itself = |form, tokens| RenderOption {
                shown: item,
                section: Section::Artifacts,
                order: u64::from(id),
                form,
                tokens,
            };
            let mut options = Vec::new();
            if let Some(turn) = state.raw_turns.get(artifact.turn as usize) {
                let raw = turn.tokens.line.get(encoding);
                if raw <= full.saturating_mul(RAW_FOR_HIT_COST) {
                    options.push(RenderOption {
                        shown: ItemRef::RawTurn(artifact.turn),
                        section: Section::Conversation,
                        order: u64::from(artifact.turn) * 2,
                        form: Form::Full,
                        tokens: raw,
                    });
                }
            }
            options.push(shown_as_itself(Form::Full, full));
            options.push(shown_as_itself(
                Form::Reference,
                artifact.reference_tokens.get(encoding),
            ));
            options
        }
        ItemRef::Episode(_) | ItemRef::Identity | ItemRef::Pinned(_) => Vec::new(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::record::test_support::recorded_with;

    /// A raw line too long for the room left still takes its turn's summary's place when the
    /// difference fits: the skip of lines that cannot fit leaves that case alone.
    #[test]
    fn a_turn_takes_its_summarys_place_when_only_the_difference_fits() {
        let state = recorded_with(
            &[(
                "My cousin Ines keeps bees on her balcony in Porto, and every Saturday she sells \
                 their honey at the market by the river with her neighbour's jams.",
                "Bees on a balcony, how brave!",
            )],
            |_| "s".into(),
            |_| Some("2024-02-01T12:00:00Z".into()),
        );
        let config = MemoryConfig::default();
        let encoding = Encoding::O200k;
        let mut packing = Packing::new(&state, encoding, &config, false);
        packing.budget.stage(10_000);
        let options = render_options(&state, ItemRef::Summary(0), encoding);
        let (Some(raw), Some(summary)) = (
            options
                .iter()
                .find(|option| option.shown == ItemRef::RawTurn(0)),
            options
                .iter()
                .find(|option| option.shown == ItemRef::Summary(0)),
        ) else {
            panic!("no raw or summary line: {options:?}");
        };
        let ranking = Ranking {
            score: 1.0,
            relevance: Some(1.0),
            reason: Reason::WorkingSet,
        };
        assert!(packing.place(
            Fenced::Recall,
            summary.line(&state, encoding),
            summary.tokens,
            ranking
        ));
        // Room for the difference, not for the raw line alone.
        packing.budget.stage(raw.tokens - summary.tokens);
        assert!(!packing.budget.fits(raw.tokens));

        let hit = RankedHit {
            item: ItemRef::RawTurn(0),
            ranking,
        };
        pack_recall(&mut packing, &[hit]);
        assert!(packing.recall.contains(ItemRef::RawTurn(0)));
        assert!(!packing.recall.contains(ItemRef::Summary(0)));
    }
}
