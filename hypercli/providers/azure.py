"""Azure through azure-mgmt-resource, -network and -compute: the CloudAPI of provider ``azure``.

What a cluster gets, all in one resource group (``resource_group``, default
``hyper-<cluster>``) tagged ``hyper:cluster`` and ``hyper:owner``:

* a virtual network ``hyper-<cluster>-vnet`` with subnet ``nodes`` and a network security group
  ``hyper-<cluster>-nsg`` with one inbound rule: TCP 22 from ``ssh_cidr``;
* per node a static Standard public IP ``<node>-ip``, a NIC ``<node>-nic`` and a VM ``<node>``
  with priority Spot, eviction policy Delete and ``max_price`` (-1: up to the on-demand
  price) or priority Regular; its OS disk of ``disk_gb`` GiB is deleted with it; custom data is
  the cloud-config, a system-assigned managed identity with the role Virtual Machine
  Contributor on the group (the node watcher deletes its idle VM with it); zones are tried in
  ``zones`` order while the answer is a capacity error (``SkuNotAvailable``,
  ``AllocationFailed``, ``ZonalAllocationFailed``, ...).

Teardown deletes the resource group, which removes everything in it. Each create and delete
waits for its long-running operation. Azure's prices come from the public Retail Prices API,
not from these SDKs: :meth:`spot_price` returns nothing.

Credentials: ``DefaultAzureCredential`` (``az login``, a service principal in
``AZURE_CLIENT_ID``/``AZURE_TENANT_ID``/``AZURE_CLIENT_SECRET``, a managed identity) and
``AZURE_SUBSCRIPTION_ID``. Test seam: ``HYPER_AZURE_ENDPOINT`` (an ``https://127.0.0.1:PORT``
stand-in for Resource Manager) with ``HYPER_AZURE_CA_BUNDLE`` (the stand-in's certificate:
azure-core sends bearer tokens over TLS only) and ``HYPER_AZURE_TOKEN`` (a fixed bearer token
used instead of the credential chain, only together with ``HYPER_AZURE_ENDPOINT``).
"""

from __future__ import annotations

import base64
import os
import re
import threading
from contextlib import contextmanager

from azure.core.exceptions import (ClientAuthenticationError, HttpResponseError,
                                   ResourceNotFoundError, ServiceRequestError)
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

CREDENTIALS_HINT = ("run `az login`, or set AZURE_CLIENT_ID, AZURE_TENANT_ID and "
                    "AZURE_CLIENT_SECRET; AZURE_SUBSCRIPTION_ID names the subscription")
CAPACITY_CODES = {"SkuNotAvailable", "AllocationFailed", "ZonalAllocationFailed",
                  "OverconstrainedAllocationRequest", "OverconstrainedZonalAllocationRequest"}
QUOTA_CODES = {"QuotaExceeded", "OperationNotAllowed"}
#: built-in role "Virtual Machine Contributor" (learn.microsoft.com/azure/role-based-access-
#: control/built-in-roles): enough for a VM to delete itself
VM_CONTRIBUTOR = "9980e02c-c2be-4d73-94e8-173b1dc7cf3c"
POWER = {"starting": "pending", "running": "running", "stopping": "stopping",
         "deallocating": "stopping", "stopped": "terminated", "deallocated": "terminated"}


def vm_name(text: str) -> str:
    """A valid Azure Linux VM name for ``text`` (``[A-Za-z0-9-]``, at most 64)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", text).strip("-")[:64] or "node"


@contextmanager
def _calls(what: str):
    """Turn azure-core's and azure-identity's errors into hypercli's."""
    try:
        yield
    except ClientAuthenticationError as e:
        raise CredentialsError(f"Azure refused the credentials ({e.message})",
                               CREDENTIALS_HINT) from None
    except HttpResponseError as e:
        code = (e.error.code if e.error else None) or str(e.status_code or "")
        msg = (e.error.message if e.error else None) or e.message
        if e.status_code in (401,) or code in ("InvalidAuthenticationToken",
                                                "AuthenticationFailed",
                                                "ExpiredAuthenticationToken"):
            raise CredentialsError(f"Azure refused the credentials ({code}: {msg})",
                                   CREDENTIALS_HINT) from None
        cls = CapacityError if code in CAPACITY_CODES else \
            QuotaError if code in QUOTA_CODES or "quota" in (msg or "").lower() else CloudError
        raise cls(f"{what}: {code}: {msg}", code=code) from None
    except ServiceRequestError as e:
        raise CloudError(f"{what}: {e}") from None
    except Exception as e:
        if type(e).__name__ == "CredentialUnavailableError":
            raise CredentialsError(f"no usable Azure credentials ({e})",
                                   CREDENTIALS_HINT) from None
        raise


class _StaticToken:
    """A TokenCredential handing out one bearer token (the test seam's stand-in takes any)."""

    def __init__(self, token: str):
        self.token = token

    def get_token(self, *scopes, **kwargs):
        import time

        from azure.core.credentials import AccessToken
        return AccessToken(self.token, int(time.time()) + 3600)


class AzureAPI:
    """Azure Resource Manager in one subscription and region (see the module docstring).

    Args:
        subscription_id: or None for AZURE_SUBSCRIPTION_ID.
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
        self.poll = 0.05 if self.base_url else 5.0  # s between LRO polls
        self._credential = credential
        self._local = threading.local()

    # -- plumbing ------------------------------------------------------------------------------
    def _client(self, cls):
        c = getattr(self._local, cls.__name__, None)
        if c is None:
            if not self.subscription:
                raise CredentialsError("no Azure subscription", "set AZURE_SUBSCRIPTION_ID "
                                       "(`az account show --query id`)")
            if self._credential is None and self.base_url and os.environ.get(
                    "HYPER_AZURE_TOKEN"):
                self._credential = _StaticToken(os.environ["HYPER_AZURE_TOKEN"])
            if self._credential is None:
                from azure.identity import DefaultAzureCredential
                self._credential = DefaultAzureCredential()
            kw = {}
            if self.base_url:
                kw["base_url"] = self.base_url
                kw["credential_scopes"] = ["https://management.azure.com/.default"]
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

    def _tags(self, cluster: str, node: str | None = None) -> dict:
        t = {TAG_CLUSTER: cluster, TAG_OWNER: owner()}
        if node:
            t[TAG_NODE] = node
        return t

    def _groups(self, cluster: str | None) -> list:
        with _calls("listing resource groups"):
            return [g for g in self.rm.resource_groups.list()
                    if (g.tags or {}).get(TAG_CLUSTER)
                    and (cluster is None or g.tags[TAG_CLUSTER] == cluster)]

    # -- the contract --------------------------------------------------------------------------
    def check(self) -> str:
        n = len(self._groups(None))
        return f"subscription {self.subscription}, region {self.region or '?'} " \
               f"({n} hyper resource groups)"

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        if not self.region:
            raise UsageError("provider azure needs cluster.region", "e.g. region: eastus")
        rg = spec.resource_group or f"hyper-{spec.cluster}"
        tags = self._tags(spec.cluster)
        with _calls(f"creating resource group {rg}"):
            self.rm.resource_groups.create_or_update(
                rg, ResourceGroup(location=self.region, tags=tags))
        with _calls("creating the network security group"):
            nsg = self.net.network_security_groups.begin_create_or_update(
                rg, f"hyper-{spec.cluster}-nsg", nm.NetworkSecurityGroup(
                    location=self.region, tags=tags,
                    security_rules=[nm.SecurityRule(
                        name="ssh", protocol="Tcp", direction="Inbound", access="Allow",
                        priority=1000, source_address_prefix=spec.ssh_cidr,
                        source_port_range="*", destination_address_prefix="*",
                        destination_port_range="22")]),
                polling_interval=self.poll).result()
        with _calls("creating the virtual network"):
            vnet = self.net.virtual_networks.begin_create_or_update(
                rg, f"hyper-{spec.cluster}-vnet", nm.VirtualNetwork(
                    location=self.region, tags=tags,
                    address_space=nm.AddressSpace(address_prefixes=["10.77.0.0/16"]),
                    subnets=[nm.Subnet(name="nodes", address_prefix="10.77.0.0/20")]),
                polling_interval=self.poll).result()
        return {"resource_group": rg, "nsg": nsg.id, "subnet": vnet.subnets[0].id}

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
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
        rg, name = prepared["resource_group"], vm_name(node)
        tags = self._tags(spec.cluster, node)
        with _calls(f"creating the public IP of {node}"):
            ip = self.net.public_ip_addresses.begin_create_or_update(
                rg, f"{name}-ip", nm.PublicIPAddress(
                    location=self.region, tags=tags, sku=nm.PublicIPAddressSku(name="Standard"),
                    public_ip_allocation_method="Static"),
                polling_interval=self.poll).result()
        with _calls(f"creating the NIC of {node}"):
            nic = self.net.network_interfaces.begin_create_or_update(
                rg, f"{name}-nic", nm.NetworkInterface(
                    location=self.region, tags=tags,
                    network_security_group=nm.NetworkSecurityGroup(id=prepared["nsg"]),
                    ip_configurations=[nm.NetworkInterfaceIPConfiguration(
                        name="ipconfig", subnet=nm.Subnet(id=prepared["subnet"]),
                        public_ip_address=nm.PublicIPAddress(id=ip.id))]),
                polling_interval=self.poll).result()

        def body(zone: str | None) -> cm.VirtualMachine:
            spot = dict(priority="Spot", eviction_policy="Delete",
                        billing_profile=cm.BillingProfile(max_price=spec.max_price or -1)) \
                if spec.spot else dict(priority="Regular")
            return cm.VirtualMachine(
                location=self.region, tags=tags, zones=[zone] if zone else None,
                identity=cm.VirtualMachineIdentity(type="SystemAssigned"),
                hardware_profile=cm.HardwareProfile(vm_size=spec.instance_type),
                storage_profile=cm.StorageProfile(
                    image_reference=cm.ImageReference(**image),
                    os_disk=cm.OSDisk(create_option="FromImage", disk_size_gb=spec.disk_gb,
                                      delete_option="Delete",
                                      managed_disk=cm.ManagedDiskParameters(
                                          storage_account_type="StandardSSD_LRS"))),
                os_profile=cm.OSProfile(
                    computer_name=name, admin_username="hyper",
                    custom_data=base64.b64encode(boot.user_data[node].encode()).decode(),
                    linux_configuration=cm.LinuxConfiguration(
                        disable_password_authentication=True,
                        ssh=cm.SshConfiguration(public_keys=[cm.SshPublicKey(
                            path="/home/hyper/.ssh/authorized_keys",
                            key_data=boot.ssh_public_key)]))),
                network_profile=cm.NetworkProfile(network_interfaces=[
                    cm.NetworkInterfaceReference(id=nic.id, delete_option="Delete")]),
                **spot)
        last: Exception | None = None
        for zone in list(spec.zones) or [None]:
            what = f"launching {node}" + (f" in zone {zone}" if zone else "")
            try:
                with _calls(what):
                    vm = self.compute.virtual_machines.begin_create_or_update(
                        rg, name, body(zone), polling_interval=self.poll).result()
                self._allow_self_delete(rg, vm)
                return VM(id=vm.name, node=node, zone=zone or "", state="running",
                          public_ip=ip.ip_address, private_ip=None,
                          instance_type=spec.instance_type, spot=spec.spot,
                          extra={"resource_group": rg})
            except CapacityError as e:
                last = e
            except CloudError as e:
                last = e
                break
        self._quietly(lambda: self.net.network_interfaces.begin_delete(
            rg, f"{name}-nic", polling_interval=self.poll).result())
        self._quietly(lambda: self.net.public_ip_addresses.begin_delete(
            rg, f"{name}-ip", polling_interval=self.poll).result())
        raise last

    def _allow_self_delete(self, rg: str, vm) -> None:
        """Give the VM's managed identity the role Virtual Machine Contributor on its own
        resource group, so that the node watcher can delete the idle VM. Best effort: an
        account that may not assign roles gets a warning, and such a VM is only powered off
        when idle (``hyper down``/``hyper gc`` remove it)."""
        import logging
        import uuid

        from azure.core.rest import HttpRequest
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
        except Exception as e:
            logging.getLogger("hypercli").warning(
                "VM %s cannot delete itself when idle (role assignment refused: %s); it will "
                "power off instead", vm.name, e)

    @staticmethod
    def _quietly(call) -> None:
        try:
            with _calls("cleaning up"):
                call()
        except (CloudError, ResourceNotFoundError):
            pass

    def describe(self, cluster: str) -> list[VM]:
        out = []
        for g in self._groups(cluster):
            with _calls(f"listing VMs of {g.name}"):
                ips = {p.name: p.ip_address
                       for p in self.net.public_ip_addresses.list(g.name)}
                for vm in self.compute.virtual_machines.list(g.name):
                    view = self.compute.virtual_machines.instance_view(g.name, vm.name)
                    power = next((s.code.split("/", 1)[1] for s in view.statuses or []
                                  if (s.code or "").startswith("PowerState/")), "starting")
                    state = POWER.get(power, "pending")
                    spot = (vm.priority or "") == "Spot"
                    if state == "terminated" and spot:
                        state = "preempted"
                    out.append(VM(id=vm.name, node=(vm.tags or {}).get(TAG_NODE, vm.name),
                                  zone=(vm.zones or [""])[0], state=state,
                                  public_ip=ips.get(f"{vm.name}-ip"), instance_type=(
                                      vm.hardware_profile.vm_size if vm.hardware_profile
                                      else ""), spot=spot, extra={"resource_group": g.name}))
        return out

    def terminate(self, cluster: str, ids: list[str]) -> None:
        for g in self._groups(cluster):
            for i in ids:
                with _calls(f"deleting VM {i}"):
                    try:
                        self.compute.virtual_machines.begin_delete(g.name, i,
                                                                   polling_interval=self.poll)
                    except ResourceNotFoundError:
                        pass

    def resources(self, cluster: str | None = None) -> list[Resource]:
        out = []
        for g in self._groups(cluster):
            c = g.tags[TAG_CLUSTER]
            with _calls(f"listing {g.name}"):
                for r in self.rm.resources.list_by_resource_group(g.name):
                    out.append(Resource(r.type.rsplit("/", 1)[-1], r.id, c, g.name))
            out.append(Resource("resource_group", g.name, c, g.location or ""))
        return out

    def delete(self, resources: list[Resource]) -> list[str]:
        removed = []
        for rg in [r for r in resources if r.kind == "resource_group"]:
            with _calls(f"deleting resource group {rg.id}"):
                try:
                    self.rm.resource_groups.begin_delete(
                        rg.id, polling_interval=self.poll).result()
                except ResourceNotFoundError:
                    continue
            removed += [f"{r.kind} {r.id.rsplit('/', 1)[-1]}" for r in resources
                        if r.kind != "resource_group" and r.region == rg.id]
            removed.append(f"resource_group {rg.id}")
        return removed

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        return {}

    @staticmethod
    def _image_reference(image: str) -> dict:
        if image.startswith("/"):
            return {"id": image}
        parts = image.split(":")
        if len(parts) != 4:
            raise UsageError(f"image {image!r} is neither an image id nor "
                             "PUBLISHER:OFFER:SKU:VERSION",
                             "e.g. Canonical:ubuntu-24_04-lts:server:latest")
        return dict(zip(("publisher", "offer", "sku", "version"), parts))

    def find_image(self, spec: CloudSpec) -> str:
        if spec.image:
            self._image_reference(spec.image)
            return spec.image
        with _calls("finding the baked image"):
            found = [i for i in self.compute.images.list()
                     if (i.tags or {}).get(TAG_IMAGE) == "node"
                     and (i.tags or {}).get(TAG_VARIANT) == spec.variant]
        if not found:
            raise UsageError(f"no baked hypercli {spec.variant} image in subscription "
                             f"{self.subscription}",
                             "bake one: hyper image build --provider azure "
                             "(or set image: PUBLISHER:OFFER:SKU:VERSION)")
        return max(found, key=lambda i: i.name).id  # names end in the build stamp
