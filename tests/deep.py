#!/usr/bin/env python3
"""Deep trees through a mount, every step relative to a directory descriptor as a
program working below PATH_MAX does: chains of directories until the full path passes
4,095, 4,096, 8,000 and 30,000 bytes; files, hard links, symlinks and 255-byte names at
the bottom; renames that make the paths below them cross those lengths (a top directory
renamed to 255 bytes, a deep subtree moved under another deep one and back, an exchange
of two deep trees). Prints one JSON document: each operation's result (ok or the errno's
name) and the tree as a walk by descriptors sees it (relative path, kind, size, a hash of
the contents), for comparison with the same run on another file system.

usage: deep.py ROOT
"""
import ctypes
import errno
import hashlib
import json
import os
import stat
import sys

log = []


def step(what, fn):
    try:
        r = fn()
        log.append([what, "ok"])
        return r
    except OSError as e:
        log.append([what, errno.errorcode.get(e.errno, str(e.errno))])
        return None


def opendir(name, dir_fd):
    return os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=dir_fd)


def nest(fd, name, until, path_len):
    """mkdir name in fd, again and again below it, until the path passes `until`
    bytes; returns the bottom's descriptor and the path length."""
    while path_len < until:
        step(f"mkdir {len(name)} at {path_len}", lambda: os.mkdir(name, dir_fd=fd))
        nfd = opendir(name, fd)
        os.close(fd)
        fd = nfd
        path_len += 1 + len(name)
    return fd, path_len


def renameat2(olddirfd, old, newdirfd, new, flags):
    libc = ctypes.CDLL(None, use_errno=True)
    r = libc.renameat2(olddirfd, old.encode(), newdirfd, new.encode(), flags)
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


def walk(root_fd):
    out = []
    stack = [(os.dup(root_fd), "")]
    while stack:
        fd, path = stack.pop()
        names = sorted(os.listdir(fd))
        for n in names:
            p = f"{path}/{n}"
            st = os.stat(n, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                out.append([p, "dir", st.st_nlink])
                stack.append((opendir(n, fd), p))
            elif stat.S_ISLNK(st.st_mode):
                out.append([p, "symlink", os.readlink(n, dir_fd=fd)])
            else:
                f = os.open(n, os.O_RDONLY, dir_fd=fd)
                data = os.read(f, 1 << 20)
                os.close(f)
                out.append([p, "file", st.st_nlink, st.st_size,
                            hashlib.sha256(data).hexdigest()[:16]])
        os.close(fd)
    return sorted(out)


def main():
    root = sys.argv[1]
    rfd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    base = len(root)
    bottoms = {}
    for i, length in enumerate([4095, 4096, 8000, 30000]):
        top = f"t{i}"
        step(f"mkdir {top}", lambda: os.mkdir(top, dir_fd=rfd))
        fd = opendir(top, rfd)
        fd, plen = nest(fd, "n" * (100 + i * 37), base + length - 300, base + 1 + len(top))
        fd, plen = nest(fd, "x", base + length, plen)
        def make(fd=fd, length=length):
            f = os.open("file", os.O_CREAT | os.O_WRONLY, 0o644, dir_fd=fd)
            os.write(f, f"at {length}".encode())
            os.close(f)
        step(f"create at {plen}", make)
        step("link", lambda: os.link("file", "hard", src_dir_fd=fd, dst_dir_fd=fd))
        step("symlink", lambda: os.symlink("../" * 3 + "y" * 200, "sym", dir_fd=fd))
        step("mkdir 255", lambda: os.mkdir("L" * 255, dir_fd=fd))
        step("mkdir 256", lambda: os.mkdir("L" * 256, dir_fd=fd))
        step("rename at the bottom", lambda: os.rename("file", "renamed", src_dir_fd=fd, dst_dir_fd=fd))
        bottoms[i] = fd
    # A top directory renamed to 255 bytes: every path below grows by 253.
    step("rename t0 to 255", lambda: os.rename("t0", "R" * 255, src_dir_fd=rfd, dst_dir_fd=rfd))
    # A deep subtree (below t1) moved under the bottom of t2, and back under t1.
    t1 = opendir("t1", rfd)
    first = "n" * 137
    step("move deep under deep", lambda: os.rename(first, "moved", src_dir_fd=t1, dst_dir_fd=bottoms[2]))
    step("move back", lambda: os.rename("moved", "back", src_dir_fd=bottoms[2], dst_dir_fd=t1))
    # An exchange of two deep trees.
    step("exchange t1 and t3", lambda: renameat2(rfd, "t1", rfd, "t3", 2))
    # A directory moved into its own subtree, through zones: refused.
    step("t3 into its own bottom", lambda: os.rename("t3", "loop", src_dir_fd=rfd, dst_dir_fd=bottoms[1]))
    tree = walk(rfd)
    for fd in bottoms.values():
        os.close(fd)
    os.close(t1)
    print(json.dumps({"ops": log, "tree": tree}))


main()
