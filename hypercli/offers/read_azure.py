"""Azure's catalog read from its APIs: the virtual machine sizes of a subscription (Resource
SKUs, ``Microsoft.Compute/skus``: vCPUs, memory, GPUs, architecture, the locations where the
subscription may use them) and their prices per region from the public Retail Prices API
(prices.azure.com: Linux, consumption, the plain and the ``Spot`` meters; Windows and
``Low Priority`` meters left out), as SkyPilot's Azure fetcher reads them
(skypilot-org/skypilot ``sky/catalog/data_fetchers/fetch_azure.py``). Azure prices per region,
so offers have no zone.

Azure's SKUs do not name the GPU model; it comes from the size family (:data:`FAMILY_GPU`,
learn.microsoft.com/azure/virtual-machines/sizes-gpu).

Test seams: ``HYPER_AZURE_ENDPOINT``/``HYPER_AZURE_CA_BUNDLE``/``HYPER_AZURE_TOKEN``
(hypercli.providers.azure) and ``HYPER_AZURE_PRICES_ENDPOINT`` for the Retail Prices API.
"""

from __future__ import annotations

import json
import os
import ssl
import time
import urllib.parse
import urllib.request

from hypercli.offers.catalog import Table

PRICES = "https://prices.azure.com"
PRICES_ENV = "HYPER_AZURE_PRICES_ENDPOINT"
FAMILY_GPU = {"standardncsv3family": "V100", "standardndsv2family": "V100-32GB",
              "standardncasv3_t4family": "T4", "standardndasv4_a100family": "A100",
              "standardndamsv4_a100family": "A100-80GB",
              "standardncadsa100v4family": "A100-80GB", "standardndsh100v5family": "H100",
              "standardncadsh100v5family": "H100", "standardncsv2family": "P100",
              "standardndsfamily": "P40", "standardncfamily": "K80",
              "standardnvsv3family": "M60", "standardnvadsa10v5family": "A10",
              "standardnvfamily": "M60"}


def _restricted(r) -> list:
    """The locations of a SKU restriction (``values``, which the SDK's models also have as
    the dict method of that name)."""
    v = r.as_dict().get("values") if hasattr(r, "as_dict") else r["values"]
    return list(v or [])


def _cap(sku, name: str, default: str = "") -> str:
    for c in sku.capabilities or []:
        if c.name == name:
            return c.value
    return default


def _prices(region: str) -> dict:
    """armSkuName → {"price": $/h, "spot": $/h} in ``region`` (Linux, consumption).
    Raises CloudError when the API cannot be read."""
    from hypercli.providers.cloud import CloudError
    base = (os.environ.get(PRICES_ENV) or PRICES).rstrip("/")
    flt = (f"serviceName eq 'Virtual Machines' and priceType eq 'Consumption' and "
           f"armRegionName eq '{region}'")
    url = f"{base}/api/retail/prices?" + urllib.parse.urlencode({"$filter": flt})
    ctx = ssl.create_default_context(cafile=os.environ.get("HYPER_AZURE_CA_BUNDLE") or None)
    out: dict = {}
    while url:
        try:
            with urllib.request.urlopen(url, timeout=60, context=ctx) as r:
                page = json.load(r)
        except (OSError, ValueError) as e:
            raise CloudError(f"reading Azure's retail prices of {region}: {e}",
                             "check the network (prices.azure.com)") from None
        for item in page.get("Items", []):
            if "Windows" in item.get("productName", "") or \
                    "Low Priority" in item.get("skuName", ""):
                continue
            kind = "spot" if item.get("skuName", "").endswith(" Spot") else "price"
            out.setdefault(item["armSkuName"], {})[kind] = float(item["retailPrice"])
        url = page.get("NextPageLink")
    return out


def read(subscription_id: str | None = None, regions: list[str] | None = None,
         credential=None) -> Table:
    """Azure's table (hypercli.offers.catalog) for ``regions`` (default: every location
    where the subscription has sizes).

    Raises:
        CredentialsError, CloudError (hypercli.providers.azure).
    """
    from azure.mgmt.compute import ComputeManagementClient

    from hypercli.providers.azure import AzureAPI, _calls
    api = AzureAPI(subscription_id, "", credential)
    table = Table("azure", read_at=time.time(), source="api")
    sizes: dict = {}
    with _calls("listing the virtual machine sizes"):
        flt = f"location eq '{regions[0]}'" if regions and len(regions) == 1 else None
        for sku in api._client(ComputeManagementClient).resource_skus.list(filter=flt):
            if sku.resource_type != "virtualMachines":
                continue
            blocked = {v.lower() for r in sku.restrictions or [] if r.type == "Location"
                       for v in _restricted(r)}
            for loc in sku.locations or []:
                if loc.lower() not in blocked and (not regions or loc in regions):
                    sizes.setdefault(loc, []).append(sku)
    for region in sorted(sizes):
        prices = _prices(region)
        for sku in sizes[region]:
            p = prices.get(sku.name, {})
            if not p:
                continue
            gpus = int(float(_cap(sku, "GPUs", "0")))
            table.add({"instance_type": sku.name, "vcpus": _cap(sku, "vCPUs", "0"),
                       "memory_gib": _cap(sku, "MemoryGB", "0"),
                       "accelerator": FAMILY_GPU.get((sku.family or "").lower(), "GPU")
                       if gpus else "", "accelerator_count": gpus,
                       "arch": "arm64" if _cap(sku, "CpuArchitectureType") == "Arm64"
                       else "x86_64", "region": region, "zone": "",
                       "price": p.get("price", ""), "spot_price": p.get("spot", "")})
    return table
