//! A replica's log device: a label, the Raft log's ring, the data log's ring and two
//! snapshot slots (little-endian, crc32c).
//!
//! - block 0, the label: `QGLB`, format version, replica id (its slot in the
//!   placement), the volume's geometry and name, reserve slots, the size of each region,
//!   and the server's incarnation in that slot (0 for the volume's first servers: older
//!   labels, whose bytes there are zero, read the same). A replica refuses a device
//!   labelled for another replica or volume.
//! - `raft_blocks` blocks: the Raft log (`raftlog.rs`).
//! - `data_blocks` blocks: the data log (`datalog.rs`).
//! - the data device's label is its last block, after the home area and the reserve:
//!   `QGDL`, replica id, the volume's name, crc32c. A blank one is a new disk.
//! - two snapshot slots of `snap_blocks` blocks each: a header block (`QGSN`, sequence
//!   number, payload length and checksum, header checksum) and the payload. The payload
//!   is flushed before its header, and the slots alternate, so a torn snapshot leaves
//!   the previous one whole.

use crate::codec::{le32, le64};
use crate::geometry::{Geometry, ReplicaId, System};
use quilt_block::{BlockDevice, BlockError, WriteClass};
use std::sync::Arc;

const LABEL_MAGIC: &[u8; 4] = b"QGLB";
const SNAP_MAGIC: &[u8; 4] = b"QGSN";
/// 2: the data device's reserve keeps all headers before all data (`store.rs`).
/// 3: the data device carries its own label, after the reserve.
const FORMAT: u32 = 3;
const DATA_MAGIC: &[u8; 4] = b"QGDL";
const NAME_MAX: usize = 64;

#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LayoutError {
    #[error(transparent)]
    Device(#[from] BlockError),
    #[error("no Gnothi replica label on the log device")]
    NoLabel,
    #[error("the log device's label is damaged (checksum)")]
    Damaged,
    #[error("the log device is labelled format {0}; this build reads format {FORMAT}")]
    Format(u32),
    #[error("the log device has {have} blocks; the layout needs {need}")]
    TooSmall { have: u64, need: u64 },
    #[error("volume name {0:?} is longer than {NAME_MAX} bytes")]
    Name(String),
    #[error("the label's geometry is invalid: {0}")]
    Geometry(String),
    #[error("the data device's label is damaged (neither blank nor a replica's)")]
    DataDamaged,
    #[error("the data device is labelled for replica {replica} of volume {volume:?}")]
    DataLabel { replica: ReplicaId, volume: String },
    #[error("a snapshot of {len} bytes does not fit a slot of {room}")]
    SnapshotTooLarge { len: usize, room: usize },
}

/// What block 0 of a log device says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Label {
    pub replica: ReplicaId,
    /// How many servers held this slot before this one (a whole server replaced is a
    /// new Raft member: `node_id`).
    pub incarnation: u32,
    pub volume: String,
    pub geometry: Geometry,
    pub reserve_slots: u64,
    pub raft_blocks: u64,
    pub data_blocks: u64,
    pub snap_blocks: u64,
}

fn system_code(s: System) -> u8 {
    match s {
        System::Gnothi => 0,
        System::GPrime => 1,
        System::CheapPaxos => 2,
        System::Local => 3,
    }
}

impl Label {
    /// The server's identity in agreement: its slot plus `n` per incarnation, so that
    /// the slot is the id modulo `n` (`Geometry::slot_of`).
    pub fn node_id(&self) -> u64 {
        self.geometry.node_id(self.replica, self.incarnation)
    }

    pub fn raft_region(&self) -> (u64, u64) {
        (1, self.raft_blocks)
    }
    pub fn data_region(&self) -> (u64, u64) {
        (1 + self.raft_blocks, self.data_blocks)
    }
    fn snap_slot(&self, slot: u64) -> u64 {
        1 + self.raft_blocks + self.data_blocks + slot * self.snap_blocks
    }
    pub fn blocks_needed(&self) -> u64 {
        1 + self.raft_blocks + self.data_blocks + 2 * self.snap_blocks
    }

    pub fn write(&self, dev: &dyn BlockDevice) -> Result<(), LayoutError> {
        if self.volume.len() > NAME_MAX {
            return Err(LayoutError::Name(self.volume.clone()));
        }
        let need = self.blocks_needed();
        if dev.block_count() < need {
            return Err(LayoutError::TooSmall {
                have: dev.block_count(),
                need,
            });
        }
        let g = &self.geometry;
        let mut b = vec![0u8; dev.block_size()];
        b[0..4].copy_from_slice(LABEL_MAGIC);
        b[4..8].copy_from_slice(&FORMAT.to_le_bytes());
        b[8..10].copy_from_slice(&self.replica.to_le_bytes());
        b[10] = system_code(g.system);
        b[12..14].copy_from_slice(&g.f.to_le_bytes());
        b[16..20].copy_from_slice(&g.block_size.to_le_bytes());
        b[20..28].copy_from_slice(&g.blocks.to_le_bytes());
        b[28..36].copy_from_slice(&g.slice_blocks.to_le_bytes());
        b[36..44].copy_from_slice(&self.reserve_slots.to_le_bytes());
        b[44..52].copy_from_slice(&self.raft_blocks.to_le_bytes());
        b[52..60].copy_from_slice(&self.data_blocks.to_le_bytes());
        b[60..68].copy_from_slice(&self.snap_blocks.to_le_bytes());
        b[68] = self.volume.len() as u8;
        b[72..72 + self.volume.len()].copy_from_slice(self.volume.as_bytes());
        b[136..140].copy_from_slice(&self.incarnation.to_le_bytes());
        let c = crc32c::crc32c(&b[..140]);
        b[140..144].copy_from_slice(&c.to_le_bytes());
        // Both snapshot slots cleared: no snapshot of an earlier volume is read as ours.
        let zero = vec![0u8; dev.block_size()];
        dev.write(self.snap_slot(0), &zero, WriteClass::Metadata)?;
        dev.write(self.snap_slot(1), &zero, WriteClass::Metadata)?;
        dev.write(0, &b, WriteClass::Metadata)?;
        dev.flush()?;
        Ok(())
    }

    pub fn read(dev: &dyn BlockDevice) -> Result<Label, LayoutError> {
        let mut b = vec![0u8; dev.block_size()];
        if b.len() < 512 {
            return Err(LayoutError::NoLabel);
        }
        dev.read(0, &mut b)?;
        if &b[0..4] != LABEL_MAGIC {
            return Err(LayoutError::NoLabel);
        }
        if le32(&b, 140) != crc32c::crc32c(&b[..140]) {
            return Err(LayoutError::Damaged);
        }
        let format = le32(&b, 4);
        if format != FORMAT {
            return Err(LayoutError::Format(format));
        }
        let system = match b[10] {
            0 => System::Gnothi,
            1 => System::GPrime,
            2 => System::CheapPaxos,
            3 => System::Local,
            x => return Err(LayoutError::Geometry(format!("unknown system code {x}"))),
        };
        let f = u16::from_le_bytes([b[12], b[13]]);
        let geometry = Geometry::new(system, f, le32(&b, 16), le64(&b, 20), le64(&b, 28))
            .map_err(|e| LayoutError::Geometry(e.to_string()))?;
        let name_len = (b[68] as usize).min(NAME_MAX);
        let label = Label {
            replica: u16::from_le_bytes([b[8], b[9]]),
            incarnation: le32(&b, 136),
            volume: String::from_utf8_lossy(&b[72..72 + name_len]).into_owned(),
            geometry,
            reserve_slots: le64(&b, 36),
            raft_blocks: le64(&b, 44),
            data_blocks: le64(&b, 52),
            snap_blocks: le64(&b, 60),
        };
        let need = label.blocks_needed();
        if dev.block_count() < need {
            return Err(LayoutError::TooSmall {
                have: dev.block_count(),
                need,
            });
        }
        Ok(label)
    }

    /// Where the data device's label lies: after the home area and the reserve.
    pub fn data_label_block(&self) -> u64 {
        crate::store::DataStore::blocks_needed(&self.geometry, self.replica, self.reserve_slots)
    }

    /// Blocks the data device must have.
    pub fn data_blocks_needed(&self) -> u64 {
        self.data_label_block() + 1
    }

    fn data_label(&self, bs: usize) -> Vec<u8> {
        let mut b = vec![0u8; bs];
        b[0..4].copy_from_slice(DATA_MAGIC);
        b[4..6].copy_from_slice(&self.replica.to_le_bytes());
        b[6] = self.volume.len().min(NAME_MAX) as u8;
        b[8..8 + self.volume.len().min(NAME_MAX)]
            .copy_from_slice(&self.volume.as_bytes()[..self.volume.len().min(NAME_MAX)]);
        let c = crc32c::crc32c(&b[..8 + NAME_MAX]);
        b[8 + NAME_MAX..12 + NAME_MAX].copy_from_slice(&c.to_le_bytes());
        b
    }

    /// Labels `dev` as this replica's data device (flushed).
    pub fn write_data_label(&self, dev: &dyn BlockDevice) -> Result<(), LayoutError> {
        let need = self.data_blocks_needed();
        if dev.block_count() < need {
            return Err(LayoutError::TooSmall {
                have: dev.block_count(),
                need,
            });
        }
        dev.write(
            self.data_label_block(),
            &self.data_label(dev.block_size()),
            WriteClass::Metadata,
        )?;
        dev.flush()?;
        Ok(())
    }

    /// Whether `dev` is this replica's data device (`true`) or a blank one (`false`:
    /// a new disk); a device of another replica or volume, or a damaged label, is an
    /// error.
    pub fn data_label_matches(&self, dev: &dyn BlockDevice) -> Result<bool, LayoutError> {
        let need = self.data_blocks_needed();
        if dev.block_count() < need {
            return Err(LayoutError::TooSmall {
                have: dev.block_count(),
                need,
            });
        }
        let mut b = vec![0u8; dev.block_size()];
        dev.read(self.data_label_block(), &mut b)?;
        if b.iter().all(|&x| x == 0) {
            return Ok(false);
        }
        if b == self.data_label(b.len()) {
            return Ok(true);
        }
        if &b[0..4] == DATA_MAGIC && le32(&b, 8 + NAME_MAX) == crc32c::crc32c(&b[..8 + NAME_MAX]) {
            let len = (b[6] as usize).min(NAME_MAX);
            return Err(LayoutError::DataLabel {
                replica: u16::from_le_bytes([b[4], b[5]]),
                volume: String::from_utf8_lossy(&b[8..8 + len]).into_owned(),
            });
        }
        Err(LayoutError::DataDamaged)
    }

    /// Writes `payload` as the newest snapshot: into the slot not holding the current
    /// one, payload flushed before the header.
    pub fn write_snapshot(
        &self,
        dev: &dyn BlockDevice,
        seq: u64,
        payload: &[u8],
    ) -> Result<(), LayoutError> {
        let bs = dev.block_size();
        let room = (self.snap_blocks.saturating_sub(1)) as usize * bs;
        if payload.len() > room {
            return Err(LayoutError::SnapshotTooLarge {
                len: payload.len(),
                room,
            });
        }
        let at = self.snap_slot(seq % 2);
        if !payload.is_empty() {
            let mut body = payload.to_vec();
            body.resize(payload.len().div_ceil(bs) * bs, 0);
            dev.write_blocks(at + 1, &body, WriteClass::Metadata)?;
            dev.flush()?;
        }
        let mut h = vec![0u8; bs];
        h[0..4].copy_from_slice(SNAP_MAGIC);
        h[4..12].copy_from_slice(&seq.to_le_bytes());
        h[12..20].copy_from_slice(&(payload.len() as u64).to_le_bytes());
        h[20..24].copy_from_slice(&crc32c::crc32c(payload).to_le_bytes());
        let c = crc32c::crc32c(&h[..24]);
        h[24..28].copy_from_slice(&c.to_le_bytes());
        dev.write(at, &h, WriteClass::Metadata)?;
        dev.flush()?;
        Ok(())
    }

    /// The newest whole snapshot: its sequence number and payload.
    pub fn read_snapshot(
        &self,
        dev: &dyn BlockDevice,
    ) -> Result<Option<(u64, Vec<u8>)>, LayoutError> {
        let bs = dev.block_size();
        let mut best: Option<(u64, Vec<u8>)> = None;
        for slot in 0..2 {
            let at = self.snap_slot(slot);
            let mut h = vec![0u8; bs];
            dev.read(at, &mut h)?;
            if &h[0..4] != SNAP_MAGIC || le32(&h, 24) != crc32c::crc32c(&h[..24]) {
                continue;
            }
            let (seq, len) = (le64(&h, 4), le64(&h, 12) as usize);
            if len > (self.snap_blocks.saturating_sub(1)) as usize * bs
                || best.as_ref().is_some_and(|(s, _)| *s >= seq)
            {
                continue;
            }
            let mut body = vec![0u8; len.div_ceil(bs) * bs];
            if !body.is_empty() {
                dev.read_blocks(at + 1, &mut body)?;
            }
            body.truncate(len);
            if crc32c::crc32c(&body) == le32(&h, 20) {
                best = Some((seq, body));
            }
        }
        Ok(best)
    }
}

/// A device shared by the log rings and the snapshots.
pub type Dev = Arc<dyn BlockDevice>;

#[cfg(test)]
mod tests {
    use super::*;
    use quilt_block::MemDevice;

    fn label() -> Label {
        Label {
            replica: 2,
            incarnation: 0,
            volume: "vol0".into(),
            geometry: Geometry::new(System::Gnothi, 1, 512, 1000, 16).unwrap(),
            reserve_slots: 8,
            raft_blocks: 32,
            data_blocks: 32,
            snap_blocks: 10,
        }
    }

    #[test]
    fn a_data_device_is_ours_blank_or_refused() {
        let l = label();
        let dev = MemDevice::new(512, l.data_blocks_needed()).unwrap();
        // A new disk reads as blank; once labelled, as this replica's.
        assert!(!l.data_label_matches(&dev).unwrap());
        l.write_data_label(&dev).unwrap();
        assert!(l.data_label_matches(&dev).unwrap());
        // Another replica's, or another volume's: refused by name.
        let mut one = l.clone();
        one.replica = 1;
        let theirs = MemDevice::new(512, l.data_blocks_needed()).unwrap();
        theirs
            .write(
                l.data_label_block(),
                &one.data_label(512),
                WriteClass::Metadata,
            )
            .unwrap();
        assert!(matches!(
            l.data_label_matches(&theirs),
            Err(LayoutError::DataLabel { replica: 1, .. })
        ));
        let mut other = l.clone();
        other.volume = "vol1".into();
        assert!(matches!(
            other.data_label_matches(&dev),
            Err(LayoutError::DataLabel { ref volume, .. }) if volume == "vol0"
        ));
        // A damaged label is neither blank nor ours.
        let mut b = vec![0u8; 512];
        dev.read(l.data_label_block(), &mut b).unwrap();
        b[9] ^= 1;
        dev.write(l.data_label_block(), &b, WriteClass::Metadata)
            .unwrap();
        assert!(matches!(
            l.data_label_matches(&dev),
            Err(LayoutError::DataDamaged)
        ));
        // A device too small for the layout says so.
        let small = MemDevice::new(512, l.data_label_block()).unwrap();
        assert!(matches!(
            l.data_label_matches(&small),
            Err(LayoutError::TooSmall { .. })
        ));
    }

    #[test]
    fn a_label_reads_back_and_a_damaged_one_is_refused() {
        let dev = MemDevice::new(512, 200).unwrap();
        let l = label();
        l.write(&dev).unwrap();
        assert_eq!(Label::read(&dev).unwrap(), l);
        let mut b = vec![0u8; 512];
        dev.read(0, &mut b).unwrap();
        b[20] ^= 1;
        dev.write(0, &b, WriteClass::Metadata).unwrap();
        assert!(matches!(Label::read(&dev), Err(LayoutError::Damaged)));
    }

    #[test]
    fn the_newest_whole_snapshot_wins() {
        let dev = MemDevice::new(512, 200).unwrap();
        let l = label();
        l.write(&dev).unwrap();
        assert_eq!(l.read_snapshot(&dev).unwrap(), None);
        l.write_snapshot(&dev, 1, &[7u8; 1000]).unwrap();
        l.write_snapshot(&dev, 2, &[9u8; 600]).unwrap();
        assert_eq!(l.read_snapshot(&dev).unwrap(), Some((2, vec![9u8; 600])));
        // Snapshot 3's payload torn: snapshot 2 is still whole.
        l.write_snapshot(&dev, 3, &[5u8; 700]).unwrap();
        let at = l.snap_slot(1) + 1;
        dev.write(at, &[0u8; 512], WriteClass::Metadata).unwrap();
        assert_eq!(l.read_snapshot(&dev).unwrap(), Some((2, vec![9u8; 600])));
        assert!(matches!(
            l.write_snapshot(&dev, 4, &vec![0u8; 9 * 512 + 1]),
            Err(LayoutError::SnapshotTooLarge { .. })
        ));
    }
}
