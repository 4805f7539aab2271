#!/usr/bin/env python3
"""CPU cost per short task of the node agent's log pump (``hypercli/node/agent.py``, _Pump:
one thread per agent carries its tasks' stdout and stderr pipes to their logs and writes
``order``), against the agent it replaced (a named git revision's agent.py, default
``main``), both driven here the same way.

Each side: one agent started by ``hypercli.node.client.local_agent`` with its file swapped,
``--tasks`` tasks launched 4 at a time (``launch`` with ``wait``, then ``poll`` until the
four have ended, as the scheduler's 4 slots would), the two agents alive at once and taking
turns batch by batch (the machine's other load falls on both alike); then each agent's CPU
read from
``/proc/<its serving pid>/stat``: its own (utime + stime: the pump's cost is there) and its
reaped tasks' (cutime + cstime: the task shells). Three workloads: ``true``; a task
writing four lines alternating stdout and stderr (so the new agent writes ``order``); and
``true`` under the checkpoint wrapper, as hypercli runs every task (its side loop's ``sleep``
holds the task's stdout and stderr up to 1 s after the task).
``--rounds`` rounds; medians and the ratio this tree / peer are printed. CPU time
is much less sensitive than wall time to the other load on a shared machine; the wall time
is printed too. Last, the pump alone in this process: CPU per line it carries.

Usage (from the repo root): python bench/bench_logs.py [--peer main] [--tasks 400] [--rounds 3]
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

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from hypercli.node import client as C  # noqa: E402

WORKLOADS = {"true": "true",
             "4 lines, alternating": "echo out; echo err >&2; echo out; echo err >&2",
             "true, checkpoint wrapper": "true"}
SLOTS = 4


def cpu(pid: int) -> tuple[float, float]:
    """(own, reaped children's) CPU seconds of process ``pid`` (proc(5) fields 14-17)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        v = f.read().rsplit(b")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return (int(v[11]) + int(v[12])) / tick, (int(v[13]) + int(v[14])) / tick


def both(agents: dict[str, Path], script: str, tasks: int, work: Path,
         wrapped: bool = False) -> dict:
    """Run ``tasks`` tasks through each agent file of ``agents`` ({side: path}), both agents
    alive at once and taking turns batch by batch (so the machine's other load falls on
    both alike): {side: (own CPU ms/task, tasks' CPU ms/task, wall s)}."""
    clients, pids, roots, wall = {}, {}, {}, dict.fromkeys(agents, 0.0)

    def extra(root: Path, attempt: str) -> dict:  # as hypercli runs every task: the
        # checkpoint wrapper, its side loop holding the logs for up to 1 s after the task
        return {"checkpoint": {"dir": str(root / "ck" / attempt), "save": "",
                               "every": 60}} if wrapped else {}
    try:
        for side, path in agents.items():
            C.AGENT_PATH = path
            roots[side] = Path(tempfile.mkdtemp(dir=work))
            clients[side] = C.local_agent("bench", roots[side])
            pids[side] = clients[side].call("hello")["pid"]
        for b in range(0, tasks, SLOTS):
            for side, c in clients.items():
                ids = [f"w.t{b + i}.1" for i in range(SLOTS)]
                t0 = time.monotonic()
                c.call("launch", attempts=[dict({"id": i, "script": script, "env": {},
                                                 "cwd": str(roots[side])}, **extra(roots[side], i))
                                           for i in ids], wait=0.2)
                while any(s["state"] == "running" for s in
                          c.call("poll", ids=ids, wait=5)["states"].values()):
                    pass
                wall[side] += time.monotonic() - t0
        out = {}
        for side, pid in pids.items():
            own, kids = cpu(pid)
            out[side] = (own * 1000 / tasks, kids * 1000 / tasks, wall[side])
        return out
    finally:
        for side, c in clients.items():
            c.close()
            shutil.rmtree(roots[side], ignore_errors=True)


def pump_alone(lines: int, work: Path) -> tuple[float, float]:
    """CPU µs per line the agent's pump spends (this tree's ``_Pump`` in this process, no
    scheduling in between): (lines of one stream, lines alternating between the streams,
    each then carrying an ``order`` record). The writes into the pipes are counted out."""
    sys.path.insert(0, str(ROOT / "hypercli" / "node"))
    import agent as A
    out = []
    for alternate in (False, True):
        d = Path(tempfile.mkdtemp(dir=work))
        pump = A._Pump()
        w = pump.attach("a.1", str(d))
        write = 0.0
        t0 = time.process_time()
        for n in range(lines):
            t = time.process_time()
            os.write(w[n % 2 if alternate else 0], b"a line of output, as a task prints\n")
            write += time.process_time() - t
            pump.carry()
        out.append((time.process_time() - t0 - write) * 1e6 / lines)
        for fd in w:
            os.close(fd)
        pump.drain("a.1")
        pump.release("a.1")
        shutil.rmtree(d, ignore_errors=True)
    return out[0], out[1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peer", default="main", help="git revision of the peer agent")
    ap.add_argument("--tasks", type=int, default=400)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hyper-bench-logs-"))
    try:
        peer = work / "peer-agent.py"
        peer.write_bytes(subprocess.run(["git", "show", f"{a.peer}:hypercli/node/agent.py"],
                                        cwd=ROOT, check=True, capture_output=True).stdout)
        sides = {a.peer: peer, "this tree": ROOT / "hypercli" / "node" / "agent.py"}
        print(f"{os.cpu_count()} CPUs, load average before: {os.getloadavg()[0]:.2f}; "
              f"{a.tasks} tasks per side and workload, {SLOTS} at a time, {a.rounds} rounds "
              "alternating, medians")
        for name, script in WORKLOADS.items():
            got: dict[str, list] = {s: [] for s in sides}
            for r in range(a.rounds):
                for side, res in both(sides, script, a.tasks, work,
                                      "wrapper" in name).items():
                    got[side].append(res)
                    own, kids, wall = res
                    print(f"  {name:22} round {r + 1} {side:10} agent {own:.3f} ms/task, "
                          f"tasks {kids:.3f} ms/task, {wall:.2f} s")
            med = {s: [statistics.median(x[k] for x in v) for k in range(3)]
                   for s, v in got.items()}
            (po, pk, pw), (to, tk, tw) = med[a.peer], med["this tree"]
            print(f"{name}: agent CPU {to:.3f} vs {po:.3f} ms/task ({to / po:.2f}x), "
                  f"agent + tasks {to + tk:.3f} vs {po + pk:.3f} ms/task "
                  f"({(to + tk) / (po + pk):.2f}x), wall {tw:.2f} vs {pw:.2f} s "
                  f"({tw / pw:.2f}x)  [this tree vs {a.peer}]")
        one_stream, alternating = pump_alone(20000, work)
        print(f"the pump alone, 20,000 lines: {one_stream:.1f} µs of CPU per line of one "
              f"stream, {alternating:.1f} µs per line alternating (each an order record)")
        print(f"load average after: {os.getloadavg()[0]:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
