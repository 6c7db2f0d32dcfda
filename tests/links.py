#!/usr/bin/env python3
"""Hard links to one file in DIR until link(2) fails: prints how many names it got and
the errno (kernel ext2 allows 65,000)."""
import errno
import os
import sys

d = sys.argv[1]
f = os.path.join(d, "f")
open(f, "w").close()
dirs = [os.path.join(d, f"d{i}") for i in range(100)]
for x in dirs:
    os.mkdir(x)
n = 1
while True:
    try:
        os.link(f, os.path.join(dirs[n % 100], f"l{n}"))
    except OSError as e:
        print("links:", os.stat(f).st_nlink, "then", errno.errorcode.get(e.errno, e.errno))
        break
    n += 1
    if n > 70000:
        print("no limit below 70000")
        break
