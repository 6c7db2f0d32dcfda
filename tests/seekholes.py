#!/usr/bin/env python3
"""Writes files with holes in DIR and prints what SEEK_DATA and SEEK_HOLE answer at many
offsets (a result or an errno name), one line per file and offset: the same on kernel
ext2 and on quiltfs, or parity is broken.

    seekholes.py write DIR      make the files
    seekholes.py probe DIR      print the answers
"""
import errno
import os
import sys

M = 1 << 20
FILES = {
    # name: list of (offset, length) written, then a final size (or None)
    "sparse": ([(0, 100 * 1024), (10 * M, 4096), (200 * M, 3 * M), ((1 << 30) + 5, 4)], None),
    "hole-first": ([(5 * M, 1)], None),
    "all-hole": ([], 1 << 30),
    "empty": ([], 0),
    "hole-at-end": ([(0, 8192)], M),
    "dense": ([(0, 3 * M + 17)], None),
    "indirect-edges": ([(48 * 1024, 1), (4 * M + 48 * 1024, 4096), (4 * 1024 * M + 52 * 1024, 1)], None),
}


def write(d):
    for name, (writes, size) in FILES.items():
        fd = os.open(os.path.join(d, name), os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
        for off, n in writes:
            os.pwrite(fd, b"d" * n, off)
        if size is not None:
            os.ftruncate(fd, size)
        os.fsync(fd)
        os.close(fd)


def answer(fd, off, whence):
    try:
        return str(os.lseek(fd, off, whence))
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def probe(d):
    for name in FILES:
        fd = os.open(os.path.join(d, name), os.O_RDONLY)
        size = os.fstat(fd).st_size
        offs = {0, 1, 4095, 4096, 100 * 1024 - 1, 100 * 1024, 48 * 1024, 52 * 1024,
                5 * M, 10 * M - 1, 10 * M, 10 * M + 4096, 200 * M, 203 * M,
                4 * M + 48 * 1024, 1 << 30, (1 << 30) + 4096, size - 1, size, size + 10}
        for off in sorted(o for o in offs if o >= 0):
            print(name, size, off, answer(fd, off, os.SEEK_DATA), answer(fd, off, os.SEEK_HOLE))
        os.close(fd)


if __name__ == "__main__":
    {"write": write, "probe": probe}[sys.argv[1]](sys.argv[2])
