#!/bin/sh
# goofys, for plain s3:// bucket mounts (hypercli falls back to s3fs without it).
set -eu
version=0.24.0
if command -v goofys >/dev/null 2>&1; then
  echo "hyper-provision: goofys: unchanged"
  exit 0
fi
tmp=$(mktemp)
curl -fsSL -o "$tmp" "https://github.com/kahing/goofys/releases/download/v$version/goofys"
install -m 0755 "$tmp" /usr/local/bin/goofys
rm -f "$tmp"
echo "hyper-provision: goofys: changed (installed $version)"
