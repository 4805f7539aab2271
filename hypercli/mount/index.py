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
"""

from __future__ import annotations

import os
import sqlite3
import threading
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


@dataclass(frozen=True)
class Entry:
    """One file, folder or symlink of a dataset.

    Attributes:
        path: relative POSIX path ('' for the root folder).
        kind: 'f', 'd' or 'l'.
        size: bytes (0 for folders; len(target) for symlinks).
        mode: st_mode permission bits and type as pushed.
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


def parent_of(path: str) -> str:
    """'a/b/c' → 'a/b'; 'a' → ''."""
    return path.rsplit("/", 1)[0] if "/" in path else ""


class Index:
    """Read access to an index file, safe from many threads.

    Connections are pooled, not kept per thread: FUSE calls arrive on threads that libfuse
    starts, and Python gives such a thread a fresh thread state (so fresh ``threading.local``
    data) on every callback, which made a connection per call. A pool keeps one connection per
    concurrent caller.

    Args:
        path: the local SQLite index file.
    Raises:
        ValueError: the file is not an index of a known format version.
    """

    _COLS = "path, kind, size, mode, mtime, sha256, target"

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        self._idle: list[sqlite3.Connection] = []
        self._lock = threading.Lock()
        with self._db() as db:
            fmt = db.execute("SELECT value FROM meta WHERE key='format'").fetchone()
            if fmt is None or int(fmt[0]) != FORMAT_VERSION:
                raise ValueError(f"{path}: not a format {FORMAT_VERSION} dataset index")
            self.chunk_list: list[tuple[int, str, int]] = db.execute(
                "SELECT seq, sha256, size FROM chunks ORDER BY seq").fetchall()

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

    def stat(self, path: str) -> Entry | None:
        """The entry at a relative path ('' is the root), or None."""
        with self._db() as db:
            r = db.execute(f"SELECT {self._COLS} FROM files WHERE path=?", (path,)).fetchone()
        return Entry(*r) if r else None

    def lookup(self, path: str) -> tuple[Entry, list[tuple[int, int, int]]] | None:
        """(entry, segments) at a relative path in one query, or None; segments as
        :meth:`segments` (empty for folders, symlinks and empty files)."""
        with self._db() as db:
            rows = db.execute(
                "SELECT f.path, f.kind, f.size, f.mode, f.mtime, f.sha256, f.target, s.chunk, "
                "s.offset, s.length FROM files f LEFT JOIN segments s ON s.path = f.path "
                "WHERE f.path=? ORDER BY s.seq", (path,)).fetchall()
        if not rows:
            return None
        return Entry(*rows[0][:7]), [r[7:] for r in rows if r[7] is not None]

    def listdir(self, path: str, *, after: str | None = None, offset: int = 0,
                limit: int = -1) -> list[Entry]:
        """Entries directly inside a folder, by name: those whose name sorts after ``after``
        (a page's last name; the index's ``(parent, name)`` order), else from the
        ``offset``-th; at most ``limit`` (-1: all)."""
        where, args = "parent=? AND path!=''", [path]
        if after is not None:
            where += " AND name>?"
            args.append(after)
        with self._db() as db:
            rows = db.execute(f"SELECT {self._COLS} FROM files WHERE {where} ORDER BY name "
                              "LIMIT ? OFFSET ?", (*args, limit, 0 if after else offset)
                              ).fetchall()
        return [Entry(*r) for r in rows]

    def files_in_pack_order(self) -> list[tuple[str, int]]:
        """(relative path, size in bytes) of every file, in the order the push packed them
        (by first chunk and offset; empty files, which have no bytes, by path at the end)."""
        with self._db() as db:
            return db.execute(
                "SELECT f.path, f.size FROM files f LEFT JOIN segments s ON s.path = f.path "
                "AND s.seq = 0 WHERE f.kind = 'f' "
                "ORDER BY s.chunk IS NULL, s.chunk, s.offset, f.path").fetchall()

    def segments(self, path: str) -> list[tuple[int, int, int]]:
        """A file's (chunk seq, offset, length) segments, in order."""
        with self._db() as db:
            return db.execute("SELECT chunk, offset, length FROM segments WHERE path=? "
                              "ORDER BY seq", (path,)).fetchall()

    def count(self) -> tuple[int, int, int]:
        """(files, folders, total file bytes)."""
        with self._db() as db:
            r = db.execute("SELECT SUM(kind='f'), SUM(kind='d'), "
                           "COALESCE(SUM(CASE WHEN kind='f' THEN size END), 0) FROM files"
                           ).fetchone()
        return int(r[0] or 0), int(r[1] or 0), int(r[2] or 0)

    def walk(self):
        """Every entry, in path order."""
        with self._db() as db:
            for r in db.execute(f"SELECT {self._COLS} FROM files ORDER BY path"):
                yield Entry(*r)


def create_index(path: str | os.PathLike, chunk_size: int) -> sqlite3.Connection:
    """A new, empty index file with the schema; the caller fills it and commits."""
    if os.path.exists(path):
        os.unlink(path)
    db = sqlite3.connect(str(path))
    db.executescript(SCHEMA)
    db.executemany("INSERT INTO meta VALUES (?, ?)",
                   [("format", str(FORMAT_VERSION)), ("chunk_size", str(chunk_size))])
    return db
