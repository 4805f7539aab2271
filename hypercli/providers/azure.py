"""Azure through azure-mgmt-resource, -network and -compute: the CloudAPI of provider ``azure``.

What a cluster gets, all in one resource group (``resource_group``, default
``hyper-<cluster>``) that hypercli made for it, tagged ``hyper:cluster``, ``hyper:owner`` and
``hyper:cluster-id`` (:func:`~hypercli.providers.cloud.identity_tag`). A ``resource_group``
that exists and is not the cluster's own (made by hypercli for it) is refused, exit 2: ``hyper
up`` would rewrite its tags and ``hyper down`` delete it with everything in it. With
``cluster.adopt_group: true`` it is used as it is: hypercli changes nothing of the group
itself, refuses to overwrite a resource of the names it uses that is not the cluster's, and
``hyper down`` deletes only the resources tagged for the cluster, one by one, never the group:

* a virtual network ``hyper-<cluster>-vnet`` (10.77.0.0/16) with subnet ``nodes``
  (10.77.0.0/20) and a network security group ``hyper-<cluster>-nsg`` with two inbound rules:
  ``ssh``, TCP 22 from ``ssh_cidr`` (priority 1000), and ``cluster``, every protocol and port
  from the subnet to the subnet (priority 1100, after ``ssh``): the cluster's nodes reach each
  other on their private addresses, e.g. the ranks of a multi-node task. Azure's default rules
  stay as they are, so anything else from the Internet meets ``DenyAllInBound``;
* per node a static Standard public IP ``<node>-ip``, a NIC ``<node>-nic`` and a VM ``<node>``,
  each tagged ``hyper:cluster``/``hyper:node``/``hyper:owner``: priority Spot, eviction policy
  Delete and ``max_price`` (-1: up to the on-demand price), or priority Regular; its OS disk of
  ``disk_gb`` GiB and its NIC are deleted with it; custom data is the node's cloud-config
  (:class:`~hypercli.providers.cloud.Boot`: host key, root's key, node watcher); the admin
  user is ``ssh_user`` with the cluster key and no password, or ``hyper`` where Azure refuses
  the name (``root``). Every VM has a system-assigned managed identity of its own with one
  right: the custom role ``self-delete`` (:data:`ROLES`: ``virtualMachines/read`` and
  ``/delete``) assigned on that VM itself, which the node watcher deletes its idle VM with
  (IMDS gives that identity's token when no client id is asked); no node can touch another
  VM, run commands on it, or list a storage account's keys. Where the role cannot be defined
  or assigned, a warning, and the VM is only powered off when idle. Zones are tried in
  ``zones`` order while the answer is a capacity error (``SkuNotAvailable``,
  ``AllocationFailed``, ``ZonalAllocationFailed``, ``Overconstrained*AllocationRequest``); a VM
  whose allocation failed is deleted first (ARM leaves it in state Failed, and its zones
  cannot change).

Storage identity: when the cluster's grants (``spec.grants``: the recipe's ``storage`` and
``mounts``, and its live workflows, :mod:`hypercli.recipe.access`) name
``az://account/container`` paths, :meth:`AzureAPI.identity` makes a user-assigned managed
identity :func:`identity_name` (``hyper-<cluster>-<tag>-storage``) in the cluster's group
(tagged like it) before any VM, and gives it, per grant, the custom role ``blob-reader`` or
``blob-writer`` (:data:`ROLES`: blob data actions only; the built-in Storage Blob Data
Contributor also carries ``containers/delete`` and ``containers/write``, which no ABAC
condition limits) on that container only (scope ``.../storageAccounts/A/blobServices/
default/containers/C``), with an ABAC condition (``conditionVersion`` 2.0) that limits blob
reads, writes and deletes to ``prefix/`` (``@Resource[...blobs:path]``) and listings to that
prefix (``@Request[...blobs:prefix]``) when the grant has a prefix. Custom roles are defined
once per subscription (their names carry its id) and kept: they grant nothing by themselves.
The VMs carry that identity beside their own; its client id goes to the node's
``/etc/environment`` (``AZURE_CLIENT_ID``), where the node's Azure SDK takes it. Role
assignment names are UUIDs derived from scope, principal, role and condition: making them again
is a no-op (409 ``RoleAssignmentExists``), and they tell hypercli's assignments from anyone
else's; the identity's assignments are set to exactly the grants each time (an ended
workflow's prefix is taken away). An identity found under the computed name is used only
when it is tagged for this cluster, has no federated credential and holds no role assignment
hypercli did not make (:class:`~hypercli.providers.cloud.IdentityConflict` otherwise).
Teardown deletes hypercli's role assignments of the VMs' and the identity's principals (they
live outside the group) before the group, and never another's; a group of the cluster's that
holds something hypercli did not make for it is kept (:meth:`AzureAPI.resources`). With ``cluster.identity`` nothing is made or assigned
for storage: the VMs carry that identity as is (it must already be allowed the containers). A
caller refused ``Microsoft.ManagedIdentity/userAssignedIdentities/write``,
``Microsoft.Authorization/roleDefinitions/write`` or ``.../roleAssignments/write`` gets a
:class:`CredentialsError` naming the permission and ``cluster.identity``, before any VM
exists.

Each create and delete waits for its long-running operation (ARM's ``Azure-AsyncOperation``
or ``Location`` polling, through azure-core's pollers).

Preemption: with eviction policy Delete an evicted Spot VM is deleted, so ARM mostly shows it
gone (the node watcher reads the ``Preempt`` scheduled event inside the VM first). A VM being
deleted is ``stopping``; a Spot VM ARM shows deallocating or deallocated is ``preempted``
(hypercli never deallocates: its watchdog powers off, which ARM shows as ``stopped``).

Prices: Azure publishes them through the Retail Prices API (``prices.azure.com``), a public
HTTP API that none of these SDKs wraps, so :meth:`AzureAPI.spot_price` returns nothing.

Credentials: ``DefaultAzureCredential`` (``az login``, a service principal in
``AZURE_CLIENT_ID``/``AZURE_TENANT_ID``/``AZURE_CLIENT_SECRET``, a managed identity) and
``AZURE_SUBSCRIPTION_ID``. Test seam: ``HYPER_AZURE_ENDPOINT`` (an ``https://127.0.0.1:PORT``
stand-in for Resource Manager) with ``HYPER_AZURE_CA_BUNDLE`` (the stand-in's certificate,
passed as azure-core's ``connection_verify``: azure-core's bearer-token policy refuses to send
a token over plain http, so the stand-in speaks TLS like the real endpoint) and
``HYPER_AZURE_TOKEN`` (a fixed bearer token used instead of the credential chain, only
together with ``HYPER_AZURE_ENDPOINT``).
"""

from __future__ import annotations

import base64
import logging
import os
import re
import threading
import time
import uuid
from contextlib import contextmanager
from urllib.parse import quote

from azure.core.credentials import AccessToken
from azure.core.exceptions import (AzureError, ClientAuthenticationError, HttpResponseError,
                                   ResourceNotFoundError)
from azure.core.rest import HttpRequest
from azure.identity import CredentialUnavailableError, DefaultAzureCredential
from azure.mgmt.compute import ComputeManagementClient
from azure.mgmt.compute import models as cm
from azure.mgmt.network import NetworkManagementClient
from azure.mgmt.network import models as nm
try:  # azure-mgmt-resource ≥ 24 moved it into a sub-package
    from azure.mgmt.resource.resources import ResourceManagementClient
    from azure.mgmt.resource.resources.models import ResourceGroup
except ImportError:
    from azure.mgmt.resource import ResourceManagementClient
    from azure.mgmt.resource.resources.models import ResourceGroup

from hypercli.errors import UsageError
from hypercli.providers.cloud import (TAG_CLUSTER, TAG_IMAGE, TAG_NODE, TAG_OWNER, TAG_VARIANT,
                                      VM, Boot, CapacityError, CloudError, CloudSpec,
                                      CredentialsError, IdentityConflict, QuotaError, Resource,
                                      owner)
from hypercli.recipe.access import rights

log = logging.getLogger("hypercli")

CREDENTIALS_HINT = ("run `az login`, or set AZURE_CLIENT_ID, AZURE_TENANT_ID and "
                    "AZURE_CLIENT_SECRET; AZURE_SUBSCRIPTION_ID names the subscription")
AUTH_CODES = {"InvalidAuthenticationToken", "AuthenticationFailed",
              "ExpiredAuthenticationToken", "InvalidAuthenticationTokenTenant"}
#: learn.microsoft.com/troubleshoot/azure/virtual-machines/windows/allocation-failure
CAPACITY_CODES = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed",
                  "OverconstrainedAllocationRequest", "OverconstrainedZonalAllocationRequest"}
AUTH_API, MSI_API, STORAGE_API = "2022-04-01", "2023-01-31", "2023-01-01"
#: what making a cluster's storage identity asks of the caller
IDENTITY_ACTIONS = ("Microsoft.ManagedIdentity/userAssignedIdentities/write",
                    "Microsoft.Authorization/roleAssignments/write",
                    "Microsoft.Authorization/roleDefinitions/write")
IDENTITY_HINT = ("or name an existing user-assigned managed identity that may use the "
                 "containers: cluster.identity: /subscriptions/S/resourceGroups/G/providers/"
                 "Microsoft.ManagedIdentity/userAssignedIdentities/NAME")
#: the blob data actions an ABAC condition limits to a prefix (the roles' data actions)
BLOB = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
TAG_CLUSTER_ID = "hyper:cluster-id"  # the identity tag of the cluster a group was made for
#: the custom roles hypercli defines once per subscription (kept: they grant nothing by
#: themselves): name → (control-plane actions, data actions). ``self-delete``: a VM's own
#: identity on that VM only; ``blob-reader`` / ``blob-writer``: the storage identity on a
#: container, under an ABAC condition, with no container right (the built-in Storage Blob
#: Data Contributor also has ``containers/delete`` and ``containers/write``, which the
#: condition, naming blob data actions only, does not limit)
ROLES = {
    "self-delete": (["Microsoft.Compute/virtualMachines/read",
                     "Microsoft.Compute/virtualMachines/delete"], []),
    # a controller's identity (AzureAPI.controller_identity), on its clusters' groups only
    "controller": (["Microsoft.Compute/virtualMachines/*", "Microsoft.Compute/disks/*",
                    "Microsoft.Network/networkInterfaces/*",
                    "Microsoft.Network/publicIPAddresses/*",
                    "Microsoft.Network/virtualNetworks/read",
                    "Microsoft.Network/virtualNetworks/subnets/read",
                    "Microsoft.Network/virtualNetworks/subnets/join/action",
                    "Microsoft.Network/networkSecurityGroups/read",
                    "Microsoft.Network/networkSecurityGroups/join/action",
                    "Microsoft.ManagedIdentity/userAssignedIdentities/read",
                    "Microsoft.ManagedIdentity/userAssignedIdentities/assign/action",
                    "Microsoft.Resources/subscriptions/resourceGroups/read",
                    "Microsoft.Resources/subscriptions/resourceGroups/resources/read"], []),
    "blob-reader": ([], [f"{BLOB}/read"]),
    "blob-writer": ([], [f"{BLOB}/read", f"{BLOB}/write", f"{BLOB}/add/action",
                         f"{BLOB}/delete"]),
}
#: instance view ``PowerState/<x>`` → VM.state
POWER = {"starting": "pending", "running": "running", "stopping": "stopping",
         "deallocating": "stopping", "stopped": "terminated", "deallocated": "terminated"}
#: admin user names Azure refuses for Linux VMs (learn.microsoft.com/azure/virtual-machines/
#: linux/faq, "username requirements"; the common ones); the admin becomes ``hyper`` then
RESERVED_USERS = {"root", "admin", "administrator", "guest", "owner", "sys", "test", "user",
                  "adm", "backup", "console", "server", "sql", "support", "a", "1", "123"}
#: ARM resource type (lower case) → Resource.kind, in deletion order
KINDS = {"microsoft.compute/virtualmachines": "instance",
         "microsoft.managedidentity/userassignedidentities": "identity",
         "microsoft.network/networkinterfaces": "nic",
         "microsoft.network/publicipaddresses": "public_ip",
         "microsoft.compute/disks": "disk",
         "microsoft.network/networksecuritygroups": "security_group",
         "microsoft.network/virtualnetworks": "network"}
ORDER = list(KINDS.values())
#: ARM resource type → Resource.kind (KINDS with the types' own case)
_TYPES = {"Microsoft.Compute/virtualMachines": "instance",
          "Microsoft.ManagedIdentity/userAssignedIdentities": "identity",
          "Microsoft.Network/networkInterfaces": "nic",
          "Microsoft.Network/publicIPAddresses": "public_ip",
          "Microsoft.Compute/disks": "disk",
          "Microsoft.Network/networkSecurityGroups": "security_group",
          "Microsoft.Network/virtualNetworks": "network"}
VNET_SPACE, SUBNET = "10.77.0.0/16", "10.77.0.0/20"  # the cluster's network and its subnet
SSH_PRIORITY, CLUSTER_PRIORITY = 1000, 1100  # NSG rules: lower numbers are applied first


def _api_version(rtype: str) -> str:
    """An ARM API version for reading a resource of type ``rtype`` by id."""
    return {"Microsoft.Compute/virtualMachines": "2023-03-01",
            "Microsoft.ManagedIdentity/userAssignedIdentities": MSI_API}.get(rtype, "2023-04-01")


def identity_name(spec: CloudSpec) -> str:
    """The name of a cluster's storage identity: ``hyper-<cluster>-<tag>-storage`` made a
    valid managed identity name (``[A-Za-z0-9][A-Za-z0-9_-]{2,127}``)."""
    return re.sub(r"[^A-Za-z0-9_-]", "-", f"hyper-{spec.cluster}")[:110] + \
        f"-{spec.tag}-storage"


def controller_identity_name(spec: CloudSpec) -> str:
    """The name of a controller's identity: ``hyper-<cluster>-<tag>-controller`` (as
    :func:`identity_name`; ``spec.cluster`` is the controller's cluster)."""
    return identity_name(spec)[:-len("-storage")] + "-controller"


def vm_name(text: str) -> str:
    """A valid Azure Linux VM name for ``text`` (``[A-Za-z0-9-]``, at most 64)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", text).strip("-")[:64] or "node"


def prefix_condition(prefix: str) -> str:
    """The ABAC condition (version 2.0) of a blob data role assignment that allows blob
    reads, writes, deletes and moves under ``prefix/`` only, and listings only with a prefix
    under it (learn.microsoft.com/azure/storage/blobs/storage-auth-abac-examples)."""
    p = (prefix.strip("/") + "/").replace("'", "")
    acts = " AND ".join(f"!(ActionMatches{{'{BLOB}/{a}'}})" for a in
                        ("write", "add/action", "delete", "move/action"))
    return (f"((!(ActionMatches{{'{BLOB}/read'}} AND NOT SubOperationMatches{{'Blob.List'}}) "
            f"AND {acts}) OR (@Resource[{BLOB}:path] StringStartsWith '{p}')) AND "
            f"((!(ActionMatches{{'{BLOB}/read'}} AND SubOperationMatches{{'Blob.List'}})) OR "
            f"(@Request[{BLOB}:prefix] StringStartsWith '{p}'))")


def _rules_key(rules) -> list[tuple]:
    """Security rules in a form to compare (what :meth:`AzureAPI.prepare` writes)."""
    return sorted((r.name, (r.protocol or "").lower(), r.direction, r.access, r.priority,
                   r.source_address_prefix, r.source_port_range,
                   r.destination_address_prefix, r.destination_port_range)
                  for r in rules or [])


def error_class(code: str, message: str) -> type[CloudError]:
    """The hypercli error for an ARM error code and message: CapacityError (try another zone),
    QuotaError (``QuotaExceeded``, or ``OperationNotAllowed`` about a quota) or CloudError."""
    if code in CAPACITY_CODES:
        return CapacityError
    if code == "QuotaExceeded" or (code == "OperationNotAllowed" and "quota" in message.lower()):
        return QuotaError
    return CloudError


@contextmanager
def _calls(what: str):
    """Turn azure-core's and azure-identity's errors into hypercli's (``what``: the action,
    for the message). Raises CredentialsError, CapacityError, QuotaError or CloudError."""
    try:
        yield
    except CredentialUnavailableError as e:
        raise CredentialsError(f"no usable Azure credentials ({e.message})",
                               CREDENTIALS_HINT) from None
    except ClientAuthenticationError as e:
        raise CredentialsError(f"Azure refused the credentials ({_text(e)})",
                               CREDENTIALS_HINT) from None
    except HttpResponseError as e:
        code = (e.error.code if e.error else None) or str(e.status_code or "")
        msg = (e.error.message if e.error else None) or e.message or ""
        if code in AUTH_CODES:
            raise CredentialsError(f"Azure refused the credentials ({code}: {msg})",
                                   CREDENTIALS_HINT) from None
        hint = ("the identity needs the role Contributor on the subscription"
                if code == "AuthorizationFailed" else None)
        raise error_class(code, msg)(f"{what}: {code}: {msg}", hint, code=code) from None
    except AzureError as e:  # no answer: connection refused, TLS, timeouts
        raise CloudError(f"{what}: {e}", "check the network and the Azure endpoint") from None


def _text(e: ClientAuthenticationError) -> str:
    if e.error is not None and e.error.code:
        return f"{e.error.code}: {e.error.message}"
    return e.message


class _StaticToken:
    """A TokenCredential handing out one bearer token (``HYPER_AZURE_TOKEN``)."""

    def __init__(self, token: str):
        self.token = token

    def get_token(self, *scopes, **kwargs) -> AccessToken:
        return AccessToken(self.token, int(time.time()) + 3600)


class AzureAPI:
    """Azure Resource Manager in one subscription and region (see the module docstring).

    Args:
        subscription_id: or None for AZURE_SUBSCRIPTION_ID (missing: CredentialsError on the
            first call).
        region: location, e.g. ``eastus``.
        credential: an azure-core TokenCredential (default: DefaultAzureCredential).
        base_url: Resource Manager endpoint (default: HYPER_AZURE_ENDPOINT, else Azure's).
    """

    name = "azure"

    def __init__(self, subscription_id: str | None, region: str, credential=None,
                 base_url: str | None = None):
        self.subscription = subscription_id or os.environ.get("AZURE_SUBSCRIPTION_ID")
        self.region = region
        self.base_url = base_url or os.environ.get("HYPER_AZURE_ENDPOINT") or None
        self.verify = os.environ.get("HYPER_AZURE_CA_BUNDLE") or None
        #: s between polls of a long-running operation when ARM sends no Retry-After
        self.poll = 0.02 if self.base_url else 5.0
        self._credential = credential
        self._local = threading.local()

    # -- plumbing ------------------------------------------------------------------------------
    def _client(self, cls):
        c = getattr(self._local, cls.__name__, None)
        if c is None:
            if not self.subscription:
                raise CredentialsError("no Azure subscription", "set AZURE_SUBSCRIPTION_ID "
                                       "(`az account show --query id -o tsv`)")
            if self._credential is None and self.base_url and os.environ.get(
                    "HYPER_AZURE_TOKEN"):
                self._credential = _StaticToken(os.environ["HYPER_AZURE_TOKEN"])
            if self._credential is None:
                self._credential = DefaultAzureCredential()
            kw = {"base_url": self.base_url} if self.base_url else {}
            if self.verify:
                kw["connection_verify"] = self.verify
            c = cls(self._credential, self.subscription, **kw)
            setattr(self._local, cls.__name__, c)
        return c

    @property
    def rm(self) -> ResourceManagementClient:
        return self._client(ResourceManagementClient)

    @property
    def net(self) -> NetworkManagementClient:
        return self._client(NetworkManagementClient)

    @property
    def compute(self) -> ComputeManagementClient:
        return self._client(ComputeManagementClient)

    @staticmethod
    def _tags(cluster: str, node: str | None = None) -> dict:
        t = {TAG_CLUSTER: cluster, TAG_OWNER: owner()}
        if node:
            t[TAG_NODE] = node
        return t

    def _groups(self, cluster: str | None) -> list:
        """Resource groups hypercli made for clusters: tagged ``hyper:cluster`` (= ``cluster``
        unless None)."""
        flt = f"tagName eq '{TAG_CLUSTER}'"
        if cluster:
            flt += " and tagValue eq '{}'".format(cluster.replace("'", "''"))
        with _calls("listing resource groups"):
            return [g for g in self.rm.resource_groups.list(filter=flt)
                    if (g.tags or {}).get(TAG_CLUSTER)
                    and (cluster is None or g.tags[TAG_CLUSTER] == cluster)]

    def _tagged(self, cluster: str | None) -> list:
        """The subscription's resources tagged ``hyper:cluster`` (= ``cluster`` unless None),
        in any group: how a cluster's resources in an adopted group are found."""
        flt = f"tagName eq '{TAG_CLUSTER}'"
        if cluster:
            flt += " and tagValue eq '{}'".format(cluster.replace("'", "''"))
        with _calls("listing tagged resources"):
            return [r for r in self.rm.resources.list(filter=flt)
                    if (r.tags or {}).get(TAG_CLUSTER)
                    and (cluster is None or r.tags[TAG_CLUSTER] == cluster)]

    def _own_group(self, spec: CloudSpec, rg: str) -> bool:
        """Make the cluster's resource group, or check that the one named is its own (tagged
        for this cluster by hypercli); with ``adopt_group``, use another as it is. Returns
        whether the group is adopted (hypercli changes nothing of it, and ``down`` removes
        only what it made in it).

        Raises:
            UsageError: the group exists and is not the cluster's own, and ``adopt_group`` is
                not set (exit 2): ``hyper up`` would rewrite its tags and ``hyper down``
                delete it with everything in it.
        """
        try:
            with _calls(f"reading resource group {rg}"):
                found = self.rm.resource_groups.get(rg)
        except CloudError as e:
            if e.code not in ("ResourceGroupNotFound", "404"):
                raise
            with _calls(f"creating resource group {rg}"):
                self.rm.resource_groups.create_or_update(rg, ResourceGroup(
                    location=self.region,
                    tags={**self._tags(spec.cluster), TAG_CLUSTER_ID: spec.tag}))
            return False
        tags = found.tags or {}
        if tags.get(TAG_CLUSTER) == spec.cluster and \
                tags.get(TAG_CLUSTER_ID, spec.tag) == spec.tag:
            return False  # made by hypercli for this cluster (an older one tagged no id)
        if spec.adopt_group:
            return True
        raise UsageError(
            f"resource group {rg} exists and hypercli did not make it for cluster "
            f"{spec.cluster}" + (f" (it is cluster {tags[TAG_CLUSTER]}'s)"
                                  if tags.get(TAG_CLUSTER) else ""),
            "name another resource_group (or none: hypercli makes hyper-<cluster>), or set "
            "cluster.adopt_group: true to use it as it is (hypercli then changes nothing of "
            "the group and `hyper down` removes only what hypercli made in it)")

    def _not_theirs(self, spec: CloudSpec, rg: str, rtype: str, name: str) -> None:
        """In an adopted group: refuse to write a resource of that name that exists and is
        not this cluster's (UsageError, exit 2)."""
        rid = (f"/subscriptions/{self.subscription}/resourceGroups/{rg}/providers/"
               f"{rtype}/{name}")
        try:
            with _calls(f"reading {name}"):
                found = self.rm.resources.get_by_id(rid, api_version=_api_version(rtype))
        except CloudError as e:
            if e.code in ("ResourceNotFound", "NotFound", "404"):
                return
            raise
        if (found.tags or {}).get(TAG_CLUSTER) != spec.cluster:
            raise UsageError(f"{name} ({rtype}) exists in resource group {rg} and is not "
                             f"cluster {spec.cluster}'s: hypercli does not overwrite it",
                             "name another cluster, or use a group of its own")

    # -- the contract --------------------------------------------------------------------------
    def check(self) -> str:
        """``subscription S, region R (N hyper resource groups)`` and whether the caller may
        make clusters' storage identities (:meth:`identity_check`). Raises CredentialsError."""
        n = len(self._groups(None))
        return f"subscription {self.subscription}, region {self.region or '?'} " \
               f"({n} hyper resource groups); {self.identity_check()}"

    def identity_check(self) -> str:
        """Whether the caller's actions in the subscription (ARM ``Microsoft.Authorization/
        permissions``: actions minus notActions, with ``*`` wildcards) include
        :data:`IDENTITY_ACTIONS`, as one line for ``hyper check``. Raises CredentialsError."""
        import fnmatch
        try:
            rows = self._arm("GET", f"/subscriptions/{self.subscription}/providers/"
                             "Microsoft.Authorization/permissions?api-version=2022-04-01",
                             "listing the caller's permissions").get("value", [])
        except CloudError as e:
            return f"storage identities: not known ({e})"

        def allowed(action: str) -> bool:
            def hit(patterns):
                return any(fnmatch.fnmatchcase(action.lower(), x.lower()) for x in patterns)
            return any(hit(r.get("actions") or []) and not hit(r.get("notActions") or [])
                       for r in rows)
        missing = [a for a in IDENTITY_ACTIONS if not allowed(a)]
        if not missing:
            return "storage identities: allowed"
        return (f"storage identities: missing {', '.join(missing)}, so recipes with az:// "
                "containers need cluster.identity")

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        """Create or update the group, network security group and virtual network (module
        docstring; the security group's rules are written whole, so a rule added by hand or an
        old caller address goes). Each is written only when it is missing or differs, so a
        caller who may only read and join them (a controller) can launch into the cluster.

        Returns:
            ``{"resource_group": name, "nsg": id, "subnet": id, "adopted": bool}`` and what
            :meth:`identity` returned (made right after the group, before anything else):
            ``"identity"``, the user-assigned identity's id when the VMs carry one, and
            ``"node_env"``.
        Raises:
            UsageError: no region or no ``ssh_cidr``; a ``resource_group`` hypercli did not
                make for this cluster, without ``adopt_group`` (:meth:`_own_group`).
            IdentityConflict: the storage identity's name is taken (:meth:`identity`).
            CredentialsError, CloudError.
        """
        if not self.region:
            raise UsageError("provider azure needs cluster.region", "e.g. region: eastus")
        if not spec.ssh_cidr:
            raise UsageError("the SSH rule needs a source address range",
                             "set cluster.ssh_cidr, e.g. 203.0.113.0/24")
        rg = spec.resource_group or f"hyper-{spec.cluster}"
        tags = self._tags(spec.cluster)
        adopted = self._own_group(spec, rg)
        ident = self.identity(spec)
        if adopted:
            for kind, name in (("networkSecurityGroups", f"hyper-{spec.cluster}-nsg"),
                               ("virtualNetworks", f"hyper-{spec.cluster}-vnet")):
                self._not_theirs(spec, rg, f"Microsoft.Network/{kind}", name)
        rules = [nm.SecurityRule(
                     name="ssh", protocol="Tcp", direction="Inbound", access="Allow",
                     priority=SSH_PRIORITY, source_address_prefix=spec.ssh_cidr,
                     source_port_range="*", destination_address_prefix="*",
                     destination_port_range="22"),
                 nm.SecurityRule(
                     name="cluster", protocol="*", direction="Inbound", access="Allow",
                     priority=CLUSTER_PRIORITY, source_address_prefix=SUBNET,
                     source_port_range="*", destination_address_prefix=SUBNET,
                     destination_port_range="*")]
        name = f"hyper-{spec.cluster}-nsg"
        nsg = self._found(lambda: self.net.network_security_groups.get(rg, name))
        if nsg is None or (nsg.tags or {}) != tags or \
                _rules_key(nsg.security_rules) != _rules_key(rules):
            with _calls("creating the network security group"):
                nsg = self.net.network_security_groups.begin_create_or_update(
                    rg, name, nm.NetworkSecurityGroup(location=self.region, tags=tags,
                                                      security_rules=rules),
                    polling_interval=self.poll).result()
        name = f"hyper-{spec.cluster}-vnet"
        vnet = self._found(lambda: self.net.virtual_networks.get(rg, name))
        if vnet is None or (vnet.tags or {}) != tags or \
                list(vnet.address_space.address_prefixes or []) != [VNET_SPACE] or \
                [(x.name, x.address_prefix) for x in vnet.subnets or []] != [("nodes", SUBNET)]:
            with _calls("creating the virtual network"):
                vnet = self.net.virtual_networks.begin_create_or_update(
                    rg, name, nm.VirtualNetwork(
                        location=self.region, tags=tags,
                        address_space=nm.AddressSpace(address_prefixes=[VNET_SPACE]),
                        subnets=[nm.Subnet(name="nodes", address_prefix=SUBNET)]),
                    polling_interval=self.poll).result()
        return {"resource_group": rg, "nsg": nsg.id, "subnet": vnet.subnets[0].id,
                "adopted": adopted, **ident}

    @staticmethod
    def _found(call):
        """What a get answers, or None when it is not there or cannot be read (the write
        that follows then says why)."""
        try:
            with _calls("reading"):
                return call()
        except CloudError:
            return None

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
        """One public IP, NIC and VM per node name, zones tried in order on capacity errors.

        Returns:
            (VMs created, node → CloudError for nodes that got none; their IP and NIC are
            removed again).
        Raises:
            UsageError: no usable image; CredentialsError.
        """
        image = self._image_reference(self.find_image(spec))
        vms, errors = [], {}
        for node in nodes:
            try:
                vms.append(self._create_one(spec, node, image, boot, prepared))
            except CloudError as e:
                errors[node] = e
        return vms, errors

    def _create_one(self, spec: CloudSpec, node: str, image: dict, boot: Boot,
                    prepared: dict) -> VM:
        """Public IP, NIC and VM of one node, in the first zone of ``spec.zones`` with
        capacity. Raises CapacityError (no zone had room), QuotaError or CloudError, after
        removing what it made."""
        rg, name = prepared["resource_group"], vm_name(node)
        tags = self._tags(spec.cluster, node)
        if prepared.get("adopted"):  # never overwrite what someone else has in the group
            for kind, what in (("Microsoft.Network/publicIPAddresses", f"{name}-ip"),
                               ("Microsoft.Network/networkInterfaces", f"{name}-nic"),
                               ("Microsoft.Compute/virtualMachines", name)):
                self._not_theirs(spec, rg, kind, what)
        try:
            with _calls(f"creating the public IP of {node}"):
                ip = self.net.public_ip_addresses.begin_create_or_update(
                    rg, f"{name}-ip", nm.PublicIPAddress(
                        location=self.region, tags=tags,
                        sku=nm.PublicIPAddressSku(name="Standard"),
                        public_ip_allocation_method="Static"),
                    polling_interval=self.poll).result()
            last: CloudError | None = None
            for zone in list(spec.zones) or [None]:
                # (again) after a failed VM: deleting it took its NIC along (delete option)
                with _calls(f"creating the NIC of {node}"):
                    nic = self.net.network_interfaces.begin_create_or_update(
                        rg, f"{name}-nic", nm.NetworkInterface(
                            location=self.region, tags=tags,
                            network_security_group=nm.NetworkSecurityGroup(id=prepared["nsg"]),
                            ip_configurations=[nm.NetworkInterfaceIPConfiguration(
                                name="ipconfig", subnet=nm.Subnet(id=prepared["subnet"]),
                                public_ip_address=nm.PublicIPAddress(id=ip.id))]),
                        polling_interval=self.poll).result()
                try:
                    with _calls(f"launching {node}" + (f" in zone {zone}" if zone else "")):
                        vm = self.compute.virtual_machines.begin_create_or_update(
                            rg, name, self._vm_body(spec, node, name, tags, image, boot,
                                                    nic.id, zone, prepared.get("identity")),
                            polling_interval=self.poll).result()
                    break
                except CapacityError as e:
                    last = e
                    # a VM whose allocation failed stays (state Failed) and keeps its zones
                    self._quietly(lambda: self.compute.virtual_machines.begin_delete(
                        rg, name, polling_interval=self.poll).result())
            else:
                raise last
        except CloudError:
            for delete, what in ((self.compute.virtual_machines.begin_delete, name),
                                 (self.net.network_interfaces.begin_delete, f"{name}-nic"),
                                 (self.net.public_ip_addresses.begin_delete, f"{name}-ip")):
                self._quietly(lambda: delete(rg, what, polling_interval=self.poll).result())
            raise
        self._allow_self_delete(vm)
        return VM(id=vm.name, node=node, zone=zone or "", state="running",
                  public_ip=ip.ip_address,
                  private_ip=nic.ip_configurations[0].private_ip_address,
                  instance_type=spec.instance_type, spot=spec.spot,
                  extra={"resource_group": rg, "vm_id": vm.vm_id})

    def _vm_body(self, spec: CloudSpec, node: str, name: str, tags: dict, image: dict,
                 boot: Boot, nic_id: str, zone: str | None,
                 identity: str | None = None) -> cm.VirtualMachine:
        """The VM of ``node`` as ARM takes it (module docstring). Azure refuses ``root`` and
        a few other admin names; the admin is then ``hyper`` (the cloud-config authorizes
        the cluster key for root itself). It always has a system-assigned identity of its
        own (the idle watchdog deletes the VM with it, IMDS's token without a client id), and
        the cluster's storage identity when there is one (``AZURE_CLIENT_ID`` on the node)."""
        user = "hyper" if boot.ssh_user.lower() in RESERVED_USERS else boot.ssh_user
        spot = dict(priority="Spot", eviction_policy="Delete",
                    billing_profile=cm.BillingProfile(max_price=spec.max_price or -1)) \
            if spec.spot else dict(priority="Regular")
        return cm.VirtualMachine(
            location=self.region, tags=tags, zones=[zone] if zone else None,
            identity=cm.VirtualMachineIdentity(
                type="SystemAssigned, UserAssigned", user_assigned_identities={
                    identity: cm.UserAssignedIdentitiesValue()})
            if identity else cm.VirtualMachineIdentity(type="SystemAssigned"),
            hardware_profile=cm.HardwareProfile(vm_size=spec.instance_type),
            storage_profile=cm.StorageProfile(
                image_reference=cm.ImageReference(**image),
                os_disk=cm.OSDisk(create_option="FromImage", disk_size_gb=spec.disk_gb,
                                  delete_option="Delete",
                                  managed_disk=cm.ManagedDiskParameters(
                                      storage_account_type="StandardSSD_LRS"))),
            os_profile=cm.OSProfile(
                computer_name=name, admin_username=user,
                custom_data=base64.b64encode(boot.user_data[node].encode()).decode(),
                linux_configuration=cm.LinuxConfiguration(
                    disable_password_authentication=True,
                    ssh=cm.SshConfiguration(public_keys=[cm.SshPublicKey(
                        path=f"/home/{user}/.ssh/authorized_keys",
                        key_data=boot.ssh_public_key)]))),
            network_profile=cm.NetworkProfile(network_interfaces=[
                cm.NetworkInterfaceReference(id=nic_id, primary=True, delete_option="Delete")]),
            **spot)

    # -- storage identity (module docstring) --------------------------------------------------
    def _arm(self, method: str, path: str, what: str, body: dict | None = None) -> dict:
        """One Resource Manager call (``path`` with its ``api-version``). Returns the JSON.

        Raises:
            CredentialsError: refused credentials. CloudError: any other error (``code``:
            ARM's error code, e.g. ``AuthorizationFailed``, ``RoleAssignmentExists``).
        """
        with _calls(what):
            resp = self.rm.send_request(HttpRequest(method, path, json=body))
            if resp.status_code >= 300:
                raise HttpResponseError(response=resp)
            return resp.json() if resp.content else {}

    def _refused(self, e: CloudError, permission: str, what: str) -> None:
        if e.code in ("AuthorizationFailed", "LinkedAuthorizationFailed", "403"):
            raise CredentialsError(
                f"the caller may not {what} (permission {permission} is missing)",
                "give the caller a role with it (e.g. Owner, or User Access Administrator "
                f"and Managed Identity Contributor), {IDENTITY_HINT}") from None

    def _account_ids(self) -> dict[str, str]:
        """Storage account name → ARM id, for the subscription."""
        out, path = {}, (f"/subscriptions/{self.subscription}/providers/Microsoft.Storage/"
                         f"storageAccounts?api-version={STORAGE_API}")
        while path:
            page = self._arm("GET", path, "listing storage accounts")
            out.update({a["name"]: a["id"] for a in page.get("value", [])})
            path = page.get("nextLink")
        return out

    def identity(self, spec: CloudSpec) -> dict:
        """Make or update, idempotently, the cluster's storage identity (module docstring,
        "Storage identity"): the user-assigned identity :func:`identity_name` with a custom
        blob data role on exactly the ``az`` containers of ``spec.grants``, each limited to
        its grant's prefix; the assignments it had beyond them are taken away. The cluster's
        resource group must exist (:meth:`prepare` makes it).

        Returns:
            ``{"identity": ARM id, "node_env": {"AZURE_CLIENT_ID": its client id}}``, or
            ``{}`` (the cluster uses no ``az://`` container).
        Raises:
            CredentialsError: the caller may not create the identity
                (``Microsoft.ManagedIdentity/userAssignedIdentities/write``), define roles
                (``roleDefinitions/write``) or assign them (``roleAssignments/write``); the
                message names the permission and ``cluster.identity``.
            IdentityConflict: an identity of that name exists and is not the cluster's own
                (other tags, or a federated credential: someone else could get its tokens).
            UsageError: a storage account of the recipe is not in the subscription.
            CloudError: other API failures.
        """
        if spec.identity:
            client = self._client_id(spec.identity)
            return {"identity": spec.identity,
                    **({"node_env": {"AZURE_CLIENT_ID": client}} if client else {})}
        if not any(g.scheme == "az" for g in spec.grants):
            return {}
        grants = [g for g in rights(spec.grants) if g.scheme == "az"]
        rg = spec.resource_group or f"hyper-{spec.cluster}"
        rid, made = self._put_identity(spec, rg, identity_name(spec), {})
        principal = made["properties"]["principalId"]
        wanted = []
        if grants:
            roles = self._roles(["blob-reader", "blob-writer"], required=True)
            wanted = [(scope, roles["blob-writer" if g.write else "blob-reader"],
                       prefix_condition(g.prefix) if g.prefix else None)
                      for scope, g in self._container_scopes(grants)]
        self._set_assignments(principal, wanted)
        return {"identity": rid,
                "node_env": {"AZURE_CLIENT_ID": made["properties"]["clientId"]}}

    def controller_identity(self, spec: CloudSpec, owner_tag: str,
                            clusters: dict | None = None) -> dict:
        """Make or update, idempotently, the identity of a controller instance
        (:mod:`hypercli.controller`; ``spec.cluster`` is the controller's cluster, whose
        group is made here if missing): the user-assigned identity
        :func:`controller_identity_name` in that group, with the custom role ``controller``
        (:data:`ROLES`: VMs, their disks, NICs and public IPs, joining the cluster's subnet
        and security group, assigning the cluster's storage identity to a VM; no role
        assignment, no identity write) assigned on the resource group of each cluster it
        drives and of nothing else, and ``blob-reader`` on the ``az`` containers of
        ``spec.grants`` (read only, each limited to its grant's prefix). The groups it was
        given before are kept (a controller keeps its clusters while it lives); ``hyper
        down`` of the controller's cluster deletes the assignments and then the group with
        the identity.

        Args:
            owner_tag: the user's owner tag (on the identity).
            clusters: the clusters it drives, name → their ``cluster:`` options (its group:
                ``resource_group``, default ``hyper-<name>``).
        Returns:
            ``{"identity": ARM id}`` for the VM to carry.
        Raises:
            CredentialsError: the caller may not make the identity, define the roles or
                assign them (the message names the permission). IdentityConflict: an
                identity of that name that is not the controller's own. UsageError: a
                storage account of the recipe is not in the subscription. CloudError.
        """
        rg = spec.resource_group or f"hyper-{spec.cluster}"
        self._own_group(spec, rg)
        rid, made = self._put_identity(spec, rg, controller_identity_name(spec),
                                       {TAG_OWNER: owner_tag})
        principal = made["properties"]["principalId"]
        roles = self._roles(["controller", "blob-reader"], required=True)
        sub = f"/subscriptions/{self.subscription}/resourceGroups/"
        scopes = {f"{sub}{(o or {}).get('resource_group') or f'hyper-{c}'}"
                  for c, o in (clusters or {}).items()}
        scopes |= {(ra.get("properties") or {}).get("scope", "") for ra in self._ours(principal)
                   if (ra.get("properties") or {}).get("roleDefinitionId", "").endswith(
                       "/" + roles["controller"])}
        wanted = [(sc, roles["controller"], None) for sc in sorted(scopes) if sc]
        grants = [g for g in rights(spec.grants) if g.scheme == "az"]
        wanted += [(scope, roles["blob-reader"], prefix_condition(g.prefix) if g.prefix else None)
                   for scope, g in self._container_scopes(grants)]
        self._set_assignments(principal, list(dict.fromkeys(wanted)))
        return {"identity": rid}

    def _put_identity(self, spec: CloudSpec, rg: str, name: str, tags: dict) -> tuple:
        """Make or update the user-assigned identity ``name`` in group ``rg``, tagged as
        cluster ``spec.cluster``'s (plus ``tags``), after refusing one found there that is
        not its own (:meth:`_check_identity`). Returns (its ARM id, the identity as the PUT
        answered). Raises CredentialsError (the permission named), IdentityConflict,
        CloudError."""
        rid = (f"/subscriptions/{self.subscription}/resourceGroups/{rg}/providers/"
               f"Microsoft.ManagedIdentity/userAssignedIdentities/{name}")
        try:
            found = self._arm("GET", f"{rid}?api-version={MSI_API}", f"reading {name}")
        except CloudError as e:
            if e.code not in ("ResourceNotFound", "NotFound", "404"):
                raise
            found = None
        if found is not None:
            self._check_identity(spec, rid, found)
        try:
            made = self._arm("PUT", f"{rid}?api-version={MSI_API}",
                             f"creating the managed identity {name}",
                             {"location": self.region,
                              "tags": {**self._tags(spec.cluster), TAG_CLUSTER_ID: spec.tag,
                                       **tags}})
        except CloudError as e:
            self._refused(e, "Microsoft.ManagedIdentity/userAssignedIdentities/write",
                          f"create the managed identity {name}")
            raise
        return rid, made

    def _container_scopes(self, grants: list) -> list[tuple]:
        """(ARM scope of the blob container, grant) for each ``az`` grant. Raises
        UsageError: a grant's storage account is not in the subscription."""
        accounts = self._account_ids() if grants else {}
        out = []
        for g in grants:
            account, container = g.bucket.split("/", 1)
            if account not in accounts:
                raise UsageError(f"storage account {account} (az://{g.bucket}) not found "
                                 f"in subscription {self.subscription}",
                                 "check the recipe's storage and mounts")
            out.append((f"{accounts[account]}/blobServices/default/containers/{container}", g))
        return out

    def _client_id(self, rid: str) -> str | None:
        """The client id of a user-assigned identity (for the node's SDK), or None with a
        warning when it cannot be read."""
        try:
            return self._arm("GET", f"{rid}?api-version={MSI_API}",
                             f"reading {rid}")["properties"]["clientId"]
        except (CloudError, KeyError) as e:
            log.warning("cannot read the client id of %s (%s): set AZURE_CLIENT_ID on the "
                        "nodes for their storage", rid, e)
            return None

    def _check_identity(self, spec: CloudSpec, rid: str, found: dict) -> None:
        """Refuse an identity found under the computed name unless it is the cluster's own
        as hypercli leaves it. Raises IdentityConflict."""
        tags = found.get("tags") or {}
        why = []
        if tags.get(TAG_CLUSTER) != spec.cluster or tags.get(TAG_CLUSTER_ID) != spec.tag:
            why.append(f"its tags are not those of cluster {spec.cluster}")
        fics = self._arm("GET", f"{rid}/federatedIdentityCredentials?api-version={MSI_API}",
                         f"listing the federated credentials of {rid}").get("value", [])
        if fics:
            why.append("it has federated credentials (others can get its tokens): "
                       + ", ".join(f.get("name", "?") for f in fics))
        principal = (found.get("properties") or {}).get("principalId")
        theirs = [ra for ra in self._assignments(principal) if not self._made_here(ra)] \
            if principal else []
        if theirs:
            held = []
            for ra in theirs:
                p = ra.get("properties") or {}
                role = (p.get("roleDefinitionId") or "?").rsplit("/", 1)[-1]
                held.append(f"role {role} on {p.get('scope')}")
            why.append("it holds role assignments hypercli did not make (every task on the "
                       "nodes would hold them): " + ", ".join(held))
        if why:
            raise IdentityConflict(
                f"a managed identity {rid.rsplit('/', 1)[1]} exists and is not cluster "
                f"{spec.cluster}'s own: " + "; ".join(why),
                "delete it if it is left from an old cluster, or " + IDENTITY_HINT)

    def _roles(self, kinds: list[str], required: bool) -> dict[str, str]:
        """The ids of hypercli's custom roles (:data:`ROLES`), defined in the subscription
        when missing or different (assignable there; each name carries the subscription id,
        since role names are unique in a tenant). Returns kind → role definition GUID; a
        kind that cannot be defined is left out (with a warning), or, when ``required``,
        raises CredentialsError naming ``roleDefinitions/write``."""
        out = {}
        cache = self.__dict__.setdefault("_defined", {})
        for kind in kinds:
            if kind in cache:
                out[kind] = cache[kind]
                continue
            actions, data = ROLES[kind]
            guid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"hypercli|{self.subscription}|{kind}"))
            path = (f"/subscriptions/{self.subscription}/providers/Microsoft.Authorization/"
                    f"roleDefinitions/{guid}?api-version={AUTH_API}")
            want = {"roleName": f"hypercli {kind} ({self.subscription})",
                    "description": f"hypercli: {kind} (a cluster's nodes)",
                    "type": "CustomRole",
                    "permissions": [{"actions": actions, "notActions": [],
                                     "dataActions": data, "notDataActions": []}],
                    "assignableScopes": [f"/subscriptions/{self.subscription}"]}
            try:
                try:
                    have = self._arm("GET", path, f"reading the role {want['roleName']}")
                except CloudError as e:
                    if e.code not in ("RoleDefinitionDoesNotExist", "NotFound", "404"):
                        raise
                    have = {}
                props = have.get("properties") or {}
                if [{k: sorted(v) for k, v in p.items()} for p in props.get(
                        "permissions", [])] != [{k: sorted(v) for k, v in p.items()}
                                                for p in want["permissions"]]:
                    self._arm("PUT", path, f"defining the role {want['roleName']}",
                              {"properties": want})
                out[kind] = cache[kind] = guid
            except CloudError as e:
                if required:
                    self._refused(e, "Microsoft.Authorization/roleDefinitions/write",
                                  f"define the role {want['roleName']}")
                    raise
                log.warning("cannot define the role %s: %s", want["roleName"], e)
        return out

    def _assignment_name(self, scope: str, role: str, principal: str,
                         condition: str | None) -> str:
        """The name of a role assignment hypercli makes: a UUID of its content, so that
        making it again is a no-op and hypercli knows its own among others."""
        return str(uuid.uuid5(uuid.NAMESPACE_URL,
                              "|".join((scope.lower(), principal, role, condition or ""))))

    def _assign(self, scope: str, role: str, principal: str, condition: str | None) -> None:
        """PUT one role assignment (:meth:`_assignment_name`: repeating it is a no-op).
        Raises CredentialsError (``roleAssignments/write`` refused), CloudError."""
        props = {"roleDefinitionId": f"/subscriptions/{self.subscription}/providers/"
                 f"Microsoft.Authorization/roleDefinitions/{role}",
                 "principalId": principal, "principalType": "ServicePrincipal"}
        if condition:
            props.update(condition=condition, conditionVersion="2.0")
        try:
            self._arm("PUT", f"{scope}/providers/Microsoft.Authorization/roleAssignments/"
                      f"{self._assignment_name(scope, role, principal, condition)}"
                      f"?api-version={AUTH_API}", f"assigning a role on {scope}",
                      {"properties": props})
        except CloudError as e:
            if e.code == "RoleAssignmentExists":
                return
            self._refused(e, "Microsoft.Authorization/roleAssignments/write",
                          f"assign roles on {scope}")
            raise

    def _assignments(self, principal: str) -> list[dict]:
        """Every role assignment of ``principal`` at, above or below the subscription (ARM's
        ``principalId eq`` filter), hypercli's and anyone else's."""
        out = []
        path = (f"/subscriptions/{self.subscription}/providers/Microsoft.Authorization/"
                f"roleAssignments?api-version={AUTH_API}&$filter="
                + quote(f"principalId eq '{principal}'"))
        while path:
            page = self._arm("GET", path, f"listing the role assignments of {principal}")
            out += page.get("value", [])
            path = page.get("nextLink")
        return out

    def _made_here(self, ra: dict) -> bool:
        """Whether a role assignment is one hypercli made: its name is the UUID of its
        content (:meth:`_assignment_name`)."""
        p = ra.get("properties") or {}
        role = (p.get("roleDefinitionId") or "").rsplit("/", 1)[-1]
        return ra.get("name") == self._assignment_name(p.get("scope", ""), role,
                                                       p.get("principalId", ""),
                                                       p.get("condition"))

    def _ours(self, principal: str) -> list[dict]:
        """The role assignments of ``principal`` that hypercli made (their names are the
        UUIDs of their content; any other is someone else's and is never touched)."""
        return [ra for ra in self._assignments(principal)
                if (ra.get("properties") or {}).get("principalId") == principal
                and self._made_here(ra)]

    def _set_assignments(self, principal: str, wanted: list[tuple]) -> None:
        """Give ``principal`` exactly the role assignments ``wanted`` ((scope, role,
        condition) each) among those hypercli makes: missing ones added, others of hypercli's
        deleted (an ended workflow's prefix)."""
        names = {self._assignment_name(sc, role, principal, cond): (sc, role, cond)
                 for sc, role, cond in wanted}
        have = self._ours(principal)
        for ra in have:
            if ra["name"] not in names:
                self._unassign_one(ra)
        held = {ra["name"] for ra in have}
        for name, (scope, role, cond) in names.items():
            if name not in held:
                self._assign(scope, role, principal, cond)

    def _unassign_one(self, ra: dict) -> str:
        try:
            self._arm("DELETE", f"{ra['id']}?api-version={AUTH_API}",
                      f"deleting role assignment {ra['name']}")
        except CloudError as e:
            if e.code not in ("RoleAssignmentNotFound", "404"):
                raise
        return ra["id"]

    def _unassign(self, principal: str) -> list[str]:
        """Delete the role assignments hypercli made for ``principal``; returns their ids."""
        return [self._unassign_one(ra) for ra in self._ours(principal)]

    def _allow_self_delete(self, vm) -> None:
        """Give the VM's own (system-assigned) identity the custom role ``self-delete``
        (:data:`ROLES`: read and delete a VM) on that VM only, so that the node watcher can
        delete it when idle and no node can touch another. Best effort: where the role
        cannot be defined or assigned, a warning, and such a VM is only powered off when idle
        (``hyper down``/``hyper gc`` remove it)."""
        principal = getattr(getattr(vm, "identity", None), "principal_id", None)
        if not principal:
            return
        try:
            role = self._roles(["self-delete"], required=False).get("self-delete")
            if role:
                self._assign(vm.id, role, principal, None)
                return
        except (CredentialsError, CloudError) as e:
            log.warning("VM %s cannot delete itself when idle (%s); it will power off "
                        "instead", vm.name, e)
            return
        log.warning("VM %s cannot delete itself when idle; it will power off instead",
                    vm.name)

    @staticmethod
    def _quietly(call) -> None:
        """Run a clean-up call; a failure (or the resource being gone) is only logged."""
        try:
            with _calls("cleaning up"):
                call()
        except CloudError as e:
            log.debug("%s", e)

    def describe(self, cluster: str) -> list[VM]:
        """The cluster's VMs with state (module docstring), zone, addresses. Raises
        CredentialsError, CloudError."""
        out = []
        for g in self._cluster_groups(cluster):
            with _calls(f"listing VMs of {g.name}"):
                ips = {p.id.lower(): p.ip_address
                       for p in self.net.public_ip_addresses.list(g.name)}
                nics = {n.id.lower(): n for n in self.net.network_interfaces.list(g.name)}
                vms = [v for v in self.compute.virtual_machines.list(
                    g.name, expand="instanceView") if (v.tags or {}).get(TAG_CLUSTER) == cluster]
            for vm in vms:
                public = private = None
                for ref in (vm.network_profile.network_interfaces or []
                            if vm.network_profile else []):
                    nic = nics.get((ref.id or "").lower())
                    for c in (nic.ip_configurations or []) if nic else []:
                        private = private or c.private_ip_address
                        if c.public_ip_address and c.public_ip_address.id:
                            public = public or ips.get(c.public_ip_address.id.lower())
                spot = (vm.priority or "") == "Spot"
                out.append(VM(id=vm.name, node=(vm.tags or {}).get(TAG_NODE, vm.name),
                              zone=(vm.zones or [""])[0], state=self._state(vm, spot),
                              public_ip=public, private_ip=private,
                              instance_type=(vm.hardware_profile.vm_size
                                             if vm.hardware_profile else ""),
                              spot=spot, extra={"resource_group": g.name}))
        return out

    @staticmethod
    def _state(vm, spot: bool) -> str:
        """VM.state from ARM's provisioning state and instance view power state."""
        codes = [s.code or "" for s in (vm.instance_view.statuses or []
                                        if vm.instance_view else [])]
        power = next((c.split("/", 1)[1] for c in codes if c.startswith("PowerState/")), None)
        provisioning = (vm.provisioning_state or "").lower()
        if provisioning == "deleting":
            return "stopping"
        if spot and power in ("deallocating", "deallocated"):
            return "preempted"
        if provisioning == "failed" and power in (None, "deallocated", "stopped"):
            return "terminated"
        return POWER.get(power or "starting", "pending")

    def terminate(self, cluster: str, ids: list[str]) -> None:
        """Start deleting the VMs named ``ids`` (no wait; NIC and OS disk go with them)."""
        wanted = set(ids)
        for g in self._cluster_groups(cluster):
            with _calls(f"deleting VMs of {g.name}"):
                for vm in self.compute.virtual_machines.list(g.name):
                    if vm.name in wanted and (vm.tags or {}).get(TAG_CLUSTER) == cluster:
                        self.compute.virtual_machines.begin_delete(
                            g.name, vm.name, polling_interval=self.poll)

    def _cluster_groups(self, cluster: str) -> list:
        """The groups holding the cluster's resources: those hypercli made for it, and the
        adopted ones its tagged resources are in (as ``SimpleNamespace(name)``)."""
        from types import SimpleNamespace
        groups = {g.name.lower(): g for g in self._groups(cluster)}
        for r in self._tagged(cluster):
            g = r.id.split("/")[4]
            groups.setdefault(g.lower(), SimpleNamespace(name=g, location=r.location))
        return list(groups.values())

    def resources(self, cluster: str | None = None) -> list[Resource]:
        """What the cluster (every hyper cluster when None) holds, ARM ids, instances first:
        everything in the groups hypercli made for it, each group last (it takes the rest
        along); in an adopted group only the resources tagged for it, and never the group.
        A group hypercli made that also holds something it did not make for that cluster
        (:meth:`_made_for`: someone's storage account put there, another cluster's
        resources in a group it adopted) is not listed, nor is that something: only the
        cluster's own resources in it, deleted one by one (with a warning that the group
        stays)."""
        out, owned = [], set()
        for g in self._groups(cluster):
            c = g.tags[TAG_CLUSTER]
            owned.add(g.name.lower())
            with _calls(f"listing {g.name}"):
                found = [r for r in self.rm.resources.list_by_resource_group(g.name)
                         if (r.type or "").count("/") == 1]  # children go with their parent
            theirs = [r for r in found if not self._made_for(r, c)]
            inner = [Resource(KINDS.get((r.type or "").lower(),
                                        (r.type or "").rsplit("/", 1)[-1]),
                              r.id, c, r.location or g.location or "")
                     for r in found if r not in theirs]
            inner.sort(key=lambda r: ORDER.index(r.kind) if r.kind in ORDER else len(ORDER))
            if theirs:
                log.warning("resource group %s holds what hypercli did not make for cluster "
                            "%s (%s): the group stays, with it; only the cluster's own "
                            "resources in it are removed", g.name, c,
                            ", ".join(r.name for r in theirs))
                out += inner
            else:
                out += inner + [Resource("resource_group", g.id, c, g.location or "")]
        loose = [Resource(KINDS.get((r.type or "").lower(), (r.type or "").rsplit("/", 1)[-1]),
                          r.id, r.tags[TAG_CLUSTER], r.location or "")
                 for r in self._tagged(cluster) if r.id.split("/")[4].lower() not in owned
                 and (r.type or "").lower() in KINDS]
        loose.sort(key=lambda r: ORDER.index(r.kind))
        return loose + out

    @staticmethod
    def _made_for(r, cluster: str) -> bool:
        """Whether a resource of a group hypercli made for ``cluster`` is one it made for it:
        tagged ``hyper:cluster`` = ``cluster``, or the OS disk of one of its VMs (Azure names
        it ``<vm>_OsDisk_...`` and gives it no tags)."""
        if (r.tags or {}).get(TAG_CLUSTER) == cluster:
            return True
        return (r.type or "").lower() == "microsoft.compute/disks" and re.match(
            rf"{re.escape(vm_name(cluster))}-\d+_OsDisk_", r.name or "") is not None

    def delete(self, resources: list[Resource]) -> list[str]:
        """Delete what :meth:`resources` listed: first the role assignments hypercli made
        for the VMs' own identities and the storage identities; then, in adopted groups,
        each resource alone in :data:`ORDER` (VMs first, waited for); then the groups
        hypercli made, waiting for each (a group already gone counts as deleted). A group
        that is not listed as a ``resource_group`` is never deleted. Returns ``"<kind>
        <name>"`` per resource."""
        removed = []
        groups = [r.id.split("/")[4] for r in resources if r.kind == "resource_group"]
        owned = {g.lower() for g in groups}
        for r in resources:
            if r.kind in ("instance", "identity"):
                for principal in self._principals(r):
                    self._unassign(principal)
        loose = [r for r in resources if r.kind != "resource_group"
                 and r.id.count("/") >= 4 and r.id.split("/")[4].lower() not in owned]
        for r in sorted(loose, key=lambda r: ORDER.index(r.kind) if r.kind in ORDER
                        else len(ORDER)):
            api = _api_version(next((t for t, k in _TYPES.items() if k == r.kind), ""))
            with _calls(f"deleting {r}"):
                try:
                    self.rm.resources.begin_delete_by_id(
                        r.id, api_version=api, polling_interval=self.poll).result()
                except ResourceNotFoundError:
                    continue
            removed.append(f"{r.kind} {r.id.rsplit('/', 1)[-1]}")
        for rg in groups:
            with _calls(f"deleting resource group {rg}"):
                try:
                    self.rm.resource_groups.begin_delete(
                        rg, force_deletion_types="Microsoft.Compute/virtualMachines",
                        polling_interval=self.poll).result()
                except ResourceNotFoundError:
                    continue
            removed += [f"{r.kind} {r.id.rsplit('/', 1)[-1]}" for r in resources
                        if r.id.count("/") >= 4 and r.id.split("/")[4].lower() == rg.lower()]
        return removed

    def _principals(self, r: Resource) -> list[str]:
        """The principal ids of a VM's system-assigned identity or of a user-assigned
        identity ([] when it is gone)."""
        rtype = ("Microsoft.Compute/virtualMachines" if r.kind == "instance"
                 else "Microsoft.ManagedIdentity/userAssignedIdentities")
        try:
            found = self._arm("GET", f"{r.id}?api-version={_api_version(rtype)}",
                              f"reading {r.id}")
        except CloudError as e:
            if e.code in ("ResourceNotFound", "NotFound", "404", "ResourceGroupNotFound"):
                return []
            raise
        p = (found.get("identity") if r.kind == "instance" else found.get("properties")) or {}
        return [p["principalId"]] if p.get("principalId") else []

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        """Nothing: Azure's prices come from its Retail Prices API, not these SDKs."""
        return {}

    @staticmethod
    def _image_reference(image: str) -> dict:
        """ImageReference fields of an image id (``/subscriptions/...``) or a marketplace URN
        ``PUBLISHER:OFFER:SKU:VERSION``. Raises UsageError for anything else."""
        if image.startswith("/"):
            return {"id": image}
        parts = image.split(":")
        if len(parts) != 4 or not all(parts):
            raise UsageError(f"image {image!r} is neither an image id nor "
                             "PUBLISHER:OFFER:SKU:VERSION",
                             "e.g. Canonical:ubuntu-24_04-lts:server:latest")
        return dict(zip(("publisher", "offer", "sku", "version"), parts))

    def find_image(self, spec: CloudSpec) -> str:
        """``spec.image`` (checked), else the id of the newest managed image in this region
        tagged ``hyper:image=node`` and ``hyper:variant=<variant>`` (newest: the build stamp
        that ends its name). Raises UsageError when there is none."""
        if spec.image:
            self._image_reference(spec.image)
            return spec.image
        with _calls("finding the baked image"):
            found = [i for i in self.compute.images.list()
                     if (i.tags or {}).get(TAG_IMAGE) == "node"
                     and (i.tags or {}).get(TAG_VARIANT) == spec.variant]
        here = [i for i in found if (i.location or "").lower() == self.region.lower()]
        if not here:
            where = f" (there is one in {found[0].location})" if found else ""
            raise UsageError(f"no baked hypercli {spec.variant} image in subscription "
                             f"{self.subscription}, region {self.region}{where}",
                             "bake one: hyper image build --provider azure "
                             "(or set image: PUBLISHER:OFFER:SKU:VERSION)")
        return max(here, key=lambda i: i.name).id
