"""Tokenise the files of one shard (paper IV-A turns text files into training records): each
file becomes one JSON line {"file", "tokens": [...]} in OUT/tokens.jsonl, and the shard's
token counts go to OUT/counts.json. Usage: tokenise_shard.py SHARD_FILES OUT_DIR"""

import collections
import json
import os
import re
import sys

TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+|[^\sA-Za-z0-9_]")


def tokens(text: str) -> list[str]:
    return TOKEN.findall(text)


def main() -> None:
    listing, out = sys.argv[1], sys.argv[2]
    counts: collections.Counter = collections.Counter()
    n = 0
    with open(listing) as f, open(os.path.join(out, "tokens.jsonl"), "w") as w:
        for path in (line.rstrip("\n") for line in f):
            with open(path, encoding="utf-8", errors="replace") as src:
                toks = tokens(src.read())
            counts.update(toks)
            w.write(json.dumps({"file": os.path.basename(path), "tokens": toks}) + "\n")
            n += 1
    with open(os.path.join(out, "counts.json"), "w") as f:
        json.dump(counts, f)
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"files": n, "tokens": sum(counts.values())}) + "\n")


if __name__ == "__main__":
    main()
