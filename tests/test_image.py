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


def image_recipe(tmp_path: Path, mnt: Path, command: str, *, workers: int,
                 tasks: int) -> Path:
    """A recipe ``imaged`` (local cluster of ``workers``) mounting the image dataset
    ``s3://bkt/img`` at ``mnt``, experiment ``read`` of ``tasks`` tasks running ``command``,
    outputs to ``s3://bkt/out``; written to ``tmp_path/r.yaml``, whose path is returned."""
    recipe = {"name": "imaged", "cluster": {"workers": workers}, "storage": "s3://bkt/out",
              "mounts": {str(mnt): "chunks+s3://bkt/img"},
              "experiments": {"read": {"parameters": {"i": list(range(tasks))},
                                       "command": command}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def bins_sum(files: dict[str, bytes]) -> str:
    """SHA-256 (hex) of the ``part-*/*.bin`` files of :func:`tree`, in name order: what
    ``cat part-*/*.bin | sha256sum`` prints."""
    return hashlib.sha256(b"".join(files[k] for k in sorted(files)
                                   if k.endswith(".bin") and k.count("/") == 1)).hexdigest()


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
    path = image_recipe(tmp_path, mnt, f'cat "{mnt}"/part-*/*.bin | sha256sum | cut -c1-64 '
                        '> "$HYPER_OUTPUT/sum"', workers=2, tasks=2)
    want = bins_sum(files)
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


# -- attacks: a hostile store, a hostile task, a careless user ---------------------------
def daemons_of(marker: str) -> list[int]:
    """Pids of the running mount daemons with ``marker`` (a store's URL, a test's own
    folder) in an argument (found for assertions and cleanup; zombies left out)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if b"hypercli.mount.fusefs" in cmd and state != "Z" and any(
                marker.encode() in arg for arg in cmd):
            pids.append(int(d.name))
    return pids


@pytest.fixture
def stop_daemons():
    """Stops (by pid) the daemons of the stores given, once the test is over."""
    stores: list[str] = []
    yield stores.append
    for store in stores:
        for pid in daemons_of(store):
            os.kill(pid, 9)


def hostile(tmp_path: Path, name: str, make) -> str:
    """A dataset whose manifest says it is an image but whose contents ``make(folder)``
    laid out; its file:// URL."""
    src = tmp_path / f"{name}-src"
    src.mkdir()
    make(src)
    url = f"file://{tmp_path}/{name}"
    pack.push(src, url, chunk_size=MiB, extra={"layout": "erofs"})
    return url


def host_image(tmp_path: Path) -> Path:
    """An EROFS image lying on the node, holding a secret (no part of any dataset)."""
    (tmp_path / "host" / "sec").mkdir(parents=True)
    (tmp_path / "host" / "sec" / "key").write_text("secret of the node\n")
    subprocess.run(["mkfs.erofs", "--quiet", str(tmp_path / "host.erofs"),
                    str(tmp_path / "host" / "sec")], check=True)
    return tmp_path / "host.erofs"


@pytest.mark.parametrize("shape", ["symlink", "folder", "missing", "extra"])
def test_a_dataset_that_is_not_one_image_file_is_refused(tmp_path, unmount_after,
                                                        stop_daemons, shape):
    """A store's manifest claims "layout": "erofs" but ``image.erofs`` is a symlink to an
    image on the node (the kernel would mount the node's file), a folder, absent, or has
    other files beside it: refused with the reason, nothing left mounted."""
    from hypercli.errors import HyperError
    real = tmp_path / "real.erofs"
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "a").write_text("a")
    subprocess.run(["mkfs.erofs", "--quiet", str(real), str(tmp_path / "r")], check=True)
    secret = host_image(tmp_path)

    def make(src: Path) -> None:
        if shape == "symlink":
            os.symlink(secret, src / image.IMAGE)
        elif shape == "folder":
            (src / image.IMAGE).mkdir()
            (src / image.IMAGE / "x").write_text("x")
        elif shape == "missing":
            shutil.copy(real, src / "other.erofs")
        else:
            shutil.copy(real, src / image.IMAGE)
            (src / "notes.txt").write_text("more")
    url = hostile(tmp_path, "bad", make)
    stop_daemons(f"{tmp_path}/bad")
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    unmount_after(mnt)
    with pytest.raises(HyperError) as e:
        image.mount(url, mnt, cache_dir=cache, cache_bytes=64 * MiB)
    assert "image.erofs" in str(e.value) and e.value.hint, e.value
    assert mounted(mnt) is None and mounts_under(cache) == []
    assert not (mnt / "key").exists()
    assert all(gone(pid) for pid in daemons_of(f"{tmp_path}/bad"))


def test_a_planted_private_folder_or_mount_point_symlink_is_refused(tmp_path,
                                                                   unmount_after,
                                                                   stop_daemons):
    """Someone else made the private folder of a mount point a symlink to another folder
    (fusermount3 would mount there), or the mount point itself a symlink: refused, the
    folder they point at is left as it was; a folder of another owner's too."""
    from hypercli.errors import UsageError
    url = f"file://{tmp_path}/store"
    stop_daemons(f"{tmp_path}/store")
    tree(tmp_path / "src")
    image.push(tmp_path / "src", url, chunk_size=MiB)
    mnt, cache, victim = tmp_path / "mnt", tmp_path / "cache", tmp_path / "victim"
    mnt.mkdir()
    victim.mkdir()
    (victim / "keep").write_text("keep")
    unmount_after(mnt)
    unmount_after(victim)
    inner = image.backing_dir(cache, str(mnt))
    inner.parent.mkdir(parents=True)
    os.symlink(victim, inner)
    with pytest.raises(UsageError) as e:
        image.mount(url, mnt, cache_dir=cache, cache_bytes=64 * MiB)
    assert str(inner) in str(e.value) and "symlink" in str(e.value)
    assert mounted(victim) is None and mounted(mnt) is None
    assert [p.name for p in victim.iterdir()] == ["keep"]
    os.unlink(inner)
    inner.mkdir()
    os.chown(inner, 65534, 65534)  # another user's
    with pytest.raises(UsageError):
        image.mount(url, mnt, cache_dir=cache, cache_bytes=64 * MiB)
    assert mounted(mnt) is None
    inner.rmdir()
    link = tmp_path / "link"
    os.symlink(victim, link)  # the mount point a task replaced by a symlink
    with pytest.raises(UsageError) as e:
        image.mount(url, link, cache_dir=cache, cache_bytes=64 * MiB)
    assert "symlink" in str(e.value)
    assert mounted(victim) is None and mounts_under(cache) == []
    assert daemons_of(f"{tmp_path}/store") == []


def test_something_else_mounted_at_the_private_folder_is_never_unmounted(tmp_path,
                                                                        unmount_after,
                                                                        stop_daemons):
    url = f"file://{tmp_path}/store"
    stop_daemons(f"{tmp_path}/store")
    tree(tmp_path / "src")
    image.push(tmp_path / "src", url, chunk_size=MiB)
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    inner = image.backing_dir(cache, str(mnt))
    inner.mkdir(parents=True, mode=0o700)
    inner.parent.chmod(0o700)
    unmount_after(mnt)
    unmount_after(inner)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "theirs", str(inner)], check=True)
    (inner / "theirs").write_text("x")
    from hypercli.errors import UsageError
    with pytest.raises(UsageError) as e:
        image.mount(url, mnt, cache_dir=cache, cache_bytes=64 * MiB)
    assert "tmpfs" in str(e.value)
    assert (inner / "theirs").read_text() == "x" and mounted(mnt) is None


def test_unmount_refuses_what_hypercli_did_not_mount(hyper, tmp_path, unmount_after):
    """``hyper data unmount`` on a tmpfs, on an EROFS mount made by hand, and on a tmpfs
    mounted over an image mount: refused (fusermount3 run by root unmounts any of them),
    all left mounted."""
    secret = host_image(tmp_path)
    for name, cmd in (("t", ["mount", "-t", "tmpfs", "-o", "size=1m", "theirs"]),
                      ("e", ["mount", "-t", "erofs", "-o", "ro", str(secret)])):
        mp = tmp_path / name
        mp.mkdir()
        unmount_after(mp)
        subprocess.run([*cmd, str(mp)], check=True)
        r = hyper("data", "unmount", mp)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
        assert "not a dataset mount of hypercli's" in r.stderr, r.stderr
        assert mounted(mp) is not None
    url = f"file://{tmp_path}/store"
    tree(tmp_path / "src")
    image.push(tmp_path / "src", url, chunk_size=MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    unmount_after(mnt)
    pid = image.mount(url, mnt, cache_dir=tmp_path / "cache", cache_bytes=64 * MiB)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "over", str(mnt)], check=True)
    r = hyper("data", "unmount", mnt)
    assert r.returncode == 2, r.stdout + r.stderr
    assert [line.split()[2] for line in open("/proc/mounts")
            if line.split()[1] == str(mnt)] == ["erofs", "tmpfs"]
    subprocess.run(["umount", str(mnt)], check=True)
    r = hyper("data", "unmount", mnt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert mounted(mnt) is None and gone(pid)


def test_a_mount_point_with_accents_unmounts_and_refuses_a_second_mount(
        hyper, tmp_path, unmount_after):
    url = f"file://{tmp_path}/store"
    files = tree(tmp_path / "src")
    image.push(tmp_path / "src", url, chunk_size=MiB)
    mnt = tmp_path / "données-été"
    mnt.mkdir()
    unmount_after(mnt)
    r = hyper("data", "mount", url, mnt, "--cache-dir", tmp_path / "cache")
    assert r.returncode == 0, r.stdout + r.stderr
    pid = int(r.stdout.split("daemon pid ")[1].split(")")[0])
    assert (mnt / "part-0" / "f000.bin").read_bytes() == files["part-0/f000.bin"]
    r = hyper("data", "mount", url, mnt, "--cache-dir", tmp_path / "cache")
    assert r.returncode == 2 and "already a mount point" in r.stderr, r.stdout + r.stderr
    assert image.mounted_image(mnt)
    r = hyper("data", "unmount", mnt)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not os.path.ismount(mnt) and gone(pid)


def test_an_index_naming_a_chunk_again_and_again_stores_it_once(tmp_path):
    """A store's index makes ``image.erofs`` 300 copies of its bytes in chunk 0 (1 MiB
    chunk, a 300 MiB file): the store of chunk 0 for one READ pushes at most the chunk's
    size into the page cache, not 300 times it."""
    from test_dataset_boundary import rewrite_index

    from hypercli.mount import fuselow, fusefs
    from hypercli.mount.cache import ChunkCache
    from hypercli.mount.store import open_store
    src = tmp_path / "src"
    src.mkdir()
    (src / image.IMAGE).write_bytes(os.urandom(3 * MiB))
    url = f"file://{tmp_path}/store"
    pack.push(src, url, chunk_size=MiB, extra={"layout": "erofs"})
    rewrite_index(url, tmp_path, f"""
        WITH RECURSIVE k(i) AS (SELECT 1 UNION ALL SELECT i + 1 FROM k WHERE i < 300)
        INSERT INTO segments SELECT s.path, 100000 + k.i, s.chunk, s.offset, s.length
            FROM segments s, k WHERE s.path = '{image.IMAGE}' AND s.chunk = 0;
        UPDATE files SET size = (SELECT SUM(length) FROM segments
                                 WHERE path = '{image.IMAGE}') WHERE path = '{image.IMAGE}';
    """)
    _, _, index = fusefs.open_dataset(url, tmp_path / "c")
    size0 = index.chunk_list[0][2]
    cache = ChunkCache(open_store(url), index.chunk_list, tmp_path / "c" / "chunks",
                       max_bytes=64 * MiB)
    counters = memoryview(bytearray(8 * fuselow._SLOT)).cast("Q")
    fs = fuselow.LowFS(index, fuselow._Owned(cache), stats=dict, counters=counters)
    out = tmp_path / "notify"
    fs.fd = os.open(out, os.O_WRONLY | os.O_CREAT, 0o600)  # what would go to /dev/fuse
    try:
        err, parts = fs.handle(fuselow.IN_HDR.pack(40 + len(image.IMAGE) + 1, fuselow.LOOKUP,
                                                   7, 1, 0, 0, 0, 0, 0)
                               + image.IMAGE.encode() + b"\0")
        assert err == 0
        entry = fuselow.ENTRY_OUT.unpack(b"".join(parts))
        nid, size = entry[0], entry[7]  # node id, attr.size
        assert size > 300 * size0 // 2  # the index was taken as written
        fs._store(nid, 0)
    finally:
        os.close(fs.fd)
        fs.pool.shutdown()
        cache.close()
    headers = fuselow.OUT_HDR.size + fuselow.STORE_OUT.size
    assert 0 < out.stat().st_size <= size0 + headers * (size0 // fuselow.STORE_PIECE + 2)


def test_reads_fail_at_once_when_the_daemon_dies_and_a_recipe_mounts_it_again(
        s3, hyper, tmp_path, unmount_after):
    """The image's daemon killed (-9) while the image is mounted: a read of bytes the
    kernel does not hold fails at once (ENOTCONN, no hang), but the EROFS mount still
    answers ``statfs``; the next run of a recipe on that node mounts it again, and its
    tasks read the right bytes; ``hyper down`` unmounts it, its daemon dead again."""
    s3.make_bucket("bkt")
    files = tree(tmp_path / "src")
    big = os.urandom(40 * MiB)  # no task reads it: no byte of its end in the page cache
    (tmp_path / "src" / "big.bin").write_bytes(big)
    image.push(tmp_path / "src", "s3://bkt/img", chunk_size=MiB, endpoint_url=s3.endpoint)
    mnt = tmp_path / "mnt"
    flag = tmp_path / "read-big"  # the second run's task reads 4 KiB of big.bin too
    cmd = (f'cat "{mnt}"/part-*/*.bin | sha256sum | cut -c1-64 > "$HYPER_OUTPUT/sum" && '
           f'if [ -e "{flag}" ]; then dd if="{mnt}/big.bin" bs=4096 skip=5000 count=1 '
           'of="$HYPER_OUTPUT/tail"; fi')
    path = image_recipe(tmp_path, mnt, cmd, workers=1, tasks=1)
    want = bins_sum(files)
    unmount_after(mnt)
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    pids = daemons_of(str(tmp_path))
    assert len(pids) == 1, pids
    os.kill(pids[0], 9)
    assert gone(pids[0])
    reader = subprocess.run(  # in its own process: a hang would end at the timeout
        ["dd", f"if={mnt / 'big.bin'}", "bs=4096", "skip=5000", "count=1", "of=/dev/null"],
        capture_output=True, timeout=60)
    assert reader.returncode != 0 and (b"Input/output error" in reader.stderr or
                                       b"not connected" in reader.stderr), reader
    os.statvfs(mnt)  # still answers: only the daemon's pid tells it is dead
    flag.touch()
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    out = tmp_path / "out-2"
    pack.pull("s3://bkt/out/imaged-2/read-0000", out)
    assert (out / "sum").read_text().strip() == want
    assert (out / "tail").read_bytes() == big[5000 * 4096:5001 * 4096]
    pids = daemons_of(str(tmp_path))
    assert len(pids) == 1, pids
    os.kill(pids[0], 9)  # dead again: hyper down still takes its mount away
    assert gone(pids[0])
    r = hyper("down", "imaged")
    assert r.returncode == 0 and f"mount {mnt}" in r.stdout, r.stdout + r.stderr
    assert mounted(mnt) is None


def test_push_counts_a_symlink_to_a_folder_as_no_folder(hyper, tmp_path):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "a" / "x").write_bytes(b"x" * 10)
    os.symlink("a", src / "to-a")
    os.symlink("a/x", src / "to-x")
    r = hyper("data", "push", "--image", src, f"file://{tmp_path}/store")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pushed 1 file, 1 folder (0.0 MB)" in r.stdout, r.stdout
    m = json.loads((tmp_path / "store" / "manifest.json").read_text())
    assert m["source"] == {"files": 1, "dirs": 1, "bytes": 10}


def test_no_extended_attribute_of_an_image_is_seen_at_its_mount(tmp_path, unmount_after):
    """A store's own image puts a forged ``user.hypercli.stats`` on its root (what
    ``mount_stats`` reads) and an attribute on a file: the mount shows neither; and a pushed
    folder's attributes are not put in its image at all."""
    from hypercli.mount import fusefs
    src = tmp_path / "src"
    src.mkdir()
    (src / "a").write_text("a")
    os.setxattr(src, fusefs.STATS_XATTR, b'{"downloads": 0, "forged": true}')
    os.setxattr(src / "a", "user.note", b"kept?")
    (tmp_path / "own").mkdir()
    subprocess.run(["mkfs.erofs", "--quiet", str(tmp_path / "own" / image.IMAGE), str(src)],
                   check=True)
    own = f"file://{tmp_path}/own-store"
    pack.push(tmp_path / "own", own, chunk_size=MiB, extra={"layout": "erofs"})
    pushed = f"file://{tmp_path}/pushed"
    image.push(src, pushed, chunk_size=MiB)
    for i, url in enumerate((own, pushed)):
        mnt = tmp_path / f"mnt-{i}"
        mnt.mkdir()
        unmount_after(mnt)
        pid = image.mount(url, mnt, cache_dir=tmp_path / "cache", cache_bytes=64 * MiB)
        assert (mnt / "a").read_text() == "a"
        with pytest.raises(OSError) as e:
            fusefs.mount_stats(mnt)
        assert e.value.errno in (errno.ENODATA, errno.EOPNOTSUPP), e.value
        assert os.listxattr(mnt / "a") == [] and os.listxattr(mnt) == []
        image.unmount(mnt)
        assert gone(pid)
    pack.pull(pushed, tmp_path / "pulled")
    for path in ("/", "/a"):
        r = subprocess.run(["dump.erofs", f"--path={path}", str(tmp_path / "pulled" /
                                                                image.IMAGE)],
                           capture_output=True, text=True)
        assert r.returncode == 0 and "Xattr size: 0" in r.stdout, (path, r.stdout, r.stderr)


def test_an_image_file_that_is_not_erofs_is_refused_naming_both_causes(tmp_path,
                                                                      unmount_after,
                                                                      stop_daemons):
    from hypercli.errors import InfraError

    def make(src: Path) -> None:
        (src / image.IMAGE).write_bytes(os.urandom(64 * 1024))
    url = hostile(tmp_path, "junk", make)
    stop_daemons(f"{tmp_path}/junk")
    mnt, cache = tmp_path / "mnt", tmp_path / "cache"
    mnt.mkdir()
    unmount_after(mnt)
    with pytest.raises(InfraError) as e:
        image.mount(url, mnt, cache_dir=cache, cache_bytes=64 * MiB)
    assert "not an EROFS image" in e.value.hint and "6.12" in e.value.hint, e.value.hint
    assert mounted(mnt) is None and mounts_under(cache) == []
    assert all(gone(pid) for pid in daemons_of(f"{tmp_path}/junk"))


def test_unmount_refuses_an_erofs_mount_named_like_an_image_mount(hyper, tmp_path,
                                                                  unmount_after):
    """An EROFS mount made by hand from a file at ``.../image-mounts/<key>/image.erofs`` (the
    path an image mount of that mount point has): not hypercli's, refused, left mounted."""
    secret = host_image(tmp_path)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    fake = image.backing_dir(tmp_path / "theirs", str(mnt))
    fake.mkdir(parents=True)
    shutil.copy(secret, fake / image.IMAGE)
    unmount_after(mnt)
    subprocess.run(["mount", "-t", "erofs", "-o", "ro", str(fake / image.IMAGE), str(mnt)],
                   check=True)
    assert not image.mounted_image(mnt)
    r = hyper("data", "unmount", mnt)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert (mnt / "key").read_text() == "secret of the node\n"


def test_mode_copy_refuses_an_image_that_is_a_symlink(tmp_path, unmount_after):
    """``mode: copy`` of a store's dataset whose ``image.erofs`` is a symlink to an image on
    the node: refused, the node's image not mounted."""
    secret = host_image(tmp_path)
    url = hostile(tmp_path, "bad", lambda src: os.symlink(secret, src / image.IMAGE))
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    unmount_after(mnt)
    r = run_node("copy", url, mnt, "--root", tmp_path / "copies")
    assert r.returncode != 0 and "image.erofs is a symlink" in r.stderr, r.stdout + r.stderr
    assert mounted(mnt) is None and not (mnt / "key").exists()


def test_the_node_mount_command_leaves_a_live_plain_mount_as_it_is(tmp_path):
    """The check added for image mounts whose daemon died must not take a live plain
    dataset mount for a dead one (a shell ``||`` not grouped had every plain mount detached
    and mounted again by each task that needed it, under the tasks reading it)."""
    from hypercli.mount import fusefs
    from hypercli.providers import runtime
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_bytes(b"f")
    pack.push(tmp_path / "src", f"file://{tmp_path}/store", chunk_size=MiB)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    pid = fusefs.mount(f"file://{tmp_path}/store", mnt, cache_dir=tmp_path / "cache",
                       cache_bytes=64 * MiB, foreground=False, warm_entries=0)
    try:
        cmd = runtime.mount_command("echo MOUNTED AGAIN", f"chunks+file://{tmp_path}/store",
                                    str(mnt), str(tmp_path / "cache"))
        r = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
        assert r.returncode == 0 and "MOUNTED AGAIN" not in r.stdout, r.stdout + r.stderr
        assert fusefs.mount_type(str(mnt)) == "fuse.hyper"
    finally:
        fusefs.unmount(mnt)
    assert gone(pid)
