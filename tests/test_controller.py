"""A controller on an SSH test host drives a workflow on three others while the machine that
ran ``hyper run`` is gone (tests/sshhosts.py): the run SIGKILLed right after the handover and
a worker host killed mid-run; the controller's host killed mid-run and the workflow taken
over from the backups on the nodes. Every task ends with exactly one success."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sysconfig

import pytest
import yaml

from conftest import ROOT, hyper_cmd, wait_for

pytestmark = pytest.mark.slow

PACKAGES = sysconfig.get_paths()["purelib"]

#: each start is counted on its host (private /root); tasks from {gate} on wait, once
#: started, for the test to open the gate (/root/go on their host): the faults come while
#: they run, however loaded the machine is
COMMAND = ("echo {{i}} >> /root/starts\n"
           "echo hello {{i}}\n"
           "if [ {{i}} -ge %d ]; then while [ ! -e /root/go ]; do sleep 0.2; done; fi\n"
           "sleep 1\n"
           "echo '{\"i\": {{i}}}' >> \"$HYPER_METRICS\"")


def open_gate(hosts) -> None:
    for h in hosts:
        h.run("touch /root/go", check=True)


def controller_recipe(tmp_path, pool, controller, workers, name: str = "far", gate: int = 3,
                      tasks: int = 9, env: str = ""):
    """A recipe of the ssh cluster ``workers`` driven by the host ``controller``, whose
    Python runs with this checkout's packages (the hosts' /usr/bin/python3 is the same 3.11;
    this Python's own binary lives under /root, which each host has its own of), and
    ``env`` (``NAME=value ...``) in its environment; ``tasks`` tasks, those from ``gate`` on
    waiting for :func:`open_gate`."""
    controller.run(f"printf '#!/bin/sh\\n{env} PYTHONPATH=\"$PYTHONPATH:{PACKAGES}\" exec "
                   f"/usr/bin/python3 \"$@\"\\n' > /root/py3 && chmod +x /root/py3", check=True)
    recipe = {"name": name, "workdir": "none",
              "cluster": {"provider": "ssh", "hosts": [h.address() for h in workers],
                          "identity_file": str(pool.client_key),
                          "controller": controller.address(), "controller_python": "/root/py3"},
              "experiments": {"work": {"parameters": {"i": list(range(tasks))}, "retries": 2,
                                       "command": COMMAND % gate}}}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def on_controller(host, code: str) -> str:
    """Run Python ``code`` on the controller host against its own state file."""
    r = host.run("cd /root && HYPER_HOME=/root/.hyper/controller "
                  "PYTHONPATH=$(ls -d /root/.hyper/lib/* | head -1) /root/py3 -c "
                  + json.dumps(code), timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def attempts_there(host, wid: str) -> list[dict]:
    return json.loads(on_controller(host, (
        "import json; from hypercli.state import State; "
        f"print(json.dumps(State().attempts({wid!r})))")))


def starts(workers) -> list[str]:
    """Every task start on the worker hosts still up (one line per start)."""
    out = []
    for h in workers:
        r = h.run("cat /root/starts 2>/dev/null")
        out += r.stdout.split()
    return out


#: files beside a workflow's backups on a node that are not its own: kept when they go
DECOYS = ("other-1.abc.json", "other-1.abc.blob", "notes.txt")


def plant_decoys(workers) -> None:
    for h in workers:
        h.run("mkdir -p /root/.hyper/controller && cd /root/.hyper/controller && touch "
              + " ".join(DECOYS), check=True)


def backups_of(workers, wid: str) -> list[str]:
    """The files of ``wid``'s backups left on the worker hosts still up, but for the lease
    record (and its lock file) that stays once they are dropped: held with no expiry, ended."""
    out = []
    for h in workers:
        mine = [f for f in h.run("ls /root/.hyper/controller").stdout.split()
                if f.startswith(f"{wid}.")]
        for f in [f for f in mine if f.endswith(".json")]:
            lease = json.loads(h.run(f"cat /root/.hyper/controller/{f}").stdout or "{}")
            if lease.get("ended") is True and lease.get("ttl") is None:
                mine = [x for x in mine if x not in (f, f[:-len(".json")] + ".lock")]
        out += mine
    return out


def decoys_kept(workers) -> bool:
    return all(set(DECOYS) <= set(h.run("ls /root/.hyper/controller").stdout.split())
               for h in workers)


def ps(hyper, wid: str) -> list[dict]:
    r = hyper("ps", wid, "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    return json.loads(r.stdout)


def test_workflow_goes_on_without_this_machine_and_a_lost_worker(ssh_hosts, tmp_path, hyper,
                                                                  hyper_home):
    """`hyper run --controller` SIGKILLed right after the handover, then the host under a
    running task killed: the controller re-runs its tasks on the other hosts, every task
    one success recorded there, and `hyper results` here shows them all, also once the
    controller is gone."""
    hosts = ssh_hosts.start(4, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers, gate=0)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path), "--controller", "--trust-new-hosts"],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        line = wait_for(lambda: (lambda s: s if "driven by the controller" in s else None)(
            p.stdout.readline()), timeout=300, what="the handover", proc=p)
    finally:
        p.send_signal(signal.SIGKILL)
        p.communicate()
    wid = line.split()[0]
    name = f"root@{controller.ip}:22"
    r = hyper("status", timeout=60)
    assert f"controller {name}  up  drives {wid}" in r.stdout, r.stdout + r.stderr
    r = hyper("down", "--controller", name, timeout=60)  # it drives a workflow: refused
    assert r.returncode == 2 and f"drives {wid}" in r.stderr, r.stdout + r.stderr
    victim = wait_for(lambda: next((r["nodes"][0] for r in ps(hyper, wid)
                                    if r["status"] == "running"), None),
                      timeout=300, interval=0.2, what="a task running")
    dead = workers[int(victim.rsplit("-", 1)[1])]  # node far-i is workers[i]
    dead.kill()
    open_gate(w for w in workers if w is not dead)
    r = hyper("attach", wid, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    there = attempts_there(controller, wid)
    by_task: dict[str, list] = {}
    for a in there:
        by_task.setdefault(a["task"], []).append(a["status"])
    assert len(by_task) == 9
    for task, statuses in by_task.items():
        assert statuses.count("succeeded") == 1, (task, statuses)
    assert any("lost" in s for s in by_task.values())  # the killed host's work was re-run
    # the drive ended: its SSH connections to the nodes are closed (the service lives on
    # for IDLE_EXIT s, and kept them open until it exited, three more per workflow)
    wait_for(lambda: controller.run("ss -tn state established | grep -c ':22 *$'"
                                    ).stdout.strip() == "0",
             timeout=15, interval=0.5, what="the drive's connections closed")
    r = hyper("down", "--controller", name, timeout=120)
    assert r.returncode == 0 and "removed" in r.stdout, r.stdout + r.stderr
    assert controller.run("ls /root/.hyper").stdout.split() == ["lib"]  # its folder is gone
    controller.kill()  # the records were copied here when the workflow ended
    r = hyper("results", wid, "--json", timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(r.stdout)
    assert sorted(row["metrics"]["i"] for row in rows) == list(range(9))
    assert {row["status"] for row in rows} == {"succeeded"}
    r = hyper("logs", f"{wid}/work-0004", timeout=60)  # the log copies came too
    assert r.returncode == 0 and "hello 4" in r.stdout, r.stdout + r.stderr


def test_a_run_followed_here_to_its_end_copies_the_records_and_stops_its_follower(
        ssh_hosts, tmp_path, hyper, hyper_home):
    """`hyper run --controller` followed here to the end: the progress shown as it comes over
    one `follow` process on the controller, the run's exit status the workflow's, its records
    and log copies here, and no follower left on the controller after."""
    hosts = ssh_hosts.start(3, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers, gate=4, tasks=4)
    r = hyper("run", path, "--controller", "--trust-new-hosts", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "work 4/4 done" in r.stdout and "workflow far-1: succeeded" in r.stdout, r.stdout
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    r = hyper("results", wid, "--json", timeout=60)
    assert sorted(row["metrics"]["i"] for row in json.loads(r.stdout)) == list(range(4))
    r = hyper("logs", f"{wid}/work-0002", timeout=60)
    assert r.returncode == 0 and "hello 2" in r.stdout, r.stdout + r.stderr
    assert controller.run("pgrep -f 'hypercli[.]controller follow'").stdout.strip() == ""


def test_controller_killed_is_taken_over_from_the_backups(ssh_hosts, tmp_path, hyper,
                                                          hyper_home):
    """The controller's host killed mid-run: `hyper attach` reads the newest backup from the
    nodes, waits out the lease and drives the workflow here; every task one success, none
    started twice. Once it ended here, the controller's backups of it are removed from the
    nodes, and nothing else there."""
    hosts = ssh_hosts.start(4, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers)
    r = hyper("run", path, "--controller", "--trust-new-hosts", "-d", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    wait_for(lambda: sum(row["status"] == "succeeded" for row in ps(hyper, wid)) >= 2,
             timeout=300, interval=0.5, what="two tasks done on the controller")
    controller.kill()
    assert backups_of(workers, wid)  # the controller's backups are on the nodes
    plant_decoys(workers)
    open_gate(workers)
    r = hyper("ps", wid, timeout=60)  # the next command sees it
    assert "does not answer" in r.stderr, r.stdout + r.stderr
    r = hyper("attach", wid, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "took" in r.stdout and "over from the controller" in r.stdout, r.stdout
    rows = ps(hyper, wid)
    assert [row["status"] for row in rows] == ["succeeded"] * 9
    assert [row["attempts"] for row in rows] == [1] * 9
    assert sorted(starts(workers), key=int) == [str(i) for i in range(9)]  # none twice
    # ended here (the background driver): the backups go, nothing else on the nodes does
    wait_for(lambda: not backups_of(workers, wid), timeout=60, interval=0.5,
             what="the controller's backups removed once the workflow ended here")
    assert decoys_kept(workers)


def test_a_launch_known_only_to_its_node_is_taken_over_not_run_again(ssh_hosts, tmp_path,
                                                                      hyper, hyper_home):
    """The controller dies after its launches reached their nodes and before their intents
    reached any other replica (the test seam HYPER_TEST_UNSAFE_NO_APPENDS: the controller
    appends no intent and writes no records after the handover's): each node kept its own
    launch's witness beside the backups, so `hyper attach` finds every attempt there and
    re-attaches it, though another workflow run from here meanwhile took a slot on the
    first node (a driver that did not know the attempts would place their tasks anew, on
    other nodes). Each task starts once and succeeds with its first attempt."""
    hosts = ssh_hosts.start(4, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers, gate=0, tasks=3,
                             env="HYPER_TEST_UNSAFE_NO_APPENDS=1")
    r = hyper("run", path, "--controller", "--trust-new-hosts", "-d", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    wait_for(lambda: len(starts(workers)) >= 3, timeout=300, interval=0.5,
             what="the three tasks started by the controller")
    controller.kill()
    # each node holds the signed intent of the attempt launched there, and no other does
    for h in workers:
        lines = h.run(f"cat /root/.hyper/controller/{wid}.*.intents").stdout.splitlines()
        assert len(lines) == 1 and len(json.loads(lines[0])["rows"]) == 1, lines
    other = yaml.safe_load(path.read_text())
    other["name"], other["cluster"]["name"] = "near", "far"
    del other["cluster"]["controller"], other["cluster"]["controller_python"]
    other["experiments"] = {"hold": {"command": "while [ ! -e /root/go2 ]; do sleep 0.2; "
                                                "done"}}
    near = tmp_path / "near.yaml"
    near.write_text(yaml.safe_dump(other, sort_keys=False))
    r = hyper("run", near, "-d", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    held = re.search(r"near-[0-9]+", r.stdout).group(0)
    wait_for(lambda: [row["status"] for row in ps(hyper, held)] == ["running"],
             timeout=300, interval=0.5, what="the other workflow's task running")
    open_gate(workers)
    try:
        r = hyper("attach", wid, timeout=600)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "took" in r.stdout and "over from the controller" in r.stdout, r.stdout
        rows = ps(hyper, wid)
        assert [(row["status"], row["attempts"]) for row in rows] == [("succeeded", 1)] * 3
        assert sorted(starts(workers), key=int) == ["0", "1", "2"]  # none twice
    finally:
        for h in workers:
            h.run("touch /root/go2")
        wait_for(lambda: [row["status"] for row in ps(hyper, held)] == ["succeeded"],
                 timeout=300, interval=0.5, what="the other workflow's end")


def test_a_controller_cut_off_and_back_stops_driving_what_was_taken_over(ssh_hosts, tmp_path,
                                                                         hyper, hyper_home):
    """The controller's network cut: `hyper attach` waits out its lease and takes the
    workflow over; the network back, the controller finds another holder on the backups and
    stops driving it (two drivers never drive one workflow): every task one success, none
    started twice."""
    hosts = ssh_hosts.start(4, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers)
    r = hyper("run", path, "--controller", "--trust-new-hosts", "-d", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    wait_for(lambda: sum(row["status"] == "succeeded" for row in ps(hyper, wid)) >= 2,
             timeout=300, interval=0.5, what="two tasks done on the controller")
    controller.cut()
    open_gate(workers)
    p = subprocess.Popen([*hyper_cmd(), "attach", wid], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: "took" in (p.stdout.readline() or ""), timeout=300,
                 what="the takeover", proc=p)
        controller.heal()
        out, _ = p.communicate(timeout=600)
    finally:
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out
    lost = wait_for(lambda: json.loads(on_controller(controller, (
        "import json; from hypercli.state import State; "
        f"print(json.dumps(State().workflow({wid!r})['spec']['lease'].get('lost')))"))),
        timeout=120, interval=1, what="the controller to see the lease taken")
    assert "driven by here" in lost, lost
    rows = ps(hyper, wid)
    assert [row["status"] for row in rows] == ["succeeded"] * 9
    assert sorted(starts(workers), key=int) == [str(i) for i in range(9)]  # none twice


def test_run_again_takes_over_from_a_dead_controller(ssh_hosts, tmp_path, hyper, hyper_home):
    """The controller's host killed mid-run: `hyper run RECIPE` again takes the workflow
    over from the backups and drives it here to its end; none started twice. Then the
    controller's backups of it are gone from the nodes, and nothing else there."""
    hosts = ssh_hosts.start(4, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers)
    r = hyper("run", path, "-d", "--trust-new-hosts", timeout=300)  # controller: in the recipe
    assert r.returncode == 0, r.stdout + r.stderr
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    wait_for(lambda: sum(row["status"] == "succeeded" for row in ps(hyper, wid)) >= 1,
             timeout=300, interval=0.5, what="a task done on the controller")
    controller.kill()
    assert backups_of(workers, wid)
    plant_decoys(workers)
    open_gate(workers)
    r = hyper("run", path, "--on-interrupt", "cancel", timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"driving {wid} here" in r.stdout, r.stdout
    rows = ps(hyper, wid)
    assert [row["status"] for row in rows] == ["succeeded"] * 9
    assert sorted(starts(workers), key=int) == [str(i) for i in range(9)]  # none twice
    # ended here (this run): its records are in the state file, the backups are gone
    assert not backups_of(workers, wid) and decoys_kept(workers)


def test_a_workflow_ended_on_a_dead_controller_is_taken_over_complete(ssh_hosts, tmp_path,
                                                                      hyper, hyper_home):
    """The workflow ends on the controller while nothing here looks (`-d`), then the
    controller's host dies before its records were copied here: `hyper attach` takes it over
    from the backups, whose last change (the workflow's end) is in the log beside the whole
    copy, and finds it ended: nothing runs again, the results are all here, and the
    controller's backups of it are gone from the nodes, nothing else there."""
    hosts = ssh_hosts.start(3, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers, gate=9)  # no gate
    r = hyper("run", path, "-d", "--trust-new-hosts", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    wait_for(lambda: json.loads(on_controller(controller, (
        "import json; from hypercli.state import State; "
        f"print(json.dumps(State().workflow({wid!r})['status']))"))) == "succeeded",
        timeout=300, interval=0.5, what="the workflow's end on the controller")
    wait_for(lambda: "intent appends" in controller.run(
        "cat /root/.hyper/controller/controller.log").stdout, timeout=60, interval=0.5,
        what="the drive's end (its last backup written)")
    controller.kill()
    plant_decoys(workers)
    r = hyper("attach", wid, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "took" in r.stdout and "over from the controller" in r.stdout, r.stdout
    rows = ps(hyper, wid)
    assert [(row["status"], row["attempts"]) for row in rows] == [("succeeded", 1)] * 9
    assert sorted(starts(workers), key=int) == [str(i) for i in range(9)]  # none again
    r = hyper("results", wid, "--json", timeout=60)
    assert sorted(row["metrics"]["i"] for row in json.loads(r.stdout)) == list(range(9))
    assert not backups_of(workers, wid) and decoys_kept(workers)


def _handed_over(ssh_hosts, tmp_path, hyper) -> tuple:
    """(controller host, worker hosts, workflow id): a gated workflow on 2 worker hosts
    handed to a controller on a third by ``hyper run -d``."""
    hosts = ssh_hosts.start(3, share=(ROOT, PACKAGES))
    controller, workers = hosts[0], hosts[1:]
    path = controller_recipe(tmp_path, ssh_hosts, controller, workers, gate=0)
    r = hyper("run", path, "-d", "--trust-new-hosts", timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wid = next(line.split()[0] for line in r.stdout.splitlines()
               if "is driven by the controller" in line)
    return controller, workers, wid


def test_cancel_is_done_by_the_controller(ssh_hosts, tmp_path, hyper, hyper_home):
    """`hyper cancel` of a workflow a controller drives cancels it there: its running tasks
    stop on their nodes, and the records copied here say so."""
    controller, workers, wid = _handed_over(ssh_hosts, tmp_path, hyper)
    wait_for(lambda: any(row["status"] == "running" for row in ps(hyper, wid)),
             timeout=300, interval=0.5, what="a task running")
    r = hyper("cancel", wid, timeout=120)
    assert r.returncode == 0 and f"cancelled {wid}" in r.stdout, r.stdout + r.stderr
    r = hyper("ps", "--json", timeout=60)
    assert [w["status"] for w in json.loads(r.stdout) if w["workflow"] == wid] == ["cancelled"]
    statuses = {row["status"] for row in ps(hyper, wid)}
    assert "cancelled" in statuses and statuses <= {"cancelled", "succeeded"}, statuses
    for h in workers:  # nothing of it runs on the nodes
        assert "sleep 0.2" not in h.run("ps -eo args").stdout


def _ui(path: str, base: str, jar, page: bool = False) -> dict | None:
    """The dashboard's answer at ``path`` (JSON; a ``page`` is only read)."""
    import urllib.request
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(jar))
    with opener.open(base + path, timeout=30) as r:
        data = r.read()
    return None if page else json.loads(data)


def test_top_cost_and_ui_show_what_the_controller_knows(ssh_hosts, tmp_path, hyper,
                                                        hyper_home):
    """`hyper top`, `hyper cost` and `hyper ui` on a workflow a controller drives ask the
    controller, each before anything else copied what it needs here: top shows the running
    tasks under their nodes (nothing was copied since the handover), then the nodes'
    utilisation samples; cost counts an instance in the controller's ledger (one it
    launched, as a cloud controller does for a replacement); the dashboard shows its tasks
    running, then all succeeded. Once the records are copied here at the
    end, the workflow's backups are removed from the nodes."""
    import http.cookiejar
    import time
    controller, workers, wid = _handed_over(ssh_hosts, tmp_path, hyper)
    running = wait_for(lambda: sorted(a["task"] for a in attempts_there(controller, wid)
                                      if a["status"] == "running"),
                       timeout=300, interval=0.5, what="tasks running on the controller")

    def top():
        r = hyper("top", "--once", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout
    out = top()
    assert f"{wid}/{running[0]}" in out, out
    sampled = wait_for(lambda: (lambda o: o if any(
        line.split()[0].startswith("far-") and "%" in line.split()[2]
        for line in o.splitlines() if len(line.split()) > 2) else None)(top()),
        timeout=120, interval=1, what="a node's utilisation sample in hyper top")
    assert "far-" in sampled

    cluster = json.loads(on_controller(controller, (
        "import json; from hypercli.state import State; "
        f"print(json.dumps(State().workflow({wid!r})['cluster']))")))
    node = next(a["node"] for a in attempts_there(controller, wid))
    on_controller(controller, (
        "from hypercli.state import State; State().ledger_launch("
        f"{cluster!r}, {node!r}, 'i-0123', {{'cloud': 'aws', 'region': 'us-east-1', "
        f"'instance_type': 'm5.large', 'spot': True, 'price': 3.6, "
        f"'launched_at': {time.time() - 600}}})"))
    r = hyper("cost", wid, "--json", timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = json.loads(r.stdout)
    assert [(n["node"], n["price"]) for n in got["nodes"]] == [(node, 3.6)], got
    assert got["total"] > 0 and [w["workflow"] for w in got["workflows"]] == [wid], got

    p = subprocess.Popen([*hyper_cmd(), "ui", "--port", "0"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        url = wait_for(lambda: (lambda s: s.strip() if "http://" in s else None)(
            p.stdout.readline()), timeout=60, what="the dashboard's URL", proc=p)
        base, token = url.split("/?token=")
        jar = http.cookiejar.CookieJar()
        _ui(f"/?token={token}", base, jar, page=True)  # the cookie
        shown = wait_for(lambda: (lambda d: d if {t["id"] for t in d["tasks"]
                                                  if t["status"] == "running"} else None)(
            _ui(f"/api/w/{wid}", base, jar)), timeout=60, interval=0.5,
            what="the dashboard showing the controller's running tasks")
        assert {t["id"] for t in shown["tasks"] if t["status"] == "running"} & set(running)

        open_gate(workers)
        wait_for(lambda: _ui(f"/api/w/{wid}", base, jar)["status"] == "succeeded",
                 timeout=300, interval=1, what="the dashboard showing the workflow's end")
        assert {t["status"] for t in _ui(f"/api/w/{wid}", base, jar)["tasks"]} == {"succeeded"}
        # its records are here now: its backups went from the nodes, nothing else there did
        wait_for(lambda: not backups_of(workers, wid), timeout=60, interval=0.5,
                 what="the workflow's backups removed from the nodes")
        assert all(h.run("test -d /root/.hyper/controller").returncode == 0 for h in workers)
    finally:
        p.terminate()
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
