//! Maps that can take back what an atomic batch did to them.
//!
//! `apply_batch` must leave the in-memory state as it found it when an operation of
//! the batch fails. Copying the whole state first cost time in proportion to every
//! inode the mount has met (a namespace service that merged a million creates copied
//! a million nodes per batch); instead, while a batch runs, each of the big maps keeps
//! the previous value of every key the batch touches, the first time it touches it,
//! and a rollback puts those back. Reads go straight to the map (`Deref`); only
//! `get_mut`, `insert`, `remove` and `replace` change it, so nothing can bypass the
//! record.

use rustc_hash::FxHashMap;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hash};
use std::ops::Deref;

/// The operations of a map the record needs.
pub(crate) trait Map: Default + Clone {
    type K: Clone + Eq + Hash + Ord;
    type V: Clone;
    fn get_mut_(&mut self, k: &Self::K) -> Option<&mut Self::V>;
    fn get_(&self, k: &Self::K) -> Option<&Self::V>;
    fn insert_(&mut self, k: Self::K, v: Self::V) -> Option<Self::V>;
    fn remove_(&mut self, k: &Self::K) -> Option<Self::V>;
}

/// Both kinds of map the state keeps have the same four methods under the same names.
macro_rules! map {
    ([$($extra:tt)*] $m:ty) => {
        impl<K: Clone + Eq + Hash + Ord, V: Clone, $($extra)*> Map for $m {
            type K = K;
            type V = V;
            fn get_mut_(&mut self, k: &K) -> Option<&mut V> {
                self.get_mut(k)
            }
            fn get_(&self, k: &K) -> Option<&V> {
                self.get(k)
            }
            fn insert_(&mut self, k: K, v: V) -> Option<V> {
                self.insert(k, v)
            }
            fn remove_(&mut self, k: &K) -> Option<V> {
                self.remove(k)
            }
        }
    };
}

map!([S: BuildHasher + Default + Clone] HashMap<K, V, S>);
map!([] BTreeMap<K, V>);

/// What a batch changed: each touched key's value before it (None: absent), or the
/// whole map when the batch replaced it.
#[derive(Clone)]
enum Record<M: Map> {
    Keys(FxHashMap<M::K, Option<M::V>>),
    Whole(M),
}

/// A map whose changes during a batch can be taken back.
#[derive(Clone, Default)]
pub(crate) struct Undoable<M: Map> {
    map: M,
    record: Option<Record<M>>,
}

impl<M: Map> Deref for Undoable<M> {
    type Target = M;
    fn deref(&self) -> &M {
        &self.map
    }
}

impl<M: Map> Undoable<M> {
    fn note(&mut self, k: &M::K) {
        if let Some(Record::Keys(before)) = &mut self.record {
            if !before.contains_key(k) {
                before.insert(k.clone(), self.map.get_(k).cloned());
            }
        }
    }

    pub fn get_mut(&mut self, k: &M::K) -> Option<&mut M::V> {
        self.note(k);
        self.map.get_mut_(k)
    }

    pub fn insert(&mut self, k: M::K, v: M::V) -> Option<M::V> {
        self.note(&k);
        self.map.insert_(k, v)
    }

    pub fn remove(&mut self, k: &M::K) -> Option<M::V> {
        self.note(k);
        self.map.remove_(k)
    }

    /// Puts `map` in place of the whole map (kept whole for a rollback: rare).
    pub fn replace(&mut self, map: M) {
        if let Some(Record::Keys(_)) = &self.record {
            let mut whole = self.map.clone();
            if let Some(Record::Keys(before)) = self.record.take() {
                restore(&mut whole, before);
            }
            self.record = Some(Record::Whole(whole));
        }
        self.map = map;
    }

    /// From now on, every change is recorded (room made for about `keys` of them).
    pub fn begin(&mut self, keys: usize) {
        let mut before = FxHashMap::default();
        before.reserve(keys);
        self.record = Some(Record::Keys(before));
    }

    /// The changes since `begin` stay.
    pub fn commit(&mut self) {
        self.record = None;
    }

    /// The map as it was at `begin`.
    pub fn rollback(&mut self) {
        match self.record.take() {
            Some(Record::Keys(before)) => restore(&mut self.map, before),
            Some(Record::Whole(m)) => self.map = m,
            None => {}
        }
    }
}

fn restore<M: Map>(map: &mut M, before: FxHashMap<M::K, Option<M::V>>) {
    for (k, v) in before {
        match v {
            Some(v) => {
                map.insert_(k, v);
            }
            None => {
                map.remove_(&k);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_rollback_restores_every_key_touched_and_a_commit_keeps_them() {
        let mut m: Undoable<HashMap<u64, String>> = Undoable::default();
        m.insert(1, "one".into());
        m.insert(2, "two".into());
        m.begin(4);
        m.insert(3, "three".into());
        *m.get_mut(&1).unwrap() = "uno".into();
        m.remove(&2);
        m.insert(2, "again".into());
        m.remove(&3);
        assert_eq!(m.get(&2).map(String::as_str), Some("again"));
        m.rollback();
        let mut now: Vec<_> = m.iter().map(|(k, v)| (*k, v.clone())).collect();
        now.sort();
        assert_eq!(now, vec![(1, "one".to_string()), (2, "two".to_string())]);
        m.begin(4);
        m.insert(4, "four".into());
        m.commit();
        m.rollback();
        assert_eq!(m.len(), 3);
    }

    #[test]
    fn a_replaced_map_comes_back_whole() {
        let mut m: Undoable<BTreeMap<Vec<u8>, u64>> = Undoable::default();
        m.insert(b"a".to_vec(), 1);
        m.begin(4);
        m.insert(b"b".to_vec(), 2);
        m.replace(BTreeMap::from([(b"z".to_vec(), 9)]));
        m.insert(b"y".to_vec(), 8);
        m.rollback();
        assert_eq!(
            m.iter().map(|(k, v)| (k.clone(), *v)).collect::<Vec<_>>(),
            vec![(b"a".to_vec(), 1)]
        );
    }
}
