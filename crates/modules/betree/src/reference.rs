//! The tree's semantics on a `BTreeMap`: what applying an [`Op`] must do, written plainly,
//! for the oracles that check the tree (the model test, the crash explorer). Knows the
//! built-in upserts only.

use crate::{Op, TRUNCATE, WRITE_AT};
use std::collections::BTreeMap;

pub type Map = BTreeMap<Vec<u8>, Vec<u8>>;

/// Applies one operation to the map as the tree must.
///
/// # Panics
/// On an upsert that is not a built-in, or whose argument is shorter than 8 bytes (the
/// oracles issue only valid ones).
pub fn apply(m: &mut Map, op: &Op) {
    match op {
        Op::Put { key, value } => {
            m.insert(key.clone(), value.clone());
        }
        Op::Delete { key } => {
            m.remove(key);
        }
        Op::Upsert { key, func, arg } => {
            let n = u64::from_le_bytes(arg[..8].try_into().expect("8 bytes")) as usize;
            match *func {
                WRITE_AT => {
                    let bytes = &arg[8..];
                    let v = m.entry(key.clone()).or_default();
                    if v.len() < n + bytes.len() {
                        v.resize(n + bytes.len(), 0);
                    }
                    v[n..n + bytes.len()].copy_from_slice(bytes);
                }
                TRUNCATE => {
                    if let Some(v) = m.get_mut(key) {
                        v.resize(n, 0);
                    }
                }
                f => panic!("the reference knows only the built-in upserts, not {f}"),
            }
        }
        Op::DeleteRange { start, end } => {
            let doomed: Vec<Vec<u8>> = m
                .range(start.clone()..end.clone())
                .map(|(k, _)| k.clone())
                .collect();
            for k in doomed {
                m.remove(&k);
            }
        }
        Op::RenamePrefix { from, to } => {
            m.retain(|k, _| !k.starts_with(to));
            let moved: Vec<Vec<u8>> = m.keys().filter(|k| k.starts_with(from)).cloned().collect();
            for k in moved {
                let v = m.remove(&k).expect("listed");
                m.insert([&to[..], &k[from.len()..]].concat(), v);
            }
        }
        Op::CloneRange {
            from,
            to,
            start,
            end,
        } => {
            let within = |s: &[u8]| s >= start.as_slice() && end.as_deref().is_none_or(|e| s < e);
            m.retain(|k, _| !k.strip_prefix(to.as_slice()).is_some_and(within));
            let copies: Vec<(Vec<u8>, Vec<u8>)> = m
                .range(from.clone()..)
                .take_while(|(k, _)| k.starts_with(from))
                .filter(|(k, _)| within(&k[from.len()..]))
                .map(|(k, v)| ([&to[..], &k[from.len()..]].concat(), v.clone()))
                .collect();
            m.extend(copies);
        }
    }
}
