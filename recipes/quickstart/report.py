"""The quick start's last step: pick the best configuration of the search and keep it.

Reads every search task's result.json from the workflow's outputs ($HYPER_OUTPUTS) and writes
best.json (the winner) and leaderboard.json (all, best first) into $HYPER_OUTPUT.
"""

import glob
import json
import os


def main() -> None:
    outputs = os.environ["HYPER_OUTPUTS"]
    results = []
    for path in glob.glob(os.path.join(outputs, "search-*", "result.json")):
        with open(path) as f:
            results.append(json.load(f))
    if not results:
        raise SystemExit(f"no search results under {outputs}")
    results.sort(key=lambda r: r["accuracy"], reverse=True)
    best = results[0]
    out = os.environ["HYPER_OUTPUT"]
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "best.json"), "w") as f:
        json.dump(best, f, indent=2)
    with open(os.path.join(out, "leaderboard.json"), "w") as f:
        json.dump(results, f, indent=2)
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"best_accuracy": best["accuracy"], "configurations": len(results)})
                + "\n")
    print(f"best of {len(results)}: {best['task']} {best['params']} "
          f"accuracy {best['accuracy']:.4f}")
    print(f"written to {os.path.join(out, 'best.json')}")


if __name__ == "__main__":
    main()
