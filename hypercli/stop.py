"""Stopping work from outside its driver: ``hyper cancel`` and ``hyper down``.

Live attempts are cancelled on their nodes, one agent call per node. The agent's answer says
how each attempt ended, and that answer is what gets recorded:

* an attempt that had already *exited* before the cancel reached it keeps its real result:
  exit 0 → its logs and output are collected (as a driver would) and the attempt and its task
  are ``succeeded``; another exit code → the attempt is ``failed`` (and its task cancelled,
  since a cancel ends retries). A result that exists is never relabelled ``cancelled``;
* an attempt stopped by the cancel, or never started on its node, is ``cancelled``;
* a node that cannot be reached keeps its attempts live (a later cancel or a resumed run finds
  them) and is named in the NodeError raised at the end.

Nothing here imports the scheduler or the cluster module: both import this one.
"""

from __future__ import annotations

import time

from hypercli.errors import HyperError, NodeError, UsageError
from hypercli.state import LIVE_ATTEMPT, TERMINAL_TASK, State

GRACE = 5.0  # s a cancelled task gets between SIGTERM and SIGKILL (agent ``cancel``)


def _nodes(state: State) -> dict[str, dict]:
    return {n["name"]: n for c in state.clusters() for n in state.nodes(c["name"])}


def cancel_on_nodes(state: State, attempts: list[dict], provider,
                    grace: float = GRACE) -> tuple[dict, set]:
    """Cancel live attempts on their nodes, grouped per node; collect the results of those
    that had already exited.

    Args:
        attempts: ``attempts`` rows (live).
        provider: the cluster's provider (``connect``, ``session``).
        grace: seconds between SIGTERM and SIGKILL on the node.
    Returns:
        ({attempt id: the agent's state dict, with ``collect_error`` set when an exit-0
        result could not be brought back}, names of the nodes that could not be reached).
    """
    failed: set = set()
    states: dict = {}
    by_node: dict[str, list[dict]] = {}
    for a in attempts:
        by_node.setdefault(a["node"], []).append(a)
    nodes = _nodes(state)
    workflows: dict = {}
    for node_name, rows in by_node.items():
        node = nodes.get(node_name)
        if node is None:
            continue
        try:
            client = provider.connect(node)
            try:
                got = client.call("cancel", ids=[a["id"] for a in rows], grace=grace)["states"]
            finally:
                client.close()
            states.update(got)
            _collect(state, provider, node, rows, got, workflows)
        except HyperError as e:
            state.event("node", f"cancel failed: {e}", node=node_name)
            failed.add(node_name)
    return states, failed


def _collect(state: State, provider, node: dict, rows: list[dict], got: dict,
             workflows: dict) -> None:
    """Bring back the logs and outputs of attempts that ended on their own (exit code 0 and
    not cancelled) through the provider's node session, as the driver would have."""
    by_wf: dict[str, dict] = {}
    for a in rows:
        st = got.get(a["id"]) or {}
        if st.get("state") == "exited" and not st.get("cancelled"):
            by_wf.setdefault(a["workflow"], {})[a["id"]] = st
    for wid, ended in by_wf.items():
        wf = workflows.setdefault(wid, state.workflow(wid))
        session = provider.session(node, wf)
        if session is None:
            continue
        try:
            session.after_end(ended)
        except (HyperError, OSError) as e:
            for st in ended.values():
                if st.get("code") == 0:
                    st["collect_error"] = f"collecting its results: {e}"


def record_stopped(state: State, wid: str, live: list[dict], states: dict,
                   unreachable: set, task: str | None = None) -> tuple[list[str], list[str]]:
    """Write what a cancel found into the state file (see the module docstring).

    Args:
        live: the live attempts the cancel was sent for.
        states: the agents' answers (attempt id → state dict).
        unreachable: nodes not reached (their attempts are left live).
        task: only this task is being cancelled (default: every unfinished task of ``wid``).
    Returns:
        (ids of tasks that turned out to have succeeded, ids of tasks cancelled).
    """
    now = time.time()
    att, succeeded = [], {}
    for a in live:
        if a["node"] in unreachable:
            continue
        st = states.get(a["id"]) or {}
        ended = st.get("state") == "exited" and not st.get("cancelled")
        if ended and st.get("code") == 0 and not st.get("collect_error"):
            att.append({"id": a["id"], "status": "succeeded", "exit_code": 0,
                        "metrics": st.get("metrics"), "ended_at": st.get("ended") or now,
                        "started_at": st.get("started") or a.get("started_at")})
            succeeded.setdefault(a["task"], st)
        elif ended:
            att.append({"id": a["id"], "status": "failed", "exit_code": st.get("code"),
                        "metrics": st.get("metrics"), "ended_at": st.get("ended") or now,
                        "error": st.get("collect_error") or f"exit code {st.get('code')}"})
        else:
            att.append({"id": a["id"], "status": "cancelled", "ended_at": now})
    open_tasks = [t["id"] for t in state.tasks(wid) if task == t["id"] or (
        task is None and t["status"] not in TERMINAL_TASK)]
    done = [t for t in open_tasks if t in succeeded]
    cancelled = [t for t in open_tasks if t not in succeeded]
    with state.tx():
        state.update_attempts(att)
        state.set_tasks(wid, [{"id": t, "status": "succeeded",
                               "metrics": succeeded[t].get("metrics"), "ended_at": now}
                              for t in done]
                        + [{"id": t, "status": "cancelled", "ended_at": now} for t in cancelled])
    return done, cancelled


def cancel_task(state: State, wid: str, tid: str, provider) -> int:
    """Cancel one task from outside its ``hyper run``: its live attempt is stopped on its
    node and the task marked cancelled, so it is not retried. An attempt that had already
    succeeded there keeps its result, and so does the task. Returns the number of tasks
    cancelled (0 or 1).

    Raises:
        UsageError: the task has already ended.
        NodeError: its node could not be reached (the task stays marked cancelled).
    """
    t = state.task(wid, tid)
    if t["status"] in TERMINAL_TASK:
        raise UsageError(f"task {wid}/{tid} has already ended ({t['status']})")
    # marked first, so a driver that sees the attempt end does not retry it
    state.set_tasks(wid, [{"id": tid, "status": "cancelled", "ended_at": time.time()}])
    live = state.attempts(wid, tid, status=LIVE_ATTEMPT)
    states, unreachable = cancel_on_nodes(state, live, provider)
    _, cancelled = record_stopped(state, wid, live, states, unreachable, task=tid)
    if unreachable:
        raise NodeError(", ".join(sorted(unreachable)), "unreachable: the task is marked "
                        "cancelled but its attempt may still run there",
                        "`hyper cancel` again once the node answers, or `hyper down`")
    return len(cancelled)


def cancel_workflow(state: State, wid: str, provider) -> int:
    """Cancel a workflow from outside its ``hyper run``: its live attempts are stopped on their
    nodes and its unfinished tasks marked cancelled; attempts that had already ended keep their
    results; a ``hyper run`` driving it notices and ends. Returns the number of tasks
    cancelled.

    Raises:
        NodeError: some node could not be reached (named; the workflow is marked cancelled).
    """
    state.set_workflow(wid, status="cancelling")
    live = state.attempts(wid, status=LIVE_ATTEMPT)
    states, unreachable = cancel_on_nodes(state, live, provider)
    _, cancelled = record_stopped(state, wid, live, states, unreachable)
    state.set_workflow(wid, status="cancelled", ended_at=time.time())
    if unreachable:
        raise NodeError(", ".join(sorted(unreachable)), "unreachable: the workflow is marked "
                        "cancelled but attempts may still run there",
                        "`hyper cancel` again once the node answers, or `hyper down`")
    return len(cancelled)
