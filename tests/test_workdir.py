"""The workdir sent to remote nodes (issue 27, item 2): .gitignore and .hyperignore honoured
(nested, negation, git's rule that an excluded folder's files stay out), only the contents a
node lacks sent (by SHA-256, checked on arrival), what is sent said with its size,
``workdir: none``, and a workdir over the limit refused naming its largest folders. The
node's side runs for real: here as a process on this machine, and end to end over SSH."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import ROOT
from hypercli import workdir
from hypercli.errors import UsageError

NODE_PY = f"PYTHONPATH={ROOT} {sys.executable} -S"


def tree(base: Path, files: dict) -> Path:
    for rel, text in files.items():
        p = base / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return base


def paths(m: workdir.Manifest) -> set:
    return {e[0] for e in m.entries if e[1] != "d"}


def test_ignore_files_are_honoured_as_git_does(tmp_path, hyper_home):
    w = tree(tmp_path / "w", {
        "train.py": "x", "run.log": "x", "keep.log": "x",
        "data/big.bin": "x", "data/small.csv": "x",
        "sub/a.py": "x", "sub/scratch.tmp": "x", "sub/deep/b.tmp": "x",
        ".git/HEAD": "x", ".venv/bin/python": "x", "pkg/__pycache__/m.pyc": "x",
        "models/w.pt": "x", "models/readme.md": "x",
        ".gitignore": "*.log\ndata/\nmodels/*\n!models/readme.md\n",
        ".hyperignore": "!keep.log\n!data/small.csv\n",  # data/ stays excluded (git's rule)
        "sub/.gitignore": "*.tmp\n",
    })
    m = workdir.build(w)
    assert paths(m) == {"train.py", "keep.log", "sub/a.py", ".gitignore", ".hyperignore",
                        "sub/.gitignore", "models/readme.md"}
    assert m.files == 7 and m.ignored >= 7
    (w / "sub" / ".hyperignore").write_text("!scratch.tmp\n")  # deeper rules win
    assert "sub/scratch.tmp" in paths(workdir.build(w))
    assert "sub/deep/b.tmp" not in paths(workdir.build(w))


def test_state_folder_and_sockets_are_never_read(tmp_path, hyper_home, monkeypatch):
    import socket
    w = tree(tmp_path / "w", {"a.py": "x", "state/state.db": "secret"})
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(w / "sock"))
    try:
        m = workdir.build(w, skip=w / "state")
    finally:
        s.close()
    assert paths(m) == {"a.py"}


def test_over_the_limit_names_the_largest_folders(tmp_path, hyper_home):
    w = tree(tmp_path / "w", {"a.py": "x"})
    for rel, n in (("data/raw/x.bin", 6000), ("ckpt/y.bin", 3000), ("logs/z.txt", 100)):
        p = w / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"0" * n)
    with pytest.raises(UsageError) as e:
        workdir.build(w, max_bytes=4096)
    msg = str(e.value)
    assert "over the 4.0 KiB limit" in msg and "largest folders: data/ (5.9 KiB), " \
        "ckpt/ (2.9 KiB), logs/ (100 B)" in msg, msg
    assert "data/raw/" not in msg  # the outermost folder of a chain is named
    assert ".hyperignore" in e.value.hint


def _node(root: Path):
    """A node's side run for real, as a process on this machine."""
    def run(cmd: str, data: bytes) -> bytes:
        p = subprocess.run(["/bin/sh", "-c", cmd], input=data, capture_output=True)
        if p.returncode:
            raise RuntimeError(p.stderr.decode())
        return p.stdout
    return run


def test_only_what_the_node_lacks_is_sent(tmp_path, hyper_home):
    w = tree(tmp_path / "w", {"a.py": "A" * 1000, "b.py": "B" * 2000, "same.txt": "A" * 1000,
                              "bin/tool": "#!/bin/sh\n"})
    (w / "bin" / "tool").chmod(0o755)
    (w / "link").symlink_to("a.py")
    node, run = tmp_path / "node", _node(tmp_path / "node")
    m = workdir.build(w)
    first = workdir.sync(run, NODE_PY, str(node), "wf-1", m)
    assert (first.files, first.bytes) == (3, 3010)  # a.py and same.txt: one content
    again = workdir.sync(run, NODE_PY, str(node), "wf-1", m)
    assert again.current and again.bytes == 0  # a resumed run: its folder is left alone
    (w / "b.py").write_text("changed")
    (w / "a.py").unlink()
    m2 = workdir.build(w)
    second = workdir.sync(run, NODE_PY, str(node), "wf-2", m2)  # a new workflow
    assert (second.files, second.bytes, second.kept) == (1, 7, 2)
    got = node / "work" / "wf-2"
    assert sorted(p.name for p in got.iterdir()) == ["b.py", "bin", "link", "same.txt"]
    assert (got / "b.py").read_text() == "changed" and os.readlink(got / "link") == "a.py"
    assert os.access(got / "bin" / "tool", os.X_OK)
    assert (node / "work" / "wf-1" / "b.py").read_text() == "B" * 2000  # untouched
    # a task writing into its folder does not change the store the next folder is built from
    (node / "work" / "wf-2" / "same.txt").write_text("task wrote this")
    workdir.sync(run, NODE_PY, str(node), "wf-3", m2)
    assert (node / "work" / "wf-3" / "same.txt").read_text() == "A" * 1000


def test_a_file_changed_after_its_manifest_is_sent_as_it_is_now(tmp_path, hyper_home):
    """The workdir changes during a run (a node joins later): the sender finds a file whose
    content is no longer the manifest's, nothing is applied, and a fresh manifest is sent.
    The node checks every object against its name too."""
    import io
    import tarfile
    w = tree(tmp_path / "w", {"a.py": "first"})
    node, run = tmp_path / "node", _node(tmp_path / "node")
    m = workdir.manifest("wf-1", str(w))
    (w / "a.py").write_text("other")  # same size, other content, after it was hashed
    with pytest.raises(workdir.Changed, match="a.py"):
        workdir.sync(run, NODE_PY, str(node), "wf-1", m)
    assert not (node / "work" / "wf-1").exists()
    m = workdir.manifest("wf-1", str(w), fresh=True)
    workdir.sync(run, NODE_PY, str(node), "wf-1", m)
    assert (node / "work" / "wf-1" / "a.py").read_text() == "other"
    buf = io.BytesIO()  # an object whose content is not its name
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in (("manifest.json", m.as_json()), ("objects/" + "0" * 64, b"x")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    with pytest.raises(RuntimeError, match="changed while it was sent"):
        run(f"{NODE_PY} -m hypercli.node.workdir {node} wf-2 apply", buf.getvalue())
    assert not (node / "work" / "wf-2").exists()
    assert ("0" * 64) not in os.listdir(node / "work" / ".objects")


def test_workdir_none_in_a_recipe(hyper, write_recipe, hyper_home):
    from hypercli.recipe import parse_recipe
    base = "name: r\nexperiments: {e: {command: 'true'}}\n"
    assert parse_recipe(base + "workdir: none\n").workdir is None
    assert parse_recipe(base + "workdir: null\n").workdir is None
    assert parse_recipe(base + "workdir: ./none\n", base_dir="/x").workdir == "/x/none"
    path = write_recipe("""
        name: nowd
        workdir: none
        experiments:
          look:
            command: ls -A | wc -l > "$HYPER_OUTPUT/n"; pwd > "$HYPER_OUTPUT/pwd"
    """)
    hyper("run", path, check=True)
    out = hyper_home / "storage" / "nowd-1" / "look-0000"
    assert (out / "n").read_text().strip() == "0"  # started in an empty folder
    assert (out / "pwd").read_text().strip() == str(hyper_home / "local" / "work" / "nowd-1")


@pytest.mark.slow
def test_over_ssh_ignored_files_stay_home_and_reruns_send_what_changed(
        ssh_hosts, tmp_path, hyper, hyper_home):
    hosts = ssh_hosts.start(2)
    w = tree(tmp_path / "proj", {"train.py": "print('v1')\n", "notes.log": "x",
                                 "data/big.bin": "x" * 100_000, ".gitignore": "*.log\ndata/\n"})
    recipe = {"name": "wd", "workdir": str(w),
              "cluster": {"provider": "ssh", "hosts": [h.address() for h in hosts],
                          "identity_file": str(ssh_hosts.client_key)},
              "experiments": {"go": {"parameters": {"i": [1, 2]},
                                     "command": "ls -A | sort | tr '\\n' ' '; echo; "
                                                "if [ -f train.py ]; then python3 train.py; "
                                                "else echo no-workdir; fi"}}}
    path = tmp_path / "wd.yaml"
    path.write_text(yaml.safe_dump(recipe))
    r = hyper("run", path, "--trust-new-hosts", check=True)
    assert "workdir " + str(w) + ": 2 files, 24 B (2 ignored" in r.stdout, r.stdout
    assert r.stdout.count("sent 2 files (24 B), 0 already there") == 2, r.stdout
    for h in hosts:  # the ignored files never reached a host
        listing = h.run("ls -A /root/.hyper/work/wd-1").stdout.split()
        assert listing == [".gitignore", "train.py"], listing
    logs = hyper("logs", "wd-1/go-0000", check=True).stdout
    assert "v1" in logs and ".gitignore train.py" in logs
    (w / "train.py").write_text("print('v2')\n")
    r = hyper("run", path, "--new", check=True)
    assert r.stdout.count("sent 1 file (12 B), 1 already there") == 2, r.stdout
    assert "v2" in hyper("logs", "wd-2/go-0000", check=True).stdout
    recipe["workdir"] = "none"
    path.write_text(yaml.safe_dump(recipe))
    r = hyper("run", path, "--new", check=True)
    assert "workdir" not in r.stdout and "sent" not in r.stdout, r.stdout
    assert hyper("logs", "wd-3/go-0000", check=True).stdout.split() == ["no-workdir"]
