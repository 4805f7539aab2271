"""Container images onto nodes: already there, pulled by the node, or pushed from here.

Rule, per node and image:
1. the node has the image (``docker image inspect``) → nothing to do;
2. the image is named ``localhost/...`` (built here, in no registry) or the node's pull fails,
   and this machine has it → ``docker save`` here streamed over SSH into ``docker load``
   (no registry needed; measured ~130–160 MB/s between test hosts);
3. otherwise the node pulls it; a failed pull is an error naming the image. The pull of a
   private registry uses the experiment's ``registry_auth`` (sent on the channel's stdin, kept
   on the node only during the pull), or, for Amazon ECR, Google Artifact Registry and Azure
   Container Registry, the node's cloud identity (:mod:`hypercli.node.registry`). An image
   of a registry the node can reach is never pushed from here.

The local container CLI is ``$HYPER_DOCKER``, else ``docker`` when its engine answers, else
``podman``.
"""

from __future__ import annotations

import functools
import json
import os
import shlex
import shutil
import subprocess

from hypercli.errors import InfraError
from hypercli.ssh.conn import Connection, HostUnreachable


class ImageError(InfraError):
    """An image cannot be made present on a node; the node itself is fine (its tasks that
    need the image fail, the node keeps working)."""


@functools.lru_cache(maxsize=1)
def local_docker() -> str | None:
    """The container CLI of this machine (see the module docstring), or None."""
    if os.environ.get("HYPER_DOCKER"):
        return os.environ["HYPER_DOCKER"]
    for cli in ("docker", "podman"):
        if shutil.which(cli) and subprocess.run([cli, "info"], capture_output=True,
                                                timeout=20).returncode == 0:
            return cli
    return None


def local_has(image: str) -> bool:
    cli = local_docker()
    return bool(cli) and subprocess.run([cli, "image", "inspect", image],
                                        capture_output=True).returncode == 0


def push(conn: Connection, image: str, chunk: int = 1 << 20) -> int:
    """Stream ``docker save IMAGE`` from here into ``docker load`` on the node.

    Returns:
        bytes sent.
    Raises:
        ImageError: the save or the load failed (with the load's stderr).
        HostUnreachable: the connection failed.
    """
    cli = local_docker()
    if cli is None:
        raise ImageError(f"cannot push {image} to {conn.name}: no docker or podman here")
    save = subprocess.Popen([cli, "save", image], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    ch = conn.channel()
    ch.settimeout(600)
    sent = 0
    try:
        ch.exec_command("docker load")
        while True:
            data = save.stdout.read(chunk)
            if not data:
                break
            ch.sendall(data)
            sent += len(data)
        ch.shutdown_write()
        code = ch.recv_exit_status()
        err = b""
        while ch.recv_stderr_ready():
            err += ch.recv_stderr(1 << 16)
    except OSError as e:
        raise HostUnreachable(conn.name, f"pushing {image} failed: {e}") from None
    finally:
        save.stdout.close()
        save_err = save.stderr.read().decode(errors="replace")
        save.wait()
        ch.close()
    if save.returncode != 0:
        raise ImageError(f"`{cli} save {image}` failed: {save_err.strip()}")
    if code != 0:
        raise ImageError(f"`docker load` of {image} on {conn.name} failed: "
                         f"{err.decode(errors='replace').strip()[-500:]}")
    return sent


def _pull(conn: Connection, image: str, creds: tuple[str, str] | None,
          helper: str | None):
    """The node's pull: plain ``docker pull``, or through the node runtime
    (:mod:`hypercli.node.registry`) with ``creds`` on stdin, or with the node's cloud
    identity for a cloud's registry."""
    from hypercli.node.registry import cloud_of, registry_of
    q = shlex.quote(image)
    if helper and (creds or cloud_of(registry_of(image))):
        body = json.dumps({"username": creds[0], "password": creds[1]} if creds else {})
        return conn.run(f"{helper} -m hypercli.node.registry pull {q}",
                        stdin=body.encode(), check=False, timeout=1800)
    return conn.run(f"docker pull {q}", check=False, timeout=1800)


def ensure(conn: Connection, image: str, *, creds: tuple[str, str] | None = None,
           helper: str | None = None) -> str:
    """Make ``image`` present on the node (rule in the module docstring).

    Args:
        creds: (username, password) of the image's registry (an experiment's
            ``registry_auth``), sent on the channel's stdin only.
        helper: shell words running the node runtime's Python (``PYTHONPATH=... python3``);
            needed for ``creds`` and for cloud registries' identities.
    Returns:
        "present", "pushed" or "pulled".
    Raises:
        ImageError: the node has no docker, or neither pull nor push worked.
    """
    q = shlex.quote(image)
    r = conn.run(f"command -v docker >/dev/null || exit 127; docker image inspect {q} "
                 ">/dev/null 2>&1", check=False)
    if r.exit_code == 127:
        raise ImageError(f"experiment image {image}: node {conn.name} has no docker",
                         "install a container runtime on the node")
    if r.exit_code == 0:
        return "present"
    if image.startswith("localhost/") and local_has(image):
        push(conn, image)
        return "pushed"
    pull = _pull(conn, image, creds, helper)
    if pull.exit_code == 0:
        return "pulled"
    if local_has(image):
        push(conn, image)
        return "pushed"
    raise ImageError(f"cannot get image {image} onto {conn.name}: the node's pull failed "
                     f"({pull.stderr.decode(errors='replace').strip()[-300:]}) and this "
                     "machine does not have it")
