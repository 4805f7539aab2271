#!/usr/bin/env python3
"""Scheduling efficiency at 1, 4, 8 and 12 nodes, in the form of a distributed-training
scaling table: speedup(n) = T(1) / T(n), efficiency(n) = speedup(n) / n.

Reference point (not a peer run here): BigDL (Dai et al., SoCC 2019), Table: scaling
efficiency — BigDL on Spark reached an efficiency of 0.81 at 4 nodes and 0.33 at 12 nodes.
Here the work is trivially parallel (``sleep``), so what the table measures is the scheduler
alone: how much of each node's time goes to anything but the task.

The nodes are real SSH test hosts (tests/sshhosts.py: sshd in its own network/PID/mount
namespaces on the 10.213.0.0/24 bridge; needs root). One pool of 12 hosts is started; a run
on n nodes uses its first n hosts. Every hyper run gets a fresh HYPER_HOME (never ~/.hyper).

A. Tasks: N tasks (default 96, 24 with --quick) of ``sleep S`` (S = --seconds, default 2) on
   n = 1, 4, 8, 12 nodes (1, 4 with --quick), one task per node at a time so that nodes =
   workers as in the paper's table: the experiment asks ``resources: {cpus: C}`` where C is
   the CPU count the hosts report (they share this machine: ``os.cpu_count()``; checked
   against every node's ``info.cpus`` after bring-up, and from the state file: no node ever
   ran two attempts at once).
     hyper         recipe ``cluster: {provider: ssh, hosts: [first n hosts], identity_file:
                   KEY}``, ``experiments: {t: {sampling: grid, samples: N, resources: {cpus:
                   C}, command: "sleep S"}}``, run in this process: ``prepare_run(
                   trust_new_hosts=True)`` (bring-up + bootstrap, not timed) then
                   ``Scheduler(...).run()``, timed.
     parallel      ``seq N | parallel -N0 --joblog LOG -S 1/root@IP1,...,1/root@IPn --ssh
                   'ssh -i KEY -o UserKnownHostsFile=KNOWN -o StrictHostKeyChecking=yes -o
                   BatchMode=yes' sleep S`` (one job per host at a time), wall clock.
     parallel -M   the same plus ``-M`` (ssh ControlMaster: one connection per host).
   Per side and n: T(n), speedup T(1)/T(n), efficiency speedup/n, the ideal time
   ceil(N/n)*S and the efficiency against it, ideal/T(n). Then hyper/parallel time ratios.
   Goal: hyper's efficiency >= 0.95 at 12 nodes. Where hyper's time goes is read from the
   state file: created->started (launch), the task's own run beyond S, ended->next created on
   the same node (the scheduler's reaction), the first launch after run() starts, the tail
   after the last task ends.

B. Gangs: K tasks (default 6) of ``nodes: n`` (every host; ``resources: {cpus: C}`` so that
   one gang holds all n nodes) running ``sleep S``, at n = 4, 8, 12 (4 with --quick). The
   gangs run one after the other: ideal K*S. Printed: T, efficiency ideal/T and the mean
   overhead per gang attempt T/K - S, with its parts (all ranks started, end of the last rank
   -> next gang created). No peer is run: GNU parallel has no all-or-nothing multi-node job.

Every run is checked from its state file (hyper: N attempts, all succeeded, over N tasks;
gangs: K tasks x n ranks, one attempt each, ranks 0..n-1 on n distinct nodes) or from
parallel's exit code and --joblog (N jobs exit 0, at most one per host at a time, on n hosts).

Figures vary +-50% run to run on this 2-core machine (other jobs run on it too); each is one
measurement (no rounds: a full run already takes ~15 minutes).

Usage (from the repo root, as root):
    python bench/bench_scale.py [--quick] [--seconds S] [--only A,B] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402

from sshhosts import HostPool, _keygen, _wait_all  # noqa: E402

TEMP_DIRS: list[str] = []
# Workflow names unique to this invocation: a node's agent keeps the attempts it ran under
# their ids (workflow-task-number), and a fresh HYPER_HOME numbers workflows from 1 again, so
# a second run of one name on the same hosts would be answered with the first run's attempts
RUN_TAG = f"{os.getpid() % 10000:04d}{int(time.time()) % 10000:04d}"
_runs = iter(range(1, 10**6))
BIGDL = {4: 0.81, 12: 0.33}  # BigDL (Dai et al., SoCC 2019), Table: scaling efficiency
GOAL_NODES, GOAL_EFF = 12, 0.95


# ------------------------------------------------------------------------------ helpers

def tmpdir(prefix: str) -> str:
    d = tempfile.mkdtemp(prefix=prefix)
    TEMP_DIRS.append(d)
    return d


def fresh_home() -> str:
    """A fresh, empty HYPER_HOME for this process."""
    home = tmpdir("hyper-bench-scale-home-")
    os.environ["HYPER_HOME"] = home
    return home


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def fmt(x, spec=".2f", none="—"):
    return none if x is None else format(x, spec)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def code_version() -> str:
    """``git describe`` of the repo, plus a digest of hypercli/ when it has local changes."""
    try:
        desc = subprocess.run(["git", "describe", "--always", "--tags"], cwd=ROOT,
                              capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hypercli"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    if not dirty:
        return desc
    import hashlib
    h = hashlib.sha256()
    for f in sorted((ROOT / "hypercli").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return f"{desc} + uncommitted changes in hypercli/ (working tree *.py sha256 " \
           f"{h.hexdigest()[:12]})"


def write_recipe(home: str, name: str, hosts, key: Path, experiments: dict) -> Path:
    recipe = {"name": name,
              "cluster": {"provider": "ssh", "hosts": [h.address() for h in hosts],
                          "identity_file": str(key)},
              "experiments": experiments}
    path = Path(home) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def ssh_cmd(pool) -> str:
    return (f"ssh -i {pool.client_key} -o UserKnownHostsFile={pool.known_hosts} "
            "-o StrictHostKeyChecking=yes -o BatchMode=yes")


def close_provider(prov, cluster: str, nodes) -> None:
    try:
        prov.terminate(cluster, nodes)
    except Exception:
        pass


def max_overlap(intervals) -> int:
    """The most intervals (start, end) open at once."""
    ev = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                key=lambda x: (x[0], x[1]))
    cur = peak = 0
    for _, d in ev:
        cur += d
        peak = max(peak, cur)
    return peak


# ----------------------------------------------------------------------------- hyper runs

def run_hyper(pool, hosts, name: str, experiments: dict, cpus: int):
    """prepare_run (not timed) + Scheduler.run() (timed). Returns (state, wid, nodes, t_run,
    run start and end as time.time(), prepare seconds)."""
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    home = fresh_home()
    path = write_recipe(home, name, hosts, pool.client_key, experiments)
    state = State()
    t0 = time.perf_counter()
    wid, _, prov, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    prep = time.perf_counter() - t0
    try:
        reported = sorted({(nd.get("info") or {}).get("cpus") for nd in nodes})
        if reported != [cpus] or len(nodes) != len(hosts):
            raise AssertionError(f"{len(nodes)} nodes (of {len(hosts)}) report cpus "
                                 f"{reported}, the benchmark asks {cpus} per task: a node "
                                 "would not hold exactly one task")
        w0, t1 = time.time(), time.perf_counter()
        summary = Scheduler(state, wid, prov, nodes).run()
        dt, w1 = time.perf_counter() - t1, time.time()
    finally:
        lock.release()
        close_provider(prov, name, nodes)
    if summary.exit_code != 0:
        raise AssertionError(f"{wid}: exit code {summary.exit_code}: {summary}")
    return state, wid, nodes, dt, w0, w1, prep


def hyper_tasks(pool, hosts, n_tasks: int, secs: float, cpus: int) -> dict:
    n = len(hosts)
    state, wid, nodes, dt, w0, w1, prep = run_hyper(
        pool, hosts, f"scale{n}r{RUN_TAG}{next(_runs)}",
        {"t": {"sampling": "grid", "samples": n_tasks, "resources": {"cpus": cpus},
               "command": f"sleep {secs:g}"}}, cpus)
    try:
        atts = state.attempts(wid)
        statuses = defaultdict(int)
        for a in atts:
            statuses[a["status"]] += 1
        tasks = {a["task"] for a in atts}
        task_st = {t["status"] for t in state.tasks(wid)}
        if not (len(atts) == n_tasks and statuses.get("succeeded") == n_tasks
                and len(tasks) == n_tasks and task_st == {"succeeded"}):
            raise AssertionError(f"{wid}: {len(atts)} attempts over {len(tasks)} tasks, "
                                 f"{dict(statuses)}, task statuses {task_st}")
        by_node = defaultdict(list)
        for a in atts:
            by_node[a["node"]].append(a)
        peak = max(max_overlap([(a["started_at"], a["ended_at"]) for a in lst])
                   for lst in by_node.values())
        if peak != 1:
            raise AssertionError(f"{wid}: a node ran {peak} attempts at once")
        if len(by_node) != n:
            raise AssertionError(f"{wid}: attempts ran on {len(by_node)} of {n} nodes")
        launch = [a["started_at"] - a["created_at"] for a in atts]
        over = [a["ended_at"] - a["started_at"] - secs for a in atts]
        gaps = []
        busy = []
        for lst in by_node.values():
            lst.sort(key=lambda a: a["created_at"])
            gaps += [b["created_at"] - a["ended_at"] for a, b in zip(lst, lst[1:])]
            busy.append(lst[-1]["ended_at"] - lst[0]["created_at"])
        first = min(a["created_at"] for a in atts) - w0
        first_start = min(a["started_at"] for a in atts) - w0
        tail = w1 - max(a["ended_at"] for a in atts)
        per_node = [len(v) for v in by_node.values()]
        return {"T": dt, "prepare": prep, "check": "ok",
                "launch_ms": 1e3 * med(launch), "launch_mean_ms": 1e3 * mean(launch),
                "over_ms": 1e3 * med(over), "over_mean_ms": 1e3 * mean(over),
                "gap_ms": 1e3 * med(gaps) if gaps else None,
                "gap_mean_ms": 1e3 * mean(gaps) if gaps else None,
                "gap_max_ms": 1e3 * max(gaps) if gaps else None,
                "first_created_ms": 1e3 * first, "first_started_ms": 1e3 * first_start,
                "tail_ms": 1e3 * tail, "tasks_per_node": [min(per_node), max(per_node)],
                "node_busy_max": max(busy),
                "attempts": [[a["node"], round(a["created_at"] - w0, 4),
                              round(a["started_at"] - w0, 4), round(a["ended_at"] - w0, 4)]
                             for a in atts]}
    finally:
        state.close()


def hyper_gangs(pool, hosts, k: int, secs: float, cpus: int) -> dict:
    n = len(hosts)
    state, wid, nodes, dt, w0, w1, prep = run_hyper(
        pool, hosts, f"gang{n}r{RUN_TAG}{next(_runs)}",
        {"g": {"sampling": "grid", "samples": k, "nodes": n, "resources": {"cpus": cpus},
               "command": f"sleep {secs:g}"}}, cpus)
    try:
        atts = state.attempts(wid)
        tasks = state.tasks(wid)
        by_task = defaultdict(list)
        for a in atts:
            by_task[a["task"]].append(a)
        bad = []
        if len(tasks) != k or {t["status"] for t in tasks} != {"succeeded"}:
            bad.append(f"{len(tasks)} tasks, statuses {sorted({t['status'] for t in tasks})}")
        if len(atts) != k * n:
            bad.append(f"{len(atts)} attempt rows, expected {k} x {n}")
        for t, lst in by_task.items():
            if {a["number"] for a in lst} != {1}:
                bad.append(f"{t}: attempt numbers {sorted({a['number'] for a in lst})}")
            if sorted(a["rank"] for a in lst) != list(range(n)):
                bad.append(f"{t}: ranks {sorted(a['rank'] for a in lst)}")
            if len({a["node"] for a in lst}) != n:
                bad.append(f"{t}: ranks on {len({a['node'] for a in lst})} distinct nodes")
            if any(a["status"] != "succeeded" for a in lst):
                bad.append(f"{t}: rank statuses {sorted({a['status'] for a in lst})}")
        if bad:
            raise AssertionError(f"{wid}: " + "; ".join(bad))
        gangs = sorted(({"created": min(a["created_at"] for a in lst),
                         "first_started": min(a["started_at"] for a in lst),
                         "all_started": max(a["started_at"] for a in lst),
                         "first_ended": min(a["ended_at"] for a in lst),
                         "all_ended": max(a["ended_at"] for a in lst)}
                        for lst in by_task.values()), key=lambda g: g["created"])
        if max_overlap([(g["first_started"], g["all_ended"]) for g in gangs]) != 1:
            raise AssertionError(f"{wid}: two gangs ran at once")
        all_started = [g["all_started"] - g["created"] for g in gangs]
        spread = [g["all_started"] - g["first_started"] for g in gangs]
        end_skew = [g["all_ended"] - g["first_ended"] for g in gangs]
        gaps = [b["created"] - a["all_ended"] for a, b in zip(gangs, gangs[1:])]
        return {"T": dt, "prepare": prep, "check": "ok", "ranks": k * n,
                "overhead_per_gang": dt / k - secs,
                "all_started_ms": 1e3 * mean(all_started),
                "start_spread_ms": 1e3 * mean(spread),
                "end_skew_ms": 1e3 * mean(end_skew),
                "gap_ms": 1e3 * mean(gaps) if gaps else None,
                "first_created_ms": 1e3 * (gangs[0]["created"] - w0),
                "tail_ms": 1e3 * (w1 - gangs[-1]["all_ended"]),
                "attempts": [[a["task"], a["rank"], a["node"], round(a["created_at"] - w0, 4),
                              round(a["started_at"] - w0, 4), round(a["ended_at"] - w0, 4)]
                             for a in atts]}
    finally:
        state.close()


# --------------------------------------------------------------------------- GNU parallel

def gnu_parallel(pool, hosts, n_tasks: int, secs: float, control_master: bool) -> dict:
    env = dict(os.environ, PARALLEL_HOME=tmpdir("hyper-bench-scale-parallel-"))
    log = Path(env["PARALLEL_HOME"]) / "joblog"
    logins = ",".join(f"1/{h.user}@{h.ip}" for h in hosts)
    cmd = (f"seq {n_tasks} | parallel -N0 {'-M ' if control_master else ''}--joblog {log} "
           f"-S {logins} --ssh {shlex.quote(ssh_cmd(pool))} sleep {secs:g}")
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True,
                       timeout=max(900, 3 * n_tasks * secs), env=env, start_new_session=True)
    dt = time.perf_counter() - t0
    rows = [ln.split("\t") for ln in log.read_text().splitlines()[1:] if ln.strip()]
    ok = {r[0] for r in rows if r[6] == "0" and r[7] == "0"}
    # GNU parallel 20221122 with -M runs the first job of each host twice at once (two
    # joblog rows with one sequence number; both really run): such repeats are counted and
    # left out of the one-job-per-host check
    first: dict = {}
    for r in rows:
        first.setdefault(r[0], r)
    repeats = len(rows) - len(first)
    by_host = defaultdict(list)
    for r in first.values():
        by_host[r[1]].append((float(r[2]), float(r[2]) + float(r[3])))
    peak = max((max_overlap(v) for v in by_host.values()), default=0)
    if p.returncode != 0 or len(ok) != n_tasks or len(by_host) != len(hosts) or peak != 1 \
            or repeats > (len(hosts) if control_master else 0):
        raise AssertionError(f"parallel exited {p.returncode}, {len(ok)}/{n_tasks} jobs ok on "
                             f"{len(by_host)} hosts, peak {peak} per host, {repeats} jobs run "
                             f"twice: {p.stderr[-1500:]}")
    runtimes = [float(r[3]) for r in first.values()]
    return {"T": dt, "check": "ok", "job_runtime_ms": 1e3 * med(runtimes), "repeats": repeats,
            "cmd": cmd.replace(str(pool.client_key), "KEY")
                      .replace(str(pool.known_hosts), "KNOWN")
                      .replace(str(log), "LOG")}


# ---------------------------------------------------------------------------- A. tasks

SIDES = ["hyper", "parallel", "parallel -M"]


def bench_tasks(args, pool, hosts, cpus: int, res: dict, out: list[str]) -> None:
    N, S = args.tasks, args.seconds
    ns = args.nodes
    print(f"\n== A. {N} x `sleep {S:g}` on {', '.join(map(str, ns))} nodes, one task per node "
          f"at a time (resources: {{cpus: {cpus}}}) ==")
    print(f"   load average at start: {loadavg()}", flush=True)
    la0 = loadavg()
    runs: dict = {}
    cmds = {}
    for i, n in enumerate(ns):
        order = SIDES[i % 3:] + SIDES[:i % 3]
        for side in order:
            if side == "hyper":
                g = hyper_tasks(pool, hosts[:n], N, S, cpus)
            else:
                g = gnu_parallel(pool, hosts[:n], N, S, side == "parallel -M")
                cmds[side] = g.pop("cmd")
            g["load"] = loadavg()
            runs[(side, n)] = g
            extra = ""
            if side == "hyper":
                extra = (f"  (prepare_run {g['prepare']:.2f} s, not timed; per task: launch "
                         f"{g['launch_ms']:.0f} ms, run beyond {S:g} s {g['over_ms']:.0f} ms, "
                         f"end->next created {fmt(g['gap_ms'], '.0f')} ms median / "
                         f"{fmt(g['gap_mean_ms'], '.0f')} mean / {fmt(g['gap_max_ms'], '.0f')}"
                         f" max; first launch {g['first_created_ms']:.0f} ms, tail "
                         f"{g['tail_ms']:.0f} ms; tasks per node {g['tasks_per_node'][0]}-"
                         f"{g['tasks_per_node'][1]})")
            else:
                extra = f"  (median job runtime in --joblog {g['job_runtime_ms']:.0f} ms" + (
                    f"; {g['repeats']} job(s) run twice at once" if g["repeats"] else "") + ")"
            print(f"   n={n:2d} {side:12s} {g['T']:8.2f} s  ideal {math.ceil(N / n) * S:6.1f} s"
                  f"  load {g['load']}  check {g['check']}{extra}", flush=True)
    la1 = loadavg()
    table = []
    for n in ns:
        ideal = math.ceil(N / n) * S
        row = {"nodes": n, "ideal": ideal}
        for side in SIDES:
            T, T1 = runs[(side, n)]["T"], runs.get((side, 1), {}).get("T")
            sp = T1 / T if T1 else None
            row[side] = {"T": T, "speedup": sp, "eff": sp / n if sp else None,
                         "eff_ideal": ideal / T}
        row["hyper/parallel"] = runs[("hyper", n)]["T"] / runs[("parallel", n)]["T"]
        row["hyper/parallel -M"] = runs[("hyper", n)]["T"] / runs[("parallel -M", n)]["T"]
        table.append(row)
    res["A"] = {"tasks": N, "seconds": S, "cpus_per_task": cpus, "load_start": la0,
                "load_end": la1, "table": table,
                "runs": {f"{s} n={n}": v for (s, n), v in runs.items()}, "commands": cmds}

    head = ("| nodes | ideal s | hyper T s | speedup | efficiency | vs ideal | parallel T s | "
            "speedup | efficiency | vs ideal | parallel -M T s | speedup | efficiency | "
            "vs ideal | hyper/parallel time | hyper/parallel -M time | BigDL efficiency |")
    lines = [f"### A. {N} × `sleep {S:g}`, one task per node (nodes = workers)", "",
             f"Load average at start {la0}, at end {la1}.", "", head,
             "|" + "|".join(["---:"] * (head.count("|") - 1)) + "|"]
    print("\n   speedup = T(1)/T(n), efficiency = speedup/n, vs ideal = ceil(N/n)*S / T(n)")
    print(f"   {'nodes':>5} {'ideal':>6} | {'hyper T':>8} {'spdup':>6} {'eff':>5} {'vs id':>5} |"
          f" {'par T':>8} {'spdup':>6} {'eff':>5} {'vs id':>5} | {'par-M T':>8} {'spdup':>6}"
          f" {'eff':>5} {'vs id':>5} | {'h/par':>5} {'h/parM':>6} | BigDL eff")
    for row in table:
        n = row["nodes"]
        cells = []
        md = []
        for side in SIDES:
            c = row[side]
            cells.append(f"{c['T']:8.2f} {fmt(c['speedup'], '6.2f'):>6} "
                         f"{fmt(c['eff'], '5.2f'):>5} {c['eff_ideal']:5.2f}")
            md += [f"{c['T']:.2f}", fmt(c["speedup"]), fmt(c["eff"]), f"{c['eff_ideal']:.2f}"]
        bigdl = fmt(BIGDL.get(n))
        print(f"   {n:5d} {row['ideal']:6.1f} | " + " | ".join(cells) +
              f" | {row['hyper/parallel']:5.2f} {row['hyper/parallel -M']:6.2f} | {bigdl}")
        lines.append(f"| {n} | {row['ideal']:.1f} | " + " | ".join(md) +
                     f" | {row['hyper/parallel']:.2f} | {row['hyper/parallel -M']:.2f} | "
                     f"{bigdl} |")
    print("   (BigDL: BigDL (Dai et al., SoCC 2019), Table: scaling efficiency; a reference "
          "point from the paper, not run here)")
    goal_row = next((r for r in table if r["nodes"] == GOAL_NODES), None)
    if goal_row and goal_row["hyper"]["eff"] is not None:
        e, ei = goal_row["hyper"]["eff"], goal_row["hyper"]["eff_ideal"]
        met = "MET" if e >= GOAL_EFF else "NOT MET"
        msg = (f"goal: hyper efficiency >= {GOAL_EFF} at {GOAL_NODES} nodes -> {met} "
               f"(speedup/n {e:.3f}; against the ideal time {ei:.3f})")
        res["A"]["goal"] = {"efficiency": e, "efficiency_vs_ideal": ei, "met": e >= GOAL_EFF}
    else:
        msg = (f"goal: hyper efficiency >= {GOAL_EFF} at {GOAL_NODES} nodes -> not measured "
               f"(n = {', '.join(map(str, ns))})")
    print("   " + msg)
    lines += ["", f"**{msg}**", "",
              "Where hyper's time goes (from the state file; launch = created→started, "
              "beyond S = started→ended less S, gap = ended→next created on the same node):",
              "", "| nodes | T s | ideal s | T − ideal s | launch ms (median) | beyond S ms "
              "(median) | gap ms median / mean / max | first launch ms | tail ms | tasks per "
              "node | prepare_run s (not timed) |", "|---:|---:|---:|---:|---:|---:|---|---:|"
              "---:|---|---:|"]
    for row in table:
        n = row["nodes"]
        g = runs[("hyper", n)]
        lines.append(f"| {n} | {g['T']:.2f} | {row['ideal']:.1f} | {g['T'] - row['ideal']:.2f} "
                     f"| {g['launch_ms']:.0f} | {g['over_ms']:.0f} | {fmt(g['gap_ms'], '.0f')} "
                     f"/ {fmt(g['gap_mean_ms'], '.0f')} / {fmt(g['gap_max_ms'], '.0f')} | "
                     f"{g['first_created_ms']:.0f} | {g['tail_ms']:.0f} | "
                     f"{g['tasks_per_node'][0]}-{g['tasks_per_node'][1]} | "
                     f"{g['prepare']:.2f} |")
    lines += ["", "Commands (KEY = the pool's client key, KNOWN = its known_hosts):", "",
              "- hyper: `prepare_run(State(), RECIPE, trust_new_hosts=True)` (not timed) then "
              "`Scheduler(state, wid, provider, nodes).run()` (timed) in the benchmark's "
              "process; RECIPE `cluster: {provider: ssh, hosts: [first n hosts], "
              f"identity_file: KEY}}`, `experiments: {{t: {{sampling: grid, samples: {N}, "
              f"resources: {{cpus: {cpus}}}, command: 'sleep {S:g}'}}}}`"]
    for side, c in cmds.items():
        lines.append(f"- {side} (n = {ns[-1]}): `{c}`")
    out += lines + [""]


# ----------------------------------------------------------------------------- B. gangs

def bench_gangs(args, pool, hosts, cpus: int, res: dict, out: list[str]) -> None:
    K, S = args.gangs, args.seconds
    ns = [n for n in args.nodes if n >= 2] if args.quick else [4, 8, 12]
    ns = ns or [4]
    print(f"\n== B. {K} gang tasks of `nodes: n` (every host) x `sleep {S:g}`, n = "
          f"{', '.join(map(str, ns))}; ideal {K} x {S:g} = {K * S:g} s ==")
    la0 = loadavg()
    print(f"   load average at start: {la0}", flush=True)
    rows = []
    for n in ns:
        g = hyper_gangs(pool, hosts[:n], K, S, cpus)
        g["nodes"], g["eff_ideal"], g["load"] = n, K * S / g["T"], loadavg()
        rows.append(g)
        print(f"   n={n:2d} hyper {g['T']:7.2f} s  efficiency (ideal/T) {g['eff_ideal']:.3f}  "
              f"overhead per gang attempt {1e3 * g['overhead_per_gang']:.0f} ms  (mean: "
              f"created->all {n} ranks started {g['all_started_ms']:.0f} ms, rank start "
              f"spread {g['start_spread_ms']:.0f} ms, rank end skew {g['end_skew_ms']:.0f} ms,"
              f" last rank ended->next gang created {fmt(g['gap_ms'], '.0f')} ms; first "
              f"launch {g['first_created_ms']:.0f} ms, tail {g['tail_ms']:.0f} ms; "
              f"{g['ranks']} ranks checked {g['check']}; load {g['load']})", flush=True)
    print("   peer: none run — no tool here starts an all-or-nothing job on n hosts at once "
          "(GNU parallel runs independent jobs)")
    la1 = loadavg()
    res["B"] = {"gangs": K, "seconds": S, "load_start": la0, "load_end": la1, "rows": rows}
    lines = [f"### B. {K} gang tasks of `nodes: n` × `sleep {S:g}` (ideal {K * S:g} s)", "",
             f"Load average at start {la0}, at end {la1}. No peer: GNU parallel has no "
             "all-or-nothing multi-node job.", "",
             "| nodes | T s | efficiency ideal/T | overhead per gang attempt ms (T/K − S) | "
             "created → all ranks started ms | rank start spread ms | rank end skew ms | "
             "last rank ended → next gang created ms | first launch ms | tail ms |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for g in rows:
        lines.append(f"| {g['nodes']} | {g['T']:.2f} | {g['eff_ideal']:.3f} | "
                     f"{1e3 * g['overhead_per_gang']:.0f} | {g['all_started_ms']:.0f} | "
                     f"{g['start_spread_ms']:.0f} | {g['end_skew_ms']:.0f} | "
                     f"{fmt(g['gap_ms'], '.0f')} | {g['first_created_ms']:.0f} | "
                     f"{g['tail_ms']:.0f} |")
    lines += ["", f"Recipe: `experiments: {{g: {{sampling: grid, samples: {K}, nodes: n, "
              f"resources: {{cpus: {cpus}}}, command: 'sleep {S:g}'}}}}` on the first n hosts; "
              "run as in A.", ""]
    out += lines


# ---------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="24 tasks, n = 1 and 4; gangs at n = 4")
    ap.add_argument("--seconds", type=float, default=2.0, help="sleep per task (default 2)")
    ap.add_argument("--tasks", type=int, help="tasks of A (default 96, 24 with --quick)")
    ap.add_argument("--gangs", type=int, default=6, help="gang tasks of B (default 6)")
    ap.add_argument("--nodes", help="node counts of A, e.g. 1,4,8,12 (default; 1,4 --quick)")
    ap.add_argument("--only", default="A,B", help="workloads to run: A, B or A,B")
    ap.add_argument("--json", help="write the raw figures here (with every attempt's "
                    "created/started/ended, seconds from the start of run())")
    ap.add_argument("--out", help="also write the Markdown results here")
    args = ap.parse_args()
    args.tasks = args.tasks or (24 if args.quick else 96)
    args.nodes = ([int(x) for x in args.nodes.split(",")] if args.nodes
                  else ([1, 4] if args.quick else [1, 4, 8, 12]))
    only = {s.strip().upper() for s in args.only.split(",")}
    if "A" in only and 1 not in args.nodes:
        ap.error("--nodes must include 1 (speedup is T(1)/T(n))")
    if shutil.which("parallel") is None:
        print("GNU parallel is missing: apt-get install -y parallel", file=sys.stderr)
        return 2
    pv = subprocess.run(["parallel", "--version"], capture_output=True,
                        text=True).stdout.splitlines()[0]
    import paramiko
    version = code_version()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    cpus = os.cpu_count() or 1
    print(f"hypercli {version}; {pv}; paramiko {paramiko.__version__}; Python "
          f"{sys.version.split()[0]}; {cpus} CPUs; {started}")
    print(f"load average at start: {loadavg()}")
    res: dict = {"code": version, "parallel": pv, "started": started, "cpus": cpus,
                 "load_start": loadavg(), "args": vars(args)}
    out = [f"Code: {version}. {pv}; paramiko {paramiko.__version__}; Python "
           f"{sys.version.split()[0]}; {cpus} CPUs (shared with other jobs). Started {started}."
           f" Load average at start {loadavg()}.", ""]
    t_all = time.perf_counter()
    keydir = tmpdir("hyper-bench-scale-key-")
    key = Path(keydir) / "client_key"
    _wait_all([_keygen(key, "hyper-bench")], "ssh-keygen")
    need = max(args.nodes + ([12] if "B" in only and not args.quick else []))
    pool = HostPool(client_key=key)
    try:
        t0 = time.perf_counter()
        hosts = pool.start(need)
        print(f"{need} SSH test hosts up in {time.perf_counter() - t0:.2f} s", flush=True)
        if "A" in only:
            bench_tasks(args, pool, hosts, cpus, res, out)
        if "B" in only:
            bench_gangs(args, pool, hosts, cpus, res, out)
    finally:
        pool.stop()
        for d in TEMP_DIRS:
            shutil.rmtree(d, ignore_errors=True)
    res["load_end"] = loadavg()
    res["total_s"] = time.perf_counter() - t_all
    print(f"\nload average at end: {res['load_end']}; total {res['total_s']:.0f} s")
    out.append(f"Load average at end {res['load_end']}; total {res['total_s']:.0f} s.")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1, default=str) + "\n")
        print(f"wrote {args.json}")
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
