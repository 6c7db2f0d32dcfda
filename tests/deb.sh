#!/usr/bin/env bash
# The Debian package as an administrator meets it, on this machine:
#  1. scripts/deb.sh builds it; lintian finds no error and no warning (info tags are
#     explained in packaging/debian/lintian-overrides).
#  2. apt installs an older build, then upgrades to this one; `quiltfs --version` names
#     this commit; man pages (a subcommand's, the mount options', the formats', a mount
#     helper's) and bash completion work; `mount -t fuse.quiltfs` and umount(8) go
#     through the package's helpers to its binary; a C program builds against the
#     patchgroup library through pkg-config.
#  3. The service units pass `systemd-analyze verify`. No systemd runs here (PID 1 is
#     not systemd), so each unit's own ExecStart is run as the unit would: the replica
#     and namespace servers as an unprivileged user (their units use DynamicUser) with
#     the secret as a credential file, scraped on their Prometheus endpoints, and
#     stopped with SIGTERM; the mount unit's ExecStart and ExecStop as root.
#  4. apt purge leaves the file system as it was before the install.
# Needs root. Usage: tests/deb.sh [QUILTFS_BINARY] (the binary is only used to find
# its build directory, target/release by default; the package is made from it).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$here/.."
build_dir="$(cd "$(dirname "${1:-$root/target/release/quiltfs}")" && pwd)"
work="$(mktemp -d /tmp/quiltfs-deb.XXXXXX)"
chmod 755 "$work"
m="$work/m"; mkdir -p "$m"
pids=()
helpers=(/usr/sbin/mount.fuse.quiltfs /usr/sbin/umount.fuse.quiltfs /usr/sbin/umount.fuseblk.quiltfs)
declare -A saved=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${pids[@]}"; do wait "$p" 2>/dev/null || true; done
  for d in "$m" "$work/srv/q"; do
    mountpoint -q "$d" && { umount "$d" 2>/dev/null || umount -l "$d" || true; }
  done
  if dpkg -s quiltfs >/dev/null 2>&1; then
    DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq quiltfs >/dev/null 2>&1 || true
  fi
  # scripts/setup.sh's helpers (to /usr/local/bin/quiltfs), put back as they were.
  for h in "${!saved[@]}"; do ln -sfn "${saved[$h]}" "$h"; done
  rm -rf "$work"
}
trap cleanup EXIT
fail() { echo "deb: FAIL: $*" >&2; exit 1; }
need=()
# (systemd for systemd-analyze, procps for pgrep, util-linux for setpriv.)
for p in lintian man-db bash-completion pkgconf gcc systemd procps util-linux; do
  dpkg -s "$p" >/dev/null 2>&1 || need+=("$p")
done
if [ ${#need[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

echo "deb: 1. build and lintian"
"$root/scripts/deb.sh" --no-build --from "$build_dir" --version 0.1.0~prev1 >/dev/null
"$root/scripts/deb.sh" --no-build --from "$build_dir"
version="$(sed -n 's/^version = "\(.*\)"$/\1/p' "$root/Cargo.toml" | head -1)"
old="$root/target/debian/quiltfs_0.1.0~prev1_amd64.deb"
new="$root/target/debian/quiltfs_${version}_amd64.deb"
cp "$old" "$new" "$work/"
lintian --fail-on error,warning "$new" >"$work/lintian.log" 2>&1 \
  || fail "lintian: $(grep -v 'root privileges' "$work/lintian.log")"

# The machine as it was, less what apt and systemd keep of their own.
snapshot() {
  find /usr /etc /lib /opt /var/lib -xdev \
    \( -path /var/lib/dpkg -o -path /var/lib/apt -o -path /var/lib/systemd \
       -o -path /var/lib/ucf -o -path /etc/ld.so.cache -o -path /var/lib/man-db \
       -o -path /usr/local \) -prune -o -print 2>/dev/null | sort
}
for h in "${helpers[@]}"; do
  if [ -L "$h" ]; then saved[$h]="$(readlink "$h")"; rm -f "$h"; fi
done
snapshot > "$work/before"

echo "deb: 2. install, upgrade, and what it installed"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$work/$(basename "$old")" >/dev/null
[ "$(dpkg-query -W -f='${Version}' quiltfs)" = 0.1.0~prev1 ] || fail "the older package is not installed"
DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$work/$(basename "$new")" >/dev/null
[ "$(dpkg-query -W -f='${Version}' quiltfs)" = "$version" ] || fail "the upgrade did not take"
commit="$(git -C "$root" rev-parse --short=12 HEAD)"
v="$(/usr/bin/quiltfs --version)"
grep -q "^quiltfs $version (commit $commit" <<<"$v" || fail "--version says: $v (commit $commit expected)"
# Only the package's pages (scripts/setup.sh puts copies under /usr/local).
export MANPATH=/usr/share/man
[ "$(man -w quiltfs-mount)" = /usr/share/man/man1/quiltfs-mount.1.gz ] || fail "man -w quiltfs-mount: $(man -w quiltfs-mount 2>&1)"
MANWIDTH=200 man quiltfs-mount 2>/dev/null | grep -q -- '--foreground' || fail "man quiltfs-mount has no options"
MANWIDTH=200 man quiltfs-mount-options 2>/dev/null | grep -q 'dirty_mib=N' || fail "man quiltfs-mount-options"
MANWIDTH=200 man quiltfs-formats 2>/dev/null | grep -qi 'betrfs' || fail "man quiltfs-formats"
MANWIDTH=200 man quiltfs-replica-serve 2>/dev/null | grep -q -- '--metrics' || fail "man quiltfs-replica-serve"
MANWIDTH=200 man mount.fuse.quiltfs 2>/dev/null | grep -q 'quiltfs mount' || fail "man mount.fuse.quiltfs"
MANWIDTH=200 man quiltfs-bench-featherstitch 2>/dev/null | grep -q -- '--quick' || fail "man quiltfs-bench-featherstitch"
words="$(bash -c 'source /usr/share/bash-completion/bash_completion 2>/dev/null
  source /usr/share/bash-completion/completions/quiltfs
  COMP_WORDS=(quiltfs mou); COMP_CWORD=1; COMP_LINE="quiltfs mou"; COMP_POINT=${#COMP_LINE}
  _quiltfs quiltfs mou quiltfs; printf "%s\n" "${COMPREPLY[@]}"')"
grep -qx mount <<<"$words" || fail "bash completion of 'quiltfs mou': $words"
words="$(bash -c 'source /usr/share/bash-completion/completions/quiltfs
  COMP_WORDS=(quiltfs mds policy s); COMP_CWORD=3; COMP_LINE="quiltfs mds policy s"; COMP_POINT=${#COMP_LINE}
  _quiltfs quiltfs s policy; printf "%s\n" "${COMPREPLY[@]}"')"
grep -qx set <<<"$words" && grep -qx show <<<"$words" || fail "bash completion of 'quiltfs mds policy s': $words"
for f in /usr/share/zsh/vendor-completions/_quiltfs /usr/share/fish/vendor_completions.d/quiltfs.fish; do
  grep -q quiltfs "$f" || fail "$f"
done
# mount(8) and umount(8) through the package's helpers.
/usr/bin/quiltfs mkfs "$work/disk.img" --size 64M >/dev/null
mount -t fuse.quiltfs "$work/disk.img" "$m" -o mode=async
pid="$(pgrep -n -f "mount $work/disk.img")" || fail "no server for the mount"
[ "$(readlink "/proc/$pid/exe")" = /usr/bin/quiltfs ] || fail "the server runs $(readlink "/proc/$pid/exe")"
printf 'through the package\n' > "$m/f"
# The patchgroup library through pkg-config: the C example builds against the package
# and orders a rename on this mount.
cc -Wall -Werror $(pkg-config --cflags quiltfs-pg) "$root/crates/interfaces/pg/examples/ordered_rename.c" \
  $(pkg-config --libs quiltfs-pg) -o "$work/ordered_rename" || fail "the C example does not build against the package"
out="$("$work/ordered_rename" "$m")" || fail "the C example failed: $out"
grep -q '^refused as expected' <<<"$out" || fail "the C example: $out"
umount "$m"
[ ! -e "/proc/$pid" ] || grep -q '^State:.*Z' "/proc/$pid/status" || fail "umount returned before the server ended"
e2fsck -fn "$work/disk.img" >/dev/null 2>&1 || fail "e2fsck after the mount"

echo "deb: 3. the service units"
for u in quiltfs-replica@0.service quiltfs-mds@main.service quiltfs-mount@srv-q.service; do
  out="$(systemd-analyze verify "$u" 2>&1)" || fail "systemd-analyze verify $u: $out"
  [ -z "$out" ] || fail "systemd-analyze verify $u says: $out"
done
# A unit's ExecStart with its specifiers and variables filled in as systemd would.
exec_of() { # UNIT KEY INSTANCE CREDENTIALS_DIR
  local line
  line="$(sed -n "s/^$2=//p" "/lib/systemd/system/$1")"
  line="${line//%d/$4}"; line="${line//%f//$3}"; line="${line//%i/$3}"
  printf '%s\n' "$line"
}
without() { # WORD ARGS...: ARGS less every WORD, into the array `cmd`
  local w="$1" a; shift; cmd=()
  for a in "$@"; do [ "$a" = "$w" ] || cmd+=("$a"); done
}
port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
scrape() { # PORT: the metrics text (empty while it does not answer)
  python3 - "$1" <<'PY' 2>/dev/null || true
import sys, urllib.request
print(urllib.request.urlopen("http://127.0.0.1:%s/metrics" % sys.argv[1], timeout=2).read().decode())
PY
}
as_nobody() { setpriv --reuid=nobody --regid=nogroup --clear-groups --no-new-privs "$@"; }
creds="$work/creds"; mkdir -p "$creds"
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$creds/secret"
chown nobody "$creds/secret"; chmod 400 "$creds/secret"
# The namespace service, as the unit runs it.
state="$work/mds"; mkdir -p "$state"
/usr/bin/quiltfs mkfs "$state/namespace.img" --fs betrfs --size 64M >/dev/null
chown -R nobody:nogroup "$state"
mp="$(port)"; lp="$(port)"
QUILTFS_MDS_ARGS="namespace.img --listen 127.0.0.1:$lp --metrics 127.0.0.1:$mp"
read -r -a line <<<"$(exec_of quiltfs-mds@.service ExecStart main "$creds")"
without '$QUILTFS_MDS_ARGS' "${line[@]}"
read -r -a args <<<"$QUILTFS_MDS_ARGS"
(cd "$state" && exec setpriv --reuid=nobody --regid=nogroup --clear-groups --no-new-privs \
   "${cmd[@]}" "${args[@]}") >"$work/mds.log" 2>&1 &
mds=$!; pids+=("$mds")
text=""
for _ in $(seq 1 100); do text="$(scrape "$mp")"; [ -n "$text" ] && break; sleep 0.1; done
grep -q '^cudele_clients 0$' <<<"$text" || fail "the namespace service's metrics: $text $(cat "$work/mds.log")"
grep -q '^cudele_requests_total{kind="op"} 0$' <<<"$text" || fail "no request counters: $text"
kill -TERM "$mds"; wait "$mds" || fail "the namespace service did not stop cleanly: $(cat "$work/mds.log")"
pids=()
grep -q 'is clean' "$work/mds.log" || fail "the namespace service's stop: $(cat "$work/mds.log")"
# Three replicas of a volume, as their units run them.
peers=""; mports=()
for i in 0 1 2; do p="$(port)"; peers="$peers${peers:+,}127.0.0.1:$p"; mports+=("$(port)"); done
for i in 0 1 2; do
  d="$work/replica-$i"; mkdir -p "$d"; chown nobody:nogroup "$d"
  (cd "$d" && as_nobody /usr/bin/quiltfs replica format --id "$i" --log-dev log.img --data-dev data.img --size 64M 2>/dev/null)
  read -r -a line <<<"$(exec_of quiltfs-replica@.service ExecStart "$i" "$creds")"
  without '$QUILTFS_REPLICA_ARGS' "${line[@]}"
  listen="$(cut -d, -f$((i + 1)) <<<"$peers")"
  (cd "$d" && exec setpriv --reuid=nobody --regid=nogroup --clear-groups --no-new-privs "${cmd[@]}" \
     --id "$i" --listen "$listen" --peers "$peers" --log-dev log.img --data-dev data.img \
     --metrics "127.0.0.1:${mports[$i]}" --log info --log-target stderr) >"$work/replica-$i.log" 2>&1 &
  pids+=("$!")
done
leaders=0
for _ in $(seq 1 150); do
  leaders=0
  for i in 0 1 2; do scrape "${mports[$i]}" | grep -q '^gnothi_is_leader{replica="'"$i"'"} 1$' && leaders=$((leaders + 1)); done
  [ "$leaders" = 1 ] && break
  sleep 0.2
done
[ "$leaders" = 1 ] || fail "no single leader in the replicas' metrics: $(scrape "${mports[0]}" | grep -v '^#' | head -20)"
scrape "${mports[1]}" | grep -q '^gnothi_incomplete_blocks{replica="1"} 0$' || fail "replica 1's metrics"
grep -q 'INFO.*replica serving' "$work/replica-0.log" || fail "--log info showed no info line: $(cat "$work/replica-0.log")"
for p in "${pids[@]}"; do kill -TERM "$p"; done
for p in "${pids[@]}"; do wait "$p" || fail "a replica did not stop cleanly on SIGTERM"; done
pids=()
# The mount unit: ExecStart (which returns once mounted); the server killed, and
# ExecStartPre detaching the dead mount it left so that a restart can mount again;
# ExecStop.
mkdir -p "$work/srv/q"
IMAGE="$work/disk.img"; OPTIONS="mode=soft-updates"
inst="${work#/}/srv/q"
start="$(exec_of quiltfs-mount@.service ExecStart "$inst" "$creds")"
start="${start/\$\{IMAGE\}/$IMAGE}"; start="${start/\$\{OPTIONS\}/$OPTIONS}"
read -r -a start_cmd <<<"$start"
unit_start() {
  "${start_cmd[@]}" >"$work/mount.log" 2>&1 || fail "the mount unit's ExecStart failed: $(cat "$work/mount.log")"
  mountpoint -q "$work/srv/q" || fail "the mount unit's ExecStart returned before the mount"
  [ "$(cat "$work/srv/q/f")" = "through the package" ] || fail "the mount unit's mount reads wrong"
}
read -r -a cmd <<<"$(exec_of quiltfs-mount@.service ExecStartPre "$inst" "$creds")"
"${cmd[@]}" || fail "ExecStartPre failed with nothing mounted"
unit_start
"${cmd[@]}" || fail "ExecStartPre failed on a live mount"
mountpoint -q "$work/srv/q" || fail "ExecStartPre detached a live mount"
pid="$(pgrep -n -f "mount $IMAGE $work/srv/q")" || fail "no server for the unit's mount"
kill -9 "$pid"
for _ in $(seq 1 50); do [ -e "/proc/$pid" ] || break; sleep 0.1; done
stat "$work/srv/q" >/dev/null 2>&1 && fail "the killed server's mount still answers"
read -r -a cmd <<<"$(exec_of quiltfs-mount@.service ExecStartPre "$inst" "$creds")"
"${cmd[@]}" || fail "ExecStartPre failed on the dead mount"
grep -q " $work/srv/q " /proc/self/mountinfo && fail "the dead mount is still there"
unit_start
read -r -a cmd <<<"$(exec_of quiltfs-mount@.service ExecStop "$inst" "$creds")"
"${cmd[@]}" || fail "the mount unit's ExecStop failed"
mountpoint -q "$work/srv/q" && fail "still mounted after ExecStop"
e2fsck -fn "$work/disk.img" >/dev/null 2>&1 || fail "e2fsck after the mount unit's stop"

echo "deb: 4. purge"
DEBIAN_FRONTEND=noninteractive apt-get purge -y -qq quiltfs >/dev/null
snapshot > "$work/after"
diff -u "$work/before" "$work/after" || fail "apt purge left the machine changed (above)"
echo "deb: PASS (lintian clean, install, upgrade, man, completion, mount helpers, units, purge)"
