"""A sharded training stand-in for the checkpoint tests, with torch.distributed.checkpoint
(gloo, CPU): every rank owns one shard (``w<rank>``, 1024 floats, each step adds rank + 1 to
it) and saves it each step into ``$HYPER_CHECKPOINT/step-<n>/`` with ``dcp.save``, so each
rank's folder holds its own shard (``__<rank>_0.distcp``); rank 0's ``.metadata`` is sent to
every rank (no shared file system), then each rank marks the step ``done``. The last KEEP
steps are kept; an old step loses its ``done`` mark before its files, so a step marked done
is whole at any moment a save or a kill catches (a folder saved halfway through removing a
step once gave a retry a marked step without its shard). On start, the ranks resume from the
newest step every rank has done, each loading its own shard, and check it holds what that
step should.

Rank 0 appends {"start", "steps", "shards_ok"} to $HYPER_METRICS at the end.
Usage: dcp_train.py STEPS PAUSE"""

import os
import shutil
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

KEEP = 5
steps, pause = int(sys.argv[1]), float(sys.argv[2])
dist.init_process_group("gloo", timeout=timedelta(seconds=120))
rank, world = dist.get_rank(), dist.get_world_size()
ck = os.environ["HYPER_CHECKPOINT"]


def done_steps() -> set[int]:
    return {int(d[5:]) for d in os.listdir(ck) if d.startswith("step-")
            and os.path.exists(os.path.join(ck, d, "done"))}


every = [None] * world
dist.all_gather_object(every, done_steps())
common = set.intersection(*every)
start = max(common) if common else 0
shard = {f"w{rank}": torch.zeros(1024)}
ok = True
if start:
    dcp.load(shard, checkpoint_id=os.path.join(ck, f"step-{start:06d}"))
    ok = bool(torch.all(shard[f"w{rank}"] == (rank + 1) * start))
print(f"rank {rank} attempt {os.environ.get('HYPER_ATTEMPT')} starts at step {start}, "
      f"shard {'as saved' if ok else 'WRONG'}", flush=True)
for step in range(start + 1, steps + 1):
    time.sleep(pause)
    shard[f"w{rank}"] += rank + 1
    t = torch.ones(1)
    dist.all_reduce(t)  # the ranks go in step: a lost peer stops the others
    path = os.path.join(ck, f"step-{step:06d}")
    dcp.save(shard, checkpoint_id=path)
    meta = [open(os.path.join(path, ".metadata"), "rb").read() if rank == 0 else None]
    dist.broadcast_object_list(meta, src=0)
    if rank != 0:
        with open(os.path.join(path, ".metadata"), "wb") as f:
            f.write(meta[0])
    dist.barrier()
    open(os.path.join(path, "done"), "w").close()
    for old in sorted(done_steps())[:-KEEP]:  # its mark first: a step is never half done
        os.unlink(os.path.join(ck, f"step-{old:06d}", "done"))
        shutil.rmtree(os.path.join(ck, f"step-{old:06d}"), ignore_errors=True)
ok = ok and bool(torch.all(shard[f"w{rank}"] == (rank + 1) * steps))
flag = torch.tensor([1 if ok else 0])
dist.all_reduce(flag, op=dist.ReduceOp.MIN)
if rank == 0 and os.environ.get("HYPER_METRICS"):
    import json
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"start": start, "steps": steps, "shards_ok": bool(flag.item())})
                + "\n")
dist.barrier()
dist.destroy_process_group()
