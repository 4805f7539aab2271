"""Multi-node data-parallel training written the way PyTorch's DDP tutorials write it, with no
line about hypercli: launched by ``torchrun`` on every node, DistributedDataParallel over gloo
(CPU), a DistributedSampler, and a *relative* ``snapshot.pt`` saved with ``torch.save`` every
``--save-every`` epochs by global rank 0 and loaded at start when it is there.

The recipe (recipes/ddp-snapshot.yaml) runs it from inside ``$HYPER_CHECKPOINT``, so
``snapshot.pt`` lands in the folder hypercli saves while the task runs and restores on every
rank of the next attempt: a gang restarted after a node was lost resumes from the last epoch
saved. If ``$HYPER_METRICS`` is set, rank 0 also reports the epoch it resumed from and the
final loss there.

    torchrun --nnodes=2 --nproc_per_node=1 --node_rank=0 --master_addr=10.0.0.1 \\
        --master_port=29500 multinode.py --epochs 30 --save-every 2
"""

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from torch.distributed import destroy_process_group, init_process_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler


class SyntheticRegression(Dataset):
    """``size`` seeded (input, target) pairs of a noisy linear map: the same on every rank."""

    def __init__(self, size: int):
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(size, 20, generator=g)
        w = torch.randn(20, 1, generator=g)
        self.y = self.x @ w + 0.01 * torch.randn(size, 1, generator=g)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Trainer:
    def __init__(self, model, data, optimizer, save_every: int, snapshot_path: str):
        self.local_rank = int(os.environ["LOCAL_RANK"])
        self.global_rank = int(os.environ["RANK"])
        self.model, self.data, self.optimizer = model, data, optimizer
        self.save_every, self.snapshot_path = save_every, snapshot_path
        self.epochs_run = 0
        if os.path.exists(snapshot_path):
            print("Loading snapshot", flush=True)
            self._load_snapshot(snapshot_path)
        self.model = DDP(self.model)

    def _load_snapshot(self, path: str) -> None:
        snapshot = torch.load(path, map_location="cpu")
        self.model.load_state_dict(snapshot["MODEL_STATE"])
        self.optimizer.load_state_dict(snapshot["OPTIMIZER_STATE"])
        self.epochs_run = snapshot["EPOCHS_RUN"]
        print(f"Resuming training from snapshot at epoch {self.epochs_run}", flush=True)

    def _run_epoch(self, epoch: int) -> float:
        self.data.sampler.set_epoch(epoch)
        total = 0.0
        for source, targets in self.data:
            self.optimizer.zero_grad()
            loss = F.mse_loss(self.model(source), targets)
            loss.backward()
            self.optimizer.step()
            total += loss.item()
        return total / len(self.data)

    def _save_snapshot(self, epochs_run: int) -> None:
        snapshot = {"MODEL_STATE": self.model.module.state_dict(),
                    "OPTIMIZER_STATE": self.optimizer.state_dict(), "EPOCHS_RUN": epochs_run}
        torch.save(snapshot, self.snapshot_path)
        print(f"Epoch {epochs_run - 1} | Training snapshot saved at {self.snapshot_path}",
              flush=True)

    def train(self, max_epochs: int, pause: float) -> float:
        loss = float("nan")
        for epoch in range(self.epochs_run, max_epochs):
            loss = self._run_epoch(epoch)
            print(f"[rank {self.global_rank}] epoch {epoch} | loss {loss:.5f}", flush=True)
            if self.global_rank == 0 and (epoch + 1) % self.save_every == 0:
                self._save_snapshot(epoch + 1)
            time.sleep(pause)
        return loss


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=30)
    ap.add_argument("--save-every", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--pause", type=float, default=0.0, help="s to wait after each epoch")
    ap.add_argument("--snapshot", default="snapshot.pt")
    args = ap.parse_args()
    init_process_group(backend="gloo")
    torch.manual_seed(0)
    data = SyntheticRegression(1024)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=False,
                        sampler=DistributedSampler(data))
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    trainer = Trainer(model, loader, optimizer, args.save_every, args.snapshot)
    resumed_from = trainer.epochs_run
    loss = trainer.train(args.epochs, args.pause)
    if trainer.global_rank == 0 and os.environ.get("HYPER_METRICS"):
        with open(os.environ["HYPER_METRICS"], "a") as f:
            f.write(json.dumps({"resumed_from_epoch": resumed_from, "epochs": args.epochs,
                                "loss": round(loss, 6)}) + "\n")
    destroy_process_group()


if __name__ == "__main__":
    main()
