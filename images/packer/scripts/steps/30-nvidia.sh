#!/bin/sh
# GPU variant only: the NVIDIA driver and the container toolkit (docker --gpus all).
set -eu
if [ "${HYPER_VARIANT:-cpu}" != gpu ]; then
  echo "hyper-provision: nvidia: skipped (variant ${HYPER_VARIANT:-cpu})"
  exit 0
fi
if command -v nvidia-smi >/dev/null 2>&1 && command -v nvidia-ctk >/dev/null 2>&1; then
  echo "hyper-provision: nvidia: unchanged"
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq ubuntu-drivers-common gnupg >/dev/null
ubuntu-drivers install --gpgpu >/dev/null
curl -fsSL https://nvidia.github.io/libnvidia-container/gpgkey \
  | gpg --dearmor --yes -o /usr/share/keyrings/nvidia-container-toolkit-keyring.gpg
curl -fsSL https://nvidia.github.io/libnvidia-container/stable/deb/nvidia-container-toolkit.list \
  | sed 's#deb https://#deb [signed-by=/usr/share/keyrings/nvidia-container-toolkit-keyring.gpg] https://#' \
  > /etc/apt/sources.list.d/nvidia-container-toolkit.list
apt-get update -qq
apt-get install -y -qq nvidia-container-toolkit >/dev/null
nvidia-ctk runtime configure --runtime=docker >/dev/null
systemctl restart docker >/dev/null 2>&1 || true
echo "hyper-provision: nvidia: changed (driver and container toolkit)"
