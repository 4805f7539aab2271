"""Runs that go on without the terminal: `hyper run -d` returns at once and the background
driver drives the workflow to its end, even when the terminal's whole process group is
killed; a driver killed mid-run is started again by the next `hyper` command and re-attaches;
`hyper run --wait` exits with the result; a foreground run left with Ctrl-C hands over."""

from __future__ import annotations

import os
import signal
import subprocess

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.state import State

RECIPE = """
    name: bg
    cluster: {workers: 2}
    experiments:
      work:
        parameters: {i: [1, 2, 3, 4]}
        command: |
          echo "$HYPER_ATTEMPT" >> "$HYPER_OUTPUT/runs"
          sleep 1
          echo '{"i": {{i}}}' >> "$HYPER_METRICS"
      report: {after: work, command: 'ls "$HYPER_OUTPUTS"'}
"""


def driver_pid(home) -> int | None:
    from hypercli.driver import driver_pid as pid_
    return pid_()


def stop_driver(home) -> None:
    pid = driver_pid(home)
    if pid and pid > 0:
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: driver_pid(home) is None, what="driver gone")


def finished(wid: str) -> bool:
    return State().workflow(wid)["status"] in ("succeeded", "failed", "cancelled")


def assert_ran_once(home, wid):
    state = State()
    for t in state.tasks(wid):
        assert t["status"] == "succeeded", t
        if t["experiment"] == "work":
            runs = (home / "storage" / wid / t["id"] / "runs").read_text().split()
            assert runs == ["1"], (t["id"], runs)  # never started twice


def test_detached_run_outlives_the_terminal(hyper_home, write_recipe):
    path = write_recipe(RECIPE)
    # a "terminal": a session whose whole process group is killed right after the command
    term = subprocess.Popen(["/bin/sh", "-c", f"{' '.join(hyper_cmd())} run -d {path}; "
                             "sleep 30"], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (hyper_home / "state.db").exists() and
                 State().attempts("bg-1", status=["running"]), what="tasks running")
        pid = driver_pid(hyper_home)
        assert pid and pid > 0
        os.killpg(term.pid, signal.SIGKILL)  # the terminal and everything in its group
        term.wait(timeout=10)
        wait_for(lambda: finished("bg-1"), timeout=60, what="the workflow's end")
        assert_ran_once(hyper_home, "bg-1")
        assert State().workflow("bg-1")["status"] == "succeeded"
        wait_for(lambda: driver_pid(hyper_home) is None, timeout=20,
                 what="the driver to exit with nothing left to drive")
    finally:
        if term.poll() is None:
            os.killpg(term.pid, signal.SIGKILL)
        stop_driver(hyper_home)


def test_killed_driver_is_restarted_and_reattaches(hyper_home, write_recipe, hyper):
    path = write_recipe(RECIPE)
    try:
        r = hyper("run", "-d", path)
        assert r.returncode == 0 and "runs in the background" in r.stdout, r.stdout + r.stderr
        running = wait_for(lambda: State().attempts("bg-1", status=["running"]),
                           what="tasks running")
        old = driver_pid(hyper_home)
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: driver_pid(hyper_home) is None, what="driver dead")
        r = hyper("ps", "bg-1")  # any command that opens the state file restarts it
        assert r.returncode == 0
        new = wait_for(lambda: driver_pid(hyper_home), what="a new driver")
        assert new != old
        r = hyper("attach", "bg-1", timeout=90)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "workflow bg-1: succeeded" in r.stdout
        assert_ran_once(hyper_home, "bg-1")
        state = State()
        for a in running:  # re-attached, not restarted
            assert state.attempts("bg-1", a["task"])[0]["status"] == "succeeded"
    finally:
        stop_driver(hyper_home)


def test_run_wait_exits_with_the_result(hyper_home, write_recipe, hyper):
    path = write_recipe(RECIPE.replace("sleep 1", "sleep 0.2")
                        .replace("'ls \"$HYPER_OUTPUTS\"'", "'exit 5'"))
    try:
        r = hyper("run", "--wait", path, timeout=90)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "workflow bg-1: failed" in r.stdout
        assert State().task("bg-1", "report-0000")["status"] == "failed"
    finally:
        stop_driver(hyper_home)


def test_left_foreground_run_is_handed_over(hyper_home, write_recipe, tmp_path):
    gate = tmp_path / "gate"  # the tasks run until the second `hyper run` has attached
    path = write_recipe(RECIPE.replace("sleep 1", f"until [ -e {gate} ]; do sleep 0.05; done"))
    p = subprocess.Popen([*hyper_cmd(), "run", str(path), "--on-interrupt", "leave"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    again = None
    try:
        wait_for(lambda: (hyper_home / "state.db").exists() and
                 State().attempts("bg-1", status=["running"]), what="tasks running")
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
        assert p.returncode == 130, out + err
        assert "handed to the background driver" in out
        # `hyper run` again attaches to the driver's run instead of refusing
        printed = tmp_path / "again.out"
        with open(printed, "w") as f:
            again = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, stdout=f,
                                     stderr=subprocess.STDOUT, text=True)
        wait_for(lambda: "attaching" in printed.read_text(), timeout=60, what="attaching",
                 proc=again)
        gate.touch()
        assert again.wait(timeout=90) == 0, printed.read_text()
        assert_ran_once(hyper_home, "bg-1")
    finally:
        gate.touch()
        for proc in (p, again):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        stop_driver(hyper_home)
