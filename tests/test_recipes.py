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
    assert sorted((a["rank"], a["status"]) for a in ranks) == [(0, "succeeded"),
                                                                (1, "succeeded")]
    assert len({a["node"] for a in ranks}) == 2
    out = hyper_home / "storage" / "distributed-training-1" / "train-0000" / "model.pt"
    assert out.stat().st_size > 0
