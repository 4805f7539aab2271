"""The local provider: the embedded default, needing no cloud account and no SSH.

Its nodes are worker slots on this machine: ``workers: N`` (default: the CPU count) gives nodes
``<cluster>-0`` … ``<cluster>-<N-1>``, each running one task at a time. They share one node
folder, ``$HYPER_HOME/local``, where the agent keeps its attempt folders. Tasks run in the
recipe's ``workdir`` with this Python environment's ``bin`` folder first on ``PATH``, so a task
can use the packages installed beside hypercli. Storage is a plain folder (``file://``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from hypercli import state as S
from hypercli.errors import UsageError
from hypercli.node.client import AgentClient, local_agent
from hypercli.providers.base import Instance, LaunchResult
from hypercli.recipe import ClusterSpec


def storage_path(storage: str) -> Path:
    """The folder of a ``file://`` storage URL.

    Raises:
        UsageError: another scheme (object stores come with ``hyper data``).
    """
    if not storage.startswith("file://"):
        raise UsageError(f"the local provider keeps outputs in a folder, not in {storage}",
                         "set storage: file://PATH in the recipe")
    return Path(storage[len("file://"):])


class LocalProvider:
    """Worker slots on this machine (see the module docstring)."""

    name = "local"
    remote = False

    def root(self) -> Path:
        return S.home() / "local"

    def launch(self, spec: ClusterSpec) -> LaunchResult:
        n = spec.workers or os.cpu_count() or 1
        return LaunchResult([Instance(f"{spec.name}-{i}", f"local:{i}", 1,
                                      {"root": str(self.root())}) for i in range(n)])

    def connect(self, node: dict) -> AgentClient:
        env = dict(os.environ)
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        return local_agent(node["name"], node["address"].get("root") or self.root(), env)

    def terminate(self, cluster: str, nodes: list[dict]) -> list[str]:
        return [f"worker slot {n['name']}" for n in nodes]

    def task_paths(self, node: dict, wf: dict, task: str) -> tuple[str, str, str]:
        outputs = storage_path(wf["storage"]) / wf["id"]
        return wf["workdir"], str(outputs / task), str(outputs)

    def session(self, node: dict, wf: dict) -> None:
        return None


def make_provider(**_) -> LocalProvider:
    return LocalProvider()
