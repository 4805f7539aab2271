"""Shared fixtures: an isolated HYPER_HOME, recipe files, and the `hyper` command.

Every test that runs tasks uses ``hyper_home``; at teardown it stops, by the pids recorded in
the attempt folders, any task process group still alive, so no test leaves processes behind.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _stop_driver(home: Path) -> None:
    """The background driver a test's `hyper run -d` (or a left run) started, by the pid in
    its lock file, when that lock is still held (then the pid is the live driver's)."""
    import fcntl
    lock = home / "locks" / "driver.lock"
    if not lock.exists():
        return
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return  # not held: no driver
    except OSError:
        pid = os.pread(fd, 32, 0).decode().strip()
    finally:
        os.close(fd)
    if pid.isdigit():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass


def _kill_leftovers(home: Path) -> None:
    _stop_driver(home)
    for pidfile in home.glob("local/tasks/*/pid"):
        try:
            pid = json.loads(pidfile.read_text()).get("pid")
        except (OSError, ValueError):
            continue
        if pid and not (pidfile.parent / "exit").exists():
            try:
                os.killpg(int(pid), signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


@pytest.fixture(autouse=True, scope="session")
def _never_the_users_hyper_home(tmp_path_factory):
    """No test reads or writes the user's ``~/.hyper``: ``HYPER_HOME`` is a session folder
    unless a test sets its own (``hyper_home``)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HYPER_HOME", str(tmp_path_factory.mktemp("session-hyper-home")))
        yield


@pytest.fixture
def hyper_home(tmp_path, monkeypatch):
    """A fresh ``$HYPER_HOME`` for the test (also exported to subprocesses)."""
    home = tmp_path / "hyper-home"
    monkeypatch.setenv("HYPER_HOME", str(home))
    # a command a test gives up waiting for is stopped with SIGABRT: its threads' stacks go
    # to its stderr (faulthandler), which wait_for puts in the failure
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")
    yield home
    _kill_leftovers(home)


@pytest.fixture
def write_recipe(tmp_path):
    """write_recipe(text, name="r.yaml") → path of a recipe file in a temp folder."""
    def write(text: str, name: str = "r.yaml") -> Path:
        p = tmp_path / name
        p.write_text(textwrap.dedent(text))
        return p
    return write


def hyper_cmd() -> list[str]:
    """The installed ``hyper`` console script when on PATH beside this Python, else
    ``python -m hypercli``."""
    exe = Path(sys.executable).parent / "hyper"
    if exe.exists():
        return [str(exe)]
    found = shutil.which("hyper")
    return [found] if found else [sys.executable, "-m", "hypercli"]


@pytest.fixture
def hyper(hyper_home):
    """hyper(*args, timeout=120, **popen_kw) → CompletedProcess of the real CLI."""
    def run(*args, timeout: float = 120, check: bool = False, **kw):
        env = dict(os.environ, COLUMNS="200")
        p = subprocess.run([*hyper_cmd(), *map(str, args)], capture_output=True, text=True,
                           timeout=timeout, env=env, cwd=kw.pop("cwd", ROOT), **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"hyper {args} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
        return p
    return run


def wait_for(pred, timeout: float = 30, interval: float = 0.05, what: str = "condition",
             proc: subprocess.Popen | None = None):
    """Poll pred() until truthy; returns its value or fails the test after timeout (s), or
    as soon as ``proc`` (a command the condition depends on) has exited, with its output.
    On a timeout a ``proc`` still running is stopped with SIGABRT and its output (with the
    stacks of its threads, ``PYTHONFAULTHANDLER``) is in the failure."""
    end = time.time() + timeout
    while time.time() < end:
        v = pred()
        if v:
            return v
        if proc is not None and proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"{proc.args} exited {proc.returncode} before {what}:\n"
                                 f"{out or ''}{err or ''}")
        time.sleep(interval)
    tail = ""
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGABRT)
        try:
            out, err = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
        if isinstance(out, bytes):
            out, err = out.decode(errors="replace"), (err or b"").decode(errors="replace")
        tail = f"; {proc.args} printed:\n{out or ''}{err or ''}"
    raise AssertionError(f"timed out after {timeout}s waiting for {what}{tail}")


def _children() -> dict[int, int]:
    """{pid: parent pid} of every process on the machine."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                stat = Path(f"/proc/{d}/stat").read_text()
            except OSError:
                continue
            out[int(d)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def _state_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


#: the test files that take longest (minutes each on 2 cores, from ``--durations``), longest
#: first: they run before all others, so that with ``-n 2 --dist loadfile`` (pytest-xdist
#: hands out whole files in collection order) the short files fill in around them instead
#: of one process running a long file alone at the end
LONG_FILES = ("test_engines.py", "test_recipes.py", "test_gang_ssh.py", "test_ssh.py",
              "test_controller.py", "test_cloud_e2e.py", "test_pools.py",
              "test_cli_defects.py", "test_checkpoint_ssh.py", "test_bucket_mounts.py")


def pytest_configure(config):
    """pytest-xdist's ``--dist loadfile`` hands out the files with the most tests first
    unless told not to (``--no-loadscope-reorder``): keep the order set below instead.

    A suite started in the background of a non-interactive shell (``cmd &``: CI launchers,
    ``nohup``) has SIGINT ignored, and an ignored signal stays ignored across exec, so every
    ``hyper`` a test starts would ignore the Ctrl-C the test sends it (the port tests hung
    on it). A user's Ctrl-C comes from a terminal, where SIGINT is at its default: so it is
    here, in this process and (a Python handler is reset at exec) in what it starts."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    """Run :data:`LONG_FILES` first, in that order; every other test keeps its place."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Keep each phase's report on the item (``rep_call``) for fixtures' teardown."""
    rep = (yield).get_result()
    setattr(item, f"rep_{rep.when}", rep)


@pytest.fixture(autouse=True)
def _no_process_left(request):
    """After each test, no child of this process that the test started is left: any such
    child and its descendants are killed by pid (so a failed test's command does not run on
    into the next tests), and a test that passed but left one fails here."""
    me = os.getpid()
    before = {p for p, pp in _children().items() if pp == me}
    yield
    procs = _children()
    left = [p for p, pp in procs.items() if pp == me and p not in before]
    if not left:
        return
    # a child in the middle of its exit (no command line any more, not yet a zombie) is
    # given a moment to get there: it was not left running
    end = time.monotonic() + 5
    while time.monotonic() < end and any(_state_of(p) not in ("Z", "X", "") for p in left):
        time.sleep(0.05)
    live = [f"{p} ({_cmdline(p)})" for p in left if _state_of(p) not in ("Z", "X", "")]
    doomed, todo = [], list(left)
    while todo:
        pid = todo.pop()
        doomed.append(pid)
        todo += [c for c, pp in procs.items() if pp == pid]
    for pid in doomed:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in left:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
    call = getattr(request.node, "rep_call", None)
    if live and call is not None and call.passed:
        pytest.fail(f"the test left running processes: {', '.join(live)}")


from sshhosts import ssh_client_key, ssh_hosts, tiny_image  # noqa: E402,F401  (fixtures)
from s3server import s3  # noqa: E402,F401  (fixture)
from cloudhosts import aws  # noqa: E402,F401  (fixture)
