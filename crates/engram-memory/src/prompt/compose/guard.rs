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
