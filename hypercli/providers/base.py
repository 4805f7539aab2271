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


@dataclass
class LaunchResult:
    """What ``launch`` got: the nodes that are up, and an error per target that is not
    (partial success survives: one bad host does not stop the others)."""

    instances: list
    errors: dict = field(default_factory=dict)


class NodeSession(Protocol):
    """A node's side work for one workflow, run in the node's scheduler thread."""

    def before_launch(self, specs: list[dict]) -> None:
        """Prepare the node for these launch specs (workdir, inputs, images).
        Raises NodeError."""

    def after_end(self, states: dict) -> None:
        """Bring back what ended attempts left on the node (logs, outputs) before the
        scheduler hears of their end. Raises NodeError."""


class Provider(Protocol):
    """What ``hypercli.cluster`` and ``hypercli.scheduler`` need from a provider."""

    name: str
    #: True when nodes are other machines (logs and outputs are fetched from them)
    remote: bool

    def launch(self, spec: ClusterSpec) -> LaunchResult:
        """Create or find the cluster's nodes. Raises UsageError for a bad spec."""

    def connect(self, node: dict) -> AgentClient:
        """Open an agent channel to a node (a ``nodes`` row of the state file).
        Raises NodeError when the node cannot be reached."""

    def terminate(self, cluster: str, nodes: list[dict]) -> list[str]:
        """Remove the nodes; returns a line per removed resource."""

    def task_paths(self, node: dict, wf: dict, task: str) -> tuple[str, str, str]:
        """(working folder, ``HYPER_OUTPUT``, ``HYPER_OUTPUTS``) of a task, as seen on the
        node; ``wf`` is the ``workflows`` row."""

    def session(self, node: dict, wf: dict) -> NodeSession | None:
        """The node's session for a workflow, or None when there is no side work."""
