//! What ext2's own tests need from the layer above it: a journal starter. (Stacks are
//! built by `quilt_stack`, which ext2's tests may not depend on; this is its
//! `JbdJournals` in the few lines a test needs.)

#![allow(dead_code)]

use quilt_block::BlockDevice;
use quilt_ext2::{JournalPlace, JournalRequest, JournalStarter, Journals};
use quilt_journal::{Journal, JournalError, RecoveryReport};
use quilt_patch::{Engine, Transactions};
use std::sync::Arc;

struct Jbd;

impl JournalStarter for Jbd {
    fn recover(
        &self,
        home: &dyn BlockDevice,
        place: &JournalPlace,
    ) -> Result<RecoveryReport, JournalError> {
        quilt_journal::recover_on(home, place.dev.as_ref(), &place.map)
    }

    fn start(
        &self,
        engine: &Engine,
        req: JournalRequest,
    ) -> Result<Arc<dyn Transactions>, JournalError> {
        let j = Journal::start_on(engine.clone(), req.place.dev, req.place.map, req.options)?;
        Ok(Arc::new(j))
    }
}

/// The starter a test's mount options carry.
pub fn journals() -> Option<Journals> {
    Some(Journals(Arc::new(Jbd)))
}

/// Default mount options with the journal starter (what most tests mount with).
pub fn options() -> quilt_ext2::MountOptions {
    quilt_ext2::MountOptions {
        journal: journals(),
        ..Default::default()
    }
}
