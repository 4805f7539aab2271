"""Outputs gathered: every successful task's ``HYPER_OUTPUT`` folder pulled into one local
folder (``hyper outputs WORKFLOW [EXPERIMENT] DIR [--merge]``).

Task ``t``'s output lands in ``DIR/<t>/``:
  * ``file://`` storage: copied from ``<storage>/<workflow>/<t>/``, each file checked after the
    copy against the source's size and SHA-256;
  * object storage: pulled as the chunked dataset the node pushed
    (:func:`hypercli.mount.pack.pull`, which checks every chunk's SHA-256).

Rules:
  * Tasks are pulled in parallel (``jobs`` at a time), each into a new temporary folder of
    its own, renamed into place when complete, so ``DIR`` never holds half a task.
  * ``DIR/.hyper-outputs.json`` is hypercli's record of what it wrote there: each task
    pulled, with the signature of its source (the manifest's index hash, or the files' sizes
    and hashes) and every entry it wrote (kind, size, mtime, inode); the merged files and
    the folders it made for them. A task whose source has not changed is not pulled again.
  * hypercli replaces only what the record says it wrote, as it wrote it. ``DIR/<t>`` that
    it has no record of, that holds anything it did not write (a file of the user's, a
    changed file, a symlink), or that is not a folder, is refused with a UsageError naming
    the path, before anything is pulled: nothing of the user's is ever deleted.
  * Nothing in ``DIR`` is followed when it is a symlink (``DIR`` itself may be one: the user
    chose it). A source output folder, or the workflow's outputs root, that is a symlink is
    refused too, and a source is read on file descriptors (``os.fwalk``, ``openat`` with
    ``O_NOFOLLOW`` at every step), so no symlink a task puts in it is ever followed.
  * ``merge``: for each relative path found in more than one task (``predictions.jsonl`` of
    every shard), ``DIR/<path>`` is the files concatenated in task order (the plan's order),
    byte for byte. It is written only where nothing is or where the record says hypercli
    wrote it, in ``DIR`` or folders hypercli made. A path that would land on a task's folder,
    on the record (a task's own ``.hyper-outputs.json``) or on a temporary folder is not
    merged, and said so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tempfile
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

from hypercli.errors import InfraError, UsageError, os_reason
from hypercli.state import State

RECORD = ".hyper-outputs.json"
_TMP = ".hyper-"  # prefix of hypercli's temporary names in DIR (never a task id: no dot)


@dataclass
class GatherReport:
    """What ``gather`` did: tasks pulled now, tasks already there, files merged (relative
    paths), files not merged with why (``"rel: reason"``), bytes pulled now."""

    pulled: list = field(default_factory=list)
    kept: list = field(default_factory=list)
    merged: list = field(default_factory=list)
    not_merged: list = field(default_factory=list)
    bytes: int = 0


def _sha256_fd(fd: int) -> str:
    h = hashlib.sha256()
    os.lseek(fd, 0, os.SEEK_SET)
    for block in iter(lambda: os.read(fd, 1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def _open_file(path: Path) -> int:
    """An fd of the regular file at ``path``, opened without following a symlink.
    Raises OSError (ELOOP for a symlink, EINVAL for anything but a regular file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(22, "not a regular file", str(path))
    return fd


def _walk(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every entry under ``root`` as (relative path, lstat), sorted; symlinks are entries,
    never followed."""
    out = []
    for folder, dirs, files in os.walk(root, followlinks=False):
        for name in dirs + files:
            p = Path(folder) / name
            out.append((p.relative_to(root).as_posix(), os.lstat(p)))
    return sorted(out)


def _regular_files(root: Path) -> list[str]:
    """Relative paths of the regular files under ``root`` (symlinks skipped), sorted."""
    return [rel for rel, st in _walk(root) if stat.S_ISREG(st.st_mode)]


def _entry(st: os.stat_result) -> list:
    """What the record keeps of an entry hypercli wrote: [kind, size, mtime_ns, inode]
    (a folder: [kind, 0, 0, 0], its times change with what is put in it)."""
    if stat.S_ISDIR(st.st_mode):
        return ["d", 0, 0, 0]
    kind = "l" if stat.S_ISLNK(st.st_mode) else "f" if stat.S_ISREG(st.st_mode) else "?"
    return [kind, st.st_size, st.st_mtime_ns, st.st_ino]


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _source_dir(src: Path) -> int:
    """An fd of a task's output folder ``src`` (``<storage>/<workflow>/<task>``): the storage
    folder opened as the user gave it, the workflow's outputs root and ``src`` each opened
    without following a symlink (a task may have put one there).

    Raises:
        FileNotFoundError: ``src`` is not there (the task wrote nothing).
        InfraError: the outputs root or ``src`` is a symlink or not a folder.
    """
    fd = os.open(src.parent.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for part in (src.parent.name, src.name):
            try:
                nxt = os.open(part, _DIR, dir_fd=fd)
            except OSError as e:
                if e.errno in (40, 20):  # ELOOP, ENOTDIR
                    raise InfraError(f"{src.parent if part == src.parent.name else src}, an "
                                     "output folder, is a symlink or not a folder: not "
                                     "followed") from None
                raise
            os.close(fd)
            fd = nxt
        return fd
    except BaseException:
        os.close(fd)
        raise


def _source_files(src: Path) -> list[str]:
    """Relative paths of the regular files under a task's output folder, sorted, walked on
    file descriptors (``os.fwalk``, symlinks never followed); [] when it is not there."""
    try:
        top = _source_dir(src)
    except FileNotFoundError:
        return []
    out = []
    try:
        for folder, _, files, dfd in os.fwalk(".", dir_fd=top, follow_symlinks=False):
            for name in files:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode):
                    out.append(os.path.normpath(os.path.join(folder, name)))
    finally:
        os.close(top)
    return sorted(out)


def _open_source(src: Path, rel: str) -> int:
    """An fd of the regular file ``rel`` under a task's output folder, each folder on the
    way opened without following a symlink. Raises OSError (ELOOP, ENOTDIR, EINVAL)."""
    fd = _source_dir(src)
    try:
        *folders, name = rel.split("/")
        for part in folders:
            nxt = os.open(part, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nxt
        out = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                      dir_fd=fd)
    finally:
        os.close(fd)
    if not stat.S_ISREG(os.fstat(out).st_mode):
        os.close(out)
        raise OSError(22, "not a regular file", str(src / rel))
    return out


def _folder_signature(src: Path) -> str:
    h = hashlib.sha256()
    for rel in _source_files(src):
        fd = _open_source(src, rel)
        try:
            h.update(f"{rel}\0{os.fstat(fd).st_size}\0{_sha256_fd(fd)}\n".encode())
        finally:
            os.close(fd)
    return h.hexdigest()


def _copy_checked(src: Path, dest: Path) -> int:
    """Copy a folder's regular files into the new folder ``dest``, each checked by size and
    SHA-256 after the copy; bytes."""
    total = 0
    for rel in _source_files(src):
        to = dest / rel
        to.parent.mkdir(parents=True, exist_ok=True)
        fd = _open_source(src, rel)
        try:
            out = os.open(to, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                          | os.O_CLOEXEC, 0o666)  # less the umask, as any new file
            try:
                while block := os.read(fd, 1 << 20):
                    _write_all(out, block)
                if os.fstat(out).st_size != os.fstat(fd).st_size or \
                        _sha256_fd(out) != _sha256_fd(fd):
                    raise InfraError(f"{to}: the copy differs from {src / rel}")
                total += os.fstat(out).st_size
            finally:
                os.close(out)
        finally:
            os.close(fd)
    return total


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _read_record(dest: Path) -> dict:
    """``DIR/.hyper-outputs.json`` as a dict ({} when there is none).

    Raises:
        UsageError: it is not a regular file, or not a record hypercli wrote.
    """
    path = dest / RECORD
    try:
        fd = _open_file(path)
    except FileNotFoundError:
        return {}
    except OSError:
        raise UsageError(f"{path} is not a regular file: hypercli keeps its record of what "
                         "it wrote in DIR there", "move it away, or gather into another "
                         "folder") from None
    try:
        with os.fdopen(fd, "rb") as f:
            record = json.loads(f.read())
    except ValueError:
        record = None
    ok = isinstance(record, dict) and isinstance(record.get("tasks", {}), dict) and \
        isinstance(record.get("merged", {}), dict) and isinstance(record.get("folders", []),
                                                                  list)
    if not ok:
        raise UsageError(f"{path} is not a record of `hyper outputs`",
                         "move it away, or gather into another folder")
    return record


def _umask() -> int:
    """This process's umask (read by setting it: call it before threads start)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _write_record(dest: Path, record: dict, mask: int) -> None:
    """Replace the record atomically (a new file renamed over it; a symlink there is
    replaced, not followed); its mode 0666 less the umask ``mask``."""
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=_TMP + "record-")
    try:
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=True)
        os.replace(tmp, dest / RECORD)
    except BaseException:
        _remove(Path(tmp))
        raise


def _remove(path: Path) -> None:
    """Remove a file or a folder hypercli made (symlinks inside are removed, not
    followed); nothing when it is gone."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _unrecorded(target: Path, entry) -> str | None:
    """Why ``DIR/<task>`` may not be replaced (module docstring), or None when it may: it
    is missing, or a folder holding only what the record's ``entry`` says hypercli wrote."""
    try:
        st = os.lstat(target)
    except FileNotFoundError:
        return None
    if stat.S_ISLNK(st.st_mode):
        return f"{target} is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return f"{target} is not a folder"
    if entry is None:
        return f"{target} exists and hypercli has no record of writing it"
    wrote = entry.get("entries") if isinstance(entry, dict) else None
    if not isinstance(wrote, dict):  # a record of an older hypercli: nothing to check with
        return f"{target} was written by an older hypercli, which kept no list of its files"
    for rel, est in _walk(target):
        if wrote.get(rel) != _entry(est):
            return f"{target / rel} was not written by hypercli (or was changed since)"
    return None


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
        UsageError: unknown workflow or experiment, no task succeeded, ``dest`` is not a
            folder or holds what hypercli did not write where it would write (named).
        InfraError: a file cannot be read or written (``no space left on DIR``...), a copy
            differs from its source, a source output folder is a symlink.
        StoreError / DatasetError: the object store failed or a chunk did not verify.
    """
    wf = state.workflow(ref)
    wid = wf["id"]
    exps = [e["name"] for e in state.experiments(wid)]
    if experiment is not None and experiment not in exps:
        raise UsageError(f"workflow {wid} has no experiment {experiment!r}",
                         f"its experiments: {', '.join(exps)}")
    every = [t["id"] for t in state.tasks(wid)]
    tasks = [t["id"] for t in state.tasks(wid, status=["succeeded"])
             if experiment in (None, t["experiment"])]
    if not tasks:
        raise UsageError(f"no task of {wid}{' / ' + experiment if experiment else ''} has "
                         "succeeded: there is no output to gather", f"`hyper ps {wid}`")
    dest = Path(dest)
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"cannot use {dest} as the folder to gather into: "
                         f"{os_reason(e, str(dest))}") from None
    try:
        return wid, _gather(wf, dest, tasks, every, merge, jobs, _umask())
    except OSError as e:
        raise InfraError(f"gathering the outputs of {wid} into {dest}: "
                         f"{os_reason(e, str(dest))}") from None


def _gather(wf: dict, dest: Path, tasks: list[str], every: list[str], merge: bool,
            jobs: int, mask: int) -> GatherReport:
    """The work of :func:`gather` once its arguments are checked; ``mask``: the umask,
    which the folders and files made here get their modes from, as any new ones."""
    from hypercli.mount.outputs import output_url
    from hypercli.mount.pack import load_manifest, pull
    from hypercli.mount.store import open_store
    wid, storage = wf["id"], wf["storage"]
    record = _read_record(dest)
    if record.get("workflow") not in (None, wid):
        raise UsageError(f"{dest} holds the outputs of {record['workflow']}",
                         "gather into another folder")
    done = record.setdefault("tasks", {})
    record["workflow"] = wid
    report = GatherReport()

    def source(task: str) -> Path:  # read on file descriptors (_source_dir)
        return Path(storage[7:]) / wid / task

    def signature(task: str) -> str:
        if storage.startswith("file://"):
            return _folder_signature(source(task))  # none there (wrote nothing): empty
        return load_manifest(open_store(output_url(storage, wid, task)))["index_sha256"]

    def fetch(task: str) -> tuple[Path, int]:
        """The task's output in a new temporary folder in DIR: (folder, bytes)."""
        tmp = Path(tempfile.mkdtemp(dir=dest, prefix=f"{_TMP}{task}-"))
        try:
            if storage.startswith("file://"):
                n = _copy_checked(source(task), tmp)
            else:
                n = pull(output_url(storage, wid, task), tmp, jobs=4).bytes
            os.chmod(tmp, 0o777 & ~mask)  # mkdtemp's 0700 was for while it is filled
            return tmp, n
        except BaseException:
            _remove(tmp)
            raise

    def install(task: str, tmp: Path) -> dict:
        """Put the pulled folder in place of DIR/<task> (checked again: still only ours)."""
        target = dest / task
        why = _unrecorded(target, done.get(task))
        if why:
            raise UsageError(f"{why}: not replaced", "move it away, or gather into another "
                             "folder")
        entries = {rel: _entry(st) for rel, st in _walk(tmp)}
        if os.path.lexists(target):
            trash = Path(tempfile.mkdtemp(dir=dest, prefix=f"{_TMP}old-{task}-"))
            os.replace(target, trash)  # onto an empty folder of ours: allowed
            os.replace(tmp, target)
            _remove(trash)
        else:
            os.replace(tmp, target)
        return {"source": sigs[task], "entries": entries}

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        sigs = dict(zip(tasks, pool.map(signature, tasks)))

        def current(t: str) -> bool:
            e = done.get(t)
            src = e.get("source") if isinstance(e, dict) else e
            try:
                return src == sigs[t] and stat.S_ISDIR(os.lstat(dest / t).st_mode)
            except FileNotFoundError:
                return False
        todo = [t for t in tasks if not current(t)]
        report.kept = [t for t in tasks if t not in todo]
        for t in todo:  # before anything is pulled: nothing of the user's is in the way
            why = _unrecorded(dest / t, done.get(t))
            if why:
                raise UsageError(f"{why}: not replaced", "move it away, or gather into "
                                 "another folder")
        futures = {pool.submit(fetch, t): t for t in todo}
        error = None
        for f in as_completed(futures):
            t = futures[f]
            try:
                tmp, n = f.result()
            except Exception as e:
                error = error or e
                continue
            if error is not None:
                _remove(tmp)
                continue
            try:
                done[t] = install(t, tmp)
            except BaseException as e:
                _remove(tmp)
                error = e
                continue
            report.pulled.append(t)
            report.bytes += n
            _write_record(dest, record, mask)
        if error is not None:
            raise error
    report.pulled.sort(key=tasks.index)
    if merge:
        _merge(dest, tasks, set(every), record, report, mask)
        _write_record(dest, record, mask)
    return report


def _merge(dest: Path, tasks: list[str], every: set[str], record: dict,
           report: GatherReport, mask: int) -> None:
    """Concatenate same-named files of the task folders, in task order, into ``dest``
    (module docstring); fills ``report.merged`` and ``report.not_merged`` and the record's
    ``merged`` and ``folders``.

    Raises:
        UsageError: a merged file would replace, or be written in, something hypercli did
            not write (named); nothing is merged then.
    """
    found: dict[str, list[Path]] = {}
    for task in tasks:
        root = dest / task
        for rel in _regular_files(root):
            found.setdefault(rel, []).append(root / rel)
    merged = record.setdefault("merged", {})
    folders = record.setdefault("folders", [])
    plan = []
    for rel, parts in sorted(found.items()):
        if len(parts) < 2:
            continue
        first = rel.split("/", 1)[0]
        if rel == RECORD or first in every or first.startswith(_TMP):
            what = ("hypercli's record of DIR" if rel == RECORD else
                    f"task {first}'s folder" if first in every else "a temporary folder")
            report.not_merged.append(f"{rel}: its place is {what}")
            continue
        out = dest / rel
        for part in Path(rel).parents[-2::-1]:  # its folders, outermost first
            p = dest / part
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                break  # made below, with the ones inside it
            if not stat.S_ISDIR(st.st_mode) or stat.S_ISLNK(st.st_mode) or \
                    part.as_posix() not in folders:
                raise UsageError(f"cannot merge {rel}: {p} is not a folder hypercli made",
                                 "move it away, or gather into another folder")
        try:
            st = os.lstat(out)
        except FileNotFoundError:
            st = None
        if st is not None and merged.get(rel) != _entry(st):
            raise UsageError(f"cannot merge {rel}: {out} was not written by hypercli (or was "
                             "changed since)", "move it away, or gather into another folder")
        plan.append((rel, out, parts))
    for rel, out, parts in plan:
        for part in Path(rel).parents[-2::-1]:
            if not os.path.lexists(dest / part):
                os.mkdir(dest / part)
                folders.append(part.as_posix())
        fd, tmp = tempfile.mkstemp(dir=out.parent, prefix=_TMP + "merge-")
        try:
            for p in parts:
                src = _open_file(p)
                try:
                    while block := os.read(src, 1 << 20):
                        _write_all(fd, block)
                finally:
                    os.close(src)
            os.fchmod(fd, 0o666 & ~mask)
            os.close(fd)
            fd = None
            os.replace(tmp, out)
        except BaseException:
            if fd is not None:
                os.close(fd)
            _remove(Path(tmp))
            raise
        merged[rel] = _entry(os.lstat(out))
        report.merged.append(rel)
