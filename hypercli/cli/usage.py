"""``hyper top`` and ``hyper stats``: utilisation of nodes and tasks (:mod:`hypercli.usage`),
read from the samples in the state file.

Thin click commands: parse, read, render. HyperErrors are left to the ``hyper`` group in
``hypercli.cli`` (exit 2 for an unknown cluster or task).
"""

from __future__ import annotations

import time

import click

from hypercli.cli.common import console, dumps, open_state, text

from hypercli.errors import UsageError

#: s a latest sample may be old and still be shown as "now"
FRESH = 60.0


def _size(n) -> str:
    """Bytes as a short text (``1.5G``); ``-`` for None."""
    if not isinstance(n, (int, float)):
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if abs(n) < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit == "B" else f"{n:.1f}{unit}"
        n /= 1024
    return "-"


def _pct(v) -> str:
    return f"{v:.0f}%" if isinstance(v, (int, float)) else "-"


def latest(state, node: str, since: float) -> tuple[dict | None, dict[str, dict]]:
    """The newest sample of ``node`` since ``since`` (unix s) and the newest of each of its
    attempts: (node data or None, {attempt id: data})."""
    node_data, attempts = None, {}
    for r in state.samples(node=node, since=since):
        if r["attempt"] is None:
            node_data = r["data"]
        else:
            attempts[r["attempt"]] = r["data"]
    return node_data, attempts


def _gpu_text(gpus) -> str:
    if not gpus:
        return "-"
    return " ".join(f"{g.get('index')}:{_pct(g.get('util_pct'))}"
                    + (f"/{g['mem_used_mib'] / 1024:.1f}G" if isinstance(
                        g.get("mem_used_mib"), (int, float)) else "")
                    for g in gpus)


def top_table(state, cluster: str | None):
    """The ``hyper top`` table: each node of the cluster (every cluster that is up when
    ``cluster`` is None) with its newest sample, and under it its running tasks.

    Raises:
        UsageError: no such cluster.
    """
    from rich.table import Table
    if cluster is not None and state.cluster(cluster) is None:
        raise UsageError(f"no cluster {cluster!r}", "`hyper status` lists the clusters")
    names = [cluster] if cluster else [c["name"] for c in state.clusters()
                                       if c["status"] == "up"]
    now = time.time()
    t = Table(title=f"hyper top  ·  {time.strftime('%H:%M:%S')}", title_justify="left",
              box=None)
    for col in ("node / task", "cpu", "load", "memory", "gpus (util/mem)", "disk free", "net"):
        t.add_column(col, justify="left" if col in ("node / task", "gpus (util/mem)")
                     else "right", overflow="fold")
    for name in names:
        for n in state.nodes(name):
            if n["status"] == "down":
                continue
            data, per = latest(state, n["name"], now - FRESH)
            d = data or {}
            net = (f"{_size(d.get('net_rx'))}/s↓ {_size(d.get('net_tx'))}/s↑"
                   if "net_rx" in d else "-")
            t.add_row(text((n["name"], "bold"), f" ({n['status']})"), _pct(d.get("cpu_pct")),
                      f"{d['load1']:.2f}" if isinstance(d.get("load1"), (int, float)) else "-",
                      f"{_size(d.get('mem_used'))} / {_size(d.get('mem_total'))}"
                      if d else "-", _gpu_text(d.get("gpus")), _size(d.get("disk_free")), net)
            util = {g.get("index"): g for g in d.get("gpus") or [] if isinstance(g, dict)}
            for a in sorted(state.live_attempts(n["name"]), key=lambda a: a["id"]):
                s = per.get(a["id"]) or {}
                held = [util.get(i, {"index": i}) for i in s.get("gpus") or
                        (a.get("claim") or {}).get("gpus") or []]
                t.add_row(text(f"  {a['workflow']}/{a['task']}"), _pct(s.get("cpu_pct")), "",
                          _size(s.get("rss")), _gpu_text(held), "", "")
    return t


@click.command()
@click.argument("cluster", required=False)
@click.option("--once", is_flag=True, help="Print the table once and exit.")
@click.option("--every", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              metavar="S", help="Seconds between refreshes.")
def top(cluster, once, every):
    """Live utilisation of CLUSTER's nodes (every cluster that is up when not given) and of
    their running tasks: CPU (a task's 100% is one core), memory, GPUs (utilisation and
    memory used), disk free and network, from the samples the nodes' agents take while they
    have work (every HYPER_SAMPLE_EVERY seconds, default 5). Ctrl-C ends it. A workflow
    that a controller drives is shown as it knows it: its records and samples are copied
    from it at each refresh.
    """
    from hypercli.cli.tasks import _from_controller, _note
    state = open_state()
    con = console()
    conns: dict = {}  # one connection per controller, kept while this runs
    said: set = set()

    def table():
        # workflows a controller drives: its records and samples copied here first
        _from_controller(state, usage=True, conns=conns,
                         note=lambda line: line in said or (said.add(line), _note(line)))
        return top_table(state, cluster)
    try:
        if once:
            con.print(table())
            return
        from rich.live import Live
        with Live(table(), console=con, refresh_per_second=4) as live:
            while True:
                time.sleep(every)
                live.update(table())
    except KeyboardInterrupt:
        pass
    finally:
        for c in conns.values():
            c.close()


def task_stats(state, ref: str, number: int | None = None, rank: int = 0,
               note=None) -> dict:
    """Peak and mean use of a task's attempt (``TASK`` or ``WORKFLOW/TASK``; attempt
    ``number``, default the newest; ``rank`` of a multi-node task):
    :func:`hypercli.usage.stats` plus ``workflow``, ``task``, ``attempt``, ``number``,
    ``node``, ``status``.

    Raises:
        UsageError: unknown or ambiguous task, no such attempt, or it never started.
    """
    from hypercli.usage import stats
    from hypercli.workflows import pick_attempt
    a = pick_attempt(state, ref, number, rank, note=note)
    rows = state.samples(attempt=a["id"])
    node_rows = []
    if rows:
        node_rows = state.samples(node=a["node"], nodes_only=True, since=rows[0]["ts"] - 1,
                                  until=rows[-1]["ts"] + (rows[-1]["span"] or 0) + 1)
    out = {"workflow": a["workflow"], "task": a["task"], "attempt": a["id"],
           "number": a["number"], "rank": a["rank"], "node": a["node"], "status": a["status"]}
    out.update(stats(rows, node_rows))
    return out


@click.command()
@click.argument("task")
@click.option("--attempt", type=int, metavar="N", help="Attempt number (default: the newest).")
@click.option("--rank", type=int, default=0, show_default=True, metavar="R",
              help="Rank of a multi-node task.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def stats(task, attempt, rank, as_json):
    """Peak and mean use of TASK's attempt (TASK or WORKFLOW/TASK): CPU (100% is one core),
    resident memory of its processes, and the utilisation and memory of the GPUs it held.
    Samples older than an hour are 1-minute means, so their peaks are means too.
    """
    state = open_state()
    err = console(stderr=True)
    s = task_stats(state, task, attempt, rank, note=lambda line: err.print(line, soft_wrap=True))
    if as_json:
        click.echo(dumps(s, indent=2, sort_keys=True))
        return
    con = console()
    con.print(f"{s['workflow']}/{s['task']} attempt {s['number']} on {s['node']} "
              f"({s['status']}): {s['samples']} samples", soft_wrap=True, highlight=False)
    if not s["samples"]:
        con.print("no utilisation samples (it ran shorter than one sampling interval, or "
                  "sampling was off: HYPER_SAMPLE_EVERY=0)")
        return

    def pm(v, fmt) -> str:
        return f"peak {fmt(v['peak'])}, mean {fmt(v['mean'])}" if v else "-"
    con.print(f"  cpu     {pm(s['cpu_pct'], _pct)}", highlight=False)
    con.print(f"  memory  {pm(s['rss'], _size)}", highlight=False)
    for i, g in sorted(s["gpus"].items(), key=lambda kv: int(kv[0])):
        con.print(f"  gpu {i}   utilisation {pm(g['util_pct'], _pct)}; memory "
                  f"{pm(g['mem_used_mib'], lambda m: _size(m * 2**20))}", highlight=False)
