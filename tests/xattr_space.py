#!/usr/bin/env python3
"""Which extended attributes fit, printed for comparison with kernel ext2 on an image
with 256-byte inodes: the issue's case (100 B and 3,900 B user attributes, then a small
trusted one, which fits only in the inode's spare space), then attributes of assorted
sizes added until three in a row find no room, then some removed and others added, on
a file and a directory under DIR. Run as root (trusted.* needs it)."""
import errno
import os
import sys


def attempt(f, *a):
    try:
        f(*a)
        return "ok"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))


def fill(p):
    out = []
    for n, size in [("user.a", 100), ("user.b", 3900), ("trusted.t", 10)]:
        out.append(f"{n}={size}:{attempt(os.setxattr, p, n, b'v' * size)}")
    print(os.path.basename(p), "issue case:", " ".join(out))
    for n in ["user.a", "user.b", "trusted.t"]:
        attempt(os.removexattr, p, n)
    out, misses, i = [], 0, 0
    while misses < 3 and i < 200:
        size = (i * 37) % 300 + 1
        r = attempt(os.setxattr, p, f"user.k{i}", bytes([i % 256]) * size)
        out.append(f"k{i}={size}:{r}")
        misses = misses + 1 if r != "ok" else 0
        i += 1
    print(os.path.basename(p), "fill:", " ".join(out))
    # Free some, then grow one past what the inode holds, then add small ones.
    for k in range(0, i, 3):
        attempt(os.removexattr, p, f"user.k{k}")
    out = [f"grow k1={attempt(os.setxattr, p, 'user.k1', b'g' * 700)}"]
    for k in range(10):
        out.append(f"s{k}:{attempt(os.setxattr, p, f'user.s{k}', b's' * (k * 11 + 1))}")
    print(os.path.basename(p), "after:", " ".join(out))
    names = sorted(os.listxattr(p))
    ok = all(os.getxattr(p, n) for n in names)
    print(os.path.basename(p), f"{len(names)} attributes, values readable: {ok}")


d = sys.argv[1]
with open(os.path.join(d, "file"), "wb") as f:
    f.write(b"x")
os.mkdir(os.path.join(d, "dir"))
fill(os.path.join(d, "file"))
fill(os.path.join(d, "dir"))
