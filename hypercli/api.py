"""The Python API: what ``hyper`` does, for notebooks and CI scripts.

    import hypercli
    wf = hypercli.run("recipes/quickstart.yaml")        # blocks until the workflow ends
    wf.status                                           # "succeeded"
    wf.results()                                        # [{"task", "params", "metrics", ...}]
    wf.results(frame=True)                              # a pandas DataFrame
    print(wf.logs("search-0003").stdout)
    hypercli.down("quickstart")

It calls the same library functions as the command line (:mod:`hypercli.workflows`,
:mod:`hypercli.cluster`, :mod:`hypercli.config`), so a recipe, a cluster and a workflow mean
the same things, the defaults file applies, and every error is the same
:class:`~hypercli.errors.HyperError` subclass the CLI reports (``UsageError`` for bad input
and unknown names, ``RecipeError`` for a recipe, ``InfraError`` for nodes and providers).
Nothing here prints, and nothing here imports click or rich. Each call opens the state file
(``$HYPER_HOME/state.db``) for itself; a :class:`Workflow` is a handle that reads the state
file whenever it is asked something, so it stays current while the workflow runs elsewhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Callable

from hypercli import state as S
from hypercli.errors import UsageError

__all__ = ["Logs", "Workflow", "down", "run", "status", "up", "workflow"]


def _state() -> S.State:
    from hypercli.driver import ensure
    st = S.State()
    ensure(st)  # a background driver that died while workflows were handed to it
    return st


@dataclass(frozen=True)
class Logs:
    """One attempt's output: ``stdout`` and ``stderr`` as text (undecodable bytes replaced),
    and which attempt it was (``attempt``: the number, ``node``: where it ran)."""

    task: str
    attempt: int
    node: str
    stdout: str
    stderr: str

    def __str__(self) -> str:
        return self.stdout + self.stderr


class Workflow:
    """A handle on one workflow (one run of a recipe), by id: ``quickstart-3``.

    Reads the state file on each call; cheap to keep and to make again
    (:func:`workflow`).
    """

    def __init__(self, wid: str):
        self.id = wid

    def __repr__(self) -> str:
        return f"Workflow({self.id!r}, status={self.status!r})"

    def _with(self, fn: Callable[[S.State], Any]) -> Any:
        st = _state()
        try:
            return fn(st)
        finally:
            st.close()

    @property
    def status(self) -> str:
        """``running``, ``cancelling``, ``succeeded``, ``failed`` or ``cancelled``."""
        return self._with(lambda st: st.workflow(self.id)["status"])

    @property
    def counts(self) -> dict[str, dict[str, int]]:
        """Tasks by experiment and status: ``{"search": {"succeeded": 30, "failed": 2}}``."""
        return self._with(lambda st: st.counts(self.id))

    def tasks(self) -> list[dict]:
        """Every task: ``{"task", "experiment", "status", "attempts", "params"}``, in plan
        order."""
        return self._with(lambda st: [
            {"task": t["id"], "experiment": t["experiment"], "status": t["status"],
             "attempts": t["attempts"], "params": t["params"]} for t in st.tasks(self.id)])

    def results(self, sort: str | None = None, ascending: bool = False, *,
                frame: bool = False):
        """Parameters and last reported metrics of each task, best first (as ``hyper
        results``: by ``sort``, default the first metric reported, largest first unless
        ``ascending``).

        Returns:
            a list of ``{"task", "experiment", "status", "params": {...}, "metrics": {...}}``;
            with ``frame``, a pandas DataFrame with one row per task and a column per
            parameter and metric (metric columns after the parameters; a name both have gets
            the metric's as ``metric.<name>``).
        Raises:
            UsageError: ``sort`` names a metric no task reported; ``frame`` without pandas.
        """
        from hypercli.workflows import results
        _, _, rows = self._with(lambda st: results(st, self.id, sort, ascending))
        out = [{k: r[k] for k in ("task", "experiment", "status", "params", "metrics")}
               for r in rows]
        if not frame:
            return out
        try:
            import pandas as pd
        except ImportError:
            raise UsageError("results(frame=True) needs pandas",
                             "pip install pandas, or use the list of dicts") from None
        flat = []
        for r in out:
            row = {"task": r["task"], "experiment": r["experiment"], "status": r["status"]}
            row.update(r["params"])
            for k, v in r["metrics"].items():
                row[f"metric.{k}" if k in r["params"] else k] = v
            flat.append(row)
        return pd.DataFrame(flat)

    def logs(self, task: str, *, attempt: int | None = None, rank: int = 0) -> Logs:
        """The output of one of this workflow's tasks (``search-0003``): its newest attempt,
        or attempt number ``attempt``; ``rank`` of a multi-node task. Read from the node, or
        from the copy kept here once the attempt has ended.

        Raises:
            UsageError: no such task or attempt, or the task never started (skipped,
                cancelled first, still waiting: the message says which).
            InfraError: the node cannot be reached and no copy is kept.
        """
        from hypercli.workflows import log_chunks, pick_attempt

        def read(st: S.State) -> Logs:
            a = pick_attempt(st, f"{self.id}/{task}", attempt, rank)
            got = {"stdout": bytearray(), "stderr": bytearray()}
            for stream, data in log_chunks(st, a, merge=False):
                got[stream] += data
            return Logs(a["task"], a["number"], a["node"],
                        got["stdout"].decode(errors="replace"),
                        got["stderr"].decode(errors="replace"))
        return self._with(read)

    def cancel(self) -> int:
        """Cancel the workflow (its running tasks are stopped, results already recorded are
        kept); returns the number of tasks cancelled.

        Raises:
            UsageError: the workflow has already ended.
        """
        from hypercli.workflows import cancel
        return self._with(lambda st: cancel(st, self.id))[1]

    def wait(self, timeout: float | None = None) -> str:
        """Wait until the workflow ends (driven by the background driver or another
        ``hyper run``); returns its status. Raises TimeoutError after ``timeout`` s."""
        from hypercli.workflows import wait
        return self._with(lambda st: wait(st, self.id, timeout=timeout))


def workflow(ref: str) -> Workflow:
    """The workflow with id ``ref`` (``quickstart-3``), or the newest of recipe name ``ref``.
    Raises UsageError: no such workflow."""
    st = _state()
    try:
        return Workflow(st.workflow(ref)["id"])
    finally:
        st.close()


def run(recipe: str | os.PathLike, *, detach: bool = False, new: bool = False,
        cluster: str | None = None, trust_new_hosts: bool = False,
        log: Callable[[str], None] | None = None, env: dict | None = None,
        env_file: str | os.PathLike | list | None = None) -> Workflow:
    """Run a recipe's workflow, as ``hyper run`` does: plan, bring the cluster up, resume the
    newest unfinished workflow of the recipe unless ``new``, and drive it to its end in this
    process. Interrupting it (Ctrl-C, a notebook's interrupt) leaves its tasks running and
    hands the workflow to the background driver; the returned handle still follows it.

    Args:
        recipe: the recipe file.
        detach: hand the workflow to the background driver and return at once
            (``hyper run -d``); :meth:`Workflow.wait` waits for its end.
        new: start a new workflow even if one could be resumed (``--new``).
        cluster: run on this cluster as it is (``--cluster``).
        trust_new_hosts: pin the host keys of SSH hosts seen for the first time.
        log: gets the progress lines ``hyper run`` prints before its loop (nodes not
            brought up, what workdir was sent where).
        env: name → value for every task, over the recipe's ``env:`` and ``env_file``
            (``--env``); a value for a name in ``secrets:`` is used as that secret's value,
            kept in memory only (:mod:`hypercli.envvars`).
        env_file: a dotenv file, or a list of them (``--env-file``).
    Returns:
        the :class:`Workflow`; its ``status`` says how it ended (a failed task does not
        raise: ``status == "failed"``).
    Raises:
        RecipeError: the recipe is wrong (naming file, line and field).
        UsageError: another process drives this workflow, an unknown ``cluster``, a task
            no node could hold, a variable or secret that is not set.
        InfraError: no node came up, or every node was lost with work left.
    """
    from hypercli.workflows import drive, prepare_run
    say = log or (lambda line: None)
    st = _state()
    try:
        wid, _, provider, nodes, lock = prepare_run(
            st, os.fspath(recipe), new=new, trust_new_hosts=trust_new_hosts, cluster=cluster,
            log=say, env=dict(env or {}),
            env_files=[os.fspath(f) for f in ([env_file] if isinstance(
                env_file, (str, os.PathLike)) else env_file or [])])
        if detach:
            from hypercli.driver import detach as detach_
            lock.release()
            detach_(st, wid)
            return Workflow(wid)
        drive(st, wid, provider, nodes, lock, on_interrupt=lambda: "leave")
        return Workflow(wid)
    finally:
        st.close()


def up(recipe: str | os.PathLike | None = None, *, provider: str | None = None,
       hosts: list[str] | tuple = (), identity_file: str | None = None,
       user: str | None = None, workers: int | None = None, name: str = "default",
       trust_new_hosts: bool = False, log: Callable[[str], None] | None = None) -> list[dict]:
    """Bring a cluster up without running tasks, as ``hyper up``: the cluster of ``recipe``,
    or one given by ``provider`` (``"local"`` or ``"ssh"``) and its options.

    Returns:
        the cluster's nodes that are up: ``nodes`` rows (``name``, ``status``, ``slots``,
        ``address``, ``info`` with CPUs, memory, GPUs).
    Raises:
        UsageError: neither ``recipe`` nor ``provider``; RecipeError: a bad recipe or option;
        InfraError: no node came up (nodes that did not are given to ``log``).
    """
    from hypercli.workflows import cluster_spec, load_with_defaults
    from hypercli.workflows import up as up_
    if recipe is not None:
        spec = load_with_defaults(os.fspath(recipe)).cluster
    elif provider:
        spec = cluster_spec(name, provider, list(hosts), workers=workers,
                            identity_file=identity_file, user=user)
    else:
        raise UsageError("give a recipe or a provider",
                         "hypercli.up('r.yaml') or hypercli.up(provider='ssh', hosts=[...])")
    st = _state()
    try:
        return up_(st, spec, trust_new_hosts=trust_new_hosts, log=log or (lambda s: None))
    finally:
        st.close()


def down(cluster: str, *, cancel: bool = False) -> list[str]:
    """Take a cluster down, as ``hyper down``: its nodes removed (SSH hosts are left
    running), its running tasks cancelled. Returns one line per resource removed.

    Args:
        cancel: cancel the workflows still running there (``--yes``); without it a cluster
            with running workflows is refused.
    Raises:
        UsageError: no such cluster; workflows still running there and not ``cancel``.
    """
    from hypercli.cluster import down as down_
    from hypercli.cluster import work_on
    st = _state()
    try:
        row = st.cluster(cluster)
        if row is not None and row["status"] == "up" and not cancel:
            work = work_on(st, cluster)
            if work:
                raise UsageError(f"cluster {cluster} has workflows not ended: "
                                 + ", ".join(w["workflow"] for w in work),
                                 "down(cluster, cancel=True) cancels them and takes it down")
        return down_(st, cluster)
    finally:
        st.close()


def status(cluster: str | None = None, *, all: bool = False) -> list[dict]:
    """Clusters and their nodes, as ``hyper status --json``: each ``{"cluster",
    "provider", "status", "nodes": [{"name", "status", "slots", "provider_id"}]}``; the
    clusters that are down only with ``all`` (or when named).

    Raises:
        UsageError: ``cluster`` names no cluster.
    """
    from hypercli.workflows import cluster_rows
    st = _state()
    try:
        return cluster_rows(st, cluster, all)[0]
    finally:
        st.close()
