//! The metrics of one question and their aggregates per category and overall.
//!
//! Per question (categories 1–4), for any system that produced a prompt:
//! - evidence recall: the share of the gold evidence turns whose normalised text (lowercase,
//!   whitespace collapsed) appears in the normalised prompt context;
//! - provenance recall: the share of the gold evidence turns the system credits as included
//!   (engram: some injected item's provenance names the turn's exchange; baselines: the turn was
//!   selected);
//! - answer recall: whether the normalised gold answer appears in the context;
//! - prompt tokens: cl100k tokens of every message content except the question itself.
//!
//! The context is everything the prompt holds except the question itself, so a question can
//! never "contain" its own evidence or answer. Questions whose evidence names no turn of the
//! conversation count for answer recall and tokens, not for the two evidence recalls.

use serde::Serialize;

use super::dataset::Category;

/// Lowercase, every run of whitespace collapsed to one space, ends trimmed.
pub fn normalise(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for word in text.split_whitespace() {
        if !out.is_empty() {
            out.push(' ');
        }
        out.extend(word.chars().flat_map(char::to_lowercase));
    }
    out
}

/// One question's figures for one system.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct QuestionScore {
    pub category: Category,
    /// `None` when the question has no resolvable evidence.
    pub evidence_recall: Option<f64>,
    pub provenance_recall: Option<f64>,
    pub answer_found: bool,
    pub tokens: u32,
}

/// Scores one prompt. `context` must already be normalised; `evidence` are the evidence turns'
/// normalised texts; `credited` says, per evidence turn, whether the system credits it.
pub fn score(
    category: Category,
    context: &str,
    evidence: &[String],
    credited: &[bool],
    answer: &str,
    tokens: u32,
) -> QuestionScore {
    let share = |hits: usize| (!evidence.is_empty()).then(|| hits as f64 / evidence.len() as f64);
    let found = evidence
        .iter()
        .filter(|text| !text.is_empty() && context.contains(text.as_str()))
        .count();
    let credited = credited.iter().filter(|credited| **credited).count();
    let answer = normalise(answer);
    QuestionScore {
        category,
        evidence_recall: share(found),
        provenance_recall: share(credited),
        answer_found: !answer.is_empty() && context.contains(&answer),
        tokens,
    }
}

/// Mean, median and 95th percentile of prompt tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct TokenStats {
    pub mean: f64,
    pub median: f64,
    pub p95: f64,
}

impl TokenStats {
    /// Median: the middle value (mean of the two middle ones for an even count); p95: the
    /// nearest-rank percentile (the smallest value with at least 95 % of values at or below it).
    pub fn of(values: &[u32]) -> TokenStats {
        if values.is_empty() {
            return TokenStats::default();
        }
        let mut sorted = values.to_vec();
        sorted.sort_unstable();
        let n = sorted.len();
        let mean = sorted.iter().map(|v| f64::from(*v)).sum::<f64>() / n as f64;
        let median = if n % 2 == 1 {
            f64::from(sorted[n / 2])
        } else {
            (f64::from(sorted[n / 2 - 1]) + f64::from(sorted[n / 2])) / 2.0
        };
        let rank = (0.95 * n as f64).ceil() as usize;
        let p95 = f64::from(sorted[rank.clamp(1, n) - 1]);
        TokenStats { mean, median, p95 }
    }
}

/// Aggregates over a set of questions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Summary {
    pub questions: usize,
    /// Questions with resolvable evidence (the denominator of both evidence recalls).
    pub with_evidence: usize,
    /// Means over the questions with evidence (macro average).
    pub evidence_recall: f64,
    pub provenance_recall: f64,
    /// Share of questions whose answer appears in the context.
    pub answer_recall: f64,
    pub tokens: TokenStats,
}

impl Summary {
    pub fn of<'a>(scores: impl IntoIterator<Item = &'a QuestionScore>) -> Summary {
        let scores: Vec<&QuestionScore> = scores.into_iter().collect();
        let evidence: Vec<f64> = scores.iter().filter_map(|s| s.evidence_recall).collect();
        let provenance: Vec<f64> = scores.iter().filter_map(|s| s.provenance_recall).collect();
        let mean = |values: &[f64]| {
            if values.is_empty() {
                0.0
            } else {
                values.iter().sum::<f64>() / values.len() as f64
            }
        };
        let answers = scores.iter().filter(|s| s.answer_found).count();
        let tokens: Vec<u32> = scores.iter().map(|s| s.tokens).collect();
        Summary {
            questions: scores.len(),
            with_evidence: evidence.len(),
            evidence_recall: mean(&evidence),
            provenance_recall: mean(&provenance),
            answer_recall: if scores.is_empty() {
                0.0
            } else {
                answers as f64 / scores.len() as f64
            },
            tokens: TokenStats::of(&tokens),
        }
    }
}

/// One category's summary.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CategorySummary {
    pub category: Category,
    pub number: u8,
    #[serde(flatten)]
    pub summary: Summary,
}

/// A summary per evaluated category (those with questions, in category order) and one over all.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Breakdown {
    pub overall: Summary,
    pub categories: Vec<CategorySummary>,
}

impl Breakdown {
    pub fn of(scores: &[QuestionScore]) -> Breakdown {
        let mut categories = Vec::new();
        for category in Category::EVALUATED {
            let of_category: Vec<&QuestionScore> = scores
                .iter()
                .filter(|score| score.category == category)
                .collect();
            if !of_category.is_empty() {
                categories.push(CategorySummary {
                    category,
                    number: category as u8,
                    summary: Summary::of(of_category),
                });
            }
        }
        Breakdown {
            overall: Summary::of(scores),
            categories,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn normalising_lowercases_and_collapses_whitespace() {
        assert_eq!(
            normalise("  Ann:\tI  ADOPTED\n a Cat. "),
            "ann: i adopted a cat."
        );
        assert_eq!(normalise("Über"), "über");
    }

    #[test]
    fn one_question_scored_by_hand() {
        let context = normalise("- [2023-05-08] “Ann: I adopted a CAT named Tom.\n  Bob: Nice.”");
        let evidence = [
            normalise("Ann: I adopted a cat named Tom."),
            normalise("Bob: What is its name?"),
        ];
        let got = score(
            Category::SingleHop,
            &context,
            &evidence,
            &[true, true],
            "Tom",
            42,
        );
        assert_eq!(got.evidence_recall, Some(0.5));
        assert_eq!(got.provenance_recall, Some(1.0));
        assert!(got.answer_found);
        assert_eq!(got.tokens, 42);
        let none = score(Category::Temporal, &context, &[], &[], "7 May 2023", 0);
        assert_eq!(none.evidence_recall, None);
        assert!(!none.answer_found);
    }

    #[test]
    fn token_stats_by_hand() {
        let stats = TokenStats::of(&[10, 40, 20, 30]);
        assert_eq!(stats.mean, 25.0);
        assert_eq!(stats.median, 25.0);
        assert_eq!(stats.p95, 40.0);
        let values: Vec<u32> = (1..=20).collect();
        let stats = TokenStats::of(&values);
        assert_eq!(stats.median, 10.5);
        // Nearest rank: ceil(0.95 * 20) = 19th value.
        assert_eq!(stats.p95, 19.0);
        assert_eq!(TokenStats::of(&[7]).p95, 7.0);
    }

    #[test]
    fn summaries_average_over_questions_with_evidence() {
        let scores = [
            QuestionScore {
                category: Category::MultiHop,
                evidence_recall: Some(1.0),
                provenance_recall: Some(1.0),
                answer_found: true,
                tokens: 100,
            },
            QuestionScore {
                category: Category::MultiHop,
                evidence_recall: Some(0.5),
                provenance_recall: Some(0.0),
                answer_found: false,
                tokens: 300,
            },
            QuestionScore {
                category: Category::Temporal,
                evidence_recall: None,
                provenance_recall: None,
                answer_found: true,
                tokens: 200,
            },
        ];
        let breakdown = Breakdown::of(&scores);
        assert_eq!(breakdown.overall.questions, 3);
        assert_eq!(breakdown.overall.with_evidence, 2);
        assert_eq!(breakdown.overall.evidence_recall, 0.75);
        assert_eq!(breakdown.overall.provenance_recall, 0.5);
        assert!((breakdown.overall.answer_recall - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(breakdown.overall.tokens.median, 200.0);
        let categories: Vec<Category> = breakdown.categories.iter().map(|c| c.category).collect();
        assert_eq!(categories, [Category::MultiHop, Category::Temporal]);
        let multi = &breakdown.categories[0].summary;
        assert_eq!(multi.questions, 2);
        assert_eq!(multi.tokens.mean, 200.0);
        assert_eq!(breakdown.categories[1].summary.with_evidence, 0);
    }
}
