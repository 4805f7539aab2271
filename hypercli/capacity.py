"""What a node can hold, what its tasks hold of it, and where the next task fits.

A node's *capacity* is what its bootstrap measured (the agent's ``hello``: CPUs, memory, GPUs
with their indexes from ``nvidia-smi``), capped by its ``slots`` (the most tasks it runs at
once). A task (each rank of a multi-node task) asks :class:`~hypercli.recipe.Resources`; when
it is placed it gets a *claim*: its CPUs and memory, and the indexes of *its own* GPUs. The
claims of a node's live attempts, of every workflow, are its leases (the ``claim`` column of
the state file's attempts): free capacity is capacity less those claims, so two drivers on one
cluster never place more than it holds (each places inside one write transaction).

Rules:
  * A task fits a node when the node has a free slot, at least the CPUs and memory asked left
    free, and as many free GPUs as asked whose name contains ``gpu_type`` (case-insensitive).
  * GPUs are given lowest index first. Among nodes that fit, a GPU task goes where the fewest
    GPUs would be left free (best fit keeps whole nodes free for larger tasks); other tasks go
    where the most slots are free (spreading them, as before resources existed).
  * A multi-node task of N ranks is placed all at once on N distinct nodes, or not at all.
  * The rendezvous port of a multi-node attempt is the lowest port from :data:`BASE_PORT` not
    claimed by another live attempt of its rank-0 node (torch.distributed's default, 29500).
    An ``engine:`` attempt claims :data:`ENGINE_PORTS` consecutive ports there the same way
    (its master's port, web UI, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BASE_PORT = 29500  #: torch.distributed's default MASTER_PORT (pytorch.org, torchrun docs)
ENGINE_PORTS = 2  #: ports an engine's master needs at once (hypercli/node/engine.py lists them)
EPS = 1e-9  # fractional CPUs are summed as floats


def gpus_of(info: dict) -> dict[int, dict]:
    """index → {"name", "memory_mib"} of a node's GPUs, from its ``info`` (the agent's
    ``hello``: a list of dicts; older bootstraps recorded names only, indexed by position)."""
    out = {}
    for i, g in enumerate(info.get("gpus") or []):
        if isinstance(g, dict):
            out[int(g.get("index", i))] = {"name": str(g.get("name") or ""),
                                           "memory_mib": g.get("memory_mib")}
        else:
            out[i] = {"name": str(g).split(",")[0].strip(), "memory_mib": None}
    return out


@dataclass
class Free:
    """What is left of one node (mutable: placing a task takes from it).

    Attributes:
        node: node name.
        slots: tasks it can still start.
        cpus: CPUs left (float).
        memory: bytes left, or None when the node's memory is unknown.
        gpus: free GPU index → name.
        ports: rendezvous ports claimed by its live attempts.
        total: the node's full capacity, as (cpus, memory or None, number of GPUs).
        gpu_names: the names of all its GPUs.
    """

    node: str
    slots: int
    cpus: float
    memory: int | None
    gpus: dict = field(default_factory=dict)
    ports: set = field(default_factory=set)
    total: tuple = (0, None, 0)
    gpu_names: list = field(default_factory=list, repr=False)

    def fits(self, need: dict) -> bool:
        """True when a task asking ``need`` (``Resources.as_dict()``) fits here now."""
        return (self.slots >= 1 and self.cpus + EPS >= need.get("cpus", 1)
                and (not need.get("memory") or self.memory is None
                     or self.memory >= need["memory"])
                and (not need.get("gpus") or len(self._gpus(need)) >= need["gpus"]))

    def could_ever(self, need: dict) -> bool:
        """True when the empty node would hold a task asking ``need``."""
        cpus, memory, _ = self.total
        gpu_type = (need.get("gpu_type") or "").lower()
        names = [n for n in self.gpu_names if gpu_type in n.lower()]
        return (cpus + EPS >= need.get("cpus", 1) and len(names) >= need.get("gpus", 0)
                and (not need.get("memory") or memory is None or memory >= need["memory"]))

    def _gpus(self, need: dict) -> list[int]:
        t = (need.get("gpu_type") or "").lower()
        return sorted(i for i, name in self.gpus.items() if t in name.lower())

    def take(self, need: dict, port: int = 0) -> dict:
        """Claim ``need`` here (it must fit), and ``port`` consecutive ports when > 0 (True
        counts as 1); returns the claim ``{"cpus", "memory", "gpus": [indexes], "port"?: the
        first port, "ports"?: how many when more than 1}``."""
        gpus = self._gpus(need)[:need.get("gpus", 0)]
        for i in gpus:
            del self.gpus[i]
        self.slots -= 1
        self.cpus -= need.get("cpus", 1)
        if self.memory is not None:
            self.memory -= need.get("memory", 0)
        claim = {"cpus": need.get("cpus", 1), "memory": need.get("memory", 0), "gpus": gpus}
        if port:
            n = int(port)
            p = BASE_PORT
            while any(q in self.ports for q in range(p, p + n)):
                p += 1
            self.ports.update(range(p, p + n))
            claim["port"] = p
            if n > 1:
                claim["ports"] = n
        return claim

def free_of(node: dict, claims: list[dict]) -> Free:
    """The free capacity of a ``nodes`` row given the claims of its live attempts (dicts as
    :meth:`Free.take` returns; None for an attempt recorded before claims existed, which
    counts as one slot and one CPU)."""
    info = node.get("info") or {}
    gpus = gpus_of(info)
    cpus = float(info.get("cpus") or node["slots"])
    memory = info.get("memory_bytes") or None
    f = Free(node["name"], node["slots"], cpus, memory,
             {i: g["name"] for i, g in gpus.items()}, set(), (cpus, memory, len(gpus)),
             [g["name"] for g in gpus.values()])
    for c in claims:
        c = c or {"cpus": 1}
        f.slots -= 1
        f.cpus -= c.get("cpus", 1)
        if f.memory is not None:
            f.memory -= c.get("memory", 0)
        for i in c.get("gpus") or ():
            f.gpus.pop(i, None)
        if c.get("port"):
            f.ports.update(range(c["port"], c["port"] + (c.get("ports") or 1)))
    return f


def place(need: dict, free: dict[str, Free], exclude: set = frozenset()) -> str | None:
    """The node a task asking ``need`` goes to now (see the rules), or None."""
    fits = [f for n, f in free.items() if n not in exclude and f.fits(need)]
    if not fits:
        return None
    if need.get("gpus"):
        return min(fits, key=lambda f: (len(f.gpus), f.node)).node
    return max(fits, key=lambda f: (f.slots, f.cpus, -len(f.gpus))).node


def place_gang(need: dict, free: dict[str, Free]) -> list[str] | None:
    """N distinct nodes (``need["nodes"]``), rank order, for a multi-node task, or None."""
    chosen: list[str] = []
    for _ in range(need.get("nodes", 1)):
        node = place(need, free, set(chosen))
        if node is None:
            return None
        chosen.append(node)
    return chosen


def _amount(need: dict) -> str:
    parts = []
    if need.get("gpus"):
        kind = f" {need['gpu_type']}" if need.get("gpu_type") else ""
        parts.append(f"{need['gpus']}{kind} GPU{'s' if need['gpus'] != 1 else ''}")
    cpus = need.get("cpus", 1)
    parts.append(f"{cpus:g} CPU{'s' if cpus != 1 else ''}")
    if need.get("memory"):
        parts.append(f"{need['memory'] / 1e9:g} GB of memory")
    return ", ".join(parts)


def describe(f: Free) -> str:
    """``node-3 (8 CPUs, 31.2 GiB, 2 GPUs)``: a node's full capacity, for messages."""
    cpus, memory, gpus = f.total
    mem = f", {memory / 2**30:.1f} GiB" if memory else ""
    return (f"{f.node} ({cpus:g} CPU{'s' if cpus != 1 else ''}{mem}, "
            f"{gpus} GPU{'s' if gpus != 1 else ''})")


def never_fits(need: dict, free: dict[str, Free]) -> str | None:
    """Why no set of this cluster's nodes could ever hold a task asking ``need``, or None
    when one could (the message names the largest node)."""
    able = [f for f in free.values() if f.could_ever(need)]
    nodes = need.get("nodes", 1)
    if len(able) >= nodes:
        return None
    if not free:
        return "the cluster has no node"
    largest = max(free.values(), key=lambda f: (f.total[2], f.total[0], f.total[1] or 0))
    if nodes > 1:
        return (f"each of its {nodes} ranks needs a node of its own with {_amount(need)}; "
                f"{len(able)} of the cluster's {len(free)} nodes could hold one (the largest "
                f"is {describe(largest)})")
    return f"it needs {_amount(need)} and no node has that (the largest is {describe(largest)})"


def shortfall(need: dict, free: dict[str, Free]) -> str:
    """``waiting for 1 GPU``: what a waiting task lacks on the node closest to holding it."""
    if not free:
        return "waiting for a node"
    nodes = need.get("nodes", 1)
    if nodes > 1:
        room = sum(f.fits(need) for f in free.values())
        return f"waiting for {nodes} nodes with {_amount(need)} free ({room} now)"
    best = max(free.values(), key=lambda f: (len(f._gpus(need)), f.slots > 0, f.cpus))
    short = len(best._gpus(need)) - need.get("gpus", 0)
    if short < 0:
        return f"waiting for {-short} GPU{'s' if short != -1 else ''}"
    if best.slots < 1:
        return "waiting for a free slot"
    if best.cpus + EPS < need.get("cpus", 1):
        n = need.get("cpus", 1) - max(best.cpus, 0)
        return f"waiting for {n:g} CPU{'s' if n != 1 else ''}"
    if need.get("memory") and best.memory is not None and best.memory < need["memory"]:
        return f"waiting for {(need['memory'] - best.memory) / 1e9:.1f} GB of memory"
    return "waiting for room"
