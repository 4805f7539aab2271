"""Put the public prices of ``hypercli/offers/data/public_prices.csv`` into the catalog
snapshot shipped in the package (``hypercli/offers/data/<cloud>.csv.gz``), in place of the
illustrative prices of those instance types and regions; ``data/NOTICE.md`` says which rows.

``public_prices.csv`` holds rows transcribed as they are from the public catalog
skypilot-org/skypilot-catalog (Apache-2.0; the file and commit on every row, with the date
it was read), in its own terms:

* AWS (``catalogs/v7/aws/vms.csv``): one row per instance type and availability-zone ID
  (``use1-az2``). A zone ID names a different zone name (``us-east-1a``) in each account, so
  a type's prices become one row per region with no zone: its on-demand price (the same in
  every zone) and, as spot price, the lowest of its zone IDs' spot prices (the price
  SkyPilot's optimizer also takes for a region); EC2 then picks the zone at launch.
* GCP (``catalogs/v7/gcp/vms.csv``): machine rows (no GPU) and GPU rows (no instance type;
  the GPU model and count). A machine with GPUs costs the sum of the two, zone by zone:
  ``n1-standard-8/nvidia-tesla-v100:4`` is ``n1-standard-8`` plus ``V100`` × 4,
  ``a2-highgpu-1g`` plus ``A100`` × 1, ``g2-standard-4`` plus ``L4`` × 1. A type's rows in a
  region become those of the zones both the public rows and the snapshot list.
* Azure (``catalogs/v6/azure/vms.csv``, the only Azure table of that catalog to be had
  here, an older version; US regions only): one row per size and region, as the snapshot's.

Only instance types and regions the snapshot already has are changed (their shapes stay
as the snapshot's readers found them), except AWS types the snapshot lacks altogether (moto
has no P3 types): those are added with the shape of the public rows (vCPUs, GiB, GPU model,
count and memory). The rest keep their illustrative prices. Running it again changes
nothing.

    .venv/bin/python scripts/public_prices.py
"""

from __future__ import annotations

import csv
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

CSV = ROOT / "hypercli" / "offers" / "data" / "public_prices.csv"
LABEL = "public"  #: the price_source of the rows this script writes
#: GCP attachable GPU (the snapshot's instance type names) → the public catalog's GPU name
GCP_ATTACHED = {"nvidia-tesla-v100": "V100", "nvidia-tesla-t4": "T4"}
#: GCP machine types that come with their GPUs → (GPU name, count) of the public catalog
GCP_BUILT_IN = {"a2-highgpu-1g": ("A100", 1), "g2-standard-4": ("L4", 1)}


def load(path: Path = CSV) -> list[dict]:
    """The rows of ``public_prices.csv`` as dicts of its header's columns."""
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def _usd(text: str) -> float | None:
    text = (text or "").strip()
    return float(text) if text else None


def _aws(table, rows: list[dict]) -> list[tuple]:
    by_region: dict = defaultdict(list)
    for r in rows:
        by_region[r["instance_type"], r["region"]].append(r)
    done = []
    new = {name for name, _ in by_region if name not in table.types}
    for (name, region), got in sorted(by_region.items()):
        if name in new:  # a type moto lacks: its shape from the public rows
            r = got[0]
            table.add({"instance_type": name, "vcpus": r["vcpus"], "memory_gib": r["memory_gib"],
                       "accelerator": r["accelerator"],
                       "accelerator_count": r["accelerator_count"],
                       "accelerator_memory_gib": float(r["accelerator_memory_mib"] or 0) / 1024,
                       "arch": "x86_64", "region": region, "zone": "", "price": "",
                       "spot_price": ""})
        if not any(p[0] == region for p in table.prices.get(name, ())):
            print(f"aws {name} {region}: not in the snapshot, left out", file=sys.stderr)
            continue
        on_demand = {_usd(r["price"]) for r in got}
        if len(on_demand) != 1:
            raise ValueError(f"aws {name} {region}: on-demand prices differ by zone: "
                             f"{sorted(on_demand, key=str)}")
        spots = [s for s in (_usd(r["spot_price"]) for r in got) if s is not None]
        table.replace_region(name, region, [(None, on_demand.pop(),
                                             min(spots) if spots else None)], LABEL)
        done.append((name, region))
    return done


def _gcp(table, rows: list[dict]) -> list[tuple]:
    machines, gpus = {}, {}
    for r in rows:
        prices = (_usd(r["price"]), _usd(r["spot_price"]))
        if r["instance_type"]:
            machines[r["instance_type"], r["region"], r["zone"]] = prices
        else:
            gpus[r["accelerator"], int(float(r["accelerator_count"])), r["region"],
                 r["zone"]] = prices
    regions = sorted({(m, region) for m, region, _ in machines})
    done = []
    for name in sorted(table.types):
        machine, _, attached = name.partition("/")
        gpu = None
        if attached:
            kind, _, count = attached.partition(":")
            if kind not in GCP_ATTACHED:
                continue
            gpu = (GCP_ATTACHED[kind], int(count))
        elif machine in GCP_BUILT_IN:
            gpu = GCP_BUILT_IN[machine]
        for m, region in regions:
            if m != machine:
                continue
            have = {p[1] for p in table.prices.get(name, ()) if p[0] == region}
            out = []
            for zone in sorted(have):
                base = machines.get((machine, region, zone))
                extra = (0.0, 0.0) if gpu is None else gpus.get((*gpu, region, zone))
                if base is None or extra is None:
                    continue
                od = None if None in (base[0], extra[0]) else round(base[0] + extra[0], 6)
                spot = None if None in (base[1], extra[1]) else round(base[1] + extra[1], 6)
                out.append((zone, od, spot))
            if out:
                table.replace_region(name, region, out, LABEL)
                done.append((name, region))
    return done


def _azure(table, rows: list[dict]) -> list[tuple]:
    done = []
    for r in sorted(rows, key=lambda r: (r["instance_type"], r["region"])):
        name, region = r["instance_type"], r["region"]
        if not any(p[0] == region for p in table.prices.get(name, ())):
            print(f"azure {name} {region}: not in the snapshot, left out", file=sys.stderr)
            continue
        table.replace_region(name, region, [(None, _usd(r["price"]), _usd(r["spot_price"]))],
                             LABEL)
        done.append((name, region))
    return done


def apply(tables: dict, rows: list[dict]) -> dict:
    """Put ``rows`` (:func:`load`) into ``tables`` (cloud → hypercli.offers.catalog.Table).
    Returns cloud → [(instance type, region)] changed. Raises ValueError for rows that
    disagree (an AWS type with two on-demand prices in one region)."""
    out = {}
    for cloud, fn in (("aws", _aws), ("gcp", _gcp), ("azure", _azure)):
        mine = [r for r in rows if r["cloud"] == cloud]
        if cloud in tables and mine:
            out[cloud] = fn(tables[cloud], mine)
    return out


def provenance(rows: list[dict]) -> dict:
    """What ``snapshot.json`` says of the public prices: source files, commits, dates."""
    files = sorted({(r["source"], r["commit"], r["read_on"]) for r in rows})
    return {"licence": "Apache-2.0", "rows": len(rows), "label": LABEL,
            "files": [{"source": s, "commit": c, "read_on": d} for s, c, d in files]}


def main() -> None:
    from hypercli.offers import catalog
    meta_path = catalog.DATA / "snapshot.json"
    meta = json.loads(meta_path.read_text())
    tables = {c: catalog.read_csv(c, (catalog.DATA / f"{c}.csv.gz").read_bytes(), "snapshot",
                                  meta["taken_at"]) for c in ("aws", "gcp", "azure")}
    rows = load()
    done = apply(tables, rows)
    for cloud, table in tables.items():
        path = catalog.write(table, catalog.DATA)
        (catalog.DATA / f"{cloud}.json").unlink()  # the snapshot's date is in snapshot.json
        meta["tables"][cloud].update(rows=sum(len(v) for v in table.prices.values()),
                                     bytes=path.stat().st_size)
    meta["prices"] = ("public for the rows marked price_source=public (public_prices.csv), "
                      "illustrative (tests/cloudcatalog.py) for the rest")
    meta["public_prices"] = provenance(rows)
    meta_path.write_text(json.dumps(meta, indent=2) + "\n")
    print(json.dumps({c: len(v) for c, v in done.items()}))


if __name__ == "__main__":
    main()
