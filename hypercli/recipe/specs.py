"""The frozen values a recipe is turned into (DESIGN.md, "The recipe")."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ClusterSpec:
    """Where a recipe's tasks run.

    Attributes:
        name: cluster name (``cluster.name``, default the recipe name).
        provider: one of :data:`PROVIDERS`; default ``"local"``.
        workers: number of nodes (local: worker slots), ≥ 1, or None for the provider default.
        options: the provider-specific keys given (``region``, ``hosts``, ...), plain values.
        grants: the object storage its nodes need (:func:`hypercli.recipe.access.
            storage_grants` of the recipe's ``storage`` and ``mounts``).
        provider_given: the recipe names its provider (False: ``local`` by default, which
            the defaults file may change, :func:`hypercli.config.apply`).
    """

    name: str
    provider: str
    workers: int | None
    options: dict
    grants: tuple = ()
    provider_given: bool = True


@dataclass(frozen=True)
class Resources:
    """What one task (each rank of a multi-node task) needs of a node.

    Attributes:
        cpus: CPUs (a number > 0; default 1). Accounting only: a node holds tasks while the
            sum of their ``cpus`` is at most the CPUs it reported. Containers also get
            ``--cpus``.
        memory: bytes (0: no claim). Containers also get ``--memory``.
        gpus: whole GPUs (0: none, and the task sees none).
        gpu_type: a GPU name the node's GPUs must contain (``A100``, case-insensitive), or None.
        nodes: ranks of a multi-node (gang) task, each on a node of its own (default 1).
        disk_gb: boot disk of a node launched for it, GiB, or None for the cluster's.
        spot: ``True`` (spot only), ``False`` (on-demand only), ``"auto"`` (spot, then
            on-demand) or None for the cluster's ``spot``; chooses offers on clouds.
        instance_type: an explicit instance type for clouds, or None to let the optimizer
            choose (:mod:`hypercli.offers.optimizer`).
        arch: ``x86_64`` or ``arm64``: the CPU architecture of instances chosen on clouds,
            or None (x86_64).
    """

    cpus: float = 1
    memory: int = 0
    gpus: int = 0
    gpu_type: str | None = None
    nodes: int = 1
    disk_gb: int | None = None
    spot: bool | str | None = None
    instance_type: str | None = None
    arch: str | None = None

    def as_dict(self) -> dict:
        """Plain values (the state file keeps them as JSON); the choices of clouds
        (``disk_gb``, ``spot``, ``instance_type``) only when given, so a recipe without them
        plans as it did before they existed."""
        out = {"cpus": self.cpus, "memory": self.memory, "gpus": self.gpus,
               "gpu_type": self.gpu_type, "nodes": self.nodes}
        for k in ("disk_gb", "spot", "instance_type", "arch"):
            if getattr(self, k) is not None:
                out[k] = getattr(self, k)
        return out


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
        env: variable name → value (str); values may hold placeholders and ``${VAR}``
            references to the submitting environment (:mod:`hypercli.recipe.environment`).
        workers: most tasks of this experiment running at once, or None for no limit.
        line: 1-based line of the experiment's key in the file.
        resources: what each task needs of a node (:class:`Resources`).
        checkpoint_every: seconds between saves of a running attempt's ``HYPER_CHECKPOINT``.
        checkpoint_ranks: ``"each"`` (every rank of a multi-node task keeps its own
            ``HYPER_CHECKPOINT``) or ``"rank0"`` (rank 0's is kept and given to every rank).
        engine: ``"spark"`` or ``"ray"``, started across each task's nodes around its command
            (``hypercli/node/engine.py``), or None.
        registry_auth: ``{"username", "password"}`` for the image's registry, each the text
            written or ``${VAR}`` (:mod:`hypercli.registry`), or None.
        secrets: names of variables whose values come from the submitting environment and
            are never recorded (:mod:`hypercli.envvars`).
        timeout: seconds an attempt may run before it is stopped and counted as a failure,
            or None for no limit.
        minutes: the expected minutes of one task (``minutes:``), for ``hyper plan``'s cost
            estimate, or None.
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
    resources: Resources = field(default_factory=Resources)
    checkpoint_every: float = 60.0
    checkpoint_ranks: str = "each"
    engine: str | None = None
    registry_auth: dict | None = None
    secrets: tuple = ()
    timeout: float | None = None
    minutes: float | None = None


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
        workdir: absolute folder tasks run in (copied to remote nodes), or None
            (``workdir: none``: tasks start in an empty folder).
        mounts: absolute mount path → URL.
        rw_mounts: the mount paths mounted read-write (plain ``s3://`` only).
        copy_mounts: the mount paths of ``chunks+`` datasets copied whole to each node's
            disk (``mode: copy``, :mod:`hypercli.mount.copy`).
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
    workdir: str | None
    mounts: dict
    rw_mounts: frozenset
    experiments: dict
    order: tuple[str, ...]
    digest: str
    copy_mounts: frozenset = frozenset()
