"""Make the catalog snapshot shipped in the package (hypercli/offers/data/) by running the
catalog readers (hypercli/offers/read_*.py, the code of `hyper catalog refresh`) against the
test stand-ins: moto for AWS (AWS's own instance types and zone offerings) with the Price List
stand-in, and the GCP and Azure stand-ins (tests/cloudcatalog.py), then puts in the public
prices of data/public_prices.csv (scripts/public_prices.py). The other prices are the
stand-ins' illustrative ones, not the clouds'; data/NOTICE.md says which are which.

    .venv/bin/python scripts/catalog_snapshot.py [AWS_REGION ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

#: the AWS regions of the snapshot (the readers take every region; a few keep it small)
AWS_REGIONS = ["us-east-1", "us-east-2", "us-west-2", "eu-west-1", "eu-central-1",
               "ap-northeast-1", "ap-southeast-1", "sa-east-1"]


def main(regions: list[str]) -> None:
    import moto
    from azurefake import ArmFake
    from cloudcatalog import AwsPricingFake, aws_spot_prices
    from gcpfake import ComputeFake

    from hypercli.offers import catalog, read_aws, read_azure, read_gcp
    out = catalog.DATA
    os.environ.update(AWS_ACCESS_KEY_ID="snapshot", AWS_SECRET_ACCESS_KEY="snapshot",
                      AWS_DEFAULT_REGION=regions[0])
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "HYPER_AWS_ENDPOINT_URL"):
        os.environ.pop(k, None)
    counts = {}
    pricing = AwsPricingFake()
    os.environ["HYPER_AWS_PRICING_ENDPOINT"] = pricing.url
    try:
        t0 = time.time()
        with moto.mock_aws(), aws_spot_prices():
            aws = read_aws.read(regions)
        print(f"aws: {len(aws.types)} types in {time.time() - t0:.0f}s", flush=True)
    finally:
        pricing.close()
    gcp_fake = ComputeFake(project="snapshot")
    os.environ["HYPER_GCP_ENDPOINT"] = gcp_fake.url
    try:
        gcp = read_gcp.read("snapshot")
    finally:
        gcp_fake.close()
    arm = ArmFake(Path(tempfile.mkdtemp()), subscription="snapshot")
    os.environ.update(HYPER_AZURE_ENDPOINT=arm.url, HYPER_AZURE_CA_BUNDLE=str(arm.ca),
                      HYPER_AZURE_TOKEN="snapshot", HYPER_AZURE_PRICES_ENDPOINT=arm.url,
                      AZURE_SUBSCRIPTION_ID="snapshot")
    try:
        azure = read_azure.read()
    finally:
        arm.close()
    import public_prices
    rows = public_prices.load()
    public_prices.apply({"aws": aws, "gcp": gcp, "azure": azure}, rows)
    now = time.time()
    for table in (aws, gcp, azure):
        table.read_at, table.source = now, "snapshot"
        path = catalog.write(table, out)
        (out / f"{table.cloud}.json").unlink()  # the snapshot's date is in snapshot.json
        counts[table.cloud] = {"types": len(table.types),
                               "rows": sum(len(v) for v in table.prices.values()),
                               "bytes": path.stat().st_size}
    meta = {"taken_at": now,
            "date": datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d"),
            "source": "catalog readers against the test stand-ins (moto for AWS)",
            "prices": "public for the rows marked price_source=public (public_prices.csv), "
                      "illustrative (tests/cloudcatalog.py) for the rest",
            "public_prices": public_prices.provenance(rows),
            "aws_regions": regions, "tables": counts}
    (out / "snapshot.json").write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps(counts))


if __name__ == "__main__":
    main(sys.argv[1:] or AWS_REGIONS)
