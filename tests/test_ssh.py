"""The ssh provider on real sshd hosts (tests/sshhosts.py): the quick start, containers with an
image pushed from here, live logs, host keys, and the faults — a host killed, cut off, hung,
unreachable, and `hyper run` SIGKILLed and resumed. Every fault test checks that each task ends
with exactly one successful attempt."""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.scheduler import Scheduler
from hypercli.state import State
from hypercli.workflows import prepare_run

pytestmark = pytest.mark.slow


def ssh_recipe(tmp_path: Path, pool, hosts, experiments: dict, name: str = "lab",
               **top) -> Path:
    recipe = {"name": name,
              "cluster": {"provider": "ssh", "hosts": [h.address() for h in hosts],
                          "identity_file": str(pool.client_key)},
              "experiments": experiments, **top}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


SLEEPY = {"work": {
    "parameters": {"i": [1, 2, 3, 4, 5, 6]},
    "retries": 2,
    "command": 'echo "$HYPER_ATTEMPT $(hostname)" >> "$HYPER_OUTPUT/runs"\n'
               "sleep 1.5\n"
               "echo '{\"i\": {{i}}}' >> \"$HYPER_METRICS\"",
}}


def run_in_process(path, **kw):
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True, **kw)
    try:
        return state, Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()


def assert_one_success_each(state: State, wid: str) -> None:
    for t in state.tasks(wid):
        statuses = [a["status"] for a in state.attempts(wid, t["id"])]
        assert statuses.count("succeeded") == 1, (t["id"], statuses)
        assert t["status"] == "succeeded"


def when_running_on(host_ip_prefix_node: str, wid: str) -> list[dict]:
    try:
        return [a for a in State().attempts(wid, status=["running"])
                if a["node"] == host_ip_prefix_node]
    except Exception:
        return []


def test_quickstart_on_three_ssh_hosts(ssh_hosts, tmp_path, hyper, hyper_home):
    pytest.importorskip("sklearn")
    hosts = ssh_hosts.start(3)
    if any(h.run("python3 -c 'import sklearn'").returncode for h in hosts[:1]):
        pytest.skip("the hosts' python3 has no scikit-learn (Debian: python3-sklearn)")
    qs = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    qs["experiments"]["search"]["samples"] = 6
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, qs["experiments"], name="quickstart",
                      workdir=str(ROOT / "recipes"))
    r = hyper("run", path, "--trust-new-hosts", timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(hyper("results", "quickstart", "--json", check=True).stdout)
    search = [x for x in rows if x["experiment"] == "search"]
    assert len(search) == 6 and all("accuracy" in x["metrics"] for x in search)
    nodes = {a["node"] for a in State().attempts("quickstart-1")}
    assert len(nodes) >= 2  # the work was spread over the hosts
    best = json.loads((hyper_home / "storage" / "quickstart-1" / "report-0000" /
                       "best.json").read_text())
    assert best["accuracy"] == search[0]["metrics"]["accuracy"]  # report saw all 6 outputs
    for h in hosts:
        h.kill()
    logs = hyper("logs", "quickstart-1/search-0000", check=True).stdout
    assert "accuracy" in logs  # from the copy kept here: the node is gone


def test_container_task_with_image_pushed_from_here(ssh_hosts, tiny_image, tmp_path,
                                                    hyper_home, monkeypatch):
    from sshhosts import TINY_IMAGE
    hosts = ssh_hosts.start(2)
    store = Path(tempfile.mkdtemp(prefix="hyp-", dir="/tmp"))  # podman: runroot ≤ 50 chars
    docker = tmp_path / "docker-here"
    docker.write_text("#!/bin/sh\nexec podman --root {0}/root --runroot {0}/run "
                      "--storage-driver vfs --cgroup-manager cgroupfs --events-backend file "
                      '"$@"\n'.format(store))
    docker.chmod(0o755)
    subprocess.run([str(docker), "load", "-i", str(tiny_image)], check=True,
                   capture_output=True)
    monkeypatch.setenv("HYPER_DOCKER", str(docker))
    try:
        path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"box": {
            "image": TINY_IMAGE,
            "parameters": {"v": ["a b", "$(id)"]},
            "command": 'echo "inside $(cat /etc/hostname 2>/dev/null) {{v}}"\n'
                       "busybox | head -1\n"
                       'printf %s {{v}} > "$HYPER_OUTPUT/v"\n'
                       'printf %s {{v}} > "$HYPER_CHECKPOINT/state"\n'  # bound in the box
                       'echo "{\\"ok\\": 1}" >> "$HYPER_METRICS"'}})
        state, summary = run_in_process(path)
    finally:
        subprocess.run([str(docker), "system", "reset", "--force"], capture_output=True)
        shutil.rmtree(store, ignore_errors=True)
    assert summary.exit_code == 0, [(a["id"], a["status"], a["error"])
                                    for a in state.attempts(summary.workflow)]
    out = hyper_home / "storage" / summary.workflow
    assert {(out / t["id"] / "v").read_text() for t in state.tasks(summary.workflow)} == \
        {"a b", "$(id)"}
    assert all(t["metrics"] == {"ok": 1} for t in state.tasks(summary.workflow))
    box = state.attempts(summary.workflow, "box-0000")[0]["id"]
    log = (hyper_home / "logs" / box / "stdout").read_text()
    assert "BusyBox" in log
    from hypercli.mount.checkpoint import restore  # the container's checkpoint was saved
    for t, v in (("box-0000", "a b"), ("box-0001", "$(id)")):
        got = tmp_path / "ck" / t
        kept = out / ".checkpoints" / t
        assert restore(f"file://{kept}", got, tmp_path / f"{t}.json").generation
        assert (got / "state").read_text() == v
    used = {a["node"] for a in state.attempts(summary.workflow)}
    for h in hosts:  # the image reached the hosts that ran a task, by push (no registry)
        has = h.run(f"docker image inspect {TINY_IMAGE} >/dev/null 2>&1").returncode == 0
        assert has == any(n.endswith(str(hosts.index(h))) for n in used)


def test_host_killed_mid_task_reruns_elsewhere(ssh_hosts, tmp_path, hyper_home):
    hosts = ssh_hosts.start(3)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, SLEEPY)
    killed = {}

    def kill_when_running():
        running = wait_for(lambda: when_running_on("lab-0", "lab-1"), what="a task on lab-0")
        killed["attempt"] = running[0]["id"]
        killed["at"] = time.time()
        hosts[0].kill()
    t = threading.Thread(target=kill_when_running)
    t.start()
    state, summary = run_in_process(path)
    t.join()
    assert summary.exit_code == 0
    assert_one_success_each(state, "lab-1")
    lost = [a for a in state.attempts("lab-1") if a["id"] == killed["attempt"]][0]
    assert lost["status"] == "lost"
    retry = [a for a in state.attempts("lab-1", lost["task"]) if a["status"] == "succeeded"][0]
    assert retry["node"] != "lab-0"
    assert retry["created_at"] - killed["at"] < 10  # back to work within 10 s
    assert state.nodes("lab", status="lost")[0]["name"] == "lab-0"


def test_host_cut_off_is_detected_and_fenced_when_it_comes_back(ssh_hosts, tmp_path,
                                                                 hyper_home):
    hosts = ssh_hosts.start(3)
    long = {"work": dict(SLEEPY["work"], command=SLEEPY["work"]["command"].replace(
        "sleep 1.5", 'echo "$HYPER_ATTEMPT $(hostname)"; sleep 4'))}
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, long)
    seen = {}

    def cut_then_heal():
        running = wait_for(lambda: when_running_on("lab-0", "lab-1"), what="a task on lab-0")
        seen["attempt"] = running[0]["id"]
        seen["cut"] = time.time()
        hosts[0].cut()
        wait_for(lambda: State().nodes("lab", status="lost"), timeout=15, what="lost node")
        seen["lost"] = time.time()
        hosts[0].heal()
    t = threading.Thread(target=cut_then_heal)
    t.start()
    state, summary = run_in_process(path)
    t.join()
    assert summary.exit_code == 0
    # declared lost by a late answer and a TCP probe (~3 s; the benchmark measures it), not
    # by TCP's own timeouts (minutes)
    assert seen["lost"] - seen["cut"] < 10
    assert_one_success_each(state, "lab-1")
    lost = [a for a in state.attempts("lab-1") if a["id"] == seen["attempt"]][0]
    assert lost["status"] == "lost"
    # the node came back: the attempt declared lost there was stopped, not counted
    # (its stdout: a stopped attempt's own output folder is removed, never the task's)
    runs = hosts[0].run(f"cat /root/.hyper/tasks/{lost['id']}/stdout").stdout
    pid = json.loads(hosts[0].run(f"cat /root/.hyper/tasks/{lost['id']}/pid").stdout)["pid"]
    assert hosts[0].run(f"kill -0 {pid}").returncode != 0
    # the lost attempt ran there once (a retry may run there too once the node is back)
    assert [ln for ln in runs.splitlines() if ln.startswith("1 ")] == ["1 h1"]
    winner = [a for a in state.attempts("lab-1", lost["task"]) if a["status"] == "succeeded"]
    assert len(winner) == 1 and winner[0]["number"] > lost["number"]


def test_stalled_agent_on_a_live_host_is_not_lost(ssh_hosts, tmp_path, hyper_home):
    """An agent that answers late (stopped 4 s: longer than its answer's grace and the TCP
    probe together) on a host whose network works is waited for, not declared lost."""
    hosts = ssh_hosts.start(2)
    slow = {"work": dict(SLEEPY["work"], command=SLEEPY["work"]["command"].replace(
        "sleep 1.5", "sleep 3"))}
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, slow)
    seen = {}

    def stall():
        wait_for(lambda: when_running_on("lab-0", "lab-1"), what="a task on lab-0")
        pids = hosts[0].run("pgrep -f 'agent-.*[.]py serve'").stdout.split()
        assert pids, "no agent process on h1"
        seen["pids"] = pids
        hosts[0].run("kill -STOP " + " ".join(pids), check=True)
        time.sleep(4)
        hosts[0].run("kill -CONT " + " ".join(pids), check=True)
    t = threading.Thread(target=stall)
    t.start()
    try:
        state, summary = run_in_process(path)
    finally:
        t.join()
    assert seen.get("pids")
    assert summary.exit_code == 0
    assert state.nodes("lab", status="lost") == []
    assert_one_success_each(state, "lab-1")
    assert all(t["attempts"] == 1 for t in state.tasks("lab-1"))


def test_hung_host_is_declared_lost(ssh_hosts, tmp_path, hyper_home):
    hosts = ssh_hosts.start(2)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, SLEEPY)
    seen = {}

    def freeze():
        wait_for(lambda: when_running_on("lab-0", "lab-1"), what="a task on lab-0")
        seen["at"] = time.time()
        hosts[0].freeze()
        wait_for(lambda: State().nodes("lab", status="lost"), timeout=20, what="lost node")
        seen["lost"] = time.time()
    t = threading.Thread(target=freeze)
    t.start()
    try:
        state, summary = run_in_process(path)
    finally:
        t.join()
        hosts[0].thaw()
    assert summary.exit_code == 0
    assert seen["lost"] - seen["at"] < 15
    assert_one_success_each(state, "lab-1")


def test_sigkilled_run_resumes_over_ssh(ssh_hosts, tmp_path, hyper_home, hyper):
    hosts = ssh_hosts.start(2)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, SLEEPY)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path), "--trust-new-hosts"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        running = wait_for(lambda: len(State().attempts("lab-1", status=["running"])) >= 2
                           and State().attempts("lab-1", status=["running"]),
                           what="2 running attempts", proc=p)
    except AssertionError as e:
        p.kill()
        p.wait()
        raise AssertionError(f"{e}\nnodes: {State().nodes('lab')}\n"
                             f"attempts: {State().attempts('lab-1')}") from None
    p.kill()
    p.wait()
    r = hyper("run", path)
    assert r.returncode == 0, r.stdout + r.stderr
    state = State()
    assert_one_success_each(state, "lab-1")
    for a in running:  # re-attached on the hosts, not started again
        assert state.task("lab-1", a["task"])["attempts"] == 1
    for t in state.tasks("lab-1"):
        runs = (hyper_home / "storage" / "lab-1" / t["id"] / "runs").read_text()
        assert len(runs.splitlines()) == 1


def test_cancel_and_logs_follow_over_ssh(ssh_hosts, tmp_path, hyper_home, hyper):
    hosts = ssh_hosts.start(1)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"tick": {
        "command": "for i in 1 2 3 4 5 6 7 8 9 10; do echo tick $i; sleep 0.3; done; "
                   "sleep 30"}})
    p = subprocess.Popen([*hyper_cmd(), "run", str(path), "--trust-new-hosts"], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: State().attempts("lab-1", status=["running"]), what="running", proc=p)
    follow = subprocess.Popen([*hyper_cmd(), "logs", "tick", "-f"], stdout=subprocess.PIPE,
                              text=True, cwd=ROOT)
    first = follow.stdout.readline()
    assert first.startswith("tick ")
    wait_for(lambda: "tick 10" in (hyper("logs", "tick").stdout), timeout=15, what="tick 10")
    r = hyper("cancel", "lab-1")
    assert r.returncode == 0, r.stderr
    follow.wait(timeout=30)
    rest = follow.stdout.read()  # (after readline: what its buffer holds too)
    assert "tick 10" in first + rest  # -f streamed until the attempt ended
    assert p.wait(timeout=30) == 1
    [a] = State().attempts("lab-1")
    pid = json.loads(hosts[0].run(f"cat /root/.hyper/tasks/{a['id']}/pid").stdout)["pid"]
    assert hosts[0].run(f"kill -0 -{pid}").returncode != 0  # its process group is gone
    assert State().tasks("lab-1")[0]["status"] == "cancelled"


def test_host_keys_wrong_and_unreachable_hosts(ssh_hosts, tmp_path, hyper_home, hyper):
    hosts = ssh_hosts.start(2)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"x": {"command": "true"}})
    r = hyper("up", path)  # first contact without --trust-new-hosts: refused
    assert r.returncode == 3 and "--trust-new-hosts" in r.stderr and "SHA256:" in r.stderr
    assert hyper("up", path, "--trust-new-hosts").returncode == 0
    assert hyper("up", path).returncode == 0  # pinned now
    pinned = hyper_home / "known_hosts" / "lab"
    other = hosts[1].host_key_line.split()[1:]  # h2's key pinned for h1: a changed key
    lines = [ln for ln in pinned.read_text().splitlines() if not ln.startswith(hosts[0].ip)]
    pinned.write_text("\n".join(lines + [f"{hosts[0].ip} {' '.join(other)}"]) + "\n")
    r = hyper("up", path)
    assert r.returncode == 0  # the other host goes on
    assert "CHANGED" in r.stderr and hosts[0].ip in r.stderr and "lab-1" in r.stdout
    # an unreachable host (a closed port on loopback) and a refused key: errors per host
    bad_key = tmp_path / "not-authorized"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(bad_key)],
                   check=True)
    path2 = tmp_path / "mixed.yaml"
    path2.write_text(yaml.safe_dump({"name": "mixed", "cluster": {
        "provider": "ssh", "identity_file": str(ssh_hosts.client_key),
        "hosts": ["root@127.0.0.1:1", hosts[1].address()]},
        "experiments": {"x": {"command": "hostname"}}}))
    r = hyper("run", path2, "--trust-new-hosts")
    assert r.returncode == 0, r.stderr
    assert "127.0.0.1" in r.stderr and "Connection refused" in r.stderr
    spec = {"provider": "ssh", "identity_file": str(bad_key), "hosts": [hosts[1].address()]}
    path3 = tmp_path / "badkey.yaml"
    path3.write_text(yaml.safe_dump({"name": "badkey", "cluster": spec,
                                     "experiments": {"x": {"command": "true"}}}))
    r = hyper("up", path3, "--trust-new-hosts")
    assert r.returncode == 3 and "refused the key" in r.stderr and "Traceback" not in r.stderr


def test_missing_image_fails_its_tasks_not_the_node(ssh_hosts, tmp_path, hyper_home):
    hosts = ssh_hosts.start(1)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {
        "boxed": {"image": "localhost/no-such-image:1", "command": "true"},
        "plain": {"parameters": {"i": [1, 2]}, "command": "echo fine"}})
    state, summary = run_in_process(path)
    assert summary.exit_code == 1
    [boxed] = state.attempts("lab-1", "boxed-0000")
    assert boxed["status"] == "failed" and "no-such-image" in boxed["error"]
    assert {t["status"] for t in state.tasks("lab-1") if t["experiment"] == "plain"} == \
        {"succeeded"}
    assert state.nodes("lab")[0]["status"] == "up"  # the node was not declared lost


def test_cancel_stops_the_container(ssh_hosts, tiny_image, tmp_path, hyper_home):
    from sshhosts import TINY_IMAGE, load_image
    hosts = ssh_hosts.start(1)
    load_image(hosts[0], tiny_image)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"box": {
        "image": TINY_IMAGE, "command": "echo started; sleep 60"}})
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    sched = Scheduler(state, wid, provider, nodes)

    def cancel_when_running():
        wait_for(lambda: hosts[0].run("docker ps -q").stdout.strip(), timeout=60,
                 what="the container")
        from hypercli.workflows import cancel
        cancel(State(), wid)
    t = threading.Thread(target=cancel_when_running)
    t.start()
    try:
        summary = sched.run()
    finally:
        t.join()
        lock.release()
    assert summary.exit_code == 1
    assert state.tasks(wid)[0]["status"] == "cancelled", state.attempts(wid)
    assert hosts[0].run("docker ps -q").stdout.strip() == ""  # the container is gone too


def test_small_logs_come_inline_large_logs_and_outputs_by_tar(ssh_hosts, tmp_path, hyper_home,
                                                              monkeypatch):
    """An ended attempt's logs up to 64 KiB come back in the agent's poll answer; only large
    logs and output folders with files cost a second exec (a tar stream)."""
    from hypercli.ssh.conn import Connection
    hosts = ssh_hosts.start(1)
    tars = []
    real_run = Connection.run

    def counting_run(self, command, **kw):
        if "tar -cf -" in command:
            tars.append(command)
        return real_run(self, command, **kw)
    monkeypatch.setattr(Connection, "run", counting_run)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {
        "quiet": {"parameters": {"i": [1, 2, 3]},
                  "command": "echo small {{i}}; echo err {{i}} >&2"},
        "loud": {"command": "head -c 300000 /dev/zero | tr '\\0' x"},
        "saves": {"command": 'echo kept > "$HYPER_OUTPUT/result.txt"'}})
    state, summary = run_in_process(path)
    assert summary.exit_code == 0, [(a["id"], a["status"], a["error"])
                                    for a in state.attempts(summary.workflow)]
    hosts[0].kill()  # everything below is read from the copies kept here
    logs = hyper_home / "logs"
    for i, task in enumerate(["quiet-0000", "quiet-0001", "quiet-0002"], 1):
        d = logs / state.attempts(summary.workflow, task)[0]["id"]
        assert (d / "stdout").read_text() == f"small {i}\n"
        assert (d / "stderr").read_text() == f"err {i}\n"
    loud = state.attempts(summary.workflow, "loud-0000")[0]["id"]
    assert (logs / loud / "stdout").read_bytes() == b"x" * 300000
    # `hyper logs` with the node gone: from the copies; empty streams have no file
    from hypercli.workflows import log_chunks
    quiet = state.attempts(summary.workflow, "quiet-0001")[0]
    assert list(log_chunks(state, quiet)) == [("stdout", b"small 2\n"), ("stderr", b"err 2\n")]
    saves = state.attempts(summary.workflow, "saves-0000")[0]
    assert (logs / saves["id"]).is_dir() and not any((logs / saves["id"]).iterdir())
    assert list(log_chunks(state, saves)) == []
    storage = hyper_home / "storage" / "lab-1"
    assert (storage / "saves-0000" / "result.txt").read_text() == "kept\n"
    assert (storage / "quiet-0000").is_dir() and not any((storage / "quiet-0000").iterdir())
    # tar streams for the loud log and the saved output only (one or two, as the ends
    # batch); nothing for the quiet tasks
    joined = " ".join(tars)
    assert 1 <= len(tars) <= 2 and "quiet" not in joined, tars
    assert f"tasks/{loud}/stdout" in joined and "outputs/lab-1/saves-0000" in joined
    assert "saves-0000.1/stdout" not in joined
