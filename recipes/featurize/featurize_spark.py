"""Distributed featurization on Spark, in the manner of MMLSpark: a pretrained scikit-learn
model applied with ``mapInPandas`` to every image of a dataset that every node sees at the
same path (a hypercli mount), the features collected into the task's output.

Usage: featurize_spark.py MODEL DATA_DIR OUT_DIR [PARTITIONS]

The master comes from the environment (``MASTER``, set by hypercli's ``engine: spark``); run it
alone with ``MASTER=local[*]`` for the same result on one machine. Executors need pandas,
pyarrow and scikit-learn (PYSPARK_PYTHON names their Python)."""

import os
import socket
import sys
import time

from pyspark.sql import SparkSession

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import common  # noqa: E402


def main() -> None:
    model_path, root, out_dir = sys.argv[1:4]
    root = os.path.abspath(root)
    started = time.time()
    spark = SparkSession.builder.appName("hyper-featurize").getOrCreate()
    sc = spark.sparkContext
    with open(model_path, "rb") as f:
        model = sc.broadcast(f.read())
    files = common.list_images(root)
    parts = int(sys.argv[4]) if len(sys.argv) > 4 else max(2, sc.defaultParallelism) * 2
    df = spark.createDataFrame([(f,) for f in files], "file string").repartition(parts)
    here = os.path.dirname(os.path.abspath(__file__))

    def featurize(batches):
        import pandas as pd
        sys.path.insert(0, here)
        import common as c
        host = socket.gethostname()
        for b in batches:
            lines = c.features(model.value, root, list(b["file"]))
            yield pd.DataFrame({"line": lines, "host": [host] * len(lines)})

    rows = df.mapInPandas(featurize, "line string, host string").collect()
    hosts: dict = {}
    for r in rows:
        hosts[r.host] = hosts.get(r.host, 0) + 1
    common.write(out_dir, [r.line for r in rows], hosts, started, time.time())
    spark.stop()


if __name__ == "__main__":
    main()
