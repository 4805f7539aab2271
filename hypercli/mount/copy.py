"""A dataset copied whole onto a node's local disk (a ``mode: copy`` mount), shared by its tasks.

Source: SkyPilot's ``COPY`` storage mode (the bucket's contents copied to the node before the
task starts) and the Hyper paper, section III-A (datasets as large immutable chunks). For a
dataset that fits on the node's disk, reading a local copy is local-disk speed by
construction, however many processes read it at once (bench/RESULTS.md §14).

    make_copy(url, root, budget_bytes=..., min_free_bytes=...)   fetch it, or find it there
    bind(copy_path, mountpoint)                                    read-only bind mount of it

An image dataset's copy (:mod:`hypercli.mount.image`) is its one image file, mounted by the
kernel's EROFS at the mount point (``ro,nosuid,nodev``) instead of bound.

Layout under ``root`` (a folder of the node's, ``0o700``: no other user reaches a copy but
through its mount):

    root/<key>/data      the dataset, whole and checked (it appears by rename, never partial)
    root/<key>/bytes     the dataset's file bytes (counted against the budget)
    root/<key>/used      touched at each use: copies are dropped least recently used first
    root/<key>.lock      ``flock``: one process fetches a copy, the others wait and reuse it
    root/.tmp-<key>-<pid>/   a copy being fetched (removed when it fails)
    root/index/          the datasets' indexes

``key`` is the SHA-256 of the dataset's manifest: a dataset pushed again with other contents
gets a copy of its own, the same dataset under two URLs shares one. The fetch is
:func:`unpack`: chunks downloaded by ``jobs`` threads, each checked against its SHA-256 and
size, files written from them by ``jobs`` threads, each checked against its own SHA-256: a
corrupt chunk is an error, never a wrong file, and nothing of that copy is kept. It differs
from :func:`hypercli.mount.pack.pull` (which writes into a folder of the user's, one file
at a time through a temporary file renamed over it) in writing into a fresh folder nobody
else can reach: each file is created in place (``O_EXCL|O_NOFOLLOW``) and the whole tree
appears by one rename, which makes it several times faster on many small files
(bench/RESULTS.md §14).

A copy is kept after its tasks end, for the next workflow on the node, while it fits: a new
copy that would take the copies past ``budget_bytes``, or leave less than ``min_free_bytes``
free on the disk, first drops copies no mount uses (least recently used first); if it still
does not fit it is refused (:class:`CopyTooLarge`) and nothing is fetched.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from hypercli.errors import InfraError, UsageError
from hypercli.mount.cache import GiB

FOLDER_MODE = 0o700
_KEY = re.compile(r"[0-9a-f]{64}")


class CopyTooLarge(UsageError):
    """A dataset that does not fit in the copy budget or on the node's disk."""


@dataclass(frozen=True)
class Copy:
    """A dataset's copy on this node.

    Attributes:
        path: the folder holding the dataset (``root/<key>/data``).
        key: the SHA-256 of the dataset's manifest.
        bytes: the dataset's file bytes.
        fetched: True when this call fetched it, False when it was there.
        seconds: time this call took.
        dropped: keys of the older copies dropped to make room.
    """

    path: Path
    key: str
    bytes: int
    fetched: bool
    seconds: float
    dropped: tuple[str, ...] = ()


def _bytes(home: Path) -> int:
    """The file bytes of the copy in ``home`` (written beside it when it was fetched)."""
    try:
        return int((home / "bytes").read_text())
    except (OSError, ValueError):
        return 0


def _in_use(key: str) -> bool:
    """Whether a mount of this system shows ``<key>/data`` (a bind mount of the copy: field 4
    of /proc/self/mountinfo is the mount's root within its file system, proc(5)) or is an
    image dataset's EROFS mount of ``<key>/data/image.erofs`` (its source, after ``-``)."""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                parts = line.split(" ")
                if len(parts) > 4 and parts[3].endswith(f"/{key}/data"):
                    return True
                rest = parts[parts.index("-") + 1:] if "-" in parts else []
                if len(rest) > 1 and rest[0] == "erofs" and rest[1].endswith(
                        f"/{key}/data/image.erofs"):
                    return True
    except OSError:
        return True  # cannot tell: keep it
    return False


def _copies(root: Path) -> list[tuple[float, str, int]]:
    """(last use, key, bytes on disk) of every whole copy under root, oldest first."""
    out = []
    for d in root.iterdir():
        if _KEY.fullmatch(d.name) and (d / "data").is_dir():
            try:
                used = (d / "used").stat().st_mtime
            except OSError:
                used = 0.0
            out.append((used, d.name, _bytes(d)))
    return sorted(out)


def _make_room(root: Path, need: int, budget: int | None, min_free: int, url: str) -> list[str]:
    """Drop unused copies, oldest first, until ``need`` more bytes fit; the keys dropped.
    Raises CopyTooLarge when they cannot."""
    def fits(held: int) -> tuple[bool, str]:
        if budget is not None and held + need > budget:
            return False, (f"the copies on this node would take {_gib(held + need)}, over "
                           f"the copy budget of {_gib(budget)}")
        st = os.statvfs(root)
        free = st.f_bavail * st.f_frsize
        if free - need < min_free:
            return False, (f"the disk has {_gib(free)} free and {_gib(min_free)} must stay "
                           "free")
        return True, ""

    if budget is not None and need > budget:
        raise CopyTooLarge(f"{url}: the dataset is {_gib(need)}, larger than the copy budget "
                           f"of {_gib(budget)}: it is not copied",
                           "mount it without `mode: copy` (the chunked mount reads it "
                           "through a cache), or raise the copy budget (--budget-mib)")
    copies = _copies(root)
    held = sum(b for _, _, b in copies)
    dropped = []
    ok, why = fits(held)
    for _, key, size in copies:
        if ok:
            break
        if _in_use(key):
            continue
        with _locked(root, key, blocking=False) as got:
            if not got:
                continue
            shutil.rmtree(root / key, ignore_errors=True)
        dropped.append(key)
        held -= size
        ok, why = fits(held)
    if not ok:
        raise CopyTooLarge(f"{url}: the dataset ({_gib(need)}) does not fit on this node: "
                           f"{why}; it is not copied",
                           "mount it without `mode: copy` (the chunked mount reads it "
                           "through a cache), or free the node's disk")
    return dropped


def _gib(n: int) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB // 100 else f"{n:,} bytes"


class _locked:
    """``flock`` on ``root/<key>.lock`` for the block; ``as``: whether it was taken."""

    def __init__(self, root: Path, key: str, blocking: bool = True):
        self.path, self.blocking = root / f"{key}.lock", blocking

    def __enter__(self) -> bool:
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                          0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | (0 if self.blocking else fcntl.LOCK_NB))
        except BlockingIOError:
            return False
        return True

    def __exit__(self, *exc) -> None:
        os.close(self.fd)


def _root(root: str | os.PathLike) -> Path:
    path = Path(root).absolute()
    path.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path):
        raise UsageError(f"{path}: not a folder")
    if st.st_mode & 0o077:
        os.chmod(path, FOLDER_MODE)
    return path


def make_copy(url: str, root: str | os.PathLike, *, endpoint_url: str | None = None,
              budget_bytes: int | None = None, min_free_bytes: int = GiB,
              jobs: int = 16, mountpoint: str | os.PathLike | None = None) -> Copy:
    """The dataset at ``url`` as a folder on this node's disk: the copy already under
    ``root``, or one fetched now (module docstring). Safe to call from many processes at
    once: one fetches, the others wait for it and share its copy.

    Args:
        url: ``s3://``, ``gs://``, ``az://`` or ``file://`` URL of a pushed dataset.
        root: the node's folder of copies (made ``0o700``).
        budget_bytes: cap on the bytes of all copies under root (None: the disk's free space).
        min_free_bytes: bytes to leave free on root's disk.
        jobs: download threads.
        mountpoint: when given, the copy is bound there (:func:`bind`) before the copy's
            lock is let go, so no other process drops it in between.
    Raises:
        CopyTooLarge: the dataset does not fit (nothing fetched).
        InfraError: the bind mount failed.
        UsageError: no dataset at url; root cannot be written.
        DatasetError: a corrupt chunk, file or index (nothing of the copy kept).
        StoreError: the store cannot be read.
    """
    from hypercli.mount.pack import _reading, fetch_index, load_manifest
    from hypercli.mount.index import Index
    from hypercli.mount.store import open_store

    t0 = time.monotonic()
    base = _root(root)
    store = open_store(url, endpoint_url=endpoint_url)
    manifest = load_manifest(store)
    key = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
    home = base / key
    data = home / "data"
    attach = bind
    if manifest.get("layout") == "erofs":  # an image dataset: its copy is the image file
        from hypercli.mount import image

        def attach(data: Path, mountpoint) -> None:
            image.mount_file(data / image.IMAGE, mountpoint, url)
    with _locked(base, key):
        if data.is_dir():
            (home / "used").touch()
            if mountpoint is not None:
                attach(data, mountpoint)
            return Copy(data, key, _bytes(home), False, time.monotonic() - t0)
        index = Index(fetch_index(store, manifest, base / "index"))
        need = index.count()[2]
        dropped = _make_room(base, need, budget_bytes, min_free_bytes, url)
        tmp = base / f".tmp-{key}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            tmp.mkdir(mode=FOLDER_MODE)
            with _reading(store, manifest):
                try:
                    unpack(store, index, tmp / "data", jobs=jobs)
                except OSError as ex:  # a full disk, or a path the index gives twice
                    raise InfraError(f"{url}: copying into {tmp} failed: {ex}") from None
            (tmp / "used").touch()
            (tmp / "bytes").write_text(str(need))
            shutil.rmtree(home, ignore_errors=True)  # a folder left without data
            os.rename(tmp, home)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        if mountpoint is not None:
            attach(data, mountpoint)
        return Copy(data, key, need, True, time.monotonic() - t0, tuple(dropped))


def bind(source: str | os.PathLike, mountpoint: str | os.PathLike) -> None:
    """Mount ``source`` at ``mountpoint`` read-only, ``nosuid,nodev`` (a bind mount, then a
    remount of it with those flags: mount(8), "bind mount operation"). Needs root.

    Raises:
        InfraError: mount(8) failed (not root; the reason given).
    """
    src, mp = os.path.abspath(source), os.path.abspath(mountpoint)
    r = subprocess.run(["mount", "--bind", src, mp], capture_output=True, text=True)
    if r.returncode != 0:
        raise InfraError(f"{mp}: cannot mount the dataset's copy: {r.stderr.strip()}",
                         "`mode: copy` needs root on the node (a read-only bind mount)")
    r = subprocess.run(["mount", "-o", "remount,bind,ro,nosuid,nodev", mp],
                       capture_output=True, text=True)
    if r.returncode != 0:
        subprocess.run(["umount", mp], capture_output=True)
        raise InfraError(f"{mp}: cannot make the dataset's copy read-only: "
                         f"{r.stderr.strip()}")


#: bytes of a file copied at once from a chunk
_BLOCK = 4 << 20


def unpack(store, index, dest: str | os.PathLike, *, jobs: int = 16) -> int:
    """Write the dataset of ``index`` (its chunks in ``store``) into ``dest``, a folder that
    must not exist yet and that no one else writes; returns the file bytes written.

    Folders and symlinks first (an entry whose path is not safe, or whose parent is not a
    folder of the dataset, is refused before anything is written), then files, chunk by
    chunk in pack order: ``jobs`` chunks are downloaded ahead (each into ``dest/..``, checked
    against its SHA-256 and size, deleted once every file in it is written), and the files
    that end in a chunk are written by ``jobs`` threads with ``pread`` from the open chunks
    and checked against their SHA-256. Modes are masked to ``0o777``; mtimes kept.

    Raises:
        DatasetError: a corrupt chunk or file, an unsafe path.
        CorruptIndex: a malformed index row (:func:`hypercli.mount.pack._reading` turns it
            into a DatasetError).
        StoreError: the store cannot be read.
    """
    from concurrent.futures import ThreadPoolExecutor

    from hypercli.mount.index import parent_of, path_ok
    from hypercli.mount.pack import DatasetError, MODE_BITS

    root = Path(dest)
    url = store.url
    entries = list(index.walk())
    dirs = {""}
    for e in entries:
        if not e.path and e.kind != "d":
            raise DatasetError(f"{url}: the dataset's root is not a folder")
        if e.path and (not path_ok(e.path) or parent_of(e.path) not in dirs):
            raise DatasetError(f"{url}: refusing path {e.path!r}: not below a folder of the "
                               "dataset")
        if e.kind == "d":
            dirs.add(e.path)
    files = [(e, index.segments(e.path, e.size)) for e in entries if e.kind == "f"]
    os.mkdir(root, FOLDER_MODE)
    for e in entries:
        if e.kind == "d" and e.path:
            os.mkdir(root / e.path, FOLDER_MODE)
        elif e.kind == "l":
            os.symlink(e.target, root / e.path)
            os.utime(root / e.path, ns=(time.time_ns(), round(e.mtime * 1e9)),
                     follow_symlinks=False)
    chunks = index.chunk_list  # [(seq, sha, size)]
    by_last: dict[int, list] = {}  # chunk seq → the files whose last segment is in it
    last_use: dict[int, int] = {}  # chunk seq → the last chunk whose files read it
    for e, segs in files:
        end = segs[-1][0] if segs else -1
        by_last.setdefault(end, []).append((e, segs))
        for seq, _, _ in segs:
            last_use[seq] = max(last_use.get(seq, -1), end)
    order = sorted(s for s in by_last if s >= 0)
    tmp = root.parent
    fds: dict[int, int] = {}

    def fetch(seq: int) -> Path:
        _, sha, size = chunks[seq]
        path = tmp / f".chunk-{seq}"
        h = hashlib.sha256()
        got = store.get_to_file(f"chunks/{sha}", path, digest=h)
        if h.hexdigest() != sha:  # an SDK may rewrite a part it retried: the file decides
            h = hashlib.sha256()
            with open(path, "rb") as f:
                while block := f.read(_BLOCK):
                    h.update(block)
        if h.hexdigest() != sha or os.path.getsize(path) != size:
            raise DatasetError(f"{url}/chunks/{sha}: corrupt (sha256 {h.hexdigest()}, "
                               f"{got} bytes; expected {size})")
        return path

    def write(item) -> int:
        e, segs = item
        h = hashlib.sha256()
        fd = os.open(root / e.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW |
                     os.O_CLOEXEC, 0o600)
        try:
            for seq, off, length in segs:
                while length:
                    block = os.pread(fds[seq], min(_BLOCK, length), off)
                    if not block:
                        raise DatasetError(f"{url}: chunk {seq} ends before {e.path!r}")
                    h.update(block)
                    view = memoryview(block)
                    while view:
                        view = view[os.write(fd, view):]
                    off += len(block)
                    length -= len(block)
            if h.hexdigest() != e.sha256:
                raise DatasetError(f"{url}: {e.path!r} has the wrong sha256 after copying")
            os.fchmod(fd, e.mode & MODE_BITS)
            os.utime(fd, ns=(time.time_ns(), round(e.mtime * 1e9)))
        finally:
            os.close(fd)
        return e.size

    def write_all(items) -> int:
        return sum(map(write, items))

    done = 0
    needed = sorted(last_use)
    with ThreadPoolExecutor(jobs, thread_name_prefix="hyper-copy-get") as getters, \
            ThreadPoolExecutor(jobs, thread_name_prefix="hyper-copy-put") as writers:
        futures: dict = {}
        ahead = 0
        try:
            for last in order:
                while ahead < len(needed) and (needed[ahead] <= last or
                                               len(futures) < jobs):
                    futures[needed[ahead]] = getters.submit(fetch, needed[ahead])
                    ahead += 1
                for seq in [s for s in futures if s <= last and s not in fds]:
                    path = futures[seq].result()
                    fds[seq] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                    os.unlink(path)  # gone from the disk with its last descriptor
                todo = by_last[last]  # in slices, one per thread: a task per file costs
                step = max(1, -(-len(todo) // jobs))  # more in the pool than the write
                done += sum(writers.map(write_all, [todo[i:i + step]
                                                    for i in range(0, len(todo), step)]))
                for seq in [s for s in fds if last_use[s] <= last]:
                    os.close(fds.pop(seq))
                    futures.pop(seq)
        finally:
            for f in futures.values():
                f.cancel()
            for fd in fds.values():
                os.close(fd)
            for p in tmp.glob(".chunk-*"):
                p.unlink(missing_ok=True)
    empty = by_last.get(-1, [])
    done += sum(map(write, empty))
    for e in reversed(entries):  # folders deepest first, after their contents
        if e.kind == "d":
            path = root / e.path if e.path else root
            os.chmod(path, (e.mode & MODE_BITS) if e.path else 0o755)
            os.utime(path, ns=(time.time_ns(), round(e.mtime * 1e9)))
    return done
