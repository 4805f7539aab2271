"""Node images: every Packer template validates with Debian's Packer (offline), every
provisioning script passes shellcheck, `hyper image` errors are clear, and the provisioning
that can run without the internet runs for real on an SSH test host, twice, the second time
changing nothing."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from hypercli import images

PACKER = ROOT / "images" / "packer"
SCRIPTS = sorted((PACKER / "scripts").rglob("*.sh"))
REQUIRED = os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1"


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{tool} is not installed (scripts/deps.sh installs it)")
        pytest.skip(f"{tool} is not installed")
    return path


def test_templates_validate_with_packer(tmp_path):
    packer = need("packer")
    folder = images.template_folder(packer, tmp_path)
    (tmp_path / "bundle.tar").write_bytes(b"")
    r = subprocess.run([packer, "validate", "-var", "hyper_version=1.0.0", "-var",
                        "stamp=202611230000", "-var", f"bundle={tmp_path / 'bundle.tar'}",
                        "-var", "gcp_project=my-project", "-var", "azure_subscription_id=s",
                        str(folder)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    # every source is there, named as hyper image build asks for them
    text = (PACKER / "node.pkr.hcl").read_text()
    for source in images.SOURCES.values():
        kind, name = source.split(".")
        assert f'source "{kind}" "{name}"' in text
    # a broken template is refused (the check can fail)
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    (bad / "node.pkr.hcl").write_text(text.replace('variable "stamp"', 'variable "stmp"'))
    r = subprocess.run([packer, "validate", "-var", "hyper_version=1", "-var", "stamp=1",
                        "-var", "bundle=x", "-var", "gcp_project=p", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


def test_plugins_block_is_kept_for_current_packer():
    text = (PACKER / "plugins.pkr.hcl").read_text()
    for plugin in ("github.com/hashicorp/amazon", "github.com/hashicorp/googlecompute",
                   "github.com/hashicorp/azure"):
        assert plugin in text


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_pass_shellcheck(script):
    shellcheck = need("shellcheck")
    r = subprocess.run([shellcheck, "-s", "sh", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


def test_image_build_without_packer_says_how_to_get_it(hyper, tmp_path, monkeypatch):
    env_path = tmp_path / "bin"  # a PATH without packer
    env_path.mkdir()
    os.symlink(shutil.which("python3") or "/usr/bin/python3", env_path / "python3")
    monkeypatch.setenv("PATH", str(env_path))
    r = hyper("image", "build", "--provider", "aws")
    assert r.returncode == 2 and "Packer is not installed" in r.stderr
    assert "apt-get install packer" in r.stderr and "Traceback" not in r.stderr
    r = hyper("image", "build", "--provider", "aws", "--var", "novalue")
    assert r.returncode == 2 and "not NAME=VALUE" in r.stderr


def test_packer_artifacts_and_image_records(hyper_home, hyper):
    """Packer's machine-readable artifact lines (the format of `packer build
    -machine-readable`, a sample here) and the record `hyper image ls` reads."""
    sample = ("1700000000,amazon-ebs.node,artifact-count,1\n"
              "1700000000,amazon-ebs.node,artifact,0,builder-id,mitchellh.amazonebs\n"
              "1700000000,amazon-ebs.node,artifact,0,id,us-east-1:ami-0abc\n"
              "1700000000,,ui,say,Build finished.\n")
    assert images.artifacts(sample) == ["us-east-1:ami-0abc"]
    images.record({"provider": "aws", "variant": "cpu", "name": "hyper-node-cpu-1-0-0-1",
                   "id": "us-east-1:ami-0abc", "version": "1.0.0", "built": 1})
    images.record({"provider": "gcp", "variant": "gpu", "name": "hyper-node-gpu-1-0-0-2",
                   "id": "hyper-node-gpu-1-0-0-2", "version": "1.0.0", "built": 2})
    rows = json.loads(hyper("image", "ls", "--json", check=True).stdout)
    assert [r["provider"] for r in rows] == ["gcp", "aws"]  # newest first
    out = hyper("image", "ls", "--provider", "aws", check=True).stdout
    assert "ami-0abc" in out and "gpu" not in out


@pytest.mark.slow
def test_provisioning_runs_on_a_host_twice_changing_nothing_the_second_time(ssh_hosts,
                                                                           tmp_path):
    from hypercli.ssh.conn import Connection, Target
    from hypercli.ssh.hostkeys import KnownHosts
    [host] = ssh_hosts.start(1)
    known = KnownHosts(path=tmp_path / "known_hosts")
    conn = Connection("h0", Target(host.ip, host.port, "root", str(ssh_hosts.client_key)),
                      known, trust_new=True)
    # the test host shares this machine's /usr: install into the host's own folders
    env = {"HYPER_PREFIX": "/root/opt/hypercli", "HYPER_BIN": "/root/bin",
           "HYPER_LIB": "/root/lib/hyper", "HYPER_UNITS": "/root/units",
           "HYPER_SSHD_DIR": "/etc/ssh/sshd_config.d"}
    try:
        first = images.provision(conn, skip=images.DOWNLOAD_STEPS, env=env)
        assert "hyper-provision: hypercli: changed" in "\n".join(first)
        assert any(line.startswith("hyper-provision: ssh: changed") for line in first)
        assert all(f"hyper-provision: {s}: skipped" in first for s in images.DOWNLOAD_STEPS)
        r = conn.run("/root/bin/hyper-node --help")
        assert b"push-output" in r.stdout or b"mount" in r.stdout
        r = conn.run("python3 /root/lib/hyper/watch.py --cloud none --root /tmp/w --once "
                     "--idle-minutes 0")
        assert r.exit_code == 0
        conf = (host.root / "etc-ssh" / "sshd_config.d" / "50-hyper.conf").read_text()
        assert "PasswordAuthentication no" in conf
        second = images.provision(conn, skip=images.DOWNLOAD_STEPS, env=env)
        assert [line for line in second if ": changed" in line] == []
        assert "hyper-provision: hypercli: unchanged" in second
    finally:
        conn.close()
