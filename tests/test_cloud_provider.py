"""The cloud layer shared by aws, gcp and azure: keys, the boot document, recipe → CloudSpec,
lazy SDK imports, and `hyper check` / `hyper gc` / `hyper up --dry-run` input errors."""

from __future__ import annotations

import base64
import contextlib
import gzip
import stat
import subprocess
import sys

import paramiko
import pytest
import yaml

from hypercli.providers import get_provider
from hypercli.providers.cloud import CloudSpec, label_key, owner
from hypercli.providers.cloud_provider import (
    block_script, boot_document, cloud_spec, cluster_key, host_key, keys_dir, new_keypair)
from hypercli.recipe import parse_recipe


def test_keys_are_ed25519_paramiko_loads_them_and_the_private_one_is_0600(hyper_home):
    path, public = cluster_key("c1")
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    key = paramiko.Ed25519Key.from_private_key_file(str(path))
    assert public.split()[:2] == [key.get_name(), key.get_base64()]
    assert cluster_key("c1") == (path, public)  # made once
    private, host_public = host_key("c1", "c1-0")
    assert (keys_dir("c1") / "hosts" / "c1-0.pub").read_text().strip() == host_public
    assert new_keypair("x")[1] != host_public


def test_boot_document_is_cloud_config_with_the_host_key_and_the_watcher(hyper_home):
    _, public = cluster_key("c2")
    private, host_public = new_keypair("hyper-c2-0")
    spec = CloudSpec(cluster="c2", idle_minutes=12)
    text = boot_document(spec, "aws", "c2-0", private, host_public, public)
    assert text.startswith("#cloud-config\n")
    assert len(text.encode()) < 16 << 10  # AWS user data limit
    doc = yaml.safe_load(text)
    assert doc["ssh_keys"] == {"ed25519_private": private, "ed25519_public": host_public}
    assert doc["ssh_deletekeys"] is True and doc["ssh_pwauth"] is False
    files = {f["path"]: f for f in doc["write_files"]}
    assert files["/root/.ssh/authorized_keys"]["content"].strip() == public
    assert '"idle_minutes": 12' in files["/etc/hyper/node.json"]["content"]
    assert files["/usr/local/lib/hyper/watch.py"]["encoding"] == "gz+b64"
    watcher = gzip.decompress(base64.b64decode(files["/usr/local/lib/hyper/watch.py"]["content"]))
    compile(watcher, "watch.py", "exec")  # the real watcher, whole
    assert b"preemption_notice" in watcher
    assert ["systemctl", "enable", "--now", "hyper-watch.service"] in doc["runcmd"]
    # containers never reach the metadata service: the rules, now and at every boot
    assert files["/usr/local/lib/hyper/block-metadata.sh"]["content"] == block_script("aws")
    assert doc["runcmd"][0] == ["sh", "/usr/local/lib/hyper/block-metadata.sh"]
    # ... and before sshd starts (runcmd runs after it: a first task could come first)
    assert doc["bootcmd"] == [["sh", "-c", block_script("aws")]]
    assert ["systemctl", "enable", "hyper-block-metadata.service"] in doc["runcmd"]
    assert "Before=docker.service podman.service" in \
        files["/etc/systemd/system/hyper-block-metadata.service"]["content"]


def test_a_gcp_node_makes_its_own_host_key_and_the_metadata_holds_no_private_key(hyper_home):
    """GCP instance metadata is readable by anyone with compute.instances.get (and by the
    node's containers, were they not kept away): the node makes its host key at first boot
    and publishes only the public half in its guest attributes."""
    _, public = cluster_key("c3")
    text = boot_document(CloudSpec(cluster="c3"), "gcp", "c3-0", None, None, public)
    assert "PRIVATE KEY" not in text and len(text.encode()) < 16 << 10
    doc = yaml.safe_load(text)
    assert "ssh_keys" not in doc
    assert doc["ssh_genkeytypes"] == ["ed25519"] and doc["ssh_deletekeys"] is True
    files = {f["path"]: f for f in doc["write_files"]}
    publish = files["/usr/local/lib/hyper/publish-hostkey.sh"]["content"]
    assert "guest-attributes/hostkeys/ssh-ed25519" in publish
    assert publish.count("ssh_host_ed25519_key") == \
        publish.count("/etc/ssh/ssh_host_ed25519_key.pub") == 1  # only the public half
    assert doc["runcmd"][-1] == ["sh", "/usr/local/lib/hyper/publish-hostkey.sh"]
    # Azure: the storage identity's client id for the node's SDK, and the WireServer dropped
    text = boot_document(CloudSpec(cluster="c3"), "azure", "c3-0", *new_keypair("h"),
                         public, env={"AZURE_CLIENT_ID": "msi-client-9"})
    files = {f["path"]: f for f in yaml.safe_load(text)["write_files"]}
    assert files["/etc/environment"] == {"path": "/etc/environment", "append": True,
                                         "content": "AZURE_CLIENT_ID=msi-client-9\n"}
    assert "168.63.129.16/32 -p tcp -m multiport --dports 80,32526" in \
        files["/usr/local/lib/hyper/block-metadata.sh"]["content"]


def _ns(name: str, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["nsenter", f"--net=/run/netns/{name}", *argv], check=check,
                          capture_output=True, text=True, **kw)


#: the "metadata server" of the namespace tests: TCP 80 and 53 and UDP 53 on 169.254.169.254,
#: each answering its port
_MD_SERVER = """
import socket, threading
def tcp(port):
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(('169.254.169.254', port)); s.listen(16)
    while True:
        c, _ = s.accept(); c.sendall(b'md%d' % port); c.close()
def udp(port):
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.bind(('169.254.169.254', port))
    while True:
        data, peer = s.recvfrom(512); s.sendto(b'md%d' % port, peer)
threading.Thread(target=tcp, args=(53,), daemon=True).start()
threading.Thread(target=udp, args=(53,), daemon=True).start()
tcp(80)
"""
_PROBE = """
import socket, sys
proto, port = sys.argv[1], int(sys.argv[2])
try:
    if proto == 'tcp':
        s = socket.create_connection(('169.254.169.254', port), timeout=1.5)
        print(s.recv(16).decode())
    else:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.settimeout(1.5)
        s.sendto(b'q', ('169.254.169.254', port)); print(s.recvfrom(16)[0].decode())
except OSError as e:
    print('refused', e)
"""


@contextlib.contextmanager
def _routed_metadata():
    """Three network namespaces on a real kernel: a "container" routed through a "node" to
    a "metadata server" at 169.254.169.254 (:data:`_MD_SERVER`), as a container on a bridge
    network is. Yields ``(node, reach)``: ``reach(ns, proto, port)`` is what a connection
    from namespace ``ns`` (``"node"`` or ``"ctr"``) gets (``md<port>``, or why not).
    Everything made is removed at the end, the server stopped by its pid."""
    import os
    import time
    if os.geteuid() != 0 or subprocess.run(["which", "iptables"],
                                           capture_output=True).returncode:
        pytest.skip("needs root and iptables")
    tag = f"{os.getpid() % 100000}"
    md, node, ctr = (f"hmd{tag}", f"hnode{tag}", f"hctr{tag}")
    server = None
    try:
        for n in (md, node, ctr):
            subprocess.run(["ip", "netns", "add", n], check=True)
        batch = [
            f"link add hv{tag}a netns {node} type veth peer name hv{tag}b netns {md}",
            f"link add hv{tag}c netns {node} type veth peer name hv{tag}d netns {ctr}"]
        subprocess.run(["ip", "-batch", "-"], input="\n".join(batch), check=True, text=True)
        for n, cmds in ((node, [f"addr add 10.250.1.1/30 dev hv{tag}a",
                                f"addr add 10.250.0.1/30 dev hv{tag}c",
                                f"link set hv{tag}a up", f"link set hv{tag}c up",
                                "link set lo up",
                                "route add 169.254.169.254/32 via 10.250.1.2"]),
                        (md, [f"addr add 10.250.1.2/30 dev hv{tag}b",
                              "addr add 169.254.169.254/32 dev lo", f"link set hv{tag}b up",
                              "link set lo up", "route add 10.250.0.0/30 via 10.250.1.1"]),
                        (ctr, [f"addr add 10.250.0.2/30 dev hv{tag}d", f"link set hv{tag}d up",
                               "link set lo up", "route add default via 10.250.0.1"])):
            subprocess.run(["ip", "-n", n, "-batch", "-"], input="\n".join(cmds),
                           check=True, text=True)
        _ns(node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        server = subprocess.Popen(["nsenter", f"--net=/run/netns/{md}", sys.executable, "-c",
                                   _MD_SERVER])
        names = {"node": node, "ctr": ctr}

        def reach(ns: str, proto: str = "tcp", port: int = 80) -> str:
            for _ in range(50):  # the server starts
                out = _ns(names[ns], sys.executable, "-c", _PROBE, proto, str(port)
                          ).stdout.strip()
                if out.startswith("md") or "timed out" in out:
                    return out
                time.sleep(0.1)
            return out
        yield node, reach
    finally:
        if server is not None:
            server.kill()
            server.wait()
        for n in (md, node, ctr):
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def test_containers_routed_through_a_node_cannot_reach_the_metadata_address():
    """The boot document's rules (block_script) on a real kernel (:func:`_routed_metadata`).
    Before the rules both the container and the node reach the metadata service; after them
    only the node itself does; running them again (every boot) adds nothing."""
    with _routed_metadata() as (node, reach):
        assert reach("ctr") == "md80" and reach("node") == "md80"
        for _ in range(2):  # at first boot, and again at the next
            r = _ns(node, "sh", "-c", block_script("aws"))
            assert r.returncode == 0, r.stderr
        assert reach("node") == "md80"
        assert reach("ctr") != "md80"
        assert reach("ctr", "tcp", 53) != "md53"  # AWS: nothing of it (its DNS is .253)
        raw = _ns(node, "iptables", "-t", "raw", "-S", "PREROUTING").stdout
        assert raw.count("169.254.169.254") == 1
        user = _ns(node, "iptables", "-S", "DOCKER-USER").stdout
        assert user.count("169.254.169.254") == 1


def test_gcp_containers_keep_the_metadata_servers_dns_and_nothing_else_of_it():
    """On GCE the metadata server is also the VM's DNS resolver (169.254.169.254:53,
    cloud.google.com/dns/docs/vpc-name-res-order), which containers on a bridge network are
    given too: GCP's rules keep port 53 (UDP and TCP) open for them and drop the rest."""
    with _routed_metadata() as (node, reach):
        for _ in range(2):
            r = _ns(node, "sh", "-c", block_script("gcp"))
            assert r.returncode == 0, r.stderr
        assert reach("node") == "md80"
        assert reach("ctr") != "md80"
        assert reach("ctr", "udp", 53) == "md53" and reach("ctr", "tcp", 53) == "md53"
        assert reach("node", "udp", 53) == "md53"
        for table, chain in (("raw", "PREROUTING"), ("filter", "DOCKER-USER")):
            rules = _ns(node, "iptables", "-t", table, "-S", chain).stdout
            assert rules.count("169.254.169.254") == 2, rules  # tcp and udp, once each


def test_recipe_cluster_becomes_a_cloud_spec():
    r = parse_recipe(yaml.safe_dump({"name": "n", "cluster": {
        "provider": "aws", "region": "eu-west-1", "zone": ["eu-west-1b", "eu-west-1a"],
        "instance_type": "m5.large", "workers": 3, "spot": False, "disk_gb": 80,
        "max_price": 0.2, "idle_minutes": 5, "image": "gpu"},
        "experiments": {"a": {"command": "true"}}}), path="r.yaml")
    cs = cloud_spec(r.cluster)
    assert (cs.cluster, cs.count, cs.region, cs.zones) == ("n", 3, "eu-west-1",
                                                          ("eu-west-1b", "eu-west-1a"))
    assert (cs.spot, cs.disk_gb, cs.max_price, cs.idle_minutes) == (False, 80, 0.2, 5)
    assert (cs.image, cs.variant) == (None, "gpu")  # "gpu": the baked GPU image
    assert cs.replace_preempted is False  # on-demand: nothing is preempted
    assert cloud_spec(r.cluster, count=1).count == 1


def test_adopt_group_is_an_azure_key_that_reaches_the_cloud_spec():
    from hypercli.recipe import RecipeError
    import pytest
    r = parse_recipe(yaml.safe_dump({"name": "n", "cluster": {
        "provider": "azure", "region": "eastus", "resource_group": "team-rg",
        "adopt_group": True}, "experiments": {"a": {"command": "true"}}}), path="r.yaml")
    cs = cloud_spec(r.cluster)
    assert (cs.resource_group, cs.adopt_group) == ("team-rg", True)
    assert cloud_spec(parse_recipe(yaml.safe_dump({"name": "n", "cluster": {
        "provider": "azure"}, "experiments": {"a": {"command": "true"}}}),
        path="r.yaml").cluster).adopt_group is False
    with pytest.raises(RecipeError, match="adopt_group.*azure"):
        parse_recipe(yaml.safe_dump({"name": "n", "cluster": {
            "provider": "aws", "adopt_group": True},
            "experiments": {"a": {"command": "true"}}}), path="r.yaml")


def test_tags_and_owner_fit_every_cloud():
    assert label_key("hyper:cluster") == "hyper-cluster"
    o = owner()
    assert o and len(o) <= 63 and all(c.isalnum() or c in "_.@-" for c in o)
    assert o == o.lower()


def test_help_and_status_import_no_cloud_sdk():
    code = ("import sys\nfrom click.testing import CliRunner\nfrom hypercli.cli import cli\n"
            "CliRunner().invoke(cli, ['--help'])\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('boto3', 'botocore', 'google', 'azure')]\nprint(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_get_provider_makes_cloud_providers_without_importing_their_sdk():
    p = get_provider("gcp", options={"region": "us-central1"})
    assert p.name == "gcp" and p.remote and p._api is None


def test_dry_run_and_gc_refuse_non_cloud_providers(hyper, write_recipe):
    path = write_recipe("name: n\nexperiments: {a: {command: 'true'}}\n")
    r = hyper("up", path, "--dry-run")
    assert r.returncode == 2 and "--dry-run is for cloud providers" in r.stderr
    r = hyper("up", "--provider", "local", "--dry-run")
    assert r.returncode == 2 and "needs a RECIPE" in r.stderr
    r = hyper("gc", "--provider", "ssh")
    assert r.returncode == 2 and "aws" in r.stderr  # click names the valid choices


def test_cloud_cluster_without_instance_type_is_a_clear_error(hyper, write_recipe):
    path = write_recipe("name: n\ncluster: {provider: aws, region: us-east-1, "
                        "ssh_cidr: 10.0.0.0/8}\nexperiments: {a: {command: 'true'}}\n")
    r = hyper("up", path)
    assert r.returncode == 2
    assert "needs cluster.instance_type" in r.stderr and "Traceback" not in r.stderr


def test_each_cluster_has_a_random_id_that_names_its_identities(hyper_home):
    """State migration 8: an id per cluster name, made once, gone when the cluster is
    forgotten; the identity tag of names that differ only in case or after 30 characters
    differs because their ids do."""
    from hypercli.providers.cloud import identity_tag
    from hypercli.state import State
    state = State()
    long = "ml-team-experiments-2026-"
    ids = {n: state.cluster_uid(n) for n in ("Team", "team", long + "gpu", long + "cpu")}
    assert len(set(ids.values())) == 4 and all(len(i) == 32 for i in ids.values())
    assert state.cluster_uid("Team") == ids["Team"]  # stable
    assert len({identity_tag(n, i) for n, i in ids.items()}) == 4
    state.put_cluster("Team", "aws", {}, "down")
    state.forget_cluster("Team")
    assert state.cluster_uid("Team") != ids["Team"]  # a new cluster of that name
