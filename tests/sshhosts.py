"""Real SSH test hosts for pytest: stand-ins for cloud VMs.

Each host is an OpenSSH server running as PID 1 of its own PID, mount, UTS and IPC namespaces,
inside its own network namespace, plugged into a bridge of 10.213.0.0/24 (the test process
reaches it at 10.213.0.1). It has a private /root, /tmp, /var/tmp, /etc/ssh,
/var/lib/containers and /etc/containers (bind mounts of a per-host folder, so they survive a
restart) and a private tmpfs /run and /dev/shm (lost at power loss, as on a VM). ``docker`` in
a host is podman with its own image store per host.

    pool = HostPool()                 # or the ``ssh_hosts`` fixture, which is a HostPool
    h1, h2 = pool.start(2)            # ~0.1 s per host, in parallel
    paramiko: connect(h1.ip, h1.port, "root", key_filename=pool.client_key), known hosts in
              pool.known_hosts
    h1.kill() / h1.restart()          # power loss / power back (same folders, ip, host key)
    h1.cut() / h1.heal()              # silent network partition
    h1.freeze() / h1.thaw()           # hung host (every process stopped)
    h1.run("ls /tmp")                 # a shell command inside the host, not over SSH
    pool.stop()

GPUs: ``pool.start(2, gpus=[2, 4])`` or ``h1.set_gpus(4, memory_mib=81920)`` puts a stand-in
``nvidia-smi`` in the host's own /usr/local/sbin (a per-host folder bound over it, first on
sshd's PATH for root), answering ``-L`` and ``--query-gpu=... --format=csv,...`` as the real
tool does; hosts without GPUs have no ``nvidia-smi``. For the local provider,
``write_nvidia_smi(folder, 2)`` writes the same stand-in into a folder to put first on PATH.

Needs root, Linux, ``sshd``, ``ssh-keygen``, ``unshare``, ``nsenter`` and ``ip``; the
fixtures skip the test otherwise. Containers also need podman, runc and busybox-static.
Everything a pool creates is found again by PID or by name (never ``pkill`` by pattern), and a
pool left behind by a test process that died is cleaned up by the next pool.
"""

from __future__ import annotations

import atexit
import fcntl
import hashlib
import itertools
import json
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SUBNET = "10.213.0"
BRIDGE = "hyperbr0"                 # shared by every pool on the machine (one /24)
BRIDGE_IP = f"{SUBNET}.1"
BRIDGE_TAG = "hypercli-sshhosts"    # link alias: marks a bridge this module created
FIRST_OCTET, LAST_OCTET = 11, 254
STATE_DIR = Path("/run/hypercli-sshhosts")   # IP claims of live pools, one file per IP
SSHD = "/usr/sbin/sshd"
HOST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
TINY_IMAGE = "localhost/hyper-tiny:latest"

CONTAINERS_CONF = """\
[containers]
netns = "host"
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
"""

STORAGE_CONF = """\
[storage]
driver = "overlay"
graphroot = "/var/lib/containers/storage"
runroot = "/run/containers/storage"
"""

DOCKER_SHIM = ("#!/bin/sh\n# docker on a test host is podman (tests/sshhosts.py)\n"
               "exec /usr/bin/podman \"$@\"\n")

NVIDIA_SMI = "nvidia-smi"
GPU_NAME = "NVIDIA A100-SXM4-40GB"
GPU_MEMORY_MIB = 40960
DRIVER_VERSION = "535.129.03"

_seq = itertools.count()
_live_pools: weakref.WeakSet = weakref.WeakSet()


# ---------------------------------------------------------------------------------- helpers

def missing_requirements(containers: bool = False) -> str | None:
    """Why SSH test hosts cannot run here, or None when they can."""
    if not hasattr(os, "geteuid") or not Path("/proc/self/ns/pid").exists():
        return "SSH test hosts need Linux namespaces"
    if os.geteuid() != 0:
        return "SSH test hosts need root (network, PID and mount namespaces)"
    need = {"sshd": SSHD, "ssh-keygen": "ssh-keygen", "unshare": "unshare",
            "nsenter": "nsenter", "ip": "ip"}
    if containers:
        need.update(podman="podman", runc="runc", busybox="busybox")
    missing = [name for name, exe in need.items() if not shutil.which(exe)]
    if missing:
        return (f"SSH test hosts need {', '.join(missing)} "
                "(scripts/deps.sh installs them as root)")
    return None


def _sh(*args: str, check: bool = True, input: str | None = None,
        timeout: float = 30) -> subprocess.CompletedProcess:
    p = subprocess.run(list(args), input=input, capture_output=True, text=True, timeout=timeout)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(args)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


def _ip_batch(lines: list[str], netns: str | None = None, check: bool = True) -> None:
    if lines:
        _sh("ip", *(["-n", netns] if netns else []), "-force", "-batch", "-",
            input="\n".join(lines) + "\n", check=check)


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def _start_time(pid: int) -> str | None:
    """Start time of a process (field 22 of /proc/PID/stat): tells a PID reused from a dead one."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _ns_id(pid: int, ns: str) -> str | None:
    try:
        return os.readlink(f"/proc/{pid}/ns/{ns}")
    except OSError:
        return None


def _pids() -> list[int]:
    return [int(d) for d in os.listdir("/proc") if d.isdigit()]


def _pids_in_ns(ns: str, ident: str) -> list[int]:
    return [p for p in _pids() if p != os.getpid() and _ns_id(p, ns) == ident]


def _proc_state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _listening(pid: int, ip: str, port: int) -> bool:
    """True when a socket of pid's network namespace listens on ip:port (no packet sent)."""
    want = "%08X:%04X" % (int.from_bytes(bytes(map(int, ip.split("."))), "little"), port)
    try:
        lines = Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]
    except OSError:
        return False
    return any(f.split()[1] == want and f.split()[3] == "0A" for f in lines)


def _mac(ip: str) -> str:
    """The fixed MAC of a host's eth0 (unique because its IP is)."""
    return "02:68:79:00:00:%02x" % int(ip.rsplit(".", 1)[1])


def _remove_container_cgroups(storage: Path) -> None:
    """rmdir the cgroups runc made for the containers of one dead host (cgroupfs manager:
    /sys/fs/cgroup[/CONTROLLER]/libpod_parent/libpod-ID). The shared parents stay."""
    ids = [d.name for d in (storage / "overlay-containers").glob("*") if len(d.name) == 64]
    for cid in ids:
        for d in [*Path("/sys/fs/cgroup").glob(f"*/libpod_parent/libpod-{cid}"),
                  *Path("/sys/fs/cgroup").glob(f"libpod_parent/libpod-{cid}")]:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:             # EBUSY while the last task is being released
                    time.sleep(0.01)


def _keygen(path: Path, comment: str) -> subprocess.Popen:
    return subprocess.Popen(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment,
                             "-f", str(path)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def _wait_all(procs: list[subprocess.Popen], what: str) -> None:
    for p in procs:
        _, err = p.communicate(timeout=30)
        if p.returncode != 0:
            raise RuntimeError(f"{what} failed: {err.decode(errors='replace').strip()}")


@contextmanager
def _state_lock():
    """Machine-wide lock over the bridge and the IP claims (pools in other processes too)."""
    STATE_DIR.mkdir(mode=0o700, parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _claims() -> dict[str, dict]:
    out = {}
    for f in STATE_DIR.glob(f"{SUBNET}.*"):
        try:
            out[f.name] = json.loads(f.read_text())
        except (OSError, ValueError):
            out[f.name] = {}
    return out


def _kill_netns_processes(netns: str) -> None:
    try:
        ident = "net:[%d]" % os.stat(f"/run/netns/{netns}").st_ino
    except OSError:
        return
    for pid in _pids_in_ns("net", ident):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _reap_stale_claims() -> None:
    """Remove what pools of dead test processes left: processes, veths, netns, folders.
    Call under _state_lock()."""
    for ip, c in _claims().items():
        owner = c.get("owner_pid")
        if owner and _start_time(owner) == c.get("owner_start"):
            continue                                    # its pool is alive
        if c.get("netns"):
            _kill_netns_processes(c["netns"])
        if c.get("veth") and _link_exists(c["veth"]):
            _sh("ip", "link", "del", c["veth"], check=False)
        if _link_exists(BRIDGE):
            _sh("ip", "neigh", "del", ip, "dev", BRIDGE, check=False)
        if c.get("netns") and Path("/run/netns", c["netns"]).exists():
            _sh("ip", "netns", "del", c["netns"], check=False)
        base = c.get("base")
        if base and Path(base).name.startswith("hyper-sshhosts-"):
            for storage in Path(base).glob("*/containers/storage"):
                _remove_container_cgroups(storage)
            shutil.rmtree(base, ignore_errors=True)
        (STATE_DIR / ip).unlink(missing_ok=True)


def _ensure_bridge() -> bool:
    """Create the shared bridge unless it exists; True when created now. Under _state_lock()."""
    if _link_exists(BRIDGE):
        return False
    _ip_batch([f"link add {BRIDGE} type bridge stp_state 0 forward_delay 0",
               f"link set {BRIDGE} alias {BRIDGE_TAG}",
               f"addr add {BRIDGE_IP}/24 dev {BRIDGE}",
               f"link set {BRIDGE} up"])
    return True


def _remove_bridge_if_unused(created: bool) -> None:
    """Delete the bridge when no pool claims an IP any more and this module made it (the pool
    that created it, or the last user of one another pool created). Under _state_lock()."""
    if _claims() or not _link_exists(BRIDGE):
        return
    try:
        alias = Path(f"/sys/class/net/{BRIDGE}/ifalias").read_text().strip()
    except OSError:
        alias = ""
    if created or alias == BRIDGE_TAG:
        _sh("ip", "link", "del", BRIDGE, check=False)


# ------------------------------------------------------------------------------------ hosts

@dataclass(eq=False)
class TestHost:
    """One SSH test host. ``pid`` is its init (sshd) in the root PID namespace; 0 when down."""

    __test__ = False                  # not a pytest test class

    name: str
    ip: str
    port: int
    user: str
    pid: int
    root: Path
    host_key_line: str
    netns: str = field(repr=False, default="")
    veth: str = field(repr=False, default="")
    gpus: int = 0                     # GPUs its nvidia-smi stand-in reports (set_gpus)
    #: folders of this machine the host sees at the same paths, read-only (start's ``share``:
    #: e.g. this Python's site-packages, which a clone under /tmp or /root would hide)
    share: tuple = ()
    _proc: subprocess.Popen | None = field(repr=False, default=None)
    _pidns: str | None = field(repr=False, default=None)

    def address(self) -> str:
        return f"{self.user}@{self.ip}:{self.port}"

    @property
    def alive(self) -> bool:
        return bool(self.pid) and self._proc is not None and self._proc.poll() is None

    @property
    def log(self) -> Path:
        """sshd's log (``-e``: everything it would send to syslog)."""
        return self.root / "sshd.log"

    # power ---------------------------------------------------------------------------------
    def _launch(self) -> None:
        r = self.root
        bind = [(r / "etc-ssh", "/etc/ssh"), (r / "home", "/root"), (r / "var-tmp", "/var/tmp")]
        if shutil.which("podman"):
            bind += [(r / "containers", "/var/lib/containers"),
                     (r / "etc-containers", "/etc/containers")]
            if Path("/usr/local/bin/docker").exists():
                bind.append((r / "bin" / "docker", "/usr/local/bin/docker"))
        # per host, first on PATH: the docker shim (when no docker is installed) and the
        # nvidia-smi stand-in of a host with GPUs (set_gpus)
        bind.append((r / "sbin", "/usr/local/sbin"))
        bind.append((r / "tmp", "/tmp"))           # last: the per-host folder may be under /tmp
        script = [
            "set -e",
            f"hostname {shlex.quote(self.name)}",
            "mount -t tmpfs -o mode=755,nosuid,nodev tmpfs /run",
            "mkdir -p -m 755 /run/sshd /run/lock",
            "mount -t tmpfs -o mode=1777,nosuid,nodev tmpfs /dev/shm",
            # mount points podman's package would make anyway (empty folders, root fs)
            "mkdir -p /var/lib/containers /etc/containers /usr/local/sbin",
            # shared folders: held at /run/share-N before /tmp and /root are covered
            *(f"mkdir -p /run/share-{i} && mount --bind {shlex.quote(str(src))} /run/share-{i}"
              for i, src in enumerate(self.share)),
            *(f"mount --bind {shlex.quote(str(src))} {dst}" for src, dst in bind),
            *(f"mkdir -p {shlex.quote(str(src))} && mount --bind /run/share-{i} "
              f"{shlex.quote(str(src))} && mount -o remount,bind,ro {shlex.quote(str(src))}"
              for i, src in enumerate(self.share)),
            "cd /",
            f"exec {SSHD} -D -e -f /etc/ssh/sshd_config",
        ]
        with open(self.log, "ab") as log:
            self._proc = subprocess.Popen(
                ["nsenter", f"--net=/run/netns/{self.netns}",
                 "unshare", "--mount", "--pid", "--uts", "--ipc", "--kill-child",
                 "--mount-proc", "--propagation", "private",
                 "/bin/sh", "-c", "\n".join(script)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, cwd="/",
                env={"PATH": HOST_PATH, "HOME": "/root", "LANG": "C.UTF-8"},
                start_new_session=True)
        self.pid = 0
        self._pidns = None

    def _poll_ready(self) -> bool:
        """One readiness check: init found, sshd exec'd and listening."""
        if self._proc is None or self._proc.poll() is not None:
            tail = self.log.read_text(errors="replace")[-2000:] if self.log.exists() else ""
            raise RuntimeError(f"host {self.name} exited during start:\n{tail}")
        if not self.pid:
            upid = self._proc.pid
            try:
                kids = Path(f"/proc/{upid}/task/{upid}/children").read_text().split()
            except OSError:
                return False
            if not kids:
                return False
            self.pid = int(kids[0])
        if not _listening(self.pid, self.ip, self.port):
            return False
        self._pidns = _ns_id(self.pid, "pid")
        return True

    def _wait_ready(self, timeout: float = 20) -> None:
        end = time.monotonic() + timeout
        while not self._poll_ready():
            if time.monotonic() > end:
                raise RuntimeError(f"host {self.name}: sshd not listening after {timeout}s")
            time.sleep(0.003)

    def kill(self, timeout: float = 20) -> None:
        """Power loss: SIGKILL the host's init; the kernel kills every process of the host
        (containers included). Returns once all of them are gone."""
        if self._proc is None:
            return
        pidns = self._pidns or (_ns_id(self.pid, "pid") if self.pid else None)
        if self.pid:
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        else:                           # still starting: unshare --kill-child takes it down
            self._proc.kill()
        try:
            self._proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        end = time.monotonic() + timeout
        while pidns and _pids_in_ns("pid", pidns):
            if time.monotonic() > end:
                raise RuntimeError(f"host {self.name}: processes left after kill")
            time.sleep(0.01)
        self._proc = None
        self.pid = 0
        self._pidns = None
        _remove_container_cgroups(self.root / "containers" / "storage")

    def restart(self, timeout: float = 20) -> None:
        """Power back after a loss: same folders, IP and host key; fresh /run and /dev/shm.
        Kills the host first if it is still up."""
        if self._proc is not None:
            self.kill()
        self._launch()
        self._wait_ready(timeout)

    # network ------------------------------------------------------------------------------
    def cut(self) -> None:
        """Silent network partition: packets to and from the host are dropped, nobody is told."""
        _sh("ip", "link", "set", self.veth, "down")

    def heal(self) -> None:
        _sh("ip", "link", "set", self.veth, "up")

    # hang ---------------------------------------------------------------------------------
    def processes(self) -> list[int]:
        """PIDs (root namespace) of every process of the host, its init first."""
        if not self._pidns:
            return []
        rest = [p for p in _pids_in_ns("pid", self._pidns) if p != self.pid]
        return ([self.pid] if self.pid else []) + rest

    def freeze(self) -> None:
        """Hung host: SIGSTOP every process of it (init first, so it forks nothing new)."""
        for _ in range(50):
            # zombies cannot stop (nor be reaped by a stopped parent): they count as stopped
            running = [p for p in self.processes()
                       if _proc_state(p) not in ("T", "t", "Z", "X", None)]
            if not running:
                return
            for p in running:
                try:
                    os.kill(p, signal.SIGSTOP)
                except ProcessLookupError:
                    pass
            time.sleep(0.002)
        raise RuntimeError(f"host {self.name}: could not stop all its processes")

    def thaw(self) -> None:
        for p in self.processes():
            try:
                os.kill(p, signal.SIGCONT)
            except ProcessLookupError:
                pass

    # GPUs -------------------------------------------------------------------------------
    def set_gpus(self, count: int, memory_mib: int | list[int] = GPU_MEMORY_MIB, *,
                 name: str | list[str] = GPU_NAME, utilization: int | list[int] = 0,
                 memory_used_mib: int | list[int] = 0, temperature_c: int | list[int] = 34,
                 power_w: float | list[float] = 55.0) -> None:
        """Give the host ``count`` GPUs: a stand-in ``nvidia-smi`` in its own /usr/local/sbin
        (see nvidia_smi_script), with UUIDs unique to this host; 0 removes it (no nvidia-smi).
        Works up or down, and takes effect at once; kept over restart()."""
        write_nvidia_smi(self.root / "sbin", count, memory_mib, name=name,
                         utilization=utilization, memory_used_mib=memory_used_mib,
                         temperature_c=temperature_c, power_w=power_w,
                         uuid_seed=str(self.root))
        self.gpus = count

    # inspection ---------------------------------------------------------------------------
    def run(self, cmd: str, *, timeout: float = 60, check: bool = False,
            input: str | bytes | None = None, stdin=None) -> subprocess.CompletedProcess:
        """Run ``sh -c cmd`` inside the host (its mount, PID, network, UTS and IPC namespaces;
        cwd /root; a clean root environment), not over SSH. stdout/stderr are str.
        ``stdin`` may be an open file (e.g. an image tar for ``docker load``)."""
        if not self.pid:
            raise RuntimeError(f"host {self.name} is down")
        if isinstance(input, str):
            input = input.encode()
        p = subprocess.run(
            ["nsenter", "-t", str(self.pid), "-m", "-p", "-n", "-u", "-i", "--wdns=/root",
             "/bin/sh", "-c", cmd],
            input=input, stdin=None if input is not None else
            (stdin if stdin is not None else subprocess.DEVNULL), capture_output=True,
            timeout=timeout, cwd="/",
            env={"PATH": HOST_PATH, "HOME": "/root", "USER": "root", "LOGNAME": "root",
                 "LANG": "C.UTF-8", "TERM": "dumb"})
        p = subprocess.CompletedProcess(p.args, p.returncode,
                                        p.stdout.decode(errors="replace"),
                                        p.stderr.decode(errors="replace"))
        if check and p.returncode != 0:
            raise AssertionError(f"{self.name}: {cmd!r} exited {p.returncode}:\n"
                                 f"{p.stdout}\n{p.stderr}")
        return p


# ------------------------------------------------------------------------------------- pool

class HostPool:
    """Starts and stops SSH test hosts. ``pool(n)`` is ``pool.start(n)``.

    client_key: ed25519 private key (OpenSSH format, paramiko-loadable) authorized on every
    host; known_hosts: a known_hosts file listing every started host's key.
    Pass ``client_key`` to share one key between pools (the ``.pub`` beside it is used)."""

    def __init__(self, client_key: Path | None = None, base: Path | None = None):
        reason = missing_requirements()
        if reason:
            raise RuntimeError(reason)
        self.seq = next(_seq)
        self.base = Path(base or tempfile.mkdtemp(prefix="hyper-sshhosts-"))
        self.base.mkdir(parents=True, exist_ok=True)
        self.hosts: list[TestHost] = []
        self.known_hosts = self.base / "known_hosts"
        self.known_hosts.write_text("")
        self.created_bridge = False
        self._lock = threading.Lock()
        self._stopped = False
        if client_key is None:
            client_key = self.base / "client_key"
            _wait_all([_keygen(client_key, "hyper-test-client")], "ssh-keygen")
        self.client_key = Path(client_key)
        self.client_pub = Path(str(client_key) + ".pub")
        _live_pools.add(self)

    def __call__(self, n: int, **kw) -> list[TestHost]:
        return self.start(n, **kw)

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, n: int, names: list[str] | None = None, timeout: float = 20,
              gpus: int | list[int] | None = None, share: tuple = ()) -> list[TestHost]:
        """Start n hosts in parallel; returns them once every sshd listens. ``gpus``: GPUs of
        each host (one number for all, or one per host), as ``TestHost.set_gpus`` gives.
        ``share``: folders of this machine each host sees read-only at the same path."""
        with self._lock:
            if self._stopped:
                raise RuntimeError("pool stopped")
            names = names or [f"h{len(self.hosts) + i + 1}" for i in range(n)]
            assert len(names) == n, "one name per host"
            per_host = [gpus or 0] * n if not isinstance(gpus, (list, tuple)) else list(gpus)
            assert len(per_host) == n, "one GPU count per host"
            me, me_start = os.getpid(), _start_time(os.getpid())
            hosts: list[TestHost] = []
            with _state_lock():
                _reap_stale_claims()
                taken = _claims()
                free = [o for o in range(FIRST_OCTET, LAST_OCTET + 1)
                        if f"{SUBNET}.{o}" not in taken]
                if len(free) < n:
                    raise RuntimeError(f"only {len(free)} test host addresses left")
                self.created_bridge |= _ensure_bridge()
                for name, octet in zip(names, free):
                    ip = f"{SUBNET}.{octet}"
                    h = TestHost(name=name, ip=ip, port=22, user="root", pid=0,
                                 root=self.base / f"{name}-{octet}", host_key_line="",
                                 netns=f"hyper-{me}-{name}-{octet}", veth=f"hv{me:x}-{octet}",
                                 share=tuple(str(p) for p in share))
                    assert len(h.veth) <= 15
                    (STATE_DIR / ip).write_text(json.dumps(
                        {"owner_pid": me, "owner_start": me_start, "netns": h.netns,
                         "veth": h.veth, "base": str(self.base)}))
                    hosts.append(h)
            self.hosts += hosts
            try:
                self._prepare(hosts)
                for h, g in zip(hosts, per_host):
                    if g:
                        h.set_gpus(g)
                for h in hosts:
                    h._launch()
                end = time.monotonic() + timeout
                waiting = list(hosts)
                while waiting:
                    waiting = [h for h in waiting if not h._poll_ready()]
                    if waiting and time.monotonic() > end:
                        raise RuntimeError(f"hosts not ready after {timeout}s: "
                                           f"{[h.name for h in waiting]}")
                    time.sleep(0.003)
            except BaseException:
                self._stop_hosts(hosts)
                raise
            self.known_hosts.write_text("".join(h.host_key_line + "\n" for h in self.hosts))
            return hosts

    def _prepare(self, hosts: list[TestHost]) -> None:
        """Per-host folders, host keys and network namespaces (done once per host)."""
        keygens = []
        for h in hosts:
            r = h.root
            for d in ("etc-ssh", "home", "tmp", "var-tmp", "containers", "etc-containers",
                      "bin", "sbin"):
                (r / d).mkdir(parents=True, exist_ok=True)
            (r / "tmp").chmod(0o1777)
            (r / "var-tmp").chmod(0o1777)
            (r / "home").chmod(0o700)
            (r / "home" / ".bashrc").write_text("")
            (r / "home" / ".profile").write_text("")
            keygens.append(_keygen(r / "etc-ssh" / "ssh_host_ed25519_key", f"root@{h.name}"))
        network = []
        for h in hosts:
            network += [f"netns add {h.netns}",
                        f"link add {h.veth} type veth peer name eth0 address {_mac(h.ip)}"
                        f" netns {h.netns}",
                        f"link set {h.veth} master {BRIDGE}",
                        f"link set {h.veth} up",
                        # no ARP for it: when cut, packets vanish instead of failing fast
                        # with "No route to host" as they would once ARP gives up
                        f"neigh replace {h.ip} lladdr {_mac(h.ip)} dev {BRIDGE} nud permanent"]
        _ip_batch(network)
        inside = [subprocess.Popen(
            ["ip", "-n", h.netns, "-batch", "-"], stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for h in hosts]
        for h, p in zip(hosts, inside):
            p.stdin.write(f"link set lo up\naddr add {h.ip}/24 dev eth0\nlink set eth0 up\n"
                          .encode())
            p.stdin.close()
            p.stdin = None
        for h in hosts:
            r = h.root
            etc = r / "etc-ssh"
            for f in ("moduli", "ssh_config"):
                if Path("/etc/ssh", f).is_file():
                    shutil.copy(Path("/etc/ssh", f), etc / f)
            shutil.copy(self.client_pub, etc / "authorized_keys")
            (etc / "sshd_config").write_text(
                f"ListenAddress {h.ip}:{h.port}\n"
                "HostKey /etc/ssh/ssh_host_ed25519_key\n"
                "AuthorizedKeysFile /etc/ssh/authorized_keys\n"
                "PidFile none\n"
                "PermitRootLogin prohibit-password\n"
                "PasswordAuthentication no\n"
                "KbdInteractiveAuthentication no\n"
                "UsePAM no\n"
                "StrictModes no\n"
                "UseDNS no\n"
                "PrintMotd no\n"
                "MaxSessions 200\n"
                "MaxStartups 200:30:400\n"
                "AcceptEnv LANG LC_*\n"
                "Subsystem sftp internal-sftp\n")
            if Path("/etc/containers").is_dir():
                shutil.copytree("/etc/containers", r / "etc-containers", dirs_exist_ok=True,
                                symlinks=True)
            (r / "etc-containers" / "containers.conf").write_text(CONTAINERS_CONF)
            (r / "etc-containers" / "storage.conf").write_text(STORAGE_CONF)
            # what the machine has in /usr/local/sbin stays visible in the host's own copy
            if Path("/usr/local/sbin").is_dir():
                shutil.copytree("/usr/local/sbin", r / "sbin", dirs_exist_ok=True, symlinks=True,
                                ignore=shutil.ignore_patterns(NVIDIA_SMI))
            shim = r / ("bin" if Path("/usr/local/bin/docker").exists() else "sbin") / "docker"
            if shim.parent.name == "bin" or shutil.which("podman"):
                shim.write_text(DOCKER_SHIM)
                shim.chmod(0o755)
        _wait_all(inside, "network namespace setup")
        _wait_all(keygens, "ssh-keygen")
        for h in hosts:
            pub = (h.root / "etc-ssh" / "ssh_host_ed25519_key.pub").read_text().split()
            h.host_key_line = f"{h.ip} {pub[0]} {pub[1]}" if h.port == 22 else \
                f"[{h.ip}]:{h.port} {pub[0]} {pub[1]}"

    def _stop_hosts(self, hosts: list[TestHost]) -> None:
        errors = []
        for h in hosts:
            try:
                h.kill()
            except Exception as e:       # go on: the network and claims must go anyway
                errors.append(e)
        with _state_lock():
            for h in hosts:
                _kill_netns_processes(h.netns)   # e.g. a process someone nsenter'ed in
            _ip_batch([f"link del {h.veth}" for h in hosts if _link_exists(h.veth)],
                      check=False)
            if _link_exists(BRIDGE):
                _ip_batch([f"neigh del {h.ip} dev {BRIDGE}" for h in hosts], check=False)
            _ip_batch([f"netns del {h.netns}" for h in hosts
                       if Path("/run/netns", h.netns).exists()], check=False)
            for h in hosts:
                (STATE_DIR / h.ip).unlink(missing_ok=True)
            _remove_bridge_if_unused(self.created_bridge)
        for h in hosts:
            shutil.rmtree(h.root, ignore_errors=True)
        if errors:
            raise errors[0]

    def stop(self) -> None:
        """Stop every host (by PID), delete veths then netns, the bridge when unused and
        made here, and the temp folders."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            try:
                self._stop_hosts(self.hosts)
            finally:
                shutil.rmtree(self.base, ignore_errors=True)

    def leftovers(self) -> list[str]:
        """What of this pool still exists on the machine (empty after stop())."""
        out = []
        netns = set(_sh("ip", "netns", "list").stdout.split())
        mounts = Path("/proc/self/mountinfo").read_text()
        for h in self.hosts:
            if h.netns in netns:
                out.append(f"netns {h.netns}")
            if h.netns in mounts:
                out.append(f"mount of {h.netns}")
            if _link_exists(h.veth):
                out.append(f"veth {h.veth}")
            if h._pidns and _pids_in_ns("pid", h._pidns):
                out.append(f"processes of {h.name}")
            if _claims().get(h.ip, {}).get("netns") == h.netns:  # not a later pool's claim
                out.append(f"claim {h.ip}")
        if str(self.base) in mounts:
            out.append(f"mount under {self.base}")
        if self.base.exists():
            out.append(f"folder {self.base}")
        return out


@atexit.register
def _stop_forgotten_pools() -> None:
    for pool in list(_live_pools):
        try:
            pool.stop()
        except Exception:
            pass


# ------------------------------------------------------------------------- nvidia-smi stand-in

_SMI_TEMPLATE = r"""#!/bin/sh
# Stand-in for nvidia-smi (tests/sshhosts.py): @COUNT@ GPU(s) and no driver. It answers, in the
# real tool's formats:
#   nvidia-smi -L
#   nvidia-smi --query-gpu=FIELD,... --format=csv[,noheader][,nounits] [-i|--id=INDEX,...]
#   nvidia-smi                      (a short summary table)
# FIELDs: index, name|gpu_name, uuid|gpu_uuid, memory.total, memory.used, memory.free,
# utilization.gpu, temperature.gpu, power.draw, count, driver_version, pci.bus_id|gpu_bus_id.
# Anything else fails with the real tool's message on stdout and exit status 2.
# index|name|uuid|memory.total|memory.used|utilization.gpu|pci.bus_id|temperature.gpu|power.draw
GPUS='@ROWS@'
DRIVER='@DRIVER@'
bad() { echo "Invalid combination of input arguments. Please run 'nvidia-smi -h' for help."
        echo; exit 2; }
list= query= format= ids= more=
while [ $# -gt 0 ]; do
  case $1 in
    -L|--list-gpus) list=1;;
    --query-gpu=*) query=${1#--query-gpu=}; [ -n "$query" ] || bad;;
    --format=*) format=${1#--format=}; [ -n "$format" ] || bad;;
    -i|--id) [ $# -ge 2 ] || bad; shift; ids=$1;;
    --id=*) ids=${1#--id=};;
    -h|--help) echo "NVIDIA System Management Interface -- v$DRIVER (stand-in)"; echo
               echo "    -L,   --list-gpus    Display a list of GPUs connected to the system."
               echo "    --query-gpu=         Information about GPU."
               echo "    --format=            csv, noheader, nounits"
               exit 0;;
    *) echo "ERROR: Option $1 is not recognized. Please run 'nvidia-smi -h' for help."; echo
       exit 2;;
  esac
  shift
done
if [ -n "$ids" ]; then
  old_ifs=$IFS; IFS=,
  for i in $ids; do
    printf '%s\n' "$GPUS" | awk -F'|' -v i="$i" '$1 == i || $3 == i { f = 1 } END { exit !f }' \
      || { echo "No devices were found"; exit 6; }
  done
  IFS=$old_ifs
fi
rows() { printf '%s\n' "$GPUS" | awk -F'|' -v ids=",$ids," \
  'ids == ",," || index(ids, "," $1 ",") || index(ids, "," $3 ",")'; }
if [ -n "$list" ]; then
  [ -z "$query$format" ] || bad
  rows | awk -F'|' '{ printf "GPU %s: %s (UUID: %s)\n", $1, $2, $3 }'
  exit 0
fi
if [ -z "$query" ]; then
  [ -z "$format" ] || bad
  echo "+---------------------------------------------------------------------------------------+"
  printf '| NVIDIA-SMI %-18s Driver Version: %-18s CUDA Version: 12.2   |\n' "$DRIVER" "$DRIVER"
  echo "|-----------------------------------------+----------------------+----------------------+"
  rows | awk -F'|' '{ printf "| %3s  %-34s | %8s / %-9s | %3s%%                 |\n",
                      $1, $2, $5 "MiB", $4 "MiB", $6 }'
  echo "+---------------------------------------------------------------------------------------+"
  exit 0
fi
[ -n "$format" ] || bad
header=1 units=1 csv=
old_ifs=$IFS; IFS=,
for o in $format; do
  case $o in csv) csv=1;; noheader) header=0;; nounits) units=0;; *) bad;; esac
done
[ -n "$csv" ] || bad
fields=
for f in $query; do
  case $f in
    index|count|driver_version|memory.total|memory.used|memory.free|utilization.gpu) ;;
    temperature.gpu|power.draw) ;;
    name|gpu_name) f=name;;
    uuid|gpu_uuid) f=uuid;;
    pci.bus_id|gpu_bus_id) f=pci.bus_id;;
    *) echo "Field \"$f\" is not a valid field to query."; echo; exit 2;;
  esac
  fields=$fields${fields:+,}$f
done
IFS=$old_ifs
[ -n "$fields" ] || bad
count=$(printf '%s\n' "$GPUS" | grep -c .)
rows | awk -F'|' -v fields="$fields" -v header=$header -v units=$units -v count="$count" \
           -v driver="$DRIVER" '
function unit(f) {
  if (f ~ /^memory\./) return " [MiB]"
  if (f == "utilization.gpu") return " [%]"
  if (f == "power.draw") return " [W]"
  return ""
}
function value(f) {
  if (f == "index") return $1
  if (f == "name") return $2
  if (f == "uuid") return $3
  if (f == "memory.total") return $4 (units ? " MiB" : "")
  if (f == "memory.used") return $5 (units ? " MiB" : "")
  if (f == "memory.free") return ($4 - $5) (units ? " MiB" : "")
  if (f == "utilization.gpu") return $6 (units ? " %" : "")
  if (f == "temperature.gpu") return $8
  if (f == "power.draw") return sprintf("%.2f", $9) (units ? " W" : "")
  if (f == "count") return count
  if (f == "driver_version") return driver
  if (f == "pci.bus_id") return $7
}
BEGIN { n = split(fields, F, ",")
        if (header) { for (i = 1; i <= n; i++)
                        printf "%s%s%s", (i > 1 ? ", " : ""), F[i], unit(F[i])
                      print "" } }
{ for (i = 1; i <= n; i++) printf "%s%s", (i > 1 ? ", " : ""), value(F[i]); print "" }'
"""


def _per_gpu(value, count: int, what: str) -> list:
    values = list(value) if isinstance(value, (list, tuple)) else [value] * count
    if len(values) != count:
        raise ValueError(f"{what}: {len(values)} values for {count} GPUs")
    return values


def gpu_uuid(seed: str, index: int) -> str:
    """The UUID the stand-in reports for GPU ``index`` (``GPU-`` then 8-4-4-4-12 hex digits,
    as the real tool prints): fixed by seed and index, so a host keeps its UUIDs over a restart
    and two hosts never share one."""
    h = hashlib.sha256(f"{seed}/{index}".encode()).hexdigest()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:32]}"


def nvidia_smi_script(count: int, memory_mib: int | list[int] = GPU_MEMORY_MIB, *,
                      name: str | list[str] = GPU_NAME, utilization: int | list[int] = 0,
                      memory_used_mib: int | list[int] = 0, temperature_c: int | list[int] = 34,
                      power_w: float | list[float] = 55.0, uuid_seed: str = "local",
                      driver_version: str = DRIVER_VERSION) -> str:
    """Text of a /bin/sh stand-in for ``nvidia-smi`` with ``count`` GPUs (indexes 0..count-1).
    Each of memory_mib, name, utilization (%), memory_used_mib, temperature_c (°C) and
    power_w (W) is one value for every GPU or a list with one per GPU. Output, as the real
    tool's:
      ``--query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits`` →
          ``0, NVIDIA A100-SXM4-40GB, 40960, GPU-1b2c...``
      ``--query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits`` →
          ``0, 37, 1024``
      ``--query-gpu=temperature.gpu,power.draw --format=csv,noheader`` → ``34, 55.00 W``
      without ``nounits``: ``40960 MiB``, ``37 %``; without ``noheader`` a first line such
          as ``index, name, memory.total [MiB], uuid``
      ``-L`` → ``GPU 0: NVIDIA A100-SXM4-40GB (UUID: GPU-1b2c...)``
    An unknown field prints ``Field "x" is not a valid field to query.`` and exits 2, an
    unknown option ``ERROR: Option x is not recognized...`` (exit 2)."""
    if count < 1:
        raise ValueError("a stand-in nvidia-smi needs at least one GPU")
    mem = _per_gpu(memory_mib, count, "memory_mib")
    names = _per_gpu(name, count, "name")
    util = _per_gpu(utilization, count, "utilization")
    used = _per_gpu(memory_used_mib, count, "memory_used_mib")
    temp = _per_gpu(temperature_c, count, "temperature_c")
    power = _per_gpu(power_w, count, "power_w")
    rows = []
    for i in range(count):
        if not 0 <= used[i] <= mem[i] or not 0 <= util[i] <= 100:
            raise ValueError(f"GPU {i}: memory used {used[i]} of {mem[i]} MiB, {util[i]} %")
        if any(c in names[i] for c in "|'\n,"):
            raise ValueError(f"GPU name {names[i]!r}: no | ' , or newline")
        rows.append(f"{i}|{names[i]}|{gpu_uuid(uuid_seed, i)}|{int(mem[i])}|{int(used[i])}|"
                    f"{int(util[i])}|00000000:{0x07 + i * 0x10:02X}:00.0|{int(temp[i])}|"
                    f"{float(power[i]):g}")
    return (_SMI_TEMPLATE.replace("@COUNT@", str(count)).replace("@ROWS@", "\n".join(rows))
            .replace("@DRIVER@", driver_version))


def write_nvidia_smi(folder: str | os.PathLike, count: int,
                     memory_mib: int | list[int] = GPU_MEMORY_MIB, **kw) -> Path | None:
    """Write the stand-in as ``folder/nvidia-smi`` (mode 755, replaced atomically so a running
    query never reads half a script); ``count`` 0 removes it. Returns its path (None for 0).
    For the local provider: ``monkeypatch.setenv("PATH", f"{folder}:{os.environ['PATH']}")``.
    Keyword arguments: those of nvidia_smi_script."""
    folder = Path(folder)
    path = folder / NVIDIA_SMI
    if not count:
        path.unlink(missing_ok=True)
        return None
    text = nvidia_smi_script(count, memory_mib, **kw)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{NVIDIA_SMI}.{os.getpid()}.{threading.get_ident()}"
    tmp.write_text(text)
    tmp.chmod(0o755)
    os.replace(tmp, path)
    return path


# ---------------------------------------------------------------------------- container image

_tiny_tar: Path | None = None


def tiny_image_tar(tmpdir: Path) -> Path:
    """A ``podman save`` tar (docker-archive) of localhost/hyper-tiny:latest, a ~2 MB
    busybox-static image (CMD /bin/sh). Built once per process into tmpdir; later calls return
    the first tar. Uses a throwaway podman store, never the machine's own."""
    global _tiny_tar
    if _tiny_tar is not None and _tiny_tar.exists():
        return _tiny_tar
    reason = missing_requirements(containers=True)
    if reason:
        raise RuntimeError(reason)
    work = Path(tempfile.mkdtemp(prefix="hyper-tiny-"))   # short: podman caps runroot at 50
    rootfs = work / "rootfs"
    for d in ("bin", "sbin", "usr/bin", "usr/sbin", "etc", "tmp", "root", "proc", "sys",
              "dev", "run", "var/tmp"):
        (rootfs / d).mkdir(parents=True, exist_ok=True)
    (rootfs / "tmp").chmod(0o1777)
    busybox = Path(shutil.which("busybox")).resolve()
    shutil.copy(busybox, rootfs / "bin" / "busybox")
    for applet in _sh(str(busybox), "--list-full").stdout.split():
        link = rootfs / applet
        if applet != "bin/busybox" and not link.exists():
            link.parent.mkdir(parents=True, exist_ok=True)
            link.symlink_to("/bin/busybox")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")
    conf = work / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    podman = ["podman", "--root", str(work / "storage"), "--runroot", str(work / "run"),
              "--tmpdir", str(work / "libpod"), "--storage-driver", "vfs",
              "--cgroup-manager", "cgroupfs", "--events-backend", "file"]
    env = dict(os.environ, CONTAINERS_CONF=str(conf), TMPDIR=str(work))
    tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
    imp = subprocess.run([*podman, "import", "--change", 'CMD ["/bin/sh"]', "-", TINY_IMAGE],
                         stdin=tar.stdout, capture_output=True, text=True, env=env)
    tar.stdout.close()
    tar.wait()
    try:
        if imp.returncode != 0:
            raise RuntimeError(f"podman import failed: {imp.stderr.strip()}")
        out = Path(tmpdir) / "hyper-tiny.tar"
        save = subprocess.run([*podman, "save", "-o", str(out), TINY_IMAGE],
                              capture_output=True, text=True, env=env)
        if save.returncode != 0:
            raise RuntimeError(f"podman save failed: {save.stderr.strip()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    _tiny_tar = out
    return out


def load_image(host: TestHost, tar: Path) -> str:
    """Load an image tar into one host's own store (``docker load`` inside it); returns
    podman's output."""
    with open(tar, "rb") as f:
        p = host.run("docker load", stdin=f, timeout=120)
    if p.returncode != 0:
        raise RuntimeError(f"{host.name}: docker load failed: {p.stderr.strip()}")
    return p.stdout


# ----------------------------------------------------------------------------------- fixtures

def _skip_unless_possible(containers: bool = False) -> None:
    """pytest.skip when hosts cannot run here; a failure instead when HYPER_REQUIRE_SSH_HOSTS
    is set (CI sets it so that these tests never vanish silently)."""
    reason = missing_requirements(containers)
    if reason:
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS"):
            pytest.fail(reason + " (HYPER_REQUIRE_SSH_HOSTS is set)", pytrace=False)
        pytest.skip(reason)


@pytest.fixture(scope="session")
def ssh_client_key(tmp_path_factory) -> Path:
    """One ed25519 client key for the session (skips when SSH test hosts cannot run)."""
    _skip_unless_possible()
    path = tmp_path_factory.mktemp("sshhosts-key") / "client_key"
    _wait_all([_keygen(path, "hyper-test-client")], "ssh-keygen")
    return path


@pytest.fixture
def ssh_hosts(ssh_client_key):
    """A HostPool for this test: ``hosts = ssh_hosts(3)``; ``ssh_hosts.client_key``,
    ``ssh_hosts.known_hosts``. Every host and network piece is removed after the test, pass
    or fail; the tail of each sshd log is printed then (pytest shows it on failure)."""
    pool = HostPool(client_key=ssh_client_key)
    try:
        yield pool
    finally:
        for h in pool.hosts:
            if h.log.exists():
                tail = h.log.read_text(errors="replace").splitlines()[-15:]
                print(f"--- sshd log of {h.name} ({h.ip}) ---", *tail, sep="\n")
        pool.stop()


@pytest.fixture(scope="session")
def tiny_image(tmp_path_factory) -> Path:
    """Path of the tiny image's tar (skips when podman, runc or busybox are missing)."""
    _skip_unless_possible(containers=True)
    return tiny_image_tar(tmp_path_factory.mktemp("tiny-image"))
