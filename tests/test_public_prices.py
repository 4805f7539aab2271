"""The public prices in the catalog snapshot shipped in the package: the figures of
hypercli/offers/data/public_prices.csv (transcribed from skypilot-org/skypilot-catalog) are
the snapshot's prices of those instance types and regions, marked as public; the rest stay
illustrative and say so; and the optimizer's choice for a recipe needing 4 V100s is the one
those prices imply, in `hyper plan` too."""

from __future__ import annotations

import csv
import gzip
import json
from collections import defaultdict

import pytest

from hypercli.offers import catalog as C
from hypercli.offers.optimizer import Shape, choose

PUBLIC = C.DATA / "public_prices.csv"
#: the regions whose prices of the curated types are public (data/NOTICE.md)
REGIONS = ["us-east-1", "us-west-2", "us-central1", "europe-west4"]


@pytest.fixture
def shipped(hyper_home) -> C.Catalog:
    """The packaged snapshot (an empty $HYPER_HOME: no cache, no custom rows)."""
    return C.Catalog(["aws", "gcp", "azure"])


def _rows(cloud: str) -> list[dict]:
    with open(PUBLIC, newline="") as f:
        return [r for r in csv.DictReader(f) if r["cloud"] == cloud]


def _usd(text: str):
    return float(text) if text else None


def test_a_few_rows_carry_the_figures_of_the_public_catalog(shipped):
    aws, gcp = shipped.tables["aws"], shipped.tables["gcp"]
    # figures as skypilot-catalog's catalogs/v7 lists them (on-demand; lowest spot of the
    # region's zone IDs for AWS; machine + GPUs for GCP)
    assert sorted(p for p in aws.prices["p3.8xlarge"]) == [
        ("us-east-1", None, 12.24, 1.7535), ("us-west-2", None, 12.24, 4.1597)]
    assert aws.types["p3.8xlarge"] == C.InstanceType("aws", "p3.8xlarge", 32, 244, "V100", 4,
                                                     16.0)
    assert ("us-east-1", None, 0.526, 0.1845) in aws.prices["g4dn.xlarge"]
    assert ("us-west-2", None, 32.7726, 10.507) in aws.prices["p4d.24xlarge"]
    v100 = {p[1]: p[2:] for p in gcp.prices["n1-standard-32/nvidia-tesla-v100:4"]
            if p[0] == "us-central1"}
    assert set(v100) == {"us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f"}
    assert v100["us-central1-a"] == pytest.approx((1.51999 + 9.92, 0.3852 + 3.968), abs=1e-9)
    l4 = {p[1]: p[2:] for p in gcp.prices["g2-standard-4"] if p[0] == "us-central1"}
    assert set(l4) == {"us-central1-a", "us-central1-b", "us-central1-c"}  # no L4 in -f
    assert l4["us-central1-b"] == pytest.approx((0.14679 + 0.56004, 0.05874 + 0.2231))
    a2 = [p for p in gcp.prices["a2-highgpu-1g"] if p[1] == "europe-west4-a"]
    assert a2 == [("europe-west4", "europe-west4-a", pytest.approx(0.81406 + 1.61365),
                   pytest.approx(0.31824 + 1.1691))]
    azure = shipped.tables["azure"]
    assert ("westus2", None, 12.24, 1.41372) in azure.prices["Standard_NC24s_v3"]
    assert ("eastus", None, 0.526, 0.062699) in azure.prices["Standard_NC4as_T4_v3"]
    assert azure.price_sources["Standard_NC24s_v3", "westus2", None] == "public"
    west = next(p for p in azure.prices["Standard_NC24s_v3"] if p[0] == "westeurope")
    assert ("Standard_NC24s_v3", "westeurope", None) not in azure.price_sources  # no data
    assert west[2] != 12.24
    for name, region, zone in (("p3.8xlarge", "us-east-1", None),
                               ("n1-standard-32/nvidia-tesla-v100:4", "us-central1",
                                "us-central1-a"), ("g2-standard-4", "europe-west4",
                                                   "europe-west4-a")):
        assert gcp.price_sources.get((name, region, zone), aws.price_sources.get(
            (name, region, zone))) == "public"


def test_every_aws_row_of_the_public_file_is_in_the_snapshot_per_region(shipped):
    """Each (type, region) of the file: one row with no zone (zone IDs are per account),
    the on-demand price and the lowest spot price of its zone IDs (none when no zone ID has
    one), marked public; the illustrative zone rows of that region are gone."""
    aws = shipped.tables["aws"]
    want = defaultdict(list)
    for r in _rows("aws"):
        want[r["instance_type"], r["region"]].append(r)
    assert len(want) == 24
    for (name, region), got in want.items():
        spots = [s for s in (_usd(r["spot_price"]) for r in got) if s is not None]
        rows = [p for p in aws.prices[name] if p[0] == region]
        assert rows == [(region, None, float(got[0]["price"]), min(spots) if spots else None)]
        assert aws.price_sources[name, region, None] == "public"


def test_gcp_plain_machines_of_the_public_file_are_in_the_snapshot_zone_by_zone(shipped):
    gcp = shipped.tables["gcp"]
    checked = 0
    for r in _rows("gcp"):
        t = gcp.types.get(r["instance_type"])
        if t is None or t.accelerator_count:  # GPU rows; a2/g2: machine + GPU (above)
            continue
        rows = {p[1]: p for p in gcp.prices[r["instance_type"]] if p[0] == r["region"]}
        if r["zone"] in rows:  # zones the snapshot lists (the stand-in's): us-central1-f...
            assert rows[r["zone"]][2:] == (_usd(r["price"]), _usd(r["spot_price"]))
            assert gcp.price_sources[r["instance_type"], r["region"], r["zone"]] == "public"
            checked += 1
    assert checked >= 40


def test_the_other_prices_stay_illustrative_and_say_so(shipped):
    aws = shipped.tables["aws"]
    other = next(p for p in aws.prices["m5.large"] if p[0] == "eu-west-1")
    offer = C.make_offer(aws.types["m5.large"], other[0], other[1], False, other[2])
    assert shipped.price_source(offer) == "illustrative"
    east = C.make_offer(aws.types["m5.large"], "us-east-1", None, False, 0.096)
    assert shipped.price_source(east) == "public"
    meta = json.loads((C.DATA / "snapshot.json").read_text())
    files = {f["source"]: f["commit"] for f in meta["public_prices"]["files"]}
    assert files == {
        "skypilot-org/skypilot-catalog:catalogs/v7/aws/vms.csv":
            "001367d22a0033fac286a8c71aeac7109e431bcb",
        "skypilot-org/skypilot-catalog:catalogs/v7/gcp/vms.csv":
            "017e2502fb63c7a28757acd94002b2d6099d3e3d",
        "skypilot-org/skypilot-catalog:catalogs/v6/azure/vms.csv":
            "098741e70562f65d7af1cceb81e33b284f742604"}
    assert meta["public_prices"]["rows"] == sum(len(_rows(c)) for c in ("aws", "gcp", "azure"))


def test_v100x4_is_what_the_public_prices_imply(shipped):
    """4 V100s, 32+ vCPUs, 100+ GiB in the public regions: spot, AWS p3.8xlarge in us-east-1
    at its lowest zone-ID spot price beats GCP's n1-standard-32 + 4 V100 (3.48 in
    europe-west4) and p3.16xlarge; on demand, GCP's n1-standard-32 + 4 V100 in us-central1
    (1.51999 + 9.92) beats p3.8xlarge (12.24)."""
    shape = dict(accelerator="V100", accelerator_count=4, cpus=32, memory_gib=100)
    spot = choose(Shape(**shape, spot=True), shipped, regions=REGIONS, limit=3)
    assert [(o.cloud, o.instance_type, o.region, o.price) for o in spot[:2]] == [
        ("aws", "p3.8xlarge", "us-east-1", 1.7535), ("aws", "p3.16xlarge", "us-east-1", 2.7531)]
    assert spot[2].cloud == "gcp" and spot[2].price == pytest.approx(0.62256 + 2.8592)
    on_demand = choose(Shape(**shape, spot=False), shipped, regions=REGIONS)
    first = on_demand[0]
    assert (first.cloud, first.instance_type, first.region) == (
        "gcp", "n1-standard-32/nvidia-tesla-v100:4", "us-central1")
    assert first.price == pytest.approx(11.43999)
    assert shipped.price_source(first) == "public"
    p3 = next(o for o in on_demand if o.instance_type == "p3.8xlarge")
    assert p3.price == 12.24 and on_demand.index(p3) > 0


def test_plan_shows_the_choice_and_that_its_price_is_public(hyper, hyper_home, write_recipe):
    path = write_recipe("""
        name: v100
        cluster: {provider: aws, clouds: [aws, gcp], regions: [us-east-1, us-west-2,
                  us-central1, europe-west4]}
        experiments:
          train:
            parameters: {lr: [0.1, 0.2]}
            resources: {accelerators: "V100:4", cpus: "32+", memory: "100+"}
            minutes: 60
            command: train --lr {{lr}}
    """)
    out = hyper("plan", path, check=True).stdout
    assert ("train [V100:4, 32+ vCPUs, 93.1+ GiB, spot]: aws us-east-1 p3.8xlarge spot "
            "$1.7535/h (public catalog price)") in out
    assert "2 tasks × 60 min (hint) = 2 node-hours ≈ $3.51" in out
    rows = json.loads(hyper("offers", "V100:4", "--region", "us-east1", "--json",
                            check=True).stdout)
    assert rows and {r["price_source"] for r in rows} == {"illustrative"}
    shown = {r["cloud"]: r for r in json.loads(hyper("catalog", "show", "--json",
                                                      check=True).stdout)}
    assert shown["aws"]["public_prices"] == 24 and shown["azure"]["public_prices"] == 25


def test_a_cached_table_without_the_column_reads_and_custom_rows_say_custom(hyper_home):
    """A table written before the ``price_source`` column (a user's cache) still reads, its
    prices from the API; a row of custom.csv says it is custom; a written table keeps the
    column."""
    folder = hyper_home / "catalog"
    folder.mkdir(parents=True)
    old = ("instance_type,vcpus,memory_gib,accelerator,accelerator_count,"
           "accelerator_memory_gib,arch,region,zone,price,spot_price\n"
           "p3.8xlarge,32,244,V100,4,16,x86_64,us-east-1,us-east-1a,12.24,3.9\n")
    (folder / "aws.csv.gz").write_bytes(gzip.compress(old.encode()))
    (folder / "aws.json").write_text(json.dumps({"read_at": 1.0, "source": "api"}))
    (folder / "custom.csv").write_text(
        "cloud,instance_type,vcpus,memory_gib,accelerator,accelerator_count,region,zone,price,"
        "spot_price\naws,p3.8xlarge,32,244,V100,4,us-west-2,,12.24,4.0\n")
    cat = C.Catalog(["aws"])
    got = {o.region: cat.price_source(o) for o in cat.offers_of(cat.tables["aws"].types[
        "p3.8xlarge"])}
    assert got == {"us-east-1": "api", "us-west-2": "custom"}
    C.write(cat.tables["aws"], folder)
    back = C.load_table("aws")
    assert back.price_sources == {("p3.8xlarge", "us-west-2", None): "custom"}


def test_a_region_wide_offer_keeps_to_the_zones_a_cluster_allows(shipped):
    """The public AWS rows hold for a whole region (zone IDs are per account): with
    ``zones:`` the optimizer offers them in those zones only, one offer per allowed zone, so
    a launch stays where the cluster allows; a zone of another region gets none of them."""
    shape = Shape(instance_type="m5.large", spot=True)
    got = choose(shape, shipped, zones=["us-east-1c", "us-east-1a"])
    assert [(o.region, o.zone, o.price) for o in got] == [
        ("us-east-1", "us-east-1a", 0.0291), ("us-east-1", "us-east-1c", 0.0291)]
    assert {shipped.price_source(o) for o in got} == {"public"}
    whole = choose(shape, shipped, zones=["us-west-2"])
    assert [(o.zone, o.price) for o in whole] == [(None, 0.0356)]
    assert all(o.region != "us-east-1" for o in choose(shape, shipped, zones=["eu-west-1a"]))
