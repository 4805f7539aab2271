"""Private registries (issue 27, item 3): an experiment's image in a registry that asks for a
password is pulled by the node itself with the experiment's ``registry_auth`` (never pushed
from here), the password is taken from the caller's environment at submit time and never kept
in the state file or left on the node, a wrong one fails the tasks (not the node), a missing
variable is exit 2. The registry is Debian's ``docker-registry`` (distribution 2.8.2) with
htpasswd auth, served on the SSH test hosts' bridge; the hosts' podman treats it as an
insecure (plain HTTP) registry through their own registries.conf. Cloud registries' sign-in
with the node's identity runs against stand-ins of the metadata services (GCE, Azure IMDS,
an ACR token exchange) and moto's ECR."""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
import yaml

from conftest import hyper_cmd, wait_for

REGISTRY = "/usr/bin/docker-registry"
USER, PASSWORD = "hyper", "s3cr3t-Pa55-not-on-any-disk"


def need_registry() -> None:
    missing = [t for t in (REGISTRY, shutil.which("htpasswd") or "/usr/bin/htpasswd")
               if not os.path.exists(t)]
    if missing:
        why = (f"Debian's docker-registry and apache2-utils are needed ({', '.join(missing)} "
               "missing; scripts/deps.sh installs them)")
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS") or os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def free_port(ip: str) -> int:
    with socket.socket() as s:
        s.bind((ip, 0))
        return s.getsockname()[1]


class Registry:
    """docker-registry on ``ip``, with one htpasswd user; stopped by its pid."""

    def __init__(self, folder: Path, ip: str):
        self.port = free_port(ip)
        self.address = f"{ip}:{self.port}"
        htpasswd = folder / "htpasswd"
        out = subprocess.run(["htpasswd", "-Bbn", USER, PASSWORD], capture_output=True,
                             text=True, check=True).stdout
        htpasswd.write_text(out)
        config = folder / "config.yml"
        config.write_text(yaml.safe_dump({
            "version": 0.1, "log": {"level": "error"},
            "storage": {"filesystem": {"rootdirectory": str(folder / "data")}},
            "http": {"addr": self.address},
            "auth": {"htpasswd": {"realm": "hyper-test", "path": str(htpasswd)}}}))
        self.log = open(folder / "registry.log", "wb")
        self.proc = subprocess.Popen([REGISTRY, "serve", str(config)], stdout=self.log,
                                     stderr=self.log, stdin=subprocess.DEVNULL)
        wait_for(lambda: self._answers(ip), timeout=20, what="the registry", proc=self.proc)

    def _answers(self, ip: str) -> bool:
        try:
            socket.create_connection((ip, self.port), timeout=1).close()
            return True
        except OSError:
            return False

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def podman_here(store: Path) -> list[str]:
    return ["podman", "--root", f"{store}/root", "--runroot", f"{store}/run",
            "--storage-driver", "vfs", "--cgroup-manager", "cgroupfs", "--events-backend",
            "file"]


@pytest.mark.slow
def test_private_registry_pulled_by_the_node_with_the_callers_password(
        ssh_hosts, tiny_image, tmp_path, hyper_home):
    from sshhosts import BRIDGE_IP, TINY_IMAGE
    need_registry()
    h1, = ssh_hosts.start(1)
    reg = Registry(tmp_path, BRIDGE_IP)
    store = Path(tempfile.mkdtemp(prefix="hyp-", dir="/tmp"))  # podman: runroot ≤ 50 chars
    image = f"{reg.address}/team/tiny:1"
    try:
        podman = podman_here(store)
        subprocess.run([*podman, "load", "-i", str(tiny_image)], check=True,
                       capture_output=True)
        push = subprocess.run([*podman, "push", "--tls-verify=false", "--creds",
                               f"{USER}:{PASSWORD}", TINY_IMAGE, f"docker://{image}"],
                              capture_output=True, text=True)
        assert push.returncode == 0, push.stderr
        (h1.root / "etc-containers" / "registries.conf").write_text(
            f'[[registry]]\nlocation = "{reg.address}"\ninsecure = true\n')
        nopass = h1.run(f"docker pull {image}")  # the registry does ask for a password
        assert nopass.returncode != 0 and "unauthorized" in nopass.stderr.lower(), nopass

        recipe = {"name": "priv",
                  "cluster": {"provider": "ssh", "hosts": [h1.address()],
                              "identity_file": str(ssh_hosts.client_key)},
                  "experiments": {"box": {
                      "image": image,
                      "registry_auth": {"username": USER, "password": "${REG_PASSWORD}"},
                      "command": "busybox | head -1"}}}
        path = tmp_path / "priv.yaml"
        path.write_text(yaml.safe_dump(recipe))
        no_docker = tmp_path / "no-docker"  # nothing can be pushed from here
        no_docker.write_text("#!/bin/sh\nexit 1\n")
        no_docker.chmod(0o755)
        env = dict(os.environ, HYPER_DOCKER=str(no_docker), COLUMNS="200")
        env.pop("REG_PASSWORD", None)

        def hyper(*args, **extra):
            return subprocess.run([*hyper_cmd(), *args], capture_output=True, text=True,
                                  timeout=180, env={**env, **extra})

        r = hyper("run", str(path), "--trust-new-hosts")  # the variable is not set
        assert r.returncode == 2, r.stdout + r.stderr
        assert "REG_PASSWORD is not set" in r.stderr and "Traceback" not in r.stderr
        r = hyper("run", str(path), "--trust-new-hosts", REG_PASSWORD=PASSWORD)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "BusyBox" in hyper("logs", "priv-1/box-0000").stdout
        shown = h1.run(f"docker image inspect --format '{{{{.RepoTags}}}}' {image}").stdout
        assert image in shown  # pulled under its registry name, not loaded from a push

        r = hyper("run", str(path), "--new", REG_PASSWORD="wrong")  # the image is there now:
        assert r.returncode == 0  # nothing is pulled, the password is not even used
        h1.run(f"docker rmi -f {image}")
        r = hyper("run", str(path), "--new", REG_PASSWORD="wrong")
        assert r.returncode == 1, r.stdout + r.stderr
        from hypercli.state import State
        [a] = State().attempts("priv-3")
        assert a["status"] == "failed" and "unauthorized" in a["error"].lower(), a["error"]
        assert State().nodes("priv")[0]["status"] == "up"  # the node is fine

        # the password is nowhere: the state file (and its WAL), anything under HYPER_HOME,
        # the node's files, podman's default auth file
        needle = PASSWORD.encode()
        for f in hyper_home.rglob("*"):
            if f.is_file():
                assert needle not in f.read_bytes(), f
        kept = State().workflow("priv-2")["spec"]["registry_auth"]
        assert kept == {"box": {"username": USER, "password": "${REG_PASSWORD}",
                                "in_recipe": False}}
        left = h1.run(f"grep -rl {PASSWORD} /root /tmp /var/tmp /dev/shm /run /etc/containers "
                      "2>/dev/null; ls -d /dev/shm/hyper-auth-* /tmp/hyper-auth-* 2>/dev/null")
        assert left.stdout.strip() == "", left.stdout  # nor the folder that held it
    finally:
        subprocess.run([*podman_here(store), "system", "reset", "--force"],
                       capture_output=True)
        shutil.rmtree(store, ignore_errors=True)
        reg.stop()


def test_registry_auth_in_recipes(tmp_path):
    from hypercli.errors import RecipeError, UsageError
    from hypercli.recipe import parse_recipe
    from hypercli import registry
    base = "name: r\nexperiments:\n  e:\n    command: 'true'\n"
    r = parse_recipe(base + "    image: reg.example:5000/a:1\n    registry_auth: "
                     "{username: u, password: '${PW}'}\n")
    assert r.experiments["e"].registry_auth == {"username": "u", "password": "${PW}"}
    for bad, what in (("    registry_auth: {username: u, password: p}\n", "needs an image"),
                      ("    image: x\n    registry_auth: {username: u}\n", "needs password"),
                      ("    image: x\n    registry_auth: {user: u, password: p}\n",
                       "did you mean 'username'"),
                      ("    image: x\n    registry_auth: {username: u, password: '${a-b}'}\n",
                       "not a variable name")):
        with pytest.raises(RecipeError, match=what):
            parse_recipe(base + bad)
    auths = {"e": {"username": "u", "password": "${PW}"}, "f": {"username": "v",
                                                                   "password": "lit$eral"}}
    assert registry.check(auths, {"PW": "x"}) == {"e": ("u", "x"), "f": ("v", "lit$eral")}
    with pytest.raises(UsageError, match=r"experiments.e.registry_auth.password is \$\{PW\}"):
        registry.check(auths, {})
    kept = registry.stored(auths, "d1")
    assert kept == {"e": {"username": "u", "password": "${PW}", "in_recipe": False},
                    "f": {"username": "v", "password": None, "in_recipe": True,
                          "recipe_digest": "d1"}}
    assert "lit$eral" not in json.dumps(kept)


def test_a_literal_password_is_read_again_from_the_recipe(hyper_home, write_recipe):
    """A driver that did not submit the workflow (the background driver, a resumed run)
    reads a literal password from the recipe file, and refuses when the file changed."""
    from hypercli import registry
    from hypercli.errors import UsageError
    from hypercli.state import State
    from hypercli.workflows import load, start_or_resume
    text = """
        name: lit
        experiments:
          e:
            image: reg.example:5000/a:1
            registry_auth: {username: u, password: "pw-in-file"}
            command: "true"
    """
    path = write_recipe(text)
    recipe, wf = load(str(path))
    st = State()
    wid, _ = start_or_resume(st, recipe, wf)
    row = st.workflow(wid)
    assert "pw-in-file" not in json.dumps(row)
    assert registry.for_workflow(row, "e") == ("u", "pw-in-file")
    registry._CACHE.clear()
    write_recipe(text.replace("pw-in-file", "another"))
    with pytest.raises(UsageError, match="has changed since lit-1 began"):
        registry.for_workflow(row, "e")


def test_cloud_registries_with_the_nodes_identity(monkeypatch, httpserver):
    from tokenstandins import MetadataServer
    from hypercli.node import registry as node
    assert node.registry_of("python:3.11") == "docker.io"
    assert node.registry_of("localhost/x") == "localhost"
    assert node.registry_of("10.0.0.1:5000/a/b:1") == "10.0.0.1:5000"
    assert node.cloud_of("europe-west4-docker.pkg.dev") == "gcp"
    assert node.cloud_of("123456789012.dkr.ecr.eu-west-1.amazonaws.com") == "aws"
    assert node.cloud_of("team.azurecr.io") == "azure" and node.cloud_of("docker.io") is None
    meta = MetadataServer("tok-123")
    try:
        env = {"GCE_METADATA_HOST": meta.host}
        assert node.cloud_credentials("europe-west4-docker.pkg.dev", env) == \
            ("oauth2accesstoken", "tok-123")
        httpserver.expect_request(
            "/oauth2/exchange", method="POST",
            data="grant_type=access_token&service=team.azurecr.io&access_token=tok-123"
        ).respond_with_json({"refresh_token": "acr-refresh"})
        env = {"AZURE_POD_IDENTITY_AUTHORITY_HOST": f"http://{meta.host}",
               "HYPER_ACR_EXCHANGE_URL": httpserver.url_for("").rstrip("/")}
        assert node.cloud_credentials("team.azurecr.io", env) == \
            ("00000000-0000-0000-0000-000000000000", "acr-refresh")
        assert meta.asked == {"gce": 1, "imds": 1}
    finally:
        meta.close()
    moto = pytest.importorskip("moto")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    with moto.mock_aws():
        user, password = node.cloud_credentials("123456789012.dkr.ecr.eu-west-1.amazonaws.com")
    assert user == "AWS" and password
    conf = node.auth_config("docker.io", "u", "p")
    assert set(conf["auths"]) == {"docker.io", "https://index.docker.io/v1/"}
    assert base64.b64decode(conf["auths"]["docker.io"]["auth"]) == b"u:p"
