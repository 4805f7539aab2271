"""Utilisation of nodes and tasks (paper III-C, "CPU/GPU utilisation logs"): the values a
node's agent samples, and how they are summarised.

A node sample (``attempt`` None) has ``cpu_pct`` (0-100, of the whole node), ``load1``,
``mem_used`` / ``mem_total`` (bytes), ``disk_free`` (bytes), ``net_rx`` / ``net_tx`` (bytes/s)
and ``gpus``: ``[{"index", "util_pct", "mem_used_mib", "mem_total_mib", "temp_c",
"power_w"}]``; ``disk_total`` (bytes) comes along for the disk-full rule. An attempt's sample
has ``cpu_pct`` (100 = one core, as ``top`` counts), ``rss`` (bytes, its processes' resident
memory) and ``gpus`` (the indexes it holds). Any key may be missing (a node without GPUs, a
value the node could not read; the first sample of a node or attempt has no rates yet).

Raw samples are kept for an hour, then as 1-minute means (:meth:`State.compact_samples`).

Nodes' agents take the samples every ``HYPER_SAMPLE_EVERY`` s (default 5; 0 turns sampling
off) while they have running attempts, and hand them over in their poll answers
(``hypercli/node/agent.py``); :func:`rows_of` turns an answer's samples into state rows.
:func:`stats` sums up an attempt's samples (peak and mean); :class:`Watch` turns the samples
of a run into warnings: a task that has held its GPUs under ``LOW_GPU_PCT`` % for
``LOW_GPU_FOR`` s, a node whose disk is nearly full while tasks run.
"""

from __future__ import annotations

import os

#: s of full-rate samples kept before they become 1-minute means
FULL_RATE_FOR = 3600.0
#: s a mean covers once compacted
MEAN_SPAN = 60.0
#: s between samples unless ``HYPER_SAMPLE_EVERY`` says otherwise
SAMPLE_EVERY = 5.0
#: s between compactions of the state file's samples by a driver
COMPACT_EVERY = 300.0
#: a GPU held under this utilisation (%) ...
LOW_GPU_PCT = 5.0
#: ... for this long (s) gets a warning
LOW_GPU_FOR = 300.0
#: a node's disk is full when its free space falls under this (bytes) ...
DISK_FULL_BYTES = 100 << 20
#: ... or under this fraction of its size
DISK_FULL_FRACTION = 0.01


def _mean(values: list) -> float | None:
    nums = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
    return sum(nums) / len(nums) if nums else None


def mean_of(samples: list[dict]) -> dict:
    """The mean of several samples' ``data`` of one node or attempt: numbers averaged key by
    key (a key missing in some samples averages over those that have it); ``gpus`` of node
    samples (dicts) averaged per GPU index; ``gpus`` of attempt samples (indexes) the last
    list seen. Non-numeric values: the last one seen."""
    out: dict = {}
    keys = {k for s in samples for k in s}
    for k in sorted(keys):
        vals = [s[k] for s in samples if k in s]
        if k == "gpus":
            if any(isinstance(g, dict) for v in vals for g in (v or [])):
                per: dict[int, list[dict]] = {}
                for v in vals:
                    for g in v or []:
                        per.setdefault(g.get("index"), []).append(g)
                out[k] = [dict(mean_of(gs), index=i) for i, gs in sorted(
                    per.items(), key=lambda kv: (kv[0] is None, kv[0]))]
            else:
                out[k] = vals[-1]
            continue
        m = _mean(vals)
        out[k] = m if m is not None else vals[-1]
    return out


def sample_every() -> float:
    """s between samples: ``HYPER_SAMPLE_EVERY`` (0 or less: off), default SAMPLE_EVERY.

    Raises:
        UsageError: the variable is not a number.
    """
    raw = os.environ.get("HYPER_SAMPLE_EVERY", "").strip()
    if not raw:
        return SAMPLE_EVERY
    try:
        return max(0.0, float(raw))
    except ValueError:
        from hypercli.errors import UsageError
        raise UsageError(f"HYPER_SAMPLE_EVERY={raw!r} is not a number of seconds",
                         "set it to the seconds between utilisation samples, 0 for none"
                         ) from None


def compact_cut(now: float) -> float:
    """The ``before`` (unix s) of a compaction at ``now``: FULL_RATE_FOR s ago, down to a
    MEAN_SPAN boundary, so a bucket is never split between two compactions (which would give
    it two means)."""
    return (now - FULL_RATE_FOR) // MEAN_SPAN * MEAN_SPAN


def rows_of(node: str, samples: list[dict]) -> list[dict]:
    """State rows (:meth:`State.add_samples`) of an agent answer's ``samples`` (``[{"ts",
    "node": {...}, "attempts": {id: {...}}}]``): one node row and one per attempt each."""
    rows = []
    for s in samples or []:
        ts = s.get("ts")
        if not isinstance(ts, (int, float)):
            continue
        if s.get("node"):
            rows.append({"node": node, "attempt": None, "ts": ts, "data": s["node"]})
        for aid, data in sorted((s.get("attempts") or {}).items()):
            rows.append({"node": node, "attempt": aid, "ts": ts, "data": data})
    return rows


def _weight(row: dict, every: float) -> float:
    """A row's weight in a mean: 1 for a raw sample, the samples a 1-minute mean stands for."""
    return (row.get("span") or 0) / every if row.get("span") else 1.0


def _summary(pairs: list[tuple[float, float]]) -> dict | None:
    """{"peak", "mean"} of (value, weight) pairs; None when there are none."""
    if not pairs:
        return None
    total = sum(w for _, w in pairs) or 1.0
    return {"peak": max(v for v, _ in pairs), "mean": sum(v * w for v, w in pairs) / total}


def _num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def stats(attempt_rows: list[dict], node_rows: list[dict] | None = None,
          every: float = SAMPLE_EVERY) -> dict:
    """Peak and mean use of one attempt, from its sample rows (``State.samples(attempt=)``)
    and, for its GPUs' utilisation, its node's rows over the same time.

    Returns ``{"samples": int, "from": unix s, "to": unix s, "cpu_pct": {"peak", "mean"}
    (100 = one core), "rss": {"peak", "mean"} (bytes), "gpus": {index: {"util_pct": {...},
    "mem_used_mib": {...}}}}``; a value without samples is None. Peaks of compacted samples
    are their 1-minute means (older than FULL_RATE_FOR s: the true peak may have been higher).
    """
    rows = sorted(attempt_rows, key=lambda r: r["ts"])
    out: dict = {"samples": len(rows), "from": rows[0]["ts"] if rows else None,
                 "to": rows[-1]["ts"] + (rows[-1].get("span") or 0) if rows else None}
    for key in ("cpu_pct", "rss"):
        out[key] = _summary([(r["data"][key], _weight(r, every)) for r in rows
                             if _num(r["data"].get(key))])
    held = sorted({g for r in rows for g in (r["data"].get("gpus") or []) if _num(g)})
    gpus: dict = {}
    if held and node_rows:
        lo, hi = out["from"], out["to"]
        near = [r for r in node_rows if lo - 1 <= r["ts"] <= hi + 1]
        for i in held:
            per: dict = {"util_pct": [], "mem_used_mib": []}
            for r in near:
                for g in r["data"].get("gpus") or []:
                    if isinstance(g, dict) and g.get("index") == i:
                        for k in per:
                            if _num(g.get(k)):
                                per[k].append((g[k], _weight(r, every)))
            gpus[str(i)] = {k: _summary(v) for k, v in per.items()}
    elif held:
        gpus = {str(i): {"util_pct": None, "mem_used_mib": None} for i in held}
    out["gpus"] = gpus
    return out


class Watch:
    """Warnings from a run's samples, each given once (per attempt, or per node and spell of
    a full disk): feed it every answer's rows with :meth:`add`.

    Args:
        low_gpu_pct, low_gpu_for: a task that has held every one of its GPUs under
            ``low_gpu_pct`` % for ``low_gpu_for`` s gets a warning.
    """

    def __init__(self, low_gpu_pct: float = LOW_GPU_PCT, low_gpu_for: float = LOW_GPU_FOR):
        self.low_gpu_pct, self.low_gpu_for = low_gpu_pct, low_gpu_for
        self.low_since: dict[str, float] = {}  # attempt → unix s since its GPUs are idle
        self.warned: set[str] = set()  # attempts warned about
        self.full: set[str] = set()  # nodes whose disk is full now (warned)

    def add(self, node: str, rows: list[dict], live: dict[str, dict]) -> list[dict]:
        """Warnings for one node's new rows (:func:`rows_of`), oldest first. ``live``:
        attempt id → its row (``task``) of the run's running attempts. Returns
        ``[{"kind": "low_gpu"|"disk_full", "message": str, "node": str, "attempt": id?,
        "task": id?}]``."""
        out = []
        util: dict[float, dict] = {}
        for r in rows:
            if r["attempt"] is None:
                util[r["ts"]] = {g.get("index"): g.get("util_pct")
                                 for g in r["data"].get("gpus") or [] if isinstance(g, dict)}
                out += self._disk(node, r, [a for a in live.values() if a["node"] == node])
        for r in rows:
            aid, held = r["attempt"], r["data"].get("gpus") or []
            if aid is None or aid in self.warned or aid not in live or not held:
                continue
            seen = util.get(r["ts"], {})
            vals = [seen.get(g) for g in held]
            if any(not _num(v) for v in vals) or any(v >= self.low_gpu_pct for v in vals):
                self.low_since.pop(aid, None)
                continue
            since = self.low_since.setdefault(aid, r["ts"])
            if r["ts"] - since >= self.low_gpu_for:
                self.warned.add(aid)
                task = live[aid]["task"]
                gpus = ", ".join(str(g) for g in held)
                out.append({"kind": "low_gpu", "node": node, "attempt": aid, "task": task,
                            "message": f"{task} has held GPU {gpus} on {node} at under "
                                       f"{self.low_gpu_pct:g}% for {(r['ts'] - since) / 60:.0f}"
                                       " min"})
        return out

    def _disk(self, node: str, r: dict, running: list[dict]) -> list[dict]:
        free, total = r["data"].get("disk_free"), r["data"].get("disk_total")
        if not _num(free):
            return []
        limit = max(DISK_FULL_BYTES, DISK_FULL_FRACTION * total if _num(total) else 0)
        if free >= limit:
            self.full.discard(node)
            return []
        if node in self.full or not running:
            return []
        self.full.add(node)
        tasks = ", ".join(sorted({a["task"] for a in running}))
        return [{"kind": "disk_full", "node": node, "attempt": None, "task": None,
                 "attempts": sorted(a["id"] for a in running),
                 "message": f"the disk of {node} is nearly full ({free / 2**20:.0f} MiB free) "
                            f"while {tasks} run"}]
