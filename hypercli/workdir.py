"""The recipe's ``workdir`` as it is sent to remote nodes: which files, and what a node lacks.

One job: choose the files of a workdir and describe them in a *manifest* (path, kind, mode,
size, SHA-256), so a node gets only the contents it does not already hold
(:mod:`hypercli.node.workdir` is the node's side). Rules:

* **What is sent.** Every file and symlink under the workdir except what is ignored:
  built-in patterns (:data:`BUILT_IN`: VCS folders, virtual environments, caches), then the
  ``.gitignore`` files and then the ``.hyperignore`` files, each applying to its own folder and
  below, in gitignore syntax (read by the ``pathspec`` library's ``GitIgnoreSpec``, which
  follows git's rules: the last matching pattern wins, ``!pattern`` re-includes, and a file
  cannot be re-included once a folder above it is excluded). A ``.hyperignore`` is read after
  the ``.gitignore`` of the same folder, so ``!data/small.csv`` sends a file git ignores.
  The state folder (``$HYPER_HOME``) is never read when it lies inside the workdir: opening
  its SQLite file from this process would drop this process's locks on it (sqlite.org,
  "How To Corrupt An SQLite Database File", 2.2).
* **Size.** A workdir whose files add up to more than :data:`MAX_BYTES` is refused before
  anything is sent, naming its largest folders.
* **What changed.** Contents are addressed by SHA-256: the node keeps each content once and
  is sent only the ones it lacks, whichever workflow or workdir first brought them. Hashes are
  kept in ``$HYPER_HOME/cache/workdir/`` per file (size, mtime, inode), so an unchanged file is
  not read again.
* ``workdir: none`` in a recipe: no folder is sent; tasks start in an empty folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from dataclasses import dataclass, field
from pathlib import Path

from hypercli.errors import UsageError

#: patterns ignored in every workdir (gitignore syntax), before its own ignore files
BUILT_IN = (".git/", ".hg/", ".svn/", ".venv/", "venv/", "__pycache__/", ".hyper/",
            ".mypy_cache/", ".pytest_cache/", "node_modules/", ".ipynb_checkpoints/")
IGNORE_FILES = (".gitignore", ".hyperignore")  #: read in this order in each folder
MAX_BYTES = 512 << 20  #: bytes of files a workdir may send (keep data in storage or mounts)
LARGEST_SHOWN = 5  #: folders named when a workdir is over MAX_BYTES


@dataclass
class Manifest:
    """The files of a workdir to send.

    Attributes:
        root: the workdir (absolute).
        entries: ``[path, kind, mode, size, ref]`` in walk order (a folder before what it
            holds): ``kind`` ``"d"`` folder, ``"f"`` file (``ref``: its SHA-256 hex), ``"l"``
            symlink (``ref``: its target); ``path`` relative, POSIX; ``mode`` the permission
            bits; ``size`` bytes (0 for folders and links).
        ignored: how many files and folders the ignore rules left out.
        digest: SHA-256 hex of the entries (two workdirs with one digest are the same).
    """

    root: str
    entries: list = field(default_factory=list)
    ignored: int = 0
    digest: str = ""

    @property
    def files(self) -> int:
        return sum(e[1] == "f" for e in self.entries)

    @property
    def bytes(self) -> int:
        return sum(e[3] for e in self.entries)

    def contents(self) -> dict[str, tuple[str, int]]:
        """SHA-256 → (a path with that content, size)."""
        return {e[4]: (e[0], e[3]) for e in self.entries if e[1] == "f"}

    def as_json(self) -> bytes:
        return json.dumps({"entries": self.entries}, separators=(",", ":")).encode()


def _spec(folder: Path, extra: tuple = ()):
    """The ignore rules of one folder (its ignore files' lines, after ``extra``), or None."""
    from pathspec import GitIgnoreSpec
    lines = list(extra)
    for name in IGNORE_FILES:
        try:
            lines += (folder / name).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            continue
    return GitIgnoreSpec.from_lines(lines) if lines else None


def _ignored(rules: list, rel: str, is_dir: bool) -> bool:
    """git's rule over the specs of the folders above ``rel`` (outermost first): the last
    decision of the deepest folder with one wins."""
    verdict = False
    for base, spec in rules:
        sub = rel[len(base) + 1:] if base else rel
        r = spec.check_file(sub + "/" if is_dir else sub)
        if r.include is not None:
            verdict = r.include
    return verdict


def _same(path: str, key: tuple | None) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return (st.st_dev, st.st_ino) == key


class _Hashes:
    """SHA-256 of files, remembered by (size, mtime_ns, inode) in a cache file per workdir."""

    def __init__(self, root: Path):
        from hypercli import state as S
        self.path = (S.home() / "cache" / "workdir" /
                     f"{hashlib.sha256(str(root).encode()).hexdigest()[:20]}.json")
        try:
            self.old = json.loads(self.path.read_text())
        except (OSError, ValueError):
            self.old = {}
        self.new: dict = {}

    def of(self, rel: str, path: str, st: os.stat_result) -> str:
        key = [st.st_size, st.st_mtime_ns, st.st_ino]
        hit = self.old.get(rel)
        if hit and hit[:3] == key:
            self.new[rel] = hit
            return hit[3]
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
        self.new[rel] = [*key, h.hexdigest()]
        return h.hexdigest()

    def save(self) -> None:
        if self.new == self.old:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self.new, separators=(",", ":")))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a cache: the next run hashes again


def build(root: str | os.PathLike, skip: str | os.PathLike | None = None,
          max_bytes: int = MAX_BYTES) -> Manifest:
    """The manifest of a workdir (rules in the module docstring).

    Args:
        root: the workdir.
        skip: a folder never read (the state folder), wherever it is.
        max_bytes: refuse a workdir whose files add up to more (bytes).
    Raises:
        UsageError: the workdir is not a folder, or is over ``max_bytes`` (naming its largest
            folders and how to leave them out).
    """
    top = Path(root)
    if not top.is_dir():
        raise UsageError(f"workdir {top} is not a folder",
                         "fix workdir: in the recipe, or write workdir: none")
    key = None
    if skip is not None:
        try:
            st = os.stat(skip)
            key = (st.st_dev, st.st_ino)
        except OSError:
            pass
    m = Manifest(str(top))
    hashes = _Hashes(top)
    sizes: dict[str, int] = {}  # folder (relative) → bytes of its files, all depths
    total = 0
    first = _spec(top, BUILT_IN)
    stack = [("", top, [("", first)] if first else [])]
    while stack:
        rel_dir, folder, rules = stack.pop()
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        subdirs = []
        for name in names:
            path = os.path.join(folder, name)
            rel = f"{rel_dir}/{name}" if rel_dir else name
            try:
                st = os.lstat(path)
            except OSError:  # vanished while read
                continue
            is_dir = stat.S_ISDIR(st.st_mode)
            if _ignored(rules, rel, is_dir) or (is_dir and _same(path, key)):
                m.ignored += 1
                continue
            mode = stat.S_IMODE(st.st_mode)
            if is_dir:
                m.entries.append([rel, "d", mode, 0, ""])
                subdirs.append((rel, Path(path)))
            elif stat.S_ISLNK(st.st_mode):
                m.entries.append([rel, "l", 0o777, 0, os.readlink(path)])
            elif stat.S_ISREG(st.st_mode):
                try:
                    digest = hashes.of(rel, path, st)
                except OSError:
                    continue
                m.entries.append([rel, "f", mode, st.st_size, digest])
                total += st.st_size
                parts = rel.split("/")[:-1]
                for i in range(1, len(parts) + 1):
                    d = "/".join(parts[:i])
                    sizes[d] = sizes.get(d, 0) + st.st_size
        for rel, path in reversed(subdirs):
            spec = _spec(path)
            stack.append((rel, path, rules + [(rel, spec)] if spec else rules))
    hashes.save()
    if total > max_bytes:
        raise _too_big(top, total, max_bytes, sizes)
    m.digest = hashlib.sha256(m.as_json()).hexdigest()
    return m


_MANIFESTS: dict[str, Manifest] = {}
_LOCK = threading.Lock()


def manifest(wid: str, root: str, skip: str | os.PathLike | None = None, *,
             fresh: bool = False) -> Manifest:
    """The manifest of workflow ``wid``'s workdir, built once per process (every node of a
    run gets the same files) or, with ``fresh``, again (its files changed since: a node
    that joins later gets them as they are then). Raises UsageError as :func:`build`."""
    with _LOCK:
        if fresh or wid not in _MANIFESTS:
            _MANIFESTS[wid] = build(root, skip)
        return _MANIFESTS[wid]


def remember(wid: str, m: Manifest) -> None:
    """Use ``m`` as workflow ``wid``'s manifest in this process (built before the workflow
    had an id, to refuse a workdir over the limit before anything is recorded)."""
    with _LOCK:
        _MANIFESTS[wid] = m


def _too_big(top: Path, total: int, max_bytes: int, sizes: dict[str, int]) -> UsageError:
    """The error of a workdir over the limit, naming the largest folders (the outermost
    of a chain that holds nearly the same bytes: ``data/`` rather than ``data/raw/``)."""
    order = sorted(sizes, key=lambda d: (-sizes[d], d))
    shown: list[str] = []
    for d in order:
        if any(d.startswith(s + "/") and sizes[d] > 0.5 * sizes[s] for s in shown):
            continue
        shown.append(d)
        if len(shown) == LARGEST_SHOWN:
            break
    what = ", ".join(f"{d}/ ({human(sizes[d])})" for d in shown) or "files at its top"
    return UsageError(f"workdir {top} holds {human(total)}, over the {human(max_bytes)} "
                      f"limit; largest folders: {what}",
                      "add them to .hyperignore (gitignore syntax), keep data in storage: "
                      "or mounts:, or write workdir: none")


def human(n: int) -> str:
    """Bytes for people: ``512 B``, ``3.2 KiB``, ``1.5 GiB``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


@dataclass(frozen=True)
class Sent:
    """What a sync did on one node: ``current`` (the node's copy already matched: nothing
    sent), the number of contents and bytes sent, and of files the node already had."""

    current: bool
    files: int
    bytes: int
    kept: int


class Changed(Exception):
    """A file of the workdir changed or vanished after its manifest was made (the manifest
    is made again: :func:`manifest` with ``fresh``)."""


def sync(run, python: str, root: str, wid: str, m: Manifest) -> Sent:
    """Make ``<root>/work/<wid>`` on a node hold the manifest's files, sending only the
    contents the node lacks (two commands; one when its copy is current).

    Args:
        run: ``run(command, stdin=bytes) -> stdout bytes`` on the node; raises when the
            command fails (``Connection.run``).
        python: shell words that run the node runtime's Python with hypercli importable.
        root: the node's hypercli folder.
        wid: the workflow id.
    Returns:
        :class:`Sent`.
    Raises:
        Changed: a file to send no longer has the manifest's content (nothing is applied).
    """
    import io
    import shlex
    import tarfile
    contents = m.contents()
    ask = json.dumps({"digest": m.digest, "contents": sorted(contents)}).encode()
    base = f"{python} -m hypercli.node.workdir {shlex.quote(root)} {shlex.quote(wid)}"
    answer = json.loads(run(f"{base} have", ask) or b"{}")
    if answer.get("current"):
        return Sent(True, 0, 0, len(contents))
    missing = [c for c in answer.get("missing", []) if c in contents]
    buf = io.BytesIO()
    sent = 0
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("manifest.json")
        data = m.as_json()
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
        for c in missing:
            rel, size = contents[c]
            try:
                with open(os.path.join(m.root, rel), "rb") as f:
                    data = f.read(size + 1)
            except OSError:
                raise Changed(rel) from None
            if len(data) != size or hashlib.sha256(data).hexdigest() != c:
                raise Changed(rel)
            info = tarfile.TarInfo(f"objects/{c}")
            info.size = size
            tar.addfile(info, io.BytesIO(data))
            sent += size
    run(f"{base} apply", buf.getvalue())
    return Sent(False, len(missing), sent, len(contents) - len(missing))
