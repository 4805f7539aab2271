#!/usr/bin/env python3
"""Planning benchmark: recipe parse+validate, plan, and store in SQLite, for two recipes.

Cases:
  paper   the paper's example: 12 discrete parameters x 2 choices, grid sampling = 4,096 tasks
  random  100,000 tasks: sampling: random, 3 discrete + 3 continuous parameters, samples: 100000

Stages of hypercli measured separately:
  parse   hypercli.recipe.parse_recipe(text)            (YAML + validation)
  plan    hypercli.plan.build_plan(recipe)              (draws, rendered commands, digest)
  open    hypercli.state.State(path)                    (new file, WAL, migrations)
  store   State.create_workflow(wf, cluster=..., recipe_path=None,
                                storage="file:///tmp/x", workdir="/tmp")

Peer (named baseline, same process layout, same figures): a naive planner written the obvious
way -- ``itertools.product`` over the discrete values (cycled for grid; for random, uniform
picks of a combination plus ``random.uniform`` / log-uniform draws for the ranges), the command
rendered with ``str.replace`` + ``shlex.quote``, the params ``json.dumps``-ed -- and, for the
store stage, a raw ``sqlite3`` ``executemany`` of (id, params JSON, command, env JSON) into one
table with the same pragmas hypercli uses (WAL, synchronous=NORMAL), in one transaction. It
has none of hypercli's validation, minimal-repetition/stratified sampling, digest or schema.

Each (case, side) runs in a fresh child interpreter (so ru_maxrss is that side's alone), 3
times, alternating hypercli / peer; figures are medians. In a child, one timed pass of the
stages runs first (no tracemalloc), ru_maxrss is read, then a second pass under tracemalloc
gives each stage's peak of newly allocated Python memory.

Usage (from the repo root):  python bench/bench_plan.py [--rounds 3] [--cases paper,random]
Every child gets HYPER_HOME set to a fresh temp folder; nothing under ~/.hyper is touched.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import math
import os
import random
import resource
import shlex
import shutil
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def code_version() -> str:
    """The commit of the code measured, and whether hypercli/ has uncommitted changes."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hypercli"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    return f"{rev}{' + uncommitted changes in hypercli/' if dirty else ''}"

GOAL_S = 1.0  # 4,096 tasks planned and stored in under 1 s (parse + plan + open + store)

# -- the two recipes ---------------------------------------------------------------------------

PAPER_NAMES = [f"p{i}" for i in range(12)]


def paper_recipe() -> str:
    params = "\n".join(f"      {n}: [lo{i}, hi{i}]" for i, n in enumerate(PAPER_NAMES))
    cmd = "python train.py " + " ".join(f"--{n} {{{{{n}}}}}" for n in PAPER_NAMES)
    return ("version: 1\nname: paper\ncluster: {provider: local, workers: 4}\n"
            "experiments:\n  search:\n    parameters:\n" + params +
            "\n    sampling: grid\n    command: " + cmd + "\n")


RANDOM_DISCRETE = {"optimizer": ["sgd", "adam", "rmsprop"], "depth": [2, 4, 8, 16],
                   "augment": [True, False]}
RANDOM_RANGES = {"lr": (1e-5, 0.3, True), "dropout": (0.0, 0.5, False),
                 "batch": (16, 512, False)}  # batch: integer range (both bounds integers)


def random_recipe() -> str:
    return """version: 1
name: big
cluster: {provider: local, workers: 4}
experiments:
  search:
    parameters:
      optimizer: [sgd, adam, rmsprop]
      depth: [2, 4, 8, 16]
      augment: [true, false]
      lr: {min: 0.00001, max: 0.3, log: true}
      dropout: "0.0-0.5"
      batch: "16-512"
    sampling: random
    samples: 100000
    command: >-
      python train.py --optimizer {{optimizer}} --depth {{depth}} --augment {{augment}}
      --lr {{lr}} --dropout {{dropout}} --batch {{batch}}
"""


CASES = {
    "paper": {"title": "paper example: 12 discrete x 2, grid", "tasks": 4096,
              "recipe": paper_recipe, "timed_repeats": 5},
    "random": {"title": "100k tasks: random, 3 discrete + 3 continuous", "tasks": 100_000,
               "recipe": random_recipe, "timed_repeats": 1},
}

# -- hypercli side -----------------------------------------------------------------------------


def hyper_stages(text: str, tmp: Path, n: int):
    """Generator of (stage name, thunk) with the thunks chained through a dict."""
    from hypercli.plan import build_plan
    from hypercli.recipe import parse_recipe
    from hypercli.state import State
    box: dict = {}

    def parse():
        box["recipe"] = parse_recipe(text)

    def plan():
        box["wf"] = build_plan(box["recipe"])

    def open_():
        box["state"] = State(tmp / f"state-{n}.db")

    def store():
        box["wid"] = box["state"].create_workflow(box["wf"], cluster="bench", recipe_path=None,
                                                  storage="file:///tmp/x", workdir="/tmp")

    def check():
        st = box["state"]
        got = st.db.execute("SELECT COUNT(*) FROM tasks WHERE workflow=?",
                            (box["wid"],)).fetchone()[0]
        st.close()
        return got, len(box["wf"].tasks)

    return [("parse", parse), ("plan", plan), ("open", open_), ("store", store)], check


# -- peer side: naive itertools.product + json.dumps, raw sqlite3 ------------------------------


def _peer_render(template: str, values: dict) -> str:
    out = template
    for k, v in values.items():
        text = ("true" if v else "false") if isinstance(v, bool) else str(v)
        out = out.replace("{{" + k + "}}", shlex.quote(text))
    return out


def peer_stages(case: str, tmp: Path, n: int):
    box: dict = {}

    def parse():  # the peer's "recipe" is a Python literal: nothing to parse or validate
        if case == "paper":
            box["disc"] = {k: [f"lo{i}", f"hi{i}"] for i, k in enumerate(PAPER_NAMES)}
            box["cmd"] = "python train.py " + " ".join(f"--{k} {{{{{k}}}}}" for k in PAPER_NAMES)
        else:
            box["disc"] = RANDOM_DISCRETE
            box["cmd"] = ("python train.py --optimizer {{optimizer}} --depth {{depth}} "
                          "--augment {{augment}} --lr {{lr}} --dropout {{dropout}} "
                          "--batch {{batch}}")

    def plan():
        disc, cmd = box["disc"], box["cmd"]
        names = list(disc)
        combos = list(itertools.product(*disc.values()))
        rows = []
        if case == "paper":
            for i, combo in enumerate(combos):
                values = dict(zip(names, combo))
                rows.append((f"search-{i:04d}", json.dumps(values), _peer_render(cmd, values),
                             "{}"))
        else:
            rng = random.Random(0)
            total = CASES[case]["tasks"]
            for i in range(total):
                values = dict(zip(names, combos[rng.randrange(len(combos))]))
                for k, (lo, hi, log) in RANDOM_RANGES.items():
                    if log:
                        x = math.exp(rng.uniform(math.log(lo), math.log(hi)))
                        values[k] = float(f"{x:.6g}")
                    elif isinstance(lo, int) and isinstance(hi, int):
                        values[k] = rng.randint(lo, hi)
                    else:
                        values[k] = float(f"{rng.uniform(lo, hi):.6g}")
                rows.append((f"search-{i:06d}", json.dumps(values), _peer_render(cmd, values),
                             "{}"))
        box["rows"] = rows

    def open_():
        db = sqlite3.connect(tmp / f"peer-{n}.db", isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("CREATE TABLE tasks (id TEXT PRIMARY KEY, params TEXT NOT NULL, "
                   "command TEXT NOT NULL, env TEXT NOT NULL)")
        box["db"] = db

    def store():
        db = box["db"]
        db.execute("BEGIN IMMEDIATE")
        db.executemany("INSERT INTO tasks VALUES (?,?,?,?)", box["rows"])
        db.execute("COMMIT")

    def check():
        got = box["db"].execute("SELECT COUNT(*) FROM tasks").fetchone()[0]
        box["db"].close()
        return got, len(box["rows"])

    return [("parse", parse), ("plan", plan), ("open", open_), ("store", store)], check


# -- child: one (case, side) in a fresh interpreter --------------------------------------------


def child(case: str, side: str) -> dict:
    tmp = Path(os.environ["HYPER_HOME"])
    text = CASES[case]["recipe"]()
    stages_of = ((lambda n: hyper_stages(text, tmp, n)) if side == "hyper"
                 else (lambda n: peer_stages(case, tmp, n)))
    if side == "hyper":  # import cost is not a stage: load the modules first
        import hypercli.plan  # noqa: F401
        import hypercli.state  # noqa: F401
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    times: dict[str, list[float]] = {}
    counts = None
    for rep in range(CASES[case]["timed_repeats"]):
        stages, check = stages_of(rep)
        for name, fn in stages:
            gc.collect()
            t0 = time.perf_counter()
            fn()
            times.setdefault(name, []).append(time.perf_counter() - t0)
        counts = check()
        del stages, check
        gc.collect()
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peaks = {}
    stages, check = stages_of(99)
    tracemalloc.start()
    for name, fn in stages:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        peaks[name] = tracemalloc.get_traced_memory()[1] - base
    retained = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    check()
    return {"case": case, "side": side, "tasks_stored": counts[0], "tasks_planned": counts[1],
            "times": {k: statistics.median(v) for k, v in times.items()},
            "tm_peak": peaks, "tm_retained": retained,
            "maxrss_kib_imports": rss_before, "maxrss_kib": rss_after}


def run_child(case: str, side: str) -> dict:
    home = tempfile.mkdtemp(prefix="hyper-bench-plan-")
    try:
        env = dict(os.environ, HYPER_HOME=home)
        p = subprocess.run([sys.executable, __file__, "--child", case, side], env=env,
                           capture_output=True, text=True, cwd=ROOT, timeout=1800)
        if p.returncode != 0:
            raise SystemExit(f"child {case}/{side} failed:\n{p.stdout}\n{p.stderr}")
        return json.loads(p.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _ms(s: float) -> str:
    return f"{s * 1000:8.1f} ms"


def _mib(b: float) -> str:
    return f"{b / 2**20:7.1f} MiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--child", nargs=2, metavar=("CASE", "SIDE"), help=argparse.SUPPRESS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default="paper,random")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results here")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(child(*a.child)))
        return 0
    print(f"hypercli {code_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"python {sys.version.split()[0]}, sqlite {sqlite3.sqlite_version}, "
          f"{os.cpu_count()} CPUs, {a.rounds} rounds alternating hypercli/peer, medians")
    all_results = {}
    for case in a.cases.split(","):
        runs: dict[str, list[dict]] = {"hyper": [], "peer": []}
        for _ in range(a.rounds):
            for side in ("hyper", "peer"):
                runs[side].append(run_child(case, side))
        med = {}
        for side, rs in runs.items():
            assert all(r["tasks_stored"] == r["tasks_planned"] == CASES[case]["tasks"]
                       for r in rs), rs
            med[side] = {
                "times": {k: statistics.median(r["times"][k] for r in rs)
                          for k in rs[0]["times"]},
                "tm_peak": {k: statistics.median(r["tm_peak"][k] for r in rs)
                            for k in rs[0]["tm_peak"]},
                "tm_retained": statistics.median(r["tm_retained"] for r in rs),
                "maxrss": statistics.median(r["maxrss_kib"] for r in rs) * 1024,
                "maxrss_imports": statistics.median(r["maxrss_kib_imports"] for r in rs) * 1024,
            }
            med[side]["times"]["total"] = sum(med[side]["times"].values())
        all_results[case] = {"runs": runs, "median": med}
        h, p = med["hyper"], med["peer"]
        print(f"\n== {case}: {CASES[case]['title']} = {CASES[case]['tasks']:,} tasks")
        print(f"{'stage':<8}{'hypercli':>12}{'peer':>12}{'ratio':>9}"
              f"{'hyper tracemalloc peak':>25}{'peer tracemalloc peak':>24}")
        for k in ("parse", "plan", "open", "store", "total"):
            ratio = h["times"][k] / p["times"][k] if p["times"][k] else float("nan")
            hp = _mib(h["tm_peak"][k]) if k in h["tm_peak"] else ""
            pp = _mib(p["tm_peak"][k]) if k in p["tm_peak"] else ""
            print(f"{k:<8}{_ms(h['times'][k]):>12}{_ms(p['times'][k]):>12}{ratio:>8.1f}x"
                  f"{hp:>25}{pp:>24}")
        n = CASES[case]["tasks"]
        print(f"per task: hypercli {h['times']['total'] / n * 1e6:.1f} us, "
              f"peer {p['times']['total'] / n * 1e6:.1f} us")
        print(f"ru_maxrss of the child: hypercli {_mib(h['maxrss'])} "
              f"(after imports {_mib(h['maxrss_imports'])}), peer {_mib(p['maxrss'])} "
              f"(after imports {_mib(p['maxrss_imports'])})")
        print(f"python memory still held after the 4 stages (tracemalloc): hypercli "
              f"{_mib(h['tm_retained'])}, peer {_mib(p['tm_retained'])}")
        if case == "paper":
            t = h["times"]["total"]
            print(f"goal: 4,096 tasks planned and stored in < {GOAL_S:.0f} s: "
                  f"{t:.3f} s -> {'MET' if t < GOAL_S else 'MISSED'}")
    if a.json:
        Path(a.json).write_text(json.dumps(all_results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
