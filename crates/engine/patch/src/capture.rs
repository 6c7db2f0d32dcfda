//! Transaction capture, for a journal above the engine: while a capture is open, every
//! change (file data only if asked) waits for the capture's *hold*, a held empty patch,
//! and its block is recorded. Closing the capture (`capture_rotate`) hands the journal the
//! captured blocks as they are at that instant (shared copy-on-write with the cache, so
//! later changes do not alter them), the blocks freed meanwhile (for revoke records), the
//! hold (which the journal drops once the transaction's commit block is durable, letting
//! the in-place writes go) and a *done* patch that becomes durable once every captured
//! change is on disk in place (the transaction's log space can then be reused). A new
//! capture opens in the same step, so no change falls between two transactions.

use crate::engine::{Engine, State};
use crate::graph::PatchId;
use crate::{PatchError, Result};
use quilt_block::BlockNo;
use quilt_block::WriteClass;
use rustc_hash::FxHashSet as HashSet;
use std::collections::BTreeSet;

pub(crate) struct Capture {
    hold: PatchId,
    data: bool,
    blocks: BTreeSet<BlockNo>,
    patches: Vec<PatchId>,
    /// Blocks freed since the last change to them in this capture.
    revoked: HashSet<BlockNo>,
}

impl Capture {
    /// Whether a change to `block` (of file data if `data`) belongs to the transaction:
    /// metadata always, file data in full mode, or when it lands in a block this
    /// transaction freed (see `State::capture_change`).
    fn takes(&self, block: BlockNo, data: bool) -> bool {
        !data || self.data || self.revoked.contains(&block)
    }
}

/// A closed capture: one transaction's worth of changes.
#[derive(Debug)]
pub struct CapturedTxn {
    /// Drop it (`Engine::release_hold`) once the transaction is committed.
    pub hold: PatchId,
    /// Durable once every captured change is written in place.
    pub done: PatchId,
    /// Each captured block and its contents at the close.
    pub blocks: Vec<(BlockNo, crate::BlockBuf)>,
    /// Blocks freed in this transaction and not changed since.
    pub revoked: Vec<BlockNo>,
}

impl State {
    /// Called for every change: ties it to the open capture.
    pub(crate) fn capture_change(&mut self, id: PatchId, block: BlockNo, data: bool) {
        // File data is captured in full mode; in metadata mode too when it lands in a
        // block this transaction freed (ext3's rule): written in place, it could reach
        // the disk before the free commits, and a checkpoint or a replay of the block's
        // old, committed contents would then overwrite it.
        let Some((hold, take)) = self
            .capture
            .as_ref()
            .map(|c| (c.hold, c.takes(block, data)))
        else {
            return;
        };
        if !take || id == hold {
            return;
        }
        self.add_edge(id, hold);
        let c = self.capture.as_mut().expect("checked above");
        c.blocks.insert(block);
        c.revoked.remove(&block);
        if c.patches.last() != Some(&id) {
            c.patches.push(id);
        }
    }

    /// May run `run` grow over `n` blocks from `first` under the open capture? Only if
    /// the capture takes none of them, or the run is already this capture's newest
    /// change: a run of an older transaction taking blocks of the running one would
    /// tie the older one's checkpoint to the newer one's commit.
    pub(crate) fn capture_may_grow(
        &self,
        run: PatchId,
        first: BlockNo,
        n: u64,
        data: bool,
    ) -> bool {
        let Some(c) = &self.capture else {
            return true;
        };
        let takes = (first..first + n).any(|b| c.takes(b, data));
        !takes || c.patches.last() == Some(&run)
    }

    /// May a change to `block` (of file data if `data`) join pending patch `p` (merge
    /// into it, or fold with it into one hard patch)? Under an open capture that takes
    /// the change, only if `p` is this capture's too. Joining a patch of an older,
    /// committed transaction ties that transaction's checkpoint to this one's commit;
    /// with a block changed in every transaction (a bitmap, an inode table) no
    /// transaction was ever retired by write-back, and every one waited for a forced
    /// checkpoint that read its blocks back from the log (a full-journal untar: 91 of
    /// 91).
    pub(crate) fn capture_may_join(&self, p: PatchId, block: BlockNo, data: bool) -> bool {
        let Some(c) = &self.capture else {
            return true;
        };
        !c.takes(block, data) || self.g.get(p).befores.contains(&c.hold)
    }

    fn open_capture(&mut self, data: bool) {
        let hold = self.new_empty(&[], 1);
        self.capture = Some(Capture {
            hold,
            data,
            blocks: BTreeSet::new(),
            patches: Vec::new(),
            revoked: HashSet::default(),
        });
    }
}

impl Engine {
    /// Opens a capture (`data`: file data changes are captured too). Refused if one is
    /// open.
    pub fn capture_start(&self, data: bool) -> Result<()> {
        let mut st = self.lock();
        if st.capture.is_some() {
            return Err(PatchError::Invalid("a capture is already open"));
        }
        st.open_capture(data);
        Ok(())
    }

    /// Closes the open capture and returns it (None if none is open); with `reopen`, a
    /// new one opens atomically. Waits until no operation (`Services::begin`) is in
    /// flight, and holds new ones back meanwhile, so a transaction never splits one.
    pub fn capture_rotate(&self, reopen: bool) -> Result<Option<CapturedTxn>> {
        self.quiesced(|| self.capture_rotate_now(reopen))
    }

    fn capture_rotate_now(&self, reopen: bool) -> Result<Option<CapturedTxn>> {
        let mut st = self.lock();
        let Some(c) = st.capture.take() else {
            return Ok(None);
        };
        let mut blocks = Vec::with_capacity(c.blocks.len());
        for &b in &c.blocks {
            match st.blocks.get(&b) {
                Some(cb) => blocks.push((b, cb.data.clone())),
                None => {
                    // Captured blocks hold pending patches, and those are never evicted.
                    st.capture = Some(c);
                    return Err(PatchError::Invalid("a captured block left the cache"));
                }
            }
        }
        let done = st.new_empty(&c.patches, 0);
        if reopen {
            st.open_capture(c.data);
        }
        Ok(Some(CapturedTxn {
            hold: c.hold,
            done,
            blocks,
            revoked: c.revoked.into_iter().collect(),
        }))
    }

    /// Records that `blocks` were freed, for the open capture's revoke records. (Pass
    /// the blocks freed together in one call: each call takes the engine's lock.)
    pub fn capture_revoke(&self, blocks: impl IntoIterator<Item = BlockNo>) {
        if let Some(c) = self.lock().capture.as_mut() {
            c.revoked.extend(blocks);
        }
    }

    /// Blocks the open capture holds (0 if none is open).
    pub fn capture_len(&self) -> usize {
        self.lock().capture.as_ref().map_or(0, |c| c.blocks.len())
    }

    /// Drops one hold on an empty patch (a capture's hold, once its transaction is
    /// committed).
    pub fn release_hold(&self, hold: PatchId) {
        self.lock().unhold(hold);
    }

    /// Writes `blocks` straight to the device, bypassing the cache but ordered with
    /// write-back (no epoch is in flight meanwhile), then flushes if the engine is in
    /// safe mode. For a journal's checkpoint: the images must be no older than what the
    /// cache would write.
    ///
    /// Each block's bytes come from `fill`, into one buffer used again for the next, so a
    /// checkpoint of a whole transaction holds one block in memory, not all of them.
    pub fn write_through(
        &self,
        blocks: &[BlockNo],
        mut fill: impl FnMut(BlockNo, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        let _epoch = self.sh.epoch.lock().unwrap_or_else(|e| e.into_inner());
        self.lock().check_failed()?;
        let mut buf = vec![0u8; self.sh.block_size];
        for &b in blocks {
            fill(b, &mut buf)?;
            // A journal checkpoint: the blocks are the transaction's, of any kind; the
            // home copies of logged blocks count as metadata.
            self.sh.dev.write(b, &buf, WriteClass::Metadata)?;
        }
        if self.sh.opts.durability == crate::Durability::Safe {
            self.sh.dev.flush()?;
        }
        Ok(())
    }

    /// Whether write-back flushes the device (safe durability).
    pub fn flushes(&self) -> bool {
        self.sh.opts.durability == crate::Durability::Safe
    }
}

#[cfg(test)]
mod tests {
    use crate::{ChangeOpts, Engine, EngineOptions};
    use quilt_block::MemDevice;
    use std::sync::Arc;

    #[test]
    fn data_in_a_block_freed_by_the_transaction_is_journaled_in_metadata_mode() {
        let e = Engine::new(
            Arc::new(MemDevice::new(512, 16).unwrap()),
            EngineOptions::default(),
        );
        e.capture_start(false).unwrap();
        let data = ChangeOpts {
            caller: None,
            data: true,
        };
        e.write(3, 0, &[1], &[], data).unwrap();
        e.capture_revoke([5]);
        e.write(5, 0, &[2], &[], data).unwrap();
        let t = e.capture_rotate(false).unwrap().unwrap();
        let blocks: Vec<u64> = t.blocks.iter().map(|(b, _)| *b).collect();
        assert_eq!(
            blocks,
            vec![5],
            "plain data stays out, reused-block data goes in"
        );
        assert!(!t.revoked.contains(&5), "re-logged, not revoked");
        e.release_hold(t.hold);
    }
}
