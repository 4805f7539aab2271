"""One contract, every cloud API (hypercli/providers/cloud.py's CloudAPI): aws on moto, gcp and
azure through their real clients against the local stand-ins. Each: prepare twice (idempotent),
create two nodes, describe them, list what the cluster holds, tear it all down with the same
loop as `hyper down`, and find nothing left. Every node records its private address, where the
cluster's other nodes reach it."""

from __future__ import annotations

import pytest

import ipaddress
import json

from hypercli.providers.cloud import VM, Boot, CloudSpec, Resource
from hypercli.providers.cloud_provider import node_info, remove_all
from hypercli.ssh.conn import Target

KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl hyper-k"


@pytest.fixture(params=["aws", "gcp", "azure"])
def cloud(request, monkeypatch, tmp_path):
    """(api, CloudSpec) of one cloud, its stand-in running."""
    name = request.param
    base = dict(cluster="k1", count=2, ssh_cidr="203.0.113.0/24", disk_gb=30)
    if name == "aws":
        moto = pytest.importorskip("moto")
        for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                     "AWS_DEFAULT_REGION": "us-east-1",
                     "AWS_EC2_METADATA_DISABLED": "true"}.items():
            monkeypatch.setenv(k, v)
        monkeypatch.delenv("HYPER_AWS_ENDPOINT_URL", raising=False)
        mock = moto.mock_aws()
        mock.start()
        request.addfinalizer(mock.stop)
        import boto3
        from hypercli.providers.aws import AWSAPI
        # an image of its own, not one of moto's default catalogue: moto keeps its backends
        # across mocks in one process (getmoto/moto#6592), so whether that catalogue is
        # loaded depends on the tests this process ran before (MOTO_EC2_LOAD_DEFAULT_AMIS)
        image = boto3.client("ec2", region_name="us-east-1").register_image(
            Name="hyper-contract", Architecture="x86_64")["ImageId"]
        return AWSAPI("us-east-1"), CloudSpec(region="us-east-1", instance_type="m5.large",
                                              image=image, **base)
    if name == "gcp":
        pytest.importorskip("google.cloud.compute_v1")
        from gcpfake import ComputeFake
        from hypercli.providers.gcp import GCPAPI
        fake = ComputeFake()
        request.addfinalizer(fake.close)
        monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
        return GCPAPI("proj", "us-central1"), CloudSpec(
            region="us-central1", instance_type="e2-standard-2",
            image="projects/proj/global/images/x", **base)
    pytest.importorskip("azure.mgmt.compute")
    from azurefake import ArmFake
    from test_azure import Token
    from hypercli.providers.azure import AzureAPI
    fake = ArmFake(tmp_path)
    request.addfinalizer(fake.close)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", fake.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(fake.ca))
    return AzureAPI("sub-1", "eastus", credential=Token()), CloudSpec(
        region="eastus", instance_type="Standard_D2s_v5",
        image="Canonical:ubuntu-24_04-lts:server:latest", **base)


def test_cloud_api_contract(cloud):
    api, spec = cloud
    assert api.name in ("aws", "gcp", "azure")
    prepared = api.prepare(spec, KEY)
    assert api.prepare(spec, KEY).keys() == prepared.keys()  # idempotent
    nodes = ["k1-0", "k1-1"]
    boot = Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root", KEY)
    vms, errors = api.create(spec, nodes, boot, prepared)
    assert errors == {}
    assert all(isinstance(v, VM) for v in vms) and sorted(v.node for v in vms) == nodes
    seen = api.describe("k1")
    assert sorted(v.node for v in seen) == nodes
    assert {v.state for v in seen} <= {"pending", "running"} and all(v.spot for v in seen)
    held = api.resources("k1")
    assert all(isinstance(r, Resource) and r.cluster == "k1" for r in held)
    assert len(held) >= 3 and api.resources("nobody") == []
    assert isinstance(api.spot_price(spec), dict)
    assert api.find_image(spec) == spec.image
    removed = remove_all(api, "k1")
    assert len(removed) >= 3
    assert api.resources("k1") == [] and api.describe("k1") == []


def test_every_node_records_its_private_address(cloud, monkeypatch, tmp_path):
    api, spec = cloud
    nodes = ["k1-0", "k1-1"]
    boot = Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root", KEY)
    vms, errors = api.create(spec, nodes, boot, api.prepare(spec, KEY))
    assert errors == {}
    seen = {v.id: v for v in api.describe("k1")}
    monkeypatch.delenv("HYPER_CLOUD_ADDRESSES", raising=False)
    for vm in vms:
        target = Target(vm.public_ip or "192.0.2.1", 22, "root")
        info = node_info(api.name, spec, vm, target, {"cpus": 2})
        assert info["private_address"] == vm.private_ip == seen[vm.id].private_ip
        assert ipaddress.ip_address(info["private_address"]).is_private
        assert info["private_address"] != info["public_ip"] and info["cpus"] == 2
    # with the test seam naming an instance, the other nodes reach it at the seam's host
    seam = tmp_path / "addresses.json"
    seam.write_text(json.dumps({vms[0].id: "10.213.0.11:22"}))
    monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(seam))
    info = node_info(api.name, spec, vms[0], Target("10.213.0.11", 22, "root"), {})
    assert info["private_address"] == "10.213.0.11" and info["private_ip"] == vms[0].private_ip
    remove_all(api, "k1")


def test_an_ssh_node_records_the_host_it_was_reached_at(ssh_hosts, hyper_home):
    """The ssh provider's nodes have no cloud to ask: the address they were reached at is
    where the cluster's other nodes reach them (the cloud providers replace it above)."""
    from hypercli.providers.ssh import SSHProvider
    host = ssh_hosts.start(1)[0]
    prov = SSHProvider(trust_new_hosts=True)
    inst = prov.bootstrap("lab-0", Target(host.ip, host.port, "root",
                                          str(ssh_hosts.client_key)), "lab")
    try:
        assert inst.extra["private_address"] == host.ip == inst.address["host"]
        assert inst.extra["cpus"] >= 1  # what the agent reported is kept beside it
    finally:
        prov.drop("lab-0")
