#!/usr/bin/env python3
"""Overhead of utilisation sampling (hypercli/usage.py, the agent's sampler) on the SSH
dispatch benchmark: N trivial tasks (``true``) over 4 SSH test hosts (tests/sshhosts.py; needs
root), one at a time per host, run in this process as bench_ssh.py's "hyper lib" side
(``prepare_run`` then ``Scheduler.run()``), with sampling

    off      HYPER_SAMPLE_EVERY=0: the agents take no samples, answers carry none
    on 5s    HYPER_SAMPLE_EVERY=5 (the default)
    on 0.5s  HYPER_SAMPLE_EVERY=0.5 (ten times the default rate: the cost of a sample shows)

every round on the same 4-host pool, the sides in a rotating order. A host's CPU per trivial
task (~10 ms: bash, the agent's bookkeeping, sshd) varies more from run to run than sampling
can cost, so the cost of one sample is also measured on its own: on one host, the agent's
sampler (hypercli/node/agent.py, ``_Sampler.sample``) with one running ``sleep`` attempt,
SAMPLE_LOOPS times, CPU time per sample; with the samples the "on 5s" runs took, that gives
the CPU sampling adds per task. Per side and round:
tasks/s = N / run(), and the CPU the hosts used per task (CPU seconds of every process of the
4 hosts, read from each host's init, which reaps the agents once they have exited, over the
run, divided by N). Medians over the rounds; the goal: "on 5s" loses ≤ 3% of the tasks/s of
"off" and costs ≤ 0.1 ms more host CPU per task.

    python bench/bench_sampling.py [--tasks 1000] [--rounds 5] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_ssh import (HostPool, check_attempts, close_provider, fresh_home,  # noqa: E402
                       host_cpu, loadavg, med, write_recipe)
from sshhosts import _ns_id, _pids_in_ns  # noqa: E402

SIDES = {"off": "0", "on 5s": "5", "on 0.5s": "0.5"}
SAMPLE_LOOPS = 200
SAMPLE_COST = r"""
import os, subprocess, sys, time
sys.path.insert(0, "/tmp")
import agent
p = subprocess.Popen(["sleep", "30"], start_new_session=True)
s = agent._Sampler("/root")
s.sample({"a": (p.pid, [])}, time.time())
t0 = time.process_time()
for i in range(%d):
    s.sample({"a": (p.pid, [])}, time.time())
dt = time.process_time() - t0
p.kill(); p.wait()
print(1e3 * dt / %d)
""" % (SAMPLE_LOOPS, SAMPLE_LOOPS)


def sample_cost_ms(host) -> float:
    """CPU ms of one sample by the agent's sampler on ``host`` (see the module docstring)."""
    import shutil
    shutil.copy(Path(__file__).resolve().parents[1] / "hypercli" / "node" / "agent.py",
                host.root / "tmp" / "agent.py")
    out = host.run("python3 -", input=SAMPLE_COST, check=True)
    return float(out.stdout.strip())


def settle(hosts, timeout: float = 10.0) -> None:
    """Wait until every host runs nothing but its sshd (the agents have exited and were
    reaped, so their CPU time is counted by host_cpu)."""
    ids = [_ns_id(h.pid, "pid") for h in hosts]
    deadline = time.time() + timeout
    while time.time() < deadline:
        if all(len(_pids_in_ns("pid", i)) <= 1 for i in ids):
            return
        time.sleep(0.05)


def one(pool, hosts, side: str, n: int) -> dict:
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    os.environ["HYPER_SAMPLE_EVERY"] = SIDES[side]
    home = fresh_home()
    name = "samp"
    path = write_recipe(home, name, hosts, pool.client_key,
                        {"t": {"sampling": "grid", "samples": n, "command": "true"}})
    state = State()
    wid, _, prov, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    settle(hosts)
    cpu0 = host_cpu(hosts)
    t1 = time.perf_counter()
    try:
        summary = Scheduler(state, wid, prov, nodes).run()
    finally:
        t2 = time.perf_counter()
        lock.release()
        close_provider(prov, name, nodes)
    settle(hosts)
    cpu1 = host_cpu(hosts)
    assert summary.exit_code == 0, summary
    check_attempts(state, wid, n)
    samples = len(state.samples(nodes_only=True))  # samples taken (one node row each)
    if side == "off":
        assert samples == 0, samples
    else:
        assert samples > 0, "sampling on, but no samples stored"
    state.close()
    return {"rate": n / (t2 - t1), "cpu_ms": 1e3 * (cpu1 - cpu0) / n, "samples": samples}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", type=int, default=1000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", help="also write the Markdown results here")
    args = ap.parse_args()
    res: dict[str, list] = {s: [] for s in SIDES}
    with HostPool() as pool:
        hosts = pool.start(4)
        for r in range(args.rounds):
            order = list(SIDES)[r % len(SIDES):] + list(SIDES)[:r % len(SIDES)]
            for side in order:
                x = one(pool, hosts, side, args.tasks)
                res[side].append(x)
                print(f"round {r + 1} {side:>8}: {x['rate']:7.1f} tasks/s, host CPU "
                      f"{x['cpu_ms']:.3f} ms/task, {x['samples']} samples "
                      f"(load {loadavg()})", flush=True)
        cost = med([sample_cost_ms(hosts[0]) for _ in range(3)])
    off_rate = med([x["rate"] for x in res["off"]])
    off_cpu = med([x["cpu_ms"] for x in res["off"]])
    lines = [f"Sampling overhead, {args.tasks} trivial tasks over 4 SSH test hosts, "
             f"{args.rounds} rounds (medians):", "",
             "| sampling | tasks/s | vs off | host CPU ms/task | vs off (ms/task) | samples |",
             "|---|---|---|---|---|---|"]
    for side, xs in res.items():
        rate, cpu = med([x["rate"] for x in xs]), med([x["cpu_ms"] for x in xs])
        lines.append(f"| {side} | {rate:.0f} | {100 * (rate / off_rate - 1):+.1f}% | "
                     f"{cpu:.3f} | {cpu - off_cpu:+.3f} | {med([x['samples'] for x in xs]):.0f} |")
    per_task = cost * med([x["samples"] for x in res["on 5s"]]) / args.tasks
    lines += ["", f"One sample costs {cost:.3f} ms of CPU on a host (median of 3 x "
              f"{SAMPLE_LOOPS}); at the \"on 5s\" runs' sample count that is {per_task:.4f} ms "
              "per task."]
    text = "\n".join(lines)
    print("\n" + text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
