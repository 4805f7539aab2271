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


@pytest.fixture(scope="module")
def metadata():
    """One for the module: google-auth reads GCE_METADATA_HOST once, when first imported."""
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


# -- what a node's token may do with the cloud's storage, its policies enforced ---------------
def _stored(make, keys):
    for k in keys:
        make(k)


def test_a_gcp_nodes_token_reaches_its_workflows_prefix_and_nothing_else(gcs_server, metadata,
                                                                         monkeypatch):
    """The node's own account as hypercli binds it (a cluster running workflow wf-1 whose
    storage is gs://B/runs, mounting the outputs of wf-0's task t-3), its token from the
    metadata stand-in, and Cloud Storage's IAM in front of the emulator (the bucket policy
    evaluated by tests/gcpiamfake.py). Its workflow's prefix: written, read, listed; an
    earlier run's outputs it mounts: read only; anything else: refused."""
    pytest.importorskip("google.cloud.compute_v1")
    from google.api_core import exceptions as gexc
    from google.auth.credentials import AnonymousCredentials
    from google.cloud import storage
    from google.oauth2.credentials import Credentials

    from gcpfake import ComputeFake
    from gcpiamfake import storage_request
    from hypercli.providers.gcp import GCPAPI
    from hypercli.recipe.access import Grant
    from test_gcp import launch, node_account, spec
    fake = ComputeFake()
    monkeypatch.setenv("HYPER_GCP_ENDPOINT", fake.url)
    bucket = gcs_server.make_bucket()
    fake.add_bucket(bucket)
    admin = gcs_server.client().bucket(bucket)
    for k in ("runs/wf-0/t-3/manifest.json", "runs/wf-0/.checkpoints/t-3/gen-1",
              "runs/wf-2/t-0/manifest.json", "datasets/x"):
        admin.blob(k).upload_from_string(b"theirs")
    grants = (Grant("gs", bucket, "runs", True, True), Grant("gs", bucket, "runs/wf-1", True),
              Grant("gs", bucket, "runs/wf-0/t-3"))
    launch(GCPAPI("proj", "us-central1", credentials=AnonymousCredentials()),
           spec(count=1, grants=grants), nodes=("c1-0",))
    fake.tokens[TOKEN] = f"serviceAccount:{node_account('c1-0')}"

    def authorize(token, method, path, query, body):
        asked = storage_request(method, path, query, body)
        if asked is None or fake.tokens.get(token) is None:
            return False
        b, perm, obj, prefix = asked
        return fake.allowed(fake.tokens[token], b, perm, obj, prefix or "")
    proxy = BearerProxy(gcs_server.endpoint.split("://", 1)[1], TOKEN, authorize=authorize)
    try:
        monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", proxy.url)
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
        monkeypatch.setenv("GCE_METADATA_HOST", metadata.host)
        monkeypatch.setenv("GCE_METADATA_IP", metadata.host)
        mine = open_store(f"gs://{bucket}/runs/wf-1")
        mine.put("t-0/out.txt", b"result")
        assert mine.get("t-0/out.txt") == b"result"
        assert [k for k, _ in mine.list("t-0/")] == ["t-0/out.txt"]
        assert not mine.exists("t-9/out.txt")
        assert open_store(f"gs://{bucket}/runs/wf-0/t-3").get("manifest.json") == b"theirs"
        refused = {
            "write another workflow's prefix": lambda: open_store(
                f"gs://{bucket}/runs/wf-2").put("t-0/x", b"mine"),
            "overwrite an earlier run's output": lambda: open_store(
                f"gs://{bucket}/runs/wf-0/t-3").put("manifest.json", b"mine"),
            "delete an earlier run's checkpoint": lambda: open_store(
                f"gs://{bucket}/runs/wf-0").delete(".checkpoints/t-3/gen-1"),
            "read another workflow's output": lambda: open_store(
                f"gs://{bucket}/runs/wf-2").get("t-0/manifest.json"),
            "list the storage prefix": lambda: list(open_store(f"gs://{bucket}/runs").list()),
            "list the bucket": lambda: list(open_store(f"gs://{bucket}").list()),
        }
        for what, call in refused.items():
            with pytest.raises(StoreError):
                call()
                pytest.fail(what)
        raw = storage.Client(project="proj", credentials=Credentials(TOKEN),
                             client_options={"api_endpoint": proxy.url}).bucket(bucket)
        with pytest.raises(gexc.Forbidden):
            raw.delete(force=False)  # the whole bucket
        with pytest.raises(gexc.Forbidden):
            raw.set_iam_policy(raw.get_iam_policy())  # make it public, or take it
        for k in ("runs/wf-0/t-3/manifest.json", "runs/wf-0/.checkpoints/t-3/gen-1",
                  "runs/wf-2/t-0/manifest.json"):
            assert admin.blob(k).download_as_bytes() == b"theirs"
        assert len(proxy.denied) >= len(refused) + 2  # refused by the policy, not the emulator
    finally:
        proxy.close()
        fake.close()
