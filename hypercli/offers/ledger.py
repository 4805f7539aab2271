"""The cost ledger: what the cloud nodes cost, from the lifetime and price of each one.

Every cloud instance a launch makes is recorded in the state file (``ledger`` table,
:meth:`hypercli.state.State.ledger_launch`) with the offer it was launched on (cloud, region,
zone, instance type, spot) and its price per node-hour; its end is recorded once, when the
cluster is taken down, when the cloud took it back (preemption), when ``up`` finds it gone, or
when ``hyper gc`` removed it — never overwritten by a later command. A node still running
counts up to now.

:func:`costs` adds the ledger up per cluster, workflow and experiment, for AWS, GCP and Azure
alike: a node's cost is price × hours (per-second billing: AWS, GCP and Azure bill Linux VMs
by the second, AWS and GCP with a one-minute minimum, which is not modelled); a node used by
several workflows is split among them by their tasks' time on it (and a workflow's share among
its experiments the same way); time no task used is the cluster's ``idle``.

:func:`within_budget` is the recipe's ``max_cost``: no new node is launched when the cluster's
ledger (since it was last forgotten) plus the next hour of its running nodes and of the new
node would pass it; nothing running is stopped for it.
"""

from __future__ import annotations

import time

from hypercli.errors import UsageError
from hypercli.offers.failover import PREEMPTED_LAST


class BudgetError(UsageError):
    """``max_cost`` of the recipe would be passed by launching a node (exit 2): the node is
    not launched; nothing running is stopped."""


def node_cost(row: dict, now: float | None = None) -> tuple[float, float]:
    """(hours, USD) of one ledger row up to its end, or up to ``now`` (unix s) while it runs;
    USD 0.0 when its price is not known."""
    end = row["ended_at"] if row.get("ended_at") is not None else (now or time.time())
    hours = max(0.0, end - row["launched_at"]) / 3600.0
    return hours, hours * (row.get("price") or 0.0)


def spent(state, cluster: str, now: float | None = None) -> tuple[float, float]:
    """(USD spent so far, USD per hour of the nodes running now) of a cluster's ledger since
    the cluster was last forgotten (:meth:`hypercli.state.State.cluster_since`)."""
    since = state.cluster_since(cluster)
    rows = [r for r in state.ledger(cluster) if r["launched_at"] >= since
            or r["ended_at"] is None]  # a node still running counts whenever it started
    total = sum(node_cost(r, now)[1] for r in rows)
    hourly = sum(r.get("price") or 0.0 for r in rows if r.get("ended_at") is None)
    return total, hourly


def within_budget(state, cluster: str, max_cost: float | None, nodes: list[str],
                  price: float) -> tuple[list[str], dict[str, BudgetError]]:
    """The nodes of ``nodes`` that may be launched under ``max_cost`` (module docstring).

    Args:
        max_cost: the recipe's ``max_cost`` in USD, or None (no limit).
        nodes: names of the nodes to launch, in order; price: USD per node-hour of the offer
            they would be launched on (0.0 when not known: only the ledger is counted).
    Returns:
        (the nodes to launch, {node: BudgetError} for the others).
    """
    if max_cost is None:
        return list(nodes), {}
    total, hourly = spent(state, cluster)
    ok: list[str] = []
    over: dict[str, BudgetError] = {}
    for node in nodes:
        would = total + hourly + price * (len(ok) + 1)
        if would > max_cost:
            over[node] = BudgetError(
                f"max_cost ${max_cost:.2f} of cluster {cluster}: ${total:.2f} spent + "
                f"${hourly + price * len(ok):.2f} for the next hour of the running nodes "
                f"+ ${price:.2f} for {node} would pass it; {node} is not launched "
                "(nothing running is stopped)",
                "raise max_cost in the recipe; `hyper cost` shows what was spent")
        else:
            ok.append(node)
    return ok, over


def preempted_regions(state, now: float | None = None) -> set[tuple[str, str]]:
    """(cloud, region) of every ledger node preempted in the last
    :data:`~hypercli.offers.failover.PREEMPTED_LAST` s (they go last in a launch)."""
    now = now or time.time()
    return {(r["cloud"], r["region"]) for r in state.ledger()
            if r.get("end_reason") == "preempted" and r.get("ended_at")
            and r["ended_at"] >= now - PREEMPTED_LAST}


def _overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def costs(state, ref: str | None = None, now: float | None = None) -> dict:
    """The ledger added up (module docstring).

    Args:
        ref: a cluster name, a workflow (id or name: its latest run), or None for all.
        now: unix s that running nodes count up to (default: now).
    Returns:
        ``{"total": USD, "clusters": [{"cluster", "cost", "node_hours", "nodes", "running",
        "idle", "unpriced"}], "pools": [{"cluster", "pool", "cost", "node_hours", "nodes",
        "running"}] (nodes of node pools only), "workflows": [{"workflow", "cluster",
        "cost", "experiments": {name: USD}}], "nodes": [{"cluster", "node", "cloud",
        "region", "zone", "instance_type", "spot", "price", "launched_at", "ended_at",
        "hours", "cost", "pool"}]}``,
        USD rounded to the cent's hundredth; ``unpriced``: nodes whose price is not known.
    Raises:
        UsageError: ``ref`` names neither a cluster nor a workflow.
    """
    now = now or time.time()
    only_wf = None
    if ref is None:
        rows = state.ledger()
    elif state.cluster(ref) is not None or state.ledger(ref):
        rows = state.ledger(ref)
    else:
        try:
            wf = state.workflow(ref)
        except UsageError:
            raise UsageError(f"no cluster or workflow named {ref!r}",
                             "`hyper status` lists clusters, `hyper ps` workflows") from None
        only_wf = wf["id"]
        rows = state.ledger(wf["cluster"])
    work: dict[str, list] = {}
    for a in state.node_work({r["node"] for r in rows}):
        work.setdefault(a["node"], []).append(a)
    clusters: dict[str, dict] = {}
    pools: dict[tuple, dict] = {}
    workflows: dict[str, dict] = {}
    nodes = []
    for r in rows:
        hours, cost = node_cost(r, now)
        end = r["ended_at"] if r["ended_at"] is not None else now
        nodes.append({**{k: r[k] for k in ("cluster", "node", "cloud", "region", "zone",
                                           "instance_type", "price", "launched_at",
                                           "ended_at")},
                      "spot": bool(r["spot"]), "hours": round(hours, 4),
                      "cost": round(cost, 4), "pool": r.get("pool")})
        if r.get("pool"):  # a node pool's (hypercli.offers.pools)
            p = pools.setdefault((r["cluster"], r["pool"]), {
                "cluster": r["cluster"], "pool": r["pool"], "cost": 0.0, "node_hours": 0.0,
                "nodes": 0, "running": 0})
            p["cost"] += cost
            p["node_hours"] += hours
            p["nodes"] += 1
            p["running"] += r["ended_at"] is None
        c = clusters.setdefault(r["cluster"], {"cluster": r["cluster"], "cost": 0.0,
                                               "node_hours": 0.0, "nodes": 0, "running": 0,
                                               "idle": 0.0, "unpriced": 0})
        c["cost"] += cost
        c["node_hours"] += hours
        c["nodes"] += 1
        c["running"] += r["ended_at"] is None
        c["unpriced"] += r.get("price") is None
        used: dict[tuple[str, str], float] = {}  # (workflow, experiment) → task seconds
        for a in work.get(r["node"], []):
            a_end = a["end"] if a["end"] is not None else (
                now if a["status"] in ("launching", "running") else a["start"])
            secs = _overlap(a["start"], a_end, r["launched_at"], end)
            if secs > 0:
                key = (a["workflow"], a["experiment"])
                used[key] = used.get(key, 0.0) + secs
        busy = sum(used.values())
        if not busy:
            c["idle"] += cost
            continue
        for (wid, exp), secs in used.items():
            share = cost * secs / busy
            w = workflows.setdefault(wid, {"workflow": wid, "cluster": r["cluster"],
                                           "cost": 0.0, "experiments": {}})
            w["cost"] += share
            w["experiments"][exp] = w["experiments"].get(exp, 0.0) + share
    if only_wf is not None:
        workflows = {k: v for k, v in workflows.items() if k == only_wf} or {
            only_wf: {"workflow": only_wf, "cluster": rows[0]["cluster"] if rows else "",
                      "cost": 0.0, "experiments": {}}}
        for c in clusters.values():
            c["idle"] = None  # not this workflow's
    for c in clusters.values():
        c["cost"] = round(c["cost"], 4)
        c["node_hours"] = round(c["node_hours"], 4)
        if c["idle"] is not None:
            c["idle"] = round(c["idle"], 4)
    for w in workflows.values():
        w["cost"] = round(w["cost"], 4)
        w["experiments"] = {k: round(v, 4) for k, v in sorted(w["experiments"].items())}
    total = (sum(w["cost"] for w in workflows.values()) if only_wf is not None
             else sum(c["cost"] for c in clusters.values()))
    for p in pools.values():
        p["cost"], p["node_hours"] = round(p["cost"], 4), round(p["node_hours"], 4)
    return {"total": round(total, 4), "clusters": list(clusters.values()),
            "pools": list(pools.values()),
            "workflows": list(workflows.values()), "nodes": nodes}
