//! The final guard: the blocks fit the budget, always. Packing charges every line against the
//! budget, so this only drops a block if packing has a bug.

use super::Packing;
use crate::prompt::explain::{Block, BlockTokens};

/// The blocks' tokens once they fit, and whether a block had to be dropped.
pub(super) struct Guarded {
    pub(super) tokens: BlockTokens,
    pub(super) trimmed: bool,
}

/// Drops whole blocks, recall first, then the window, then core, until the rest fits `budget`.
pub(super) fn fit_budget(packing: &mut Packing<'_>, budget: u32) -> Guarded {
    let mut trimmed = false;
    for block in [Block::Recall, Block::Window, Block::Core] {
        if block_tokens(packing).total <= budget {
            break;
        }
        trimmed = true;
        match block {
            Block::Recall => packing.recall.clear(),
            Block::Window => packing.window.clear(),
            Block::Core => packing.core.clear(),
        }
        packing.explained.retain(|item| item.block != block);
    }
    Guarded {
        tokens: block_tokens(packing),
        trimmed,
    }
}

fn block_tokens(packing: &Packing<'_>) -> BlockTokens {
    let core = packing.core.tokens;
    let window = packing.window.tokens;
    let recall = packing.recall.tokens;
    BlockTokens {
        core,
        window,
        recall,
        total: core + window + recall,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::MemoryConfig;
    use crate::model::MemoryState;
    use crate::prompt::compose::window::WindowTurn;
    use crate::tokens::Encoding;

    /// Packing never overspends, so the guard is only reached through a bug; this forces it.
    #[test]
    fn the_guard_drops_recall_then_the_window_then_core() {
        let state = MemoryState::new();
        let config = MemoryConfig::default();
        let over = |core, window, recall| {
            let mut packing = Packing::new(&state, Encoding::O200k, &config, false);
            packing.core.tokens = core;
            packing.window.tokens = window;
            packing.window.turns.push(WindowTurn::Stored(0));
            packing.recall.tokens = recall;
            packing
        };
        let tokens = |core, window, recall| BlockTokens {
            core,
            window,
            recall,
            total: core + window + recall,
        };

        let mut packing = over(30, 40, 50);
        let guarded = fit_budget(&mut packing, 120);
        assert!(!guarded.trimmed);
        assert_eq!(guarded.tokens, tokens(30, 40, 50));

        let guarded = fit_budget(&mut packing, 75);
        assert!(guarded.trimmed);
        assert_eq!(guarded.tokens, tokens(30, 40, 0));
        assert_eq!(packing.window.turns.len(), 1);

        let mut packing = over(30, 40, 50);
        let guarded = fit_budget(&mut packing, 35);
        assert_eq!(guarded.tokens, tokens(30, 0, 0));
        assert!(packing.window.turns.is_empty());

        let mut packing = over(30, 40, 50);
        let guarded = fit_budget(&mut packing, 10);
        assert_eq!(guarded.tokens, tokens(0, 0, 0));
    }
}
