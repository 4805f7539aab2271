"""Data-parallel training of a small regression network with PyTorch's
DistributedDataParallel on the gloo backend (CPU): one process per node, as a gang task of
`hyper` starts it. torch.distributed reads MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK from
the environment, which hypercli sets for every rank.

Each rank trains on its own slice of a seeded synthetic data set; gradients are averaged by
DDP's all-reduce, so every rank ends with the same weights (checked at the end). After every
epoch rank 0 writes a checkpoint (weights, optimizer, epoch) into $HYPER_CHECKPOINT, which
hypercli saves while the task runs and restores for its next attempt on every rank: a
training stopped midway (a node preempted) goes on from its last epoch. Rank 0 reports the
loss and the epoch it started from to $HYPER_METRICS and saves the model to $HYPER_OUTPUT.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--samples", type=int, default=4096)
    ap.add_argument("--pause", type=float, default=0.0, help="s to wait after each epoch")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(args.samples, 16)
    w_true = torch.randn(16, 1)
    y = x @ w_true + 0.01 * torch.randn(args.samples, 1)
    mine = slice(rank * args.samples // world, (rank + 1) * args.samples // world)
    torch.manual_seed(1)  # the same initial weights on every rank (DDP also broadcasts them)
    net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
    opt = torch.optim.SGD(net.parameters(), lr=args.lr)
    ckpt_dir = os.environ.get("HYPER_CHECKPOINT")
    ckpt = os.path.join(ckpt_dir, "ckpt.pt") if ckpt_dir else None
    start = 0
    if ckpt and os.path.exists(ckpt):  # restored by hypercli for this attempt
        saved = torch.load(ckpt)
        net.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        start = saved["epoch"] + 1
    print(f"rank {rank}: starting at epoch {start}", flush=True)
    model = nn.parallel.DistributedDataParallel(net)
    loss_fn = nn.MSELoss()
    total = torch.tensor(0.0)
    for epoch in range(start, args.epochs):
        for xb, yb in zip(x[mine].split(64), y[mine].split(64)):
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()  # DDP all-reduces the gradients here
            opt.step()
        with torch.no_grad():
            total = loss_fn(model(x), y)
        if rank == 0:
            print(f"epoch {epoch} loss {total.item():.5f}", flush=True)
            if ckpt:
                torch.save({"model": net.state_dict(), "optimizer": opt.state_dict(),
                            "epoch": epoch}, ckpt + ".tmp")
                os.replace(ckpt + ".tmp", ckpt)
        time.sleep(args.pause)
    checksum = torch.tensor([sum(p.sum().item() for p in model.parameters())])
    gathered = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(gathered, checksum)
    same = all(abs(g.item() - checksum.item()) < 1e-4 for g in gathered)
    if rank == 0:
        metrics = {"loss": round(total.item(), 6), "world_size": world, "in_sync": same,
                   "started_at_epoch": start}
        with open(os.environ.get("HYPER_METRICS", os.devnull), "a") as f:
            f.write(json.dumps(metrics) + "\n")
        out = os.environ.get("HYPER_OUTPUT")
        if out:
            torch.save(net.state_dict(), os.path.join(out, "model.pt"))
        print(json.dumps(metrics))
    dist.barrier()  # every rank done before any tears its connections down
    dist.destroy_process_group()
    if not same:
        raise SystemExit("ranks ended with different weights")


if __name__ == "__main__":
    main()
