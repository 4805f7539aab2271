"""Test infrastructure for GPU scheduling and multi-node jobs, checked on its own: the stand-in
``nvidia-smi`` of tests/sshhosts.py (on SSH test hosts and for the local provider) and the
torch.distributed programs of tests/gang/ (Debian's python3-torch, CPU, gloo) run as 3 ranks
on 3 SSH test hosts, each in its own network namespace."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from sshhosts import GPU_MEMORY_MIB, GPU_NAME, HostPool, TestHost, write_nvidia_smi

GANG = Path(__file__).resolve().parent / "gang"
UUID = re.compile(r"GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
INVENTORY = "nvidia-smi --query-gpu=index,name,memory.total,uuid --format=csv,noheader,nounits"
USAGE = "nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader,nounits"


def required() -> bool:
    return bool(os.environ.get("HYPER_REQUIRE_SSH_HOSTS"))


def need_torch() -> None:
    """Skip (fail when HYPER_REQUIRE_SSH_HOSTS is set) unless Debian's python3-torch is there."""
    probe = "import torch.distributed as d; assert d.is_gloo_available()"
    p = subprocess.run(["/usr/bin/python3", "-c", probe], capture_output=True, text=True)
    if p.returncode != 0:
        why = ("torch.distributed with gloo is not importable by /usr/bin/python3 "
               "(scripts/deps.sh installs Debian's python3-torch)")
        if required():
            pytest.fail(why + " (HYPER_REQUIRE_SSH_HOSTS is set)", pytrace=False)
        pytest.skip(why)


def connect(host: TestHost, pool: HostPool, timeout: float = 10):
    """A paramiko client to host (TCP_NODELAY, host key pinned from the pool's known_hosts)."""
    if required():
        import paramiko
    else:
        paramiko = pytest.importorskip("paramiko")
    sock = socket.create_connection((host.ip, host.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    client = paramiko.SSHClient()
    client.load_host_keys(str(pool.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    try:
        client.connect(host.ip, host.port, username=host.user, sock=sock,
                       key_filename=str(pool.client_key), timeout=timeout,
                       banner_timeout=timeout, auth_timeout=timeout,
                       look_for_keys=False, allow_agent=False)
    except BaseException:
        client.close()
        sock.close()
        raise
    return client


def sh(client, cmd: str, timeout: float = 30) -> tuple[int, str, str]:
    _, out, err = client.exec_command(cmd, timeout=timeout)
    stdout, stderr = out.read().decode(), err.read().decode()
    return out.channel.recv_exit_status(), stdout, stderr


def rows(text: str) -> list[list[str]]:
    return [r for r in csv.reader(io.StringIO(text), skipinitialspace=True) if r]


@pytest.fixture(autouse=True)
def nothing_left(request):
    """After each test and its pool's teardown: no host, namespace or child process remains."""
    yield
    pool = request.node.funcargs.get("ssh_hosts")
    if pool is not None:
        assert pool.leftovers() == []
    me = str(os.getpid())
    children = []
    for p in os.listdir("/proc"):
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if p.isdigit() and fields[1] == me and fields[0] != "Z":
            children.append(p)
    assert children == [], f"processes left: {children}"


# ----------------------------------------------------------------------------- GPU stand-in

def test_gpu_standin_over_ssh(ssh_hosts):
    h1, h2, h3 = ssh_hosts.start(3, gpus=[2, 4, 0])
    assert (h1.gpus, h2.gpus, h3.gpus) == (2, 4, 0)
    clients = [connect(h, ssh_hosts) for h in (h1, h2, h3)]
    try:
        c1, c2, c3 = clients
        for c in clients:              # sshd's own PATH for root puts /usr/local/sbin first
            rc, out, _ = sh(c, "echo $PATH")
            assert rc == 0 and out.split(":")[0] == "/usr/local/sbin", out
        assert sh(c1, "command -v nvidia-smi")[:2] == (0, "/usr/local/sbin/nvidia-smi\n")
        assert sh(c3, "command -v nvidia-smi")[0] != 0          # a host without GPUs
        assert h3.run("command -v nvidia-smi").returncode != 0
        assert not Path("/usr/local/sbin/nvidia-smi").exists()  # the machine's own is untouched

        uuids = []
        for c, n in ((c1, 2), (c2, 4)):
            rc, out, err = sh(c, INVENTORY)
            assert rc == 0 and err == "", err
            got = rows(out)
            assert [r[0] for r in got] == [str(i) for i in range(n)]
            assert {r[1] for r in got} == {GPU_NAME}
            assert {int(r[2]) for r in got} == {GPU_MEMORY_MIB}
            assert all(UUID.fullmatch(r[3]) for r in got), got
            uuids += [r[3] for r in got]
            rc, out, _ = sh(c, USAGE)
            assert rc == 0 and [[int(v) for v in r] for r in rows(out)] == [
                [i, 0, 0] for i in range(n)]
            rc, out, _ = sh(c, "nvidia-smi -L")
            assert rc == 0 and out.splitlines() == [
                f"GPU {i}: {GPU_NAME} (UUID: {u})" for i, u in enumerate(uuids[-n:])]
        assert len(set(uuids)) == 6                              # distinct across hosts

        rc, out, _ = sh(c1, "nvidia-smi --query-gpu=index,bogus --format=csv,noheader")
        assert rc == 2 and out.startswith('Field "bogus" is not a valid field to query.')
        rc, out, _ = sh(c1, "nvidia-smi --bogus")
        assert rc != 0 and "is not recognized" in out

        # changed while the hosts run: added, resized, removed; kept over a power cycle
        h3.set_gpus(1, memory_mib=81920, name="NVIDIA A100-SXM4-80GB", utilization=37,
                    memory_used_mib=1024)
        assert rows(sh(c3, INVENTORY)[1])[0][:3] == ["0", "NVIDIA A100-SXM4-80GB", "81920"]
        assert rows(sh(c3, USAGE)[1]) == [["0", "37", "1024"]]
        h1.set_gpus(0)
        assert sh(c1, "command -v nvidia-smi")[0] != 0
        before = sh(c2, INVENTORY)[1]
    finally:
        for c in clients:
            c.close()
    h2.restart()
    with connect(h2, ssh_hosts) as c2:
        assert sh(c2, INVENTORY)[1] == before
    assert h2.run(INVENTORY).stdout == before


def test_gpu_standin_for_the_local_provider(tmp_path, monkeypatch):
    bindir = tmp_path / "bin"
    path = write_nvidia_smi(bindir, 2, memory_mib=[40960, 81920], utilization=[37, 0],
                            memory_used_mib=[1024, 0], uuid_seed="box-a")
    assert path == bindir / "nvidia-smi" and os.access(path, os.X_OK)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("nvidia-smi") == str(path)

    def smi(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=10)

    p = smi("--query-gpu=index,name,memory.total,uuid", "--format=csv,noheader,nounits")
    assert p.returncode == 0 and p.stderr == ""
    got = rows(p.stdout)
    assert [r[:3] for r in got] == [["0", GPU_NAME, "40960"], ["1", GPU_NAME, "81920"]]
    assert p.stdout.splitlines()[0] == f"0, {GPU_NAME}, 40960, {got[0][3]}"
    assert smi("--query-gpu=index,utilization.gpu,memory.used",
               "--format=csv,noheader,nounits").stdout == "0, 37, 1024\n1, 0, 0\n"
    # with units and a header, as the real tool prints them
    assert smi("--query-gpu=index,memory.used,memory.free,utilization.gpu",
               "--format=csv").stdout.splitlines() == [
        "index, memory.used [MiB], memory.free [MiB], utilization.gpu [%]",
        "0, 1024 MiB, 39936 MiB, 37 %", "1, 0 MiB, 81920 MiB, 0 %"]
    assert smi("--query-gpu=gpu_name,count", "--format=csv,nounits").stdout.splitlines() == [
        "name, count", f"{GPU_NAME}, 2", f"{GPU_NAME}, 2"]
    assert smi("-i", "1", "--query-gpu=index,uuid",
               "--format=csv,noheader").stdout == f"1, {got[1][3]}\n"
    assert smi("-L").stdout == "".join(
        f"GPU {i}: {GPU_NAME} (UUID: {r[3]})\n" for i, r in enumerate(got))
    # other seeds, other UUIDs: two "machines" never share a GPU
    other = write_nvidia_smi(tmp_path / "other", 2, uuid_seed="box-b")
    assert not set(subprocess.run([str(other), "-L"], capture_output=True, text=True).stdout
                   .split()) & {r[3] + ")" for r in got}
    # errors as the real tool's: message on stdout, exit status 2 (6: no such GPU)
    p = smi("--query-gpu=index,clocks.no_such", "--format=csv,noheader,nounits")
    assert (p.returncode, p.stdout) == (
        2, 'Field "clocks.no_such" is not a valid field to query.\n\n')
    for bad in (["--query-gpu=index"], ["--format=csv"], ["-L", "--format=csv"],
                ["--query-gpu=index", "--format=xml"]):
        p = smi(*bad)
        assert p.returncode == 2 and p.stdout.startswith("Invalid combination of input"), bad
    assert smi("-q").returncode == 2
    assert smi("-i", "5", "-L").returncode == 6
    assert write_nvidia_smi(bindir, 0) is None and shutil.which("nvidia-smi") != str(path)


# --------------------------------------------------------------------- torch.distributed

def launch(pool: HostPool, hosts: list[TestHost], script: str, args: str = "",
           port: int = 29500, timeout: float = 120) -> list[tuple[int, str, str]]:
    """Run tests/gang/SCRIPT as rank i of len(hosts) on hosts[i], over SSH, all at once, with
    Debian's /usr/bin/python3; the ranks meet at hosts[0]'s address. The scripts are copied
    into each host's own /root (the repository may be under /tmp, private to each host).
    Returns (exit status, stdout, stderr) per rank; each rank's metrics are in its
    /root/metrics.jsonl."""
    clients = []
    try:
        chans = []
        for rank, h in enumerate(hosts):
            dst = h.root / "home" / "gang"
            dst.mkdir(exist_ok=True)
            shutil.copy(GANG / script, dst / script)
            (h.root / "home" / "metrics.jsonl").unlink(missing_ok=True)
            clients.append(connect(h, pool))
            env = (f"GLOO_SOCKET_IFNAME=eth0 MASTER_ADDR={hosts[0].ip} MASTER_PORT={port} "
                   f"WORLD_SIZE={len(hosts)} RANK={rank} HYPER_METRICS=/root/metrics.jsonl")
            _, out, err = clients[-1].exec_command(
                f"{env} exec timeout {int(timeout)} /usr/bin/python3 /root/gang/{script} {args}",
                timeout=timeout + 10)
            chans.append((out, err))
        return [(out.channel.recv_exit_status(), out.read().decode(), err.read().decode())
                for out, err in chans]
    finally:
        for c in clients:
            c.close()


def metrics(h: TestHost) -> list[dict]:
    f = h.root / "home" / "metrics.jsonl"
    return [json.loads(line) for line in f.read_text().splitlines()] if f.exists() else []


def test_allreduce_on_three_hosts_in_their_own_network_namespaces(ssh_hosts):
    need_torch()
    hosts = ssh_hosts.start(3)
    assert len({h.netns for h in hosts}) == 3
    results = launch(ssh_hosts, hosts, "allreduce.py", "--steps 3")
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{out}\n{err}"
        assert json.loads(out.splitlines()[-1]) == {"sum": 6.0, "rank": rank, "world_size": 3,
                                                    "steps": 3}
    assert [metrics(h) for h in hosts] == [[{"sum": 6.0, "steps": 3}]] * 3


def test_ddp_training_on_three_hosts(ssh_hosts):
    need_torch()
    hosts = ssh_hosts.start(3)
    results = launch(ssh_hosts, hosts, "ddp_train.py", "--steps 30", port=29501)
    for rank, (rc, out, err) in enumerate(results):
        assert rc == 0, f"rank {rank} exited {rc}:\n{out}\n{err}"
        assert f"rank {rank}/3: weights equal to rank 0's" in out
    out = results[0][1]
    final = float(re.search(r"^final loss (\S+)$", out, re.MULTILINE).group(1))
    report = json.loads(out.splitlines()[-1])
    assert final < 0.01 < report["first_loss"] and report["world_size"] == 3
    assert metrics(hosts[0]) == [{"loss": report["loss"], "steps": 30}]
    assert metrics(hosts[1]) == metrics(hosts[2]) == []       # only rank 0 reports


def test_a_killed_host_fails_the_other_ranks(ssh_hosts):
    """What a gang restart relies on: power loss of one host ends the other ranks (gloo sees
    the connection close) well before the collective timeout."""
    need_torch()
    hosts = ssh_hosts.start(3)
    for h in hosts:
        (h.root / "home" / "gang").mkdir()
        shutil.copy(GANG / "allreduce.py", h.root / "home" / "gang")
    procs = []
    try:
        for rank, h in enumerate(hosts):    # run inside each host, output to its own /root
            cmd = (f"GLOO_SOCKET_IFNAME=eth0 MASTER_ADDR={hosts[0].ip} MASTER_PORT=29502 "
                   f"WORLD_SIZE=3 RANK={rank} exec /usr/bin/python3 /root/gang/allreduce.py "
                   "--steps 3000 --sleep 0.05 --timeout 120 > /root/out.log 2>&1")
            procs.append(subprocess.Popen(
                ["nsenter", "-t", str(h.pid), "-m", "-p", "-n", "-u", "-i", "--wdns=/root",
                 "/bin/sh", "-c", cmd], stdin=subprocess.DEVNULL))
        logs = [h.root / "home" / "out.log" for h in hosts]
        end = time.monotonic() + 60
        while not all(f.exists() and "step 5/" in f.read_text() for f in logs):
            assert all(p.poll() is None for p in procs), [f.read_text() for f in logs
                                                          if f.exists()]
            assert time.monotonic() < end, "the ranks did not reach step 5"
            time.sleep(0.1)
        killed = time.monotonic()
        hosts[2].kill()
        assert procs[2].wait(20) != 0
        for p in procs[:2]:
            assert p.wait(60) != 0
        assert time.monotonic() - killed < 60          # not the 120 s collective timeout
        for f in logs[:2]:
            text = f.read_text()
            assert "sum 6" in text and "RuntimeError" in text, text
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
