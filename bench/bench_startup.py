#!/usr/bin/env python3
"""Start-up time of the CLI: `hyper --help` and `hyper status` against the AWS CLI's
`aws --version` (and `sky --help`, SkyPilot, when installed), in the same run.

    python bench/bench_startup.py [--runs 20]

Each command runs ``--runs`` times after one warm-up run (the page cache holds the files, as
on a laptop that used the tool a minute ago); the median and the 90th percentile of the wall
time are printed, then each peer's median over hyper's. `hyper status` runs against a fresh
``HYPER_HOME`` holding one cluster with 4 nodes (a state file to open and read).
Goal (cloud-providers issue): `hyper --help` and `hyper status` under 0.3 s.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def timed(argv: list[str], env: dict, runs: int) -> list[float]:
    subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    out = []
    for _ in range(runs):
        t = time.perf_counter()
        r = subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append(time.perf_counter() - t)
        if r.returncode != 0:
            raise SystemExit(f"{' '.join(argv)} exited {r.returncode}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    a = ap.parse_args()
    hyper = shutil.which("hyper", path=str(Path(sys.executable).parent)) or shutil.which("hyper")
    if not hyper:
        raise SystemExit("hyper is not installed: pip install -e .")
    home = tempfile.mkdtemp(prefix="hyper-bench-")
    env = dict(os.environ, HYPER_HOME=home)
    try:
        sys.path.insert(0, str(ROOT))
        os.environ["HYPER_HOME"] = home
        from hypercli.state import State
        st = State()
        st.put_cluster("lab", "ssh", {"workers": None, "options": {}}, "up")
        for i in range(4):
            st.put_node("lab", f"lab-{i}", slots=1, provider_id=f"root@10.0.0.{i}:22",
                        address={}, info={})
        cmds = {"hyper --help": [hyper, "--help"], "hyper status": [hyper, "status"]}
        for name, argv in (("aws --version", ["aws", "--version"]),
                           ("sky --help", ["sky", "--help"])):
            if shutil.which(argv[0]):
                cmds[name] = argv
        print(f"start-up, {a.runs} runs each after a warm-up; load average "
              f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
        med = {}
        for name, argv in cmds.items():
            ts = sorted(timed(argv, env, a.runs))
            med[name] = statistics.median(ts)
            p90 = ts[min(len(ts) - 1, int(0.9 * len(ts)))]
            goal = ""
            if name.startswith("hyper"):
                goal = f"   goal < 0.3 s: {'yes' if p90 < 0.3 else 'NO'}"
            print(f"  {name:<16} median {med[name] * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms{goal}")
        for peer in [n for n in med if not n.startswith("hyper")]:
            for own in ("hyper --help", "hyper status"):
                print(f"  {peer} / {own}: {med[peer] / med[own]:.1f}x")
    finally:
        shutil.rmtree(home, ignore_errors=True)


if __name__ == "__main__":
    main()
