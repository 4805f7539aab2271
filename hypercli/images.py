"""Node images: bake them with Packer (``images/packer``), list them, and provision hosts that
have no baked image over SSH with the same scripts.

* :func:`build` runs ``packer build -machine-readable -only=<source>`` on ``images/packer`` for
  one cloud with the hypercli version, the variant (cpu/gpu), a build stamp and a tar of
  hypercli's code (the one SSH nodes get, :mod:`hypercli.node.bundle`), after checking that
  Packer is there and the cloud's credentials work; it reads the artifact id from Packer's
  machine-readable output and records the image in ``$HYPER_HOME/images.json``. Images are
  named ``hyper-node-<variant>-<version>-<stamp>`` (:func:`image_name`) and tagged the way the
  providers look them up (:mod:`hypercli.providers.cloud`).
* :func:`list_images` reads that record (the clouds themselves are not asked).
* :func:`provision` sends ``images/packer/scripts`` and the code tar to one node over its SSH
  connection and runs ``provision.sh`` as root; :func:`bootstrap` does it on many nodes at once
  (``hyper up --bootstrap``). Every step is idempotent: a second run changes nothing.

Packer versions: a current Packer (1.7 or later) reads ``plugins.pkr.hcl`` and needs
``packer init images/packer`` once. Debian's Packer 1.6.6 has the three builders built in and
does not understand ``required_plugins``: for it the template folder is copied without that
file (:func:`template_folder`). ``images/packer/README.md`` says more.
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
#: provider → the template's source for ``packer build -only=``
SOURCES = {"aws": "amazon-ebs.node", "gcp": "googlecompute.node", "azure": "azure-arm.node"}
#: steps of ``provision.sh`` that download (left out by ``--offline``)
DOWNLOAD_STEPS = ("base", "docker", "nvidia", "goofys", "prepull", "engines")
#: variables that :func:`build` sets itself
OWN_VARIABLES = ("hyper_version", "variant", "stamp", "bundle")
PACKER_HINT = ("apt-get install packer (Debian, Ubuntu), or download it from "
               "https://developer.hashicorp.com/packer/install")


class ProvisionError(InfraError):
    """Provisioning failed on some nodes (exit 3). ``results`` maps every node to its
    ``hyper-provision:`` lines or to its error; what succeeded stays done."""

    def __init__(self, message: str, hint: str | None, results: dict):
        super().__init__(message, hint)
        self.results = results


# -- names ----------------------------------------------------------------------------------
def image_name(variant: str, version: str, stamp: str) -> str:
    """``hyper-node-<variant>-<version>-<stamp>``, the version in ``[a-z0-9-]`` (other
    characters ``-``, at most 24): valid on all three clouds. ``node.pkr.hcl`` uses the same
    rule (``local.name``)."""
    slug = re.sub(r"[^a-z0-9]", "-", version.lower())[:24]
    return f"hyper-node-{variant}-{slug}-{stamp}"


def new_stamp(now: float | None = None) -> str:
    """The build stamp: UTC ``YYYYMMDDhhmmss`` of ``now`` (unix s, default: the time now)."""
    return time.strftime("%Y%m%d%H%M%S", time.gmtime(now))


# -- Packer ---------------------------------------------------------------------------------
def packer_dir() -> Path:
    """The template folder. Raises UsageError when hypercli is installed without it."""
    if not (PACKER_DIR / "node.pkr.hcl").exists():
        raise UsageError(f"no Packer templates at {PACKER_DIR}",
                         "run hyper from a checkout of hypercli (images/packer)")
    return PACKER_DIR


def find_packer() -> str:
    """The ``packer`` executable on PATH. Raises UsageError saying how to install it."""
    packer = shutil.which("packer")
    if packer is None:
        raise UsageError("Packer is not installed (no `packer` on PATH)", PACKER_HINT)
    return packer


def packer_version(packer: str) -> tuple[int, ...]:
    """``packer version`` as a tuple, e.g. (1, 6, 6). Raises UsageError when it cannot run."""
    try:
        out = subprocess.run([packer, "version"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot run {packer}: {e}", PACKER_HINT) from None
    m = re.search(r"(\d+)\.(\d+)\.(\d+)", out)
    if not m:
        raise UsageError(f"{packer} printed no version ({out.strip()[:100]!r})", PACKER_HINT)
    return tuple(int(x) for x in m.groups())


def template_folder(packer: str, work: Path) -> Path:
    """The folder to give ``packer``: ``images/packer`` itself for Packer ≥ 1.7, else a copy
    in ``work`` without ``plugins.pkr.hcl`` (module docstring)."""
    src = packer_dir()
    if packer_version(packer) >= (1, 7, 0):
        return src
    dest = work / "packer"
    shutil.copytree(src, dest, ignore=shutil.ignore_patterns("plugins.pkr.hcl", "*.md"))
    return dest


def artifacts(machine_readable: str) -> list[str]:
    """Artifact ids in ``packer build -machine-readable`` output, lines
    ``time,source,artifact,N,id,VALUE`` (AWS: ``region:ami-...``; GCP: the image name; Azure:
    the managed image's resource id). Packer writes a comma in a value as ``%!(PACKER_COMMA)``
    (https://developer.hashicorp.com/packer/docs/commands#machine-readable-output)."""
    out = []
    for line in machine_readable.splitlines():
        parts = line.split(",")
        if len(parts) >= 6 and parts[2] == "artifact" and parts[4] == "id":
            out.append(",".join(parts[5:]).replace("%!(PACKER_COMMA)", ","))
    return out


def _ui_text(line: str) -> str | None:
    """The message of a machine-readable ``ui`` line (``time,,ui,say,TEXT``), else None."""
    parts = line.rstrip("\n").split(",")
    if len(parts) >= 5 and parts[2] == "ui":
        return (",".join(parts[4:]).replace("%!(PACKER_COMMA)", ",")
                .replace("\\n", "\n").replace("\\r", "").rstrip())
    return None


# -- the record -----------------------------------------------------------------------------
def _records() -> Path:
    return S.home() / "images.json"


def list_images(provider: str | None = None) -> list[dict]:
    """Images baked here (read from ``$HYPER_HOME/images.json``), newest first. A row:
    ``{"provider", "variant", "name", "id", "version", "location", "stamp", "built"}``
    (location: the AWS region, GCP project or Azure location; built: unix s). Raises
    StateError for an unreadable record."""
    path = _records()
    try:
        rows = json.loads(path.read_text()) if path.exists() else []
        if not isinstance(rows, list):
            raise ValueError("not a JSON list")
    except (OSError, ValueError) as e:
        raise S.StateError(f"{path}: {e}", "move the file away; it only lists images") from None
    rows = [r for r in rows if isinstance(r, dict) and provider in (None, r.get("provider"))]
    return sorted(rows, key=lambda r: r.get("built", 0), reverse=True)


def record(row: dict) -> None:
    """Add a baked image (a row of :func:`list_images`) to the record, written atomically."""
    rows = list_images()
    rows.append(row)
    path = _records()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(rows, indent=2) + "\n")
    os.replace(tmp, path)


# -- build ----------------------------------------------------------------------------------
def code_tar(path: Path) -> Path:
    """Write the tar of hypercli's code that nodes run (hypercli + mfusepy,
    :func:`hypercli.node.bundle.bundle`) to ``path``; returns ``path``."""
    from hypercli.node.bundle import bundle
    _, data = bundle()
    path.write_bytes(data)
    return path


def _cloud_settings(provider: str, v: dict) -> None:
    """Fill in the region/project/subscription both Packer and hypercli's check use, check
    the way Packer will sign in, then check the cloud's credentials with hypercli's own client
    (:meth:`hypercli.providers.cloud.CloudAPI.check`). Changes ``v`` in place.

    Raises:
        UsageError: Azure with neither a service principal nor the Azure CLI; a missing SDK.
        CredentialsError: the credentials are missing or refused (the hint says how to set
        them up). CloudError: the check could not be made.
    """
    from hypercli.providers.cloud_provider import make_api
    if provider == "aws":
        v.setdefault("aws_region", os.environ.get("AWS_REGION")
                     or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1")
        make_api("aws", {"region": v["aws_region"]}).check()
    elif provider == "gcp":
        v.setdefault("gcp_zone", "us-central1-a")
        api = make_api("gcp", {"region": v["gcp_zone"].rsplit("-", 1)[0],
                               "project": v.get("gcp_project")})
        api.check()
        v.setdefault("gcp_project", api.project)
    else:
        if not (os.environ.get("AZURE_CLIENT_ID") or v.get("azure_client_id")) \
                and shutil.which("az") is None:
            raise UsageError("Packer's Azure builder signs in with a service principal or the "
                             "Azure CLI, and there is neither",
                             "set AZURE_CLIENT_ID, AZURE_CLIENT_SECRET and AZURE_TENANT_ID, "
                             "or install the Azure CLI and run `az login`")
        v.setdefault("azure_location", "eastus")
        api = make_api("azure", {"region": v["azure_location"],
                                 "subscription_id": v.get("azure_subscription_id")})
        api.check()
        v.setdefault("azure_subscription_id", api.subscription)


def build(provider: str, gpu: bool = False, variables: dict | None = None,
          log=lambda text: None) -> dict:
    """Bake the node image of ``provider`` with Packer and record it.

    Args:
        provider: ``aws``, ``gcp`` or ``azure``.
        gpu: the GPU variant (NVIDIA driver and container toolkit).
        variables: more template variables, name → value (``aws_region``, ``gcp_project``,
            ``gcp_zone``, ``azure_resource_group``, ``azure_location``, ``prepull``,
            ``disk_gb``, ...; see ``images/packer/node.pkr.hcl``).
        log: called with each message Packer prints while it builds (str).
    Returns:
        the recorded row (see :func:`list_images`).
    Raises:
        UsageError: unknown provider, a variable hyper sets itself, no Packer, no templates;
        CredentialsError: the cloud's credentials are missing or refused; InfraError: Packer
        failed (its last lines are in the message).
    """
    if provider not in SOURCES:
        raise UsageError(f"unknown provider {provider!r}", "one of: aws, gcp, azure")
    v = {k: str(val) for k, val in (variables or {}).items()}
    own = sorted(set(v) & set(OWN_VARIABLES))
    if own:
        raise UsageError(f"{', '.join(own)}: set by hyper image build itself",
                         "leave them out (--gpu chooses the variant)")
    packer = find_packer()
    version = packer_version(packer)
    _cloud_settings(provider, v)  # credentials first: a clear error, no half-made build
    stamp = new_stamp()
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
        lines: list[str] = []
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace") as proc:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                text = _ui_text(line)
                if text:
                    log(text)
            code = proc.wait()
    ids = artifacts("\n".join(lines))
    if code != 0 or not ids:
        tail = "\n".join(filter(None, (_ui_text(x) or x for x in lines[-10:])))
        hint = "run it again with PACKER_LOG=1 for Packer's own log"
        if version >= (1, 7, 0) and re.search(r"(?i)plugin|unknown source type", tail):
            hint = f"install the plugins first: packer init {packer_dir()}"
        raise InfraError(f"packer build failed (exit {code}):\n{tail}", hint)
    row = {"provider": provider, "variant": variant, "id": ids[-1],
           "name": image_name(variant, __version__, stamp), "version": __version__,
           "location": {"aws": v.get("aws_region"), "gcp": v.get("gcp_project"),
                        "azure": v.get("azure_location")}[provider],
           "stamp": stamp, "built": time.time()}
    record(row)
    return row


# -- provisioning over SSH ------------------------------------------------------------------
def scripts_tar(bundle_path: Path | None = None) -> bytes:
    """A tar of ``images/packer/scripts`` (plus, when given, the code tar as
    ``hypercli-bundle.tar``) to unpack in a node's provisioning folder."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(str(packer_dir() / "scripts"), arcname=".")
        if bundle_path is not None:
            tar.add(str(bundle_path), arcname="hypercli-bundle.tar")
    return buf.getvalue()


def _payload() -> bytes:
    with tempfile.TemporaryDirectory(prefix="hyper-prov-") as tmp:
        return scripts_tar(code_tar(Path(tmp) / "hypercli-bundle.tar"))


def provision(conn, *, variant: str = "auto", skip: tuple[str, ...] = (), prepull: str = "",
              env: dict | None = None, timeout: float = 1800,
              payload: bytes | None = None) -> list[str]:
    """Run the image's provisioning on a node over its SSH connection, as root (through
    ``sudo -n`` for another user), in one command: the scripts and the code tar go in on
    stdin to a new folder under ``/tmp``, which is removed afterwards. Idempotent.

    Args:
        conn: a :class:`hypercli.ssh.conn.Connection`.
        variant: ``cpu``, ``gpu`` or ``auto`` (gpu when the host has an NVIDIA PCI device).
        skip: steps to leave out (``base``, ``docker``, ``nvidia``, ``goofys``, ``hypercli``,
            ``prepull``, ``ssh``; ``DOWNLOAD_STEPS`` are those that download).
        prepull: container images to pull, separated by spaces.
        env: more environment for the scripts (``HYPER_PREFIX`` ... where files go; see
            ``provision.sh``).
        timeout: s for the whole run.
        payload: the tar to send (default: :func:`scripts_tar` with the code tar).
    Returns:
        the ``hyper-provision: STEP: changed (...)|unchanged|skipped (...)`` lines.
    Raises:
        NodeError: the connection failed. InfraError: a step failed (its output is in the
        message; the steps before it stay done).
    """
    from hypercli.ssh.conn import CommandFailed
    data = payload if payload is not None else _payload()
    sudo = "" if conn.target.user == "root" else "sudo -n "
    values = {"HYPER_VARIANT": variant, "HYPER_PREPULL": prepull, "HYPER_SKIP": " ".join(skip),
              **(env or {})}
    assign = " ".join(f"{k}={shlex.quote(str(val))}" for k, val in values.items())
    script = ('d=$(mktemp -d /tmp/hyper-provision.XXXXXX) && tar -C "$d" -xf - && '
              f'{sudo}env {assign} HYPER_BUNDLE="$d/hypercli-bundle.tar" sh "$d/provision.sh"; '
              'rc=$?; [ -n "${d:-}" ] && rm -rf "$d"; exit $rc')
    try:
        r = conn.run(f"sh -c {shlex.quote(script)}", stdin=data, timeout=timeout)
    except CommandFailed as e:
        out = e.result.stdout.decode(errors="replace").splitlines()
        done = [line for line in out if line.startswith("hyper-provision:")]
        err = "\n".join(e.result.stderr.decode(errors="replace").splitlines()[-8:])
        raise InfraError(f"node {conn.name}: provisioning failed (exit {e.result.exit_code})"
                         + (f" after: {done[-1]}" if done else "") + (f"\n{err}" if err else ""),
                         "fix the cause and run it again: finished steps are not redone"
                         ) from None
    return [line for line in r.stdout.decode(errors="replace").splitlines()
            if line.startswith("hyper-provision:")]


def bootstrap(conns: dict, *, offline: bool = False, variant: str = "auto",
              skip: tuple[str, ...] = (), prepull: str = "", env: dict | None = None,
              timeout: float = 1800) -> dict[str, list[str]]:
    """Provision many nodes at once (``hyper up --bootstrap``), each as :func:`provision`.

    Args:
        conns: node name → :class:`hypercli.ssh.conn.Connection`.
        offline: also leave out the steps that download (``DOWNLOAD_STEPS``).
        variant, skip, prepull, env, timeout: as :func:`provision`.
    Returns:
        node name → its ``hyper-provision:`` lines.
    Raises:
        ProvisionError: some nodes failed; its ``results`` has every node's lines or error.
    """
    from hypercli.ssh.fanout import fan_out
    payload = _payload()
    steps = tuple(dict.fromkeys((*skip, *(DOWNLOAD_STEPS if offline else ()))))
    res = fan_out(list(conns), lambda name: provision(
        conns[name], variant=variant, skip=steps, prepull=prepull, env=env, timeout=timeout,
        payload=payload))
    if res.failed:
        names = sorted(res.failed)
        first = res.failed[names[0]]
        raise ProvisionError(f"provisioning failed on {len(names)} of {len(res)} nodes "
                             f"({', '.join(names)}): {first}",
                             getattr(first, "hint", None), dict(res))
    return dict(res.ok)
