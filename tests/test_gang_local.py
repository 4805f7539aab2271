"""Multi-node (gang) tasks on the local provider: every rank's environment, all-or-nothing
failure and retry as one, per-rank attempts, and plans refused before they start."""

from __future__ import annotations

import json
import os
from pathlib import Path

from test_run import run_recipe

from hypercli.state import State


def test_gang_ranks_get_the_distributed_environment(hyper_home, write_recipe):
    path = write_recipe("""
        name: gang
        cluster: {workers: 3}
        experiments:
          train:
            nodes: 3
            command: |
              python3 - <<'PY'
              import json, os
              keys = ["HYPER_NODE_RANK", "HYPER_NUM_NODES", "HYPER_NODE_IPS", "HYPER_MASTER_ADDR",
                      "HYPER_MASTER_PORT", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK",
                      "NODE_RANK", "HYPER_GPUS", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                      "HYPER_GPUS_PER_NODE", "HYPER_NODE_IP"]
              env = {k: os.environ.get(k) for k in keys}
              env["hostfile"] = open(os.environ["HYPER_HOSTFILE"]).read()
              print(json.dumps(env))
              with open(os.environ["HYPER_METRICS"], "a") as f:
                  f.write(json.dumps({"rank": int(os.environ["RANK"])}) + "\\n")
              PY
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    attempts = state.attempts(summary.workflow, "train-0000")
    assert sorted(a["rank"] for a in attempts) == [0, 1, 2]
    assert len({a["node"] for a in attempts}) == 3  # distinct nodes
    assert {a["status"] for a in attempts} == {"succeeded"}
    assert state.task(summary.workflow, "train-0000")["metrics"] == {"rank": 0}
    envs = []
    for a in attempts:
        out = (hyper_home / "local" / "tasks" / a["id"] / "stdout").read_text()
        envs.append(json.loads(out))
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) >= 29500
    for a, e in zip(attempts, envs):
        assert e["RANK"] == e["NODE_RANK"] == e["HYPER_NODE_RANK"] == str(a["rank"])
        assert e["WORLD_SIZE"] == e["HYPER_NUM_NODES"] == "3"
        assert e["HYPER_NODE_IPS"] == "127.0.0.1\n127.0.0.1\n127.0.0.1"
        assert e["MASTER_ADDR"] == e["HYPER_MASTER_ADDR"] == "127.0.0.1"
        assert e["hostfile"] == "127.0.0.1 slots=1\n" * 3
        assert e["HYPER_GPUS"] == ""
        # torchrun's names, one process per node: a script written for torchrun runs as is
        assert e["GROUP_RANK"] == str(a["rank"])
        assert e["LOCAL_RANK"] == "0" and e["LOCAL_WORLD_SIZE"] == "1"
        assert e["HYPER_GPUS_PER_NODE"] == "0" and e["HYPER_NODE_IP"] == "127.0.0.1"


def test_a_failed_rank_stops_the_gang_which_is_retried_as_one(hyper_home, write_recipe,
                                                             tmp_path):
    marker = tmp_path / "failed-once"
    path = write_recipe(f"""
        name: flakygang
        cluster: {{workers: 2}}
        experiments:
          train:
            nodes: 2
            retries: 1
            command: |
              echo "$HYPER_ATTEMPT $RANK" >> {tmp_path}/starts
              if [ "$RANK" = 1 ] && [ ! -e {marker} ]; then
                # fail once rank 0 runs (else the gang may stop it before its first line)
                for i in $(seq 300); do grep -q '^1 0$' {tmp_path}/starts && break; sleep 0.1; done
                touch {marker}; exit 9
              fi
              if [ "$HYPER_ATTEMPT" = 1 ]; then sleep 60; fi
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0, summary
    by = {(a["number"], a["rank"]): a for a in state.attempts(summary.workflow)}
    assert by[(1, 1)]["status"] == "failed" and by[(1, 1)]["exit_code"] == 9
    assert by[(1, 0)]["status"] == "cancelled"  # stopped with its gang, not after 60 s
    assert "stopped with its gang: rank 1 failed (exit code 9)" in by[(1, 0)]["error"]
    assert by[(2, 0)]["status"] == by[(2, 1)]["status"] == "succeeded"
    assert len(by) == 4
    task = state.task(summary.workflow, "train-0000")
    assert task["status"] == "succeeded" and task["attempts"] == 2
    assert sorted((tmp_path / "starts").read_text().split("\n")[:-1]) == ["1 0", "1 1", "2 0",
                                                                          "2 1"]


def test_a_gang_out_of_retries_fails_once(hyper_home, write_recipe):
    path = write_recipe("""
        name: badgang
        cluster: {workers: 2}
        experiments:
          train: {nodes: 2, retries: 1, command: 'exit 3'}
          report: {after: train, command: 'true'}
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 1
    assert state.task(summary.workflow, "train-0000")["status"] == "failed"
    assert state.task(summary.workflow, "report-0000")["status"] == "skipped"
    assert len(state.attempts(summary.workflow, "train-0000")) == 4  # 2 attempts x 2 ranks


def test_plans_no_node_could_hold_are_refused_before_they_start(hyper_home, write_recipe,
                                                                hyper):
    path = write_recipe("""
        name: toobig
        cluster: {workers: 2}
        experiments:
          train: {nodes: 3, command: 'true'}
    """)
    r = hyper("run", path)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "experiment train cannot run on cluster toobig" in r.stderr
    assert "3 ranks" in r.stderr and "toobig-0" in r.stderr
    path = write_recipe("""
        name: gpus
        cluster: {workers: 2}
        experiments:
          train: {resources: {gpus: 1}, command: 'true'}
    """, name="g.yaml")
    r = hyper("run", path)
    assert r.returncode == 2 and "needs 1 GPU" in r.stderr and "the largest is" in r.stderr
    state = State()
    assert [w["id"] for w in state.workflows()] == []  # nothing was recorded


def test_a_retried_gang_keeps_only_the_winning_attempts_output(hyper_home, write_recipe,
                                                              tmp_path):
    """Rank 0 of attempt 1 exits 0 (its output promoted) before rank 1 fails: the retry's
    output replaces it whole, every rank of the winning attempt merged in."""
    path = write_recipe(f"""
        name: gangout
        cluster: {{workers: 2}}
        experiments:
          train:
            nodes: 2
            retries: 1
            command: |
              echo "attempt $HYPER_ATTEMPT rank $RANK" > "$HYPER_OUTPUT/model.txt"
              echo "$HYPER_ATTEMPT" > "$HYPER_OUTPUT/rank-$RANK-attempt-$HYPER_ATTEMPT"
              echo "$HYPER_ATTEMPT $RANK" >> {tmp_path}/ends
              if [ "$RANK" = 1 ] && [ "$HYPER_ATTEMPT" = 1 ]; then
                # fail once rank 0 has ended, so that its output was promoted
                for i in $(seq 600); do grep -q '^1 0$' {tmp_path}/ends && break; sleep 0.1; done
                sleep 1; exit 3
              fi
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0, summary
    by = {(a["number"], a["rank"]): a["status"] for a in state.attempts(summary.workflow)}
    assert by[(1, 0)] == "succeeded" and by[(1, 1)] == "failed"
    assert by[(2, 0)] == by[(2, 1)] == "succeeded"
    out = hyper_home / "storage" / summary.workflow / "train-0000"
    assert (out / "model.txt").read_text().startswith("attempt 2 rank ")
    assert sorted(p.name for p in out.iterdir()) == ["model.txt", "rank-0-attempt-2",
                                                     "rank-1-attempt-2"]
    assert [p.name for p in out.parent.iterdir()] == ["train-0000"]  # nothing else left


def test_promote_replaces_an_earlier_attempts_output_and_follows_no_symlink(tmp_path):
    """The agent's promotion on its own: ranks of one attempt merge (first kept), a later
    attempt replaces the output whole, an earlier one changes nothing, an output of no known
    attempt is merged into (not removed), and a symlink where the owner record goes is
    replaced, never written through."""
    from hypercli.node.agent import (_fresh_output, _owner_file, _promote, attempt_of,
                                     output_owner)

    root, owners = tmp_path / "outputs", str(tmp_path / "owners")
    output = str(root / "train-0000")

    def rank(aid, files):
        fresh = _fresh_output(output, aid)
        for name, text in files.items():
            with open(os.path.join(fresh, name), "w") as f:
                f.write(text)
        return _promote(fresh, output, attempt_of(aid), owners)

    def files():
        return {p.name: p.read_text() for p in (root / "train-0000").iterdir()}

    assert rank("w.train-0000.1-r0", {"model.txt": "1/0", "a": "1"}) is True
    assert rank("w.train-0000.1-r1", {"model.txt": "1/1", "b": "1"}) is False
    assert files() == {"model.txt": "1/0", "a": "1", "b": "1"}
    assert output_owner(owners, output) == "w.train-0000.1"
    assert rank("w.train-0000.2-r1", {"model.txt": "2/1"}) is True
    assert files() == {"model.txt": "2/1"}
    assert rank("w.train-0000.2-r0", {"model.txt": "2/0", "c": "2"}) is False
    assert files() == {"model.txt": "2/1", "c": "2"}
    assert rank("w.train-0000.1-r0", {"model.txt": "late"}) is False  # superseded
    assert files() == {"model.txt": "2/1", "c": "2"}
    # nothing but the output and the attempts' own folders (removed by the agent at their end)
    assert [p.name for p in root.iterdir() if not p.name.startswith(".attempt-")] == [
        "train-0000"]

    # a symlink where the owner record goes is never followed: read as no known attempt
    # (the output merged into, nothing removed), replaced when the record is written
    target = tmp_path / "elsewhere"
    target.write_text("w.train-0000.9\n")
    record = Path(_owner_file(owners, output))
    record.unlink()
    record.symlink_to(target)
    assert output_owner(owners, output) is None
    assert rank("w.train-0000.3-r0", {"d": "3"}) is False
    assert files() == {"model.txt": "2/1", "c": "2", "d": "3"}
    other = str(root / "eval-0000")
    Path(_owner_file(owners, other)).symlink_to(target)
    fresh = _fresh_output(other, "w.eval-0000.1")
    assert _promote(fresh, other, "w.eval-0000.1", owners) is True
    assert target.read_text() == "w.train-0000.9\n"
    assert output_owner(owners, other) == "w.eval-0000.1"
