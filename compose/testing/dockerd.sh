#!/usr/bin/env bash
# A Docker engine answering on this machine: starts dockerd (Debian's docker.io, installed
# when missing) in the background when none answers. Needs root on a fresh machine.
set -euo pipefail
if docker info >/dev/null 2>&1; then
  exit 0
fi
APT="env DEBIAN_FRONTEND=noninteractive apt-get"
command -v dockerd >/dev/null || { $APT update -qq && $APT install -y -qq --no-install-recommends docker.io; }
command -v docker >/dev/null || { $APT update -qq && $APT install -y -qq --no-install-recommends docker.io; }
LOG=${DOCKERD_LOG:-/var/log/pagedserve-dockerd.log}
echo "starting dockerd (log: $LOG)"
setsid nohup dockerd >"$LOG" 2>&1 < /dev/null &
for _ in $(seq 60); do
  docker info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "dockerd did not answer within 60 s; its log: $LOG" >&2
tail -20 "$LOG" >&2
exit 1
