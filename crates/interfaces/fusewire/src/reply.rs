//! Replies: one per request (FORGET and BATCH_FORGET take none). A `Reply` that is
//! dropped unanswered answers EIO, so the kernel never waits forever.

use crate::abi::{self, Attr, Entry, Writer};
use crate::channel::Channel;
use std::time::Duration;

/// Where a reply goes.
#[derive(Clone, Copy)]
pub(crate) enum Sink<'c> {
    /// Written to /dev/fuse at once.
    Dev(&'c Channel),
    /// Staged (header and body) for the ring entry that carried the request; the ring
    /// worker copies it into the entry's buffers once the request is no longer borrowed
    /// from them, and commits it.
    Ring(&'c std::cell::RefCell<Vec<u8>>),
}

/// The answer to one request.
pub struct Reply<'c> {
    sink: Sink<'c>,
    unique: u64,
    done: bool,
}

/// A statfs answer.
#[derive(Debug, Clone, Copy, Default)]
pub struct Statfs {
    pub blocks: u64,
    pub bfree: u64,
    pub bavail: u64,
    pub files: u64,
    pub ffree: u64,
    pub bsize: u32,
    pub namelen: u32,
    pub frsize: u32,
}

impl<'c> Reply<'c> {
    pub fn new(chan: &'c Channel, unique: u64) -> Self {
        Reply::to(Sink::Dev(chan), unique)
    }

    pub(crate) fn to(sink: Sink<'c>, unique: u64) -> Self {
        Reply {
            sink,
            unique,
            done: false,
        }
    }

    fn send(mut self, error: i32, body: &[u8]) {
        if self.done {
            return;
        }
        self.done = true;
        let len = (abi::OUT_HEADER_LEN + body.len()) as u32;
        let mut h = Writer::with_capacity(abi::OUT_HEADER_LEN);
        h.u32(len).i32(error).u64(self.unique);
        match self.sink {
            Sink::Dev(chan) => {
                if let Err(e) = chan.send(&[&h.buf, body]) {
                    tracing::warn!("replying to FUSE request {}: {e}", self.unique);
                }
            }
            Sink::Ring(staged) => {
                let mut st = staged.borrow_mut();
                st.clear();
                st.extend_from_slice(&h.buf);
                st.extend_from_slice(body);
            }
        }
    }

    /// An error (a positive errno).
    pub fn error(self, errno: i32) {
        self.send(-errno, &[]);
    }
    pub fn ok(self) {
        self.send(0, &[]);
    }
    pub fn data(self, d: &[u8]) {
        self.send(0, d);
    }
    pub fn entry(self, e: &Entry) {
        let mut w = Writer::with_capacity(abi::ENTRY_OUT_LEN);
        e.encode(&mut w);
        self.send(0, &w.buf);
    }
    pub fn attr(self, a: &Attr, valid: Duration) {
        let mut w = Writer::with_capacity(16 + abi::ATTR_LEN);
        w.u64(valid.as_secs()).u32(valid.subsec_nanos()).u32(0);
        a.encode(&mut w);
        self.send(0, &w.buf);
    }
    pub fn open(self, fh: u64, open_flags: u32) {
        let mut w = Writer::with_capacity(16);
        w.u64(fh).u32(open_flags).u32(0);
        self.send(0, &w.buf);
    }
    pub fn created(self, e: &Entry, fh: u64, open_flags: u32) {
        let mut w = Writer::with_capacity(abi::ENTRY_OUT_LEN + 16);
        e.encode(&mut w);
        w.u64(fh).u32(open_flags).u32(0);
        self.send(0, &w.buf);
    }
    pub fn written(self, n: u32) {
        let mut w = Writer::with_capacity(8);
        w.u32(n).u32(0);
        self.send(0, &w.buf);
    }
    pub fn statfs(self, s: &Statfs) {
        let mut w = Writer::with_capacity(80);
        w.u64(s.blocks)
            .u64(s.bfree)
            .u64(s.bavail)
            .u64(s.files)
            .u64(s.ffree)
            .u32(s.bsize)
            .u32(s.namelen)
            .u32(s.frsize)
            .u32(0)
            .zeros(24);
        self.send(0, &w.buf);
    }
    /// The size an xattr value or list needs (the caller asked with size 0).
    pub fn xattr_size(self, n: u32) {
        let mut w = Writer::with_capacity(8);
        w.u32(n).u32(0);
        self.send(0, &w.buf);
    }
    pub fn lseek(self, offset: u64) {
        let mut w = Writer::with_capacity(8);
        w.u64(offset);
        self.send(0, &w.buf);
    }
    /// A finished ioctl: its result and the bytes copied back to the caller.
    pub fn ioctl(self, result: i32, out: &[u8]) {
        let mut w = Writer::with_capacity(16 + out.len());
        w.i32(result).u32(0).u32(0).u32(0).bytes(out);
        self.send(0, &w.buf);
    }
    /// The INIT answer, already encoded.
    pub(crate) fn raw(self, body: &[u8]) {
        self.send(0, body);
    }
    /// For requests that take no answer (FORGET): nothing is sent.
    pub fn none(mut self) {
        self.done = true;
    }
    /// A reply for a request that takes none: answering it sends nothing.
    pub(crate) fn noreply(mut self) -> Self {
        self.done = true;
        self
    }
}

impl Drop for Reply<'_> {
    fn drop(&mut self) {
        if !self.done {
            tracing::error!("FUSE request {} left unanswered: EIO", self.unique);
            let r = Reply::to(self.sink, self.unique);
            r.error(libc::EIO);
        }
    }
}

/// What precedes a listing entry: nothing (READDIR), or for READDIRPLUS its attributes
/// or zeros (no attributes: the kernel links nothing).
#[derive(Clone, Copy)]
enum Attrs<'e> {
    None,
    Zeros,
    Entry(&'e Entry),
}

/// Directory listings for READDIR (and READDIRPLUS), filled up to the size the kernel
/// asked for.
pub struct DirBuf {
    w: Writer,
    max: usize,
}

impl DirBuf {
    pub fn new(max: u32) -> Self {
        DirBuf {
            w: Writer::with_capacity((max as usize).min(1 << 16)),
            max: max as usize,
        }
    }

    /// Adds one entry; false (and nothing added) when it does not fit. `next` is the
    /// offset to resume after this entry.
    pub fn add(&mut self, ino: u64, next: u64, mode: u32, name: &[u8]) -> bool {
        self.push(Attrs::None, ino, next, mode, name)
    }

    /// Adds one entry with its attributes (READDIRPLUS).
    pub fn add_plus(&mut self, e: &Entry, next: u64, name: &[u8]) -> bool {
        self.push(Attrs::Entry(e), e.attr.ino, next, e.attr.mode, name)
    }

    /// Adds one entry of a READDIRPLUS listing without attributes (node 0: the kernel
    /// links nothing and counts no lookup), as for `.` and `..`.
    pub fn add_plus_bare(&mut self, ino: u64, next: u64, mode: u32, name: &[u8]) -> bool {
        self.push(Attrs::Zeros, ino, next, mode, name)
    }

    /// The bytes a READDIRPLUS entry with this name takes.
    pub fn plus_len(name: &[u8]) -> usize {
        abi::ENTRY_OUT_LEN + Self::dirent_len(name)
    }

    fn dirent_len(name: &[u8]) -> usize {
        (24 + name.len()).div_ceil(8) * 8
    }

    /// One `fuse_dirent`, preceded for READDIRPLUS by its `fuse_entry_out`.
    fn push(&mut self, plus: Attrs<'_>, ino: u64, next: u64, mode: u32, name: &[u8]) -> bool {
        let len = match plus {
            Attrs::None => Self::dirent_len(name),
            _ => Self::plus_len(name),
        };
        if self.w.buf.len() + len > self.max {
            return false;
        }
        match plus {
            Attrs::Entry(e) => e.encode(&mut self.w),
            Attrs::Zeros => {
                self.w.zeros(abi::ENTRY_OUT_LEN);
            }
            Attrs::None => {}
        }
        self.w
            .u64(ino)
            .u64(next)
            .u32(name.len() as u32)
            .u32(abi::dirent_type(mode))
            .bytes(name)
            .align8();
        true
    }

    pub fn is_empty(&self) -> bool {
        self.w.buf.is_empty()
    }

    pub fn send(self, reply: Reply<'_>) {
        reply.data(&self.w.buf);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_records_are_aligned_and_bounded() {
        let mut d = DirBuf::new(64);
        assert!(d.add(5, 1, libc::S_IFDIR, b"a"));
        assert_eq!(d.w.buf.len(), 32);
        assert!(d.add(6, 2, libc::S_IFREG, b"12345678"));
        assert_eq!(d.w.buf.len(), 64);
        assert!(!d.add(7, 3, libc::S_IFREG, b"x"), "full");
        assert_eq!(&d.w.buf[16..20], &1u32.to_le_bytes());
        assert_eq!(&d.w.buf[20..24], &(libc::S_IFDIR >> 12).to_le_bytes());
    }
}
