"""A task killed in the middle of writing its checkpoint, for the checkpoint tests. Attempt 1
writes model.pt (1 MiB of 0x01), waits until a save of it is in the store, then starts
writing version 2 in place and is killed (SIGKILL) halfway. Attempt 2 writes what it got
back to $HYPER_METRICS: {"size": bytes, "byte": the one byte value, or -1 when torn}."""

import glob
import json
import os
import signal
import time

ck = os.environ["HYPER_CHECKPOINT"]
path = os.path.join(ck, "model.pt")
size = 1 << 20
if os.environ["HYPER_ATTEMPT"] == "1":
    with open(path, "wb") as f:
        f.write(b"\x01" * size)
    gens = os.path.join(os.environ["HYPER_OUTPUTS"], ".checkpoints",
                        os.environ["HYPER_TASK_ID"], "gen", "*.json")
    while not glob.glob(gens):  # the file:// store of the local provider
        time.sleep(0.05)
    with open(path, "r+b") as f:
        f.write(b"\x02" * (size // 2))
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)
data = open(path, "rb").read()
with open(os.environ["HYPER_METRICS"], "a") as f:
    f.write(json.dumps({"size": len(data),
                        "byte": data[0] if len(set(data)) == 1 else -1}) + "\n")
