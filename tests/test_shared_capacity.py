"""One capacity per cluster: two workflows driven at once by two `hyper run` processes on one
cluster of real SSH hosts never run more tasks on a node than it holds. The count comes from
the nodes themselves (each task notes its start and end there), not from the state file."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from conftest import ROOT, hyper_cmd
from hypercli.state import State

pytestmark = pytest.mark.slow

WORK = {"parameters": {"i": list(range(6))},
        "command": 'echo "start $(date +%s.%N) $HYPER_WORKFLOW" >> /tmp/conc\n'
                   "sleep 1.2\n"
                   'echo "end $(date +%s.%N) $HYPER_WORKFLOW" >> /tmp/conc'}


def peak(lines: list[str]) -> tuple[int, set]:
    """Most tasks running at once from start/end lines, and the workflows seen."""
    events = []
    for line in lines:
        kind, ts, wf = line.split()
        events.append((float(ts), 1 if kind == "start" else -1, wf))
    events.sort(key=lambda e: (e[0], e[1]))  # an end before a start at the same instant
    now = most = 0
    for _, d, _ in events:
        now += d
        most = max(most, now)
    return most, {e[2] for e in events}


def test_two_workflows_share_one_cluster(ssh_hosts, tmp_path, hyper, hyper_home):
    hosts = ssh_hosts.start(2)
    cluster = {"provider": "ssh", "hosts": [h.address() for h in hosts],
               "identity_file": str(ssh_hosts.client_key)}
    paths = []
    for name in ("alpha", "beta"):
        p = tmp_path / f"{name}.yaml"
        p.write_text(yaml.safe_dump({"name": name, "cluster": {**cluster, "name": "lab"},
                                     "experiments": {"work": WORK}}))
        paths.append(p)
    r = hyper("up", paths[0], "--trust-new-hosts")
    assert r.returncode == 0, r.stdout + r.stderr
    caps = {n["name"]: min(n["slots"], n["info"]["cpus"]) for n in State().nodes("lab")}
    procs = [subprocess.Popen([*hyper_cmd(), "run", str(p), "--cluster", "lab"], cwd=ROOT,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in paths]
    try:
        outs = [p.communicate(timeout=120) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, out + err
    total = 0
    for node, h in zip(sorted(caps), hosts):
        lines = h.run("cat /tmp/conc").stdout.split("\n")
        most, _ = peak([x for x in lines if x.strip()])
        assert most <= caps[node], (node, most, caps[node])
        total += most
        assert len(lines) >= 2
    assert total == sum(caps.values())  # the cluster was used to its capacity, never beyond
    state = State()
    for wid in ("alpha-1", "beta-1"):
        assert {t["status"] for t in state.tasks(wid)} == {"succeeded"}
