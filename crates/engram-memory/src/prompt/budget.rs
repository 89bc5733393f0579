//! Token budgets (seed 000's `budgetsFromTotal`) and the packer that charges items against a
//! tier's share and the whole budget at once, so the injected blocks can never exceed it.

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Budgets {
    pub total: u32,
    pub new: u32,
    pub current: u32,
    /// The rest: OLD manifests and rehydration hints.
    pub old: u32,
}

/// Splits `total` into NEW, CURRENT and the rest for OLD (fractions are clamped so the parts
/// never exceed the total).
pub fn budgets_from_total(total: u32, new_fraction: f32, current_fraction: f32) -> Budgets {
    let new_fraction = new_fraction.clamp(0.0, 1.0);
    let current_fraction = current_fraction.clamp(0.0, 1.0 - new_fraction);
    let part = |fraction: f32| ((total as f64) * f64::from(fraction)).floor() as u32;
    let new = part(new_fraction).min(total);
    let current = part(current_fraction).min(total - new);
    Budgets {
        total,
        new,
        current,
        old: total - new - current,
    }
}

/// Tokens left in the whole budget and in the stage being packed.
#[derive(Debug, Clone, Copy)]
pub struct Packer {
    pub total_left: u32,
    pub stage_left: u32,
}

impl Packer {
    pub fn new(total: u32) -> Packer {
        Packer {
            total_left: total,
            stage_left: total,
        }
    }

    /// Starts a stage capped at `limit` (and by what is left overall).
    pub fn stage(&mut self, limit: u32) {
        self.stage_left = limit.min(self.total_left);
    }

    pub fn fits(&self, tokens: u32) -> bool {
        tokens <= self.stage_left && tokens <= self.total_left
    }

    /// Charges `tokens` if they fit.
    pub fn take(&mut self, tokens: u32) -> bool {
        if !self.fits(tokens) {
            return false;
        }
        self.stage_left -= tokens;
        self.total_left -= tokens;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seed_split() {
        assert_eq!(
            budgets_from_total(2048, 0.2, 0.6),
            Budgets {
                total: 2048,
                new: 409,
                current: 1228,
                old: 411
            }
        );
        let odd = budgets_from_total(7, 0.9, 0.9);
        assert_eq!(odd.new + odd.current + odd.old, 7);
        assert_eq!(budgets_from_total(0, 0.2, 0.6), Budgets::default());
    }

    #[test]
    fn packer_respects_stage_and_total() {
        let mut packer = Packer::new(10);
        packer.stage(6);
        assert!(packer.take(5));
        assert!(!packer.take(2));
        packer.stage(100);
        assert_eq!(packer.stage_left, 5);
        assert!(packer.take(5));
        assert!(!packer.take(1));
    }
}
