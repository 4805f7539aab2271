"""Checkpoints that follow a task across its attempts: a folder (``HYPER_CHECKPOINT``) saved
to an object store in generations and restored, on whatever node, for the next attempt.

Under a checkpoint URL ``C`` (``<storage>/<workflow>/<task>/checkpoint``)::

    C/packs/<sha256>                 blocks that were new at a save, concatenated
    C/gen/<attempt>.<seq>.json       one generation: {"attempt", "seq", "time", "files":
                                     {path: {"size", "mode", "blocks": [[sha256, pack,
                                     offset, length], ...]}}}, written last

Rules:
  * Files are cut into fixed blocks of BLOCK bytes, named by their SHA-256. A save uploads one
    pack holding only the blocks no earlier generation it knows of holds, then the generation
    that lists every file's blocks: what did not change is not sent again (fixed-size blocks,
    as rsync's; a checkpoint rewritten in place changes the blocks around the bytes that
    changed). A file whose size and mtime did not change since the last save is not read.
  * A generation exists once its manifest does (written after its pack): a save cut short
    leaves no generation, and restore takes the newest *complete* one.
  * Generations are named by attempt number then sequence, and restore takes the greatest:
    a late save of an older attempt (a fenced node that comes back) never wins over a newer
    attempt's generations, and nothing is ever overwritten.
  * Restore makes the folder exactly the generation's files (others removed), fetching each
    pack it needs once, and checks every block's SHA-256; a block that does not match is an
    error (nothing half-restored is left: files are renamed into place when whole).
  * What a node knows (blocks and where they are, files' sizes and mtimes) is kept in a state
    file beside the folder, under an flock, so a periodic save and the final one never run at
    once.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from hypercli.mount.store import NotFound, Store, StoreError, open_store

BLOCK = 256 << 10  #: bytes per block (a 1 MiB change in place sends 1-1.25 MiB)


@dataclass
class SaveReport:
    """What a save did: the generation written (None when nothing changed), bytes uploaded,
    bytes of the folder, files read (changed)."""

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
        st.setdefault("files", {})   # path → {"size", "mtime_ns", "mode", "blocks"}
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
        gen = {"attempt": attempt, "seq": seq, "time": time.time(),
               "files": {rel: {"size": f["size"], "mode": f["mode"],
                               "blocks": [[b, *known[b]] for b in f["blocks"]]}
                         for rel, f in files.items()}}
        name = _gen_name(attempt, seq)
        store.put(name, json.dumps(gen).encode())  # last: the generation is complete
        st.update(attempt=attempt, seq=seq, files=files)
        return SaveReport(name, uploaded, total, read)


def restore(url: str, folder: str | os.PathLike, state_path: str | os.PathLike,
            jobs: int = 8) -> RestoreReport:
    """Make ``folder`` the newest complete generation at ``url`` (module docstring).

    Raises:
        StoreError: the store failed, or a block did not match its SHA-256.
    """
    from concurrent.futures import ThreadPoolExecutor
    store = open_store(url)
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    gens = generations(store)
    if not gens:
        return RestoreReport(None, 0, 0)
    name = _gen_name(*gens[-1])
    try:
        gen = json.loads(store.get(name))
    except (NotFound, ValueError) as e:
        raise StoreError(f"{store.url}/{name}: {e}") from None
    with _state(Path(state_path)) as st, tempfile.TemporaryDirectory(
            dir=Path(state_path).parent) as tmp:
        need = {b[1] for f in gen["files"].values() for b in f["blocks"]}
        packs: dict[str, Path] = {}

        def fetch(pack: str) -> int:
            dest = Path(tmp) / pack.replace("/", "_")
            n = store.get_to_file(pack, dest)
            packs[pack] = dest
            return n

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            downloaded = sum(pool.map(fetch, sorted(need)))
        total = 0
        for rel, f in gen["files"].items():
            out = root / rel
            out.parent.mkdir(parents=True, exist_ok=True)
            part = out.with_name(out.name + ".restoring")
            with open(part, "wb") as w:
                for sha, pack, off, length in f["blocks"]:
                    with open(packs[pack], "rb") as r:
                        r.seek(off)
                        data = r.read(length)
                    if hashlib.sha256(data).hexdigest() != sha:
                        part.unlink()
                        raise StoreError(f"{store.url}/{pack}: a block of {rel} does not match "
                                         "its SHA-256")
                    w.write(data)
            os.chmod(part, f.get("mode", 0o644))
            os.replace(part, out)
            total += f["size"]
        for rel, p in list(_walk(root)):
            if rel not in gen["files"]:
                p.unlink()
        st["blocks"] = {b[0]: b[1:] for f in gen["files"].values() for b in f["blocks"]}
        st["files"] = {rel: {"size": f["size"], "mode": f.get("mode", 0o644),
                             "mtime_ns": (root / rel).stat().st_mtime_ns,
                             "blocks": [b[0] for b in f["blocks"]]}
                       for rel, f in gen["files"].items()}
        st.update(attempt=gen["attempt"], seq=gen["seq"])
    return RestoreReport(name, downloaded, total)
