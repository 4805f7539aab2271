"""Image datasets: a folder pushed as one EROFS image, its files served by the kernel.

A dataset mount answers every open, lookup and read of every file in its daemon: with many
data-loader workers on few cores that daemon, not the disk, sets the pace (bench/RESULTS.md
§14). An *image dataset* moves the per-file work into the kernel. Rules:

- **Push** (:func:`push`, ``hyper data push --image``): the folder is made into one
  read-only EROFS image by ``mkfs.erofs`` (Debian's ``erofs-utils``; files, folders,
  symlinks and modes kept, owned by root; extended attributes not), and the image is
  pushed as a one-file dataset (:func:`hypercli.mount.pack.push`: content-defined chunks,
  each checked by SHA-256, only new chunks uploaded) whose manifest says
  ``"layout": "erofs"`` and counts the source's files, folders and bytes under
  ``"source"``.
- **Mount** (:func:`mount`; a recipe's ``chunks+`` mount of such a dataset does it on the
  node): the dataset is mounted as usual (the chunk cache, its cap and checks) at a private
  folder under the cache, served by :mod:`hypercli.mount.fuselow` with ``store_chunks``: the
  first read of the image in a chunk has the daemon push that chunk's bytes of the image
  into the kernel's page cache, so the kernel's later reads there never reach it. The image
  is then mounted by the kernel's EROFS straight from that file (``mount(2)``, a file-backed
  EROFS mount, Linux ≥ 6.12; ``ro,nosuid,nodev``) at the mount point, and the private FUSE
  mount is detached at once (``fusermount3 -uz``): it lives on only as the EROFS mount's
  backing file, so unmounting the mount point (``umount``) ends the daemon too, and nothing
  else is left in the mount table.
- **Checks** (a hostile store, a hostile task): the private folder is made 0700 and
  refused when it is a symlink, another user's, or has another mount on it; the mounted
  dataset must be one regular file ``image.erofs`` and nothing else (a symlink there would
  have the kernel mount a file of the node); a mount point that is a symlink is refused.
  The daemon's pid is kept beside the private folder (:func:`pid_file`).
- **What the kernel does**: lookups, listings, opens and reads of the files are EROFS's,
  from its own page cache; a byte of the image not yet in the page cache is read through
  the FUSE file, whose daemon fetches and checks its chunk (an unreadable or corrupt chunk is
  EIO for the files whose bytes are in it, never other bytes). EROFS is made to read
  untrusted images (container images); the image here was made by ``mkfs.erofs`` from the
  user's folder and its chunks are checked against the manifest before the kernel sees them.
- **Needs root** on the node (``mount(2)`` of EROFS), as ``mode: copy`` does; without it the
  mount is refused with a clear error and the private FUSE mount is taken down.

Chosen over FUSE passthrough (Linux ≥ 6.9), which maps one FUSE file onto one local file at
the same offsets, and so cannot serve files packed into shared chunks before their chunk is
on disk, and over a loop device (a global, scarce device per mount).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

from hypercli.errors import InfraError, UsageError

LAYOUT = "erofs"          # the manifest's "layout" of an image dataset
IMAGE = "image.erofs"     # the one file of an image dataset
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4   # <sys/mount.h>
#: EROFS options (Documentation/filesystems/erofs.rst): no user.* extended attributes and no
#: ACLs from an image (a store's own image could hold a forged ``user.hypercli.stats`` or
#: ACLs), as a plain dataset's mount has none
OPTIONS = b"nouser_xattr,noacl"


def build(src_dir: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Make the EROFS image ``out`` of folder ``src_dir`` with ``mkfs.erofs`` (uncompressed,
    files owned by root, modes, symlinks and modification times kept; extended attributes
    not, as in a plain dataset).

    Returns:
        the source's counts: {"files", "dirs", "bytes"} (folders below the root; bytes of
        regular files).
    Raises:
        UsageError: ``src_dir`` is not a folder, or ``mkfs.erofs`` is not installed.
        InfraError: ``mkfs.erofs`` failed (its last lines in the message).
    """
    src = Path(src_dir)
    if not src.is_dir():
        raise UsageError(f"{src_dir}: {'not a folder' if src.exists() else 'no such folder'}",
                         "give the folder to push")
    exe = shutil.which("mkfs.erofs")
    if exe is None:
        raise UsageError("an image dataset needs mkfs.erofs, which is not installed",
                         "install erofs-utils (Debian: apt-get install erofs-utils)")
    files = dirs = nbytes = 0
    for root, dnames, fnames in os.walk(src):  # a symlink to a folder is in dnames
        for name in dnames + fnames:
            st = os.lstat(os.path.join(root, name))
            if stat.S_ISDIR(st.st_mode):
                dirs += 1
            elif stat.S_ISREG(st.st_mode):
                files += 1
                nbytes += st.st_size
    r = subprocess.run([exe, "--quiet", "--all-root", "--preserve-mtime", "-x", "-1",
                        str(out), str(src)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        tail = " ".join((r.stderr or r.stdout).strip().splitlines()[-3:])
        raise InfraError(f"mkfs.erofs {src_dir} failed (exit {r.returncode}): {tail}")
    return {"files": files, "dirs": dirs, "bytes": nbytes}


def push(src_dir: str | os.PathLike, url: str, **push_kw):
    """Push folder ``src_dir`` as an image dataset at ``url`` (module docstring).

    Args:
        src_dir: the folder.
        url: as :func:`hypercli.mount.pack.push`.
        push_kw: ``chunk_size``, ``jobs``, ``endpoint_url``, ``progress`` of
            :func:`hypercli.mount.pack.push`.
    Returns:
        ``(PushReport of the image, source counts)``.
    Raises:
        UsageError, InfraError: as :func:`build`; and what ``pack.push`` raises.
    """
    from hypercli.mount import pack
    with tempfile.TemporaryDirectory(prefix="hyper-image-") as tmp:
        folder = Path(tmp) / "image"
        folder.mkdir()
        source = build(src_dir, folder / IMAGE)
        report = pack.push(folder, url, extra={"layout": LAYOUT, "source": source},
                           **push_kw)
    return report, source


def is_image(manifest: dict) -> bool:
    """Whether a dataset manifest is an image dataset's."""
    return manifest.get("layout") == LAYOUT


def dataset_is_image(url: str, *, endpoint_url: str | None = None) -> bool:
    """Whether the dataset at ``url`` is an image dataset (reads its manifest).

    Raises:
        UsageError: no dataset there; DatasetError: a bad manifest; StoreError.
    """
    from hypercli.mount.pack import load_manifest
    from hypercli.mount.store import open_store
    return is_image(load_manifest(open_store(url, endpoint_url=endpoint_url)))


def _key(mountpoint: str | os.PathLike) -> str:
    """The name of ``mountpoint``'s private folder: 16 hex digits of the SHA-256 of its
    absolute path."""
    return hashlib.sha256(os.fsencode(os.path.abspath(mountpoint))).hexdigest()[:16]


def backing_dir(cache_dir: str | os.PathLike, mountpoint: str) -> Path:
    """The private folder where the image's FUSE mount is made for ``mountpoint``."""
    return Path(cache_dir).absolute() / "image-mounts" / _key(mountpoint)


def pid_file(cache_dir: str | os.PathLike, mountpoint: str) -> Path:
    """The file beside :func:`backing_dir` holding the pid of the daemon serving the image
    mounted at ``mountpoint``: once that daemon has died, the EROFS mount still answers
    ``statfs`` and lists what the kernel holds, but its other reads fail (ENOTCONN), so a
    node's mount command (:func:`hypercli.providers.runtime.mount_command`) checks it."""
    # a relative cache_dir stays relative (the node's mount command is run from its home)
    return Path(cache_dir) / "image-mounts" / f"{_key(mountpoint)}.pid"


def mount(url: str, mountpoint: str | os.PathLike, *, cache_dir: str | os.PathLike,
          cache_bytes: int, endpoint_url: str | None = None, allow_other: bool = False,
          timeout: float = 60.0) -> int:
    """Mount the image dataset at ``url`` at ``mountpoint`` (module docstring); returns once
    it is up, with the pid of the daemon serving the image (it ends when the mount point is
    unmounted).

    Args:
        url, cache_dir, cache_bytes, endpoint_url, allow_other, timeout: as
            :func:`hypercli.mount.fusefs.mount` (bytes, s).
    Raises:
        UsageError: not an image dataset, the mount point is missing or mounted, or no
            right to mount EROFS (not root).
        InfraError: the image's FUSE mount failed, or the kernel refused the image (its
            reason in the message).
        DatasetError, StoreError: as :func:`hypercli.mount.fusefs.mount`.
    """
    from hypercli.mount import fusefs
    mp = os.path.abspath(mountpoint)
    if os.path.islink(mp):  # mount(2) would follow it: the mount would land elsewhere
        raise UsageError(f"{mp}: a symlink, not a folder", "give a real folder as the "
                         "mount point")
    fusefs._check_mountpoint(mp)
    if not dataset_is_image(url, endpoint_url=endpoint_url):
        raise UsageError(f"{url} is not an image dataset",
                         "mount it with `hyper data mount`, or push it with --image")
    inner = _private_dir(cache_dir, mp)
    pid = fusefs.mount(url, inner, cache_dir=cache_dir, cache_bytes=cache_bytes,
                       endpoint_url=endpoint_url, foreground=False, allow_other=allow_other,
                       timeout=timeout, warm_entries=0, store_chunks=True)
    try:
        mount_file(inner / IMAGE, mp, url)
        fd = os.open(pid_file(cache_dir, mp),
                     os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(f"{pid}\n")
    finally:  # the image's FUSE mount stays only as the EROFS mount's backing file
        try:
            fusefs.unmount(inner, lazy=True)
        except (InfraError, UsageError):
            pass
    return pid


def mount_file(path: str | os.PathLike, mountpoint: str | os.PathLike, what: str) -> None:
    """Mount the EROFS image file ``path`` at ``mountpoint``, ``ro,nosuid,nodev``
    (``mount(2)``, a file-backed EROFS mount). ``what`` names the dataset in errors.

    The image must be a regular file alone in its folder (:func:`_check_image`), and
    mounting follows no symlink at ``mountpoint``.

    Raises:
        UsageError: no right to mount (not root); the mount point is a symlink.
        DatasetError: ``path`` is not a regular file alone in its folder.
        InfraError: the kernel refused the image (its reason in the message).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    mp = os.path.abspath(mountpoint)
    if os.path.islink(mp):  # mount(2) would follow it: the mount would land elsewhere
        raise UsageError(f"{mp}: a symlink, not a folder", "give a real folder as the "
                         "mount point")
    _check_image(what, Path(path).parent)
    if libc.mount(os.fsencode(os.path.abspath(path)), os.fsencode(mp), b"erofs",
                  MS_RDONLY | MS_NOSUID | MS_NODEV, OPTIONS) != 0:
        err = ctypes.get_errno()
        if err == 1:  # EPERM
            raise UsageError(f"mounting the image dataset {what} at {mp} needs root",
                             "run as root on the node, or push the dataset without --image")
        raise InfraError(f"the kernel refused the image of {what} at {mp}: "
                         f"{os.strerror(err)}", "either the dataset's image.erofs is not an "
                         "EROFS image (push the folder again with --image), or the node's "
                         "kernel lacks EROFS with file-backed mounts (Linux ≥ 6.12; dmesg "
                         "says which)")


def _private_dir(cache_dir: str | os.PathLike, mp: str) -> Path:
    """:func:`backing_dir` of ``mp``, made (mode 0700) or checked: each of ``image-mounts``
    and its ``<key>`` must be a real folder of this user's that no one else can write (not
    a symlink someone planted, which ``fusermount3`` would follow). A FUSE mount of
    hypercli's left there by a mount that failed half-way is detached; anything else
    mounted there is refused, never unmounted.

    Raises:
        UsageError: naming the folder that is not this user's own, or what is mounted there.
    """
    from hypercli.mount import fusefs
    inner = backing_dir(cache_dir, mp)
    inner.parent.parent.mkdir(parents=True, exist_ok=True)
    for folder in (inner.parent, inner):
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        kind = fusefs.mount_type(str(folder))
        if kind == "fuse.hyper" and folder == inner:  # left by a mount failed half-way
            fusefs.unmount(inner, lazy=True)
        elif kind is not None:
            raise UsageError(f"{folder}: a {kind} file system is mounted there, not "
                             "hypercli's", f"unmount it (`umount {folder}`)")
        st = os.lstat(folder)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise UsageError(f"{folder}: not a private folder of this user's (a symlink, "
                             "another owner's, or writable by others)",
                             "remove it: hypercli makes it again")
    return inner


def _check_image(url: str, inner: Path) -> None:
    """Check that the dataset mounted at ``inner`` is one regular file ``image.erofs`` and
    nothing else: a symlink there would have the kernel mount whatever file it names on
    this node, a folder or other files are not an image dataset's.

    Raises:
        DatasetError: naming what the dataset holds instead.
    """
    from hypercli.mount.pack import DatasetError
    names = sorted(os.listdir(inner))
    try:
        st = os.lstat(inner / IMAGE)
    except FileNotFoundError:
        st = None
    if names != [IMAGE] or st is None or not stat.S_ISREG(st.st_mode):
        what = ("a symlink" if st and stat.S_ISLNK(st.st_mode) else "a folder"
                if st and stat.S_ISDIR(st.st_mode) else "a regular file" if st else "missing")
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        raise DatasetError(f"{url}: not an image dataset's contents: it must hold one file "
                           f"{IMAGE} and nothing else; {IMAGE} is {what}, entries: {shown}",
                           "push the folder again with `hyper data push --image`")


def mounted_image(mountpoint: str | os.PathLike) -> bool:
    """Whether the mount on top at ``mountpoint`` is an image mount made by :func:`mount`
    (an EROFS mount whose backing file is an ``image-mounts/<key>/image.erofs`` of this
    module, in private folders of this user's with the daemon's pid file beside them), read
    from ``/proc/self/mountinfo`` (proc(5)). An EROFS mount made otherwise is not."""
    from hypercli.mount.fusefs import top_mount
    mp = os.path.abspath(mountpoint)
    try:
        top = top_mount(mp)
    except OSError:
        return False
    if top is None or top[0] != "erofs" or not top[1].endswith(
            f"/image-mounts/{_key(mp)}/{IMAGE}"):
        return False
    inner = Path(top[1]).parent  # made 0700 by _private_dir, the daemon's pid beside it
    try:
        for path, kind in ((inner.parent, stat.S_ISDIR), (inner, stat.S_ISDIR),
                           (inner.with_name(inner.name + ".pid"), stat.S_ISREG)):
            st = os.lstat(path)
            if not kind(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
                return False
    except OSError:
        return False
    return True


def unmount(mountpoint: str | os.PathLike, *, lazy: bool = False) -> None:
    """Unmount an image mount made by :func:`mount` (``umount2``; ``MNT_DETACH`` when lazy);
    its daemon then ends.

    Raises:
        UsageError: no image mount of hypercli's is on top at ``mountpoint``.
        InfraError: the kernel refused (busy: a program still uses it; no right: not root).
    """
    mp = os.path.abspath(mountpoint)
    if not mounted_image(mp):
        raise UsageError(f"{mp}: no image dataset of hypercli's is mounted there")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(mp.encode(), 2 if lazy else 0) != 0:  # MNT_DETACH
        raise InfraError(f"{mp}: cannot unmount: {os.strerror(ctypes.get_errno())}",
                         "close the programs using it, or unmount lazily")
