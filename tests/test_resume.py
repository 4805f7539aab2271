"""A `hyper run` killed (SIGKILL), interrupted (Ctrl-C) or cancelled from another process:
tasks survive the CLI, a new run re-attaches instead of restarting, nothing runs twice."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import threading
import time

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.scheduler import Scheduler
from hypercli.state import State
from hypercli.workflows import prepare_run

RECIPE = """
    name: slow
    cluster: {workers: 2}
    experiments:
      work:
        parameters: {i: [1, 2, 3, 4, 5]}
        command: |
          echo "$HYPER_ATTEMPT $$" >> "$HYPER_OUTPUT/runs"
          until [ -e @GATE@ ]; do sleep 0.05; done
          echo '{"done": {{i}}}' >> "$HYPER_METRICS"
"""


def gated(tmp_path, recipe: str = RECIPE) -> tuple:
    """(recipe text, open_gate): its tasks run until ``open_gate()`` is called (not for a
    fixed time, which a loaded machine may outlast before the test has done its part)."""
    gate = tmp_path / "gate"
    return recipe.replace("@GATE@", str(gate)), gate.touch


def start_run(path, *args, **kw) -> subprocess.Popen:
    return subprocess.Popen([*hyper_cmd(), "run", str(path), *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kw)


def live_attempts(wid: str = "slow-1") -> list[dict]:
    try:
        return State().attempts(wid, status=["running"])
    except Exception:  # workflow not created yet
        return []


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


def task_pids(home, attempts) -> list[int]:
    return [json.loads((home / "local" / "tasks" / a["id"] / "pid").read_text())["pid"]
            for a in attempts]


def assert_each_task_ran_once(home, wid="slow-1"):
    state = State()
    for t in state.tasks(wid):
        attempts = state.attempts(wid, t["id"])
        assert [a["status"] for a in attempts].count("succeeded") == 1, attempts
        assert t["status"] == "succeeded"
        runs = (home / "storage" / wid / t["id"] / "runs").read_text().splitlines()
        assert len(runs) == 1, (t["id"], runs)  # the command itself ran exactly once


def test_sigkilled_run_resumes_and_reattaches(hyper_home, write_recipe, tmp_path, hyper):
    recipe, open_gate = gated(tmp_path)
    path = write_recipe(recipe)
    p = start_run(path)
    running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(), what="2 running")
    p.kill()
    p.wait(timeout=10)
    pids = task_pids(hyper_home, running)
    assert all(alive(pid) for pid in pids)  # the tasks outlived the CLI
    open_gate()
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "resuming workflow slow-1" in r.stdout
    assert_each_task_ran_once(hyper_home)
    state = State()
    for a in running:  # re-attached: the same attempt succeeded, no second attempt
        assert state.attempts("slow-1", a["task"])[0]["id"] == a["id"]
        assert state.task("slow-1", a["task"])["attempts"] == 1


def test_launch_written_ahead_but_never_sent_is_sent_on_resume(hyper_home, write_recipe,
                                                               tmp_path):
    recipe, open_gate = gated(tmp_path)
    open_gate()
    path = write_recipe(recipe)
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path))
    # the previous run died between recording the launch and sending it
    state.start_attempts([(f"{wid}.work-0000.1", wid, "work-0000", 1, nodes[0]["name"])])
    try:
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert summary.exit_code == 0
    assert [a["id"] for a in state.attempts(wid, "work-0000")] == [f"{wid}.work-0000.1"]
    assert_each_task_ran_once(hyper_home, wid)


def test_second_run_of_a_driven_workflow_is_refused(hyper_home, write_recipe, tmp_path, hyper):
    recipe, open_gate = gated(tmp_path)
    path = write_recipe(recipe)
    p = start_run(path)
    try:
        wait_for(live_attempts, what="running attempts")
        r = hyper("run", path)
        assert r.returncode == 2
        assert f"pid {p.pid}" in r.stderr
    finally:
        open_gate()
        p.wait(timeout=60)
    assert p.returncode == 0


def test_interrupt_cancel_stops_tasks(hyper_home, write_recipe, tmp_path):
    path = write_recipe(gated(tmp_path)[0])  # never opened
    p = start_run(path, "--on-interrupt", "cancel")
    running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(), what="running")
    pids = task_pids(hyper_home, running)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1, out + err
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=10, what="tasks to stop")
    state = State()
    assert {t["status"] for t in state.tasks("slow-1")} == {"cancelled"}
    assert state.workflow("slow-1")["status"] == "cancelled"
    assert {a["status"] for a in state.attempts("slow-1")} == {"cancelled"}


def test_interrupt_leave_keeps_tasks_then_run_resumes(hyper_home, write_recipe, tmp_path,
                                                      hyper):
    recipe, open_gate = gated(tmp_path)
    path = write_recipe(recipe)
    p = start_run(path, "--on-interrupt", "leave")
    running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(), what="running")
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=30)
    assert p.returncode == 130, out + err
    assert "left slow-1 running" in out
    assert all(alive(pid) for pid in task_pids(hyper_home, running))
    open_gate()
    r = hyper("run", path)
    assert r.returncode == 0, r.stderr
    assert_each_task_ran_once(hyper_home)


def test_ctrl_c_asks_on_a_terminal(hyper_home, write_recipe, tmp_path):
    path = write_recipe(gated(tmp_path)[0])  # never opened
    pid, fd = pty.fork()
    if pid == 0:  # child: the real CLI on a terminal
        os.chdir(ROOT)
        os.execvp(hyper_cmd()[0], [*hyper_cmd(), "run", str(path)])
    buf = b""

    def read_until(token: bytes, timeout: float = 30) -> None:
        nonlocal buf
        end = time.time() + timeout
        while token not in buf and time.time() < end:
            if select.select([fd], [], [], 0.2)[0]:
                try:
                    buf += os.read(fd, 4096)
                except OSError:
                    break
        assert token in buf, buf.decode(errors="replace")[-2000:]

    try:
        wait_for(lambda: len(live_attempts()) == 2, what="running")
        os.write(fd, b"\x03")  # Ctrl-C, delivered by the terminal as SIGINT
        read_until(b"leave the tasks running or cancel them?")
        os.write(fd, b"cancel\r")
        read_until(b"workflow slow-1:")
    finally:
        _, status = os.waitpid(pid, 0)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 1
    assert {t["status"] for t in State().tasks("slow-1")} == {"cancelled"}


def test_cancel_from_another_process_and_ps_while_running(hyper_home, write_recipe, tmp_path,
                                                          hyper):
    path = write_recipe(gated(tmp_path)[0])  # never opened
    p = start_run(path)
    running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(), what="running")
    for _ in range(3):  # readers are not blocked by the writing run
        r = hyper("ps", "slow-1", "--json")
        assert r.returncode == 0 and len(json.loads(r.stdout)) == 5
    r = hyper("cancel", "slow")
    assert r.returncode == 0 and "cancelled slow-1" in r.stdout
    out, err = p.communicate(timeout=30)
    assert p.returncode == 1, out + err
    assert not any(alive(pid) for pid in task_pids(hyper_home, running))
    assert State().workflow("slow-1")["status"] == "cancelled"
    r = hyper("cancel", "slow-1")
    assert r.returncode == 2 and "already ended" in r.stderr


def test_cancel_one_task(hyper_home, write_recipe, tmp_path, hyper):
    """A queued task cancelled from another process is never launched, even when a node
    frees up right after the cancel (the driver looks for cancels before it places)."""
    recipe, open_gate = gated(tmp_path)
    path = write_recipe(recipe)
    p = start_run(path)
    wait_for(lambda: len(live_attempts()) == 2, what="running")
    r = hyper("cancel", "slow-1/work-0004")  # still pending: never launched
    assert r.returncode == 0, r.stderr
    open_gate()  # nodes free up at once
    out, err = p.communicate(timeout=60)
    assert p.returncode == 1, out + err
    state = State()
    status = {t["id"]: t["status"] for t in state.tasks("slow-1")}
    assert status.pop("work-0004") == "cancelled"
    assert set(status.values()) == {"succeeded"}, (state.attempts("slow-1"), [
        (hyper_home / "local" / "tasks" / a["id"] / "stderr").read_text()
        for a in state.attempts("slow-1") if a["status"] == "failed"])
    assert state.attempts("slow-1", "work-0004") == []


def test_a_task_cancelled_by_another_process_is_never_placed(hyper_home, write_recipe,
                                                            tmp_path):
    """`hyper cancel` of a queued task recorded just before the driver places work (before its
    periodic look for cancels): the task gets no attempt, the others run."""
    from hypercli.stop import cancel_task
    recipe, open_gate = gated(tmp_path)
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(write_recipe(recipe)))
    try:
        sched = Scheduler(state, wid, provider, nodes)
        assert cancel_task(state, wid, "work-0000", provider) == 1  # queued: marked only
        sched._recover()  # the queue, as the run loads it (it does so again: idempotent)
        sched._dispatch()  # what the run does as a node frees up
        assert state.attempts(wid, "work-0000") == []
        assert sorted(a["task"] for a in state.attempts(wid)) == ["work-0001", "work-0002"]
        open_gate()
        summary = sched.run()
    finally:
        lock.release()
    assert summary.exit_code == 1
    status = {t["id"]: t["status"] for t in state.tasks(wid)}
    assert status.pop("work-0000") == "cancelled" and set(status.values()) == {"succeeded"}
    assert state.attempts(wid, "work-0000") == []


def test_a_workflow_cancelled_before_its_driver_begins_stays_cancelled(hyper_home,
                                                                      write_recipe, tmp_path):
    """`hyper cancel` of a workflow whose driver has not begun yet (a detached workflow's
    background driver starting late): the driver does not turn it back into a running
    workflow nor launch anything; the cancel's record is kept as it was."""
    from hypercli.stop import cancel_workflow
    recipe, _ = gated(tmp_path)  # never opened: a task launched would never end
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(write_recipe(recipe)))
    try:
        cancel_workflow(state, wid, provider)
        recorded = state.workflow(wid)
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert (summary.interrupted, summary.exit_code) == ("cancel", 1)
    after = state.workflow(wid)
    assert (after["status"], after["ended_at"]) == ("cancelled", recorded["ended_at"])
    assert state.attempts(wid) == []


def test_down_cancels_a_detached_workflow(hyper_home, write_recipe, tmp_path, hyper):
    path = write_recipe(gated(tmp_path)[0])  # never opened: none ends before `down`
    p = start_run(path, "--on-interrupt", "leave")
    running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(), what="running")
    p.send_signal(signal.SIGINT)
    assert p.wait(timeout=30) == 130
    r = hyper("down", "slow", "--yes")  # without --yes: refused (tasks are running)
    assert r.returncode == 0, r.stderr
    assert not any(alive(pid) for pid in task_pids(hyper_home, running))
    state = State()
    assert state.workflow("slow-1")["status"] == "cancelled"
    assert {t["status"] for t in state.tasks("slow-1")} == {"cancelled"}
    assert state.cluster("slow")["status"] == "down"


def test_resume_after_a_node_left_the_cluster(hyper_home, write_recipe, tmp_path):
    recipe, open_gate = gated(tmp_path)
    open_gate()
    path = write_recipe(recipe.replace("experiments:", "experiments:\n  # retries 1\n")
                        .replace("command: |", "retries: 1\n        command: |"))
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path))
    # a previous run had work-0000 on a node that the cluster no longer has (workers 3 → 2)
    state.start_attempts([(f"{wid}.work-0000.1", wid, "work-0000", 1, "slow-2")])
    try:
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert summary.exit_code == 0
    attempts = state.attempts(wid, "work-0000")
    assert [(a["number"], a["status"]) for a in attempts] == [(1, "lost"), (2, "succeeded")]
    assert_each_task_ran_once(hyper_home, wid)


def test_a_cancel_left_half_done_is_finished_by_the_next_driver(hyper_home, write_recipe,
                                                                 tmp_path):
    """A workflow left ``cancelling`` (the `hyper cancel` that marked it died): the next
    driver finishes the cancel and launches nothing."""
    recipe, _ = gated(tmp_path)
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(write_recipe(recipe)))
    try:
        state.set_workflow(wid, status="cancelling")
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert summary.interrupted == "cancel"
    assert state.workflow(wid)["status"] == "cancelled"
    assert {t["status"] for t in state.tasks(wid)} == {"cancelled"}
    assert state.attempts(wid) == []


def test_a_cancel_from_another_process_keeps_its_recorded_times(hyper_home, write_recipe,
                                                                tmp_path):
    """`hyper cancel` of a running workflow records the workflow's and its tasks' end; the
    driver that notices it afterwards stops, and leaves those records as they were (a recorded
    result is never overwritten by a later command)."""
    from hypercli.stop import cancel_workflow
    recipe, _ = gated(tmp_path)  # never opened: the tasks run until cancelled
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(write_recipe(recipe)))
    out = {}
    try:
        sched = Scheduler(state, wid, provider, nodes)
        # the run loop's periodic look for cancels comes only after the whole cancel is
        # recorded (the look before placing work is left as it is)
        recorded_whole, placing = threading.Event(), []
        look, dispatch = sched._cancelled_elsewhere, sched._dispatch
        sched._cancelled_elsewhere = lambda: (bool(placing) or recorded_whole.is_set()) \
            and look()

        def placing_dispatch():
            placing.append(1)
            try:
                return dispatch()
            finally:
                placing.pop()
        sched._dispatch = placing_dispatch
        t = threading.Thread(target=lambda: out.setdefault("summary", sched.run()))
        t.start()
        try:
            wait_for(lambda: len(live_attempts(wid)) == 2, what="two tasks running")
            other = State()  # another process's view of the state file
            cancel_workflow(other, wid, provider)
            recorded = other.workflow(wid)["ended_at"]
            tasks = {t["id"]: t["ended_at"] for t in other.tasks(wid)}
        finally:
            recorded_whole.set()
            t.join(timeout=60)
    finally:
        lock.release()
    assert not t.is_alive() and out["summary"].interrupted == "cancel"
    after = state.workflow(wid)
    assert (after["status"], after["ended_at"]) == ("cancelled", recorded)
    assert {t["status"] for t in state.tasks(wid)} == {"cancelled"}
    assert None not in tasks.values() and len(tasks) == 5
    assert {t["id"]: t["ended_at"] for t in state.tasks(wid)} == tasks
