"""The storage identity of an aws cluster (hypercli/providers/aws.py, "Storage identity"):
an IAM role and instance profile scoped to the recipe's buckets, IMDSv2 with one hop, and
the node's boto3 reaching the role's credentials through the metadata service.

moto enforces IAM policies when its authorisation checks are on, for an assumed role's
credentials too; it cannot evaluate a trust policy whose principal is a service
(``ec2.amazonaws.com``: moto fails on it), so the test that assumes the role first lets the
test's admin user assume it. Everything else is the role as hypercli made it."""

from __future__ import annotations

import json
import boto3
import pytest

moto = pytest.importorskip("moto")

from moto.core import set_initial_no_auth_action_count  # noqa: E402

from imds import IMDS  # noqa: E402
from test_aws import REGION, fake_credentials, instance, launch, spec  # noqa: E402,F401

from hypercli.providers.aws import AWSAPI, storage_policy  # noqa: E402
from hypercli.providers.cloud import CredentialsError  # noqa: E402
from hypercli.providers.cloud_provider import remove_all  # noqa: E402
from hypercli.recipe.access import Grant  # noqa: E402

GRANTS = (Grant("s3", "dsets", "imagenet"), Grant("s3", "outs", "runs", True))
ADMIN = {"Version": "2012-10-17",
         "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}


@pytest.fixture
def ec2(monkeypatch):
    fake_credentials(monkeypatch)
    with moto.mock_aws():
        yield boto3.client("ec2", region_name=REGION)


@pytest.fixture
def image(ec2) -> str:
    return ec2.register_image(Name="base-image", Architecture="x86_64")["ImageId"]


def iam_names(iam) -> tuple[list, list]:
    return (sorted(r["RoleName"] for r in iam.list_roles()["Roles"]),
            sorted(p["InstanceProfileName"] for p in
                   iam.list_instance_profiles()["InstanceProfiles"]))


def test_role_policy_profile_and_locked_metadata(ec2, image):
    api = AWSAPI(REGION)
    vms, errors = launch(api, spec(image, grants=GRANTS))
    assert errors == {} and len(vms) == 2
    iam = boto3.client("iam", region_name=REGION)
    role = iam.get_role(RoleName="hyper-c1")["Role"]
    assert role["Path"] == "/hyper/c1/"
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert trust["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    policy = iam.get_role_policy(RoleName="hyper-c1", PolicyName="hyper-storage")
    doc = policy["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == storage_policy(GRANTS)
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["Read0"]["Resource"] == "arn:aws:s3:::dsets/imagenet/*"
    assert by_sid["Read0"]["Action"] == ["s3:GetObject"]
    assert by_sid["ReadWrite1"]["Resource"] == "arn:aws:s3:::outs/runs/*"
    assert "s3:PutObject" in by_sid["ReadWrite1"]["Action"]
    assert by_sid["List"]["Resource"] == ["arn:aws:s3:::dsets", "arn:aws:s3:::outs"]
    [prof] = iam.get_instance_profile(InstanceProfileName="hyper-c1")["InstanceProfile"][
        "Roles"]
    assert prof["RoleName"] == "hyper-c1"
    for vm in vms:
        inst = instance(ec2, vm.id)
        assert inst["IamInstanceProfile"]["Arn"].endswith("/hyper-c1")
        opts = inst["MetadataOptions"]
        assert (opts["HttpTokens"], opts["HttpPutResponseHopLimit"]) == ("required", 1)
    # a later recipe on the cluster needs more: the policy grows, nothing is duplicated
    more = GRANTS + (Grant("s3", "dsets", "coco"),)
    assert api.identity(spec(image, grants=more)) == {"instance_profile": "hyper-c1"}
    doc = iam.get_role_policy(RoleName="hyper-c1", PolicyName="hyper-storage")["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert "arn:aws:s3:::dsets/coco/*" in [s["Resource"] for s in doc["Statement"]]
    assert iam_names(iam) == (["hyper-c1"], ["hyper-c1"])


def test_no_bucket_no_role_and_a_named_profile_is_used_as_is(ec2, image):
    api = AWSAPI(REGION)
    iam = boto3.client("iam", region_name=REGION)
    vms, _ = launch(api, spec(image))  # file:// storage, no s3 mount: nothing of IAM
    assert "IamInstanceProfile" not in instance(ec2, vms[0].id)
    assert iam_names(iam) == ([], [])
    iam.create_instance_profile(InstanceProfileName="mine")
    vms, _ = launch(api, spec(image, cluster="c2", grants=GRANTS, identity="mine"),
                    nodes=("c2-0",))
    assert instance(ec2, vms[0].id)["IamInstanceProfile"]["Arn"].endswith("/mine")
    assert iam_names(iam) == ([], ["mine"])  # nothing made


def test_down_and_gc_remove_roles_profiles_and_policies(ec2, image):
    api = AWSAPI(REGION)
    iam = boto3.client("iam", region_name=REGION)
    launch(api, spec(image, grants=GRANTS))
    launch(api, spec(image, cluster="c2", grants=GRANTS), nodes=("c2-0",))
    iam.create_role(RoleName="users-own", AssumeRolePolicyDocument=json.dumps(ADMIN))
    removed = remove_all(api, "c1", timeout=60)
    assert {"instance_profile hyper-c1", "role hyper-c1"} <= set(removed)
    assert iam_names(iam) == (["hyper-c2", "users-own"], ["hyper-c2"])
    remove_all(api, None, keep=set(), timeout=60)  # gc: no live cluster
    assert iam_names(iam) == (["users-own"], [])  # never what hypercli did not make


def test_a_caller_who_may_not_make_roles_is_stopped_before_anything_exists(ec2, image):
    @set_initial_no_auth_action_count(3)
    def attempt():
        iam = boto3.client("iam", region_name=REGION)
        iam.create_user(UserName="ec2-only")
        iam.put_user_policy(UserName="ec2-only", PolicyName="ec2", PolicyDocument=json.dumps(
            {"Version": "2012-10-17", "Statement": [
                {"Effect": "Allow", "Action": ["ec2:*", "sts:*"], "Resource": "*"}]}))
        key = iam.create_access_key(UserName="ec2-only")["AccessKey"]
        session = boto3.Session(aws_access_key_id=key["AccessKeyId"],
                                aws_secret_access_key=key["SecretAccessKey"],
                                region_name=REGION)
        api = AWSAPI(REGION, session=session)
        said = api.check()  # hyper check says so before any up
        assert "IAM refused" in said and "cluster.iam_role" in said, said
        with pytest.raises(CredentialsError) as e:
            launch(api, spec(image, grants=GRANTS))
        return e.value
    assert "storage identities: IAM usable" in AWSAPI(REGION).check()
    err = attempt()
    assert "iam:CreateRole" in str(err) and "cluster.iam_role" in err.hint
    assert ec2.describe_key_pairs()["KeyPairs"] == []
    assert [g["GroupName"] for g in ec2.describe_security_groups()["SecurityGroups"]] == \
        ["default"]
    assert ec2.describe_instances()["Reservations"] == []


def _node(argv: list[str], capsys) -> tuple[int, str]:
    """A node-side hypercli command (``python3 -m hypercli.mount.node ARGV``), in this
    process so that moto answers it; (exit code, stderr)."""
    from hypercli.mount.node import main
    code = main(argv)
    return code, capsys.readouterr().err


def test_a_node_reads_its_dataset_and_writes_its_outputs_with_the_roles_credentials(
        tmp_path, monkeypatch, capsys):
    """moto with authorisation on after the first requests; the role hypercli made, assumed
    (its trust widened to the test's admin, module docstring); its credentials served by an
    IMDSv2 stand-in on loopback, the only credentials the node-side commands have.

    In process: moto's server checks the signatures of S3 requests whose query holds a
    ``/`` (a listing prefix) wrongly, so the node-side commands run here, against moto's
    in-process S3, with boto3's own metadata client reaching the stand-in over HTTP."""
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
        s3 = admin.client("s3")
        for b in ("dsets", "outs"):
            s3.create_bucket(Bucket=b)
        for k in ("imagenet/train/a.jpg", "other/b.jpg"):
            s3.put_object(Bucket="dsets", Key=k, Body=k.encode())
        api = AWSAPI(REGION, session=admin)
        assert api.identity(spec("ami-x", grants=GRANTS)) == {"instance_profile": "hyper-c1"}
        iam, sts = admin.client("iam"), admin.client("sts")
        iam.update_assume_role_policy(RoleName="hyper-c1", PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
                "AWS": sts.get_caller_identity()["Arn"]}, "Action": "sts:AssumeRole"}]}))
        creds = sts.assume_role(RoleArn=iam.get_role(RoleName="hyper-c1")["Role"]["Arn"],
                                RoleSessionName="node-0")["Credentials"]
        out = tmp_path / "out"
        out.mkdir()
        (out / "result.txt").write_text("42\n")
        with IMDS("hyper-c1", creds) as imds:
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                      "AWS_EC2_METADATA_DISABLED"):
                monkeypatch.delenv(k, raising=False)
            monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint)
            assert boto3.Session().get_credentials().method == "iam-role"
            code, err = _node(["push-output", str(out), "s3://outs/runs/wf-1/t-0"], capsys)
            assert code == 0, err
            assert s3.get_object(Bucket="outs", Key="runs/wf-1/t-0/manifest.json")
            code, err = _node(["push-output", str(out), "s3://outs/elsewhere/t-0"], capsys)
            assert code != 0 and "AccessDenied" in err
            from hypercli.mount.store import StoreError, open_store
            assert open_store("s3://dsets/imagenet").get("train/a.jpg") == \
                b"imagenet/train/a.jpg"  # the node-side store reads the dataset
            with pytest.raises(StoreError, match="AccessDenied"):
                open_store("s3://dsets/other").get("b.jpg")
            node = boto3.Session().client("s3", region_name=REGION)  # the role's (stand-in)
            for call in (lambda: node.get_object(Bucket="dsets", Key="other/b.jpg"),
                         lambda: node.put_object(Bucket="dsets", Key="imagenet/x", Body=b"")):
                with pytest.raises(Exception, match="AccessDenied"):
                    call()
        return imds
    with moto.mock_aws():
        imds = run()
    # IMDSv2: a token first, then only requests that carry it
    assert imds.requests[0][:2] == ("PUT", "/latest/api/token")
    gets = [r for r in imds.requests if r[0] == "GET"]
    assert gets and all(valid for _, _, valid, _ in gets)
    assert ("GET", "/latest/meta-data/iam/security-credentials/hyper-c1", True, "127.0.0.1") \
        in gets


def test_a_later_recipe_on_an_up_cluster_widens_its_role(ec2, hyper_home):
    """``hyper run --cluster`` with a recipe that needs another bucket: the role's policy
    gets it, keeps what the cluster had, and the state file remembers the union."""
    from hypercli import cluster as C
    from hypercli.providers.cloud_provider import CloudProvider
    from hypercli.recipe import ClusterSpec
    from hypercli.recipe.access import grants_from
    from hypercli.state import State
    state = State()
    first = ClusterSpec("c1", "aws", 1, {"region": REGION}, grants=GRANTS)
    state.put_cluster("c1", "aws", {"options": first.options,
                                    "grants": [g.as_dict() for g in GRANTS]})
    provider = CloudProvider("aws", options=first.options, api=AWSAPI(REGION))
    provider.grant(first)
    later = ClusterSpec("c1", "aws", 1, {"region": REGION},
                        grants=(Grant("s3", "dsets", "coco"),))
    C.grant(state, later, provider)
    iam = boto3.client("iam", region_name=REGION)
    doc = iam.get_role_policy(RoleName="hyper-c1", PolicyName="hyper-storage")["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == storage_policy(GRANTS + later.grants)
    assert set(grants_from(state.cluster("c1")["spec"]["grants"])) == set(GRANTS + later.grants)
    calls = []
    provider.grant = lambda spec: calls.append(spec)  # covered already: nothing asked
    C.grant(state, ClusterSpec("c1", "aws", 1, {}, grants=(Grant("s3", "dsets", "imagenet"),)),
            provider)
    assert calls == []
