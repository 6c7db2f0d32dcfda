//! FUSE over io_uring (kernel 6.14 and later, with the fuse module's `enable_uring`).
//!
//! Why: on /dev/fuse any idle worker may take a request, so the caller and the worker
//! usually sit on different CPUs and every request pays a cross-CPU wakeup each way;
//! on this machine (a 2-vCPU VM) that doubles the cost of a request (see
//! docs/results: the same untar takes 2.4-3x longer unpinned than with caller and
//! server on one CPU). The kernel's io_uring transport keeps one queue per CPU and
//! puts a request on the queue of the CPU its caller runs on; our workers for that
//! queue are pinned to that CPU, so a request and its answer are handed over locally.
//!
//! Protocol (fs/fuse/dev_uring.c): after INIT (answered on /dev/fuse with
//! `OVER_IO_URING`), each worker registers ring entries with `IORING_OP_URING_CMD`
//! (128-byte SQEs; `FUSE_IO_URING_CMD_REGISTER`, `addr` = two iovecs: a 288-byte header
//! area and a payload buffer of at least the negotiated largest write). The kernel
//! answers a registration when a request lands in the entry: `fuse_in_header` in the
//! first 128 bytes of the header area, the request's first argument (its per-opcode
//! struct, empty for name-only requests) in the next 128, then `fuse_uring_ent_in_out`
//! (the payload's size); the remaining arguments are in the payload. The answer goes
//! back the same way (`fuse_out_header` first, the body in the payload, its size in
//! `ent_in_out`) with `FUSE_IO_URING_CMD_COMMIT_AND_FETCH`, which also re-arms the
//! entry. The kernel switches to the ring once every CPU's queue has an entry; until
//! then, and for FORGET and INTERRUPT always, requests come on /dev/fuse.

use crate::abi::opcode;
use crate::channel::{Channel, Received};
use crate::reply::{Reply, Sink};
use crate::request::{Proto, Request};
use io_uring::{cqueue, squeue, types, IoUring};
use std::cell::RefCell;
use std::io;
use std::os::fd::RawFd;
use std::sync::{Arc, Mutex};

/// A little-endian u32 from the first four bytes of `b` (shorter: the rest zero).
fn le32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    let n = b.len().min(4);
    a[..n].copy_from_slice(&b[..n]);
    u32::from_le_bytes(a)
}

/// A little-endian u64 from the first eight bytes of `b` (shorter: the rest zero).
fn le64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    let n = b.len().min(8);
    a[..n].copy_from_slice(&b[..n]);
    u64::from_le_bytes(a)
}

const CMD_REGISTER: u32 = 1;
const CMD_COMMIT_AND_FETCH: u32 = 2;

/// `struct fuse_uring_req_header`: in/out header, per-opcode header, `ent_in_out`.
const HEADERS_LEN: usize = 128 + 128 + 32;
const OP_IN: usize = 128;
const OP_IN_LEN: usize = 128;
/// Offset of `fuse_uring_ent_in_out.payload_sz` (after `flags` and `commit_id`).
const PAYLOAD_SZ: usize = 256 + 16;

/// Room before the payload for the in-header and the per-opcode header, copied there
/// so the request reads exactly as one from /dev/fuse (the payload is not moved).
const PREFIX: usize = crate::abi::IN_HEADER_LEN + OP_IN_LEN;

/// How many queues the kernel makes: one per possible CPU.
pub(crate) fn possible_cpus() -> usize {
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse_cpu_list(s.trim()))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// The highest CPU of a list such as `0-3,6` plus one.
fn parse_cpu_list(s: &str) -> Option<usize> {
    let mut top = None;
    for part in s.split(',') {
        let last = part.rsplit('-').next()?;
        let n: usize = last.trim().parse().ok()?;
        top = Some(top.map_or(n + 1, |t: usize| t.max(n + 1)));
    }
    top
}

/// One registered entry: its header area, its payload (behind [`PREFIX`]) and the
/// iovecs that told the kernel where they are. Boxed, so they never move.
struct Slot {
    headers: Box<[u8]>,
    buf: Box<[u8]>,
    iov: Box<[libc::iovec; 2]>,
}

impl Slot {
    fn new(payload: usize) -> Slot {
        let mut headers = vec![0u8; HEADERS_LEN].into_boxed_slice();
        let mut buf = vec![0u8; PREFIX + payload].into_boxed_slice();
        let iov = Box::new([
            libc::iovec {
                iov_base: headers.as_mut_ptr().cast(),
                iov_len: HEADERS_LEN,
            },
            libc::iovec {
                // SAFETY: PREFIX is within buf.
                iov_base: unsafe { buf.as_mut_ptr().add(PREFIX) }.cast(),
                iov_len: payload,
            },
        ]);
        Slot { headers, buf, iov }
    }

    fn payload_cap(&self) -> usize {
        self.buf.len() - PREFIX
    }

    /// Lays the request the kernel wrote out contiguously; returns its byte range in
    /// `buf`, or why it cannot be (then the header's `unique` is still valid).
    fn request_range(&mut self) -> Result<std::ops::Range<usize>, &'static str> {
        let h = &self.headers;
        let len = le32(&h[0..4]) as usize;
        let payload = le32(&h[PAYLOAD_SZ..PAYLOAD_SZ + 4]) as usize;
        if payload > self.payload_cap() {
            return Err("ring payload larger than its buffer");
        }
        let op_len = len
            .checked_sub(crate::abi::IN_HEADER_LEN + payload)
            .ok_or("ring request shorter than its header and payload")?;
        if op_len > OP_IN_LEN {
            return Err("ring request's first argument larger than its header slot");
        }
        let start = PREFIX - op_len - crate::abi::IN_HEADER_LEN;
        self.buf[start..start + crate::abi::IN_HEADER_LEN]
            .copy_from_slice(&h[..crate::abi::IN_HEADER_LEN]);
        self.buf[PREFIX - op_len..PREFIX].copy_from_slice(&h[OP_IN..OP_IN + op_len]);
        Ok(start..PREFIX + payload)
    }

    fn unique(&self) -> u64 {
        le64(&self.headers[8..16])
    }

    /// Puts a staged answer (out-header and body) where the kernel reads it.
    fn stage_answer(&mut self, staged: &[u8]) {
        let out = crate::abi::OUT_HEADER_LEN;
        let mut body = &staged[out.min(staged.len())..];
        self.headers[..out].copy_from_slice(&staged[..out]);
        if body.len() > self.payload_cap() {
            // Cannot happen: no answer is larger than the largest write negotiated.
            tracing::error!("FUSE answer of {} bytes does not fit the ring", body.len());
            self.headers[4..8].copy_from_slice(&(-libc::EIO).to_le_bytes());
            body = &[];
        }
        self.buf[PREFIX..PREFIX + body.len()].copy_from_slice(body);
        self.headers[PAYLOAD_SZ..PAYLOAD_SZ + 4]
            .copy_from_slice(&(body.len() as u32).to_le_bytes());
    }
}

fn command(
    fd: RawFd,
    op: u32,
    qid: u16,
    commit_id: u64,
    slot: &Slot,
    tag: u64,
) -> squeue::Entry128 {
    // struct fuse_uring_cmd_req: flags, commit_id, qid.
    let mut cmd = [0u8; 80];
    cmd[8..16].copy_from_slice(&commit_id.to_le_bytes());
    cmd[16..18].copy_from_slice(&qid.to_le_bytes());
    let e = io_uring::opcode::UringCmd80::new(types::Fd(fd), op)
        .cmd(cmd)
        .addr(Some(slot.iov.as_ptr() as u64))
        .build()
        .user_data(tag);
    with_len(e, 2)
}

/// Sets `sqe->len` (the number of iovecs, which the fuse command checks), a field the
/// io-uring crate's builder for this opcode does not expose.
fn with_len(e: squeue::Entry128, len: u32) -> squeue::Entry128 {
    const _: () = assert!(std::mem::size_of::<squeue::Entry128>() == 128);
    // SAFETY: Entry128 is repr(C), 128 bytes of plain integers and unions of them
    // (struct io_uring_sqe and the 64 bytes after it); every bit pattern is valid, and
    // `len` is the u32 at byte 24 of io_uring_sqe.
    let mut raw: [u8; 128] = unsafe { std::mem::transmute(e) };
    raw[24..28].copy_from_slice(&len.to_le_bytes());
    unsafe { std::mem::transmute::<[u8; 128], squeue::Entry128>(raw) }
}

/// Pins the calling thread to one CPU (the queue's); false if it could not.
fn pin_to(cpu: usize) -> bool {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET stays within it for cpu < CPU_SETSIZE.
    unsafe {
        if cpu >= libc::CPU_SETSIZE as usize {
            return false;
        }
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

/// Whether a request must wait for the FORGETs queued before it. The kernel queues a
/// FORGET on /dev/fuse when it drops an inode (an unlinked file's last name: before
/// unlink(2) returns) but sends the next request over the ring, which can overtake it;
/// the inode's space is freed only at its FORGET. Requests that report or allocate
/// space see it freed, as on a kernel file system, by draining /dev/fuse first.
/// UNLINK and RMDIR neither report nor allocate: they leave the FORGETs to the
/// /dev/fuse thread, on the other CPU, so that `rm -rf` does not wait for the previous
/// file's blocks to be freed (read from the device when its map is cold) before the
/// next unlink.
fn after_forgets(opc: u32) -> bool {
    !matches!(
        opc,
        opcode::LOOKUP
            | opcode::GETATTR
            | opcode::READ
            | opcode::READDIR
            | opcode::READDIRPLUS
            | opcode::READLINK
            | opcode::GETXATTR
            | opcode::LISTXATTR
            | opcode::OPEN
            | opcode::OPENDIR
            | opcode::RELEASE
            | opcode::RELEASEDIR
            | opcode::FLUSH
            | opcode::ACCESS
            | opcode::LSEEK
            | opcode::UNLINK
            | opcode::RMDIR
    )
}

/// How long the /dev/fuse thread leaves FORGETs to the ring workers' drains between
/// its own sweeps ([`Drainer::serve`]). Short enough that an unlinked file's space is
/// freed promptly when nothing else comes (requests that report or allocate space
/// drain first anyway), long enough to batch a burst.
const SWEEP_PAUSE: std::time::Duration = std::time::Duration::from_millis(2);

/// A worker's ring, set up and registered (so the caller learns of failure before it
/// decides how many /dev/fuse workers it needs).
pub(crate) struct Worker {
    ring: IoUring<squeue::Entry128, cqueue::Entry>,
    slots: Vec<Slot>,
    fd: RawFd,
    qid: u16,
    /// /dev/fuse, drained before requests that must see the FORGETs queued before
    /// them ([`after_forgets`]).
    dev: Arc<Drainer>,
    /// Completions seen while registering that carry requests (a queue can become
    /// ready, and an entry filled, before `register` returns): served first by `run`.
    early: Vec<(usize, i32)>,
    /// Whether waits hand the CPU to the caller (`handoff.rs`).
    handoff: Arc<crate::handoff::Handoff>,
}

/// The one way /dev/fuse is read while the ring serves: a non-blocking descriptor read
/// under a lock until it is empty, by the session's /dev/fuse thread when it polls
/// readable and by ring workers before requests that must follow queued FORGETs.
/// Reading and serving under one lock is what makes the drain a barrier: when a
/// drainer gets the lock, every request queued before is either still in the kernel
/// (it reads it) or was read and served by whoever held the lock before.
pub(crate) struct Drainer {
    chan: Channel,
    buf: Mutex<Vec<u8>>,
}

impl Drainer {
    pub(crate) fn new(master: &Channel, bufsize: usize) -> io::Result<Drainer> {
        let chan = master.clone_channel()?;
        chan.set_nonblocking()?;
        Ok(Drainer {
            chan,
            buf: Mutex::new(vec![0u8; bufsize]),
        })
    }

    /// Serves what is pending; false once the connection is gone.
    pub(crate) fn drain(
        &self,
        proto: Proto,
        serve: &dyn Fn(&Request<'_>, Reply<'_>),
    ) -> io::Result<bool> {
        let mut buf = self.buf.lock().unwrap_or_else(|e| e.into_inner());
        loop {
            match self.chan.try_receive(&mut buf)? {
                None => return Ok(true),
                Some(Received::Closed) => return Ok(false),
                Some(Received::Request(n)) => match Request::parse_with(&buf[..n], proto) {
                    Ok(req) => serve(&req, Reply::new(&self.chan, req.header.unique)),
                    Err(e) => tracing::error!("{e}"),
                },
            }
        }
    }

    /// Serves /dev/fuse until the connection ends: waits until it is readable, drains,
    /// and pauses for [`SWEEP_PAUSE`] before waiting again.
    ///
    /// The pause is what keeps `rm -rf` fast. Every unlinked file's FORGET is queued on
    /// /dev/fuse before unlink(2) returns; a thread waiting in poll is woken for each
    /// one (often on the other, idle, vCPU), and frees the inode under the file
    /// system's lock while the ring serves the caller's next request, so the two
    /// contend and wake each other. Not waiting most of the time, this thread is not
    /// woken, and FORGETs come in batches of a pause's worth. (Delete of linux-source:
    /// 4.8 s -> 3.3 s, when unlinks still drained.) During `rm -rf` this thread frees
    /// the unlinked files, beside the ring (see [`after_forgets`]); requests that must
    /// see the space freed drain what it has not reached yet.
    pub(crate) fn serve(
        &self,
        proto: Proto,
        serve: &dyn Fn(&Request<'_>, Reply<'_>),
    ) -> io::Result<()> {
        loop {
            let mut p = libc::pollfd {
                fd: self.chan.raw(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd.
            let r = unsafe { libc::poll(&mut p, 1, -1) };
            if r < 0 {
                let e = io::Error::last_os_error();
                if e.raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return Err(e);
            }
            if !self.drain(proto, serve)? {
                return Ok(());
            }
            std::thread::sleep(SWEEP_PAUSE);
            if p.revents & (libc::POLLERR | libc::POLLHUP) != 0 && p.revents & libc::POLLIN == 0 {
                return Ok(());
            }
        }
    }
}

impl Worker {
    /// Makes a ring for queue `qid` with `entries` entries of `payload` bytes and
    /// registers them. Runs on the worker's own thread (the ring is single-issuer).
    pub(crate) fn register(
        master: &Channel,
        dev: Arc<Drainer>,
        handoff: Arc<crate::handoff::Handoff>,
        qid: u16,
        entries: usize,
        payload: usize,
    ) -> io::Result<Worker> {
        pin_to(qid as usize);
        let fd = master.raw();
        let depth = (entries * 2).next_power_of_two() as u32;
        let ring = IoUring::<squeue::Entry128, cqueue::Entry>::builder()
            .setup_single_issuer()
            .setup_defer_taskrun()
            .build(depth)
            .or_else(|_| IoUring::<squeue::Entry128, cqueue::Entry>::builder().build(depth))?;
        let slots: Vec<Slot> = (0..entries).map(|_| Slot::new(payload)).collect();
        let mut w = Worker {
            ring,
            slots,
            fd,
            qid,
            dev,
            early: Vec::new(),
            handoff,
        };
        for i in 0..w.slots.len() {
            w.push(CMD_REGISTER, 0, i)?;
        }
        w.ring.submit()?;
        // A registration fails at once (an error completion) or stays pending until a
        // request arrives; look for the failures now, and keep any request that came.
        let seen: Vec<(usize, i32)> = w
            .ring
            .completion()
            .map(|c| (c.user_data() as usize, c.result()))
            .collect();
        for (i, res) in seen {
            if res < 0 {
                return Err(io::Error::from_raw_os_error(-res));
            }
            w.early.push((i, res));
        }
        Ok(w)
    }

    fn push(&mut self, op: u32, commit_id: u64, i: usize) -> io::Result<()> {
        let e = command(self.fd, op, self.qid, commit_id, &self.slots[i], i as u64);
        // SAFETY: the iovecs and buffers the entry points to live in self.slots, which
        // outlives the ring's use of them (the worker owns both; the kernel lets go of
        // them when the connection ends, which ends the worker).
        while unsafe { self.ring.submission().push(&e) }.is_err() {
            self.ring.submit()?;
        }
        Ok(())
    }

    /// Serves requests until the connection ends. `serve` handles one parsed request
    /// and answers through the reply it is given.
    pub(crate) fn run(
        mut self,
        proto: Proto,
        serve: &dyn Fn(&Request<'_>, Reply<'_>),
    ) -> io::Result<()> {
        let staged = RefCell::new(Vec::with_capacity(4096));
        let mut live = self.slots.len();
        let mut done: Vec<(usize, i32)> = std::mem::take(&mut self.early);
        while live > 0 {
            if done.is_empty() {
                // The answers staged below are submitted here.
                match self.handoff.submit_and_wait(&mut self.ring) {
                    Ok(_) => {}
                    Err(e) if e.raw_os_error() == Some(libc::EINTR) => continue,
                    Err(e) => return Err(e),
                }
                done.extend(
                    self.ring
                        .completion()
                        .map(|c| (c.user_data() as usize, c.result())),
                );
            }
            for &(i, res) in &done {
                if i >= self.slots.len() {
                    continue;
                }
                if res < 0 {
                    // ENOTCONN/ECANCELED/ECONNABORTED: the connection is going away.
                    if !matches!(
                        -res,
                        libc::ENOTCONN | libc::ECANCELED | libc::ECONNABORTED | libc::ENODEV
                    ) {
                        tracing::warn!(
                            "FUSE ring entry {i} of queue {}: {}",
                            self.qid,
                            io::Error::from_raw_os_error(-res)
                        );
                    }
                    live -= 1;
                    continue;
                }
                let unique = self.slots[i].unique();
                let opc = le32(&self.slots[i].headers[4..8]);
                // fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid.
                let pid = le32(&self.slots[i].headers[32..36]);
                self.handoff.arrived(pid, self.qid);
                if after_forgets(opc) {
                    self.dev.drain(proto, serve)?;
                }
                staged.borrow_mut().clear();
                match self.slots[i].request_range() {
                    Ok(range) => {
                        let slot = &self.slots[i];
                        match Request::parse_with(&slot.buf[range], proto) {
                            Ok(req) => serve(&req, Reply::to(Sink::Ring(&staged), unique)),
                            Err(e) => {
                                tracing::error!("{e}");
                                Reply::to(Sink::Ring(&staged), unique).error(libc::EIO);
                            }
                        }
                    }
                    Err(e) => {
                        tracing::error!("{e}");
                        Reply::to(Sink::Ring(&staged), unique).error(libc::EIO);
                    }
                }
                if staged.borrow().is_empty() {
                    // Requests that take no answer never come over the ring; answer
                    // anyway, or the entry would never be re-armed.
                    Reply::to(Sink::Ring(&staged), unique).error(libc::EIO);
                }
                self.slots[i].stage_answer(&staged.borrow());
                self.push(CMD_COMMIT_AND_FETCH, unique, i)?;
            }
            done.clear();
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_lists() {
        assert_eq!(parse_cpu_list("0-1"), Some(2));
        assert_eq!(parse_cpu_list("0"), Some(1));
        assert_eq!(parse_cpu_list("0-3,6"), Some(7));
        assert_eq!(parse_cpu_list("x"), None);
    }

    #[test]
    fn a_ring_request_reads_as_one_from_dev_fuse() {
        let mut s = Slot::new(8192);
        // A WRITE-shaped request: 40-byte header, 40-byte op header, 5 bytes of data.
        let len = 40 + 40 + 5u32;
        s.headers[0..4].copy_from_slice(&len.to_le_bytes());
        s.headers[4..8].copy_from_slice(&16u32.to_le_bytes());
        s.headers[8..16].copy_from_slice(&77u64.to_le_bytes());
        for b in &mut s.headers[OP_IN..OP_IN + 40] {
            *b = 0xab;
        }
        s.headers[PAYLOAD_SZ..PAYLOAD_SZ + 4].copy_from_slice(&5u32.to_le_bytes());
        s.buf[PREFIX..PREFIX + 5].copy_from_slice(b"hello");
        let r = s.request_range().unwrap();
        let bytes = &s.buf[r];
        assert_eq!(bytes.len(), 85);
        assert_eq!(&bytes[0..4], &len.to_le_bytes());
        assert_eq!(&bytes[8..16], &77u64.to_le_bytes());
        assert!(bytes[40..80].iter().all(|&b| b == 0xab));
        assert_eq!(&bytes[80..], b"hello");
        assert_eq!(s.unique(), 77);

        // An op header larger than its slot is refused, not read past.
        s.headers[0..4].copy_from_slice(&(40 + 200 + 5u32).to_le_bytes());
        assert!(s.request_range().is_err());
        // So is a payload larger than the buffer.
        s.headers[PAYLOAD_SZ..PAYLOAD_SZ + 4].copy_from_slice(&100_000u32.to_le_bytes());
        assert!(s.request_range().is_err());
    }

    #[test]
    fn answers_go_to_the_header_and_payload() {
        let mut s = Slot::new(8192);
        let mut staged = vec![0u8; 16];
        staged[0..4].copy_from_slice(&(16 + 3u32).to_le_bytes());
        staged[8..16].copy_from_slice(&9u64.to_le_bytes());
        staged.extend_from_slice(b"abc");
        s.stage_answer(&staged);
        assert_eq!(&s.headers[8..16], &9u64.to_le_bytes());
        assert_eq!(&s.headers[PAYLOAD_SZ..PAYLOAD_SZ + 4], &3u32.to_le_bytes());
        assert_eq!(&s.buf[PREFIX..PREFIX + 3], b"abc");
    }

    #[test]
    fn commands_carry_two_iovecs() {
        let s = Slot::new(4096);
        let e = command(5, CMD_REGISTER, 1, 42, &s, 3);
        let raw: [u8; 128] = unsafe { std::mem::transmute(e) };
        assert_eq!(raw[0], io_uring::opcode::UringCmd80::CODE);
        assert_eq!(&raw[4..8], &5i32.to_le_bytes());
        assert_eq!(&raw[8..12], &CMD_REGISTER.to_le_bytes());
        assert_eq!(&raw[16..24], &(s.iov.as_ptr() as u64).to_le_bytes());
        assert_eq!(&raw[24..28], &2u32.to_le_bytes());
        assert_eq!(&raw[48 + 8..48 + 16], &42u64.to_le_bytes());
        assert_eq!(&raw[48 + 16..48 + 18], &1u16.to_le_bytes());
    }
}
