//! Services every file-system module needs from below, provided once here so that ext2,
//! betrfs and the namespace service do not each grow their own (Featherstitch's modules
//! all spoke one patch language; these are the verbs they share):
//!
//! * **An operation boundary.** [`Services::begin`] opens an [`Op`] for a caller; every
//!   change the module makes for that operation goes through it, and [`Op::end`] closes
//!   it. A transaction service never splits an operation: closing a transaction waits
//!   for the operations in flight and holds new ones back meanwhile (JBD2's handles do
//!   the same). Ops nest on one thread without waiting (a nested op may not block on a
//!   close its own outer op holds up).
//! * **Membership in patchgroups.** An op carries its caller explicitly, and each change
//!   made through it joins the patchgroups that caller has engaged (the engine orders it
//!   after their tails and before their heads).
//! * **A transaction service below the module.** A journal (JBD2 today, a log-skipping
//!   journal next, a Bε-tree's redo log later) implements [`Transactions`] and is
//!   attached here; the module never holds it. The module learns whether one is attached
//!   ([`Services::transactional`]) and asks for durability in module-neutral terms.
//! * **"Make these heads durable."** [`Services::make_durable`] flushes exactly the given
//!   patches' closure, or commits the running transaction when a transaction service
//!   makes everything so far durable at once (group commit).
//! * **Patchgroup calls** ([`Services::pg_create`] …), with `pg_sync` meaning a commit
//!   under a transaction service.

use crate::engine::Engine;
use crate::graph::PatchId;
use crate::patchgroup::{CallerId, PatchgroupId};
use crate::{ChangeOpts, PatchError, Result};
use quilt_block::BlockDeviceExt;
use quilt_block::BlockNo;
use std::marker::PhantomData;
use std::sync::{Arc, RwLock};

/// Something below the file system that makes groups of changes atomic and commits them.
/// Closing a transaction must go through [`Engine::capture_rotate`], which waits for the
/// operations in flight.
pub trait Transactions: Send + Sync {
    /// Called when an operation has made all its changes: commit if the running
    /// transaction has grown past its limit.
    fn op_end(&self) -> Result<()>;
    /// Makes every change made so far durable (concurrent callers may share a commit).
    fn commit(&self) -> Result<()>;
    /// Ends the service: commit, put everything in place, leave the log empty. No change
    /// may be made through it afterwards.
    fn shutdown(&self) -> Result<()>;
    /// Stops the service without committing what is running: nothing changed since the
    /// last commit reaches the disk, and every later commit fails (a module whose memory
    /// went ahead of what it may make durable; the next mount's recovery finds the
    /// last commit).
    fn abort(&self, why: String);
    /// Counters for `quiltfs stats`, without a prefix.
    fn counters(&self) -> Vec<(&'static str, u64)>;
    /// Name of the counters' prefix ("journal").
    fn kind(&self) -> &'static str;
    /// Counters of a device of the service's own (an external journal's: a disk model's
    /// latencies), under `{kind}.device.`; none by default.
    fn device_counters(&self) -> Vec<(String, u64)> {
        Vec::new()
    }
}

struct Inner {
    engine: Engine,
    txn: RwLock<Option<Arc<dyn Transactions>>>,
}

/// The services of one engine (cheap to clone; clones share them).
#[derive(Clone)]
pub struct Services {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Services {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Services")
            .field("transactional", &self.transactional())
            .finish()
    }
}

impl Services {
    pub fn new(engine: Engine) -> Services {
        Services {
            inner: Arc::new(Inner {
                engine,
                txn: RwLock::new(None),
            }),
        }
    }

    pub fn engine(&self) -> &Engine {
        &self.inner.engine
    }

    fn txn(&self) -> Option<Arc<dyn Transactions>> {
        self.inner
            .txn
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Puts a transaction service under every operation from now on. Refused if one is
    /// attached already.
    pub fn attach(&self, txn: Arc<dyn Transactions>) -> Result<()> {
        let mut slot = self.inner.txn.write().unwrap_or_else(|e| e.into_inner());
        if slot.is_some() {
            return Err(PatchError::Invalid(
                "a transaction service is attached already",
            ));
        }
        *slot = Some(txn);
        Ok(())
    }

    /// Is a transaction service attached? Then each operation is atomic by itself and a
    /// module need not order its changes across blocks for consistency.
    pub fn transactional(&self) -> bool {
        self.txn().is_some()
    }

    /// Opens an operation for `caller` (None: on no process's behalf). Waits while a
    /// transaction is being closed, unless this thread already has an op open.
    pub fn begin(&self, caller: Option<CallerId>) -> Op<'_> {
        self.inner.engine.op_enter();
        Op {
            svc: self,
            caller,
            ended: false,
            _not_send: PhantomData,
        }
    }

    /// Makes `heads` and everything they depend on durable: a commit under a transaction
    /// service (it covers every change so far), else a flush of exactly their closure.
    /// Must not be called with an op open on this thread (a commit waits for ops).
    pub fn make_durable(&self, heads: &[PatchId]) -> Result<()> {
        if let Some(t) = self.txn() {
            return t.commit();
        }
        let e = &self.inner.engine;
        match heads {
            [] => Ok(()),
            [one] => e.flush_until(*one),
            many => {
                let join = e.empty(many);
                e.flush_until(join)
            }
        }
    }

    /// Makes every change so far durable.
    /// Stops the transaction service without committing what is running (see
    /// [`Transactions::abort`]); false when there is none.
    pub fn abort_transactions(&self, why: String) -> bool {
        match self.txn() {
            Some(t) => {
                t.abort(why);
                true
            }
            None => false,
        }
    }

    pub fn sync(&self) -> Result<()> {
        if let Some(t) = self.txn() {
            return t.commit();
        }
        self.inner.engine.sync()
    }

    /// Ends the transaction service (if any): it commits and checkpoints everything and
    /// leaves its log empty. Later changes go to the engine alone. Then syncs.
    pub fn shutdown(&self) -> Result<()> {
        let t = self
            .inner
            .txn
            .write()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(t) = t {
            t.shutdown()?;
        }
        self.inner.engine.sync()
    }

    /// Counters of the engine (`patch.`), the transaction service and the device.
    pub fn counters(&self) -> Vec<(String, u64)> {
        let e = &self.inner.engine;
        let mut v: Vec<(String, u64)> = e
            .stats()
            .fields()
            .into_iter()
            .map(|(k, val)| (format!("patch.{k}"), val))
            .collect();
        if let Some(t) = self.txn() {
            let kind = t.kind();
            v.extend(
                t.counters()
                    .into_iter()
                    .map(|(k, val)| (format!("{kind}.{k}"), val)),
            );
            v.extend(
                t.device_counters()
                    .into_iter()
                    .map(|(k, val)| (format!("{kind}.device.{k}"), val)),
            );
        }
        v.extend(
            e.device()
                .stats()
                .fields()
                .into_iter()
                .map(|(k, val)| (format!("device.{k}"), val)),
        );
        v.extend(
            e.device()
                .extra_stats()
                .into_iter()
                .map(|(k, val)| (format!("device.{k}"), val)),
        );
        v
    }

    // Patchgroups: the engine keeps them; these are the calls a module's users make.

    pub fn pg_create(&self) -> PatchgroupId {
        self.inner.engine.pg_create()
    }
    pub fn pg_depend(&self, after: PatchgroupId, before: PatchgroupId) -> Result<()> {
        self.inner.engine.pg_add_depend(after, before)
    }
    pub fn pg_release(&self, pg: PatchgroupId) -> Result<()> {
        self.inner.engine.pg_release(pg)
    }
    pub fn pg_engage(&self, pg: PatchgroupId, caller: CallerId) -> Result<()> {
        self.inner.engine.pg_engage(pg, caller)
    }
    pub fn pg_disengage(&self, pg: PatchgroupId, caller: CallerId) -> Result<()> {
        self.inner.engine.pg_disengage(pg, caller)
    }
    /// Waits until the group's changes, and those of every group before it, are
    /// durable. Under a transaction service that is a commit: groups' changes are made
    /// in order, so the log holds them in order.
    pub fn pg_sync(&self, pg: PatchgroupId) -> Result<()> {
        match self.txn() {
            Some(t) => {
                self.inner.engine.pg_exists(pg)?;
                t.commit()?;
                self.inner.engine.mark(&format!("pg-sync {}", pg.0));
                Ok(())
            }
            None => self.inner.engine.pg_sync(pg),
        }
    }
    pub fn pg_abandon(&self, pg: PatchgroupId) -> Result<()> {
        self.inner.engine.pg_abandon(pg)
    }
    pub fn pg_inherit(&self, parent: CallerId, child: CallerId) {
        self.inner.engine.pg_inherit(parent, child)
    }
    pub fn pg_forget_caller(&self, caller: CallerId) {
        self.inner.engine.pg_forget_caller(caller)
    }
}

/// One operation of a module, made for one caller. Every change goes through it, so the
/// caller's patchgroups order it and no transaction closes in its middle. Not `Send`:
/// the nesting count is per thread.
pub struct Op<'s> {
    svc: &'s Services,
    caller: Option<CallerId>,
    ended: bool,
    _not_send: PhantomData<*const ()>,
}

impl std::fmt::Debug for Op<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Op").field("caller", &self.caller).finish()
    }
}

impl<'s> Op<'s> {
    pub fn caller(&self) -> Option<CallerId> {
        self.caller
    }
    pub fn services(&self) -> &'s Services {
        self.svc
    }
    pub fn engine(&self) -> &'s Engine {
        &self.svc.inner.engine
    }

    fn opts(&self, data: bool) -> ChangeOpts {
        ChangeOpts {
            caller: self.caller,
            data,
        }
    }

    /// [`Engine::write`] for this operation's caller; `data`: file data, not metadata.
    pub fn write(
        &self,
        block: BlockNo,
        offset: usize,
        bytes: &[u8],
        befores: &[PatchId],
        data: bool,
    ) -> Result<PatchId> {
        self.engine()
            .write(block, offset, bytes, befores, self.opts(data))
    }

    /// [`Engine::write_run`] for this operation's caller.
    pub fn write_run(
        &self,
        first: BlockNo,
        data: &[u8],
        befores: &[PatchId],
        is_data: bool,
    ) -> Result<Vec<PatchId>> {
        self.engine()
            .write_run(first, data, befores, self.opts(is_data))
    }

    /// [`Engine::zero_block`] for this operation's caller.
    pub fn zero_block(&self, block: BlockNo, befores: &[PatchId], data: bool) -> Result<PatchId> {
        self.engine().zero_block(block, befores, self.opts(data))
    }

    /// [`Engine::xor_bits`] for this operation's caller (metadata).
    pub fn xor_bits(
        &self,
        block: BlockNo,
        offset: usize,
        xor: u32,
        befores: &[PatchId],
    ) -> Result<PatchId> {
        self.engine()
            .xor_bits(block, offset, xor, befores, self.opts(false))
    }

    /// An empty patch joining `befores`.
    pub fn empty(&self, befores: &[PatchId]) -> PatchId {
        self.engine().empty(befores)
    }

    /// The operation boundary: its changes are all made. A transaction service may now
    /// commit (if its running transaction is full), unless this op is nested in another
    /// on the thread (the outer one's end does that).
    pub fn end(mut self) -> Result<()> {
        self.ended = true;
        if !self.svc.inner.engine.op_leave() {
            return Ok(());
        }
        // Write-back that a change inside the op found due, now that the module's
        // locks are released.
        self.svc.inner.engine.throttle_due()?;
        match self.svc.txn() {
            Some(t) => t.op_end(),
            None => Ok(()),
        }
    }
}

impl Drop for Op<'_> {
    /// An op dropped without `end` (an early error return) still leaves the boundary,
    /// so a transaction waiting to close is not held up forever.
    fn drop(&mut self) {
        if !self.ended && self.svc.inner.engine.op_leave() {
            // An error here is the engine's failure, which it keeps and reports.
            let _ = self.svc.inner.engine.throttle_due();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::EngineOptions;
    use quilt_block::MemDevice;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
    use std::time::Duration;

    fn services() -> Services {
        Services::new(Engine::new(
            Arc::new(MemDevice::new(512, 64).unwrap()),
            EngineOptions::default(),
        ))
    }

    /// A transaction service that closes a capture on each commit and records which
    /// blocks each transaction held.
    struct Recorder {
        engine: Engine,
        txns: std::sync::Mutex<Vec<Vec<BlockNo>>>,
        ends: AtomicU64,
    }
    impl Transactions for Recorder {
        fn op_end(&self) -> Result<()> {
            self.ends.fetch_add(1, SeqCst);
            Ok(())
        }
        fn commit(&self) -> Result<()> {
            if let Some(t) = self.engine.capture_rotate(true)? {
                let blocks = t.blocks.iter().map(|(b, _)| *b).collect();
                self.txns.lock().unwrap().push(blocks);
                self.engine.release_hold(t.hold);
            }
            Ok(())
        }
        fn abort(&self, _why: String) {}
        fn shutdown(&self) -> Result<()> {
            self.commit()?;
            if let Some(t) = self.engine.capture_rotate(false)? {
                self.engine.release_hold(t.hold);
            }
            Ok(())
        }
        fn counters(&self) -> Vec<(&'static str, u64)> {
            vec![("transactions", self.txns.lock().unwrap().len() as u64)]
        }
        fn kind(&self) -> &'static str {
            "recorder"
        }
    }

    #[test]
    fn a_commit_never_splits_an_operation() {
        let svc = services();
        let e = svc.engine().clone();
        e.capture_start(false).unwrap();
        let rec = Arc::new(Recorder {
            engine: e.clone(),
            txns: Default::default(),
            ends: AtomicU64::new(0),
        });
        svc.attach(rec.clone()).unwrap();
        let first_made = Arc::new(AtomicBool::new(false));
        std::thread::scope(|s| {
            let op = svc.begin(Some(1));
            op.write(1, 0, &[1], &[], false).unwrap();
            first_made.store(true, SeqCst);
            // A commit from another thread must wait until this op ends.
            let committer = s.spawn(|| {
                while !first_made.load(SeqCst) {
                    std::thread::yield_now();
                }
                svc.sync().unwrap();
            });
            std::thread::sleep(Duration::from_millis(50));
            op.write(2, 0, &[2], &[], false).unwrap();
            op.end().unwrap();
            committer.join().unwrap();
        });
        let txns = rec.txns.lock().unwrap().clone();
        assert_eq!(
            txns,
            vec![vec![1, 2]],
            "both changes of the op in one transaction"
        );
        assert_eq!(rec.ends.load(SeqCst), 1);
        svc.shutdown().unwrap();
        assert!(!svc.transactional());
    }

    #[test]
    fn an_op_dropped_on_an_error_path_does_not_hold_up_a_commit() {
        let svc = services();
        let e = svc.engine().clone();
        e.capture_start(false).unwrap();
        let rec = Arc::new(Recorder {
            engine: e.clone(),
            txns: Default::default(),
            ends: AtomicU64::new(0),
        });
        svc.attach(rec.clone()).unwrap();
        {
            let op = svc.begin(None);
            op.write(3, 0, &[3], &[], false).unwrap();
            // dropped without end
        }
        svc.sync().unwrap();
        assert_eq!(rec.txns.lock().unwrap().len(), 1);
        assert_eq!(rec.ends.load(SeqCst), 0, "op_end runs only at end()");
        svc.shutdown().unwrap();
    }

    #[test]
    fn nested_ops_on_one_thread_do_not_wait_for_a_closing_transaction() {
        let svc = services();
        let e = svc.engine().clone();
        e.capture_start(false).unwrap();
        let rec = Arc::new(Recorder {
            engine: e.clone(),
            txns: Default::default(),
            ends: AtomicU64::new(0),
        });
        svc.attach(rec.clone()).unwrap();
        std::thread::scope(|s| {
            let outer = svc.begin(None);
            outer.write(4, 0, &[4], &[], false).unwrap();
            let committer = s.spawn(|| svc.sync().unwrap());
            // Let the committer start closing (it waits for `outer`).
            std::thread::sleep(Duration::from_millis(50));
            let inner = svc.begin(None);
            inner.write(5, 0, &[5], &[], false).unwrap();
            drop(inner);
            outer.end().unwrap();
            committer.join().unwrap();
        });
        assert_eq!(rec.txns.lock().unwrap().clone(), vec![vec![4, 5]]);
        svc.shutdown().unwrap();
    }

    #[test]
    fn make_durable_flushes_only_the_heads_closure_without_a_transaction_service() {
        let svc = services();
        let op = svc.begin(Some(9));
        let a = op.write(1, 0, &[1], &[], false).unwrap();
        let b = op.write(2, 0, &[2], &[a], false).unwrap();
        let other = op.write(3, 0, &[3], &[], false).unwrap();
        op.end().unwrap();
        svc.make_durable(&[b]).unwrap();
        let e = svc.engine();
        assert!(e.is_durable(a) && e.is_durable(b));
        assert!(!e.is_durable(other), "outside the closure: not written");
        let names: Vec<String> = svc.counters().into_iter().map(|(k, _)| k).collect();
        assert!(names.iter().any(|k| k == "patch.patches_created"));
        assert!(names.iter().any(|k| k.starts_with("device.")));
    }

    #[test]
    fn an_ops_changes_join_its_callers_groups() {
        let svc = services();
        let pg = svc.pg_create();
        svc.pg_release(pg).unwrap();
        svc.pg_engage(pg, 42).unwrap();
        let op = svc.begin(Some(42));
        op.write(6, 0, &[6], &[], false).unwrap();
        op.end().unwrap();
        svc.pg_disengage(pg, 42).unwrap();
        svc.pg_sync(pg).unwrap();
        let mut b = vec![0u8; 512];
        svc.engine().device().read(6, &mut b).unwrap();
        assert_eq!(b[0], 6, "syncing the group wrote the op's change");
    }
}
