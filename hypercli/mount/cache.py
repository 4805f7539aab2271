"""The local chunk cache of a mount: whole chunks, downloaded once, verified, kept under a cap.

Source: the Hyper paper (Snark AI, 2019), section III-A — a node fetches a dataset's large
immutable chunks whole and keeps them on local disk, so that many small reads by a training
program cost a few large requests and then run at local-disk speed.

A chunk is named by the SHA-256 of its bytes, so a cached file ``cache_dir/<sha256>`` is right
exactly when its bytes hash to its name. The rules:

- **Single flight.** The first reader of a chunk that is not here downloads it; every other
  reader of that chunk waits for the same download. A download goes to a temporary file
  (``.<sha>.<pid>.<thread>.tmp``), is hashed as its bytes arrive (the file itself is hashed
  again only when that digest is wrong: an SDK may rewrite a part it retried), and only then
  renamed into place: a reader never sees a partial or wrong chunk. A chunk whose bytes are
  wrong is fetched once more; wrong twice and the read fails with :class:`ChunkError` (the
  FUSE layer answers EIO).
- **Reuse.** Chunks left in ``cache_dir`` by an earlier mount are reused. At start only their
  sizes are checked (a truncated file is deleted at once); the SHA-256 of a reused chunk is
  checked lazily, the first time this process opens it. Hashing the whole cache at start would
  delay the mount by a minute for every ~100 GB cached; checked on first use, the cost is one
  local sequential read of a chunk that is about to be read anyway (it also warms the page cache).
  A cached file that turns out short while in use (truncated behind our back) is dropped and
  fetched again.
- **Eviction.** Chunks no reader has touched for ``ACTIVE_WINDOW`` s (least recently used
  first), then read-ahead no reader has opened yet, then the chunks readers are in, are
  deleted when the cached bytes would exceed
  ``max_bytes`` or the cache's disk would have less than ``min_free_bytes`` free. A chunk in
  use (``acquire``-d and not yet ``release``-d, or being read) is never evicted: when every chunk
  is in use the cap is exceeded until one is released. Files of other datasets found in
  ``cache_dir`` at start count towards the cap and are evicted first, oldest first.
- **Prefetch.** The first time a chunk is opened, the next ``prefetch`` chunks in pack order are
  downloaded (or, reused, checked) in the background (``jobs`` threads): an epoch over a dataset
  reads its files in pack order, so the next chunk is usually ready before it is needed.
  Prefetch is off when the cap holds fewer than ``prefetch + 2`` of the largest chunks (it
  would evict what is read). A prefetch is only *admitted* when the cap has room for it after
  evicting chunks that readers opened and have not read for ``ACTIVE_WINDOW`` s: it never
  evicts a chunk a reader is in the middle of, nor another prefetched chunk not yet read, nor
  pushes the cache over its cap. Without that rule, several
  readers streaming large files through a small cache evicted each other's read-ahead and
  their own current chunks: measured with 4 readers of 128 MiB files and a 256 MiB cap, 19 GB
  were downloaded for 0.5 GB read, and the cache held 1.9x its cap.
- **Nobody else writes a cached chunk.** A chunk file is checked once per process (above) and
  then served from its open descriptor, so a change to it after the check would be served.
  Chunk files are made read-only (``0o400``) and the chunk folder is the daemon's alone
  (``0o700``), whatever the umask: no other user can change, replace or even read a cached
  chunk. This is chosen over checking a chunk again before each read: hashing it again costs
  a whole chunk per check, and even a cheap sign of change (an ``fstat`` of its ctime) is one
  more system call on every READ and still leaves a gap between the check and the read. The
  daemon's own user (and root) can still change the files, but they can as well change the
  daemon itself; a chunk changed while no daemon holds it open is hashed again before its
  first use, as every reused chunk is.
- **Store failures.** An unreachable store or a missing chunk fails that read with
  :class:`ChunkError` and a warning on the ``hypercli.mount`` logger naming the chunk and the
  reason. Nothing is remembered: the next read asks the store again, so the mount recovers when
  the store does.

Thread-safe; one lock guards the bookkeeping, and no I/O is done while holding it but
``statvfs`` and unlinking evicted files. Two mounts may share a cache folder (names are content
hashes, files appear by atomic rename, and a file evicted by one stays readable through the
other's open descriptor), but each keeps its own count against its own cap: give each mount its
own folder when the cap matters.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from hypercli.mount.store import Store, StoreError

log = logging.getLogger("hypercli.mount")

GiB = 1 << 30
_BLOCK = 1 << 20
_NAME = re.compile(r"[0-9a-f]{64}")
_TMP = re.compile(r"\.[0-9a-f]{64}\.(\d+)\.\d+\.tmp")

_ABSENT, _LOADING, _READY = "absent", "loading", "ready"
FOLDER_MODE = 0o700  # the chunk folder: the daemon's user's alone
CHUNK_MODE = 0o400   # a cached chunk: read-only, to its owner only
#: s since its last read after which a chunk counts as one no reader is in the middle of (a
#: streaming reader touches its current chunk at every read, milliseconds apart); only such
#: chunks may make room for read-ahead
ACTIVE_WINDOW = 1.0


class ChunkError(StoreError):
    """A chunk cannot be served: the store failed or its bytes were wrong twice."""


class _Flight:
    """One download (or check) of a chunk that readers wait for."""

    __slots__ = ("done", "error")

    def __init__(self):
        self.done = threading.Event()
        self.error: ChunkError | None = None


class _Entry:
    __slots__ = ("sha", "size", "state", "verified", "refs", "fd", "stale_fds", "flight",
                 "opened", "queued", "used")

    def __init__(self, sha: str, size: int):
        self.sha, self.size = sha, size
        self.state = _ABSENT
        self.verified = False     # bytes hashed by this process
        self.refs = 0             # acquire()s and reads in progress
        self.used = 0.0           # time.monotonic() of its last acquire
        self.fd: int | None = None
        self.stale_fds: list[int] = []  # fds of a dropped file, closed when refs reach 0
        self.flight: _Flight | None = None
        self.opened = False       # acquired since it became resident (prefetch trigger)
        self.queued = False       # a prefetch is queued


def sha256_file(path: str | os.PathLike) -> str:
    """Hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_BLOCK):
            h.update(block)
    return h.hexdigest()


class ChunkCache:
    """Verified local copies of a dataset's chunks (see the module docstring for the rules).

    Args:
        store: where ``chunks/<sha256>`` objects are (:mod:`hypercli.mount.store`).
        chunks: the dataset's chunks as (seq, sha256 hex, size bytes), seq 0..n-1 in pack
            order (``Index.chunk_list``).
        cache_dir: folder for the chunk files (created); may hold chunks of earlier mounts.
        max_bytes: cap on the bytes of chunk files in cache_dir.
        min_free_bytes: free space to keep on cache_dir's file system (default 1 GiB).
        prefetch: chunks to download ahead of the first read of a chunk (0: off).
        jobs: background download threads.
    Attributes:
        hits, misses: ``acquire`` calls served from the cache / that had to wait for a
            download or a check.
        downloads, bytes_downloaded: completed store reads of chunks and their bytes
            (a chunk fetched again after a bad hash counts twice).
        evictions: chunk files deleted to stay under the cap.
        verify_failures: chunks (downloaded or cached) whose bytes had the wrong SHA-256.
        errors: reads failed with ChunkError.
        prefetches: background downloads (or checks of reused chunks) queued.
        prefetch_skipped: read-ahead not admitted: no room under the cap (see Prefetch).
        downloads_by_seq: {seq: downloads} of each chunk.
    """

    def __init__(self, store: Store, chunks: list[tuple[int, str, int]],
                 cache_dir: str | os.PathLike, *, max_bytes: int, min_free_bytes: int = GiB,
                 prefetch: int = 2, jobs: int = 4):
        self.store = store
        self.dir = Path(cache_dir).absolute()
        self.dir.mkdir(parents=True, exist_ok=True, mode=FOLDER_MODE)
        _private(self.dir, FOLDER_MODE)
        self.max_bytes, self.min_free_bytes = int(max_bytes), int(min_free_bytes)
        self.seqs: list[str] = [sha for _, sha, _ in sorted(chunks)]
        self._entries: dict[str, _Entry] = {}
        for _, sha, size in chunks:
            self._entries.setdefault(sha, _Entry(sha, int(size)))
        biggest = max((e.size for e in self._entries.values()), default=0)
        self.prefetch = prefetch if self.max_bytes >= (prefetch + 2) * biggest else 0
        self._lock = threading.Lock()
        self._lru: OrderedDict[str, _Entry] = OrderedDict()   # resident, oldest first
        self._foreign: list[tuple[Path, int]] = []             # other datasets' files
        self._bytes = 0   # resident + being downloaded
        self.hits = self.misses = self.downloads = self.bytes_downloaded = 0
        self.evictions = self.verify_failures = self.errors = self.prefetches = 0
        self.prefetch_skipped = 0
        self.downloads_by_seq: dict[int, int] = {}
        #: called with a chunk's sha256, under the cache's lock, when its file is evicted
        #: or dropped (so other processes reading it can let go of their descriptors)
        self.on_evict = None
        self._pool = ThreadPoolExecutor(max(1, jobs), thread_name_prefix="hyper-prefetch")
        self._scan()

    # -- start ------------------------------------------------------------------------
    def _scan(self) -> None:
        """Adopt chunk files of earlier mounts (right size), drop truncated ones and stale
        temporary files of dead processes."""
        found = []
        for de in os.scandir(self.dir):
            m = _TMP.fullmatch(de.name)
            if m:
                if not _alive(int(m.group(1))):
                    _unlink(de.path)
                continue
            if not _NAME.fullmatch(de.name) or not de.is_file(follow_symlinks=False):
                continue
            st = de.stat()
            e = self._entries.get(de.name)
            if e is None:
                found.append((st.st_mtime, Path(de.path), st.st_size))
            elif st.st_size != e.size:
                log.warning("cached chunk %s is %d bytes, not %d: deleted, will fetch again",
                            de.name, st.st_size, e.size)
                _unlink(de.path)
            else:
                _private(de.path, CHUNK_MODE)
                e.state = _READY  # verified lazily, on first use
                self._lru[e.sha] = e
                self._bytes += e.size
        self._foreign = [(p, size) for _, p, size in sorted(found, key=lambda f: f[0])]
        self._bytes += sum(size for _, size in self._foreign)
        with self._lock:
            self._make_room(None)

    # -- public -----------------------------------------------------------------------
    def acquire(self, seq: int) -> Path:
        """The local path of chunk ``seq``, whole and verified; it stays here (never evicted)
        until the matching :meth:`release`. Downloads it when needed (single flight).

        Raises:
            ChunkError: the store failed or the chunk's bytes are wrong (logged).
        """
        e = self._entry(seq)
        if not self._hold(e, seq):
            try:
                self._ensure(e, seq)
            except BaseException:
                self._let_go(e)
                raise
        return self.dir / e.sha

    def drop_if_short(self, seq: int) -> bool:
        """Drop chunk ``seq``'s cached file if it is shorter than the chunk (cut short behind
        this cache's back while resident), so the next :meth:`acquire` fetches it again; for
        a caller that reads the file through a descriptor of its own. True when dropped."""
        e = self._entry(seq)
        with self._lock:
            fd = e.fd if e.state == _READY else None
            if fd is None:
                return False
            got = os.fstat(fd).st_size
        if got >= e.size:
            return False
        self._drop(e, f"{got} bytes where {e.size} were expected (file truncated?)")
        return True

    def ready(self, seq: int) -> bool:
        """Whether chunk ``seq`` is here and verified now (no lock taken: a hint, for a
        caller choosing between answering at once and handing the read to a thread)."""
        e = self._entries[self.seqs[seq]]
        return e.state == _READY and e.verified and e.fd is not None

    def read_nowait(self, seq: int, offset: int, length: int):
        """:meth:`read` only if it cannot wait: the bytes (a bytearray, counted as a hit) when
        chunk ``seq`` is here and verified and they are in the kernel's page cache
        (``preadv`` with ``RWF_NOWAIT``, Linux 4.14+); else None (nothing counted), and the
        caller reads them with :meth:`read` where it may wait."""
        e = self._entry(seq)
        with self._lock:
            if e.state != _READY or not e.verified or e.fd is None:
                return None
            e.refs += 1
            e.used = time.monotonic()
        try:
            length = max(0, min(length, e.size - offset))
            buf = bytearray(length)
            try:
                got = os.preadv(e.fd, [buf], offset, os.RWF_NOWAIT)
            except (BlockingIOError, OSError):
                return None
            if got != length:
                return None
            with self._lock:
                self.hits += 1
            return buf
        finally:
            self._let_go(e)

    def release(self, seq: int) -> None:
        """Undo one :meth:`acquire` (or a read's hold); the chunk may be evicted after."""
        self._let_go(self._entry(seq))

    def _hold(self, e: _Entry, seq: int) -> bool:
        """Take a ref on chunk e (``seq``), count a hit or a miss, start its read-ahead on
        its first use; returns whether it is here and verified."""
        with self._lock:
            e.refs += 1
            e.used = time.monotonic()
            ready = e.state == _READY and e.verified
            if ready:
                self.hits += 1
                self._lru.move_to_end(e.sha)
            else:
                self.misses += 1
            first, e.opened = not e.opened, True
        if first:
            self._prefetch_after(seq)
        return ready

    def _let_go(self, e: _Entry) -> None:
        """Drop a ref taken by :meth:`_hold`; make room when the cache is over its cap."""
        with self._lock:
            self._unref(e)
            if e.refs == 0 and self._bytes > self.max_bytes:
                self._make_room(None)

    @contextmanager
    def chunk(self, seq: int) -> Iterator[Path]:
        """``with cache.chunk(seq) as path:`` — acquire/release around a block."""
        path = self.acquire(seq)
        try:
            yield path
        finally:
            self.release(seq)

    def read(self, seq: int, offset: int, length: int, into=None):
        """:meth:`acquire`, :meth:`pread` and :meth:`release` in one: the bytes a program
        reads, counted as a hit or a miss, the chunk held while they are read (never
        evicted under the read), its read-ahead started on its first read. ``into``: a
        writable buffer of ``length`` bytes to read into; then their count is returned.

        Raises:
            ChunkError: as :meth:`pread`.
        """
        e = self._entry(seq)
        self._hold(e, seq)
        try:
            return self._pread_held(e, seq, offset, length, into)
        finally:
            self._let_go(e)

    def pread(self, seq: int, offset: int, length: int) -> bytes:
        """``length`` bytes at ``offset`` of chunk ``seq`` (fewer only past the chunk's end).

        Holds the chunk for the duration of the read and fetches it if needed (uncounted in
        hits/misses). A cached file found short is dropped and fetched again once.

        Raises:
            ChunkError: as :meth:`acquire`, or the file is short twice.
        """
        e = self._entry(seq)
        with self._lock:
            e.refs += 1
        try:
            return self._pread_held(e, seq, offset, length)
        finally:
            with self._lock:
                self._unref(e)

    def _pread_held(self, e: _Entry, seq: int, offset: int, length: int, into=None):
        """pread of chunk e, whose ref the caller holds: bytes, or their count read into
        ``into``."""
        length = max(0, min(length, e.size - offset))
        for _ in range(2):
            while (fd := e.fd if e.state == _READY and e.verified else None) is None:
                self._ensure(e, seq)
            if into is None:
                data = os.pread(fd, length, offset)
                got = len(data)
            else:
                data = got = os.preadv(fd, [into[:length]], offset)
            if got == length:
                return data
            self._drop(e, f"{got} bytes at offset {offset} where {length} were "
                          "expected (file truncated?)")
        with self._lock:
            self.errors += 1
        raise ChunkError(f"{self.store.url}/chunks/{e.sha}: cached copy keeps coming "
                         "back short")

    def stats(self) -> dict:
        """The counters (see the class docstring) and cache state, JSON-ready: also
        ``cached_bytes``, ``max_bytes``, ``resident`` and ``in_use`` (lists of seqs, for
        datasets of at most 10,000 chunks)."""
        with self._lock:
            s = {k: getattr(self, k) for k in (
                "hits", "misses", "downloads", "bytes_downloaded", "evictions",
                "verify_failures", "errors", "prefetches", "prefetch_skipped", "max_bytes")}
            s["cached_bytes"] = self._bytes
            s["downloads_by_seq"] = dict(self.downloads_by_seq)
            if len(self.seqs) <= 10_000:
                s["resident"] = [i for i, sha in enumerate(self.seqs)
                                 if self._entries[sha].state == _READY]
                s["in_use"] = [i for i, sha in enumerate(self.seqs)
                               if self._entries[sha].refs > 0]
        return s

    def close(self) -> None:
        """Stop prefetching and close the chunk files (the files stay for the next mount)."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            for e in self._entries.values():
                for fd in [e.fd, *e.stale_fds]:
                    if fd is not None:
                        os.close(fd)
                e.fd, e.stale_fds = None, []

    # -- internals ----------------------------------------------------------------------
    def _entry(self, seq: int) -> _Entry:
        if not 0 <= seq < len(self.seqs):
            raise ChunkError(f"{self.store.url}: no chunk {seq} in the dataset")
        return self._entries[self.seqs[seq]]

    def _unref(self, e: _Entry) -> None:  # under the lock
        e.refs -= 1
        if e.refs == 0 and e.stale_fds:
            for fd in e.stale_fds:
                os.close(fd)
            e.stale_fds = []

    def _ensure(self, e: _Entry, seq: int, prefetch: bool = False) -> None:
        """Make e resident and verified, leading or joining its flight. Caller holds a ref.
        ``prefetch``: room is made without evicting prefetched chunks not yet opened."""
        while True:
            with self._lock:
                if e.state == _READY and e.verified:
                    return
                if e.state == _LOADING:
                    flight, lead, cached = e.flight, False, False
                else:
                    cached = e.state == _READY
                    if not cached:
                        self._bytes += e.size  # reserve the room before downloading
                    else:
                        self._lru.pop(e.sha, None)
                    e.state, e.flight = _LOADING, _Flight()
                    flight, lead = e.flight, True
                    if not cached:
                        self._make_room(e, spare_unopened=prefetch)
            if lead:
                self._load(e, seq, flight, cached)
            flight.done.wait()
            if flight.error is not None:
                raise flight.error

    def _load(self, e: _Entry, seq: int, flight: _Flight, cached: bool) -> None:
        """Check a cached file or download the chunk (twice at most); then publish."""
        path = self.dir / e.sha
        key = f"chunks/{e.sha}"
        try:
            ok = False
            if cached:
                try:
                    ok = os.path.getsize(path) == e.size and sha256_file(path) == e.sha
                except FileNotFoundError:
                    ok = False
                if not ok:
                    with self._lock:
                        self.verify_failures += 1
                    log.warning("cached chunk %d (%s) is corrupt: fetching it again",
                                seq, e.sha)
                    _unlink(path)
            for attempt in range(2):
                if ok:
                    break
                tmp = self.dir / f".{e.sha}.{os.getpid()}.{threading.get_ident()}.tmp"
                try:
                    digest = hashlib.sha256()  # fed as the bytes arrive: one pass over them
                    n = self.store.get_to_file(key, tmp, digest=digest)
                    with self._lock:
                        self.downloads += 1
                        self.bytes_downloaded += n
                        self.downloads_by_seq[seq] = self.downloads_by_seq.get(seq, 0) + 1
                    got = digest.hexdigest()
                    if got != e.sha and n == e.size:  # an SDK may have rewritten a part
                        got = sha256_file(tmp)  # the file's bytes decide
                    if n == e.size and got == e.sha:
                        os.chmod(tmp, CHUNK_MODE)
                        os.replace(tmp, path)
                        ok = True
                        break
                finally:
                    _unlink(tmp)
                with self._lock:
                    self.verify_failures += 1
                log.warning("chunk %d from %s/%s: %d bytes with sha256 %s, expected %d bytes "
                            "with its name as sha256%s", seq, self.store.url, key, n, got,
                            e.size, ": fetching it again" if attempt == 0 else "")
            if not ok:
                raise ChunkError(f"{self.store.url}/{key}: corrupt in the store (wrong "
                                 "sha256 twice); not served")
            fd = os.open(path, os.O_RDONLY)
        except (StoreError, OSError) as ex:
            reason = ex if isinstance(ex, StoreError) else f"{path}: {ex.strerror or ex}"
            with self._lock:
                e.state, e.flight = _ABSENT, None
                e.opened = False
                self._bytes -= e.size
                self.errors += 1
            flight.error = ex if isinstance(ex, ChunkError) else ChunkError(
                f"chunk {seq} ({e.sha[:12]}): {reason}")
            log.warning("chunk %d (%s) cannot be read: %s", seq, e.sha, reason)
        else:
            with self._lock:
                if e.fd is not None:
                    e.stale_fds.append(e.fd)
                e.fd, e.state, e.verified, e.flight = fd, _READY, True, None
                self._lru[e.sha] = e
        finally:
            flight.done.set()

    def _drop(self, e: _Entry, reason: str) -> None:
        """Forget a resident chunk whose file is wrong; readers holding it keep its fd."""
        with self._lock:
            if e.state != _READY:
                return
            log.warning("cached chunk %s: %s; fetching it again", e.sha, reason)
            self._lru.pop(e.sha, None)
            e.state, e.verified, e.opened = _ABSENT, False, False
            self._bytes -= e.size
            if e.fd is not None:
                e.stale_fds.append(e.fd)
                e.fd = None
            _unlink(self.dir / e.sha)
            if self.on_evict is not None:
                self.on_evict(e.sha)

    def _make_room(self, keep: _Entry | None, spare_unopened: bool = False) -> None:
        """Evict chunks not in use until under the cap with min_free_bytes free: chunks read
        past first (untouched for ACTIVE_WINDOW s, least recently used first), then
        read-ahead not yet opened, then the chunks readers are in. Under the lock.
        ``self._bytes`` already counts a download being reserved. ``spare_unopened``: chunks
        prefetched and not yet opened stay (room made for a prefetch)."""
        need = keep.size if keep is not None else 0
        try:
            st = os.statvfs(self.dir)
            free = st.f_bavail * st.f_frsize - need
        except OSError:
            free = None

        def over() -> bool:
            return self._bytes > self.max_bytes or (free is not None and
                                                    free < self.min_free_bytes)
        while over() and self._foreign:
            p, size = self._foreign.pop(0)
            _unlink(p)
            self._bytes -= size
            free = free + size if free is not None else None
            self.evictions += 1
        if not over():
            return
        # first chunks no reader has touched for ACTIVE_WINDOW s (read past, LRU order), then
        # read-ahead no reader has opened yet (a guess), then chunks readers are in
        idle_since = time.monotonic() - ACTIVE_WINDOW
        idle, ahead, active = [], [], []
        for sha, v in self._lru.items():
            (ahead if not v.opened else idle if v.used < idle_since else active).append(sha)
        for sha in idle + ([] if spare_unopened else ahead) + active:
            if not over():
                return
            v = self._lru.get(sha)
            if v is None or v.refs or v is keep or v.state != _READY or (
                    spare_unopened and not v.opened):
                continue
            del self._lru[sha]
            v.state, v.verified, v.opened = _ABSENT, False, False
            if v.fd is not None:
                os.close(v.fd)  # refs == 0: nobody is reading it
                v.fd = None
            _unlink(self.dir / sha)
            if self.on_evict is not None:
                self.on_evict(sha)
            self._bytes -= v.size
            free = free + v.size if free is not None else None
            self.evictions += 1
        if over():
            log.debug("chunk cache over its cap (%d > %d bytes): every chunk is in use",
                      self._bytes, self.max_bytes)

    def _prefetch_after(self, seq: int) -> None:
        for k in range(seq + 1, min(seq + 1 + self.prefetch, len(self.seqs))):
            e = self._entry(k)
            with self._lock:
                if e.queued or e.state == _LOADING or (e.state == _READY and e.verified):
                    continue  # a reused chunk not yet checked is checked ahead too
                e.queued = True
                self.prefetches += 1
            try:
                self._pool.submit(self._prefetch_one, k, e)
            except RuntimeError:  # closed
                e.queued = False
                return

    def _room_for_prefetch(self, e: _Entry) -> bool:
        """Under the lock: True when ``e`` fits under the cap once the chunks that readers
        opened and have not touched for ACTIVE_WINDOW s (and other datasets' files) are
        evicted: a chunk a reader is in the middle of is touched at every read."""
        idle = time.monotonic() - ACTIVE_WINDOW
        freeable = sum(size for _, size in self._foreign) + sum(
            v.size for v in self._lru.values()
            if not v.refs and v.opened and v.state == _READY and v.used < idle)
        return self._bytes + e.size - freeable <= self.max_bytes

    def _prefetch_one(self, seq: int, e: _Entry) -> None:
        with self._lock:
            e.queued = False
            if e.state == _ABSENT and not self._room_for_prefetch(e):
                self.prefetch_skipped += 1
                return
            e.refs += 1
        try:
            self._ensure(e, seq, prefetch=True)
        except ChunkError:
            pass  # logged by _load; a reader will try again
        finally:
            with self._lock:
                self._unref(e)
                if e.refs == 0 and self._bytes > self.max_bytes:
                    self._make_room(None)


def _private(path, mode: int) -> None:
    """Give a file or folder of the cache ``mode`` unless it has it (one of another user's,
    in a shared cache folder, is left as it is, with a warning)."""
    try:
        if os.stat(path).st_mode & 0o7777 != mode:
            os.chmod(path, mode)
    except OSError as e:
        log.warning("%s: cannot make it %o: %s", path, mode, e.strerror or e)


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
