"""Checkpoints that follow a task: HYPER_CHECKPOINT saved in generations while the attempt
runs, and restored for the next attempt, on the local provider (file:// storage); the store's
own rules (only changed blocks sent, generations by attempt, a late save of an older attempt
never wins, a corrupt block refused)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, hyper_cmd, wait_for
from test_resume import task_pids

from hypercli.mount import checkpoint as C
from hypercli.mount.store import StoreError, open_store
from hypercli.state import State

JOB = Path(__file__).parent / "ckptjob"


def test_save_sends_only_changed_blocks_and_restore_is_exact(tmp_path):
    src, url = tmp_path / "ck", f"file://{tmp_path}/store"
    (src / "sub").mkdir(parents=True)
    rnd = random.Random(1)
    (src / "model.bin").write_bytes(rnd.randbytes(8 << 20))
    (src / "sub" / "step").write_text("1")
    first = C.save(src, url, 1, tmp_path / "a.json")
    assert first.uploaded >= 8 << 20
    assert C.save(src, url, 1, tmp_path / "a.json").generation is None  # nothing changed
    with open(src / "model.bin", "r+b") as f:
        f.seek(3 << 20)
        f.write(rnd.randbytes(1 << 20))
    again = C.save(src, url, 1, tmp_path / "a.json")
    assert (1 << 20) <= again.uploaded <= 1.25 * (1 << 20) + 16
    out = tmp_path / "restored"
    (out).mkdir()
    (out / "stale").write_text("from an older attempt")
    r = C.restore(url, out, tmp_path / "b.json")
    assert r.generation == "gen/00000001.00000002.json"
    assert (out / "model.bin").read_bytes() == (src / "model.bin").read_bytes()
    assert (out / "sub" / "step").read_text() == "1" and not (out / "stale").exists()


def test_a_late_save_of_an_older_attempt_never_wins(tmp_path):
    url = f"file://{tmp_path}/store"
    old, new = tmp_path / "old", tmp_path / "new"
    for d, text in ((old, "attempt 1"), (new, "attempt 2")):
        d.mkdir()
        (d / "step").write_text(text)
    C.save(old, url, 1, tmp_path / "old.json")
    C.save(new, url, 2, tmp_path / "new.json")
    (old / "step").write_text("attempt 1, much later (a fenced node)")
    C.save(old, url, 1, tmp_path / "old.json")
    out = tmp_path / "out"
    C.restore(url, out, tmp_path / "out.json")
    assert (out / "step").read_text() == "attempt 2"


def test_ranks_sharing_a_folder_restore_it_together(tmp_path):
    """The ranks of a gang on one machine (local nodes) restore into one folder at once:
    each waits for the other, and the second finds the folder already restored."""
    url = f"file://{tmp_path}/store"
    src = tmp_path / "src"
    src.mkdir()
    for i in range(8):
        (src / f"shard{i}.bin").write_bytes(random.Random(i).randbytes(1 << 20))
    C.save(src, url, 1, tmp_path / "s.json")
    out, state = tmp_path / "out", tmp_path / "out.state.json"
    cmd = [sys.executable, "-m", "hypercli.mount.node", "checkpoint-restore", url, str(out),
           str(state)]
    procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(4)]
    try:
        done = [p.communicate(timeout=60) for p in procs]
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert [p.returncode for p in procs] == [0] * 4, done
    for i in range(8):
        assert (out / f"shard{i}.bin").read_bytes() == (src / f"shard{i}.bin").read_bytes()
    assert sorted(x.name for x in out.iterdir()) == [f"shard{i}.bin" for i in range(8)]
    again = C.restore(url, out, state)  # already this generation: nothing fetched
    assert again.downloaded == 0 and again.total == 8 << 20


def test_a_corrupt_block_is_refused(tmp_path):
    url = f"file://{tmp_path}/store"
    src = tmp_path / "src"
    src.mkdir()
    (src / "w").write_bytes(os.urandom(1000))
    C.save(src, url, 1, tmp_path / "s.json")
    [(pack, _)] = open_store(url).list("packs/")
    p = tmp_path / "store" / pack
    p.write_bytes(b"x" + p.read_bytes()[1:])
    out = tmp_path / "out"
    with pytest.raises(StoreError, match="does not match"):
        C.restore(url, out, tmp_path / "o.json")
    assert not (out / "w").exists()


def test_a_killed_attempt_resumes_from_its_checkpoint(hyper_home, write_recipe, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "count.py").write_text((JOB / "count.py").read_text())
    path = write_recipe(f"""
        name: ckpt
        workdir: {work}
        cluster: {{workers: 1}}
        experiments:
          train:
            retries: 1
            checkpoint_every: 1
            command: python3 count.py 40 0.1
    """)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        store = hyper_home / "storage" / "ckpt-1" / ".checkpoints" / "train-0000"
        wait_for(lambda: len(list(store.glob("gen/*.json"))) >= 2, timeout=30,
                 what="two saved generations")
        [a] = State().attempts("ckpt-1", status=["running"])
        os.killpg(task_pids(hyper_home, [a])[0], signal.SIGKILL)  # no last save
        out, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 0, out + err
    state = State()
    attempts = state.attempts("ckpt-1", "train-0000")
    assert [a["status"] for a in attempts] == ["failed", "succeeded"]
    metrics = state.task("ckpt-1", "train-0000")["metrics"]
    assert metrics["steps"] == 40 and 0 < metrics["start"] < 40  # resumed, not from 0
    log = (hyper_home / "local" / "tasks" / attempts[1]["id"] / "stdout").read_text()
    assert f"attempt 2 starts at step {metrics['start']}" in log


def test_many_saves_chain_deltas_and_restore_fetches_little_more_than_it_needs(tmp_path):
    src, url = tmp_path / "ck", f"file://{tmp_path}/store"
    src.mkdir()
    rnd = random.Random(7)
    size = 4 << 20
    (src / "w.bin").write_bytes(rnd.randbytes(size))
    C.save(src, url, 1, tmp_path / "s.json")
    for i in range(2 * C.FULL_EVERY + 3):  # past two full generations
        with open(src / "w.bin", "r+b") as f:
            f.seek(rnd.randrange(size - 4096))
            f.write(rnd.randbytes(4096))
        (src / "step").write_text(str(i))
        r = C.save(src, url, 1, tmp_path / "s.json")
        assert r.uploaded < 2 * C.BLOCK + 8192  # the changed blocks and a small manifest
        if i == 5:
            (src / "extra").write_text("gone later")
        if i == 9:
            (src / "extra").unlink()
    fulls = [g for g in open_store(url).list("gen/")
             if json.loads(open_store(url).get(g[0]))["base"] is None]
    assert len(fulls) == 3  # the first, then one per FULL_EVERY deltas
    out = tmp_path / "out"
    r = C.restore(url, out, tmp_path / "o.json")
    assert (out / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    assert (out / "step").read_text() == str(2 * C.FULL_EVERY + 2)
    assert not (out / "extra").exists()
    assert r.downloaded <= size * 1.15  # ranged reads of old packs, not whole packs
