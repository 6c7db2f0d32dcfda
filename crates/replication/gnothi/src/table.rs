//! The replicated metadata table: per block, the version and checksum of its latest
//! committed write and which replicas hold that version's data. Every replica applies
//! the same [`Command`]s in log order and so holds the same table; what a replica
//! must do on its own disks (write a block home, free a reserve slot, fetch a block it
//! lacks) follows from the table and its own id.
//!
//! A command comes from the agreement log: it is checked whole before it changes
//! anything, and a bad one is refused the same way on every replica (a
//! [`CommandError`], the table unchanged), never a panic.

use crate::geometry::{Geometry, ReplicaId};
use serde::{Deserialize, Serialize};

/// The agreement log index of the write that wrote a block; 0: never written (the
/// block reads as zeros).
pub type Version = u64;

/// A client's name for one write: what replicas file its data under until the write's
/// metadata commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct WriteId {
    pub client: u64,
    pub seq: u64,
}

/// A set of replicas, as a bit mask (bit `r`: replica `r`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Holders(pub u16);

impl Holders {
    pub fn contains(self, r: ReplicaId) -> bool {
        r < 16 && self.0 & (1 << r) != 0
    }
    pub fn insert(&mut self, r: ReplicaId) {
        self.0 |= 1 << r;
    }
    pub fn remove(&mut self, r: ReplicaId) {
        self.0 &= !(1 << r);
    }
    pub fn len(self) -> u32 {
        self.0.count_ones()
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
    pub fn iter(self) -> impl Iterator<Item = ReplicaId> {
        (0..16).filter(move |&r| self.contains(r))
    }
}

/// What the table knows of one block.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct BlockMeta {
    pub version: Version,
    /// crc32c of the block's data at `version`.
    pub checksum: u32,
    /// Replicas whose copy of this version is durable, at home or in their reserve.
    pub holders: Holders,
    /// Of the holders, those keeping it in their reserve (they do not prefer the slice).
    pub reserve: Holders,
}

/// Where a replica made a write's data durable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Stored {
    /// At home: the replica prefers the block's slice.
    Home(ReplicaId),
    /// In its reserve, standing in for a preferred replica that could not take it.
    Reserve(ReplicaId),
}

impl Command {
    /// The command a fence carries, and the fence's epoch (`None`: not fenced).
    pub fn unfenced(&self) -> (&Command, Option<u64>) {
        match self {
            Command::Fenced { epoch, command } => (command, Some(*epoch)),
            c => (c, None),
        }
    }
}

impl Stored {
    pub fn replica(self) -> ReplicaId {
        match self {
            Stored::Home(r) | Stored::Reserve(r) => r,
        }
    }
}

/// An entry of the agreement log.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    /// `checksums.len()` blocks from `first` now hold the write's data, durable on
    /// `stored` (at least `f+1` replicas, before the client was answered).
    Write {
        write: WriteId,
        first: u64,
        checksums: Vec<u32>,
        stored: Vec<Stored>,
    },
    /// `replica` fetched these blocks at these versions and made them durable at home
    /// (Phase 2, or a repair after a checksum mismatch). A block written since keeps
    /// its newer holders.
    Repaired {
        replica: ReplicaId,
        blocks: Vec<(u64, Version)>,
    },
    /// The reserve copies of these blocks at these versions may go: every preferred
    /// replica holds them. A block written since has no reserve copy of that version.
    Reclaim { blocks: Vec<(u64, Version)> },
    /// `replica` no longer holds these blocks at these versions (found missing or
    /// damaged; a block written since keeps its newer holders), or, with `None`, any
    /// block (its data device was replaced by an empty one: re-replication).
    Lost {
        replica: ReplicaId,
        blocks: Option<Vec<(u64, Version)>>,
    },
    /// `command`, applied only if no slot changed servers since membership `epoch`
    /// (the log index of the membership its proposer routed by). A write stored on the
    /// server a slot had before, or a repair reported by it, names copies the slot's
    /// new server does not have: refused (`StaleMembership`), and the proposer routes
    /// again. The replica applies the fence (`replica.rs`); the table never sees one.
    /// (Last, so that logs written before it existed decode the same.)
    Fenced { epoch: u64, command: Box<Command> },
    /// These writes' staged data is let go (a data log out of room): any of them
    /// applied after this entry is refused (`CommandError::Abandoned`) and its client
    /// writes it again. Before this entry is applied no replica drops a staged write
    /// that may yet commit: which comes first in the log decides, alike everywhere.
    /// The replica applies it (its sessions and staged data); the table ignores it.
    Abandon { writes: Vec<WriteId> },
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
#[non_exhaustive]
pub enum CommandError {
    #[error("blocks {first}..{end} are outside the volume ({blocks} blocks)")]
    OutOfRange { first: u64, end: u64, blocks: u64 },
    #[error("a write of no blocks")]
    EmptyWrite,
    #[error("replica {0} is not in the volume")]
    NoSuchReplica(ReplicaId),
    #[error("replica {0} is named twice as holding the write")]
    TwiceStored(ReplicaId),
    #[error("the write is durable on {got} replicas; it needs {want}")]
    TooFewCopies { got: u32, want: u32 },
    #[error("replica {replica} does not prefer block {block}'s slice: its copy is a reserve copy")]
    NotPreferred { replica: ReplicaId, block: u64 },
    #[error(
        "replica {replica} prefers block {block}'s slice: its copy is at home, not in reserve"
    )]
    PreferredInReserve { replica: ReplicaId, block: u64 },
    #[error("log index {index} is not past block {block}'s version {version}")]
    StaleIndex {
        index: Version,
        block: u64,
        version: Version,
    },
    #[error("routed by membership {epoch}; a server was replaced since (membership {current})")]
    StaleMembership { epoch: u64, current: u64 },
    #[error("a fenced command inside a fence, or one that reached the table unchecked")]
    Unfenced,
    #[error("the write's staged data was let go before it committed (a replica's data log ran out of room); write it again")]
    Abandoned,
}

/// What applying a command asks of each replica beyond the table: reserve copies that
/// became garbage, per block and holder (a newer write replaced them, or a reclaim let
/// them go). Each holder frees its slot.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Applied {
    /// Block, the version of the reserve copies that became garbage, their holders.
    pub reserve_freed: Vec<(u64, Version, Holders)>,
}

/// The table: one [`BlockMeta`] per block of the volume.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct MetaTable {
    geometry: Geometry,
    blocks: Vec<BlockMeta>,
    /// The last log index applied.
    applied: Version,
}

impl MetaTable {
    /// An empty volume: every block unwritten.
    pub fn new(geometry: Geometry) -> MetaTable {
        MetaTable {
            geometry,
            blocks: vec![BlockMeta::default(); geometry.blocks as usize],
            applied: 0,
        }
    }

    pub fn geometry(&self) -> &Geometry {
        &self.geometry
    }

    /// Counts entry `index` as applied without a change (a command refused before the
    /// table saw it).
    pub fn note_applied(&mut self, index: Version) {
        self.applied = self.applied.max(index);
    }

    /// Whether a table that came from elsewhere (a snapshot) has one entry per block
    /// of its geometry, as every method here assumes.
    pub fn is_whole(&self) -> bool {
        self.blocks.len() as u64 == self.geometry.blocks
    }

    /// The last log index applied.
    pub fn applied(&self) -> Version {
        self.applied
    }

    /// What the table knows of `block` (`None` past the volume's end).
    pub fn meta(&self, block: u64) -> Option<&BlockMeta> {
        self.blocks.get(usize::try_from(block).ok()?)
    }

    /// Checks `cmd` as entry `index` would be applied: `Ok` exactly when `apply` would
    /// change the table. The leader checks before it proposes.
    pub fn check(&self, index: Version, cmd: &Command) -> Result<(), CommandError> {
        let g = &self.geometry;
        let replica = |r: ReplicaId| {
            if r < g.replicas() {
                Ok(())
            } else {
                Err(CommandError::NoSuchReplica(r))
            }
        };
        let block = |b: u64| {
            if b < g.blocks {
                Ok(())
            } else {
                Err(CommandError::OutOfRange {
                    first: b,
                    end: b.saturating_add(1),
                    blocks: g.blocks,
                })
            }
        };
        match cmd {
            Command::Write {
                first,
                checksums,
                stored,
                ..
            } => {
                if checksums.is_empty() {
                    return Err(CommandError::EmptyWrite);
                }
                let end = first.saturating_add(checksums.len() as u64);
                if end > g.blocks {
                    return Err(CommandError::OutOfRange {
                        first: *first,
                        end,
                        blocks: g.blocks,
                    });
                }
                let mut seen = Holders::default();
                for s in stored {
                    let r = s.replica();
                    replica(r)?;
                    if seen.contains(r) {
                        return Err(CommandError::TwiceStored(r));
                    }
                    seen.insert(r);
                }
                if seen.len() < g.copies() as u32 {
                    return Err(CommandError::TooFewCopies {
                        got: seen.len(),
                        want: g.copies() as u32,
                    });
                }
                // One slice's preference per write is not assumed: each block is
                // checked (a write may cross a slice boundary).
                for b in *first..end {
                    let s = g.slice_of(b);
                    for st in stored {
                        match *st {
                            Stored::Home(r) if !g.prefers(r, s) => {
                                return Err(CommandError::NotPreferred {
                                    replica: r,
                                    block: b,
                                })
                            }
                            Stored::Reserve(r) if g.prefers(r, s) => {
                                return Err(CommandError::PreferredInReserve {
                                    replica: r,
                                    block: b,
                                })
                            }
                            _ => {}
                        }
                    }
                    let version = self.blocks[b as usize].version;
                    if index <= version {
                        return Err(CommandError::StaleIndex {
                            index,
                            block: b,
                            version,
                        });
                    }
                }
                Ok(())
            }
            Command::Repaired { replica: r, blocks } => {
                replica(*r)?;
                blocks.iter().try_for_each(|&(b, _)| block(b))
            }
            Command::Reclaim { blocks } => blocks.iter().try_for_each(|&(b, _)| block(b)),
            Command::Lost { replica: r, blocks } => {
                replica(*r)?;
                blocks.iter().flatten().try_for_each(|&(b, _)| block(b))
            }
            Command::Fenced { .. } => Err(CommandError::Unfenced),
            Command::Abandon { .. } => Ok(()),
        }
    }

    /// Applies log entry `index`. A command that fails its check changes nothing (on
    /// every replica alike); the index counts as applied either way.
    pub fn apply(&mut self, index: Version, cmd: &Command) -> Result<Applied, CommandError> {
        let checked = self.check(index, cmd);
        self.applied = self.applied.max(index);
        checked?;
        let mut out = Applied::default();
        match cmd {
            Command::Write {
                first,
                checksums,
                stored,
                ..
            } => {
                let mut holders = Holders::default();
                let mut reserve = Holders::default();
                for s in stored {
                    holders.insert(s.replica());
                    if let Stored::Reserve(r) = s {
                        reserve.insert(*r);
                    }
                }
                for (i, &checksum) in checksums.iter().enumerate() {
                    let b = first + i as u64;
                    let m = &mut self.blocks[b as usize];
                    if !m.reserve.is_empty() {
                        out.reserve_freed.push((b, m.version, m.reserve));
                    }
                    *m = BlockMeta {
                        version: index,
                        checksum,
                        holders,
                        reserve,
                    };
                }
            }
            Command::Repaired { replica, blocks } => {
                for &(b, v) in blocks {
                    let m = &mut self.blocks[b as usize];
                    if m.version == v {
                        m.holders.insert(*replica);
                        m.reserve.remove(*replica);
                    }
                }
            }
            Command::Reclaim { blocks } => {
                for &(b, v) in blocks {
                    let m = &mut self.blocks[b as usize];
                    if m.version != v || m.reserve.is_empty() {
                        continue;
                    }
                    let kept = Holders(m.holders.0 & !m.reserve.0);
                    // Only once the preferred copies alone make f+1: the reserve is
                    // what kept the write durable until then.
                    if kept.len() >= self.geometry.copies() as u32 {
                        out.reserve_freed.push((b, m.version, m.reserve));
                        m.holders = kept;
                        m.reserve = Holders::default();
                    }
                }
            }
            Command::Lost { replica, blocks } => {
                let lose = |m: &mut BlockMeta| {
                    m.holders.remove(*replica);
                    m.reserve.remove(*replica);
                };
                match blocks {
                    Some(bs) => {
                        for &(b, v) in bs {
                            let m = &mut self.blocks[b as usize];
                            if m.version == v {
                                lose(m);
                            }
                        }
                    }
                    None => self.blocks.iter_mut().for_each(lose),
                }
            }
            Command::Fenced { .. } => unreachable!("refused by check"),
            Command::Abandon { .. } => {}
        }
        Ok(out)
    }

    /// Blocks replica `r` should hold at home and does not (written, its slice
    /// preferred by `r`, `r` not a holder): Phase 2's work, in block order.
    pub fn incomplete(&self, r: ReplicaId) -> impl Iterator<Item = (u64, &BlockMeta)> + '_ {
        let g = self.geometry;
        self.blocks.iter().enumerate().filter_map(move |(b, m)| {
            let b = b as u64;
            (m.version > 0 && !m.holders.contains(r) && g.prefers(r, g.slice_of(b)))
                .then_some((b, m))
        })
    }

    /// As [`MetaTable::incomplete`], from block `from` to the end and then from the
    /// start: Phase 2 goes round the volume, so a block no one can give it yet does not
    /// hold up the ones after it.
    pub fn incomplete_from(
        &self,
        r: ReplicaId,
        from: u64,
    ) -> impl Iterator<Item = (u64, &BlockMeta)> + '_ {
        let g = self.geometry;
        let from = (from as usize).min(self.blocks.len());
        let (head, tail) = self.blocks.split_at(from);
        tail.iter()
            .enumerate()
            .map(move |(i, m)| ((from + i) as u64, m))
            .chain(head.iter().enumerate().map(|(i, m)| (i as u64, m)))
            .filter(move |(b, m)| {
                m.version > 0 && !m.holders.contains(r) && g.prefers(r, g.slice_of(*b))
            })
    }

    /// Blocks with reserve copies that every preferred replica now holds: what a
    /// `Reclaim` may let go.
    pub fn reclaimable(&self) -> impl Iterator<Item = (u64, Version)> + '_ {
        let g = self.geometry;
        self.blocks.iter().enumerate().filter_map(move |(b, m)| {
            let b = b as u64;
            let preferred_all = g
                .preferred(g.slice_of(b))
                .into_iter()
                .all(|r| m.holders.contains(r));
            (!m.reserve.is_empty() && preferred_all).then_some((b, m.version))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::geometry::System;
    use proptest::prelude::*;

    fn table(f: u16, blocks: u64, slice: u64) -> MetaTable {
        MetaTable::new(Geometry::new(System::Gnothi, f, 4096, blocks, slice).unwrap())
    }

    fn w(first: u64, n: usize, stored: &[Stored]) -> Command {
        Command::Write {
            write: WriteId {
                client: 1,
                seq: first,
            },
            first,
            checksums: (0..n as u32).map(|i| 0xc0 + i).collect(),
            stored: stored.to_vec(),
        }
    }

    #[test]
    fn a_write_sets_versions_checksums_and_holders() {
        // f = 1, slices of 4: slice 0 prefers 0 and 1.
        let mut t = table(1, 24, 4);
        t.apply(5, &w(1, 2, &[Stored::Home(0), Stored::Home(1)]))
            .unwrap();
        let m = t.meta(2).unwrap();
        assert_eq!((m.version, m.checksum), (5, 0xc1));
        assert!(m.holders.contains(0) && m.holders.contains(1) && !m.holders.contains(2));
        assert_eq!(t.meta(0).unwrap().version, 0);
        assert_eq!(t.applied(), 5);
        assert_eq!(t.incomplete(0).count(), 0);
    }

    #[test]
    fn a_reserve_copy_stands_in_and_is_reclaimed_once_the_preferred_replica_has_it() {
        let mut t = table(1, 24, 4);
        // Replica 1 (preferred) is down: replica 2 keeps the copy in its reserve.
        t.apply(3, &w(0, 1, &[Stored::Home(0), Stored::Reserve(2)]))
            .unwrap();
        assert_eq!(t.incomplete(1).map(|(b, _)| b).collect::<Vec<_>>(), vec![0]);
        assert_eq!(t.reclaimable().count(), 0, "the reserve keeps it durable");
        // Phase 2 on replica 1.
        t.apply(
            4,
            &Command::Repaired {
                replica: 1,
                blocks: vec![(0, 3)],
            },
        )
        .unwrap();
        assert_eq!(t.incomplete(1).count(), 0);
        assert_eq!(t.reclaimable().collect::<Vec<_>>(), vec![(0, 3)]);
        let a = t
            .apply(
                5,
                &Command::Reclaim {
                    blocks: vec![(0, 3)],
                },
            )
            .unwrap();
        assert_eq!(a.reserve_freed, vec![(0, 3, Holders(1 << 2))]);
        let m = t.meta(0).unwrap();
        assert_eq!((m.holders, m.reserve), (Holders(0b011), Holders(0)));
    }

    #[test]
    fn a_newer_write_frees_old_reserve_copies_and_outdates_repairs() {
        let mut t = table(1, 24, 4);
        t.apply(3, &w(0, 1, &[Stored::Home(0), Stored::Reserve(2)]))
            .unwrap();
        let a = t
            .apply(4, &w(0, 1, &[Stored::Home(0), Stored::Home(1)]))
            .unwrap();
        assert_eq!(a.reserve_freed, vec![(0, 3, Holders(1 << 2))]);
        // A repair of the old version changes nothing.
        t.apply(
            5,
            &Command::Repaired {
                replica: 2,
                blocks: vec![(0, 3)],
            },
        )
        .unwrap();
        assert!(!t.meta(0).unwrap().holders.contains(2));
    }

    #[test]
    fn a_replaced_replica_has_every_preferred_block_to_fetch() {
        let mut t = table(1, 12, 4);
        for (i, first) in [0u64, 4, 8].into_iter().enumerate() {
            let s = t.geometry().slice_of(first);
            let stored: Vec<Stored> = t
                .geometry()
                .preferred(s)
                .into_iter()
                .map(Stored::Home)
                .collect();
            t.apply(10 + i as u64, &w(first, 4, &stored)).unwrap();
        }
        t.apply(
            20,
            &Command::Lost {
                replica: 0,
                blocks: None,
            },
        )
        .unwrap();
        // Replica 0 prefers slices 0 and 2.
        let todo: Vec<u64> = t.incomplete(0).map(|(b, _)| b).collect();
        assert_eq!(todo, vec![0, 1, 2, 3, 8, 9, 10, 11]);
    }

    #[test]
    fn bad_commands_are_refused_alike_and_change_nothing() {
        let mut t = table(1, 24, 4);
        let before = t.clone();
        let bad = [
            (
                w(22, 4, &[Stored::Home(0), Stored::Home(2)]),
                "past the end",
            ),
            (w(0, 0, &[Stored::Home(0), Stored::Home(1)]), "empty"),
            (w(0, 1, &[Stored::Home(0)]), "one copy"),
            (w(0, 1, &[Stored::Home(0), Stored::Home(0)]), "twice"),
            (w(0, 1, &[Stored::Home(0), Stored::Home(7)]), "no replica 7"),
            (
                w(0, 1, &[Stored::Home(0), Stored::Home(2)]),
                "2 does not prefer slice 0",
            ),
            (
                w(0, 1, &[Stored::Home(0), Stored::Reserve(1)]),
                "1 prefers slice 0",
            ),
            // Crosses into slice 1 (preferred by 1 and 2): 0 is not a home there.
            (
                w(2, 4, &[Stored::Home(0), Stored::Home(1)]),
                "crosses a slice",
            ),
        ];
        for (cmd, why) in bad {
            assert!(t.apply(7, &cmd).is_err(), "{why}");
            assert_eq!(t.blocks, before.blocks, "{why}");
        }
        t.apply(8, &w(0, 1, &[Stored::Home(0), Stored::Home(1)]))
            .unwrap();
        assert!(matches!(
            t.apply(8, &w(0, 1, &[Stored::Home(0), Stored::Home(1)])),
            Err(CommandError::StaleIndex { .. })
        ));
    }

    #[test]
    fn commands_survive_a_round_trip_through_json() {
        let c = w(3, 2, &[Stored::Home(0), Stored::Reserve(2)]);
        let s = serde_json::to_string(&c).unwrap();
        assert_eq!(serde_json::from_str::<Command>(&s).unwrap(), c);
    }

    fn cmd_s(f: u16, blocks: u64, slice: u64) -> impl Strategy<Value = Command> {
        let g = Geometry::new(System::Gnothi, f, 4096, blocks, slice).unwrap();
        let n = g.replicas();
        prop_oneof![
            4 => (0..blocks, 1usize..4, proptest::collection::vec(0..n, 0..5), any::<bool>())
                .prop_map(move |(first, len, rs, reserve)| {
                    let first = first.min(blocks - 1);
                    let s = g.slice_of(first);
                    let mut stored: Vec<Stored> = rs
                        .into_iter()
                        .map(|r| if g.prefers(r, s) || !reserve { Stored::Home(r) } else { Stored::Reserve(r) })
                        .collect();
                    stored.dedup();
                    Command::Write { write: WriteId { client: 0, seq: first }, first, checksums: vec![7; len], stored }
                }),
            1 => (0..n, proptest::collection::vec(0..blocks, 1..4)).prop_map(|(r, bs)| {
                Command::Repaired { replica: r, blocks: bs.into_iter().map(|b| (b, 0)).collect() }
            }),
            1 => (0..n, proptest::option::of(proptest::collection::vec(0..blocks, 1..3)))
                .prop_map(|(r, blocks)| Command::Lost { replica: r, blocks: blocks.map(|bs| bs.into_iter().map(|b| (b, 0)).collect()) }),
            1 => (0..blocks).prop_map(|seq| Command::Abandon { writes: vec![WriteId { client: 0, seq }] }),
        ]
    }

    proptest! {
        /// Against a model that keeps, per block, the index of the last write that
        /// covered it and who stored it: versions follow the last write; a block keeps
        /// at least f+1 holders of its version unless a `Lost` took them; holders of a
        /// block never include a replica that neither stored nor repaired it; and a
        /// copy of the table fed the same log agrees (determinism).
        #[test]
        fn the_table_follows_the_log(cmds in proptest::collection::vec(cmd_s(1, 16, 4), 1..40)) {
            let mut t = table(1, 16, 4);
            let mut twin = table(1, 16, 4);
            let mut model: Vec<(u64, u16, bool)> = vec![(0, 0, false); 16];
            for (i, c) in cmds.iter().enumerate() {
                let index = i as u64 + 1;
                // Repairs name the block's current version (the strategy cannot know it).
                let c = match c {
                    Command::Repaired { replica, blocks } => Command::Repaired {
                        replica: *replica,
                        blocks: blocks.iter().map(|&(b, _)| (b, t.meta(b).unwrap().version)).collect(),
                    },
                    // Losses name the current version, or (every other one) a stale one,
                    // which must change nothing.
                    Command::Lost { replica, blocks: Some(bs) } => Command::Lost {
                        replica: *replica,
                        blocks: Some(bs.iter().enumerate().map(|(k, &(b, _))| {
                            let v = t.meta(b).unwrap().version;
                            (b, if k % 2 == 1 && v > 0 { v - 1 } else { v })
                        }).collect()),
                    },
                    c => c.clone(),
                };
                let r1 = t.apply(index, &c);
                let r2 = twin.apply(index, &c);
                prop_assert_eq!(&r1, &r2);
                if r1.is_err() { continue; }
                match &c {
                    Command::Write { first, checksums, stored, .. } => {
                        let mask = stored.iter().fold(0u16, |m, s| m | 1 << s.replica());
                        for b in *first..first + checksums.len() as u64 {
                            model[b as usize] = (index, mask, false);
                        }
                    }
                    Command::Repaired { replica, blocks } => {
                        for &(b, v) in blocks {
                            if model[b as usize].0 == v && v > 0 {
                                model[b as usize].1 |= 1 << replica;
                            }
                        }
                    }
                    Command::Lost { replica, blocks } => {
                        let bs: Vec<(u64, u64)> = blocks
                            .clone()
                            .unwrap_or_else(|| (0..16).map(|b| (b, model[b as usize].0)).collect());
                        for (b, v) in bs {
                            if model[b as usize].0 == v {
                                model[b as usize].1 &= !(1 << replica);
                                model[b as usize].2 = true;
                            }
                        }
                    }
                    // The replica's business (sessions, staged data): no block changes.
                    Command::Reclaim { .. } | Command::Abandon { .. } => {}
                    Command::Fenced { .. } => prop_assert!(false, "the table applied a fence"),
                }
            }
            prop_assert_eq!(&t, &twin);
            for (b, &(v, mask, lost)) in model.iter().enumerate() {
                let m = t.meta(b as u64).unwrap();
                prop_assert_eq!(m.version, v, "block {}", b);
                if v > 0 {
                    prop_assert_eq!(m.holders.0 & !mask, 0, "block {}: holders beyond the model", b);
                    if !lost {
                        prop_assert!(m.holders.len() >= 2, "block {}: fewer than f+1 holders", b);
                    }
                }
            }
        }
    }
}
