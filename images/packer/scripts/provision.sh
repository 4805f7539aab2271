#!/bin/sh
# Provision a hypercli node: run every step of this folder in order, as root.
# Used by Packer (images/packer/node.pkr.hcl) and by `hyper up --bootstrap` over SSH.
# Each step is idempotent and prints "hyper-provision: STEP: changed|unchanged|skipped".
# Environment: HYPER_VARIANT (cpu|gpu), HYPER_BUNDLE (tar of hypercli's code),
# HYPER_PREPULL (images to pull), HYPER_SKIP (steps to skip, e.g. "docker nvidia").
set -eu
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" != 0 ]; then
  echo "hyper-provision: must run as root" >&2
  exit 1
fi
for step in "$here"/steps/[0-9]*.sh; do
  name=$(basename "$step" .sh)
  name=${name#*-}
  case " ${HYPER_SKIP:-} " in
    *" $name "*) echo "hyper-provision: $name: skipped"; continue ;;
  esac
  sh "$step"
done
