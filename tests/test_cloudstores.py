"""``gs://`` and ``az://`` stores (hypercli.mount.store_gcs, store_azure) on real emulators.

Every test marked with the ``cloud`` fixture runs twice: against gcp-storage-emulator and
against Azurite (``emulators.py``), both on loopback. They check the Store contract, the real
dataset pipeline (``pack.push`` → ls → pull → verify, incremental pushes), the errors a user
meets (unreachable endpoint, bad credentials, a missing SDK, bad URLs), and, where FUSE is
available, a mount of a dataset in each store. No test talks to anything but loopback: the
credential tests fail before any request, or get their answer from Azurite.
"""

from __future__ import annotations

import hashlib
import os
import random
import signal
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import ROOT
from emulators import AZURITE_ACCOUNT, AZURITE_KEY
from emulators import azurite, azurite_server, gcs, gcs_server  # noqa: F401  (fixtures)
from hypercli.errors import UsageError
from hypercli.mount import pack, store_azure, store_gcs
from hypercli.mount.store import NotFound, StoreError, open_store
from s3server import free_port

MiB = 1 << 20


class Cloud:
    """One emulated cloud for a test: its scheme, its server, URLs in fresh buckets."""

    def __init__(self, scheme: str, server):
        self.scheme, self.server = scheme, server

    def url(self, prefix: str, bucket: str | None = None) -> str:
        """A URL in a new bucket/container (made now), or in ``bucket`` as named."""
        bucket = bucket or self.server.make_bucket()
        if self.scheme == "gs":
            return f"gs://{bucket}/{prefix}"
        return f"az://{AZURITE_ACCOUNT}/{bucket}/{prefix}"

    def missing_url(self) -> str:
        """A URL whose bucket/container does not exist."""
        return self.url("p", bucket=self.server.new_bucket("none"))


@pytest.fixture(scope="module", params=["gs", "az"])
def cloud_server(request):
    """(scheme, the module's emulator): module-scoped, so that the emulator is started
    before conftest's ``_no_process_left`` counts a test's own processes (it would kill it)."""
    return request.param, request.getfixturevalue(
        "gcs_server" if request.param == "gs" else "azurite_server")


@pytest.fixture
def cloud(cloud_server, request) -> Cloud:
    scheme, _ = cloud_server
    server = request.getfixturevalue("gcs" if scheme == "gs" else "azurite")  # env too
    return Cloud(scheme, server)


def random_tree(root: Path, n: int, seed: int, max_size: int) -> list[str]:
    rnd = random.Random(seed)
    out = []
    for i in range(n):
        p = root / f"d{rnd.randrange(12):02d}" / f"f{i:04d}.bin"
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(rnd.randbytes(rnd.randrange(0, max_size)))
        out.append(p.relative_to(root).as_posix())
    return out


def tree(root: Path) -> dict[str, str]:
    """relative path → sha256 of every file below root (symlinks: 'link:' + target)."""
    out = {}
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix()
        if p.is_symlink():
            out[rel] = "link:" + os.readlink(p)
        elif p.is_file():
            out[rel] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


# -- the Store contract -------------------------------------------------------------------
def test_store_contract(cloud, tmp_path):
    url = cloud.url("p/q")
    s = open_store(url)
    assert s.url == url
    assert list(s.list()) == []
    sibling = open_store(url + "q")  # p/qq: shares the string prefix, not the folder
    sibling.put("x", b"not mine")

    s.put("a/one", b"1")
    s.put("a/two", b"22")
    s.put("b/three", b"333")
    s.put("empty", b"")
    assert s.get("a/one") == b"1" and s.get("empty") == b""
    s.put("a/one", b"uno")  # overwrite
    assert s.get("a/one") == b"uno"
    assert sorted(s.list()) == [("a/one", 3), ("a/two", 2), ("b/three", 3), ("empty", 0)]
    assert sorted(s.list("a/")) == [("a/one", 3), ("a/two", 2)]
    assert list(sibling.list()) == [("x", 8)]
    assert s.exists("a/two") and not s.exists("a/nothing") and not s.exists("a")

    # a file larger than one upload/download piece (GCS 8 MiB, Azure 4 MiB), streamed
    big = random.Random(1).randbytes(9 * MiB + 5)
    (tmp_path / "big").write_bytes(big)
    s.put_file("chunks/big", tmp_path / "big")
    assert s.get_to_file("chunks/big", tmp_path / "back") == len(big)
    assert (tmp_path / "back").read_bytes() == big
    assert dict(s.list("chunks/")) == {"chunks/big": len(big)}
    assert s.get_to_file("empty", tmp_path / "empty") == 0

    with pytest.raises(NotFound, match=f"^{url}/a/nothing: no such object"):
        s.get("a/nothing")
    with pytest.raises(NotFound, match="no such object"):
        s.get_to_file("a/nothing", tmp_path / "nothing")
    assert not (tmp_path / "nothing").exists()

    s.delete("a/two")
    s.delete("a/two")  # absent: no error
    assert not s.exists("a/two")
    assert sorted(k for k, _ in s.list()) == ["a/one", "b/three", "chunks/big", "empty"]
    assert sibling.get("x") == b"not mine"


def test_missing_bucket_is_a_store_error_not_a_missing_object(cloud):
    s = open_store(cloud.missing_url())
    with pytest.raises(StoreError, match="no such (bucket|container)") as e:
        list(s.list())
    assert not isinstance(e.value, NotFound)
    with pytest.raises(StoreError, match="no such (bucket|container)") as e:
        s.put("k", b"x")
    assert not isinstance(e.value, NotFound)
    assert s.exists("k") is False


def test_many_threads_share_one_store(cloud):
    s = open_store(cloud.url("par"))

    def roundtrip(i: int) -> bool:
        data = random.Random(i).randbytes(1000 + 97 * i)
        s.put(f"k/{i:03d}", data)
        return s.get(f"k/{i:03d}") == data and s.exists(f"k/{i:03d}")

    with ThreadPoolExecutor(16) as pool:
        assert all(pool.map(roundtrip, range(64)))
    listed = dict(s.list("k/"))
    assert len(listed) == 64 and listed["k/063"] == 1000 + 97 * 63


# -- the dataset pipeline -----------------------------------------------------------------
def test_push_ls_pull_verify_and_incremental_push(cloud, tmp_path):
    src = tmp_path / "src"
    random_tree(src, 400, seed=5, max_size=12_000)
    (src / "zz").mkdir()
    (src / "zz" / "big.bin").write_bytes(random.Random(2).randbytes(2 * MiB + MiB // 3))
    (src / "zz" / "link").symlink_to("big.bin")
    url = cloud.url("datasets/t")

    r = pack.push(src, url, chunk_size=MiB, jobs=8)
    assert (r.files, r.symlinks) == (401, 1) and r.chunks >= 5
    assert r.chunks_uploaded == r.chunks and r.bytes_uploaded == r.bytes
    store = open_store(url)
    m = pack.load_manifest(store)
    assert {k for k, _ in store.list()} == \
        {"manifest.json", r.index} | {f"chunks/{sha}" for sha, _ in m["chunks"]}
    assert {e.path for e in pack.ls(url, cache_dir=tmp_path / "c")} == set(os.listdir(src))
    [big] = pack.ls(url, "zz/big.bin", cache_dir=tmp_path / "c")
    assert big.size == 2 * MiB + MiB // 3

    p = pack.pull(url, tmp_path / "dest", jobs=8, cache_dir=tmp_path / "c")
    assert (p.files, p.bytes) == (401, r.bytes)
    assert tree(tmp_path / "dest") == tree(src)
    v = pack.verify(url)
    assert v.ok and v.chunks == r.chunks, v.problems

    (src / "d03" / "added.bin").write_bytes(b"new file\n" * 500)
    changed = sorted(src.glob("d07/*.bin"))[0]
    changed.write_bytes(changed.read_bytes() + b"changed")
    before = dict(store.list("chunks/"))
    r2 = pack.push(src, url, chunk_size=MiB, jobs=8)
    added = set(dict(store.list("chunks/"))) - set(before)
    assert 1 <= r2.chunks_uploaded <= 3 and r2.chunks_uploaded == len(added)
    assert r2.files == 402 and r2.index != r.index
    assert pack.push(src, url, chunk_size=MiB).chunks_uploaded == 0
    pack.pull(url, tmp_path / "dest2", cache_dir=tmp_path / "c")
    assert tree(tmp_path / "dest2") == tree(src)

    sha, size = pack.load_manifest(store)["chunks"][0]
    store.put(f"chunks/{sha}", b"x" * size)  # same size, wrong bytes
    v = pack.verify(url)
    assert v.problems == [f"chunks/{sha}: corrupt (its bytes have sha256 "
                          f"{hashlib.sha256(b'x' * size).hexdigest()})"]


# -- errors a user meets ------------------------------------------------------------------
def test_unreachable_endpoint_is_a_clear_store_error(cloud, monkeypatch, tmp_path):
    monkeypatch.setattr(store_gcs, "RETRY_SECONDS", 1.0)
    monkeypatch.setattr(store_azure, "RETRIES", 0)
    dead = f"http://127.0.0.1:{free_port()}"
    if cloud.scheme == "gs":
        monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", dead)
        url, endpoint = "gs://bucket/ds", dead
    else:
        monkeypatch.setenv("HYPER_AZURE_STORAGE_ENDPOINT_URL", dead)
        url, endpoint = f"az://{AZURITE_ACCOUNT}/cont/ds", f"{dead}/{AZURITE_ACCOUNT}"
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "f").write_text("x")
    for call in (lambda: pack.push(tmp_path / "src", url, chunk_size=MiB),
                 lambda: pack.ls(url, cache_dir=tmp_path / "c")):
        with pytest.raises(StoreError) as e:
            call()
        text = str(e.value)
        assert text.startswith(url) and f"Could not connect to {endpoint}" in text, text
        assert "Connection refused" in text and "Traceback" not in text
        assert e.value.hint


def test_azure_endpoint_seam_uses_the_connection_strings_key(azurite, monkeypatch):
    url = f"az://{AZURITE_ACCOUNT}/{azurite.make_bucket()}/ds"
    open_store(url).put("via-connection-string", b"1")
    monkeypatch.setenv("HYPER_AZURE_STORAGE_ENDPOINT_URL", azurite.endpoint)
    s = open_store(url)
    assert s.endpoint == f"{azurite.endpoint}/{AZURITE_ACCOUNT}"
    s.put("via-seam", b"2")
    assert dict(s.list()) == {"via-connection-string": 1, "via-seam": 1}


def test_gcs_storage_emulator_host_without_scheme(gcs, monkeypatch):
    url = f"gs://{gcs.make_bucket()}/ds"
    monkeypatch.delenv("HYPER_GCS_ENDPOINT_URL")
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", gcs.endpoint[len("http://"):])
    s = open_store(url)
    assert s.endpoint == gcs.endpoint
    s.put("k", b"v")
    assert [b.name for b in gcs.client().list_blobs(url.split("/")[2])] == ["ds/k"]


SHIM = "from hypercli.cli import main\nmain()\n"


def hyper_data(*args: str, env: dict) -> subprocess.CompletedProcess:
    """The real ``hyper data ...`` command in a subprocess."""
    return subprocess.run([sys.executable, "-c", SHIM, "data", *args], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=dict(env, COLUMNS="200"))


def test_missing_google_credentials_say_how_to_set_them(monkeypatch, tmp_path, hyper_home):
    for k in ("HYPER_GCS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST"):
        monkeypatch.delenv(k, raising=False)
    # a key file that is not there: google.auth fails before asking any server
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing-key.json"))
    with pytest.raises(StoreError, match="^gs://b/ds: no Google credentials") as e:
        open_store("gs://b/ds")
    assert "gcloud auth application-default login" in e.value.hint

    p = hyper_data("ls", "gs://b/ds", env=dict(os.environ))
    assert p.returncode == 3, p.stderr
    assert "no Google credentials" in p.stderr and "gcloud auth" in p.stderr + p.stdout
    assert "Traceback" not in p.stderr


def test_wrong_azure_key_says_how_to_set_credentials(azurite, monkeypatch, hyper_home):
    url = f"az://{AZURITE_ACCOUNT}/{azurite.make_bucket()}/ds"
    wrong = azurite.connection_string.replace(AZURITE_KEY, "A" * 86 + "==")
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING", wrong)
    with pytest.raises(StoreError, match="Azure authentication failed") as e:
        open_store(url).put("k", b"x")
    assert not isinstance(e.value, NotFound)
    assert "AZURE_STORAGE_CONNECTION_STRING" in e.value.hint and "az login" in e.value.hint

    p = hyper_data("ls", url, env=dict(os.environ))
    assert p.returncode == 3, p.stderr
    assert "Azure authentication failed" in p.stderr and "Traceback" not in p.stderr


def test_bad_urls_are_usage_errors(monkeypatch):
    monkeypatch.setenv("AZURE_STORAGE_CONNECTION_STRING",
                       f"AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY}")
    for url, msg in [("gs:///ds", "no bucket"),
                     ("az://", "no account"),
                     (f"az://{AZURITE_ACCOUNT}", "no container"),
                     ("az://Not_An_Account/cont/ds", "not a storage account name"),
                     (f"az://{AZURITE_ACCOUNT}/ab/ds", "not a container name"),
                     (f"az://{AZURITE_ACCOUNT}/a--b/ds", "not a container name"),
                     ("az://otheraccount/cont/ds", "is for account 'devstoreaccount1'"),
                     ("ftp://host/ds", "unknown store scheme")]:
        with pytest.raises(UsageError, match=msg):
            open_store(url)


def test_missing_sdk_names_the_pip_extra():
    code = ("import sys\n"
            "sys.modules['google.cloud.storage'] = None\n"
            "sys.modules['azure.storage.blob'] = None\n"
            "from hypercli.mount.store import open_store\n"
            "from hypercli.errors import UsageError\n"
            "for url in ('gs://b/p', 'az://acct/cont/p'):\n"
            "    try:\n"
            "        open_store(url)\n"
            "    except UsageError as e:\n"
            "        print(e, '|', e.hint)\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    lines = p.stdout.splitlines()
    assert len(lines) == 2, p.stdout + p.stderr
    assert lines[0].startswith("gs:// stores need") and "pip install 'hypercli[gcp]'" in lines[0]
    assert lines[1].startswith("az:// stores need") and \
        "pip install 'hypercli[azure]'" in lines[1]


def test_hyper_help_and_the_mount_modules_import_no_storage_sdk():
    p = subprocess.run([sys.executable, "-X", "importtime", "-c",
                        "import hypercli.mount.pack, hypercli.mount.fusefs\n" + SHIM, "--help"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert p.returncode == 0 and "Usage" in p.stdout, p.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in p.stderr.splitlines()
                if line.startswith("import time:")}
    assert "hypercli.mount.store" in imported
    loaded = {m for m in imported
              if m.startswith(("google.cloud.storage", "azure.storage", "azure.identity",
                               "hypercli.mount.store_gcs", "hypercli.mount.store_azure"))}
    assert not loaded, loaded


# -- a mount of a dataset in each store ---------------------------------------------------
@pytest.mark.skipif(not os.path.exists("/dev/fuse") or not shutil.which("fusermount3"),
                    reason="needs /dev/fuse and fusermount3")
def test_mount_a_dataset_and_read_files(cloud, tmp_path):
    from hypercli.mount import fusefs
    src = tmp_path / "src"
    random_tree(src, 60, seed=9, max_size=50_000)
    url = cloud.url("mnt")
    pack.push(src, url, chunk_size=MiB)
    mp = tmp_path / "mp"
    mp.mkdir()
    pid = fusefs.mount(url, mp, cache_dir=tmp_path / "cache", cache_bytes=64 * MiB,
                       foreground=False, timeout=30)
    try:
        assert tree(mp) == tree(src)
        first = sorted(tree(src))[0]
        with open(mp / first, "rb") as f:
            f.seek(7)
            assert f.read(100) == (src / first).read_bytes()[7:107]
        assert fusefs.mount_stats(mp)["downloads"] >= 1
    finally:
        _unmount(str(mp), pid)


def _unmount(mp: str, pid: int) -> None:
    subprocess.run(["fusermount3", "-u", mp], capture_output=True, timeout=10)
    for sig in (None, signal.SIGTERM, signal.SIGKILL):
        if sig is not None:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + 5
        while time.monotonic() < end:
            try:
                if os.waitpid(pid, os.WNOHANG)[0] == pid:
                    break
            except ChildProcessError:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    break
            time.sleep(0.02)
        else:
            continue
        break
    with open("/proc/mounts") as f:
        if any(line.split()[1] == mp for line in f):
            subprocess.run(["fusermount3", "-uz", mp], capture_output=True, timeout=10)
