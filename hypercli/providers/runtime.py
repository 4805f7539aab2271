"""What a node does for a workflow besides running tasks, written once for every provider:
the recipe's ``mounts:`` (mounted before the first task, unmounted on ``hyper down``) and task
outputs kept in object storage (:mod:`hypercli.mount.outputs`).

A provider's session gives :class:`NodeRuntime` two things: ``sh`` (run a shell command on
the node) and ``hyper`` (the shell words that run hypercli there: this Python for the local
provider, the copied runtime of :mod:`hypercli.node.bundle` over SSH), used as
``<python> -m hypercli.mount.node ...``, which needs no package beyond boto3 and mfusepy.

Mount kinds (recipe ``mounts: {PATH: URL}``):
* ``chunks+s3://...``, ``chunks+file://...``: hypercli's chunked FUSE mount
  (``hyper data mount``), its chunk cache in ``<node root>/cache``;
* ``s3://bucket/prefix``: the bucket itself, with goofys, else s3fs, whichever the node has;
  read-only unless the recipe mounts it ``rw``.
"""

from __future__ import annotations

import os
import shlex
from typing import Callable

from hypercli.errors import InfraError
from hypercli.mount.outputs import checkpoint_url, output_url
from hypercli.ssh.conn import CommandFailed


class NodeSetupError(InfraError):
    """Preparing a node for a workflow failed (a mount, pulling inputs): the attempts that
    needed it fail with this reason; the node itself is not lost. ``stderr``: what the
    failed command said, when one did."""

    def __init__(self, message: str, hint: str | None = None, *, stderr: str = ""):
        super().__init__(message, hint)
        self.stderr = stderr


def _said(e: Exception) -> str:
    """The reason of a failed node command: the last lines of its stderr, else the error
    (which names the command)."""
    err = e.result.stderr.decode(errors="replace") if isinstance(e, CommandFailed) \
        else getattr(e, "stderr", "")
    return "\n".join(err.strip().splitlines()[-5:]) or str(e)


#: environment passed to node-side hypercli commands when set here (an S3-compatible
#: endpoint is not a secret; credentials come from the node's own configuration)
FORWARD_ENV = ("HYPER_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
               "HYPER_GCS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT",
               "HYPER_AZURE_STORAGE_ENDPOINT_URL")


def forwarded_env() -> dict:
    return {k: os.environ[k] for k in FORWARD_ENV if os.environ.get(k)}


def env_prefix() -> str:
    return "".join(f"{k}={shlex.quote(v)} " for k, v in forwarded_env().items())


def _serving(p: str) -> str:
    """Shell test: a file system is mounted at quoted path ``p`` and answers. A FUSE mount
    whose daemon died stays in the mount table and may still pass ``stat`` from the kernel's
    cached attributes; ``statfs`` is never cached, so it fails there (ENOTCONN)."""
    return f"mountpoint -q {p} && stat -f {p} >/dev/null 2>&1"


def _detach(p: str) -> str:
    """Shell text that lazily unmounts a dead FUSE mount at quoted path ``p``; nothing, and
    no output, when none is there."""
    return (f"{{ fusermount3 -uz {p} || fusermount -uz {p} || umount -l {p}; }} "
            f">/dev/null 2>&1")


def mount_command(hyper: str, url: str, path: str, cache: str, rw: bool = False) -> str:
    """Shell text that mounts ``url`` at ``path`` on a node (idempotent: nothing when a file
    system is mounted there and answers; a mount whose daemon died is detached and mounted
    again). A plain bucket is mounted read-only (goofys and s3fs alike) unless ``rw``."""
    p = shlex.quote(path)
    if url.startswith("chunks+"):
        cmd = (f"{env_prefix()}{hyper} mount {shlex.quote(url[len('chunks+'):])} {p} "
               f"--cache-dir {shlex.quote(cache)}")
    else:
        bucket_path = url[len("s3://"):]
        bucket, _, prefix = bucket_path.partition("/")
        endpoint = forwarded_env().get("HYPER_S3_ENDPOINT_URL")
        goofys = "goofys " + ("" if rw else "-o ro ") + \
            (f"--endpoint {shlex.quote(endpoint)} " if endpoint else "") + \
            f"{shlex.quote(bucket + (':' + prefix if prefix else ''))} {p}"
        s3fs = (f"s3fs {shlex.quote(bucket + (':/' + prefix if prefix else ''))} {p} "
                f"-o {'rw' if rw else 'ro'}"
                + (f",url={shlex.quote(endpoint)},use_path_request_style" if endpoint else ""))
        cmd = (f"if command -v goofys >/dev/null; then {goofys}; elif command -v s3fs "
               f">/dev/null; then {s3fs}; else echo 'neither goofys nor s3fs is installed' >&2; "
               "exit 127; fi")
    return f"{_serving(p)} || {{ {_detach(p)}; mkdir -p {p} && {cmd}; }}"


def unmount_command(path: str) -> str:
    """Shell text that unmounts a FUSE mount at ``path`` when one is there, a dead one
    (its daemon gone: ``stat`` fails) lazily; always exits 0."""
    p = shlex.quote(path)
    return (f"if mountpoint -q {p}; then "
            f"{{ fusermount3 -u {p} 2>/dev/null || fusermount -u {p} 2>/dev/null || "
            f"umount {p}; }}; elif ! stat {p} >/dev/null 2>&1; then {_detach(p)}; fi; true")


class NodeRuntime:
    """Mounts and object-store outputs for one workflow on one node.

    Args:
        node: node name (errors).
        wf: the ``workflows`` row (storage, spec with mounts).
        root: the node's hypercli folder (``~/.hyper`` there).
        hyper: shell words running ``hypercli.mount.node`` on the node.
        sh: ``sh(command) -> None``, raising CommandFailed/NodeSetupError when the command
            fails and NodeError when the node cannot be reached.
    """

    def __init__(self, node: str, wf: dict, root: str, hyper: str,
                 sh: Callable[[str], None]):
        self.node, self.wf, self.root, self.hyper, self.sh = node, wf, root, hyper, sh
        self.mounted = False
        self.staged: set[str] = set()

    @property
    def object_storage(self) -> bool:
        return not self.wf["storage"].startswith("file://")

    def ensure_mounts(self) -> None:
        """Mount every ``mounts:`` entry once per workflow. Raises NodeError."""
        if self.mounted:
            return
        spec = self.wf.get("spec") or {}
        for path, url in sorted(spec.get("mounts", {}).items()):
            try:
                self.sh(mount_command(self.hyper, url, path, f"{self.root}/cache",
                                      rw=path in spec.get("rw_mounts", ())))
            except (CommandFailed, NodeSetupError) as e:
                raise NodeSetupError(f"mounting {url} at {path} on {self.node} failed: "
                                     f"{_said(e)}") from None
        self.mounted = True

    def stage(self, experiments: set[str], outputs: str) -> None:
        """Pull the outputs of ``experiments`` into ``outputs`` (object storage only)."""
        todo = sorted(experiments - self.staged)
        if not todo or not self.object_storage:
            return
        try:
            self.sh(f"{env_prefix()}{self.hyper} pull-outputs "
                    f"{shlex.quote(self.wf['storage'])} {shlex.quote(self.wf['id'])} "
                    f"{shlex.quote(outputs)} " + " ".join(map(shlex.quote, todo)))
        except (CommandFailed, NodeSetupError) as e:
            raise NodeSetupError(f"pulling the outputs of {', '.join(todo)} onto {self.node} "
                                 f"failed: {_said(e)}") from None
        self.staged.update(todo)

    def finish_command(self, output: str, task: str) -> str | None:
        """The command the supervisor runs after a successful task: push its outputs."""
        if not self.object_storage:
            return None
        url = output_url(self.wf["storage"], self.wf["id"], task)
        return (f"{env_prefix()}{self.hyper} push-output {shlex.quote(output)} "
                f"{shlex.quote(url)}")

    def checkpoint(self, spec: dict, every: float, url: str | None = None) -> None:
        """Give a launch spec its checkpoint (:mod:`hypercli.mount.checkpoint`): the folder
        ``<root>/ckpt/<workflow>/<task>`` as ``HYPER_CHECKPOINT``, and the node-side commands
        the agent runs around the task: restore (attempts after the first) and save (every
        ``every`` s, at a preemption notice, at the end). Every rank of a multi-node task
        restores; only rank 0's folder is saved.

        Args:
            url: the checkpoint store as the node reaches it; default the workflow's storage.
        """
        wid, task = self.wf["id"], spec["env"]["HYPER_TASK_ID"]
        number = int(spec["env"]["HYPER_ATTEMPT"])
        folder = f"{self.root}/ckpt/{wid}/{task}"
        state = shlex.quote(f"{folder}.state.json")
        url = shlex.quote(url or checkpoint_url(self.wf["storage"], wid, task))
        q = shlex.quote(folder)
        spec["env"]["HYPER_CHECKPOINT"] = folder
        saves = spec["env"].get("HYPER_NODE_RANK", "0") == "0"  # a gang saves rank 0's
        spec["checkpoint"] = {
            "dir": folder, "every": every, "preempted": f"{self.root}/preempted",
            "save": (f"{env_prefix()}{self.hyper} checkpoint-save {q} {url} {number} {state}"
                     if saves else ""),
            "restore": (f"{env_prefix()}{self.hyper} checkpoint-restore {url} {q} {state}"
                        if number > 1 else None)}

    def binds(self) -> dict:
        """Mount paths to bind into containers at the same path."""
        return {p: p for p in (self.wf.get("spec") or {}).get("mounts", {})}
