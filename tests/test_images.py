"""Node images (images/packer, hypercli/images.py, `hyper image`).

* Every template validates with Debian's Packer 1.6.6, offline, for both variants; a broken
  template and a bad variant are refused; every HCL file (plugins.pkr.hcl too) parses and is
  formatted; the image name and tags the template computes (asked of Packer itself with
  `packer console`) are the ones hypercli records and the providers look up.
* Every provisioning script passes shellcheck.
* `hyper image build` says how to get Packer when it is missing and what to do when a cloud's
  credentials are missing (real Packer on PATH, real cloud clients, nothing leaves this host).
* The provisioning that needs no download (hypercli's code and the node watcher from a bundle
  sent over SSH, SSH hardening, GPU detection, an empty pre-pull) runs for real on SSH test
  hosts, twice, the second time changing no file; a config sshd refuses is put back.
  The steps that download (packages, Docker, NVIDIA, goofys) are covered by validate and
  shellcheck only.

Without packer or shellcheck the tests that need them are skipped, unless
HYPER_REQUIRE_SSH_HOSTS=1 (CI), where they fail.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import ROOT
from hypercli import __version__, images
from hypercli.providers.cloud import TAG_IMAGE, TAG_VARIANT, TAG_VERSION, label_key

PACKER = ROOT / "images" / "packer"
SCRIPTS = sorted((PACKER / "scripts").rglob("*.sh"))
REQUIRED = os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1"
STAMP = "20261123000000"


@pytest.fixture(autouse=True)
def _no_checkpoint(monkeypatch):
    """Packer asks HashiCorp's checkpoint service for news unless told not to."""
    monkeypatch.setenv("CHECKPOINT_DISABLE", "1")


def need(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        if REQUIRED:
            pytest.fail(f"{tool} is not installed (scripts/deps.sh installs it)")
        pytest.skip(f"{tool} is not installed (apt-get install {tool})")
    return path


def template_vars(tmp_path: Path, **kw) -> list[str]:
    bundle = tmp_path / "bundle.tar"
    bundle.write_bytes(b"")
    values = {"hyper_version": "1.0.0", "stamp": STAMP, "bundle": str(bundle),
              "gcp_project": "my-project", "azure_subscription_id": "sub", **kw}
    return [a for k, v in values.items() for a in ("-var", f"{k}={v}")]


def packer_run(packer: str, *args: str, stdin: str | None = None):
    return subprocess.run([packer, *args], capture_output=True, text=True, timeout=120,
                          input=stdin)


# -- templates ------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["cpu", "gpu"])
def test_templates_validate_with_packer(tmp_path, variant):
    packer = need("packer")
    folder = images.template_folder(packer, tmp_path)
    r = packer_run(packer, "validate", *template_vars(tmp_path, variant=variant), str(folder))
    assert r.returncode == 0, r.stdout + r.stderr
    text = (PACKER / "node.pkr.hcl").read_text()
    for source in images.SOURCES.values():  # the sources hyper image build asks for
        kind, name = source.split(".")
        assert f'source "{kind}" "{name}"' in text
        r = packer_run(packer, "validate", f"-only={source}", *template_vars(tmp_path),
                       str(folder))
        assert r.returncode == 0, r.stdout + r.stderr


def test_packer_refuses_a_broken_template_and_a_bad_variant(tmp_path):
    packer = need("packer")
    folder = images.template_folder(packer, tmp_path)
    r = packer_run(packer, "validate", *template_vars(tmp_path, variant="tpu"), str(folder))
    assert r.returncode != 0 and "cpu or gpu" in r.stdout + r.stderr
    r = packer_run(packer, "validate", *template_vars(tmp_path, stamp="now"), str(folder))
    assert r.returncode != 0 and "digits" in r.stdout + r.stderr
    bad = tmp_path / "bad"
    shutil.copytree(folder, bad)
    text = (bad / "node.pkr.hcl").read_text()
    (bad / "node.pkr.hcl").write_text(text.replace("ami_name      = local.name", ""))
    r = packer_run(packer, "validate", *template_vars(tmp_path), str(bad))
    assert r.returncode != 0 and "ami_name" in r.stdout + r.stderr


def test_every_hcl_file_parses_and_is_formatted():
    """`packer fmt` parses HCL without knowing its blocks: it also covers plugins.pkr.hcl,
    which Packer 1.6.6 cannot validate (required_plugins is newer)."""
    packer = need("packer")
    r = packer_run(packer, "fmt", "-check", "-diff", str(PACKER))
    assert r.returncode == 0, r.stdout + r.stderr


def test_plugins_block_is_kept_for_current_packer_and_left_out_for_1_6(tmp_path):
    text = (PACKER / "plugins.pkr.hcl").read_text()
    for plugin in ("github.com/hashicorp/amazon", "github.com/hashicorp/googlecompute",
                   "github.com/hashicorp/azure"):
        assert plugin in text
    packer = need("packer")
    folder = images.template_folder(packer, tmp_path)
    if images.packer_version(packer) < (1, 7, 0):
        assert folder != PACKER and not (folder / "plugins.pkr.hcl").exists()
        assert (folder / "node.pkr.hcl").exists() and (folder / "scripts" / "provision.sh").exists()
    else:
        assert folder == PACKER


def console(packer: str, folder: Path, tmp_path: Path, expr: str, **kw) -> str:
    r = packer_run(packer, "console", *template_vars(tmp_path, **kw), str(folder),
                   stdin=expr + "\n")
    assert r.returncode == 0, r.stdout + r.stderr
    return r.stdout.strip()


@pytest.mark.parametrize("version", ["0.1.0", "2.0.0rc1+Local.Build_7"])
def test_image_name_and_tags_are_what_providers_look_up(tmp_path, version):
    """The template's own name, tags and labels (evaluated by Packer) against hypercli's rule
    and the tag keys the aws/gcp/azure providers filter on."""
    packer = need("packer")
    folder = images.template_folder(packer, tmp_path)
    name = console(packer, folder, tmp_path, "local.name", hyper_version=version,
                   variant="gpu")
    assert name == images.image_name("gpu", version, STAMP)
    assert re.fullmatch(r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", name)  # a valid GCP image name
    pairs = re.compile(r'"([^"]+)" = "([^"]*)"')
    tags = dict(pairs.findall(console(packer, folder, tmp_path, "local.tags",
                                      hyper_version=version, variant="gpu")))
    assert tags == {TAG_IMAGE: "node", TAG_VARIANT: "gpu", TAG_VERSION: version}
    labels = dict(pairs.findall(console(packer, folder, tmp_path, "local.labels",
                                        hyper_version=version, variant="gpu")))
    gcp = pytest.importorskip("hypercli.providers.gcp")
    assert labels == {label_key(TAG_IMAGE): "node", label_key(TAG_VARIANT): "gpu",
                      label_key(TAG_VERSION): gcp.label_value(version)}


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_scripts_pass_shellcheck(script):
    shellcheck = need("shellcheck")
    r = subprocess.run([shellcheck, "-s", "sh", str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout


# -- hyper image build / ls -----------------------------------------------------------------
def path_with(tmp_path: Path, *tools: str) -> str:
    """A PATH folder holding only ``tools`` (links to the real ones) and python3."""
    d = tmp_path / "bin"
    d.mkdir(exist_ok=True)
    for tool in ("python3", *tools):
        found = shutil.which(tool)
        if found and not (d / tool).exists():
            os.symlink(found, d / tool)
    return str(d)


def test_image_build_without_packer_says_how_to_get_it(hyper, tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", path_with(tmp_path))
    r = hyper("image", "build", "--provider", "aws")
    assert r.returncode == 2 and "Packer is not installed" in r.stderr, r.stderr
    assert "apt-get install packer" in r.stderr and "developer.hashicorp.com" in r.stderr
    assert "Traceback" not in r.stderr
    r = hyper("image", "build", "--provider", "aws", "--var", "novalue")
    assert r.returncode == 2 and "not NAME=VALUE" in r.stderr
    r = hyper("image", "build", "--provider", "aws", "--var", "variant=gpu")
    assert r.returncode == 2 and "set by hyper image build" in r.stderr


def test_image_build_without_credentials_says_what_to_set(hyper, hyper_home, tmp_path,
                                                          monkeypatch):
    """Real Packer on PATH, real cloud clients; each stops before any request leaves: AWS
    with nothing to sign with, GCP with a missing credentials file, Azure with no
    subscription or no way for Packer to sign in."""
    need("packer")
    for k in list(os.environ):
        if k.startswith(("AWS_", "AZURE_", "GOOGLE_", "HYPER_GCP", "HYPER_AZURE", "CLOUDSDK")):
            monkeypatch.delenv(k)
    empty = tmp_path / "empty"
    empty.write_text("")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(empty))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(empty))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.setenv("GOOGLE_APPLICATION_CREDENTIALS", str(tmp_path / "missing.json"))
    monkeypatch.setenv("PATH", path_with(tmp_path, "packer"))

    r = hyper("image", "build", "--provider", "aws")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "credentials" in r.stderr.lower() and "aws configure" in r.stderr
    pytest.importorskip("google.cloud.compute_v1")
    r = hyper("image", "build", "--provider", "gcp", "--var", "gcp_project=p")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "missing.json" in r.stderr and "gcloud auth application-default login" in r.stderr
    pytest.importorskip("azure.mgmt.compute")
    r = hyper("image", "build", "--provider", "azure")
    assert r.returncode == 2 and "neither" in r.stderr and "az login" in r.stderr, r.stderr
    monkeypatch.setenv("AZURE_CLIENT_ID", "00000000-0000-0000-0000-000000000000")
    r = hyper("image", "build", "--provider", "azure")
    assert r.returncode == 2 and "no Azure subscription" in r.stderr, r.stderr
    assert "AZURE_SUBSCRIPTION_ID" in r.stderr and "Traceback" not in r.stderr
    assert not (hyper_home / "images.json").exists()


def test_build_arguments_fit_the_template(hyper_home, tmp_path, monkeypatch):
    """Argument passing only, not a build: `packer` on PATH here is a wrapper that records
    the arguments `build` gets and hands them to the real Packer's `validate` (so the
    variables hyper passes must be the template's, the code tar must exist), then prints an
    artifact line in Packer's machine-readable form. What it proves: the arguments, the
    template folder, artifact parsing and the record. The credentials check runs against
    moto's STS in process."""
    moto = pytest.importorskip("moto")
    real = need("packer")
    for k, v in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(k, v)
    for k in ("AWS_SESSION_TOKEN", "AWS_PROFILE", "HYPER_AWS_ENDPOINT_URL"):
        monkeypatch.delenv(k, raising=False)
    bindir = tmp_path / "wrapper"
    bindir.mkdir()
    args_file = tmp_path / "args"
    (bindir / "packer").write_text(f"""#!/bin/sh
case "$1" in
  build)
    shift
    printf '%s\\n' "$@" > {args_file}
    out=$({real} validate "$@" 2>&1) || {{ echo "1,,ui,error,$out"; exit 1; }}
    echo "1700000000,amazon-ebs.node,artifact,0,id,eu-west-1:ami-0abc%!(PACKER_COMMA)x"
    echo "1700000000,,ui,say,Build 'amazon-ebs.node' finished." ;;
  *) exec {real} "$@" ;;
esac
""")
    (bindir / "packer").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    said = []
    with moto.mock_aws():
        row = images.build("aws", gpu=True, variables={"aws_region": "eu-west-1",
                                                       "prepull": "python:3.11-slim busybox"},
                           log=said.append)
        args = args_file.read_text().splitlines()
        assert args[:2] == ["-machine-readable", "-only=amazon-ebs.node"]
        given = dict(args[i + 1].split("=", 1) for i, a in enumerate(args) if a == "-var")
        assert given["hyper_version"] == __version__ and given["variant"] == "gpu"
        assert given["aws_region"] == "eu-west-1"
        assert given["prepull"] == "python:3.11-slim busybox"
        assert re.fullmatch(r"\d{14}", given["stamp"])
        assert row == {**row, "provider": "aws", "variant": "gpu", "location": "eu-west-1",
                       "id": "eu-west-1:ami-0abc,x", "stamp": given["stamp"],
                       "name": images.image_name("gpu", __version__, given["stamp"])}
        assert "Build 'amazon-ebs.node' finished." in said
        assert images.list_images("aws") == [row] and images.list_images("gcp") == []
        with pytest.raises(images.InfraError, match="nonsense") as e:  # Packer refuses it
            images.build("aws", variables={"nonsense": "1"})
        assert "exit 1" in str(e.value)
    assert len(images.list_images()) == 1


def test_packer_artifacts_and_image_records(hyper_home, hyper):
    """Packer's machine-readable artifact lines (a sample in the documented format) and the
    record that `hyper image ls` reads."""
    sample = ("1700000000,amazon-ebs.node,artifact-count,1\n"
              "1700000000,amazon-ebs.node,artifact,0,builder-id,mitchellh.amazonebs\n"
              "1700000000,amazon-ebs.node,artifact,0,id,us-east-1:ami-0abc\n"
              "1700000000,,ui,say,Build finished.\n")
    assert images.artifacts(sample) == ["us-east-1:ami-0abc"]
    assert "no images baked yet" in hyper("image", "ls", check=True).stdout
    images.record({"provider": "aws", "variant": "cpu", "name": "hyper-node-cpu-1-0-0-1",
                   "id": "us-east-1:ami-0abc", "version": "1.0.0", "built": 1})
    images.record({"provider": "gcp", "variant": "gpu", "name": "hyper-node-gpu-1-0-0-2",
                   "id": "hyper-node-gpu-1-0-0-2", "version": "1.0.0", "built": 2})
    rows = json.loads(hyper("image", "ls", "--json", check=True).stdout)
    assert [r["provider"] for r in rows] == ["gcp", "aws"]  # newest first
    out = hyper("image", "ls", "--provider", "aws", check=True).stdout
    assert "ami-0abc" in out and "gpu" not in out
    (hyper_home / "images.json").write_text("{broken")
    r = hyper("image", "ls")
    assert r.returncode == 3 and "images.json" in r.stderr and "Traceback" not in r.stderr


# -- provisioning on SSH test hosts ---------------------------------------------------------
# the test hosts share this machine's /usr, /opt and /etc except /etc/ssh: files go to the
# hosts' own /root instead
HOST_ENV = {"HYPER_PREFIX": "/root/opt/hypercli", "HYPER_BIN": "/root/bin",
            "HYPER_LIB": "/root/lib/hyper", "HYPER_UNITS": "/root/units",
            "HYPER_SSHD_CONFIG": "/etc/ssh/sshd_config"}
SNAPSHOT = ("find /root/opt /root/bin /root/lib /root/units /etc/ssh -exec stat -c '%n %s %Y %a'"
            " {} + | sort; find /root/opt /root/bin /root/lib /root/units /etc/ssh -type f "
            "-exec sha256sum {} + | sort; ls -d /tmp/hyper-provision.* 2>/dev/null || true")


def connect(ssh_hosts, host, tmp_path):
    from hypercli.ssh.conn import Connection, Target
    from hypercli.ssh.hostkeys import KnownHosts
    known = KnownHosts(path=tmp_path / "known_hosts")
    return Connection(host.name, Target(host.ip, host.port, "root", str(ssh_hosts.client_key)),
                      known, trust_new=True)


def nvidia_here() -> bool:
    return any(Path(v).read_text().strip() == "0x10de"
               for v in glob.glob("/sys/bus/pci/devices/*/vendor"))


def effective_sshd(conn) -> dict:
    out = conn.run("/usr/sbin/sshd -T -f /etc/ssh/sshd_config").stdout.decode()
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


@pytest.mark.slow
def test_provisioning_runs_on_hosts_twice_changing_nothing_the_second_time(ssh_hosts,
                                                                          tmp_path):
    from hypercli.providers.cloud import CloudSpec
    from hypercli.providers.cloud_provider import boot_document
    import yaml
    hosts = ssh_hosts.start(2)
    for h in hosts:  # a host that still accepts passwords
        cfg = h.root / "etc-ssh" / "sshd_config"
        cfg.write_text(cfg.read_text().replace("PasswordAuthentication no",
                                               "PasswordAuthentication yes")
                       .replace("KbdInteractiveAuthentication no",
                                "KbdInteractiveAuthentication yes"))
    conns = {h.name: connect(ssh_hosts, h, tmp_path) for h in hosts}
    # the steps that download are left out; GPU detection runs where there is no NVIDIA
    # device, and pre-pulling nothing needs no download
    skip = ("base", "docker", "goofys") + (("nvidia",) if nvidia_here() else ())
    try:
        assert effective_sshd(conns[hosts[0].name])["passwordauthentication"] == "yes"
        first = images.bootstrap(conns, skip=skip, env=HOST_ENV)
        before = {}
        for name, conn in conns.items():
            text = "\n".join(first[name])
            assert "hyper-provision: hypercli: changed" in text
            assert "hyper-provision: ssh: changed" in text
            assert all(f"hyper-provision: {s}: skipped" in first[name] for s in skip)
            assert "hyper-provision: prepull: unchanged" in first[name]
            if "nvidia" not in skip:
                assert "hyper-provision: nvidia: skipped (no NVIDIA device)" in first[name]
            # hypercli's node commands and the watcher run from what was installed
            r = conn.run("/root/bin/hyper-node --help")
            assert b"push-output" in r.stdout
            r = conn.run("readlink /root/opt/hypercli/current && "
                         "python3 /root/lib/hyper/watch.py --cloud none --root /tmp/w --once "
                         "--idle-minutes 0")
            assert r.exit_code == 0
            # the unit is the one a cloud node's boot document writes
            doc = yaml.safe_load(boot_document(CloudSpec(cluster="c", count=1), "aws", "n",
                                               "k", "k", "k").split("\n", 1)[1])
            unit = next(f["content"] for f in doc["write_files"]
                        if f["path"].endswith("hyper-watch.service"))
            assert conn.run("cat /root/units/hyper-watch.service").stdout.decode() == unit
            # keys only, as sshd itself reads its configuration now
            eff = effective_sshd(conn)
            assert eff["passwordauthentication"] == "no"
            assert eff["kbdinteractiveauthentication"] == "no"
            assert eff["permitemptypasswords"] == "no"
            # as the host had it (sshd -T prints prohibit-password by its old name)
            assert eff["permitrootlogin"] in ("prohibit-password", "without-password")
            before[name] = conn.run(SNAPSHOT).stdout.decode()
            assert "hyper-provision." not in before[name]  # the upload folder is removed
        second = images.bootstrap(conns, skip=skip, env=HOST_ENV)
        for name, conn in conns.items():
            assert [line for line in second[name] if ": changed" in line] == []
            assert "hyper-provision: hypercli: unchanged" in second[name]
            assert "hyper-provision: ssh: unchanged" in second[name]
            assert conn.run(SNAPSHOT).stdout.decode() == before[name]
        with pytest.raises(images.ProvisionError, match="unknown step 'dockr'") as e:
            images.bootstrap(conns, skip=("dockr",), env=HOST_ENV)
        assert set(e.value.results) == set(conns)
    finally:
        for conn in conns.values():
            conn.close()


@pytest.mark.slow
def test_a_config_sshd_refuses_is_put_back(ssh_hosts, tmp_path):
    [host] = ssh_hosts.start(1)
    cfg = host.root / "etc-ssh" / "sshd_config"
    good = cfg.read_text()
    cfg.write_text(good + "NoSuchKeyword yes\n")
    conn = connect(ssh_hosts, host, tmp_path)
    try:
        with pytest.raises(images.InfraError, match="sshd refuses") as e:
            images.provision(conn, skip=("base", "docker", "nvidia", "goofys", "hypercli",
                                         "prepull"), env=HOST_ENV)
        assert "hyper-provision: engines: skipped" in str(e.value)  # the step before
        assert cfg.read_text() == good + "NoSuchKeyword yes\n"
        assert not (host.root / "etc-ssh" / "sshd_config.d" / "01-hyper.conf").exists()
        cfg.write_text(good)
        lines = images.provision(conn, skip=images.DOWNLOAD_STEPS + ("hypercli",),
                                 env=HOST_ENV)
        assert any(line.startswith("hyper-provision: ssh: changed") for line in lines)
    finally:
        conn.close()


def test_engines_step_finds_engines_already_there_and_refuses_unknown_ones(ssh_hosts, tmp_path):
    """The engines step on a host whose PATH has Java and an environment with pyspark and
    ray (scripts/engines.sh): nothing to install; an unknown engine stops provisioning."""
    engines = Path(os.environ.get("HYPER_TEST_ENGINES") or "/opt/hypercli-engines")
    if not (engines / "bin" / "ray").exists() or not shutil.which("java"):
        if os.environ.get("HYPER_REQUIRE_SSH_HOSTS") == "1":
            pytest.fail(f"no engines at {engines} (scripts/engines.sh installs them)")
        pytest.skip(f"no engines at {engines}")
    [host] = ssh_hosts.start(1)
    conn = connect(ssh_hosts, host, tmp_path)
    others = tuple(s for s in images.DOWNLOAD_STEPS + ("hypercli", "ssh") if s != "engines")
    env = dict(HOST_ENV, PATH=f"{engines}/bin:/usr/sbin:/usr/bin:/sbin:/bin")
    try:
        lines = images.provision(conn, skip=others, env=dict(env, HYPER_ENGINES="spark ray"))
        assert "hyper-provision: engines: unchanged" in lines
        with pytest.raises(images.InfraError, match="unknown engine 'flink'"):
            images.provision(conn, skip=others, env=dict(env, HYPER_ENGINES="spark flink"))
        lines = images.provision(conn, skip=others, env=env)
        assert "hyper-provision: engines: skipped (HYPER_ENGINES is empty)" in lines
    finally:
        conn.close()


@pytest.mark.slow
def test_the_templates_provisioners_run_by_packer_on_a_host(ssh_hosts, tmp_path):
    """`packer build` of the template's own build block (file upload of scripts/ and the code
    tar, the environment with values holding spaces, execute_command as root, provision.sh,
    clean-up) on an SSH test host: a copy of the template gains a `null` source that reaches
    the host. Steps that download or write outside the host's private folders are skipped
    through the template's `skip` variable; the ssh step runs."""
    packer = need("packer")
    [host] = ssh_hosts.start(1)
    folder = tmp_path / "template"
    shutil.copytree(images.template_folder(packer, tmp_path), folder)
    (folder / "plugins.pkr.hcl").unlink(missing_ok=True)
    hcl = folder / "node.pkr.hcl"
    text = hcl.read_text()
    assert text.count('sources = ["source.amazon-ebs.node"') == 1
    hcl.write_text(text.replace('sources = ["source.amazon-ebs.node"',
                                'sources = ["source.null.host", "source.amazon-ebs.node"')
                   + f"""
source "null" "host" {{
  ssh_host             = "{host.ip}"
  ssh_port             = {host.port}
  ssh_username         = "root"
  ssh_private_key_file = "{ssh_hosts.client_key}"
}}
""")
    bundle = images.code_tar(tmp_path / "hypercli-bundle.tar")
    args = ["build", "-machine-readable", "-only=null.host",
            *template_vars(tmp_path, skip="hypercli base docker goofys")]
    args[args.index(f"bundle={tmp_path / 'bundle.tar'}")] = f"bundle={bundle}"
    r = subprocess.run([packer, *args, str(folder)], capture_output=True, text=True,
                       timeout=300)
    out = "\n".join(filter(None, map(images._ui_text, r.stdout.splitlines())))
    assert r.returncode == 0, out + r.stderr
    for line in ("hyper-provision: base: skipped", "hyper-provision: hypercli: skipped",
                 "hyper-provision: nvidia: skipped (variant cpu)",
                 "hyper-provision: prepull: unchanged", "hyper-provision: ssh: changed",
                 "hyper-provision: engines: skipped (HYPER_ENGINES is empty)"):
        assert line in out
    conf = host.root / "etc-ssh" / "sshd_config.d" / "01-hyper.conf"
    assert "PasswordAuthentication no" in conf.read_text()
    assert not list((host.root / "tmp").glob("hyper-provision*"))  # cleaned up
