#!/bin/sh
# Provision a hypercli node: run every step of steps/ in order, as root. Used by Packer
# (images/packer/node.pkr.hcl) and by `hyper up --bootstrap` over SSH. Each step is idempotent
# and prints "hyper-provision: STEP: changed (...)|unchanged|skipped (...)".
# Environment:
#   HYPER_SKIP           steps to leave out, separated by spaces (e.g. "docker nvidia")
#   HYPER_VARIANT        cpu | gpu | auto (gpu when the host has an NVIDIA device)
#   HYPER_BUNDLE         tar of hypercli's code (hypercli.node.bundle), for the hypercli step
#   HYPER_PREPULL        container images to pull, separated by spaces
#   HYPER_ENGINES        engines to install for `engine:` experiments: spark, ray (see
#                        steps/65-engines.sh)
#   HYPER_NVIDIA_DRIVER  NVIDIA driver branch for the gpu variant (default 535-server)
#   HYPER_PREFIX, HYPER_BIN, HYPER_LIB, HYPER_UNITS, HYPER_SSHD_CONFIG: where files go
#                        (defaults /opt/hypercli, /usr/local/bin, /usr/local/lib/hyper,
#                        /etc/systemd/system, /etc/ssh/sshd_config)
set -eu
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" != 0 ]; then
  echo "hyper-provision: must run as root" >&2
  exit 1
fi
names=""
for step in "$here"/steps/[0-9]*.sh; do
  name=$(basename "$step" .sh)
  names="$names ${name#*-}"
done
for s in ${HYPER_SKIP:-}; do
  case " $names " in
    *" $s "*) ;;
    *) echo "hyper-provision: unknown step '$s' in HYPER_SKIP (steps:$names)" >&2; exit 2 ;;
  esac
done
for step in "$here"/steps/[0-9]*.sh; do
  name=$(basename "$step" .sh)
  name=${name#*-}
  case " ${HYPER_SKIP:-} " in
    *" $name "*) echo "hyper-provision: $name: skipped"; continue ;;
  esac
  sh "$step"
done
