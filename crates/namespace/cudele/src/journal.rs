//! The client journal: what a decoupled client did, as events, in a compact,
//! versioned, checksummed format that the same bytes serve for every mechanism that
//! moves a journal (Append Client Journal in memory, Local Persist to a file, Global
//! Persist to the service, the merge's input).
//!
//! ```text
//! header  magic "QCJ1" | version u16 | flags u16 | client u64 | subtree u64 | crc32c u32
//! frame   len u32 | crc32c u32 | first_seq u64 | count u32 | events (len bytes)
//! event   postcard of (uid, gid, FsOp)          -- varints: a create is ~30 bytes
//! ```
//!
//! All integers little-endian. A frame's checksum covers `first_seq`, `count` and the
//! events; frames follow one another with consecutive sequence numbers (the first
//! event of a journal is 1), so a merge can name what it already applied by one
//! number, its watermark. Events are [`FsOp`]s, the project's one operation type, with
//! the credentials of the caller that made them.
//!
//! Appending encodes the event at once into the open frame's buffer: the journal in
//! memory is already the bytes that go to a disk or the network, and sealing a frame
//! ([`ClientJournal::seal`]) swaps buffers without copying (the namespace sync ships
//! the sealed frame while the client goes on appending to the next).

use quilt_vfs::FsOp;
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::Path;

pub const MAGIC: [u8; 4] = *b"QCJ1";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 28;
pub const FRAME_HEADER_LEN: usize = 20;
/// The largest frame a reader accepts (a guard against a length that is garbage).
pub const MAX_FRAME: usize = 64 << 20;

/// One update of a decoupled client: an operation and who made it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub uid: u32,
    pub gid: u32,
    pub op: FsOp,
}

/// Whose journal it is and for which subtree.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub client: u64,
    /// The subtree's root directory in the global namespace.
    pub subtree: u64,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut h = [0u8; HEADER_LEN];
        h[0..4].copy_from_slice(&MAGIC);
        h[4..6].copy_from_slice(&VERSION.to_le_bytes());
        h[8..16].copy_from_slice(&self.client.to_le_bytes());
        h[16..24].copy_from_slice(&self.subtree.to_le_bytes());
        let crc = crc32c::crc32c(&h[..24]);
        h[24..28].copy_from_slice(&crc.to_le_bytes());
        h
    }

    pub fn decode(b: &[u8]) -> Result<Header, JournalError> {
        if b.len() < HEADER_LEN {
            return Err(JournalError::Truncated { offset: 0 });
        }
        if b[0..4] != MAGIC {
            return Err(JournalError::NotAJournal);
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(JournalError::Version(version));
        }
        if crc32c::crc32c(&b[..24]) != le32(&b[24..28]) {
            return Err(JournalError::Checksum { offset: 0 });
        }
        Ok(Header {
            client: le64(&b[8..16]),
            subtree: le64(&b[16..24]),
        })
    }
}

fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum JournalError {
    #[error("not a quiltfs client journal (no QCJ1 magic)")]
    NotAJournal,
    #[error("client journal format version {0}; this build reads version 1")]
    Version(u16),
    #[error("the journal is truncated at byte {offset}")]
    Truncated { offset: u64 },
    #[error("the journal is damaged at byte {offset} (checksum mismatch)")]
    Checksum { offset: u64 },
    #[error("a frame at byte {offset} claims {len} bytes, more than a frame may hold")]
    FrameTooLarge { offset: u64, len: u64 },
    #[error("the frame at byte {offset} starts at event {got}, expected {expected}")]
    Gap {
        offset: u64,
        expected: u64,
        got: u64,
    },
    #[error("event {seq} does not decode: {why}")]
    Event { seq: u64, why: String },
    #[error("the frame at byte {offset} holds more bytes than its {count} events")]
    Trailing { offset: u64, count: u32 },
    #[error("writing the journal: {0}")]
    Io(String),
}

/// A client's journal in memory: sealed frames and the open one.
pub struct ClientJournal {
    header: Header,
    /// The open frame's events, encoded.
    open: Vec<u8>,
    open_count: u32,
    /// The sequence number of the open frame's first event.
    open_first: u64,
    bytes_appended: u64,
}

/// A sealed frame: its bytes (header included) and the events it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Frame {
    pub bytes: Vec<u8>,
    pub first_seq: u64,
    pub count: u32,
}

impl Frame {
    /// The last event's sequence number (`first_seq - 1` for an empty frame).
    pub fn last_seq(&self) -> u64 {
        self.first_seq + u64::from(self.count) - 1
    }
}

impl ClientJournal {
    /// A journal whose first event will be `next_seq` (1 for a new one; after a
    /// merge, the next number past the watermark).
    pub fn new(header: Header, next_seq: u64) -> ClientJournal {
        ClientJournal {
            header,
            open: Vec::with_capacity(64 << 10),
            open_count: 0,
            open_first: next_seq.max(1),
            bytes_appended: 0,
        }
    }

    pub fn header(&self) -> Header {
        self.header
    }

    /// Append Client Journal: the event is encoded into the open frame; nothing is
    /// asked of anyone. Returns its sequence number.
    pub fn append(&mut self, ev: &Event) -> u64 {
        let before = self.open.len();
        // Encoding into a Vec cannot fail for these types (no maps, no unsized data).
        if postcard::to_io(ev, &mut self.open).is_err() {
            self.open.truncate(before);
        }
        self.bytes_appended += (self.open.len() - before) as u64;
        let seq = self.open_first + u64::from(self.open_count);
        self.open_count += 1;
        seq
    }

    /// Events appended and not yet sealed.
    pub fn pending(&self) -> u32 {
        self.open_count
    }

    /// The next event's sequence number.
    pub fn next_seq(&self) -> u64 {
        self.open_first + u64::from(self.open_count)
    }

    /// Bytes of events appended since the journal began (frame headers not counted).
    pub fn event_bytes(&self) -> u64 {
        self.bytes_appended
    }

    /// Closes the open frame and starts the next; `None` when it holds no events.
    pub fn seal(&mut self) -> Option<Frame> {
        if self.open_count == 0 {
            return None;
        }
        let events = std::mem::replace(&mut self.open, Vec::with_capacity(64 << 10));
        let frame = encode_frame(self.open_first, self.open_count, &events);
        self.open_first += u64::from(self.open_count);
        self.open_count = 0;
        Some(frame)
    }
}

/// A frame's bytes from its events (already encoded, `count` of them).
pub fn encode_frame(first_seq: u64, count: u32, events: &[u8]) -> Frame {
    let mut bytes = Vec::with_capacity(FRAME_HEADER_LEN + events.len());
    bytes.extend_from_slice(&(events.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&[0; 4]);
    bytes.extend_from_slice(&first_seq.to_le_bytes());
    bytes.extend_from_slice(&count.to_le_bytes());
    bytes.extend_from_slice(events);
    let crc = crc32c::crc32c(&bytes[8..]);
    bytes[4..8].copy_from_slice(&crc.to_le_bytes());
    Frame {
        bytes,
        first_seq,
        count,
    }
}

/// A whole journal's bytes: its header and frames.
pub fn encode(header: &Header, frames: &[Frame]) -> Vec<u8> {
    let mut out = header.encode().to_vec();
    for f in frames {
        out.extend_from_slice(&f.bytes);
    }
    out
}

/// How a reader treats a damaged end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tail {
    /// Any damage is an error (a journal that crossed the network, or was merged).
    Strict,
    /// The last frame may be torn (a local file after a crash in the middle of an
    /// append that was never acknowledged): it is dropped and said so. Damage before
    /// the last frame is still an error.
    MayBeTorn,
}

/// A journal read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Read {
    pub header: Header,
    /// Events with their sequence numbers, in order.
    pub events: Vec<(u64, Event)>,
    /// Bytes of a torn last frame that were dropped (only with [`Tail::MayBeTorn`]).
    pub torn_bytes: u64,
}

/// Reads a journal's bytes: every frame checked, every event decoded.
pub fn read(bytes: &[u8], tail: Tail) -> Result<Read, JournalError> {
    let header = Header::decode(bytes)?;
    let mut events = Vec::new();
    let mut off = HEADER_LEN;
    let mut expected: Option<u64> = None;
    while off < bytes.len() {
        let at = off as u64;
        match read_frame(&bytes[off..], at, expected) {
            Ok((n, first, evs)) => {
                expected = Some(first + evs.len() as u64);
                events.extend(evs);
                off += n;
            }
            Err(e @ (JournalError::Truncated { .. } | JournalError::Checksum { .. }))
                if tail == Tail::MayBeTorn && frame_reaches_end(&bytes[off..]) =>
            {
                tracing::warn!("client journal: {e}; the torn last frame is dropped");
                return Ok(Read {
                    header,
                    events,
                    torn_bytes: (bytes.len() - off) as u64,
                });
            }
            Err(e) => return Err(e),
        }
    }
    Ok(Read {
        header,
        events,
        torn_bytes: 0,
    })
}

/// Whether the frame starting at `b` is the journal's last: its claimed length
/// reaches the end (or past it, or the header itself is cut).
fn frame_reaches_end(b: &[u8]) -> bool {
    if b.len() < FRAME_HEADER_LEN {
        return true;
    }
    let len = le32(b) as usize;
    FRAME_HEADER_LEN + len >= b.len()
}

type FrameRead = (usize, u64, Vec<(u64, Event)>);

fn read_frame(b: &[u8], at: u64, expected: Option<u64>) -> Result<FrameRead, JournalError> {
    if b.len() < FRAME_HEADER_LEN {
        return Err(JournalError::Truncated {
            offset: at + b.len() as u64,
        });
    }
    let len = le32(b) as usize;
    if len > MAX_FRAME {
        return Err(JournalError::FrameTooLarge {
            offset: at,
            len: len as u64,
        });
    }
    let end = FRAME_HEADER_LEN + len;
    if b.len() < end {
        return Err(JournalError::Truncated {
            offset: at + b.len() as u64,
        });
    }
    if crc32c::crc32c(&b[8..end]) != le32(&b[4..8]) {
        return Err(JournalError::Checksum { offset: at });
    }
    let first = le64(&b[8..16]);
    let count = le32(&b[16..20]);
    if let Some(e) = expected {
        if first != e {
            return Err(JournalError::Gap {
                offset: at,
                expected: e,
                got: first,
            });
        }
    }
    if first == 0 {
        return Err(JournalError::Gap {
            offset: at,
            expected: 1,
            got: 0,
        });
    }
    let mut rest = &b[FRAME_HEADER_LEN..end];
    // Each event takes at least a byte: a count larger than the bytes is garbage.
    if count as usize > rest.len() {
        return Err(JournalError::Event {
            seq: first,
            why: format!("{count} events claimed in {} bytes", rest.len()),
        });
    }
    let mut evs = Vec::with_capacity(count as usize);
    for i in 0..u64::from(count) {
        let seq = first + i;
        let (ev, r) =
            postcard::take_from_bytes::<Event>(rest).map_err(|e| JournalError::Event {
                seq,
                why: e.to_string(),
            })?;
        evs.push((seq, ev));
        rest = r;
    }
    if !rest.is_empty() {
        return Err(JournalError::Trailing { offset: at, count });
    }
    Ok((end, first, evs))
}

/// Local Persist: a journal file on the client's disk, appended frame by frame and
/// made durable (fdatasync) before the append returns.
pub struct LocalFile {
    file: std::fs::File,
}

impl LocalFile {
    /// Opens (creating with `header` if new) the journal file at `path`. An existing
    /// file must be this client's journal of this subtree.
    pub fn open(path: &Path, header: Header) -> Result<LocalFile, JournalError> {
        use std::io::Read as _;
        let io = |e: std::io::Error| JournalError::Io(format!("{}: {e}", path.display()));
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .map_err(io)?;
        let mut head = Vec::new();
        (&mut file)
            .take(HEADER_LEN as u64)
            .read_to_end(&mut head)
            .map_err(io)?;
        if head.is_empty() {
            file.write_all(&header.encode()).map_err(io)?;
            file.sync_data().map_err(io)?;
        } else {
            let h = Header::decode(&head)?;
            if h != header {
                return Err(JournalError::Io(format!(
                    "{} is the journal of client {} for subtree {}, not of client {} for \
                     subtree {}",
                    path.display(),
                    h.client,
                    h.subtree,
                    header.client,
                    header.subtree
                )));
            }
        }
        Ok(LocalFile { file })
    }

    /// Appends `frame` and waits until it is durable.
    pub fn append(&mut self, frame: &Frame) -> Result<(), JournalError> {
        let io = |e: std::io::Error| JournalError::Io(e.to_string());
        self.file.write_all(&frame.bytes).map_err(io)?;
        self.file.sync_data().map_err(io)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn create(parent: u64, name: &str, ino: u64) -> Event {
        Event {
            uid: 1000,
            gid: 1000,
            op: FsOp::Mknod {
                parent,
                name: name.as_bytes().to_vec(),
                mode: libc::S_IFREG | 0o644,
                rdev: 0,
                ino: Some(ino),
            },
        }
    }

    fn journal(n: u64, frame_every: u64) -> (Vec<u8>, Vec<Event>) {
        let h = Header {
            client: 7,
            subtree: 12,
        };
        let mut j = ClientJournal::new(h, 1);
        let mut frames = Vec::new();
        let mut evs = Vec::new();
        for i in 0..n {
            let ev = create(12, &format!("file.{i}"), 70_000 + i);
            assert_eq!(j.append(&ev), i + 1);
            evs.push(ev);
            if (i + 1) % frame_every == 0 {
                frames.extend(j.seal());
            }
        }
        frames.extend(j.seal());
        (encode(&h, &frames), evs)
    }

    #[test]
    fn a_journal_reads_back_event_for_event() {
        let (bytes, evs) = journal(1000, 300);
        let r = read(&bytes, Tail::Strict).unwrap();
        assert_eq!(r.header.client, 7);
        assert_eq!(r.header.subtree, 12);
        assert_eq!(r.torn_bytes, 0);
        let got: Vec<Event> = r.events.iter().map(|(_, e)| e.clone()).collect();
        assert_eq!(got, evs);
        let seqs: Vec<u64> = r.events.iter().map(|(s, _)| *s).collect();
        assert_eq!(seqs, (1..=1000).collect::<Vec<_>>());
    }

    #[test]
    fn a_create_costs_far_less_than_the_papers_two_and_a_half_kilobytes() {
        let (bytes, _) = journal(10_000, 1000);
        let per = bytes.len() as f64 / 10_000.0;
        // Each create: credentials, parent, a ten-byte name, mode, the granted number.
        assert!(per < 40.0, "{per} bytes per create");
    }

    #[test]
    fn every_damaged_byte_is_caught() {
        let (bytes, _) = journal(40, 10);
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x40;
            assert!(
                read(&b, Tail::Strict).is_err(),
                "a flipped bit at byte {i} went unnoticed"
            );
        }
    }

    #[test]
    fn every_truncation_is_caught_and_a_torn_tail_of_a_local_file_is_dropped() {
        let (bytes, _) = journal(40, 10);
        let frame_ends: Vec<usize> = {
            let mut v = vec![HEADER_LEN];
            let mut off = HEADER_LEN;
            while off < bytes.len() {
                off += FRAME_HEADER_LEN + le32(&bytes[off..]) as usize;
                v.push(off);
            }
            v
        };
        for cut in HEADER_LEN..bytes.len() {
            let b = &bytes[..cut];
            if frame_ends.contains(&cut) {
                // A cut between frames is a shorter journal, whole.
                let r = read(b, Tail::Strict).unwrap();
                assert_eq!(r.events.len() % 10, 0);
                continue;
            }
            assert!(read(b, Tail::Strict).is_err(), "cut at {cut}");
            let r = read(b, Tail::MayBeTorn).unwrap();
            let whole = frame_ends.iter().filter(|&&e| e <= cut).count() - 1;
            assert_eq!(r.events.len(), whole * 10, "cut at {cut}");
            assert!(r.torn_bytes > 0);
        }
        // A damaged frame that is not the last is damage, torn tail or not.
        let mut b = bytes.clone();
        b[HEADER_LEN + FRAME_HEADER_LEN + 3] ^= 1;
        assert!(matches!(
            read(&b, Tail::MayBeTorn),
            Err(JournalError::Checksum { .. })
        ));
    }

    #[test]
    fn frames_out_of_order_or_from_nowhere_are_refused() {
        let h = Header {
            client: 1,
            subtree: 1,
        };
        let mut j = ClientJournal::new(h, 1);
        j.append(&create(1, "a", 100));
        let f1 = j.seal().unwrap();
        j.append(&create(1, "b", 101));
        let f2 = j.seal().unwrap();
        assert!(matches!(
            read(&encode(&h, &[f2.clone(), f1.clone()]), Tail::Strict),
            Err(JournalError::Gap { .. })
        ));
        assert!(matches!(
            read(&encode(&h, &[f1.clone(), f1.clone()]), Tail::Strict),
            Err(JournalError::Gap { .. })
        ));
        // A journal that begins after a merge's watermark is fine.
        let r = read(&encode(&h, &[f2]), Tail::Strict).unwrap();
        assert_eq!(r.events[0].0, 2);
        // Garbage that is not a journal at all.
        assert_eq!(
            read(b"hello world, not a journal...", Tail::Strict),
            Err(JournalError::NotAJournal)
        );
        let mut v2 = h.encode();
        v2[4] = 2;
        assert_eq!(read(&v2, Tail::Strict), Err(JournalError::Version(2)));
    }

    #[test]
    fn a_local_file_takes_frames_and_refuses_another_clients_journal() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("j");
        let h = Header {
            client: 3,
            subtree: 9,
        };
        let mut j = ClientJournal::new(h, 1);
        let mut f = LocalFile::open(&path, h).unwrap();
        for i in 0..5 {
            j.append(&create(9, &format!("x{i}"), 500 + i));
            f.append(&j.seal().unwrap()).unwrap();
        }
        drop(f);
        // Reopened: appends go on after what is there.
        let mut f = LocalFile::open(&path, h).unwrap();
        j.append(&create(9, "y", 600));
        f.append(&j.seal().unwrap()).unwrap();
        let r = read(&std::fs::read(&path).unwrap(), Tail::MayBeTorn).unwrap();
        assert_eq!(r.events.len(), 6);
        let other = Header {
            client: 4,
            subtree: 9,
        };
        let e = LocalFile::open(&path, other).err().unwrap().to_string();
        assert!(e.contains("client 3"), "{e}");
    }
}
