"""Checkpoints that follow a task: HYPER_CHECKPOINT saved in generations while the attempt
runs, and restored for the next attempt, on the local provider (file:// storage); the store's
own rules (only changed blocks sent, generations by attempt, a late save of an older attempt
never wins, a corrupt block refused, a file being written never taken torn)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
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
    data = p.read_bytes()
    p.write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # always another byte
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


#: rewrites a file in place again and again as torch.save does (open with O_TRUNC, then write
#: 64 KiB at a time), every version all one 8-byte word (its number); prints the last number
WRITER = r"""
import os, sys
path, size, stop = sys.argv[1], int(sys.argv[2]), sys.argv[3]
v = 1
while not os.path.exists(stop):
    v += 1
    word = v.to_bytes(8, "little") * 8192
    with open(path, "wb") as f:
        for _ in range(size // len(word)):
            f.write(word)
print(v, flush=True)
"""


def one_version(data: bytes, size: int) -> int | None:
    """The version a file written by WRITER holds, or None when it is torn."""
    if len(data) != size or data != data[:8] * (size // 8):
        return None
    return int.from_bytes(data[:8], "little")


def test_a_file_rewritten_in_place_while_saves_run_is_never_saved_torn(tmp_path):
    src, url, state = tmp_path / "ck", f"file://{tmp_path}/store", tmp_path / "s.json"
    src.mkdir()
    size = 4 << 20
    (src / "model.pt").write_bytes((1).to_bytes(8, "little") * (size // 8))
    (src / "step").write_text("1")
    assert C.save(src, url, 1, state).generation
    stop = tmp_path / "stop"
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(src / "model.pt"), str(size),
                               str(stop)], stdout=subprocess.PIPE, text=True)
    try:
        first = (src / "model.pt").stat().st_ctime_ns
        wait_for(lambda: (src / "model.pt").stat().st_ctime_ns != first, timeout=60,
                 what="the writer at work")
        warnings, seen = [], 1
        for i in range(4):
            (src / "step").write_text(str(i + 2))
            r = C.save(src, url, 1, state)
            warnings += r.warnings
            out = tmp_path / f"out{i}"
            C.restore(url, out, tmp_path / f"out{i}.json")
            # one whole version: the last one kept, or one the writer had closed and not
            # yet opened again while it was read (a writer kept waiting for a CPU)
            v = one_version((out / "model.pt").read_bytes(), size)
            assert v is not None and v >= seen, v
            seen = v
            assert (out / "step").read_text() == str(i + 2)  # the rest of the save is taken
    finally:
        stop.touch()
        last = int(writer.communicate(timeout=120)[0])
    assert warnings and all("model.pt" in w and "previous version is kept" in w
                            for w in warnings), warnings
    assert C.save(src, url, 1, state).warnings == []  # it holds still now: taken
    C.restore(url, tmp_path / "final", tmp_path / "final.json")
    assert one_version((tmp_path / "final" / "model.pt").read_bytes(), size) == last


def test_the_final_save_of_a_stopped_attempt_never_replaces_a_complete_generation(tmp_path):
    src, url, state = tmp_path / "ck", f"file://{tmp_path}/store", tmp_path / "s.json"
    src.mkdir()
    size = 1 << 20
    model = src / "model.pt"
    model.write_bytes(b"\x01" * size)
    complete = C.save(src, url, 1, state)
    time.sleep(0.1)  # the torn write's ctime (a coarse clock) after the save's time
    with open(model, "r+b") as f:  # a writer killed halfway: torn, and still from now on
        f.write(b"\x02" * (size // 2))
    r = C.save(src, url, 1, state, stopped_at=time.time())
    assert r.generation is None and "model.pt changed as the attempt ended" in r.warnings[0]
    C.restore(url, tmp_path / "a", tmp_path / "a.json")
    assert (tmp_path / "a" / "model.pt").read_bytes() == b"\x01" * size

    # a periodic save ran as the attempt was ending and took the torn file (it held still):
    # the final save puts the generation written before it back on top
    torn = C.save(src, url, 1, state)
    assert torn.generation and torn.generation != complete.generation
    r = C.save(src, url, 1, state, stopped_at=time.time())  # even when written just before
    assert r.generation and complete.generation in r.warnings[0], r.warnings
    C.restore(url, tmp_path / "b", tmp_path / "b.json")
    assert (tmp_path / "b" / "model.pt").read_bytes() == b"\x01" * size
    # an attempt that ended long after its last change saves as usual
    assert C.save(src, url, 1, state, stopped_at=time.time() + 60).generation


def test_a_task_killed_halfway_through_a_save_resumes_from_its_last_whole_one(
        hyper_home, write_recipe, tmp_path):
    """The whole way: the task's last save before it is killed mid-write is the one the
    retry gets, not the torn file the wrapper's final save found."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "torn.py").write_text((JOB / "torn.py").read_text())
    path = write_recipe(f"""
        name: torn
        workdir: {work}
        cluster: {{workers: 1}}
        experiments:
          train:
            retries: 1
            checkpoint_every: 1
            command: python3 torn.py
    """)
    r = subprocess.run([*hyper_cmd(), "run", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    state = State()
    attempts = state.attempts("torn-1", "train-0000")
    logs = [(hyper_home / "local" / "tasks" / a["id"] / "stderr").read_text()
            for a in attempts]
    assert r.returncode == 0 and [a["status"] for a in attempts] == ["failed", "succeeded"], (
        r.stdout + r.stderr, logs)
    assert state.task("torn-1", "train-0000")["metrics"] == {"size": 1 << 20, "byte": 1}
    assert "changed as the attempt ended" in logs[0]


def test_every_rank_of_a_gang_gets_its_own_checkpoint_back(hyper_home, write_recipe,
                                                            tmp_path):
    """Rank 0 and rank 1 each keep a file of their own (the default, ``each``): after the
    gang is retried, each finds its own. With ``checkpoint_ranks: rank0`` (a folder the
    ranks share) rank 0's is kept and every rank gets it."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "ranks.py").write_text((JOB / "ranks.py").read_text())
    path = write_recipe(f"""
        name: ranks
        workdir: {work}
        cluster: {{workers: 4}}
        experiments:
          own:
            nodes: 2
            retries: 1
            checkpoint_every: 1
            command: python3 ranks.py each
          shared:
            nodes: 2
            retries: 1
            checkpoint_every: 1
            checkpoint_ranks: rank0
            command: python3 ranks.py rank0
    """)
    r = subprocess.run([*hyper_cmd(), "run", str(path)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    state = State()
    found = {}
    for task in ("own-0000", "shared-0000"):
        for a in state.attempts("ranks-1", task):
            out = (hyper_home / "local" / "tasks" / a["id"] / "stdout").read_text()
            found[task, a["number"], a["rank"]] = out.split("found: ", 1)[-1].strip()
    assert r.returncode == 0, (r.stdout + r.stderr, found)
    assert found[("own-0000", 2, 0)] == "written by rank 0"
    assert found[("own-0000", 2, 1)] == "written by rank 1"
    assert found[("shared-0000", 2, 0)] == found[("shared-0000", 2, 1)] == "written by rank 0"
    kept = hyper_home / "storage" / "ranks-1" / ".checkpoints"
    for rank in (0, 1):  # each rank's own generations, and its own file in them
        out = tmp_path / f"rank-{rank}"
        C.restore(f"file://{kept}/own-0000/rank-{rank}", out, tmp_path / f"r{rank}.json")
        assert (out / "mine").read_text() == f"written by rank {rank}"
    assert list((kept / "shared-0000" / "gen").glob("*.json"))
    assert not (kept / "shared-0000" / "rank-1").exists()


def test_checkpoint_ranks_is_checked_with_a_did_you_mean():
    from hypercli.errors import RecipeError
    from hypercli.recipe import parse_recipe
    ok = parse_recipe("name: r\nexperiments:\n  t:\n    nodes: 2\n    checkpoint_ranks: rank0\n"
                      "    command: 'true'\n")
    assert ok.experiments["t"].checkpoint_ranks == "rank0"
    assert parse_recipe("name: r\nexperiments:\n  t:\n    command: 'true'\n").experiments[
        "t"].checkpoint_ranks == "each"
    with pytest.raises(RecipeError) as e:
        parse_recipe("name: r\nexperiments:\n  t:\n    checkpoint_ranks: rank-0\n"
                     "    command: 'true'\n")
    assert e.value.field == "experiments.t.checkpoint_ranks" and e.value.line == 4
    assert "not 'rank-0'" in str(e.value) and "did you mean 'rank0'?" in str(e.value)
