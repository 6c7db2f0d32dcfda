//! The C interface (`include/quiltfs_pg.h`): the same calls on a control-file
//! descriptor. Each returns 0 (or a group id, for the creating calls) on success and -1
//! with `errno` set on failure; `qfs_pg_strerror` then gives the server's explanation.

use crate::{abi, call, last_error};
use std::ffi::{c_char, c_int, CStr};

fn set_errno(e: i32) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

fn ret(r: Result<abi::PgArgs, crate::Error>) -> c_int {
    match r {
        Ok(_) => 0,
        Err(e) => {
            set_errno(e.errno);
            -1
        }
    }
}

/// Opens `<mount>/.quiltfs-control`; returns the descriptor or -1.
///
/// # Safety
/// `mount` must be a NUL-terminated string.
#[no_mangle]
pub unsafe extern "C" fn qfs_pg_open(mount: *const c_char) -> c_int {
    if mount.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let m = unsafe { CStr::from_ptr(mount) }.to_bytes();
    let mut path = m.to_vec();
    path.push(b'/');
    path.extend_from_slice(abi::CONTROL_NAME.as_bytes());
    path.push(0);
    // SAFETY: `path` is NUL-terminated.
    unsafe {
        libc::open(
            path.as_ptr() as *const c_char,
            libc::O_RDONLY | libc::O_CLOEXEC,
        )
    }
}

#[no_mangle]
pub extern "C" fn qfs_pg_close(fd: c_int) -> c_int {
    // SAFETY: closing a descriptor the caller owns.
    unsafe { libc::close(fd) }
}

/// A new group's id (> 0), or -1.
#[no_mangle]
pub extern "C" fn qfs_pg_create(fd: c_int) -> i64 {
    match call(fd, abi::CREATE, 0, 0) {
        Ok(a) => a.a as i64,
        Err(e) => {
            set_errno(e.errno);
            -1
        }
    }
}

/// Creates a group depending on `before` and releases it; its id, or -1.
#[no_mangle]
pub extern "C" fn qfs_pg_create_after(fd: c_int, before: u64) -> i64 {
    let c = crate::Control::from_file(dup_file(fd));
    match c.create_after(crate::Group(before)) {
        Ok(g) => g.0 as i64,
        Err(e) => {
            set_errno(e.errno);
            -1
        }
    }
}

/// A `File` on a duplicate of `fd`, so the caller's descriptor stays open.
fn dup_file(fd: c_int) -> std::fs::File {
    use std::os::fd::FromRawFd;
    // SAFETY: dup returns a new descriptor (or -1, which the ioctls then reject with
    // EBADF) that the File owns.
    unsafe { std::fs::File::from_raw_fd(libc::dup(fd)) }
}

#[no_mangle]
pub extern "C" fn qfs_pg_depend(fd: c_int, after: u64, before: u64) -> c_int {
    ret(call(fd, abi::DEPEND, after, before))
}
#[no_mangle]
pub extern "C" fn qfs_pg_release(fd: c_int, pg: u64) -> c_int {
    ret(call(fd, abi::RELEASE, pg, 0))
}
#[no_mangle]
pub extern "C" fn qfs_pg_engage(fd: c_int, pg: u64) -> c_int {
    ret(call(fd, abi::ENGAGE, pg, 0))
}
#[no_mangle]
pub extern "C" fn qfs_pg_disengage(fd: c_int, pg: u64) -> c_int {
    ret(call(fd, abi::DISENGAGE, pg, 0))
}
#[no_mangle]
pub extern "C" fn qfs_pg_sync(fd: c_int, pg: u64) -> c_int {
    ret(call(fd, abi::SYNC, pg, 0))
}
#[no_mangle]
pub extern "C" fn qfs_pg_abandon(fd: c_int, pg: u64) -> c_int {
    ret(call(fd, abi::ABANDON, pg, 0))
}
/// Ends `pg` (engaged by this process) and engages a new group after it; returns the
/// new group's id, or 0 with errno set (`pg` is then still engaged).
#[no_mangle]
pub extern "C" fn qfs_pg_next(fd: c_int, pg: u64, abandon_old: c_int) -> u64 {
    let flags = if abandon_old != 0 {
        abi::NEXT_ABANDON
    } else {
        0
    };
    match call(fd, abi::NEXT, pg, flags) {
        Ok(r) => r.a,
        Err(e) => {
            set_errno(e.errno);
            0
        }
    }
}

/// Copies the server's explanation of this process's last failed call into `buf`
/// (NUL-terminated, cut to `len`). Returns 0, or -1 if there is none to give.
///
/// # Safety
/// `buf` must point to `len` writable bytes.
#[no_mangle]
pub unsafe extern "C" fn qfs_pg_strerror(fd: c_int, buf: *mut c_char, len: usize) -> c_int {
    if buf.is_null() || len == 0 {
        set_errno(libc::EINVAL);
        return -1;
    }
    let Some(m) = last_error(fd) else { return -1 };
    let n = m.len().min(len - 1);
    // SAFETY: `buf` has room for `len` bytes and n < len.
    unsafe {
        std::ptr::copy_nonoverlapping(m.as_ptr(), buf as *mut u8, n);
        *buf.add(n) = 0;
    }
    0
}

/// Clones bytes `src_off..src_off + len` of `src_fd` (`len` 0: to its end) into
/// `dst_fd` at `dst_off` (see `quilt_pg::clone::clone_file`); returns the bytes cloned,
/// or -1 with errno set.
#[no_mangle]
pub extern "C" fn qfs_clone_range(
    dst_fd: c_int,
    dst_off: u64,
    src_fd: c_int,
    src_off: u64,
    len: u64,
) -> i64 {
    match crate::clone::clone_fd(dst_fd, dst_off, src_fd, src_off, len) {
        Ok(n) => n as i64,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}

/// A new entry `dst` holding a copy of the tree at `src`, sharing storage (see
/// `quilt_pg::clone::clone_tree`); 0, or -1 with errno set.
///
/// # Safety
/// Both must be NUL-terminated strings.
#[no_mangle]
pub unsafe extern "C" fn qfs_clone_tree(src: *const c_char, dst: *const c_char) -> c_int {
    if src.is_null() || dst.is_null() {
        set_errno(libc::EINVAL);
        return -1;
    }
    use std::os::unix::ffi::OsStrExt;
    // SAFETY: the caller passes NUL-terminated strings.
    let (s, d) = unsafe { (CStr::from_ptr(src), CStr::from_ptr(dst)) };
    let p = |c: &CStr| std::path::PathBuf::from(std::ffi::OsStr::from_bytes(c.to_bytes()));
    match crate::clone::clone_tree(p(s), p(d)) {
        Ok(_) => 0,
        Err(e) => {
            set_errno(e.raw_os_error().unwrap_or(libc::EIO));
            -1
        }
    }
}
