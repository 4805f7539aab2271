"""Faults of a node, not of a task: a container task on a node whose container runtime does
not work is not started there and keeps its retries; the node gets no more container tasks;
when no node can run it, the run ends with exit 3 (infrastructure) naming the cause."""

from __future__ import annotations

import os

from hypercli.state import State

BROKEN_DOCKER = """#!/bin/sh
echo "Cannot connect to the Docker daemon at unix:///var/run/docker.sock. Is the docker daemon running?" >&2
exit 1
"""


def broken_docker_on_path(tmp_path, monkeypatch):
    d = tmp_path / "bin"
    d.mkdir()
    (d / "docker").write_text(BROKEN_DOCKER)
    (d / "docker").chmod(0o755)
    monkeypatch.setenv("PATH", f"{d}{os.pathsep}{os.environ['PATH']}")


def test_container_runtime_down_is_an_infrastructure_fault(hyper_home, write_recipe, hyper,
                                                          tmp_path, monkeypatch):
    broken_docker_on_path(tmp_path, monkeypatch)
    path = write_recipe("""
        name: boxed
        cluster: {workers: 2}
        experiments:
          plain: {parameters: {i: [1, 2]}, command: 'echo fine'}
          boxed: {image: 'python:3.11-slim', retries: 2, command: 'true'}
    """)
    r = hyper("run", path)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot run on the nodes left" in r.stderr
    assert "Cannot connect to the Docker daemon" in r.stderr
    state = State()
    tasks = {t["id"]: t for t in state.tasks("boxed-1")}
    assert tasks["plain-0000"]["status"] == tasks["plain-0001"]["status"] == "succeeded"
    assert tasks["boxed-0000"]["status"] == "pending"  # not failed: its retries are intact
    attempts = state.attempts("boxed-1", "boxed-0000")
    assert attempts and {a["status"] for a in attempts} == {"refused"}
    assert all("docker info" in a["error"] for a in attempts)
    assert len(attempts) <= 2  # one per node, then the nodes are known to be unable
    events = " ".join(e["message"] for e in state.events("boxed-1"))
    assert "no container tasks here any more" in events
    assert not any((hyper_home / "local" / "tasks" / a["id"]).exists() for a in attempts)
