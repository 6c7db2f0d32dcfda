//! Crash states cut from a recorded history (see `quilt_block::RecordingLog`). A state is
//! a prefix length plus the choice of which writes after the prefix's last flush reached
//! the disk (a volatile write cache may persist any subset of them; keeping an older
//! write to a block and dropping a newer one is the reordering case).

use crate::workload::Rng;
use quilt_block::{LogEntry, RecordingLog};
use std::collections::BTreeMap;

/// One crash state.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct CrashState {
    /// Entries of the log replayed (writes after the last flush among them are filtered
    /// by `kept`).
    pub len: usize,
    /// Indices of the in-flight writes that persisted (all writes before the last flush
    /// always do).
    pub kept: Vec<usize>,
    /// How the state was chosen.
    pub why: &'static str,
    /// Other cuts that leave the very same disk image (a mark with no write since the
    /// previous cut, a flush whose writes all landed). The image is checked once; the
    /// persistence oracle holds it to the promises of every one of these cuts.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub also: Vec<usize>,
}

impl CrashState {
    pub fn keeps(&self, i: usize) -> bool {
        self.kept.binary_search(&i).is_ok()
    }
}

/// Up to this many writes in flight, every subset is tried (bounded exhaustive).
pub const EXHAUSTIVE_MAX: usize = 4;
/// Past it, this many random subsets besides "all" and "none".
pub const RANDOM_SUBSETS: usize = 6;

/// The writes a state applies, in a canonical form: how many of the log's writes are
/// applied from the start without a gap, and the applied writes past that gap. Two
/// states with the same key leave the same image.
fn image_key(
    log: &RecordingLog,
    writes: &[usize],
    len: usize,
    kept: &[usize],
) -> (usize, Vec<usize>) {
    let durable = log.durable_prefix(len);
    let mut applied: Vec<usize> = writes.iter().copied().filter(|&i| i < durable).collect();
    applied.extend_from_slice(kept);
    let run = applied
        .iter()
        .zip(writes)
        .take_while(|(a, w)| a == w)
        .count();
    (run, applied[run..].to_vec())
}

/// Every distinct state worth checking: each prefix ending at a flush or a mark (all
/// writes in), the whole log, and just before each flush, subsets of the writes in
/// flight. Cuts that leave the same image are one state (see [`CrashState::also`]).
pub fn generate(log: &RecordingLog, rng: &mut Rng) -> Vec<CrashState> {
    let writes: Vec<usize> = (0..log.entries.len())
        .filter(|&i| matches!(log.entries[i], LogEntry::Write { .. }))
        .collect();
    let mut out: Vec<CrashState> = Vec::new();
    let mut seen: BTreeMap<(usize, Vec<usize>), usize> = BTreeMap::new();
    let mut push = |len: usize, kept: Vec<usize>, why: &'static str, out: &mut Vec<CrashState>| {
        let key = image_key(log, &writes, len, &kept);
        match seen.get(&key) {
            Some(&at) => {
                let s = &mut out[at];
                if s.len != len && !s.also.contains(&len) {
                    s.also.push(len);
                }
            }
            None => {
                seen.insert(key, out.len());
                out.push(CrashState {
                    len,
                    kept,
                    why,
                    also: Vec::new(),
                });
            }
        }
    };
    for len in log.crash_points() {
        let all = log.in_flight(len);
        let why = match len.checked_sub(1).map(|i| &log.entries[i]) {
            Some(LogEntry::Flush) => "after a flush",
            Some(LogEntry::Mark(m)) if m.starts_with("fsync") => "after an fsync",
            Some(LogEntry::Mark(_)) => "before an operation",
            _ => "end of the run",
        };
        push(len, all, why, &mut out);
    }
    for (f, e) in log.entries.iter().enumerate() {
        if !matches!(e, LogEntry::Flush) {
            continue;
        }
        let w = log.in_flight(f);
        if w.is_empty() {
            continue;
        }
        if w.len() <= EXHAUSTIVE_MAX {
            for mask in 0u32..(1 << w.len()) {
                let kept = w
                    .iter()
                    .enumerate()
                    .filter(|(b, _)| mask & (1 << b) != 0)
                    .map(|(_, &i)| i)
                    .collect();
                push(f, kept, "before a flush (every subset)", &mut out);
            }
        } else {
            push(f, Vec::new(), "before a flush (none in flight)", &mut out);
            push(f, w.clone(), "before a flush (all in flight)", &mut out);
            for _ in 0..RANDOM_SUBSETS {
                let kept = w.iter().copied().filter(|_| rng.below(2) == 1).collect();
                push(f, kept, "before a flush (random subset)", &mut out);
            }
        }
    }
    out
}

/// At most `n` of `states`, chosen evenly (the last state always among them).
pub fn sample(mut states: Vec<CrashState>, n: usize, rng: &mut Rng) -> Vec<CrashState> {
    if states.len() <= n {
        return states;
    }
    let last = states.pop();
    let mut keep = Vec::with_capacity(n);
    // A random subset of indices of size n - 1, in order.
    let mut idx: Vec<usize> = (0..states.len()).collect();
    for i in 0..n.saturating_sub(1) {
        let j = i + rng.below((idx.len() - i) as u64) as usize;
        idx.swap(i, j);
    }
    idx.truncate(n.saturating_sub(1));
    idx.sort_unstable();
    for i in idx {
        keep.push(states[i].clone());
    }
    keep.extend(last);
    keep
}

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_block::{BlockDevice, MemDevice, RecordingDevice};
    use quilt_block::{BlockDeviceExt, WriteClass};
    use std::sync::Arc;

    #[test]
    fn states_cover_prefixes_and_every_small_subset() {
        let rec = RecordingDevice::new(Arc::new(MemDevice::new(512, 16).unwrap()), 1 << 20);
        let b = vec![1u8; 512];
        rec.write(0, &b, WriteClass::Metadata).unwrap();
        rec.write(1, &b, WriteClass::Metadata).unwrap();
        rec.flush().unwrap();
        rec.mark("fsync-1");
        rec.write(2, &b, WriteClass::Metadata).unwrap();
        rec.write(3, &b, WriteClass::Metadata).unwrap();
        rec.write(4, &b, WriteClass::Metadata).unwrap();
        rec.flush().unwrap();
        let log = rec.take_log();
        let states = generate(&log, &mut Rng::new(1));
        // Before the first flush: 4 subsets of 2 writes, but "both" is the image after
        // the flush. Before the second: 8 subsets of 3, but "none" is the image after the
        // first flush and "all" the one after the second.
        assert_eq!(states.iter().filter(|s| s.len == 2).count(), 3);
        assert_eq!(states.iter().filter(|s| s.len == 7).count(), 6);
        let after_first = states.iter().find(|s| s.len == 3).unwrap();
        assert_eq!(
            after_first.also,
            vec![4, 2, 7],
            "the fsync mark, the full subset before the first flush and the empty one before the second leave the same image"
        );
        let n = states.len();
        let mut keys: Vec<_> = states
            .iter()
            .map(|s| {
                let dev = MemDevice::new(512, 16).unwrap();
                log.replay_subset(s.len, &dev, |i| s.keeps(i)).unwrap();
                dev.to_vec()
            })
            .collect();
        keys.sort();
        keys.dedup();
        assert_eq!(keys.len(), n, "every state leaves a different image");
        assert!(states.iter().any(|s| s.len == log.entries.len()));
        let sampled = sample(states.clone(), 5, &mut Rng::new(2));
        assert_eq!(sampled.len(), 5);
        assert_eq!(sampled.last(), states.last());
    }
}
