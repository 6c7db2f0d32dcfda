#!/usr/bin/env bash
# Builds a tree exercising every operation the ext2 module offers, under $1.
set -euo pipefail
r="$1"
cd "$r"
mkdir -p d1/d2/d3 d4 "spaced name" empty
# Files of awkward sizes, and holes.
: > zero
head -c 1 /dev/urandom > one
head -c 4095 /dev/urandom > b4095
head -c 4096 /dev/urandom > b4096
head -c 4097 /dev/urandom > b4097
head -c $((1024 * 1024 + 3)) /dev/urandom > d1/mib
head -c $((20 * 1024 * 1024)) /dev/urandom > d1/d2/big
dd if=/dev/urandom of=holes bs=4096 seek=3 count=2 status=none
dd if=/dev/urandom of=holes bs=4096 seek=1100 count=1 conv=notrunc status=none
# A 5 GiB sparse file with data past 4 GiB (double/triple-indirect territory).
truncate -s 5G sparse5g
echo "at 4GiB" | dd of=sparse5g bs=1 seek=$((4 * 1024 * 1024 * 1024 + 7)) conv=notrunc status=none
echo "at the end" >> sparse5g
# Overwrite in the middle, extend, shrink.
printf 'MIDDLE' | dd of=b4097 bs=1 seek=2000 conv=notrunc status=none
truncate -s 10000 one
head -c 300000 /dev/urandom > shrink && truncate -s 5000 shrink
# Links of every kind.
ln b4096 d4/hard1
ln b4096 d1/d2/hard2
ln -s b4096 fastlink
ln -s "$(printf 'd1/%.0s' $(seq 1 40))target" slowlink
mkfifo fifo
mknod cdev c 4 64
mknod bdev b 7 200
python3 -c 'import socket; s=socket.socket(socket.AF_UNIX); s.bind("sock")'
# Owners, modes, xattrs.
chmod 0640 b4095; chmod 4755 one; chmod 1777 empty
chown 1234:5678 b4097; chown 42:43 d4
setfattr -n user.color -v blue b4096
setfattr -n user.empty -v "" one
setfattr -n user.big -v "$(head -c 1500 /dev/zero | tr '\0' x)" d1
setfattr -n user.gone -v x b4095 && setfattr -x user.gone b4095
# A directory over several blocks, half of it removed again.
mkdir many
for i in $(seq 1 600); do echo "$i" > "many/file-with-a-longish-name-$i"; done
for i in $(seq 1 2 600); do rm "many/file-with-a-longish-name-$i"; done
# Renames: file, over a file, directory across parents, exchange by moves.
echo a > ra; echo b > rb
mv ra rb
mv d1/d2/d3 d4/d3moved
mv d4/d3moved d4/d3final
echo x > d4/d3final/inside
mkdir victim && mv empty victim2 && rmdir victim
mv "spaced name" d1/
# Deletions.
echo bye > gone && rm gone
mkdir -p rmtree/a/b && echo x > rmtree/a/b/c && rm -rf rmtree
sync
