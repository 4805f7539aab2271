#!/bin/sh
# Base packages: FUSE 3, Python 3 with boto3 (object stores), rclone (gs:// and az:// bucket
# mounts), curl, certificates.
set -eu
missing=""
for p in fuse3 python3 python3-boto3 rclone curl ca-certificates; do
  dpkg -s "$p" >/dev/null 2>&1 || missing="$missing $p"
done
if [ -z "$missing" ]; then
  echo "hyper-provision: base: unchanged"
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || {
  echo "hyper-provision: base: needs apt-get (Debian, Ubuntu); HYPER_SKIP=base skips it" >&2
  exit 1
}
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086  # one word per package
apt-get install -y -qq $missing >/dev/null
echo "hyper-provision: base: changed (installed$missing)"
