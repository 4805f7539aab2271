"""The node runtime: hypercli's own code, copied to a node that has no hypercli installed.

Baked node images have hypercli installed (``images/packer``); an SSH host usually does not.
For what must run *on* the node — the chunked FUSE mount, pushing a task's outputs to object
storage, pulling the outputs of earlier experiments — hypercli copies itself there once: a tar
of the ``hypercli`` package plus ``mfusepy`` (one pure-Python file), unpacked into
``~/.hyper/lib/<hash>/`` and run as ``PYTHONPATH=... python3 -m hypercli.mount.node``. Third-party
packages with data files (boto3) must come from the node's Python (Debian: python3-boto3).
"""

from __future__ import annotations

import functools
import hashlib
import io
import tarfile
from pathlib import Path

import hypercli


@functools.lru_cache(maxsize=1)
def bundle() -> tuple[str, bytes]:
    """(12-hex-digit content hash, tar bytes) of the runtime described above."""
    pkg = Path(hypercli.__file__).parent
    files: list[tuple[str, Path]] = []
    for p in sorted(pkg.rglob("*.py")):
        files.append((f"hypercli/{p.relative_to(pkg).as_posix()}", p))
    try:
        import mfusepy
        files.append(("mfusepy.py", Path(mfusepy.__file__)))
    except ImportError:
        pass
    h = hashlib.sha256()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, path in files:
            data = path.read_bytes()
            h.update(name.encode() + b"\0" + data)
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    return h.hexdigest()[:12], buf.getvalue()


def remote_python(root: str) -> str:
    """Shell words that run the bundled node commands on a node whose hypercli root is
    ``root``: ``PYTHONPATH=<root>/lib/<hash> python3 -m hypercli.mount.node``."""
    digest, _ = bundle()
    return f"PYTHONPATH={root}/lib/{digest} python3 -m hypercli.mount.node"
