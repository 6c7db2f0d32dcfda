//! Atomic batches: many operations applied as one step ([`FileSystem::apply_batch`]).
//!
//! What a module promises for a batch:
//! - the operations run in order, each seeing the ones before it, and no other change
//!   runs between them (writers wait at the module's [`Gate`]; readers may see a batch
//!   in progress);
//! - all of them take effect or none does: on an operation's failure the module is as
//!   it was before the batch, and the answer names the operation ([`BatchError`]);
//! - on disk they are one unit, so a crash leaves all of the batch or none of it;
//! - a batch holds only operations that change names and attributes, and reads
//!   ([`FsOp::batchable`]); file data, fsync and size changes go on their own.
//!
//! How each module keeps the promise is its own: betrfs logs the batch as one record of
//! its tree and rolls its memory back on a failure; ext2 (journal modes only) tries the
//! batch first on a copy-on-write view of its image, then applies it inside one journal
//! transaction. A batch is bounded by what one record or one transaction can hold.
//!
//! [`FileSystem::apply_batch`]: crate::FileSystem::apply_batch

use crate::{Ctx, FileSystem, FsError, FsOp, FsReply};
use std::cell::{Cell, RefCell};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Why a batch was refused: the operation at `index` (of the batch) failed with
/// `error`, and nothing of the batch took effect.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("operation {index} of the batch: {error}")]
pub struct BatchError {
    pub index: usize,
    pub error: FsError,
}

impl BatchError {
    pub fn at(index: usize, error: FsError) -> BatchError {
        BatchError { index, error }
    }
}

impl FsOp {
    /// Whether the operation may be part of an atomic batch: a change of names or
    /// attributes (not of a file's size), or a read.
    pub fn batchable(&self) -> bool {
        match self {
            FsOp::Setattr { set, .. } => set.size.is_none(),
            FsOp::Write { .. }
            | FsOp::Fallocate { .. }
            | FsOp::Fsync { .. }
            | FsOp::SyncAll
            | FsOp::Read { .. } => false,
            _ => true,
        }
    }
}

/// Refuses a batch holding an operation that may not be in one.
pub fn check_batchable(ops: &[FsOp]) -> Result<(), BatchError> {
    match ops.iter().position(|op| !op.batchable()) {
        Some(i) => Err(BatchError::at(
            i,
            FsError::Invalid(
                "this operation cannot be part of an atomic batch (file data, sizes, fsync)",
            ),
        )),
        None => Ok(()),
    }
}

/// Runs `ops` on `fs` in order, as a module runs a batch it has opened: the replies, or
/// the first failure and its index (what ran before it is the module's to undo).
pub fn run_in_order(
    fs: &(impl FileSystem + ?Sized),
    ops: &[FsOp],
    ctx: &Ctx,
) -> Result<Vec<FsReply>, BatchError> {
    let mut out = Vec::with_capacity(ops.len());
    for (i, op) in ops.iter().enumerate() {
        out.push(op.apply(fs, ctx).map_err(|e| BatchError::at(i, e))?);
    }
    Ok(out)
}

thread_local! {
    /// The gate this thread holds exclusively (its address), if any: the batch's own
    /// operations pass it.
    static HELD: Cell<usize> = const { Cell::new(0) };
    /// The gates this thread is passing (their addresses, once per pass): a change
    /// nested in another on the same thread passes again without taking the lock,
    /// which would wait behind a batch waiting for the outer pass (the lock prefers
    /// writers), and so forever.
    static PASSING: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
}

/// Where a module's changes wait while a batch runs: every change passes it shared
/// ([`Gate::pass`]), a batch holds it alone ([`Gate::batch`]), and the thread running
/// the batch passes its own gate freely.
#[derive(Default, Debug)]
pub struct Gate {
    lock: RwLock<()>,
}

/// A change passing the gate (no guard: the thread's own batch holds it, or the thread
/// passes it already).
pub struct Passing<'a> {
    /// Held for its drop (the read side of the gate).
    #[allow(dead_code)]
    guard: Option<RwLockReadGuard<'a, ()>>,
    id: usize,
}

impl Drop for Passing<'_> {
    fn drop(&mut self) {
        PASSING.with(|p| {
            let mut p = p.borrow_mut();
            if let Some(i) = p.iter().rposition(|&g| g == self.id) {
                p.swap_remove(i);
            }
        });
    }
}

/// A batch holding the gate.
pub struct Holding<'a> {
    _guard: RwLockWriteGuard<'a, ()>,
    id: usize,
}

impl Gate {
    fn id(&self) -> usize {
        self as *const Gate as usize
    }

    /// Lets a change through, after any batch in progress on another thread.
    pub fn pass(&self) -> Passing<'_> {
        let id = self.id();
        let nested = HELD.with(|h| h.get()) == id || PASSING.with(|p| p.borrow().contains(&id));
        let guard = if nested {
            None
        } else {
            Some(self.lock.read().unwrap_or_else(|e| e.into_inner()))
        };
        PASSING.with(|p| p.borrow_mut().push(id));
        Passing { guard, id }
    }

    /// Holds the gate for a batch: waits for the changes in progress, and keeps new ones
    /// out until the holding ends, except this thread's own.
    pub fn batch(&self) -> Result<Holding<'_>, FsError> {
        if HELD.with(|h| h.get()) != 0 {
            return Err(FsError::Invalid("a batch inside a batch"));
        }
        if PASSING.with(|p| p.borrow().contains(&self.id())) {
            // It would wait for this thread's own change.
            return Err(FsError::Invalid("a batch inside a change"));
        }
        let guard = self.lock.write().unwrap_or_else(|e| e.into_inner());
        HELD.with(|h| h.set(self.id()));
        Ok(Holding {
            _guard: guard,
            id: self.id(),
        })
    }
}

impl Drop for Holding<'_> {
    fn drop(&mut self) {
        HELD.with(|h| {
            if h.get() == self.id {
                h.set(0)
            }
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_batch_passes_its_own_gate_and_holds_others_back() {
        let gate = Arc::new(Gate::default());
        let h = gate.batch().unwrap();
        // The batch's own changes pass (they would wait for themselves otherwise).
        drop(gate.pass());
        assert!(gate.batch().is_err(), "no batch inside a batch");
        let passed = Arc::new(AtomicBool::new(false));
        let t = {
            let (gate, passed) = (gate.clone(), passed.clone());
            std::thread::spawn(move || {
                let _p = gate.pass();
                passed.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!passed.load(Ordering::SeqCst), "another thread waits");
        drop(h);
        t.join().unwrap();
        assert!(passed.load(Ordering::SeqCst));
        // Held no more: this thread waits like any other again.
        let p = gate.pass();
        assert!(p.guard.is_some());
    }

    #[test]
    fn a_change_nested_in_another_passes_while_a_batch_waits() {
        let gate = Arc::new(Gate::default());
        let outer = gate.pass();
        // A batch on another thread waits for the outer change...
        let batched = Arc::new(AtomicBool::new(false));
        let t = {
            let (gate, batched) = (gate.clone(), batched.clone());
            std::thread::spawn(move || {
                let _h = gate.batch().unwrap();
                batched.store(true, Ordering::SeqCst);
            })
        };
        std::thread::sleep(Duration::from_millis(50));
        // ...and a change nested in it passes all the same (the lock would make it wait
        // behind the batch, which waits for it).
        let inner = gate.pass();
        assert!(inner.guard.is_none());
        assert!(gate.batch().is_err(), "no batch inside a change");
        drop(inner);
        assert!(!batched.load(Ordering::SeqCst));
        drop(outer);
        t.join().unwrap();
        assert!(batched.load(Ordering::SeqCst));
    }

    #[test]
    fn only_name_and_attribute_changes_and_reads_are_batchable() {
        let ok = FsOp::Mkdir {
            parent: 1,
            name: b"d".to_vec(),
            mode: 0o755,
            ino: None,
        };
        let data = FsOp::Write {
            ino: 2,
            offset: 0,
            data: vec![1],
        };
        let size = FsOp::Setattr {
            ino: 2,
            set: crate::SetAttr {
                size: Some(0),
                ..Default::default()
            },
        };
        assert!(ok.batchable() && !data.batchable() && !size.batchable());
        assert_eq!(check_batchable(&[ok.clone(), size]).unwrap_err().index, 1);
        assert!(check_batchable(&[ok]).is_ok());
    }
}
