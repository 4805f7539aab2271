"""Datasets as chunks in an object store: push a folder, list, pull and verify it.

This module owns the writing side of the chunked format of :mod:`hypercli.mount.index` (the
Hyper paper, section III-A: many small files packed into large immutable chunks, so a million
small reads cost a few large requests) and the whole-dataset readers beside the FUSE mount:

    push(src_dir, url)      pack a folder into chunks; upload the chunks the store lacks,
                            then the index, then the manifest (last)
    ls(url, path)           a folder's entries, or one file's entry
    pull(url, dest_dir)     download chunks in parallel, check them, write the files back
    verify(url)             check every chunk and the index against the manifest
    load_manifest(store), fetch_index(store, manifest, cache_dir)   shared with the mount

**Chunk boundaries are content-defined, at file boundaries.** Files are packed in sorted path
order. After each file, the current chunk is closed when it holds at least ``chunk_size / 2``
bytes and a hash of the file's (path, SHA-256) falls below ``2 × file size / chunk_size``
(a cut chance per byte of ``2 / chunk_size``, so a chunk grows on average ``chunk_size / 2``
past its minimum: chunks average ≈ ``chunk_size``, whatever the file sizes). A chunk is also
closed before a file that would take it past ``2 × chunk_size``, and a file larger than
``chunk_size`` gets chunks of its own, cut every ``chunk_size`` bytes. Because a cut depends
only on the file at the cut, and not on where the chunk began, an added or changed file moves
the boundaries of the one or two chunks around it and the next cut puts the rest back in
step; chunks are named by the SHA-256 of their bytes, so an incremental push uploads only the
chunks that changed. This is content-defined chunking as in LBFS (Muthitacharoen, Chen,
Mazières, "A Low-bandwidth Network File System", SOSP 2001) and rsync's rolling checksum,
with file boundaries as the only candidate cut points.

Errors: :class:`~hypercli.errors.UsageError` for bad arguments (not a folder, a chunk size out
of range, an unknown URL scheme, no dataset at a URL), :class:`~hypercli.mount.store.StoreError`
when the store fails, :class:`DatasetError` (a StoreError) for a dataset that is corrupt or
unsafe (a chunk whose SHA-256 is wrong, a path that leads outside the destination).
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import stat
import tempfile
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

from hypercli.errors import UsageError
from hypercli.mount.index import (FORMAT_VERSION, CorruptIndex, Entry, Index, create_index,
                                  parent_of, path_ok)
from hypercli.mount.store import NotFound, Store, StoreError, open_store

MiB = 1 << 20
DEFAULT_CHUNK_SIZE = 64 * MiB
MIN_CHUNK_SIZE = 1 * MiB
MAX_CHUNK_SIZE = 1024 * MiB
BLOCK = 1 * MiB  # read/write unit when copying bytes
WRITE_BUFFER = 4 * MiB  # bytes of a chunk gathered in memory before they are written
INDEX_BATCH = 10_000  # index rows gathered in memory before they are inserted
MANIFEST = "manifest.json"


class DatasetError(StoreError):
    """A dataset that is corrupt or unsafe: a chunk or index with the wrong SHA-256 or size, a
    manifest that cannot be read, a path that would lead outside the destination."""


@dataclass(frozen=True)
class PushReport:
    """What :func:`push` did. Sizes in bytes, time in seconds."""

    url: str
    files: int
    dirs: int           # folders below the root
    symlinks: int
    bytes: int          # total file bytes
    chunks: int         # chunks of the dataset
    chunks_uploaded: int
    bytes_uploaded: int  # chunk bytes uploaded (index and manifest not counted)
    seconds: float
    index: str          # the index's key, index/<sha256>.sqlite
    warnings: tuple[str, ...] = ()


@dataclass(frozen=True)
class PullReport:
    """What :func:`pull` wrote. Sizes in bytes, time in seconds."""

    files: int
    dirs: int
    symlinks: int
    bytes: int
    chunks: int         # chunks downloaded
    seconds: float


@dataclass
class VerifyReport:
    """What :func:`verify` checked; ``problems`` lists every fault found, one line each."""

    url: str
    chunks: int
    bytes: int
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems


# -- shared with the mount ----------------------------------------------------------------
def load_manifest(store: Store) -> dict:
    """The dataset's manifest (the dict of :mod:`hypercli.mount.index`'s docstring).

    Raises:
        UsageError: the store has no ``manifest.json`` ("no dataset at URL").
        DatasetError: the manifest is not JSON of format 1 with the required keys.
        StoreError: the store cannot be read.
    """
    try:
        raw = store.get(MANIFEST)
    except NotFound:
        raise UsageError(f"no dataset at {store.url} (no {MANIFEST})",
                         "`hyper data push DIR URL` creates one") from None
    try:
        m = json.loads(raw)
        ok = (isinstance(m, dict) and m.get("format") == FORMAT_VERSION
              and _index_key_ok(m.get("index"), m) and isinstance(m.get("chunks"), list)
              and all(isinstance(c, list) and len(c) == 2 and _hex64(c[0])
                      and type(c[1]) is int and c[1] >= 0 for c in m["chunks"]))
    except ValueError:
        ok = False
    if not ok:
        raise DatasetError(f"{store.url}/{MANIFEST}: not a format {FORMAT_VERSION} "
                           "dataset manifest")
    return m


def _hex64(sha) -> bool:
    """Whether sha is a SHA-256 in lowercase hex (a name that is safe as a file name)."""
    return isinstance(sha, str) and len(sha) == 64 and all(c in "0123456789abcdef"
                                                           for c in sha)


def _index_key_ok(key, m: dict) -> bool:
    sha = m.get("index_sha256")
    return _hex64(sha) and key == f"index/{sha}.sqlite"


def fetch_index(store: Store, manifest: dict, cache_dir: str | os.PathLike) -> Path:
    """The dataset's index as a local file, downloaded once into ``cache_dir``.

    The file is ``cache_dir/<index sha256>.sqlite``; a download is checked against the
    manifest's ``index_sha256`` before it is renamed into place, read-only (``0o400``, in a
    ``0o700`` folder when this makes it), so a file found there is whole and right and no
    other user has changed it (as cached chunks, :mod:`hypercli.mount.cache`). Safe to call
    from many threads and processes at once.

    Raises:
        DatasetError: the downloaded index has the wrong SHA-256.
        StoreError: the store cannot be read (NotFound: the index object is missing).
    """
    sha = manifest["index_sha256"]
    cache = Path(cache_dir)
    path = cache / f"{sha}.sqlite"
    if path.is_file():
        return path
    cache.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = cache / f".{sha}.{os.getpid()}.{threading.get_ident()}.tmp"
    try:
        store.get_to_file(manifest["index"], tmp)
        got = _sha256_file(tmp)
        if got != sha:
            raise DatasetError(f"{store.url}/{manifest['index']}: sha256 is {got}, "
                               "not the one the manifest names")
        os.chmod(tmp, 0o400)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def _sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(BLOCK):
            h.update(block)
    return h.hexdigest()


def _default_cache() -> Path:
    from hypercli.state import home
    return home() / "cache" / "index"


def _open(url: str, endpoint_url: str | None, cache_dir) -> tuple[Store, dict, Index]:
    store = open_store(url, endpoint_url=endpoint_url)
    manifest = load_manifest(store)
    path = fetch_index(store, manifest, cache_dir or _default_cache())
    with _reading(store, manifest):
        return store, manifest, Index(path)


@contextmanager
def _reading(store: Store, manifest: dict) -> Iterator[None]:
    """Turn a corrupt or crafted index (:class:`~hypercli.mount.index.CorruptIndex`, or
    SQLite's own errors) met inside the block into a :class:`DatasetError` naming the index
    and the entry."""
    try:
        yield
    except (ValueError, sqlite3.DatabaseError) as e:
        why = str(e) if len(str(e)) <= 300 else str(e)[:297] + "..."  # SQLite quotes text
        raise DatasetError(f"{store.url}/{manifest['index']}: {why}",
                           "the dataset's index is corrupt or was not made by `hyper data "
                           "push`: push the dataset again") from None


def dataset_files(url: str, *, endpoint_url: str | None = None,
                  cache_dir: str | os.PathLike | None = None) -> list[tuple[str, int]]:
    """(relative path, bytes) of every file of the dataset at ``url``, in pack order, read
    from its index (fetched once into the cache; nothing is mounted).

    Raises:
        DatasetError, StoreError: no dataset there, or the store failed.
    """
    store, manifest, index = _open(url, endpoint_url, cache_dir)
    with _reading(store, manifest):
        return index.files_in_pack_order()


# -- push ---------------------------------------------------------------------------------
def _check_args(chunk_size: int, jobs: int) -> None:
    if not MIN_CHUNK_SIZE <= chunk_size <= MAX_CHUNK_SIZE:
        raise UsageError(f"chunk size {chunk_size / MiB:g} MiB is out of range",
                         "give 1 to 1024 MiB; 12-100 MB is best (the paper's figure 2)")
    if jobs < 1:
        raise UsageError(f"jobs must be at least 1, not {jobs}")


def _scan(root: Path) -> tuple[list[tuple[str, str, os.stat_result, str | None]], list[str]]:
    """Every entry below root as (relative POSIX path, kind, lstat, symlink target), in
    sorted path order, root ('') first; and warnings for what was skipped."""
    entries = [("", "d", os.stat(root), None)]
    warnings: list[str] = []
    stack = [""]
    while stack:
        rel = stack.pop()
        try:
            with os.scandir(root / rel if rel else root) as it:
                found = list(it)
        except OSError as e:
            raise UsageError(f"{root / rel}: cannot list: {e.strerror}") from None
        for de in found:
            path = f"{rel}/{de.name}" if rel else de.name
            try:
                path.encode("utf-8")
            except UnicodeEncodeError:
                warnings.append(f"{root / path!s}: name is not UTF-8, skipped")
                continue
            try:
                st = de.stat(follow_symlinks=False)
                target = os.readlink(de.path) if stat.S_ISLNK(st.st_mode) else None
            except FileNotFoundError:
                continue  # removed while we looked
            except OSError as e:
                raise UsageError(f"{de.path}: {e.strerror}") from None
            if target is not None:
                entries.append((path, "l", st, target))
            elif stat.S_ISDIR(st.st_mode):
                entries.append((path, "d", st, None))
                stack.append(path)
            elif stat.S_ISREG(st.st_mode):
                entries.append((path, "f", st, None))
            else:
                kind = "socket" if stat.S_ISSOCK(st.st_mode) else "fifo" \
                    if stat.S_ISFIFO(st.st_mode) else "device"
                warnings.append(f"{de.path}: a {kind}, skipped")
    entries.sort(key=lambda e: e[0])
    return entries, warnings


def _cut(path: str, sha: str, size: int, chunk_size: int) -> bool:
    """Whether a chunk that holds ≥ chunk_size/2 ends after this file: true with chance
    min(1, 2·size/chunk_size), decided by a hash of (path, sha256) — the same file at the
    same path always decides the same way."""
    h = hashlib.sha256(f"{path}\0{sha}".encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(h[:8], "big") < min(1.0, 2 * size / chunk_size) * 2.0 ** 64


class _Uploader:
    """Uploads closed chunks on ``jobs`` threads; skips those the store has. At most
    ``jobs + 1`` chunk files wait on disk at once (the packer blocks for a free slot)."""

    def __init__(self, store: Store, jobs: int, present: dict[str, int], total: int,
                 progress):
        self.store, self.present, self.total, self.progress = store, present, total, progress
        self.pool = ThreadPoolExecutor(jobs, thread_name_prefix="hyper-push")
        self.slots = threading.Semaphore(jobs + 1)
        self.lock = threading.Lock()
        self.futures: list[Future] = []
        self.error: BaseException | None = None
        self.done = self.uploaded = self.bytes_uploaded = 0

    def submit(self, path: Path, sha: str, size: int) -> None:
        if self.error:
            raise self.error
        if self.present.get(sha) == size:  # a chunk of another size there is re-uploaded
            path.unlink()
            self._count(size, 0)
            return
        self.present[sha] = size
        self.slots.acquire()
        self.futures.append(self.pool.submit(self._upload, path, sha, size))

    def _upload(self, path: Path, sha: str, size: int) -> None:
        try:
            if not self.error:
                self.store.put_file(f"chunks/{sha}", path)
                self._count(size, size)
        except BaseException as e:
            self.error = self.error or e
            raise
        finally:
            path.unlink(missing_ok=True)
            self.slots.release()

    def _count(self, size: int, uploaded: int) -> None:
        with self.lock:
            self.done += size
            if uploaded:
                self.uploaded += 1
                self.bytes_uploaded += uploaded
            if self.progress:
                self.progress(self.done, self.total, self.bytes_uploaded)

    def finish(self) -> None:
        for f in self.futures:
            f.exception()
        self.pool.shutdown()
        if self.error:
            raise self.error


class _Packer:
    """Writes file bytes into chunk files in ``tmp`` and hands each closed chunk on."""

    def __init__(self, chunk_size: int, tmp: Path, emit: Callable[[Path, str, int], None]):
        self.chunk_size, self.tmp, self.emit = chunk_size, tmp, emit
        self.chunks: list[tuple[str, int]] = []  # (sha256, size) in pack order
        self.f = None
        self.h = None
        self.len = 0
        # small files are gathered here and written and hashed WRITE_BUFFER bytes at a time
        # (one write and one hash call per file cost ~25 µs of a ~100 µs budget per file)
        self.buf = bytearray()

    @property
    def seq(self) -> int:
        return len(self.chunks)

    def _write(self, data: bytes) -> None:
        if self.f is None:
            self.f, self.h, self.len = open(self.tmp / f"chunk-{self.seq}", "wb"), \
                hashlib.sha256(), 0
        self.buf += data
        self.len += len(data)
        if len(self.buf) >= WRITE_BUFFER:
            self._flush()

    def _flush(self) -> None:
        if self.buf:
            self.f.write(self.buf)
            self.h.update(self.buf)
            self.buf = bytearray()

    def close(self) -> None:
        if self.f is None:
            return
        self._flush()
        self.f.close()
        sha, size, path = self.h.hexdigest(), self.len, Path(self.f.name)
        self.chunks.append((sha, size))
        self.f = None
        self.emit(path, sha, size)

    def add_file(self, rel: str, src: Path, size: int) -> tuple[str, int, list]:
        """Pack one file; returns (sha256, bytes read, [(chunk seq, offset, length)])."""
        big = size > self.chunk_size
        if big or (self.f is not None and self.len + size > 2 * self.chunk_size):
            self.close()
        fh, n, segs = hashlib.sha256(), 0, []
        try:
            with open(src, "rb") as f:
                while block := f.read(BLOCK if not big or self.f is None else
                                      min(BLOCK, self.chunk_size - self.len)):
                    if not segs or self.f is None:
                        self._write(b"")  # opens a chunk when none is open
                        segs.append([self.seq, self.len, 0])
                    self._write(block)
                    fh.update(block)
                    segs[-1][2] += len(block)
                    n += len(block)
                    if big and self.len >= self.chunk_size:
                        self.close()
        except OSError as e:
            raise UsageError(f"{src}: cannot read: {e.strerror}") from None
        sha = fh.hexdigest()
        if big:
            self.close()
        elif self.f is not None and self.len >= self.chunk_size // 2 and \
                _cut(rel, sha, n, self.chunk_size):
            self.close()
        return sha, n, [tuple(s) for s in segs]


def _insert(db: sqlite3.Connection, files: list, segments: list) -> None:
    """Add index rows gathered by push (a batch: one statement per row costs ~15 µs of a
    ~100 µs budget per file); the lists are emptied."""
    db.executemany("INSERT INTO files VALUES (?,?,?,?,?,?,?,?,?)", files)
    db.executemany("INSERT INTO segments VALUES (?,?,?,?,?)", segments)
    files.clear()
    segments.clear()


def push(src_dir: str | os.PathLike, url: str, *, chunk_size: int = DEFAULT_CHUNK_SIZE,
         jobs: int = 16, endpoint_url: str | None = None,
         progress: Callable[[int, int, int], None] | None = None,
         extra: dict | None = None) -> PushReport:
    """Pack the folder ``src_dir`` into a dataset at ``url``; upload only what is new.

    Folders, files and symlinks (stored as links, not followed) are packed in sorted path
    order with the content-defined chunk boundaries of the module docstring. The store's
    ``chunks/`` is listed once and chunks already there are not uploaded again, so pushing
    unchanged data uploads no chunk, and an incremental push uploads the new chunks, a new
    index and the manifest, which is written last. Chunks are built in temporary files and
    uploaded by ``jobs`` threads; at most ``jobs + 1`` chunks (each ≤ 2 × chunk_size) wait
    on disk at once. Sockets, fifos, devices and names that are not UTF-8 are skipped with a
    warning (in ``PushReport.warnings``; nothing is printed).

    Args:
        src_dir: the folder to push.
        url: ``s3://bucket/prefix`` or ``file:///path`` (see ``open_store``).
        chunk_size: target chunk size in bytes, 1 MiB to 1 GiB; default 64 MiB. The paper
            measured chunks of 12-100 MB as best (section III-A, figure 2).
        jobs: parallel uploads.
        endpoint_url: an S3-compatible endpoint (default ``$HYPER_S3_ENDPOINT_URL``).
        progress: called as ``progress(done, total, uploaded)`` in bytes from any thread,
            where ``done`` counts the bytes of chunks uploaded or found present.
        extra: more keys for the manifest (an image dataset's ``layout`` and ``source``,
            :mod:`hypercli.mount.image`); never one of the keys above.
    Raises:
        UsageError: src_dir is not a folder, chunk_size or jobs out of range, a bad URL.
        StoreError: the store cannot be listed or written (unreachable endpoint, no bucket).
    """
    t0 = time.monotonic()
    _check_args(chunk_size, jobs)
    src = Path(src_dir)
    if not src.is_dir():
        raise UsageError(f"{src_dir}: {'not a folder' if src.exists() else 'no such folder'}",
                         "give the folder to push")
    store = open_store(url, endpoint_url=endpoint_url)
    entries, warnings = _scan(src)
    try:
        present = {k[len("chunks/"):]: size for k, size in store.list("chunks/")}
    except StoreError as e:
        raise StoreError(str(e), e.hint or "check the URL, the endpoint (--endpoint-url, "
                         "$HYPER_S3_ENDPOINT_URL) and the credentials") from None
    total = sum(st.st_size for _, kind, st, _ in entries if kind == "f")
    counts = {"f": 0, "d": -1, "l": 0}
    nbytes = 0
    with tempfile.TemporaryDirectory(prefix="hyper-push-") as tmpdir:
        tmp = Path(tmpdir)
        up = _Uploader(store, jobs, present, total, progress)
        packer = _Packer(chunk_size, tmp, up.submit)
        db = create_index(tmp / "index.sqlite", chunk_size)
        files, segments = [], []
        try:
            for rel, kind, st, target in entries:
                sha, size, segs = None, 0, []
                if kind == "f":
                    sha, size, segs = packer.add_file(rel, src / rel, st.st_size)
                    nbytes += size
                elif kind == "l":
                    size = len(os.fsencode(target))
                counts[kind] += 1
                files.append((rel, parent_of(rel), rel.rsplit("/", 1)[-1], kind, size,
                              st.st_mode, st.st_mtime, sha, target))
                segments.extend((rel, i, *s) for i, s in enumerate(segs))
                if len(files) >= INDEX_BATCH:
                    _insert(db, files, segments)
            packer.close()
        finally:
            up.finish()  # waits for the uploads; raises the first failure
        _insert(db, files, segments)
        db.executemany("INSERT INTO chunks VALUES (?,?,?)",
                       [(i, sha, size) for i, (sha, size) in enumerate(packer.chunks)])
        db.commit()
        db.close()
        index_sha = _sha256_file(tmp / "index.sqlite")
        index_key = f"index/{index_sha}.sqlite"
        if not store.exists(index_key):
            store.put_file(index_key, tmp / "index.sqlite")
    manifest = {"format": FORMAT_VERSION, "created": time.time(), "chunk_size": chunk_size,
                "index": index_key, "index_sha256": index_sha,
                "chunks": [list(c) for c in packer.chunks],
                "files": counts["f"], "dirs": counts["d"], "bytes": nbytes}
    manifest.update({k: v for k, v in (extra or {}).items() if k not in manifest})
    store.put(MANIFEST, json.dumps(manifest, separators=(",", ":")).encode())
    return PushReport(url=store.url, files=counts["f"], dirs=counts["d"], symlinks=counts["l"],
                      bytes=nbytes, chunks=len(packer.chunks), chunks_uploaded=up.uploaded,
                      bytes_uploaded=up.bytes_uploaded, seconds=time.monotonic() - t0,
                      index=index_key, warnings=tuple(warnings))


# -- read side ----------------------------------------------------------------------------
def _norm(path: str) -> str:
    return "/".join(p for p in path.strip("/").split("/") if p not in ("", "."))


def ls(url: str, path: str = "", *, endpoint_url: str | None = None,
       cache_dir: str | os.PathLike | None = None) -> list[Entry]:
    """The entries of the folder ``path`` of the dataset at ``url`` (by name), or the one
    entry of a file or symlink. ``path`` is relative to the dataset's root ('' is the root).

    Raises:
        UsageError: no dataset at url, or no such path in it.
        DatasetError: the index is corrupt, or an entry listed is not well-formed (named).
        StoreError: the store cannot be read.
    """
    store, manifest, idx = _open(url, endpoint_url, cache_dir)
    p = _norm(path)
    with _reading(store, manifest):
        e = idx.stat(p)
        if e is None:
            raise UsageError(f"{url}: no {p!r} in the dataset",
                             "`hyper data ls URL` lists it")
        return idx.listdir(p) if e.kind == "d" else [e]


class _Fetcher:
    """Downloads chunks (by seq) into ``tmp`` on ``jobs`` threads, at most ``jobs`` ahead of
    the one being read, and checks each one's size and SHA-256."""

    def __init__(self, store: Store, chunks, order: list[int], tmp: Path, jobs: int):
        self.store, self.chunks, self.order, self.tmp, self.jobs = store, chunks, order, tmp, jobs
        self.pos = {c: i for i, c in enumerate(order)}
        self.refs = dict.fromkeys(order, 0)
        self.pool = ThreadPoolExecutor(jobs, thread_name_prefix="hyper-pull")
        self.futures: dict[int, Future] = {}
        self.next = 0

    def _fetch(self, seq: int) -> Path:
        _, sha, size = self.chunks[seq]
        path = self.tmp / f"chunk-{seq}"
        self.store.get_to_file(f"chunks/{sha}", path)
        got = _sha256_file(path)
        if got != sha or path.stat().st_size != size:
            raise DatasetError(f"{self.store.url}/chunks/{sha}: corrupt (sha256 {got}, "
                               f"{path.stat().st_size} bytes; expected {size})")
        return path

    def get(self, seq: int) -> Path:
        while self.next < len(self.order) and self.next <= self.pos[seq] + self.jobs:
            c = self.order[self.next]
            self.futures[c] = self.pool.submit(self._fetch, c)
            self.next += 1
        return self.futures[seq].result()

    def use(self, seq: int) -> None:
        """One more segment will read chunk seq (call for all before the first get)."""
        self.refs[seq] += 1

    def release(self, seq: int) -> None:
        """A segment of chunk seq was read; the chunk file goes after its last one."""
        self.refs[seq] -= 1
        if not self.refs[seq]:
            self.futures.pop(seq).result().unlink(missing_ok=True)

    def close(self) -> None:
        for f in self.futures.values():
            f.cancel()
        self.pool.shutdown(wait=True)


#: the mode bits a pull gives what it writes: permissions only, never setuid, setgid or sticky
MODE_BITS = 0o777


def _mkdir(path: Path) -> None:
    """A real folder at path (a symlink or file there is replaced), never followed."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        os.mkdir(path, 0o700)


def _write_file(dest: Path, e: Entry, segs, fetcher: _Fetcher, url: str) -> int:
    """Write one file through a temporary file of our own (a new name, ``O_EXCL`` and
    ``O_NOFOLLOW``) in its folder, renamed over ``dest`` once its bytes check (a symlink at
    dest is replaced, not followed). Returns the bytes written."""
    fd, name = tempfile.mkstemp(prefix=".hyper-pull-", dir=dest.parent)
    tmp = Path(name)
    h, n = hashlib.sha256(), 0
    try:
        with open(fd, "wb") as out:
            for seq, off, length in segs:
                with open(fetcher.get(seq), "rb") as cf:
                    cf.seek(off)
                    while length:
                        block = cf.read(min(BLOCK, length))
                        if not block:
                            raise DatasetError(f"{url}: chunk {seq} ends before {e.path!r}")
                        out.write(block)
                        h.update(block)
                        length -= len(block)
                        n += len(block)
                fetcher.release(seq)
            out.flush()
            os.fchmod(out.fileno(), e.mode & MODE_BITS)
            os.utime(out.fileno(), ns=(time.time_ns(), round(e.mtime * 1e9)))
        if h.hexdigest() != e.sha256:
            raise DatasetError(f"{url}: {e.path!r} has the wrong sha256 after pulling")
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return n


def _set_dir(path: Path, e: Entry) -> None:
    """Give a folder the pull made its entry's mode (masked) and mtime, through a descriptor
    opened without following a symlink."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        os.fchmod(fd, e.mode & MODE_BITS)
        os.utime(fd, ns=(time.time_ns(), round(e.mtime * 1e9)))
    finally:
        os.close(fd)


def pull(url: str, dest_dir: str | os.PathLike, *, jobs: int = 16, path_prefix: str = "",
         endpoint_url: str | None = None, cache_dir: str | os.PathLike | None = None,
         progress: Callable[[int, int], None] | None = None) -> PullReport:
    """Write the dataset at ``url`` (or its subtree ``path_prefix``) into ``dest_dir``.

    Entries keep their relative paths (``path_prefix='a/b'`` writes ``dest_dir/a/b/...``),
    permission bits (``MODE_BITS``: never setuid, setgid or sticky), mtimes and symlinks;
    existing files are replaced. ``dest_dir`` itself is the user's: made when missing, but
    an existing one keeps its mode and its mtime (put back after the pull wrote into it);
    the dataset's root entry is never applied to it. Chunks are downloaded by ``jobs``
    threads, each checked against its SHA-256 and size, and at most ``jobs + 1`` wait on
    disk. Every file is checked against its SHA-256. Nothing is written outside dest_dir:
    the whole index is read and checked before the first write; paths that are absolute,
    have '..' or an empty part, or whose parent is not a folder of the dataset are refused;
    a symlink in the way (one found in dest_dir, or one this pull made) is replaced, never
    followed, and a folder is only entered after the pull made it a real folder.

    Args:
        progress: called as ``progress(bytes written, total bytes)``.
    Raises:
        UsageError: no dataset at url, or no path_prefix in it; dest_dir cannot be written.
        DatasetError: a corrupt chunk, a corrupt or crafted index (the entry named), or an
            unsafe path (nothing after it is written).
        StoreError: the store cannot be read.
    """
    t0 = time.monotonic()
    if jobs < 1:
        raise UsageError(f"jobs must be at least 1, not {jobs}")
    store, manifest, idx = _open(url, endpoint_url, cache_dir)
    prefix = _norm(path_prefix)
    if not path_ok(prefix):
        raise UsageError(f"{path_prefix!r} is not a path in a dataset",
                         "give a relative path without '..' (`hyper data ls URL` lists them)")
    with _reading(store, manifest):
        if idx.stat(prefix) is None:
            raise UsageError(f"{url}: no {prefix!r} in the dataset",
                             "`hyper data ls URL` lists it")
        entries = [e for e in idx.walk()
                   if not prefix or e.path == prefix or e.path.startswith(prefix + "/")]
        segs = {e.path: idx.segments(e.path, e.size) for e in entries if e.kind == "f"}
    order = list(dict.fromkeys(c for s in segs.values() for c, _, _ in s))
    total = sum(e.size for e in entries if e.kind == "f")
    root = Path(dest_dir)
    where = root
    try:
        before = os.stat(root) if root.is_dir() else None  # dest_dir is the user's
        root.mkdir(parents=True, exist_ok=True)
    except OSError as ex:
        raise UsageError(f"{root}: cannot write: {ex.strerror}") from None
    try:
        dirs = {parent_of(prefix)} if prefix else set()
        for a in filter(None, parent_of(prefix).split("/")):  # folders above the prefix
            where = where / a
            _mkdir(where)
        counts = {"f": 0, "d": 0, "l": 0}
        done = 0
        made: list[tuple[Path, Entry]] = []
        with tempfile.TemporaryDirectory(prefix="hyper-pull-") as tmp:
            fetcher = _Fetcher(store, idx.chunk_list, order, Path(tmp), jobs)
            for s in segs.values():
                for c, _, _ in s:
                    fetcher.use(c)
            try:
                for e in entries:
                    if not path_ok(e.path) or (e.path and parent_of(e.path) not in dirs):
                        raise DatasetError(f"{url}: refusing path {e.path!r}: outside "
                                           f"{dest_dir} or not below a folder of the dataset")
                    if not e.path:  # the dataset's root: dest_dir, left as it is
                        dirs.add("")
                        continue
                    where = dest = root / e.path
                    if e.kind == "d":
                        _mkdir(dest)
                        dirs.add(e.path)
                        made.append((dest, e))
                    elif e.kind == "l":
                        if os.path.lexists(dest):
                            dest.unlink()  # a file or link; a folder there is an error
                        os.symlink(e.target, dest)
                        os.utime(dest, ns=(time.time_ns(), round(e.mtime * 1e9)),
                                 follow_symlinks=False)
                    else:
                        done += _write_file(dest, e, segs[e.path], fetcher, url)
                        if progress:
                            progress(done, total)
                    counts[e.kind] += 1
            finally:
                fetcher.close()
        for dest, e in reversed(made):  # deepest first, after their contents
            where = dest
            _set_dir(dest, e)
    except OSError as ex:
        raise UsageError(f"{where}: cannot write: {ex.strerror}") from None
    finally:
        if before is not None:  # its mtime as it was, whatever was written into it
            try:
                os.utime(root, ns=(before.st_atime_ns, before.st_mtime_ns))
            except OSError:
                pass
    return PullReport(files=counts["f"], dirs=counts["d"], symlinks=counts["l"],
                      bytes=done, chunks=len(order), seconds=time.monotonic() - t0)


def _entry_problems(idx: Index) -> list[str]:
    """Every row of the index that is not a well-formed entry, and every file whose segments
    are wrong or do not add up to its size (one line each, naming the entry)."""
    problems = []
    for e in idx.walk(bad="keep"):
        if not isinstance(e, Entry):
            problems.append(e.reason)
        elif e.kind == "f":
            try:
                idx.segments(e.path, e.size)
            except CorruptIndex as ex:
                problems.append(str(ex))
    return problems


def verify(url: str, *, jobs: int = 16, endpoint_url: str | None = None) -> VerifyReport:
    """Check the dataset at ``url`` against its manifest, and report every fault found.

    Checks: the index object exists and has the manifest's SHA-256; the index names the
    manifest's chunks; every row of it is a well-formed entry, and every file's segments are
    bytes of its chunks that add up to its size; every chunk exists (one LIST), has the
    manifest's size, and its bytes have the SHA-256 that names it (each chunk downloaded
    once, by ``jobs`` threads). The index is downloaded again (not taken from a cache).

    Raises:
        UsageError: no dataset at url.
        StoreError: the store cannot be read at all (a failed chunk is a problem, not an error).
    """
    t0 = time.monotonic()
    store = open_store(url, endpoint_url=endpoint_url)
    m = load_manifest(store)
    chunks = [(sha, size) for sha, size in m["chunks"]]
    report = VerifyReport(url=store.url, chunks=len(chunks), bytes=sum(s for _, s in chunks))
    with tempfile.TemporaryDirectory(prefix="hyper-verify-") as tmp:
        try:
            idx = Index(fetch_index(store, m, tmp))  # the store's copy, never a cached one
            if [(sha, size) for _, sha, size in idx.chunk_list] != chunks:
                report.problems.append(f"{m['index']}: names other chunks than the manifest")
            report.problems += [f"{m['index']}: {p}" for p in _entry_problems(idx)]
        except NotFound:
            report.problems.append(f"{m['index']}: missing")
        except DatasetError as e:
            report.problems.append(str(e))
        except (ValueError, sqlite3.DatabaseError) as e:
            report.problems.append(f"{m['index']}: {e}")
        listed = dict(store.list("chunks/"))

        def check(sha: str, size: int) -> str | None:
            key = f"chunks/{sha}"
            if key not in listed:
                return f"{key}: missing"
            if listed[key] != size:
                return f"{key}: {listed[key]} bytes, expected {size}"
            path = Path(tmp) / sha
            try:
                store.get_to_file(key, path)
                got = _sha256_file(path)
            except StoreError as e:
                return f"{key}: {e}"
            finally:
                path.unlink(missing_ok=True)
            return None if got == sha else f"{key}: corrupt (its bytes have sha256 {got})"

        unique = dict(chunks)
        with ThreadPoolExecutor(max(1, jobs), thread_name_prefix="hyper-verify") as pool:
            for problem in pool.map(lambda c: check(*c), unique.items()):
                if problem:
                    report.problems.append(problem)
    report.seconds = time.monotonic() - t0
    return report
