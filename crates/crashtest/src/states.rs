//! Crash states cut from a recorded history (see `quilt_block::RecordingLog`). A state is
//! a prefix length plus the choice of which writes after the prefix's last flush reached
//! the disk (a volatile write cache may persist any subset of them; keeping an older
//! write to a block and dropping a newer one is the reordering case).

use crate::workload::Rng;
use quilt_block::{LogEntry, RecordingLog};
use std::collections::BTreeSet;

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

/// Every state worth checking: each prefix ending at a flush or a mark (all writes in),
/// the whole log, and just before each flush, subsets of the writes in flight.
pub fn generate(log: &RecordingLog, rng: &mut Rng) -> Vec<CrashState> {
    let mut out = Vec::new();
    let mut seen: BTreeSet<(usize, Vec<usize>)> = BTreeSet::new();
    let mut push = |len: usize, kept: Vec<usize>, why: &'static str, out: &mut Vec<CrashState>| {
        if seen.insert((len, kept.clone())) {
            out.push(CrashState { len, kept, why });
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
    use std::sync::Arc;

    #[test]
    fn states_cover_prefixes_and_every_small_subset() {
        let rec = RecordingDevice::new(Arc::new(MemDevice::new(512, 16).unwrap()), 1 << 20);
        let b = vec![1u8; 512];
        rec.write(0, &b).unwrap();
        rec.write(1, &b).unwrap();
        rec.flush().unwrap();
        rec.mark("fsync-1");
        rec.write(2, &b).unwrap();
        rec.write(3, &b).unwrap();
        rec.write(4, &b).unwrap();
        rec.flush().unwrap();
        let log = rec.take_log();
        let states = generate(&log, &mut Rng::new(1));
        // Before the first flush: 4 subsets of 2 writes; before the second: 8 of 3.
        assert_eq!(states.iter().filter(|s| s.len == 2).count(), 4);
        assert_eq!(states.iter().filter(|s| s.len == 7).count(), 8);
        assert!(states
            .iter()
            .any(|s| s.why == "after an fsync" && s.len == 4));
        assert!(states.iter().any(|s| s.len == log.entries.len()));
        let sampled = sample(states.clone(), 5, &mut Rng::new(2));
        assert_eq!(sampled.len(), 5);
        assert_eq!(sampled.last(), states.last());
    }
}
