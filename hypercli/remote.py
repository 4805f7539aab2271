"""Ad-hoc work on a cluster's nodes: ``hyper exec``, ``hyper ssh`` and ``hyper ssh-config``.

* :func:`exec_on` runs one shell command on every node of a cluster (or on some) at once and
  hands each line of output to the caller as it arrives, tagged with its node and stream. It
  goes over the same verified connections as the run loop (:class:`hypercli.ssh.conn.
  Connection`, host keys pinned per cluster by :mod:`hypercli.ssh.hostkeys`), and keeps every
  node's outcome, after Fabric's ``GroupResult``: a node that cannot be reached is reported
  and counts as exit code 255 (what OpenSSH's ``ssh`` exits with), the others go on.
  A local cluster's nodes are worker slots of this machine: the command runs here once per
  node, in the current folder, with the node's view (``HYPER_NODE``, its share of the GPUs).
* :func:`ssh_argv` is the command line of the system ``ssh`` client for an interactive shell
  on one node, and :func:`ssh_config` the OpenSSH ``Host`` blocks of a cluster's nodes, so
  ``ssh``, ``scp``, ``rsync`` and editors' remote modes reach them. Both pin the host keys
  through a known_hosts file of the cluster's own, ``$HYPER_HOME/ssh/<cluster>.known_hosts``,
  written from the pins (:func:`write_known_hosts`), with ``StrictHostKeyChecking yes``: a
  host whose key is not the pinned one is refused, never learned.

Nothing here prints: output and notes go to the caller's callbacks.
"""

from __future__ import annotations

import os
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from hypercli import state as S
from hypercli.errors import HyperError, InfraError, NodeError, UsageError

UNREACHABLE = 255  # exit code of a node that could not be reached (as OpenSSH's ssh)
LINE_MAX = 64 << 10  # bytes: a longer line (binary output, progress bars) is passed on in parts

#: on_line(node name, "stdout" | "stderr", one line of output without its b"\n")
OnLine = Callable[[str, str, bytes], None]
#: on_note(node name, kind, text): kind "skipped" (node not up), "error" (unreachable),
#: "exit" (the node's non-zero exit code, at its end)
OnNote = Callable[[str, str, str], None]


# -- clusters and nodes --------------------------------------------------------------------
def cluster_row(state: S.State, name: str) -> dict:
    """The ``clusters`` row of ``name``.

    Raises:
        UsageError: no cluster of that name (the message names the known ones), or the
            cluster is down.
    """
    c = state.cluster(name)
    if c is None:
        known = ", ".join(x["name"] for x in state.clusters()) or "none"
        raise UsageError(f"no cluster named {name!r} (known clusters: {known})",
                         "`hyper status` lists them")
    if c["status"] != "up":
        raise UsageError(f"cluster {name} is {c['status']}",
                         f"`hyper up` brings it up again; `hyper status {name}` shows it")
    return c


def pick_nodes(nodes: list[dict], refs: Sequence[str], cluster: str) -> list[dict]:
    """The nodes named by ``refs`` (all of ``nodes`` when empty), in cluster order.

    A ref is a node name (``lab-1``), or an index: the node ``<cluster>-<index>`` when there
    is one, else the index-th node as ``hyper status`` lists them (from 0).

    Raises:
        UsageError: a ref that names no node (the message lists the cluster's nodes).
    """
    if not refs:
        return list(nodes)
    names = [n["name"] for n in nodes]
    chosen = set()
    for ref in refs:
        if ref in names:
            chosen.add(ref)
        elif ref.isdigit() and f"{cluster}-{int(ref)}" in names:
            chosen.add(f"{cluster}-{int(ref)}")
        elif ref.isdigit() and int(ref) < len(names):
            chosen.add(names[int(ref)])
        else:
            raise UsageError(f"cluster {cluster} has no node {ref!r} (its nodes: "
                             f"{', '.join(names) or 'none'})",
                             "give a node name or its index from `hyper status`")
    return [n for n in nodes if n["name"] in chosen]


def command_line(args: Sequence[str]) -> str:
    """The shell command of ``hyper exec``/``hyper ssh`` arguments: a single argument is a
    shell line as it is (``'nvidia-smi | head'``); several are quoted word by word
    (``sh -c 'exit 3'`` stays three words).

    Raises:
        UsageError: no argument, or only blank ones.
    """
    args = list(args)
    line = args[0] if len(args) == 1 else shlex.join(args)
    if not line.strip():
        raise UsageError("no command given", "hyper exec CLUSTER -- COMMAND")
    return line


# -- exec ----------------------------------------------------------------------------------
@dataclass
class ExecResult:
    """What ``exec_on`` did. ``codes``: node → exit code (255: not reached or the connection
    died); ``errors``: node → the error of a node not reached; ``skipped``: node → its status
    (nodes not up, not tried)."""

    codes: dict[str, int] = field(default_factory=dict)
    errors: dict[str, HyperError] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)

    @property
    def exit_code(self) -> int:
        """The worst node's exit code (the largest), 0 when every node that ran exited 0."""
        return max(self.codes.values(), default=0)


class _Lines:
    """Cuts a byte stream into lines for ``on_line`` (a line longer than LINE_MAX is passed
    on in parts)."""

    def __init__(self, node: str, stream: str, emit: OnLine):
        self.node, self.stream, self.emit = node, stream, emit
        self.buf = bytearray()

    def feed(self, data: bytes) -> None:
        self.buf += data
        while True:
            i = self.buf.find(b"\n")
            if i < 0:
                break
            self.emit(self.node, self.stream, bytes(self.buf[:i]))
            del self.buf[:i + 1]
        while len(self.buf) >= LINE_MAX:
            self.emit(self.node, self.stream, bytes(self.buf[:LINE_MAX]))
            del self.buf[:LINE_MAX]

    def close(self) -> None:
        if self.buf:
            self.emit(self.node, self.stream, bytes(self.buf))
            self.buf.clear()


def _ssh_target(node: dict):
    from hypercli.ssh.conn import Target
    a = node["address"]
    return Target(a["host"], a["port"], a["user"], a.get("identity_file"))


def _remote(provider, node: dict, command: str, emit: OnLine, stop: threading.Event) -> int:
    """Run ``command`` on an SSH node over the provider's verified connection, streaming its
    output; returns the exit code (255: the connection died or the command was killed by a
    signal). Raises NodeError: the node cannot be reached."""
    from hypercli.ssh.conn import HostUnreachable
    name = node["name"]
    conn = provider.connection(name, _ssh_target(node), node["cluster"])
    ch = conn.channel()
    out, err = _Lines(name, "stdout", emit), _Lines(name, "stderr", emit)
    try:
        ch.exec_command(f"HYPER_NODE={shlex.quote(name)}; export HYPER_NODE; {command}")
        ch.shutdown_write()
        fd = ch.fileno()  # readable when either stream has data or the channel closed
        while not stop.is_set():
            got = False
            while ch.recv_ready():
                out.feed(ch.recv(1 << 16))
                got = True
            while ch.recv_stderr_ready():
                err.feed(ch.recv_stderr(1 << 16))
                got = True
            if got:
                continue
            if ch.closed or (ch.eof_received and ch.exit_status_ready()):
                break
            if ch.eof_received:  # the exit status is on its way
                time.sleep(0.002)
            else:
                select.select([fd], [], [], 0.5)
        out.close()
        err.close()
        if stop.is_set():
            return 130
        code = ch.recv_exit_status() if ch.exit_status_ready() else -1
    except (OSError, EOFError) as e:
        raise HostUnreachable(name, f"connection lost: {e}") from None
    finally:
        ch.close()
    if code < 0:  # no exit status: the connection died, or a signal killed the command
        for _ in range(50):  # the transport notices its end just after the channel's
            if not conn.alive():
                raise HostUnreachable(name, "connection lost while the command ran")
            time.sleep(0.01)
        return UNREACHABLE
    return code


def _local(node: dict, command: str, emit: OnLine, stop: threading.Event,
           gpu_machine: bool) -> int:
    """Run ``command`` here in the view of local node ``node`` (module docstring), streaming
    its output; returns its exit code (128 + N when killed by signal N). ``gpu_machine``:
    this machine has GPUs (then the node sees exactly its share of them, maybe none)."""
    env = dict(os.environ, HYPER_NODE=node["name"])
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    gpus = [str(g["index"]) for g in (node.get("info") or {}).get("gpus") or []]
    if gpu_machine:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus)
        env["NVIDIA_VISIBLE_DEVICES"] = ",".join(gpus) or "void"
    proc = subprocess.Popen(["/bin/sh", "-c", command], stdin=subprocess.DEVNULL,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                            start_new_session=True)
    lines = {proc.stdout.fileno(): _Lines(node["name"], "stdout", emit),
             proc.stderr.fileno(): _Lines(node["name"], "stderr", emit)}
    try:
        while lines and not stop.is_set():
            ready, _, _ = select.select(list(lines), [], [], 0.5)
            for fd in ready:
                data = os.read(fd, 1 << 16)
                if data:
                    lines[fd].feed(data)
                else:
                    lines.pop(fd).close()
        if stop.is_set():
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        code = proc.wait()
    finally:
        for f in (proc.stdout, proc.stderr):
            f.close()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return 128 - code if code < 0 else code


def exec_on(state: S.State, cluster: str, command: str, *, nodes: Sequence[str] = (),
            on_line: OnLine, on_note: OnNote = lambda node, kind, text: None) -> ExecResult:
    """Run a shell command on every node of ``cluster`` that is up (or on ``nodes``), all at
    once, streaming output as it comes.

    Args:
        cluster: the cluster's name.
        command: a shell command line (see :func:`command_line`); it runs in the login
            folder of SSH nodes, and in the current folder here for local nodes, with
            ``HYPER_NODE`` set to the node's name.
        nodes: node names or indexes (:func:`pick_nodes`); empty = all.
        on_line: receives each line of output (without its newline) as it arrives; calls
            are serialized (one at a time, from the nodes' threads). What it raises (e.g.
            BrokenPipeError) stops every node's command and is raised again here.
        on_note: receives "skipped" notes for nodes that are not up (before anything runs),
            an "error" note for each node that cannot be reached, as it happens, and an
            "exit" note for each node that exits non-zero; serialized with ``on_line``.
    Returns:
        ExecResult: every node's exit code (255: not reached); ``exit_code`` is the worst.
    Raises:
        UsageError: unknown cluster or node, cluster down, empty command.
        InfraError: none of the chosen nodes is up.
        KeyboardInterrupt: after stopping the local commands and closing the channels
            (commands on SSH nodes get SIGPIPE when they next write).
    """
    if not command.strip():
        raise UsageError("no command given", "hyper exec CLUSTER -- COMMAND")
    c = cluster_row(state, cluster)
    every = state.nodes(cluster)
    chosen = pick_nodes(every, nodes, cluster)
    gpu_machine = any((n.get("info") or {}).get("gpus") for n in every)
    result = ExecResult()
    lock = threading.Lock()
    stop = threading.Event()
    failed: list[BaseException] = []  # what on_line raised (a closed pipe): stops everything

    def emit(node: str, stream: str, line: bytes) -> None:
        with lock:
            if failed:
                return
            try:
                on_line(node, stream, line)
            except BaseException as e:
                failed.append(e)
                stop.set()

    def note(node: str, kind: str, text: str) -> None:
        with lock:
            on_note(node, kind, text)

    for n in chosen:
        if n["status"] != "up":
            result.skipped[n["name"]] = n["status"]
            note(n["name"], "skipped", f"node is {n['status']}, not up: skipped")
    live = [n for n in chosen if n["status"] == "up"]
    if not live:
        raise InfraError(f"no node of cluster {cluster} to run on: "
                         + ", ".join(f"{k} is {v}" for k, v in result.skipped.items()),
                         f"`hyper status {cluster}` shows its nodes; `hyper up` brings "
                         "them back")
    provider = None
    if c["provider"] != "local":
        from hypercli.providers.ssh import SSHProvider
        provider = SSHProvider(trust_new_hosts=False)  # cloud nodes are SSH hosts too

    def one(node: dict) -> None:
        name = node["name"]
        try:
            if provider is None:
                code = _local(node, command, emit, stop, gpu_machine)
            else:
                code = _remote(provider, node, command, emit, stop)
        except HyperError as e:
            result.errors[name], result.codes[name] = e, UNREACHABLE
            note(name, "error", str(e).removeprefix(f"node {name}: ")
                 + (f" ({e.hint})" if e.hint else ""))
            return
        except Exception as e:  # paramiko's own errors: the node is not reachable
            result.errors[name] = NodeError(name, f"{type(e).__name__}: {e}")
            result.codes[name] = UNREACHABLE
            note(name, "error", f"{type(e).__name__}: {e}")
            return
        result.codes[name] = code
        if code and not stop.is_set():
            note(name, "exit", f"exited {code}")

    threads = [threading.Thread(target=one, args=(n,), name=f"exec-{n['name']}", daemon=True)
               for n in live]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)
    except KeyboardInterrupt:
        stop.set()
        for t in threads:
            t.join(5)
        raise
    finally:
        if provider is not None:
            for n in live:
                provider.drop(n["name"])
    if failed:
        raise failed[0]
    result.codes = {n["name"]: result.codes[n["name"]] for n in live if n["name"] in result.codes}
    return result


# -- ssh and ssh-config --------------------------------------------------------------------
def known_hosts_path(cluster: str) -> Path:
    """``$HYPER_HOME/ssh/<cluster>.known_hosts``: the pins of a cluster for OpenSSH."""
    return S.home() / "ssh" / f"{cluster}.known_hosts"


def write_known_hosts(cluster: str, nodes: list[dict]) -> tuple[Path, list[str]]:
    """Write the pinned host keys of ``nodes`` (SSH nodes of ``cluster``) in OpenSSH's
    known_hosts format to :func:`known_hosts_path` (mode 0600, atomically). A node's keys
    are those hypercli's connections accept: pinned for the cluster
    (``$HYPER_HOME/known_hosts/<cluster>``) or in ``~/.ssh/known_hosts``, the cluster's pin
    winning for a key type both have.

    Returns:
        (the file, names of the nodes that have no pinned key: OpenSSH will refuse them).
    """
    from hypercli.ssh.hostkeys import KnownHosts
    known = KnownHosts(cluster)
    lines, missing = [], []
    for n in nodes:
        a = n["address"]
        host = KnownHosts.hostname(a["host"], a["port"])
        keys: dict = {}
        for source in (known.user_keys, known.keys):
            found = source.lookup(host)
            if found:
                keys.update({kind: key for kind, key in found.items()})
        if not keys:
            missing.append(n["name"])
        for kind, key in sorted(keys.items()):
            lines.append(f"{host} {kind} {key.get_base64()}\n")
    path = known_hosts_path(cluster)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(dict.fromkeys(lines)))
    os.replace(tmp, path)
    return path, missing


def _ssh_cluster(state: S.State, cluster: str) -> list[dict]:
    """The nodes of an SSH-reachable cluster. Raises UsageError: unknown, down or local."""
    c = cluster_row(state, cluster)
    if c["provider"] == "local":
        raise UsageError(f"cluster {cluster} is local: its nodes are worker slots of this "
                         "machine, there is no host to ssh to",
                         f"`hyper exec {cluster} -- COMMAND` runs a command in each node's "
                         "view here")
    return state.nodes(cluster)


def ssh_argv(state: S.State, cluster: str, node: str | None = None,
             command: str | None = None) -> list[str]:
    """The argv of the system ``ssh`` client for a shell (or ``command``) on one node, with
    the node's user, port and key (``-i``, ``IdentitiesOnly``; none when the cluster uses
    the default keys and agent) and its pinned host key (:func:`write_known_hosts`,
    ``StrictHostKeyChecking=yes``, no global known_hosts).

    Args:
        node: a node name or index (:func:`pick_nodes`); None: the first node that is up.
        command: a shell command line to run instead of a login shell.
    Raises:
        UsageError: unknown cluster or node, a local cluster, a node that is down, no node up.
        InfraError: no ``ssh`` client on PATH; the node has no pinned host key.
    """
    nodes = _ssh_cluster(state, cluster)
    if node is None:
        up = [n for n in nodes if n["status"] == "up"]
        if not up:
            raise UsageError(f"no node of cluster {cluster} is up",
                             f"`hyper status {cluster}` shows its nodes")
        n = up[0]
    else:
        n = pick_nodes(nodes, [node], cluster)[0]
        if n["status"] == "down":
            raise UsageError(f"node {n['name']} is down (removed)",
                             f"`hyper status {cluster}` shows the nodes that are up")
    exe = shutil.which("ssh")
    if exe is None:
        raise InfraError("no `ssh` client found on PATH",
                         "install OpenSSH's client (Debian/Ubuntu: apt-get install "
                         "openssh-client)")
    path, missing = write_known_hosts(cluster, [n])
    if missing:
        raise InfraError(f"node {n['name']} has no pinned host key",
                         f"`hyper up` with --trust-new-hosts pins it, or add it to {path}")
    a = n["address"]
    argv = [exe]
    if a.get("identity_file"):
        argv += ["-i", a["identity_file"], "-o", "IdentitiesOnly=yes"]
    argv += ["-o", f"UserKnownHostsFile={path}", "-o", "GlobalKnownHostsFile=/dev/null",
             "-o", "StrictHostKeyChecking=yes", "-o", "UpdateHostKeys=no",
             "-p", str(a["port"]), "-l", a["user"], "--", a["host"]]
    if command:
        argv.append(command)
    return argv


def _quote(value: str) -> str:
    """A value for ssh_config: double-quoted when it holds spaces."""
    return f'"{value}"' if any(c.isspace() for c in value) else value


def ssh_config(state: S.State, cluster: str) -> str:
    """OpenSSH client configuration for the nodes of ``cluster`` that are up or lost: one
    ``Host <node name>`` block each, with HostName, Port, User, IdentityFile and
    IdentitiesOnly (when the cluster has a key), the cluster's known_hosts file
    (:func:`write_known_hosts`, rewritten now) and ``StrictHostKeyChecking yes``.

    Returns:
        the text (for ``ssh -F FILE``, or an ``Include`` in ``~/.ssh/config``); a node with
        no pinned key gets a comment saying OpenSSH will refuse it.
    Raises:
        UsageError: unknown, down or local cluster.
    """
    nodes = [n for n in _ssh_cluster(state, cluster) if n["status"] != "down"]
    path, missing = write_known_hosts(cluster, nodes)
    out = [f"# hypercli cluster {cluster}: `hyper ssh-config {cluster}` writes this again\n"]
    for n in nodes:
        a = n["address"]
        out.append(f"\nHost {n['name']}\n")
        if n["name"] in missing:
            out.append("    # no pinned host key: ssh refuses this host until it is pinned\n")
        if n["status"] != "up":
            out.append(f"    # node is {n['status']}\n")
        out.append(f"    HostName {a['host']}\n    Port {a['port']}\n    User {a['user']}\n")
        if a.get("identity_file"):
            out.append(f"    IdentityFile {_quote(a['identity_file'])}\n"
                       "    IdentitiesOnly yes\n")
        out.append(f"    UserKnownHostsFile {_quote(str(path))}\n"
                   "    GlobalKnownHostsFile /dev/null\n"
                   "    StrictHostKeyChecking yes\n"
                   "    UpdateHostKeys no\n")
    return "".join(out)
