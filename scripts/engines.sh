#!/usr/bin/env bash
# The engines the `engine: spark|ray` tests start on the SSH test hosts, installed as a node
# image would have them: Java 17 comes from Debian (scripts/deps.sh), and pyspark, ray and
# what the featurization jobs import go into their own Python environment at a path the
# hosts see (not /tmp or /root, which are private to each host), made from Debian's
# /usr/bin/python3 (a Python under /root, such as pyenv's, is not there for the hosts).
# A no-op when present.
# Usage: scripts/engines.sh [DIR]   (default /opt/hypercli-engines, or $HYPER_TEST_ENGINES)
set -euo pipefail
dir="${1:-${HYPER_TEST_ENGINES:-/opt/hypercli-engines}}"
if "$dir/bin/python" -c 'import pyspark, ray, pandas, pyarrow, sklearn' 2>/dev/null; then
  exit 0
fi
if [ ! -w "$(dirname "$dir")" ]; then
  echo "note: cannot write $dir: the engine tests are skipped (run scripts/engines.sh as root)" >&2
  exit 0
fi
if ! /usr/bin/python3 -c 'import ensurepip' 2>/dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
fi
rm -rf "$dir"
/usr/bin/python3 -m venv "$dir"
"$dir/bin/python" -m pip install -q --upgrade pip
"$dir/bin/python" -m pip install -q 'pyspark>=3.5' 'ray>=2.9' pandas pyarrow scikit-learn
