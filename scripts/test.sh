#!/usr/bin/env bash
# Install hypercli with its test extras into .venv and run the whole test suite.
# Arguments are passed to pytest. On Debian as root, missing system packages are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "scripts/test.sh: as root on Debian, installs missing system packages with apt-get and Azurite globally with npm (scripts/deps.sh) and Spark and Ray into /opt/hypercli-engines (scripts/engines.sh), then hypercli's test extras and PyTorch's CPU build into .venv" >&2
bash scripts/deps.sh
bash scripts/engines.sh   # Spark and Ray for the engine tests, where the SSH test hosts see them
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
# PyTorch's CPU build, for the tests of the distributed-training recipe (skipped without it,
# except in CI): a no-op when it is installed
.venv/bin/python -c 'import torch' 2>/dev/null \
  || .venv/bin/python -m pip install -q 'torch==2.13.0+cpu' \
  || echo "note: no CPU build of PyTorch 2.13.0 here: the distributed-training tests are skipped" >&2
# whole test files in two pytest processes (pytest-xdist; the longest files first, see
# LONG_FILES in tests/conftest.py): most tests wait on hosts, containers and servers, so two
# share 2 cores well; `-n 0` after it runs them in one process
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile "$@"
