"""AWS's catalog read from its APIs with the user's credentials: instance types
(``DescribeInstanceTypes``), where each is offered (``DescribeInstanceTypeOfferings`` by
availability zone), spot prices per zone (``DescribeSpotPriceHistory``, the newest price of
each type and zone) and on-demand prices per region (the Price List Query API,
``GetProducts`` of ``AmazonEC2``: Linux, shared tenancy, no pre-installed software, capacity
status "Used" — the filters SkyPilot's AWS fetcher applies, skypilot-org/skypilot
``sky/catalog/data_fetchers/fetch_aws.py``).

Test seams: ``HYPER_AWS_ENDPOINT_URL`` (every EC2 call, as hypercli.providers.aws) and
``HYPER_AWS_PRICING_ENDPOINT`` (the Price List API, served in the tests by
tests/cloudcatalog.py).
"""

from __future__ import annotations

import json
import os
import time
from datetime import datetime, timezone

from hypercli.offers.catalog import Table

PRICING_ENV = "HYPER_AWS_PRICING_ENDPOINT"
PAGE = 100  #: items per page asked of EC2 (the APIs' usual MaxResults)
PRICING_REGION = "us-east-1"  #: the Price List API's endpoint region (AWS documentation)
PRICE_FILTERS = {"operatingSystem": "Linux", "tenancy": "Shared", "preInstalledSw": "NA",
                 "capacitystatus": "Used"}


def _client(session, service: str, region: str, endpoint: str | None):
    from botocore.config import Config
    return session.client(service, region_name=region, endpoint_url=endpoint,
                          config=Config(retries={"mode": "standard", "max_attempts": 5},
                                        user_agent_extra="hypercli"))


def _arch(t: dict) -> str:
    archs = t.get("ProcessorInfo", {}).get("SupportedArchitectures", [])
    return "arm64" if "arm64" in archs and "x86_64" not in archs else "x86_64"


def _type_row(t: dict) -> dict:
    gpus = (t.get("GpuInfo") or {}).get("Gpus") or []
    accel = (t.get("InferenceAcceleratorInfo") or {}).get("Accelerators") or []
    name, count, mem = "", 0, 0.0
    if gpus:
        name, count = gpus[0].get("Name", ""), sum(g.get("Count", 0) for g in gpus)
        mem = gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0) / 1024
    elif accel:
        name, count = accel[0].get("Name", ""), sum(a.get("Count", 0) for a in accel)
    return {"instance_type": t["InstanceType"], "vcpus": t["VCpuInfo"]["DefaultVCpus"],
            "memory_gib": t["MemoryInfo"]["SizeInMiB"] / 1024, "accelerator": name,
            "accelerator_count": count, "accelerator_memory_gib": mem, "arch": _arch(t)}


def _on_demand(pricing, region: str) -> dict:
    """instance type → on-demand $/h in ``region``."""
    filters = [{"Type": "TERM_MATCH", "Field": k, "Value": v}
               for k, v in {**PRICE_FILTERS, "regionCode": region}.items()]
    out = {}
    for page in pricing.get_paginator("get_products").paginate(
            ServiceCode="AmazonEC2", Filters=filters, FormatVersion="aws_v1"):
        for text in page.get("PriceList", []):
            item = json.loads(text) if isinstance(text, str) else text
            itype = item["product"]["attributes"].get("instanceType")
            for term in item.get("terms", {}).get("OnDemand", {}).values():
                for dim in term.get("priceDimensions", {}).values():
                    usd = float(dim.get("pricePerUnit", {}).get("USD") or 0)
                    if itype and usd > 0:
                        out[itype] = usd
    return out


def _spot(ec2) -> dict:
    """(instance type, zone) → the newest Linux spot $/h."""
    out: dict = {}
    start = datetime.fromtimestamp(time.time() - 3600, tz=timezone.utc)
    for page in ec2.get_paginator("describe_spot_price_history").paginate(
            PaginationConfig={"PageSize": PAGE}, StartTime=start,
            ProductDescriptions=["Linux/UNIX", "Linux/UNIX (Amazon VPC)"]):
        for p in page.get("SpotPriceHistory", []):
            key = (p["InstanceType"], p["AvailabilityZone"])
            stamp = str(p.get("Timestamp", ""))
            if key not in out or stamp > out[key][1]:
                out[key] = (float(p["SpotPrice"]), stamp)
    return {k: v[0] for k, v in out.items()}


def read(regions: list[str] | None = None, session=None) -> Table:
    """AWS's table (hypercli.offers.catalog) for ``regions`` (default every region
    ``DescribeRegions`` lists for the account).

    Args:
        regions: region names; session: a boto3 Session (default: the user's credentials).
    Raises:
        CredentialsError, UsageError, CloudError (hypercli.providers.aws.aws_errors).
    """
    import boto3

    from hypercli.providers.aws import ENDPOINT_ENV, aws_errors
    session = session or boto3.Session()
    ec2_endpoint = os.environ.get(ENDPOINT_ENV) or None
    table = Table("aws", read_at=time.time(), source="api")
    home_region = (regions or [None])[0] or session.region_name or "us-east-1"
    with aws_errors("listing the AWS regions"):
        if not regions:
            ec2 = _client(session, "ec2", home_region, ec2_endpoint)
            regions = sorted(r["RegionName"] for r in ec2.describe_regions()["Regions"])
    pricing = _client(session, "pricing", PRICING_REGION, os.environ.get(PRICING_ENV) or None)
    found = {}
    for region in regions:
        with aws_errors(f"reading the instance types offered in {region}"):
            ec2 = _client(session, "ec2", region, ec2_endpoint)
            zones: dict = {}
            for page in ec2.get_paginator("describe_instance_type_offerings").paginate(
                    PaginationConfig={"PageSize": PAGE}, LocationType="availability-zone"):
                for o in page["InstanceTypeOfferings"]:
                    zones.setdefault(o["InstanceType"], []).append(o["Location"])
            found[region] = (zones, _spot(ec2), _on_demand(pricing, region))
    names = sorted({t for zones, _, _ in found.values() for t in zones})
    types = {}
    with aws_errors("describing the instance types"):
        ec2 = _client(session, "ec2", regions[0], ec2_endpoint)
        for i in range(0, len(names), PAGE):  # the API takes at most 100 names a call
            for t in ec2.describe_instance_types(InstanceTypes=names[i:i + PAGE])[
                    "InstanceTypes"]:
                types[t["InstanceType"]] = _type_row(t)
    for region, (zones, spot, on_demand) in found.items():
        for itype, where in zones.items():
            if itype not in types:
                continue
            for zone in sorted(where):
                price, sp = on_demand.get(itype), spot.get((itype, zone))
                if price is None and sp is None:
                    continue
                table.add({**types[itype], "region": region, "zone": zone,
                           "price": "" if price is None else str(price),
                           "spot_price": "" if sp is None else str(sp)})
    return table
