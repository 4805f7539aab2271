"""Object stores behind one small interface: ``file://`` folders, ``s3://``, ``gs://`` and
``az://`` buckets.

A :class:`Store` holds immutable objects under string keys below the URL's prefix. ``s3://``
goes through boto3, so any S3-compatible endpoint works (``endpoint_url`` argument, or the
``HYPER_S3_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL`` environment variables); credentials come from
boto3's standard chain (environment, profiles, instance roles). ``gs://bucket/prefix`` is
Google Cloud Storage (:mod:`hypercli.mount.store_gcs`) and ``az://account/container/prefix``
Azure Blob Storage (:mod:`hypercli.mount.store_azure`); their SDKs are imported only when such
a URL is opened, so ``hyper --help`` loads none of them.

Errors: :class:`NotFound` for a missing key, :class:`StoreError` for everything else (both
``InfraError``: exit code 3), always naming the URL. The interface, the errors and what the
stores share live in :mod:`hypercli.mount.store_base`, which every store module imports (and
this one re-exports), so imports run one way: this module → the cloud stores → the base.
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path
from typing import Iterator
from urllib.parse import urlparse

from hypercli.errors import UsageError
from hypercli.mount.store_base import (DigestWriter, NotFound, PerThread, Store,  # noqa: F401
                                       StoreError, network_reason, sdk_missing)


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

    def get_to_file(self, key: str, path: str | os.PathLike, digest=None) -> int:
        try:
            if digest is None:
                shutil.copyfile(self._path(key), path)
                return os.path.getsize(path)
            with open(self._path(key), "rb") as src, open(path, "wb") as dst:
                shutil.copyfileobj(src, DigestWriter(dst, digest), 1 << 20)
                return dst.tell()
        except FileNotFoundError:
            raise NotFound(f"{self.url}/{key}: no such object") from None
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e.strerror or e}") from None

    def iter_chunks(self, key: str, size: int = 1 << 20, start: int = 0,
                    length: int | None = None) -> Iterator[bytes]:
        """The object's bytes from ``start`` (``length`` of them, default to the end),
        ``size`` at a time, as they are read. Raises NotFound, StoreError."""
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                left = length if length is not None else -1
                while left:
                    data = f.read(size if left < 0 else min(size, left))
                    if not data:
                        return
                    left -= len(data) if left > 0 else 0
                    yield data
        except FileNotFoundError:
            raise NotFound(f"{self.url}/{key}: no such object") from None
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e.strerror or e}") from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from byte ``start`` of the object. Raises NotFound, StoreError."""
        try:
            with open(self._path(key), "rb") as f:
                f.seek(start)
                return f.read(length)
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

    def get_to_file(self, key: str, path: str | os.PathLike, digest=None) -> int:
        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
            with open(path, "wb") as f:
                out = f if digest is None else DigestWriter(f, digest)
                for block in body.iter_chunks(1 << 20):
                    out.write(block)
                return f.tell()
        except OSError as e:
            raise StoreError(f"{self.url}/{key}: {e}") from None
        except Exception as e:
            raise self._err(key, e) from None

    def iter_chunks(self, key: str, size: int = 1 << 20, start: int = 0,
                    length: int | None = None) -> Iterator[bytes]:
        """The object's bytes from ``start`` (``length`` of them, default to the end; an
        HTTP Range request), ``size`` at a time, as they arrive. Raises NotFound,
        StoreError."""
        try:
            kw = {}
            if start or length is not None:
                end = "" if length is None else str(start + length - 1)
                kw["Range"] = f"bytes={start}-{end}"
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(key), **kw)["Body"]
            yield from body.iter_chunks(size)
        except Exception as e:
            raise self._err(key, e) from None

    def get_range(self, key: str, start: int, length: int) -> bytes:
        """``length`` bytes from byte ``start`` of the object (an HTTP Range request).
        Raises NotFound, StoreError."""
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key),
                                          Range=f"bytes={start}-{start + length - 1}"
                                          )["Body"].read()
        except Exception as e:
            raise self._err(key, e) from None

    def exists(self, key: str) -> bool:
        """Whether the object is there. A 403 answer counts as "not there": S3 answers a
        HEAD of a missing key with 404 only to a caller that may list the bucket without
        naming a prefix, and a cloud node may list only under its own prefixes
        (``hypercli.providers.aws.storage_policy``); a key the caller may not read at all
        fails at the read or write that follows."""
        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except Exception as e:
            code = getattr(e, "response", {}).get("Error", {}).get("Code")
            if code in ("403", "AccessDenied", "Forbidden"):
                return False
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


#: the URL schemes :func:`open_store` opens (``hyper data --help`` names each)
SCHEMES = ("s3", "gs", "az", "file")


def open_store(url: str, *, endpoint_url: str | None = None) -> Store:
    """The store of a URL: ``file:///abs/path``, ``s3://bucket/prefix``, ``gs://bucket/prefix``
    or ``az://account/container/prefix``.

    Args:
        endpoint_url: the store's API endpoint, ``http(s)://HOST:PORT`` (an S3-compatible
            server, a GCS or Azure Blob emulator). Default per scheme: s3 —
            ``$HYPER_S3_ENDPOINT_URL`` or ``$AWS_ENDPOINT_URL``, else AWS; gs —
            ``$HYPER_GCS_ENDPOINT_URL`` or ``$STORAGE_EMULATOR_HOST``, else Google; az —
            ``$HYPER_AZURE_STORAGE_ENDPOINT_URL``, else the connection string's endpoint or
            ``https://ACCOUNT.blob.core.windows.net``.
    Raises:
        UsageError: an unknown scheme, a URL without bucket (or account and container), or
            the scheme's SDK not installed (the message names the pip extra).
        StoreError: no credentials for a gs:// or az:// store (the hint says how to set them).
    """
    u = urlparse(url)
    env = os.environ.get
    if u.scheme == "file":
        return FileStore(u.netloc + u.path if u.netloc else u.path)
    if u.scheme == "s3":
        if not u.netloc:
            raise UsageError(f"{url}: no bucket", "write s3://BUCKET/PREFIX")
        endpoint_url = (endpoint_url or env("HYPER_S3_ENDPOINT_URL") or env("AWS_ENDPOINT_URL"))
        return S3Store(u.netloc, u.path, endpoint_url)
    if u.scheme == "gs":
        if not u.netloc:
            raise UsageError(f"{url}: no bucket", "write gs://BUCKET/PREFIX")
        from hypercli.mount.store_gcs import GCSStore
        endpoint_url = (endpoint_url or env("HYPER_GCS_ENDPOINT_URL")
                        or env("STORAGE_EMULATOR_HOST"))
        return GCSStore(u.netloc, u.path, endpoint_url)
    if u.scheme == "az":
        container, _, prefix = u.path.lstrip("/").partition("/")
        if not u.netloc or not container:
            raise UsageError(f"{url}: no {'account' if not u.netloc else 'container'}",
                             "write az://ACCOUNT/CONTAINER/PREFIX")
        from hypercli.mount.store_azure import AzureBlobStore
        endpoint_url = endpoint_url or env("HYPER_AZURE_STORAGE_ENDPOINT_URL")
        return AzureBlobStore(u.netloc, container, prefix, endpoint_url)
    raise UsageError(f"{url}: unknown store scheme {u.scheme!r}",
                     "use s3://BUCKET/PREFIX, gs://BUCKET/PREFIX, "
                     "az://ACCOUNT/CONTAINER/PREFIX or file:///PATH")
