"""Train the classifier the inference recipe applies: an SVM on the first half of
scikit-learn's digits, saved with pickle to OUT/model.pkl. Usage: train.py OUT_DIR"""

import json
import os
import pickle
import sys

from sklearn.datasets import load_digits
from sklearn.svm import SVC


def main() -> None:
    digits = load_digits()
    half = len(digits.images) // 2
    model = SVC(gamma=0.001).fit(digits.data[:half], digits.target[:half])
    with open(os.path.join(sys.argv[1], "model.pkl"), "wb") as f:
        pickle.dump(model, f)
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"trained_on": half}) + "\n")


if __name__ == "__main__":
    main()
