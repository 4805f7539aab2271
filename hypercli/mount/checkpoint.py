"""Checkpoints that follow a task across its attempts: a folder (``HYPER_CHECKPOINT``) saved
to an object store in generations and restored, on whatever node, for the next attempt.

Under a checkpoint URL ``C`` (``<storage>/<workflow>/.checkpoints/<task>``)::

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
    full manifest). A file whose size and mtime did not change is not read.
  * A generation exists once its manifest does (written after its pack): a save cut short
    leaves no generation, and restore takes the newest *complete* one.
  * Generations are named by attempt number then sequence, and restore takes the greatest:
    a late save of an older attempt (a fenced node that comes back) never wins over a newer
    attempt's generations, and nothing is ever overwritten.
  * Restore makes the folder exactly the generation's files (others removed) and checks
    every block's SHA-256; a pack mostly made of blocks still in use is fetched whole, one
    holding few of them by ranged reads of those blocks only (packs of old saves are mostly
    superseded). A file is renamed into place when whole.
  * What a node knows (blocks, files' sizes and mtimes, the generation its folder is) is kept
    in a state file beside the folder, under an flock, so a periodic save and the final one
    never run at once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hypercli.mount.store import NotFound, Store, StoreError, open_store

BLOCK = 128 << 10  #: bytes per block (an unaligned 1 MiB change spans 9 blocks)
FULL_EVERY = 20   #: at most this many deltas before a full generation
WHOLE_PACK = 0.5  #: fetch a pack whole when at least this share of it is still in use
PART = 16 << 20   #: bytes: a pack fetched whole is read in parallel ranges of at least this


@dataclass
class SaveReport:
    """What a save did: the generation written (None when nothing changed), bytes uploaded
    (pack and manifest), bytes of the folder, bytes of files read (changed)."""

    generation: str | None
    uploaded: int
    total: int
    read: int


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
        stem = key[len("gen/"):].removesuffix(".json")
        a, _, s = stem.partition(".")
        if a.isdigit() and s.isdigit():
            out.append((int(a), int(s)))
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
        st.setdefault("blocks", {})  # sha256 → [pack, offset, length]
        st.setdefault("files", {})   # path → {"size", "mtime_ns", "mode", "blocks": [sha]}
        yield st
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(st))
        os.replace(tmp, path)
    finally:
        os.close(fd)


def _walk(root: Path):
    for dirpath, dirs, files in os.walk(root):
        dirs.sort()
        for name in sorted(files):
            p = Path(dirpath) / name
            if p.is_file() and not p.is_symlink():
                yield p.relative_to(root).as_posix(), p


def save(folder: str | os.PathLike, url: str, attempt: int,
         state_path: str | os.PathLike) -> SaveReport:
    """Save the folder as a new generation of ``attempt`` (nothing when no file changed).

    Args:
        folder: the task's checkpoint folder.
        url: the checkpoint URL (``file://``, ``s3://``, ``gs://``, ``az://``).
        attempt: the attempt number (generations are ordered by it first).
        state_path: the node's state file for this folder.
    Raises:
        StoreError: the store failed (no generation is written then).
    """
    root = Path(folder)
    store = open_store(url)
    with _state(Path(state_path)) as st:
        known, old_files = st["blocks"], st["files"]
        files, changed, total, read = {}, False, 0, 0
        with tempfile.NamedTemporaryFile(dir=Path(state_path).parent) as pack:
            h = hashlib.sha256()
            fresh: dict[str, tuple[int, int]] = {}  # sha → (offset, length) in this pack
            for rel, p in _walk(root):
                s = p.stat()
                total += s.st_size
                old = old_files.get(rel)
                if old and old["size"] == s.st_size and old["mtime_ns"] == s.st_mtime_ns \
                        and all(b in known for b in old["blocks"]):
                    files[rel] = old
                    continue
                changed = True
                read += s.st_size
                blocks = []
                with open(p, "rb") as f:
                    for data in iter(lambda: f.read(BLOCK), b""):
                        sha = hashlib.sha256(data).hexdigest()
                        if sha not in known and sha not in fresh:
                            fresh[sha] = (pack.tell(), len(data))
                            pack.write(data)
                            h.update(data)
                        blocks.append(sha)
                files[rel] = {"size": s.st_size, "mtime_ns": s.st_mtime_ns,
                              "mode": s.st_mode & 0o777, "blocks": blocks}
            if not changed and set(files) == set(old_files) and st.get("attempt") == attempt:
                return SaveReport(None, 0, total, 0)
            uploaded = pack.tell()
            pack_name = None
            if fresh:
                pack_name = f"packs/{h.hexdigest()}"
                pack.flush()
                store.put_file(pack_name, pack.name)
        for sha, (off, length) in fresh.items():
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
        return SaveReport(name, uploaded + len(data), total, read)


def newest(store: Store) -> tuple[list[str], set[str]] | None:
    """What restoring the newest complete generation reads: (the generations of its chain,
    newest first; the packs its files use), or None when there is none."""
    gens = generations(store)
    if not gens:
        return None
    chain, files = _resolve(store, _gen_name(*gens[-1]))
    return chain, {b[1] for f in files.values() for b in f["blocks"]}


def _resolve(store: Store, name: str) -> tuple[list[str], dict]:
    """A generation's chain (its name, then the names of the generations it changes, back
    to a full one) and its full block lists: {path: {"size", "mode", "blocks": [[sha, pack,
    off, length], ...]}}."""
    names, chain = [], []
    while name is not None and len(chain) <= FULL_EVERY + 1:
        try:
            gen = json.loads(store.get(name))
        except (NotFound, ValueError) as e:
            raise StoreError(f"{store.url}/{name}: {e}") from None
        chain.append(gen)
        names.append(name)
        name = gen.get("base")
    if name is not None:
        raise StoreError(f"{store.url}: a chain of generations longer than {FULL_EVERY}")
    files: dict = {}
    for gen in reversed(chain):  # the full one first, then each delta over it
        out = {}
        for rel, f in gen["files"].items():
            prev = files.get(rel, {}).get("blocks", []) if gen.get("base") else []
            blocks = [prev[i] if i < len(prev) else None for i in range(f["n"])]
            for i, b in f["blocks"].items():
                blocks[int(i)] = b
            if None in blocks:
                raise StoreError(f"{store.url}: generation {gen['attempt']}.{gen['seq']} "
                                 f"leaves blocks of {rel} undefined")
            out[rel] = {"size": f["size"], "mode": f.get("mode", 0o644), "blocks": blocks}
        files = out
    return names, files


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

    Raises:
        StoreError: the store failed, or a block did not match its SHA-256.
    """
    store = open_store(url)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    gens = generations(store)
    if not gens:
        return RestoreReport(None, 0, 0)
    name = _gen_name(*gens[-1])
    with _state(Path(state_path)) as st:  # one restore at a time into one folder
        if st.get("gen") == name and _unchanged(root, st["files"]):
            return RestoreReport(name, 0, sum(f["size"] for f in st["files"].values()))
        return _restore_into(store, root, st, name, gens[-1], jobs)


def _unchanged(root: Path, files: dict) -> bool:
    """Whether ``root`` holds exactly ``files`` (a state's "files"), by size and mtime: the
    folder is already the generation the state names (restored by another rank that shares
    it, or saved here and not touched since)."""
    here = dict(_walk(root))
    if set(here) != set(files):
        return False
    for rel, f in files.items():
        s = here[rel].stat()
        if s.st_size != f["size"] or s.st_mtime_ns != f["mtime_ns"]:
            return False
    return True


def _restore_into(store, root: Path, st: dict, name: str, gen: tuple[int, int],
                  jobs: int) -> RestoreReport:
    """:func:`restore`'s work, under the state's lock: fetch generation ``name`` into
    ``root`` and record it in ``st``."""
    _, files = _resolve(store, name)
    sizes = dict(store.list("packs/"))
    ranged = getattr(store, "get_range", None)
    stream = getattr(store, "iter_chunks", None)
    # pack → {pack offset: (length, sha, [(fd, file offset), ...])}
    wanted: dict[str, dict[int, tuple]] = {}
    fds: dict[str, int] = {}
    try:
        for rel, f in files.items():
            part = (root / rel).with_name(Path(rel).name + ".restoring")
            part.parent.mkdir(parents=True, exist_ok=True)
            fd = fds[rel] = os.open(part, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, f["mode"])
            os.ftruncate(fd, f["size"])
            pos = 0
            for sha, pack, off, length in f["blocks"]:
                entry = wanted.setdefault(pack, {}).setdefault(off, (length, sha, []))
                entry[2].append((fd, pos))
                pos += length

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
        for rel, fd in fds.items():
            os.close(fd)
            (root / rel).with_name(Path(rel).name + ".restoring").unlink(missing_ok=True)
        raise
    total = 0
    for rel, fd in fds.items():
        os.close(fd)
        os.replace((root / rel).with_name(Path(rel).name + ".restoring"), root / rel)
        total += files[rel]["size"]
    for rel, p in list(_walk(root)):
        if rel not in files:
            p.unlink()
    st["blocks"] = {b[0]: b[1:] for f in files.values() for b in f["blocks"]}
    st["files"] = {rel: {"size": f["size"], "mode": f["mode"],
                         "mtime_ns": (root / rel).stat().st_mtime_ns,
                         "blocks": [b[0] for b in f["blocks"]]}
                   for rel, f in files.items()}
    attempt, seq = gen
    st.update(attempt=attempt, seq=seq, gen=name, chain=FULL_EVERY)
    return RestoreReport(name, downloaded, total)
