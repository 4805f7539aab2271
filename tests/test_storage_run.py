"""Recipes with `mounts:` and object storage, run end to end: the chunked dataset is mounted on
every node before its tasks start, task outputs are pushed to S3 when attempts succeed, a later
experiment reads them through HYPER_OUTPUTS, the user pulls them, and `hyper down` unmounts.
Real moto S3 server, real FUSE mounts, real sshd test hosts."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from hypercli.mount import pack
from s3server import CREDENTIALS, S3Server

pytestmark = pytest.mark.slow


def make_dataset(root: Path, n: int = 40) -> dict[str, str]:
    files = {}
    for i in range(n):
        rel = f"shard-{i % 4}/item-{i:03d}.txt"
        files[rel] = f"item {i} " + "x" * (i * 37)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(files[rel])
    return files


def mounted(path: Path) -> bool:
    return any(line.split()[1] == str(path) for line in open("/proc/mounts"))


def experiments(mnt: Path) -> dict:
    return {
        "read": {"parameters": {"i": [0, 5, 10, 39]},
                 "command": f'cp "{mnt}/shard-$(({{{{i}}}} % 4))/item-$(printf %03d {{{{i}}}}).txt" '
                            '"$HYPER_OUTPUT/copy"\n'
                            f'ls "{mnt}" > "$HYPER_OUTPUT/listing"'},
        "total": {"after": ["read"],
                  "command": 'cat "$HYPER_OUTPUTS"/read-*/copy | wc -c > "$HYPER_OUTPUT/bytes"\n'
                             'ls "$HYPER_OUTPUTS" > "$HYPER_OUTPUT/seen"'},
    }


def check_outputs(tmp_path: Path, wid: str, files: dict) -> None:
    out = tmp_path / "pulled"
    pack.pull(f"s3://bkt/out/{wid}/total-0000", out)
    expected = sum(len(files[f"shard-{i % 4}/item-{i:03d}.txt"]) for i in (0, 5, 10, 39))
    assert int((out / "bytes").read_text()) == expected
    seen = (out / "seen").read_text().split()  # HYPER_OUTPUTS: the inputs and its own folder
    assert [t for t in seen if t.startswith("read-")] == [f"read-000{i}" for i in range(4)]
    one = tmp_path / "one"
    pack.pull(f"s3://bkt/out/{wid}/read-0003", one)
    assert (one / "copy").read_text() == files["shard-3/item-039.txt"]
    assert (one / "listing").read_text().split() == ["shard-0", "shard-1", "shard-2", "shard-3"]


def test_local_run_with_mount_and_s3_outputs(s3, hyper, hyper_home, tmp_path):
    s3.make_bucket("bkt")
    files = make_dataset(tmp_path / "src")
    pack.push(tmp_path / "src", "s3://bkt/ds", chunk_size=1 << 20)
    mnt = tmp_path / "mnt"
    recipe = {"name": "mounted", "cluster": {"workers": 2}, "storage": "s3://bkt/out",
              "mounts": {str(mnt): "chunks+s3://bkt/ds"}, "experiments": experiments(mnt)}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    try:
        r = hyper("run", path)
        assert r.returncode == 0, r.stdout + r.stderr
        assert mounted(mnt)
        check_outputs(tmp_path, "mounted-1", files)
        r = hyper("down", "mounted")
        assert r.returncode == 0 and f"mount {mnt}" in r.stdout
        assert not mounted(mnt)
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def test_ssh_run_with_mount_and_s3_outputs(ssh_hosts, hyper, hyper_home, tmp_path,
                                           monkeypatch):
    hosts = ssh_hosts.start(2)
    if hosts[0].run("python3 -c 'import boto3'").returncode != 0:
        pytest.skip("the hosts' python3 has no boto3 (Debian: python3-boto3)")
    with S3Server(host="10.213.0.1") as s3:  # the bridge address: reachable from the hosts
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("HYPER_S3_ENDPOINT_URL", s3.endpoint)
        for h in hosts:  # the nodes' own credentials, as an instance would have them
            h.run("mkdir -p ~/.aws && printf '[default]\\naws_access_key_id = testing\\n"
                  "aws_secret_access_key = testing\\n' > ~/.aws/credentials", check=True)
        s3.make_bucket("bkt")
        files = make_dataset(tmp_path / "src")
        pack.push(tmp_path / "src", "s3://bkt/ds", chunk_size=1 << 20)
        recipe = {"name": "sshmount", "storage": "s3://bkt/out",
                  "cluster": {"provider": "ssh", "hosts": [h.address() for h in hosts],
                              "identity_file": str(ssh_hosts.client_key)},
                  "mounts": {"/data": "chunks+s3://bkt/ds"}, "experiments": experiments(
                      Path("/data"))}
        path = tmp_path / "r.yaml"
        path.write_text(yaml.safe_dump(recipe))
        r = hyper("run", path, "--trust-new-hosts")
        assert r.returncode == 0, r.stdout + r.stderr + hyper("logs", "sshmount-1/read-0000").stderr
        used = {a["node"] for a in json.loads(hyper("ps", "sshmount", "--json").stdout)
                if a["node"]}
        for i, h in enumerate(hosts):
            is_mounted = h.run("awk '$2 == \"/data\"' /proc/mounts").stdout.strip() != ""
            assert is_mounted == (f"sshmount-{i}" in used)
        check_outputs(tmp_path, "sshmount-1", files)
        r = hyper("down", "sshmount")
        assert r.returncode == 0, r.stderr
        for h in hosts:
            assert h.run("awk '$2 == \"/data\"' /proc/mounts").stdout.strip() == ""


def test_plain_bucket_mount_in_a_recipe(s3, hyper, hyper_home, tmp_path):
    import shutil
    if not (shutil.which("goofys") or shutil.which("s3fs")):
        pytest.skip("neither goofys nor s3fs is installed (Debian: s3fs)")
    s3.make_bucket("raw1")
    s3.client().put_object(Bucket="raw1", Key="pre/a/b.txt", Body=b"per-object file")
    s3.make_bucket("scratch1")
    mnt, scratch = tmp_path / "raw", tmp_path / "scratch"
    probe = 'if echo x > "{0}/new" 2>/dev/null; then echo writable; else echo read-only; fi'
    recipe = {"name": "bucket", "cluster": {"workers": 1},
              "mounts": {str(mnt): "s3://raw1/pre",
                         str(scratch): {"url": "s3://scratch1/tmp", "mode": "rw"}},
              "experiments": {"cat": {"command": (
                  f'cat "{mnt}/a/b.txt" > "$HYPER_OUTPUT/got"; '
                  f'{probe.format(mnt)} > "$HYPER_OUTPUT/raw"; '
                  f'{probe.format(scratch)} > "$HYPER_OUTPUT/scratch"')}}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    try:
        r = hyper("run", path)
        assert r.returncode == 0, r.stdout + r.stderr
        out = hyper_home / "storage" / "bucket-1" / "cat-0000"
        assert (out / "got").read_text() == "per-object file"
        # a dataset bucket is read-only unless the recipe asks for rw
        assert (out / "raw").read_text() == "read-only\n"
        assert (out / "scratch").read_text() == "writable\n"
        assert s3.client().get_object(Bucket="scratch1", Key="tmp/new")["Body"].read() == b"x\n"
        assert "new" not in [o["Key"] for o in s3.client().list_objects_v2(
            Bucket="raw1").get("Contents", [])]
        assert hyper("down", "bucket").returncode == 0
        assert not mounted(mnt) and not mounted(scratch)
    finally:
        for m in (mnt, scratch):
            subprocess.run(["fusermount", "-uz", str(m)], capture_output=True)


def daemon_pids(mnt: Path) -> list[int]:
    """PIDs of the mount daemons serving mnt (their command line names it)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if d.name.isdigit() and str(mnt).encode() in argv and b"hypercli.mount.fusefs" in argv:
            out.append(int(d.name))
    return out


def kill_daemon(mnt: Path) -> None:
    """SIGKILL the daemon of mnt: the mount stays in the mount table, dead (ECONNABORTED,
    then ENOTCONN)."""
    pids = daemon_pids(mnt)
    assert len(pids) == 1, pids
    os.kill(pids[0], signal.SIGKILL)
    end = time.monotonic() + 10
    while pids[0] in daemon_pids(mnt) and time.monotonic() < end:
        time.sleep(0.05)
    with pytest.raises(OSError) as e:
        os.statvfs(mnt)  # stat may still answer from the kernel's cached attributes
    assert e.value.errno in (errno.ECONNABORTED, errno.ENOTCONN) and mounted(mnt)


def test_a_mount_whose_daemon_died_is_mounted_again_and_taken_down(hyper, hyper_home,
                                                                    tmp_path):
    """The mount daemon dies (OOM killer, a crash): its mount stays behind, dead. The next
    run on the node mounts the dataset again, and `hyper down` removes a dead mount too."""
    files = make_dataset(tmp_path / "src", n=8)
    url = "file://" + str(tmp_path / "store")
    pack.push(tmp_path / "src", url, chunk_size=1 << 20)
    mnt = tmp_path / "mnt"

    def recipe(rel: str) -> Path:  # a file no run read before: not in the page cache
        path = tmp_path / f"{rel.replace('/', '-')}.yaml"
        path.write_text(yaml.safe_dump({
            "name": "remount", "cluster": {"workers": 1}, "mounts": {str(mnt): "chunks+" + url},
            "experiments": {"read": {"command": f'cat "{mnt}/{rel}"'}}}))
        return path
    try:
        assert hyper("run", recipe("shard-3/item-007.txt")).returncode == 0
        kill_daemon(mnt)
        r = hyper("run", recipe("shard-2/item-006.txt"))
        assert r.returncode == 0, r.stdout + r.stderr
        assert (mnt / "shard-1" / "item-005.txt").read_text() == files["shard-1/item-005.txt"]
        kill_daemon(mnt)
        r = hyper("down", "remount")
        assert r.returncode == 0, r.stdout + r.stderr
        assert not mounted(mnt)
    finally:
        for pid in daemon_pids(mnt):
            os.kill(pid, signal.SIGKILL)
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def test_a_mount_that_fails_says_why_not_the_shell_text(hyper, hyper_home, tmp_path):
    """A recipe mount of a dataset that is not there: the attempt fails with the mount's own
    reason, not the shell text that ran it."""
    mnt = tmp_path / "mnt"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump({
        "name": "nodata", "cluster": {"workers": 1},
        "mounts": {str(mnt): f"chunks+file://{tmp_path}/nothing"},
        "experiments": {"read": {"command": f'ls "{mnt}"'}}}))
    try:
        r = hyper("run", path)
        assert r.returncode == 1, r.stdout + r.stderr
        assert (f"mounting chunks+file://{tmp_path}/nothing at {mnt} on nodata-0 failed: "
                f"error: no dataset at file://{tmp_path}/nothing") in r.stdout + r.stderr
        assert "fusermount" not in r.stdout + r.stderr
    finally:
        subprocess.run(["fusermount3", "-uz", str(mnt)], capture_output=True)


def test_a_failed_node_command_is_told_by_its_stderr():
    """Over SSH too: the reason is the last lines the command wrote on stderr; a command
    that wrote none is told by the error, which names it."""
    from hypercli.providers.runtime import NodeSetupError, _said
    from hypercli.ssh.conn import CommandFailed, Result
    said = "\n".join(f"line {i}" for i in range(8))
    assert _said(CommandFailed("n1", Result("mount x", 1, b"", said.encode()))) == \
        "\n".join(f"line {i}" for i in range(3, 8))
    assert _said(CommandFailed("n1", Result("mount x", 7, b"", b""))) == \
        "node n1: `mount x` exited 7"
    assert _said(NodeSetupError("`mount y` exited 2: why", stderr="why\n")) == "why"
