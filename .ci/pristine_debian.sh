#!/usr/bin/env bash
# Runs the README's quick-start commands, exactly as the README writes them, on a pristine Debian 12: a
# debootstrap'd root (--variant=minbase, plus build-essential, cmake, git and ca-certificates only), from
# the machine's own Debian mirror, entered with chroot. A developer's machine has packages a newcomer's
# does not, so a green test run there can hide a missing install step; this cannot.
#
#   bash .ci/pristine_debian.sh            as root, from anywhere in the repository
#
# The base root is made once and cached in $SDPA_PRISTINE_CACHE (default /var/cache/sdpa/pristine-debian12);
# each run copies it, clones the committed HEAD of this repository into the copy and removes the copy
# afterwards. Logs: $SDPA_PRISTINE_LOGS (default /tmp/sdpa-pristine), one per command. Exit 0 when every
# command passed.
set -uo pipefail
[ "$(id -u)" -eq 0 ] || { echo "pristine_debian: needs root (debootstrap, chroot, mount)" >&2; exit 2; }
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${SDPA_PRISTINE_CACHE:-/var/cache/sdpa/pristine-debian12}
logs=${SDPA_PRISTINE_LOGS:-/tmp/sdpa-pristine}
mkdir -p "$logs" "$(dirname "$cache")"

# The commands: the lines of the README's "Quick start" code block, comments stripped by the shell.
mapfile -t cmds < <(awk '/^## Quick start/ { in_section = 1; next }
                         in_section && /^## / { exit }
                         in_section && /^```/ { if (in_block) exit; in_block = 1; next }
                         in_block && NF && $1 !~ /^#/ { print }' "$root/README.md")
[ ${#cmds[@]} -gt 0 ] || { echo "pristine_debian: no commands in the README's Quick start block" >&2; exit 2; }

if [ ! -f "$cache/.complete" ]; then
  if ! command -v debootstrap >/dev/null; then
    (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends debootstrap) \
      >"$logs/debootstrap-install.log" 2>&1 || { echo "pristine_debian: cannot install debootstrap" >&2; exit 2; }
  fi
  mirror=$(grep -rhoE 'https?://[^ ]*/debian/?( |$)' /etc/apt/sources.list /etc/apt/sources.list.d/ 2>/dev/null \
             | head -1 | tr -d ' ')
  mirror=${mirror:-http://deb.debian.org/debian}
  echo "pristine_debian: making the base root in $cache from $mirror (once; a few minutes)"
  rm -rf --one-file-system "$cache"
  debootstrap --variant=minbase --include=build-essential,cmake,git,ca-certificates bookworm "$cache" "$mirror" \
    >"$logs/debootstrap.log" 2>&1 || { echo "pristine_debian: debootstrap failed, see $logs/debootstrap.log" >&2; exit 2; }
  touch "$cache/.complete"
fi

work=$(mktemp -d /tmp/sdpa-pristine-root.XXXXXX)
cleanup() {
  for m in dev/pts dev proc; do mountpoint -q "$work/$m" && umount "$work/$m"; done
  rm -rf --one-file-system "$work"
}
trap cleanup EXIT
cp -a "$cache/." "$work/"
cp /etc/resolv.conf "$work/etc/resolv.conf"
mount -t proc proc "$work/proc" && mount --bind /dev "$work/dev" && mount --bind /dev/pts "$work/dev/pts" \
  || { echo "pristine_debian: cannot mount proc/dev in the root" >&2; exit 2; }
git clone -q "$root" "$work/root/sdpa" || { echo "pristine_debian: git clone failed" >&2; exit 2; }

status=0
i=0
for cmd in "${cmds[@]}"; do
  i=$((i + 1))
  log="$logs/command-$i.log"
  echo "pristine_debian: [$i] $cmd"
  if chroot "$work" env -i HOME=/root PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin LANG=C.UTF-8 \
      bash -c "cd /root/sdpa && $cmd" >"$log" 2>&1; then
    tail -n 3 "$log" | sed 's/^/    /'
    echo "pristine_debian: [$i] passed"
  else
    tail -n 30 "$log" | sed 's/^/    /'
    echo "pristine_debian: [$i] FAILED, full log: $log"
    status=1
  fi
done
exit $status
