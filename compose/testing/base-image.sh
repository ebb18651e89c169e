#!/usr/bin/env bash
# Builds a stand-in for python:3.11-slim where Docker Hub cannot be reached: a Debian
# bookworm root filesystem from debootstrap (python3 is 3.11 there), imported as an image.
# Cached: does nothing when the tag exists. Needs root (debootstrap).
# Usage: base-image.sh [TAG]   (default pagedserve-base:bookworm)
set -euo pipefail
TAG=${1:-pagedserve-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if docker image inspect "$TAG" >/dev/null 2>&1; then
  echo "base image $TAG: cached"
  exit 0
fi
command -v debootstrap >/dev/null || {
  DEBIAN_FRONTEND=noninteractive apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends debootstrap
}
ROOTFS=$(mktemp -d /tmp/pagedserve-rootfs.XXXXXX)
trap 'rm -rf "$ROOTFS"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$ROOTFS" "$MIRROR"
rm -rf "$ROOTFS"/var/lib/apt/lists/* "$ROOTFS"/var/cache/apt/archives/*.deb
tar -C "$ROOTFS" -c . | docker import \
  --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV LANG=C.UTF-8' \
  --change 'CMD ["python3"]' - "$TAG"
echo "base image $TAG: built"
