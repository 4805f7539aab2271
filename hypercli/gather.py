"""Outputs gathered: every successful task's ``HYPER_OUTPUT`` folder pulled into one local
folder (``hyper outputs WORKFLOW [EXPERIMENT] DIR [--merge]``).

Task ``t``'s output lands in ``DIR/<t>/``:
  * ``file://`` storage: copied from ``<storage>/<workflow>/<t>/``, each file checked after the
    copy against the source's size and SHA-256;
  * object storage: pulled as the chunked dataset the node pushed
    (:func:`hypercli.mount.pack.pull`, which checks every chunk's SHA-256).

Rules:
  * Tasks are pulled in parallel (``jobs`` at a time), each into a temporary folder renamed
    into place when complete, so ``DIR`` never holds half a task.
  * Resumable: ``DIR/.hyper-outputs.json`` records each task pulled with the signature of
    its source (the manifest's index hash, or the files' sizes and hashes); a task whose
    source has not changed is not pulled again.
  * ``merge``: for each relative path found in more than one task (``predictions.jsonl`` of
    every shard), ``DIR/<path>`` is the files concatenated in task order (the plan's order),
    byte for byte.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from hypercli.errors import UsageError
from hypercli.state import State

RECORD = ".hyper-outputs.json"


@dataclass
class GatherReport:
    """What ``gather`` did: tasks pulled now, tasks already there, files merged (relative
    paths), bytes pulled now."""

    pulled: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    merged: list = field(default_factory=list)
    bytes: int = 0


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink())


def _folder_signature(src: Path) -> str:
    h = hashlib.sha256()
    for p in _files(src):
        h.update(f"{p.relative_to(src).as_posix()}\0{p.stat().st_size}\0{_sha256(p)}\n"
                 .encode())
    return h.hexdigest()


def _copy_checked(src: Path, dest: Path) -> int:
    """Copy a folder's files, each checked by size and SHA-256 after the copy; bytes."""
    total = 0
    for p in _files(src):
        to = dest / p.relative_to(src)
        to.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(p, to)
        if to.stat().st_size != p.stat().st_size or _sha256(to) != _sha256(p):
            raise OSError(f"{to}: the copy differs from {p}")
        total += to.stat().st_size
    return total


def gather(state: State, ref: str, dest: str | os.PathLike, *, experiment: str | None = None,
           merge: bool = False, jobs: int = 8) -> tuple[str, GatherReport]:
    """Pull the outputs of a workflow's successful tasks into ``dest`` (module docstring).

    Args:
        ref: workflow id or recipe name (its newest workflow).
        experiment: only this experiment's tasks.
        jobs: tasks pulled at once.
    Returns:
        (workflow id, GatherReport).
    Raises:
        UsageError: unknown workflow or experiment, or no task succeeded.
        StoreError / DatasetError: the object store failed or a chunk did not verify.
    """
    from hypercli.mount.outputs import output_url
    from hypercli.mount.pack import load_manifest, pull
    from hypercli.mount.store import open_store
    wf = state.workflow(ref)
    wid = wf["id"]
    exps = [e["name"] for e in state.experiments(wid)]
    if experiment is not None and experiment not in exps:
        raise UsageError(f"workflow {wid} has no experiment {experiment!r}",
                         f"its experiments: {', '.join(exps)}")
    tasks = [t["id"] for t in state.tasks(wid, status=["succeeded"])
             if experiment in (None, t["experiment"])]
    if not tasks:
        raise UsageError(f"no task of {wid}{' / ' + experiment if experiment else ''} has "
                         "succeeded: there is no output to gather", f"`hyper ps {wid}`")
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    record_path = dest / RECORD
    record = json.loads(record_path.read_text()) if record_path.exists() else {}
    if record.get("workflow") not in (None, wid):
        raise UsageError(f"{dest} holds the outputs of {record['workflow']}",
                         "gather into another folder")
    done = record.setdefault("tasks", {})
    record["workflow"] = wid
    storage = wf["storage"]
    report = GatherReport()

    def signature(task: str) -> str:
        if storage.startswith("file://"):
            return _folder_signature(Path(storage[7:]) / wid / task)
        return load_manifest(open_store(output_url(storage, wid, task)))["index_sha256"]

    def one(task: str) -> int:
        tmp = dest / f".{task}.incoming"
        shutil.rmtree(tmp, ignore_errors=True)
        if storage.startswith("file://"):
            n = _copy_checked(Path(storage[7:]) / wid / task, tmp)
        else:
            tmp.mkdir(parents=True)
            n = pull(output_url(storage, wid, task), tmp, jobs=4).bytes
        shutil.rmtree(dest / task, ignore_errors=True)
        os.replace(tmp, dest / task)
        return n

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        sigs = dict(zip(tasks, pool.map(signature, tasks)))
        todo = [t for t in tasks if done.get(t) != sigs[t] or not (dest / t).is_dir()]
        report.kept = [t for t in tasks if t not in todo]
        for task, n in zip(todo, pool.map(one, todo)):
            done[task] = sigs[task]
            report.pulled.append(task)
            report.bytes += n
            tmp = record_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(record, indent=1, sort_keys=True))
            os.replace(tmp, record_path)
    if merge:
        report.merged = _merge(dest, tasks)
    return wid, report


def _merge(dest: Path, tasks: list[str]) -> list[str]:
    """Concatenate same-named files of the task folders, in task order, into ``dest``."""
    found: dict[str, list[Path]] = {}
    for task in tasks:
        root = dest / task
        for p in _files(root):
            found.setdefault(p.relative_to(root).as_posix(), []).append(p)
    merged = []
    for rel, parts in sorted(found.items()):
        if len(parts) < 2:
            continue
        out = dest / rel
        if out.exists() and out.is_dir():
            raise UsageError(f"cannot merge {rel}: {out} is a folder")
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".merging")
        with open(tmp, "wb") as w:
            for p in parts:
                with open(p, "rb") as r:
                    shutil.copyfileobj(r, w, 1 << 20)
        os.replace(tmp, out)
        merged.append(rel)
    return merged
