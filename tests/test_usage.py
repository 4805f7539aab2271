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
