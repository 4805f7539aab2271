#!/usr/bin/env bash
# Debian packages the test suite needs. Installs the missing ones when run as root on a
# Debian-like system; otherwise prints what is missing and goes on.
set -euo pipefail
packages=(python3-venv openssh-server iproute2 podman runc busybox-static docker-registry apache2-utils python3-sklearn python3-boto3 python3-torch fuse3 erofs-utils s3fs rclone parallel packer shellcheck chromium chromium-driver openjdk-17-jre-headless)
missing=()
for p in "${packages[@]}"; do
  dpkg -s "$p" >/dev/null 2>&1 || missing+=("$p")
done
# python3 -m venv works without python3-venv when Python is not Debian's own.
if python3 -c 'import venv, ensurepip' 2>/dev/null; then
  missing=("${missing[@]/python3-venv}")
fi
missing=($(printf '%s\n' "${missing[@]}" | sed '/^$/d'))
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "missing Debian packages (install them as root): ${missing[*]}" >&2
  fi
fi
# Azurite, the Azure Storage emulator the az:// store is tested against (npm registry).
if ! command -v azurite-blob >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v npm >/dev/null; then
    npm install -g --silent --no-audit --no-fund azurite@3 >/dev/null
  else
    echo "missing azurite-blob (install it as root: npm install -g azurite@3)" >&2
  fi
fi
