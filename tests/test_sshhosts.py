"""The SSH test hosts of tests/sshhosts.py, checked with a real SSH client (paramiko)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sshhosts import (BRIDGE, STATE_DIR, TINY_IMAGE, HostPool, TestHost, _state_lock,
                      load_image, ssh_client_key, ssh_hosts, tiny_image)  # noqa: F401

try:
    import paramiko
except ImportError:
    if os.environ.get("HYPER_REQUIRE_SSH_HOSTS"):
        raise
    pytest.skip("paramiko is needed to test the SSH hosts", allow_module_level=True)


def connect(host: TestHost, pool: HostPool, timeout: float = 5, known_hosts: Path | None = None):
    """A paramiko client on a socket we built (TCP_NODELAY), host key pinned (RejectPolicy)."""
    sock = socket.create_connection((host.ip, host.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = paramiko.SSHClient()
    client.load_host_keys(str(known_hosts or pool.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(host.ip, host.port, username=host.user,
                       key_filename=str(pool.client_key), sock=sock, timeout=timeout,
                       banner_timeout=timeout, auth_timeout=timeout,
                       look_for_keys=False, allow_agent=False)
    except BaseException:
        client.close()
        sock.close()
        raise
    return client


def sh(client, cmd: str, timeout: float = 10) -> tuple[int, str]:
    _, out, err = client.exec_command(cmd, timeout=timeout)
    text = out.read().decode() + err.read().decode()
    return out.channel.recv_exit_status(), text


@pytest.fixture(autouse=True)
def nothing_left(request):
    """After each test (and after ssh_hosts' own teardown): nothing of its pool remains."""
    yield
    pool = request.node.funcargs.get("ssh_hosts")
    if pool is None:
        return
    me = os.getpid()
    assert pool.leftovers() == []
    assert not [n for n in subprocess.run(["ip", "netns", "list"], capture_output=True,
                                          text=True).stdout.split()
                if n.startswith(f"hyper-{me}-")]
    assert not [n for n in os.listdir("/sys/class/net") if n.startswith(f"hv{me:x}-")]
    mounts = Path("/proc/self/mountinfo").read_text()
    assert f"hyper-{me}-" not in mounts and str(pool.base) not in mounts
    children = [p for p in os.listdir("/proc") if p.isdigit() and
                Path(f"/proc/{p}/stat").exists() and
                _ppid(p) == me]
    assert children == [], f"processes left: {children}"
    with _state_lock():  # pools of other processes start and stop under it
        if not list(STATE_DIR.glob("10.*")) and pool.created_bridge:
            assert not Path("/sys/class/net", BRIDGE).exists(), "bridge left"


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None


def _ppid(pid: str) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError):
        return None


def test_three_isolated_hosts(ssh_hosts):
    t0 = time.monotonic()
    hosts = ssh_hosts(3)
    started = time.monotonic() - t0
    assert [h.name for h in hosts] == ["h1", "h2", "h3"]
    assert len({h.ip for h in hosts}) == 3 and len({h.pid for h in hosts}) == 3
    known = ssh_hosts.known_hosts.read_text().splitlines()
    assert sorted(known) == sorted(h.host_key_line for h in hosts)
    clients = [connect(h, ssh_hosts) for h in hosts]
    try:
        for h, c in zip(hosts, clients):
            assert h.address() == f"root@{h.ip}:22"
            key = c.get_transport().get_remote_server_key()
            assert h.host_key_line.split()[1:] == [key.get_name(), key.get_base64()]
            code, out = sh(c, "hostname; cat /proc/1/comm; python3 --version; "
                              "ip -4 -o addr show dev eth0; ls -A ~; cat ~/.bashrc")
            assert code == 0, out
            lines = out.splitlines()
            assert lines[:2] == [h.name, "sshd"]
            assert lines[2].startswith("Python 3.")
            assert f"inet {h.ip}/24" in lines[3]
        # private /tmp: a file written on h1 over SSH is absent from h2 and h3 (and from ours)
        assert sh(clients[0], "echo only-h1 > /tmp/mark && cat /tmp/mark") == (0, "only-h1\n")
        assert (hosts[0].root / "tmp" / "mark").read_text() == "only-h1\n"
        assert not Path("/tmp/mark").exists() or Path("/tmp/mark").read_text() != "only-h1\n"
        for c in clients[1:]:
            assert sh(c, "test -e /tmp/mark")[0] == 1
        assert hosts[0].run("cat /tmp/mark").stdout == "only-h1\n"
        assert hosts[1].run("test -e /tmp/mark").returncode == 1
        # each host sees only its own processes, its own /run
        assert hosts[1].run("ps -e -o comm=").stdout.split()[0] == "sshd"
        assert hosts[2].run("hostname; echo $HOME; pwd").stdout.split() == ["h3", "/root",
                                                                              "/root"]
    finally:
        for c in clients:
            c.close()
    print(f"3 hosts started in {started:.2f}s")


def test_host_keys_are_pinned(ssh_hosts, tmp_path):
    h1, h2 = ssh_hosts(2)
    wrong = tmp_path / "known_hosts"
    wrong.write_text(f"{h1.ip} {' '.join(h2.host_key_line.split()[1:])}\n")
    with pytest.raises(paramiko.BadHostKeyException):
        connect(h1, ssh_hosts, known_hosts=wrong)
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(paramiko.SSHException, match="not found in known_hosts"):
        connect(h1, ssh_hosts, known_hosts=empty)


def test_start_four_is_fast(ssh_hosts):
    t0 = time.monotonic()
    hosts = ssh_hosts(4)
    took = time.monotonic() - t0
    assert all(h.run("true").returncode == 0 for h in hosts)
    print(f"4 hosts started in {took:.2f}s")
    assert took < 5


def test_kill_is_power_loss(ssh_hosts):
    h1, h2 = ssh_hosts(2)
    c = connect(h1, ssh_hosts)
    try:
        # a background process and a running command: both die with the host
        assert sh(c, "setsid sleep 300 > /dev/null 2>&1 < /dev/null & echo started")[0] == 0
        chan = c.get_transport().open_session(timeout=5)
        chan.exec_command("sleep 300")
        time.sleep(0.1)
        assert len(h1.processes()) >= 3
        old_pid = h1.pid
        t0 = time.monotonic()
        h1.kill()
        assert chan.recv_exit_status() == -1          # channel closed without a status
        detected = time.monotonic() - t0
        assert detected < 2
        assert not h1.alive and h1.processes() == [] and not Path(f"/proc/{old_pid}").exists()
        with pytest.raises(ConnectionRefusedError):
            connect(h1, ssh_hosts, timeout=2)
        with pytest.raises(RuntimeError, match="down"):
            h1.run("true")
        assert h2.run("hostname").stdout == "h2\n"    # the other host is untouched
        print(f"kill detected by the open channel in {detected:.3f}s")
    finally:
        c.close()


def test_restart_keeps_folders_and_host_key(ssh_hosts):
    h, = ssh_hosts(1)
    h.run("echo disk > /tmp/on-disk; echo ram > /run/in-ram; echo home > ~/f", check=True)
    old_pid, old_key = h.pid, h.host_key_line
    h.kill()
    t0 = time.monotonic()
    h.restart()
    took = time.monotonic() - t0
    assert h.pid != old_pid and h.host_key_line == old_key
    c = connect(h, ssh_hosts)        # RejectPolicy: the pinned key still matches
    try:
        assert sh(c, "cat /tmp/on-disk ~/f; test -e /run/in-ram || echo no-run") == \
            (0, "disk\nhome\nno-run\n")
    finally:
        c.close()
    print(f"restart in {took:.3f}s")


def test_cut_and_heal(ssh_hosts):
    h, = ssh_hosts(1)
    c = connect(h, ssh_hosts)
    try:
        assert sh(c, "echo before")[1] == "before\n"
        h.cut()
        t0 = time.monotonic()
        with pytest.raises((TimeoutError, socket.timeout)):
            socket.create_connection((h.ip, h.port), timeout=0.5)
        assert time.monotonic() - t0 >= 0.45            # silent: no refusal, no unreachable
        with pytest.raises(paramiko.SSHException):     # the old connection gets no answer
            c.get_transport().open_session(timeout=0.5)
    finally:
        h.heal()
    try:
        assert sh(c, "echo after")[1] == "after\n"     # the old connection survives a heal
    finally:
        c.close()
    c2 = connect(h, ssh_hosts)
    try:
        assert sh(c2, "hostname")[1] == "h1\n"
    finally:
        c2.close()


def test_freeze_and_thaw(ssh_hosts):
    h, = ssh_hosts(1)
    c = connect(h, ssh_hosts)
    try:
        h.freeze()
        states = {p: _state(p) for p in h.processes()}
        assert states and set(states.values()) <= {"T", "t", "Z", None}, states
        with pytest.raises(paramiko.SSHException):     # hung: caught only by a timeout
            c.get_transport().open_session(timeout=0.5)
        with pytest.raises((paramiko.SSHException, EOFError, socket.timeout)):
            connect(h, ssh_hosts, timeout=0.5).close()  # TCP accepts, no SSH banner comes
        h.thaw()
        assert sh(c, "echo alive")[1] == "alive\n"
    finally:
        h.thaw()
        c.close()


def test_container_on_a_host(ssh_hosts, tiny_image):
    assert tiny_image.stat().st_size < 5_000_000
    h1, h2 = ssh_hosts(2)
    assert "Loaded image" in load_image(h1, tiny_image)
    p = h1.run(f"docker run --rm {TINY_IMAGE} echo hi")
    assert (p.returncode, p.stdout) == (0, "hi\n"), p.stderr
    # each host has its own image store
    assert h2.run(f"docker image exists {TINY_IMAGE}").returncode == 1
    # push over SSH: the tar on stdin of `docker load`, then run it over SSH
    c = connect(h2, ssh_hosts)
    try:
        stdin, out, err = c.exec_command("docker load", timeout=60)
        stdin.write(tiny_image.read_bytes())
        stdin.channel.shutdown_write()
        assert out.channel.recv_exit_status() == 0, err.read()
        code, text = sh(c, f"docker run --rm {TINY_IMAGE} sh -c 'hostname; ulimit -n'",
                        timeout=60)
        assert (code, text.split()) == (0, ["h2", "20000"])
        # a detached container dies with its host
        assert sh(c, f"docker run -d --name long {TINY_IMAGE} sleep 300")[0] == 0
        assert "true" in h2.run("docker inspect -f '{{.State.Running}}' long").stdout
    finally:
        c.close()
    h2.kill()
    assert h2.processes() == []
    h2.restart()
    assert h2.run("docker inspect -f '{{.State.Running}}' long").stdout.strip() == "false"
