"""The controller's side: take a workflow handed over, drive it with the same scheduler as
``hyper run``, back it up after every change, answer the user's machine.

Runs on the controller host as ``python -m hypercli.controller OP`` with ``HYPER_HOME`` the
controller's own folder (``~/.hyper/controller``); the user's machine sends each request over
one SSH connection (:mod:`hypercli.controller.client`). The service (``serve``) is one process
per controller home, holding an flock on ``locks/controller.lock`` (its pid inside), started
in a session of its own so the SSH connection that started it may end. It drives every
workflow of its state file whose lease it holds, each in a thread with a
:class:`~hypercli.scheduler.Scheduler` over a :class:`BackedState`: the attempts a committed
transaction is about to launch are written to the replicas (:mod:`hypercli.controller.backup`)
before they start: a launch to a replica node carries its own intent (its witness, which that
node's agent writes before it starts the attempt, :func:`_gated`) and goes at once; a launch
to any other node waits in its node's thread until the group commit (:class:`_Intents`, one
append per APPEND_GAP s at most, the scheduler never waiting) has it on a majority; the
whole records follow within FLUSH_EVERY s of any change, so whoever takes the workflow over
knows every attempt that may have started, but for the gap the backup module names. A lease
it loses (another driver took the workflow) stops that thread at once, leaving the tasks
running. It exits after IDLE_EXIT s with nothing to drive.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import io
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

from hypercli import state as S
from hypercli.controller.backup import LEASE_TTL, LeaseLost, Replicas, pack
from hypercli.errors import HyperError

IDLE_EXIT = 30.0  #: s with nothing to drive before the service exits
LOOK_EVERY = 0.5  #: s between looks for workflows to drive
RENEW_EVERY = LEASE_TTL / 4  #: s between lease renewals of a workflow being driven
#: s at most between a change that launches nothing and its backup (several go in one)
FLUSH_EVERY = 1.0
#: s at most between whole copies of the records; the writes between them carry only the
#: rows changed since the write before (:class:`_Records`)
WHOLE_EVERY = 30.0
#: s at most that a node thread which reported ends waits for the launches answering them
#: (twice the intents' moving time: the scheduler's launch_delay), before it polls again
MAX_DELAY = 0.25
#: s at least between the starts of two intent appends: the launches placed meanwhile go in
#: one (a launch to a replica node does not wait for it: it carries its witness, _gated)
APPEND_GAP = 0.05
#: a test seam, read only here: when set in the service's environment, it makes no intent
#: append and no write of the records after the handover's, and sends launches as if their
#: appends were on a majority (unsafe: for injecting a controller that dies first)
TEST_NO_APPENDS = "HYPER_TEST_UNSAFE_NO_APPENDS"

log = logging.getLogger("hypercli.controller")


class BackedState(S.State):
    """A state file whose every committed write transaction is followed by
    ``after_commit(must, rows)``: ``rows`` are the attempts the transaction recorded as
    about to be launched (``start_attempts`` rows), which must be backed up before they are
    launched (write-ahead); ``must`` is True for the first transaction, whose whole
    records must be; other changes may be written a moment later, several at once. An
    exception from it reaches the writer (the scheduler stops)."""

    def __init__(self, after_commit, path=None):
        self.ready = False  # opening the file (migrations) is not a change to back up
        super().__init__(path)
        self.after_commit = after_commit
        self.must = True  # the first change: nothing of this drive is backed up yet
        self.rows: list = []
        self.ready = True

    def start_attempts(self, rows: list[tuple]) -> None:
        super().start_attempts(rows)
        self.rows += [list(r) for r in rows]

    @contextlib.contextmanager
    def tx(self):
        outer = not self.db.in_transaction
        with super().tx() as db:
            yield db
        if outer and self.ready:
            must, self.must = self.must, False
            rows, self.rows = self.rows, []
            self.after_commit(must, rows)


class _Batch:
    """One group of launch intents: ``done`` is set once they are on a majority of the
    replicas, or ``error`` says why they are not; ``rows``: attempt id → its row."""

    def __init__(self):
        self.done = threading.Event()
        self.error: HyperError | None = None
        self.rows: dict = {}


class _Intents(threading.Thread):
    """Group commit of launch intents (Gray and Reuter, *Transaction Processing*, 1993,
    section 9.4.7; the DeWitt et al. group commit of 1984): the rows recorded while one
    append is on its way to the replicas go together in the next one, so the replicas' time
    per append (a round trip, an fsync on each) is shared by every launch placed meanwhile,
    and the scheduler never waits for it. A launch to a node that is not a replica waits
    for its batch in its node's thread (:func:`_gated`) before it is sent: still
    write-ahead; one to a replica node carries its own intent (its witness) and goes at
    once. Appends start at least ``gap`` s apart, so that many launches share one.
    """

    def __init__(self, replicas: Replicas, failed, took, gap: float = APPEND_GAP):
        super().__init__(name="intents", daemon=True)
        self.replicas, self.failed, self.took, self.gap = replicas, failed, took, gap
        self.skip = bool(os.environ.get(TEST_NO_APPENDS))  # the test seam (TEST_NO_APPENDS)
        self.cv = threading.Condition()
        self.rows: list = []
        self.batch = _Batch()
        self.stopping = False
        #: what the appends took: {"appends", "rows", "s": their time in all}, and the node
        #: threads' waits for them: {"waits": launches that waited, "waited": s in all}
        self.stats = {"appends": 0, "rows": 0, "s": 0.0, "waits": 0, "waited": 0.0}

    def add(self, rows: list) -> _Batch:
        """Queue ``rows`` (``State.start_attempts`` rows); returns the batch they go in."""
        with self.cv:
            self.rows += rows
            self.batch.rows.update((r[0], r) for r in rows)
            self.cv.notify()
            return self.batch

    def stop(self) -> None:
        with self.cv:
            self.stopping = True
            self.cv.notify()

    def run(self) -> None:
        last = -self.gap
        while True:
            with self.cv:
                while not self.rows and not self.stopping:
                    self.cv.wait()
                if not self.rows:
                    return
                rest = self.gap - (time.monotonic() - last)
                if rest > 0 and not self.stopping:  # the launches placed meanwhile join
                    self.cv.wait_for(lambda: self.stopping, rest)
                rows, batch = self.rows, self.batch
                self.rows, self.batch = [], _Batch()
            began = last = time.monotonic()
            try:
                if self.skip:
                    continue  # (finally: the batch is let go unwritten)
                self.replicas.intend(rows)
                took = time.monotonic() - began
                self.stats["appends"] += 1
                self.stats["rows"] += len(rows)
                self.stats["s"] += took
                self.took(took)
            except HyperError as e:
                batch.error = e
                self.failed(e)
            except Exception as e:  # a bug: nothing of this batch may be launched
                batch.error = HyperError(f"backing up launches: {e}")
                self.failed(batch.error)
            finally:
                batch.done.set()


class _Records:
    """Writes one workflow's records to its replicas, one write at a time: the whole records
    (a blob) first and now and then, in between only the rows changed since the last write
    a majority took (a delta, :meth:`hypercli.state.State.export_changes`: O(changes), where
    a blob is O(tasks): 2.46 MB of JSON at 4,096 tasks, bench/RESULTS.md §17). A log of
    changes beside a periodic whole copy, compacted into the next one: a blob is written
    again once WHOLE_EVERY s have passed since the last or the deltas since weigh more
    than it (the replicas then drop the deltas it holds). A write that failed is made
    again from the same mark, so the next one holds its changes too.

    Args:
        replicas: the workflow's :class:`~hypercli.controller.backup.Replicas`.
        wid: the workflow's id (its state file has :meth:`~hypercli.state.State.
            track_changes` on).
    """

    def __init__(self, replicas: Replicas, wid: str, whole_every: float = WHOLE_EVERY):
        self.replicas, self.wid, self.whole_every = replicas, wid, whole_every
        self.acked: dict | None = None  # the mark of the newest write a majority took
        self.whole_at = 0.0  # time.monotonic() of the last blob a majority took
        self.whole_bytes = self.log_bytes = 0  # that blob's size; the deltas' since
        self.count = {"blob": 0, "delta": 0}  # writes a majority took
        self.lock = threading.Lock()

    def write(self, st: S.State, whole: bool = False, forget: bool = True) -> None:
        """Write what changed in ``st`` (a blob when ``whole`` or due, else a delta);
        with ``forget``, then drop the change log's rows it holds from ``st`` (not on a
        :class:`BackedState`: that would be one more change). Raises as
        :meth:`Replicas.write`."""
        if os.environ.get(TEST_NO_APPENDS):
            return  # the test seam: nothing written after the handover's records
        with self.lock:
            whole = (whole or self.acked is None or self.log_bytes > self.whole_bytes
                     or time.monotonic() - self.whole_at >= self.whole_every)
            made: dict = {}

            def make() -> str:
                data = st.export_changes(self.wid, None if whole else self.acked)
                made["mark"], made["text"] = data["mark"], pack(data)
                return made["text"]
            if whole:
                self.replicas.write(make)
            else:
                self.replicas.append(make)
            self.acked = made["mark"]
            self.count["blob" if whole else "delta"] += 1
            if whole:
                self.whole_at, self.whole_bytes, self.log_bytes = (
                    time.monotonic(), len(made["text"]), 0)
            else:
                self.log_bytes += len(made["text"])
        if forget:
            st.forget_changes(self.wid, made["mark"]["changes"])


def _gated(worker, gates: dict, stats: dict | None = None, witness=None) -> None:
    """Make ``worker`` (a scheduler's NodeWorker) send a launch only once its attempts'
    intents are on a majority of the replicas (``gates``: attempt id → :class:`_Batch`), or
    with their witness when its node is a replica (``witness``: (node name, rows) → the
    witness, or None for a node that is not a replica: :meth:`Replicas.witness`; its rows
    are every rank of the attempts launched): that node's agent writes the intent beside
    its backups before it starts them, so the launch need not wait for the others. A
    launch whose batch failed already is not sent (the drive stops, and the next one
    launches it from the records: the agent's launch is idempotent per attempt id).
    ``stats`` (:class:`_Intents`'s) counts the launches that waited and the time they
    waited."""
    handle = worker._handle

    def gated(op, payload):
        if op == "launch":
            held = [(spec, gates.pop(spec["id"], None)) for spec in payload]
            held = [(spec, batch) for spec, batch in held if batch is not None]
            if any(b.error is not None for _, b in held):
                return False
            if held and witness is not None:
                keys = {tuple(b.rows[s["id"]][2:4]) for s, b in held if s["id"] in b.rows}
                rows = {r[0]: r for _, b in held for r in b.rows.values()
                        if tuple(r[2:4]) in keys}
                w = witness(getattr(worker, "node", None), list(rows.values()))
                if w is not None:
                    for spec, _ in held:
                        spec["witness"] = w
                    held = []  # sent now, with their witness
            for spec, batch in held:
                if batch is not None:
                    if stats is not None and not batch.done.is_set():
                        began = time.monotonic()
                        batch.done.wait()
                        stats["waits"] += 1  # a race between node threads loses a count at
                        stats["waited"] += time.monotonic() - began  # most: a rough figure
                    batch.done.wait()
                    if batch.error is not None:
                        return False
        return handle(op, payload)
    worker._handle = gated


def lease_of(wf: dict) -> dict:
    """The controller's lease record in a workflow's spec: ``{"holder", "seq", "replicas":
    [node names], "lost": why or absent}``; {} for a workflow not driven here."""
    return (wf.get("spec") or {}).get("lease") or {}


def _set_spec(state: S.State, wid: str, **lease) -> None:
    wf = state.workflow(wid)
    spec = dict(wf.get("spec") or {})
    spec["lease"] = {**lease_of(wf), **lease}
    state.set_workflow(wid, spec=json.dumps(spec))


def _replicas(state: S.State, wf: dict, provider) -> Replicas:
    lease = lease_of(wf)
    nodes = [n for n in state.nodes(wf["cluster"]) if n["name"] in lease.get("replicas", [])]
    return Replicas(provider, nodes, wf, lease["holder"], seq=lease.get("seq", 0))


# -- submit --------------------------------------------------------------------------------
def submit(data: dict) -> dict:
    """Take a workflow handed over by the user's machine. ``data``: ``{"export": the
    workflow's records (State.export_workflow), "known_hosts": the cluster's pinned keys
    (text), "key": the cluster's private key (text), "workdir": base64 tar of the workdir
    or None, "holder": the lease holder id to use, "handoff": the holder it takes over from
    or None, "seq": the newest backup's sequence number}``. Writes the first backup (the lease)
    before answering, and starts the service. Returns ``{"workflow", "pid"}``.

    Raises:
        LeaseLost: another driver holds the workflow's lease.
        NoQuorum: fewer than a majority of the cluster's nodes took the first backup.
    """
    from hypercli.cluster import provider_of
    export = data["export"]
    wf, cluster = export["workflow"], export["cluster"]
    wid, name = wf["id"], cluster["name"]
    home = S.home()
    key = S.folder("keys") / name
    if data.get("keys") is not None:  # a cloud cluster: its folder of keys, as made there
        key = _cloud_cluster(data, export)
    else:
        fd = os.open(key, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(data["key"])
    kh = home / "known_hosts"
    kh.mkdir(exist_ok=True, mode=0o700)
    (kh / name).write_text(data["known_hosts"])
    os.chmod(kh / name, 0o600)
    spec = json.loads(cluster["spec"] or "{}")
    if (spec.get("options") or {}).get("identity_file"):
        spec["options"]["identity_file"] = str(key)
    cluster["spec"] = json.dumps(spec)
    for n in export["nodes"]:
        addr = json.loads(n["address"] or "{}")
        addr["identity_file"] = str(key)
        n["address"] = json.dumps(addr)
    if wf["storage"].startswith("file://"):  # the user's folder is not here: outputs come here
        wf["storage"] = "file://" + str(S.folder("storage"))
    work = S.folder("work") / wid
    if data.get("workdir"):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        from hypercli.untar import extract
        extract(base64.b64decode(data["workdir"]), work)
        wf["workdir"] = str(work)
    wspec = json.loads(wf["spec"] or "{}")
    replicas = [n["name"] for n in export["nodes"] if n["status"] == "up"]
    wspec["lease"] = {"holder": data["holder"], "seq": data.get("seq", 0),
                      "replicas": replicas}
    wf["spec"] = json.dumps(wspec)
    state = S.State()
    try:
        state.import_workflow(export, driver_pid=None, detached=0)
        wf_row = state.workflow(wid)
        reps = _replicas(state, wf_row, provider_of(state, name))
        try:
            reps.write(pack(state.export_workflow(wid)), handoff=data.get("handoff"))
        finally:
            reps.close()
        _set_spec(state, wid, seq=reps.seq)
        state.event("workflow", f"taken by the controller (lease {data['holder']})",
                    workflow=wid)
    finally:
        state.close()
    return {"workflow": wid, "pid": ensure_service()}


def _cloud_cluster(data: dict, export: dict) -> Path:
    """Put a cloud cluster's key folder here (``keys/<cluster>/``: its key, the host keys of
    its nodes, the places it was launched in: :mod:`hypercli.providers.cloud_provider`), set
    its options so that a launch from here uses the cluster's instance profile, Azure
    storage identity or GCP node account as it is (``iam_role``, ``identity``,
    ``service_account``: the controller makes none), and
    keep the user's owner tag for what it launches (``owner``, :func:`_owner`). Returns the
    key's path."""
    name = export["cluster"]["name"]
    top = S.folder("keys") / name
    for rel, text in data["keys"].items():
        path = (top / rel).resolve()
        if top.resolve() not in path.parents:
            raise HyperError(f"a key file outside keys/{name}: {rel!r}")
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(text)
    spec = json.loads(export["cluster"]["spec"] or "{}")
    options = spec.setdefault("options", {})
    if data.get("iam_role"):
        options["iam_role"] = data["iam_role"]
    if data.get("identity"):  # an Azure cluster's storage identity, as it is
        options["identity"] = data["identity"]
    if data.get("service_account"):  # a GCP cluster's node account, as it is
        options["service_account"] = data["service_account"]
    export["cluster"]["spec"] = json.dumps(spec)
    if data.get("owner"):
        (S.home() / "owner").write_text(data["owner"])
        os.environ["HYPER_OWNER"] = data["owner"]
    return top / "id_ed25519"


def _owner() -> None:
    """``HYPER_OWNER`` from the owner tag a handover left (:func:`_cloud_cluster`)."""
    try:
        os.environ["HYPER_OWNER"] = (S.home() / "owner").read_text().strip()
    except OSError:
        pass


# -- answers to the user's machine ----------------------------------------------------------
def service_pid() -> int | None:
    """The live service's pid (its lock is held), else None."""
    path = S.home() / "locks" / "controller.lock"
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    except OSError:
        pid = os.pread(fd, 32, 0).decode().strip()
        return int(pid) if pid.isdigit() else None
    finally:
        os.close(fd)


def ensure_service() -> int:
    """The service's pid, started first when none is alive (it exits at once, harmlessly,
    when another won the race)."""
    pid = service_pid()
    if pid:
        return pid
    out = open(S.home() / "controller.log", "ab")
    try:
        p = subprocess.Popen([sys.executable, "-m", "hypercli.controller", "serve"],
                             stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                             start_new_session=True, close_fds=True)
    finally:
        out.close()
    for _ in range(100):  # until it holds its lock: the caller may ask for it next
        if service_pid() or p.poll() is not None:
            break
        time.sleep(0.05)
    return service_pid() or p.pid


def export(wid: str, since: float | None = None) -> dict:
    """``{"export": the workflow's records, "driven": True while the service is alive and
    holds its lease, "lost": why its lease was lost, or None, "ledger": the cost ledger's
    rows of its cluster (instances launched here too), "samples": the utilisation samples
    of its cluster's nodes and their attempts taken at ``since`` (unix s) or later, oldest
    first ([] when ``since`` is None)}``."""
    state = S.State()
    try:
        wf = state.workflow(wid)
        lease = lease_of(wf)
        if wf["status"] in ("running", "cancelling") and lease and not lease.get("lost"):
            ensure_service()  # a service that died is started again, as the driver is
        samples = [] if since is None else sorted(
            (s for n in state.nodes(wf["cluster"])
             for s in state.samples(node=n["name"], since=since)), key=lambda s: s["ts"])
        return {"export": state.export_workflow(wid), "lost": lease.get("lost"),
                "driven": bool(service_pid()) and not lease.get("lost"),
                "ledger": state.ledger(wf["cluster"]), "samples": samples}
    finally:
        state.close()


def follow(wid: str, every: float = 1.0, out=None) -> int:
    """Write :func:`export`'s answer for ``wid`` to ``out`` (stdout) as one JSON line now and
    every ``every`` s after, until the workflow has ended or its lease was lost (that answer
    is the last line); a line that would repeat the one before is written as ``{}`` (the
    follower's sign that the controller still answers). One process for a follower (`hyper
    run --controller`) instead of one ``export`` per copy: each costs a Python start and its
    imports on the controller, 0.1-0.2 s of CPU (bench/RESULTS.md §17). Returns 0; a
    follower that went away ends it (its pipe closes). Raises HyperError as :func:`export`."""
    out = out or sys.stdout
    last = None
    while True:
        got = export(wid)
        text = json.dumps(got, separators=(",", ":"), default=str)
        try:
            out.write(("{}" if text == last else text) + "\n")
            out.flush()
        except BrokenPipeError:
            return 0
        last = text
        if got["export"]["workflow"]["status"] not in ("running", "cancelling") \
                or got["lost"]:
            return 0
        time.sleep(every)


def logs_tar(wid: str) -> bytes:
    """A tar of the log copies kept here of the workflow's attempts (``<attempt>/stdout``,
    ``<attempt>/stderr``) and of its outputs in a ``file://`` storage (``outputs/<task>/``)."""
    state = S.State()
    try:
        wf = state.workflow(wid)
        logs = S.folder("logs")
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for a in state.attempts(wid):
                d = logs / a["id"]
                if d.is_dir() and not d.is_symlink():
                    tar.add(str(d), arcname=f"logs/{a['id']}")
            if wf["storage"].startswith("file://"):
                out = Path(wf["storage"][7:]) / wid
                if out.is_dir() and not out.is_symlink():
                    tar.add(str(out), arcname="outputs")
        return buf.getvalue()
    finally:
        state.close()


def cancel(ref: str) -> dict:
    """Cancel a workflow or task here (as ``hyper cancel``); the scheduler driving it
    picks the cancel up. Returns ``{"what", "tasks"}``."""
    from hypercli.workflows import cancel as cancel_
    state = S.State()
    try:
        what, n = cancel_(state, ref)
        return {"what": what, "tasks": n}
    finally:
        state.close()


def status() -> dict:
    """``{"pid": the service's or None, "workflows": [{"id", "status", "holder", "lost"}]}``."""
    state = S.State()
    try:
        rows = [{"id": w["id"], "status": w["status"], "holder": lease_of(w).get("holder"),
                 "lost": lease_of(w).get("lost")}
                for w in state.workflows(limit=1000) if lease_of(w)]
        return {"pid": service_pid(), "workflows": rows}
    finally:
        state.close()


def stop() -> int | None:
    """Stop the service (SIGTERM: every task is left running); returns its pid or None."""
    pid = service_pid()
    if pid:
        os.kill(pid, signal.SIGTERM)
        for _ in range(600):
            if not service_pid():
                break
            time.sleep(0.05)
    return pid


# -- the service ----------------------------------------------------------------------------
class _Drive(threading.Thread):
    """Drives one workflow here, backed up after every change, until it ends or its lease
    is lost."""

    def __init__(self, wid: str):
        super().__init__(name=f"drive-{wid}", daemon=True)
        self.wid = wid
        self.scheduler = self.replicas = None
        self.stopping = False
        self.lost: str | None = None  # why the lease was lost

    def stop(self) -> None:
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.stop()

    def renew(self) -> None:
        """Renew the lease (the last backup written again); a lost lease stops the run."""
        reps = self.replicas
        if reps is None or reps.blob is None:
            return
        try:
            reps.write()
        except LeaseLost as e:
            self._lost(str(e))
        except HyperError as e:
            log.warning("%s: lease not renewed: %s", self.wid, e)

    def _lost(self, why: str) -> None:
        if not self.stopping:
            log.error("%s: %s; stopping (tasks left running)", self.wid, why)
        self.lost = why
        self.stop()

    def run(self) -> None:
        from hypercli.cluster import provider_of
        plain = S.State()
        provider = None
        try:
            wf = plain.workflow(self.wid)
            provider = provider_of(plain, wf["cluster"])
            self.replicas = _replicas(plain, wf, provider)
            plain.track_changes()  # before the first write: every change after it is seen
            records = _Records(self.replicas, self.wid)
            dirty = threading.Event()
            ended = threading.Event()  # set when the drive ends: the last blob goes now
            took = [0.0]  # s an intent takes to reach a majority (moving average)

            def write(st: S.State, whole: bool = False) -> None:
                try:
                    records.write(st, whole, forget=not isinstance(st, BackedState))
                except LeaseLost as e:
                    self._lost(str(e))
                    raise

            def backup(must: bool, rows: list) -> None:
                if self.lost:
                    raise LeaseLost(self.lost)
                if must:
                    dirty.clear()  # this write takes every change so far
                    write(state, whole=True)
                    return
                if rows:  # sent by the node threads once their batch is backed up
                    batch = intents.add(rows)
                    for r in rows:
                        gates[r[0]] = batch
                dirty.set()

            def failed(e: HyperError) -> None:
                if isinstance(e, LeaseLost):
                    self._lost(str(e))
                else:
                    log.warning("%s: launches not backed up, stopping: %s", self.wid, e)
                    self.stop()

            def took_(s: float) -> None:
                took[0] = 0.8 * took[0] + 0.2 * s
                if self.scheduler is not None and intents.stats["waits"]:  # node threads
                    # wait for launches this long (only a launch to a node that is not a
                    # replica waits for its append)
                    self.scheduler.launch_delay = min(2 * took[0], MAX_DELAY)
            gates: dict = {}
            intents = _Intents(self.replicas, failed, took_)
            intents.start()

            def flush() -> None:  # the other changes, a batch at a time, on a connection
                own = S.State()  # of its own
                last = 0.0
                try:
                    while not self.stopping or dirty.is_set():
                        if not dirty.wait(FLUSH_EVERY):
                            continue
                        # one blob a FLUSH_EVERY at most, the changes meanwhile in it: a blob
                        # is the whole records (O(tasks)), and the replicas' time spent on it
                        # is time the next launch's intent waits
                        rest = FLUSH_EVERY - (time.monotonic() - last)
                        if rest > 0:
                            ended.wait(rest)
                        dirty.clear()
                        last = time.monotonic()
                        try:
                            write(own)
                        except HyperError as e:
                            log.warning("%s: backup not written: %s", self.wid, e)
                            if self.lost:
                                return
                            dirty.set()
                            time.sleep(FLUSH_EVERY)
                finally:
                    own.close()
            state = BackedState(backup)
            flusher = threading.Thread(target=flush, name=f"backup-{self.wid}", daemon=True)
            flusher.start()
            try:
                nodes = state.nodes(wf["cluster"], status="up")
                self.scheduler = _Scheduler(state, self.wid, provider, nodes, gates=gates,
                                            stats=intents.stats,
                                            witness=self.replicas.witness)
                if self.stopping:
                    return
                log.info("driving %s on %d nodes", self.wid, len(nodes))
                summary = self.scheduler.run()
                st = intents.stats
                log.info("%s: %s; %d whole copies of the records, %d deltas; %d intent "
                         "appends of %d rows, %.3f s each; %d launches waited for theirs, "
                         "%.3f s each", self.wid, summary.counts, records.count["blob"],
                         records.count["delta"], st["appends"], st["rows"],
                         st["s"] / max(st["appends"], 1), st["waits"],
                         st["waited"] / max(st["waits"], 1))
            finally:
                intents.stop()
                self.stopping = True  # the flusher writes what is left, then ends
                ended.set()
                flusher.join(timeout=60)
                if dirty.is_set() and not self.lost:  # changed after the flusher ended
                    try:
                        write(state)
                    except HyperError as e:
                        log.warning("%s: last backup not written: %s", self.wid, e)
                state.close()
        except LeaseLost as e:
            self._lost(str(e))
        except HyperError as e:
            log.error("%s: %s", self.wid, e)
        except Exception:  # a bug must not take the other workflows down
            log.exception("%s: drive thread failed", self.wid)
        finally:
            if self.lost:
                _set_spec(plain, self.wid, lost=self.lost)
            elif self.replicas is not None:
                _set_spec(plain, self.wid, seq=self.replicas.seq)
            if self.replicas is not None:
                self.replicas.close()
            _hang_up(provider, plain, self.wid)
            plain.close()


def _hang_up(provider, state: S.State, wid: str) -> None:
    """Close the SSH connections a drive of ``wid`` opened to its cluster's nodes (the
    service outlives its drives: each one's connections, their threads and their nodes'
    agents were left open until it exited, three more for each workflow driven). Never
    raises."""
    drop = getattr(provider, "drop", None)
    if drop is None:
        return
    try:
        for n in state.nodes(state.workflow(wid)["cluster"]):
            drop(n["name"])
    except Exception as e:  # closing must not hide why the drive ended
        log.warning("%s: connections not closed: %s", wid, e)


def _Scheduler(*args, gates: dict, stats: dict | None = None, witness=None, **kw):
    """A :class:`~hypercli.scheduler.Scheduler` whose node threads, the ones it starts
    with and those of replacement nodes, send launches as :func:`_gated` says."""
    from hypercli.scheduler import Scheduler

    class Gated(Scheduler):
        def _worker(self, n):
            w = super()._worker(n)
            _gated(w, gates, stats, witness)
            return w
    return Gated(*args, **kw)


def _used() -> None:
    """Mark this host as in use for a cloud node's idle watchdog (:mod:`hypercli.node.watch`
    reads ``<root>/contact``; the controller's home is ``<root>/controller``), so that a
    cloud controller removes itself only once it has driven nothing for its idle limit. Only
    a file that is there already (the node agent's: the controller is a node) is touched:
    nothing is made on a host the user named."""
    try:
        os.utime(S.home().parent / "contact")
    except OSError:
        pass


def _uncollected(state: S.State) -> bool:
    """Whether a workflow driven here has ended and the user's machine has not copied its
    records yet (:func:`collected`): a cloud controller is then not idle, since its instance
    removing itself would take the only whole copy of those records with it."""
    return any(w["status"] not in ("running", "cancelling") and lease_of(w)
               and not lease_of(w).get("collected") and not lease_of(w).get("lost")
               for w in state.workflows(limit=1000))


def collected(wid: str) -> dict:
    """Record that the user's machine has copied the records of ended workflow ``wid``
    (:func:`hypercli.controller.client.refresh`), and remove its backups from the replica
    nodes (:meth:`Replicas.drop`): they are needed no more, and nothing else would remove
    them. Returns ``{"workflow", "dropped": replicas that removed them}``."""
    from hypercli.cluster import provider_of
    state = S.State()
    try:
        wf = state.workflow(wid)
        _set_spec(state, wf["id"], collected=True)
        lease, dropped = lease_of(wf), 0
        if wf["status"] not in ("running", "cancelling") and lease.get("holder") and \
                not lease.get("lost"):
            try:
                reps = _replicas(state, state.workflow(wid), provider_of(state, wf["cluster"]))
                try:
                    dropped = reps.drop()
                finally:
                    reps.close()
            except HyperError as e:  # the nodes are gone: so are the backups on them
                log.warning("%s: backups not removed: %s", wid, e)
        return {"workflow": wid, "dropped": dropped}
    finally:
        state.close()


def _to_drive(state: S.State) -> list[str]:
    return [w["id"] for w in state.workflows(limit=1000)
            if w["status"] in ("running", "cancelling") and lease_of(w)
            and not lease_of(w).get("lost")]


def serve() -> int:
    """The service's loop (module docstring). Returns the exit status."""
    from hypercli.locks import lock_folder
    fd = os.open(lock_folder() / "controller.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another service is alive
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s controller[%(process)d] %(message)s")
    stopping: list = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    log.info("started for %s", S.home())
    _owner()
    state = S.State()
    drives: dict[str, _Drive] = {}
    idle = renewed = time.monotonic()
    on_node = (S.home().parent / "contact").exists()  # a cloud controller (_used)
    try:
        while not stopping:
            for wid in _to_drive(state):
                if wid not in drives or not drives[wid].is_alive():
                    drives[wid] = _Drive(wid)
                    drives[wid].start()
            if time.monotonic() - renewed > RENEW_EVERY:
                renewed = time.monotonic()
                for d in list(drives.values()):
                    if d.is_alive():
                        d.renew()
            drives = {w: d for w, d in drives.items() if d.is_alive()}
            if drives or (on_node and _uncollected(state)):
                idle = time.monotonic()
                _used()
            elif time.monotonic() - idle > IDLE_EXIT:
                break
            time.sleep(LOOK_EVERY)
    finally:
        for d in drives.values():
            d.stop()
        for d in drives.values():
            d.join(timeout=30)
        log.info("exiting (%s)", "signal" if stopping else "nothing left to drive")
        state.close()
        os.close(fd)
    return 0
