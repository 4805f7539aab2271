"""Running workflows on the local provider: retries, skipped dependents, injection-safe
parameters, outputs, cancel — real agent processes, real detached tasks, a real state file."""

from __future__ import annotations

import json

import pytest

from hypercli.scheduler import Scheduler
from hypercli.state import State
from hypercli.workflows import prepare_run, results


def run_recipe(path, **kw):
    """Plan, bring up and run a recipe in this process; returns (state, summary)."""
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path), **kw)
    try:
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    return state, summary


def test_retry_then_success(hyper_home, write_recipe, tmp_path):
    marker = tmp_path / "failed-once"
    path = write_recipe(f"""
        name: flaky
        cluster: {{workers: 2}}
        experiments:
          flaky:
            retries: 2
            command: |
              if [ -e {marker} ]; then echo second; exit 0; fi
              touch {marker}; echo first >&2; exit 7
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    [task] = state.tasks(summary.workflow)
    assert task["status"] == "succeeded" and task["attempts"] == 2
    attempts = state.attempts(summary.workflow, task["id"])
    assert [(a["status"], a["exit_code"]) for a in attempts] == [("failed", 7), ("succeeded", 0)]


def test_failure_skips_dependents_and_exits_1(hyper, write_recipe):
    path = write_recipe("""
        name: broken
        cluster: {workers: 2}
        experiments:
          prepare:
            parameters: {i: [1, 2, 3]}
            retries: 1
            command: test {{i}} -ne 2
          train:
            after: [prepare]
            command: echo never
          report:
            after: train
            command: echo never either
          independent:
            command: echo fine
    """)
    p = hyper("run", path)
    assert p.returncode == 1, p.stderr
    ps = json.loads(hyper("ps", "broken", "--json", check=True).stdout)
    status = {t["task"]: (t["status"], t["attempts"]) for t in ps}
    assert status["prepare-0001"] == ("failed", 2)  # 1 + retries
    assert status["prepare-0000"] == ("succeeded", 1)
    assert status["train-0000"] == ("skipped", 0)
    assert status["report-0000"] == ("skipped", 0)
    assert status["independent-0000"] == ("succeeded", 1)
    assert json.loads(hyper("ps", "--json").stdout)[0]["status"] == "failed"


NASTY = ["x; touch PWNED", "$(touch PWNED)", "`touch PWNED`", "it's \"quoted\"",
         "two\nlines", "ünïcödé 漢字 🎉", "*", "~", "a b  c", "-n", "", "\\", "$HOME"]


def test_parameter_values_reach_the_program_verbatim(hyper_home, write_recipe, tmp_path):
    path = write_recipe(f"""
        name: inject
        cluster: {{workers: 2}}
        experiments:
          echo:
            parameters:
              v: {json.dumps(NASTY, ensure_ascii=False)}
            env: {{RAW: "{{{{v}}}}"}}
            command: |
              cd {tmp_path}
              printf '%s' {{{{v}}}} > "$HYPER_OUTPUT/arg"
              printf '%s' "$RAW" > "$HYPER_OUTPUT/env"
              printf '%s' "$HYPER_PARAMS" > "$HYPER_OUTPUT/params"
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0, state.attempts(summary.workflow)
    out = hyper_home / "storage" / summary.workflow
    seen = {}
    for t in state.tasks(summary.workflow):
        d = out / t["id"]
        seen[t["params"]["v"]] = d
        assert (d / "arg").read_bytes().decode() == t["params"]["v"]
        assert (d / "env").read_bytes().decode() == t["params"]["v"]
        assert json.loads((d / "params").read_text()) == {"v": t["params"]["v"]}
    assert sorted(seen) == sorted(NASTY)
    assert not (tmp_path / "PWNED").exists()


def test_metrics_and_environment(hyper_home, write_recipe):
    path = write_recipe("""
        name: metrics
        cluster: {workers: 2}
        experiments:
          fit:
            parameters: {lr: [0.1, 0.2, 0.3]}
            command: |
              echo '{"loss": 9, "step": 1}' >> "$HYPER_METRICS"
              echo 'not json' >> "$HYPER_METRICS"
              python3 -c "import json,sys; print(json.dumps({'loss': 1 - {{lr}}, 'step': 2}))" >> "$HYPER_METRICS"
              env | grep '^HYPER_' | sort > "$HYPER_OUTPUT/env"
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    wid, metric, rows = results(state, "metrics", "loss", ascending=True)
    assert metric == "loss"
    assert [r["params"]["lr"] for r in rows] == [0.3, 0.2, 0.1]
    assert rows[0]["metrics"] == {"loss": pytest.approx(0.7), "step": 2}
    env = dict(line.split("=", 1) for line in
               (hyper_home / "storage" / wid / "fit-0000" / "env").read_text().splitlines())
    assert env["HYPER_TASK_ID"] == "fit-0000" and env["HYPER_EXPERIMENT"] == "fit"
    assert env["HYPER_WORKFLOW"] == wid and env["HYPER_ATTEMPT"] == "1"
    assert env["HYPER_NODE"].startswith("metrics-")
    # the attempt's own fresh folder, made fit-0000 (where env was read) when it won
    assert env["HYPER_OUTPUT"].startswith(
        f"{hyper_home}/storage/{wid}/.attempt-{wid}.fit-0000.")
    assert env["HYPER_METRICS"].endswith("/metrics.jsonl")


def test_experiment_workers_cap_and_dag_order(hyper_home, write_recipe, tmp_path):
    log = tmp_path / "log"
    path = write_recipe(f"""
        name: dag
        cluster: {{workers: 4}}
        experiments:
          a:
            parameters: {{i: [1, 2, 3, 4]}}
            workers: 1
            command: |
              n=$(ls {tmp_path}/running 2>/dev/null | wc -l); echo "a {{{{i}}}} $n" >> {log}
              mkdir -p {tmp_path}/running && touch {tmp_path}/running/{{{{i}}}}
              sleep 0.2; rm {tmp_path}/running/{{{{i}}}}
          b:
            after: [a]
            command: echo b >> {log}
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    lines = log.read_text().splitlines()
    assert lines[-1] == "b" and len(lines) == 5
    assert all(line.endswith(" 0") for line in lines[:-1]), lines  # never two `a` at once


def test_resume_starts_new_workflow_after_success_and_refuses_changed_recipe(
        hyper_home, write_recipe, hyper):
    path = write_recipe("""
        name: again
        cluster: {workers: 1}
        experiments:
          x: {command: "true"}
    """)
    _, first = run_recipe(path)
    _, second = run_recipe(path)
    assert (first.workflow, second.workflow) == ("again-1", "again-2")
    state = State()
    state.set_workflow("again-2", status="running")  # as if a run had been killed
    path.write_text(path.read_text().replace('"true"', '"false"'))
    p = hyper("run", path)
    assert p.returncode == 2
    assert "again-2" in p.stderr and "--new" in p.stderr
    p = hyper("run", path, "--new")
    assert p.returncode == 1 and "again-3" in p.stdout
