#!/usr/bin/env python3
"""Scale in nodes: 4, 16, 32 and 64 SSH test hosts — is 64 nodes as cheap as 4?

The hosts are real sshd test hosts (tests/sshhosts.py: sshd in its own network/PID/mount
namespaces on the 10.213.0.0/24 bridge; needs root). One pool of max(sizes) hosts is started;
a size n uses its first n hosts. All of them and the driver share this machine's cores.

Per size n:

1. up(n): cold bring-up (``~/.hyper`` removed on every host, a fresh HYPER_HOME: host keys
   pinned again, the agent uploaded again) with ``hypercli.cluster.up`` in this process.
   Measured: wall time; the CPU it cost here and on the hosts (each host's init plus what it
   reaped, after the connections are closed); the *CPU floor*, that CPU divided by the cores,
   which no schedule of the same work can beat on this machine. Goal: up(64) within 1.5x of
   its floor.
2. dispatch: ``--tasks-per-node`` (default 32) x n tasks of ``true`` on the n nodes, in a fresh child
   process (``prepare_run(trust_new_hosts=True)``, untimed, then ``Scheduler.run()``,
   timed). Measured: tasks/s; the driver's CPU per task (``getrusage(RUSAGE_SELF)`` over
   ``run()``: every thread, paramiko's included); the driver's memory: its peak RSS, and per
   node the slope of that peak between the smallest and the largest size (what one more node
   costs; the RSS at 4 nodes also holds imports made lazily and the state file's cache).
   Goals: CPU per task flat within 1.5x from 4 to 64 nodes; <= 4 MiB of driver memory per
   node. Every run is checked
   from its state file (one succeeded attempt per task).
   Peer: GNU parallel ``-S 1/root@IP,...`` over the same n hosts running ``--peer-tasks``
   (default 128) ``true`` jobs; its tasks/s and the ratio.
3. kill recovery: task 0 runs ``sleep 6`` and 4n others ``sleep 0.5`` on the n nodes; one
   second after task 0 is running its host is killed (``host.kill()``); measured from the
   kill to the retry ``running`` in the state file (polled every 10 ms). The host is powered
   back (``restart``) before the next size. Goal: flat within 1.5x from 4 to 64 nodes.

Usage (from the repo root, as root):
    python bench/bench_nodes.py [--sizes 4,16,32,64] [--tasks-per-node 32] [--peer-tasks 128]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_ssh as B  # noqa: E402  (its helpers: hosts, homes, recipes, CPU counters)

ROOT = B.ROOT


def rss_mib() -> float:
    """This process's resident set now, MiB (``/proc/self/statm``)."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


# ------------------------------------------------------------------------- child: dispatch

def child_dispatch(spec: dict) -> dict:
    """One dispatch run in this (fresh) process; returns its figures."""
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    base = rss_mib()
    state = State()
    wid, _, prov, nodes, lock = prepare_run(state, spec["recipe"], trust_new_hosts=True)
    up_rss = rss_mib()
    r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    try:
        summary = Scheduler(state, wid, prov, nodes).run()
    finally:
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        end_rss = rss_mib()
        lock.release()
    B.check_attempts(state, wid, spec["tasks"])
    assert summary.exit_code == 0, summary
    B.close_provider(prov, spec["name"], nodes)
    cpu = (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime)
    return {"run": t1 - t0, "rate": spec["tasks"] / (t1 - t0),
            "cpu_per_task_ms": 1e3 * cpu / spec["tasks"], "base_rss": base,
            "up_rss": up_rss, "end_rss": end_rss, "max_rss": r1.ru_maxrss / 1024,
            "nodes": len(nodes), "threads": threading.active_count()}


# ------------------------------------------------------------------------------- per size

def bench_up(pool, hosts, key) -> dict:
    from hypercli import cluster as C
    from hypercli.providers.ssh import SSHProvider
    from hypercli.state import State
    from hypercli.workflows import cluster_spec
    for h in hosts:
        h.run("rm -rf /root/.hyper", check=True)
    B.fresh_home()
    state = State()
    prov = SSHProvider(trust_new_hosts=True)
    spec = cluster_spec(f"up{len(hosts)}", "ssh", [h.address() for h in hosts],
                        identity_file=str(key))
    c0, h0 = B.own_cpu(), B.host_cpu(hosts)
    t0 = time.perf_counter()
    nodes = C.up(state, spec, prov)
    dt = time.perf_counter() - t0
    c1 = B.own_cpu()
    assert len(nodes) == len(hosts), f"{len(nodes)} of {len(hosts)} nodes up"
    B.close_provider(prov, spec.name, nodes)
    for n in nodes:
        prov.drop(n["name"])
    time.sleep(1.0)  # the hosts' sshd connection processes exit and are reaped
    cpu = (c1 - c0) + (B.host_cpu(hosts) - h0)
    state.close()
    return {"up": dt, "driver_cpu": c1 - c0, "cpu": cpu,
            "floor": cpu / (os.cpu_count() or 1)}


def bench_dispatch(pool, hosts, key, tasks: int) -> dict:
    home = B.fresh_home()
    name = f"d{len(hosts)}"
    path = B.write_recipe(home, name, hosts, key,
                          {"t": {"sampling": "grid", "samples": tasks, "command": "true"}})
    spec = {"recipe": str(path), "tasks": tasks, "name": name}
    p = subprocess.run([sys.executable, __file__, "--child", json.dumps(spec)], cwd=ROOT,
                       capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, HYPER_HOME=home))
    if p.returncode != 0:
        raise AssertionError(f"dispatch child exited {p.returncode}:\n{p.stdout[-2000:]}\n"
                             f"{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def bench_recovery(pool, hosts, key) -> dict:
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    home = B.fresh_home()
    n = len(hosts)
    by_ip = {h.ip: h for h in hosts}
    path = B.write_recipe(home, f"rec{n}", hosts, key, {"work": {
        "parameters": {"i": list(range(4 * n + 1))}, "retries": 2,
        "command": B.RECOVERY_CMD}})
    state = State()
    wid, _, prov, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    victim = next(t["id"] for t in state.tasks(wid) if t["params"]["i"] == 0)
    ip_of = {nd["name"]: nd["address"]["host"] for nd in nodes}
    seen: dict = {}

    def inject():
        try:
            st = State()
            end = time.time() + 120
            while time.time() < end:
                run = [a for a in st.attempts(wid, victim) if a["status"] == "running"]
                if run:
                    break
                time.sleep(0.01)
            else:
                seen["error"] = "task 0 never ran"
                return
            seen["node"] = run[0]["node"]
            seen["host"] = by_ip[ip_of[run[0]["node"]]]
            time.sleep(1.0)
            seen["fault"] = time.time()
            seen["host"].kill()
            end = time.time() + 60
            while time.time() < end:
                if [a for a in st.attempts(wid, victim)
                        if a["number"] >= 2 and a["status"] in ("running", "succeeded")]:
                    seen["running"] = time.time()
                    break
                time.sleep(0.01)
            st.close()
        except Exception as e:  # reported below
            seen["error"] = repr(e)
    th = threading.Thread(target=inject, daemon=True)
    th.start()
    try:
        summary = Scheduler(state, wid, prov, nodes).run()
    finally:
        lock.release()
        th.join(timeout=130)
        B.close_provider(prov, f"rec{n}", nodes)
    if "host" in seen:
        seen["host"].restart()
    if "error" in seen:
        raise AssertionError(seen["error"])
    assert summary.exit_code == 0, summary
    for t in state.tasks(wid):
        sts = [a["status"] for a in state.attempts(wid, t["id"])]
        assert sts.count("succeeded") == 1, (t["id"], sts)
    atts = state.attempts(wid, victim)
    assert atts[0]["status"] == "lost" and atts[0]["node"] == seen["node"], atts
    state.close()
    return {"recovery": seen["running"] - seen["fault"] if "running" in seen else None}


# ---------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,16,32,64")
    ap.add_argument("--tasks-per-node", type=int, default=32, help="dispatch tasks per node")
    ap.add_argument("--peer-tasks", type=int, default=128, help="GNU parallel jobs per size")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_dispatch(json.loads(args.child))))
        return 0
    if os.geteuid() != 0:
        print("bench_nodes: needs root (network namespaces)", file=sys.stderr)
        return 2
    sizes = [int(x) for x in args.sizes.split(",")]
    key = Path(B.tmpdir("hyper-bench-nodes-key-")) / "client_key"
    B._wait_all([B._keygen(key, "bench-nodes")], "client key")
    print(f"hypercli {B.code_version()}; {os.cpu_count()} CPUs; sizes {sizes}")
    res = {}
    with B.HostPool(client_key=key) as pool:
        t0 = time.perf_counter()
        all_hosts = pool.start(max(sizes))
        print(f"started {len(all_hosts)} test hosts in {time.perf_counter() - t0:.1f} s; "
              f"load {B.loadavg()}", flush=True)
        bench_up(pool, all_hosts[:2], key)  # imports and first-use costs, not counted
        for n in sizes:
            hosts = all_hosts[:n]
            r = {"load": B.loadavg()}
            r.update(bench_up(pool, hosts, key))
            print(f"n={n:3d} up {r['up']:.2f} s, CPU floor {r['floor']:.2f} s "
                  f"(ratio {r['up'] / r['floor']:.2f}), driver CPU {r['driver_cpu']:.2f} s",
                  flush=True)
            r.update(bench_dispatch(pool, hosts, key, args.tasks_per_node * n))
            mem = r["max_rss"] - r["base_rss"]
            r["mem_per_node"] = mem / n
            print(f"      dispatch {r['rate']:.0f} tasks/s, driver CPU/task "
                  f"{r['cpu_per_task_ms']:.2f} ms, driver RSS {r['base_rss']:.0f} MiB after "
                  f"imports -> {r['max_rss']:.0f} MiB peak ({r['mem_per_node']:.2f} MiB/node), "
                  f"{r['threads']} threads", flush=True)
            q = B.gnu_parallel(pool, hosts, args.peer_tasks)
            r["parallel_rate"] = q["rate"]
            r["parallel_cmd"] = q["cmd"]
            print(f"      GNU parallel {q['rate']:.1f} tasks/s ({args.peer_tasks} jobs): "
                  f"hyper / parallel {r['rate'] / q['rate']:.1f}x", flush=True)
            r.update(bench_recovery(pool, hosts, key))
            print(f"      kill recovery {B.fmt(r['recovery'])} s", flush=True)
            res[n] = r
    lo, hi = min(sizes), max(sizes)
    print(f"\n== summary ({lo} -> {hi} nodes) ==")
    print("| nodes | up s | CPU floor s | up/floor | tasks/s | parallel tasks/s | ratio | "
          "driver CPU/task ms | driver MiB peak | MiB/node | kill recovery s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for n, r in res.items():
        print(f"| {n} | {r['up']:.2f} | {r['floor']:.2f} | {r['up'] / r['floor']:.2f} | "
              f"{r['rate']:.0f} | {r['parallel_rate']:.1f} | {r['rate'] / r['parallel_rate']:.1f}"
              f" | {r['cpu_per_task_ms']:.2f} | {r['max_rss']:.0f} | {r['mem_per_node']:.2f} | "
              f"{B.fmt(r['recovery'])} |")
    if lo != hi:
        a, b = res[lo], res[hi]
        slope = (b["max_rss"] - a["max_rss"]) / (hi - lo)
        cpu_ratio = b["cpu_per_task_ms"] / a["cpu_per_task_ms"]
        rec = (b["recovery"] / a["recovery"]) if a["recovery"] and b["recovery"] else None
        print(f"driver CPU/task {hi}/{lo}: {cpu_ratio:.2f}x (goal <= 1.5x: "
              f"{'yes' if cpu_ratio <= 1.5 else 'NO'})")
        print(f"kill recovery {hi}/{lo}: {B.fmt(rec)}x (goal <= 1.5x: "
              f"{'yes' if rec is not None and rec <= 1.5 else 'NO'})")
        print(f"driver memory per node (peak RSS slope {lo}->{hi}): {slope:.2f} MiB (goal <= 4:"
              f" {'yes' if slope <= 4 else 'NO'}); at {hi} nodes the peak over the after-imports"
              f" RSS is {b['mem_per_node']:.2f} MiB/node")
        print(f"up({hi}) / CPU floor: {b['up'] / b['floor']:.2f} (goal <= 1.5: "
              f"{'yes' if b['up'] / b['floor'] <= 1.5 else 'NO'})")
    print(f"GNU parallel command (size {hi}): {res[hi]['parallel_cmd']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
