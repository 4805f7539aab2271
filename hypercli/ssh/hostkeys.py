"""Pinned SSH host keys: one known_hosts file per cluster, never trust-on-first-use by accident.

``$HYPER_HOME/known_hosts/<cluster>`` holds the keys hypercli has pinned for a cluster (in
OpenSSH's format); the user's ``~/.ssh/known_hosts`` is read too. A host whose key is in
neither is refused unless the user said ``--trust-new-hosts``, which records the key it saw.
A host whose key differs from the pinned one is always refused. Cloud nodes get a host key that
hypercli generated and injected at boot (``pin``), so they never need trust on first use.
"""

from __future__ import annotations

import base64
import fcntl
import hashlib
import os
import threading
from pathlib import Path

from hypercli.errors import NodeError
from hypercli.state import home


def fingerprint(key) -> str:
    """OpenSSH-style ``SHA256:...`` fingerprint of a paramiko key."""
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


class HostKeyUnknown(NodeError):
    """The host's key is not pinned and trusting new hosts was not asked for."""

    def __init__(self, node: str, target, key, path: Path):
        super().__init__(node, f"host key of {target} is not known ({key.get_name()} "
                         f"{fingerprint(key)})",
                         f"check the fingerprint, then run again with --trust-new-hosts, or add "
                         f"the host's key to {path} or ~/.ssh/known_hosts")


class HostKeyChanged(NodeError):
    """The host presented a key different from the pinned one."""

    def __init__(self, node: str, target, key, expected, path: Path | None = None):
        super().__init__(node, f"host key of {target} CHANGED: it offered {fingerprint(key)}, "
                         f"the pinned key is {fingerprint(expected)}; refusing to connect",
                         "someone may be intercepting the connection; if the host was "
                         f"reinstalled, remove its line from {path or 'known_hosts'}")


class KnownHosts:
    """The pinned keys of one cluster.

    Args:
        cluster: cluster name (file ``$HYPER_HOME/known_hosts/<cluster>``).
        path: another file instead (tests).
    """

    def __init__(self, cluster: str | None = None, path: Path | None = None):
        import paramiko
        if path is None:
            d = home() / "known_hosts"
            d.mkdir(exist_ok=True, mode=0o700)
            path = d / (cluster or "default")
        self.path = Path(path)
        self.keys = paramiko.HostKeys()
        if self.path.exists():
            self.keys.load(str(self.path))
        self.user_keys = paramiko.HostKeys()
        user_file = Path(os.path.expanduser("~/.ssh/known_hosts"))
        if user_file.exists():
            try:
                self.user_keys.load(str(user_file))
            except (OSError, Exception):  # a malformed user file must not stop us
                pass
        self._lock = threading.Lock()
        self._dirty = False

    @staticmethod
    def hostname(host: str, port: int) -> str:
        return host if port == 22 else f"[{host}]:{port}"

    def pin(self, host: str, port: int, key_line: str) -> None:
        """Pin a key given as ``"ssh-ed25519 AAAA..."`` for host:port and save."""
        import paramiko
        kind, b64 = key_line.split()[:2]
        key = paramiko.PKey.from_type_string(kind, base64.b64decode(b64))
        with self._lock:
            self.keys.add(self.hostname(host, port), kind, key)
            self._dirty = True
        self.save_new()

    def install(self, client, *, trust_new: bool, node: str | None = None) -> None:
        """Give a paramiko SSHClient these keys and the matching missing-key policy
        (``node``: the node name used in errors)."""
        import paramiko
        known = self

        class Policy(paramiko.MissingHostKeyPolicy):
            def missing_host_key(self, client, hostname, key):
                if not trust_new:
                    raise HostKeyUnknown(node or hostname, hostname, key, known.path)
                with known._lock:
                    known.keys.add(hostname, key.get_name(), key)
                    known._dirty = True

        hk = client.get_host_keys()
        for source in (self.user_keys, self.keys):
            for name in source.keys():
                for kind, key in source[name].items():
                    hk.add(name, kind, key)
        client.set_missing_host_key_policy(Policy())

    def save_new(self) -> None:
        """Write the file (mode 0600, atomically) when keys were added, merged with what other
        processes pinned meanwhile (under an flock on ``<file>.lock``)."""
        import paramiko
        with self._lock:
            if not self._dirty:
                return
            fd = os.open(str(self.path) + ".lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                merged = paramiko.HostKeys()
                if self.path.exists():
                    merged.load(str(self.path))
                for name in self.keys.keys():
                    for kind, key in self.keys[name].items():
                        merged.add(name, kind, key)
                tmp = self.path.with_suffix(f".tmp{os.getpid()}")
                merged.save(str(tmp))
                os.chmod(tmp, 0o600)
                os.replace(tmp, self.path)
                self.keys = merged
                self._dirty = False
            finally:
                os.close(fd)
