#!/usr/bin/env python3
"""Prints a tree's contents, one line per entry, sorted: path, type, mode, link count,
size and a SHA-256 of the data (or a symlink's target), and its user xattrs. Two trees
with the same manifest hold the same files as far as POSIX shows them (times aside)."""
import hashlib
import os
import stat
import sys


def entry(root, rel):
    p = os.path.join(root, rel) if rel else root
    st = os.lstat(p)
    kind = stat.S_IFMT(st.st_mode)
    mode = "%04o" % stat.S_IMODE(st.st_mode)
    if stat.S_ISLNK(st.st_mode):
        what = "link " + os.readlink(p)
    elif stat.S_ISREG(st.st_mode):
        h = hashlib.sha256()
        with open(p, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        what = "file %d %s" % (st.st_size, h.hexdigest())
    elif stat.S_ISDIR(st.st_mode):
        what = "dir"
    else:
        what = "other %o" % kind
    xattrs = ""
    if not stat.S_ISLNK(st.st_mode):
        names = sorted(n for n in os.listxattr(p) if n.startswith("user."))
        xattrs = "".join(" %s=%s" % (n, os.getxattr(p, n).hex()) for n in names)
    nlink = st.st_nlink if not stat.S_ISDIR(st.st_mode) else "-"
    return "%s %s %s %s%s" % (rel or ".", mode, nlink, what, xattrs)


def main():
    root = sys.argv[1]
    lines = [entry(root, "")]
    for d, dirs, files in os.walk(root):
        dirs[:] = [x for x in dirs if x != "lost+found"]
        for name in dirs + files:
            lines.append(entry(root, os.path.relpath(os.path.join(d, name), root)))
    lines[1:] = sorted(lines[1:])
    print("\n".join(lines))


main()
