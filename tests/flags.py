#!/usr/bin/env python3
"""Inode flags (FS_IOC_GETFLAGS/SETFLAGS) under DIR, printed for comparison with kernel
ext2. Run as root, on a mount other users may enter.

  flags.py setup DIR   makes the files and sets their flags (chattr's ioctls)
  flags.py probe DIR   tries every operation the flags govern, as root and as uid 1234,
                       and prints each result (ok or the errno), the flags seen (lsattr's
                       ioctl and FS_IOC_FSGETXATTR), what new files inherit, and who may
                       change which flag; then clears the flags so the tree can go.

setup and probe may run on different mounts of one image (flags set by the kernel
enforced by quiltfs, and the reverse)."""
import fcntl
import os
import struct
import sys

import userops
from userops import attempt

GETFLAGS, SETFLAGS = 0x80086601, 0x40086602
FSGETXATTR, FSSETXATTR = 0x801C581F, 0x401C5820
SYNC, IMMUTABLE, APPEND, NODUMP, NOATIME = 0x8, 0x10, 0x20, 0x40, 0x80
DIRSYNC, EXTENTS, TOPDIR = 0x10000, 0x80000, 0x20000
USER = 1234


def as_user(f, *a):
    return userops.as_user(USER, [USER], f, *a)





def get_flags(p):
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        return struct.unpack("I", fcntl.ioctl(fd, GETFLAGS, b"\0" * 4))[0]
    finally:
        os.close(fd)


def set_flags(p, v):
    fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK)
    try:
        fcntl.ioctl(fd, SETFLAGS, struct.pack("I", v))
    finally:
        os.close(fd)


def xflags(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        return hex(struct.unpack("7I", fcntl.ioctl(fd, FSGETXATTR, b"\0" * 28))[0])
    finally:
        os.close(fd)




def write_file(p, data, flags=os.O_WRONLY):
    fd = os.open(p, flags)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def setup(d):
    for f in ["i", "a", "plain", "mine"]:
        write_file(os.path.join(d, f), b"0123456789", os.O_WRONLY | os.O_CREAT)
    os.chown(os.path.join(d, "mine"), USER, USER)
    for sub in ["di", "da", "inherit"]:
        os.mkdir(os.path.join(d, sub))
        write_file(os.path.join(d, sub, "f"), b"inside", os.O_WRONLY | os.O_CREAT)
    # Modes that let anyone write, so the flags alone refuse the ordinary user. (Where the
    # mode also refuses, the kernel answers EPERM for the flag first and a FUSE mount
    # EACCES, as the kernel checks the mode before asking the server.)
    for f, m in [("", 0o777), ("i", 0o666), ("di", 0o777), ("da", 0o777)]:
        os.chmod(os.path.join(d, f), m)
    set_flags(os.path.join(d, "i"), IMMUTABLE)
    set_flags(os.path.join(d, "a"), APPEND | NODUMP)
    set_flags(os.path.join(d, "di"), IMMUTABLE)
    set_flags(os.path.join(d, "da"), APPEND)
    set_flags(os.path.join(d, "inherit"), SYNC | NOATIME | NODUMP | DIRSYNC)


def file_ops(d, f):
    p = os.path.join(d, f)
    ops = [
        ("read", lambda: len(open(p, "rb").read())),
        ("open O_WRONLY", lambda: os.close(os.open(p, os.O_WRONLY))),
        ("open O_RDWR|O_APPEND", lambda: os.close(os.open(p, os.O_RDWR | os.O_APPEND))),
        ("append", lambda: write_file(p, b"+", os.O_WRONLY | os.O_APPEND)),
        ("open O_WRONLY|O_APPEND|O_TRUNC",
         lambda: os.close(os.open(p, os.O_WRONLY | os.O_APPEND | os.O_TRUNC))),
        ("truncate", lambda: os.truncate(p, 3)),
        ("chmod", lambda: os.chmod(p, 0o600)),
        ("chown", lambda: os.chown(p, 5, 5)),
        ("utime explicit", lambda: os.utime(p, (1, 1))),
        ("utime now", lambda: os.utime(p, None)),
        ("setxattr", lambda: os.setxattr(p, "user.x", b"v")),
        ("link", lambda: os.link(p, p + ".link")),
        ("rename", lambda: os.rename(p, p + ".moved")),
        ("unlink", lambda: os.unlink(p)),
        ("size", lambda: os.stat(p).st_size),
    ]
    for what, op in ops:
        print(f"{f}: {what}: {attempt(op)}")


def dir_ops(d, sub):
    p = os.path.join(d, sub)
    ops = [
        ("list", lambda: len(os.listdir(p))),
        ("write inside", lambda: write_file(os.path.join(p, "f"), b"x", os.O_WRONLY | os.O_APPEND)),
        ("create", lambda: os.close(os.open(os.path.join(p, "new"), os.O_CREAT | os.O_WRONLY))),
        ("mkdir", lambda: os.mkdir(os.path.join(p, "sub"))),
        ("link in", lambda: os.link(os.path.join(d, "plain"), os.path.join(p, "l"))),
        ("rename in", lambda: os.rename(os.path.join(d, "in-" + sub), os.path.join(p, "moved-in"))),
        ("rename within", lambda: os.rename(os.path.join(p, "f"), os.path.join(p, "g"))),
        ("rename out", lambda: os.rename(os.path.join(p, "f"), os.path.join(d, "out-" + sub))),
        ("unlink", lambda: os.unlink(os.path.join(p, "f"))),
        ("rmdir", lambda: os.rmdir(p)),
        ("chmod", lambda: os.chmod(p, 0o700)),
        ("entries", lambda: " ".join(sorted(os.listdir(p)))),
    ]
    write_file(os.path.join(d, "in-" + sub), b"y", os.O_WRONLY | os.O_CREAT)
    for what, op in ops:
        print(f"{sub}/: {what}: {attempt(op)}")


def probe(d):
    j = lambda f: os.path.join(d, f)  # noqa: E731
    for f in ["i", "a", "di", "da", "inherit", "plain"]:
        print(f"{f}: flags {hex(get_flags(j(f)))} xflags {xflags(j(f))}")
    file_ops(d, "i")
    file_ops(d, "a")
    dir_ops(d, "di")
    dir_ops(d, "da")
    # Inheritance: a file and a directory made in a directory with flags.
    write_file(j("inherit/newfile"), b"x", os.O_WRONLY | os.O_CREAT)
    os.mkdir(j("inherit/newdir"))
    os.mkfifo(j("inherit/fifo"))
    for f in ["inherit/newfile", "inherit/newdir", "inherit/f"]:
        print(f"{f}: flags {hex(get_flags(j(f)))}")
    # Who may set what.
    cases = [
        ("root: nodump", "plain", NODUMP),
        ("root: unknown visible bit 0x100 (kept as it was)", "plain", 0x100),
        ("root: bit 0x80000000", "plain", 0x80000000),
        ("root: dirsync on a file", "plain", DIRSYNC),
        ("root: topdir on a file", "plain", TOPDIR),
        ("root: extents", "plain", EXTENTS),
        ("root: nodump while immutable", "i", IMMUTABLE | NODUMP),
        ("root: dirsync on a directory", "di", IMMUTABLE | DIRSYNC),
    ]
    for what, f, v in cases:
        print(f"setflags {what}: {attempt(set_flags, j(f), v)} -> {hex(get_flags(j(f)))}")
    set_flags(j("plain"), 0)
    for what, f, v in [
        ("owner: nodump", "mine", NODUMP),
        ("owner: immutable", "mine", IMMUTABLE),
        ("owner: append", "mine", APPEND),
        ("other: nodump", "plain", NODUMP),
    ]:
        print(f"setflags as uid {USER} {what}: {as_user(set_flags, j(f), v)} -> {hex(get_flags(j(f)))}")
    # As an ordinary user, through a writable directory: the flags still win.
    print(f"uid {USER}: append to i: {as_user(write_file, j('i'), b'u', os.O_WRONLY | os.O_APPEND)}")
    print(f"uid {USER}: unlink da/f: {as_user(os.unlink, j('da/f'))}")
    print(f"uid {USER}: create in di: {as_user(write_file, j('di/u'), b'u', os.O_WRONLY | os.O_CREAT)}")
    # xfs_io's interface: set and clear through FS_IOC_FSSETXATTR.
    def fsset(p, x):
        fd = os.open(p, os.O_RDONLY)
        try:
            fcntl.ioctl(fd, FSSETXATTR, struct.pack("7I", x, 0, 0, 0, 0, 0, 0))
        finally:
            os.close(fd)
    print(f"fssetxattr noatime|nodump: {attempt(fsset, j('plain'), 0xC0)} -> {hex(get_flags(j('plain')))}")
    print(f"fssetxattr none: {attempt(fsset, j('plain'), 0)} -> {hex(get_flags(j('plain')))}")
    for f in ["i", "a", "di", "da", "inherit"]:
        set_flags(j(f), 0)
    print("cleared:", " ".join(hex(get_flags(j(f))) for f in ["i", "a", "di", "da"]))


if __name__ == "__main__":
    {"setup": setup, "probe": probe}[sys.argv[1]](sys.argv[2])
