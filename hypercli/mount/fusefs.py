"""A dataset in object storage as a read-only local folder: FUSE over the chunk cache.

Source: the Hyper paper (Snark AI, 2019), section III-A — a dataset packed into large chunks
in object storage is mounted on every node as a file system, so that programs that know
nothing about it read its small files at near local-disk speed, each chunk fetched once.

    mount(url, mountpoint, cache_dir=..., cache_bytes=...)   serve it (foreground or daemon)
    unmount(mountpoint)                                       ``fusermount3 -u``
    mount_stats(mountpoint)                                   the chunk cache's counters

The file system answers from the dataset's index (names, sizes, modes, mtimes, symlinks) and
reads bytes from whole chunks in :class:`~hypercli.mount.cache.ChunkCache`. Two servers give
the same file system (``SERVERS``, chosen by :func:`mount`'s ``server``):
:mod:`hypercli.mount.fuselow` (``server="low"``), the FUSE protocol read from ``/dev/fuse`` by
one or more processes; or, by default, :class:`ChunkFS` below, the rest of this docstring,
served with mfusepy over libfuse 3 (``FUSE_LIBRARY_NAME=fuse3``), multithreaded, mounted ``ro`` with the
kernel's page cache kept across opens (``kernel_cache``) and attribute, entry and negative
lookups cached for an hour: the data is immutable, so nothing the kernel caches goes stale.
``open`` answers ENOSYS, once: the kernel then stops sending opens (and releases) for the life
of the mount and keeps each file's page cache across opens (``no_open``, Linux 4.19+:
``fuse_file_open`` in fs/fuse/file.c), so a file read again costs no request to this daemon.
Listings are answered with every entry's attributes (READDIRPLUS), and a new mount lists its
first ``WARM_ENTRIES`` entries itself (:func:`warm`): the kernel then knows those names and
sizes, and the first read of a file is one request (READ) instead of two (LOOKUP, READ). With
a reader and this daemon on different cores, a request's round trip costs ~50 µs of wake-ups
on this kind of VM (12.7 µs on one core; bench/RESULTS.md §4), more than the handlers' work.
Reads find a file's layout by path, and each read holds the chunks it reads for its duration.
The calls of every operation and the time spent in them are counted (:meth:`ChunkFS.stats`).
(``opendir`` is not answered the same way: libfuse's high-level readdir needs the handle its
own opendir makes.)

Errors a program sees: ENOENT for a path not in the dataset; EROFS for every kind of write
(open for writing, create, mkdir, unlink, rmdir, rename, link, symlink, chmod, chown,
truncate, utimes, setxattr); EIO when a chunk cannot be served (the store is unreachable, or
its bytes are wrong) — the reason goes to the ``hypercli.mount`` logger, wrong bytes are never
returned, and the next read tries the store again. An index row that is not a well-formed
entry (:class:`~hypercli.mount.index.CorruptIndex`: an unknown kind, a size, mode or mtime
of the wrong type, segments that do not add up to the file's size) is EIO for that entry
alone: its folder still lists (the entry's name shown without attributes, so a ``stat`` of
it asks, and gets EIO; a name that cannot be shown is left out) and its other entries read.
libfuse 3 runs the daemon with ``/`` as its working folder, so every path here is made
absolute first.

A daemon (``foreground=False``) is this module run as a program (``python -m
hypercli.mount.fusefs``) in a session of its own, logging to ``cache_dir/mount.log``.

The cache folder holds ``chunks/<sha256>`` (the chunk cache), ``index/<sha256>.sqlite`` (the
dataset's index, see :func:`hypercli.mount.pack.fetch_index`) and ``mount.log``.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import functools
import json
import logging
import os
import re
import stat
import subprocess
import sys
import threading
import time
from collections import OrderedDict
from pathlib import Path

from hypercli.errors import InfraError, UsageError
from hypercli.mount.cache import GiB, ChunkCache
from hypercli.mount.index import BadEntry, CorruptIndex, Index, pieces
from hypercli.mount.store import StoreError, open_store

log = logging.getLogger("hypercli.mount")

STATS_XATTR = "user.hypercli.stats"  # on the mount's root: the cache counters, as JSON
CACHE_TIMEOUT = 3600.0  # s the kernel keeps attributes, entries and misses (data is immutable)
NODES = 16384  # paths whose entry and layout the daemon keeps (LOOKUP, then READ, by path)
LISTING_PAGE = 1024  # entries of a folder read from the index at once for READDIRPLUS
LISTING_FOLDERS = 64  # folders whose current READDIRPLUS page is kept
#: entries a new mount lists at once (READDIRPLUS), so the kernel knows them before a program
#: asks: a file first read then costs one request (READ), not two (LOOKUP, READ). ~1.2 KiB
#: of reclaimable kernel memory (dentry, inode) and ~0.1 KiB of the daemon's (libfuse's node)
#: each, and ~6 µs of mount time (bench/RESULTS.md §4, "First touch")
WARM_ENTRIES = 100_000
#: KiB the kernel reads ahead of a program reading a file in order, and so the size of a READ
#: it sends (up to libfuse's 1 MiB): 8 times fewer requests than the kernel's 128 KiB default
#: when a large file streams. Set on the mount's own backing device (``/sys/class/bdi``),
#: where the writer may (root); elsewhere the default stays.
READ_AHEAD_KIB = 1024
MAX_THREADS = 64       # libfuse worker threads: concurrent requests (most wait on downloads)
MAX_IDLE_THREADS = 64  # kept when idle, with their Python thread states (_keep_thread_state)
#: what serves a mount: libfuse 3's high-level API through mfusepy (one process), or
#: :mod:`hypercli.mount.fuselow` (the FUSE protocol itself, one or more processes)
SERVERS = ("mfusepy", "low")
DEFAULT_SERVER = "mfusepy"
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC


class _Errno(OSError):
    """An answer chosen on purpose (ENOENT, EROFS, ...), passed to the kernel as is."""

    def __init__(self, code: int, path: str = ""):
        super().__init__(code, os.strerror(code), path)


_KEPT: set[int] = set()


def _keep_thread_state() -> None:
    """Keep this libfuse thread's Python thread state from one callback to the next.

    ctypes gives a thread that Python did not start a fresh thread state for every callback
    (``PyGILState_Ensure``/``Release`` around it), which costs time on each of the 4-5
    callbacks a small file needs. One extra ``PyGILState_Ensure`` per thread, never released,
    keeps the state (documented C API: calls nest); libfuse keeps its idle threads
    (``max_idle_threads``), so the states kept are bounded by the threads it ever ran.
    """
    t = threading.get_ident()
    if t not in _KEPT:
        _KEPT.add(t)
        ctypes.pythonapi.PyGILState_Ensure()


def _op(fn):
    """Run a FUSE handler: chosen errnos pass; a store or chunk failure is logged and becomes
    EIO; anything unexpected is logged with its traceback and becomes EIO (never the silent
    ENOENT or EINVAL of the binding)."""
    name = fn.__name__

    @functools.wraps(fn)
    def handler(self, path, *args):
        _keep_thread_state()
        t0 = time.perf_counter_ns()
        try:
            return fn(self, path, *args)
        except _Errno:
            raise
        except CorruptIndex as e:
            log.warning("%s %s: the index is corrupt: %s", fn.__name__, path, e)
            raise _Errno(errno.EIO, path) from None
        except StoreError as e:
            log.warning("%s %s: %s", fn.__name__, path, e)
            raise _Errno(errno.EIO, path) from None
        except Exception:
            log.exception("%s %s failed", fn.__name__, path)
            raise _Errno(errno.EIO, path) from None
        finally:
            dt = time.perf_counter_ns() - t0
            with self._ops_lock:
                c = self._ops.get(name)
                if c is None:
                    c = self._ops[name] = [0, 0]
                c[0] += 1
                c[1] += dt
    return handler


def _read_only(fn):
    @functools.wraps(fn)
    def handler(self, path, *args, **kwargs):
        raise _Errno(errno.EROFS, path)
    return handler


class _Node:
    """What the daemon keeps of a path it was asked about: its index entry, and a file's
    layout (segments: chunk, offset in chunk, length; ``starts``: each segment's offset in
    the file)."""

    __slots__ = ("entry", "starts", "segs")

    def __init__(self, entry, segments: list[tuple[int, int, int]]):
        self.entry, self.segs = entry, segments
        self.starts: list[int] = []
        pos = 0
        for _, _, length in segments:
            self.starts.append(pos)
            pos += length


class ChunkFS:
    """The FUSE operations (mfusepy's interface, paths as str, times in ns) of one dataset.

    Args:
        index: the dataset's :class:`~hypercli.mount.index.Index`.
        cache: a :class:`~hypercli.mount.cache.ChunkCache` over the index's chunks.
        uid, gid: owner reported for every entry (default: this process's).
    Each read holds the chunks it reads for its duration (never evicted under it). A path's
    entry and layout come from one index query and are kept (``NODES`` paths, least recently
    used dropped), so the READ that follows a LOOKUP asks the index nothing. Counters of
    every operation (calls, time spent) are in :meth:`stats`.
    """

    use_ns = True

    def __init__(self, index: Index, cache: ChunkCache, *, uid: int | None = None,
                 gid: int | None = None):
        self.index, self.cache = index, cache
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.files, self.dirs, self.bytes = index.count()
        self._nodes: OrderedDict[str, _Node] = OrderedDict()  # path → node, LRU
        self._nodes_lock = threading.Lock()
        self.started = False
        self.on_start = None  # called once mounted (from libfuse's init)
        self.open_calls = 0  # opens that reached this daemon (the kernel stops after one)
        self._ops: dict[str, list[int]] = {}  # FUSE operation → [calls, ns spent in it]
        self._ops_lock = threading.Lock()
        # READDIRPLUS pages: folder → (offset of the page's first entry, [(name, attrs)])
        self._pages: OrderedDict[str, tuple[int, list]] = OrderedDict()

    def stats(self) -> dict:
        """The chunk cache's counters (:meth:`ChunkCache.stats`), ``open_calls`` and ``ops``:
        {FUSE operation: {"calls": n, "us": µs spent in this daemon's handler}} (the kernel's
        and libfuse's share of a request is not in ``us``)."""
        with self._ops_lock:
            ops = {k: {"calls": c, "us": round(t / 1000)} for k, (c, t) in self._ops.items()}
        return dict(self.cache.stats(), open_calls=self.open_calls, ops=ops)

    # -- helpers ------------------------------------------------------------------------
    def _node(self, path: str) -> _Node:
        with self._nodes_lock:
            n = self._nodes.get(path)
            if n is not None:
                self._nodes.move_to_end(path)
                return n
        rel = path.strip("/")
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:  # a name the dataset cannot hold
            raise _Errno(errno.ENOENT, path) from None
        found = self.index.lookup(rel)
        if found is None:
            raise _Errno(errno.ENOENT, path)
        n = _Node(*found)
        with self._nodes_lock:
            self._nodes[path] = n
            if len(self._nodes) > NODES:
                self._nodes.popitem(last=False)
        return n

    def _entry(self, path: str):
        return self._node(path).entry

    @staticmethod
    def _stat(e) -> tuple[int, int, int, int, int]:
        """(st_mode, st_nlink, st_size, st_blocks, mtime in ns) of an entry."""
        return (e.mode, 2 if e.kind == "d" else 1, e.size, (e.size + 511) // 512,
                int(round(e.mtime * 1e9)))

    def _attrs(self, e) -> dict:
        mode, nlink, size, blocks, ns = self._stat(e)
        return {"st_mode": mode, "st_nlink": nlink, "st_size": size, "st_uid": self.uid,
                "st_gid": self.gid, "st_blocks": blocks, "st_atime": ns, "st_mtime": ns,
                "st_ctime": ns}

    # -- reading ------------------------------------------------------------------------
    @_op
    def getattr(self, path: str, fh=None) -> dict:
        return self._attrs(self._entry(path))

    @_op
    def readlink(self, path: str) -> str:
        e = self._entry(path)
        if e.kind != "l":
            raise _Errno(errno.EINVAL, path)
        return e.target

    @_op
    def readdir(self, path: str, fh) -> list:
        e = self._entry(path)
        if e.kind != "d":
            raise _Errno(errno.ENOTDIR, path)
        out = [(".", {"st_mode": stat.S_IFDIR}, 0), ("..", {"st_mode": stat.S_IFDIR}, 0)]
        for c in self.index.listdir(e.path, bad="keep"):
            if type(c) is BadEntry:
                if c.name is not None:  # shown; a stat of it gets EIO
                    out.append((c.name, {"st_mode": 0}, 0))
                continue
            out.append((c.path.rsplit("/", 1)[-1], {"st_mode": c.mode}, 0))
        return out

    @_op
    def readdir_plus(self, path: str, offset: int) -> tuple[int, list]:
        """A page of a folder's listing for READDIRPLUS: (offset of its first entry,
        [(name as bytes, stat)]) holding the entry at ``offset`` (0 is ``.``, 1 ``..``, then
        the children by name), each child's stat as :meth:`_stat` (None for ``.`` and ``..``,
        which are folders); empty past the end. A row of the index that is not a well-formed
        entry keeps its place as (its name, or None when it cannot be shown; ``False``): it
        is listed without attributes, or not at all. The kernel asks for a listing in pieces,
        by offset: the folder's last page is kept and the next one is read after its last
        name (``LISTING_PAGE`` entries a page)."""
        with self._nodes_lock:
            page = self._pages.get(path)
        if page is not None:
            first, entries = page
            if first <= offset < first + len(entries) or (not entries and offset >= first):
                return page
        e = self._entry(path)
        if e.kind != "d":
            raise _Errno(errno.ENOTDIR, path)
        if offset < 2:
            first, entries = 0, [(b".", None), (b"..", None)]
            kids = self.index.listdir(e.path, limit=LISTING_PAGE, bad="keep")
        else:
            first, entries = offset, []
            after = None
            if page is not None and page[1] and offset == page[0] + len(page[1]) and \
                    page[1][-1][0] is not None:
                after = page[1][-1][0].decode()  # the next page, by name
                if after in (".", ".."):
                    after = None
            if after is not None:
                kids = self.index.listdir(e.path, after=after, limit=LISTING_PAGE,
                                          bad="keep")
            else:
                kids = self.index.listdir(e.path, offset=offset - 2, limit=LISTING_PAGE,
                                          bad="keep")
        for c in kids:
            if type(c) is BadEntry:
                log.warning("listing %s: the index is corrupt: %s", path, c.reason)
                entries.append((None if c.name is None else c.name.encode(), False))
                continue
            entries.append((c.path.rsplit("/", 1)[-1].encode(), self._stat(c)))
        page = (first, entries)
        with self._nodes_lock:
            self._pages[path] = page
            self._pages.move_to_end(path)
            if len(self._pages) > LISTING_FOLDERS:
                self._pages.popitem(last=False)
        return page

    @_op
    def access(self, path: str, amode: int) -> int:
        self._entry(path)
        if amode & os.W_OK:
            raise _Errno(errno.EROFS, path)
        return 0

    def open(self, path: str, flags: int) -> int:
        """ENOSYS: the kernel's sign to stop sending opens and releases for this mount (its
        ``no_open`` mode, kernel page cache kept). Only the first open of a mount gets here.
        The mount is ``ro``, so the kernel refuses an open for writing with EROFS itself; reads
        find a file's layout by path (a small cache of them)."""
        self.open_calls += 1
        raise _Errno(errno.ENOSYS, path)

    @_op
    def read(self, path: str, size: int, offset: int, fh: int = 0, into=None):
        """Up to ``size`` bytes at ``offset``, as bytes; or written into ``into`` (a writable
        buffer of at least ``size`` bytes: libfuse's own, so no copy is made here) and their
        count returned."""
        n = self._node(path)
        e = n.entry
        if e.kind != "f":
            raise _Errno(errno.EISDIR if e.kind == "d" else errno.ELOOP, path)
        end = min(offset + size, e.size)
        if into is None:
            buf = bytearray(max(0, end - offset))
            view = memoryview(buf)
        else:
            view = memoryview(into)
        pos = 0
        for seq, coff, k in pieces(n.segs, n.starts, offset, end):
            got = self.cache.read(seq, coff, k, into=view[pos:pos + k])
            if got != k:
                raise StoreError(f"chunk {seq} ends before {e.path}")
            pos += k
        return pos if into is not None else bytes(buf[:pos])

    @_op
    def statfs(self, path: str) -> dict:
        return {"f_bsize": 4096, "f_frsize": 4096, "f_blocks": (self.bytes + 4095) // 4096,
                "f_bfree": 0, "f_bavail": 0, "f_files": self.files + self.dirs,
                "f_ffree": 0, "f_favail": 0, "f_namemax": 255}

    @_op
    def getxattr(self, path: str, name: str, position: int = 0) -> bytes:
        if name == STATS_XATTR and path == "/":
            return json.dumps(self.stats(),
                              separators=(",", ":")).encode()
        self._entry(path)
        raise _Errno(errno.ENODATA, path)

    @_op
    def listxattr(self, path: str) -> list:
        self._entry(path)
        return []

    def init_with_config(self, conn, config) -> None:
        """Mounted and serving (a later non-zero exit is a signal's). Every listing is asked
        with READDIRPLUS, not only a folder's first piece (``FUSE_CAP_READDIRPLUS_AUTO`` off:
        the kernel's ``fuse_use_readdirplus``), and symlink targets stay in the page cache
        (``FUSE_CAP_CACHE_SYMLINKS``, Linux 4.20+); both only where the kernel offers them."""
        self.started = True
        if self.on_start is not None:
            self.on_start()
        if conn is not None:
            if conn.capable & _CAP_READDIRPLUS:
                conn.want = (conn.want | _CAP_READDIRPLUS) & ~_CAP_READDIRPLUS_AUTO
            if conn.capable & _CAP_CACHE_SYMLINKS:
                conn.want |= _CAP_CACHE_SYMLINKS

    def destroy(self, path: str) -> None:
        self.cache.close()

    # -- writing: never ---------------------------------------------------------------
    @_read_only
    def create(self, path, mode, fi=None): ...
    @_read_only
    def write(self, path, data, offset, fh): ...
    @_read_only
    def truncate(self, path, length, fh=None): ...
    @_read_only
    def mkdir(self, path, mode): ...
    @_read_only
    def mknod(self, path, mode, dev): ...
    @_read_only
    def rmdir(self, path): ...
    @_read_only
    def unlink(self, path): ...
    @_read_only
    def rename(self, old, new): ...
    @_read_only
    def link(self, target, source): ...
    @_read_only
    def symlink(self, target, source): ...
    @_read_only
    def chmod(self, path, mode): ...
    @_read_only
    def chown(self, path, uid, gid): ...
    @_read_only
    def utimens(self, path, times=None): ...
    @_read_only
    def setxattr(self, path, name, value, options, position=0): ...
    @_read_only
    def removexattr(self, path, name): ...
    @_read_only
    def fallocate(self, path, mode, offset, size, fh): ...


# -- mounting -----------------------------------------------------------------------------
def _mounted(mountpoint: str) -> bool:
    """Whether mountpoint is in /proc/mounts (read without touching the mount itself)."""
    try:
        with open("/proc/mounts") as f:
            for line in f:
                mp = line.split(" ")[1]
                mp = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), mp)
                if mp == mountpoint:
                    return True
    except OSError:
        pass
    return False


def mount_path(field: bytes) -> str:
    """A path field of ``/proc/self/mountinfo`` (octal escapes for space, tab, newline and
    backslash, proc(5)), decoded as file names are (``os.fsdecode``)."""
    return os.fsdecode(re.sub(rb"\\([0-7]{3})", lambda m: bytes([int(m.group(1), 8)]), field))


def top_mount(path: str) -> tuple[str, str] | None:
    """``(type, source)`` of the mount on top at absolute ``path`` (type ``"fuse.hyper"`` for
    a dataset mount of hypercli's, ``"erofs"``, ``"tmpfs"``...; the source decoded as
    :func:`mount_path`), read from ``/proc/self/mountinfo`` (proc(5)); None when nothing is
    mounted there."""
    top = None
    with open("/proc/self/mountinfo", "rb") as f:
        for line in f:
            fields = line.split()
            if mount_path(fields[4]) == path:
                top = fields[fields.index(b"-") + 1:]
    if top is None:
        return None
    return top[0].decode(errors="replace"), mount_path(top[1]) if len(top) > 1 else ""


def mount_type(path: str) -> str | None:
    """The type of the mount on top at absolute ``path`` (:func:`top_mount`), or None."""
    top = top_mount(path)
    return None if top is None else top[0]


def open_dataset(url: str, cache_dir: str | os.PathLike, *, endpoint_url: str | None = None
                 ) -> tuple:
    """(store, manifest, index) of the dataset at url, its index cached in
    ``cache_dir/index``.

    Raises:
        UsageError: a bad URL, or no dataset there.
        DatasetError: a corrupt manifest or index.
        StoreError: the store cannot be read.
    """
    import sqlite3

    from hypercli.mount.pack import DatasetError, fetch_index, load_manifest
    store = open_store(url, endpoint_url=endpoint_url)
    manifest = load_manifest(store)
    path = fetch_index(store, manifest, Path(cache_dir) / "index")
    try:
        index = Index(path)
    except (ValueError, sqlite3.DatabaseError) as e:
        raise DatasetError(f"{store.url}/{manifest['index']}: {e}") from None
    if [[sha, size] for _, sha, size in index.chunk_list] != \
            [list(c) for c in manifest["chunks"]]:
        raise DatasetError(f"{store.url}: the index names other chunks than the manifest")
    return store, manifest, index


def _check_mountpoint(mountpoint: str) -> None:
    if _mounted(mountpoint):
        raise UsageError(f"{mountpoint}: already a mount point",
                         f"`hyper data unmount {mountpoint}` first")
    if not os.path.isdir(mountpoint):
        raise UsageError(f"{mountpoint}: no such folder", "create the mount point first")


def mount(url: str, mountpoint: str | os.PathLike, *, cache_dir: str | os.PathLike,
          cache_bytes: int, endpoint_url: str | None = None, foreground: bool = True,
          min_free_bytes: int = GiB, prefetch: int = 2, jobs: int = 4,
          allow_other: bool = False, log_file: str | os.PathLike | None = None,
          timeout: float = 60.0, warm_entries: int = WARM_ENTRIES,
          server: str | None = None, serving_processes: int | None = None,
          store_chunks: bool = False) -> int:
    """Mount the dataset at ``url`` read-only at ``mountpoint``.

    Args:
        url: ``s3://bucket/prefix`` or ``file:///path`` of a pushed dataset.
        mountpoint: an existing folder (made absolute).
        cache_dir: folder for chunks, index and log (created; reused across mounts).
        cache_bytes: cap on cached chunk bytes; more are used only while every cached chunk
            is in use (see :class:`~hypercli.mount.cache.ChunkCache`).
        endpoint_url: S3-compatible endpoint (default ``$HYPER_S3_ENDPOINT_URL``).
        foreground: serve in this process until unmounted (SIGINT/SIGTERM unmount);
            False: start a daemon and return once the mount is up.
        min_free_bytes: free space to keep on cache_dir's disk (default 1 GiB).
        prefetch: chunks read ahead, in pack order, of a chunk's first read (0: off).
        jobs: background download threads.
        allow_other: let other users (containers) read the mount (kernel-checked modes).
        log_file: the daemon's log (default ``cache_dir/mount.log``).
        timeout: seconds to wait for the daemon's mount.
        warm_entries: entries listed as soon as the mount is up (:func:`warm`; 0: none); a
            daemon mount returns once they are and its read-ahead is raised
            (:func:`read_ahead`), a foreground one does both in a thread.
        server: what serves the mount: ``"mfusepy"`` (libfuse 3's high-level API, one
            process) or ``"low"`` (:mod:`hypercli.mount.fuselow`: the FUSE protocol read
            from ``/dev/fuse`` by ``serving_processes`` processes); default
            ``$HYPER_MOUNT_SERVER``, else ``DEFAULT_SERVER``.
        serving_processes: processes serving a ``"low"`` mount (≥ 1; default
            ``$HYPER_MOUNT_SERVING_PROCESSES``, else 1).
        store_chunks: a file's bytes in a chunk are pushed into the kernel's page cache at
            its first read there (:class:`hypercli.mount.fuselow.LowFS`; served by
            ``"low"`` whatever ``server`` says): for an image dataset's one file.
    Returns:
        0 after a foreground mount ends; the daemon's pid otherwise.
    Raises:
        UsageError: bad URL, no dataset, mount point missing or already mounted.
        DatasetError: a corrupt manifest or index.
        StoreError: the store cannot be read.
        InfraError: FUSE could not mount (the daemon's last log lines in the message).
    """
    mp = os.path.abspath(mountpoint)
    cache = Path(cache_dir).absolute()
    _check_mountpoint(mp)
    server = "low" if store_chunks else _server(server)
    if serving_processes is None:
        serving_processes = int(os.environ.get("HYPER_MOUNT_SERVING_PROCESSES") or 1)
    if server == "mfusepy":
        load_mfusepy()  # here, so a missing libfuse is one clear error, not the daemon's log
    store, _, index = open_dataset(url, cache, endpoint_url=endpoint_url)
    if foreground:
        if not logging.getLogger().handlers and not log.handlers:
            _log_to(sys.stderr)  # a foreground mount's reasons for EIO go to the terminal
        serve(store, index, mp, cache_dir=cache, cache_bytes=cache_bytes,
              min_free_bytes=min_free_bytes, prefetch=prefetch, jobs=jobs,
              allow_other=allow_other, warm_entries=warm_entries, server=server,
              serving_processes=serving_processes, store_chunks=store_chunks)
        return 0
    log_path = Path(log_file).absolute() if log_file else cache / "mount.log"
    cmd = [sys.executable, "-m", "hypercli.mount.fusefs", url, mp, "--cache-dir", str(cache),
           "--cache-bytes", str(int(cache_bytes)), "--min-free-bytes", str(int(min_free_bytes)),
           "--prefetch", str(prefetch), "--jobs", str(jobs), "--server", server,
           "--serving-processes", str(int(serving_processes))]
    if endpoint_url:
        cmd += ["--endpoint-url", endpoint_url]
    if allow_other:
        cmd.append("--allow-other")
    if store_chunks:
        cmd.append("--store-chunks")
    pkg_root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, FUSE_LIBRARY_NAME=os.environ.get("FUSE_LIBRARY_NAME", "fuse3"),
               PYTHONPATH=os.pathsep.join(filter(None, [pkg_root,
                                                        os.environ.get("PYTHONPATH")])))
    start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=env,
                                cwd="/", start_new_session=True)
    deadline = time.monotonic() + timeout
    while not _mounted(mp):
        if proc.poll() is not None or time.monotonic() > deadline:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            tail = _tail(log_path, start)
            raise InfraError(f"mounting {url} at {mp} failed: {tail or 'no reason logged'}",
                             f"the daemon's log is {log_path}")
        time.sleep(0.02)
    read_ahead(mp)
    if warm_entries > 0:
        warm(mp, warm_entries)
    return proc.pid


def read_ahead(mountpoint: str | os.PathLike, kib: int = READ_AHEAD_KIB) -> bool:
    """Raise the kernel's read-ahead of a mount to ``kib`` (never lower it): its backing
    device's ``/sys/class/bdi/MAJOR:MINOR/read_ahead_kb``. Returns whether it is at least
    ``kib`` now; False without the right to change it (not root), never raises."""
    try:
        dev = os.stat(mountpoint).st_dev
        path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
        with open(path) as f:
            if int(f.read()) >= kib:
                return True
        with open(path, "w") as f:
            f.write(str(kib))
        return True
    except (OSError, ValueError) as e:
        log.debug("read-ahead of %s left as it is: %s", mountpoint, e)
        return False


def warm(mountpoint: str | os.PathLike, limit: int = WARM_ENTRIES) -> int:
    """List a mount's folders, breadth first, until ``limit`` entries are listed; returns
    how many were (the kernel may have taken a few hundred more: it asks for a listing a
    buffer at a time). Each listing is a READDIRPLUS (see :func:`_fuse_class`), which leaves
    every entry's name and attributes in the kernel's caches for the life of the mount (the
    ``CACHE_TIMEOUT``), so the first open of a listed file sends no LOOKUP to the daemon.
    The kernel may reclaim them under memory pressure (then a LOOKUP asks again). Errors (an
    unreadable folder, a mount going away) end the walk; nothing is raised."""
    done, todo = 0, [os.path.abspath(mountpoint)]
    try:
        while todo and done < limit:
            nxt = []
            for folder in todo:
                with os.scandir(folder) as it:
                    for de in it:
                        done += 1
                        if de.is_dir(follow_symlinks=False):
                            nxt.append(de.path)
                        if done >= limit:
                            return done
            todo = nxt
    except OSError as e:
        log.info("warming %s stopped after %d entries: %s", mountpoint, done, e)
    return done


def _tail(path: Path, start: int, lines: int = 5) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return ""
    return " | ".join(text.strip().splitlines()[-lines:])


def load_mfusepy():
    """Import mfusepy, which loads libfuse 3 (``FUSE_LIBRARY_NAME``, default ``fuse3``).

    Raises:
        InfraError: mfusepy is not installed, or the FUSE library cannot be loaded (the hint
            names the package to install).
    """
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")
    try:
        import mfusepy
    except ImportError:
        raise InfraError("mounting needs the Python package mfusepy, which is not installed",
                         "`pip install mfusepy`, and libfuse 3 (Debian/Ubuntu: "
                         "`apt-get install fuse3`)") from None
    except OSError as e:
        raise InfraError(f"the FUSE library ({os.environ['FUSE_LIBRARY_NAME']}) cannot be "
                         f"loaded: {e}", "install libfuse 3: `apt-get install fuse3` "
                         "(Debian/Ubuntu; `dnf install fuse3` on Fedora)") from None
    return mfusepy


@functools.lru_cache(maxsize=None)
def _fuse_class(mfusepy):
    """mfusepy's FUSE, answering READDIRPLUS with every entry's attributes.

    The kernel asks for listings with READDIRPLUS (see :meth:`ChunkFS.init_with_config`);
    entries given with ``FUSE_FILL_DIR_PLUS`` and a whole ``struct stat`` become dentries and
    attributes in the kernel's caches for ``entry_timeout`` and ``attr_timeout`` (libfuse's
    high-level ``fill_dir_plus`` makes their nodes without asking ``getattr``), so reading the
    files of a listed folder costs no LOOKUP. mfusepy 3.1 passes only the mode (its
    ``readdir_fuse_3`` leaves this as a TODO). Entries go with their offsets (the next
    entry's position), a kernel buffer at a time: given all at offset 0, libfuse 3.14 keeps
    the listing itself and sends it with inode 0, which tells the kernel to drop the
    attributes (``readdir_fill_from_list`` in lib/fuse.c). libfuse 3.14 counts a lookup for
    the entry that does not fit in a buffer, which the kernel never forgets: one node of
    libfuse's (~100 bytes) per request is kept until unmount.
    """
    c_stat = mfusepy.c_stat
    fields = {f[0] for f in c_stat._fields_}
    if not {"st_atimespec", "st_mtimespec", "st_ctimespec"} <= fields:
        raise InfraError("this mfusepy's struct stat has no st_*timespec fields (a Linux "
                         "build of mfusepy 3 is needed)")

    class FUSE(mfusepy.FUSE):
        def read(self, path, buf, size, offset, fip):
            """Bytes go straight into libfuse's buffer (preadv from the chunk file), not
            through a bytes object copied in afterwards (mfusepy's ``read``)."""
            into = (ctypes.c_char * size).from_address(ctypes.addressof(buf.contents))
            return self.operations.read(path.decode(self.encoding, self.errors), size,
                                        offset, 0, into)

        def readdir_fuse_3(self, path, buf, filler, offset, fip, flags):
            if not flags & _READDIR_PLUS:
                return super().readdir_fuse_3(path, buf, filler, offset, fip, flags)
            ops = self.operations
            folder = path.decode(self.encoding, self.errors)
            st = c_stat()
            st.st_uid, st.st_gid = ops.uid, ops.gid
            times = (st.st_atimespec, st.st_mtimespec, st.st_ctimespec)
            while True:
                first, entries = ops.readdir_plus(folder, offset)
                if offset >= first + len(entries):
                    return 0  # past the end
                for i in range(offset - first, len(entries)):
                    name, t = entries[i]
                    offset = first + i + 1  # the next entry's offset
                    if t is None:  # . and ..: only the mode counts without FILL_DIR_PLUS
                        st.st_mode = stat.S_IFDIR
                        plus = 0
                    elif t is False:  # a bad entry: its name only (a stat of it is EIO)
                        if name is None:
                            continue  # no name to show; its place is kept
                        st.st_mode = 0
                        plus = 0
                    else:
                        st.st_mode, st.st_nlink, st.st_size, st.st_blocks, ns = t
                        sec, nsec = divmod(ns, 1_000_000_000)
                        for ts in times:
                            ts.tv_sec, ts.tv_nsec = sec, nsec
                        plus = _FILL_DIR_PLUS
                    if filler(buf, name, st, offset, plus) != 0:
                        return 0  # the kernel's buffer is full

    return FUSE


_READDIR_PLUS = 1    # enum fuse_readdir_flags: FUSE_READDIR_PLUS (libfuse 3 fuse.h)
_FILL_DIR_PLUS = 2   # enum fuse_fill_dir_flags: FUSE_FILL_DIR_PLUS
_CAP_READDIRPLUS = 1 << 13       # libfuse 3 fuse_common.h
_CAP_READDIRPLUS_AUTO = 1 << 14
_CAP_CACHE_SYMLINKS = 1 << 23


def _server(name: str | None) -> str:
    name = name or os.environ.get("HYPER_MOUNT_SERVER") or DEFAULT_SERVER
    if name not in SERVERS:
        raise UsageError(f"no mount server {name!r}", f"one of: {', '.join(SERVERS)}")
    return name


def serve(store, index: Index, mountpoint: str, *, cache_dir: str | os.PathLike,
          cache_bytes: int, min_free_bytes: int = GiB, prefetch: int = 2, jobs: int = 4,
          allow_other: bool = False, warm_entries: int = 0, server: str | None = None,
          serving_processes: int = 1, store_chunks: bool = False) -> None:
    """Serve an opened dataset at mountpoint in this process until it is unmounted.

    Chunks go to ``cache_dir/chunks``. Once the mount is up, a thread raises its read-ahead
    (:func:`read_ahead`) and lists ``warm_entries`` entries (:func:`warm`; 0: none).
    ``server``, ``serving_processes``, ``store_chunks``: as :func:`mount`. Raises InfraError
    when the mount fails.
    """
    if store_chunks or _server(server) == "low":
        from hypercli.mount import fuselow

        def started() -> None:
            read_ahead(mountpoint)
            if warm_entries > 0:
                warm(mountpoint, warm_entries)
        fuselow.serve(store, index, os.path.abspath(mountpoint), cache_dir=cache_dir,
                      cache_bytes=cache_bytes, min_free_bytes=min_free_bytes,
                      prefetch=prefetch, jobs=jobs, allow_other=allow_other,
                      processes=serving_processes, on_start=started,
                      store_chunks=store_chunks)
        return
    mfusepy = load_mfusepy()
    cache = ChunkCache(store, index.chunk_list, Path(cache_dir) / "chunks",
                       max_bytes=cache_bytes, min_free_bytes=min_free_bytes,
                       prefetch=prefetch, jobs=jobs)
    ops = ChunkFS(index, cache)
    opts = dict(foreground=True, ro=True, default_permissions=True, kernel_cache=True,
                entry_timeout=CACHE_TIMEOUT, attr_timeout=CACHE_TIMEOUT,
                negative_timeout=CACHE_TIMEOUT, max_idle_threads=MAX_IDLE_THREADS,
                max_threads=MAX_THREADS, subtype="hyper",
                fsname="hyper:" + store.url.replace(",", "_").replace(" ", "_"))
    if allow_other:
        opts["allow_other"] = True
    log.info("serving %s at %s (cache %s, cap %d bytes)", store.url, mountpoint, cache_dir,
             cache_bytes)
    def started() -> None:  # from another thread: this one answers the kernel's INIT
        read_ahead(mountpoint)
        if warm_entries > 0:
            warm(mountpoint, warm_entries)
    ops.on_start = lambda: threading.Thread(target=started, name="hyper-start",
                                            daemon=True).start()
    try:
        _fuse_class(mfusepy)(ops, os.path.abspath(mountpoint), **opts)
    except RuntimeError as e:  # libfuse's non-zero exit: failed to mount, or a signal ended it
        if not ops.started:
            raise InfraError(f"{mountpoint}: FUSE failed to mount {store.url} (libfuse "
                             f"exit {e})", "is /dev/fuse there, and fusermount3 installed?"
                             ) from None
        log.info("stopped by a signal")
    finally:
        cache.close()
    log.info("unmounted %s", mountpoint)


def unmount(mountpoint: str | os.PathLike, *, lazy: bool = False, timeout: float = 30) -> None:
    """Unmount a mount made by :func:`mount` (``fusermount3 -u``; ``-uz`` when lazy, which
    detaches it now and lets programs still using it finish). Its daemon then exits.

    Raises:
        UsageError: mountpoint is not mounted, or what is mounted on top there is no dataset
            mount of hypercli's (``fuse.hyper``).
        InfraError: fusermount3 failed (busy: a program still uses the mount).
    """
    mp = os.path.abspath(mountpoint)
    kind = mount_type(mp)
    if kind is None:
        raise UsageError(f"{mp}: not mounted")
    if kind != "fuse.hyper":  # fusermount3 run by root unmounts any file system
        raise UsageError(f"{mp}: a {kind} file system is mounted there, not a dataset mount "
                         "of hypercli's", "hypercli unmounts only what it mounted")
    try:
        r = subprocess.run(["fusermount3", "-uz" if lazy else "-u", mp], capture_output=True,
                           text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise InfraError(f"{mp}: fusermount3 failed: {e}") from None
    if r.returncode != 0:
        raise InfraError(f"{mp}: cannot unmount: {r.stderr.strip()}",
                         "close the programs using it, or unmount lazily")


def mount_stats(mountpoint: str | os.PathLike) -> dict:
    """The counters of a mount's chunk cache (:meth:`ChunkCache.stats`), read from the
    ``user.hypercli.stats`` extended attribute of its root.

    Raises:
        OSError: not a hypercli mount (ENODATA), or not reachable.
    """
    return json.loads(os.getxattr(os.path.abspath(mountpoint), STATS_XATTR))


def _log_to(stream, level: str | int = "INFO") -> None:
    logging.basicConfig(stream=stream, level=level,
                        format="%(asctime)s %(process)d %(levelname)s %(name)s: %(message)s")
    logging.getLogger("mfusepy").setLevel(logging.WARNING)
    logging.getLogger("botocore").setLevel(logging.WARNING)


def _main(argv: list[str] | None = None) -> int:
    """The daemon: ``python -m hypercli.mount.fusefs URL MOUNTPOINT --cache-dir D
    --cache-bytes N [...]``; logs to stderr; exit 0 after unmount, 1 on error."""
    p = argparse.ArgumentParser(prog="python -m hypercli.mount.fusefs")
    p.add_argument("url")
    p.add_argument("mountpoint")
    p.add_argument("--cache-dir", required=True)
    p.add_argument("--cache-bytes", type=int, required=True)
    p.add_argument("--min-free-bytes", type=int, default=GiB)
    p.add_argument("--prefetch", type=int, default=2)
    p.add_argument("--jobs", type=int, default=4)
    p.add_argument("--endpoint-url")
    p.add_argument("--allow-other", action="store_true")
    p.add_argument("--server", choices=SERVERS)
    p.add_argument("--serving-processes", type=int, default=1)
    p.add_argument("--store-chunks", action="store_true")
    p.add_argument("--log-level", default="INFO")
    a = p.parse_args(argv)
    _log_to(sys.stderr, a.log_level)
    try:
        mp = os.path.abspath(a.mountpoint)
        _check_mountpoint(mp)
        store, _, index = open_dataset(a.url, a.cache_dir, endpoint_url=a.endpoint_url)
        serve(store, index, mp, cache_dir=a.cache_dir, cache_bytes=a.cache_bytes,
              min_free_bytes=a.min_free_bytes, prefetch=a.prefetch, jobs=a.jobs,
              allow_other=a.allow_other, server=a.server,
              serving_processes=a.serving_processes, store_chunks=a.store_chunks)
    except Exception as e:  # HyperError or not: the parent shows the last log lines
        log.error("%s", e, exc_info=not hasattr(e, "exit_code"))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(_main())
