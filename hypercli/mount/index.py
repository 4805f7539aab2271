"""The chunked dataset format (version 1): manifest, index and chunks in an object store.

Source: the Hyper paper (Snark AI, 2019), section III-A — many small files packed into large
immutable chunks (best between 12 and 100 MB, the paper's figure 2), fetched whole and cached on
the node, so a million small reads cost a few large requests.

Under a dataset URL ``P`` (``s3://bucket/datasets/coco``)::

    P/manifest.json          {"format": 1, "created": unix s, "chunk_size": bytes,
                              "index": "index/<sha256>.sqlite", "index_sha256": hex,
                              "chunks": [[sha256 hex, size bytes], ...]  (pack order),
                              "files": n, "dirs": n, "bytes": total file bytes}
    P/index/<sha256>.sqlite  the index below (named by its content)
    P/chunks/<sha256>        chunk objects (named by their content; never rewritten)

The manifest is written last: a dataset is whatever its manifest names, so an interrupted push
changes nothing readers see. The index is SQLite (a path lookup stays fast at millions of
files)::

    meta(key PRIMARY KEY, value)                       format, chunk_size
    chunks(seq PRIMARY KEY, sha256, size)              pack order, seq from 0
    files(path PRIMARY KEY, parent, name, kind, size, mode, mtime, sha256, target)
        kind 'f' file, 'd' folder, 'l' symlink (target); paths relative, POSIX, root is ''
    segments(path, seq, chunk, offset, length)         a file's bytes, in order:
        ``length`` bytes at ``offset`` of chunk number ``chunk``; a small file has one
        segment, a large one spans chunks of its own

An index comes from object storage and is not trusted: :class:`Index` checks the schema when
it opens one and every row as it reads it, and answers a row that is not a well-formed entry
(an unknown kind, a size, mode or mtime of the wrong type or out of range, a path with ``..``
or an empty part, segments that do not add up to the size) with :class:`CorruptIndex` naming
it. Modes are read as the entry's type (from its kind) and its permission bits (``0o777``):
setuid, setgid and sticky bits, and a type that disagrees with the kind, never come out.
"""

from __future__ import annotations

import os
import re
import sqlite3
import stat
import threading
from bisect import bisect_right
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator

FORMAT_VERSION = 1

SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE chunks (seq INTEGER PRIMARY KEY, sha256 TEXT NOT NULL, size INTEGER NOT NULL);
CREATE TABLE files (path TEXT PRIMARY KEY, parent TEXT NOT NULL, name TEXT NOT NULL,
    kind TEXT NOT NULL, size INTEGER NOT NULL, mode INTEGER NOT NULL, mtime REAL NOT NULL,
    sha256 TEXT, target TEXT);
CREATE INDEX files_parent ON files(parent, name);
CREATE TABLE segments (path TEXT NOT NULL, seq INTEGER NOT NULL, chunk INTEGER NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL, PRIMARY KEY (path, seq));
"""
#: the columns each table must have (what the readers below select)
COLUMNS = {"meta": ("key", "value"), "chunks": ("seq", "sha256", "size"),
           "files": ("path", "parent", "name", "kind", "size", "mode", "mtime", "sha256",
                     "target"),
           "segments": ("path", "seq", "chunk", "offset", "length")}
#: st_mode type bits of each kind of entry
KIND_TYPES = {"f": stat.S_IFREG, "d": stat.S_IFDIR, "l": stat.S_IFLNK}
MAX_BYTES = (1 << 63) - 1  # sizes and offsets: what a signed 64-bit off_t holds
#: |mtime| limit, s: a signed 64-bit count of nanoseconds (Linux's ktime_t), years 1677-2262
MAX_MTIME = MAX_BYTES / 1e9
_SHA = re.compile(r"[0-9a-f]{64}")


class CorruptIndex(ValueError):
    """An index that is not well-formed: a missing table or column, a format it is not, or a
    row (entry, segment, chunk) whose values are of the wrong type or out of range.

    Attributes:
        path: the entry at fault (relative path; None when the fault is not one entry's).
    """

    def __init__(self, message: str, path: str | None = None):
        super().__init__(message)
        self.path = path


@dataclass(frozen=True)
class Entry:
    """One file, folder or symlink of a dataset.

    Attributes:
        path: relative POSIX path ('' for the root folder).
        kind: 'f', 'd' or 'l'.
        size: bytes (0 for folders; len(target) for symlinks).
        mode: st_mode: the kind's type bits and the permission bits pushed (``0o777`` of
            them: never setuid, setgid or sticky).
        mtime: modification time, unix s.
        sha256: hex digest of a file's bytes, else None.
        target: a symlink's target, else None.
    """

    path: str
    kind: str
    size: int
    mode: int
    mtime: float
    sha256: str | None = None
    target: str | None = None


@dataclass(frozen=True)
class BadEntry:
    """A row of a folder's listing that is not a well-formed entry (see :class:`CorruptIndex`).

    Attributes:
        name: its name in the folder when that name can be shown (a string without '/' or
            NUL, not '', '.' or '..', agreeing with the row's path), else None.
        reason: what is wrong, naming the entry.
    """

    name: str | None
    reason: str


def parent_of(path: str) -> str:
    """'a/b/c' → 'a/b'; 'a' → ''."""
    return path.rsplit("/", 1)[0] if "/" in path else ""


def path_ok(path) -> bool:
    """Whether ``path`` is a relative POSIX path an entry may have: '' (the root) or parts
    that are neither empty, '.' nor '..', and no NUL."""
    if type(path) is not str or "\0" in path:
        return False
    s = f"/{path}/"  # every part between slashes: none empty, '.' or '..'
    return path == "" or ("//" not in s and "/./" not in s and "/../" not in s)


def _r(value, limit: int = 80) -> str:
    """repr of a value read from an index, cut to ``limit`` characters (a crafted one can be
    megabytes long)."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _bad(path, why: str) -> CorruptIndex:
    return CorruptIndex(f"entry {_r(path, 200)}: {why}",
                        path if isinstance(path, str) else None)


def entry_of(row) -> Entry:
    """The :class:`Entry` of a ``files`` row (path, kind, size, mode, mtime, sha256, target),
    checked: the path as :func:`path_ok` (the root a folder), a known kind, a size of
    0..2**63-1 bytes, a mode of 0..2**32-1, a finite mtime within ±``MAX_MTIME`` s, a file's
    sha256 a string, a symlink's target a non-empty string without NUL.

    Raises:
        CorruptIndex: naming the entry and the first fault found.
    """
    path, kind, size, mode, mtime, sha, target = row
    if not path_ok(path):
        raise _bad(path, "not a relative path (absolute, '..', an empty part, or NUL)")
    if kind not in KIND_TYPES:
        raise _bad(path, f"unknown kind {_r(kind)} (not 'f', 'd' or 'l')")
    if path == "" and kind != "d":
        raise _bad(path, "the root is not a folder")
    if type(size) is not int or not 0 <= size <= MAX_BYTES:
        raise _bad(path, f"size {_r(size)} is not a number of bytes")
    if type(mode) is not int or not 0 <= mode < 1 << 32:
        raise _bad(path, f"mode {_r(mode)} is not a file mode")
    if type(mtime) not in (int, float) or not -MAX_MTIME <= mtime <= MAX_MTIME:
        raise _bad(path, f"mtime {_r(mtime)} is not a time (unix s, years 1677-2262)")
    if kind == "f" and type(sha) is not str:  # a wrong one fails the file's check
        raise _bad(path, f"sha256 {_r(sha)} is not a hex digest")
    if kind == "l" and not (isinstance(target, str) and target and "\0" not in target):
        raise _bad(path, f"symlink target {_r(target)} is not a path")
    return Entry(path, kind, size, KIND_TYPES[kind] | (mode & 0o777), float(mtime),
                 sha if kind == "f" else None, target if kind == "l" else None)


def pieces(segs, starts, offset: int, end: int) -> list[tuple[int, int, int]]:
    """The bytes ``[offset, end)`` of a file laid out as ``segs`` ((chunk seq, offset in the
    chunk, length) each, in file order; ``starts``: each segment's offset in the file), as
    (chunk seq, offset in that chunk, length) pieces in file order (bytes)."""
    out = []
    i = max(0, bisect_right(starts, offset) - 1)
    while offset < end and i < len(segs):
        seq, coff, length = segs[i]
        start = starts[i]
        k = min(end, start + length) - offset
        if k > 0:
            out.append((seq, coff + offset - start, k))
            offset += k
        i += 1
    return out


class Index:
    """Read access to an index file, safe from many threads; every row checked as it is read.

    Connections are pooled, not kept per thread: FUSE calls arrive on threads that libfuse
    starts, and Python gives such a thread a fresh thread state (so fresh ``threading.local``
    data) on every callback, which made a connection per call. A pool keeps one connection per
    concurrent caller.

    Args:
        path: the local SQLite index file.
    Raises:
        CorruptIndex (a ValueError): the file is not an index of a known format version, a
            table or column is missing, or a chunk row is wrong (seqs 0..n-1, sha256 64 hex
            digits, size 0..2**63-1 bytes). The readers below raise it for a bad row.
        sqlite3.DatabaseError: the file is not SQLite (or is damaged).
    """

    _COLS = "path, kind, size, mode, mtime, sha256, target"

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        with self._db() as db:
            for table, cols in COLUMNS.items():
                have = {r[1] for r in db.execute(f"PRAGMA table_info({table})")}
                if not have:
                    raise CorruptIndex(f"no table {table!r}")
                missing = [c for c in cols if c not in have]
                if missing:
                    raise CorruptIndex(f"table {table!r} has no column {missing[0]!r}")
            fmt = db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
            if fmt is None or str(fmt[0]) != str(FORMAT_VERSION):
                raise CorruptIndex(f"not a format {FORMAT_VERSION} dataset index")
            self.chunk_list: list[tuple[int, str, int]] = db.execute(
                "SELECT seq, sha256, size FROM chunks ORDER BY seq").fetchall()
        for i, (seq, sha, size) in enumerate(self.chunk_list):
            if seq != i or type(seq) is not int or not isinstance(sha, str) or \
                    not _SHA.fullmatch(sha) or type(size) is not int or \
                    not 0 <= size <= MAX_BYTES:
                raise CorruptIndex(f"chunk row {i} {_r((seq, sha, size), 200)} is not "
                                   "(seq, 64 hex digits, bytes) in order from 0")

    @contextmanager
    def _db(self) -> Iterator[sqlite3.Connection]:
        """A connection of the pool, for one caller at a time."""
        with self._lock:
            db = self._idle.pop() if self._idle else None
        if db is None:
            db = sqlite3.connect(f"file:{self.path}?mode=ro&immutable=1", uri=True,
                                 check_same_thread=False)
        try:
            yield db
        finally:
            with self._lock:
                self._idle.append(db)

    def _checked(self, e: Entry, segs) -> list[tuple[int, int, int]]:
        """A file's segments, each ``length`` > 0 bytes at ``offset`` ≥ 0 inside chunk
        ``chunk`` of the dataset, adding up to the file's size; [] for other kinds.

        Raises:
            CorruptIndex: naming the file.
        """
        if e.kind != "f":
            return []
        chunks, total = self.chunk_list, 0
        for seg in segs:
            c, off, n = seg
            if type(c) is not int or type(off) is not int or type(n) is not int or \
                    not 0 <= c < len(chunks) or off < 0 or n <= 0 or off + n > chunks[c][2]:
                raise _bad(e.path, f"segment {_r(tuple(seg))} is not bytes of a chunk of the "
                           "dataset")
            total += n
        if total != e.size:
            raise _bad(e.path, f"size is {e.size} bytes but its segments hold {total}")
        return segs

    def stat(self, path: str) -> Entry | None:
        """The entry at a relative path ('' is the root), or None.

        Raises:
            CorruptIndex: the row there is not a well-formed entry.
        """
        with self._db() as db:
            r = db.execute(f"SELECT {self._COLS} FROM files WHERE path=?", (path,)).fetchone()
        return entry_of(r) if r else None

    def lookup(self, path: str) -> tuple[Entry, list[tuple[int, int, int]]] | None:
        """(entry, segments) at a relative path in one query, or None; segments as
        :meth:`segments` (empty for folders, symlinks and empty files).

        Raises:
            CorruptIndex: the row is not a well-formed entry, or a file's segments are wrong
                or do not add up to its size.
        """
        with self._db() as db:
            rows = db.execute(
                "SELECT f.path, f.kind, f.size, f.mode, f.mtime, f.sha256, f.target, s.chunk, "
                "s.offset, s.length FROM files f LEFT JOIN segments s ON s.path = f.path "
                "WHERE f.path=? ORDER BY s.seq", (path,)).fetchall()
        if not rows:
            return None
        e = entry_of(rows[0][:7])
        return e, self._checked(e, [r[7:] for r in rows if r[7] is not None])

    def lookup_id(self, path: str) -> tuple[int, Entry, list[tuple[int, int, int]]] | None:
        """(rowid, entry, segments) at a relative path, or None: :meth:`lookup` with the
        row's SQLite rowid, a number that names the entry for the life of the (immutable)
        index file.

        Raises:
            CorruptIndex: as :meth:`lookup`.
        """
        with self._db() as db:
            rows = db.execute(
                "SELECT f.path, f.kind, f.size, f.mode, f.mtime, f.sha256, f.target, s.chunk, "
                "s.offset, s.length, f.rowid FROM files f LEFT JOIN segments s "
                "ON s.path = f.path WHERE f.path=? ORDER BY s.seq", (path,)).fetchall()
        if not rows:
            return None
        e = entry_of(rows[0][:7])
        return rows[0][10], e, self._checked(e, [r[7:10] for r in rows if r[7] is not None])

    def by_id(self, rowid: int) -> tuple[Entry, list[tuple[int, int, int]]] | None:
        """(entry, segments) of the row with this rowid (see :meth:`lookup_id`), or None.

        Raises:
            CorruptIndex: as :meth:`lookup`.
        """
        with self._db() as db:
            rows = db.execute(
                "SELECT f.path, f.kind, f.size, f.mode, f.mtime, f.sha256, f.target, s.chunk, "
                "s.offset, s.length FROM files f LEFT JOIN segments s ON s.path = f.path "
                "WHERE f.rowid=? ORDER BY s.seq", (rowid,)).fetchall()
        if not rows:
            return None
        e = entry_of(rows[0][:7])
        return e, self._checked(e, [r[7:] for r in rows if r[7] is not None])

    def by_ids(self, lo: int, hi: int) -> list[tuple[int, Entry, list[tuple[int, int, int]]]]:
        """(rowid, entry, segments) of every well-formed row with lo <= rowid <= hi, in one
        query (rows that are not well-formed are left out: :meth:`by_id` names their fault).
        Rows are inserted in path order, so the rows around one are its neighbours in the
        dataset, which a program reading one file is likely to read next."""
        with self._db() as db:
            rows = db.execute(
                "SELECT f.path, f.kind, f.size, f.mode, f.mtime, f.sha256, f.target, s.chunk, "
                "s.offset, s.length, f.rowid FROM files f LEFT JOIN segments s "
                "ON s.path = f.path WHERE f.rowid BETWEEN ? AND ? ORDER BY f.rowid, s.seq",
                (lo, hi)).fetchall()
        out, i = [], 0
        while i < len(rows):
            j = i
            while j < len(rows) and rows[j][10] == rows[i][10]:
                j += 1
            try:
                e = entry_of(rows[i][:7])
                out.append((rows[i][10], e, self._checked(
                    e, [r[7:10] for r in rows[i:j] if r[7] is not None])))
            except CorruptIndex:
                pass
            i = j
        return out

    def listdir(self, path: str, *, after: str | None = None, offset: int = 0,
                limit: int = -1, bad: str = "raise", ids: bool = False) -> list:
        """Entries directly inside a folder, by name: those whose name sorts after ``after``
        (a page's last name; the index's ``(parent, name)`` order), else from the
        ``offset``-th; at most ``limit`` (-1: all).

        Args:
            bad: 'raise' (CorruptIndex for the first row that is not a well-formed entry of
                this folder) or 'keep' (a :class:`BadEntry` in its place, so one bad row
                keeps its position and costs only itself).
            ids: give each entry with its rowid (see :meth:`lookup_id`).
        Returns:
            [Entry] (with bad='keep': [Entry | BadEntry]; with ids: [(rowid, entry)]).
        """
        where, args = "parent=? AND path!=''", [path]
        if after is not None:
            where += " AND name>?"
            args.append(after)
        sql = (f"SELECT {self._COLS}, name, rowid FROM files WHERE {where} ORDER BY name "
               "LIMIT ? OFFSET ?")
        args += [limit, 0 if after else offset]
        with self._db() as db:
            try:
                rows = db.execute(sql, args).fetchall()
            except sqlite3.OperationalError:  # text that is not UTF-8 ("Could not decode")
                if bad == "raise":
                    raise
                rows = _undecoded(db, sql, args)
        out: list = []
        for r in rows:
            p, name = r[0], r[7]
            try:
                e = entry_of(r[:7])
                if parent_of(p) != path or name != p.rsplit("/", 1)[-1]:
                    raise _bad(p, f"listed in folder {_r(path)} under the name {_r(name)}")
                out.append((r[8], e) if ids else e)
            except CorruptIndex as ex:
                if bad == "raise":
                    raise
                shown = isinstance(name, str) and path_ok(name) and "/" not in name and \
                    name != "" and p == (f"{path}/{name}" if path else name)
                b = BadEntry(name if shown else None, str(ex))
                out.append((r[8], b) if ids else b)
        return out

    def files_in_pack_order(self) -> list[tuple[str, int]]:
        """(relative path, size in bytes) of every file, in the order the push packed them
        (by first chunk and offset; empty files, which have no bytes, by path at the end).

        Raises:
            CorruptIndex: a file's path or size is not one.
        """
        with self._db() as db:
            rows = db.execute(
                "SELECT f.path, f.size FROM files f LEFT JOIN segments s ON s.path = f.path "
                "AND s.seq = 0 WHERE f.kind = 'f' "
                "ORDER BY s.chunk IS NULL, s.chunk, s.offset, f.path").fetchall()
        for p, size in rows:
            if not path_ok(p) or p == "" or type(size) is not int or \
                    not 0 <= size <= MAX_BYTES:
                raise _bad(p, f"not a file's path and size ({_r(size)})")
        return rows

    def segments(self, path: str, size: int | None = None) -> list[tuple[int, int, int]]:
        """A file's (chunk seq, offset, length) segments, in order, each checked to be bytes
        of a chunk of the dataset; with ``size`` (bytes), also that they add up to it.

        Raises:
            CorruptIndex: a segment is not bytes of a chunk, or they do not add up to size.
        """
        with self._db() as db:
            segs = db.execute("SELECT chunk, offset, length FROM segments WHERE path=? "
                              "ORDER BY seq", (path,)).fetchall()
        if size is None:
            size = sum(n for _, _, n in segs if type(n) is int)
        return self._checked(Entry(path, "f", size, 0, 0.0), segs)

    def count(self) -> tuple[int, int, int]:
        """(files, folders, total file bytes), each at most 2**63-1."""
        with self._db() as db:
            r = db.execute("SELECT TOTAL(kind='f'), TOTAL(kind='d'), "
                           "TOTAL(CASE WHEN kind='f' THEN size END) FROM files").fetchone()
        return tuple(int(min(max(v or 0, 0), MAX_BYTES)) for v in r)

    def walk(self, bad: str = "raise"):
        """Every entry, in path order (as :meth:`listdir`: ``bad='keep'`` yields a
        :class:`BadEntry`, whose ``name`` is then the row's path, for a row that is not a
        well-formed entry; 'raise' raises CorruptIndex)."""
        with self._db() as db:
            for r in db.execute(f"SELECT {self._COLS} FROM files ORDER BY path"):
                try:
                    yield entry_of(r)
                except CorruptIndex as ex:
                    if bad == "raise":
                        raise
                    yield BadEntry(r[0] if isinstance(r[0], str) else None, str(ex))


def _undecoded(db: sqlite3.Connection, sql: str, args) -> list[tuple]:
    """The rows of a query whose text is not all UTF-8: each text value decoded where it is
    UTF-8, else left as bytes (which no check takes for a path, kind or name)."""
    db.text_factory = bytes
    try:
        rows = db.execute(sql, args).fetchall()
    finally:
        db.text_factory = str

    def text(v):
        if isinstance(v, bytes):
            try:
                return v.decode("utf-8")
            except UnicodeDecodeError:
                return v
        return v
    return [tuple(text(v) for v in r) for r in rows]


def create_index(path: str | os.PathLike, chunk_size: int) -> sqlite3.Connection:
    """A new, empty index file with the schema; the caller fills it and commits."""
    if os.path.exists(path):
        os.unlink(path)
    db = sqlite3.connect(str(path))
    db.executescript(SCHEMA)
    db.executemany("INSERT INTO meta VALUES (?, ?)",
                   [("format", str(FORMAT_VERSION)), ("chunk_size", str(chunk_size))])
    return db
