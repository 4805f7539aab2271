"""Azure through azure-mgmt-resource, -network and -compute: the CloudAPI of provider ``azure``.

What a cluster gets, all in one resource group (``resource_group``, default
``hyper-<cluster>``) tagged ``hyper:cluster`` and ``hyper:owner``:

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
  the name (``root``); a
  system-assigned managed identity with the role Virtual Machine Contributor on the group (the
  node watcher deletes its idle VM with it), or the storage identity below. Zones are
  tried in ``zones`` order while the
  answer is a capacity error (``SkuNotAvailable``, ``AllocationFailed``,
  ``ZonalAllocationFailed``, ``Overconstrained*AllocationRequest``); a VM whose allocation
  failed is deleted first (ARM leaves it in state Failed, and its zones cannot change).

Storage identity: when the recipe's ``storage`` / ``mounts`` name ``az://account/container``
paths (``spec.grants``), :meth:`AzureAPI.identity` makes a user-assigned managed identity
``hyper-<cluster>-storage`` in the cluster's group (tagged like it) before any VM, and gives
it, per grant, the built-in role Storage Blob Data Reader (read) or Storage Blob Data
Contributor (read/write) on that container only (scope ``.../storageAccounts/A/
blobServices/default/containers/C``), with an ABAC condition (``conditionVersion`` 2.0) that
limits blob reads, writes and deletes to ``prefix/`` (``@Resource[...blobs:path]``) and
listings to that prefix (``@Request[...blobs:prefix]``) when the grant has a prefix; and Virtual
Machine Contributor on the cluster's group (the node watcher deletes its idle VM with it). The
VMs then carry that identity only (no system-assigned one), so a token from IMDS with no
client id is that identity's. Role assignment names are UUIDs derived from scope, principal,
role and condition: making them again is a no-op (409 ``RoleAssignmentExists``); they are only
added, never taken away by a later recipe. Teardown deletes the identity's role assignments
(they live outside the group) before the group. With ``cluster.identity`` nothing is made or
assigned: the VMs carry that identity as is (it must already be allowed the containers; the
watchdog then only powers an idle VM off unless it may delete it). A caller refused
``Microsoft.ManagedIdentity/userAssignedIdentities/write`` or
``Microsoft.Authorization/roleAssignments/write`` gets a :class:`CredentialsError` naming the
permission and ``cluster.identity``, before any VM exists.

Teardown deletes the resource group (VMs force-deleted), which removes everything in it.
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
                                      CredentialsError, QuotaError, Resource, owner)

log = logging.getLogger("hypercli")

CREDENTIALS_HINT = ("run `az login`, or set AZURE_CLIENT_ID, AZURE_TENANT_ID and "
                    "AZURE_CLIENT_SECRET; AZURE_SUBSCRIPTION_ID names the subscription")
AUTH_CODES = {"InvalidAuthenticationToken", "AuthenticationFailed",
              "ExpiredAuthenticationToken", "InvalidAuthenticationTokenTenant"}
#: learn.microsoft.com/troubleshoot/azure/virtual-machines/windows/allocation-failure
CAPACITY_CODES = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed",
                  "OverconstrainedAllocationRequest", "OverconstrainedZonalAllocationRequest"}
#: built-in role "Virtual Machine Contributor" (learn.microsoft.com/azure/role-based-access-
#: control/built-in-roles): enough for a VM to delete itself
VM_CONTRIBUTOR = "9980e02c-c2be-4d73-94e8-173b1dc7cf3c"
#: built-in roles "Storage Blob Data Reader" and "Storage Blob Data Contributor"
BLOB_READER, BLOB_CONTRIBUTOR = ("2a2b9908-6ea1-4ae2-8e65-a410df84e7d1",
                                 "ba92f5b4-2d11-453d-a403-e96b0029c9fe")
AUTH_API, MSI_API, STORAGE_API = "2022-04-01", "2023-01-31", "2023-01-01"
#: what making a cluster's storage identity asks of the caller
IDENTITY_ACTIONS = ("Microsoft.ManagedIdentity/userAssignedIdentities/write",
                    "Microsoft.Authorization/roleAssignments/write")
IDENTITY_HINT = ("or name an existing user-assigned managed identity that may use the "
                 "containers: cluster.identity: /subscriptions/S/resourceGroups/G/providers/"
                 "Microsoft.ManagedIdentity/userAssignedIdentities/NAME")
#: the blob data actions an ABAC condition limits to a prefix (the roles' data actions)
BLOB = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"
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
VNET_SPACE, SUBNET = "10.77.0.0/16", "10.77.0.0/20"  # the cluster's network and its subnet
SSH_PRIORITY, CLUSTER_PRIORITY = 1000, 1100  # NSG rules: lower numbers are applied first


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
        """Resource groups tagged ``hyper:cluster`` (= ``cluster`` unless None)."""
        flt = f"tagName eq '{TAG_CLUSTER}'"
        if cluster:
            flt += " and tagValue eq '{}'".format(cluster.replace("'", "''"))
        with _calls("listing resource groups"):
            return [g for g in self.rm.resource_groups.list(filter=flt)
                    if (g.tags or {}).get(TAG_CLUSTER)
                    and (cluster is None or g.tags[TAG_CLUSTER] == cluster)]

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
        old caller address goes).

        Returns:
            ``{"resource_group": name, "nsg": id, "subnet": id}`` and, from :meth:`identity`
            (made right after the group, before anything else), ``"identity"``: the
            user-assigned identity's id when the VMs carry one.
        Raises:
            UsageError: no region or no ``ssh_cidr``; CredentialsError, CloudError.
        """
        if not self.region:
            raise UsageError("provider azure needs cluster.region", "e.g. region: eastus")
        if not spec.ssh_cidr:
            raise UsageError("the SSH rule needs a source address range",
                             "set cluster.ssh_cidr, e.g. 203.0.113.0/24")
        rg = spec.resource_group or f"hyper-{spec.cluster}"
        tags = self._tags(spec.cluster)
        with _calls(f"creating resource group {rg}"):
            self.rm.resource_groups.create_or_update(
                rg, ResourceGroup(location=self.region, tags=tags))
        ident = self.identity(spec)
        with _calls("creating the network security group"):
            nsg = self.net.network_security_groups.begin_create_or_update(
                rg, f"hyper-{spec.cluster}-nsg", nm.NetworkSecurityGroup(
                    location=self.region, tags=tags,
                    security_rules=[
                        nm.SecurityRule(
                            name="ssh", protocol="Tcp", direction="Inbound", access="Allow",
                            priority=SSH_PRIORITY, source_address_prefix=spec.ssh_cidr,
                            source_port_range="*", destination_address_prefix="*",
                            destination_port_range="22"),
                        nm.SecurityRule(
                            name="cluster", protocol="*", direction="Inbound", access="Allow",
                            priority=CLUSTER_PRIORITY, source_address_prefix=SUBNET,
                            source_port_range="*", destination_address_prefix=SUBNET,
                            destination_port_range="*")]),
                polling_interval=self.poll).result()
        with _calls("creating the virtual network"):
            vnet = self.net.virtual_networks.begin_create_or_update(
                rg, f"hyper-{spec.cluster}-vnet", nm.VirtualNetwork(
                    location=self.region, tags=tags,
                    address_space=nm.AddressSpace(address_prefixes=[VNET_SPACE]),
                    subnets=[nm.Subnet(name="nodes", address_prefix=SUBNET)]),
                polling_interval=self.poll).result()
        return {"resource_group": rg, "nsg": nsg.id, "subnet": vnet.subnets[0].id, **ident}

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
        self._allow_self_delete(rg, vm)
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
        the cluster key for root itself)."""
        user = "hyper" if boot.ssh_user.lower() in RESERVED_USERS else boot.ssh_user
        spot = dict(priority="Spot", eviction_policy="Delete",
                    billing_profile=cm.BillingProfile(max_price=spec.max_price or -1)) \
            if spec.spot else dict(priority="Regular")
        return cm.VirtualMachine(
            location=self.region, tags=tags, zones=[zone] if zone else None,
            identity=cm.VirtualMachineIdentity(
                type="UserAssigned", user_assigned_identities={
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
        "Storage identity"): the user-assigned identity ``hyper-<cluster>-storage`` with a
        blob data role on exactly the ``az`` containers of ``spec.grants``, limited to each
        grant's prefix. The cluster's resource group must exist (:meth:`prepare` makes it).

        Returns:
            ``{"identity": ARM id}`` of the identity the VMs carry, or ``{}`` (no ``az``
            grant: the VMs keep a system-assigned identity).
        Raises:
            CredentialsError: the caller may not create the identity
                (``Microsoft.ManagedIdentity/userAssignedIdentities/write``) or assign roles
                (``Microsoft.Authorization/roleAssignments/write``); the message names the
                permission and ``cluster.identity``.
            UsageError: a storage account of the recipe is not in the subscription.
            CloudError: other API failures.
        """
        if spec.identity:
            return {"identity": spec.identity}
        grants = [g for g in spec.grants if g.scheme == "az"]
        if not grants:
            return {}
        rg = spec.resource_group or f"hyper-{spec.cluster}"
        name = f"hyper-{spec.cluster}-storage"[:128]
        rid = (f"/subscriptions/{self.subscription}/resourceGroups/{rg}/providers/"
               f"Microsoft.ManagedIdentity/userAssignedIdentities/{name}")
        try:
            made = self._arm("PUT", f"{rid}?api-version={MSI_API}",
                             f"creating the managed identity {name}",
                             {"location": self.region, "tags": self._tags(spec.cluster)})
        except CloudError as e:
            self._refused(e, "Microsoft.ManagedIdentity/userAssignedIdentities/write",
                          f"create the managed identity {name}")
            raise
        principal = made["properties"]["principalId"]
        accounts = self._account_ids()
        wanted = [(f"/subscriptions/{self.subscription}/resourceGroups/{rg}", VM_CONTRIBUTOR,
                   None)]
        for g in grants:
            account, container = g.bucket.split("/", 1)
            if account not in accounts:
                raise UsageError(f"storage account {account} (az://{g.bucket}) not found in "
                                 f"subscription {self.subscription}",
                                 "check the recipe's storage and mounts")
            wanted.append((f"{accounts[account]}/blobServices/default/containers/{container}",
                           BLOB_CONTRIBUTOR if g.write else BLOB_READER,
                           prefix_condition(g.prefix) if g.prefix else None))
        for scope, role, condition in wanted:
            self._assign(scope, role, principal, condition)
        return {"identity": rid}

    def _assign(self, scope: str, role: str, principal: str, condition: str | None) -> None:
        """PUT one role assignment (its name a UUID of its content: repeating it is a
        no-op). Raises CredentialsError (``roleAssignments/write`` refused), CloudError."""
        key = "|".join((scope.lower(), principal, role, condition or ""))
        props = {"roleDefinitionId": f"/subscriptions/{self.subscription}/providers/"
                 f"Microsoft.Authorization/roleDefinitions/{role}",
                 "principalId": principal, "principalType": "ServicePrincipal"}
        if condition:
            props.update(condition=condition, conditionVersion="2.0")
        try:
            self._arm("PUT", f"{scope}/providers/Microsoft.Authorization/roleAssignments/"
                      f"{uuid.uuid5(uuid.NAMESPACE_URL, key)}?api-version={AUTH_API}",
                      f"assigning a role on {scope}", {"properties": props})
        except CloudError as e:
            if e.code == "RoleAssignmentExists":
                return
            self._refused(e, "Microsoft.Authorization/roleAssignments/write",
                          f"assign roles on {scope}")
            raise

    def _unassign(self, group: str) -> list[str]:
        """Delete the role assignments of the user-assigned identities in ``group`` (they
        live at the containers' scopes, outside the group). Returns their ids."""
        removed = []
        base = f"/subscriptions/{self.subscription}"
        try:
            found = self._arm("GET", f"{base}/resourceGroups/{group}/providers/"
                              f"Microsoft.ManagedIdentity/userAssignedIdentities"
                              f"?api-version={MSI_API}", f"listing identities in {group}")
        except CloudError as e:
            if e.code in ("ResourceGroupNotFound", "404"):
                return removed
            raise
        for ident in found.get("value", []):
            pid = ident["properties"]["principalId"]
            path = (f"{base}/providers/Microsoft.Authorization/roleAssignments?api-version="
                    f"{AUTH_API}&$filter=" + quote(f"principalId eq '{pid}'"))
            while path:
                page = self._arm("GET", path, f"listing role assignments of {ident['name']}")
                for ra in page.get("value", []):
                    try:
                        self._arm("DELETE", f"{ra['id']}?api-version={AUTH_API}",
                                  f"deleting role assignment {ra['name']}")
                    except CloudError as e:
                        if e.code not in ("RoleAssignmentNotFound", "404"):
                            raise
                    removed.append(ra["id"])
                path = page.get("nextLink")
        return removed

    def _allow_self_delete(self, rg: str, vm) -> None:
        """Give the VM's managed identity the role Virtual Machine Contributor on its own
        resource group, so that the node watcher can delete the idle VM. Best effort: an
        account that may not assign roles gets a warning, and such a VM is only powered off
        when idle (``hyper down``/``hyper gc`` remove it)."""
        principal = getattr(getattr(vm, "identity", None), "principal_id", None)
        if not principal:
            return
        scope = f"/subscriptions/{self.subscription}/resourceGroups/{rg}"
        req = HttpRequest("PUT", f"{scope}/providers/Microsoft.Authorization/roleAssignments/"
                          f"{uuid.uuid5(uuid.NAMESPACE_URL, scope + principal)}"
                          "?api-version=2022-04-01", json={"properties": {
                              "roleDefinitionId": f"/subscriptions/{self.subscription}/providers/"
                              f"Microsoft.Authorization/roleDefinitions/{VM_CONTRIBUTOR}",
                              "principalId": principal, "principalType": "ServicePrincipal"}})
        try:
            resp = self.rm.send_request(req)
            if resp.status_code >= 300 and resp.status_code != 409:  # 409: already there
                raise HttpResponseError(response=resp)
        except AzureError as e:
            log.warning("VM %s cannot delete itself when idle (role assignment refused: %s); "
                        "it will power off instead", vm.name, e)

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
        for g in self._groups(cluster):
            with _calls(f"listing VMs of {g.name}"):
                ips = {p.id.lower(): p.ip_address
                       for p in self.net.public_ip_addresses.list(g.name)}
                nics = {n.id.lower(): n for n in self.net.network_interfaces.list(g.name)}
                vms = list(self.compute.virtual_machines.list(g.name, expand="instanceView"))
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
        for g in self._groups(cluster):
            with _calls(f"deleting VMs of {g.name}"):
                for vm in self.compute.virtual_machines.list(g.name):
                    if vm.name in wanted:
                        self.compute.virtual_machines.begin_delete(
                            g.name, vm.name, polling_interval=self.poll)

    def resources(self, cluster: str | None = None) -> list[Resource]:
        """Every resource in the hyper resource groups of ``cluster`` (all when None), ARM ids,
        instances first and each group last (it takes the rest along)."""
        out = []
        for g in self._groups(cluster):
            c = g.tags[TAG_CLUSTER]
            with _calls(f"listing {g.name}"):
                inner = [Resource(KINDS.get((r.type or "").lower(),
                                            (r.type or "").rsplit("/", 1)[-1]),
                                  r.id, c, r.location or g.location or "")
                         for r in self.rm.resources.list_by_resource_group(g.name)]
            inner.sort(key=lambda r: ORDER.index(r.kind) if r.kind in ORDER else len(ORDER))
            out += inner + [Resource("resource_group", g.id, c, g.location or "")]
        return out

    def delete(self, resources: list[Resource]) -> list[str]:
        """Delete the resource groups that hold ``resources`` (ARM ids), waiting for each,
        after the role assignments of their storage identities (module docstring);
        a group already gone counts as deleted. Returns ``"<kind> <name>"`` per resource."""
        removed = []
        groups = list(dict.fromkeys(r.id.split("/")[4] for r in resources
                                    if r.id.count("/") >= 4))
        for rg in groups:
            self._unassign(rg)
            with _calls(f"deleting resource group {rg}"):
                try:
                    self.rm.resource_groups.begin_delete(
                        rg, force_deletion_types="Microsoft.Compute/virtualMachines",
                        polling_interval=self.poll).result()
                except ResourceNotFoundError:
                    continue
            removed += [f"{r.kind} {r.id.rsplit('/', 1)[-1]}" for r in resources
                        if r.id.split("/")[4] == rg]
        return removed

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
