"""One task of the quick start: 5-fold cross-validated accuracy of an SVC on sklearn's digits.

Reports its metrics through hypercli's task protocol: one JSON object per line appended to
$HYPER_METRICS, and keeps its configuration and score in $HYPER_OUTPUT/result.json.
"""

import argparse
import json
import os
import time

from sklearn.datasets import load_digits
from sklearn.model_selection import cross_val_score
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import MinMaxScaler, StandardScaler
from sklearn.svm import SVC

SCALERS = {"standard": StandardScaler, "minmax": MinMaxScaler, "none": None}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", choices=["rbf", "poly", "sigmoid"], required=True)
    ap.add_argument("--scaler", choices=list(SCALERS), required=True)
    ap.add_argument("--C", type=float, required=True)
    ap.add_argument("--gamma", type=float, required=True)
    ap.add_argument("--folds", type=int, default=5)
    args = ap.parse_args()

    X, y = load_digits(return_X_y=True)
    steps = [SCALERS[args.scaler]()] if SCALERS[args.scaler] else []
    model = make_pipeline(*steps, SVC(kernel=args.kernel, C=args.C, gamma=args.gamma))
    t0 = time.time()
    scores = cross_val_score(model, X, y, cv=args.folds)
    result = {"accuracy": round(float(scores.mean()), 5),
              "accuracy_std": round(float(scores.std()), 5),
              "fit_seconds": round(time.time() - t0, 3)}
    print(f"{vars(args)} -> accuracy {result['accuracy']:.4f} ± {result['accuracy_std']:.4f}")

    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps(result) + "\n")
    out = os.environ["HYPER_OUTPUT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump({"task": os.environ["HYPER_TASK_ID"], "params": vars(args), **result}, f)


if __name__ == "__main__":
    main()
