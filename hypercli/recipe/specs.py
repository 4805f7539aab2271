"""The frozen values a recipe is turned into (DESIGN.md, "The recipe")."""

from __future__ import annotations

from dataclasses import dataclass


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
