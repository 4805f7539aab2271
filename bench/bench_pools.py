#!/usr/bin/env python3
"""Node pools benchmark: the paper's workflow shape in miniature (IV-A preprocessing, IV-B a
multi-node training, IV-D inference) run on node pools, one per stage's shape, against the
same recipe on one cluster of the biggest shape kept for the whole run (the peer: what a
recipe gets without pools). Goal (issue "per-experiment node pools"): at most the cost, at
most 1.1 x the wall time.

Workflow: ``prep`` 8 tasks (``cpus: 2``, ``workers: 4``) → ``train`` 1 gang of 2 nodes
(``cpus: 2, memory: 12+``) → ``infer`` 8 tasks (``cpus: 2, memory: 6+``, ``workers: 4``);
every task ``sleep --seconds``. Pools: p1, p2, p3 on the optimizer's cheapest offer of each
shape (the shipped catalog: its prices are illustrative), each launched when its stage is
ready and terminated when it ends. Peer: ``pools: false`` — one cluster of 4 nodes on the
first offer of the biggest shape, brought up before the run (``hyper up``) and taken down
right after it.

The cloud is moto's EC2 API on loopback whose instances boot onto SSH test hosts
(tests/cloudhosts.py), so a "boot" takes seconds here, not the 30-90 s of a real cloud: the
pools pay one boot per stage, the peer one in all, and that difference is understated here.
Figures: node-hours and cost from the cost ledger (launch to termination of each instance),
wall time from the start of the launch to the run's end (peer: to its ``down``).

Usage (from the repo root, as root, with the system packages of the test suite):
    .venv/bin/python bench/bench_pools.py [--seconds 10]
HYPER_HOME is a fresh temp folder per run; nothing under ~/.hyper is touched.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402

from sshhosts import HostPool, _keygen, _wait_all  # noqa: E402

REGION = "us-east-1"


def recipe(name: str, image: str, seconds: float, pools: bool) -> dict:
    cluster = {"provider": "aws", "region": REGION, "zone": [f"{REGION}a"], "image": image,
               "ssh_cidr": "10.213.0.0/24", "pool_idle_minutes": 0.05}
    if not pools:
        cluster.update(pools=False, workers=4)
    run = f"sleep {seconds:g}"
    return {"name": name, "cluster": cluster, "experiments": {
        "prep": {"parameters": {"i": list(range(8))}, "workers": 4,
                 "resources": {"cpus": 2}, "command": run},
        "train": {"after": ["prep"], "nodes": 2,
                  "resources": {"cpus": 2, "memory": "12+"}, "command": run},
        "infer": {"after": ["train"], "parameters": {"i": list(range(8))}, "workers": 4,
                  "resources": {"cpus": 2, "memory": "6+"}, "command": run}}}


def one(name: str, hosts, seconds: float, pools: bool) -> dict:
    """One run on a fresh HYPER_HOME and a fresh moto_server: its figures."""
    home = tempfile.mkdtemp(prefix=f"hyper-bench-pools-{name}-")
    os.environ["HYPER_HOME"] = home
    from s3server import CREDENTIALS, S3Server
    for k, v in CREDENTIALS.items():
        os.environ[k] = v
    os.environ.update(AWS_DEFAULT_REGION=REGION, AWS_EC2_METADATA_DISABLED="true",
                      HYPER_CLOUD_ADDRESSES=str(Path(home) / "addresses.json"))
    server = S3Server().start()
    os.environ["HYPER_AWS_ENDPOINT_URL"] = server.endpoint
    import boto3

    from cloudhosts import Booter
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=server.endpoint)
    booter = Booter(ec2, hosts, Path(home) / "addresses.json")
    booter.start()
    try:
        from hypercli import cluster as C
        from hypercli.offers.ledger import costs
        from hypercli.scheduler import Scheduler
        from hypercli.state import State
        from hypercli.workflows import prepare_run
        image = ec2.describe_images(Owners=["amazon"])["Images"][0]["ImageId"]
        path = Path(home).with_name(Path(home).name + "-recipe") / f"{name}.yaml"
        path.parent.mkdir()  # its folder is the workdir sent to the nodes
        path.write_text(yaml.safe_dump(recipe(name, image, seconds, pools), sort_keys=False))
        state = State()
        t0 = time.time()
        wid, _, provider, nodes, lock = prepare_run(state, str(path))
        try:
            summary = Scheduler(state, wid, provider, nodes).run()
        finally:
            lock.release()
        if not pools:
            C.down(state, name)
        t1 = time.time()
        if summary.exit_code != 0:
            errors = {a["error"] for a in state.attempts(wid) if a["error"]}
            raise RuntimeError(f"{name}: {summary.counts}: {sorted(errors)[:3]}")
        out = costs(state, name, now=t1)
        c = out["clusters"][0]
        per_pool = {p["pool"]: (p["nodes"], p["node_hours"], p["cost"])
                    for p in out["pools"]}
        types = sorted({(n["instance_type"], n["price"]) for n in out["nodes"]})
        if pools:
            C.down(state, name)
        if booter.errors:
            raise RuntimeError(f"{name}: {booter.errors}")
        return {"wall_s": t1 - t0, "node_hours": c["node_hours"], "cost": c["cost"],
                "nodes": c["nodes"], "pools": per_pool, "types": types}
    finally:
        booter.stopping.set()
        booter.join(10)
        server.stop()
        shutil.rmtree(home, ignore_errors=True)
        shutil.rmtree(home + "-recipe", ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=10.0, help="sleep per task (default 10)")
    args = ap.parse_args()
    keydir = tempfile.mkdtemp(prefix="hyper-bench-pools-key-")
    key = Path(keydir) / "client_key"
    _wait_all([_keygen(key, "hyper-bench")], "ssh-keygen")
    pool = HostPool(client_key=key)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    print(f"{started}; {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.2f}; "
          f"tasks sleep {args.seconds:g} s")
    try:
        hosts = pool.start(14)  # pools: 4 + 2 + 4; the one cluster: 4
        res = {"pools": one("pooled", hosts[:10], args.seconds, True),
               "one cluster": one("single", hosts[10:], args.seconds, False)}
    finally:
        pool.stop()
        shutil.rmtree(keydir, ignore_errors=True)
    print(f"{'':<12} {'wall s':>8} {'nodes':>6} {'node-hours':>11} {'cost $':>10}")
    for k, r in res.items():
        print(f"{k:<12} {r['wall_s']:>8.1f} {r['nodes']:>6} {r['node_hours']:>11.4f} "
              f"{r['cost']:>10.5f}   {r['types']}")
        for p, (n, h, c) in sorted(r["pools"].items()):
            print(f"  pool {p:<6} {'':>8} {n:>6} {h:>11.4f} {c:>10.5f}")
    a, b = res["pools"], res["one cluster"]
    print(f"pools / one cluster: cost {a['cost'] / b['cost']:.2f} (goal <= 1), node-hours "
          f"{a['node_hours'] / b['node_hours']:.2f}, wall time {a['wall_s'] / b['wall_s']:.2f}"
          " (goal <= 1.1)")
    print(f"load average at end {os.getloadavg()[0]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
