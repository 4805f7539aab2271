"""What the cloud stand-ins answer about machines and prices: GCP machine types, accelerator
types and Cloud Billing Catalog SKUs (tests/gcpfake.py), Azure Resource SKUs and Retail Prices
(tests/azurefake.py), and for AWS, where moto has the instance types and offerings (AWS's own
data) but no prices, the Price List API (:class:`AwsPricingFake`, an HTTP server for the real
boto3 ``pricing`` client) and spot prices (:func:`aws_spot_prices`, moto's answer of
``DescribeSpotPriceHistory`` given prices instead of its fixed ``0.00001``).

The shapes (vCPUs, memory, GPUs of each machine type) follow the clouds' documentation
(cloud.google.com/compute/docs/machine-resource, learn.microsoft.com/azure/virtual-machines/
sizes); the prices are ILLUSTRATIVE, made by :func:`price` from per-vCPU, per-GiB and per-GPU
rates of the order of the clouds' 2024 list prices: they are test data, not the clouds'
prices. The JSON shapes are the real APIs' (field names, pagination, units).
"""

from __future__ import annotations

import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

#: on-demand US dollars per GPU-hour (illustrative, of the order of 2024 list prices)
GPU_RATE = {"V100": 2.48, "V100-32GB": 3.1, "T4": 0.35, "P100": 1.46, "K80": 0.45,
            "A100": 2.93, "A100-80GB": 3.93, "L4": 0.56, "H100": 9.8, "A10G": 1.0,
            "A10": 0.9, "M60": 0.75, "P40": 1.6, "K520": 0.65, "L40S": 1.86, "H200": 10.6,
            "B200": 14.0, "T4g": 0.42, "Radeon Pro V520": 0.38, "Gaudi HL-205": 4.1}
REGION_FACTOR = {"us": 1.0, "ca": 1.05, "eu": 1.1, "europe": 1.1, "northamerica": 1.05,
                 "asia": 1.2, "ap": 1.2, "sa": 1.4, "me": 1.15, "af": 1.2, "il": 1.15,
                 "southamerica": 1.4, "australia": 1.2, "eastus": 1.0, "eastus2": 1.0,
                 "westus2": 1.0, "westeurope": 1.1, "southeastasia": 1.2}


def _factor(region: str) -> float:
    return REGION_FACTOR.get(region, REGION_FACTOR.get(region.split("-")[0], 1.1))


def price(vcpus: float, mem_gib: float, gpu: str | None, gpus: int, region: str,
          cpu_rate: float = 0.0416, mem_rate: float = 0.0052) -> float:
    """Illustrative on-demand $/h of a machine (module docstring)."""
    p = vcpus * cpu_rate + mem_gib * mem_rate + gpus * GPU_RATE.get(gpu or "", 1.0)
    return round(p * _factor(region), 5)


def spot_share(*keys: str) -> float:
    """The spot price as a share of on-demand, 0.25-0.45, fixed per (type, zone)."""
    h = hashlib.sha256("/".join(keys).encode()).digest()[0]
    return 0.25 + 0.2 * h / 255


# -- GCP ---------------------------------------------------------------------------------------
COMPUTE_SERVICE = "6F81-5844-456A"  #: Compute Engine's service id in the Billing Catalog
GCP_ZONES = ("us-central1-a", "us-central1-b", "us-central1-c", "us-central1-f",
             "us-east1-b", "us-east1-c", "us-west1-a", "us-west1-b", "europe-west4-a",
             "europe-west4-b", "asia-east1-a", "asia-east1-c")
#: accelerator type → (normalised model, most cards per instance, GiB each)
GCP_GPUS = {"nvidia-tesla-v100": ("V100", 8, 16), "nvidia-tesla-t4": ("T4", 4, 16),
            "nvidia-tesla-p100": ("P100", 4, 16), "nvidia-tesla-k80": ("K80", 8, 12),
            "nvidia-tesla-a100": ("A100", 16, 40), "nvidia-a100-80gb": ("A100-80GB", 8, 80),
            "nvidia-l4": ("L4", 8, 24), "nvidia-h100-80gb": ("H100", 8, 80)}
#: SKU description words of each accelerator type (Cloud Billing Catalog)
GCP_GPU_SKU = {"nvidia-tesla-v100": "Nvidia Tesla V100", "nvidia-tesla-t4": "Nvidia Tesla T4",
               "nvidia-tesla-p100": "Nvidia Tesla P100", "nvidia-tesla-k80": "Nvidia Tesla K80",
               "nvidia-tesla-a100": "Nvidia Tesla A100",
               "nvidia-a100-80gb": "Nvidia Tesla A100 80GB", "nvidia-l4": "Nvidia L4",
               "nvidia-h100-80gb": "Nvidia H100 80GB"}
#: family → (core $/h, RAM $/GiB-h), illustrative
GCP_RATES = {"e2": (0.021811, 0.002923), "n1": (0.031611, 0.004237),
             "n2": (0.031611, 0.004237), "a2": (0.031611, 0.004237),
             "g2": (0.024988, 0.002927), "a3": (0.029563, 0.003963)}


def gcp_machine_types() -> list[dict]:
    """(name, vCPUs, MiB, [(accelerator type, count)]) of the stand-in's machine types."""
    out = []
    for n in (2, 4, 8, 16, 32):
        out.append((f"e2-standard-{n}", n, n * 4096, []))
    for n in (1, 2, 4, 8, 16, 32, 64, 96):
        out.append((f"n1-standard-{n}", n, int(n * 3840), []))
    for n in (2, 4, 8, 16, 32, 64, 96):
        out.append((f"n1-highmem-{n}", n, int(n * 6656), []))
    for n in (2, 4, 8, 16, 32, 48, 64, 80, 96, 128):
        out.append((f"n2-standard-{n}", n, n * 4096, []))
    for g in (1, 2, 4, 8):
        out.append((f"a2-highgpu-{g}g", 12 * g, 87040 * g, [("nvidia-tesla-a100", g)]))
        out.append((f"a2-ultragpu-{g}g", 12 * g, 174080 * g, [("nvidia-a100-80gb", g)]))
    out.append(("a2-megagpu-16g", 96, 1392640, [("nvidia-tesla-a100", 16)]))
    for n, g in ((4, 1), (8, 1), (12, 1), (16, 1), (24, 2), (32, 1), (48, 4), (96, 8)):
        out.append((f"g2-standard-{n}", n, n * 4096, [("nvidia-l4", g)]))
    out.append(("a3-highgpu-8g", 208, 1916928, [("nvidia-h100-80gb", 8)]))
    return [{"name": name, "cpus": c, "mib": mib, "gpus": g} for name, c, mib, g in out]


def gcp_aggregated(kind: str, link) -> dict:
    """The answer of ``aggregated/machineTypes`` or ``aggregated/acceleratorTypes``."""
    items = {}
    for i, zone in enumerate(GCP_ZONES):
        if kind == "machineTypes":
            objs = [{"kind": "compute#machineType", "id": str(9000 + j), "name": m["name"],
                     "description": f"{m['cpus']} vCPUs, {m['mib'] / 1024:g} GB RAM",
                     "guestCpus": m["cpus"], "memoryMb": m["mib"], "zone": zone,
                     "isSharedCpu": False, "maximumPersistentDisks": 128,
                     "accelerators": [{"guestAcceleratorType": t, "guestAcceleratorCount": c}
                                      for t, c in m["gpus"]],
                     "selfLink": link(f"zones/{zone}/machineTypes/{m['name']}")}
                    for j, m in enumerate(gcp_machine_types())
                    if not (m["gpus"] and zone.startswith("asia") and m["name"][:2] == "a3")]
            for o in objs:
                if not o["accelerators"]:
                    del o["accelerators"]
        else:
            objs = [{"kind": "compute#acceleratorType", "id": str(10000 + j), "name": t,
                     "description": GCP_GPU_SKU[t], "zone": link(f"zones/{zone}"),
                     "maximumCardsPerInstance": most,
                     "selfLink": link(f"zones/{zone}/acceleratorTypes/{t}")}
                    for j, (t, (_, most, _)) in enumerate(GCP_GPUS.items())
                    if not (t == "nvidia-tesla-k80" and i % 3 == 2)]
        items[f"zones/{zone}"] = {kind: objs}
    return {"kind": f"compute#{kind[:-1]}AggregatedList", "id": f"projects/x/aggregated/{kind}",
            "items": items}


def _money(usd: float) -> dict:
    units = int(usd)
    return {"currencyCode": "USD", "units": str(units), "nanos": int(round((usd - units) * 1e9))}


def gcp_skus() -> list[dict]:
    """Compute Engine SKUs of the Cloud Billing Catalog: per family a core and a RAM SKU
    (on-demand and spot) and per GPU model a GPU SKU, per region."""
    regions = sorted({z.rsplit("-", 1)[0] for z in GCP_ZONES})
    out = []

    def sku(desc, group, usage, region, usd, unit="h"):
        sid = hashlib.sha256(f"{desc}/{region}".encode()).hexdigest()[:12].upper()
        out.append({"name": f"services/6F81-5844-456A/skus/{sid}", "skuId": sid,
                    "description": f"{desc} running in {region}",
                    "category": {"serviceDisplayName": "Compute Engine",
                                 "resourceFamily": "Compute", "resourceGroup": group,
                                 "usageType": usage},
                    "serviceRegions": [region],
                    "pricingInfo": [{"pricingExpression": {
                        "usageUnit": unit, "usageUnitDescription": "hour",
                        "tieredRates": [{"startUsageAmount": 0, "unitPrice": _money(usd)}]}}],
                    "serviceProviderName": "Google"})
    for region in regions:
        f = _factor(region)
        for fam, (core, ram) in GCP_RATES.items():
            name = fam.upper()
            word = "Predefined Instance" if fam == "n1" else "Instance"
            for spot, usage, share in (("", "OnDemand", 1.0),
                                       ("Spot Preemptible ", "Preemptible", 0.3)):
                sku(f"{spot}{name} {word} Core", "CPU", usage, region, core * f * share)
                sku(f"{spot}{name} {word} Ram", "RAM", usage, region, ram * f * share,
                    "GiBy.h")
        for t, words in GCP_GPU_SKU.items():
            model = GCP_GPUS[t][0]
            for spot, usage, share in (("", "OnDemand", 1.0),
                                       ("Spot Preemptible ", "Preemptible", 0.3)):
                sku(f"{spot}{words} GPU", "GPU", usage, region,
                    GPU_RATE[model] * f * share)
    return out


# -- Azure -------------------------------------------------------------------------------------
AZURE_LOCATIONS = ("eastus", "eastus2", "westus2", "westeurope", "southeastasia")
#: (size, vCPUs, GiB, GPUs, family); the GPU model comes from the family, as Azure's SKUs
#: name none (learn.microsoft.com/azure/virtual-machines/sizes-gpu)
AZURE_SIZES = (
    [(f"Standard_D{n}s_v5", n, n * 4, 0, "standardDSv5Family") for n in (2, 4, 8, 16, 32, 64,
                                                                         96)]
    + [(f"Standard_E{n}s_v5", n, n * 8, 0, "standardESv5Family") for n in (2, 4, 8, 16, 32,
                                                                           64)]
    + [(f"Standard_F{n}s_v2", n, n * 2, 0, "standardFSv2Family") for n in (2, 4, 8, 16, 32,
                                                                           72)]
    + [("Standard_NC6s_v3", 6, 112, 1, "standardNCSv3Family"),
       ("Standard_NC12s_v3", 12, 224, 2, "standardNCSv3Family"),
       ("Standard_NC24s_v3", 24, 448, 4, "standardNCSv3Family"),
       ("Standard_ND40rs_v2", 40, 672, 8, "standardNDSv2Family"),
       ("Standard_NC4as_T4_v3", 4, 28, 1, "standardNCASv3_T4Family"),
       ("Standard_NC8as_T4_v3", 8, 56, 1, "standardNCASv3_T4Family"),
       ("Standard_NC16as_T4_v3", 16, 110, 1, "standardNCASv3_T4Family"),
       ("Standard_NC64as_T4_v3", 64, 440, 4, "standardNCASv3_T4Family"),
       ("Standard_ND96asr_v4", 96, 900, 8, "standardNDASv4_A100Family"),
       ("Standard_ND96amsr_A100_v4", 96, 1924, 8, "standardNDAMSv4_A100Family"),
       ("Standard_NC24ads_A100_v4", 24, 220, 1, "StandardNCADSA100v4Family"),
       ("Standard_NC48ads_A100_v4", 48, 440, 2, "StandardNCADSA100v4Family"),
       ("Standard_NC96ads_A100_v4", 96, 880, 4, "StandardNCADSA100v4Family"),
       ("Standard_ND96isr_H100_v5", 96, 1900, 8, "standardNDSH100v5Family")])
AZURE_FAMILY_GPU = {"standardNCSv3Family": "V100", "standardNDSv2Family": "V100-32GB",
                    "standardNCASv3_T4Family": "T4", "standardNDASv4_A100Family": "A100",
                    "standardNDAMSv4_A100Family": "A100-80GB",
                    "StandardNCADSA100v4Family": "A100-80GB",
                    "standardNDSH100v5Family": "H100"}


def azure_skus(location: str | None) -> list[dict]:
    """Resource SKUs (``Microsoft.Compute/skus``) of virtual machines, in ``location`` or
    every location of the stand-in; Standard_ND96isr_H100_v5 is not offered in
    southeastasia (a restriction, as the real API reports one)."""
    out = []
    for loc in AZURE_LOCATIONS:
        if location and loc != location.lower():
            continue
        for name, cpus, gib, gpus, family in AZURE_SIZES:
            caps = [{"name": "vCPUs", "value": str(cpus)}, {"name": "MemoryGB", "value": str(gib)},
                    {"name": "CpuArchitectureType", "value": "x64"},
                    {"name": "LowPriorityCapable", "value": "True"}]
            if gpus:
                caps.append({"name": "GPUs", "value": str(gpus)})
            restricted = name.endswith("H100_v5") and loc == "southeastasia"
            out.append({"resourceType": "virtualMachines", "name": name, "tier": "Standard",
                        "size": name.removeprefix("Standard_"), "family": family,
                        "locations": [loc],
                        "locationInfo": [{"location": loc, "zones": ["1", "2", "3"]}],
                        "capabilities": caps,
                        "restrictions": [{"type": "Location", "values": [loc],
                                          "reasonCode": "NotAvailableForSubscription"}]
                        if restricted else []})
    return out


def azure_prices() -> list[dict]:
    """Items of the Retail Prices API (prices.azure.com/api/retail/prices) for the sizes:
    Linux and Windows, on-demand, Spot and Low Priority meters (a reader keeps Linux
    on-demand and Spot)."""
    out = []
    for loc in AZURE_LOCATIONS:
        for name, cpus, gib, gpus, family in AZURE_SIZES:
            base = price(cpus, gib, AZURE_FAMILY_GPU.get(family), gpus, loc, 0.048, 0.0045)
            meter = name.removeprefix("Standard_").replace("_", " ")
            for suffix, share in (("", 1.0), (" Spot", spot_share(name, loc)),
                                  (" Low Priority", 0.2)):
                for os_, extra in (("", 0.0), (" Windows", 0.046 * cpus)):
                    out.append({"currencyCode": "USD", "tierMinimumUnits": 0.0,
                                "retailPrice": round(base * share + extra, 5),
                                "unitPrice": round(base * share + extra, 5),
                                "armRegionName": loc, "location": loc,
                                "effectiveStartDate": "2024-01-01T00:00:00Z",
                                "meterName": meter + suffix, "productName":
                                f"Virtual Machines {family.removeprefix('standard')} Series"
                                f"{os_}", "skuName": meter + suffix, "armSkuName": name,
                                "serviceName": "Virtual Machines", "serviceFamily": "Compute",
                                "unitOfMeasure": "1 Hour", "type": "Consumption",
                                "priceType": "Consumption",
                                "isPrimaryMeterRegion": True})
    return out


# -- AWS ---------------------------------------------------------------------------------------
def _moto_types() -> dict:
    from moto.ec2.models.instance_types import INSTANCE_TYPES
    return INSTANCE_TYPES


def _moto_offerings(kind: str) -> dict:
    from moto.ec2.models.instance_types import INSTANCE_TYPE_OFFERINGS
    return INSTANCE_TYPE_OFFERINGS[kind]


def aws_price(itype: str, region: str) -> float:
    """Illustrative on-demand $/h of an EC2 instance type (module docstring)."""
    t = _moto_types()[itype]
    gpus = (t.get("GpuInfo") or {}).get("Gpus") or []
    gpu = gpus[0]["Name"] if gpus else None
    if gpu in ("A100", "V100") and gpus[0].get("MemoryInfo", {}).get("SizeInMiB", 0) > 70000:
        gpu = "A100-80GB"
    count = sum(g.get("Count", 0) for g in gpus)
    arm = "arm64" in t.get("ProcessorInfo", {}).get("SupportedArchitectures", [])
    p = price(t["VCpuInfo"]["DefaultVCpus"], t["MemoryInfo"]["SizeInMiB"] / 1024, gpu, count,
              region)
    return round(p * (0.8 if arm else 1.0), 5)


@contextmanager
def aws_spot_prices():
    """moto's ``DescribeSpotPriceHistory`` answering a price per (type, zone) —
    :func:`spot_share` of :func:`aws_price` — instead of its fixed ``0.00001``."""
    from moto.core.responses import ActionResult
    from moto.ec2.responses.spot_instances import SpotInstances
    original = SpotInstances.describe_spot_price_history

    def describe(self):
        types = self._get_param("InstanceTypes", [])
        found = self.ec2_backend.describe_spot_price_history(
            types, self._filters_from_querystring())
        def usd(p):
            return aws_price(p["InstanceType"], self.region) * spot_share(p["InstanceType"],
                                                                          p["Location"])
        return ActionResult({"SpotPriceHistory": [
            {"InstanceType": p["InstanceType"], "ProductDescription": "Linux/UNIX",
             "SpotPrice": f"{usd(p):.6f}",
             "AvailabilityZone": p["Location"], "Timestamp": "2026-11-20T00:00:00.000Z"}
            for p in found if p["InstanceType"] in _moto_types()]})
    SpotInstances.describe_spot_price_history = describe
    try:
        yield
    finally:
        SpotInstances.describe_spot_price_history = original


class AwsPricingFake:
    """The AWS Price List Query API (``AWSPriceListService.GetProducts``, JSON 1.1 over
    HTTP POST) on 127.0.0.1 for the real boto3 ``pricing`` client (``endpoint_url=url``):
    one product per (instance type, region) of moto's offerings, Linux, shared tenancy, in
    the real PriceList JSON shape, 100 per page (``NextToken``). ``requests`` counts calls.
    ``close()`` stops it.
    """

    def __init__(self):
        self.requests = 0
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True

            def log_message(self, *a):
                pass

            def do_POST(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"{}")
                target = self.headers.get("X-Amz-Target", "")
                fake.requests += 1
                if target.endswith("GetProducts"):
                    code, obj = 200, fake.products(body)
                else:
                    code, obj = 400, {"__type": "InvalidParameterException",
                                      "Message": f"unknown operation {target}"}
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/x-amz-json-1.1")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def products(self, body: dict) -> dict:
        if body.get("ServiceCode") != "AmazonEC2":
            return {"PriceList": [], "FormatVersion": "aws_v1"}
        filters = {f["Field"]: f["Value"] for f in body.get("Filters", [])}
        regions = [filters["regionCode"]] if "regionCode" in filters else \
            sorted(_moto_offerings("region"))
        rows = []
        for region in regions:
            for o in _moto_offerings("region").get(region, []):
                t = o["InstanceType"]
                if t in _moto_types() and filters.get("instanceType", t) == t:
                    rows.append((t, region))
        start = int(body.get("NextToken") or 0)
        size = min(int(body.get("MaxResults") or 100), 100)
        page = rows[start:start + size]
        out = {"FormatVersion": "aws_v1", "PriceList": [self._product(t, r) for t, r in page]}
        if start + size < len(rows):
            out["NextToken"] = str(start + size)
        return out

    @staticmethod
    def _product(itype: str, region: str) -> str:
        sku = hashlib.sha256(f"{itype}/{region}".encode()).hexdigest()[:16].upper()
        t = _moto_types()[itype]
        return json.dumps({
            "product": {"productFamily": "Compute Instance", "sku": sku, "attributes": {
                "instanceType": itype, "regionCode": region, "operatingSystem": "Linux",
                "tenancy": "Shared", "preInstalledSw": "NA", "capacitystatus": "Used",
                "vcpu": str(t["VCpuInfo"]["DefaultVCpus"]),
                "memory": f"{t['MemoryInfo']['SizeInMiB'] / 1024:g} GiB"}},
            "serviceCode": "AmazonEC2",
            "terms": {"OnDemand": {f"{sku}.JRTCKXETXF": {
                "offerTermCode": "JRTCKXETXF", "sku": sku,
                "priceDimensions": {f"{sku}.JRTCKXETXF.6YS6EN2CT7": {
                    "unit": "Hrs", "description": f"${aws_price(itype, region)} per On "
                    f"Demand Linux {itype} Instance Hour",
                    "pricePerUnit": {"USD": f"{aws_price(itype, region):.10f}"}}}}}},
            "version": "20261120000000", "publicationDate": "2026-11-20T00:00:00Z"})

