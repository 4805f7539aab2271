"""``gs://bucket/prefix``: Google Cloud Storage behind the :class:`~hypercli.mount.store.Store`
interface, through google-cloud-storage (``pip install 'hypercli[gcp]'``).

Credentials are Google application default credentials (``google.auth.default()``: the
``GOOGLE_APPLICATION_CREDENTIALS`` key file, ``gcloud auth application-default login``, or the
VM's service account). With an endpoint (``HYPER_GCS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``,
or the ``endpoint_url`` argument: an emulator such as gcp-storage-emulator) the project is
``$GOOGLE_CLOUD_PROJECT`` or ``hypercli`` and requests are anonymous, unless
``GCE_METADATA_HOST`` names a metadata server: then they carry the token of the VM's service
account from it (google-auth's Compute Engine credentials), as on a node.

Semantics match :class:`~hypercli.mount.store.S3Store`: a missing object is
:class:`~hypercli.mount.store.NotFound` (a missing bucket is a StoreError), ``exists`` is False
for both, ``delete`` of a missing object is no error. Every operation retries transient
failures (connection errors, 429, 5xx) for up to :data:`RETRY_SECONDS`; uploads are retried
too, which is safe because every object hypercli writes is written whole and the same bytes
go under the same key. Each thread gets its own client (:class:`~hypercli.mount.store.PerThread`)
sharing one set of credentials. Downloads stream to the file; uploads go in
:data:`UPLOAD_PART` pieces (a resumable upload), so neither holds a whole chunk in memory.
"""

from __future__ import annotations

import os
from typing import Iterator

from hypercli.mount.store_base import (DigestWriter, NotFound, PerThread, StoreError,
                                       network_reason, sdk_missing)

MiB = 1 << 20
#: seconds an operation keeps retrying transient failures (google-api-core exponential
#: backoff, 1 s doubling); the SDK's own default is 120 s
RETRY_SECONDS = 20.0
#: (connect, read) timeout of one request, seconds
TIMEOUT = (5.0, 60.0)
#: bytes per request of an upload above 8 MiB (a multiple of 256 KiB, the GCS rule); the
#: part size of boto3's multipart uploads
UPLOAD_PART = 8 * MiB
DEFAULT_ENDPOINT = "https://storage.googleapis.com"
CREDENTIALS_HINT = ("set Google application default credentials: `gcloud auth "
                    "application-default login`, or GOOGLE_APPLICATION_CREDENTIALS=KEY.json "
                    "(a service account key), or run on a VM with a service account")


def _sdk():
    """(storage module, api_core exceptions, google.auth module, storage DEFAULT_RETRY).

    Raises UsageError naming ``hypercli[gcp]`` when google-cloud-storage is missing."""
    try:
        import google.auth
        import google.auth.exceptions
        from google.api_core import exceptions
        from google.cloud import storage
        from google.cloud.storage.retry import DEFAULT_RETRY
    except ImportError as e:
        raise sdk_missing("gs", "gcp", e) from None
    return storage, exceptions, google.auth, DEFAULT_RETRY


class GCSStore:
    """A Google Cloud Storage bucket prefix.

    Args:
        bucket, prefix: where objects go (``gs://bucket/prefix``; prefix may be empty).
        endpoint_url: the JSON API's endpoint ``http(s)://HOST:PORT`` (an emulator), or None
            for Google with application default credentials.
    Raises:
        StoreError: no application default credentials (hint: how to set them).
        UsageError: google-cloud-storage is not installed.
    """

    def __init__(self, bucket: str, prefix: str, endpoint_url: str | None = None):
        storage, self._exc, gauth, default_retry = _sdk()
        self.bucket, self.prefix = bucket, prefix.strip("/")
        self.url = f"gs://{bucket}/{self.prefix}".rstrip("/")
        if endpoint_url and "://" not in endpoint_url:  # STORAGE_EMULATOR_HOST=host:port
            endpoint_url = "http://" + endpoint_url
        self.endpoint = (endpoint_url or DEFAULT_ENDPOINT).rstrip("/")
        if endpoint_url and os.environ.get("GCE_METADATA_HOST"):
            from google.auth import compute_engine
            creds = compute_engine.Credentials()
            project = os.environ.get("GOOGLE_CLOUD_PROJECT") or "hypercli"
            options = {"api_endpoint": self.endpoint}
        elif endpoint_url:
            from google.auth.credentials import AnonymousCredentials
            creds = AnonymousCredentials()
            project = os.environ.get("GOOGLE_CLOUD_PROJECT") or "hypercli"
            options = {"api_endpoint": self.endpoint}
        else:
            try:
                creds, project = gauth.default(
                    scopes=["https://www.googleapis.com/auth/devstorage.read_write"])
            except gauth.exceptions.GoogleAuthError as e:
                raise StoreError(f"{self.url}: no Google credentials ({_first_line(e)})",
                                 CREDENTIALS_HINT) from None
            options = None
        self._retry = (default_retry.with_timeout if hasattr(default_retry, "with_timeout")
                       else default_retry.with_deadline)(RETRY_SECONDS)
        self._clients = PerThread(lambda: storage.Client(
            project=project, credentials=creds, client_options=options))

    # -- helpers --------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _blob(self, key: str, chunk_size: int | None = None):
        return self._clients.get().bucket(self.bucket).blob(self._key(key),
                                                            chunk_size=chunk_size)

    def _err(self, key: str, e: BaseException, *, missing: str = "object") -> StoreError:
        """The StoreError for an SDK exception. ``missing``: what a 404 means here —
        "object" (NotFound, unless the text says the bucket is missing) or "bucket"."""
        where = f"{self.url}/{key}" if key else self.url
        exc = self._exc
        if isinstance(e, exc.RetryError) and e.cause is not None:
            e = e.cause
        if isinstance(e, exc.NotFound):
            if missing == "bucket" or "bucket does not exist" in str(e).lower():
                return StoreError(f"{self.url}: no such bucket {self.bucket}",
                                  "create it, or check the bucket name")
            return NotFound(f"{where}: no such object")
        if isinstance(e, (exc.Unauthorized, exc.Forbidden)):
            return StoreError(f"{where}: permission denied ({_api_message(e)})",
                              CREDENTIALS_HINT)
        if isinstance(e, exc.GoogleAPICallError):
            return StoreError(f"{where}: HTTP {e.code}: {_api_message(e)}")
        if _is_auth_error(e):
            return StoreError(f"{where}: Google credentials failed ({_first_line(e)})",
                              CREDENTIALS_HINT)
        if type(e).__name__ == "DataCorruption":
            return StoreError(f"{where}: checksum mismatch ({_first_line(e)})")
        if _is_requests_error(e):  # before OSError: requests' errors are IOErrors
            if "Timeout" in type(e).__name__:
                return StoreError(f"{where}: {self.endpoint} did not answer in time")
            return StoreError(f"{where}: Could not connect to {self.endpoint} "
                              f"({network_reason(e)})",
                              "check the network, the endpoint (HYPER_GCS_ENDPOINT_URL) and "
                              "the bucket name")
        if isinstance(e, OSError):
            return StoreError(f"{where}: {e.strerror or e}")
        return StoreError(f"{where}: {type(e).__name__}: {_first_line(e)}")

    # -- the Store interface --------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Store bytes under key (overwrites). Raises StoreError (no such bucket, ...)."""
        try:
            self._blob(key).upload_from_string(data, content_type="application/octet-stream",
                                               retry=self._retry, timeout=TIMEOUT)
        except Exception as e:
            raise self._err(key, e, missing="bucket") from None

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Store a local file under key, read in UPLOAD_PART pieces. Raises StoreError."""
        try:
            self._blob(key, UPLOAD_PART).upload_from_filename(
                str(path), content_type="application/octet-stream", retry=self._retry,
                timeout=TIMEOUT)
        except Exception as e:
            raise self._err(key, e, missing="bucket") from None

    def get(self, key: str) -> bytes:
        """The whole object. Raises NotFound, StoreError."""
        try:
            return self._blob(key).download_as_bytes(retry=self._retry, timeout=TIMEOUT)
        except Exception as e:
            raise self._err(key, e) from None

    def get_to_file(self, key: str, path: str | os.PathLike, digest=None) -> int:
        """Stream the object into a local file (one GET, written as it arrives, its checksum
        checked by the SDK; ``digest`` also fed the bytes, see ``DigestWriter``); returns
        bytes written. On failure the file is removed. Raises NotFound, StoreError."""
        try:
            with open(path, "wb") as f:
                self._blob(key).download_to_file(f if digest is None else
                                                 DigestWriter(f, digest),
                                                 retry=self._retry, timeout=TIMEOUT)
                return f.tell()
        except Exception as e:
            try:
                os.unlink(path)
            except OSError:
                pass
            raise self._err(key, e) from None

    def exists(self, key: str) -> bool:
        """Whether key exists (False also when the bucket does not). Raises StoreError."""
        try:
            return self._blob(key).exists(retry=self._retry, timeout=TIMEOUT)
        except Exception as e:
            raise self._err(key, e) from None

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every object whose key starts with prefix, page by page.
        Raises StoreError (no such bucket, ...)."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            for blob in self._clients.get().list_blobs(
                    self.bucket, prefix=self._key(prefix), retry=self._retry, timeout=TIMEOUT):
                yield blob.name[strip:], blob.size
        except Exception as e:
            raise self._err(prefix, e, missing="bucket") from None

    def delete(self, key: str) -> None:
        """Remove key (no error when absent). Raises StoreError."""
        try:
            self._blob(key).delete(retry=self._retry, timeout=TIMEOUT)
        except self._exc.NotFound:
            pass
        except Exception as e:
            raise self._err(key, e) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__


def _api_message(e) -> str:
    """The server's reason of a GoogleAPICallError, without the request line the SDK adds."""
    msg = getattr(e, "message", "") or str(e)
    head, sep, rest = msg.partition(": ")
    return _first_line(Exception(rest if sep and head.split(" ")[0].isupper() else msg))


def _is_auth_error(e: BaseException) -> bool:
    return type(e).__module__.startswith("google.auth")


def _is_requests_error(e: BaseException) -> bool:
    return type(e).__module__.startswith(("requests", "urllib3"))
