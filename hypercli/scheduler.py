"""The run loop: ready tasks onto free node slots, attempts watched to their end, retries.

One :class:`NodeWorker` thread per node owns that node's agent channel: it sends launches and
cancels and long-polls the node's running attempts, posting what it learns to one queue. The
main thread alone reads that queue and writes the state file, so every decision is made in one
place, in order. Each launch is written to the state file *before* it is sent (write-ahead):
a ``hyper run`` killed at any point and started again re-sends launches the node may not have
received (the agent's launch is idempotent per attempt id) and re-attaches to attempts still
running, instead of starting them again.

Rules (paper section III-D for the re-run of lost work):
  * Experiments run in the order of their ``after`` edges; a task is ready when every experiment
    its experiment comes after has all its tasks succeeded.
  * A ready task is placed where its ``resources`` fit (:mod:`hypercli.capacity`), first come
    first served within its experiment: the first task that does not fit waits, with the
    reason recorded (``waiting for 1 GPU``), and the tasks queued after it wait too. Placing
    happens inside one write transaction of the state file, against the claims of every live
    attempt on the cluster, whatever workflow or driver it belongs to.
  * A task of ``nodes: N`` is a gang: its attempt is N ranks started together on N distinct
    nodes. A rank that fails or is lost stops the others; the attempt ends when its last rank
    has, and counts as one success (every rank exited 0) or one failure.
  * An attempt its node *refused* (a container task where the container runtime does not
    work; an ``engine:`` task where the engine is not installed; a controller's launch on a
    node that saw another driver take the workflow over) uses no retry: the task goes
    back to the queue and that node gets no more tasks that need what it lacks; when no node
    is left that could hold a ready task, the run ends (InfraError, naming what is missing).
  * A failed attempt (exit code ≠ 0) or a lost one (its node, or the agent that started it, died)
    gives the task a new attempt with the same arguments while failed + lost attempts ≤
    ``retries``.
  * An attempt that runs longer than its experiment's ``timeout:`` (s from its launch) is
    stopped, every rank (SIGTERM, then SIGKILL after CANCEL_GRACE s), and counts as a failure
    whose error says it timed out.
  * A task out of attempts fails its experiment; the experiments after it are skipped.
  * The first successful attempt of a task wins: a later success of the same task is recorded
    as ``superseded`` and changes nothing.
  * A node unreachable for LOST_AFTER seconds is *lost*: its attempts are marked lost and their
    tasks re-queued. An SSH host is lost at once when an answer of its agent is late and the
    host no longer answers a TCP handshake either (:class:`~hypercli.node.client.NodeCutOff`,
    ~3 s after a silent cut-off); a host that answers is only slow and is waited for. A lost node that answers again is first *fenced*: the attempts that were
    declared lost on it are cancelled there, and whatever they produced is discarded (nothing
    is fetched, their attempts stay ``lost``), so a node that comes back never gives a task a
    second result. Then it takes new work again.
  * Cloud nodes (providers with ``probe``): the provider is asked about a node that stopped
    answering. Terminated or preempted in the cloud's own words: lost at once. Still running
    there: the node gets up to LOST_AFTER_RUNNING seconds before it is declared lost (a
    network blip is not a preemption). A node whose agent reports the watcher's preemption
    notice is lost at once, before it vanishes. With ``replace_preempted`` (default for spot),
    a node lost that way gets a replacement launched into the cluster, which takes work as
    soon as it is up.
  * Node pools (a cloud cluster with one pool per resource shape, :mod:`hypercli.offers.
    pools`): a task goes only to nodes of its experiment's pool; after each dispatch the
    pools launch nodes for tasks that wait for room and terminate idle ones; a pool's node
    lost to the cloud is not replaced by a launch of the cluster: its pool grows again.
  * Utilisation (:mod:`hypercli.usage`): agents sample their node and running attempts every
    ``HYPER_SAMPLE_EVERY`` s and hand the samples over in the answers the node threads wait
    for anyway (no extra round trip); the main thread stores them, compacts the old ones
    every COMPACT_EVERY s, and records the warnings :class:`~hypercli.usage.Watch` finds
    (idle GPUs, a full disk) and OOM kills as events and progress notices.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import tarfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hypercli import envvars, logcopy, usage
from hypercli.capacity import ENGINE_PORTS, free_of, never_fits, place_gang, shortfall
from hypercli.errors import HyperError, InfraError, NodeError, os_reason
from hypercli.node.client import AgentFailed, NodeCutOff, engine_source
from hypercli.state import LIVE_ATTEMPT, TERMINAL_TASK, State, unwritable

POLL_WAIT = 1.0  # s a node's long poll waits for an attempt to end (cut short by new work)
#: s a launch waits, as a poll, for an attempt of its node to end: a short task's launch and end
#: come in one round trip, and a long one is reported running this long after its launch
LAUNCH_WAIT = 0.2
#: s a node thread that just reported ended attempts waits for the launches the scheduler
#: answers them with, before it polls again (a poll sent first would be cut short: one more
#: round trip per task)
DISPATCH_GRACE = 0.02
#: s a node may stay unreachable before its attempts are declared lost and re-queued. With
#: the SSH layer's keepalive (~4 s to notice a silent link) and 3 s reconnect timeouts this
#: puts a task back to work within ~10 s of its node's death (goal of the SSH issue); a silent
#: cut-off of an SSH host is found sooner, by its late answer and a TCP probe (NodeCutOff).
LOST_AFTER = 3.0
FENCE_RETRY = 5.0  # s between reconnect tries to a lost node (to fence it when it is back)
#: s a cloud node that the cloud still reports running may stay unreachable before it is lost
LOST_AFTER_RUNNING = 30.0
CANCEL_GRACE = 5.0  # s a stopped attempt gets between SIGTERM and SIGKILL on its node


def _lost_words(kind: str, text: str) -> str:
    """Why a node was lost, in a few words, for the line a restart prints (the whole text
    is in the node's events)."""
    if kind == "crash":
        return "its node thread failed"
    for word, words in (("preempted", "preempted"), ("gone", "terminated by the cloud"),
                        ("cut off", "cut off the network")):
        if word in text:
            return words
    return "host unreachable"


def _seconds(s: float) -> str:
    """A time limit as written back to the user: ``90 s``, ``30 min``, ``2 h``."""
    for unit, size in (("h", 3600), ("min", 60)):
        if s >= size and s % size == 0:
            return f"{s / size:g} {unit}"
    return f"{s:g} s"


class NodePreempted(NodeError):
    """The node's agent reported the cloud's preemption notice (see hypercli/node/watch.py)."""


class NodeWorker(threading.Thread):
    """Owns one node's agent channel (see the module docstring).

    Args:
        node: ``nodes`` row.
        connect: () → AgentClient; raises NodeError when the node is unreachable.
        events: queue receiving ``(kind, node_name, payload)`` tuples: ``states``
            ({attempt id: state}), ``error`` (message), ``lost`` (message: the node has been
            unreachable for LOST_AFTER s), ``back`` (None: a lost node answers again).
        session: the provider's NodeSession for this node and workflow, or None.
        delay: () → s the scheduler's launches take to come beyond DISPATCH_GRACE (a
            controller's write-ahead backup of them), waited for as well after ends.
    """

    def __init__(self, node: dict, connect: Callable, events: queue.Queue, session=None,
                 probe: Callable[[], str] | None = None,
                 delay: Callable[[], float] = lambda: 0.0):
        super().__init__(name=f"node-{node['name']}", daemon=True)
        self.node = node["name"]
        #: the node's hypercli folder, where its agent keeps the attempt folders
        self.root = (node.get("address") or {}).get("root") or \
            (node.get("info") or {}).get("root")
        self.connect = connect
        self.probe = probe  # the cloud's word on the node: running|preempted|gone|unknown
        self.delay = delay  # s the scheduler's launches take beyond DISPATCH_GRACE
        self.events = events
        self.session = session
        self.inbox: queue.Queue = queue.Queue()
        self.watch: set[str] = set()
        self.client = None
        self.stopping = False
        self.lost = False
        self.freed = False  # the last answer ended attempts: launches may be on their way
        #: s between copies of the node's checkpoints here (sessions that keep them on the
        #: node, ``mirror_checkpoints``): the smallest checkpoint_every of its launches
        self.mirror_every: float | None = None
        self.mirrored_at = time.monotonic()
        # ended attempts' logs up to this many bytes come back in the agent's answer
        limit = getattr(session, "inline_bytes", 0)
        self._inline = {"inline": limit} if limit else {}
        #: the node keeps the logs (they come back at the end): its running attempts' logs
        #: are copied here as they are written (hypercli/logcopy.py), kept if it is lost
        self.stream_logs = bool(limit)
        self.streamed_at = 0.0
        every = usage.sample_every()
        if every:  # the agent samples while it has work, answers carry the samples
            self._inline["sample"] = every

    def submit(self, op: str, payload) -> None:
        """Queue ``launch`` (list of specs), ``watch`` (ids), ``cancel`` (ids) or ``fence``
        (ids: cancel, and bring nothing back); wake the poll in progress."""
        self.inbox.put((op, payload))
        client = self.client  # the node thread may drop it at any moment
        if client is not None:
            client.wake()

    def stop(self) -> None:
        self.stopping = True
        self.inbox.put(("stop", None))
        client = self.client
        if client is not None:
            client.wake()

    def _report(self, states: dict, collect: bool = True) -> None:
        """Post ended/started states; ended ones are collected first (logs, outputs)."""
        ended = {k: v for k, v in states.items() if v["state"] != "running"}
        try:
            self._collect(ended, states, collect)
        finally:
            for v in states.values():
                v.pop("inline", None)  # logs brought back inline: not for the events queue
        self.watch.difference_update(ended)
        self.freed = self.freed or bool(ended)
        self.events.put(("states", self.node, states))

    def _collect(self, ended: dict, states: dict, collect: bool) -> None:
        ended = {k: v for k, v in ended.items() if v["state"] != "refused"}  # nothing ran
        if ended and collect and self.session is not None:
            try:
                self.session.after_end(ended)
                if self.stream_logs:
                    logcopy.complete(ended)
            except NodeError:
                raise
            except (HyperError, OSError, tarfile.TarError) as e:  # node fine, results not
                if isinstance(e, OSError):  # a full disk here: say where
                    where = getattr(self.session, "storage", None)
                    e = os_reason(e, str(where) if where is not None else None)
                for k, v in ended.items():
                    if v["state"] == "exited" and v.get("code") == 0 and not v.get("cancelled"):
                        states[k] = {"state": "failed", "error": f"collecting its results: {e}"}

    def _handle(self, op: str, payload) -> bool:
        """Carry out one inbox entry; True when it was a launch that also waited as a poll
        (the launch and the next poll in one round trip)."""
        if op == "launch":
            if self.session is not None:
                try:
                    self.session.before_launch(payload)
                except NodeError:
                    raise
                except (HyperError, OSError) as e:  # the node is fine; these attempts are not
                    if isinstance(e, OSError):
                        e = os_reason(e)
                    if len(payload) > 1:  # only the ones that need what failed (an image)
                        waited = False
                        for spec in payload:
                            waited = self._handle("launch", [spec]) or waited
                        return waited
                    self.events.put(("states", self.node, {
                        s["id"]: {"state": "failed", "error": f"preparing the node: {e}"}
                        for s in payload}))
                    return False
            # nothing else to send: the launch waits as the next poll would, so a short
            # task's cycle (launch, task, end) costs one round trip
            wait = LAUNCH_WAIT if self.inbox.empty() and not self.stopping else 0
            launched = {s["id"] for s in payload}
            every = min(s.get("checkpoint_every") or 60 for s in payload)
            self.mirror_every = min(self.mirror_every or every, every)
            try:
                r = self.client.call("launch", attempts=payload, ids=sorted(self.watch),
                                     wait=wait, **self._inline)
            except AgentFailed as e:  # it answered: it could not start them (a full disk)
                if len(payload) > 1:  # one by one: those it started are found running
                    waited = False
                    for spec in payload:
                        waited = self._handle("launch", [spec]) or waited
                    return waited
                self.events.put(("states", self.node, {payload[0]["id"]: {
                    "state": "failed", "error": self._why_not_started(e.reason)}}))
                return False
            self._check_preempted(r)
            self.watch.update(launched)
            self._report({k: v for k, v in r["states"].items()
                          if k in launched or v["state"] != "running"})
            return wait > 0
        if op == "watch":
            self.watch.update(payload)
        elif op in ("cancel", "fence"):
            r = self.client.call("cancel", ids=list(payload), grace=CANCEL_GRACE,
                                 **self._inline)
            self._take_samples(r)
            self._report(r["states"], collect=op == "cancel")
        return False

    def _step(self) -> None:
        if self.client is None:
            self.client = self.connect()
            if self.lost:
                self.lost = False
                self._drop_inbox()  # launches sent while it was lost belong to no one now
                self.events.put(("back", self.node, None))
        waited = False
        while True:
            try:
                if not self.watch:
                    self.freed = False
                    op, payload = self.inbox.get(timeout=POLL_WAIT)
                elif self.freed:  # give the scheduler a moment to fill the freed slots
                    self.freed = False
                    op, payload = self.inbox.get(timeout=DISPATCH_GRACE + self.delay())
                else:
                    op, payload = self.inbox.get_nowait()
            except queue.Empty:
                break
            # the wake of this entry's submit() is spent; one that comes after this point is
            # for an entry read below, or makes the next waiting call not wait: none is lost
            self.client.clear_wake()
            if op == "stop":
                return
            try:
                waited = self._handle(op, payload) or waited
            except NodeError:
                self.inbox.put((op, payload))  # retried after the reconnect
                raise
        mirror = getattr(self.session, "mirror_checkpoints", None)
        if mirror and self.watch and self.mirror_every and \
                time.monotonic() - self.mirrored_at >= self.mirror_every:
            self.mirrored_at = time.monotonic()
            try:
                mirror()
            except NodeError:
                raise
            except (HyperError, OSError, tarfile.TarError) as e:
                self.events.put(("note", self.node, f"copying checkpoints failed: {e}"))
        if self.watch and not self.stopping and not waited:
            r = self.client.call("poll", ids=sorted(self.watch), wait=POLL_WAIT, **self._inline)
            self._check_preempted(r)
            done = {k: v for k, v in r["states"].items() if v["state"] != "running"}
            if done:
                self._report(done)
        if self.stream_logs and self.watch and not self.stopping and \
                time.monotonic() - self.streamed_at >= logcopy.STREAM_EVERY:
            self.streamed_at = time.monotonic()
            logcopy.pull(self.client, sorted(self.watch))

    def run(self) -> None:
        try:
            self._run()
        except Exception as e:  # a bug must not leave the run waiting for this node forever
            self.events.put(("crash", self.node, f"{type(e).__name__}: {e}"))
            if self.client is not None:
                self.client.close()

    def _why_not_started(self, reason: str) -> str:
        """An attempt's error when its node's agent could not start it: ``no space left
        on <the node's hypercli folder>`` for a full disk (the agent's ``OSError`` names no
        path: its attempt folders are there), else the agent's words."""
        if "[Errno 28]" in reason or "[Errno 122]" in reason:  # ENOSPC, EDQUOT
            where = self.root or "the node's disk"
            return f"node {self.node} could not start it: no space left on {where}"
        return f"node {self.node} could not start it: {reason}"

    def _take_samples(self, r: dict) -> None:
        """Post the utilisation samples an answer carries (see hypercli/usage.py)."""
        if r.get("samples"):
            self.events.put(("samples", self.node, r.pop("samples")))

    def _check_preempted(self, r: dict) -> None:
        self._take_samples(r)
        if r.get("preempted"):
            notice = r["preempted"].get("notice") or "preemption notice"
            raise NodePreempted(self.node, f"preempted: {notice}")

    def _declare_lost(self, why: str) -> None:
        self.lost = True
        self.watch.clear()
        self._drop_inbox()
        self.events.put(("lost", self.node, why))

    def _run(self) -> None:
        down_since = None
        verdict = None
        while not self.stopping:
            try:
                self._step()
                down_since = verdict = None
            except NodePreempted as e:
                if self.client is not None:
                    self.client.close()
                self.client = None
                self._declare_lost(str(e))
                return  # it is going away: nothing to fence, nothing to knock on
            except NodeError as e:
                if self.client is not None:
                    self.client.close()
                self.client = None
                if self.lost:  # keep knocking, slowly, so a node that comes back is fenced
                    time.sleep(FENCE_RETRY)
                    continue
                if down_since is None:  # the first error of an outage is worth a line
                    down_since = time.monotonic()
                    self.events.put(("error", self.node, str(e)))
                    verdict = self._probe()
                    if verdict in ("preempted", "gone"):
                        self._declare_lost(f"{verdict} (the cloud says so): {e}")
                        continue
                    if isinstance(e, NodeCutOff) and verdict is None:
                        # its agent's answer was late *and* its host no longer answers TCP:
                        # cut off (a loaded or stalled host still answers; see client.py)
                        self._declare_lost(str(e))
                        continue
                waited = time.monotonic() - down_since
                if waited >= LOST_AFTER:
                    if verdict is not None and waited < LOST_AFTER_RUNNING:
                        verdict = self._probe()  # running, by the cloud's last word
                        if verdict == "running":
                            time.sleep(1.0)
                            continue
                    self._declare_lost(f"{verdict} (the cloud says so): {e}"
                                       if verdict in ("preempted", "gone") else str(e))
                    continue
                time.sleep(0.2)
        if self.client is not None:
            self.client.close()

    def _probe(self) -> str | None:
        """The cloud's word on this node, or None when its provider has none to give."""
        if self.probe is None:
            return None
        try:
            return self.probe()
        except Exception:  # the cloud API failing must not decide anything
            return "unknown"

    def _drop_inbox(self) -> None:
        while True:
            try:
                self.inbox.get_nowait()
            except queue.Empty:
                return


@dataclass
class Summary:
    """What a run ended with: task counts by status, and how it ended."""

    workflow: str
    counts: dict = field(default_factory=dict)
    interrupted: str | None = None  # None, "leave" or "cancel"
    exit_code: int = 0


class Scheduler:
    """Drives one workflow to its end (see the module docstring).

    Args:
        state: the state file.
        workflow: workflow id.
        provider: the cluster's provider (``connect``, ``output_dir``).
        nodes: the cluster's live ``nodes`` rows.
        on_interrupt: called (no arguments) in the main thread after Ctrl-C; returns
            ``"leave"`` (tasks keep running, a later ``hyper run`` re-attaches) or ``"cancel"``.
    """

    def __init__(self, state: State, workflow: str, provider, nodes: list[dict], *,
                 on_interrupt: Callable[[], str] | None = None):
        self.state, self.wid, self.provider = state, workflow, provider
        self.wf = state.workflow(workflow)
        #: experiment → {name: value} of its secrets: held in memory only, added to each
        #: launch spec sent to a node (hypercli/envvars.py); UsageError when one is not set
        self.secrets = envvars.for_workflow(self.wf)
        #: in every attempt id: another state file's workflow of the same name, on the same
        #: hosts, has other attempt ids (a node's agent answers a launch it knows with the
        #: state of that attempt); older workflows have none
        token = (self.wf.get("spec") or {}).get("token")
        self.token = f"-{token}" if token else ""
        self.on_interrupt = on_interrupt or (lambda: "leave")
        self.events: queue.Queue = queue.Queue()
        #: s a launch takes from its placement to its node thread beyond this process's own
        #: work (a controller sets it to the time its write-ahead backup takes)
        self.launch_delay = 0.0
        self.nodes = {n["name"]: n for n in nodes}
        self.up: set[str] = set(self.nodes)  # nodes that take work (not lost)
        self.workers = {n["name"]: self._worker(n) for n in nodes}
        self.replacing: set[str] = set()  # lost nodes whose replacement is being launched
        self.fenced: dict[str, set] = {}  # node → attempt ids declared lost on it
        self.exps = {e["name"]: e for e in state.experiments(workflow)}
        self.tasks = {t["id"]: t for t in state.tasks(workflow)}
        self.queue: dict[str, deque] = {e: deque() for e in self.exps}
        self.live: dict[str, dict] = {}  # attempt id → attempt row (+ task)
        #: (task, attempt number) → its ranks: {"nodes": [node per rank], "port", "ended":
        #: {rank: status}, "cause": first status that ended it (None: all fine so far),
        #: "cause_text", "metrics": rank 0's}; a task of one node is a gang of one
        self.gangs: dict[tuple, dict] = {}
        self.waits: dict[str, str | None] = {}  # task → why it waits, as recorded
        #: node → {what it lacks ("containers", "spark", "ray") → why}: it gets no more tasks
        #: that need it (the agent refused one)
        self.lacking: dict[str, dict[str, str]] = {}
        self.shard_plans: dict[str, dict | None] = {}  # experiment → its shard plan
        self.failures: dict[str, int] = {}
        self.count: dict[str, dict[str, int]] = {e: {} for e in self.exps}
        for t in self.tasks.values():
            c = self.count[t["experiment"]]
            c[t["status"]] = c.get(t["status"], 0) + 1
        self.started = time.time()
        self.watch = usage.Watch()
        #: warnings for the progress display (idle GPUs, full disks, OOM kills), oldest first
        self.notices: list[str] = []
        self.compacted = time.time()
        self.interrupted: list = []  # signals (or stop()) that ask the run to end
        #: experiment → s an attempt may run before it is stopped (``timeout:``)
        self.timeouts: dict[str, float] = (self.wf.get("spec") or {}).get("timeouts") or {}
        self.deadlines: dict[tuple, float] = {}  # (task, attempt number) → unix s
        self.lost_why: dict[str, str] = {}  # node → why it was lost, in a few words
        self.restarts: dict[str, str] = {}  # task → why its last attempt ended (to retry it)
        #: lines for the progress display: a task restarted after a node was lost, a rank
        #: failed or a time limit passed (``train-0000: node lab-0 lost (host unreachable) →
        #: gang restarted, attempt 2/2 on lab-1, lab-2``), oldest first
        self.lines: list[str] = []
        from hypercli.offers.pools import for_run
        #: the cluster's node pools, grown and shrunk from the loop (None: no pools)
        self.pools = for_run(state, self.wf, provider, self.events)

    def retire(self, node: str) -> None:
        """Take a node with no live attempt out of the run (its pool is shrinking)."""
        self.up.discard(node)
        w = self.workers.pop(node, None)
        if w is not None:
            w.stop()

    def _worker(self, n: dict) -> NodeWorker:
        probe = getattr(self.provider, "probe", None)
        return NodeWorker(n, lambda: self.provider.connect(n), self.events,
                          self.provider.session(n, self.wf),
                          probe=(lambda: probe(n)) if probe else None,
                          delay=lambda: self.launch_delay)

    def _replace(self, node: str, why: str) -> None:
        """Launch a replacement for a node the cloud took back, in a thread of its own; its
        nodes join the run through a ``replaced`` event."""
        row = self.nodes.get(node)
        if not hasattr(self.provider, "replacement") or row is None or node in self.replacing:
            return
        if not ("preempted" in why or why.startswith("gone")):
            return
        if self.pools is not None and self.pools.lost(row):
            return  # its pool grows again for the work it had
        self.replacing.add(node)
        self.state.event("node", "launching a replacement", workflow=self.wid, node=node)

        def run() -> None:
            rows: list = []
            from hypercli.cluster import replace
            st = State(self.state.path)  # this thread's own connection
            try:
                rows = replace(st, self.provider, row)
            except HyperError as e:
                self.events.put(("error", node, f"replacement not launched: {e}"))
            except Exception as e:  # a bug must not kill the run
                self.events.put(("error", node, f"replacement failed: {type(e).__name__}: {e}"))
            finally:
                st.close()
            self.events.put(("replaced", node, rows))
        threading.Thread(target=run, name=f"replace-{node}", daemon=True).start()

    def _set(self, task: dict, status: str) -> None:
        """Change a task's status in memory, keeping the per-experiment counts."""
        c = self.count[task["experiment"]]
        c[task["status"]] -= 1
        c[status] = c.get(status, 0) + 1
        task["status"] = status

    # -- setup ---------------------------------------------------------------------------
    def _recover(self) -> None:
        """Load the queue and re-attach to attempts a previous run left live."""
        ranks: dict[tuple, list] = {}
        for a in self.state.attempts(self.wid):
            ranks.setdefault((a["task"], a["number"]), []).append(a)
        for key, rows in ranks.items():
            rows.sort(key=lambda r: r["rank"])
            g = self._new_gang([r["node"] for r in rows], (rows[0]["claim"] or {}).get("port"))
            for r in rows:
                if r["status"] not in LIVE_ATTEMPT:
                    self._rank_ended(g, r["rank"], r["status"], r.get("metrics"), r["exit_code"])
            self.gangs[key] = g
            if g["cause"] in ("failed", "lost") and len(g["ended"]) == len(rows):
                self.failures[key[0]] = self.failures.get(key[0], 0) + 1
            limit = self.timeouts.get(self.tasks[key[0]]["experiment"])
            if limit and len(g["ended"]) < len(rows):
                self.deadlines[key] = min(r["created_at"] for r in rows) + limit
        lost = []
        for a in self.state.attempts(self.wid, status=LIVE_ATTEMPT):
            w = self.workers.get(a["node"])
            self.live[a["id"]] = a
            if w is None:  # its node left the cluster: the attempt is lost, the task re-queued
                lost.append(a)
            elif a["status"] == "launching":
                w.submit("launch", [self._spec(self.tasks[a["task"]], a)])
            else:
                w.submit("watch", [a["id"]])
        att_upd, task_upd = [], []
        for a in lost:
            u, t = self._ended(a, {"state": "lost"}, "its node is no longer in the cluster")
            att_upd.append(u)
            if t:
                task_upd.append(t)
        if att_upd:
            with self.state.tx():
                self.state.update_attempts(att_upd)
                self.state.set_tasks(self.wid, task_upd)
        for a in list(self.live.values()):  # a rank of a gang that had already failed
            if self.gangs[(a["task"], a["number"])]["cause"] and a["node"] in self.workers:
                self.workers[a["node"]].submit("cancel", [a["id"]])
        queued = {tid for q in self.queue.values() for tid in q}
        live_tasks = {a["task"] for a in self.live.values()}
        for t in self.tasks.values():
            if t["id"] in queued:
                continue
            if t["status"] == "pending" or (t["status"] == "running"
                                            and t["id"] not in live_tasks):
                self._set(t, "pending")
                self.queue[t["experiment"]].append(t["id"])

    @staticmethod
    def _new_gang(nodes: list[str], port: int | None) -> dict:
        return {"nodes": nodes, "port": port, "ended": {}, "cause": None, "cause_text": None,
                "metrics": None}

    @staticmethod
    def _rank_ended(g: dict, rank: int, status: str, metrics, code=None) -> None:
        """Note one rank's end in its gang; the first rank that did not succeed is the
        cause that ends the whole attempt."""
        g["ended"][rank] = status
        if rank == 0:
            g["metrics"] = metrics
        if status not in ("succeeded", "superseded") and g["cause"] is None:
            g["cause"] = status
            g["cause_text"] = f"rank {rank} {status}" + (
                f" (exit code {code})" if status == "failed" and code is not None else "")

    def _address(self, node: str) -> str:
        """The address other nodes reach a node at: its private address when it has one."""
        row = self.nodes[node]
        return ((row.get("info") or {}).get("private_address")
                or (row.get("address") or {}).get("host") or "127.0.0.1")

    def _spec(self, task: dict, a: dict) -> dict:
        """The launch spec of attempt row ``a`` (id, number, node, rank, claim)."""
        node, rank, number = a["node"], a.get("rank") or 0, a["number"]
        row = self.nodes[node]
        cwd, output, outputs = self.provider.task_paths(row, self.wf, task["id"])
        exp = self.exps[task["experiment"]]
        claim = a.get("claim") or {}
        gpus = list(claim.get("gpus") or [])
        g = self.gangs.get((task["id"], number))
        size = len(g["nodes"]) if g else 1
        # Python's output reaches `hyper logs -f` as it is printed, not when an 8 KiB pipe
        # buffer fills (torchrun's log tee writes to its stdout with no flush), as SkyPilot's
        # tasks get it; the recipe's env may set it to "" to turn it off
        env = {"PYTHONUNBUFFERED": "1", **task["env"]}
        env.update({
            "HYPER_TASK_ID": task["id"], "HYPER_EXPERIMENT": task["experiment"],
            "HYPER_WORKFLOW": self.wid, "HYPER_ATTEMPT": str(number), "HYPER_NODE": node,
            "HYPER_OUTPUT": output, "HYPER_OUTPUTS": outputs,
            "HYPER_PARAMS": json.dumps(task["params"], ensure_ascii=False),
            "HYPER_GPUS": ",".join(map(str, gpus)), "HYPER_CPUS": f"{claim.get('cpus', 1):g}",
            "HYPER_NODE_RANK": str(rank), "HYPER_NUM_NODES": str(size),
            "HYPER_GPUS_PER_NODE": str(len(gpus)),
        })
        if gpus or (row.get("info") or {}).get("gpus"):  # exactly its own GPUs, or none
            env["NVIDIA_VISIBLE_DEVICES"] = ",".join(map(str, gpus)) or "void"
            # in a container the devices given are renumbered from 0
            shown = range(len(gpus)) if exp["image"] else gpus
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, shown))
        files = {}
        shards = self._shards(task["experiment"])
        if shards is not None:
            k = int(task["params"][shards["param"]])
            b = shards["bounds"]
            files["HYPER_SHARD_FILES"] = "".join(p + "\n" for p in shards["files"][b[k]:b[k + 1]])
        if exp.get("engine"):
            ips = [self._address(n) for n in (g["nodes"] if g else [node])]
            env.update({"HYPER_ENGINE_PORT": str(g["port"]), "HYPER_NODE_IP": ips[rank],
                        "HYPER_MASTER_ADDR": ips[0]})
            if claim.get("memory"):
                env["HYPER_MEMORY"] = str(int(claim["memory"]))
        if size > 1:
            ips = [self._address(n) for n in g["nodes"]]
            port = str(g["port"])
            env.update({"HYPER_NODE_IPS": "\n".join(ips), "HYPER_NODE_IP": ips[rank],
                        "HYPER_MASTER_ADDR": ips[0],
                        "HYPER_MASTER_PORT": port, "MASTER_ADDR": ips[0], "MASTER_PORT": port,
                        "WORLD_SIZE": str(size), "RANK": str(rank), "NODE_RANK": str(rank),
                        # torchrun's names for one process per node (pytorch.org, torchrun
                        # "Environment Variables"): a script launched without it finds them
                        "GROUP_RANK": str(rank), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"})
            slots = max(1, len(gpus))
            files["HYPER_HOSTFILE"] = "".join(f"{ip} slots={slots}\n" for ip in ips)
        spec = {"id": a["id"], "script": task["command"], "env": env, "cwd": cwd,
                "output": output, "outputs": outputs, "image": exp["image"],
                "after": list(exp["after"]), "gpus": gpus,
                "checkpoint_every": exp.get("checkpoint_every") or 60}
        if files:
            spec["files"] = files
        if self.secrets.get(task["experiment"]):  # sent to the node's agent, kept nowhere
            spec["secrets"] = dict(self.secrets[task["experiment"]])
        if exp.get("engine"):
            spec["engine"] = {"kind": exp["engine"], "source": engine_source()}
        if size > 1:
            spec["bind_address"] = env["HYPER_NODE_IP"]
        if claim.get("memory"):
            spec["limits"] = {"memory": claim["memory"]}
        return spec

    # -- decisions -----------------------------------------------------------------------
    def _exp_state(self, name: str) -> str:
        """'blocked' (deps not done), 'ready', 'dead' (a dependency failed)."""
        for dep in self.exps[name]["after"]:
            counts = self.count[dep]
            if any(counts.get(s) for s in ("failed", "skipped", "cancelled")):
                return "dead"
            if counts.get("succeeded", 0) < sum(counts.values()):
                return "blocked"
        return "ready"

    def _shards(self, experiment: str) -> dict | None:
        """An experiment's shard plan (``shards.plan_file``), read once; None without."""
        if experiment not in self.shard_plans:
            from hypercli.shards import plan_file
            path = plan_file(self.wid, experiment)
            self.shard_plans[experiment] = (json.loads(path.read_text())
                                            if path.exists() else None)
        return self.shard_plans[experiment]

    def _free(self) -> dict:
        """node → :class:`~hypercli.capacity.Free` of the nodes taking work, less the claims
        of every live attempt there, of any workflow (the state file's leases)."""
        claims: dict[str, list] = {}
        for c in self.state.claims(self.up):
            claims.setdefault(c["node"], []).append(c["claim"])
        return {n: free_of(self.nodes[n], claims.get(n, [])) for n in sorted(self.up)}

    def _usable(self, name: str, free: dict) -> dict:
        """The nodes of ``free`` that can run experiment ``name`` (a container experiment
        skips nodes whose container runtime failed). The values are shared, not copied."""
        if self.pools is not None:
            free = self.pools.usable(name, free, self.nodes)
        needs = self._needs(name)
        if not needs or not self.lacking:
            return free
        return {n: f for n, f in free.items() if not needs & self.lacking.get(n, {}).keys()}

    def _needs(self, name: str) -> set:
        """What experiment ``name`` needs of a node beyond capacity: "containers", its engine."""
        exp = self.exps[name]
        return {k for k in ("containers" if exp["image"] else None, exp.get("engine")) if k}

    def _dispatch(self) -> None:
        ready = []
        for name in self.exps:
            if not self.queue[name]:
                continue
            st = self._exp_state(name)
            if st == "dead":
                self._skip(name)
            elif st == "ready":
                ready.append(name)
        if not ready or not self.up:
            return
        batches: dict[str, list] = {}
        waits: dict[str, str] = {}
        with self.state.tx():  # placed under the write lock: no other driver places meanwhile
            # a `hyper cancel` recorded since the last look is seen before anything is placed
            # (it takes the same lock): a cancelled task is never launched, and one cancelled
            # after this finds its attempt recorded and stops it on its node
            if self._cancelled_elsewhere():
                return  # the whole workflow: the run's loop cancels it
            free = self._free()
            rows = []
            for name in ready:
                rows += self._place(name, free, batches, waits)
            if rows:
                self.state.start_attempts(rows)
        for node, specs in batches.items():
            self.workers[node].submit("launch", specs)
        changed = [{"id": t, "wait": w} for t, w in waits.items() if self.waits.get(t) != w]
        if changed:
            self.state.set_tasks(self.wid, changed)
            self.waits.update(waits)

    def _place(self, name: str, free: dict, batches: dict, waits: dict) -> list:
        """Place the queued tasks of one experiment, first come first served, while they
        fit; returns the attempt rows to record. The first task that does not fit waits
        (its reason in ``waits``) and so do the ones queued after it."""
        q, exp = self.queue[name], self.exps[name]
        need = exp.get("resources") or {}
        free = self._usable(name, free)
        cap = exp["workers"]
        running = len({a["task"] for a in self.live.values()
                       if self.tasks[a["task"]]["experiment"] == name}) if cap else 0
        rows = []
        while q and (not cap or running < cap):
            task = self.tasks[q[0]]
            nodes = place_gang(need, free)
            if nodes is None:
                waits[task["id"]] = shortfall(need, free)
                break
            q.popleft()
            self.waits.pop(task["id"], None)  # start_attempts clears it in the state file
            number = task["attempts"] + 1
            gang = len(nodes) > 1
            ports = ENGINE_PORTS if exp.get("engine") else int(gang)
            claims = [free[n].take(need, port=ports if r == 0 else 0)
                      for r, n in enumerate(nodes)]
            self.gangs[(task["id"], number)] = self._new_gang(nodes, claims[0].get("port"))
            if self.timeouts.get(name):
                self.deadlines[(task["id"], number)] = time.time() + self.timeouts[name]
            self._set(task, "running")
            task["attempts"] = number
            running += 1
            why = self.restarts.pop(task["id"], None)
            if why:
                line = (f"{task['id']}: {why} → {'gang ' if gang else ''}restarted, attempt "
                        f"{number}/{exp['retries'] + 1} on {', '.join(nodes)}")
                self.lines.append(line)
                self.state.event("attempt", line, workflow=self.wid, task=task["id"])
            for rank, node in enumerate(nodes):
                aid = f"{self.wid}.{task['id']}.{number}{self.token}" + (
                    f"-r{rank}" if gang else "")
                a = {"id": aid, "task": task["id"], "node": node, "number": number,
                     "rank": rank, "claim": claims[rank], "status": "launching"}
                self.live[aid] = a
                rows.append((aid, self.wid, task["id"], number, node, rank, claims[rank]))
                batches.setdefault(node, []).append(self._spec(task, a))
        return rows

    def _skip(self, exp: str) -> None:
        ids = list(self.queue[exp])
        self.queue[exp].clear()
        for tid in ids:
            self._set(self.tasks[tid], "skipped")
        self.state.set_tasks(self.wid, [{"id": t, "status": "skipped", "ended_at": time.time()}
                                        for t in ids])
        self.state.event("workflow", f"experiment {exp} skipped: an experiment it comes after "
                         "failed", workflow=self.wid)

    def _ended(self, a: dict, st: dict, why: str | None = None) -> tuple[dict, dict | None]:
        """Attempt and task updates for an attempt (one rank) that is no longer running. The
        task is decided when the last rank of its attempt has ended: a rank that fails, or
        is lost, stops the others, and the attempt counts as one failure."""
        task = self.tasks[a["task"]]
        now = time.time()
        code = st.get("code")
        if st["state"] == "exited":
            status = "cancelled" if st.get("cancelled") else (
                "succeeded" if code == 0 else "failed")
        elif st["state"] in ("failed", "refused"):
            status = st["state"]
        else:
            status = "lost"
        if task["status"] == "succeeded" and status == "succeeded":
            status = "superseded"
        if status == "lost" and not why:
            why = self._lost_why(a["node"])
        key = (a["task"], a["number"])
        g = self.gangs.setdefault(key, self._new_gang([a["node"]], None))
        if status == "cancelled" and g.get("timed_out"):  # stopped at its time limit
            status, why = "failed", why or g["cause_text"]
        if status == "cancelled" and g["cause"] and task["status"] not in TERMINAL_TASK:
            why = why or f"stopped with its gang: {g['cause_text']}"
        upd = {"id": a["id"], "status": status, "exit_code": code,
               "metrics": st.get("metrics"), "ended_at": st.get("ended") or now,
               "started_at": st.get("started"),
               "error": why or (f"exit code {code}" if status == "failed" else None)}
        if st["state"] in ("failed", "refused"):  # never launched: the node could not run it
            upd["error"] = st.get("error")
        if st.get("oom") and not why:  # the kernel's OOM killer, as its node's agent saw
            upd["error"] = st["oom"]
            self._notice("attempt", f"{a['task']} (attempt {a['number']}) was {st['oom']}",
                         node=a["node"], attempt=a["id"], task=a["task"])
        self.live.pop(a["id"], None)
        if status == "lost" and "restart_why" not in g:  # the cause, even when a rank that
            # saw its peer go failed first
            g["restart_why"] = f"node {a['node']} lost ({self.lost_why.get(a['node'], why)})"
        self._rank_ended(g, a.get("rank") or 0, status, st.get("metrics"), code)
        others = [x for x in self.live.values() if (x["task"], x["number"]) == key]
        if g["cause"] and others and not g.get("stopping"):
            g["stopping"] = True
            for x in others:  # all or nothing: the other ranks of this attempt stop too
                if x["node"] in self.up:
                    self.workers[x["node"]].submit("cancel", [x["id"]])
        if others:
            return upd, None
        self.deadlines.pop(key, None)
        outcome = g["cause"] or ("superseded" if status == "superseded" else "succeeded")
        if outcome == "superseded" or task["status"] in TERMINAL_TASK:
            return upd, None
        if outcome == "succeeded":
            self._set(task, "succeeded")
            return upd, {"id": task["id"], "status": "succeeded", "metrics": g["metrics"],
                         "ended_at": now}
        if outcome == "cancelled":
            self._set(task, "cancelled")
            return upd, {"id": task["id"], "status": "cancelled", "ended_at": now}
        if outcome == "refused":  # the node's fault: the task keeps its retries
            self._set(task, "pending")
            self.queue[task["experiment"]].appendleft(task["id"])
            return upd, {"id": task["id"], "status": "pending"}
        self.failures[task["id"]] = self.failures.get(task["id"], 0) + 1
        if self.failures[task["id"]] <= self.exps[task["experiment"]]["retries"]:
            self.restarts[task["id"]] = g.get("restart_why") or g["cause_text"] or outcome
            self._set(task, "pending")
            self.queue[task["experiment"]].appendleft(task["id"])
            return upd, {"id": task["id"], "status": "pending"}
        self._set(task, "failed")
        return upd, {"id": task["id"], "status": "failed", "metrics": g["metrics"],
                     "ended_at": now}

    def _check_timeouts(self) -> None:
        """Stop every attempt that has run longer than its experiment's ``timeout:``: all its
        ranks are cancelled on their nodes (SIGTERM, then SIGKILL after the agent's grace)
        and the attempt counts as one failure (retried within ``retries``)."""
        now = time.time()
        for key, deadline in list(self.deadlines.items()):
            if now < deadline:
                continue
            del self.deadlines[key]
            g = self.gangs.get(key)
            ranks = [a for a in self.live.values() if (a["task"], a["number"]) == key]
            if g is None or g["cause"] or not ranks:
                continue
            limit = self.timeouts[self.tasks[key[0]]["experiment"]]
            g.update(cause="failed", timed_out=True, stopping=True,
                     cause_text=f"timed out after {_seconds(limit)}")
            self._notice("attempt", f"{key[0]} (attempt {key[1]}) timed out after "
                         f"{_seconds(limit)}: stopping it (SIGTERM, then SIGKILL after "
                         f"{CANCEL_GRACE:g} s)", task=key[0])
            for a in ranks:
                if a["node"] in self.up:
                    self.workers[a["node"]].submit("cancel", [a["id"]])

    def _lost_why(self, node: str) -> str:
        """Why an attempt its node's agent reports lost (no exit status, and nothing runs
        it) was lost: a full disk where a local node keeps its attempt folders (it could not
        write the exit status), else that the agent that ran it stopped."""
        root = (self.nodes.get(node) or {}).get("address", {}).get("root")
        if getattr(self.provider, "name", None) == "local" and root:
            why = unwritable(Path(root) / "tasks")
            if why:
                return f"lost: its exit status could not be written ({why})"
        return "lost: its node has no exit status for it (the agent that ran it stopped)"

    # -- events --------------------------------------------------------------------------
    def _samples(self, node: str, samples: list) -> None:
        """Store an answer's utilisation samples; record the warnings they raise."""
        rows = usage.rows_of(node, samples)
        self.state.add_samples(rows)
        for w in self.watch.add(node, rows, self.live):
            self._notice("attempt" if w["attempt"] else "node", w["message"], node=node,
                         attempt=w["attempt"], task=w["task"])
            for aid in w.get("attempts") or []:
                a = self.live.get(aid)
                if a is not None:
                    self.state.event("attempt", w["message"], workflow=self.wid,
                                     node=node, attempt=aid, task=a["task"])
        if time.time() - self.compacted >= usage.COMPACT_EVERY:
            self.compacted = time.time()
            self.state.compact_samples(usage.compact_cut(time.time()), bucket=usage.MEAN_SPAN)

    def _notice(self, kind: str, message: str, **ids) -> None:
        """An event in the state file and a line for the progress display."""
        self.state.event(kind, message, workflow=self.wid, **ids)
        self.notices.append(message)

    def _apply(self, kind: str, node: str, payload) -> None:
        if kind == "samples":
            self._samples(node, payload)
            return
        if kind == "note":
            self.state.event("node", payload, workflow=self.wid, node=node)
            return
        if kind == "error":
            self.state.event("node", f"unreachable: {payload}", workflow=self.wid, node=node)
            return
        if kind in ("replaced", "joined"):  # payload: the new nodes' rows (none: failed)
            self.replacing.discard(node)
            if kind == "joined":  # node: the pool that grew
                payload = self.pools.joined(node, payload)
            for row in payload:
                if row["name"] in self.workers:
                    continue
                self.state.event("node", f"joined the run, replacing {node}" if kind ==
                                 "replaced" else f"joined the run (pool {node})",
                                 workflow=self.wid, node=row["name"])
                self.nodes[row["name"]] = row
                self.up.add(row["name"])
                self.workers[row["name"]] = self._worker(row)
                self.workers[row["name"]].start()
            return
        payload_text = payload if isinstance(payload, str) else ""
        if kind in ("lost", "crash"):
            self.state.event("node", f"{kind}: {payload}", workflow=self.wid, node=node)
            self.lost_why[node] = _lost_words(kind, payload_text)
            self.state.set_node_status(node, "lost")
            if kind == "lost":
                self._replace(node, payload_text)
            self.up.discard(node)
            payload = {a["id"]: {"state": "lost"} for a in self.live.values()
                       if a["node"] == node}
            self.fenced.setdefault(node, set()).update(payload)
        if kind == "back":
            self.state.event("node", "back: fencing the attempts declared lost on it",
                             workflow=self.wid, node=node)
            self.state.set_node_status(node, "up")
            self.up.add(node)
            if self.fenced.get(node):
                self.workers[node].submit("fence", sorted(self.fenced[node]))
            return
        att_upd, task_upd = [], []
        for aid, st in payload.items():
            a = self.live.get(aid)
            if a is None:
                if aid in self.fenced.get(node, ()) and st["state"] != "running":
                    self.fenced[node].discard(aid)
                    note = ("fenced: it ended with exit code %s after its node was declared "
                            "lost; result discarded" % st.get("code"))
                    att_upd.append({"id": aid, "error": note})
                continue
            lacks = st.get("lacks", "containers")  # null: nothing the node lacks (a lease)
            if st["state"] == "refused" and lacks and lacks not in self.lacking.get(node, {}):
                self.lacking.setdefault(node, {})[lacks] = st.get("error") or "refused"
                what = "container" if lacks == "containers" else lacks
                self.state.event("node", f"no {what} tasks here any more: {st.get('error')}",
                                 workflow=self.wid, node=node)
            if st["state"] == "running":
                if a["status"] == "launching":
                    a["status"] = "running"
                    att_upd.append({"id": aid, "status": "running",
                                    "started_at": st.get("started") or time.time()})
                continue
            u, t = self._ended(a, st, {"lost": "node lost", "crash": f"node thread failed: "
                                       f"{payload_text}"}.get(kind))
            att_upd.append(u)
            if t:
                task_upd.append(t)
        if att_upd or task_upd:
            with self.state.tx():
                self.state.update_attempts(att_upd)
                self.state.set_tasks(self.wid, task_upd)

    def _drain(self, timeout: float) -> None:
        try:
            ev = self.events.get(timeout=timeout)
        except queue.Empty:
            return
        while True:
            self._apply(*ev)
            try:
                ev = self.events.get_nowait()
            except queue.Empty:
                return

    # -- the loop ------------------------------------------------------------------------
    def _check_stuck(self) -> None:
        """Nothing runs and nothing is coming: a ready task that the nodes left could never
        hold would wait forever.

        Raises:
            InfraError: every node was lost, or too few are left for a ready task.
        """
        if not self.up:
            raise InfraError(f"every node of workflow {self.wid}'s cluster was lost",
                             "`hyper status` shows the nodes; `hyper run` again resumes")
        free = None
        for name, q in self.queue.items():
            if q and self._exp_state(name) == "ready":
                free = free or self._free()
                why = never_fits(self.exps[name].get("resources") or {},
                                 self._usable(name, free))
                lacked = sorted((n, k, e) for n, ks in self.lacking.items()
                                for k, e in ks.items() if k in self._needs(name))
                if why and lacked:
                    need = ("runs in a container" if lacked[0][1] == "containers"
                            else f"needs the {lacked[0][1]} engine")
                    why = f"it {need} and too few nodes left have it: " + "; ".join(
                        f"{n}: {e}" for n, _, e in lacked)
                if why and not self.state.claims(self.up):
                    lost = sorted(set(self.nodes) - self.up)
                    if lost and not lacked and not never_fits(
                            self.exps[name].get("resources") or {},
                            {n: free_of(self.nodes[n], []) for n in self.nodes}):
                        # it fitted the whole cluster: the lost nodes are the cause
                        ranks = int((self.exps[name].get("resources") or {}).get("nodes") or 1)
                        raise InfraError(
                            f"experiment {name} cannot run on the nodes left: it needs "
                            f"{ranks} node{'s' if ranks != 1 else ''} and {len(self.up)} "
                            f"{'is' if len(self.up) == 1 else 'are'} left after "
                            f"{', '.join(lost)} {'was' if len(lost) == 1 else 'were'} lost",
                            "`hyper status` shows the nodes; when they are back (or the "
                            "cluster has others), `hyper run` again resumes")
                    raise InfraError(f"experiment {name} cannot run on the nodes left: {why}",
                                     "`hyper status` shows the nodes; `hyper run` again "
                                     "resumes")

    def snapshot(self) -> dict:
        """experiment → {status: count} of the run in progress (for progress displays)."""
        return {e: {k: v for k, v in c.items() if v} for e, c in self.count.items()}

    def _done(self) -> bool:
        return not self.live and not any(n for c in self.count.values()
                                         for s, n in c.items() if s not in TERMINAL_TASK)

    def _cancelled_elsewhere(self) -> bool:
        """Pick up ``hyper cancel`` from another process: True when the whole workflow was
        cancelled; single cancelled tasks are taken off the queue."""
        if self.state.workflow(self.wid)["status"] in ("cancelling", "cancelled"):
            return True
        for t in self.state.tasks(self.wid, status=["cancelled"]):
            mine = self.tasks[t["id"]]
            if mine["status"] not in TERMINAL_TASK:
                if mine["status"] == "pending":
                    self.queue[mine["experiment"]].remove(mine["id"])
                self._set(mine, "cancelled")
                for a in self.live.values():  # launched just before the cancel was seen
                    if a["task"] == t["id"] and a["node"] in self.workers:
                        self.workers[a["node"]].submit("cancel", [a["id"]])
        return False

    def cancel(self) -> None:
        """Cancel every live attempt on its node and every task not yet ended; waits for the
        nodes to confirm (at most ~15 s)."""
        by_node: dict[str, list] = {}
        for a in self.live.values():
            by_node.setdefault(a["node"], []).append(a["id"])
        for node, ids in by_node.items():
            if node in self.workers and self.workers[node].is_alive():
                self.workers[node].submit("cancel", ids)
        deadline = time.time() + 15
        while self.live and time.time() < deadline:
            self._drain(0.2)
        now = time.time()
        ids = [t["id"] for t in self.tasks.values() if t["status"] not in TERMINAL_TASK]
        for tid in ids:
            self._set(self.tasks[tid], "cancelled")
        with self.state.tx():
            self.state.update_attempts([{"id": a, "status": "cancelled", "ended_at": now}
                                        for a in self.live])
            self.state.set_tasks(self.wid, [{"id": t, "status": "cancelled", "ended_at": now}
                                            for t in ids])
        self.live.clear()

    def stop(self) -> None:
        """Make a ``run`` in another thread end soon, leaving the tasks running (as SIGTERM
        does to a run in the main thread); a later run re-attaches."""
        self.interrupted.append(signal.SIGTERM)

    def run(self, progress: Callable[[Scheduler], None] | None = None,
            refresh: float = 0.25) -> Summary:
        """Run the workflow to its end, a cancel, or an interrupt.

        Args:
            progress: called with this scheduler about every ``refresh`` seconds.
        Returns:
            a Summary; ``exit_code`` 0 when every task succeeded, 1 otherwise, 130 after an
            interrupt that left tasks running.
        Raises:
            InfraError: every node of the cluster was lost with work left to do.
        """
        with self.state.tx():  # under the lock `hyper cancel` takes to mark it
            before = self.state.workflow(self.wid)["status"]
            if before not in ("cancelling", "cancelled"):
                self.state.set_workflow(self.wid, driver_pid=os.getpid(), status="running")
            elif before == "cancelling":  # its first look for cancels finishes the cancel
                self.state.set_workflow(self.wid, driver_pid=os.getpid())
        if before == "cancelled":
            # cancelled after this driver was handed it but before it began (a detached
            # workflow's background driver starting late): never driven, and the cancel's
            # record is left as it is, not turned back into a running workflow
            summary = Summary(self.wid, interrupted="cancel", exit_code=1)
            for t in self.state.tasks(self.wid):
                summary.counts[t["status"]] = summary.counts.get(t["status"], 0) + 1
            return summary
        stop_checkpoints = self.state.checkpoint_in_background()
        interrupted = self.interrupted
        old = {}
        if threading.current_thread() is threading.main_thread():  # else: ``stop()``
            old = {s: signal.signal(s, lambda signum, frame: interrupted.append(signum))
                   for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
        for w in self.workers.values():
            w.start()
        summary = Summary(self.wid)
        last_check = 0.0
        try:
            self._recover()
            while True:
                if interrupted:
                    choice = ("leave" if interrupted[0] != signal.SIGINT  # SIGTERM, SIGHUP
                              else self.on_interrupt())
                    summary.interrupted = choice
                    if choice == "cancel":
                        self.cancel()
                    break
                if time.time() - last_check > 0.5:
                    last_check = time.time()
                    if self._cancelled_elsewhere():
                        self.cancel()
                        summary.interrupted = "cancel"
                        break
                if self.deadlines:
                    self._check_timeouts()
                self._dispatch()
                if self.pools is not None:
                    self.pools.tick(self)
                if self._done():
                    break
                if not self.live and not self.replacing and not (
                        self.pools is not None and self.pools.busy()):
                    if self.pools is not None:
                        self.pools.check(self)
                    self._check_stuck()
                if progress:
                    progress(self)
                self._drain(refresh)
            if self.pools is not None and summary.interrupted != "leave":
                self.pools.finish(self)  # the pools whose experiments ended go away
        finally:
            for s, h in old.items():
                signal.signal(s, h)
            for w in self.workers.values():
                w.stop()
            for w in self.workers.values():
                w.join(timeout=10)
            stop_checkpoints()
        summary.counts = {}
        for t in self.tasks.values():
            summary.counts[t["status"]] = summary.counts.get(t["status"], 0) + 1
        if summary.interrupted == "leave":
            summary.exit_code = 130
            self.state.set_workflow(self.wid, driver_pid=None)
        else:
            ok = summary.counts.get("succeeded", 0) == len(self.tasks)
            status = "cancelled" if summary.interrupted else ("succeeded" if ok else "failed")
            summary.exit_code = 0 if ok else 1
            with self.state.tx():
                stored = self.state.workflow(self.wid)
                if status == "cancelled" and stored["status"] == "cancelled" \
                        and stored["ended_at"]:
                    # `hyper cancel` from another process recorded the end: its time is kept
                    self.state.set_workflow(self.wid, driver_pid=None)
                else:
                    self.state.set_workflow(self.wid, status=status, ended_at=time.time(),
                                            driver_pid=None)
            self.state.event("workflow", f"{status}: {summary.counts}", workflow=self.wid)
        if progress:
            progress(self)
        return summary
