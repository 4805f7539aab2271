"""``engine: spark`` and ``engine: ray``: real Spark (standalone, Java 17) and Ray clusters that
hypercli starts across a gang's nodes, on 3 SSH test hosts in network namespaces of their own,
running the featurization recipes' jobs (recipes/featurize/).

The engines come from the hosts, as from a node image: Debian's Java and a Python environment
with pyspark and ray at a path the hosts see (scripts/engines.sh, /opt/hypercli-engines).
Checked: the executors / Ray tasks ran on all 3 hosts; the features match the same job in
Spark's local mode byte for byte; a host killed mid-job retries the gang and the result is
still exact; a cancel mid-job leaves no Java or Ray process on any host; a node without the
engine stops the run with exit 3 naming what is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, hyper_cmd, wait_for
from test_ssh import run_in_process, ssh_recipe

from hypercli.state import State

ENGINES = Path(os.environ.get("HYPER_TEST_ENGINES") or "/opt/hypercli-engines")
PY = ENGINES / "bin" / "python"
#: every JVM of the tests' Spark (master, workers, driver, executors) runs short: C1 only and
#: the serial collector start it and run its small jobs in about half the wall time of the
#: defaults on 2 cores (one local-mode job: 28 s and 45 s against 50 s and 87 s, twice each)
JAVA_OPTS = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"
ENV = {"PATH": f"{ENGINES}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "PYSPARK_PYTHON": str(PY), "JAVA_TOOL_OPTIONS": JAVA_OPTS}
#: processes of an engine, by their command names as ps shows them
ENGINE_COMMS = ("java", "raylet", "gcs_server", "ray::", "default_worker", "plasma_store")


def need_engines() -> None:
    ok = shutil.which("java") and PY.exists() and subprocess.run(
        [str(PY), "-c", "import pyspark, ray, pandas, pyarrow, sklearn"],
        capture_output=True).returncode == 0
    if not ok:
        why = (f"no Java or no Spark/Ray environment at {ENGINES} "
               "(scripts/deps.sh and scripts/engines.sh install them)")
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1":
            pytest.fail(why)
        pytest.skip(why)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """The recipes' featurization jobs and scikit-learn's digits as 899 image files."""
    pytest.importorskip("sklearn")
    work = tmp_path_factory.mktemp("engines") / "work"
    shutil.copytree(ROOT / "recipes" / "featurize", work / "featurize")
    shutil.copytree(ROOT / "recipes" / "inference", work / "inference")
    subprocess.run([sys.executable, str(work / "inference" / "make_images.py"),
                    str(work / "images")], check=True, capture_output=True)
    return work


@pytest.fixture(scope="module")
def local_features(workdir, tmp_path_factory) -> bytes:
    """features.jsonl of the same job in Spark's local mode (one JVM, here), with the model
    trained the same way."""
    need_engines()
    out = tmp_path_factory.mktemp("local")
    env = dict(os.environ, **ENV, MASTER="local[2]", HYPER_METRICS=str(out / "m.jsonl"))
    subprocess.run([str(PY), "inference/train.py", str(out)], cwd=workdir, env=env,
                   check=True, capture_output=True, timeout=120)
    p = subprocess.run([str(PY), "featurize/featurize_spark.py", str(out / "model.pkl"),
                        "images", str(out / "features")], cwd=workdir, env=env,
                       capture_output=True, timeout=300)
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    return (out / "features" / "features.jsonl").read_bytes()


def engine_recipe(tmp_path, pool, hosts, workdir, experiments: dict, name="feat", hold=0,
                  **more) -> Path:
    """``hold``: s each engine job's command sleeps after the job (its engine stays up)."""
    exps = {"train": {"command": f'{PY} inference/train.py "$HYPER_OUTPUT"', "env": ENV}}
    for exp, (engine, job) in experiments.items():
        exps[exp] = {"after": "train", "engine": engine, "nodes": 3, "retries": 1, "env": ENV,
                     "command": f'python featurize/{job} "$HYPER_OUTPUTS/train-0000/model.pkl" '
                                f'images "$HYPER_OUTPUT" 6' + (f" && sleep {hold}" if hold
                                                               else ""), **more}
    return ssh_recipe(tmp_path, pool, hosts, exps, name=name, workdir=str(workdir))


def engine_processes(hosts) -> dict:
    """host name → the engine processes (ps lines) left inside it."""
    out = {}
    for h in hosts:
        if not h.pid:
            continue
        ps = h.run("ps -eo pid,comm,args").stdout.splitlines()[1:]
        left = [line for line in ps if any(c in line for c in ENGINE_COMMS)]
        if left:
            out[h.name] = left
    return out


def explain(state, wid: str) -> str:
    """Each attempt's status, error and the end of its stderr: for a failing assertion."""
    home = Path(os.environ["HYPER_HOME"])
    out = []
    for a in state.attempts(wid):
        err = home / "logs" / a["id"] / "stderr"
        tail = err.read_text(errors="replace")[-1500:] if err.exists() else ""
        out.append(f"{a['id']} {a['status']} {a['error']}\n{tail}")
    return "\n".join(out)


def output(hyper_home: Path, wid: str, task: str, name: str) -> Path:
    return hyper_home / "storage" / wid / task / name


def hostnames(hosts) -> set:
    return {h.run("hostname").stdout.strip() for h in hosts}


def test_ray_job_on_three_hosts(ssh_hosts, tmp_path, hyper_home, workdir, local_features):
    """Ray on 3 hosts with 2 (stand-in) GPUs each, every rank asking 1 GPU and 2 CPUs."""
    need_engines()
    hosts = ssh_hosts.start(3, gpus=[2, 2, 2])
    path = engine_recipe(tmp_path, ssh_hosts, hosts, workdir,
                         {"featurize": ("ray", "ray_map.py")},
                         resources={"gpus": 1, "cpus": 2})
    state, summary = run_in_process(path)
    assert summary.exit_code == 0, explain(state, "feat-1")
    ranks = state.attempts("feat-1", "featurize-0000")
    assert sorted(a["status"] for a in ranks) == ["succeeded"] * 3
    got = output(hyper_home, "feat-1", "featurize-0000", "features.jsonl").read_bytes()
    assert got == local_features  # the same features as Spark's local mode
    ran = json.loads(output(hyper_home, "feat-1", "featurize-0000", "hosts.json").read_text())
    assert set(ran) == hostnames(hosts) and sum(ran.values()) == 899  # tasks on all 3
    rank0 = next(a for a in ranks if a["rank"] == 0)
    logs = (hyper_home / "logs" / rank0["id"] / "stderr").read_text()
    assert "hyper engine: ray up on 3 nodes" in logs
    # the ranks' own resources, and only those, as Ray counts them
    assert "hyper engine: ray: 0.0/6.0 CPU" in logs and "hyper engine: ray: 0.0/3.0 GPU" in logs
    assert engine_processes(hosts) == {}


def rank0_says(host, attempt_id: str, text: str) -> bool:
    p = host.run(f"grep -qF {text!r} .hyper/tasks/{attempt_id}/stderr")
    return p.returncode == 0


def test_spark_job_with_a_host_killed_mid_job_retries_the_gang_with_an_exact_result(
        ssh_hosts, tmp_path, hyper_home, workdir, local_features):
    """The Spark job on 3 of 4 hosts; rank 1's host killed mid-job: the gang is retried on
    the 3 hosts left, whose executors all took part, and the features match Spark's local
    mode byte for byte."""
    need_engines()
    hosts = ssh_hosts.start(3)
    spare = ssh_hosts.start(1)
    path = engine_recipe(tmp_path, ssh_hosts, hosts + spare, workdir,
                         {"featurize": ("spark", "featurize_spark.py")})
    by_node = {f"feat-{i}": h for i, h in enumerate(hosts + spare)}
    killed = {}

    def kill_rank_1_mid_job():
        def ranks():
            try:
                live = State().attempts("feat-1", "featurize-0000", status=["running"])
            except Exception:
                return None
            return {a["rank"]: a for a in live if a["number"] == 1} or None
        r = wait_for(lambda: (lambda x: x if x and len(x) == 3 else None)(ranks()),
                     timeout=120, interval=0.2, what="3 ranks running")
        wait_for(lambda: rank0_says(by_node[r[0]["node"]], r[0]["id"], "spark up on 3"),
                 timeout=120, interval=0.2, what="the engine up")
        time.sleep(2)  # the job's stages are under way
        killed["node"] = r[1]["node"]
        by_node[r[1]["node"]].kill()
    t = threading.Thread(target=kill_rank_1_mid_job)
    t.start()
    state, summary = run_in_process(path)
    t.join()
    assert summary.exit_code == 0 and killed, explain(state, "feat-1")
    by = {(a["number"], a["rank"]): a for a in state.attempts("feat-1", "featurize-0000")}
    assert by[(1, 1)]["status"] == "lost"
    assert [by[(2, r)]["status"] for r in range(3)] == ["succeeded"] * 3
    assert killed["node"] not in {by[(2, r)]["node"] for r in range(3)}
    got = output(hyper_home, "feat-1", "featurize-0000", "features.jsonl").read_bytes()
    assert got == local_features and got.count(b"\n") == 899
    second = [by[(2, r)] for r in range(3)]
    used = [by_node[a["node"]] for a in second]
    ran = json.loads(output(hyper_home, "feat-1", "featurize-0000", "hosts.json").read_text())
    assert set(ran) == hostnames(used) and sum(ran.values()) == 899  # executors on all 3
    logs = (hyper_home / "logs" / second[0]["id"] / "stderr").read_text()
    ip0, port = used[0].ip, second[0]["claim"]["port"]
    assert f"Starting Spark master at spark://{ip0}:{port}" in logs
    assert f"Bound MasterWebUI to {ip0}" in logs  # the web UI on the private address only
    assert "hyper engine: spark up on 3 nodes" in logs
    assert all(f"hyper engine: worker {h.ip}: 1 cores," in logs for h in used)  # 1 CPU each
    worker = (hyper_home / "logs" / second[2]["id"] / "stderr").read_text()
    assert "Successfully registered with master" in worker  # a worker's log, kept with rank 2
    assert engine_processes(hosts + spare) == {}


def test_cancel_mid_job_leaves_no_engine_process(ssh_hosts, tmp_path, hyper_home, workdir):
    need_engines()
    hosts = ssh_hosts.start(3)
    path = engine_recipe(tmp_path, ssh_hosts, hosts, workdir,
                         {"spark": ("spark", "featurize_spark.py"),
                          "ray": ("ray", "ray_map.py")},
                         hold=600)  # both engines up at once, however slow the machine
    by_node = {f"feat-{i}": h for i, h in enumerate(hosts)}
    run = subprocess.Popen([*hyper_cmd(), "run", str(path), "--trust-new-hosts"],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def both_up():
            try:
                live = State().attempts("feat-1", status=["running"])
            except Exception:
                return False
            zero = [a for a in live if a["rank"] == 0 and a["task"] != "train-0000"]
            return len(zero) == 2 and all(
                rank0_says(by_node[a["node"]], a["id"], "up on 3 nodes") for a in zero)
        wait_for(both_up, timeout=180, interval=0.5, what="spark and ray up", proc=run)
        assert engine_processes(hosts)  # the engines run
        p = subprocess.run([*hyper_cmd(), "cancel", "feat-1"], capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stdout + p.stderr
        out, err = run.communicate(timeout=120)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.communicate(timeout=60)
    statuses = {a["status"] for a in State().attempts("feat-1") if a["task"] != "train-0000"}
    assert statuses == {"cancelled"}, statuses
    assert engine_processes(hosts) == {}  # no Java, no Ray process on any host


@pytest.mark.parametrize("engine,env,names", [
    ("ray", {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}, "Ray on the node (no ray on PATH)"),
    ("spark", {"JAVA_HOME": "/nonexistent/jvm"}, "JAVA_HOME=/nonexistent/jvm has no bin/java"),
    ("spark", {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "SPARK_HOME": ""},
     "Spark on the node (no spark-class on PATH"),
])
def test_missing_engine_stops_the_run_with_exit_3(hyper, tmp_path, engine, env, names):
    path = tmp_path / "noengine.yaml"
    path.write_text(yaml.safe_dump({
        "name": "noengine", "cluster": {"provider": "local", "workers": 1},
        "experiments": {"job": {"engine": engine, "env": env, "command": "echo never"}}}))
    r = hyper("run", path, timeout=60)
    assert r.returncode == 3, r.stdout + r.stderr
    assert names in r.stderr and f"needs the {engine} engine" in r.stderr
    assert "never" not in r.stdout
    tasks = json.loads(hyper("ps", "noengine", "--json", check=True).stdout)
    assert [t["status"] for t in tasks] == ["pending"]  # nothing ran, nothing counted


def test_spark_jobs_wait_for_every_workers_cores(tmp_path, monkeypatch):
    """The Spark conf of a gang's command makes the job wait for the executors of all the
    workers that joined: ``minRegisteredResourcesRatio`` is a share of ``spark.cores.max``,
    and a standalone application without it expects 0 cores and starts at once (seen here:
    a retried gang whose third executor came late and never took a task). The cores are the
    master's count; an installation's own ``spark.cores.max`` is left as it is."""
    from hypercli.node import engine
    home = tmp_path / "spark"
    (home / "conf").mkdir(parents=True)
    (home / "conf" / "spark-defaults.conf").write_text("spark.eventLog.enabled false\n")
    env = {"HYPER_ENGINE": "spark", "HYPER_ENGINE_PORT": "7077", "HYPER_ENGINE_ATTEMPT": "a1",
           "HYPER_NUM_NODES": "3", "HYPER_ENGINE_DIR": str(tmp_path / "rank0"),
           "SPARK_HOME": str(home)}
    (tmp_path / "rank0").mkdir()

    def conf(seen):
        w = engine.Wrapper(["true"], env)
        w.seen = seen
        folder = Path(w.command_env()["SPARK_CONF_DIR"])
        lines = (folder / "spark-defaults.conf").read_text().splitlines()
        return dict(line.split(" ", 1) for line in lines)

    got = conf({"aliveworkers": 3, "cores": 6})
    assert got["spark.cores.max"] == "6"
    assert got["spark.scheduler.minRegisteredResourcesRatio"] == "1.0"
    assert got["spark.eventLog.enabled"] == "false"  # the installation's own defaults stay
    assert got["spark.master"] == "spark://127.0.0.1:7077"
    (home / "conf" / "spark-defaults.conf").write_text("spark.cores.max 2\n")
    assert conf({"aliveworkers": 3, "cores": 6})["spark.cores.max"] == "2"
