"""The mount served over the FUSE protocol itself (hypercli.mount.fuselow), on real parts.

The whole of tests/test_mount.py also runs against this server with
``HYPER_MOUNT_SERVER=low`` (and ``HYPER_MOUNT_SERVING_PROCESSES=2``); the tests here are of
what is new: several serving processes answering one mount, sharing one chunk cache, and
the answers to requests the kernel never sends in an ordinary mount (a node id not in the
index, an unknown opcode), made by calling the request handler with the bytes of such a
request. Every mount is taken down by ``Mounted.close`` (``fusermount3 -u`` by mount point,
then the daemon by pid); its serving children are checked gone by pid.
"""

from __future__ import annotations

import errno
import os
import random
import shutil
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from hypercli.mount import fuselow, fusefs, pack
from hypercli.mount.cache import ChunkCache
from hypercli.mount.store import open_store
from s3server import s3  # noqa: F401  (fixture)
from test_dataset_boundary import dataset  # noqa: F401  (fixture)
from test_mount import mount, synth_tree, synth_url  # noqa: F401  (fixtures)

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                       reason="needs /dev/fuse and fusermount3"),
]

MiB = 1 << 20


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """~13 MB of seeded random files in 3 folders (240 of 0-80 KB, two of 1.5 MiB + 5) and a
    symlink, pushed in 1 MiB chunks: many chunks, so reads spread over them."""
    rng = random.Random(25)
    root = tmp_path_factory.mktemp("low") / "src"
    for i in range(240):
        d = root / f"d{i % 3}"
        d.mkdir(parents=True, exist_ok=True)
        (d / f"f{i:03d}").write_bytes(rng.randbytes(rng.randint(0, 80_000)))
    for name in ("big-a", "big-b"):
        (root / name).write_bytes(rng.randbytes(3 * MiB // 2 + 5))
    os.symlink("d0/f000", root / "link")
    return root


@pytest.fixture(scope="module")
def url(tree, tmp_path_factory) -> str:
    u = "file://" + str(tmp_path_factory.mktemp("store") / "low")
    pack.push(tree, u, chunk_size=MiB)
    return u


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")
                  if p.is_file() and not p.is_symlink())


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _mounted(url: str, tmp_path: Path, name: str, processes: int, **kw):
    from test_mount import Mounted
    return Mounted(url, tmp_path, name, server="low", serving_processes=processes, **kw)


def test_several_processes_serve_one_mount_from_one_cache(url, tree, tmp_path):
    m = _mounted(url, tmp_path, "three", 3, warm_entries=0)
    try:
        files = _files(tree)
        rng = random.Random(3)
        order = files * 3
        rng.shuffle(order)

        def check(rel: str) -> None:
            assert (m.mp / rel).read_bytes() == (tree / rel).read_bytes(), rel
        with ThreadPoolExecutor(8) as pool:  # cold: chunks fetched while others read
            list(pool.map(check, order))
        assert os.readlink(m.mp / "link") == "d0/f000"
        s = m.stats()
        serving = s["serving"]
        assert s["serving_processes"] == 3 and len(serving) == 3
        pids = [p["pid"] for p in serving]
        assert pids[0] == m.pid and len(set(pids)) == 3
        answered = [p["requests"] for p in serving]
        print(f"requests answered by each process: {answered}")
        assert sum(1 for n in answered if n > 0) >= 2, answered  # not one process alone
        chunks = len(fusefs.open_dataset(url, tmp_path / "idx")[2].chunk_list)
        # one download per chunk, whichever process asked for it first
        assert s["downloads"] == chunks and set(s["downloads_by_seq"].values()) == {1}, s
        assert s["errors"] == 0 and s["hits"] + s["misses"] >= len(files)
    finally:
        m.close()
    for pid in pids[1:]:  # the children end with the mount
        assert not _alive(pid), pid


def test_children_read_through_evictions_under_a_tiny_cap(url, tree, tmp_path):
    # room for ~2 of ~12 chunks: the first process evicts chunks the children hold
    m = _mounted(url, tmp_path, "tiny", 2, cache_bytes=3 * MiB, warm_entries=0)
    try:
        files = _files(tree)
        for _ in range(2):
            with ThreadPoolExecutor(4) as pool:
                list(pool.map(lambda rel: (m.mp / rel).read_bytes() == (tree / rel)
                              .read_bytes() or pytest.fail(rel), files))
            for p in m.mp.rglob("*"):  # drop the page cache of the mount's files
                if p.is_file() and not p.is_symlink():
                    fd = os.open(p, os.O_RDONLY)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    os.close(fd)
        s = m.stats()
        assert s["evictions"] > 0 and s["errors"] == 0, s
        cached = sum(e.stat().st_size for e in os.scandir(m.cache_dir / "chunks")
                     if e.is_file() and not e.name.startswith("."))
        assert cached <= 3 * MiB + 2 * 2 * MiB, cached  # over the cap only while in use
    finally:
        m.close()


def test_an_opcode_it_does_not_serve_gets_enosys_and_the_kernel_goes_on(url, tree, tmp_path):
    m = _mounted(url, tmp_path, "lseek", 1)
    try:
        fd = os.open(m.mp / "big-a", os.O_RDONLY)
        try:  # SEEK_DATA sends FUSE_LSEEK; ENOSYS makes the kernel answer it itself
            assert os.lseek(fd, 0, os.SEEK_DATA) == 0
            assert os.pread(fd, 100, MiB) == (tree / "big-a").read_bytes()[MiB:MiB + 100]
        finally:
            os.close(fd)
    finally:
        m.close()


# -- the request handler alone ----------------------------------------------------------------
@pytest.fixture
def fs(url, tmp_path):
    _, _, index = fusefs.open_dataset(url, tmp_path / "c")
    cache = ChunkCache(open_store(url), index.chunk_list, tmp_path / "c" / "chunks",
                       max_bytes=64 * MiB)
    counters = memoryview(bytearray(8 * fuselow._SLOT)).cast("Q")
    f = fuselow.LowFS(index, fuselow._Owned(cache), stats=dict, counters=counters)
    yield f
    f.pool.shutdown()
    cache.close()


def _req(op: int, nid: int, body: bytes = b"") -> bytes:
    return fuselow.IN_HDR.pack(40 + len(body), op, 7, nid, 0, 0, 0, 0, 0) + body


def _lookup(fs, parent: int, name: str) -> int:
    err, parts = fs.handle(_req(fuselow.LOOKUP, parent, name.encode() + b"\0"))
    assert err == 0
    return fuselow.ENTRY_OUT.unpack(b"".join(parts))[0]


def test_a_node_id_not_in_the_index_is_enoent(fs):
    rowids = [fs.root_rowid + 2,  # the root's row by its rowid: the root is node 1 only
              10**12, (1 << 64) - 1, 0]
    for nid in rowids:
        for op, body in ((fuselow.GETATTR, b"\0" * 16),
                         (fuselow.READ, fuselow.READ_IN.pack(0, 0, 4096) + b"\0" * 16),
                         (fuselow.READDIRPLUS, fuselow.READ_IN.pack(0, 0, 4096) + b"\0" * 16),
                         (fuselow.LOOKUP, b"f000\0"), (fuselow.READLINK, b"")):
            assert fs.handle(_req(op, nid, body)) == (errno.ENOENT, []), (op, nid)
    # a name not in the dataset: a miss the kernel may keep (node id 0, entry timeout set)
    err, parts = fs.handle(_req(fuselow.LOOKUP, 1, b"no-such\0"))
    nid, _, entry_valid = fuselow.ENTRY_OUT.unpack(b"".join(parts))[:3]
    assert (err, nid, entry_valid) == (0, 0, fuselow.CACHE_TIMEOUT)
    # a node id that is: found again from the index alone, by a handler that never saw it
    d0 = _lookup(fs, 1, "d0")
    f = _lookup(fs, d0, "f000")
    fs.nodes.clear()
    err, parts = fs.handle(_req(fuselow.GETATTR, f, b"\0" * 16))
    assert err == 0 and fuselow.ATTR_OUT.unpack(b"".join(parts))[3] == f  # ino


def test_an_unknown_opcode_is_enosys_and_every_write_erofs(fs):
    for op in (0, 46, 52, 99, 4096, (1 << 32) - 1):  # LSEEK, STATX, and no opcode at all
        assert fs.handle(_req(op, 1, b"\0" * 64)) == (errno.ENOSYS, []), op
    for op in sorted(fuselow.WRITES):
        assert fs.handle(_req(op, 1, b"\0" * 64)) == (errno.EROFS, []), op
    for op in (fuselow.FORGET, fuselow.BATCH_FORGET, fuselow.INTERRUPT):
        assert fs.handle(_req(op, 1, b"\0" * 16)) is None, op  # no reply is due
    assert fs.handle(_req(fuselow.OPEN, 1, b"\0" * 8)) == (errno.ENOSYS, [])
    err, _ = fs.handle(_req(fuselow.ACCESS, 1, struct.pack("<II", os.W_OK, 0)))
    assert err == errno.EROFS
    assert fs.handle(_req(fuselow.ACCESS, 1, struct.pack("<II", os.R_OK, 0))) == (0, ())


def test_sigterm_ends_every_serving_process_and_unmounts(url, tmp_path):
    m = _mounted(url, tmp_path, "term", 2, warm_entries=0)
    try:
        assert (m.mp / "link").read_bytes()[:1] is not None
        pids = [p["pid"] for p in m.stats()["serving"]]
        os.kill(m.pid, 15)
        end = time.monotonic() + 30
        while any(_alive(p) for p in pids) and time.monotonic() < end:
            time.sleep(0.05)
        assert not any(_alive(p) for p in pids), pids
        assert not fusefs._mounted(str(m.mp))
    finally:
        m.close()


# -- the faults of tests/test_mount.py, served by three processes ------------------------------
FAULTS = {  # test → the fixtures it takes
    "test_store_down_gives_eio_with_reason_then_mount_recovers":
        ("s3", "mount", "synth_tree", "tmp_path"),
    "test_corrupt_chunk_in_store_gives_eio_never_wrong_bytes":
        ("s3", "mount", "synth_tree", "tmp_path"),
    "test_many_readers_of_a_cold_chunk_make_one_download":
        ("s3", "mount", "synth_tree", "tmp_path"),
    "test_truncated_cached_chunk_is_fetched_again":
        ("mount", "synth_tree", "synth_url", "tmp_path"),
    "test_eviction_under_tiny_cap_keeps_chunks_in_use":
        ("mount", "synth_tree", "synth_url", "tmp_path"),
}


@pytest.mark.parametrize("name", sorted(FAULTS))
def test_faults_of_the_mount_with_three_serving_processes(name, request, monkeypatch):
    """A store down, a corrupt or truncated chunk, many readers of a cold chunk, a tiny cap:
    the same answers (EIO with the reason, then recovery; one download; the cap) when most
    READs reach a child that must ask the first process for the chunk."""
    import test_mount
    monkeypatch.setenv("HYPER_MOUNT_SERVER", "low")
    monkeypatch.setenv("HYPER_MOUNT_SERVING_PROCESSES", "3")
    getattr(test_mount, name)(*(request.getfixturevalue(f) for f in FAULTS[name]))


def test_a_bad_index_row_is_eio_for_it_alone_with_three_serving_processes(dataset, tmp_path,
                                                                          monkeypatch):
    import test_dataset_boundary
    monkeypatch.setenv("HYPER_MOUNT_SERVER", "low")
    monkeypatch.setenv("HYPER_MOUNT_SERVING_PROCESSES", "3")
    test_dataset_boundary.test_mount_answers_eio_for_a_bad_entry_alone(dataset, tmp_path)
