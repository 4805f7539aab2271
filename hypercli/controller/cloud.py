"""A controller on a cloud: one small on-demand instance per user and cloud, launched when a
workflow is first handed to it, reused by later ones, removed when idle.

The instance is a one-node cluster of its own, named :func:`name_of` (``ctl-<cloud>-<8 hex
of the user>``), brought up as any cloud cluster is (:func:`hypercli.cluster.up`: its key
pair, firewall, pinned host key, boot document, cost ledger), with these differences:

* its offer is the cheapest **on-demand** one that fits :data:`SHAPE` in the recipe's
  first region (the optimizer, :func:`hypercli.offers.optimizer.choose`, over the catalog of
  that cloud), the next two cheapest after it should that one have no room;
* its identity is the controller's own, never the user's credentials, which stay here:
  on AWS a role (:meth:`hypercli.providers.aws.AWSAPI.controller_identity`: launch,
  describe and terminate only what is tagged for the user's clusters), on GCP a service
  account (:meth:`hypercli.providers.gcp.GCPAPI.controller_identity`: custom roles bound
  on the project, acting only on the instances and disks named for the clusters it drives,
  under IAM conditions, and as their node accounts only, for its replacements), on Azure a user-assigned identity
  (:meth:`hypercli.providers.azure.AzureAPI.controller_identity`: a custom role assigned on
  the resource groups of the clusters it drives only); each reads the recipes' storage;
* its node watcher's idle limit is ``controller_idle_minutes`` (default
  :data:`IDLE_MINUTES`): the controller's service marks the node as used while it drives a
  workflow, and while a workflow that ended there has not been copied to the user's machine
  yet (:func:`hypercli.controller.host.serve`), so the instance removes itself once it has
  had nothing to drive or keep for that long.

It is recorded twice here: as a cluster (its nodes, ledger and tagged resources, so that
``hyper down --controller`` removes it as ``hyper down`` removes a cluster: the instance and
everything made for it, its identity included), and as a controller
(``controllers`` table, ``spec["cloud"]`` naming that cluster) that the rest of
:mod:`hypercli.controller.client` reaches over SSH like a named host.
"""

from __future__ import annotations

import hashlib
from typing import Callable

from hypercli import state as S
from hypercli.errors import UsageError

#: what a controller needs: the driver of a few workflows (a Python process, SSH channels)
SHAPE_CPUS, SHAPE_MEMORY_GIB = 2, 4
IDLE_MINUTES = 30  #: default ``controller_idle_minutes``
CLOUDS = ("aws", "gcp", "azure")  #: clouds whose controller identity is made here
#: the key of a cloud's controller_identity answer → the ``cluster:`` option that makes the
#: instance run as it (an existing identity: nothing else is made for its storage)
IDENTITY_OPTION = {"aws": ("instance_profile", "iam_role"),
                   "gcp": ("service_account", "service_account"),
                   "azure": ("identity", "identity")}
#: the recipe's ``cluster:`` keys the controller's own cluster takes over
KEPT = ("region", "image", "ssh_cidr", "disk_gb")


def name_of(cloud: str) -> str:
    """The controller cluster of this user on ``cloud``: ``ctl-<cloud>-<8 hex>``, the hex
    the SHA-256 of :func:`hypercli.providers.cloud.owner` (a name fit for every cloud's
    resource names)."""
    from hypercli.providers.cloud import owner
    return f"ctl-{cloud}-{hashlib.sha256(owner().encode()).hexdigest()[:8]}"


def offers_for(cloud: str, region: str, catalog=None) -> list:
    """The cheapest three on-demand offers of ``cloud`` in ``region`` with at least
    SHAPE_CPUS vCPUs and SHAPE_MEMORY_GIB GiB, cheapest first.

    Raises:
        NoOffer: the catalog has none there (the message names the nearest).
    """
    from hypercli.offers.catalog import Catalog
    from hypercli.offers.optimizer import Shape, choose
    shape = Shape(cpus=SHAPE_CPUS, memory_gib=SHAPE_MEMORY_GIB, spot=False)
    return choose(shape, catalog or Catalog([cloud]), clouds=[cloud],
                  regions=[region] if region else None, what="the controller")[:3]


def _row(state: S.State, cluster: str) -> dict | None:
    return next((c for c in state.controllers()
                 if (c["spec"].get("cloud") or {}).get("cluster") == cluster), None)


def ensure(state: S.State, cloud: str, options: dict, grants=(), *,
           clusters: dict | None = None, idle_minutes: float = IDLE_MINUTES,
           python: str = "python3",
           log: Callable[[str], None] = lambda s: None) -> dict:
    """This user's controller on ``cloud``: the one up already when its instance runs (its
    role widened to ``grants`` too), else a new one launched (module docstring).

    Args:
        options: the recipe's ``cluster:`` options; ``region`` (its first region), and
            ``image``, ``ssh_cidr``, ``disk_gb`` as for its nodes, are used.
        grants: the recipe's storage (:class:`hypercli.recipe.access.Grant`): read.
        clusters: the clusters it is to drive, name → their ``cluster:`` options (GCP and
            Azure scope its identity by them; kept with those given before).
        idle_minutes: the instance removes itself after driving nothing for this long.
        python: the controller's Python.
    Returns:
        its controller spec: ``{"name": "root@host:port", "host", "port", "user",
        "identity_file", "python", "cloud": {"provider", "cluster", "region", "grants"}}``
        (:func:`hypercli.controller.client.spec_of`'s form, plus ``cloud``), its host key
        pinned for :class:`hypercli.controller.client.Controller`.
    Raises:
        UsageError: a cloud whose controller is not supported here; NoOffer.
        CredentialsError, CloudError: from the cloud (the user's credentials make it).
        InfraError: the instance did not come up.
    """
    from dataclasses import replace as dc_replace

    from hypercli import cluster as C
    from hypercli.providers.cloud import owner
    from hypercli.providers.cloud_provider import CloudProvider, cloud_spec, keys_dir
    from hypercli.recipe import ClusterSpec
    from hypercli.recipe.access import grants_from
    if cloud not in CLOUDS:
        raise UsageError(f"a controller on {cloud} is not supported",
                         f"use provider: {', '.join(CLOUDS)}, or an ssh cluster's "
                         "controller: user@host")
    o = options
    region = o.get("region", "")
    name = name_of(cloud)
    row = _row(state, name)
    c = state.cluster(name)
    grants = tuple(grants)
    clusters = dict(clusters or {})
    if row is not None:
        grants = tuple(dict.fromkeys(grants + tuple(grants_from(
            row["spec"]["cloud"].get("grants") or []))))
        clusters = {**(row["spec"]["cloud"].get("clusters") or {}), **clusters}
    provider = CloudProvider(cloud, options={"region": region})
    cs = dc_replace(cloud_spec(ClusterSpec(name, cloud, 1, {"region": region})),
                    cluster_id=state.cluster_uid(name), grants=grants)
    key, option = IDENTITY_OPTION[cloud]
    profile = provider.api().controller_identity(cs, owner(), clusters)[key]
    live = state.nodes(name, status="up") if c and c["status"] == "up" else []
    if row is not None and row["status"] == "up" and live and \
            provider.probe(live[0]) == "running":
        spec = {**row["spec"], "cloud": {**row["spec"]["cloud"], "clusters": clusters,
                                         "grants": [g.as_dict() for g in grants]}}
        state.put_controller(row["name"], spec)
        log(f"using the controller {name} ({row['name']})")
        return spec
    offers = offers_for(cloud, region)
    log(f"launching the controller {name}: {offers[0].describe()}")
    options = {k: o[k] for k in KEPT if k in o}
    options.update({option: profile}, spot=False, instance_type=offers[0].instance_type,
                   idle_minutes=idle_minutes, replace_preempted=False)
    spec = ClusterSpec(name, cloud, 1, options)
    node = C.up(state, spec, provider=CloudProvider(cloud, options=options), offers=offers)[0]
    addr = node["address"]
    from hypercli.ssh.hostkeys import KnownHosts
    known = KnownHosts(path=S.home() / "known_hosts" / "@controllers")
    pub = (keys_dir(name) / "hosts" / f"{node['name']}.pub").read_text().split()
    known.pin(addr["host"], addr.get("port", 22), " ".join(pub[:2]))
    ctl = {"name": f"{addr.get('user', 'root')}@{addr['host']}:{addr.get('port', 22)}",
           "host": addr["host"], "port": addr.get("port", 22),
           "user": addr.get("user", "root"), "identity_file": addr["identity_file"],
           "python": python,
           "cloud": {"provider": cloud, "cluster": name, "region": region,
                     "clusters": clusters, "grants": [g.as_dict() for g in grants]}}
    if row is not None and row["name"] != ctl["name"]:
        state.put_controller(row["name"], row["spec"], status="down")
    state.put_controller(ctl["name"], ctl)
    return ctl


def handover_data(state: S.State, cluster: str) -> dict:
    """What a controller needs of a cloud cluster beyond a workflow's records
    (:func:`hypercli.controller.client.handover`): ``{"key": its private key, "keys":
    {path under keys/<cluster>/: text} (its key, its nodes' host keys, its places), "owner":
    the owner tag its resources carry, "iam_role": its instance profile or None, "identity":
    its Azure storage identity or None, "service_account": the GCP service account of its
    first node that is up (or its ``service_account`` option) or None}`` (what the
    controller's launches use as they are: it may not make or change an identity; on GCP
    :meth:`hypercli.providers.gcp.GCPAPI.controller_identity` lets it act as the cluster's
    node accounts only)."""
    from hypercli.providers.cloud import owner
    from hypercli.providers.cloud_provider import keys_dir
    top = keys_dir(cluster)
    keys = {str(p.relative_to(top)): p.read_text() for p in sorted(top.rglob("*"))
            if p.is_file() and not p.is_symlink() and not p.name.startswith(".")}
    row = state.cluster(cluster) or {}
    spec = row.get("spec") or {}
    profile = (spec.get("options") or {}).get("iam_role")
    if not profile and row.get("provider") == "aws" and any(
            g.get("scheme") == "s3" for g in spec.get("given") or spec.get("grants") or []):
        from hypercli.providers.aws import role_name
        from hypercli.providers.cloud import CloudSpec
        profile = role_name(CloudSpec(cluster=cluster, cluster_id=state.cluster_uid(cluster)))
    ident = (spec.get("options") or {}).get("identity")
    if not ident and row.get("provider") == "azure" and any(
            g.get("scheme") == "az" for g in spec.get("given") or spec.get("grants") or []):
        import os

        from hypercli.providers.azure import identity_name
        from hypercli.providers.cloud import CloudSpec
        rg = (spec.get("options") or {}).get("resource_group") or f"hyper-{cluster}"
        ident = (f"/subscriptions/{os.environ.get('AZURE_SUBSCRIPTION_ID', '')}/resourceGroups/"
                 f"{rg}/providers/Microsoft.ManagedIdentity/userAssignedIdentities/"
                 + identity_name(CloudSpec(cluster=cluster,
                                           cluster_id=state.cluster_uid(cluster))))
    options = spec.get("options") or {}
    account = options.get("service_account")
    up = state.nodes(cluster, status="up")
    if not account and row.get("provider") == "gcp" and up:
        from hypercli.providers.cloud import CloudSpec
        from hypercli.providers.cloud_provider import make_api
        from hypercli.providers.gcp import account_id
        aid = account_id(CloudSpec(cluster=cluster, cluster_id=state.cluster_uid(cluster)),
                         up[0]["name"])
        account = f"{aid}@{make_api('gcp', options).project}.iam.gserviceaccount.com"
    return {"key": keys.get("id_ed25519", ""), "keys": keys, "owner": owner(),
            "iam_role": profile, "identity": ident, "service_account": account}


def remove(state: S.State, ctl: dict) -> list[str]:
    """Remove a cloud controller's instance and everything tagged for it (as ``hyper down``
    of its cluster: instance, role, instance profile, security group, key pair). Returns a
    line per resource removed. Raises CloudError, CredentialsError."""
    from hypercli import cluster as C
    return C.down(state, ctl["cloud"]["cluster"])


def cost(state: S.State, ctl: dict) -> tuple[float, float] | None:
    """(USD so far, USD per hour now) of a cloud controller's instances (the cost ledger),
    None for a controller that is not a cloud's."""
    if not ctl.get("cloud"):
        return None
    from hypercli.offers.ledger import spent
    return spent(state, ctl["cloud"]["cluster"])
