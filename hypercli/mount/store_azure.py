"""``az://account/container/prefix``: Azure Blob Storage behind the
:class:`~hypercli.mount.store.Store` interface, through azure-storage-blob
(``pip install 'hypercli[azure]'``).

The URL names the storage account, the container and a prefix inside it:
``az://mylab/datasets/coco`` is the blobs ``coco/...`` of container ``datasets`` in account
``mylab`` (``https://mylab.blob.core.windows.net``).

Credentials, first found wins:

1. ``AZURE_STORAGE_CONNECTION_STRING`` (the account's connection string, with an account key
   or a SAS token); its account must be the URL's.
2. ``DefaultAzureCredential`` of azure-identity: environment service principal, managed
   identity of the VM, ``az login``.

Endpoint: ``endpoint_url`` / ``HYPER_AZURE_STORAGE_ENDPOINT_URL`` (an emulator such as
Azurite: the account URL is ``ENDPOINT/ACCOUNT``, path-style), else the connection string's
``BlobEndpoint``, else ``https://ACCOUNT.blob.core.windows.net``.

Semantics match :class:`~hypercli.mount.store.S3Store`: a missing blob is
:class:`~hypercli.mount.store.NotFound` (a missing container is a StoreError), ``exists`` is
False for both, ``delete`` of a missing blob is no error. Each thread gets its own client
(:class:`~hypercli.mount.store.PerThread`; azure-core's requests transport is one Session,
which it documents as not thread-safe) sharing one credential. Transfers go in pieces of
:data:`BLOCK` bytes (downloads streamed to the file, uploads as staged blocks), so no whole
chunk is held in memory. Transient failures are retried :data:`RETRIES` times.
"""

from __future__ import annotations

import os
import re
from typing import Iterator

from hypercli.errors import UsageError
from hypercli.mount.store_base import (DigestWriter, NotFound, PerThread, StoreError,
                                       network_reason, sdk_missing)

MiB = 1 << 20
#: bytes per request of a download or upload larger than one piece
BLOCK = 4 * MiB
#: retries of a failed request (azure-storage ExponentialRetry: BACKOFF s, then
#: BACKOFF + 2**n s, ± 1 s); the SDK's own default waits 15 s before the first retry
RETRIES = 3
BACKOFF = 1
CONNECT_TIMEOUT, READ_TIMEOUT = 5, 60  # seconds
CONNECTION_STRING_ENV = "AZURE_STORAGE_CONNECTION_STRING"
CREDENTIALS_HINT = (f"set {CONNECTION_STRING_ENV} (Azure portal: storage account → access "
                    "keys), or sign in for DefaultAzureCredential: `az login`, a managed "
                    "identity, or AZURE_CLIENT_ID/AZURE_TENANT_ID/AZURE_CLIENT_SECRET")
_ACCOUNT = re.compile(r"[a-z0-9]{3,24}")
_CONTAINER = re.compile(r"[a-z0-9][a-z0-9-]{1,61}[a-z0-9]")


def _sdk():
    """(azure.storage.blob module, azure.core.exceptions module). Raises UsageError naming
    ``hypercli[azure]`` when azure-storage-blob is missing."""
    try:
        import azure.storage.blob as blob
        from azure.core import exceptions
    except ImportError as e:
        raise sdk_missing("az", "azure", e) from None
    return blob, exceptions


def connection_string_fields(conn: str) -> dict[str, str]:
    """``{"AccountName": ..., "AccountKey": ..., ...}`` of an Azure Storage connection string
    (``Key=Value;Key=Value``; values may hold ``=``, as base64 keys do)."""
    return dict(p.split("=", 1) for p in conn.split(";") if "=" in p)


class AzureBlobStore:
    """A prefix in an Azure Blob Storage container.

    Args:
        account: the storage account name (3-24 lowercase letters and digits).
        container: the container name (3-63 lowercase letters, digits, hyphens).
        prefix: the blob name prefix ('' for the whole container).
        endpoint_url: an emulator's ``http(s)://HOST:PORT``; the account URL is
            ``endpoint_url/account``. None: see the module docstring.
        connection_string: default ``$AZURE_STORAGE_CONNECTION_STRING``.
    Raises:
        UsageError: a bad account or container name, a connection string of another account,
            or azure-storage-blob (or azure-identity, when needed) not installed.
    """

    def __init__(self, account: str, container: str, prefix: str = "",
                 endpoint_url: str | None = None, connection_string: str | None = None):
        blob, self._exc = _sdk()
        self.account, self.container, self.prefix = account, container, prefix.strip("/")
        self.url = f"az://{account}/{container}/{self.prefix}".rstrip("/")
        if not _ACCOUNT.fullmatch(account):
            raise UsageError(f"{self.url}: {account!r} is not a storage account name",
                             "3-24 lowercase letters and digits: az://ACCOUNT/CONTAINER/PREFIX")
        if not _CONTAINER.fullmatch(container) or "--" in container:
            raise UsageError(f"{self.url}: {container!r} is not a container name",
                             "3-63 lowercase letters, digits and single hyphens")
        conn = connection_string or os.environ.get(CONNECTION_STRING_ENV) or None
        fields = connection_string_fields(conn) if conn else {}
        if conn and fields.get("AccountName", account) != account:
            raise UsageError(f"{self.url}: {CONNECTION_STRING_ENV} is for account "
                             f"{fields['AccountName']!r}, not {account!r}",
                             "use that account's connection string, or unset it")
        retry = blob.ExponentialRetry(initial_backoff=BACKOFF, increment_base=2,
                                      retry_total=RETRIES, random_jitter_range=1)
        kw = dict(retry_policy=retry, connection_timeout=CONNECT_TIMEOUT,
                  read_timeout=READ_TIMEOUT, max_single_get_size=BLOCK,
                  max_chunk_get_size=BLOCK, max_single_put_size=BLOCK, max_block_size=BLOCK)
        if conn and not endpoint_url:
            self.endpoint = fields.get("BlobEndpoint") or \
                f"https://{account}.blob.{fields.get('EndpointSuffix', 'core.windows.net')}"
            self._clients = PerThread(
                lambda: blob.BlobServiceClient.from_connection_string(conn, **kw))
            return
        self.endpoint = (f"{endpoint_url.rstrip('/')}/{account}" if endpoint_url
                         else f"https://{account}.blob.core.windows.net")
        if fields.get("AccountKey"):
            cred = {"account_name": account, "account_key": fields["AccountKey"]}
        elif fields.get("SharedAccessSignature"):
            cred = fields["SharedAccessSignature"]
        else:
            try:
                from azure.identity import DefaultAzureCredential
            except ImportError as e:
                raise sdk_missing("az", "azure", e) from None
            cred = DefaultAzureCredential()
        self._clients = PerThread(
            lambda: blob.BlobServiceClient(self.endpoint, credential=cred, **kw))

    # -- helpers --------------------------------------------------------------------------
    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def _container(self):
        return self._clients.get().get_container_client(self.container)

    def _blob(self, key: str):
        return self._clients.get().get_blob_client(self.container, self._key(key))

    def _err(self, key: str, e: BaseException) -> StoreError:
        """The StoreError for an SDK exception (NotFound for a missing blob)."""
        where = f"{self.url}/{key}" if key else self.url
        exc = self._exc
        code = getattr(e, "error_code", None)
        code = getattr(code, "value", code) or ""
        status = getattr(e, "status_code", None)
        if isinstance(e, exc.ResourceNotFoundError) or status == 404:
            if code == "ContainerNotFound":
                return StoreError(f"{self.url}: no such container {self.container} in "
                                  f"account {self.account}",
                                  "create it, or check the container name")
            if code in ("BlobNotFound", ""):
                return NotFound(f"{where}: no such object")
            return StoreError(f"{where}: {code or 'not found'}: {_first_line(e)}")
        if isinstance(e, exc.ClientAuthenticationError) or status in (401, 403):
            return StoreError(f"{where}: Azure authentication failed "
                              f"({code or _first_line(e)})", CREDENTIALS_HINT)
        if isinstance(e, exc.HttpResponseError):
            return StoreError(f"{where}: HTTP {status} {code}: {_first_line(e)}")
        if isinstance(e, (exc.ServiceRequestError, exc.ServiceResponseError)):
            return StoreError(f"{where}: Could not connect to {self.endpoint} "
                              f"({network_reason(e)})",
                              "check the network, the account name and the endpoint "
                              "(HYPER_AZURE_STORAGE_ENDPOINT_URL)")
        if isinstance(e, OSError):
            return StoreError(f"{where}: {e.strerror or e}")
        return StoreError(f"{where}: {type(e).__name__}: {_first_line(e)}")

    # -- the Store interface --------------------------------------------------------------
    def put(self, key: str, data: bytes) -> None:
        """Store bytes under key (overwrites). Raises StoreError (no such container, ...)."""
        try:
            self._blob(key).upload_blob(data, overwrite=True)
        except Exception as e:
            raise self._err(key, e) from None

    def put_file(self, key: str, path: str | os.PathLike) -> None:
        """Store a local file under key, read and staged in BLOCK pieces. Raises StoreError."""
        try:
            with open(path, "rb") as f:
                self._blob(key).upload_blob(f, length=os.fstat(f.fileno()).st_size,
                                            overwrite=True, max_concurrency=1)
        except Exception as e:
            raise self._err(key, e) from None

    def get(self, key: str) -> bytes:
        """The whole object. Raises NotFound, StoreError."""
        try:
            return self._blob(key).download_blob(max_concurrency=1).readall()
        except Exception as e:
            raise self._err(key, e) from None

    def get_to_file(self, key: str, path: str | os.PathLike, digest=None) -> int:
        """Stream the object into a local file in BLOCK pieces (``digest`` also fed the
        bytes, see ``DigestWriter``); returns bytes written. On failure the file is removed.
        Raises NotFound, StoreError."""
        try:
            with open(path, "wb") as f:
                return self._blob(key).download_blob(max_concurrency=1).readinto(
                    f if digest is None else DigestWriter(f, digest))
        except Exception as e:
            try:
                os.unlink(path)
            except OSError:
                pass
            raise self._err(key, e) from None

    def exists(self, key: str) -> bool:
        """Whether key exists (False also when the container does not). Raises StoreError."""
        try:
            return self._blob(key).exists()
        except Exception as e:
            raise self._err(key, e) from None

    def list(self, prefix: str = "") -> Iterator[tuple[str, int]]:
        """(key, size in bytes) of every object whose key starts with prefix, page by page.
        Raises StoreError (no such container, ...)."""
        strip = len(self.prefix) + 1 if self.prefix else 0
        try:
            for b in self._container().list_blobs(name_starts_with=self._key(prefix)):
                yield b.name[strip:], b.size
        except Exception as e:
            raise self._err(prefix, e) from None

    def delete(self, key: str) -> None:
        """Remove key (no error when absent; a missing container is). Raises StoreError."""
        try:
            self._blob(key).delete_blob()
        except Exception as e:
            err = self._err(key, e)
            if not isinstance(err, NotFound):
                raise err from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0][:300] if text else type(e).__name__
