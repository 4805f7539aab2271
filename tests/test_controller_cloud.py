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
from hypercli.providers.cloud import (TAG_CLUSTER, TAG_OWNER, Boot, CloudSpec,  # noqa: E402
                                      owner)
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


@pytest.mark.slow
def test_a_cloud_controller_is_on_demand_tagged_scoped_reused_listed_and_removed(
        aws, ssh_hosts, tmp_path, hyper_home, hyper):
    """On the AWS stand-in (moto_server; the instance booted onto an SSH test host,
    tests/cloudhosts.py): the controller is the cheapest on-demand offer of the catalog in
    the recipe's region, tagged for its user, launched with the controller's role and its
    idle limit; a second workflow reuses it; `hyper status` lists it with its cost; `hyper
    down --controller` leaves nothing of it (instance, role, instance profile, security
    group, key pair)."""
    from cloudhosts import Booter, tagged_left

    from hypercli.controller.client import Controller
    from hypercli.controller.cloud import ensure, name_of, offers_for
    from hypercli.state import State
    hosts = ssh_hosts.start(1)
    booter = Booter(aws, hosts, tmp_path / "addresses.json")
    booter.start()
    image = aws.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    options = {"region": REGION, "image": image, "ssh_cidr": "10.213.0.0/24",
               "instance_type": "p3.2xlarge", "spot": True}  # the nodes', not its own
    iam = boto3.client("iam", region_name=REGION, endpoint_url=aws.meta.endpoint_url)
    name = name_of("aws")
    try:
        state = State()
        ctl = ensure(state, "aws", options, STORAGE, idle_minutes=7)
        assert ctl["cloud"]["cluster"] == name
        [node] = state.nodes(name, status="up")
        inst = instance(aws, node["provider_id"])
        assert "InstanceLifecycle" not in inst  # on-demand
        assert inst["InstanceType"] == offers_for("aws", REGION)[0].instance_type
        tags = {t["Key"]: t["Value"] for t in inst["Tags"]}
        assert tags[TAG_CLUSTER] == name and tags[TAG_OWNER] == owner()
        cs = CloudSpec(cluster=name, cluster_id=state.cluster_uid(name))
        role = role_name(cs)
        assert inst["IamInstanceProfile"]["Arn"].endswith(f"/{role}")
        doc = iam.get_role_policy(RoleName=role, PolicyName="hyper-controller")[
            "PolicyDocument"]
        doc = json.loads(doc) if isinstance(doc, str) else doc
        assert doc == controller_policy(owner(), "123456789012", STORAGE)
        user_data = aws.describe_instance_attribute(InstanceId=inst["InstanceId"],
                                                    Attribute="userData")
        import base64
        assert '"idle_minutes": 7' in base64.b64decode(
            user_data["UserData"]["Value"]).decode()  # removes itself when idle
        c = Controller(ctl)  # reached over SSH with its pinned host key
        try:
            assert c.conn.run("echo up").stdout.strip() == b"up"
        finally:
            c.close()
        again = ensure(State(), "aws", options, ())  # a later workflow: the same one
        assert again["name"] == ctl["name"] and again["cloud"]["grants"]
        live = [i for r in aws.describe_instances(Filters=[
            {"Name": f"tag:{TAG_CLUSTER}", "Values": [name]}])["Reservations"]
            for i in r["Instances"] if i["State"]["Name"] != "terminated"]
        assert len(live) == 1
        r = hyper("status", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("controller "))
        assert ctl["name"] in line and f"{name} $" in line and "/h" in line, line
        assert f"${offers_for('aws', REGION)[0].price:.4f}/h" in line  # its on-demand price
        r = hyper("down", "--controller", name, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "removed instance" in r.stdout and f"controller {ctl['name']} removed" in \
            r.stdout, r.stdout
        assert tagged_left(aws, name) == []
        assert role not in [x["RoleName"] for x in iam.list_roles()["Roles"]]
        assert role not in [p["InstanceProfileName"] for p in
                            iam.list_instance_profiles()["InstanceProfiles"]]
        r = hyper("status", timeout=60)
        assert "controller " not in r.stdout, r.stdout
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)


@pytest.mark.slow
def test_a_cloud_controller_drives_the_workflow_after_the_run_is_killed_and_leaves_nothing(
        ssh_hosts, tmp_path, hyper_home, hyper, monkeypatch):
    """`hyper run --controller` of an aws recipe on the AWS stand-in (moto_server on the
    test hosts' bridge; instances booted onto SSH test hosts): the cluster comes up here,
    the controller instance is launched (on-demand) and given the workflow, and the run is
    SIGKILLed right after; then one of the two spot nodes is taken by the cloud mid-task.
    The controller, whose only credentials are its role's (an IMDSv2 stand-in on its host),
    asks EC2, launches a replacement tagged for this user, goes on backing up on the node
    left (the one the cloud took is pruned from the replicas) and drives every task to one
    success; `hyper down --controller` then leaves nothing of it."""
    import signal
    import subprocess

    from cloudhosts import Booter, tagged_left
    from conftest import ROOT, hyper_cmd, wait_for
    from imds import IMDS
    from s3server import CREDENTIALS, S3Server
    from test_controller import COMMAND, PACKAGES, open_gate

    from hypercli.controller.cloud import name_of
    hosts = ssh_hosts.start(4, share=(ROOT, PACKAGES, tmp_path))
    server = S3Server(host="10.213.0.1").start()  # EC2, IAM and STS, reached by the hosts
    imds = IMDS("hyper-ctl", {"AccessKeyId": "ASIACONTROLLER", "SecretAccessKey": "ctl",
                              "SessionToken": "ctl-session",
                              "Expiration": "2099-01-01T00:00:00Z"},
                host="10.213.0.1").__enter__()
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    seam = tmp_path / "addresses.json"
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("HYPER_AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(seam))
    # the controller's Python: this checkout's packages, the stand-ins' addresses, and no
    # credentials but its role's, from the metadata service (as on an instance)
    wrapper = (f"#!/bin/sh\nexport PYTHONPATH=\"$PYTHONPATH:{PACKAGES}\"\n"
               f"export HYPER_AWS_ENDPOINT_URL={server.endpoint}\n"
               f"export HYPER_CLOUD_ADDRESSES={seam}\n"
               f"export AWS_EC2_METADATA_SERVICE_ENDPOINT={imds.endpoint}\n"
               "export AWS_METADATA_SERVICE_TIMEOUT=5 AWS_METADATA_SERVICE_NUM_ATTEMPTS=3\n"
               "exec /usr/bin/python3 \"$@\"\n")
    for h in hosts:
        h.run(
            f"cat > /root/py3 <<'EOF'\n{wrapper}EOF\nchmod +x /root/py3", check=True)
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=server.endpoint)
    iam = boto3.client("iam", region_name=REGION, endpoint_url=server.endpoint)
    booter = Booter(ec2, hosts, seam)
    booter.start()
    image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    import yaml
    path = tmp_path / "far.yaml"
    path.write_text(yaml.safe_dump({
        "name": "far", "workdir": "none",
        "cluster": {"provider": "aws", "region": REGION, "zone": [f"{REGION}a"],
                    "instance_type": "m5.large", "workers": 2, "image": image,
                    "ssh_cidr": "10.213.0.0/24", "controller": True,
                    "controller_idle_minutes": 5, "controller_python": "/root/py3"},
        "experiments": {"work": {"parameters": {"i": list(range(6))}, "retries": 2,
                                 "command": COMMAND % 0}}}, sort_keys=False))
    name = name_of("aws")
    try:
        p = subprocess.Popen([*hyper_cmd(), "run", str(path), "--controller"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            line = wait_for(lambda: (lambda s: s if "driven by the controller" in s else None)(
                p.stdout.readline()), timeout=400, what="the handover", proc=p)
        finally:
            p.send_signal(signal.SIGKILL)
            p.communicate()
        wid = line.split()[0]
        workers = [h for iid, h in booter.booted.items() if h is not None and any(
            t["Key"] == "hyper:cluster" and t["Value"] == "far" for t in instance(
                ec2, iid).get("Tags", []))]
        assert len(workers) == 2
        ctl_host = next(h for iid, h in booter.booted.items() if h is not None and
                        any(t["Value"] == name for t in instance(ec2, iid)["Tags"]))
        # a spot node taken by the cloud mid-run, the laptop away: the controller asks EC2
        # (its role's credentials) and launches a replacement tagged for this user
        victim = wait_for(lambda: next((r["nodes"][0] for r in json.loads(hyper(
            "ps", wid, "--json", timeout=120).stdout) if r["status"] == "running"), None),
            timeout=300, interval=0.5, what="a task running")
        from hypercli.state import State
        node = next(n for n in State().nodes("far") if n["name"] == victim)
        ec2.terminate_instances(InstanceIds=[node["provider_id"]])
        booter.booted[node["provider_id"]].kill()
        open_gate(h for h in hosts if h is not booter.booted[node["provider_id"]])
        from test_controller import attempts_there, on_controller

        def ended() -> bool:  # seen inside the controller's host: nothing of hyper runs here
            return on_controller(ctl_host, "from hypercli.state import State; print(State()."
                                 f"workflow({wid!r})['status'])").strip() == "succeeded"
        wait_for(ended, timeout=600, interval=1, what="the workflow done by the controller")
        r = hyper("attach", wid, timeout=600)  # ended there: its records come here
        if r.returncode != 0:
            print("CONTROLLER LOG", ctl_host.run(
                "cat /root/.hyper/controller/controller.log").stdout[-5000:])
        assert r.returncode == 0, r.stdout + r.stderr
        r = hyper("ps", wid, "--json", timeout=120)
        rows = json.loads(r.stdout)
        assert [row["status"] for row in rows] == ["succeeded"] * 6
        assert on_controller(ctl_host, "from hypercli.state import State; print(State()."
                             f"workflow({wid!r})['spec']['lease'].get('collected'))").strip() \
            == "True"  # copied here: the controller may now remove itself when idle
        there = attempts_there(ctl_host, wid)  # the controller's own records
        for i in range(6):
            mine = [a["status"] for a in there if a["task"] == f"work-{i:04d}"]
            assert mine.count("succeeded") == 1, mine
        assert any(a["status"] == "lost" for a in there)
        new = [i for r in ec2.describe_instances(Filters=[
            {"Name": "tag:hyper:cluster", "Values": ["far"]}])["Reservations"]
            for i in r["Instances"] if i["InstanceId"] != node["provider_id"]
            and i["State"]["Name"] == "running"]
        assert len(new) == 2  # the replacement, launched by the controller
        assert all({t["Key"]: t["Value"] for t in i["Tags"]}["hyper:owner"] == owner()
                   for i in new)
        assert ctl_host.ip in {r[3] for r in imds.requests}  # its role's credentials
        [ctl_node] = State().nodes(name, status="up")
        assert "InstanceLifecycle" not in instance(ec2, ctl_node["provider_id"])
        r = hyper("down", "--controller", name, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert tagged_left(ec2, name) == []
        assert not [x for x in iam.list_roles()["Roles"] if x["Path"] == f"/hyper/{name}/"]
        assert not [x for x in iam.list_instance_profiles()["InstanceProfiles"]
                    if x["Path"] == f"/hyper/{name}/"]
        r = hyper("down", "far", "--yes", timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert tagged_left(ec2, "far") == []
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)
        imds.__exit__(None, None, None)
        server.stop()


# -- GCP and Azure: the controller's identity, checked with its own token against the
# stand-ins' permission checks (tests/gcpfake.py, tests/azurefake.py: the real SDK clients
# make the calls; the stand-ins evaluate the bindings and role assignments hypercli made)

GS = (Grant("gs", "outs", "runs", True),)   # the recipe's storage (read/write for nodes)
AZ = (Grant("az", "acct/outs", "runs", True),)


@pytest.fixture
def gcp(monkeypatch):
    pytest.importorskip("google.cloud.compute_v1")
    from gcpfake import ComputeFake
    fake = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
    try:
        yield fake
    finally:
        fake.close()


@pytest.fixture
def azure(monkeypatch, tmp_path):
    pytest.importorskip("azure.mgmt.compute")
    from azurefake import ArmFake
    fake = ArmFake(tmp_path)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", fake.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(fake.ca))
    monkeypatch.delenv("HYPER_AZURE_TOKEN", raising=False)
    try:
        yield fake
    finally:
        fake.close()


def test_the_gcp_controllers_account_drives_the_clusters_it_is_given_and_nothing_else(gcp):
    """A service account of its own, with the custom roles hyperControllerRead (reads,
    bound on the project without a condition) and hyperController (what driving does to
    instances and disks, bound once per cluster under an IAM condition on their names),
    read on the recipe's bucket prefix. With its token the real Compute client describes,
    terminates and launches its clusters' instances; a replacement it launches carries a
    node account of the cluster as it is (actAs, bound on those accounts only); a launch as
    another cluster's account or the project's default one, another cluster's instance, a
    firewall rule, IAM (a role, an account, the project's, an account's or a bucket's
    policy) and writes to the storage are refused. The laptop's next launch keeps the
    account a replacement runs as. A second handover widens it to a second cluster;
    removing the controller's cluster leaves no account and no binding of it."""
    from google.auth.credentials import AnonymousCredentials, Credentials

    from test_gcp import launch, node_account
    from test_gcp import spec as gspec

    from hypercli.providers.cloud import CloudError, CredentialsError
    from hypercli.providers.gcp import (ACT_AS_ROLE, CONTROLLER_PERMISSIONS,
                                        CONTROLLER_READ_PERMISSIONS, GCPAPI,
                                        controller_condition)
    gcp.add_bucket("outs")
    api = GCPAPI("proj", "us-central1", credentials=AnonymousCredentials())
    launch(api, gspec())                                       # c1-0, c1-1: it drives c1
    launch(api, gspec(cluster="c9", count=1), nodes=("c9-0",))  # not given to it
    ctl = CloudSpec(cluster="ctl-me", cluster_id="id-ctl", region="us-central1", grants=GS)
    email = api.controller_identity(ctl, owner(), {"c1": {}})["service_account"]
    member = f"serviceAccount:{email}"
    assert email in gcp.service_accounts
    assert sorted(gcp.roles["hyperController"]["includedPermissions"]) == \
        CONTROLLER_PERMISSIONS
    assert sorted(gcp.roles["hyperControllerRead"]["includedPermissions"]) == \
        CONTROLLER_READ_PERMISSIONS
    perms = set(CONTROLLER_PERMISSIONS) | set(CONTROLLER_READ_PERMISSIONS)
    assert all(p.startswith("compute.") for p in perms)
    assert not {p for p in perms if p.endswith(("setIamPolicy", ".create")) and
                not p.startswith(("compute.instances.", "compute.disks."))}
    mine = [b for b in gcp.project_policy["bindings"] if member in b["members"]]
    assert sorted((b["role"].rsplit("/", 1)[1], (b.get("condition") or {}).get("expression"))
                  for b in mine) == sorted([
        ("hyperControllerRead", None),
        ("hyperController", controller_condition("c1")["expression"]),
        ("hyperController", controller_condition("ctl-me")["expression"])])
    assert gcp.allowed(member, "outs", "storage.objects.get", "runs/wf-1/t-0/out")
    assert not gcp.allowed(member, "outs", "storage.objects.create", "runs/wf-1/t-0/out")
    assert not gcp.allowed(member, "outs", "storage.objects.get", "elsewhere/x")

    class Tok(Credentials):  # the token its metadata server hands out
        def refresh(self, request):
            self.token = "ya29.controller"
    gcp.tokens["ya29.controller"] = member
    mine_api = GCPAPI("proj", "us-central1", credentials=Tok())
    assert sorted(v.node for v in mine_api.describe("c1")) == ["c1-0", "c1-1"]
    mine_api.terminate("c1", ["c1-0"])
    assert gcp.instances["us-central1-a"]["c1-0"]["status"] == "STOPPING"
    # it may act as the node accounts of the clusters it drives, each bound on the account
    # itself (not the project), and as no other account
    node_sa, c9_sa = node_account("c1-0"), node_account("c9-0", cluster="c9")
    default_sa = "123456789-compute@developer.gserviceaccount.com"
    gcp.add_service_account(default_sa)  # the project's default account
    assert gcp.may_act_as(member, node_sa) and gcp.may_act_as(member, node_account("c1-1"))
    assert not gcp.may_act_as(member, c9_sa) and not gcp.may_act_as(member, default_sa)
    assert gcp.sa_policies[node_sa]["bindings"] == [
        {"role": ACT_AS_ROLE, "members": [member]}]
    assert not [b for b in gcp.project_policy["bindings"] if member in b["members"] and
                "iam.serviceAccounts.actAs" in gcp.role_permissions(b["role"])]
    # a replacement, launched as the controller launches one (the handover names a node
    # account of the cluster: cluster.service_account): it carries that account as it is
    n = len(gcp.requests)
    [vm], errors = launch(mine_api, gspec(identity=node_sa), nodes=("c1-2",))
    assert errors == {} and vm.node == "c1-2" and vm.state == "running"
    assert [a["email"] for a in
            gcp.instances["us-central1-a"]["c1-2"]["serviceAccounts"]] == [node_sa]
    assert not [(m, p) for m, p, _ in gcp.requests[n:] if p.endswith(
        ("/serviceAccounts", "setIamPolicy", "/iam")) or (m == "PUT" and "/iam" in p)]
    for other in (c9_sa, default_sa):  # another cluster's account, the project's default
        boot = Boot({"c1-3": "#cloud-config\n"}, "root", "ssh-ed25519 AAAA k")
        with pytest.raises(CredentialsError, match=f"not have access to service account "
                           f"'{other}'"):
            mine_api.create(gspec(identity=other), ["c1-3"], boot, {
                "network_tag": "hyper-c1", "service_account": other})
    assert "c1-3" not in gcp.instances["us-central1-a"]
    # the laptop's next launch into the cluster keeps the account a replacement runs as,
    # though the node it was made for is gone
    del gcp.instances["us-central1-a"]["c1-0"]
    [vm], errors = launch(api, gspec(), nodes=("c1-4",))
    assert errors == {} and node_sa in gcp.service_accounts
    assert node_account("c1-4") in gcp.service_accounts  # the laptop's: one per node
    beyond = {
        "delete another cluster's instance": lambda: mine_api.instances.delete_unary(
            project="proj", zone="us-central1-a", instance="c9-0"),
        "launch outside its clusters": lambda: mine_api.create(
            gspec(cluster="c9"), ["c9-1"], Boot({"c9-1": "#cloud-config\n"}, "root", "k"),
            {"network_tag": "hyper-c9", "service_account": node_sa}),
        "open a firewall rule": lambda: mine_api._firewall(__import__(
            "google.cloud.compute_v1", fromlist=["Firewall"]).Firewall(
            name="hyper-evil", network="global/networks/default", source_ranges=["0.0.0.0/0"],
            allowed=[{"I_p_protocol": "all"}])),
        "widen its own role": lambda: mine_api._rest(
            "PATCH", f"{gcp.url}/v1/projects/proj/roles/hyperController?updateMask="
            "includedPermissions", "x", {"includedPermissions": ["iam.roles.update"]}),
        "bind itself in the project": lambda: mine_api._rest(
            "POST", f"{gcp.url}/v1/projects/proj:setIamPolicy", "x",
            {"policy": {"bindings": [{"role": "roles/owner", "members": [member]}]}}),
        "make a service account": lambda: mine_api._rest(
            "POST", f"{gcp.url}/v1/projects/proj/serviceAccounts", "x",
            {"accountId": "evil-account"}),
        "bind itself on the bucket": lambda: mine_api._rest(
            "PUT", f"{gcp.url}/storage/v1/b/outs/iam", "x", {"bindings": []}),
        "let itself act as another account": lambda: mine_api._rest(
            "POST", f"{gcp.url}/v1/projects/proj/serviceAccounts/{c9_sa}:setIamPolicy", "x",
            {"policy": {"bindings": [{"role": ACT_AS_ROLE, "members": [member]}]}}),
    }
    for what, call in beyond.items():
        try:
            made = call()
        except Exception as e:  # CredentialsError / CloudError, or the client's Forbidden
            assert isinstance(e, (CredentialsError, CloudError)) or "403" in str(e), (what, e)
            assert "forbidden" in str(e).lower() or "permission" in str(e).lower(), (what, e)
        else:
            assert isinstance(made, tuple) and made[0] == [] and made[1], what  # create
    with pytest.raises(CredentialsError):  # a new node's own account: beyond it (docs)
        mine_api.prepare(gspec(), "ssh-ed25519 AAAA k")
    assert gcp.instances["us-central1-a"]["c9-0"]["status"] == "RUNNING"
    assert "c9-1" not in gcp.instances["us-central1-a"] and "hyper-evil" not in gcp.firewalls
    assert sorted(gcp.roles["hyperController"]["includedPermissions"]) == \
        CONTROLLER_PERMISSIONS
    # a later handover: the same account, widened to that cluster too (while someone else
    # changes the project's policy between its read and its write: read again, then set)
    gcp.project_races = 2  # its own-roles check reads the policy first, then the binding
    n = len(gcp.requests)
    assert api.controller_identity(ctl, owner(), {"c9": {}}) == {"service_account": email}
    assert [p for m, p, _ in gcp.requests[n:] if p.endswith(":setIamPolicy")
            and "/serviceAccounts/" not in p] == [
        "/v1/projects/proj:setIamPolicy"] * 2  # refused once (stale etag), then set
    assert gcp.may_act_as(member, c9_sa) and not gcp.may_act_as(member, default_sa)
    assert mine_api.describe("c9")
    mine_api.terminate("c9", ["c9-0"])
    assert gcp.instances["us-central1-a"]["c9-0"]["status"] == "STOPPING"
    # `hyper down --controller`: its account, its bindings in the project and on the bucket
    removed = remove_all(api, "ctl-me", timeout=60)
    assert f"service_account {email}" in removed
    assert email not in gcp.service_accounts
    assert not [b for b in gcp.project_policy["bindings"] if member in b["members"]]
    assert not [b for b in gcp.buckets["outs"]["policy"]["bindings"]
                if member in b["members"]]
    assert gcp.sa_policies[c9_sa] == {"bindings": []}  # nor may it act as a node account
    assert not [a for a, p in gcp.sa_policies.items()
                if any(member in b["members"] for b in p.get("bindings", []))]


def test_the_azure_controllers_identity_acts_in_its_clusters_groups_and_nothing_else(azure):
    """A user-assigned identity in the controller's own group with the custom role
    ``controller`` (VMs, disks, NICs, public IPs; no authorization or identity write)
    assigned on the resource group of each cluster it drives and nowhere else, and
    ``blob-reader`` on the recipe's container prefix. With its token the real azure-mgmt
    clients describe, terminate and launch its cluster's VMs (the cluster's network read and
    joined, not written); another cluster's VM and group are invisible and refused, as are
    a role assignment, an identity write and blob writes.
    A second handover widens it to a second group; removing the controller's cluster
    leaves no identity and no assignment of it."""
    import uuid

    from azure.core.credentials import AccessToken

    from test_azure import launch
    from test_azure import spec as aspec

    from hypercli.providers.azure import ROLES, AzureAPI
    from hypercli.providers.cloud import CloudError, CredentialsError

    class Tok:
        def __init__(self, token):
            self.token = token

        def get_token(self, *scopes, **kw):
            import time
            return AccessToken(self.token, int(time.time()) + 3600)
    azure.add_account("acct")
    api = AzureAPI("sub-1", "eastus", credential=Tok("token-1"))
    launch(api, aspec(grants=AZ))  # group hyper-c1, with a storage identity: it drives c1
    launch(api, aspec(cluster="c9"), nodes=("c9-0",))      # hyper-c9: not given to it
    ctl = CloudSpec(cluster="ctl-me", cluster_id="id-ctl", region="eastus", grants=AZ)
    rid = api.controller_identity(ctl, owner(), {"c1": {}})["identity"]
    assert "/resourceGroups/hyper-ctl-me/" in rid
    principal = azure.res[rid.lower()]["properties"]["principalId"]
    guid = str(uuid.uuid5(uuid.NAMESPACE_URL, "hypercli|sub-1|controller"))
    [perm] = azure.role_defs[guid]["permissions"]
    assert sorted(perm["actions"]) == sorted(ROLES["controller"][0]) and not perm["dataActions"]
    assert not [a for a in perm["actions"] if a.startswith("Microsoft.Authorization/")
                or a.endswith("userAssignedIdentities/write")]
    held = {(a["properties"]["scope"], a["properties"]["roleDefinitionId"].rsplit("/", 1)[1])
            for a in azure.assignments.values() if a["properties"]["principalId"] == principal}
    reader = str(uuid.uuid5(uuid.NAMESPACE_URL, "hypercli|sub-1|blob-reader"))
    assert held == {("/subscriptions/sub-1/resourceGroups/hyper-c1", guid),
                    (azure.accounts["acct"] + "/blobServices/default/containers/outs", reader)}
    assert azure.allowed(principal, "acct", "outs", "read", "runs/wf-1/t-0/out")
    assert not azure.allowed(principal, "acct", "outs", "write", "runs/wf-1/t-0/out")
    assert not azure.allowed(principal, "acct", "outs", "read", "elsewhere/x")

    azure.principal_tokens["controller-token"] = principal
    mine = AzureAPI("sub-1", "eastus", credential=Tok("controller-token"))
    assert sorted(v.node for v in mine.describe("c1")) == ["c1-0", "c1-1"]
    assert mine.describe("c9") == []  # its group is not one it may read
    mine.terminate("c1", ["c1-0"])
    azure.wait()
    assert azure.vm("hyper-c1", "c1-0") is None
    vms = mine.compute.virtual_machines
    beyond = {
        "delete another cluster's VM": lambda: vms.begin_delete("hyper-c9", "c9-0").result(),
        "delete another cluster's group": lambda: mine.rm.resource_groups.begin_delete(
            "hyper-c9").result(),
        "give itself a role": lambda: mine._assign(
            "/subscriptions/sub-1", guid, principal, None),
        "make an identity": lambda: mine._arm(
            "PUT", "/subscriptions/sub-1/resourceGroups/hyper-c1/providers/Microsoft."
            "ManagedIdentity/userAssignedIdentities/evil?api-version=2023-01-31", "x",
            {"location": "eastus"}),
        "list the storage account's keys": lambda: mine._arm(
            "POST", azure.accounts["acct"] + "/listKeys?api-version=2023-01-01", "x"),
    }
    for what, call in beyond.items():
        with pytest.raises((CredentialsError, CloudError, Exception),
                           match="AuthorizationFailed|may not"):
            call()
            pytest.fail(what)
    # a replacement node of its cluster: the cluster's network read and joined as it is
    writes = len(azure.requests)
    storage = api.prepare(aspec(grants=AZ), "ssh-ed25519 AAAA k")["identity"]
    as_given = aspec(grants=AZ, identity=storage)  # as the handover gives it (handover_data)
    prepared = mine.prepare(as_given, "ssh-ed25519 AAAA k")
    [vm], errors = mine.create(as_given, ["c1-2"], Boot({"c1-2": "#cloud-config\n"}, "root",
                                                       "ssh-ed25519 AAAA k"), prepared)
    assert errors == {} and vm.node == "c1-2"
    assert azure.vm("hyper-c1", "c1-2")["tags"][TAG_OWNER] == owner()
    assert storage in azure.vm("hyper-c1", "c1-2")["identity"]["userAssignedIdentities"]
    assert not [p for m, p, _ in azure.requests[writes:] if m == "PUT" and (
        "networkSecurityGroups" in p or "virtualNetworks" in p)]
    with pytest.raises((CredentialsError, CloudError)):  # another cluster's: beyond it
        mine.prepare(aspec(cluster="c9"), "ssh-ed25519 AAAA k")
    assert azure.vm("hyper-c9", "c9-0") is not None and "hyper-c9" in azure.groups
    # a later handover: the same identity, widened to that cluster's group too
    assert api.controller_identity(ctl, owner(), {"c9": {}}) == {"identity": rid}
    assert sorted(v.node for v in mine.describe("c9")) == ["c9-0"]
    # `hyper down --controller`: its assignments, then its group with the identity
    remove_all(api, "ctl-me", timeout=60)
    azure.wait()
    assert "hyper-ctl-me" not in azure.groups and rid.lower() not in azure.res
    assert not [a for a in azure.assignments.values()
                if a["properties"]["principalId"] == principal]


@pytest.mark.slow
@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_a_gcp_or_azure_controller_is_on_demand_labelled_scoped_reused_listed_and_removed(
        ssh_hosts, tmp_path, hyper_home, hyper, monkeypatch, request, cloud):
    """On the GCP and Azure stand-ins (the instance booted onto an SSH test host,
    tests/cloudhosts.py): the controller is the cheapest on-demand offer of the catalog in
    the recipe's first region, labelled/tagged for its user, running as the controller's
    own identity (the service account bound as the identity test above shows; the managed
    identity assigned on the driven cluster's group), with its idle limit; a second
    workflow reuses it (its identity widened to that cluster); `hyper status` lists it with
    its cost; `hyper down --controller` leaves nothing of it on the cloud."""
    import base64
    import time

    from cloudhosts import Booter, azure_source, gcp_publisher, gcp_source

    from hypercli.controller.client import Controller
    from hypercli.controller.cloud import ensure, name_of, offers_for
    from hypercli.offers import catalog as C
    from hypercli.providers.cloud import label_key
    from hypercli.state import State
    monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(tmp_path / "addresses.json"))
    if cloud == "gcp":
        fake = request.getfixturevalue("gcp")
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", fake.project)
        fake.add_image("hyper-node-cpu-1-a", {"hyper-image": "node", "hyper-variant": "cpu"},
                       "2026-06-01T10:00:00.000-07:00")
        fake.add_bucket("outs")
        source, publish, region, zone = gcp_source(fake), gcp_publisher(fake), \
            "us-central1", "us-central1-a"
    else:
        fake = request.getfixturevalue("azure")
        monkeypatch.setenv("HYPER_AZURE_TOKEN", "token")
        monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "sub-1")
        fake.add_image("hyper-node-cpu-1-a", {"hyper:image": "node", "hyper:variant": "cpu"})
        fake.add_account("acct")
        source, publish, region, zone = azure_source(fake), None, "eastus", ""
    # (type, vCPUs, GiB, $/h): too small, the cheapest that fits, and dearer ones
    rows = {"gcp": [("e2-small", 2, 2, 0.017), ("e2-medium", 2, 4, 0.05),
                    ("e2-standard-2", 2, 8, 0.067), ("e2-standard-4", 4, 16, 0.134)],
            "azure": [("Standard_B1s", 1, 1, 0.0104), ("Standard_F2s_v2", 2, 4, 0.05),
                      ("Standard_D2s_v5", 2, 8, 0.096), ("Standard_D4s_v5", 4, 16, 0.192)]}
    fits = rows[cloud][1][0]
    t = C.Table(cloud, read_at=time.time(), source="test")
    for name, cpus, mem, price in rows[cloud]:
        t.add({"instance_type": name, "vcpus": str(cpus), "memory_gib": str(mem),
               "region": region, "zone": zone, "price": str(price),
               "spot_price": str(price / 4)})
    C.write(t)
    [best] = offers_for(cloud, region)[:1]
    assert best.instance_type == fits  # the cheapest with 2 vCPUs and 4 GiB, on demand
    hosts = ssh_hosts.start(1)
    booter = Booter(source, hosts, tmp_path / "addresses.json", publish=publish)
    booter.start()
    options = {"region": region, "ssh_cidr": "10.213.0.0/24", "instance_type": rows[cloud][3][0],
               "spot": True}  # the nodes', not its own
    name = name_of(cloud)
    try:
        state = State()
        ctl = ensure(state, cloud, options, GS if cloud == "gcp" else AZ,
                     clusters={"c1": {}}, idle_minutes=7)
        assert ctl["cloud"]["cluster"] == name
        [node] = state.nodes(name, status="up")
        if cloud == "gcp":
            [inst] = [i for z in fake.instances.values() for i in z.values()]
            assert inst["scheduling"]["provisioningModel"] == "STANDARD"  # on demand
            assert inst["machineType"].endswith(f"/{fits}")
            assert inst["labels"][label_key(TAG_CLUSTER)] == name
            assert inst["labels"][label_key(TAG_OWNER)] == \
                __import__("hypercli.providers.gcp", fromlist=["x"]).label_value(owner())
            [sa] = inst["serviceAccounts"]
            member = f"serviceAccount:{sa['email']}"
            assert sa["email"].split("@")[0].endswith(tuple("0123456789abcdef")) and \
                "controller" in fake.service_accounts[sa["email"]]["description"]
            held = sorted(((b.get("condition") or {}).get("title", ""))
                          for b in fake.project_policy["bindings"] if member in b["members"])
            assert held == ["", "drives c1", f"drives {name}"]
            doc = {i["key"]: i["value"] for i in inst["metadata"]["items"]}["user-data"]
        else:
            [vm] = [r for r in fake.res.values() if r["type"].endswith("/virtualMachines")]
            assert vm["properties"].get("priority", "Regular") == "Regular"  # on demand
            assert vm["properties"]["hardwareProfile"]["vmSize"] == fits
            assert vm["tags"][TAG_CLUSTER] == name and vm["tags"][TAG_OWNER] == owner()
            [rid] = list(vm["identity"]["userAssignedIdentities"])
            principal = fake.res[rid.lower()]["properties"]["principalId"]
            scopes = sorted(a["properties"]["scope"] for a in fake.assignments.values()
                            if a["properties"]["principalId"] == principal)
            assert len(scopes) == 2 and scopes[1] == \
                "/subscriptions/sub-1/resourceGroups/hyper-c1"  # the driven cluster's group
            assert scopes[0] == fake.accounts["acct"] + "/blobServices/default/containers/outs"
            doc = base64.b64decode(vm["properties"]["osProfile"]["customData"]).decode()
        assert '"idle_minutes": 7' in doc  # removes itself when idle
        c = Controller(ctl)  # reached over SSH with its pinned host key
        try:
            assert c.conn.run("echo up").stdout.strip() == b"up"
        finally:
            c.close()
        again = ensure(State(), cloud, options, (), clusters={"c2": {}})
        assert again["name"] == ctl["name"] and set(again["cloud"]["clusters"]) == {"c1", "c2"}
        if cloud == "gcp":
            assert sum(len(z) for z in fake.instances.values()) == 1
            assert "drives c2" in {(b.get("condition") or {}).get("title") for b in
                                   fake.project_policy["bindings"] if member in b["members"]}
        else:
            assert len([r for r in fake.res.values()
                        if r["type"].endswith("/virtualMachines")]) == 1
            assert "/subscriptions/sub-1/resourceGroups/hyper-c2" in {
                a["properties"]["scope"] for a in fake.assignments.values()
                if a["properties"]["principalId"] == principal}
        r = hyper("status", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        line = next(x for x in r.stdout.splitlines() if x.startswith("controller "))
        assert ctl["name"] in line and f"{name} $" in line and "$0.0500/h" in line, line
        r = hyper("down", "--controller", name, timeout=300)
        assert r.returncode == 0, r.stdout + r.stderr
        assert f"controller {ctl['name']} removed" in r.stdout, r.stdout
        if cloud == "gcp":
            assert fake.instances == {z: {} for z in fake.zones}
            assert not any(fake.disks.values()) and not fake.firewalls
            assert not fake.service_accounts
            assert not [b for b in fake.project_policy["bindings"] if member in b["members"]]
            assert not [b for b in fake.buckets["outs"]["policy"]["bindings"]
                        if member in b["members"]]
        else:
            fake.wait()
            assert fake.groups == {} and fake.res == {}
            assert not [a for a in fake.assignments.values()
                        if a["properties"]["principalId"] == principal]
        r = hyper("status", timeout=60)
        assert "controller " not in r.stdout, r.stdout
        assert not booter.errors, booter.errors
        assert node["name"]
    finally:
        booter.stopping.set()
        booter.join(10)


def test_an_azure_clusters_storage_identity_is_handed_to_the_controller_as_it_is(
        hyper_home, monkeypatch):
    """The controller may not make or change an identity, so the handover names the
    cluster's storage identity for its launches to use as it is (as the instance profile
    on AWS); a cluster without ``az://`` storage has none."""
    from hypercli.controller.cloud import handover_data
    from hypercli.providers.azure import identity_name
    from hypercli.state import State
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "sub-1")
    st = State()
    st.put_cluster("c1", "azure", {"options": {"region": "eastus"},
                                   "given": [g.as_dict() for g in AZ]})
    st.put_cluster("c2", "azure", {"options": {"region": "eastus"}, "given": []})
    name = identity_name(CloudSpec(cluster="c1", cluster_id=st.cluster_uid("c1")))
    assert handover_data(st, "c1")["identity"] == (
        "/subscriptions/sub-1/resourceGroups/hyper-c1/providers/Microsoft.ManagedIdentity/"
        f"userAssignedIdentities/{name}")
    assert handover_data(st, "c2")["identity"] is None


def test_a_gcp_clusters_node_account_is_handed_to_the_controller_as_it_is(
        hyper_home, monkeypatch):
    """The controller may not make a service account, so the handover names a node account
    of the cluster (that of its first node that is up, or its cluster.service_account) for
    its replacements to run as, and the controller's side sets it as the cluster's
    service_account; a cluster with no node up names none."""
    from hypercli.controller.cloud import handover_data
    from hypercli.controller.host import _cloud_cluster
    from hypercli.providers.gcp import account_id
    from hypercli.state import State
    st = State()
    st.put_cluster("g1", "gcp", {"options": {"region": "us-central1", "project": "proj"}})
    mine = "mine@proj.iam.gserviceaccount.com"  # cluster.service_account
    st.put_cluster("g2", "gcp", {"options": {"region": "us-central1", "project": "proj",
                                             "service_account": mine}})
    st.put_cluster("g3", "gcp", {"options": {"region": "us-central1", "project": "proj"}})
    st.put_node("g1", "g1-0", slots=1, status="down")
    st.put_node("g1", "g1-1", slots=1)
    st.put_node("g2", "g2-0", slots=1)
    aid = account_id(CloudSpec(cluster="g1", cluster_id=st.cluster_uid("g1")), "g1-1")
    data = handover_data(st, "g1")
    assert data["service_account"] == f"{aid}@proj.iam.gserviceaccount.com"
    assert handover_data(st, "g2")["service_account"] == mine
    assert handover_data(st, "g3")["service_account"] is None
    export = {"cluster": {"name": "g1", "spec": json.dumps(st.cluster("g1")["spec"])}}
    _cloud_cluster(dict(data, keys={}, owner=None), export)
    assert json.loads(export["cluster"]["spec"])["options"]["service_account"] == \
        data["service_account"]


def test_a_squatted_controller_identity_is_refused_before_it_is_used(gcp, azure):
    """An account or identity found under the controller's computed name that is not its
    own (made by someone else; holding a role hypercli did not give it) is refused, with
    nothing bound to it: every workflow the controller drives would run with its rights."""
    from google.auth.credentials import AnonymousCredentials

    from test_azure import Token

    from hypercli.providers.azure import AzureAPI, controller_identity_name
    from hypercli.providers.cloud import IdentityConflict
    from hypercli.providers.gcp import GCPAPI, account_id
    ctl = CloudSpec(cluster="ctl-me", cluster_id="id-ctl", region="us-central1")
    email = f"{account_id(ctl, 'controller')}@proj.iam.gserviceaccount.com"
    gcp.add_service_account(email)  # someone else's, under that name
    gcp.project_policy["bindings"].append({"role": "roles/owner",
                                           "members": [f"serviceAccount:{email}"]})
    with pytest.raises(IdentityConflict, match="not the controller ctl-me's own"):
        GCPAPI("proj", "us-central1", credentials=AnonymousCredentials()).controller_identity(
            ctl, owner(), {"c1": {}})
    assert [b["role"] for b in gcp.project_policy["bindings"]] == ["roles/owner"]
    a = AzureAPI("sub-1", "eastus", credential=Token())
    a.controller_identity(ctl, owner(), {"c1": {}})
    rid = next(k for k in azure.res if k.endswith(controller_identity_name(ctl).lower()))
    azure.res[rid]["tags"] = {"made-by": "someone"}  # no longer the controller's own
    with pytest.raises(IdentityConflict, match="is not cluster ctl-me's own"):
        a.controller_identity(ctl, owner(), {"c2": {}})
    assert not [x for x in azure.assignments.values()
                if x["properties"]["scope"].endswith("/hyper-c2")]
