"""What the Spark and the Ray featurization jobs share: the dataset listing, the image reader
and the features of one image (the pretrained model's decision scores, rounded so that two
runs anywhere give the same bytes), and the output files."""

import json
import os
import pickle


def list_images(root: str) -> list[str]:
    """The dataset's PGM files as paths relative to ``root``, sorted."""
    out = []
    for d, _, names in os.walk(root):
        out += [os.path.relpath(os.path.join(d, n), root) for n in names if n.endswith(".pgm")]
    return sorted(out)


def read_pgm(path: str) -> list[float]:
    """The 64 pixel values of one 8x8 PGM written by inference/make_images.py."""
    with open(path) as f:
        words = f.read().split()
    assert words[0] == "P2" and words[1:3] == ["8", "8"], path
    return [float(v) for v in words[4:4 + 64]]


def features(model_bytes: bytes, root: str, files: list[str]) -> list[str]:
    """One JSON line per file: {"file", "features": 10 decision scores (6 decimals)}."""
    if not files:
        return []
    model = pickle.loads(model_bytes)
    scores = model.decision_function([read_pgm(os.path.join(root, f)) for f in files])
    return [json.dumps({"file": f, "features": [round(float(v), 6) for v in row]})
            for f, row in zip(files, scores)]


def write(out_dir: str, lines: list[str], hosts: dict, started: float, ended: float) -> None:
    """OUT/features.jsonl (sorted lines), OUT/hosts.json (host → files featurized there) and
    the task's metrics."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "features.jsonl"), "w") as f:
        f.writelines(line + "\n" for line in sorted(lines))
    with open(os.path.join(out_dir, "hosts.json"), "w") as f:
        json.dump(dict(sorted(hosts.items())), f, indent=1)
    if os.environ.get("HYPER_METRICS"):
        with open(os.environ["HYPER_METRICS"], "a") as f:
            f.write(json.dumps({"files": len(lines), "hosts": len(hosts),
                                "job_s": round(ended - started, 3)}) + "\n")
