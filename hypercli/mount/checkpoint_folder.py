"""The files of a checkpoint folder as a save reads them and a restore writes them
(:mod:`hypercli.mount.checkpoint`): always relative to the folder's own descriptor
(``openat``), never through a symlink (``O_NOFOLLOW``), a FIFO never opened blocking, and a
file read only while nothing writes it. The task that owns the folder is not trusted: it may
put symlinks, FIFOs or files being written anywhere in it.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import signal
import stat
import time
from contextlib import contextmanager
from pathlib import Path

from hypercli.errors import InfraError
from hypercli.mount.checkpoint_manifest import BLOCK, BadManifest

TRIES = 5           #: reads of a file that keeps changing before its old version is kept
RETRY_PAUSE = 0.05  #: s before the second read of a changing file, doubled for each next one

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC  # a FIFO never blocks
_F_SETSIG = getattr(fcntl, "F_SETSIG", 10)  # Linux's value (asm-generic/fcntl.h)


class FolderError(InfraError):
    """The checkpoint folder itself cannot be used (a symlink, not a folder)."""


@contextmanager
def open_folder(root: Path):
    """A descriptor of the checkpoint folder (made when missing), never through a symlink.
    Raises FolderError."""
    root.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(root, _DIR)
    except OSError as e:
        raise FolderError(f"checkpoint folder {root}: {e.strerror} (a symlink is refused)",
                          "remove it; hypercli makes it again") from None
    try:
        yield fd
    finally:
        os.close(fd)


def walk_files(root_fd: int):
    """(path, its folder's descriptor, name) of every regular file under the folder, sorted;
    symlinks are neither followed nor listed. The descriptor is good until the next item."""
    for top, dirs, names, dfd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        dirs.sort()
        prefix = "" if top == "." else top[2:] + "/"
        for name in sorted(names):
            try:
                s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue  # gone since it was listed
            if stat.S_ISREG(s.st_mode):
                yield prefix + name, dfd, name


def signature(s: os.stat_result) -> tuple:
    """What tells two versions of a file apart: (size in bytes, mtime ns, ctime ns, inode)."""
    return s.st_size, s.st_mtime_ns, s.st_ctime_ns, s.st_ino


def same_stat(old: dict, s: os.stat_result) -> bool:
    """Whether a file a state recorded as ``{"size", "mtime_ns", "ctime_ns", ...}`` is still
    that version (a state of an older hypercli, without ctime_ns, never is)."""
    return (old.get("size"), old.get("mtime_ns"), old.get("ctime_ns")) == (
        s.st_size, s.st_mtime_ns, s.st_ctime_ns)


class Pack:
    """The pack a save writes: new blocks appended, its SHA-256 kept as it grows, and the
    blocks of one file taken back when that file changed while it was read."""

    def __init__(self, f):
        self.f, self.h = f, hashlib.sha256()
        self.fresh: dict[str, tuple[int, int]] = {}  # sha → (offset, length) in this pack

    def add(self, data: bytes, known: dict) -> str:
        sha = hashlib.sha256(data).hexdigest()
        if sha not in known and sha not in self.fresh:
            self.fresh[sha] = (self.f.tell(), len(data))
            self.f.write(data)
            self.h.update(data)
        return sha

    def mark(self) -> tuple:
        return self.f.tell(), self.h.copy(), len(self.fresh)

    def rollback(self, mark: tuple) -> None:
        pos, self.h, n = mark
        self.f.seek(pos)
        self.f.truncate()
        for sha in list(self.fresh)[n:]:
            del self.fresh[sha]


def being_written(fd: int) -> bool | None:
    """Whether some process has the file of ``fd`` (opened read-only) open for writing: a
    read lease is refused then (EAGAIN). The lease is let go at once; a writer that opens
    the file meanwhile waits for that, and the break is told with SIGURG, which is ignored
    unless a handler is set. None: leases cannot tell here (not the file's owner, no
    CAP_LEASE, a file system without leases)."""
    try:
        fcntl.fcntl(fd, _F_SETSIG, signal.SIGURG)
        fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_RDLCK)
    except OSError as e:
        return True if e.errno == errno.EAGAIN else None
    fcntl.fcntl(fd, fcntl.F_SETLEASE, fcntl.F_UNLCK)
    return False


def read_stable(dfd: int, name: str, pack: Pack, known: dict):
    """Read file ``name`` of folder ``dfd`` into ``pack`` when nothing writes it: no process
    has it open for writing before and after the read (:func:`being_written`) and its
    :func:`signature` is the same before and after; tried TRIES times, RETRY_PAUSE s apart
    and doubling. ``known``: sha256 → where a block already is (not packed again).
    Returns (stat, [sha256 of each BLOCK-byte block]), or (None, why not: text)."""
    why = f"it kept changing while it was read ({TRIES} tries)"
    for k in range(TRIES):
        if k:
            time.sleep(RETRY_PAUSE * 2 ** (k - 1))
        try:
            fd = os.open(name, _FILE, dir_fd=dfd)
        except OSError as e:
            return None, ("it became a symlink" if e.errno == errno.ELOOP
                          else f"it could not be opened ({e.strerror})")
        try:
            s = os.fstat(fd)
            if not stat.S_ISREG(s.st_mode):
                return None, "it is no longer a regular file"
            if being_written(fd):
                why = f"a process kept it open for writing ({TRIES} tries)"
                continue
            mark, blocks, off = pack.mark(), [], 0
            while data := os.pread(fd, BLOCK, off):
                blocks.append(pack.add(data, known))
                off += len(data)
            if off == s.st_size and signature(os.fstat(fd)) == signature(s) \
                    and not being_written(fd):
                return s, blocks
            pack.rollback(mark)
            why = f"it kept changing while it was read ({TRIES} tries)"
        finally:
            os.close(fd)
    return None, why


def changed_since(root_fd: int, cutoff_ns: int) -> list[str]:
    """Paths under the folder (files, folders, links; "." for itself) whose ctime is after
    ``cutoff_ns`` (ns since the epoch)."""
    out = []
    for top, dirs, names, dfd in os.fwalk(".", dir_fd=root_fd, follow_symlinks=False):
        if os.fstat(dfd).st_ctime_ns > cutoff_ns:
            out.append(top[2:] or ".")
        prefix = "" if top == "." else top[2:] + "/"
        for name in names:
            try:
                if os.stat(name, dir_fd=dfd, follow_symlinks=False).st_ctime_ns > cutoff_ns:
                    out.append(prefix + name)
            except OSError:
                out.append(prefix + name)
    return sorted(out)


def open_dirs(rfd: int, dirs: dict, rel: str, gen: str) -> int:
    """The descriptor of the folder that holds ``rel``, each folder on the way opened from
    its parent without following symlinks and made when missing; a file in the way (not in
    the generation) is removed. ``dirs``: folder path → descriptor, "" the root. Raises
    BadManifest when a part of the way is a symlink."""
    parts = rel.split("/")[:-1]
    for k in range(len(parts)):
        key = "/".join(parts[:k + 1])
        if key in dirs:
            continue
        parent, part = dirs["/".join(parts[:k])], parts[k]
        for _ in range(3):
            try:
                dirs[key] = os.open(part, _DIR, dir_fd=parent)
                break
            except FileNotFoundError:
                try:
                    os.mkdir(part, 0o755, dir_fd=parent)
                except FileExistsError:
                    pass
            except OSError as e:
                if e.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                if stat.S_ISLNK(os.stat(part, dir_fd=parent, follow_symlinks=False).st_mode):
                    raise BadManifest(gen, rel, f"it passes through {key!r}, a symlink in "
                                      "the checkpoint folder (never followed)",
                                      hint=f"remove the symlink {key!r} from the task's "
                                      "checkpoint folder") from None
                os.unlink(part, dir_fd=parent)  # a stale file where a folder goes
        else:
            raise FolderError(f"checkpoint folder: {key!r} keeps changing while it is restored")
    return dirs["/".join(parts)]


def remove_tree(name: str, parent: int) -> None:
    """Remove folder ``name`` of ``parent`` and all in it, never following a symlink."""
    fd = os.open(name, _DIR, dir_fd=parent)
    try:
        for e in os.scandir(fd):
            if e.is_dir(follow_symlinks=False):
                remove_tree(e.name, fd)
            else:
                os.unlink(e.name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)
