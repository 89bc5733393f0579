//! The report: engram and the baselines per category and overall at the headline budget, the
//! budget sweep, where engram loses evidence, the targets, the protocol check and the timings;
//! as JSON (everything, per question included) and as markdown.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Arc;

use serde::Serialize;

use super::baselines::ConversationBaselines;
use super::dataset::{Category, Conversation};
use super::locomo::{
    EvalOptions, Loss, MODEL, Missed, ProtocolCheck, QuestionRecord, SystemScore, baseline_score,
};
use super::metrics::{Breakdown, QuestionScore, Summary, TokenStats};
use crate::memory::MemoryConfig;

/// Target (issue 30): evidence recall at the default budget.
pub const TARGET_EVIDENCE_RECALL: f64 = 0.90;
/// Target: engram's median prompt tokens at most this share of full history's.
pub const TARGET_TOKEN_SHARE: f64 = 0.10;

pub const ENGRAM: &str = "engram";
pub const FULL_HISTORY: &str = "full history";
pub const WINDOW: &str = "last 6 exchanges";
pub const BM25: &str = "BM25 top-k";
/// Engram with `memory.retrieval.mode: lexical`, beside a hybrid run.
pub const ENGRAM_LEXICAL: &str = "engram, lexical";

#[derive(Debug, Clone, Copy, Default, Serialize)]
pub struct Timing {
    pub total_seconds: f64,
    pub replay_seconds: f64,
    pub questions_seconds: f64,
}

#[derive(Debug, Clone, Serialize)]
pub struct ConversationRow {
    pub sample_id: String,
    pub sessions: usize,
    pub exchanges: usize,
    pub questions: usize,
    /// Replay plus the headline budget's questions.
    pub seconds: f64,
    pub engram: Summary,
    pub full_history: Summary,
}

#[derive(Debug, Clone, Serialize)]
pub struct SystemRow {
    pub system: &'static str,
    /// `None` for the budget-independent baselines.
    pub budget: Option<u32>,
    #[serde(flatten)]
    pub breakdown: Breakdown,
}

#[derive(Debug, Clone, Serialize)]
pub struct SweepPoint {
    pub system: &'static str,
    pub budget: Option<u32>,
    pub evidence_recall: f64,
    pub provenance_recall: f64,
    pub answer_recall: f64,
    pub tokens: TokenStats,
}

#[derive(Debug, Clone, Serialize)]
pub struct Targets {
    pub evidence_recall: f64,
    pub evidence_recall_met: bool,
    pub median_tokens: f64,
    pub full_history_median_tokens: f64,
    pub median_token_share: f64,
    pub median_token_share_met: bool,
    pub bm25_evidence_recall: f64,
    pub bm25_mean_tokens: f64,
    pub above_bm25: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct Report {
    pub engram_version: &'static str,
    pub data: String,
    pub model: &'static str,
    pub encoding: &'static str,
    pub budget: u32,
    /// The memory configuration of the headline run.
    pub memory: MemoryConfig,
    pub exchanges: usize,
    pub questions: usize,
    /// Evidence ids of the data that name no turn (left out of evidence recall).
    pub unresolved_evidence: usize,
    pub headline: Vec<SystemRow>,
    pub sweep: Vec<SweepPoint>,
    /// Engram's lost evidence turns at the headline budget, by where they were lost.
    pub losses: BTreeMap<String, usize>,
    pub targets: Targets,
    pub protocol: ProtocolCheck,
    pub protocol_holds: bool,
    pub conversations: Vec<ConversationRow>,
    pub timing: Timing,
    pub questions_detail: Vec<QuestionRecord>,
}

/// Engram's probes: per budget, per conversation, per evaluated question, its score and losses.
pub type EngramProbes = Vec<(u32, Vec<Vec<(QuestionScore, Vec<Missed>)>>)>;

/// Engram's probes in the configured retrieval mode, and in lexical mode beside a hybrid run
/// (empty otherwise).
#[derive(Clone, Copy)]
pub struct EngramRuns<'a> {
    pub configured: &'a EngramProbes,
    pub lexical: &'a EngramProbes,
}

/// Budgets of the sweep at which BM25 (filling engram's mean tokens) has evidence recall at
/// least engram's.
fn budgets_behind_bm25(sweep: &[SweepPoint]) -> Vec<String> {
    let recall = |system: &str, budget: Option<u32>| {
        sweep
            .iter()
            .find(|point| point.system == system && point.budget == budget)
            .map(|point| point.evidence_recall)
    };
    sweep
        .iter()
        .filter(|point| point.system == ENGRAM)
        .filter_map(|point| {
            let bm25 = recall(BM25, point.budget)?;
            (bm25 >= point.evidence_recall).then(|| {
                format!(
                    "{}: {:.3} against {:.3}",
                    point.budget.unwrap_or_default(),
                    bm25,
                    point.evidence_recall
                )
            })
        })
        .collect()
}

pub fn build(
    options: &EvalOptions,
    conversations: &[Arc<Conversation>],
    baselines: &[ConversationBaselines],
    runs: EngramRuns<'_>,
    conversation_seconds: &[f64],
    protocol: ProtocolCheck,
    timing: Timing,
) -> Report {
    let budget = options.budget;
    let (engram, lexical) = (runs.configured, runs.lexical);
    let flat = |probes: &Vec<Vec<(QuestionScore, Vec<Missed>)>>| -> Vec<QuestionScore> {
        probes.iter().flatten().map(|(score, _)| *score).collect()
    };
    let mut headline = Vec::new();
    let mut sweep = Vec::new();
    let mut full_scores = Vec::new();
    let mut window_scores = Vec::new();
    let mut detail = Vec::new();
    let mut losses: BTreeMap<String, usize> = BTreeMap::new();
    let mut conversation_rows = Vec::new();
    let mut targets = None;

    // Budget-independent baselines.
    for (conversation, baseline) in conversations.iter().zip(baselines) {
        for question in conversation.evaluated_questions() {
            full_scores.push(baseline_score(conversation, question, &baseline.full_history).score);
            window_scores.push(baseline_score(conversation, question, &baseline.window).score);
        }
    }
    let full = Breakdown::of(&full_scores);
    let window = Breakdown::of(&window_scores);

    for (round, (round_budget, probes)) in engram.iter().enumerate() {
        let engram_scores = flat(probes);
        let engram_breakdown = Breakdown::of(&engram_scores);
        // BM25 gets the same mean token count engram used at this budget.
        let target = engram_breakdown.overall.tokens.mean.round() as u32;
        let mut bm25_scores = Vec::new();
        for (c, (conversation, baseline)) in conversations.iter().zip(baselines).enumerate() {
            let mut engram_row = Vec::new();
            for (q, question) in conversation.evaluated_questions().enumerate() {
                let bm25_prompt = baseline.bm25(&question.question, target);
                let bm25 = baseline_score(conversation, question, &bm25_prompt);
                bm25_scores.push(bm25.score);
                if round == 0 {
                    let (score, missed) = probes[c][q].clone();
                    engram_row.push(score);
                    for lost in &missed {
                        *losses.entry(loss_name(lost.why).to_owned()).or_default() += 1;
                    }
                    detail.push(QuestionRecord {
                        conversation: conversation.sample_id.clone(),
                        index: question_index(conversation, q),
                        category: question.category,
                        evidence: question
                            .evidence
                            .iter()
                            .filter_map(|pos| conversation.turn(*pos))
                            .map(|turn| turn.dia_id.clone())
                            .collect(),
                        engram: SystemScore { score, missed },
                        full_history: baseline_score(
                            conversation,
                            question,
                            &baseline.full_history,
                        ),
                        window: baseline_score(conversation, question, &baseline.window),
                        bm25,
                    });
                }
            }
            if round == 0 {
                let full_row: Vec<QuestionScore> = conversation
                    .evaluated_questions()
                    .map(|question| {
                        baseline_score(conversation, question, &baseline.full_history).score
                    })
                    .collect();
                conversation_rows.push(ConversationRow {
                    sample_id: conversation.sample_id.clone(),
                    sessions: conversation.sessions.len(),
                    exchanges: conversation.exchange_count(),
                    questions: engram_row.len(),
                    seconds: conversation_seconds.get(c).copied().unwrap_or_default(),
                    engram: Summary::of(&engram_row),
                    full_history: Summary::of(&full_row),
                });
            }
        }
        let bm25_breakdown = Breakdown::of(&bm25_scores);
        sweep.push(point(
            ENGRAM,
            Some(*round_budget),
            &engram_breakdown.overall,
        ));
        sweep.push(point(BM25, Some(*round_budget), &bm25_breakdown.overall));
        if round == 0 {
            let engram_overall = engram_breakdown.overall;
            let share = if full.overall.tokens.median > 0.0 {
                engram_overall.tokens.median / full.overall.tokens.median
            } else {
                0.0
            };
            targets = Some(Targets {
                evidence_recall: engram_overall.evidence_recall,
                evidence_recall_met: engram_overall.evidence_recall >= TARGET_EVIDENCE_RECALL,
                median_tokens: engram_overall.tokens.median,
                full_history_median_tokens: full.overall.tokens.median,
                median_token_share: share,
                median_token_share_met: share <= TARGET_TOKEN_SHARE,
                bm25_evidence_recall: bm25_breakdown.overall.evidence_recall,
                bm25_mean_tokens: bm25_breakdown.overall.tokens.mean,
                above_bm25: engram_overall.evidence_recall > bm25_breakdown.overall.evidence_recall,
            });
            headline.push(SystemRow {
                system: ENGRAM,
                budget: Some(*round_budget),
                breakdown: engram_breakdown,
            });
            headline.push(SystemRow {
                system: FULL_HISTORY,
                budget: None,
                breakdown: full.clone(),
            });
            headline.push(SystemRow {
                system: WINDOW,
                budget: None,
                breakdown: window.clone(),
            });
            headline.push(SystemRow {
                system: BM25,
                budget: Some(*round_budget),
                breakdown: bm25_breakdown,
            });
        }
    }
    for (round, (round_budget, probes)) in lexical.iter().enumerate() {
        let breakdown = Breakdown::of(&flat(probes));
        sweep.push(point(
            ENGRAM_LEXICAL,
            Some(*round_budget),
            &breakdown.overall,
        ));
        if round == 0 {
            headline.insert(
                1.min(headline.len()),
                SystemRow {
                    system: ENGRAM_LEXICAL,
                    budget: Some(*round_budget),
                    breakdown,
                },
            );
        }
    }
    sweep.push(point(FULL_HISTORY, None, &full.overall));
    sweep.push(point(WINDOW, None, &window.overall));
    sweep.sort_by(|a, b| a.system.cmp(b.system).then(a.budget.cmp(&b.budget)));

    let mut memory = options.config.memory.clone();
    memory.budget_tokens = budget;
    let protocol_holds = protocol.holds();
    Report {
        engram_version: env!("CARGO_PKG_VERSION"),
        data: options.data.display().to_string(),
        model: MODEL,
        encoding: "cl100k_base",
        budget,
        memory,
        exchanges: conversations.iter().map(|c| c.exchange_count()).sum(),
        questions: full_scores.len(),
        unresolved_evidence: conversations
            .iter()
            .flat_map(|c| c.evaluated_questions())
            .map(|q| q.unresolved_evidence.len())
            .sum(),
        headline,
        sweep,
        losses,
        targets: targets.unwrap_or(Targets {
            evidence_recall: 0.0,
            evidence_recall_met: false,
            median_tokens: 0.0,
            full_history_median_tokens: 0.0,
            median_token_share: 0.0,
            median_token_share_met: false,
            bm25_evidence_recall: 0.0,
            bm25_mean_tokens: 0.0,
            above_bm25: false,
        }),
        protocol,
        protocol_holds,
        conversations: conversation_rows,
        timing,
        questions_detail: detail,
    }
}

/// The position of the `n`-th evaluated question among all of the conversation's questions.
fn question_index(conversation: &Conversation, n: usize) -> usize {
    conversation
        .questions
        .iter()
        .enumerate()
        .filter(|(_, question)| question.category != Category::Adversarial)
        .nth(n)
        .map_or(0, |(index, _)| index)
}

fn point(system: &'static str, budget: Option<u32>, summary: &Summary) -> SweepPoint {
    SweepPoint {
        system,
        budget,
        evidence_recall: summary.evidence_recall,
        provenance_recall: summary.provenance_recall,
        answer_recall: summary.answer_recall,
        tokens: summary.tokens,
    }
}

pub fn loss_name(loss: Loss) -> &'static str {
    match loss {
        Loss::Clipped => "clipped",
        Loss::Summarised => "summarised",
        Loss::NoRoom => "no_room",
        Loss::NotRetrieved => "not_retrieved",
        Loss::Mismatch => "mismatch",
        Loss::NotSelected => "not_selected",
    }
}

fn loss_meaning(name: &str) -> &'static str {
    match name {
        "clipped" => "the exchange was injected, clipped to its first words per side",
        "summarised" => "only a summary, fact or episode built from the exchange was injected",
        "no_room" => "retrieved and ranked, but it did not fit the budget",
        "not_retrieved" => "not among the retrieved candidates",
        "mismatch" => "injected whole but not found verbatim (a text mismatch)",
        _ => "",
    }
}

fn budget_label(budget: Option<u32>) -> String {
    budget.map_or_else(|| "–".to_owned(), |budget| budget.to_string())
}

fn thousands(value: f64) -> String {
    let rounded = value.round() as i64;
    let digits = rounded.abs().to_string();
    let mut out = String::new();
    for (index, digit) in digits.chars().enumerate() {
        if index > 0 && (digits.len() - index).is_multiple_of(3) {
            out.push(',');
        }
        out.push(digit);
    }
    if rounded < 0 { format!("-{out}") } else { out }
}

fn summary_cells(summary: &Summary) -> String {
    format!(
        "{} | {:.3} | {:.3} | {:.3} | {} | {} | {}",
        summary.questions,
        summary.evidence_recall,
        summary.provenance_recall,
        summary.answer_recall,
        thousands(summary.tokens.mean),
        thousands(summary.tokens.median),
        thousands(summary.tokens.p95),
    )
}

pub fn markdown(report: &Report) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "# LoCoMo replay: engram and the baselines\n");
    let _ = writeln!(
        out,
        "{} conversations, {} exchanges replayed, {} questions (categories 1–4) asked \
         read-only; prompt tokens in {} (every message except the question). Budget {}.\n",
        report.conversations.len(),
        report.exchanges,
        report.questions,
        report.encoding,
        report.budget
    );
    let _ = writeln!(out, "## At budget {}\n", report.budget);
    let _ = writeln!(
        out,
        "| category | system | questions | evidence recall | provenance recall | answer recall \
         | tokens mean | median | p95 |"
    );
    let _ = writeln!(out, "|---|---|--:|--:|--:|--:|--:|--:|--:|");
    let mut categories: Vec<(String, Vec<(&str, Summary)>)> = Vec::new();
    if let Some(first) = report.headline.first() {
        for (index, category) in first.breakdown.categories.iter().enumerate() {
            let rows = report
                .headline
                .iter()
                .filter_map(|row| {
                    row.breakdown
                        .categories
                        .get(index)
                        .map(|c| (row.system, c.summary))
                })
                .collect();
            categories.push((
                format!("{} {}", category.number, category.category.name()),
                rows,
            ));
        }
    }
    categories.push((
        "overall".to_owned(),
        report
            .headline
            .iter()
            .map(|row| (row.system, row.breakdown.overall))
            .collect(),
    ));
    for (category, rows) in &categories {
        for (system, summary) in rows {
            let _ = writeln!(
                out,
                "| {category} | {system} | {} |",
                summary_cells(summary)
            );
        }
    }

    let _ = writeln!(out, "\n## Budget sweep (overall)\n");
    let _ = writeln!(
        out,
        "| system | budget | evidence recall | provenance recall | answer recall | tokens mean \
         | median | p95 |"
    );
    let _ = writeln!(out, "|---|--:|--:|--:|--:|--:|--:|--:|");
    for point in &report.sweep {
        let _ = writeln!(
            out,
            "| {} | {} | {:.3} | {:.3} | {:.3} | {} | {} | {} |",
            point.system,
            budget_label(point.budget),
            point.evidence_recall,
            point.provenance_recall,
            point.answer_recall,
            thousands(point.tokens.mean),
            thousands(point.tokens.median),
            thousands(point.tokens.p95),
        );
    }

    let _ = writeln!(
        out,
        "\n## Where engram loses evidence (budget {})\n",
        report.budget
    );
    let _ = writeln!(out, "| lost evidence turns | count | meaning |");
    let _ = writeln!(out, "|---|--:|---|");
    for (name, count) in &report.losses {
        let _ = writeln!(out, "| {name} | {count} | {} |", loss_meaning(name));
    }

    let targets = &report.targets;
    let mark = |met: bool| if met { "met" } else { "NOT met" };
    let _ = writeln!(out, "\n## Targets (budget {})\n", report.budget);
    let _ = writeln!(
        out,
        "- evidence recall ≥ {TARGET_EVIDENCE_RECALL:.2}: {:.3} — {}",
        targets.evidence_recall,
        mark(targets.evidence_recall_met)
    );
    let _ = writeln!(
        out,
        "- median prompt tokens ≤ {:.0} % of full history's: {} of {} ({:.1} %) — {}",
        TARGET_TOKEN_SHARE * 100.0,
        thousands(targets.median_tokens),
        thousands(targets.full_history_median_tokens),
        targets.median_token_share * 100.0,
        mark(targets.median_token_share_met)
    );
    let _ = writeln!(
        out,
        "- above BM25 at equal tokens: {:.3} vs {:.3} at {} mean tokens — {}",
        targets.evidence_recall,
        targets.bm25_evidence_recall,
        thousands(targets.bm25_mean_tokens),
        mark(targets.above_bm25)
    );

    let behind_bm25 = budgets_behind_bm25(&report.sweep);
    let _ = writeln!(
        out,
        "- above BM25 at equal tokens at every budget of the sweep: {}",
        if behind_bm25.is_empty() {
            "met".to_owned()
        } else {
            format!("NOT met (BM25 ahead at {})", behind_bm25.join(", "))
        }
    );

    let _ = writeln!(out, "\n## Per conversation (budget {})\n", report.budget);
    let _ = writeln!(
        out,
        "| conversation | sessions | exchanges | questions | engram evidence recall | engram \
         median tokens | full history median tokens | seconds |"
    );
    let _ = writeln!(out, "|---|--:|--:|--:|--:|--:|--:|--:|");
    for row in &report.conversations {
        let _ = writeln!(
            out,
            "| {} | {} | {} | {} | {:.3} | {} | {} | {:.1} |",
            row.sample_id,
            row.sessions,
            row.exchanges,
            row.questions,
            row.engram.evidence_recall,
            thousands(row.engram.tokens.median),
            thousands(row.full_history.tokens.median),
            row.seconds
        );
    }

    let protocol = &report.protocol;
    let _ = writeln!(
        out,
        "\n## Protocol check: {}\n",
        if report.protocol_holds {
            "holds"
        } else {
            "VIOLATED"
        }
    );
    let _ = writeln!(
        out,
        "{} exchanges and {} questions sent; the upstream received {} requests ({} unscripted); \
         {} replayed prompts did not end with their exchange; {} raw turns after the replay, {} \
         after the questions ({} mismatched); {} jobs recorded by the read-only questions; {} \
         questions answered degraded; {} evidence ids name no turn.",
        protocol.exchanges_sent,
        protocol.questions_sent,
        protocol.upstream_requests,
        protocol.upstream_unscripted,
        protocol.replay_prompt_violations,
        protocol.raw_turns_after_replay,
        protocol.raw_turns_after_questions,
        protocol.raw_turn_mismatches,
        protocol.jobs_recorded_by_questions,
        protocol.degraded_questions,
        report.unresolved_evidence,
    );
    let _ = writeln!(
        out,
        "\nRuntime: {:.1} s in total ({:.1} s replay until applied, {:.1} s questions).",
        report.timing.total_seconds, report.timing.replay_seconds, report.timing.questions_seconds
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(system: &'static str, budget: u32, evidence_recall: f64) -> SweepPoint {
        SweepPoint {
            system,
            budget: Some(budget),
            evidence_recall,
            provenance_recall: evidence_recall,
            answer_recall: 0.0,
            tokens: TokenStats::default(),
        }
    }

    #[test]
    fn the_budgets_where_bm25_is_not_behind_are_named() {
        let sweep = [
            at(BM25, 512, 0.638),
            at(BM25, 2048, 0.764),
            at(ENGRAM, 512, 0.629),
            at(ENGRAM, 2048, 0.855),
            at(ENGRAM_LEXICAL, 512, 0.1),
        ];
        assert_eq!(
            budgets_behind_bm25(&sweep),
            vec!["512: 0.638 against 0.629".to_owned()]
        );
        assert!(budgets_behind_bm25(&sweep[1..]).is_empty());
    }
}
