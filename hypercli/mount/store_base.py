"""What every object store shares: the :class:`Store` interface, its errors, and the helpers
the cloud stores (:mod:`hypercli.mount.store_gcs`, :mod:`hypercli.mount.store_azure`) use.

Nothing here opens a store (:func:`hypercli.mount.store.open_store` does); this module
imports no SDK and no other store module.
"""

from __future__ import annotations

import os
import re
import threading
from typing import Iterator, Protocol

from hypercli.errors import InfraError, UsageError


class StoreError(InfraError):
    """An object store operation failed (message names the URL and the reason)."""


class NotFound(StoreError):
    """The key does not exist."""


class Store(Protocol):
    """Immutable objects under keys (``chunks/ab12...``); ``url`` is the prefix's URL."""

    url: str

    def put(self, key: str, data: bytes) -> None:
        """Store bytes under key (overwrites). Raises StoreError."""

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Store a local file under key, streamed. Raises StoreError."""

    def get(self, key: str) -> bytes:
        """The whole object. Raises NotFound, StoreError."""

    def get_to_file(self, key: str, path: str | os.PathLike, digest=None) -> int:
        """Stream the object into a local file; returns bytes written. ``digest``: a
        hashlib object also fed the bytes as they are written (one pass over them). Raises
        NotFound, StoreError."""

    def exists(self, key: str) -> bool:
        """Whether key exists. Raises StoreError when the store cannot be asked."""

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every object whose key starts with prefix."""

    def delete(self, key: str) -> None:
        """Remove key (no error when absent)."""


class DigestWriter:
    """A binary file that also feeds what is written to a hashlib object (``digest``); any
    other attribute is the file's. A write anywhere but at the end of what was written
    before (an SDK that seeks back to retry a part) spoils the digest for good, so it can
    never match the file's bytes by accident: callers check a mismatch against the file."""

    def __init__(self, f, digest):
        self._f, self._digest, self._written = f, digest, 0

    def write(self, data) -> int:
        if self._f.tell() != self._written:
            self._digest.update(b"\0not written in order")
        n = self._f.write(data)
        self._digest.update(data)
        self._written = self._f.tell()
        return n

    def __getattr__(self, name):
        return getattr(self._f, name)


# -- shared by the cloud stores (store_gcs, store_azure) -----------------------------------
class PerThread:
    """One object per thread, made by ``factory()`` at a thread's first :meth:`get`.

    For SDK clients that sit on one ``requests.Session``: requests does not promise a Session
    is thread-safe (psf/requests#2766), and its pool keeps 10 connections, fewer than the 16
    threads of a push or pull.
    """

    def __init__(self, factory):
        self._factory = factory
        self._local = threading.local()

    def get(self):
        obj = getattr(self._local, "obj", None)
        if obj is None:
            obj = self._local.obj = self._factory()
        return obj


def sdk_missing(scheme: str, extra: str, err: ImportError) -> UsageError:
    """The error for a store whose SDK is not installed, naming the pip extra to install."""
    return UsageError(f"{scheme}:// stores need a package that is not installed ({err})",
                      f"pip install 'hypercli[{extra}]'")


_ERRNO_TEXT = re.compile(r"\[Errno -?\d+\] ([^'\")]+)")


def network_reason(e: BaseException) -> str:
    """A short reason for a failed connection, from an exception whose text may wrap
    urllib3's (``... [Errno 111] Connection refused ...`` → ``Connection refused``)."""
    text = str(e)
    m = _ERRNO_TEXT.search(text)
    if m:
        return m.group(1).strip()
    if "timed out" in text.lower():
        return "timed out"
    return text.splitlines()[0][:200] if text else type(e).__name__
