"""Plain ``gs://`` and ``az://`` bucket mounts through rclone (hypercli.mount.bucket), with
real FUSE mounts of the GCS emulator and Azurite (tests/emulators.py): a task reads a file of
the bucket byte for byte, a read-only mount refuses a write, a ``mode: rw`` mount's writes are
in the bucket after `hyper down` (which waits for rclone's write-back cache), a missing bucket
is an error naming it, the mounts are nosuid,nodev, credentials never reach rclone's command
line, and no rclone is left running."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import wait_for
from emulators import azurite, azurite_server, gcs, gcs_server  # noqa: F401  (fixtures)
from hypercli.mount import bucket
from hypercli.providers.runtime import guarded, unmount_command

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not shutil.which("rclone"),
                                 reason="rclone is not installed (Debian: rclone)")]

#: bytes no text round trip keeps: every byte value, and more than one read's worth
PAYLOAD = bytes(range(256)) * 700 + b"\x00end"


def rclones(mnt: Path) -> list[int]:
    """PIDs of the rclone processes whose command line names mnt."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if argv and argv[0].endswith(b"rclone") and str(mnt).encode() in argv:
            out.append(int(d.name))
    return out


def mount_options(mnt: Path) -> list[str] | None:
    for line in open("/proc/mounts"):
        f = line.split()
        if f[1] == str(mnt):
            return f[3].split(",")
    return None


def cleanup(*mnts: Path) -> None:
    """Take down what a failed test left: the mounts, then their rclone by PID."""
    for m in mnts:
        subprocess.run(["fusermount3", "-uz", str(m)], capture_output=True)
        for pid in rclones(m):
            os.kill(pid, 9)


def run_recipe(hyper, tmp_path: Path, name: str, ro_url: str, rw_url: str):
    mnt, scratch = tmp_path / "ro", tmp_path / "rw"
    probe = 'if echo x > "{0}/new" 2>/dev/null; then echo writable; else echo read-only; fi'
    recipe = {"name": name, "cluster": {"workers": 1},
              "mounts": {str(mnt): ro_url, str(scratch): {"url": rw_url, "mode": "rw"}},
              "experiments": {"cat": {"command": (
                  f'cp "{mnt}/a/b.bin" "$HYPER_OUTPUT/got"; '
                  f'{probe.format(mnt)} > "$HYPER_OUTPUT/ro"; '
                  f'{probe.format(scratch)} > "$HYPER_OUTPUT/rw"; '
                  f'cp "{mnt}/a/b.bin" "{scratch}/copy.bin"')}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return hyper("run", path), mnt, scratch


def check_run(r, hyper, hyper_home: Path, name: str, mnt: Path, scratch: Path,
              objects) -> None:
    """The task's view of the mounts, then `hyper down`: the rw writes are in the bucket,
    nothing in the read-only one, no mount and no rclone left. ``objects(which)``: the
    {key: bytes} of the ``ro`` or ``rw`` bucket prefix."""
    assert r.returncode == 0, r.stdout + r.stderr
    out = hyper_home / "storage" / f"{name}-1" / "cat-0000"
    assert (out / "got").read_bytes() == PAYLOAD
    assert (out / "ro").read_text() == "read-only\n"
    assert (out / "rw").read_text() == "writable\n"
    for m in (mnt, scratch):  # containers' users may read it, within the files' modes
        assert {"nosuid", "nodev", "allow_other", "default_permissions"} <= set(
            mount_options(m)), mount_options(m)
        assert len(rclones(m)) == 1
    assert "ro" in mount_options(mnt) and "rw" in mount_options(scratch)
    # the task's writes reach the bucket about a second after their files were closed
    wait_for(lambda: objects("rw") == {"new": b"x\n", "copy.bin": PAYLOAD}, timeout=60,
             what="the task's writes in the bucket")
    r = hyper("down", name)
    assert r.returncode == 0, r.stdout + r.stderr
    assert mount_options(mnt) is None and mount_options(scratch) is None
    assert rclones(mnt) == [] and rclones(scratch) == []
    got = objects("rw")
    assert got == {"new": b"x\n", "copy.bin": PAYLOAD}
    assert "new" not in objects("ro")


def test_gs_bucket_mounts_in_a_recipe(gcs, hyper, hyper_home, tmp_path):
    raw, scratch = gcs.make_bucket(), gcs.make_bucket()
    client = gcs.client()
    client.bucket(raw).blob("pre/a/b.bin").upload_from_string(PAYLOAD)

    def objects(which):
        b, prefix = (raw, "pre/") if which == "ro" else (scratch, "tmp/")
        return {x.name[len(prefix):]: x.download_as_bytes()
                for x in client.list_blobs(b, prefix=prefix)}
    try:
        r, mnt, rw = run_recipe(hyper, tmp_path, "gsb", f"gs://{raw}/pre", f"gs://{scratch}/tmp")
        check_run(r, hyper, hyper_home, "gsb", mnt, rw, objects)
    finally:
        cleanup(tmp_path / "ro", tmp_path / "rw")


def test_az_bucket_mounts_in_a_recipe(azurite, hyper, hyper_home, tmp_path):
    from emulators import AZURITE_ACCOUNT
    raw, scratch = azurite.make_bucket(), azurite.make_bucket()
    client = azurite.client()
    client.get_blob_client(raw, "pre/a/b.bin").upload_blob(PAYLOAD)

    def objects(which):
        c, prefix = (raw, "pre/") if which == "ro" else (scratch, "tmp/")
        cc = client.get_container_client(c)
        return {b.name[len(prefix):]: cc.download_blob(b.name).readall()
                for b in cc.list_blobs(name_starts_with=prefix)}
    try:
        r, mnt, rw = run_recipe(hyper, tmp_path, "azb", f"az://{AZURITE_ACCOUNT}/{raw}/pre",
                                f"az://{AZURITE_ACCOUNT}/{scratch}/tmp")
        check_run(r, hyper, hyper_home, "azb", mnt, rw, objects)
    finally:
        cleanup(tmp_path / "ro", tmp_path / "rw")


@pytest.mark.parametrize("cloud", ["gs", "az"])
def test_a_missing_bucket_is_an_error_naming_it(cloud, request, hyper, hyper_home, tmp_path):
    from emulators import AZURITE_ACCOUNT
    server = request.getfixturevalue("gcs" if cloud == "gs" else "azurite")
    name = server.new_bucket("missing")
    url = f"gs://{name}/pre" if cloud == "gs" else f"az://{AZURITE_ACCOUNT}/{name}/pre"
    mnt = tmp_path / "mnt"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({
        "name": "nobucket", "cluster": {"workers": 1}, "mounts": {str(mnt): url},
        "experiments": {"read": {"command": f'ls "{mnt}"'}}}))
    try:
        r = hyper("run", path)
        assert r.returncode == 1, r.stdout + r.stderr
        what = (f"no such bucket {name}" if cloud == "gs" else
                f"no such container {name} in account {AZURITE_ACCOUNT}")
        assert f"mounting {url} at {mnt} on nobucket-0 failed: error: {url}: {what}" in \
            r.stdout + r.stderr
        assert mount_options(mnt) is None and rclones(mnt) == []
    finally:
        cleanup(mnt)


def slow_rw_mount(url: str, mnt: Path, root: Path, write_back: int) -> list[int]:
    """Mount url rw at mnt as a node would (recorded under root), with rclone holding a
    closed file ``write_back`` s before uploading it; the rclone PIDs serving mnt."""
    start = (f"{sys.executable} -c 'import sys; from hypercli.mount import bucket; "
             f"bucket.WRITE_BACK_S = {write_back}; bucket.mount(*sys.argv[1:3], "
             "cache_dir=sys.argv[3], pid_file=sys.argv[4], rw=True)' "
             f"{url} {mnt} " + " ".join(bucket.node_paths(str(root), str(mnt))))
    (root / "mounts").mkdir(parents=True, exist_ok=True)
    mnt.mkdir(exist_ok=True)
    p = subprocess.run(["/bin/sh", "-c", guarded(str(mnt), str(root), start)],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return rclones(mnt)


def test_a_succeeded_attempts_writes_are_in_the_bucket_when_it_ends(gcs, tmp_path):
    """The command the agent runs after a successful task waits for the node's rw bucket
    mounts to upload what was written: a later experiment on another node reads it."""
    from hypercli.providers.runtime import NodeRuntime
    name = gcs.make_bucket()
    root, mnt = tmp_path / "node", tmp_path / "mnt"
    url = f"gs://{name}/w"
    try:
        slow_rw_mount(url, mnt, root, write_back=30)
        (mnt / "result.bin").write_bytes(PAYLOAD)
        wf = {"id": "wf-1", "storage": f"file://{tmp_path}/storage",
              "spec": {"mounts": {str(mnt): url, "/other": "chunks+file:///x"},
                       "rw_mounts": [str(mnt)]}}
        rt = NodeRuntime("n0", wf, str(root), f"{sys.executable} -m hypercli.mount.node",
                         lambda cmd: None)
        finish = rt.finish_command(str(tmp_path / "out"), "t-0")
        p = subprocess.run(["/bin/sh", "-c", finish], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        blob = gcs.client().bucket(name).blob("w/result.bin")
        assert blob.download_as_bytes() == PAYLOAD
        # a workflow with no rw bucket mount and no object storage has nothing to finish
        assert NodeRuntime("n0", {**wf, "spec": {}}, str(root), "h", print).finish_command(
            str(tmp_path / "out"), "t-0") is None
        subprocess.run(["/bin/sh", "-c", unmount_command(str(mnt), str(root))], check=True)
    finally:
        cleanup(mnt)


def test_down_waits_for_the_write_back_cache_and_stops_rclone_by_pid(gcs, tmp_path):
    """A file closed just before `hyper down` is still in rclone's write-back cache: the
    unmount waits for its upload instead of stopping rclone with it unsent."""
    name = gcs.make_bucket()
    root, mnt = tmp_path / "node", tmp_path / "mnt"
    try:
        # rclone holds the file 6 s after its close before uploading it: the unmount is first
        [pid] = slow_rw_mount(f"gs://{name}/w", mnt, root, write_back=6)
        (mnt / "late.bin").write_bytes(PAYLOAD)
        assert list(gcs.client().list_blobs(name)) == []  # not uploaded yet
        p = subprocess.run(["/bin/sh", "-c", unmount_command(str(mnt), str(root))],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert gcs.client().bucket(name).blob("w/late.bin").download_as_bytes() == PAYLOAD
        assert mount_options(mnt) is None
        wait_for(lambda: not Path(f"/proc/{pid}").exists(), timeout=10,
                 what="the stopped rclone to be reaped")
        assert not Path(bucket.node_paths(str(root), str(mnt))[1]).exists()
    finally:
        cleanup(mnt)


def test_credentials_reach_rclone_by_its_environment_only(azurite, tmp_path):
    """The account key signs a SAS that rclone gets in its environment: neither is on its
    command line, which every user of the node can read (ps)."""
    from emulators import AZURITE_ACCOUNT, AZURITE_KEY
    container = azurite.make_bucket()
    azurite.client().get_blob_client(container, "p/f").upload_blob(b"1")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache, pid_file = bucket.node_paths(str(tmp_path), str(mnt))
    (tmp_path / "mounts").mkdir()
    try:
        pid = bucket.mount(f"az://{AZURITE_ACCOUNT}/{container}/p", str(mnt), cache_dir=cache,
                           pid_file=pid_file)
        assert (mnt / "f").read_bytes() == b"1"
        argv = Path(f"/proc/{pid}/cmdline").read_text()
        env = Path(f"/proc/{pid}/environ").read_text()
        assert "sig=" in env and "sig=" not in argv and AZURITE_KEY not in argv
        assert oct(os.stat(pid_file).st_mode & 0o777) == "0o600"
    finally:
        cleanup(mnt)


def test_rclone_env_follows_the_nodes_identity():
    """Which credentials rclone is given (hypercli.mount.bucket's docstring), per cloud."""
    remote, env = bucket.rclone_env("gs://b1/x/y", {
        "HYPER_GCS_ENDPOINT_URL": "http://127.0.0.1:9", "RCLONE_CONFIG_X_TYPE": "s3"})
    assert remote == "HYPERBUCKET:b1/x/y"
    assert env["RCLONE_CONFIG_HYPERBUCKET_ANONYMOUS"] == "true"
    assert "RCLONE_CONFIG_X_TYPE" not in env and env["RCLONE_CONFIG"] == os.devnull
    # on a VM: the metadata server's token (rclone falls back to Google's default client)
    _, env = bucket.rclone_env("gs://b1", {"HYPER_GCS_ENDPOINT_URL": "http://127.0.0.1:9",
                                           "GCE_METADATA_HOST": "127.0.0.1:8"})
    assert "RCLONE_CONFIG_HYPERBUCKET_ANONYMOUS" not in env
    # Azure with a key, no custom endpoint: account and key
    conn = "AccountName=acct1;AccountKey=a2V5;EndpointSuffix=core.windows.net"
    remote, env = bucket.rclone_env("az://acct1/cont1/p", {"AZURE_STORAGE_CONNECTION_STRING": conn})
    assert remote == "HYPERBUCKET:cont1/p"
    assert (env["RCLONE_CONFIG_HYPERBUCKET_ACCOUNT"], env["RCLONE_CONFIG_HYPERBUCKET_KEY"]) == \
        ("acct1", "a2V5")
    # Azure without a connection string: the VM's managed identity
    _, env = bucket.rclone_env("az://acct1/cont1", {"AZURE_CLIENT_ID": "cid"})
    assert env["RCLONE_CONFIG_HYPERBUCKET_USE_MSI"] == "true"
    assert env["RCLONE_CONFIG_HYPERBUCKET_MSI_CLIENT_ID"] == "cid"
    from hypercli.errors import UsageError
    with pytest.raises(UsageError, match="'Acct_1' is not a storage account name"):
        bucket.rclone_env("az://Acct_1/c1", {})
    with pytest.raises(UsageError, match="'c' is not a container name"):
        bucket.rclone_env("az://acct1/c/p", {})
    with pytest.raises(UsageError, match="is for account 'other'"):
        bucket.rclone_env("az://acct1/cont1", {"AZURE_STORAGE_CONNECTION_STRING":
                                            "AccountName=other;AccountKey=a2V5"})


def test_a_gs_mount_on_a_vm_uses_the_service_accounts_token(gcs_server, tmp_path,
                                                            monkeypatch):
    """On a GCP node rclone gets no credentials of hypercli's: it reads the VM's service
    account token from the metadata server (GCE_METADATA_HOST), like the node's store
    clients; the emulator sits behind a proxy that refuses any request without that token."""
    from hypercli.mount.store_base import StoreError
    from tokenstandins import BearerProxy, MetadataServer
    token = "ya29.rclone-node-token"
    name = gcs_server.make_bucket()
    gcs_server.client().bucket(name).blob("p/f.bin").upload_from_string(PAYLOAD)
    metadata = MetadataServer(token)
    proxy = BearerProxy(gcs_server.endpoint.split("://", 1)[1], token)
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    cache, pid_file = bucket.node_paths(str(tmp_path), str(mnt))
    (tmp_path / "mounts").mkdir()
    try:
        monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", proxy.url)
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
        monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
        monkeypatch.setenv("HOME", str(tmp_path))  # no gcloud credentials of the user's
        # without the metadata server the requests are anonymous, and refused
        with pytest.raises(StoreError, match=f"gs://{name}/p: rclone cannot list it"):
            bucket.mount(f"gs://{name}/p", str(mnt), cache_dir=cache, pid_file=pid_file)
        assert proxy.seen and set(proxy.seen) == {None}
        monkeypatch.setenv("GCE_METADATA_HOST", metadata.host)
        proxy.seen.clear()
        bucket.mount(f"gs://{name}/p", str(mnt), cache_dir=cache, pid_file=pid_file)
        assert (mnt / "f.bin").read_bytes() == PAYLOAD
        assert metadata.asked["gce"] >= 1
        assert proxy.seen and set(proxy.seen) == {f"Bearer {token}"}
    finally:
        cleanup(mnt)
        proxy.close()
        metadata.close()


def cache_record(root: Path, mnt: Path, name: str) -> dict | None:
    """``Dirty`` and ``Rs`` (the ranges cached) of rclone's record of file ``name`` in the
    write-back cache of the bucket mount at mnt, or None while there is none whole."""
    import json
    cache = Path(bucket.node_paths(str(root), str(mnt))[0])
    for meta in (cache / "vfsMeta").rglob(name):
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            return None
        return {"Dirty": info.get("Dirty"), "Rs": info.get("Rs")}
    return None


def test_writes_a_dead_rclone_had_not_uploaded_are_uploaded_by_the_next_mount(gcs, tmp_path):
    """rclone dies (the OOM killer) with a closed file still in its write-back cache: the
    next run's mount finds the dead mount, mounts again over the same cache, and the file
    reaches the bucket."""
    from hypercli.providers.runtime import mount_command
    name = gcs.make_bucket()
    root, mnt = tmp_path / "node", tmp_path / "mnt"
    hyper = f"{sys.executable} -m hypercli.mount.node"
    blob = gcs.client().bucket(name).blob("w/kept.bin")
    try:
        [pid] = slow_rw_mount(f"gs://{name}/w", mnt, root, write_back=30)
        (mnt / "kept.bin").write_bytes(PAYLOAD)
        # the kernel tells rclone of the close after close() returned; rclone then rewrites
        # the file's record in place (a kill in that moment loses the file: rclone's limit)
        wait_for(lambda: cache_record(root, mnt, "kept.bin") == {
            "Dirty": True, "Rs": [{"Pos": 0, "Size": len(PAYLOAD)}]},
            what="rclone to record the closed file as not uploaded")
        os.kill(pid, 9)
        wait_for(lambda: not rclones(mnt), what="rclone to die")
        assert not blob.exists()
        again = guarded(str(mnt), str(root), mount_command(
            hyper, f"gs://{name}/w", str(mnt), str(root / "cache"), rw=True, root=str(root)))
        p = subprocess.run(["/bin/sh", "-c", again], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        assert len(rclones(mnt)) == 1 and rclones(mnt) != [pid]
        wait_for(blob.exists, timeout=60, what="the file the dead rclone left to be uploaded")
        assert blob.download_as_bytes() == PAYLOAD
        p = subprocess.run(["/bin/sh", "-c", unmount_command(str(mnt), str(root))],
                           capture_output=True, text=True)
        assert p.returncode == 0 and rclones(mnt) == [] and mount_options(mnt) is None
    finally:
        cleanup(mnt)


def test_a_pid_file_naming_another_process_stops_nothing(tmp_path):
    """The PID file is in the node's hypercli folder, where a task may write: one naming
    another process (with its true start time) gets that process neither waited for nor
    killed."""
    from hypercli.providers.runtime import _stop_rclone
    other = subprocess.Popen(["sleep", "60"])
    try:
        mnt = str(tmp_path / "mnt")
        pid_file = Path(bucket.node_paths(str(tmp_path), mnt)[1])
        pid_file.parent.mkdir()
        pid_file.write_text(f"{other.pid} {bucket.start_time(other.pid)}\n")
        subprocess.run(["/bin/sh", "-c", _stop_rclone(mnt, str(tmp_path))], check=True)
        assert other.poll() is None and not pid_file.exists()
    finally:
        other.kill()
        other.wait()


def test_a_node_without_rclone_is_told_to_install_it(tmp_path, monkeypatch, capsys):
    from hypercli.mount.node import main
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", "http://127.0.0.1:9")
    (tmp_path / "mnt").mkdir()
    assert main(["bucket-mount", "gs://b/p", str(tmp_path / "mnt"), "--root",
                 str(tmp_path)]) == 1
    assert capsys.readouterr().err == (
        "error: rclone is not installed on this node: gs:// and az:// bucket mounts need it "
        "(install it: apt-get install rclone)\n")


HOST_RCLONES = ("for p in /proc/[0-9]*; do tr '\\0' ' ' < $p/cmdline 2>/dev/null | "
                "grep -q '^/usr/bin/rclone mount ' && echo ${p#/proc/}; done")


def test_gs_bucket_mounts_on_ssh_nodes(ssh_hosts, gcs_server, hyper, hyper_home, tmp_path,
                                       monkeypatch):
    """The same over SSH: each node mounts with its own rclone (the emulator's endpoint
    passed on, as for the store clients), and `hyper down` stops it there."""
    from s3server import Proxy
    [host] = ssh_hosts.start(1)
    relay = Proxy(gcs_server.port, host="10.213.0.1")  # the bridge: reachable from the host
    relay.start()
    try:
        monkeypatch.setenv("HYPER_GCS_ENDPOINT_URL", f"http://10.213.0.1:{relay.port}")
        monkeypatch.delenv("STORAGE_EMULATOR_HOST", raising=False)
        raw, scratch = gcs_server.make_bucket(), gcs_server.make_bucket()
        from google.auth.credentials import AnonymousCredentials
        from google.cloud import storage
        # through the relay: the emulator names an object's download URL by the Host it
        # was uploaded through, and the node reaches the relay only
        client = storage.Client(project="hypercli", credentials=AnonymousCredentials(),
                                client_options={"api_endpoint": os.environ[
                                    "HYPER_GCS_ENDPOINT_URL"]})
        client.bucket(raw).blob("pre/a/b.bin").upload_from_string(PAYLOAD)
        recipe = {"name": "sshb", "cluster": {"provider": "ssh", "hosts": [host.address()],
                                              "identity_file": str(ssh_hosts.client_key)},
                  "mounts": {"/raw": f"gs://{raw}/pre",
                             "/rw": {"url": f"gs://{scratch}/tmp", "mode": "rw"}},
                  "experiments": {"cat": {"command": (
                      'set -e; cp /raw/a/b.bin /rw/copy.bin; cmp /raw/a/b.bin /rw/copy.bin; '
                      'if touch /raw/new 2>/dev/null; then exit 9; fi; '
                      'grep -E " /(raw|rw) fuse.rclone" /proc/mounts')}}}
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(recipe))
        r = hyper("run", path, "--trust-new-hosts")
        assert r.returncode == 0, r.stdout + r.stderr + hyper("logs", "sshb-1/cat-0000").stderr
        mounts = hyper("logs", "sshb-1/cat-0000").stdout
        assert all("nosuid" in line and "nodev" in line for line in mounts.splitlines()), mounts
        assert len(host.run(HOST_RCLONES).stdout.split()) == 2
        r = hyper("down", "sshb")
        assert r.returncode == 0, r.stdout + r.stderr
        assert host.run(HOST_RCLONES).stdout.split() == []
        assert host.run("awk '$2 ~ /^\\/(raw|rw)$/' /proc/mounts").stdout.strip() == ""
        assert client.bucket(scratch).blob("tmp/copy.bin").download_as_bytes() == PAYLOAD
    finally:
        host.run("fusermount3 -uz /raw; fusermount3 -uz /rw; "
                 f"for p in $({HOST_RCLONES}); do kill -9 $p; done")
        relay.stop()


def test_a_read_only_az_mount_gets_a_sas_that_cannot_write(azurite):
    """The SAS hypercli signs for a read-only mount allows reading and listing only: even a
    rclone without --read-only could not write with it."""
    from urllib.parse import parse_qs, urlparse

    from emulators import AZURITE_ACCOUNT
    for rw, perms in ((False, "rl"), (True, "racwdl")):
        _, env = bucket.rclone_env(f"az://{AZURITE_ACCOUNT}/cont1/p", rw=rw)
        sas = parse_qs(urlparse(env["RCLONE_CONFIG_HYPERBUCKET_SAS_URL"]).query)
        assert sas["sp"] == [perms]
