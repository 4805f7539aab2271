"""The local provider: the embedded default, needing no cloud account and no SSH.

Its nodes are worker slots on this machine: ``workers: N`` (default: the CPU count) gives nodes
``<cluster>-0`` … ``<cluster>-<N-1>``, each running one task at a time. They share one node
folder, ``$HYPER_HOME/local``, where the agent keeps its attempt folders. Tasks run in the
recipe's ``workdir`` with this Python environment's ``bin`` folder first on ``PATH``, so a task
can use the packages installed beside hypercli. ``file://`` storage is used as a plain folder;
with object storage (``s3://``) outputs are written here and pushed when an attempt succeeds.

The nodes share this machine's capacity evenly: each has ``CPUs // N`` CPUs (at least 1),
``memory / N`` and every N-th GPU (node i the GPUs whose index is i modulo N), so tasks that
ask ``resources:`` are placed as on separate machines; their private address is 127.0.0.1.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import threading
from pathlib import Path

from hypercli import state as S
from hypercli.errors import UsageError
from hypercli.node.client import AgentClient, local_agent
from hypercli.providers.base import Instance, LaunchResult
from hypercli.providers.runtime import (NodeRuntime, NodeSetupError, forwarded_env,
                                        mount_guard, unmount_command)
from hypercli.recipe import ClusterSpec


def storage_path(storage: str) -> Path:
    """The folder of a ``file://`` storage URL.

    Raises:
        UsageError: another scheme.
    """
    if not storage.startswith("file://"):
        raise UsageError(f"{storage} is not a folder", "use a file:// storage URL here")
    return Path(storage[len("file://"):])


class LocalProvider:
    """Worker slots on this machine (see the module docstring)."""

    name = "local"
    remote = False

    def root(self) -> Path:
        return S.folder("local")

    def launch(self, spec: ClusterSpec) -> LaunchResult:
        n = spec.workers or os.cpu_count() or 1
        return LaunchResult([Instance(f"{spec.name}-{i}", f"local:{i}", 1,
                                      {"root": str(self.root())}, share)
                             for i, share in enumerate(machine_shares(n))])

    def connect(self, node: dict) -> AgentClient:
        from hypercli.envvars import without_secrets
        env = without_secrets(os.environ, S.State())  # each task gets its own in its launch
        bindir = str(Path(sys.executable).parent)
        env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
        return local_agent(node["name"], node["address"].get("root") or self.root(), env)

    def terminate(self, cluster: str, nodes: list[dict]) -> list[str]:
        return [f"worker slot {n['name']}" for n in nodes]

    def task_paths(self, node: dict, wf: dict, task: str) -> tuple[str, str, str]:
        if wf["storage"].startswith("file://"):
            outputs = storage_path(wf["storage"]) / wf["id"]
        else:  # object storage: a folder here, pushed when the attempt succeeds
            outputs = self.root() / "outputs" / wf["id"]
        # workdir: none → an empty folder of the workflow's (LocalSession makes it)
        cwd = wf["workdir"] or str(self.root() / "work" / wf["id"])
        return cwd, str(outputs / task), str(outputs)

    def session(self, node: dict, wf: dict) -> "LocalSession":
        return LocalSession(self, node, wf)

    def unmount(self, nodes: list[dict], paths: list[str]) -> list[str]:
        """Unmount the workflows' mounts on this machine that hypercli made (its record in
        ``root()/mounts``); returns what was unmounted."""
        done = []
        for path in paths:
            if subprocess.run(["/bin/sh", "-c", unmount_command(path, str(self.root()))]
                              ).returncode == 0:
                done.append(f"mount {path}")
        return done

    def check_mounts(self, paths) -> None:
        """Refuse, before anything starts, the recipe's mount paths that cannot be mounted
        on this machine, the node of every local worker slot (:func:`mount_guard`).

        Raises:
            UsageError: a path is a mount point hypercli did not make, not a folder, or a
                folder with files in it (the message says which).
        """
        for path in sorted(paths):
            p = subprocess.run(["/bin/sh", "-c", mount_guard(path, str(self.root()))],
                               capture_output=True, text=True)
            if p.returncode == 2:
                raise UsageError(f"mounts.{path}: {p.stderr.strip().removeprefix('hyper: ')}",
                                 "mount it on a folder that does not exist or is empty")


def machine_shares(n: int) -> list[dict]:
    """This machine's CPUs, memory and GPUs dealt to ``n`` local nodes (module docstring):
    one ``info`` dict per node, as a node's bootstrap would record it."""
    from hypercli.node.agent import _gpus
    cpus = os.cpu_count() or 1
    try:
        with open("/proc/meminfo") as f:
            memory = int(f.readline().split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        memory = 0
    gpus = _gpus()
    return [{"cpus": max(1, cpus // n), "memory_bytes": memory // n,
             "gpus": [g for g in gpus if g["index"] % n == i], "private_address": "127.0.0.1",
             "machine_cpus": cpus} for i in range(n)]


_MOUNT_LOCK = threading.Lock()  # the local nodes share this machine's mounts and outputs
_STAGED: dict[str, set] = {}  # workflow → experiments whose outputs are pulled here


class LocalSession:
    """Mounts and object-store outputs for the local nodes (see providers/runtime.py)."""

    def __init__(self, provider: LocalProvider, node: dict, wf: dict):
        self.wf = wf
        self.rt = NodeRuntime(node["name"], wf, str(provider.root()),
                              f"{shlex.quote(sys.executable)} -m hypercli.mount.node", self._sh)
        self.name = node["name"]

    def _sh(self, command: str) -> None:
        p = subprocess.run(["/bin/sh", "-c", command], capture_output=True, text=True)
        if p.returncode != 0:
            raise NodeSetupError(f"`{command[:200]}` exited {p.returncode}: "
                                 f"{p.stderr.strip()[-500:]}", stderr=p.stderr)

    def before_launch(self, specs: list[dict]) -> None:
        if not self.wf["workdir"]:  # workdir: none: an empty folder of the workflow's
            for s in specs:
                os.makedirs(s["cwd"], exist_ok=True)
        with _MOUNT_LOCK:
            self.rt.ensure_mounts()
            self.rt.staged = _STAGED.setdefault(self.wf["id"], set())
            for s in specs:  # one pull per experiment for all the local nodes
                self.rt.stage(set(s.get("after", [])), s["outputs"])
        for s in specs:
            s["finish"] = self.rt.finish_command(s["output"], s["env"]["HYPER_TASK_ID"])
            s["binds"] = self.rt.binds()
            s["hide"] = [str(S.home())]  # never seen in a container (a workdir holding it)
            s["env"].update(forwarded_env())
            self.rt.checkpoint(s, s.get("checkpoint_every", 60))

    def after_end(self, states: dict) -> None:
        pass


def make_provider(**_) -> LocalProvider:
    return LocalProvider()
