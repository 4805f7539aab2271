"""Ports of a cluster's nodes on this machine: ``hyper port-forward``, ``hyper jupyter`` and
``hyper tensorboard`` (the paper's "one-click Jupyter notebooks or Tensorboard graphs",
section VI).

* :class:`Forward` listens on a port of this machine (127.0.0.1 unless told otherwise) and
  carries each connection to a port of a node through the cluster's own SSH connection
  (a ``direct-tcpip`` channel, RFC 4254 section 7.2, over :class:`hypercli.ssh.conn.
  Connection`, whose host key is pinned): nothing is opened in a firewall, and the node's
  port may listen on its loopback only.
* :class:`NodeServer` starts a web server (JupyterLab, TensorBoard, or any command) detached
  on a node, on the node itself or in a container image (``docker run --network host``),
  waits until the server prints its URL (``http://127.0.0.1:8888/lab?token=...``), and stops
  it again (its process group, or its container). :class:`LocalServer` is the same on this
  machine. :func:`local_url` turns the server's URL into the forwarded one, keeping its path
  and token.

A server's URL is read from its own output, so no port is chosen here and the token never
appears on a command line: JupyterLab makes its token and prints it. Nothing here prints.
"""

from __future__ import annotations

import re
import secrets
import select
import shlex
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass

from hypercli import state as S
from hypercli.errors import InfraError, UsageError

#: a URL a server prints when it is ready: scheme, host, port, and the rest
URL = re.compile(r"(https?)://([A-Za-z0-9.\-]+|\[[0-9a-fA-F:]+\]):(\d{1,5})(/[^\s'\"<>]*)?")
READY_TIMEOUT = 60.0  #: s a server has to print its URL
JUPYTER = ("jupyter lab --no-browser --ip=127.0.0.1 --port=8888 --ServerApp.port_retries=50"
           " --allow-root")
TENSORBOARD = "tensorboard --host 127.0.0.1 --port 0 --logdir {logdir}"


def parse_ports(spec: str) -> tuple[int, int]:
    """``PORT[:LOCAL]`` → (the node's port, the local port; 0 when not given: a free one).

    Raises:
        UsageError: not two numbers in 1..65535 (the local one may be 0).
    """
    remote, _, local = spec.partition(":")
    try:
        r, l_ = int(remote), int(local or 0)
    except ValueError:
        r = l_ = -1
    if not (0 < r < 65536 and 0 <= l_ < 65536):
        raise UsageError(f"{spec!r} is not PORT[:LOCAL]",
                         "the node's port, then optionally this machine's: 8888 or 8888:9000")
    return r, l_


def local_url(url: str, port: int, host: str = "127.0.0.1") -> str:
    """The server's ``url`` as seen through a forward to ``host:port`` (path and query,
    the token with them, kept)."""
    m = URL.search(url)
    rest = m[4] or "/" if m else "/"
    return f"http://{host}:{port}{rest}"


class Forward:
    """Connections to ``bind:local_port`` here carried to ``remote_host:remote_port`` as the
    node sees it, over an SSH connection (module docstring).

    Args:
        conn: the node's :class:`~hypercli.ssh.conn.Connection`.
        remote_port: the port on the node.
        local_port: the port here; 0 picks a free one (``port`` tells which).
        bind: the address to listen on here (127.0.0.1: this machine only).
    Raises:
        UsageError: the local port cannot be bound.
    """

    def __init__(self, conn, remote_port: int, local_port: int = 0, bind: str = "127.0.0.1",
                 remote_host: str = "127.0.0.1"):
        self.conn, self.remote = conn, (remote_host, remote_port)
        self.sock = socket.socket(socket.AF_INET6 if ":" in bind else socket.AF_INET)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((bind, local_port))
        except OSError as e:
            self.sock.close()
            raise UsageError(f"cannot listen on {bind}:{local_port}: {e.strerror or e}",
                             "give another local port (PORT:LOCAL)") from None
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.closed = threading.Event()
        self.errors: list[str] = []  #: why connections could not be carried (newest last)
        self.connections = 0  #: connections carried so far
        self._thread = threading.Thread(target=self._accept, name="forward", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                r, _, _ = select.select([self.sock], [], [], 0.2)
                if not r:
                    continue
                client, addr = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._carry, args=(client, addr), daemon=True).start()

    def _carry(self, client: socket.socket, addr) -> None:
        try:
            ch = self.conn.transport.open_channel("direct-tcpip", self.remote, addr[:2],
                                                  timeout=10)
        except Exception as e:  # refused on the node (nothing listens), connection gone
            self.errors.append(f"{self.remote[0]}:{self.remote[1]} on {self.conn.name}: {e}")
            client.close()
            return
        self.connections += 1
        watch = [client, ch]
        try:
            while not self.closed.is_set():
                ready, _, _ = select.select(watch, [], [], 0.5)
                if client in ready:
                    data = client.recv(1 << 16)
                    if data:
                        ch.sendall(data)
                    else:  # the client is done sending: so is the channel
                        ch.shutdown_write()
                        watch = [ch]
                if ch in ready:
                    data = ch.recv(1 << 16)
                    if not data:
                        break
                    client.sendall(data)
        except OSError:
            pass
        finally:
            ch.close()
            client.close()

    def close(self) -> None:
        self.closed.set()
        try:
            self.sock.close()
        except OSError:
            pass
        self._thread.join(2)


def wait_for_url(read, alive, what: str, timeout: float = READY_TIMEOUT) -> str:
    """Poll a server's output (``read() -> str``, all of it so far) until it holds a URL
    with a port; ``alive() -> bool`` tells whether the server still runs.

    Raises:
        InfraError: the server ended first (with the last lines it printed) or ``timeout``
            s passed.
    """
    end = time.monotonic() + timeout
    while True:
        text = read()
        m = URL.search(text)
        if m:
            return m[0]
        if not alive():
            text = read()
            m = URL.search(text)
            if m:
                return m[0]
            tail = "\n".join(text.strip().splitlines()[-8:])
            raise InfraError(f"{what} ended before it printed its URL"
                             + (f":\n{tail}" if tail else " (it printed nothing)"))
        if time.monotonic() > end:
            raise InfraError(f"{what} printed no URL in {timeout:g} s",
                             "its output so far: " + " | ".join(text.strip().splitlines()[-3:]))
        time.sleep(0.2)


def _q(path: str) -> str:
    """A path for a node's shell: quoted, with a leading ``~/`` left to the shell."""
    if path.startswith("~/"):
        return '"$HOME"/' + shlex.quote(path[2:])
    return shlex.quote(path)


@dataclass
class NodeServer:
    """A server started detached on a node (module docstring).

    Args:
        conn: the node's connection.
        command: shell text that starts the server in the foreground.
        folder: where it starts (made when missing; bound into the container).
        image: run it in this container image (host network), or None.
        gpus: give the container the node's GPUs.
    """

    conn: object
    command: str
    folder: str
    image: str | None = None
    gpus: bool = False

    def start(self) -> "NodeServer":
        """Start the server. Raises HyperError (CommandFailed: it could not start)."""
        self.name = f"hyper-srv-{secrets.token_hex(4)}"
        d = "~/.hyper/servers"
        self.log = f"{d}/{self.name}.log"
        f = _q(self.folder)
        if self.image:
            gpus = "--gpus all " if self.gpus else ""
            self.conn.run(
                f"mkdir -p {f} && docker run -d --rm --name {self.name} --network host {gpus}"
                f"-v {f}:{f} -w {f} {shlex.quote(self.image)} sh -c "
                f"{shlex.quote(self.command)} >/dev/null", timeout=600)
        else:
            out = self.conn.run(
                f"mkdir -p {d} {f} && chmod 700 {d} && cd {f} && "
                f"{{ setsid sh -c {shlex.quote(self.command)} </dev/null >{self.log} 2>&1 & }}"
                " && echo $!", timeout=60).stdout
            self.pid = int(out.split()[-1])
        return self

    def output(self) -> str:
        cmd = (f"docker logs {self.name} 2>&1" if self.image else f"cat {self.log}")
        return self.conn.run(cmd, check=False, timeout=30).stdout.decode(errors="replace")

    def alive(self) -> bool:
        cmd = (f"docker inspect -f '{{{{.State.Running}}}}' {self.name} 2>/dev/null | "
               "grep -qx true" if self.image else f"kill -0 {self.pid} 2>/dev/null")
        return self.conn.run(cmd, check=False, timeout=30).exit_code == 0

    def stop(self) -> None:
        """Stop the server (its whole process group, or its container); never raises."""
        try:
            if self.image:
                self.conn.run(f"docker rm -f {self.name} >/dev/null 2>&1", check=False,
                              timeout=60)
            else:
                self.conn.run(f"kill -TERM -- -{self.pid} 2>/dev/null; sleep 0.5; "
                              f"kill -KILL -- -{self.pid} 2>/dev/null; rm -f {self.log}",
                              check=False, timeout=30)
        except Exception:
            pass


class LocalServer:
    """A server started on this machine, in a process group of its own; its output is
    kept in memory."""

    def __init__(self, command: str, folder: str):
        self.command, self.folder = command, folder
        self.text = ""

    def start(self) -> "LocalServer":
        import os
        os.makedirs(self.folder, exist_ok=True)
        self.proc = subprocess.Popen(["/bin/sh", "-c", self.command], cwd=self.folder,
                                     stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        return self

    def _read(self) -> None:
        for line in iter(self.proc.stdout.readline, b""):
            self.text += line.decode(errors="replace")

    def output(self) -> str:
        return self.text

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        import os
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(5)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        self.proc.wait()
        self.proc.stdout.close()


# -- the cluster's side ---------------------------------------------------------------------
def node_connection(state: S.State, cluster: str, node: str | None = None):
    """(the ``nodes`` row, its verified Connection) of a node of an SSH-reachable cluster:
    ``node`` a name or index (:func:`hypercli.remote.pick_nodes`), default the first up.

    Raises:
        UsageError: unknown cluster or node, a local cluster, no node up, a node not up.
        NodeError: the node cannot be reached (or its host key is not the pinned one).
    """
    from hypercli.providers.ssh import SSHProvider, _target_of
    from hypercli.remote import cluster_row, pick_nodes
    c = cluster_row(state, cluster)
    if c["provider"] == "local":
        raise UsageError(f"cluster {cluster} is local: its ports are this machine's already",
                         "open http://127.0.0.1:PORT directly")
    nodes = state.nodes(cluster)
    if node is None:
        up = [n for n in nodes if n["status"] == "up"]
        if not up:
            raise UsageError(f"no node of cluster {cluster} is up",
                             f"`hyper status {cluster}` shows its nodes")
        n = up[0]
    else:
        n = pick_nodes(nodes, [node], cluster)[0]
        if n["status"] != "up":
            raise UsageError(f"node {n['name']} is {n['status']}, not up",
                             f"`hyper status {cluster}` shows the nodes that are up")
    provider = SSHProvider(trust_new_hosts=False)
    return n, provider.connection(n["name"], _target_of(n), cluster)


def jupyter_command(conn, image: str | None) -> str:
    """The default JupyterLab command, after checking that the node (or the image) has it.
    Raises UsageError: no ``jupyter`` there (the hint says what to install)."""
    if image:
        return JUPYTER
    if conn.run("command -v jupyter >/dev/null", check=False).exit_code != 0:
        raise UsageError(f"JupyterLab is not installed on node {conn.name}",
                         "pip install jupyterlab there (`hyper exec`), or give --image with "
                         "an image that has it")
    return JUPYTER


@dataclass
class Served:
    """A server reachable from here: ``url`` (with its token), the server, and the forward
    carrying it (None when it runs on this machine). ``close()`` stops both."""

    url: str
    server: object
    forward: Forward | None = None
    where: str = "this machine"

    def close(self) -> None:
        if self.forward is not None:
            self.forward.close()
        self.server.stop()


def _serve(server, forward_to=None, local_port: int = 0, what: str = "the server") -> Served:
    """Start ``server``, wait for its URL and, with ``forward_to`` (a Connection), forward
    its port to ``local_port`` here. The server is stopped again when any step fails."""
    server.start()
    try:
        url = wait_for_url(server.output, server.alive, what)
        if forward_to is None:
            return Served(url, server)
        port = int(URL.search(url)[3])
        fwd = Forward(forward_to, port, local_port)
        return Served(local_url(url, fwd.port), server, fwd, forward_to.name)
    except BaseException:
        server.stop()
        raise


def port_forward(state: S.State, cluster: str, node: str | None, remote_port: int,
                 local_port: int = 0, bind: str = "127.0.0.1") -> Forward:
    """Forward ``bind:local_port`` here to port ``remote_port`` of a node (default the
    cluster's first node that is up). Raises as :func:`node_connection`; UsageError: the
    local port cannot be bound."""
    _, conn = node_connection(state, cluster, node)
    return Forward(conn, remote_port, local_port, bind)


def experiment_image(state: S.State, ref: str) -> str:
    """The image of experiment ``WORKFLOW/EXPERIMENT``. Raises UsageError: no such
    workflow or experiment, or it has no image."""
    wref, _, exp = ref.rpartition("/")
    if not wref:
        raise UsageError(f"{ref!r} is not WORKFLOW/EXPERIMENT", "e.g. quickstart-1/search")
    wid = state.workflow(wref)["id"]
    row = next((e for e in state.experiments(wid) if e["name"] == exp), None)
    if row is None:
        raise UsageError(f"workflow {wid} has no experiment {exp!r}",
                         f"`hyper ps {wid}` lists its tasks")
    if not row["image"]:
        raise UsageError(f"experiment {wid}/{exp} has no image: it runs on the node itself",
                         "leave out --experiment")
    return row["image"]


def jupyter(state: S.State, cluster: str, node: str | None = None, *,
            image: str | None = None, command: str | None = None,
            local_port: int = 0) -> Served:
    """Start JupyterLab (or ``command``, a server that prints its URL) on a node, in
    ``image`` when given (made present there as for tasks, :mod:`hypercli.ssh.images`),
    in the node's ``~/.hyper/work`` (the workflows' working folders), and forward it here.

    Returns:
        :class:`Served`; its ``url`` is this machine's, with the server's token.
    Raises:
        UsageError: unknown cluster or node, a local cluster, no JupyterLab on the node.
        InfraError: the server ended, or printed no URL in READY_TIMEOUT s (with its output).
    """
    n, conn = node_connection(state, cluster, node)
    if image:
        from hypercli.ssh import images
        images.ensure(conn, image)
    cmd = command or jupyter_command(conn, image)
    home = (n.get("info") or {}).get("root") or "~/.hyper"
    server = NodeServer(conn, cmd, f"{home}/work", image,
                        gpus=bool((n.get("info") or {}).get("gpus")))
    return _serve(server, conn, local_port, f"the notebook server on {n['name']}")


def tensorboard(state: S.State, workflow: str, *, command: str | None = None,
                local_port: int = 0) -> Served:
    """Serve TensorBoard (or ``command``; ``{logdir}`` in it is the folder or URL) over a
    workflow's outputs: here when they are in a ``file://`` folder or the cluster is local;
    on the cluster's first node that is up, forwarded here, when they are in object storage
    (TensorBoard reads ``s3://`` and ``gs://`` itself, with the node's storage identity).

    Raises:
        UsageError: unknown workflow; InfraError: as :func:`jupyter`.
    """
    wf = state.workflow(workflow)
    storage = wf["storage"].rstrip("/")
    logdir = f"{storage}/{wf['id']}"
    cmd = (command or TENSORBOARD)
    if storage.startswith("file://"):
        folder = logdir[len("file://"):]
        import os
        os.makedirs(folder, exist_ok=True)
        return _serve(LocalServer(cmd.replace("{logdir}", shlex.quote(folder)), folder),
                      what="TensorBoard")
    row = state.cluster(wf["cluster"])
    if row is None or row["provider"] == "local" or row["status"] != "up":
        return _serve(LocalServer(cmd.replace("{logdir}", shlex.quote(logdir)),
                                  str(S.home())), what="TensorBoard")
    n, conn = node_connection(state, wf["cluster"])
    server = NodeServer(conn, cmd.replace("{logdir}", shlex.quote(logdir)),
                        (n.get("info") or {}).get("root") or "~/.hyper")
    return _serve(server, conn, local_port, f"TensorBoard on {n['name']}")
