"""The node watcher (hypercli/node/watch.py): each cloud's preemption notice read from a
metadata service on loopback, the marker it leaves, the agent reporting it, the scheduler
re-queuing the node's tasks at once; and the idle watchdog."""

from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import wait_for
from hypercli.node import watch
from hypercli.node.client import local_agent


class Metadata:
    """A metadata service on 127.0.0.1 for one cloud; ``preempt()`` switches its answer."""

    def __init__(self, cloud: str):
        self.cloud = cloud
        self.preempted = False
        self.identity = True  # the instance has an identity allowed to delete it
        self.requests: list[tuple[str, str, dict]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                outer.requests.append(("PUT", self.path, dict(self.headers)))
                if outer.cloud == "aws" and self.path == "/latest/api/token":
                    return self._send(200, "TOKEN123")
                self._send(404)

            def do_DELETE(self):  # the cloud API's delete of the instance itself
                outer.requests.append(("DELETE", self.path, dict(self.headers)))
                ok = self.headers.get("Authorization") == "Bearer SELF-TOKEN"
                self._send(200 if ok and outer.identity else 403, "{}")

            def do_GET(self):
                outer.requests.append(("GET", self.path, dict(self.headers)))
                c = outer.cloud
                gcp = {"/computeMetadata/v1/instance/service-accounts/default/token":
                       json.dumps({"access_token": "SELF-TOKEN", "expires_in": 3599}),
                       "/computeMetadata/v1/project/project-id": "proj",
                       "/computeMetadata/v1/instance/zone": "projects/123/zones/us-central1-b",
                       "/computeMetadata/v1/instance/name": "c1-0"}
                if c == "gcp" and self.path in gcp and outer.identity:
                    return self._send(200, gcp[self.path])
                if c == "azure" and self.path.startswith("/metadata/identity/oauth2/token"):
                    if not outer.identity:
                        return self._send(400, '{"error": "invalid_request"}')
                    return self._send(200, json.dumps({"access_token": "SELF-TOKEN"}))
                if c == "azure" and self.path.startswith("/metadata/instance/compute"):
                    return self._send(200, json.dumps({
                        "subscriptionId": "sub-1", "resourceGroupName": "hyper-c1",
                        "name": "c1-0"}))
                if c == "aws" and self.path == "/latest/meta-data/spot/instance-action":
                    if self.headers.get("X-aws-ec2-metadata-token") != "TOKEN123":
                        return self._send(401)
                    if not outer.preempted:
                        return self._send(404)
                    return self._send(200, json.dumps({"action": "terminate",
                                                       "time": "2026-11-23T02:00:00Z"}))
                if c == "gcp" and self.path == "/computeMetadata/v1/instance/preempted":
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403)
                    return self._send(200, "TRUE" if outer.preempted else "FALSE")
                if c == "azure" and self.path.startswith("/metadata/scheduledevents"):
                    if self.headers.get("Metadata") != "true":
                        return self._send(400)
                    events = [{"EventId": "E1", "EventType": "Freeze",
                               "NotBefore": "soon"}]
                    if outer.preempted:
                        events.append({"EventId": "E2", "EventType": "Preempt",
                                       "ResourceType": "VirtualMachine",
                                       "Resources": ["vm0"], "NotBefore": "in 30 s"})
                    return self._send(200, json.dumps({"DocumentIncarnation": 2,
                                                       "Events": events}))
                self._send(404)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def metadata():
    made = []

    def make(cloud):
        made.append(Metadata(cloud))
        return made[-1]
    yield make
    for m in made:
        m.close()


@pytest.mark.parametrize("cloud", ["aws", "gcp", "azure"])
def test_preemption_notice_of_each_cloud(metadata, cloud):
    md = metadata(cloud)
    assert watch.preemption_notice(cloud, md.url) is None
    md.preempted = True
    notice = watch.preemption_notice(cloud, md.url)
    assert notice and notice.startswith(cloud)
    if cloud == "aws":  # IMDSv2: a token first, then the token on the read
        assert ("PUT", "/latest/api/token") in [(m, p) for m, p, _ in md.requests]
        assert "terminate" in notice
    if cloud == "azure":
        assert "E2" in notice and "E1" not in notice  # only the Preempt event counts


def test_no_metadata_service_is_no_notice():
    assert watch.preemption_notice("aws", "http://127.0.0.1:9") is None


def test_watcher_writes_the_marker_once(metadata, tmp_path):
    md = metadata("gcp")
    root = tmp_path / "node"
    args = ["--cloud", "gcp", "--root", str(root), "--metadata-url", md.url, "--once",
            "--idle-minutes", "0"]
    assert watch.main(args) == 0
    assert not (root / "preempted").exists()
    md.preempted = True
    assert watch.main(args) == 0
    marker = json.loads((root / "preempted").read_text())
    assert marker["notice"] == "gcp instance/preempted: TRUE" and marker["seen"] > 0


def test_idle_watchdog_powers_off_only_when_idle(tmp_path):
    root = tmp_path / "node"
    flag = tmp_path / "powered-off"
    args = ["--cloud", "none", "--root", str(root), "--idle-minutes", "0.0001", "--once",
            "--shutdown-command", f"touch {flag}"]
    # a running attempt, started by a real agent (which holds its lock)
    client = local_agent("n", root)
    try:
        r = client.call("launch", attempts=[{"id": "a.t.1", "script": "sleep 60", "env": {},
                                             "cwd": str(tmp_path)}])
        assert r["states"]["a.t.1"]["state"] == "running"
        time.sleep(0.05)
        watch.main(args)
        assert not flag.exists()  # busy: stays up
        r = client.call("cancel", ids=["a.t.1"], grace=2)
        assert r["states"]["a.t.1"]["state"] == "exited"
    finally:
        client.close()
    time.sleep(0.05)
    watch.main(args)
    assert flag.exists()  # idle longer than idle_minutes: powered off


@pytest.mark.parametrize("cloud", ["gcp", "azure"])
def test_idle_node_deletes_its_own_instance_with_its_identity(metadata, tmp_path, cloud):
    md = metadata(cloud)
    flag = tmp_path / "powered-off"
    args = ["--cloud", cloud, "--root", str(tmp_path / "node"), "--idle-minutes", "1",
            "--once", "--since", str(time.time() - 7200), "--metadata-url", md.url,
            "--api-url", md.url, "--shutdown-command", f"touch {flag}"]
    watch.main(args)
    [(method, path, headers)] = [r for r in md.requests if r[0] == "DELETE"]
    assert headers["Authorization"] == "Bearer SELF-TOKEN"
    assert path == ("/compute/v1/projects/proj/zones/us-central1-b/instances/c1-0"
                    if cloud == "gcp" else
                    "/subscriptions/sub-1/resourceGroups/hyper-c1/providers/Microsoft.Compute/"
                    "virtualMachines/c1-0?api-version=2023-03-01")
    assert not flag.exists()  # deleted, not merely powered off
    md.identity = False  # no identity (or no right): power off instead
    watch.main(args)
    assert flag.exists()


def test_aws_idle_node_powers_off_to_terminate(metadata, tmp_path):
    md = metadata("aws")
    flag = tmp_path / "powered-off"
    watch.main(["--cloud", "aws", "--root", str(tmp_path / "node"), "--idle-minutes", "1",
                "--once", "--since", str(time.time() - 7200), "--metadata-url", md.url,
                "--api-url", md.url, "--shutdown-command", f"touch {flag}"])
    assert flag.exists() and not [r for r in md.requests if r[0] == "DELETE"]


def test_recent_contact_keeps_the_node_up(tmp_path):
    root = tmp_path / "node"
    root.mkdir()
    flag = tmp_path / "powered-off"
    args = ["--cloud", "none", "--root", str(root), "--idle-minutes", "1", "--once",
            "--shutdown-command", f"touch {flag}", "--since", str(time.time() - 7200)]
    (root / "contact").touch()  # hyper talked to the agent just now
    watch.main(args)
    assert not flag.exists()
    old = time.time() - 3600
    os.utime(root / "contact", (old, old))  # an hour ago: the laptop went away
    watch.main(args)
    assert flag.exists()
    flag.unlink()
    watch.main(args[:-2] + ["--since", str(time.time())])  # just booted: not idle yet
    assert not flag.exists()


@pytest.mark.slow
def test_preempted_node_reported_by_its_agent_loses_its_tasks_at_once(ssh_hosts, tmp_path,
                                                                       hyper_home):
    """The marker on one node: its running task is re-run on the other node at the next
    poll, well before a silent node would be declared lost; every task ends with exactly one
    successful attempt."""
    from test_ssh import assert_one_success_each, ssh_recipe
    from hypercli.scheduler import LOST_AFTER, Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    hosts = ssh_hosts.start(2)
    path = ssh_recipe(tmp_path, ssh_hosts, hosts, {"work": {
        "parameters": {"i": [1, 2]}, "retries": 1,
        "command": "sleep 4; echo done {{i}}"}})
    seen = {}

    def preempt_one():
        wait_for(lambda: len(State().attempts("lab-1", status=["running"])) == 2, timeout=30,
                 what="both tasks running")
        victim = State().attempts("lab-1", status=["running"])[0]
        host = hosts[int(victim["node"].rsplit("-", 1)[1])]
        seen["victim"] = victim
        marked = time.monotonic()
        host.run("mkdir -p /root/.hyper && echo '{\"notice\": \"test notice\"}' "
                 "> /root/.hyper/preempted.tmp && mv /root/.hyper/preempted.tmp "
                 "/root/.hyper/preempted", check=True)
        wait_for(lambda: any(a["status"] == "lost" for a in State().attempts("lab-1")),
                 timeout=10, what="the attempt declared lost")
        seen["after"] = time.monotonic() - marked
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    t = threading.Thread(target=preempt_one)
    t.start()
    try:
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
        t.join(60)
    assert summary.exit_code == 0
    assert seen["after"] < LOST_AFTER  # the next poll, not LOST_AFTER s of silence
    assert_one_success_each(state, wid)
    lost = [a for a in state.attempts(wid) if a["status"] == "lost"]
    assert len(lost) == 1 and lost[0]["node"] == seen["victim"]["node"]
    assert any("preempted: test notice" in e["message"] for e in state.events(wid))
