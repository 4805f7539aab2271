"""The storage identity of an aws cluster (hypercli/providers/aws.py, "Storage identity"):
an IAM role and instance profile scoped to the recipe's buckets and the cluster's live
workflows, named with the cluster's identity tag, IMDSv2 with one hop, and the node's boto3
reaching the role's credentials through the metadata service.

moto enforces IAM policies when its authorisation checks are on, for an assumed role's
credentials too; it cannot evaluate a trust policy whose principal is a service
(``ec2.amazonaws.com``: moto fails on it), so the test that assumes the role first lets the
test's admin user assume it. Its S3 checks do not evaluate conditions (``s3:prefix``,
``s3:ResourceAccount``): tests/awsiam.py completes them with AWS's evaluation rules, and the
attacks below are made with the role's credentials against that. Everything else is the role
as hypercli made it."""

from __future__ import annotations

import json
import boto3
import pytest

moto = pytest.importorskip("moto")

from moto.core import set_initial_no_auth_action_count  # noqa: E402

from awsiam import enforced  # noqa: E402
from imds import IMDS  # noqa: E402
from test_aws import REGION, fake_credentials, instance, launch, spec  # noqa: E402,F401

from hypercli.providers.aws import AWSAPI, role_name, storage_policy  # noqa: E402
from hypercli.providers.cloud import CloudSpec, CredentialsError, IdentityConflict  # noqa: E402,E501
from hypercli.providers.cloud_provider import remove_all  # noqa: E402
from hypercli.recipe.access import Grant  # noqa: E402

GRANTS = (Grant("s3", "dsets", "imagenet"), Grant("s3", "outs", "runs", True))
ACCOUNT = "123456789012"  # moto's
ROLE = role_name(spec("ami-x"))  # cluster c1 of an API used on its own: tag of its name
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
    assert ROLE.startswith("hyper-c1-") and len(ROLE) == len("hyper-c1-") + 8
    role = iam.get_role(RoleName=ROLE)["Role"]
    assert role["Path"] == "/hyper/c1/"
    trust = role["AssumeRolePolicyDocument"]
    trust = json.loads(trust) if isinstance(trust, str) else trust
    assert trust["Statement"][0]["Principal"] == {"Service": "ec2.amazonaws.com"}
    policy = iam.get_role_policy(RoleName=ROLE, PolicyName="hyper-storage")
    doc = policy["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == storage_policy(GRANTS, ACCOUNT)
    by_sid = {s["Sid"]: s for s in doc["Statement"]}
    assert by_sid["Read0"]["Resource"] == "arn:aws:s3:::dsets/imagenet/*"
    assert by_sid["Read0"]["Action"] == ["s3:GetObject"] and "Condition" not in by_sid["Read0"]
    assert by_sid["ReadWrite1"]["Resource"] == "arn:aws:s3:::outs/runs/*"
    assert "s3:PutObject" in by_sid["ReadWrite1"]["Action"]
    assert by_sid["ReadWrite1"]["Condition"] == {
        "StringEquals": {"s3:ResourceAccount": ACCOUNT}}  # outputs go to our buckets only
    assert by_sid["List0"] == {"Sid": "List0", "Effect": "Allow", "Action": "s3:ListBucket",
                               "Resource": "arn:aws:s3:::dsets", "Condition": {
                                   "StringLike": {"s3:prefix": ["imagenet/*"]}}}
    assert by_sid["List1"]["Condition"] == {"StringLike": {"s3:prefix": ["runs/*"]},
                                            "StringEquals": {"s3:ResourceAccount": ACCOUNT}}
    tags = {t["Key"]: t["Value"] for t in iam.list_role_tags(RoleName=ROLE)["Tags"]}
    assert tags["hyper:cluster"] == "c1" and tags["hyper:cluster-id"] == ROLE[-8:]
    assert iam.list_attached_role_policies(RoleName=ROLE)["AttachedPolicies"] == []
    [prof] = iam.get_instance_profile(InstanceProfileName=ROLE)["InstanceProfile"]["Roles"]
    assert prof["RoleName"] == ROLE
    for vm in vms:
        inst = instance(ec2, vm.id)
        assert inst["IamInstanceProfile"]["Arn"].endswith(f"/{ROLE}")
        opts = inst["MetadataOptions"]
        assert (opts["HttpTokens"], opts["HttpPutResponseHopLimit"]) == ("required", 1)
    # a later recipe on the cluster needs more: the policy grows, nothing is duplicated
    more = GRANTS + (Grant("s3", "dsets", "coco"),)
    assert api.identity(spec(image, grants=more)) == {"instance_profile": ROLE}
    doc = iam.get_role_policy(RoleName=ROLE, PolicyName="hyper-storage")["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert "arn:aws:s3:::dsets/coco/*" in [s["Resource"] for s in doc["Statement"]]
    assert iam_names(iam) == ([ROLE], [ROLE])
    # exactly what is asked: a grant left out is taken away
    api.identity(spec(image, grants=GRANTS[:1]))
    doc = iam.get_role_policy(RoleName=ROLE, PolicyName="hyper-storage")["PolicyDocument"]
    doc = json.loads(doc) if isinstance(doc, str) else doc
    assert doc == storage_policy(GRANTS[:1], ACCOUNT)


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


def test_instances_up_before_the_role_existed_are_given_its_profile(ec2, image):
    """A cluster brought up by a recipe with no s3:// bucket, then run with one
    (``hyper run --cluster``): its running instances get the new instance profile."""
    api = AWSAPI(REGION)
    vms, _ = launch(api, spec(image))
    assert all("IamInstanceProfile" not in instance(ec2, v.id) for v in vms)
    assert api.identity(spec(image, grants=GRANTS)) == {"instance_profile": ROLE}
    assert all(instance(ec2, v.id)["IamInstanceProfile"]["Arn"].endswith(f"/{ROLE}")
               for v in vms)


def test_down_and_gc_remove_roles_profiles_and_policies(ec2, image):
    api = AWSAPI(REGION)
    iam = boto3.client("iam", region_name=REGION)
    launch(api, spec(image, grants=GRANTS))
    launch(api, spec(image, cluster="c2", grants=GRANTS), nodes=("c2-0",))
    iam.create_role(RoleName="users-own", AssumeRolePolicyDocument=json.dumps(ADMIN))
    removed = remove_all(api, "c1", timeout=60)
    assert {f"instance_profile {ROLE}", f"role {ROLE}"} <= set(removed)
    c2 = role_name(spec(image, cluster="c2"))
    assert iam_names(iam) == ([c2, "users-own"], [c2])
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


#: a cluster whose storage is s3://outs/runs running workflow wf-1 and mounting the outputs of
#: an earlier run, wf-0's task t-3 (what hypercli.cluster.with_granted gives it)
NODE_GRANTS = (Grant("s3", "dsets", "imagenet"), Grant("s3", "outs", "runs", True, True),
               Grant("s3", "outs", "runs/wf-1", True), Grant("s3", "outs", "runs/wf-0/t-3"))


def test_a_node_reads_its_dataset_and_writes_its_outputs_with_the_roles_credentials(
        tmp_path, monkeypatch, capsys):
    """moto with authorisation on after the first requests (conditions evaluated as AWS
    does, tests/awsiam.py); the role hypercli made, assumed (its trust widened to the test's
    admin, module docstring); its credentials served by an IMDSv2 stand-in on loopback, the
    only credentials the node-side commands have. What a task on the node could try with
    them: each refused, the node's own work allowed.

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
        for k in ("runs/wf-0/t-3/manifest.json", "runs/wf-0/.checkpoints/t-3/gen-1",
                  "runs/wf-2/t-0/manifest.json"):
            s3.put_object(Bucket="outs", Key=k, Body=b"theirs")
        ec2 = admin.client("ec2")
        ami = ec2.register_image(Name="base-image", Architecture="x86_64")["ImageId"]
        sibling = ec2.run_instances(ImageId=ami, MinCount=1, MaxCount=1)["Instances"][0][
            "InstanceId"]
        api = AWSAPI(REGION, session=admin)
        assert api.identity(spec("ami-x", grants=NODE_GRANTS)) == {"instance_profile": ROLE}
        iam, sts = admin.client("iam"), admin.client("sts")
        iam.update_assume_role_policy(RoleName=ROLE, PolicyDocument=json.dumps({
            "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
                "AWS": sts.get_caller_identity()["Arn"]}, "Action": "sts:AssumeRole"}]}))
        creds = sts.assume_role(RoleArn=iam.get_role(RoleName=ROLE)["Role"]["Arn"],
                                RoleSessionName="node-0")["Credentials"]
        out = tmp_path / "out"
        out.mkdir()
        (out / "result.txt").write_text("42\n")
        with IMDS(ROLE, creds) as imds, enforced():
            for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",
                      "AWS_EC2_METADATA_DISABLED"):
                monkeypatch.delenv(k, raising=False)
            monkeypatch.setenv("AWS_EC2_METADATA_SERVICE_ENDPOINT", imds.endpoint)
            assert boto3.Session().get_credentials().method == "iam-role"
            # its own workflow's prefix: a push (which asks whether objects exist first)
            code, err = _node(["push-output", str(out), "s3://outs/runs/wf-1/t-0"], capsys)
            assert code == 0, err
            assert s3.get_object(Bucket="outs", Key="runs/wf-1/t-0/manifest.json")
            from hypercli.mount.store import StoreError, open_store
            mine = open_store("s3://outs/runs/wf-1")
            assert mine.exists("t-0/manifest.json")
            assert not mine.exists("t-9/manifest.json")  # 403 without a bucket listing
            assert [k for k, _ in mine.list("t-0/")] and not list(mine.list("t-9/"))
            # another workflow's prefix, or anywhere else: refused
            for url in ("s3://outs/runs/wf-2/t-0", "s3://outs/elsewhere/t-0"):
                code, err = _node(["push-output", str(out), url], capsys)
                assert code != 0 and "AccessDenied" in err, url
            # the earlier run's outputs it mounts: read, never written or deleted
            assert open_store("s3://outs/runs/wf-0/t-3").get("manifest.json") == b"theirs"
            node = boto3.Session().client("s3", region_name=REGION)  # the role's (stand-in)
            attacks = {
                "overwrite an earlier run's output": lambda: node.put_object(
                    Bucket="outs", Key="runs/wf-0/t-3/manifest.json", Body=b"mine"),
                "delete an earlier run's checkpoint": lambda: node.delete_object(
                    Bucket="outs", Key="runs/wf-0/.checkpoints/t-3/gen-1"),
                "read another workflow's output": lambda: node.get_object(
                    Bucket="outs", Key="runs/wf-2/t-0/manifest.json"),
                "list the storage prefix": lambda: node.list_objects_v2(
                    Bucket="outs", Prefix="runs/"),
                "list the whole bucket": lambda: node.list_objects_v2(Bucket="outs"),
                "list a dataset's bucket": lambda: node.list_objects_v2(
                    Bucket="dsets", Prefix="other/"),
                "read outside the dataset": lambda: node.get_object(
                    Bucket="dsets", Key="other/b.jpg"),
                "write into the dataset": lambda: node.put_object(
                    Bucket="dsets", Key="imagenet/x", Body=b""),
                "delete the bucket": lambda: node.delete_bucket(Bucket="outs"),
            }
            for what, call in attacks.items():
                with pytest.raises(Exception, match="AccessDenied"):
                    call()
                    pytest.fail(what)
            # nothing of EC2 or IAM: no sibling or other cluster's instance to terminate,
            # no way to widen its own role or to mint keys that outlive the node
            node_ec2 = boto3.Session().client("ec2", region_name=REGION)
            node_iam = boto3.Session().client("iam", region_name=REGION)
            beyond = {
                "terminate another instance": lambda: node_ec2.terminate_instances(
                    InstanceIds=[sibling]),
                "stop another instance": lambda: node_ec2.stop_instances(
                    InstanceIds=[sibling]),
                "launch an instance": lambda: node_ec2.run_instances(
                    ImageId=ami, MinCount=1, MaxCount=1),
                "widen its own role": lambda: node_iam.put_role_policy(
                    RoleName=ROLE, PolicyName="more", PolicyDocument=json.dumps(ADMIN)),
                "attach a managed policy": lambda: node_iam.attach_role_policy(
                    RoleName=ROLE, PolicyArn="arn:aws:iam::aws:policy/AdministratorAccess"),
                "make an access key": lambda: node_iam.create_access_key(UserName="admin"),
            }
            for what, call in beyond.items():
                with pytest.raises(Exception, match="AccessDenied|UnauthorizedOperation"):
                    call()
                    pytest.fail(what)
            assert ec2.describe_instances(InstanceIds=[sibling])["Reservations"][0][
                "Instances"][0]["State"]["Name"] == "running"
            assert open_store("s3://dsets/imagenet").get("train/a.jpg") == \
                b"imagenet/train/a.jpg"  # the node-side store reads the dataset
            with pytest.raises(StoreError, match="AccessDenied"):
                open_store("s3://dsets/other").get("b.jpg")
            assert [k for k, _ in open_store("s3://dsets/imagenet").list()] == ["train/a.jpg"]
            # a bucket of that name in another account would receive nothing
            iam.put_role_policy(RoleName=ROLE, PolicyName="hyper-storage", PolicyDocument=(
                json.dumps(storage_policy(NODE_GRANTS, "999999999999"))))
            with pytest.raises(Exception, match="AccessDenied"):
                node.put_object(Bucket="outs", Key="runs/wf-1/t-0/x", Body=b"")
            assert node.get_object(Bucket="dsets", Key="imagenet/train/a.jpg")  # reads still
        for k in ("runs/wf-0/t-3/manifest.json", "runs/wf-0/.checkpoints/t-3/gen-1"):
            assert s3.get_object(Bucket="outs", Key=k)["Body"].read() == b"theirs"
        return imds
    with moto.mock_aws():
        imds = run()
    # IMDSv2: a token first, then only requests that carry it
    assert imds.requests[0][:2] == ("PUT", "/latest/api/token")
    gets = [r for r in imds.requests if r[0] == "GET"]
    assert gets and all(valid for _, _, valid, _ in gets)
    assert ("GET", f"/latest/meta-data/iam/security-credentials/{ROLE}", True, "127.0.0.1") \
        in gets


def _policy(iam, name) -> dict:
    doc = iam.get_role_policy(RoleName=name, PolicyName="hyper-storage")["PolicyDocument"]
    return json.loads(doc) if isinstance(doc, str) else doc


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
    name = role_name(CloudSpec(cluster="c1", cluster_id=state.cluster_uid("c1")))
    later = ClusterSpec("c1", "aws", 1, {"region": REGION},
                        grants=(Grant("s3", "dsets", "coco"),))
    C.grant(state, later, provider)
    iam = boto3.client("iam", region_name=REGION)
    assert _policy(iam, name) == storage_policy(GRANTS + later.grants, ACCOUNT)
    assert set(grants_from(state.cluster("c1")["spec"]["grants"])) == set(GRANTS + later.grants)
    calls = []
    provider.grant = lambda spec: calls.append(spec)  # covered already: nothing asked
    C.grant(state, ClusterSpec("c1", "aws", 1, {}, grants=(Grant("s3", "dsets", "imagenet"),)),
            provider)
    assert calls == []


def test_each_workflow_writes_only_its_own_prefix_from_its_start(ec2, hyper_home, tmp_path):
    """Two workflows, one after the other, on one cluster whose storage is s3://outs/runs:
    each start sets the role to the live workflows' prefixes, so the second may write
    runs/<its id>/ and no longer the first's; both live at once: both."""
    from hypercli import cluster as C
    from hypercli import workflows as W
    from hypercli.providers.cloud_provider import CloudProvider
    from hypercli.state import State
    path = tmp_path / "r.yaml"
    path.write_text("name: r\nstorage: s3://outs/runs\ncluster: {provider: aws, "
                    "region: us-east-1}\nmounts: {/d: chunks+s3://dsets/imagenet}\n"
                    "experiments: {a: {command: 'true'}}\n")
    recipe, wf = W.load(str(path))
    state = State()
    provider = CloudProvider("aws", options=recipe.cluster.options, api=AWSAPI(REGION))
    base, spec0 = C.with_granted(state, recipe.cluster, None)
    provider.grant(spec0)  # as `hyper up` leaves it: the dataset only, no workflow yet
    state.put_cluster("r", "aws", {"options": recipe.cluster.options,
                                   "grants": [g.as_dict() for g in base],
                                   "given": [g.as_dict() for g in spec0.grants]})
    name = role_name(CloudSpec(cluster="r", cluster_id=state.cluster_uid("r")))
    iam = boto3.client("iam", region_name=REGION)
    written = lambda: sorted(s["Resource"] for s in _policy(iam, name)["Statement"]  # noqa
                             if "s3:PutObject" in s["Action"])
    assert written() == []
    one, _ = W.start_or_resume(state, recipe, wf, new=True)
    C.grant(state, recipe.cluster, provider)
    assert written() == [f"arn:aws:s3:::outs/runs/{one}/*"]
    two, _ = W.start_or_resume(state, recipe, wf, new=True)
    C.grant(state, recipe.cluster, provider)
    assert written() == [f"arn:aws:s3:::outs/runs/{one}/*", f"arn:aws:s3:::outs/runs/{two}/*"]
    state.set_workflow(one, status="succeeded")
    three, _ = W.start_or_resume(state, recipe, wf, new=True)
    C.grant(state, recipe.cluster, provider)
    assert written() == [f"arn:aws:s3:::outs/runs/{two}/*", f"arn:aws:s3:::outs/runs/{three}/*"]
    reads = [s["Resource"] for s in _policy(iam, name)["Statement"]
             if s["Action"] == ["s3:GetObject"]]
    assert reads == ["arn:aws:s3:::dsets/imagenet/*"]  # never the storage prefix as a whole


def test_names_carry_the_cluster_id_and_a_squatted_role_is_refused(ec2, image):
    """Cluster names equal after IAM's limit or but for case get roles of their own; a role
    made in advance under the computed name (another trust policy, a managed policy) is
    refused, exit 2, and nothing is launched."""
    api = AWSAPI(REGION)
    long = "ml-team-experiments-2026-" + "x" * 30
    names = {role_name(spec(image, cluster=c, cluster_id=i)) for c, i in
             ((long + "-gpu", "id-a"), (long + "-cpu", "id-b"), ("Team", "id-c"),
              ("team", "id-d"))}
    assert len({n.lower() for n in names}) == 4 and all(len(n) <= 64 for n in names)
    for c, i in ((long + "-gpu", "id-a"), (long + "-cpu", "id-b"), ("Team", "id-c"),
                 ("team", "id-d")):
        api.identity(spec(image, cluster=c, cluster_id=i, grants=GRANTS))
    iam = boto3.client("iam", region_name=REGION)
    assert {n.lower() for n in iam_names(iam)[0]} == {n.lower() for n in names}
    s = spec(image, cluster="c9", cluster_id="id-9", grants=GRANTS)
    squat = role_name(s)
    iam.create_role(RoleName=squat, Path="/hyper/c9/", AssumeRolePolicyDocument=json.dumps({
        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
            "AWS": "arn:aws:iam::210987654321:root"}, "Action": "sts:AssumeRole"}]}),
        Tags=[{"Key": "hyper:cluster", "Value": "c9"},
              {"Key": "hyper:cluster-id", "Value": s.tag}])
    with pytest.raises(IdentityConflict, match="trust policy") as e:
        launch(api, s, nodes=("c9-0",))
    assert e.value.exit_code == 2 and "cluster.iam_role" in e.value.hint
    assert ec2.describe_instances()["Reservations"] == []
    from hypercli.providers.aws import EC2_TRUST
    iam.update_assume_role_policy(RoleName=squat, PolicyDocument=json.dumps(EC2_TRUST))
    arn = iam.create_policy(PolicyName="everything",
                            PolicyDocument=json.dumps(ADMIN))["Policy"]["Arn"]
    iam.attach_role_policy(RoleName=squat, PolicyArn=arn)
    with pytest.raises(IdentityConflict, match="everything"):
        api.identity(s)
    iam.detach_role_policy(RoleName=squat, PolicyArn=arn)
    # an instance profile of that name made in advance, untagged: down would never remove
    # it (it is not known to be hypercli's), so it is not used either
    iam.create_instance_profile(InstanceProfileName=squat, Path="/hyper/c9/")
    with pytest.raises(IdentityConflict, match="not tagged"):
        api.identity(s)
    iam.tag_instance_profile(InstanceProfileName=squat, Tags=[
        {"Key": "hyper:cluster", "Value": "c9"}])
    assert api.identity(s) == {"instance_profile": squat}  # as hypercli leaves it: its own


def test_down_and_gc_never_remove_a_role_under_hyperclis_path_that_it_did_not_make(ec2, image):
    """Roles and instance profiles someone made under ``/hyper/<cluster>/`` (another trust
    policy, no cluster tag, a profile holding another role, a role refused as squatted) are
    not hypercli's: ``down`` and ``gc`` leave them and what is attached to them; the
    cluster's own role and profile go."""
    api = AWSAPI(REGION)
    iam = boto3.client("iam", region_name=REGION)
    launch(api, spec(image, grants=GRANTS))
    ours = [{"Key": "hyper:cluster", "Value": "c1"}, {"Key": "hyper:cluster-id",
                                                      "Value": ROLE[-8:]}]
    from hypercli.providers.aws import EC2_TRUST
    iam.create_role(RoleName="their-deployer", Path="/hyper/c1/", Tags=ours,
                    AssumeRolePolicyDocument=json.dumps({
                        "Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Principal": {
                            "AWS": "arn:aws:iam::210987654321:root"},
                            "Action": "sts:AssumeRole"}]}))
    arn = iam.create_policy(PolicyName="deploy", PolicyDocument=json.dumps(ADMIN))["Policy"]["Arn"]
    iam.attach_role_policy(RoleName="their-deployer", PolicyArn=arn)
    iam.create_role(RoleName="their-untagged", Path="/hyper/c1/",
                    AssumeRolePolicyDocument=json.dumps(EC2_TRUST))
    iam.put_role_policy(RoleName="their-untagged", PolicyName="keep",
                        PolicyDocument=json.dumps(ADMIN))
    iam.create_instance_profile(InstanceProfileName="their-profile", Path="/hyper/c1/",
                                Tags=ours)
    iam.add_role_to_instance_profile(InstanceProfileName="their-profile",
                                     RoleName="their-untagged")
    assert {(r.kind, r.id) for r in api.resources("c1") if r.kind in ("role",
                                                                      "instance_profile")} \
        == {("role", ROLE), ("instance_profile", ROLE)}
    removed = remove_all(api, "c1", timeout=60)
    assert {f"instance_profile {ROLE}", f"role {ROLE}"} <= set(removed)
    remove_all(api, None, keep=set(), timeout=60)  # gc: no live cluster
    assert iam_names(iam) == (["their-deployer", "their-untagged"], ["their-profile"])
    assert [p["PolicyArn"] for p in iam.list_attached_role_policies(
        RoleName="their-deployer")["AttachedPolicies"]] == [arn]
    assert iam.list_role_policies(RoleName="their-untagged")["PolicyNames"] == ["keep"]
    assert [r["RoleName"] for r in iam.get_instance_profile(
        InstanceProfileName="their-profile")["InstanceProfile"]["Roles"]] == ["their-untagged"]


def test_without_an_answer_from_sts_the_role_is_neither_made_nor_widened(ec2, image):
    """The account id is what keeps the role's writes to the account's own buckets
    (``s3:ResourceAccount``): when STS does not answer (its endpoint a closed port on
    loopback), ``hyper up`` stops before anything exists, and an up cluster's role keeps its
    policy rather than getting one without that condition."""
    import socket

    from botocore.config import Config

    from hypercli.providers.cloud import CloudError

    def cut_off(api):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
        s.close()  # nothing listens there
        api._clients["sts"] = boto3.client(
            "sts", region_name=REGION, endpoint_url=f"http://127.0.0.1:{port}",
            config=Config(retries={"max_attempts": 1}, connect_timeout=2))
        return api
    iam = boto3.client("iam", region_name=REGION)
    with pytest.raises(CloudError, match="own buckets") as e:
        launch(cut_off(AWSAPI(REGION)), spec(image, grants=GRANTS))
    assert "STS" in e.value.hint
    assert iam_names(iam) == ([], []) and ec2.describe_instances()["Reservations"] == []
    AWSAPI(REGION).identity(spec(image, grants=GRANTS))
    with pytest.raises(CloudError):
        cut_off(AWSAPI(REGION)).identity(spec(image, grants=GRANTS + (
            Grant("s3", "outs", "more", True),)))
    assert _policy(iam, ROLE) == storage_policy(GRANTS, ACCOUNT)
