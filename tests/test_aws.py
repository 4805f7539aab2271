"""The aws CloudAPI (hypercli/providers/aws.py) through boto3 against moto (in-process): spot and
on-demand launches, tags on everything, the security group, key pair, user data, image lookup,
zone failover on an injected capacity error, quota errors, missing credentials, spot prices,
and teardown / gc leaving nothing."""

from __future__ import annotations

import base64

import boto3
import pytest
from botocore.exceptions import ClientError

moto = pytest.importorskip("moto")

from hypercli.errors import UsageError  # noqa: E402
from hypercli.providers.aws import AWSAPI  # noqa: E402
from hypercli.providers.cloud import (Boot, CapacityError, CloudSpec,  # noqa: E402
                                      CredentialsError, QuotaError)
from hypercli.providers.cloud_provider import remove_all  # noqa: E402

REGION = "us-east-1"


@pytest.fixture
def ec2(monkeypatch):
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": REGION, "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("HYPER_AWS_ENDPOINT_URL", raising=False)
    with moto.mock_aws():
        yield boto3.client("ec2", region_name=REGION)


def ami(ec2) -> str:
    return ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]


def spec(ec2, **kw) -> CloudSpec:
    base = dict(cluster="c1", count=2, region=REGION, instance_type="m5.large",
                image=ami(ec2), ssh_cidr="203.0.113.0/24", disk_gb=40)
    base.update(kw)
    return CloudSpec(**base)


def boot(nodes) -> Boot:
    return Boot({n: f"#cloud-config\n# {n}\n" for n in nodes}, "root",
                "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
                " hyper-c1")


def launch(api, s, nodes=("c1-0", "c1-1")):
    prepared = api.prepare(s, boot(nodes).ssh_public_key)
    return api.create(s, list(nodes), boot(nodes), prepared)


def tags(obj) -> dict:
    return {t["Key"]: t["Value"] for t in obj.get("Tags", [])}


def test_spot_launch_with_tags_key_group_user_data_and_disk(ec2):
    api = AWSAPI(REGION)
    vms, errors = launch(api, spec(ec2))
    assert errors == {} and sorted(v.node for v in vms) == ["c1-0", "c1-1"]
    inst = ec2.describe_instances(InstanceIds=[vms[0].id])["Reservations"][0]["Instances"][0]
    assert inst.get("InstanceLifecycle") == "spot" and vms[0].spot
    t = tags(inst)
    assert t["hyper:cluster"] == "c1" and t["hyper:node"] == vms[0].node and t["hyper:owner"]
    assert inst["KeyName"] == "hyper-c1"
    ud = ec2.describe_instance_attribute(InstanceId=vms[0].id, Attribute="userData")
    assert base64.b64decode(ud["UserData"]["Value"]).decode() == f"#cloud-config\n# {vms[0].node}\n"
    vol_id = inst["BlockDeviceMappings"][0]["Ebs"]["VolumeId"]
    vol = ec2.describe_volumes(VolumeIds=[vol_id])["Volumes"][0]
    assert vol["Size"] == 40 and tags(vol)["hyper:cluster"] == "c1"
    [sg] = ec2.describe_security_groups(GroupNames=["hyper-c1"])["SecurityGroups"]
    assert [(p["FromPort"], p["ToPort"], [r["CidrIp"] for r in p["IpRanges"]])
            for p in sg["IpPermissions"]] == [(22, 22, ["203.0.113.0/24"])]
    assert tags(sg)["hyper:cluster"] == "c1"
    [kp] = ec2.describe_key_pairs(KeyNames=["hyper-c1"])["KeyPairs"]
    assert tags(kp)["hyper:cluster"] == "c1"
    # prepare is idempotent: a second up reuses the group and the key pair
    api.prepare(spec(ec2), boot(["x"]).ssh_public_key)
    assert len(ec2.describe_security_groups(GroupNames=["hyper-c1"])["SecurityGroups"]) == 1


def test_on_demand_launch(ec2):
    vms, errors = launch(AWSAPI(REGION), spec(ec2, spot=False), nodes=("c1-0",))
    inst = ec2.describe_instances(InstanceIds=[vms[0].id])["Reservations"][0]["Instances"][0]
    assert errors == {} and "InstanceLifecycle" not in inst and not vms[0].spot


def inject(api, failing: dict):
    """Make RunInstances fail with ``failing[zone]`` (an EC2 error code) for those zones, at
    the botocore client boundary; returns the list of zones asked for."""
    asked = []

    def before(params, **_):
        zone = (params.get("Placement") or {}).get("AvailabilityZone")
        if zone is None and params.get("NetworkInterfaces"):
            subnet = params["NetworkInterfaces"][0]["SubnetId"]
            zone = next(z for z, s in prepared_subnets(api).items() if s == subnet)
        asked.append(zone)
        if zone in failing:
            raise ClientError({"Error": {"Code": failing[zone], "Message": "injected"}},
                              "RunInstances")
    api.ec2.meta.events.register("provide-client-params.ec2.RunInstances", before)
    return asked


def prepared_subnets(api):
    vpc = api.ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])[
        "Vpcs"][0]["VpcId"]
    return {s["AvailabilityZone"]: s["SubnetId"] for s in api.ec2.describe_subnets(
        Filters=[{"Name": "vpc-id", "Values": [vpc]}])["Subnets"]}


def test_zone_failover_on_capacity_error(ec2):
    api = AWSAPI(REGION)
    asked = inject(api, {f"{REGION}a": "InsufficientInstanceCapacity"})
    s = spec(ec2, zones=(f"{REGION}a", f"{REGION}b"), count=1)
    vms, errors = launch(api, s, nodes=("c1-0",))
    assert errors == {} and vms[0].zone == f"{REGION}b"
    assert asked == [f"{REGION}a", f"{REGION}b"]


def test_every_zone_out_of_capacity_is_an_error_per_node(ec2):
    api = AWSAPI(REGION)
    inject(api, {f"{REGION}a": "InsufficientInstanceCapacity",
                 f"{REGION}b": "InsufficientInstanceCapacity"})
    vms, errors = launch(api, spec(ec2, zones=(f"{REGION}a", f"{REGION}b")))
    assert vms == [] and set(errors) == {"c1-0", "c1-1"}
    assert all(isinstance(e, CapacityError) for e in errors.values())


def test_quota_error_is_not_retried_in_another_zone(ec2):
    api = AWSAPI(REGION)
    asked = inject(api, {f"{REGION}a": "VcpuLimitExceeded"})
    vms, errors = launch(api, spec(ec2, zones=(f"{REGION}a", f"{REGION}b"), count=1),
                         nodes=("c1-0",))
    assert isinstance(errors["c1-0"], QuotaError) and asked == [f"{REGION}a"]


def test_missing_credentials_say_how_to_configure_them(monkeypatch, tmp_path):
    for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HYPER_AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # never reached
    with pytest.raises(CredentialsError) as e:
        AWSAPI(REGION).check()
    assert "aws configure" in e.value.hint and e.value.exit_code == 2


def test_image_lookup_newest_baked_explicit_and_missing(ec2):
    api = AWSAPI(REGION)
    with pytest.raises(UsageError) as e:
        api.find_image(spec(ec2, image=None))
    assert "hyper image build --provider aws" in e.value.hint
    vms, _ = launch(api, spec(ec2, count=1), nodes=("c1-0",))
    made = []
    for n in range(2):
        img = ec2.create_image(InstanceId=vms[0].id, Name=f"hyper-node-cpu-1-{n}")["ImageId"]
        ec2.create_tags(Resources=[img], Tags=[{"Key": "hyper:image", "Value": "node"},
                                               {"Key": "hyper:variant", "Value": "cpu"}])
        made.append(img)
    found = api.find_image(spec(ec2, image=None))
    assert found in made
    newest = max(ec2.describe_images(ImageIds=made)["Images"],
                 key=lambda i: i["CreationDate"])["ImageId"]
    assert found == newest
    with pytest.raises(UsageError):
        api.find_image(spec(ec2, image=None, variant="gpu"))
    with pytest.raises(UsageError, match="ami-00000000000000000 does not exist"):
        api.find_image(spec(ec2, image="ami-00000000000000000"))


def test_teardown_and_gc_leave_nothing(ec2):
    api = AWSAPI(REGION)
    launch(api, spec(ec2))
    launch(api, spec(ec2, cluster="other", count=1), nodes=("other-0",))
    kinds = {r.kind for r in api.resources("c1")}
    assert {"instance", "key_pair", "security_group", "volume"} <= kinds
    removed = remove_all(api, "c1")
    assert any(x.startswith("instance ") for x in removed)
    assert api.resources("c1") == [] and api.describe("c1") == []
    # gc (the state file deleted): every hyper-tagged resource but the kept clusters'
    assert {r.cluster for r in api.resources(None)} == {"other"}
    assert remove_all(api, None, keep={"other"}) == []
    assert remove_all(api, None) and api.resources(None) == []


def test_spot_prices_by_zone(ec2):
    prices = AWSAPI(REGION).spot_price(spec(ec2))
    assert prices and all(z.startswith(REGION) and p > 0 for z, p in prices.items())
    assert AWSAPI(REGION).spot_price(spec(ec2, spot=False)) == {}
