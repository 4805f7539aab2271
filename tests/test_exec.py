"""hyper exec, hyper ssh and hyper ssh-config on real SSH hosts (tests/sshhosts.py) and on a
local cluster: prefixed streaming output, the worst exit code, a killed host, pinned host
keys honoured by the system OpenSSH client (ssh, scp)."""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import pytest

from conftest import hyper_cmd, wait_for

needs_openssh = pytest.mark.skipif(not shutil.which("ssh") or not shutil.which("scp"),
                                   reason="OpenSSH's client (ssh, scp) is needed")


def up_lab(hyper, pool, n: int = 2, name: str = "lab"):
    """n SSH test hosts brought up as cluster ``name`` (nodes name-0 … on h1 …)."""
    hosts = pool(n)
    args = ["up", "--provider", "ssh", "--name", name, "--identity-file", pool.client_key,
            "--trust-new-hosts"]
    for h in hosts:
        args += ["--host", h.address()]
    hyper(*args, check=True, timeout=120)
    return hosts


class Streamed:
    """A `hyper` process whose stdout/stderr lines are collected as they come."""

    def __init__(self, *args):
        self.proc = subprocess.Popen([*hyper_cmd(), *map(str, args)], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                     text=True, env=dict(os.environ))
        self.out: list[str] = []
        self.err: list[str] = []
        self.threads = [threading.Thread(target=self._read, args=(f, lines), daemon=True)
                        for f, lines in ((self.proc.stdout, self.out),
                                         (self.proc.stderr, self.err))]
        for t in self.threads:
            t.start()

    @staticmethod
    def _read(f, lines: list[str]) -> None:
        for line in f:
            lines.append(line.rstrip("\n"))

    def wait(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for t in self.threads:
            t.join(5)
        return code

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def test_exec_prefixes_lines_and_exits_with_the_worst_code(hyper, ssh_hosts):
    up_lab(hyper, ssh_hosts)
    r = hyper("exec", "lab", "--", 'echo "out-$(hostname) $HYPER_NODE"; echo err-$(hostname) >&2;'
              ' [ "$(hostname)" != h2 ] || exit 3')
    assert r.returncode == 3, r.stderr
    assert sorted(r.stdout.splitlines()) == ["lab-0 | out-h1 lab-0", "lab-1 | out-h2 lab-1"]
    err = r.stderr.splitlines()
    assert "lab-0 | err-h1" in err and "lab-1 | err-h2" in err
    assert "lab-1 | hyper: exited 3" in err and not any("exited" in e for e in err
                                                       if e.startswith("lab-0"))
    # several arguments are quoted word by word: `sh -c 'exit 4'` is one command
    r = hyper("exec", "lab", "--", "sh", "-c", "echo $0 $1; exit 4", "a b", "c")
    assert r.returncode == 4
    assert sorted(r.stdout.splitlines()) == ["lab-0 | a b c", "lab-1 | a b c"]


def test_exec_streams_output_before_the_commands_end(hyper, ssh_hosts):
    hosts = up_lab(hyper, ssh_hosts)
    p = Streamed("exec", "lab", "--",
                 "echo first; while [ ! -e /tmp/go ]; do sleep 0.05; done; echo second")
    try:
        wait_for(lambda: sorted(p.out) == ["lab-0 | first", "lab-1 | first"], timeout=30,
                 what="the first lines of both nodes")
        assert p.proc.poll() is None  # still running: the lines were not held to the end
        for h in hosts:
            h.run("touch /tmp/go", check=True)
        assert p.wait() == 0, p.err
    finally:
        p.stop()
    assert sorted(p.out) == ["lab-0 | first", "lab-0 | second", "lab-1 | first",
                             "lab-1 | second"]


def test_exec_on_chosen_nodes_and_unknown_names(hyper, ssh_hosts):
    up_lab(hyper, ssh_hosts)
    r = hyper("exec", "lab", "--node", "lab-1", "--", "hostname")
    assert (r.returncode, r.stdout) == (0, "lab-1 | h2\n")
    r = hyper("exec", "lab", "--node", "0", "--", "hostname")
    assert (r.returncode, r.stdout) == (0, "lab-0 | h1\n")
    r = hyper("exec", "lab", "--node", "0", "--node", "lab-1", "--", "hostname")
    assert sorted(r.stdout.splitlines()) == ["lab-0 | h1", "lab-1 | h2"]
    r = hyper("exec", "lab", "--node", "gpu-9", "--", "true")
    assert r.returncode == 2 and "no node 'gpu-9'" in r.stderr and "lab-0, lab-1" in r.stderr
    r = hyper("exec", "nolab", "--", "true")
    assert r.returncode == 2 and "no cluster named 'nolab'" in r.stderr and "lab" in r.stderr
    assert r.stdout == ""


def test_exec_reports_a_killed_host_and_goes_on(hyper, ssh_hosts):
    hosts = up_lab(hyper, ssh_hosts)
    p = Streamed("exec", "lab", "--",
                 'echo begin-$(hostname); [ "$(hostname)" = h1 ] && exit 0; sleep 60')
    try:
        wait_for(lambda: "lab-1 | begin-h2" in p.out, timeout=30, what="h2's first line")
        hosts[1].kill()  # power loss while its command runs
        t0 = time.monotonic()
        assert p.wait(timeout=30) == 255, p.err
        assert time.monotonic() - t0 < 20  # noticed by the connection, not after the sleep
    finally:
        p.stop()
    assert "lab-0 | begin-h1" in p.out
    assert any(e.startswith("lab-1 | hyper: unreachable: ") for e in p.err), p.err
    # a host that is down from the start: reported, the other's output still printed
    r = hyper("exec", "lab", "--", "echo hi")
    assert r.returncode == 255
    assert r.stdout == "lab-0 | hi\n"
    assert "lab-1 | hyper: unreachable: cannot connect" in r.stderr


def test_exec_skips_nodes_that_are_not_up(hyper, ssh_hosts):
    up_lab(hyper, ssh_hosts)
    from hypercli.state import State
    state = State()
    state.set_node_status("lab-1", "lost")
    state.close()
    r = hyper("exec", "lab", "--", "hostname")
    assert (r.returncode, r.stdout) == (0, "lab-0 | h1\n")
    assert "lab-1 | hyper: node is lost, not up: skipped" in r.stderr
    r = hyper("exec", "lab", "--node", "lab-1", "--", "hostname")
    assert r.returncode == 3 and "no node of cluster lab to run on" in r.stderr


def test_exec_on_a_local_cluster_runs_here_in_each_nodes_view(hyper, tmp_path):
    hyper("up", "--provider", "local", "--workers", "2", "--name", "loc", check=True)
    r = hyper("exec", "loc", "--", 'echo "$HYPER_NODE $(pwd)"; [ $HYPER_NODE = loc-0 ] || '
              "exit 5", cwd=tmp_path)
    assert r.returncode == 5
    assert sorted(r.stdout.splitlines()) == [f"loc-0 | loc-0 {tmp_path}",
                                             f"loc-1 | loc-1 {tmp_path}"]
    # a reader that goes away (`| head`) stops the commands: no wait for their end
    p = subprocess.Popen([*hyper_cmd(), "exec", "loc", "--", "yes | head -c 20000000; sleep 60"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         stdin=subprocess.DEVNULL)
    try:
        assert p.stdout.readline() in (b"loc-0 | y\n", b"loc-1 | y\n")
        p.stdout.close()
        assert p.wait(30) == 141
        assert b"Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stderr.close()
    r = hyper("ssh", "loc")
    assert r.returncode == 2 and "no host to ssh to" in r.stderr and "hyper exec loc" in r.stderr
    assert hyper("ssh-config", "loc").returncode == 2


@needs_openssh
def test_ssh_runs_the_system_client_with_the_pinned_key(hyper, ssh_hosts, hyper_home):
    hosts = up_lab(hyper, ssh_hosts)
    r = hyper("ssh", "lab", "lab-1", "--", "hostname", stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stdout) == (0, "h2\n"), r.stderr
    r = hyper("ssh", "lab", "--", "echo $((6 * 7)) $(hostname)", stdin=subprocess.DEVNULL)
    assert (r.returncode, r.stdout) == (0, "42 h1\n"), r.stderr  # the first node
    r = hyper("ssh", "lab", "1", "--", "exit 7", stdin=subprocess.DEVNULL)
    assert r.returncode == 7  # the remote exit code comes through ssh
    # the command line it exec's
    from hypercli.remote import ssh_argv
    from hypercli.state import State
    state = State()
    argv = ssh_argv(state, "lab", "lab-0")
    state.close()
    known = hyper_home / "ssh" / "lab.known_hosts"
    assert argv[0] == shutil.which("ssh")
    for opt in (["-i", str(ssh_hosts.client_key)], ["-o", "StrictHostKeyChecking=yes"],
                ["-o", f"UserKnownHostsFile={known}"], ["-p", "22"], ["-l", "root"]):
        assert any(argv[i:i + 2] == opt for i in range(len(argv))), (opt, argv)
    assert argv[-2:] == ["--", hosts[0].ip]
    assert known.read_text() == hosts[0].host_key_line + "\n"
    assert oct(known.stat().st_mode & 0o777) == "0o600"
    # no ssh client: a clear error, not a traceback
    p = subprocess.run([*hyper_cmd(), "ssh", "lab"], capture_output=True, text=True,
                       env=dict(os.environ, PATH=str(hyper_home)), stdin=subprocess.DEVNULL,
                       timeout=60)
    assert p.returncode == 3 and "no `ssh` client" in p.stderr and "Traceback" not in p.stderr
    r = hyper("ssh", "lab", "lab-7")
    assert r.returncode == 2 and "lab-0, lab-1" in r.stderr


@needs_openssh
def test_ssh_config_works_with_ssh_and_scp_and_refuses_a_changed_key(hyper, ssh_hosts,
                                                                     tmp_path, hyper_home):
    hosts = up_lab(hyper, ssh_hosts)
    r = hyper("ssh-config", "lab", check=True)
    config = tmp_path / "config"
    config.write_text(r.stdout)
    assert "Host lab-0\n" in r.stdout and "Host lab-1\n" in r.stdout
    assert f"HostName {hosts[1].ip}\n" in r.stdout
    assert f"IdentityFile {ssh_hosts.client_key}\n" in r.stdout
    assert f"UserKnownHostsFile {hyper_home / 'ssh' / 'lab.known_hosts'}\n" in r.stdout
    assert r.stdout.count("StrictHostKeyChecking yes\n") == 2
    assert r.stdout.count("IdentitiesOnly yes\n") == 2

    def ssh(*args, **kw):
        return subprocess.run(["ssh", "-F", config, "-o", "BatchMode=yes", *args],
                              capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL, **kw)

    def scp(*args):
        return subprocess.run(["scp", "-F", config, "-o", "BatchMode=yes", *args],
                              capture_output=True, text=True, timeout=30,
                              stdin=subprocess.DEVNULL)

    p = ssh("lab-0", "true")
    assert p.returncode == 0, p.stderr
    assert (ssh("lab-1", "hostname").stdout, ssh("lab-0", "hostname").stdout) == ("h2\n", "h1\n")
    src = tmp_path / "payload.txt"
    src.write_text("over scp\n")
    p = scp(str(src), "lab-1:/tmp/payload.txt")
    assert p.returncode == 0, p.stderr
    assert hosts[1].run("cat /tmp/payload.txt", check=True).stdout == "over scp\n"
    p = scp("lab-1:/tmp/payload.txt", str(tmp_path / "back.txt"))
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "back.txt").read_text() == "over scp\n"

    # h1 comes back with another host key (reinstalled, or someone in the middle)
    keyfile = hosts[0].root / "etc-ssh" / "ssh_host_ed25519_key"
    keyfile.unlink()
    keyfile.with_suffix(".pub").unlink()
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(keyfile)],
                   check=True, capture_output=True)
    hosts[0].restart()
    p = ssh("lab-0", "true")
    assert p.returncode == 255
    assert "REMOTE HOST IDENTIFICATION HAS CHANGED" in p.stderr, p.stderr
    assert ssh("lab-1", "true").returncode == 0
    # writing the config again keeps the pinned key: still refused
    config.write_text(hyper("ssh-config", "lab", check=True).stdout)
    assert ssh("lab-0", "true").returncode == 255
    r = hyper("ssh", "lab", "lab-0", "--", "true", stdin=subprocess.DEVNULL)
    assert r.returncode == 255 and "HOST IDENTIFICATION HAS CHANGED" in r.stderr
    r = hyper("exec", "lab", "--", "hostname")
    assert r.returncode == 255 and r.stdout == "lab-1 | h2\n"
    assert "lab-0 | hyper: unreachable: host key of" in r.stderr and "CHANGED" in r.stderr
