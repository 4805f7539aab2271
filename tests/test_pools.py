"""Node pools (hypercli/offers/pools.py): the growth and shrink decisions, and end to end on
the AWS stand-in (moto_server on loopback, instances booted onto SSH test hosts by
tests/cloudhosts.py): a two-stage recipe whose stages need different machines gets one pool
per stage, each launched when its stage is ready and terminated when it ends; a spot
interruption in the second pool is replaced in that pool only."""

from __future__ import annotations

import threading

import pytest
import yaml

from hypercli.offers.pools import idle_nodes, wanted
from test_failover import moto_aws  # noqa: F401 (a fixture: moto's EC2 in process)


def test_a_pool_grows_for_the_tasks_waiting_within_its_cap():
    assert wanted(waiting=6, holds=1, size=0, launching=0, cap=3) == 3
    assert wanted(waiting=6, holds=4, size=0, launching=0, cap=3) == 2  # 4 tasks a node
    assert wanted(waiting=3, holds=1, size=1, launching=2, cap=3) == 0  # launches under way
    assert wanted(waiting=5, holds=1, size=1, launching=1, cap=8) == 4
    assert wanted(waiting=0, holds=1, size=0, launching=0, cap=3) == 0
    assert wanted(waiting=4, holds=1, size=3, launching=0, cap=3) == 0  # at its cap


def test_a_node_idle_for_the_limit_is_taken_down_and_no_sooner():
    since = {"a": 100.0, "b": 103.0, "c": 97.0}
    assert idle_nodes(since, now=104.0, limit=3.0) == ["a", "c"]
    assert idle_nodes(since, now=102.0, limit=3.0) == ["c"]
    assert idle_nodes(since, now=103.0, limit=0.0) == ["a", "b", "c"]  # its stage ended


def test_pools_per_shape_with_the_cap_of_workers(hyper_home, write_recipe):
    from hypercli.offers import pools
    from hypercli.workflows import load
    path = write_recipe("""
        name: stages
        cluster: {provider: aws, region: us-east-1, pool_idle_minutes: 0.5}
        experiments:
          prep: {parameters: {i: [1, 2, 3, 4, 5, 6]}, workers: 3, resources: {cpus: 2},
                 command: "true"}
          more: {parameters: {i: [1, 2]}, resources: {cpus: 2}, command: "true"}
          train: {after: [prep], resources: {cpus: 2, memory: "12+"}, command: "true"}
          gang: {nodes: 2, resources: {cpus: 2, memory: "12+"}, command: "true"}
    """)
    r, wf = load(str(path))
    assert "instance_type" not in r.cluster.options  # the pools choose, per shape
    assert pools.wants_pools(r)
    got = pools.plan(r, {e.name: e.tasks for e in wf.experiments})
    assert [(p.name, p.experiments, p.cap, p.idle_s) for p in got] == [
        ("p1", ("prep", "more"), 3, 30.0), ("p2", ("train",), 1, 30.0),
        ("p3", ("gang",), 2, 30.0)]
    assert all(o.vcpus >= 2 and o.memory_gib >= 11 for o in got[1].offers)
    assert len({o.region for o in got[2].offers}) == 1  # a gang's nodes in one region
    one = write_recipe("""
        name: one
        cluster: {provider: aws, region: us-east-1}
        experiments:
          a: {resources: {cpus: 2}, command: "true"}
    """)
    assert not pools.wants_pools(load(str(one))[0])  # one shape: one cluster, as before


def test_a_shape_no_offer_holds_is_exit_2_naming_the_pool(hyper_home, write_recipe, hyper):
    path = write_recipe("""
        name: big
        cluster: {provider: aws, region: us-east-1}
        experiments:
          a: {resources: {cpus: 2}, command: "true"}
          b: {resources: {accelerators: "V100:64"}, command: "true"}
    """)
    r = hyper("run", path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "pool p2 (b)" in r.stderr and "V100:64" in r.stderr


def test_plan_shows_the_pools_and_up_says_to_run_them(hyper_home, write_recipe, hyper):
    path = write_recipe("""
        name: stages
        cluster: {provider: aws, region: us-east-1, pool_idle_minutes: 0.5}
        experiments:
          prep: {parameters: {i: [1, 2, 3]}, workers: 3, resources: {cpus: 2}, command: "true"}
          train: {after: [prep], resources: {cpus: 2, memory: "12+"}, command: "true"}
    """)
    r = hyper("plan", path)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "p1 (prep) [2+ vCPUs, spot]: aws us-east-1" in r.stdout
    assert "at most 3 nodes, idle limit 0.5 min" in r.stdout
    assert "p2 (train) [2+ vCPUs, 11.2+ GiB, spot]: aws" in r.stdout
    r = hyper("up", path)
    assert r.returncode == 2 and "runs as node pools" in r.stderr, r.stdout + r.stderr
    from hypercli.state import State
    assert State().cluster("stages") is None  # nothing recorded, nothing launched


@pytest.mark.slow
def test_two_stages_two_pools_grow_shrink_and_a_spot_interruption_on_aws(
        aws, ssh_hosts, tmp_path, hyper_home, hyper):
    from cloudhosts import REGION, Booter, tagged_left
    from conftest import wait_for
    from hypercli.offers.ledger import costs
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    from test_ssh import assert_one_success_each
    hosts = ssh_hosts.start(6)  # 3 of pool 1, 2 of pool 2, 1 replacement
    booter = Booter(aws, hosts, tmp_path / "addresses.json")
    booter.start()
    image = aws.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
    recipe = {
        "name": "stages",
        "cluster": {"provider": "aws", "region": REGION, "zone": [f"{REGION}a"],
                    "image": image, "ssh_cidr": "10.213.0.0/24", "pool_idle_minutes": 0.05},
        "experiments": {
            "prep": {"parameters": {"i": [1, 2, 3, 4, 5, 6]}, "workers": 3,
                     "resources": {"cpus": 2}, "command": "sleep 1.5"},
            "train": {"after": ["prep"], "parameters": {"i": [1, 2]}, "workers": 2,
                      "retries": 2, "resources": {"cpus": 2, "memory": "12+"},
                      "command": "sleep 6"}}}
    path = tmp_path / "stages.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    injected: dict = {}

    def interrupt():
        def running_train():
            st = State()
            try:
                return [a for a in st.attempts(wid, status=["running"])
                        if a["task"].startswith("train")]
            finally:
                st.close()
        wait_for(running_train, timeout=240, what="a running task of stage 2")
        victim = running_train()[0]
        st = State()
        node = next(n for n in st.nodes("stages") if n["name"] == victim["node"])
        st.close()
        injected["node"] = node["name"]
        aws.terminate_instances(InstanceIds=[node["provider_id"]])  # the cloud takes it
        booter.booted[node["provider_id"]].kill()                    # and the VM dies
    try:
        state = State()
        wid, _, provider, nodes, lock = prepare_run(state, str(path))
        assert nodes == []  # nothing runs before there is work for it
        assert [p["name"] for p in state.pools("stages")] == ["p1", "p2"]
        t = threading.Thread(target=interrupt)
        t.start()
        try:
            summary = Scheduler(state, wid, provider, nodes).run()
        finally:
            lock.release()
            t.join(240)
        assert summary.exit_code == 0, state.attempts(wid)
        assert_one_success_each(state, wid)
        assert not booter.errors, booter.errors
        all_nodes = {n["name"]: n for n in state.nodes("stages")}
        p1 = sorted(n for n, r in all_nodes.items() if r["pool"] == "p1")
        p2 = sorted(n for n, r in all_nodes.items() if r["pool"] == "p2")
        assert len(p1) == 3 and set(p1) | set(p2) == set(all_nodes)  # workers: 3 caps it
        assert injected["node"] in p2 and len(p2) == 3  # 2, and the replacement in pool 2
        attempts = state.attempts(wid)
        assert {a["node"] for a in attempts if a["task"].startswith("prep")} <= set(p1)
        assert {a["node"] for a in attempts if a["task"].startswith("train")} <= set(p2)
        lost = [a for a in attempts if a["status"] == "lost"]
        assert lost and {a["node"] for a in lost} == {injected["node"]}
        replacement = next(n for n in p2 if all_nodes[n]["created_at"] >
                           all_nodes[injected["node"]]["created_at"] and
                           n != injected["node"] and
                           any(a["node"] == n and a["status"] == "succeeded" and
                               a["task"] in {x["task"] for x in lost} for a in attempts))
        assert replacement
        # pool 1 went up for stage 1 and was taken down when stage 1 ended, before stage 2
        # ended; pool 2 went up only for stage 2
        ledger = {r["node"]: r for r in state.ledger("stages")}
        assert set(ledger) == set(all_nodes)
        prep_end = max(a["ended_at"] for a in attempts if a["task"].startswith("prep"))
        prep_start = min(a["created_at"] for a in attempts if a["task"].startswith("prep"))
        train_end = max(a["ended_at"] for a in attempts if a["task"].startswith("train"))
        for n in p1:
            assert ledger[n]["pool"] == "p1" and ledger[n]["end_reason"] == "idle"
            assert prep_end <= ledger[n]["ended_at"] < train_end
            print(f"{n} ended {ledger[n]['ended_at'] - prep_end:.2f} s after stage 1's last "
                  "task")
        # ... launched once every task of stage 1 had started, to boot while the last ran
        last_prep = max(a["created_at"] for a in attempts if a["task"].startswith("prep"))
        assert all(ledger[n]["launched_at"] >= last_prep for n in p2)
        assert all(ledger[n]["launched_at"] <= prep_start for n in p1)
        assert ledger[injected["node"]]["end_reason"] == "preempted"
        p1_ids = [all_nodes[n]["provider_id"] for n in p1]
        states = {i["InstanceId"]: i["State"]["Name"] for r in aws.describe_instances(
            InstanceIds=p1_ids)["Reservations"] for i in r["Instances"]}
        assert set(states.values()) == {"terminated"}
        # without the driver, the node watcher takes an idle pool node down after the same
        # minutes: they are in its boot document
        import base64
        import json
        data = aws.describe_instance_attribute(InstanceId=p1_ids[0], Attribute="userData")
        doc = yaml.safe_load(base64.b64decode(data["UserData"]["Value"]).decode())
        node_json = next(f for f in doc["write_files"] if f["path"] == "/etc/hyper/node.json")
        assert json.loads(node_json["content"])["idle_minutes"] == 0.05
        # the run's end took pool 2 down too: its experiments have all ended
        assert all(ledger[n]["ended_at"] is not None for n in p2)
        assert {p["name"]: p["status"] for p in state.pools("stages")} == {
            "p1": "done", "p2": "done"}
        # the ledger per pool: pool 1's node-hours end where its nodes did
        out = costs(state, "stages")
        by_pool = {p["pool"]: p for p in out["pools"]}
        hours = sum(ledger[n]["ended_at"] - ledger[n]["launched_at"] for n in p1) / 3600
        assert by_pool["p1"]["node_hours"] == pytest.approx(hours, abs=1e-3)
        assert by_pool["p1"]["nodes"] == 3 and by_pool["p2"]["nodes"] == 3
        assert by_pool["p1"]["running"] == 0
        r = hyper("status", "stages")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "pool p1" in r.stdout and "pool p2" in r.stdout and "done" in r.stdout
        r = hyper("cost", "stages")
        assert r.returncode == 0 and "p1" in r.stdout, r.stdout + r.stderr
        r = hyper("down", "stages", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert tagged_left(aws, "stages") == []
    finally:
        booter.stopping.set()
        booter.join(10)


@pytest.mark.slow
def test_a_pool_that_cannot_grow_tries_again_then_the_run_names_it(
        hyper_home, tmp_path, monkeypatch, moto_aws):
    """Every offer of the pool out of capacity (EC2's own error, moto in process): the pool
    launches again after GROW_RETRY, GROW_TRIES times in all, then the run ends with an
    error naming the pool and the cloud's answer; no instance is left."""
    from test_failover import EAST, Refuse
    from hypercli.errors import InfraError
    from hypercli.offers import pools
    from hypercli.providers.aws import AWSAPI
    from hypercli.providers.cloud_provider import CloudProvider
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    monkeypatch.setattr(pools, "GROW_RETRY", 0.2)
    path = tmp_path / "full.yaml"
    path.write_text(yaml.safe_dump({
        "name": "full", "cluster": {"provider": "aws", "region": EAST, "zone": [f"{EAST}a"],
                                    "ssh_cidr": "10.213.0.0/24"},
        "experiments": {"a": {"resources": {"cpus": 2}, "command": "true"},
                        "b": {"after": ["a"], "resources": {"cpus": 2, "memory": "12+"},
                              "command": "true"}}}))
    state = State()
    wid, _, _, nodes, lock = prepare_run(state, str(path))
    api = AWSAPI(EAST)
    refused = Refuse(api, {"*"})
    provider = CloudProvider("aws", options=state.cluster("full")["spec"]["options"], api=api)
    try:
        with pytest.raises(InfraError) as e:
            Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert "pool p1 of cluster full (a) cannot grow" in e.value.message
    assert "InsufficientInstanceCapacity" in e.value.message or "capacity" in e.value.message
    offers = len(pools.offers_of(state.pools("full")[0]))
    assert len(refused.asked) == pools.GROW_TRIES * offers  # each try walks every offer
    p1, p2 = state.pools("full")
    assert (p1["status"], p2["status"], p2["target"]) == ("held", "steady", 0)
    assert "capacity" in p1["why"]
    running = [i for r in api.ec2.describe_instances()["Reservations"] for i in r["Instances"]
               if i["State"]["Name"] != "terminated"]
    assert running == [] and state.ledger("full") == []


@pytest.mark.slow
def test_two_stages_two_pools_on_gcp(ssh_hosts, tmp_path, hyper_home, monkeypatch, hyper):
    """The same on GCP (the Compute Engine stand-in tests/gcpfake.py through the real
    client; nodes make and publish their own host keys): each stage on its own pool, pool 1
    terminated when stage 1 ended, nothing left after `hyper down`."""
    pytest.importorskip("google.cloud.compute_v1")
    from cloudhosts import Booter, gcp_publisher, gcp_source
    from gcpfake import ComputeFake
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    from test_ssh import assert_one_success_each
    fake = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
    monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(tmp_path / "addresses.json"))
    hosts = ssh_hosts.start(3)
    booter = Booter(gcp_source(fake), hosts, tmp_path / "addresses.json",
                    publish=gcp_publisher(fake))
    booter.start()
    path = tmp_path / "gstages.yaml"
    path.write_text(yaml.safe_dump({
        "name": "gstages",
        "cluster": {"provider": "gcp", "project": "proj", "region": "us-central1",
                    "zone": ["us-central1-a"], "image": "projects/proj/global/images/x",
                    "ssh_cidr": "10.213.0.0/24", "pool_idle_minutes": 0.05},
        "experiments": {
            "prep": {"parameters": {"i": [1, 2]}, "workers": 2, "resources": {"cpus": 2},
                     "command": "sleep 1"},
            "train": {"after": ["prep"], "resources": {"cpus": 2, "memory": "12+"},
                      "command": "sleep 3"}}}, sort_keys=False))
    try:
        state = State()
        wid, _, provider, nodes, lock = prepare_run(state, str(path))
        try:
            summary = Scheduler(state, wid, provider, nodes).run()
        finally:
            lock.release()
        assert summary.exit_code == 0, state.attempts(wid)
        assert_one_success_each(state, wid)
        assert not booter.errors, booter.errors
        by_pool: dict = {}
        for n in state.nodes("gstages"):
            by_pool.setdefault(n["pool"], []).append(n["name"])
        assert sorted(by_pool) == ["p1", "p2"] and len(by_pool["p1"]) == 2
        attempts = state.attempts(wid)
        assert {a["node"] for a in attempts if a["task"].startswith("prep")} <= set(
            by_pool["p1"])
        assert {a["node"] for a in attempts if a["task"].startswith("train")} <= set(
            by_pool["p2"])
        ledger = {r["node"]: r for r in state.ledger("gstages")}
        train_end = max(a["ended_at"] for a in attempts if a["task"].startswith("train"))
        assert all(ledger[n]["cloud"] == "gcp" and ledger[n]["end_reason"] == "idle" and
                   ledger[n]["ended_at"] < train_end for n in by_pool["p1"])
        r = hyper("down", "gstages", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        assert fake.instances == {z: {} for z in fake.zones}
        assert not fake.firewalls and not fake.service_accounts
    finally:
        booter.stopping.set()
        booter.join(10)
        fake.close()


@pytest.mark.slow
def test_max_cost_stops_a_pool_growing_and_the_run_says_so(hyper_home, tmp_path, moto_aws):
    """``max_cost`` below the next hour of a pool's first node: nothing is launched and the
    run ends naming the pool and the budget."""
    from test_failover import EAST
    from hypercli.errors import InfraError
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    path = tmp_path / "cheap.yaml"
    path.write_text(yaml.safe_dump({
        "name": "cheap", "cluster": {"provider": "aws", "region": EAST, "zone": [f"{EAST}a"],
                                     "ssh_cidr": "10.213.0.0/24", "max_cost": 0.001},
        "experiments": {"a": {"resources": {"cpus": 2}, "command": "true"},
                        "b": {"after": ["a"], "resources": {"cpus": 2, "memory": "12+"},
                              "command": "true"}}}))
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path))
    try:
        with pytest.raises(InfraError) as e:
            Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert "pool p1 of cluster cheap (a) cannot grow: max_cost $0.00" in e.value.message
    assert state.ledger("cheap") == [] and state.nodes("cheap") == []
    assert state.pools("cheap")[0]["status"] == "held"
    assert any("max_cost" in ev["message"] for ev in state.cluster_events("cheap",
                                                                          ("cluster",)))
