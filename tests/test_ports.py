"""Ports, notebooks and TensorBoard (issue 27, item 4): `hyper port-forward`, `hyper jupyter`
and `hyper tensorboard`, end to end on SSH test hosts with real HTTP requests through the
forward. The hosts' servers listen on their own loopback, which this machine cannot reach
but through the cluster's SSH connection. JupyterLab and TensorBoard are played by stand-ins
that behave as they do for hypercli (print their URL with a token, serve it); the real ones
run when the hosts have them."""

from __future__ import annotations

import json
import re
import shutil
import signal
import socket
import subprocess
import urllib.error
import urllib.request

import pytest

from conftest import wait_for
from test_exec import Streamed, up_lab

pytestmark = pytest.mark.slow

STANDIN = r'''
import http.server, os, secrets, sys
token = secrets.token_hex(8)
root = sys.argv[1] if len(sys.argv) > 1 else os.getcwd()

class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        ok = ("token=" + token) in self.path or "notoken" in sys.argv
        names = sorted(os.path.relpath(os.path.join(d, f), root)
                       for d, _, fs in os.walk(root) for f in fs)
        body = ("served from %s: %s" % (os.getcwd(), " ".join(names)) if ok
                else "403: token").encode()
        self.send_response(200 if ok else 403)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass

srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
print("starting up", flush=True)
url = "http://127.0.0.1:%d/%s" % (srv.server_port,
                                  "" if "notoken" in sys.argv else "lab?token=" + token)
print("[I ServerApp] Jupyter Server is running at:\n    " + url, flush=True)
srv.serve_forever()
'''


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def url_of(p: Streamed, what: str = "URL") -> str:
    line = wait_for(lambda: next((ln for ln in p.out if "http://" in ln), None), timeout=60,
                    what=what, proc=p.proc)
    return re.search(r"http://\S+", line)[0].rstrip(");")


def stop(p: Streamed) -> int:
    """Ctrl-C: its exit status; when it has not ended 30 s later, the failure shows what it
    printed and the stacks of its threads (SIGABRT, ``PYTHONFAULTHANDLER``)."""
    p.proc.send_signal(signal.SIGINT)
    try:
        return p.wait(30)
    except subprocess.TimeoutExpired:
        p.proc.send_signal(signal.SIGABRT)
        try:
            p.wait(15)
        except subprocess.TimeoutExpired:
            p.stop()
        raise AssertionError("it did not end within 30 s of SIGINT; it printed:\n"
                             + "\n".join(p.out + p.err)) from None


def reachable(ip: str, port: int) -> bool:
    try:
        socket.create_connection((ip, port), timeout=1).close()
        return True
    except OSError:
        return False


def test_port_forward_carries_requests_to_a_port_on_the_nodes_loopback(ssh_hosts, hyper):
    h1, h2 = up_lab(hyper, ssh_hosts, 2)
    h2.run("mkdir -p /root/www && echo hello from h2 > /root/www/index.html")
    h2.run("setsid python3 -m http.server --bind 127.0.0.1 18080 --directory /root/www "
           ">/dev/null 2>&1 < /dev/null &")
    wait_for(lambda: "18080" in h2.run("ss -ltnH").stdout, what="the host's server")
    assert not reachable(h2.ip, 18080)  # only the host's loopback: no way in but SSH
    p = Streamed("port-forward", "lab", "1", "18080")  # node by index
    try:
        base = url_of(p)
        port = int(base.rsplit(":", 1)[1].split("/")[0])
        assert "port 18080 of lab-1" in p.out[0]
        for _ in range(3):  # each request a connection of its own
            assert get(base) == (200, "hello from h2\n")
    finally:
        assert stop(p) == 0
    assert not reachable("127.0.0.1", port)  # closed with the command
    p = Streamed("port-forward", "lab", "lab-0", "18080:0")  # nothing listens on lab-0
    try:
        base = url_of(p)
        with pytest.raises(OSError):
            urllib.request.urlopen(base, timeout=10).read()
        wait_for(lambda: any("not carried" in ln for ln in p.err), what="the refusal noted")
    finally:
        stop(p)
    r = hyper("port-forward", "lab", "lab-7", "80")
    assert r.returncode == 2 and "no node 'lab-7'" in r.stderr
    r = hyper("port-forward", "lab", "80:x")
    assert r.returncode == 2 and "PORT[:LOCAL]" in r.stderr and "Traceback" not in r.stderr
    hyper("up", "--provider", "local", "--name", "here", "--workers", "1", check=True)
    r = hyper("port-forward", "here", "80")
    assert r.returncode == 2 and "local" in r.stderr


def test_jupyter_on_a_node_and_in_an_image(ssh_hosts, hyper, tiny_image):
    from sshhosts import TINY_IMAGE, load_image
    h1, = up_lab(hyper, ssh_hosts, 1)
    (h1.root / "home" / "standin.py").write_text(STANDIN)
    if shutil.which("jupyter") is None:  # the hosts see this machine's /usr
        r = hyper("jupyter", "lab")
        assert r.returncode == 2 and "JupyterLab is not installed on node lab-0" in r.stderr
    p = Streamed("jupyter", "lab", "--command", "python3 /root/standin.py")
    try:
        url = url_of(p)
        assert url.startswith("http://127.0.0.1:") and "/lab?token=" in url
        status, body = get(url)
        assert status == 200 and body.startswith("served from /root/.hyper/work"), body
        assert get(url.split("?")[0])[0] == 403  # the token is the server's own
        assert "standin.py" in h1.run("ps -eo args").stdout
    finally:
        assert stop(p) == 0
    wait_for(lambda: "standin.py" not in h1.run("ps -eo args").stdout,
             what="the server stopped on the node")
    assert h1.run("ls /root/.hyper/servers").stdout.strip() == ""  # its log removed
    r = hyper("jupyter", "lab", "--command", "echo no url here; exit 4")
    assert r.returncode == 3 and "ended before it printed its URL" in r.stderr
    assert "no url here" in r.stderr

    load_image(h1, tiny_image)  # a server in a container image (busybox's httpd)
    serve = ("mkdir -p /tmp/www && echo in the box > /tmp/www/index.html && "
             "echo http://127.0.0.1:18765/?token=abc && exec httpd -f -p 127.0.0.1:18765 "
             "-h /tmp/www")
    p = Streamed("jupyter", "lab", "--image", TINY_IMAGE, "--command", serve)
    try:
        url = url_of(p)
        assert url.endswith("/?token=abc")
        assert get(url) == (200, "in the box\n")
        assert h1.run("docker ps -q").stdout.strip()
    finally:
        assert stop(p) == 0
    assert h1.run("docker ps -aq").stdout.strip() == ""  # the container is gone


def test_tensorboard_over_a_workflows_outputs(hyper, hyper_home, write_recipe, tmp_path):
    standin = tmp_path / "tb.py"
    standin.write_text(STANDIN)
    path = write_recipe("""
        name: tb
        experiments:
          train:
            parameters: {lr: [1, 2]}
            command: echo step > "$HYPER_OUTPUT/events.out.tfevents.{{lr}}"
    """)
    hyper("run", path, check=True)
    p = Streamed("tensorboard", "tb", "--command", f"python3 {standin} {{logdir}} notoken")
    try:
        url = url_of(p)
        status, body = get(url)
        assert status == 200, body
        assert "train-0000/events.out.tfevents.1 train-0001/events.out.tfevents.2" in body
    finally:
        assert stop(p) == 0
    r = hyper("tensorboard", "nope")
    assert r.returncode == 2 and "no workflow named 'nope'" in r.stderr


@pytest.mark.skipif(shutil.which("tensorboard") is None, reason="TensorBoard is not installed")
def test_real_tensorboard(hyper, hyper_home, write_recipe):
    path = write_recipe("name: tbr\nexperiments: {e: {command: 'true'}}\n")
    hyper("run", path, check=True)
    p = Streamed("tensorboard", "tbr")
    try:
        status, body = get(url_of(p))
        assert status == 200 and "TensorBoard" in body
    finally:
        stop(p)


def test_forward_unit(hyper_home):
    """Arguments: PORT[:LOCAL] and the local URL of a server's URL."""
    from hypercli.errors import UsageError
    from hypercli.ports import local_url, parse_ports
    assert parse_ports("8888") == (8888, 0) and parse_ports("8888:9000") == (8888, 9000)
    for bad in ("0", "x", "70000", "1:-2", ""):
        with pytest.raises(UsageError):
            parse_ports(bad)
    assert local_url("http://localhost:8888/lab?token=ab12", 9000) == \
        "http://127.0.0.1:9000/lab?token=ab12"
    assert local_url("http://10.0.0.5:6006", 7000) == "http://127.0.0.1:7000/"
    assert json.dumps(local_url("x", 1)) == '"http://127.0.0.1:1/"'
