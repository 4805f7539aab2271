"""The optimizer (hypercli/offers/optimizer.py) over small catalogs made here: what satisfies a
shape, the order, the cluster's limits, the nearest offers when nothing does (exit 2), the
estimate of `hyper plan`, the offer a cloud cluster with no instance_type is launched on, and
the user's custom rows."""

from __future__ import annotations

import textwrap

import pytest

from hypercli.offers import catalog as C
from hypercli.offers.estimate import per_node, plan
from hypercli.offers.optimizer import (NoOffer, Shape, choose, parse_shape, ranked_offers,
                                       with_first_offer)
from hypercli.plan import build_plan
from hypercli.recipe import parse_recipe

ROWS = {
    "aws": [  # type, vcpus, GiB, gpu, count, region, zone, price, spot
        ("p3.8xlarge", 32, 244, "V100", 4, "us-east-1", "us-east-1a", 12.24, 3.9),
        ("p3.8xlarge", 32, 244, "V100", 4, "us-east-1", "us-east-1b", 12.24, 4.4),
        ("p3.8xlarge", 32, 244, "V100", 4, "us-west-2", "us-west-2a", 12.24, 3.7),
        ("p3.16xlarge", 64, 488, "V100", 8, "us-east-1", "us-east-1a", 24.48, 7.5),
        ("g4dn.xlarge", 4, 16, "T4", 1, "us-east-1", "us-east-1a", 0.526, 0.16),
        ("m5.large", 2, 8, "", 0, "us-east-1", "us-east-1a", 0.096, 0.035),
        ("m5.2xlarge", 8, 32, "", 0, "us-east-1", "us-east-1a", 0.384, 0.14),
        ("m5.2xlarge", 8, 32, "", 0, "eu-west-1", "eu-west-1a", 0.428, ""),
    ],
    "gcp": [
        ("n1-standard-32/nvidia-tesla-v100:4", 32, 120, "nvidia-tesla-v100", 4,
         "us-central1", "us-central1-a", 11.44, 3.6),
        ("n2-standard-8", 8, 32, "", 0, "us-central1", "us-central1-a", 0.388, 0.09),
    ],
    "azure": [
        ("Standard_NC24s_v3", 24, 448, "V100", 4, "eastus", "", 12.24, 4.1),
        ("Standard_D8s_v5", 8, 32, "", 0, "eastus", "", 0.384, 0.077),
    ],
}


def table(cloud: str, rows=None) -> C.Table:
    t = C.Table(cloud, read_at=1.0, source="test")
    for name, cpus, mem, gpu, n, region, zone, price, spot in rows or ROWS[cloud]:
        t.add({"instance_type": name, "vcpus": str(cpus), "memory_gib": str(mem),
               "accelerator": gpu, "accelerator_count": str(n), "region": region,
               "zone": zone, "price": str(price), "spot_price": str(spot)})
    return t


@pytest.fixture
def cat() -> C.Catalog:
    return C.Catalog(tables={c: table(c) for c in ROWS})


def names(offers):
    return [(o.cloud, o.instance_type, o.where(), o.spot, o.price) for o in offers]


def test_v100x4_spot_cheapest_first_across_clouds(cat):
    got = ranked_offers(Shape(accelerator="V100", accelerator_count=4), cat)
    assert names(got)[:4] == [
        ("gcp", "n1-standard-32/nvidia-tesla-v100:4", "us-central1-a", True, 3.6),
        ("aws", "p3.8xlarge", "us-west-2a", True, 3.7),
        ("aws", "p3.8xlarge", "us-east-1a", True, 3.9),
        ("azure", "Standard_NC24s_v3", "eastus", True, 4.1)]
    assert all(o.spot for o in got)
    assert [o.price for o in got] == sorted(o.price for o in got)
    assert "p3.16xlarge" in {o.instance_type for o in got}  # 8 V100s hold 4


def test_spot_auto_puts_every_on_demand_offer_after_the_spot_ones(cat):
    got = ranked_offers(Shape(accelerator="V100", accelerator_count=4, spot="auto"), cat)
    kinds = [o.spot for o in got]
    assert kinds == sorted(kinds, reverse=True) and False in kinds
    on_demand = [o for o in got if not o.spot]
    assert on_demand[0].price == 11.44 and on_demand == sorted(on_demand, key=lambda o: o.price)
    assert not any(o.spot for o in ranked_offers(Shape(accelerator="T4", accelerator_count=1,
                                                       spot=False), cat))


def test_cpu_shapes_leave_gpu_instances_out_and_respect_minimums(cat):
    got = ranked_offers(Shape(cpus=8, memory_gib=30), cat)
    assert {o.instance_type for o in got} == {"m5.2xlarge", "n2-standard-8", "Standard_D8s_v5"}
    assert got[0].instance_type == "m5.2xlarge" and got[0].price == 0.14 or \
        got[0].instance_type == "Standard_D8s_v5"
    assert names(got)[0] == ("azure", "Standard_D8s_v5", "eastus", True, 0.077)
    # a region without spot (the eu-west-1 row) gives an on-demand offer only
    assert [o.spot for o in got if o.region == "eu-west-1"] == []
    assert [o.spot for o in ranked_offers(Shape(cpus=8, spot=False), cat)
            if o.region == "eu-west-1"] == [False]


def test_cluster_limits_clouds_regions_zones_and_max_price(cat):
    shape = Shape(accelerator="V100", accelerator_count=4)
    assert {o.cloud for o in ranked_offers(shape, cat, clouds=["aws"])} == {"aws"}
    assert {o.region for o in ranked_offers(shape, cat, regions=["us-east-1"])} == {"us-east-1"}
    assert {o.zone for o in ranked_offers(shape, cat, zones=["us-east-1b"])} == {"us-east-1b"}
    assert [o.price for o in ranked_offers(shape, cat, max_price=3.8)] == [3.6, 3.7]


def test_nothing_satisfies_names_the_nearest_offers_exit_2(cat):
    with pytest.raises(NoOffer) as e:
        choose(Shape(accelerator="V100", accelerator_count=16), cat)
    assert e.value.exit_code == 2
    assert "no instance in aws, gcp, azure has V100:16" in str(e.value)
    assert e.value.nearest[0].instance_type == "p3.16xlarge"  # the most V100s there are
    assert "p3.16xlarge" in str(e.value)
    with pytest.raises(NoOffer, match="did you mean V100"):
        choose(Shape(accelerator="V1000", accelerator_count=1), cat)


def test_offers_outside_the_limits_are_named(cat):
    with pytest.raises(NoOffer) as e:
        choose(Shape(accelerator="T4", accelerator_count=1), cat, regions=["eu-west-1"],
               max_price=0.1)
    assert "within cluster regions, max_price" in str(e.value)
    assert "g4dn.xlarge" in str(e.value) and e.value.hint == "widen cluster regions, max_price"


def test_parse_shape_for_hyper_offers():
    assert parse_shape("v100:4") == Shape(accelerator="V100", accelerator_count=4, spot="auto")
    assert parse_shape("A100-80GB").accelerator_count == 1
    assert parse_shape("p3.8xlarge").instance_type == "p3.8xlarge"
    with pytest.raises(C.UsageError, match="whole number"):
        parse_shape("V100:four")


def recipe(text: str):
    r = parse_recipe(textwrap.dedent(text))
    return r, build_plan(r)


def test_plan_estimate_tasks_per_node_and_gangs(cat):
    r, wf = recipe("""
        name: est
        cluster: {provider: aws, clouds: [aws, gcp, azure]}
        experiments:
          prep:
            parameters: {i: [1, 2, 3, 4, 5, 6, 7, 8]}
            resources: {cpus: 2, memory: 8GiB, spot: false}
            command: echo {{i}}
          train:
            nodes: 2
            resources: {accelerators: "V100:4"}
            command: train
    """)
    choices = plan(wf.experiments, r.cluster.options, "aws", cat, {"prep": 30, "train": 60})
    prep, train = choices
    assert prep.offers[0].instance_type == "m5.large" and not prep.offers[0].spot
    assert per_node(prep.offers[0], prep.shape) == 1  # 2 vCPUs: one task of 2 at a time
    assert prep.node_hours == pytest.approx(8 * 30 / 60)
    assert prep.cost == pytest.approx(4 * 0.096)
    assert train.shape.nodes == 2 and train.offers[0].price == 3.6
    assert train.node_hours == pytest.approx(2.0) and train.cost == pytest.approx(7.2)
    assert len(train.offers) == 4  # the choice and 3 alternatives


def write_tables(tables):
    for t in tables:
        C.write(t)


def test_a_cloud_cluster_without_instance_type_gets_the_first_offer(hyper_home):
    from hypercli.providers.cloud_provider import cloud_spec
    write_tables([table("aws")])
    r, _ = recipe("""
        name: gpu
        cluster: {provider: aws, regions: [us-east-1], max_price: 5}
        experiments:
          train: {resources: {accelerators: "V100:4", disk_gb: 200}, command: train}
          eval: {resources: {cpus: 16, disk_gb: 80}, command: eval}
    """)
    got = with_first_offer(r)
    o = got.cluster.options
    assert (o["instance_type"], o["region"], o["zone"], o["spot"], o["disk_gb"]) == (
        "p3.8xlarge", "us-east-1", "us-east-1a", True, 200)
    cs = cloud_spec(got.cluster)
    assert (cs.instance_type, cs.region, cs.zones, cs.spot) == (
        "p3.8xlarge", "us-east-1", ("us-east-1a",), True)
    # an instance type in the recipe is kept as it is
    r2, _ = recipe("name: x\ncluster: {provider: aws, instance_type: m5.large}\n"
                   "experiments: {a: {command: x, resources: {cpus: 64}}}\n")
    assert with_first_offer(r2) is r2


def test_first_offer_refuses_two_gpu_models_and_no_offer(hyper_home):
    write_tables([table("aws")])
    r, _ = recipe("""
        name: two
        cluster: {provider: aws}
        experiments:
          a: {resources: {accelerators: "V100:1"}, command: a}
          b: {resources: {accelerators: "T4:1"}, command: b}
    """)
    with pytest.raises(C.UsageError, match=r"different machines \(T4, V100\)"):
        with_first_offer(r)
    r, _ = recipe("name: big\ncluster: {provider: aws}\n"
                  "experiments: {a: {resources: {cpus: 512}, command: a}}\n")
    with pytest.raises(NoOffer, match=r"no instance in aws has 512\+ vCPUs, spot; nearest: "
                       "aws us-east-1a m5.2xlarge"):
        with_first_offer(r)


def test_custom_rows_add_and_replace(hyper_home):
    write_tables([table("aws")])
    (hyper_home / "catalog" / "custom.csv").write_text(
        "cloud,instance_type,vcpus,memory_gib,accelerator,accelerator_count,region,zone,"
        "price,spot_price\n"
        "aws,p3.8xlarge,32,244,V100,4,us-east-1,us-east-1a,10.0,2.0\n"   # a negotiated price
        "aws,x9.gpu,8,64,nvidia-tesla-v100,4,us-east-1,us-east-1c,9.0,\n")  # a new type
    cat = C.Catalog(["aws"])
    got = ranked_offers(Shape(accelerator="V100", accelerator_count=4, spot="auto"), cat)
    assert names(got)[0] == ("aws", "p3.8xlarge", "us-east-1a", True, 2.0)
    assert ("aws", "x9.gpu", "us-east-1c", False, 9.0) in names(got)
    assert cat.tables["aws"].source == "cache+custom"


def test_bad_custom_row_names_the_line(hyper_home):
    write_tables([table("aws")])
    (hyper_home / "catalog" / "custom.csv").write_text(
        "cloud,instance_type,vcpus,memory_gib,region,price\n"
        "aws,ok.type,2,4,us-east-1,0.1\n"
        "aws,bad.type,two,4,us-east-1,0.1\n")
    with pytest.raises(C.UsageError, match=r"custom.csv:3: could not convert"):
        C.Catalog(["aws"])
    (hyper_home / "catalog" / "custom.csv").write_text("cloud,instance_type\naws,x\n")
    with pytest.raises(C.UsageError, match="no column vcpus, memory_gib, region"):
        C.Catalog(["aws"])


def test_plan_takes_minutes_from_an_earlier_run_of_the_recipe(hyper_home, write_recipe, cat):
    from hypercli.offers.estimate import plan_recipe
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    path = write_recipe("""
        name: again
        experiments:
          step: {parameters: {i: [1, 2]}, command: "sleep 0.3; echo {{i}}"}
    """)
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path))
    try:
        assert Scheduler(state, wid, provider, nodes).run().exit_code == 0
    finally:
        lock.release()
    spans = [a["ended_at"] - a["started_at"] for a in state.attempts(wid)]
    r, wf = recipe("""
        name: again
        cluster: {provider: aws}
        experiments:
          step: {parameters: {i: [1, 2]}, command: "sleep 0.3; echo {{i}}"}
    """)
    got = plan_recipe(r, wf, state, cat)
    [c] = got["choices"]
    assert got["minutes_from"] == {"step": "earlier run"}
    assert c.minutes == pytest.approx(sum(spans) / len(spans) / 60)
    assert c.cost == pytest.approx(c.node_hours * c.offers[0].price) and c.cost > 0


def test_plan_of_an_instance_type_the_catalog_lacks_is_a_note_not_an_error(cat):
    r, wf = recipe("""
        name: named
        cluster: {provider: aws, instance_type: x1.custom, region: us-east-1}
        experiments:
          a: {command: a}
          b: {resources: {accelerators: "T4:1", instance_type: g4dn.xlarge}, command: b}
    """)
    a, b = plan(wf.experiments, r.cluster.options, "aws", cat)
    assert a.offers == () and "x1.custom is not in the catalog there" in a.note
    assert b.offers[0].instance_type == "g4dn.xlarge" and b.note is None


def test_hardware_chooses_machines_as_accelerators_do(cat):
    r, wf = recipe("""
        name: hw
        cluster: {provider: azure}
        experiments:
          a: {hardware: {gpu: V100, gpu_count: 4}, command: a}
    """)
    [c] = plan(wf.experiments, r.cluster.options, "azure", cat)
    assert c.shape.accelerator == "V100" and c.offers[0].instance_type == "Standard_NC24s_v3"


def test_clouds_without_the_provider_is_refused_at_launch(hyper_home):
    write_tables([table("aws")])
    r, _ = recipe("name: c\ncluster: {provider: aws, clouds: [gcp]}\n"
                  "experiments: {a: {resources: {cpus: 4}, command: a}}\n")
    with pytest.raises(C.UsageError, match=r"cluster.clouds \(gcp\) does not include the "
                                           r"provider aws"):
        with_first_offer(r)


def test_loading_a_cloud_recipe_for_up_or_run_fills_in_the_first_offer(hyper_home,
                                                                       write_recipe):
    from hypercli.workflows import load, load_with_defaults
    write_tables([table("azure")])
    path = write_recipe("""
        name: az
        cluster: {provider: azure, spot: false}
        experiments:
          a: {resources: {cpus: "8+", memory: "30+"}, command: a}
    """)
    o = load_with_defaults(str(path)).cluster.options
    assert (o["instance_type"], o["region"], o["spot"]) == ("Standard_D8s_v5", "eastus", False)
    assert "zone" not in o  # Azure prices per region
    r, _ = load(str(path), offer=False)  # hyper plan: the recipe as written
    assert "instance_type" not in r.cluster.options


def test_a_cluster_that_is_up_keeps_the_instance_type_it_was_launched_with(hyper_home):
    from hypercli.state import State
    write_tables([table("aws")])
    state = State()
    state.put_cluster("keep", "aws", {"workers": 1, "options": {
        "instance_type": "p3.16xlarge", "region": "us-east-1", "zone": "us-east-1a",
        "spot": True}}, "up")
    r, _ = recipe("""
        name: keep
        cluster: {provider: aws}
        experiments:
          train: {resources: {accelerators: "V100:4"}, command: train}
    """)
    assert with_first_offer(r, state).cluster.options["instance_type"] == "p3.16xlarge"
    state.put_cluster("keep", "aws", {"workers": 1, "options": {}}, "down")
    assert with_first_offer(r, state).cluster.options["instance_type"] == "p3.8xlarge"


def test_arm64_instances_are_left_out_unless_asked():
    rows = [("m7g.large", 2, 8, "", 0, "us-east-1", "us-east-1a", 0.08, 0.03),
            ("m5.large", 2, 8, "", 0, "us-east-1", "us-east-1a", 0.096, 0.035)]
    t = table("aws", rows)
    t.add({"instance_type": "m7g.large", "vcpus": "2", "memory_gib": "8", "arch": "arm64",
           "region": "us-east-1", "zone": "us-east-1a", "price": "0.08", "spot_price": "0.03"})
    cat = C.Catalog(tables={"aws": t})
    assert [o.instance_type for o in ranked_offers(Shape(cpus=2), cat)] == ["m5.large"]
    assert [o.instance_type for o in ranked_offers(Shape(cpus=2, arch="arm64"), cat)] == [
        "m7g.large"]
    from hypercli.offers.optimizer import shape_of
    r, wf = recipe("name: a\ncluster: {provider: aws}\n"
                   "experiments: {a: {command: a, resources: {cpus: 2, arch: arm64}}}\n")
    shape = shape_of(wf.experiments[0].resources, r.cluster.options)
    assert [o.instance_type for o in ranked_offers(shape, cat)] == ["m7g.large"]


def test_a_cluster_without_instance_type_fails_over_along_the_ranked_offers(hyper_home):
    """The launch of a cluster the optimizer chose walks the optimizer's whole list in its
    order (cheapest first, spot before on-demand with spot: auto), not only the first."""
    from hypercli.offers import failover
    from hypercli.offers.optimizer import cluster_offers
    write_tables([table("aws")])
    r, _ = recipe("""
        name: gpu
        cluster: {provider: aws}
        experiments:
          train: {resources: {accelerators: "V100:4", spot: auto}, command: train}
    """)
    o = with_first_offer(r).cluster.options
    ranked = cluster_offers([e.resources.as_dict() for e in r.experiments.values()],
                            r.cluster.options, "aws")
    walk = failover.offers_from_options("aws", o)
    assert len(walk) > 1 and walk == ranked
    assert (walk[0].instance_type, walk[0].region, walk[0].zone) == (
        o["instance_type"], o["region"], o.get("zone"))
    assert failover.ordered(walk) == walk  # spot first, then cheapest: the list's own order
    assert any(not x.spot for x in walk) and walk[-1].spot is False
    # the list survives the state file (JSON) as the launch reads it back
    import json
    assert failover.offers_from_options("aws", json.loads(json.dumps(o))) == ranked


def test_cluster_clouds_rank_every_allowed_cloud_so_failover_reaches_the_next_one(hyper_home):
    """With ``clouds: [aws, gcp]`` the failover list spans both clouds in price order, and a
    cloud with more cheap offers than the list holds does not push the other one out."""
    from hypercli.offers import failover
    from hypercli.offers.optimizer import FAILOVER_OFFERS, cluster_offers
    many = [("m5.large", 2, 8, "", 0, f"r{i}", f"r{i}a", 0.096, 0.01 + i / 1000)
            for i in range(FAILOVER_OFFERS + 4)]
    write_tables([table("aws", many), table("gcp")])
    r, _ = recipe("""
        name: two
        cluster: {provider: aws, clouds: [aws, gcp]}
        experiments:
          a: {resources: {cpus: 2}, command: a}
    """)
    needs = [e.resources.as_dict() for e in r.experiments.values()]
    ranked = cluster_offers(needs, r.cluster.options, "aws")
    assert [o.cloud for o in ranked] == ["aws"] * FAILOVER_OFFERS + ["gcp"]
    assert ranked[-1].instance_type == "n2-standard-8" and ranked[-1].price == 0.09
    o = with_first_offer(r).cluster.options
    walk = failover.offers_from_options("aws", o)
    assert walk == ranked and walk[-1].cloud == "gcp"
    assert (o["instance_type"], o["region"], o["zone"]) == ("m5.large", "r0", "r0a")
    # without clouds: the provider's own cloud only, as before
    r1, _ = recipe("name: one\ncluster: {provider: aws}\n"
                   "experiments: {a: {resources: {cpus: 2}, command: a}}\n")
    assert {x["cloud"] for x in with_first_offer(r1).cluster.options["offers"]} == {"aws"}


def test_when_the_providers_cloud_has_nothing_that_fits_the_cluster_goes_to_the_next(
        hyper_home):
    from hypercli.state import State
    write_tables([table("gcp")])
    r, _ = recipe("""
        name: big
        cluster: {provider: aws, clouds: [aws, gcp], region: us-east-1, image: ami-1}
        experiments:
          a: {resources: {cpus: 8, memory: 32, spot: false}, command: a}
    """)
    table_aws = [("m5.large", 2, 8, "", 0, "us-east-1", "us-east-1a", 0.096, 0.035)]
    write_tables([table("aws", table_aws)])
    got = with_first_offer(r)
    o = got.cluster.options
    assert got.cluster.provider == "gcp"
    assert (o["instance_type"], o["region"], o["zone"], o["spot"]) == (
        "n2-standard-8", "us-central1", "us-central1-a", False)
    assert "image" not in o  # an AMI is of AWS
    # a cluster up on GCP keeps its provider and instance type on the next run
    state = State()
    state.put_cluster("big", "gcp", {"workers": 1, "options": o}, "up")
    again = with_first_offer(r, state)
    assert again.cluster.provider == "gcp" and again.cluster.options["instance_type"] == \
        "n2-standard-8"


def _reference(shape, cat, regions=(), zones=(), max_price=None, limit=None):
    """Every offer of every type, filtered and sorted one by one (the optimizer's
    definition, module docstring), to check the indexed ranking against."""
    from hypercli.offers.optimizer import _fits
    out = []
    for t in cat.types():
        if not _fits(t, shape):
            continue
        for o in cat.offers_of(t):
            if shape.spot != "auto" and o.spot != shape.spot:
                continue
            if (max_price is not None and o.price > max_price) or \
                    (regions and o.region not in regions):
                continue
            if zones and not o.zone and o.region not in zones:  # region-wide: per zone
                out += [o._replace(zone=z) for z in sorted(zones) if z.startswith(o.region)]
                continue
            if zones and o.zone and o.zone not in zones:
                continue
            out.append(o)
    auto = shape.spot == "auto"
    out.sort(key=lambda o: ((not o.spot) if auto else False, o.price, o.cloud,
                            o.instance_type, o.region, o.zone or ""))
    return out if limit is None else out[:limit]


@pytest.mark.parametrize("shape,limits", [
    (Shape(accelerator="V100", accelerator_count=4, spot=True), {}),
    (Shape(accelerator="A100-80GB", accelerator_count=8, spot="auto"), {"limit": 5}),
    (Shape(accelerator="T4", accelerator_count=1, spot=False), {"max_price": 1.0}),
    (Shape(accelerator_count=1, spot="auto"), {"regions": {"us-east-1", "eastus"}}),
    (Shape(cpus=8, memory_gib=32, spot=True), {"zones": {"us-west-2b", "eastus"}}),
    (Shape(cpus=96, spot="auto"), {"limit": 40, "max_price": 3.0}),
    (Shape(instance_type="m5.large", spot="auto"), {}),
    (Shape(cpus=2, arch="arm64", spot=False), {"limit": 3}),
])
def test_the_indexed_ranking_equals_filtering_every_offer_of_the_shipped_catalog(
        hyper_home, shape, limits):
    cat = C.Catalog()
    assert ranked_offers(shape, cat, **limits) == _reference(shape, cat, **limits)


def test_a_gpu_shape_reads_the_rows_of_its_model_only_and_the_index_follows_the_table(cat):
    """The optimizer's index (Table.by_gpu, offers_of_kind): a V100 shape never reads a CPU or
    T4 type's prices; a table whose types are replaced or added to is indexed again."""
    read = []
    for t in cat.tables.values():
        split = t.offers_of_kind
        t.offers_of_kind = lambda name, spot, split=split: read.append(name) or split(name,
                                                                                     spot)
    got = ranked_offers(Shape(accelerator="V100", accelerator_count=4), cat)
    assert got and set(read) == {"p3.8xlarge", "p3.16xlarge", "Standard_NC24s_v3",
                                 "n1-standard-32/nvidia-tesla-v100:4"}
    gcp = cat.tables["gcp"]
    gcp.types = {k: v for k, v in gcp.types.items() if "/" not in k}  # as with_first_offer
    assert {o.cloud for o in ranked_offers(Shape(accelerator="V100", accelerator_count=4),
                                           cat)} == {"aws", "azure"}
    cat.tables["aws"].add({"instance_type": "p3.2xlarge", "vcpus": "8", "memory_gib": "61",
                           "accelerator": "V100", "accelerator_count": "4",
                           "region": "us-east-1", "zone": "us-east-1a", "price": "1",
                           "spot_price": "0.5"})
    first = ranked_offers(Shape(accelerator="V100", accelerator_count=4), cat)[0]
    assert (first.instance_type, first.price) == ("p3.2xlarge", 0.5)
