"""A training stand-in for the checkpoint tests: counts to STEPS, one step every PAUSE s,
keeping its step in $HYPER_CHECKPOINT/state.json (and a blob that changes a little each
step), and resumes from it. Prints the step it started from; writes {"start", "steps"} to
$HYPER_METRICS at the end. Usage: count.py STEPS PAUSE"""

import json
import os
import sys
import time

steps, pause = int(sys.argv[1]), float(sys.argv[2])
ck = os.environ["HYPER_CHECKPOINT"]
state_path = os.path.join(ck, "state.json")
start = 0
if os.path.exists(state_path):
    with open(state_path) as f:
        start = json.load(f)["step"]
print(f"attempt {os.environ['HYPER_ATTEMPT']} starts at step {start}", flush=True)
blob = os.path.join(ck, "weights.bin")
if not os.path.exists(blob):
    with open(blob, "wb") as f:
        f.write(bytes(1 << 20))
for step in range(start, steps):
    time.sleep(pause)
    with open(blob, "r+b") as f:
        f.seek((step * 4096) % (1 << 20))
        f.write(step.to_bytes(4, "little") * 1024)
    tmp = state_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"step": step + 1}, f)
    os.replace(tmp, state_path)
with open(os.environ["HYPER_METRICS"], "a") as f:
    f.write(json.dumps({"start": start, "steps": steps}) + "\n")
