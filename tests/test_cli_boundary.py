"""What hypercli does on the laptop's side of the wall: it never unmounts, deletes or
replaces what it did not make, keeps its state folder private, prints user text as text,
writes valid JSON, keeps the dashboard answering, and says plainly when its folder is
read-only or its disk is full (issue 22, items 5, 6, 9, 10, 11, 13, 14). Real `hyper`
processes on the local provider, real mounts (tmpfs, FUSE), a real dashboard process."""

from __future__ import annotations

import errno
import json
import os
import re
import shutil
import stat
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import ROOT, _kill_leftovers, hyper_cmd

from hypercli.state import State

root_only = pytest.mark.skipif(os.geteuid() != 0, reason="mounts need root")


def _hyper(home: Path, *args, timeout: float = 120, env: dict | None = None):
    """The real CLI with ``HYPER_HOME=home``."""
    e = dict(os.environ, COLUMNS="200", HYPER_HOME=str(home), **(env or {}))
    return subprocess.run([*hyper_cmd(), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=e, cwd=ROOT)


def _mount_tmpfs(path: Path, size: str = "1m") -> None:
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs",
                    str(path)], check=True)


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def _fill(folder: Path) -> None:
    """Write into ``folder`` until its file system is full."""
    fd = os.open(folder / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _top_mount(path: Path) -> str | None:
    """The type of the mount on top at ``path``, from /proc/self/mountinfo, or None."""
    top = None
    for line in open("/proc/self/mountinfo"):
        fields = line.split(" - ")
        if fields[0].split()[4] == str(path):
            top = fields[1].split()[0]
    return top


def _strict_json(text: str):
    """JSON as RFC 8259 has it: NaN and Infinity are not JSON."""
    def refuse(name):
        raise ValueError(f"{name} is not JSON")
    return json.loads(text, parse_constant=refuse)


# -- a workflow whose values, metric keys, commands, logs and failure hold markup -----------
MARKED = """
name: marks
cluster: {workers: 2}
experiments:
  search:
    parameters:
      tag: ["[/]", "[link=http://evil.example]x[/link]", "[bold]b"]
    command: |
      echo "out [/] [link=http://e.example]click[/link] :smile:"
      echo '{"loss [/]": NaN, "acc": Infinity, "[link=http://e.example]k[/link]": -Infinity, "n": 1.5}' >> "$HYPER_METRICS"
      echo "err [/] [red]x" >&2
      test {{tag}} != '[bold]b'
"""


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    """(HYPER_HOME, recipe path, the `hyper run` result) of the MARKED workflow, run once."""
    top = tmp_path_factory.mktemp("marks")
    home, recipe = top / "home", top / "r.yaml"
    recipe.write_text(MARKED)
    try:
        yield home, recipe, _hyper(home, "run", recipe)
    finally:
        _kill_leftovers(home)


_SGR = re.compile(r"\x1b\[[0-9;]*m")


# -- 10: user text with console markup is printed as it is ---------------------------------
def test_markup_in_user_text_is_printed_as_text(marked):
    home, recipe, run = marked
    assert run.returncode == 1, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "failed: search-0002" in run.stdout and "  err [/] [red]x" in run.stdout
    # a terminal that shows colours and hyperlinks: nothing of the user's becomes one
    term = {"FORCE_COLOR": "1", "TERM": "xterm-256color"}
    expect = {
        ("plan", recipe): ["[link=http://e.example]click[/link] :smile:",
                           "test '[link=http://evil.example]x[/link]' != '[bold]b'"],
        ("ps",): ["marks-1"],
        ("ps", "marks-1"): ["tag=[/]", "tag=[link=http://evil.example]x[/link]",
                            "tag=[bold]b"],
        ("results", "marks-1"): ["loss [/]", "[link=http://e.example]k[/link]", "[/]",
                                 "[link=http://evil.example]x[/link]"],
        ("logs", "marks-1/search-0000"): ["out [/] [link=http://e.example]click[/link] "
                                          ":smile:"],
        ("status",): ["marks"],
        ("stats", "marks-1/search-0002"): ["marks-1/search-0002 attempt 1"],
        ("top", "--once"): ["marks-0"],
    }
    for args, texts in expect.items():
        r = _hyper(home, *args, env=term)
        assert r.returncode == 0, (args, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr and "MarkupError" not in r.stderr, r.stderr
        assert "\x1b]8;" not in r.stdout, (args, r.stdout)  # OSC 8: a live hyperlink
        plain = _SGR.sub("", r.stdout)
        for t in texts:
            assert t in plain, (args, t, plain)
        assert "😄" not in plain  # an emoji code is text too
    # an error's text holds the user's value as it is
    r = _hyper(home, "results", "marks-1", "--sort", "[/][link=x]y")
    assert r.returncode == 2 and "'[/][link=x]y'" in r.stderr, r.stderr


# -- 11: NaN and infinities: kept, shown, and JSON stays JSON -------------------------------
def test_non_finite_metrics_are_shown_and_json_stays_valid(marked):
    home = marked[0]
    r = _hyper(home, "results", "marks-1", "--json")
    assert r.returncode == 0, r.stderr
    rows = _strict_json(r.stdout)
    assert rows[0]["metrics"] == {"loss [/]": "NaN", "acc": "Infinity",
                                  "[link=http://e.example]k[/link]": "-Infinity", "n": 1.5}
    ps = _strict_json(_hyper(home, "ps", "marks-1", "--json").stdout)
    assert {t["metrics"]["acc"] for t in ps} == {"Infinity"}
    table = _hyper(home, "results", "marks-1", "--sort", "acc").stdout
    line = next(x for x in table.splitlines() if "search-0000" in x)
    assert re.search(r"\bnan\b", line) and re.search(r"(?<!-)\binf\b", line) and \
        "-inf" in line and "1.5" in line, table
    # the state file keeps the numbers themselves
    assert State(home / "state.db").task("marks-1", "search-0000")["metrics"]["acc"] == \
        float("inf")


# -- 13: the dashboard answers every route while one request reads a log that hangs --------
def _start_ui(home: Path) -> tuple[subprocess.Popen, str, str]:
    """`hyper ui` on a free port: (process, base URL, token)."""
    p = subprocess.Popen([*hyper_cmd(), "ui", "--port", "0"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=dict(os.environ, HYPER_HOME=str(home)))
    line, end = "", time.time() + 30
    while "http://" not in line and time.time() < end:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            raise AssertionError(f"hyper ui exited {p.returncode}: {p.stderr.read()}")
    url = line.strip()
    return p, url.split("/?token=")[0], url.split("token=")[1]


def _get(base: str, token: str, path: str, timeout: float) -> tuple[int, bytes]:
    req = urllib.request.Request(base + path, headers={"Cookie": f"hyper_ui_token={token}"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_dashboard_answers_while_a_log_is_a_fifo_and_sends_valid_json(marked):
    home = marked[0]
    attempt = State(home / "state.db").attempts("marks-1", "search-0001")[-1]["id"]
    log = home / "local" / "tasks" / attempt / "stdout"
    log.unlink()
    os.mkfifo(log)  # as a task (or anyone) could leave it: opening it to read waits forever
    ui, base, token = _start_ui(home)
    slow: dict = {}
    t = threading.Thread(target=lambda: slow.update(
        r=_get(base, token, "/api/w/marks-1/t/search-0001", 60)), daemon=True)
    try:
        t.start()
        time.sleep(0.5)  # that request is in
        status, body = _get(base, token, "/api/workflows", 20)
        assert status == 200 and b"marks-1" in body
        status, body = _get(base, token, "/api/w/marks-1/r/search", 20)
        assert status == 200, body
        res = _strict_json(body)
        assert res["rows"][0]["metrics"]["loss [/]"] == "NaN"
        assert res["rows"][0]["metrics"]["acc"] == "Infinity"
        t.join(30)
        assert not t.is_alive(), "the request for the FIFO's task never answered"
        status, body = slow["r"]
        assert status == 200 and "is not a regular file" in _strict_json(body)["log_error"]
        r = _hyper(home, "logs", "marks-1/search-0001", timeout=60)
        assert r.returncode == 3 and "is not a regular file" in r.stderr, r.stderr
    finally:
        ui.terminate()
        try:
            ui.wait(timeout=10)
        except subprocess.TimeoutExpired:
            ui.kill()
            ui.wait()
        try:  # a reader still waiting on the FIFO (the old code) gets its end of file
            os.close(os.open(log, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:
            pass
        ui.stdout.close()
        ui.stderr.close()


# -- 9: the state folder and hypercli's folders in it are private ---------------------------
def test_state_folders_are_private_and_an_open_home_is_told(hyper_home, hyper,
                                                           write_recipe):
    path = write_recipe("""
        name: priv
        cluster: {workers: 1}
        experiments: {one: {command: 'echo x > "$HYPER_OUTPUT/x"'}}
    """)
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    for p in (hyper_home, hyper_home / "local", hyper_home / "storage"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o700, p
    assert "chmod" not in r.stderr
    os.chmod(hyper_home, 0o755)  # as an older hypercli, or the user, left it
    r = hyper("ps")
    assert r.returncode == 0
    assert f"{hyper_home} (HYPER_HOME) has mode 0755" in r.stderr and \
        f"chmod 700 {hyper_home}" in r.stderr, r.stderr
    assert stat.S_IMODE(hyper_home.stat().st_mode) == 0o755  # told, not changed


# -- 6: `hyper outputs` replaces only what it wrote, follows no symlink ---------------------
OUTPUTS = """
    name: outs
    cluster: {workers: 2}
    experiments:
      shard:
        parameters: {i: [0, 1]}
        command: |
          echo "row {{i}}" > "$HYPER_OUTPUT/predictions.jsonl"
          echo '{"workflow": "not hypercli"}' > "$HYPER_OUTPUT/.hyper-outputs.json"
      quiet: {command: 'true'}
"""


def test_outputs_never_replace_what_hypercli_did_not_write(hyper_home, hyper, write_recipe,
                                                            tmp_path):
    r = hyper("run", write_recipe(OUTPUTS))
    assert r.returncode == 0, r.stdout + r.stderr
    dest = tmp_path / "out"
    mine = dest / "shard-0000" / "mine.txt"
    mine.parent.mkdir(parents=True)
    mine.write_text("the user's")
    r = hyper("outputs", "outs-1", "shard", dest)  # a folder of the user's where one goes
    assert r.returncode == 2 and str(dest / "shard-0000") in r.stderr, r.stdout + r.stderr
    assert mine.read_text() == "the user's"
    assert sorted(p.name for p in dest.iterdir()) == ["shard-0000"]  # nothing pulled

    shutil.rmtree(mine.parent)  # a symlink there: refused, not followed, nothing left over
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("keep")
    (dest / "shard-0000").symlink_to(elsewhere)
    r = hyper("outputs", "outs-1", "shard", dest)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"{dest / 'shard-0000'} is a symlink" in r.stderr
    assert sorted(p.name for p in elsewhere.iterdir()) == ["keep.txt"]
    assert sorted(p.name for p in dest.iterdir()) == ["shard-0000"]

    (dest / "shard-0000").unlink()  # pulled, merged; a task's own record name is not merged
    r = hyper("outputs", "outs-1", dest, "--merge")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 task outputs pulled" in r.stdout and "merged predictions.jsonl" in r.stdout
    assert (dest / "predictions.jsonl").read_text() == "row 0\nrow 1\n"
    assert (dest / "quiet-0000").is_dir()  # a task that wrote nothing: an empty folder
    assert json.loads((dest / ".hyper-outputs.json").read_text())["workflow"] == "outs-1"
    assert "not merged: .hyper-outputs.json" in r.stderr
    assert not [p.name for p in dest.iterdir() if p.name.startswith(".hyper-")
                and p.name != ".hyper-outputs.json"]

    notes = dest / "shard-0001" / "notes.txt"  # the user's file in a task's folder...
    notes.write_text("my notes")
    src = hyper_home / "storage" / "outs-1" / "shard-0001" / "predictions.jsonl"
    src.write_text("row 1 again\n")  # ...and its source changed: refused, nothing deleted
    r = hyper("outputs", "outs-1", dest)
    assert r.returncode == 2 and str(notes) in r.stderr, r.stderr
    assert notes.read_text() == "my notes"
    assert (dest / "shard-0001" / "predictions.jsonl").read_text() == "row 1\n"
    notes.unlink()  # once it is moved away, the new output replaces hypercli's own
    r = hyper("outputs", "outs-1", dest, "--merge")
    assert r.returncode == 0 and "1 task output pulled" in r.stdout, r.stdout + r.stderr
    assert (dest / "shard-0001" / "predictions.jsonl").read_text() == "row 1 again\n"
    assert (dest / "predictions.jsonl").read_text() == "row 0\nrow 1 again\n"

    other = tmp_path / "other"  # a merged file over the user's own: refused
    other.mkdir()
    (other / "predictions.jsonl").write_text("the user's")
    r = hyper("outputs", "outs-1", other, "--merge")
    assert r.returncode == 2 and str(other / "predictions.jsonl") in r.stderr, r.stderr
    assert (other / "predictions.jsonl").read_text() == "the user's"

    bad = tmp_path / "bad"  # a record that is not one, DIR that is a file: said, no trace
    bad.mkdir()
    (bad / ".hyper-outputs.json").write_text("{not json")
    r = hyper("outputs", "outs-1", bad)
    assert r.returncode == 2 and str(bad / ".hyper-outputs.json") in r.stderr, r.stderr
    (tmp_path / "afile").write_text("x")
    r = hyper("outputs", "outs-1", tmp_path / "afile")
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr


# -- 5: mounts go only where nothing is; `hyper down` unmounts only its own -----------------
def _dataset(tmp_path: Path) -> str:
    from hypercli.mount import pack
    src = tmp_path / "src"
    src.mkdir()
    (src / "data.txt").write_text("from the dataset\n")
    url = "file://" + str(tmp_path / "store")
    pack.push(src, url, chunk_size=1 << 20)
    return url


def _mount_recipe(tmp_path: Path, mounts: dict, name: str = "mnt") -> Path:
    import yaml
    first = next(iter(mounts))
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({
        "name": name, "cluster": {"workers": 1}, "mounts": mounts,
        "experiments": {"read": {"command": f'ls "{first}" > "$HYPER_OUTPUT/seen"'}}}))
    return path


def test_system_mount_paths_are_refused(hyper_home, hyper, tmp_path):
    for path, why in (("/etc", "a system folder"), ("/usr/local/data", "inside the system "
                      "folder /usr"), ("/var/lib/x", "inside the system folder /var"),
                      ("/home/someone", "a user's home folder"), ("/tmp", "a system folder"),
                      (str(Path.home()), "")):
        r = hyper("plan", _mount_recipe(tmp_path, {path: "s3://bucket/ds"}))
        assert r.returncode == 2 and f"cannot mount over {path}: it is" in r.stderr and \
            why in r.stderr, (path, r.stderr)


@root_only
def test_mount_paths_in_use_are_refused(hyper_home, hyper, tmp_path):
    url = "chunks+" + _dataset(tmp_path)
    theirs = tmp_path / "theirs"  # a tmpfs of the user's
    _mount_tmpfs(theirs)
    try:
        (theirs / "mine").write_text("the user's")
        r = hyper("run", _mount_recipe(tmp_path, {str(theirs): url}))
        assert r.returncode == 2, r.stdout + r.stderr
        assert f"{theirs} is already a mount point that hypercli did not make (tmpfs" in \
            r.stderr
        full = tmp_path / "full"
        full.mkdir()
        (full / "f").write_text("x")
        r = hyper("run", _mount_recipe(tmp_path, {str(full): url}, name="full"))
        assert r.returncode == 2 and f"{full} is a folder with files in it" in r.stderr
        r = hyper("down", "mnt")
        assert r.returncode == 0, r.stderr
        assert _top_mount(theirs) == "tmpfs" and (theirs / "mine").read_text() == "the user's"
    finally:
        _umount(theirs)


@root_only
def test_down_unmounts_only_the_mount_hypercli_made(hyper_home, hyper, tmp_path):
    url = "chunks+" + _dataset(tmp_path)
    mnt = tmp_path / "mnt"
    try:
        r = hyper("run", _mount_recipe(tmp_path, {str(mnt): url}))
        assert r.returncode == 0, r.stdout + r.stderr
        assert _top_mount(mnt) == "fuse.hyper"
        subprocess.run(["fusermount3", "-u", str(mnt)], check=True)  # ours, gone...
        _mount_tmpfs(mnt)  # ...and the user's tmpfs in its place
        (mnt / "mine").write_text("the user's")
        r = hyper("down", "mnt")
        assert r.returncode == 0, r.stderr
        assert f"mount {mnt}" not in r.stdout
        assert _top_mount(mnt) == "tmpfs" and (mnt / "mine").read_text() == "the user's"
    finally:
        _umount(mnt)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


# -- 14: a read-only state folder, a full disk ----------------------------------------------
SMALL = """
    name: small
    cluster: {workers: 1}
    experiments:
      one:
        command: |
          echo hi
          echo '{"score": 3}' >> "$HYPER_METRICS"
"""


@root_only
def test_a_read_only_state_folder_is_read_and_writes_say_why(hyper_home, hyper,
                                                              write_recipe, tmp_path,
                                                              monkeypatch):
    path = write_recipe(SMALL)
    assert hyper("run", path).returncode == 0
    ro = tmp_path / "ro"
    ro.mkdir()
    subprocess.run(["mount", "--bind", str(hyper_home), str(ro)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(ro)], check=True)
        monkeypatch.setenv("HYPER_HOME", str(ro))
        for args, text in ((("ps",), "small-1"), (("ps", "small-1"), "succeeded"),
                           (("results", "small-1"), "score"),
                           (("logs", "small/one-0000"), "hi"), (("status",), "small"),
                           (("stats", "small/one-0000"), "attempt 1")):
            r = hyper(*args)
            assert r.returncode == 0 and text in r.stdout, (args, r.stdout, r.stderr)
            assert "unable to open database file" not in r.stderr
        r = hyper("run", path, "--new")
        assert r.returncode == 3, r.stdout + r.stderr
        assert f"{ro} is on a read-only file system" in r.stderr, r.stderr
    finally:
        _umount(ro)


@root_only
def test_a_full_disk_is_named_and_the_task_kept(hyper_home, hyper, write_recipe):
    hyper_home.mkdir(mode=0o700)
    local = hyper_home / "local"  # the local node's folder: its attempt folders go there
    _mount_tmpfs(local, "64k")
    try:
        _fill(local)
        r = hyper("run", write_recipe(SMALL))
        assert r.returncode == 1, r.stdout + r.stderr
        assert f"no space left on {local}" in r.stdout
        task = State().task("small-1", "one-0000")
        assert task["status"] == "failed" and task["attempts"] == 1
        a = State().attempts("small-1", "one-0000")[-1]
        assert a["status"] == "failed" and f"no space left on {local}" in a["error"]
    finally:
        _umount(local)


@root_only
def test_a_full_state_disk_is_named(tmp_path, write_recipe):
    home = tmp_path / "home"
    _mount_tmpfs(home, "2m")
    try:
        path = write_recipe(SMALL)
        assert _hyper(home, "run", path).returncode == 0
        _fill(home)
        r = _hyper(home, "ps", "small-1")
        assert r.returncode == 0 and "succeeded" in r.stdout, r.stderr
        r = _hyper(home, "run", path, "--new")
        assert r.returncode == 3 and f"no space left on {home}" in r.stderr, r.stderr
        assert "disk I/O error" not in r.stderr
    finally:
        _kill_leftovers(home)
        _umount(home)


# -- bad input found on the way: said, never silently replaced ------------------------------
def test_zero_workers_is_refused_not_the_default(hyper_home, hyper):
    r = hyper("up", "--provider", "local", "--workers", "0", "--name", "zero")
    assert r.returncode == 2 and "workers must be at least 1" in r.stderr, r.stdout + r.stderr
