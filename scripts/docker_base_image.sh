#!/usr/bin/env bash
# Builds a stand-in for the images' base, `python:3.11-slim`, from Debian's packages, on a machine
# whose Docker engine can pull no image (docs/DEPLOYMENT.md, "Without a registry"). Needs root,
# debootstrap and a running dockerd; about a minute and 190 MB.
#
#   scripts/docker_base_image.sh [TAG]      # TAG: python:3.11-slim unless given
#
# Debian bookworm's minimal base with its Python 3.11, laid out as the official image lays it out:
# `python` and `pip` in /usr/local/bin, packages in /usr/local/lib/python3.11/site-packages (a venv
# at /usr/local over Debian's interpreter, since Debian's own site is marked externally managed).
# The CA certificates this machine added (/usr/local/share/ca-certificates, e.g. a TLS-inspecting
# egress proxy's) are trusted inside, so pip can reach PyPI from a build.
set -euo pipefail

tag="${1:-python:3.11-slim}"
mirror="http://deb.debian.org/debian"
work="$(mktemp -d)"
root="$work/rootfs"
cleanup() {
  umount "$root/proc" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

debootstrap --variant=minbase --include=ca-certificates bookworm "$root" "$mirror"
cp /etc/resolv.conf "$root/etc/resolv.conf"
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
  cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
fi
mount --bind /proc "$root/proc"
# Through apt, not debootstrap's --include: apt resolves python3.11-venv's dependencies, which
# debootstrap leaves unconfigured (python3.11-distutils).
chroot "$root" env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin DEBIAN_FRONTEND=noninteractive sh -euc '
  apt-get update -q
  apt-get install -y -q --no-install-recommends python3.11 python3.11-venv
  update-ca-certificates
  python3.11 -m venv /usr/local
  /usr/local/bin/pip install -q --no-cache-dir --upgrade pip
  apt-get clean
  rm -rf /var/lib/apt/lists/* /root/.cache
'
umount "$root/proc"
: >"$root/etc/resolv.conf"  # Docker writes the container's own

tar -C "$root" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' \
  - "$tag"
docker run --rm "$tag" python -c 'import sys, ssl; print(sys.version.split()[0], ssl.OPENSSL_VERSION)'
