"""The aws CloudAPI (hypercli/providers/aws.py) with the real boto3 client against moto, in
process: spot and on-demand launches, tags, user data, disk, key pair and SSH-only security
group; image lookup; zone failover, capacity and quota errors returned by EC2 at the client
boundary; missing, refused and insufficient credentials; teardown and gc leaving nothing
tagged; spot prices. Nothing leaves the process: moto answers every AWS call."""

from __future__ import annotations

import base64
from datetime import datetime, timezone

import boto3
import pytest
from botocore.awsrequest import AWSResponse
from botocore.exceptions import ClientError

moto = pytest.importorskip("moto")

from moto.core import set_initial_no_auth_action_count  # noqa: E402

from hypercli.errors import UsageError  # noqa: E402
from hypercli.providers import aws as aws_module  # noqa: E402
from hypercli.providers.aws import AWSAPI, aws_errors  # noqa: E402
from hypercli.providers.cloud import (Boot, CapacityError, CloudError,  # noqa: E402
                                      CloudSpec, CredentialsError, QuotaError)
from hypercli.providers.cloud_provider import remove_all  # noqa: E402

REGION = "us-east-1"
A, B = f"{REGION}a", f"{REGION}b"
CIDR = "203.0.113.0/24"
KEY = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl "
       "hyper-c1")
OTHER_KEY = ("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIDY2yK3exrziB1m0pdw6esoaa5OmizW4/4PzCvR2tnwE "
             "hyper-c1")


def fake_credentials(monkeypatch) -> None:
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true",
                 "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "HYPER_AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)


@pytest.fixture
def ec2(monkeypatch):
    """moto's EC2 in process (fake credentials in the environment) and a client of it."""
    fake_credentials(monkeypatch)
    with moto.mock_aws():
        yield boto3.client("ec2", region_name=REGION)


@pytest.fixture
def image(ec2) -> str:
    """An AMI to boot (moto's default images are not loaded: they take seconds)."""
    return ec2.register_image(Name="base-image", Architecture="x86_64")["ImageId"]


def spec(image, **kw) -> CloudSpec:
    base = dict(cluster="c1", count=2, region=REGION, instance_type="m5.large", image=image,
                ssh_cidr=CIDR, disk_gb=40)
    return CloudSpec(**{**base, **kw})


def boot(nodes) -> Boot:
    return Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root", KEY)


def launch(api, s, nodes=("c1-0", "c1-1")):
    return api.create(s, list(nodes), boot(nodes), api.prepare(s, KEY))


def tags(obj) -> dict:
    return {t["Key"]: t["Value"] for t in obj.get("Tags") or []}


def ingress(ec2, group: str) -> list[tuple]:
    """The group's inbound permissions as (protocol, from port, to port, IPv4 ranges, IPv6
    ranges, source groups), sorted."""
    [sg] = ec2.describe_security_groups(GroupIds=[group])["SecurityGroups"]
    return sorted((p["IpProtocol"], p.get("FromPort"), p.get("ToPort"),
                   [r["CidrIp"] for r in p.get("IpRanges") or []],
                   [r["CidrIpv6"] for r in p.get("Ipv6Ranges") or []],
                   [g["GroupId"] for g in p.get("UserIdGroupPairs") or []])
                  for p in sg["IpPermissions"])


def instance(ec2, iid) -> dict:
    return ec2.describe_instances(InstanceIds=[iid])["Reservations"][0]["Instances"][0]


class RunInstances:
    """What RunInstances was asked (the serialized request of each call), answering with
    EC2's error ``answers[zone]`` for those zones: at the botocore client boundary, so the
    error goes through botocore's own error parsing as a real EC2 answer would."""

    def __init__(self, api, prepared: dict, answers: dict | None = None):
        self.subnet_zone = {s: z for z, s in prepared["subnets"].items()}
        self.answers, self.calls, self.zones = answers or {}, [], []
        api.ec2.meta.events.register("before-call.ec2.RunInstances", self.before_call)

    def before_call(self, params, **_):
        body = params["body"]
        zone = body.get("Placement.AvailabilityZone") or self.subnet_zone.get(
            body.get("NetworkInterface.1.SubnetId"))
        self.calls.append(body)
        self.zones.append(zone)
        if zone in self.answers:
            error = {"Code": self.answers[zone], "Message": f"no {zone} for you"}
            return (AWSResponse(params["url"], 400, {}, None),
                    {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 400}})
        return None


# -- launching ---------------------------------------------------------------------------------
def test_spot_launch_tags_user_data_disk_key_and_ssh_only_group(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image, zones=(B,), max_price=0.25)
    prepared = api.prepare(s, KEY)
    runs = RunInstances(api, prepared)
    vms, errors = api.create(s, ["c1-0", "c1-1"], boot(["c1-0", "c1-1"]), prepared)
    assert errors == {} and sorted(v.node for v in vms) == ["c1-0", "c1-1"]
    assert all(v.spot and v.zone == B and v.state in ("pending", "running") for v in vms)
    inst = instance(ec2, vms[0].id)
    assert inst["InstanceLifecycle"] == "spot" and inst["KeyName"] == "hyper-c1"
    t = tags(inst)
    assert (t["hyper:cluster"], t["hyper:node"], t["Name"]) == ("c1", vms[0].node, vms[0].node)
    assert t["hyper:owner"] == aws_module.owner()
    user_data = ec2.describe_instance_attribute(InstanceId=vms[0].id, Attribute="userData")
    assert base64.b64decode(user_data["UserData"]["Value"]).decode() == \
        f"#cloud-config\n# {vms[0].node}\n"
    shutdown = ec2.describe_instance_attribute(InstanceId=vms[0].id,
                                               Attribute="instanceInitiatedShutdownBehavior")
    assert shutdown["InstanceInitiatedShutdownBehavior"]["Value"] == "terminate"
    # the root volume: the image's root device, disk_gb GiB, gp3, tagged like its instance
    root = ec2.describe_images(ImageIds=[image])["Images"][0]["RootDeviceName"]
    [mapping] = inst["BlockDeviceMappings"]
    assert mapping["DeviceName"] == root and mapping["Ebs"]["DeleteOnTermination"]
    vol = ec2.describe_volumes(VolumeIds=[mapping["Ebs"]["VolumeId"]])["Volumes"][0]
    assert (vol["Size"], vol["VolumeType"]) == (40, "gp3")
    assert tags(vol)["hyper:cluster"] == "c1" and tags(vol)["hyper:node"] == vms[0].node
    # what EC2 was asked: a one-time spot request terminated on interruption, at most
    # max_price; tags also on the network interface and the spot request
    body = runs.calls[0]
    assert body["InstanceMarketOptions.MarketType"] == "spot"
    assert body["InstanceMarketOptions.SpotOptions.SpotInstanceType"] == "one-time"
    assert body["InstanceMarketOptions.SpotOptions.InstanceInterruptionBehavior"] == "terminate"
    assert float(body["InstanceMarketOptions.SpotOptions.MaxPrice"]) == 0.25
    kinds = {v for k, v in body.items() if k.endswith(".ResourceType")}
    assert kinds == {"instance", "volume", "network-interface", "spot-instances-request"}
    assert (body["MinCount"], body["MaxCount"]) == (1, 1)
    # the key pair holds our key; the instance is in the cluster's group (rules: next test)
    [kp] = ec2.describe_key_pairs(KeyNames=["hyper-c1"], IncludePublicKey=True)["KeyPairs"]
    assert kp["PublicKey"].split()[1] == KEY.split()[1] and tags(kp)["hyper:cluster"] == "c1"
    [sg] = ec2.describe_security_groups(GroupIds=[prepared["security_group"]])[
        "SecurityGroups"]
    assert sg["GroupName"] == "hyper-c1" and tags(sg)["hyper:owner"] == aws_module.owner()
    assert [g["GroupId"] for g in inst["NetworkInterfaces"][0]["Groups"]] == [sg["GroupId"]]


def test_the_group_admits_all_traffic_from_itself_and_only_ssh_from_outside(ec2, image):
    api = AWSAPI(REGION)
    group = api.prepare(spec(image), KEY)["security_group"]
    # every protocol and port from the group's own members (the cluster's nodes, at their
    # private addresses); from anywhere else only TCP 22 from ssh_cidr
    assert ingress(ec2, group) == [("-1", None, None, [], [], [group]),
                                   ("tcp", 22, 22, [CIDR], [], [])]
    rules = ec2.describe_security_group_rules(
        Filters=[{"Name": "group-id", "Values": [group]}])["SecurityGroupRules"]
    [mesh] = [r for r in rules if not r["IsEgress"] and r["IpProtocol"] == "-1"]
    assert mesh["ReferencedGroupInfo"]["GroupId"] == group and "CidrIpv4" not in mesh
    # kept, not revoked and added again, when prepare runs again (a new caller address);
    # a rule from another group (here: the VPC's default group) is revoked
    default = ec2.describe_security_groups(Filters=[
        {"Name": "group-name", "Values": ["default"]}])["SecurityGroups"][0]["GroupId"]
    ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[{
        "IpProtocol": "-1", "UserIdGroupPairs": [{"GroupId": default}]}])
    calls = []
    for op in ("AuthorizeSecurityGroupIngress", "RevokeSecurityGroupIngress"):
        api.ec2.meta.events.register(f"before-call.ec2.{op}",
                                     lambda params, op=op, **_: calls.append((op, params)))
    api.prepare(spec(image, ssh_cidr="198.51.100.7/32"), KEY)
    assert ingress(ec2, group) == [("-1", None, None, [], [], [group]),
                                   ("tcp", 22, 22, ["198.51.100.7/32"], [], [])]
    assert [op for op, _ in calls] == ["RevokeSecurityGroupIngress",
                                       "AuthorizeSecurityGroupIngress"]
    assert mesh["SecurityGroupRuleId"] not in str(calls[0][1])
    calls.clear()
    api.prepare(spec(image, ssh_cidr="198.51.100.7/32"), KEY)
    assert calls == []  # nothing to change


def test_nodes_record_their_private_address(ec2, image):
    api = AWSAPI(REGION)
    vms, _ = launch(api, spec(image, count=1), nodes=("c1-0",))
    private = instance(ec2, vms[0].id)["PrivateIpAddress"]
    assert vms[0].private_ip == private and api.describe("c1")[0].private_ip == private


def test_on_demand_launch_asks_for_no_spot_capacity(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image, spot=False, disk_gb=12)
    prepared = api.prepare(s, KEY)
    runs = RunInstances(api, prepared)
    vms, errors = api.create(s, ["c1-0"], boot(["c1-0"]), prepared)
    inst = instance(ec2, vms[0].id)
    assert errors == {} and "InstanceLifecycle" not in inst and not vms[0].spot
    assert not any(k.startswith("InstanceMarketOptions") for k in runs.calls[0])
    vol_id = inst["BlockDeviceMappings"][0]["Ebs"]["VolumeId"]
    assert ec2.describe_volumes(VolumeIds=[vol_id])["Volumes"][0]["Size"] == 12


def test_prepare_is_idempotent_and_follows_a_new_address_and_key(ec2, image):
    api = AWSAPI(REGION)
    first = api.prepare(spec(image), KEY)
    assert api.prepare(spec(image), KEY) == first
    assert first["key_name"] == "hyper-c1" and {A, B} <= set(first["subnets"])
    assert len(ec2.describe_security_groups(
        Filters=[{"Name": "group-name", "Values": ["hyper-c1"]}])["SecurityGroups"]) == 1
    # the caller moved (a new address) and the cluster key was made anew
    again = api.prepare(spec(image, ssh_cidr="198.51.100.7/32"), OTHER_KEY)
    assert again["security_group"] == first["security_group"]
    group = first["security_group"]
    assert ingress(ec2, group) == [("-1", None, None, [], [], [group]),
                                   ("tcp", 22, 22, ["198.51.100.7/32"], [], [])]
    [kp] = ec2.describe_key_pairs(KeyNames=["hyper-c1"], IncludePublicKey=True)["KeyPairs"]
    assert kp["PublicKey"].split()[1] == OTHER_KEY.split()[1]
    assert tags(kp)["hyper:cluster"] == "c1"
    # a rule added by hand is revoked; an IPv6 range is an IPv6 rule
    ec2.authorize_security_group_ingress(GroupId=first["security_group"], IpPermissions=[{
        "IpProtocol": "tcp", "FromPort": 80, "ToPort": 80, "IpRanges": [{"CidrIp": CIDR}]}])
    api.prepare(spec(image, ssh_cidr="2001:db8::/64"), OTHER_KEY)
    assert ingress(ec2, group) == [("-1", None, None, [], [], [group]),
                                   ("tcp", 22, 22, [], ["2001:db8::/64"], [])]


def test_user_data_over_the_ec2_limit_is_that_node_s_error(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image)
    docs = {"c1-0": "#cloud-config\n", "c1-1": "#cloud-config\n" + "x" * 20000}
    vms, errors = api.create(s, ["c1-0", "c1-1"], Boot(docs, "root", KEY),
                             api.prepare(s, KEY))
    assert [v.node for v in vms] == ["c1-0"] and "16384" in str(errors["c1-1"])


# -- images ------------------------------------------------------------------------------------
def test_image_newest_baked_by_creation_date_explicit_and_missing(ec2, monkeypatch):
    api = AWSAPI(REGION)
    with pytest.raises(UsageError) as e:
        api.find_image(spec(None))
    assert "hyper image build --provider aws" in e.value.hint and "ami-" in e.value.hint

    def bake(name, variant, when):
        monkeypatch.setattr("moto.ec2.models.amis.utcnow", lambda: when)
        img = ec2.register_image(Name=name, Architecture="x86_64")["ImageId"]
        ec2.create_tags(Resources=[img], Tags=[{"Key": "hyper:image", "Value": "node"},
                                               {"Key": "hyper:variant", "Value": variant}])
        return img
    bake("hyper-node-cpu-1-a", "cpu", datetime(2024, 1, 1, tzinfo=timezone.utc))
    newest = bake("hyper-node-cpu-1-b", "cpu", datetime(2025, 5, 1, tzinfo=timezone.utc))
    bake("hyper-node-cpu-1-c", "cpu", datetime(2023, 1, 1, tzinfo=timezone.utc))  # listed last
    gpu = bake("hyper-node-gpu-1-a", "gpu", datetime(2026, 1, 1, tzinfo=timezone.utc))
    plain = ec2.register_image(Name="untagged", Architecture="x86_64")["ImageId"]
    assert api.find_image(spec(None)) == newest
    assert api.find_image(spec(None, variant="gpu")) == gpu
    assert api.find_image(spec(plain)) == plain  # an explicit AMI, tagged or not
    with pytest.raises(UsageError, match="ami-0123456789abcdef0 does not exist"):
        api.find_image(spec("ami-0123456789abcdef0"))


# -- zones, capacity, quota --------------------------------------------------------------------
def test_capacity_error_in_one_zone_launches_in_the_next(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image, zones=(A, B))
    prepared = api.prepare(s, KEY)
    runs = RunInstances(api, prepared, {A: "InsufficientInstanceCapacity"})
    vms, errors = api.create(s, ["c1-0", "c1-1"], boot(["c1-0", "c1-1"]), prepared)
    assert errors == {} and [v.zone for v in vms] == [B, B]
    assert {instance(ec2, v.id)["Placement"]["AvailabilityZone"] for v in vms} == {B}
    assert runs.zones == [A, B, B]  # the zone out of capacity is not asked again


def test_every_zone_out_of_capacity_gives_each_node_an_error(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image, zones=(A, B))
    prepared = api.prepare(s, KEY)
    runs = RunInstances(api, prepared, {A: "InsufficientInstanceCapacity", B: "Unsupported"})
    vms, errors = api.create(s, ["c1-0", "c1-1"], boot(["c1-0", "c1-1"]), prepared)
    assert vms == [] and set(errors) == {"c1-0", "c1-1"}
    assert all(isinstance(e, CapacityError) and e.code == "Unsupported" and B in str(e)
               for e in errors.values())  # the last zone's answer
    assert runs.zones == [A, B]
    assert api.describe("c1") == []


def test_without_zones_ec2_picks_then_each_zone_is_tried(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image)
    prepared = api.prepare(s, KEY)
    runs = RunInstances(api, prepared, {None: "InsufficientInstanceCapacity",
                                        A: "InsufficientInstanceCapacity"})
    vms, errors = api.create(s, ["c1-0"], boot(["c1-0"]), prepared)
    assert errors == {} and vms[0].zone == B and runs.zones == [None, A, B]


def test_quota_error_is_not_retried_in_another_zone_or_for_other_nodes(ec2, image):
    api = AWSAPI(REGION)
    s = spec(image, zones=(A, B))
    prepared = api.prepare(s, KEY)
    runs = RunInstances(api, prepared, {A: "VcpuLimitExceeded"})
    vms, errors = api.create(s, ["c1-0", "c1-1"], boot(["c1-0", "c1-1"]), prepared)
    assert vms == [] and runs.zones == [A]
    assert all(isinstance(e, QuotaError) and e.code == "VcpuLimitExceeded"
               for e in errors.values()) and set(errors) == {"c1-0", "c1-1"}


@pytest.mark.parametrize("code, cls", [
    ("InsufficientInstanceCapacity", CapacityError), ("SpotMaxPriceTooLow", CapacityError),
    ("MaxSpotInstanceCountExceeded", QuotaError), ("InstanceLimitExceeded", QuotaError),
    ("AuthFailure", CredentialsError), ("ExpiredToken", CredentialsError),
    ("InvalidParameterValue", CloudError)])
def test_ec2_error_codes_map_to_hypercli_errors(code, cls):
    with pytest.raises(cls) as e:
        with aws_errors("launching c1-0"):
            raise ClientError({"Error": {"Code": code, "Message": "m"}}, "RunInstances")
    assert type(e.value) is cls and code in str(e.value) and "launching c1-0" in str(e.value)


# -- credentials -------------------------------------------------------------------------------
def test_missing_credentials_say_how_to_configure_them(monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE",
              "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_FULL_URI",
              "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI", "HYPER_AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    api = AWSAPI(REGION)
    sent = []
    for service in ("sts", "ec2"):  # a request never leaves: no credentials to sign it
        api.client(service).meta.events.register("before-send", lambda **kw: sent.append(kw))
    for call in (api.check, api.resources, lambda: api.describe("c1")):
        with pytest.raises(CredentialsError) as e:
            call()
        assert e.value.exit_code == 2
        assert all(w in e.value.hint for w in ("aws configure", "AWS_PROFILE",
                                                "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))
    assert sent == []


def test_unknown_profile_is_a_credentials_error(monkeypatch, tmp_path):
    (tmp_path / "empty").write_text("")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "empty"))
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile")
    with pytest.raises(CredentialsError, match="no-such-profile"):
        AWSAPI(REGION).check()


def test_refused_and_insufficient_credentials(ec2):
    @set_initial_no_auth_action_count(0)  # moto checks every request's signature
    def refused(call):
        with pytest.raises(CredentialsError) as e:
            call()
        return e.value
    api = AWSAPI(REGION)
    sts, ec2_ = refused(api.check), refused(lambda: api.describe("c1"))
    assert "InvalidClientTokenId" in str(sts) and "AuthFailure" in str(ec2_)
    assert "aws configure" in sts.hint and "aws configure" in ec2_.hint

    @set_initial_no_auth_action_count(2)  # a real user and key, with no permission at all
    def powerless():
        iam = boto3.client("iam", region_name=REGION)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        session = boto3.Session(aws_access_key_id=key["AccessKeyId"],
                                aws_secret_access_key=key["SecretAccessKey"],
                                region_name=REGION)
        api = AWSAPI(REGION, session=session)
        assert api.check().startswith("account ")  # STS needs no permission
        with pytest.raises(CredentialsError) as e:
            api.resources("c1")
        return e.value
    denied = powerless()
    assert "IAM" in denied.hint and "aws configure" not in denied.hint


def test_endpoint_seam_and_region(monkeypatch):
    fake_credentials(monkeypatch)
    monkeypatch.setenv("HYPER_AWS_ENDPOINT_URL", "http://127.0.0.1:5999")
    api = AWSAPI("eu-west-1")
    assert api.ec2.meta.endpoint_url == "http://127.0.0.1:5999"
    assert api.client("sts").meta.endpoint_url == "http://127.0.0.1:5999"
    assert api.ec2.meta.region_name == "eu-west-1" and api.ec2 is api.ec2
    assert AWSAPI("").region == REGION  # AWS_DEFAULT_REGION
    monkeypatch.delenv("AWS_DEFAULT_REGION")
    monkeypatch.setenv("AWS_CONFIG_FILE", "/nonexistent")
    with pytest.raises(UsageError, match="no AWS region"):
        AWSAPI("").client("ec2")


# -- describe, teardown, gc --------------------------------------------------------------------
def test_describe_maps_states_and_spot_termination(ec2, image):
    api = AWSAPI(REGION)
    vms, _ = launch(api, spec(image, count=3), nodes=("c1-0", "c1-1", "c1-2"))
    by_node = {v.node: v.id for v in vms}
    ec2.terminate_instances(InstanceIds=[by_node["c1-1"]])  # the user, not the cloud: gone
    reclaimed = by_node["c1-2"]

    def spot_interruption(parsed, **_):  # EC2's record of an instance it took back
        for r in parsed.get("Reservations", []):
            for i in r["Instances"]:
                if i["InstanceId"] == reclaimed:
                    i["State"] = {"Code": 48, "Name": "terminated"}
                    i["StateReason"] = {"Code": "Server.SpotInstanceTermination",
                                        "Message": "Server.SpotInstanceTermination"}
    api.ec2.meta.events.register("after-call.ec2.DescribeInstances", spot_interruption)
    seen = {v.node: v.state for v in api.describe("c1")}
    assert seen == {"c1-0": "running", "c1-2": "preempted"}
    api.terminate("c1", [by_node["c1-0"], "i-0123456789abcdef0"])  # an unknown id is skipped
    assert instance(ec2, by_node["c1-0"])["State"]["Name"] in ("shutting-down", "terminated")


def test_teardown_leaves_nothing_and_gc_finds_every_cluster(ec2, image):
    api = AWSAPI(REGION)
    launch(api, spec(image, zones=(A,)))
    launch(api, spec(image, cluster="other", count=1), nodes=("other-0",))
    address = ec2.allocate_address(Domain="vpc", TagSpecifications=[{
        "ResourceType": "elastic-ip", "Tags": [{"Key": "hyper:cluster", "Value": "c1"}]}])
    held = api.resources("c1")
    kinds = [r.kind for r in held]
    assert {"instance", "disk", "public_ip", "key_pair", "security_group"} <= set(kinds)
    order = ["instance", "spot_request", "nic", "disk", "public_ip", "key_pair",
             "security_group"]
    assert kinds == sorted(kinds, key=order.index) and {r.cluster for r in held} == {"c1"}
    assert kinds.count("instance") == 2
    removed = api.delete(held)
    assert sum(x.startswith("instance ") for x in removed) == 2
    assert f"public_ip {address['AllocationId']}" in removed
    assert "key_pair hyper-c1" in removed
    assert api.resources("c1") == [] and api.describe("c1") == []
    assert api.delete(held) == []  # all gone already: nothing removed, no error
    # gc: nothing known of the state file, everything tagged by hypercli is found
    assert {r.cluster for r in api.resources(None)} == {"other"}
    assert remove_all(api, None, keep={"other"}) == []
    assert remove_all(api, None) and api.resources(None) == []
    left = ec2.describe_instances(Filters=[{"Name": "tag-key", "Values": ["hyper:cluster"]}])
    assert {i["State"]["Name"] for r in left["Reservations"] for i in r["Instances"]} == \
        {"terminated"}
    assert ec2.describe_security_groups(
        Filters=[{"Name": "tag-key", "Values": ["hyper:cluster"]}])["SecurityGroups"] == []


def test_a_disk_still_in_use_is_retried_then_named(ec2, image, monkeypatch):
    api = AWSAPI(REGION)
    api.prepare(spec(image), KEY)
    stranger = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]
    disk = ec2.create_volume(AvailabilityZone=stranger["Placement"]["AvailabilityZone"], Size=1,
                             TagSpecifications=[{"ResourceType": "volume", "Tags": [
                                 {"Key": "hyper:cluster", "Value": "c1"}]}])["VolumeId"]
    ec2.attach_volume(VolumeId=disk, InstanceId=stranger["InstanceId"], Device="/dev/sdf")
    tries = []
    api.ec2.meta.events.register("before-call.ec2.DeleteVolume", lambda **kw: tries.append(1))
    monkeypatch.setattr(aws_module, "BUSY_PAUSE", 0.01)
    with pytest.raises(CloudError) as e:  # an instance hypercli does not own holds the disk
        api.delete(api.resources("c1"))
    assert e.value.code == "VolumeInUse" and disk in str(e.value)
    assert len(tries) == aws_module.BUSY_TRIES
    assert [r.kind for r in api.resources("c1")] == ["disk"]  # the rest went
    ec2.detach_volume(VolumeId=disk, InstanceId=stranger["InstanceId"], Device="/dev/sdf")
    assert api.delete(api.resources("c1")) == [f"disk {disk}"]


# -- prices ------------------------------------------------------------------------------------
def test_spot_prices_by_zone(ec2, image):
    api = AWSAPI(REGION)
    prices = api.spot_price(spec(image))
    assert {A, B} <= set(prices) and all(p > 0 for p in prices.values())
    assert set(api.spot_price(spec(image, zones=(B,)))) == {B}
    assert api.spot_price(spec(image, spot=False)) == {}
