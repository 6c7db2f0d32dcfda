//! Slices and preferred quorums: which replicas keep a block's data, and where on their
//! data device.
//!
//! The volume is cut into slices of `slice_blocks` consecutive blocks. In Gnothi, slice
//! `s` prefers replicas `(s + i) mod n` for `i` in `0..=f`: over any `n` consecutive
//! slices each replica is preferred by `f+1`, an equal share. A replica keeps only the
//! slices it prefers, packed in slice order on its data device, so a slice's local
//! position is the number of slices before it the replica prefers: a closed form.

use serde::{Deserialize, Serialize};

/// A replica's number, `0..n`.
pub type ReplicaId = u16;

/// The most replicas a volume may have (`f` at most 7): holder sets are 16-bit masks.
pub const MAX_REPLICAS: u16 = 15;

/// How a volume places data: Gnothi, and the baselines run on the same code path.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum System {
    /// `f+1` of `2f+1` replicas per slice, rotated.
    Gnothi,
    /// G′, Gaios-like full replication: every replica keeps every slice.
    GPrime,
    /// Cheap Paxos: the `f+1` main replicas (`0..=f`) keep every slice; the `f`
    /// auxiliaries keep none, and act only on failure.
    CheapPaxos,
    /// One unreplicated disk (`f = 0`).
    Local,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum GeometryError {
    #[error("block size {0} is invalid: a power of two from 512 to 1 MiB")]
    BlockSize(u32),
    #[error("a slice of {0} blocks: it must hold at least one block")]
    SliceBlocks(u64),
    #[error("f = {f} needs {replicas} replicas; at most {MAX_REPLICAS} are supported")]
    TooManyReplicas { f: u16, replicas: u32 },
    #[error("a local volume has f = 0 (got f = {0})")]
    LocalWithReplicas(u16),
    #[error("a replicated volume needs f ≥ 1 (got f = 0); use the local system")]
    NoFaultTolerance,
    #[error("a volume of no blocks")]
    Empty,
}

/// A volume's shape and placement; the same on every replica and client.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Geometry {
    pub system: System,
    /// Failures tolerated: `2f+1` replicas.
    pub f: u16,
    pub block_size: u32,
    pub blocks: u64,
    pub slice_blocks: u64,
}

impl Geometry {
    /// Checks a geometry: a valid block size, a slice of at least one block, and a
    /// number of replicas the holder masks can name.
    pub fn new(
        system: System,
        f: u16,
        block_size: u32,
        blocks: u64,
        slice_blocks: u64,
    ) -> Result<Geometry, GeometryError> {
        if !block_size.is_power_of_two() || !(512..=1 << 20).contains(&block_size) {
            return Err(GeometryError::BlockSize(block_size));
        }
        if slice_blocks == 0 {
            return Err(GeometryError::SliceBlocks(slice_blocks));
        }
        if blocks == 0 {
            return Err(GeometryError::Empty);
        }
        match system {
            System::Local if f != 0 => return Err(GeometryError::LocalWithReplicas(f)),
            System::Local => {}
            _ if f == 0 => return Err(GeometryError::NoFaultTolerance),
            _ => {}
        }
        let replicas = 2 * f as u32 + 1;
        if replicas > MAX_REPLICAS as u32 {
            return Err(GeometryError::TooManyReplicas { f, replicas });
        }
        Ok(Geometry {
            system,
            f,
            block_size,
            blocks,
            slice_blocks,
        })
    }

    /// Replicas in the volume: `2f+1`.
    pub fn replicas(&self) -> u16 {
        2 * self.f + 1
    }

    /// The slot (the place in the placement) of the server with agreement id `node`:
    /// the volume's first servers are `0..n`; a server that replaces slot `r` for the
    /// `k`th time is `r + k·n` (`node_id`).
    pub fn slot_of(&self, node: u64) -> ReplicaId {
        (node % u64::from(self.replicas())) as ReplicaId
    }

    /// The agreement id of the `incarnation`th server of slot `r`.
    pub fn node_id(&self, r: ReplicaId, incarnation: u32) -> u64 {
        u64::from(r) + u64::from(self.replicas()) * u64::from(incarnation)
    }

    /// Copies of the data a write needs before it is acknowledged: `f+1`.
    pub fn copies(&self) -> u16 {
        self.f + 1
    }

    pub fn slices(&self) -> u64 {
        self.blocks.div_ceil(self.slice_blocks)
    }

    pub fn slice_of(&self, block: u64) -> u64 {
        block / self.slice_blocks
    }

    /// Whether replica `r` keeps slice `s`'s data.
    pub fn prefers(&self, r: ReplicaId, s: u64) -> bool {
        let n = self.replicas() as u64;
        match self.system {
            System::Gnothi => (r as u64 + n - s % n) % n <= self.f as u64,
            System::GPrime | System::Local => r < self.replicas(),
            System::CheapPaxos => r <= self.f,
        }
    }

    /// The replicas that keep slice `s`'s data, in order.
    pub fn preferred(&self, s: u64) -> Vec<ReplicaId> {
        (0..self.replicas())
            .filter(|&r| self.prefers(r, s))
            .collect()
    }

    /// Slices before `s` that replica `r` keeps: where slice `s` starts on `r`'s data
    /// device, in slices (meaningful when `r` prefers `s`).
    pub fn slices_before(&self, r: ReplicaId, s: u64) -> u64 {
        let n = self.replicas() as u64;
        match self.system {
            System::Gnothi => {
                let cycles = s / n;
                let rest = (0..s % n).filter(|&t| self.prefers(r, t)).count() as u64;
                cycles * self.copies() as u64 + rest
            }
            System::GPrime | System::Local => s,
            System::CheapPaxos => {
                if r <= self.f {
                    s
                } else {
                    0
                }
            }
        }
    }

    /// Where block `block` lives on replica `r`'s data device (in blocks from the start
    /// of its home area), or `None` if `r` does not prefer its slice.
    pub fn home_of(&self, r: ReplicaId, block: u64) -> Option<u64> {
        let s = self.slice_of(block);
        self.prefers(r, s)
            .then(|| self.slices_before(r, s) * self.slice_blocks + block % self.slice_blocks)
    }

    /// Blocks replica `r` keeps at home: the size its data device's home area needs.
    pub fn home_blocks(&self, r: ReplicaId) -> u64 {
        let s = self.slices();
        let full = self.slices_before(r, s) * self.slice_blocks;
        // The last slice may be short.
        let last = s - 1;
        if self.prefers(r, last) {
            full - (s * self.slice_blocks - self.blocks)
        } else {
            full
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn geo(system: System, f: u16, blocks: u64, slice: u64) -> Geometry {
        Geometry::new(system, f, 4096, blocks, slice).unwrap()
    }

    #[test]
    fn gnothi_prefers_f_plus_one_rotated_and_shares_equally() {
        let g = geo(System::Gnothi, 1, 3 * 100, 10);
        assert_eq!(g.preferred(0), vec![0, 1]);
        assert_eq!(g.preferred(1), vec![1, 2]);
        assert_eq!(g.preferred(2), vec![0, 2]);
        assert_eq!(g.preferred(3), vec![0, 1]);
        for r in 0..3 {
            assert_eq!(g.home_blocks(r), 200, "replica {r}");
        }
        let g = geo(System::Gnothi, 2, 5 * 16, 16);
        for s in 0..5 {
            assert_eq!(g.preferred(s).len(), 3);
        }
        for r in 0..5 {
            assert_eq!(g.home_blocks(r), 3 * 16, "replica {r}");
        }
    }

    #[test]
    fn baselines_place_as_their_papers_say() {
        let g = geo(System::GPrime, 1, 100, 10);
        assert_eq!(g.preferred(7), vec![0, 1, 2]);
        assert_eq!(g.home_blocks(2), 100);
        let c = geo(System::CheapPaxos, 2, 100, 10);
        assert_eq!(c.preferred(3), vec![0, 1, 2]);
        assert_eq!(c.home_blocks(0), 100);
        assert_eq!(c.home_blocks(4), 0);
        assert_eq!(c.home_of(4, 5), None);
        let l = geo(System::Local, 0, 100, 10);
        assert_eq!(l.replicas(), 1);
        assert_eq!(l.home_of(0, 42), Some(42));
    }

    #[test]
    fn bad_geometries_are_refused_with_a_reason() {
        use GeometryError::*;
        let e = |s, f, bs, b, sl| Geometry::new(s, f, bs, b, sl).unwrap_err();
        assert_eq!(e(System::Gnothi, 1, 1000, 10, 1), BlockSize(1000));
        assert_eq!(e(System::Gnothi, 1, 4096, 10, 0), SliceBlocks(0));
        assert_eq!(e(System::Gnothi, 1, 4096, 0, 1), Empty);
        assert_eq!(e(System::Gnothi, 0, 4096, 10, 1), NoFaultTolerance);
        assert_eq!(e(System::Local, 1, 4096, 10, 1), LocalWithReplicas(1));
        assert_eq!(
            e(System::GPrime, 8, 4096, 10, 1),
            TooManyReplicas { f: 8, replicas: 17 }
        );
    }

    proptest! {
        /// Every block has exactly `f+1` homes in Gnothi (n in G′), and on each replica
        /// the homes of its blocks are distinct and inside its home area: a packing
        /// with no overlap and no gap.
        #[test]
        fn homes_are_a_packing(
            f in 1u16..=3,
            slice in 1u64..=9,
            blocks in 1u64..=400,
            gprime in any::<bool>(),
        ) {
            let system = if gprime { System::GPrime } else { System::Gnothi };
            let g = geo(system, f, blocks, slice);
            let mut seen: Vec<Vec<bool>> =
                (0..g.replicas()).map(|r| vec![false; g.home_blocks(r) as usize]).collect();
            for b in 0..blocks {
                let homes: Vec<(ReplicaId, u64)> = (0..g.replicas())
                    .filter_map(|r| g.home_of(r, b).map(|h| (r, h)))
                    .collect();
                let want = if gprime { g.replicas() } else { g.copies() };
                prop_assert_eq!(homes.len(), want as usize);
                for (r, h) in homes {
                    let slot = seen[r as usize].get_mut(h as usize);
                    prop_assert!(slot.is_some(), "home {} of block {} past replica {}'s area", h, b, r);
                    let slot = slot.unwrap();
                    prop_assert!(!*slot, "two blocks at home {} of replica {}", h, r);
                    *slot = true;
                }
            }
            for (r, s) in seen.iter().enumerate() {
                prop_assert!(s.iter().all(|&x| x), "a gap in replica {}'s home area", r);
            }
        }
    }
}
