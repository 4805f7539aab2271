"""Real Google Cloud Storage and Azure Blob Storage emulators on loopback, for tests.

``gcp-storage-emulator`` (PyPI, in-memory) and Azurite (``azurite-blob``, npm) each run as a
subprocess in its own session on 127.0.0.1 with a free port, are polled until they answer
HTTP, and are stopped by PID (SIGTERM, then SIGKILL) at the end of the test module that used them
(no server outlives its module: tests/test_sshhosts.py checks that no child process is left).

    gcs_server / azurite_server     module-scoped servers
    gcs / azurite                   per test: the same server, with the environment pointing
                                    hypercli at it (HYPER_GCS_ENDPOINT_URL;
                                    AZURE_STORAGE_CONNECTION_STRING) and a fresh bucket /
                                    container name from ``.new_bucket()``

Azurite missing → its tests are skipped with the reason, unless ``HYPER_REQUIRE_SSH_HOSTS=1``
(CI), where they fail. Azurite runs with ``--disableTelemetry`` so it sends nothing off the
machine.
"""

from __future__ import annotations

import importlib.util
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from s3server import free_port

#: Azurite's well-known development account and key (published in Azurite's README)
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = ("Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/"
               "KBHBeksoGMGw==")
_names = itertools.count(1)


def _required() -> bool:
    return os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1"


def _skip_or_fail(reason: str) -> None:
    if _required():
        pytest.fail(reason)
    pytest.skip(reason)


def _answers(url: str) -> bool:
    """Whether an HTTP server answers at url (any status counts)."""
    try:
        urllib.request.urlopen(url, timeout=1).close()
        return True
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


class Emulator:
    """A server subprocess on 127.0.0.1:port, started by :meth:`start`, stopped by PID."""

    name = "emulator"

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None
        self.log = tmp / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def probe_url(self) -> str:
        return self.endpoint + "/"

    def start(self, timeout: float = 30) -> "Emulator":
        with open(self.log, "wb") as out:
            self.proc = subprocess.Popen(self.command(), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, cwd=self.tmp,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while not _answers(self.probe_url()):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not start on port {self.port}: "
                                   f"{self.log.read_text()[-2000:]}")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        for sig, wait in ((signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, sig)
            except ProcessLookupError:
                break
            try:
                p.wait(timeout=wait)
            except subprocess.TimeoutExpired:
                pass

    @staticmethod
    def new_bucket(stem: str = "hyper") -> str:
        """A bucket/container name not used before in this session (valid on both)."""
        return f"{stem}-{os.getpid()}-{next(_names)}"


class GCSEmulator(Emulator):
    """gcp-storage-emulator's JSON API, in memory."""

    name = "gcp-storage-emulator"

    def command(self) -> list[str]:
        return [sys.executable, "-m", "gcp_storage_emulator", "start", "--host", "127.0.0.1",
                "--port", str(self.port), "--in-memory", "--quiet"]

    def probe_url(self) -> str:
        return f"{self.endpoint}/storage/v1/b?project=hypercli"

    def client(self):
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        return storage.Client(project="hypercli", credentials=AnonymousCredentials(),
                              client_options={"api_endpoint": self.endpoint})

    def make_bucket(self, name: str | None = None) -> str:
        name = name or self.new_bucket()
        self.client().create_bucket(name)
        return name


class Azurite(Emulator):
    """Azurite's Blob service with its data in a temporary folder."""

    name = "azurite-blob"

    def command(self) -> list[str]:
        return [shutil.which("azurite-blob"), "--blobHost", "127.0.0.1", "--blobPort",
                str(self.port), "--location", str(self.tmp / "data"), "--silent",
                "--skipApiVersionCheck", "--loose", "--disableTelemetry"]

    @property
    def connection_string(self) -> str:
        return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};"
                f"AccountKey={AZURITE_KEY};BlobEndpoint={self.endpoint}/{AZURITE_ACCOUNT};")

    def client(self):
        from azure.storage.blob import BlobServiceClient
        return BlobServiceClient.from_connection_string(self.connection_string)

    def make_bucket(self, name: str | None = None) -> str:
        name = name or self.new_bucket()
        self.client().create_container(name)
        return name


@pytest.fixture(scope="module")
def gcs_server(tmp_path_factory):
    """A running :class:`GCSEmulator` for the session (skipped when it is not installed,
    failed instead under HYPER_REQUIRE_SSH_HOSTS=1)."""
    if importlib.util.find_spec("gcp_storage_emulator") is None:
        msg = "gcp-storage-emulator is not installed (pip install gcp-storage-emulator)"
        _skip_or_fail(msg)
    server = GCSEmulator(tmp_path_factory.mktemp("gcs")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def azurite_server(tmp_path_factory):
    """A running :class:`Azurite` for the session (skipped when azurite-blob is not on
    PATH, failed instead under HYPER_REQUIRE_SSH_HOSTS=1)."""
    if not shutil.which("azurite-blob"):
        msg = "azurite-blob is not installed (npm install -g azurite@3; scripts/deps.sh)"
        _skip_or_fail(msg)
    server = Azurite(tmp_path_factory.mktemp("azurite")).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def gcs(gcs_server, monkeypatch):
    """The GCS emulator, with HYPER_GCS_ENDPOINT_URL pointing at it for this test."""
    monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", gcs_server.endpoint)
    monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
    return gcs_server


@pytest.fixture
def azurite(azurite_server, monkeypatch):
    """Azurite, with AZURE_STORAGE_CONNECTION_STRING (its dev account) set for this test."""
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", azurite_server.connection_string)
    monkeypatch.delenv("HYPER_AZURE_STORAGE_ENDPOINT_URL", raising=False)
    return azurite_server
