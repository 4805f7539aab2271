#!/bin/sh
# Container runtime: Docker engine (Ubuntu's docker.io), enabled at boot.
set -eu
if command -v docker >/dev/null 2>&1; then
  echo "hyper-provision: docker: unchanged"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq docker.io >/dev/null
systemctl enable --now docker >/dev/null 2>&1 || true
echo "hyper-provision: docker: changed (installed docker.io)"
