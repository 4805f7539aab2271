"""Object stores behind one small interface: ``file://`` folders and ``s3://`` buckets.

A :class:`Store` holds immutable objects under string keys below the URL's prefix. ``s3://``
goes through boto3, so any S3-compatible endpoint works (``endpoint_url`` argument, or the
``HYPER_S3_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL`` environment variables); credentials come from
boto3's standard chain (environment, profiles, instance roles). ``gs://`` and ``az://`` are
recognised and answered with a clear "not supported yet" error.

Errors: :class:`NotFound` for a missing key, :class:`StoreError` for everything else (both
``InfraError``: exit code 3), always naming the URL.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Iterator, Protocol
from urllib.parse import urlparse

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

    def get_to_file(self, key: str, path: str | os.PathLike) -> int:
        """Stream the object into a local file; returns bytes written. Raises NotFound,
        StoreError."""

    def exists(self, key: str) -> bool:
        """Whether key exists. Raises StoreError when the store cannot be asked."""

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every object whose key starts with prefix."""

    def delete(self, key: str) -> None:
        """Remove key (no error when absent)."""


class FileStore:
    """A folder as an object store; writes are atomic (temp file + rename)."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = "file://" + str(self.root)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise StoreError(f"{self.url}: bad key {key!r}")
        return self.root / key

    def put(self, key: str, data: bytes) -> None:
        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            tmp.write_bytes(data)
            os.replace(tmp, p)
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e.strerror or e}") from None

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        p = self._path(key)
        try:
            p.parent.mkdir(parents=True, exist_ok=True)
            tmp = p.with_name(f".{p.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            shutil.copyfile(path, tmp)
            os.replace(tmp, p)
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e.strerror or e}") from None

    def get(self, key: str) -> bytes:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            raise NotFound(f"{self.url}/{key}: no such object") from None
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e.strerror or e}") from None

    def get_to_file(self, key: str, path: str | os.PathLike) -> int:
        try:
            shutil.copyfile(self._path(key), path)
            return os.path.getsize(path)
        except FileNotFoundError:
            raise NotFound(f"{self.url}/{key}: no such object") from None
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e.strerror or e}") from None

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        base = self.root
        if not base.exists():
            return
        for dirpath, _, files in os.walk(base):
            for f in files:
                if f.endswith(".tmp") and f.startswith("."):
                    continue
                full = Path(dirpath) / f
                key = full.relative_to(base).as_posix()
                if key.startswith(prefix):
                    yield key, full.stat().st_size

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass


class S3Store:
    """An S3 (or S3-compatible) bucket prefix, through boto3.

    Args:
        bucket, prefix: where objects go (``s3://bucket/prefix``).
        endpoint_url: an S3-compatible endpoint, or None for AWS.
    """

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None):
        import boto3
        from botocore.config import Config
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.endpoint_url = endpoint_url
        cfg = Config(retries={"max_attempts": 3, "mode": "standard"}, max_pool_connections=64,
                     connect_timeout=5, read_timeout=60)
        try:
            self.client = boto3.session.Session().client("s3", endpoint_url=endpoint_url,
                                                         config=cfg)
        except ValueError as e:  # botocore: "Invalid endpoint: ..."
            raise UsageError(f"{self.url}: {e}", "give --endpoint-url as http(s)://HOST:PORT"
                             ) from None

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _err(self, key: str, e: Exception) -> StoreError:
        code = getattr(e, "response", {}).get("Error", {}).get("Code")
        if code in ("NoSuchKey", "404", "NotFound"):
            return NotFound(f"{self.url}/{key}: no such object")
        if code in ("NoSuchBucket",):
            return StoreError(f"{self.url}: no such bucket {self.bucket}")
        return StoreError(f"{self.url}/{key}: {e}")

    def put(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except Exception as e:  # botocore raises ClientError, EndpointConnectionError, ...
            raise self._err(key, e) from None

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        try:
            self.client.upload_file(str(path), self.bucket, self._key(key))
        except Exception as e:
            raise self._err(key, e) from None

    def get(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except Exception as e:
            raise self._err(key, e) from None

    def get_to_file(self, key: str, path: str | os.PathLike) -> int:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            n = 0
            with open(path, "wb") as f:
                for block in body.iter_chunks(1 << 20):
                    f.write(block)
                    n += len(block)
            return n
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e}") from None
        except Exception as e:
            raise self._err(key, e) from None

    def exists(self, key: str) -> bool:
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            err = self._err(key, e)
            if isinstance(err, NotFound):
                return False
            raise err from None

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self._key(prefix))
            strip = len(self.prefix) + 1 if self.prefix else 0
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][strip:], obj["Size"]
        except Exception as e:
            raise self._err(prefix, e) from None

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as e:
            raise self._err(key, e) from None


def open_store(url: str, *, endpoint_url: str | None = None) -> Store:
    """The store of a URL: ``file:///abs/path``, ``s3://bucket/prefix``.

    Args:
        endpoint_url: S3-compatible endpoint; default ``$HYPER_S3_ENDPOINT_URL`` or
            ``$AWS_ENDPOINT_URL`` when set, else AWS.
    Raises:
        UsageError: an unknown or unsupported scheme, or a URL without bucket.
    """
    u = urlparse(url)
    if u.scheme == "file":
        return FileStore(u.netloc + u.path if u.netloc else u.path)
    if u.scheme == "s3":
        if not u.netloc:
            raise UsageError(f"{url}: no bucket", "write s3://BUCKET/PREFIX")
        endpoint_url = (endpoint_url or os.environ.get("HYPER_S3_ENDPOINT_URL")
                        or os.environ.get("AWS_ENDPOINT_URL"))
        return S3Store(u.netloc, u.path, endpoint_url)
    if u.scheme in ("gs", "az"):
        raise UsageError(f"{url}: {u.scheme}:// stores are not supported yet",
                         "use s3:// (any S3-compatible endpoint) or file://")
    raise UsageError(f"{url}: unknown store scheme {u.scheme!r}",
                     "use s3://BUCKET/PREFIX or file:///PATH")
