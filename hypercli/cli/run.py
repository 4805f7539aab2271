"""``hyper plan``, ``hyper run`` and ``hyper attach``: a recipe's workflow planned, run with
live progress, and watched again from the state file.
"""

from __future__ import annotations

import sys
import time

import click

from hypercli.cli.common import console, open_state, plural, print_json, text
from hypercli.errors import HyperError, UsageError


def env_options(f):
    """``--env NAME[=VALUE]`` and ``--env-file FILE``, both repeatable
    (:mod:`hypercli.envvars`)."""
    f = click.option("--env-file", "env_files", multiple=True, metavar="FILE",
                     type=click.Path(dir_okay=False),
                     help="Variables for every task from a dotenv file (repeatable; later "
                          "files win).")(f)
    return click.option("--env", "env", multiple=True, metavar="NAME[=VALUE]",
                        help="A variable for every task, over the recipe's env: and "
                             "--env-file; NAME alone takes this shell's value (repeatable)."
                        )(f)


# -- plan ---------------------------------------------------------------------------------
@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the tasks as JSON.")
@env_options
def plan(recipe, as_json, env, env_files):
    """Show the tasks RECIPE would run, without running anything (a secret's value is shown
    as ***)."""
    from hypercli.envvars import masked
    from hypercli.workflows import load
    r, wf = load(recipe, env, env_files, offer=False)  # the machines are shown below, all of them
    hidden = {e.name: e.secrets for e in wf.experiments}
    if as_json:
        print_json([{"task": t.id, "experiment": t.experiment, "params": t.params,
                      "command": t.command, "env": masked(t.env, hidden[t.experiment])}
                    for t in wf.tasks])
        return
    from rich.table import Table
    con = console()
    con.print(text("recipe ", (r.name, "bold"), f": {plural(len(wf.tasks), 'task')} in "
                   f"{plural(len(wf.experiments), 'experiment')}, cluster {r.cluster.name} "
                   f"({r.cluster.provider})"))
    for e in wf.experiments:
        after = f" after {', '.join(e.after)}" if e.after else ""
        con.print(text((e.name, "bold"), f": {plural(e.tasks, 'task')}, retries {e.retries}"
                       f"{after}"))
        first = next((t for t in wf.tasks if t.experiment == e.name), None)
        shown = masked(first.env if first else {}, e.secrets)
        if shown:
            con.print(text("  env: " + " ".join(f"{k}={v}" for k, v in sorted(shown.items()))),
                      soft_wrap=True)
    table = Table(box=None)
    for col in ("task", "command"):
        table.add_column(col, overflow="fold")
    for t in wf.tasks[:200]:
        table.add_row(text(t.id), text(t.command))
    con.print(table)
    if len(wf.tasks) > 200:
        con.print(f"… and {len(wf.tasks) - 200} more (use --json for all)")
    _plan_machines(con, r, wf)


def _price_note(catalog, offer) -> str:
    """`` (illustrative price)`` and the like after an offer whose price is not one read from
    the clouds' APIs (hypercli.offers.catalog.Catalog.price_source); empty for those."""
    label = catalog.price_source(offer)
    return "" if label == "api" else f" ({PRICE_WORDS.get(label, label)} price)"


#: how `hyper plan` and `hyper offers` name a price source (Catalog.price_source)
PRICE_WORDS = {"public": "public catalog", "illustrative": "illustrative", "custom": "custom"}


def _plan_machines(con, r, wf) -> None:
    """The optimizer's choice per experiment, its alternatives and the workflow's estimate
    (cloud recipes only; hypercli.offers.estimate.plan_recipe)."""
    from hypercli.offers.estimate import plan_recipe
    from hypercli.state import State
    machines = plan_recipe(r, wf, State())
    if not machines:
        return
    total, known = 0.0, True
    con.print(text(("machines", "bold"), " (cheapest offer first, $ per node-hour):"))
    for c in machines["choices"]:
        if not c.offers:
            known = False
            con.print(text((c.experiment, "bold"), f" [{c.shape.describe()}]: ",
                           (c.note or "", "yellow")))
            continue
        best = c.offers[0]
        nodes = f" × {c.shape.nodes} nodes" if c.shape.nodes > 1 else ""
        con.print(text((c.experiment, "bold"), f" [{c.shape.describe()}]: ",
                       (best.describe(), "green"), nodes,
                       (_price_note(machines["catalog"], best), "dim")))
        for alt in c.offers[1:]:
            con.print(text(f"    then {alt.describe()}",
                           (_price_note(machines["catalog"], alt), "dim")))
        if c.cost is None:
            known = False
            con.print(text(("    no estimate", "dim"), ": give minutes: (one task's minutes)"))
        else:
            total += c.cost
            con.print(text(f"    {c.tasks} tasks × {c.minutes:.3g} min "
                           f"({machines['minutes_from'][c.experiment]}) = "
                           f"{c.node_hours:.3g} node-hours ≈ ${c.cost:.2f}"))
    if known:
        con.print(text(("estimate", "bold"), f": ${total:.2f} for the workflow"))
    from hypercli.offers import pools
    if pools.wants_pools(r, State()):
        con.print(text(("pools", "bold"), " (one per resource shape, each launched when its "
                       "experiments have ready tasks, terminated when idle):"))
        for p in pools.plan(r, {e.name: e.tasks for e in wf.experiments}):
            con.print(text((p.name, "bold"), f" ({', '.join(p.experiments)}) "
                           f"[{p.shape.describe()}]: ", (p.offers[0].describe(), "green"),
                           f", at most {plural(p.cap, 'node')}, idle limit "
                           f"{p.idle_s / 60:g} min"))
    for cloud in machines["stale"]:
        con.print(text(("note:", "dim"), f" the {cloud} catalog is older than a week: "
                       f"`hyper catalog refresh --cloud {cloud}`"))


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


def _read_line(prompt: str, poll: float = 0.1) -> str:
    """Print ``prompt`` and return the next line typed on stdin (a terminal), stripped. It
    waits in ``select`` at most ``poll`` s at a time, so that a signal's Python handler runs
    within ``poll`` s even when the signal came while no system call was there to interrupt
    (just before the read) or went to another thread; a blocking ``input()`` would then
    sleep on until a line is typed.

    Raises:
        EOFError: the end of input (Ctrl-D, the terminal gone).
    """
    import os
    import select
    click.echo(prompt, nl=False)
    fd = sys.stdin.fileno()
    line = b""
    while not line.endswith(b"\n"):
        if not select.select([fd], [], [], poll)[0]:
            continue
        chunk = os.read(fd, 1024)  # a terminal in canonical mode gives a whole line at once
        if not chunk:
            raise EOFError
        line += chunk
    return line.decode(errors="replace").strip()


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
    choice = click.Choice(["leave", "cancel"])
    old = {s: signal.signal(s, leave_now) for s in (signal.SIGINT, signal.SIGTERM,
                                                      signal.SIGHUP)}
    try:
        while True:
            answer = _read_line("\ninterrupted: leave the tasks running or cancel them? "
                                "(leave, cancel) [leave]: ") or "leave"
            try:
                return choice.convert(answer, None, None)
            except click.BadParameter as e:
                click.echo(f"Error: {e.message}")
    except (_LeaveNow, EOFError, OSError):  # OSError: the terminal is gone (SIGHUP)
        restore()
        try:
            click.echo("\nleaving the tasks running")
        except OSError:
            pass
        return "leave"
    finally:
        restore()


@click.command()
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
@click.option("--controller", "use_controller", is_flag=True,
              help="Hand the workflow to the cluster's controller (cluster.controller), which "
                   "drives it while this machine is away.")
@env_options
def run(recipe, new, on_interrupt, trust_new_hosts, cluster, detach, wait, use_controller, env,
        env_files):
    """Run RECIPE's workflow to its end (resuming an unfinished one), with live progress.

    A recipe's secrets: are read from this shell's environment (or --env-file) each time,
    never stored; a resumed run needs them again.

    Ctrl-C asks whether to leave the tasks running (the background driver goes on
    scheduling them; `hyper attach` shows them again) or to cancel them.
    """
    from hypercli.controller.client import link_of, spec_of
    from hypercli.workflows import Driven, drive, load_with_defaults, prepare_run
    state = open_state()
    con = console()
    err = console(stderr=True)
    ctl = spec_of(load_with_defaults(recipe, offer=False).cluster, asked=use_controller)
    if use_controller and ctl is None:
        raise UsageError("--controller needs a controller in the recipe's cluster",
                         "cluster: {provider: ssh, controller: user@host, ...}, or "
                         "provider: aws")
    try:
        wid, resumed, provider, nodes, lock = prepare_run(
            state, recipe, new=new, trust_new_hosts=trust_new_hosts, cluster=cluster,
            log=lambda line: con.print(text(line), soft_wrap=True),
            report=lambda line: err.print(text(("not up:", "yellow"), f" {line}"),
                                          soft_wrap=True), env=env, env_files=env_files)
    except Driven as e:
        from hypercli.driver import driver_pid
        if str(driver_pid()) != e.pid:
            raise
        con.print(text(f"{e.workflow} is run by the background driver (pid {e.pid}): "
                       "attaching"))
        sys.exit(_attach(state, e.workflow))
    if ctl is not None or link_of(state.workflow(wid)) is not None:
        code = _on_controller(state, wid, ctl, lock, con, trust_new_hosts, detach and not wait,
                              use_controller)
        if code is not None:
            sys.exit(code)
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
    shown = [0, 0]  # scheduler notices and lines printed so far

    def progress(sched):
        for note in sched.notices[shown[0]:]:  # idle GPUs, full disks, OOM kills, time limits
            con.print(text(("warning:", "yellow"), f" {note}"), soft_wrap=True)
        for line in sched.lines[shown[1]:]:  # restarts: a node lost, a rank failed
            con.print(text(line), soft_wrap=True)
        shown[:] = [len(sched.notices), len(sched.lines)]
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

    try:  # a "leave" hands the workflow to the background driver (workflows.drive)
        summary, pid = drive(state, wid, provider, nodes, lock, on_interrupt=ask,
                             progress=progress)
    finally:
        if live is not None:
            live.stop()
    counts = ", ".join(f"{n} {s}" for s, n in sorted(summary.counts.items()))
    if summary.interrupted == "leave":
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
        elif summary.counts.get("failed"):
            _show_failure(state, wid, con)
            con.print(f"`hyper ps {wid}` and `hyper logs {wid}/TASK` show what failed")
        else:  # cancelled: nothing failed
            con.print(f"`hyper ps {wid}` shows its tasks")
    sys.exit(summary.exit_code)


def _show_failure(state, wid: str, con, lines: int = 10) -> None:
    """After a failed run: the failed tasks, and the last ``lines`` lines of the first
    failure's stderr."""
    from hypercli.workflows import failure
    try:
        failed, attempt, tail = failure(state, wid, lines=lines)
    except HyperError:  # its logs cannot be read: the names are enough
        failed, attempt, tail = [t["id"] for t in state.tasks(wid, status=["failed"])], None, []
    if not failed:
        return
    shown = ", ".join(failed[:20]) + (f", … ({len(failed)} in all)" if len(failed) > 20 else "")
    con.print(text(("failed:", "bold red"), f" {shown}"), soft_wrap=True)
    if attempt is None:
        return
    gang = any(a["rank"] for a in state.attempts(wid, attempt["task"]))
    rank = f", rank {attempt['rank']}" if gang else ""  # the rank that failed on its own
    if tail:
        con.print(f"last {plural(len(tail), 'line')} of {attempt['task']}'s stderr (attempt "
                  f"{attempt['number']}{rank}, {_ended_how(attempt)}):")
        for line in tail:
            con.print(text(f"  {line}"), soft_wrap=True)
    else:
        why = attempt["error"] or _ended_how(attempt)
        con.print(text(f"{attempt['task']} wrote nothing on stderr (attempt "
                       f"{attempt['number']}{rank}: {why})"), soft_wrap=True)


def _ended_how(attempt: dict) -> str:
    """``exit code 3``; for an attempt that has no exit code (lost, never started), its
    status and the reason recorded."""
    if attempt.get("exit_code") is not None and not (attempt.get("error") or "").startswith(
            "timed out"):
        return f"exit code {attempt['exit_code']}"
    return f"{attempt['status']}: {attempt['error']}" if attempt.get("error") else \
        f"{attempt['status']}, no exit code"


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
    from hypercli.workflows import wait
    view = _View(state, wid)
    con = console()
    seen = [max((e["id"] for e in state.events(wid, limit=1)), default=0)]

    def changed(counts) -> None:
        # the driver's lines since, as `hyper run` prints them: restarts and time limits
        for e in state.events(wid):
            if e["id"] > seen[0] and e["kind"] == "attempt" and e["task"] and not e["attempt"]:
                con.print(text(e["message"]), soft_wrap=True)
        seen[0] = max([seen[0]] + [e["id"] for e in state.events(wid, limit=1)])
        con.print(text(_line(view)))
    try:  # a line whenever the counts change; a driver that died is started again
        status = wait(state, wid, interval=interval, on_change=changed)
    except KeyboardInterrupt:
        con.print(f"stopped watching; {wid} goes on (`hyper attach {wid}`)")
        return 130
    con.print(f"workflow {wid}: {status}")
    return 0 if status == "succeeded" else 1


def _on_controller(state, wid: str, ctl: dict | None, lock, con, trust_new_hosts: bool,
                   detach: bool, asked: bool) -> int | None:
    """``hyper run`` of a workflow a controller drives or is to drive: hand it over (``ctl``:
    the recipe's controller), or follow it there. A controller that does not answer is taken
    over, and the workflow is then driven here unless ``--controller`` was ``asked`` (it is
    handed over again). Returns the exit code, or None when the workflow is to be driven
    here (``lock`` is then still held)."""
    from hypercli.controller import client
    link = client.link_of(state.workflow(wid))
    if link is not None:  # resumed: a controller has it
        try:
            r = client.refresh(state, wid)
            if r is not None and not r["lost"]:
                lock.release()
                return _follow_controller(state, wid, con, detach)
        except client.Unreachable as e:
            con.print(text(("note:", "yellow"), f" {e}"), soft_wrap=True)
        client.takeover(state, wid, log=lambda line: con.print(text(line), soft_wrap=True))
        if not asked:
            con.print(f"driving {wid} here; `hyper run --controller` hands it back")
            ctl = None
    if ctl is None:
        return None
    try:
        if ctl.get("pending"):  # a cloud's: this user's controller instance, found or made
            from hypercli.controller.cloud import IDLE_MINUTES, ensure
            c = ctl["pending"]
            ctl = ensure(state, c.provider, c.options, c.grants, clusters={c.name: c.options},
                         idle_minutes=c.options.get("controller_idle_minutes", IDLE_MINUTES),
                         python=c.options.get("controller_python") or "python3",
                         log=lambda line: con.print(text(line), soft_wrap=True))
        client.handover(state, wid, ctl, trust_new=trust_new_hosts,
                        log=lambda line: con.print(text(line), soft_wrap=True))
    finally:
        lock.release()
    return _follow_controller(state, wid, con, detach)


def _follow_controller(state, wid: str, con, detach: bool) -> int:
    """Say who drives ``wid``; unless ``detach``, follow its progress there until it ends
    (Ctrl-C stops watching only). Returns the exit code."""
    from hypercli.controller.client import follow, link_of
    link = link_of(state.workflow(wid))
    if link is None:  # it ended there and its records were copied here on the way
        status = state.workflow(wid)["status"]
        con.print(f"workflow {wid}: {status}")
        return 0 if status == "succeeded" else 1
    name = link["name"]
    con.print(f"{wid} is driven by the controller {name}; `hyper attach {wid}` follows it, "
              f"`hyper cancel {wid}` stops it")
    if detach:
        return 0
    view = _View(state, wid)
    try:
        status = follow(state, wid, on_change=lambda: con.print(text(_line(view))))
    except KeyboardInterrupt:
        con.print(f"stopped watching; {wid} goes on on the controller (`hyper attach {wid}`)")
        return 130
    con.print(f"workflow {wid}: {status}")
    return 0 if status == "succeeded" else 1


@click.command()
@click.argument("workflow")
def attach(workflow):
    """Show the live progress of WORKFLOW (run in the background, by another `hyper run` or
    by a controller) until it ends; exit 0 when every task succeeded. Ctrl-C stops watching
    only. A controller that does not answer is taken over: its backup is read from the
    cluster's nodes and the workflow is driven here by the background driver."""
    from hypercli.controller import client
    state = open_state()
    wid = state.workflow(workflow)["id"]
    con = console()
    if client.link_of(state.workflow(wid)) is not None:
        try:
            r = client.refresh(state, wid)
            if r is not None and not r["lost"]:
                sys.exit(_follow_controller(state, wid, con, False))
        except client.Unreachable as e:
            con.print(text(("note:", "yellow"), f" {e}"), soft_wrap=True)
        if client.link_of(state.workflow(wid)) is not None:
            from hypercli.driver import detach
            client.takeover(state, wid, log=lambda line: con.print(text(line), soft_wrap=True))
            detach(state, wid)
    sys.exit(_attach(state, wid))
