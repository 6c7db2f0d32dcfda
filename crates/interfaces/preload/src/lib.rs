//! `libquilt_preload.so`: patchgroups for unmodified programs.
//!
//! ```text
//! QUILTFS_MOUNT=/mnt/quilt LD_PRELOAD=libquilt_preload.so program ...
//! ```
//!
//! At start the process creates a patchgroup and engages it. Each `fsync` or `fdatasync`
//! of a file on that mount then ends the current group and starts a new one that depends
//! on it, and (with `QUILTFS_FSYNC=order`, the default) returns without waiting for the
//! disk. So every change made before an fsync reaches the disk before any change made
//! after it, but nothing is promised about *when*: ordering without durability, like
//! OptFS's osync. With `QUILTFS_FSYNC=durable` the group switch is made and the real
//! fsync follows, so fsync is as durable as without the library and orders as well.
//!
//! Limits:
//! * Only fsync and fdatasync are caught (not sync, syncfs, msync, sync_file_range,
//!   O_SYNC/O_DSYNC writes, which keep their own meaning).
//! * With the kernel's writeback cache (`-o wbcache`), the file's dirty pages are sent
//!   to the server before the switch, so they join the group they were written in.
//!   Pages of *other* files written in the group and still cached in the kernel join
//!   the group that is current when the kernel writes them back: later, never earlier.
//!   Without it (the default) every write reaches the server in its own call, in the
//!   group current at that moment.
//! * A child made by fork (without exec) starts inside the group its parent had engaged
//!   when the server first sees the child (FUSE cannot see the fork itself). While a
//!   child keeps that group engaged, the parent cannot start a group after it; its fsync
//!   then falls back to the real, durable one.
//! * Engagement is per process: in the instant between ending one group and engaging
//!   the next, another thread's change joins neither.
//! * A process that exits has its groups abandoned by the server; their order is kept.
//! * If the mount has no control file (not quiltfs), or `QUILTFS_MOUNT` is unset, the
//!   library changes nothing.
//!
//! It also makes FICLONE and FICLONERANGE work on quiltfs mounts (betrfs), so that
//! `cp --reflink=always` clones (no `QUILTFS_MOUNT` needed for that): the kernel answers
//! them EOPNOTSUPP on every FUSE file system (FUSE has no request for remap_file_range),
//! and the library then asks the mount through `quilt_pg::clone`. On anything but a
//! FUSE mount, and where the mount does not know the request, the kernel's answer
//! stands.

#![cfg_attr(not(test), deny(clippy::unwrap_used))]

use quilt_pg::{Control, Group};
use std::ffi::{c_int, c_void, CStr};
use std::sync::Mutex;

struct State {
    ctl: Control,
    /// The mount's device: fsync of files elsewhere is passed through.
    dev: libc::dev_t,
    current: Group,
    /// The process that created `current` (a forked child must not abandon it).
    creator: libc::pid_t,
    durable: bool,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

type FsyncFn = unsafe extern "C" fn(c_int) -> c_int;

fn real(name: &CStr) -> Option<FsyncFn> {
    // SAFETY: dlsym with RTLD_NEXT finds the next definition of a libc symbol; the two
    // looked up here have the signature of FsyncFn.
    let p = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) };
    if p.is_null() {
        None
    } else {
        // SAFETY: see above.
        Some(unsafe { std::mem::transmute::<*mut c_void, FsyncFn>(p) })
    }
}

fn warn(msg: &str) {
    if std::env::var_os("QUILTFS_PRELOAD_QUIET").is_none() {
        eprintln!("libquilt_preload: {msg}");
    }
}

fn start() -> Option<State> {
    let mount = std::env::var_os("QUILTFS_MOUNT")?;
    let durable = match std::env::var("QUILTFS_FSYNC").as_deref() {
        Ok("durable") => true,
        Ok("order") | Err(_) => false,
        Ok(other) => {
            warn(&format!(
                "QUILTFS_FSYNC={other} is neither 'order' nor 'durable'; using 'order'"
            ));
            false
        }
    };
    let ctl = match Control::open(&mount) {
        Ok(c) => c,
        Err(e) => {
            warn(&format!("{e}; fsync is left alone"));
            return None;
        }
    };
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills `st` for an open descriptor.
    if unsafe { libc::fstat(ctl.as_raw_fd(), &mut st) } != 0 {
        return None;
    }
    let first = ctl
        .create()
        .and_then(|g| ctl.release(g).map(|()| g))
        .and_then(|g| ctl.engage(g).map(|()| g));
    match first {
        Ok(g) => Some(State {
            ctl,
            dev: st.st_dev,
            current: g,
            // SAFETY: getpid has no preconditions.
            creator: unsafe { libc::getpid() },
            durable,
        }),
        Err(e) => {
            warn(&format!("{e}; fsync is left alone"));
            None
        }
    }
}

/// Runs when the library is loaded, before `main`: the process's changes are in a group
/// from its first one.
extern "C" fn init() {
    let s = start();
    *STATE.lock().unwrap_or_else(|e| e.into_inner()) = s;
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;

/// Ends the current group and engages a new one after it. On failure the old group is
/// engaged again (ordering still holds) and the errno is returned.
fn next_group(s: &mut State) -> Result<(), i32> {
    // One call: the server ends the group and engages the next (see `Control::next`).
    // Only the process that created a group drops its handle: a forked child's fsync
    // must leave its parent's group usable.
    // SAFETY: getpid has no preconditions.
    let me = unsafe { libc::getpid() };
    let g = s
        .ctl
        .next(s.current, s.creator == me)
        .map_err(|e| e.errno)?;
    s.current = g;
    s.creator = me;
    Ok(())
}

fn on_mount(s: &State, fd: c_int) -> bool {
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills `st` for an open descriptor (or fails).
    unsafe { libc::fstat(fd, &mut st) == 0 && st.st_dev == s.dev }
}

fn sync_like(fd: c_int, name: &CStr) -> c_int {
    let Some(real_fn) = real(name) else {
        // SAFETY: errno slot of this thread.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    };
    let mut guard = STATE.lock().unwrap_or_else(|e| e.into_inner());
    let Some(s) = guard.as_mut().filter(|s| on_mount(s, fd)) else {
        drop(guard);
        // SAFETY: the real fsync/fdatasync.
        return unsafe { real_fn(fd) };
    };
    // The file's pages cached in the kernel go to the server now, inside the group they
    // were written in. (For a directory this does nothing and fails harmlessly.)
    // SAFETY: sync_file_range on a descriptor the caller passed.
    unsafe {
        libc::sync_file_range(
            fd,
            0,
            0,
            libc::SYNC_FILE_RANGE_WAIT_BEFORE
                | libc::SYNC_FILE_RANGE_WRITE
                | libc::SYNC_FILE_RANGE_WAIT_AFTER,
        )
    };
    if let Err(e) = next_group(s) {
        drop(guard);
        warn(&format!(
            "switching patchgroups failed ({}); this fsync waits for the disk instead",
            std::io::Error::from_raw_os_error(e)
        ));
        // SAFETY: the real fsync/fdatasync.
        return unsafe { real_fn(fd) };
    }
    let durable = s.durable;
    drop(guard);
    if durable {
        // SAFETY: the real fsync/fdatasync.
        return unsafe { real_fn(fd) };
    }
    0
}

/// # Safety
/// As fsync(2).
#[no_mangle]
pub unsafe extern "C" fn fsync(fd: c_int) -> c_int {
    sync_like(fd, c"fsync")
}

/// # Safety
/// As fdatasync(2).
#[no_mangle]
pub unsafe extern "C" fn fdatasync(fd: c_int) -> c_int {
    sync_like(fd, c"fdatasync")
}

type IoctlFn = unsafe extern "C" fn(c_int, libc::c_ulong, *mut c_void) -> c_int;

/// FICLONE and FICLONERANGE (linux/fs.h).
const FICLONE: libc::c_ulong = 0x4004_9409;
const FICLONERANGE: libc::c_ulong = 0x4020_940d;
const FUSE_SUPER_MAGIC: i64 = 0x6573_5546;

fn on_fuse(fd: c_int) -> bool {
    // SAFETY: fstatfs fills the struct for an open descriptor, or fails.
    unsafe {
        let mut sf: libc::statfs = std::mem::zeroed();
        libc::fstatfs(fd, &mut sf) == 0 && sf.f_type as i64 == FUSE_SUPER_MAGIC
    }
}

/// ioctl(2), with FICLONE and FICLONERANGE carried to quiltfs mounts.
///
/// # Safety
/// As ioctl(2): `arg` is what the request expects.
#[no_mangle]
pub unsafe extern "C" fn ioctl(fd: c_int, request: libc::c_ulong, arg: *mut c_void) -> c_int {
    // SAFETY: dlsym finds libc's ioctl, whose first three arguments are these (the rest
    // of its variadic list is unused by every request).
    let real: Option<IoctlFn> = unsafe {
        let p = libc::dlsym(libc::RTLD_NEXT, c"ioctl".as_ptr());
        (!p.is_null()).then(|| std::mem::transmute::<*mut c_void, IoctlFn>(p))
    };
    let Some(real) = real else {
        // SAFETY: this thread's errno slot.
        unsafe { *libc::__errno_location() = libc::ENOSYS };
        return -1;
    };
    // SAFETY: the caller's request, passed on as it is.
    let r = unsafe { real(fd, request, arg) };
    if r == 0 || (request != FICLONE && request != FICLONERANGE) {
        return r;
    }
    // SAFETY: this thread's errno slot.
    let errno = unsafe { *libc::__errno_location() };
    if errno != libc::EOPNOTSUPP || !on_fuse(fd) {
        return r;
    }
    let (src, src_off, len, dst_off) = if request == FICLONE {
        (arg as usize as c_int, 0, 0, 0)
    } else {
        // struct file_clone_range { __s64 src_fd; __u64 src_offset, src_length,
        // dest_offset; }
        // SAFETY: for FICLONERANGE the caller passes a pointer to that struct.
        let a = unsafe { std::slice::from_raw_parts(arg as *const u64, 4) };
        (a[0] as i64 as c_int, a[1], a[2], a[3])
    };
    match quilt_pg::clone::clone_fd(fd, dst_off, src, src_off, len) {
        Ok(_) => 0,
        Err(e) => {
            let code = match e.raw_os_error() {
                // Not quiltfs (or not betrfs): the kernel's answer.
                Some(libc::ENOTTY) | Some(libc::ENOSYS) | None => errno,
                Some(c) => c,
            };
            // SAFETY: this thread's errno slot.
            unsafe { *libc::__errno_location() = code };
            -1
        }
    }
}
