"""The client end of the node agent protocol (``hypercli/node/agent.py`` documents it).

A :class:`AgentClient` wraps any pair of byte streams connected to ``agent.py serve``: a local
subprocess's pipes (local provider) or an SSH exec channel (ssh and cloud providers). Calls are
synchronous and serialized; :meth:`AgentClient.wake` may be called from any thread to cut short
a ``poll`` wait in progress.

Late answers (a node cut off the network). Every request has a time its answer is due: its own
``wait`` and ``grace`` plus ANSWER_LATE. A client given ``silent`` (the SSH providers: "does the
host's TCP stack still answer a connection?") has its late answers checked by one watchdog
thread for all clients: when the host does not answer within the probe's timeout, the client
is closed and the call raises :class:`NodeCutOff` at once, instead of after TCP's own timeouts.
A host that answers is only slow (loaded, or its agent stalled): the call goes on waiting, up
to CALL_TIMEOUT past its wait, after which it counts as hung. A loaded host's kernel answers a
TCP handshake in well under the probe's timeout however busy its CPUs are; only a silent path
does not.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable

from hypercli.errors import NodeError

#: s past a request's own ``wait`` and ``grace`` after which its answer is late and the node's
#: host is probed (see the module docstring). An answer travels in one round trip, a few ms on
#: a LAN and ~0.3 s across regions.
ANSWER_LATE = 0.5


class AgentFailed(NodeError):
    """The node's agent answered, with an error instead of a result (it could not do what
    was asked: a full disk, a bad request). The node is reachable. ``reason``: the agent's
    words (``OSError: [Errno 28] No space left on device``)."""

    def __init__(self, node: str, reason: str):
        super().__init__(node, f"agent: {reason}")
        self.reason = reason


class NodeCutOff(NodeError):
    """An answer from the node's agent was late and its host no longer answers TCP: the network
    path to it is cut (or the host is off)."""


class _Watchdog:
    """One daemon thread that probes the hosts of clients whose answer is late.

    ``arm(client, due, call)`` registers the request numbered ``call`` of ``client`` as due at
    ``due`` (``time.monotonic()`` s); ``disarm(client)`` when its answer came. A request still
    armed at its due time gets one probe, in a short-lived thread of its own so a slow probe
    never delays the others.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._due: dict = {}  # client -> (due, call number)
        self._thread: threading.Thread | None = None

    def arm(self, client: "AgentClient", due: float, call: int) -> None:
        with self._cond:
            self._due[client] = (due, call)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="answer-watchdog",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()

    def disarm(self, client: "AgentClient") -> None:
        with self._cond:
            self._due.pop(client, None)

    def _run(self) -> None:
        import time
        while True:
            with self._cond:
                now = time.monotonic()
                late = [(c, n) for c, (due, n) in self._due.items() if due <= now]
                for c, _ in late:
                    del self._due[c]
                if not late:
                    nearest = min((due for due, _ in self._due.values()), default=None)
                    self._cond.wait(None if nearest is None else nearest - now)
                    continue
            for c, n in late:
                threading.Thread(target=c._probe, args=(n,), name=f"probe-{c.node}",
                                 daemon=True).start()


_WATCHDOG = _Watchdog()
AGENT_PATH = Path(__file__).with_name("agent.py")


def agent_source() -> bytes:
    """The agent program's bytes, as copied to remote nodes."""
    return AGENT_PATH.read_bytes()


@functools.lru_cache(maxsize=1)
def engine_source() -> str:
    """The engine wrapper's text (``engine.py``), sent in the launch spec of ``engine:``
    attempts."""
    return AGENT_PATH.with_name("engine.py").read_text()


class AgentClient:
    """Requests to one node's agent.

    Args:
        node: node name, for errors.
        write: callable writing bytes to the agent's stdin.
        readline: callable returning one line (bytes, b"" at EOF) of the agent's stdout.
        close: callable closing the transport.
        settimeout: callable setting the transport's read timeout (s), or None.
        silent: ``() -> str | None``: why the node's host no longer answers (a TCP handshake),
            or None when it does; asked when an answer is late (see the module docstring).
            None: late answers are only bounded by CALL_TIMEOUT.
    Raises (from call):
        NodeCutOff: an answer was late and ``silent`` said the host does not answer.
        NodeError: the transport closed or failed, or the agent answered ``ok: false``.
    """

    #: s an answer may take beyond the request's own ``wait`` and ``grace`` before the node
    #: counts as hung (a stopped host keeps its TCP connection up but never answers)
    CALL_TIMEOUT = 5.0

    def __init__(self, node: str, write: Callable[[bytes], None],
                 readline: Callable[[], bytes], close: Callable[[], None],
                 settimeout: Callable[[float], None] | None = None,
                 silent: Callable[[], str | None] | None = None):
        self.node = node
        self._silent = silent
        self._cut: str | None = None  # why the watchdog closed this client
        self._write, self._readline, self._close = write, readline, close
        self._settimeout = settimeout
        self._call_lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._next = 0
        self._waiting = False  # a request with a ``wait`` is out: a wake can cut it short
        self._woken = False  # a wake came while no wait was out: the next wait is 0
        self.closed = False

    def _send(self, obj: dict) -> None:
        with self._write_lock:
            if obj.get("wait"):
                if self._woken:  # new work came before this wait was sent: do not wait
                    obj["wait"] = 0
                self._woken = False
            self._write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")
            self._waiting = bool(obj.get("wait"))

    def call(self, op: str, **args) -> dict:
        """Send one request and wait for its response (dict without ``ok``/``id``)."""
        with self._call_lock:
            if self.closed:
                raise NodeError(self.node, "agent connection is closed")
            self._next += 1
            budget = float(args.get("wait") or 0) + float(args.get("grace") or 0)
            try:
                if self._settimeout is not None:
                    self._settimeout(budget + self.CALL_TIMEOUT)
                if self._silent is not None:
                    import time
                    _WATCHDOG.arm(self, time.monotonic() + budget + ANSWER_LATE, self._next)
                self._send({"id": self._next, "op": op, **args})
                line = self._readline()
            except (OSError, EOFError, ValueError) as e:
                self.closed = True
                if self._cut:
                    raise NodeCutOff(self.node, self._cut) from None
                raise NodeError(self.node, f"agent connection failed: {e}") from None
            finally:
                if self._silent is not None:
                    _WATCHDOG.disarm(self)
                with self._write_lock:
                    self._waiting = False
            if not line:
                self.closed = True
                if self._cut:
                    raise NodeCutOff(self.node, self._cut)
                raise NodeError(self.node, "agent connection closed")
            try:
                resp = json.loads(line)
            except ValueError:  # e.g. a login script printing to stdout
                self.closed = True
                raise NodeError(self.node, f"the agent answered with something that is not "
                                f"JSON: {line[:200]!r}", "does the node's shell print on "
                                "login (~/.bashrc)?") from None
            if not resp.pop("ok", False):
                raise AgentFailed(self.node, str(resp.get("error")))
            resp.pop("id", None)
            return resp

    def _probe(self, call: int) -> None:
        """The watchdog's check of a late answer to request ``call``: close this client when
        the node's host does not answer (the blocked call then raises NodeCutOff)."""
        try:
            why = self._silent()
        except Exception:  # a probe that breaks decides nothing
            why = None
        if why is None or self.closed or self._next != call or not self._call_lock.locked():
            return
        self._cut = f"no answer from its agent and {why}"
        self.close()

    def wake(self) -> None:
        """Cut short the wait (of a ``poll``, or a ``launch`` that waits) in progress, or, when
        none is, make the next request that would wait not wait. Safe from any thread. (The
        agent ignores wakes that come before a request, so none is sent then.)"""
        with self._write_lock:
            if not self._waiting:
                self._woken = True
                return
            try:
                self._write(b'{"op":"wake"}\n')
            except (OSError, EOFError, ValueError):
                pass

    def clear_wake(self) -> None:
        """Forget a wake that came while no wait was out: the caller is about to look at its
        work queue itself (a wake after this call still counts)."""
        with self._write_lock:
            self._woken = False

    def read(self, attempt_id: str, stream: str, offset: int, limit: int = 1 << 20) -> dict:
        """Read a log stream by offset: dict with data (bytes), offset (next), size, done."""
        r = self.call("read", id=attempt_id, stream=stream, offset=offset, limit=limit)
        r["data"] = base64.b64decode(r["data"])
        return r

    def close(self) -> None:
        self.closed = True
        try:
            self._close()
        except OSError:
            pass


def local_agent(node: str, root: str | os.PathLike, env: dict | None = None) -> AgentClient:
    """Start ``agent.py serve`` as a subprocess of this process and connect to it.

    Args:
        node: node name (for errors).
        root: the node's folder (attempt folders go in ``root/tasks``).
        env: environment of the agent and so of its tasks (default: this process's).
    """
    proc = subprocess.Popen([sys.executable, "-I", "-S", str(AGENT_PATH), "serve", "--root",
                             str(root)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0,
                            start_new_session=True)

    def write(data: bytes) -> None:
        proc.stdin.write(data)

    def close() -> None:
        try:
            proc.stdin.close()
        finally:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            proc.stdout.close()

    return AgentClient(node, write, proc.stdout.readline, close)
