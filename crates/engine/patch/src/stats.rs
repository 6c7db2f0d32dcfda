//! The engine's counters. They feed the paper's optimization table (patches created,
//! merged, made hard, rolled back; undo bytes) and `quiltfs stats`.

/// A snapshot of the patch layer's counters.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct EngineStats {
    /// Patches allocated (a change merged into an existing patch allocates none).
    pub patches_created: u64,
    /// Changes folded into an existing patch (overlap merging or hard-patch merging).
    pub patches_merged: u64,
    /// Hard patches formed (whole-block, no undo bytes).
    pub patches_made_hard: u64,
    /// Patch rollbacks while building block images for write-back.
    pub patches_rolled_back: u64,
    /// Empty patches allocated (included in `patches_created`).
    pub empties_created: u64,
    /// Bit patches allocated (bitmap changes; included in `patches_created`).
    pub bit_patches_created: u64,
    /// Patches allocated for file data (included in `patches_created`).
    pub data_patches_created: u64,
    /// Undo bytes held right now.
    pub undo_bytes_now: u64,
    /// Undo bytes ever allocated.
    pub undo_bytes_total: u64,
    /// Patches not yet durable.
    pub patches_live: u64,
    /// Block writes issued by write-back.
    pub blocks_written: u64,
    /// Write-back epochs that wrote at least one block.
    pub epochs: u64,
    /// Flushes issued by write-back.
    pub flushes: u64,
    /// Blocks whose ready patches an epoch looked for: the work of choosing what to write,
    /// which follows the candidates, not the dirty set.
    pub blocks_examined: u64,
    /// Write-backs run by a change that found the cache or the graph over its limit.
    pub throttled_writebacks: u64,
    /// Rounds of the background flusher (on its interval or woken early).
    pub flusher_rounds: u64,
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub evictions: u64,
    pub blocks_cached: u64,
    pub blocks_dirty: u64,
}

impl EngineStats {
    /// Every counter with its name, for text and JSON output.
    pub fn fields(&self) -> Vec<(&'static str, u64)> {
        vec![
            ("patches_created", self.patches_created),
            ("patches_merged", self.patches_merged),
            ("patches_made_hard", self.patches_made_hard),
            ("patches_rolled_back", self.patches_rolled_back),
            ("empties_created", self.empties_created),
            ("bit_patches_created", self.bit_patches_created),
            ("data_patches_created", self.data_patches_created),
            ("undo_bytes_now", self.undo_bytes_now),
            ("undo_bytes_total", self.undo_bytes_total),
            ("patches_live", self.patches_live),
            ("blocks_written", self.blocks_written),
            ("epochs", self.epochs),
            ("flushes", self.flushes),
            ("blocks_examined", self.blocks_examined),
            ("throttled_writebacks", self.throttled_writebacks),
            ("flusher_rounds", self.flusher_rounds),
            ("cache_hits", self.cache_hits),
            ("cache_misses", self.cache_misses),
            ("evictions", self.evictions),
            ("blocks_cached", self.blocks_cached),
            ("blocks_dirty", self.blocks_dirty),
        ]
    }
}
