"""Utilisation of nodes and tasks (paper III-C, "CPU/GPU utilisation logs"): the values a
node's agent samples, and how they are summarised.

A node sample (``attempt`` None) has ``cpu_pct`` (0-100, of the whole node), ``load1``,
``mem_used`` / ``mem_total`` (bytes), ``disk_free`` (bytes), ``net_rx`` / ``net_tx`` (bytes/s)
and ``gpus``: ``[{"index", "util_pct", "mem_used_mib", "mem_total_mib", "temp_c",
"power_w"}]``. An attempt's sample has ``cpu_pct`` (100 = one core, as ``top`` counts),
``rss`` (bytes, its processes' resident memory) and ``gpus`` (the indexes it holds). Any key
may be missing (a node without GPUs, a value the node could not read).

Raw samples are kept for an hour, then as 1-minute means (:meth:`State.compact_samples`).
"""

from __future__ import annotations

#: s of full-rate samples kept before they become 1-minute means
FULL_RATE_FOR = 3600.0
#: s a mean covers once compacted
MEAN_SPAN = 60.0


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
