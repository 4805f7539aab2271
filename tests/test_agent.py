"""The node agent (hypercli/node/agent.py) on its own, through its real protocol: tasks as the
agent's children, ends seen at once, the agent outliving its connection (locally and over a
real SSH session), a killed agent's attempts seen as lost with their processes killed, wakes,
``finish`` commands and a task that cannot start."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import wait_for
from hypercli.node.client import AGENT_PATH, local_agent

pytestmark = pytest.mark.slow


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def spec(aid: str, script: str, tmp_path: Path, **kw) -> dict:
    return {"id": aid, "script": script, "env": {}, "cwd": str(tmp_path), **kw}


def poll_until_ended(client, aid: str, timeout: float = 20) -> dict:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        st = client.call("poll", ids=[aid], wait=1)["states"][aid]
        if st["state"] != "running":
            return st
    raise AssertionError(f"{aid} still running after {timeout} s")


@pytest.fixture
def agents(tmp_path):
    """agents() → a new local agent client on one node root; all closed at teardown, and
    every agent process they started (detached ones too) gone or killed by pid."""
    made = []

    def make():
        c = local_agent("n", tmp_path / "node")
        c.pid = c.call("hello")["pid"]
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()
    for c in made:
        if not wait_for(lambda: not alive(c.pid), timeout=10):
            os.kill(c.pid, signal.SIGKILL)


def test_a_task_end_answers_the_poll_at_once(agents, tmp_path):
    c = agents()
    assert c.call("launch", attempts=[spec("a", "sleep 0.3", tmp_path)])["states"]["a"][
        "state"] == "running"
    t0 = time.monotonic()
    st = c.call("poll", ids=["a"], wait=10)["states"]["a"]
    assert st["state"] == "exited" and st["code"] == 0
    assert time.monotonic() - t0 < 2  # woken by the task's end, not by the 10 s wait


def test_the_agent_outlives_its_connection_and_records_the_end(agents, tmp_path):
    c = agents()
    c.call("launch", attempts=[spec("a", "sleep 1; echo late", tmp_path)])
    d = tmp_path / "node" / "tasks" / "a"
    c.close()  # EOF: the process the caller started exits now; the agent stays for its task
    assert alive(c.pid) and not (d / "exit").exists()
    assert wait_for(lambda: (d / "exit").exists(), timeout=10)
    assert json.loads((d / "exit").read_text())["code"] == 0
    assert (d / "stdout").read_text() == "late\n"
    assert wait_for(lambda: not alive(c.pid), timeout=5)  # and then it exits
    c2 = agents()
    st = c2.call("poll", ids=["a"])["states"]["a"]
    assert st["state"] == "exited" and st["code"] == 0


def test_a_new_agent_sees_an_older_agents_running_attempt_end(agents, tmp_path):
    c = agents()
    c.call("launch", attempts=[spec("a", "sleep 1", tmp_path)])
    c.close()
    c2 = agents()  # another connection while the first agent still supervises "a"
    assert c2.pid != c.pid
    st = c2.call("poll", ids=["a"], wait=0)["states"]["a"]
    assert st["state"] == "running"
    st = poll_until_ended(c2, "a")
    assert st["state"] == "exited" and st["code"] == 0


def test_a_killed_agent_leaves_lost_attempts_and_their_processes_are_killed(agents, tmp_path):
    c = agents()
    c.call("launch", attempts=[spec("a", "sleep 60", tmp_path)])
    task_pid = json.loads((tmp_path / "node" / "tasks" / "a" / "pid").read_text())["pid"]
    assert alive(task_pid)
    os.kill(c.pid, signal.SIGKILL)  # the agent dies; its task goes on, orphaned
    assert wait_for(lambda: not alive(c.pid), timeout=5)
    c2 = agents()
    st = c2.call("poll", ids=["a"])["states"]["a"]
    assert st["state"] == "lost"
    assert wait_for(lambda: not alive(task_pid), timeout=5)  # orphans of a dead agent: killed


def test_a_lost_attempts_fresh_output_folder_is_removed(agents, tmp_path):
    """A lost attempt never wins: the output folder it was writing goes, and only that one
    (the task's output and a sibling attempt's folder stay)."""
    out = tmp_path / "outputs" / "t-0000"
    c = agents()
    c.call("launch", attempts=[spec("a", 'echo part > "$HYPER_OUTPUT/partial.txt"; sleep 60',
                                    tmp_path, output=str(out))])
    fresh = tmp_path / "outputs" / ".attempt-a"
    assert wait_for(lambda: (fresh / "partial.txt").exists(), timeout=10)
    (tmp_path / "outputs" / ".attempt-b").mkdir()  # another attempt's: not this one's
    out.mkdir()
    os.kill(c.pid, signal.SIGKILL)
    assert wait_for(lambda: not alive(c.pid), timeout=5)
    st = agents().call("poll", ids=["a"])["states"]["a"]
    assert st["state"] == "lost"
    assert not fresh.exists()
    assert (tmp_path / "outputs" / ".attempt-b").is_dir() and out.is_dir()


def test_a_stale_wake_does_not_cut_the_next_poll_short(tmp_path):
    proc = subprocess.Popen([sys.executable, "-I", str(AGENT_PATH), "serve", "--root",
                             str(tmp_path / "node")], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, start_new_session=True)

    def call(req: dict) -> dict:
        proc.stdin.write(json.dumps(req).encode() + b"\n")
        proc.stdin.flush()
        return json.loads(proc.stdout.readline())
    try:
        pid = call({"id": 1, "op": "hello"})["pid"]
        call({"id": 2, "op": "launch", "attempts": [spec("a", "sleep 30", tmp_path)]})
        proc.stdin.write(b'{"op":"wake"}\n')  # sent while no poll was waiting: stale
        t0 = time.monotonic()
        r = call({"id": 3, "op": "poll", "ids": ["a"], "wait": 0.6})
        assert r["states"]["a"]["state"] == "running" and time.monotonic() - t0 >= 0.5
        # a wake during the wait cuts it short
        proc.stdin.write(json.dumps({"id": 4, "op": "poll", "ids": ["a"], "wait": 20}
                                    ).encode() + b"\n")
        proc.stdin.flush()
        time.sleep(0.2)
        t0 = time.monotonic()
        proc.stdin.write(b'{"op":"wake"}\n')
        proc.stdin.flush()
        r = json.loads(proc.stdout.readline())
        assert r["id"] == 4 and time.monotonic() - t0 < 2
        r = call({"id": 5, "op": "cancel", "ids": ["a"], "grace": 2})
        assert r["states"]["a"]["cancelled"] and r["states"]["a"]["state"] == "exited"
    finally:
        proc.stdin.close()
        proc.wait(timeout=10)
        proc.stdout.close()
    assert wait_for(lambda: not alive(pid), timeout=10)


def test_finish_runs_after_a_success_only_and_its_failure_fails_the_attempt(agents, tmp_path):
    c = agents()
    c.call("launch", attempts=[
        spec("ok", "echo task", tmp_path, finish="echo saved"),
        spec("bad-finish", "true", tmp_path, finish="echo nope >&2; exit 3"),
        spec("bad-task", "exit 5", tmp_path, finish=f"touch {tmp_path / 'ran'}")])
    got = {a: poll_until_ended(c, a) for a in ("ok", "bad-finish", "bad-task")}
    assert (got["ok"]["state"], got["ok"]["code"]) == ("exited", 0)
    assert (tmp_path / "node" / "tasks" / "ok" / "stdout").read_text() == "task\nsaved\n"
    assert got["bad-finish"]["code"] == 70
    err = (tmp_path / "node" / "tasks" / "bad-finish" / "stderr").read_text()
    assert "nope" in err and "saving its outputs failed (exit 3)" in err
    assert got["bad-task"]["code"] == 5 and not (tmp_path / "ran").exists()


def test_a_task_that_cannot_start_exits_127_with_the_reason(agents, tmp_path):
    c = agents()
    st = c.call("launch", attempts=[spec("a", "true", tmp_path / "no-such-folder")])
    st = st["states"]["a"]
    assert (st["state"], st["code"]) == ("exited", 127)
    err = (tmp_path / "node" / "tasks" / "a" / "stderr").read_text()
    assert "cannot start the task" in err and "no-such-folder" in err
    again = c.call("launch", attempts=[spec("a", "true", tmp_path)])["states"]["a"]
    assert (again["state"], again["code"]) == ("exited", 127)  # launch is idempotent


def test_the_ssh_session_ends_with_the_channel_while_the_task_goes_on(ssh_hosts, hyper_home):
    """Over a real sshd: the agent's channel ends (exit status sent, session freed) as soon
    as the client closes it, though its task runs on; a second channel on the same
    connection sees the task and its end."""
    from hypercli.providers.ssh import AGENT_REL, SSHProvider
    from hypercli.ssh.conn import Target
    host = ssh_hosts.start(1)[0]
    target = Target(host.ip, host.port, "root", str(ssh_hosts.client_key))
    prov = SSHProvider(trust_new_hosts=True)
    inst = prov.bootstrap("agent-0", target, "agenttest")
    try:
        conn = prov.connection("agent-0", target, "agenttest")
        ch = conn.channel()
        ch.exec_command(f"exec python3 ~/{AGENT_REL} serve")
        ch.sendall(json.dumps({"id": 1, "op": "launch", "attempts": [
            {"id": "s", "script": "sleep 4; echo done", "env": {}, "cwd": "/"}]}).encode()
            + b"\n")
        f = ch.makefile("rb")
        assert json.loads(f.readline())["states"]["s"]["state"] == "running"
        ch.shutdown_write()
        t0 = time.monotonic()
        ch.settimeout(10)
        assert ch.recv_exit_status() == 0 and time.monotonic() - t0 < 1.5
        ch.close()
        client = prov.connect_conn(conn, "agent-0")
        try:
            assert client.call("poll", ids=["s"])["states"]["s"]["state"] == "running"
            st = poll_until_ended(client, "s")
            assert (st["state"], st["code"]) == ("exited", 0)
            assert client.call("read", id="s", stream="stdout", offset=0)["data"]
        finally:
            client.close()
    finally:
        prov.drop("agent-0")
    assert inst.name == "agent-0"


def test_a_launch_can_wait_as_a_poll(agents, tmp_path):
    c = agents()
    c.call("launch", attempts=[spec("long", "sleep 0.5", tmp_path)])
    # a short task: launched and ended in one answer
    st = c.call("launch", attempts=[spec("short", "true", tmp_path)], wait=5)["states"]
    assert st["short"]["state"] == "exited" and st["short"]["code"] == 0
    # a long one: running, once the wait is over (and other ids watched meanwhile)
    t0 = time.monotonic()
    st = c.call("launch", attempts=[spec("slow", "sleep 30", tmp_path)], ids=["long"],
                wait=5)["states"]
    assert set(st) == {"slow", "long"} and time.monotonic() - t0 < 3
    assert st["slow"]["state"] == "running" and st["long"]["state"] == "exited"
    t0 = time.monotonic()
    st = c.call("launch", attempts=[spec("slow2", "sleep 30", tmp_path)], wait=0.3)["states"]
    assert st["slow2"]["state"] == "running" and 0.25 <= time.monotonic() - t0 < 3
    c.call("cancel", ids=["slow", "slow2"], grace=2)


def test_a_slot_costs_one_round_trip_per_short_task(hyper_home, write_recipe, monkeypatch):
    """The scheduler's node thread: a launch that waits as a poll, so a run of short tasks
    on one slot makes about one agent call per task, not two or three."""
    from hypercli.node.client import AgentClient
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    calls = []
    real_call = AgentClient.call

    def counting(self, op, **args):
        calls.append(op)
        return real_call(self, op, **args)
    monkeypatch.setattr(AgentClient, "call", counting)
    path = write_recipe("name: quick\ncluster: {workers: 1}\n"
                        "experiments: {t: {samples: 30, sampling: grid, command: 'true'}}\n")
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path))
    try:
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert summary.exit_code == 0 and summary.counts == {"succeeded": 30}
    assert calls.count("launch") == 30
    assert calls.count("poll") <= 3, calls  # the launches waited for the ends


def test_a_wake_between_waits_is_not_lost(agents, tmp_path):
    """AgentClient: a wake while no wait is out makes the next waiting call not wait (new
    work came while its caller was not looking); clear_wake() forgets such a wake."""
    c = agents()
    c.call("launch", attempts=[spec("a", "sleep 30", tmp_path)])
    c.wake()
    t0 = time.monotonic()
    assert c.call("poll", ids=["a"], wait=5)["states"]["a"]["state"] == "running"
    assert time.monotonic() - t0 < 1
    t0 = time.monotonic()
    c.call("poll", ids=["a"], wait=0.4)  # the wake was used up: this one waits
    assert time.monotonic() - t0 >= 0.35
    c.wake()
    c.clear_wake()
    t0 = time.monotonic()
    c.call("poll", ids=["a"], wait=0.4)
    assert time.monotonic() - t0 >= 0.35
    c.call("cancel", ids=["a"], grace=2)


def test_an_ended_attempt_says_whether_its_checkpoint_folder_holds_anything(agents, tmp_path):
    """``checkpoint_empty`` in the inline answer: the SSH session copies the node's
    checkpoints only after an attempt that wrote some (no extra exec per plain task)."""
    c = agents()
    ck = {"dir": str(tmp_path / "ck-{}"), "every": 60, "save": "true", "restore": None}
    wrote = spec("w", 'echo step > "$HYPER_CHECKPOINT/state"', tmp_path,
                 checkpoint=dict(ck, dir=str(tmp_path / "ck-w")))
    quiet = spec("q", "true", tmp_path, checkpoint=dict(ck, dir=str(tmp_path / "ck-q")))
    plain = spec("p", "true", tmp_path)
    wrote["env"]["HYPER_CHECKPOINT"] = str(tmp_path / "ck-w")
    c.call("launch", attempts=[wrote, quiet, plain])
    ended = {}
    end = time.monotonic() + 20
    while len(ended) < 3 and time.monotonic() < end:
        r = c.call("poll", ids=sorted({"w", "q", "p"} - ended.keys()), wait=1, inline=65536)
        ended.update({k: v for k, v in r["states"].items() if v["state"] != "running"})
    assert {k: v["code"] for k, v in ended.items()} == {"w": 0, "q": 0, "p": 0}
    assert ended["w"]["inline"]["checkpoint_empty"] is False
    assert ended["q"]["inline"]["checkpoint_empty"] is True
    assert ended["p"]["inline"]["checkpoint_empty"] is True
    assert ended["p"]["inline"]["output_empty"] is True  # no output folder: nothing to copy


def test_cancel_signals_only_the_group_the_agent_started(agents, tmp_path):
    """A pid file naming another process (rewritten, or a pid the kernel reused) is not
    signalled: a second agent checks the process's start time against the one recorded; the
    agent that started the task signals the pid in its memory, whatever the file says."""
    victim = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        c = agents()
        c.call("launch", attempts=[spec("a", "sleep 60", tmp_path)])
        pidfile = tmp_path / "node" / "tasks" / "a" / "pid"
        rec = json.loads(pidfile.read_text())
        task = rec["pid"]
        pidfile.write_text(json.dumps(dict(rec, pid=victim.pid)))
        other = agents()
        other.call("cancel", ids=["a"], grace=0.5)
        assert victim.poll() is None  # not the task's: left alone
        assert alive(task)
        st = c.call("cancel", ids=["a"], grace=2)["states"]["a"]
        assert st["state"] == "exited" and st["cancelled"] and not alive(task)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
