"""Files split across tasks: the shard parameters of a recipe, resolved into file lists.

A parameter ``{shards: N, of: /data}`` splits the files of the dataset mounted at ``/data``
(or of a ``chunks+...`` dataset URL) into N shards; ``{files: PATTERN, per_task: K}`` gives each
task K of the files matching PATTERN. Each task gets ``HYPER_SHARD`` (its index),
``HYPER_SHARDS`` (their number) and ``HYPER_SHARD_FILES`` (a file listing its paths, one per
line, as the task sees them: under the mount path, or relative to the dataset root for a URL,
or to ``workdir`` for a pattern).

Rules:
  * A dataset's files are listed from its index (:func:`hypercli.mount.pack.dataset_files`),
    without mounting it, in pack order: the order the push wrote them into chunks.
  * Shards are contiguous runs of that order, balanced by bytes: shard k holds the files
    whose first byte falls in [k·B/N, (k+1)·B/N) of the B bytes in all, so a task reads
    whole chunks where it can (the Hyper paper, III-A: chunks are fetched whole). A dataset
    of fewer files than N makes fewer shards (no task gets nothing), and so do files so large
    that a run of the order holds several shares.
  * A pattern is matched against the dataset's paths when it starts with a mount path (fnmatch:
    ``*`` also matches ``/``), else as a glob under ``workdir`` on this machine; matches are
    taken in pack (or sorted) order, K at a time.
  * Every file is in exactly one shard. The lists are part of the plan's digest: a dataset
    that changed makes another workflow.
"""

from __future__ import annotations

import bisect
import dataclasses
import fnmatch
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from hypercli.errors import RecipeError
from hypercli.params import Shards
from hypercli.recipe import Recipe


@dataclass(frozen=True)
class ShardPlan:
    """The files of one experiment's shard parameter.

    Attributes:
        param: the parameter's name.
        files: every path, in order (as tasks see them).
        bounds: N+1 increasing positions into ``files``: shard k is files[bounds[k]:bounds[k+1]].
        digest: sha256 hex over the paths and bounds.
    """

    param: str
    files: tuple
    bounds: tuple
    digest: str

    def shard(self, k: int) -> list[str]:
        """The paths of shard k."""
        return list(self.files[self.bounds[k]:self.bounds[k + 1]])

    @property
    def count(self) -> int:
        return len(self.bounds) - 1

    def save(self, workflow: str, experiment: str) -> None:
        """Keep the plan beside the state file (:func:`plan_file`), where the scheduler
        reads each task's paths."""
        path = plan_file(workflow, experiment)
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(json.dumps({"param": self.param, "files": list(self.files),
                                    "bounds": list(self.bounds)}))


def plan_file(workflow: str, experiment: str) -> Path:
    """``$HYPER_HOME/shards/<workflow>/<experiment>.json``: an experiment's shard plan
    ({"param", "files", "bounds"}), written when the workflow is created."""
    from hypercli.state import home
    return home() / "shards" / workflow / f"{experiment}.json"


def balanced_bounds(sizes: list[int], n: int) -> list[int]:
    """Split a sequence of file sizes (bytes, in order) into at most ``n`` contiguous,
    non-empty runs balanced by bytes (module docstring); returns the run boundaries
    ``[0, ..., len(sizes)]``. Every file is in exactly one run."""
    if not sizes:
        return [0]
    starts, total = [], 0
    for s in sizes:  # byte offset where each file starts; empty files weigh one byte
        starts.append(total)
        total += max(s, 1)
    bounds = [0]
    for k in range(1, n):
        cut = bisect.bisect_left(starts, k * total / n)
        if bounds[-1] < cut < len(sizes):
            bounds.append(cut)
    bounds.append(len(sizes))
    return bounds


def _dataset(recipe: Recipe, of: str, field: str) -> tuple[str, str]:
    """(dataset URL, prefix tasks see the paths under) of a shard source."""
    if of.startswith("chunks+"):
        return of[len("chunks+"):], ""
    path = "/" + os.path.normpath(of).strip("/")
    url = recipe.mounts.get(path)
    if url is None:
        known = ", ".join(recipe.mounts) or "none"
        raise RecipeError(f"{of} is not a mount of this recipe (mounts: {known})",
                          path=recipe.path, field=field, hint="add it under mounts:, or give a "
                          "chunks+ dataset URL")
    if not url.startswith("chunks+"):
        raise RecipeError(f"{of} is a plain bucket mount: only a chunked dataset has an index "
                          "to split", path=recipe.path, field=field,
                          hint="push it with `hyper data push` and mount chunks+URL")
    return url[len("chunks+"):], path + "/"


def _files(recipe: Recipe, source: tuple, field: str) -> tuple[list[str], list[int]]:
    from hypercli.mount.pack import dataset_files
    kind, where = source[0], source[1]
    if kind == "dataset":
        url, prefix = _dataset(recipe, where, field)
        listed = dataset_files(url)
        return [prefix + p for p, _ in listed], [s for _, s in listed]
    mount = next((m for m in recipe.mounts if where == m or where.startswith(m + "/")), None)
    if mount is not None:
        url, prefix = _dataset(recipe, mount, field)
        listed = [(prefix + p, s) for p, s in dataset_files(url)]
        hits = [(p, s) for p, s in listed if fnmatch.fnmatchcase(p, where)]
        return [p for p, _ in hits], [s for _, s in hits]
    base = Path(recipe.workdir or (os.path.dirname(os.path.abspath(recipe.path))
                                   if recipe.path else os.getcwd()))
    hits = sorted(p for p in base.glob(where) if p.is_file())
    return [p.relative_to(base).as_posix() for p in hits], [p.stat().st_size for p in hits]


def resolve(recipe: Recipe) -> tuple[Recipe, dict[str, ShardPlan]]:
    """List the files of every shard parameter and size its values to the shards made.

    Returns:
        (the recipe with each shard parameter's values set to 0..shards-1, experiment name →
        ShardPlan).
    Raises:
        RecipeError: a shard source names no mount or matches no file; DatasetError or
            StoreError (exit 3) when the dataset cannot be read.
    """
    plans: dict[str, ShardPlan] = {}
    experiments = dict(recipe.experiments)
    for name, exp in recipe.experiments.items():
        for pname, spec in exp.parameters.items():
            if not isinstance(spec, Shards):
                continue
            field = f"experiments.{name}.parameters.{pname}"
            files, sizes = _files(recipe, spec.source, field)
            if not files:
                raise RecipeError(f"{spec.source[1]} has no file to split", path=recipe.path,
                                  field=field, line=exp.line)
            if spec.source[0] == "dataset":
                bounds = balanced_bounds(sizes, spec.source[2])
            else:
                per = spec.source[2]
                bounds = list(range(0, len(files), per)) + [len(files)]
            h = hashlib.sha256("\n".join(files).encode())
            h.update(repr(bounds).encode())
            plans[name] = ShardPlan(pname, tuple(files), tuple(bounds), h.hexdigest())
            parameters = dict(exp.parameters)
            parameters[pname] = Shards(tuple(range(len(bounds) - 1)), spec.source)
            experiments[name] = dataclasses.replace(exp, parameters=parameters)
    if not plans:
        return recipe, plans
    return dataclasses.replace(recipe, experiments=experiments), plans
