"""The controller's parts that need no host: the recipe keys and their errors, the lease
rules of the backup replicas' own script (run here as on a node), and a workflow's records
moved between two state files."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import wait_for
from hypercli.controller.backup import NODE_SCRIPT, pack, unpack
from hypercli.errors import RecipeError
from hypercli.recipe import parse_recipe


def _recipe(cluster: str) -> str:
    return f"name: far\ncluster: {cluster}\nexperiments:\n  a:\n    command: 'true'\n"


def test_controller_keys_belong_to_ssh_clusters():
    r = parse_recipe(_recipe("{provider: ssh, hosts: [h1], identity_file: /k, "
                             "controller: 'root@10.0.0.4:2222', controller_python: /py}"))
    assert r.cluster.options["controller"] == "root@10.0.0.4:2222"
    with pytest.raises(RecipeError, match="applies to providers ssh, aws, gcp, azure, not "
                                          "local"):
        parse_recipe(_recipe("{provider: local, controller: root@h}"))
    for cloud in ("aws", "gcp", "azure"):
        r = parse_recipe(_recipe(f"{{provider: {cloud}, controller: true, "
                                 "controller_idle_minutes: 5}"))
        assert (r.cluster.options["controller"],
                r.cluster.options["controller_idle_minutes"]) == (True, 5)
    with pytest.raises(RecipeError, match="applies to providers aws, gcp, azure"):
        parse_recipe(_recipe("{provider: ssh, hosts: [h1], controller_idle_minutes: 5}"))
    with pytest.raises(RecipeError, match="not of the form user@host:port"):
        parse_recipe(_recipe("{provider: ssh, hosts: [h1], controller: 'a b'}"))


def test_run_with_controller_needs_one_and_its_key(hyper, write_recipe):
    no_ctl = write_recipe(_recipe("{provider: ssh, hosts: ['root@127.0.0.1:1']}"))
    r = hyper("run", no_ctl, "--controller")
    assert r.returncode == 2 and "--controller needs a controller" in r.stderr, r.stderr
    no_key = write_recipe(_recipe("{provider: ssh, hosts: ['root@127.0.0.1:1'], "
                                  "controller: 'root@127.0.0.1:1'}"), "k.yaml")
    r = hyper("run", no_key)
    assert r.returncode == 2 and "needs cluster.identity_file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


class _Replica:
    """NODE_SCRIPT served from this machine, as a node serves it."""

    def __init__(self, folder):
        self.p = subprocess.Popen([sys.executable, "-I", "-S", "-c", NODE_SCRIPT, str(folder)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def __call__(self, **q) -> dict:
        self.p.stdin.write(json.dumps(q) + "\n")
        self.p.stdin.flush()
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=10)


def test_a_replica_keeps_one_holder_until_its_lease_expires_or_is_handed_on(tmp_path):
    rep = _Replica(tmp_path / "backups")
    try:
        w = dict(op="write", workflow="far-1")
        assert rep(**w, holder="A", ttl=30, seq=1, blob="a1") == {"ok": True}
        refused = rep(**w, holder="B", ttl=None, seq=2, blob="b2")
        assert refused["ok"] is False and refused["holder"] == "A" and refused["left"] > 0
        got = rep(op="read", workflow="far-1")
        assert (got["holder"], got["seq"], got["blob"]) == ("A", 1, "a1")
        assert rep(**w, holder="A", ttl=0.2, seq=2, blob=None) == {"ok": True}  # renewed
        got = rep(op="read", workflow="far-1")
        assert (got["blob"], got["seq"]) == ("a1", 1)  # a renewal keeps the blob and its seq
        time.sleep(0.3)  # A's lease expired by the replica's clock
        assert rep(**w, holder="B", ttl=None, seq=3, blob="b3") == {"ok": True}
        assert rep(**w, holder="A", ttl=30, seq=4, blob="a4")["holder"] == "B"  # fenced
        assert rep(**w, holder="C", ttl=30, seq=4, blob="c4", handoff="B") == {"ok": True}
        assert rep(op="read", workflow="far-1")["holder"] == "C"
        assert "error" in rep(op="read", workflow="../../etc/passwd")
        assert rep(op="read", workflow="far-2") == {"found": False}
    finally:
        rep.close()
    assert sorted(p.name for p in (tmp_path / "backups").iterdir()) == [
        "far-1.blob", "far-1.intents", "far-1.json", "far-1.lock", "far-2.lock"]


def test_a_node_witnesses_a_launch_and_refuses_one_from_a_holder_that_lost_the_lease(
        tmp_path):
    """A controller's launch to a replica node carries its witness (the signed intent of
    the attempt): the node's agent appends it beside the workflow's backups before it
    starts the attempt, where a takeover reads it (HMAC checked), and a whole copy
    numbered after it drops it. Once another holder took the workflow over on that node,
    a launch witnessed by the old holder is refused and never run."""
    import os
    import signal

    from hypercli.controller.backup import Replicas, new_key, trusted
    from hypercli.node.client import local_agent
    folder = tmp_path / "node" / "controller"
    rep = _Replica(folder)
    agent = local_agent("n1", tmp_path / "node")
    pid = agent.call("hello")["pid"]
    key = new_key()
    wf = {"id": "far-1", "spec": {"token": "t0", "backup_key": key}}
    node = {"name": "n1", "cluster": "far", "info": {"root": str(tmp_path / "node")}}
    old, new = (Replicas(None, [node], wf, h, seq=1) for h in ("controller A", "here B"))

    def launch(aid: str, witness: dict) -> dict:
        return agent.call("launch", attempts=[{"id": aid, "script": "true", "env": {},
                                               "cwd": str(tmp_path),
                                               "witness": witness}])["states"][aid]
    try:
        w = dict(op="write", workflow="far-1.t0")
        assert rep(**w, holder="controller A", ttl=30, seq=1, blob="a1")["ok"]
        rows = [["far-1.a-0000.1", "far-1", "a-0000", 1, "n1", 0]]
        first = old.witness("n1", rows)
        assert old.witness("n9", rows) is None  # not a replica: no witness
        assert launch("far-1.a-0000.1", first)["state"] != "refused"
        got = trusted([rep(op="read", workflow="far-1.t0")], key, "far-1.t0")[0]
        assert got["intents"] == [first["line"]]  # the node's own record of the launch
        assert first["line"]["seq"] == 2  # numbered as an intent: after blob 1
        forged = dict(first, line={**first["line"], "rows": [["far-1.x.1", "far-1", "a-0001",
                                                             1, "n1", 0]]})
        launch("far-1.x.1", forged)  # a line whose HMAC fails is not taken
        got = trusted([rep(op="read", workflow="far-1.t0")], key, "far-1.t0")[0]
        assert got["intents"] == [first["line"]]
        assert rep(**w, holder="here B", ttl=None, seq=3, blob="b3", handoff="controller A",
                   )["ok"]  # taken over: blob 3 holds the attempt, the witness goes
        assert rep(op="read", workflow="far-1.t0")["intents"] == []
        late = old.witness("n1", [["far-1.a-0002.1", "far-1", "a-0002", 1, "n1", 0]])
        st = launch("far-1.a-0002.1", late)
        assert st["state"] == "refused" and "here B" in st["error"], st
        assert st.get("lacks") is None
        assert not (tmp_path / "node" / "tasks" / "far-1.a-0002.1").exists()  # never run
        assert rep(op="read", workflow="far-1.t0")["intents"] == []
        new.seq = 3
        mine = new.witness("n1", [["far-1.a-0003.1", "far-1", "a-0003", 1, "n1", 0]])
        assert launch("far-1.a-0003.1", mine)["state"] != "refused"
        assert [i["seq"] for i in rep(op="read", workflow="far-1.t0")["intents"]] == [4]
        # a record name that could leave the folder is refused, nothing written
        bad = dict(mine, name="../../x")
        assert launch("far-1.a-0004.1", bad)["state"] == "refused"
        assert not (tmp_path / "x.intents").exists()
    finally:
        rep.close()
        agent.close()
        if not wait_for(lambda: not os.path.exists(f"/proc/{pid}"), timeout=10):
            os.kill(pid, signal.SIGKILL)


def test_a_takeover_reads_a_witness_on_a_node_with_no_record_yet(tmp_path):
    """A node that missed the handover's whole copy (it took none yet) but got a launch
    holds only that launch's witness: a read answers it (found: false, its intents), its
    HMAC is checked, and it becomes a launching attempt beside the blob of the others."""
    from hypercli.controller.backup import mac, new_key, trusted, with_intents
    from hypercli.node.agent import Agent
    key = new_key()
    ctl = _local_replicas(tmp_path, "controller A", key)
    try:
        blob = pack({"workflow": {"id": "far-1", "spec": "{}"}, "attempts": [],
                     "tasks": [{"id": "a-0000", "status": "pending", "attempts": 0}]})
        for r in ctl.replicas[:2]:  # n2 is not reached
            got = r.call({"op": "write", "workflow": "far-1.t0", "holder": "controller A",
                          "ttl": 30, "seq": 1, "blob": blob,
                          "mac": mac(key, "far-1.t0", "blob", 1, blob)})
            assert got == {"ok": True}
        ctl.seq = 1
        w = ctl.witness("n2", [["far-1.a-0000.1", "far-1", "a-0000", 1, "n2", 0]])
        assert w["dir"] == "~/.hyper/controller"  # the replicas' folder on the node
        assert Agent._witness(str(tmp_path / "n2"), w["name"], w["holder"],
                              [w["line"]]) is None
        Agent._witness(str(tmp_path / "n2"), w["name"], w["holder"],  # a forged line
                       [{**w["line"], "rows": [["far-1.x.1", "far-1", "a-0000", 1, "n2"]]}])
        answers = ctl.read()
        assert [a["found"] for a in answers] == [True, True, False]
        assert [len(a.get("intents") or []) for a in answers] == [0, 0, 1]  # checked
        export = with_intents(unpack(blob), 1, answers)
        assert [(a["id"], a["node"], a["status"]) for a in export["attempts"]] == [
            ("far-1.a-0000.1", "n2", "launching")]
        assert trusted(answers, key, "far-1.t0") == answers
    finally:
        ctl.close()


def test_a_workflows_records_move_between_state_files(tmp_path, write_recipe, monkeypatch):
    from hypercli.plan import build_plan
    from hypercli.recipe import load_recipe
    from hypercli.state import State
    monkeypatch.setenv("HYPER_HOME", str(tmp_path / "home"))
    recipe = load_recipe(str(write_recipe(
        "name: far\nexperiments:\n  a:\n    parameters: {i: [1, 2, 3]}\n"
        "    command: echo {{i}}\n")))
    here, there = State(tmp_path / "here.db"), State(tmp_path / "there.db")
    here.put_cluster("far", "local", {"options": {}})
    here.put_node("far", "far-0", slots=2, address={"host": "h"})
    wid = here.create_workflow(build_plan(recipe), cluster="far", recipe_path=None,
                               storage="file:///s", workdir="", spec={"token": "t"})
    here.start_attempts([(f"{wid}.a-0000.1", wid, "a-0000", 1, "far-0")])
    here.update_attempts([{"id": f"{wid}.a-0000.1", "status": "succeeded", "exit_code": 0}])
    here.set_tasks(wid, [{"id": "a-0000", "status": "succeeded", "metrics": {"x": 1.5}}])
    data = unpack(pack(here.export_workflow(wid)))  # as it travels
    there.import_workflow(data, driver_pid=None, storage="file:///elsewhere")
    assert there.workflow(wid)["storage"] == "file:///elsewhere"
    assert there.tasks(wid) == here.tasks(wid)
    assert there.attempts(wid) == here.attempts(wid)
    assert [n["name"] for n in there.nodes("far")] == ["far-0"]
    there.set_tasks(wid, [{"id": "a-0001", "status": "succeeded"}])
    here.import_workflow(there.export_workflow(wid), nodes=False)  # copied back: replaced
    assert here.counts(wid) == {"a": {"succeeded": 2, "pending": 1}}
    assert here.workflow(wid)["storage"] == "file:///elsewhere"
    assert len(here.events(wid)) == len(there.events(wid))


def test_records_from_a_backup_change_progress_only(tmp_path, write_recipe, monkeypatch):
    """A backup lies on nodes where tasks run: what it says of the plan (commands, cluster,
    storage) and attempts of other workflows or nodes are not taken, only progress."""
    from hypercli.controller.client import _as_planned
    from hypercli.plan import build_plan
    from hypercli.recipe import load_recipe
    from hypercli.state import State
    monkeypatch.setenv("HYPER_HOME", str(tmp_path / "home"))
    recipe = load_recipe(str(write_recipe(
        "name: far\nexperiments:\n  a:\n    parameters: {i: [1, 2]}\n    command: echo {{i}}\n")))
    state = State()
    state.put_cluster("far", "ssh", {"options": {}})
    state.put_node("far", "far-0", slots=2, address={"host": "h"})
    wid = state.create_workflow(build_plan(recipe), cluster="far", recipe_path=None,
                                storage="file:///s", workdir="")
    forged = state.export_workflow(wid)
    forged["workflow"].update(cluster="other", storage="file:///evil", status="succeeded")
    forged["tasks"][0].update(command="rm -rf /", status="succeeded", metrics='{"x": 1}')
    ok = {"id": f"{wid}.a-0000.1", "workflow": wid, "task": "a-0000", "number": 1,
          "node": "far-0", "status": "succeeded", "created_at": 1.0}
    forged["attempts"] = [ok, {**ok, "id": "other-1.a-0000.1", "workflow": "other-1"},
                          {**ok, "id": f"{wid}.a-0001.1", "node": "elsewhere"}]
    state.import_workflow(_as_planned(state, wid, forged), nodes=False)
    wf = state.workflow(wid)
    assert (wf["cluster"], wf["storage"], wf["status"]) == ("far", "file:///s", "succeeded")
    t = state.task(wid, "a-0000")
    assert (t["command"], t["status"], t["metrics"]) == ("echo 1", "succeeded", {"x": 1})
    assert [a["id"] for a in state.attempts(wid)] == [f"{wid}.a-0000.1"]


def test_intents_newer_than_the_blob_become_launching_attempts(tmp_path):
    """An attempt backed up as an intent only (its launch may have been sent, the whole
    records not written yet) is taken over as launching; older intents are in the blob."""
    from hypercli.controller.backup import with_intents
    rep = _Replica(tmp_path / "backups")
    try:
        w = dict(workflow="far-1", holder="A", ttl=30)
        blob = {"tasks": [{"id": "a-0000", "status": "pending", "attempts": 0},
                          {"id": "a-0001", "status": "pending", "attempts": 0}],
                "attempts": []}
        intent1 = dict(op="intent", seq=2, rows=[["far-1.a-0000.1", "far-1", "a-0000", 1,
                                                  "n0"]], **w)
        assert "error" in rep(**intent1)  # no record of A's yet: not taken
        assert rep(op="write", seq=1, blob="b1", **w) == {"ok": True}
        assert rep(**intent1) == {"ok": True}
        assert rep(op="write", seq=2, blob="b2", **w) == {"ok": True}  # has intent 2
        assert rep(op="intent", seq=3, rows=[["far-1.a-0001.1", "far-1", "a-0001", 1, "n1",
                                              0, {"cpus": 1}]], **w) == {"ok": True}
        got = rep(op="read", workflow="far-1")
        assert [i["seq"] for i in got["intents"]] == [3]
    finally:
        rep.close()
    out = with_intents(blob, got["seq"], [got])
    [a] = out["attempts"]
    assert (a["id"], a["status"], a["node"], json.loads(a["claim"])) == (
        "far-1.a-0001.1", "launching", "n1", {"cpus": 1})
    assert [(t["status"], t["attempts"]) for t in out["tasks"]] == [("pending", 0),
                                                                     ("running", 1)]


class _LocalChannel:
    """A replica's server run here, as a node runs it, behind a channel's calls."""

    def __init__(self, folder):
        self.p = subprocess.Popen([sys.executable, "-I", "-S", "-c", NODE_SCRIPT, str(folder)],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def sendall(self, data: bytes) -> None:
        self.p.stdin.write(data)
        self.p.stdin.flush()

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=10)


def _local_replicas(tmp_path, holder: str, key: str | None, ttl=30.0, stall=None):
    from hypercli.controller.backup import Replicas, _Replica

    class Local(_Replica):
        def call(self, request):
            if stall is not None and self.node["name"] == "n2":
                stall.wait()  # this node's answers are held up until the test lets them go
            return super().call(request)

        def _open(self):
            self.ch = _LocalChannel(tmp_path / self.node["name"])
            self.f = self.ch.p.stdout

    class LocalReplicas(Replicas):
        replica_class = Local
    nodes = [{"name": f"n{i}", "cluster": "far"} for i in range(3)]
    wf = {"id": "far-1", "spec": {"token": "t0", "backup_key": key}}
    return LocalReplicas(None, nodes, wf, holder, ttl=ttl)


def test_a_stalled_replica_holds_no_write_back_and_gets_them_all_in_order(tmp_path):
    """One of three replicas stops answering for a while (a loaded node): the blobs and
    intents still return once the other two took them (before, each waited for all
    three), and the stalled one, once it answers again, gets them all in the order sent, so
    it ends with the newest blob, not an older one written over it."""
    import threading

    from hypercli.controller.backup import new_key
    key = new_key()
    stall = threading.Event()
    ctl = _local_replicas(tmp_path, "controller A", key, stall=stall)
    blob = pack({"workflow": {"id": "far-1", "spec": "{}"}, "tasks": [], "attempts": []})
    done = threading.Event()

    def drive():
        ctl.write(blob)
        ctl.intend([("far-1.a-0000.1", "far-1", "a-0000", 1, "n1")])
        ctl.write(blob + "")
        done.set()
    t = threading.Thread(target=drive, daemon=True)
    try:
        t.start()
        assert done.wait(60), "a write waited for the stalled replica"
        stall.set()
        for r in ctl.replicas:  # the stalled one's queue runs out
            r.queue.submit(lambda: None).result(timeout=60)
        got = {g["node"]: g["seq"] for g in ctl.read()}
        assert got == {"n0": 3, "n1": 3, "n2": 3}, got
    finally:
        stall.set()
        t.join(timeout=60)
        ctl.close()


def test_a_backup_planted_by_a_task_on_one_node_neither_blocks_nor_is_taken(tmp_path):
    """A task running as root on a node writes that node's replica files: a lease that never
    expires, a blob with a higher number whose records say every task succeeded, and an
    intent. The controller's writes still count (a majority took them), a takeover is not
    held up by that lease, and what it reads is the controller's blob, the forged records
    dropped for their HMAC."""
    from hypercli.controller.backup import new_key
    key = new_key()
    mine = {"workflow": {"id": "far-1", "spec": json.dumps({"backup_key": key})},
            "tasks": [{"id": "a-0000", "status": "running"}], "attempts": []}
    ctl = _local_replicas(tmp_path, "controller A", key)
    here = None
    try:
        def settled():  # a write returns at a majority: the third replica may still be on it
            wait_for(lambda: all(r.pending == 0 for r in ctl.replicas), timeout=60,
                     what="every replica's requests answered")
        ctl.write(pack(mine))
        assert key not in unpack(ctl.blob)["workflow"]["spec"]  # never onto a node
        settled()  # n0 has the controller's files, which the task then writes over
        forged = pack({**mine, "tasks": [{"id": "a-0000", "status": "succeeded"}]})
        node = tmp_path / "n0"  # the node's own files, written by the task
        (node / "far-1.t0.json").write_text(json.dumps(
            {"holder": "task", "ttl": None, "renewed_at": time.time(), "seq": 99,
             "mac": "0" * 64}))
        (node / "far-1.t0.blob").write_text(forged)
        (node / "far-1.t0.intents").write_text(json.dumps(
            {"seq": 100, "rows": [["far-1.a-0000.9", "far-1", "a-0000", 9, "n0"]],
             "mac": "0" * 64}) + "\n")
        ctl.write(pack(mine))  # no LeaseLost: two of three took it
        ctl.intend([("far-1.a-0000.1", "far-1", "a-0000", 1, "n1")])
        settled()
        here = _local_replicas(tmp_path, "here B", key, ttl=None)
        found = [g for g in here.read() if g["found"]]
        assert {g["node"]: g["holder"] for g in found} == {
            "n0": "task", "n1": "controller A", "n2": "controller A"}
        assert [g["holder"] for g in here.held(found)] == ["controller A"] * 2  # not "task"
        kept = [g for g in found if g["blob"]]
        assert {g["node"] for g in kept} == {"n1", "n2"}  # the forged blob failed its HMAC
        assert unpack(max(kept, key=lambda g: g["seq"])["blob"])["tasks"][0]["status"] == \
            "running"
        assert [i["rows"][0][0] for g in found for i in g["intents"]] == \
            ["far-1.a-0000.1"] * 2  # the planted intent is dropped
    finally:
        ctl.close()
        if here is not None:
            here.close()


def test_a_cloud_controller_is_not_idle_while_ended_records_wait_to_be_copied(
        tmp_path, write_recipe, monkeypatch):
    """Its instance removes itself when idle, which would take the only whole copy of a
    workflow that ended while the user's machine was away: until that machine has copied
    the records (`collected`, asked by its refresh), the controller counts as in use."""
    from hypercli.controller import host
    from hypercli.controller.__main__ import main
    from hypercli.plan import build_plan
    from hypercli.recipe import load_recipe
    from hypercli.state import State
    monkeypatch.setenv("HYPER_HOME", str(tmp_path / "node" / "controller"))
    recipe = load_recipe(str(write_recipe("name: far\nexperiments:\n  a:\n    command: 'true'\n")))
    state = State()
    wid = state.create_workflow(build_plan(recipe), cluster="far", recipe_path=None,
                                storage="file:///s", workdir="",
                                spec={"lease": {"holder": "controller x", "replicas": []}})
    assert not host._uncollected(state)  # running: driven, not waiting
    state.set_workflow(wid, status="succeeded")
    assert host._uncollected(state)
    assert main(["collected", wid]) == 0
    assert not host._uncollected(state)
    assert state.workflow(wid)["spec"]["lease"]["collected"] is True


def test_an_intent_does_not_wait_for_the_whole_records_to_be_made(tmp_path):
    """Making the whole records (O(tasks): 0.1 s at 4,096 tasks) no longer holds a launch's
    intent back; the intent sent meanwhile is numbered after the blob, so it is kept beside
    it and read back with it."""
    import threading

    from hypercli.controller.backup import with_intents
    ctl = _local_replicas(tmp_path, "controller A", None)
    blob = pack({"workflow": {"id": "far-1", "spec": "{}"},
                 "tasks": [{"id": "a-0000", "status": "pending"}], "attempts": []})
    ctl.write(blob)
    making, go = threading.Event(), threading.Event()

    def slow():
        making.set()
        go.wait(60)
        return blob
    t = threading.Thread(target=ctl.write, args=(slow,), daemon=True)
    try:
        t.start()
        assert making.wait(60)
        ctl.intend([("far-1.a-0000.1", "far-1", "a-0000", 1, "n1")])  # not held back
        assert t.is_alive()  # the blob is still being made
        go.set()
        t.join(60)
        found = ctl.read()
        newest = max(found, key=lambda g: g["seq"])
        assert newest["seq"] == 2
        out = with_intents(unpack(newest["blob"]), newest["seq"], found)
        assert [a["id"] for a in out["attempts"]] == ["far-1.a-0000.1"]
    finally:
        go.set()
        t.join(60)
        ctl.close()


def test_drop_removes_only_the_workflows_own_backup_files(tmp_path):
    """Once the workflow's records are copied to the user's machine, its backups go from the
    nodes: the files of its name only (another workflow's stay), a symlink a task put in
    place of one is removed without touching what it points at, and a holder that is not
    the lease's removes nothing while that lease is live."""
    ctl = _local_replicas(tmp_path, "controller A", None)
    other = None
    try:
        blob = pack({"workflow": {"id": "far-1", "spec": "{}"}, "tasks": [], "attempts": []})
        ctl.write(blob)
        ctl.intend([("far-1.a-0000.1", "far-1", "a-0000", 1, "n1")])
        for r in ctl.replicas:  # the third replica has it too (a write returns at two)
            r.queue.submit(lambda: None).result(timeout=60)
        (tmp_path / "n0" / "far-2.t9.json").write_text("{}")  # another workflow's
        precious = tmp_path / "precious"
        precious.write_text("keep")
        (tmp_path / "n1" / "far-1.t0.intents").unlink()
        (tmp_path / "n1" / "far-1.t0.intents").symlink_to(precious)
        other = _local_replicas(tmp_path, "here B", None, ttl=None)
        assert other.drop() == 0  # controller A's lease is live on every replica
        assert (tmp_path / "n0" / "far-1.t0.blob").exists()
        assert ctl.drop() == 3
        left = sorted(p.name for n in ("n0", "n1", "n2") for p in (tmp_path / n).iterdir())
        assert left == ["far-1.t0.json"] * 3 + ["far-1.t0.lock"] * 3 + ["far-2.t9.json"], \
            left  # the lease record and its lock file stay
        kept = json.loads((tmp_path / "n1" / "far-1.t0.json").read_text())
        assert (kept["holder"], kept["ttl"], kept["ended"]) == ("controller A", None, True)
        assert precious.read_text() == "keep"
    finally:
        ctl.close()
        if other is not None:
            other.close()


def test_a_driver_cut_off_finds_its_lease_lost_after_the_records_were_dropped(tmp_path):
    """Controller A is cut off; its lease expires and this machine (B) takes the workflow
    over, drives it to its end and drops the backups. A, back, must find the lease taken
    (and stop), not an empty place where it may write its lease and drive the ended
    workflow again."""
    from hypercli.controller.backup import LeaseLost
    a = _local_replicas(tmp_path, "controller A", None, ttl=0.2)
    b = None
    try:
        blob = pack({"workflow": {"id": "far-1", "spec": "{}"}, "tasks": [], "attempts": []})
        a.write(blob)
        time.sleep(0.3)  # A's lease expired by the replicas' clocks (A cut off)
        b = _local_replicas(tmp_path, "here B", None, ttl=None)
        b.write(blob)
        assert b.drop() == 3
        with pytest.raises(LeaseLost):
            a.write(None)  # A back: its renewal
        with pytest.raises(LeaseLost):
            a.write(blob)
        assert all(json.loads((tmp_path / n / "far-1.t0.json").read_text())["holder"]
                   == "here B" for n in ("n0", "n1", "n2"))
    finally:
        a.close()
        if b is not None:
            b.close()


def test_a_launch_is_sent_only_once_its_intents_are_backed_up(tmp_path):
    """Group commit keeps the write-ahead rule: the intents of launches placed together go
    in one append, the scheduler does not wait for it, and each launch is sent by its node's
    thread only once the append is on a majority of the replicas; a launch whose append
    failed (the lease lost, too few replicas) is never sent."""
    import threading

    from hypercli.controller.backup import LeaseLost
    from hypercli.controller.host import _gated, _Intents

    class Worker:  # a scheduler's node thread: what reaches _handle is sent to the node
        def __init__(self):
            self.sent = []

        def _handle(self, op, payload):
            self.sent.append((op, [s["id"] for s in payload]))
            return False

    ctl = _local_replicas(tmp_path, "controller A", None)
    failures = []
    intents = _Intents(ctl, failures.append, lambda s: None)
    try:
        ctl.write(pack({"workflow": {"id": "far-1", "spec": "{}"}, "tasks": [],
                        "attempts": []}))
        stall = threading.Event()
        real = ctl.intend
        ctl.intend = lambda rows: (stall.wait(60), real(rows))[1]  # the append under way
        intents.start()
        gates, w = {}, Worker()
        _gated(w, gates)
        rows = [(f"far-1.a-000{i}.1", "far-1", f"a-000{i}", 1, "n1") for i in range(2)]
        batch = intents.add(rows)  # returns at once: the scheduler goes on
        gates.update({r[0]: batch for r in rows})
        t = threading.Thread(target=w._handle, args=("launch", [{"id": rows[0][0]},
                                                                  {"id": rows[1][0]}]))
        t.start()
        t.join(1)
        assert w.sent == []  # not sent while its intents are on their way
        stall.set()
        t.join(60)
        assert w.sent == [("launch", [rows[0][0], rows[1][0]])]
        got = [i["rows"] for g in ctl.read() for i in g["intents"]]
        assert got and all(len(r) == 2 for r in got)  # one append for both

        def lost(rows):
            raise LeaseLost("driven by B")
        ctl.intend = lost
        batch = intents.add([("far-1.a-0002.1", "far-1", "a-0002", 1, "n1")])
        gates["far-1.a-0002.1"] = batch
        w._handle("launch", [{"id": "far-1.a-0002.1"}])
        assert [op for op, ids in w.sent if "far-1.a-0002.1" in ids] == []
        assert isinstance(failures[0], LeaseLost)
    finally:
        stall.set()
        intents.stop()
        intents.join(10)
        ctl.close()


def test_a_launch_to_a_replica_goes_with_its_witness_and_one_elsewhere_waits(tmp_path):
    """While the intents' append is under way, a launch to a replica node is sent at once,
    carrying the signed intent of every rank of its attempt (its witness); a launch to a
    node that is not a replica (a replacement node) is sent only once the append is on a
    majority, without a witness."""
    import threading

    from hypercli.controller.backup import trusted
    from hypercli.controller.host import _gated, _Intents

    class Worker:  # a scheduler's node thread: what reaches _handle is sent to the node
        def __init__(self, node):
            self.node, self.sent = node, []

        def _handle(self, op, payload):
            self.sent.append((op, [(s["id"], s.get("witness")) for s in payload]))
            return False

    ctl = _local_replicas(tmp_path, "controller A", "ab" * 32)
    intents = _Intents(ctl, lambda e: None, lambda s: None)
    stall = threading.Event()
    try:
        ctl.write(pack({"workflow": {"id": "far-1", "spec": "{}"}, "tasks": [],
                        "attempts": []}))
        real = ctl.intend
        ctl.intend = lambda rows: (stall.wait(60), real(rows))[1]  # the append under way
        intents.start()
        gates, rep, other = {}, Worker("n1"), Worker("far-9")
        for w in (rep, other):
            _gated(w, gates, intents.stats, ctl.witness)
        gang = [("far-1.a-0000.1-r0", "far-1", "a-0000", 1, "n1", 0),
                ("far-1.a-0000.1-r1", "far-1", "a-0000", 1, "n2", 1)]
        alone = [("far-1.a-0001.1", "far-1", "a-0001", 1, "far-9", 0)]
        batch = intents.add(gang + alone)
        gates.update({r[0]: batch for r in gang + alone})
        rep._handle("launch", [{"id": gang[0][0]}])  # returns: sent without waiting
        [(op, [(aid, w)])] = rep.sent
        assert aid == gang[0][0] and w["holder"] == "controller A"
        assert sorted(r[0] for r in w["line"]["rows"]) == [gang[0][0], gang[1][0]]
        line = {"found": False, "intents": [w["line"]]}
        assert trusted([line], ctl.key, ctl.name)[0]["intents"] == [w["line"]]  # signed
        t = threading.Thread(target=other._handle, args=("launch", [{"id": alone[0][0]}]))
        t.start()
        t.join(1)
        assert other.sent == []  # not a replica: waits for the append
        stall.set()
        t.join(60)
        assert other.sent == [("launch", [(alone[0][0], None)])]
    finally:
        stall.set()
        intents.stop()
        intents.join(10)
        ctl.close()


def _workflow(tmp_path, write_recipe, tasks: int = 3):
    """A state file with change tracking on and a planned workflow of ``tasks`` tasks on a
    cluster of one node: (state, workflow id)."""
    from hypercli.plan import build_plan
    from hypercli.recipe import load_recipe
    from hypercli.state import State
    recipe = load_recipe(str(write_recipe(
        f"name: far\nexperiments:\n  a:\n    parameters: {{i: {list(range(tasks))}}}\n"
        "    command: echo {{i}}\n")))
    st = State(tmp_path / "ctl.db")
    st.put_cluster("far", "local", {"options": {}})
    st.put_node("far", "n1", slots=2, address={"host": "h"})
    st.track_changes()
    wid = st.create_workflow(build_plan(recipe), cluster="far", recipe_path=None,
                             storage="file:///s", workdir="", spec={"token": "t0"})
    return st, wid


def test_a_change_logged_but_not_yet_in_a_whole_copy_is_taken_over(tmp_path, write_recipe,
                                                                  monkeypatch):
    """The controller writes the whole records once, then only what changed (a delta per
    write); it is killed after a delta and before the next whole copy: the takeover's
    records have the delta's changes (a task ended, an attempt, an event), each once, and
    a delta forged on one node (no valid HMAC) is not applied. A whole copy written later
    drops the deltas it holds from the replicas (compaction)."""
    from hypercli.controller.backup import new_key, with_changes, with_intents
    from hypercli.controller.host import _Records
    monkeypatch.setenv("HYPER_HOME", str(tmp_path / "home"))
    key = new_key()
    st, wid = _workflow(tmp_path, write_recipe)
    ctl = _local_replicas(tmp_path, "controller A", key)
    ctl.workflow = wid
    records = _Records(ctl, wid)
    try:
        records.write(st)  # the first write: the whole records
        st.start_attempts([(f"{wid}.a-0000.1", wid, "a-0000", 1, "n1")])
        st.update_attempts([{"id": f"{wid}.a-0000.1", "status": "succeeded", "exit_code": 0,
                             "ended_at": 2.0}])
        st.set_tasks(wid, [{"id": "a-0000", "status": "succeeded", "attempts": 1,
                            "metrics": {"loss": 0.5}}])
        st.event("attempt", "a-0000 ended", workflow=wid, task="a-0000")
        records.write(st)  # a delta
        st.set_tasks(wid, [{"id": "a-0001", "status": "running", "attempts": 1}])
        records.write(st)  # another
        assert records.count == {"blob": 1, "delta": 2}
        for r in ctl.replicas:
            r.queue.submit(lambda: None).result(timeout=60)
        # a task on n0 appends a delta of its own: every task succeeded
        forged = pack({"workflow": {"id": wid, "status": "succeeded"},
                       "tasks": [{"id": f"a-000{i}", "status": "succeeded"} for i in range(3)]})
        with open(tmp_path / "n0" / f"{wid}.t0.log", "a") as f:
            f.write(json.dumps({"seq": 99, "delta": forged, "mac": "0" * 64}) + "\n")
        # killed here, before the next whole copy: the laptop reads the replicas
        found = ctl.read()
        newest = max((g for g in found if g.get("blob")), key=lambda g: g["seq"])
        assert newest["seq"] == 1 and all(len(g["log"]) == 2 for g in found)
        out = with_intents(with_changes(unpack(newest["blob"]), newest["seq"], found),
                           newest["seq"], found)
        tasks = {t["id"]: t for t in out["tasks"]}
        assert (tasks["a-0000"]["status"], json.loads(tasks["a-0000"]["metrics"])) == (
            "succeeded", {"loss": 0.5})
        assert tasks["a-0001"]["status"] == "running"
        assert tasks["a-0002"]["status"] == "pending"  # the forged delta is not applied
        assert [(a["id"], a["status"]) for a in out["attempts"]] == [
            (f"{wid}.a-0000.1", "succeeded")]
        assert [e["message"] for e in out["events"]].count("a-0000 ended") == 1
        assert out["workflow"]["status"] != "succeeded"
        # the change log here keeps only what no write has taken yet
        assert st.export_changes(wid, records.acked)["tasks"] == []
        records.whole_every = 0  # a whole copy is due: it compacts the deltas away
        records.write(st)
        for r in ctl.replicas:
            r.queue.submit(lambda: None).result(timeout=60)
        found = ctl.read()
        assert records.count["blob"] == 2
        assert [len(g["log"]) for g in found] == [0, 0, 0], found
        whole = unpack(max(found, key=lambda g: g["seq"])["blob"])
        assert {t["id"]: t["status"] for t in whole["tasks"]}["a-0000"] == "succeeded"
    finally:
        ctl.close()
        st.close()


def test_follow_writes_each_change_once_a_still_sign_between_and_ends_with_the_workflow(
        monkeypatch):
    """The one process a follower runs on the controller (`python -m hypercli.controller
    follow`): the export as a JSON line, ``{}`` while nothing changed, the last line once the
    workflow has ended (or its lease was lost), and a follower gone (a closed pipe) ends it."""
    import io
    from hypercli.controller import host
    answers = iter([("running", None), ("running", None), ("running", None),
                    ("succeeded", None), ("never", None)])

    def export(wid, since=None):
        status, lost = next(answers)
        return {"export": {"workflow": {"id": wid, "status": status}}, "lost": lost,
                "driven": True, "ledger": [], "samples": []}
    monkeypatch.setattr(host, "export", export)
    out = io.StringIO()
    assert host.follow("far-1", every=0, out=out) == 0
    lines = [json.loads(x) for x in out.getvalue().splitlines()]
    assert [x.get("export", {}).get("workflow", {}).get("status") for x in lines] == [
        "running", None, None, "succeeded"]
    assert lines[1] == lines[2] == {}

    answers = iter([("running", None), ("running", "taken over by here-B")])
    out = io.StringIO()
    assert host.follow("far-1", every=0, out=out) == 0  # a lost lease is the last line
    assert json.loads(out.getvalue().splitlines()[-1])["lost"] == "taken over by here-B"

    class Gone(io.StringIO):
        def write(self, s):
            raise BrokenPipeError

    answers = iter([("running", None)] * 3)
    assert host.follow("far-1", every=0, out=Gone()) == 0
