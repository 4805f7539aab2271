"""The gcp CloudAPI (hypercli/providers/gcp.py) through the real google-cloud-compute client
against a local stand-in for the Compute Engine REST API (tests/gcpfake.py): spot and standard
instances, labels, ssh-keys and boot metadata, the SSH and intra-cluster firewall rules (which
traffic they let in), operation waits, zone failover on resource exhaustion, quota and
credential errors, preemption, image lookup, teardown and gc."""

from __future__ import annotations

import pytest

pytest.importorskip("google.cloud.compute_v1")

from google.auth import exceptions as auth_exc  # noqa: E402
from google.auth.credentials import AnonymousCredentials, Credentials  # noqa: E402

from gcpfake import ComputeFake  # noqa: E402
from hypercli.errors import UsageError  # noqa: E402
from hypercli.providers.cloud import (Boot, CapacityError, CloudError,  # noqa: E402
                                      CloudSpec, CredentialsError, QuotaError)
from hypercli.providers.cloud_provider import remove_all  # noqa: E402
from hypercli.providers.gcp import GCPAPI, account_id, gce_name, label_value  # noqa: E402

IMAGE = "projects/proj/global/images/hyper-node-cpu-1-1"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl hyper-c1"
CONFIG = "#cloud-config\nssh_keys: {{}}\n# {}\n"
SCRIPT = "#!/bin/sh\necho {} > /etc/hyper-node\n"


@pytest.fixture
def fake(monkeypatch):
    f = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", f.url)
    try:
        yield f
    finally:
        f.close()


@pytest.fixture
def api(fake):
    return GCPAPI("proj", "us-central1", credentials=AnonymousCredentials())


def spec(**kw) -> CloudSpec:
    base = dict(cluster="c1", count=2, region="us-central1", instance_type="e2-standard-4",
                image=IMAGE, ssh_cidr="203.0.113.0/24", disk_gb=30)
    base.update(kw)
    return CloudSpec(**base)


def node_account(node: str, **kw) -> str:
    """The e-mail of a node's own service account (cluster c1 unless ``cluster=``)."""
    return f"{account_id(spec(**kw), node)}@proj.iam.gserviceaccount.com"


def launch(api, s, nodes=("c1-0", "c1-1"), doc=CONFIG):
    boot = Boot({n: doc.format(n) for n in nodes}, "root", KEY)
    return api.create(s, list(nodes), boot, api.prepare(s, KEY))


def inserts(fake) -> list[tuple[str, dict]]:
    """(zone, body) of every instance insert the fake received."""
    return [(p.split("/zones/")[1].split("/")[0], b) for m, p, b in fake.requests
            if m == "POST" and p.endswith("/instances")]


def test_spot_instances_carry_scheduling_labels_metadata_and_disk(fake, api):
    vms, errors = launch(api, spec())
    assert errors == {} and sorted(v.node for v in vms) == ["c1-0", "c1-1"]
    assert all(v.state == "running" and v.spot and v.public_ip and v.private_ip for v in vms)
    assert {v.zone for v in vms} == {"us-central1-a"}  # the region's first zone
    zone, body = inserts(fake)[0]
    assert body["name"] == "c1-0"
    assert body["machineType"] == "zones/us-central1-a/machineTypes/e2-standard-4"
    assert body["scheduling"] == {"provisioningModel": "SPOT",
                                  "instanceTerminationAction": "DELETE",
                                  "automaticRestart": False, "onHostMaintenance": "TERMINATE"}
    assert body["labels"]["hyper-cluster"] == "c1" and body["labels"]["hyper-node"] == "c1-0"
    assert "@" not in body["labels"]["hyper-owner"]
    assert body["tags"] == {"items": ["hyper-c1"]}
    meta = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert meta["ssh-keys"] == f"root:{KEY}"
    assert meta["user-data"] == CONFIG.format("c1-0") and "startup-script" not in meta
    [disk] = body["disks"]
    assert disk["boot"] and disk["autoDelete"]
    assert disk["initializeParams"]["diskSizeGb"] == "30"
    assert disk["initializeParams"]["sourceImage"] == IMAGE
    assert disk["initializeParams"]["labels"]["hyper-cluster"] == "c1"
    [nic] = body["networkInterfaces"]
    assert nic["accessConfigs"] == [{"name": "External NAT", "type": "ONE_TO_ONE_NAT"}]
    # its own service account, never the project's default one, whatever the storage
    [sa] = body["serviceAccounts"]
    assert sa["email"] == node_account("c1-0") != "default"
    assert sa["scopes"] == ["https://www.googleapis.com/auth/compute",
                            "https://www.googleapis.com/auth/devstorage.read_write"]
    assert meta["enable-guest-attributes"] == "TRUE"  # where the node publishes its host key
    assert fake.disks["us-central1-a"]["c1-0"]["sizeGb"] == "30"


def test_every_operation_is_waited_until_done(fake, api):
    launch(api, spec())
    ops = [p for m, p, _ in fake.requests if "/operations/" in p]
    # the stand-in answers RUNNING to the first wait of each operation: two waits each for
    # the two firewall rules and both inserts
    assert len(ops) == 8 and all(p.endswith("/wait") for p in ops)
    assert all(e["op"]["status"] == "DONE" for e in fake.operations.values())
    assert {i["status"] for i in fake.instances["us-central1-a"].values()} == {"RUNNING"}


def test_standard_instances_and_a_shell_boot_script(fake, api):
    vms, _ = launch(api, spec(spot=False), nodes=("c1-0",), doc=SCRIPT)
    _, body = inserts(fake)[0]
    assert body["scheduling"]["provisioningModel"] == "STANDARD"
    assert "instanceTerminationAction" not in body["scheduling"]
    meta = {i["key"]: i["value"] for i in body["metadata"]["items"]}
    assert meta["startup-script"] == SCRIPT.format("c1-0") and "user-data" not in meta
    assert not vms[0].spot and vms[0].state == "running"


def test_firewall_rules_made_once_and_corrected(fake, api):
    assert api.prepare(spec(), KEY) == api.prepare(spec(), KEY)
    assert sorted(fake.firewalls) == ["hyper-c1-internal", "hyper-c1-ssh"]
    fw = fake.firewalls["hyper-c1-ssh"]
    assert fw["direction"] == "INGRESS" and fw["sourceRanges"] == ["203.0.113.0/24"]
    assert fw["allowed"] == [{"IPProtocol": "tcp", "ports": ["22"]}] and not fw.get("sourceTags")
    assert fw["targetTags"] == ["hyper-c1"] and fw["network"].endswith("/networks/default")
    assert fw["description"].startswith("hyper:cluster=c1 ")
    # the cluster's nodes to each other: every protocol, from the tag to the tag, no range
    internal = fake.firewalls["hyper-c1-internal"]
    assert internal["direction"] == "INGRESS" and internal["allowed"] == [{"IPProtocol": "all"}]
    assert internal["sourceTags"] == internal["targetTags"] == ["hyper-c1"]
    assert not internal.get("sourceRanges") and not internal.get("ports")
    assert internal["description"].startswith("hyper:cluster=c1 ")
    writes = [m for m, p, _ in fake.requests if "firewalls" in p and m != "GET"]
    assert writes == ["POST", "POST"]
    api.prepare(spec(ssh_cidr="198.51.100.7/32"), KEY)  # the caller's address changed
    assert fake.firewalls["hyper-c1-ssh"]["sourceRanges"] == ["198.51.100.7/32"]
    assert fake.firewalls["hyper-c1-internal"] == internal
    # a range added by hand to the internal rule would open every port to it: replaced
    internal["sourceRanges"] = ["0.0.0.0/0"]
    api.prepare(spec(ssh_cidr="198.51.100.7/32"), KEY)
    assert not fake.firewalls["hyper-c1-internal"].get("sourceRanges")
    assert fake.firewalls["hyper-c1-internal"]["sourceTags"] == ["hyper-c1"]
    writes = [(m, p.rsplit("/", 1)[1]) for m, p, _ in fake.requests
              if "firewalls" in p and m != "GET"]
    assert writes[2:] == [("PUT", "hyper-c1-ssh"), ("PUT", "hyper-c1-internal")]
    with pytest.raises(UsageError, match="SSH firewall rule"):
        api.prepare(spec(ssh_cidr=None), KEY)


def test_nodes_reach_each_other_and_only_ssh_gets_in_from_outside(fake, api):
    vms, _ = launch(api, spec())
    launch(api, spec(cluster="other", count=1), nodes=("other-0",))
    zone = "us-central1-a"
    a, b, other = (zone, "c1-0"), (zone, "c1-1"), (zone, "other-0")

    def verdict(source, dst, protocol, port=None):
        return fake.firewall_verdict(source, *dst, protocol, port)
    # node to node: any protocol, any port, both ways
    assert verdict(a, b, "tcp", 29500) == verdict(b, a, "udp", 53) == "hyper-c1-internal"
    assert verdict(a, b, "icmp") == "hyper-c1-internal"
    # from outside: port 22 from ssh_cidr only
    assert verdict("203.0.113.9", b, "tcp", 22) == "hyper-c1-ssh"
    assert verdict("203.0.113.9", b, "tcp", 29500) is None
    assert verdict("198.51.100.9", b, "tcp", 22) is None
    # another cluster's node is outside too
    assert verdict(other, b, "tcp", 29500) is None and verdict(a, other, "tcp", 29500) is None
    # each node's internal address, where the others reach it
    ips = {n: i["networkInterfaces"][0]["networkIP"]
           for n, i in fake.instances[zone].items()}
    assert {v.node: v.private_ip for v in vms} == {"c1-0": ips["c1-0"], "c1-1": ips["c1-1"]}
    assert {v.node: v.private_ip for v in api.describe("c1")} == \
        {"c1-0": ips["c1-0"], "c1-1": ips["c1-1"]}


@pytest.mark.parametrize("change, error", [
    (dict(allowed=[{"I_p_protocol": "all", "ports": ["22"]}]), "Ports may only be specified"),
    (dict(direction="EGRESS"), "not allowed for EGRESS"),
    (dict(source_tags=["Not A Tag"]), "sourceTags"),
    (dict(allowed=[]), "Exactly one of 'allowed' or 'denied'"),
])
def test_the_stand_in_refuses_firewall_rules_the_api_refuses(fake, api, change, error):
    from google.cloud import compute_v1
    base = dict(name="hyper-bad-internal", network="global/networks/default",
                direction="INGRESS", source_tags=["hyper-bad"], target_tags=["hyper-bad"],
                allowed=[{"I_p_protocol": "all"}])
    base.update(change)
    base["allowed"] = [compute_v1.Allowed(**a) for a in base["allowed"]]
    with pytest.raises(CloudError, match=error) as e:
        api._firewall(compute_v1.Firewall(**base))
    assert e.value.code == "invalid" and fake.firewalls == {}


def test_zone_failover_on_exhaustion(fake, api):
    fake.fail("us-central1-a", "exhausted")
    fake.fail("us-central1-b", "exhausted-details")
    vms, errors = launch(api, spec())
    assert errors == {} and {v.zone for v in vms} == {"us-central1-c"}
    assert [z for z, _ in inserts(fake)] == ["us-central1-a"] * 2 + ["us-central1-b"] * 2 + \
        ["us-central1-c"] * 2
    assert fake.instances["us-central1-a"] == {} and fake.instances["us-central1-b"] == {}


def test_zones_named_in_the_spec_are_tried_in_their_order(fake, api):
    fake.exhaust("us-central1-c")
    vms, errors = launch(api, spec(zones=("us-central1-c", "us-central1-b")), nodes=("c1-0",))
    assert errors == {} and vms[0].zone == "us-central1-b"
    assert [z for z, _ in inserts(fake)] == ["us-central1-c", "us-central1-b"]


def test_every_zone_exhausted_is_a_capacity_error_per_node(fake, api):
    for z in fake.zones:
        fake.exhaust(z)
    vms, errors = launch(api, spec())
    assert vms == [] and set(errors) == {"c1-0", "c1-1"}
    assert all(isinstance(e, CapacityError) for e in errors.values())
    assert errors["c1-0"].code == "ZONE_RESOURCE_POOL_EXHAUSTED"
    assert "us-central1-c" in str(errors["c1-0"])


@pytest.mark.parametrize("fault", ["quota", "quota-http"])
def test_quota_exceeded_is_not_retried_in_another_zone(fake, api, fault):
    fake.fail("us-central1-a", fault)
    vms, errors = launch(api, spec(), nodes=("c1-0",))
    assert vms == [] and isinstance(errors["c1-0"], QuotaError)
    assert "Quota 'CPUS' exceeded" in str(errors["c1-0"])
    assert [z for z, _ in inserts(fake)] == ["us-central1-a"]


def test_a_refused_request_is_a_cloud_error_with_the_reason_and_not_retried(fake, api):
    vms, errors = launch(api, spec(instance_type="E2 BIG"), nodes=("c1-0",))
    assert vms == [] and type(errors["c1-0"]) is CloudError
    assert errors["c1-0"].code == "invalid" and "machineType" in str(errors["c1-0"])
    assert len(inserts(fake)) == 1


def test_odd_node_and_cluster_names_become_valid_names_and_labels(fake, api):
    vms, errors = launch(api, spec(cluster="Lab_X"), nodes=("Lab_X.0",))
    assert errors == {}  # the stand-in rejects invalid names and labels like the real API
    _, body = inserts(fake)[0]
    assert body["name"] == "lab-x-0" and body["labels"]["hyper-cluster"] == "lab_x"
    assert vms[0].id == "lab-x-0" and vms[0].node == "Lab_X.0"
    assert [v.node for v in api.describe("Lab_X")] == ["Lab_X.0"]
    assert gce_name("9lab-0") == "h-9lab-0" and label_value("me@Host.lan") == "me-host-lan"


class Token(Credentials):
    """Credentials with a bearer token that refreshes (the API may still refuse it)."""

    def refresh(self, request):
        self.token = "ya29.test-token"


def test_auth_failure_says_how_to_configure(fake):
    fake.auth_fail = True
    api = GCPAPI("proj", "us-central1", credentials=Token())
    with pytest.raises(CredentialsError) as e:
        api.check()
    assert "gcloud auth application-default login" in e.value.hint
    assert "GOOGLE_APPLICATION_CREDENTIALS" in e.value.hint
    assert "invalid authentication credentials" in str(e.value)
    with pytest.raises(CredentialsError):
        launch(api, spec())


def test_missing_application_default_credentials(monkeypatch, tmp_path):
    monkeypatch.delenv("HYPER_GCP_ENDPOINT", raising=False)
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    with pytest.raises(CredentialsError) as e:
        GCPAPI("proj", "us-central1").check()
    assert "missing.json" in str(e.value) and "`project:`" in e.value.hint


def test_credentials_that_cannot_refresh(fake):
    class Expired(Credentials):
        def refresh(self, request):
            raise auth_exc.RefreshError("invalid_grant: Token has been expired or revoked.")

    with pytest.raises(CredentialsError, match="expired or revoked") as e:
        GCPAPI("proj", "us-central1", credentials=Expired()).check()
    assert "gcloud auth application-default login" in e.value.hint


def test_permission_denied_is_a_credentials_error(fake):
    api = GCPAPI("someone-elses", "us-central1", credentials=AnonymousCredentials())
    with pytest.raises(CredentialsError, match="permission denied") as e:
        api.check()
    assert "Compute Admin" in e.value.hint


def test_project_from_the_environment_or_a_clear_error(fake, monkeypatch):
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj")
    api = GCPAPI(None, "us-central1", credentials=AnonymousCredentials())
    assert api.check() == ("project proj, region us-central1 (3 zones); "
                           "storage identities: allowed")
    fake.deny.add("iam.serviceAccounts.create")  # hyper check says what up would need
    said = api.check()
    assert "missing iam.serviceAccounts.create" in said and "cluster.service_account" in said
    assert "every gcp cluster" in said  # not only recipes with gs:// buckets
    fake.deny.discard("iam.serviceAccounts.create")
    monkeypatch.delenv("GOOGLE_CLOUD_PROJECT")
    with pytest.raises(CredentialsError, match="no Google Cloud project") as e:
        GCPAPI(None, "us-central1", credentials=AnonymousCredentials()).check()
    assert "`project:`" in e.value.hint and "GOOGLE_CLOUD_PROJECT" in e.value.hint


def test_unknown_region(fake):
    with pytest.raises(UsageError, match="region mars-north1 not found"):
        GCPAPI("proj", "mars-north1", credentials=AnonymousCredentials()).check()


def test_preempted_only_when_gce_says_so(fake, api):
    launch(api, spec())
    fake.preempt("us-central1-a", "c1-0")
    fake.power_off("us-central1-a", "c1-1")  # the idle watchdog's fallback
    states = {v.node: v.state for v in api.describe("c1")}
    assert states == {"c1-0": "preempted", "c1-1": "terminated"}
    lists = [p for m, p, _ in fake.requests if m == "GET" and p.endswith("/operations")]
    assert lists == ["/compute/v1/projects/proj/zones/us-central1-a/operations"]


def test_terminate_does_not_wait(fake, api):
    launch(api, spec())
    before = len(fake.requests)
    api.terminate("c1", ["c1-1", "no-such"])
    assert not any("/operations/" in p for _, p, _ in fake.requests[before:])
    assert [(m, p.rsplit("/", 1)[-1]) for m, p, _ in fake.requests[before:]
            if m == "DELETE"] == [("DELETE", "c1-1")]
    assert {v.node: v.state for v in api.describe("c1")} == {"c1-0": "running",
                                                             "c1-1": "stopping"}


def test_image_lookup_newest_baked_family_and_missing(fake, api):
    with pytest.raises(UsageError) as e:
        api.find_image(spec(image=None))
    assert "hyper image build --provider gcp" in e.value.hint
    labels = {"hyper-image": "node", "hyper-variant": "cpu"}
    fake.add_image("old", labels, "2026-01-01T00:00:00.000-08:00", family="hyper-node-cpu")
    fake.add_image("new", labels, "2026-06-01T10:00:00.000-07:00", family="hyper-node-cpu")
    fake.add_image("newer-same-day", labels, "2026-06-01T09:30:00.000-08:00")
    fake.add_image("gpu", {**labels, "hyper-variant": "gpu"}, "2026-09-01T00:00:00.000-07:00")
    fake.add_image("dropped", labels, "2026-12-01T00:00:00.000-08:00",
                   deprecated="DEPRECATED")
    # 09:30 -08:00 is later than 10:00 -07:00: the offsets count, not the text
    assert api.find_image(spec(image=None)).endswith("/global/images/newer-same-day")
    assert api.find_image(spec(image=None, variant="gpu")).endswith("/global/images/gpu")
    assert api.find_image(spec(image="old")).endswith("/global/images/old")
    assert api.find_image(spec(image="hyper-node-cpu")).endswith("/global/images/new")
    assert api.find_image(spec()) == IMAGE  # a link is taken as it is
    with pytest.raises(UsageError, match="no image or image family nope"):
        api.find_image(spec(image="nope"))


def test_teardown_and_gc_leave_nothing(fake, api):
    launch(api, spec())
    launch(api, spec(cluster="other", count=1), nodes=("other-0",))
    held = api.resources("c1")
    assert sorted((r.kind, r.id) for r in held) == [
        ("disk", "c1-0"), ("disk", "c1-1"), ("firewall", "hyper-c1-internal"),
        ("firewall", "hyper-c1-ssh"), ("instance", "c1-0"), ("instance", "c1-1"),
        ("service_account", node_account("c1-0")), ("service_account", node_account("c1-1"))]
    assert [r.kind for r in held][:2] == ["instance", "instance"]  # deletion order
    removed = remove_all(api, "c1")
    assert {"instance c1-0", "instance c1-1", "firewall hyper-c1-ssh",
            "firewall hyper-c1-internal"} <= set(removed)
    assert api.resources("c1") == [] and api.describe("c1") == []
    assert sorted(fake.firewalls) == ["hyper-other-internal", "hyper-other-ssh"]
    assert "c1-0" not in fake.disks["us-central1-a"]
    others = api.resources(None)
    assert {r.cluster for r in others} == {"other"} and len(others) == 5
    assert api.delete([r for r in held if r.kind == "instance"]) == []  # already gone
    remove_all(api, None)
    assert api.resources(None) == [] and not fake.firewalls
    assert all(not z for z in fake.instances.values()) and all(not z for z in fake.disks.values())


def test_spot_price_is_not_in_the_compute_api(api):
    assert api.spot_price(spec()) == {}


# -- identities: an account per node, bound on the recipe's buckets and its own instance only --
import json  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

from hypercli.providers.cloud import IdentityConflict  # noqa: E402
from hypercli.recipe.access import Grant  # noqa: E402

SA = node_account("c1-0")
MEMBER = f"serviceAccount:{SA}"
MEMBERS = sorted(f"serviceAccount:{node_account(n)}" for n in ("c1-0", "c1-1"))
GRANTS = (Grant("gs", "data", "datasets/coco"), Grant("gs", "out", "runs/wf1", write=True))
SELF_DELETE = "projects/proj/roles/hyperNodeSelfDelete"


def storage_fake(fake):
    for b in ("data", "out", "other"):
        fake.add_bucket(b)
    return fake


def policy_calls(fake) -> list[tuple[str, dict]]:
    return [(p.split("/b/")[1].split("/")[0], b) for m, p, b in fake.requests
            if m == "PUT" and p.endswith("/iam")]


def test_each_node_runs_as_its_own_account_bound_on_exactly_the_recipe_prefixes(fake, api):
    storage_fake(fake)
    vms, errors = launch(api, spec(grants=GRANTS))
    assert errors == {}
    made = [b for m, p, b in fake.requests if m == "POST" and p.endswith("/serviceAccounts")]
    assert [b["accountId"] for b in made] == [account_id(spec(), "c1-0"),
                                              account_id(spec(), "c1-1")]
    assert made[0]["accountId"].startswith("hyper-c1-") and len(made[0]["accountId"]) <= 30
    assert made[0]["serviceAccount"]["description"].startswith(
        f"hyper:cluster=c1 hyper:cluster-id={spec().tag} hyper:node=c1-0 ")
    for (_, ins), node in zip(inserts(fake), ("c1-0", "c1-1")):
        assert ins["serviceAccounts"] == [{"email": node_account(node), "scopes": [
            "https://www.googleapis.com/auth/compute",
            "https://www.googleapis.com/auth/devstorage.read_write"]}]
    calls = policy_calls(fake)
    assert sorted(b for b, _ in calls) == ["data", "out"]  # never "other"
    assert all(p["version"] == 3 for _, p in calls)
    [read] = fake.buckets["data"]["policy"]["bindings"]
    assert read["role"] == "roles/storage.objectViewer" and read["members"] == MEMBERS
    assert read["condition"]["title"] == f"hyper-c1-{spec().tag}"
    [write] = fake.buckets["out"]["policy"]["bindings"]
    assert write["role"] == "roles/storage.objectUser"
    may = fake.allowed
    assert may(MEMBER, "data", "storage.objects.get", "datasets/coco/chunks/0001")
    assert not may(MEMBER, "data", "storage.objects.get", "datasets/cocoa/x")
    assert not may(MEMBER, "data", "storage.objects.get", "secret/x")
    assert not may(MEMBER, "data", "storage.objects.create", "datasets/coco/x")
    assert may(MEMBER, "data", "storage.objects.list", list_prefix="datasets/coco/")
    assert not may(MEMBER, "data", "storage.objects.list", list_prefix="")
    assert may(MEMBER, "out", "storage.objects.create", "runs/wf1/t1/out.txt")
    assert not may(MEMBER, "out", "storage.objects.create", "runs/wf0/t3/out.txt")
    assert not may(MEMBER, "out", "storage.objects.get", "runs/wf0/t3/out.txt")
    assert not may(MEMBER, "out", "storage.objects.list", list_prefix="runs/")
    assert fake.buckets["other"]["policy"]["bindings"] == []
    # the idle watchdog may delete its own instance, and only that: a custom role with two
    # permissions, each node's account bound on its own instance
    assert fake.roles["hyperNodeSelfDelete"]["includedPermissions"] == [
        "compute.instances.delete", "compute.instances.get"]
    for node in ("c1-0", "c1-1"):
        assert fake.instance_policies[("us-central1-a", node)]["bindings"] == [
            {"role": SELF_DELETE, "members": [f"serviceAccount:{node_account(node)}"]}]


def test_identity_is_idempotent_and_sets_exactly_what_is_asked(fake, api):
    storage_fake(fake)
    fake.buckets["out"]["policy"]["bindings"].append(
        {"role": "roles/storage.objectViewer", "members": ["user:me@example.com"]})
    launch(api, spec(grants=GRANTS))
    n = len(fake.requests)
    assert api.identity(spec(grants=GRANTS)) == {"own_accounts": True, "scopes": [
        "https://www.googleapis.com/auth/compute",
        "https://www.googleapis.com/auth/devstorage.read_write"]}
    assert not [m for m, p, _ in fake.requests[n:] if m in ("PUT", "PATCH", "DELETE")
                or (m == "POST" and not p.endswith(":testIamPermissions"))]  # nothing written
    later = (GRANTS[0], Grant("gs", "data", "datasets/imagenet"),
             Grant("gs", "out", "runs/wf2", write=True))
    api.identity(spec(grants=later))
    assert fake.allowed(MEMBER, "data", "storage.objects.get", "datasets/imagenet/x")
    assert fake.allowed(MEMBER, "data", "storage.objects.get", "datasets/coco/x")  # kept
    assert fake.allowed(MEMBER, "out", "storage.objects.create", "runs/wf2/x")
    assert not fake.allowed(MEMBER, "out", "storage.objects.create", "runs/wf1/x")  # ended
    assert {"role": "roles/storage.objectViewer", "members": ["user:me@example.com"]} in \
        fake.buckets["out"]["policy"]["bindings"]  # never what hypercli did not bind
    api.identity(spec(grants=later[:2]))
    assert [b for b in fake.buckets["out"]["policy"]["bindings"]
            if set(b["members"]) & set(MEMBERS)] == []
    assert len(fake.service_accounts) == 2


@pytest.mark.parametrize("permission", ["iam.serviceAccounts.create",
                                        "storage.buckets.setIamPolicy"])
def test_a_caller_who_may_not_make_the_identity_is_stopped_before_any_instance(
        fake, api, permission):
    storage_fake(fake)
    fake.deny.add(permission)
    with pytest.raises(CredentialsError) as e:
        launch(api, spec(grants=GRANTS))
    assert permission in str(e.value) and "cluster.service_account" in e.value.hint
    assert inserts(fake) == [] and fake.firewalls == {} and fake.service_accounts == {}


def test_a_caller_who_may_not_make_the_role_gets_nodes_that_power_off(fake, api, caplog):
    fake.deny.add("iam.roles.create")
    vms, errors = launch(api, spec())
    assert errors == {} and len(vms) == 2
    assert fake.instance_policies == {} and "power off" in caplog.text


def test_a_named_service_account_is_used_as_is(fake, api):
    storage_fake(fake)
    mine = "trainer@proj.iam.gserviceaccount.com"
    fake.add_service_account(mine)
    vms, errors = launch(api, spec(grants=GRANTS, identity=mine))
    assert errors == {} and len(vms) == 2
    assert [sa["email"] for _, b in inserts(fake) for sa in b["serviceAccounts"]] == [mine] * 2
    assert policy_calls(fake) == [] and list(fake.service_accounts) == [mine]
    assert fake.instance_policies == {}  # one account for all: no node may delete others


def test_without_gs_storage_nodes_still_run_as_their_own_account(fake, api):
    launch(api, spec(grants=(Grant("s3", "b", "p"),)))
    assert sorted(fake.service_accounts) == sorted([node_account("c1-0"),
                                                    node_account("c1-1")])
    assert [b["serviceAccounts"][0]["email"] for _, b in inserts(fake)] == [
        node_account("c1-0"), node_account("c1-1")]


def test_down_removes_the_accounts_and_their_bindings(fake, api):
    storage_fake(fake)
    fake.buckets["out"]["policy"]["bindings"].append(
        {"role": "roles/storage.objectViewer", "members": ["user:me@example.com"]})
    launch(api, spec(grants=GRANTS))
    launch(api, spec(cluster="c2", count=1, grants=GRANTS[:1]), nodes=("c2-0",))
    assert ("service_account", SA) in [(r.kind, r.id) for r in api.resources("c1")]
    removed = remove_all(api, "c1")
    assert f"service_account {SA}" in removed
    assert SA not in fake.service_accounts
    other = node_account("c2-0", cluster="c2")
    assert list(fake.service_accounts) == [other]
    assert fake.buckets["out"]["policy"]["bindings"] == [
        {"role": "roles/storage.objectViewer", "members": ["user:me@example.com"]}]
    assert [b["members"] for b in fake.buckets["data"]["policy"]["bindings"]] == [
        [f"serviceAccount:{other}"]]
    remove_all(api, None)
    assert fake.service_accounts == {}
    assert "hyperNodeSelfDelete" in fake.roles  # per project, grants nothing by itself


def test_a_policy_changed_by_someone_else_meanwhile_is_read_again(fake, api):
    storage_fake(fake)
    launch(api, spec(grants=GRANTS))
    fake.buckets["data"]["policy"]["bindings"].append(
        {"role": "roles/storage.objectViewer", "members": ["user:me@example.com"]})
    fake.races["data"] = 1
    n = len(policy_calls(fake))
    api.identity(spec(grants=GRANTS + (Grant("gs", "data", "datasets/imagenet"),)))
    assert [b for b, _ in policy_calls(fake)[n:]] == ["data", "data"]  # 412, then again
    members = {m for b in fake.buckets["data"]["policy"]["bindings"] for m in b["members"]}
    assert members == set(MEMBERS) | {"user:me@example.com"}


def test_gc_works_for_a_caller_who_may_not_list_service_accounts(fake, api):
    launch(api, spec())
    fake.deny.add("iam.serviceAccounts.list")
    assert remove_all(api, "c1") and api.resources("c1") == []


def test_accounts_of_nodes_that_are_gone_go_at_the_next_launch(fake, api):
    launch(api, spec(), nodes=("c1-0",))
    for z in fake.instances.values():
        z.pop("c1-0", None)  # preempted and deleted by GCE
    launch(api, spec(), nodes=("c1-1",))
    assert list(fake.service_accounts) == [node_account("c1-1")]


def _as_node(fake, node: str, method: str, path: str, body: dict | None = None,
             cluster: str = "c1") -> int:
    """HTTP status of a Compute Engine call made with the token of ``node``'s account (what
    a task on that node reads from the metadata server)."""
    token = f"ya29.node-{node}"
    fake.tokens[token] = f"serviceAccount:{node_account(node, cluster=cluster)}"
    req = urllib.request.Request(f"{fake.url}/compute/v1/projects/proj/{path}", method=method,
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Authorization": f"Bearer {token}",
                                          "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_nodes_token_deletes_its_own_instance_and_nothing_else(fake, api, tmp_path):
    """From the token a task on c1-0 can take from the metadata server: its siblings,
    another cluster's node, its own labels (to survive down and gc) and metadata, a bucket's
    policy, a new service account: each refused; deleting itself, as the idle watchdog
    does it: allowed."""
    storage_fake(fake)
    launch(api, spec(grants=GRANTS))
    launch(api, spec(cluster="c2", count=1), nodes=("c2-0",))
    z = "zones/us-central1-a/instances"
    fp = fake.instances["us-central1-a"]["c1-0"]["labelFingerprint"]
    refused = {
        "delete a sibling": ("DELETE", f"{z}/c1-1", None),
        "delete another cluster's node": ("DELETE", f"{z}/c2-0", None),
        "read a sibling (its metadata)": ("GET", f"{z}/c1-1", None),
        "remove its own labels": ("POST", f"{z}/c1-0/setLabels",
                                  {"labels": {}, "labelFingerprint": fp}),
        "set its own metadata (ssh-keys)": ("POST", f"{z}/c1-0/setMetadata", {"items": []}),
        "stop a sibling": ("POST", f"{z}/c1-1/stop", None),
        "list the project's instances": ("GET", "aggregated/instances", None),
        "make an instance": ("POST", z, {"name": "evil"}),
    }
    for what, (method, path, body) in refused.items():
        assert _as_node(fake, "c1-0", method, path, body) == 403, what
    for path in ("/v1/projects/proj/serviceAccounts", "/storage/v1/b/out/iam"):
        req = urllib.request.Request(fake.url + path, method="PUT" if "iam" in path else "POST",
                                     data=b"{}", headers={"Authorization":
                                                         "Bearer ya29.node-c1-0"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 403, path
    assert set(fake.instances["us-central1-a"]) == {"c1-0", "c1-1", "c2-0"}
    assert fake.instances["us-central1-a"]["c1-0"]["labels"]["hyper-cluster"] == "c1"
    # itself: the watchdog's own call, with its own token from a metadata server
    from hypercli.node import watch
    from tokenstandins import MetadataServer
    md = MetadataServer("ya29.node-c1-0", SA, instance={
        "project": "proj", "zone": "us-central1-a", "name": "c1-0"})
    try:
        assert watch.self_delete("gcp", f"http://{md.host}", api=fake.url)
    finally:
        md.close()
    fake.op_seconds = 0
    fake.route("GET", "/compute/v1/projects/proj/zones", {}, None)  # operations settle
    assert set(fake.instances["us-central1-a"]) == {"c1-1", "c2-0"}


def test_down_finds_a_node_that_lost_its_labels_by_name_and_account(fake, api):
    """Labels are not what down and gc trust alone: an instance of the cluster whose labels
    and metadata were removed is still found by its name and the account it runs as; another
    cluster's instance of a similar name is not."""
    launch(api, spec())
    launch(api, spec(cluster="c10", count=1), nodes=("c10-0",))
    inst = fake.instances["us-central1-a"]["c1-1"]
    inst["labels"] = {}
    inst["metadata"]["items"] = [i for i in inst["metadata"]["items"]
                                 if not i["key"].startswith("hyper-")]
    assert ("instance", "c1-1") in [(r.kind, r.id) for r in api.resources("c1")]
    assert ("instance", "c10-0") not in [(r.kind, r.id) for r in api.resources("c1")]
    assert {r.cluster for r in api.resources(None) if r.id == "c1-1"} == {"c1"}
    remove_all(api, "c1")
    assert set(fake.instances["us-central1-a"]) == {"c10-0"}


def test_account_names_never_collide_and_a_squatted_account_is_refused(fake, api):
    """Cluster names equal in their first 30 characters or but for case get accounts of their
    own (the cluster's id is in each name); an account made in advance under a node's computed
    name is used only when it is that node's own and nobody else holds it."""
    long = "ml-team-experiments-2026-"
    ids = {account_id(spec(cluster=c, cluster_id=i), f"{c}-0") for c, i in
           ((long + "gpu", "id-a"), (long + "cpu", "id-b"), ("Team", "id-c"),
            ("team", "id-d"))}
    assert len(ids) == 4 and all(6 <= len(i) <= 30 for i in ids)
    launch(api, spec(cluster=long + "gpu", cluster_id="id-a", count=1),
           nodes=(long + "gpu-0",))
    launch(api, spec(cluster=long + "cpu", cluster_id="id-b", count=1),
           nodes=(long + "cpu-0",))
    assert len(fake.service_accounts) == 2
    s = spec(cluster="c9", cluster_id="id-9", count=1)
    squat = f"{account_id(s, 'c9-0')}@proj.iam.gserviceaccount.com"
    fake.add_service_account(squat)
    with pytest.raises(IdentityConflict, match="description") as e:
        launch(api, s, nodes=("c9-0",))
    assert e.value.exit_code == 2 and "cluster.service_account" in e.value.hint
    fake.service_accounts[squat]["description"] = (
        f"hyper:cluster=c9 hyper:cluster-id={s.tag} hyper:node=c9-0 buckets=")
    fake.sa_keys[squat] = [{"name": "key-1", "keyType": "USER_MANAGED"}]
    with pytest.raises(IdentityConflict, match="key"):
        launch(api, s, nodes=("c9-0",))
    fake.sa_keys[squat] = []
    fake.sa_policies[squat] = {"bindings": [{"role": "roles/iam.serviceAccountUser",
                                             "members": ["user:someone@example.com"]}]}
    with pytest.raises(IdentityConflict, match="act as it"):
        launch(api, s, nodes=("c9-0",))
    assert not [i for z in fake.instances.values() for i in z if i.startswith("c9")]
    fake.sa_policies[squat] = {}
    # what it holds in the project would be every task's on its node (Editor: every VM)
    fake.project_policy["bindings"] = [
        {"role": "roles/editor", "members": [f"serviceAccount:{squat}"]},
        {"role": "roles/viewer", "members": ["user:someone@example.com"]}]
    with pytest.raises(IdentityConflict, match="roles/editor"):
        launch(api, s, nodes=("c9-0",))
    fake.deny.add("resourcemanager.projects.getIamPolicy")  # cannot be known: refused too
    with pytest.raises(IdentityConflict, match="getIamPolicy"):
        launch(api, s, nodes=("c9-0",))
    fake.deny.discard("resourcemanager.projects.getIamPolicy")
    assert not [i for z in fake.instances.values() for i in z if i.startswith("c9")]
    fake.project_policy["bindings"] = fake.project_policy["bindings"][1:]
    vms, errors = launch(api, s, nodes=("c9-0",))  # as hypercli leaves it: its own
    assert errors == {} and len(vms) == 1


def test_the_host_key_a_node_published_is_read_from_its_guest_attributes(fake, api):
    vms, _ = launch(api, spec(count=1), nodes=("c1-0",))
    assert api.host_key(vms[0]) is None  # not yet published
    fake.publish("us-central1-a", "c1-0", "hostkeys", "ssh-ed25519",
                 "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyFakeKeyFakeKey")
    assert api.host_key(vms[0]) == "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIFakeKeyFakeKeyFakeKey"


def test_a_self_delete_role_found_with_more_rights_is_corrected_before_a_node_holds_it(
        fake, api):
    """The project's custom role of that name, made (or widened, or deleted) by someone
    else: its permissions are set back to get and delete, and restored, before any instance
    is bound to it, so a node's token still may not relabel or stop itself."""
    from gcpiamfake import INSTANCE_ADMIN
    fake.roles["hyperNodeSelfDelete"] = {
        "name": SELF_DELETE, "title": "mine", "etag": "BwA=", "deleted": True,
        "includedPermissions": sorted(INSTANCE_ADMIN)}
    launch(api, spec())
    role = fake.roles["hyperNodeSelfDelete"]
    assert role["includedPermissions"] == ["compute.instances.delete",
                                           "compute.instances.get"] and not role["deleted"]
    z = "zones/us-central1-a/instances"
    fp = fake.instances["us-central1-a"]["c1-0"]["labelFingerprint"]
    assert _as_node(fake, "c1-0", "POST", f"{z}/c1-0/setLabels",
                    {"labels": {}, "labelFingerprint": fp}) == 403
    assert _as_node(fake, "c1-0", "POST", f"{z}/c1-0/stop") == 403
    assert _as_node(fake, "c1-0", "GET", f"{z}/c1-0") == 200


def test_a_bucket_without_uniform_access_is_a_clear_error_before_any_instance(fake, api):
    """Prefix conditions need uniform bucket-level access: a bucket without it is bad input
    (exit 2, how to turn it on), found before any instance is made, its policy unchanged."""
    storage_fake(fake)
    fake.add_bucket("out", uniform=False)
    with pytest.raises(UsageError, match="uniform bucket-level access") as e:
        launch(api, spec(grants=GRANTS))
    assert e.value.exit_code == 2 and "--uniform-bucket-level-access" in e.value.hint
    assert inserts(fake) == [] and fake.buckets["out"]["policy"]["bindings"] == []


def test_a_cluster_of_the_same_name_from_another_state_file_never_rebinds_the_accounts(
        fake, api):
    """Two clusters named c1 with different ids (two state files): setting one's storage
    binds its own nodes' accounts only; the other's keep their grants."""
    storage_fake(fake)
    launch(api, spec(cluster_id="id-a", grants=GRANTS), nodes=("c1-0",))
    a = f"serviceAccount:{node_account('c1-0', cluster_id='id-a')}"
    assert fake.allowed(a, "out", "storage.objects.create", "runs/wf1/t/x")
    theirs = (Grant("gs", "out", "runs/wf9", write=True),)
    launch(api, spec(cluster_id="id-b", grants=theirs), nodes=("c1-5",))
    b = f"serviceAccount:{node_account('c1-5', cluster_id='id-b')}"
    assert fake.allowed(b, "out", "storage.objects.create", "runs/wf9/t/x")
    assert fake.allowed(a, "out", "storage.objects.create", "runs/wf1/t/x")  # kept
    assert not fake.allowed(a, "out", "storage.objects.create", "runs/wf9/t/x")
    assert fake.allowed(a, "data", "storage.objects.get", "datasets/coco/x")
    assert not fake.allowed(b, "data", "storage.objects.get", "datasets/coco/x")
