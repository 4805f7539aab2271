"""The cloud contract: what the aws, gcp and azure providers share.

A cloud node is an SSH host that a cloud created (:mod:`hypercli.providers.ssh` drives it once
it is up). Each cloud has one small class, a :class:`CloudAPI`, the only code that talks to its
SDK; :class:`hypercli.providers.cloud_provider.CloudProvider` turns any of them into a provider
(keys, boot script, host-key pinning, SSH bootstrap, preemption checks, leak-proof teardown).

Names and tags, the same on every cloud so that ``hyper gc`` finds everything:

* every resource created for a cluster carries the tags (AWS, Azure) or labels (GCP, where
  ``:`` is not allowed and ``-`` is used instead) ``hyper:cluster`` = cluster name,
  ``hyper:node`` = node name (resources of one node) and ``hyper:owner`` = :func:`owner`;
* resource names start with ``hyper-<cluster>`` (GCP and Azure need names); the names of
  identities (AWS roles, GCP service accounts, Azure managed identities) also end with
  :func:`identity_tag`, a hash of the cluster's id in the state file, so that two clusters
  never share one (names cut to a cloud's length limit, or compared without case, stay
  apart) and a name made in advance by someone else is not reused: an identity found under
  the computed name is used only when it is the cluster's own and grants nothing more
  (:class:`IdentityConflict` otherwise);
* baked images (``images/packer``) are named ``hyper-node-<variant>-<version>-<stamp>`` with
  tags/labels ``hyper:image`` = ``node``, ``hyper:variant`` = ``cpu``|``gpu`` and
  ``hyper:version`` = the hypercli version; a provider takes the newest one of its variant
  unless ``image:`` names one.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Protocol

from hypercli.errors import InfraError, UsageError

#: tag keys (AWS, Azure); GCP labels use the same with ``-`` for ``:``
TAG_CLUSTER, TAG_NODE, TAG_OWNER = "hyper:cluster", "hyper:node", "hyper:owner"
TAG_IMAGE, TAG_VARIANT, TAG_VERSION = "hyper:image", "hyper:variant", "hyper:version"


def owner() -> str:
    """``user@host`` of the caller, lower case, in ``[a-z0-9_.@-]`` (fits GCP labels too);
    ``HYPER_OWNER`` when set (a controller tags what it launches with its user's owner:
    :mod:`hypercli.controller.host`)."""
    text = os.environ.get("HYPER_OWNER") or f"{getpass.getuser()}@{socket.gethostname()}"
    text = text.lower()
    return re.sub(r"[^a-z0-9_.@-]", "-", text)[:63]


def identity_tag(cluster: str, cluster_id: str = "") -> str:
    """8 hex digits naming a cluster's identities: the SHA-256 of its state-file id
    (:meth:`hypercli.state.State.cluster_uid`), or of its exact name when it has none (an
    API used on its own)."""
    return hashlib.sha256((cluster_id or f"name:{cluster}").encode()).hexdigest()[:8]


def label_key(tag: str) -> str:
    """The GCP label key of a tag key (``hyper:cluster`` → ``hyper-cluster``)."""
    return tag.replace(":", "-")


class CloudError(InfraError):
    """A cloud API call failed (exit 3). ``code`` is the cloud's error code when it gave one."""

    def __init__(self, message: str, hint: str | None = None, code: str | None = None):
        super().__init__(message, hint)
        self.code = code


class IdentityConflict(UsageError):
    """An identity of the name hypercli computed for a cluster exists and is not that
    cluster's own as hypercli would leave it (another trust policy, tags, keys, attached
    policies or bindings): refused (exit 2) rather than used."""


class CapacityError(CloudError):
    """No capacity for the request in a zone (AWS ``InsufficientInstanceCapacity``, GCP
    ``ZONE_RESOURCE_POOL_EXHAUSTED``, Azure ``SkuNotAvailable`` / ``AllocationFailed``): the
    next zone is tried, then the next offer (:mod:`hypercli.offers.failover`)."""

    failover = "capacity"


class QuotaError(CloudError):
    """The account's quota does not allow the request (not retried in another zone of the
    region; the launch goes on to the next offer of another region, cloud or instance type)."""

    failover = "quota"


class CredentialsError(UsageError):
    """No usable credentials (exit 2); the hint says how to configure them."""


@dataclass(frozen=True)
class CloudSpec:
    """A cloud cluster's settings, from the recipe's ``cluster:`` (see DESIGN.md).

    Attributes:
        cluster: cluster name.
        count: nodes wanted.
        region: e.g. ``us-east-1`` / ``us-central1`` / ``eastus``.
        zones: zones to try in order on capacity errors (empty: the API's choice / all of
            the region's zones, in the API's order).
        instance_type: machine type (``m5.large``, ``e2-standard-4``, ``Standard_D4s_v5``).
        spot: spot/preemptible capacity (True) or on-demand.
        image: an explicit image (AMI id, GCP image link, Azure image id), or None for the
            newest baked image of ``variant``.
        variant: ``cpu`` or ``gpu`` (baked image lookup).
        disk_gb: boot disk size, GiB.
        max_price: highest spot price per hour, USD, or None for the on-demand cap.
        ssh_cidr: who may reach port 22 (default: the caller's public address /32).
        idle_minutes: the node terminates itself after this long with no task and no contact.
        replace_preempted: launch a replacement when a node is preempted.
        project: GCP project; resource_group: Azure resource group (default ``hyper-<cluster>``).
        grants: the object storage the nodes may use (:class:`hypercli.recipe.access.Grant`,
            from the recipe's ``storage`` and ``mounts``); the provider gives the nodes a
            storage identity scoped to exactly these.
        identity: an existing storage identity to use instead of one made for the cluster:
            an instance profile (AWS ``iam_role``), a service account e-mail (GCP
            ``service_account``), a user-assigned managed identity id (Azure ``identity``).
        cluster_id: the cluster's id in the state file (:func:`identity_tag`).
        adopt_group: Azure: use ``resource_group`` although hypercli did not make it
            (``cluster.adopt_group``); hypercli then changes nothing of the group itself
            and removes only what it made in it.
    """

    cluster: str
    count: int = 1
    region: str = ""
    zones: tuple[str, ...] = ()
    instance_type: str = ""
    spot: bool = True
    image: str | None = None
    variant: str = "cpu"
    disk_gb: int = 50
    max_price: float | None = None
    ssh_cidr: str | None = None
    idle_minutes: int = 30
    replace_preempted: bool = True
    project: str | None = None
    resource_group: str | None = None
    grants: tuple = ()
    identity: str | None = None
    cluster_id: str = ""
    adopt_group: bool = False

    @property
    def tag(self) -> str:
        """:func:`identity_tag` of this cluster."""
        return identity_tag(self.cluster, self.cluster_id)


@dataclass(frozen=True)
class VM:
    """One instance as the cloud describes it.

    Attributes:
        id: the cloud's id (``i-0abc...``, GCP instance name, Azure VM name).
        node: hypercli's node name (from the ``hyper:node`` tag).
        zone: where it runs.
        state: ``pending`` | ``running`` | ``stopping`` | ``terminated`` | ``preempted``
            (a spot node the cloud took back, when the API tells).
        public_ip, private_ip: addresses, or None while it has none; the cluster's nodes
            reach each other at their private addresses.
        instance_type: machine type; spot: spot capacity.
        extra: anything else worth recording (price, image, launch time).
    """

    id: str
    node: str
    zone: str
    state: str
    public_ip: str | None = None
    private_ip: str | None = None
    instance_type: str = ""
    spot: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Resource:
    """Anything a cloud holds for a cluster, as ``down`` and ``gc`` see it.

    Attributes:
        kind: ``instance``, ``security_group``, ``firewall``, ``key_pair``, ``nic``,
            ``public_ip``, ``disk``, ``network``, ``resource_group``, ...
        id: the cloud's id or name.
        cluster: the ``hyper:cluster`` tag (None when untagged: never deleted by ``gc``).
        region: region or zone it lives in.
    """

    kind: str
    id: str
    cluster: str | None
    region: str = ""

    def __str__(self) -> str:
        return f"{self.kind} {self.id}" + (f" ({self.region})" if self.region else "")


@dataclass(frozen=True)
class Boot:
    """What a node needs at first boot, given to :meth:`CloudAPI.create`.

    Attributes:
        user_data: node name → its boot document: a ``#cloud-config`` YAML document
            (:func:`hypercli.providers.cloud_provider.boot_document`) that cloud-init applies
            at first boot — AWS user data, GCP ``user-data`` metadata, Azure custom data. The
            same on every cloud: it installs the node's own host key before sshd starts
            (generated here, so the client pins it without trusting a first contact; on GCP,
            whose metadata is readable with ``compute.instances.get``, made on the node and
            its public half published, :attr:`CloudAPI.node_host_keys`) and the cluster's
            SSH key, keeps containers away from the metadata service, and starts the
            preemption watcher and the idle watchdog.
        ssh_user: the login user the script sets up.
        ssh_public_key: the cluster's public key, OpenSSH one-line form.
    """

    user_data: dict
    ssh_user: str
    ssh_public_key: str


class CloudAPI(Protocol):
    """The part of a cloud provider that talks to the cloud's SDK. Every method raises
    :class:`CredentialsError` for missing or refused credentials and :class:`CloudError`
    (or a subclass) for other API failures; none prints."""

    #: provider name: "aws", "gcp" or "azure"
    name: str
    #: True when nodes make their own SSH host key and publish its public half, which
    #: ``host_key(vm) -> str | None`` (``ssh-ed25519 AAAA...``, None until published) reads
    #: for the caller to pin (GCP); False or absent: the caller makes the key (Boot)
    node_host_keys: bool

    def check(self) -> str:
        """Whether the credentials work: a one-line description of the account (``account
        123456789012, region us-east-1``). Raises CredentialsError saying how to set them up."""

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        """Create (or find) the cluster's shared resources, idempotently: network, security
        group or firewall rules (from outside only TCP 22 from ``spec.ssh_cidr``; between the
        cluster's own nodes every protocol and port, on their private addresses), key pair,
        resource group, and the storage identity (:meth:`identity`). Returns what
        :meth:`create` needs of them (opaque to the caller)."""

    def identity(self, spec: CloudSpec) -> dict:
        """Create or update, idempotently, the cluster's storage identity scoped to exactly
        ``spec.grants`` (read on datasets, read/write on each live workflow's prefix; a
        per-workflow template gives nothing, it says the cloud's storage is used): what it
        allowed beyond them is taken away. Nothing is made for storage when
        ``spec.identity`` names an existing one. Called by :meth:`prepare`, and again when a
        workflow starts on the cluster (``hypercli.cluster.grant``). Identities are named
        with :func:`identity_tag`. Returns what the instances are launched with (opaque to
        the caller).

        Raises:
            CredentialsError: the caller may not create or bind identities (the message
                names the missing permission and the recipe key that names an existing
                identity instead).
            IdentityConflict: an identity of the computed name exists and is not the
                cluster's own.
        """

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
        """Launch one instance per node name, tagged, with ``boot.user_data[node]``; on a
        :class:`CapacityError` in a zone the next of ``spec.zones`` is tried. Returns the VMs
        created (any state) and an error per node that got none (partial success)."""

    def describe(self, cluster: str) -> list[VM]:
        """The cluster's instances that are not gone (any state but deleted)."""

    def terminate(self, cluster: str, ids: list[str]) -> None:
        """Terminate instances (no wait)."""

    def resources(self, cluster: str | None = None) -> list[Resource]:
        """Everything tagged ``hyper:cluster`` (= ``cluster``; any value when None) that
        still exists, instances included, in deletion order (instances first)."""

    def delete(self, resources: list[Resource]) -> list[str]:
        """Delete resources (waiting where the cloud needs it: an instance must be gone
        before its security group); returns a line per resource removed."""

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        """Current price per hour (USD) by zone for ``spec.instance_type`` (spot or
        on-demand as ``spec.spot`` says); empty when the API gives none."""

    def find_image(self, spec: CloudSpec) -> str:
        """The image to boot: ``spec.image`` when set, else the newest baked image of
        ``spec.variant`` (names and tags in the module docstring). Raises UsageError when
        there is none, saying how to bake one (``hyper image build``)."""
