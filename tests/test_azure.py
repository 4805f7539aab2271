"""The azure CloudAPI (hypercli/providers/azure.py) through the real azure-mgmt clients against
a local TLS stand-in for Azure Resource Manager (tests/azurefake.py): spot and regular VMs in a
resource group with network, security group (SSH from the caller, every port between the
cluster's nodes, and which packets get in), public IPs and NICs, long-running operations, zone
failover on SkuNotAvailable and allocation failures, quota and auth errors, power states,
teardown by resource group, and gc across clusters."""

from __future__ import annotations

import base64
import time

import pytest

pytest.importorskip("azure.mgmt.compute")

from azure.core.credentials import AccessToken  # noqa: E402
from azure.identity import CredentialUnavailableError  # noqa: E402

from azurefake import ArmFake  # noqa: E402
from hypercli.errors import UsageError  # noqa: E402
from hypercli.providers.azure import AzureAPI  # noqa: E402
from hypercli.providers.cloud import (Boot, CapacityError, CloudError,  # noqa: E402
                                      CloudSpec, CredentialsError, QuotaError)
from hypercli.providers.cloud_provider import remove_all  # noqa: E402

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl hyper-c1"
URN = "Canonical:ubuntu-24_04-lts:server:latest"


class Token:
    """A TokenCredential that hands out a fixed token and records the scopes asked for."""

    def __init__(self):
        self.scopes: set[str] = set()

    def get_token(self, *scopes, **kw):
        self.scopes.update(scopes)
        return AccessToken("token-1", int(time.time()) + 3600)


class NoCredential:
    """A TokenCredential with nothing configured, as DefaultAzureCredential's chain ends."""

    def get_token(self, *scopes, **kw):
        raise CredentialUnavailableError("EnvironmentCredential: environment variables are "
                                         "not fully configured")


@pytest.fixture
def fake(monkeypatch, tmp_path):
    f = ArmFake(tmp_path)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", f.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(f.ca))
    monkeypatch.delenv("HYPER_AZURE_TOKEN", raising=False)
    try:
        yield f
    finally:
        f.close()


def api(credential=None) -> AzureAPI:
    return AzureAPI("sub-1", "eastus", credential=credential or Token())


def spec(**kw) -> CloudSpec:
    base = dict(cluster="c1", count=2, region="eastus", instance_type="Standard_D4s_v5",
                image=URN, ssh_cidr="203.0.113.0/24", disk_gb=64, max_price=0.05)
    base.update(kw)
    return CloudSpec(**base)


def launch(a, s, nodes=("c1-0", "c1-1")):
    boot = Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root", KEY)
    return a.create(s, list(nodes), boot, a.prepare(s, KEY))


def vm_puts(fake) -> list[tuple[str, dict]]:
    return [(p, b) for m, p, b in fake.requests if m == "PUT" and "/virtualMachines/" in p
            and "/Microsoft.Authorization/" not in p]


def kinds_in(fake, group: str) -> list[str]:
    return sorted(r["type"].rsplit("/", 1)[1] for r in fake.resources_in(group))


def test_spot_vms_in_their_resource_group(fake):
    token = Token()
    a = api(token)
    vms, errors = launch(a, spec())
    assert errors == {} and sorted(v.node for v in vms) == ["c1-0", "c1-1"]
    assert token.scopes == {"https://management.azure.com/.default"}
    assert fake.tokens == {"token-1"}
    path, body = vm_puts(fake)[0]
    assert "/resourceGroups/hyper-c1/providers/Microsoft.Compute/virtualMachines/c1-0" in path
    props = body["properties"]
    assert props["priority"] == "Spot" and props["evictionPolicy"] == "Delete"
    assert props["billingProfile"] == {"maxPrice": 0.05}
    assert props["hardwareProfile"] == {"vmSize": "Standard_D4s_v5"}
    assert base64.b64decode(props["osProfile"]["customData"]).decode() == "#cloud-config\n# c1-0\n"
    # Azure refuses "root" as the admin; the cloud-config authorizes root's key
    linux = props["osProfile"]["linuxConfiguration"]
    assert props["osProfile"]["adminUsername"] == "hyper"
    assert linux["disablePasswordAuthentication"] is True
    assert linux["ssh"]["publicKeys"] == [{"path": "/home/hyper/.ssh/authorized_keys",
                                           "keyData": KEY}]
    disk = props["storageProfile"]["osDisk"]
    assert (disk["diskSizeGB"], disk["deleteOption"]) == (64, "Delete")
    assert props["storageProfile"]["imageReference"] == {
        "publisher": "Canonical", "offer": "ubuntu-24_04-lts", "sku": "server",
        "version": "latest"}
    assert "zones" not in body
    assert body["tags"]["hyper:cluster"] == "c1" and body["tags"]["hyper:node"] == "c1-0"
    assert body["tags"]["hyper:owner"]
    assert body["identity"] == {"type": "SystemAssigned"}
    # the idle watchdog may delete its own VM: a custom role of read and delete, on that VM
    # only, for that VM's own identity
    assert len(fake.role_assignments) == 2
    for vm in ("c1-0", "c1-1"):
        [ra] = [a["properties"] for a in fake.assignments.values()
                if a["properties"]["scope"].endswith(f"/virtualMachines/{vm}")]
        assert ra["principalId"] == fake.vm("hyper-c1", vm)["identity"]["principalId"]
        assert fake.role(ra["roleDefinitionId"].rsplit("/", 1)[1]) == (
            {"Microsoft.Compute/virtualMachines/read",
             "Microsoft.Compute/virtualMachines/delete"}, set())
    assert fake.groups["hyper-c1"]["tags"]["hyper:cluster-id"] == spec().tag
    assert fake.groups["hyper-c1"]["tags"]["hyper:cluster"] == "c1"
    assert kinds_in(fake, "hyper-c1") == ["disks"] * 2 + ["networkInterfaces"] * 2 + [
        "networkSecurityGroups"] + ["publicIPAddresses"] * 2 + ["virtualMachines"] * 2 + [
        "virtualNetworks"]
    for r in fake.resources_in("hyper-c1"):
        if r["type"] != "Microsoft.Compute/disks":  # ARM does not copy a VM's tags to disks
            assert r["tags"]["hyper:cluster"] == "c1", r["id"]
    # each create of a security group, network, IP, NIC, VM: an operation polled to its end
    assert fake.polls.get("InProgress", 0) >= 8 and fake.polls["Succeeded"] == 8
    ips = {r["name"]: r["properties"]["ipAddress"] for r in fake.resources_in("hyper-c1")
           if r["type"].endswith("publicIPAddresses")}
    assert {v.node: v.public_ip for v in vms} == {"c1-0": ips["c1-0-ip"],
                                                  "c1-1": ips["c1-1-ip"]}
    seen = a.describe("c1")
    assert {(v.node, v.state, v.public_ip, v.spot) for v in seen} == {
        (v.node, "running", v.public_ip, True) for v in vms}
    assert all(v.private_ip and v.private_ip.startswith("10.77.") for v in seen)


def test_regular_vm(fake):
    vms, errors = launch(api(), spec(spot=False), nodes=("c1-0",))
    assert errors == {} and not vms[0].spot
    props = vm_puts(fake)[0][1]["properties"]
    assert props["priority"] == "Regular"
    assert "evictionPolicy" not in props and "billingProfile" not in props


def test_spot_without_max_price_pays_up_to_on_demand(fake):
    launch(api(), spec(max_price=None), nodes=("c1-0",))
    assert vm_puts(fake)[0][1]["properties"]["billingProfile"] == {"maxPrice": -1}


def test_security_group_admits_the_cluster_and_ssh_from_the_cidr_only(fake):
    api().prepare(spec(), KEY)
    [nsg] = [b for m, p, b in fake.requests if m == "PUT" and "networkSecurityGroups" in p]
    ssh, cluster = nsg["properties"]["securityRules"]
    p = ssh["properties"]
    assert ssh["name"] == "ssh"
    assert (p["sourceAddressPrefix"], p["destinationPortRange"], p["protocol"], p["access"],
            p["direction"], p["priority"]) == ("203.0.113.0/24", "22", "Tcp", "Allow",
                                               "Inbound", 1000)
    # the cluster's subnet to itself, every protocol and port, applied after the SSH rule
    q = cluster["properties"]
    assert cluster["name"] == "cluster"
    assert (q["sourceAddressPrefix"], q["destinationAddressPrefix"], q["protocol"],
            q["sourcePortRange"], q["destinationPortRange"], q["access"], q["direction"]) == (
        "10.77.0.0/20", "10.77.0.0/20", "*", "*", "*", "Allow", "Inbound")
    assert p["priority"] < q["priority"] < 4096
    assert nsg["tags"]["hyper:cluster"] == "c1"
    # the defaults are Azure's own, DenyAllInBound included: nothing sent, nothing changed
    assert "defaultSecurityRules" not in nsg["properties"]
    [stored] = [r for r in fake.resources_in("hyper-c1") if r["name"] == "hyper-c1-nsg"]
    assert [(r["name"], r["properties"]["priority"])
            for r in stored["properties"]["defaultSecurityRules"]][:3] == [
        ("AllowVnetInBound", 65000), ("AllowAzureLoadBalancerInBound", 65001),
        ("DenyAllInBound", 65500)]


def test_nodes_reach_each_other_and_only_ssh_gets_in_from_the_internet(fake):
    a = api()
    vms, _ = launch(a, spec())
    ip = {v.node: v.private_ip for v in a.describe("c1")}
    assert {v.node: v.private_ip for v in vms} == ip  # each node's private address
    assert all(x.startswith("10.77.") for x in ip.values())

    def verdict(source, dst, protocol, port=None):
        return fake.nsg_verdict("hyper-c1", "hyper-c1-nsg", source, dst, protocol, port)
    # node to node: any protocol and port, by the cluster rule
    assert verdict(ip["c1-0"], ip["c1-1"], "Tcp", 29500) == ("Allow", "cluster")
    assert verdict(ip["c1-1"], ip["c1-0"], "Udp", 53) == ("Allow", "cluster")
    assert verdict(ip["c1-0"], ip["c1-1"], "Icmp") == ("Allow", "cluster")
    # from the Internet: port 22 from ssh_cidr, nothing else
    assert verdict("203.0.113.9", ip["c1-1"], "Tcp", 22) == ("Allow", "ssh")
    assert verdict("203.0.113.9", ip["c1-1"], "Tcp", 29500) == ("Deny", "DenyAllInBound")
    assert verdict("198.51.100.9", ip["c1-1"], "Tcp", 22) == ("Deny", "DenyAllInBound")


@pytest.mark.parametrize("rule, code", [
    (dict(priority=50), "SecurityRuleInvalidPriority"),
    (dict(priority=1000), "SecurityRuleConflict"),
    (dict(source_address_prefix="anywhere"), "SecurityRuleInvalidAddressPrefix"),
    (dict(destination_port_range="22-99999"), "SecurityRuleInvalidPortRange"),
])
def test_the_stand_in_refuses_security_rules_arm_refuses(fake, rule, code):
    from azure.core.exceptions import HttpResponseError
    from azure.mgmt.network import models as nm
    base = dict(name="extra", protocol="*", direction="Inbound", access="Allow", priority=900,
                source_address_prefix="10.0.0.0/8", source_port_range="*",
                destination_address_prefix="*", destination_port_range="*")
    a = api()
    a.prepare(spec(), KEY)
    with pytest.raises(HttpResponseError) as e:
        a.net.network_security_groups.begin_create_or_update(
            "hyper-c1", "hyper-c1-nsg", nm.NetworkSecurityGroup(
                location="eastus", security_rules=[
                    nm.SecurityRule(name="ssh", protocol="Tcp", direction="Inbound",
                                    access="Allow", priority=1000,
                                    source_address_prefix="203.0.113.0/24",
                                    source_port_range="*", destination_address_prefix="*",
                                    destination_port_range="22"),
                    nm.SecurityRule(**{**base, **rule})]), polling_interval=0.01).result()
    assert e.value.error.code == code


def test_prepare_is_idempotent_and_follows_a_new_cidr(fake):
    a = api()
    first = a.prepare(spec(), KEY)
    assert a.prepare(spec(ssh_cidr="198.51.100.7/32"), KEY) == first
    assert kinds_in(fake, "hyper-c1") == ["networkSecurityGroups", "virtualNetworks"]
    [nsg] = [r for r in fake.resources_in("hyper-c1") if r["name"] == "hyper-c1-nsg"]
    assert [(r["name"], r["properties"]["sourceAddressPrefix"])
            for r in nsg["properties"]["securityRules"]] == [("ssh", "198.51.100.7/32"),
                                                             ("cluster", "10.77.0.0/20")]
    with pytest.raises(UsageError, match="source address"):
        a.prepare(spec(ssh_cidr=None), KEY)


def test_zone_failover_on_sku_not_available(fake):
    fake.no_sku_in("1")
    vms, errors = launch(api(), spec(zones=("1", "2")), nodes=("c1-0",))
    assert errors == {} and vms[0].zone == "2"
    assert [b["zones"] for _, b in vm_puts(fake)] == [["1"], ["2"]]
    assert fake.vm("hyper-c1", "c1-0")["zones"] == ["2"]


def test_zone_failover_after_an_allocation_failure(fake):
    # the operation fails later and leaves a Failed VM, whose zone cannot change: it must go
    fake.no_capacity_in("1")
    vms, errors = launch(api(), spec(zones=("1", "3")), nodes=("c1-0",))
    assert errors == {} and vms[0].zone == "3"
    assert fake.polls.get("Failed") == 1
    vm = fake.vm("hyper-c1", "c1-0")
    assert vm["zones"] == ["3"] and vm["properties"]["provisioningState"] == "Succeeded"


def test_no_capacity_anywhere_cleans_up_the_node(fake):
    fake.no_sku_in("1")
    fake.no_capacity_in("2")
    vms, errors = launch(api(), spec(zones=("1", "2")), nodes=("c1-0",))
    assert vms == [] and isinstance(errors["c1-0"], CapacityError)
    assert errors["c1-0"].code == "ZonalAllocationFailed"
    assert kinds_in(fake, "hyper-c1") == ["networkSecurityGroups", "virtualNetworks"]


def test_quota_is_not_retried_and_others_still_launch(fake):
    fake.vm_limit = 1
    vms, errors = launch(api(), spec(zones=("1", "2")))
    assert [v.node for v in vms] == ["c1-0"]
    assert isinstance(errors["c1-1"], QuotaError) and errors["c1-1"].code == "QuotaExceeded"
    assert "Cores quota" in str(errors["c1-1"])
    assert [p.rsplit("/", 1)[1].split("?")[0] for p, _ in vm_puts(fake)] == ["c1-0", "c1-1"]
    assert "c1-1-nic" not in {r["name"] for r in fake.resources_in("hyper-c1")}


@pytest.mark.parametrize("code,message,cls", [
    ("OperationNotAllowed", "Operation could not be completed as it results in exceeding "
     "approved LowPriorityCores quota.", QuotaError),
    ("OperationNotAllowed", "The subscription is disabled.", CloudError),
    ("OverconstrainedAllocationRequest", "Allocation failed.", CapacityError),
])
def test_error_codes(fake, code, message, cls):
    fake.vm_error = (409, code, message)
    _, errors = launch(api(), spec(zones=("1", "2")), nodes=("c1-0",))
    e = errors["c1-0"]
    assert type(e) is cls and e.code == code and message in str(e)
    assert len(vm_puts(fake)) == (2 if cls is CapacityError else 1)


def test_auth_failure_says_how_to_configure(fake):
    fake.auth_fail = True
    with pytest.raises(CredentialsError) as e:
        api().check()
    assert "InvalidAuthenticationToken" in str(e.value)
    assert "az login" in e.value.hint and "AZURE_CLIENT_ID" in e.value.hint


def test_no_credentials_at_all(fake):
    with pytest.raises(CredentialsError) as e:
        api(NoCredential()).prepare(spec(), KEY)
    assert "environment variables" in str(e.value) and "AZURE_TENANT_ID" in e.value.hint
    assert fake.requests == []


def test_missing_subscription(fake, monkeypatch):
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID", raising=False)
    with pytest.raises(CredentialsError, match="no Azure subscription") as e:
        AzureAPI(None, "eastus", credential=Token()).check()
    assert "AZURE_SUBSCRIPTION_ID" in e.value.hint
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "sub-1")
    api = AzureAPI(None, "eastus", credential=Token())
    said = api.check()
    assert said.startswith("subscription sub-1") and said.endswith("storage identities: allowed")
    fake.deny.add("Microsoft.Authorization/roleAssignments/write")  # as up would be refused
    said = api.check()
    assert "missing Microsoft.Authorization/roleAssignments/write" in said
    assert "cluster.identity" in said


def test_image_lookup(fake):
    a = api()
    with pytest.raises(UsageError) as e:
        a.find_image(spec(image=None))
    assert "hyper image build --provider azure" in e.value.hint
    cpu = {"hyper:image": "node", "hyper:variant": "cpu"}
    fake.add_image("hyper-node-cpu-1-202601010000", cpu)
    newest = fake.add_image("hyper-node-cpu-1-202606010000", cpu)
    fake.add_image("hyper-node-cpu-1-202612010000", cpu, location="westus")  # other region
    fake.add_image("hyper-node-gpu-1-202612010000", {**cpu, "hyper:variant": "gpu"})
    fake.page_size = 1  # the image list comes in pages
    assert a.find_image(spec(image=None)) == newest
    launch(a, spec(image=None), nodes=("c1-0",))
    assert vm_puts(fake)[0][1]["properties"]["storageProfile"]["imageReference"] == {
        "id": newest}
    with pytest.raises(UsageError, match="PUBLISHER:OFFER:SKU:VERSION"):
        a.find_image(spec(image="not-an-urn"))


def test_describe_reads_power_states(fake):
    a = api()
    nodes = ("c1-0", "c1-1", "c1-2", "c1-3")
    launch(a, spec(count=4), nodes=nodes)
    for node, power in zip(nodes, ("starting", "running", "stopped", "deallocated")):
        fake.set_power("hyper-c1", node, power)
    states = {v.node: v.state for v in a.describe("c1")}
    assert states == {"c1-0": "pending", "c1-1": "running", "c1-2": "terminated",
                      "c1-3": "preempted"}
    assert a.describe("nobody") == []


def test_terminate_deletes_only_the_named_vms_with_their_nic_and_disk(fake):
    a = api()
    launch(a, spec())
    fake.lro_seconds = 0.5  # deletes take a while: terminate does not wait
    a.terminate("c1", ["c1-0"])
    assert {v.node: v.state for v in a.describe("c1")}["c1-0"] == "stopping"
    fake.wait()
    assert [v.node for v in a.describe("c1")] == ["c1-1"]
    assert kinds_in(fake, "hyper-c1") == ["disks", "networkInterfaces",
                                          "networkSecurityGroups", "publicIPAddresses",
                                          "publicIPAddresses", "virtualMachines",
                                          "virtualNetworks"]


def test_teardown_deletes_the_group_and_gc_finds_other_clusters(fake):
    a = api()
    launch(a, spec())
    launch(a, spec(cluster="other"), nodes=("other-0",))
    fake.page_size = 1  # groups and resources come in pages
    held = a.resources("c1")
    assert [r.kind for r in held] == ["instance"] * 2 + ["nic"] * 2 + ["public_ip"] * 2 + [
        "disk"] * 2 + ["security_group", "network", "resource_group"]
    assert {r.cluster for r in held} == {"c1"} and {r.region for r in held} == {"eastus"}
    removed = remove_all(a, "c1")
    assert "resource_group hyper-c1" in removed and "instance c1-0" in removed
    assert len(removed) == len(held)
    assert "hyper-c1" not in fake.groups and fake.resources_in("hyper-c1") == []
    assert any("forceDeletionTypes=Microsoft.Compute" in p for m, p, _ in fake.requests
               if m == "DELETE")
    assert a.resources("c1") == [] and a.describe("c1") == []
    assert {r.cluster for r in a.resources(None)} == {"other"}
    assert a.delete(held) == []  # already gone
    remove_all(a, None)
    assert fake.groups == {} and fake.res == {}


# -- identities: each VM's own (self-deletion), the cluster's storage identity (containers) --
import json  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

from hypercli.providers.azure import identity_name  # noqa: E402
from hypercli.providers.cloud import IdentityConflict  # noqa: E402
from hypercli.recipe.access import Grant  # noqa: E402

GRANTS = (Grant("az", "acct/data", "datasets/coco"),
          Grant("az", "acct/out", "runs/wf1", write=True))
MSI = ("/subscriptions/sub-1/resourceGroups/hyper-c1/providers/"
       f"Microsoft.ManagedIdentity/userAssignedIdentities/{identity_name(spec())}")
BLOB = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs"


def principal(fake, rid=MSI) -> str:
    return fake.res[rid.lower()]["properties"]["principalId"]


def storage_assignments(fake) -> dict[str, tuple[tuple, bool]]:
    """container scope tail → ((actions, data actions) of its role, has a condition)."""
    return {a["properties"]["scope"].split("/containers/")[1]:
            (fake.role(a["properties"]["roleDefinitionId"].rsplit("/", 1)[1]),
             bool(a["properties"].get("condition")))
            for a in fake.assignments.values() if "/containers/" in a["properties"]["scope"]}


def test_nodes_carry_their_own_identity_and_the_clusters_storage_identity(fake):
    acct = fake.add_account("acct")
    fake.add_account("other")
    vms, errors = launch(api(), spec(grants=GRANTS))
    assert errors == {} and len(vms) == 2
    for _, body in vm_puts(fake):
        assert body["identity"] == {"type": "SystemAssigned, UserAssigned",
                                    "userAssignedIdentities": {MSI: {}}}
    read = (set(), {f"{BLOB}/read"})
    write = (set(), {f"{BLOB}/{a}" for a in ("read", "write", "add/action", "delete")})
    # custom roles: blob data only, no container right (delete it, make it public)
    assert storage_assignments(fake) == {"data": (read, True), "out": (write, True)}
    for a in fake.assignments.values():
        if "/containers/" in a["properties"]["scope"]:
            assert a["properties"]["scope"].startswith(acct + "/blobServices/default/")
            assert a["properties"]["conditionVersion"] == "2.0"
    pid = principal(fake)
    may = fake.allowed
    assert may(pid, "acct", "data", "read", "datasets/coco/chunks/0001")
    assert not may(pid, "acct", "data", "read", "datasets/cocoa/x")
    assert not may(pid, "acct", "data", "read", "secret/x")
    assert not may(pid, "acct", "data", "write", "datasets/coco/x")
    assert may(pid, "acct", "data", "read", list_prefix="datasets/coco/")
    assert not may(pid, "acct", "data", "read", list_prefix="")
    assert may(pid, "acct", "out", "write", "runs/wf1/t1/out.txt")
    assert not may(pid, "acct", "out", "read", "runs/wf0/t3/out.txt")  # another workflow
    assert not may(pid, "acct", "out", "write", "elsewhere/x")
    assert not may(pid, "other", "data", "read", "datasets/coco/x")
    container = f"{acct}/blobServices/default/containers/out"
    for action in ("delete", "write"):
        assert not fake.may(pid, f"Microsoft.Storage/storageAccounts/blobServices/containers/"
                                 f"{action}", container)
    # the storage identity has no other right: nothing on the group, no VM
    assert {a["properties"]["scope"].split("/")[-2] for a in fake.assignments.values()
            if a["properties"]["principalId"] == pid} == {"containers"}
    # its client id reaches the nodes' SDK
    prepared = api().prepare(spec(grants=GRANTS), KEY)
    assert prepared["node_env"] == {
        "AZURE_CLIENT_ID": fake.res[MSI.lower()]["properties"]["clientId"]}


def test_storage_assignments_are_exactly_the_grants(fake):
    fake.add_account("acct")
    a = api()
    launch(a, spec(grants=GRANTS))
    n = len(fake.assignments)
    assert a.identity(spec(grants=GRANTS))["identity"] == MSI
    assert len(fake.assignments) == n
    pid = principal(fake)
    theirs = (f"/subscriptions/sub-1/resourceGroups/data-rg/providers/Microsoft.Storage/"
              f"storageAccounts/acct/providers/Microsoft.Authorization/roleAssignments/"
              f"11111111-2222-3333-4444-555555555555")
    fake.identity_handle("PUT", theirs, {}, {"properties": {
        "roleDefinitionId": "/subscriptions/sub-1/providers/Microsoft.Authorization/"
        "roleDefinitions/2a2b9908-6ea1-4ae2-8e65-a410df84e7d1", "principalId": pid}})
    later = (GRANTS[0], Grant("az", "acct/data", "datasets/imagenet"),
             Grant("az", "acct/out", "runs/wf2", write=True))
    # a role someone gave the cluster's identity: refused (the nodes would hold more than
    # the grants), and never deleted by hypercli
    with pytest.raises(IdentityConflict, match="did not make"):
        a.identity(spec(grants=later))
    assert theirs.lower() in fake.assignments and len(fake.assignments) == n + 1
    del fake.assignments[theirs.lower()]
    a.identity(spec(grants=later))
    assert fake.allowed(pid, "acct", "data", "read", "datasets/imagenet/x")
    assert fake.allowed(pid, "acct", "data", "read", "datasets/coco/x")  # kept
    assert fake.allowed(pid, "acct", "out", "write", "runs/wf2/x")
    assert not fake.allowed(pid, "acct", "out", "write", "runs/wf1/x")  # an ended workflow


@pytest.mark.parametrize("permission", [
    "Microsoft.Authorization/roleAssignments/write",
    "Microsoft.Authorization/roleDefinitions/write",
    "Microsoft.ManagedIdentity/userAssignedIdentities/write"])
def test_a_caller_who_may_not_make_the_identity_is_stopped_before_any_vm(fake, permission):
    fake.add_account("acct")
    fake.deny.add(permission)
    with pytest.raises(CredentialsError) as e:
        launch(api(), spec(grants=GRANTS))
    assert permission in str(e.value) and "cluster.identity" in e.value.hint
    assert vm_puts(fake) == []
    assert not [r for r in fake.res.values() if r["type"] != "Microsoft.ManagedIdentity/"
                "userAssignedIdentities"]


def test_a_named_identity_is_used_as_is(fake):
    fake.add_account("acct")
    a = api()
    a.prepare(spec(), KEY)  # the group, so that the named identity can live somewhere
    mine = ("/subscriptions/sub-1/resourceGroups/hyper-c1/providers/"
            "Microsoft.ManagedIdentity/userAssignedIdentities/trainer")
    fake.identity_handle("PUT", mine, {}, {"location": "eastus"})
    fake.requests.clear()
    vms, errors = launch(a, spec(grants=GRANTS, identity=mine))
    assert errors == {} and len(vms) == 2
    assert [b["identity"]["userAssignedIdentities"] for _, b in vm_puts(fake)] == [{mine: {}}] * 2
    assert [a["properties"]["scope"].rsplit("/", 2)[-2] for a in fake.assignments.values()] \
        == ["virtualMachines"] * 2  # only each VM's own self-deletion
    assert not [p for m, p, _ in fake.requests if "userAssignedIdentities/" in p and m == "PUT"]
    assert a.identity(spec(identity=mine))["node_env"] == {
        "AZURE_CLIENT_ID": fake.res[mine.lower()]["properties"]["clientId"]}


def test_an_unknown_storage_account_is_a_usage_error(fake):
    with pytest.raises(UsageError, match="storage account acct"):
        launch(api(), spec(grants=GRANTS))
    assert vm_puts(fake) == []


def test_down_removes_the_identity_and_the_role_assignments_hypercli_made(fake):
    fake.add_account("acct")
    a = api()
    launch(a, spec(grants=GRANTS))
    launch(a, spec(cluster="c2", grants=GRANTS[:1]), nodes=("c2-0",))
    assert "identity" in [r.kind for r in a.resources("c1")]
    pid = principal(fake)
    other = principal(fake, f"/subscriptions/sub-1/resourceGroups/hyper-c2/providers/"
                            f"Microsoft.ManagedIdentity/userAssignedIdentities/"
                            f"{identity_name(spec(cluster='c2'))}")
    vm_principals = {fake.vm("hyper-c1", n)["identity"]["principalId"] for n in ("c1-0", "c1-1")}
    remove_all(a, "c1")
    assert not [x for x in fake.assignments.values()
                if x["properties"]["principalId"] in vm_principals | {pid}]
    assert fake.allowed(other, "acct", "data", "read", "datasets/coco/x")
    assert MSI.lower() not in fake.res
    remove_all(a, None)
    assert fake.assignments == {}


def _put_group(fake, name: str, tags: dict) -> None:
    fake.groups[name.lower()] = {"id": f"/subscriptions/sub-1/resourceGroups/{name}",
                                 "name": name, "type": "Microsoft.Resources/resourceGroups",
                                 "location": "eastus", "tags": dict(tags),
                                 "properties": {"provisioningState": "Succeeded"}}


def test_a_group_hypercli_did_not_make_is_refused_unless_adopted_and_never_deleted(fake):
    """A shared resource_group: hyper up refuses it (exit 2) and changes nothing; with
    adopt_group it is used as it is, its tags untouched; down removes what hypercli made in it
    and nothing else: not the group, not its other resources or role assignments."""
    fake.add_account("acct")
    _put_group(fake, "team-rg", {"owner": "ml-team"})
    a = api()
    with pytest.raises(UsageError, match="team-rg") as e:
        launch(a, spec(resource_group="team-rg"))
    assert e.value.exit_code == 2 and "adopt_group" in e.value.hint
    assert fake.resources_in("team-rg") == [] and fake.groups["team-rg"]["tags"] == {
        "owner": "ml-team"}
    # someone's own network security group, and a group made for another cluster
    fake.res[("/subscriptions/sub-1/resourceGroups/team-rg/providers/Microsoft.Network/"
              "networkSecurityGroups/keep-me").lower()] = {
        "id": "/subscriptions/sub-1/resourceGroups/team-rg/providers/Microsoft.Network/"
              "networkSecurityGroups/keep-me", "name": "keep-me",
        "type": "Microsoft.Network/networkSecurityGroups", "location": "eastus", "tags": {},
        "properties": {"securityRules": [], "provisioningState": "Succeeded"}}
    _put_group(fake, "hyper-c3", {"hyper:cluster": "c3", "hyper:cluster-id": "00000000"})
    with pytest.raises(UsageError, match="cluster c3's"):
        launch(a, spec(cluster="c4", resource_group="hyper-c3"))
    vms, errors = launch(a, spec(resource_group="team-rg", adopt_group=True, grants=GRANTS))
    assert errors == {} and len(vms) == 2
    assert fake.groups["team-rg"]["tags"] == {"owner": "ml-team"}
    assert {v.node for v in a.describe("c1")} == {"c1-0", "c1-1"}
    held = a.resources("c1")
    assert "resource_group" not in [r.kind for r in held]
    remove_all(a, "c1")
    assert "team-rg" in fake.groups
    assert [r["name"] for r in fake.resources_in("team-rg")] == ["keep-me"]
    assert not [x for x in fake.assignments.values()
                if "/virtualMachines/" in x["properties"]["scope"]]


def test_identity_names_never_collide_and_a_squatted_identity_is_refused(fake):
    long = "ml-team-experiments-2026-" + "x" * 120
    names = {identity_name(spec(cluster=c, cluster_id=i)) for c, i in
             ((long + "-gpu", "a"), (long + "-cpu", "b"), ("Team", "c"), ("team", "d"))}
    assert len({n.lower() for n in names}) == 4 and all(len(n) <= 128 for n in names)
    fake.add_account("acct")
    a = api()
    a.prepare(spec(), KEY)
    fake.identity_handle("PUT", MSI, {}, {"location": "eastus", "tags": {
        "hyper:cluster": "c1", "hyper:cluster-id": spec().tag}})
    fake.fics[MSI.lower()] = [{"name": "github-actions", "properties": {
        "issuer": "https://token.actions.githubusercontent.com", "subject": "repo:x/y"}}]
    with pytest.raises(IdentityConflict, match="federated") as e:
        launch(a, spec(grants=GRANTS))
    assert e.value.exit_code == 2 and vm_puts(fake) == []
    fake.fics.clear()
    fake.res[MSI.lower()]["tags"] = {"hyper:cluster": "someone-else"}
    with pytest.raises(IdentityConflict, match="tags"):
        a.identity(spec(grants=GRANTS))
    # tagged right, but holding a role someone gave it: every task would hold it too
    fake.res[MSI.lower()]["tags"] = {"hyper:cluster": "c1", "hyper:cluster-id": spec().tag}
    theirs = ("/subscriptions/sub-1/providers/Microsoft.Authorization/roleAssignments/"
              "33333333-3333-3333-3333-333333333333")
    fake.identity_handle("PUT", theirs, {}, {"properties": {
        "roleDefinitionId": "/subscriptions/sub-1/providers/Microsoft.Authorization/"
        "roleDefinitions/9980e02c-c2be-4d73-94e8-173b1dc7cf3c",  # VM Contributor
        "principalId": principal(fake)}})
    with pytest.raises(IdentityConflict, match="did not make") as e:
        launch(a, spec(grants=GRANTS))
    assert "9980e02c-c2be-4d73-94e8-173b1dc7cf3c on /subscriptions/sub-1" in str(e.value)
    assert vm_puts(fake) == [] and theirs.lower() in fake.assignments  # refused, untouched
    del fake.assignments[theirs.lower()]
    assert a.identity(spec(grants=GRANTS))["identity"] == MSI  # as hypercli leaves it
    assert a.identity(spec(grants=GRANTS))["identity"] == MSI  # its own assignments pass


def _as_node(fake, token: str, method: str, path: str, body: dict | None = None) -> int:
    """HTTP status of a Resource Manager call made with a node's token."""
    import ssl
    ctx = ssl.create_default_context(cafile=str(fake.ca))
    sep = "&" if "?" in path else "?"
    req = urllib.request.Request(f"{fake.url}{path}{sep}api-version=2023-03-01",
                                 method=method, headers={"Authorization": f"Bearer {token}",
                                                         "Content-Type": "application/json"},
                                 data=json.dumps(body).encode() if body is not None else None)
    try:
        with urllib.request.urlopen(req, timeout=10, context=ctx) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_vms_own_token_deletes_its_own_vm_and_nothing_else(fake, monkeypatch):
    """From the token a task on c1-0 can get from IMDS (its VM's own identity, no client
    id): a sibling, another cluster's VM, a command on a sibling, its own tags (to survive
    down), the storage account's keys: each refused; deleting itself, as the idle watchdog
    does: allowed."""
    fake.add_account("acct")
    a = api()
    launch(a, spec(grants=GRANTS))
    launch(a, spec(cluster="c2"), nodes=("c2-0",))
    me = fake.vm("hyper-c1", "c1-0")["identity"]["principalId"]
    fake.principal_tokens["node-token"] = me
    vms = "/subscriptions/sub-1/resourceGroups/{}/providers/Microsoft.Compute/virtualMachines"
    refused = {
        "delete a sibling": ("DELETE", f"{vms.format('hyper-c1')}/c1-1", None),
        "delete another cluster's VM": ("DELETE", f"{vms.format('hyper-c2')}/c2-0", None),
        "run a command on a sibling": ("POST", f"{vms.format('hyper-c1')}/c1-1/runCommand",
                                       {"commandId": "RunShellScript"}),
        "retag itself": ("PUT", f"{vms.format('hyper-c1')}/c1-0",
                         {"location": "eastus", "tags": {}}),
        "list the storage account's keys": (
            "POST", "/subscriptions/sub-1/resourceGroups/data-rg/providers/"
                    "Microsoft.Storage/storageAccounts/acct/listKeys", None),
        "make a VM": ("PUT", f"{vms.format('hyper-c1')}/evil", {"location": "eastus"}),
        "give itself a role": ("PUT", "/subscriptions/sub-1/providers/Microsoft.Authorization/"
                               "roleAssignments/22222222-2222-2222-2222-222222222222",
                               {"properties": {}}),
    }
    for what, (method, path, body) in refused.items():
        assert _as_node(fake, "node-token", method, path, body) == 403, what
    assert _as_node(fake, "node-token", "GET", f"{vms.format('hyper-c1')}/c1-0") == 200
    assert {v.node for v in a.describe("c1")} == {"c1-0", "c1-1"}
    from hypercli.node import watch
    from tokenstandins import MetadataServer
    md = MetadataServer("node-token", instance={
        "subscriptionId": "sub-1", "resourceGroupName": "hyper-c1", "name": "c1-0"})
    monkeypatch.setenv("SSL_CERT_FILE", str(fake.ca))
    try:
        assert watch.self_delete("azure", f"http://{md.host}", api=fake.url)
    finally:
        md.close()
    fake.wait()
    assert {v.node for v in a.describe("c1")} == {"c1-1"}
    assert {v.node for v in a.describe("c2")} == {"c2-0"}


def test_custom_roles_found_with_more_rights_are_corrected_before_anyone_holds_them(fake):
    """hypercli's custom role definitions (names fixed per subscription) found with more
    than they should hold (every VM action for ``self-delete``, container rights for
    ``blob-writer``) are set back before any assignment: a VM's own token still may not
    run commands on itself, the storage identity still may not delete the container."""
    import uuid
    acct = fake.add_account("acct")
    for kind, actions, data in (
            ("self-delete", ["Microsoft.Compute/virtualMachines/*"], []),
            ("blob-writer", ["Microsoft.Storage/storageAccounts/blobServices/containers/*"],
             [f"{BLOB}/*"])):
        guid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"hypercli|sub-1|{kind}"))
        fake.role_defs[guid] = {
            "roleName": f"hypercli {kind} (sub-1)", "type": "CustomRole",
            "assignableScopes": ["/subscriptions/sub-1"],
            "permissions": [{"actions": actions, "notActions": [], "dataActions": data,
                             "notDataActions": []}]}
    a = api()
    launch(a, spec(grants=GRANTS))
    me = fake.vm("hyper-c1", "c1-0")["identity"]["principalId"]
    vm = "/subscriptions/sub-1/resourceGroups/hyper-c1/providers/Microsoft.Compute/" \
         "virtualMachines/c1-0"
    assert not fake.may(me, "Microsoft.Compute/virtualMachines/runCommand/action", vm)
    assert not fake.may(me, "Microsoft.Compute/virtualMachines/write", vm)
    assert fake.may(me, "Microsoft.Compute/virtualMachines/delete", vm)
    fake.principal_tokens["node-token"] = me
    assert _as_node(fake, "node-token", "POST", f"{vm}/runCommand",
                    {"commandId": "RunShellScript"}) == 403
    container = f"{acct}/blobServices/default/containers/out"
    pid = principal(fake)
    assert not fake.may(pid, "Microsoft.Storage/storageAccounts/blobServices/containers/"
                             "delete", container)
    assert fake.allowed(pid, "acct", "out", "write", "runs/wf1/x")
    assert not fake.allowed(pid, "acct", "out", "write", "elsewhere/x")


def test_a_group_hypercli_made_that_holds_what_it_did_not_make_is_kept_with_it(fake, caplog):
    """Someone put a storage account of their own (their datasets) into the cluster's group,
    and another cluster adopted the group for a VM: `down` removes the cluster's own
    resources one by one and keeps the group with the rest, saying so; once the group
    holds only the cluster's, `down` deletes it."""
    a = api()
    launch(a, spec())
    mine = ("/subscriptions/sub-1/resourceGroups/hyper-c1/providers/Microsoft.Storage/"
            "storageAccounts/teamdata")
    fake.res[mine.lower()] = {"id": mine, "name": "teamdata",
                              "type": "Microsoft.Storage/storageAccounts",
                              "location": "eastus", "tags": {"owner": "ml-team"},
                              "properties": {"provisioningState": "Succeeded"}}
    launch(a, spec(cluster="c5", resource_group="hyper-c1", adopt_group=True),
           nodes=("c5-0",))
    held = a.resources("c1")
    assert "resource_group" not in [r.kind for r in held]
    assert not [r for r in held if "teamdata" in r.id or "c5-0" in r.id]
    remove_all(a, "c1")
    assert "hyper-c1" in fake.groups and "keeps" not in caplog.text
    assert "teamdata" in caplog.text and "the group stays" in caplog.text
    left = sorted(r["name"] for r in fake.resources_in("hyper-c1"))
    assert "teamdata" in left and "c5-0" in left
    assert not [n for n in left if n.startswith("c1-") or n.startswith("hyper-c1-")]
    assert {v.node for v in a.describe("c5")} == {"c5-0"}  # the other cluster's VM runs
    remove_all(a, "c5")
    del fake.res[mine.lower()]
    remove_all(a, "c1")
    assert "hyper-c1" not in fake.groups
