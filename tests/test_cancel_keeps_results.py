"""A cancel from outside the driver never relabels work that had already ended on its node:
an attempt that exited 0 keeps its success (and its output is collected), one that failed
keeps its failure; only work that was still running is recorded as cancelled."""

from __future__ import annotations

import subprocess
import time

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.state import State

RECIPE = """
    name: mixed
    cluster: {workers: 3}
    experiments:
      work:
        parameters: {i: [0, 1, 2]}
        command: |
          while [ ! -e go ]; do sleep 0.05; done   # the test says when (workdir: its folder)
          echo "out {{i}}" > "$HYPER_OUTPUT/result"
          echo '{"i": {{i}}}' >> "$HYPER_METRICS"
          if [ {{i}} = 1 ]; then exit 4; fi
          if [ {{i}} = 2 ]; then sleep 60; fi
          echo done
"""


def _exit_files(home, n):
    return len(list(home.glob("local/tasks/*/exit"))) >= n


def test_cancel_after_tasks_ended_keeps_their_results(hyper_home, write_recipe, hyper):
    path = write_recipe(RECIPE)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(State().attempts("mixed-1", status=["running"])) == 3
                 if (hyper_home / "state.db").exists() else False, what="3 running")
    finally:
        p.kill()  # the driver dies; the tasks go on without it
        p.wait(timeout=10)
    # two tasks end on their nodes while no driver is there to record it
    (path.parent / "go").touch()
    wait_for(lambda: _exit_files(hyper_home, 2), what="2 exit files")
    state = State()
    assert {t["status"] for t in state.tasks("mixed-1")} == {"running"}
    r = hyper("cancel", "mixed-1")
    assert r.returncode == 0, r.stdout + r.stderr
    tasks = {t["id"]: t for t in state.tasks("mixed-1")}
    assert tasks["work-0000"]["status"] == "succeeded"
    assert tasks["work-0000"]["metrics"] == {"i": 0}
    assert tasks["work-0001"]["status"] == "cancelled"  # failed, and the cancel ends retries
    assert tasks["work-0002"]["status"] == "cancelled"
    attempts = {a["task"]: a for a in state.attempts("mixed-1")}
    assert attempts["work-0000"]["status"] == "succeeded"
    assert attempts["work-0000"]["exit_code"] == 0
    assert attempts["work-0001"]["status"] == "failed"
    assert attempts["work-0001"]["exit_code"] == 4
    assert attempts["work-0002"]["status"] == "cancelled"
    assert "1 task)" in r.stdout or "(2 tasks)" in r.stdout
    out = hyper_home / "storage" / "mixed-1" / "work-0000" / "result"
    assert out.read_text() == "out 0\n"
    # a later command cannot relabel the recorded success either
    state.set_tasks("mixed-1", [{"id": "work-0000", "status": "cancelled",
                                 "ended_at": time.time()}])
    state.update_attempts([{"id": attempts["work-0000"]["id"], "status": "cancelled"}])
    assert state.task("mixed-1", "work-0000")["status"] == "succeeded"
    assert state.attempts("mixed-1", "work-0000")[0]["status"] == "succeeded"
