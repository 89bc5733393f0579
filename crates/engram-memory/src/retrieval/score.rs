//! Seed 000's item score, used to pack the working set, to decide demotion and to break ties
//! between equally relevant recall candidates.

use crate::config::ScoringWeights;
use crate::model::{FactCategory, MemoryState, Tier, TierState, TurnLogEntry, TurnSeq};
use crate::tokens::Encoding;

/// The inputs of one item's score.
#[derive(Debug, Clone, Copy)]
pub struct ScoreInputs {
    pub tier: TierState,
    /// `0..=1`.
    pub user_priority: f32,
    /// Share of the item's dependencies that are active (NEW or CURRENT), `0..=1`.
    pub dependency: f32,
    pub size_tokens: u32,
}

/// `w_r·exp(-decay·Δturns) + w_f·min(freq/cap,1) + w_u·priority + w_d·dependency −
/// w_s·min(size/scale,1)`.
pub fn score(weights: &ScoringWeights, now: TurnSeq, inputs: &ScoreInputs) -> f32 {
    let age = now.saturating_sub(inputs.tier.last_touched_turn) as f32;
    let recency = (-weights.recency_decay * age).exp();
    let frequency = (inputs.tier.frequency as f32 / weights.frequency_cap.max(1e-6)).min(1.0);
    let size = (inputs.size_tokens as f32 / weights.size_scale_tokens.max(1e-6)).min(1.0);
    weights.recency * recency
        + weights.frequency * frequency
        + weights.user_priority * inputs.user_priority.clamp(0.0, 1.0)
        + weights.dependency * inputs.dependency.clamp(0.0, 1.0)
        - weights.size * size
}

fn is_active(tier: Tier) -> bool {
    matches!(tier, Tier::New | Tier::Current)
}

/// Default importance of a fact category when the diff does not say.
pub fn default_importance(category: FactCategory) -> f32 {
    match category {
        FactCategory::HardConstraint => 1.0,
        FactCategory::Explicit => 0.8,
        FactCategory::Identity => 0.7,
        FactCategory::Relation | FactCategory::Plan => 0.6,
        FactCategory::Preference | FactCategory::Possession => 0.5,
        FactCategory::General => 0.4,
    }
}

/// A fact depends on the turns it came from: it is worth more while they are in the working set.
pub fn fact_score(state: &MemoryState, weights: &ScoringWeights, fact_index: usize) -> f32 {
    let Some(fact) = state.facts.get(fact_index) else {
        return 0.0;
    };
    let dependency = share_active(
        fact.provenance
            .iter()
            .filter_map(|seq| state.turn_log.get(*seq as usize))
            .map(|entry| entry.tier.tier),
    );
    score(
        weights,
        state.now(),
        &ScoreInputs {
            tier: fact.tier,
            user_priority: fact.importance,
            dependency,
            size_tokens: fact.tokens.get(Encoding::O200k),
        },
    )
}

/// A turn summary depends on the facts its turn established.
pub fn summary_score(state: &MemoryState, weights: &ScoringWeights, entry: &TurnLogEntry) -> f32 {
    let dependency = share_active(
        entry
            .facts
            .iter()
            .filter_map(|id| state.fact(*id))
            .filter(|fact| fact.active)
            .map(|fact| fact.tier.tier),
    );
    // Turns that produced artifacts are referenced later more often than chit-chat.
    let user_priority = if entry.artifacts.is_empty() { 0.0 } else { 0.5 };
    score(
        weights,
        state.now(),
        &ScoreInputs {
            tier: entry.tier,
            user_priority,
            dependency,
            size_tokens: entry.tokens.get(Encoding::O200k),
        },
    )
}

fn share_active(tiers: impl Iterator<Item = Tier>) -> f32 {
    let (mut active, mut total) = (0u32, 0u32);
    for tier in tiers {
        total += 1;
        active += u32::from(is_active(tier));
    }
    if total == 0 {
        0.0
    } else {
        active as f32 / total as f32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs(last_touched: TurnSeq, frequency: u32, priority: f32, size: u32) -> ScoreInputs {
        ScoreInputs {
            tier: TierState {
                tier: Tier::Current,
                since_turn: 0,
                last_touched_turn: last_touched,
                frequency,
            },
            user_priority: priority,
            dependency: 0.0,
            size_tokens: size,
        }
    }

    #[test]
    fn matches_the_seed_formula() {
        let weights = ScoringWeights::default();
        // Touched this turn, once, no priority, 100 tokens:
        // 0.40·1 + 0.20·(1/5) + 0 + 0 − 0.15·0.5 = 0.365
        let got = score(&weights, 10, &inputs(10, 1, 0.0, 100));
        assert!((got - 0.365).abs() < 1e-6, "{got}");
        // Four turns old: recency 0.40·exp(-1.4).
        let got = score(&weights, 14, &inputs(10, 1, 0.0, 0));
        let want = 0.40 * (-1.4f32).exp() + 0.04;
        assert!((got - want).abs() < 1e-6, "{got} vs {want}");
    }

    #[test]
    fn frequency_and_size_saturate() {
        let weights = ScoringWeights::default();
        let many = score(&weights, 0, &inputs(0, 50, 0.0, 0));
        let five = score(&weights, 0, &inputs(0, 5, 0.0, 0));
        assert_eq!(many, five);
        let huge = score(&weights, 0, &inputs(0, 1, 0.0, 10_000));
        let at_scale = score(&weights, 0, &inputs(0, 1, 0.0, 200));
        assert_eq!(huge, at_scale);
    }

    #[test]
    fn priority_outweighs_age() {
        let weights = ScoringWeights::default();
        let old_important = score(&weights, 100, &inputs(0, 1, 1.0, 10));
        let old_plain = score(&weights, 100, &inputs(0, 1, 0.0, 10));
        assert!(old_important > old_plain);
    }
}
