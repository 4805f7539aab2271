#!/bin/sh
# Container runtime: Docker engine (Ubuntu's docker.io), enabled at boot.
set -eu
if command -v docker >/dev/null 2>&1; then
  echo "hyper-provision: docker: unchanged"
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || {
  echo "hyper-provision: docker: needs apt-get (Debian, Ubuntu); HYPER_SKIP=docker skips it" >&2
  exit 1
}
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq docker.io >/dev/null
systemctl enable --now docker >/dev/null 2>&1 || true
echo "hyper-provision: docker: changed (installed docker.io)"
