"""Utilisation sampling on SSH test hosts (tests/sshhosts.py): a CPU-burning task on a host
with a stand-in nvidia-smi is sampled by its node's agent, the samples reach the state file
in the poll answers, `hyper top`, `hyper ps` and `hyper stats` show them; a task that the
kernel's OOM killer kills in a real memory cgroup is reported as such."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from hypercli.cli import cli
from hypercli.scheduler import Scheduler
from hypercli.state import State
from hypercli.workflows import prepare_run
from test_ssh import ssh_recipe

pytestmark = pytest.mark.slow

BURN = "timeout 5 sh -c 'while :; do :; done' || true"

#: % of a core a busy loop is sure to show: a whole core on an idle machine, a share of one
#: on a loaded one (2 cores at load 8: ~25%); a sampler that does not see it shows ~0
BUSY = 15


def _run(path, progress=None):
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    try:
        sched = Scheduler(state, wid, provider, nodes)
        return state, sched, sched.run(progress)
    finally:
        lock.release()


def test_samples_of_a_cpu_burning_task_reach_top_ps_and_stats(ssh_hosts, tmp_path, hyper_home,
                                                              monkeypatch):
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0.5")
    monkeypatch.setenv("COLUMNS", "200")
    [host] = ssh_hosts.start(1)
    host.set_gpus(2, utilization=[37, 0], memory_used_mib=[2048, 0], temperature_c=[61, 30],
                  power_w=[250.5, 40])
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {
        "burn": {"resources": {"gpus": 1}, "command": BURN}})
    seen = {}

    def progress(sched):  # while the task burns: what `hyper top` and `hyper ps` show
        if "top" in seen or not sched.state.samples(nodes_only=False, since=0):
            return
        running = [a for a in sched.live.values() if a["status"] == "running"]
        if not running or not [r for r in sched.state.samples(attempt=running[0]["id"])
                               if "cpu_pct" in r["data"]]:
            return
        runner = CliRunner()
        seen["top"] = runner.invoke(cli, ["top", "lab", "--once"], catch_exceptions=False)
        seen["ps"] = runner.invoke(cli, ["ps", sched.wid, "--json"], catch_exceptions=False)
        seen["ps_text"] = runner.invoke(cli, ["ps", sched.wid], catch_exceptions=False)

    state, sched, summary = _run(path, progress)
    assert summary.exit_code == 0
    [t] = state.tasks(sched.wid)
    [a] = state.attempts(sched.wid, t["id"])
    rows = state.samples(attempt=a["id"])
    # 5 s of work sampled every ~0.5-1 s (a poll answer carries them: a poll waits ≤ 1 s)
    assert len(rows) >= 4, rows
    assert all(r["node"] == a["node"] and r["span"] == 0 for r in rows)
    held = a["claim"]["gpus"]
    assert len(held) == 1 and all(r["data"]["gpus"] == held for r in rows)
    assert all(r["data"]["rss"] > 0 for r in rows[:-1])
    node_rows = state.samples(node=a["node"], nodes_only=True)
    assert len(node_rows) >= len(rows)  # plus the last one after the task ended
    last = node_rows[-1]["data"]
    assert last["mem_total"] > last["mem_used"] > 0 and last["disk_free"] > 0
    assert {"cpu_pct", "load1", "net_rx", "net_tx"} <= set(last)
    assert last["gpus"] == [
        {"index": 0, "util_pct": 37.0, "mem_used_mib": 2048.0, "mem_total_mib": 40960.0,
         "temp_c": 61.0, "power_w": 250.5},
        {"index": 1, "util_pct": 0.0, "mem_used_mib": 0.0, "mem_total_mib": 40960.0,
         "temp_c": 30.0, "power_w": 40.0}]

    # `hyper top --once` and `hyper ps` while it ran
    top = seen["top"]
    assert top.exit_code == 0, top.output
    assert a["node"] in top.output and "burn" in top.output and "37%" in top.output
    [task] = [r for r in json.loads(seen["ps"].output) if r["task"] == t["id"]]
    assert task["usage"]["gpus"] == held and task["usage"]["cpu_pct"] > BUSY
    assert task["usage"]["gpu_util"] == {str(held[0]): 37.0 if held[0] == 0 else 0.0}
    header, row = [x.split() for x in seen["ps_text"].output.splitlines()
                   if x.split()[:1] in (["task"], [t["id"]])]
    assert header[:8] == ["task", "status", "attempts", "node", "started", "duration", "cpu",
                          "gpus"]
    assert row[1] == "running" and row[6].endswith("%") and int(row[6][:-1]) > BUSY
    assert row[7] == f"{held[0]}:{37 if held[0] == 0 else 0}%"

    # `hyper stats`: the peak the burning task reached (a whole core on an idle machine)
    out = CliRunner().invoke(cli, ["stats", "burn", "--json"], catch_exceptions=False)
    assert out.exit_code == 0, out.output
    st = json.loads(out.output)
    assert st["task"] == t["id"] and st["samples"] == len(rows)
    assert st["cpu_pct"]["peak"] > BUSY, st
    assert 0 < st["cpu_pct"]["mean"] <= st["cpu_pct"]["peak"]
    gpu = st["gpus"][str(held[0])]
    assert gpu["util_pct"]["peak"] == (37.0 if held[0] == 0 else 0.0)
    text = CliRunner().invoke(cli, ["stats", "burn"], catch_exceptions=False)
    assert text.exit_code == 0 and "cpu     peak" in text.output

    # downsampled: everything older than now becomes 1-minute means, stats still hold
    n_raw = len(state.samples())
    assert state.compact_samples(before=rows[-1]["ts"] + 3600) == n_raw
    means = state.samples(attempt=a["id"])
    assert 1 <= len(means) <= 2 and all(m["span"] == 60 for m in means)
    again = CliRunner().invoke(cli, ["stats", "burn", "--json"], catch_exceptions=False)
    assert json.loads(again.output)["cpu_pct"]["peak"] > BUSY / 2

    # bad input: exit 2 and a message, no traceback
    bad = CliRunner().invoke(cli, ["stats", "no-such-task"])
    assert bad.exit_code == 2 and "no task" in bad.output and "Traceback" not in bad.output
    bad = CliRunner().invoke(cli, ["top", "no-such-cluster", "--once"])
    assert bad.exit_code == 2 and "no cluster" in bad.output


def test_sampling_off_sends_no_samples(ssh_hosts, tmp_path, hyper_home, monkeypatch):
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0")
    [host] = ssh_hosts.start(1)
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {
        "burn": {"command": "timeout 2 sh -c 'while :; do :; done' || true"}})
    state, sched, summary = _run(path)
    assert summary.exit_code == 0 and state.samples() == []


def test_a_task_killed_by_the_oom_killer_is_reported(ssh_hosts, tmp_path, hyper_home, hyper,
                                                     monkeypatch):
    """A real memory cgroup (cgroup v1 or v2) with a 64 MiB limit: the task moves itself
    into it and allocates 512 MiB; the kernel kills it. The agent reads the cgroup's
    ``oom_kill`` counter, as it would for a task a container runtime limits. `hyper run`
    (the real CLI) prints the warning and the failure summary says why."""
    v1 = Path("/sys/fs/cgroup/memory")
    base = v1 if (v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    cg = base / f"hyper-oom-test-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        limit = "memory.limit_in_bytes" if base == v1 else "memory.max"
        (cg / limit).write_text(str(64 << 20))
        if base == v1 and (cg / "memory.swappiness").exists():
            try:
                (cg / "memory.swappiness").write_text("0")
            except OSError:
                pass
        monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0.3")
        [host] = ssh_hosts.start(1)
        path = ssh_recipe(tmp_path, ssh_hosts, [host], {
            "hog": {"env": {"CG": str(cg)},
                    "command": 'echo $$ > "$CG/cgroup.procs"\nsleep 2\n'
                               "python3 -c 'x = bytearray(512 << 20)'"}})
        p = hyper("run", path, "--trust-new-hosts", "--on-interrupt", "cancel", timeout=120)
        assert p.returncode == 1, p.stdout + p.stderr
        assert "warning: hog" in p.stdout and "was killed by the kernel's OOM killer" in p.stdout
        assert "hyper: killed by the kernel's OOM killer" in p.stdout  # the stderr tail
        state = State()
        [wf] = state.workflows()
        [t] = state.tasks(wf["id"])
        [a] = state.attempts(wf["id"], t["id"])
        assert a["status"] == "failed" and a["exit_code"] == 137
        assert "OOM killer" in a["error"] and str(cg.name) in a["error"]
        events = [e for e in state.events(wf["id"]) if e["attempt"] == a["id"]]
        assert any("OOM killer" in e["message"] for e in events), events
        err = host.run(f"cat /root/.hyper/tasks/{a['id']}/stderr").stdout
        assert "hyper: killed by the kernel's OOM killer" in err
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                time.sleep(0.1)


def test_a_task_killed_by_sigkill_outside_a_full_cgroup_is_not_called_oom(
        ssh_hosts, tmp_path, hyper_home, monkeypatch):
    """Exit 137 alone (a task killing itself with SIGKILL) is no OOM kill."""
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0.3")
    [host] = ssh_hosts.start(1)
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {
        "selfkill": {"command": "sleep 1\nsh -c 'kill -9 $$'"}})
    state, sched, summary = _run(path)
    [t] = state.tasks(sched.wid)
    [a] = state.attempts(sched.wid, t["id"])
    assert a["exit_code"] == 137 and a["error"] == "exit code 137"
    assert not sched.notices


def test_a_full_disk_while_a_task_runs_is_recorded_against_node_and_task(
        ssh_hosts, tmp_path, hyper_home, monkeypatch):
    """The node's hypercli folder on a 64 MiB tmpfs of the host's own: under 100 MiB free
    while the task runs, so the node's samples say the disk is full."""
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0.3")
    [host] = ssh_hosts.start(1)
    host.run("mkdir -p /root/.hyper && mount -t tmpfs -o size=64m tmpfs /root/.hyper",
             check=True)
    try:
        path = ssh_recipe(tmp_path, ssh_hosts, [host], {
            "fill": {"command": "head -c 40000000 /dev/zero > ~/.hyper/filler\nsleep 1.5\n"
                                "rm ~/.hyper/filler"}})
        state, sched, summary = _run(path)
        assert summary.exit_code == 0
        [t] = state.tasks(sched.wid)
        [a] = state.attempts(sched.wid, t["id"])
        full = [e for e in state.events(sched.wid) if "nearly full" in e["message"]]
        assert [(e["kind"], e["attempt"]) for e in full] == [("node", None),
                                                              ("attempt", a["id"])], full
        assert full[1]["task"] == t["id"] and full[0]["node"] == a["node"]
        assert len(sched.notices) == 1 and t["id"] in sched.notices[0]
        free = [r["data"]["disk_free"] for r in state.samples(node=a["node"], nodes_only=True)]
        assert min(free) < 30 << 20 and max(free) <= 64 << 20
    finally:
        host.run("umount /root/.hyper")


def test_the_driver_compacts_old_samples_while_it_runs(ssh_hosts, tmp_path, hyper_home,
                                                       monkeypatch):
    """Time scaled down (full rate for 1 s, 1-second means, a compaction every 0.5 s): a 4 s
    task's older samples become means during the run, one per bucket however many
    compactions ran, and the newest stay raw."""
    from hypercli import usage
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0.2")
    monkeypatch.setattr(usage, "FULL_RATE_FOR", 1.0)
    monkeypatch.setattr(usage, "MEAN_SPAN", 1.0)
    monkeypatch.setattr(usage, "COMPACT_EVERY", 0.5)
    [host] = ssh_hosts.start(1)
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {
        "burn": {"command": "timeout 4 sh -c 'while :; do :; done' || true"}})
    mixes = set()

    def progress(sched):  # during the run: means of the older samples, the newest raw
        for a in list(sched.live.values()):
            spans = [r["span"] for r in sched.state.samples(attempt=a["id"])]
            if spans:
                assert spans == sorted(spans, reverse=True), spans  # means first (older)
                mixes.add(tuple(sorted(set(spans))))

    state, sched, summary = _run(path, progress)
    assert summary.exit_code == 0
    assert (0.0, 1.0) in mixes, mixes
    [t] = state.tasks(sched.wid)
    [a] = state.attempts(sched.wid, t["id"])
    rows = state.samples(attempt=a["id"])
    means = [r for r in rows if r["span"]]
    assert len(means) >= 2 and len({r["ts"] for r in means}) == len(means)  # none split
    assert all(r["ts"] == int(r["ts"]) for r in means)
    assert max(r["data"].get("cpu_pct", 0) for r in means) > 0  # means of the burning task
