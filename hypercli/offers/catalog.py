"""The catalog: every cloud's instance types (vCPUs, memory, GPUs, CPU architecture) and their
prices (on-demand per region, spot per zone), as offers the optimizer ranks.

Where a cloud's table comes from, first found wins:

1. ``$HYPER_HOME/catalog/<cloud>.csv.gz``, written by ``hyper catalog refresh`` from the
   cloud's own APIs with the user's credentials (hypercli.offers.read_aws, read_gcp,
   read_azure), with the date it was read in ``<cloud>.json``; older than
   :data:`MAX_AGE_S` it is still used, and :func:`stale` says so.
2. The snapshot shipped in the package, ``hypercli/offers/data/<cloud>.csv.gz``, taken
   2026-11-27 (``data/snapshot.json``) by ``scripts/catalog_snapshot.py``: the readers below
   run against the test stand-ins — AWS's instance types and zone offerings as moto ships
   them (Apache-2.0), GCP and Azure machine types of tests/cloudcatalog.py — so its shapes
   are real; the prices of a curated set of instance types and regions are public ones
   (skypilot-org/skypilot-catalog, Apache-2.0; rows marked ``price_source`` = ``public``,
   put in by ``scripts/public_prices.py``), the rest illustrative, not the clouds'.
   Details in ``data/NOTICE.md``.

Then ``$HYPER_HOME/catalog/custom.csv`` (same columns as below, plus ``cloud`` first) adds
rows, or replaces the row of the same (cloud, instance type, region, zone).

Columns of a table (one row per instance type and zone; ``zone`` empty where the cloud prices
per region only), as SkyPilot's catalogs (skypilot-org/skypilot-catalog ``vms.csv``):
``instance_type, vcpus, memory_gib, accelerator, accelerator_count, accelerator_memory_gib,
arch, region, zone, price, spot_price, price_source`` — prices in US dollars per node-hour,
empty when the cloud sells none (no spot capacity of that type there); ``price_source`` says
where a row's prices come from when it is not where the table comes from (``public``: the
public catalog named in ``data/NOTICE.md``), and may be absent (older tables).
"""

from __future__ import annotations

import csv
import functools
import gzip
import io
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

from hypercli.errors import UsageError
from hypercli.offers.offer import Offer
from hypercli.recipe.resources import normalise_gpu

CLOUDS = ("aws", "gcp", "azure")
COLUMNS = ("instance_type", "vcpus", "memory_gib", "accelerator", "accelerator_count",
           "accelerator_memory_gib", "arch", "region", "zone", "price", "spot_price",
           "price_source")
#: what :meth:`Catalog.price_source` calls a price from a table of each source
TABLE_PRICES = {"snapshot": "illustrative", "cache": "api", "api": "api"}
MAX_AGE_S = 7 * 24 * 3600  #: a cached table older than a week is stale (issue 23, item 1)
DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class InstanceType:
    """One instance type of a cloud.

    Attributes:
        cloud, name: ``aws``, ``p3.8xlarge``.
        vcpus: virtual CPUs; memory_gib: GiB.
        accelerator: normalised GPU model (``V100``) or None; accelerator_count: GPUs.
        accelerator_memory_gib: memory of one GPU, GiB (0 when unknown).
        arch: ``x86_64`` or ``arm64``.
    """

    cloud: str
    name: str
    vcpus: float
    memory_gib: float
    accelerator: str | None = None
    accelerator_count: int = 0
    accelerator_memory_gib: float = 0.0
    arch: str = "x86_64"


@dataclass
class Table:
    """One cloud's catalog.

    Attributes:
        cloud: ``aws``, ``gcp`` or ``azure``.
        types: instance type name → :class:`InstanceType`.
        prices: instance type name → [(region, zone or None, on-demand $/h or None,
            spot $/h or None)].
        read_at: unix time (s) the data was read from the cloud (or the snapshot taken).
        source: where it came from (``snapshot``, ``cache``, ``api``), plus ``+custom``.
        price_sources: (instance type, region, zone or None) → where that row's prices come
            from when not from ``source`` (``public``, ``custom``).
    """

    cloud: str
    types: dict = field(default_factory=dict)
    prices: dict = field(default_factory=dict)
    read_at: float = 0.0
    source: str = ""
    price_sources: dict = field(default_factory=dict)

    def add(self, row: dict, replace: bool = True) -> None:
        """Add (or, with ``replace``, replace: same type, region and zone) one row of the
        columns above. Raises ValueError for a row that does not parse."""
        name = row["instance_type"].strip()
        if not name:
            raise ValueError("instance_type is empty")
        if replace or name not in self.types:  # a table's rows of one type agree
            gpu = (row.get("accelerator") or "").strip() or None
            mem = float(row.get("accelerator_memory_gib") or 0)
            self.types[name] = InstanceType(
                self.cloud, name, float(row["vcpus"]), float(row["memory_gib"]),
                _gpu(gpu, mem * 1024 or None) if gpu else None,
                int(float(row.get("accelerator_count") or 0)), mem,
                (row.get("arch") or "x86_64").strip() or "x86_64")
        region, zone = row["region"].strip(), (row.get("zone") or "").strip() or None
        price = _price(row.get("price"))
        spot = _price(row.get("spot_price"))
        if not region:
            raise ValueError("region is empty")
        rows = self.prices.setdefault(name, [])
        self.__dict__.get("_split", {}).pop((name, True), None)
        self.__dict__.get("_split", {}).pop((name, False), None)
        self.__dict__.pop("_by_gpu", None)
        if replace:
            rows[:] = [p for p in rows if (p[0], p[1]) != (region, zone)]
            self.price_sources.pop((name, region, zone), None)
        rows.append((region, zone, price, spot))
        label = (row.get("price_source") or "").strip()
        if label:
            self.price_sources[name, region, zone] = label

    def replace_region(self, name: str, region: str, rows, source: str = "") -> None:
        """Replace every price row of instance type ``name`` in ``region`` by ``rows``
        ([(zone or None, on-demand $/h or None, spot $/h or None)]), their prices labelled
        ``source`` (``price_source``; empty: the table's own). Raises KeyError for a type the
        table lacks."""
        if name not in self.types:
            raise KeyError(name)
        old = self.prices.get(name, [])
        for r in old:
            if r[0] == region:
                self.price_sources.pop((name, region, r[1]), None)
        self.prices[name] = [r for r in old if r[0] != region] + [
            (region, zone, price, spot) for zone, price, spot in rows]
        for zone, _, _ in rows:
            if source:
                self.price_sources[name, region, zone] = source
        split = self.__dict__.get("_split", {})
        split.pop((name, True), None)
        split.pop((name, False), None)

    def offers_of_kind(self, name: str, spot: bool) -> list[Offer]:
        """The spot (or on-demand) offers of instance type ``name`` in (region, zone)
        order, made once per table (the optimizer's index: a shape that limits no region,
        zone or price takes the list as it is)."""
        index = self.__dict__.setdefault("_split", {})
        got = index.get((name, spot))
        if got is None:
            b = _base(self.types[name])
            new = _tuple
            got = index[name, spot] = [
                new(Offer, (b[0], b[1], r, z, spot, p, b[2], b[3], b[4], b[5], b[6]))
                for r, z, od, sp in sorted(self.prices.get(name, ()), key=_place)
                for p in ((sp if spot else od),) if p is not None]
        return got

    def by_gpu(self) -> dict:
        """GPU model (None for the types without GPU) → the :class:`InstanceType` values
        with it, by name, made once per table and again when ``types`` is replaced or
        added to (the optimizer's index: a GPU shape looks at the types of its model only)."""
        cached = self.__dict__.get("_by_gpu")
        if cached is None or cached[0] is not self.types:
            index: dict = {}
            for name in sorted(self.types):
                t = self.types[name]
                index.setdefault(t.accelerator if t.accelerator_count else None,
                                 []).append(t)
            cached = self.__dict__["_by_gpu"] = (self.types, index)
        return cached[1]

    def offers(self, name: str) -> list[Offer]:
        """Every offer of instance type ``name``: spot and on-demand, per zone (region)."""
        t = self.types[name]
        out = []
        for region, zone, price, spot in self.prices.get(name, ()):
            for is_spot, p in ((True, spot), (False, price)):
                if p is not None:
                    out.append(make_offer(t, region, zone, is_spot, p))
        return out

    def dicts(self):
        """The table as dicts of :data:`COLUMNS`, sorted by type, region, zone."""
        for name in sorted(self.prices):
            t = self.types[name]
            for region, zone, price, spot in sorted(self.prices[name],
                                                    key=lambda p: (p[0], p[1] or "")):
                yield {"instance_type": name, "vcpus": _num(t.vcpus),
                       "memory_gib": _num(t.memory_gib), "accelerator": t.accelerator or "",
                       "accelerator_count": t.accelerator_count or "",
                       "accelerator_memory_gib": _num(t.accelerator_memory_gib) or "",
                       "arch": t.arch, "region": region, "zone": zone or "",
                       "price": "" if price is None else f"{price:.10g}",
                       "spot_price": "" if spot is None else f"{spot:.10g}",
                       "price_source": self.price_sources.get((name, region, zone), "")}


def _extra(t: InstanceType) -> tuple:
    """GCP's attached accelerators (``n1-standard-8/nvidia-tesla-v100:1``) as Offer.extra."""
    if t.cloud == "gcp" and "/" in t.name:
        machine, _, acc = t.name.partition("/")
        kind, _, count = acc.partition(":")
        return (("accelerator_count", count), ("accelerator_type", kind),
                ("machine_type", machine))
    return ()


def make_offer(t: InstanceType, region: str, zone: str | None, spot: bool,
               price: float) -> Offer:
    """The :class:`Offer` of instance type ``t`` in ``region``/``zone`` at ``price`` ($ per
    node-hour)."""
    return Offer(t.cloud, t.name, region, zone, spot, price, t.vcpus, t.memory_gib,
                 t.accelerator, t.accelerator_count, _extra(t))


def _base(t: InstanceType) -> tuple:
    """The fields every offer of instance type ``t`` shares (:meth:`Table.offers_of_kind`):
    cloud, instance type, vCPUs, GiB, GPU model, GPU count, extra."""
    return (t.cloud, t.name, t.vcpus, t.memory_gib, t.accelerator, t.accelerator_count,
            _extra(t))


def _place(row: tuple) -> tuple:
    """The (region, zone) order of a ``Table.prices`` row (no zone first)."""
    return row[0], row[1] or ""


#: an Offer made in one ``tuple.__new__`` call (3 times faster than ``Offer(...)``; the
#: full ranked lists of a recipe hold tens of thousands)
_tuple = tuple.__new__


@functools.lru_cache(maxsize=None)
def _gpu(name: str, memory_mib: float | None) -> str:
    return normalise_gpu(name, memory_mib)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def _price(text) -> float | None:
    text = (text or "").strip() if isinstance(text, str) else text
    if text in ("", None):
        return None
    p = float(text)
    if not p >= 0 or p == float("inf"):
        raise ValueError(f"price {text!r} is not a number of dollars")
    return p


def home() -> Path:
    """``$HYPER_HOME/catalog`` (``~/.hyper/catalog``)."""
    base = os.environ.get("HYPER_HOME") or os.path.expanduser("~/.hyper")
    return Path(base) / "catalog"


def read_csv(cloud: str, data: bytes, source: str, read_at: float) -> Table:
    """A :class:`Table` from the gzipped (or plain) CSV text of one cloud's table.
    Raises ValueError naming the line that does not parse."""
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    table = Table(cloud, read_at=read_at, source=source)
    reader = csv.reader(io.StringIO(data.decode()))
    header = next(reader, [])
    col = {c: i for i, c in enumerate(header)}
    missing = [c for c in ("instance_type", "vcpus", "memory_gib", "region") if c not in col]
    if missing:
        raise ValueError(f"line 1: no column {', '.join(missing)}")
    get = [col.get(c) for c in COLUMNS]
    types, prices = table.types, table.prices
    for n, raw in enumerate(reader, start=2):
        try:  # the fast path of Table.add: a table has one row per type and zone
            row = ["" if i is None else raw[i] for i in get]
            name, region = row[0].strip(), row[7].strip()
            if not name or not region:
                raise ValueError("instance_type or region is empty")
            if name not in types:
                table.add(dict(zip(COLUMNS, row)), replace=False)
                continue
            zone = row[8].strip() or None
            prices[name].append((region, zone, _price(row[9]), _price(row[10])))
            if row[11]:
                table.price_sources[name, region, zone] = row[11].strip()
        except (IndexError, KeyError, ValueError, TypeError) as e:
            raise ValueError(f"line {n}: {e}") from None
    return table


def write(table: Table, folder: Path | None = None) -> Path:
    """Write ``table`` as ``<folder>/<cloud>.csv.gz`` and its date as ``<cloud>.json``
    (default folder :func:`home`), each replaced atomically. Returns the CSV's path."""
    folder = folder or home()
    folder.mkdir(parents=True, exist_ok=True)
    buf = io.StringIO()
    w = csv.DictWriter(buf, COLUMNS, lineterminator="\n")
    w.writeheader()
    w.writerows(table.dicts())
    path = folder / f"{table.cloud}.csv.gz"
    for target, data in ((path, gzip.compress(buf.getvalue().encode(), mtime=0)),
                         (folder / f"{table.cloud}.json",
                          json.dumps({"read_at": table.read_at, "source": table.source,
                                      "types": len(table.types)}).encode())):
        tmp = target.with_suffix(target.suffix + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return path


def _snapshot_meta() -> dict:
    try:
        return json.loads((DATA / "snapshot.json").read_text())
    except (OSError, ValueError):
        return {}


def load_table(cloud: str) -> Table:
    """One cloud's table: the cache when there is one, else the packaged snapshot (module
    docstring), without custom rows. Raises UsageError when neither can be read."""
    cached = home() / f"{cloud}.csv.gz"
    try:
        meta = json.loads((home() / f"{cloud}.json").read_text())
        return read_csv(cloud, cached.read_bytes(), "cache", float(meta.get("read_at", 0)))
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as e:
        raise UsageError(f"the cached catalog {cached} cannot be read ({e})",
                         f"run `hyper catalog refresh --cloud {cloud}` or delete it") from None
    try:
        data = (DATA / f"{cloud}.csv.gz").read_bytes()
    except OSError as e:
        raise UsageError(f"no catalog of {cloud}: {e}",
                         f"run `hyper catalog refresh --cloud {cloud}`") from None
    return read_csv(cloud, data, "snapshot", float(_snapshot_meta().get("taken_at", 0)))


def add_custom(tables: dict) -> None:
    """Add the rows of ``$HYPER_HOME/catalog/custom.csv`` (columns ``cloud`` and
    :data:`COLUMNS`) to ``tables`` (cloud → Table), replacing rows of the same type, region
    and zone. Raises UsageError naming the line that does not parse."""
    path = home() / "custom.csv"
    try:
        text = path.read_text()
    except FileNotFoundError:
        return
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e}") from None
    reader = csv.DictReader(io.StringIO(text))
    missing = [c for c in ("cloud", "instance_type", "vcpus", "memory_gib", "region")
               if c not in (reader.fieldnames or ())]
    if missing:
        raise UsageError(f"{path}: no column {', '.join(missing)}",
                         f"the first line names the columns: cloud,{','.join(COLUMNS)}")
    for n, row in enumerate(reader, start=2):
        cloud = (row.get("cloud") or "").strip()
        if cloud not in CLOUDS:
            raise UsageError(f"{path}:{n}: cloud must be one of {', '.join(CLOUDS)}, "
                             f"not {cloud!r}")
        table = tables.get(cloud)
        if table is None:
            continue  # a cloud not asked for
        try:
            table.add({**row, "price_source": (row.get("price_source") or "").strip()
                       or "custom"})
        except (KeyError, ValueError, TypeError) as e:
            raise UsageError(f"{path}:{n}: {e}",
                             "prices are dollars per node-hour; leave a column empty "
                             "when there is none") from None
        if "+custom" not in table.source:
            table.source += "+custom"


class Catalog:
    """The tables of some clouds, with the user's custom rows.

    Args:
        clouds: the clouds to load (default all of :data:`CLOUDS`).
        tables: ready tables (cloud → :class:`Table`) instead of loading (tests, bench).
    Raises:
        UsageError: a table or the custom file cannot be read.
    """

    def __init__(self, clouds=None, tables: dict | None = None):
        if tables is None:
            tables = {c: load_table(c) for c in (clouds or CLOUDS)}
            add_custom(tables)
        self.tables = tables

    def types(self):
        """Every :class:`InstanceType` of every loaded cloud."""
        for table in self.tables.values():
            yield from table.types.values()

    def offers_of(self, t: InstanceType) -> list[Offer]:
        """Every offer of one instance type."""
        return self.tables[t.cloud].offers(t.name)

    def price_source(self, offer: Offer) -> str:
        """Where ``offer``'s price comes from: ``public`` (the public catalog of
        ``data/NOTICE.md``, in the shipped snapshot), ``illustrative`` (the rest of the shipped
        snapshot: not the clouds' prices), ``api`` (read by ``hyper catalog refresh``) or
        ``custom`` (``$HYPER_HOME/catalog/custom.csv``)."""
        table = self.tables[offer.cloud]
        name, region, zone = offer.instance_type, offer.region, offer.zone
        if zone and not any(r[:2] == (region, zone) for r in table.prices.get(name, ())):
            zone = None  # a region-wide row offered in a zone (optimizer._in_zones)
        label = table.price_sources.get((name, region, zone))
        if label:
            return label
        base = table.source.split("+")[0]
        return TABLE_PRICES.get(base, base or "unknown")

    def stale(self, now: float | None = None) -> list[str]:
        """The clouds whose table was read more than :data:`MAX_AGE_S` ago."""
        now = time.time() if now is None else now
        return [c for c, t in self.tables.items() if now - t.read_at > MAX_AGE_S]

    def gpu_names(self) -> list[str]:
        """Every GPU model in the loaded tables, sorted."""
        return sorted({t.accelerator for t in self.types() if t.accelerator})
