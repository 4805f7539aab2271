"""The wall around a task (issue 22, items 2, 3, 4, 7 and 15), in one place: what a task can
do to its node and to hypercli, tried the way a task would try it (from inside a real podman
container where the promise is about containers), and what holds.

* A task in a container cannot write its attempt's control folder: a pid file it rewrites,
  a log it swaps for a symlink or a FIFO live in its own root file system, not the agent's.
* The agent reads back only regular files, opened without following a symlink and without
  waiting (a task on the node itself can swap its logs too): ``hyper logs`` never prints a
  host file through a log and never hangs on a FIFO; it signals only the process group it
  started.
* Output folders are made without following symlinks; a task cannot make another task's
  output a host folder, and ``hyper outputs`` never copies a host folder out.
* ``image:`` is an image reference, checked at validation, and passed after ``--``.
* Every attempt writes a fresh output folder; only the winner's becomes the task's output.
* A tar stream from a node is extracted member by member, each checked (CVE-2025-4517).
"""

from __future__ import annotations

import io
import os
import stat
import tarfile

import pytest

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


def test_ssh_untar_holds_against_cve_2025_4517(tmp_path):
    """providers/ssh.py's ``_untar`` (logs and outputs from a node): the data filter's
    PATH_MAX bypass plants nothing beside the target folder."""
    from hypercli.providers.ssh import _untar
    dest = tmp_path / "in"
    dest.mkdir()
    _untar(_past_path_max(dest), dest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in"]
    assert not any(n == "planted" for _, _, fs in os.walk(tmp_path) for n in fs)
