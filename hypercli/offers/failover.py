"""Launch failover: the order in which a cloud launch tries its offers, and the walk along
them when a cloud answers that it has no room.

A launch gets an ordered list of :class:`~hypercli.offers.offer.Offer` (the optimizer's,
cheapest first, or :func:`offers_from_options`: the recipe's own ``instance_type`` in each of
its zones). :func:`ordered` puts spot offers before on-demand ones (``spot: auto``: on-demand
only when no spot capacity is left) and the spot offers of a region whose spot nodes were
preempted in the last :data:`PREEMPTED_LAST` seconds after the other spot offers. :func:`walk`
launches the nodes on the first offer; the nodes that meet a capacity error
(``hypercli.providers.cloud.CapacityError``: AWS ``InsufficientInstanceCapacity``, a spot
request not fulfilled; GCP ``ZONE_RESOURCE_POOL_EXHAUSTED``; Azure ``SkuNotAvailable`` /
``AllocationFailed`` / ``ZonalAllocationFailed``) or a quota error go on to the next offer:
next zone, next region, next cloud, in the list's order. Each step is one line (:class:`Step`,
``us-east-1a: no spot capacity for p3.8xlarge → us-west-2b``) that the caller logs as an event,
and when every offer failed the nodes' error (:class:`FailoverError`) lists them all.

SkyPilot's failover (``sky/backends/cloud_vm_ray_backend.py``, ``FailoverCloudErrorHandlerV2``:
zone, then region, then cloud, blocking what failed) is the model; this module is cloud-free:
the cloud calls come in through ``launch_on``, and an error says what it is by its
``failover`` attribute (``capacity`` or ``quota``, set on the providers' CapacityError and
QuotaError), so that this package imports no provider.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Callable, Iterable

from hypercli.errors import InfraError
from hypercli.offers.offer import Offer

#: s that a region whose spot nodes were just preempted goes to the end of the list. A spot
#: pool that took nodes back is short of capacity for a while; AWS keeps a preempted spot
#: request's pool answering ``capacity-not-available`` for minutes to hours ("Spot Instance
#: interruptions", EC2 User Guide). 30 minutes is hypercli's choice: long enough for a
#: replacement launched at once to go elsewhere, short enough that a cheap region is tried
#: again on the next day's runs.
PREEMPTED_LAST = 1800.0

#: where each cloud's quotas are raised
QUOTA_PAGES = {
    "aws": "https://{region}.console.aws.amazon.com/servicequotas/home/services/ec2/quotas",
    "gcp": "https://console.cloud.google.com/iam-admin/quotas",
    "azure": "https://portal.azure.com/#view/Microsoft_Azure_Capacity/QuotaMenuBlade/~/myQuotas",
}


def _kind(error: Exception) -> str | None:
    """``capacity``, ``quota`` or None: what an error means for failover (module docstring)."""
    return getattr(error, "failover", None)


def offers_from_options(cloud: str, options: dict) -> list[Offer]:
    """The offers a recipe's explicit ``cluster:`` names: its ``instance_type`` in each of
    its ``zone:`` zones, in order (one region-wide offer when it names none: the cloud then
    tries the region's zones itself). ``spot: true`` (the default) gives spot offers,
    ``false`` on-demand ones, ``auto`` the spot ones followed by the same on-demand.

    Args:
        cloud: ``aws``, ``gcp`` or ``azure``; options: the recipe's ``cluster:`` options.
    Returns:
        offers with ``price`` 0.0: the recipe gives none; the ledger asks the cloud for the
        price of the offer a node was launched on. When ``options`` carries ``offers`` (the
        optimizer's ranked list, set by
        :func:`hypercli.offers.optimizer.with_first_offer`), those, in their order.
    """
    if options.get("offers"):
        return [Offer(**{**d, "extra": tuple(tuple(p) for p in d.get("extra") or ())})
                for d in options["offers"]]
    zone = options.get("zone")
    zones = list(zone) if isinstance(zone, list) else ([zone] if zone else [None])
    spot = options.get("spot", True)
    kinds = [True, False] if spot == "auto" else [bool(spot)]
    return [Offer(cloud, options.get("instance_type", ""), options.get("region", ""), z, s,
                  0.0, 0.0, 0.0) for s in kinds for z in zones]


def ordered(offers: Iterable[Offer], preempted: Iterable[tuple[str, str]] = ()) -> list[Offer]:
    """The order a launch tries ``offers`` in: spot before on-demand, and the spot offers of
    a region in ``preempted`` ((cloud, region) pairs whose spot nodes were preempted in the
    last :data:`PREEMPTED_LAST` s) after the other spot offers (on-demand capacity is not
    taken back); otherwise the given order (the optimizer's, cheapest first) is kept."""
    hot = set(preempted)
    return sorted(offers, key=lambda o: (not o.spot, o.spot and (o.cloud, o.region) in hot))


def quota_hint(offer: Offer, error: Exception) -> str:
    """Which quota stopped a launch on ``offer`` and where to raise it, from the cloud's
    error text: ``quota NVIDIA_V100_GPUS of gcp us-central1: raise it at https://...``.
    Quota names: AWS "Running On-Demand <family> instances" / "All <family> Spot Instance
    Requests" (vCPUs; EC2 User Guide, "On-Demand Instance quotas"), GCP the name in the
    error (``Quota 'CPUS' exceeded``), Azure the VM family of the error
    (``standardNCSv3Family``) or "Total Regional Spot vCPUs"."""
    text = str(error)
    if offer.cloud == "aws":
        family = _aws_family(offer.instance_type)
        name = (f"All {family} Spot Instance Requests" if offer.spot else
                f"Running On-Demand {family} instances") + " (vCPUs)"
    elif offer.cloud == "gcp":
        m = re.search(r"[Qq]uota '([A-Z0-9_]+)'", text)
        name = m[1] if m else ("PREEMPTIBLE_CPUS" if offer.spot else "CPUS")
    else:
        m = re.search(r"approved (\w+) Cores quota", text)
        name = (f"{m[1]} vCPUs" if m else
                "Total Regional Spot vCPUs" if offer.spot else "Total Regional vCPUs")
    page = QUOTA_PAGES.get(offer.cloud, "").format(region=offer.region or "us-east-1")
    return f"quota {name!r} of {offer.cloud} {offer.region}: raise it at {page}"


def _aws_family(instance_type: str) -> str:
    """The EC2 quota family of an instance type (``p3.8xlarge`` → ``P``)."""
    prefix = re.match(r"[a-z]+", instance_type or "")
    p = prefix[0] if prefix else ""
    for start, family in (("inf", "Inf"), ("trn", "Trn"), ("dl", "DL"), ("vt", "G and VT"),
                          ("g", "G and VT"), ("p", "P"), ("f", "F"), ("x", "X")):
        if p.startswith(start):
            return family
    return "Standard (A, C, D, H, I, M, R, T, Z)"


@dataclass(frozen=True)
class Step:
    """One move of a launch from an offer to the next.

    Attributes:
        offer: the offer that failed; error: the cloud's answer; nodes: how many nodes met it;
        next: the offer tried next, or None when none was left.
    """

    offer: Offer
    error: Exception
    nodes: int
    next: Offer | None

    def reason(self) -> str:
        """``no spot capacity for p3.8xlarge``, ``spot request not fulfilled``, or the quota."""
        if _kind(self.error) == "quota":
            return quota_hint(self.offer, self.error).split(": raise it")[0]
        if getattr(self.error, "code", None) == "SpotNotFulfilled":
            return f"spot request for {self.offer.instance_type} not fulfilled in time"
        kind = "spot capacity" if self.offer.spot else "capacity"
        return f"no {kind} for {self.offer.instance_type}"

    def line(self) -> str:
        """``us-east-1a: no spot capacity for p3.8xlarge → us-west-2b`` (the cloud named
        when the next offer is on another one; ``on-demand, costs more`` when the next is
        on-demand after spot)."""
        text = f"{self.offer.where()}: {self.reason()}"
        if self.next is None:
            return text + " → no offer left"
        nxt = self.next.where()
        if self.next.cloud != self.offer.cloud:
            nxt = f"{self.next.cloud} {nxt}"
        if self.next.instance_type != self.offer.instance_type:
            nxt += f" {self.next.instance_type}"
        if self.offer.spot and not self.next.spot:
            nxt += " on-demand (costs more" + (
                f": ${self.next.price:.4f}/h" if self.next.price else "") + ")"
        return f"{text} → {nxt}"


class FailoverError(InfraError):
    """Every offer of a launch failed (exit 3): the message lists each step, the hint says
    where to raise a quota that was met, or to allow more zones, regions or clouds."""

    def __init__(self, steps: list[Step], last: Exception | None):
        lines = "; ".join(s.line() for s in steps) or str(last)
        quotas = [quota_hint(s.offer, s.error) for s in steps
                  if _kind(s.error) == "quota"]
        hint = "; ".join(dict.fromkeys(quotas)) or (
            "allow more zones, regions or clouds, or spot: auto to fall back to on-demand")
        super().__init__(f"no offer had room: {lines}", hint)
        self.steps = steps


#: what a launch on one offer does: (offer, node names) → (launched, {node: error})
LaunchOn = Callable[[Offer, list[str]], tuple[list, dict]]


def walk(offers: list[Offer], nodes: list[str], launch_on: LaunchOn,
         step: Callable[[Step], None] = lambda s: None) -> tuple[list, dict, list[Step]]:
    """Launch ``nodes`` along ``offers`` (module docstring).

    Args:
        offers: in the order to try (:func:`ordered`); nodes: node names to launch;
        launch_on: launches some nodes on one offer, returns what it launched (anything:
            VMs) and an error per node that got nothing;
        step: called with each :class:`Step` as it happens (to log it).
    Returns:
        (everything launched, {node: error} for nodes that got nothing — a
        :class:`FailoverError` listing every step when capacity or quota errors ran through
        the whole list, else the node's own error — the steps taken).
    """
    launched: list = []
    errors: dict = {}
    steps: list[Step] = []
    waiting = list(nodes)
    blocked: set = set()  # (cloud, region, spot, type) whose quota was met
    todo = list(offers)
    last: Exception | None = None
    while waiting and todo:
        offer = todo.pop(0)
        if (offer.cloud, offer.region, offer.spot, offer.instance_type) in blocked:
            continue
        got, failed = launch_on(offer, waiting)
        launched += got
        moved = []
        for node in waiting:
            err = failed.get(node)
            if err is None:
                errors.pop(node, None)
            elif _kind(err):
                moved.append(node)
                errors[node] = last = err
            else:
                errors[node] = err
        if moved:
            err = errors[moved[-1]]
            if _kind(err) == "quota":
                blocked.add((offer.cloud, offer.region, offer.spot, offer.instance_type))
                todo = [o for o in todo if (o.cloud, o.region, o.spot, o.instance_type)
                        not in blocked]
            s = Step(offer, err, len(moved), todo[0] if todo else None)
            steps.append(s)
            step(s)
        waiting = moved
    if waiting and steps:
        final = FailoverError(steps, last)
        for node in waiting:
            errors[node] = final
    return launched, errors, steps


def with_price(offer: Offer, prices: dict[str, float]) -> Offer:
    """``offer`` with its price from a cloud's ``{zone: USD per hour}`` (the zone's, or the
    lowest when the offer is region-wide), when it has none yet."""
    if offer.price or not prices:
        return offer
    p = prices.get(offer.zone or "") or min(prices.values())
    return offer._replace(price=float(p))
