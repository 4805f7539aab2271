"""The wall around a task (issue 22, items 2, 3, 4, 7 and 15), in one place: what a task can
do to its node and to hypercli, tried the way a task would try it (from inside a real podman
container where the promise is about containers), and what holds.

* A task in a container cannot write its attempt's control folder: a pid file it rewrites,
  a log it swaps for a symlink or a FIFO live in its own root file system, not the agent's;
  ``hyper cancel`` signals only the task's process group.
* The agent reads back only regular files, opened without following a symlink and without
  waiting (a task on the node itself can swap its logs too): ``hyper logs`` and the
  dashboard never print a host file through a log and never hang on a FIFO.
* Output folders are made without following symlinks; a task cannot make another task's
  output a host folder, and ``hyper outputs`` never copies a host folder out.
* ``image:`` is an image reference, checked at validation, and passed after ``--``.
* Every attempt writes a fresh output folder; only the winner's becomes the task's output.
* A tar stream from a node is extracted member by member, each checked (CVE-2025-4517).
"""

from __future__ import annotations

import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.state import State
from hypercli.untar import extract


# ------------------------------------------------------------------ tar streams from a node

def _tar(*members) -> bytes:
    """A tar of (TarInfo fields dict, data bytes or None) pairs, in order."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for fields, data in members:
            info = tarfile.TarInfo(fields.pop("name"))
            for k, v in fields.items():
                setattr(info, k, v)
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def _everything(root) -> set[str]:
    return {os.path.relpath(os.path.join(d, n), root)
            for d, ds, fs in os.walk(root) for n in ds + fs}


def test_plain_members_are_extracted_with_modes_masked(tmp_path):
    data = _tar(({"name": "out", "type": tarfile.DIRTYPE, "mode": 0o7755}, None),
                ({"name": "out/a.txt", "mode": 0o4755}, b"hello"),
                ({"name": "out/sub/b", "mode": 0o644}, b"b"),
                ({"name": "out/ln", "type": tarfile.SYMTYPE, "linkname": "sub/b"}, None),
                ({"name": "out/hard", "type": tarfile.LNKTYPE, "linkname": "out/a.txt"},
                 None))
    dest = tmp_path / "d"
    assert extract(data, dest) == []
    assert (dest / "out" / "a.txt").read_bytes() == b"hello"
    assert stat.S_IMODE((dest / "out" / "a.txt").stat().st_mode) == 0o755  # setuid dropped
    assert stat.S_IMODE((dest / "out").stat().st_mode) == 0o755  # setgid, sticky dropped
    assert os.readlink(dest / "out" / "ln") == "sub/b"
    assert (dest / "out" / "hard").stat().st_ino == (dest / "out" / "a.txt").stat().st_ino


@pytest.mark.parametrize("members", [
    [({"name": "/tmp/abs"}, b"x")],
    [({"name": "../up"}, b"x")],
    [({"name": "a/../../up"}, b"x")],
    # a symlink out, then a file through it (the data filter's classic hole)
    [({"name": "esc", "type": tarfile.SYMTYPE, "linkname": "{host}"}, None),
     ({"name": "esc/planted"}, b"x")],
    # CVE-2025-4517's shape: a chain of links that a realpath() check resolves inside,
    # the kernel outside
    [({"name": "a", "type": tarfile.DIRTYPE}, None),
     ({"name": "a/l1", "type": tarfile.SYMTYPE, "linkname": ".."}, None),
     ({"name": "a/l2", "type": tarfile.SYMTYPE, "linkname": "l1/../.."}, None),
     ({"name": "a/l2/planted"}, b"x")],
    [({"name": "rel", "type": tarfile.SYMTYPE, "linkname": "../../outside"}, None)],
    [({"name": "abs", "type": tarfile.SYMTYPE, "linkname": "/etc/passwd"}, None)],
    [({"name": "hl", "type": tarfile.LNKTYPE, "linkname": "/etc/passwd"}, None)],
    [({"name": "hl", "type": tarfile.LNKTYPE, "linkname": "../host/victim"}, None)],
    [({"name": "dev", "type": tarfile.CHRTYPE, "devmajor": 1, "devminor": 3}, None)],
    [({"name": "blk", "type": tarfile.BLKTYPE, "devmajor": 7, "devminor": 0}, None)],
    [({"name": "fifo", "type": tarfile.FIFOTYPE}, None)],
])
def test_crafted_members_are_skipped_and_nothing_lands_outside(tmp_path, members):
    host = tmp_path / "host"
    host.mkdir()
    (host / "victim").write_text("mine")
    members = [(dict(f, linkname=f["linkname"].format(host=host)) if "linkname" in f else
                dict(f), d) for f, d in members]
    work = tmp_path / "w" / "x" / "y"
    work.mkdir(parents=True)
    dest = work / "d"
    skipped = extract(_tar(*members), dest)
    assert skipped  # said, not silently taken
    assert _everything(host) == {"victim"} and (host / "victim").read_text() == "mine"
    assert not (tmp_path / "up").exists() and not (work / "up").exists()
    assert not (work / "planted").exists() and not (tmp_path / "w" / "planted").exists()
    assert not os.path.exists("/tmp/abs")
    for rel in _everything(dest):  # what was kept is a file, a folder or an inside link
        st = os.lstat(dest / rel)
        assert stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode) or \
            (stat.S_ISLNK(st.st_mode) and not os.readlink(dest / rel).startswith("/")), rel
        assert not st.st_mode & 0o7000


def _past_path_max(dest) -> bytes:
    """CVE-2025-4517's tar (CPython's ``test_realpath_limit_attack``, gh-135034): symlinks
    whose expansion passes PATH_MAX, so ``os.path.realpath`` stops expanding and the data
    filter judges ``escape`` by its text (inside) while the kernel follows it outside."""
    steps = "abcdefghijklmnop"
    width = (os.pathconf(os.path.dirname(dest), "PC_PATH_MAX") - len(str(dest)) - 1) \
        // (len(steps) + 1)
    comp, path, members = "d" * width, "", []
    for s in steps:
        members += [({"name": os.path.join(path, comp), "type": tarfile.DIRTYPE,
                      "mode": 0o777}, None),
                    ({"name": os.path.join(path, s), "type": tarfile.SYMTYPE,
                      "linkname": comp}, None)]
        path = os.path.join(path, comp)
    link = os.path.join(*steps, "l" * 254)
    members += [({"name": link, "type": tarfile.SYMTYPE,
                  "linkname": os.path.join(*[".."] * len(steps))}, None),
                ({"name": "escape", "type": tarfile.SYMTYPE,
                  "linkname": os.path.join(link, "..")}, None),
                ({"name": "escape/planted"}, b"x")]
    return _tar(*members)


def test_a_chain_of_inside_looking_symlinks_that_leaves_the_folder_is_removed(tmp_path):
    """Each link's target, read from its own folder, stays inside; together the kernel
    resolves ``a/m`` to the folder's parent. No link left behind leads outside."""
    dest = tmp_path / "w" / "d"
    (tmp_path / "w").mkdir()
    skipped = extract(_tar(({"name": "x", "type": tarfile.SYMTYPE, "linkname": "."}, None),
                           ({"name": "a", "type": tarfile.DIRTYPE, "mode": 0o755}, None),
                           ({"name": "a/l", "type": tarfile.SYMTYPE, "linkname": "../x"},
                            None),
                           ({"name": "a/m", "type": tarfile.SYMTYPE, "linkname": "l/../.."},
                            None),
                           ({"name": "ok", "type": tarfile.SYMTYPE, "linkname": "a"}, None)),
                      dest)
    assert any(s.startswith("a/m:") for s in skipped), skipped
    real = os.path.realpath(dest)
    for rel in _everything(dest):
        got = os.path.realpath(dest / rel)
        assert got == real or got.startswith(real + os.sep), (rel, got)
    assert os.path.islink(dest / "ok") and os.path.islink(dest / "x")


def test_ssh_untar_holds_against_cve_2025_4517(tmp_path):
    """providers/ssh.py's ``_untar`` (logs and outputs from a node): the data filter's
    PATH_MAX bypass plants nothing beside the target folder."""
    from hypercli.providers.ssh import _untar
    dest = tmp_path / "in"
    dest.mkdir()
    _untar(_past_path_max(dest), dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert not any(n == "planted" for _, _, fs in os.walk(tmp_path) for n in fs)


# --------------------------------------------------------------------------- image: values

@pytest.mark.parametrize("image", ["--privileged alpine", "-v/:/host alpine", "-alpine",
                                   "alpine --privileged", "python:3.11 slim", "Alpine:3",
                                   "alpine:-x", "alpine@sha256:abc"])
def test_an_image_that_is_not_a_reference_is_refused(hyper, write_recipe, image):
    import json
    path = write_recipe(f"""
        name: img
        experiments:
          box:
            command: echo hi
            image: {json.dumps(image)}
        """)
    r = hyper("plan", path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"{path}:6: experiments.box.image" in r.stderr
    assert "is not an image reference" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("image", ["python:3.11-slim", "localhost/hyper-tiny:latest",
                                   "registry.example:5000/team/img:v1.2",
                                   "ghcr.io/o/i@sha256:" + "ab" * 32])
def test_image_references_pass(image):
    from hypercli.recipe import parse_recipe
    r = parse_recipe(f"name: img\nexperiments: {{box: {{command: x, image: '{image}'}}}}\n")
    assert r.experiments["box"].image == image


# ------------------------------------------------------------------ fixtures and functions

@pytest.fixture
def local_docker(tiny_image, tmp_path, monkeypatch, hyper_home):
    """``docker`` on PATH for the local provider's agent: podman with a store and a tmpdir
    of the test's own (the tiny image loaded), removed at teardown after the attempts' process
    groups left running are killed by their pids. Yields the shim's path."""
    from conftest import _kill_leftovers
    from sshhosts import CONTAINERS_CONF
    store = Path(tempfile.mkdtemp(prefix="hyp-", dir="/tmp"))  # podman: runroot <= 50 chars
    (store / "containers.conf").write_text(CONTAINERS_CONF)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    docker = bindir / "docker"
    docker.write_text(f"#!/bin/sh\nCONTAINERS_CONF={store}/containers.conf exec podman "
                      f"--root {store}/root --runroot {store}/run --tmpdir {store}/tmp "
                      "--storage-driver vfs "
                      "--cgroup-manager cgroupfs --events-backend file \"$@\"\n")
    docker.chmod(0o755)
    subprocess.run([str(docker), "load", "-i", str(tiny_image)], check=True,
                   capture_output=True)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    try:
        yield docker
    finally:
        _kill_leftovers(hyper_home)  # before the store goes: nothing of it still runs
        try:
            subprocess.run([str(docker), "system", "reset", "--force"], capture_output=True,
                           timeout=120)
        finally:
            shutil.rmtree(store, ignore_errors=True)


@pytest.fixture
def victim():
    """A process of the test's own, in a process group of its own: what a task must not be
    able to make hypercli signal. Killed by its pid at teardown."""
    p = subprocess.Popen(["sleep", "600"], start_new_session=True)
    yield p
    p.kill()
    p.wait()


def start_run(path) -> subprocess.Popen:
    return subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def attempt_folder(home: Path, wid: str, task: str) -> Path:
    [a] = State().attempts(wid, task)
    return home / "local" / "tasks" / a["id"]


def metrics_say(folder: Path, key: str) -> bool:
    try:
        return key in (folder / "metrics.jsonl").read_text()
    except OSError:
        return False


#: the attack on the attempt folder, from the task: its pid file names the victim's group,
#: stderr becomes a symlink to a host file, stdout a FIFO; then it says so and waits
ATTACK = """
d=$(dirname "$HYPER_METRICS")
printf '{{"pid": {pid}, "started": 1}}' > "$d/pid" || true
rm -f "$d/stderr"; ln -s {secret} "$d/stderr" || true
rm -f "$d/stdout"; mkfifo "$d/stdout" || true
echo '{{"attacked": 1}}' >> "$HYPER_METRICS"
sleep 600
"""


def _attack(hyper, hyper_home, tmp_path, victim, image):
    secret = tmp_path / "host-secret.txt"
    secret.write_text("TOP-SECRET of the host\n")
    box = {"command": ATTACK.format(pid=victim.pid, secret=secret).strip() + "\n"}
    if image:
        box["image"] = image
    path = tmp_path / "wall.yaml"
    path.write_text(yaml.safe_dump({"name": "wall", "cluster": {"workers": 1},
                                    "experiments": {"box": box}}))
    run = start_run(path)
    try:
        folder = wait_for(lambda: State().attempts("wall-1", status=["running"]) and
                          attempt_folder(hyper_home, "wall-1", "box-0000"), timeout=120,
                          what="the attempt", proc=run)
        wait_for(lambda: metrics_say(folder, "attacked"), timeout=120,
                 what="the task's attack", proc=run)
        logs = hyper("logs", "box-0000", timeout=60)  # a FIFO in the way: no hang
        page = dashboard_task(hyper_home, "wall-1", "box-0000")  # nor in the dashboard
        r = hyper("cancel", "wall-1", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
    assert State().tasks("wall-1")[0]["status"] == "cancelled", out + err
    if image:  # (without a container the task is root on its node: it could signal the
        # victim itself, and a pid file it rewrites is believed when it names a session
        # leader; the agent that started the task still signals only its own, test_agent.py)
        assert victim.poll() is None  # the group the pid file named was not signalled
    assert "TOP-SECRET" not in logs.stdout + logs.stderr  # no host file through a log
    assert secret.read_text() == "TOP-SECRET of the host\n"
    return logs, folder, page


def dashboard_task(home: Path, wid: str, task: str) -> dict:
    """The dashboard's data for a task page, asked in a process of its own (so a hang shows
    as a timeout, not a stuck test)."""
    code = ("import json, sys; from hypercli.state import State; "
            "from hypercli.ui.app import task_data; "
            "print(json.dumps(task_data(State(), sys.argv[1], sys.argv[2])))")
    p = subprocess.run([sys.executable, "-c", code, wid, task], capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, HYPER_HOME=str(home)))
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


# ------------------------------------------------------------ item 2: the attempt folder

@pytest.mark.slow
def test_a_container_cannot_write_its_attempt_folder(hyper, hyper_home, write_recipe,
                                                     tmp_path, victim, local_docker):
    from sshhosts import TINY_IMAGE
    logs, folder, page = _attack(hyper, hyper_home, tmp_path, victim, TINY_IMAGE)
    assert logs.returncode == 0, logs.stderr
    assert page["log_error"] is None and "TOP-SECRET" not in json.dumps(page)
    for name in ("stdout", "stderr", "pid"):  # the agent's own files, untouched
        assert stat.S_ISREG(os.lstat(folder / name).st_mode), name
    assert json.loads((folder / "pid").read_text())["pid"] != victim.pid


def test_a_task_on_the_node_cannot_make_the_agent_follow_its_logs(
        hyper, hyper_home, write_recipe, tmp_path, victim):
    """Without a container a task runs as root on its node and can rewrite its attempt
    folder; the agent still reads back only regular files: ``hyper logs`` and the dashboard
    say what is wrong instead of printing a host file or hanging."""
    logs, folder, page = _attack(hyper, hyper_home, tmp_path, victim, None)
    assert logs.returncode != 0 and "is a FIFO, not a regular file" in logs.stderr, \
        logs.stdout + logs.stderr
    assert "is a FIFO, not a regular file" in page["log_error"]
    assert "TOP-SECRET" not in json.dumps(page)
    assert "Traceback" not in logs.stderr


# ------------------------------------------------- items 3 and 7: output folders, attempts

def test_a_failed_attempt_leaves_nothing_in_the_retrys_output(hyper, hyper_home,
                                                              write_recipe, tmp_path):
    path = write_recipe("""
        name: again
        cluster: {workers: 1}
        experiments:
          flaky:
            retries: 1
            command: |
              echo '{"row": '$HYPER_ATTEMPT'}' >> "$HYPER_OUTPUT/rows.jsonl"
              if [ "$HYPER_ATTEMPT" = 1 ]; then echo half > "$HYPER_OUTPUT/partial.txt"; exit 3; fi
              echo whole > "$HYPER_OUTPUT/final.txt"
        """)
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [a["status"] for a in State().attempts("again-1", "flaky-0000")] == \
        ["failed", "succeeded"]
    out = hyper_home / "storage" / "again-1"
    assert sorted(os.listdir(out)) == ["flaky-0000"]  # no attempt folder left beside it
    assert sorted(os.listdir(out / "flaky-0000")) == ["final.txt", "rows.jsonl"]
    assert (out / "flaky-0000" / "rows.jsonl").read_text() == '{"row": 2}\n'
    r = hyper("outputs", "again-1", tmp_path / "got")
    assert r.returncode == 0, r.stdout + r.stderr
    assert sorted(os.listdir(tmp_path / "got" / "flaky-0000")) == ["final.txt", "rows.jsonl"]


def test_a_task_cannot_turn_an_output_folder_into_a_host_folder(hyper, hyper_home,
                                                                write_recipe, tmp_path):
    """Task ``a`` puts a symlink to a host folder where ``b``'s output goes; task ``c``
    swaps its own output folder for one: neither output becomes the host folder, nothing
    is written there, and ``hyper outputs`` copies nothing of it."""
    host = tmp_path / "host-dir"
    host.mkdir()
    (host / "private.txt").write_text("the host's own\n")
    path = write_recipe(f"""
        name: swap
        cluster: {{workers: 1}}
        experiments:
          a:
            command: ln -s {host} "$HYPER_OUTPUTS/b-0000"; echo mine > "$HYPER_OUTPUT/a.txt"
          b:
            after: [a]
            command: echo from-b > "$HYPER_OUTPUT/b.txt"
          c:
            after: [a]
            command: rmdir "$HYPER_OUTPUT"; ln -s {host} "$HYPER_OUTPUT"
        """)
    r = hyper("run", path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert sorted(os.listdir(host)) == ["private.txt"]  # b wrote nothing there
    tasks = {t["id"]: t for t in State().tasks("swap-1")}
    assert tasks["a-0000"]["status"] == "succeeded"
    for t in ("b-0000", "c-0000"):
        assert tasks[t]["status"] == "failed", tasks[t]
        logs = hyper("logs", t).stderr
        assert "symlink" in logs and "output was not kept" in logs, logs
    out = hyper_home / "storage" / "swap-1"
    assert os.path.islink(out / "b-0000")  # a's symlink is left: hypercli did not make it
    assert not os.path.lexists(out / "c-0000")
    r = hyper("outputs", "swap-1", tmp_path / "got")
    assert r.returncode == 0, r.stdout + r.stderr
    got = [p.name for p in (tmp_path / "got").rglob("*")]
    assert "private.txt" not in got and "a.txt" in got


@pytest.mark.slow
def test_a_container_cannot_plant_a_symlink_among_the_outputs(hyper, hyper_home, tmp_path,
                                                              local_docker):
    """In a container ``HYPER_OUTPUTS`` is read-only: task ``a`` cannot put a symlink to a
    host folder where ``b``'s output goes, and ``b``'s output is a folder of its own."""
    from sshhosts import TINY_IMAGE
    host = tmp_path / "host-dir"
    host.mkdir()
    path = tmp_path / "plant.yaml"
    path.write_text(yaml.safe_dump({"name": "plant", "cluster": {"workers": 1}, "experiments": {
        "a": {"image": TINY_IMAGE, "command": f'ln -s {host} "$HYPER_OUTPUTS/b-0000" || '
                                              'echo refused > "$HYPER_OUTPUT/a.txt"'},
        "b": {"image": TINY_IMAGE, "after": ["a"],
              "command": 'echo from-b > "$HYPER_OUTPUT/b.txt"'}}}))
    r = hyper("run", path, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = hyper_home / "storage" / "plant-1"
    assert (out / "a-0000" / "a.txt").read_text() == "refused\n"
    assert not os.path.islink(out / "b-0000")
    assert (out / "b-0000" / "b.txt").read_text() == "from-b\n"
    assert os.listdir(host) == []


def test_an_outputs_root_that_is_a_symlink_is_refused(hyper, hyper_home, write_recipe,
                                                      tmp_path):
    host = tmp_path / "host-dir"
    host.mkdir()
    storage = tmp_path / "store"
    storage.mkdir()
    (storage / "root-1").symlink_to(host)
    path = write_recipe(f"""
        name: root
        cluster: {{workers: 1}}
        storage: file://{storage}
        experiments:
          one: {{command: 'echo x > "$HYPER_OUTPUT/x"'}}
        """)
    r = hyper("run", path)
    assert r.returncode == 1, r.stdout + r.stderr
    assert os.listdir(host) == []
    logs = hyper("logs", "one-0000").stderr
    assert "is a symlink or not a folder: refused" in logs, logs


FLAKY = ('echo \'{"row": \'$HYPER_ATTEMPT\'}\' >> "$HYPER_OUTPUT/rows.jsonl"\n'
         'if [ "$HYPER_ATTEMPT" = 1 ]; then echo half > "$HYPER_OUTPUT/partial.txt"; exit 3; fi\n'
         'echo whole > "$HYPER_OUTPUT/final.txt"\n')


@pytest.mark.slow
def test_a_failed_attempt_leaves_nothing_in_the_retrys_output_over_ssh(
        ssh_hosts, hyper, hyper_home, tmp_path):
    """The same on an SSH host (the path of cloud nodes too): the node's output folder and
    the copy brought here hold the winner's files only."""
    [host] = ssh_hosts.start(1)
    path = tmp_path / "again.yaml"
    path.write_text(yaml.safe_dump({
        "name": "again", "cluster": {"provider": "ssh", "hosts": [host.address()],
                                     "identity_file": str(ssh_hosts.client_key)},
        "experiments": {"flaky": {"retries": 1, "command": FLAKY}}}))
    r = hyper("run", path, "--trust-new-hosts", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    out = hyper_home / "storage" / "again-1" / "flaky-0000"
    assert sorted(os.listdir(out)) == ["final.txt", "rows.jsonl"]
    assert (out / "rows.jsonl").read_text() == '{"row": 2}\n'
    on_node = host.run("ls -A /root/.hyper/outputs/again-1").stdout.split()
    assert on_node == ["flaky-0000"]  # no attempt's folder left there
