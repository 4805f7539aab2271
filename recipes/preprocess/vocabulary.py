"""Merge the token counts of every shard into one vocabulary (OUT/vocab.txt: token and
count, most frequent first). Usage: vocabulary.py OUTPUTS_DIR OUT_DIR"""

import collections
import json
import os
import sys
from pathlib import Path


def main() -> None:
    outputs, out = Path(sys.argv[1]), sys.argv[2]
    total: collections.Counter = collections.Counter()
    shards = 0
    for counts in sorted(outputs.glob("tokenize-*/counts.json")):
        total.update(json.loads(counts.read_text()))
        shards += 1
    with open(os.path.join(out, "vocab.txt"), "w") as f:
        for tok, n in total.most_common():
            f.write(f"{tok}\t{n}\n")
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"shards": shards, "tokens": sum(total.values()),
                            "vocabulary": len(total)}) + "\n")


if __name__ == "__main__":
    main()
