#!/usr/bin/env bash
# Install hypercli with its test extras into .venv and run the whole test suite.
# Arguments are passed to pytest. On Debian as root, missing system packages are installed first.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/deps.sh
python3 -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e '.[test]'
exec .venv/bin/python -m pytest -q "$@"
