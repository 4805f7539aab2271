"""The ``hyper`` command line: each command parses, calls one library function, renders.

This is the only module that imports click and the only place where a HyperError becomes a
message and an exit code (0 all tasks succeeded, 1 some task failed, 2 bad input,
3 infrastructure error, 130 interrupted with tasks left running).
"""

from __future__ import annotations

import json
import sys
import time

import click

from hypercli import __version__
from hypercli.errors import HyperError


def _state():
    from hypercli.driver import ensure
    from hypercli.state import State
    state = State()
    ensure(state)  # detached workflows with no driver alive: start one
    return state


from hypercli.console import console as _console  # noqa: E402
from hypercli.console import plural  # noqa: E402


class HyperGroup(click.Group):
    """Turns HyperErrors into a one-line message, a hint and the error's exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HyperError as e:
            err = _console(stderr=True)
            err.print(f"[bold red]error:[/] {e}", markup=True, soft_wrap=True)
            if e.hint:
                err.print(f"[dim]hint:[/] {e.hint}", soft_wrap=True)
            ctx.exit(e.exit_code)


@click.group(cls=HyperGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hyper")
def cli():
    """Run recipes of container tasks on spot VMs, SSH hosts or this machine."""


def _print_json(obj) -> None:
    click.echo(json.dumps(obj, indent=2, ensure_ascii=False, default=str))


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def _ago(t: float | None) -> str:
    if not t:
        return "-"
    s = time.time() - t
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else \
        f"{s / 3600:.1f}h ago"


def _duration(s: float | None) -> str:
    """``-``, ``4.2s``, ``42s``, ``3m05s``, ``2h07m``."""
    if s is None:
        return "-"
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else \
        f"{s // 3600}h{s % 3600 // 60:02d}m"


def _when(t: float) -> str:
    """A time of day (with the date when not today) and how long ago."""
    fmt = "%H:%M:%S" if time.localtime(t)[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M:%S"
    return f"{time.strftime(fmt, time.localtime(t))} ({_ago(t)})"


# -- plan ---------------------------------------------------------------------------------
@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the tasks as JSON.")
def plan(recipe, as_json):
    """Show the tasks RECIPE would run, without running anything."""
    from hypercli.workflows import load
    r, wf = load(recipe)
    if as_json:
        _print_json([{"task": t.id, "experiment": t.experiment, "params": t.params,
                      "command": t.command} for t in wf.tasks])
        return
    from rich.table import Table
    con = _console()
    con.print(f"recipe [bold]{r.name}[/]: {plural(len(wf.tasks), 'task')} in "
              f"{plural(len(wf.experiments), 'experiment')}, cluster {r.cluster.name} "
              f"({r.cluster.provider})")
    for e in wf.experiments:
        after = f" after {', '.join(e.after)}" if e.after else ""
        con.print(f"[bold]{e.name}[/]: {plural(e.tasks, 'task')}, retries {e.retries}{after}")
    table = Table(box=None)
    for col in ("task", "command"):
        table.add_column(col, overflow="fold")
    for t in wf.tasks[:200]:
        table.add_row(t.id, t.command)
    con.print(table)
    if len(wf.tasks) > 200:
        con.print(f"… and {len(wf.tasks) - 200} more (use --json for all)")


# -- run ----------------------------------------------------------------------------------
def _progress_table(sched):
    from rich.table import Table
    t = Table(title=f"workflow {sched.wid}  ·  {time.time() - sched.started:.0f}s",
              title_justify="left")
    snap = sched.snapshot()
    # skipped and cancelled tasks did not fail: columns of their own, when there are any
    extra = [s for s in ("skipped", "cancelled") if any(c.get(s) for c in snap.values())]
    cols = ("running", "pending", "failed", *extra)
    for col in ("experiment", "done", *cols, "total"):
        t.add_column(col, justify="right" if col != "experiment" else "left")
    for exp, c in snap.items():
        t.add_row(exp, str(c.get("succeeded", 0)), *[str(c.get(col, 0)) for col in cols],
                  str(sum(c.values())))
    return t


def _line(sched) -> str:
    parts = []
    for exp, c in sched.snapshot().items():
        part = (f"{exp} {c.get('succeeded', 0)}/{sum(c.values())} done, "
                f"{c.get('running', 0)} running, {c.get('failed', 0)} failed")
        for s in ("skipped", "cancelled"):  # not failures: counted apart
            if c.get(s):
                part += f", {c[s]} {s}"
        parts.append(part)
    return f"[{time.time() - sched.started:5.0f}s] " + "; ".join(parts)


class _LeaveNow(BaseException):
    """A second Ctrl-C, SIGTERM or SIGHUP while the interrupt question is asked."""


def _ask_leave_or_cancel() -> str:
    """Ask, after Ctrl-C, whether to leave the tasks running or cancel them. A second Ctrl-C,
    SIGTERM or SIGHUP (the terminal closing) answers "leave", the safe answer, at once; so
    does the end of input."""
    import signal

    def restore():
        for s, h in old.items():
            signal.signal(s, h)

    def leave_now(signum, frame):
        restore()  # a third signal is only noted by the run loop
        raise _LeaveNow()
    old = {s: signal.signal(s, leave_now) for s in (signal.SIGINT, signal.SIGTERM,
                                                      signal.SIGHUP)}
    try:
        return click.prompt("\ninterrupted: leave the tasks running or cancel them?",
                            type=click.Choice(["leave", "cancel"]), default="leave")
    except (_LeaveNow, click.Abort):
        restore()
        try:
            click.echo("\nleaving the tasks running")
        except OSError:  # the terminal is gone (SIGHUP)
            pass
        return "leave"
    finally:
        restore()


@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--new", is_flag=True, help="Start a new workflow even if one can be resumed.")
@click.option("--on-interrupt", type=click.Choice(["ask", "leave", "cancel"]), default="ask",
              show_default=True,
              help="What Ctrl-C does: ask, leave the tasks running, or cancel them.")
@click.option("--trust-new-hosts", is_flag=True,
              help="Pin the host key of SSH hosts seen for the first time (check them first).")
@click.option("--cluster", metavar="NAME",
              help="Run on this cluster as it is (from `hyper up`), not the recipe's.")
@click.option("-d", "--detach", is_flag=True,
              help="Hand the workflow to the background driver and return at once.")
@click.option("--wait", is_flag=True,
              help="As --detach, then wait for the end and exit with its result (for CI).")
def run(recipe, new, on_interrupt, trust_new_hosts, cluster, detach, wait):
    """Run RECIPE's workflow to its end (resuming an unfinished one), with live progress.

    Ctrl-C asks whether to leave the tasks running (the background driver goes on
    scheduling them; `hyper attach` shows them again) or to cancel them.
    """
    from hypercli.scheduler import Scheduler
    from hypercli.workflows import Driven, prepare_run
    state = _state()
    con = _console()
    err = _console(stderr=True)
    try:
        wid, resumed, provider, nodes, lock = prepare_run(
            state, recipe, new=new, trust_new_hosts=trust_new_hosts, cluster=cluster,
            log=con.print, report=lambda line: err.print(f"[yellow]not up:[/] {line}",
                                                         soft_wrap=True))
    except Driven as e:
        from hypercli.driver import driver_pid
        if str(driver_pid()) != e.pid:
            raise
        con.print(f"{e.workflow} is run by the background driver (pid {e.pid}): attaching")
        sys.exit(_attach(state, e.workflow))
    if detach or wait:
        from hypercli.driver import detach as detach_
        lock.release()
        pid = detach_(state, wid)
        if wait:
            sys.exit(_attach(state, wid))
        con.print(f"{wid} runs in the background (driver pid {pid}); `hyper attach {wid}` "
                  f"shows it, `hyper cancel {wid}` stops it")
        return
    live = None
    if con.is_terminal:
        from rich.live import Live
        live = Live(console=con, refresh_per_second=4, transient=False)
        live.start()
    last = [0.0, ""]
    shown = [0]  # scheduler notices printed so far

    def progress(sched):
        from rich.markup import escape
        for note in sched.notices[shown[0]:]:  # idle GPUs, full disks, OOM kills
            con.print(f"[yellow]warning:[/] {escape(note)}", soft_wrap=True, highlight=False)
        shown[0] = len(sched.notices)
        if live is not None:
            live.update(_progress_table(sched))
            return
        line = _line(sched)
        if line.split("] ", 1)[1] != last[1] and time.time() - last[0] > 2 or sched._done():
            last[:] = [time.time(), line.split("] ", 1)[1]]
            con.print(line)

    def ask() -> str:
        if live is not None:
            live.stop()
        if on_interrupt != "ask":
            return on_interrupt
        if not sys.stdin.isatty():
            return "leave"
        return _ask_leave_or_cancel()

    try:
        summary = Scheduler(state, wid, provider, nodes, on_interrupt=ask).run(progress)
    finally:
        if live is not None:
            live.stop()
        lock.release()
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.counts.items()))
    if summary.interrupted == "leave":
        from hypercli.driver import detach as detach_
        pid = detach_(state, wid)  # the background driver goes on scheduling its tasks
        try:
            con.print(f"left {wid} running ({counts}), handed to the background driver "
                      f"(pid {pid}); `hyper attach {wid}` shows it, `hyper cancel {wid}` "
                      "stops it")
        except OSError:  # the terminal is gone (SIGHUP)
            pass
    else:
        con.print(f"workflow {wid}: {counts}")
        if summary.exit_code == 0:
            con.print(f"`hyper results {wid}` shows the metrics")
        else:
            _show_failure(state, wid, con)
            con.print(f"`hyper ps {wid}` and `hyper logs {wid}/TASK` show what failed")
    sys.exit(summary.exit_code)


def _show_failure(state, wid: str, con, lines: int = 10) -> None:
    """After a failed run: the failed tasks, and the last ``lines`` lines of the first
    failure's stderr."""
    from rich.markup import escape

    from hypercli.workflows import failure
    try:
        failed, attempt, tail = failure(state, wid, lines=lines)
    except HyperError:  # its logs cannot be read: the names are enough
        failed, attempt, tail = [t["id"] for t in state.tasks(wid, status=["failed"])], None, []
    if not failed:
        return
    shown = ", ".join(failed[:20]) + (f", … ({len(failed)} in all)" if len(failed) > 20 else "")
    con.print(f"[bold red]failed:[/] {escape(shown)}", soft_wrap=True)
    if attempt is not None and tail:
        con.print(f"last {plural(len(tail), 'line')} of {attempt['task']}'s stderr (attempt "
                  f"{attempt['number']}, exit code {attempt['exit_code']}):")
        for line in tail:
            con.print(f"  {escape(line)}", soft_wrap=True, highlight=False)
    elif attempt is not None:
        why = attempt["error"] or f"exit code {attempt['exit_code']}"
        con.print(f"{attempt['task']} wrote nothing on stderr (attempt {attempt['number']}: "
                  f"{escape(str(why))})", soft_wrap=True)


class _View:
    """The progress displays' view of a workflow read from the state file (``hyper
    attach``), shaped as the Scheduler they are given during ``hyper run``."""

    def __init__(self, state, wid: str):
        self.state, self.wid = state, wid
        self.started = state.workflow(wid)["created_at"]

    def snapshot(self) -> dict:
        return self.state.counts(self.wid)

    def _done(self) -> bool:
        return self.state.workflow(self.wid)["status"] not in ("running", "cancelling")


def _attach(state, wid: str, interval: float = 0.5) -> int:
    """Show a workflow's progress from the state file until it ends; returns the exit code
    (0 all succeeded, 1 not, 130 when Ctrl-C stops watching)."""
    from hypercli.driver import ensure
    view = _View(state, wid)
    con = _console()
    last = ""
    try:
        while True:
            ensure(state)  # a driver that died is started again
            done = view._done()
            line = _line(view)
            if line.split("] ", 1)[1] != last or done:
                last = line.split("] ", 1)[1]
                con.print(line)
            if done:
                break
            time.sleep(interval)
    except KeyboardInterrupt:
        con.print(f"stopped watching; {wid} goes on (`hyper attach {wid}`)")
        return 130
    wf = state.workflow(wid)
    con.print(f"workflow {wid}: {wf['status']}")
    return 0 if wf["status"] == "succeeded" else 1


@cli.command()
@click.argument("workflow")
def attach(workflow):
    """Show the live progress of WORKFLOW (run in the background or by another `hyper run`)
    until it ends; exit 0 when every task succeeded. Ctrl-C stops watching only."""
    state = _state()
    sys.exit(_attach(state, state.workflow(workflow)["id"]))


# -- clusters -----------------------------------------------------------------------------
@cli.command()
@click.argument("recipe", type=click.Path(dir_okay=False), required=False)
@click.option("--provider", type=click.Choice(["local", "ssh"]),
              help="Without RECIPE: the provider of the cluster to bring up (cloud clusters "
                   "come from a recipe's cluster:).")
@click.option("--host", "hosts", multiple=True, metavar="[USER@]HOST[:PORT]",
              help="Without RECIPE: an SSH host (repeat for more).")
@click.option("--identity-file", type=click.Path(dir_okay=False),
              help="Without RECIPE: the SSH private key.")
@click.option("--user", help="Without RECIPE: the SSH user where a host names none.")
@click.option("--workers", type=int, help="Without RECIPE: number of local worker slots.")
@click.option("--name", default="default", show_default=True,
              help="Without RECIPE: the cluster's name.")
@click.option("--trust-new-hosts", is_flag=True,
              help="Pin the host key of SSH hosts seen for the first time (check them first).")
@click.option("--dry-run", is_flag=True,
              help="Cloud clusters: show what would be created and its price; create nothing.")
@click.option("--bootstrap", is_flag=True,
              help="Then run the node image's provisioning on every node over SSH "
                   "(hosts without the baked image; idempotent).")
@click.option("--offline", is_flag=True,
              help="With --bootstrap: skip the steps that download (packages, docker, "
                   "NVIDIA, goofys, pre-pulled images).")
def up(recipe, provider, hosts, identity_file, user, workers, name, trust_new_hosts, dry_run,
       bootstrap, offline):
    """Bring up the cluster of RECIPE, or one given by options (no tasks are run)."""
    from hypercli.errors import UsageError
    from hypercli.workflows import cluster_spec
    from hypercli.workflows import up as up_
    if recipe:
        from hypercli.recipe import load_recipe
        spec = load_recipe(recipe).cluster
        if dry_run:
            from hypercli.cluster import dry_run as dry_run_
            p = dry_run_(spec)
            kind = "spot" if p["spot"] else "on-demand"
            click.echo(f"cluster {p['cluster']} ({p['provider']} {p['region'] or 'default region'}"
                       f"): {p['running']} running, {p['to_create']} to create, "
                       f"{p['instance_type']} {kind}")
            for zone, price in sorted(p["zone_prices"].items(), key=lambda kv: kv[1]):
                click.echo(f"  {zone:<16} ${price:.4f}/h")
            if p["cost_per_hour"] is None:
                click.echo("  price: not available from this provider's API")
            else:
                click.echo(f"estimated cost: ${p['cost_per_hour']:.4f}/h for the whole cluster "
                           f"(cheapest zone, {plural(p['running'] + p['to_create'], 'node')})")
            return
    elif dry_run:
        raise UsageError("--dry-run needs a RECIPE with a cloud cluster")
    elif provider:
        spec = cluster_spec(name, provider, list(hosts), workers=workers,
                            identity_file=identity_file, user=user)
    else:
        raise UsageError("give a RECIPE or --provider", "e.g. `hyper up --provider ssh "
                         "--host root@10.0.0.5 --identity-file ~/.ssh/id_ed25519`")
    err = _console(stderr=True)
    nodes = up_(_state(), spec, trust_new_hosts=trust_new_hosts,
                log=lambda line: err.print(f"[yellow]not up:[/] {line}", soft_wrap=True))
    click.echo(f"cluster {spec.name} is up: {plural(len(nodes), spec.provider + ' node')}")
    for n in nodes:
        click.echo(f"  {n['name']}  {n['provider_id']}  {_node_facts(n['info'], spec.provider)}")
    if bootstrap:
        from hypercli.workflows import bootstrap_nodes
        for node, lines in bootstrap_nodes(_state(), spec, nodes, offline=offline).items():
            for line in lines:
                click.echo(f"  {node}: {line}")


def _node_facts(info: dict, provider: str) -> str:
    """What a node holds, as its bootstrap measured it (a local node: its share of this
    machine)."""
    cpus = info.get("cpus")
    gpus = info.get("gpus") or []
    facts = [plural(cpus, "CPU") if isinstance(cpus, int) else f"{cpus or '?'} CPUs",
             f"{info.get('memory_bytes', 0) / 2**30:.1f} GiB"]
    if provider != "local":
        facts.append(f"{info.get('disk_free_bytes', 0) / 2**30:.0f} GiB free")
    facts.append(plural(len(gpus), "GPU") + (
        f" ({', '.join(str(g.get('name', g.get('index'))) for g in gpus)})" if gpus else ""))
    if provider == "local":
        facts.append(f"a share of this machine's {plural(info.get('machine_cpus') or 0, 'CPU')}")
    else:
        facts.append(f"docker: {'yes' if info.get('docker') else 'no'}")
    return ", ".join(facts)


@cli.command()
@click.argument("cluster")
@click.option("-y", "--yes", is_flag=True,
              help="Cancel the cluster's running workflows without asking.")
def down(cluster, yes):
    """Take CLUSTER down: cancel its tasks and remove its nodes.

    With workflows still running on it, asks first on a terminal; elsewhere refuses unless
    --yes is given.
    """
    from hypercli.cluster import down as down_
    from hypercli.cluster import work_on
    from hypercli.errors import UsageError
    state = _state()
    if state.cluster(cluster) is not None and state.cluster(cluster)["status"] == "up":
        work = work_on(state, cluster)
        if work and not yes:
            what = "; ".join(f"{w['workflow']} ({w['running']} running, {w['pending']} "
                             "pending)" for w in work)
            text = (f"cluster {cluster} has {plural(len(work), 'workflow')} not ended: "
                    f"{what}; taking it down cancels them")
            if not sys.stdin.isatty():
                raise UsageError(text, f"`hyper down {cluster} --yes` cancels them and takes "
                                 "it down")
            if not click.confirm(f"{text}. Go on?", default=False):
                raise UsageError(f"cluster {cluster} left up")
    removed = down_(state, cluster)
    for line in removed:
        click.echo(f"removed {line}")
    click.echo(f"cluster {cluster} is down")


@cli.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def check(as_json):
    """Show which cloud providers are ready (SDK installed, credentials accepted)."""
    from hypercli.cluster import check as check_
    rows = check_()
    if as_json:
        _print_json(rows)
        return
    for r in rows:
        mark = "ready" if r["ready"] else "not ready"
        click.echo(f"{r['provider']:<6} {mark:<10} {r['detail']}")
        if r["hint"]:
            click.echo(f"{'':<17} hint: {r['hint']}")


@cli.command()
@click.option("--provider", type=click.Choice(["aws", "gcp", "azure"]), required=True)
@click.option("--region", help="Region to clean (default: the SDK's configured one).")
@click.option("--project", help="GCP project.")
@click.option("--subscription", help="Azure subscription id.")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
def gc(provider, region, project, subscription, dry_run):
    """Remove every hyper:* resource in the cloud that no cluster that is up owns."""
    from hypercli.cluster import gc as gc_
    options = {k: v for k, v in (("region", region), ("project", project),
                                 ("subscription_id", subscription)) if v}
    lines = gc_(_state(), provider, options, dry_run=dry_run)
    for line in lines:
        click.echo(f"{'orphan' if dry_run else 'removed'} {line}")
    click.echo(f"{plural(len(lines), 'orphan')} found" if dry_run else
               f"{plural(len(lines), 'resource')} removed")


@cli.command()
@click.argument("cluster", required=False)
@click.option("--all", "show_all", is_flag=True, help="Also the clusters that are down.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(cluster, show_all, as_json):
    """Show clusters and their nodes (the clusters that are not down, or CLUSTER)."""
    state = _state()
    clusters = [c for c in state.clusters() if cluster in (None, c["name"])]
    if cluster and not clusters:
        from hypercli.errors import UsageError
        raise UsageError(f"no cluster named {cluster!r}", "`hyper status --all` lists them")
    hidden = 0
    if not cluster and not show_all:
        shown = [c for c in clusters if c["status"] != "down"]
        hidden, clusters = len(clusters) - len(shown), shown
    out = [{"cluster": c["name"], "provider": c["provider"], "status": c["status"],
            "nodes": [{"name": n["name"], "status": n["status"], "slots": n["slots"],
                       "provider_id": n["provider_id"]} for n in state.nodes(c["name"])]}
           for c in clusters]
    if as_json:
        _print_json(out)
        return
    if not out and not hidden:
        click.echo("no clusters; `hyper up RECIPE` or `hyper run RECIPE` creates one")
    for c in out:
        up_nodes = sum(n["status"] == "up" for n in c["nodes"])
        click.echo(f"{c['cluster']}  {c['provider']}  {c['status']}  "
                   f"{up_nodes}/{len(c['nodes'])} nodes up")
        for n in c["nodes"]:
            click.echo(f"  {n['name']:<24} {n['status']:<6} slots {n['slots']}  "
                       f"{n['provider_id'] or ''}")
    if hidden:
        click.echo(f"{plural(hidden, 'cluster that is down', 'clusters that are down')} not "
                   f"shown (--all shows {'it' if hidden == 1 else 'them'}; `hyper forget "
                   "CLUSTER` removes one from the state file)")


@cli.command()
@click.argument("cluster")
def forget(cluster):
    """Remove CLUSTER, which must be down, and its nodes from the state file; the records
    of its workflows are kept."""
    from hypercli.workflows import forget as forget_
    n = forget_(_state(), cluster)
    click.echo(f"forgot cluster {cluster} ({plural(n, 'node')})")


# -- workflows and tasks ------------------------------------------------------------------
@cli.command()
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
    state = _state()
    if workflow is None:
        rows = [{"workflow": w["id"], "status": w["status"], "cluster": w["cluster"],
                 "counts": state.counts(w["id"]), "created_at": w["created_at"]}
                for w in state.workflows()]
        if as_json:
            _print_json(rows)
            return
        for r in rows:
            totals: dict = {}
            for c in r["counts"].values():
                for k, v in c.items():
                    totals[k] = totals.get(k, 0) + v
            counts = ", ".join(f"{v} {k}" for k, v in sorted(totals.items()))
            click.echo(f"{r['workflow']:<28} {r['status']:<10} {_ago(r['created_at']):<10} "
                       f"{counts}")
            since = undriven(state, r["workflow"])
            if since is not None:
                click.echo(f"{'':<28} no `hyper run` drives it: states as of "
                           f"{_when(since)}; `hyper ps {r['workflow']}` asks its nodes")
        if not rows:
            click.echo("no workflows yet; `hyper run RECIPE` starts one")
        return
    wid = state.workflow(workflow)["id"]
    since = undriven(state, wid)
    observed = observe(state, wid) if since is not None else {}
    live = {a["task"]: a for a in state.attempts(wid)}
    rows = [{"task": t["id"], "experiment": t["experiment"], "status": t["status"],
             "attempts": t["attempts"], "node": (live.get(t["id"]) or {}).get("node"),
             "params": t["params"], "metrics": t["metrics"] or {},
             "waiting": t["wait"] if t["status"] == "pending" else None}
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
        _print_json(rows)
        return
    if since is not None:
        wf = state.workflow(wid)
        from rich.markup import escape
        _console().print(f"[yellow]stale:[/] no `hyper run` drives {wid}; its states are as "
                         f"of the last update at {_when(since)}. `hyper run "
                         f"{escape(wf['recipe_path'] or wf['name'])}` re-attaches and "
                         "collects what ended", soft_wrap=True)
    from rich.table import Table
    table = Table(title=f"workflow {wid}", title_justify="left", box=None)
    for col in ("task", "status", "attempts", "node", "started", "duration", "cpu", "gpus",
                "params"):
        table.add_column(col, overflow="fold")
    for r in rows:
        params = " ".join(f"{k}={_fmt(v)}" for k, v in r["params"].items())
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
        table.add_row(r["task"], status, str(r["attempts"]), r["node"] or "-", started,
                      _duration(r["duration"]), cpu, gpus, params)
    _console().print(table)


@cli.command()
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
    wid, metric, rows = results_(_state(), workflow, sort, ascending)
    if as_json:
        _print_json([{k: r[k] for k in ("task", "experiment", "status", "params", "metrics")}
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
        table.add_column(col, justify="left" if col in ("task", "status") else "right",
                         style="bold" if col == metric else None)
    for r in rows:
        table.add_row(r["task"], r["status"], *[_fmt(r["params"].get(p, "")) for p in pnames],
                      *[_fmt(r["metrics"].get(m, "")) for m in mnames])
    con = _console()
    con.print(table)
    if hidden:
        con.print(f"{plural(hidden, 'task')} without {metric} not shown (--all shows them)")


@cli.command()
@click.argument("workflow")
@click.argument("args", nargs=-1, metavar="[EXPERIMENT] DIR")
@click.option("--merge", is_flag=True,
              help="Also concatenate files of the same name, in task order, into DIR.")
@click.option("--jobs", type=click.IntRange(1, 64), default=8, show_default=True,
              help="Tasks pulled at once.")
def outputs(workflow, args, merge, jobs):
    """Pull the outputs of WORKFLOW's successful tasks (or EXPERIMENT's) into DIR/TASK/.

    Every file is checked; a second run pulls only what changed.
    """
    from hypercli.errors import UsageError
    from hypercli.gather import gather
    if len(args) not in (1, 2):
        raise UsageError("give DIR, or EXPERIMENT and DIR",
                         "hyper outputs WORKFLOW [EXPERIMENT] DIR")
    experiment, dest = (None, args[0]) if len(args) == 1 else args
    wid, r = gather(_state(), workflow, dest, experiment=experiment, merge=merge, jobs=jobs)
    click.echo(f"{wid}: {plural(len(r.pulled), 'task output')} pulled ({r.bytes / 1e6:.1f} MB), "
               f"{len(r.kept)} already there, into {dest}")
    for rel in r.merged:
        click.echo(f"merged {rel}")


@cli.command()
@click.argument("task")
@click.option("-f", "--follow", is_flag=True, help="Keep streaming until the attempt ends.")
@click.option("--attempt", type=int, metavar="N", help="Attempt number (default: the newest).")
@click.option("--rank", type=int, default=0, show_default=True, metavar="R",
              help="Rank of a multi-node task.")
def logs(task, follow, attempt, rank):
    """Print the output of TASK (search-0007, or WORKFLOW/search-0007 when several
    workflows have that task)."""
    from rich.markup import escape

    from hypercli.workflows import log_chunks, pick_attempt
    state = _state()
    err_con = _console(stderr=True)
    a = pick_attempt(state, task, attempt, rank,
                     note=lambda line: err_con.print(f"[dim]note:[/] {escape(line)}",
                                                     soft_wrap=True))
    out, err = sys.stdout.buffer, sys.stderr.buffer
    try:
        for stream, data in log_chunks(state, a, follow=follow):
            f = out if stream == "stdout" else err
            f.write(data)
            f.flush()
    except KeyboardInterrupt:
        pass


@cli.command()
@click.argument("target")
def cancel(target):
    """Cancel a workflow (id or recipe name) or one task (WORKFLOW/TASK)."""
    from hypercli.workflows import cancel as cancel_
    what, n = cancel_(_state(), target)
    click.echo(f"cancelled {what} ({plural(n, 'task')})")


from hypercli.cli_data import data  # noqa: E402  (hyper data push/ls/pull/verify/mount)

cli.add_command(data)

from hypercli.cli_image import image  # noqa: E402  (hyper image build/ls)

cli.add_command(image)

from hypercli.cli_cluster import exec_, ssh, ssh_config  # noqa: E402  (hyper exec/ssh)

for _command in (exec_, ssh, ssh_config):
    cli.add_command(_command)

from hypercli.cli_ui import ui  # noqa: E402  (hyper ui)

cli.add_command(ui)

from hypercli.cli_usage import stats, top  # noqa: E402  (hyper top/stats)

for _command in (top, stats):
    cli.add_command(_command)


def main() -> None:
    """Entry point of the ``hyper`` console script."""
    cli(prog_name="hyper")
