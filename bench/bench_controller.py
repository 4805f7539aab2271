#!/usr/bin/env python3
"""A workflow driven by a controller against the same workflow driven from here, on real SSH
test hosts (tests/sshhosts.py; needs root).

4 hosts: host 0 is the controller, hosts 1-3 the ssh cluster. N trivial tasks (``true``,
default 300). Sides, each on a fresh HYPER_HOME, the order turned by one per round (each
side first once in 3 rounds, after one run not counted: the first run on fresh hosts is
the slowest):
  here        ``python -m hypercli run RECIPE --trust-new-hosts`` (the driver in this process)
  controller  ``python -m hypercli run RECIPE --controller --trust-new-hosts`` (the same
              scheduler on host 0, each launch's intent on a majority of hosts 1-3 before it
              is sent, several in one append: a group commit; the other changes within a
              second; this process follows it, copying its records every second from one
              ``python -m hypercli.controller follow`` there, on the same 2 cores)
  away        the same handed over with ``-d``: nothing of ``hyper`` runs here until the
              controller's drive has ended (its log line, looked for inside host 0 every
              2 s), then ``hyper attach`` copies the records here: the laptop closed
Rate = N / (last attempt's end - first attempt's creation), from the attempts' own times (the
controller's records are copied here at the end): the dispatch rate, without start-up,
bootstrap and handover. Every run is checked: N attempts, all succeeded. Ratios controller /
here and away / here per round, their medians printed (goal >= 0.9, issue 26), and after
each controller run its own account of the run (whole copies and deltas of the records,
intent appends, the launches that waited for theirs). Figures vary +-50% run to run on this
2-core machine; compare within a round.

``--recovery``: the time from a worker's loss to its task running again, with nothing of
``hyper`` running here meanwhile (the laptop away), driven by the controller against driven
from here. 4 fresh hosts per trial (one is killed); 6 tasks, task 0's first attempt runs 60 s,
the others 0.5 s. Once task 0 has run 1 s (seen in the driver's own state file: here, or the
controller's on host 0, read inside the host, not over SSH), its host is killed (power loss,
``host.kill()``); from the driver's records, copied here at the end: fault → first error
seen, → node declared lost, → the retry's attempt created, → started on another host (the
agent's own start time). Each run is checked: every task one success, the retry on another
node. Sides alternate per round; medians printed, and the ratio controller / here of the
time to running again (goal: the same as from here, ~3.5 s: bench/RESULTS.md §2).

Usage (from the repo root, as root):
    python bench/bench_controller.py [--quick] [-n N]
    python bench/bench_controller.py --recovery [--rounds R]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402

from sshhosts import HostPool  # noqa: E402

PACKAGES = sysconfig.get_paths()["purelib"]


def _recipe(pool, controller, workers, home: str, on_controller: bool, exp: dict) -> Path:
    """Write ``home``/r.yaml: experiment ``t`` (``exp``) on the ssh cluster of ``workers``,
    driven by ``controller`` when ``on_controller``; returns its path."""
    cluster = {"provider": "ssh", "hosts": [h.address() for h in workers],
               "identity_file": str(pool.client_key)}
    if on_controller:
        cluster.update(controller=controller.address(), controller_python="/root/py3")
    path = Path(home) / "r.yaml"
    path.write_text(yaml.safe_dump({"name": "b", "workdir": "none", "cluster": cluster,
                                    "experiments": {"t": exp}}))
    return path


#: the sides of a dispatch round: driven from here; by the controller, followed from here
#: (``hyper run --controller``: this process copies its records every second, written by
#: one ``python -m hypercli.controller follow`` on the controller); by the controller with
#: this machine away (``-d``: nothing of ``hyper`` runs here until the end)
SIDES = ("here", "controller", "away")
ENDED = "grep -c 'intent appends' /root/.hyper/controller/controller.log 2>/dev/null"


def one(pool, controller, workers, n: int, side: str) -> float:
    from hypercli.state import State
    on_controller = side != "here"
    home = tempfile.mkdtemp(prefix="bench-ctl-")
    path = _recipe(pool, controller, workers, home, on_controller,
                   {"sampling": "grid", "samples": n, "command": "true"})
    cmd = [sys.executable, "-m", "hypercli", "run", str(path), "--trust-new-hosts"]
    env = dict(os.environ, HYPER_HOME=home, COLUMNS="200")
    drives = int(controller.run(ENDED).stdout.strip() or 0)  # drives ended there so far
    p = subprocess.run(cmd + (["-d"] if side == "away" else []), cwd=ROOT,
                       capture_output=True, text=True, timeout=1800, env=env)
    if p.returncode == 0 and side == "away":  # its drive's last log line, looked for inside
        end = time.time() + 1800                # the host every 2 s (no SSH, no Python)
        while int(controller.run(ENDED).stdout.strip() or 0) <= drives:
            assert time.time() < end, "the controller's drive never ended"
            time.sleep(2)
        p = subprocess.run([sys.executable, "-m", "hypercli", "attach", "b-1"], cwd=ROOT,
                           capture_output=True, text=True, timeout=600, env=env)
    if p.returncode != 0:
        raise AssertionError(f"{cmd} exited {p.returncode}:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    state = State(Path(home) / "state.db")
    atts = state.attempts("b-1")
    assert len(atts) == n and {a["status"] for a in atts} == {"succeeded"}, len(atts)
    span = max(a["ended_at"] for a in atts) - min(a["created_at"] for a in atts)
    state.close()
    if on_controller:  # the controller's own account of its backups (hypercli.controller.host)
        r = controller.run("grep -h 'intent appends' /root/.hyper/controller/controller.log "
                           "| tail -1")
        print("   controller:", r.stdout.strip().split(": ", 1)[-1], flush=True)
    return n / span


#: task 0's first attempt runs long (it is the one whose host is killed), every other 0.5 s
RECOVERY_CMD = ('if [ {{i}} -eq 0 ] && [ "$HYPER_ATTEMPT" = 1 ]; then sleep 60; '
                'else sleep 0.5; fi')


def _py3(host) -> None:
    host.run(f"printf '#!/bin/sh\\nPYTHONPATH=\"$PYTHONPATH:{PACKAGES}\" exec "
             f"/usr/bin/python3 \"$@\"\\n' > /root/py3 && chmod +x /root/py3", check=True)


def _attempts_on(host, wid: str) -> list[dict]:
    """The controller's own records of ``wid``'s attempts, read inside its host."""
    code = ("import json; from hypercli.state import State; "
            f"print(json.dumps(State().attempts({wid!r})))")
    r = host.run("cd /root && HYPER_HOME=/root/.hyper/controller PYTHONPATH=$(ls -d "
                 f"/root/.hyper/lib/* | head -1) /root/py3 -c {json.dumps(code)} "
                 "2>/dev/null", timeout=60)
    try:
        return json.loads(r.stdout)
    except ValueError:
        return []


def recovery(on_controller: bool) -> dict:
    """One trial (module docstring, ``--recovery``): s from the fault to each step."""
    from hypercli.state import State
    pool = HostPool()
    home = tempfile.mkdtemp(prefix="bench-ctl-rec-")
    env = dict(os.environ, HYPER_HOME=home, COLUMNS="200")
    try:
        hosts = pool.start(4, share=(ROOT, PACKAGES))
        controller, workers = hosts[0], hosts[1:]
        _py3(controller)
        path = _recipe(pool, controller, workers, home, on_controller,
                       {"parameters": {"i": list(range(6))}, "retries": 2,
                        "command": RECOVERY_CMD})
        cmd = [sys.executable, "-m", "hypercli", "run", str(path), "--trust-new-hosts"]
        if on_controller:  # handed over, then nothing of hyper runs here until the end
            subprocess.run(cmd + ["-d"], cwd=ROOT, env=env, check=True, capture_output=True,
                           timeout=600)
            p = None
            look = lambda: _attempts_on(controller, "b-1")  # noqa: E731
        else:
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            look = lambda: State(Path(home) / "state.db").attempts("b-1")  # noqa: E731
        end = time.time() + 300
        while time.time() < end:
            run = [a for a in look() if a["task"] == "t-0000" and a["status"] == "running"]
            if run:
                break
            time.sleep(0.05)
        else:
            raise AssertionError("task 0 never ran")
        node = run[0]["node"]
        victim = workers[int(node.rsplit("-", 1)[1])]  # node b-i is workers[i]
        time.sleep(1.0)
        fault = time.time()
        victim.kill()
        if on_controller:
            time.sleep(20)  # away: the controller alone re-runs it
            r = subprocess.run([sys.executable, "-m", "hypercli", "attach", "b-1"], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=600)
            assert r.returncode == 0, r.stdout + r.stderr
            atts = _attempts_on(controller, "b-1")
        else:
            assert p.wait(timeout=600) == 0
            atts = State(Path(home) / "state.db").attempts("b-1")
        for t in {a["task"] for a in atts}:
            sts = [a["status"] for a in atts if a["task"] == t]
            assert sts.count("succeeded") == 1, (t, sts)
        first = next(a for a in atts if a["task"] == "t-0000" and a["number"] == 1)
        retry = next(a for a in atts if a["task"] == "t-0000" and a["number"] >= 2)
        assert first["status"] == "lost" and retry["node"] != node, (first, retry)
        state = State(Path(home) / "state.db")
        evs = [e for e in state.events("b-1", limit=10000) if e["node"] == node]
        state.close()
        lost = next((e["ts"] for e in evs if e["message"].startswith("lost")), None)
        return {"lost": None if lost is None else lost - fault,
                "created": retry["created_at"] - fault,
                "started": retry["started_at"] - fault}
    finally:
        pool.stop()


def main_recovery(rounds: int) -> None:
    got: dict = {False: [], True: []}
    for r in range(rounds):
        for side in ([False, True] if r % 2 == 0 else [True, False]):
            got[side].append(recovery(side))
            g = got[side][-1]
            print(f"round {r + 1} {'controller' if side else 'here':>10}: lost "
                  + (f"{g['lost']:.2f}" if g["lost"] is not None else "?")
                  + f" s, retry created {g['created']:.2f} s, running {g['started']:.2f} s "
                  "after the host's power loss", flush=True)
    med = {side: statistics.median(g["started"] for g in got[side]) for side in got}
    print(f"loss → running again, median of {rounds}: here {med[False]:.2f} s, controller "
          f"{med[True]:.2f} s, controller / here {med[True] / med[False]:.2f} "
          "(goal: about the same, ~3.5 s)")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="one round instead of three")
    ap.add_argument("-n", type=int, default=300, help="tasks per run")
    ap.add_argument("--recovery", action="store_true",
                    help="time from a worker's loss to its task running again")
    ap.add_argument("--rounds", type=int, default=3, help="--recovery: rounds")
    args = ap.parse_args()
    if args.recovery:
        main_recovery(args.rounds)
        return
    rounds = 1 if args.quick else 3
    pool = HostPool()
    try:
        hosts = pool.start(4, share=(ROOT, PACKAGES))
        controller, workers = hosts[0], hosts[1:]
        controller.run(f"printf '#!/bin/sh\\nPYTHONPATH=\"$PYTHONPATH:{PACKAGES}\" exec "
                       f"/usr/bin/python3 \"$@\"\\n' > /root/py3 && chmod +x /root/py3",
                       check=True)
        # the first run on fresh hosts is the slowest of a bench (its side, "here" until
        # this was added, lost 10-30% in round 1): one run first, not counted
        warm = one(pool, controller, workers, args.n, "here")
        print(f"warm-up (here, not counted): {warm:.0f} tasks/s", flush=True)
        ratios: dict = {"controller": [], "away": []}
        for r in range(rounds):
            order = SIDES[r % 3:] + SIDES[:r % 3]  # each side first once in 3 rounds
            rate = {side: one(pool, controller, workers, args.n, side) for side in order}
            for side in ratios:
                ratios[side].append(rate[side] / rate["here"])
            print(f"round {r + 1} ({', '.join(order)}): here {rate['here']:.0f} tasks/s, "
                  f"controller {rate['controller']:.0f} (ratio "
                  f"{ratios['controller'][-1]:.2f}), controller with this machine away "
                  f"{rate['away']:.0f} (ratio {ratios['away'][-1]:.2f}); load average "
                  f"{os.getloadavg()[0]:.1f}", flush=True)
        print(f"controller / here (median of {rounds}): followed "
              f"{statistics.median(ratios['controller']):.2f}, away "
              f"{statistics.median(ratios['away']):.2f} (goal >= 0.9)")
    finally:
        pool.stop()


if __name__ == "__main__":
    main()
