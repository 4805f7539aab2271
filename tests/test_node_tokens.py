"""The node-side stores use the VM's identity: a ``gs://`` store with an endpoint reads the
service account's token from the metadata server (``GCE_METADATA_HOST``), an ``az://`` store
without a connection string gets the managed identity's from IMDS; both stand-ins hand out
tokens as the real services do (tests/tokenstandins.py), and the storage emulators sit behind
a proxy that refuses any request without exactly that bearer token."""

from __future__ import annotations

import pytest

from emulators import azurite_server, gcs_server  # noqa: F401  (fixtures)
from hypercli.mount.store import StoreError, open_store
from tokenstandins import BearerProxy, MetadataServer

TOKEN = "ya29.node-token-7f3a"


@pytest.fixture
def metadata():
    m = MetadataServer(TOKEN)
    try:
        yield m
    finally:
        m.close()


def test_gcs_store_on_a_vm_sends_the_metadata_servers_token(gcs_server, metadata,
                                                            monkeypatch):
    proxy = BearerProxy(gcs_server.endpoint.split("://", 1)[1], TOKEN)
    try:
        bucket = gcs_server.make_bucket()
        monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", proxy.url)
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
        monkeypatch.setenv("GCE_METADATA_HOST", metadata.host)
        monkeypatch.setenv("GCE_METADATA_IP", metadata.host)
        store = open_store(f"gs://{bucket}/runs/wf1")
        store.put("t1/out.txt", b"result")
        assert store.get("t1/out.txt") == b"result"
        assert metadata.asked["gce"] >= 1
        assert proxy.seen and set(proxy.seen) == {f"Bearer {TOKEN}"}
        # without the metadata server the same request is anonymous and refused
        monkeypatch.delenv("GCE_METADATA_HOST")
        with pytest.raises(StoreError):
            open_store(f"gs://{bucket}/runs/wf1").get("t1/out.txt")
        assert proxy.seen[-1] is None
    finally:
        proxy.close()


def test_azure_store_on_a_vm_sends_the_managed_identitys_token(azurite_server, metadata,
                                                              monkeypatch, tmp_path):
    from azure.storage.blob import AccountSasPermissions, ResourceTypes, generate_account_sas

    from azurefake import make_cert
    from emulators import AZURITE_ACCOUNT, AZURITE_KEY
    container = azurite_server.make_bucket()
    sas = generate_account_sas(AZURITE_ACCOUNT, AZURITE_KEY,
                               ResourceTypes(service=True, container=True, object=True),
                               AccountSasPermissions(read=True, write=True, list=True,
                                                     delete=True, create=True, add=True),
                               expiry="2099-01-01T00:00:00Z")
    cert, key = make_cert(tmp_path)
    proxy = BearerProxy(azurite_server.endpoint.split("://", 1)[1], TOKEN, add_query=sas,
                        tls=(cert, key))
    try:
        for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_CLIENT_ID", "AZURE_TENANT_ID",
                    "AZURE_CLIENT_SECRET", "AZURE_FEDERATED_TOKEN_FILE", "IDENTITY_ENDPOINT",
                    "MSI_ENDPOINT", "IMDS_ENDPOINT"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("HYPER_AZURE_STORAGE_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", f"http://{metadata.host}")
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
        store = open_store(f"az://{AZURITE_ACCOUNT}/{container}/runs/wf1")
        store.put("t1/out.txt", b"result")
        assert store.get("t1/out.txt") == b"result"
        assert metadata.asked["imds"] >= 1
        assert proxy.seen and set(proxy.seen) == {f"Bearer {TOKEN}"}
    finally:
        proxy.close()
