"""Apply the trained model to one shard of images: each PGM file listed in SHARD_FILES gets
one JSON line {"file", "label" (from its name), "predicted"} in OUT. Usage:
predict.py MODEL SHARD_FILES OUT"""

import json
import os
import pickle
import sys


def read_pgm(path: str) -> list[float]:
    with open(path) as f:
        words = f.read().split()
    assert words[0] == "P2" and words[1:3] == ["8", "8"], path
    return [float(v) for v in words[4:4 + 64]]


def main() -> None:
    model_path, listing, out = sys.argv[1:4]
    with open(model_path, "rb") as f:
        model = pickle.load(f)
    with open(listing) as f:
        paths = [line.rstrip("\n") for line in f if line.strip()]
    predicted = model.predict([read_pgm(p) for p in paths]) if paths else []
    right = 0
    with open(out, "w") as w:
        for p, y in zip(paths, predicted):
            label = int(os.path.basename(p).split("_")[1].split(".")[0])
            right += int(y) == label
            w.write(json.dumps({"file": os.path.basename(p), "label": label,
                                "predicted": int(y)}) + "\n")
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"images": len(paths), "accuracy": right / max(1, len(paths))})
                + "\n")


if __name__ == "__main__":
    main()
