"""Each rank of a gang keeps a file of its own in $HYPER_CHECKPOINT, for the checkpoint
tests. Attempt 1: every rank writes ``mine`` ("written by rank R"; with ``rank0`` only rank
0 does: the ranks share the folder), then rank 1 waits until the checkpoint store holds a
generation of every folder that is saved and fails (exit 9), so the gang is retried. Every
attempt prints ``rank R attempt A found: <mine, or nothing>``. Usage: ranks.py each|rank0"""

import glob
import os
import sys
import time

rank, attempt = os.environ["HYPER_NODE_RANK"], os.environ["HYPER_ATTEMPT"]
mode = sys.argv[1]
mine = os.path.join(os.environ["HYPER_CHECKPOINT"], "mine")
found = open(mine).read() if os.path.exists(mine) else "nothing"
print(f"rank {rank} attempt {attempt} found: {found}", flush=True)
if attempt != "1":
    sys.exit(0)
if mode == "each" or rank == "0":
    with open(mine + ".tmp", "w") as f:
        f.write(f"written by rank {rank}")
    os.replace(mine + ".tmp", mine)
if rank != "1":
    time.sleep(300)  # until the gang is stopped
    sys.exit(0)
store = os.path.join(os.environ["HYPER_OUTPUTS"], ".checkpoints", os.environ["HYPER_TASK_ID"])
want = [f"{store}/gen"] if mode == "rank0" else [f"{store}/rank-{r}/gen" for r in (0, 1)]
while not all(glob.glob(f"{w}/*.json") for w in want):
    time.sleep(0.1)
sys.exit(9)
