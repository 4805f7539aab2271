"""The gcp CloudAPI (hypercli/providers/gcp.py) through the real google-cloud-compute client
against a local stand-in for the Compute Engine REST API (tests/gcpfake.py): spot and standard
instances, labels, ssh-keys and user-data metadata, the SSH firewall rule, operation waits,
zone failover on resource exhaustion, quota and auth errors, image lookup, teardown and gc."""

from __future__ import annotations

import pytest

pytest.importorskip("google.cloud.compute_v1")

from gcpfake import ComputeFake  # noqa: E402
from hypercli.errors import UsageError  # noqa: E402
from hypercli.providers.cloud import (Boot, CapacityError, CloudSpec,  # noqa: E402
                                      CredentialsError, QuotaError)
from hypercli.providers.cloud_provider import remove_all  # noqa: E402
from hypercli.providers.gcp import GCPAPI, gce_name  # noqa: E402

IMAGE = "projects/proj/global/images/hyper-node-cpu-1-1"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl hyper-c1"


@pytest.fixture
def fake(monkeypatch):
    f = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", f.url)
    try:
        yield f
    finally:
        f.close()


def spec(**kw) -> CloudSpec:
    base = dict(cluster="c1", count=2, region="us-central1", instance_type="e2-standard-4",
                image=IMAGE, ssh_cidr="203.0.113.0/24", disk_gb=30)
    base.update(kw)
    return CloudSpec(**base)


def launch(api, s, nodes=("c1-0", "c1-1")):
    boot = Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root", KEY)
    return api.create(s, list(nodes), boot, api.prepare(s, KEY))


def inserted(fake) -> list[dict]:
    return [b for m, p, b in fake.requests if m == "POST" and p.endswith("/instances")]


def test_spot_instances_with_labels_metadata_disk_and_operation_waits(fake):
    api = GCPAPI("proj", "us-central1")
    vms, errors = launch(api, spec())
    assert errors == {} and sorted(v.node for v in vms) == ["c1-0", "c1-1"]
    assert all(v.state == "running" and v.spot and v.public_ip for v in vms)
    body = inserted(fake)[0]
    assert body["scheduling"]["provisioningModel"] == "SPOT"
    assert body["scheduling"]["instanceTerminationAction"] == "DELETE"
    assert body["labels"]["hyper-cluster"] == "c1" and body["labels"]["hyper-node"] == "c1-0"
    meta = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert meta["ssh-keys"] == f"root:{KEY}" and meta["user-data"] == "#cloud-config\n# c1-0\n"
    disk = body["disks"][0]
    assert disk["autoDelete"] and disk["initializeParams"]["diskSizeGb"] == "30"
    assert disk["initializeParams"]["sourceImage"] == IMAGE
    [sa] = body["serviceAccounts"]  # the idle watchdog deletes its instance with it
    assert sa["email"] == "default" and sa["scopes"] == ["https://www.googleapis.com/auth/compute"]
    waits = [p for m, p, _ in fake.requests if p.endswith("/wait")]
    assert len(waits) >= 3  # the firewall and both inserts were waited for
    assert [v.node for v in api.describe("c1")] == ["c1-0", "c1-1"]


def test_standard_instances(fake):
    vms, _ = launch(GCPAPI("proj", "us-central1"), spec(spot=False), nodes=("c1-0",))
    assert inserted(fake)[0]["scheduling"]["provisioningModel"] == "STANDARD"
    assert not vms[0].spot


def test_firewall_admits_ssh_from_the_cidr_only_and_is_made_once(fake):
    api = GCPAPI("proj", "us-central1")
    api.prepare(spec(), KEY)
    api.prepare(spec(), KEY)
    [fw] = fake.firewalls.values()
    assert fw["sourceRanges"] == ["203.0.113.0/24"]
    assert fw["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}]
    assert fw["targetTags"] == ["hyper-c1"] and "hyper:cluster=c1" in fw["description"]


def test_zone_failover_on_exhaustion(fake):
    fake.exhaust("us-central1-a")
    vms, errors = launch(GCPAPI("proj", "us-central1"), spec(count=1), nodes=("c1-0",))
    assert errors == {} and vms[0].zone == "us-central1-b"
    zones = [p.split("/zones/")[1].split("/")[0] for m, p, _ in fake.requests
             if m == "POST" and p.endswith("/instances")]
    assert zones == ["us-central1-a", "us-central1-b"]


def test_every_zone_exhausted_is_a_capacity_error_per_node(fake):
    for z in fake.zones:
        fake.exhaust(z)
    vms, errors = launch(GCPAPI("proj", "us-central1"), spec())
    assert vms == [] and all(isinstance(e, CapacityError) for e in errors.values())
    assert "ZONE_RESOURCE_POOL_EXHAUSTED" in str(errors["c1-0"])


def test_quota_exceeded_is_not_retried(fake):
    fake.quota = True
    _, errors = launch(GCPAPI("proj", "us-central1"), spec(count=1), nodes=("c1-0",))
    assert isinstance(errors["c1-0"], QuotaError)
    assert len(inserted(fake)) == 1


def test_auth_failure_says_how_to_configure(fake):
    fake.auth_fail = True
    with pytest.raises(CredentialsError) as e:
        GCPAPI("proj", "us-central1").check()
    assert "gcloud auth application-default login" in e.value.hint


def test_missing_project_is_a_clear_error(fake, monkeypatch):
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT", raising=False)
    with pytest.raises(CredentialsError, match="no Google Cloud project"):
        GCPAPI(None, "us-central1").check()


def test_image_lookup_newest_baked_and_missing(fake):
    api = GCPAPI("proj", "us-central1")
    with pytest.raises(UsageError) as e:
        api.find_image(spec(image=None))
    assert "hyper image build --provider gcp" in e.value.hint
    labels = {"hyper-image": "node", "hyper-variant": "cpu"}
    fake.add_image("old", labels, "2026-01-01T00:00:00.000-00:00")
    fake.add_image("new", labels, "2026-06-01T00:00:00.000-00:00")
    fake.add_image("gpu", {**labels, "hyper-variant": "gpu"}, "2026-09-01T00:00:00.000-00:00")
    assert api.find_image(spec(image=None)).endswith("/global/images/new")
    assert api.find_image(spec(image="old")).endswith("/global/images/old")
    with pytest.raises(UsageError, match="does not exist"):
        api.find_image(spec(image="nope"))


def test_teardown_and_gc_leave_nothing(fake):
    api = GCPAPI("proj", "us-central1")
    launch(api, spec())
    launch(api, spec(cluster="other", count=1), nodes=("other-0",))
    kinds = {r.kind for r in api.resources("c1")}
    assert kinds == {"instance", "disk", "firewall"}
    removed = remove_all(api, "c1")
    assert "instance c1-0" in removed and any(x.startswith("firewall ") for x in removed)
    assert api.resources("c1") == [] and api.describe("c1") == []
    assert {r.cluster for r in api.resources(None)} == {"other"}
    remove_all(api, None)
    assert api.resources(None) == [] and not fake.firewalls


def test_names_are_valid_gce_names():
    assert gce_name("My_Cluster.1-0") == "my-cluster-1-0"
    assert gce_name("9lab-0") == "h-9lab-0"
