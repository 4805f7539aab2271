#!/usr/bin/env python3
"""What one request costs the mount's daemon: a file read through each mount server, one reader.

A dataset of N × 10 KB files (default 4,000, 10 folders) is pushed to a ``file://`` store (no
network, no store delay), mounted by each side named (``server:processes``, e.g.
``mfusepy:1 low:1 low:2``), read once whole (the chunk cache filled), then ``--passes`` times
by one reader in path order, each pass after the page cache is dropped (``echo 1 >
/proc/sys/vm/drop_caches``, root), so every file is one READ to the daemon. Printed per pass:
files/s, the daemon's CPU a file (utime + stime of the daemon and its serving processes over
the pass, from /proc, divided by the files: the kernel's share of the round trip included),
the READs and the µs a READ spent in the server's own handler (``mount_stats``).

Usage (from the repo root, as root):
    .venv/bin/python bench/bench_request.py [--files N] [--passes 3] [SIDE ...]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from bench_loader import cpu_s  # noqa: E402

from hypercli.mount import fusefs, pack  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("sides", nargs="*", default=["mfusepy:1", "low:1", "low:2"])
    p.add_argument("--files", type=int, default=4000)
    p.add_argument("--passes", type=int, default=3)
    a = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-request-"))
    print(f"bench_request: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, {os.cpu_count()} cores, "
          "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    try:
        src, rng = work / "src", random.Random(1)
        files = []
        for i in range(a.files):
            rel = f"d{i % 10}/f{i:06d}"
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes(rng.randbytes(10_000))
            files.append(rel)
        url = f"file://{work / 'store'}"
        pack.push(src, url)
        for side in a.sides:
            server, procs = side.split(":")
            mp, cache = work / f"mnt-{server}{procs}", work / f"cache-{server}{procs}"
            mp.mkdir()
            pid = fusefs.mount(url, mp, cache_dir=cache, cache_bytes=1 << 30,
                               foreground=False, server=server,
                               serving_processes=int(procs))
            try:
                for rel in files:
                    (mp / rel).read_bytes()
                for _ in range(a.passes):
                    with open("/proc/sys/vm/drop_caches", "w") as f:
                        f.write("1\n")
                    r0 = fusefs.mount_stats(mp)["ops"]["read"]
                    c0, t0 = cpu_s(pid), time.perf_counter()
                    for rel in files:
                        with open(mp / rel, "rb", buffering=0) as f:
                            f.read()
                    dt, c1 = time.perf_counter() - t0, cpu_s(pid)
                    r1 = fusefs.mount_stats(mp)["ops"]["read"]
                    n = r1["calls"] - r0["calls"]
                    print(f"{side:>10}: {len(files) / dt:8,.0f} files/s, daemon "
                          f"{(c1 - c0) / len(files) * 1e6:4.0f} µs CPU a file, {n} READs, "
                          f"{(r1['us'] - r0['us']) / max(n, 1):5.1f} µs a READ in the handler"
                          f", load {os.getloadavg()[0]:.1f}", flush=True)
            finally:
                subprocess.run(["fusermount3", "-u", str(mp)], check=False)
                end = time.monotonic() + 10
                while time.monotonic() < end:
                    if os.waitpid(pid, os.WNOHANG)[0] == pid:
                        break
                    time.sleep(0.05)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
