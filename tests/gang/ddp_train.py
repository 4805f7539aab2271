"""A tiny DistributedDataParallel training for multi-node tests: linear regression
(y = X·w + b + noise, 4 features) on seeded synthetic data, each rank training on its own
slice of the batch, gloo backend, env:// rendezvous (MASTER_ADDR, MASTER_PORT, WORLD_SIZE,
RANK from the environment).

Rank 0 prints the final loss (over the whole data set) as ``final loss 0.0123`` and a JSON
line, and appends {"loss": ..., "steps": ...} to $HYPER_METRICS when it is set. Every rank
checks that its weights equal rank 0's at the end (DDP keeps replicas in step): exit status 1
if not, or if training did not reduce the loss.

    ddp_train.py [--steps N] [--lr LR] [--samples M] [--timeout T]
"""
import argparse
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

TRUE_W = [2.0, -3.0, 0.5, 1.0]
TRUE_B = 0.25


def data(samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)         # the same data on every rank
    x = torch.randn(samples, len(TRUE_W), generator=g)
    y = x @ torch.tensor(TRUE_W) + TRUE_B + 0.01 * torch.randn(samples, generator=g)
    return x, y.unsqueeze(1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--samples", type=int, default=240)
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    dist.init_process_group("gloo", init_method="env://",
                            timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x, y = data(args.samples)
    mine = slice(rank, None, world)                 # this rank's share of every batch
    model = DDP(torch.nn.Linear(len(TRUE_W), 1))     # DDP broadcasts rank 0's initial weights
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.MSELoss()
    with torch.no_grad():
        first = loss_fn(model.module(x), y).item()
    for step in range(1, args.steps + 1):
        opt.zero_grad()
        loss = loss_fn(model(x[mine]), y[mine])
        loss.backward()                             # DDP averages the gradients over ranks
        opt.step()
    with torch.no_grad():
        final = loss_fn(model.module(x), y).item()
        flat = torch.cat([p.detach().flatten() for p in model.module.parameters()])
    ref = flat.clone()
    dist.broadcast(ref, src=0)
    same = torch.equal(ref, flat)
    print(f"rank {rank}/{world}: weights {'equal to' if same else 'DIFFER from'} rank 0's",
          flush=True)
    ok = torch.tensor([1 if same else 0])
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"final loss {final:.6f}", flush=True)
        print(json.dumps({"loss": final, "first_loss": first, "steps": args.steps,
                          "world_size": world, "weights": [round(v, 4) for v in flat.tolist()]}),
              flush=True)
        if os.environ.get("HYPER_METRICS"):
            with open(os.environ["HYPER_METRICS"], "a") as f:
                f.write(json.dumps({"loss": final, "steps": args.steps}) + "\n")
    dist.barrier()
    dist.destroy_process_group()
    if not ok.item():
        return 1
    return 0 if final < first else 1


if __name__ == "__main__":
    sys.exit(main())
