"""Image datasets: a folder pushed as one EROFS image, its files served by the kernel.

A dataset mount answers every open, lookup and read of every file in its daemon: with many
data-loader workers on few cores that daemon, not the disk, sets the pace (bench/RESULTS.md
§14). An *image dataset* moves the per-file work into the kernel. Rules:

- **Push** (:func:`push`, ``hyper data push --image``): the folder is made into one
  read-only EROFS image by ``mkfs.erofs`` (Debian's ``erofs-utils``; files, folders,
  symlinks and modes kept, owned by root), and the image is pushed as a one-file dataset
  (:func:`hypercli.mount.pack.push`: content-defined chunks, each checked by SHA-256, only
  new chunks uploaded) whose manifest says ``"layout": "erofs"`` and counts the source's
  files, folders and bytes under ``"source"``.
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
import subprocess
import tempfile
from pathlib import Path

from hypercli.errors import InfraError, UsageError

LAYOUT = "erofs"          # the manifest's "layout" of an image dataset
IMAGE = "image.erofs"     # the one file of an image dataset
MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4   # <sys/mount.h>


def build(src_dir: str | os.PathLike, out: str | os.PathLike) -> dict:
    """Make the EROFS image ``out`` of folder ``src_dir`` with ``mkfs.erofs`` (uncompressed,
    files owned by root, modes, symlinks and modification times kept).

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
    for root, dnames, fnames in os.walk(src):
        dirs += len(dnames)
        for name in fnames:
            st = os.lstat(os.path.join(root, name))
            if os.path.isfile(os.path.join(root, name)) and not os.path.islink(
                    os.path.join(root, name)):
                files += 1
                nbytes += st.st_size
    r = subprocess.run([exe, "--quiet", "--all-root", "--preserve-mtime", str(out), str(src)],
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


def backing_dir(cache_dir: str | os.PathLike, mountpoint: str) -> Path:
    """The private folder where the image's FUSE mount is made for ``mountpoint``."""
    key = hashlib.sha256(os.path.abspath(mountpoint).encode()).hexdigest()[:16]
    return Path(cache_dir).absolute() / "image-mounts" / key


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
    fusefs._check_mountpoint(mp)
    if not dataset_is_image(url, endpoint_url=endpoint_url):
        raise UsageError(f"{url} is not an image dataset",
                         "mount it with `hyper data mount`, or push it with --image")
    inner = backing_dir(cache_dir, mp)
    if os.path.ismount(inner):  # a backing mount left by a mount that failed half-way
        fusefs.unmount(inner, lazy=True)
    inner.mkdir(parents=True, exist_ok=True)
    pid = fusefs.mount(url, inner, cache_dir=cache_dir, cache_bytes=cache_bytes,
                       endpoint_url=endpoint_url, foreground=False, allow_other=allow_other,
                       timeout=timeout, warm_entries=0, store_chunks=True)
    try:
        mount_file(inner / IMAGE, mp, url)
    finally:  # the image's FUSE mount stays only as the EROFS mount's backing file
        try:
            fusefs.unmount(inner, lazy=True)
        except InfraError:
            pass
    return pid


def mount_file(path: str | os.PathLike, mountpoint: str | os.PathLike, what: str) -> None:
    """Mount the EROFS image file ``path`` at ``mountpoint``, ``ro,nosuid,nodev``
    (``mount(2)``, a file-backed EROFS mount). ``what`` names the dataset in errors.

    Raises:
        UsageError: no right to mount (not root).
        InfraError: the kernel refused the image (its reason in the message).
    """
    libc = ctypes.CDLL(None, use_errno=True)
    mp = os.path.abspath(mountpoint)
    if libc.mount(os.fsencode(os.path.abspath(path)), os.fsencode(mp), b"erofs",
                  MS_RDONLY | MS_NOSUID | MS_NODEV, None) != 0:
        err = ctypes.get_errno()
        if err == 1:  # EPERM
            raise UsageError(f"mounting the image dataset {what} at {mp} needs root",
                             "run as root on the node, or push the dataset without --image")
        raise InfraError(f"the kernel refused the image of {what} at {mp}: "
                         f"{os.strerror(err)}", "the node's kernel needs EROFS with "
                         "file-backed mounts (Linux ≥ 6.12)")


def mounted_image(mountpoint: str | os.PathLike) -> bool:
    """Whether the mount on top at ``mountpoint`` is an image mount made by :func:`mount`
    (an EROFS mount whose backing file is an ``image-mounts/<key>/image.erofs`` of this
    module), read from ``/proc/self/mountinfo`` (proc(5))."""
    mp = os.path.abspath(mountpoint)
    top = None
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                target = fields[4].encode().decode("unicode_escape")
                if target == mp:
                    top = fields
    except OSError:
        return False
    if top is None:
        return False
    rest = top[top.index("-") + 1:]
    key = hashlib.sha256(mp.encode()).hexdigest()[:16]
    return len(rest) >= 2 and rest[0] == "erofs" and rest[1].endswith(
        f"/image-mounts/{key}/{IMAGE}")


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
