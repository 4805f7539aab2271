"""Extracting a tar stream that came from a node, trusting nothing in it.

A node's tar stream carries what its tasks wrote (outputs, logs, checkpoints): a task runs as
root on its node and can put any member in it. ``tarfile``'s ``data`` filter alone is not
enough on the Pythons in use (CVE-2025-4517 and its siblings bypass it through symlink chains
that ``os.path.realpath`` resolves differently than the kernel), so every member is checked
here and written through directory file descriptors, never through a path the kernel would
resolve again:

* names: relative, no ``..`` part, no empty part, no NUL;
* every folder on the way is opened ``O_NOFOLLOW`` from the target's own descriptor (a
  symlink made by an earlier member is never walked through);
* symlinks: only relative ones whose target, taken from the link's own folder, stays inside,
  and, once every member is out, only those the kernel resolves to inside (a chain such as
  ``x -> .``, ``a/l -> ../x``, ``a/m -> l/../..`` passes the first check and leaves the
  folder: such links are removed again);
* hard links: only to a regular file extracted inside, linked without following a symlink;
* devices, FIFOs and anything else: skipped;
* modes masked to ``0o777`` (no setuid, setgid or sticky bit); owners are not restored.

A member that fails a check is skipped, and said so in the list :func:`extract` returns.
"""

from __future__ import annotations

import io
import os
import posixpath
import stat
import tarfile
from pathlib import Path

_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _parts(name: str) -> list[str] | None:
    """The parts of a member name, or None when it is not a plain relative path."""
    if not name or "\x00" in name or name.startswith("/"):
        return None
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if not parts or any(p == ".." for p in parts):
        return None
    return parts


def _inside(parts: list[str], target: str) -> list[str] | None:
    """The parts of symlink ``target`` resolved from the folder of the link at ``parts``,
    or None when it is absolute or leaves the extraction root."""
    if not target or "\x00" in target or target.startswith("/"):
        return None
    joined = posixpath.normpath(posixpath.join(*parts[:-1], target) if parts[:-1] else target)
    if joined == ".." or joined.startswith("../") or joined.startswith("/"):
        return None
    return [] if joined == "." else joined.split("/")


def _open_folder(root: int, parts: list[str], make: bool) -> int:
    """An fd of the folder ``parts`` under fd ``root``, each step opened without following
    a symlink; made (mode 0o755 less the umask) when ``make``. Raises OSError (ELOOP or
    ENOTDIR when a step is a symlink or not a folder)."""
    fd = os.dup(root)
    try:
        for p in parts:
            try:
                nxt = os.open(p, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not make:
                    raise
                os.mkdir(p, 0o755, dir_fd=fd)
                nxt = os.open(p, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _clear(folder: int, name: str) -> None:
    """Remove a file or symlink ``name`` in fd ``folder`` (a later member of the same name
    replaces it); a folder there is kept."""
    try:
        st = os.stat(name, dir_fd=folder, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=folder)


def extract(data: bytes | io.BufferedIOBase, dest: str | os.PathLike) -> list[str]:
    """Extract a tar stream into the folder ``dest`` (made when missing), checking each
    member (module docstring).

    Args:
        data: the tar's bytes, or a binary file object positioned at its start.
        dest: the target folder; a symlink there is refused.
    Returns:
        ``["name: why skipped", ...]`` of the members not extracted.
    Raises:
        tarfile.TarError, EOFError: the stream is not a whole tar (cut short).
        OSError: ``dest`` cannot be made or is a symlink, or a write failed.
    """
    Path(dest).parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(dest, 0o755)
    except FileExistsError:
        pass
    root = os.open(dest, _DIR)
    skipped: list[str] = []
    links: list[list[str]] = []
    fileobj = io.BytesIO(data) if isinstance(data, (bytes, bytearray)) else data
    try:
        with tarfile.open(fileobj=fileobj, mode="r|*") as tar:
            for m in tar:
                why = _one(tar, m, root, links)
                if why:
                    skipped.append(f"{m.name}: {why}")
        skipped += _unlink_leaving(root, os.path.realpath(dest), links)
    finally:
        os.close(root)
    return skipped


def _resolved(path: str) -> str | None:
    """Where the kernel resolves ``path`` (the open file's ``/proc/self/fd`` name; for a
    dangling link, ``os.path.realpath``'s answer); None when it cannot be resolved (ELOOP,
    ENAMETOOLONG: ``realpath`` would stop expanding there, the flaw of CVE-2025-4517)."""
    try:
        fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
    except FileNotFoundError:
        return os.path.realpath(path)
    except OSError:
        return None
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _unlink_leaving(root: int, real: str, links: list[list[str]]) -> list[str]:
    """Remove each symlink made (``links``: their parts under fd ``root``, whose real path
    is ``real``) that the kernel now resolves to outside ``real``; their skip reasons."""
    out = []
    for parts in links:
        got = _resolved(os.path.join(real, *parts))
        if got is not None and (got == real or got.startswith(real + os.sep)):
            continue
        try:
            folder = _open_folder(root, parts[:-1], make=False)
        except OSError:
            continue  # its folder went with an earlier link: nothing reaches it now
        try:
            st = os.stat(parts[-1], dir_fd=folder, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.unlink(parts[-1], dir_fd=folder)
                out.append(f"{'/'.join(parts)}: a symlink that resolves outside the folder")
        except FileNotFoundError:
            pass
        finally:
            os.close(folder)
    return out


def _one(tar: tarfile.TarFile, m: tarfile.TarInfo, root: int,
         links: list[list[str]]) -> str | None:
    """Extract member ``m`` under fd ``root``; the reason when it is skipped. A symlink
    made is added to ``links`` (its parts)."""
    parts = _parts(m.name)
    if parts is None:
        return "not a relative path inside the folder"
    mode = m.mode & 0o777
    if not (m.isdir() or m.isreg() or m.issym() or m.islnk()):
        return "not a file, folder or link (device, FIFO...)"
    try:
        folder = _open_folder(root, parts[:-1] if not m.isdir() else parts, make=True)
    except OSError as e:
        return f"its folder cannot be made or passes through a symlink ({e.strerror})"
    try:
        if m.isdir():
            os.chmod(folder, mode | 0o700)  # (an fd: never a symlink's target)
            return None
        name = parts[-1]
        if m.issym():
            if _inside(parts, m.linkname) is None:
                return f"a symlink to {m.linkname!r}, outside the folder"
            _clear(folder, name)
            os.symlink(m.linkname, name, dir_fd=folder)
            links.append(parts)
            return None
        if m.islnk():
            src = _parts(m.linkname)
            if src is None:
                return f"a hard link to {m.linkname!r}, outside the folder"
            try:
                sfd = _open_folder(root, src[:-1], make=False)
            except OSError:
                return f"a hard link to {m.linkname!r}, not a file extracted here"
            try:
                st = os.stat(src[-1], dir_fd=sfd, follow_symlinks=False)
                if not stat.S_ISREG(st.st_mode):
                    return f"a hard link to {m.linkname!r}, not a regular file"
                _clear(folder, name)
                os.link(src[-1], name, src_dir_fd=sfd, dst_dir_fd=folder,
                        follow_symlinks=False)
            except FileNotFoundError:
                return f"a hard link to {m.linkname!r}, not a file extracted here"
            finally:
                os.close(sfd)
            return None
        _clear(folder, name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                     0o600, dir_fd=folder)
        try:
            src = tar.extractfile(m)
            while block := src.read(1 << 20):
                view = memoryview(block)
                while view:
                    view = view[os.write(fd, view):]
            os.fchmod(fd, mode)
            if m.mtime:
                try:
                    os.utime(fd, (m.mtime, m.mtime))
                except (OverflowError, ValueError, OSError):
                    pass
        finally:
            os.close(fd)
        return None
    finally:
        os.close(folder)
