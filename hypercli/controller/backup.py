"""A controller's backups of the workflows it drives, and the lease that lets one driver only
drive a workflow: kept on the workflow's own nodes.

Where: an SSH cluster's storage is often ``file://`` on the machine that ran ``hyper run``,
which is away while the controller drives, and the controller's own disk dies with the
controller. The cluster's nodes are the one place that outlives either and that every party
already reaches with pinned host keys; a backup held nowhere but on nodes that are all gone
would be useless anyway (there is nothing left to drive). So each node of the replica set
(the cluster's nodes when the workflow was handed over) keeps ``<root>/controller/<workflow>
.<token>.*``, and a write counts when a majority of the set took it (the lease over a quorum of
replicas, as in Chubby, Burrows, OSDI 2006, and Gray & Cheriton's leases, SOSP 1989: two
majorities always share a replica, so two holders never both succeed).

Each record is four files: ``.json`` ``{"holder", "ttl" (s, or null: until handed over),
"renewed_at" (the node's clock), "seq" (the blob's number; a renewal changes neither)}``,
``.blob`` (base64 of the gzipped JSON of :meth:`hypercli.state.State.export_workflow`),
``.intents`` and ``.log`` (JSON lines). A node takes a write only when no other holder has a
lease there that is still live by its own clock (so no two machines' clocks are compared),
or when the writer names that holder as the one it takes over from (``handoff``: the user's
machine giving the workflow back to a controller). Attempts about to be launched are written
first as an *intent* (their rows only, appended, before the launch is sent: write-ahead),
the records a moment later with other changes: most often only the rows changed since the
last write, appended to ``.log`` (a *delta*: :meth:`hypercli.state.State.export_changes`),
now and then the whole records again (a blob), which drops the intents and deltas it holds.
Whoever takes the workflow over applies the deltas newer than the newest blob in order
(:func:`with_changes`), then adds the intents newer than it as attempts still launching; the
agent's launch is idempotent per attempt id, so one the node did get is
re-attached.

The node as the witness of its own launches: a launch to a replica node carries the intent of
its attempt (every rank of it), numbered and signed as an intent (:meth:`Replicas.witness`),
and that node's agent appends it to ``.intents`` under the flock of ``.lock`` (this server's
lock) and fsyncs it before it starts the attempt (:meth:`hypercli.node.agent.Agent.witness`);
it refuses the launch when ``.json`` there names another holder whose lease is live by its
own clock (the rule of this server). So the controller sends such a launch at once; the
intents still go to a majority, several launches in one append, for the case of a node that
dies with its witness. A read of a node with no record yet answers the witnesses it has.
What is left uncovered: an attempt whose controller died before its majority append and
whose node does not answer at the takeover is known to no one; the new driver runs its task
again elsewhere. When that node comes back, the attempt runs on there to its end, watched by
no driver: its logs and output are never collected, its use of the node is counted by no
driver's claims, its witness line stays in that node's ``.intents`` unread (the takeover is
done) until the backups are removed, and nothing fences it.

Each replica is served by one small Python process on one SSH channel that stays open
(``python3 -I -S -c``; the node needs nothing but its python3, as for the agent).

Tasks: a task that runs as root on a node (no ``image:``) can write these files. So nothing
read from a replica is trusted on its own: each blob and intent carries an HMAC-SHA256 (RFC
2104) under the workflow's backup key (``spec["backup_key"]``, made by the user's machine at
the handover, held in the two state files and sent over SSH to the controller only: never to
a node, and left out of every blob), over the record's name, its sequence number and its
content; a reader drops what fails it (:func:`trusted`). A lease record says nothing a
forger could gain by: a write counts once a majority of the replicas took it, and a refusal
by fewer than a majority is not a lost lease (:meth:`Replicas._check`: two majorities share
a replica, so a real holder's live lease is seen by every writer that could reach a
majority), and a takeover waits only for a lease that a majority of the replicas holds.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import hmac
import json
import shlex
import threading
import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Callable

from hypercli.errors import HyperError, InfraError

LEASE_TTL = 20.0  #: s a controller's lease lasts unless renewed (renewed every TTL/4)
RETRY_AFTER = 5.0  #: s before a replica that failed is tried again (a dead host costs time)
CALL_TIMEOUT = 15.0  #: s a replica has to answer one request
BEHIND = 16  #: requests queued for one replica beyond which it is skipped (Replicas._send)

#: the replica's server (node side): one JSON request per line on stdin, one answer per line
NODE_SCRIPT = r'''
import fcntl, json, os, re, sys, time
top = os.path.expanduser(sys.argv[1])
os.makedirs(top, mode=0o700, exist_ok=True)
def load(p):
    try:
        with open(p, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None
def put(p, data):
    tmp = p + ".tmp"
    fd = os.open(tmp, os.O_CREAT | os.O_WRONLY | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, p)
def intents(p):
    try:
        with open(p, "rb") as f:
            return [json.loads(x) for x in f.read().splitlines() if x.strip()]
    except (OSError, ValueError):
        return []
def left(r, now):
    return None if r.get("ttl") is None else r["ttl"] - (now - r.get("renewed_at", 0))
def answer(x):
    sys.stdout.write(json.dumps(x) + "\n")
    sys.stdout.flush()
for line in sys.stdin:
    q = json.loads(line)
    wid = q.get("workflow", "")
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}", wid):
        answer({"error": "bad workflow id"})
        continue
    base = os.path.join(top, wid)
    meta_p, blob_p, int_p = base + ".json", base + ".blob", base + ".intents"
    log_p = base + ".log"
    lock = os.open(base + ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        now = time.time()
        have = load(meta_p)
        if q["op"] == "read":
            if have is None:  # a launch's witness may be here before any record (agent.py)
                w = intents(int_p)
                answer({"found": False, **({"intents": w} if w else {})})
                continue
            try:
                with open(blob_p, "rb") as f:
                    blob = f.read().decode()
            except OSError:
                blob = None
            answer({"found": True, "holder": have.get("holder"), "left": left(have, now),
                    "seq": have.get("seq", 0), "mac": have.get("mac"), "blob": blob,
                    "intents": intents(int_p), "log": intents(log_p)})
            continue
        if (have is not None and have.get("holder") != q["holder"]
                and (left(have, now) is None or left(have, now) > 0)
                and q.get("handoff") != have.get("holder")):
            answer({"ok": False, "holder": have.get("holder"), "left": left(have, now)})
            continue
        if q["op"] == "drop":  # the workflow's records are safe elsewhere: its files go;
            gone = 0          # a symlink planted in their place is removed, never followed
            for ext in (".blob", ".intents", ".log", ".json.tmp", ".blob.tmp",
                        ".intents.tmp", ".log.tmp"):
                try:
                    os.unlink(base + ext)
                    gone += 1
                except OSError:
                    pass
            # but the lease stays, held by the dropper for good: a driver cut off before
            # the workflow ended here must find it taken, not free to take again
            put(meta_p, json.dumps({"holder": q["holder"], "ttl": None, "renewed_at": now,
                                    "seq": (have or {}).get("seq", 0), "mac": None,
                                    "ended": True}).encode())
            answer({"ok": True, "removed": gone})
            continue
        if q["op"] in ("intent", "delta"):
            if have is None or have.get("holder") != q["holder"]:
                answer({"error": "no record of this holder yet"})  # counted as not taken
                continue
            fd = os.open(int_p if q["op"] == "intent" else log_p,
                         os.O_CREAT | os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, json.dumps({"seq": q["seq"], "mac": q.get("mac"), **(
                    {"rows": q["rows"]} if q["op"] == "intent" else {"delta": q["delta"]})}
                    ).encode() + b"\n")
                os.fsync(fd)
            finally:
                os.close(fd)
            answer({"ok": True})
            continue
        new = q.get("blob") is not None  # else a renewal: the blob and its seq stay
        if new:
            put(blob_p, q["blob"].encode())
        put(meta_p, json.dumps({"holder": q["holder"], "ttl": q.get("ttl"), "renewed_at": now,
                                "seq": q.get("seq", 0) if new else (have or {}).get("seq", 0),
                                "mac": q.get("mac") if new else (have or {}).get("mac")}
                               ).encode())
        if new:  # the intents and changes the blob has are dropped with it
            for p in (int_p, log_p) if os.path.exists(log_p) else (int_p,):
                put(p, b"".join(json.dumps(i).encode() + b"\n" for i in intents(p)
                                if i.get("seq", 0) > q.get("seq", 0)))
        answer({"ok": True})
    finally:
        os.close(lock)
'''


class LeaseLost(InfraError):
    """Another driver holds the workflow's lease on a replica: this one must stop driving."""


class NoQuorum(InfraError):
    """Fewer than a majority of the replicas answered."""


KEY_FIELD = "backup_key"  #: the workflow spec's field holding the backup key (hex)


def pack(export: dict) -> str:
    """base64 of the gzipped JSON of a workflow export (:meth:`State.export_workflow`),
    without the workflow's backup key (a blob lies on nodes)."""
    wf = export.get("workflow") or {}
    spec = wf.get("spec")
    if isinstance(spec, str) and KEY_FIELD in spec:
        spec = json.loads(spec)
        spec.pop(KEY_FIELD, None)
        export = {**export, "workflow": {**wf, "spec": json.dumps(spec)}}
    raw = json.dumps(export, separators=(",", ":"), default=str).encode()
    return base64.b64encode(gzip.compress(raw, 3)).decode()


def new_key() -> str:
    """A new backup key: 32 random bytes, hex."""
    import secrets
    return secrets.token_hex(32)


def mac(key: str | None, name: str, kind: str, seq: int, content: str) -> str | None:
    """HMAC-SHA256 (hex) of one record: ``kind`` (``blob``, ``intent`` or ``delta``), the
    backups' ``name`` (workflow and token), ``seq`` and ``content`` (the blob's or delta's
    text, an intent's rows as JSON); None without a key."""
    if not key:
        return None
    msg = json.dumps([name, kind, int(seq), content], separators=(",", ":")).encode()
    return hmac.new(bytes.fromhex(key), msg, hashlib.sha256).hexdigest()


def _rows_text(rows) -> str:
    return json.dumps(rows, separators=(",", ":"), sort_keys=True, default=str)


def trusted(answers: list[dict], key: str | None, name: str) -> list[dict]:
    """``answers`` of :meth:`Replicas.read` with every blob, intent and delta whose HMAC does not
    verify under ``key`` taken out (a blob: ``blob`` None; module docstring). Without a key
    (a workflow handed over before backups were signed) they are taken as they are."""
    if not key:
        return answers
    out = []
    for a in answers:
        a = dict(a)
        blob = a.get("blob")
        want = mac(key, name, "blob", a.get("seq", 0), blob) if isinstance(blob, str) else None
        if not (want and isinstance(a.get("mac"), str)
                and hmac.compare_digest(want, a["mac"])):
            a["blob"] = None
        a["intents"] = [i for i in a.get("intents") or [] if isinstance(i, dict)
                        and isinstance(i.get("mac"), str) and isinstance(i.get("seq"), int)
                        and hmac.compare_digest(mac(key, name, "intent", i["seq"],
                                                    _rows_text(i.get("rows"))), i["mac"])]
        a["log"] = [d for d in a.get("log") or [] if isinstance(d, dict)
                    and isinstance(d.get("mac"), str) and isinstance(d.get("seq"), int)
                    and isinstance(d.get("delta"), str)
                    and hmac.compare_digest(mac(key, name, "delta", d["seq"], d["delta"]),
                                            d["mac"])]
        out.append(a)
    return out


def with_intents(export: dict, seq: int, answers: list[dict]) -> dict:
    """``export`` (the blob of number ``seq``) with the attempts of newer intents in
    ``answers`` (:meth:`Replicas.read`) that it lacks added as ``launching``, their tasks
    running."""
    have = {a["id"] for a in export.get("attempts") or []}
    tasks = {t["id"]: t for t in export.get("tasks") or []}
    now = time.time()
    for got in answers:
        for intent in got.get("intents") or []:
            if intent.get("seq", 0) <= seq:
                continue
            for row in intent.get("rows") or []:
                aid, wid, task, number, node = row[:5]
                if aid in have or task not in tasks:
                    continue
                have.add(aid)
                claim = row[6] if len(row) > 6 else None
                export["attempts"].append({
                    "id": aid, "workflow": wid, "task": task, "number": number, "node": node,
                    "rank": row[5] if len(row) > 5 else 0, "status": "launching",
                    "claim": json.dumps(claim) if claim is not None else None,
                    "created_at": now})
                t = tasks[task]
                t["status"], t["attempts"] = "running", max(t.get("attempts") or 0, number)
    return export


def with_changes(export: dict, seq: int, answers: list[dict]) -> dict:
    """``export`` (the blob of number ``seq``) with the deltas newer than it in ``answers``
    (:meth:`Replicas.read`; each delta once, in the order written) applied: a changed
    workflow, task or attempt row replaces its copy (or is added), and events newer than
    the blob's ``mark`` (:meth:`hypercli.state.State.export_changes`) are added once each.
    A delta that cannot be read is skipped: the ones after it hold its rows too when they
    changed again, and a delta holds all rows changed since the last write a majority
    took, so none acknowledged is lost."""
    deltas = {}
    for got in answers:
        for d in got.get("log") or []:
            if isinstance(d.get("seq"), int) and d["seq"] > seq:
                deltas[d["seq"]] = d["delta"]
    seen = (export.get("mark") or {}).get("events") or 0
    tasks = {t["id"]: i for i, t in enumerate(export.get("tasks") or [])}
    atts = {a["id"]: i for i, a in enumerate(export.get("attempts") or [])}
    for n in sorted(deltas):
        try:
            d = unpack(deltas[n])
        except ValueError:
            continue
        if d.get("workflow"):
            export["workflow"] = {**export.get("workflow", {}), **d["workflow"]}
        for key, index in (("tasks", tasks), ("attempts", atts)):
            rows = export.setdefault(key, [])
            for r in d.get(key) or []:
                if r.get("id") in index:
                    rows[index[r["id"]]] = r
                else:
                    index[r.get("id")] = len(rows)
                    rows.append(r)
        for e in d.get("events") or []:
            if isinstance(e.get("id"), int) and e["id"] > seen:
                seen = e["id"]
                export.setdefault("events", []).append(
                    {k: v for k, v in e.items() if k != "id"})
    return export


def unpack(blob: str) -> dict:
    """The export :func:`pack` made. Raises ValueError: not such a blob."""
    try:
        return json.loads(gzip.decompress(base64.b64decode(blob)))
    except (OSError, EOFError, ValueError, TypeError) as e:
        raise ValueError(f"not a workflow backup: {e}") from None


class _Replica:
    """One node's server channel (opened on first use, again after a failure)."""

    def __init__(self, provider, node: dict):
        self.provider, self.node = provider, node
        self.ch = self.f = None
        self.failed_at = 0.0
        self.lock = threading.Lock()
        #: its requests, one at a time in the order sent (Replicas._send)
        self.queue = ThreadPoolExecutor(1, thread_name_prefix=f"backup-{node['name']}")
        self.pending = 0  # requests queued or under way
        self.counting = threading.Lock()

    def _open(self) -> None:
        from hypercli.providers.ssh import _target_of
        conn = self.provider.connection(self.node["name"], _target_of(self.node),
                                        self.node["cluster"])
        root = (self.node.get("info") or {}).get("root") or "~/.hyper"
        ch = conn.channel()
        ch.settimeout(CALL_TIMEOUT)
        ch.exec_command(f"exec python3 -I -S -c {shlex.quote(NODE_SCRIPT)} "
                        f"{shlex.quote(root + '/controller')}")
        self.ch, self.f = ch, ch.makefile("rb")

    def close(self) -> None:
        if self.ch is not None:
            try:
                self.ch.close()
            except Exception:
                pass
        self.ch = self.f = None

    def call(self, request: dict) -> dict:
        """Send one request, return the answer. Raises InfraError (the replica is skipped
        for RETRY_AFTER s)."""
        with self.lock:
            if self.ch is None and time.time() - self.failed_at < RETRY_AFTER:
                raise InfraError(f"replica {self.node['name']} failed just before")
            try:
                if self.ch is None:
                    self._open()
                self.ch.sendall(json.dumps(request).encode() + b"\n")
                line = self.f.readline()
                if not line:
                    raise EOFError("the channel closed")
                return json.loads(line)
            except (HyperError, OSError, EOFError, ValueError, Exception) as e:
                self.close()
                self.failed_at = time.time()
                raise InfraError(f"replica {self.node['name']}: {e}") from None


class Replicas:
    """The backups of one workflow on its replica set (module docstring). Its blobs and
    intents are signed with the workflow's backup key (``spec["backup_key"]``) when it has
    one.

    Args:
        provider: the cluster's SSH provider (its pinned, cached connections).
        nodes: the replica set, ``nodes`` rows (name, cluster, address, info).
        workflow: the workflow row (its id, and its token, which tells it from another state
            file's workflow of the same id on the same hosts).
        holder: this driver's lease holder id.
        ttl: s the lease lasts unless renewed; None: until handed over.
        seq: the sequence number of the newest backup so far (writes count on from it).

    A replica whose instance the cloud says is gone (the provider's ``probe``: ``gone`` or
    ``preempted``) is taken out of the set when too few answer (:meth:`_prune`), and the
    majority is counted over the rest: it can neither answer nor hold a lease again, and
    every party that prunes drops only such replicas, so any two majorities still share a
    replica that answers. Without that, a cluster of two nodes that lost one could never
    back up again, nor be taken over. Replicas of an ssh cluster are never pruned.
    """

    replica_class = _Replica  #: one replica's channel (a test serves the script locally)

    def __init__(self, provider, nodes: list[dict], workflow: dict, holder: str, *,
                 ttl: float | None = LEASE_TTL, seq: int = 0):
        self.provider = provider
        self.replicas = [self.replica_class(provider, n) for n in nodes]
        self.workflow, self.holder, self.ttl, self.seq = workflow["id"], holder, ttl, seq
        self.key = (workflow.get("spec") or {}).get(KEY_FIELD)
        token = (workflow.get("spec") or {}).get("token")
        self.name = f"{workflow['id']}.{token}" if token else workflow["id"]
        self.quorum = len(nodes) // 2 + 1
        self.blob: str | None = None
        #: orders the making of backups and their sending: every replica gets the requests
        #: in one order (a blob never overwrites a newer one); answers are waited for
        #: outside it, so one write's round trip does not hold the next one back
        self.lock = threading.Lock()

    def _send(self, request: dict) -> list:
        """Queue ``request`` on every replica's channel (in this order on each: the caller
        holds this object's lock); returns a future per replica. A replica with BEHIND
        requests queued already is skipped (an error in its place): a slow replica must not
        hold the others up, and a majority still has every write."""
        def one(r):
            try:
                got = r.call(request)
            except InfraError as e:
                return e
            finally:
                with r.counting:
                    r.pending -= 1
            if "error" in got:
                return InfraError(f"replica {r.node['name']}: {got['error']}")
            return got
        out = []
        for r in self.replicas:
            if r.pending >= BEHIND:
                f: Future = Future()
                f.set_result(InfraError(f"replica {r.node['name']}: {r.pending} requests "
                                        "behind"))
            else:
                with r.counting:
                    r.pending += 1
                f = r.queue.submit(one, r)
            out.append(f)
        return out

    def _wait(self, futures: list, enough: int | None = None) -> list:
        """Answers (dict) or errors (InfraError) of ``futures`` (:meth:`_send`), in replica
        order; with ``enough``, as soon as that many answered ``ok`` (the others, still
        on their way, as errors)."""
        pending = set(futures)
        while pending:
            if enough is not None and sum(
                    f.done() and isinstance(f.result(), dict) and f.result().get("ok") is True
                    for f in futures) >= enough:
                break
            _, pending = wait(pending, return_when=FIRST_COMPLETED)
        return [f.result() if f.done() else InfraError("no answer yet") for f in futures]

    def _all(self, request: dict) -> list:
        """Answers (dict) or errors (InfraError) of every replica, in replica order."""
        with self.lock:
            futures = self._send(request)
        return self._wait(futures)

    def write(self, blob: str | Callable[[], str] | None = None,
              handoff: str | None = None) -> None:
        """:meth:`_write`, again once after replicas the cloud says are gone were pruned."""
        try:
            self._write(blob, handoff)
        except NoQuorum:
            if not self._prune():
                raise
            self._write(self.blob if blob is not None else None, handoff)

    def _write(self, blob: str | Callable[[], str] | None = None,
               handoff: str | None = None) -> None:
        """Write ``blob`` (a function: called once the blob's number is taken, so that it
        holds every row of the intents numbered before it; None: renew the lease, the blob
        kept as it is) with this holder's lease, and return once a majority took it. Blobs
        are written by one thread at a time (the caller's).

        Raises:
            LeaseLost: a replica has another holder's live lease.
            NoQuorum: fewer than a majority took it (replicas unreachable).
        """
        seq = None
        if callable(blob):  # its number first, then the blob, outside the lock: making it
            with self.lock:  # takes O(tasks) time that intents must not wait for. An intent
                self.seq += 1  # numbered before it has rows committed before it, which the
                seq = self.seq  # blob holds; one numbered after it is kept beside it
            blob = blob()
        with self.lock:
            if blob is not None:
                self.blob = blob
                if seq is None:
                    self.seq += 1  # the blob's number; a renewal keeps it
                    seq = self.seq
            futures = self._send({"op": "write", "workflow": self.name,
                                  "holder": self.holder, "ttl": self.ttl,
                                  "seq": self.seq if seq is None else seq,
                                  "blob": blob, "handoff": handoff,
                                  "mac": None if blob is None else
                                  mac(self.key, self.name, "blob", seq, blob)})
        self._check(self._wait(futures, self.quorum))

    def _prune(self) -> bool:
        """Take out of the set the replicas that did not answer last and whose instance the
        cloud says is gone (class docstring); True when one was."""
        probe = getattr(self.provider, "probe", None)
        if probe is None:
            return False
        gone = []
        for r in self.replicas:
            if r.ch is None and r.failed_at:
                try:
                    if probe(r.node) in ("gone", "preempted"):
                        gone.append(r)
                except HyperError:
                    pass
        if not gone or len(gone) == len(self.replicas):
            return False
        with self.lock:
            self.replicas = [r for r in self.replicas if r not in gone]
            self.quorum = len(self.replicas) // 2 + 1
        for r in gone:
            r.close()
        return True

    def _check(self, answers: list) -> None:
        """Return when a majority took the write; a refusal by fewer than a majority (a
        lease a task planted on its node, or one a minority kept) is then no lost lease
        (module docstring). Raises LeaseLost (fewer took it and one refused), NoQuorum."""
        refused = [a for a in answers if isinstance(a, dict) and a.get("ok") is False]
        ok = sum(isinstance(a, dict) and a.get("ok") is True for a in answers)
        if refused and ok < self.quorum:
            raise LeaseLost(f"workflow {self.workflow} is driven by {refused[0]['holder']} "
                            "now (its lease is on the backups)")
        if ok < self.quorum:
            errors = "; ".join(str(a) for a in answers if not isinstance(a, dict))
            raise NoQuorum(f"backup of {self.workflow} reached {ok} of "
                           f"{len(self.replicas)} nodes, {self.quorum} needed: {errors}")

    def intend(self, rows: list[tuple]) -> None:
        """Write attempts about to be launched (``State.start_attempts`` rows) with this
        holder's lease, and return once a majority took them. Raises as :meth:`write`."""
        try:
            self._intend(rows)
        except NoQuorum:
            if not self._prune():
                raise
            self._intend(rows)

    def _intend(self, rows: list[tuple]) -> None:
        with self.lock:
            self.seq += 1
            rows = [list(r) for r in rows]
            futures = self._send({"op": "intent", "workflow": self.name, "holder": self.holder,
                                  "ttl": self.ttl, "seq": self.seq, "rows": rows,
                                  "mac": mac(self.key, self.name, "intent", self.seq,
                                             _rows_text(rows))})
        self._check(self._wait(futures, self.quorum))

    def append(self, delta: Callable[[], str]) -> None:
        """Append the changes since the last write (``delta``: a function giving them packed,
        :func:`pack`, called once their number is taken, as a blob's) with this holder's
        lease, and return once a majority took them. Raises as :meth:`write`."""
        try:
            self._append(delta)
        except NoQuorum:
            if not self._prune():
                raise
            self._append(delta)

    def _append(self, delta: Callable[[], str]) -> None:
        with self.lock:
            self.seq += 1
            seq = self.seq
        text = delta()
        with self.lock:
            futures = self._send({"op": "delta", "workflow": self.name, "holder": self.holder,
                                  "ttl": self.ttl, "seq": seq, "delta": text,
                                  "mac": mac(self.key, self.name, "delta", seq, text)})
        self._check(self._wait(futures, self.quorum))

    def witness(self, node: str, rows: list) -> dict | None:
        """The witness of a launch to replica ``node`` (a node name): the signed intent of
        ``rows`` (``State.start_attempts`` rows: every rank of the attempts launched), which
        that node's agent appends to this record's ``.intents`` there before it starts them
        (:meth:`hypercli.node.agent.Agent.witness`). ``{"dir": the replicas' folder on the
        node, "name", "holder", "line": {"seq", "mac", "rows"}}``; None when ``node`` is not
        a replica. Its number is taken as an intent's: the rows were committed before, so a
        blob numbered after it holds them (and drops it), one numbered before keeps it."""
        rep = next((r for r in self.replicas if r.node["name"] == node), None)
        if rep is None:
            return None
        rows = [list(r) for r in rows]
        with self.lock:
            self.seq += 1
            seq = self.seq
        root = (rep.node.get("info") or {}).get("root") or "~/.hyper"
        return {"dir": root + "/controller", "name": self.name, "holder": self.holder,
                "line": {"seq": seq, "mac": mac(self.key, self.name, "intent", seq,
                                                _rows_text(rows)), "rows": rows}}

    def drop(self) -> int:
        """Remove this workflow's backups from every replica that answers (its records are
        kept elsewhere now: the user's machine copied them), unless another holder's live
        lease is there. The records go (blob, intents, deltas: only the files of
        :data:`NODE_SCRIPT`'s names, each unlinked, so a symlink a task put in one's place is
        removed, not followed); the lease record stays, this holder's with no expiry and
        ``"ended": true`` (a few bytes, kept), so a controller cut off before
        the workflow ended elsewhere finds its lease lost when it is back, never free to take
        and drive the ended workflow again. Returns how many replicas removed them."""
        answers = self._all({"op": "drop", "workflow": self.name, "holder": self.holder})
        return sum(isinstance(a, dict) and a.get("ok") is True for a in answers)

    def read(self) -> list[dict]:
        """What each replica that answered holds: ``{"node", "found", "holder", "left" (s
        of lease left by that node's clock, None: no expiry), "seq", "blob", "intents":
        [{"seq", "rows"}], "log": [{"seq", "delta"}]}``, what fails its HMAC left out
        (:func:`trusted`).

        Raises:
            NoQuorum: fewer than a majority answered (a newer backup may be on the others).
        """
        answers = self._all({"op": "read", "workflow": self.name})
        got = [{**a, "node": r.node["name"]} for r, a in zip(self.replicas, answers)
               if isinstance(a, dict) and "found" in a]
        if len(got) < self.quorum and self._prune():
            return self.read()
        if len(got) < self.quorum:
            errors = "; ".join(str(a) for a in answers if not isinstance(a, dict))
            raise NoQuorum(f"the backups of {self.workflow}: {len(got)} of "
                           f"{len(self.replicas)} nodes answered, {self.quorum} needed"
                           + (f" ({errors})" if errors else ""),
                           "bring the cluster's hosts back, then try again")
        return trusted(got, self.key, self.name)

    def held(self, found: list[dict]) -> list[dict]:
        """The answers of ``found`` (:meth:`read`) that show a live lease of a holder other
        than this one which a majority of the replica set holds: a lease held by fewer can
        be no real holder's (module docstring), so it is not waited for."""
        live = [g for g in found if g.get("found") and g.get("holder") != self.holder
                and (g.get("left") is None or g["left"] > 0)]
        count: dict = {}
        for g in live:
            count[g["holder"]] = count.get(g["holder"], 0) + 1
        return [g for g in live if count[g["holder"]] >= self.quorum]

    def close(self) -> None:
        for r in self.replicas:
            r.close()
            r.queue.shutdown(wait=False)
