#!/usr/bin/env python3
"""Optimizer benchmark: every offer that satisfies each of 5 resource shapes, cheapest first,
over the full catalogs of the three clouds (the snapshot shipped in hypercli/offers/data/).

Shapes (a recipe of 5 experiments): V100:4 spot, A100-80GB:8 spot or on-demand (auto),
T4:1 on-demand, 8+ vCPUs and 32+ GiB spot, 96+ vCPUs spot.

Stages of hypercli measured separately (CPU time of the process, ``time.process_time``: the
machine is shared and its load is printed; wall time under load mostly measures the others):
  load    hypercli.offers.catalog.Catalog()        (the three gzipped CSV tables → memory)
  plan    ranked_offers(shape, catalog, limit=4) for the 5 shapes on a fresh catalog: what
          `hyper plan` asks (the choice and 3 alternatives per experiment)
  full    ranked_offers(shape, catalog) for the 5 shapes: every offer, as `hyper offers -n 0`

Peer (named baseline): the same question asked of pandas DataFrames, the way SkyPilot's
catalog answers it (skypilot-org/skypilot ``sky/catalog/common.py``: the CSVs read with
``pandas.read_csv``, then boolean-mask filters on AcceleratorName/AcceleratorCount/vCPUs/
MemoryGiB and ``sort_values`` on the price). SkyPilot itself cannot run here: its optimizer
downloads its catalogs from GitHub at first use and this machine reaches no network but the
package registries. The peer loads the same three tables (``read_csv``, gzip) and ranks the
same 5 shapes (spot and on-demand rows as separate offers, like ours); both sides must return
the same number of offers per shape (checked).

Usage (from the repo root):  .venv/bin/python bench/bench_optimizer.py [--rounds 5]
Goal (issue 23): under 100 ms for the 5 shapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypercli.offers.optimizer import Shape  # noqa: E402

SHAPES = [Shape(accelerator="V100", accelerator_count=4, spot=True),
          Shape(accelerator="A100-80GB", accelerator_count=8, spot="auto"),
          Shape(accelerator="T4", accelerator_count=1, spot=False),
          Shape(cpus=8, memory_gib=32, spot=True),
          Shape(cpus=96, spot=True)]


CLOCK = time.process_time


def ours() -> tuple[float, float, float, list[int]]:
    from hypercli.offers.catalog import Catalog
    from hypercli.offers.optimizer import ranked_offers
    t0 = CLOCK()
    cat = Catalog()
    t1 = CLOCK()
    firsts = [ranked_offers(s, cat, limit=4) for s in SHAPES]
    t2 = CLOCK()
    cat = Catalog()
    t3 = CLOCK()
    counts = [len(ranked_offers(s, cat)) for s in SHAPES]
    t4 = CLOCK()
    assert all(len(f) == min(4, n) for f, n in zip(firsts, counts))
    return t1 - t0, t2 - t1, t4 - t3, counts


def peer() -> tuple[float, float, float, list[int]]:
    import pandas as pd

    from hypercli.offers.catalog import DATA
    from hypercli.recipe.resources import normalise_gpu
    t0 = CLOCK()
    frames = []
    for cloud in ("aws", "gcp", "azure"):
        df = pd.read_csv(DATA / f"{cloud}.csv.gz", keep_default_na=False,
                         na_values={"price": [""], "spot_price": [""]})
        df["cloud"] = cloud
        names = {n: normalise_gpu(n) for n in df["accelerator"].unique() if n}
        df["accelerator"] = df["accelerator"].map(lambda n: names.get(n, ""))
        df["accelerator_count"] = pd.to_numeric(df["accelerator_count"]).fillna(0)
        frames.append(df)
    df = pd.concat(frames, ignore_index=True)
    t1 = CLOCK()
    rank(df, 4)
    t2 = CLOCK()
    counts = rank(df, None)
    t3 = CLOCK()
    return t1 - t0, t2 - t1, t3 - t2, counts


def rank(df, limit: int | None) -> list[int]:
    """The peer's ranking of the 5 shapes: the first ``limit`` offers (or all) of each."""
    counts = []
    for s in SHAPES:
        if s.accelerator_count:
            m = (df["accelerator"] == s.accelerator) & \
                (df["accelerator_count"] >= s.accelerator_count)
        else:
            m = df["accelerator_count"] == 0
        m &= (df["vcpus"] >= s.cpus) & (df["memory_gib"] >= s.memory_gib) & \
            (df["arch"] == s.arch)
        rows = df[m]
        parts = []
        if s.spot in (True, "auto"):
            spot = rows[rows["spot_price"].notna()]
            parts.append(spot.nsmallest(limit, "spot_price") if limit else
                         spot.sort_values("spot_price"))
        if s.spot in (False, "auto"):
            od = rows[rows["price"].notna()]
            parts.append(od.nsmallest(limit, "price") if limit else od.sort_values("price"))
        counts.append(sum(len(p) for p in parts))
    return counts


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.environ["HYPER_HOME"] = tempfile.mkdtemp(prefix="bench-opt-")  # no cache: snapshot
    import pandas  # noqa: F401  (imported once, outside the timings)
    from hypercli.offers.catalog import Catalog
    cat = Catalog()
    rows = {c: sum(len(v) for v in t.prices.values()) for c, t in cat.tables.items()}
    sizes = [f"{c} {len(t.types)} types / {rows[c]} rows" for c, t in cat.tables.items()]
    print(f"catalog: {', '.join(sizes)}")
    print(f"load average {os.getloadavg()[0]:.2f}")
    res: dict = {"hypercli": [], "pandas": []}
    for _ in range(args.rounds):
        for side, fn in (("hypercli", ours), ("pandas", peer)):
            res[side].append(fn())
    a, b = res["hypercli"][0][3], res["pandas"][0][3]
    assert a == b, f"the sides disagree on the offers per shape: {a} vs {b}"
    print(f"offers per shape: {a}")
    print("| stage (CPU ms, median) | hypercli | pandas (SkyPilot's way) | ratio |\n"
          "|---|---:|---:|---:|")
    for i, stage in ((0, "load 3 catalogs"), (1, "plan: first 4 offers of 5 shapes"),
                     (2, "full: every offer of 5 shapes")):
        h = statistics.median(r[i] for r in res["hypercli"]) * 1000
        p = statistics.median(r[i] for r in res["pandas"]) * 1000
        print(f"| {stage} | {h:,.1f} ms | {p:,.1f} ms | {h / p:.2f}× |")
    for i, what in ((1, "plan"), (2, "full")):
        ms = statistics.median(r[i] for r in res["hypercli"]) * 1000
        print(f"goal (5 shapes under 100 ms), {what}: {'met' if ms < 100 else 'NOT met'} "
              f"({ms:.1f} ms)")


if __name__ == "__main__":
    main()
