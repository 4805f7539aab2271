"""Workflows as the user sees them: start or resume one from a recipe, its results, its logs.

The functions here are what the CLI commands call; each takes plain values and returns plain
values (dicts, lists), so the CLI only parses and renders.

Resume rule: ``hyper run RECIPE`` continues the newest workflow of the recipe's name when that
workflow has not ended and was planned from the same tasks (same plan digest); otherwise it
starts a new workflow ``<name>-<n+1>``. A workflow is driven by one ``hyper run`` at a time,
enforced with an flock on ``$HYPER_HOME/locks/<workflow>.lock`` (released by the kernel when
that process dies, even by SIGKILL).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
import stat
import time
from pathlib import Path
from typing import Callable, Iterator

from hypercli import cluster as C
from hypercli import envvars, registry
from hypercli import state as S
from hypercli.cluster import provider_of
from hypercli.errors import HyperError, InfraError, UsageError
from hypercli.locks import Driven, Lock, driver_pid  # noqa: F401  (Driven: raised here)
from hypercli.plan import Workflow, build_plan
from hypercli.providers import get_provider
from hypercli.recipe import Recipe, load_recipe


def default_storage() -> str:
    """``file://$HYPER_HOME/storage``: where outputs go when the recipe names no storage."""
    return "file://" + str(S.folder("storage"))


def load(recipe_path: str, env=(), env_files=(), offer: bool = True
         ) -> tuple[Recipe, Workflow]:
    """Read, validate and plan a recipe, with what it leaves out taken from the defaults
    file (:func:`hypercli.config.apply`), listing the files of its shard parameters, its
    ``env:`` references resolved from this process's environment and ``env`` (``--env``
    items) / ``env_files`` (``--env-file`` paths) applied (:mod:`hypercli.envvars`; no
    secret's value is read). ``offer``: see :func:`load_with_defaults`. Raises RecipeError; UsageError for a variable that is not set
    or a bad ``--env``/``--env-file``; StoreError when a dataset to split cannot be read."""
    from hypercli.shards import resolve
    recipe = load_with_defaults(recipe_path, offer)
    overrides, _ = envvars.from_options(env, env_files)
    lookups = envvars.lookups(recipe, overrides)
    recipe, shards = resolve(recipe)
    return recipe, build_plan(recipe, shards, lookups, envvars.recorded(recipe, overrides))


def load_with_defaults(recipe_path: str, offer: bool = True) -> Recipe:
    """A recipe file read and checked, its gaps filled from ``config.yaml``
    (:mod:`hypercli.config`); with ``offer``, a cloud cluster with no ``instance_type``
    gets the optimizer's first offer (:func:`hypercli.offers.optimizer.with_first_offer`).
    Raises RecipeError; NoOffer (exit 2) when nothing satisfies the experiments."""
    from hypercli import config
    recipe = config.apply(load_recipe(recipe_path))
    if offer and recipe.cluster.provider in ("aws", "gcp", "azure") and \
            not recipe.cluster.options.get("instance_type"):
        from hypercli.offers.optimizer import with_first_offer
        from hypercli.offers.pools import wants_pools
        state = S.State()
        if not wants_pools(recipe, state):  # pools choose their offers per shape
            recipe = with_first_offer(recipe, state)
    return recipe


def start_or_resume(state: S.State, recipe: Recipe, wf: Workflow, *, new: bool = False
                    ) -> tuple[str, bool]:
    """The workflow ``hyper run`` should drive (see the resume rule in the module docstring).

    Args:
        new: always start a new workflow.
    Returns:
        (workflow id, resumed?).
    Raises:
        UsageError: the newest workflow of this name is unfinished but was planned from a
            different recipe (the message says how to go on).
    """
    last = state.latest_workflow(wf.name)
    if last and not new and last["status"] in ("running", "cancelling"):
        if last["digest"] == wf.digest:
            return last["id"], True
        raise UsageError(f"workflow {last['id']} of recipe {wf.name} has not ended and was "
                         "planned from a different version of the recipe (or other values "
                         "of its env: variables, --env or --env-file)",
                         f"`hyper run --new` starts another, `hyper cancel {last['id']}` "
                         "ends it")
    storage = recipe.storage or default_storage()
    wid = state.create_workflow(wf, cluster=recipe.cluster.name, recipe_path=recipe.path,
                                storage=storage, workdir=recipe.workdir or "",
                                spec={"mounts": dict(recipe.mounts),
                                      "rw_mounts": sorted(recipe.rw_mounts),
                                      "copy_mounts": sorted(recipe.copy_mounts),
                                      "token": secrets.token_hex(4),
                                      "log_params": log_params(recipe),
                                      # experiment → s an attempt may run (``timeout:``)
                                      "timeouts": {n: e.timeout for n, e in
                                                   recipe.experiments.items() if e.timeout},
                                      # experiments whose gangs keep rank 0's checkpoint only
                                      "checkpoint_rank0": sorted(
                                          n for n, e in recipe.experiments.items()
                                          if e.checkpoint_ranks == "rank0"),
                                      # references only, never a password's value
                                      "registry_auth": registry.stored(
                                          registry.of_recipe(recipe), recipe.digest),
                                      "secrets": envvars.stored(recipe)})  # names only
    for exp, plan in wf.shards.items():  # the file lists, kept beside the state file
        plan.save(wid, exp)
    return wid, False


def log_params(recipe: Recipe) -> dict[str, list[str]]:
    """experiment → the names of its parameters drawn on a log scale (``log: true``), for
    plots (the dashboard draws them on log axes); experiments with none are left out."""
    from hypercli.params import Continuous
    out = {}
    for name, exp in recipe.experiments.items():
        names = [p for p, v in exp.parameters.items() if isinstance(v, Continuous) and v.log]
        if names:
            out[name] = names
    return out


def results(state: S.State, ref: str, sort: str | None = None, ascending: bool = False
            ) -> tuple[str, str | None, list[dict]]:
    """Tasks of a workflow with their parameters and last reported metrics, best first.

    Args:
        ref: workflow id or recipe name (newest workflow).
        sort: metric to order by; default the first metric any task reported.
        ascending: smallest first (for losses); default largest first.
    Returns:
        (workflow id, the metric sorted by or None, rows) where each row has task, experiment,
        status, params (dict), metrics (dict), attempts (int). Tasks without the metric, or
        whose value of it is not a number (NaN, a string), last; infinities are numbers.
    Raises:
        UsageError: unknown workflow; ``sort`` names a metric no task reported.
    """
    wid = state.workflow(ref)["id"]
    rows = [{"task": t["id"], "experiment": t["experiment"], "status": t["status"],
             "params": t["params"], "metrics": t["metrics"] or {}, "attempts": t["attempts"]}
            for t in state.tasks(wid)]
    reported = list(dict.fromkeys(k for r in rows for k in r["metrics"]))
    if sort is None:
        sort = next(iter(reported), None)
    elif sort not in reported:
        raise UsageError(f"no task of {wid} reported a metric {sort!r}",
                         f"its metrics: {', '.join(reported)}" if reported else
                         "its tasks reported no metrics (a task appends JSON lines to "
                         "$HYPER_METRICS)")
    if sort is not None:
        def key(r):
            v = r["metrics"].get(sort)
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN
            return (0, v if ascending else -v) if ok else (1, 0)
        rows.sort(key=key)
    return wid, sort, rows


def _pid_alive(pid) -> bool:
    try:
        os.kill(int(pid), 0)
    except (ProcessLookupError, ValueError, TypeError):
        return False
    except PermissionError:  # alive, another user's
        return True
    return True


def undriven(state: S.State, wid: str) -> float | None:
    """When a workflow has not ended but no process drives it (its ``driver_pid`` is empty or
    dead, and it is not handed to a live background driver), the time (unix s) of its last
    recorded change (newest attempt or event time): its states are as of then. None when it
    has ended or is driven."""
    wf = state.workflow(wid)
    if wf["status"] not in ("running", "cancelling"):
        return None
    ctl = (wf.get("spec") or {}).get("controller") or {}
    if ctl and not ctl.get("done") and not ctl.get("taken"):
        return None  # a controller drives it (hypercli.controller.client)
    if wf.get("driver_pid") and _pid_alive(wf["driver_pid"]):
        return None
    if wf.get("detached"):
        if driver_pid():
            return None
    times = [wf["created_at"]]
    for a in state.attempts(wid):
        times += [a["created_at"], a["started_at"] or 0, a["ended_at"] or 0]
    times += [e["ts"] for e in state.events(wid, limit=1)]
    return max(times)


def observe(state: S.State, wid: str, timeout: float = 2.0) -> dict[str, str]:
    """Ask the nodes, for at most ``timeout`` s, what the workflow's live attempts (as the
    state file has them) are doing now, without recording anything: task id → what the node
    says (``exited 0``, ``lost``, ``running``; ``not answering`` when the node did not answer
    in time). Uses the agent's ``poll`` request with no wait (``hypercli/node/agent.py``)."""
    import threading
    live = state.attempts(wid, status=S.LIVE_ATTEMPT)
    if not live:
        return {}
    wf = state.workflow(wid)
    by_node: dict[str, list[dict]] = {}
    for a in live:
        by_node.setdefault(a["node"], []).append(a)
    nodes = {n["name"]: n for n in state.nodes(wf["cluster"])}
    out: dict[str, str] = {}
    seen: dict[str, dict] = {}

    def ask(node: str, attempts: list[dict]) -> None:
        client = None
        try:
            client = provider_of(state, wf["cluster"]).connect(nodes[node])
            states = client.call("poll", ids=[a["id"] for a in attempts], wait=0)["states"]
            seen.update(states)
        except (HyperError, KeyError, OSError):
            pass
        finally:
            if client is not None:
                client.close()
    threads = [threading.Thread(target=ask, args=item, daemon=True)
               for item in by_node.items()]
    for t in threads:
        t.start()
    end = time.time() + timeout
    for t in threads:
        t.join(max(0.0, end - time.time()))
    for a in live:
        s = dict(seen.get(a["id"]) or {})
        if not s:
            text = "not answering"
        elif s.get("state") == "exited":
            text = f"exited {s.get('code')}"
        else:
            text = str(s.get("state"))
        if a["rank"]:
            text = f"rank {a['rank']} {text}"
        out[a["task"]] = f"{out[a['task']]}, {text}" if a["task"] in out else text
    return out


def resolve_task(state: S.State, ref: str) -> tuple[str, str, str | None]:
    """``TASK`` or ``WORKFLOW/TASK`` → (workflow id, task id, note). A bare task id means
    the newest workflow that has it; the note (else None) says which one was chosen when
    several workflows have it.

    Raises:
        UsageError: no such task; a bare task id of several workflows that have not ended
            (the message lists them as WORKFLOW/TASK).
    """
    if "/" in ref:
        return (*state.find_task(ref), None)
    matches = state.task_matches(ref)
    open_ = [m for m in matches if m["status"] in ("running", "cancelling")]
    if len(open_) > 1:
        raise UsageError(f"task {ref!r} is in {len(open_)} workflows that have not ended: "
                         + ", ".join(f"{m['workflow']}/{m['task']}" for m in open_),
                         "give it as WORKFLOW/TASK")
    wid, tid = state.find_task(ref)
    note = None
    if len(matches) > 1:
        others = [m["workflow"] for m in matches if m["workflow"] != wid]
        note = (f"{ref}: showing {wid}/{tid}, the newest of {len(matches)} workflows with "
                f"this task (also in {', '.join(others[:5])}"
                f"{', …' if len(others) > 5 else ''}; give WORKFLOW/TASK for another)")
    return wid, tid, note


def _never_started(state: S.State, wid: str, tid: str) -> UsageError:
    """Why a task has no attempt: skipped (an experiment it comes after did not succeed),
    cancelled before it started, or not started yet."""
    task = state.task(wid, tid)
    if task["status"] == "skipped":
        exp = next((e for e in state.experiments(wid) if e["name"] == task["experiment"]), None)
        counts = state.counts(wid)
        bad = [a for a in (exp or {}).get("after", [])
               if any(counts.get(a, {}).get(s) for s in ("failed", "skipped", "cancelled"))]
        failed = next((t["id"] for t in state.tasks(wid, status=["failed"])
                       if t["experiment"] in bad), None)
        def how(e: str) -> str:
            return ", ".join(f"{counts[e][s]} {s}" for s in ("failed", "skipped", "cancelled")
                             if counts[e].get(s))
        why = (f"experiment {', '.join(f'{e} ({how(e)})' for e in bad)}, which "
               f"{task['experiment']} comes after, did not succeed" if bad else
               "an experiment it comes after failed")
        ev = next((e for e in reversed(state.events(wid))
                   if e["message"].startswith(f"experiment {task['experiment']} skipped")), None)
        when = f" ({time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(ev['ts']))})" if ev else ""
        return UsageError(f"task {wid}/{tid} was skipped{when}: {why}; it will "
                          "never start, so it has no logs",
                          f"`hyper logs {wid}/{failed}` shows the failure" if failed else
                          f"`hyper ps {wid}` shows what failed")
    if task["status"] == "cancelled":
        when = (f" at {time.strftime('%Y-%m-%d %H:%M:%S', time.localtime(task['ended_at']))}"
                if task.get("ended_at") else "")
        return UsageError(f"task {wid}/{tid} was cancelled before it started{when}, so it "
                          "has no logs", f"`hyper ps {wid}` shows the workflow's tasks")
    return UsageError(f"task {wid}/{tid} has not started yet ({task['status']})",
                      f"`hyper ps {wid}` shows why it waits")


def pick_attempt(state: S.State, ref: str, number: int | None = None, rank: int = 0,
                 note: Callable[[str], None] | None = None) -> dict:
    """The attempt of a task (``TASK`` or ``WORKFLOW/TASK``): number N, else the newest; for a
    multi-node task, that attempt's rank ``rank``. ``note`` gets a line naming the workflow
    chosen for a bare task id that several workflows have (:func:`resolve_task`).

    Raises:
        UsageError: unknown or ambiguous task, no such attempt or rank, or the task never
            started (skipped, cancelled before it started, or waiting: the message says
            which).
    """
    wid, tid, chosen = resolve_task(state, ref)
    if chosen and note:
        note(chosen)
    attempts = state.attempts(wid, tid)
    ranks = {a["rank"] for a in attempts}
    if rank not in ranks and attempts:
        raise UsageError(f"task {wid}/{tid} has no rank {rank}",
                         f"its ranks are 0..{max(ranks)}" if max(ranks) else
                         "it is not a multi-node task")
    attempts = [a for a in attempts if a["rank"] == rank]
    if not attempts:
        raise _never_started(state, wid, tid)
    if number is None:
        return attempts[-1]
    for a in attempts:
        if a["number"] == number:
            return a
    raise UsageError(f"task {wid}/{tid} has no attempt {number}",
                     f"it has attempts 1..{len(attempts)}")


def log_chunks(state: S.State, attempt: dict, *, follow: bool = False,
               interval: float = 0.25, note: Callable[[str], None] | None = None,
               merge: bool = True) -> Iterator[tuple[str, bytes]]:
    """Yield (stream, bytes) of an attempt's stdout and stderr, read by offset from its node;
    with ``follow``, until the attempt ends. With ``merge``, the lines of both come in the
    order they came (:mod:`hypercli.logmerge`, from the node's ``order``), each still named
    by its stream; else all of stdout, then all of stderr. Falls back to the copy in
    ``$HYPER_HOME/logs``
    when the node cannot be reached (a local node's attempt folder, under
    ``$HYPER_HOME/local/tasks``, is such a copy: it stays when its cluster is forgotten).
    A copy made while the attempt ran on a node that was then lost (:mod:`hypercli.logcopy`)
    may miss its last lines: ``note`` gets one line saying up to when it is complete.

    A copy's log is read only when it is a regular file, opened without following a
    symlink and without waiting (a task may have put a FIFO or a symlink in its place; an
    ``order`` that is not one is not read: the streams then come one after the other).

    Raises:
        InfraError: the node is unreachable and no copy exists; a log of the copy is not a
            regular file.
    """
    from hypercli.logmerge import Merger
    wf = state.workflow(attempt["workflow"])
    copies = [S.home() / "logs" / attempt["id"], S.home() / "local" / "tasks" / attempt["id"]]
    copy = next((c for c in copies if c.exists()), copies[0])

    def from_copy():
        from hypercli.logcopy import note as partial
        why = partial(attempt) if attempt["status"] in ("lost", *S.LIVE_ATTEMPT) else None
        if why and note is not None:
            note(why)
        if merge:
            yield from Merger(lambda name, offset, limit: _read_log(
                copy / name, offset, limit, name == "order") or b"").step()
            return
        for stream in ("stdout", "stderr"):
            data = _read_log(copy / stream)
            if data is not None:
                yield stream, data

    if attempt["status"] not in S.LIVE_ATTEMPT and copy.exists():
        yield from from_copy()  # ended and brought back: no need to reach the node
        return
    try:
        node = next((n for n in state.nodes(wf["cluster"]) if n["name"] == attempt["node"]),
                    None)
        if node is None:
            raise InfraError(f"node {attempt['node']} of attempt {attempt['id']} is unknown")
        client = provider_of(state, wf["cluster"]).connect(node)
    except HyperError:
        if not copy.exists():
            raise
        yield from from_copy()
        return
    try:
        if merge:
            merger = Merger(lambda name, offset, limit: client.read(
                attempt["id"], name, offset, limit)["data"])
            while True:
                ended = client.read(attempt["id"], "order", 0, 0)["state"] != "running"
                yield from merger.step(final=ended or not follow)
                if ended or not follow:
                    return
                time.sleep(interval)
        offsets = {"stdout": 0, "stderr": 0}
        while True:
            done = True
            for stream in offsets:
                while True:
                    r = client.read(attempt["id"], stream, offsets[stream])
                    offsets[stream] = r["offset"]
                    if r["data"]:
                        yield stream, r["data"]
                    if len(r["data"]) < (1 << 20):
                        break
                done = done and r["done"]
            if not follow or done:
                return
            time.sleep(interval)
    finally:
        client.close()


def _read_log(path: Path, offset: int = 0, limit: int = -1,
              optional: bool = False) -> bytes | None:
    """``limit`` bytes (-1: all) at ``offset`` of the log at ``path``; None when there is
    none, or with ``optional`` when it is not a regular file.

    Raises:
        InfraError: it is not a regular file (a symlink, a FIFO, a folder), or cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a symlink
        if optional:
            return None
        raise InfraError(f"log {path} is not a regular file ({e.strerror}): not read",
                         "something other than the task's agent replaced it") from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            if optional:
                return None
            raise InfraError(f"log {path} is not a regular file: not read",
                             "something other than the task's agent replaced it")
        with os.fdopen(fd, "rb", closefd=False) as f:
            f.seek(offset)
            return f.read(limit)
    except OSError as e:
        raise InfraError(f"cannot read log {path}: {e.strerror or e}") from None
    finally:
        os.close(fd)


def failure(state: S.State, wid: str, lines: int = 10) -> tuple[list[str], dict | None,
                                                                  list[str]]:
    """What a failed workflow shows at its end: (ids of its failed tasks in the order they
    failed, the last attempt of the first of them or None, the last ``lines`` lines of that
    attempt's stderr).

    Raises:
        HyperError: the attempt's logs cannot be read (node unreachable, no copy here).
    """
    failed = sorted(state.tasks(wid, status=["failed"]),
                    key=lambda t: (t["ended_at"] or float("inf")))
    if not failed:
        return [], None, []
    ids = [t["id"] for t in failed]
    attempts = state.attempts(wid, ids[0])
    if not attempts:
        return ids, None, []
    attempt = root_cause(attempts)
    err = b"".join(data for stream, data in log_chunks(state, attempt, merge=False)
                   if stream == "stderr")
    tail = err.decode(errors="replace").rstrip("\n").splitlines()[-lines:] if err else []
    return ids, attempt, tail


def root_cause(attempts: list[dict]) -> dict:
    """The rank that ended the newest attempt of a task (``attempts`` rows of one task, any
    order): the first rank that failed on its own, by its end time (not one hypercli stopped
    with its gang: those are ``cancelled``, or say ``stopped with its gang``), else the first
    that was lost, else rank 0."""
    number = max(a["number"] for a in attempts)
    ranks = sorted((a for a in attempts if a["number"] == number), key=lambda a: a["rank"])

    def by_end(status: str) -> list[dict]:
        own = [a for a in ranks if a["status"] == status
               and not (a.get("error") or "").startswith("stopped with its gang")]
        return sorted(own, key=lambda a: (a["ended_at"] or float("inf"), a["rank"]))
    return (by_end("failed") or by_end("lost") or ranks)[0]


def task_times(state: S.State, wid: str) -> dict[str, tuple[float | None, float | None]]:
    """task id → (start, end) in unix s: when its first attempt started (None: never) and
    when it ended (None: not yet)."""
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    for a in state.attempts(wid):  # every rank of a gang: its earliest start, latest end
        start = a["started_at"] or a["created_at"]
        starts[a["task"]] = min(starts.get(a["task"], start), start)
        if a["ended_at"]:
            ends[a["task"]] = max(ends.get(a["task"], 0.0), a["ended_at"])
    out: dict[str, tuple] = {}
    for t in state.tasks(wid):
        end = None
        if t["status"] in S.TERMINAL_TASK:
            end = max(t["ended_at"] or 0.0, ends.get(t["id"], 0.0)) or None
        out[t["id"]] = (starts.get(t["id"]), end)
    return out


def cancel(state: S.State, ref: str) -> tuple[str, int]:
    """Cancel a workflow (id or name) or one task (``WORKFLOW/TASK``).

    Returns:
        (what was cancelled, number of tasks cancelled).
    """
    from hypercli.stop import cancel_task, cancel_workflow
    if "/" in ref:
        wid, tid = state.find_task(ref)
        wf = state.workflow(wid)
        return f"{wid}/{tid}", cancel_task(state, wid, tid, provider_of(state, wf["cluster"]))
    wf = state.workflow(ref)
    if wf["status"] not in ("running", "cancelling"):
        raise UsageError(f"workflow {wf['id']} has already ended ({wf['status']})")
    open_ = {t["id"] for t in state.tasks(wf["id"]) if t["status"] not in S.TERMINAL_TASK}
    cancel_workflow(state, wf["id"], provider_of(state, wf["cluster"]))
    # counted from the state file: a `hyper run` driving it may have marked them first
    return wf["id"], sum(t["id"] in open_ for t in state.tasks(wf["id"], status=["cancelled"]))


def forget(state: S.State, name: str) -> int:
    """Forget a cluster that is down: its row and its nodes' rows leave the state file; its
    workflows keep their records (their logs are read from the copies kept here). Returns
    the number of nodes forgotten.

    Raises:
        UsageError: no such cluster, or it is up.
    """
    c = state.cluster(name)
    if c is None:
        raise UsageError(f"no cluster named {name!r}", "`hyper status --all` lists them")
    if c["status"] != "down":
        raise UsageError(f"cluster {name} is {c['status']}: only a cluster that is down can "
                         "be forgotten", f"`hyper down {name}` first")
    return state.forget_cluster(name)


def up(state: S.State, spec, *, trust_new_hosts: bool = False,
       log: Callable[[str], None] = lambda s: None) -> list[dict]:
    """Bring a cluster (``recipe.ClusterSpec``) up; returns its nodes. Targets that fail are
    reported through ``log``, one line each; the others go on."""
    provider = get_provider(spec.provider, trust_new_hosts=trust_new_hosts,
                            options=spec.options)
    return C.up(state, spec, provider, report=log)


def cluster_spec(name: str, provider: str, hosts: list[str], *, workers: int | None = None,
                 identity_file: str | None = None, user: str | None = None):
    """A ClusterSpec from command-line options (``hyper up --provider ssh --host ...``),
    checked by the same rules as a recipe's ``cluster:``.

    Raises:
        RecipeError: a bad option value (reported with the option's field name).
    """
    import yaml

    from hypercli.recipe import parse_recipe
    cluster: dict = {"provider": provider, "name": name}
    if workers is not None:
        cluster["workers"] = workers
    if hosts:
        cluster["hosts"] = list(hosts)
    if identity_file:
        cluster["identity_file"] = identity_file
    if user:
        cluster["user"] = user
    text = yaml.safe_dump({"name": name, "cluster": cluster,
                           "experiments": {"none": {"command": "true"}}})
    from hypercli import config
    return config.apply(parse_recipe(text, path="(command line)")).cluster  # flags win


def prepare_run(state: S.State, recipe_path: str, *, new: bool = False,
                trust_new_hosts: bool = False, cluster: str | None = None,
                log: Callable[[str], None] = lambda s: None,
                report: Callable[[str], None] | None = None, env=(), env_files=()):
    """Everything ``hyper run`` does before its loop: plan, bring the cluster up (or, with
    ``cluster``, use that cluster as it is, whatever the recipe's ``cluster:`` says), check
    that its nodes can hold every experiment's tasks, pick the workflow and lock it. ``log``
    gets progress lines, ``report`` (default ``log``) one line per node that could not be
    brought up. ``env``/``env_files``: ``--env`` items and ``--env-file`` paths
    (:mod:`hypercli.envvars`); the secrets' values are read here and kept in this process's
    memory only. Returns (workflow id, resumed?, provider, nodes, lock).

    Raises:
        UsageError: ``cluster`` names no cluster that is up; a task no node could hold
            (:func:`check_fits`); a variable or secret that is not set, a secret's value
            given on the command line.
    """
    recipe, wf = load(recipe_path, env, env_files)
    overrides, literal = envvars.from_options(env, env_files)
    secret_env = envvars.secret_values(envvars.secret_names(recipe), overrides, literal)
    if cluster is not None:
        row = state.cluster(cluster)
        if row is None or row["status"] != "up":
            raise UsageError(f"no cluster {cluster!r} is up", "`hyper status` lists clusters; "
                             "`hyper up` brings one up")
        recipe = dataclasses.replace(recipe, cluster=dataclasses.replace(
            recipe.cluster, name=cluster, provider=row["provider"],
            options=(row.get("spec") or {}).get("options") or {}))
    provider = get_provider(recipe.cluster.provider, trust_new_hosts=trust_new_hosts,
                            options=recipe.cluster.options)
    from hypercli.offers import pools
    pooled = cluster is None and pools.wants_pools(recipe, state)
    if cluster is not None:
        nodes = state.nodes(cluster, status="up")
    elif pooled:  # no node yet: each pool grows when its experiments have work
        nodes = pools.record(state, recipe, pools.plan(
            recipe, {e.name: e.tasks for e in wf.experiments}))
    else:
        started = time.time()
        try:
            nodes = C.up(state, recipe.cluster, provider, report=report or log)
        finally:  # the launch's failover steps: another zone, region or cloud, on-demand
            for e in state.cluster_events(recipe.cluster.name, ("launch",), since=started):
                log(f"failover: {e['message']}")
    if not pooled:  # a pool's offer holds its shape
        check_fits(wf, recipe.cluster.name, nodes)  # before a workflow is recorded
    if recipe.mounts and hasattr(provider, "check_mounts"):  # this machine: known now
        provider.check_mounts(recipe.mounts)
    creds = registry.check(registry.of_recipe(recipe))  # a ${VAR} not set: refused now
    sync = getattr(provider, "sync_workdir", None)
    manifest = None
    if sync is not None and recipe.workdir:  # over its limit: refused before it is recorded
        from hypercli import workdir
        manifest = workdir.build(recipe.workdir, skip=S.home())
    wid, resumed = start_or_resume(state, recipe, wf, new=new)
    lock = Lock(wid).acquire()
    registry.remember(wid, creds)  # in this process's memory only
    envvars.remember(wid, secret_env)  # so are the secrets' values
    try:  # the workflow's own storage prefix (and this recipe's mounts) on its cluster
        if resumed and state.workflow(wid)["cluster"] != recipe.cluster.name:
            state.set_workflow(wid, cluster=recipe.cluster.name)  # resumed on another cluster
        C.grant(state, recipe.cluster, provider)
    except BaseException:
        lock.release()
        raise
    from hypercli.console import plural
    log(f"{'resuming' if resumed else 'starting'} workflow {wid}: {plural(len(wf.tasks), 'task')}"
        f" on {C.count_nodes(nodes, recipe.cluster.provider)}")
    if manifest is not None and nodes:
        try:
            workdir.remember(wid, manifest)
            sync(nodes, state.workflow(wid), log)  # all nodes at once, saying what is sent
        except BaseException:
            lock.release()
            raise
    return wid, resumed, provider, nodes, lock


def check_fits(wf: Workflow, cluster: str, nodes: list[dict]) -> None:
    """Refuse a plan with an experiment whose tasks no node of the cluster could ever hold
    (asking more GPUs, CPUs or memory than the largest node has, or more nodes than there
    are).

    Raises:
        UsageError: naming the experiment, what it asks and the largest node.
    """
    from hypercli.capacity import free_of, never_fits
    free = {n["name"]: free_of(n, []) for n in nodes}
    for e in wf.experiments:
        why = never_fits(e.resources, free)
        if why:
            raise UsageError(f"experiment {e.name} cannot run on cluster {cluster}: {why}",
                             "ask for less in its resources:, or use a cluster with larger "
                             "nodes")


def storage_folder(state: S.State, wid: str) -> Path | None:
    """The output folder of a workflow whose storage is a ``file://`` folder, else None."""
    storage = state.workflow(wid)["storage"]
    return Path(storage[7:]) / wid if storage.startswith("file://") else None


def bootstrap_nodes(state: S.State, spec, nodes: list[dict], *,
                    offline: bool = False) -> dict[str, list]:
    """Run the node image's provisioning (``images/packer/scripts``) on every node of a
    cluster that is reached over SSH; returns node → its ``hyper-provision:`` lines.

    Raises:
        UsageError: the cluster's nodes are not SSH hosts (the local provider).
        HyperError: a node failed (the others are not rolled back: a rerun continues).
    """
    from hypercli.images import DOWNLOAD_STEPS, provision
    from hypercli.ssh.fanout import fan_out
    provider = get_provider(spec.provider, options=spec.options)
    if not hasattr(provider, "connection"):
        raise UsageError(f"--bootstrap is for nodes reached over SSH, not {spec.provider}")
    from hypercli.providers.ssh import _target_of
    by_name = {n["name"]: n for n in nodes}

    def one(name: str) -> list:
        n = by_name[name]
        conn = provider.connection(name, _target_of(n), n["cluster"])
        return provision(conn, skip=DOWNLOAD_STEPS if offline else ())
    res = fan_out(list(by_name), one)
    if res.failed:
        first = next(iter(res.failed.values()))
        raise InfraError(f"provisioning failed on {', '.join(sorted(res.failed))}: {first}")
    return dict(res.ok)


def drive(state: S.State, wid: str, provider, nodes: list[dict], lock, *,
          on_interrupt: Callable[[], str] | None = None, progress=None):
    """Run a workflow prepared by :func:`prepare_run` to its end in this process (what
    ``hyper run`` does in the foreground and ``hypercli.run`` in a notebook), releasing
    ``lock`` at the end. An interrupt answered "leave" (``on_interrupt``; SIGTERM and SIGHUP
    always leave) hands the workflow to the background driver, which goes on scheduling it.

    Returns:
        (the :class:`hypercli.scheduler.Summary`, the pid of the background driver it was
        handed to when ``interrupted == "leave"``, else None).
    Raises:
        InfraError: every node of the cluster was lost with work left to do.
    """
    from hypercli.driver import detach
    from hypercli.scheduler import Scheduler
    try:
        summary = Scheduler(state, wid, provider, nodes, on_interrupt=on_interrupt).run(progress)
    finally:
        lock.release()
    pid = detach(state, wid) if summary.interrupted == "leave" else None
    if pid is None:  # ended here: a controller's backups of it, if taken over, go
        from hypercli.controller.client import drop_backups
        drop_backups(state, wid)
    return summary, pid


def wait(state: S.State, wid: str, *, interval: float = 0.5, timeout: float | None = None,
         on_change: Callable[[dict], None] | None = None) -> str:
    """Wait for a workflow driven elsewhere (the background driver, another ``hyper run``)
    to end, starting the background driver again if it died; returns its final status.
    ``on_change`` gets the task counts (experiment → {status: n}) whenever they change.

    Raises:
        UsageError: unknown workflow; a driver must be started for it and a secret of it is
            not set in this process's environment (the driver would get none).
        TimeoutError: ``timeout`` (s) passed first.
    """
    from hypercli.driver import ensure
    end = None if timeout is None else time.monotonic() + timeout
    last = None
    while True:
        wf = state.workflow(wid)
        if wf.get("detached") and wf["status"] == "running" and not driver_pid():
            envvars.for_workflow(wf)  # asked again: the driver started next gets them
        ensure(state)
        status = state.workflow(wid)["status"]
        if on_change is not None:
            counts = state.counts(wid)
            if counts != last:
                last = counts
                on_change(counts)
        if status not in ("running", "cancelling"):
            return status
        if end is not None and time.monotonic() > end:
            raise TimeoutError(f"workflow {wid} is still {status} after {timeout:g} s")
        time.sleep(interval)


def cluster_rows(state: S.State, name: str | None = None, show_all: bool = False
                 ) -> tuple[list[dict], int]:
    """What ``hyper status`` shows: (clusters as ``{"cluster", "provider", "status",
    "nodes": [{"name", "status", "slots", "provider_id"}]}``, how many clusters that are
    down were left out). ``name``: only that cluster; ``show_all``: those that are down too.

    Raises:
        UsageError: ``name`` names no cluster.
    """
    clusters = [c for c in state.clusters() if name in (None, c["name"])]
    if name and not clusters:
        raise UsageError(f"no cluster named {name!r}", "`hyper status --all` lists them")
    hidden = 0
    if not name and not show_all:
        shown = [c for c in clusters if c["status"] != "down"]
        hidden, clusters = len(clusters) - len(shown), shown
    return [{"cluster": c["name"], "provider": c["provider"], "status": c["status"],
             "nodes": [{"name": n["name"], "status": n["status"], "slots": n["slots"],
                        "provider_id": n["provider_id"]} for n in state.nodes(c["name"])]}
            for c in clusters], hidden
