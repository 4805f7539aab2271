#!/usr/bin/env python3
"""hypercli node agent: the node side of the task protocol, one file, standard library only.

It runs on every node (this machine for the local provider; over SSH on hosts and cloud VMs,
copied there by hypercli) as ``python3 agent.py serve --root ROOT`` and answers JSON requests,
one per line on stdin, with one JSON response per line on stdout. It keeps no state of its own:
everything lives in the attempt folders, so a new agent (after the CLI or the connection died)
sees exactly what the old one saw.

Attempt folder ``ROOT/tasks/<attempt id>/``::

    script.sh      the task's command (run with bash when present, else sh; ``set -e``)
    spec.json      the launch request (env, cwd, image, finish: a command run after a successful
                   task, e.g. pushing its outputs to object storage)
    pid            JSON {"pid": <command pid = its process group>, "started": <unix s>}
    stdout,stderr  the command's output
    metrics.jsonl  JSON objects, one per line, written by the task through $HYPER_METRICS
    lock           flock()ed by the supervisor for as long as it lives
    exit           JSON {"code": <int>, "ended": <unix s>}, written atomically (rename) at the end
    cancelled      present when the attempt was cancelled

A task is started by a supervisor process forked by the agent into a session of its own, so it
belongs to no terminal, no SSH session and no CLI: it survives all three (the agent reaps it
when it ends; if the agent goes first, init adopts it). The supervisor holds ``lock`` while it lives, so
"supervisor dead and no ``exit``" (the attempt is *lost*) is told apart from "still running"
without trusting pids, which the kernel reuses.

Requests (``{"id": N, "op": OP, ...}``) and responses (``{"id": N, "ok": true, ...}`` or
``{"id": N, "ok": false, "error": TEXT}``):

    hello                         → version, hostname, cpus, memory_bytes, disk_free_bytes, gpus,
                                    docker (container runtime path or null)
    launch  attempts: [spec]      → states: {id: state}   (idempotent per attempt id)
    poll    ids: [id], wait: s    → states: {id: state}; with wait > 0 returns as soon as one of
                                    the ids is no longer running, a request or a ``wake``
                                    arrives, or ``wait`` seconds pass
    cancel  ids: [id], grace: s   → states: {id: state}  (SIGTERM to the process group, then
                                    SIGKILL after ``grace`` seconds)
    read    id, stream, offset, limit → data (base64), offset, size, done
    wake                          → no response; cuts short the current or next ``poll`` wait

Answers to ``launch``, ``poll`` and ``cancel`` carry ``preempted`` (the JSON of
``ROOT/preempted``) once the node watcher (``watch.py``) has seen the cloud's preemption
notice. Every request touches ``ROOT/contact`` (at most every 10 s): the watcher's idle
watchdog counts it as use.

A state is ``{"state": "running"|"exited"|"lost"|"unknown", "code": int?, "started": s?,
"ended": s?, "cancelled": bool, "metrics": {...}?, "inline": {...}?}``; metrics (the last
value of each key over all lines of metrics.jsonl) come with every state that is not running.
``launch``, ``poll`` and ``cancel`` take an optional ``inline: N`` (bytes): every state that
is not running then also carries ``inline = {"stdout": b64?, "stderr": b64?, "output_empty":
bool}``, the logs included when both together are at most N bytes, so a client over a
network brings back an ended attempt's logs in the answer it already waits for instead of a
second round trip (``output_empty``: the attempt's output folder holds nothing to copy).
"""

import base64
import fcntl
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import time

VERSION = 1
POLL_TICK = 0.005  # s between exit-file checks inside a poll wait
FULL_EVERY = 0.25  # s between full state looks (lock, pid) inside a poll wait
METRICS_MAX = 4 << 20  # bytes of metrics.jsonl read at most (the last 4 MiB)
CONTACT_EVERY = 10.0  # s between touches of ROOT/contact (read by the node watcher)


class Agent:
    """Serves requests for the attempt folders under ``root``."""

    def __init__(self, root):
        self.root = os.path.abspath(os.path.expanduser(root))
        self.tasks = os.path.join(self.root, "tasks")
        os.makedirs(self.tasks, exist_ok=True)
        self.inbuf = b""
        self.woken = False
        self.supervisors = set()  # pids of supervisors forked here and not yet reaped
        self.contact = 0.0  # unix s of the last touch of ROOT/contact

    # -- input -------------------------------------------------------------------------
    def _fill(self, timeout):
        """Read what stdin has within timeout; False at EOF."""
        r, _, _ = select.select([0], [], [], timeout)
        if not r:
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
        out = sys.stdout.buffer
        while True:
            while not self._pending_request():
                if not self._fill(None):
                    return
            line, self.inbuf = self.inbuf.split(b"\n", 1)
            req = {}
            try:
                req = json.loads(line)
                resp = self.handle(req)
            except Exception as e:  # a bad request must not kill the agent
                resp = {"ok": False, "error": "%s: %s" % (type(e).__name__, e)}
            resp["id"] = req.get("id") if isinstance(req, dict) else None
            out.write(json.dumps(resp, separators=(",", ":")).encode() + b"\n")
            out.flush()

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
        result = fn(req)
        if op in ("launch", "poll", "cancel"):
            marker = _read_json(os.path.join(self.root, "preempted"))
            if marker is not None:
                result["preempted"] = marker
        result["ok"] = True
        return result

    # -- ops ---------------------------------------------------------------------------
    def op_hello(self, req):
        st = os.statvfs(self.root)
        mem = 0
        try:
            with open("/proc/meminfo") as f:
                mem = int(f.readline().split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        gpus = []
        if shutil.which("nvidia-smi"):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total",
                                      "--format=csv,noheader"], capture_output=True, text=True,
                                     timeout=20).stdout
                gpus = [g.strip() for g in out.splitlines() if g.strip()]
            except Exception:
                gpus = []
        return {"version": VERSION, "hostname": socket.gethostname(),
                "cpus": os.cpu_count() or 1, "memory_bytes": mem,
                "disk_free_bytes": st.f_bavail * st.f_frsize, "gpus": gpus,
                "docker": shutil.which("docker"), "python": sys.version.split()[0],
                "root": self.root}

    def op_launch(self, req):
        return self._inline(req, {a["id"]: self.launch(a) for a in req.get("attempts", [])})

    def _inline(self, req, states):
        """The ``{"states": ...}`` answer, with ``inline`` added when the request asks."""
        limit = int(req.get("inline", 0) or 0)
        if limit > 0:
            for i, s in states.items():
                if s["state"] not in ("running", "unknown"):
                    s["inline"] = self.inline(i, limit)
        return {"states": states}

    def inline(self, attempt_id, limit):
        """``{"stdout": b64, "stderr": b64, "output_empty": bool}`` of an ended attempt; the
        logs are left out when together they exceed ``limit`` bytes (the client reads them)."""
        d = self.dir(attempt_id)
        out = {}
        sizes = {}
        for name in ("stdout", "stderr"):
            try:
                sizes[name] = os.path.getsize(os.path.join(d, name))
            except OSError:
                sizes[name] = 0
        if sum(sizes.values()) <= limit:
            for name in ("stdout", "stderr"):
                try:
                    with open(os.path.join(d, name), "rb") as f:
                        out[name] = base64.b64encode(f.read(limit + 1)).decode()
                except FileNotFoundError:
                    out[name] = ""
        output = (_read_json(os.path.join(d, "spec.json")) or {}).get("output")
        try:
            with os.scandir(output) as it:
                out["output_empty"] = next(it, None) is None
        except (OSError, TypeError):
            out["output_empty"] = True
        return out

    def op_poll(self, req):
        self._reap()
        ids = req.get("ids", [])
        deadline = time.time() + float(req.get("wait", 0) or 0)
        states = {i: self.state(i, with_metrics=False) for i in ids}
        last_full = time.time()
        while (all(s["state"] == "running" for s in states.values()) and ids
               and not self.woken and time.time() < deadline):
            if not self._fill(min(POLL_TICK, max(0.0, deadline - time.time()))):
                break
            if self._pending_request() or self.woken:
                break
            # between full looks (every FULL_EVERY s, to see supervisors that died), an
            # ``exit`` file appearing is all that can change
            if time.time() - last_full >= FULL_EVERY or any(
                    os.path.exists(os.path.join(self.tasks, i, "exit")) for i in ids):
                states = {i: self.state(i, with_metrics=False) for i in ids}
                last_full = time.time()
        self.woken = False
        for i, s in states.items():
            if s["state"] != "running":
                s["metrics"] = self.metrics(i)
        return self._inline(req, states)

    def op_cancel(self, req):
        grace = float(req.get("grace", 5))
        ids = req.get("ids", [])
        stops = []
        for i in ids:
            d = self.dir(i)
            if os.path.isdir(d) and not os.path.exists(os.path.join(d, "exit")):
                open(os.path.join(d, "cancelled"), "w").close()
                self._signal(i, signal.SIGTERM)
                if (_read_json(os.path.join(d, "spec.json")) or {}).get("image"):
                    # the container's init ignores the docker CLI's signals: stop it by name
                    stops.append(subprocess.Popen(
                        [shutil.which("docker") or "docker", "stop", "-t", str(int(grace)),
                         "hyper-" + i], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for p in stops:
            try:
                p.wait(timeout=grace + 30)
            except subprocess.TimeoutExpired:
                p.kill()
        deadline = time.time() + grace
        while time.time() < deadline and any(
                self.state(i, with_metrics=False)["state"] == "running" for i in ids):
            time.sleep(0.02)
        for i in ids:
            if self.state(i, with_metrics=False)["state"] == "running":
                self._signal(i, signal.SIGKILL)
        time.sleep(0.05)
        return self._inline(req, {i: self.state(i) for i in ids})

    def op_read(self, req):
        name = req.get("stream", "stdout")
        if name not in ("stdout", "stderr", "metrics.jsonl"):
            raise ValueError("stream must be stdout, stderr or metrics.jsonl")
        path = os.path.join(self.dir(req["id"]), name)
        offset, limit = int(req.get("offset", 0)), int(req.get("limit", 1 << 20))
        state = self.state(req["id"], with_metrics=False)["state"]
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(offset)
                data = f.read(limit)
        except FileNotFoundError:
            size, data = 0, b""
        return {"data": base64.b64encode(data).decode(), "offset": offset + len(data),
                "size": size, "done": state != "running" and offset + len(data) >= size,
                "state": state}

    # -- attempts ----------------------------------------------------------------------
    def dir(self, attempt_id):
        if not attempt_id or "/" in attempt_id or attempt_id.startswith("."):
            raise ValueError("bad attempt id %r" % (attempt_id,))
        return os.path.join(self.tasks, attempt_id)

    def state(self, attempt_id, with_metrics=True):
        d = self.dir(attempt_id)
        # the lock is looked at BEFORE the exit file: the supervisor writes ``exit`` and only
        # then releases the lock, so "no exit, lock free" seen in this order means it died
        locked = _locked(os.path.join(d, "lock"))
        s = {"state": "unknown", "cancelled": os.path.exists(os.path.join(d, "cancelled"))}
        pid = _read_json(os.path.join(d, "pid"))
        if pid:
            s["started"] = pid.get("started")
        ex = _read_json(os.path.join(d, "exit"))
        if ex is not None:
            s.update(state="exited", code=ex.get("code"), ended=ex.get("ended"))
        elif not os.path.isdir(d):
            return s
        elif locked:
            s["state"] = "running"
        else:
            s["state"] = "lost"
            self._signal(attempt_id, signal.SIGKILL)  # orphans of a dead supervisor
        if with_metrics and s["state"] != "running":
            s["metrics"] = self.metrics(attempt_id)
        return s

    def metrics(self, attempt_id):
        path = os.path.join(self.dir(attempt_id), "metrics.jsonl")
        out = {}
        try:
            with open(path, "rb") as f:
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

    def _reap(self):
        """Collect the exit status of supervisors that ended (no zombies pile up)."""
        for pid in list(self.supervisors):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                done = pid
            if done:
                self.supervisors.discard(pid)

    def _signal(self, attempt_id, sig):
        pid = _read_json(os.path.join(self.dir(attempt_id), "pid"))
        if pid and pid.get("pid"):
            try:
                os.killpg(int(pid["pid"]), sig)
            except (ProcessLookupError, PermissionError):
                pass

    def launch(self, spec):
        d = self.dir(spec["id"])
        try:
            os.mkdir(d)
        except FileExistsError:
            return self.state(spec["id"])  # launched before: idempotent
        with open(os.path.join(d, "script.sh"), "w") as f:
            f.write("set -e\n" + spec["script"] + "\n")
        _write_json(os.path.join(d, "spec.json"), spec)
        open(os.path.join(d, "metrics.jsonl"), "ab").close()
        ready_r, ready_w = os.pipe()
        self._reap()
        pid = os.fork()
        if pid == 0:  # the supervisor: a session of its own (no terminal, no SSH session)
            try:
                os.close(ready_r)
                os.setsid()
                _supervise(d, spec, ready_w)
            finally:
                os._exit(0)
        # one fork, not the classic two (a Python fork costs ~0.8 ms of CPU): the supervisor
        # stays this agent's child until it ends and is reaped here, or until this agent
        # exits and init adopts it; either way it outlives the agent
        self.supervisors.add(pid)
        os.close(ready_w)
        # the supervisor writes one byte once it holds the lock: from now on "lock free and
        # no exit file" can only mean it died
        r, _, _ = select.select([ready_r], [], [], 30)
        ok = bool(r) and os.read(ready_r, 1) == b"1"
        os.close(ready_r)
        if not ok:
            return self.state(spec["id"])
        return {"state": "running", "cancelled": False}


def _locked(path):
    """True when another process holds the flock on path."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _open_fds():
    try:
        return [int(x) for x in os.listdir("/proc/self/fd")]
    except OSError:
        return list(range(3, 1024))


def _read_json(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _write_json(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # atomic: a reader sees the old file or the whole new one


def _command(d, spec, env):
    """argv of the task: the script under bash/sh, or inside ``docker run`` for an image.

    In a container the attempt folder, the output folder and the working folder are bound at
    the same paths, so every ``HYPER_*`` path means the same inside and out; ``env`` names are
    passed with ``-e NAME`` (values come from the environment, never the command line).
    """
    shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
    script = os.path.join(d, "script.sh")
    if not spec.get("image"):
        return [shell, script]
    docker = shutil.which("docker") or "docker"
    argv = [docker, "run", "--rm", "--name", "hyper-" + spec["id"], "-v", "%s:%s" % (d, d)]
    binds = dict(spec.get("binds") or {})
    for path in (spec.get("output"), spec.get("outputs"), spec.get("cwd")):
        if path and os.path.isdir(path):
            binds.setdefault(path, path)
    for host_path, path in sorted(binds.items()):
        argv += ["-v", "%s:%s" % (host_path, path)]
    if spec.get("cwd"):
        argv += ["-w", spec["cwd"]]
    if spec.get("gpus"):
        argv += ["--gpus", "all"]
    for k in sorted(spec.get("env") or {}) + ["HYPER_METRICS"]:
        argv += ["-e", k]
    return argv + [spec["image"], "sh", script]


def _supervise(d, spec, ready):
    """Body of the detached supervisor: take the lock, tell the agent (one byte on ``ready``),
    run the command, record its pid, then its exit code atomically."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    lock = os.open(os.path.join(d, "lock"), os.O_CREAT | os.O_RDWR, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.write(ready, b"1")
    os.close(ready)
    for fd in _open_fds():
        if fd > 2 and fd != lock:
            try:
                os.close(fd)
            except OSError:
                pass
    env = dict(os.environ)
    env.update(spec.get("env") or {})
    env["HYPER_METRICS"] = os.path.join(d, "metrics.jsonl")
    cwd = spec.get("cwd") if not spec.get("image") else None
    code = 127
    try:
        if spec.get("output"):
            os.makedirs(spec["output"], exist_ok=True)
        with open(os.path.join(d, "stdout"), "ab") as out, \
                open(os.path.join(d, "stderr"), "ab") as err:
            proc = subprocess.Popen(_command(d, spec, env), cwd=cwd or None, env=env, stdout=out,
                                    stderr=err, stdin=subprocess.DEVNULL,
                                    start_new_session=True)  # its own group, for killpg
        _write_json(os.path.join(d, "pid"), {"pid": proc.pid, "started": time.time()})
        while True:
            try:
                rc = proc.wait()
                break
            except InterruptedError:
                continue
        code = rc if rc >= 0 else 128 - rc
        if code == 0 and spec.get("finish") and not os.path.exists(os.path.join(d, "cancelled")):
            code = _finish(d, spec, env)
    except Exception as e:
        with open(os.path.join(d, "stderr"), "a") as f:
            f.write("hyper: cannot start the task: %s\n" % e)
        if not os.path.exists(os.path.join(d, "pid")):
            _write_json(os.path.join(d, "pid"), {"pid": None, "started": time.time()})
    _write_json(os.path.join(d, "exit"), {"code": code, "ended": time.time()})
    os._exit(0)


def _finish(d, spec, env):
    """Run the attempt's ``finish`` command (e.g. push HYPER_OUTPUT to object storage) after a
    successful task; its failure fails the attempt (exit code 70, reason in stderr)."""
    with open(os.path.join(d, "stdout"), "ab") as out, \
            open(os.path.join(d, "stderr"), "ab") as err:
        rc = subprocess.call(["/bin/sh", "-c", spec["finish"]], env=env, stdout=out, stderr=err,
                             stdin=subprocess.DEVNULL)
    if rc == 0:
        return 0
    with open(os.path.join(d, "stderr"), "a") as f:
        f.write("hyper: the task succeeded but saving its outputs failed (exit %d)\n" % rc)
    return 70


def main(argv):
    if len(argv) >= 2 and argv[1] == "serve":
        root = argv[argv.index("--root") + 1] if "--root" in argv else "~/.hyper"
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        Agent(root).serve()
        return 0
    sys.stderr.write("usage: agent.py serve [--root DIR]\n")
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
