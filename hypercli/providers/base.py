"""The provider contract: what every provider (local, ssh, aws, gcp, azure) implements.

Lifecycle of a cluster: ``launch`` creates (or finds) its nodes and returns them as
:class:`Instance` values, which ``hypercli.cluster`` records in the state file; ``connect``
opens a channel to a node's agent (``hypercli/node/agent.py``), over which every task runs;
``terminate`` removes the nodes. A node's *name* is hypercli's (``<cluster>-<n>``, unique in the
state file); its ``provider_id`` is the provider's own (an instance id, a host address).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from hypercli.node.client import AgentClient
from hypercli.recipe import ClusterSpec


@dataclass(frozen=True)
class Instance:
    """A node as a provider describes it.

    Attributes:
        name: hypercli's node name, ``<cluster>-<n>``.
        provider_id: the provider's id for it (instance id, ``user@host:port``, ...).
        slots: tasks the node runs at once.
        address: how to reach it (provider-specific: host, port, user, ...).
        extra: anything else worth keeping (zone, instance type, spot price, ...).
    """

    name: str
    provider_id: str
    slots: int = 1
    address: dict = field(default_factory=dict)
    extra: dict = field(default_factory=dict)


class Provider(Protocol):
    """What ``hypercli.cluster`` and ``hypercli.scheduler`` need from a provider."""

    name: str

    def launch(self, spec: ClusterSpec) -> list[Instance]:
        """Create or find the cluster's nodes. Raises InfraError/UsageError."""

    def connect(self, node: dict) -> AgentClient:
        """Open an agent channel to a node (a ``nodes`` row of the state file).
        Raises NodeError when the node cannot be reached."""

    def terminate(self, cluster: str, nodes: list[dict]) -> list[str]:
        """Remove the nodes; returns a line per removed resource."""

    def output_dir(self, storage: str, workflow: str, task: str) -> str:
        """The folder, as seen on the node, given to a task as ``HYPER_OUTPUT``."""
