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

The checks are split by section of the file: :mod:`.yamltree` (the node tree and single
values), :mod:`.cluster` (``cluster``, ``storage``, ``mounts``), :mod:`.experiments` (each
experiment and the ``after`` DAG), :mod:`.parameters`, and :mod:`.resources` (what a task
needs of a node: CPUs, memory, GPUs, and how many nodes); :mod:`.specs` holds the frozen
values they build, :mod:`.environment` checks ``env:`` and ``secrets:``, and :mod:`.access`
derives what object storage the cluster's nodes need.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import replace

from yaml.nodes import MappingNode

from hypercli.errors import RecipeError
from hypercli.recipe.access import storage_grants
from hypercli.recipe.cluster import (  # noqa: F401
    _CLUSTER_KEYS,
    MOUNT_SCHEMES,
    PROVIDERS,
    STORAGE_SCHEMES,
    _cluster,
    _local_path,
    _mounts,
    _url,
)
from hypercli.recipe.experiments import _EXPERIMENT_KEYS, MAX_TASKS, _experiments  # noqa: F401
from hypercli.recipe.parameters import _RANGE_KEYS  # noqa: F401
from hypercli.recipe.specs import ClusterSpec, ExperimentSpec, Recipe, Resources
from hypercli.recipe.yamltree import (  # noqa: F401
    _INT64,
    _RECIPE_NAME,
    MAX_BYTES,
    MAX_EXPANDED,
    _check_keys,
    _compose,
    _Ctx,
    _int,
    _Item,
    _kind,
    _line,
    _mapping,
    _name,
    _precheck,
    _show,
    _str,
    _value,
)

__all__ = ["ClusterSpec", "ExperimentSpec", "Recipe", "Resources", "load_recipe",
           "parse_recipe"]


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
    workdir: str | None = base_dir
    if "workdir" in top:  # none (or null): no folder is sent, tasks start in an empty one
        if _value(ctx, top["workdir"].node) in (None, "none"):
            workdir = None
        else:
            workdir = _local_path(base_dir, _str(ctx, top["workdir"], "workdir"))
    mounts, rw_mounts, copy_mounts = ({}, frozenset(), frozenset())
    if "mounts" in top:
        mounts, rw_mounts, copy_mounts = _mounts(ctx, top["mounts"], base_dir)
    cluster = replace(cluster, grants=storage_grants(storage, mounts, rw_mounts))
    if "experiments" not in top:
        ctx.fail("experiments is required", None, "experiments",
                 "add experiments: with at least one experiment and its command")
    experiments, order = _experiments(ctx, top["experiments"])
    return Recipe(path=ctx.path, name=name, version=version, seed=seed, cluster=cluster,
                  storage=storage, workdir=workdir, mounts=mounts, rw_mounts=rw_mounts,
                  experiments=experiments,
                  order=order, digest=digest, copy_mounts=copy_mounts)


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



def _missing_hint(path: str) -> str | None:
    for ext in (".yaml", ".yml"):
        if os.path.isfile(path + ext):
            return f"did you mean '{path + ext}'?"
    return None
