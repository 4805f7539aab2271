"""The azure CloudAPI (hypercli/providers/azure.py) through the real azure-mgmt clients against
a local TLS stand-in for Azure Resource Manager (tests/azurefake.py): spot and regular VMs in a
resource group with network, security group, public IPs and NICs, long-running operations, zone
failover on SkuNotAvailable, quota and auth errors, teardown by resource group, and gc."""

from __future__ import annotations

import base64
import time

import pytest

pytest.importorskip("azure.mgmt.compute")

from azure.core.credentials import AccessToken  # noqa: E402

from azurefake import ArmFake  # noqa: E402
from hypercli.errors import UsageError  # noqa: E402
from hypercli.providers.azure import AzureAPI  # noqa: E402
from hypercli.providers.cloud import (Boot, CapacityError, CloudSpec,  # noqa: E402
                                      CredentialsError, QuotaError)
from hypercli.providers.cloud_provider import remove_all  # noqa: E402

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl hyper-c1"
URN = "Canonical:ubuntu-24_04-lts:server:latest"


class Token:
    """A TokenCredential that hands out a fixed token (the stand-in checks none)."""

    def get_token(self, *scopes, **kw):
        return AccessToken("token", int(time.time()) + 3600)


@pytest.fixture
def fake(monkeypatch, tmp_path):
    f = ArmFake(tmp_path)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", f.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(f.ca))
    try:
        yield f
    finally:
        f.close()


def api() -> AzureAPI:
    return AzureAPI("sub-1", "eastus", credential=Token())


def spec(**kw) -> CloudSpec:
    base = dict(cluster="c1", count=2, region="eastus", instance_type="Standard_D4s_v5",
                image=URN, ssh_cidr="203.0.113.0/24", disk_gb=64, max_price=0.05)
    base.update(kw)
    return CloudSpec(**base)


def launch(a, s, nodes=("c1-0", "c1-1")):
    boot = Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root", KEY)
    return a.create(s, list(nodes), boot, a.prepare(s, KEY))


def vm_puts(fake) -> list[tuple[str, dict]]:
    return [(p, b) for m, p, b in fake.requests
            if m == "PUT" and "/virtualMachines/" in p]


def test_spot_vms_in_their_resource_group(fake):
    a = api()
    vms, errors = launch(a, spec())
    assert errors == {} and sorted(v.node for v in vms) == ["c1-0", "c1-1"]
    assert all(v.spot and v.public_ip for v in vms)
    path, body = vm_puts(fake)[0]
    assert "/resourceGroups/hyper-c1/" in path
    props = body["properties"]
    assert props["priority"] == "Spot" and props["evictionPolicy"] == "Delete"
    assert props["billingProfile"] == {"maxPrice": 0.05}
    assert base64.b64decode(props["osProfile"]["customData"]).decode() == "#cloud-config\n# c1-0\n"
    assert props["osProfile"]["linuxConfiguration"]["disablePasswordAuthentication"] is True
    assert props["storageProfile"]["osDisk"]["diskSizeGB"] == 64
    assert props["storageProfile"]["osDisk"]["deleteOption"] == "Delete"
    assert props["storageProfile"]["imageReference"]["offer"] == "ubuntu-24_04-lts"
    assert body["tags"]["hyper:cluster"] == "c1" and body["tags"]["hyper:node"] == "c1-0"
    assert body["identity"] == {"type": "SystemAssigned"}
    # each VM's identity may delete VMs of its group (the idle watchdog deletes itself)
    assert len(fake.role_assignments) == 2
    ra = fake.role_assignments[0]["properties"]
    assert ra["roleDefinitionId"].endswith("9980e02c-c2be-4d73-94e8-173b1dc7cf3c")
    assert ra["principalId"].startswith("principal-")
    group = fake.groups["hyper-c1"]
    assert group["tags"]["hyper:cluster"] == "c1"
    kinds = sorted(r["type"].rsplit("/", 1)[1] for r in fake.resources_in("hyper-c1"))
    assert kinds == ["networkInterfaces"] * 2 + ["networkSecurityGroups"] + \
        ["publicIPAddresses"] * 2 + ["virtualMachines"] * 2 + ["virtualNetworks"]
    assert sorted(v.node for v in a.describe("c1")) == ["c1-0", "c1-1"]
    assert {v.state for v in a.describe("c1")} == {"running"}


def test_regular_vm(fake):
    vms, _ = launch(api(), spec(spot=False), nodes=("c1-0",))
    assert vm_puts(fake)[0][1]["properties"]["priority"] == "Regular" and not vms[0].spot


def test_security_group_admits_ssh_from_the_cidr_only(fake):
    api().prepare(spec(), KEY)
    [nsg] = [b for m, p, b in fake.requests if m == "PUT" and "networkSecurityGroups" in p]
    [rule] = nsg["properties"]["securityRules"]
    p = rule["properties"]
    assert (p["sourceAddressPrefix"], p["destinationPortRange"], p["protocol"],
            p["access"], p["direction"]) == ("203.0.113.0/24", "22", "Tcp", "Allow", "Inbound")


def test_zone_failover_on_sku_not_available(fake):
    fake.no_sku_in("1")
    vms, errors = launch(api(), spec(zones=("1", "2"), count=1), nodes=("c1-0",))
    assert errors == {} and vms[0].zone == "2"
    assert [b["zones"] for _, b in vm_puts(fake)] == [["1"], ["2"]]


def test_no_sku_anywhere_is_a_capacity_error_and_cleans_up(fake):
    fake.no_sku_in("*")
    vms, errors = launch(api(), spec(zones=("1", "2"), count=1), nodes=("c1-0",))
    assert vms == [] and isinstance(errors["c1-0"], CapacityError)
    assert "SkuNotAvailable" in str(errors["c1-0"])
    left = {r["type"].rsplit("/", 1)[1] for r in fake.resources_in("hyper-c1")}
    assert "networkInterfaces" not in left and "publicIPAddresses" not in left


def test_quota_is_not_retried(fake):
    fake.quota = True
    _, errors = launch(api(), spec(zones=("1", "2"), count=1), nodes=("c1-0",))
    assert isinstance(errors["c1-0"], QuotaError) and len(vm_puts(fake)) == 1


def test_auth_failure_says_how_to_configure(fake):
    fake.auth_fail = True
    with pytest.raises(CredentialsError) as e:
        api().check()
    assert "az login" in e.value.hint


def test_missing_subscription(fake, monkeypatch):
    monkeypatch.delenv("AZURE_SUBSCRIPTION_ID", raising=False)
    with pytest.raises(CredentialsError, match="no Azure subscription"):
        AzureAPI(None, "eastus", credential=Token()).check()


def test_image_lookup(fake):
    a = api()
    with pytest.raises(UsageError) as e:
        a.find_image(spec(image=None))
    assert "hyper image build --provider azure" in e.value.hint
    tags = {"hyper:image": "node", "hyper:variant": "cpu"}
    fake.add_image("hyper-node-cpu-1-202601010000", tags)
    fake.add_image("hyper-node-cpu-1-202606010000", tags)
    assert a.find_image(spec(image=None)).endswith("hyper-node-cpu-1-202606010000")
    with pytest.raises(UsageError, match="PUBLISHER:OFFER:SKU:VERSION"):
        a.find_image(spec(image="not-an-urn"))


def test_teardown_deletes_the_group_and_gc_the_rest(fake):
    a = api()
    launch(a, spec())
    launch(a, spec(cluster="other", count=1), nodes=("other-0",))
    removed = remove_all(a, "c1")
    assert "resource_group hyper-c1" in removed and "virtualMachines c1-0" in removed
    assert "hyper-c1" not in fake.groups and fake.resources_in("hyper-c1") == []
    assert a.resources("c1") == []
    assert {r.cluster for r in a.resources(None)} == {"other"}
    remove_all(a, None)
    assert fake.groups == {}
