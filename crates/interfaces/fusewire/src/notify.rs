//! Notifications to the kernel: drop cached attributes, data or names that the file
//! system changed on its own.

use crate::abi::{self, Writer};
use crate::channel::Channel;
use std::io;
use std::sync::Arc;

/// Sends notifications on a session's connection (cheap to clone).
#[derive(Clone, Debug)]
pub struct Notifier {
    chan: Arc<Channel>,
}

impl Notifier {
    pub(crate) fn new(chan: Arc<Channel>) -> Self {
        Notifier { chan }
    }

    fn send(&self, code: i32, body: &[u8]) -> io::Result<()> {
        let mut h = Writer::with_capacity(abi::OUT_HEADER_LEN);
        h.u32((abi::OUT_HEADER_LEN + body.len()) as u32)
            .i32(code)
            .u64(0);
        self.chan.send(&[&h.buf, body])
    }

    /// Drops the kernel's cached attributes of `ino` and, for `offset >= 0`, its cached
    /// data from `offset` for `len` bytes (0: to the end).
    pub fn inval_inode(&self, ino: u64, offset: i64, len: i64) -> io::Result<()> {
        let mut w = Writer::with_capacity(24);
        w.u64(ino).i64(offset).i64(len);
        self.send(abi::notify::INVAL_INODE, &w.buf)
    }

    /// Drops the kernel's cached lookup of `name` in `parent`.
    pub fn inval_entry(&self, parent: u64, name: &[u8]) -> io::Result<()> {
        let mut w = Writer::with_capacity(16 + name.len() + 1);
        w.u64(parent)
            .u32(name.len() as u32)
            .u32(0)
            .bytes(name)
            .bytes(&[0]);
        self.send(abi::notify::INVAL_ENTRY, &w.buf)
    }

    /// Tells the kernel `name` in `parent` (naming `child`) is gone.
    pub fn delete(&self, parent: u64, child: u64, name: &[u8]) -> io::Result<()> {
        let mut w = Writer::with_capacity(24 + name.len() + 1);
        w.u64(parent)
            .u64(child)
            .u32(name.len() as u32)
            .u32(0)
            .bytes(name)
            .bytes(&[0]);
        self.send(abi::notify::DELETE, &w.buf)
    }
}
