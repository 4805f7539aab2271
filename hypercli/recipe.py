"""Recipe files: YAML text → a validated, frozen :class:`Recipe`.

Owns the recipe format of DESIGN.md ("The recipe"): reading the file, parsing YAML with line
numbers, and every check a recipe must pass before anything is planned or started. Each problem
is one :class:`~hypercli.errors.RecipeError` naming the file, the line, the dotted field path
(``experiments.search.samples``) and, when one is close, the key the user probably meant.
Parameter semantics (what a range or a list means, how many tasks) live in :mod:`hypercli.params`.
Pure apart from reading the one file; never touches state, network or the cloud.

YAML is read with PyYAML's SafeLoader as a node tree, so that every value keeps its line. Only
the known structure is walked, so aliases that make a structure recursive (``a: &x [*x]``) are
harmless, and alias "bombs" are refused by :data:`MAX_EXPANDED`. Merge keys (``<<: *base``)
work as in ``yaml.safe_load``; duplicate keys, which PyYAML would silently collapse, are errors.
One departure from PyYAML's YAML 1.1 rules: an unquoted ``1e-4`` is the number it is in YAML 1.2
(PyYAML would read the string "1e-4"), since learning rates are written that way.
"""

from __future__ import annotations

import datetime
import difflib
import hashlib
import heapq
import ipaddress
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple, NoReturn

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from hypercli import params
from hypercli.errors import RecipeError
from hypercli.params import Continuous, Discrete

__all__ = ["ClusterSpec", "ExperimentSpec", "Recipe", "load_recipe", "parse_recipe"]

MAX_BYTES = 256 << 10  # a recipe is a few KiB; PyYAML parses ~60 KiB/s at worst
MAX_TASKS = 1_000_000        #: largest number of tasks one recipe may make
MAX_EXPANDED = 8 * MAX_BYTES  #: alias expansion budget: 8 per node plus 1 per scalar character
PROVIDERS = ("local", "ssh", "aws", "gcp", "azure")
STORAGE_SCHEMES = ("file", "s3", "gs", "az")
#: plain bucket mounts exist for s3 only (goofys/s3fs); gs and az datasets mount as chunks+
MOUNT_SCHEMES = ("chunks+s3", "chunks+file", "chunks+gs", "chunks+az", "s3", "file")

_INT64 = 2**63 - 1  # every integer must fit a SQLite INTEGER
_RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_RANGE = re.compile(rf"\s*({_NUM})\s*-\s*({_NUM})\s*")
_INT_TEXT = re.compile(r"[+-]?\d+")
_URL = re.compile(r"([a-z][a-z0-9+]*)://(.*)", re.S)
_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?"
                   r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                   r"(?::(?P<port>\d{1,5}))?")
_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_EXP_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+")
_HASHABLE_KEYS = (str, int, float, bytes, datetime.date, type(None))


@dataclass(frozen=True)
class ClusterSpec:
    """Where a recipe's tasks run.

    Attributes:
        name: cluster name (``cluster.name``, default the recipe name).
        provider: one of :data:`PROVIDERS`; default ``"local"``.
        workers: number of nodes (local: worker slots), ≥ 1, or None for the provider default.
        options: the provider-specific keys given (``region``, ``hosts``, ...), plain values.
    """

    name: str
    provider: str
    workers: int | None
    options: dict


@dataclass(frozen=True)
class ExperimentSpec:
    """One experiment: a command run once per parameter set.

    Attributes:
        name: the experiment's key under ``experiments``.
        command: shell text with ``{{param}}`` placeholders (a list of lines joined by "\\n").
        parameters: name → :class:`~hypercli.params.Discrete` or ``Continuous``, in file order.
        sampling: ``"grid"`` or ``"random"``.
        samples: number of draws, or None for the full grid.
        after: names of the experiments that must finish first.
        retries: extra attempts of a failed task, 0..100.
        image: container image, or None to run on the node itself.
        env: variable name → value (str); values may hold placeholders.
        workers: most tasks of this experiment running at once, or None for no limit.
        line: 1-based line of the experiment's key in the file.
    """

    name: str
    command: str
    parameters: dict
    sampling: str
    samples: int | None
    after: tuple[str, ...]
    retries: int
    image: str | None
    env: dict
    workers: int | None
    line: int | None


@dataclass(frozen=True)
class Recipe:
    """A validated recipe (DESIGN.md, "The recipe").

    Attributes:
        path: the file as given, or None for a recipe parsed from text.
        name: recipe name (default: the file's stem).
        version: format version, always 1.
        seed: seed of every random draw of the plan.
        cluster: where tasks run.
        storage: object store URL (relative ``file://`` paths made absolute), or None.
        workdir: absolute folder tasks run in.
        mounts: absolute mount path → URL.
        experiments: name → :class:`ExperimentSpec`, in file order.
        order: experiment names in a topological order of ``after`` (file order among ready).
        digest: sha256 hex digest of the recipe text (UTF-8).
    """

    path: str | None
    name: str
    version: int
    seed: int
    cluster: ClusterSpec
    storage: str | None
    workdir: str
    mounts: dict
    experiments: dict
    order: tuple[str, ...]
    digest: str


def load_recipe(path: str | os.PathLike) -> Recipe:
    """Read and validate a recipe file.

    Args:
        path: the YAML file; relative paths inside it are resolved against its folder.
    Returns:
        the :class:`Recipe`, with ``path`` as given and ``name`` defaulting to the file's stem.
    Raises:
        RecipeError: missing file, a folder, unreadable, over 256 KiB, not UTF-8, or any problem
            :func:`parse_recipe` reports.
    """
    try:
        shown = os.fsdecode(os.fspath(path))
    except TypeError as e:
        raise RecipeError(f"not a file path: {e}") from None
    try:
        if os.path.isdir(shown):
            raise RecipeError("is a folder, not a recipe file", path=shown)
        with open(shown, "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except FileNotFoundError:
        raise RecipeError("no such recipe file", path=shown, hint=_missing_hint(shown)) from None
    except (OSError, ValueError) as e:
        reason = getattr(e, "strerror", None) or str(e)
        raise RecipeError(f"cannot read the recipe file: {reason}", path=shown) from None
    if len(data) > MAX_BYTES:
        raise RecipeError(f"recipe file is larger than {MAX_BYTES >> 10} KiB", path=shown)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise RecipeError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})",
                          path=shown, line=line) from None
    return parse_recipe(text, path=shown, base_dir=os.path.dirname(os.path.abspath(shown)))


def parse_recipe(text: str, path: str | None = None, base_dir: str | None = None) -> Recipe:
    """Validate recipe text.

    Args:
        text: the YAML document.
        path: the file it came from, for messages and the default name; None for plain text
            (then ``name`` is required).
        base_dir: folder that relative ``workdir``, ``storage`` and ``file://`` mounts are
            resolved against; default the current folder.
    Returns:
        the :class:`Recipe`.
    Raises:
        RecipeError: for every problem, never anything else; it names the line and field.
    """
    ctx = _Ctx(path)
    if not isinstance(text, str):
        ctx.fail(f"recipe text must be a str, not {type(text).__name__}")
    data = text.encode("utf-8", "surrogatepass")
    if len(data) > MAX_BYTES:
        ctx.fail(f"recipe is larger than {MAX_BYTES >> 10} KiB")
    root = _compose(ctx, text)
    if root is None:
        ctx.fail("recipe is empty", hint="a recipe needs at least experiments:")
    _precheck(ctx, root)
    if not isinstance(root, MappingNode):
        ctx.fail(f"the top level must be a mapping, not {_kind(_value(ctx, root))}", _line(root),
                 hint="start with keys such as name: and experiments:")
    try:
        base = os.path.abspath(base_dir if base_dir is not None else os.getcwd())
    except OSError as e:
        ctx.fail(f"cannot resolve relative paths: {e.strerror}")
    return _recipe(ctx, root, base, hashlib.sha256(data).hexdigest())


# --- YAML nodes ------------------------------------------------------------------------------

class _Item(NamedTuple):
    """A value node and the line of its key (or of the list item itself)."""

    line: int
    node: Node


class _Ctx:
    """Per-parse state: the file for messages and one constructor for scalars."""

    def __init__(self, path: str | None):
        self.path = path
        self.constructor = yaml.constructor.SafeConstructor()

    def fail(self, message: str, line: int | None = None, field: str | None = None,
             hint: str | None = None) -> NoReturn:
        raise RecipeError(message, path=self.path, line=line, field=field or None, hint=hint)


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _yaml_message(e: Exception) -> tuple[str, int | None]:
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        text = " ".join(p for p in (e.context, e.problem) if p)
        return text or type(e).__name__, (mark.line + 1 if mark else None)
    if isinstance(e, RecursionError):
        return "nested too deeply", None
    return (str(e).splitlines() or [type(e).__name__])[0], None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _compose(ctx: _Ctx, text: str) -> Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except Exception as e:  # PyYAML also raises ValueError, RecursionError, ...
        message, line = _yaml_message(e)
        ctx.fail(f"not valid YAML: {message}", line)


def _construct(ctx: _Ctx, node: ScalarNode) -> Any:
    if node.tag == _STR_TAG and node.style is None and _EXP_FLOAT.fullmatch(node.value):
        return float(node.value)  # YAML 1.2 reads 1e-4 as a number; PyYAML as a string
    try:
        return ctx.constructor.construct_object(node, deep=True)
    except Exception as e:  # e.g. ValueError for the timestamp 2024-13-45
        ctx.fail(f"not valid YAML: {_yaml_message(e)[0]}", _line(node))


def _value(ctx: _Ctx, node: Node) -> Any:
    """A scalar's Python value; a list or mapping node is returned as is."""
    return _construct(ctx, node) if isinstance(node, ScalarNode) else node


def _precheck(ctx: _Ctx, root: Node) -> None:
    """Refuse what ``yaml.safe_load`` would (bad scalars, odd tags), duplicate keys anywhere,
    and alias expansion beyond :data:`MAX_EXPANDED`. Visits each node once."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ScalarNode):
            if _SURROGATE.search(node.value):
                ctx.fail("not valid Unicode: a lone surrogate (a \\ud800-\\udfff escape "
                         "that is not half of a pair)", _line(node),
                         hint="write the character itself, or \\U0001F389 for one above "
                         "U+FFFF")
            if node.tag != _MERGE_TAG:
                _construct(ctx, node)
        elif node.tag not in (_MAP_TAG, _SEQ_TAG):
            ctx.fail(f"not valid YAML: the tag {node.tag} is not supported", _line(node))
        elif isinstance(node, SequenceNode):
            stack.extend(node.value)
        else:
            keys: dict = {}
            for k, v in node.value:
                stack += (k, v)
                if isinstance(k, ScalarNode):
                    key = "<<" if k.tag == _MERGE_TAG else _construct(ctx, k)
                    if not isinstance(key, _HASHABLE_KEYS):
                        continue
                    if key in keys:
                        ctx.fail(f"duplicate key {_show(key)} (first on line {keys[key]})",
                                 _line(k))
                    keys[key] = _line(k)
    if _expanded_size(root) > MAX_EXPANDED:
        ctx.fail("aliases expand to too large a document", hint="use fewer aliases (*name)")


def _children(node: Node) -> list:
    if isinstance(node, SequenceNode):
        return node.value
    return [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else []


def _expanded_size(root: Node) -> int:
    """Size of the document with aliases expanded (a recursive alias counts once), stopping
    early past :data:`MAX_EXPANDED`."""
    memo: dict[int, int] = {}
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            size = 8 + sum(memo.get(id(c), 8) for c in _children(node))
            memo[id(node)] = size
            open_.discard(id(node))
            if size > MAX_EXPANDED:
                return size
        elif id(node) not in memo and id(node) not in open_:
            if isinstance(node, ScalarNode):
                memo[id(node)] = 8 + len(node.value)
                continue
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
    return memo[id(root)]


def _entries(ctx: _Ctx, node: MappingNode, field: str, seen: set, depth: int = 0) -> dict:
    """key → _Item of a mapping node; merge keys (``<<``) expanded, explicit keys winning."""
    if depth > 50:
        ctx.fail("merge keys (<<) nested too deeply", _line(node), field)
    own: dict[str, _Item] = {}
    merged: dict[str, _Item] = {}
    for k, v in node.value:
        if k.tag == _MERGE_TAG:
            for src in v.value if isinstance(v, SequenceNode) else [v]:
                if not isinstance(src, MappingNode):
                    ctx.fail("<< must be given a mapping or a list of mappings", _line(k), field)
                if id(src) not in seen:
                    seen.add(id(src))
                    for key, item in _entries(ctx, src, field, seen, depth + 1).items():
                        merged.setdefault(key, item)
            continue
        key = _value(ctx, k)
        if not isinstance(key, str):
            if not isinstance(k, ScalarNode):
                ctx.fail(f"keys must be strings, not {_kind(key)}", _line(k), field)
            ctx.fail(f"key {_show(key)} must be a string", _line(k), field,
                     f"quote it: '{k.value}'")
        own[key] = _Item(_line(k), v)
    return {**merged, **own}


def _mapping(ctx: _Ctx, item: _Item, field: str, *, null_ok: bool = False) -> dict:
    """The entries of a mapping value; null counts as an empty mapping when ``null_ok``."""
    v = _value(ctx, item.node)
    if v is None and null_ok:
        return {}
    if not isinstance(v, MappingNode):
        ctx.fail(f"{_leaf(field)} must be a mapping, not {_kind(v)}", item.line, field)
    return _entries(ctx, v, field, {id(v)})


def _check_keys(ctx: _Ctx, entries: dict, allowed, field: str) -> None:
    for key, item in entries.items():
        if key not in allowed:
            ctx.fail(f"unknown key {_show(key)}", item.line, _join(field, key),
                     _suggest(key, list(allowed), "valid keys"))


# --- scalar fields ---------------------------------------------------------------------------

def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _leaf(field: str) -> str:
    return field.rsplit(".", 1)[-1]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(v: Any) -> str:
    if isinstance(v, MappingNode):
        return "a mapping"
    if isinstance(v, SequenceNode):
        return "a list"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, int):
        return f"an integer ({_show(v)})"
    if isinstance(v, float):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return f"a string ({_show(v)})"
    if isinstance(v, datetime.date):
        return f"a date ({v})"
    return f"a {type(v).__name__}"


def _suggest(word: str, choices: list, label: str) -> str | None:
    """'did you mean ...?' for a close match, else the list of choices (first 12)."""
    close = difflib.get_close_matches(word[:200], choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if not choices:
        return None
    more = ", ..." if len(choices) > 12 else ""
    return f"{label}: {', '.join(choices[:12])}{more}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _get(ctx: _Ctx, item: _Item, field: str, ok: Callable[[Any], bool], what: str) -> Any:
    v = _value(ctx, item.node)
    if not ok(v):
        ctx.fail(f"{_leaf(field)} must be {what}, not {_kind(v)}", item.line, field)
    return v


def _str(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _get(ctx, item, field, lambda v: isinstance(v, str), "a string")
    if not v.strip():
        ctx.fail(f"{_leaf(field)} must not be empty", item.line, field)
    if "\x00" in v:
        ctx.fail(f"{_leaf(field)} must not contain a NUL character", item.line, field)
    return v


def _int(ctx: _Ctx, item: _Item, field: str, lo: int | None = None, hi: int = _INT64) -> int:
    v = _get(ctx, item, field, _is_int, "an integer")
    if lo is not None and v < lo:
        ctx.fail(f"{_leaf(field)} must be at least {lo}", item.line, field)
    if v > hi:
        ctx.fail(f"{_leaf(field)} must be at most {hi}", item.line, field)
    return v


def _bool(ctx: _Ctx, item: _Item, field: str) -> bool:
    return _get(ctx, item, field, lambda v: isinstance(v, bool), "true or false")


def _strings(ctx: _Ctx, item: _Item, field: str, *, single_ok: bool, empty_ok: bool) -> list:
    """A list of non-empty strings (or one string when ``single_ok``), with item lines."""
    if single_ok and isinstance(item.node, ScalarNode):
        return [(_str(ctx, item, field), item.line)]
    if not isinstance(item.node, SequenceNode):
        what = "a string or a list of strings" if single_ok else "a list of strings"
        ctx.fail(f"{_leaf(field)} must be {what}, not {_kind(_value(ctx, item.node))}",
                 item.line, field)
    if not item.node.value and not empty_ok:
        ctx.fail(f"{_leaf(field)} must not be an empty list", item.line, field)
    return [(_str(ctx, _Item(_line(n), n), f"{field}[{i}]"), _line(n))
            for i, n in enumerate(item.node.value)]


def _name(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _str(ctx, item, field)
    if not _RECIPE_NAME.fullmatch(v):
        ctx.fail(f"{_leaf(field)} {_show(v)} is not a valid name", item.line, field,
                 "1-63 letters, digits, '_', '.', '-', starting with a letter or digit")
    return v


# --- top level, cluster, storage -------------------------------------------------------------

_TOP_KEYS = ("version", "name", "seed", "cluster", "storage", "workdir", "mounts", "experiments")


def _recipe(ctx: _Ctx, root: MappingNode, base_dir: str, digest: str) -> Recipe:
    top = _mapping(ctx, _Item(_line(root), root), "")
    _check_keys(ctx, top, _TOP_KEYS, "")
    version = _int(ctx, top["version"], "version") if "version" in top else 1
    if version != 1:
        ctx.fail(f"unsupported version {version}", top["version"].line, "version",
                 "this hyper reads version: 1")
    name = _recipe_name(ctx, top.get("name"))
    seed = _int(ctx, top["seed"], "seed", lo=-_INT64 - 1) if "seed" in top else 0
    cluster = _cluster(ctx, top.get("cluster"), name)
    storage = None
    if "storage" in top:
        storage = _url(ctx, top["storage"], "storage", STORAGE_SCHEMES, base_dir)
    workdir = base_dir
    if "workdir" in top:
        workdir = _local_path(base_dir, _str(ctx, top["workdir"], "workdir"))
    mounts = _mounts(ctx, top["mounts"], base_dir) if "mounts" in top else {}
    if "experiments" not in top:
        ctx.fail("experiments is required", None, "experiments",
                 "add experiments: with at least one experiment and its command")
    experiments, order = _experiments(ctx, top["experiments"])
    return Recipe(path=ctx.path, name=name, version=version, seed=seed, cluster=cluster,
                  storage=storage, workdir=workdir, mounts=mounts, experiments=experiments,
                  order=order, digest=digest)


def _recipe_name(ctx: _Ctx, item: _Item | None) -> str:
    if item is not None:
        return _name(ctx, item, "name")
    if ctx.path is None:
        ctx.fail("name is required", None, "name", "add name: my-search")
    stem = os.path.splitext(os.path.basename(ctx.path))[0]
    if not _RECIPE_NAME.fullmatch(stem):
        ctx.fail(f"the file name {_show(stem)} is not a valid recipe name", None, "name",
                 "add name: with letters, digits, '_', '.', '-'")
    return stem


def _hosts(ctx: _Ctx, item: _Item, field: str) -> list:
    out = []
    for host, line in _strings(ctx, item, field, single_ok=False, empty_ok=False):
        m = _HOST.fullmatch(host)
        if not m or not 0 < int(m["port"] or 22) < 65536:
            ctx.fail(f"host {_show(host)} is not of the form user@host:port", line, field,
                     "user and port are optional: 10.0.0.5, root@node1:2222")
        out.append(host)
    return out


def _zone(ctx: _Ctx, item: _Item, field: str) -> str | list:
    zones = [z for z, _ in _strings(ctx, item, field, single_ok=True, empty_ok=False)]
    return zones[0] if isinstance(item.node, ScalarNode) else zones


def _cidr(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _str(ctx, item, field)
    try:
        ipaddress.ip_network(v, strict=False)
    except ValueError:
        ctx.fail(f"ssh_cidr {_show(v)} is not a network", item.line, field,
                 "write it as 203.0.113.0/24")
    return v


def _price(ctx: _Ctx, item: _Item, field: str) -> float:
    v = _get(ctx, item, field, _is_number, "a number")
    if not (_finite(v) and v > 0):
        ctx.fail(f"max_price must be a number above 0, not {_show(v)}", item.line, field)
    return v


_Check = Callable[[_Ctx, _Item, str], Any]
_CLOUD_KEYS: dict[str, _Check] = {
    "region": _str, "zone": _zone, "instance_type": _str, "spot": _bool, "image": _str,
    "disk_gb": lambda c, i, f: _int(c, i, f, lo=10), "max_price": _price,
    "idle_minutes": lambda c, i, f: _int(c, i, f, lo=1), "replace_preempted": _bool,
    "ssh_cidr": _cidr,
}
_PROVIDER_KEYS: dict[str, dict[str, _Check]] = {
    "local": {},
    "ssh": {"hosts": _hosts, "identity_file": _str, "user": _str,
            "port": lambda c, i, f: _int(c, i, f, lo=1, hi=65535)},
    "aws": _CLOUD_KEYS,
    "gcp": {**_CLOUD_KEYS, "project": _str},
    "azure": {**_CLOUD_KEYS, "resource_group": _str},
}
_CLUSTER_KEYS = ("provider", "name", "workers")


def _cluster(ctx: _Ctx, item: _Item | None, recipe_name: str) -> ClusterSpec:
    if item is None:
        return ClusterSpec(name=recipe_name, provider="local", workers=None, options={})
    keys = _mapping(ctx, item, "cluster", null_ok=True)
    provider = _str(ctx, keys["provider"], "cluster.provider") if "provider" in keys else "local"
    if provider not in PROVIDERS:
        ctx.fail(f"unknown provider {_show(provider)}", keys["provider"].line,
                 "cluster.provider", _suggest(provider, list(PROVIDERS), "providers"))
    own = _PROVIDER_KEYS[provider]
    for key, it in keys.items():
        owners = [p for p in PROVIDERS if key in _PROVIDER_KEYS[p]]
        if key not in own and owners:
            ctx.fail(f"'{key}' applies to provider{'s' if len(owners) > 1 else ''} "
                     f"{', '.join(owners)}, not {provider}", it.line, f"cluster.{key}",
                     f"set provider: {owners[0]}" if len(owners) == 1 else None)
    _check_keys(ctx, keys, _CLUSTER_KEYS + tuple(own), "cluster")
    name = _name(ctx, keys["name"], "cluster.name") if "name" in keys else recipe_name
    workers = _int(ctx, keys["workers"], "cluster.workers", lo=1) if "workers" in keys else None
    options = {k: own[k](ctx, it, f"cluster.{k}") for k, it in keys.items() if k in own}
    if provider == "ssh" and "hosts" not in options:
        ctx.fail("provider ssh needs hosts", item.line, "cluster.hosts",
                 "hosts: [user@10.0.0.5:22, ...]")
    return ClusterSpec(name=name, provider=provider, workers=workers, options=options)


def _local_path(base_dir: str, text: str) -> str:
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(text)))


def _url(ctx: _Ctx, item: _Item, field: str, schemes: tuple, base_dir: str) -> str:
    """A URL with one of ``schemes``; the path of a ``file`` URL is made absolute."""
    v = _str(ctx, item, field)
    m = _URL.fullmatch(v)
    if not m or m[1] not in schemes:
        ctx.fail(f"{_leaf(field)} must be a URL starting with "
                 f"{', '.join(s + '://' for s in schemes)}, not {_show(v)}", item.line, field)
    if re.search(r"[\x00-\x1f\x7f]", v):
        ctx.fail(f"{_leaf(field)} must not contain control characters", item.line, field)
    scheme, rest = m[1], m[2]
    if scheme.endswith("file"):
        if not rest:
            ctx.fail(f"{_leaf(field)} {_show(v)} has no path", item.line, field)
        return f"{scheme}://{_local_path(base_dir, rest)}"
    if not rest or rest.startswith("/"):
        ctx.fail(f"{_leaf(field)} {_show(v)} has no bucket", item.line, field,
                 f"{scheme}://BUCKET/PREFIX")
    return v


def _mounts(ctx: _Ctx, item: _Item, base_dir: str) -> dict:
    out: dict[str, str] = {}
    for target, it in _mapping(ctx, item, "mounts", null_ok=True).items():
        field = f"mounts.{target}"
        if not target.startswith("/") or ".." in target.split("/") or "\x00" in target:
            ctx.fail(f"mount path {_show(target)} must be absolute, without '..'", it.line,
                     field, "for example /data")
        norm = "/" + os.path.normpath(target).lstrip("/")
        if norm == "/":
            ctx.fail("cannot mount over /", it.line, field)
        if norm in out:
            ctx.fail(f"mount path {norm} is given twice", it.line, field)
        out[norm] = _url(ctx, it, field, MOUNT_SCHEMES, base_dir)
    return out


# --- experiments -----------------------------------------------------------------------------

_EXPERIMENT_KEYS = ("command", "image", "parameters", "sampling", "samples", "after",
                    "retries", "env", "workers")


def _experiments(ctx: _Ctx, item: _Item) -> tuple[dict, tuple]:
    entries = _mapping(ctx, item, "experiments", null_ok=True)
    if not entries:
        ctx.fail("experiments must not be empty", item.line, "experiments",
                 "add an experiment with a command")
    experiments, counts, after_lines = {}, {}, {}
    for name, it in entries.items():
        if not _EXPERIMENT_NAME.fullmatch(name):
            ctx.fail(f"experiment name {_show(name)} is not valid", it.line,
                     f"experiments.{name}",
                     "1-64 letters, digits, '_', '.', '-', not starting with '.' or '-'")
        experiments[name], counts[name], after_lines[name] = _experiment(ctx, name, it)
    _check_after(ctx, experiments, after_lines)
    total = sum(counts.values())
    if total > MAX_TASKS:
        big = max(counts, key=counts.__getitem__)
        ctx.fail(f"the recipe makes {_count(total)} tasks, more than {MAX_TASKS:,}", item.line,
                 "experiments", f"experiment {big} alone makes {_count(counts[big])}")
    return experiments, _order(ctx, experiments, after_lines)


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**18 else "over 10^18"


def _experiment(ctx: _Ctx, name: str, item: _Item) -> tuple[ExperimentSpec, int, list]:
    """One experiment → (spec, task count, [(after name, line), ...])."""
    f = f"experiments.{name}"
    keys = _mapping(ctx, item, f)
    _check_keys(ctx, keys, _EXPERIMENT_KEYS, f)
    if "command" not in keys:
        ctx.fail("command is required", item.line, f"{f}.command", "add command: python ...")
    command = _command(ctx, keys["command"], f"{f}.command")
    parameters = _parameters(ctx, keys.get("parameters"), f"{f}.parameters")
    sampling = _sampling(ctx, keys["sampling"], f"{f}.sampling") if "sampling" in keys else "grid"
    samples = _int(ctx, keys["samples"], f"{f}.samples", lo=1) if "samples" in keys else None
    after = []
    if "after" in keys:
        after = _strings(ctx, keys["after"], f"{f}.after", single_ok=True, empty_ok=True)
    retries = _int(ctx, keys["retries"], f"{f}.retries", 0, 100) if "retries" in keys else 0
    image = _str(ctx, keys["image"], f"{f}.image") if "image" in keys else None
    env = _env(ctx, keys["env"], f"{f}.env") if "env" in keys else {}
    workers = _int(ctx, keys["workers"], f"{f}.workers", lo=1) if "workers" in keys else None
    _check_placeholders(ctx, command, parameters, keys["command"].line, f"{f}.command")
    for var, (value, line) in env.items():
        _check_placeholders(ctx, value, parameters, line, f"{f}.env.{var}")
    try:
        count = params.count_samples(parameters, sampling, samples)
    except ValueError as e:
        line = keys["samples"].line if "samples" in keys else item.line
        ctx.fail(str(e), line, f"{f}.samples", "add samples: N")
    spec = ExperimentSpec(
        name=name, command=command, parameters=parameters, sampling=sampling, samples=samples,
        after=tuple(dict.fromkeys(a for a, _ in after)), retries=retries, image=image,
        env={k: v for k, (v, _) in env.items()}, workers=workers, line=item.line)
    return spec, count, after


def _command(ctx: _Ctx, item: _Item, field: str) -> str:
    if isinstance(item.node, SequenceNode):
        lines = [_get(ctx, _Item(_line(n), n), f"{field}[{i}]", lambda v: isinstance(v, str),
                      "a string") for i, n in enumerate(item.node.value)]
        text = "\n".join(lines)
    else:
        text = _get(ctx, item, field, lambda v: isinstance(v, str), "a string or a list of lines")
    if not text.strip():
        ctx.fail("command must not be empty", item.line, field)
    if "\x00" in text:
        ctx.fail("command must not contain a NUL character", item.line, field)
    return text


def _sampling(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _str(ctx, item, field)
    if v not in ("grid", "random"):
        ctx.fail(f"sampling must be grid or random, not {_show(v)}", item.line, field,
                 _suggest(v, ["grid", "random"], "choices"))
    return v


def _env(ctx: _Ctx, item: _Item, field: str) -> dict:
    """name → (value text, line). Numbers and dates keep the text as written (1.10 stays
    "1.10"); booleans become "true"/"false"."""
    out = {}
    for var, it in _mapping(ctx, item, field, null_ok=True).items():
        f = f"{field}.{var}"
        if not _IDENT.fullmatch(var):
            ctx.fail(f"{_show(var)} is not a valid variable name", it.line, f,
                     "letters, digits and '_', not starting with a digit")
        if var.startswith("HYPER_"):
            ctx.fail(f"{var} is reserved: hyper sets HYPER_ variables itself", it.line, f,
                     "choose another name")
        v = _value(ctx, it.node)
        if isinstance(v, bool):
            text = "true" if v else "false"
        elif isinstance(v, str):
            text = v
        elif isinstance(v, (int, float, datetime.date)):
            text = it.node.value
        else:
            ctx.fail(f"{var} must be a string, number or boolean, not {_kind(v)}", it.line, f,
                     'use "" for an empty value' if v is None else None)
        if "\x00" in text:
            ctx.fail(f"{var} must not contain a NUL character", it.line, f)
        out[var] = (text, it.line)
    return out


def _check_placeholders(ctx: _Ctx, text: str, parameters: dict, line: int, field: str) -> None:
    for name in params.placeholders(text):
        if name not in parameters:
            hint = _suggest(name, list(parameters), "parameters") if parameters else None
            ctx.fail(f"placeholder {{{{{name}}}}} names no parameter", line, field,
                     hint or f"add {name} under parameters")


def _check_after(ctx: _Ctx, experiments: dict, after_lines: dict) -> None:
    for name, refs in after_lines.items():
        for ref, line in refs:
            field = f"experiments.{name}.after"
            if ref == name:
                ctx.fail(f"experiment {name} cannot run after itself", line, field)
            if ref not in experiments:
                others = [n for n in experiments if n != name]
                ctx.fail(f"after names no experiment {_show(ref)}", line, field,
                         _suggest(ref, others, "experiments"))


def _order(ctx: _Ctx, experiments: dict, after_lines: dict) -> tuple[str, ...]:
    """Kahn's algorithm, taking ready experiments in file order; a cycle is an error."""
    names = list(experiments)
    index = {n: i for i, n in enumerate(names)}
    waiting = {n: len(e.after) for n, e in experiments.items()}
    dependents: dict[str, list[str]] = {n: [] for n in names}
    for n, e in experiments.items():
        for dep in e.after:
            dependents[dep].append(n)
    ready = [index[n] for n in names if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        name = names[heapq.heappop(ready)]
        order.append(name)
        for m in dependents[name]:
            waiting[m] -= 1
            if waiting[m] == 0:
                heapq.heappush(ready, index[m])
    if len(order) < len(names):
        _fail_cycle(ctx, experiments, set(order), index, after_lines)
    return tuple(order)


def _fail_cycle(ctx: _Ctx, experiments: dict, placed: set, index: dict,
                after_lines: dict) -> NoReturn:
    """Every unplaced experiment waits on another unplaced one: follow those edges to a cycle."""
    path = [min((n for n in experiments if n not in placed), key=index.__getitem__)]
    seen = {path[0]: 0}
    while True:
        nxt = next(d for d in experiments[path[-1]].after if d not in placed)
        if nxt in seen:
            cycle = path[seen[nxt]:]
            break
        seen[nxt] = len(path)
        path.append(nxt)
    start = cycle.index(min(cycle, key=index.__getitem__))
    cycle = cycle[start:] + cycle[:start]
    line = next(ln for ref, ln in after_lines[cycle[0]] if ref == cycle[1 % len(cycle)])
    shown = cycle + [cycle[0]] if len(cycle) <= 8 else cycle[:4] + ["..."] + cycle[-3:] + cycle[:1]
    ctx.fail(f"cycle in after: {' -> '.join(shown)}", line, f"experiments.{cycle[0]}.after",
             f"the cycle has {len(cycle)} experiments" if len(cycle) > 8 else None)


# --- parameters ------------------------------------------------------------------------------

_RANGE_KEYS = ("min", "max", "log", "type")


def _parameters(ctx: _Ctx, item: _Item | None, field: str) -> dict:
    if item is None:
        return {}
    out = {}
    for name, it in _mapping(ctx, item, field, null_ok=True).items():
        f = f"{field}.{name}"
        if not _IDENT.fullmatch(name):
            ctx.fail(f"parameter name {_show(name)} is not valid", it.line, f,
                     "letters, digits and '_', not starting with a digit")
        out[name] = _parameter(ctx, it, f)
    return out


def _parameter(ctx: _Ctx, item: _Item, field: str) -> params.ParamSpec:
    """A list → Discrete; "a-b" or {min, max, log, type} → Continuous; a scalar → constant."""
    node = item.node
    if isinstance(node, SequenceNode):
        if not node.value:
            ctx.fail("empty list", item.line, field, "give at least one value")
        return Discrete(tuple(_param_value(ctx, _Item(_line(n), n), f"{field}[{i}]")
                              for i, n in enumerate(node.value)))
    if isinstance(node, MappingNode):
        return _range_mapping(ctx, item, field)
    v = _value(ctx, node)
    m = _RANGE.fullmatch(v) if isinstance(v, str) else None
    if m:
        integer = bool(_INT_TEXT.fullmatch(m[1]) and _INT_TEXT.fullmatch(m[2]))
        low, high = (_number_text(t, integer) for t in (m[1], m[2]))
        shown = f"{m[1]}-{m[2]}"
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return _continuous(ctx, low, high, False, integer, item, field, shown)
    return Discrete((_param_value(ctx, item, field),))


def _number_text(text: str, integer: bool) -> float | int:
    x = float(text)
    return int(text) if integer and math.isfinite(x) else x


def _param_value(ctx: _Ctx, item: _Item, field: str) -> Any:
    v = _value(ctx, item.node)
    if v is None:
        ctx.fail(f"{_leaf(field)} has no value", item.line, field,
                 'give a list, a range such as "0.01-0.3", or a constant')
    if not isinstance(v, (str, int, float)):
        ctx.fail(f"{_leaf(field)} must be a string, number or boolean, not {_kind(v)}",
                 item.line, field, "quote it" if isinstance(v, datetime.date) else None)
    if isinstance(v, float) and not math.isfinite(v):
        ctx.fail(f"{_leaf(field)} must be a finite number, not {v}", item.line, field)
    if isinstance(v, str) and "\x00" in v:
        ctx.fail(f"{_leaf(field)} must not contain a NUL character", item.line, field)
    return v


def _range_mapping(ctx: _Ctx, item: _Item, field: str) -> Continuous:
    keys = _mapping(ctx, item, field)
    _check_keys(ctx, keys, _RANGE_KEYS, field)
    for k in ("min", "max"):
        if k not in keys:
            ctx.fail(f"a range needs {k}", item.line, f"{field}.{k}", "{min: 1, max: 10}")
    low, high = (_get(ctx, keys[k], f"{field}.{k}", _is_number, "a number") for k in ("min", "max"))
    log = _bool(ctx, keys["log"], f"{field}.log") if "log" in keys else False
    kind = _str(ctx, keys["type"], f"{field}.type") if "type" in keys else None
    if kind not in (None, "int", "float"):
        ctx.fail(f"type must be int or float, not {_show(kind)}", keys["type"].line,
                 f"{field}.type")
    integer = kind == "int" if kind else _is_int(low) and _is_int(high)
    for k, b in (("min", low), ("max", high)):
        if not _finite(b):
            ctx.fail(f"{k} must be a finite number, not {_show(b)}", keys[k].line, f"{field}.{k}")
        if integer and b != int(b):
            ctx.fail(f"{k} must be a whole number with type int, not {b}", keys[k].line,
                     f"{field}.{k}")
    low, high = (int(low), int(high)) if integer else (float(low), float(high))
    shown = f"{params.format_value(low)}-{params.format_value(high)}"
    return _continuous(ctx, low, high, log, integer, item, field, shown)


def _continuous(ctx: _Ctx, low, high, log: bool, integer: bool, item: _Item, field: str,
                shown: str) -> Continuous:
    if not (_finite(low) and _finite(high) and _finite(high - low)):
        ctx.fail(f"range {shown} must have finite bounds", item.line, field)
    if not low < high:
        ctx.fail(f"empty range {shown}: min must be below max", item.line, field)
    if log and low <= 0:
        ctx.fail(f"log range {shown} needs min above 0", item.line, field)
    return Continuous(low, high, log=log, integer=integer)


def _missing_hint(path: str) -> str | None:
    for ext in (".yaml", ".yml"):
        if os.path.isfile(path + ext):
            return f"did you mean '{path + ext}'?"
    return None
