"""Datasets as chunks (hypercli.mount.pack, `hyper data`): push, ls, pull, verify.

Against a real S3 API server (moto_server behind a fault-injecting proxy, the ``s3`` fixture)
and ``file://`` folders. The big tree is one nobody here wrote: this Python's standard library
source folder (~2,400 files, ~57 MB; without site-packages, __pycache__ and the 45 MB
libpython*.a build archive, which only made the suite slower: files spanning chunks are tested
on their own below).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import sqlite3
import stat
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from conftest import ROOT
from hypercli.errors import HyperError, InfraError, UsageError
from hypercli.mount import pack
from hypercli.mount.index import Index
from hypercli.mount.store import StoreError, open_store
from s3server import s3  # noqa: F401  (fixture)

MiB = 1 << 20


# -- helpers ------------------------------------------------------------------------------
def snapshot(root: Path, with_dir_mtimes: bool = True) -> dict:
    """path → (kind, mode, size, sha256 of bytes or link target, mtime s) for a whole tree."""
    out = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            st = os.lstat(p)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", None, None, os.readlink(p), st.st_mtime)
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", stat.S_IMODE(st.st_mode), None, None,
                            st.st_mtime if with_dir_mtimes else None)
            elif stat.S_ISREG(st.st_mode):
                out[rel] = ("f", stat.S_IMODE(st.st_mode), st.st_size,
                            hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime)
        dirs[:] = [d for d in dirs if not (Path(dirpath) / d).is_symlink()]
    return out


def assert_same_tree(a: Path, b: Path) -> None:
    """Same names, kinds, modes, sizes, bytes and link targets; mtimes within 1 µs (the
    dataset index keeps them as doubles: ~0.24 µs apart at today's dates)."""
    sa, sb = snapshot(a), snapshot(b)
    assert sorted(sa) == sorted(sb), set(sa) ^ set(sb)
    diff = [k for k in sa if sa[k][:4] != sb[k][:4] or (sa[k][4] is None) != (sb[k][4] is None)
            or sa[k][4] is not None and abs(sa[k][4] - sb[k][4]) > 1e-6]
    assert not diff, [(k, sa[k], sb[k]) for k in diff[:5]]


@pytest.fixture(scope="module")
def stdlib_tree(tmp_path_factory) -> Path:
    """A copy of this Python's standard library source folder (see the module docstring).
    A test that changes it puts it back."""
    dst = tmp_path_factory.mktemp("stdlib") / "lib"
    shutil.copytree(sysconfig.get_paths()["stdlib"], dst, symlinks=True,
                    ignore=shutil.ignore_patterns("site-packages", "__pycache__", "*.a"))
    return dst


def chunk_objects(s3, bucket: str, prefix: str) -> dict:
    """key → (size, LastModified, ETag) of the chunk objects under prefix."""
    out = {}
    for page in s3.client().get_paginator("list_objects_v2").paginate(
            Bucket=bucket, Prefix=f"{prefix}/chunks/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["Size"], o["LastModified"], o["ETag"])
    return out


def random_tree(root: Path, n: int, seed: int, max_size: int = 20_000) -> list[str]:
    rnd = random.Random(seed)
    paths = []
    for i in range(n):
        p = root / f"d{rnd.randrange(20):02d}" / f"f{i:05d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd.randbytes(rnd.randrange(1, max_size)))
        paths.append(p.relative_to(root).as_posix())
    return sorted(paths)


# -- the standard library, through S3 -----------------------------------------------------
def test_stdlib_push_pull_verify_roundtrip(s3, stdlib_tree, tmp_path):
    s3.make_bucket("data")
    url = "s3://data/datasets/stdlib"
    r = pack.push(stdlib_tree, url, chunk_size=1 * MiB)
    assert r.files >= 1500 and r.dirs > 50
    assert r.chunks_uploaded == r.chunks > 40 and r.bytes_uploaded == r.bytes
    assert r.bytes == sum(p.stat().st_size for p in stdlib_tree.rglob("*")
                          if p.is_file() and not p.is_symlink())
    print(f"\nstdlib push: {r.files} files, {r.bytes / 1e6:.1f} MB, {r.chunks} chunks, "
          f"{r.seconds:.2f} s = {r.files / r.seconds:.0f} files/s, "
          f"{r.bytes / 1e6 / r.seconds:.1f} MB/s")

    v = pack.verify(url)
    assert v.ok, v.problems
    assert v.chunks == r.chunks

    dest = tmp_path / "pulled"
    p = pack.pull(url, dest)
    assert (p.files, p.bytes, p.chunks) == (r.files, r.bytes, r.chunks)
    assert_same_tree(stdlib_tree, dest)

    names = {e.path for e in pack.ls(url, "json")}
    assert names == {f"json/{n}" for n in os.listdir(stdlib_tree / "json")}
    [one] = pack.ls(url, "/json/decoder.py")
    assert one.kind == "f" and one.size == (stdlib_tree / "json/decoder.py").stat().st_size


def test_incremental_push_uploads_only_new_chunks(s3, stdlib_tree, tmp_path):
    src = stdlib_tree
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*.py"))
    added = Path(files[len(files) // 2]).parent / "aaa_added_by_test.py"
    changed = files[len(files) // 3]
    old_bytes, old_stat = (src / changed).read_bytes(), (src / changed).stat()
    try:
        incremental(s3, src, tmp_path, added, changed, old_bytes)
    finally:  # put the shared tree back
        (src / added).unlink(missing_ok=True)
        (src / changed).write_bytes(old_bytes)
        os.utime(src / changed, ns=(old_stat.st_atime_ns, old_stat.st_mtime_ns))


def incremental(s3, src, tmp_path, added, changed, old_bytes):
    s3.make_bucket("inc")
    url = "s3://inc/std"
    first = pack.push(src, url, chunk_size=1 * MiB)
    before = chunk_objects(s3, "inc", "std")
    assert len(before) == len({sha for sha, _ in json.loads(
        s3.client().get_object(Bucket="inc", Key="std/manifest.json")["Body"].read())["chunks"]})

    time.sleep(1.1)  # a re-upload would show in LastModified (1 s resolution)
    n0 = s3.proxy.requests
    again = pack.push(src, url, chunk_size=1 * MiB)
    assert again.chunks_uploaded == 0 and again.bytes_uploaded == 0
    assert again.chunks == first.chunks and again.index == first.index
    assert s3.proxy.requests - n0 <= 8  # LIST chunks/, HEAD index, PUT manifest
    assert chunk_objects(s3, "inc", "std") == before

    old_manifest = s3.client().get_object(Bucket="inc", Key="std/manifest.json")["Body"].read()
    (src / added).write_text("print('new file in the middle of the pack order')\n" * 50)
    (src / changed).write_bytes(old_bytes + b"\n# changed by the test\n")

    third = pack.push(src, url, chunk_size=1 * MiB)
    print(f"\nincremental push: {third.chunks_uploaded} of {third.chunks} chunks uploaded")
    assert 1 <= third.chunks_uploaded <= 3 and third.chunks > 40
    assert third.files == first.files + 1 and third.index != first.index
    assert added.as_posix() in {e.path for e in pack.ls(url, added.parent.as_posix())}
    out = tmp_path / "new"
    pack.pull(url, out, path_prefix=changed)
    assert (out / changed).read_bytes() == old_bytes + b"\n# changed by the test\n"
    pack.pull(url, out, path_prefix=added.as_posix())
    assert (out / added).read_text() == (src / added).read_text()

    # the old dataset still reads: put its manifest back, verify and pull from it
    s3.client().put_object(Bucket="inc", Key="std/manifest.json", Body=old_manifest)
    assert pack.verify(url).ok
    pack.pull(url, tmp_path / "old", path_prefix=changed)
    assert (tmp_path / "old" / changed).read_bytes() == old_bytes
    with pytest.raises(UsageError, match="no .* in the dataset"):
        pack.ls(url, added.as_posix())


# -- chunking -----------------------------------------------------------------------------
def test_chunk_boundaries_are_content_defined(tmp_path):
    src = tmp_path / "src"
    paths = random_tree(src, 2400, seed=7)
    url = f"file://{tmp_path}/ds"
    r = pack.push(src, url, chunk_size=1 * MiB, jobs=4)
    sizes = [size for _, size in json.loads((tmp_path / "ds/manifest.json").read_text())[
        "chunks"]]
    assert r.chunks == len(sizes) >= 20
    assert all(MiB // 2 <= s <= 2 * MiB for s in sizes[:-1]), sizes
    assert 0.7 * MiB <= sum(sizes) / len(sizes) <= 1.3 * MiB, sum(sizes) / len(sizes)

    rnd = random.Random(1)
    for i in range(4):  # one change at a time, anywhere in the pack order
        if i % 2:
            p = src / rnd.choice(paths)
            p.write_bytes(p.read_bytes()[:-1] + b"!")
        else:
            (src / f"{rnd.choice(paths)}.new{i}").write_bytes(rnd.randbytes(5000))
        assert pack.push(src, url, chunk_size=1 * MiB).chunks_uploaded <= 3
    assert pack.push(src, url, chunk_size=1 * MiB).chunks_uploaded == 0


def test_chunk_size_and_jobs_are_validated(tmp_path):
    (tmp_path / "src").mkdir()
    for bad in (MiB - 1, 1024 * MiB + 1, 0):
        with pytest.raises(UsageError, match="chunk size"):
            pack.push(tmp_path / "src", f"file://{tmp_path}/ds", chunk_size=bad)
    with pytest.raises(UsageError, match="jobs"):
        pack.push(tmp_path / "src", f"file://{tmp_path}/ds", jobs=0)
    assert not (tmp_path / "ds").exists()


# -- odd trees, file:// -------------------------------------------------------------------
def test_odd_tree_roundtrip(tmp_path):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    big = random.Random(3).randbytes(5 * MiB + MiB // 2)
    (src / "big.bin").write_bytes(big)
    (src / "sub" / "file.txt").write_text("hello\n")
    (src / "empty.txt").write_bytes(b"")
    (src / "empty-dir").mkdir()
    (src / "a" / "b" / "c").mkdir(parents=True)
    (src / "link-rel").symlink_to("sub/file.txt")
    (src / "link-abs").symlink_to("/etc/hostname")
    (src / "dangling").symlink_to("nowhere/at all")
    (src / "sublink").symlink_to("sub")  # a link to a folder: stored, not followed
    (src / "données").mkdir()
    (src / "données" / "été.txt").write_text("ça va\n")
    (src / "日本語 😀.txt").write_bytes(b"\xe6\x97\xa5")
    (src / "with space and\nnewline.txt").write_text("odd name\n")
    (src / "run.sh").write_text("#!/bin/sh\n")
    os.chmod(src / "run.sh", 0o755)
    os.chmod(src / "sub" / "file.txt", 0o600)
    os.chmod(src / "a" / "b", 0o750)
    os.utime(src / "sub" / "file.txt", (1_000_000_000, 1_000_000_000.25))
    os.mkfifo(src / "a-fifo")

    url = f"file://{tmp_path}/ds"
    calls = []
    r = pack.push(src, url, chunk_size=1 * MiB, jobs=2,
                  progress=lambda done, total, up: calls.append((done, total, up)))
    assert (r.files, r.symlinks) == (7, 4)
    assert r.dirs == 6  # sub empty-dir a a/b a/b/c données; sublink is a link
    assert r.bytes == len(big) + 6 + 0 + len("ça va\n".encode()) + 3 + 9 + 10
    assert len(r.warnings) == 1 and "fifo" in r.warnings[0]
    assert calls[-1] == (r.bytes, r.bytes, r.bytes_uploaded)

    m = pack.load_manifest(open_store(url))
    idx = Index(pack.fetch_index(open_store(url), m, tmp_path / "cache"))
    segs = idx.segments("big.bin")
    assert [length for _, _, length in segs] == [MiB] * 5 + [MiB // 2]
    assert all(off == 0 for _, off, _ in segs) and len({c for c, _, _ in segs}) == 6
    assert not idx.segments("empty.txt") and idx.stat("empty.txt").size == 0
    assert idx.stat("sublink").kind == "l" and idx.stat("sublink/file.txt") is None
    assert idx.stat("dangling").target == "nowhere/at all"
    assert idx.stat("a-fifo") is None

    root = {e.path: e for e in pack.ls(url)}
    assert {"big.bin", "données", "日本語 😀.txt", "with space and\nnewline.txt",
            "empty-dir", "link-abs"} <= set(root)
    assert root["empty-dir"].kind == "d" and not pack.ls(url, "empty-dir")

    dest = tmp_path / "dest"
    p = pack.pull(url, dest, jobs=3)
    assert (p.files, p.symlinks, p.bytes) == (7, 4, r.bytes)
    os.unlink(src / "a-fifo")
    assert_same_tree(src, dest)
    assert os.stat(dest / "sub" / "file.txt").st_mtime == 1_000_000_000.25
    assert pack.verify(url).ok

    # a subtree only, into a folder that already has files in the way
    part = tmp_path / "part"
    (part / "données").mkdir(parents=True)
    (part / "données" / "été.txt").symlink_to("/etc/passwd")  # replaced, not followed
    pack.pull(url, part, path_prefix="données")
    assert sorted(os.listdir(part)) == ["données"]
    assert (part / "données" / "été.txt").read_text() == "ça va\n"
    assert not (part / "données" / "été.txt").is_symlink()


def _rewrite_index(url: str, tmp: Path, sql: str) -> None:
    """Tamper with a dataset's index (and re-sign it in the manifest), as an attacker could."""
    store = open_store(url)
    m = pack.load_manifest(store)
    path = tmp / "evil.sqlite"
    shutil.copy(pack.fetch_index(store, m, tmp / "c"), path)
    db = sqlite3.connect(path)
    db.executescript(sql)
    db.close()
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    store.put_file(f"index/{sha}.sqlite", path)
    store.put("manifest.json", json.dumps(dict(m, index=f"index/{sha}.sqlite",
                                               index_sha256=sha)).encode())


@pytest.mark.parametrize("attack", ["dotdot", "symlink-parent"])
def test_pull_refuses_to_write_outside_dest(tmp_path, attack):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x").write_text("payload\n")
    url = f"file://{tmp_path}/ds"
    pack.push(src, url, chunk_size=MiB)
    outside = tmp_path / "outside"
    outside.mkdir()
    if attack == "dotdot":
        sql = ("UPDATE files SET path='a/../../outside/x' WHERE path='a/x';"
               "UPDATE segments SET path='a/../../outside/x' WHERE path='a/x';")
    else:
        sql = f"UPDATE files SET kind='l', target='{outside}' WHERE path='a';"
    _rewrite_index(url, tmp_path, sql)
    with pytest.raises(pack.DatasetError, match="refusing path|not a relative path"):
        pack.pull(url, tmp_path / "dest", cache_dir=tmp_path / "cache")
    assert os.listdir(outside) == []


# -- verify and faults --------------------------------------------------------------------
def test_verify_finds_corrupt_missing_and_truncated_chunks(s3, tmp_path):
    s3.make_bucket("bad")
    src = tmp_path / "src"
    random_tree(src, 300, seed=2, max_size=40_000)
    big = random.Random(4).randbytes(3 * MiB + 5)
    (src / "zz-big.bin").write_bytes(big)  # spans 4 chunks of its own, packed last
    url = "s3://bad/ds"
    r = pack.push(src, url, chunk_size=MiB)
    assert r.chunks >= 8
    pack.pull(url, tmp_path / "ok", path_prefix="zz-big.bin")
    assert (tmp_path / "ok" / "zz-big.bin").read_bytes() == big
    shas = [sha for sha, _ in pack.load_manifest(open_store(url))["chunks"]]
    c = s3.client()
    size1 = c.head_object(Bucket="bad", Key=f"ds/chunks/{shas[1]}")["ContentLength"]
    c.put_object(Bucket="bad", Key=f"ds/chunks/{shas[1]}", Body=b"x" * size1)  # same size
    c.delete_object(Bucket="bad", Key=f"ds/chunks/{shas[2]}")
    c.put_object(Bucket="bad", Key=f"ds/chunks/{shas[3]}", Body=b"short")

    v = pack.verify(url)
    assert not v.ok and len(v.problems) == 3, v.problems
    text = "\n".join(v.problems)
    assert f"chunks/{shas[1]}: corrupt" in text
    assert f"chunks/{shas[2]}: missing" in text
    assert f"chunks/{shas[3]}: 5 bytes, expected" in text
    assert shas[0] not in text
    with pytest.raises(StoreError, match="corrupt"):  # stops at the first bad chunk
        pack.pull(url, tmp_path / "dest")
    written = [p for p in (tmp_path / "dest").rglob("*") if p.is_file()]
    assert 0 < len(written) < 300  # the files before it, every one of them right
    assert all(p.read_bytes() == (src / p.relative_to(tmp_path / "dest")).read_bytes()
               for p in written)
    again = pack.push(src, url, chunk_size=MiB)  # a push mends the missing and short chunks
    assert again.chunks_uploaded == 2
    assert [p for p in pack.verify(url).problems if shas[1] not in p] == []

    m = pack.load_manifest(open_store(url))
    c.put_object(Bucket="bad", Key=f"ds/{m['index']}", Body=b"not an index")
    v = pack.verify(url)
    assert any("sha256" in p and "index/" in p for p in v.problems), v.problems
    assert len(v.problems) == 2  # the index and the same-size corrupt chunk


def test_errors_are_hyper_errors_with_clear_messages(s3, tmp_path):
    s3.make_bucket("err")
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    with pytest.raises(UsageError, match="no such folder"):
        pack.push(tmp_path / "missing", "s3://err/ds")
    with pytest.raises(UsageError, match="not a folder"):
        pack.push(src / "f", "s3://err/ds")
    with pytest.raises(UsageError, match="unknown store scheme 'ftp'"):
        pack.push(src, "ftp://host/ds")
    with pytest.raises(UsageError, match=r"no dataset at s3://err/nothing \(no manifest"):
        pack.ls("s3://err/nothing")
    with pytest.raises(StoreError, match="no such bucket"):
        pack.push(src, "s3://no-such-bucket/ds")

    pack.push(src, "s3://err/ds", chunk_size=MiB)
    s3.proxy.stop()
    try:
        for call in (lambda: pack.push(src, "s3://err/ds2"),  # 3 attempts each (store.py)
                     lambda: pack.ls("s3://err/ds")):
            with pytest.raises(InfraError) as e:
                call()
            assert isinstance(e.value, HyperError) and "Could not connect" in str(e.value)
            assert "s3://err/" in str(e.value)
    finally:
        s3.proxy.start()
    assert [e.path for e in pack.ls("s3://err/ds")] == ["f"]


# -- the command line ---------------------------------------------------------------------
def hyper_data(*args, env=None):
    """`python -m hypercli data ...`"""
    return subprocess.run([sys.executable, "-m", "hypercli", "data", *map(str, args)], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(env or os.environ, COLUMNS="200"))


def test_cli_push_ls_verify_and_exit_codes(s3, hyper_home, tmp_path):
    s3.make_bucket("cli")
    src = tmp_path / "src"
    random_tree(src, 50, seed=5)
    (src / "x y.txt").write_text("spaced\n")

    p = hyper_data("push", src, "s3://cli/ds", "--chunk-size", 1, "--jobs", 4)
    assert p.returncode == 0, p.stderr
    assert "pushed 51 files" in p.stdout and "chunk" in p.stdout and " uploaded (" in p.stdout
    p = hyper_data("ls", "s3://cli/ds", "--json")
    assert p.returncode == 0, p.stderr
    listed = json.loads(p.stdout)
    assert {e["path"] for e in listed} >= {"x y.txt", "d00"}
    assert next(e for e in listed if e["path"] == "x y.txt")["size"] == 7
    p = hyper_data("ls", "s3://cli/ds")
    assert p.returncode == 0 and "x y.txt" in p.stdout and "d00/" in p.stdout
    p = hyper_data("pull", "s3://cli/ds", tmp_path / "out")
    assert p.returncode == 0 and (tmp_path / "out" / "x y.txt").read_text() == "spaced\n"
    assert hyper_data("verify", "s3://cli/ds").returncode == 0

    sha = json.loads(s3.client().get_object(Bucket="cli", Key="ds/manifest.json")["Body"]
                     .read())["chunks"][0][0]
    s3.client().put_object(Bucket="cli", Key=f"ds/chunks/{sha}", Body=b"garbage")
    p = hyper_data("verify", "s3://cli/ds")
    assert p.returncode == 1 and f"chunks/{sha}" in p.stdout

    for args, code, msg in ((("push", tmp_path / "nope", "s3://cli/ds"), 2, "no such folder"),
                            (("ls", "s3://cli/empty"), 2, "no dataset at")):
        p = hyper_data(*args)
        assert (p.returncode, "Traceback" in p.stderr) == (code, False), p.stderr
        assert msg in p.stderr
    s3.proxy.stop()
    try:
        p = hyper_data("push", src, "s3://cli/ds")
    finally:
        s3.proxy.start()
    assert (p.returncode, "Traceback" in p.stderr) == (3, False), p.stderr
    assert "Could not connect" in p.stderr and "hint:" in p.stderr


def test_help_does_not_import_boto3():
    code = ("import sys\n"
            "from hypercli.cli import cli\n"

            "for argv in (['--help'], ['data', '--help'], ['data', 'push', '--help']):\n"
            "    try:\n"
            "        cli(argv, prog_name='hyper')\n"
            "    except SystemExit as e:\n"
            "        assert e.code == 0, e.code\n"
            "print('boto3' in sys.modules, 'botocore' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                       timeout=60)
    assert p.returncode == 0, p.stderr
    assert "--chunk-size" in p.stdout and p.stdout.strip().endswith("False False")
