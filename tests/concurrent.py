#!/usr/bin/env python3
"""Concurrent creates, writes, renames over existing names, links and unlinks in one
directory from several processes (issue 18: requests now run on several CPUs at once).

Usage: concurrent.py DIR PROCS ROUNDS. Each process writes files whose content names
the writer and the round, renames them over a few shared names, links and unlinks;
afterwards every surviving file must hold one writer's complete content (a rename is
atomic: never a mix, never a torn file), and exactly the names the processes left."""
import os
import sys
from multiprocessing import Process

SHARED = 5


def content(p, j):
    line = f"writer {p} round {j}\n".encode()
    return line * (50 + (p * 7 + j) % 400)


def worker(d, p, rounds):
    for j in range(rounds):
        tmp = os.path.join(d, f"tmp.{p}.{j}")
        with open(tmp, "wb") as f:
            f.write(content(p, j))
        if j % 3 == 0:
            os.link(tmp, os.path.join(d, f"keep.{p}.{j}"))
        os.rename(tmp, os.path.join(d, f"shared.{j % SHARED}"))
        if j % 4 == 1:
            sub = os.path.join(d, f"dir.{p}.{j}")
            os.mkdir(sub)
            open(os.path.join(sub, "x"), "wb").close()
            os.unlink(os.path.join(sub, "x"))
            os.rmdir(sub)
        if unlinked_in(j - 2, rounds) and j >= 2:
            os.unlink(os.path.join(d, f"keep.{p}.{j - 2}"))


def unlinked_in(j, rounds):
    """Whether keep.P.J (made in round J) is unlinked again, two rounds later."""
    return j >= 0 and j % 3 == 0 and j % 5 == 0 and j + 2 < rounds


def valid(data):
    if not data:
        return False
    first = data.split(b"\n", 1)[0]
    parts = first.split()
    if len(parts) != 4:
        return False
    p, j = int(parts[1]), int(parts[3])
    return data == content(p, j)


def main():
    d, procs, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    d = os.path.join(d, "work")
    os.mkdir(d)
    ps = [Process(target=worker, args=(d, p, rounds)) for p in range(procs)]
    for x in ps:
        x.start()
    for x in ps:
        x.join()
        if x.exitcode != 0:
            sys.exit(f"concurrent: a worker failed (exit {x.exitcode})")
    names = sorted(os.listdir(d))
    want = {f"shared.{k}" for k in range(min(SHARED, rounds))}
    want |= {f"keep.{p}.{j}" for p in range(procs) for j in range(0, rounds, 3)
             if not unlinked_in(j, rounds)}
    if set(names) != want:
        sys.exit(f"concurrent: names differ: extra {sorted(set(names) - want)[:5]}, "
                 f"missing {sorted(want - set(names))[:5]}")
    by_ino = {}
    for n in names:
        with open(os.path.join(d, n), "rb") as f:
            if not valid(f.read()):
                sys.exit(f"concurrent: {n} holds no writer's complete content")
        st = os.stat(os.path.join(d, n))
        by_ino.setdefault(st.st_ino, []).append((n, st.st_nlink))
    # Every file's link count is the number of its names (all live in this directory).
    for ino, ns in by_ino.items():
        if any(nl != len(ns) for _, nl in ns):
            sys.exit(f"concurrent: inode {ino} has names {ns}: link count differs")
    print(f"concurrent: {procs} processes x {rounds} rounds, {len(names)} names, all whole")


if __name__ == "__main__":
    main()
