//! Messages: what a write becomes in the tree. A message travels down from the root
//! buffer to the leaf that holds its key and is applied there; a query applies the
//! messages still pending on its root-to-leaf path on top of the leaf's value.

use crate::points::{MsgRef, Points};
use crate::{Error, Result};
use std::borrow::Cow;
use std::collections::HashMap;
use std::sync::Arc;

/// Message sequence number: the order in which operations were issued.
pub type Msn = u64;

/// A message for one key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Msg {
    Put(Vec<u8>),
    Delete,
    /// Apply the registered update function `func` with `arg` to the value.
    Upsert {
        func: u16,
        arg: Vec<u8>,
    },
}

impl Msg {
    /// What a message is charged in a buffer besides its key: its encoded size plus 3
    /// (`points` relies on that to charge a whole group from its header alone).
    pub fn bytes(&self) -> usize {
        match self {
            Msg::Put(v) => v.len() + 16,
            Msg::Delete => 12,
            Msg::Upsert { arg, .. } => arg.len() + 18,
        }
    }
}

/// A range delete: every key in `start..end` (end exclusive).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangeDel {
    pub msn: Msn,
    pub start: Vec<u8>,
    pub end: Vec<u8>,
}

impl RangeDel {
    pub fn covers(&self, key: &[u8]) -> bool {
        self.start.as_slice() <= key && key < self.end.as_slice()
    }
}

/// The messages a parent holds for one child.
///
/// Invariant: a point message inside a range delete of the same buffer is newer than it
/// (a range delete arriving drops the older point messages it covers). So the buffer's
/// effect on a key is: its range deletes first, then its point messages in MSN order.
/// Messages in a buffer are newer than every message below it in the tree (a flush moves
/// a child's whole buffer), so a query applies buffers from the deepest up.
#[derive(Debug, Clone, Default)]
pub struct Buffer {
    pub points: Points,
    pub ranges: Vec<RangeDel>,
}

pub fn point_bytes(key: &[u8], msg: &Msg) -> usize {
    key.len() + msg.bytes()
}

fn range_bytes(r: &RangeDel) -> usize {
    r.start.len() + r.end.len() + 16
}

impl Buffer {
    pub fn is_empty(&self) -> bool {
        self.points.is_empty() && self.ranges.is_empty()
    }

    /// Bytes the buffer's messages take (what flushes are decided by).
    pub fn bytes(&self) -> usize {
        self.points.bytes + self.ranges.iter().map(range_bytes).sum::<usize>()
    }

    /// Adds a point message. A put or delete supersedes what the buffer held for the key.
    pub fn push(&mut self, key: Vec<u8>, msn: Msn, msg: Msg) {
        self.points.push(key, msn, msg);
    }

    /// Adds a range delete (already clipped to this child's keys by the caller), dropping
    /// the older point messages it covers.
    pub fn push_range(&mut self, r: RangeDel) {
        self.points.remove_range(&r.start, &r.end);
        // A range inside an older one of this buffer adds nothing.
        if self
            .ranges
            .iter()
            .any(|o| o.start <= r.start && r.end <= o.end)
        {
            return;
        }
        self.ranges.push(r);
    }

    /// Takes a whole buffer whose messages are all newer than this one's (a flush
    /// into a leaf's delta): its range deletes first (they drop the older messages
    /// they cover), then its point messages merged in. The buffer rule holds after.
    pub fn absorb(&mut self, newer: Buffer) {
        for r in newer.ranges {
            self.push_range(r);
        }
        let mut points = newer.points;
        points.settle();
        let n = points.groups_len();
        if self.points.is_empty() {
            self.points = points;
        } else {
            self.points.merge_range(&points, 0, n);
        }
    }

    /// Whether any point message is an upsert (whose result may be far larger than
    /// the message: a write at an offset).
    pub fn has_upserts(&self) -> bool {
        self.points.has_upserts()
    }

    pub fn covered(&self, key: &[u8]) -> bool {
        self.ranges.iter().any(|r| r.covers(key))
    }

    /// Cuts the buffer at `key`: keeps the messages below it, returns those at or above
    /// it (a range delete across the cut is cut in two). Both keep the buffer rule.
    pub fn split_off(&mut self, key: &[u8]) -> Buffer {
        let mut right = Buffer {
            points: self.points.split_off(key),
            ..Buffer::default()
        };
        let mut left = Vec::new();
        for r in std::mem::take(&mut self.ranges) {
            if r.end.as_slice() <= key {
                left.push(r);
            } else if r.start.as_slice() >= key {
                right.ranges.push(r);
            } else {
                left.push(RangeDel {
                    msn: r.msn,
                    start: r.start,
                    end: key.to_vec(),
                });
                right.ranges.push(RangeDel {
                    msn: r.msn,
                    start: key.to_vec(),
                    end: r.end,
                });
            }
        }
        self.ranges = left;
        right
    }

    /// Takes out the messages for keys in `lo..hi`.
    pub fn extract(&mut self, lo: &[u8], hi: &[u8]) -> Buffer {
        let mut mid = self.split_off(lo);
        let right = mid.split_off(hi);
        self.points.merge_all(right.points);
        self.ranges.extend(right.ranges);
        mid
    }
}

/// An update function: the new value from the old one (`None`: absent) and the
/// message's argument. Returning `None` deletes the key.
pub type UpsertFn =
    Arc<dyn Fn(Option<&[u8]>, &[u8]) -> std::result::Result<Option<Vec<u8>>, String> + Send + Sync>;

/// Built-in upsert: write bytes at an offset of the value, zero-filling any gap
/// (argument: [`write_at_arg`]).
pub const WRITE_AT: u16 = 1;
/// Built-in upsert: truncate (or zero-extend) the value to a length (argument:
/// [`truncate_arg`]); an absent value stays absent.
pub const TRUNCATE: u16 = 2;
/// Ids below this are reserved for built-ins.
pub const FIRST_USER_UPSERT: u16 = 16;

pub fn write_at_arg(offset: u64, bytes: &[u8]) -> Vec<u8> {
    let mut a = Vec::with_capacity(8 + bytes.len());
    a.extend_from_slice(&offset.to_le_bytes());
    a.extend_from_slice(bytes);
    a
}

pub fn truncate_arg(len: u64) -> Vec<u8> {
    len.to_le_bytes().to_vec()
}

fn arg_u64(arg: &[u8]) -> std::result::Result<(u64, &[u8]), String> {
    if arg.len() < 8 {
        return Err(format!("argument of {} bytes is shorter than 8", arg.len()));
    }
    let (n, rest) = arg.split_at(8);
    Ok((u64::from_le_bytes(n.try_into().expect("8 bytes")), rest))
}

/// The update functions a tree knows, by id. Every tree opened on an image must register
/// the functions its messages name; a message naming an unknown one is an error when it
/// is applied, never a panic.
#[derive(Clone)]
pub struct Upserts {
    fns: HashMap<u16, UpsertFn>,
    /// Results longer than this are refused (a value must fit a leaf).
    pub(crate) max_value: usize,
    /// Applications that failed (the value was left unchanged).
    pub(crate) failures: Arc<std::sync::atomic::AtomicU64>,
}

impl std::fmt::Debug for Upserts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut ids: Vec<_> = self.fns.keys().collect();
        ids.sort();
        f.debug_struct("Upserts").field("ids", &ids).finish()
    }
}

/// No value is larger (nodes are at most 64 MiB): the built-in functions refuse what
/// would make one larger before allocating it (a damaged message's offset or length
/// must not ask for terabytes).
const BUILTIN_VALUE_MAX: usize = 64 << 20;

impl Default for Upserts {
    fn default() -> Self {
        let mut fns: HashMap<u16, UpsertFn> = HashMap::new();
        fns.insert(
            WRITE_AT,
            Arc::new(|old: Option<&[u8]>, arg: &[u8]| {
                let (off, bytes) = arg_u64(arg)?;
                let off = usize::try_from(off).map_err(|_| "offset too large".to_string())?;
                let end = off
                    .checked_add(bytes.len())
                    .filter(|&e| e <= BUILTIN_VALUE_MAX)
                    .ok_or_else(|| "offset too large".to_string())?;
                let mut v = old.map(<[u8]>::to_vec).unwrap_or_default();
                if v.len() < end {
                    v.resize(end, 0);
                }
                v[off..end].copy_from_slice(bytes);
                Ok(Some(v))
            }),
        );
        fns.insert(
            TRUNCATE,
            Arc::new(|old: Option<&[u8]>, arg: &[u8]| {
                let (len, _) = arg_u64(arg)?;
                let len = usize::try_from(len)
                    .ok()
                    .filter(|&l| l <= BUILTIN_VALUE_MAX)
                    .ok_or_else(|| "length too large".to_string())?;
                Ok(old.map(|o| {
                    let mut v = o.to_vec();
                    v.resize(len, 0);
                    v
                }))
            }),
        );
        Upserts {
            fns,
            max_value: usize::MAX,
            failures: Arc::default(),
        }
    }
}

impl Upserts {
    /// Registers `f` under `id` (at least [`FIRST_USER_UPSERT`]).
    pub fn register(&mut self, id: u16, f: UpsertFn) -> Result<()> {
        if id < FIRST_USER_UPSERT {
            return Err(Error::Invalid(format!(
                "upsert id {id} is reserved for built-ins (use {FIRST_USER_UPSERT} or more)"
            )));
        }
        self.fns.insert(id, f);
        Ok(())
    }

    pub fn knows(&self, id: u16) -> bool {
        self.fns.contains_key(&id)
    }

    /// Checks a new message's argument where the function's contract is known (the
    /// built-ins), so that a bad one is refused when issued, not found at a flush.
    pub fn check(&self, func: u16, arg: &[u8]) -> Result<()> {
        if !self.knows(func) {
            return Err(Error::UnknownUpsert(func));
        }
        let bad = |why: String| Err(Error::Invalid(format!("upsert {func}: {why}")));
        match func {
            WRITE_AT => match arg_u64(arg) {
                Err(e) => bad(e),
                Ok((off, bytes))
                    if off.saturating_add(bytes.len() as u64) > self.max_value as u64 =>
                {
                    bad(format!(
                        "writing past byte {} of a value (limit {})",
                        off.saturating_add(bytes.len() as u64),
                        self.max_value
                    ))
                }
                Ok(_) => Ok(()),
            },
            TRUNCATE => match arg_u64(arg) {
                Err(e) => bad(e),
                Ok((len, _)) if len > self.max_value as u64 => bad(format!(
                    "length {len} exceeds the value limit {}",
                    self.max_value
                )),
                Ok(_) => Ok(()),
            },
            _ => Ok(()),
        }
    }

    /// Applies one message to a value.
    pub fn apply(&self, old: Option<Vec<u8>>, msg: &Msg) -> Result<Option<Vec<u8>>> {
        match msg {
            Msg::Put(v) => Ok(Some(v.clone())),
            Msg::Delete => Ok(None),
            Msg::Upsert { func, arg } => self.upsert(old, *func, arg),
        }
    }

    /// The length of the value after upsert `func` with `arg`, from the old value's
    /// length alone (`None`: absent), for a scan that reads keys without their values:
    /// known for the built-ins, which it mirrors exactly (a failure, or a result past
    /// the value limit, leaves the value as it was); `None` for a registered function,
    /// whose result needs the old value itself.
    pub fn length_after(&self, old: Option<usize>, func: u16, arg: &[u8]) -> Option<Option<usize>> {
        let keep = Some(old);
        let Ok((n, bytes)) = arg_u64(arg) else {
            return matches!(func, WRITE_AT | TRUNCATE).then_some(old);
        };
        let n = usize::try_from(n).ok();
        let within = |l: usize| l <= BUILTIN_VALUE_MAX && l <= self.max_value;
        match func {
            WRITE_AT => {
                let Some(end) = n.and_then(|o| o.checked_add(bytes.len())) else {
                    return keep;
                };
                if end > BUILTIN_VALUE_MAX {
                    return keep;
                }
                let len = old.unwrap_or(0).max(end);
                Some(if within(len) { Some(len) } else { old })
            }
            TRUNCATE => match (old, n) {
                (None, _) => Some(None),
                (Some(_), Some(len)) if within(len) => Some(Some(len)),
                _ => keep,
            },
            _ => None,
        }
    }

    /// Applies one message read in place.
    pub fn apply_ref(&self, old: Option<Vec<u8>>, msg: MsgRef) -> Result<Option<Vec<u8>>> {
        match msg {
            MsgRef::Put(v) => Ok(Some(v.to_vec())),
            MsgRef::Delete => Ok(None),
            MsgRef::Upsert { func, arg } => self.upsert(old, func, arg),
        }
    }

    /// What a key's messages, oldest first, make of its value `v`: borrowed from the
    /// messages or `v` until an upsert must compute a new one.
    pub fn apply_all<'a>(
        &self,
        mut v: Option<Cow<'a, [u8]>>,
        msgs: impl Iterator<Item = MsgRef<'a>>,
    ) -> Result<Option<Cow<'a, [u8]>>> {
        for m in msgs {
            v = match m {
                MsgRef::Put(x) => Some(Cow::Borrowed(x)),
                MsgRef::Delete => None,
                MsgRef::Upsert { .. } => self.apply_ref(v.map(Cow::into_owned), m)?.map(Cow::Owned),
            };
        }
        Ok(v)
    }

    fn upsert(&self, old: Option<Vec<u8>>, func: u16, arg: &[u8]) -> Result<Option<Vec<u8>>> {
        let f = self.fns.get(&func).ok_or(Error::UnknownUpsert(func))?;
        // The message was accepted and logged long ago: a function that fails on this
        // value leaves it unchanged (and is counted) rather than wedging every later
        // flush of the node.
        let why = match f(old.as_deref(), arg) {
            Ok(Some(v)) if v.len() > self.max_value => {
                format!(
                    "result of {} bytes exceeds the value limit {}",
                    v.len(),
                    self.max_value
                )
            }
            Ok(new) => return Ok(new),
            Err(e) => e,
        };
        self.failures
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        tracing::warn!(func, "upsert left the value unchanged: {why}");
        Ok(old)
    }
}
