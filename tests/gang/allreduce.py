"""A torch.distributed check for multi-node tests: every rank all-reduces (sum) a tensor holding
rank+1, so each step's result must be WORLD_SIZE*(WORLD_SIZE+1)/2 (6 for 3 ranks).

Gloo backend, env:// rendezvous: MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK come from the
environment (set GLOO_SOCKET_IFNAME to the interface the ranks share when the host name does
not resolve to it). Prints one line per step and a final JSON line; when HYPER_METRICS names a
file, appends {"sum": ..., "steps": ...} to it as one JSON line. Exit status 1 when a sum is
wrong.

    allreduce.py [--steps N] [--sleep S] [--timeout T]

--steps/--sleep keep the job running (N all-reduces, S seconds apart) so a test can kill a
host mid-run; --timeout bounds how long a collective waits for a rank that is gone (seconds).
"""
import argparse
import json
import os
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--sleep", type=float, default=0.0)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method="env://",
                            timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = world * (world + 1) / 2
    total = None
    for step in range(1, args.steps + 1):
        t = torch.tensor([float(rank + 1)])
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
        total = t.item()
        print(f"rank {rank}/{world} step {step}/{args.steps}: sum {total:g}", flush=True)
        if total != expected:
            print(f"rank {rank}: sum {total:g}, expected {expected:g}", file=sys.stderr,
                  flush=True)
            return 1
        if step < args.steps and args.sleep > 0:
            time.sleep(args.sleep)
    print(json.dumps({"sum": total, "rank": rank, "world_size": world, "steps": args.steps}),
          flush=True)
    if os.environ.get("HYPER_METRICS"):
        with open(os.environ["HYPER_METRICS"], "a") as f:
            f.write(json.dumps({"sum": total, "steps": args.steps}) + "\n")
    dist.barrier()              # nobody tears the group down while a peer still uses it
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
