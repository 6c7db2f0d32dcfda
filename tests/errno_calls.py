#!/usr/bin/env python3
"""Seeded random POSIX calls in DIR, each printed with its result ("ok", "ok VALUE" or
the errno's name), then the tree they left: run on a kernel mount and on a quiltfs
mount, the two outputs must be equal line for line (the kernel is the oracle).

Names come from a small pool three levels deep, so calls collide: creates over
existing names, renames onto files, directories and their own children, links of
directories, removals of full directories, symlink loops, opens of the wrong kind.
Usage: errno_calls.py DIR SEED CALLS"""
import ctypes
import hashlib
import os
import random
import stat
import sys

from userops import attempt

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD = -100
NOREPLACE, EXCHANGE = 1, 2


def renameat2(a, b, flags):
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def kind(m):
    for k, f in (("dir", stat.S_ISDIR), ("file", stat.S_ISREG), ("link", stat.S_ISLNK)):
        if f(m):
            return k
    return "other"


def describe(st):
    return f"{kind(st.st_mode)} {stat.S_IMODE(st.st_mode):o} n{st.st_nlink} " + (
        f"s{st.st_size}" if not stat.S_ISDIR(st.st_mode) else "")


def create(p, mode):
    os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode))


def write(p, data):
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)


def append(p, data):
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    try:
        return os.write(fd, data)
    finally:
        os.close(fd)


def read(p):
    fd = os.open(p, os.O_RDONLY)
    try:
        b = b""
        while True:
            part = os.read(fd, 1 << 16)
            if not part:
                break
            b += part
        return f"{len(b)} {hashlib.sha1(b).hexdigest()[:12]}"
    finally:
        os.close(fd)


def open_dir(p):
    os.close(os.open(p, os.O_RDONLY | os.O_DIRECTORY))


def open_write(p):
    os.close(os.open(p, os.O_WRONLY))


def listing(p):
    return " ".join(sorted(os.listdir(p)))


def main():
    root, seed, calls = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    rng = random.Random(seed)
    parts = ["a", "b", "c"]
    pool = [x for x in parts] + [f"{x}/{y}" for x in parts for y in parts]
    pool += [f"{x}/{y}/{z}" for x in parts for y in parts[:2] for z in parts[:2]]

    def path():
        return os.path.join(root, rng.choice(pool))

    def target():
        return rng.choice(["a", "b", "a/../c", "c/b", "nowhere", "self"])

    ops = [
        ("mkdir", 6, lambda: (os.mkdir, path(), rng.choice([0o755, 0o700]))),
        ("rmdir", 3, lambda: (os.rmdir, path())),
        ("create", 5, lambda: (create, path(), 0o644)),
        ("write", 4, lambda: (write, path(), rng.randbytes(rng.choice([0, 5, 4096, 9000])))),
        ("append", 2, lambda: (append, path(), b"more")),
        ("read", 3, lambda: (read, path())),
        ("unlink", 3, lambda: (os.unlink, path())),
        ("rename", 5, lambda: (os.rename, path(), path())),
        ("noreplace", 2, lambda: (renameat2, path(), path(), NOREPLACE)),
        ("exchange", 2, lambda: (renameat2, path(), path(), EXCHANGE)),
        ("link", 3, lambda: (os.link, path(), path())),
        ("symlink", 2, lambda: (os.symlink, target(), path())),
        ("readlink", 1, lambda: (os.readlink, path())),
        ("truncate", 2, lambda: (os.truncate, path(), rng.choice([0, 3, 70000]))),
        ("chmod", 2, lambda: (os.chmod, path(), rng.choice([0o600, 0o755, 0o4755]))),
        ("lstat", 4, lambda: (lambda p: describe(os.lstat(p)), path())),
        ("stat", 2, lambda: (lambda p: describe(os.stat(p)), path())),
        ("list", 3, lambda: (listing, path())),
        ("opendir", 1, lambda: (open_dir, path())),
        ("openwrite", 1, lambda: (open_write, path())),
        ("setxattr", 1, lambda: (os.setxattr, path(), "user.q", b"v", rng.choice([0, 1, 2]))),
        ("getxattr", 1, lambda: (os.getxattr, path(), "user.q")),
        ("removexattr", 1, lambda: (os.removexattr, path(), "user.q")),
    ]
    weights = [w for _, w, _ in ops]
    for i in range(calls):
        name, _, make = rng.choices(ops, weights)[0]
        f, *args = make()
        shown = " ".join(
            os.path.relpath(a, root) if isinstance(a, str) and a.startswith(root)
            else f"<{len(a)} bytes>" if isinstance(a, bytes) else str(a)
            for a in args)
        print(f"{i} {name} {shown}: {attempt(f, *args)}")
    # The tree the calls left.
    for d, dirs, files in os.walk(root):
        dirs.sort()
        for n in sorted(dirs + files):
            p = os.path.join(d, n)
            st = os.lstat(p)
            extra = ""
            if stat.S_ISREG(st.st_mode):
                extra = read(p)
            elif stat.S_ISLNK(st.st_mode):
                extra = os.readlink(p)
            print(f"tree {os.path.relpath(p, root)}: {describe(st)} {extra}")


if __name__ == "__main__":
    main()
