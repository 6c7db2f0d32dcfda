#!/usr/bin/env python3
"""POSIX ACLs under DIR, printed for comparison with kernel ext2. Run as root, on a mount
other users may enter.

  acl.py setup DIR   makes files and directories and gives them ACLs with setfacl
  acl.py probe DIR   prints every ACL (getfacl) and mode, tries reads and writes as
                     users the ACLs name and do not name, creates files and directories
                     under a default ACL, chmods files with ACLs, removes ACLs

setup and probe may run on different mounts of one image (ACLs set by the kernel,
enforced by quiltfs, and the reverse). With noacl mounts the same script shows ACLs
unsupported and ignored."""
import errno
import os
import subprocess
import sys

from userops import as_user, attempt, name

U1, U2, G = 1234, 1235, 50





def getfacl(p):
    r = subprocess.run(["getfacl", "-cpn", p], capture_output=True, text=True)
    if r.returncode != 0:
        return "getfacl: " + r.stderr.strip().split(":")[-1].strip()
    return ",".join(line for line in r.stdout.splitlines() if line and not line.startswith("#"))


def setfacl(*args):
    r = subprocess.run(["setfacl", *args], capture_output=True, text=True)
    return "ok" if r.returncode == 0 else "setfacl: " + r.stderr.strip().split(":")[-1].strip()




def read(p):
    with open(p, "rb") as f:
        return len(f.read())


def write(p):
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.write(fd, b"w")
    os.close(fd)


def create(p, mode=0o666):
    os.close(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode))


def mode(p):
    try:
        return oct(os.stat(p).st_mode & 0o7777)
    except OSError as e:
        return name(e.errno)


def make(p, m, uid=0, gid=0):
    with open(p, "wb") as f:
        f.write(b"data")
    os.chown(p, uid, gid)
    os.chmod(p, m)


def setup(d):
    j = lambda f: os.path.join(d, f)  # noqa: E731
    os.chmod(d, 0o777)
    make(j("f"), 0o644)
    print("f:", setfacl("-m", f"u:{U1}:---,m::r--", j("f")))
    make(j("g"), 0o640, 0, G)
    print("g:", setfacl("-m", f"u:{U1}:rw-", j("g")))
    make(j("h"), 0o600)
    print("h:", setfacl("-m", f"g:{U1}:r--", j("h")))
    make(j("eq"), 0o600)
    print("eq:", setfacl("-m", "u::rwx,g::r-x,o::r-x", j("eq")))
    make(j("sg"), 0o2775, U1, G)
    print("sg:", as_user(U1, [U1], lambda: print_none(setfacl("-m", f"u:{U2}:r--", j("sg")))))
    os.mkdir(j("d"))
    print("d:", setfacl("-m", f"d:u:{U1}:rwx,d:g::r-x,d:o::---,u:{U1}:rwx", j("d")))
    os.mkdir(j("e"))
    # Larger ACLs: many named entries (spilling out of the inode into the block).
    make(j("many"), 0o640)
    many = ",".join(f"u:{2000 + i}:r--" for i in range(40))
    print("many:", setfacl("-m", many, j("many")))


def print_none(out):
    if out != "ok":
        raise OSError(errno.EPERM, out)


def probe(d):
    j = lambda f: os.path.join(d, f)  # noqa: E731
    for f in ["f", "g", "h", "eq", "sg", "d", "e", "many"]:
        print(f"{f}: {mode(j(f))} {getfacl(j(f))}")
    print("listxattr f:", sorted(os.listxattr(j("f"))))
    print("listxattr eq:", sorted(os.listxattr(j("eq"))))
    for uid, groups in [(U1, [U1]), (U2, [U2]), (U2, [U2, U1]), (3000, [G]), (2005, [2005])]:
        for f in ["f", "g", "h", "many"]:
            print(f"uid {uid} groups {groups}: read {f}: {as_user(uid, groups, read, j(f))}, "
                  f"write {f}: {as_user(uid, groups, write, j(f))}")
    print(f"uid {U1}: create in d: {as_user(U1, [U1], create, j('d/byuser'))}")
    print(f"uid {U2}: create in d: {as_user(U2, [U2], create, j('d/byother'))}")
    # Inheritance: the default ACL replaces the umask.
    old = os.umask(0o077)
    create(j("d/new"), 0o666)
    os.mkdir(j("d/sub"), 0o777)
    create(j("d/sub/deeper"), 0o640)
    os.symlink("new", j("d/link"))
    create(j("e/plain"), 0o666)
    os.umask(old)
    for f in ["d/new", "d/sub", "d/sub/deeper", "d/byuser", "e/plain"]:
        print(f"{f}: {mode(j(f))} {getfacl(j(f))}")
    print("d/link:", oct(os.lstat(j("d/link")).st_mode & 0o777))
    # chmod moves the mask; the named entries stay.
    os.chmod(j("g"), 0o600)
    print(f"g after chmod 600: {mode(j('g'))} {getfacl(j('g'))}")
    print(f"uid {U1}: read g: {as_user(U1, [U1], read, j('g'))}")
    os.chmod(j("g"), 0o660)
    print(f"g after chmod 660: {mode(j('g'))} {getfacl(j('g'))}")
    # Who may set ACLs; bad ones; a default ACL on a file.
    print(f"uid {U2}: setfacl on f: {as_user(U2, [U2], lambda: print_none(setfacl('-m', 'o::rwx', j('f'))))}")
    print("default ACL on a file:", setfacl("-m", "d:u:5:r--", j("f")))
    print("bad ACL:", attempt(os.setxattr, j("f"), "system.posix_acl_access", b"\x02\0\0\0\x01\0\x06\0"))
    print("remove all (setfacl -b f):", setfacl("-b", j("f")), mode(j("f")), getfacl(j("f")))
    print("remove default (setfacl -k d):", setfacl("-k", j("d")), getfacl(j("d")))
    print("remove missing:", attempt(os.removexattr, j("e"), "system.posix_acl_default"))
    print(f"uid {U1}: read f after -b: {as_user(U1, [U1], read, j('f'))}")


if __name__ == "__main__":
    {"setup": setup, "probe": probe}[sys.argv[1]](sys.argv[2])
