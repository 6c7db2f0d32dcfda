#!/usr/bin/env python3
"""renameat2(RENAME_WHITEOUT) in DIR, printed for comparison with kernel ext2: the file
moves, its old name is left a whiteout (character device 0:0); over an existing target
too; with RENAME_EXCHANGE it is refused."""
import ctypes
import errno
import os
import stat
import sys

libc = ctypes.CDLL(None, use_errno=True)
AT_FDCWD, NOREPLACE, EXCHANGE, WHITEOUT = -100, 1, 2, 4


def renameat2(a, b, flags):
    if libc.renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), flags) != 0:
        e = ctypes.get_errno()
        return errno.errorcode.get(e, str(e))
    return "ok"


def show(p):
    try:
        st = os.lstat(p)
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
    kind = "chr" if stat.S_ISCHR(st.st_mode) else "reg" if stat.S_ISREG(st.st_mode) else "?"
    return f"{kind} mode {oct(stat.S_IMODE(st.st_mode))} rdev {st.st_rdev} nlink {st.st_nlink} uid {st.st_uid} size {st.st_size}"


d = sys.argv[1]
j = lambda n: os.path.join(d, n)
open(j("a"), "w").write("upper file")
print("whiteout rename:", renameat2(j("a"), j("b"), WHITEOUT))
print("a:", show(j("a")))
print("b:", show(j("b")), open(j("b")).read())
open(j("c"), "w").write("c")
open(j("e"), "w").write("replaced")
print("over a target:", renameat2(j("c"), j("e"), WHITEOUT))
print("c:", show(j("c")), "e:", show(j("e")))
print("with exchange:", renameat2(j("b"), j("e"), WHITEOUT | EXCHANGE))
print("with noreplace, target exists:", renameat2(j("b"), j("e"), WHITEOUT | NOREPLACE))
os.mkdir(j("dir"))
print("a directory:", renameat2(j("dir"), j("dir2"), WHITEOUT), show(j("dir")))
print("listing:", sorted(os.listdir(d)))
