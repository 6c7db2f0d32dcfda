//! A linearizability checker for histories of block reads and writes, for the
//! simulation and the fault tests (issue 49). Each block is a register, and
//! linearizability is compositional (a history is linearizable exactly when its
//! restriction to every block is), so the check runs per block: the Wing–Gong search
//! with Lowe's memoization of (operations linearized, register value), which prunes the
//! orders that reach a state already explored.
//!
//! A write whose outcome the client never learned (a timeout, a crash) may have taken
//! effect at any time after it was invoked, or never: it is given a completion at the
//! end of time, where linearizing it last is the same as its never having happened. A
//! read that got no answer observed nothing and is left out by the caller.

use std::collections::HashSet;

/// What an operation did: a write of a value, or a read that returned one. Values are
/// names for block contents (a write id, a checksum); 0 is the block before any write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Write(u64),
    Read(u64),
}

/// One operation: on which block, what, when it was invoked and when it completed
/// (`None`: the outcome is unknown; only for writes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Op {
    pub block: u64,
    pub kind: Kind,
    pub invoke: u64,
    pub complete: Option<u64>,
}

/// A block whose history has no linearization.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("block {block}: {ops} operations have no linearization (a read returned {value:#x}, which no order of the writes explains)")]
pub struct Violation {
    pub block: u64,
    pub ops: usize,
    /// A read the search could not place (the one it failed at last).
    pub value: u64,
}

/// Checks a history; the first block without a linearization is the error. Ops of any
/// block may come in any order.
pub fn check(ops: &[Op]) -> Result<(), Violation> {
    let mut blocks: Vec<u64> = ops.iter().map(|o| o.block).collect();
    blocks.sort_unstable();
    blocks.dedup();
    for b in blocks {
        let mine: Vec<Op> = ops.iter().filter(|o| o.block == b).copied().collect();
        check_register(b, &mine)?;
    }
    Ok(())
}

/// One entry of the event list: an operation's call or return.
#[derive(Clone, Copy)]
struct Event {
    op: usize,
    call: bool,
    /// For a call: the index of its return event.
    ret: usize,
}

fn check_register(block: u64, ops: &[Op]) -> Result<(), Violation> {
    let n = ops.len();
    if n == 0 {
        return Ok(());
    }
    // Events by time; at equal times calls before returns (overlap, the permissive
    // reading of a tie).
    let mut order: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, o) in ops.iter().enumerate() {
        let end = o.complete.unwrap_or(u64::MAX).max(o.invoke);
        order.push((o.invoke, true, i));
        order.push((end, false, i));
    }
    order.sort_by_key(|&(t, call, i)| (t, !call, i));
    let mut events: Vec<Event> = order
        .iter()
        .map(|&(_, call, op)| Event { op, call, ret: 0 })
        .collect();
    let mut ret_of = vec![0usize; n];
    for (k, e) in events.iter().enumerate() {
        if !e.call {
            ret_of[e.op] = k;
        }
    }
    for e in events.iter_mut() {
        if e.call {
            e.ret = ret_of[e.op];
        }
    }
    // A doubly linked list over the events in time order, with a head sentinel at
    // index m; END past the last.
    const END: usize = usize::MAX;
    let m = events.len();
    let head = m;
    let mut next: Vec<usize> = (0..=m)
        .map(|k| if k + 1 < m { k + 1 } else { END })
        .collect();
    next[head] = 0;
    let mut prev: Vec<usize> = (0..=m).map(|k| if k == 0 { head } else { k - 1 }).collect();
    prev[head] = head;
    let unlink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, k: usize| {
        let (p, x) = (prev[k], next[k]);
        next[p] = x;
        if x != END {
            prev[x] = p;
        }
    };
    let relink = |next: &mut Vec<usize>, prev: &mut Vec<usize>, k: usize| {
        let (p, x) = (prev[k], next[k]);
        next[p] = k;
        if x != END {
            prev[x] = k;
        }
    };
    let words = n.div_ceil(64);
    let mut done = vec![0u64; words];
    let mut seen: HashSet<(Vec<u64>, u64)> = HashSet::new();
    let mut stack: Vec<(usize, u64)> = Vec::new();
    let mut state = 0u64;
    let mut at = next[head];
    let mut last_read = 0;
    while next[head] != END {
        if at != END && events[at].call {
            let e = events[at];
            let after = match ops[e.op].kind {
                Kind::Write(v) => Some(v),
                Kind::Read(v) if v == state => Some(state),
                Kind::Read(v) => {
                    last_read = v;
                    None
                }
            };
            if let Some(s2) = after {
                let mut d2 = done.clone();
                d2[e.op / 64] |= 1 << (e.op % 64);
                if seen.insert((d2.clone(), s2)) {
                    stack.push((at, state));
                    state = s2;
                    done = d2;
                    unlink(&mut next, &mut prev, e.ret);
                    unlink(&mut next, &mut prev, at);
                    at = next[head];
                    continue;
                }
            }
            at = next[at];
            continue;
        }
        // An operation returned before it was linearized, or only returns are left
        // ahead: this order fails; back up to the last operation linearized.
        let Some((k, s)) = stack.pop() else {
            return Err(Violation {
                block,
                ops: n,
                value: last_read,
            });
        };
        let op = events[k].op;
        done[op / 64] &= !(1 << (op % 64));
        state = s;
        relink(&mut next, &mut prev, events[k].ret);
        relink(&mut next, &mut prev, k);
        at = next[k];
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn w(v: u64, a: u64, b: Option<u64>) -> Op {
        Op {
            block: 0,
            kind: Kind::Write(v),
            invoke: a,
            complete: b,
        }
    }
    fn r(v: u64, a: u64, b: u64) -> Op {
        Op {
            block: 0,
            kind: Kind::Read(v),
            invoke: a,
            complete: Some(b),
        }
    }

    #[test]
    fn sequential_and_overlapping_histories() {
        assert!(check(&[w(1, 0, Some(1)), r(1, 2, 3)]).is_ok());
        // A stale read after the write completed.
        assert!(check(&[w(1, 0, Some(1)), r(0, 2, 3)]).is_err());
        // A read overlapping the write may see either.
        assert!(check(&[w(1, 0, Some(5)), r(0, 1, 2), r(1, 3, 4)]).is_ok());
        // But not new then old (no going back).
        assert!(check(&[w(1, 0, Some(10)), r(1, 1, 2), r(0, 3, 4)]).is_err());
        // A value never written.
        assert!(check(&[w(1, 0, Some(1)), r(7, 2, 3)]).is_err());
    }

    #[test]
    fn a_write_of_unknown_outcome_may_or_may_not_have_happened() {
        assert!(check(&[w(1, 0, None), r(0, 5, 6)]).is_ok());
        assert!(check(&[w(1, 0, None), r(1, 5, 6)]).is_ok());
        // But once seen, it stays.
        assert!(check(&[w(1, 0, None), r(1, 5, 6), r(0, 7, 8)]).is_err());
        // A lost acknowledged write is caught even beside unknown ones.
        assert!(check(&[w(1, 0, Some(1)), w(2, 0, None), r(0, 9, 10)]).is_err());
    }

    #[test]
    fn blocks_are_checked_apart() {
        let mut h = vec![w(1, 0, Some(1)), r(1, 2, 3)];
        h.push(Op {
            block: 9,
            kind: Kind::Read(5),
            invoke: 0,
            complete: Some(1),
        });
        assert_eq!(check(&h).unwrap_err().block, 9);
    }

    /// Every order of the ops that respects real time, tried: the reference the search
    /// must agree with on small histories.
    fn brute(ops: &[Op]) -> bool {
        fn go(ops: &[Op], used: &mut Vec<bool>, state: u64) -> bool {
            if used.iter().all(|&u| u) {
                return true;
            }
            for i in 0..ops.len() {
                if used[i] {
                    continue;
                }
                // i may go next only if no unused op completed before i was invoked.
                let blocked = (0..ops.len()).any(|j| {
                    !used[j] && j != i && ops[j].complete.is_some_and(|c| c < ops[i].invoke)
                });
                if blocked {
                    continue;
                }
                let s2 = match ops[i].kind {
                    Kind::Write(v) => v,
                    Kind::Read(v) if v == state => state,
                    Kind::Read(_) => continue,
                };
                used[i] = true;
                if go(ops, used, s2) {
                    return true;
                }
                used[i] = false;
            }
            false
        }
        go(ops, &mut vec![false; ops.len()], 0)
    }

    fn op_s() -> impl Strategy<Value = Op> {
        (any::<bool>(), 0u64..3, 0u64..12, 0u64..6, any::<bool>()).prop_map(
            |(write, v, a, len, unknown)| Op {
                block: 0,
                kind: if write {
                    Kind::Write(v + 1)
                } else {
                    Kind::Read(v)
                },
                invoke: a,
                complete: if write && unknown {
                    None
                } else {
                    Some(a + len)
                },
            },
        )
    }

    /// A history made linearizable by construction: four clients issue operations back
    /// to back, each taking effect at a point inside its interval; reads return what
    /// the points' order gives. Hundreds of overlapping operations are checked quickly
    /// (the memoization keeps the search near linear on such histories), and the same
    /// history with one read made stale is refused.
    fn concurrent(steps: &[(u8, bool, u64, u64)]) -> Vec<Op> {
        let mut clock = [0u64; 4];
        let mut points: Vec<(u64, usize)> = Vec::new();
        let mut ops = Vec::new();
        for (i, &(c, write, len, at)) in steps.iter().enumerate() {
            let c = c as usize % 4;
            let start = clock[c] + 1;
            let end = start + len;
            clock[c] = end;
            // Distinct points: a tie would leave the constructed order ambiguous.
            points.push(((start + at % (len + 1)) * 1000 + i as u64, i));
            ops.push(Op {
                block: 0,
                kind: if write {
                    Kind::Write(i as u64 + 1)
                } else {
                    Kind::Read(0)
                },
                invoke: start * 1000,
                complete: Some(end * 1000 + 999),
            });
        }
        points.sort_unstable();
        let mut value = 0;
        for (_, i) in points {
            match &mut ops[i].kind {
                Kind::Write(v) => value = *v,
                Kind::Read(v) => *v = value,
            }
        }
        ops
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]
        #[test]
        fn long_concurrent_histories_are_checked(
            steps in proptest::collection::vec((any::<u8>(), any::<bool>(), 0u64..20, any::<u64>()), 300..600),
        ) {
            let ops = concurrent(&steps);
            prop_assert!(check(&ops).is_ok());
            // A read made stale: it returns w1's value though w2 was written after w1
            // completed and completed before the read began.
            let writes: Vec<usize> = (0..ops.len()).filter(|&i| matches!(ops[i].kind, Kind::Write(_))).collect();
            let end = |i: usize| ops[i].complete.unwrap();
            let stale = (0..ops.len()).filter(|&k| matches!(ops[k].kind, Kind::Read(_))).find_map(|k| {
                writes.iter().find_map(|&w2| {
                    (end(w2) < ops[k].invoke).then(|| {
                        writes.iter().find(|&&w1| end(w1) < ops[w2].invoke).map(|&w1| (k, w1))
                    }).flatten()
                })
            });
            if let Some((k, w1)) = stale {
                let Kind::Write(v) = ops[w1].kind else { unreachable!() };
                let mut bad = ops.clone();
                bad[k].kind = Kind::Read(v);
                prop_assert!(check(&bad).is_err());
            }
        }
    }

    proptest! {
        #[test]
        fn agrees_with_trying_every_order(ops in proptest::collection::vec(op_s(), 1..7)) {
            prop_assert_eq!(check(&ops).is_ok(), brute(&ops), "{:?}", ops);
        }
    }
}
