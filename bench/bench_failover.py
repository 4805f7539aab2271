#!/usr/bin/env python3
"""Failover benchmark: time from a cloud's capacity error to the next launch request, as
hypercli's own time (goal: under 1 s).

A cluster of 1 node is launched through ``CloudProvider.launch`` (the real failover path:
:mod:`hypercli.offers.failover`) against moto's EC2 API in process, along 8 offers: 4 zones of
us-east-1, then 4 of us-west-2; every RunInstances is answered ``InsufficientInstanceCapacity``
at the botocore client boundary (so botocore parses it as a real EC2 answer). A botocore
event hook stamps each request as it leaves and each answer as it comes back; for each step

    gap   = next RunInstances request sent − previous RunInstances answer received
    cloud = time inside other EC2 calls made in that gap (the next region's key pair,
            security group and image lookup, answered by moto in process)
    own   = gap − cloud: hypercli's and botocore's own time (error parsing, the step's
            event written to the state file, the next offer's spec and boot documents)

Steps within a region and steps into a new region are reported apart (a new region is
prepared first). Figures: medians over ``--rounds`` launches.

Peer: none runs here. SkyPilot's failover (``sky launch`` with its optimizer's candidate list)
is the one to compare with, but it needs cloud credentials its own checks accept and
provisions through Ray/its provisioner with calls moto does not answer (it cannot be pointed
at a local EC2 stand-in without patching it), and this machine reaches no cloud.

Usage (from the repo root):  .venv/bin/python bench/bench_failover.py [--rounds 5]
HYPER_HOME is a fresh temp folder; nothing under ~/.hyper is touched.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

REGIONS = ("us-east-1", "us-west-2")


def one_round(n: int) -> tuple[list, list]:
    """One launch along 8 refused offers: ((own s, gap s) of each step within a region,
    the same of the step into a new region)."""
    import boto3
    from botocore.awsrequest import AWSResponse

    from hypercli.offers.offer import Offer
    from hypercli.providers.aws import AWSAPI
    from hypercli.providers.cloud_provider import CloudProvider
    from hypercli.recipe import ClusterSpec
    for r in REGIONS:
        ec2 = boto3.client("ec2", region_name=r)
        iid = ec2.register_image(Name="hyper-node-cpu-1-a", Architecture="x86_64")["ImageId"]
        ec2.create_tags(Resources=[iid], Tags=[{"Key": "hyper:image", "Value": "node"},
                                               {"Key": "hyper:variant", "Value": "cpu"}])
    apis = {("aws", r): AWSAPI(r) for r in REGIONS}
    marks: list[tuple[str, str, float]] = []  # (event, operation, time)

    def before(params, model, **_):
        marks.append(("send", model.name, time.perf_counter()))
        if model.name == "RunInstances":
            error = {"Code": "InsufficientInstanceCapacity", "Message": "no capacity"}
            return (AWSResponse(params["url"], 500, {}, None),
                    {"Error": error, "ResponseMetadata": {"HTTPStatusCode": 500}})
        return None

    def after(model, **_):
        marks.append(("back", model.name, time.perf_counter()))
    for api in apis.values():
        api.ec2.meta.events.register("before-call.ec2", before)
        api.ec2.meta.events.register("after-call.ec2", after)
    offers = [Offer("aws", "m5.large", r, f"{r}{z}", True, 0.05, 2, 8)
              for r in REGIONS for z in "abcd"]
    spec = ClusterSpec(f"bench{n}", "aws", 1, {"region": REGIONS[0], "instance_type": "m5.large",
                                           "ssh_cidr": "10.0.0.0/24"})
    provider = CloudProvider("aws", options=spec.options, api=apis["aws", REGIONS[0]],
                             apis=apis, offers=offers)
    result = provider.launch(spec)
    [error] = result.errors.values()
    assert not result.instances and "no offer left" in str(error), error
    # pair each RunInstances answer with the next RunInstances request
    runs = [i for i, m in enumerate(marks) if m[1] == "RunInstances"]
    sends = [i for i in runs if marks[i][0] == "send"]
    backs = [i for i in runs if marks[i][0] == "back"]
    within, across = [], []
    for n, b in enumerate(backs[:-1]):
        s = sends[n + 1]
        gap = marks[s][2] - marks[b][2]
        cloud, opened = 0.0, None
        for ev, op, t in marks[b + 1:s]:
            if ev == "send":
                opened = t
            elif opened is not None:
                cloud += t - opened
                opened = None
        (across if n == 3 else within).append((gap - cloud, gap))
    return within, across


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    home = tempfile.mkdtemp(prefix="hyper-bench-failover-")
    os.environ.update({"HYPER_HOME": home, "AWS_ACCESS_KEY_ID": "testing",
                       "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": REGIONS[0],
                       "AWS_EC2_METADATA_DISABLED": "true",
                       "MOTO_EC2_LOAD_DEFAULT_AMIS": "false"})
    os.environ.pop("HYPER_AWS_ENDPOINT_URL", None)
    import moto
    within, across = [], []
    for n in range(args.rounds):
        with moto.mock_aws():
            w, a = one_round(n)
        within += w
        across += a
    load = os.getloadavg()[0]
    print(f"load average at the end: {load:.2f}; {args.rounds} launches, 8 refused offers each")
    for name, xs in (("next zone, same region", within), ("next region", across)):
        own, gap = [x[0] for x in xs], [x[1] for x in xs]
        print(f"{name:<24} own time median {statistics.median(own) * 1000:7.1f} ms, "
              f"max {max(own) * 1000:7.1f} ms; whole gap with the cloud's calls median "
              f"{statistics.median(gap) * 1000:7.1f} ms  ({len(xs)} steps)")
    worst = max(x[0] for x in within + across)
    print(f"goal (< 1 s of hypercli's own time per step): {'met' if worst < 1 else 'NOT met'}")
    print("peer: none runs here (see the module docstring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
