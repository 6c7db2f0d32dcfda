//! A device backed by an image file: pread/pwrite, fdatasync on flush, O_DIRECT optional.

use crate::{
    check_block_size, check_request, check_run, BlockDevice, BlockError, BlockNo, Capabilities,
    GatherWrites, HostRoom, IoCounters, IoStats, PartReads, ReadHints, Reservation, Result,
    WriteClass,
};
use std::fs::{File, OpenOptions};
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// How to open an image file.
#[derive(Debug, Clone)]
pub struct FileDeviceOptions {
    pub block_size: usize,
    /// Bypass the host page cache (O_DIRECT). Buffers are bounced through aligned memory.
    pub direct: bool,
    pub read_only: bool,
    /// Take the image's lock for as long as the device is open: an `flock`, exclusive
    /// to write, shared to read (on a block device, a device the kernel has mounted is
    /// refused too). A second writer gets [`BlockError::Busy`]. The lock dies with the
    /// process, so a killed server leaves none behind.
    pub lock: bool,
}

impl Default for FileDeviceOptions {
    fn default() -> Self {
        FileDeviceOptions {
            block_size: 4096,
            direct: false,
            read_only: false,
            lock: true,
        }
    }
}

/// An image file seen as a block device. The block count is fixed when it is opened
/// (a trailing partial block is not used).
#[derive(Debug)]
pub struct FileDevice {
    file: File,
    path: PathBuf,
    opts: FileDeviceOptions,
    block_count: u64,
    counters: IoCounters,
    /// Chunks of the file ([`RESERVE_CHUNK`] bytes) known to have host storage behind
    /// them; None when there is nothing to reserve (a block device, a read-only open,
    /// or a host file system without fallocate).
    backed: Option<std::sync::Mutex<Vec<u64>>>,
}

/// `pwritev` of `parts` at `offset`, again for what a short write left.
fn write_all_vectored_at(file: &File, parts: &[&[u8]], mut offset: u64) -> std::io::Result<()> {
    const IOV_MAX: usize = 1024;
    let mut parts: Vec<&[u8]> = parts.iter().copied().filter(|p| !p.is_empty()).collect();
    let mut at = 0;
    while at < parts.len() {
        let iov: Vec<libc::iovec> = parts[at..parts.len().min(at + IOV_MAX)]
            .iter()
            .map(|p| libc::iovec {
                iov_base: p.as_ptr() as *mut libc::c_void,
                iov_len: p.len(),
            })
            .collect();
        let off = libc::off_t::try_from(offset)
            .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
        // SAFETY: every iovec points into a live slice of `parts` for the call's duration.
        let n = unsafe { libc::pwritev(file.as_raw_fd(), iov.as_ptr(), iov.len() as i32, off) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        let mut n = n as usize;
        offset += n as u64;
        while n > 0 {
            if n >= parts[at].len() {
                n -= parts[at].len();
                at += 1;
            } else {
                parts[at] = &parts[at][n..];
                n = 0;
            }
        }
    }
    Ok(())
}

/// Host storage is reserved in chunks of this many bytes (one fallocate each).
pub const RESERVE_CHUNK: u64 = 1 << 20;

/// Takes the image lock on `file`'s open file description without waiting: exclusive
/// to write, shared to read. On conflict the error names the processes holding it.
pub fn lock_file(file: &File, path: &Path, exclusive: bool) -> Result<()> {
    let op = if exclusive {
        libc::LOCK_EX
    } else {
        libc::LOCK_SH
    } | libc::LOCK_NB;
    // SAFETY: flock on a descriptor we own.
    if unsafe { libc::flock(file.as_raw_fd(), op) } == 0 {
        return Ok(());
    }
    let source = std::io::Error::last_os_error();
    if source.raw_os_error() == Some(libc::EWOULDBLOCK) {
        return Err(BlockError::Busy {
            path: path.display().to_string(),
            holders: lock_holders(file),
        });
    }
    Err(BlockError::Io {
        what: format!("locking {}", path.display()),
        source,
    })
}

/// A handle on the lock an open image holds, to let go of it before the device is
/// dropped: a server ends its unmount with it, so that the image is free for the next
/// mount or mkfs the moment umount(8) returns, not when the server process exits.
#[derive(Debug)]
pub struct ImageLock(File);

impl ImageLock {
    /// Lets go of the lock. Nothing may write the image through its device afterwards.
    pub fn release(self) {
        // SAFETY: flock on a descriptor we own; the lock belongs to the open file
        // description this one shares with the device's.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

/// The processes holding a `flock` on `file` (from /proc/locks; empty if unknown).
pub fn lock_holders(file: &File) -> Vec<u32> {
    use std::os::unix::fs::MetadataExt;
    let Ok(meta) = file.metadata() else {
        return Vec::new();
    };
    let dev = meta.dev();
    // /proc/locks names a file as MAJOR:MINOR:INODE, the numbers in hex, hex, decimal.
    let want = format!(
        "{:02x}:{:02x}:{}",
        libc::major(dev),
        libc::minor(dev),
        meta.ino()
    );
    let text = std::fs::read_to_string("/proc/locks").unwrap_or_default();
    let mut pids: Vec<u32> = text
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            // "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; a blocked waiter has
            // "->" after the number.
            let f: Vec<&str> = f.into_iter().filter(|x| *x != "->").collect();
            (f.len() >= 6 && f[1] == "FLOCK" && f[5] == want)
                .then(|| f[4].parse().ok())
                .flatten()
        })
        .collect();
    pids.sort_unstable();
    pids.dedup();
    pids
}

/// Memory aligned for O_DIRECT (4096 covers every logical sector size we meet).
struct AlignedBuf {
    ptr: std::ptr::NonNull<u8>,
    layout: std::alloc::Layout,
}

impl AlignedBuf {
    const ALIGN: usize = 4096;
    fn new(len: usize) -> Self {
        let layout = std::alloc::Layout::from_size_align(len, Self::ALIGN)
            .expect("block sizes are validated powers of two");
        // SAFETY: layout has non-zero size (block sizes are at least 512).
        let raw = unsafe { std::alloc::alloc_zeroed(layout) };
        let ptr =
            std::ptr::NonNull::new(raw).unwrap_or_else(|| std::alloc::handle_alloc_error(layout));
        AlignedBuf { ptr, layout }
    }
    fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: ptr points to layout.size() initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.layout.size()) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        // SAFETY: allocated in new() with this layout.
        unsafe { std::alloc::dealloc(self.ptr.as_ptr(), self.layout) }
    }
}

impl FileDevice {
    /// Opens an existing image.
    pub fn open(path: impl AsRef<Path>, opts: FileDeviceOptions) -> Result<Self> {
        check_block_size(opts.block_size)?;
        let path = path.as_ref().to_path_buf();
        let is_bdev = std::fs::metadata(&path)
            .map(|m| std::os::unix::fs::FileTypeExt::is_block_device(&m.file_type()))
            .unwrap_or(false);
        let mut oo = OpenOptions::new();
        oo.read(true).write(!opts.read_only);
        let mut flags = 0;
        if opts.direct {
            flags |= libc::O_DIRECT;
        }
        oo.custom_flags(flags);
        let open_err = |source: std::io::Error| {
            if source.raw_os_error() == Some(libc::EBUSY) {
                BlockError::Busy {
                    path: path.display().to_string(),
                    holders: Vec::new(),
                }
            } else {
                BlockError::Io {
                    what: format!("opening {}", path.display()),
                    source,
                }
            }
        };
        if opts.lock && is_bdev && !opts.read_only {
            // O_EXCL fails while the kernel has the device mounted (or another program
            // claims it). We let go at once: our own block-device FUSE mount claims it
            // next, and the flock below keeps other servers out meanwhile.
            OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_EXCL)
                .open(&path)
                .map_err(open_err)?;
        }
        let file = oo.open(&path).map_err(open_err)?;
        if opts.lock {
            lock_file(&file, &path, !opts.read_only)?;
        }
        Self::from_locked(file, path, opts)
    }

    /// A device over `file`, opened (and locked, if wanted) by the caller: `mkfs` takes
    /// the lock before it looks at what the image holds and before it truncates it.
    pub fn from_locked(file: File, path: PathBuf, opts: FileDeviceOptions) -> Result<Self> {
        check_block_size(opts.block_size)?;
        let size_err = |source| BlockError::Io {
            what: format!("reading the size of {}", path.display()),
            source,
        };
        let meta = file.metadata().map_err(size_err)?;
        // A block device (a loop device, a disk partition) has no length in its
        // metadata: its size is where seeking to the end lands.
        let len = if std::os::unix::fs::FileTypeExt::is_block_device(&meta.file_type()) {
            use std::io::Seek;
            (&file).seek(std::io::SeekFrom::End(0)).map_err(size_err)?
        } else {
            meta.len()
        };
        let is_file = meta.is_file();
        let chunks = len.div_ceil(RESERVE_CHUNK);
        Ok(FileDevice {
            backed: (is_file && !opts.read_only)
                .then(|| std::sync::Mutex::new(vec![0; chunks.div_ceil(64) as usize])),
            file,
            block_count: len / opts.block_size as u64,
            path,
            opts,
            counters: IoCounters::default(),
        })
    }

    /// Creates (or truncates) an image of `block_count` zero blocks and opens it.
    pub fn create(
        path: impl AsRef<Path>,
        block_count: u64,
        opts: FileDeviceOptions,
    ) -> Result<Self> {
        check_block_size(opts.block_size)?;
        let path = path.as_ref();
        let io = |source| BlockError::Io {
            what: format!("creating {}", path.display()),
            source,
        };
        let bytes = block_count
            .checked_mul(opts.block_size as u64)
            .ok_or(BlockError::Unsupported("an image this large"))?;
        let f = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path)
            .map_err(io)?;
        // Locked before it is emptied: an image in use is refused, not destroyed.
        if opts.lock {
            lock_file(&f, path, true)?;
        }
        f.set_len(0).map_err(io)?;
        f.set_len(bytes).map_err(io)?;
        Self::from_locked(f, path.to_path_buf(), opts)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A handle on this device's image lock (None if it was opened without one).
    pub fn image_lock(&self) -> Option<ImageLock> {
        if !self.opts.lock {
            return None;
        }
        self.file.try_clone().ok().map(ImageLock)
    }

    fn fallocate(&self, off: u64, len: u64) -> std::io::Result<()> {
        // SAFETY: fallocate on our descriptor; mode 0 allocates without changing size.
        let r = unsafe { libc::fallocate(self.file.as_raw_fd(), 0, off as i64, len as i64) };
        if r == 0 {
            Ok(())
        } else {
            Err(std::io::Error::last_os_error())
        }
    }

    fn io_err(&self, what: &str, block: BlockNo, source: std::io::Error) -> BlockError {
        BlockError::Io {
            what: format!("{what} block {block} of {}", self.path.display()),
            source,
        }
    }

    fn read_into(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        self.read_into_at(block, 0, buf)
    }

    /// Reads `buf` from `skip` bytes into `block` on (errors name `block`).
    fn read_into_at(&self, block: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
        let offset = block * self.opts.block_size as u64 + skip as u64;
        let mut done = 0;
        while done < buf.len() {
            match self.file.read_at(&mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    return Err(BlockError::ShortRead {
                        block,
                        got: done,
                        want: buf.len(),
                    })
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(self.io_err("reading", block, e)),
            }
        }
        Ok(())
    }
}

impl BlockDevice for FileDevice {
    fn block_size(&self) -> usize {
        self.opts.block_size
    }
    fn block_count(&self) -> u64 {
        self.block_count
    }
    fn read(&self, block: BlockNo, buf: &mut [u8]) -> Result<()> {
        check_request(self, block, buf.len())?;
        if self.opts.direct {
            let mut bounce = AlignedBuf::new(buf.len());
            self.read_into(block, bounce.as_mut_slice())?;
            buf.copy_from_slice(bounce.as_mut_slice());
        } else {
            self.read_into(block, buf)?;
        }
        self.counters.read(buf.len());
        Ok(())
    }
    fn read_blocks(&self, first: BlockNo, buf: &mut [u8]) -> Result<()> {
        check_run(self, first, buf.len())?;
        if self.opts.direct {
            let mut bounce = AlignedBuf::new(buf.len());
            self.read_into(first, bounce.as_mut_slice())?;
            buf.copy_from_slice(bounce.as_mut_slice());
        } else {
            self.read_into(first, buf)?;
        }
        self.counters.read(buf.len());
        Ok(())
    }

    fn write(&self, block: BlockNo, buf: &[u8], _class: WriteClass) -> Result<()> {
        check_request(self, block, buf.len())?;
        if self.opts.read_only {
            return Err(BlockError::Unsupported("writes on a read-only image"));
        }
        let offset = block * self.opts.block_size as u64;
        let res = if self.opts.direct {
            let mut bounce = AlignedBuf::new(buf.len());
            bounce.as_mut_slice().copy_from_slice(buf);
            self.file.write_all_at(bounce.as_mut_slice(), offset)
        } else {
            self.file.write_all_at(buf, offset)
        };
        res.map_err(|e| self.io_err("writing", block, e))?;
        self.counters.write(buf.len());
        Ok(())
    }
    fn write_blocks(&self, first: BlockNo, buf: &[u8], _class: WriteClass) -> Result<()> {
        let bs = self.opts.block_size;
        // The whole run in one pwrite.
        check_run(self, first, buf.len())?;
        if self.opts.read_only {
            return Err(BlockError::Unsupported("writes on a read-only image"));
        }
        let offset = first * bs as u64;
        let res = if self.opts.direct {
            let mut bounce = AlignedBuf::new(buf.len());
            bounce.as_mut_slice().copy_from_slice(buf);
            self.file.write_all_at(bounce.as_mut_slice(), offset)
        } else {
            self.file.write_all_at(buf, offset)
        };
        res.map_err(|e| self.io_err("writing", first, e))?;
        self.counters.write(buf.len());
        Ok(())
    }
    fn flush(&self) -> Result<()> {
        if self.opts.read_only {
            return Ok(());
        }
        self.file.sync_data().map_err(|source| BlockError::Io {
            what: format!("fdatasync of {}", self.path.display()),
            source,
        })?;
        self.counters.flush();
        Ok(())
    }
    fn stats(&self) -> IoStats {
        self.counters.snapshot()
    }
    fn capabilities(&self) -> Capabilities<'_> {
        Capabilities {
            gather: Some(self),
            part_reads: Some(self),
            hints: Some(self),
            reservation: Some(self),
            ..Capabilities::default()
        }
    }
}

impl GatherWrites for FileDevice {
    /// One `pwritev` per at most `IOV_MAX` parts: the epoch's run of node blocks goes
    /// down without being copied into one buffer first (that copy and its reallocations
    /// were a sixth of a Bε-tree checkpoint thread's time).
    fn write_blocks_gather(
        &self,
        first: BlockNo,
        parts: &[&[u8]],
        class: WriteClass,
    ) -> Result<()> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        check_run(self, first, len)?;
        if self.opts.read_only {
            return Err(BlockError::Unsupported("writes on a read-only image"));
        }
        if self.opts.direct || parts.iter().any(|p| p.len() % self.opts.block_size != 0) {
            return self.write_blocks(first, &parts.concat(), class);
        }
        let offset = first * self.opts.block_size as u64;
        write_all_vectored_at(&self.file, parts, offset)
            .map_err(|e| self.io_err("writing", first, e))?;
        self.counters.write(len);
        Ok(())
    }
}

impl PartReads for FileDevice {
    fn read_part(&self, first: BlockNo, skip: usize, buf: &mut [u8]) -> Result<()> {
        if buf.is_empty() {
            return Ok(());
        }
        let bs = self.opts.block_size;
        check_run(self, first, (skip + buf.len()).div_ceil(bs) * bs)?;
        if self.opts.direct {
            let mut whole = AlignedBuf::new((skip + buf.len()).div_ceil(bs) * bs);
            self.read_into(first, whole.as_mut_slice())?;
            buf.copy_from_slice(&whole.as_mut_slice()[skip..skip + buf.len()]);
        } else {
            self.read_into_at(first, skip, buf)?;
        }
        self.counters.read(buf.len());
        Ok(())
    }
}

impl ReadHints for FileDevice {
    fn will_need(&self, first: BlockNo, count: u64) {
        // Through the page cache only: O_DIRECT reads would not find what it reads.
        if self.opts.direct || count == 0 || first >= self.block_count {
            return;
        }
        let bs = self.opts.block_size as u64;
        let count = count.min(self.block_count - first);
        // SAFETY: a valid descriptor; the call only starts reads into the page cache.
        unsafe {
            libc::posix_fadvise(
                self.file.as_raw_fd(),
                (first * bs) as libc::off_t,
                (count * bs) as libc::off_t,
                libc::POSIX_FADV_WILLNEED,
            );
        }
    }
}

impl Reservation for FileDevice {
    fn reserve(&self, first: BlockNo, count: u64) -> Result<()> {
        let Some(backed) = &self.backed else {
            return Ok(());
        };
        if count == 0 {
            return Ok(());
        }
        if first.saturating_add(count) > self.block_count {
            return Err(BlockError::OutOfRange {
                block: first.saturating_add(count - 1),
                count: self.block_count,
            });
        }
        let bs = self.opts.block_size as u64;
        let (start, end) = (first * bs, (first + count) * bs);
        let mut map = backed.lock().unwrap_or_else(|e| e.into_inner());
        let file_len = self.block_count * bs;
        for c in start / RESERVE_CHUNK..end.div_ceil(RESERVE_CHUNK) {
            let (word, bit) = ((c / 64) as usize, c % 64);
            if map.get(word).is_some_and(|w| w & (1 << bit) != 0) {
                continue;
            }
            let off = c * RESERVE_CHUNK;
            let len = RESERVE_CHUNK.min(file_len - off);
            match self.fallocate(off, len) {
                Ok(()) => {
                    if let Some(w) = map.get_mut(word) {
                        *w |= 1 << bit;
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOSPC) => {
                    // Not room for the whole chunk: is there for what is asked?
                    let (a, b) = (start.max(off), end.min(off + len));
                    if self.fallocate(a, b - a).is_err() {
                        return Err(BlockError::NoSpace {
                            path: self.path.display().to_string(),
                            first,
                            end: first + count,
                        });
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => {
                    // The host cannot reserve (tmpfs can; some network file systems
                    // cannot): writes may then fail at write-back, as for any program.
                    tracing::warn!(
                        "{}: the host file system cannot reserve space (fallocate): a full host disk will show as I/O errors at write-back",
                        self.path.display()
                    );
                    map.iter_mut().for_each(|w| *w = u64::MAX);
                    return Ok(());
                }
                Err(source) => {
                    return Err(BlockError::Io {
                        what: format!("reserving blocks {first}.. of {}", self.path.display()),
                        source,
                    })
                }
            }
        }
        Ok(())
    }

    /// The file's holes, from its length and what the host has allocated to it (which
    /// counts space reserved with fallocate, and a little of the host's own metadata:
    /// the margins above this leave room for that).
    fn host_room(&self) -> Option<HostRoom> {
        self.backed.as_ref()?;
        use std::os::unix::fs::MetadataExt;
        let meta = self.file.metadata().ok()?;
        let holes = meta.len().saturating_sub(meta.blocks().saturating_mul(512));
        if holes == 0 {
            return None;
        }
        // SAFETY: fstatvfs fills the struct we pass, for a descriptor we own.
        let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::fstatvfs(self.file.as_raw_fd(), &mut st) } != 0 {
            return None;
        }
        // What an unprivileged writer may take: the host's reserve for root is not
        // counted on, since the server need not run as root.
        Some(HostRoom {
            free: (st.f_bavail as u64).saturating_mul(st.f_frsize as u64),
            unbacked: holes,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::BlockDeviceExt;

    fn roundtrip(direct: bool) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let opts = FileDeviceOptions {
            block_size: 4096,
            direct,
            read_only: false,
            lock: true,
        };
        let dev = FileDevice::create(&path, 16, opts.clone()).unwrap();
        assert_eq!((dev.block_count(), dev.block_size()), (16, 4096));
        let pattern: Vec<u8> = (0..4096).map(|i| (i % 251) as u8).collect();
        dev.write(15, &pattern, WriteClass::Metadata).unwrap();
        dev.flush().unwrap();
        drop(dev);
        // Reopen: the bytes are in the file at the right offset.
        let raw = std::fs::read(&path).unwrap();
        assert_eq!(&raw[15 * 4096..], &pattern[..]);
        let dev = FileDevice::open(&path, opts).unwrap();
        let mut back = vec![0; 4096];
        dev.read(15, &mut back).unwrap();
        assert_eq!(back, pattern);
        let s = dev.stats();
        assert_eq!((s.reads, s.bytes_read), (1, 4096));
    }

    #[test]
    fn buffered_write_flush_reopen_read() {
        roundtrip(false);
    }

    #[test]
    fn direct_io_write_flush_reopen_read() {
        roundtrip(true);
    }

    /// A fresh image of `blocks` blocks of 512 bytes (kept while the directory lives).
    fn device_512(blocks: u64, direct: bool) -> (tempfile::TempDir, FileDevice) {
        let dir = tempfile::tempdir().unwrap();
        let opts = FileDeviceOptions {
            block_size: 512,
            direct,
            read_only: false,
            lock: true,
        };
        let dev = FileDevice::create(dir.path().join("img"), blocks, opts).unwrap();
        (dir, dev)
    }

    /// A gathered write of more parts than one `pwritev` takes lands exactly where the
    /// concatenation would, and refuses runs past the end or of partial blocks.
    #[test]
    fn gathered_write_matches_the_concatenation() {
        for direct in [false, true] {
            let (_dir, dev) = device_512(1200, direct);
            let parts: Vec<Vec<u8>> = (0..1100u32)
                .map(|i| (0..512u32).map(|j| (i * 7 + j) as u8).collect())
                .collect();
            let refs: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            GatherWrites::write_blocks_gather(&dev, 50, &refs, WriteClass::Metadata).unwrap();
            let mut back = vec![0; 1100 * 512];
            dev.read_blocks(50, &mut back).unwrap();
            assert_eq!(back, parts.concat(), "direct={direct}");
            assert_eq!(dev.stats().bytes_written, 1100 * 512);
            assert!(
                GatherWrites::write_blocks_gather(&dev, 150, &refs, WriteClass::Metadata).is_err(),
                "past the end"
            );
            assert!(
                GatherWrites::write_blocks_gather(
                    &dev,
                    0,
                    &[&[1u8; 100][..]],
                    WriteClass::Metadata
                )
                .is_err(),
                "partial block"
            );
        }
    }

    /// A part read returns exactly the bytes of the blocks it spans, in both modes and
    /// from the default implementation, and refuses parts past the end.
    #[test]
    fn part_reads_match_the_blocks() {
        for direct in [false, true] {
            let (_dir, dev) = device_512(8, direct);
            let all: Vec<u8> = (0..8 * 512u32).map(|i| (i * 31 % 253) as u8).collect();
            dev.write_blocks(0, &all, WriteClass::Metadata).unwrap();
            for (first, skip, len) in [
                (0u64, 0usize, 512usize),
                (1, 100, 10),
                (2, 500, 700),
                (3, 0, 2560),
                (5, 511, 1),
                (7, 0, 0),
            ] {
                let mut got = vec![0; len];
                PartReads::read_part(&dev, first, skip, &mut got).unwrap();
                let at = first as usize * 512 + skip;
                assert_eq!(
                    got,
                    all[at..at + len],
                    "direct={direct} {first} {skip} {len}"
                );
                let mut via_default = vec![0; len];
                let whole = crate::MemDevice::new(512, 8).unwrap();
                whole.write_blocks(0, &all, WriteClass::Metadata).unwrap();
                whole.read_part(first, skip, &mut via_default).unwrap();
                assert_eq!(via_default, got);
            }
            let mut past = vec![0; 600];
            assert!(
                PartReads::read_part(&dev, 7, 0, &mut past).is_err(),
                "past the end"
            );
        }
    }

    #[test]
    fn short_image_gives_short_read_not_panic() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let dev = FileDevice::create(
            &path,
            4,
            FileDeviceOptions {
                block_size: 1024,
                ..Default::default()
            },
        )
        .unwrap();
        // Someone truncates the image under us: the read reports how much it got.
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .unwrap()
            .set_len(3 * 1024 + 100)
            .unwrap();
        let mut buf = vec![0; 1024];
        match dev.read(3, &mut buf) {
            Err(BlockError::ShortRead {
                block: 3,
                got: 100,
                want: 1024,
            }) => {}
            other => panic!("expected a short read, got {other:?}"),
        }
        assert!(matches!(
            dev.read(4, &mut buf),
            Err(BlockError::OutOfRange { .. })
        ));
    }

    #[test]
    fn missing_image_and_read_only_writes_are_clear_errors() {
        let dir = tempfile::tempdir().unwrap();
        let err =
            FileDevice::open(dir.path().join("nope"), FileDeviceOptions::default()).unwrap_err();
        assert!(err.to_string().contains("nope"), "{err}");
        let path = dir.path().join("img");
        FileDevice::create(&path, 2, FileDeviceOptions::default()).unwrap();
        let ro = FileDevice::open(
            &path,
            FileDeviceOptions {
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(matches!(
            ro.write(0, &[0; 4096], WriteClass::Metadata),
            Err(BlockError::Unsupported(_))
        ));
    }

    #[test]
    fn one_writer_or_many_readers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let rw = FileDevice::create(&path, 2, FileDeviceOptions::default()).unwrap();
        let ro = FileDeviceOptions {
            read_only: true,
            ..Default::default()
        };
        // A second writer and a reader are refused while a writer holds the image, and
        // the error names the holder (this process).
        for opts in [FileDeviceOptions::default(), ro.clone()] {
            match FileDevice::open(&path, opts) {
                Err(BlockError::Busy { holders, .. }) => {
                    assert_eq!(holders, vec![std::process::id()])
                }
                other => panic!("expected Busy, got {other:?}"),
            }
        }
        // mkfs's path (create) must not truncate an image in use.
        assert!(matches!(
            FileDevice::create(&path, 1, FileDeviceOptions::default()),
            Err(BlockError::Busy { .. })
        ));
        assert_eq!(std::fs::metadata(&path).unwrap().len(), 2 * 4096);
        drop(rw);
        // Readers share; a writer waits for them to go.
        let r1 = FileDevice::open(&path, ro.clone()).unwrap();
        let r2 = FileDevice::open(&path, ro).unwrap();
        assert!(matches!(
            FileDevice::open(&path, FileDeviceOptions::default()),
            Err(BlockError::Busy { .. })
        ));
        drop((r1, r2));
        FileDevice::open(&path, FileDeviceOptions::default()).unwrap();
        // Opting out (tests that look at an image a server holds) takes no lock.
        let _held = FileDevice::open(&path, FileDeviceOptions::default()).unwrap();
        FileDevice::open(
            &path,
            FileDeviceOptions {
                lock: false,
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
    }

    #[test]
    fn reserve_allocates_host_storage_once() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        let dev = FileDevice::create(&path, 16384, FileDeviceOptions::default()).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().blocks(), 0, "sparse");
        Reservation::reserve(&dev, 5, 1).unwrap();
        let after = std::fs::metadata(&path).unwrap().blocks() * 512;
        assert!(
            after >= 4096,
            "block 5 has storage behind it ({after} bytes)"
        );
        assert!(after <= RESERVE_CHUNK, "one chunk at most ({after} bytes)");
        Reservation::reserve(&dev, 6, 1).unwrap();
        assert_eq!(std::fs::metadata(&path).unwrap().blocks() * 512, after);
        // Through the Arc<dyn BlockDevice> an engine holds, too.
        let dev: std::sync::Arc<dyn BlockDevice> = std::sync::Arc::new(dev);
        let via: &dyn BlockDevice = &dev;
        via.reserve(16000, 1).unwrap();
        assert!(std::fs::metadata(&path).unwrap().blocks() * 512 > after);
        assert!(matches!(
            via.reserve(16383, 2),
            Err(BlockError::OutOfRange { .. })
        ));
    }

    #[test]
    fn host_room_counts_the_image_files_holes() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        // 8 MiB of 4 KiB blocks, all a hole.
        let dev = FileDevice::create(&path, 2048, FileDeviceOptions::default()).unwrap();
        let room = Reservation::host_room(&dev).expect("a sparse image has a host room");
        assert_eq!(room.unbacked, 8 * RESERVE_CHUNK);
        assert!(room.free > 0);
        // Reserved (fallocate) and written space are both no longer holes.
        Reservation::reserve(&dev, 0, 1).unwrap();
        dev.write(3 * 256, &[7; 4096], WriteClass::Data).unwrap();
        dev.flush().unwrap();
        let left = Reservation::host_room(&dev).unwrap().unbacked;
        assert!(
            (6 * RESERVE_CHUNK..=7 * RESERVE_CHUNK - 4096).contains(&left),
            "{left} bytes of holes after a reserved chunk and a written block"
        );
        // Fully backed, the device's own size is the only limit.
        Reservation::reserve(&dev, 0, 2048).unwrap();
        assert_eq!(Reservation::host_room(&dev), None);
        // A block device or a read-only open has nothing to reserve, nor a host room.
        drop(dev);
        let ro = FileDevice::open(
            &path,
            FileDeviceOptions {
                read_only: true,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(Reservation::host_room(&ro), None);
    }
}
