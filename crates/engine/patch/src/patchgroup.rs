//! Patchgroups: application-defined write ordering (Featherstitch §patchgroups).
//!
//! A group has two held empty patches. Its *tail* is what its changes wait for: the heads
//! of the groups it depends on, and (until release) a hold. Its *head* waits for every
//! change made while the group is engaged; groups that depend on this one wait for it.
//!
//! The rules that keep groups acyclic (as in the original):
//! * dependencies are added to a group only before it is released (`add_depend(Q, P)` needs
//!   Q unreleased), and never from a group that already has afters;
//! * a group must be released before it is engaged, and a group with afters is never
//!   engaged again;
//! * `add_depend(Q, P)` is refused while P is engaged anywhere (P's head must be final).
//!
//! Q's changes are made after its release, so they can only follow P's, never precede them.

use crate::engine::{Engine, State};
use crate::graph::PatchId;
use crate::libc_errno;
use crate::Result;
use rustc_hash::FxHashMap as HashMap;

/// A patchgroup handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct PatchgroupId(pub u64);

/// Who makes a change (through FUSE: the requesting process id).
pub type CallerId = u64;

/// A violated patchgroup rule.
#[non_exhaustive]
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PatchgroupError {
    #[error("patchgroup {0} does not exist")]
    NoSuchGroup(u64),
    #[error("patchgroup {0} cannot depend on itself")]
    SelfDependency(u64),
    #[error("patchgroup {0} is released: it can take no new dependencies")]
    AfterReleased(u64),
    #[error(
        "patchgroup {0} is engaged: a group cannot depend on it until it is disengaged everywhere"
    )]
    BeforeEngaged(u64),
    #[error("patchgroup {0} must be released before it is engaged")]
    NotReleased(u64),
    #[error("patchgroup {0} already has groups depending on it: it cannot be engaged again")]
    HasAfters(u64),
    #[error("patchgroup {0} is already engaged by caller {1}")]
    AlreadyEngaged(u64, CallerId),
    #[error("patchgroup {0} is not engaged by caller {1}")]
    NotEngaged(u64, CallerId),
    #[error("patchgroup {0} is already released")]
    AlreadyReleased(u64),
}

impl PatchgroupError {
    pub fn errno(&self) -> i32 {
        match self {
            PatchgroupError::NoSuchGroup(_) => libc_errno::ENOENT,
            PatchgroupError::BeforeEngaged(_) => libc_errno::EBUSY,
            PatchgroupError::AlreadyEngaged(..) => libc_errno::EEXIST,
            _ => libc_errno::EINVAL,
        }
    }
}

#[derive(Debug)]
pub(crate) struct Group {
    tail: PatchId,
    head: PatchId,
    released: bool,
    has_afters: bool,
    engaged_by: Vec<CallerId>,
}

#[derive(Debug, Default)]
pub(crate) struct Patchgroups {
    next: u64,
    groups: HashMap<u64, Group>,
    /// Groups engaged by each caller, in engagement order.
    scopes: HashMap<CallerId, Vec<u64>>,
}

impl Patchgroups {
    pub fn engaged_tails(&self, c: CallerId) -> Vec<PatchId> {
        self.scope(c).map(|g| g.tail).collect()
    }
    pub fn is_engaged(&self, c: CallerId) -> bool {
        self.scopes.contains_key(&c)
    }
    pub fn engaged_heads(&self, c: CallerId) -> Vec<PatchId> {
        self.scope(c).map(|g| g.head).collect()
    }
    fn scope(&self, c: CallerId) -> impl Iterator<Item = &Group> {
        self.scopes
            .get(&c)
            .into_iter()
            .flatten()
            .filter_map(|id| self.groups.get(id))
    }

    /// Removes `caller`'s engagement of group `id` on both sides.
    fn disengage(&mut self, id: u64, caller: CallerId) {
        if let Some(g) = self.groups.get_mut(&id) {
            g.engaged_by.retain(|&c| c != caller);
        }
        if let Some(scope) = self.scopes.get_mut(&caller) {
            scope.retain(|&x| x != id);
            if scope.is_empty() {
                self.scopes.remove(&caller);
            }
        }
    }

    fn group(&self, id: PatchgroupId) -> Result<&Group, PatchgroupError> {
        self.groups
            .get(&id.0)
            .ok_or(PatchgroupError::NoSuchGroup(id.0))
    }
}

impl State {
    fn pg_disengage_all(&mut self, id: u64) {
        let callers = self
            .pgs
            .groups
            .get(&id)
            .map(|g| g.engaged_by.clone())
            .unwrap_or_default();
        for c in callers {
            self.pgs.disengage(id, c);
        }
    }
}

impl Engine {
    /// Creates a patchgroup (unreleased, not engaged).
    pub fn pg_create(&self) -> PatchgroupId {
        let mut st = self.lock();
        let tail = st.new_empty(&[], 1);
        let head = st.new_empty(&[], 1);
        st.pgs.next += 1;
        let id = st.pgs.next;
        st.pgs.groups.insert(
            id,
            Group {
                tail,
                head,
                released: false,
                has_afters: false,
                engaged_by: Vec::new(),
            },
        );
        PatchgroupId(id)
    }

    /// Makes group `after`'s changes wait for group `before`'s.
    pub fn pg_add_depend(&self, after: PatchgroupId, before: PatchgroupId) -> Result<()> {
        let mut st = self.lock();
        if after == before {
            return Err(PatchgroupError::SelfDependency(after.0).into());
        }
        let a = st.pgs.group(after)?;
        let b = st.pgs.group(before)?;
        if a.released {
            return Err(PatchgroupError::AfterReleased(after.0).into());
        }
        if !b.engaged_by.is_empty() {
            return Err(PatchgroupError::BeforeEngaged(before.0).into());
        }
        let (tail, head) = (a.tail, b.head);
        let first_after = !b.has_afters;
        st.pgs
            .groups
            .get_mut(&before.0)
            .expect("checked")
            .has_afters = true;
        if let (Some(t), Some(h)) = (st.g.resolve(tail), st.g.resolve(head)) {
            st.add_edge(t, h);
        }
        if first_after {
            // `before` can never be engaged again, so its head's befores are final and it
            // may become durable once they are.
            st.unhold(head);
        }
        st.debug_check();
        Ok(())
    }

    /// From now on, changes made by `caller` join group `pg`.
    pub fn pg_engage(&self, pg: PatchgroupId, caller: CallerId) -> Result<()> {
        let mut st = self.lock();
        let g = st.pgs.group(pg)?;
        if !g.released {
            return Err(PatchgroupError::NotReleased(pg.0).into());
        }
        if g.has_afters {
            return Err(PatchgroupError::HasAfters(pg.0).into());
        }
        if g.engaged_by.contains(&caller) {
            return Err(PatchgroupError::AlreadyEngaged(pg.0, caller).into());
        }
        st.pgs
            .groups
            .get_mut(&pg.0)
            .expect("checked")
            .engaged_by
            .push(caller);
        st.pgs.scopes.entry(caller).or_default().push(pg.0);
        Ok(())
    }

    pub fn pg_disengage(&self, pg: PatchgroupId, caller: CallerId) -> Result<()> {
        let mut st = self.lock();
        let g = st.pgs.group(pg)?;
        if !g.engaged_by.contains(&caller) {
            return Err(PatchgroupError::NotEngaged(pg.0, caller).into());
        }
        st.pgs.disengage(pg.0, caller);
        Ok(())
    }

    /// No more dependencies may be added to `pg`; its changes may now reach the disk once
    /// the groups it depends on have.
    pub fn pg_release(&self, pg: PatchgroupId) -> Result<()> {
        let mut st = self.lock();
        let g = st.pgs.group(pg)?;
        if g.released {
            return Err(PatchgroupError::AlreadyReleased(pg.0).into());
        }
        let tail = g.tail;
        st.pgs.groups.get_mut(&pg.0).expect("checked").released = true;
        st.unhold(tail);
        Ok(())
    }

    /// Fails with `NoSuchGroup` unless `pg` exists.
    pub fn pg_exists(&self, pg: PatchgroupId) -> Result<()> {
        self.lock().pgs.group(pg)?;
        Ok(())
    }

    /// Waits until every change in `pg` (and so everything it depends on) is durable.
    pub fn pg_sync(&self, pg: PatchgroupId) -> Result<()> {
        let (head, tail, released) = {
            let st = self.lock();
            let g = st.pgs.group(pg)?;
            (g.head, g.tail, g.released)
        };
        // The head waits for the group's changes; the groups before it are reached
        // through the tail (an empty group's head has no befores at all). An unreleased
        // group's tail is held: it can take no changes yet, and what it will depend on
        // is not settled, so only its head is synced.
        if released {
            self.flush_until(tail)?;
        }
        self.flush_until(head)?;
        self.mark(&format!("pg-sync {}", pg.0));
        Ok(())
    }

    /// Drops the handle. The group's changes keep their order; the group can take no more
    /// afters and is disengaged everywhere. An unreleased group is released first (it has
    /// no changes, since only released groups can be engaged).
    pub fn pg_abandon(&self, pg: PatchgroupId) -> Result<()> {
        let mut st = self.lock();
        let g = st.pgs.group(pg)?;
        let (tail, head, released, has_afters) = (g.tail, g.head, g.released, g.has_afters);
        st.pg_disengage_all(pg.0);
        st.pgs.groups.remove(&pg.0);
        if !released {
            st.unhold(tail);
        }
        if !has_afters {
            st.unhold(head);
        }
        st.debug_check();
        Ok(())
    }

    /// Copies `parent`'s engaged groups to `child` (fork).
    pub fn pg_inherit(&self, parent: CallerId, child: CallerId) {
        let mut st = self.lock();
        let groups: Vec<u64> = st.pgs.scopes.get(&parent).cloned().unwrap_or_default();
        for id in groups {
            if let Some(g) = st.pgs.groups.get_mut(&id) {
                if !g.engaged_by.contains(&child) {
                    g.engaged_by.push(child);
                    st.pgs.scopes.entry(child).or_default().push(id);
                }
            }
        }
    }

    /// Disengages everything `caller` had engaged (the process exited).
    pub fn pg_forget_caller(&self, caller: CallerId) {
        let mut st = self.lock();
        for id in st.pgs.scopes.remove(&caller).unwrap_or_default() {
            if let Some(g) = st.pgs.groups.get_mut(&id) {
                g.engaged_by.retain(|&c| c != caller);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ChangeOpts, EngineOptions, PatchError};
    use quilt_block::{BlockDevice, MemDevice};
    use std::sync::Arc;

    fn engine() -> (Engine, Arc<MemDevice>) {
        let dev = Arc::new(MemDevice::new(512, 16).unwrap());
        (Engine::new(dev.clone(), EngineOptions::default()), dev)
    }

    fn on_disk(dev: &MemDevice, block: u64) -> u8 {
        let mut b = vec![0; 512];
        dev.read(block, &mut b).unwrap();
        b[0]
    }

    fn pg_err(r: Result<()>) -> PatchgroupError {
        match r {
            Err(PatchError::Patchgroup(e)) => e,
            other => panic!("expected a patchgroup error, got {other:?}"),
        }
    }

    #[test]
    fn each_rule_violation_has_its_own_error() {
        let (e, _) = engine();
        let p = e.pg_create();
        let q = e.pg_create();
        assert_eq!(
            pg_err(e.pg_add_depend(p, p)),
            PatchgroupError::SelfDependency(p.0)
        );
        assert_eq!(pg_err(e.pg_engage(p, 1)), PatchgroupError::NotReleased(p.0));
        e.pg_release(p).unwrap();
        assert_eq!(
            pg_err(e.pg_release(p)),
            PatchgroupError::AlreadyReleased(p.0)
        );
        assert_eq!(
            pg_err(e.pg_add_depend(p, q)),
            PatchgroupError::AfterReleased(p.0)
        );
        e.pg_engage(p, 1).unwrap();
        assert_eq!(
            pg_err(e.pg_engage(p, 1)),
            PatchgroupError::AlreadyEngaged(p.0, 1)
        );
        assert_eq!(
            pg_err(e.pg_add_depend(q, p)),
            PatchgroupError::BeforeEngaged(p.0)
        );
        assert_eq!(
            pg_err(e.pg_disengage(p, 2)),
            PatchgroupError::NotEngaged(p.0, 2)
        );
        e.pg_disengage(p, 1).unwrap();
        e.pg_add_depend(q, p).unwrap();
        assert_eq!(pg_err(e.pg_engage(p, 1)), PatchgroupError::HasAfters(p.0));
        assert_eq!(
            pg_err(e.pg_sync(PatchgroupId(99))),
            PatchgroupError::NoSuchGroup(99)
        );
        assert_eq!(PatchgroupError::BeforeEngaged(1).errno(), 16);
    }

    #[test]
    fn changes_of_a_dependent_group_reach_disk_only_after_the_groups_before_it() {
        let (e, dev) = engine();
        let p = e.pg_create();
        let q = e.pg_create();
        e.pg_add_depend(q, p).unwrap();
        e.pg_release(p).unwrap();
        e.pg_release(q).unwrap();
        let me = ChangeOpts {
            caller: Some(7),
            data: false,
        };
        // Q's change is made first but must wait for P's.
        e.pg_engage(q, 7).unwrap();
        e.write(2, 0, &[2], &[], me).unwrap();
        e.pg_disengage(q, 7).unwrap();
        // P has afters, so it can never be engaged: its head is final (and empty), and
        // Q's change may go at once.
        e.pg_engage(p, 7).unwrap_err();
        e.write_back_ready().unwrap();
        assert_eq!(
            on_disk(&dev, 2),
            2,
            "P has no changes and can take none: Q is free"
        );

        // Now a chain where P does have changes.
        let p = e.pg_create();
        let q = e.pg_create();
        e.pg_release(p).unwrap();
        e.pg_engage(p, 7).unwrap();
        let pa = e.write(3, 0, &[3], &[], me).unwrap();
        e.pg_disengage(p, 7).unwrap();
        e.pg_add_depend(q, p).unwrap();
        e.pg_release(q).unwrap();
        e.pg_engage(q, 7).unwrap();
        let qa = e.write(4, 0, &[4], &[], me).unwrap();
        e.pg_disengage(q, 7).unwrap();
        // One epoch writes P's block only; Q's waits for the flush.
        let r = e.epoch().unwrap();
        assert_eq!(r.blocks_written, 1);
        assert!(e.is_durable(pa) && !e.is_durable(qa));
        assert_eq!((on_disk(&dev, 3), on_disk(&dev, 4)), (3, 0));
        e.pg_sync(q).unwrap();
        assert_eq!(on_disk(&dev, 4), 4);
        e.pg_abandon(p).unwrap();
        e.pg_abandon(q).unwrap();
        e.sync().unwrap();
        e.check_invariants().unwrap();
    }

    #[test]
    fn changes_wait_for_an_unreleased_before_group_and_sync_says_pinned() {
        let (e, dev) = engine();
        let p = e.pg_create(); // never released, never engaged
        let q = e.pg_create();
        e.pg_add_depend(q, p).unwrap();
        e.pg_release(q).unwrap();
        e.pg_engage(q, 1).unwrap();
        let c = ChangeOpts {
            caller: Some(1),
            data: false,
        };
        let w = e.write(5, 0, &[5], &[], c).unwrap();
        // P has afters, so its head is final (empty): Q is not pinned by it.
        e.flush_until(w).unwrap();
        assert_eq!(on_disk(&dev, 5), 5);
        // A patch waiting for an unreleased group's tail cannot be written.
        let r = e.pg_create();
        let s = e.pg_create();
        e.pg_release(s).unwrap();
        e.pg_add_depend(r, s).unwrap();
        let tail = e.lock().pgs.group(r).unwrap().tail;
        let x = e.write(6, 0, &[6], &[tail], ChangeOpts::default()).unwrap();
        assert!(matches!(e.flush_until(x), Err(PatchError::Pinned)));
        assert!(matches!(e.sync(), Err(PatchError::Pinned)));
        assert_eq!(on_disk(&dev, 6), 0);
        e.pg_release(r).unwrap();
        e.sync().unwrap();
        assert_eq!(on_disk(&dev, 6), 6);
    }

    #[test]
    fn sync_of_an_empty_group_makes_the_groups_before_it_durable() {
        let (e, dev) = engine();
        let me = ChangeOpts {
            caller: Some(3),
            data: false,
        };
        let p = e.pg_create();
        e.pg_release(p).unwrap();
        e.pg_engage(p, 3).unwrap();
        e.write(7, 0, &[7], &[], me).unwrap();
        e.pg_disengage(p, 3).unwrap();
        let q = e.pg_create();
        e.pg_add_depend(q, p).unwrap();
        e.pg_release(q).unwrap();
        e.pg_engage(q, 3).unwrap();
        // Q made no change: syncing it must still make P's durable.
        e.pg_sync(q).unwrap();
        assert_eq!(on_disk(&dev, 7), 7);
    }

    #[test]
    fn fork_inherits_engagement_and_exit_disengages() {
        let (e, _) = engine();
        let p = e.pg_create();
        e.pg_release(p).unwrap();
        e.pg_engage(p, 10).unwrap();
        e.pg_inherit(10, 11);
        let w = e
            .write(
                1,
                0,
                &[1],
                &[],
                ChangeOpts {
                    caller: Some(11),
                    data: false,
                },
            )
            .unwrap();
        let head = e.lock().pgs.group(p).unwrap().head;
        assert_eq!(
            e.lock().g.reaches(head, w, 100),
            Some(true),
            "the child's change joins the group"
        );
        e.pg_forget_caller(11);
        e.pg_forget_caller(10);
        let q = e.pg_create();
        e.pg_add_depend(q, p).unwrap(); // no longer engaged anywhere
    }
}
