#!/usr/bin/env python3
"""hypercli engine wrapper: a Spark or Ray cluster across a gang's ranks, around the task's
command. One file, standard library only.

The node agent writes this file into the folder of each rank of an ``engine:`` attempt and
runs ``python3 engine.py ARGV...`` in place of the task's command (``ARGV``: the shell and the
task's script). hypercli never installs the engine: it comes from the node (its image or the
task's container), found as below.

Every rank starts a worker; rank 0 first starts the master (Spark standalone master, or Ray's
head), waits until every rank's worker has joined, runs the command with the address set,
then stops the engine and exits with the command's exit code. A rank other than 0 runs its
worker until the master's port has been closed for CLOSED_AFTER s (rank 0 is done), then
stops it and exits 0; a worker that dies on its own ends the rank with its exit code.

Rules:
  * The engine's processes belong to the attempt: each carries ``HYPER_ENGINE_ID`` (the
    attempt id) in its environment, and at the end (the command's end, SIGTERM from a
    cancel, a gang stopped by a lost rank) every process of this node that carries it is
    stopped by its PID: SIGTERM, then SIGKILL after STOP_GRACE s. The agent does the same
    after the rank has ended, so a wrapper killed outright leaves nothing either.
  * Engine logs go to the rank's own stderr (``hyper logs TASK --rank R``): Spark's daemons
    log there, and Ray's with ``RAY_LOG_TO_STDERR=1``; Spark executors' logs are in the
    rank's folder under ``spark-work/``.
  * Everything listens on the rank's private address (``HYPER_NODE_IP``), web UIs included.
  * An engine that is not there: exit MISSING (3) with what is missing on stderr. The agent
    checks the same before starting a rank on the node itself (see :func:`missing`).
  * Rank 0 waits at most JOIN_TIMEOUT s for the workers; a worker waits as long for the
    master: exit 75 (temporary failure) then, which the gang's retries cover.

Input (environment, set by hypercli): ``HYPER_ENGINE`` (spark | ray), ``HYPER_ENGINE_PORT``
(P: the gang's port; Spark's master listens on P and its web UI on P+1; Ray's GCS on P and
its dashboard, when installed, on P+1), ``HYPER_NODE_RANK``, ``HYPER_NUM_NODES``,
``HYPER_MASTER_ADDR``, ``HYPER_NODE_IP``, ``HYPER_CPUS``, ``HYPER_GPUS`` (the rank's own GPU
indexes), ``HYPER_MEMORY`` (bytes, when the task claims memory), ``HYPER_ENGINE_ATTEMPT`` (the
attempt id: the wrapper puts it as ``HYPER_ENGINE_ID`` in the environment of what it starts,
never in its own, so its own parents are never taken for the engine's processes).

Output to the command (rank 0): Spark: ``SPARK_MASTER_URL`` and ``MASTER`` (read by
``spark-submit`` and ``SparkSession.builder`` when no master is given), ``SPARK_LOCAL_IP``,
and unless the task sets its own, ``SPARK_CONF_DIR`` (see :meth:`Wrapper._spark_conf`);
Ray: ``RAY_ADDRESS`` (read by ``ray.init()``).
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request

MISSING = 3             #: exit code: the engine is not installed where the rank runs
NOT_STARTED = 75        #: exit code: the engine did not come up within JOIN_TIMEOUT (EX_TEMPFAIL)
JOIN_TIMEOUT = 180.0    #: s rank 0 waits for every worker, and a worker for the master
CLOSED_AFTER = 3.0      #: s the master's port stays closed before a worker rank ends
STOP_GRACE = 3.0        #: s between SIGTERM and SIGKILL when the engine is stopped
MARK = "HYPER_ENGINE_ID"


def missing(kind, env):
    """What engine ``kind`` lacks on this node with environment ``env`` (its ``PATH``,
    ``JAVA_HOME``, ``SPARK_HOME``), as a sentence naming what to install, or None."""
    path = env.get("PATH") or os.defpath
    if kind == "spark":
        java = _java(env)
        if java is None:
            where = ("JAVA_HOME=%s has no bin/java" % env["JAVA_HOME"] if env.get("JAVA_HOME")
                     else "no java on PATH and JAVA_HOME is not set")
            return ("the spark engine needs Java 17 on the node (%s): install "
                    "openjdk-17-jre-headless, or bake images/packer with engine=spark" % where)
        if _spark_class(env) is None:
            return ("the spark engine needs Spark on the node (no spark-class on PATH and "
                    "SPARK_HOME is not set): pip install pyspark, or bake images/packer with "
                    "engine=spark")
        return None
    if kind == "ray":
        if _which("ray", path) is None:
            return ("the ray engine needs Ray on the node (no ray on PATH): pip install "
                    "ray, or bake images/packer with engine=ray")
        return None
    return "unknown engine %r (spark or ray)" % kind


def _which(name, path):
    for d in path.split(os.pathsep):
        p = os.path.join(d or ".", name)
        if os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def _java(env):
    if env.get("JAVA_HOME"):
        p = os.path.join(env["JAVA_HOME"], "bin", "java")
        return p if os.access(p, os.X_OK) else None
    return _which("java", env.get("PATH") or os.defpath)


def _spark_class(env):
    if env.get("SPARK_HOME"):
        p = os.path.join(env["SPARK_HOME"], "bin", "spark-class")
        return p if os.access(p, os.X_OK) else None
    return _which("spark-class", env.get("PATH") or os.defpath)


def _say(text):
    sys.stderr.write("hyper engine: %s\n" % text)
    sys.stderr.flush()


def _open(host, port, timeout=1.0):
    """True when something accepts TCP connections at host:port."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def processes(attempt_id, roots=()):
    """PIDs of the attempt's processes on this node (this process excepted): those whose
    environment carries ``HYPER_ENGINE_ID=attempt_id``, those given in ``roots``, and every
    descendant of either. The descendants matter: a process that sets its title
    (setproctitle, as Ray's agents and workers do) overwrites its environment as
    ``/proc/PID/environ`` shows it, but stays its parent's child until the parent dies.
    Processes that cannot be read are skipped."""
    want = ("%s=%s" % (MARK, attempt_id)).encode()
    me = os.getpid()
    children = {}
    found = set(roots)
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        pid = int(name)
        try:
            with open("/proc/%d/stat" % pid) as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(pid)
            if pid != me and pid not in found:
                with open("/proc/%d/environ" % pid, "rb") as f:
                    if want in f.read().split(b"\0"):
                        found.add(pid)
        except (OSError, IndexError, ValueError):
            continue
    todo, out = list(found), set()
    while todo:
        pid = todo.pop()
        if pid in out:
            continue
        out.add(pid)
        todo += children.get(pid, ())
    out.discard(me)
    return sorted(out)


def sweep(attempt_id, grace=STOP_GRACE, pids=()):
    """Stop the attempt's processes (see :func:`processes`) and ``pids``: SIGTERM, then
    SIGKILL to those left after ``grace`` s. Returns how many were signalled."""
    pids = sorted(set(pids) | set(processes(attempt_id)))
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except OSError:
            pass
    deadline = time.time() + grace
    left = pids
    while left and time.time() < deadline:
        time.sleep(0.1)
        left = [p for p in left if _alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return len(pids)


def _alive(pid):
    try:
        with open("/proc/%d/stat" % pid) as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Stopped(Exception):
    """SIGTERM arrived: the attempt is being cancelled or its gang stopped."""


class Wrapper:
    """One rank's engine around the command (module docstring)."""

    def __init__(self, argv, env):
        self.argv = argv
        self.env = dict(env)
        self.kind = env["HYPER_ENGINE"]
        self.rank = int(env.get("HYPER_NODE_RANK") or 0)
        self.size = int(env.get("HYPER_NUM_NODES") or 1)
        self.ip = env.get("HYPER_NODE_IP") or "127.0.0.1"
        self.master = env.get("HYPER_MASTER_ADDR") or self.ip
        self.port = int(env["HYPER_ENGINE_PORT"])
        self.cpus = max(1, int(float(env.get("HYPER_CPUS") or 1)))
        self.gpus = [g for g in (env.get("HYPER_GPUS") or "").split(",") if g]
        self.memory = int(env["HYPER_MEMORY"]) if env.get("HYPER_MEMORY") else None
        self.id = env["HYPER_ENGINE_ATTEMPT"]
        self.env[MARK] = self.id
        self.folder = os.getcwd() if not env.get("HYPER_ENGINE_DIR") else env["HYPER_ENGINE_DIR"]
        self.daemons = []

    # -- the engines ---------------------------------------------------------------------
    def engine_env(self):
        """The environment of the engine's daemons: the rank's, marked, plus the engine's
        own settings (Spark: its addresses and folders; Ray: logs to stderr, no usage
        reports)."""
        env = dict(self.env)
        if self.kind == "spark":
            env.update(SPARK_LOCAL_IP=self.ip, SPARK_LOCAL_HOSTNAME=self.ip,
                       SPARK_LOCAL_DIRS=os.path.join(self.folder, "spark-local"),
                       SPARK_NO_DAEMONIZE="1")
        else:
            env.update(RAY_LOG_TO_STDERR="1", RAY_USAGE_STATS_ENABLED="0")
        return env

    def start_master(self):
        """Rank 0: the Spark master on P (web UI P+1), or Ray's head (GCS on P)."""
        env = self.engine_env()
        if self.kind == "spark":
            self._daemon([_spark_class(env), "org.apache.spark.deploy.master.Master",
                          "--host", self.ip, "--port", str(self.port),
                          "--webui-port", str(self.port + 1)], env)
        else:
            self._daemon(["ray", "start", "--head", "--block", "--disable-usage-stats",
                          "--node-ip-address", self.ip, "--port", str(self.port),
                          "--dashboard-host", self.ip, "--dashboard-port", str(self.port + 1)]
                         + self._ray_resources(), env)

    def start_worker(self):
        """A Spark worker with the rank's cores, memory and GPUs; on ranks other than 0 a
        Ray node joining the head with the same (the head is rank 0's Ray node)."""
        env = self.engine_env()
        if self.kind == "spark":
            work = os.path.join(self.folder, "spark-work")
            os.makedirs(work, exist_ok=True)
            argv = [_spark_class(env), "org.apache.spark.deploy.worker.Worker",
                    "spark://%s:%d" % (self.master, self.port), "--host", self.ip,
                    "--cores", str(self.cpus), "--work-dir", work]
            if self.memory:
                argv += ["--memory", "%dm" % max(1, self.memory // 2**20)]
            if self.gpus:  # CUDA_VISIBLE_DEVICES renumbers the rank's GPUs from 0
                path = os.path.join(self.folder, "spark-gpus.json")
                with open(path, "w") as f:
                    json.dump([{"id": {"componentName": "spark.worker", "resourceName": "gpu"},
                                "addresses": [str(i) for i in range(len(self.gpus))]}], f)
                env["SPARK_WORKER_OPTS"] = " ".join(filter(None, [
                    env.get("SPARK_WORKER_OPTS"),
                    "-Dspark.worker.resource.gpu.amount=%d" % len(self.gpus),
                    "-Dspark.worker.resourcesFile=%s" % path]))
            self._daemon(argv, env)
        elif self.rank > 0:  # Ray's head is its rank's worker too
            self._daemon(["ray", "start", "--block", "--disable-usage-stats",
                          "--address", "%s:%d" % (self.master, self.port),
                          "--node-ip-address", self.ip] + self._ray_resources(), env)

    def _ray_resources(self):
        out = ["--num-cpus", str(self.cpus), "--num-gpus", str(len(self.gpus))]
        if self.memory:
            out += ["--memory", str(self.memory)]
        return out

    def joined(self):
        """Workers that have joined the master (rank 0), or None when it cannot tell yet.
        What the master said is kept in ``self.seen`` (for :meth:`describe`)."""
        if self.kind == "spark":
            try:
                url = "http://%s:%d/json/" % (self.ip, self.port + 1)
                with urllib.request.urlopen(url, timeout=2) as r:
                    self.seen = json.load(r)
                return int(self.seen.get("aliveworkers") or 0)
            except (OSError, ValueError):
                return None
        env = self.engine_env()
        p = subprocess.run(["ray", "status", "--address", "%s:%d" % (self.ip, self.port)],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                           timeout=60)
        if p.returncode != 0:
            return None
        self.seen = p.stdout.decode(errors="replace")
        return _ray_nodes(self.seen)

    def describe(self):
        """What the engine holds, one line per worker (Spark: address, cores, memory, GPU
        addresses) or Ray's resource totals, from the master's last answer."""
        seen = getattr(self, "seen", None)
        if self.kind == "spark":
            out = []
            for w in (seen or {}).get("workers") or []:
                if w.get("state") != "ALIVE":
                    continue
                gpus = ((w.get("resources") or {}).get("gpu") or {}).get("addresses") or []
                out.append("worker %s: %s cores, %s MiB%s" % (
                    w.get("host"), w.get("cores"), w.get("memory"),
                    ", gpus %s" % ",".join(gpus) if gpus else ""))
            return sorted(out)
        lines, on = [], False
        for line in (seen or "").splitlines():
            s = line.strip()
            if s.startswith("Total Usage:") or s.startswith("Usage:"):
                on = True
                continue
            if on:
                if not s or s.endswith(":"):
                    break
                lines.append("ray: " + s)
        return lines

    def command_env(self):
        """The command's environment on rank 0 (module docstring: output)."""
        env = dict(self.env)  # marked too: what the command leaves behind is stopped with it
        if self.kind == "spark":
            url = "spark://%s:%d" % (self.ip, self.port)
            env.update(SPARK_MASTER_URL=url, MASTER=url, SPARK_LOCAL_IP=self.ip)
            if not env.get("SPARK_CONF_DIR"):
                env["SPARK_CONF_DIR"] = self._spark_conf(url, env)
        else:
            env["RAY_ADDRESS"] = "%s:%d" % (self.ip, self.port)
        return env

    def _spark_conf(self, url, env):
        """A conf folder in the rank's folder whose ``spark-defaults.conf`` is the Spark
        installation's own (when it has one) plus the master, and jobs that wait until an
        executor on every worker has registered (``minRegisteredResourcesRatio`` 1.0, at most
        60 s: Spark's standalone default starts at once and may leave nodes of the gang idle).
        The ratio is of ``spark.cores.max``: a standalone application without it expects 0
        cores and never waits (Spark's ``StandaloneSchedulerBackend``), so it is set to the
        cores of the workers that joined (the master's count), unless the installation's
        own defaults set it. Returns its path."""
        conf = os.path.join(self.folder, "spark-conf")
        os.makedirs(conf, exist_ok=True)
        text = ""
        home = env.get("SPARK_HOME") or os.path.dirname(os.path.dirname(
            os.path.realpath(_spark_class(env) or "/nonexistent/bin/x")))
        try:
            with open(os.path.join(home, "conf", "spark-defaults.conf")) as f:
                text = f.read().rstrip("\n") + "\n"
        except OSError:
            pass
        text += ("spark.master %s\nspark.scheduler.minRegisteredResourcesRatio 1.0\n"
                 "spark.scheduler.maxRegisteredResourcesWaitingTime 60s\n" % url)
        cores = (getattr(self, "seen", None) or {}).get("cores")
        if cores and not re.search(r"(?m)^\s*spark\.cores\.max\b", text):
            text += "spark.cores.max %d\n" % int(cores)
        with open(os.path.join(conf, "spark-defaults.conf"), "w") as f:
            f.write(text)
        return conf

    # -- the rank ------------------------------------------------------------------------
    def _daemon(self, argv, env):
        # a session of its own: PySpark's worker daemon signals its whole process group
        # (os.kill(0, ...)) when it shuts down, which must not reach this wrapper or the command
        self.daemons.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL,
                                             start_new_session=True))

    def _check_daemons(self):
        for p in self.daemons:
            if p.poll() is not None:
                return p
        return None

    def run(self):
        """The rank's life (module docstring); returns its exit code."""
        why = missing(self.kind, self.env)
        if why:
            _say(why)
            return MISSING
        t0 = time.time()
        if self.rank == 0:
            self.start_master()
            if self.kind == "spark":
                self._wait(lambda: _open(self.ip, self.port), "the master to listen")
            self.start_worker()
            self._wait(lambda: (self.joined() or 0) >= self.size,
                       "%d worker%s to join" % (self.size, "s" if self.size > 1 else ""))
            _say("%s up on %d node%s in %.1f s" % (self.kind, self.size,
                                                   "s" if self.size > 1 else "",
                                                   time.time() - t0))
            for line in self.describe():
                _say(line)
            proc = subprocess.Popen(self.argv, env=self.command_env(),
                                    stdin=subprocess.DEVNULL)
            self.command = proc
            return proc.wait()
        self._wait(lambda: _open(self.master, self.port), "the master at %s:%d"
                   % (self.master, self.port))
        self.start_worker()
        closed_since = None
        while True:
            dead = self._check_daemons()
            if dead is not None:
                _say("the %s worker exited with code %d" % (self.kind, dead.returncode))
                return dead.returncode or 1
            if _open(self.master, self.port):
                closed_since = None
            elif closed_since is None:
                closed_since = time.time()
            elif time.time() - closed_since >= CLOSED_AFTER:
                return 0  # rank 0 is done and has stopped the master
            time.sleep(0.5)

    def _wait(self, ready, what):
        deadline = time.time() + JOIN_TIMEOUT
        while not ready():
            dead = self._check_daemons()
            if dead is not None:
                raise NotStarted("the %s engine exited with code %d while waiting for %s"
                                 % (self.kind, dead.returncode, what))
            if time.time() > deadline:
                raise NotStarted("gave up waiting %g s for %s" % (JOIN_TIMEOUT, what))
            time.sleep(0.25)

    def stop(self):
        """Stop this rank's engine: its daemons first (a clean shutdown), then every process
        of the attempt (:func:`processes`, its tree taken before anything is stopped: a
        daemon's children are orphaned once it has gone)."""
        tree = processes(self.id, roots=[os.getpid()])
        for p in self.daemons:
            if p.poll() is None:
                try:
                    p.terminate()
                except OSError:
                    pass
        deadline = time.time() + STOP_GRACE
        for p in self.daemons:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                pass
        sweep(self.id, grace=max(0.5, deadline - time.time()), pids=tree)
        for p in self.daemons:
            try:
                p.wait(1)
            except subprocess.TimeoutExpired:
                pass


class NotStarted(Exception):
    """The engine did not come up."""


def _ray_nodes(text):
    """Live nodes in ``ray status`` output: the lines under "Active:" up to the next
    heading."""
    count, active = 0, False
    for line in text.splitlines():
        s = line.strip()
        if s.startswith("Active:"):
            active = True
            continue
        if active:
            if not s or s.endswith(":"):
                break
            if s[0].isdigit() and "node_" in s:
                count += int(s.split()[0])
    return count


def main(argv):
    """``engine.py COMMAND...`` (the rank, module docstring); ``engine.py --check KIND``
    (print what is missing, exit 3, or exit 0); ``engine.py --sweep ATTEMPT_ID`` (stop the
    attempt's processes, see :func:`sweep`: SIGTERM, SIGKILL after 0.5 s)."""
    if len(argv) == 3 and argv[1] == "--check":
        why = missing(argv[2], os.environ)
        if why:
            print(why)
            return MISSING
        return 0
    if len(argv) == 3 and argv[1] == "--sweep":
        sweep(argv[2], grace=0.5)
        return 0
    if len(argv) < 2:
        sys.stderr.write("usage: engine.py COMMAND... | --check KIND | --sweep ATTEMPT_ID\n")
        return 2
    w = Wrapper(argv[1:], os.environ)

    def on_term(signum, frame):
        raise Stopped()
    signal.signal(signal.SIGTERM, on_term)
    code = 143
    try:
        code = w.run()
    except Stopped:
        _say("stopping (SIGTERM)")
        cmd = getattr(w, "command", None)
        if cmd is not None:
            try:
                code = cmd.wait(STOP_GRACE)
            except subprocess.TimeoutExpired:
                code = 143
        code = 143 if code in (None, 0) else code
    except NotStarted as e:
        _say(str(e))
        code = NOT_STARTED
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        w.stop()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv))
