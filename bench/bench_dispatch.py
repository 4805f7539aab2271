#!/usr/bin/env python3
"""Dispatch overhead on the local provider: 1,000 tasks of ``true`` on 4 worker slots.

Sides, run in the same invocation, alternating, ``--rounds`` times (default 3); medians:

  hyper CLI   ``python -m hypercli run RECIPE --on-interrupt cancel`` as a subprocess, wall
              clock from spawn to exit (interpreter start-up, imports, plan, state file,
              cluster up, the run loop, every attempt recorded in SQLite). The recipe:
                cluster: {provider: local, workers: 4}
                experiments: {t: {sampling: grid, samples: 1000, command: "true"}}
  GNU parallel  ``seq 1000 | parallel -j4 true`` (through ``bash -c``), wall clock
  hyper loop  the same recipe driven in a child interpreter by hypercli's library
              (load_recipe, build_plan, start_or_resume, cluster.up, then
              ``hypercli.scheduler.Scheduler(...).run()``); the figure is Scheduler.run()
              alone, to separate CLI start-up and setup from the dispatch loop.

After every hypercli run the state file is opened with ``hypercli.state.State`` and checked:
1,000 tasks succeeded, 1,000 attempts all ``succeeded``, none other. From the attempts'
timestamps it also reports where a slot's time goes (launch latency, task run time, and the
gap between one attempt's end and the next launch on the same slot).

Goal reported against: hyper CLI rate >= 0.5 x GNU parallel's rate, with every attempt
recorded as succeeded.

CPU time: the benchmark makes itself the subreaper of its descendants (Linux prctl), so the
node agents of hypercli (which detach from their connection and supervise the tasks they
started) are reaped here like parallel's children, and RUSAGE_CHILDREN gives each side's
whole CPU cost per task -- a figure much less sensitive to other load on the machine than
wall time. The in-process side also splits it into the scheduler process and the node agents
with their task shells.

Each hypercli run gets a fresh HYPER_HOME (a temp folder; all are removed at the end, not
between runs -- see new_home); ~/.hyper is never touched. Processes left behind (none
expected) are found by their HYPER_HOME in /proc/<pid>/environ or by the pids in the attempt
folders and killed by pid.

Usage (from the repo root):  python bench/bench_dispatch.py [--rounds 3] [--tasks 1000]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
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

WORKERS = 4
RECIPE_NAME = "dispatch"


def recipe_text(n: int) -> str:
    return (f"version: 1\nname: {RECIPE_NAME}\n"
            f"cluster: {{provider: local, workers: {WORKERS}}}\n"
            f"experiments:\n  t:\n    sampling: grid\n    samples: {n}\n"
            f"    command: \"true\"\n")


# -- process hygiene and CPU accounting ---------------------------------------------------------


def become_subreaper() -> bool:
    """Make this process the reaper of its orphaned descendants (Linux prctl
    PR_SET_CHILD_SUBREAPER), so hypercli's detached node agents (and, through them, their
    task shells) are reaped here and their CPU time shows in RUSAGE_CHILDREN like GNU
    parallel's children do."""
    try:
        import ctypes
        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def reap(deadline_s: float = 5.0) -> int:
    """Wait for every child (including adopted orphans) that has ended or ends within the
    deadline; returns how many were reaped."""
    n, end = 0, time.monotonic() + deadline_s
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return n
        if pid == 0:
            if time.monotonic() > end:
                return n
            time.sleep(0.02)
            continue
        n += 1


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime



def _procs_with_home(home: str) -> list[int]:
    """Pids of live processes whose environment has HYPER_HOME=home (ours, by construction)."""
    needle = f"HYPER_HOME={home}".encode() + b"\0"
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit() or int(d) == os.getpid():
            continue
        try:
            with open(f"/proc/{d}/environ", "rb") as f:
                if needle in f.read() + b"\0":
                    out.append(int(d))
        except OSError:
            continue
    return out


def cleanup(home: str) -> int:
    """Kill, by pid, whatever the run under ``home`` left alive; returns how many."""
    killed = 0
    for pidfile in Path(home).glob("local/tasks/*/pid"):
        try:
            pid = json.loads(pidfile.read_text()).get("pid")
        except (OSError, ValueError):
            continue
        if pid and not (pidfile.parent / "exit").exists():
            try:
                os.killpg(int(pid), signal.SIGKILL)
                killed += 1
            except (ProcessLookupError, PermissionError):
                pass
    for pid in _procs_with_home(home):
        try:
            os.kill(pid, signal.SIGKILL)
            killed += 1
        except (ProcessLookupError, PermissionError):
            pass
    return killed


# -- verification from the state file ---------------------------------------------------------


def verify(home: str, n: int) -> dict:
    """Open the run's state file with hypercli.state.State and check every attempt."""
    from hypercli.state import State
    st = State(Path(home) / "state.db")
    try:
        wf = st.latest_workflow(RECIPE_NAME)
        if wf is None:
            raise AssertionError("no workflow in the state file")
        tasks = st.tasks(wf["id"])
        attempts = st.attempts(wf["id"])
    finally:
        st.close()
    t_status: dict[str, int] = {}
    for t in tasks:
        t_status[t["status"]] = t_status.get(t["status"], 0) + 1
    a_status: dict[str, int] = {}
    for a in attempts:
        a_status[a["status"]] = a_status.get(a["status"], 0) + 1
    ok = (wf["status"] == "succeeded" and t_status == {"succeeded": n}
          and a_status == {"succeeded": n} and len(attempts) == n)
    # where a slot's time goes, from the recorded timestamps
    launch = [a["started_at"] - a["created_at"] for a in attempts if a["started_at"]]
    runtime = [a["ended_at"] - a["started_at"] for a in attempts
               if a["started_at"] and a["ended_at"]]
    gaps = []
    by_node: dict[str, list] = {}
    for a in attempts:
        by_node.setdefault(a["node"], []).append(a)
    for rows in by_node.values():
        rows.sort(key=lambda a: a["created_at"])
        for prev, nxt in zip(rows, rows[1:]):
            if prev["ended_at"]:
                gaps.append(nxt["created_at"] - prev["ended_at"])
    med = (lambda xs: statistics.median(xs) * 1000 if xs else float("nan"))
    return {"ok": ok, "workflow": wf["id"], "workflow_status": wf["status"],
            "tasks": t_status, "attempts": a_status, "n_attempts": len(attempts),
            "launch_ms": med(launch), "run_ms": med(runtime), "gap_ms": med(gaps),
            "per_node": {k: len(v) for k, v in sorted(by_node.items())},
            "bad": [(a["id"], a["status"], a["error"], _exit_file(home, a["id"]))
                    for a in attempts if a["status"] != "succeeded"][:5]}


def _exit_file(home: str, attempt_id: str):
    """What the node's attempt folder says about how the attempt ended (its ``exit`` file)."""
    try:
        return "exit file: " + (Path(home) / "local" / "tasks" / attempt_id / "exit").read_text()
    except OSError:
        return "no exit file"


# -- the sides ----------------------------------------------------------------------------------


HOMES: list[str] = []  # removed at the very end (see new_home)
TMPDIR: str | None = None


def new_home() -> str:
    """A fresh HYPER_HOME. Not deleted until the benchmark ends: deleting ~10,000 files between
    sides makes file creation in the next side slower on ext4 without a journal (the inode
    allocator skips inodes deleted in the last 60 s), which would bias the next figure."""
    home = tempfile.mkdtemp(prefix="hyper-bench-dispatch-", dir=TMPDIR)
    HOMES.append(home)
    return home


def remove_homes() -> None:
    for home in HOMES:
        cleanup(home)
        shutil.rmtree(home, ignore_errors=True)
    HOMES.clear()


def run_hyper_cli(n: int, timeout: float) -> dict:
    home = new_home()
    try:
        recipe = Path(home) / "work" / "dispatch.yaml"
        recipe.parent.mkdir()
        recipe.write_text(recipe_text(n))
        env = dict(os.environ, HYPER_HOME=home, PYTHONPATH=str(ROOT))
        cmd = [sys.executable, "-m", "hypercli", "run", str(recipe), "--on-interrupt", "cancel"]
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGINT)  # --on-interrupt cancel
            try:
                out, _ = p.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                out, _ = p.communicate()
            raise SystemExit(f"hyper run exceeded {timeout} s:\n{out.decode(errors='replace')}")
        wall = time.perf_counter() - t0
        # exit code 1 = some task failed: not fatal for the benchmark, verify() reports it
        if p.returncode not in (0, 1) or not (Path(home) / "state.db").exists():
            raise SystemExit(f"hyper run exited {p.returncode}:\n{out.decode(errors='replace')}")
        v = verify(home, n)
        v.update(side="hyper-cli", seconds=wall, rate=n / wall, exit_code=p.returncode,
                 leftovers=cleanup(home))
        return v
    finally:
        cleanup(home)


def run_parallel(n: int, timeout: float) -> dict:
    cmd = f"seq {n} | parallel -j{WORKERS} true"
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=timeout,
                       start_new_session=True)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"`{cmd}` exited {p.returncode}: {p.stderr.decode(errors='replace')}")
    return {"side": "parallel", "seconds": wall, "rate": n / wall}


def run_hyper_loop(n: int, timeout: float) -> dict:
    home = new_home()
    try:
        recipe = Path(home) / "work" / "dispatch.yaml"
        recipe.parent.mkdir()
        recipe.write_text(recipe_text(n))
        env = dict(os.environ, HYPER_HOME=home, PYTHONPATH=str(ROOT))
        p = subprocess.run([sys.executable, __file__, "--child-loop", str(recipe)], cwd=ROOT,
                           env=env, capture_output=True, text=True, timeout=timeout,
                           start_new_session=True)
        if p.returncode != 0:
            raise SystemExit(f"in-process run failed:\n{p.stdout}\n{p.stderr}")
        r = json.loads(p.stdout.strip().splitlines()[-1])
        v = verify(home, n)
        v.update(side="hyper-loop", seconds=r["loop"], setup=r["setup"], imports=r["imports"],
                 rate=n / r["loop"], cpu_split=r.get("cpu_split"), leftovers=cleanup(home))
        return v
    finally:
        cleanup(home)


def child_loop(recipe_path: str) -> dict:
    """In a child with HYPER_HOME set: plan and set up as ``hyper run`` does, then time
    Scheduler.run() alone."""
    t0 = time.perf_counter()
    from hypercli import cluster as C
    from hypercli.providers import get_provider
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import load, start_or_resume
    t1 = time.perf_counter()
    state = State()
    recipe, wf = load(recipe_path)
    wid, _ = start_or_resume(state, recipe, wf)
    provider = get_provider(recipe.cluster.provider)
    nodes = C.up(state, recipe.cluster, provider)
    split = become_subreaper()
    self0 = resource.getrusage(resource.RUSAGE_SELF)
    kids0 = children_cpu()
    t2 = time.perf_counter()
    summary = Scheduler(state, wid, provider, nodes, on_interrupt=lambda: "cancel").run()
    t3 = time.perf_counter()
    state.close()
    self1 = resource.getrusage(resource.RUSAGE_SELF)
    reap()  # the detached agents, once their last task has ended
    agents = children_cpu() - kids0
    if summary.interrupted:  # a failed task is reported by verify(), an interrupt is not
        raise SystemExit(f"run ended {summary}")
    out = {"imports": t1 - t0, "setup": t2 - t1, "loop": t3 - t2,
           "exit_code": summary.exit_code}
    if split:
        out["cpu_split"] = {
            "scheduler process": (self1.ru_utime + self1.ru_stime)
            - (self0.ru_utime + self0.ru_stime),
            "node agents + task shells": agents}
    return out


def cli_startup(rounds: int) -> float:
    """Median wall time of ``python -m hypercli --help`` (interpreter + click import)."""
    ts = []
    env = dict(os.environ, HYPER_HOME=new_home(), PYTHONPATH=str(ROOT))
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "hypercli", "--help"], cwd=ROOT, env=env,
                       capture_output=True, check=True, timeout=60)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--timeout", type=float, default=900, help="s per run")
    ap.add_argument("--no-loop", action="store_true", help="skip the in-process figure")
    ap.add_argument("--json", metavar="FILE", help="also write the raw results here")
    ap.add_argument("--tmpdir", metavar="DIR", help="where the temp HYPER_HOMEs go (default: "
                    "the system temp folder; e.g. /dev/shm to take the disk out of the figure)")
    ap.add_argument("--child-loop", metavar="RECIPE", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child_loop:
        print(json.dumps(child_loop(a.child_loop)))
        return 0
    global TMPDIR
    TMPDIR = a.tmpdir
    try:
        return bench(a)
    finally:
        remove_homes()


def bench(a) -> int:
    if shutil.which("parallel") is None:
        raise SystemExit("GNU parallel is missing: apt-get install -y parallel")
    ver = subprocess.run(["parallel", "--version"], capture_output=True, text=True).stdout
    print(f"hypercli {code_version()}, {time.strftime('%Y-%m-%d %H:%M:%S')}")
    print(f"python {sys.version.split()[0]}, {ver.splitlines()[0]}, {os.cpu_count()} CPUs, "
          f"{a.tasks} tasks of `true`, {WORKERS} slots, {a.rounds} rounds alternating, medians")
    probe = tempfile.mkdtemp(dir=TMPDIR)
    fs = subprocess.run(["df", "--output=fstype", probe], capture_output=True,
                        text=True).stdout.split()[-1]
    os.rmdir(probe)
    print(f"HYPER_HOMEs under {TMPDIR or tempfile.gettempdir()} ({fs}); "
          f"load average before: {os.getloadavg()[0]:.2f}")
    subreaper = become_subreaper()
    results: dict[str, list[dict]] = {"hyper-cli": [], "parallel": [], "hyper-loop": []}
    for i in range(a.rounds):
        for side, fn in (("hyper-cli", run_hyper_cli), ("parallel", run_parallel),
                         ("hyper-loop", run_hyper_loop)):
            if side == "hyper-loop" and a.no_loop:
                continue
            cpu0 = children_cpu()
            r = fn(a.tasks, a.timeout)
            r["reaped_orphans"] = reap()
            r["cpu_s"] = children_cpu() - cpu0
            results[side].append(r)
            extra = ""
            if "ok" in r:
                extra = (f"  state: {r['n_attempts']} attempts {r['attempts']}, tasks "
                         f"{r['tasks']} -> {'verified' if r['ok'] else 'NOT VERIFIED'}; "
                         f"median launch {r['launch_ms']:.1f} ms, run {r['run_ms']:.1f} ms, "
                         f"end->next launch gap {r['gap_ms']:.1f} ms")
            r["load1"] = os.getloadavg()[0]
            cpu = (f", CPU {r['cpu_s'] / a.tasks * 1000:.1f} ms/task" if subreaper else "")
            print(f"round {i + 1} {side:<10} {r['seconds']:7.2f} s  {r['rate']:7.1f} tasks/s"
                  f"  (load {r['load1']:.1f}{cpu})" + extra, flush=True)
            if r.get("cpu_split"):
                print("    CPU ms/task in the loop: " + ", ".join(
                    f"{k} {v / a.tasks * 1000:.1f}" for k, v in r["cpu_split"].items()))
            if r.get("bad"):
                print(f"    attempts not succeeded: {r['bad']}", flush=True)
    startup = cli_startup(a.rounds)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    med = {k: statistics.median(r["seconds"] for r in v) for k, v in results.items() if v}
    rate = {k: a.tasks / s for k, s in med.items()}
    all_ok = all(r["ok"] for k in ("hyper-cli", "hyper-loop") for r in results[k])
    print()
    print(f"hyper CLI   : median {med['hyper-cli']:.2f} s = {rate['hyper-cli']:.1f} tasks/s "
          f"(includes start-up; `python -m hypercli --help` alone: {startup:.2f} s)")
    print(f"GNU parallel: median {med['parallel']:.2f} s = {rate['parallel']:.1f} tasks/s")
    if "hyper-loop" in med:
        setup = statistics.median(r["setup"] for r in results["hyper-loop"])
        print(f"hyper loop  : median {med['hyper-loop']:.2f} s = {rate['hyper-loop']:.1f} "
              f"tasks/s (Scheduler.run() only; setup before it {setup:.2f} s)")
    ratio = rate["hyper-cli"] / rate["parallel"]
    per_round = [p["seconds"] / h["seconds"]
                 for h, p in zip(results["hyper-cli"], results["parallel"])]
    print(f"ratio hyper CLI / parallel (tasks/s): {ratio:.2f} (ratio of the medians; "
          f"per round: {', '.join(f'{x:.2f}' for x in per_round)})")
    if "hyper-loop" in rate:
        print(f"ratio hyper loop / parallel (tasks/s): {rate['hyper-loop'] / rate['parallel']:.2f}")
    if subreaper:
        cpu = {k: statistics.median(r["cpu_s"] for r in v) / a.tasks * 1000
               for k, v in results.items() if v}
        print("CPU time per task (user+sys of every process each side started, detached "
              "ones included), median: " + ", ".join(f"{k} {v:.1f} ms" for k, v in cpu.items())
              + f"; hyper CLI / parallel {cpu['hyper-cli'] / cpu['parallel']:.2f}")
    print(f"every attempt recorded as succeeded in SQLite: {'yes' if all_ok else 'NO'}")
    print(f"goal: hyper >= 0.5 x GNU parallel's rate with every attempt recorded -> "
          f"{'MET' if ratio >= 0.5 and all_ok else 'MISSED'}")
    if a.json:
        Path(a.json).write_text(json.dumps({"results": results, "startup": startup},
                                           indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
