#!/usr/bin/env python3
"""A workflow driven by a controller against the same workflow driven from here, on real SSH
test hosts (tests/sshhosts.py; needs root).

4 hosts: host 0 is the controller, hosts 1-3 the ssh cluster. N trivial tasks (``true``,
default 300). Sides, each on a fresh HYPER_HOME, in alternating order per round:
  here        ``python -m hypercli run RECIPE --trust-new-hosts`` (the driver in this process)
  controller  ``python -m hypercli run RECIPE --controller --trust-new-hosts`` (the same
              scheduler on host 0, every committed change backed up to a majority of hosts 1-3
              before it acts on it; this process follows it)
Rate = N / (last attempt's end - first attempt's creation), from the attempts' own times (the
controller's records are copied here at the end): the dispatch rate, without start-up,
bootstrap and handover. Every run is checked: N attempts, all succeeded. Ratio controller /
here per round, the median printed (goal >= 0.9, issue 26). Figures vary +-50% run to run on
this 2-core machine; compare within a round.

Usage (from the repo root, as root):  python bench/bench_controller.py [--quick] [-n N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402

from sshhosts import HostPool  # noqa: E402

PACKAGES = sysconfig.get_paths()["purelib"]


def one(pool, controller, workers, n: int, on_controller: bool) -> float:
    from hypercli.state import State
    home = tempfile.mkdtemp(prefix="bench-ctl-")
    cluster = {"provider": "ssh", "hosts": [h.address() for h in workers],
               "identity_file": str(pool.client_key)}
    if on_controller:
        cluster.update(controller=controller.address(), controller_python="/root/py3")
    path = Path(home) / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "b", "workdir": "none", "cluster": cluster,
                                    "experiments": {"t": {"sampling": "grid", "samples": n,
                                                          "command": "true"}}}))
    cmd = [sys.executable, "-m", "hypercli", "run", str(path), "--trust-new-hosts"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800,
                       env=dict(os.environ, HYPER_HOME=home, COLUMNS="200"))
    if p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    state = State(Path(home) / "state.db")
    atts = state.attempts("b-1")
    assert len(atts) == n and {a["status"] for a in atts} == {"succeeded"}, len(atts)
    span = max(a["ended_at"] for a in atts) - min(a["created_at"] for a in atts)
    state.close()
    return n / span


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one round instead of three")
    ap.add_argument("-n", type=int, default=300, help="tasks per run")
    args = ap.parse_args()
    rounds = 1 if args.quick else 3
    pool = HostPool()
    try:
        hosts = pool.start(4, share=(ROOT, PACKAGES))
        controller, workers = hosts[0], hosts[1:]
        controller.run(f"printf '#!/bin/sh\\nPYTHONPATH=\"$PYTHONPATH:{PACKAGES}\" exec "
                       f"/usr/bin/python3 \"$@\"\\n' > /root/py3 && chmod +x /root/py3",
                       check=True)
        ratios = []
        for r in range(rounds):
            order = [False, True] if r % 2 == 0 else [True, False]
            rate = {side: one(pool, controller, workers, args.n, side) for side in order}
            ratios.append(rate[True] / rate[False])
            print(f"round {r + 1}: here {rate[False]:.0f} tasks/s, controller "
                  f"{rate[True]:.0f} tasks/s, ratio {ratios[-1]:.2f}", flush=True)
        print(f"controller / here (median of {rounds}): {statistics.median(ratios):.2f} "
              "(goal >= 0.9)")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
