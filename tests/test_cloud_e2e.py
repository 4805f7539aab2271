"""End to end on a cloud: `hyper up → run → down` with the aws provider against moto's EC2 API
(moto_server on loopback), where the instances' SSH addresses are SSH test hosts booted by
tests/cloudhosts.py. A spot interruption is injected mid-run the way it happens: the instance is
terminated in the cloud and its host dies.

The spot test's recipe has ``storage: s3://`` and a ``chunks+s3://`` mount on an S3 server the
hosts reach; the nodes have no credentials of their own but those an IMDSv2 stand-in serves
for the cluster's role (tests/imds.py), found through the node's boto3 configuration as on an
instance. moto's authorisation checks are off here: its server rejects the signatures of
listings with a ``/`` in their prefix, which every mount and push makes; the role's policy is
enforced in tests/test_aws_identity.py."""

from __future__ import annotations

import json
import threading
import time

import pytest
import yaml

from cloudhosts import REGION, Booter, tagged_left
from conftest import wait_for

pytestmark = pytest.mark.slow


def test_up_run_spot_interruption_and_down_on_aws(aws, ssh_hosts, tmp_path, hyper_home,
                                                  hyper, monkeypatch):
    import boto3

    from hypercli.mount import pack
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    from imds import IMDS
    from s3server import S3Server
    from test_ssh import assert_one_success_each
    hosts = ssh_hosts.start(3)
    if hosts[0].run("python3 -c 'import boto3'").returncode != 0:
        pytest.skip("the hosts' python3 has no boto3 (Debian: python3-boto3)")
    store = S3Server(host="10.213.0.1").start()  # the bridge address: the hosts reach it
    imds = IMDS("hyper-spotjob", {"AccessKeyId": "ASIAE2ENODE", "SecretAccessKey": "node",
                                  "SessionToken": "node-session",
                                  "Expiration": "2099-01-01T00:00:00Z"},
                host="10.213.0.1").__enter__()
    monkeypatch.setenv("HYPER_S3_ENDPOINT_URL", store.endpoint)
    # where an instance's boto3 finds its metadata service (169.254.169.254); a token request
    # gets 5 s, not boto3's 1 s, before it falls back to IMDSv1 (a loaded test machine)
    for h in hosts:
        h.run(f"mkdir -p ~/.aws && printf '[default]\\nec2_metadata_service_endpoint = "
              f"{imds.endpoint}\\nmetadata_service_timeout = 5\\n"
              "metadata_service_num_attempts = 3\\n' > ~/.aws/config && "
              "rm -f ~/.aws/credentials", check=True)
    store.make_bucket("spotdata")
    (tmp_path / "ds").mkdir()
    for i in range(1, 7):
        (tmp_path / "ds" / f"x{i}").write_text(f"value {i * i}\n")
    pack.push(tmp_path / "ds", "s3://spotdata/ds")
    booter = Booter(aws, hosts, tmp_path / "addresses.json")
    booter.start()
    image = aws.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    recipe = {
        "name": "spotjob",
        "storage": "s3://spotdata/runs",
        "mounts": {"/data": "chunks+s3://spotdata/ds"},
        "cluster": {"provider": "aws", "region": REGION, "zone": [f"{REGION}a"],
                    "instance_type": "m5.large", "workers": 2, "image": image,
                    "ssh_cidr": "10.213.0.0/24"},
        "experiments": {"work": {
            "parameters": {"i": [1, 2, 3, 4, 5, 6]}, "retries": 2,
            "command": 'sleep 1.5; cat /data/x{{i}} > "$HYPER_OUTPUT/v"'}}}
    path = tmp_path / "spotjob.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    try:
        r = hyper("up", path, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "cluster spotjob is up: 2 aws nodes" in r.stdout
        nodes = State().nodes("spotjob", status="up")
        from hypercli.providers.aws import role_name
        from hypercli.providers.cloud import CloudSpec
        role = role_name(CloudSpec(cluster="spotjob", cluster_id=State().cluster_uid("spotjob")))
        assert {n["info"]["spot"] for n in nodes} == {True}
        assert all(n["provider_id"].startswith("i-") for n in nodes)
        for n in nodes:  # launched with the cluster's role and IMDSv2 only
            inst = aws.describe_instances(InstanceIds=[n["provider_id"]])["Reservations"][0][
                "Instances"][0]
            assert inst["IamInstanceProfile"]["Arn"].endswith(f"/{role}")
            assert inst["MetadataOptions"]["HttpTokens"] == "required"
        # the host key was pinned before the first contact: no trust-on-first-use
        pinned = (hyper_home / "known_hosts" / "spotjob").read_text()
        assert all(h.ip in pinned for h in booter.booted.values() if h)

        injected = {}

        def interrupt():
            wait_for(lambda: State().attempts("spotjob-1", status=["running"]), timeout=60,
                     what="a running attempt")
            victim = State().attempts("spotjob-1", status=["running"])[0]
            node = next(n for n in State().nodes("spotjob") if n["name"] == victim["node"])
            injected["node"], injected["at"] = node["name"], time.monotonic()
            aws.terminate_instances(InstanceIds=[node["provider_id"]])  # the cloud takes it
            booter.booted[node["provider_id"]].kill()                    # and the VM dies
        state = State()
        wid, _, provider, nodes, lock = prepare_run(state, str(path))
        t = threading.Thread(target=interrupt)
        t.start()
        try:
            summary = Scheduler(state, wid, provider, nodes).run()
        finally:
            lock.release()
            t.join(90)
        assert summary.exit_code == 0, state.attempts(wid)
        assert_one_success_each(state, wid)
        lost = [a for a in state.attempts(wid) if a["status"] == "lost"]
        assert lost and {a["node"] for a in lost} == {injected["node"]}
        all_nodes = {n["name"]: n for n in state.nodes("spotjob")}
        assert all_nodes[injected["node"]]["status"] in ("lost", "down")
        assert len(all_nodes) == 3  # the replacement joined the cluster ...
        replacement = next(n for n in all_nodes if n not in {x["name"] for x in nodes})
        used = {a["node"] for a in state.attempts(wid) if a["status"] == "succeeded"}
        assert replacement in used  # ... and took work
        assert not booter.errors, booter.errors
        # each task read its file from the mount and its output was pushed from its node
        for t in state.tasks(wid):
            i = t["params"]["i"]
            got = pack.pull(f"s3://spotdata/runs/{wid}/{t['id']}", tmp_path / "got" / t["id"])
            assert got is not None
            assert (tmp_path / "got" / t["id"] / "v").read_text() == f"value {i * i}\n"
        # the nodes' boto3 found the role's credentials through IMDSv2: a token first
        from_nodes = [r for r in imds.requests if r[3] != "127.0.0.1"]
        assert {r[3] for r in from_nodes} >= {h.ip for h in booter.booted.values() if h}
        assert ("PUT", "/latest/api/token") in [r[:2] for r in from_nodes]
        assert all(r[2] for r in from_nodes if r[0] == "GET")

        # the cost ledger: each node's lifetime, the preempted one ended when it was taken
        rows = {r["node"]: r for r in state.ledger("spotjob")}
        assert set(rows) == set(all_nodes)
        victim = rows[injected["node"]]
        assert victim["end_reason"] == "preempted" and victim["ended_at"] is not None
        assert rows[replacement]["launched_at"] >= victim["ended_at"]
        assert all(r["ended_at"] is None for n, r in rows.items() if n != injected["node"])

        r = hyper("down", "spotjob", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "removed instance" in r.stdout and "security_group" in r.stdout
        assert tagged_left(aws, "spotjob") == []
        rows = {r["node"]: r for r in State().ledger("spotjob")}
        assert rows[injected["node"]]["ended_at"] == victim["ended_at"]  # not moved by down
        assert all(r["end_reason"] == "down" and r["ended_at"] >= r["launched_at"]
                   for n, r in rows.items() if n != injected["node"])
        iam = boto3.client("iam", region_name=REGION,
                           endpoint_url=aws.meta.endpoint_url)
        assert iam.list_roles(PathPrefix="/hyper/")["Roles"] == []
        assert iam.list_instance_profiles(PathPrefix="/hyper/")["InstanceProfiles"] == []
    finally:
        booter.stopping.set()
        booter.join(10)
        imds.__exit__(None, None, None)
        store.stop()


def test_dry_run_prices_then_gc_after_the_state_file_is_deleted(aws, ssh_hosts, tmp_path,
                                                                hyper_home, hyper):
    """`hyper up --dry-run` creates nothing and shows spot prices; after `hyper up`, the
    state file is deleted; `hyper gc` still finds the cluster's resources by their tags and
    removes them all, and leaves a cluster the (new) state file has up alone."""
    hosts = ssh_hosts.start(2)
    booter = Booter(aws, hosts, tmp_path / "addresses.json")
    booter.start()
    image = aws.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]

    def recipe(name):
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump({
            "name": name, "cluster": {"provider": "aws", "region": REGION,
                                      "instance_type": "m5.large", "workers": 1,
                                      "image": image, "ssh_cidr": "10.213.0.0/24"},
            "experiments": {"a": {"command": "true"}}}))
        return path
    try:
        r = hyper("up", recipe("orphan"), "--dry-run", timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "0 running, 1 to create, m5.large spot" in r.stdout
        assert "estimated cost: $" in r.stdout and "/h" in r.stdout
        assert tagged_left(aws, "orphan") == []  # a dry run creates nothing
        r = hyper("up", recipe("orphan"), timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert tagged_left(aws, "orphan")
        (hyper_home / "state.db").unlink()  # the laptop lost its state
        for extra in ("state.db-wal", "state.db-shm"):
            (hyper_home / extra).unlink(missing_ok=True)
        r = hyper("up", recipe("kept"), timeout=120)  # a live cluster of the new state file
        assert r.returncode == 0, r.stdout + r.stderr
        r = hyper("gc", "--provider", "aws", "--region", REGION, "--dry-run")
        assert r.returncode == 0 and "orphan instance" in r.stdout and "kept" not in r.stdout
        assert tagged_left(aws, "orphan")
        r = hyper("gc", "--provider", "aws", "--region", REGION, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "removed instance" in r.stdout and "removed security_group" in r.stdout
        assert tagged_left(aws, "orphan") == []
        assert tagged_left(aws, "kept")  # owned by a cluster that is up: left alone
        r = hyper("down", "kept", timeout=120)
        assert r.returncode == 0 and tagged_left(aws, "kept") == []
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)


def _second_cloud(cloud: str, monkeypatch, tmp_path, request):
    """The second cloud's stand-in with the baked node image: (its cloud-config source, the
    host-key publisher or None, a check that it holds nothing, its catalog row, the zone
    the nodes land in)."""
    from cloudhosts import azure_source, gcp_publisher, gcp_source
    if cloud == "gcp":
        pytest.importorskip("google.cloud.compute_v1")
        from gcpfake import ComputeFake
        fake = ComputeFake()
        request.addfinalizer(fake.close)
        monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
        monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", fake.project)
        fake.add_image("hyper-node-cpu-1-a", {"hyper-image": "node", "hyper-variant": "cpu"},
                       "2026-06-01T10:00:00.000-07:00")
        return (gcp_source(fake), gcp_publisher(fake),
                lambda: fake.instances == {z: {} for z in fake.zones}
                and not fake.firewalls and not fake.service_accounts,
                ("n2-standard-2", 2, 8, "us-central1", "us-central1-a", 0.097, 0.05),
                "us-central1-a")
    pytest.importorskip("azure.mgmt.compute")
    from azurefake import ArmFake
    fake = ArmFake(tmp_path)
    request.addfinalizer(fake.close)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", fake.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(fake.ca))
    monkeypatch.setenv("HYPER_AZURE_TOKEN", "token")
    monkeypatch.setenv("AZURE_SUBSCRIPTION_ID", "sub-1")
    fake.add_image("hyper-node-cpu-1-a", {"hyper:image": "node", "hyper:variant": "cpu"})
    return (azure_source(fake), None, lambda: fake.groups == {} and fake.res == {},
            ("Standard_D2s_v5", 2, 8, "eastus", "", 0.096, 0.05), None)


@pytest.mark.parametrize("second", ["gcp", "azure"])
def test_a_recipe_naming_only_cpus_fails_over_to_the_second_cloud_and_runs_there(
        aws, ssh_hosts, tmp_path, hyper_home, hyper, monkeypatch, request, second):
    """A recipe whose cluster allows ``clouds: [aws, <second>]`` and whose experiment names
    only ``cpus:``: the optimizer ranks AWS first (cheaper), EC2 (moto_server) answers every
    RunInstances ``InsufficientInstanceCapacity`` (at the botocore client boundary of the
    ``hyper run`` process), so the launch goes on to the second cloud (tests/gcpfake.py,
    tests/azurefake.py) in price order, the tasks run there, `hyper status` and the run's
    output say the cloud changed, `hyper down` (its own process) leaves nothing on either
    cloud and the ledger holds each node's lifetime."""
    from botocore.awsrequest import AWSResponse
    from hypercli.offers import catalog as C
    from hypercli.providers import aws as aws_provider
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    from test_ssh import assert_one_success_each

    source, publish, empty, row, zone = _second_cloud(second, monkeypatch, tmp_path, request)
    # the catalog: AWS's two zones cheaper than the second cloud, so AWS is tried first
    for cloud, rows in {
            "aws": [("m5.large", 2, 8, REGION, f"{REGION}a", 0.096, 0.030),
                    ("m5.large", 2, 8, REGION, f"{REGION}b", 0.096, 0.031)],
            second: [row]}.items():
        t = C.Table(cloud, read_at=time.time(), source="test")
        for name, cpus, mem, region, z, price, spot in rows:
            t.add({"instance_type": name, "vcpus": str(cpus), "memory_gib": str(mem),
                   "region": region, "zone": z, "price": str(price),
                   "spot_price": str(spot)})
        C.write(t)
    where = f"{second} {zone or row[3]} {row[0]}"
    asked: list = []

    def refuse(params, **_):  # EC2 has no room anywhere
        body = params["body"]
        asked.append(body.get("Placement.AvailabilityZone") or body.get(
            "NetworkInterface.1.SubnetId"))
        error = {"Code": "InsufficientInstanceCapacity", "Message": "We currently do not "
                 "have sufficient capacity in the Availability Zone you requested."}
        return (AWSResponse(params["url"], 500, {}, None),
                {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 500}})

    init = aws_provider.AWSAPI.__init__

    def refusing(self, *a, **kw):
        init(self, *a, **kw)
        self.ec2.meta.events.register("before-call.ec2.RunInstances", refuse)
    monkeypatch.setattr(aws_provider.AWSAPI, "__init__", refusing)

    hosts = ssh_hosts.start(2)
    booter = Booter(source, hosts, tmp_path / "addresses.json", publish=publish)
    booter.start()
    image = aws.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    recipe = {
        "name": "xcloud",
        "cluster": {"provider": "aws", "clouds": ["aws", second], "workers": 2,
                    "image": image, "ssh_cidr": "10.213.0.0/24"},
        "experiments": {"work": {
            "parameters": {"i": [1, 2, 3, 4]}, "resources": {"cpus": 2},
            "command": 'echo "done {{i}}" > "$HYPER_OUTPUT/v"'}}}
    path = tmp_path / "xcloud.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    try:
        state = State()
        said: list[str] = []
        t0 = time.time()
        wid, _, provider, nodes, lock = prepare_run(state, str(path), log=said.append)
        t1 = time.time()
        try:
            summary = Scheduler(state, wid, provider, nodes).run()
        finally:
            lock.release()
        assert summary.exit_code == 0, state.attempts(wid)
        assert_one_success_each(state, wid)
        assert len(asked) == 2  # each AWS zone once, then GCP
        nodes = state.nodes("xcloud")
        assert len(nodes) == 2 and {n["info"]["cloud"] for n in nodes} == {second}
        assert {n["info"]["region"] for n in nodes} == {row[3]}
        assert {a["node"] for a in state.attempts(wid)} <= {n["name"] for n in nodes}
        assert f"failover: {REGION}b: no spot capacity for m5.large → {where}" in said, said
        assert f"failover: changed cloud: 2 nodes on {second}, not aws: its offers had no " \
            "room" in said, said
        assert any(line.endswith(f"on 2 {second} nodes") for line in said), said
        r = hyper("status", "xcloud")
        assert r.returncode == 0, r.stderr
        assert f"changed cloud: 2 nodes on {second}, not aws" in r.stdout, r.stdout
        assert f"{where} spot $0.0500/h" in r.stdout, r.stdout

        r = hyper("down", "xcloud", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        t2 = time.time()
        assert empty()                                        # nothing left there
        assert tagged_left(aws, "xcloud") == []               # nor on AWS
        rows = State().ledger("xcloud")
        assert sorted(r["node"] for r in rows) == sorted(n["name"] for n in nodes)
        assert all(r["cloud"] == second and r["price"] == 0.05 and t0 <= r["launched_at"] <= t1
                   and t1 <= r["ended_at"] <= t2 and r["end_reason"] == "down" for r in rows)
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)


def test_a_cluster_split_over_two_clouds_is_listed_run_taken_down_and_costed_whole(
        aws, ssh_hosts, tmp_path, hyper_home, hyper, monkeypatch, request):
    """EC2 has room for one node only (every later RunInstances answered
    ``InsufficientInstanceCapacity``): the cluster's second node goes to GCP. Both nodes take
    tasks, `hyper status` lists both with their clouds, `hyper down` removes both clouds'
    resources and the ledger has one row per node, each with its own cloud."""
    from botocore.awsrequest import AWSResponse
    from cloudhosts import _ec2_source
    from hypercli.offers import catalog as C
    from hypercli.providers import aws as aws_provider
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    from test_ssh import assert_one_success_each

    gcp, publish, empty, row, zone = _second_cloud("gcp", monkeypatch, tmp_path, request)
    for cloud, rows in {"aws": [("m5.large", 2, 8, REGION, f"{REGION}a", 0.096, 0.030)],
                        "gcp": [row]}.items():
        t = C.Table(cloud, read_at=time.time(), source="test")
        for name, cpus, mem, region, z, price, spot in rows:
            t.add({"instance_type": name, "vcpus": str(cpus), "memory_gib": str(mem),
                   "region": region, "zone": z, "price": str(price),
                   "spot_price": str(spot)})
        C.write(t)
    asked: list = []

    def room_for_one(params, **_):
        asked.append(params["body"].get("Placement.AvailabilityZone"))
        if len(asked) == 1:
            return None  # the first instance is launched
        error = {"Code": "InsufficientInstanceCapacity", "Message": "We currently do not "
                 "have sufficient capacity in the Availability Zone you requested."}
        return (AWSResponse(params["url"], 500, {}, None),
                {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 500}})

    init = aws_provider.AWSAPI.__init__

    def refusing(self, *a, **kw):
        init(self, *a, **kw)
        self.ec2.meta.events.register("before-call.ec2.RunInstances", room_for_one)
    monkeypatch.setattr(aws_provider.AWSAPI, "__init__", refusing)
    ec2 = _ec2_source(aws)
    hosts = ssh_hosts.start(2)
    booter = Booter(lambda: {**ec2(), **gcp()}, hosts, tmp_path / "addresses.json",
                    publish=publish)
    booter.start()
    image = aws.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    recipe = {
        "name": "split",
        "cluster": {"provider": "aws", "clouds": ["aws", "gcp"], "workers": 2,
                    "image": image, "ssh_cidr": "10.213.0.0/24"},
        "experiments": {"work": {
            "parameters": {"i": list(range(1, 9))}, "resources": {"cpus": 2},
            "command": 'sleep 1; echo "done {{i}}" > "$HYPER_OUTPUT/v"'}}}
    path = tmp_path / "split.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    try:
        state = State()
        said: list[str] = []
        t0 = time.time()
        wid, _, provider, nodes, lock = prepare_run(state, str(path), log=said.append)
        t1 = time.time()
        try:
            summary = Scheduler(state, wid, provider, nodes).run()
        finally:
            lock.release()
        assert summary.exit_code == 0, state.attempts(wid)
        assert_one_success_each(state, wid)
        nodes = {n["name"]: n for n in state.nodes("split")}
        clouds = {n["info"]["cloud"]: name for name, n in nodes.items()}
        assert len(nodes) == 2 and set(clouds) == {"aws", "gcp"}, nodes
        used = {a["node"] for a in state.attempts(wid) if a["status"] == "succeeded"}
        assert used == set(nodes)  # both clouds' nodes ran tasks
        assert any(line.endswith("on 1 aws node, 1 gcp node") for line in said), said
        assert "failover: changed cloud: 1 node on gcp, not aws: its offers had no room" \
            in said, said
        r = hyper("status", "split")
        assert r.returncode == 0, r.stderr
        assert f"aws {REGION}a m5.large spot $0.0300/h" in r.stdout, r.stdout
        assert "gcp us-central1-a n2-standard-2 spot $0.0500/h" in r.stdout, r.stdout

        r = hyper("down", "split", timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        t2 = time.time()
        assert empty() and tagged_left(aws, "split") == []  # nothing left on either cloud
        rows = {r["node"]: r for r in State().ledger("split")}
        assert set(rows) == set(nodes)
        assert (rows[clouds["aws"]]["cloud"], rows[clouds["aws"]]["price"]) == ("aws", 0.03)
        assert (rows[clouds["gcp"]]["cloud"], rows[clouds["gcp"]]["price"]) == ("gcp", 0.05)
        assert all(t0 <= r["launched_at"] <= t1 <= r["ended_at"] <= t2
                   and r["end_reason"] == "down" for r in rows.values())
        r = hyper("cost", "split", "--json")
        hours = {n: (r["ended_at"] - r["launched_at"]) / 3600 for n, r in rows.items()}
        assert json.loads(r.stdout)["clusters"][0]["cost"] == pytest.approx(
            0.03 * hours[clouds["aws"]] + 0.05 * hours[clouds["gcp"]], abs=1e-4)
        assert not booter.errors, booter.errors
    finally:
        booter.stopping.set()
        booter.join(10)
