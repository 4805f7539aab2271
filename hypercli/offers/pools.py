"""Node pools: a cloud cluster as one pool of nodes per resource shape of its experiments,
each grown with its experiments' ready work and shrunk when that work ends.

A pool holds the experiments whose resources resolve to one :class:`~hypercli.offers.
optimizer.Shape` (:func:`plan`), and launches on the optimizer's offers for that shape
(cheapest first, the launch failing over along them; a gang's pool keeps to the region of
its first offer, so its N nodes are in one region). Its size is capped by the largest
``workers:`` of its experiments (else the cluster's ``workers``, else the tasks it could run
at once). Which nodes a pool wants (:func:`wanted`, :func:`idle_nodes`) is decided here from
what the scheduler knows; the provider only launches (``grow``) and terminates
(``release``) the nodes named.

Rules (the decisions of :class:`Pools`, taken in the scheduler's loop after each dispatch):
  * **grow**: a pool launches nodes when its ready experiments have tasks that no free node of
    the pool could hold (and that their own ``workers:`` would let run) — an experiment is
    counted as ready as soon as every task of the experiments it comes after has started,
    so that its nodes boot while their last tasks run — enough for them at
    the tasks one node of its offer holds (:func:`hypercli.offers.estimate.per_node`), up to
    its cap and within ``max_cost`` (:func:`hypercli.offers.ledger.within_budget`); each node
    is launched in a thread of its own and takes tasks as soon as it is up.
  * **shrink**: a node of a pool with no live attempt (of any workflow) while its pool has no
    task waiting for room is terminated after ``pool_idle_minutes`` (the cluster's option;
    default :data:`IDLE_MINUTES`) — at once when every experiment of its pool has ended;
    when the driver is gone, the node watcher's idle limit (the same minutes) does it.
  * a pool whose experiments have all ended and that has no node left is ``done``.
  * a node of a pool that the cloud took back (preemption) ends its ledger row; the tasks it
    ran wait again, so its pool grows again: the replacement is in that pool only.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time

from hypercli.errors import HyperError, InfraError
from hypercli.offers.catalog import CLOUDS, Catalog
from hypercli.offers.estimate import per_node
from hypercli.offers.offer import Offer
from hypercli.offers.optimizer import FAILOVER_OFFERS, Shape, choose, shape_of, where_of

#: minutes a pool's node may stay idle before it is terminated, when the recipe says none:
#: long enough to carry a node from one stage to the next of the same shape (hypercli's
#: choice, well under the node watcher's 30 min default for a cluster without pools)
IDLE_MINUTES = 3.0
GROW_RETRY = 30.0  #: s after a launch of a pool that got no node before it launches again
#: launches in a row that got no node before the pool stops growing and the run says why
GROW_TRIES = 3


def wants_pools(recipe, state=None) -> bool:
    """Whether ``hyper run`` runs this recipe's cluster as pools: a cloud cluster that names
    no ``instance_type``, whose experiments say what they need, with ``pools: true`` or with
    more than one resource shape among its experiments (``pools: false``: one cluster on the
    first offer, as before pools). A cluster that is up without pools (``hyper up``) stays
    so until it is taken down."""
    spec = recipe.cluster
    o = spec.options
    if spec.provider not in CLOUDS or o.get("instance_type") or o.get("pools") is False:
        return False
    row = state.cluster(spec.name) if state is not None else None
    if row and row.get("status") == "up" and not (row.get("spec") or {}).get("pools"):
        return False
    needs = [e.resources.as_dict() for e in recipe.experiments.values()]
    if not any(any(r.get(k) for k in ("gpus", "instance_type", "memory"))
               or (r.get("cpus") or 1) != 1 for r in needs):
        return False
    shapes = {shape_of(r, o) for r in needs}
    return bool(o.get("pools")) or len(shapes) > 1


@dataclasses.dataclass(frozen=True)
class PoolSpec:
    """One pool of a recipe's cluster.

    Attributes:
        name: ``p1``, ``p2``... in the order of the recipe's experiments.
        shape: what each node holds; experiments: names of the experiments it runs.
        offers: where it launches, in failover order (``offers[0]``: the optimizer's choice).
        cap: most nodes at once; idle_s: s a node may stay idle before it is terminated.
    """

    name: str
    shape: Shape
    experiments: tuple[str, ...]
    offers: tuple[Offer, ...]
    cap: int
    idle_s: float

    def row(self) -> dict:
        """The values :meth:`hypercli.state.State.put_pool` records."""
        return {"shape": dataclasses.asdict(self.shape),
                "offer": {**self.offers[0]._asdict(),
                          "failover": [o._asdict() for o in self.offers]},
                "experiments": list(self.experiments), "cap": self.cap, "idle_s": self.idle_s}


def plan(recipe, tasks: dict[str, int] | None = None,
         catalog: Catalog | None = None) -> list[PoolSpec]:
    """The pools of a recipe's cloud cluster (module docstring).

    Args:
        recipe: a :class:`~hypercli.recipe.Recipe` on aws, gcp or azure.
        tasks: experiment → its number of tasks (caps a pool with no ``workers:``).
        catalog: the catalog (default: the provider's cloud's).
    Raises:
        NoOffer: a shape no offer satisfies (exit 2, naming the pool, its experiments and
            the nearest offers). UsageError: ``cluster.clouds`` leaves out the provider.
    """
    spec = recipe.cluster
    o = spec.options
    provider = spec.provider
    where = where_of(o, provider)
    if provider not in where["clouds"]:
        from hypercli.errors import UsageError
        raise UsageError(f"cluster.clouds ({', '.join(where['clouds'])}) does not include "
                         f"the provider {provider}", f"add {provider} to cluster.clouds")
    where["clouds"] = [provider]
    if catalog is None:
        catalog = Catalog([provider])
        if provider == "gcp":  # machine types without attached GPUs (as with_first_offer)
            table = catalog.tables["gcp"]
            table.types = {k: v for k, v in table.types.items() if "/" not in k}
    groups: dict[Shape, list[str]] = {}
    for name, e in recipe.experiments.items():
        groups.setdefault(shape_of(e.resources.as_dict(), o), []).append(name)
    idle = float(o.get("pool_idle_minutes", IDLE_MINUTES)) * 60
    out = []
    for i, (shape, names) in enumerate(groups.items(), 1):
        name = f"p{i}"
        offers = choose(shape, catalog, what=f"pool {name} ({', '.join(names)})",
                        limit=FAILOVER_OFFERS, **where)
        if shape.nodes > 1:  # a gang's nodes in one region
            offers = [x for x in offers if (x.cloud, x.region) ==
                      (offers[0].cloud, offers[0].region)]
        caps = [recipe.experiments[n].workers for n in names if recipe.experiments[n].workers]
        if caps:
            cap = max(caps) * shape.nodes
        elif spec.workers:
            cap = spec.workers
        else:
            cap = max(1, sum((tasks or {}).get(n, 1) for n in names)) * shape.nodes
        out.append(PoolSpec(name, shape, tuple(names), tuple(offers),
                            max(cap, shape.nodes), idle))
    return out


def record(state, recipe, pools: list[PoolSpec]) -> list[dict]:
    """Record a pooled cluster and its pools in the state file (no node is launched: pools
    grow when a run has work for them); returns the cluster's nodes that are up."""
    spec = recipe.cluster
    row = state.cluster(spec.name)
    old = (row or {}).get("spec") or {}
    keep = {k: old[k] for k in ("grants", "given") if k in old and row["status"] == "up"}
    state.put_cluster(spec.name, spec.provider,
                      {"workers": spec.workers, "options": spec.options, "pools": True,
                       **keep}, "up")
    for p in pools:
        state.put_pool(spec.name, p.name, **p.row())
    return state.nodes(spec.name, status="up")


def pool_rows(state, cluster: str) -> list[dict]:
    """What ``hyper status`` shows of a cluster's pools: ``{"pool", "experiments", "shape"
    (text), "offer" (the optimizer's choice, a dict of :class:`Offer`), "size" (nodes up),
    "target", "cap", "status", "why"}`` each; [] for a cluster without pools."""
    up: dict[str, int] = {}
    for n in state.nodes(cluster, status="up"):
        up[n.get("pool")] = up.get(n.get("pool"), 0) + 1
    out = []
    for r in state.pools(cluster):
        offer = {k: v for k, v in r["offer"].items() if k != "failover"}
        out.append({"pool": r["name"], "experiments": r["experiments"],
                    "shape": Shape(**r["shape"]).describe(), "offer": offer,
                    "size": up.get(r["name"], 0), "target": r["target"], "cap": r["cap"],
                    "status": r["status"], "why": r["why"]})
    return out


def offers_of(row: dict) -> list[Offer]:
    """The failover list of a ``pools`` row as :class:`Offer` values."""
    return [Offer(**{**d, "extra": tuple(tuple(p) for p in d.get("extra") or ())})
            for d in (row["offer"].get("failover") or [row["offer"]])]


def wanted(waiting: int, holds: int, size: int, launching: int, cap: int) -> int:
    """How many nodes a pool launches now.

    Args:
        waiting: tasks of its ready experiments that no free node could hold (and that
            their ``workers:`` would let start), counted in nodes for a gang's ranks.
        holds: tasks one node of its offer holds at once (>= 1).
        size: its nodes up; launching: its nodes being launched; cap: most nodes.
    Returns:
        0 or more: enough for the waiting tasks beyond what the launches under way will
        hold, within the cap.
    """
    need = math.ceil(waiting / max(1, holds)) - launching
    return max(0, min(need, cap - size - launching))


def idle_nodes(idle_since: dict[str, float], now: float, limit: float) -> list[str]:
    """The nodes idle for ``limit`` s or more (``idle_since``: node → monotonic s it was
    last seen with work, or joined), by name."""
    return sorted(n for n, t in idle_since.items() if now - t >= limit)


class Pools:
    """The pools of one run's cluster, grown and shrunk from the scheduler's loop (module
    docstring). Made by :func:`for_run`.

    Args:
        state: the state file; cluster: its name; provider: the cluster's CloudProvider
            (``grow``, ``release``); rows: the ``pools`` rows; events: the scheduler's
            queue, which gets ``("joined", pool, rows)`` when a launch ends.
    """

    def __init__(self, state, cluster: str, provider, rows: list[dict], events):
        self.state, self.cluster, self.provider, self.events = state, cluster, provider, events
        self.rows = {r["name"]: r for r in rows}
        self.of_exp = {e: r["name"] for r in rows for e in r["experiments"]}
        self.shape = {r["name"]: Shape(**r["shape"]) for r in rows}
        self.offers = {r["name"]: offers_of(r) for r in rows}
        self.launching: dict[str, int] = {r["name"]: 0 for r in rows}
        self.failed: dict[str, str] = {}  # pool → why its last launch got no node
        self.tries: dict[str, int] = {}  # pool → launches in a row that got no node
        self.retry_at: dict[str, float] = {}  # pool → monotonic s it may launch again
        self.idle_since: dict[str, float] = {}
        self.shown: dict[str, tuple] = {}  # pool → (target, status, why) last recorded
        self.threads: list[threading.Thread] = []
        self.seq = 0
        c = state.cluster(cluster) or {}
        self.spec_row = c

    # -- what the scheduler asks ----------------------------------------------------------
    def usable(self, experiment: str, free: dict, nodes: dict) -> dict:
        """The nodes of ``free`` an experiment's tasks may go to: those of its pool (nodes
        without a pool: any)."""
        pool = self.of_exp.get(experiment)
        if pool is None:
            return free
        return {n: f for n, f in free.items() if nodes[n].get("pool") in (None, pool)}

    def busy(self) -> bool:
        """Whether a pool is being launched, or will launch again after a launch that got
        no node (the run waits for it rather than ending)."""
        return any(self.launching.values()) or any(
            0 < n < GROW_TRIES for n in self.tries.values())

    def check(self, sched) -> None:
        """Nothing runs or is launched: raise for a pool that has waiting work and could not
        grow. Raises InfraError naming the pool and why."""
        for pool, why in self.failed.items():
            if self._waiting(sched, pool) and (self.tries.get(pool, 0) >= GROW_TRIES or
                                               "max_cost" in why):
                raise InfraError(f"pool {pool} of cluster {self.cluster} "
                                 f"({', '.join(self.rows[pool]['experiments'])}) cannot grow: "
                                 f"{why}", "`hyper status` shows the pools; `hyper run` "
                                 "again resumes")

    # -- decisions ------------------------------------------------------------------------
    def _waiting(self, sched, pool: str) -> int:
        """Ranks of tasks of the pool's ready experiments that wait for room."""
        n = 0
        for exp in self.rows[pool]["experiments"]:
            if exp not in sched.queue or not sched.queue[exp]:
                continue
            st = sched._exp_state(exp)
            if st != "ready" and not (st == "blocked" and self._next(sched, exp)):
                continue
            q = len(sched.queue[exp])
            cap = sched.exps[exp]["workers"]
            if cap:
                running = len({a["task"] for a in sched.live.values()
                               if sched.tasks[a["task"]]["experiment"] == exp})
                q = min(q, max(0, cap - running))
            n += q * max(1, self.shape[pool].nodes)
        return n

    @staticmethod
    def _next(sched, exp: str) -> bool:
        """Whether ``exp`` is next: every experiment it comes after is ready and has all its
        tasks started (none pending), so its nodes boot while their last tasks run."""
        for dep in sched.exps[exp]["after"]:
            if sched._exp_state(dep) != "ready" or sched.count[dep].get("pending"):
                return False
        return True

    def _ended(self, sched, pool: str) -> bool:
        """Every task of the pool's experiments (of this run) has ended."""
        from hypercli.state import TERMINAL_TASK
        return all(all(s in TERMINAL_TASK for s, k in sched.count.get(e, {}).items() if k)
                   for e in self.rows[pool]["experiments"])

    def tick(self, sched) -> None:
        """One round of decisions after the scheduler's dispatch (module docstring)."""
        now = time.monotonic()
        busy_nodes = {a["node"] for a in sched.live.values()}
        busy_nodes |= {c["node"] for c in self.state.claims(sched.up)}
        for pool in self.rows:
            members = [n for n in sched.up if sched.nodes[n].get("pool") == pool]
            waiting = self._waiting(sched, pool)
            ended = self._ended(sched, pool)
            status, why = "steady", None
            for n in members:
                if n in busy_nodes or waiting:
                    self.idle_since[n] = now
                else:
                    self.idle_since.setdefault(n, now)
            limit = 0.0 if ended else self.rows[pool]["idle_s"]
            idle = idle_nodes({n: self.idle_since[n] for n in members
                               if n not in busy_nodes and not waiting}, now, limit)
            if idle:
                self._shrink(sched, pool, idle, "its experiments have ended" if ended else
                             f"idle for {limit:g} s")
                members = [n for n in members if n not in idle]
            if any(n not in busy_nodes for n in members) and not waiting and members:
                status, why = "shrinking", ("its experiments have ended" if ended else
                                            "nodes idle: no task waits for this pool")
            more = wanted(waiting, per_node(self.offers[pool][0], self.shape[pool]),
                          len(members), self.launching[pool], self.rows[pool]["cap"])
            if more and (now < self.retry_at.get(pool, 0) or
                         self.tries.get(pool, 0) >= GROW_TRIES):
                more = 0  # after a launch that got no node: later, or not at all
            if more:
                more = self._within_budget(pool, more)
            if more:
                self._grow(sched, pool, more)
            if self.launching[pool]:
                status = "growing"
                why = f"{waiting} task{'s' if waiting != 1 else ''} wait for room"
            elif waiting and pool in self.failed:
                status, why = "held", self.failed[pool]
            target = len(members) + self.launching[pool]
            if ended and not members and not self.launching[pool]:
                status, why = "done", "its experiments have ended"
            self._show(pool, target, status, why)

    def _within_budget(self, pool: str, n: int) -> int:
        max_cost = (self.spec_row.get("spec") or {}).get("options", {}).get("max_cost")
        if max_cost is None:
            return n
        from hypercli.offers.ledger import within_budget
        names = [f"{pool}-new-{i}" for i in range(n)]
        ok, over = within_budget(self.state, self.cluster, max_cost, names,
                                 self.offers[pool][0].price)
        if over:
            why = str(next(iter(over.values())))
            if self.failed.get(pool) != why:
                self.state.event("cluster", f"pool {pool}: {why}", cluster=self.cluster)
            self.failed[pool] = why
        return len(ok)

    def _show(self, pool: str, target: int, status: str, why: str | None) -> None:
        if self.shown.get(pool) != (target, status, why):
            self.shown[pool] = (target, status, why)
            self.state.set_pool(self.cluster, pool, target=target, status=status, why=why)

    # -- actions --------------------------------------------------------------------------
    def _names(self, pool: str, n: int) -> list[str]:
        """New node names of the pool, never one the cluster had (``<cluster>-<pool>-<i>``)."""
        from hypercli.providers.cloud_provider import keys_dir
        hosts = keys_dir(self.cluster) / "hosts"
        used = {r["name"] for r in self.state.nodes(self.cluster)} | (
            {p.stem for p in hosts.glob("*.pub")} if hosts.exists() else set())
        out = []
        while len(out) < n:
            name = f"{self.cluster}-{pool}-{self.seq}"
            self.seq += 1
            if name not in used:
                out.append(name)
        return out

    def _grow(self, sched, pool: str, n: int) -> None:
        """Launch ``n`` nodes of the pool, each in a thread of its own."""
        from hypercli.recipe import ClusterSpec
        c = self.spec_row
        spec = ClusterSpec(self.cluster, c["provider"], (c.get("spec") or {}).get("workers"),
                           (c.get("spec") or {}).get("options") or {})
        offers = self.offers[pool]
        idle = self.rows[pool]["idle_s"] / 60
        names = self._names(pool, n)
        self.launching[pool] += n
        self.state.event("cluster", f"pool {pool}: launching {', '.join(names)} on "
                         f"{offers[0].describe()}", cluster=self.cluster, workflow=sched.wid)
        for name in names:
            t = threading.Thread(target=self._launch_one, args=(spec, pool, name, offers, idle),
                                 name=f"grow-{name}", daemon=True)
            self.threads.append(t)
            t.start()

    def _launch_one(self, spec, pool: str, name: str, offers: list, idle: float) -> None:
        from hypercli.state import State
        st = State(self.state.path)
        rows: list = []
        error = None
        try:
            result = self.provider.grow(spec, offers, [name], idle_minutes=idle)
            for inst in result.instances:
                st.put_node(spec.name, inst.name, slots=inst.slots,
                            provider_id=inst.provider_id, address=inst.address,
                            info=inst.extra)
            st.set_node_pool(spec.name, [name], pool)
            rows = [n for n in st.nodes(spec.name, status="up") if n["name"] == name]
            if result.errors:
                error = "; ".join(f"{k}: {v}" for k, v in result.errors.items())
        except HyperError as e:
            error = str(e)
        except Exception as e:  # a bug must not leave the run waiting for this launch
            error = f"{type(e).__name__}: {e}"
        finally:
            if error:
                st.set_node_pool(spec.name, [name], pool)
                st.event("node", f"pool {pool}: {name} not brought up: {error}",
                         cluster=spec.name, node=name)
            st.close()
        self.events.put(("joined", pool, {"rows": rows, "error": error}))

    def joined(self, pool: str, payload: dict) -> list[dict]:
        """A launch of the pool ended (the scheduler's ``joined`` event): the rows of the
        nodes that came up, which join the run."""
        self.launching[pool] = max(0, self.launching[pool] - 1)
        if payload.get("error") and not payload.get("rows"):
            self.failed[pool] = payload["error"]
            self.tries[pool] = self.tries.get(pool, 0) + 1
            self.retry_at[pool] = time.monotonic() + GROW_RETRY
        elif payload.get("rows"):
            self.failed.pop(pool, None)
            self.tries.pop(pool, None)
        for r in payload.get("rows") or []:
            self.idle_since[r["name"]] = time.monotonic()
        return payload.get("rows") or []

    def _shrink(self, sched, pool: str, nodes: list[str], why: str) -> None:
        """Take these idle nodes out of the run and terminate them."""
        rows = [sched.nodes[n] for n in nodes]
        ended = time.time()
        for n in nodes:
            sched.retire(n)
            self.idle_since.pop(n, None)
            self.state.set_node_status(n, "down")
        self.state.ledger_end(self.cluster, nodes, at=ended, reason="idle")
        self.state.event("cluster", f"pool {pool}: terminating {', '.join(nodes)} ({why})",
                         cluster=self.cluster, workflow=sched.wid)

        def run() -> None:
            try:
                self.provider.release(self.cluster, rows)
            except Exception as e:  # said; `hyper down` removes what is left
                from hypercli.state import State
                st = State(self.state.path)
                st.event("cluster", f"pool {pool}: terminating {', '.join(nodes)} failed: {e}",
                         cluster=self.cluster)
                st.close()
        t = threading.Thread(target=run, name=f"shrink-{pool}", daemon=True)
        self.threads.append(t)
        t.start()

    def lost(self, node: dict) -> bool:
        """A node the cloud took back: its ledger row ends (``preempted`` for spot); True
        when it is a pool's (its pool grows again for the work it had)."""
        if node.get("pool") not in self.rows:
            return False
        self.state.ledger_end(self.cluster, [node["name"]],
                              reason="preempted" if (node.get("info") or {}).get("spot")
                              else "gone")
        self.idle_since.pop(node["name"], None)
        return True

    def finish(self, sched) -> None:
        """The run ended: the nodes of pools whose experiments have all ended are
        terminated, and the launches and terminations under way are waited for."""
        self.tick(sched)
        for t in list(self.threads):
            t.join(timeout=120)


def for_run(state, workflow: dict, provider, events) -> Pools | None:
    """The :class:`Pools` of a workflow's cluster, or None when it has no pools."""
    row = state.cluster(workflow["cluster"])
    if not row or not (row.get("spec") or {}).get("pools") or not hasattr(provider, "grow"):
        return None
    rows = state.pools(workflow["cluster"])
    if not rows:
        return None
    return Pools(state, workflow["cluster"], provider, rows, events)
