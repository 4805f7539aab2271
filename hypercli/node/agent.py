#!/usr/bin/env python3
"""hypercli node agent: the node side of the task protocol, one file, standard library only.

It runs on every node (this machine for the local provider; over SSH on hosts and cloud VMs,
copied there by hypercli) as ``python3 agent.py serve --root ROOT`` and answers JSON requests,
one per line on stdin, with one JSON response per line on stdout. It keeps no state of its own:
everything lives in the attempt folders, so a new agent (after the CLI or the connection died)
sees exactly what the old one saw (and in ``ROOT/owners``, which attempt each task output
it promoted is from).

Attempt folder ``ROOT/tasks/<attempt id>/``::

    script.sh      the task's command (run with bash when present, else sh; ``set -e``), and
                   the attempt's lock: flock()ed by the agent that started the attempt for as
                   long as the attempt runs (bash opens it anew, so it never holds the lock)
    pid            JSON {"pid": <command pid = its process group>, "started": <unix s>,
                   "ticks": <its start time, clock ticks since boot>, "image": str?,
                   "output": str?, "attempt_output": str?}, written atomically (rename)
                   once started
    stdout,stderr  the command's output, carried there by the agent's log pump (_Pump)
    order          made when a task's lines alternate between stdout and stderr: one line
                   ``o N`` / ``e N`` per switch (the run of stdout / stderr lines that
                   ended at byte N of its file), so a reader shows the lines of both in the
                   order they came (hypercli/logmerge.py)
    metrics.jsonl  JSON objects, one per line, written by the task through $HYPER_METRICS
                   (created by the task's first write)
    exit           JSON {"code": <int>, "ended": <unix s>}, written atomically (rename) at the end
    cancelled      present when the attempt was cancelled
    <var>          for each ``files: {VAR: text}`` of the launch spec (``hyper_hostfile``):
                   the text, its path in the task's environment as ``VAR``

The task cannot write this folder from a container: only the script (read-only), the
``files`` (read-only) and ``metrics.jsonl`` (made before, bound alone) are bound into it.
Everything the agent reads back from it (logs, pid, exit, metrics) is opened without
following a symlink and without waiting, and must be a regular file (a task on the node
itself can put a FIFO or a symlink in its place); the group it signals is the one it started
(its memory, else ``pid`` checked against the process's start time and session).

Outputs: an attempt with ``output`` (the task's output folder, in the workflow's outputs
root) writes into a fresh folder of its own, ``<outputs root>/.attempt-<attempt id>``
(``HYPER_OUTPUT``), made without following a symlink (an outputs root that is a symlink is
refused); when the task succeeds it is renamed to ``output`` (before ``finish``), else
removed, so a failed attempt's files never become the task's output. ``ROOT/owners/<hash
of the output's path>`` names the attempt (its id without ``-r<rank>``) whose files the
output holds: the ranks of one multi-node attempt merge into it, and a later attempt
replaces it whole (a rank that exited 0 before its gang failed promoted its files too
early). It is kept there, not beside the output, because ROOT is the agent's own (never
bound into a container) and the outputs root stays the tasks' folders only.

An attempt with ``engine: {kind, source}`` (a rank of an ``engine: spark|ray`` task) runs the
task's command under the engine wrapper (``hypercli/node/engine.py``, whose text comes in the
spec, kept once per content as ``ROOT/engine-<hash>.py``): the agent first checks on the node
itself that the engine is there (not in a container: the wrapper checks there, exit 3) and
answers state "refused" with ``lacks: KIND`` and the reason when it is not; it sets
``HYPER_ENGINE_ATTEMPT`` (the attempt id, which the wrapper puts on the engine's processes as
``HYPER_ENGINE_ID``) and ``HYPER_ENGINE_DIR`` (the attempt folder), and after the rank ends it
kills whatever process of the node still carries that mark.

Every file costs: creating one on a VM's ext4 takes ~90 µs here, the biggest part of a
trivial task's cost on its node, so an attempt makes these and no others.

The agent starts each task itself, as its own child (``vfork`` + ``exec`` of the task's
shell, in a session of its own: no terminal, no SSH session, a process group to signal),
holds the attempt's lock until it has reaped the task and written ``exit``, and learns of
every end at once through SIGCHLD. So "lock free and no ``exit``" means the agent that started
the attempt died before the task ended: the attempt is *lost* (its orphaned processes are
killed), told apart from "still running" without trusting pids, which the kernel reuses.

The agent outlives its connection while it has tasks: ``serve`` forks at start, and the
forked process serves the requests; when the connection ends (EOF on stdin) it lets the
original process exit, so the SSH session ends, and it goes on supervising its running
tasks, in a session of its own, until the last one has ended and its ``exit`` is written. A
new agent (a new connection, a restarted ``hyper run``) sees those attempts as running from
their locks and their ends from their ``exit`` files.

Requests (``{"id": N, "op": OP, ...}``) and responses (``{"id": N, "ok": true, ...}`` or
``{"id": N, "ok": false, "error": TEXT}``):

    hello                         → version, hostname, cpus, memory_bytes, disk_free_bytes, gpus
                                    ([{index, name, memory_mib, uuid}] from nvidia-smi), docker
                                    (container runtime path or null), pid (the agent's)
    launch  attempts: [spec]      → states: {id: state}   (idempotent per attempt id; a spec:
                                    id, script, env, cwd, image, output, binds, finish, files,
                                    gpus: [index] (a container gets those devices only),
                                    checkpoint: {dir, save, restore, every, preempted} (see
                                    CHECKPOINT_WRAPPER), bind_address (a rank's address:
                                    GLOO_SOCKET_IFNAME and
                                    NCCL_SOCKET_IFNAME are set to its interface),
                                    limits: {cpus, memory} (container limits), engine (see
                                    above), secrets: {NAME: value} (never written: put in
                                    the task's environment, or for a container sent on
                                    its stdin, see SECRETS_PROLOGUE)); an attempt with
                                    an image on a node whose container runtime fails
                                    ``docker info`` is not started:
                                    state "refused" + error + lacks "containers";
                                    witness: {dir, name, holder, line} (a controller's
                                    signed intent of the attempt, see Agent.witness):
                                    appended to dir/name.intents before the attempt starts,
                                    or the attempt is "refused" (lacks null); with
            ids: [id]?, wait: s?    wait > 0 it then waits as ``poll`` does, over the launched
                                    attempts and ``ids``, and answers with all their states
    poll    ids: [id], wait: s    → states: {id: state}; with wait > 0 returns as soon as one of
                                    the ids is no longer running, a request or a ``wake``
                                    arrives, or ``wait`` seconds pass
    cancel  ids: [id], grace: s   → states: {id: state}  (SIGTERM to the process group, then
                                    SIGKILL after ``grace`` seconds)
    read    id, stream, offset, limit → data (base64), offset, size, done (stream: stdout,
                                    stderr, order or metrics.jsonl)
    wake                          → no response; cuts short the ``poll`` wait in progress (a
                                    wake read before a request is stale: ignored)

Answers to ``launch``, ``poll`` and ``cancel`` carry ``preempted`` (the JSON of
``ROOT/preempted``) once the node watcher (``watch.py``) has seen the cloud's preemption
notice. Every request touches ``ROOT/contact`` (at most every 10 s): the watcher's idle
watchdog counts it as use.

Utilisation (hypercli/usage.py has the fields): ``launch``, ``poll`` and ``cancel`` take an
optional ``sample: s``. With it, while the agent has running attempts (its own and those the
request names) and one last time after, a sample of the node and of each running attempt is
taken when ``sample`` s have passed since the last one (at answer time, never more often;
no thread, no process per poll: ``/proc``, ``statvfs``, and ``pynvml`` or one ``nvidia-smi``
query per sample on a node with GPUs). Samples wait in a buffer (the oldest dropped beyond
SAMPLES_MAX) and ride on the next answer as ``samples: [{"ts": unix s, "node": {...},
"attempts": {id: {...}}}]``. An attempt's processes are its session's (the task's shell
starts one); a container's processes run under the container runtime and are not counted.
An attempt killed by SIGKILL (exit 137) that was not cancelled is checked against the
kernel's OOM killer: the ``oom_kill`` counter of the memory cgroups its processes were seen
in (cgroup v2 ``memory.events``, v1 ``memory.oom_control``), else the kernel log
(``/dev/kmsg``) naming one of its processes; when found, ``exit`` carries ``oom`` (text) and
the state ``oom`` too.

A state is ``{"state": "running"|"exited"|"lost"|"unknown", "code": int?, "started": s?,
"ended": s?, "cancelled": bool, "oom": text?, "metrics": {...}?, "inline": {...}?}``;
metrics (the last value of each key over all lines of metrics.jsonl) come with every state
that is not running.
``launch``, ``poll`` and ``cancel`` take an optional ``inline: N`` (bytes): every state that
is not running then also carries ``inline = {"stdout": b64?, "stderr": b64?, "order": b64?,
"output_empty": bool, "checkpoint_empty": bool}``, the logs included when all together are at
most N bytes,
so a client over a network brings back an ended attempt's logs in the answer it already waits
for instead of a second round trip (``output_empty``: the attempt's output folder holds
nothing to copy; ``checkpoint_empty``: its ``HYPER_CHECKPOINT`` folder holds nothing, so no
save of it made anything to copy).
"""

import binascii
import fcntl
import json
import os
import select
import shutil
import signal
import stat
import sys
import time

# ``subprocess`` is imported where a process is started: an agent that only answers ``hello``
# (bootstrap) starts ~4 ms sooner, and it is started once per node and connection.

VERSION = 2
POLL_TICK = 0.005  # s between exit-file checks of other agents' attempts inside a poll wait
FULL_EVERY = 0.25  # s between full state looks (lock, pid) of other agents' attempts
METRICS_MAX = 4 << 20  # bytes of metrics.jsonl read at most (the last 4 MiB)
#: set to the interface of a rank's address (unless the task sets them): gloo and NCCL
#: otherwise pick the address the host name resolves to, often 127.0.0.1 (pytorch.org,
#: "Distributed communication package", Common environment variables)
SOCKET_IFNAME = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
#: runs a task whose spec has a checkpoint: restore first (exit 75 when that fails), then the
#: task with a loop beside it that saves every HYPER_CKPT_EVERY s and at once when the node's
#: preemption marker appears, then a last save (after a failure told when the task ended:
#: mount/checkpoint.py keeps the last complete generation if a file changed as it ended);
#: saves only a folder that is not empty (a task that never checkpoints costs no save), one
#: at a time (the save takes an flock). The task itself runs without the wrapper's
#: HYPER_CKPT_* variables (its commands are internal) and without HYPER_HOME (the state
#: folder of the machine that runs ``hyper``)
CHECKPOINT_WRAPPER = r"""
ck="$HYPER_CHECKPOINT"
save() {
  [ -n "$HYPER_CKPT_SAVE" ] || return 0
  for f in "$ck"/* "$ck"/.[!.]* "$ck"/..?*; do  # not empty (a shell test, no process)
    if [ -e "$f" ] || [ -L "$f" ]; then
      sh -c "$HYPER_CKPT_SAVE $*" || echo "hyper: saving the checkpoint failed" >&2
      return 0
    fi
  done
}
if [ -n "$HYPER_CKPT_RESTORE" ]; then
  sh -c "$HYPER_CKPT_RESTORE" </dev/null || {  # stdin: the task's (a container's secrets)
    echo "hyper: restoring the checkpoint failed" >&2; exit 75; }
fi
(
  n=0; noticed=
  while sleep 1 </dev/null >/dev/null 2>&1; do  # (its sleep holds no log pipe: killed
    # with the task's end, the loop leaves nothing the agent's log pump waits on)
    n=$((n + 1))
    if [ -z "$noticed" ] && [ -n "$HYPER_CKPT_PREEMPTED" ] && [ -e "$HYPER_CKPT_PREEMPTED" ]
    then noticed=1; n=0; save
    elif [ "$n" -ge "$HYPER_CKPT_EVERY" ]; then n=0; save
    fi
  done
) &
side=$!
(unset HYPER_CKPT_SAVE HYPER_CKPT_RESTORE HYPER_CKPT_EVERY HYPER_CKPT_PREEMPTED HYPER_HOME
 exec "$@")
code=$?
ended=; [ "$code" = 0 ] || ended="--stopped-at $(date +%s)"
kill "$side" 2>/dev/null
wait "$side" 2>/dev/null
save $ended
exit "$code"
"""
#: a container's first command when its task has secrets: ``export NAME='value'`` lines
#: read from stdin (the agent's pipe, closed after them), then the task. So a secret's value
#: is on no command line and in no file, not even the container runtime's own store
#: (podman keeps ``-e`` values in its state database after the container is removed).
SECRETS_PROLOGUE = ('s=; while IFS= read -r l || [ -n "$l" ]; do s="$s$l\n"; done; '
                    'eval "$s"; exec "$@"')  # builtins only: any image with a shell
SAMPLES_MAX = 720  # samples buffered at most between two answers (1 h at 5 s)
GPU_QUERY = ("--query-gpu=index,utilization.gpu,memory.used,memory.total,temperature.gpu,"
             "power.draw")
RUNTIME_RECHECK = 10.0  # s a failed container runtime check is believed before a new one
CONTACT_EVERY = 10.0  # s between touches of ROOT/contact (read by the node watcher)


class _Child:
    """A task this agent started and has not reaped yet (the attempt's lock held by ``lock``)."""

    __slots__ = ("id", "dir", "spec", "env", "proc", "lock", "started", "finishing")

    def __init__(self, attempt_id, d, spec, env, proc, lock, started):
        self.id, self.dir, self.spec, self.env = attempt_id, d, spec, env
        self.proc, self.lock, self.started = proc, lock, started
        self.finishing = False  # the ``finish`` command runs (the task itself succeeded)


def _no_op(signum, frame):
    """A Python-level handler: wakes ``select`` (through the wakeup fd) and, unlike SIG_IGN,
    is reset to the default in the tasks at exec."""


class Agent:
    """Serves requests for the attempt folders under ``root``; the parent of the tasks it
    starts (see the module docstring)."""

    def __init__(self, root):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.tasks = os.path.join(self.root, "tasks")
        os.makedirs(self.tasks, exist_ok=True)
        self.inbuf = b""
        self.woken = False
        self.children = {}  # attempt id -> _Child: tasks started here, not reaped yet
        self.ended = 0  # children reaped so far (a poll wait looks again when it moves)
        self.contact = 0.0  # unix s of the last touch of ROOT/contact
        self.base_env = dict(os.environ)
        self.runtime = None  # (checked at, error or None): does the container runtime work?
        self.is_podman = None  # the container runtime is podman (asked when first needed)
        self.sampler = _Sampler(self.root)
        self.sample_every = 0.0  # s between utilisation samples, from the last request
        self.own_cgroups = None  # this agent's memory cgroups (its tasks start in them)
        self.pump = None  # carries its tasks' output to their logs (_Pump)
        # SIGCHLD → a byte on _sig_w → select() returns: a task's end is seen at once
        self._sig_r, self._sig_w = os.pipe()
        for fd in (self._sig_r, self._sig_w):
            os.set_blocking(fd, False)
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        signal.signal(signal.SIGCHLD, _no_op)
        signal.signal(signal.SIGHUP, _no_op)   # a hangup of the session must not end tasks
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # a closed connection: EPIPE, not death
        # (subprocess restores SIGPIPE's default in the tasks: restore_signals)

    # -- input -------------------------------------------------------------------------
    def _fill(self, timeout):
        """Read what stdin has within timeout, reaping tasks that end meanwhile; False at
        EOF. Returns early (True) when a task ended, so a poll wait can look again."""
        r, _, _ = select.select([0, self._sig_r] + ([self.pump] if self.pump else []), [],
                                [], timeout)
        if self.pump in r:
            self.pump.carry()
        if self._sig_r in r:
            self._children_ended()
        if 0 not in r:
            return True
        chunk = os.read(0, 65536)
        if not chunk:
            return False
        self.inbuf += chunk
        return True

    def _pending_request(self):
        """Consume wake lines; True when a real request is waiting in the buffer."""
        while b"\n" in self.inbuf:
            line, rest = self.inbuf.split(b"\n", 1)
            if line.strip() in (b"", b'{"op":"wake"}', b'{"op": "wake"}'):
                self.inbuf = rest
                self.woken = True
                continue
            return True
        return False

    def serve(self):
        """Answer requests until EOF on stdin; then go on reaping this agent's running tasks
        (detached from the connection, see the module docstring) and return."""
        parent_done = _detach_from_caller()
        out = sys.stdout.buffer
        try:
            while True:
                while not self._pending_request():
                    if not self._fill(None):
                        return
                line, self.inbuf = self.inbuf.split(b"\n", 1)
                self.woken = False  # wakes sent before this request were for an earlier poll
                req = {}
                try:
                    req = json.loads(line)
                    resp = self.handle(req)
                except Exception as e:  # a bad request must not kill the agent
                    resp = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
                resp["id"] = req.get("id") if isinstance(req, dict) else None
                try:
                    out.write(json.dumps(resp, separators=(",", ":")).encode() + b"\n")
                    out.flush()
                except OSError:  # the connection is gone
                    return
        finally:
            self._orphaned(parent_done)

    def _orphaned(self, parent_done):
        """The connection ended: let the caller's process exit, keep reaping, then return."""
        devnull = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)  # the SSH session ends once nothing holds its pipes
        os.close(devnull)
        if parent_done is not None:
            os.close(parent_done)
        while self.children:
            self._pause(1.0)

    def _pause(self, seconds):
        """Wait ``seconds``, carrying the tasks' output meanwhile (or until a task ends)."""
        end = time.time() + seconds
        while True:
            left = end - time.time()
            if left <= 0:
                return
            r, _, _ = select.select([self._sig_r] + ([self.pump] if self.pump else []), [],
                                    [], left)
            if self.pump in r:
                self.pump.carry()
            if self._sig_r in r:
                self._children_ended()
                return

    def _children_ended(self):
        """SIGCHLD came (its bytes on the wakeup pipe): empty the pipe, reap."""
        try:
            while os.read(self._sig_r, 4096):
                pass
        except BlockingIOError:
            pass
        self._reap()

    def handle(self, req):
        op = req.get("op")
        fn = getattr(self, "op_" + str(op), None)
        if fn is None:
            return {"ok": False, "error": "unknown op %r" % (op,)}
        now = time.time()
        if now - self.contact >= CONTACT_EVERY:  # the idle watchdog's sign of use
            self.contact = now
            try:
                with open(os.path.join(self.root, "contact"), "w"):
                    pass
            except OSError:
                pass
        if op in ("launch", "poll", "cancel"):
            self.sample_every = float(req.get("sample") or 0)
        result = fn(req)
        if op in ("launch", "poll", "cancel"):
            if self.sample_every > 0:
                self._sample(result.get("states") or {}, time.time())
            if self.sampler.buf:
                result["samples"] = self.sampler.take()
            marker = _read_json(os.path.join(self.root, "preempted"))
            if marker is not None:
                result["preempted"] = marker
        result["ok"] = True
        return result

    def _sample(self, states, now):
        """Sample when due (see the module docstring): this agent's running tasks and the
        attempts of ``states`` reported running."""
        if now - self.sampler.last < self.sample_every:  # the common case: costs nothing
            return
        running = {}
        for i, c in self.children.items():
            if not c.finishing and c.proc is not None and c.proc.returncode is None:
                running[i] = (c.proc.pid, c.spec.get("gpus") or [])
        foreign = [i for i, st in states.items()
                   if st.get("state") == "running" and i not in running]
        if not self.sampler.due(self.sample_every, running or foreign, now):
            return
        for i in foreign:
            pid = (_read_json(os.path.join(self.tasks, i, "pid")) or {}).get("pid")
            if pid:
                running[i] = (int(pid), _environ_gpus(int(pid)))
        self.sampler.sample(running, now)

    # -- ops ---------------------------------------------------------------------------
    def op_hello(self, req):
        st = os.statvfs(self.root)
        mem = 0
        try:
            with open("/proc/meminfo") as f:
                mem = int(f.readline().split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        gpus = _gpus()
        return {"version": VERSION, "hostname": os.uname().nodename,
                "cpus": os.cpu_count() or 1, "memory_bytes": mem,
                "disk_free_bytes": st.f_bavail * st.f_frsize, "gpus": gpus,
                "docker": shutil.which("docker"), "python": sys.version.split()[0],
                "root": self.root, "pid": os.getpid()}

    def op_launch(self, req):
        attempts = req.get("attempts", [])
        refused = self.witness(attempts)
        states = {a["id"]: refused.get(a["id"]) or self.launch(a) for a in attempts}
        refused = {k: v for k, v in states.items() if v["state"] == "refused"}
        if float(req.get("wait", 0) or 0) > 0 and len(refused) < len(states) + len(
                req.get("ids", [])):  # then wait as ``poll`` does, one round trip
            ids = [i for i in dict.fromkeys(list(states) + list(req.get("ids", [])))
                   if i not in refused]
            states = dict(self._wait(ids, float(req["wait"])), **refused)
        return self._inline(req, states)

    def _inline(self, req, states):
        """The ``{"states": ...}`` answer, with ``inline`` added when the request asks."""
        limit = int(req.get("inline", 0) or 0)
        if limit > 0:
            for i, s in states.items():
                if s["state"] not in ("running", "unknown", "refused"):
                    s["inline"] = self.inline(i, limit)
        return {"states": states}

    def inline(self, attempt_id, limit):
        """``{"stdout": b64, "stderr": b64, "order": b64, "output_empty": bool,
        "checkpoint_empty": bool}`` of an ended attempt; the logs are left out when
        together they exceed ``limit`` bytes (the client reads them)."""
        d = self.dir(attempt_id)
        out = {}
        sizes = {}
        for name in LOG_FILES:
            try:
                st = os.lstat(os.path.join(d, name))
                sizes[name] = st.st_size if stat.S_ISREG(st.st_mode) else 0
            except OSError:
                sizes[name] = 0
        if sum(sizes.values()) <= limit:
            for name in LOG_FILES:
                out[name] = ""
                if not sizes[name]:
                    continue
                try:  # (a log that is not a regular file is not read: left empty)
                    fd = _open_regular(os.path.join(d, name))
                except OSError:
                    continue
                with os.fdopen(fd, "rb") as f:
                    out[name] = _b64(f.read(limit + 1))
        pid = _read_json(os.path.join(d, "pid")) or {}
        for key, folder in (("output_empty", pid.get("output")),
                            ("checkpoint_empty", pid.get("checkpoint"))):
            if not folder:  # (``os.scandir(None)`` would list the agent's own folder)
                out[key] = True
                continue
            try:
                with os.scandir(folder) as it:
                    out[key] = next(it, None) is None
            except OSError:
                out[key] = True
        return out

    def op_poll(self, req):
        return self._inline(req, self._wait(req.get("ids", []), float(req.get("wait", 0) or 0)))

    def _wait(self, ids, wait):
        """States of ``ids``, once one of them is not running, a request or a wake arrives,
        or ``wait`` s pass; metrics added to the states that are not running."""
        self._reap()
        deadline = time.time() + wait
        states = {i: self.state(i, with_metrics=False) for i in ids}
        last_full = time.time()
        while (all(s["state"] == "running" for s in states.values()) and ids
               and not self.woken and time.time() < deadline):
            # this agent's own tasks wake the wait by SIGCHLD; other agents' attempts (a
            # connection before this one) are looked at every POLL_TICK s
            foreign = any(i not in self.children for i in ids)
            left = max(0.0, deadline - time.time())
            ended = self.ended
            if not self._fill(min(POLL_TICK, left) if foreign else left):
                break
            if self._pending_request() or self.woken:
                break
            if self.ended != ended or (foreign and (
                    time.time() - last_full >= FULL_EVERY or any(
                        os.path.exists(os.path.join(self.tasks, i, "exit"))
                        for i in ids if i not in self.children))):
                states = {i: self.state(i, with_metrics=False) for i in ids}
                last_full = time.time()
        for i, s in states.items():
            if s["state"] != "running":
                s["metrics"] = self.metrics(i)
        return states

    def op_cancel(self, req):
        import subprocess
        grace = float(req.get("grace", 5))
        ids = req.get("ids", [])
        stops = []
        stopped = []
        for i in ids:
            d = self.dir(i)
            if os.path.isdir(d) and not os.path.exists(os.path.join(d, "exit")):
                try:
                    os.close(_open_regular(os.path.join(d, "cancelled"),
                                           os.O_WRONLY | os.O_CREAT))
                except OSError:
                    pass
                self._signal(i, signal.SIGTERM)
                stopped.append(i)
                if (_read_json(os.path.join(d, "pid")) or {}).get("image"):
                    # the container's init ignores the docker CLI's signals: stop it by name
                    stops.append(subprocess.Popen(
                        [shutil.which("docker") or "docker", "stop", "-t", str(int(grace)),
                         "hyper-" + i], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        until = time.time() + grace + 30
        for p in stops:
            while p.poll() is None and time.time() < until:
                self._pause(0.05)  # (the tasks' output is carried meanwhile)
            if p.poll() is None:
                p.kill()
                p.wait()

        def busy(i):  # running, or a process of its group is left (it ignored SIGTERM)
            return self.state(i, with_metrics=False)["state"] == "running" or (
                i in stopped and self._signal(i, 0))
        deadline = time.time() + grace
        while time.time() < deadline and any(busy(i) for i in ids):
            self._pause(0.02)
        for i in ids:
            if busy(i):
                self._signal(i, signal.SIGKILL)
        self._pause(0.05)
        return self._inline(req, {i: self.state(i) for i in ids})

    def op_read(self, req):
        name = req.get("stream", "stdout")
        if name not in ("stdout", "stderr", "order", "metrics.jsonl"):
            raise ValueError("stream must be stdout, stderr, order or metrics.jsonl")
        path = os.path.join(self.dir(req["id"]), name)
        offset, limit = int(req.get("offset", 0)), int(req.get("limit", 1 << 20))
        state = self.state(req["id"], with_metrics=False)["state"]
        try:  # NotRegular (a symlink, a FIFO) is the request's error, said to the client
            fd = _open_regular(path)
        except FileNotFoundError:
            size, data = 0, b""
        else:
            with os.fdopen(fd, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                data = f.read(limit)
        return {"data": _b64(data), "offset": offset + len(data),
                "size": size, "done": state != "running" and offset + len(data) >= size,
                "state": state}

    # -- attempts ----------------------------------------------------------------------
    def dir(self, attempt_id):
        if not attempt_id or "/" in attempt_id or attempt_id.startswith("."):
            raise ValueError("bad attempt id %r" % (attempt_id,))
        return os.path.join(self.tasks, attempt_id)

    def state(self, attempt_id, with_metrics=True):
        d = self.dir(attempt_id)
        child = self.children.get(attempt_id)
        if child is not None:
            if child.proc.poll() is None:  # started here and not ended: nothing to read
                return {"state": "running", "started": child.started,
                        "cancelled": os.path.exists(os.path.join(d, "cancelled"))}
            self._reap()
            if attempt_id in self.children:  # its ``finish`` command started
                return self.state(attempt_id, with_metrics)
        # the lock is looked at BEFORE the exit file: the agent writes ``exit`` and only
        # then releases the lock, so "no exit, lock free" seen in this order means it died
        locked = _locked(os.path.join(d, "script.sh"))
        s = {"state": "unknown", "cancelled": os.path.exists(os.path.join(d, "cancelled"))}
        pid = _read_json(os.path.join(d, "pid"))
        if pid:
            s["started"] = pid.get("started")
        ex = _read_json(os.path.join(d, "exit"))
        if ex is not None:
            s.update(state="exited", code=ex.get("code"), ended=ex.get("ended"))
            if ex.get("oom"):
                s["oom"] = ex["oom"]
        elif not os.path.isdir(d):
            return s
        elif locked:
            s["state"] = "running"
        else:
            s["state"] = "lost"
            self._signal(attempt_id, signal.SIGKILL)  # orphans of a dead agent
            made = (pid or {}).get("attempt_output")  # its fresh output folder never wins
            if isinstance(made, str) and os.path.basename(made) == ATTEMPT_OUTPUT + attempt_id:
                _remove_made(made)
        if with_metrics and s["state"] != "running":
            s["metrics"] = self.metrics(attempt_id)
        return s

    def metrics(self, attempt_id):
        path = os.path.join(self.dir(attempt_id), "metrics.jsonl")
        out = {}
        try:
            with os.fdopen(_open_regular(path), "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(max(0, size - METRICS_MAX))
                lines = f.read().splitlines()
        except OSError:
            return out
        for line in lines:
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                out.update(obj)
        return out

    def _signal(self, attempt_id, sig):
        """Send ``sig`` to the process group of the attempt's task: the pid this agent
        started (its memory), else the one in the attempt's ``pid`` file (written by the
        agent that started it, where no container can write) when that process is still
        the one started then (same start time, its own session) or is gone (its group's
        other processes are the task's: the kernel reuses no pid still naming a group).
        True when a process of it was there (``sig`` 0 only asks)."""
        child = self.children.get(attempt_id)
        if child is not None and child.proc is not None:
            pid = child.proc.pid
        else:
            rec = _read_json(os.path.join(self.dir(attempt_id), "pid")) or {}
            try:
                pid = int(rec.get("pid") or 0)
            except (TypeError, ValueError):
                return False
            if pid <= 1:
                return False
            now = _proc_start(pid)
            if now is not None and (now[1] != pid or (
                    rec.get("ticks") is not None and now[0] != rec.get("ticks"))):
                return False  # another process (a reused pid), not the task's session leader
        try:
            os.killpg(pid, sig)
            return True
        except (ProcessLookupError, PermissionError):
            return False

    def witness(self, specs):
        """Write the witnesses of the launches of ``specs`` not seen before: a controller's
        signed intent of the attempt (``witness: {"dir": its backups' folder here, "name":
        the workflow's record there, "holder": the controller's lease holder id, "line":
        {"seq", "mac", "rows"}}``, hypercli/controller/backup.py), appended to
        ``<dir>/<name>.intents`` and fsynced under an flock of ``<name>.lock`` (the lock the
        backups' server takes: its rewrite of that file when a whole copy lands keeps the
        line), so that whoever takes the workflow over finds the attempt on this node even
        when it reached no other. A launch whose record here names another holder whose
        lease is live by this node's clock (ttl - (now - renewed_at) > 0, ttl null: for
        ever; the backups' server's rule) is refused, as is one whose witness cannot be
        written: a controller that lost its lease starts nothing through a node that saw
        the takeover. Returns {attempt id: refused state}."""
        import re
        groups = {}
        for spec in specs:
            w = spec.get("witness")
            if isinstance(w, dict) and not os.path.isdir(self.dir(spec["id"])):
                groups.setdefault((w.get("dir"), w.get("name"), w.get("holder")),
                                  []).append(spec)
        refused = {}
        for (folder, name, holder), group in groups.items():
            lines = {}
            for spec in group:
                line = spec["witness"].get("line") or {}
                lines.setdefault(line.get("seq"), line)
            try:
                if not (isinstance(folder, str) and isinstance(name, str) and re.fullmatch(
                        r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}", name)):
                    raise ValueError("a witness without a valid record name")
                why = self._witness(os.path.expanduser(folder), name, holder,
                                    list(lines.values()))
            except (OSError, ValueError, TypeError) as e:
                why = "its launch could not be witnessed on this node: %s" % e
            if why:
                for spec in group:
                    refused[spec["id"]] = {"state": "refused", "error": why, "lacks": None}
        return refused

    @staticmethod
    def _witness(folder, name, holder, lines):
        """Append ``lines`` to ``folder/name.intents`` unless another holder's lease is live
        in ``folder/name.json`` (:meth:`witness`); returns why not, or None."""
        os.makedirs(folder, mode=0o700, exist_ok=True)
        base = os.path.join(folder, name)
        lock = os.open(base + ".lock", os.O_CREAT | os.O_RDWR | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)
            have = _read_json(base + ".json")
            if isinstance(have, dict) and have.get("holder") != holder:
                ttl = have.get("ttl")
                left = None if ttl is None else ttl - (time.time() - have.get("renewed_at", 0))
                if left is None or left > 0:
                    return ("workflow record %s is driven by %s here (its lease on this node); "
                            "a launch from %s is refused" % (name, have.get("holder"), holder))
            fd = os.open(base + ".intents", os.O_CREAT | os.O_WRONLY | os.O_APPEND
                         | os.O_NOFOLLOW, 0o600)
            try:
                os.write(fd, b"".join(json.dumps(line).encode() + b"\n" for line in lines))
                os.fsync(fd)
            finally:
                os.close(fd)
            return None
        finally:
            os.close(lock)

    def launch(self, spec):
        """Start one attempt (idempotent per attempt id): its folder, the lock taken, the
        task spawned as this agent's child. Returns the attempt's state."""
        attempt_id = spec["id"]
        d = self.dir(attempt_id)
        if spec.get("image") and not os.path.isdir(d):
            broken = self.runtime_error()
            if broken:  # a fault of the node, not of the task: nothing is started
                return {"state": "refused", "error": broken, "lacks": "containers"}
        engine = spec.get("engine")
        if engine:
            spec["engine_path"] = self.engine_file(engine["source"])
            if not spec.get("image") and not os.path.isdir(d):
                env = dict(self.base_env, **(spec.get("env") or {}))
                lacks = self.engine_missing(spec["engine_path"], engine["kind"], env)
                if lacks:
                    return {"state": "refused", "error": lacks, "lacks": engine["kind"]}
        try:
            os.mkdir(d)
        except FileExistsError:
            return self.state(attempt_id)  # launched before: idempotent
        if spec.get("bind_address"):  # a rank of a multi-node task: talk on that address
            iface = _iface_of(spec["bind_address"])
            if iface:
                own = spec.get("env") or {}
                spec["env"] = dict(own, **{k: iface for k in SOCKET_IFNAME if k not in own})
        lock = os.open(os.path.join(d, "script.sh"), os.O_CREAT | os.O_WRONLY | os.O_CLOEXEC,
                       0o600)
        fcntl.flock(lock, fcntl.LOCK_EX)  # a new file: nobody else holds it
        os.write(lock, ("set -e\n" + spec["script"] + "\n").encode())
        env = dict(self.base_env)
        env.update(spec.get("env") or {})
        secrets = spec.get("secrets") or {}
        if not spec.get("image"):  # in the task's environment only (a container: its stdin)
            env.update(secrets)
        env["HYPER_METRICS"] = os.path.join(d, "metrics.jsonl")
        if engine:
            env.update(HYPER_ENGINE=engine["kind"], HYPER_ENGINE_ATTEMPT=attempt_id,
                       HYPER_ENGINE_DIR=d)
        for var, text in sorted((spec.get("files") or {}).items()):  # e.g. HYPER_HOSTFILE
            path = os.path.join(d, var.lower())
            with open(path, "w") as f:
                f.write(text)
            env[var] = path
        cwd = spec.get("cwd") if not spec.get("image") else None
        ck = spec.get("checkpoint")
        if ck:  # saved and restored around the task by CHECKPOINT_WRAPPER
            os.makedirs(ck["dir"], exist_ok=True)
            spec["binds"] = dict(spec.get("binds") or {}, **{ck["dir"]: ck["dir"]})
            env.update(HYPER_CKPT_SAVE=ck["save"], HYPER_CKPT_RESTORE=ck.get("restore") or "",
                       HYPER_CKPT_EVERY=str(max(1, int(ck.get("every") or 60))),
                       HYPER_CKPT_PREEMPTED=ck.get("preempted") or "")
        started = time.time()
        try:
            if spec.get("output"):  # a fresh folder; the task's output only if it wins
                spec["attempt_output"] = env["HYPER_OUTPUT"] = _fresh_output(
                    spec["output"], attempt_id)
            if spec.get("image"):  # bound into the container: made here, a regular file
                os.close(_open_regular(env["HYPER_METRICS"], os.O_WRONLY | os.O_CREAT))
            argv = _command(d, spec, env, [self.root] + list(spec.get("hide") or []),
                            spec.get("image") and self.podman())
            if ck:
                argv = ["/bin/sh", "-c", CHECKPOINT_WRAPPER, "hyper-task"] + argv
            feed = None
            if spec.get("image") and secrets:
                import shlex
                feed = "".join("export %s=%s\n" % (k, shlex.quote(v))
                               for k, v in sorted(secrets.items())).encode()
            proc = self._spawn(d, argv, env, cwd, new_session=True, feed=feed)
        except Exception as e:
            _note(d, "cannot start the task: %s" % e)
            _write_json(os.path.join(d, "pid"), {"pid": None, "started": started})
            self._end(_Child(attempt_id, d, spec, env, None, lock, started), 127)
            return self.state(attempt_id)
        _write_json(os.path.join(d, "pid"), {"pid": proc.pid, "started": started,
                                             "ticks": (_proc_start(proc.pid) or (None,))[0],
                                             "image": spec.get("image"),
                                             "output": spec.get("output"),
                                             "attempt_output": spec.get("attempt_output"),
                                             "checkpoint": (ck or {}).get("dir")})
        self.children[attempt_id] = _Child(attempt_id, d, spec, env, proc, lock, started)
        if self.sample_every > 0:  # OOM kills in the cgroups the task starts in count
            if self.own_cgroups is None:
                self.own_cgroups = _memory_cgroups(os.getpid())
            self.sampler.cgroups[attempt_id] = {g: _oom_kills(g) for g in self.own_cgroups}
        return {"state": "running", "cancelled": False, "started": started}

    def engine_file(self, source):
        """The path of the engine wrapper with text ``source``, written once (atomically)."""
        data = source.encode()
        import hashlib
        path = os.path.join(self.root, "engine-%s.py" % hashlib.sha256(data).hexdigest()[:12])
        if not os.path.exists(path):
            tmp = "%s.%d.tmp" % (path, os.getpid())
            with open(tmp, "wb") as f:
                f.write(data)
            os.rename(tmp, path)
        return path

    @staticmethod
    def engine_missing(path, kind, env):
        """What engine ``kind`` lacks on this node for a task with environment ``env``
        (the wrapper's ``--check``), or None."""
        import subprocess
        p = subprocess.run([sys.executable, "-I", "-S", path, "--check", kind], env=env,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=60)
        if p.returncode == 0:
            return None
        return p.stdout.decode(errors="replace").strip() or "the %s engine check failed" % kind

    def podman(self):
        """True when the container runtime is podman (``docker --version``, asked once): its
        tmpfs mounts take ``notmpcopyup``, or they would start as a copy of what they hide."""
        if self.is_podman is None:
            import subprocess
            try:
                out = subprocess.run([shutil.which("docker") or "docker", "--version"],
                                     capture_output=True, timeout=60).stdout
            except (OSError, subprocess.TimeoutExpired):
                out = b""
            self.is_podman = b"podman" in out.lower()
        return self.is_podman

    def runtime_error(self):
        """None when the container runtime answers ``docker info``, else why not (a missing
        client or a daemon that does not run). A success is kept for this agent's life, a
        failure for RUNTIME_RECHECK seconds."""
        now = time.time()
        if self.runtime is not None and (self.runtime[1] is None
                                         or now - self.runtime[0] < RUNTIME_RECHECK):
            return self.runtime[1]
        import subprocess
        docker = shutil.which("docker", path=self.base_env.get("PATH"))
        if docker is None:
            error = "no container runtime: docker is not installed on this node"
        else:
            try:
                p = subprocess.run([docker, "info"], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, env=self.base_env, timeout=60)
                tail = p.stderr.decode(errors="replace").strip().splitlines()[-1:] or [""]
                error = None if p.returncode == 0 else (
                    "the container runtime does not work on this node (`docker info` exited "
                    "%d: %s)" % (p.returncode, tail[0][:300]))
            except (OSError, subprocess.TimeoutExpired) as e:
                error = "the container runtime does not answer on this node: %s" % e
        self.runtime = (now, error)
        return error

    def _spawn(self, d, argv, env, cwd, new_session, feed=None):
        """The command as a child of this agent, its output carried by the agent's log pump
        (:class:`_Pump`) to the attempt's logs (``vfork``: no copy of this process is made);
        ``feed`` (bytes, at most a pipe's buffer: the secrets' exports) is written to its
        stdin, which is then closed."""
        import subprocess
        if self.pump is None:
            self.pump = _Pump()
        fds = []
        try:
            fds = self.pump.attach(os.path.basename(d), d)
            proc = subprocess.Popen(argv, cwd=cwd or None, env=env, stdout=fds[0],
                                    stderr=fds[1], stdin=subprocess.DEVNULL if feed is None
                                    else subprocess.PIPE, start_new_session=new_session)
        finally:
            for fd in fds:
                os.close(fd)
        if feed is not None:
            try:
                proc.stdin.write(feed)
            except OSError:  # it ended at once: its exit says why
                pass
            finally:
                try:
                    proc.stdin.close()
                except OSError:
                    pass
        return proc

    def _reap(self):
        """Collect the tasks (and ``finish`` commands) of this agent that ended."""
        for child in list(self.children.values()):
            rc = child.proc.poll()
            if rc is None:
                continue
            if self.pump is not None:  # what it wrote is in its logs before its end is told
                self.pump.drain(child.id)
            code = rc if rc >= 0 else 128 - rc
            if child.finishing:
                if code != 0:
                    _note(child.dir, "the task succeeded but saving its outputs failed "
                                     "(exit %d)" % code)
                    code = 70
                    if child.spec.get("promoted"):  # not the task's output after all
                        disown_output(os.path.join(self.root, "owners"),
                                      child.spec["output"])
            elif code == 0 and child.spec.get("attempt_output") and not os.path.exists(
                    os.path.join(child.dir, "cancelled")) and not self._promote(child):
                code = 70
            if code == 0 and not child.finishing and child.spec.get("finish") and \
                    not os.path.exists(os.path.join(child.dir, "cancelled")):
                try:  # after a successful task: e.g. push HYPER_OUTPUT to object storage
                    child.proc = self._spawn(child.dir, ["/bin/sh", "-c",
                                                         child.spec["finish"]],
                                             child.env, None, new_session=True)
                    child.finishing = True
                    continue
                except OSError as e:
                    _note(child.dir, "cannot save the task's outputs: %s" % e)
                    code = 70
            self._end(child, code)

    def _promote(self, child):
        """Make the attempt's fresh output folder the task's output (:func:`_promote`, the
        attempt it is from kept in ``ROOT/owners``; under the flock of ``ROOT/owners/lock``,
        as the local nodes' agents share one outputs root); False, with the reason in its
        stderr, when it cannot be."""
        owners = os.path.join(self.root, "owners")
        try:
            os.makedirs(owners, 0o700, exist_ok=True)
            lock = os.open(os.path.join(owners, "lock"),
                           os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(lock, fcntl.LOCK_EX)
                child.spec["promoted"] = _promote(child.spec["attempt_output"],
                                                  child.spec["output"], attempt_of(child.id),
                                                  owners)
            finally:
                os.close(lock)
            return True
        except OSError as e:
            _note(child.dir, "the task succeeded but its output was not kept: %s" % e)
            return False

    def _end(self, child, code):
        """Record an attempt's end: ``exit`` written atomically, then its lock released. A
        task killed by SIGKILL, not cancelled, is checked against the OOM killer. The
        attempt's fresh output folder, when it did not become the task's, is removed."""
        if child.spec.get("attempt_output"):
            _remove_made(child.spec["attempt_output"])
        ex = {"code": code, "ended": time.time()}
        if code == 137 and not child.finishing and not os.path.exists(
                os.path.join(child.dir, "cancelled")):
            why = self.sampler.oom(child.id, child.started, ex["ended"])
            if why:
                ex["oom"] = why
                _note(child.dir, why)
        self.sampler.forget(child.id)
        if child.spec.get("engine_path"):  # nothing of the rank's engine outlives it
            import subprocess
            try:
                subprocess.run([sys.executable, "-I", "-S", child.spec["engine_path"],
                                "--sweep", child.id], timeout=60, stdout=subprocess.DEVNULL)
            except (OSError, subprocess.TimeoutExpired) as e:
                _note(child.dir, "cannot stop the engine's processes: %s" % e)
        _write_json(os.path.join(child.dir, "exit"), ex)
        if self.pump is not None:
            self.pump.release(child.id)
        os.close(child.lock)
        self.children.pop(child.id, None)
        self.ended += 1


LOG_FILES = ("stdout", "stderr", "order")  # an attempt's logs, as copied off its node
LOG_READ = 1 << 16  # bytes read from a task's pipe at a time (a pipe's default buffer)
#: bytes of a line without its end after which the part written so far counts as a line in
#: ``order`` (a progress bar's ``\r`` ends a line too): the order of a stream that never
#: ends its lines still moves, and nothing holds more than LOG_READ bytes of it
LINE_MAX = 1 << 16
DRAIN_MAX = 4 << 20  # bytes read at most from a pipe at a task's end (what it left in it)
ORDER_STREAMS = (b"o", b"e")  # how ``order`` names stdout and stderr


class _Logs:
    """The logs of one attempt while processes of it write into the pump's pipes: fds of its
    ``stdout`` and ``stderr`` files (appended to), of ``order`` (made at its first record;
    -1 not yet, None: not kept), the run now open (0: stdout, 1: stderr, None: no line
    yet), where each stream's last complete line ends (bytes into its file), the bytes of
    each stream's unended line (-1: it is over LINE_MAX, all of it counts as come), the
    pipes still open, and whether the attempt ended."""

    __slots__ = ("id", "dir", "files", "order", "cur", "done", "part", "pipes", "ended",
                 "fds")

    def __init__(self, attempt_id, d, files, keep_order):
        self.id, self.dir, self.files = attempt_id, d, files
        self.order = -1 if keep_order else None
        self.cur = None
        self.done = [0, 0]
        self.part = [0, 0]
        self.pipes = 0
        self.ended = False
        self.fds = []  # read ends of its open pipes


class _Pump:
    """Carries what the agent's tasks write to their logs, and the order in which their lines
    came; driven by the agent's own loop (no thread, no process of its own).

    A task's stdout and stderr are two pipes, all of them in one epoll set whose fd the
    agent's loop waits on beside its requests and SIGCHLD (:meth:`carry`): what comes on
    each pipe is appended to the attempt's ``stdout`` or ``stderr`` (kept exact). When a
    stream's line ends (``\\n``, ``\\r``, or LINE_MAX bytes without one) after lines of
    the other stream, the run of lines of that other stream is closed: the record ``o N``
    or ``e N`` (stdout or stderr, N: the byte offset in its file where the run ends) is
    appended to ``order``. So ``order`` holds one short line per switch between the streams
    (none for a task that writes one stream only, and no file then), and a reader rebuilds
    the lines of both streams in the order they came (:mod:`hypercli.logmerge`). Lines
    written to both streams before the agent reads them are taken stdout first. At most
    LOG_READ bytes of a task's output are held at a time, whatever the task writes; while
    the agent is busy with something else (a ``docker info``, an engine's check), a task
    that fills its pipe (64 KiB) waits, as on a slow terminal (``cancel`` carries output
    while it waits).

    An attempt's files are opened once (never through a symlink: a log that is not a
    regular file gets nothing, and then no ``order``) for the task and its ``finish``
    command, and closed when the attempt has ended and its last pipe is closed. Processes a
    task left behind that still write are carried while this agent runs.
    """

    def __init__(self):
        self.logs = {}  # attempt id -> _Logs
        self.pipes = {}  # read fd -> (_Logs, stream index)
        self.poll = select.epoll()

    def fileno(self):
        """The fd that is readable when a pipe has something (for ``select``)."""
        return self.poll.fileno()

    def attach(self, attempt_id, d):
        """Two new pipes for a process of attempt ``attempt_id`` (folder ``d``): returns
        their write ends [stdout, stderr] (the caller closes them once the process has
        them). Raises OSError (no fd left)."""
        logs = self.logs.get(attempt_id)
        if logs is None:
            files, keep = [], True
            try:
                for name in ("stdout", "stderr"):  # never through a task's symlink
                    try:
                        files.append(_open_regular(
                            os.path.join(d, name), os.O_WRONLY | os.O_APPEND | os.O_CREAT))
                    except NotRegular:
                        files.append(os.open(os.devnull, os.O_WRONLY | os.O_CLOEXEC))
                        keep = False
            except OSError:
                for fd in files:
                    os.close(fd)
                raise
            logs = self.logs[attempt_id] = _Logs(attempt_id, d, files, keep)
        ends = []
        try:
            for i in (0, 1):
                r, w = os.pipe()  # (both close-on-exec: the task gets w as its 1 or 2)
                ends.append(w)
                fcntl.fcntl(r, fcntl.F_SETFL, os.O_NONBLOCK)
                self.poll.register(r, select.EPOLLIN)
                self.pipes[r] = (logs, i)
                logs.pipes += 1
                logs.fds.append(r)
        except OSError:
            for fd in ends:
                os.close(fd)
            raise
        return ends

    def carry(self):
        """Move what waits in the pipes to the logs (one read per ready pipe)."""
        for fd, _ in self.poll.poll(0):
            if fd in self.pipes:
                self._carry(fd)

    def drain(self, attempt_id):
        """Carry at once what the attempt's pipes hold (its task ended: all it wrote is
        in them), up to DRAIN_MAX bytes per pipe (processes it left may go on writing)."""
        logs = self.logs.get(attempt_id)
        for fd in list(logs.fds if logs else ()):
            n = 0
            while n < DRAIN_MAX and fd in logs.fds:
                got = self._carry(fd)
                if not got:
                    break
                n += got

    def release(self, attempt_id):
        """The attempt ended: its files are closed once no pipe of it is open."""
        logs = self.logs.get(attempt_id)
        if logs is not None:
            logs.ended = True
            if not logs.pipes:
                self._close(logs)

    def _close(self, logs):
        for fd in logs.files + ([logs.order] if logs.order is not None and logs.order >= 0
                                else []):
            os.close(fd)
        self.logs.pop(logs.id, None)

    def _carry(self, fd):
        """Move one read of pipe ``fd`` to its log: returns the bytes moved, 0 when none
        waited; at its end the pipe is closed."""
        logs, i = self.pipes[fd]
        try:
            data = os.read(fd, LOG_READ)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:  # every writer closed it
            os.close(fd)  # (which takes it out of the epoll set: no other fd refers to it)
            del self.pipes[fd]
            logs.fds.remove(fd)
            logs.pipes -= 1
            if logs.ended and not logs.pipes:
                self._close(logs)
            return 0
        _write_all(logs.files[i], data)
        if logs.order is None:
            return len(data)
        end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
        if not end and 0 <= logs.part[i] and logs.part[i] + len(data) < LINE_MAX:
            logs.part[i] += len(data)
            return len(data)
        try:
            at = os.lseek(logs.files[i], 0, os.SEEK_CUR)  # (appends by others counted)
        except OSError:
            return len(data)
        logs.part[i] = len(data) - end if end else -1  # -1: in a line over LINE_MAX
        if logs.cur is not None and logs.cur != i:  # the other stream's run ends here
            if logs.order == -1:
                try:
                    logs.order = _open_regular(os.path.join(logs.dir, "order"),
                                               os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                except OSError:
                    logs.order = None
                    return len(data)
            _write_all(logs.order, b"%s %d\n" % (ORDER_STREAMS[logs.cur],
                                                  logs.done[logs.cur]))
        logs.cur = i
        logs.done[i] = at - max(0, logs.part[i])
        return len(data)


def _write_all(fd, data):
    """Write all of ``data`` to ``fd``; a full disk or a broken file loses it (the task goes
    on: its output is never what stops it)."""
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:
        pass


class _Sampler:
    """Utilisation of the node and of its running attempts (see the module docstring):
    rates (CPU, network) are the change since the previous sample."""

    def __init__(self, root):
        self.root = root
        self.buf = []
        self.last = 0.0  # unix s of the last sample (0: none yet)
        self.active = False  # the last sample saw running attempts: one more is due after
        self.cpu = None  # (busy ticks, total ticks) of /proc/stat at the last sample
        self.net = None  # (rx bytes, tx bytes, unix s)
        self.tasks = {}  # attempt id -> (cpu ticks of its processes, unix s)
        self.cgroups = {}  # attempt id -> {memory cgroup folder: oom_kill count when first seen}
        self.pids = {}  # attempt id -> pids seen in its session
        self.nvml = None  # the pynvml module once initialised, False when not usable
        self.tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def due(self, every, running, now):
        """True when a sample is to be taken now: ``every`` s passed, and attempts run (or ran
        at the last sample: the last one)."""
        return every > 0 and (running or self.active) and now - self.last >= every

    def sample(self, attempts, now):
        """Take one sample. ``attempts``: {attempt id: (session pid, [GPU index])} of the
        running attempts."""
        node = {}
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:9]]
            busy, total = sum(v) - v[3] - v[4], sum(v)
            if self.cpu and total > self.cpu[1]:
                node["cpu_pct"] = round(100.0 * (busy - self.cpu[0]) / (total - self.cpu[1]), 1)
            self.cpu = (busy, total)
        except (OSError, ValueError, IndexError):
            pass
        try:
            with open("/proc/loadavg") as f:
                node["load1"] = float(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            pass
        try:
            mem = {}
            with open("/proc/meminfo") as f:
                for line in f:
                    k, _, rest = line.partition(":")
                    if k in ("MemTotal", "MemAvailable"):
                        mem[k] = int(rest.split()[0]) * 1024
            node["mem_total"] = mem["MemTotal"]
            node["mem_used"] = mem["MemTotal"] - mem["MemAvailable"]
        except (OSError, ValueError, IndexError, KeyError):
            pass
        try:
            st = os.statvfs(self.root)
            node["disk_free"] = st.f_bavail * st.f_frsize
            node["disk_total"] = st.f_blocks * st.f_frsize
        except OSError:
            pass
        try:
            rx = tx = 0
            with open("/proc/net/dev") as f:
                for line in f.readlines()[2:]:
                    name, _, rest = line.partition(":")
                    if name.strip() != "lo":
                        v = rest.split()
                        rx, tx = rx + int(v[0]), tx + int(v[8])
            if self.net and now > self.net[2]:
                dt = now - self.net[2]
                node["net_rx"] = round(max(0, rx - self.net[0]) / dt, 1)
                node["net_tx"] = round(max(0, tx - self.net[1]) / dt, 1)
            self.net = (rx, tx, now)
        except (OSError, ValueError, IndexError):
            pass
        gpus = self.gpus()
        if gpus is not None:
            node["gpus"] = gpus
        out = {}
        if attempts:
            per = self.processes({pid: aid for aid, (pid, _) in attempts.items() if pid})
            for aid, (pid, held) in attempts.items():
                ticks, rss, pids = per.get(aid, (0, 0, []))
                s = {"rss": rss, "gpus": list(held or [])}
                prev = self.tasks.get(aid)
                if prev and now > prev[1]:
                    s["cpu_pct"] = round(100.0 * max(0, ticks - prev[0]) / self.tick
                                         / (now - prev[1]), 1)
                self.tasks[aid] = (ticks, now)
                self.pids.setdefault(aid, set()).update(pids)
                groups = self.cgroups.setdefault(aid, {})
                for p in pids[:8]:  # the memory cgroups its processes are in
                    for g in _memory_cgroups(p):
                        if g not in groups:
                            groups[g] = _oom_kills(g)
                out[aid] = s
        for aid in list(self.tasks):
            if aid not in attempts:
                self.tasks.pop(aid, None)
        self.buf.append({"ts": round(now, 3), "node": node, "attempts": out})
        del self.buf[:-SAMPLES_MAX]
        self.last = now
        self.active = bool(attempts)

    def processes(self, sessions):
        """{attempt id: (cpu ticks (utime+stime+cutime+cstime), rss bytes, [pid])} summed
        over the processes of each session in ``sessions`` ({session id: attempt id})."""
        out = {}
        try:
            names = os.listdir("/proc")
        except OSError:
            return out
        for name in names:
            if not name.isdigit():
                continue
            try:
                with open("/proc/%s/stat" % name, "rb") as f:
                    raw = f.read()
            except OSError:
                continue
            v = raw[raw.rfind(b")") + 2:].split()
            try:
                aid = sessions.get(int(v[3]))
                if aid is None:
                    continue
                ticks = int(v[11]) + int(v[12]) + int(v[13]) + int(v[14])
                rss = int(v[21]) * self.page
            except (IndexError, ValueError):
                continue
            t, r, pids = out.get(aid, (0, 0, []))
            pids.append(int(name))
            out[aid] = (t + ticks, r + rss, pids)
        return out

    def gpus(self):
        """[{index, util_pct, mem_used_mib, mem_total_mib, temp_c, power_w}] of the node's
        GPUs (pynvml when importable, else nvidia-smi's CSV query); None without GPUs."""
        if self.nvml is None:
            try:
                import pynvml
                pynvml.nvmlInit()
                self.nvml = pynvml
            except Exception:
                self.nvml = False
        if self.nvml:
            try:
                return self._nvml_gpus()
            except Exception:
                self.nvml = False
        if not shutil.which("nvidia-smi"):
            return None
        import subprocess
        try:
            out = subprocess.run(["nvidia-smi", GPU_QUERY, "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=10)
        except Exception:
            return None
        if out.returncode != 0:
            return None
        gpus = []
        keys = ("util_pct", "mem_used_mib", "mem_total_mib", "temp_c", "power_w")
        for line in out.stdout.splitlines():
            f = [x.strip() for x in line.split(",")]
            if not f or not f[0].isdigit():
                continue
            g = {"index": int(f[0])}
            for k, x in zip(keys, f[1:]):
                try:
                    g[k] = float(x)
                except ValueError:  # [N/A], [Not Supported]
                    pass
            gpus.append(g)
        return gpus

    def _nvml_gpus(self):
        nv = self.nvml
        gpus = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            g = {"index": i}
            for k, fn in (("util_pct", lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu),
                          ("mem_used_mib", lambda: nv.nvmlDeviceGetMemoryInfo(h).used / 2**20),
                          ("mem_total_mib",
                           lambda: nv.nvmlDeviceGetMemoryInfo(h).total / 2**20),
                          ("temp_c", lambda: nv.nvmlDeviceGetTemperature(h, 0)),
                          ("power_w", lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0)):
                try:
                    g[k] = float(fn())
                except Exception:
                    pass
            gpus.append(g)
        return gpus

    def take(self):
        """The buffered samples, oldest first; the buffer is emptied."""
        out, self.buf = self.buf, []
        return out

    def oom(self, attempt_id, started, ended):
        """Why an attempt killed by SIGKILL was killed by the OOM killer (text), or None."""
        for g, before in sorted(self.cgroups.get(attempt_id, {}).items()):
            after = _oom_kills(g)
            if before is not None and after is not None and after > before:
                return ("killed by the kernel's OOM killer (memory cgroup %s: %d OOM kill%s "
                        "while it ran)" % (g, after - before, "" if after - before == 1 else "s"))
        pids = self.pids.get(attempt_id)
        if pids:  # kernel log records since the attempt started (monotonic clock)
            line = _kmsg_oom(pids, time.monotonic() - (time.time() - started) - 1.0)
            if line:
                return "killed by the kernel's OOM killer (kernel log: %s)" % line
        return None

    def forget(self, attempt_id):
        for d in (self.tasks, self.cgroups, self.pids):
            d.pop(attempt_id, None)


def _environ_gpus(pid):
    """The GPU indexes of a task from its ``HYPER_GPUS`` (``/proc/<pid>/environ``), or []."""
    try:
        with open("/proc/%d/environ" % pid, "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"HYPER_GPUS="):
                    return [int(x) for x in kv[11:].split(b",") if x.strip().isdigit()]
    except OSError:
        pass
    return []


def _memory_cgroups(pid):
    """The memory cgroup folders (under /sys/fs/cgroup) process ``pid`` is in."""
    out = []
    try:
        with open("/proc/%d/cgroup" % pid) as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":  # cgroup v2
            d = "/sys/fs/cgroup" + parts[2].rstrip("/")
            if os.path.exists(d + "/memory.events"):
                out.append(d)
        elif "memory" in parts[1].split(","):  # cgroup v1
            out.append("/sys/fs/cgroup/memory" + parts[2].rstrip("/"))
    return out


def _oom_kills(folder):
    """The ``oom_kill`` counter of a memory cgroup folder, or None."""
    for name in ("memory.events", "memory.oom_control"):
        try:
            with open(os.path.join(folder, name)) as f:
                for line in f:
                    k, _, v = line.partition(" ")
                    if k == "oom_kill":
                        return int(v)
        except (OSError, ValueError):
            continue
    return None


def _kmsg_oom(pids, since=None):
    """The kernel log line of an OOM kill of one of ``pids``, or None (/dev/kmsg, read
    without blocking; needs CAP_SYSLOG). ``since``: only records logged after this
    ``time.monotonic()`` value (s; a pid reused since an older kill does not match)."""
    try:
        fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return None
    found = None
    try:
        while True:
            try:
                rec = os.read(fd, 8192)
            except BlockingIOError:
                break
            except OSError:  # EPIPE: records overwritten while reading; go on
                continue
            if not rec:
                break
            head, _, text = rec.decode(errors="replace").partition(";")
            text = text.strip()
            if since is not None:
                try:  # "priority,sequence,microseconds since boot,flags;message"
                    if int(head.split(",")[2]) / 1e6 < since:
                        continue
                except (IndexError, ValueError):
                    pass
            if "Killed process" in text or "oom-kill:" in text:
                for pid in pids:
                    if ("Killed process %d " % pid) in text or (",pid=%d," % pid) in text:
                        found = text[:200]
    finally:
        os.close(fd)
    return found


def _detach_from_caller():
    """Fork: the original process (the one the SSH session or the local provider started)
    waits until this agent's connection ends, then exits, so the session can end while the
    forked process, in a session of its own, goes on supervising its tasks. Returns the fd
    whose closing lets the original process go (None when forking is not possible)."""
    r, w = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid:  # the original process: wait for the connection's end (or the agent's death)
        os.close(w)
        try:
            while os.read(r, 1):
                pass
        finally:
            os._exit(0)
    os.close(r)
    os.setsid()
    return w


#: how the agent opens what it reads back from an attempt folder: never through a symlink,
#: never waiting on a FIFO (a task on the node itself can put either in a file's place)
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


class NotRegular(OSError):
    """A file the agent reads back is not a regular file (a symlink, a FIFO, a device...)."""

    def __str__(self):
        return self.strerror or OSError.__str__(self)


def _open_regular(path, flags=_READ, mode=0o644):
    """An fd of the regular file at ``path``, opened without following a symlink and
    without blocking (``O_NONBLOCK`` is cleared once it is known to be a regular file).
    Raises FileNotFoundError, NotRegular (naming what it is instead), OSError."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as e:
        if e.errno == 40:  # ELOOP: the last part is a symlink
            raise NotRegular(e.errno, "%s is a symlink, not a regular file: not followed"
                             % path) from None
        if e.errno == 6:  # ENXIO: a FIFO opened for writing with no reader
            raise NotRegular(e.errno, "%s is a FIFO, not a regular file" % path) from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        kind = ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a folder" if stat.S_ISDIR(
            st.st_mode) else "a device or socket")
        raise NotRegular(22, "%s is %s, not a regular file: not read" % (path, kind))
    os.set_blocking(fd, True)
    return fd


def _proc_start(pid):
    """The start time of process ``pid`` (clock ticks since boot, proc(5) field 22) and its
    session id (field 6), or None when there is no such process."""
    try:
        with open("/proc/%d/stat" % pid, "rb") as f:
            v = f.read().rsplit(b")", 1)[1].split()
        return int(v[19]), int(v[3])
    except (OSError, IndexError, ValueError):
        return None


def _locked(path):
    """True when another process holds the flock on path."""
    try:
        fd = _open_regular(path)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _note(d, text):
    """Append hypercli's own line about an attempt to its stderr (only when that is still a
    regular file: never through a symlink a task put there)."""
    try:
        fd = _open_regular(os.path.join(d, "stderr"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    except OSError:
        return
    try:
        os.write(fd, ("hyper: %s\n" % text).encode())
    finally:
        os.close(fd)


def _iface_of(address):
    """The name of the network interface whose IPv4 address is ``address`` (``eth0``), or
    None (ioctl SIOCGIFADDR per interface, netdevice(7))."""
    import socket
    import struct
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    finally:
        s.close()
    return None


def _gpus():
    """The node's GPUs as ``[{"index", "name", "memory_mib", "uuid"}]``, from ``nvidia-smi``'s
    CSV query (nvidia-smi(1), "--query-gpu"); [] without the tool or when it fails."""
    if not shutil.which("nvidia-smi"):
        return []
    import subprocess
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name,memory.total,uuid",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=20)
    except Exception:
        return []
    if out.returncode != 0:
        return []
    gpus = []
    for line in out.stdout.splitlines():
        f = [x.strip() for x in line.split(",")]
        if len(f) < 4 or not f[0].isdigit():
            continue
        try:
            memory = int(float(f[2]))
        except ValueError:
            memory = None
        gpus.append({"index": int(f[0]), "name": f[1], "memory_mib": memory, "uuid": f[3]})
    return gpus


def _b64(data):
    return binascii.b2a_base64(data, newline=False).decode()


def _read_json(path):
    """The JSON of the regular file at ``path`` (:func:`_open_regular`), or None."""
    try:
        fd = _open_regular(path)
    except OSError:
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            return json.loads(f.read(1 << 20))
    except (OSError, ValueError):
        return None


def _write_json(path, obj):
    tmp = path + ".tmp"
    try:
        os.unlink(tmp)  # whatever is there (a symlink is removed, not followed)
    except FileNotFoundError:
        pass
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                 0o644)
    with os.fdopen(fd, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one


_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
ATTEMPT_OUTPUT = ".attempt-"  #: prefix of an attempt's fresh output folder in the outputs root


def _outputs_root(output):
    """An fd of the outputs root, the folder of the task's output folder ``output`` (made
    when missing, its own parents as any folder), opened without following a symlink.
    Raises NotRegular: the outputs root is a symlink (refused: a task could have put it
    there to make outputs land in a host folder); OSError."""
    root = os.path.dirname(os.path.abspath(output))
    try:
        os.makedirs(root, exist_ok=True)
    except FileExistsError:
        pass
    try:
        return os.open(root, _DIR)
    except OSError as e:
        if e.errno in (40, 20):  # ELOOP, ENOTDIR
            raise NotRegular(e.errno, "the outputs folder %s is a symlink or not a folder: "
                                      "refused" % root) from None
        raise


def _fresh_output(output, attempt_id):
    """Make the attempt's own new output folder beside the task's output folder ``output``
    (``<outputs root>/.attempt-<attempt id>``, mode 0o755) and return its path: every
    attempt writes a fresh folder, which :func:`_promote` makes the task's output only when
    the attempt wins. Raises NotRegular, OSError (a folder of that name is there already)."""
    fd = _outputs_root(output)
    try:
        name = ATTEMPT_OUTPUT + attempt_id
        os.mkdir(name, 0o755, dir_fd=fd)
        return os.path.join(os.path.dirname(os.path.abspath(output)), name)
    finally:
        os.close(fd)


def attempt_of(attempt_id):
    """The attempt a rank belongs to: ``attempt_id`` (``<workflow>.<task>.<n>[-<token>]``,
    ``-r<rank>`` appended for a rank of a multi-node task, hypercli/scheduler.py) without
    its rank, the same for every rank of one attempt and different for every attempt."""
    head, sep, rank = attempt_id.rpartition("-r")
    return head if sep and rank.isdigit() else attempt_id


def later_attempt(owner, than):
    """Whether attempt ``owner`` (:func:`attempt_of`) is a later attempt than ``than``, by
    the attempt number ``<n>`` in ``...<task>.<n>[-<token>]``; True when either has none."""
    def number(a):
        n = a.rsplit(".", 1)[-1].split("-", 1)[0]
        return int(n) if n.isdigit() else None
    a, b = number(owner), number(than)
    return a is None or b is None or a > b


def _owner_file(owners, output):
    """The file in folder ``owners`` naming the attempt whose files the output folder
    ``output`` holds: ``<sha256 of its absolute path, 32 hex>``."""
    import hashlib
    key = hashlib.sha256(os.path.abspath(output).encode()).hexdigest()[:32]
    return os.path.join(owners, key)


def output_owner(owners, output):
    """The attempt (:func:`attempt_of`) whose files the task's output folder ``output``
    holds, as written by :func:`own_output` in ``owners`` (a folder of hypercli's own,
    which a task in a container cannot write), read without following a symlink or
    waiting; None when none is written or it is not a regular file."""
    try:
        f = os.open(_owner_file(owners, output), _READ)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(f).st_mode):
            return None
        line = os.read(f, 65536).decode("utf-8", "replace").split("\n")[0].strip()
        return line or None
    finally:
        os.close(f)


def own_output(owners, output, owner):
    """Write in folder ``owners`` (made 0o700 when missing) that the output folder
    ``output`` holds attempt ``owner``'s files: a new file renamed over the old one (a
    symlink in its place is replaced, never followed). Raises OSError."""
    os.makedirs(owners, 0o700, exist_ok=True)
    path = _owner_file(owners, output)
    tmp = "%s.%d.tmp" % (path, os.getpid())
    try:
        os.unlink(tmp)
    except FileNotFoundError:
        pass
    f = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644)
    try:
        os.write(f, ("%s\n%s\n" % (owner, os.path.abspath(output))).encode())
    finally:
        os.close(f)
    os.replace(tmp, path)


def disown_output(owners, output):
    """Remove the task's output folder ``output`` (made by hypercli, :func:`_remove_made`)
    and what ``owners`` says of it; nothing when they are gone."""
    _remove_made(os.path.abspath(output))
    try:
        os.unlink(_owner_file(owners, output))
    except OSError:
        pass


def _promote(fresh, output, owner, owners):
    """Make the winning attempt's folder ``fresh`` the task's output ``output``, both in the
    outputs root, never following a symlink. ``owner`` (:func:`attempt_of` of the rank) is
    written in folder ``owners`` as the attempt the output is from (:func:`own_output`).
    When nothing is there, ``fresh`` is renamed into place; when the output holds another
    rank of the same attempt, each entry is moved into it unless one of that name is there
    (the first kept); when it holds an earlier attempt's files (that attempt's rank exited 0
    but its gang, or the attempt, did not win), that folder, made by hypercli, is replaced
    whole; when it holds a later attempt's, it is left as it is (``fresh`` is not moved). An output ``owners`` says nothing of is not known to be hypercli's: merged into,
    never removed. Returns True when renamed. Raises NotRegular: ``output`` is a symlink or
    not a folder (put there by something else: the output is not kept), OSError."""
    fd = _outputs_root(output)
    src, dst = os.path.basename(fresh), os.path.basename(os.path.abspath(output))
    try:
        try:
            st = os.stat(src, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            raise NotRegular(2, "%s, the attempt's output folder, is gone" % fresh) from None
        if not stat.S_ISDIR(st.st_mode):
            raise NotRegular(20, "%s, the attempt's output folder, was replaced by %s" % (
                fresh, "a symlink" if stat.S_ISLNK(st.st_mode) else "a file"))
        try:
            st = os.stat(dst, dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            own_output(owners, output, owner)
            os.rename(src, dst, src_dir_fd=fd, dst_dir_fd=fd)
            return True
        if not stat.S_ISDIR(st.st_mode):
            raise NotRegular(20, "%s is %s that hypercli did not make: not replaced" % (
                output, "a symlink" if stat.S_ISLNK(st.st_mode) else "not a folder"))
        was = output_owner(owners, output)
        if was is not None and was != owner and not later_attempt(owner, was):
            return False  # a later attempt's output is there: this success changes nothing
        if was is not None and was != owner:  # an earlier attempt's: replaced whole
            old = ".replaced-" + src
            os.rename(dst, old, src_dir_fd=fd, dst_dir_fd=fd)
            own_output(owners, output, owner)
            os.rename(src, dst, src_dir_fd=fd, dst_dir_fd=fd)
            shutil.rmtree(old, dir_fd=fd, ignore_errors=True)  # never follows a symlink
            return True
        a, b = os.open(src, _DIR, dir_fd=fd), os.open(dst, _DIR, dir_fd=fd)
        try:
            for name in os.listdir(a):
                try:
                    os.stat(name, dir_fd=b, follow_symlinks=False)
                except FileNotFoundError:
                    os.rename(name, name, src_dir_fd=a, dst_dir_fd=b)
        finally:
            os.close(a)
            os.close(b)
        return False
    finally:
        os.close(fd)


def _remove_made(path):
    """Remove a folder the agent made (an attempt's output folder), symlinks inside removed,
    never followed (``shutil.rmtree`` on file descriptors); a symlink a task put in its
    place is removed itself (its target is left); nothing when it is gone."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            shutil.rmtree(path, ignore_errors=True)
        else:
            os.unlink(path)
    except OSError:
        pass


def _command(d, spec, env, hide=(), podman=False):
    """argv of the task: the script under bash/sh, or inside ``docker run`` for an image.

    A container sees, at the same paths as outside (so every ``HYPER_*`` path means the same
    inside and out): the script and the ``files`` read-only, the metrics file (one file,
    bound), the outputs root read-only with the attempt's own output folder read-write in
    it, the working folder, the checkpoint folder and the recipe's mounts (``binds``). The
    attempt folder itself (pid, exit, logs) is not bound: the task cannot write it, and each
    folder of ``hide`` (the agent's root, ``$HYPER_HOME`` on this machine) that lies in a
    bound folder (a working folder holding it) is covered by an empty tmpfs (the runtime
    mounts the deeper binds over it). ``env``
    names are passed with ``-e NAME`` (values come from the environment, never the command
    line); the image comes after ``--``, so it can never be read as an option;
    ``secrets`` come on the container's stdin (SECRETS_PROLOGUE).
    """
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    script = os.path.join(d, "script.sh")
    engine = spec.get("engine_path")
    if not spec.get("image"):
        return ([sys.executable, "-I", "-S", engine] if engine else []) + [shell, script]
    docker = shutil.which("docker") or "docker"
    argv = [docker, "run", "--rm", "--name", "hyper-" + spec["id"]]
    ro = [script] + [env[var] for var in sorted(spec.get("files") or {})]
    if engine:
        ro.append(engine)
    if spec.get("outputs") and os.path.isdir(spec["outputs"]):
        ro.append(spec["outputs"])
    binds = dict(spec.get("binds") or {})
    binds[env["HYPER_METRICS"]] = env["HYPER_METRICS"]
    for path in (spec.get("attempt_output"), spec.get("cwd")):
        if path and os.path.isdir(path):
            binds.setdefault(path, path)
    for path in sorted(ro):
        argv += ["-v", "%s:%s:ro" % (path, path)]
    for host_path, path in sorted(binds.items()):
        argv += ["-v", "%s:%s" % (host_path, path)]
    bound = [p.rstrip("/") + "/" for p in list(ro) + list(binds)]
    for folder in sorted(set(hide)):
        if any((folder.rstrip("/") + "/").startswith(b) for b in bound):
            argv += ["--tmpfs", folder + (":rw,notmpcopyup,mode=0700" if podman else
                                          ":rw,mode=0700")]
    if spec.get("cwd"):
        argv += ["-w", spec["cwd"]]
    gpus = spec.get("gpus")
    if isinstance(gpus, list):  # the attempt's own GPUs only (docker run --gpus, device=...)
        if gpus:
            argv += ["--gpus", '"device=%s"' % ",".join(str(g) for g in gpus)]
    elif gpus:
        argv += ["--gpus", "all"]
    limits = spec.get("limits") or {}
    if limits.get("cpus"):
        argv += ["--cpus", "%g" % limits["cpus"]]
    if limits.get("memory"):
        argv += ["--memory", "%d" % limits["memory"]]
    names = sorted(spec.get("env") or {}) + ["HYPER_METRICS"] + sorted(spec.get("files") or {})
    if engine:
        names += ["HYPER_ENGINE", "HYPER_ENGINE_ATTEMPT", "HYPER_ENGINE_DIR"]
    if spec.get("attempt_output"):
        names.append("HYPER_OUTPUT")
    for k in dict.fromkeys(names):
        argv += ["-e", k]
    if spec.get("secrets"):  # read from stdin inside the container (SECRETS_PROLOGUE)
        argv += ["-i", "--", spec["image"], "sh", "-c", SECRETS_PROLOGUE, "hyper-secrets"]
    else:
        argv += ["--", spec["image"]]
    return argv + (["python3", engine] if engine else []) + ["sh", script]


def main(argv):
    if len(argv) >= 2 and argv[1] == "serve":
        root = argv[argv.index("--root") + 1] if "--root" in argv else "~/.hyper"
        Agent(root).serve()
        return 0
    sys.stderr.write("usage: agent.py serve [--root DIR]\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
