//! The server against a minimal client written from the protocol document, over a Unix
//! socket pair: option haggling, every command, unaligned I/O against a byte model, the
//! errors a client can provoke, and frames that break the protocol.

use quilt_block::{BlockDevice, Capabilities, IoStats, MemDevice, WriteClass};
use quilt_nbd::proto::*;
use quilt_nbd::{serve_connection, Export, NbdError};
use rand::{Rng, SeedableRng};
use std::io::{BufReader, BufWriter, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;

const BS: usize = 4096;
const BLOCKS: u64 = 64;
const SIZE: u64 = BS as u64 * BLOCKS;

struct Client {
    s: UnixStream,
    cookie: u64,
}

fn start(export: Export) -> (UnixStream, JoinHandle<Result<(), NbdError>>) {
    let (a, b) = UnixStream::pair().unwrap();
    let server = std::thread::spawn(move || {
        let r = BufReader::new(b.try_clone().unwrap());
        serve_connection(r, BufWriter::new(b), &export)
    });
    (a, server)
}

fn u16_(s: &mut UnixStream) -> u16 {
    let mut b = [0; 2];
    s.read_exact(&mut b).unwrap();
    u16::from_be_bytes(b)
}
fn u32_(s: &mut UnixStream) -> u32 {
    let mut b = [0; 4];
    s.read_exact(&mut b).unwrap();
    u32::from_be_bytes(b)
}
fn u64_(s: &mut UnixStream) -> u64 {
    let mut b = [0; 8];
    s.read_exact(&mut b).unwrap();
    u64::from_be_bytes(b)
}

/// The server's greeting, and this client's flags.
fn greet(s: &mut UnixStream, client_flags: u32) {
    assert_eq!(u64_(s), INIT_MAGIC);
    assert_eq!(u64_(s), OPT_MAGIC);
    let flags = u16_(s);
    assert_ne!(flags & FLAG_FIXED_NEWSTYLE, 0);
    s.write_all(&client_flags.to_be_bytes()).unwrap();
}

fn send_option(s: &mut UnixStream, option: u32, data: &[u8]) {
    s.write_all(&OPT_MAGIC.to_be_bytes()).unwrap();
    s.write_all(&option.to_be_bytes()).unwrap();
    s.write_all(&(data.len() as u32).to_be_bytes()).unwrap();
    s.write_all(data).unwrap();
}

/// One option reply: (type, data).
fn option_reply(s: &mut UnixStream, option: u32) -> (u32, Vec<u8>) {
    assert_eq!(u64_(s), REPLY_OPT_MAGIC);
    assert_eq!(u32_(s), option);
    let kind = u32_(s);
    let len = u32_(s);
    let mut d = vec![0; len as usize];
    s.read_exact(&mut d).unwrap();
    (kind, d)
}

fn info_data(name: &str, wanted: &[u16]) -> Vec<u8> {
    let mut d = (name.len() as u32).to_be_bytes().to_vec();
    d.extend_from_slice(name.as_bytes());
    d.extend_from_slice(&(wanted.len() as u16).to_be_bytes());
    for w in wanted {
        d.extend_from_slice(&w.to_be_bytes());
    }
    d
}

/// GO on `name`: the replies until ACK, parsed into (size, flags), or the error type.
fn go(s: &mut UnixStream, name: &str) -> Result<(u64, u16), u32> {
    send_option(s, OPT_GO, &info_data(name, &[INFO_NAME, INFO_BLOCK_SIZE]));
    let mut export = None;
    loop {
        let (kind, d) = option_reply(s, OPT_GO);
        match kind {
            REP_INFO => {
                let t = u16::from_be_bytes([d[0], d[1]]);
                if t == INFO_EXPORT {
                    assert_eq!(d.len(), 12);
                    let size = u64::from_be_bytes(d[2..10].try_into().unwrap());
                    export = Some((size, u16::from_be_bytes([d[10], d[11]])));
                } else if t == INFO_NAME {
                    assert_eq!(&d[2..], name.as_bytes());
                } else if t == INFO_BLOCK_SIZE {
                    assert_eq!(d.len(), 14);
                    let min = u32::from_be_bytes(d[2..6].try_into().unwrap());
                    let pref = u32::from_be_bytes(d[6..10].try_into().unwrap());
                    let max = u32::from_be_bytes(d[10..14].try_into().unwrap());
                    assert!(min <= pref && pref <= max && min.is_power_of_two());
                }
            }
            REP_ACK => return Ok(export.expect("INFO_EXPORT before ACK")),
            err => return Err(err),
        }
    }
}

impl Client {
    fn connect(export: Export) -> (Client, u64, u16, JoinHandle<Result<(), NbdError>>) {
        let (mut s, server) = start(export);
        greet(&mut s, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
        let (size, flags) = go(&mut s, "vol").expect("GO succeeds");
        (Client { s, cookie: 0 }, size, flags, server)
    }

    /// One command: (error, data read).
    fn cmd(
        &mut self,
        kind: u16,
        flags: u16,
        offset: u64,
        length: u32,
        payload: &[u8],
    ) -> (u32, Vec<u8>) {
        self.cookie += 1;
        let req = Request {
            flags,
            kind,
            cookie: self.cookie,
            offset,
            length,
        };
        self.s.write_all(&req.encode()).unwrap();
        self.s.write_all(payload).unwrap();
        assert_eq!(u32_(&mut self.s), SIMPLE_REPLY_MAGIC);
        let error = u32_(&mut self.s);
        assert_eq!(
            u64_(&mut self.s),
            self.cookie,
            "the reply names its request"
        );
        let mut data = Vec::new();
        if kind == CMD_READ && error == 0 {
            data = vec![0; length as usize];
            self.s.read_exact(&mut data).unwrap();
        }
        (error, data)
    }

    fn read(&mut self, offset: u64, len: u32) -> (u32, Vec<u8>) {
        self.cmd(CMD_READ, 0, offset, len, &[])
    }
    fn write(&mut self, offset: u64, data: &[u8]) -> u32 {
        self.cmd(CMD_WRITE, 0, offset, data.len() as u32, data).0
    }

    fn disconnect(mut self) {
        let req = Request {
            flags: 0,
            kind: CMD_DISC,
            cookie: 0,
            offset: 0,
            length: 0,
        };
        self.s.write_all(&req.encode()).unwrap();
    }
}

fn mem() -> Arc<MemDevice> {
    Arc::new(MemDevice::new(BS, BLOCKS).unwrap())
}

#[test]
fn unaligned_reads_and_writes_match_a_byte_model() {
    let dev = mem();
    let (mut c, size, flags, server) = Client::connect(Export::new("vol", dev.clone(), false));
    assert_eq!(size, SIZE);
    assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
    assert_eq!(flags & TFLAG_READ_ONLY, 0);
    assert_ne!(flags & TFLAG_SEND_FLUSH, 0);
    let mut model = vec![0u8; SIZE as usize];
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for i in 0..600 {
        let off = rng.random_range(0..SIZE);
        let len = rng.random_range(0..=(SIZE - off).min(3 * BS as u64 + 100)) as usize;
        match rng.random_range(0..10) {
            0..=3 => {
                let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
                let fua = if i % 7 == 0 { CMD_FLAG_FUA } else { 0 };
                assert_eq!(c.cmd(CMD_WRITE, fua, off, len as u32, &data).0, 0);
                model[off as usize..off as usize + len].copy_from_slice(&data);
            }
            4 => {
                assert_eq!(c.cmd(CMD_WRITE_ZEROES, 0, off, len as u32, &[]).0, 0);
                model[off as usize..off as usize + len].fill(0);
            }
            5 => assert_eq!(c.cmd(CMD_FLUSH, 0, 0, 0, &[]).0, 0),
            _ => {
                let (e, d) = c.read(off, len as u32);
                assert_eq!(e, 0);
                assert!(
                    d == model[off as usize..off as usize + len],
                    "read {len} at {off}"
                );
            }
        }
    }
    // The device below holds exactly the model.
    let mut whole = vec![0u8; SIZE as usize];
    dev.read_blocks(0, &mut whole).unwrap();
    assert!(whole == model);
    c.disconnect();
    server.join().unwrap().unwrap();
}

#[test]
fn requests_outside_the_export_get_errors_and_the_connection_goes_on() {
    let (mut c, _, _, server) = Client::connect(Export::new("vol", mem(), false));
    assert_eq!(c.read(SIZE - 10, 20).0, EINVAL);
    assert_eq!(c.read(u64::MAX - 5, 10).0, EINVAL);
    assert_eq!(c.write(SIZE - 1, &[1, 2]), ENOSPC);
    assert_eq!(c.cmd(CMD_WRITE_ZEROES, 0, SIZE, 1, &[]).0, ENOSPC);
    assert_eq!(c.cmd(CMD_TRIM, 0, SIZE, 1, &[]).0, EINVAL);
    assert_eq!(c.read(0, MAX_PAYLOAD + 1).0, EOVERFLOW);
    assert_eq!(c.cmd(99, 0, 0, 0, &[]).0, EINVAL, "an unknown command");
    // Nothing was written by the refused requests, and the connection still works.
    assert_eq!(c.write(100, b"still here"), 0);
    assert_eq!(c.read(100, 10).1, b"still here");
    assert_eq!(c.read(SIZE - 1, 1).1, [0]);
    assert_eq!(c.cmd(CMD_TRIM, 0, 0, 4096, &[]).0, 0);
    assert_eq!(c.read(100, 10).1, b"still here", "trim is advisory");
    c.disconnect();
    server.join().unwrap().unwrap();
}

#[test]
fn a_read_only_export_refuses_writes_and_keeps_its_data() {
    let dev = mem();
    dev.write(0, &[7u8; BS], WriteClass::Data).unwrap();
    let (mut c, _, flags, server) = Client::connect(Export::new("vol", dev.clone(), true));
    assert_ne!(flags & TFLAG_READ_ONLY, 0);
    assert_eq!(c.write(0, b"x"), EPERM);
    assert_eq!(c.cmd(CMD_WRITE_ZEROES, 0, 0, 10, &[]).0, EPERM);
    assert_eq!(c.cmd(CMD_TRIM, 0, 0, 10, &[]).0, EPERM);
    assert_eq!(c.read(0, 4).1, [7, 7, 7, 7]);
    assert_eq!(c.cmd(CMD_FLUSH, 0, 0, 0, &[]).0, 0);
    c.disconnect();
    server.join().unwrap().unwrap();
}

#[test]
fn options_unknown_export_list_and_the_old_export_name() {
    let (mut s, server) = start(Export::new("vol", mem(), false));
    greet(&mut s, CLIENT_FIXED_NEWSTYLE); // zeroes wanted after EXPORT_NAME
    assert_eq!(go(&mut s, "nope"), Err(REP_ERR_UNKNOWN));
    send_option(&mut s, OPT_LIST, &[]);
    let (kind, d) = option_reply(&mut s, OPT_LIST);
    assert_eq!(kind, REP_SERVER);
    assert_eq!(&d[4..], b"vol");
    assert_eq!(option_reply(&mut s, OPT_LIST).0, REP_ACK);
    send_option(&mut s, 42, b"whatever");
    assert_eq!(option_reply(&mut s, 42).0, REP_ERR_UNSUP);
    send_option(&mut s, OPT_INFO, &[0, 0, 0, 9, b'v']); // name longer than the data
    assert_eq!(option_reply(&mut s, OPT_INFO).0, REP_ERR_INVALID);
    send_option(&mut s, OPT_INFO, &info_data("", &[]));
    assert_eq!(option_reply(&mut s, OPT_INFO).0, REP_INFO);
    assert_eq!(option_reply(&mut s, OPT_INFO).0, REP_INFO);
    assert_eq!(option_reply(&mut s, OPT_INFO).0, REP_ACK);
    send_option(&mut s, OPT_EXPORT_NAME, b"vol");
    assert_eq!(u64_(&mut s), SIZE);
    let flags = u16_(&mut s);
    assert_ne!(flags & TFLAG_HAS_FLAGS, 0);
    let mut zeroes = [1u8; 124];
    s.read_exact(&mut zeroes).unwrap();
    assert_eq!(zeroes, [0u8; 124]);
    let mut c = Client { s, cookie: 0 };
    assert_eq!(c.write(5, b"abc"), 0);
    assert_eq!(c.read(4, 5).1, [0, b'a', b'b', b'c', 0]);
    c.disconnect();
    server.join().unwrap().unwrap();
}

#[test]
fn abort_ends_the_handshake_cleanly() {
    let (mut s, server) = start(Export::new("vol", mem(), false));
    greet(&mut s, CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES);
    send_option(&mut s, OPT_ABORT, &[]);
    assert_eq!(option_reply(&mut s, OPT_ABORT).0, REP_ACK);
    server.join().unwrap().unwrap();
}

/// Sends `bytes` after the greeting and returns what the server made of them.
fn after_greeting(client_flags: u32, bytes: &[u8], close: bool) -> Result<(), NbdError> {
    let (mut s, server) = start(Export::new("vol", mem(), false));
    greet(&mut s, client_flags);
    s.write_all(bytes).unwrap();
    if close {
        s.shutdown(std::net::Shutdown::Write).unwrap();
    }
    let r = server.join().expect("the server thread does not panic");
    drop(s);
    r
}

#[test]
fn frames_that_break_the_protocol_end_the_connection_with_an_error() {
    let flags = CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES;
    // Unknown client flags.
    assert!(matches!(
        after_greeting(1 << 9, &[], true),
        Err(NbdError::Protocol(_))
    ));
    // An option without IHAVEOPT.
    assert!(matches!(
        after_greeting(flags, &[0u8; 16], true),
        Err(NbdError::Protocol(_))
    ));
    // An option claiming a gigabyte of data.
    let mut big = OPT_MAGIC.to_be_bytes().to_vec();
    big.extend_from_slice(&OPT_GO.to_be_bytes());
    big.extend_from_slice(&(1u32 << 30).to_be_bytes());
    assert!(matches!(
        after_greeting(flags, &big, true),
        Err(NbdError::Protocol(_))
    ));
    // A truncated option: the client hung up mid-frame.
    assert!(matches!(
        after_greeting(flags, &OPT_MAGIC.to_be_bytes()[..5], true),
        Err(NbdError::Io(_))
    ));
    // EXPORT_NAME of an export that is not there: closing is the only answer.
    let mut opt = OPT_MAGIC.to_be_bytes().to_vec();
    opt.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    opt.extend_from_slice(&4u32.to_be_bytes());
    opt.extend_from_slice(b"nope");
    assert!(matches!(
        after_greeting(flags, &opt, true),
        Err(NbdError::Protocol(_))
    ));

    // In transmission: a request with a wrong magic, a write too large to take, and a
    // write whose payload never comes.
    let (mut c, _, _, server) = Client::connect(Export::new("vol", mem(), false));
    c.s.write_all(&[0xAB; Request::LEN]).unwrap();
    assert!(matches!(server.join().unwrap(), Err(NbdError::Protocol(_))));
    let (mut c, _, _, server) = Client::connect(Export::new("vol", mem(), false));
    let req = Request {
        flags: 0,
        kind: CMD_WRITE,
        cookie: 1,
        offset: 0,
        length: MAX_PAYLOAD + 1,
    };
    c.s.write_all(&req.encode()).unwrap();
    assert!(matches!(server.join().unwrap(), Err(NbdError::Protocol(_))));
    let (mut c, _, _, server) = Client::connect(Export::new("vol", mem(), false));
    let req = Request {
        flags: 0,
        kind: CMD_WRITE,
        cookie: 1,
        offset: 0,
        length: 4096,
    };
    c.s.write_all(&req.encode()).unwrap();
    c.s.write_all(&[1; 100]).unwrap();
    c.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(matches!(server.join().unwrap(), Err(NbdError::Io(_))));
    // A client that hangs up between requests is merely gone.
    let (c, _, _, server) = Client::connect(Export::new("vol", mem(), false));
    c.s.shutdown(std::net::Shutdown::Write).unwrap();
    assert!(server.join().unwrap().is_ok());
}

/// A device whose reads and flushes fail on demand, as a replicated volume without a
/// quorum does.
struct Flaky {
    inner: MemDevice,
    down: AtomicBool,
}

impl Flaky {
    fn check(&self) -> quilt_block::Result<()> {
        if self.down.load(Ordering::SeqCst) {
            return Err(quilt_block::BlockError::Unavailable {
                what: "the test volume".into(),
                why: "switched off".into(),
            });
        }
        Ok(())
    }
}

impl BlockDevice for Flaky {
    fn block_size(&self) -> usize {
        self.inner.block_size()
    }
    fn block_count(&self) -> u64 {
        self.inner.block_count()
    }
    fn read(&self, block: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.check()?;
        self.inner.read(block, buf)
    }
    fn read_blocks(&self, first: u64, buf: &mut [u8]) -> quilt_block::Result<()> {
        self.check()?;
        self.inner.read_blocks(first, buf)
    }
    fn write(&self, block: u64, buf: &[u8], class: WriteClass) -> quilt_block::Result<()> {
        self.check()?;
        self.inner.write(block, buf, class)
    }
    fn write_blocks(&self, first: u64, buf: &[u8], class: WriteClass) -> quilt_block::Result<()> {
        self.check()?;
        self.inner.write_blocks(first, buf, class)
    }
    fn flush(&self) -> quilt_block::Result<()> {
        self.check()?;
        self.inner.flush()
    }
    fn stats(&self) -> IoStats {
        IoStats::default()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities::default()
    }
}

#[test]
fn device_failures_become_errno_replies_and_change_nothing() {
    let dev = Arc::new(Flaky {
        inner: MemDevice::new(BS, BLOCKS).unwrap(),
        down: AtomicBool::new(false),
    });
    let (mut c, _, _, server) = Client::connect(Export::new("vol", dev.clone(), false));
    assert_eq!(c.write(10, b"before"), 0);
    dev.down.store(true, Ordering::SeqCst);
    assert_eq!(c.read(10, 6).0, EIO);
    assert_eq!(c.write(10, b"during"), EIO);
    assert_eq!(c.write(0, &[3u8; BS]), EIO);
    assert_eq!(c.cmd(CMD_FLUSH, 0, 0, 0, &[]).0, EIO);
    dev.down.store(false, Ordering::SeqCst);
    assert_eq!(c.read(10, 6).1, b"before");
    assert_eq!(c.read(0, 4).1, [0, 0, 0, 0]);
    c.disconnect();
    server.join().unwrap().unwrap();
}
