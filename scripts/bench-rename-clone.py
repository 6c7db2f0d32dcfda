#!/usr/bin/env python3
"""Rename and clone latency on betrfs against kernel btrfs and xfs (issue 21's goals).

On each system (an 8 GiB image on a loop device for the kernel's, a betrfs image through
the FUSE mount for quiltfs), untimed: untar Debian's linux source, a directory of 10
files, a 1 GiB file, sync. Then, each timed alone, medians of RUNS:

  rename   rename(2) of the linux tree (83,731 entries) and of the 10-file directory,
           back and forth; warm, and cold (remounted, page cache dropped);
  clone    a copy of the linux tree and of the 10-file directory: `quiltfs clone` on
           betrfs, `cp -r --reflink=always` on btrfs and xfs (the command a user runs;
           process start included on both sides);
  file     a clone of the 1 GiB file: `quiltfs clone` and `cp --reflink=always` (with
           libquilt_preload.so on betrfs, which carries FICLONE to the mount);
  write1%  on betrfs, after a sync: every hundredth file of one clone rewritten whole
           (same size, new bytes), then a sync; the bytes the tree copied from shared
           nodes (copy-on-abundant-write) and the bytes the device wrote, against the
           clone's bytes.

  scripts/bench-rename-clone.py [RUNS]      (QUICK=1: a 58 MB subset of the source;
                                             SYSTEMS="betrfs btrfs xfs")
Writes results.csv and report.md under WORK (default /tmp/quiltfs-bench-rename-clone).
"""
import csv
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
Q = os.path.join(ROOT, "target/release/quiltfs")
PRELOAD = os.path.join(ROOT, "target/release/libquilt_preload.so")
RUNS = int(sys.argv[1]) if len(sys.argv) > 1 else 9
WORK = os.environ.get("WORK", "/tmp/quiltfs-bench-rename-clone")
SYSTEMS = os.environ.get("SYSTEMS", "betrfs btrfs xfs").split()
QUICK = os.environ.get("QUICK") == "1"


def sh(*cmd, **kw):
    return subprocess.run(cmd, check=True, **kw)


def out(*cmd):
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def setup():
    need = []
    for pkg, tool in [("btrfs-progs", "mkfs.btrfs"), ("xfsprogs", "mkfs.xfs"), ("bc", "bc")]:
        if subprocess.run(["which", tool], capture_output=True).returncode != 0:
            need.append(pkg)
    if need:
        sh("apt-get", "install", "-y", "-qq", *need, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
           stdout=subprocess.DEVNULL)
    if not (os.path.exists(Q) and os.path.exists(PRELOAD)):
        sh("cargo", "build", "--release", "-q", "-p", "quilt-cli", "-p", "quilt-preload", cwd=ROOT)
    os.makedirs(WORK, exist_ok=True)
    env = {**os.environ, "QUICK": "1" if QUICK else "0"}
    return subprocess.run([os.path.join(ROOT, "scripts/linux-tarball.sh"), WORK], check=True,
                          capture_output=True, text=True, env=env).stdout.strip()


def drop_caches():
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class System:
    def __init__(self, name):
        self.name = name
        self.img = os.path.join(WORK, f"{name}.img")
        self.m = os.path.join(WORK, "m")
        os.makedirs(self.m, exist_ok=True)

    def mkfs(self):
        if os.path.exists(self.img):
            os.remove(self.img)
        with open(self.img, "wb") as f:
            f.truncate(8 << 30)
        if self.name == "betrfs":
            sh(Q, "mkfs", "--fs", "betrfs", self.img, "--force", stdout=subprocess.DEVNULL)
        elif self.name == "btrfs":
            sh("mkfs.btrfs", "-q", "-f", self.img)
        elif self.name == "xfs":
            sh("mkfs.xfs", "-q", "-f", "-m", "reflink=1", self.img)

    def mount(self):
        if self.name == "betrfs":
            sh(Q, "mount", self.img, self.m, stdout=subprocess.DEVNULL)
        else:
            sh("mount", "-o", "loop", self.img, self.m)

    def umount(self):
        if self.name == "betrfs":
            sh(Q, "umount", self.m, stdout=subprocess.DEVNULL)
        else:
            sh("umount", self.m)

    def sync(self):
        if self.name == "betrfs":
            sh(Q, "sync", self.m)
        else:
            os.sync()

    def clone_cmd(self, src, dst, preload=False):
        if self.name == "betrfs" and not preload:
            return [Q, "clone", src, dst]
        return ["cp", "-r", "--reflink=always", src, dst]

    def stats(self):
        if self.name != "betrfs":
            return {}
        s = {}
        for line in out(Q, "stats", self.m).splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1].isdigit():
                s[parts[0]] = int(parts[1])
        return s


def timed_call(f):
    t = time.perf_counter()
    f()
    return (time.perf_counter() - t) * 1e3


rows = []


def record(system, phase, what, ms):
    rows.append({"system": system, "phase": phase, "what": what, "ms": f"{ms:.3f}"})


def med(system, phase, what):
    xs = [float(r["ms"]) for r in rows if (r["system"], r["phase"], r["what"]) == (system, phase, what)]
    return statistics.median(xs) if xs else None


def run_system(s, tarball):
    print(f"bench: {s.name}: untar, 10 files, 1 GiB file (untimed)", flush=True)
    s.mkfs()
    s.mount()
    sh("tar", "xf", tarball, "-C", s.m)
    big = [d for d in os.listdir(s.m) if d.startswith("linux")][0]
    os.makedirs(os.path.join(s.m, "small"))
    for i in range(10):
        with open(os.path.join(s.m, "small", f"f{i}"), "wb") as f:
            f.write(os.urandom(3000))
    os.makedirs(os.path.join(s.m, "into"))
    gib = os.path.join(s.m, "gib")
    sh("dd", "if=/dev/urandom", f"of={gib}", "bs=1M", f"count={64 if QUICK else 1024}",
       "status=none")
    s.sync()
    entries = int(out("sh", "-c", f"find '{s.m}/{big}' | wc -l"))
    print(f"bench: {s.name}: {entries} entries under {big}", flush=True)
    for temp in ["warm", "cold"]:
        if temp == "cold":
            s.umount()
            s.mount()
            drop_caches()
        for name in [big, "small"]:
            a, b = os.path.join(s.m, name), os.path.join(s.m, "into", name)
            for _ in range(RUNS):
                record(s.name, f"rename-{temp}", name, timed_call(lambda: os.rename(a, b)))
                record(s.name, f"rename-{temp}", name, timed_call(lambda: os.rename(b, a)))
        for name in [big, "small"]:
            for i in range(RUNS):
                dst = os.path.join(s.m, f"{name}.{temp}{i}")
                cmd = s.clone_cmd(os.path.join(s.m, name), dst)
                record(s.name, f"clone-{temp}", name, timed_call(lambda: sh(*cmd)))
        for i in range(RUNS):
            for how in (["ioctl", "cp"] if s.name == "betrfs" else ["cp"]):
                dst = os.path.join(s.m, f"gib.{temp}.{how}{i}")
                cmd = s.clone_cmd(gib, dst, preload=(how == "cp"))
                env = {**os.environ, "LD_PRELOAD": PRELOAD} if how == "cp" and s.name == "betrfs" else None
                record(s.name, f"file-{temp}", f"1GiB-{how}",
                       timed_call(lambda: sh(*cmd, env=env)))
        for phase, label in [(f"rename-{temp}", "rename"), (f"clone-{temp}", "clone")]:
            print(f"bench: {s.name:6} {temp} {label:6} linux {med(s.name, phase, big):9.3f} ms"
                  f"   small {med(s.name, phase, 'small'):8.3f} ms", flush=True)
        for how in (["ioctl", "cp"] if s.name == "betrfs" else ["cp"]):
            print(f"bench: {s.name:6} {temp} 1 GiB file clone ({how}) "
                  f"{med(s.name, f'file-{temp}', f'1GiB-{how}'):8.3f} ms", flush=True)
    result = {"entries": entries, "big": big}
    if s.name == "betrfs":
        result.update(write_one_percent(s, big))
        s.umount()
        t = time.perf_counter()
        fsck = subprocess.run([Q, "fsck", "-n", s.img], capture_output=True, text=True)
        said = (fsck.stdout.strip() + " " + fsck.stderr.strip()).strip()
        result["fsck"] = (f"exit {fsck.returncode} in {time.perf_counter() - t:.0f} s "
                          f"(the image holds the tree and {2 * RUNS + 1} clones of it): {said}")
        print(f"bench: betrfs fsck: {result['fsck']}", flush=True)
    else:
        s.umount()
    os.remove(s.img)
    return result


def write_one_percent(s, big):
    clone = os.path.join(s.m, f"{big}.cold0")
    files = []
    for d, _, names in os.walk(clone):
        files.extend(os.path.join(d, n) for n in sorted(names))
    files.sort()
    total = 0
    for f in files:
        st = os.lstat(f)
        if not os.path.islink(f):
            total += st.st_size
    s.sync()
    before = s.stats()
    chosen = [f for f in files[::100] if not os.path.islink(f)]
    written = 0
    for f in chosen:
        n = os.path.getsize(f)
        with open(f, "r+b") as h:
            h.write(os.urandom(n))
        written += n
    s.sync()
    after = s.stats()
    d = {k: after.get(k, 0) - before.get(k, 0) for k in
         ["tree.cow_bytes", "tree.cow_copies", "tree.device_bytes_written"]}
    r = {
        "clone_bytes": total,
        "files": len(files),
        "rewritten": len(chosen),
        "rewritten_bytes": written,
        "cow_bytes": d["tree.cow_bytes"],
        "cow_copies": d["tree.cow_copies"],
        "device_bytes": d["tree.device_bytes_written"],
    }
    print(f"bench: betrfs 1% of the clone's files rewritten ({len(chosen)} of {len(files)}, "
          f"{written / 1e6:.1f} MB of {total / 1e6:.1f} MB): copied {r['cow_bytes'] / 1e6:.1f} MB "
          f"({100 * r['cow_bytes'] / max(total, 1):.2f}% of the clone) in {r['cow_copies']} node copies; "
          f"the device wrote {r['device_bytes'] / 1e6:.1f} MB "
          f"({100 * r['device_bytes'] / max(total, 1):.2f}%)", flush=True)
    return r


def main():
    tarball = setup()
    results = {}
    for name in SYSTEMS:
        results[name] = run_system(System(name), tarball)
    with open(os.path.join(WORK, "results.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=["system", "phase", "what", "ms"])
        w.writeheader()
        w.writerows(rows)
    lines = ["# Rename and clone latency", "",
             f"Medians of {RUNS} (renames: {2 * RUNS}, back and forth); milliseconds; "
             f"{'the 58 MB subset' if QUICK else 'the full linux source'}.", "",
             "| system | phase | linux tree | 10 files | ratio | 1 GiB file |", "|---|---|---|---|---|---|"]
    for name in SYSTEMS:
        big = results[name]["big"]
        for phase in ["rename-warm", "rename-cold", "clone-warm", "clone-cold"]:
            a, b = med(name, phase, big), med(name, phase, "small")
            temp = phase.split("-")[1]
            fl = med(name, f"file-{temp}", "1GiB-cp") if phase.startswith("clone") else None
            io = med(name, f"file-{temp}", "1GiB-ioctl") if phase.startswith("clone") else None
            fs = "" if fl is None else (f"{fl:.3f} (cp)" + (f", {io:.3f} (ioctl)" if io else ""))
            lines.append(f"| {name} | {phase} | {a:.3f} | {b:.3f} | {a / b:.2f} | {fs} |")
    lines.append("")
    goals = []
    if "betrfs" in results:
        big = results["betrfs"]["big"]
        for temp in ["warm", "cold"]:
            r, rs = med("betrfs", f"rename-{temp}", big), med("betrfs", f"rename-{temp}", "small")
            goals.append(f"- rename of the linux tree ({temp}): {r:.3f} ms (goal ≤ 10 ms: "
                         f"{'met' if r <= 10 else 'missed'}), {r / rs:.2f}× the 10-file directory "
                         f"(goal ≤ 2×: {'met' if r <= 2 * rs else 'missed'})")
            c = med("betrfs", f"clone-{temp}", big)
            peers = [(p, med(p, f"clone-{temp}", results[p]["big"])) for p in SYSTEMS if p != "betrfs"]
            line = f"- clone of the linux tree ({temp}): {c:.1f} ms (goal ≤ 1 s: {'met' if c <= 1000 else 'missed'})"
            for p, v in peers:
                line += f"; {v / c:.1f}× faster than cp -r --reflink on {p} ({v:.0f} ms)"
            if peers:
                best = min(v for _, v in peers)
                line += f" (goal ≥ 5×: {'met' if best >= 5 * c else 'missed'})"
            goals.append(line)
            f = med("betrfs", f"file-{temp}", "1GiB-ioctl")
            goals.append(f"- clone of a 1 GiB file ({temp}): {f:.3f} ms through the ioctl, "
                         f"{med('betrfs', f'file-{temp}', '1GiB-cp'):.3f} ms with cp --reflink "
                         f"(goal ≤ 10 ms: {'met' if f <= 10 else 'missed'})")
        w = results["betrfs"]
        pct = 100 * w["cow_bytes"] / max(w["clone_bytes"], 1)
        goals.append(f"- writing 1% of a clone's files ({w['rewritten']} of {w['files']}, "
                     f"{w['rewritten_bytes'] / 1e6:.1f} MB): {w['cow_bytes'] / 1e6:.1f} MB copied from shared "
                     f"nodes, {pct:.2f}% of the clone's {w['clone_bytes'] / 1e6:.0f} MB (goal < 5%: "
                     f"{'met' if pct < 5 else 'missed'}); the device wrote {w['device_bytes'] / 1e6:.1f} MB "
                     f"in all (log, copies, rewritten nodes)")
        goals.append(f"- quiltfs fsck after the run: {w['fsck']}")
    lines += ["## Goals", ""] + goals
    report = "\n".join(lines) + "\n"
    with open(os.path.join(WORK, "report.md"), "w") as f:
        f.write(report)
    print(report)


if __name__ == "__main__":
    main()
