"""One contract, every provider (hypercli/providers/base.py): launch a cluster of 2 nodes,
reach each node's agent, run a task through it, record the nodes, and take them down.
local runs on this machine, ssh on SSH test hosts; aws on moto's EC2 API, gcp and azure on
their local stand-ins, each with its instances booted onto SSH test hosts by
tests/cloudhosts.py's Booter (their cloud-config applied the way cloud-init would)."""

from __future__ import annotations

import base64
import dataclasses
import time

import pytest
import yaml

from hypercli import cluster as C
from hypercli.providers import get_provider
from hypercli.providers.base import Instance
from hypercli.recipe import parse_recipe
from hypercli.state import State

PROVIDERS = ["local", "ssh", "aws", "gcp", "azure"]


@pytest.fixture(params=PROVIDERS)
def made(request, tmp_path, hyper_home, monkeypatch):
    """(provider name, ClusterSpec, provider, cleanup check) for a 2-node cluster."""
    name = request.param
    extra = {}
    checks = []
    if name == "local":
        cluster = {"provider": "local", "workers": 2}
    else:
        pool = request.getfixturevalue("ssh_hosts")
        hosts = pool.start(2)
        if name == "ssh":
            cluster = {"provider": "ssh", "hosts": [h.address() for h in hosts],
                       "identity_file": str(pool.client_key)}
            extra["trust_new_hosts"] = True
        elif name == "gcp":
            pytest.importorskip("google.cloud.compute_v1")
            from cloudhosts import Booter, gcp_publisher, gcp_source
            from gcpfake import ComputeFake
            fake = ComputeFake()
            request.addfinalizer(fake.close)
            monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
            monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(tmp_path / "addresses.json"))
            booter = Booter(gcp_source(fake), hosts, tmp_path / "addresses.json",
                            publish=gcp_publisher(fake))
            booter.start()
            request.addfinalizer(lambda: (booter.stopping.set(), booter.join(10)))
            cluster = {"provider": "gcp", "project": "proj", "region": "us-central1",
                       "instance_type": "e2-standard-2", "workers": 2,
                       "image": "projects/proj/global/images/x", "ssh_cidr": "10.213.0.0/24"}
            checks.append(lambda: fake.instances == {z: {} for z in fake.zones}
                          and not fake.firewalls and not fake.service_accounts)
            checks.append(lambda: not [  # the nodes made their host keys: none in metadata
                b for m, p, b in fake.requests if m == "POST" and p.endswith("/instances")
                and "PRIVATE KEY" in str(b)] and fake.guest)
        elif name == "azure":
            pytest.importorskip("azure.mgmt.compute")
            from azurefake import ArmFake
            from cloudhosts import Booter, azure_source
            from test_azure import Token
            from hypercli.providers.azure import AzureAPI
            fake = ArmFake(tmp_path)
            request.addfinalizer(fake.close)
            monkeypatch.setenv("HYPER_AZURE_ENDPOINT", fake.url)
            monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(fake.ca))
            monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(tmp_path / "addresses.json"))
            booter = Booter(azure_source(fake), hosts, tmp_path / "addresses.json")
            booter.start()
            request.addfinalizer(lambda: (booter.stopping.set(), booter.join(10)))
            cluster = {"provider": "azure", "region": "eastus", "workers": 2,
                       "instance_type": "Standard_D2s_v5", "ssh_cidr": "10.213.0.0/24",
                       "image": "Canonical:ubuntu-24_04-lts:server:latest"}
            monkeypatch.setenv("HYPER_AZURE_TOKEN", "token")  # for `down`'s own client
            monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "sub-1")
            extra["api"] = AzureAPI("sub-1", "eastus", credential=Token())
            checks.append(lambda: fake.groups == {} and fake.res == {})
        else:
            from cloudhosts import REGION, Booter, tagged_left
            ec2 = request.getfixturevalue("aws")
            booter = Booter(ec2, hosts, tmp_path / "addresses.json")
            booter.start()
            request.addfinalizer(lambda: (booter.stopping.set(), booter.join(10)))
            image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
            cluster = {"provider": "aws", "region": REGION, "instance_type": "t3.micro",
                       "workers": 2, "image": image, "ssh_cidr": "10.213.0.0/24",
                       "spot": False}
            checks.append(lambda: tagged_left(ec2, "contract") == [])
    spec = parse_recipe(yaml.safe_dump({"name": "contract", "cluster": cluster,
                                        "experiments": {"a": {"command": "true"}}}),
                        path="contract.yaml").cluster
    if "api" in extra:  # a credential for the stand-in, where the SDK chain would look around
        from hypercli.providers.cloud_provider import CloudProvider
        provider = CloudProvider(name, options=spec.options, api=extra["api"])
    else:
        provider = get_provider(name, options=spec.options, **extra)
    return name, spec, provider, checks


@pytest.mark.slow
def test_provider_contract(made, tmp_path):
    name, spec, provider, checks = made
    assert provider.name == name and isinstance(provider.remote, bool)
    result = provider.launch(spec)
    assert result.errors == {}
    assert len(result.instances) == 2
    for inst in result.instances:
        assert isinstance(inst, Instance) and inst.slots >= 1 and inst.provider_id
        with pytest.raises(dataclasses.FrozenInstanceError):
            inst.slots = 5  # type: ignore[misc]
    state = State()
    nodes = C.up(state, spec, provider)
    assert sorted(n["name"] for n in nodes) == sorted(i.name for i in result.instances)
    wf = {"id": "contract-1", "storage": f"file://{tmp_path / 'storage'}", "workdir": "/",
          "spec": {}}
    for node in nodes:
        client = provider.connect(node)
        try:
            hello = client.call("hello")
            assert hello["cpus"] >= 1 and hello["version"] >= 1
            cwd, output, outputs = provider.task_paths(node, wf, "a-0000")
            assert output.startswith(outputs) and "a-0000" in output
            aid = f"contract-1.a-0000.{node['name']}"
            r = client.call("launch", attempts=[{
                "id": aid, "script": "echo contract-ok", "env": {}, "cwd": "/",
                "output": output, "outputs": outputs}])
            assert r["states"][aid]["state"] in ("running", "exited")
            end = time.monotonic() + 20
            while r["states"][aid]["state"] == "running" and time.monotonic() < end:
                r = client.call("poll", ids=[aid], wait=1)
            assert r["states"][aid]["state"] == "exited" and r["states"][aid]["code"] == 0
            out = client.call("read", id=aid, stream="stdout", offset=0)
            assert base64.b64decode(out["data"]) == b"contract-ok\n"
        finally:
            client.close()
    removed = C.down(state, "contract")
    assert isinstance(removed, list)
    assert {n["status"] for n in state.nodes("contract")} == {"down"}
    for check in checks:
        assert check()
