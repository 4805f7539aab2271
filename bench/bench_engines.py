#!/usr/bin/env python3
"""Spark started by hypercli (``engine: spark``) against the same Spark cluster started by
hand on the same hosts, running the same featurization job, in the form of the BigDL paper's
scaling table (Dai et al., SoCC 2019: speedup and efficiency per node count).

Hosts: 3 real SSH test hosts (tests/sshhosts.py: sshd in network/PID/mount namespaces of
their own on the 10.213.0.0/24 bridge; needs root). They share this machine's 2 cores, so the
job's compute cannot speed up with more hosts here: what the table measures is what each side
adds around the job (start-up, per-node cost), and the 4-12 node rows are a model on paper
from the measured per-node start-up cost, not measurements.

Engines as a node image has them (scripts/engines.sh): Debian's Java 17 and
/opt/hypercli-engines (pyspark, pandas, pyarrow, scikit-learn). The dataset: scikit-learn's
digits as 8x8 PGM files (recipes/inference/make_images.py), copied --copies times (default
12: 10,788 files), written into every host's /root/featdata; the job
(recipes/featurize/featurize_spark.py) and a model trained here, into every host's
/root/featjob. Both sides run exactly that job with the same partition count.

For n = 1, 2, 3 nodes (hosts[:n]):
  hyper   a recipe ``{featurize: {engine: spark, nodes: n, resources: {cpus: C}, command:
          python featurize_spark.py ...}}`` on an ssh cluster of those hosts; prepare_run
          (bring-up) not timed, Scheduler.run() timed as the wall time. Start-up: from rank
          0's log ("spark up on n nodes in X s": master and n workers registered).
  hand    inside the hosts (nsenter, no SSH): ``spark-class ...Master --host IP0`` on host 0,
          ``spark-class ...Worker spark://IP0:7077 --cores C`` on each host; start-up = until
          the master's /json/ shows n alive workers; then the job on host 0 with
          MASTER=spark://IP0:7077 and the scheduler settings hypercli's engine gives jobs
          (minRegisteredResourcesRatio 1.0 of spark.cores.max = n × C, so both sides wait
          for every executor); wall =
          start-up + job + stop.
  job     the job's own measured time (``job_s`` in its metrics: SparkSession creation to
          features written), the figure the two sides are compared on.
Printed per n: start-up, job, wall, the hyper/hand job ratio; speedup job(1)/job(n) and
efficiency speedup/n per side; the least-squares fit start-up(n) = a + b*n of hyper and the
modelled start-up at 4, 8, 12 nodes. Goals (issue): start-up <= 10 s for 3 nodes, job time
within 1.05x of the hand-started cluster.

Usage (repo root, as root):  python bench/bench_engines.py [--copies K] [--rounds R]
"""

from __future__ import annotations

import argparse
import io
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402

from sshhosts import HostPool  # noqa: E402

ENGINES = Path(os.environ.get("HYPER_TEST_ENGINES") or "/opt/hypercli-engines")
PY = ENGINES / "bin" / "python"
ENV = {"PATH": f"{ENGINES}/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
       "PYSPARK_PYTHON": str(PY)}
PARTS = 12
CPUS = os.cpu_count() or 2


def tar_of(folder: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(folder, arcname=".")
    return buf.getvalue()


def prepare(tmp: Path, copies: int) -> tuple[Path, Path]:
    """(dataset folder, job folder with model.pkl) built here."""
    images = tmp / "images"
    subprocess.run([sys.executable, str(ROOT / "recipes/inference/make_images.py"),
                    str(images)], check=True, capture_output=True)
    data = tmp / "data"
    for k in range(copies):
        shutil.copytree(images, data / f"copy{k:02d}")
    job = tmp / "job"
    shutil.copytree(ROOT / "recipes/featurize", job / "featurize")
    env = dict(os.environ, HYPER_METRICS=str(tmp / "train.jsonl"))
    subprocess.run([str(PY), str(ROOT / "recipes/inference/train.py"), str(job / "featurize")],
                   check=True, capture_output=True, env=env)
    return data, job


def hyper_side(pool, hosts, n: int, job: Path, tag: str) -> dict:
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    home = Path(tempfile.mkdtemp(prefix="hyper-bench-engines-"))
    os.environ["HYPER_HOME"] = str(home)
    name = f"eng{n}{tag}"
    recipe = {"name": name,
              "cluster": {"provider": "ssh", "hosts": [h.address() for h in hosts[:n]],
                          "identity_file": str(pool.client_key)},
              "experiments": {"featurize": {
                  "engine": "spark", "nodes": n, "resources": {"cpus": CPUS}, "env": ENV,
                  "command": "python featurize/featurize_spark.py featurize/model.pkl "
                             f'/root/featdata "$HYPER_OUTPUT" {PARTS}'}}}
    path = home / f"{name}.yaml"
    recipe["workdir"] = str(job)
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    state = State()
    wid, _, prov, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    try:
        t0 = time.perf_counter()
        summary = Scheduler(state, wid, prov, nodes).run()
        wall = time.perf_counter() - t0
    finally:
        lock.release()
        try:
            prov.terminate(name, nodes)
        except Exception:
            pass
    if summary.exit_code != 0:
        raise SystemExit(f"hyper run {wid} failed: {summary}")
    ranks = sorted(state.attempts(wid, "featurize-0000"), key=lambda a: a["rank"])
    log = (home / "logs" / ranks[0]["id"] / "stderr").read_text(errors="replace")
    m = re.search(r"spark up on \d+ nodes? in ([0-9.]+) s", log)
    metrics = state.task(wid, "featurize-0000")["metrics"]
    out = home / "storage" / wid / "featurize-0000"
    hosts_used = json.loads((out / "hosts.json").read_text())
    shutil.rmtree(home, ignore_errors=True)
    return {"startup": float(m.group(1)), "job": metrics["job_s"], "wall": wall,
            "files": metrics["files"], "hosts": len(hosts_used)}


def hand_side(hosts, n: int) -> dict:
    """A standalone cluster started by hand inside the hosts, the job on host 0, stopped."""
    ip0 = hosts[0].ip
    spark_class = ENGINES / "bin" / "spark-class"
    envs = " ".join(f"{k}={v}" for k, v in ENV.items())
    pids = []

    def start(h, argv: str) -> None:
        p = h.run(f"cd /root && {envs} SPARK_LOCAL_IP={h.ip} SPARK_NO_DAEMONIZE=1 "
                  f"nohup {spark_class} {argv} > /root/spark-{len(pids)}.log 2>&1 & echo $!",
                  check=True)
        pids.append((h, int(p.stdout.split()[-1])))

    t0 = time.perf_counter()
    start(hosts[0], f"org.apache.spark.deploy.master.Master --host {ip0} --port 7077 "
                    "--webui-port 8080")
    for h in hosts[:n]:
        start(h, f"org.apache.spark.deploy.worker.Worker spark://{ip0}:7077 --host {h.ip} "
                 f"--cores {CPUS} --work-dir /root/spark-work")
    while True:
        try:
            with urllib.request.urlopen(f"http://{ip0}:8080/json/", timeout=2) as r:
                if int(json.load(r).get("aliveworkers") or 0) >= n:
                    break
        except (OSError, ValueError):
            pass
        if time.perf_counter() - t0 > 180:
            raise SystemExit("the hand-started cluster did not come up in 180 s")
        time.sleep(0.25)
    startup = time.perf_counter() - t0
    hosts[0].run("rm -rf /root/out /root/m.jsonl; mkdir -p /root/spark-conf; printf '"
                 "spark.scheduler.minRegisteredResourcesRatio 1.0\\nspark.scheduler."
                 f"maxRegisteredResourcesWaitingTime 60s\\nspark.cores.max {n * CPUS}\\n' "
                 "> /root/spark-conf/spark-defaults.conf")
    p = hosts[0].run(f"cd /root/featjob && {envs} MASTER=spark://{ip0}:7077 "
                     "SPARK_CONF_DIR=/root/spark-conf "
                     f"SPARK_LOCAL_IP={ip0} HYPER_METRICS=/root/m.jsonl python "
                     f"featurize/featurize_spark.py featurize/model.pkl /root/featdata "
                     f"/root/out {PARTS}", timeout=900)
    if p.returncode != 0:
        raise SystemExit(f"the hand-run job failed: {p.stderr[-2000:]}")
    t1 = time.perf_counter()
    for h, pid in pids:
        h.run(f"kill {pid}")
    for h, pid in pids:
        for _ in range(100):
            if h.run(f"kill -0 {pid} 2>/dev/null").returncode != 0:
                break
            time.sleep(0.1)
        else:
            h.run(f"kill -9 {pid}")
    wall = time.perf_counter() - t0
    metrics = json.loads(hosts[0].run("tail -1 /root/m.jsonl").stdout)
    used = json.loads(hosts[0].run("cat /root/out/hosts.json").stdout)
    return {"startup": startup, "job": metrics["job_s"], "wall": wall, "stop": wall - (t1 - t0),
            "files": metrics["files"], "hosts": len(used)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--copies", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=1)
    args = ap.parse_args()
    if not PY.exists():
        raise SystemExit(f"{PY} is missing: run scripts/engines.sh first")
    tmp = Path(tempfile.mkdtemp(prefix="bench-engines-"))
    pool = HostPool()
    try:
        data, job = prepare(tmp, args.copies)
        hosts = pool.start(3)
        data_tar, job_tar = tar_of(data), tar_of(job)
        for h in hosts:
            h.run("mkdir -p /root/featdata /root/featjob", check=True)
            h.run("tar -x -C /root/featdata", input=data_tar, check=True, timeout=300)
            h.run("tar -x -C /root/featjob", input=job_tar, check=True, timeout=300)
        print(f"dataset: {args.copies * 899} files; {PARTS} partitions; {CPUS} cores per "
              f"worker; load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
        res: dict = {"hyper": {}, "hand": {}}
        for r in range(args.rounds):
            for n in (1, 2, 3):
                order = ("hand", "hyper") if (n + r) % 2 else ("hyper", "hand")
                for side in order:
                    x = (hyper_side(pool, hosts, n, job, f"r{r}") if side == "hyper"
                         else hand_side(hosts, n))
                    assert x["hosts"] == n and x["files"] == args.copies * 899, x
                    res[side].setdefault(n, []).append(x)
                    print(f"  round {r} n={n} {side:5}: start-up {x['startup']:5.2f} s, job "
                          f"{x['job']:6.2f} s, wall {x['wall']:6.2f} s", flush=True)
        med = {s: {n: {k: statistics.median(x[k] for x in v) for k in ("startup", "job", "wall")}
                   for n, v in res[s].items()} for s in res}
        print("\n| nodes | start-up hyper | start-up hand | job hyper | job hand | job hyper/hand "
              "| wall hyper | wall hand | speedup hyper | eff. hyper | speedup hand | eff. hand |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for n in (1, 2, 3):
            h, s = med["hyper"][n], med["hand"][n]
            sh, ss = med["hyper"][1]["job"] / h["job"], med["hand"][1]["job"] / s["job"]
            print(f"| {n} | {h['startup']:.2f} s | {s['startup']:.2f} s | {h['job']:.2f} s | "
                  f"{s['job']:.2f} s | {h['job'] / s['job']:.3f} | {h['wall']:.2f} s | "
                  f"{s['wall']:.2f} s | {sh:.2f} | {sh / n:.2f} | {ss:.2f} | {ss / n:.2f} |")
        xs = [1, 2, 3]
        ys = [med["hyper"][n]["startup"] for n in xs]
        mx, my = statistics.mean(xs), statistics.mean(ys)
        b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
        a = my - b * mx
        print(f"\nhyper start-up fit: {a:.2f} s + {b:.2f} s per node; modelled: "
              + ", ".join(f"{n} nodes {a + b * n:.1f} s" for n in (4, 8, 12)))
        print(f"goals: start-up(3) {med['hyper'][3]['startup']:.2f} s (<= 10 s); job ratio at "
              f"3 nodes {med['hyper'][3]['job'] / med['hand'][3]['job']:.3f} (<= 1.05)")
    finally:
        pool.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
