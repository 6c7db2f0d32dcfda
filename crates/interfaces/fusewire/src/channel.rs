//! The /dev/fuse connection: reading requests, writing replies and notifications, and one
//! cloned descriptor per worker thread (each has its own processing queue in the kernel,
//! so its replies go back through the descriptor that read the request).

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

/// `FUSE_DEV_IOC_CLONE`: `_IOR(229, 0, uint32_t)`.
const FUSE_DEV_IOC_CLONE: libc::c_ulong = 0x8004_e500;

/// One descriptor of a FUSE connection.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
}

/// What a read from the channel gave.
#[derive(Debug)]
pub enum Received {
    /// A request of this many bytes is at the start of the buffer.
    Request(usize),
    /// The connection is gone (unmounted or aborted).
    Closed,
}

impl Channel {
    pub fn from_fd(fd: OwnedFd) -> Channel {
        Channel { fd }
    }

    /// Opens /dev/fuse (not yet mounted).
    pub fn open() -> io::Result<Channel> {
        // SAFETY: open on a NUL-terminated literal; the result is checked.
        let fd = unsafe { libc::open(c"/dev/fuse".as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: fd is a fresh descriptor we own.
        Ok(Channel {
            fd: unsafe { OwnedFd::from_raw_fd(fd) },
        })
    }

    /// A new descriptor on the same connection, for another worker thread.
    pub fn clone_channel(&self) -> io::Result<Channel> {
        let new = Channel::open()?;
        let master: u32 = self.fd.as_raw_fd() as u32;
        // SAFETY: the ioctl reads one u32 (the descriptor to clone) from the pointer.
        let r = unsafe { libc::ioctl(new.fd.as_raw_fd(), FUSE_DEV_IOC_CLONE, &master) };
        if r != 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(new)
    }

    pub fn raw(&self) -> RawFd {
        self.fd.as_raw_fd()
    }

    /// Reads one request into `buf` (which must hold the largest request negotiated).
    pub fn receive(&self, buf: &mut [u8]) -> io::Result<Received> {
        loop {
            // SAFETY: reads at most buf.len() bytes into buf.
            let n = unsafe { libc::read(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(Received::Request(n as usize));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                // Interrupted, or the request was answered/aborted before we read it.
                Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::ENOENT) => continue,
                // Unmounted (ENODEV), or the connection aborted on the way out
                // (ECONNABORTED, seen once at umount under load): the session is over.
                Some(libc::ENODEV) | Some(libc::ECONNABORTED) => return Ok(Received::Closed),
                _ => return Err(e),
            }
        }
    }

    /// Makes reads return at once when nothing is pending ([`Channel::try_receive`]).
    pub fn set_nonblocking(&self) -> io::Result<()> {
        // SAFETY: fcntl on a descriptor we own.
        let flags = unsafe { libc::fcntl(self.raw(), libc::F_GETFL) };
        if flags < 0
            || unsafe { libc::fcntl(self.raw(), libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0
        {
            return Err(io::Error::last_os_error());
        }
        Ok(())
    }

    /// Reads one request if one is pending (a non-blocking channel); None if none is.
    pub fn try_receive(&self, buf: &mut [u8]) -> io::Result<Option<Received>> {
        loop {
            // SAFETY: reads at most buf.len() bytes into buf.
            let n = unsafe { libc::read(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
            if n >= 0 {
                return Ok(Some(Received::Request(n as usize)));
            }
            let e = io::Error::last_os_error();
            match e.raw_os_error() {
                Some(libc::EAGAIN) => return Ok(None),
                Some(libc::EINTR) | Some(libc::ENOENT) => continue,
                Some(libc::ENODEV) | Some(libc::ECONNABORTED) => return Ok(Some(Received::Closed)),
                _ => return Err(e),
            }
        }
    }

    /// Writes one message (header and body parts) in a single write.
    pub fn send(&self, parts: &[&[u8]]) -> io::Result<()> {
        let iov: Vec<libc::iovec> = parts
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        // SAFETY: every iovec points into a live slice for the duration of the call.
        let n = unsafe { libc::writev(self.raw(), iov.as_ptr(), iov.len() as libc::c_int) };
        if n < 0 {
            let e = io::Error::last_os_error();
            // The request was interrupted and the kernel no longer waits for it.
            if e.raw_os_error() == Some(libc::ENOENT) {
                return Ok(());
            }
            return Err(e);
        }
        Ok(())
    }
}
