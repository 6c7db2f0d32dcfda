#!/usr/bin/env python3
"""O_TMPFILE in DIR, printed so that kernel ext2 and quiltfs can be compared line by line:
an unnamed file (nlink 0) linked into the tree with its data; one opened O_EXCL that may
not be linked; one never linked, gone (its inode free again) once closed."""
import ctypes
import errno
import os
import sys
import time

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, AT_EMPTY_PATH = -100, 0x1000


def linkat(fd, path):
    """linkat(fd, "", AT_FDCWD, path, AT_EMPTY_PATH): names the open file (root may)."""
    if libc.linkat(fd, b"", AT_FDCWD, os.fsencode(path), AT_EMPTY_PATH) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def err(f):
    try:
        return f()
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


d = sys.argv[1]
ffree = os.statvfs(d).f_ffree
fd = os.open(d, os.O_TMPFILE | os.O_RDWR, 0o640)
os.write(fd, b"made without a name")
st = os.fstat(fd)
print("tmpfile: nlink", st.st_nlink, "mode", oct(st.st_mode), "size", st.st_size)
print("link:", err(lambda: linkat(fd, os.path.join(d, "named"))))
os.close(fd)
st = os.stat(os.path.join(d, "named"))
print("named: nlink", st.st_nlink, "mode", oct(st.st_mode))
print("named data:", open(os.path.join(d, "named"), "rb").read())
fd = os.open(d, os.O_TMPFILE | os.O_RDWR | os.O_EXCL, 0o600)
print("excl link:", err(lambda: linkat(fd, os.path.join(d, "nope"))))
os.close(fd)
fd = os.open(d, os.O_TMPFILE | os.O_WRONLY, 0o600)
os.write(fd, b"x" * 100000)
os.close(fd)
# A FUSE server hears of the last close through FORGET, which the kernel queues: give it
# a moment (the kernel's own file systems free the inode at once).
for _ in range(40):
    used = ffree - os.statvfs(d).f_ffree
    if used <= 1:
        break
    time.sleep(0.05)
print("inodes used by the run:", used)
print("in a file:", err(lambda: os.open(os.path.join(d, "named"), os.O_TMPFILE | os.O_RDWR, 0o600)))
print("listing:", sorted(os.listdir(d)))
