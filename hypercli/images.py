"""Node images: bake them with Packer (``images/packer``), list them, and provision plain hosts
over SSH with the same scripts.

* :func:`build` runs ``packer build`` on ``images/packer`` for one cloud (``-only`` its source)
  with the hypercli version, the variant (cpu/gpu), a build stamp and a tar of hypercli's code
  (the same one SSH nodes get, :mod:`hypercli.node.bundle`); it reads the artifact id from
  Packer's ``-machine-readable`` output and records the image in ``$HYPER_HOME/images.json``.
  Images are named ``hyper-node-<variant>-<version>-<stamp>`` and tagged the way the providers
  look them up (:mod:`hypercli.providers.cloud`).
* :func:`list_images` reads that record.
* :func:`provision` sends ``images/packer/scripts`` and the code tar to a node over its SSH
  connection and runs ``provision.sh`` as root: the image's provisioning, idempotent, on a host
  that has no baked image (``hyper up --bootstrap``).

Packer: a current Packer needs ``packer init images/packer`` once (plugins.pkr.hcl); Debian's
Packer 1.6.6 has the builders built in and does not understand ``required_plugins``, so for it
the template folder is copied without ``plugins.pkr.hcl``.
"""

from __future__ import annotations

import io
import json
import os
import re
import shlex
import shutil
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

from hypercli import __version__
from hypercli import state as S
from hypercli.errors import InfraError, UsageError

PACKER_DIR = Path(__file__).resolve().parent.parent / "images" / "packer"
SOURCES = {"aws": "amazon-ebs.node", "gcp": "googlecompute.node", "azure": "azure-arm.node"}
#: steps of provision.sh that need the internet (skipped with ``--offline``)
DOWNLOAD_STEPS = ("base", "docker", "nvidia", "goofys", "prepull")


def packer_dir() -> Path:
    """The template folder. Raises UsageError when hypercli is installed without it."""
    if not (PACKER_DIR / "node.pkr.hcl").exists():
        raise UsageError(f"no Packer templates at {PACKER_DIR}",
                         "run hyper from a checkout of hypercli (images/packer)")
    return PACKER_DIR


def packer_version(packer: str) -> tuple[int, ...]:
    out = subprocess.run([packer, "version"], capture_output=True, text=True, timeout=30).stdout
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(x) for x in m.groups()) if m else (0,)


def template_folder(packer: str, work: Path) -> Path:
    """The folder to give ``packer``: the templates as they are for Packer ≥ 1.7, else a copy
    without ``plugins.pkr.hcl`` (module docstring)."""
    src = packer_dir()
    if packer_version(packer) >= (1, 7, 0):
        return src
    dest = work / "packer"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("plugins.pkr.hcl"))
    return dest


def code_tar(path: Path) -> Path:
    """Write the tar of hypercli's code (hypercli + mfusepy) that nodes run to ``path``."""
    from hypercli.node.bundle import bundle
    _, data = bundle()
    path.write_bytes(data)
    return path


def _records() -> Path:
    return S.home() / "images.json"


def list_images(provider: str | None = None) -> list[dict]:
    """Images baked here, newest first: ``{"provider", "variant", "name", "id", "version",
    "built"}`` (built: unix s). Raises StateError for an unreadable record."""
    path = _records()
    try:
        rows = json.loads(path.read_text()) if path.exists() else []
    except (OSError, ValueError) as e:
        raise S.StateError(f"{path}: {e}", "move the file away; it only lists images") from None
    rows = [r for r in rows if provider in (None, r.get("provider"))]
    return sorted(rows, key=lambda r: r.get("built", 0), reverse=True)


def record(row: dict) -> None:
    """Add a baked image to ``$HYPER_HOME/images.json`` (written atomically)."""
    rows = list_images()
    rows.append(row)
    path = _records()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rows, indent=2))
    os.replace(tmp, path)


def artifacts(machine_readable: str) -> list[str]:
    """Artifact ids from ``packer build -machine-readable`` output (lines
    ``time,builder,artifact,N,id,VALUE``; an AWS id is ``region:ami-...``)."""
    out = []
    for line in machine_readable.splitlines():
        parts = line.split(",")
        if len(parts) >= 6 and parts[2] == "artifact" and parts[4] == "id":
            out.append(",".join(parts[5:]).replace("%!(PACKER_COMMA)", ","))
    return out


def build(provider: str, gpu: bool = False, variables: dict | None = None,
          log=lambda line: None) -> dict:
    """Bake the node image of ``provider`` with Packer and record it.

    Args:
        provider: ``aws``, ``gcp`` or ``azure``.
        gpu: the GPU variant (NVIDIA driver and container toolkit).
        variables: more Packer variables (``aws_region``, ``gcp_project``, ``prepull``, ...).
        log: receives Packer's progress lines.
    Returns:
        the recorded row (see :func:`list_images`).
    Raises:
        UsageError: unknown provider, no Packer, no templates; CredentialsError: the cloud's
        credentials do not work; InfraError: Packer failed (its last lines are in the message).
    """
    if provider not in SOURCES:
        raise UsageError(f"unknown provider {provider!r}", "one of: aws, gcp, azure")
    packer = shutil.which("packer")
    if packer is None:
        raise UsageError("Packer is not installed",
                         "apt-get install packer, or get it from "
                         "https://developer.hashicorp.com/packer/install")
    from hypercli.providers.cloud_provider import make_api
    v = dict(variables or {})
    region = {"aws": v.get("aws_region", "us-east-1"),  # the template's defaults
              "gcp": v.get("gcp_zone", "us-central1-a").rsplit("-", 1)[0],
              "azure": v.get("azure_location", "eastus")}[provider]
    opts = {"region": region, "project": v.get("gcp_project"),
            "subscription_id": v.get("azure_subscription_id")}
    if provider == "gcp" and not v.get("gcp_project"):
        raise UsageError("baking a GCP image needs the project",
                         "--var gcp_project=PROJECT")
    if provider == "azure" and not v.get("azure_subscription_id"):
        v["azure_subscription_id"] = os.environ.get("AZURE_SUBSCRIPTION_ID", "")
    make_api(provider, opts).check()  # credentials first: a clear error, no half build
    stamp = time.strftime("%Y%m%d%H%M", time.gmtime())
    variant = "gpu" if gpu else "cpu"
    with tempfile.TemporaryDirectory(prefix="hyper-image-") as tmp:
        work = Path(tmp)
        folder = template_folder(packer, work)
        v.update(hyper_version=__version__, variant=variant, stamp=stamp,
                 bundle=str(code_tar(work / "hypercli-bundle.tar")))
        argv = [packer, "build", "-machine-readable", f"-only={SOURCES[provider]}"]
        for k, val in sorted(v.items()):
            argv += ["-var", f"{k}={val}"]
        argv.append(str(folder))
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        lines = []
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            parts = line.split(",")
            if len(parts) >= 5 and parts[2] == "ui":
                log(",".join(parts[4:]).replace("%!(PACKER_COMMA)", ",").rstrip())
        code = proc.wait()
    text = "\n".join(lines)
    ids = artifacts(text)
    if code != 0 or not ids:
        tail = "\n".join(lines[-10:])
        raise InfraError(f"packer build failed (exit {code}):\n{tail}",
                         "run it again with PACKER_LOG=1 for details")
    row = {"provider": provider, "variant": variant, "id": ids[-1],
           "name": f"hyper-node-{variant}-{__version__.replace('.', '-')}-{stamp}",
           "version": __version__, "built": time.time()}
    record(row)
    return row


def scripts_tar(bundle_path: Path | None = None) -> bytes:
    """A tar of ``images/packer/scripts`` (and, when given, the code tar as
    ``hypercli-bundle.tar``) to unpack into a node's provisioning folder."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(packer_dir() / "scripts"), arcname=".")
        if bundle_path is not None:
            tar.add(str(bundle_path), arcname="hypercli-bundle.tar")
    return buf.getvalue()


def provision(conn, *, gpu: bool = False, skip: tuple[str, ...] = (), prepull: str = "",
              env: dict | None = None, timeout: float = 1800) -> list[str]:
    """Run the image's provisioning on a node over its SSH connection (as root; through
    ``sudo -n`` for another user). Idempotent: a second run changes nothing.

    Args:
        conn: a :class:`hypercli.ssh.conn.Connection`.
        skip: steps to leave out (``base``, ``docker``, ``nvidia``, ``goofys``, ``hypercli``,
            ``prepull``, ``ssh``).
        env: more environment for the scripts (paths, for tests).
    Returns:
        the ``hyper-provision: STEP: changed|unchanged|skipped`` lines.
    Raises:
        NodeError (connection), InfraError (a step failed: its output is in the message).
    """
    with tempfile.TemporaryDirectory(prefix="hyper-prov-") as tmp:
        data = scripts_tar(code_tar(Path(tmp) / "hypercli-bundle.tar"))
    d = "/tmp/hyper-provision"
    sudo = "" if conn.target.user == "root" else "sudo -n "
    conn.run(f"rm -rf {d} && mkdir -p {d} && tar -C {d} -xf -", stdin=data, timeout=120)
    vars_ = {"HYPER_VARIANT": "gpu" if gpu else "cpu", "HYPER_BUNDLE": f"{d}/hypercli-bundle.tar",
             "HYPER_PREPULL": prepull, "HYPER_SKIP": " ".join(skip), **(env or {})}
    assign = " ".join(f"{k}={shlex.quote(v)}" for k, v in vars_.items())
    r = conn.run(f"{sudo}env {assign} sh {d}/provision.sh", timeout=timeout)
    return [line for line in r.stdout.decode(errors="replace").splitlines()
            if line.startswith("hyper-provision:")]
