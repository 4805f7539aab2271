#!/bin/sh
# goofys, for plain s3:// bucket mounts (hypercli falls back to s3fs without it).
# The release has an x86_64 binary only; HYPER_GOOFYS_SHA256, when set, must match it.
set -eu
version=${HYPER_GOOFYS_VERSION:-0.24.0}
if command -v goofys >/dev/null 2>&1; then
  echo "hyper-provision: goofys: unchanged"
  exit 0
fi
if [ "$(uname -m)" != x86_64 ]; then
  echo "hyper-provision: goofys: skipped (no release binary for $(uname -m))"
  exit 0
fi
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
curl -fsSL -o "$tmp" "https://github.com/kahing/goofys/releases/download/v$version/goofys"
if [ -n "${HYPER_GOOFYS_SHA256:-}" ]; then
  echo "$HYPER_GOOFYS_SHA256  $tmp" | sha256sum -c - >/dev/null
fi
install -m 0755 "$tmp" /usr/local/bin/goofys
echo "hyper-provision: goofys: changed (installed $version)"
