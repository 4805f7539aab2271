"""GPUs on SSH test hosts with a stand-in nvidia-smi (tests/sshhosts.py): tasks asking one GPU
run two at a time on a 2-GPU host, each seeing exactly one index of its own, and a task asking
two waits for a free pair. The timeline comes from notes the tasks leave on the host."""

from __future__ import annotations

import pytest

from test_ssh import run_in_process, ssh_recipe

pytestmark = pytest.mark.slow

NOTE = ('echo "start $(date +%s.%N) $HYPER_TASK_ID $CUDA_VISIBLE_DEVICES $HYPER_GPUS '
        '$NVIDIA_VISIBLE_DEVICES" >> /tmp/gpu-log\n'
        "sleep {s}\n"
        'echo "end $(date +%s.%N) $HYPER_TASK_ID" >> /tmp/gpu-log')


def test_tasks_get_their_own_gpus_and_wait_for_them(ssh_hosts, tmp_path, hyper_home):
    [host] = ssh_hosts.start(1, gpus=2)
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {
        "single": {"parameters": {"i": [0, 1, 2, 3]}, "resources": {"gpus": 1},
                   "command": NOTE.format(s=1.2)},
        "pair": {"resources": {"gpus": 2}, "command": NOTE.format(s=0.5)}})
    state, summary = run_in_process(path)
    assert summary.exit_code == 0
    [node] = state.nodes("lab")
    assert [g["index"] for g in node["info"]["gpus"]] == [0, 1]
    lines = [x.split() for x in host.run("cat /tmp/gpu-log").stdout.splitlines() if x]
    spans, seen = {}, {}
    for x in lines:
        if x[0] == "start":
            spans[x[2]] = [float(x[1]), None]
            seen[x[2]] = x[3:]
        else:
            spans[x[2]][1] = float(x[1])
    assert len(spans) == 5
    for task, (cuda, mine, nvidia) in ((t, v) for t, v in seen.items() if t != "pair-0000"):
        assert cuda == mine == nvidia and cuda in ("0", "1"), (task, seen[task])
    assert seen["pair-0000"][:2] == ["0,1", "0,1"]

    def overlap(a, b):
        return spans[a][0] < spans[b][1] and spans[b][0] < spans[a][1]
    singles = [t for t in spans if t.startswith("single")]
    for i, a in enumerate(singles):
        for b in singles[i + 1:]:
            if overlap(a, b):
                assert seen[a][0] != seen[b][0], (a, b)  # never the same GPU at once
        assert not overlap(a, "pair-0000")  # the pair waited for both GPUs
    most = max(sum(overlap(a, b) for b in singles) for a in singles)
    assert most == 2  # itself and one other: two at a time, as many as there are GPUs
