"""Distributed training as people run it, on the local provider: time limits (``timeout:``),
the failing rank named in the run's summary, a line per restart, what `hyper ps`, `hyper stats`
and `hyper cancel` say of a gang, and what a task's environment holds (and does not)."""

from __future__ import annotations

import json
import re
import subprocess

import pytest
from conftest import ROOT, hyper_cmd, wait_for
from test_run import run_recipe

from hypercli.errors import RecipeError
from hypercli.recipe import parse_recipe
from hypercli.state import State


def running(pid: int) -> bool:
    """The process is there and not a zombie (init here may be slow to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def recipe_text(timeout) -> str:
    return ("name: t\nexperiments:\n  e:\n    command: 'true'\n"
            f"    timeout: {timeout}\n")


@pytest.mark.parametrize("written, seconds", [(90, 90), ("90s", 90), ("30m", 1800),
                                              ("2h", 7200), ("1.5h", 5400), (0.5, 0.5)])
def test_timeout_is_read_as_seconds(written, seconds):
    r = parse_recipe(recipe_text(json.dumps(written)))
    assert r.experiments["e"].timeout == seconds


@pytest.mark.parametrize("written, words", [
    ('"30min"', "did you mean 30m?"), ('"2 hours"', "did you mean 2h?"),
    ('"soon"', "a number followed by s, m or h"), ("-5", "more than 0"), ("0", "more than 0"),
    ("[1]", "not a list"), ('"90d"', "a number followed by s, m or h"), (".inf", "more than 0")])
def test_bad_timeouts_are_refused_with_what_to_write(written, words):
    with pytest.raises(RecipeError) as e:
        parse_recipe(recipe_text(written))
    assert "experiments.e.timeout" in str(e.value) and "line 5" in str(e.value)
    assert words in str(e.value) + str(e.value.hint)


def test_a_misspelt_timeout_key_gets_a_did_you_mean():
    with pytest.raises(RecipeError) as e:
        parse_recipe("name: t\nexperiments:\n  e:\n    command: 'true'\n    timout: 5\n")
    assert "timeout" in str(e.value) + str(e.value.hint)


def test_a_hung_gang_is_stopped_at_its_time_limit_and_retried(hyper_home, write_recipe, hyper,
                                                              tmp_path):
    """Attempt 1 hangs (as a rendezvous waiting for a rank that never comes) and ignores
    SIGTERM: both ranks are stopped at the limit, SIGKILL after the grace, the attempt counts
    as a failure that says it timed out, and attempt 2 runs."""
    path = write_recipe(f"""
        name: hung
        cluster: {{workers: 2}}
        experiments:
          train:
            nodes: 2
            retries: 1
            timeout: 2s
            command: |
              if [ "$HYPER_ATTEMPT" = 1 ]; then
                echo $$ > {tmp_path}/pid-$RANK
                trap '' TERM
                sleep 600
              fi
    """)
    r = hyper("run", path, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "train-0000 (attempt 1) timed out after 2 s" in r.stdout
    assert "train-0000: timed out after 2 s → gang restarted, attempt 2/2 on" in r.stdout
    state = State()
    by = {(a["number"], a["rank"]): a for a in state.attempts("hung-1", "train-0000")}
    for rank in (0, 1):
        assert by[(1, rank)]["status"] == "failed", by[(1, rank)]
        assert by[(1, rank)]["error"] == "timed out after 2 s"
        assert by[(2, rank)]["status"] == "succeeded"
        pid = int((tmp_path / f"pid-{rank}").read_text())
        assert not running(pid)  # SIGKILLed: it ignored SIGTERM
    assert state.task("hung-1", "train-0000")["status"] == "succeeded"


def test_a_task_out_of_retries_after_its_time_limit_fails_saying_so(hyper_home, write_recipe,
                                                                    hyper):
    path = write_recipe("""
        name: slow
        cluster: {workers: 1}
        experiments:
          work: {timeout: 1, command: 'echo started; sleep 600'}
          after: {after: work, command: 'true'}
    """)
    r = hyper("run", path, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert "work-0000 (attempt 1) timed out after 1 s" in r.stdout
    assert "timed out after 1 s" in r.stdout.split("failed:", 1)[1]
    state = State()
    [a] = state.attempts("slow-1", "work-0000")
    assert a["status"] == "failed" and a["error"] == "timed out after 1 s"
    assert state.task("slow-1", "after-0000")["status"] == "skipped"


def test_the_summary_names_the_rank_that_failed_on_its_own(hyper_home, write_recipe, hyper):
    """Rank 1 exits 7 with the root cause on stderr; rank 0, stopped by hypercli, is not the
    one shown. `hyper ps` and `hyper stats` agree on the gang's nodes."""
    path = write_recipe("""
        name: rootcause
        cluster: {workers: 3}
        experiments:
          train:
            nodes: 2
            command: |
              if [ "$RANK" = 1 ]; then
                sleep 1; echo "rank 1: CUDA out of memory (the root cause)" >&2; exit 7
              fi
              echo "rank 0 waiting for its peers" >&2
              sleep 60
    """)
    r = hyper("run", path, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    tail = r.stdout.split("failed:", 1)[1]
    assert "attempt 1, rank 1, exit code 7" in tail, tail
    assert "CUDA out of memory (the root cause)" in tail
    assert "rank 0 waiting" not in tail and "show what failed" in tail
    state = State()
    ranks = sorted(state.attempts("rootcause-1", "train-0000"), key=lambda a: a["rank"])
    ps = json.loads(hyper("ps", "rootcause-1", "--json", check=True).stdout)
    [row] = ps
    assert row["nodes"] == [a["node"] for a in ranks]
    assert row["node"] == ranks[0]["node"]
    stats = json.loads(hyper("stats", "rootcause-1/train-0000", "--json", check=True).stdout)
    assert stats["node"] == row["node"]
    table = hyper("ps", "rootcause-1", check=True).stdout
    assert f"{ranks[0]['node']}, {ranks[1]['node']}" in table


def test_a_gangs_duration_is_its_longest_ranks(hyper_home, write_recipe, hyper):
    path = write_recipe("""
        name: uneven
        cluster: {workers: 2}
        experiments:
          train: {nodes: 2, command: 'if [ "$RANK" = 1 ]; then sleep 3; fi'}
    """)
    r = hyper("run", path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    state = State()
    r0, r1 = sorted(state.attempts("uneven-1", "train-0000"), key=lambda a: a["rank"])
    # rank 0 started late (its node was slower to start it, as one pulling an image is)
    state.update_attempts([{"id": r0["id"], "started_at": r1["started_at"] + 2}])
    [row] = json.loads(hyper("ps", "uneven-1", "--json", check=True).stdout)
    assert row["started_at"] == r1["started_at"]
    assert row["duration"] >= r1["ended_at"] - r1["started_at"] - 0.01, (row, r1)


def test_cancel_of_a_running_gang_counts_its_task(hyper_home, write_recipe, hyper):
    path = write_recipe("""
        name: cancelme
        cluster: {workers: 2}
        experiments:
          train: {nodes: 2, command: 'sleep 300'}
    """)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: len(State().attempts("cancelme-1", status=["running"])) == 2,
                 timeout=60, what="both ranks running", proc=p)
        r = hyper("cancel", "cancelme-1")
        assert r.returncode == 0, r.stderr
        assert "cancelled cancelme-1 (1 task)" in r.stdout
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 1
    assert "show what failed" not in out and "failed:" not in out, out


def test_a_failed_rank_restarts_the_gang_with_one_line(hyper_home, write_recipe, hyper, tmp_path):
    marker = tmp_path / "failed-once"
    path = write_recipe(f"""
        name: oneline
        cluster: {{workers: 2}}
        experiments:
          train:
            nodes: 2
            retries: 2
            command: |
              if [ "$RANK" = 1 ] && [ ! -e {marker} ]; then touch {marker}; exit 9; fi
    """)
    r = hyper("run", path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if "restarted" in ln]
    assert line.startswith("train-0000: rank 1 failed (exit code 9) → gang restarted, "
                           "attempt 2/3 on "), line
    assert "show what failed" not in r.stdout
    marker.unlink()  # the same again, run by the background driver and watched with --wait
    r = hyper("run", "--new", "--wait", path, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    [line] = [ln for ln in r.stdout.splitlines() if "restarted" in ln]
    assert line.startswith("train-0000: rank 1 failed (exit code 9) → gang restarted, "
                           "attempt 2/3 on "), line


def test_internal_variables_stay_out_of_the_task(hyper_home, write_recipe, tmp_path):
    out = tmp_path / "env.json"
    path = write_recipe(f"""
        name: envcheck
        cluster: {{workers: 1}}
        experiments:
          e:
            command: python3 -c 'import json, os; json.dump(dict(os.environ), open("{out}", "w"))'
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    env = json.loads(out.read_text())
    assert env["HYPER_CHECKPOINT"]  # it ran under the checkpoint wrapper
    assert not [k for k in env if k.startswith("HYPER_CKPT_")], sorted(env)
    assert "HYPER_HOME" not in env
    assert env["HYPER_GPUS_PER_NODE"] == "0"



def test_checkpoint_lines_do_not_count_the_manifest_as_the_folders_bytes(hyper_home,
                                                                         write_recipe):
    path = write_recipe("""
        name: small
        cluster: {workers: 1}
        experiments:
          e: {command: 'printf 0123456789abcdef > "$HYPER_CHECKPOINT/state"'}
    """)
    state, summary = run_recipe(path)
    assert summary.exit_code == 0
    [a] = state.attempts(summary.workflow, "e-0000")
    err = (hyper_home / "local" / "tasks" / a["id"] / "stderr").read_text()
    [line] = [ln for ln in err.splitlines() if ln.startswith("checkpoint:")]
    assert "16 bytes changed of 16 bytes" in line and "uploaded with its manifest" in line
    for n, total in re.findall(r"(\d+) of (\d+) bytes uploaded", err):
        assert int(n) <= int(total), line
