"""GCP's catalog read from its APIs with the user's credentials: machine types and accelerator
types of every zone (Compute Engine ``machineTypes`` and ``acceleratorTypes`` aggregated
lists) and prices from the Cloud Billing Catalog's Compute Engine SKUs (per region: a vCPU and
a GiB of RAM per machine family, a GPU per model; on-demand and spot). A machine's price is
vCPUs × core price + GiB × RAM price + GPUs × GPU price of its family and region, as SkyPilot's
GCP fetcher computes it (skypilot-org/skypilot ``sky/catalog/data_fetchers/fetch_gcp.py``).

Instance types with GPUs are the accelerator-optimized machines (a2, a3, g2: the GPUs come
with the machine) and N1 machines with GPUs attached, named ``<machine type>/<accelerator
type>:<count>`` (``n1-standard-8/nvidia-tesla-v100:1``); N1 takes at most the vCPUs per GPU
count of :data:`N1_GPU_VCPUS` (cloud.google.com/compute/docs/gpus, "N1 general-purpose
machine type").

Test seam: ``HYPER_GCP_ENDPOINT`` serves both APIs (hypercli.providers.gcp).
"""

from __future__ import annotations

import re
import time

from hypercli.offers.catalog import Table
from hypercli.recipe.resources import normalise_gpu

BILLING = "https://cloudbilling.googleapis.com"
COMPUTE_SERVICE = "6F81-5844-456A"  #: Compute Engine's service id in the Billing Catalog
#: attachable GPU → {count: most vCPUs of the N1 machine}
N1_GPU_VCPUS = {"nvidia-tesla-k80": {1: 8, 2: 16, 4: 32, 8: 64},
                "nvidia-tesla-p100": {1: 16, 2: 32, 4: 96},
                "nvidia-tesla-v100": {1: 12, 2: 24, 4: 48, 8: 96},
                "nvidia-tesla-t4": {1: 48, 2: 48, 4: 96},
                "nvidia-tesla-p4": {1: 24, 2: 48, 4: 96}}
_CORE = re.compile(r"^(Spot Preemptible )?(\w+) (?:Predefined )?Instance (Core|Ram) running in")
_GPU = re.compile(r"^(Spot Preemptible )?Nvidia (.+?) GPU running in")


def _usd(sku: dict) -> float | None:
    for info in sku.get("pricingInfo", [])[:1]:
        rates = info.get("pricingExpression", {}).get("tieredRates", [])
        if rates:
            p = rates[-1].get("unitPrice", {})
            return int(p.get("units") or 0) + int(p.get("nanos") or 0) / 1e9
    return None


def _skus(api) -> dict:
    """{(region, "core"|"ram"|gpu model, family or "", spot): $/h} from the SKUs."""
    out: dict = {}
    token = ""
    while True:
        url = f"{api._base(BILLING)}/v1/services/{COMPUTE_SERVICE}/skus?currencyCode=USD"
        page = api._rest("GET", url + (f"&pageToken={token}" if token else ""),
                         "reading the Compute Engine prices")
        for sku in page.get("skus", []):
            desc, usd = sku.get("description", ""), _usd(sku)
            if usd is None:
                continue
            if m := _CORE.match(desc):
                key = (m[3].lower(), m[2].lower(), bool(m[1]))
            elif m := _GPU.match(desc):
                key = (normalise_gpu(m[2]), "", bool(m[1]))
            else:
                continue
            for region in sku.get("serviceRegions", []):
                out[(region, *key)] = usd
        token = page.get("nextPageToken") or ""
        if not token:
            return out


def _price(prices: dict, region: str, family: str, vcpus: float, gib: float,
           gpu: str | None, count: int, spot: bool) -> float | None:
    core = prices.get((region, "core", family, spot))
    ram = prices.get((region, "ram", family, spot))
    if core is None or ram is None:
        return None
    p = vcpus * core + gib * ram
    if gpu:
        g = prices.get((region, gpu, "", spot))
        if g is None:
            return None
        p += count * g
    return round(p, 6)


def read(project: str | None = None, credentials=None) -> Table:
    """GCP's table (hypercli.offers.catalog) of every zone of ``project``.

    Raises:
        CredentialsError, CloudError (hypercli.providers.gcp).
    """
    from google.cloud import compute_v1

    from hypercli.providers.gcp import GCPAPI, _calls
    api = GCPAPI(project, "", credentials)
    table = Table("gcp", read_at=time.time(), source="api")
    with _calls("listing the machine types"):
        machines = [(zone.rsplit("/", 1)[-1], m) for zone, scoped in
                    api._client(compute_v1.MachineTypesClient).aggregated_list(
                        project=api.project) for m in scoped.machine_types]
        gpus = {}
        for zone, scoped in api._client(compute_v1.AcceleratorTypesClient).aggregated_list(
                project=api.project):
            for a in scoped.accelerator_types:
                gpus.setdefault(zone.rsplit("/", 1)[-1], {})[a.name] = \
                    a.maximum_cards_per_instance
    prices = _skus(api)
    for zone, m in machines:
        region, family = zone.rsplit("-", 1)[0], m.name.split("-")[0]
        gib = m.memory_mb / 1024
        shapes = []
        if m.accelerators:
            acc = m.accelerators[0]
            shapes.append((m.name, acc.guest_accelerator_type, acc.guest_accelerator_count))
        else:
            shapes.append((m.name, None, 0))
            if family == "n1":
                for acc, limits in N1_GPU_VCPUS.items():
                    most = gpus.get(zone, {}).get(acc, 0)
                    shapes += [(f"{m.name}/{acc}:{n}", acc, n) for n, cpus in limits.items()
                               if n <= most and m.guest_cpus <= cpus]
        for name, acc, count in shapes:
            gpu = normalise_gpu(acc) if acc else None
            on_demand = _price(prices, region, family, m.guest_cpus, gib, gpu, count, False)
            spot = _price(prices, region, family, m.guest_cpus, gib, gpu, count, True)
            if on_demand is None and spot is None:
                continue
            table.add({"instance_type": name, "vcpus": m.guest_cpus, "memory_gib": gib,
                       "accelerator": gpu or "", "accelerator_count": count,
                       "arch": "arm64" if family in ("t2a", "c4a") else "x86_64",
                       "region": region, "zone": zone,
                       "price": "" if on_demand is None else on_demand,
                       "spot_price": "" if spot is None else spot})
    return table
