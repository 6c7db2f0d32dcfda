#!/usr/bin/env python3
"""fallocate(2) under DIR.

  fallocate.py punch DIR      PUNCH_HOLE|KEEP_SIZE in every shape (inside a block, whole
                              blocks, across blocks, over a whole indirect block's range,
                              past the end), the modes block-mapped files refuse, and the
                              refusals of flags and open modes; after each, the size,
                              st_blocks, the data map (SEEK_DATA/SEEK_HOLE) and a digest
                              of the contents. Printed for comparison with kernel ext2.
  fallocate.py prealloc DIR   preallocation (mode 0, KEEP_SIZE inside the file), which
                              the kernel refuses on ext2 and quiltfs does: checked here
                              (zeros read back, blocks allocated, size as asked, the
                              space taken so later writes cannot fail), printed too.
"""
import ctypes
import errno
import fcntl
import hashlib
import os
import struct
import sys

libc = ctypes.CDLL(None, use_errno=True)
libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
KEEP, PUNCH, COLLAPSE, ZERO = 1, 2, 8, 0x10
BS = 4096


def falloc(fd, mode, off, length):
    if libc.fallocate(fd, mode, off, length) != 0:
        e = ctypes.get_errno()
        return errno.errorcode.get(e, str(e))
    return "ok"


def data_map(fd, size):
    out, pos = [], 0
    while pos < size:
        try:
            d = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:
            break
        h = os.lseek(fd, d, os.SEEK_HOLE)
        out.append(f"{d}-{h}")
        pos = h
    return ",".join(out) or "none"


def show(p):
    fd = os.open(p, os.O_RDONLY)
    st = os.fstat(fd)
    digest = hashlib.sha256(os.pread(fd, st.st_size, 0)).hexdigest()[:16]
    m = data_map(fd, st.st_size)
    os.close(fd)
    return f"size {st.st_size} blocks {st.st_blocks} data {m} sha {digest}"


def make(p, nblocks):
    with open(p, "wb") as f:
        for i in range(nblocks):
            f.write(bytes([(i % 250) + 1]) * BS)
        f.write(b"tail")


def punch(d):
    j = lambda f: os.path.join(d, f)  # noqa: E731
    make(j("a"), 40)
    make(j("big"), 1300)  # direct, a whole indirect block, part of the double-indirect
    cases = [
        ("a", PUNCH | KEEP, 100, 200),
        ("a", PUNCH | KEEP, BS, BS),
        ("a", PUNCH | KEEP, 5000, 20000),
        ("a", PUNCH | KEEP, 30 * BS - 10, 100 * BS),
        ("a", PUNCH | KEEP, 50 * BS, BS),
        ("a", PUNCH, 0, BS),
        ("a", ZERO, 0, BS),
        ("a", COLLAPSE, 0, BS),
        ("big", PUNCH | KEEP, 12 * BS, 1024 * BS),
        ("big", PUNCH | KEEP, 1100 * BS + 7, 150 * BS),
        ("big", PUNCH | KEEP, 0, 1300 * BS + 4),
    ]
    for f, mode, off, length in cases:
        fd = os.open(j(f), os.O_RDWR)
        r = falloc(fd, mode, off, length)
        os.close(fd)
        print(f"{f} mode {mode:#x} {off}+{length}: {r}: {show(j(f))}")
    make(j("ro"), 2)
    fd = os.open(j("ro"), os.O_RDONLY)
    print("read-only descriptor:", falloc(fd, PUNCH | KEEP, 0, BS))
    os.close(fd)
    make(j("i"), 2)
    make(j("ap"), 2)
    for f, flag in [("i", 0x10), ("ap", 0x20)]:
        fd = os.open(j(f), os.O_RDONLY)
        fcntl.ioctl(fd, 0x40086602, struct.pack("I", flag))
        os.close(fd)
    fd = os.open(j("ap"), os.O_WRONLY | os.O_APPEND)
    print("append-only:", falloc(fd, PUNCH | KEEP, 0, BS), show(j("ap")))
    os.close(fd)
    for f in ["i", "ap"]:
        fd = os.open(j(f), os.O_RDONLY)
        fcntl.ioctl(fd, 0x40086602, struct.pack("I", 0))
        os.close(fd)


def prealloc(d):
    j = lambda f: os.path.join(d, f)  # noqa: E731
    fd = os.open(j("p"), os.O_RDWR | os.O_CREAT, 0o644)
    r = falloc(fd, 0, 0, 64 * BS + 100)
    st = os.fstat(fd)
    print("mode 0 on an empty file:", r, show(j("p")))
    assert r == "ok" and st.st_size == 64 * BS + 100 and st.st_blocks >= 65 * 8, st
    assert os.pread(fd, st.st_size, 0) == bytes(st.st_size), "preallocated bytes read zero"
    os.pwrite(fd, b"x" * 10, 3 * BS)
    os.ftruncate(fd, 100 * BS)
    r = falloc(fd, KEEP, 64 * BS, 36 * BS)
    st2 = os.fstat(fd)
    print("KEEP_SIZE filling holes inside:", r, show(j("p")))
    assert r == "ok" and st2.st_size == 100 * BS and st2.st_blocks >= 100 * 8, st2
    r = falloc(fd, KEEP, 99 * BS, 10 * BS)
    print("KEEP_SIZE past the end:", r)
    assert r in ("EOPNOTSUPP", "ENOTSUP"), r
    assert os.pread(fd, 20, 3 * BS) == b"x" * 10 + bytes(10)
    os.close(fd)


if __name__ == "__main__":
    {"punch": punch, "prealloc": prealloc}[sys.argv[1]](sys.argv[2])
