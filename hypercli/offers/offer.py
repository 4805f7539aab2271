"""An offer: one way to get a node — a cloud's instance type in a region (and zone), spot or
on-demand, at a price per node-hour. The catalog makes offers, the optimizer ranks them, a
launch fails over along them, and the cost ledger records the one each node was launched on.

An offer is an immutable value, a :class:`typing.NamedTuple` rather than a frozen dataclass:
the optimizer makes tens of thousands per ranking, and a named tuple is made in one C call
(``tuple.__new__``), 3 times faster than filling a dataclass instance; ``_asdict()`` and
``_replace()`` stand for ``dataclasses.asdict`` and ``dataclasses.replace``.
"""

from __future__ import annotations

from typing import NamedTuple


class Offer(NamedTuple):
    """One launchable choice of machine.

    Attributes:
        cloud: ``aws``, ``gcp`` or ``azure``.
        instance_type: the cloud's name (``p3.8xlarge``, ``n1-standard-32``,
            ``Standard_NC24s_v3``).
        region: the cloud's region (``us-east-1``).
        zone: the zone (``us-east-1a``), or None when the offer holds for the whole region.
        spot: True for spot (preemptible) capacity, False for on-demand.
        price: US dollars per node-hour.
        vcpus: virtual CPUs of one instance.
        memory_gib: memory of one instance, GiB.
        accelerator: normalised GPU model (``V100``, ``A100-80GB``, ``T4``), or None.
        accelerator_count: GPUs per instance (0 without).
        extra: cloud-specific fields as sorted (key, value) pairs, e.g. GCP's attached
            accelerator type (Apache Libcloud's ``extra``).
    """

    cloud: str
    instance_type: str
    region: str
    zone: str | None
    spot: bool
    price: float
    vcpus: float
    memory_gib: float
    accelerator: str | None = None
    accelerator_count: int = 0
    extra: tuple[tuple[str, str], ...] = ()

    def where(self) -> str:
        """The zone when known, else the region: ``us-east-1a``."""
        return self.zone or self.region

    def describe(self) -> str:
        """One line for the user: ``aws us-east-1a p3.8xlarge spot $3.6720/h``."""
        kind = "spot" if self.spot else "on-demand"
        return f"{self.cloud} {self.where()} {self.instance_type} {kind} ${self.price:.4f}/h"
