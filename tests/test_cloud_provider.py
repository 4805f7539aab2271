"""The cloud layer shared by aws, gcp and azure: keys, the boot document, recipe → CloudSpec,
lazy SDK imports, and `hyper check` / `hyper gc` / `hyper up --dry-run` input errors."""

from __future__ import annotations

import base64
import stat
import subprocess
import sys

import paramiko
import yaml

from hypercli.providers import get_provider
from hypercli.providers.cloud import CloudSpec, label_key, owner
from hypercli.providers.cloud_provider import (
    boot_document, cloud_spec, cluster_key, host_key, keys_dir, new_keypair)
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
    watcher = base64.b64decode(files["/usr/local/lib/hyper/watch.py"]["content"])
    compile(watcher, "watch.py", "exec")  # the real watcher, whole
    assert b"preemption_notice" in watcher
    assert ["systemctl", "enable", "--now", "hyper-watch.service"] in doc["runcmd"]


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
