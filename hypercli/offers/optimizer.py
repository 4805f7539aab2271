"""The optimizer: for what an experiment says it needs (a :class:`Shape`), every offer of the
catalog that satisfies it, cheapest first; the offer a cloud cluster with no ``instance_type``
is launched on. (``hyper plan``'s choice per experiment and estimate: hypercli.offers.estimate.)

Ranking (as SkyPilot's optimizer does for one task, skypilot-org/skypilot ``sky/optimizer.py``,
cost objective): an offer satisfies a shape when its instance type has the CPU architecture
asked (x86_64 unless said otherwise: an arm64 instance would not boot an x86_64 image), the
GPU model asked for (normalised names, :func:`hypercli.recipe.resources.normalise_gpu`) with at least that
many GPUs (no GPU when none is asked), at least the vCPUs and memory asked, is the instance
type named when one is, lies in the allowed clouds, regions and zones, and costs at most
``max_price``. Offers are sorted by price per node-hour, then cloud, instance type, region
and zone so that the order is stable (a stable sort by price of the offers listed in that
order: no key tuple is made per offer); with ``spot: auto`` every spot offer comes before
every on-demand one. A gang of N nodes needs N instances of one offer in one region; its
price is N times the offer's.
"""

from __future__ import annotations

import heapq
import math
import operator
from dataclasses import dataclass

from hypercli.errors import UsageError
from hypercli.offers.catalog import CLOUDS, Catalog, InstanceType
from hypercli.offers.offer import Offer
from hypercli.recipe.resources import gpu_name, normalise_gpu

GIB = 2**30


class NoOffer(UsageError):
    """No offer of the catalog satisfies a shape (exit 2); the message names the nearest.

    Attributes:
        nearest: up to 3 offers closest to the shape, cheapest first.
    """

    def __init__(self, message: str, hint: str | None, nearest: list[Offer]):
        super().__init__(message, hint)
        self.nearest = nearest


@dataclass(frozen=True)
class Shape:
    """What one node must have.

    Attributes:
        accelerator: GPU model (``V100``) or None; accelerator_count: GPUs per node.
        cpus: vCPUs at least; memory_gib: GiB at least.
        instance_type: this instance type only, or None.
        spot: True (spot only), False (on-demand only) or ``"auto"`` (spot, then on-demand).
        nodes: instances in one region (a gang's ``nodes:``).
        arch: CPU architecture, ``x86_64`` (the node images hypercli bakes, and most
            container images) or ``arm64``.
    """

    accelerator: str | None = None
    accelerator_count: int = 0
    cpus: float = 0
    memory_gib: float = 0
    instance_type: str | None = None
    spot: bool | str = True
    nodes: int = 1
    arch: str = "x86_64"

    def describe(self) -> str:
        """``V100:4, 8+ vCPUs, 32+ GiB, spot`` (what was asked, for messages)."""
        parts = []
        if self.instance_type:
            parts.append(self.instance_type)
        if self.accelerator:
            parts.append(f"{self.accelerator}:{self.accelerator_count}")
        if self.cpus:
            parts.append(f"{self.cpus:g}+ vCPUs")
        if self.memory_gib:
            parts.append(f"{self.memory_gib:.3g}+ GiB")
        parts.append({True: "spot", False: "on-demand"}.get(self.spot, "spot or on-demand"))
        if self.nodes > 1:
            parts.append(f"{self.nodes} nodes")
        return ", ".join(parts)


def parse_shape(text: str, spot: bool | str = "auto") -> Shape:
    """``V100:4``, ``A100-80GB``, ``T4:1`` or an instance type (``p3.8xlarge``) as a
    :class:`Shape`, for ``hyper offers``. Raises UsageError for an empty text."""
    text = text.strip()
    if not text:
        raise UsageError("say which GPU (V100:4) or instance type to list offers of")
    name, _, count = text.partition(":")
    if count and not count.isdigit():
        raise UsageError(f"{text!r}: the count after ':' must be a whole number",
                         "for example V100:4")
    known = gpu_name(name)
    if known is None and not count:
        return Shape(instance_type=name, spot=spot)
    return Shape(accelerator=known or normalise_gpu(name),
                 accelerator_count=int(count or 1), spot=spot)


def shape_of(resources: dict, options: dict | None = None) -> Shape:
    """The :class:`Shape` of one experiment: its ``resources`` (``Resources.as_dict()``)
    with the cluster's ``instance_type`` and ``spot`` (``options``) where it says nothing."""
    o = options or {}
    gpus = int(resources.get("gpus") or 0)
    gpu = resources.get("gpu_type")
    return Shape(accelerator=normalise_gpu(gpu) if gpu and gpus else None,
                 accelerator_count=gpus,
                 cpus=float(resources.get("cpus") or 0),
                 memory_gib=(resources.get("memory") or 0) / GIB,
                 instance_type=resources.get("instance_type") or o.get("instance_type"),
                 spot=resources.get("spot") if resources.get("spot") is not None
                 else o.get("spot", True),
                 nodes=int(resources.get("nodes") or 1),
                 arch=resources.get("arch") or "x86_64")


def _fits(t: InstanceType, shape: Shape) -> bool:
    if shape.instance_type is not None:
        return t.name == shape.instance_type
    if t.arch != shape.arch:
        return False
    if shape.accelerator_count:
        if shape.accelerator and t.accelerator != shape.accelerator:
            return False
        if t.accelerator_count < shape.accelerator_count:
            return False
    elif t.accelerator_count:
        return False
    return t.vcpus >= shape.cpus and t.memory_gib >= shape.memory_gib - 1e-9


def _key(o: Offer):
    """The order of offers (module docstring): price, cloud, instance type, region, zone."""
    return (o.price, o.cloud, o.instance_type, o.region, o.zone or "")


def _in_zones(o: Offer, zones: set) -> list[Offer]:
    """A region-wide offer (no zone: the catalog prices that region as a whole, as the
    public AWS prices of the shipped snapshot) where ``zones`` are allowed: the offer
    itself when they name its region, else one offer per allowed zone of its region, so a
    launch stays in the zones the cluster allows; none when no allowed zone is there."""
    if o.region in zones:
        return [o]
    return [o._replace(zone=z) for z in sorted(zones) if z.startswith(o.region)]


def ranked_offers(shape: Shape, catalog: Catalog | None = None, *, clouds=None, regions=None,
                  zones=None, max_price: float | None = None,
                  limit: int | None = None) -> list[Offer]:
    """Every offer that satisfies ``shape``, cheapest first (module docstring).

    Args:
        shape: what one node needs.
        catalog: the catalog (default: loaded for ``clouds``, :class:`Catalog`).
        clouds, regions, zones: lists of names to allow (None or empty: any).
        max_price: highest price per node-hour, US dollars, or None.
        limit: at most this many offers (the first ones), or None for all.
    Returns:
        the offers, price per node-hour ascending (with ``spot="auto"``, spot offers first);
        ties by cloud, instance type, region, zone; empty when none satisfies. Prices are
        per node: a gang pays ``shape.nodes`` times.
    Raises:
        UsageError: the catalog cannot be read.
    """
    catalog = catalog or Catalog([c for c in CLOUDS if not clouds or c in clouds])
    clouds, regions, zones = set(clouds or ()), set(regions or ()), set(zones or ())
    want_spot = shape.spot is True or shape.spot == "auto"
    want_od = shape.spot is False or shape.spot == "auto"
    cap = math.inf if max_price is None else max_price
    plain = not regions and not zones and cap == math.inf  # every offer of a type counts
    spot: list = []
    od: list = []
    for cloud in sorted(catalog.tables):  # cloud, then type, then region and zone ...
        if clouds and cloud not in clouds:
            continue
        table = catalog.tables[cloud]
        for t in _candidates(table, shape):
            if not _fits(t, shape):
                continue
            for want, is_spot, into in ((want_spot, True, spot), (want_od, False, od)):
                if not want:
                    continue
                offers = table.offers_of_kind(t.name, is_spot)
                if plain:
                    into += offers
                    continue
                for o in offers:
                    if o[5] > cap or (regions and o[2] not in regions):
                        continue
                    if zones and o[3] is None:  # region-wide: in the allowed zones only
                        into += _in_zones(o, zones)
                        continue
                    if zones and o[3] not in zones:
                        continue
                    into.append(o)
    out: list = []
    for offers in (spot, od):  # ... then a stable sort by price puts the price first
        if limit is not None and limit < len(offers) // 8:
            offers = heapq.nsmallest(limit, offers, key=_PRICE)  # as sorted()[:limit]
        else:
            offers.sort(key=_PRICE)
        out += offers if limit is None else offers[:limit - len(out)]
    return out


_PRICE = operator.itemgetter(5)  #: an Offer's price


def _candidates(table, shape: Shape):
    """The instance types of ``table`` that may fit ``shape``, by the table's GPU index:
    the one named, those of the GPU model asked (of any model when none is named), or
    those without GPU."""
    if shape.instance_type is not None:
        t = table.types.get(shape.instance_type)
        return [t] if t is not None else []
    index = table.by_gpu()
    if not shape.accelerator_count:
        return index.get(None, ())
    if shape.accelerator:
        return index.get(shape.accelerator, ())
    return [t for gpu, types in index.items() if gpu is not None for t in types]


def _distance(t: InstanceType, shape: Shape) -> float:
    """How far an instance type is from a shape: 0 when it fits; a missing or other GPU
    model counts most, then the share of GPUs, vCPUs and memory missing."""
    d = 0.0
    if shape.instance_type:
        import difflib
        return 1 - difflib.SequenceMatcher(None, t.name, shape.instance_type).ratio()
    if shape.accelerator_count:
        if t.accelerator != shape.accelerator:
            d += 10
        d += max(0, shape.accelerator_count - t.accelerator_count) / shape.accelerator_count
    elif t.accelerator_count:
        d += 10
    if shape.cpus:
        d += max(0.0, shape.cpus - t.vcpus) / shape.cpus
    if shape.memory_gib:
        d += max(0.0, shape.memory_gib - t.memory_gib) / shape.memory_gib
    return d


def nearest(shape: Shape, catalog: Catalog, *, clouds=None, n: int = 3) -> list[Offer]:
    """Up to ``n`` offers of the instance types closest to ``shape`` (:func:`_distance`),
    the cheapest offer of each, closest first, of the allowed ``clouds``."""
    types = [t for t in catalog.types() if not clouds or t.cloud in clouds]
    out = []
    for t in sorted(types, key=lambda t: (_distance(t, shape), t.cloud, t.name)):
        offers = sorted(catalog.offers_of(t), key=_key)
        if offers:
            out.append(offers[0])
        if len(out) == n:
            break
    return out


def choose(shape: Shape, catalog: Catalog, *, clouds=None, regions=None, zones=None,
           max_price: float | None = None, what: str = "",
           limit: int | None = None) -> list[Offer]:
    """:func:`ranked_offers`, or NoOffer (exit 2) naming the nearest offers and, when
    offers exist outside ``regions``/``zones``/``max_price``, the cheapest of those."""
    found = ranked_offers(shape, catalog, clouds=clouds, regions=regions, zones=zones,
                          max_price=max_price, limit=limit)
    if found:
        return found
    where = f"{what}: " if what else ""
    loose = ranked_offers(shape, catalog, clouds=clouds, limit=3)
    if loose:
        limits = ", ".join(k for k, v in (("regions", regions), ("zones", zones),
                                          ("max_price", max_price)) if v)
        raise NoOffer(f"{where}no offer of {shape.describe()} within cluster {limits}; "
                      f"the cheapest outside: {loose[0].describe()}",
                      f"widen cluster {limits}", loose[:3])
    close = nearest(shape, catalog, clouds=clouds)
    gpus = ""
    if shape.accelerator and shape.accelerator not in catalog.gpu_names():
        import difflib
        match = difflib.get_close_matches(shape.accelerator, catalog.gpu_names(), n=1)
        gpus = f"; did you mean {match[0]}?" if match else ""
    names = "; ".join(o.describe() + f" ({_spec(o)})" for o in close) or "none"
    raise NoOffer(f"{where}no instance in {', '.join(clouds or CLOUDS)} has "
                  f"{shape.describe()}{gpus}; nearest: {names}",
                  "`hyper offers GPU:COUNT` lists what the catalog has", close)


def _spec(o: Offer) -> str:
    gpu = f"{o.accelerator}:{o.accelerator_count}, " if o.accelerator else ""
    return f"{gpu}{o.vcpus:g} vCPUs, {o.memory_gib:g} GiB"


def where_of(options: dict, provider: str) -> dict:
    """The ``clouds``, ``regions``, ``zones`` and ``max_price`` a cluster's options allow
    (``clouds`` default: the provider's own cloud)."""
    zone = options.get("zones") or options.get("zone")
    return {"clouds": options.get("clouds") or ([provider] if provider in CLOUDS else
                                                  list(CLOUDS)),
            "regions": options.get("regions") or ([options["region"]]
                                                   if options.get("region") else None),
            "zones": [zone] if isinstance(zone, str) else zone,
            "max_price": options.get("max_price")}


def cluster_shape(experiments, options: dict) -> Shape | None:
    """The shape one node of a cluster must have to hold any task of ``experiments``
    (``Resources.as_dict()`` dicts): the most vCPUs, memory and GPUs any asks; None when
    none says what it needs. Raises UsageError when they ask for different GPU models or
    instance types (one cluster has one instance type)."""
    shapes = [shape_of(r, options) for r in experiments
              if any(r.get(k) for k in ("gpus", "instance_type", "memory")) or
              (r.get("cpus") or 1) != 1]
    if not shapes:
        return None
    gpus = {s.accelerator for s in shapes if s.accelerator_count}
    types = {s.instance_type for s in shapes if s.instance_type}
    if len(gpus) > 1 or len(types) > 1:
        raise UsageError(f"the experiments ask for different machines "
                         f"({', '.join(sorted(map(str, gpus | types)))}): a cluster has one "
                         "instance type", "run them as recipes of their own, or set "
                         "cluster.instance_type")
    spots = {s.spot for s in shapes}
    return Shape(accelerator=next(iter(gpus), None),
                 accelerator_count=max(s.accelerator_count for s in shapes),
                 cpus=max(s.cpus for s in shapes),
                 memory_gib=max(s.memory_gib for s in shapes),
                 instance_type=next(iter(types), None),
                 spot=spots.pop() if len(spots) == 1 else "auto",
                 nodes=max(s.nodes for s in shapes))


FAILOVER_OFFERS = 16  #: most offers a launch without instance_type may fail over along


def first_offer(experiments, options: dict, provider: str,
                catalog: Catalog | None = None) -> Offer | None:
    """The offer a cloud cluster with no ``instance_type`` is launched on: the first of
    :func:`cluster_offers`; None when no experiment says what it needs."""
    found = cluster_offers(experiments, options, provider, catalog, limit=1)
    return found[0] if found else None


def cluster_offers(experiments, options: dict, provider: str,
                   catalog: Catalog | None = None,
                   limit: int = FAILOVER_OFFERS) -> list[Offer]:
    """The offers of the cluster's allowed clouds (``cluster.clouds``, default the
    provider's own) that satisfy :func:`cluster_shape`, cheapest first (spot before
    on-demand with ``spot: auto``): the cluster is launched on the first and fails over
    along the rest (:mod:`hypercli.offers.failover`).

    At most ``limit`` offers of each cloud, merged in price order, so that a cloud whose
    own offers are all cheaper does not push the next cloud out of the list: when every
    offer of the first cloud is out of capacity the launch goes on to the next cloud.
    ``cluster.region``/``zone`` limit the provider's own cloud only; ``regions``/``zones``
    every cloud. Empty when no experiment says what it needs. Raises NoOffer (exit 2) when
    nothing satisfies it; UsageError when ``cluster.clouds`` leaves out the provider."""
    shape = cluster_shape(experiments, options)
    if shape is None:
        return []
    where = where_of(options, provider)
    if provider not in where["clouds"]:
        raise UsageError(f"cluster.clouds ({', '.join(where['clouds'])}) does not include "
                         f"the provider {provider}", f"add {provider} to cluster.clouds")
    catalog = catalog or Catalog(where["clouds"])
    clouds = [c for c in where["clouds"] if c in catalog.tables]
    found: list[Offer] = []
    for cloud in clouds:
        w = {**where, "clouds": [cloud]}
        if cloud != provider:  # cluster.region and zone are places of the provider's cloud
            w["regions"] = options.get("regions")
            w["zones"] = options.get("zones")
        found += ranked_offers(shape, catalog, limit=limit, **w)
    if not found:  # NoOffer naming the nearest, across the allowed clouds
        return choose(shape, catalog, what=f"cluster ({', '.join(clouds)})", limit=limit,
                      **{**where, "clouds": clouds})
    auto = shape.spot == "auto"
    found.sort(key=lambda o: ((not o.spot) if auto else False, *_key(o)))
    return found


def with_first_offer(recipe, state=None):
    """``recipe`` with its cloud cluster's ``instance_type``, ``region``, ``zone`` and
    ``spot`` set from the first of :func:`cluster_offers`, and ``offers`` (the whole
    ranked list, as dicts, which the launch fails over along), when it names no instance type and its
    experiments say what they need (and ``disk_gb``, GiB, the largest they ask, when the
    cluster sets none); unchanged otherwise. A cluster already up (in
    ``state``) keeps the instance type (and provider) it was launched with.

    With ``cluster.clouds`` naming several clouds the list spans them, in price order; the
    options above are those of the cheapest offer on the provider's own cloud (the place
    whose API and ``image`` the recipe gives), and when that cloud has none, of the first
    offer, whose cloud then becomes the cluster's provider (without the recipe's
    ``region``, ``zone`` and ``image``, which are of another cloud).

    GCP offers with attached GPUs (``n1-standard-8/nvidia-tesla-v100:1``) are left out:
    the gcp provider launches machine types without attached accelerators.

    Raises:
        NoOffer: nothing satisfies the experiments (exit 2). UsageError: they ask for
            different GPU models, or ``cluster.clouds`` leaves out the provider.
    """
    import dataclasses
    spec = recipe.cluster
    o = spec.options
    if spec.provider not in CLOUDS or o.get("instance_type"):
        return recipe
    row = state.cluster(spec.name) if state is not None else None
    if row and row.get("status") == "up":
        old = (row.get("spec") or {}).get("options") or {}
        if old.get("instance_type"):
            keep = {k: old[k] for k in ("instance_type", "region", "zone", "spot", "offers")
                    if k in old}
            return dataclasses.replace(recipe, cluster=dataclasses.replace(
                spec, provider=row.get("provider") or spec.provider, options={**o, **keep}))
    needs = [e.resources.as_dict() for e in recipe.experiments.values()]
    clouds = where_of(o, spec.provider)["clouds"]
    catalog = Catalog(clouds)
    if "gcp" in catalog.tables:  # machine types with attached GPUs are not launched
        table = catalog.tables["gcp"]
        table.types = {k: v for k, v in table.types.items() if "/" not in k}
    ranked = cluster_offers(needs, o, spec.provider, catalog)
    if not ranked:
        return recipe
    # the cluster's own place: the cheapest offer on the provider's cloud (its API, the
    # recipe's image); offers on other clouds are reached by failover in price order
    home = next((x for x in ranked if x.cloud == spec.provider), None)
    provider = spec.provider
    if home is None:  # the provider's cloud has nothing that fits: the first offer's
        home, provider = ranked[0], ranked[0].cloud
        o = {k: v for k, v in o.items() if k not in ("image", "region", "zone")}
    chosen = {"instance_type": home.instance_type, "region": home.region,
              "spot": home.spot, **({"zone": home.zone} if home.zone else {}),
              "offers": [x._asdict() for x in ranked]}  # the failover order
    disks = [r["disk_gb"] for r in needs if r.get("disk_gb")]
    if disks and "disk_gb" not in o:  # the largest boot disk any experiment asks
        chosen["disk_gb"] = max(disks)
    return dataclasses.replace(recipe, cluster=dataclasses.replace(
        spec, provider=provider,
        options={**{k: v for k, v in o.items() if k != "zones"}, **chosen}))
