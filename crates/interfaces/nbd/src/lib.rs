//! An NBD server that exports one [`BlockDevice`]: a replicated volume (Gnothi) or an
//! image, to the standard network block clients (qemu and qemu-img, libnbd's nbdcopy
//! and nbdinfo, nbd-client, fio's nbd engine).
//!
//! It speaks the fixed newstyle handshake (options `EXPORT_NAME`, `LIST`, `INFO`, `GO`,
//! `ABORT`; others are refused as unsupported) and simple replies; commands `READ`,
//! `WRITE` (with `FUA`), `FLUSH`, `WRITE_ZEROES`, `TRIM` (advisory: a no-op), `CACHE` and
//! `DISC`. Requests are served in order, one connection per thread. Offsets and lengths
//! need not be block-aligned: a partial block is read, patched and written back under a
//! lock that every connection to the export shares.
//!
//! Nothing a client sends can take the server down: a malformed frame ends that
//! connection with an error in the log; a request outside the export, on a read-only
//! export or one the device fails gets the protocol's errno in its reply.

#![forbid(unsafe_code)]
#![cfg_attr(not(test), deny(clippy::unwrap_used))]

pub mod proto;

use proto::*;
use quilt_block::{BlockDevice, BlockError, ByteView};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// How many clients may be connected at once; more are turned away at accept.
pub const MAX_CONNECTIONS: usize = 64;

#[derive(Debug, thiserror::Error)]
pub enum NbdError {
    #[error("connection: {0}")]
    Io(#[from] io::Error),
    #[error("the client broke the protocol: {0}")]
    Protocol(String),
}

/// One device offered under one name.
pub struct Export {
    name: String,
    /// Shared by every connection, so partial-block patches are serialised across them.
    bytes: ByteView,
    read_only: bool,
}

impl Export {
    pub fn new(name: impl Into<String>, dev: Arc<dyn BlockDevice>, read_only: bool) -> Export {
        Export {
            name: name.into(),
            bytes: ByteView::new(dev),
            read_only,
        }
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    /// The export's size in bytes.
    pub fn size(&self) -> u64 {
        self.bytes.size()
    }

    fn transmission_flags(&self) -> u16 {
        let mut f = TFLAG_HAS_FLAGS | TFLAG_SEND_FLUSH | TFLAG_SEND_FUA;
        if self.read_only {
            f |= TFLAG_READ_ONLY;
        } else {
            f |= TFLAG_SEND_WRITE_ZEROES | TFLAG_SEND_TRIM;
        }
        f
    }

    /// The client names the export; the empty name is the default, which is this one.
    fn answers_to(&self, name: &[u8]) -> bool {
        name.is_empty() || name == self.name.as_bytes()
    }
}

/// A listening server for one export.
pub struct Server {
    listener: TcpListener,
    export: Arc<Export>,
}

impl Server {
    pub fn bind(addr: impl ToSocketAddrs, export: Export) -> io::Result<Server> {
        Ok(Server {
            listener: TcpListener::bind(addr)?,
            export: Arc::new(export),
        })
    }

    pub fn local_addr(&self) -> io::Result<std::net::SocketAddr> {
        self.listener.local_addr()
    }

    /// Accepts clients until the listener fails; each is served on its own thread.
    pub fn serve(self) -> io::Result<()> {
        let live = Arc::new(AtomicUsize::new(0));
        for conn in self.listener.incoming() {
            let stream = match conn {
                Ok(s) => s,
                // A client that went away between connect and accept, or a transient
                // shortage of descriptors: the listener itself is fine.
                Err(e) => {
                    tracing::warn!("nbd: accept failed: {e}");
                    std::thread::sleep(std::time::Duration::from_millis(50));
                    continue;
                }
            };
            if live.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                live.fetch_sub(1, Ordering::SeqCst);
                tracing::warn!("nbd: {MAX_CONNECTIONS} clients already connected; one turned away");
                continue;
            }
            let export = self.export.clone();
            let live = live.clone();
            std::thread::spawn(move || {
                let peer = stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "a client".into());
                match serve_tcp(stream, &export) {
                    Ok(()) => tracing::info!("nbd: {peer} disconnected"),
                    Err(e) => tracing::warn!("nbd: {peer}: {e}"),
                }
                live.fetch_sub(1, Ordering::SeqCst);
            });
        }
        Ok(())
    }
}

fn serve_tcp(stream: TcpStream, export: &Export) -> Result<(), NbdError> {
    // Replies are small and each is awaited: Nagle's delay would add to every request.
    stream.set_nodelay(true)?;
    let reader = BufReader::with_capacity(1 << 20, stream.try_clone()?);
    let writer = BufWriter::with_capacity(1 << 20, stream);
    serve_connection(reader, writer, export)
}

/// Serves one client from handshake to disconnect. `Ok` when the client said goodbye
/// (or hung up between requests), an error when it broke the protocol or the
/// connection failed.
pub fn serve_connection(
    mut r: impl Read,
    mut w: impl Write,
    export: &Export,
) -> Result<(), NbdError> {
    if handshake(&mut r, &mut w, export)? {
        transmission(&mut r, &mut w, export)?;
    }
    Ok(())
}

fn read_u32(r: &mut impl Read) -> io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_be_bytes(b))
}
fn read_u64(r: &mut impl Read) -> io::Result<u64> {
    let mut b = [0u8; 8];
    r.read_exact(&mut b)?;
    Ok(u64::from_be_bytes(b))
}

/// The handshake and option haggling. `true` when the client chose the export and
/// transmission begins; `false` when it aborted.
fn handshake(r: &mut impl Read, w: &mut impl Write, export: &Export) -> Result<bool, NbdError> {
    w.write_all(&INIT_MAGIC.to_be_bytes())?;
    w.write_all(&OPT_MAGIC.to_be_bytes())?;
    w.write_all(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes())?;
    w.flush()?;
    let client = read_u32(r)?;
    if client & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        return Err(NbdError::Protocol(format!(
            "unknown client flags {client:#x}"
        )));
    }
    let no_zeroes = client & CLIENT_NO_ZEROES != 0;
    loop {
        let magic = read_u64(r)?;
        if magic != OPT_MAGIC {
            return Err(NbdError::Protocol(format!(
                "option magic {magic:#x}, not IHAVEOPT"
            )));
        }
        let option = read_u32(r)?;
        let len = read_u32(r)?;
        if len > MAX_OPTION {
            return Err(NbdError::Protocol(format!(
                "option {option} of {len} bytes (at most {MAX_OPTION})"
            )));
        }
        let mut data = vec![0u8; len as usize];
        r.read_exact(&mut data)?;
        match option {
            OPT_EXPORT_NAME => {
                if !export.answers_to(&data) {
                    // This option has no error reply: closing is the answer.
                    return Err(NbdError::Protocol(format!(
                        "no export named {:?}",
                        String::from_utf8_lossy(&data)
                    )));
                }
                w.write_all(&export.size().to_be_bytes())?;
                w.write_all(&export.transmission_flags().to_be_bytes())?;
                if !no_zeroes {
                    w.write_all(&[0u8; 124])?;
                }
                w.flush()?;
                return Ok(true);
            }
            OPT_ABORT => {
                // The client may already have closed; the ack is a courtesy.
                let _ = w
                    .write_all(&option_reply(option, REP_ACK, &[]))
                    .and_then(|()| w.flush());
                return Ok(false);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    w.write_all(&option_reply(option, REP_ERR_INVALID, &[]))?;
                } else {
                    let mut d = (export.name.len() as u32).to_be_bytes().to_vec();
                    d.extend_from_slice(export.name.as_bytes());
                    w.write_all(&option_reply(option, REP_SERVER, &d))?;
                    w.write_all(&option_reply(option, REP_ACK, &[]))?;
                }
            }
            OPT_INFO | OPT_GO => match parse_info(&data) {
                None => w.write_all(&option_reply(option, REP_ERR_INVALID, &[]))?,
                Some((name, _)) if !export.answers_to(name) => {
                    let msg = format!("no export named {:?}", String::from_utf8_lossy(name));
                    w.write_all(&option_reply(option, REP_ERR_UNKNOWN, msg.as_bytes()))?
                }
                Some((_, wanted)) => {
                    let mut info = INFO_EXPORT.to_be_bytes().to_vec();
                    info.extend_from_slice(&export.size().to_be_bytes());
                    info.extend_from_slice(&export.transmission_flags().to_be_bytes());
                    w.write_all(&option_reply(option, REP_INFO, &info))?;
                    if wanted.contains(&INFO_NAME) {
                        let mut info = INFO_NAME.to_be_bytes().to_vec();
                        info.extend_from_slice(export.name.as_bytes());
                        w.write_all(&option_reply(option, REP_INFO, &info))?;
                    }
                    // Any alignment works (partial blocks are patched); whole blocks
                    // are cheaper.
                    let mut info = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
                    info.extend_from_slice(&1u32.to_be_bytes());
                    info.extend_from_slice(
                        &(export.bytes.device().block_size() as u32).to_be_bytes(),
                    );
                    info.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
                    w.write_all(&option_reply(option, REP_INFO, &info))?;
                    w.write_all(&option_reply(option, REP_ACK, &[]))?;
                    if option == OPT_GO {
                        w.flush()?;
                        return Ok(true);
                    }
                }
            },
            _ => w.write_all(&option_reply(option, REP_ERR_UNSUP, &[]))?,
        }
        w.flush()?;
    }
}

/// `INFO`/`GO` data: the export name and the information types asked for.
fn parse_info(d: &[u8]) -> Option<(&[u8], Vec<u16>)> {
    let n = u32::from_be_bytes(d.get(0..4)?.try_into().ok()?) as usize;
    let name = d.get(4..4usize.checked_add(n)?)?;
    let rest = &d[4 + n..];
    let count = u16::from_be_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
    let items = rest.get(2..)?;
    if items.len() != count * 2 {
        return None;
    }
    let wanted = items
        .chunks_exact(2)
        .map(|c| u16::from_be_bytes([c[0], c[1]]))
        .collect();
    Some((name, wanted))
}

/// The protocol's errno for a device failure.
fn errno(e: &BlockError) -> u32 {
    match e {
        BlockError::NoSpace { .. } | BlockError::LogFull { .. } => ENOSPC,
        BlockError::OutOfRange { .. } => EINVAL,
        BlockError::Unsupported(_) => ENOTSUP,
        // The protocol's errnos are Linux's, so the host's ENOSPC is the same number.
        BlockError::Io { source, .. } if source.raw_os_error() == Some(ENOSPC as i32) => ENOSPC,
        _ => EIO,
    }
}

fn transmission(r: &mut impl Read, w: &mut impl Write, export: &Export) -> Result<(), NbdError> {
    let size = export.size();
    let mut buf = Vec::new();
    loop {
        let mut head = [0u8; Request::LEN];
        match r.read_exact(&mut head) {
            Ok(()) => {}
            // Hanging up between requests without DISC is rude but not an error.
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) => return Err(e.into()),
        }
        let req = Request::decode(&head)
            .ok_or_else(|| NbdError::Protocol("request magic is wrong".into()))?;
        let len = req.length as u64;
        let inside = req.offset.checked_add(len).is_some_and(|end| end <= size);
        let error = match req.kind {
            CMD_READ => {
                if req.length > MAX_PAYLOAD {
                    EOVERFLOW
                } else if !inside {
                    EINVAL
                } else {
                    buf.resize(req.length as usize, 0);
                    match export.bytes.read_at(req.offset, &mut buf) {
                        Ok(()) => {
                            w.write_all(&simple_reply(0, req.cookie))?;
                            w.write_all(&buf)?;
                            w.flush()?;
                            continue;
                        }
                        Err(e) => {
                            tracing::warn!("nbd: read of {len} bytes at {}: {e}", req.offset);
                            errno(&e)
                        }
                    }
                }
            }
            CMD_WRITE => {
                if req.length > MAX_PAYLOAD {
                    // Its payload cannot be skipped safely; the connection ends.
                    return Err(NbdError::Protocol(format!(
                        "a write of {len} bytes (at most {MAX_PAYLOAD})"
                    )));
                }
                buf.resize(req.length as usize, 0);
                r.read_exact(&mut buf)?;
                write_errno(export, &req, inside, "write", |b| {
                    b.write_at(req.offset, &buf)
                })
            }
            CMD_WRITE_ZEROES => write_errno(export, &req, inside, "write zeroes", |b| {
                b.write_zeroes_at(req.offset, len)
            }),
            CMD_FLUSH => result_errno(export.bytes.flush(), "flush"),
            CMD_TRIM => {
                if export.read_only {
                    EPERM
                } else if !inside {
                    EINVAL
                } else {
                    0 // advisory; the blocks keep what they hold
                }
            }
            CMD_CACHE => {
                if inside {
                    0
                } else {
                    EINVAL
                }
            }
            CMD_DISC => {
                // A client that leaves without flushing still finds its writes durable
                // when the next one connects.
                if let Err(e) = export.bytes.flush() {
                    tracing::warn!("nbd: flush at disconnect: {e}");
                }
                return Ok(());
            }
            _ => EINVAL,
        };
        w.write_all(&simple_reply(error, req.cookie))?;
        w.flush()?;
    }
}

/// A command that writes: refused on a read-only export or outside it, else done (and
/// flushed when the client asked for FUA), its outcome as an errno.
fn write_errno(
    export: &Export,
    req: &Request,
    inside: bool,
    what: &str,
    write: impl FnOnce(&ByteView) -> quilt_block::Result<()>,
) -> u32 {
    if export.read_only {
        return EPERM;
    }
    if !inside {
        return ENOSPC;
    }
    let fua = req.flags & CMD_FLAG_FUA != 0;
    result_errno(
        write(&export.bytes).and_then(|()| if fua { export.bytes.flush() } else { Ok(()) }),
        what,
    )
}

fn result_errno(r: quilt_block::Result<()>, what: &str) -> u32 {
    match r {
        Ok(()) => 0,
        Err(e) => {
            tracing::warn!("nbd: {what}: {e}");
            errno(&e)
        }
    }
}
