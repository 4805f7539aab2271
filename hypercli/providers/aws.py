"""AWS EC2 through boto3: the :class:`~hypercli.providers.cloud.CloudAPI` of provider ``aws``.

What a cluster gets, every piece tagged ``hyper:cluster``, ``hyper:owner`` and ``Name`` (and
``hyper:node`` where it belongs to one node):

* a key pair ``hyper-<cluster>``: the public half of the cluster key made by hypercli
  (replaced when the local key changed);
* a security group ``hyper-<cluster>`` in the region's default VPC with exactly two inbound
  rules: TCP 22 from ``ssh_cidr``, and all traffic from the group itself (the cluster's nodes
  reach each other on their private addresses, e.g. the ranks of a multi-node task); other
  inbound rules are revoked, so a new caller address replaces the old one;
* per node one instance, spot (a one-time request, terminated on interruption, ``MaxPrice``
  when ``max_price`` is set) or on-demand; shutdown from inside terminates it (so the idle
  watchdog's power-off removes it); its root volume is ``disk_gb`` GiB, gp3, deleted with
  the instance; the boot document is its user data.

Storage identity (``spec.grants``, from the recipe's ``storage`` and ``mounts`` and the
cluster's live workflows; see :mod:`hypercli.recipe.access`): when they name ``s3://``
buckets, the cluster gets an IAM role and an instance profile, both named
``hyper-<cluster>-<tag>`` (:func:`role_name`; ``<tag>`` is
:func:`~hypercli.providers.cloud.identity_tag`, since IAM names are case-insensitive and
limited to 64 characters) under the path ``/hyper/<cluster>/`` (how ``down`` and ``gc`` find
them) and tagged like the rest plus ``hyper:cluster-id`` = ``<tag>``; the role has an inline
policy ``hyper-storage`` (:func:`storage_policy`) and nothing else: ``s3:GetObject`` on the
objects under each read grant's prefix, also ``s3:PutObject``, ``s3:DeleteObject`` and
``s3:AbortMultipartUpload`` under each read/write grant's, and ``s3:ListBucket`` on those
buckets only with an ``s3:prefix`` condition (a listing must ask for a prefix under a grant's).
Writes and their buckets' listings carry an ``s3:ResourceAccount`` condition: the bucket must
belong to the caller's own account, so a bucket name someone else owns never receives
outputs (reads of another account's datasets stay possible). Without unconditioned
ListBucket, S3 answers a HEAD of a missing key with 403, not 404: the node-side store takes a
403 on HEAD for "not there" (:meth:`hypercli.mount.store.S3Store.exists`). A role or profile
found under the computed name is used only when it is the cluster's own as hypercli leaves
it (path, tags, the EC2 trust policy, no managed policy, no other inline policy, no other
role in the profile): :class:`~hypercli.providers.cloud.IdentityConflict` otherwise, exit 2.
The nodes' boto3 gets the role's credentials from the instance metadata service; a profile
made for a cluster whose instances run already is associated with them.
``cluster.iam_role`` names an existing instance profile instead: nothing is made.
A caller who may not make roles (``iam:CreateRole``, ``iam:PutRolePolicy``,
``iam:CreateInstanceProfile``, ``iam:AddRoleToInstanceProfile``, ``iam:PassRole``) gets a
:class:`CredentialsError` naming the permission and ``cluster.iam_role``, before anything else
is made. Instances require IMDSv2 with a hop limit of 1: the metadata service answers only a
session token asked from the node itself, so a container on a bridge network (one hop more)
cannot read the role's credentials or the user data (which holds the node's host key); the
node's boot document also drops containers' packets to it
(:func:`hypercli.providers.cloud_provider.block_script`). Nodes have no EC2 right at all: the
idle watchdog powers the node off, and instances are launched to terminate on shutdown.

Zones: ``zones`` are tried in order while EC2 answers with a capacity error; with no zones,
EC2 picks first, then each zone of the default VPC is tried by name.

Errors (codes from docs.aws.amazon.com/AWSEC2/latest/APIReference/errors-overview.html): missing
or refused credentials → :class:`CredentialsError`; capacity → :class:`CapacityError`;
account limits → :class:`QuotaError`; anything else → :class:`CloudError` with the AWS code.

Credentials and region: boto3's standard chain (``AWS_PROFILE``, ``AWS_ACCESS_KEY_ID`` /
``AWS_SECRET_ACCESS_KEY``, ``~/.aws``, instance roles). Test seam: ``HYPER_AWS_ENDPOINT_URL``
sends every EC2, IAM and STS call to that endpoint (a moto server in the test suite).
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from contextlib import contextmanager
from datetime import datetime, timezone

import boto3
from botocore.config import Config
from botocore.exceptions import (BotoCoreError, ClientError, NoCredentialsError,
                                 NoRegionError, PartialCredentialsError, ProfileNotFound)

from hypercli.errors import UsageError
from hypercli.providers.cloud import (TAG_CLUSTER, TAG_IMAGE, TAG_NODE, TAG_OWNER, TAG_VARIANT,
                                      VM, Boot, CapacityError, CloudError, CloudSpec,
                                      CredentialsError, IdentityConflict, QuotaError, Resource,
                                      owner)
from hypercli.recipe.access import rights

ENDPOINT_ENV = "HYPER_AWS_ENDPOINT_URL"
CREDENTIALS_HINT = ("run `aws configure`, or set AWS_PROFILE, or AWS_ACCESS_KEY_ID and "
                    "AWS_SECRET_ACCESS_KEY")
PERMISSION_HINT = ("the credentials work but may not do this: give their IAM user or role "
                   "the EC2 permissions (or use another AWS_PROFILE)")
#: refused credentials (EC2 and STS codes)
AUTH_CODES = {"AuthFailure", "UnrecognizedClientException", "InvalidClientTokenId",
              "ExpiredToken", "ExpiredTokenException", "RequestExpired",
              "SignatureDoesNotMatch", "InvalidAccessKeyId", "IncompleteSignature"}
#: credentials that work but lack a permission
DENIED_CODES = {"UnauthorizedOperation", "AccessDenied", "AccessDeniedException"}
#: no room for the request in that zone: the next zone is tried
CAPACITY_CODES = {"InsufficientInstanceCapacity", "InsufficientCapacity",
                  "InsufficientHostCapacity", "InsufficientReservedInstanceCapacity",
                  "Unsupported", "SpotMaxPriceTooLow", "InsufficientFreeAddressesInSubnet",
                  # a spot request's status when EC2 cannot fulfil it (EC2 User Guide,
                  # "Spot request status": capacity-not-available, ...), as an error code
                  "capacity-not-available", "capacity-oversubscribed", "price-too-low"}
#: account limits: not retried elsewhere
QUOTA_CODES = {"VcpuLimitExceeded", "MaxSpotInstanceCountExceeded", "InstanceLimitExceeded",
               "ResourceLimitExceeded", "AddressLimitExceeded", "VolumeLimitExceeded"}
#: the resource is already gone: deleting it again is no error
GONE_CODES = {"InvalidInstanceID.NotFound", "InvalidGroup.NotFound", "InvalidKeyPair.NotFound",
              "InvalidVolume.NotFound", "InvalidNetworkInterfaceID.NotFound",
              "InvalidAllocationID.NotFound", "InvalidSpotInstanceRequestID.NotFound"}
#: still used by something that is going away: retried after a pause
BUSY_CODES = {"DependencyViolation", "VolumeInUse", "InvalidNetworkInterface.InUse",
              "InvalidIPAddress.InUse"}
STATES = {"pending": "pending", "running": "running", "stopping": "stopping",
          "shutting-down": "stopping", "stopped": "stopping", "terminated": "terminated"}
SPOT_TERMINATION = "Server.SpotInstanceTermination"  # StateReason code of a preempted node
USER_DATA_MAX = 16384  # bytes before base64 (RunInstances ``UserData``)
TERMINATE_WAIT = 600.0  # s that ``delete`` waits for instances to be terminated
POLL = 2.0  # s between looks while waiting
BUSY_TRIES, BUSY_PAUSE = 5, 2.0  # tries, s between them, for a resource still in use
IAM_PATH = "/hyper/"  # roles and instance profiles of cluster C are under /hyper/C/
STORAGE_POLICY = "hyper-storage"  # the role's inline policy
#: s that RunInstances is retried while it does not know a new instance profile yet: IAM is
#: eventually consistent, a new profile "may take a few seconds" to be usable by EC2
#: (IAM User Guide, "Troubleshooting IAM roles"; 10-15 s is usual)
PROFILE_WAIT = 60.0
#: who may assume a cluster's role: EC2 instances
EC2_TRUST = {"Version": "2012-10-17", "Statement": [{
    "Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"},
    "Action": "sts:AssumeRole"}]}
ROLE_HINT = ("give the caller that permission, or name an existing instance profile whose "
             "role may use the recipe's buckets: cluster.iam_role: NAME")


TAG_CLUSTER_ID = "hyper:cluster-id"  # the identity tag of the cluster a role was made for


def role_name(spec: CloudSpec) -> str:
    """The name of a cluster's role and instance profile: ``hyper-<cluster>-<tag>``, the
    cluster's name cut so that the whole fits IAM's 64 characters (module docstring)."""
    return f"hyper-{spec.cluster[:48]}-{spec.tag}"


def storage_policy(grants, account: str | None = None) -> dict:
    """The IAM policy document (a dict) that allows exactly the ``s3`` grants of ``grants``
    (:class:`hypercli.recipe.access.Grant`; others, and per-workflow templates, are ignored):
    see the module docstring.

    Args:
        account: the caller's AWS account id: writes (and listings of the buckets written)
            get an ``s3:ResourceAccount`` condition naming it; None: no such condition.

    Sources: docs.aws.amazon.com/AmazonS3/latest/userguide/amazon-s3-policy-keys.html
    (``s3:prefix``), .../reference_policies_condition-keys.html (``s3:ResourceAccount``).
    """
    s3 = sorted(g for g in rights(grants) if g.scheme == "s3")
    own = {"StringEquals": {"s3:ResourceAccount": account}} if account else None
    statements = []
    for i, g in enumerate(s3):
        objects = f"arn:aws:s3:::{g.bucket}/" + (f"{g.prefix}/*" if g.prefix else "*")
        actions = ["s3:GetObject"]
        if g.write:
            actions += ["s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload"]
        st = {"Sid": f"{'ReadWrite' if g.write else 'Read'}{i}",
              "Effect": "Allow", "Action": actions, "Resource": objects}
        if g.write and own:
            st["Condition"] = own
        statements.append(st)
    for i, bucket in enumerate(sorted({g.bucket for g in s3})):
        mine = [g for g in s3 if g.bucket == bucket]
        st = {"Sid": f"List{i}", "Effect": "Allow", "Action": "s3:ListBucket",
              "Resource": f"arn:aws:s3:::{bucket}"}
        cond = {}
        if all(g.prefix for g in mine):
            cond["StringLike"] = {"s3:prefix": sorted({f"{g.prefix}/*" for g in mine})}
        if own and any(g.write for g in mine):
            cond.update(own)
        if cond:
            st["Condition"] = cond
        statements.append(st)
    return {"Version": "2012-10-17", "Statement": statements}


CONTROLLER_POLICY = "hyper-controller"  # a controller's role's inline policy
#: what a controller's instances, disks and interfaces carry, and may be acted on by
LAUNCHED = ("instance", "volume", "network-interface", "spot-instances-request")


def controller_policy(owner_tag: str, account: str, grants=()) -> dict:
    """The IAM policy document of a controller instance's role: what driving a workflow on
    EC2 needs and nothing else.

    * ``ec2:Describe*`` (EC2 has no resource-level permissions for its Describe actions);
    * ``ec2:RunInstances`` creating instances, volumes, network interfaces and spot requests
      only when the request tags them ``hyper:owner`` = ``owner_tag`` and ``hyper:cluster``
      (``aws:RequestTag``), from any image and subnet and with security groups and key
      pairs tagged ``hyper:owner`` = ``owner_tag`` (a cluster's, made by ``hyper up``);
      ``ec2:CreateTags`` only within that launch (``ec2:CreateAction`` = RunInstances);
    * ``ec2:TerminateInstances``, ``ec2:DeleteVolume`` and ``ec2:CancelSpotInstanceRequests``
      only on resources tagged ``hyper:owner`` = ``owner_tag`` and ``hyper:cluster``;
    * ``iam:PassRole`` of the clusters' roles (path ``/hyper/``, :data:`IAM_PATH`) to EC2
      alone (``iam:PassedToService``), so that a replacement node gets its cluster's
      storage role; no other IAM action (a controller never makes or widens a role);
    * reads (``s3:GetObject``, ``s3:ListBucket`` under the prefixes) of the ``s3`` grants of
      ``grants`` (:func:`storage_policy` with every grant read-only).

    Args:
        owner_tag: the ``hyper:owner`` value of the user's clusters
            (:func:`hypercli.providers.cloud.owner` where they were brought up).
        account: the account id (the ARN of the clusters' roles).

    Sources: EC2 API Reference, "Actions, resources, and condition keys for Amazon EC2"
    (RunInstances resource types, ``ec2:CreateAction``); IAM User Guide, "Granting a user
    permissions to pass a role" (``iam:PassedToService``).
    """
    from hypercli.recipe.access import Grant
    arn = "arn:aws:ec2:*:*:"
    mine = {"StringEquals": {"ec2:ResourceTag/" + TAG_OWNER: owner_tag},
            "StringLike": {"ec2:ResourceTag/" + TAG_CLUSTER: "*"}}
    made = [f"{arn}{kind}/*" for kind in LAUNCHED]
    st = [
        {"Sid": "Describe", "Effect": "Allow", "Action": "ec2:Describe*", "Resource": "*"},
        {"Sid": "LaunchTagged", "Effect": "Allow", "Action": "ec2:RunInstances",
         "Resource": made, "Condition": {
             "StringEquals": {"aws:RequestTag/" + TAG_OWNER: owner_tag},
             "StringLike": {"aws:RequestTag/" + TAG_CLUSTER: "*"}}},
        {"Sid": "LaunchFrom", "Effect": "Allow", "Action": "ec2:RunInstances",
         "Resource": ["arn:aws:ec2:*::image/*", f"{arn}subnet/*"]},
        {"Sid": "LaunchWith", "Effect": "Allow", "Action": "ec2:RunInstances",
         "Resource": [f"{arn}security-group/*", f"{arn}key-pair/*"],
         "Condition": {"StringEquals": mine["StringEquals"]}},
        {"Sid": "TagAtLaunch", "Effect": "Allow", "Action": "ec2:CreateTags",
         "Resource": made, "Condition": {"StringEquals": {"ec2:CreateAction": "RunInstances"}}},
        {"Sid": "EndTagged", "Effect": "Allow",
         "Action": ["ec2:TerminateInstances", "ec2:DeleteVolume",
                    "ec2:CancelSpotInstanceRequests"],
         "Resource": made, "Condition": mine},
        {"Sid": "PassClusterRoles", "Effect": "Allow", "Action": "iam:PassRole",
         "Resource": f"arn:aws:iam::{account}:role{IAM_PATH}*",
         "Condition": {"StringEquals": {"iam:PassedToService": "ec2.amazonaws.com"}}}]
    reads = [Grant(g.scheme, g.bucket, g.prefix) for g in grants]
    st += [{**x, "Sid": "Storage" + x["Sid"]}
           for x in storage_policy(reads)["Statement"]]
    return {"Version": "2012-10-17", "Statement": st}


@contextmanager
def aws_errors(what: str):
    """Turn boto3's errors raised inside the block into hypercli's (module docstring).

    Args:
        what: the action, for the message (``launching c1-0 in us-east-1a``).
    Raises:
        CredentialsError: no credentials, an unknown profile, refused credentials, or an
            operation the credentials may not do.
        UsageError: no region configured.
        CapacityError, QuotaError, CloudError: other API errors; ``code`` is AWS's.
    """
    try:
        yield
    except (NoCredentialsError, PartialCredentialsError, ProfileNotFound) as e:
        raise CredentialsError(f"no usable AWS credentials ({e})", CREDENTIALS_HINT) from None
    except NoRegionError:
        raise UsageError("no AWS region", "set cluster.region, or AWS_DEFAULT_REGION") from None
    except ClientError as e:
        err = e.response.get("Error", {})
        code, msg = err.get("Code", "?"), err.get("Message", str(e))
        if code in AUTH_CODES:
            raise CredentialsError(f"AWS refused the credentials while {what} ({code}: {msg})",
                                   CREDENTIALS_HINT) from None
        if code in DENIED_CODES:
            raise CredentialsError(f"{what}: {code}: {msg}", PERMISSION_HINT) from None
        cls = (CapacityError if code in CAPACITY_CODES else
               QuotaError if code in QUOTA_CODES else CloudError)
        raise cls(f"{what}: {code}: {msg}", code=code) from None
    except BotoCoreError as e:  # endpoint unreachable, bad response, waiter failure ...
        raise CloudError(f"{what}: {e}") from None


def _tags(cluster: str, node: str | None = None) -> list[dict]:
    tags = {TAG_CLUSTER: cluster, TAG_OWNER: owner(), "Name": node or f"hyper-{cluster}"}
    if node:
        tags[TAG_NODE] = node
    return [{"Key": k, "Value": v} for k, v in tags.items()]


def _statements(doc: dict) -> list:
    """A policy document's statements in a form to compare (order and one-item lists left
    out)."""
    import json

    def norm(v):
        if isinstance(v, list):
            return sorted((norm(x) for x in v), key=json.dumps) if len(v) != 1 else norm(v[0])
        if isinstance(v, dict):
            return {k: norm(x) for k, x in v.items() if k != "Sid"}
        return v
    st = (doc or {}).get("Statement", [])
    return sorted((norm(x) for x in (st if isinstance(st, list) else [st])), key=json.dumps)


def _tag(obj: dict, key: str) -> str | None:
    return next((t["Value"] for t in obj.get("Tags") or [] if t["Key"] == key), None)


def _from_itself(rule: dict, group: str) -> bool:
    """Whether a rule of DescribeSecurityGroupRules is the cluster's own: inbound, every
    protocol and port (``-1``), from members of ``group`` itself."""
    return (not rule.get("IsEgress") and rule.get("IpProtocol") == "-1"
            and (rule.get("ReferencedGroupInfo") or {}).get("GroupId") == group)


def _cluster_filter(cluster: str | None) -> list[dict]:
    if cluster is None:
        return [{"Name": "tag-key", "Values": [TAG_CLUSTER]}]
    return [{"Name": f"tag:{TAG_CLUSTER}", "Values": [cluster]}]


def _chunks(items: list, n: int = 100):
    for i in range(0, len(items), n):
        yield items[i:i + n]


class AWSAPI:
    """EC2 in one region (see the module docstring).

    Args:
        region: e.g. ``us-east-1``; empty: the profile's or ``AWS_DEFAULT_REGION``.
        session: a boto3 Session (default: a new one from the standard chain).
    Raises:
        CredentialsError: ``AWS_PROFILE`` names a profile that does not exist.
    Clients are made on first use, once, and shared between threads (boto3 clients are
    thread-safe, their creation is not).
    """

    name = "aws"

    def __init__(self, region: str = "", session: boto3.Session | None = None):
        with aws_errors("reading the AWS configuration"):
            self.session = session or boto3.Session()
            self.region = region or self.session.region_name or ""
        self._clients: dict = {}
        self._lock = threading.Lock()

    def client(self, service: str):
        """The boto3 client of ``service`` (``ec2``, ``iam``, ``sts``) in this region, made once.
        Raises UsageError when no region is known."""
        with self._lock:
            if service not in self._clients:
                if not self.region:
                    raise UsageError("no AWS region",
                                     "set cluster.region, or AWS_DEFAULT_REGION")
                config = Config(retries={"mode": "standard", "max_attempts": 5},
                                user_agent_extra="hypercli")
                with aws_errors(f"creating the {service} client"):
                    self._clients[service] = self.session.client(
                        service, region_name=self.region, config=config,
                        endpoint_url=os.environ.get(ENDPOINT_ENV) or None)
            return self._clients[service]

    @property
    def iam(self):
        """The IAM client (see :meth:`client`; IAM is global, the region only signs)."""
        return self.client("iam")

    @property
    def ec2(self):
        """The EC2 client (see :meth:`client`)."""
        return self.client("ec2")

    def _all(self, op: str, key: str, **kw) -> list[dict]:
        """Every item under ``key`` of the paginated EC2 call ``op``; call inside
        :func:`aws_errors`."""
        if self.ec2.can_paginate(op):
            return [x for page in self.ec2.get_paginator(op).paginate(**kw) for x in page[key]]
        return getattr(self.ec2, op)(**kw)[key]

    # -- the contract ----------------------------------------------------------------------
    def check(self) -> str:
        """``account <id>, region <region>`` from STS GetCallerIdentity, and whether the
        caller may use IAM for clusters' storage identities (a listing of the roles made for
        clusters: refused means ``hyper up`` of a recipe with ``s3://`` buckets would stop,
        unless it names ``cluster.iam_role``).
        Raises CredentialsError (with how to configure them) or CloudError."""
        with aws_errors("checking the credentials"):
            ident = self.client("sts").get_caller_identity()
        line = f"account {ident['Account']}, region {self.region}"
        try:
            with aws_errors("listing the clusters' instance profiles"):
                self.iam.list_instance_profiles(PathPrefix=IAM_PATH, MaxItems=1)
        except CredentialsError as e:
            if "AccessDenied" not in str(e):
                raise
            return (line + "; storage identities: IAM refused (iam:ListInstanceProfiles), "
                    "so recipes with s3:// buckets need cluster.iam_role")
        return line + "; storage identities: IAM usable"

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        """Make or find, idempotently, the key pair and the security group of
        ``spec.cluster`` (module docstring).

        Args:
            spec: the cluster; ``spec.ssh_cidr`` (e.g. ``203.0.113.7/32``) is who may SSH.
            ssh_public_key: the cluster's public key, OpenSSH one-line form.
        Returns:
            ``{"key_name": str, "security_group": sg id, "vpc": vpc id,
            "subnets": {zone: default subnet id}}``.
        Raises:
            UsageError: no ``ssh_cidr``. CloudError: the region has no default VPC, or an
            API error. CredentialsError.
        """
        if not spec.ssh_cidr:
            raise UsageError("no address range allowed to reach port 22",
                             "set cluster.ssh_cidr, e.g. 203.0.113.7/32")
        name = f"hyper-{spec.cluster}"
        ec2 = self.ec2
        with aws_errors("finding the default VPC"):
            vpcs = ec2.describe_vpcs(Filters=[{"Name": "is-default", "Values": ["true"]}])["Vpcs"]
        if not vpcs:
            raise CloudError(f"region {self.region} has no default VPC",
                             "create one: aws ec2 create-default-vpc")
        vpc = vpcs[0]["VpcId"]
        profile = self.identity(spec)  # first: a refused permission leaves nothing made
        self._key_pair(spec.cluster, name, ssh_public_key)
        group = self._security_group(spec, name, vpc)
        with aws_errors("listing the default subnets"):
            subnets = self._all("describe_subnets", "Subnets", Filters=[
                {"Name": "vpc-id", "Values": [vpc]},
                {"Name": "default-for-az", "Values": ["true"]}])
        return {"key_name": name, "security_group": group, "vpc": vpc,
                "subnets": {s["AvailabilityZone"]: s["SubnetId"] for s in subnets}, **profile}

    # -- storage identity (module docstring) ---------------------------------------------------
    def identity(self, spec: CloudSpec) -> dict:
        """Make or update, idempotently, the cluster's role, its inline policy (exactly the
        ``s3`` grants of ``spec.grants``: what it allowed beyond them is taken away) and its
        instance profile (module docstring).

        Returns:
            ``{"instance_profile": name}`` to launch the instances with, or ``{}`` when the
            cluster uses no ``s3://`` bucket and names no ``cluster.iam_role``.
        Raises:
            CredentialsError: the caller may not make or change them (the message names the
                IAM action and ``cluster.iam_role``).
            IdentityConflict: a role or profile of that name exists and is not the
                cluster's own (module docstring).
            CloudError: other API errors; STS gives no account id (:meth:`_account`:
                nothing is made or changed).
        """
        if spec.identity:
            return {"instance_profile": spec.identity}
        if not any(g.scheme == "s3" for g in spec.grants):
            return {}
        account = self._account()  # before anything is made
        return self._role(spec, STORAGE_POLICY, storage_policy(spec.grants, account),
                          f"hypercli cluster {spec.cluster}: its storage")

    def controller_identity(self, spec: CloudSpec, owner_tag: str,
                            clusters: dict | None = None) -> dict:
        """Make or update, idempotently, the role and instance profile of a controller
        instance (:mod:`hypercli.controller`), named and kept as a cluster's are (module
        docstring: ``spec.cluster`` is the controller's name), with one inline policy,
        ``hyper-controller`` = :func:`controller_policy` for ``owner_tag`` and the read
        grants of ``spec.grants``. ``clusters`` (name → options, the clusters it drives) is
        not needed here: the policy names the user's owner tag, which EC2's conditions test.

        Returns ``{"instance_profile": name}``. Raises as :meth:`identity`."""
        account = self._account()
        return self._role(spec, CONTROLLER_POLICY, controller_policy(
            owner_tag, account, spec.grants), f"hypercli controller {spec.cluster}")

    def _role(self, spec: CloudSpec, policy: str, doc: dict, description: str) -> dict:
        """Make or update the role ``role_name(spec)`` under ``/hyper/<cluster>/`` with the
        one inline policy ``policy`` = ``doc`` (none while ``doc`` has no statement), and its
        instance profile. Returns ``{"instance_profile": name}``. Raises as :meth:`identity`."""
        import json
        name, path = role_name(spec), f"{IAM_PATH}{spec.cluster}/"
        tags = [t for t in _tags(spec.cluster) if t["Key"] != "Name"] + [
            {"Key": TAG_CLUSTER_ID, "Value": spec.tag}]
        iam = self.iam
        made = False
        with self._denied("iam:CreateRole", f"creating the role {name}"):
            try:
                iam.create_role(RoleName=name, Path=path, Tags=tags,
                                AssumeRolePolicyDocument=json.dumps(EC2_TRUST),
                                Description=description)
                made = True
            except iam.exceptions.EntityAlreadyExistsException:
                self._check_role(spec, name, path, policy)
        if doc["Statement"]:
            with self._denied("iam:PutRolePolicy", f"setting the policy of the role {name}"):
                iam.put_role_policy(RoleName=name, PolicyName=policy,
                                    PolicyDocument=json.dumps(doc))
        else:  # nothing to allow yet (no workflow has started): no policy
            with self._denied("iam:DeleteRolePolicy", f"clearing the policy of role {name}"):
                try:
                    iam.delete_role_policy(RoleName=name, PolicyName=policy)
                except iam.exceptions.NoSuchEntityException:
                    pass
        with self._denied("iam:CreateInstanceProfile",
                          f"creating the instance profile {name}"):
            try:
                iam.create_instance_profile(InstanceProfileName=name, Path=path,
                                            Tags=tags)
            except iam.exceptions.EntityAlreadyExistsException:
                pass
            profile = iam.get_instance_profile(InstanceProfileName=name)["InstanceProfile"]
        self._check_profile(spec, profile, name, path)
        if name not in [r["RoleName"] for r in profile.get("Roles", [])]:
            with self._denied("iam:AddRoleToInstanceProfile",
                              f"adding the role {name} to its instance profile"):
                iam.add_role_to_instance_profile(InstanceProfileName=name, RoleName=name)
        if made:
            self._associate(spec.cluster, name)
        return {"instance_profile": name}

    def _account(self) -> str:
        """The caller's account id (STS ``GetCallerIdentity``, which needs no permission),
        once: the ``s3:ResourceAccount`` of the role's writes (module docstring).

        Raises:
            CloudError: STS does not answer; the role is then not set at all, since without
                the account its writes could not be kept to the account's own buckets.
            CredentialsError: STS refuses the credentials.
        """
        if not hasattr(self, "_account_id"):
            try:
                with aws_errors("asking STS for the caller's account"):
                    self._account_id = self.client("sts").get_caller_identity()["Account"]
            except CredentialsError:
                raise
            except CloudError as e:
                raise CloudError(f"{e}; the cluster's role is left unchanged: without the "
                                 "account its writes could not be kept to your own buckets",
                                 "check the network to STS (sts.amazonaws.com) and run again",
                                 code=e.code) from None
        return self._account_id

    def _check_role(self, spec: CloudSpec, name: str, path: str,
                    policy: str = STORAGE_POLICY) -> None:
        """Refuse a role found under the computed name unless it is the cluster's own as
        hypercli leaves it (module docstring). Raises IdentityConflict."""
        import json
        from urllib.parse import unquote
        iam = self.iam
        with self._denied("iam:GetRole", f"reading the role {name}"):
            role = iam.get_role(RoleName=name)["Role"]
            attached = iam.list_attached_role_policies(RoleName=name)["AttachedPolicies"]
            inline = iam.list_role_policies(RoleName=name)["PolicyNames"]
            tags = {t["Key"]: t["Value"] for t in
                    iam.list_role_tags(RoleName=name).get("Tags", [])}
        trust = role.get("AssumeRolePolicyDocument")
        if isinstance(trust, str):
            trust = json.loads(unquote(trust))
        why = []
        if role.get("Path") != path:
            why.append(f"its path is {role.get('Path')}, not {path}")
        if tags.get(TAG_CLUSTER) != spec.cluster or tags.get(TAG_CLUSTER_ID) != spec.tag:
            why.append(f"its tags are not those of cluster {spec.cluster}")
        if _statements(trust) != _statements(EC2_TRUST):
            why.append("its trust policy lets more than EC2 instances assume it")
        if attached:
            why.append("it has managed policies attached: "
                       + ", ".join(p["PolicyName"] for p in attached))
        if set(inline) - {policy}:
            why.append("it has other inline policies: "
                       + ", ".join(sorted(set(inline) - {policy})))
        if why:
            raise IdentityConflict(
                f"an IAM role named {name} exists and is not cluster {spec.cluster}'s own: "
                + "; ".join(why),
                "delete it if it is left from an old cluster, or name the instance profile "
                "the nodes should use: cluster.iam_role: NAME")

    def _check_profile(self, spec: CloudSpec, profile: dict, name: str, path: str) -> None:
        """Refuse an instance profile that is not the cluster's own (another path, not tagged
        for the cluster, so that ``down`` would not remove it, or a role other than the
        cluster's in it). Raises IdentityConflict."""
        others = [r["RoleName"] for r in profile.get("Roles", []) if r["RoleName"] != name]
        tagged = {t["Key"]: t["Value"] for t in profile.get("Tags") or []}.get(TAG_CLUSTER)
        if profile.get("Path") != path or others or tagged != spec.cluster:
            raise IdentityConflict(
                f"an instance profile named {name} exists and is not cluster "
                f"{spec.cluster}'s own (path {profile.get('Path')}"
                + (f", role {others[0]}" if others else "")
                + ("" if tagged == spec.cluster else ", not tagged for it") + ")",
                "delete it if it is left from an old cluster, or name the instance profile "
                "the nodes should use: cluster.iam_role: NAME")

    def _associate(self, cluster: str, profile: str) -> None:
        """Give the cluster's instances that run without an instance profile this one (a
        cluster brought up before it used any bucket)."""
        for inst in self._instances(cluster):
            if inst["State"]["Name"] in ("pending", "running") and \
                    not inst.get("IamInstanceProfile"):
                with aws_errors(f"giving {inst['InstanceId']} the instance profile {profile}"):
                    self.ec2.associate_iam_instance_profile(
                        IamInstanceProfile={"Name": profile}, InstanceId=inst["InstanceId"])

    @contextmanager
    def _denied(self, action: str, what: str):
        """:func:`aws_errors` for an IAM call, a refusal naming ``action`` and
        ``cluster.iam_role``."""
        try:
            with aws_errors(what):
                yield
        except CredentialsError as e:
            if "AccessDenied" not in str(e) and "UnauthorizedOperation" not in str(e):
                raise
            raise CredentialsError(f"the caller may not do {action} ({what}): {e}",
                                   ROLE_HINT) from None

    def _key_pair(self, cluster: str, name: str, public_key: str) -> None:
        ec2 = self.ec2
        with aws_errors(f"importing the key pair {name}"):
            found = ec2.describe_key_pairs(Filters=[{"Name": "key-name", "Values": [name]}],
                                           IncludePublicKey=True)["KeyPairs"]
            if found:
                theirs = (found[0].get("PublicKey") or "").split()[1:2]
                if not theirs or theirs == public_key.split()[1:2]:
                    return
                ec2.delete_key_pair(KeyName=name)  # the cluster's local key was made anew
            try:
                ec2.import_key_pair(KeyName=name, PublicKeyMaterial=public_key.encode(),
                                    TagSpecifications=[{"ResourceType": "key-pair",
                                                        "Tags": _tags(cluster)}])
            except ClientError as e:  # imported meanwhile by another `hyper up`
                if e.response.get("Error", {}).get("Code") != "InvalidKeyPair.Duplicate":
                    raise

    def _security_group(self, spec: CloudSpec, name: str, vpc: str) -> str:
        ec2 = self.ec2
        cidr = spec.ssh_cidr or ""
        v6 = ":" in cidr
        find = [{"Name": "group-name", "Values": [name]}, {"Name": "vpc-id", "Values": [vpc]}]
        with aws_errors(f"preparing the security group {name}"):
            groups = ec2.describe_security_groups(Filters=find)["SecurityGroups"]
            if groups:
                group = groups[0]["GroupId"]
            else:
                try:
                    group = ec2.create_security_group(
                        GroupName=name, VpcId=vpc,
                        Description=f"hypercli cluster {spec.cluster}",
                        TagSpecifications=[{"ResourceType": "security-group",
                                            "Tags": _tags(spec.cluster)}])["GroupId"]
                except ClientError as e:  # made meanwhile by another `hyper up`
                    if e.response.get("Error", {}).get("Code") != "InvalidGroup.Duplicate":
                        raise
                    group = ec2.describe_security_groups(Filters=find)[
                        "SecurityGroups"][0]["GroupId"]
            rules = ec2.describe_security_group_rules(
                Filters=[{"Name": "group-id", "Values": [group]}])["SecurityGroupRules"]
            ours = [r for r in rules if not r.get("IsEgress") and r.get("IpProtocol") == "tcp"
                    and r.get("FromPort") == 22 and r.get("ToPort") == 22
                    and r.get("CidrIpv6" if v6 else "CidrIpv4") == cidr]
            mesh = [r for r in rules if _from_itself(r, group)]
            others = [r["SecurityGroupRuleId"] for r in rules
                      if not r.get("IsEgress") and r not in ours and r not in mesh]
            if others:
                ec2.revoke_security_group_ingress(GroupId=group, SecurityGroupRuleIds=others)
            if not ours:
                ranges = ({"Ipv6Ranges": [{"CidrIpv6": cidr, "Description": "hypercli SSH"}]}
                          if v6 else
                          {"IpRanges": [{"CidrIp": cidr, "Description": "hypercli SSH"}]})
                ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[{
                    "IpProtocol": "tcp", "FromPort": 22, "ToPort": 22, **ranges}])
            if not mesh:
                try:
                    ec2.authorize_security_group_ingress(GroupId=group, IpPermissions=[{
                        "IpProtocol": "-1", "UserIdGroupPairs": [{
                            "GroupId": group, "Description": "hypercli: the cluster's nodes"}]}])
                except ClientError as e:  # added meanwhile by another `hyper up`
                    if e.response.get("Error", {}).get("Code") != "InvalidPermission.Duplicate":
                        raise
        return group

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
        """Launch one instance per node (one RunInstances call each), trying the zones in
        order on capacity errors (module docstring).

        Args:
            spec: the cluster; nodes: node names; boot: their user data;
            prepared: what :meth:`prepare` returned.
        Returns:
            (the VMs launched, {node: the error that left it without one}): a zone that
            answered with a capacity error is not asked again for later nodes, a quota
            error ends the launch (the remaining nodes get it too), and a node's error is
            the last one it met.
        Raises:
            UsageError: no image (see :meth:`find_image`). CredentialsError.
        """
        image = self._image(spec)
        root = image.get("RootDeviceName") or "/dev/xvda"
        zones = list(spec.zones) or [None, *sorted(prepared.get("subnets") or {})]
        full: set = set()  # zones that answered with a capacity error
        vms: list[VM] = []
        errors: dict[str, Exception] = {}
        last: Exception | None = None  # the latest error of any node
        quota: Exception | None = None
        for node in nodes:
            size = len(boot.user_data[node].encode())
            if size > USER_DATA_MAX:
                errors[node] = CloudError(f"the boot document of {node} is {size} bytes; "
                                          f"EC2 user data holds at most {USER_DATA_MAX}")
                continue
            left = [z for z in zones if z not in full]
            if quota is not None or not left:
                errors[node] = quota or last  # the same answer again: not asked
                continue
            for zone in left:
                try:
                    vms.append(self._run(spec, node, zone, image["ImageId"], root, boot,
                                         prepared))
                    errors.pop(node, None)  # an earlier zone's capacity error
                    break
                except CapacityError as e:
                    errors[node] = last = e
                    full.add(zone)
                except CloudError as e:
                    errors[node] = last = e
                    if isinstance(e, QuotaError):
                        quota = e
                    break
        return vms, errors

    def _run(self, spec: CloudSpec, node: str, zone: str | None, image: str, root: str,
             boot: Boot, prepared: dict) -> VM:
        args = {
            "ImageId": image, "InstanceType": spec.instance_type, "MinCount": 1, "MaxCount": 1,
            "KeyName": prepared["key_name"], "UserData": boot.user_data[node],
            "InstanceInitiatedShutdownBehavior": "terminate",
            "ClientToken": f"{node}-{uuid.uuid4().hex}"[-64:],  # retried calls launch once
            "BlockDeviceMappings": [{"DeviceName": root, "Ebs": {
                "VolumeSize": spec.disk_gb, "VolumeType": "gp3",
                "DeleteOnTermination": True}}],
            "TagSpecifications": [{"ResourceType": r, "Tags": _tags(spec.cluster, node)}
                                  for r in ("instance", "volume", "network-interface")],
        }
        subnet = (prepared.get("subnets") or {}).get(zone) if zone else None
        if subnet:
            args["NetworkInterfaces"] = [{"DeviceIndex": 0, "SubnetId": subnet,
                                          "Groups": [prepared["security_group"]],
                                          "AssociatePublicIpAddress": True,
                                          "DeleteOnTermination": True}]
        else:
            args["SecurityGroupIds"] = [prepared["security_group"]]
            if zone:
                args["Placement"] = {"AvailabilityZone": zone}
        # IMDSv2 only, one hop: only the node itself gets a session token (module docstring)
        args["MetadataOptions"] = {"HttpTokens": "required", "HttpPutResponseHopLimit": 1,
                                   "HttpEndpoint": "enabled"}
        if prepared.get("instance_profile"):
            args["IamInstanceProfile"] = {"Name": prepared["instance_profile"]}
        if spec.spot:
            opts = {"SpotInstanceType": "one-time", "InstanceInterruptionBehavior": "terminate"}
            if spec.max_price:
                opts["MaxPrice"] = f"{spec.max_price:.6f}"
            args["InstanceMarketOptions"] = {"MarketType": "spot", "SpotOptions": opts}
            args["TagSpecifications"].append({"ResourceType": "spot-instances-request",
                                              "Tags": _tags(spec.cluster, node)})
        deadline = time.monotonic() + PROFILE_WAIT
        while True:
            try:
                with aws_errors(f"launching {node}" + (f" in {zone}" if zone else "")):
                    inst = self.ec2.run_instances(**args)["Instances"][0]
                return self._vm(inst)
            except CloudError as e:  # a new instance profile EC2 does not see yet
                if not (e.code == "InvalidParameterValue" and "instance profile" in str(e).lower()
                        and time.monotonic() < deadline):
                    raise
                args["ClientToken"] = f"{node}-{uuid.uuid4().hex}"[-64:]
                time.sleep(POLL)

    @staticmethod
    def _vm(inst: dict) -> VM:
        state = STATES.get(inst["State"]["Name"], "pending")
        if (inst.get("StateReason") or {}).get("Code") == SPOT_TERMINATION:
            state = "preempted"
        return VM(id=inst["InstanceId"], node=_tag(inst, TAG_NODE) or "",
                  zone=(inst.get("Placement") or {}).get("AvailabilityZone", ""),
                  state=state, public_ip=inst.get("PublicIpAddress"),
                  private_ip=inst.get("PrivateIpAddress"),
                  instance_type=inst.get("InstanceType", ""),
                  spot=inst.get("InstanceLifecycle") == "spot",
                  extra={"image": inst.get("ImageId"), "launched": str(inst.get("LaunchTime", "")),
                         "spot_request": inst.get("SpotInstanceRequestId"),
                         "state_reason": (inst.get("StateReason") or {}).get("Message")})

    def _instances(self, cluster: str | None) -> list[dict]:
        with aws_errors("listing instances"):
            reservations = self._all("describe_instances", "Reservations",
                                     Filters=_cluster_filter(cluster))
        return [i for r in reservations for i in r["Instances"]]

    def describe(self, cluster: str) -> list[VM]:
        """The cluster's instances that are not terminated, plus the spot ones EC2 took back
        (state ``preempted``; EC2 lists terminated instances for about an hour).
        Raises CredentialsError / CloudError."""
        return [self._vm(i) for i in self._instances(cluster)
                if i["State"]["Name"] != "terminated"
                or (i.get("StateReason") or {}).get("Code") == SPOT_TERMINATION]

    def terminate(self, cluster: str, ids: list[str]) -> None:
        """Terminate instances by id, without waiting; ids EC2 no longer knows are skipped.
        Raises CredentialsError / CloudError."""
        for chunk in _chunks(list(ids)):
            if not self._gone(f"terminating {', '.join(chunk)}",
                              lambda c=chunk: self.ec2.terminate_instances(InstanceIds=c)):
                for i in chunk:  # one unknown id fails the whole call: each alone
                    self._gone(f"terminating {i}",
                               lambda i=i: self.ec2.terminate_instances(InstanceIds=[i]))

    def resources(self, cluster: str | None = None) -> list[Resource]:
        """What carries the tag ``hyper:cluster`` (= ``cluster``; any value when None) and
        still exists, in deletion order: ``instance``, ``spot_request`` (open or active),
        ``nic``, ``disk``, ``public_ip``, ``key_pair``, ``security_group``,
        ``instance_profile``, ``role`` (IAM is global: the same ones in every region).
        Raises CredentialsError / CloudError."""
        f = _cluster_filter(cluster)

        def res(kind, items, key):
            return [Resource(kind, x[key], _tag(x, TAG_CLUSTER), self.region) for x in items]
        out = res("instance", [i for i in self._instances(cluster)
                               if i["State"]["Name"] != "terminated"], "InstanceId")
        with aws_errors("listing the cluster's resources"):
            out += res("spot_request", [r for r in self._all(
                "describe_spot_instance_requests", "SpotInstanceRequests", Filters=f)
                if r["State"] in ("open", "active")], "SpotInstanceRequestId")
            out += res("nic", self._all("describe_network_interfaces", "NetworkInterfaces",
                                        Filters=f), "NetworkInterfaceId")
            out += res("disk", self._all("describe_volumes", "Volumes", Filters=f), "VolumeId")
            out += res("public_ip", [a for a in self.ec2.describe_addresses(Filters=f)[
                "Addresses"] if a.get("AllocationId")], "AllocationId")
            out += res("key_pair", self.ec2.describe_key_pairs(Filters=f)["KeyPairs"],
                       "KeyName")
            out += res("security_group", self._all("describe_security_groups",
                                                   "SecurityGroups", Filters=f), "GroupId")
        out += self._iam_resources(cluster)
        return out

    def _iam_resources(self, cluster: str | None) -> list[Resource]:
        """The instance profiles and roles hypercli made for clusters, of ``cluster`` when
        given: under the path ``/hyper/<cluster>/`` (:data:`IAM_PATH`; the path comes back in
        one listing call) *and* tagged ``hyper:cluster`` = ``<cluster>``, a role also trusted
        by EC2 alone, a profile holding no role but its own (:meth:`_made_here`). Anything
        else under that path (a role someone made there, one refused as squatted by
        :meth:`identity`) is never listed, so never deleted. A caller who may not list IAM
        gets none (it made none)."""
        iam = self.iam
        prefix = IAM_PATH + (f"{cluster}/" if cluster else "")
        out = []
        try:
            with aws_errors("listing the clusters' roles"):
                for kind, op, key, name in (
                        ("instance_profile", "list_instance_profiles", "InstanceProfiles",
                         "InstanceProfileName"),
                        ("role", "list_roles", "Roles", "RoleName")):
                    for page in iam.get_paginator(op).paginate(PathPrefix=prefix):
                        for x in page[key]:
                            c = x["Path"][len(IAM_PATH):].strip("/")
                            if c and (cluster is None or c == cluster) and \
                                    self._made_here(kind, x, c):
                                out.append(Resource(kind, x[name], c, "global"))
        except CredentialsError as e:
            if "AccessDenied" not in str(e):
                raise
        return out

    def _made_here(self, kind: str, x: dict, cluster: str) -> bool:
        """Whether a role or instance profile of a listing (``x``, found under cluster
        ``cluster``'s path) is one hypercli made for that cluster: tagged ``hyper:cluster`` =
        ``cluster``; a role trusted by EC2 and nothing else (:data:`EC2_TRUST`), a profile
        holding no role of another name. Call inside :func:`aws_errors`."""
        import json
        from urllib.parse import unquote
        iam = self.iam
        if kind == "role":
            trust = x.get("AssumeRolePolicyDocument")
            if isinstance(trust, str):
                trust = json.loads(unquote(trust))
            if _statements(trust) != _statements(EC2_TRUST):
                return False
            tags = iam.list_role_tags(RoleName=x["RoleName"]).get("Tags", [])
        else:
            if any(r["RoleName"] != x["InstanceProfileName"] for r in x.get("Roles", [])):
                return False
            tags = x.get("Tags") or iam.get_instance_profile(
                InstanceProfileName=x["InstanceProfileName"])["InstanceProfile"].get("Tags", [])
        return {t["Key"]: t["Value"] for t in tags}.get(TAG_CLUSTER) == cluster

    def delete(self, resources: list[Resource]) -> list[str]:
        """Delete resources as :meth:`resources` lists them: instances are terminated and
        waited for (at most TERMINATE_WAIT s), then the rest go in list order, each retried
        BUSY_TRIES times while still in use (a group whose instance's interface is going).

        Returns:
            ``"<kind> <id>"`` per resource removed by this call (one already gone is
            skipped, not an error).
        Raises:
            CloudError: instances still not terminated at the deadline, or resources that
            could not be deleted (named). CredentialsError.
        """
        removed = self._delete_instances([r.id for r in resources if r.kind == "instance"])
        failed = []
        for r in resources:
            if r.kind == "instance":
                continue
            for attempt in range(BUSY_TRIES):
                try:
                    if self._gone(f"deleting {r}", lambda: self._delete_one(r)):
                        removed.append(f"{r.kind} {r.id}")
                    break
                except CloudError as e:
                    if e.code not in BUSY_CODES or attempt == BUSY_TRIES - 1:
                        failed.append(e)
                        break
                    time.sleep(BUSY_PAUSE)
        if failed:
            raise CloudError("; ".join(str(e) for e in failed),
                             "run `hyper down` again, or remove them in the AWS console",
                             code=failed[0].code)
        return removed

    def _delete_one(self, r: Resource) -> bool:
        """Delete one resource that is not an instance: True when this call removed it (key
        pairs and spot requests are looked up first: deleting them again is no error)."""
        ec2 = self.ec2
        if r.kind == "key_pair":
            if not ec2.describe_key_pairs(
                    Filters=[{"Name": "key-name", "Values": [r.id]}])["KeyPairs"]:
                return False
            ec2.delete_key_pair(KeyName=r.id)
        elif r.kind == "spot_request":
            if not ec2.describe_spot_instance_requests(Filters=[
                    {"Name": "spot-instance-request-id", "Values": [r.id]},
                    {"Name": "state", "Values": ["open", "active"]}])["SpotInstanceRequests"]:
                return False
            ec2.cancel_spot_instance_requests(SpotInstanceRequestIds=[r.id])
        elif r.kind == "nic":
            ec2.delete_network_interface(NetworkInterfaceId=r.id)
        elif r.kind == "disk":
            ec2.delete_volume(VolumeId=r.id)
        elif r.kind == "public_ip":
            ec2.release_address(AllocationId=r.id)
        elif r.kind == "security_group":
            ec2.delete_security_group(GroupId=r.id)
        elif r.kind == "instance_profile":
            iam = self.iam
            try:
                found = iam.get_instance_profile(InstanceProfileName=r.id)["InstanceProfile"]
            except iam.exceptions.NoSuchEntityException:
                return False
            for role in found.get("Roles", []):
                iam.remove_role_from_instance_profile(InstanceProfileName=r.id,
                                                      RoleName=role["RoleName"])
            iam.delete_instance_profile(InstanceProfileName=r.id)
        elif r.kind == "role":
            iam = self.iam
            try:
                policies = iam.list_role_policies(RoleName=r.id)["PolicyNames"]
            except iam.exceptions.NoSuchEntityException:
                return False
            for name in policies:
                iam.delete_role_policy(RoleName=r.id, PolicyName=name)
            for p in iam.list_attached_role_policies(RoleName=r.id)["AttachedPolicies"]:
                iam.detach_role_policy(RoleName=r.id, PolicyArn=p["PolicyArn"])
            for prof in iam.list_instance_profiles_for_role(RoleName=r.id)["InstanceProfiles"]:
                iam.remove_role_from_instance_profile(
                    InstanceProfileName=prof["InstanceProfileName"], RoleName=r.id)
            iam.delete_role(RoleName=r.id)
        else:
            return False
        return True

    def _delete_instances(self, ids: list[str]) -> list[str]:
        """Terminate the instances of ``ids`` not yet terminated and wait until they are;
        returns a line per instance this call terminated."""
        live = self._not_terminated(ids)
        if not live:
            return []
        self.terminate("", live)
        deadline = time.monotonic() + TERMINATE_WAIT
        while left := self._not_terminated(live):
            if time.monotonic() > deadline:
                raise CloudError(f"instances not terminated after {TERMINATE_WAIT:.0f} s: "
                                 + ", ".join(left), "run `hyper down` again later")
            time.sleep(POLL)
        return [f"instance {i}" for i in live]

    def _not_terminated(self, ids: list[str]) -> list[str]:
        with aws_errors("looking at instances"):
            return [i["InstanceId"] for chunk in _chunks(ids) for r in self._all(
                "describe_instances", "Reservations", Filters=[
                    {"Name": "instance-id", "Values": chunk},
                    {"Name": "instance-state-name", "Values": [
                        "pending", "running", "shutting-down", "stopping", "stopped"]}])
                for i in r["Instances"]]

    @staticmethod
    def _gone(what: str, call) -> bool:
        """Run a delete call; its result, or False when the resource was already gone."""
        try:
            with aws_errors(what):
                return call() is not False
        except CloudError as e:
            if e.code in GONE_CODES:
                return False
            raise

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        """The spot price in effect now (USD per hour, Linux/UNIX) of ``spec.instance_type``
        by zone (only ``spec.zones`` when set), from DescribeSpotPriceHistory with start
        and end time now, which returns each zone's latest price. On-demand (``spot``
        false): ``{}``, EC2 has no on-demand price call (the Pricing API is another
        service and is not used). Raises CredentialsError / CloudError."""
        if not spec.spot or not spec.instance_type:
            return {}
        now = datetime.now(timezone.utc)
        with aws_errors("reading spot prices"):
            history = self._all("describe_spot_price_history", "SpotPriceHistory",
                                InstanceTypes=[spec.instance_type], StartTime=now,
                                EndTime=now, ProductDescriptions=["Linux/UNIX"])
        newest: dict[str, tuple] = {}
        for h in history:
            zone = h["AvailabilityZone"]
            if spec.zones and zone not in spec.zones:
                continue
            stamp = h.get("Timestamp") or now
            if zone not in newest or stamp > newest[zone][0]:
                newest[zone] = (stamp, float(h["SpotPrice"]))
        return {z: p for z, (_, p) in sorted(newest.items())}

    def find_image(self, spec: CloudSpec) -> str:
        """The AMI id to boot: ``spec.image`` (checked to exist in the region), else the
        newest (by CreationDate) available image of this account tagged ``hyper:image`` =
        ``node`` and ``hyper:variant`` = ``spec.variant``.
        Raises UsageError naming the AMI or saying how to bake one; CredentialsError."""
        return self._image(spec)["ImageId"]

    def _image(self, spec: CloudSpec) -> dict:
        if spec.image:
            try:
                with aws_errors(f"finding the image {spec.image}"):
                    found = self.ec2.describe_images(ImageIds=[spec.image])["Images"]
            except CloudError as e:
                if not (e.code or "").startswith("InvalidAMIID"):
                    raise
                found = []
            if not found:
                raise UsageError(f"image {spec.image} does not exist in {self.region}",
                                 "set cluster.image to an AMI of that region, or remove it "
                                 "to use the newest image baked by `hyper image build`")
            return found[0]
        with aws_errors("finding the baked image"):
            images = self.ec2.describe_images(Owners=["self"], Filters=[
                {"Name": f"tag:{TAG_IMAGE}", "Values": ["node"]},
                {"Name": f"tag:{TAG_VARIANT}", "Values": [spec.variant]},
                {"Name": "state", "Values": ["available"]}])["Images"]
        if not images:
            raise UsageError(f"no baked hypercli {spec.variant} image in {self.region}",
                             "bake one: hyper image build --provider aws "
                             "(or set image: ami-...)")
        return max(images, key=lambda i: i.get("CreationDate", ""))
