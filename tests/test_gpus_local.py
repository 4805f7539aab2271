"""GPUs on the local provider, with a stand-in `nvidia-smi` on PATH that answers the query
hypercli makes in the real tool's CSV format: each task sees exactly its own GPU, a task
waits (and says so in `hyper ps`) while no GPU is free, and `hyper logs --rank` reads a rank."""

from __future__ import annotations

import os
import subprocess

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.state import State

FAKE_SMI = """#!/bin/sh
# stand-in for nvidia-smi --query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits
case "$*" in
  *--query-gpu=index,name,memory.total,uuid*)
    echo "0, NVIDIA A100-SXM4-40GB, 40960, GPU-00000000-0000-0000-0000-000000000000"
    echo "1, NVIDIA A100-SXM4-40GB, 40960, GPU-11111111-1111-1111-1111-111111111111";;
  *) echo "unknown query" >&2; exit 2;;
esac
"""


def test_each_task_sees_its_own_gpu_and_waits_for_one(hyper_home, write_recipe, hyper,
                                                      tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(FAKE_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    path = write_recipe(f"""
        name: gpu
        cluster: {{workers: 2}}
        experiments:
          train:
            parameters: {{i: [0, 1, 2]}}
            resources: {{gpus: 1}}
            command: |
              echo "$CUDA_VISIBLE_DEVICES $NVIDIA_VISIBLE_DEVICES $HYPER_GPUS" > "$HYPER_OUTPUT/gpu"
              while [ ! -e {tmp_path}/go ] && [ {{{{i}}}} != 2 ]; do sleep 0.05; done
          cpu:
            command: echo "cpu sees [$CUDA_VISIBLE_DEVICES]"
    """)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (hyper_home / "state.db").exists() and len(
            State().attempts("gpu-1", status=["running"])) >= 2, what="2 GPU tasks running")
        ps = wait_for(lambda: (lambda out: out if "waiting for 1 GPU" in out else None)(
            hyper("ps", "gpu-1").stdout), what="ps shows a task waiting for a GPU")
        assert "train-0002" in ps or "cpu-0000" in ps
        (tmp_path / "go").touch()
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out + err
    store = hyper_home / "storage" / "gpu-1"
    seen = [(store / f"train-000{i}" / "gpu").read_text().split() for i in range(3)]
    for cuda, nvidia, mine in seen:
        assert cuda == nvidia == mine and mine in ("0", "1")
    state = State()
    first_two = sorted(state.attempts("gpu-1"), key=lambda a: a["created_at"])[:2]
    assert {a["claim"]["gpus"][0] for a in first_two} == {0, 1}  # never the same GPU at once
    logs = hyper("logs", "gpu-1/cpu-0000")
    assert "cpu sees []" in logs.stdout  # a task without GPUs sees none
    r = hyper("logs", "gpu-1/cpu-0000", "--rank", "1")
    assert r.returncode == 2 and "not a multi-node task" in r.stderr
