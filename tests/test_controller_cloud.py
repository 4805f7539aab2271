"""The cloud identity of a controller instance (hypercli/providers/aws.py,
:func:`~hypercli.providers.aws.controller_policy`): a role scoped like the nodes' storage
roles, that may launch, describe and terminate only instances tagged for its user's
clusters, pass only the clusters' roles to EC2, and read the recipe's storage; checked with
the role's own credentials against moto with its IAM enforcement on (EC2's resources and
condition keys evaluated as AWS does: tests/awsiam.py), as the nodes' roles are in
tests/test_aws_identity.py."""

from __future__ import annotations

import json

import boto3
import pytest

moto = pytest.importorskip("moto")

from moto.core import set_initial_no_auth_action_count  # noqa: E402

from awsiam import enforced  # noqa: E402
from test_aws import KEY, REGION, boot, fake_credentials, instance, spec  # noqa: E402
from test_aws_identity import ADMIN  # noqa: E402

from hypercli.providers.aws import AWSAPI, controller_policy, role_name  # noqa: E402
from hypercli.providers.cloud import TAG_CLUSTER, TAG_OWNER, CloudSpec, owner  # noqa: E402
from hypercli.providers.cloud_provider import remove_all  # noqa: E402
from hypercli.recipe.access import Grant  # noqa: E402

STORAGE = (Grant("s3", "outs", "runs", True, True),)
CONTROLLER = CloudSpec(cluster="ctl-me", cluster_id="id-ctl", region=REGION, grants=STORAGE)


def test_policy_reads_storage_and_acts_on_tagged_resources_only():
    doc = controller_policy("me@laptop", "123456789012", STORAGE)
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["EndTagged"]["Condition"] == {
        "StringEquals": {f"ec2:ResourceTag/{TAG_OWNER}": "me@laptop"},
        "StringLike": {f"ec2:ResourceTag/{TAG_CLUSTER}": "*"}}
    assert by_sid["PassClusterRoles"]["Resource"] == "arn:aws:iam::123456789012:role/hyper/*"
    actions = {a for s in doc["Statement"] for a in
               (s["Action"] if isinstance(s["Action"], list) else [s["Action"]])}
    assert not {a for a in actions if a.startswith("iam:")} - {"iam:PassRole"}
    assert "s3:PutObject" not in actions and "s3:GetObject" in actions  # reads only


def test_the_controllers_role_drives_its_users_clusters_and_nothing_else(monkeypatch):
    fake_credentials(monkeypatch)

    @set_initial_no_auth_action_count(3)
    def run():
        root = boto3.client("iam", region_name=REGION)
        root.create_user(UserName="admin")
        root.put_user_policy(UserName="admin", PolicyName="all",
                             PolicyDocument=json.dumps(ADMIN))
        key = root.create_access_key(UserName="admin")["AccessKey"]
        admin = boto3.Session(aws_access_key_id=key["AccessKeyId"],
                              aws_secret_access_key=key["SecretAccessKey"], region_name=REGION)
        s3, ec2, iam = admin.client("s3"), admin.client("ec2"), admin.client("iam")
        s3.create_bucket(Bucket="outs")
        s3.put_object(Bucket="outs", Key="runs/wf-1/t-0/manifest.json", Body=b"out")
        image = ec2.register_image(Name="base-image", Architecture="x86_64")["ImageId"]
        api = AWSAPI(REGION, session=admin)
        c1 = spec(image, grants=STORAGE)
        prepared = api.prepare(c1, KEY)  # the cluster as `hyper up` leaves it
        [node], _ = api.create(c1, ["c1-0"], boot(["c1-0"]), prepared)
        untagged = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1)["Instances"][0]
        theirs = ec2.run_instances(ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{
            "ResourceType": "instance", "Tags": [{"Key": TAG_OWNER, "Value": "someone@else"},
                                                 {"Key": TAG_CLUSTER, "Value": "c9"}]}])[
            "Instances"][0]
        assert api.controller_identity(CONTROLLER, owner()) == {
            "instance_profile": role_name(CONTROLLER)}
        name = role_name(CONTROLLER)
        sts = admin.client("sts")
        iam.update_assume_role_policy(RoleName=name, PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
                "AWS": sts.get_caller_identity()["Arn"]}, "Action": "sts:AssumeRole"}]}))
        creds = sts.assume_role(RoleArn=iam.get_role(RoleName=name)["Role"]["Arn"],
                                RoleSessionName="controller")["Credentials"]
        ctl = boto3.Session(aws_access_key_id=creds["AccessKeyId"],
                            aws_secret_access_key=creds["SecretAccessKey"],
                            aws_session_token=creds["SessionToken"], region_name=REGION)
        with enforced():
            ctl_api = AWSAPI(REGION, session=ctl)
            assert [v.id for v in ctl_api.describe("c1")] == [node.id]
            # a replacement node: launched tagged, with the cluster's key, group and role
            [new], errors = ctl_api.create(c1, ["c1-1"], boot(["c1-1"]), prepared)
            assert errors == {}
            got = instance(ec2, new.id)
            assert got["IamInstanceProfile"]["Arn"].endswith("/" + prepared["instance_profile"])
            ctl_api.terminate("c1", [node.id])  # its user's cluster's node
            assert instance(ec2, node.id)["State"]["Name"] in ("shutting-down", "terminated")
            assert ctl.client("s3").get_object(
                Bucket="outs", Key="runs/wf-1/t-0/manifest.json")["Body"].read() == b"out"
            c_ec2, c_iam, c_s3 = ctl.client("ec2"), ctl.client("iam"), ctl.client("s3")
            beyond = {
                "terminate an untagged instance": lambda: c_ec2.terminate_instances(
                    InstanceIds=[untagged["InstanceId"]]),
                "terminate another user's node": lambda: c_ec2.terminate_instances(
                    InstanceIds=[theirs["InstanceId"]]),
                "launch untagged": lambda: c_ec2.run_instances(
                    ImageId=image, MinCount=1, MaxCount=1),
                "launch as another user": lambda: c_ec2.run_instances(
                    ImageId=image, MinCount=1, MaxCount=1, TagSpecifications=[{
                        "ResourceType": "instance", "Tags": [
                            {"Key": TAG_OWNER, "Value": "someone@else"},
                            {"Key": TAG_CLUSTER, "Value": "c9"}]}]),
                "widen its own role": lambda: c_iam.put_role_policy(
                    RoleName=name, PolicyName="more", PolicyDocument=json.dumps(ADMIN)),
                "make an access key": lambda: c_iam.create_access_key(UserName="admin"),
                "write the storage": lambda: c_s3.put_object(
                    Bucket="outs", Key="runs/wf-1/t-0/manifest.json", Body=b"mine"),
                "read outside the storage": lambda: c_s3.list_objects_v2(Bucket="outs"),
            }
            for what, call in beyond.items():
                with pytest.raises(Exception, match="AccessDenied|UnauthorizedOperation"):
                    call()
                    pytest.fail(what)
        for inst in (untagged, theirs):
            assert instance(ec2, inst["InstanceId"])["State"]["Name"] == "running"
        # `hyper down --controller`: its role and profile go as a cluster's do (its trust
        # as hypercli made it: EC2's alone)
        from hypercli.providers.aws import EC2_TRUST
        iam.update_assume_role_policy(RoleName=name, PolicyDocument=json.dumps(EC2_TRUST))
        removed = remove_all(api, CONTROLLER.cluster, timeout=60)
        assert {f"role {name}", f"instance_profile {name}"} <= set(removed)
        assert name not in [r["RoleName"] for r in iam.list_roles()["Roles"]]
        assert name not in [p["InstanceProfileName"]
                            for p in iam.list_instance_profiles()["InstanceProfiles"]]
    with moto.mock_aws():
        run()
