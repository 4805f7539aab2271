"""The node's side of the workdir copy (:mod:`hypercli.workdir` is the sender's): a store of
contents by SHA-256, and each workflow's folder built from it. Standard library only.

Layout under the node's hypercli folder ``ROOT``::

    work/.objects/<sha256>        each content once, whatever workflow brought it
    work/.manifests/<wid>.json    the manifest a workflow's folder was built from
    work/<wid>/                   a workflow's working folder (tasks run here)

Commands (``python3 -m hypercli.node.workdir ROOT WID have|apply``):

* ``have``: stdin ``{"digest", "contents": [sha256, ...]}``; prints ``{"current": true}``
  when ``work/<wid>`` was built from a manifest with that digest (a resumed run: nothing to
  do, and its running attempts keep their folder), else ``{"missing": [...]}``, the contents
  the store lacks.
* ``apply``: stdin a tar of ``manifest.json`` and ``objects/<sha256>`` members. Each object
  is checked against its name before it enters the store; the folder is built beside the old
  one (``work/.<wid>.new``) and swapped in, so attempts already running keep theirs. Files are
  copies of the store's objects, never links to them: a task that writes to a file of its
  working folder cannot change the store. Then objects that no manifest of an existing folder
  names and that are older than :data:`KEEP_S` are removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import time

KEEP_S = 3600.0  #: s an unreferenced object stays (another sync may be about to use it)


def _paths(root: str, wid: str) -> tuple[str, str, str]:
    work = os.path.join(os.path.expanduser(root), "work")
    return work, os.path.join(work, ".objects"), os.path.join(work, ".manifests")


def _digest_of(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def have(root: str, wid: str, ask: dict) -> dict:
    work, objects, manifests = _paths(root, wid)
    if os.path.isdir(os.path.join(work, wid)) and \
            _digest_of(os.path.join(manifests, f"{wid}.json")) == ask.get("digest"):
        return {"current": True}
    return {"missing": [c for c in ask.get("contents", [])
                        if not os.path.exists(os.path.join(objects, c))]}


def _safe(rel: str) -> bool:
    parts = rel.split("/")
    return bool(rel) and not rel.startswith("/") and ".." not in parts and "" not in parts


def apply(root: str, wid: str, stream) -> dict:
    """Take the tar on ``stream`` (module docstring); returns ``{"files", "objects"}``.
    Raises ValueError: an object whose content is not its name, or a bad manifest."""
    work, objects, manifests = _paths(root, wid)
    for d in (work, objects, manifests):
        os.makedirs(d, mode=0o700, exist_ok=True)
    manifest = None
    got = 0
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for member in tar:
            f = tar.extractfile(member)
            if f is None:
                continue
            if member.name == "manifest.json":
                manifest = f.read()
                continue
            name = member.name[len("objects/"):]
            if not member.name.startswith("objects/") or len(name) != 64 or \
                    not all(c in "0123456789abcdef" for c in name):
                raise ValueError(f"unexpected member {member.name!r}")
            tmp = os.path.join(objects, f".{name}.{os.getpid()}.tmp")
            h = hashlib.sha256()
            with open(tmp, "wb") as out:
                while chunk := f.read(1 << 20):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != name:
                os.unlink(tmp)
                raise ValueError(f"a file changed while it was sent (content {name[:12]}); "
                                 "run again")
            os.replace(tmp, os.path.join(objects, name))
            got += 1
    if manifest is None:
        raise ValueError("no manifest.json in the stream")
    entries = json.loads(manifest)["entries"]
    new, old, dest = (os.path.join(work, f".{wid}.new"), os.path.join(work, f".{wid}.old"),
                      os.path.join(work, wid))
    shutil.rmtree(new, ignore_errors=True)
    os.makedirs(new)
    now = time.time()
    files = 0
    for rel, kind, mode, _size, ref in entries:
        if not _safe(rel):
            raise ValueError(f"bad path {rel!r} in the manifest")
        path = os.path.join(new, rel)
        if kind == "d":
            os.makedirs(path, exist_ok=True)
            os.chmod(path, (mode & 0o7777) | 0o700)
        elif kind == "l":
            os.symlink(ref, path)
        elif kind == "f":
            src = os.path.join(objects, ref)
            shutil.copyfile(src, path)
            os.chmod(path, mode & 0o7777)
            os.utime(src, (now, now))  # in use: not removed by the sweep below
            files += 1
    tmp = os.path.join(manifests, f".{wid}.{os.getpid()}.tmp")
    with open(tmp, "wb") as out:
        out.write(manifest)
    shutil.rmtree(old, ignore_errors=True)
    if os.path.lexists(dest):
        os.rename(dest, old)
    os.rename(new, dest)
    os.replace(tmp, os.path.join(manifests, f"{wid}.json"))
    _sweep(work, objects, manifests, now)
    return {"files": files, "objects": got}


def _sweep(work: str, objects: str, manifests: str, now: float) -> None:
    """Remove manifests of folders that are gone, then objects no manifest names that are
    older than KEEP_S."""
    used: set[str] = set()
    for name in os.listdir(manifests):
        if not name.endswith(".json"):
            continue
        if not os.path.isdir(os.path.join(work, name[:-5])):
            os.unlink(os.path.join(manifests, name))
            continue
        try:
            with open(os.path.join(manifests, name), "rb") as f:
                used.update(e[4] for e in json.load(f)["entries"] if e[1] == "f")
        except (OSError, ValueError, KeyError, IndexError):
            return  # unsure what is used: remove nothing
    for name in os.listdir(objects):
        p = os.path.join(objects, name)
        try:
            if name not in used and now - os.stat(p).st_mtime > KEEP_S:
                os.unlink(p)
        except OSError:
            pass


def main(argv: list[str]) -> int:
    root, wid, op = argv
    if "/" in wid or wid.startswith("."):
        print(f"bad workflow id {wid!r}", file=sys.stderr)
        return 2
    try:
        if op == "have":
            print(json.dumps(have(root, wid, json.load(sys.stdin))))
        elif op == "apply":
            print(json.dumps(apply(root, wid, sys.stdin.buffer)))
        else:
            print(f"unknown command {op!r}", file=sys.stderr)
            return 2
    except (ValueError, OSError, tarfile.TarError) as e:
        print(f"workdir: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
