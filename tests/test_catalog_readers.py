"""The catalog readers (hypercli/offers/read_*.py) with the real SDK clients: boto3 against
moto (AWS's own instance types and offerings) and the Price List stand-in, google-cloud-compute
against the Compute Engine stand-in, azure-mgmt-compute against the ARM stand-in; the tables
they make kept in $HYPER_HOME/catalog and read back."""

from __future__ import annotations

import gzip
import time

import pytest

from hypercli.offers import catalog as C

moto = pytest.importorskip("moto")


@pytest.fixture
def aws(monkeypatch):
    from cloudcatalog import AwsPricingFake, aws_spot_prices
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "HYPER_AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    pricing = AwsPricingFake()
    monkeypatch.setenv("HYPER_AWS_PRICING_ENDPOINT", pricing.url)
    try:
        with moto.mock_aws(), aws_spot_prices():
            yield pricing
    finally:
        pricing.close()


def test_aws_reader_types_offerings_spot_and_on_demand(aws, hyper_home):
    from cloudcatalog import aws_price
    from hypercli.offers import read_aws
    table = read_aws.read(["me-south-1"])
    g = table.types["g4dn.12xlarge"]  # AWS's own shape, as moto ships it
    assert (g.vcpus, g.memory_gib, g.accelerator, g.accelerator_count) == (48, 192, "T4", 4)
    assert table.types["m5.large"].accelerator is None
    offers = table.offers("g4dn.12xlarge")
    zones = {o.zone for o in offers}
    assert zones and all(z.startswith("me-south-1") for z in zones)
    on_demand = {o.price for o in offers if not o.spot}
    assert on_demand == {aws_price("g4dn.12xlarge", "me-south-1")}  # from the Price List API
    spot = [o for o in offers if o.spot]
    assert len(spot) == len(zones) and all(0 < o.price < min(on_demand) for o in spot)
    assert aws.requests >= 2  # paged: more than 100 products
    assert any(t.arch == "arm64" for t in table.types.values())  # Graviton


def test_gcp_reader_machine_types_attached_gpus_and_skus(monkeypatch):
    from cloudcatalog import GCP_RATES, GPU_RATE
    from gcpfake import ComputeFake
    from hypercli.offers import read_gcp
    fake = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
    try:
        table = read_gcp.read("proj")
    finally:
        fake.close()
    a2 = table.types["a2-ultragpu-8g"]
    assert (a2.vcpus, a2.accelerator, a2.accelerator_count) == (96, "A100-80GB", 8)
    v = table.types["n1-standard-8/nvidia-tesla-v100:1"]
    assert (v.vcpus, v.memory_gib, v.accelerator, v.accelerator_count) == (8, 30, "V100", 1)
    # N1 takes at most 12 vCPUs per V100: no n1-standard-16 with one V100
    assert "n1-standard-16/nvidia-tesla-v100:1" not in table.types
    core, ram = GCP_RATES["n1"]
    [o] = [o for o in table.offers("n1-standard-8/nvidia-tesla-v100:1")
           if o.zone == "us-central1-a" and not o.spot]
    assert o.price == pytest.approx(8 * core + 30 * ram + GPU_RATE["V100"], rel=1e-4)
    # K80s are missing in every third zone of the stand-in: no offer there
    k80 = {o.zone for o in table.offers("n1-standard-8/nvidia-tesla-k80:1")}
    assert "us-central1-c" not in k80 and "us-central1-a" in k80


def test_azure_reader_skus_restrictions_and_retail_prices(monkeypatch, tmp_path):
    from azurefake import ArmFake
    from hypercli.offers import read_azure
    fake = ArmFake(tmp_path)
    for k, v in {"HYPER_AZURE_ENDPOINT": fake.url, "HYPER_AZURE_CA_BUNDLE": str(fake.ca),
                 "HYPER_AZURE_TOKEN": "token-1", "HYPER_AZURE_PRICES_ENDPOINT": fake.url,
                 "AZURE_SUBSCRIPTION_ID": "sub-1"}.items():
        monkeypatch.setenv(k, v)
    try:
        table = read_azure.read()
    finally:
        fake.close()
    nc = table.types["Standard_NC24s_v3"]
    assert (nc.vcpus, nc.memory_gib, nc.accelerator, nc.accelerator_count) == (24, 448, "V100", 4)
    offers = table.offers("Standard_NC24s_v3")
    east = {o.spot: o.price for o in offers if o.region == "eastus"}
    assert set(east) == {True, False} and east[True] < east[False]  # Linux, not Windows
    assert all(o.zone is None for o in offers)
    # the SKU is restricted in southeastasia for this subscription: no offer there
    assert "southeastasia" not in {o.region for o in table.offers("Standard_ND96isr_H100_v5")}


def test_cache_round_trip_date_and_staleness(hyper_home):
    t = C.Table("gcp", read_at=time.time() - 8 * 24 * 3600, source="api")
    t.add({"instance_type": "g2-standard-4", "vcpus": "4", "memory_gib": "16",
           "accelerator": "nvidia-l4", "accelerator_count": "1", "region": "us-central1",
           "zone": "us-central1-a", "price": "0.7", "spot_price": "0.28"})
    path = C.write(t)
    assert path == hyper_home / "catalog" / "gcp.csv.gz"
    assert gzip.decompress(path.read_bytes()).decode().startswith(",".join(C.COLUMNS))
    back = C.load_table("gcp")
    assert back.source == "cache" and back.read_at == pytest.approx(t.read_at)
    assert back.types["g2-standard-4"].accelerator == "L4"
    cat = C.Catalog(tables={"gcp": back})
    assert cat.stale() == ["gcp"]  # read more than a week ago


def test_broken_cache_is_a_clear_error(hyper_home):
    (hyper_home / "catalog").mkdir(parents=True)
    (hyper_home / "catalog" / "aws.csv.gz").write_bytes(b"instance_type,vcpus\nx,notanumber\n")
    (hyper_home / "catalog" / "aws.json").write_text('{"read_at": 1}')
    with pytest.raises(C.UsageError, match=r"cached catalog .*aws.csv.gz cannot be read"):
        C.load_table("aws")


def test_azure_prices_unreachable_is_a_cloud_error_and_nothing_is_written(
        monkeypatch, tmp_path, hyper_home):
    import socket

    from azurefake import ArmFake
    from hypercli.offers import read_azure
    from hypercli.providers.cloud import CloudError
    fake = ArmFake(tmp_path)
    with socket.socket() as s:  # a loopback port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = f"https://127.0.0.1:{s.getsockname()[1]}"
    for k, v in {"HYPER_AZURE_ENDPOINT": fake.url, "HYPER_AZURE_CA_BUNDLE": str(fake.ca),
                 "HYPER_AZURE_TOKEN": "token-1", "HYPER_AZURE_PRICES_ENDPOINT": dead,
                 "AZURE_SUBSCRIPTION_ID": "sub-1"}.items():
        monkeypatch.setenv(k, v)
    try:
        with pytest.raises(CloudError, match="reading Azure's retail prices of eastus"):
            read_azure.read(regions=["eastus"])
    finally:
        fake.close()
    assert not (hyper_home / "catalog").exists()
