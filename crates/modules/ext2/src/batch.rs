//! Atomic batches on ext2 (`FileSystem::apply_batch`; the promise is in
//! `quilt_vfs::batch`). Only the journal modes can keep it: the batch's changes go into
//! one transaction, which commits whole or not at all. Memory cannot be rolled back
//! (the patch engine keeps no undo of a running transaction), so the batch is tried
//! first on a trial mount, a copy-on-write view of the image as the last commit left
//! it, and applied for real only when every operation succeeded there. An operation
//! that fails for real all the same (an I/O error, damage, space the trial found and
//! this mount does not) aborts the journal: nothing of the batch reaches the disk, the
//! mount takes no more changes, and the next mount finds the file system as it was
//! before the batch.

use crate::fs::{Ext2, JournalDevice, Mode, MountOptions};
use quilt_block::{BlockDevice, OverlayDevice};
use quilt_patch::{Engine, EngineOptions};
use quilt_vfs::batch::{check_batchable, run_in_order};
use quilt_vfs::{BatchError, Ctx, FileSystem, FsError, FsOp, FsReply};
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

impl Ext2 {
    pub(crate) fn batch(&self, ops: &[FsOp], ctx: &Ctx) -> Result<Vec<FsReply>, BatchError> {
        let first = |e| BatchError::at(0, e);
        check_batchable(ops)?;
        if !self.mode().is_journal() {
            return Err(first(FsError::Invalid(
                "atomic batches need a journal mode (meta-journal or full-journal)",
            )));
        }
        self.check_writable().map_err(first)?;
        let _held = self.gate.batch().map_err(first)?;
        // Everything before the batch committed: the trial mount sees this state.
        self.sync_all().map_err(first)?;
        let touched = self.trial(ops, ctx)?;
        // Room in one transaction: the blocks the trial changed, with a margin for what
        // it could not see (descriptor and revoke blocks, allocations placed apart).
        let journal = self.journal_blocks.load(Relaxed) as u64;
        if touched * 2 + 16 > journal {
            return Err(BatchError::at(
                ops.len().saturating_sub(1),
                FsError::Invalid(
                    "the batch changes more blocks than the journal holds in one transaction",
                ),
            ));
        }
        // An op held open across the batch: no transaction closes in its middle.
        let outer = self.services().begin(None);
        let last = ops.len().saturating_sub(1);
        match run_in_order(self, ops, ctx) {
            Ok(replies) => match outer.end() {
                Ok(()) => Ok(replies),
                Err(e) => {
                    let e = BatchError::at(last, Self::io(e));
                    Err(self.stop(e, "its transaction could not commit"))
                }
            },
            Err(e) => {
                // The journal stops while the op still holds the transaction open: a
                // commit between the two (the timer's) would make half the batch durable.
                let e = self.stop(e, "it failed after its trial passed");
                drop(outer);
                Err(e)
            }
        }
    }

    /// A batch went wrong past the point where it could be refused: the journal stops
    /// before anything of it commits, and the mount takes no more changes.
    fn stop(&self, e: BatchError, how: &str) -> BatchError {
        let why = format!("operation {} of a batch: {} ({how})", e.index, e.error);
        tracing::error!("ext2: {why}; the journal stops, nothing of the batch is kept");
        self.services().abort_transactions(why);
        self.errored.store(true, Relaxed);
        e
    }

    /// Runs the batch on a trial mount: the image (and an external journal) under a
    /// copy-on-write overlay, the journal replayed into it, this mount's inode grants
    /// copied. Its answer is the batch's if it fails there; else the number of blocks
    /// the batch changed.
    fn trial(&self, ops: &[FsOp], ctx: &Ctx) -> Result<u64, BatchError> {
        let home: Arc<dyn BlockDevice> =
            Arc::new(OverlayDevice::new(self.engine().device().clone()));
        let journal_device = self
            .journal_device
            .as_ref()
            .map(|j| JournalDevice(Arc::new(OverlayDevice::new(j.0.clone()))));
        let opts = MountOptions {
            mode: Mode::Async,
            acl: self.acl,
            journal_device,
            journal: self.journals.clone(),
            ..MountOptions::default()
        };
        // Silent: what it would log (an image in use, a replay) is this mount's news,
        // not the batch's; what goes wrong in it comes back as the batch's answer.
        tracing::subscriber::with_default(tracing::subscriber::NoSubscriber::default(), || {
            let setup = |e: FsError| {
                BatchError::at(
                    0,
                    FsError::Io(quilt_vfs::IoError::context("the batch's trial mount", e)),
                )
            };
            let trial =
                Ext2::open(Engine::new(home, EngineOptions::default()), opts).map_err(setup)?;
            trial.lock().grants = self.read_lock().grants.clone();
            trial.sync_all().map_err(setup)?;
            run_in_order(&trial, ops, ctx)?;
            Ok(trial.engine().stats().blocks_dirty)
        })
    }
}
