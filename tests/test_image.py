"""Image datasets (hypercli.mount.image): a folder pushed as one EROFS image; its mount is the
kernel's EROFS reading the image through the chunked FUSE mount, whose daemon pushes each
chunk into the page cache. Real S3 server on loopback, real mkfs.erofs, real EROFS and FUSE
mounts (root), the CLI and the node command as users and nodes run them, a recipe end to end."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hypercli.mount import image, pack
from s3server import s3  # noqa: F401  (fixture)
from test_copy_mount import make_tree, mounted, run_node, unmount_after  # noqa: F401

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="mounting EROFS needs root"),
    pytest.mark.skipif(shutil.which("mkfs.erofs") is None,
                       reason="erofs-utils is not installed"),
]
MiB = 1 << 20


def gone(pid: int, timeout: float = 20.0) -> bool:
    """Whether process ``pid`` has ended (or is a zombie) within ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def mounts_under(path: Path) -> list[str]:
    return [line.split()[1] for line in open("/proc/mounts")
            if line.split()[1].startswith(str(path))]


def tree(root: Path) -> dict[str, bytes]:
    files = make_tree(root, n=200, size=9_000)
    (root / "part-0" / "deep" / "er").mkdir(parents=True)
    (root / "part-0" / "deep" / "er" / "x.txt").write_bytes(b"deep\n")
    files["part-0/deep/er/x.txt"] = b"deep\n"
    os.symlink("f000.bin", root / "part-0" / "link")
    os.chmod(root / "part-1" / "f001.bin", 0o640)
    return files


def test_push_mount_read_and_unmount_with_the_cli(s3, hyper, tmp_path, unmount_after):
    s3.make_bucket("bkt")
    files = tree(tmp_path / "src")
    r = hyper("data", "push", "--image", "--chunk-size", "1", tmp_path / "src", "s3://bkt/img")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"pushed {len(files)} files, 5 folders" in r.stdout and "as an image of" in r.stdout
    m = json.loads(s3.client().get_object(Bucket="bkt", Key="img/manifest.json")["Body"].read())
    assert m["layout"] == "erofs" and m["files"] == 1 and m["source"]["files"] == len(files)
    assert len(m["chunks"]) >= 2
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    unmount_after(mnt)
    r = hyper("data", "mount", "s3://bkt/img", mnt, "--cache-dir", cache)
    assert r.returncode == 0, r.stdout + r.stderr
    pid = int(r.stdout.split("daemon pid ")[1].split(")")[0])
    opts = mounted(mnt).split(",")
    assert {"ro", "nosuid", "nodev"} <= set(opts)
    assert [line.split()[2] for line in open("/proc/mounts")
            if line.split()[1] == str(mnt)] == ["erofs"]
    assert mounts_under(cache) == []  # the image's FUSE mount is detached, not listed
    got = {str(p.relative_to(mnt)): p.read_bytes() for p in mnt.rglob("*")
           if p.is_file() and not p.is_symlink()}
    assert got == files
    assert os.readlink(mnt / "part-0" / "link") == "f000.bin"
    assert (mnt / "part-1" / "f001.bin").stat().st_mode & 0o777 == 0o640
    with pytest.raises(OSError) as e:
        (mnt / "new").write_bytes(b"x")
    assert e.value.errno == errno.EROFS
    r = hyper("data", "unmount", mnt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert mounted(mnt) is None
    assert gone(pid), "the image's daemon outlived its mount"
    r = hyper("data", "pull", "s3://bkt/img", tmp_path / "pulled")  # the image, and a note
    assert r.returncode == 0, r.stdout + r.stderr
    assert "is an image dataset" in r.stderr and "fsck.erofs --extract" in r.stderr
    subprocess.run(["fsck.erofs", f"--extract={tmp_path / 'unpacked'}",
                    str(tmp_path / "pulled" / image.IMAGE)], check=True, capture_output=True)
    assert {str(p.relative_to(tmp_path / "unpacked")): p.read_bytes()
            for p in (tmp_path / "unpacked").rglob("*")
            if p.is_file() and not p.is_symlink()} == files


def test_a_corrupt_chunk_is_eio_for_its_files_and_never_other_bytes(s3, tmp_path,
                                                                   unmount_after):
    s3.make_bucket("bkt")
    files = tree(tmp_path / "src")
    report, _ = image.push(tmp_path / "src", "s3://bkt/img", chunk_size=MiB,
                           endpoint_url=s3.endpoint)
    assert report.chunks >= 2
    m = json.loads(s3.client().get_object(Bucket="bkt", Key="img/manifest.json")["Body"].read())
    sha = m["chunks"][-1][0]  # the last chunk (the superblock is in the first)
    key = f"img/chunks/{sha}"
    body = bytearray(s3.client().get_object(Bucket="bkt", Key=key)["Body"].read())
    body[len(body) // 2] ^= 0xFF
    s3.client().put_object(Bucket="bkt", Key=key, Body=bytes(body))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    unmount_after(mnt)
    pid = image.mount("s3://bkt/img", mnt, cache_dir=tmp_path / "cache", cache_bytes=64 * MiB,
                      endpoint_url=s3.endpoint)
    exact = eio = 0
    for rel, data in files.items():
        try:
            got = (mnt / rel).read_bytes()
        except OSError as e:
            assert e.errno == errno.EIO, (rel, e)
            eio += 1
            continue
        assert got == data, f"{rel}: wrong bytes"
        exact += 1
    assert eio > 0 and exact > 0, (eio, exact)
    subprocess.run(["umount", str(mnt)], check=True)
    assert gone(pid)


def test_the_node_command_mounts_it_and_refuses_a_plain_mount_of_it(s3, tmp_path,
                                                                    unmount_after):
    s3.make_bucket("bkt")
    files = tree(tmp_path / "src")
    image.push(tmp_path / "src", "s3://bkt/img", chunk_size=MiB, endpoint_url=s3.endpoint)
    pack.push(tmp_path / "src", "s3://bkt/plain", chunk_size=MiB, endpoint_url=s3.endpoint)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    unmount_after(mnt)
    r = run_node("mount", "s3://bkt/img", mnt, "--cache-dir", tmp_path / "cache")
    assert r.returncode == 0, r.stderr
    assert "image dataset" in r.stdout
    pid = int(r.stdout.rsplit("(pid ", 1)[1].split(")")[0])
    assert (mnt / "part-2" / "f002.bin").read_bytes() == files["part-2/f002.bin"]
    subprocess.run(["umount", str(mnt)], check=True)
    assert gone(pid)
    with pytest.raises(Exception) as e:  # image.mount of a dataset that is not an image
        image.mount("s3://bkt/plain", mnt, cache_dir=tmp_path / "cache", cache_bytes=MiB,
                    endpoint_url=s3.endpoint)
    assert "not an image dataset" in str(e.value)
    assert mounted(mnt) is None and mounts_under(tmp_path / "cache") == []


def test_push_without_mkfs_erofs_names_the_package(hyper, tmp_path, monkeypatch):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_bytes(b"a")
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    for tool in ("python3", "env", "sh"):  # a PATH with no mkfs.erofs
        found = shutil.which(tool)
        if found:
            os.symlink(found, bin_ / tool)
    monkeypatch.setenv("PATH", str(bin_))
    r = hyper("data", "push", "--image", tmp_path / "src", f"file://{tmp_path}/store")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "mkfs.erofs" in r.stderr and "erofs-utils" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (tmp_path / "store").exists() or not any((tmp_path / "store").rglob("*.json"))


def test_a_recipe_reads_an_image_dataset_on_its_nodes(s3, hyper, hyper_home, tmp_path,
                                                      unmount_after):
    s3.make_bucket("bkt")
    files = tree(tmp_path / "src")
    image.push(tmp_path / "src", "s3://bkt/img", chunk_size=MiB, endpoint_url=s3.endpoint)
    mnt = tmp_path / "mnt"
    recipe = {"name": "imaged", "cluster": {"workers": 2}, "storage": "s3://bkt/out",
              "mounts": {str(mnt): "chunks+s3://bkt/img"},
              "experiments": {"read": {
                  "parameters": {"i": [0, 1]},
                  "command": f'cat "{mnt}"/part-*/*.bin | sha256sum | cut -c1-64 '
                             '> "$HYPER_OUTPUT/sum"'}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    want = hashlib.sha256(b"".join(files[k] for k in sorted(files)
                                   if k.endswith(".bin") and k.count("/") == 1)).hexdigest()
    unmount_after(mnt)
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [line.split()[2] for line in open("/proc/mounts")
            if line.split()[1] == str(mnt)] == ["erofs"]
    sums = {(pack_out(tmp_path, i) / "sum").read_text().strip() for i in range(2)}
    assert sums == {want}
    r = hyper("down", "imaged")
    assert r.returncode == 0 and f"mount {mnt}" in r.stdout, r.stdout + r.stderr
    assert mounted(mnt) is None


def pack_out(tmp_path: Path, i: int) -> Path:
    """Task ``read-000i``'s outputs of workflow ``imaged-1``, pulled here."""
    out = tmp_path / f"out-{i}"
    pack.pull(f"s3://bkt/out/imaged-1/read-000{i}", out)
    return out


@pytest.mark.parametrize("store", [False, True])
def test_stored_chunks_answer_later_reads_from_the_page_cache(tmp_path, store):
    """One 8 MiB file in 1 MiB chunks read 4 KiB at a time at 256 random places (kernel
    read-ahead off): with ``store_chunks`` the daemon answers a few READs per chunk (the
    rest are in the page cache already), without it about one per place."""
    import random

    from hypercli.mount import fusefs
    src = tmp_path / "src"
    src.mkdir()
    data = os.urandom(8 * MiB)
    (src / "big.bin").write_bytes(data)
    pack.push(src, f"file://{tmp_path}/store", chunk_size=MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fusefs.mount(f"file://{tmp_path}/store", mnt, cache_dir=tmp_path / "cache",
                 cache_bytes=64 * MiB, foreground=False, warm_entries=0, server="low",
                 store_chunks=store)
    try:
        rng = random.Random(7)
        fd = os.open(mnt / "big.bin", os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            for _ in range(256):
                off = rng.randrange(0, 8 * MiB // 4096) * 4096
                assert os.pread(fd, 4096, off) == data[off:off + 4096]
                if store:
                    time.sleep(0.002)  # the store thread's turn
        finally:
            os.close(fd)
        reads = fusefs.mount_stats(mnt)["ops"]["read"]["calls"]
    finally:
        fusefs.unmount(mnt)
    if store:
        assert reads < 128, reads
    else:
        assert reads > 160, reads


def test_mode_copy_of_an_image_dataset_mounts_the_local_image(s3, tmp_path, unmount_after):
    """``mode: copy`` copies the image file to the node's disk and mounts it with EROFS (the
    folder of files, not a folder holding ``image.erofs``); the copy counts as in use while
    mounted, so no other copy's room-making drops it."""
    from hypercli.mount import copy
    s3.make_bucket("bkt")
    files = tree(tmp_path / "src")
    image.push(tmp_path / "src", "s3://bkt/img", chunk_size=MiB, endpoint_url=s3.endpoint)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    unmount_after(mnt)
    r = run_node("copy", "s3://bkt/img", mnt, "--root", tmp_path / "copies")
    assert r.returncode == 0, r.stderr
    assert [line.split()[2] for line in open("/proc/mounts")
            if line.split()[1] == str(mnt)] == ["erofs"]
    assert {"ro", "nosuid", "nodev"} <= set(mounted(mnt).split(","))
    got = {str(p.relative_to(mnt)): p.read_bytes() for p in mnt.rglob("*")
           if p.is_file() and not p.is_symlink()}
    assert got == files
    key = next(p.name for p in (tmp_path / "copies").iterdir() if len(p.name) == 64)
    assert copy._in_use(key)
    subprocess.run(["umount", str(mnt)], check=True)
    assert not copy._in_use(key)
