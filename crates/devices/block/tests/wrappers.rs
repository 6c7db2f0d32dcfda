//! Every device that wraps another passes every capability on: stacked over a probe
//! that has them all and logs what reaches it, each capability called at the top of the
//! stack arrives at the bottom, with its write class, or (the overlay's writes) is served
//! by the wrapper as the capability says. A wrapper that forgets one fails here.

use quilt_block::{
    BlockDevice, BlockDeviceExt, BlockNo, Capabilities, Clock, DeviceCounters, DiskModel,
    DiskParams, GatherWrites, History, HostRoom, IoCounters, IoStats, MemDevice, OverlayDevice,
    PartReads, RangeWrites, ReadHints, RecordingDevice, Reservation, Result, WriteClass,
};
use std::sync::{Arc, Mutex};

const BS: usize = 4096;

/// A memory device with every capability, logging each call that reaches it.
struct Probe {
    mem: MemDevice,
    calls: Mutex<Vec<String>>,
    counters: IoCounters,
}

impl Probe {
    fn new() -> Arc<Probe> {
        Arc::new(Probe {
            mem: MemDevice::new(BS, 4096).unwrap(),
            calls: Mutex::default(),
            counters: IoCounters::default(),
        })
    }
    fn log(&self, s: String) {
        self.calls.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut *self.calls.lock().unwrap())
    }
}

impl BlockDevice for Probe {
    fn block_size(&self) -> usize {
        BS
    }
    fn block_count(&self) -> u64 {
        self.mem.block_count()
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        self.log(format!("read {block}"));
        self.mem.read(block, buf)
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        self.log(format!("read_blocks {first}+{}", buf.len() / BS));
        self.mem.read_blocks(first, buf)
    }
    fn write(&self, block: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        self.log(format!("write {block} {class:?}"));
        self.mem.write(block, buf, class)
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], class: WriteClass) -> Result<()> {
        self.log(format!("write_blocks {first}+{} {class:?}", buf.len() / BS));
        self.mem.write_blocks(first, buf, class)
    }
    fn flush(&self) -> Result<()> {
        self.log("flush".into());
        self.mem.flush()
    }
    fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities {
            gather: Some(self),
            part_reads: Some(self),
            ranges: Some(self),
            hints: Some(self),
            reservation: Some(self),
            history: Some(self),
            counters: Some(self),
        }
    }
}

impl GatherWrites for Probe {
    fn write_blocks_gather(
        &self,
        first: BlockNo,
        parts: &[&[u8]],
        class: WriteClass,
    ) -> Result<()> {
        self.log(format!("gather {first}x{} {class:?}", parts.len()));
        self.mem.write_blocks(first, &parts.concat(), class)
    }
}
impl PartReads for Probe {
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
        self.log(format!("read_part {first}@{skip}+{}", buf.len()));
        let mut whole = vec![0; (skip + buf.len()).div_ceil(BS) * BS];
        self.mem.read_blocks(first, &mut whole)?;
        buf.copy_from_slice(&whole[skip..skip + buf.len()]);
        Ok(())
    }
}
impl RangeWrites for Probe {
    /// Takes the last candidate, so that a wrapper that chose by itself shows.
    fn write_range(
        &self,
        candidates: &[BlockNo],
        buf: &[u8],
        class: WriteClass,
    ) -> Result<BlockNo> {
        let at = *candidates.last().unwrap();
        self.log(format!("range {at} {class:?}"));
        self.mem.write_blocks(at, buf, class)?;
        Ok(at)
    }
}
impl ReadHints for Probe {
    fn will_need(&self, first: BlockNo, count: u64) {
        self.log(format!("will_need {first}+{count}"));
    }
}
impl Reservation for Probe {
    fn reserve(&self, first: BlockNo, count: u64) -> Result<()> {
        self.log(format!("reserve {first}+{count}"));
        Ok(())
    }
    fn host_room(&self) -> Option<HostRoom> {
        self.log("host_room".into());
        Some(HostRoom {
            free: 1,
            unbacked: 2,
        })
    }
}
impl History for Probe {
    fn mark(&self, name: &str) {
        self.log(format!("mark {name}"));
    }
}
impl DeviceCounters for Probe {
    fn extra_stats(&self) -> Vec<(String, u64)> {
        vec![("probe.calls".into(), 7)]
    }
}

fn model(inner: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
    Arc::new(DiskModel::new(inner, DiskParams::desktop_7200(), Clock::virtual_at(0)).unwrap())
}
fn recording(inner: Arc<dyn BlockDevice>) -> Arc<dyn BlockDevice> {
    Arc::new(RecordingDevice::new(inner, 1 << 30))
}

/// What each call at the top of a stack of pass-through wrappers must make the probe
/// see (the disk model makes its own range choice and writes the run below).
fn calls_reach_the_probe(top: &dyn BlockDevice, probe: &Probe, model_below: bool) {
    let caps = top.capabilities().names();
    for c in [
        "gather",
        "part_reads",
        "ranges",
        "hints",
        "reservation",
        "history",
        "counters",
    ] {
        assert!(caps.contains(&c), "{c} dropped: the top has {caps:?}");
    }
    probe.take();
    let a = vec![1u8; BS];
    let b = vec![2u8; BS];
    top.write_blocks_gather(10, &[&a, &b], WriteClass::Data)
        .unwrap();
    assert_eq!(probe.take(), ["gather 10x2 Data"]);
    let mut part = vec![0u8; 100];
    top.read_part(10, BS - 50, &mut part).unwrap();
    assert_eq!(probe.take(), [format!("read_part 10@{}+100", BS - 50)]);
    assert_eq!(&part[..50], &[1u8; 50][..]);
    assert_eq!(&part[50..], &[2u8; 50][..]);
    let at = top
        .write_range(&[20, 30], &a, WriteClass::Metadata)
        .unwrap();
    if model_below {
        // The disk model's own choice among the candidates, written as a run.
        assert!(at == 20 || at == 30);
        assert_eq!(probe.take(), [format!("write_blocks {at}+1 Metadata")]);
    } else {
        assert_eq!(at, 30);
        assert_eq!(probe.take(), ["range 30 Metadata"]);
    }
    top.will_need(40, 8);
    assert_eq!(probe.take(), ["will_need 40+8"]);
    top.reserve(50, 4).unwrap();
    assert_eq!(probe.take(), ["reserve 50+4"]);
    assert_eq!(
        top.host_room(),
        Some(HostRoom {
            free: 1,
            unbacked: 2
        })
    );
    assert_eq!(probe.take(), ["host_room"]);
    top.mark("m");
    assert_eq!(probe.take(), ["mark m"]);
    let extra = top.extra_stats();
    assert!(extra.contains(&("probe.calls".to_string(), 7)), "{extra:?}");
    top.write(60, &b, WriteClass::Data).unwrap();
    assert_eq!(probe.take(), ["write 60 Data"]);
    top.write_blocks(61, &[a.clone(), b.clone()].concat(), WriteClass::Metadata)
        .unwrap();
    assert_eq!(probe.take(), ["write_blocks 61+2 Metadata"]);
}

#[test]
fn the_recording_device_passes_every_capability_on() {
    let probe = Probe::new();
    let rec = RecordingDevice::new(probe.clone(), 1 << 30);
    calls_reach_the_probe(&rec, &probe, false);
    // And records the writes where they went, with their class.
    let log = rec.log();
    let writes: Vec<(BlockNo, WriteClass)> = log
        .entries
        .iter()
        .filter_map(|e| match e {
            quilt_block::LogEntry::Write { block, class, .. } => Some((*block, *class)),
            _ => None,
        })
        .collect();
    assert_eq!(
        writes,
        [
            (10, WriteClass::Data),
            (11, WriteClass::Data),
            (30, WriteClass::Metadata),
            (60, WriteClass::Data),
            (61, WriteClass::Metadata),
            (62, WriteClass::Metadata)
        ]
    );
    assert!(log
        .entries
        .contains(&quilt_block::LogEntry::Mark("m".to_string())));
}

#[test]
fn the_disk_model_passes_every_capability_on() {
    let probe = Probe::new();
    let m = model(probe.clone());
    calls_reach_the_probe(m.as_ref(), &probe, true);
    assert!(m
        .extra_stats()
        .iter()
        .any(|(k, _)| k == "model.range_skips"));
}

#[test]
fn a_stack_of_every_wrapper_passes_every_capability_on() {
    let probe = Probe::new();
    let stack = recording(model(recording(probe.clone())));
    calls_reach_the_probe(stack.as_ref(), &probe, true);
}

/// The overlay keeps writes to itself: what reaches the device below is reads, hints,
/// marks and counters; gathered, ranged and reserved writes land in the view.
#[test]
fn the_overlay_passes_on_what_is_not_a_write_and_serves_the_rest() {
    let probe = Probe::new();
    let ov = OverlayDevice::new(recording(probe.clone()));
    let caps = ov.capabilities().names();
    for c in ["hints", "history", "counters"] {
        assert!(caps.contains(&c), "{c} dropped: {caps:?}");
    }
    probe.take();
    ov.will_need(1, 2);
    ov.mark("x");
    assert_eq!(probe.take(), ["will_need 1+2", "mark x"]);
    assert!(ov.extra_stats().contains(&("probe.calls".to_string(), 7)));
    let a = vec![5u8; BS];
    ov.write_blocks_gather(3, &[&a, &a], WriteClass::Data)
        .unwrap();
    assert_eq!(
        ov.write_range(&[7, 8], &a, WriteClass::Metadata).unwrap(),
        7
    );
    ov.reserve(9, 1).unwrap();
    assert!(probe.take().is_empty(), "a write went below the overlay");
    let mut back = vec![0u8; 3 * BS];
    ov.read_blocks(3, &mut back).unwrap();
    assert_eq!(&back[..2 * BS], &[5u8; 2 * BS][..]);
    let mut part = vec![0u8; 10];
    ov.read_part(7, 5, &mut part).unwrap();
    assert_eq!(part, [5u8; 10]);
    assert_eq!(ov.written_blocks(), 3);
}
