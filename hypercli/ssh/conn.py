"""One persistent SSH connection to a node, built for fast commands and fast failure.

The TCP socket is built here, not by paramiko, so its options can be set before the handshake
(measured on this project's test hosts, see ENVIRONMENT.md):

* ``TCP_NODELAY``: without it every exec on a persistent connection waits ~48 ms (Nagle +
  delayed ACK); with it 3.5–7.5 ms.
* ``SO_KEEPALIVE`` (idle 2 s, interval 1 s, 3 probes) and ``TCP_USER_TIMEOUT`` (4 s): a host cut
  off the network is noticed in ~4 s instead of ~15 minutes.

Host keys are verified against pinned keys (:mod:`hypercli.ssh.hostkeys`), never accepted
silently. A node that cannot be reached gives a :class:`hypercli.errors.NodeError` subclass
naming it; a command that fails on a reachable node gives :class:`CommandFailed`.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass

from hypercli.errors import InfraError, NodeError
from hypercli.ssh.hostkeys import HostKeyChanged, HostKeyUnknown, KnownHosts

logging.getLogger("paramiko").addHandler(logging.NullHandler())  # errors reach users as ours

#: s for TCP connect, SSH banner and authentication each, when reconnecting to a known node
#: during a run (a healthy host answers in milliseconds on a LAN, ~0.3 s across regions)
CONNECT_TIMEOUT = 3.0
KEEPALIVE = (2, 1, 3)  # TCP_KEEPIDLE s, TCP_KEEPINTVL s, TCP_KEEPCNT
USER_TIMEOUT_MS = 4000  # TCP_USER_TIMEOUT: unacknowledged data for this long kills the socket
#: s a host has to answer a TCP handshake when an answer of its agent is late. Linux resends an
#: unanswered SYN after 1 s (its initial RTO, RFC 6298 2.1), so one lost SYN does not make a
#: healthy host look cut off; a loaded host's kernel answers in well under a millisecond here.
PROBE_TIMEOUT = 1.5


class HostUnreachable(NodeError):
    """No TCP connection, or the SSH handshake did not finish in time."""


class AuthFailed(NodeError):
    """The host refused the key (wrong key, wrong user)."""


class CommandFailed(InfraError):
    """A command exited non-zero on a node that is fine (not a NodeError: the node is not
    lost). Carries the :class:`Result`; prints the node, the command, the exit code and the
    last lines of stderr (after ``invoke.exceptions.Failure``)."""

    def __init__(self, node: str, result: "Result"):
        tail = "\n".join(result.stderr.decode(errors="replace").splitlines()[-5:])
        super().__init__(f"node {node}: `{result.command[:300]}` exited {result.exit_code}"
                         + (f":\n{tail}" if tail else ""))
        self.node, self.result = node, result


@dataclass(frozen=True)
class Result:
    """What a command did: its text, exit code (-1: the connection died) and output bytes."""

    command: str
    exit_code: int
    stdout: bytes
    stderr: bytes


@dataclass(frozen=True)
class Target:
    """Where and as whom to connect: ``user@host:port`` plus the private key file (or None for
    the default keys of ``~/.ssh`` and the agent)."""

    host: str
    port: int = 22
    user: str = "root"
    identity_file: str | None = None

    @classmethod
    def parse(cls, spec: str, *, user: str | None = None, port: int | None = None,
              identity_file: str | None = None) -> "Target":
        """``[user@]host[:port]`` → Target; ``user``/``port`` fill what the spec leaves out.

        Raises:
            ValueError: empty host or a port that is not a number.
        """
        u, _, hp = spec.rpartition("@")
        host, _, p = hp.partition(":")
        if hp.startswith("["):  # [ipv6]:port
            host, _, p = hp[1:].partition("]")
            p = p.lstrip(":")
        if not host:
            raise ValueError(f"no host in {spec!r}")
        return cls(host, int(p) if p else (port or 22), u or user or "root", identity_file)

    def __str__(self) -> str:
        return f"{self.user}@{self.host}:{self.port}"


def make_socket(host: str, port: int, timeout: float = CONNECT_TIMEOUT) -> socket.socket:
    """A connected TCP socket with the options of the module docstring.

    Raises:
        OSError: the connection failed or timed out.
    """
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    idle, intvl, cnt = KEEPALIVE
    for opt, val in (("TCP_KEEPIDLE", idle), ("TCP_KEEPINTVL", intvl), ("TCP_KEEPCNT", cnt)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)
    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, "TCP_USER_TIMEOUT", 18),
                    USER_TIMEOUT_MS)
    return sock


def tcp_silent(host: str, port: int, timeout: float = PROBE_TIMEOUT) -> str | None:
    """None when ``host`` answers a TCP handshake on ``port`` within ``timeout`` s (a refusal
    is an answer too: the host is up), else why not. The connection is closed at once."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except ConnectionRefusedError:
        return None
    except OSError as e:
        return f"{host}:{port} does not answer TCP ({e or 'timed out'} within {timeout:g} s)"
    return None


class Connection:
    """A persistent, verified SSH connection.

    Args:
        name: node name for errors.
        target: host, port, user, key.
        known_hosts: pinned host keys.
        trust_new: record the key of a host seen for the first time instead of refusing it.
    Raises:
        HostUnreachable, AuthFailed, HostKeyUnknown, HostKeyChanged: on connect.
    """

    def __init__(self, name: str, target: Target, known_hosts: KnownHosts, *,
                 trust_new: bool = False, timeout: float = CONNECT_TIMEOUT):
        import paramiko
        self.name, self.target = name, target
        self.lock = threading.Lock()
        try:
            sock = make_socket(target.host, target.port, timeout)
        except OSError as e:
            raise HostUnreachable(name, f"cannot connect to {target}: {e}",
                                  "is the host up and port open?") from None
        client = paramiko.SSHClient()
        known_hosts.install(client, trust_new=trust_new, node=name)
        try:
            client.connect(target.host, target.port, username=target.user,
                           key_filename=target.identity_file, sock=sock, timeout=timeout,
                           banner_timeout=timeout, auth_timeout=timeout,
                           allow_agent=target.identity_file is None,
                           look_for_keys=target.identity_file is None)
        except (HostKeyUnknown, HostKeyChanged):
            sock.close()
            raise
        except paramiko.BadHostKeyException as e:
            sock.close()
            raise HostKeyChanged(name, target, e.key, e.expected_key) from None
        except paramiko.AuthenticationException as e:
            sock.close()
            raise AuthFailed(name, f"{target} refused the key ({e})",
                             "check the user and identity_file") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            sock.close()
            raise HostUnreachable(name, f"SSH handshake with {target} failed: {e}") from None
        known_hosts.save_new()
        self.client = client
        self.transport = client.get_transport()
        self.transport.set_keepalive(5)

    def channel(self, timeout: float = CONNECT_TIMEOUT):
        """A new session channel (``open_session`` with a timeout catches hung hosts)."""
        try:
            return self.transport.open_session(timeout=timeout)
        except Exception as e:  # paramiko raises SSHException, EOFError, socket errors
            raise HostUnreachable(self.name, f"cannot open a channel: {e}") from None

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float = 60.0,
            check: bool = True) -> Result:
        """Run a command, feeding ``stdin``; returns its Result.

        Raises:
            CommandFailed: non-zero exit with ``check``.
            HostUnreachable: the connection died or ``timeout`` (s) passed.
        """
        ch = self.channel()
        ch.settimeout(timeout)
        try:
            ch.exec_command(command)
            if stdin is not None:
                ch.sendall(stdin)
            ch.shutdown_write()
            out, err = _drain(ch, timeout)
            code = ch.recv_exit_status() if ch.exit_status_ready() else -1
        except (OSError, EOFError, TimeoutError) as e:
            raise HostUnreachable(self.name, f"`{command[:200]}` failed: {e}") from None
        except Exception as e:  # paramiko.SSHException and kin: the session broke
            raise HostUnreachable(self.name, f"`{command[:200]}` failed: {e}") from None
        finally:
            ch.close()
        r = Result(command, code, out, err)
        if check and code != 0:
            raise CommandFailed(self.name, r)
        return r

    def alive(self) -> bool:
        return self.transport is not None and self.transport.is_active()

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass


#: s a command's output may stay open after its exit status arrived (a background process
#: holding it) before the read ends without the server's EOF
EXIT_GRACE = 2.0


def _drain(ch, timeout: float) -> tuple[bytes, bytes]:
    """Read a channel's stdout and stderr to the end without either blocking the other.

    The end is the server's EOF with the exit status. The exit status alone is not: it is not flow-controlled, so
    it can arrive while output is still on its way (a 300 kB tar stream was cut short that
    way). After the exit status, a command whose output stays open (a background process
    holding it) ends the read once nothing has arrived for EXIT_GRACE s.

    Raises:
        TimeoutError: ``timeout`` seconds passed before the command ended.
    """
    out, err = bytearray(), bytearray()
    deadline = time.monotonic() + timeout
    quiet_since = None
    while True:
        got = False
        while ch.recv_ready():
            out += ch.recv(1 << 16)
            got = True
        while ch.recv_stderr_ready():
            err += ch.recv_stderr(1 << 16)
            got = True
        if (ch.closed or ch.eof_received and ch.exit_status_ready()) \
                and not ch.recv_ready() and not ch.recv_stderr_ready():
            return bytes(out), bytes(err)
        now = time.monotonic()
        if ch.exit_status_ready():
            if got or quiet_since is None:
                quiet_since = now
            elif now - quiet_since > EXIT_GRACE:
                return bytes(out), bytes(err)
        if now > deadline:
            raise TimeoutError(f"no end after {timeout:.0f} s")
        if not got:
            time.sleep(0.0005)
