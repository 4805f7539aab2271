"""A cloud for the tests: moto's EC2 API on loopback whose instances boot onto SSH test hosts.

The test seam (documented in hypercli/providers/cloud_provider.py): ``HYPER_CLOUD_ADDRESSES``
names a JSON file {instance id: "host:port"}. A :class:`Booter` thread plays the part of the
cloud booting a VM: for each new instance of a cluster it takes a free test host, applies the
instance's cloud-config the way cloud-init would (the host key it carries, or, with none, a
new one made on the host and published as its ``runcmd`` does: GCP guest attributes; root's
authorized key), restarts the host's sshd, and writes the instance's address into that file.
"""

from __future__ import annotations

import base64
import json
import threading
from pathlib import Path

import pytest
import yaml

from s3server import CREDENTIALS, S3Server

REGION = "us-east-1"


class Booter(threading.Thread):
    """Boots a cloud's new instances onto free SSH test hosts (module docstring).

    Args:
        source: the moto EC2 client, or a callable giving ``{instance id: cloud-config
            text}`` of the instances that are up (the GCP and Azure stand-ins: see
            :func:`gcp_source`, :func:`azure_source`).
    """

    def __init__(self, source, hosts, seam: Path, publish=None):
        super().__init__(daemon=True)
        self.publish = publish  # (instance id, public key line): a node's own host key
        self.source = source if callable(source) else _ec2_source(source)
        self.ec2 = None if callable(source) else source
        self.free, self.seam = list(hosts), seam
        self.booted: dict[str, object] = {}  # instance id → TestHost
        self.errors: list[str] = []
        self.stopping = threading.Event()
        seam.write_text("{}")

    def run(self) -> None:
        while not self.stopping.is_set():
            try:
                self._round()
            except Exception as e:  # reported by the test, not lost in a thread
                self.errors.append(f"{type(e).__name__}: {e}")
            self.stopping.wait(0.2)

    def _round(self) -> None:
        for iid, text in self.source().items():
            if iid not in self.booted:
                self._boot(iid, text)

    def _boot(self, iid: str, text: str) -> None:
        if not self.free:
            self.errors.append(f"no free test host for {iid}")
            self.booted[iid] = None
            return
        host = self.free.pop(0)
        doc = yaml.safe_load(text)
        etc = host.root / "etc-ssh"
        key = etc / "ssh_host_ed25519_key"
        if "ssh_keys" in doc:
            private, public = (doc["ssh_keys"]["ed25519_private"],
                               doc["ssh_keys"]["ed25519_public"])
        else:  # cloud-init makes one (ssh_genkeytypes); runcmd publishes its public half
            from hypercli.providers.cloud_provider import new_keypair
            private, public = new_keypair(f"root@{iid}")
        key.write_text(private)
        key.chmod(0o600)
        (etc / "ssh_host_ed25519_key.pub").write_text(public + "\n")
        auth = next(f for f in doc["write_files"] if f["path"] == "/root/.ssh/authorized_keys")
        with open(etc / "authorized_keys", "a") as f:
            f.write(auth["content"])
        host.restart()
        if "ssh_keys" not in doc:
            self.publish(iid, " ".join(public.split()[:2]))
        self.booted[iid] = host
        seam = json.loads(self.seam.read_text())
        seam[iid] = f"{host.ip}:{host.port}"
        tmp = self.seam.with_suffix(".tmp")
        tmp.write_text(json.dumps(seam))
        tmp.replace(self.seam)


def _ec2_source(ec2):
    def source() -> dict:
        r = ec2.describe_instances(Filters=[
            {"Name": "tag-key", "Values": ["hyper:cluster"]},
            {"Name": "instance-state-name", "Values": ["pending", "running"]}])
        out = {}
        for res in r["Reservations"]:
            for inst in res["Instances"]:
                data = ec2.describe_instance_attribute(InstanceId=inst["InstanceId"],
                                                       Attribute="userData")
                out[inst["InstanceId"]] = base64.b64decode(data["UserData"]["Value"]).decode()
        return out
    return source


def gcp_source(fake):
    """Instances of tests/gcpfake.py's ComputeFake with their ``user-data`` metadata."""
    def source() -> dict:
        out = {}
        for zone in list(fake.instances.values()):
            for name, inst in list(zone.items()):
                items = {i["key"]: i["value"] for i in inst["metadata"]["items"]}
                out[name] = items["user-data"]
        return out
    return source


def gcp_publisher(fake):
    """The guest side of tests/gcpfake.py's ComputeFake: an instance publishes its host key
    in its guest attributes (``hostkeys/ssh-ed25519``), as the boot document's runcmd does."""
    def publish(name: str, public: str) -> None:
        zone = next(z for z, insts in fake.instances.items() if name in insts)
        fake.publish(zone, name, "hostkeys", "ssh-ed25519", public)
    return publish


def azure_source(fake):
    """VMs of tests/azurefake.py's ArmFake with their custom data."""
    def source() -> dict:
        return {r["name"]: base64.b64decode(
                    r["properties"]["osProfile"]["customData"]).decode()
                for r in list(fake.res.values()) if r["type"].endswith("/virtualMachines")}
    return source


@pytest.fixture
def aws(monkeypatch, tmp_path):
    """moto_server on loopback with the environment pointing the aws provider at it."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    server = S3Server().start()
    monkeypatch.setenv("HYPER_AWS_ENDPOINT_URL", server.endpoint)
    monkeypatch.setenv("HYPER_CLOUD_ADDRESSES", str(tmp_path / "addresses.json"))
    import boto3
    ec2 = boto3.client("ec2", region_name=REGION, endpoint_url=server.endpoint)
    try:
        yield ec2
    finally:
        server.stop()


def tagged_left(ec2, cluster: str) -> list[str]:
    """What moto still holds for the cluster (instances not terminated, groups, keys,
    volumes, network interfaces)."""
    f = [{"Name": "tag:hyper:cluster", "Values": [cluster]}]
    left = [i["InstanceId"] for r in ec2.describe_instances(Filters=f)["Reservations"]
            for i in r["Instances"] if i["State"]["Name"] != "terminated"]
    left += [g["GroupId"] for g in ec2.describe_security_groups(Filters=f)["SecurityGroups"]]
    left += [k["KeyName"] for k in ec2.describe_key_pairs(Filters=f)["KeyPairs"]]
    left += [v["VolumeId"] for v in ec2.describe_volumes(Filters=f)["Volumes"]]
    left += [n["NetworkInterfaceId"]
             for n in ec2.describe_network_interfaces(Filters=f)["NetworkInterfaces"]]
    return left
