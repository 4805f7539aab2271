"""The cost ledger (hypercli/offers/ledger.py) and the failover walk's order and words
(hypercli/offers/failover.py), on a real state file: node lifetimes recorded once, costs split
among workflows by their tasks' time, `max_cost`, `hyper cost`, and the order of offers."""

from __future__ import annotations

import json
import time

import pytest
import yaml

from hypercli.offers import ledger as L
from hypercli.offers.failover import (FailoverError, Step, offers_from_options, ordered,
                                      quota_hint, walk)
from hypercli.offers.offer import Offer
from hypercli.plan import build_plan
from hypercli.providers.cloud import CapacityError, CloudError, QuotaError
from hypercli.recipe import parse_recipe
from hypercli.state import State

HOUR = 3600.0


def offer(cloud="aws", region="us-east-1", zone="us-east-1a", spot=True, price=1.0,
          itype="p3.8xlarge") -> Offer:
    return Offer(cloud, itype, region, zone, spot, price, 32, 244, "V100", 4)


# -- failover: order, steps, errors --------------------------------------------------------------
def test_recipe_offers_spot_auto_puts_on_demand_after_spot_and_preempted_regions_last():
    got = offers_from_options("aws", {"instance_type": "m5.large", "region": "us-east-1",
                                      "zone": ["us-east-1a", "us-east-1b"], "spot": "auto"})
    assert [(o.zone, o.spot) for o in got] == [("us-east-1a", True), ("us-east-1b", True),
                                               ("us-east-1a", False), ("us-east-1b", False)]
    assert [o.zone for o in offers_from_options("gcp", {"instance_type": "e2-standard-4",
                                                        "region": "us-central1"})] == [None]
    a, b = offer(region="us-east-1"), offer(region="us-west-2", zone="us-west-2b")
    od = offer(spot=False, price=3.0)
    assert ordered([od, a, b]) == [a, b, od]
    assert ordered([od, a, b], {("aws", "us-east-1")}) == [b, a, od]


def test_each_capacity_error_moves_to_the_next_offer_and_every_step_is_named():
    offers = [offer(zone="us-east-1a"), offer(zone="us-east-1b"),
              offer(region="us-west-2", zone="us-west-2b"),
              offer(cloud="gcp", region="us-central1", zone="us-central1-a", itype="n1-x"),
              offer(cloud="gcp", region="us-central1", zone="us-central1-a", itype="n1-x",
                    spot=False, price=9.5)]
    full = {"us-east-1a", "us-east-1b", "us-west-2b"}
    quota = {("gcp", True)}
    asked = []

    def launch_on(o, nodes):
        asked.append((o.where(), o.spot, tuple(nodes)))
        if o.where() in full:
            return [], {n: CapacityError(f"no room in {o.where()}") for n in nodes}
        if (o.cloud, o.spot) in quota:
            return [], {n: QuotaError("Quota 'PREEMPTIBLE_NVIDIA_V100_GPUS' exceeded. "
                                      "Limit: 0.0 in region us-central1.") for n in nodes}
        return [f"vm-{n}" for n in nodes], {}
    logged = []
    got, errors, steps = walk(offers, ["c-0", "c-1"], launch_on, logged.append)
    assert got == ["vm-c-0", "vm-c-1"] and errors == {}
    assert [a[0] for a in asked] == ["us-east-1a", "us-east-1b", "us-west-2b",
                                     "us-central1-a", "us-central1-a"]
    assert logged == steps and [s.line() for s in steps] == [
        "us-east-1a: no spot capacity for p3.8xlarge → us-east-1b",
        "us-east-1b: no spot capacity for p3.8xlarge → us-west-2b",
        "us-west-2b: no spot capacity for p3.8xlarge → gcp us-central1-a n1-x",
        "us-central1-a: quota 'PREEMPTIBLE_NVIDIA_V100_GPUS' of gcp us-central1 → "
        "us-central1-a on-demand (costs more: $9.5000/h)"]


def test_every_offer_failing_is_one_error_listing_each_step_and_the_quota_page():
    offers = [offer(zone="us-east-1a"), offer(zone="us-east-1b"), offer(zone="us-east-1c")]

    def launch_on(o, nodes):
        if o.zone == "us-east-1a":
            return [], {n: CapacityError("InsufficientInstanceCapacity") for n in nodes}
        return [], {n: QuotaError("VcpuLimitExceeded", code="VcpuLimitExceeded")
                    for n in nodes}
    got, errors, steps = walk(offers, ["c-0"], launch_on)
    assert got == [] and len(steps) == 2  # the region's quota is not asked again in 1c
    err = errors["c-0"]
    assert isinstance(err, FailoverError) and err.exit_code == 3
    assert "us-east-1a: no spot capacity for p3.8xlarge → us-east-1b" in err.message
    assert ("us-east-1b: quota 'All P Spot Instance Requests (vCPUs)' of aws us-east-1 → "
            "no offer left") in err.message
    assert "https://us-east-1.console.aws.amazon.com/servicequotas/home/services/ec2/quotas" \
        in err.hint


def test_other_errors_end_a_node_s_walk_and_quota_names_per_cloud():
    def launch_on(o, nodes):
        return [], {n: CloudError("InvalidParameterValue") for n in nodes}
    got, errors, steps = walk([offer(), offer(zone="us-east-1b")], ["c-0"], launch_on)
    assert steps == [] and str(errors["c-0"]) == "InvalidParameterValue"
    az = offer(cloud="azure", region="eastus", zone="1", itype="Standard_NC24s_v3",
               spot=False)
    text = quota_hint(az, QuotaError("Operation could not be completed as it results in "
                                     "exceeding approved standardNCSv3Family Cores quota."))
    assert "'standardNCSv3Family vCPUs' of azure eastus" in text and "portal.azure.com" in text
    assert "'Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances (vCPUs)'" in \
        quota_hint(offer(spot=False, itype="m5.large"), QuotaError("x"))
    assert Step(offer(), CapacityError("x", code="SpotNotFulfilled"), 1, None).line() == \
        "us-east-1a: spot request for p3.8xlarge not fulfilled in time → no offer left"


# -- the ledger ----------------------------------------------------------------------------------
def workflow(state: State, name: str, cluster: str, experiments=("a", "b")) -> tuple[str, list]:
    recipe = parse_recipe(yaml.safe_dump({
        "name": name, "experiments": {e: {"command": "true"} for e in experiments}}))
    wf = build_plan(recipe)
    wid = state.create_workflow(wf, cluster=cluster, recipe_path=None, storage="file:///s",
                                workdir="/")
    return wid, [t.id for t in wf.tasks]


def attempt(state, wid, task, node, start, end, n=1):
    aid = f"{wid}.{task}.{n}"
    state.start_attempts([(aid, wid, task, n, node)])
    state.update_attempts([{"id": aid, "status": "succeeded" if end else "running",
                            "started_at": start, "ended_at": end}])


def launched(state, cluster, node, at, price, cloud="aws", spot=True, region="us-east-1"):
    state.ledger_launch(cluster, node, f"i-{node}", {
        "cloud": cloud, "region": region, "zone": region + "a", "instance_type": "m5.large",
        "spot": spot, "price": price, "launched_at": at})


def test_costs_split_a_shared_node_by_task_time_and_a_running_node_counts_to_now(hyper_home):
    state = State()
    t0 = 1_000_000.0
    launched(state, "c", "c-0", t0, 2.0)                   # 2 h, $4, shared
    launched(state, "c", "c-1", t0, 1.0, cloud="gcp")      # running: 3 h at `now`
    launched(state, "c", "c-2", t0, 0.5, cloud="azure")    # never used: idle
    state.ledger_end("c", ["c-0"], at=t0 + 2 * HOUR)
    state.ledger_end("c", ["c-2"], at=t0 + HOUR)
    w1, (a1, b1) = workflow(state, "one", "c")
    w2, (a2, _) = workflow(state, "two", "c")
    attempt(state, w1, a1, "c-0", t0, t0 + 1800)            # w1: 0.5 h on c-0 (a)
    attempt(state, w1, b1, "c-0", t0 + 1800, t0 + 3600)     # w1: 0.5 h on c-0 (b)
    attempt(state, w2, a2, "c-0", t0, t0 + 2 * HOUR)        # w2: 2 h on c-0, more than its
    attempt(state, w2, a2, "c-1", t0 + HOUR, None, n=2)     # life; running on c-1
    out = L.costs(state, now=t0 + 3 * HOUR)
    [c] = out["clusters"]
    assert c["cost"] == pytest.approx(4.0 + 3.0 + 0.5) and c["nodes"] == 3
    assert c["running"] == 1 and c["idle"] == pytest.approx(0.5)
    w = {x["workflow"]: x for x in out["workflows"]}
    # c-0 ($4): w1 1 h of tasks, w2 2 h → 1/3 and 2/3; c-1 ($3) all w2's
    assert w[w1]["cost"] == pytest.approx(4 / 3, abs=1e-3)
    assert w[w1]["experiments"] == {"a": pytest.approx(2 / 3, abs=1e-3),
                                    "b": pytest.approx(2 / 3, abs=1e-3)}
    assert w[w2]["cost"] == pytest.approx(8 / 3 + 3.0, abs=1e-3)
    assert out["total"] == pytest.approx(7.5)
    assert {n["cloud"] for n in out["nodes"]} == {"aws", "gcp", "azure"}
    one = L.costs(state, "one", now=t0 + 3 * HOUR)
    assert [x["workflow"] for x in one["workflows"]] == [w1]
    assert one["total"] == pytest.approx(4 / 3, abs=1e-3)
    with pytest.raises(Exception, match="no cluster or workflow named 'nope'"):
        L.costs(state, "nope")


def test_a_recorded_end_is_never_overwritten_by_a_later_down_or_gc(hyper_home):
    state = State()
    launched(state, "c", "c-0", 100.0, 1.0)
    launched(state, "c", "c-0", 50.0, 9.0)  # the same instance again: recorded once
    assert state.ledger_end("c", ["c-0"], at=200.0, reason="preempted") == 1
    assert state.ledger_end("c", ["c-0"], at=900.0, reason="down") == 0        # a down
    assert state.ledger_end_instances("aws", ["i-c-0"], at=990.0) == 0         # a gc
    assert state.ledger_end("c", ["c-0"], at=999.0, reason="down") == 0        # a 2nd down
    [row] = state.ledger("c")
    assert (row["launched_at"], row["ended_at"], row["end_reason"], row["price"]) == \
        (100.0, 200.0, "preempted", 1.0)
    assert L.preempted_regions(state, now=250.0) == {("aws", "us-east-1")}
    assert L.preempted_regions(state, now=200.0 + L.PREEMPTED_LAST + 1) == set()


def test_max_cost_stops_new_nodes_and_says_so(hyper_home):
    state = State()
    state.cluster_uid("c")
    now = time.time()
    launched(state, "c", "c-0", now - 2 * HOUR, 1.0)   # $2 so far, running: $1 next hour
    ok, over = L.within_budget(state, "c", 4.5, ["c-1", "c-2"], 1.0)
    assert ok == ["c-1"] and list(over) == ["c-2"]
    msg = str(over["c-2"])
    assert "max_cost $4.50 of cluster c" in msg and "c-2 is not launched" in msg
    assert "nothing running is stopped" in msg and over["c-2"].exit_code == 2
    assert L.within_budget(state, "c", None, ["c-1"], 1.0) == (["c-1"], {})
    assert [r["ended_at"] for r in state.ledger("c")] == [None]  # nothing killed


def test_hyper_cost_prints_clusters_workflows_and_json(hyper_home, hyper):
    state = State()
    now = time.time()
    launched(state, "c", "c-0", now - HOUR, 2.0)
    state.ledger_end("c", ["c-0"], at=now)
    wid, (a, _) = workflow(state, "one", "c")
    attempt(state, wid, a, "c-0", now - HOUR, now)
    state.close()
    r = hyper("cost", "--nodes")
    assert r.returncode == 0, r.stderr
    assert "cluster c" in r.stdout and "$2.00" in r.stdout and "workflow one-1" in r.stdout
    assert "c-0" in r.stdout and "aws us-east-1a m5.large spot $2.0000/h" in r.stdout
    r = hyper("cost", "c", "--json")
    out = json.loads(r.stdout)
    assert out["clusters"][0]["cost"] == pytest.approx(2.0, abs=0.01)
    r = hyper("cost", "nope")
    assert r.returncode == 2 and "no cluster or workflow named 'nope'" in r.stderr


def test_recipe_takes_spot_auto_and_max_cost_and_refuses_bad_ones():
    from hypercli.errors import RecipeError
    spec = parse_recipe("name: n\ncluster: {provider: gcp, spot: auto, max_cost: 12.5}\n"
                        "experiments: {a: {command: x}}\n").cluster
    assert spec.options["spot"] == "auto" and spec.options["max_cost"] == 12.5
    with pytest.raises(RecipeError) as e:
        parse_recipe("name: n\ncluster: {provider: aws, max_cost: -3}\n"
                     "experiments: {a: {command: x}}\n")
    assert e.value.field == "cluster.max_cost" and "US dollars above 0" in str(e.value)
    with pytest.raises(RecipeError, match="applies to providers aws, gcp, azure"):
        parse_recipe("name: n\ncluster: {provider: ssh, hosts: [h], max_cost: 3}\n"
                     "experiments: {a: {command: x}}\n")


@pytest.mark.parametrize("code", ["capacity-not-available", "capacity-oversubscribed",
                                  "price-too-low", "InsufficientInstanceCapacity"])
def test_ec2_spot_request_status_codes_are_capacity_errors(code):
    """EC2's spot request status codes for a request it cannot fulfil move a launch on."""
    from botocore.exceptions import ClientError

    from hypercli.providers.aws import aws_errors
    with pytest.raises(CapacityError) as e:
        with aws_errors("launching c-0 in us-east-1a"):
            raise ClientError({"Error": {"Code": code, "Message": "m"}}, "RunInstances")
    assert e.value.code == code and e.value.failover == "capacity"
