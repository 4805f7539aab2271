"""`hyper offers`, `hyper catalog` and the machines of `hyper plan`, through the real CLI:
catalogs kept in $HYPER_HOME/catalog (written here, or read by `hyper catalog refresh` from
the GCP and Azure stand-ins), the packaged snapshot when there is none."""

from __future__ import annotations

import json

from test_optimizer import ROWS, table

from hypercli.offers import catalog as C


def cache_all():
    for cloud in ROWS:
        C.write(table(cloud))


def test_offers_lists_cheapest_first_one_row_per_type_and_region(hyper, hyper_home):
    cache_all()
    p = hyper("offers", "V100:4", "--json", check=True)
    rows = json.loads(p.stdout)
    first = [(r["cloud"], r["instance_type"], r["region"]) for r in rows[:3]]
    assert first == [("gcp", "n1-standard-32/nvidia-tesla-v100:4", "us-central1"),
                     ("aws", "p3.8xlarge", "us-west-2"), ("aws", "p3.8xlarge", "us-east-1")]
    east = rows[2]
    assert (east["price"], east["spot_price"], east["spot_zone"]) == (12.24, 3.9, "us-east-1a")
    p = hyper("offers", "v100:4", "--cloud", "aws", "--region", "us-east-1", check=True)
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert lines[0].split()[:4] == ["GPU", "QTY", "CLOUD", "INSTANCE_TYPE"]
    assert [ln.split()[3] for ln in lines[1:]] == ["p3.8xlarge", "p3.16xlarge"]
    p = hyper("offers", "V100:4", "--on-demand", "--json", check=True)
    assert all(r["spot_price"] is None for r in json.loads(p.stdout))


def test_offers_of_a_shape_nothing_satisfies_is_exit_2_naming_the_nearest(hyper, hyper_home):
    cache_all()
    p = hyper("offers", "V100:16")
    assert p.returncode == 2, p.stderr
    assert "no instance in aws, gcp, azure has V100:16" in p.stderr
    assert "p3.16xlarge" in p.stderr and "Traceback" not in p.stderr
    p = hyper("offers", "V10:1")
    assert p.returncode == 2 and "did you mean V100" in p.stderr


def test_plan_prints_the_choice_alternatives_and_estimate(hyper, hyper_home, write_recipe):
    cache_all()
    path = write_recipe("""
        name: est
        cluster: {provider: aws, clouds: [aws, azure]}
        experiments:
          train:
            parameters: {lr: [0.1, 0.2]}
            resources: {accelerators: "V100:4"}
            minutes: 90
            command: train --lr {{lr}}
          report:
            after: [train]
            command: report
    """)
    p = hyper("plan", path, check=True)
    out = p.stdout
    assert "train [V100:4, 1+ vCPUs, spot]: aws us-west-2a p3.8xlarge spot $3.7000/h" in out
    assert "then aws us-east-1a p3.8xlarge spot $3.9000/h" in out
    assert "2 tasks × 90 min (hint) = 3 node-hours ≈ $11.10" in out
    assert "report [1+ vCPUs, spot]: aws us-east-1a m5.large spot $0.0350/h" in out
    assert "then azure eastus Standard_D8s_v5 spot $0.0770/h" in out
    assert "no estimate" in out and "estimate: $" not in out  # report has no minutes


def test_plan_of_a_recipe_nothing_satisfies_is_exit_2(hyper, hyper_home, write_recipe):
    cache_all()
    path = write_recipe("""
        name: nope
        cluster: {provider: gcp}
        experiments:
          big: {resources: {accelerators: "H100:8"}, command: x}
    """)
    p = hyper("plan", path)
    assert p.returncode == 2
    assert "experiment big: no instance in gcp has H100:8" in p.stderr


def test_catalog_refresh_reads_the_gcp_and_azure_apis(hyper, hyper_home, monkeypatch,
                                                       tmp_path):
    from azurefake import ArmFake
    from gcpfake import ComputeFake
    gcp, arm = ComputeFake(), ArmFake(tmp_path)
    for k, v in {"HYPER_GCP_ENDPOINT": gcp.url, "GOOGLE_CLOUD_PROJECT": "proj",
                 "HYPER_AZURE_ENDPOINT": arm.url, "HYPER_AZURE_CA_BUNDLE": str(arm.ca),
                 "HYPER_AZURE_TOKEN": "token-1", "HYPER_AZURE_PRICES_ENDPOINT": arm.url,
                 "AZURE_SUBSCRIPTION_ID": "sub-1"}.items():
        monkeypatch.setenv(k, v)
    try:
        p = hyper("catalog", "refresh", "--cloud", "gcp", "--cloud", "azure", timeout=300,
                  check=True)
    finally:
        gcp.close()
        arm.close()
    assert "gcp:" in p.stdout and "azure:" in p.stdout
    assert (hyper_home / "catalog" / "gcp.csv.gz").exists()
    shown = {r["cloud"]: r for r in json.loads(hyper("catalog", "show", "--json",
                                                      check=True).stdout)}
    assert shown["gcp"]["source"] == "cache" and shown["azure"]["source"] == "cache"
    assert shown["aws"]["source"] == "snapshot" and not shown["gcp"]["stale"]
    rows = json.loads(hyper("offers", "L4:8", "--cloud", "gcp", "--json", check=True).stdout)
    assert rows[0]["instance_type"] == "g2-standard-96"


def test_refresh_with_refused_credentials_is_a_clear_error(hyper, hyper_home, monkeypatch):
    from gcpfake import ComputeFake
    gcp = ComputeFake()
    gcp.auth_fail = True
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", gcp.url)
    monkeypatch.setenv("GOOGLE_CLOUD_PROJECT", "proj")
    try:
        p = hyper("catalog", "refresh", "--cloud", "gcp")
    finally:
        gcp.close()
    assert p.returncode == 2 and "Google credentials" in p.stderr and "hint:" in p.stderr
    assert "Traceback" not in p.stderr
    assert not (hyper_home / "catalog" / "gcp.csv.gz").exists()  # nothing half-written
