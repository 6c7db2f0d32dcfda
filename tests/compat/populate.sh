#!/usr/bin/env bash
# Writes the fixtures' contents into the directory $1 (a mount of the old build). The
# same every time: data comes from a seeded generator, not from the machine.
set -euo pipefail
cd "$1"
gen() { python3 -c "import random,sys; r=random.Random($1); sys.stdout.buffer.write(bytes(r.getrandbits(8) for _ in range($2)))"; }
mkdir -p a/b/c docs empty-dir
printf 'hello, old format\n' > hello.txt
gen 1 65536 > a/b/c/random-64k.bin
gen 2 5000 > a/small.bin
: > a/empty
printf 'tail' | dd of=sparse.bin bs=1 seek=$((3 * 1024 * 1024)) conv=notrunc status=none
for i in $(seq 1 40); do printf 'file %d\n' "$i" > "docs/note-$i.txt"; done
ln -s a/b/c/random-64k.bin link-to-random
ln -s /nowhere dangling
ln hello.txt hard-hello.txt
chmod 0640 a/small.bin
chmod 0700 a/b
setfattr -n user.origin -v quiltfs-0.1.0-3d4f672 hello.txt
mv docs/note-40.txt a/moved-note.txt
rm docs/note-39.txt
python3 -c "import sys; sys.stdout.write(''.join('line %07d of a file larger than a node\\n' % i for i in range(26000)))" > big-text.txt
