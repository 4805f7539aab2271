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
                                                                         monkeypatch, tmp_path):
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
        # above 8 MiB: a resumable upload, whose session is authorised when it is opened
        # (its URI then carries the right, as on GCS): allowed in its own prefix only
        big = tmp_path / "big.bin"
        big.write_bytes(b"x" * (9 << 20))
        mine.put_file("t-1/big.bin", big)
        admin.reload()
        assert admin.get_blob("runs/wf-1/t-1/big.bin").size == 9 << 20
        with pytest.raises(StoreError):
            open_store(f"gs://{bucket}/runs/wf-2").put_file("t-0/big.bin", big)
        assert admin.get_blob("runs/wf-2/t-0/big.bin") is None
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


def test_an_azure_nodes_token_reaches_its_workflows_prefix_and_nothing_else(
        azurite_server, metadata, monkeypatch, tmp_path):
    """The cluster's storage identity as hypercli assigns it (custom blob roles with ABAC
    conditions; a cluster running workflow wf-1, mounting wf-0's task t-3), its token from
    the IMDS stand-in, and Blob Storage's authorisation in front of Azurite (the assignments
    evaluated by tests/azureiamfake.py). Its workflow's prefix: written, read, listed; the
    earlier run's outputs: read only; the container itself (delete it, make it public),
    another workflow's files, listings outside the prefix: refused."""
    pytest.importorskip("azure.mgmt.compute")
    from azure.core.credentials import AccessToken
    from azure.core.exceptions import HttpResponseError
    from azure.storage.blob import (AccountSasPermissions, ContainerClient, PublicAccess,
                                    ResourceTypes, generate_account_sas)

    from azurefake import ArmFake, make_cert
    from azureiamfake import blob_request
    from emulators import AZURITE_ACCOUNT, AZURITE_KEY
    from hypercli.providers.azure import AzureAPI
    from hypercli.recipe.access import Grant
    from test_azure import Token, launch, spec
    fake = ArmFake(tmp_path)
    monkeypatch.setenv("HYPER_AZURE_ENDPOINT", fake.url)
    monkeypatch.setenv("HYPER_AZURE_CA_BUNDLE", str(fake.ca))
    container = azurite_server.make_bucket()
    acct = fake.add_account(AZURITE_ACCOUNT)
    admin = azurite_server.client().get_container_client(container)
    for k in ("runs/wf-0/t-3/manifest.json", "runs/wf-0/.checkpoints/t-3/gen-1",
              "runs/wf-2/t-0/manifest.json"):
        admin.upload_blob(k, b"theirs")
    where = f"{AZURITE_ACCOUNT}/{container}"
    grants = (Grant("az", where, "runs", True, True), Grant("az", where, "runs/wf-1", True),
              Grant("az", where, "runs/wf-0/t-3"))
    launch(AzureAPI("sub-1", "eastus", credential=Token()), spec(count=1, grants=grants),
           nodes=("c1-0",))
    msi = next(r for r in fake.res.values() if r["type"].endswith("userAssignedIdentities"))
    fake.principal_tokens[TOKEN] = msi["properties"]["principalId"]

    def authorize(token, method, path, query, body):
        asked = blob_request(method, path, query)
        who = fake.principal_tokens.get(token)
        if asked is None or who is None:
            return False
        account, cont, kind, action, blob, prefix = asked
        if kind == "control":
            return fake.may(who, action, f"{acct}/blobServices/default/containers/{cont}")
        return fake.allowed(who, account, cont, action, blob, prefix)
    sas = generate_account_sas(AZURITE_ACCOUNT, AZURITE_KEY,
                               ResourceTypes(service=True, container=True, object=True),
                               AccountSasPermissions(read=True, write=True, list=True,
                                                     delete=True, create=True, add=True),
                               expiry="2099-01-01T00:00:00Z")
    cert, key = make_cert(tmp_path)
    proxy = BearerProxy(azurite_server.endpoint.split("://", 1)[1], TOKEN, add_query=sas,
                        tls=(cert, key), authorize=authorize, refused_type="application/xml",
                        refused=b'<?xml version="1.0" encoding="utf-8"?><Error><Code>'
                        b'AuthorizationPermissionMismatch</Code><Message>This request is not '
                        b'authorized to perform this operation using this permission.'
                        b'</Message></Error>')
    try:
        for var in ("AZURE_STORAGE_CONNECTION_STRING", "AZURE_TENANT_ID", "AZURE_CLIENT_SECRET",
                    "AZURE_FEDERATED_TOKEN_FILE", "IDENTITY_ENDPOINT", "MSI_ENDPOINT",
                    "IMDS_ENDPOINT"):
            monkeypatch.delenv(var, raising=False)
        monkeypatch.setenv("AZURE_CLIENT_ID", msi["properties"]["clientId"])  # /etc/environment
        monkeypatch.setenv("HYPER_AZURE_STORAGE_ENDPOINT_URL", proxy.url)
        monkeypatch.setenv("AZURE_POD_IDENTITY_AUTHORITY_HOST", f"http://{metadata.host}")
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(cert))
        base = f"az://{where}"
        mine = open_store(f"{base}/runs/wf-1")
        mine.put("t-0/out.txt", b"result")
        assert mine.get("t-0/out.txt") == b"result"
        assert [k for k, _ in mine.list("t-0/")] == ["t-0/out.txt"]
        assert not mine.exists("t-9/out.txt")
        assert open_store(f"{base}/runs/wf-0/t-3").get("manifest.json") == b"theirs"
        refused = {
            "write another workflow's prefix": lambda: open_store(
                f"{base}/runs/wf-2").put("t-0/x", b"mine"),
            "overwrite an earlier run's output": lambda: open_store(
                f"{base}/runs/wf-0/t-3").put("manifest.json", b"mine"),
            "delete an earlier run's checkpoint": lambda: open_store(
                f"{base}/runs/wf-0").delete(".checkpoints/t-3/gen-1"),
            "read another workflow's output": lambda: open_store(
                f"{base}/runs/wf-2").get("t-0/manifest.json"),
            "list the storage prefix": lambda: list(open_store(f"{base}/runs").list()),
            "list the container": lambda: list(open_store(base).list()),
        }
        for what, call in refused.items():
            with pytest.raises(StoreError):
                call()
                pytest.fail(what)

        class Static:
            def get_token(self, *scopes, **kw):
                return AccessToken(TOKEN, 2 ** 31)
        raw = ContainerClient(f"{proxy.url}/{AZURITE_ACCOUNT}", container,
                              credential=Static(), connection_verify=str(cert))
        with pytest.raises(HttpResponseError) as e:
            raw.delete_container()
        assert e.value.status_code == 403
        with pytest.raises(HttpResponseError) as e:
            raw.set_container_access_policy({}, public_access=PublicAccess.Container)
        assert e.value.status_code == 403
        for k in ("runs/wf-0/t-3/manifest.json", "runs/wf-0/.checkpoints/t-3/gen-1",
                  "runs/wf-2/t-0/manifest.json"):
            assert admin.download_blob(k).readall() == b"theirs"
        assert len(proxy.denied) >= len(refused) + 2
    finally:
        proxy.close()
        fake.close()
