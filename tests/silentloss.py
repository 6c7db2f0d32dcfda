#!/usr/bin/env python3
"""Helpers for tests/no-silent-loss.sh, each a subcommand printing one JSON line.

fill PATH SEED CHUNK [LIMIT]
                       write a pattern that names (SEED, offset) in every 8-byte word
                       until write(2) fails (or LIMIT bytes are written: "NEVER"); then
                       fsync and close; report how many bytes write(2) acknowledged and
                       which call failed with which errno
verify PATH SEED ACKED the file holds exactly ACKED bytes of SEED's pattern
maxsize PATH           the largest size truncate(2) accepts (binary search; EFBIG above)
edge PATH MAX          pwrite of one byte at MAX-1 and at MAX, ftruncate to MAX+1 (errnos)
blocks PATH            st_blocks through a file's life: after writes (fstat and stat),
                       after fsync, after close
hold PATH              write a sparse file, fsync, print "ready" and keep it open until
                       stdin closes
"""
import errno
import json
import os
import struct
import sys


def pattern(seed, offset, length):
    """Bytes [offset, offset+length) of seed's pattern: word i is (seed, i)."""
    first = offset // 8
    last = (offset + length + 7) // 8
    words = b"".join(struct.pack("<II", seed, i & 0xFFFFFFFF) for i in range(first, last))
    skip = offset - first * 8
    return words[skip:skip + length]


def fill(path, seed, chunk, limit=None):
    res = {"path": path, "acked": 0, "write_errno": None, "fsync_errno": None,
           "close_errno": None}
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    off = 0
    while True:
        data = pattern(seed, off, chunk)
        try:
            n = os.write(fd, data)
        except OSError as e:
            res["write_errno"] = errno.errorcode.get(e.errno, str(e.errno))
            break
        off += n
        if limit is not None and off > limit:
            # More than the file system holds: write(2) never failed.
            res["write_errno"] = "NEVER"
            break
        if n < len(data):
            # A short write: the next one reports why.
            continue
    res["acked"] = off
    try:
        os.fsync(fd)
    except OSError as e:
        res["fsync_errno"] = errno.errorcode.get(e.errno, str(e.errno))
    try:
        os.close(fd)
    except OSError as e:
        res["close_errno"] = errno.errorcode.get(e.errno, str(e.errno))
    print(json.dumps(res))


def verify(path, seed, acked):
    st = os.stat(path)
    ok = st.st_size == acked
    bad_at = None
    with open(path, "rb") as f:
        off = 0
        while ok and off < acked:
            n = min(1 << 20, acked - off)
            got = f.read(n)
            if got != pattern(seed, off, n):
                ok = False
                bad_at = off
            off += n
    print(json.dumps({"path": path, "size": st.st_size, "acked": acked,
                      "blocks": st.st_blocks, "ok": ok, "bad_at": bad_at}))
    sys.exit(0 if ok else 1)


def maxsize(path):
    open(path, "wb").close()
    lo, hi = 0, (1 << 63) - 1  # lo is accepted; hi is not tried yet
    try:
        os.truncate(path, hi)
        lo = hi
    except OSError as e:
        if e.errno != errno.EFBIG:
            raise
    while hi - lo > 1:
        mid = (lo + hi) // 2
        try:
            os.truncate(path, mid)
            lo = mid
        except OSError as e:
            if e.errno != errno.EFBIG:
                raise
            hi = mid
    os.truncate(path, 0)
    print(json.dumps({"max": lo}))


def edge(path, mx):
    out = {}
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    for name, off in (("pwrite_last", mx - 1), ("pwrite_past", mx)):
        try:
            out[name] = os.pwrite(fd, b"x", off)
        except OSError as e:
            out[name] = errno.errorcode.get(e.errno, str(e.errno))
    try:
        os.ftruncate(fd, mx + 1)
        out["truncate_past"] = 0
    except OSError as e:
        out["truncate_past"] = errno.errorcode.get(e.errno, str(e.errno))
    try:
        os.fsync(fd)
        out["fsync"] = None
    except OSError as e:
        out["fsync"] = errno.errorcode.get(e.errno, str(e.errno))
    out["size"] = os.fstat(fd).st_size
    os.close(fd)
    print(json.dumps(out))


def write_sparse(fd):
    os.write(fd, pattern(1, 0, 100 * 1024))
    os.pwrite(fd, pattern(2, 0, 4096), 10 << 20)
    os.pwrite(fd, pattern(3, 0, 3 << 20), 200 << 20)
    os.pwrite(fd, b"tail", (1 << 30) + 5)


def blocks(path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    write_sparse(fd)
    out = {"written_fstat": os.fstat(fd).st_blocks, "written_stat": os.stat(path).st_blocks}
    os.fsync(fd)
    out["fsynced"] = os.stat(path).st_blocks
    os.close(fd)
    st = os.stat(path)
    out["closed"] = st.st_blocks
    out["size"] = st.st_size
    print(json.dumps(out))


def hold(path):
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    write_sparse(fd)
    os.fsync(fd)
    print("ready", flush=True)
    sys.stdin.read()
    os.close(fd)


def main():
    cmd, args = sys.argv[1], sys.argv[2:]
    if cmd == "fill":
        fill(args[0], int(args[1]), int(args[2]), int(args[3]) if len(args) > 3 else None)
    elif cmd == "verify":
        verify(args[0], int(args[1]), int(args[2]))
    elif cmd == "maxsize":
        maxsize(args[0])
    elif cmd == "edge":
        edge(args[0], int(args[1]))
    elif cmd == "blocks":
        blocks(args[0])
    elif cmd == "hold":
        hold(args[0])
    else:
        sys.exit(f"unknown command {cmd}")


if __name__ == "__main__":
    main()
