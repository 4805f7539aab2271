"""Serving a mounted dataset over the FUSE wire protocol itself, from one or more processes.

Source: the FUSE protocol as the kernel defines it, ``include/uapi/linux/fuse.h`` (protocol
7.31 is what this server speaks: ``struct fuse_in_header``, the opcodes, ``fuse_out_header``
and the structs of each request and reply), and libfuse 3's ``lib/mount.c`` for how
``fusermount3`` hands over the ``/dev/fuse`` descriptor (the ``_FUSE_COMMFD`` socket).

The same file system as :class:`hypercli.mount.fusefs.ChunkFS` (what a program sees is the
same: names, sizes, modes, mtimes, symlinks, bytes, errors), without libfuse's high-level
layer or ctypes callbacks: a request is one ``os.readv`` of ``/dev/fuse``, a struct unpack,
a handler and one ``os.writev`` of the reply. Rules:

- **Node ids are the index's.** The root is node 1; any other entry is its row's SQLite
  rowid + 2 (rows with a negative rowid are not served: EIO). The index file is immutable,
  so every answer (LOOKUP, GETATTR, READ, READDIRPLUS...) is computed from the index and the
  chunk cache alone, by any process: no table of nodes is shared or needed (each process
  keeps a bounded cache of the nodes it has read). FORGET has nothing to do.
- **Several serving processes** (``processes``): after INIT is answered, the daemon forks
  ``processes - 1`` children, each with its own clone of the descriptor
  (``FUSE_DEV_IOC_CLONE``: its own queue of requests being processed); the kernel hands
  each request to whichever process reads first, so serving grows with the cores given to
  it (each process has its own GIL).
- **One chunk cache, in the first process** (:class:`~hypercli.mount.cache.ChunkCache`: the
  cap, the checks, single flight, read-ahead, counters). A child that needs a chunk it does
  not hold asks the first process over a socket pair; the first process makes it resident
  and verified (downloading it at most once, whoever asks), opens it and sends the open
  descriptor back (``SCM_RIGHTS``). The child then reads the chunk with ``pread`` on that
  descriptor for as long as the chunk stays: a shared array holds a counter per chunk that
  the first process raises whenever it evicts (or drops) the chunk's file, and a child
  whose counter is out of date lets go of its descriptor and asks again. Chosen over file
  locks in the cache folder because the cap and the eviction order need one view of what is
  cached and used, which a lock per file does not give. What this loosens: a chunk a child
  is reading may be evicted under the read (the read still returns the right bytes through
  the open descriptor), and its disk space is freed when that child lets go — at its next
  read of that chunk or at its sweep (every ``SWEEP`` requests).
- **A read never waits in the loop.** A READ whose chunks are held and whose bytes are in the
  page cache (``preadv`` with ``RWF_NOWAIT``) is answered at once; one that needs a download,
  another process's help or the disk is handed to a thread, which asks the kernel to read the
  whole chunk ahead (``POSIX_FADV_WILLNEED``) and writes the reply when the bytes are there,
  while the loop goes on to the next request.
- **Pages pushed, for one large file** (``store_chunks``, an image dataset's mount): the
  first READ in a chunk has a thread of its own push the file's bytes in that chunk into
  the kernel's page cache (``FUSE_NOTIFY_STORE``), so later reads there never come here.
- **Answers**: INIT (READDIRPLUS always, symlinks cached, 1 MiB reads, async reads),
  LOOKUP (misses cached by the kernel for ``CACHE_TIMEOUT``), GETATTR, READLINK, READ,
  READDIR, READDIRPLUS, STATFS, GETXATTR/LISTXATTR (``user.hypercli.stats`` on the root:
  the cache's counters, summed over the processes), ACCESS; OPEN and OPENDIR answer ENOSYS
  (the kernel then sends neither for the life of the mount, and keeps each file's page
  cache across opens), FLUSH and FSYNC ENOSYS; FORGET, BATCH_FORGET and INTERRUPT get no
  reply; every kind of write is EROFS; any other opcode is ENOSYS. An entry not in the
  index is ENOENT, a chunk that cannot be served or a row that is not a well-formed entry
  EIO (its folder still lists it, without attributes), with the reason logged.

Mounted with ``fusermount3`` (as root or not), ``ro,nosuid,nodev,default_permissions``;
unmounted with ``fusermount3 -u``, which ends every serving process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import queue
import signal
import socket
import stat
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from hypercli.errors import InfraError
from hypercli.mount.cache import ChunkCache, ChunkError
from hypercli.mount.index import BadEntry, CorruptIndex, Index
from hypercli.mount.index import pieces as layout_pieces
from hypercli.mount.store import StoreError

log = logging.getLogger("hypercli.mount")

CACHE_TIMEOUT = 3600  # s the kernel keeps attributes, entries and misses (data is immutable)
NODES = 65536        # nodes (entry, layout) a process keeps; all dropped when full
AROUND = 256         # rows on each side of a node read with it from the index
LISTING_PAGE = 1024  # entries of a folder read from the index at once for READDIR(PLUS)
THREADS = 32         # threads per process for reads that wait (downloads, the first process)
SWEEP = 4096         # requests between a child's checks of the chunks it holds
BUFSIZE = (128 + 4) * 1024  # bytes read from /dev/fuse at once (requests are ≤ 4 KiB + max_write)
MINOR = 31           # protocol 7.31: has max_pages, cache_symlinks, no_opendir (fuse.h changelog)
MAX_PAGES = 256      # 4 KiB pages in a READ: 1 MiB
FUSE_DEV_IOC_CLONE = 0x8004E500  # _IOR(229, 0, uint32_t) (fuse.h)

# struct fuse_in_header / fuse_out_header
IN_HDR = struct.Struct("<IIQQIIIHH")
OUT_HDR = struct.Struct("<IiQ")
_ATTR = "QQQqqqIIIIIIIIII"  # struct fuse_attr (88 bytes; times as signed s)
ENTRY_OUT = struct.Struct("<QQQQII" + _ATTR)   # struct fuse_entry_out, 128 bytes
ATTR_OUT = struct.Struct("<QII" + _ATTR)       # struct fuse_attr_out, 104 bytes
STORE_OUT = struct.Struct("<QQII")  # struct fuse_notify_store_out: node, offset, size
NOTIFY_STORE = 4                    # enum fuse_notify_code: FUSE_NOTIFY_STORE
STORE_PIECE = 1 << 20               # bytes pushed into the page cache per message
STORE_AGAIN = 1.0                   # s before a READ in a stored chunk stores it again
READ_IN = struct.Struct("<QQI")                # fh, offset, size of struct fuse_read_in
DIRENT = struct.Struct("<QQII")                # struct fuse_dirent without its name
INIT_IN = struct.Struct("<IIII")
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH11H")  # struct fuse_init_out, 64 bytes
KSTATFS = struct.Struct("<QQQQQIIII6I")        # struct fuse_kstatfs, 80 bytes
XATTR_IN = struct.Struct("<II")                # struct fuse_getxattr_in
XATTR_OUT = struct.Struct("<II")               # struct fuse_getxattr_out

# opcodes (enum fuse_opcode)
LOOKUP, FORGET, GETATTR, READLINK = 1, 2, 3, 5
OPEN, READ, STATFS, RELEASE, FSYNC = 14, 15, 17, 18, 20
GETXATTR, LISTXATTR, FLUSH, INIT = 22, 23, 25, 26
OPENDIR, READDIR, RELEASEDIR, FSYNCDIR, ACCESS = 27, 28, 29, 30, 34
INTERRUPT, DESTROY, NOTIFY_REPLY, BATCH_FORGET, READDIRPLUS = 36, 38, 41, 42, 44
#: SETATTR SYMLINK MKNOD MKDIR UNLINK RMDIR RENAME LINK WRITE SETXATTR REMOVEXATTR CREATE
#: FALLOCATE RENAME2 COPY_FILE_RANGE TMPFILE: every kind of write
WRITES = frozenset({4, 6, 8, 9, 10, 11, 12, 13, 16, 21, 24, 35, 43, 45, 47, 51})
NO_REPLY = frozenset({FORGET, INTERRUPT, NOTIFY_REPLY, BATCH_FORGET})

# INIT flags (fuse.h)
ASYNC_READ, DO_READDIRPLUS, READDIRPLUS_AUTO = 1 << 0, 1 << 13, 1 << 14
PARALLEL_DIROPS, MAX_PAGES_FLAG, CACHE_SYMLINKS = 1 << 18, 1 << 22, 1 << 23
WANT = ASYNC_READ | DO_READDIRPLUS | PARALLEL_DIROPS | MAX_PAGES_FLAG | CACHE_SYMLINKS

#: names of the counted operations, as :class:`~hypercli.mount.fusefs.ChunkFS` names them
#: (a LOOKUP is counted under ``getattr``, as libfuse's high-level layer answers it)
OP_NAMES = {LOOKUP: "getattr", GETATTR: "getattr", READLINK: "readlink", READ: "read",
            READDIR: "readdir", READDIRPLUS: "readdir_plus", STATFS: "statfs",
            GETXATTR: "getxattr", LISTXATTR: "listxattr", ACCESS: "access", OPEN: "open",
            OPENDIR: "opendir"}
_STAT_OPS = sorted(set(OP_NAMES.values()))
_SLOT = 3 + 2 * len(_STAT_OPS)  # a process's counters: hits, misses, pid, (calls, ns) per op

_DEFERRED = object()  # a handler's answer: a thread will reply
_NONE = ()            # an empty reply (success, no payload)


class _Stopped(BaseException):
    """SIGTERM or SIGINT reached the serving loop of the first process."""


class _Errno(Exception):
    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class _Node:
    __slots__ = ("path", "entry", "starts", "segs")

    def __init__(self, path: str, entry, segs):
        self.path, self.entry, self.segs = path, entry, segs
        self.starts, pos = [], 0
        for _, _, n in segs:
            self.starts.append(pos)
            pos += n


# -- where chunk bytes come from -------------------------------------------------------------
class _Owned:
    """The first process's chunks: its :class:`ChunkCache`."""

    def __init__(self, cache: ChunkCache):
        self.cache = cache

    def fast(self, seq: int, off: int, n: int):
        """The bytes when the chunk is here and they are in the page cache, else None (never
        waits on a download, nor on the disk)."""
        return self.cache.read_nowait(seq, off, n)

    def slow(self, seq: int, off: int, n: int) -> bytes:
        if self.cache.ready(seq):  # on disk, not in the page cache: read it all ahead
            _read_ahead(seq, self.cache.dir / self.cache.seqs[seq])
        return self.cache.read(seq, off, n)


class _Lent:
    """A chunk's descriptor lent by the first process: its eviction count then, the readers
    using it now, and whether it was let go (closed once no reader uses it: a descriptor
    closed under a reader could be reused by the next open, and the reader would read
    another file)."""

    __slots__ = ("gen", "fd", "refs", "retired")

    def __init__(self, gen: int, fd: int):
        self.gen, self.fd, self.refs, self.retired = gen, fd, 1, False


class _Borrowed:
    """A child's chunks: descriptors lent by the first process (see the module docstring).

    Args:
        sock: this child's end of its SOCK_SEQPACKET pair with the first process.
        gens: the shared array of eviction counters, one per chunk.
        counters: this process's slot of the shared counters (hits at 0, misses at 1).
    """

    def __init__(self, sock: socket.socket, gens, counters):
        self.sock, self.gens, self.ctr = sock, gens, counters
        self.held: dict[int, _Lent] = {}
        self._lock = threading.Lock()
        self._waiting: dict[int, list] = {}  # request id → [event, answer]
        self._next = 0
        self._receiver: threading.Thread | None = None

    def fast(self, seq: int, off: int, n: int):
        with self._lock:
            h = self.held.get(seq)
            if h is None or self.gens[seq] != h.gen:
                return None
            h.refs += 1
        try:
            buf = bytearray(n)
            try:  # never waits on the disk: bytes not in the page cache go to a thread
                if os.preadv(h.fd, [buf], off, os.RWF_NOWAIT) != n:
                    return None
            except OSError:  # EAGAIN, or a file ending short (the slow path tells which)
                return None
        finally:
            self._unref(h)
        self.ctr[0] += 1
        return buf

    def slow(self, seq: int, off: int, n: int) -> bytes:
        for _ in range(2):
            h = self._borrow(seq)
            try:
                _read_ahead(seq, h.fd)
                data = os.pread(h.fd, n, off)
            finally:
                self._unref(h)
            if len(data) == n:
                return data
            with self._lock:
                self._retire(seq, h)
        raise ChunkError(f"chunk {seq}: the cached copy keeps coming back short")

    def _borrow(self, seq: int) -> _Lent:
        """The chunk's descriptor, a reference taken (:meth:`_unref` it)."""
        with self._lock:
            h = self.held.get(seq)
            if h is not None and self.gens[seq] == h.gen:
                h.refs += 1
                return h
        status, gen, payload, fds = self.ask(b"C", seq)
        if status:
            for fd in fds:
                os.close(fd)
            raise ChunkError(payload.decode(errors="replace") or os.strerror(status))
        h = _Lent(gen, fds[0])
        with self._lock:
            self.ctr[1] += 1
            old = self.held.get(seq)
            self.held[seq] = h
            if old is not None:
                self._retire(seq, old)
        return h

    def _unref(self, h: _Lent) -> None:
        with self._lock:
            h.refs -= 1
            if h.retired and h.refs == 0:
                os.close(h.fd)

    def _retire(self, seq: int, h: _Lent) -> None:  # under the lock
        if self.held.get(seq) is h:
            del self.held[seq]
        if not h.retired:
            h.retired = True
            if h.refs == 0:
                os.close(h.fd)

    def sweep(self) -> None:
        """Let go of every chunk the first process has evicted since it lent it."""
        with self._lock:
            for seq, h in list(self.held.items()):
                if self.gens[seq] != h.gen:
                    self._retire(seq, h)

    def ask(self, kind: bytes, seq: int = 0) -> tuple[int, int, bytes, list[int]]:
        """Send a request to the first process and wait for its answer: (errno or 0, the
        chunk's eviction count, payload, descriptors)."""
        with self._lock:
            if self._receiver is None:
                self._receiver = threading.Thread(target=self._receive, daemon=True,
                                                  name="hyper-borrow")
                self._receiver.start()
            self._next += 1
            rid = self._next
            slot = self._waiting[rid] = [threading.Event(), None]
        self.sock.send(struct.pack("<cII", kind, rid, seq))
        slot[0].wait()
        if slot[1] is None:
            raise ChunkError("the mount's first process is gone")
        return slot[1]

    def _receive(self) -> None:
        while True:
            try:
                msg, fds, _, _ = socket.recv_fds(self.sock, 1 << 22, 1)
            except OSError:
                msg, fds = b"", []
            if len(msg) < 16:
                with self._lock:
                    for slot in self._waiting.values():
                        slot[0].set()
                    self._waiting.clear()
                return
            rid, status, gen = struct.unpack_from("<IiQ", msg)
            with self._lock:
                slot = self._waiting.pop(rid, None)
            if slot is None:
                for fd in fds:
                    os.close(fd)
                continue
            slot[1] = (status, gen, msg[16:], fds)
            slot[0].set()


_AHEAD: dict[int, float] = {}  # chunk seq → time.monotonic() of its last read-ahead


def _read_ahead(seq: int, file) -> None:
    """Ask the kernel to read a whole cached chunk into the page cache in the background
    (``POSIX_FADV_WILLNEED``), at most once a second per chunk: a READ missed the page cache
    (a dataset larger than memory, or the cache dropped), and the reads that follow are most
    likely in the same chunk. ``file``: its path or an open descriptor."""
    now = time.monotonic()
    if now - _AHEAD.get(seq, -2.0) < 1.0:
        return
    _AHEAD[seq] = now
    try:
        fd = file if isinstance(file, int) else os.open(file, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        finally:
            if fd is not file:
                os.close(fd)
    except OSError as e:
        log.debug("read-ahead of chunk %d: %s", seq, e)


# -- the file system -------------------------------------------------------------------------
class LowFS:
    """Answers FUSE requests of one dataset (see the module docstring).

    Args:
        index: the dataset's :class:`~hypercli.mount.index.Index`.
        chunks: where chunk bytes come from (``_Owned`` or ``_Borrowed``).
        stats: a function returning the mount's counters as a dict (the stats xattr).
        counters: this process's slot of the shared counters (a ``memoryview`` of uint64).
        uid, gid: owner reported for every entry (default: this process's).
        store_chunks: the first READ of a file's bytes in a chunk has a thread push all of
            that file's bytes in the chunk into the kernel's page cache (FUSE_NOTIFY_STORE),
            again when a READ shows some of them were dropped (at most once a second per
            chunk): for one large file read at random places (an image dataset's, see
            :mod:`hypercli.mount.image`), so that its reads after the first in a chunk never
            reach this process.
    :meth:`handle` answers one request (bytes as read from ``/dev/fuse``) and is what the
    serving loop and the tests call.
    """

    def __init__(self, index: Index, chunks, *, stats, counters, uid: int | None = None,
                 gid: int | None = None, store_chunks: bool = False):
        self.index, self.chunks, self._stats, self.ctr = index, chunks, stats, counters
        self.uid = os.getuid() if uid is None else uid
        self.gid = os.getgid() if gid is None else gid
        self.files, self.dirs, self.bytes = index.count()
        found = index.lookup_id("")
        if found is None:
            raise CorruptIndex("the index has no root folder")
        self.root_rowid = found[0]
        self.nodes: dict[int, _Node] = {1: _Node("", found[1], [])}
        self.pages: dict[int, tuple[int, list]] = {}  # folder node → its last listing page
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="hyper-read")
        self.fd = -1
        self._slow_lock = threading.Lock()
        self.store_chunks = store_chunks
        self._stored: dict[tuple[int, int], float] = {}  # (node, chunk) → when last stored
        self._store_q: queue.SimpleQueue = queue.SimpleQueue()
        if store_chunks:
            threading.Thread(target=self._storer, daemon=True, name="hyper-store").start()
        self._ops = {op: 3 + 2 * _STAT_OPS.index(name) for op, name in OP_NAMES.items()}
        self.ctr[2] = os.getpid()
        self._handlers = {
            LOOKUP: self._lookup, GETATTR: self._getattr, READLINK: self._readlink,
            READ: self._read, READDIR: self._readdir, READDIRPLUS: self._readdirplus,
            STATFS: self._statfs, GETXATTR: self._getxattr, LISTXATTR: self._listxattr,
            ACCESS: self._access, OPEN: self._no_open, OPENDIR: self._no_open,
            RELEASE: self._ok, RELEASEDIR: self._ok,
            DESTROY: self._ok}

    # -- requests ----------------------------------------------------------------------
    def handle(self, req) -> tuple[int, list] | None:
        """Answer one request: (errno or 0, reply payload parts), or None when no reply is
        due (FORGET, INTERRUPT...) or a thread will reply (a read that waits)."""
        length, op, unique, nid = IN_HDR.unpack_from(req)[:4]
        if op in NO_REPLY:
            return None
        h = self._handlers.get(op)
        if h is None:
            return (errno.EROFS if op in WRITES else errno.ENOSYS), []
        i = self._ops.get(op)
        t0 = time.perf_counter_ns()
        try:
            out = h(unique, nid, req[IN_HDR.size:length])
            if out is _DEFERRED:
                return None
            return 0, out
        except _Errno as e:
            return e.code, []
        except Exception as e:
            return self._failed(op, nid, e), []
        finally:
            if i is not None:
                self.ctr[i] += 1
                self.ctr[i + 1] += time.perf_counter_ns() - t0

    def _failed(self, op: int, nid: int, e: Exception) -> int:
        if isinstance(e, CorruptIndex):
            log.warning("opcode %d, node %d: the index is corrupt: %s", op, nid, e)
        elif isinstance(e, StoreError):
            log.warning("opcode %d, node %d: %s", op, nid, e)
        else:
            log.error("opcode %d, node %d failed", op, nid, exc_info=e)
        return errno.EIO

    def reply(self, unique: int, err: int, parts) -> None:
        """Write one reply to ``/dev/fuse`` (ENOENT from the kernel: the request was
        interrupted, and the reply is not wanted)."""
        size = OUT_HDR.size + sum(len(p) for p in parts)
        try:
            os.writev(self.fd, [OUT_HDR.pack(size, -err, unique), *parts])
        except OSError as e:
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.warning("reply to request %d: %s", unique, e)

    # -- nodes -------------------------------------------------------------------------
    def _node(self, nid: int) -> _Node:
        n = self.nodes.get(nid)
        if n is not None:
            return n
        rowid = nid - 2
        if not 0 <= rowid < 1 << 63 or rowid == self.root_rowid:
            raise _Errno(errno.ENOENT)
        # the rows around it too, in one query: the next files a reader opens are most
        # often its neighbours (same folder, pack order), and each costs a query alone
        for r, e, segs in self.index.by_ids(max(0, rowid - AROUND), rowid + AROUND):
            if r != self.root_rowid:
                self._keep(r + 2, e, segs)
        n = self.nodes.get(nid)
        if n is not None:
            return n
        found = self.index.by_id(rowid)  # not well-formed (CorruptIndex), or not there
        if found is None:
            raise _Errno(errno.ENOENT)
        return self._keep(nid, found[0], found[1])

    def _keep(self, nid: int, entry, segs) -> _Node:
        if len(self.nodes) >= NODES:
            root = self.nodes[1]
            self.nodes = {1: root}
        n = self.nodes[nid] = _Node(entry.path, entry, segs)
        return n

    def _nid(self, rowid: int) -> int:
        if rowid < 0:
            raise CorruptIndex(f"row {rowid}: a negative rowid is not served")
        return rowid + 2

    def _attr(self, nid: int, e) -> tuple:
        sec, nsec = divmod(int(round(e.mtime * 1e9)), 1_000_000_000)
        return (nid, e.size, (e.size + 511) // 512, sec, sec, sec, nsec, nsec, nsec, e.mode,
                2 if e.kind == "d" else 1, self.uid, self.gid, 0, 0, 0)

    def _entry_out(self, nid: int, e) -> bytes:
        return ENTRY_OUT.pack(nid, 0, CACHE_TIMEOUT, CACHE_TIMEOUT, 0, 0,
                              *self._attr(nid, e))

    # -- handlers ----------------------------------------------------------------------
    def _ok(self, unique, nid, body):
        return _NONE

    def _no_open(self, unique, nid, body):
        """ENOSYS: the kernel's sign to send no more OPEN (OPENDIR) nor RELEASE for this
        mount, keeping each file's page cache across opens (``no_open``, Linux 4.19+)."""
        raise _Errno(errno.ENOSYS)

    def _lookup(self, unique, nid, body):
        parent = self._node(nid)
        if parent.entry.kind != "d":
            raise _Errno(errno.ENOTDIR)
        raw = bytes(body).split(b"\0", 1)[0]
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            name = None
        found = None if name is None else self.index.lookup_id(
            f"{parent.path}/{name}" if parent.path else name)
        if found is None:  # a miss the kernel keeps for CACHE_TIMEOUT (node id 0)
            return [_NEGATIVE]
        rowid, e, segs = found
        child = self._nid(rowid)
        self._keep(child, e, segs)
        return [self._entry_out(child, e)]

    def _getattr(self, unique, nid, body):
        n = self._node(nid)
        return [ATTR_OUT.pack(CACHE_TIMEOUT, 0, 0, *self._attr(nid, n.entry))]

    def _readlink(self, unique, nid, body):
        e = self._node(nid).entry
        if e.kind != "l":
            raise _Errno(errno.EINVAL)
        return [e.target.encode()]

    def _access(self, unique, nid, body):
        self._node(nid)
        if XATTR_IN.unpack_from(body)[0] & os.W_OK:
            raise _Errno(errno.EROFS)
        return _NONE

    def _statfs(self, unique, nid, body):
        return [KSTATFS.pack((self.bytes + 4095) // 4096, 0, 0, self.files + self.dirs, 0,
                             4096, 255, 4096, 0, *([0] * 6))]

    def _getxattr(self, unique, nid, body):
        size = XATTR_IN.unpack_from(body)[0]
        name = bytes(body[XATTR_IN.size:]).split(b"\0", 1)[0]
        if nid == 1 and name == b"user.hypercli.stats":
            value = json.dumps(self._stats(), separators=(",", ":")).encode()
        else:
            self._node(nid)
            raise _Errno(errno.ENODATA)
        if size == 0:
            return [XATTR_OUT.pack(len(value), 0)]
        if len(value) > size:
            raise _Errno(errno.ERANGE)
        return [value]

    def _listxattr(self, unique, nid, body):
        self._node(nid)
        return [XATTR_OUT.pack(0, 0)] if XATTR_IN.unpack_from(body)[0] == 0 else _NONE

    def _read(self, unique, nid, body):
        _, offset, size = READ_IN.unpack_from(body)
        n = self._node(nid)
        e = n.entry
        if e.kind != "f":
            raise _Errno(errno.EISDIR if e.kind == "d" else errno.EINVAL)
        end = min(offset + size, e.size)
        pieces = layout_pieces(n.segs, n.starts, offset, end)
        parts = []
        fast = self.chunks.fast
        if self.store_chunks:
            now = time.monotonic()
            for seq, _, _ in pieces:
                if now - self._stored.get((nid, seq), -STORE_AGAIN) >= STORE_AGAIN:
                    self._stored[(nid, seq)] = now
                    self._store_q.put((nid, seq))
        for seq, off, k in pieces:
            data = fast(seq, off, k)
            if data is None:  # not held: a thread waits for it, the loop goes on
                self.pool.submit(self._read_slow, unique, nid, pieces)
                return _DEFERRED
            if len(data) != k:
                raise StoreError(f"chunk {seq} ends before {e.path}")
            parts.append(data)
        return parts

    def _read_slow(self, unique: int, nid: int, pieces) -> None:
        t0 = time.perf_counter_ns()
        try:
            parts = []
            for seq, off, k in pieces:
                data = self.chunks.slow(seq, off, k)
                if len(data) != k:
                    raise StoreError(f"chunk {seq} ends before node {nid}'s end")
                parts.append(data)
            err = 0
        except Exception as e:
            err, parts = self._failed(READ, nid, e), []
        self.reply(unique, err, parts)
        i = self._ops[READ]
        with self._slow_lock:
            self.ctr[i + 1] += time.perf_counter_ns() - t0

    def _storer(self) -> None:
        """The store thread (``store_chunks``): one (node, chunk) at a time, from a queue.
        Its own thread, never the READ pool: a store waits on the kernel's lock of any page
        a READ not yet answered is filling, and that READ's answer must not wait on it."""
        while True:
            nid, seq = self._store_q.get()
            try:
                self._store(nid, seq)
            except Exception as e:  # a chunk that fails its check: its READs say EIO
                log.warning("node %d, chunk %d not stored in the page cache: %s", nid, seq, e)

    def _store(self, nid: int, seq: int) -> None:
        """Push node ``nid``'s bytes in chunk ``seq`` into the kernel's page cache
        (FUSE_NOTIFY_STORE, ``STORE_PIECE`` bytes a message; fuse.h's ``struct
        fuse_notify_store_out``), as checked by the chunk cache. At most the chunk's size
        in all: a file's bytes in a chunk fit in it, and an index naming the same bytes of a
        chunk again and again must not make one READ fill the page cache with more."""
        n = self._node(nid)
        left = self.index.chunk_list[seq][2]
        for (s, coff, length), start in zip(n.segs, n.starts):
            if s != seq:
                continue
            length = min(length, left)
            left -= length
            if length <= 0:
                return
            for k in range(0, length, STORE_PIECE):
                m = min(STORE_PIECE, length - k)
                data = self.chunks.slow(seq, coff + k, m)
                if len(data) != m:
                    raise StoreError(f"chunk {seq} ends before node {nid}'s bytes in it")
                try:
                    os.writev(self.fd, [OUT_HDR.pack(OUT_HDR.size + STORE_OUT.size + m,
                                                     NOTIFY_STORE, 0),
                                        STORE_OUT.pack(nid, start + k, m, 0), data])
                except OSError as e:  # ENOENT: the kernel has forgotten the node
                    log.debug("node %d at %d not stored: %s", nid, start + k, e)
                    return

    def _listing(self, nid: int, n: _Node, offset: int) -> tuple[int, list]:
        """A page of a folder's listing holding position ``offset`` (0 ``.``, 1 ``..``, then
        the children by name): (position of its first item, [(name bytes or None, node id,
        entry or None for . and .., False for a bad row)])."""
        page = self.pages.get(nid)
        if page is not None:
            first, items = page
            if first <= offset < first + len(items) or (not items and offset >= first):
                return page
        if offset < 2:
            first, items = 0, [(b".", nid, None), (b"..", 1, None)]
            kids = self.index.listdir(n.path, limit=LISTING_PAGE, bad="keep", ids=True)
        else:
            first, items = offset, []
            after = None
            if page is not None and page[1] and offset == page[0] + len(page[1]) and \
                    page[1][-1][0] not in (None, b".", b".."):
                after = page[1][-1][0].decode()
            if after is not None:
                kids = self.index.listdir(n.path, after=after, limit=LISTING_PAGE,
                                          bad="keep", ids=True)
            else:
                kids = self.index.listdir(n.path, offset=offset - 2, limit=LISTING_PAGE,
                                          bad="keep", ids=True)
        for rowid, c in kids:
            if type(c) is BadEntry or rowid is None or type(rowid) is not int or rowid < 0:
                reason = c.reason if type(c) is BadEntry else f"row {rowid!r} not served"
                log.warning("listing %r: the index is corrupt: %s", n.path, reason)
                name = c.name if type(c) is BadEntry else c.path.rsplit("/", 1)[-1]
                items.append((None if name is None else name.encode(),
                              rowid + 2 if type(rowid) is int and rowid >= 0 else 0, False))
                continue
            items.append((c.path.rsplit("/", 1)[-1].encode(), rowid + 2, c))
        page = (first, items)
        if len(self.pages) >= 64:
            self.pages.clear()
        self.pages[nid] = page
        return page

    def _readdir(self, unique, nid, body):
        return self._dirents(nid, body, plus=False)

    def _readdirplus(self, unique, nid, body):
        return self._dirents(nid, body, plus=True)

    def _dirents(self, nid: int, body, plus: bool) -> list:
        """Entries of a folder from position ``offset`` that fit in ``size`` bytes, each
        (``plus``) with its attributes and node id: a ``struct fuse_direntplus`` (a bad row:
        node id 0, which the kernel takes as "no attributes given"), else a ``struct
        fuse_dirent``; each with the position of the entry after it."""
        _, offset, size = READ_IN.unpack_from(body)
        n = self._node(nid)
        if n.entry.kind != "d":
            raise _Errno(errno.ENOTDIR)
        out, used = [], 0
        while True:
            first, items = self._listing(nid, n, offset)
            if offset >= first + len(items):
                return out
            for i in range(offset - first, len(items)):
                name, child, e = items[i]
                pos = first + i + 1
                if name is None:  # a bad row without a name to show: its place is kept
                    offset = pos
                    continue
                if e is None:
                    typ = stat.S_IFDIR >> 12
                else:
                    typ = (e.mode & 0o170000) >> 12 if e else 0
                rec = DIRENT.pack(child, pos, len(name), typ) + name + \
                    b"\0" * ((-len(name)) % 8)
                if plus:
                    if e:
                        if e.kind != "f":  # a file's layout is read at its first READ
                            self._keep(child, e, [])
                        rec = self._entry_out(child, e) + rec
                    else:
                        rec = _NO_ENTRY + rec
                if used + len(rec) > size:
                    return out
                out.append(rec)
                used += len(rec)
                offset = pos


_NEGATIVE = ENTRY_OUT.pack(0, 0, CACHE_TIMEOUT, 0, 0, 0, *([0] * 16))
_NO_ENTRY = ENTRY_OUT.pack(0, 0, 0, 0, 0, 0, *([0] * 16))


# -- serving ---------------------------------------------------------------------------------
def loop(fs: LowFS, fd: int, sweep=None) -> None:
    """Answer requests read from ``fd`` until the mount goes (ENODEV) or DESTROY.
    ``sweep``: called every ``SWEEP`` requests."""
    fs.fd = fd
    buf = bytearray(BUFSIZE)
    view = memoryview(buf)
    handle, reply, k = fs.handle, fs.reply, 0
    while True:
        try:
            n = os.readv(fd, [buf])
        except OSError as e:
            if e.errno in (errno.EINTR, errno.ENOENT, errno.EAGAIN):
                continue
            if e.errno == errno.ENODEV:
                return  # unmounted
            raise
        out = handle(view[:n])
        if out is not None:
            reply(IN_HDR.unpack_from(buf)[2], out[0], out[1])
            if IN_HDR.unpack_from(buf)[1] == DESTROY:
                return
        k += 1
        if sweep is not None and k % SWEEP == 0:
            sweep()


def fuse_mount(mountpoint: str, fsname: str, *, allow_other: bool = False) -> int:
    """Mount a FUSE file system at ``mountpoint`` with ``fusermount3`` (as libfuse's
    ``fuse_mount_fusermount`` does: a socket pair, its end's number in ``_FUSE_COMMFD``, the
    ``/dev/fuse`` descriptor received over it) and return that descriptor. Options:
    ``ro,nosuid,nodev,default_permissions``, ``fsname``, ``subtype=hyper``.

    Raises:
        InfraError: fusermount3 is missing or refused (its message in ours).
    """
    opts = ("ro,nosuid,nodev,default_permissions,subtype=hyper,fsname="
            + fsname.replace(",", "_").replace(" ", "_").replace("\\", "_"))
    if allow_other:
        opts += ",allow_other"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        env = dict(os.environ, _FUSE_COMMFD=str(theirs.fileno()))
        try:
            proc = subprocess.Popen(["fusermount3", "-o", opts, "--", mountpoint],
                                    env=env, pass_fds=[theirs.fileno()],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE)
        except OSError as e:
            raise InfraError(f"{mountpoint}: cannot run fusermount3: {e}",
                             "install fuse3 (Debian/Ubuntu: `apt-get install fuse3`)") from None
        theirs.close()
        try:
            _, fds, _, _ = socket.recv_fds(ours, 1, 1)
        except OSError:
            fds = []
        _, err = proc.communicate(timeout=60)
        if not fds:
            raise InfraError(f"{mountpoint}: fusermount3 failed: "
                             f"{err.decode(errors='replace').strip() or proc.returncode}",
                             "is /dev/fuse there, and the mount point an empty folder?")
        for fd in fds[1:]:
            os.close(fd)
        os.set_inheritable(fds[0], False)
        return fds[0]
    finally:
        ours.close()
        if theirs.fileno() >= 0:
            theirs.close()


def answer_init(fd: int) -> dict:
    """Read the kernel's INIT from ``fd`` and answer it: protocol 7.``MINOR`` (or the
    kernel's, when older), the ``WANT`` flags the kernel offers, its read-ahead kept (raised
    later through sysfs, see :func:`hypercli.mount.fusefs.read_ahead`), ``MAX_PAGES``.
    Returns what was agreed ({"minor", "flags", "max_readahead"}).

    Raises:
        InfraError: the first request is not INIT, or of a protocol major other than 7.
    """
    buf = bytearray(BUFSIZE)
    while True:
        try:
            n = os.readv(fd, [buf])
            break
        except InterruptedError:
            continue
    length, op, unique = IN_HDR.unpack_from(buf)[:3]
    if op != INIT or n < IN_HDR.size + INIT_IN.size:
        raise InfraError(f"the kernel's first FUSE request is opcode {op}, not INIT")
    major, minor, readahead, flags = INIT_IN.unpack_from(buf, IN_HDR.size)
    if major != 7:
        os.writev(fd, [OUT_HDR.pack(OUT_HDR.size, -errno.EPROTO, unique)])
        raise InfraError(f"the kernel speaks FUSE {major}.{minor}; this mount speaks 7.x")
    agreed = {"minor": min(minor, MINOR), "flags": flags & WANT, "max_readahead": readahead}
    out = INIT_OUT.pack(7, agreed["minor"], readahead, agreed["flags"], 64, 48, 4096, 1,
                        MAX_PAGES, 0, 0, 0, 0, *([0] * 11))
    os.writev(fd, [OUT_HDR.pack(OUT_HDR.size + len(out), 0, unique), out])
    return agreed


def _clone(fd: int) -> int:
    """A clone of the /dev/fuse descriptor ``fd`` (its own queue of requests in process);
    ``fd`` itself when the kernel refuses."""
    new = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.ioctl(new, FUSE_DEV_IOC_CLONE, struct.pack("I", fd))
        return new
    except OSError as e:
        log.warning("FUSE_DEV_IOC_CLONE refused (%s): this process reads the first queue", e)
        os.close(new)
        return fd


class _Shared:
    """Memory shared by the serving processes (made before they fork): an eviction counter
    per chunk, and each process's counters (a slot of ``_SLOT`` uint64s)."""

    def __init__(self, chunks: int, processes: int):
        import mmap
        self._gens = mmap.mmap(-1, 8 * max(1, chunks))
        self._ctr = mmap.mmap(-1, 8 * _SLOT * processes)
        self.gens = memoryview(self._gens).cast("Q")
        self.counters = memoryview(self._ctr).cast("Q")
        self.processes = processes

    def slot(self, i: int):
        return self.counters[i * _SLOT:(i + 1) * _SLOT]

    def totals(self) -> tuple[int, int, dict, list]:
        """(hits, misses, {op: {"calls", "us"}}, [{"pid", "requests"}]) summed over the
        processes (the list: each process's pid and the requests it answered)."""
        hits = misses = 0
        ops, serving = {}, []
        for i in range(self.processes):
            c = self.slot(i)
            hits += c[0]
            misses += c[1]
            answered = 0
            for j, name in enumerate(_STAT_OPS):
                calls, ns = c[3 + 2 * j], c[4 + 2 * j]
                answered += calls
                if calls:
                    o = ops.setdefault(name, {"calls": 0, "us": 0})
                    o["calls"] += calls
                    o["us"] += round(ns / 1000)
            serving.append({"pid": c[2], "requests": answered})
        return hits, misses, ops, serving


def _lend(cache: ChunkCache, shared: _Shared, sock: socket.socket, send_lock, pool) -> None:
    """The first process's side of one child's socket: lend chunks, give the counters."""
    def chunk(rid: int, seq: int) -> None:
        try:
            cache.drop_if_short(seq)  # the child asks again when the one lent came back short
            path = cache.acquire(seq)
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
                gen = shared.gens[seq]  # read while held: not evicted before release
            finally:
                cache.release(seq)
            try:
                with send_lock:
                    socket.send_fds(sock, [struct.pack("<IiQ", rid, 0, gen)], [fd])
            finally:
                os.close(fd)
        except Exception as e:  # ChunkError (logged by the cache), an OSError
            why = str(e).encode()[:4000]
            with send_lock:
                sock.send(struct.pack("<IiQ", rid, errno.EIO, 0) + why)

    def stats(rid: int) -> None:
        with send_lock:
            sock.send(struct.pack("<IiQ", rid, 0, 0) + json.dumps(_stats_of(
                cache, shared), separators=(",", ":")).encode())

    while True:
        try:
            msg = sock.recv(64)
        except OSError:
            return
        if len(msg) < 9:
            return  # the child is gone
        kind, rid, seq = struct.unpack_from("<cII", msg)
        try:
            pool.submit(chunk if kind == b"C" else stats, rid, *((seq,) if kind == b"C"
                                                                  else ()))
        except RuntimeError:
            return


def _stats_of(cache: ChunkCache, shared: _Shared) -> dict:
    s = cache.stats()
    hits, misses, ops, serving = shared.totals()
    s["hits"] += hits
    s["misses"] += misses
    return dict(s, open_calls=ops.get("open", {}).get("calls", 0), ops=ops,
                serving_processes=shared.processes, serving=serving)


def serve(store, index: Index, mountpoint: str, *, cache_dir, cache_bytes: int,
          min_free_bytes: int, prefetch: int = 2, jobs: int = 4, allow_other: bool = False,
          warm_entries: int = 0, processes: int = 1, on_start=None,
          store_chunks: bool = False) -> None:
    """Mount an opened dataset at ``mountpoint`` and serve it with ``processes`` processes
    (this one and ``processes - 1`` forked children) until it is unmounted.

    Args:
        store, index: the dataset (:func:`hypercli.mount.fusefs.open_dataset`).
        cache_dir: chunks go to ``cache_dir/chunks``.
        cache_bytes, min_free_bytes, prefetch, jobs: as :class:`ChunkCache` (bytes, count).
        processes: serving processes, ≥ 1.
        on_start: called (in a thread of this process) once the kernel's INIT is answered.
        store_chunks: push whole chunk pieces of a file into the page cache (:class:`LowFS`).
    Raises:
        InfraError: fusermount3 failed, or the kernel's INIT could not be answered.
    SIGTERM and SIGINT unmount (``fusermount3 -uz``): every process then ends.
    """
    from pathlib import Path
    processes = max(1, int(processes))
    fd = fuse_mount(mountpoint, "hyper:" + store.url, allow_other=allow_other)
    try:
        agreed = answer_init(fd)
    except BaseException:
        subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True)
        os.close(fd)
        raise
    log.info("serving %s at %s with %d process(es) over FUSE 7.%d (cache %s, cap %d bytes)",
             store.url, mountpoint, processes, agreed["minor"], cache_dir, cache_bytes)
    shared = _Shared(len(index.chunk_list), processes)
    children: list[tuple[int, socket.socket]] = []
    for i in range(1, processes):
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # a child: serves its clone of the descriptor until the mount goes
            code = 0
            try:
                _die_with_parent(parent)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.SIG_DFL)
                mine.close()
                for _, s in children:
                    s.close()
                own = Index(index.path)
                chunks = _Borrowed(theirs, shared.gens, shared.slot(i))

                def stats() -> dict:
                    status, _, payload, _ = chunks.ask(b"S")
                    return json.loads(payload)
                fs = LowFS(own, chunks, stats=stats, counters=shared.slot(i),
                           store_chunks=store_chunks)
                loop(fs, _clone(fd), sweep=chunks.sweep)
            except BaseException:
                log.exception("serving process %d failed", os.getpid())
                code = 1
            finally:
                os._exit(code)
        theirs.close()
        children.append((pid, mine))
    cache = ChunkCache(store, index.chunk_list, Path(cache_dir) / "chunks",
                       max_bytes=cache_bytes, min_free_bytes=min_free_bytes,
                       prefetch=prefetch, jobs=jobs)
    seqs_of: dict[str, list[int]] = {}
    for seq, sha, _ in index.chunk_list:
        seqs_of.setdefault(sha, []).append(seq)

    def evicted(sha: str) -> None:
        for seq in seqs_of.get(sha, ()):
            shared.gens[seq] += 1
    cache.on_evict = evicted
    lenders = ThreadPoolExecutor(THREADS, thread_name_prefix="hyper-lend")
    for _, sock in children:
        threading.Thread(target=_lend, args=(cache, shared, sock, threading.Lock(), lenders),
                         daemon=True, name="hyper-lender").start()
    def stop(signum, frame) -> None:
        """Unmount (lazily) and end the loop, even when a copy of the mount in another
        mount namespace would keep the connection open."""
        log.info("signal %d: unmounting %s", signum, mountpoint)
        try:
            subprocess.run(["fusermount3", "-uz", mountpoint], capture_output=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            pass
        raise _Stopped(signum)
    try:
        old = [signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)]
    except ValueError:  # not the main thread: the caller handles signals
        old = None
    fs = LowFS(index, _Owned(cache), stats=lambda: _stats_of(cache, shared),
               counters=shared.slot(0), store_chunks=store_chunks)
    if on_start is not None:
        threading.Thread(target=on_start, daemon=True, name="hyper-start").start()
    try:
        loop(fs, fd)
    except _Stopped:
        log.info("stopped by a signal")
    finally:
        if old is not None:
            for s, h in zip((signal.SIGTERM, signal.SIGINT), old):
                signal.signal(s, h)
        _end_children([pid for pid, _ in children])
        for _, sock in children:
            sock.close()
        fs.pool.shutdown(wait=False, cancel_futures=True)
        lenders.shutdown(wait=False, cancel_futures=True)
        cache.close()
        os.close(fd)
    log.info("unmounted %s", mountpoint)


def _die_with_parent(parent: int) -> None:
    """SIGKILL this process when the process that forked it ends (``PR_SET_PDEATHSIG``,
    prctl(2)): a daemon killed takes its serving children with it, as one process would go,
    and the mount then answers ENOTCONN instead of being served half."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1
    if os.getppid() != parent:  # it ended before the call
        os._exit(1)


def _end_children(pids: list[int], wait: float = 10.0) -> None:
    """Wait for the serving children (they end with the mount), by pid; SIGKILL those
    still there after ``wait`` s."""
    end = time.monotonic() + wait
    left = set(pids)
    while left and time.monotonic() < end:
        for pid in list(left):
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    left.discard(pid)
            except ChildProcessError:
                left.discard(pid)
        if left:
            time.sleep(0.02)
    for pid in left:
        log.warning("serving process %d still there after the unmount: killed", pid)
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
