"""Utilisation samples in the state file: stored, read back by node and attempt, and
compacted to 1-minute means after an hour (hypercli.usage)."""

from __future__ import annotations

from hypercli.state import State
from hypercli.usage import FULL_RATE_FOR, MEAN_SPAN


def test_samples_are_stored_and_compacted_to_minute_means(hyper_home):
    st = State()
    t0 = 1_000_000.0 - 1_000_000.0 % MEAN_SPAN  # a minute boundary
    rows = []
    for i in range(24):  # 2 minutes at one sample per 5 s
        ts = t0 + 5 * i
        rows.append({"node": "n0", "attempt": None, "ts": ts,
                     "data": {"cpu_pct": float(i), "mem_used": 1000 + i,
                              "gpus": [{"index": 0, "util_pct": 10.0 * (i % 2)},
                                       {"index": 1, "util_pct": 90.0}]}})
        rows.append({"node": "n0", "attempt": "a1", "ts": ts,
                     "data": {"cpu_pct": 100.0, "rss": 2 << 20, "gpus": [1]}})
    rows.append({"node": "n0", "attempt": None, "ts": t0 + FULL_RATE_FOR * 2,
                 "data": {"cpu_pct": 50.0}})  # recent: stays raw
    assert st.add_samples(rows) == 49
    assert len(st.samples(node="n0", nodes_only=True)) == 25
    assert len(st.samples(attempt="a1")) == 24

    replaced = st.compact_samples(before=t0 + FULL_RATE_FOR)
    assert replaced == 48
    node = st.samples(node="n0", nodes_only=True)
    assert [(s["ts"], s["span"]) for s in node] == [(t0, MEAN_SPAN), (t0 + MEAN_SPAN, MEAN_SPAN),
                                                     (t0 + FULL_RATE_FOR * 2, 0)]
    first = node[0]["data"]
    assert first["cpu_pct"] == sum(range(12)) / 12 and first["mem_used"] == 1000 + 5.5
    assert first["gpus"] == [{"index": 0, "util_pct": 5.0}, {"index": 1, "util_pct": 90.0}]
    [a, b] = st.samples(attempt="a1")
    assert a["data"] == {"cpu_pct": 100.0, "rss": 2 << 20, "gpus": [1]} and a["span"] == 60
    assert st.compact_samples(before=t0 + FULL_RATE_FOR) == 0  # means are not compacted again
    assert len(st.samples(since=t0 + MEAN_SPAN, until=t0 + MEAN_SPAN)) == 2


def test_the_agent_samples_only_while_it_has_work_and_buffers_a_bounded_number(tmp_path,
                                                                              monkeypatch):
    """A real agent and a real CPU-burning task: samples ride on the answers only while the
    task runs, plus one last one; no samples without the ``sample`` argument."""
    import time

    from hypercli.node import agent as agent_mod
    from hypercli.node.client import local_agent
    c = local_agent("n", tmp_path / "node")
    try:
        r = c.call("poll", ids=[], wait=0, sample=0.2)
        assert "samples" not in r  # no work: nothing sampled
        r = c.call("launch", attempts=[{"id": "a1", "script": "timeout 2 sh -c "
                                        "'while :; do :; done' || true", "env": {},
                                        "gpus": [3]},
                                       {"id": "idle", "script": "sleep 1", "env": {}}],
                   sample=0.2)
        got = list(r.get("samples", []))
        while True:
            r = c.call("poll", ids=["a1"], wait=0.5, sample=0.2)
            got += r.get("samples", [])
            if r["states"]["a1"]["state"] != "running":
                break
        time.sleep(0.3)
        got += c.call("poll", ids=[], wait=0, sample=0.2).get("samples", [])
        # one last sample after the end (in the answer that reports the end, or the next)
        assert got[-1]["attempts"] == {} and got[-2]["attempts"] != {}
        got.pop()
        time.sleep(0.3)
        assert "samples" not in c.call("poll", ids=[], wait=0, sample=0.2)
        assert 3 <= len(got) <= 12, got
        per = [s["attempts"]["a1"] for s in got if "a1" in s["attempts"]]
        assert all(p["gpus"] == [3] and p["rss"] >= 0 for p in per)
        # a busy loop (a whole core on an idle machine, ~25% of one on 2 cores at load 8)
        # against a sleeping task sampled at the same times
        idle = [s["attempts"]["idle"] for s in got if "idle" in s["attempts"]]
        assert max(p.get("cpu_pct", 0) for p in per) > 15
        assert max(p.get("cpu_pct", 0) for p in idle) < 5
        assert all(s["ts"] > 0 and "mem_total" in s["node"] for s in got)
        # without ``sample`` (sampling off): no samples at all
        c.call("launch", attempts=[{"id": "a2", "script": "sleep 0.5", "env": {}}])
        r = c.call("poll", ids=["a2"], wait=2)
        assert r["states"]["a2"]["state"] == "exited" and "samples" not in r
    finally:
        c.close()
    s = agent_mod._Sampler(str(tmp_path))
    for i in range(agent_mod.SAMPLES_MAX + 5):
        s.sample({}, 1000.0 + i)
    buf = s.take()
    assert len(buf) == agent_mod.SAMPLES_MAX and buf[0]["ts"] == 1005.0  # oldest dropped
    assert s.take() == []


def test_stats_are_peak_and_time_weighted_mean():
    from hypercli.usage import rows_of, stats
    rows = rows_of("n0", [{"ts": 100.0 + 5 * i, "node": {"gpus": [{"index": 1, "util_pct": u}]},
                           "attempts": {"a1": {"cpu_pct": c, "rss": 100 * i, "gpus": [1]}}}
                          for i, (c, u) in enumerate([(10, 0), (90, 50), (50, 100)])])
    att = [dict(r, span=0) for r in rows if r["attempt"]]
    node = [dict(r, span=0) for r in rows if r["attempt"] is None]
    s = stats(att, node)
    assert s["samples"] == 3 and s["from"] == 100 and s["to"] == 110
    assert s["cpu_pct"] == {"peak": 90, "mean": 50} and s["rss"]["peak"] == 200
    assert s["gpus"] == {"1": {"util_pct": {"peak": 100, "mean": 50},
                               "mem_used_mib": None}}
    # a 1-minute mean weighs as the 12 samples (of 5 s) it stands for
    mixed = stats([{"ts": 0, "span": 60, "data": {"cpu_pct": 10}},
                   {"ts": 60, "span": 0, "data": {"cpu_pct": 100}}])
    assert mixed["cpu_pct"]["peak"] == 100 and abs(mixed["cpu_pct"]["mean"] - 220 / 13) < 1e-9
    assert stats([])["cpu_pct"] is None and stats([])["samples"] == 0


def test_watch_warns_once_of_an_idle_gpu_and_of_a_full_disk():
    from hypercli.usage import DISK_FULL_BYTES, Watch, rows_of
    w = Watch(low_gpu_for=300)
    live = {"a1": {"id": "a1", "task": "train-0001", "node": "n0"}}

    def at(ts, util, free=10 << 30, gpus=(0,)):
        return rows_of("n0", [{"ts": ts, "node": {
            "disk_free": free, "disk_total": 100 << 30,
            "gpus": [{"index": 0, "util_pct": util}, {"index": 1, "util_pct": 99}]},
            "attempts": {"a1": {"gpus": list(gpus)}}}])
    assert w.add("n0", at(0, 2), live) == []
    assert w.add("n0", at(200, 60), live) == []  # busy again: the idle time starts over
    assert w.add("n0", at(250, 1), live) == []
    assert w.add("n0", at(500, 4.9), live) == []  # 250 s idle: not yet
    [warn] = w.add("n0", at(560, 0), live)  # 310 s
    assert warn["kind"] == "low_gpu" and warn["attempt"] == "a1"
    assert warn["message"] == "train-0001 has held GPU 0 on n0 at under 5% for 5 min"
    assert w.add("n0", at(900, 0), live) == []  # once per attempt
    # a task on the busy GPU 1 is never warned about
    w2 = Watch(low_gpu_for=300)
    assert w2.add("n0", at(0, 0, gpus=(1,)), live) + w2.add("n0", at(400, 0, gpus=(1,)),
                                                              live) == []
    # disk: under 1% of 100 GiB (> 100 MiB) while a task runs, once per spell
    [full] = w.add("n0", at(1000, 50, free=512 << 20), live)
    assert full["kind"] == "disk_full" and full["attempts"] == ["a1"]
    assert "train-0001" in full["message"]
    assert w.add("n0", at(1005, 50, free=DISK_FULL_BYTES // 2), live) == []
    assert w.add("n0", at(1010, 50, free=10 << 30), live) == []  # freed: the spell ends
    assert len(w.add("n0", at(1015, 50, free=1 << 20), live)) == 1
    assert Watch().add("n0", at(0, 0, free=1 << 20), {}) == []  # no task runs: no warning


def test_sample_interval_from_the_environment(monkeypatch):
    import pytest

    from hypercli.errors import UsageError
    from hypercli.usage import SAMPLE_EVERY, sample_every
    monkeypatch.delenv("HYPER_SAMPLE_EVERY", raising=False)
    assert sample_every() == SAMPLE_EVERY == 5.0
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "0")
    assert sample_every() == 0
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "1.5")
    assert sample_every() == 1.5
    monkeypatch.setenv("HYPER_SAMPLE_EVERY", "often")
    with pytest.raises(UsageError, match="HYPER_SAMPLE_EVERY='often'"):
        sample_every()


def test_the_kernel_log_names_an_oom_killed_process(tmp_path):
    """The agent's other OOM evidence, for processes of its own PID namespace: a real OOM
    kill in a 64 MiB memory cgroup of this machine, then the kernel log read as the agent
    reads it (/dev/kmsg), and the cgroup's counter."""
    import os
    import subprocess
    import time
    from pathlib import Path

    import pytest

    from hypercli.node import agent
    v1 = Path("/sys/fs/cgroup/memory")
    base = v1 if (v1 / "cgroup.procs").exists() else Path("/sys/fs/cgroup")
    cg = base / f"hyper-kmsg-test-{os.getpid()}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot make a memory cgroup here: {e}")
    try:
        (cg / ("memory.limit_in_bytes" if base == v1 else "memory.max")).write_text(
            str(64 << 20))
        before = agent._oom_kills(str(cg))
        start = time.monotonic()
        p = subprocess.Popen(["sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec python3 -c '
                              '"x = bytearray(512 << 20)"'])
        assert p.wait(timeout=60) == -9
        assert agent._oom_kills(str(cg)) == before + 1
        line = agent._kmsg_oom({p.pid})
        if line is None and not os.access("/dev/kmsg", os.R_OK):
            pytest.skip("/dev/kmsg is not readable here")
        assert line is not None and str(p.pid) in line, line
        assert agent._kmsg_oom({p.pid}, since=start) == line
        assert agent._kmsg_oom({p.pid}, since=time.monotonic() + 1) is None  # too old
        assert agent._kmsg_oom({1 << 22}) is None  # no such pid was killed
    finally:
        cg.rmdir()
