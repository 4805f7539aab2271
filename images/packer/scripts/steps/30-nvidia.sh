#!/bin/sh
# GPU variant: the NVIDIA driver and the container toolkit (docker run --gpus all).
# HYPER_VARIANT=gpu installs them; auto installs them when the host has an NVIDIA PCI device
# (vendor 0x10de); cpu skips. The driver branch is named (HYPER_NVIDIA_DRIVER), so an image
# baked on a builder without a GPU gets it too.
set -eu
variant=${HYPER_VARIANT:-cpu}
driver=${HYPER_NVIDIA_DRIVER:-535-server}
if [ "$variant" = auto ]; then
  variant=cpu
  for v in /sys/bus/pci/devices/*/vendor; do
    [ -r "$v" ] && [ "$(cat "$v")" = 0x10de ] && variant=gpu && break
  done
  if [ "$variant" = cpu ]; then
    echo "hyper-provision: nvidia: skipped (no NVIDIA device)"
    exit 0
  fi
fi
if [ "$variant" != gpu ]; then
  echo "hyper-provision: nvidia: skipped (variant $variant)"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && command -v nvidia-ctk >/dev/null 2>&1; then
  echo "hyper-provision: nvidia: unchanged"
  exit 0
fi
command -v apt-get >/dev/null 2>&1 || {
  echo "hyper-provision: nvidia: needs apt-get (Debian, Ubuntu); HYPER_SKIP=nvidia skips it" >&2
  exit 1
}
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq ubuntu-drivers-common gnupg curl >/dev/null
ubuntu-drivers install --gpgpu "nvidia:$driver" >/dev/null
apt-get install -y -qq "nvidia-utils-$driver" >/dev/null
keyring=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey | gpg --dearmor --yes -o "$keyring"
curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
  | sed "s#deb https://#deb [signed-by=$keyring] https://#" \
  > /etc/apt/sources.list.d/nvidia-container-toolkit.list
apt-get update -qq
apt-get install -y -qq nvidia-container-toolkit >/dev/null
if command -v docker >/dev/null 2>&1; then
  nvidia-ctk runtime configure --runtime=docker >/dev/null
  systemctl restart docker >/dev/null 2>&1 || true
fi
echo "hyper-provision: nvidia: changed (driver $driver, container toolkit)"
