"""Clusters: bring a recipe's nodes up through its provider, record them, and take them down.

``up`` is idempotent: it asks the provider for the cluster's nodes and reconciles the state
file with the answer (new nodes added, vanished ones marked down). ``down`` cancels the attempts
still running on the nodes, asks the provider to remove them and marks everything down.
``grant`` sets a cloud cluster's storage identity when a workflow starts on it: the recipes'
datasets and the own prefix of each workflow that has not ended (:mod:`hypercli.recipe.access`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import time
from typing import Callable

from hypercli.console import plural
from hypercli.errors import HyperError, InfraError, UsageError
from hypercli.providers import get_provider
from hypercli.recipe import ClusterSpec
from hypercli.recipe.access import for_workflows, grants_from, merge
from hypercli.state import State, home
from hypercli.stop import cancel_workflow


def up(state: State, spec: ClusterSpec, provider=None,
       report: Callable[[str], None] = lambda line: None, offers: list | None = None
       ) -> list[dict]:
    """Bring the cluster of ``spec`` up and return its live nodes (``nodes`` rows).

    Args:
        provider: the provider instance to use (default: a new one of ``spec.provider``).
        report: receives one line per target that could not be brought up.
        offers: for a cloud provider, the :class:`~hypercli.offers.offer.Offer` values its
            launch walks along, in order (:mod:`hypercli.offers.failover`; default: the
            recipe's own instance type and zones).
    Raises:
        UsageError: a cluster of that name exists with another provider.
        InfraError: no node at all came up (the message lists every target's error).
    """
    old = state.cluster(spec.name)
    if old and old["status"] == "up" and old["provider"] != spec.provider:
        raise UsageError(f"cluster {spec.name} is up with provider {old['provider']}, "
                         f"not {spec.provider}",
                         f"`hyper down {spec.name}` first, or name another cluster")
    base, spec = with_granted(state, spec, old)
    provider = provider or get_provider(spec.provider, options=spec.options)
    result = provider.launch(spec, offers=offers) if offers else provider.launch(spec)
    instances = result.instances
    for target, err in result.errors.items():
        report(f"{target}: {err}" + (f" ({err.hint})" if getattr(err, "hint", None) else ""))
        state.event("node", f"{target} not brought up: {err}")
    if not instances:
        lines = "; ".join(f"{t}: {e}" for t, e in result.errors.items())
        raise InfraError(f"no node of cluster {spec.name} came up: {lines}",
                         getattr(next(iter(result.errors.values()), None), "hint", None))
    state.put_cluster(spec.name, spec.provider,
                      {"workers": spec.workers, "options": spec.options,
                       "grants": [g.as_dict() for g in base],
                       "given": [g.as_dict() for g in spec.grants]}, "up")
    names = set()
    for inst in instances:
        names.add(inst.name)
        state.put_node(spec.name, inst.name, slots=inst.slots, provider_id=inst.provider_id,
                       address=inst.address, info=inst.extra)
    moved = clouds_of([i for i in instances if (i.extra or {}).get("launched_at")],
                      spec.provider)  # launched now, not found running
    moved.pop(spec.provider, None)
    for cloud, count in moved.items():  # a failover step to another cloud (hyper status)
        state.event("launch", f"changed cloud: {plural(count, 'node')} on {cloud}, not "
                    f"{spec.provider}: its offers had no room", cluster=spec.name)
    gone = [n["name"] for n in state.nodes(spec.name, status="up") if n["name"] not in names]
    for name in gone:
        state.set_node_status(name, "down")
    state.ledger_end(spec.name, gone, reason="gone")
    state.event("cluster", f"up with {plural(len(instances), 'node')} ({spec.provider})")
    return state.nodes(spec.name, status="up")


def clouds_of(nodes: list, provider: str) -> dict[str, int]:
    """cloud → how many of ``nodes`` (``nodes`` rows or Instances) are on it, the
    provider's own first: a cluster whose launch failed over to another cloud has nodes on
    two (:mod:`hypercli.offers.failover`)."""
    out: dict[str, int] = {}
    for n in nodes:
        info = (n.get("info") if isinstance(n, dict) else getattr(n, "extra", None)) or {}
        cloud = info.get("cloud") or provider
        out[cloud] = out.get(cloud, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: (kv[0] != provider, kv[0])))


def count_nodes(nodes: list, provider: str) -> str:
    """``2 aws nodes``, or per cloud: ``1 aws node, 2 gcp nodes``."""
    return ", ".join(plural(k, f"{c} node") for c, k in
                     clouds_of(nodes, provider).items()) or plural(0, f"{provider} node")


def with_granted(state: State, spec: ClusterSpec, row: dict | None
                 ) -> tuple[tuple, ClusterSpec]:
    """What the cluster's nodes may use of object storage now (:mod:`hypercli.recipe.access`):
    ``(base, spec)`` where ``base`` is ``spec``'s grants with those the cluster (its
    ``clusters`` row, or None) was given before, so that a cluster shared by several recipes
    keeps what each one reads, and ``spec``'s grants are ``base`` with read and write on
    ``<storage>/<workflow>/`` of each workflow of the cluster that has not ended."""
    before = grants_from((row.get("spec") or {}).get("grants")) \
        if row and row.get("status") == "up" else ()
    base = merge(tuple(spec.grants) + before)
    return base, dataclasses.replace(
        spec, grants=for_workflows(base, state.live_workflows(spec.name)))


@contextlib.contextmanager
def _grants_lock(name: str):
    """One process at a time changes a cluster's grants (two ``hyper run`` starting on one
    cluster would otherwise each set the identity to what it saw, the later one losing the
    other's workflow)."""
    d = home() / "locks"
    d.mkdir(exist_ok=True, mode=0o700)
    fd = os.open(d / f"cluster-{name}.grants", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def grant(state: State, spec: ClusterSpec, provider) -> None:
    """Set an up cluster's storage identity to what its nodes may use now
    (:func:`with_granted`: ``spec``'s grants, those of earlier recipes on it, and each of its
    live workflows' own prefix), when its provider scopes storage to the cluster (the clouds)
    and that differs from what it was given. Called when a workflow starts or resumes on the
    cluster, after it is recorded: from then on its nodes may write under
    ``<storage>/<workflow>/``, and no longer under the prefixes of workflows that have ended.

    Raises:
        CredentialsError, CloudError: from the provider.
    """
    if not hasattr(provider, "grant"):
        return
    with _grants_lock(spec.name):
        row = state.cluster(spec.name)
        if row is None:
            return
        base, spec = with_granted(state, spec, row)
        given = grants_from((row.get("spec") or {}).get("given",
                                                     (row.get("spec") or {}).get("grants")))
        if set(spec.grants) == set(given):
            return
        provider.grant(spec)
        state.put_cluster(spec.name, row["provider"],
                          dict(row.get("spec") or {}, grants=[g.as_dict() for g in base],
                               given=[g.as_dict() for g in spec.grants]), "up")


def replace(state: State, provider, node: dict) -> list[dict]:
    """Launch what a cluster lacks after ``node`` was preempted or terminated, through the
    provider's ``replacement`` spec, record it, and return the new ``nodes`` rows ([] when
    the provider launches no replacements).

    Raises:
        HyperError: the launch failed (CloudError, CredentialsError, InfraError).
    """
    spec = provider.replacement(node) if hasattr(provider, "replacement") else None
    # the cloud took the node back (the scheduler asks for a replacement only then): its
    # cost ends now, and a spot node's region goes last in launches for a while
    state.ledger_end(node["cluster"], [node["name"]],
                     reason="preempted" if (node.get("info") or {}).get("spot") else "gone")
    if spec is None:
        return []
    before = {n["name"] for n in state.nodes(spec.name)}
    return [n for n in up(state, spec, provider) if n["name"] not in before]


def work_on(state: State, name: str) -> list[dict]:
    """What ``down`` would cancel: the cluster's workflows that have not ended, each
    ``{"workflow", "running", "pending"}`` (numbers of tasks), oldest first."""
    out = []
    for wf in reversed(state.workflows(limit=10000)):
        if wf["cluster"] == name and wf["status"] in ("running", "cancelling"):
            counts: dict = {}
            for c in state.counts(wf["id"]).values():
                for k, v in c.items():
                    counts[k] = counts.get(k, 0) + v
            out.append({"workflow": wf["id"], "running": counts.get("running", 0),
                        "pending": counts.get("pending", 0)})
    return out


def down(state: State, name: str) -> list[str]:
    """Take a cluster down: cancel its running attempts and workflows, remove its nodes.

    Returns:
        one line per removed resource.
    Raises:
        UsageError: no cluster of that name.
    """
    c = state.cluster(name)
    if c is None:
        known = ", ".join(x["name"] for x in state.clusters()) or "none"
        raise UsageError(f"no cluster named {name!r}", f"known clusters: {known}")
    provider = get_provider(c["provider"], options=(c.get("spec") or {}).get("options") or {})
    nodes = state.nodes(name)
    workflows = [wf for wf in state.workflows(limit=10000) if wf["cluster"] == name]
    for wf in workflows:
        if wf["status"] in ("running", "cancelling"):
            try:
                cancel_workflow(state, wf["id"], provider)
            except HyperError as e:  # an unreachable node: say so, take the rest down
                state.event("cluster", f"{name} down: {e}", workflow=wf["id"])
    live_nodes = [n for n in nodes if n["status"] != "down"]
    paths = sorted({p for wf in workflows for p in (wf.get("spec") or {}).get("mounts", {})})
    removed = []
    if paths and hasattr(provider, "unmount"):
        removed += provider.unmount(live_nodes, paths)
    ended = time.time()  # the nodes are not used after this: their cost ends here
    removed += provider.terminate(name, live_nodes)
    for n in nodes:
        state.set_node_status(n["name"], "down")
    state.ledger_end(name, None, at=ended, reason="down")  # every instance it had
    state.set_cluster_status(name, "down")
    state.event("cluster", f"{name} down: removed {len(removed)} resources")
    return removed


def dry_run(spec: ClusterSpec) -> dict:
    """What ``up`` would do for a cloud cluster, with a price estimate (see
    :meth:`hypercli.providers.cloud_provider.CloudProvider.plan`).

    Raises:
        UsageError: not a cloud provider; CredentialsError / CloudError from the cloud.
    """
    from hypercli.providers import CLOUDS
    if spec.provider not in CLOUDS:
        raise UsageError(f"--dry-run is for cloud providers ({', '.join(CLOUDS)}), "
                         f"not {spec.provider}")
    return get_provider(spec.provider, options=spec.options).plan(spec)


def check(providers: tuple[str, ...] = ("aws", "gcp", "azure"),
          options: dict | None = None) -> list[dict]:
    """Which cloud providers are ready: per provider ``{"provider", "ready", "detail",
    "hint"}`` (detail: the account, or what is wrong; hint: how to fix it). Never raises."""
    from hypercli.providers.cloud_provider import make_api
    out = []
    for name in providers:
        try:
            detail = make_api(name, (options or {}).get(name, {})).check()
            out.append({"provider": name, "ready": True, "detail": detail, "hint": None})
        except HyperError as e:
            out.append({"provider": name, "ready": False, "detail": e.message,
                        "hint": e.hint})
    return out


def gc(state: State, provider: str, options: dict, dry_run: bool = False) -> list[str]:
    """Remove every ``hyper:*``-tagged resource of ``provider`` (in the region of
    ``options``) that no cluster of the state file that is up owns, even when the state file
    was deleted. Returns a line per resource (removed, or found when ``dry_run``).

    Raises:
        UsageError: not a cloud provider; CredentialsError / CloudError from the cloud.
    """
    from hypercli.providers import CLOUDS
    from hypercli.providers.cloud_provider import make_api, remove_all
    if provider not in CLOUDS:
        raise UsageError(f"gc is for cloud providers ({', '.join(CLOUDS)}), not {provider}")
    live = {c["name"] for c in state.clusters() if c["status"] == "up"
            and c["provider"] == provider}
    api = make_api(provider, options)
    if dry_run:
        return [str(r) for r in api.resources(None) if r.cluster and r.cluster not in live]
    ended = time.time()
    removed = remove_all(api, None, keep=live)
    gone = [line.split()[1] for line in removed if line.split()[:1] == ["instance"]]
    state.ledger_end_instances(provider, gone, at=ended, reason="gc")
    state.event("cluster", f"gc {provider}: removed {len(removed)} resources")
    return removed


def provider_of(state: State, cluster_name: str):
    """The provider of a recorded cluster, with the options it was brought up with.

    Raises:
        UsageError: no cluster of that name in the state file.
    """
    c = state.cluster(cluster_name)
    if c is None:
        raise UsageError(f"no cluster named {cluster_name!r}", "`hyper status` lists them")
    return get_provider(c["provider"], options=(c.get("spec") or {}).get("options") or {})
