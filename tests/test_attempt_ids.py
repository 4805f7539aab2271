"""Attempt ids are unique across state files: two HYPER_HOMEs (a laptop and a CI job) running
a recipe of the same name on the same SSH host both run their tasks; the second is not
answered with the first one's attempts, whose ids a node's agent still knows."""

from __future__ import annotations

import pytest

from test_ssh import ssh_recipe

pytestmark = pytest.mark.slow


def test_same_workflow_name_from_two_state_files(ssh_hosts, tmp_path, hyper, monkeypatch):
    [host] = ssh_hosts.start(1)
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {"work": {
        "parameters": {"i": [1, 2]},
        "command": 'echo "$HYPER_WORKFLOW {{i}}" >> /tmp/runs'}})
    for home in ("laptop", "ci"):
        monkeypatch.setenv("HYPER_HOME", str(tmp_path / home))
        r = hyper("run", path, "--trust-new-hosts")
        assert r.returncode == 0, r.stdout + r.stderr
        assert "workflow lab-1" in r.stdout  # the same workflow id in each state file
    runs = host.run("cat /tmp/runs").stdout.split("\n")
    assert sorted(x for x in runs if x) == ["lab-1 1", "lab-1 1", "lab-1 2", "lab-1 2"]
