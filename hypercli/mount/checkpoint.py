"""Checkpoints that follow a task across its attempts: a folder (``HYPER_CHECKPOINT``) saved
to an object store in generations and restored, on whatever node, for the next attempt.

Under a checkpoint URL ``C`` (``<storage>/<workflow>/.checkpoints/<task>``, and
``.../<task>/rank-<r>`` for each rank of a multi-node task that keeps every rank's folder)::

    C/packs/<sha256>                 the blocks that were new at one save, concatenated
    C/gen/<attempt>.<seq>.json       one generation, written last:
        {"attempt", "seq", "time", "base": the generation it changes, or null,
         "files": {path: {"size", "mode", "n": number of blocks,
                          "blocks": {index: [sha256, pack, offset, length], ...}}}}

A *full* generation (``base`` null) lists every block of every file; a *delta* lists only the
blocks that differ from its base (the generation the node last saved or restored); a file it
does not list is gone. A chain of deltas ends at a full generation within FULL_EVERY saves.

Rules:
  * Files are cut into fixed blocks of BLOCK bytes, named by their SHA-256 (rsync's fixed
    blocks: a checkpoint rewritten in place changes only the blocks around the bytes that
    changed). A save uploads one pack holding only blocks no generation it knows of holds,
    then a manifest listing only what changed: a save sends little more than what changed
    (a 1 MiB change: 9 blocks of 128 KiB at worst, a small delta, and every FULL_EVERY saves a
    full manifest). A file whose size, mtime and ctime did not change is not read.
  * A save never takes a file that was being written: a file is taken only when no process
    has it open for writing before and after it is read (a read lease, ``F_SETLEASE``,
    is granted only then: fcntl(2), "Leases"; this catches a writer paused between two
    writes, or between O_TRUNC and its first write) and its size, mtime, ctime and inode
    are the same before and after the read; it is tried TRIES times, then left at the
    version the last generation holds, with a warning on stderr
    (:mod:`hypercli.mount.checkpoint_folder`). The final save after an attempt that
    did not succeed (``stopped_at``: when it ended) writes nothing when any file or folder
    changed within STOP_MARGIN s of that end: a task killed in the middle of writing leaves
    a torn file that no longer changes, and the last complete generation must win. If a
    periodic save took such a file as the attempt ended, the final save writes a copy of
    the newest generation written before, so that one is restored.
  * A generation exists once its manifest does (written after its pack): a save cut short
    leaves no generation, and restore takes the newest *complete* one.
  * Generations are named by attempt number then sequence, and restore takes the greatest:
    a late save of an older attempt (a fenced node that comes back) never wins over a newer
    attempt's generations, and nothing is ever overwritten.
  * A task can write its own checkpoint store, and restore runs as root outside its
    container: every manifest is checked first (:mod:`hypercli.mount.checkpoint_manifest`:
    plain relative paths only, modes masked to 0o777, blocks well formed), and every folder
    and file on the way in is opened relative to the folder's own descriptor without
    following symlinks (``O_NOFOLLOW``, ``openat``): a path through a symlink in the folder is
    refused, so nothing is ever written outside it. Saves read files the same way.
  * Restore makes the folder exactly the generation's files (others removed) and checks
    every block's SHA-256; a pack mostly made of blocks still in use is fetched whole, one
    holding few of them by ranged reads of those blocks only (packs of old saves are mostly
    superseded). A file is renamed into place when whole.
  * What a node knows (blocks, files' sizes, mtimes and ctimes, the generation its folder is)
    is kept in a state file beside the folder, under an flock, so a periodic save and the
    final one never run at once.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import os
import secrets
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from hypercli.mount.checkpoint_folder import (FolderError, Pack,  # noqa: F401
                                              changed_since, open_dirs, open_folder,
                                              read_stable, remove_tree, same_stat,
                                              walk_files)
from hypercli.mount.checkpoint_manifest import (BLOCK, FULL_EVERY, GEN_NAME,  # noqa: F401
                                                BadManifest, resolve)
from hypercli.mount.store import Store, StoreError, open_store

WHOLE_PACK = 0.5  #: fetch a pack whole when at least this share of it is still in use
PART = 16 << 20   #: bytes: a pack fetched whole is read in parallel ranges of at least this
#: s before an unsuccessful attempt's end within which a change makes its final save write
#: nothing: a process killed mid-write ends at once, and a container's end reaches the
#: wrapper through its runtime's client well within this
STOP_MARGIN = 2.0


@dataclass
class SaveReport:
    """What a save did: the generation written (None when nothing changed, or when the final
    save of a stopped attempt was refused), bytes uploaded (pack and manifest), bytes of the
    folder, bytes of files read (changed), and one line per file not taken as it is now."""

    generation: str | None
    uploaded: int
    total: int
    read: int
    warnings: list[str] = field(default_factory=list)


@dataclass
class RestoreReport:
    """What a restore did: the generation restored (None: there is none yet), bytes
    downloaded, bytes of the folder."""

    generation: str | None
    downloaded: int
    total: int


def _gen_name(attempt: int, seq: int) -> str:
    return f"gen/{attempt:08d}.{seq:08d}.json"


def generations(store: Store) -> list[tuple[int, int]]:
    """(attempt, seq) of every complete generation, oldest first."""
    out = []
    for key, _ in store.list("gen/"):
        m = GEN_NAME.fullmatch(key)
        if m:
            out.append((int(m.group(1)), int(m.group(2))))
    return sorted(out)


@contextmanager
def _state(path: Path):
    """The node's state of a checkpoint folder, read and written under an flock."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError):
            st = {}
        if not isinstance(st, dict):
            st = {}
        st.setdefault("blocks", {})  # sha256 → [pack, offset, length]
        st.setdefault("files", {})   # path → {"size", "mtime_ns", "ctime_ns", "mode", "blocks"}
        yield st
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, path)
    finally:
        os.close(fd)


def save(folder: str | os.PathLike, url: str, attempt: int,
         state_path: str | os.PathLike, stopped_at: float | None = None) -> SaveReport:
    """Save the folder as a new generation of ``attempt`` (nothing when no file changed).
    A file being written is never taken (module docstring): it stays at the version of the
    last generation, or out of this one when it has none, with a line in ``warnings``.

    Args:
        folder: the task's checkpoint folder.
        url: the checkpoint URL (``file://``, ``s3://``, ``gs://``, ``az://``).
        attempt: the attempt number (generations are ordered by it first).
        state_path: the node's state file for this folder.
        stopped_at: for the final save of an attempt that did not succeed, when it ended
            (s since the epoch): nothing is saved when anything in the folder changed less
            than STOP_MARGIN s before (and a generation that took such a change is
            superseded by a copy of the one written before it).
    Raises:
        StoreError: the store failed (no generation is written then).
        BadManifest: the generation to go back to is malformed.
        FolderError: the folder is a symlink or not a folder.
    """
    store = open_store(url)
    with _state(Path(state_path)) as st, open_folder(Path(folder)) as rfd:
        if stopped_at is not None:
            cutoff = int((stopped_at - STOP_MARGIN) * 1e9)
            late = changed_since(rfd, cutoff)
            if late:
                return _stopped(store, st, attempt, cutoff, late)
        return _save(store, rfd, attempt, st, Path(state_path).parent)


def _stopped(store: Store, st: dict, attempt: int, cutoff: int, late: list[str]) -> SaveReport:
    """The final save of an attempt that did not succeed, when ``late`` (paths) changed after
    ``cutoff`` (ns): nothing of now is saved. When the newest generation itself took a file
    that changed after ``cutoff`` (a periodic save that ran as the attempt ended), a copy of
    the newest generation written before the first such change is saved over it."""
    late = [x for x in late if x != "."] or ["the folder"]
    shown = ", ".join(late[:3]) + (f" and {len(late) - 3} more" if len(late) > 3 else "")
    note = f"{shown} changed as the attempt ended: not saved"
    bad = sorted(rel for rel, f in st["files"].items() if (f.get("ctime_ns") or 0) > cutoff)
    if not bad or not st.get("gen"):
        return SaveReport(None, 0, 0, 0, [
            f"{note}; the last complete generation ({st.get('gen') or 'none yet'}) stays the "
            "newest"])
    # a generation written before the first of those changes cannot hold them
    safe = _written_before(store, min(st["files"][rel]["ctime_ns"] for rel in bad), attempt)
    if safe is None:
        return SaveReport(None, 0, 0, 0, [
            f"{note}; {st['gen']} holds {', '.join(bad[:3])} as it was then, and no "
            "generation before it was written"])
    _, files = resolve(store.get, safe)
    seq = st["seq"] + 1 if st.get("attempt") == attempt else 1
    gen = {"attempt": attempt, "seq": seq, "time": time.time(), "base": None, "files": {
        rel: {"size": f["size"], "mode": f["mode"], "n": len(f["blocks"]),
              "blocks": {str(i): list(b) for i, b in enumerate(f["blocks"])}}
        for rel, f in files.items()}}
    name = _gen_name(attempt, seq)
    data = json.dumps(gen, separators=(",", ":")).encode()
    store.put(name, data)
    st["blocks"].update({b[0]: list(b[1:]) for f in files.values() for b in f["blocks"]})
    st.update(attempt=attempt, seq=seq, gen=name, chain=0, files={
        rel: {"size": f["size"], "mode": f["mode"], "mtime_ns": None, "ctime_ns": None,
              "blocks": [b[0] for b in f["blocks"]]} for rel, f in files.items()})
    return SaveReport(name, len(data), sum(f["size"] for f in files.values()), 0, [
        f"{note}; {', '.join(bad[:3])} of the newest generation changed then too: {name} "
        f"is a copy of {safe}, written before"])


def _written_before(store: Store, cutoff: int, attempt: int, look: int = 64) -> str | None:
    """The newest generation of ``attempt`` or before written before ``cutoff`` (ns since
    the epoch, by its manifest's time), among the ``look`` newest; or None."""
    for a, s in [g for g in generations(store) if g[0] <= attempt][::-1][:look]:
        name = _gen_name(a, s)
        try:
            t = json.loads(store.get(name)).get("time")
        except (StoreError, ValueError, AttributeError, RecursionError):
            continue
        if isinstance(t, (int, float)) and t * 1e9 < cutoff:
            return name
    return None


def _save(store: Store, rfd: int, attempt: int, st: dict, tmpdir: Path) -> SaveReport:
    """:func:`save`'s work, under the state's lock."""
    known, old_files = st["blocks"], st["files"]
    files, changed, total, read, warnings = {}, False, 0, 0, []
    with tempfile.NamedTemporaryFile(dir=tmpdir) as f:
        pack = Pack(f)
        for rel, dfd, name in walk_files(rfd):
            old = old_files.get(rel)
            usable = bool(old) and all(b in known for b in old["blocks"])
            try:
                s = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except OSError:
                continue
            if usable and same_stat(old, s):
                files[rel] = old
                total += s.st_size
                continue
            s, got = read_stable(dfd, name, pack, known)
            if s is None:
                if usable:
                    files[rel] = old
                    total += old["size"]
                warnings.append(f"{rel}: not saved as it is now, {got}; "
                                + ("its previous version is kept" if usable
                                   else "it is left out of this generation"))
                continue
            changed = True
            read += s.st_size
            total += s.st_size
            files[rel] = {"size": s.st_size, "mtime_ns": s.st_mtime_ns,
                          "ctime_ns": s.st_ctime_ns, "mode": s.st_mode & 0o777, "blocks": got}
        if not changed and set(files) == set(old_files) and st.get("attempt") == attempt:
            return SaveReport(None, 0, total, 0, warnings)
        uploaded = f.tell()
        pack_name = None
        if pack.fresh:
            pack_name = f"packs/{pack.h.hexdigest()}"
            f.flush()
            store.put_file(pack_name, f.name)
    for sha, (off, length) in pack.fresh.items():
        known[sha] = [pack_name, off, length]
    seq = st["seq"] + 1 if st.get("attempt") == attempt else 1
    delta = bool(st.get("gen")) and st.get("chain", 0) < FULL_EVERY
    gen = {"attempt": attempt, "seq": seq, "time": time.time(),
           "base": st["gen"] if delta else None, "files": {}}
    for rel, f in files.items():
        before = (old_files.get(rel) or {}).get("blocks") or [] if delta else []
        gen["files"][rel] = {
            "size": f["size"], "mode": f["mode"], "n": len(f["blocks"]),
            "blocks": {str(i): [b, *known[b]] for i, b in enumerate(f["blocks"])
                       if i >= len(before) or before[i] != b}}
    name = _gen_name(attempt, seq)
    data = json.dumps(gen, separators=(",", ":")).encode()
    store.put(name, data)  # last: the generation is complete
    st.update(attempt=attempt, seq=seq, files=files, gen=name,
              chain=st.get("chain", 0) + 1 if delta else 0)
    return SaveReport(name, uploaded + len(data), total, read, warnings)


def newest(store: Store) -> tuple[list[str], set[str]] | None:
    """What restoring the newest complete generation reads: (the generations of its chain,
    newest first; the packs its files use), or None when there is none.
    Raises BadManifest, StoreError."""
    gens = generations(store)
    if not gens:
        return None
    chain, files = resolve(store.get, _gen_name(*gens[-1]))
    return chain, {b[1] for f in files.values() for b in f["blocks"]}


def _spans(blocks: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Sorted (offset, length) byte ranges merged where adjacent."""
    merged: list[list[int]] = []
    for off, length in sorted(set(blocks)):
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1][1] += length
        else:
            merged.append([off, length])
    return [(o, n) for o, n in merged]


def restore(url: str, folder: str | os.PathLike, state_path: str | os.PathLike,
            jobs: int = 8) -> RestoreReport:
    """Make ``folder`` the newest complete generation at ``url`` (module docstring). Blocks
    are written into their files as the packs stream in, each checked as it completes. One
    restore at a time holds the folder (an flock beside ``state_path``): the ranks of a gang
    whose nodes share a file system (local nodes) restore it once, the others find it done.
    Nothing is written outside ``folder``: every path is checked, and every folder on the way
    opened without following symlinks.

    Raises:
        BadManifest: the generation's manifest is malformed or names a path that is not a
            plain relative one, or one through a symlink in the folder (nothing written).
        StoreError: the store failed, or a block did not match its SHA-256.
        FolderError: the folder is a symlink or not a folder.
    """
    store = open_store(url)
    root = Path(folder)
    gens = generations(store)
    if not gens:
        root.mkdir(parents=True, exist_ok=True)
        return RestoreReport(None, 0, 0)
    name = _gen_name(*gens[-1])
    with _state(Path(state_path)) as st, open_folder(root) as rfd:  # one restore at a time
        if st.get("gen") == name and _unchanged(rfd, st["files"]):
            return RestoreReport(name, 0, sum(f["size"] for f in st["files"].values()))
        return _restore_into(store, rfd, st, name, gens[-1], jobs)


def _unchanged(root_fd: int, files: dict) -> bool:
    """Whether the folder holds exactly ``files`` (a state's "files"), by size, mtime and
    ctime: the folder is already the generation the state names (restored by another rank
    that shares it, or saved here and not touched since)."""
    here = {rel: os.stat(name, dir_fd=dfd, follow_symlinks=False)
            for rel, dfd, name in walk_files(root_fd)}
    return set(here) == set(files) and all(same_stat(f, here[rel]) for rel, f in files.items())


def _let_go(temps: dict, dirs: dict) -> None:
    """Close and remove a restore's temporary files (``rel -> (dir fd, name, fd)``) and
    close its folders' fds (``dirs``, the first of which is the caller's)."""
    for d, tmp, fd in temps.values():
        os.close(fd)
        try:
            os.unlink(tmp, dir_fd=d)
        except OSError:
            pass
    for fd in list(dirs.values())[1:]:
        os.close(fd)


def _restore_into(store, rfd: int, st: dict, name: str, gen: tuple[int, int],
                  jobs: int) -> RestoreReport:
    """:func:`restore`'s work, under the state's lock: fetch generation ``name`` into the
    folder ``rfd`` and record it in ``st``."""
    _, files = resolve(store.get, name)
    sizes = dict(store.list("packs/"))
    ranged = getattr(store, "get_range", None)
    stream = getattr(store, "iter_chunks", None)
    # pack → {pack offset: (length, sha, [(fd, file offset), ...])}
    wanted: dict[str, dict[int, tuple]] = {}
    dirs = {"": rfd}
    temps: dict[str, tuple[int, str, int]] = {}  # path → (folder fd, temp name, fd)
    try:
        for rel, f in files.items():
            d = open_dirs(rfd, dirs, rel, name)
            tmp = f".hyper-restoring.{secrets.token_hex(8)}"
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600, dir_fd=d)
            temps[rel] = (d, tmp, fd)
            os.ftruncate(fd, f["size"])
            pos = 0
            for sha, pack, off, length in f["blocks"]:
                entry = wanted.setdefault(pack, {}).setdefault(off, (length, sha, []))
                if entry[:2] != (length, sha):
                    raise BadManifest(name, rel, f"{pack} at {off} is given two ways")
                entry[2].append((fd, pos))
                pos += length
        for pack, blocks in wanted.items():
            offs = sorted(blocks)
            for a, b in zip(offs, offs[1:]):
                if a + blocks[a][0] > b:
                    raise BadManifest(name, None, f"blocks of {pack} overlap at {b}")

        def put(pack: str, off: int, data: bytes) -> None:
            length, sha, targets = wanted[pack][off]
            if len(data) != length or hashlib.sha256(data).hexdigest() != sha:
                raise StoreError(f"{store.url}/{pack}: a block at {off} does not match its "
                                 "SHA-256")
            for fd, pos in targets:
                os.pwrite(fd, data, pos)

        def jobs_of(pack: str) -> list[tuple[str, int, int, list[int]]]:
            """(pack, start, length, block offsets) ranges to stream: the whole pack, cut
            into up to ``jobs`` parts on block boundaries, when most of it is in use (one
            stream is CPU-bound here: hashing and writing run in the fetching thread); else
            each run of blocks in use."""
            blocks = wanted[pack]
            offs = sorted(blocks)
            spans = _spans([(o, blocks[o][0]) for o in offs])
            live = sum(n for _, n in spans)
            size = sizes.get(pack, live)
            if stream is None:
                return [(pack, 0, size, offs)]
            if ranged is not None and live < WHOLE_PACK * size:
                return [(pack, o, n, [b for b in offs if o <= b < o + n]) for o, n in spans]
            parts = max(1, min(jobs, size // PART))
            cuts = [offs[len(offs) * k // parts] for k in range(parts)] + [size]
            return [(pack, cuts[k], cuts[k + 1] - cuts[k],
                     [b for b in offs if cuts[k] <= b < cuts[k + 1]])
                    for k in range(parts) if cuts[k] < cuts[k + 1]]

        def fetch(job) -> int:
            pack, first, length, todo = job
            blocks = wanted[pack]
            chunks = (stream(pack, start=first, length=length) if stream
                      else iter([store.get(pack)]))
            buf, at, n, i = bytearray(), first, 0, 0  # at: the pack offset of buf[0]
            for chunk in chunks:
                buf += chunk
                n += len(chunk)
                while i < len(todo) and todo[i] + blocks[todo[i]][0] <= at + len(buf):
                    off = todo[i]
                    put(pack, off, bytes(buf[off - at:off - at + blocks[off][0]]))
                    i += 1
                drop = min(len(buf), (todo[i] - at) if i < len(todo) else len(buf))
                del buf[:drop]  # what no block still to come needs
                at += drop
            if i < len(todo):
                raise StoreError(f"{store.url}/{pack}: shorter than its blocks")
            return n

        work = [j for pack in sorted(wanted) for j in jobs_of(pack)]
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            downloaded = sum(pool.map(fetch, work))
    except BaseException:
        _let_go(temps, dirs)
        raise
    total, kept = 0, {}
    try:
        for rel, (d, tmp, fd) in list(temps.items()):
            os.fchmod(fd, files[rel]["mode"])  # permission bits only (checked)
            os.close(fd)
            del temps[rel]
            base = rel.rsplit("/", 1)[-1]
            try:
                os.replace(tmp, base, src_dir_fd=d, dst_dir_fd=d)
            except OSError as e:  # a folder of the task's where the generation has a file
                if e.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST):
                    os.unlink(tmp, dir_fd=d)
                    raise
                remove_tree(base, d)
                os.replace(tmp, base, src_dir_fd=d, dst_dir_fd=d)
            kept[rel] = os.stat(base, dir_fd=d, follow_symlinks=False)
            total += files[rel]["size"]
        for rel, dfd, fname in walk_files(rfd):
            if rel not in files:
                os.unlink(fname, dir_fd=dfd)
    finally:
        _let_go(temps, dirs)
    st["blocks"] = {b[0]: list(b[1:]) for f in files.values() for b in f["blocks"]}
    st["files"] = {rel: {"size": f["size"], "mode": f["mode"],
                         "mtime_ns": kept[rel].st_mtime_ns, "ctime_ns": kept[rel].st_ctime_ns,
                         "blocks": [b[0] for b in f["blocks"]]}
                   for rel, f in files.items()}
    attempt, seq = gen
    st.update(attempt=attempt, seq=seq, gen=name, chain=FULL_EVERY)
    return RestoreReport(name, downloaded, total)
