#!/bin/sh
# Engines for `engine: spark|ray` experiments, asked with HYPER_ENGINES ("spark", "ray" or
# both, separated by spaces; empty: none). hypercli starts them but never installs them.
#   spark: Java 17 (openjdk-17-jre-headless) and pyspark, with pandas and pyarrow for
#          mapInPandas
#   ray:   ray
# Python packages go into the system Python (python3 -m pip), so `python3`, `spark-class` and
# `ray` on PATH see them. HYPER_PYSPARK_VERSION and HYPER_RAY_VERSION pin versions.
set -eu
want=${HYPER_ENGINES:-}
if [ -z "$want" ]; then
  echo "hyper-provision: engines: skipped (HYPER_ENGINES is empty)"
  exit 0
fi
for e in $want; do
  case $e in
    spark|ray) ;;
    *) echo "hyper-provision: engines: unknown engine '$e' in HYPER_ENGINES (spark, ray)" >&2
       exit 2 ;;
  esac
done
export DEBIAN_FRONTEND=noninteractive
changed=""
apt_install() {
  command -v apt-get >/dev/null 2>&1 || {
    echo "hyper-provision: engines: needs apt-get (Debian, Ubuntu) for $*" >&2
    exit 1
  }
  apt-get update -qq
  apt-get install -y -qq "$@" >/dev/null
}
pip_install() {
  python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
  # Debian 12 / Ubuntu 23.04+ mark the system Python as externally managed (PEP 668)
  if python3 -m pip install --help | grep -q -- --break-system-packages; then
    python3 -m pip install -q --break-system-packages "$@"
  else
    python3 -m pip install -q "$@"
  fi
}
for e in $want; do
  case $e in
    spark)
      if ! java -version 2>&1 | grep -q 'version "\(1[7-9]\|[2-9][0-9]\)'; then
        apt_install openjdk-17-jre-headless
        changed="$changed java17"
      fi
      if ! python3 -c 'import pyspark, pandas, pyarrow' 2>/dev/null \
          || ! command -v spark-class >/dev/null 2>&1; then
        pip_install "pyspark${HYPER_PYSPARK_VERSION:+==$HYPER_PYSPARK_VERSION}" pandas pyarrow
        changed="$changed pyspark"
      fi
      ;;
    ray)
      if ! command -v ray >/dev/null 2>&1; then
        pip_install "ray${HYPER_RAY_VERSION:+==$HYPER_RAY_VERSION}"
        changed="$changed ray"
      fi
      ;;
  esac
done
if [ -n "$changed" ]; then
  echo "hyper-provision: engines: changed (installed$changed)"
else
  echo "hyper-provision: engines: unchanged"
fi
