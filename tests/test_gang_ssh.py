"""A real torch.distributed job (Debian's python3-torch, CPU, gloo) as a gang of 3 ranks on SSH
test hosts in network namespaces of their own: the all-reduce's result is checked, and with a
host killed mid-run the whole gang is restarted and the task ends with exactly one successful
attempt."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from conftest import wait_for
from test_ssh import run_in_process, ssh_recipe

from hypercli.state import State

pytestmark = pytest.mark.slow
JOB = os.path.join(os.path.dirname(__file__), "gangjob")


def need_torch():
    if subprocess.run(["/usr/bin/python3", "-c", "import torch.distributed"],
                      capture_output=True).returncode != 0:
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1":
            pytest.fail("Debian's python3-torch is not installed (scripts/deps.sh installs it)")
        pytest.skip("Debian's python3-torch is not installed")


def gang_recipe(tmp_path, pool, hosts, steps: int, pause: float):
    work = tmp_path / "work"
    shutil.copytree(JOB, work)
    return ssh_recipe(tmp_path, pool, hosts, {"train": {
        "nodes": 3, "retries": 1,
        "command": f"/usr/bin/python3 allreduce.py {steps} {pause}"}}, workdir=str(work))


def test_allreduce_gang_on_three_hosts(ssh_hosts, tmp_path, hyper_home):
    need_torch()
    hosts = ssh_hosts.start(3)
    state, summary = run_in_process(gang_recipe(tmp_path, ssh_hosts, hosts, 3, 0))
    assert summary.exit_code == 0
    ranks = state.attempts("lab-1", "train-0000")
    assert sorted(a["rank"] for a in ranks) == [0, 1, 2]
    assert len({a["node"] for a in ranks}) == 3 and {a["status"] for a in ranks} == {
        "succeeded"}
    assert state.task("lab-1", "train-0000")["metrics"] == {"sum": 6.0, "steps": 3}
    logs = (hyper_home / "logs" / ranks[0]["id"] / "stdout").read_text()
    assert '"world": 3' in logs


def test_host_killed_under_a_rank_restarts_the_whole_gang(ssh_hosts, tmp_path, hyper_home):
    need_torch()
    hosts = ssh_hosts.start(4)
    path = gang_recipe(tmp_path, ssh_hosts, hosts, 40, 0.1)
    killed = {}

    def kill_under_rank_1():
        def rank1():
            try:
                return [a for a in State().attempts("lab-1", status=["running"])
                        if a["rank"] == 1 and a["number"] == 1]
            except Exception:
                return []
        [a] = wait_for(rank1, timeout=60, what="rank 1 running")
        time.sleep(1.5)  # the ranks have met and are all-reducing
        killed["node"] = a["node"]
        hosts[int(a["node"].rsplit("-", 1)[1])].kill()
    t = threading.Thread(target=kill_under_rank_1)
    t.start()
    state, summary = run_in_process(path)
    t.join()
    assert summary.exit_code == 0
    by = {(a["number"], a["rank"]): a for a in state.attempts("lab-1", "train-0000")}
    assert by[(1, 1)]["status"] == "lost" and by[(1, 1)]["node"] == killed["node"]
    # the other ranks ended with the gang: stopped by it, or failing on their own as gloo
    # saw their peer go (whichever came first); none of them went on alone
    first = [by[(1, r)] for r in (0, 2)]
    assert {a["status"] for a in first} <= {"cancelled", "failed"}, first
    assert all(a["ended_at"] <= by[(2, 0)]["created_at"] for a in first)
    assert [by[(2, r)]["status"] for r in range(3)] == ["succeeded"] * 3
    assert killed["node"] not in {by[(2, r)]["node"] for r in range(3)}
    assert sum(a["status"] == "succeeded" for a in by.values()) == 3  # one attempt, 3 ranks
    task = state.task("lab-1", "train-0000")
    assert task["status"] == "succeeded" and task["attempts"] == 2
    assert task["metrics"] == {"sum": 6.0, "steps": 40}
