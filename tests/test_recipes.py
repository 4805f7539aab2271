"""The example recipes of recipes/, run end to end on the local provider."""

from __future__ import annotations

import json
import os

import pytest

from conftest import ROOT
from hypercli.state import State


def need_torch():
    try:
        import torch  # noqa: F401
    except ImportError:
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1":
            pytest.fail("PyTorch is not installed beside hypercli (scripts/test.sh installs it)")
        pytest.skip("PyTorch is not installed beside hypercli")


def test_distributed_training_recipe(hyper_home, hyper):
    need_torch()
    r = hyper("run", ROOT / "recipes" / "distributed-training.yaml", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(hyper("results", "distributed-training", "--json", check=True).stdout)
    [row] = rows
    assert row["metrics"]["world_size"] == 2 and row["metrics"]["in_sync"] is True
    assert row["metrics"]["loss"] < 0.05  # it learned (the noise floor is 1e-4)
    ranks = State().attempts("distributed-training-1", "train-0000")
    errs = [(hyper_home / "local" / "tasks" / a["id"] / "stderr") for a in ranks]
    assert sorted((a["rank"], a["status"]) for a in ranks) == [(0, "succeeded"),
                                                                (1, "succeeded")], [
        e.read_text()[-3000:] for e in errs if e.exists()]
    assert len({a["node"] for a in ranks}) == 2
    out = hyper_home / "storage" / "distributed-training-1" / "train-0000" / "model.pt"
    assert out.stat().st_size > 0


def test_distributed_training_resumes_from_its_checkpoint(hyper_home, tmp_path):
    """The node under a rank goes away mid-run (its processes killed): the gang restarts as
    one, every rank restores rank 0's last saved checkpoint, training goes on from there."""
    need_torch()
    import signal
    import subprocess

    import yaml

    from conftest import hyper_cmd, wait_for
    recipe = yaml.safe_load((ROOT / "recipes" / "distributed-training.yaml").read_text())
    recipe["workdir"] = str(ROOT / "recipes")
    recipe["experiments"]["train"]["checkpoint_every"] = 1
    recipe["experiments"]["train"]["command"] += " --pause 0.4"
    path = tmp_path / "dt.yaml"
    path.write_text(yaml.safe_dump(recipe))
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        kept = hyper_home / "storage" / "distributed-training-1" / ".checkpoints" / "train-0000"
        wait_for(lambda: len(list(kept.glob("gen/*.json"))) >= 3, timeout=90,
                 what="three saved checkpoints")
        [rank1] = [a for a in State().attempts("distributed-training-1", status=["running"])
                   if a["rank"] == 1]
        pid = json.loads((hyper_home / "local" / "tasks" / rank1["id"] / "pid").read_text())
        os.killpg(pid["pid"], signal.SIGKILL)
        out, err = p.communicate(timeout=180)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out + err
    state = State()
    by = {(a["number"], a["rank"]): a["status"]
          for a in state.attempts("distributed-training-1", "train-0000")}
    assert by[(1, 1)] == "failed" and by[(1, 0)] in ("cancelled", "failed")
    assert by[(2, 0)] == by[(2, 1)] == "succeeded"
    m = state.task("distributed-training-1", "train-0000")["metrics"]
    assert 0 < m["started_at_epoch"] < 20 and m["in_sync"] and m["loss"] < 0.05, m
