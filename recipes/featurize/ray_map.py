"""Distributed featurization with Ray tasks: the same job as featurize_spark.py, the dataset
split into batches, one Ray task per batch spread over the nodes.

Usage: ray_map.py MODEL DATA_DIR OUT_DIR [BATCHES]

``ray.init()`` joins the cluster named by ``RAY_ADDRESS`` (set by hypercli's ``engine: ray``);
without it, Ray starts a local one."""

import os
import socket
import sys
import time

import ray

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


@ray.remote(num_cpus=1, scheduling_strategy="SPREAD")
def featurize(model_bytes: bytes, root: str, files: list) -> tuple:
    sys.path.insert(0, HERE)
    import common as c
    return socket.gethostname(), c.features(model_bytes, root, files)


def main() -> None:
    model_path, root, out_dir = sys.argv[1:4]
    root = os.path.abspath(root)
    started = time.time()
    ray.init()
    with open(model_path, "rb") as f:
        model = ray.put(f.read())
    files = common.list_images(root)
    n = int(sys.argv[4]) if len(sys.argv) > 4 else max(2, int(ray.cluster_resources()["CPU"]) * 2)
    batches = [files[i::n] for i in range(n)]
    lines, hosts = [], {}
    for host, out in ray.get([featurize.remote(model, root, b) for b in batches]):
        lines += out
        hosts[host] = hosts.get(host, 0) + len(out)
    common.write(out_dir, lines, hosts, started, time.time())
    ray.shutdown()


if __name__ == "__main__":
    main()
