"""`mode: copy` dataset mounts (hypercli.mount.copy): the dataset copied whole to the node's
disk, checked, shared by the node's tasks and bound read-only. Real S3 server on loopback,
real bind mounts (root), the node command as nodes run it, and a recipe run end to end."""

from __future__ import annotations

import errno
import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from hypercli.errors import RecipeError
from hypercli.mount import pack
from hypercli.recipe import parse_recipe
from s3server import s3  # noqa: F401  (fixture)
from test_dataset_boundary import rewrite_index

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")
ROOT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def mounted(path: Path) -> str | None:
    """The mount options of path in /proc/mounts, or None."""
    for line in open("/proc/mounts"):
        f = line.split()
        if f[1] == str(path):
            return f[3]
    return None


def node(*args, **kw) -> subprocess.Popen:
    """``python -m hypercli.mount.node ARGS`` as a node runs it."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.Popen([sys.executable, "-m", "hypercli.mount.node", *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            cwd="/", **kw)


def run_node(*args) -> subprocess.CompletedProcess:
    p = node(*args)
    out, err = p.communicate(timeout=120)
    return subprocess.CompletedProcess(p.args, p.returncode, out, err)


@pytest.fixture
def unmount_after():
    paths: list[Path] = []
    yield paths.append
    for p in reversed(paths):
        while mounted(p):
            if subprocess.run(["umount", str(p)], capture_output=True).returncode != 0:
                subprocess.run(["umount", "-l", str(p)], capture_output=True)
                break


def make_tree(root: Path, n: int = 30, size: int = 100_000) -> dict[str, bytes]:
    files = {}
    for i in range(n):
        rel = f"part-{i % 3}/f{i:03d}.bin"
        data = os.urandom(size) + f"#{i}".encode()
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


def read_tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def copies(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.is_dir() and len(p.name) == 64)


def test_two_tasks_of_a_node_share_one_copy_read_only(s3, tmp_path, unmount_after):
    s3.make_bucket("data")
    files = make_tree(tmp_path / "src")
    pack.push(tmp_path / "src", "s3://data/ds", chunk_size=MiB)
    root = tmp_path / "copies"
    mps = [tmp_path / "a", tmp_path / "b"]
    for mp in mps:
        mp.mkdir()
        unmount_after(mp)
    procs = [node("copy", "s3://data/ds", mp, "--root", root) for mp in mps]  # at once
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    said = sorted(o[0].split(" ", 1)[0] for o in outs)
    assert said == ["copied", "reused"], outs  # one fetched it, the other waited and reused
    assert len(copies(root)) == 1
    assert not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    for mp in mps:
        opts = mounted(mp).split(",")
        assert {"ro", "nosuid", "nodev"} <= set(opts)
        assert read_tree(mp) == files  # byte for byte
    # the copy itself is one folder: both mounts show the same inode
    assert os.stat(mps[0] / "part-0/f000.bin").st_ino == os.stat(mps[1] / "part-0/f000.bin").st_ino
    # a task cannot write into the shared copy: not through its mount (even as root) ...
    for attempt in (lambda: (mps[0] / "part-0/f000.bin").write_bytes(b"x"),
                    lambda: (mps[0] / "new").write_bytes(b"x"),
                    lambda: (mps[0] / "part-1/f001.bin").unlink(),
                    lambda: os.chmod(mps[0] / "part-0/f000.bin", 0o777)):
        with pytest.raises(OSError) as e:
            attempt()
        assert e.value.errno == errno.EROFS
    # ... nor, as another user, around it: the copies' folder is root's alone
    assert os.stat(root).st_mode & 0o077 == 0
    key = copies(root)[0]
    r = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "sh",
                        "-c", f"echo x > {root}/{key}/data/part-0/f000.bin"],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "Permission denied" in r.stderr
    assert read_tree(mps[1]) == files
    # a later workflow reuses the copy kept on the node: no download at all
    s3.make_bucket("other")  # (the store is still up; the copy is found by its manifest)
    again = tmp_path / "c"
    again.mkdir()
    unmount_after(again)
    r = run_node("copy", "s3://data/ds", again, "--root", root)
    assert r.returncode == 0 and r.stdout.startswith("reused"), r.stdout + r.stderr


def test_a_corrupt_chunk_is_an_error_never_a_wrong_file(s3, tmp_path, unmount_after):
    s3.make_bucket("data")
    make_tree(tmp_path / "src")
    pack.push(tmp_path / "src", "s3://data/ds", chunk_size=MiB)
    client = s3.client()
    key = next(o["Key"] for o in client.list_objects_v2(Bucket="data",
                                                        Prefix="ds/chunks/")["Contents"])
    good = client.get_object(Bucket="data", Key=key)["Body"].read()
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    client.put_object(Bucket="data", Key=key, Body=bytes(bad))  # same size, one byte off
    root, mp = tmp_path / "copies", tmp_path / "mnt"
    mp.mkdir()
    unmount_after(mp)
    r = run_node("copy", "s3://data/ds", mp, "--root", root)
    assert r.returncode == 1
    assert "corrupt" in r.stderr and key.rsplit("/", 1)[1] in r.stderr
    assert mounted(mp) is None and list(mp.iterdir()) == []
    assert copies(root) == [] and not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    client.put_object(Bucket="data", Key=key, Body=good)  # repaired: the next try copies it
    r = run_node("copy", "s3://data/ds", mp, "--root", root)
    assert r.returncode == 0, r.stderr
    assert read_tree(mp) == read_tree(tmp_path / "src")


def test_a_dataset_over_the_budget_is_refused_and_unused_copies_make_room(
        s3, tmp_path, unmount_after):
    s3.make_bucket("data")
    for name in ("one", "two"):
        make_tree(tmp_path / name, n=12, size=100_000)  # ~1.2 MB each
        pack.push(tmp_path / name, f"s3://data/{name}", chunk_size=MiB)
    root = tmp_path / "copies"
    mps = {n: tmp_path / f"mnt-{n}" for n in ("one", "two")}
    for mp in mps.values():
        mp.mkdir()
        unmount_after(mp)
    r = run_node("copy", "s3://data/one", mps["one"], "--root", root, "--budget-mib", 1)
    assert r.returncode == 1 and mounted(mps["one"]) is None
    assert "larger than the copy budget" in r.stderr and "without `mode: copy`" in r.stderr
    assert not root.exists() or copies(root) == []
    # a budget for one: the second dataset cannot take the place of the first while in use
    r = run_node("copy", "s3://data/one", mps["one"], "--root", root, "--budget-mib", 2)
    assert r.returncode == 0, r.stderr
    r = run_node("copy", "s3://data/two", mps["two"], "--root", root, "--budget-mib", 2)
    assert r.returncode == 1 and "over the copy budget" in r.stderr, r.stderr
    assert mounted(mps["two"]) is None and len(copies(root)) == 1
    # once unmounted, the first copy makes room for the second
    subprocess.run(["umount", str(mps["one"])], check=True)
    r = run_node("copy", "s3://data/two", mps["two"], "--root", root, "--budget-mib", 2)
    assert r.returncode == 0, r.stderr
    assert len(copies(root)) == 1
    assert read_tree(mps["two"]) == read_tree(tmp_path / "two")


def test_recipe_mode_copy_is_for_datasets_only():
    text = "name: r\nmounts:\n  /data: {url: %s, mode: copy}\nexperiments:\n  a: {command: 'true'}\n"
    r = parse_recipe(text % "chunks+s3://b/ds")
    assert r.copy_mounts == frozenset({"/data"}) and r.mounts == {"/data": "chunks+s3://b/ds"}
    with pytest.raises(RecipeError) as e:
        parse_recipe(text % "s3://b/raw")
    assert "only a chunks+ dataset can be copied" in str(e.value)
    with pytest.raises(RecipeError) as e:
        parse_recipe(text.replace("copy", "cpy") % "chunks+s3://b/ds")
    assert "mode must be ro, rw or copy" in str(e.value)


def test_local_run_with_a_copied_dataset(s3, hyper, hyper_home, tmp_path):
    s3.make_bucket("bkt")
    files = make_tree(tmp_path / "src", n=8, size=500)
    pack.push(tmp_path / "src", "s3://bkt/ds", chunk_size=MiB)
    mnt = tmp_path / "mnt"
    recipe = {"name": "copied", "cluster": {"workers": 2}, "storage": "s3://bkt/out",
              "mounts": {str(mnt): {"url": "chunks+s3://bkt/ds", "mode": "copy"}},
              "experiments": {"read": {
                  "parameters": {"i": [0, 1, 2, 3]},
                  "command": f'cat "{mnt}"/part-*/* | sha256sum | cut -c1-64 '
                             '> "$HYPER_OUTPUT/sum"; '
                             f'if touch "{mnt}/x" 2>/dev/null; then echo written; else '
                             'echo refused; fi > "$HYPER_OUTPUT/write"'}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    want = hashlib.sha256(b"".join(files[k] for k in sorted(files))).hexdigest()
    try:
        r = hyper("run", path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "ro" in mounted(mnt).split(",")
        for i in range(4):
            out = tmp_path / f"out-{i}"
            pack.pull(f"s3://bkt/out/copied-1/read-000{i}", out)
            assert (out / "sum").read_text().strip() == want
            assert (out / "write").read_text().strip() == "refused"
        kept = [p for p in hyper_home.rglob("copies/*/data")]
        assert len(kept) == 1  # the node's tasks shared one copy
        r = hyper("down", "copied")
        assert r.returncode == 0 and f"mount {mnt}" in r.stdout, r.stdout + r.stderr
        assert mounted(mnt) is None
    finally:
        while mounted(mnt):
            if subprocess.run(["umount", str(mnt)]).returncode != 0:
                break


@pytest.mark.parametrize("craft", ["dotdot", "below-a-file", "root-is-a-file"])
def test_a_crafted_index_writes_nothing_outside_the_copy(tmp_path, unmount_after, craft):
    """An index naming a path with '..', a file below a file, or a root that is a file: a
    clear error, nothing written outside the copies' folder, no copy kept."""
    make_tree(tmp_path / "src", n=4, size=1000)
    url = f"file://{tmp_path}/store"
    pack.push(tmp_path / "src", url, chunk_size=MiB)
    outside = tmp_path / "outside"
    outside.mkdir()
    row = ("INSERT INTO files VALUES ('{p}', '{parent}', '{name}', 'd', 0, 16877, 0, NULL, "
           "NULL);")
    rewrite_index(url, tmp_path, {
        "dotdot": row.format(p="../../outside/evil", parent="../../outside", name="evil"),
        "below-a-file": row.format(p="part-0/f000.bin/evil", parent="part-0/f000.bin",
                                   name="evil"),
        "root-is-a-file": "UPDATE files SET kind='f', sha256=(SELECT sha256 FROM files "
                          "WHERE path='part-0/f000.bin') WHERE path='';"
                          "INSERT INTO segments SELECT '', seq, chunk, offset, length FROM "
                          "segments WHERE path='part-0/f000.bin';"}[craft])
    root, mp = tmp_path / "copies", tmp_path / "mnt"
    mp.mkdir()
    unmount_after(mp)
    r = run_node("copy", url, mp, "--root", root)
    assert r.returncode == 1 and r.stderr.startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    assert {"dotdot": "index is corrupt", "below-a-file": "refusing path 'part-0/f000.bin/evil'",
            "root-is-a-file": "root is not a folder"}[craft] in r.stderr
    assert os.listdir(outside) == [] and mounted(mp) is None
    assert copies(root) == [] and not [p for p in root.iterdir() if p.name.startswith(".tmp-")]
