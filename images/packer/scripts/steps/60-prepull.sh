#!/bin/sh
# Pull the common containers into the image (HYPER_PREPULL, separated by spaces).
set -eu
pulled=""
for image in ${HYPER_PREPULL:-}; do
  if ! docker image inspect "$image" >/dev/null 2>&1; then
    docker pull -q "$image" >/dev/null
    pulled="$pulled $image"
  fi
done
if [ -n "$pulled" ]; then
  echo "hyper-provision: prepull: changed (pulled$pulled)"
else
  echo "hyper-provision: prepull: unchanged"
fi
