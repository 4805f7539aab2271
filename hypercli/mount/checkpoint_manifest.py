"""Reading a checkpoint generation's manifest (:mod:`hypercli.mount.checkpoint`) as untrusted
input: a task can write its own checkpoint store (it shares the storage), and the restore
that reads it runs as root on the node, outside the task's container. So every field is
checked before a byte is written:

  * a path is relative, made of non-empty parts that are not ``.`` or ``..``, holds no NUL,
    and no part is longer than NAME_MAX bytes nor the path than PATH_MAX; no path is a
    folder of another (``a`` and ``a/b``);
  * a mode is an int, and only its permission bits (0o777) are ever used: never setuid,
    setgid or sticky;
  * a block is ``[sha256, "packs/<sha256>", offset, length]`` with 0 < length <= BLOCK, and a
    file's blocks add up to its size; a base is a generation's name.

Anything else is :class:`BadManifest`, naming the generation and the entry.
"""

from __future__ import annotations

import json
import re
from typing import Callable

from hypercli.mount.store_base import NotFound, StoreError

BLOCK = 128 << 10   #: bytes per block (the most a manifest's block may say)
FULL_EVERY = 20     #: at most this many deltas before a full generation
MAX_BLOCKS = 1 << 24  #: blocks of one file at most (2 TiB of 128 KiB blocks)
NAME_MAX = 255      #: bytes of one path part (Linux NAME_MAX, limits.h)
PATH_MAX = 4096     #: bytes of a whole path (Linux PATH_MAX, limits.h)
GEN_NAME = re.compile(r"gen/(\d{8})\.(\d{8})\.json")
_PACK = re.compile(r"packs/[0-9a-f]{64}")
_SHA = re.compile(r"[0-9a-f]{64}")


class BadManifest(StoreError):
    """A generation's manifest that restore refuses (exit code 3): the message names the
    generation and the entry; nothing was written."""

    def __init__(self, generation: str, entry: str | None, reason: str,
                 hint: str | None = None):
        where = f", entry {entry!r}" if entry is not None else ""
        super().__init__(f"checkpoint generation {generation}{where}: {reason}", hint or (
            f"it was not written by hypercli's save: remove {generation} from the checkpoint "
            "store to restore the generation before it"))
        self.generation, self.entry = generation, entry


def path_problem(rel: object) -> str | None:
    """Why ``rel`` cannot be a file's path inside a checkpoint folder, or None when it can
    (module docstring)."""
    if not isinstance(rel, str) or not rel:
        return "a path must be a non-empty string"
    if "\x00" in rel:
        return "a path must not hold a NUL"
    if rel.startswith("/"):
        return "an absolute path"
    try:
        data = rel.encode()
    except UnicodeEncodeError:
        return "a path must be valid UTF-8"
    if len(data) > PATH_MAX:
        return f"a path longer than {PATH_MAX} bytes"
    for part in rel.split("/"):
        if part in ("", ".", ".."):
            return f"a path with a part {part!r} (only plain names, no '..', no '//')"
        if len(part.encode()) > NAME_MAX:
            return f"a path part longer than {NAME_MAX} bytes"
    return None


def _int(v: object, lo: int = 0, hi: int | None = None) -> bool:
    return type(v) is int and v >= lo and (hi is None or v <= hi)


def parse(name: str, data: bytes) -> dict:
    """One generation's manifest, checked field by field.

    Args:
        name: its key (``gen/<attempt>.<seq>.json``), for messages.
        data: its bytes.
    Returns:
        ``{"attempt", "seq", "base": str | None, "files": {path: {"size", "mode" (0o777 at
        most), "n", "blocks": {index (int): (sha, pack, offset, length)}}}}``.
    Raises:
        BadManifest: anything the module docstring does not allow.
    """
    try:
        gen = json.loads(data)
    except (ValueError, RecursionError) as e:
        raise BadManifest(name, None, f"not JSON ({str(e)[:100]})") from None
    if not isinstance(gen, dict) or not isinstance(gen.get("files"), dict):
        raise BadManifest(name, None, "not a manifest (an object with files)")
    base = gen.get("base")
    if base is not None and not (isinstance(base, str) and GEN_NAME.fullmatch(base)):
        raise BadManifest(name, None, f"base {str(base)[:80]!r} is not a generation's name")
    files = {}
    for rel, f in gen["files"].items():
        why = path_problem(rel)
        if why:
            raise BadManifest(name, rel, why)
        if not isinstance(f, dict) or not isinstance(f.get("blocks"), dict):
            raise BadManifest(name, rel, "not a file entry (an object with blocks)")
        size, n, mode = f.get("size"), f.get("n"), f.get("mode", 0o644)
        if not _int(size) or not _int(n, 0, MAX_BLOCKS) or type(mode) is not int:
            raise BadManifest(name, rel, "size, n and mode must be whole numbers (size and "
                              f"n at least 0, n at most {MAX_BLOCKS})")
        blocks = {}
        for i, b in f["blocks"].items():
            if not (isinstance(i, str) and i.isdigit() and i.isascii() and int(i) < n):
                raise BadManifest(name, rel, f"block index {str(i)[:20]!r} is not below n={n}")
            if not (isinstance(b, list) and len(b) == 4 and isinstance(b[0], str)
                    and _SHA.fullmatch(b[0]) and isinstance(b[1], str)
                    and _PACK.fullmatch(b[1]) and _int(b[2]) and _int(b[3], 1, BLOCK)):
                raise BadManifest(name, rel, f"block {i} is not [sha256, packs/<sha256>, "
                                  f"offset, length (1..{BLOCK})]")
            blocks[int(i)] = tuple(b)
        files[rel] = {"size": size, "mode": mode & 0o777, "n": n, "blocks": blocks}
    attempt, seq = gen.get("attempt"), gen.get("seq")
    return {"attempt": attempt, "seq": seq, "base": base, "files": files}


def resolve(get: Callable[[str], bytes], name: str) -> tuple[list[str], dict]:
    """A generation's chain (its name, then the generations it changes, back to a full one)
    and its files with every block: ``{path: {"size", "mode", "blocks": [(sha, pack, offset,
    length), ...]}}``.

    Args:
        get: reads a key of the checkpoint store (raises NotFound, StoreError).
        name: the generation's key.
    Raises:
        BadManifest: a manifest of the chain is malformed, blocks are left undefined, a
            file's blocks do not add up to its size, or a path is a folder of another.
        StoreError: the store failed, or the chain is longer than FULL_EVERY + 1.
    """
    names, chain = [], []
    at: str | None = name
    while at is not None and len(chain) <= FULL_EVERY + 1:
        try:
            data = get(at)
        except NotFound as e:
            raise StoreError(f"{e} (a generation of the chain of {name})") from None
        chain.append(parse(at, data))
        names.append(at)
        at = chain[-1]["base"]
    if at is not None:
        raise StoreError(f"checkpoint generation {name}: a chain of generations longer than "
                         f"{FULL_EVERY}")
    files: dict = {}
    for gname, gen in zip(reversed(names), reversed(chain)):  # the full one, then the deltas
        out = {}
        for rel, f in gen["files"].items():
            prev = files.get(rel, {}).get("blocks", []) if gen["base"] else []
            blocks = []
            for i in range(f["n"]):
                b = f["blocks"].get(i) or (prev[i] if i < len(prev) else None)
                if b is None:
                    raise BadManifest(gname, rel, f"block {i} is left undefined")
                blocks.append(b)
            out[rel] = {"size": f["size"], "mode": f["mode"], "blocks": blocks}
        files = out
    for rel, f in files.items():
        if sum(b[3] for b in f["blocks"]) != f["size"]:
            raise BadManifest(name, rel, f"its blocks do not add up to its size {f['size']}")
        parts = rel.split("/")
        for k in range(1, len(parts)):
            if "/".join(parts[:k]) in files:
                raise BadManifest(name, rel, f"{'/'.join(parts[:k])!r} is both a file and "
                                  "a folder")
    return names, files
