"""A torch.distributed job for the gang tests: each rank all-reduces rank+1 (gloo, env://
init from MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK), STEPS times with PAUSE s between, and
rank 0 reports the sum to $HYPER_METRICS. Usage: allreduce.py [STEPS] [PAUSE]"""
import json, os, sys, time
import torch
import torch.distributed as dist
dist.init_process_group("gloo")
r = dist.get_rank()
steps = int(sys.argv[1]) if len(sys.argv) > 1 else 1
pause = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
for s in range(steps):
    t = torch.tensor([float(r + 1)])
    dist.all_reduce(t)
    time.sleep(pause)
print(json.dumps({"sum": t.item(), "rank": r, "world": dist.get_world_size()}), flush=True)
if os.environ.get("HYPER_METRICS"):
    with open(os.environ["HYPER_METRICS"], "a") as f:
        f.write(json.dumps({"sum": t.item(), "steps": steps}) + "\n")
dist.barrier()
dist.destroy_process_group()
