"""Launch failover through the cloud provider: capacity errors injected per zone, per region
(AWS, moto's EC2 API in process, errors answered at the botocore client boundary so they go
through botocore's own error parsing), spot-only exhaustion with ``spot: auto``, and per cloud
(every AWS offer out of capacity, the GCP stand-in tests/gcpfake.py has room), with the
instances booted onto SSH test hosts (tests/cloudhosts.py). The cost ledger matches the
nodes' recorded lifetimes, and `hyper status` shows the steps."""

from __future__ import annotations

import json

import boto3
import moto
import pytest
from botocore.awsrequest import AWSResponse

from cloudhosts import Booter, gcp_publisher, gcp_source
from hypercli import cluster as C
from hypercli.offers.offer import Offer
from hypercli.providers.aws import AWSAPI
from hypercli.providers.cloud_provider import CloudProvider
from hypercli.recipe import ClusterSpec
from hypercli.state import State

pytestmark = pytest.mark.slow

EAST, WEST = "us-east-1", "us-west-2"
CIDR = "10.213.0.0/24"


class Refuse:
    """Answers RunInstances with EC2's error ``code`` for the zones in ``zones`` (spot
    requests only, with ``spot_only``), at the botocore client boundary; records each
    request's (zone, spot)."""

    def __init__(self, api: AWSAPI, zones: set, code="InsufficientInstanceCapacity",
                 spot_only=False):
        self.zones, self.code, self.spot_only, self.asked = zones, code, spot_only, []
        self.ec2 = api.ec2
        api.ec2.meta.events.register("before-call.ec2.RunInstances", self)

    def __call__(self, params, **_):
        body = params["body"]
        zone = body.get("Placement.AvailabilityZone")
        if zone is None and body.get("NetworkInterface.1.SubnetId"):
            zone = self.ec2.describe_subnets(SubnetIds=[body["NetworkInterface.1.SubnetId"]])[
                "Subnets"][0]["AvailabilityZone"]
        spot = "InstanceMarketOptions.MarketType" in body
        self.asked.append((zone, spot))
        if (zone in self.zones or "*" in self.zones) and (spot or not self.spot_only):
            error = {"Code": self.code, "Message": f"We currently do not have sufficient "
                     f"capacity in the Availability Zone you requested ({zone})."}
            return (AWSResponse(params["url"], 500, {}, None),
                    {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 500}})
        return None


@pytest.fixture
def moto_aws(monkeypatch, tmp_path):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": EAST, "AWS_EC2_METADATA_DISABLED": "true",
                 "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "HYPER_AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(tmp_path / "addresses.json"))
    with moto.mock_aws():
        clients = {r: boto3.client("ec2", region_name=r) for r in (EAST, WEST)}
        for ec2 in clients.values():  # a baked node image in each region (found by its tags)
            iid = ec2.register_image(Name="hyper-node-cpu-1-a", Architecture="x86_64")[
                "ImageId"]
            ec2.create_tags(Resources=[iid], Tags=[
                {"Key": "hyper:image", "Value": "node"}, {"Key": "hyper:variant",
                                                         "Value": "cpu"}])
        yield clients


def booted(sources, hosts, tmp_path, publish=None) -> Booter:
    def source():
        out = {}
        for s in sources:
            out.update(s())
        return out
    b = Booter(source, hosts, tmp_path / "addresses.json", publish=publish)
    b.start()
    return b


def ec2_source(ec2):
    from cloudhosts import _ec2_source
    return _ec2_source(ec2)


def left(ec2, cluster) -> list:
    from cloudhosts import tagged_left
    return tagged_left(ec2, cluster)


def test_capacity_errors_per_zone_then_per_region_land_in_the_next_region(
        moto_aws, ssh_hosts, tmp_path, hyper_home, hyper):
    hosts = ssh_hosts.start(1)
    booter = booted([ec2_source(moto_aws[EAST]), ec2_source(moto_aws[WEST])], hosts, tmp_path)
    apis = {("aws", EAST): AWSAPI(EAST), ("aws", WEST): AWSAPI(WEST)}
    refused = Refuse(apis["aws", EAST], {f"{EAST}a", f"{EAST}b"})
    offers = [Offer("aws", "m5.large", EAST, f"{EAST}a", True, 0.04, 2, 8),
              Offer("aws", "m5.large", EAST, f"{EAST}b", True, 0.05, 2, 8),
              Offer("aws", "m5.large", WEST, f"{WEST}b", True, 0.06, 2, 8)]
    spec = ClusterSpec("fo", "aws", 1, {"region": EAST, "instance_type": "m5.large",
                                        "ssh_cidr": CIDR})
    provider = CloudProvider("aws", options=spec.options, api=apis["aws", EAST], apis=apis)
    state = State()
    try:
        [node] = C.up(state, spec, provider, offers=offers)
        assert provider.offers == offers  # what a replacement launch walks along
        assert [z for z, _ in refused.asked] == [f"{EAST}a", f"{EAST}b"]
        assert (node["info"]["cloud"], node["info"]["region"], node["info"]["zone"]) == \
            ("aws", WEST, f"{WEST}b")
        steps = [e["message"] for e in state.cluster_events("fo")]
        assert steps == [f"{EAST}a: no spot capacity for m5.large → {EAST}b",
                         f"{EAST}b: no spot capacity for m5.large → {WEST}b"]
        r = hyper("status", "fo")
        assert r.returncode == 0, r.stderr
        assert f"aws {WEST}b m5.large spot $0.0600/h" in r.stdout
        assert f"{EAST}b: no spot capacity for m5.large → {WEST}b" in r.stdout
        [row] = state.ledger("fo")
        assert (row["region"], row["zone"], row["price"], row["ended_at"]) == \
            (WEST, f"{WEST}b", 0.06, None)
        C.down(state, "fo")  # both regions are cleaned: the first had a key pair and group
        assert left(moto_aws[EAST], "fo") == [] and left(moto_aws[WEST], "fo") == []
        [row] = state.ledger("fo")
        assert row["ended_at"] is not None and row["end_reason"] == "down"
        ended = row["ended_at"]
        C.down(state, "fo")  # a second down changes no recorded end
        assert state.ledger("fo")[0]["ended_at"] == ended
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)


def test_spot_auto_falls_back_to_on_demand_and_says_it_costs_more(
        moto_aws, ssh_hosts, tmp_path, hyper_home):
    hosts = ssh_hosts.start(1)
    booter = booted([ec2_source(moto_aws[EAST])], hosts, tmp_path)
    api = AWSAPI(EAST)
    refused = Refuse(api, {"*"}, spot_only=True)
    spec = ClusterSpec("auto", "aws", 1, {"region": EAST, "instance_type": "m5.large",
                                          "zone": [f"{EAST}a", f"{EAST}b"], "spot": "auto",
                                          "ssh_cidr": CIDR})
    provider = CloudProvider("aws", options=spec.options, api=api)
    state = State()
    try:
        [node] = C.up(state, spec, provider)
        assert refused.asked == [(f"{EAST}a", True), (f"{EAST}b", True), (f"{EAST}a", False)]
        assert node["info"]["spot"] is False and node["info"]["zone"] == f"{EAST}a"
        steps = [e["message"] for e in state.cluster_events("auto")]
        assert steps == [f"{EAST}a: no spot capacity for m5.large → {EAST}b",
                         f"{EAST}b: no spot capacity for m5.large → {EAST}a on-demand "
                         "(costs more)"]
        assert state.ledger("auto")[0]["spot"] == 0
        C.down(state, "auto")
        assert left(moto_aws[EAST], "auto") == []
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)


def test_every_offer_out_of_capacity_is_one_error_naming_each_step(moto_aws, hyper_home):
    api = AWSAPI(EAST)
    Refuse(api, {"*"})
    spec = ClusterSpec("none", "aws", 2, {"region": EAST, "instance_type": "m5.large",
                                          "zone": [f"{EAST}a", f"{EAST}c"], "ssh_cidr": CIDR})
    state = State()
    with pytest.raises(Exception) as e:
        C.up(state, spec, CloudProvider("aws", options=spec.options, api=api))
    text = str(e.value)
    assert "no node of cluster none came up" in text
    assert f"{EAST}a: no spot capacity for m5.large → {EAST}c" in text
    assert f"{EAST}c: no spot capacity for m5.large → no offer left" in text
    assert state.ledger("none") == []
    from hypercli.providers.cloud_provider import remove_all
    remove_all(api, "none")
    assert left(moto_aws[EAST], "none") == []


def test_the_first_cloud_out_of_capacity_the_launch_lands_on_the_second(
        moto_aws, ssh_hosts, tmp_path, hyper_home, monkeypatch, hyper):
    """End to end: a recipe's cluster whose offers are AWS zones (each out of capacity) and
    then a GCP zone; the nodes come up on GCP, run a task, and the ledger holds their
    lifetimes as the launch and `down` recorded them."""
    pytest.importorskip("google.cloud.compute_v1")
    from gcpfake import ComputeFake
    from hypercli.providers.gcp import GCPAPI
    fake = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
    hosts = ssh_hosts.start(2)
    booter = booted([ec2_source(moto_aws[EAST]), gcp_source(fake)], hosts, tmp_path,
                    publish=gcp_publisher(fake))
    apis = {("aws", EAST): AWSAPI(EAST), ("gcp", "us-central1"): GCPAPI("proj", "us-central1")}
    refused = Refuse(apis["aws", EAST], {"*"})
    offers = [Offer("aws", "p3.8xlarge", EAST, f"{EAST}a", True, 3.67, 32, 244, "V100", 4),
              Offer("aws", "p3.8xlarge", EAST, f"{EAST}b", True, 3.80, 32, 244, "V100", 4),
              Offer("gcp", "n1-standard-32", "us-central1", "us-central1-a", True, 4.10, 32,
                    120, "V100", 4, (("accelerator", "nvidia-tesla-v100"), ("project", "proj")))]
    fake.add_image("hyper-node-cpu-1-a", {"hyper-image": "node", "hyper-variant": "cpu"},
                   "2026-06-01T10:00:00.000-07:00")  # the baked image on GCP
    spec = ClusterSpec("xc", "aws", 2, {"region": EAST, "instance_type": "p3.8xlarge",
                                        "ssh_cidr": CIDR})
    provider = CloudProvider("aws", options=spec.options, api=apis["aws", EAST], apis=apis,
                             offers=offers)
    state = State()
    try:
        t0 = __import__("time").time()
        nodes = C.up(state, spec, provider)
        t1 = __import__("time").time()
        assert len(nodes) == 2 and len(refused.asked) == 2  # one request per zone: then
        assert {n["info"]["cloud"] for n in nodes} == {"gcp"}  # the zone is not asked again
        assert {n["info"]["zone"] for n in nodes} == {"us-central1-a"}
        steps = [e["message"] for e in state.cluster_events("xc")]
        assert steps == [f"{EAST}a: no spot capacity for p3.8xlarge → {EAST}b",
                         f"{EAST}b: no spot capacity for p3.8xlarge → gcp us-central1-a "
                         "n1-standard-32",
                         "changed cloud: 2 nodes on gcp, not aws: its offers had no room"]
        for n in nodes:  # the nodes work
            client = provider.connect(n)
            try:
                assert client.call("hello")["cpus"] >= 1
            finally:
                client.close()
        rows = state.ledger("xc")
        assert sorted(r["node"] for r in rows) == sorted(n["name"] for n in nodes)
        assert all(r["cloud"] == "gcp" and r["price"] == 4.10 and t0 <= r["launched_at"] <= t1
                   for r in rows)
        C.down(state, "xc")
        t2 = __import__("time").time()
        rows = state.ledger("xc")
        assert all(t1 <= r["ended_at"] <= t2 and r["end_reason"] == "down" for r in rows)
        assert fake.instances == {z: {} for z in fake.zones}  # and nothing else of it
        assert not fake.firewalls and not fake.service_accounts
        assert left(moto_aws[EAST], "xc") == []
        r = hyper("cost", "xc", "--json")
        out = json.loads(r.stdout)
        hours = sum(r["ended_at"] - r["launched_at"] for r in rows) / 3600
        assert out["clusters"][0]["cost"] == pytest.approx(4.10 * hours, abs=1e-3)
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)
        fake.close()


def test_a_spot_instance_left_pending_is_terminated_and_the_next_offer_tried(
        moto_aws, ssh_hosts, tmp_path, hyper_home, monkeypatch):
    """EC2 accepts the spot request but the instance stays pending (answered so by
    DescribeInstances at the client boundary): after SPOT_WAIT it is terminated and the node
    is launched in the next zone."""
    from hypercli.providers import cloud_provider
    monkeypatch.setattr(cloud_provider, "SPOT_WAIT", 1.0)
    monkeypatch.setattr(cloud_provider, "DESCRIBE_EVERY", 0.2)
    hosts = ssh_hosts.start(2)
    booter = booted([ec2_source(moto_aws[EAST])], hosts, tmp_path)
    api = AWSAPI(EAST)
    stuck: set = set()

    def keep_pending(parsed, **_):
        for res in parsed.get("Reservations", []):
            for inst in res["Instances"]:
                if inst["InstanceId"] in stuck and inst["State"]["Name"] == "running":
                    inst["State"]["Name"] = "pending"

    def first_is_stuck(parsed, **_):
        if not stuck:
            stuck.add(parsed["Instances"][0]["InstanceId"])
    api.ec2.meta.events.register("after-call.ec2.DescribeInstances", keep_pending)
    api.ec2.meta.events.register("after-call.ec2.RunInstances", first_is_stuck)
    spec = ClusterSpec("slow", "aws", 1, {"region": EAST, "instance_type": "m5.large",
                                          "zone": [f"{EAST}a", f"{EAST}b"], "ssh_cidr": CIDR})
    state = State()
    try:
        [node] = C.up(state, spec, CloudProvider("aws", options=spec.options, api=api))
        assert node["info"]["zone"] == f"{EAST}b" and node["provider_id"] not in stuck
        [first] = stuck
        gone = moto_aws[EAST].describe_instances(InstanceIds=[first])["Reservations"][0][
            "Instances"][0]["State"]["Name"]
        assert gone in ("shutting-down", "terminated")
        assert [e["message"] for e in state.cluster_events("slow")] == [
            f"{EAST}a: spot request for m5.large not fulfilled in time → {EAST}b"]
        C.down(state, "slow")
        assert left(moto_aws[EAST], "slow") == []
    finally:
        booter.stopping.set()
        booter.join(10)


def test_a_region_just_preempted_goes_last(moto_aws, hyper_home):
    """A spot node of us-east-1 taken back (the scheduler's replacement path,
    ``cluster.replace``) ends its ledger row as preempted; the next launch asks us-west-2
    first."""
    state = State()
    state.put_cluster("pre", "aws", {"options": {"region": EAST}})
    info = {"cloud": "aws", "region": EAST, "zone": f"{EAST}a", "instance_type": "m5.large",
            "spot": True, "price": 0.05, "launched_at": 1.0}
    state.put_node("pre", "pre-0", slots=2, provider_id="i-0", info=info)
    state.ledger_launch("pre", "pre-0", "i-0", info)
    assert C.replace(state, object(), state.nodes("pre")[0]) == []  # no provider to relaunch
    [row] = state.ledger("pre")
    assert row["end_reason"] == "preempted" and row["ended_at"] is not None
    apis = {("aws", EAST): AWSAPI(EAST), ("aws", WEST): AWSAPI(WEST)}
    east, west = Refuse(apis["aws", EAST], {"*"}), Refuse(apis["aws", WEST], {"*"})
    offers = [Offer("aws", "m5.large", EAST, f"{EAST}a", True, 0.05, 2, 8),
              Offer("aws", "m5.large", WEST, f"{WEST}a", True, 0.07, 2, 8)]
    spec = ClusterSpec("pre2", "aws", 1, {"region": EAST, "instance_type": "m5.large",
                                          "ssh_cidr": CIDR})
    provider = CloudProvider("aws", options=spec.options, api=apis["aws", EAST], apis=apis,
                             offers=offers)
    result = provider.launch(spec)
    assert result.instances == [] and east.asked and west.asked
    steps = [e["message"] for e in state.cluster_events("pre2")]
    assert steps[0].startswith(f"{WEST}a: no spot capacity") and steps[0].endswith(f"{EAST}a")
    provider.terminate("pre2", [])
    assert left(moto_aws[EAST], "pre2") == [] and left(moto_aws[WEST], "pre2") == []


def test_max_cost_launches_nothing_more_and_says_so(moto_aws, hyper_home):
    state = State()
    state.cluster_uid("cap")
    import time
    state.ledger_launch("cap", "cap-0", "i-old", {
        "cloud": "aws", "region": EAST, "zone": f"{EAST}a", "instance_type": "m5.large",
        "spot": True, "price": 2.0, "launched_at": time.time() - 3600})  # $2 spent, running
    api = AWSAPI(EAST)
    asked = Refuse(api, set())  # records requests, refuses none
    spec = ClusterSpec("cap", "aws", 1, {"region": EAST, "instance_type": "m5.large",
                                         "ssh_cidr": CIDR, "max_cost": 4.5})
    provider = CloudProvider("aws", options=spec.options, api=api,
                             offers=[Offer("aws", "m5.large", EAST, f"{EAST}a", True, 1.0, 2, 8)])
    with pytest.raises(Exception) as e:
        C.up(state, spec, provider)
    assert "max_cost $4.50 of cluster cap" in str(e.value) and asked.asked == []
    assert any("max_cost" in x["message"] for x in state.cluster_events("cap", ("cluster",)))
    assert state.ledger("cap")[0]["ended_at"] is None  # nothing running is stopped
    provider.terminate("cap", [])


def test_gcp_zone_exhausted_then_the_next_zone_through_the_compute_stand_in(
        moto_aws, ssh_hosts, tmp_path, hyper_home, monkeypatch):
    pytest.importorskip("google.cloud.compute_v1")
    from google.auth.credentials import AnonymousCredentials

    from gcpfake import ComputeFake
    from hypercli.providers.gcp import GCPAPI
    fake = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
    hosts = ssh_hosts.start(1)
    booter = booted([gcp_source(fake)], hosts, tmp_path, publish=gcp_publisher(fake))
    fake.exhaust("us-central1-a")
    api = GCPAPI("proj", "us-central1", credentials=AnonymousCredentials())
    spec = ClusterSpec("g", "gcp", 1, {"project": "proj", "region": "us-central1",
                                       "zone": ["us-central1-a", "us-central1-b"],
                                       "instance_type": "e2-standard-4", "ssh_cidr": CIDR,
                                       "image": "projects/proj/global/images/x"})
    state = State()
    try:
        [node] = C.up(state, spec, CloudProvider("gcp", options=spec.options, api=api))
        assert node["info"]["zone"] == "us-central1-b"
        assert [e["message"] for e in state.cluster_events("g")] == [
            "us-central1-a: no spot capacity for e2-standard-4 → us-central1-b"]
        fake.fail("us-central1-c", "quota")  # then a quota error, and no offer left
        spec2 = ClusterSpec("g2", "gcp", 1, {**spec.options, "zone": ["us-central1-a",
                                                                      "us-central1-c"]})
        with pytest.raises(Exception) as e:
            C.up(state, spec2, CloudProvider("gcp", options=spec2.options, api=api))
        text = str(e.value)
        assert "us-central1-a: no spot capacity for e2-standard-4 → us-central1-c" in text
        assert "us-central1-c: quota 'CPUS' of gcp us-central1 → no offer left" in text
        assert "console.cloud.google.com/iam-admin/quotas" in (e.value.hint or "")
        C.down(state, "g")
        CloudProvider("gcp", options=spec2.options, api=api).terminate("g2", [])
        assert fake.instances == {z: {} for z in fake.zones}
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)
        fake.close()


def test_azure_allocation_failures_and_quota_name_each_step(hyper_home, tmp_path,
                                                            monkeypatch):
    pytest.importorskip("azure.mgmt.compute")
    from azurefake import ArmFake
    from test_azure import Token
    from hypercli.providers.azure import AzureAPI
    fake = ArmFake(tmp_path)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", fake.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(fake.ca))
    try:
        fake.no_sku_in("1")
        fake.no_capacity_in("2")
        api = AzureAPI("sub-1", "eastus", credential=Token())
        spec = ClusterSpec("az", "azure", 1, {
            "region": "eastus", "zone": ["1", "2"], "instance_type": "Standard_D4s_v5",
            "ssh_cidr": CIDR, "image": "Canonical:ubuntu-24_04-lts:server:latest"})
        provider = CloudProvider("azure", options=spec.options, api=api)
        with pytest.raises(Exception) as e:
            C.up(State(), spec, provider)
        text = str(e.value)
        assert "1: no spot capacity for Standard_D4s_v5 → 2" in text
        assert "2: no spot capacity for Standard_D4s_v5 → no offer left" in text
        fake.vm_limit = 0  # zone 3: the VM family's quota
        spec = ClusterSpec("az", "azure", 1, {**spec.options, "zone": ["1", "3"]})
        with pytest.raises(Exception) as e:
            C.up(State(), spec, provider)
        text = str(e.value)
        assert "1: no spot capacity for Standard_D4s_v5 → 3" in text
        assert "3: quota 'standardDSv5Family vCPUs' of azure eastus → no offer left" in text
        assert "portal.azure.com" in (e.value.hint or "")
        provider.terminate("az", [])
        assert fake.res == {}
    finally:
        fake.close()


def test_gc_ends_the_ledger_rows_of_the_instances_it_removed_once(moto_aws, hyper_home):
    """`hyper gc` (the state file lost its cluster) removes a cluster's instance: its open
    ledger row ends then, and a later gc or down does not move that end."""
    ec2 = moto_aws[EAST]
    image = ec2.describe_images(Owners=["self"])["Images"][0]["ImageId"]
    tags = [{"Key": "hyper:cluster", "Value": "orphan"}, {"Key": "hyper:node",
                                                          "Value": "orphan-0"}]
    iid = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, InstanceType="m5.large",
                            TagSpecifications=[{"ResourceType": "instance", "Tags": tags}])[
        "Instances"][0]["InstanceId"]
    state = State()
    state.ledger_launch("orphan", "orphan-0", iid, {"cloud": "aws", "region": EAST,
                                                    "price": 0.1, "launched_at": 1.0})
    state.ledger_launch("kept", "kept-0", "i-other", {"cloud": "aws", "region": EAST,
                                                      "price": 0.1, "launched_at": 1.0})
    removed = C.gc(state, "aws", {"region": EAST})
    assert f"instance {iid}" in removed
    rows = {r["node"]: r for r in state.ledger()}
    assert rows["orphan-0"]["end_reason"] == "gc" and rows["kept-0"]["ended_at"] is None
    ended = rows["orphan-0"]["ended_at"]
    C.gc(state, "aws", {"region": EAST})
    assert state.ledger_end("orphan", ["orphan-0"], reason="down") == 0
    assert state.ledger("orphan")[0]["ended_at"] == ended
