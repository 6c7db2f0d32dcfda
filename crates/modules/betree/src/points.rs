//! The point messages of one buffer, kept the way they are written.
//!
//! A buffer's point messages are sorted by key, and each key's messages by MSN. They
//! live in one arena in exactly their on-disk form, a *group* per key:
//!
//! ```text
//! key length (u32), key, message count (u32), messages
//! message: MSN (u64), kind (u8: 1 put, 2 delete, 3 upsert), then a put's value
//!          (u32 length, bytes) or an upsert's function (u16) and argument (u32, bytes)
//! ```
//!
//! plus the offset of each group. So reading a buffer from disk is one validating pass
//! and a copy, writing it is a copy, and merging a parent's buffer into a child's,
//! cutting one at a pivot, cloning and dropping one cost copies of bytes rather than an
//! allocation per message (a map of vectors spent most of a flush in the allocator).
//!
//! Single messages routed into the root's buffers wait in a short unsorted *tail*,
//! merged into the arena once it holds `TAIL_MAX` of them and before anything walks the
//! buffer in order; a lookup reads the tail as well.
//!
//! Rule kept by every operation: a put or a delete supersedes the older messages of its
//! key (they are dropped), an upsert queues behind them.

#[cfg(test)]
use crate::codec::Writer;
use crate::codec::{key_cmp, Reader};
use crate::msg::{point_bytes, Msg, Msn};
use crate::{Error, Result};
use std::borrow::Cow;

/// Messages the tail holds before it is merged into the arena.
const TAIL_MAX: usize = 64;

/// Every message of a key range, owned: `(key, messages oldest first)`.
pub type Window = Vec<(Vec<u8>, Vec<(Msn, Msg)>)>;

/// A message read in place from an arena.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MsgRef<'a> {
    Put(&'a [u8]),
    Delete,
    Upsert { func: u16, arg: &'a [u8] },
}

impl MsgRef<'_> {
    pub fn to_msg(self) -> Msg {
        match self {
            MsgRef::Put(v) => Msg::Put(v.to_vec()),
            MsgRef::Delete => Msg::Delete,
            MsgRef::Upsert { func, arg } => Msg::Upsert {
                func,
                arg: arg.to_vec(),
            },
        }
    }

    /// A put or a delete: nothing older of the key matters after it.
    pub fn supersedes(self) -> bool {
        !matches!(self, MsgRef::Upsert { .. })
    }
}

fn msg_ref(m: &Msg) -> MsgRef<'_> {
    match m {
        Msg::Put(v) => MsgRef::Put(v),
        Msg::Delete => MsgRef::Delete,
        Msg::Upsert { func, arg } => MsgRef::Upsert { func: *func, arg },
    }
}

fn put_msg(w: &mut Vec<u8>, msn: Msn, m: MsgRef) {
    w.extend_from_slice(&msn.to_le_bytes());
    match m {
        MsgRef::Put(v) => {
            w.push(1);
            w.extend_from_slice(&(v.len() as u32).to_le_bytes());
            w.extend_from_slice(v);
        }
        MsgRef::Delete => w.push(2),
        MsgRef::Upsert { func, arg } => {
            w.push(3);
            w.extend_from_slice(&func.to_le_bytes());
            w.extend_from_slice(&(arg.len() as u32).to_le_bytes());
            w.extend_from_slice(arg);
        }
    }
}

fn get_msg<'a>(r: &mut Reader<'a>) -> Result<(Msn, MsgRef<'a>)> {
    let msn = r.u64()?;
    let m = match r.u8()? {
        1 => MsgRef::Put(r.bytes()?),
        2 => MsgRef::Delete,
        3 => {
            let func = r.u16()?;
            MsgRef::Upsert {
                func,
                arg: r.bytes()?,
            }
        }
        k => return Err(r.corrupt(format!("unknown message kind {k}"))),
    };
    Ok((msn, m))
}

/// One key's messages, in place.
#[derive(Debug, Clone, Copy)]
pub struct Group<'a> {
    pub key: &'a [u8],
    count: u32,
    /// The encoded messages.
    body: &'a [u8],
}

impl<'a> Group<'a> {
    /// Parses the group at the start of `b` (checked: `b` came from a validated arena
    /// or from `Points::decode`'s own pass).
    fn at(b: &'a [u8]) -> Result<(Group<'a>, usize)> {
        let mut r = Reader::new(b, "message buffer");
        let key = r.bytes()?;
        let count = r.u32()?;
        let start = r.pos();
        if count == 0 || count as usize > r.remaining() {
            return Err(r.corrupt("message list length"));
        }
        for _ in 0..count {
            get_msg(&mut r)?;
        }
        let end = r.pos();
        Ok((
            Group {
                key,
                count,
                body: &b[start..end],
            },
            end,
        ))
    }

    /// The messages, oldest first.
    pub fn msgs(&self) -> impl Iterator<Item = (Msn, MsgRef<'a>)> + 'a {
        let mut r = Reader::new(self.body, "message buffer");
        // (Validated when the group entered the arena.)
        (0..self.count).map_while(move |_| get_msg(&mut r).ok())
    }

    /// The messages, owned.
    pub fn owned(self) -> Vec<(Msn, Msg)> {
        self.msgs().map(|(n, m)| (n, m.to_msg())).collect()
    }

    /// Bytes the buffer is charged for this key (`msg::point_bytes` of each message),
    /// from the header alone: each message is charged its encoded size, the key, and 3.
    pub fn bytes(&self) -> usize {
        self.body.len() + self.count as usize * (self.key.len() + 3)
    }

    fn first_supersedes(&self) -> bool {
        self.msgs().next().is_some_and(|(_, m)| m.supersedes())
    }
}

/// One item of `Points::window_in_place`: a key's group of the arena, or one message of
/// the tail.
#[derive(Debug, Clone, Copy)]
pub enum Item<'a> {
    Group(Group<'a>),
    One(Msn, MsgRef<'a>),
}

impl<'a> Item<'a> {
    /// About how many bytes of entries the item's messages may yield (their encoded
    /// size, or a put's value): what a scan reserves for it.
    pub fn size_hint(&self) -> usize {
        match self {
            Item::Group(g) => g.body.len(),
            Item::One(_, MsgRef::Put(v)) => v.len(),
            Item::One(_, MsgRef::Upsert { arg, .. }) => arg.len(),
            Item::One(_, MsgRef::Delete) => 0,
        }
    }

    /// The item's messages, oldest first.
    pub fn msgs(self) -> impl Iterator<Item = (Msn, MsgRef<'a>)> + 'a {
        let (group, one) = match self {
            Item::Group(g) => (Some(g.msgs()), None),
            Item::One(msn, m) => (None, Some((msn, m))),
        };
        group.into_iter().flatten().chain(one)
    }
}

/// Appends a group for `key` made of the messages of `parts` (each an encoded message
/// list and its count).
fn put_group(out: &mut Vec<u8>, key: &[u8], parts: &[(&[u8], u32)]) {
    out.extend_from_slice(&(key.len() as u32).to_le_bytes());
    out.extend_from_slice(key);
    let n: u32 = parts.iter().map(|p| p.1).sum();
    out.extend_from_slice(&n.to_le_bytes());
    for (body, _) in parts {
        out.extend_from_slice(body);
    }
}

/// See the module's doc.
#[derive(Debug, Clone, Default)]
pub struct Points {
    arena: Vec<u8>,
    offs: Vec<u32>,
    /// Routed messages not merged yet, in arrival (MSN) order.
    tail: Vec<(Vec<u8>, Msn, Msg)>,
    /// `msg::point_bytes` of every message held (the tail's counted as they came).
    pub bytes: usize,
}

impl Points {
    pub fn is_empty(&self) -> bool {
        self.offs.is_empty() && self.tail.is_empty()
    }

    /// Whether any message (arena or tail) is for a key in `lo..hi`.
    pub fn any_in(&self, lo: &[u8], hi: &[u8]) -> bool {
        let a = self.lower_bound(lo);
        (a < self.offs.len() && self.key_at(a) < hi)
            || self
                .tail
                .iter()
                .any(|(k, _, _)| k.as_slice() >= lo && k.as_slice() < hi)
    }

    /// Whether any message (arena or tail) is an upsert.
    pub fn has_upserts(&self) -> bool {
        self.tail
            .iter()
            .any(|(_, _, m)| matches!(m, Msg::Upsert { .. }))
            || (0..self.offs.len()).any(|i| {
                self.group(i)
                    .msgs()
                    .any(|(_, m)| matches!(m, MsgRef::Upsert { .. }))
            })
    }

    /// Keys in the arena, plus messages in the tail (an upper bound of the keys).
    pub fn len(&self) -> usize {
        self.offs.len() + self.tail.len()
    }

    /// Group `i`, read from its header: the arena was validated as it was filled, so
    /// the messages need no second pass (this runs for every group a merge touches).
    fn group(&self, i: usize) -> Group<'_> {
        let end = self
            .offs
            .get(i + 1)
            .map_or(self.arena.len(), |&e| e as usize);
        let key = self.key_at(i);
        let at = self.offs[i] as usize + 4 + key.len();
        let count = u32::from_le_bytes(self.arena[at..at + 4].try_into().expect("4 bytes"));
        Group {
            key,
            count,
            body: &self.arena[at + 4..end],
        }
    }

    fn key_at(&self, i: usize) -> &[u8] {
        let at = self.offs[i] as usize;
        let len = u32::from_le_bytes(self.arena[at..at + 4].try_into().expect("4 bytes")) as usize;
        &self.arena[at + 4..at + 4 + len]
    }

    /// The index of the first group whose key is not below `key`.
    fn lower_bound(&self, key: &[u8]) -> usize {
        let (mut lo, mut hi) = (0, self.offs.len());
        while lo < hi {
            let mid = (lo + hi) / 2;
            if key_cmp(self.key_at(mid), key).is_lt() {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        lo
    }

    /// Adds one message (newer than everything held).
    pub fn push(&mut self, key: Vec<u8>, msn: Msn, msg: Msg) {
        self.bytes += point_bytes(&key, &msg);
        self.tail.push((key, msn, msg));
        if self.tail.len() >= TAIL_MAX {
            self.settle();
        }
    }

    /// Merges the tail into the arena.
    pub fn settle(&mut self) {
        if self.tail.is_empty() {
            return;
        }
        let mut tail = std::mem::take(&mut self.tail);
        self.bytes -= tail
            .iter()
            .map(|(k, _, m)| point_bytes(k, m))
            .sum::<usize>();
        // Stable: a key's messages stay in MSN order.
        tail.sort_by(|a, b| a.0.cmp(&b.0));
        let mut newer = Points::default();
        let mut i = 0;
        let mut body = Vec::new();
        while i < tail.len() {
            let key = &tail[i].0;
            let mut j = i;
            while j < tail.len() && tail[j].0 == *key {
                j += 1;
            }
            // A put or delete drops what came before it for the key.
            let from = (i..j)
                .rev()
                .find(|&x| msg_ref(&tail[x].2).supersedes())
                .unwrap_or(i);
            body.clear();
            for (_, msn, m) in &tail[from..j] {
                put_msg(&mut body, *msn, msg_ref(m));
            }
            newer.offs.push(newer.arena.len() as u32);
            put_group(&mut newer.arena, key, &[(&body, (j - from) as u32)]);
            i = j;
        }
        newer.bytes = (0..newer.offs.len()).map(|g| newer.group(g).bytes()).sum();
        self.merge(&newer, 0, newer.offs.len());
    }

    /// A view without a tail: borrowed when there is none.
    pub fn settled(&self) -> Cow<'_, Points> {
        if self.tail.is_empty() {
            Cow::Borrowed(self)
        } else {
            let mut p = self.clone();
            p.settle();
            Cow::Owned(p)
        }
    }

    /// Groups in key order (no tail: see `settled`).
    pub fn groups(&self) -> impl Iterator<Item = Group<'_>> + '_ {
        debug_assert!(self.tail.is_empty(), "walking a buffer with a tail");
        (0..self.offs.len()).map(|i| self.group(i))
    }

    /// Keys in order (no tail).
    pub fn keys(&self) -> impl Iterator<Item = &[u8]> + '_ {
        debug_assert!(self.tail.is_empty(), "walking a buffer with a tail");
        (0..self.offs.len()).map(|i| self.key_at(i))
    }

    /// The messages held for `key`, oldest first.
    pub fn get(&self, key: &[u8]) -> Vec<(Msn, Msg)> {
        let i = self.lower_bound(key);
        let mut out = if i < self.offs.len() && self.key_at(i) == key {
            self.group(i).owned()
        } else {
            Vec::new()
        };
        for (k, msn, m) in &self.tail {
            if k.as_slice() == key {
                if msg_ref(m).supersedes() {
                    out.clear();
                }
                out.push((*msn, m.clone()));
            }
        }
        out
    }

    /// Every key's messages in `lo..hi` (`None`: to the end), owned, in key order.
    pub fn window(&self, lo: &[u8], hi: Option<&[u8]>) -> Window {
        let a = self.lower_bound(lo);
        let b = hi.map_or(self.offs.len(), |h| self.lower_bound(h));
        let mut out: Window = (a..b.max(a))
            .map(|i| {
                let g = self.group(i);
                (g.key.to_vec(), g.owned())
            })
            .collect();
        // The tail's messages in the window, newer than the arena's: as `push` would.
        let mut tail: Vec<&(Vec<u8>, Msn, Msg)> = self
            .tail
            .iter()
            .filter(|(k, _, _)| k.as_slice() >= lo && hi.is_none_or(|h| k.as_slice() < h))
            .collect();
        if tail.is_empty() {
            return out;
        }
        tail.sort_by(|x, y| x.0.cmp(&y.0)); // stable: MSN order within a key
        for (k, msn, m) in tail {
            let at = match out.binary_search_by(|(ok, _)| ok.as_slice().cmp(k)) {
                Ok(at) => at,
                Err(at) => {
                    out.insert(at, (k.clone(), Vec::new()));
                    at
                }
            };
            let list = &mut out[at].1;
            if msg_ref(m).supersedes() {
                list.clear();
            }
            list.push((*msn, m.clone()));
        }
        out
    }

    /// The messages of keys in `lo..hi` (`None`: to the end), in place and in key
    /// order: each key's arena group first, then its tail messages (newer), one item
    /// each. Applying every item of a key in this order gives what `window`'s list
    /// gives (a superseding message makes the older ones irrelevant either way).
    pub fn window_in_place(&self, lo: &[u8], hi: Option<&[u8]>) -> Vec<(&[u8], Item<'_>)> {
        let a = self.lower_bound(lo);
        let b = hi.map_or(self.offs.len(), |h| self.lower_bound(h)).max(a);
        let mut tail: Vec<&(Vec<u8>, Msn, Msg)> = self
            .tail
            .iter()
            .filter(|(k, _, _)| k.as_slice() >= lo && hi.is_none_or(|h| k.as_slice() < h))
            .collect();
        let mut out = Vec::with_capacity(b - a + tail.len());
        if tail.is_empty() {
            out.extend((a..b).map(|i| {
                let g = self.group(i);
                (g.key, Item::Group(g))
            }));
            return out;
        }
        tail.sort_by(|x, y| x.0.cmp(&y.0)); // stable: MSN order within a key
        let mut t = tail.into_iter().peekable();
        for i in a..b {
            let g = self.group(i);
            while let Some((k, msn, m)) = t.next_if(|(k, _, _)| k.as_slice() < g.key) {
                out.push((k.as_slice(), Item::One(*msn, msg_ref(m))));
            }
            out.push((g.key, Item::Group(g)));
            while let Some((k, msn, m)) = t.next_if(|(k, _, _)| k.as_slice() == g.key) {
                out.push((k.as_slice(), Item::One(*msn, msg_ref(m))));
            }
        }
        out.extend(t.map(|(k, msn, m)| (k.as_slice(), Item::One(*msn, msg_ref(m)))));
        out
    }

    /// Merges groups `a..b` of `newer` (whose messages are all newer than this one's)
    /// in: a key's newer messages replace the older ones when they start with a put or
    /// a delete, else they queue behind them. No tail on either side.
    pub fn merge_range(&mut self, newer: &Points, a: usize, b: usize) {
        self.settle();
        self.merge(newer, a, b);
    }

    fn merge(&mut self, newer: &Points, a: usize, b: usize) {
        debug_assert!(newer.tail.is_empty());
        if a >= b {
            return;
        }
        let span = |p: &Points, x: usize, y: usize| {
            let s = p.offs.get(x).map_or(p.arena.len(), |&o| o as usize);
            let e = p.offs.get(y).map_or(p.arena.len(), |&o| o as usize);
            (s, e)
        };
        if self.offs.is_empty() {
            let (s, e) = span(newer, a, b);
            self.arena = newer.arena[s..e].to_vec();
            self.offs = newer.offs[a..b].iter().map(|&o| o - s as u32).collect();
            self.bytes += (a..b).map(|i| newer.group(i).bytes()).sum::<usize>();
            return;
        }
        let mut arena =
            Vec::with_capacity(self.arena.len() + span(newer, a, b).1 - span(newer, a, b).0);
        let mut offs = Vec::with_capacity(self.offs.len() + b - a);
        let (mut i, mut j) = (0, a);
        let mut delta: isize = 0;
        // Runs of groups from one side only are copied whole.
        while i < self.offs.len() || j < b {
            if j == b || (i < self.offs.len() && key_cmp(self.key_at(i), newer.key_at(j)).is_lt()) {
                let mut e = i + 1;
                while e < self.offs.len()
                    && (j == b || key_cmp(self.key_at(e), newer.key_at(j)).is_lt())
                {
                    e += 1;
                }
                let (s, end) = span(self, i, e);
                let base = arena.len() as u32;
                offs.extend(self.offs[i..e].iter().map(|&o| o - s as u32 + base));
                arena.extend_from_slice(&self.arena[s..end]);
                i = e;
            } else if i == self.offs.len() || key_cmp(newer.key_at(j), self.key_at(i)).is_lt() {
                let mut e = j + 1;
                while e < b
                    && (i == self.offs.len() || key_cmp(newer.key_at(e), self.key_at(i)).is_lt())
                {
                    e += 1;
                }
                let (s, end) = span(newer, j, e);
                let base = arena.len() as u32;
                offs.extend(newer.offs[j..e].iter().map(|&o| o - s as u32 + base));
                arena.extend_from_slice(&newer.arena[s..end]);
                delta += (j..e).map(|x| newer.group(x).bytes()).sum::<usize>() as isize;
                j = e;
            } else {
                let (old, new) = (self.group(i), newer.group(j));
                offs.push(arena.len() as u32);
                if new.first_supersedes() {
                    put_group(&mut arena, new.key, &[(new.body, new.count)]);
                    delta += new.bytes() as isize - old.bytes() as isize;
                } else {
                    put_group(
                        &mut arena,
                        new.key,
                        &[(old.body, old.count), (new.body, new.count)],
                    );
                    delta += new.bytes() as isize;
                }
                i += 1;
                j += 1;
            }
        }
        self.arena = arena;
        self.offs = offs;
        self.bytes = (self.bytes as isize + delta) as usize;
    }

    /// Merges all of `newer` in (see `merge_range`).
    pub fn merge_all(&mut self, mut newer: Points) {
        newer.settle();
        if self.is_empty() {
            *self = newer;
            return;
        }
        let n = newer.offs.len();
        self.merge_range(&newer, 0, n);
    }

    /// Indexes of the first group at or past `key` (for cutting at pivots).
    pub fn position(&self, key: &[u8]) -> usize {
        debug_assert!(self.tail.is_empty());
        self.lower_bound(key)
    }

    /// Groups in the arena (no tail).
    pub fn groups_len(&self) -> usize {
        self.offs.len()
    }

    /// Cuts at `key`: keeps the keys below it, returns the others.
    pub fn split_off(&mut self, key: &[u8]) -> Points {
        self.settle();
        let at = self.lower_bound(key);
        if at == self.offs.len() {
            return Points::default();
        }
        let s = self.offs[at] as usize;
        let right_arena = self.arena.split_off(s);
        let right_offs: Vec<u32> = self
            .offs
            .split_off(at)
            .iter()
            .map(|&o| o - s as u32)
            .collect();
        let right = Points {
            arena: right_arena,
            offs: right_offs,
            tail: Vec::new(),
            bytes: 0,
        };
        let rb: usize = right.groups().map(|g| g.bytes()).sum();
        self.bytes -= rb;
        Points { bytes: rb, ..right }
    }

    /// Drops the keys in `lo..hi`; returns their bytes.
    pub fn remove_range(&mut self, lo: &[u8], hi: &[u8]) -> usize {
        self.settle();
        let a = self.lower_bound(lo);
        let b = self.lower_bound(hi).max(a);
        if a == b {
            return 0;
        }
        let gone: usize = (a..b).map(|i| self.group(i).bytes()).sum();
        let s = self.offs[a] as usize;
        let e = self.offs.get(b).map_or(self.arena.len(), |&o| o as usize);
        self.arena.drain(s..e);
        let cut = (e - s) as u32;
        self.offs.drain(a..b);
        for o in &mut self.offs[a..] {
            *o -= cut;
        }
        self.bytes -= gone;
        gone
    }

    /// Every key mapped by `f`, which must keep their order (a lift's prefix change).
    pub fn map_keys(self, f: impl Fn(&[u8]) -> Vec<u8>) -> Points {
        let p = self.settled().into_owned();
        let mut out = Points::default();
        for g in p.groups() {
            let k = f(g.key);
            debug_assert!(
                out.offs.is_empty() || out.key_at(out.offs.len() - 1) < k.as_slice(),
                "a key map that does not keep the order"
            );
            out.offs.push(out.arena.len() as u32);
            put_group(&mut out.arena, &k, &[(g.body, g.count)]);
        }
        out.bytes = (0..out.offs.len()).map(|i| out.group(i).bytes()).sum();
        out
    }

    /// Reads `count` groups from `r` (a buffer as written), checking every bound, kind
    /// and length and that the keys ascend; damage is `Corrupt`, never a panic.
    pub fn decode(r: &mut Reader, count: usize) -> Result<Points> {
        let start = r.pos();
        let all = r.rest();
        let mut offs = Vec::with_capacity(count.min(all.len() / 9));
        let mut at = 0;
        let mut prev: Option<&[u8]> = None;
        let mut bytes = 0;
        for _ in 0..count {
            let (g, len) = Group::at(&all[at..]).map_err(|e| match e {
                Error::Corrupt(why) => Error::Corrupt(format!("{why} (byte {})", start + at)),
                e => e,
            })?;
            if prev.is_some_and(|p| p >= g.key) {
                return Err(r.corrupt("keys out of order"));
            }
            prev = Some(g.key);
            bytes += g.bytes();
            offs.push(at as u32);
            at += len;
        }
        let arena = all[..at].to_vec();
        r.skip(at)?;
        Ok(Points {
            arena,
            offs,
            tail: Vec::new(),
            bytes,
        })
    }

    /// The groups cut into runs of about `target` bytes, in order: each run's first
    /// key, its groups' bytes exactly as `decode` reads them, and how many (no tail).
    pub fn runs(&self, target: usize) -> Vec<(&[u8], &[u8], u32)> {
        debug_assert!(self.tail.is_empty(), "cutting a buffer with a tail");
        let mut out = Vec::new();
        let mut a = 0;
        while a < self.offs.len() {
            let start = self.offs[a] as usize;
            let mut b = a + 1;
            while b < self.offs.len() && (self.offs[b] as usize) - start < target {
                b += 1;
            }
            let end = self.offs.get(b).map_or(self.arena.len(), |&e| e as usize);
            out.push((self.key_at(a), &self.arena[start..end], (b - a) as u32));
            a = b;
        }
        out
    }

    /// Appends `other`'s groups, whose keys are all above this one's (neither has a tail).
    pub fn append(&mut self, other: Points) -> Result<()> {
        if let Some(last) = self.offs.len().checked_sub(1) {
            if !other.offs.is_empty() && self.key_at(last) >= other.key_at(0) {
                return Err(Error::Corrupt("message runs out of order".into()));
            }
        }
        let base = self.arena.len() as u32;
        self.arena.extend_from_slice(&other.arena);
        self.offs.extend(other.offs.iter().map(|o| o + base));
        self.bytes += other.bytes;
        Ok(())
    }

    /// The messages for `key` among `count` encoded groups (checked as they are
    /// walked), oldest first.
    pub fn lookup_encoded(body: &[u8], count: usize, key: &[u8]) -> Result<Vec<(Msn, Msg)>> {
        let mut at = 0;
        for _ in 0..count {
            let (g, len) = Group::at(body.get(at..).unwrap_or_default())?;
            if g.key == key {
                return Ok(g.owned());
            }
            if g.key > key {
                break;
            }
            at += len;
        }
        Ok(Vec::new())
    }

    /// Writes the groups as `decode` reads them (count first). (Nodes write their
    /// buffers' groups run by run: `runs`.)
    #[cfg(test)]
    pub fn encode(&self, w: &mut Writer) {
        let p = self.settled();
        w.u32(p.offs.len() as u32);
        w.raw(&p.arena);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    type Model = BTreeMap<Vec<u8>, Vec<(Msn, Msg)>>;

    fn model_push(m: &mut Model, k: &[u8], msn: Msn, msg: Msg) {
        let l = m.entry(k.to_vec()).or_default();
        if !matches!(msg, Msg::Upsert { .. }) {
            l.clear();
        }
        l.push((msn, msg));
    }

    fn contents(p: &Points) -> Model {
        p.window(b"", None).into_iter().collect()
    }

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn random_msg(seed: &mut u64) -> Msg {
        match rng(seed) % 3 {
            0 => Msg::Put(vec![rng(seed) as u8; (rng(seed) % 20) as usize]),
            1 => Msg::Delete,
            _ => Msg::Upsert {
                func: 1,
                arg: vec![7; (rng(seed) % 5) as usize],
            },
        }
    }

    fn bytes_of(m: &Model) -> usize {
        m.iter()
            .map(|(k, l)| l.iter().map(|(_, x)| point_bytes(k, x)).sum::<usize>())
            .sum()
    }

    /// What a list of messages makes of no value (an upsert appends its argument).
    fn fold<'a>(msgs: impl Iterator<Item = MsgRef<'a>>) -> Option<Vec<u8>> {
        msgs.fold(None, |v, m| match m {
            MsgRef::Put(x) => Some(x.to_vec()),
            MsgRef::Delete => None,
            MsgRef::Upsert { arg, .. } => Some([v.unwrap_or_default(), arg.to_vec()].concat()),
        })
    }

    /// A delta's runs (`runs`), decoded one by one and appended, give back the groups;
    /// each key's messages are found in the run `lo` points at (`lookup_encoded`).
    #[test]
    fn runs_round_trip_and_hold_their_keys() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200 {
            let (mut p, mut m) = (Points::default(), Model::new());
            for msn in 0..(rng(&mut seed) % 300) {
                let k = format!("k{:04}", rng(&mut seed) % 500).into_bytes();
                let x = random_msg(&mut seed);
                model_push(&mut m, &k, msn, x.clone());
                p.push(k, msn, x);
            }
            p.settle();
            let target = 1 + (rng(&mut seed) % 2000) as usize;
            let runs = p.runs(target);
            assert_eq!(runs.iter().map(|r| r.2 as usize).sum::<usize>(), m.len());
            let mut back = Points::default();
            for (i, (lo, bytes, groups)) in runs.iter().enumerate() {
                let mut r = Reader::new(bytes, "run");
                let q = Points::decode(&mut r, *groups as usize).unwrap();
                assert_eq!(r.remaining(), 0);
                assert_eq!(q.key_at(0), *lo);
                // Every key of this run, and only those, is found in it.
                let hi = runs.get(i + 1).map(|r| r.0);
                for (k, msgs) in &m {
                    let mine = k.as_slice() >= *lo && hi.is_none_or(|h| k.as_slice() < h);
                    let got = Points::lookup_encoded(bytes, *groups as usize, k).unwrap();
                    assert_eq!(got, if mine { msgs.clone() } else { Vec::new() });
                }
                back.append(q).unwrap();
            }
            assert_eq!(contents(&back), m);
            assert_eq!(back.bytes, bytes_of(&m));
            // Out of order: an error, not a wrong buffer.
            if runs.len() > 1 {
                let mut r = Reader::new(runs[0].1, "run");
                let first = Points::decode(&mut r, runs[0].2 as usize).unwrap();
                assert!(back.append(first).is_err());
            }
        }
    }

    #[test]
    fn a_window_in_place_applies_as_the_owned_window() {
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        for round in 0..300 {
            let (mut p, mut m) = (Points::default(), Model::new());
            let mut msn = 0;
            // Some settled, then a tail of up to TAIL_MAX - 1 messages.
            for _ in 0..(rng(&mut seed) % 200 + rng(&mut seed) % TAIL_MAX as u64) {
                let k = format!("k{:03}", rng(&mut seed) % 40).into_bytes();
                let x = random_msg(&mut seed);
                msn += 1;
                model_push(&mut m, &k, msn, x.clone());
                p.push(k, msn, x);
            }
            let lo = format!("k{:03}", rng(&mut seed) % 45).into_bytes();
            let hi = format!("k{:03}", rng(&mut seed) % 45).into_bytes();
            let hi = (rng(&mut seed) % 4 != 0).then_some(hi);
            let items = p.window_in_place(&lo, hi.as_deref());
            assert!(
                items.windows(2).all(|w| w[0].0 <= w[1].0),
                "key order {round}"
            );
            let mut got: BTreeMap<Vec<u8>, Option<Vec<u8>>> = BTreeMap::new();
            let mut i = 0;
            while i < items.len() {
                let k = items[i].0;
                let mut j = i;
                while j < items.len() && items[j].0 == k {
                    j += 1;
                }
                let msgs: Vec<MsgRef> = items[i..j]
                    .iter()
                    .flat_map(|(_, it)| it.msgs().map(|(_, x)| x))
                    .collect();
                let msns: Vec<Msn> = items[i..j]
                    .iter()
                    .flat_map(|(_, it)| it.msgs().map(|(n, _)| n))
                    .collect();
                assert!(msns.windows(2).all(|w| w[0] < w[1]), "MSN order {round}");
                got.insert(k.to_vec(), fold(msgs.into_iter()));
                i = j;
            }
            let want: BTreeMap<Vec<u8>, Option<Vec<u8>>> = m
                .range(lo.clone()..)
                .filter(|(k, _)| hi.as_ref().is_none_or(|h| *k < h))
                .map(|(k, l)| (k.clone(), fold(l.iter().map(|(_, x)| msg_ref(x)))))
                .collect();
            assert_eq!(got, want, "round {round}");
        }
    }

    #[test]
    fn pushes_merges_cuts_and_round_trips_match_a_map_of_lists() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for round in 0..200 {
            let (mut a, mut ma) = (Points::default(), Model::new());
            let (mut b, mut mb) = (Points::default(), Model::new());
            let mut msn = 0;
            for _ in 0..(rng(&mut seed) % 300) {
                let k = format!("k{:03}", rng(&mut seed) % 60).into_bytes();
                let m = random_msg(&mut seed);
                msn += 1;
                model_push(&mut ma, &k, msn, m.clone());
                a.push(k, msn, m);
            }
            for _ in 0..(rng(&mut seed) % 300) {
                let k = format!("k{:03}", rng(&mut seed) % 60).into_bytes();
                let m = random_msg(&mut seed);
                msn += 1;
                model_push(&mut mb, &k, msn, m.clone());
                b.push(k, msn, m);
            }
            // Lookups see the tail.
            for i in 0..60 {
                let k = format!("k{i:03}").into_bytes();
                assert_eq!(
                    a.get(&k),
                    ma.get(&k).cloned().unwrap_or_default(),
                    "get {round}"
                );
            }
            assert_eq!(contents(&a), ma);
            a.settle();
            assert_eq!(a.bytes, bytes_of(&ma), "bytes after settling");
            // b is newer: merge it in.
            a.merge_all(b);
            for (k, l) in mb {
                for (n, m) in l {
                    model_push(&mut ma, &k, n, m);
                }
            }
            assert_eq!(contents(&a), ma, "merge {round}");
            assert_eq!(a.bytes, bytes_of(&ma), "bytes after merge {round}");
            // Round trip through the encoding.
            let mut w = Writer::default();
            a.encode(&mut w);
            let mut r = Reader::new(&w.buf, "test");
            let n = r.u32().unwrap() as usize;
            let d = Points::decode(&mut r, n).unwrap();
            assert_eq!(r.remaining(), 0);
            assert_eq!(contents(&d), ma);
            assert_eq!(d.bytes, a.bytes);
            // Cut and range removal.
            let cut = format!("k{:03}", rng(&mut seed) % 60).into_bytes();
            let mut left = d.clone();
            let right = left.split_off(&cut);
            let mr = ma.split_off(&cut);
            assert_eq!(contents(&left), ma);
            assert_eq!(contents(&right), mr);
            assert_eq!(left.bytes + right.bytes, d.bytes);
            let mut all = d;
            let (lo, hi) = (b"k010".as_slice(), b"k030".as_slice());
            let gone = all.remove_range(lo, hi);
            let mut m2 = ma;
            m2.extend(mr);
            let removed: Model = m2
                .range(lo.to_vec()..hi.to_vec())
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect();
            for k in removed.keys() {
                m2.remove(k);
            }
            assert_eq!(gone, bytes_of(&removed));
            assert_eq!(contents(&all), m2);
            assert_eq!(all.bytes, bytes_of(&m2));
        }
    }

    #[test]
    fn damaged_encodings_are_errors() {
        let mut p = Points::default();
        for i in 0..20u8 {
            p.push(vec![b'a', i], i as u64, Msg::Put(vec![i; 5]));
        }
        let mut w = Writer::default();
        p.encode(&mut w);
        for cut in 0..w.buf.len() {
            let mut r = Reader::new(&w.buf[..cut], "test");
            if let Ok(n) = r.u32() {
                assert!(Points::decode(&mut r, n as usize).is_err(), "cut at {cut}");
            }
        }
        for i in 4..w.buf.len() {
            let mut b = w.buf.clone();
            b[i] ^= 0xff;
            let mut r = Reader::new(&b, "test");
            let n = r.u32().unwrap() as usize;
            let _ = Points::decode(&mut r, n); // never panics
        }
    }
}
