"""The ssh provider: hosts a user already has (a lab server, on-premise machines), and the base
of the cloud providers, whose nodes are SSH hosts a cloud created.

``cluster: {provider: ssh, hosts: [root@10.0.0.5:22, ...], identity_file: ~/.ssh/id_ed25519}``.
Bootstrap (``launch``) connects to every host in parallel, checks host keys against the pins
(:mod:`hypercli.ssh.hostkeys`), copies the node agent to ``~/.hyper/bin/agent-<hash>.py`` and
records what the host has (CPUs, memory, free disk, GPUs from ``nvidia-smi``, docker): its
capacity for tasks' ``resources:``, with at most one task per CPU at once (its slots). A host
that is unreachable, refuses the key or has no ``python3`` is reported on its own line; the
others go on.

Per node and workflow (:class:`SSHSession`, in the node's scheduler thread):
* the recipe's ``workdir`` is copied to ``~/.hyper/work/<workflow>``: only the contents the
  node lacks, .gitignore and .hyperignore honoured (:mod:`hypercli.workdir`); ``hyper run``
  does it for every node at once before the first task (:meth:`SSHProvider.sync_workdir`);
* before a task of an experiment with ``after`` starts, the outputs of those experiments are
  copied to the node's ``~/.hyper/outputs/<workflow>/`` (``HYPER_OUTPUTS``);
* the experiment's image is made present (:mod:`hypercli.ssh.images`);
* when attempts end, their stdout/stderr go to ``$HYPER_HOME/logs/<attempt>/`` and their output
  folders into the storage folder *before* the scheduler hears of the end, so a dependent task
  never starts without its inputs. Logs up to 64 KiB ride in the agent's poll answer; larger
  logs and output folders that are not empty come in one tar stream per batch.
"""

from __future__ import annotations

import base64
import hashlib
import io
import os
import shlex
import shutil
import stat
import tarfile
import threading
from pathlib import Path
from typing import Callable

from hypercli import state as S
from hypercli.errors import HyperError, InfraError, NodeError, UsageError
from hypercli.node.bundle import bundle, remote_python
from hypercli.node.agent import LOG_FILES
from hypercli.node.client import AgentClient, agent_source
from hypercli.providers.base import Instance, LaunchResult
from hypercli.providers.runtime import (NodeRuntime, checkpoint_name, forwarded_env,
                                       unmount_command)
from hypercli.recipe import ClusterSpec
from hypercli.ssh import images
from hypercli.ssh.conn import CONNECT_TIMEOUT, Connection, Target, tcp_silent
from hypercli.ssh.fanout import fan_out
from hypercli.ssh.hostkeys import KnownHosts
from hypercli.untar import extract

AGENT_HASH = hashlib.sha256(agent_source()).hexdigest()[:12]
AGENT_REL = f".hyper/bin/agent-{AGENT_HASH}.py"
BOOTSTRAP_TIMEOUT = 15.0  # s per connection step when first contacting a host (it may be booting)


def _targets(spec: ClusterSpec) -> list[Target]:
    o = spec.options
    try:
        return [Target.parse(h, user=o.get("user"), port=o.get("port"),
                             identity_file=os.path.expanduser(o["identity_file"])
                             if o.get("identity_file") else None) for h in o.get("hosts", [])]
    except ValueError as e:
        raise UsageError(f"cluster.hosts: {e}") from None


def _target_of(node: dict) -> Target:
    a = node["address"]
    return Target(a["host"], a["port"], a["user"], a.get("identity_file"))


def _manifest(wf: dict):
    """The workdir manifest of a workflow (:mod:`hypercli.workdir`), built once per
    process. Raises UsageError: the workdir is over its limit."""
    from hypercli import workdir
    return workdir.manifest(wf["id"], wf["workdir"], skip=S.home())


#: tar streams of ended attempts' logs and outputs fetched at most this many times when one
#: arrives cut short (seen once under load in CI: "unexpected end of data"), before the
#: attempt's collection fails
FETCH_TRIES = 3


def _untar(data: bytes, dest: Path) -> None:
    """Extract a tar that came from a node: each member checked by :func:`hypercli.untar.extract`
    (a task's output can hold anything; members that fail a check are skipped)."""
    extract(data, dest)


class SSHProvider:
    """Hosts reached over SSH (see the module docstring).

    Args:
        trust_new_hosts: pin the key of hosts seen for the first time instead of refusing them.
    """

    name = "ssh"
    remote = True

    def __init__(self, trust_new_hosts: bool = False):
        self.trust_new_hosts = trust_new_hosts
        self._conns: dict[str, Connection] = {}
        self._known: dict[str, KnownHosts] = {}
        self._lock = threading.Lock()

    def known_hosts(self, cluster: str) -> KnownHosts:
        """The cluster's pinned keys, one instance shared by all its connections."""
        with self._lock:
            if cluster not in self._known:
                self._known[cluster] = KnownHosts(cluster)
            return self._known[cluster]

    # -- connections ---------------------------------------------------------------------
    def connection(self, name: str, target: Target, cluster: str,
                   timeout: float = CONNECT_TIMEOUT) -> Connection:
        """The cached live connection to a node, (re)connecting when needed (``timeout``: s
        for each of TCP connect, banner and authentication)."""
        with self._lock:
            conn = self._conns.get(name)
        if conn is not None and conn.alive():
            return conn
        conn = Connection(name, target, self.known_hosts(cluster), trust_new=self.trust_new_hosts,
                          timeout=timeout)
        with self._lock:
            old, self._conns[name] = self._conns.get(name), conn
        if old is not None:
            old.close()
        return conn

    def drop(self, name: str) -> None:
        with self._lock:
            conn = self._conns.pop(name, None)
        if conn is not None:
            conn.close()

    # -- the contract --------------------------------------------------------------------
    def bootstrap(self, name: str, target: Target, cluster: str) -> Instance:
        """Connect, install the agent, and describe the host (``extra``: what the agent
        reports, and ``private_address``, the host it was reached at). Raises NodeError."""
        conn = self.connection(name, target, cluster, BOOTSTRAP_TIMEOUT)
        r = conn.run("command -v python3 >/dev/null || exit 127; "
                     f"mkdir -p ~/.hyper/bin && test -s ~/{AGENT_REL} && echo present; "
                     "echo $HOME", check=False)
        if r.exit_code == 127:
            raise NodeError(name, f"{target} has no python3", "install python3 on the host")
        lines = r.stdout.decode().split()
        if "present" not in lines:
            conn.run(f"cat > ~/{AGENT_REL}.tmp && mv ~/{AGENT_REL}.tmp ~/{AGENT_REL}",
                     stdin=agent_source())
        client = self.connect_conn(conn, name)
        try:
            info = client.call("hello")
        finally:
            client.close()
        info.pop("version", None)
        info["private_address"] = target.host  # where the cluster's other nodes reach it
        slots = max(1, int(info.get("cpus") or 1))  # a cap; resources decide the rest
        return Instance(name, str(target), slots, {"host": target.host, "port": target.port,
                                               "user": target.user,
                                               "identity_file": target.identity_file}, info)

    def launch(self, spec: ClusterSpec) -> LaunchResult:
        targets = _targets(spec)
        if not targets:
            raise UsageError("cluster.hosts is empty", "list the hosts: [root@10.0.0.5, ...]")
        named = {f"{spec.name}-{i}": t for i, t in enumerate(targets)}
        res = fan_out(named, lambda n: self.bootstrap(n, named[n], spec.name))
        return LaunchResult(list(res.ok.values()),
                            {str(named[n]): e for n, e in res.failed.items()})

    def connect_conn(self, conn: Connection, name: str, root: str = "~/.hyper") -> AgentClient:
        ch = conn.channel()
        # -I -S: the agent needs the standard library only; no site (~10 ms of start-up)
        ch.exec_command(f"exec python3 -I -S ~/{AGENT_REL} serve --root {shlex.quote(root)}"
                        if root != "~/.hyper" else f"exec python3 -I -S ~/{AGENT_REL} serve")
        f = ch.makefile("rb")

        def close() -> None:
            try:
                ch.shutdown_write()
            finally:
                ch.close()
        target = conn.target
        return AgentClient(name, ch.sendall, f.readline, close, ch.settimeout,
                           silent=lambda: tcp_silent(target.host, target.port))

    def connect(self, node: dict) -> AgentClient:
        cluster = node["cluster"]
        try:
            conn = self.connection(node["name"], _target_of(node), cluster)
            return self.connect_conn(conn, node["name"])
        except HyperError:
            self.drop(node["name"])
            raise

    def terminate(self, cluster: str, nodes: list[dict]) -> list[str]:
        for n in nodes:
            self.drop(n["name"])
        return [f"host {n['provider_id']} (left running: not ours)" for n in nodes]

    def task_paths(self, node: dict, wf: dict, task: str) -> tuple[str, str, str]:
        root = node["info"].get("root") or "/root/.hyper"
        outputs = f"{root}/outputs/{wf['id']}"
        return f"{root}/work/{wf['id']}", f"{outputs}/{task}", outputs

    def session(self, node: dict, wf: dict) -> "SSHSession":
        return SSHSession(self, node, wf)

    def sync_workdir(self, nodes: list[dict], wf: dict,
                     log: Callable[[str], None] = lambda s: None) -> dict:
        """Copy the workflow's workdir to every node now, all at once (what each lacks,
        :mod:`hypercli.workdir`), and say through ``log`` what was sent where. A node that
        fails is reported and left to its session, which tries again before its first task.
        Returns node name → :class:`hypercli.workdir.Sent` of the nodes done.

        Raises:
            UsageError: the workdir is over its limit (nothing is sent).
        """
        from hypercli.console import plural
        from hypercli.workdir import human
        if not wf["workdir"]:
            return {}
        m = _manifest(wf)
        log(f"workdir {m.root}: {plural(m.files, 'file')}, {human(m.bytes)}"
            + (f" ({m.ignored} ignored by .gitignore, .hyperignore and built-in rules)"
               if m.ignored else ""))
        by_name = {n["name"]: n for n in nodes}
        res = fan_out(list(by_name), lambda name: SSHSession(self, by_name[name], wf)
                      .sync_workdir(self.connection(name, _target_of(by_name[name]),
                                                    by_name[name]["cluster"])))
        for name, sent in sorted(res.ok.items()):
            if sent.current:
                log(f"  {name}: up to date")
            else:
                log(f"  {name}: sent {plural(sent.files, 'file')} ({human(sent.bytes)}), "
                    f"{sent.kept} already there")
        for name, e in sorted(res.failed.items()):
            log(f"  {name}: not sent yet ({e}); tried again before its first task")
        return dict(res.ok)

    def unmount(self, nodes: list[dict], paths: list[str]) -> list[str]:
        """Unmount the workflows' mounts on the nodes it can reach; returns what it did."""
        def one(node: dict) -> list[str]:
            conn = self.connection(node["name"], _target_of(node), node["cluster"])
            root = node["info"].get("root") or "/root/.hyper"
            return [f"mount {p} on {node['name']}" for p in paths  # only hypercli's own
                    if conn.run(unmount_command(p, root), check=False).exit_code == 0]
        res = fan_out([n["name"] for n in nodes],
                      lambda name: one(next(n for n in nodes if n["name"] == name)))
        return [line for lines in res.ok.values() for line in lines]


class SSHSession:
    """One node's side work for one workflow (module docstring); runs in the node's thread."""

    #: bytes of an ended attempt's stdout+stderr that come back inside the agent's answer
    #: (no second exec per attempt); larger logs are copied with tar
    inline_bytes = 64 << 10

    def __init__(self, provider: SSHProvider, node: dict, wf: dict):
        self.p, self.node, self.wf = provider, node, wf
        self.synced = False
        self.staged: set[str] = set()
        self.images: set[str] = set()
        self.root = node["info"].get("root") or "/root/.hyper"
        self.storage = Path(wf["storage"][7:]) if wf["storage"].startswith("file://") else None
        self.rt = NodeRuntime(node["name"], wf, self.root, remote_python(self.root), self._sh)
        self.bundled = False  # the node runtime (checkpoints, mounts, outputs) copied there
        self.mirrored: dict[str, int] = {}  # checkpoint files brought here: path → size

    def _sh(self, command: str) -> None:
        self.conn().run(command, timeout=600)

    def _ensure_bundle(self, conn: Connection) -> None:
        """Copy the node runtime there unless it is there. Asked first, sent only when
        missing: a command that exits without reading its stdin closes the channel while a
        1 MiB stdin is still being sent ("Socket is closed")."""
        digest, data = bundle()
        lib = f"{self.root}/lib/{digest}"
        if conn.run(f"test -d {lib}", check=False).exit_code != 0:
            conn.run(f"test -d {lib} || {{ mkdir -p {lib}.tmp && "
                     f"tar -C {lib}.tmp -xf - && mv {lib}.tmp {lib}; }}; cat >/dev/null",
                     stdin=data, timeout=120)
        self.bundled = True

    def conn(self) -> Connection:
        return self.p.connection(self.node["name"], _target_of(self.node), self.node["cluster"])

    def before_launch(self, specs: list[dict]) -> None:
        conn = self.conn()
        if not self.synced:
            self.sync_workdir(conn)
            self.synced = True
        if not self.bundled:
            self._ensure_bundle(conn)
        self.rt.ensure_mounts()
        for s in specs:
            if self.storage is None:
                self.rt.stage(set(s.get("after", [])), s["outputs"])
            s["finish"] = self.rt.finish_command(s["output"], s["env"]["HYPER_TASK_ID"])
            s["binds"] = self.rt.binds()
            s["env"].update(forwarded_env())
            self._checkpoint(conn, s)
        if self.storage is not None:
            for exp in {e for s in specs for e in s.get("after", [])} - self.staged:
                self._stage(conn, exp)
                self.staged.add(exp)
        for image, exp in {(s["image"], s["env"]["HYPER_EXPERIMENT"])
                           for s in specs if s.get("image")}:
            if image in self.images:
                continue
            from hypercli import registry
            creds = registry.for_workflow(self.wf, exp)  # private registry: pulled with these
            digest, _ = bundle()
            images.ensure(conn, image, creds=creds,
                          helper=f"PYTHONPATH={self.root}/lib/{digest} python3 -S")
            self.images.add(image)

    # -- checkpoints (file:// storage: kept on the node, mirrored here by the driver) ------
    def _node_store(self, task: str) -> str:
        return f"{self.root}/ckpt-store/{self.wf['id']}/{task}"

    def _checkpoint(self, conn: Connection, spec: dict) -> None:
        """The spec's checkpoint commands; with ``file://`` storage, which the node cannot
        reach, the node saves into a store of its own that :meth:`mirror_checkpoints` copies
        here, and an attempt after the first gets the newest generation copied there first."""
        if self.storage is None:
            self.rt.checkpoint(spec, spec.get("checkpoint_every", 60))
            return
        name = checkpoint_name(self.wf, spec)
        self.rt.checkpoint(spec, spec.get("checkpoint_every", 60),
                           url=f"file://{self._node_store(name)}")
        if int(spec["env"]["HYPER_ATTEMPT"]) > 1:
            self._push_checkpoint(conn, name)

    def _push_checkpoint(self, conn: Connection, name: str) -> None:
        """Copy the newest generation kept here of checkpoint ``name`` (a task, or a rank of
        one: :func:`~hypercli.providers.runtime.checkpoint_name`), its chain and the packs it
        needs, to the node."""
        from hypercli.mount.checkpoint import newest
        from hypercli.mount.outputs import checkpoint_url
        from hypercli.mount.store import open_store
        store = open_store(checkpoint_url(self.wf["storage"], self.wf["id"], name))
        found = newest(store)
        if found is None:
            return
        chain, packs = found
        base = Path(store.url[len("file://"):])
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for rel in sorted(packs) + chain[::-1]:  # the generations last, the newest last
                tar.add(str(base / rel), arcname=rel)
        d = shlex.quote(self._node_store(name))
        conn.run(f"mkdir -p {d} && tar -C {d} -xf -", stdin=buf.getvalue(), timeout=600)

    def mirror_checkpoints(self) -> int:
        """Copy here (``file://`` storage) the checkpoint files the node saved since the last
        call: packs before generations, so a generation here is always whole. Returns the
        number of files copied. Raises NodeError."""
        if self.storage is None:
            return 0
        conn = self.conn()
        top = f"{self.root}/ckpt-store/{self.wf['id']}"
        listing = conn.run(f"cd {shlex.quote(top)} 2>/dev/null && find . -type f -printf "
                           f"'%P\t%s\n' || true", timeout=60).stdout.decode()
        new = []
        for line in listing.splitlines():
            rel, _, size = line.partition("\t")
            if rel and size.isdigit() and self.mirrored.get(rel) != int(size) and \
                    "/" in rel and not rel.endswith(".tmp"):
                new.append((rel, int(size)))
        if not new:
            return 0
        new.sort(key=lambda x: ("/gen/" in x[0], x[0]))
        data = conn.run(f"cd {shlex.quote(top)} && tar -cf - " + " ".join(
            shlex.quote(r) for r, _ in new), timeout=600).stdout
        # in the order asked: packs, then generations; each member checked
        _untar(data, self.storage / self.wf["id"] / ".checkpoints")
        for rel, size in new:
            self.mirrored[rel] = size
        return len(new)

    def sync_workdir(self, conn: Connection):
        """Make ``<root>/work/<wid>`` hold the workdir, sending only the contents the node
        lacks; a folder already built from the same files is left alone (a resumed run must
        not pull it from under its re-attached attempts), a changed one is built beside it
        and swapped in (running attempts keep their folder). With ``workdir: none``, an empty
        folder. Returns :class:`hypercli.workdir.Sent` (None for none).
        Raises UsageError (over the limit), NodeError, CommandFailed."""
        from hypercli import workdir
        wid = self.wf["id"]
        if not self.wf["workdir"]:
            conn.run(f"mkdir -p {self.root}/work/{shlex.quote(wid)}")
            return None
        if not self.bundled:
            self._ensure_bundle(conn)
        digest, _ = bundle()
        python = f"PYTHONPATH={self.root}/lib/{digest} python3 -S"
        m = _manifest(self.wf)
        for tries in range(3):  # a file changed since the manifest was made: made again
            try:
                return workdir.sync(lambda cmd, data: conn.run(cmd, stdin=data,
                                                               timeout=600).stdout,
                                    python, self.root, wid, m)
            except workdir.Changed as e:
                if tries == 2:
                    raise InfraError(f"workdir file {e} keeps changing while it is sent",
                                     "leave it out with .hyperignore") from None
                m = workdir.manifest(wid, self.wf["workdir"], skip=S.home(), fresh=True)

    def _stage(self, conn: Connection, exp: str) -> None:
        if self.storage is None:
            raise InfraError(f"storage {self.wf['storage']} cannot hold outputs yet",
                             "use storage: file://PATH")
        src = self.storage / self.wf["id"]
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for d in sorted(src.glob(f"{exp}-*")) if src.exists() else []:
                if d.name[len(exp) + 1:].isdigit():  # exp "a" must not take "a-b-0000"
                    tar.add(str(d), arcname=d.name)
        outputs = f"{self.root}/outputs/{self.wf['id']}"
        conn.run(f"mkdir -p {outputs} && tar -C {outputs} -xf -", stdin=buf.getvalue(),
                 timeout=600)

    def after_end(self, states: dict[str, dict]) -> None:
        """Copy logs and outputs of ended attempts here. Logs of at most ``inline_bytes``
        came in the agent's answer (``inline``); the rest, and outputs that are not empty
        (file:// storage only; each is kept by :func:`_keep_output`: the ranks of one
        attempt merged, a later attempt's replacing an earlier one's), come in one tar stream
        over a second exec. Raises NodeError."""
        ids = [a for a, st in states.items() if st["state"] != "unknown"]
        if any(not (states[a].get("inline") or {}).get("checkpoint_empty") for a in ids):
            # the last save of these attempts, before a retry; an attempt that wrote nothing
            # in HYPER_CHECKPOINT saved nothing (one exec per ended batch saved per task)
            self.mirror_checkpoints()
        if not ids:
            return
        wid = self.wf["id"]
        tasks = {a: a[len(wid) + 1:].rsplit(".", 1)[0] for a in ids}  # <workflow>.<task>.<n>
        logs = S.folder("logs")
        fetch = []
        for a in ids:
            inline = states[a].get("inline") or {}
            if "stdout" in inline:
                _save_logs(logs / a, inline)
            else:
                fetch.append(a)
        wanted = {}
        if self.storage is not None:
            for a, t in tasks.items():
                st = states[a]
                if st.get("state") != "exited" or st.get("code") != 0:
                    continue
                if (st.get("inline") or {}).get("output_empty"):
                    _keep_output(self.storage / wid, t, None, a)  # as a local node leaves it
                else:
                    wanted[a] = t
        if not fetch and not wanted:
            return
        paths = [f"tasks/{a}/{s}" for a in fetch for s in LOG_FILES]
        paths += [f"outputs/{wid}/{t}" for t in wanted.values()]
        cmd = (f"cd {self.root} && tar -cf - --ignore-failed-read "
               + " ".join(shlex.quote(p) for p in paths) + " 2>/dev/null; true")
        tmp = logs / f".incoming-{os.getpid()}-{threading.get_ident()}"
        try:
            for attempt in range(FETCH_TRIES):
                data = self.conn().run(cmd, timeout=600).stdout
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True, exist_ok=True)
                try:
                    if data:
                        _untar(data, tmp)
                    break
                except (tarfile.TarError, EOFError):  # a stream cut short: fetch it again
                    if attempt == FETCH_TRIES - 1:
                        raise
            for a in fetch:
                src = tmp / "tasks" / a
                if src.exists():
                    dest = logs / a
                    dest.mkdir(parents=True, exist_ok=True)
                    for f in src.iterdir():
                        os.replace(f, dest / f.name)
            for a, t in wanted.items():
                src = tmp / "outputs" / wid / t
                if src.is_dir() and not src.is_symlink():
                    _keep_output(self.storage / wid, t, src, a)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


_KEEP_LOCK = threading.Lock()  # the ranks of one attempt end on different nodes' threads


def _keep_output(root: Path, name: str, src: Path | None, attempt_id: str) -> None:
    """Put the output folder ``src`` (None: the attempt's output was empty) that attempt
    ``attempt_id`` left on its node into storage as task output ``root/name``, as the node's
    agent does in its outputs root (:func:`hypercli.node.agent._promote`): which attempt
    (:func:`~hypercli.node.agent.attempt_of`) the output holds is kept in hypercli's own
    folder ``owners`` (not in storage, whose folders are the tasks' outputs only); another
    rank of that attempt merges into it (a name there is kept), a later attempt replaces it
    whole (made by hypercli), an earlier one's is dropped; an output of no known attempt is merged into, never removed;
    a symlink or file in its place is left and nothing is kept. Nothing is followed through
    a symlink. Raises OSError."""
    from hypercli.node.agent import attempt_of, later_attempt, output_owner, own_output
    owner, owners = attempt_of(attempt_id), S.folder("owners")
    root.mkdir(parents=True, exist_ok=True)
    with _KEEP_LOCK:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                st = None
            if st is not None and not stat.S_ISDIR(st.st_mode):
                return
            was = output_owner(owners, root / name)
            if st is not None and was not in (None, owner) and not later_attempt(owner, was):
                return  # a later attempt's output is there: this success changes nothing
            if st is not None and was is not None and was != owner:  # an earlier attempt's
                old = f".replaced-{name}-{os.getpid()}"
                os.rename(name, old, src_dir_fd=fd, dst_dir_fd=fd)
                shutil.rmtree(old, dir_fd=fd, ignore_errors=True)
                st = None
            if st is None:
                own_output(owners, root / name, owner)
                if src is None:
                    os.mkdir(name, 0o755, dir_fd=fd)
                else:
                    os.rename(src, name, dst_dir_fd=fd)
                return
            if src is None:
                return
            b = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                        dir_fd=fd)
            try:
                for entry in os.listdir(src):
                    try:
                        os.stat(entry, dir_fd=b, follow_symlinks=False)
                    except FileNotFoundError:
                        os.rename(src / entry, entry, dst_dir_fd=b)
            finally:
                os.close(b)
        finally:
            os.close(fd)


def _save_logs(dest: Path, inline: dict) -> None:
    """Write an attempt's logs that came inline (base64 ``stdout``/``stderr``/``order``) into
    ``dest``, each file atomically. An empty stream gets no file (the folder alone says the
    logs were brought back): each file made costs ~0.1 ms on a VM's disk, per attempt."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in LOG_FILES:
        data = base64.b64decode(inline.get(name) or "")
        if not data:
            continue
        tmp = dest / f".{name}.{threading.get_ident()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dest / name)


def make_provider(trust_new_hosts: bool = False, **_) -> SSHProvider:
    return SSHProvider(trust_new_hosts=trust_new_hosts)
