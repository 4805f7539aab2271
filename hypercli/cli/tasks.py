"""``hyper ps``, ``results``, ``outputs``, ``logs`` and ``cancel``: a workflow's tasks, their
metrics, outputs and logs, read from the state file and the nodes.
"""

from __future__ import annotations

import sys
import time

import click

from hypercli.errors import HyperError

from hypercli.cli.common import (ago, console, duration, fmt, open_state, plural, print_json,
                                  text, when)


def _note(line: str) -> None:
    console(stderr=True).print(text(("note:", "yellow"), f" {line}"), soft_wrap=True)


def _from_controller(state, wid: str | None = None, *, usage: bool = False,
                     conns: dict | None = None, note=_note) -> None:
    """Copy here the records of the workflow ``wid`` (None: of every workflow) that a
    controller drives (hypercli.controller.client), with ``usage`` also its nodes'
    utilisation samples, over ``conns`` (controller name → connection, kept open for the
    next call: ``refresh_all``); nothing to do, and nothing imported, for the others."""
    wfs = [state.workflow(wid)] if wid else state.workflows()
    if not any((w.get("spec") or {}).get("controller") for w in wfs):
        return
    from hypercli.controller.client import refresh_all, refreshed
    if wid:
        refreshed(state, wid, note)
    else:
        refresh_all(state, note, usage=usage, conns=conns)


# -- workflows and tasks ------------------------------------------------------------------
@click.command()
@click.argument("workflow", required=False)
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ps(workflow, as_json):
    """List workflows, or the tasks of WORKFLOW (an id or a recipe name).

    When no `hyper run` drives a workflow that has not ended, says so and since when; with
    WORKFLOW, also asks its nodes what its running tasks do now (nothing is recorded),
    and shows each running task's CPU (100% is one core) and GPUs from its newest
    utilisation sample.
    """
    from hypercli.workflows import observe, task_times, undriven
    state = open_state()
    if workflow is None:
        _from_controller(state)  # workflows a controller drives: its records copied here
        rows = [{"workflow": w["id"], "status": w["status"], "cluster": w["cluster"],
                 "counts": state.counts(w["id"]), "created_at": w["created_at"]}
                for w in state.workflows()]
        if as_json:
            print_json(rows)
            return
        for r in rows:
            totals: dict = {}
            for c in r["counts"].values():
                for k, v in c.items():
                    totals[k] = totals.get(k, 0) + v
            counts = ", ".join(f"{v} {k}" for k, v in sorted(totals.items()))
            click.echo(f"{r['workflow']:<28} {r['status']:<10} {ago(r['created_at']):<10} "
                       f"{counts}")
            since = undriven(state, r["workflow"])
            if since is not None:
                click.echo(f"{'':<28} no `hyper run` drives it: states as of "
                           f"{when(since)}; `hyper ps {r['workflow']}` asks its nodes")
        if not rows:
            click.echo("no workflows yet; `hyper run RECIPE` starts one")
        return
    from hypercli.envvars import shown_env
    _from_controller(state, state.workflow(workflow)["id"])
    wf_row = state.workflow(workflow)
    wid = wf_row["id"]
    since = undriven(state, wid)
    observed = observe(state, wid) if since is not None else {}
    by_task: dict[str, list] = {}
    for a in state.attempts(wid):
        by_task.setdefault(a["task"], []).append(a)
    newest = {}  # task → the ranks of its newest attempt, rank 0 first
    for tid, rows_ in by_task.items():
        n = max(a["number"] for a in rows_)
        newest[tid] = sorted((a for a in rows_ if a["number"] == n), key=lambda a: a["rank"])
    live = {t: ranks[0] for t, ranks in newest.items()}  # rank 0, as `hyper stats` shows
    rows = [{"task": t["id"], "experiment": t["experiment"], "status": t["status"],
             "attempts": t["attempts"], "node": (live.get(t["id"]) or {}).get("node"),
             "nodes": [a["node"] for a in newest.get(t["id"], [])],
             "params": t["params"], "metrics": t["metrics"] or {},
             "waiting": t["wait"] if t["status"] == "pending" else None,
             "env": shown_env(wf_row, t)}  # a secret as ***
            for t in state.tasks(wid)]
    times = task_times(state, wid)
    fresh, node_gpus = time.time() - 60, {}
    for r in rows:
        a = live.get(r["task"])
        if r["status"] == "running" and a is not None:  # its newest utilisation sample
            s = state.samples(attempt=a["id"], since=fresh)
            if s:
                r["usage"] = u = {k: s[-1]["data"].get(k) for k in ("cpu_pct", "rss", "gpus")}
                if u["gpus"] and a["node"] not in node_gpus:
                    ns = state.samples(node=a["node"], nodes_only=True, since=fresh)
                    node_gpus[a["node"]] = {g.get("index"): g.get("util_pct") for g in (
                        ns[-1]["data"].get("gpus") or [] if ns else [])}
                u["gpu_util"] = {str(g): node_gpus.get(a["node"], {}).get(g)
                                 for g in u["gpus"] or []}
        if r["task"] in observed:
            r["observed"] = observed[r["task"]]  # what its node says now, not recorded
        start, end = times.get(r["task"], (None, None))
        r["started_at"], r["ended_at"] = start, end
        r["duration"] = round((end or time.time()) - start, 3) if start else None
    if as_json:
        print_json(rows)
        return
    if since is not None:
        wf = state.workflow(wid)
        console().print(text(("stale:", "yellow"), f" no `hyper run` drives {wid}; its states "
                             f"are as of the last update at {when(since)}. `hyper run "
                             f"{wf['recipe_path'] or wf['name']}` re-attaches and collects "
                             "what ended"), soft_wrap=True)
    from rich.table import Table
    table = Table(title=f"workflow {wid}", title_justify="left", box=None)
    for col in ("task", "status", "attempts", "node", "started", "duration", "cpu", "gpus",
                "params"):
        table.add_column(col, overflow="fold")
    for r in rows:
        params = " ".join(f"{k}={fmt(v)}" for k, v in r["params"].items())
        status = f"{r['status']} ({r['waiting']})" if r["waiting"] else r["status"]
        if r.get("observed") and r["observed"] != r["status"]:
            status += f" → {r['observed']}" + (" (not collected: `hyper run` collects it)"
                                               if r["observed"].startswith("exited") else "")
        started = time.strftime("%H:%M:%S", time.localtime(r["started_at"])) \
            if r["started_at"] else "-"
        u = r.get("usage") or {}
        cpu = f"{u['cpu_pct']:.0f}%" if isinstance(u.get("cpu_pct"), (int, float)) else "-"
        gpus = " ".join(f"{g}:{v:.0f}%" if isinstance(v, (int, float)) else f"{g}:-"
                        for g, v in (u.get("gpu_util") or {}).items()) or "-"
        table.add_row(r["task"], text(status), str(r["attempts"]),
                      ", ".join(r["nodes"]) or "-", started,
                      duration(r["duration"]), cpu, gpus, text(params))
    console().print(table)


@click.command()
@click.argument("workflow")
@click.option("--sort", "sort", metavar="METRIC", help="Metric to order by (default: the "
              "first one reported), largest first.")
@click.option("--ascending", is_flag=True, help="Smallest first (for losses).")
@click.option("--all", "show_all", is_flag=True,
              help="Also list tasks that did not report the metric (e.g. a report step).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list, one object per task.")
def results(workflow, sort, ascending, show_all, as_json):
    """Parameters and metrics of WORKFLOW's tasks, best first."""
    from hypercli.workflows import results as results_
    state = open_state()
    _from_controller(state, state.workflow(workflow)["id"])
    wid, metric, rows = results_(state, workflow, sort, ascending)
    if as_json:
        print_json([{k: r[k] for k in ("task", "experiment", "status", "params", "metrics")}
                     for r in rows])
        return
    from rich.table import Table
    hidden = 0
    if metric and not show_all:
        shown = [r for r in rows if metric in r["metrics"]]
        hidden, rows = len(rows) - len(shown), shown
    pnames = list(dict.fromkeys(k for r in rows for k in r["params"]))
    mnames = list(dict.fromkeys(k for r in rows for k in r["metrics"]))
    if metric in mnames:
        mnames.remove(metric)
        mnames.insert(0, metric)
    table = Table(title=f"workflow {wid}" + (f", by {metric}" if metric else ""),
                  title_justify="left")
    for col in ["task", "status", *pnames, *mnames]:
        table.add_column(text(col), justify="left" if col in ("task", "status") else "right",
                         style="bold" if col == metric else None)
    for r in rows:
        table.add_row(r["task"], r["status"],
                      *[text(fmt(r["params"].get(p, ""))) for p in pnames],
                      *[text(fmt(r["metrics"].get(m, ""))) for m in mnames])
    con = console()
    con.print(table)
    if hidden:
        con.print(text(f"{plural(hidden, 'task')} without {metric} not shown (--all shows "
                       "them)"))


@click.command()
@click.argument("workflow")
@click.argument("args", nargs=-1, metavar="[EXPERIMENT] DIR")
@click.option("--merge", is_flag=True,
              help="Also concatenate files of the same name, in task order, into DIR.")
@click.option("--jobs", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Tasks pulled at once.")
def outputs(workflow, args, merge, jobs):
    """Pull the outputs of WORKFLOW's successful tasks (or EXPERIMENT's) into DIR/TASK/.

    Every file is checked; a second run pulls only what changed. Only what hypercli wrote
    in DIR is ever replaced (DIR/.hyper-outputs.json keeps the list): anything else in the
    way is named, and nothing is pulled.
    """
    from hypercli.errors import UsageError
    from hypercli.gather import gather
    if len(args) not in (1, 2):
        raise UsageError("give DIR, or EXPERIMENT and DIR",
                         "hyper outputs WORKFLOW [EXPERIMENT] DIR")
    experiment, dest = (None, args[0]) if len(args) == 1 else args
    state = open_state()
    _from_controller(state, state.workflow(workflow)["id"])
    wid, r = gather(state, workflow, dest, experiment=experiment, merge=merge, jobs=jobs)
    click.echo(f"{wid}: {plural(len(r.pulled), 'task output')} pulled ({r.bytes / 1e6:.1f} MB), "
               f"{len(r.kept)} already there, into {dest}")
    for rel in r.merged:
        click.echo(f"merged {rel}")
    err = console(stderr=True)
    for line in r.not_merged:
        err.print(text(("not merged:", "yellow"), f" {line}"), soft_wrap=True)


@click.command()
@click.argument("task")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the attempt ends.")
@click.option("--attempt", type=int, metavar="N", help="Attempt number (default: the newest).")
@click.option("--rank", type=int, default=0, show_default=True, metavar="R",
              help="Rank of a multi-node task.")
def logs(task, follow, attempt, rank):
    """Print the output of TASK (search-0007, or WORKFLOW/search-0007 when several
    workflows have that task): its stdout and stderr lines in the order they came, each on
    its own stream."""
    from hypercli.workflows import log_chunks, pick_attempt, resolve_task
    state = open_state()
    err_con = console(stderr=True)
    try:  # a workflow a controller drives: its records first
        _from_controller(state, resolve_task(state, task)[0])
    except HyperError:
        pass  # an unknown task is said by pick_attempt below
    a = pick_attempt(state, task, attempt, rank,
                     note=lambda line: err_con.print(text(("note:", "dim"), f" {line}"),
                                                     soft_wrap=True))
    out, err = sys.stdout.buffer, sys.stderr.buffer
    try:
        for stream, data in log_chunks(state, a, follow=follow, note=lambda line: err_con.print(
                text(("note:", "yellow"), f" {line}"), soft_wrap=True)):
            f = out if stream == "stdout" else err
            f.write(data)
            f.flush()
    except KeyboardInterrupt:
        pass


@click.command()
@click.argument("target")
def cancel(target):
    """Cancel a workflow (id or recipe name) or one task (WORKFLOW/TASK)."""
    from hypercli.workflows import cancel as cancel_
    state = open_state()
    wf = state.workflow(target.rsplit("/", 1)[0] if "/" in target else target)
    done = None
    if (wf.get("spec") or {}).get("controller"):  # a controller drives it: cancelled there
        from hypercli.controller.client import cancel as on_controller
        done = on_controller(state, target)
    what, n = done if done is not None else cancel_(state, target)
    click.echo(f"cancelled {what} ({plural(n, 'task')})")
