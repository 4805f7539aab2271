"""Defects a new user met: stale `ps`, Ctrl-C that traps, `down` without a word, silent wrong
answers, progress counts, messages, clusters kept forever. Real `hyper` processes on the local
provider."""

from __future__ import annotations

import ctypes
import errno
import json
import os
import pty
import select
import signal
import time

import pytest
from conftest import ROOT, hyper_cmd, wait_for
from test_resume import alive, live_attempts, task_pids

from hypercli.state import State

SLOW = """
    name: slow
    cluster: {workers: 2}
    experiments:
      work:
        parameters: {i: [1, 2, 3]}
        command: sleep 30
"""


class Terminal:
    """`hyper ARGS` in a pseudo-terminal of its own (a child of pty.fork)."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # child: the real CLI on a terminal
            os.chdir(ROOT)
            os.execvp(hyper_cmd()[0], [*hyper_cmd(), *map(str, args)])
        self.buf = b""
        self.status = None

    def read_until(self, token: bytes, timeout: float = 30) -> None:
        end = time.time() + timeout
        while token not in self.buf and time.time() < end:
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.buf += os.read(self.fd, 4096)
                except OSError:
                    break
        assert token in self.buf, self.buf.decode(errors="replace")[-2000:]

    def wait(self, timeout: float) -> int | None:
        """The exit code, or None when the process is still there after timeout s."""
        end = time.time() + timeout
        while time.time() < end:
            if select.select([self.fd], [], [], 0.1)[0]:
                try:
                    self.buf += os.read(self.fd, 4096)
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
                return self.status
        return None

    def close(self) -> None:
        if self.status is None:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self.pid, 0)
        os.close(self.fd)


def signal_a_thread(pid: int, sig: int) -> None:
    """Send ``sig`` to one thread of process ``pid`` other than its main thread, one that
    does not block it (tgkill(2)): as the kernel may pick any such thread for a signal sent
    to the process. Threads come and go (a worker thread may end between the listing and the
    signal): one that is gone is passed over and the listing is read again, for up to 10 s."""
    libc = ctypes.CDLL(None, use_errno=True)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for tid in sorted(int(t) for t in os.listdir(f"/proc/{pid}/task")):
            if tid == pid:
                continue
            try:
                with open(f"/proc/{pid}/task/{tid}/status") as f:
                    status = f.read()
            except (FileNotFoundError, ProcessLookupError):
                continue  # this thread ended since the listing
            blocked = int(status.split("SigBlk:")[1].split()[0], 16)
            if blocked & (1 << (sig - 1)):
                continue
            if libc.tgkill(pid, tid, sig) == 0:
                return
            if ctypes.get_errno() != errno.ESRCH:
                raise OSError(ctypes.get_errno(), f"tgkill({pid}, {tid}, {sig})")
        time.sleep(0.05)
    raise AssertionError(f"process {pid} has no thread but its main one to signal")


# -- 4: a second Ctrl-C (or SIGTERM) at the interrupt question leaves at once --------------
# "thread": the second SIGINT reaches a thread other than the main one, which waits for the
# answer: its handler must still run (a blocking read of the terminal would wait on for a
# line, as it does when the signal comes just before the read)
@pytest.mark.parametrize("second", ["ctrl-c", "sigterm", "thread"])
def test_second_interrupt_at_the_question_leaves_at_once(hyper_home, write_recipe, hyper,
                                                         second):
    path = write_recipe(SLOW)
    term = Terminal("run", path)
    try:
        running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(),
                           what="2 running")
        os.write(term.fd, b"\x03")  # Ctrl-C, delivered by the terminal as SIGINT
        term.read_until(b"leave the tasks running or cancel them?")
        if second == "ctrl-c":
            os.write(term.fd, b"\x03")
        elif second == "thread":
            signal_a_thread(term.pid, signal.SIGINT)
        else:
            os.kill(term.pid, signal.SIGTERM)
        code = term.wait(timeout=30)  # the workers stop first (they are woken; slower loaded)
        assert code == 130, term.buf.decode(errors="replace")[-2000:]
        assert b"left slow-1 running" in term.buf
        assert all(alive(pid) for pid in task_pids(hyper_home, running))
        assert {a["status"] for a in State().attempts("slow-1")} == {"running"}
    finally:
        term.close()
        hyper("cancel", "slow-1")


# -- 3: `hyper ps` says when no run drives a workflow, and asks the nodes -------------------
def test_ps_says_stale_and_asks_the_nodes(hyper_home, write_recipe, hyper, tmp_path):
    import subprocess
    path = write_recipe("""
        name: quick
        cluster: {workers: 1}
        experiments:
          one: {command: "sleep 1; echo done"}
    """)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        [a] = wait_for(lambda: live_attempts("quick-1"), what="running")
    finally:
        p.kill()
        p.wait(timeout=10)
    exit_file = hyper_home / "local" / "tasks" / a["id"] / "exit"
    wait_for(exit_file.exists, timeout=20, what="the task to end")
    before = State().attempts("quick-1")

    def answered(*args):  # the node's answer, once it came within ps's 2 s (a loaded machine)
        r = hyper("ps", "quick-1", *args, check=True)
        return None if "not answering" in r.stdout else r
    r = wait_for(answered, timeout=60, interval=0.5, what="the node's answer")
    assert "no `hyper run` drives quick-1" in r.stdout, r.stdout
    assert "last update at" in r.stdout and f"hyper run {path}" in r.stdout
    assert "running → exited 0 (not collected" in r.stdout, r.stdout
    assert State().attempts("quick-1") == before  # nothing recorded
    rows = json.loads(wait_for(lambda: answered("--json"), timeout=60, interval=0.5,
                               what="the node's answer").stdout)
    assert rows[0]["status"] == "running" and rows[0]["observed"] == "exited 0"
    listing = hyper("ps", check=True).stdout
    assert "no `hyper run` drives it" in listing
    r = hyper("run", path, check=True)  # re-attaches and collects
    assert "no `hyper run` drives" not in hyper("ps", "quick-1").stdout
    assert "no `hyper run` drives" not in hyper("ps").stdout


# -- 5: `hyper down` with work running asks, or refuses without --yes -----------------------
def test_down_with_running_tasks_needs_yes(hyper_home, write_recipe, hyper):
    import subprocess
    path = write_recipe(SLOW)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        running = wait_for(lambda: len(live_attempts()) == 2 and live_attempts(),
                           what="2 running")
    finally:
        p.kill()
        p.wait(timeout=10)
    pids = task_pids(hyper_home, running)
    r = hyper("down", "slow")  # stdin is not a terminal
    assert r.returncode == 2, r.stdout + r.stderr
    assert "slow-1" in r.stderr and "2 running" in r.stderr and "--yes" in r.stderr
    assert "Traceback" not in r.stderr
    state = State()
    assert state.cluster("slow")["status"] == "up"
    assert {a["status"] for a in state.attempts("slow-1")} == {"running"}
    assert all(alive(pid) for pid in pids)
    r = hyper("down", "slow", "--yes")
    assert r.returncode == 0, r.stderr
    assert "cluster slow is down" in r.stdout
    wait_for(lambda: not any(alive(pid) for pid in pids), timeout=15, what="tasks to stop")
    assert State().cluster("slow")["status"] == "down"
    assert State().workflow("slow-1")["status"] == "cancelled"


def test_down_asks_on_a_terminal(hyper_home, write_recipe, hyper):
    import subprocess
    path = write_recipe(SLOW)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: len(live_attempts()) == 2, what="2 running")
    finally:
        p.kill()
        p.wait(timeout=10)
    term = Terminal("down", "slow")
    try:
        term.read_until(b"cancel")
        term.read_until(b"[y/N]")
        os.write(term.fd, b"n\r")
        assert term.wait(timeout=15) == 2
    finally:
        term.close()
    assert State().cluster("slow")["status"] == "up"
    assert hyper("down", "slow", "--yes").returncode == 0


# -- 6: silent wrong answers ---------------------------------------------------------------
BROKEN = """
    name: broken
    cluster: {workers: 2}
    experiments:
      prepare:
        parameters: {i: [1, 2]}
        command: |
          echo '{"accuracy": 0.5, "loss": 1}' >> "$HYPER_METRICS"
          for n in $(seq 1 15); do echo "line $n of {{i}}" >&2; done
          test {{i}} -ne 2
      report:
        after: [prepare]
        command: echo never
"""


def test_results_sorted_by_a_metric_nobody_reported(hyper, write_recipe):
    path = write_recipe(BROKEN)
    assert hyper("run", path).returncode == 1
    r = hyper("results", "broken", "--sort", "acc")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "acc" in r.stderr and "accuracy" in r.stderr and "loss" in r.stderr
    assert hyper("results", "broken", "--sort", "loss").returncode == 0


def test_logs_of_a_skipped_or_cancelled_task_say_why(hyper, write_recipe, hyper_home):
    path = write_recipe(BROKEN)
    assert hyper("run", path).returncode == 1
    r = hyper("logs", "broken-1/report")
    assert r.returncode == 2 and "not started yet" not in r.stderr, r.stderr
    assert "skipped" in r.stderr and "prepare" in r.stderr and "failed" in r.stderr
    assert "will never start" in r.stderr
    state = State()  # a task cancelled before it started (set_tasks leaves an ended one be)
    with state.tx() as db:
        db.execute("UPDATE tasks SET status='cancelled' WHERE workflow=? AND id=?",
                   ("broken-1", "report-0000"))
    r = hyper("logs", "broken-1/report")
    assert r.returncode == 2 and "cancelled before it started" in r.stderr, r.stderr


def test_a_bare_task_id_names_its_workflow_or_asks(hyper, write_recipe):
    for name in ("first", "second"):
        path = write_recipe(f"""
            name: {name}
            cluster: {{workers: 1}}
            experiments:
              x: {{command: "echo from {name}"}}
        """, f"{name}.yaml")
        assert hyper("run", path).returncode == 0
    r = hyper("logs", "x-0000", check=True)
    assert "from second" in r.stdout
    assert "second-1" in r.stderr and "first-1" in r.stderr, r.stderr
    r = hyper("logs", "second-1/x-0000", check=True)
    assert r.stderr == ""
    state = State()
    for wid in ("first-1", "second-1"):  # two that have not ended: no guessing
        state.set_workflow(wid, status="running")
    r = hyper("logs", "x-0000")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "first-1/x-0000" in r.stderr and "second-1/x-0000" in r.stderr
    for wid in ("first-1", "second-1"):
        state.set_workflow(wid, status="succeeded")


# -- 7: progress keeps skipped and cancelled apart; a failed run shows its failure ---------
def test_failed_run_shows_counts_apart_and_the_failure(hyper, write_recipe):
    path = write_recipe(BROKEN)
    r = hyper("run", path)
    assert r.returncode == 1
    last = [line for line in r.stdout.splitlines() if line.startswith("[")][-1]
    assert "prepare 1/2 done, 0 running, 1 failed" in last, r.stdout
    assert "report 0/1 done, 0 running, 0 failed, 1 skipped" in last, r.stdout
    assert "failed: prepare-0001" in r.stdout, r.stdout
    tail = r.stdout.split("failed: prepare-0001", 1)[1]
    assert "line 15 of 2" in tail and "line 6 of 2" in tail and "line 5 of 2" not in tail
    assert "line 1 of 1" not in r.stdout  # the task that succeeded
    rows = {x["task"]: x for x in json.loads(hyper("ps", "broken-1", "--json").stdout)}
    assert rows["prepare-0000"]["started_at"] and rows["prepare-0000"]["duration"] >= 0
    assert rows["report-0000"]["started_at"] is None
    table = hyper("ps", "broken-1", check=True).stdout
    assert "started" in table and "duration" in table


# -- 9: messages ---------------------------------------------------------------------------
def test_mount_without_libfuse_says_what_to_install(hyper, tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    url = f"file://{tmp_path / 'ds'}"
    hyper("data", "push", src, url, check=True)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    monkeypatch.setenv("FUSE_LIBRARY_NAME", "no-such-fuse-library")
    for mode in ("--daemon", "--foreground"):
        r = hyper("data", "mount", url, mnt, mode, timeout=60)
        assert r.returncode == 3, r.stdout + r.stderr
        assert "apt-get install fuse3" in r.stderr, r.stderr
        assert "Traceback" not in r.stderr and "File \"" not in r.stderr
        assert not os.path.ismount(mnt)


def _commands(group, path=()):
    import click
    yield path, group
    if isinstance(group, click.Group):
        for name, cmd in group.commands.items():
            yield from _commands(cmd, (*path, name))


def test_help_is_plain_text():
    from click.testing import CliRunner

    from hypercli.cli import cli
    seen = 0
    for path, _ in _commands(cli):
        r = CliRunner().invoke(cli, [*path, "--help"], prog_name="hyper")
        assert r.exit_code == 0, (path, r.output)
        assert "``" not in r.output, (path, r.output)
        seen += 1
    assert seen > 20


def test_counts_of_one_are_singular(hyper, write_recipe, tmp_path):
    import re
    wrong = re.compile(r"(?<![\d.,/])1 (tasks|nodes|experiments|workflows|files|folders|symlinks|"
                       r"chunks|problems|resources|orphans|CPUs|GPUs|task outputs|lines)\b")
    path = write_recipe("""
        name: one
        cluster: {workers: 1}
        experiments:
          x: {command: "echo '{\\"acc\\": 1}' >> $HYPER_METRICS; echo hi > $HYPER_OUTPUT/f"}
    """)
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    url = f"file://{tmp_path / 'ds'}"
    outputs = []
    for args in (("plan", path), ("run", path), ("up", "--provider", "local", "--workers", "1",
                                                 "--name", "solo"),
                 ("outputs", "one", tmp_path / "out"), ("data", "push", src, url),
                 ("data", "pull", url, tmp_path / "copy"), ("data", "verify", url),
                 ("results", "one", "--sort", "acc"), ("ps",), ("status",)):
        r = hyper(*args, check=True)
        outputs.append(r.stdout + r.stderr)
        assert not wrong.search(r.stdout + r.stderr), (args, r.stdout + r.stderr)
    assert "1 task " in outputs[0] and "1 experiment," in outputs[0], outputs[0]


def test_a_push_that_uploads_nothing_says_so(hyper, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello")
    url = f"file://{tmp_path / 'ds'}"
    first = hyper("data", "push", src, url, check=True).stdout
    assert "MB/s" in first and "nothing new" not in first
    again = hyper("data", "push", src, url, check=True).stdout
    assert "nothing new to upload" in again and "MB/s" not in again, again


def test_up_on_local_prints_what_each_node_holds(hyper):
    out = hyper("up", "--provider", "local", "--workers", "2", "--name", "facts",
                check=True).stdout
    lines = [line for line in out.splitlines() if line.startswith("  facts-")]
    assert len(lines) == 2, out
    cpus = max(1, (os.cpu_count() or 1) // 2)
    for line in lines:
        assert f"{cpus} CPU" in line and "GiB" in line and "GPU" in line, out


def test_readme_and_test_script_say_what_is_true():
    readme = (ROOT / "README.md").read_text()
    assert "validated, not yet run" not in readme  # the clouds run (see "Cloud providers")
    internals = (ROOT / "docs" / "internals.md").read_text()  # the layout of the code
    layout = internals.split("\nrecipes/ ", 1)[1].split("\nbench/", 1)[0]  # with its next lines
    for recipe in sorted(p.stem for p in (ROOT / "recipes").glob("*.yaml")):
        assert recipe in layout, layout
    top = readme.split("bash scripts/test.sh", 1)[0].rsplit("**Run the whole test suite**", 1)[1]
    assert "apt-get" in top and "npm" in top, top
    script = (ROOT / "scripts" / "test.sh").read_text().splitlines()
    first = next(i for i, line in enumerate(script) if line.startswith(("echo", "bash", "python")))
    assert script[first].startswith("echo") and "apt-get" in script[first] \
        and "npm" in script[first], script[first]
    assert first < next(i for i, line in enumerate(script) if "deps.sh" in line
                        and not line.startswith("#") and not line.startswith("echo"))


# -- 10: clusters that are down are hidden, and can be forgotten ---------------------------
def test_status_hides_clusters_that_are_down_and_forget(hyper, write_recipe):
    path = write_recipe("""
        name: gone
        cluster: {workers: 1}
        experiments:
          x: {command: "echo kept"}
    """)
    assert hyper("run", path).returncode == 0
    hyper("up", "--provider", "local", "--workers", "1", "--name", "live", check=True)
    hyper("down", "gone", check=True)
    out = hyper("status", check=True).stdout
    assert "live" in out and "gone" not in out.split("not shown")[0], out
    assert "1 cluster that is down not shown (--all shows it" in out, out
    assert [c["cluster"] for c in json.loads(hyper("status", "--json").stdout)] == ["live"]
    assert "gone" in hyper("status", "--all", check=True).stdout
    assert "gone" in hyper("status", "gone", check=True).stdout
    r = hyper("forget", "live")
    assert r.returncode == 2 and "up" in r.stderr and "hyper down live" in r.stderr, r.stderr
    r = hyper("forget", "nope")
    assert r.returncode == 2 and "no cluster named 'nope'" in r.stderr
    r = hyper("forget", "gone", check=True)
    assert "forgot cluster gone" in r.stdout
    assert "gone" not in hyper("status", "--all", check=True).stdout
    state = State()
    assert state.cluster("gone") is None and state.nodes("gone") == []
    assert state.workflow("gone-1")["status"] == "succeeded"  # its workflows are kept
    assert "kept" in hyper("logs", "gone-1/x-0000", check=True).stdout
    assert hyper("ps", "gone-1", check=True).returncode == 0
