"""AWS EC2 through boto3: the :class:`~hypercli.providers.cloud.CloudAPI` of provider ``aws``.

What a cluster gets (all tagged ``hyper:cluster``, ``hyper:node`` where it belongs to one node,
``hyper:owner``, and ``Name``):

* a key pair ``hyper-<cluster>`` (the public half of the key made by hypercli);
* a security group ``hyper-<cluster>`` in the default VPC with one rule: TCP 22 from
  ``ssh_cidr``;
* per node one instance, spot (one-time request, terminated on interruption, ``MaxPrice`` when
  ``max_price`` is set) or on-demand, shutting down = terminating (so the node watcher's idle
  power-off removes it), its root volume of ``disk_gb`` GiB (gp3, deleted with the instance);
  zones are tried in ``zones`` order while the answer is a capacity error.

Credentials: boto3's standard chain (``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID``..., ``~/.aws``,
instance roles). Test seam: ``HYPER_AWS_ENDPOINT_URL`` sends every EC2 and STS call to that
endpoint (moto's server in the test suite).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import boto3
from botocore.exceptions import (BotoCoreError, ClientError, NoCredentialsError,
                                 NoRegionError, PartialCredentialsError)

from hypercli.errors import UsageError
from hypercli.providers.cloud import (TAG_CLUSTER, TAG_IMAGE, TAG_NODE, TAG_OWNER, TAG_VARIANT,
                                      VM, Boot, CapacityError, CloudError, CloudSpec,
                                      CredentialsError, QuotaError, Resource, owner)

CREDENTIALS_HINT = ("run `aws configure`, or set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY")
#: error codes of EC2 (docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html)
AUTH_CODES = {"AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId",
              "ExpiredToken", "RequestExpired", "SignatureDoesNotMatch",
              "UnauthorizedOperation", "OptInRequired"}
CAPACITY_CODES = {"InsufficientInstanceCapacity", "InsufficientCapacity",
                  "InsufficientHostCapacity", "Unsupported", "SpotMaxPriceTooLow",
                  "InsufficientFreeAddressesInSubnet"}
QUOTA_CODES = {"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded",
               "ResourceLimitExceeded"}
GONE_CODES = {"InvalidInstanceID.NotFound", "InvalidGroup.NotFound", "InvalidKeyPair.NotFound",
              "InvalidVolume.NotFound", "InvalidNetworkInterfaceID.NotFound",
              "InvalidAllocationID.NotFound", "InvalidSpotInstanceRequestID.NotFound"}
STATES = {"pending": "pending", "running": "running", "stopping": "stopping",
          "shutting-down": "stopping", "stopped": "stopping", "terminated": "terminated"}
TERMINATE_WAIT = 300.0  # s that ``delete`` waits for instances to be terminated


@contextmanager
def _calls(what: str):
    """Turn boto3's errors into hypercli's (module docstring): credentials, capacity,
    quota, other cloud errors."""
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError) as e:
        raise CredentialsError(f"no AWS credentials ({e})", CREDENTIALS_HINT) from None
    except NoRegionError:
        raise UsageError("no AWS region", "set cluster.region, or AWS_DEFAULT_REGION") from None
    except ClientError as e:
        err = e.response.get("Error", {})
        code, msg = err.get("Code", "?"), err.get("Message", str(e))
        if code in AUTH_CODES:
            raise CredentialsError(f"AWS refused the credentials ({code}: {msg})",
                                   CREDENTIALS_HINT) from None
        cls = CapacityError if code in CAPACITY_CODES else \
            QuotaError if code in QUOTA_CODES else CloudError
        raise cls(f"{what}: {code}: {msg}", code=code) from None
    except BotoCoreError as e:
        raise CloudError(f"{what}: {e}") from None


def _tags(cluster: str, node: str | None = None, name: str | None = None) -> list[dict]:
    tags = {TAG_CLUSTER: cluster, TAG_OWNER: owner(), "Name": name or node or
            f"hyper-{cluster}"}
    if node:
        tags[TAG_NODE] = node
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def _tag(obj: dict, key: str) -> str | None:
    return next((t["Value"] for t in obj.get("Tags") or [] if t["Key"] == key), None)


def _code(e: CloudError) -> str:
    return e.code or ""


class AWSAPI:
    """EC2 in one region (see the module docstring).

    Args:
        region: e.g. ``us-east-1``; empty: boto3's configured default.
        session: a boto3 Session (default: a new one from the standard chain).
    """

    name = "aws"

    def __init__(self, region: str = "", session: boto3.Session | None = None):
        self.session = session or boto3.Session()
        self.region = region or self.session.region_name or os.environ.get(
            "AWS_DEFAULT_REGION") or ""
        self._local = threading.local()

    def _client(self, service: str):
        key = f"c_{service}"
        c = getattr(self._local, key, None)
        if c is None:  # boto3 clients are thread-safe but not their creation: one per thread
            if not self.region:
                raise UsageError("no AWS region", "set cluster.region, or AWS_DEFAULT_REGION")
            with _calls("creating the EC2 client"):
                c = self.session.client(service, region_name=self.region,
                                        endpoint_url=os.environ.get("HYPER_AWS_ENDPOINT_URL")
                                        or None)
            setattr(self._local, key, c)
        return c

    @property
    def ec2(self):
        return self._client("ec2")

    # -- the contract ----------------------------------------------------------------------
    def check(self) -> str:
        with _calls("checking the credentials"):
            ident = self._client("sts").get_caller_identity()
        return f"account {ident['Account']}, region {self.region}"

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        name = f"hyper-{spec.cluster}"
        ec2 = self.ec2
        with _calls("finding the default VPC"):
            vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            raise CloudError(f"region {self.region} has no default VPC",
                             "create one: aws ec2 create-default-vpc")
        vpc = vpcs[0]["VpcId"]
        with _calls("importing the key pair"):
            try:
                ec2.import_key_pair(KeyName=name, PublicKeyMaterial=ssh_public_key.encode(),
                                    TagSpecifications=[{"ResourceType": "key-pair",
                                                        "Tags": _tags(spec.cluster)}])
            except ClientError as e:
                if e.response["Error"]["Code"] != "InvalidKeyPair.Duplicate":
                    raise
        with _calls("creating the security group"):
            groups = ec2.describe_security_groups(Filters=[
                {"Name": "group-name", "Values": [name]},
                {"Name": "vpc-id", "Values": [vpc]}])["SecurityGroups"]
            if groups:
                sg = groups[0]["GroupId"]
            else:
                sg = ec2.create_security_group(
                    GroupName=name, VpcId=vpc,
                    Description=f"hypercli cluster {spec.cluster}: SSH from {spec.ssh_cidr}",
                    TagSpecifications=[{"ResourceType": "security-group",
                                        "Tags": _tags(spec.cluster)}])["GroupId"]
                ec2.authorize_security_group_ingress(GroupId=sg, IpPermissions=[{
                    "IpProtocol": "tcp", "FromPort": 22, "ToPort": 22,
                    "IpRanges": [{"CidrIp": spec.ssh_cidr, "Description": "hyper SSH"}]}])
            subnets = ec2.describe_subnets(Filters=[{"Name": "vpc-id", "Values": [vpc]}])
        by_zone = {}
        for s in subnets["Subnets"]:
            if s.get("DefaultForAz", True):
                by_zone.setdefault(s["AvailabilityZone"], s["SubnetId"])
        return {"key_name": name, "security_group": sg, "subnets": by_zone}

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
        image = self.find_image(spec)
        with _calls("describing the image"):
            img = self.ec2.describe_images(ImageIds=[image])["Images"][0]
        root = img.get("RootDeviceName") or "/dev/xvda"
        zones = list(spec.zones) or [None]
        vms, errors = [], {}
        for node in nodes:
            last: Exception | None = None
            for zone in zones:
                try:
                    vms.append(self._run(spec, node, zone, image, root, boot, prepared))
                    last = None
                    break
                except CapacityError as e:
                    last = e  # the next zone may have room
                except CloudError as e:
                    last = e
                    break
            if last is not None:
                errors[node] = last
        return vms, errors

    def _run(self, spec: CloudSpec, node: str, zone: str | None, image: str, root: str,
             boot: Boot, prepared: dict) -> VM:
        args = {
            "ImageId": image, "InstanceType": spec.instance_type, "MinCount": 1, "MaxCount": 1,
            "KeyName": prepared["key_name"], "UserData": boot.user_data[node],
            "InstanceInitiatedShutdownBehavior": "terminate",
            "BlockDeviceMappings": [{"DeviceName": root, "Ebs": {
                "VolumeSize": spec.disk_gb, "VolumeType": "gp3",
                "DeleteOnTermination": True}}],
            "TagSpecifications": [{"ResourceType": r, "Tags": _tags(spec.cluster, node)}
                                  for r in ("instance", "volume", "network-interface")],
        }
        subnet = prepared["subnets"].get(zone) if zone else None
        if subnet:
            args["NetworkInterfaces"] = [{"DeviceIndex": 0, "SubnetId": subnet,
                                          "Groups": [prepared["security_group"]],
                                          "AssociatePublicIpAddress": True}]
        else:
            args["SecurityGroupIds"] = [prepared["security_group"]]
            if zone:
                args["Placement"] = {"AvailabilityZone": zone}
        if spec.spot:
            opts = {"SpotInstanceType": "one-time",
                    "InstanceInterruptionBehavior": "terminate"}
            if spec.max_price:
                opts["MaxPrice"] = f"{spec.max_price:.4f}"
            args["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": opts}
            args["TagSpecifications"].append({"ResourceType": "spot-instances-request",
                                              "Tags": _tags(spec.cluster, node)})
        with _calls(f"launching {node}" + (f" in {zone}" if zone else "")):
            inst = self.ec2.run_instances(**args)["Instances"][0]
        return self._vm(inst)

    def _vm(self, inst: dict) -> VM:
        state = STATES.get(inst["State"]["Name"], "pending")
        if (inst.get("StateReason") or {}).get("Code") == "Server.SpotInstanceTermination":
            state = "preempted"
        return VM(id=inst["InstanceId"], node=_tag(inst, TAG_NODE) or "",
                  zone=(inst.get("Placement") or {}).get("AvailabilityZone", ""),
                  state=state, public_ip=inst.get("PublicIpAddress"),
                  private_ip=inst.get("PrivateIpAddress"),
                  instance_type=inst.get("InstanceType", ""),
                  spot=inst.get("InstanceLifecycle") == "spot",
                  extra={"image": inst.get("ImageId"),
                         "launched": str(inst.get("LaunchTime", ""))})

    def _instances(self, cluster: str | None) -> list[dict]:
        f = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}] if cluster else \
            [{"Name": "tag-key", "Values": [TAG_CLUSTER]}]
        out = []
        with _calls("listing instances"):
            for page in self.ec2.get_paginator("describe_instances").paginate(Filters=f):
                out += [i for r in page["Reservations"] for i in r["Instances"]]
        return out

    def describe(self, cluster: str) -> list[VM]:
        return [self._vm(i) for i in self._instances(cluster)
                if i["State"]["Name"] != "terminated"
                or (i.get("StateReason") or {}).get("Code") == "Server.SpotInstanceTermination"]

    def terminate(self, cluster: str, ids: list[str]) -> None:
        if ids:
            with _calls("terminating instances"):
                self.ec2.terminate_instances(InstanceIds=ids)

    def resources(self, cluster: str | None = None) -> list[Resource]:
        ec2 = self.ec2
        f = [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}] if cluster else \
            [{"Name": "tag-key", "Values": [TAG_CLUSTER]}]
        out = [Resource("instance", i["InstanceId"], _tag(i, TAG_CLUSTER), self.region)
               for i in self._instances(cluster) if i["State"]["Name"] != "terminated"]
        with _calls("listing resources"):
            out += [Resource("spot_request", r["SpotInstanceRequestId"],
                             _tag(r, TAG_CLUSTER), self.region)
                    for r in ec2.describe_spot_instance_requests(Filters=f)[
                        "SpotInstanceRequests"] if r["State"] in ("open", "active")]
            out += [Resource("network_interface", n["NetworkInterfaceId"],
                             _tag(n, TAG_CLUSTER), self.region)
                    for n in ec2.describe_network_interfaces(Filters=f)["NetworkInterfaces"]]
            out += [Resource("volume", v["VolumeId"], _tag(v, TAG_CLUSTER), self.region)
                    for v in ec2.describe_volumes(Filters=f)["Volumes"]]
            out += [Resource("address", a["AllocationId"], _tag(a, TAG_CLUSTER), self.region)
                    for a in ec2.describe_addresses(Filters=f)["Addresses"]
                    if a.get("AllocationId")]
            out += [Resource("key_pair", k["KeyName"], _tag(k, TAG_CLUSTER), self.region)
                    for k in ec2.describe_key_pairs(Filters=f)["KeyPairs"]]
            out += [Resource("security_group", g["GroupId"], _tag(g, TAG_CLUSTER), self.region)
                    for g in ec2.describe_security_groups(Filters=f)["SecurityGroups"]]
        return out

    def delete(self, resources: list[Resource]) -> list[str]:
        ec2 = self.ec2
        removed = []
        instances = [r.id for r in resources if r.kind == "instance"]
        if instances:
            self._gone(lambda: ec2.terminate_instances(InstanceIds=instances))
            deadline = time.monotonic() + TERMINATE_WAIT
            while time.monotonic() < deadline:
                with _calls("waiting for instances to terminate"):
                    left = [i for r in ec2.describe_instances(InstanceIds=instances)[
                        "Reservations"] for i in r["Instances"]
                        if i["State"]["Name"] != "terminated"]
                if not left:
                    break
                time.sleep(2.0)
            removed += [f"instance {i}" for i in instances]
        actions = {
            "spot_request": lambda i: ec2.cancel_spot_instance_requests(
                SpotInstanceRequestIds=[i]),
            "network_interface": lambda i: ec2.delete_network_interface(NetworkInterfaceId=i),
            "volume": lambda i: ec2.delete_volume(VolumeId=i),
            "address": lambda i: ec2.release_address(AllocationId=i),
            "key_pair": lambda i: ec2.delete_key_pair(KeyName=i),
            "security_group": lambda i: ec2.delete_security_group(GroupId=i),
        }
        for r in resources:
            if r.kind in actions:
                for attempt in range(5):
                    try:
                        self._gone(lambda: actions[r.kind](r.id))
                        removed.append(f"{r.kind} {r.id}")
                        break
                    except CloudError as e:  # e.g. a group still used by a vanishing ENI
                        if _code(e) != "DependencyViolation" or attempt == 4:
                            raise
                        time.sleep(2.0)
        return removed

    @staticmethod
    def _gone(call) -> None:
        """Run a delete; a resource already gone is not an error."""
        try:
            with _calls("deleting"):
                call()
        except CloudError as e:
            if _code(e) not in GONE_CODES:
                raise

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        if not spec.spot or not spec.instance_type:
            return {}
        with _calls("reading spot prices"):
            hist = self.ec2.describe_spot_price_history(
                InstanceTypes=[spec.instance_type], ProductDescriptions=["Linux/UNIX"],
                MaxResults=100)["SpotPriceHistory"]
        newest: dict[str, tuple] = {}
        for h in hist:
            z = h["AvailabilityZone"]
            if spec.zones and z not in spec.zones:
                continue
            if z not in newest or h["Timestamp"] > newest[z][0]:
                newest[z] = (h["Timestamp"], float(h["SpotPrice"]))
        return {z: p for z, (_, p) in newest.items()}

    def find_image(self, spec: CloudSpec) -> str:
        ec2 = self.ec2
        if spec.image:
            try:
                with _calls("finding the image"):
                    found = ec2.describe_images(ImageIds=[spec.image])["Images"]
            except CloudError as e:
                if "InvalidAMIID" not in _code(e):
                    raise
                found = []
            if not found:
                raise UsageError(f"image {spec.image} does not exist in {self.region}",
                                 "set cluster.image to an AMI of that region")
            return spec.image
        with _calls("finding the baked image"):
            images = ec2.describe_images(Owners=["self"], Filters=[
                {"Name": f"tag:{TAG_IMAGE}", "Values": ["node"]},
                {"Name": f"tag:{TAG_VARIANT}", "Values": [spec.variant]}])["Images"]
        if not images:
            raise UsageError(f"no baked hypercli {spec.variant} image in {self.region}",
                             "bake one: hyper image build --provider aws "
                             "(or set image: ami-...)")
        return max(images, key=lambda i: i.get("CreationDate", ""))["ImageId"]
