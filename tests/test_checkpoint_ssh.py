"""Checkpoint resume after a host is killed, on SSH test hosts: with file:// storage (the
node saves into a store of its own, which the driver copies here) and with S3 storage on
loopback (the node saves there itself), the retry on another host starts from the last
saved step, not from 0; a gang whose ranks each save their own shard with
torch.distributed.checkpoint resumes on a spare with every rank's shard back."""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
import threading
import time
from pathlib import Path

import pytest

from conftest import wait_for
from s3server import CREDENTIALS, S3Server
from test_ssh import run_in_process, ssh_recipe

from hypercli.state import State

pytestmark = pytest.mark.slow
JOB = Path(__file__).parent / "ckptjob"


def run_and_kill(tmp_path, ssh_hosts, hosts, **top):
    work = tmp_path / "work"
    shutil.copytree(JOB, work)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"train": {
        "retries": 2, "checkpoint_every": 1,  # 2: a loaded machine may lose a node twice
        # 200 steps of 0.05 s: still running when the host is killed 3.5 s after the attempt
        # is recorded running, even when the record lags on a loaded machine
        "command": "python3 count.py 200 0.05"}}, workdir=str(work), **top)
    killed = {}

    def kill_after_saves():
        a = wait_for(lambda: (lambda r: r[0] if r else None)(
            [x for x in State().attempts("lab-1", status=["running"])]
            if (Path(State().path)).exists() else []), timeout=60, what="the task running")
        time.sleep(3.5)  # a few periodic saves
        killed["node"] = a["node"]
        hosts[int(a["node"].rsplit("-", 1)[1])].kill()
    t = threading.Thread(target=kill_after_saves)
    t.start()
    state, summary = run_in_process(path)
    t.join()
    assert summary.exit_code == 0, [
        (a["status"], a["exit_code"], a["error"],
         (Path(State().path).parent / "logs" / a["id"] / "stderr").read_text()[-2000:]
         if (Path(State().path).parent / "logs" / a["id"] / "stderr").exists() else "")
        for a in state.attempts("lab-1")]
    attempts = state.attempts("lab-1", "train-0000")
    assert attempts[0]["status"] == "lost" and attempts[0]["node"] == killed["node"]
    assert attempts[-1]["status"] == "succeeded" and attempts[-1]["node"] != killed["node"]
    metrics = state.task("lab-1", "train-0000")["metrics"]
    assert metrics["steps"] == 200 and 0 < metrics["start"] < 200, metrics
    return state, attempts


def test_resume_after_a_host_is_killed_file_storage(ssh_hosts, tmp_path, hyper_home):
    hosts = ssh_hosts.start(2)
    run_and_kill(tmp_path, ssh_hosts, hosts)
    kept = hyper_home / "storage" / "lab-1" / ".checkpoints" / "train-0000"
    assert list(kept.glob("gen/*.json")) and list(kept.glob("packs/*"))


def test_resume_after_a_host_is_killed_s3_storage(ssh_hosts, tmp_path, hyper_home,
                                                  monkeypatch):
    hosts = ssh_hosts.start(2)
    if hosts[0].run("python3 -c 'import boto3'").returncode != 0:
        pytest.skip("the hosts' python3 has no boto3 (Debian: python3-boto3)")
    with S3Server(host="10.213.0.1") as s3:
        for k, v in CREDENTIALS.items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("HYPER_S3_ENDPOINT_URL", s3.endpoint)
        for h in hosts:
            h.run("mkdir -p ~/.aws && printf '[default]\\naws_access_key_id = testing\\n"
                  "aws_secret_access_key = testing\\n' > ~/.aws/credentials", check=True)
        s3.make_bucket("bkt")
        run_and_kill(tmp_path, ssh_hosts, hosts, storage="s3://bkt/out")
        from hypercli.mount.checkpoint import generations
        from hypercli.mount.store import open_store
        gens = generations(open_store("s3://bkt/out/lab-1/.checkpoints/train-0000"))
        assert {a for a, _ in gens} == {1, 2}  # both attempts saved, in generations of their own


def need_torch():
    try:
        import torch.distributed.checkpoint  # noqa: F401
    except ImportError:
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1":
            pytest.fail("PyTorch is not installed beside hypercli (scripts/test.sh installs it)")
        pytest.skip("PyTorch is not installed beside hypercli")


def test_sharded_checkpoint_resumes_on_a_spare_with_every_ranks_shard(ssh_hosts, tmp_path,
                                                                       hyper_home):
    """2 ranks (gloo, CPU) each save their own shard with torch.distributed.checkpoint into
    their own HYPER_CHECKPOINT every step; the host under rank 1 is killed once both ranks'
    saves of a finished step have reached here; the gang is retried on the spare and resumes
    from the newest step both ranks kept, each rank loading its own shard."""
    need_torch()
    packages = sysconfig.get_paths()["purelib"]  # under /tmp or /root in a clone there
    hosts = ssh_hosts.start(3, share=(packages,))
    work = tmp_path / "work"
    shutil.copytree(JOB, work)
    # the hosts' /usr/bin/python3 (3.11, as this one) with this Python's packages: PyTorch's
    # CPU build (Debian's 1.13 has no torch.distributed.checkpoint)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"train": {
        "nodes": 2, "retries": 2, "checkpoint_every": 1,
        "env": {"PYTHONPATH": packages},
        "command": "/usr/bin/python3 dcp_train.py 80 0.25"}}, workdir=str(work))
    kept = hyper_home / "storage" / "lab-1" / ".checkpoints" / "train-0000"
    killed = {}

    def a_done_step_saved(rank: int) -> bool:
        try:
            newest = sorted((kept / f"rank-{rank}" / "gen").glob("*.json"))[-1]
            return any(f.endswith("/done") for f in json.loads(newest.read_bytes())["files"])
        except (IndexError, OSError, ValueError):
            return False

    def kill_under_rank_1():
        wait_for(lambda: a_done_step_saved(0) and a_done_step_saved(1), timeout=300,
                 what="a finished step of each rank saved here")
        [a] = [x for x in State().attempts("lab-1", status=["running"])
               if x["rank"] == 1 and x["number"] == 1]
        killed["node"] = a["node"]
        hosts[int(a["node"].rsplit("-", 1)[1])].kill()
    t = threading.Thread(target=kill_under_rank_1)
    t.start()
    state, summary = run_in_process(path)
    t.join()
    by = {(a["number"], a["rank"]): a for a in state.attempts("lab-1", "train-0000")}
    def log(a, name):
        f = Path(State().path).parent / "logs" / a["id"] / name
        return f.read_text() if f.exists() else ""
    logs = {k: log(a, "stdout") for k, a in by.items()}
    assert summary.exit_code == 0, [(k, a["status"], a["exit_code"], a["error"], a["node"],
                                     logs[k], log(a, "stderr")[-1500:]) for k, a in by.items()]
    assert by[(1, 1)]["status"] == "lost" and by[(1, 1)]["node"] == killed["node"]
    last = max(n for n, _ in by)
    assert [by[(last, r)]["status"] for r in (0, 1)] == ["succeeded"] * 2
    assert killed["node"] not in {by[(last, r)]["node"] for r in (0, 1)}  # the spare took it
    metrics = state.task("lab-1", "train-0000")["metrics"]
    assert metrics["shards_ok"] is True and metrics["steps"] == 80, (metrics, logs)
    assert 0 < metrics["start"] < 80, (metrics, logs)  # resumed, each from its own shard
    assert f"rank 1 attempt {last} starts at step {metrics['start']}, shard as saved" in logs[
        (last, 1)]
