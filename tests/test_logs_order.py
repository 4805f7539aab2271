"""``hyper logs`` shows a task's stdout and stderr lines in the order they came, each on its
own stream (so ``2>&1`` reads them in order and ``2>/dev/null`` gives stdout alone, exact):
from the node's ``order`` (the agent's log pump), on this machine, on an SSH test host (live,
ended, and from the copy kept here once the host is gone), and in a container. What a task
writes there is not trusted: a forged ``order``, a symlink in its place, a line that never
ends."""

from __future__ import annotations

import os
import subprocess
import threading
from pathlib import Path

import yaml

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.logmerge import Merger
from hypercli.node.client import local_agent
from hypercli.state import State

# Each line waits until it is in its stream's file on the node (so the next one surely comes
# after it, however loaded the machine is).
ALTERNATE = """d=$(dirname "$HYPER_METRICS")
for i in 1 2 3; do
  echo "out $i"; until grep -qx "out $i" "$d/stdout"; do sleep 0.02; done
  echo "err $i" >&2; until grep -qx "err $i" "$d/stderr"; do sleep 0.02; done
done
"""
MERGED = "out 1\nerr 1\nout 2\nerr 2\nout 3\nerr 3\n"


def _recipe(tmp_path: Path, command: str, cluster: dict | None = None, **more) -> Path:
    path = tmp_path / "order.yaml"
    path.write_text(yaml.safe_dump({"name": "order", "cluster": cluster or {"workers": 1},
                                    "experiments": {"t": {"command": command, **more}}}))
    return path


def _merged(*args: str) -> str:
    """``hyper logs ARGS 2>&1``: both streams as the terminal shows them."""
    r = subprocess.run([*hyper_cmd(), "logs", *args], cwd=ROOT, text=True, timeout=120,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert r.returncode == 0, r.stdout
    return r.stdout


def _check_streams(hyper, out_tail: str = "") -> None:
    """``hyper logs t`` of the ended task: in order with 2>&1, each stream exact alone."""
    assert _merged("t") == MERGED + out_tail
    r = hyper("logs", "t")
    assert (r.returncode, r.stdout, r.stderr) == (0, "out 1\nout 2\nout 3\n" + out_tail,
                                                  "err 1\nerr 2\nerr 3\n")


def _follow_until_flag(run: subprocess.Popen, flag, tail: str = "") -> None:
    """``hyper logs -f`` of the running task: its lines in order as they come, to the end
    (``flag.touch()`` lets the task end; ``tail``: what it writes after "done")."""
    wait_for(lambda: State().attempts("order-1", status=["running"]), timeout=120,
             what="the attempt running", proc=run)
    follow = subprocess.Popen([*hyper_cmd(), "logs", "t", "-f"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(follow.stdout.readline, "")),
                              daemon=True)
    reader.start()
    try:
        wait_for(lambda: len(lines) >= 6, timeout=120, what="six lines followed")
        assert "".join(lines) == MERGED
        assert follow.poll() is None  # still following: the task has not ended
        flag.touch()
        assert follow.wait(timeout=120) == 0
        reader.join(timeout=60)
        assert "".join(lines) == MERGED + "done\n" + tail
        out, err = run.communicate(timeout=120)
        assert run.returncode == 0, out + err
    finally:
        for p in (follow, run):
            if p.poll() is None:
                p.kill()
                p.communicate()


def test_logs_interleave_by_arrival_locally(hyper, hyper_home, tmp_path):
    r = hyper("run", _recipe(tmp_path, ALTERNATE))
    assert r.returncode == 0, r.stdout + r.stderr
    _check_streams(hyper)
    [a] = State().attempts("order-1")
    folder = hyper_home / "local" / "tasks" / a["id"]
    assert (folder / "stdout").read_text() == "out 1\nout 2\nout 3\n"  # kept exact
    assert (folder / "stderr").read_text() == "err 1\nerr 2\nerr 3\n"


def test_logs_follow_in_order_locally(hyper, hyper_home, tmp_path):
    flag = tmp_path / "go"
    path = _recipe(tmp_path, ALTERNATE + f"until [ -e {flag} ]; do sleep 0.05; done\n"
                                         "echo done\n")
    run = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _follow_until_flag(run, flag)


def test_logs_in_order_over_ssh_live_ended_and_from_the_copy(ssh_hosts, tmp_path, hyper_home,
                                                             hyper):
    hosts = ssh_hosts.start(1)
    host_flag = "/tmp/hyper-logs-order-go"  # made on the test host

    class HostFlag:
        def touch(self):
            assert hosts[0].run(f"touch {host_flag}").returncode == 0
    assert hosts[0].run(f"rm -f {host_flag}").returncode == 0
    big = "x" * 70000  # over the logs that come back inline: the copy comes by tar
    path = _recipe(tmp_path, ALTERNATE + f"until [ -e {host_flag} ]; do sleep 0.05; done\n"
                                         f"echo done\necho {big}\n",
                   {"provider": "ssh", "hosts": [hosts[0].address()],
                    "identity_file": str(ssh_hosts.client_key)})
    run = subprocess.Popen([*hyper_cmd(), "run", str(path), "--trust-new-hosts"], cwd=ROOT,
                           text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _follow_until_flag(run, HostFlag(), f"{big}\n")
    [a] = State().attempts("order-1")
    copy = hyper_home / "logs" / a["id"]
    assert (copy / "order").exists()  # brought back with the logs
    _check_streams(hyper, f"done\n{big}\n")
    hosts[0].kill()  # the node gone: the copy brought back here reads the same
    _check_streams(hyper, f"done\n{big}\n")


def test_logs_in_order_of_a_container_task(ssh_hosts, tiny_image, tmp_path, hyper_home,
                                           hyper):
    """The container's streams reach the node's agent as a task's own do (through the
    container runtime's client); the task cannot see its logs, so its lines are 1 s apart."""
    from sshhosts import TINY_IMAGE, load_image
    host = ssh_hosts.start(1)[0]
    load_image(host, tiny_image)
    path = _recipe(tmp_path, "for i in 1 2 3; do echo \"out $i\"; sleep 1; "
                             "echo \"err $i\" >&2; sleep 1; done",
                   {"provider": "ssh", "hosts": [host.address()],
                    "identity_file": str(ssh_hosts.client_key)}, image=TINY_IMAGE)
    r = hyper("run", path, "--trust-new-hosts", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    _check_streams(hyper)


def test_a_forged_order_never_repeats_or_drops_a_byte_and_a_planted_symlink_is_not_followed(
        hyper, hyper_home, tmp_path):
    secret = tmp_path / "secret"
    secret.write_text("keep\n")
    forge = ('d=$(dirname "$HYPER_METRICS"); echo a; echo b >&2; echo c; '
             'printf "o 0\\ne 0\\no 0\\ne 99999999\\no 2\\no 1\\n" >> "$d/order"; echo d >&2')
    r = hyper("run", _recipe(tmp_path, forge))
    assert r.returncode == 0, r.stdout + r.stderr
    out = _merged("t")
    assert sorted(out.splitlines()) == ["a", "b", "c", "d"]  # each once, whatever it says
    r = hyper("logs", "t")
    assert (r.stdout, r.stderr) == ("a\nc\n", "b\nd\n")
    # a symlink put in place of ``order`` before the streams alternate: never written through
    plant = (f'd=$(dirname "$HYPER_METRICS"); ln -s {secret} "$d/order"; '
             'echo a; echo b >&2; echo c; echo d >&2')
    r = hyper("run", _recipe(tmp_path, plant))
    assert r.returncode == 0, r.stdout + r.stderr
    assert secret.read_text() == "keep\n"
    assert _merged("order-2/t") == "a\nc\nb\nd\n"  # no order kept: one stream, the other
    r = hyper("logs", "order-2/t")
    assert (r.returncode, r.stdout, r.stderr) == (0, "a\nc\n", "b\nd\n")


def test_a_line_that_never_ends_is_carried_whole_and_in_order(hyper, hyper_home, tmp_path):
    """8 MiB without a line end on stdout between two stderr lines: every byte kept, the
    stderr line written after it comes after it."""
    task = ('d=$(dirname "$HYPER_METRICS"); echo first >&2; '
            'head -c 8388608 /dev/zero | tr "\\0" y; '
            'until [ "$(stat -c %s "$d/stdout")" = 8388608 ]; do sleep 0.02; done; '
            'echo last >&2')
    r = hyper("run", _recipe(tmp_path, task))
    assert r.returncode == 0, r.stdout + r.stderr
    out = _merged("t")
    assert out == "first\n" + "y" * 8388608 + "last\n"


def test_the_pump_tells_an_end_with_all_output_and_does_not_wait_for_what_the_task_left(
        tmp_path):
    """A task writes 4 MiB and ends, leaving a process that holds its stdout: its end is
    told with every byte in its log, without waiting for that process."""
    root = tmp_path / "node"
    pidfile = tmp_path / "left.pid"
    script = (f"(exec sleep 600) & echo $! > {pidfile}; "
              "head -c 4194304 /dev/zero | tr '\\0' z; echo; echo end >&2")
    c = local_agent("n", root)
    try:
        c.call("launch", attempts=[{"id": "x.1", "script": script, "env": {},
                                    "cwd": str(tmp_path)}])
        wait_for(lambda: c.call("poll", ids=["x.1"], wait=5)["states"]["x.1"]["state"]
                 == "exited", timeout=120, what="the end told")
        pid = int(pidfile.read_text())
        assert os.path.exists(f"/proc/{pid}")  # the process it left still runs
        d = root / "tasks" / "x.1"
        assert (d / "stdout").stat().st_size == 4194305
        assert (d / "stderr").read_text() == "end\n"
        assert c.read("x.1", "order", 0)["data"] == b"o 4194305\n"
    finally:
        try:
            os.kill(int(pidfile.read_text()), 9)
        except (OSError, ValueError):
            pass
        c.close()


def test_merger_follows_without_ever_showing_a_line_early():
    """The reader side alone: records and streams as a node has them at three moments."""
    files = {"stdout": b"", "stderr": b"", "order": b""}

    def read(name, offset, limit):
        return files[name][offset:offset + limit]
    m = Merger(read)
    got: list[tuple[str, bytes]] = []
    files.update(stdout=b"a\nb\npart")
    got += m.step(final=False)
    assert got == [("stdout", b"a\nb\n")]  # the open run's complete lines, not "part"
    files.update(stderr=b"x\n", order=b"o 4\n")  # "part" ends after stderr's line
    got += m.step(final=False)
    files.update(stdout=b"a\nb\npart-ended\n", order=b"o 4\ne 2\n")
    got += m.step(final=False)
    got += m.step(final=True)
    assert b"".join(d for _, d in got) == b"a\nb\nx\npart-ended\n"
    assert [s for s, _ in got if _] == ["stdout", "stderr", "stdout"]


def test_python_prints_are_followed_as_they_are_made(tmp_path, hyper_home, hyper, monkeypatch):
    """A Python task's print, to a pipe, reaches ``hyper logs`` while the task still runs
    (PYTHONUNBUFFERED is 1 unless the recipe says otherwise); with the recipe's
    ``PYTHONUNBUFFERED: ""`` it stays in Python's buffer until the task ends."""
    import time
    monkeypatch.delenv("PYTHONUNBUFFERED", raising=False)  # not from this environment
    flag = tmp_path / "go"
    (tmp_path / "s.py").write_text(
        "import os, time\n"
        "print('early', os.environ.get('PYTHONUNBUFFERED'))\n"
        f"while not os.path.exists({str(flag)!r}): time.sleep(0.02)\n")
    for n, env, shown in ((1, {}, "early 1\n"), (2, {"PYTHONUNBUFFERED": ""}, "")):
        flag.unlink(missing_ok=True)
        path = _recipe(tmp_path, f"python3 {tmp_path}/s.py", env=env)
        run = subprocess.Popen([*hyper_cmd(), "run", str(path), "--new"], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        try:
            wait_for(lambda: State().attempts(f"order-{n}", status=["running"]), timeout=120,
                     what="the attempt running", proc=run)
            if shown:
                wait_for(lambda: hyper("logs", "t").stdout == shown, timeout=60,
                         what="the print in the logs while the task runs")
            else:
                time.sleep(1.5)  # it would be in the log by now, were it written
                assert hyper("logs", "t").stdout == ""
            flag.touch()
            out, err = run.communicate(timeout=120)
            assert run.returncode == 0, out + err
        finally:
            if run.poll() is None:
                run.kill()
        assert hyper("logs", "t").stdout == "early " + ("1\n" if shown else "\n")
