//! Open files and orphans: the part of [`State`](crate::fs::State) that decides when an
//! unlinked inode is freed. An inode with open handles lives on, nameless, as an
//! orphan until its last release; in the journal modes orphans are also on ext3's
//! on-disk list (`orphan.rs`), whose back links are kept here.

use rustc_hash::{FxHashMap as HashMap, FxHashSet as HashSet};

#[derive(Default)]
pub(crate) struct Files {
    /// Open handles per inode.
    open: HashMap<u32, u32>,
    /// Unlinked inodes that stay until their last handle is released.
    orphans: HashSet<u32>,
    /// The on-disk orphan list's back links (journal modes): each member's predecessor,
    /// 0 for the head (the superblock points to it). The list is singly linked on
    /// disk, newest first, and files leave it oldest first (`rm -rf`: each unlinked
    /// file at its FORGET, in batches), so finding the predecessor by walking cost a
    /// walk of the whole list per file.
    prev: HashMap<u32, u32>,
}

impl Files {
    /// A handle of `ino` was opened.
    pub fn open(&mut self, ino: u32) {
        *self.open.entry(ino).or_default() += 1;
    }

    /// Open handles of `ino`.
    pub fn opens(&self, ino: u32) -> u32 {
        self.open.get(&ino).copied().unwrap_or(0)
    }

    /// A handle of `ino` was released; whether it was the last one.
    pub fn release(&mut self, ino: u32) -> bool {
        let n = self.open.entry(ino).or_default();
        *n = n.saturating_sub(1);
        if *n > 0 {
            return false;
        }
        self.open.remove(&ino);
        true
    }

    /// Forgets the handles of `ino` (freed at unmount).
    pub fn forget_opens(&mut self, ino: u32) {
        self.open.remove(&ino);
    }

    pub fn is_orphan(&self, ino: u32) -> bool {
        self.orphans.contains(&ino)
    }

    pub fn orphan(&mut self, ino: u32) {
        self.orphans.insert(ino);
    }

    /// `ino` is no longer an orphan; whether it was one.
    pub fn unorphan(&mut self, ino: u32) -> bool {
        self.orphans.remove(&ino)
    }

    /// Takes every orphan (to free them at unmount).
    pub fn take_orphans(&mut self) -> Vec<u32> {
        self.orphans.drain().collect()
    }

    /// `ino`'s predecessor on the on-disk list is now `prev` (0: the superblock).
    pub fn set_prev(&mut self, ino: u32, prev: u32) {
        self.prev.insert(ino, prev);
    }

    /// Takes `ino`'s back link, if one is known.
    pub fn take_prev(&mut self, ino: u32) -> Option<u32> {
        self.prev.remove(&ino)
    }
}
