"""Google Compute Engine through google-cloud-compute: the CloudAPI of provider ``gcp``.

What a cluster gets (the tags of :mod:`hypercli.providers.cloud` as GCP labels, ``-`` for
``:``; label values made valid: lower case, ``[a-z0-9_-]``, 63 characters):

* two firewall rules on the ``default`` network, both for instances with the network tag
  ``hyper-<cluster>``: ``hyper-<cluster>-ssh``, TCP 22 from ``ssh_cidr`` only, and
  ``hyper-<cluster>-internal``, every protocol from instances with that same tag (the
  cluster's nodes reach each other on their internal addresses, e.g. the ranks of a
  multi-node task; GCE matches source tags on internal traffic only, so nothing from outside
  gets in by it). Firewall rules take no labels, so each rule's description carries
  ``hyper:cluster=<cluster>``; a rule that already exists but admits something else (the
  caller's address changed, a source added by hand) is replaced as a whole;
* per node one instance named after the node (made a valid GCE name), labelled
  ``hyper-cluster``, ``hyper-node``, ``hyper-owner`` (the exact names are also kept in metadata
  ``hyper-cluster`` / ``hyper-node``), SPOT with ``instanceTerminationAction: DELETE`` (or
  STANDARD), an ephemeral external IP, a boot disk of ``disk_gb`` GiB deleted with the
  instance and labelled like it, running as **its own service account** (below, whatever the
  storage: never the project's default account, which in many projects holds Editor), and
  metadata ``ssh-keys`` = ``<ssh_user>:<public key>``, ``enable-guest-attributes`` and the boot
  document: a cloud-config (text starting ``#cloud-config``, what
  :mod:`hypercli.providers.cloud_provider` makes) goes to ``user-data``, which cloud-init reads
  on GCE; a shell script goes to ``startup-script``, which the guest agent runs as root at
  every boot. The cloud-config carries no host private key: the node makes its own at first
  boot and publishes the public half in its guest attributes (``hostkeys/ssh-ed25519``), which
  :meth:`GCPAPI.host_key` reads for the caller to pin.

Zones are tried in ``zones`` order (default: the region's zones in the API's order) while the
insert operation ends in ``ZONE_RESOURCE_POOL_EXHAUSTED`` (or ``..._WITH_DETAILS``, or says
the zone "does not have enough resources"); ``QUOTA_EXCEEDED`` (an operation error or an HTTP
403 ``quotaExceeded``) is a :class:`QuotaError` and is not retried elsewhere. Every insert and
delete made here waits for its zone or global operation with ``operations.wait`` (the API
answers when the operation is DONE or after at most two minutes; it is asked again until
DONE or :data:`OP_TIMEOUT`); :meth:`GCPAPI.terminate` does not wait.

Preemption: a SPOT instance that is STOPPING or TERMINATED is reported ``preempted`` when its
zone lists an operation of type ``compute.instances.preempted`` whose target is that instance
(same instance id); otherwise it is ``stopping`` / ``terminated`` (e.g. the idle watchdog
powered it off). With the DELETE action GCE deletes a preempted instance shortly after, and
from then on it is simply gone from :meth:`GCPAPI.describe`.

Prices: the Compute API has none (they are in the Cloud Billing Catalog API, another
service), so :meth:`GCPAPI.spot_price` returns ``{}``; ``max_price`` has no GCE equivalent
(a SPOT instance has no bid) and is not used.

Identities: every node runs as a service account of its own,
``hyper-<cluster>-<tag>-<n>`` (:func:`account_id`: the cluster name cut to fit the 30
characters of an account id, :func:`~hypercli.providers.cloud.identity_tag` of the cluster's
id, the node's number), whose description says ``hyper:cluster=<cluster>
hyper:cluster-id=<tag> hyper:node=<node> buckets=...`` (IAM service accounts take no labels).
One account per node, because IAM cannot bind a right to "the caller's own instance": with one
account for the cluster, a binding on each instance would let every node act on every other.
Each account may do two things:

* **delete its own instance** (the idle watchdog): the project's custom role
  ``hyperNodeSelfDelete`` (:data:`SELF_DELETE_PERMISSIONS`: ``compute.instances.get`` and
  ``compute.instances.delete``, nothing else: not setLabels, setMetadata, stop or reset),
  made once per project and kept (it grants nothing by itself), bound on that instance only
  (instance-level IAM policy, set after the insert). Where the caller may not make the role or
  set the policy, a warning says so and the node is only powered off when idle;
* **the cluster's storage** (``spec.grants``, :mod:`hypercli.recipe.access`): bucket-level IAM
  bindings on exactly those buckets (``buckets.setIamPolicy``, policy ``version: 3``):
  ``roles/storage.objectViewer`` for a read grant, ``roles/storage.objectUser`` for a
  read/write one, each with an IAM Condition titled ``hyper-<cluster>-<tag>`` that limits it to
  the grant's prefix (``resource.name.startsWith("projects/_/buckets/B/objects/PREFIX/")``,
  or the bucket itself when its object listing asks for that prefix,
  ``storage.googleapis.com/objectListPrefix``); a whole-bucket grant has no condition.
  Conditions need uniform bucket-level access on the bucket. The bindings of the cluster's
  accounts are set to exactly the grants each time (a grant left out, such as an ended
  workflow's prefix, is taken away; others' bindings are never touched).

The nodes' scopes are ``compute`` and ``devstorage.read_write``; the bindings, not the scopes,
decide what they may touch. An account found under a computed name is used only when its
description names this cluster and node, it has no user-managed key, nobody may act as it
(its own IAM policy is empty) and it holds no role in the project's IAM policy (read with
``projects.getIamPolicy``; a caller who may not read it cannot use a found account):
:class:`~hypercli.providers.cloud.IdentityConflict` otherwise.
:meth:`GCPAPI.delete` of an account removes its bindings from every bucket it was bound on
(listed in its description) and then the account; the accounts of nodes that are gone are
removed at the next launch into the cluster. ``down`` and ``gc`` find a cluster's instances by
their labels and also by what a node cannot change on itself: the instance name's prefix and
the account it runs as (:meth:`GCPAPI.resources`).
With ``cluster.service_account`` set nothing is made or bound: every node runs as that account
(it must already be allowed the buckets; the caller needs ``iam.serviceAccounts.actAs`` on
it), and no self-deletion is bound (one account for all nodes: each could delete the others);
idle nodes power off. A caller refused ``iam.serviceAccounts.create`` or
``storage.buckets.setIamPolicy`` (``testIamPermissions`` asked first) gets a
:class:`CredentialsError` naming that permission and ``cluster.service_account``, before any
instance or firewall rule is made.

Credentials: Google application default credentials (``google.auth.default()``); the project is
the ``project`` argument, else the credentials' project, else ``GOOGLE_CLOUD_PROJECT``.
Test seam: ``HYPER_GCP_ENDPOINT`` (``http://127.0.0.1:PORT``) is given to every client as its
``api_endpoint`` (the REST transport keeps an ``http://`` scheme); with it set and no
``credentials`` passed, anonymous credentials are used (a local stand-in needs none).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import threading
import time
from contextlib import contextmanager
from datetime import datetime, timezone

import google.auth
import requests
from google.api_core import exceptions as gexc
from google.api_core.client_options import ClientOptions
from google.auth import exceptions as auth_exc
from google.auth.credentials import AnonymousCredentials
from google.cloud import compute_v1

from hypercli.errors import UsageError
from hypercli.providers.cloud import (TAG_CLUSTER, TAG_IMAGE, TAG_NODE, TAG_OWNER, TAG_VARIANT,
                                      VM, Boot, CapacityError, CloudError, CloudSpec,
                                      CredentialsError, IdentityConflict, QuotaError, Resource,
                                      label_key, owner)
from hypercli.recipe.access import rights

log = logging.getLogger("hypercli")

CREDENTIALS_HINT = ("run `gcloud auth application-default login`, or set "
                    "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file; the project "
                    "is `project:` in the recipe's cluster, or GOOGLE_CLOUD_PROJECT")
PROJECT_HINT = "set `project:` in the recipe's cluster, or GOOGLE_CLOUD_PROJECT"
SCOPES = ["https://www.googleapis.com/auth/compute"]
#: the nodes' scopes when they have a storage identity (module docstring, "Storage identity")
STORAGE_SCOPE = "https://www.googleapis.com/auth/devstorage.read_write"
#: the caller's scopes: Compute, IAM and Cloud Storage IAM policies
CALLER_SCOPES = ["https://www.googleapis.com/auth/cloud-platform"]
IAM_URL, STORAGE_URL = "https://iam.googleapis.com", "https://storage.googleapis.com"
#: bucket roles of a read grant and of a read/write grant
READ_ROLE, WRITE_ROLE = "roles/storage.objectViewer", "roles/storage.objectUser"
#: the project's custom role a node's account holds on its own instance (idle self-deletion)
SELF_DELETE_ROLE = "hyperNodeSelfDelete"
SELF_DELETE_PERMISSIONS = ["compute.instances.delete", "compute.instances.get"]
#: the custom roles of a controller's account (:meth:`GCPAPI.controller_identity`): reads
#: of the project and its zones, bound without a condition (list calls are checked on the
#: project, cloud.google.com/compute/docs/access/iam-permissions), and what driving does to
#: its clusters' instances and disks, bound under a condition on their names
CONTROLLER_READ_ROLE, CONTROLLER_ROLE = "hyperControllerRead", "hyperController"
CONTROLLER_READ_PERMISSIONS = sorted(
    ["compute.instances.list", "compute.disks.list", "compute.firewalls.list",
     "compute.firewalls.get", "compute.zoneOperations.get", "compute.zoneOperations.list",
     "compute.globalOperations.get", "compute.regions.get", "compute.zones.list",
     "compute.images.get", "compute.images.getFromFamily", "compute.images.list",
     "compute.images.useReadOnly", "compute.machineTypes.get", "compute.networks.use",
     "compute.subnetworks.use", "compute.subnetworks.useExternalIp"])
CONTROLLER_PERMISSIONS = sorted(
    [f"compute.instances.{p}" for p in ("create", "get", "delete", "setLabels",
                                        "setMetadata", "setTags", "setServiceAccount",
                                        "getGuestAttributes")]
    + [f"compute.disks.{p}" for p in ("create", "get", "delete", "setLabels")])
DRIVES = "drives "  #: the title of a controller's conditional binding: ``drives <cluster>``
#: the role a controller's account holds on each node account of the clusters it drives (that
#: account's own IAM policy, not the project's): ``iam.serviceAccounts.actAs``, so that a
#: replacement it launches runs as that account
#: (cloud.google.com/iam/docs/service-account-permissions)
ACT_AS_ROLE = "roles/iam.serviceAccountUser"
#: what making the nodes' service accounts asks of the caller, project-wide
IDENTITY_PERMISSIONS = ("iam.serviceAccounts.create", "iam.serviceAccounts.actAs")
#: s that an insert is retried while Compute Engine does not know a new service account yet
#: (IAM is eventually consistent: "it might take up to 60 seconds" for a new account to be
#: usable, cloud.google.com/iam/docs/service-accounts-create)
ACCOUNT_WAIT = 90.0
IDENTITY_HINT = ("or name an existing service account that may use the buckets in the "
                 "recipe: cluster.service_account: NAME@PROJECT.iam.gserviceaccount.com")
#: operation error codes (cloud.google.com/compute/docs/troubleshooting/troubleshooting-vm-creation)
CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS"}
CAPACITY_TEXT = "does not have enough resources"
QUOTA_CODES = {"QUOTA_EXCEEDED", "quotaExceeded"}
#: HTTP error reasons (errors[].reason or ErrorInfo.reason) that mean the caller's identity
AUTH_REASONS = {"authError", "forbidden", "insufficientPermissions", "required",
                "IAM_PERMISSION_DENIED", "ACCESS_TOKEN_TYPE_UNSUPPORTED", "CREDENTIALS_MISSING",
                "ACCESS_TOKEN_EXPIRED", "accessNotConfigured", "SERVICE_DISABLED",
                "accountDisabled"}
NOT_FOUND = "notFound"
IN_USE = "resourceInUseByAnotherResource"
STATES = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running",
          "STOPPING": "stopping", "SUSPENDING": "stopping", "SUSPENDED": "stopping",
          "REPAIRING": "stopping", "TERMINATED": "terminated"}
PREEMPTED_OP = "compute.instances.preempted"
OP_TIMEOUT = 600.0  # s an insert or delete operation may take
CLOUD_INIT_STARTS = ("#cloud-config", "#include", "#cloud-boothook", "Content-Type: multipart")


def gce_name(text: str) -> str:
    """A valid GCE resource name (``[a-z]([-a-z0-9]{0,61}[a-z0-9])?``) for ``text``: lower
    case, other characters made ``-``, ``h-`` in front when it does not start with a letter."""
    s = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-") or "x"
    if not s[0].isalpha():
        s = "h-" + s
    return s[:63].rstrip("-")


def label_value(text: str) -> str:
    """A valid GCP label value (``[a-z0-9_-]{0,63}``) for ``text``: lower case, other
    characters made ``-``."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


def _reasons(e: gexc.GoogleAPICallError) -> list[str]:
    """The reasons of an HTTP error: ``errors[].reason``, then ErrorInfo's reason."""
    out = [d["reason"] for d in e.errors if isinstance(d, dict) and d.get("reason")]
    return out + ([e.reason] if e.reason else [])


def _text(e: gexc.GoogleAPICallError) -> str:
    """The API's message without the ``METHOD URL:`` prefix the REST transport adds."""
    return re.sub(r"^[A-Z]+ \S+: ", "", str(e.message or ""))


@contextmanager
def _calls(what: str):
    """Turn google-api-core's, google-auth's and requests' errors into hypercli's.

    401, and 403 with an identity reason (:data:`AUTH_REASONS`, or none) → CredentialsError;
    403 quotaExceeded → QuotaError; "not enough resources" → CapacityError; any other API
    error → CloudError whose ``code`` is the API's reason (``notFound``, ``alreadyExists``,
    ...) or else the HTTP status."""
    try:
        yield
    except (auth_exc.DefaultCredentialsError, auth_exc.RefreshError) as e:
        raise CredentialsError(f"no usable Google credentials ({e})", CREDENTIALS_HINT) from None
    except auth_exc.TransportError as e:
        raise CloudError(f"{what}: cannot reach Google's token service ({e})") from None
    except gexc.GoogleAPICallError as e:
        reasons, msg = _reasons(e), _text(e)
        code = reasons[0] if reasons else str(e.code or "")
        if isinstance(e, gexc.Unauthorized):
            raise CredentialsError(f"Google refused the credentials ({msg})",
                                   CREDENTIALS_HINT) from None
        if set(reasons) & QUOTA_CODES:
            raise QuotaError(f"{what}: {msg}", code="QUOTA_EXCEEDED") from None
        if isinstance(e, gexc.Forbidden) and (not reasons or set(reasons) & AUTH_REASONS):
            hint = ("enable it: gcloud services enable compute.googleapis.com"
                    if set(reasons) & {"accessNotConfigured", "SERVICE_DISABLED"} else
                    "give the account the Compute Admin role, or " + CREDENTIALS_HINT)
            raise CredentialsError(f"{what}: permission denied ({msg})", hint) from None
        if CAPACITY_TEXT in msg:
            raise CapacityError(f"{what}: {msg}", code=code) from None
        if isinstance(e, gexc.NotFound):
            code = NOT_FOUND
        raise CloudError(f"{what}: {code}: {msg}", code=code) from None
    except (gexc.GoogleAPIError, requests.RequestException) as e:
        raise CloudError(f"{what}: {e}") from None


def _metadata(inst, key: str) -> str | None:
    for item in (inst.metadata.items if inst.metadata else []):
        if item.key == key:
            return item.value
    return None


def _when(stamp: str) -> datetime:
    """An RFC 3339 timestamp of the API (``2026-01-01T00:00:00.000-08:00``) as a datetime."""
    try:
        when = datetime.fromisoformat(stamp.replace("Z", "+00:00"))
        return when if when.tzinfo else when.replace(tzinfo=timezone.utc)
    except ValueError:
        return datetime.min.replace(tzinfo=timezone.utc)


def firewall_names(cluster: str) -> tuple[str, str]:
    """The names of a cluster's firewall rules (SSH, internal), valid GCE names."""
    tag = gce_name(f"hyper-{cluster}")
    return f"{tag[:59].rstrip('-')}-ssh", f"{tag[:54].rstrip('-')}-internal"


def _admits(rule) -> tuple:
    """What a firewall rule admits, in a form to compare (priority and description left
    out): a found rule whose form differs from the wanted one is replaced."""
    return (rule.direction or "INGRESS", bool(rule.disabled), sorted(rule.source_ranges),
            sorted(rule.source_tags), sorted(rule.source_service_accounts),
            sorted(rule.target_tags), sorted(rule.target_service_accounts),
            sorted((a.I_p_protocol, tuple(a.ports)) for a in rule.allowed),
            sorted((d.I_p_protocol, tuple(d.ports)) for d in rule.denied))


def _last(link: str) -> str:
    return link.rstrip("/").rsplit("/", 1)[-1]


def account_id(spec: CloudSpec, node: str) -> str:
    """The service account id of one node (module docstring): ``hyper-<cluster>-<tag>-<n>``,
    ``<n>`` the node's number (``<cluster>-<n>``; a hash of the name for any other), the
    cluster's name cut so that the id fits 30 characters, the API's limit."""
    rest = node[len(spec.cluster) + 1:] if node.startswith(spec.cluster + "-") else ""
    n = rest if rest.isdigit() and len(rest) <= 5 else \
        hashlib.sha256(node.encode()).hexdigest()[:5]
    room = 30 - len(f"hyper--{spec.tag}-{n}")
    slug = gce_name(spec.cluster)[:room].rstrip("-") or "c"
    return f"hyper-{slug}-{spec.tag}-{n}"


def _sa_description(cluster: str, tag: str, node: str, buckets: list[str]) -> str:
    """A node's service account's description: its cluster, the cluster's identity tag, its
    node and the buckets it is bound on (what :meth:`GCPAPI.delete` unbinds). At most 256
    characters, the API's limit."""
    return (f"{TAG_CLUSTER}={cluster} hyper:cluster-id={tag} {TAG_NODE}={node} "
            f"buckets={','.join(buckets)}")[:256]


def _sa_field(description: str, key: str) -> str | None:
    m = re.search(rf"(?:^| ){re.escape(key)}=(\S*)", description or "")
    return m[1] if m else None


def _sa_buckets(description: str) -> list[str]:
    return [b for b in (_sa_field(description, "buckets") or "").split(",") if b]


def _bindings_key(bindings: list[dict]) -> list:
    """A policy's bindings in a form to compare (member order left out)."""
    import json
    return sorted(json.dumps(dict(b, members=sorted(b.get("members", []))), sort_keys=True)
                  for b in bindings)


def _cel(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def bucket_bindings(bucket: str, grants: list, cluster: str, tag: str = "") -> list[dict]:
    """The IAM bindings (without members) that give one bucket's ``grants``
    (:class:`hypercli.recipe.access.Grant`, all of ``bucket``): ``roles/storage.objectViewer``
    per read grant, ``roles/storage.objectUser`` per read/write grant; a grant with a prefix
    gets a condition titled ``hyper-<cluster>-<tag>`` allowing the objects under ``prefix/``
    and listing the bucket with that prefix (module docstring)."""
    out = []
    for g in sorted(rights(grants)):
        b = {"role": WRITE_ROLE if g.write else READ_ROLE}
        if g.prefix:
            p = g.prefix + "/"
            b["condition"] = {
                "title": gce_name(f"hyper-{cluster}" + (f"-{tag}" if tag else "")),
                "description": f"{'read/write' if g.write else 'read'} gs://{bucket}/{p}",
                "expression": (
                    f"resource.name.startsWith({_cel(f'projects/_/buckets/{bucket}/objects/{p}')})"
                    f" || (resource.name == {_cel(f'projects/_/buckets/{bucket}')} && "
                    f"api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\")"
                    f".startsWith({_cel(p)}))")}
        out.append(b)
    return out


def controller_condition(cluster: str) -> dict:
    """The IAM condition of a controller's binding for one cluster it drives: the instances
    and disks whose names start ``<cluster>-`` (as :func:`gce_name` makes its nodes'), in
    CEL (cloud.google.com/iam/docs/conditions-resource-attributes: ``resource.name`` of a
    Compute Engine instance is ``projects/P/zones/Z/instances/NAME``; ``extract`` gives the
    part in braces, "" when the template does not match)."""
    p = _cel(gce_name(cluster) + "-")
    return {"title": f"{DRIVES}{cluster}"[:100],
            "description": f"hypercli: a controller drives the cluster {cluster}"[:256],
            "expression": f'resource.name.extract("/instances/{{name}}").startsWith({p}) || '
                          f'resource.name.extract("/disks/{{name}}").startsWith({p})'}


class GCPAPI:
    """Compute Engine in one project and region (see the module docstring).

    Args:
        project: project id, or None for the credentials' project / ``GOOGLE_CLOUD_PROJECT``.
        region: e.g. ``us-central1`` (may be empty when every spec names its zones).
        credentials: google-auth credentials (default: application default credentials).
    """

    name = "gcp"
    #: nodes make their own SSH host key and publish it (:meth:`host_key`)
    node_host_keys = True

    def __init__(self, project: str | None, region: str, credentials=None):
        self.region = region
        self.endpoint = os.environ.get("HYPER_GCP_ENDPOINT") or None
        self._credentials = credentials
        self._project = project
        self._found_project: str | None = None
        self._zones_of_region: list[str] | None = None
        self._local = threading.local()
        self._lock = threading.Lock()
        self._session = None

    # -- plumbing ------------------------------------------------------------------------------
    def _creds(self):
        """The credentials (module docstring). Raises CredentialsError."""
        with self._lock:
            if self._credentials is None:
                if self.endpoint:
                    self._credentials = AnonymousCredentials()
                else:
                    with _calls("loading Google application default credentials"):
                        self._credentials, self._found_project = google.auth.default(
                            scopes=CALLER_SCOPES)
            return self._credentials

    @property
    def project(self) -> str:
        """The project id. Raises CredentialsError when neither the argument, the credentials
        nor ``GOOGLE_CLOUD_PROJECT`` name one."""
        if not self._project:
            self._creds()
            self._project = self._found_project or os.environ.get("GOOGLE_CLOUD_PROJECT")
            if not self._project:
                raise CredentialsError("no Google Cloud project", PROJECT_HINT)
        return self._project

    def _client(self, cls):
        """One client of ``cls`` per thread, on the REST transport."""
        c = getattr(self._local, cls.__name__, None)
        if c is None:
            opts = ClientOptions(api_endpoint=self.endpoint) if self.endpoint else None
            with _calls("creating the Compute Engine client"):
                c = cls(credentials=self._creds(), client_options=opts, transport="rest")
            setattr(self._local, cls.__name__, c)
        return c

    @property
    def instances(self) -> compute_v1.InstancesClient:
        return self._client(compute_v1.InstancesClient)

    def _wait(self, op, what: str, zone: str | None = None) -> None:
        """Wait until a zone operation (``zone`` given) or global operation is DONE.

        Raises:
            CapacityError, QuotaError, CloudError: the operation ended in that error (``code``:
            the operation's error code), or is not done after :data:`OP_TIMEOUT` s.
        """
        deadline = time.monotonic() + OP_TIMEOUT
        ops = self._client(compute_v1.ZoneOperationsClient if zone
                           else compute_v1.GlobalOperationsClient)
        where = {"zone": zone} if zone else {}
        while op.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() > deadline:
                raise CloudError(f"{what}: operation {op.name} not done after "
                                 f"{OP_TIMEOUT:.0f} s")
            with _calls(what):
                op = ops.wait(project=self.project, operation=op.name, **where)
        errors = list(op.error.errors) if op.error else []
        if errors:
            code, msg = errors[0].code, errors[0].message
            cls = CapacityError if code in CAPACITY_CODES or CAPACITY_TEXT in msg else \
                QuotaError if code in QUOTA_CODES else CloudError
            raise cls(f"{what}: {code}: {msg}", code=code)

    def _region_zones(self) -> list[str]:
        """The region's zones in the API's order. Raises UsageError for an unknown region."""
        if self._zones_of_region is None:
            if not self.region:
                raise UsageError("provider gcp needs cluster.region or cluster.zone",
                                 "e.g. region: us-central1")
            try:
                with _calls(f"reading region {self.region}"):
                    region = self._client(compute_v1.RegionsClient).get(
                        project=self.project, region=self.region)
            except CloudError as e:
                if e.code != NOT_FOUND:
                    raise
                raise UsageError(f"region {self.region} not found in project {self.project}",
                                 "set cluster.region, e.g. us-central1") from None
            self._zones_of_region = [_last(z) for z in region.zones]
        return self._zones_of_region

    # -- the contract --------------------------------------------------------------------------
    def check(self) -> str:
        """``project P, region R (N zones)`` after one authenticated read (the region, or the
        project when no region is set). Raises CredentialsError, UsageError, CloudError."""
        if self.region:
            zones = self._region_zones()
            line = f"project {self.project}, region {self.region} ({len(zones)} zones)"
        else:
            with _calls("reading the project"):
                self._client(compute_v1.ProjectsClient).get(project=self.project)
            line = f"project {self.project}, no region set"
        return f"{line}; {self.identity_check()}"

    def identity_check(self) -> str:
        """Whether the caller may make clusters' service accounts (Resource Manager
        ``projects.testIamPermissions`` of :data:`IDENTITY_PERMISSIONS`), as one line for
        ``hyper check``: ``storage identities: allowed`` or what is missing and what to do.
        Bucket policies (``storage.buckets.setIamPolicy``) are per bucket: ``hyper up``
        checks those. Raises CredentialsError."""
        url = (f"{self._base('https://cloudresourcemanager.googleapis.com')}/v1/projects/"
               f"{self.project}:testIamPermissions")
        try:
            have = set(self._rest("POST", url, "testing the caller's IAM permissions",
                                  {"permissions": list(IDENTITY_PERMISSIONS)})
                       .get("permissions") or [])
        except CloudError as e:
            return f"storage identities: not known ({e})"
        missing = [x for x in IDENTITY_PERMISSIONS if x not in have]
        if not missing:
            return "storage identities: allowed"
        return (f"storage identities: missing {', '.join(missing)}, so every gcp cluster "
                "needs cluster.service_account (nodes never run as the default account)")

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        """Make (or find, or correct) the cluster's two firewall rules (module docstring):
        ``hyper-<cluster>-ssh`` (TCP 22 from ``spec.ssh_cidr``) and ``hyper-<cluster>-internal``
        (every protocol from the tag ``hyper-<cluster>``), both to instances with the tag
        ``hyper-<cluster>``; waits for their global operations.

        Returns:
            ``{"firewall": SSH rule name, "internal_firewall": internal rule name,
            "network_tag": tag}`` and what :meth:`identity` returned (asked first: a caller
            who may not make the nodes' accounts gets its CredentialsError before anything
            else exists) for :meth:`create`.
        Raises:
            UsageError: ``spec.ssh_cidr`` is not set. CredentialsError, CloudError.
        """
        if not spec.ssh_cidr:
            raise UsageError("no address range for the SSH firewall rule",
                             "set cluster.ssh_cidr, e.g. 203.0.113.7/32")
        ident = self.identity(spec)
        tag = gce_name(f"hyper-{spec.cluster}")
        ssh, internal = firewall_names(spec.cluster)
        mark = f"{TAG_CLUSTER}={spec.cluster} {TAG_OWNER}={owner()}"
        common = dict(network="global/networks/default", direction="INGRESS", target_tags=[tag])
        self._firewall(compute_v1.Firewall(
            name=ssh, description=f"{mark}: SSH", source_ranges=[spec.ssh_cidr],
            allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])], **common))
        self._firewall(compute_v1.Firewall(
            name=internal, description=f"{mark}: traffic between the cluster's nodes",
            source_tags=[tag], allowed=[compute_v1.Allowed(I_p_protocol="all")], **common))
        return {"firewall": ssh, "internal_firewall": internal, "network_tag": tag, **ident}

    # -- storage identity (module docstring) --------------------------------------------------
    def _rest(self, method: str, url: str, what: str, body: dict | None = None) -> dict:
        """One authorized JSON call to the IAM or Cloud Storage API (``HYPER_GCP_ENDPOINT``
        serves both in tests). Returns the answer's JSON.

        Raises:
            CredentialsError: 401. CloudError: any other error; ``code`` is ``notFound``
            (404), ``alreadyExists`` (409), ``forbidden`` (403) or the HTTP status.
        """
        from google.auth.transport.requests import AuthorizedSession
        creds = self._creds()
        with _calls(what):
            with self._lock:
                if self._session is None:
                    self._session = AuthorizedSession(creds)
            r = self._session.request(method, url, json=body, timeout=60)
        if r.status_code < 300:
            return r.json() if r.content else {}
        try:
            err = r.json().get("error") or {}
        except ValueError:
            err = {}
        msg = err.get("message") or r.text[:200]
        if r.status_code == 401:
            raise CredentialsError(f"Google refused the credentials ({msg})", CREDENTIALS_HINT)
        code = {403: "forbidden", 404: NOT_FOUND, 409: "alreadyExists"}.get(
            r.status_code, str(r.status_code))
        raise CloudError(f"{what}: {code}: {msg}", code=code)

    def _base(self, real: str) -> str:
        return (self.endpoint or real).rstrip("/")

    def _denied(self, e: CloudError, permission: str, where: str) -> None:
        if e.code == "forbidden":
            raise CredentialsError(
                f"the caller may not {where} (permission {permission} is missing)",
                f"grant it to the caller (e.g. roles/iam.serviceAccountAdmin, "
                f"roles/storage.admin on the bucket), {IDENTITY_HINT}") from None

    def identity(self, spec: CloudSpec) -> dict:
        """Set, idempotently, the storage bindings of the cluster's nodes' accounts to exactly
        the ``gs`` grants of ``spec.grants`` (module docstring, "Identities"), after asking
        whether the caller may make the nodes' accounts and bind them on those buckets.

        Returns:
            ``{"own_accounts": True, "scopes": [...]}`` (:meth:`create` makes an account per
            node and binds it), or, with ``cluster.service_account``, ``{"service_account":
            e-mail, "scopes": [...]}``.
        Raises:
            CredentialsError: the caller may not create service accounts
                (``iam.serviceAccounts.create``) or set a bucket's IAM policy
                (``storage.buckets.setIamPolicy``); the message names the permission and
                ``cluster.service_account``.
            CloudError: other API failures (e.g. a bucket that does not exist).
        """
        scopes = SCOPES + [STORAGE_SCOPE]
        if spec.identity:
            return {"service_account": spec.identity, "scopes": scopes}
        self._preflight(spec)
        self._set_bindings(spec, self._accounts(spec))
        return {"own_accounts": True, "scopes": scopes}

    def _preflight(self, spec: CloudSpec) -> None:
        """CredentialsError unless the caller may make service accounts and set the IAM
        policy of each bucket of ``spec.grants`` (``testIamPermissions``: nothing is made
        before it is known that all can be)."""
        url = (f"{self._base('https://cloudresourcemanager.googleapis.com')}/v1/projects/"
               f"{self.project}:testIamPermissions")
        have = set(self._rest("POST", url, "testing the caller's IAM permissions",
                              {"permissions": list(IDENTITY_PERMISSIONS)})
                   .get("permissions") or [])
        for perm in IDENTITY_PERMISSIONS:
            if perm not in have:
                self._denied(CloudError("refused", code="forbidden"), perm,
                             "create the nodes' service accounts")
        for bucket in sorted({g.bucket for g in rights(spec.grants) if g.scheme == "gs"}):
            got = self._rest("GET", f"{self._policy_url(bucket)}/testPermissions?permissions="
                             "storage.buckets.setIamPolicy",
                             f"testing the caller's permissions on bucket {bucket}")
            if "storage.buckets.setIamPolicy" not in (got.get("permissions") or []):
                self._denied(CloudError("refused", code="forbidden"),
                             "storage.buckets.setIamPolicy",
                             f"set the IAM policy of bucket {bucket}")

    def _sa_url(self, email: str = "") -> str:
        url = f"{self._base(IAM_URL)}/v1/projects/{self.project}/serviceAccounts"
        return f"{url}/{email}" if email else url

    def _email(self, aid: str) -> str:
        return f"{aid}@{self.project}.iam.gserviceaccount.com"

    def _accounts(self, spec: CloudSpec) -> dict[str, dict]:
        """The cluster's nodes' service accounts: e-mail → the account (IAM's JSON); those
        whose description names the cluster *and* its identity tag, so that another
        cluster of the same name (another state file) never gets this one's bindings."""
        return {a["email"]: a for a in self._account_list() if
                _sa_field(a.get("description"), TAG_CLUSTER) == spec.cluster
                and _sa_field(a.get("description"), "hyper:cluster-id") == spec.tag}

    def _node_account(self, spec: CloudSpec, node: str) -> tuple[str, dict]:
        """Create (or find, when it is this node's own) the service account of ``node``;
        returns (e-mail, the account). Raises CredentialsError, IdentityConflict,
        CloudError."""
        aid = account_id(spec, node)
        email = self._email(aid)
        try:
            made = self._rest("POST", self._sa_url(), f"creating the service account {email}", {
                "accountId": aid,
                "serviceAccount": {"displayName": f"hypercli node {node}"[:100],
                                   "description": _sa_description(spec.cluster, spec.tag,
                                                                  node, [])}})
            return email, made
        except CloudError as e:
            self._denied(e, "iam.serviceAccounts.create", f"create the service account {email}")
            if e.code != "alreadyExists":
                raise
        return email, self._check_account(spec, node, email)

    def _check_account(self, spec: CloudSpec, node: str, email: str) -> dict:
        """The account found under a node's computed name, when it is that node's own as
        hypercli leaves it (module docstring). Raises IdentityConflict otherwise."""
        found = self._rest("GET", self._sa_url(email), f"reading {email}")
        desc = found.get("description") or ""
        why = []
        if (_sa_field(desc, TAG_CLUSTER), _sa_field(desc, "hyper:cluster-id"),
                _sa_field(desc, TAG_NODE)) != (spec.cluster, spec.tag, node):
            why.append(f"its description does not name cluster {spec.cluster} and node "
                       f"{node}")
        keys = self._rest("GET", f"{self._sa_url(email)}/keys?keyTypes=USER_MANAGED",
                          f"listing the keys of {email}").get("keys") or []
        if keys:
            why.append(f"it has {len(keys)} user-managed key(s)")
        policy = self._rest("POST", f"{self._sa_url(email)}:getIamPolicy",
                            f"reading who may act as {email}", {})
        if policy.get("bindings"):
            why.append("others may act as it: " + ", ".join(
                f"{b.get('role')} {m}" for b in policy["bindings"] for m in b.get("members", [])))
        held = self._project_roles(email)
        if held is None:
            why.append(f"its roles in project {self.project} cannot be read (permission "
                       "resourcemanager.projects.getIamPolicy)")
        elif held:
            why.append(f"it holds roles in project {self.project}: " + ", ".join(held))
        if why:
            raise IdentityConflict(
                f"a service account {email} exists and is not node {node}'s own: "
                + "; ".join(why),
                "delete it if it is left from an old cluster, or name the account the nodes "
                "should run as: cluster.service_account: NAME@PROJECT.iam.gserviceaccount.com")
        return found

    def _project_roles(self, email: str) -> list[str] | None:
        """The roles the project's IAM policy gives the account ``email`` (Resource Manager
        ``projects.getIamPolicy``), sorted; None when the caller may not read that policy.
        A node's account holds none (module docstring): a found one that does would hand
        them to every task on its node."""
        url = (f"{self._base('https://cloudresourcemanager.googleapis.com')}/v1/projects/"
               f"{self.project}:getIamPolicy")
        try:
            policy = self._rest("POST", url, f"reading the IAM policy of project "
                                f"{self.project}", {"options": {"requestedPolicyVersion": 3}})
        except CloudError as e:
            if e.code != "forbidden":
                raise
            return None
        member = f"serviceAccount:{email}"
        return sorted({b.get("role", "?") for b in policy.get("bindings") or []
                       if member in (b.get("members") or [])})

    def _set_bindings(self, spec: CloudSpec, accounts: dict[str, dict]) -> None:
        """Bind the accounts (e-mail → account) on exactly the ``gs`` grants of
        ``spec.grants``: on each bucket wanted or bound before (the accounts' descriptions),
        take the accounts out of every binding, then add them to the wanted ones; the
        accounts' descriptions list the buckets they are bound on (written first, so that a
        bucket is never bound unrecorded)."""
        grants = [g for g in rights(spec.grants) if g.scheme == "gs"]
        wanted = sorted({g.bucket for g in grants})
        before = sorted({b for a in accounts.values()
                         for b in _sa_buckets(a.get("description", ""))})
        members = {f"serviceAccount:{e}" for e in accounts}
        if not members:
            return
        for email, acct in accounts.items():
            listed = _sa_buckets(acct.get("description", ""))
            if set(wanted) - set(listed):
                desc = acct.get("description", "")
                new = _sa_description(spec.cluster, spec.tag, _sa_field(desc, TAG_NODE) or "",
                                      sorted(set(listed) | set(wanted)))
                try:
                    self._rest("PATCH", self._sa_url(email), f"updating {email}", {
                        "serviceAccount": {"description": new}, "updateMask": "description"})
                except CloudError as e:
                    self._denied(e, "iam.serviceAccounts.update", f"update {email}")
                    raise
                acct["description"] = new
        for bucket in sorted(set(wanted) | set(before)):
            self._bind(bucket, members, spec, [g for g in grants if g.bucket == bucket])

    def _policy_url(self, bucket: str) -> str:
        return f"{self._base(STORAGE_URL)}/storage/v1/b/{bucket}/iam"

    def _bind(self, bucket: str, members: set, spec: CloudSpec, grants: list) -> None:
        """Set ``members``' bindings on one bucket to ``grants`` (read-modify-write with the
        policy's etag, version 3); nothing is sent when they are so already; a bucket gone is
        skipped when nothing is wanted on it."""
        for attempt in range(3):  # 412: someone else changed the policy in between
            try:
                return self._bind_once(bucket, members, spec, grants)
            except CloudError as e:
                if e.code != "412" or attempt == 2:
                    raise

    def _bind_once(self, bucket: str, members: set, spec: CloudSpec, grants: list) -> None:
        what = f"setting the IAM policy of bucket {bucket}"
        try:
            policy = self._rest("GET", self._policy_url(bucket) +
                                "?optionsRequestedPolicyVersion=3",
                                f"reading the IAM policy of bucket {bucket}")
        except CloudError as e:
            if e.code == NOT_FOUND and not grants:
                return
            self._denied(e, "storage.buckets.getIamPolicy",
                         f"read the IAM policy of bucket {bucket}")
            raise
        old = policy.get("bindings", [])
        kept = []
        for b in old:
            rest = [m for m in b.get("members", []) if m not in members]
            if rest:
                kept.append(dict(b, members=rest))
        for want in bucket_bindings(bucket, grants, spec.cluster, spec.tag):
            same = [b for b in kept if b.get("role") == want["role"]
                    and b.get("condition") == want.get("condition")]
            if same:
                same[0]["members"] = sorted(set(same[0]["members"]) | members)
            else:
                kept.append(dict(want, members=sorted(members)))
        if _bindings_key(kept) == _bindings_key(old):
            return
        policy["bindings"], policy["version"] = kept, 3
        try:
            self._rest("PUT", self._policy_url(bucket), what, policy)
        except CloudError as e:
            self._denied(e, "storage.buckets.setIamPolicy",
                         f"set the IAM policy of bucket {bucket}")
            if e.code == "400" and "uniform bucket-level access" in str(e):
                raise UsageError(
                    f"bucket {bucket} does not use uniform bucket-level access, which the "
                    "IAM Conditions keeping the nodes to their prefixes need",
                    f"turn it on: gcloud storage buckets update gs://{bucket} "
                    "--uniform-bucket-level-access (or name an account that may use the "
                    "bucket: cluster.service_account)") from None
            raise

    def _unbind(self, bucket: str, member: str) -> None:
        """Take ``member`` out of every binding of a bucket's policy (a bucket gone is
        skipped)."""
        try:
            policy = self._rest("GET", self._policy_url(bucket) +
                                "?optionsRequestedPolicyVersion=3",
                                f"reading the IAM policy of bucket {bucket}")
        except CloudError as e:
            if e.code == NOT_FOUND:
                return
            raise
        bindings = policy.get("bindings", [])
        kept = []
        for b in bindings:
            members = [m for m in b.get("members", []) if m != member]
            if members:
                kept.append(dict(b, members=members))
        if kept != bindings:
            policy["bindings"], policy["version"] = kept, 3
            self._rest("PUT", self._policy_url(bucket),
                       f"setting the IAM policy of bucket {bucket}", policy)

    def _delete_service_account(self, email: str) -> None:
        """Unbind a node's service account from the buckets its description lists, then
        delete it (one already gone is skipped)."""
        try:
            found = self._rest("GET", self._sa_url(email), f"reading {email}")
        except CloudError as e:
            if e.code == NOT_FOUND:
                return
            raise
        for bucket in _sa_buckets(found.get("description", "")):
            self._unbind(bucket, f"serviceAccount:{email}")
        if _sa_field(found.get("description", ""), TAG_NODE) == "controller":
            self._unbind_project(email)  # its project bindings (controller_identity)
        try:
            self._rest("DELETE", self._sa_url(email), f"deleting {email}")
        except CloudError as e:
            if e.code != NOT_FOUND:
                raise

    def _self_delete_role(self) -> str | None:
        """The project's custom role ``hyperNodeSelfDelete`` (module docstring), made,
        restored or corrected when needed; its name, or None (with a warning) when the
        caller may not make it."""
        base = f"{self._base(IAM_URL)}/v1/projects/{self.project}/roles"
        name = f"projects/{self.project}/roles/{SELF_DELETE_ROLE}"
        want = {"title": "hypercli node self-deletion",
                "description": "A hypercli node deletes its own idle instance (bound on that "
                               "instance only)",
                "includedPermissions": SELF_DELETE_PERMISSIONS, "stage": "GA"}
        try:
            try:
                role = self._rest("GET", f"{base}/{SELF_DELETE_ROLE}", f"reading {name}")
            except CloudError as e:
                if e.code != NOT_FOUND:
                    raise
                self._rest("POST", base, f"creating the role {name}",
                           {"roleId": SELF_DELETE_ROLE, "role": want})
                return name
            if role.get("deleted"):
                role = self._rest("POST", f"{base}/{SELF_DELETE_ROLE}:undelete",
                                  f"restoring {name}", {"etag": role.get("etag")})
            if sorted(role.get("includedPermissions") or []) != SELF_DELETE_PERMISSIONS:
                self._rest("PATCH", f"{base}/{SELF_DELETE_ROLE}?updateMask="
                           "includedPermissions", f"correcting {name}",
                           {"includedPermissions": SELF_DELETE_PERMISSIONS,
                            "etag": role.get("etag")})
            return name
        except CloudError as e:
            if e.code != "forbidden":
                raise
            log.warning("the nodes cannot delete their own idle instance (the custom role "
                        "%s cannot be made: %s); they power off instead", name, e)
            return None

    # -- a controller's identity (hypercli.controller.cloud) -----------------------------------
    def controller_identity(self, spec: CloudSpec, owner_tag: str,
                            clusters: dict | None = None) -> dict:
        """Make or update, idempotently, the identity of a controller instance
        (:mod:`hypercli.controller`; ``spec.cluster`` is the controller's cluster): a service
        account of its own (:func:`account_id` of node ``controller``, described like a
        node's, so that ``hyper down`` of the controller's cluster removes it), the custom
        roles :data:`CONTROLLER_READ_ROLE` and :data:`CONTROLLER_ROLE`, bound on the project
        (:meth:`_bind_controller`: the first without a condition, the second once per
        cluster the controller drives with an IAM condition on the names of that cluster's
        instances and disks), read on the ``gs`` grants of ``spec.grants``, and
        :data:`ACT_AS_ROLE` on the node accounts of ``clusters`` only (:meth:`_let_act_as`:
        a replacement it launches runs as one of them as it is).

        GCP's IAM conditions cannot test labels (the owner label of the node identities is
        not an attribute; cloud.google.com/iam/docs/conditions-attribute-reference lists
        ``resource.name``, ``resource.type``, ``resource.service`` and tags), so the scope is
        by name: ``<cluster>-`` for each of ``clusters`` and the controller's own. The list
        and read permissions are checked on the project or zone, not on an instance, and
        are granted without a condition (reads only).

        Args:
            owner_tag: the user's owner label value (kept in the account's description).
            clusters: the clusters it drives, name → their ``cluster:`` options, added to
                those it was given before (never taken away while it lives).
        Returns:
            ``{"service_account": its e-mail}`` for the instance to run as.
        Raises:
            CredentialsError: the caller may not make the account, the roles or the bindings
                (the message names the permission). IdentityConflict: an account of that
                name that is not this controller's own. CloudError.
        """
        from dataclasses import replace
        email = self._email(account_id(spec, "controller"))
        acct = self._controller_account(spec, email)
        reads = tuple(replace(g, write=False) for g in rights(spec.grants) if g.scheme == "gs")
        self._set_bindings(replace(spec, grants=reads), {email: acct})
        names = sorted(set(clusters or ()) | {spec.cluster})
        read_role = self._custom_role(CONTROLLER_READ_ROLE, CONTROLLER_READ_PERMISSIONS,
                                      "hypercli controller: reads")
        act_role = self._custom_role(CONTROLLER_ROLE, CONTROLLER_PERMISSIONS,
                                     "hypercli controller: its user's clusters' instances")
        self._bind_controller(email, read_role, act_role, names)
        self._let_act_as(f"serviceAccount:{email}", spec.cluster, clusters or {})
        return {"service_account": email}

    def _let_act_as(self, member: str, own: str, clusters: dict) -> None:
        """Give ``member`` (a controller's account) :data:`ACT_AS_ROLE` on the node accounts
        of ``clusters`` (name → their ``cluster:`` options) and on nothing else: those whose
        description names one of them (not ``own``, the controller's cluster) and a node, and
        a cluster's ``service_account`` option. Each binding is on that account's own IAM
        policy (``serviceAccounts.setIamPolicy``), added once. Raises CredentialsError (for
        the cluster's own accounts), CloudError; a named ``service_account`` whose policy the
        caller may not set gets a warning (the controller launches no node as it)."""
        named = {o.get("service_account") for c, o in clusters.items()
                 if c != own and (o or {}).get("service_account")}
        found = {a["email"] for a in self._account_list()
                 if _sa_field(a.get("description"), TAG_CLUSTER) in set(clusters) - {own}
                 and _sa_field(a.get("description"), TAG_NODE) not in (None, "controller")}
        for email in sorted(found | named):
            url = self._sa_url(email)
            try:
                policy = self._rest("POST", f"{url}:getIamPolicy",
                                    f"reading who may act as {email}", {})
                bindings = policy.get("bindings") or []
                if any(b.get("role") == ACT_AS_ROLE and member in b.get("members", [])
                       and not b.get("condition") for b in bindings):
                    continue
                policy["bindings"] = bindings + [{"role": ACT_AS_ROLE, "members": [member]}]
                self._rest("POST", f"{url}:setIamPolicy",
                           f"letting the controller launch nodes as {email}",
                           {"policy": policy})
            except CloudError as e:
                if email in named and e.code == "forbidden":
                    log.warning("the controller may not launch nodes as %s (%s): it drives "
                                "the nodes there are but launches no replacement", email, e)
                    continue
                self._denied(e, "iam.serviceAccounts.setIamPolicy",
                             f"let the controller act as {email}")
                raise

    def _controller_account(self, spec: CloudSpec, email: str) -> dict:
        """Create, or find when it is this controller's own, its service account. Raises
        CredentialsError, IdentityConflict, CloudError."""
        desc = _sa_description(spec.cluster, spec.tag, "controller", [])
        try:
            return self._rest("POST", self._sa_url(), f"creating the service account {email}", {
                "accountId": email.split("@")[0],
                "serviceAccount": {"displayName": f"hypercli controller {spec.cluster}"[:100],
                                   "description": desc}})
        except CloudError as e:
            self._denied(e, "iam.serviceAccounts.create", f"create the service account {email}")
            if e.code != "alreadyExists":
                raise
        found = self._rest("GET", self._sa_url(email), f"reading {email}")
        d = found.get("description") or ""
        held = self._project_roles(email)
        mine = {f"projects/{self.project}/roles/{r}" for r in
                (CONTROLLER_ROLE, CONTROLLER_READ_ROLE)}
        why = []
        if (_sa_field(d, TAG_CLUSTER), _sa_field(d, "hyper:cluster-id"),
                _sa_field(d, TAG_NODE)) != (spec.cluster, spec.tag, "controller"):
            why.append(f"its description does not name the controller {spec.cluster}")
        if self._rest("GET", f"{self._sa_url(email)}/keys?keyTypes=USER_MANAGED",
                      f"listing the keys of {email}").get("keys"):
            why.append("it has user-managed keys")
        if self._rest("POST", f"{self._sa_url(email)}:getIamPolicy",
                      f"reading who may act as {email}", {}).get("bindings"):
            why.append("others may act as it")
        if held is None or set(held) - mine:
            why.append(f"it holds roles in project {self.project} other than the "
                       "controller's" if held else "its project roles cannot be read")
        if why:
            raise IdentityConflict(f"a service account {email} exists and is not the "
                                   f"controller {spec.cluster}'s own: " + "; ".join(why),
                                   "delete it if it is left from an old controller")
        return found

    def _custom_role(self, role_id: str, permissions: list[str], title: str) -> str:
        """The project's custom role ``role_id`` with exactly ``permissions``, made,
        restored or corrected when needed; returns its name. Raises CredentialsError
        (``iam.roles.create`` / ``iam.roles.update`` refused), CloudError."""
        base = f"{self._base(IAM_URL)}/v1/projects/{self.project}/roles"
        name = f"projects/{self.project}/roles/{role_id}"
        want = sorted(permissions)
        try:
            try:
                role = self._rest("GET", f"{base}/{role_id}", f"reading {name}")
            except CloudError as e:
                if e.code != NOT_FOUND:
                    raise
                self._rest("POST", base, f"creating the role {name}", {
                    "roleId": role_id, "role": {"title": title, "description": title,
                                                "includedPermissions": want, "stage": "GA"}})
                return name
            if role.get("deleted"):
                role = self._rest("POST", f"{base}/{role_id}:undelete", f"restoring {name}",
                                  {"etag": role.get("etag")})
            if sorted(role.get("includedPermissions") or []) != want:
                self._rest("PATCH", f"{base}/{role_id}?updateMask=includedPermissions",
                           f"correcting {name}", {"includedPermissions": want,
                                                  "etag": role.get("etag")})
        except CloudError as e:
            self._denied(e, "iam.roles.create", f"make the custom role {name}")
            raise
        return name

    def _project_policy_url(self, verb: str) -> str:
        return (f"{self._base('https://cloudresourcemanager.googleapis.com')}/v1/projects/"
                f"{self.project}:{verb}")

    def _bind_controller(self, email: str, read_role: str, act_role: str,
                         clusters: list[str]) -> None:
        """Set the controller account's bindings in the project's IAM policy (version 3,
        read-modify-write with its etag) to exactly: ``read_role`` unconditioned, and
        ``act_role`` once per cluster with the condition :func:`controller_condition`, for
        ``clusters`` and those it was bound for before (a controller keeps the clusters it
        was given while it lives)."""
        member = f"serviceAccount:{email}"
        for attempt in range(3):
            policy = self._rest("POST", self._project_policy_url("getIamPolicy"),
                                f"reading the IAM policy of project {self.project}",
                                {"options": {"requestedPolicyVersion": 3}})
            old = policy.get("bindings") or []
            given = {b["condition"]["title"][len(DRIVES):] for b in old
                     if b.get("role") == act_role and member in b.get("members", [])
                     and (b.get("condition") or {}).get("title", "").startswith(DRIVES)}
            want = [{"role": read_role, "members": [member]}] + [
                {"role": act_role, "members": [member], "condition": controller_condition(c)}
                for c in sorted(given | set(clusters))]
            kept = [dict(b, members=[m for m in b.get("members", []) if m != member])
                    for b in old]
            kept = [b for b in kept if b["members"]] + want
            if _bindings_key(kept) == _bindings_key(old):
                return
            policy.update(bindings=kept, version=3)
            try:
                self._rest("POST", self._project_policy_url("setIamPolicy"),
                           f"setting the IAM policy of project {self.project}",
                           {"policy": policy, "updateMask": "bindings,etag,version"})
                return
            except CloudError as e:
                self._denied(e, "resourcemanager.projects.setIamPolicy",
                             f"bind the controller's roles in project {self.project}")
                if e.code not in ("alreadyExists", "412") or attempt == 2:  # a concurrent change
                    raise

    def _unbind_project(self, email: str) -> None:
        """Take ``serviceAccount:<email>`` out of every binding of the project's IAM policy
        (a controller's account, before it is deleted), and out of the IAM policies of the
        node accounts of the clusters it drove (:meth:`_let_act_as`)."""
        member = f"serviceAccount:{email}"
        policy = self._rest("POST", self._project_policy_url("getIamPolicy"),
                            f"reading the IAM policy of project {self.project}",
                            {"options": {"requestedPolicyVersion": 3}})
        old = policy.get("bindings") or []
        titles = {(b.get("condition") or {}).get("title", "") for b in old
                  if member in b.get("members", [])}
        self._unlet_act_as(member, {t[len(DRIVES):] for t in titles if t.startswith(DRIVES)})
        kept = [dict(b, members=[m for m in b.get("members", []) if m != member]) for b in old]
        kept = [b for b in kept if b["members"]]
        if kept != old:
            policy.update(bindings=kept, version=3)
            self._rest("POST", self._project_policy_url("setIamPolicy"),
                       f"setting the IAM policy of project {self.project}",
                       {"policy": policy, "updateMask": "bindings,etag,version"})

    def _unlet_act_as(self, member: str, clusters: set) -> None:
        """Take ``member`` out of the IAM policies of the node accounts of ``clusters``.
        Best effort: a policy that cannot be read or set gets a warning (once ``member`` is
        deleted, such a binding names a deleted account and grants nothing)."""
        for a in self._account_list():
            if _sa_field(a.get("description"), TAG_CLUSTER) not in clusters:
                continue
            url = self._sa_url(a["email"])
            try:
                policy = self._rest("POST", f"{url}:getIamPolicy",
                                    f"reading who may act as {a['email']}", {})
                old = policy.get("bindings") or []
                kept = [dict(b, members=[m for m in b.get("members", []) if m != member])
                        for b in old]
                kept = [b for b in kept if b["members"]]
                if kept != old:
                    self._rest("POST", f"{url}:setIamPolicy",
                               f"taking the controller off {a['email']}",
                               {"policy": dict(policy, bindings=kept)})
            except CloudError as e:
                log.warning("%s may still act as %s: %s", member, a["email"], e)

    def _account_list(self) -> list[dict]:
        """Every service account of the project (IAM's JSON); [] with a warning when the
        caller may not list them (a caller who named ``cluster.service_account`` may lack
        that, and has none to remove)."""
        out, token = [], ""
        while True:
            try:
                page = self._rest("GET", self._sa_url() + (f"?pageToken={token}" if token
                                                           else ""), "listing service accounts")
            except CloudError as e:
                if e.code != "forbidden":
                    raise
                log.warning("cannot list service accounts (iam.serviceAccounts.list): %s", e)
                return out
            out += page.get("accounts", [])
            token = page.get("nextPageToken")
            if not token:
                return out

    def _service_accounts(self, cluster: str | None,
                          accounts: list[dict] | None = None) -> list[Resource]:
        """The service accounts whose description says ``hyper:cluster=`` (= ``cluster``,
        any when None); none, with a warning, when the caller may not list them."""
        out = []
        for a in self._account_list() if accounts is None else accounts:
            c = _sa_field(a.get("description"), TAG_CLUSTER) \
                if (a.get("description") or "").startswith(f"{TAG_CLUSTER}=") else None
            if c and (cluster is None or c == cluster):
                out.append(Resource("service_account", a["email"], c, "global"))
        return out

    def _firewall(self, want: compute_v1.Firewall) -> None:
        """Insert the firewall rule ``want``, or replace the rule of its name when that
        admits something else (``firewalls.update``, a full replacement: a source added by
        hand goes too); waits for the global operation. Raises CredentialsError, CloudError."""
        fw = self._client(compute_v1.FirewallsClient)
        try:
            with _calls(f"reading the firewall rule {want.name}"):
                rule = fw.get(project=self.project, firewall=want.name)
        except CloudError as e:
            if e.code != NOT_FOUND:
                raise
            rule = None
        if rule is None:
            what = f"creating the firewall rule {want.name}"
            with _calls(what):
                op = fw.insert_unary(project=self.project, firewall_resource=want)
        elif _admits(rule) != _admits(want):
            what = f"updating the firewall rule {want.name}"
            with _calls(what):
                op = fw.update_unary(project=self.project, firewall=want.name,
                                     firewall_resource=want)
        else:
            return
        self._wait(op, what)

    def _labels(self, cluster: str, node: str | None = None) -> dict:
        labels = {label_key(TAG_CLUSTER): label_value(cluster),
                  label_key(TAG_OWNER): label_value(owner())}
        if node:
            labels[label_key(TAG_NODE)] = label_value(node)
        return labels

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
        """Insert one instance per node (module docstring), all of a zone at once, then wait
        for their operations; nodes that met a CapacityError go on to the next zone.

        Args:
            spec: the cluster; nodes: node names; boot: boot documents and SSH key;
            prepared: what :meth:`prepare` returned.
        Returns:
            (the VMs made, {node: its last error} for nodes that got none).
        Raises:
            UsageError: no image, unknown region. CredentialsError.
        """
        image = self.find_image(spec)
        zones = list(spec.zones) or self._region_zones()
        vms, errors = [], {}
        if prepared.get("own_accounts"):
            prepared = dict(prepared, accounts=self._make_accounts(spec, nodes))
        waiting = list(nodes)
        for zone in zones:
            started, next_zone = {}, []
            for node in waiting:
                try:
                    started[node] = self._insert(spec, node, zone, image, boot, prepared)
                except CapacityError as e:
                    errors[node] = e
                    next_zone.append(node)
                except CloudError as e:
                    vm = self._adopt(spec, node, zone) if e.code == "alreadyExists" else None
                    if vm:
                        vms.append(vm)
                        errors.pop(node, None)
                    else:
                        errors[node] = e
            for node, op in started.items():
                what = f"launching {node} in {zone}"
                try:
                    self._wait(op, what, zone)
                    with _calls(what):
                        vms.append(self._vm(self.instances.get(
                            project=self.project, zone=zone, instance=gce_name(node)), zone))
                    errors.pop(node, None)
                except CapacityError as e:
                    errors[node] = e
                    next_zone.append(node)
                except CloudError as e:
                    errors[node] = e
            waiting = next_zone
            if not waiting:
                break
        if prepared.get("accounts"):
            role = self._self_delete_role()
            for vm in vms:
                if role and vm.node in prepared["accounts"]:
                    self._let_delete_itself(vm, prepared["accounts"][vm.node], role)
        return vms, errors

    def _make_accounts(self, spec: CloudSpec, nodes: list[str]) -> dict[str, str]:
        """The new nodes' service accounts (node → e-mail), made and bound on the cluster's
        storage with the cluster's other accounts; the accounts of the cluster's nodes that
        are gone (no instance, not being made now, none running as it) are removed first."""
        have = self._accounts(spec)
        found = self._instances(spec.cluster)
        live = {self._vm(i, z).node for z, i in found} | set(nodes)
        # an account a node runs as stays, though its own node is gone: a controller's
        # replacement carries an existing account as it is (controller_identity)
        used = {sa.email for _, inst in found for sa in inst.service_accounts}
        for email, a in list(have.items()):
            if _sa_field(a.get("description"), TAG_NODE) not in live and email not in used:
                self._delete_service_account(email)
                del have[email]
        made = {}
        for node in nodes:
            email, acct = self._node_account(spec, node)
            made[node] = email
            have[email] = acct
        self._set_bindings(spec, have)
        return made

    def _let_delete_itself(self, vm: VM, email: str, role: str) -> None:
        """Bind the node's own service account on its instance only, with the custom role
        ``hyperNodeSelfDelete`` (instance-level IAM policy): the node's idle watchdog deletes
        its own instance with it. Best effort: refused, a warning (the node powers off when
        idle instead)."""
        policy = compute_v1.Policy(bindings=[compute_v1.Binding(
            role=role, members=[f"serviceAccount:{email}"])])
        try:
            with _calls(f"letting {vm.id} delete itself (compute.instances.setIamPolicy)"):
                self.instances.set_iam_policy(
                    project=self.project, zone=vm.zone, resource=vm.id,
                    zone_set_policy_request_resource=compute_v1.ZoneSetPolicyRequest(
                        policy=policy))
        except CredentialsError as e:
            log.warning("%s cannot delete itself when idle (%s); it powers off instead",
                        vm.id, e)

    def host_key(self, vm: VM) -> str | None:
        """The SSH host key (``ssh-ed25519 AAAA...``) the node made itself and published in
        its guest attributes (``hostkeys/ssh-ed25519``, module docstring), or None while it
        has published none. Raises CredentialsError, CloudError."""
        try:
            with _calls(f"reading the guest attributes of {vm.id}"):
                got = self.instances.get_guest_attributes(request={
                    "project": self.project, "zone": vm.zone, "instance": vm.id,
                    "query_path": "hostkeys/"})
        except CloudError as e:
            if e.code == NOT_FOUND:
                return None
            raise
        for item in (got.query_value.items if got.query_value else []):
            if item.namespace == "hostkeys" and item.key == "ssh-ed25519" and item.value:
                parts = item.value.split()
                return " ".join(parts[:2]) if parts[0].startswith("ssh-") else \
                    f"ssh-ed25519 {parts[0]}"
        return None

    def _adopt(self, spec: CloudSpec, node: str, zone: str) -> VM | None:
        """The instance of ``node`` that already exists in ``zone`` when it is this
        cluster's (a create repeated after a partial failure), else None."""
        try:
            with _calls(f"reading {node}"):
                inst = self.instances.get(project=self.project, zone=zone,
                                          instance=gce_name(node))
        except CloudError:
            return None
        return self._vm(inst, zone) if _metadata(inst, "hyper-cluster") == spec.cluster \
            else None

    def _insert(self, spec: CloudSpec, node: str, zone: str, image: str, boot: Boot,
                prepared: dict):
        """Send one instance insert; returns its (not yet DONE) zone operation."""
        if spec.spot:
            scheduling = compute_v1.Scheduling(
                provisioning_model="SPOT", instance_termination_action="DELETE",
                automatic_restart=False, on_host_maintenance="TERMINATE")
        else:  # GPUs cannot live-migrate
            scheduling = compute_v1.Scheduling(
                provisioning_model="STANDARD", automatic_restart=True,
                on_host_maintenance="TERMINATE" if spec.variant == "gpu" else "MIGRATE")
        doc = boot.user_data[node]
        meta = {"ssh-keys": f"{boot.ssh_user}:{boot.ssh_public_key}",
                "user-data" if doc.lstrip().startswith(CLOUD_INIT_STARTS)
                else "startup-script": doc,
                "enable-guest-attributes": "TRUE",
                "hyper-cluster": spec.cluster, "hyper-node": node}
        account = (prepared.get("accounts") or {}).get(node) or prepared.get("service_account")
        if not account:
            raise CloudError(f"launching {node}: no service account for it")
        labels = self._labels(spec.cluster, node)
        inst = compute_v1.Instance(
            name=gce_name(node), machine_type=f"zones/{zone}/machineTypes/{spec.instance_type}",
            labels=labels, tags=compute_v1.Tags(items=[prepared["network_tag"]]),
            disks=[compute_v1.AttachedDisk(
                boot=True, auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=image, disk_size_gb=spec.disk_gb, labels=labels))],
            network_interfaces=[compute_v1.NetworkInterface(
                network="global/networks/default",
                access_configs=[compute_v1.AccessConfig(name="External NAT",
                                                        type_="ONE_TO_ONE_NAT")])],
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v)
                                                for k, v in meta.items()]),
            service_accounts=[compute_v1.ServiceAccount(
                email=account, scopes=prepared.get("scopes", SCOPES + [STORAGE_SCOPE]))],
            scheduling=scheduling)
        deadline = time.monotonic() + ACCOUNT_WAIT
        while True:
            try:
                with _calls(f"launching {node} in {zone}"):
                    return self.instances.insert_unary(project=self.project, zone=zone,
                                                       instance_resource=inst)
            except CloudError as e:  # a new account Compute Engine does not know yet
                if not ("serviceAccounts" in str(e) and "not found" in str(e)
                        and time.monotonic() < deadline):
                    raise
                time.sleep(2.0)

    def _vm(self, inst, zone: str, preempted: set | None = None) -> VM:
        state = STATES.get(inst.status, "pending")
        spot = bool(inst.scheduling) and inst.scheduling.provisioning_model == "SPOT"
        if spot and preempted and inst.id in preempted:
            state = "preempted"
        nic = inst.network_interfaces[0] if inst.network_interfaces else None
        public = nic.access_configs[0].nat_i_p if nic and nic.access_configs else None
        return VM(id=inst.name, node=_metadata(inst, "hyper-node") or inst.name,
                  zone=zone, state=state, public_ip=public or None,
                  private_ip=(nic.network_i_p or None) if nic else None,
                  instance_type=_last(inst.machine_type), spot=spot,
                  extra={"instance_id": str(inst.id), "created": inst.creation_timestamp,
                         "status": inst.status})

    def _filter(self, cluster: str | None) -> str:
        key = label_key(TAG_CLUSTER)
        return f'labels.{key} = "{label_value(cluster)}"' if cluster else f"labels.{key}:*"

    def _instances(self, cluster: str | None) -> list[tuple[str, object]]:
        """(zone, instance) of the cluster's instances (of every cluster when None)."""
        out = []
        with _calls("listing instances"):
            for scope, listing in self.instances.aggregated_list(
                    request={"project": self.project, "filter": self._filter(cluster)}):
                for inst in listing.instances:
                    if cluster is None or _metadata(inst, "hyper-cluster") in (None, cluster):
                        out.append((_last(scope), inst))
        return out

    def _preempted(self, found: list[tuple[str, object]]) -> set[int]:
        """Ids of the SPOT instances among ``found`` that are STOPPING or TERMINATED and
        that a ``compute.instances.preempted`` operation of their zone names."""
        stopped = [(z, i) for z, i in found if i.status in ("STOPPING", "TERMINATED")
                   and i.scheduling and i.scheduling.provisioning_model == "SPOT"]
        out: set[int] = set()
        ops = self._client(compute_v1.ZoneOperationsClient) if stopped else None
        for zone in sorted({z for z, _ in stopped}):
            with _calls(f"listing preemptions in {zone}"):
                for op in ops.list(request={"project": self.project, "zone": zone,
                                            "filter": f'operationType = "{PREEMPTED_OP}"'}):
                    out.add(op.target_id)
        return {i.id for _, i in stopped if i.id in out}

    def describe(self, cluster: str) -> list[VM]:
        """The cluster's instances, any state (preemption rule: module docstring).
        Raises CredentialsError, CloudError."""
        found = self._instances(cluster)
        preempted = self._preempted(found)
        return [self._vm(i, z, preempted) for z, i in found]

    def terminate(self, cluster: str, ids: list[str]) -> None:
        """Delete the instances named ``ids`` (instance names) without waiting; one already
        gone is skipped. Raises CredentialsError, CloudError."""
        zones = {vm.id: vm.zone for vm in self.describe(cluster)}
        for i in ids:
            if i in zones:
                self._gone(lambda: self.instances.delete_unary(
                    project=self.project, zone=zones[i], instance=i), f"deleting {i}")

    def resources(self, cluster: str | None = None) -> list[Resource]:
        """Instances and disks labelled ``hyper-cluster`` (= ``cluster``), and firewall rules
        whose description says ``hyper:cluster=`` (or named like the cluster's rules,
        :func:`firewall_names`; a ``hyper-*`` rule without that description is listed with
        cluster None), and the cluster's service accounts (description ``hyper:cluster=``),
        in deletion order. Raises CredentialsError, CloudError."""
        key = label_key(TAG_CLUSTER)
        accounts = self._account_list()
        out = [Resource("instance", i.name, c, z)
               for z, i, c in self._owned_instances(cluster, accounts)]
        with _calls("listing disks"):
            for scope, listing in self._client(compute_v1.DisksClient).aggregated_list(
                    request={"project": self.project, "filter": self._filter(cluster)}):
                out += [Resource("disk", d.name, cluster or d.labels.get(key), _last(scope))
                        for d in listing.disks]
        mine = firewall_names(cluster) if cluster else ()
        with _calls("listing firewall rules"):
            for f in self._client(compute_v1.FirewallsClient).list(project=self.project):
                m = re.match(rf"{re.escape(TAG_CLUSTER)}=(\S+)", f.description or "")
                owner_ = m[1] if m else None
                if cluster is None and (owner_ or f.name.startswith("hyper-")):
                    out.append(Resource("firewall", f.name, owner_, "global"))
                elif cluster is not None and (owner_ == cluster or
                                              (owner_ is None and f.name in mine)):
                    out.append(Resource("firewall", f.name, cluster, "global"))
        return out + self._service_accounts(cluster, accounts)

    def _owned_instances(self, cluster: str | None, accounts: list[dict]) -> list[tuple]:
        """(zone, instance, cluster) of the instances of ``cluster`` (every hyper cluster
        when None) for ``down`` and ``gc``: those labelled for it, and those running as one of
        its nodes' accounts whose name starts like its nodes' (a node cannot change either on
        itself, so one that removed its labels is still found)."""
        key = label_key(TAG_CLUSTER)
        owner_of = {a["email"]: _sa_field(a.get("description"), TAG_CLUSTER)
                    for a in accounts if (a.get("description") or "").startswith(
                        f"{TAG_CLUSTER}=")}
        out = []
        with _calls("listing instances"):
            for scope, listing in self.instances.aggregated_list(
                    request={"project": self.project}):
                for inst in listing.instances:
                    by_account = next((owner_of[sa.email] for sa in inst.service_accounts
                                       if sa.email in owner_of), None)
                    if by_account and not inst.name.startswith(gce_name(by_account) + "-"):
                        by_account = None
                    labelled = None
                    if inst.labels.get(key):
                        labelled = _metadata(inst, "hyper-cluster") or inst.labels[key]
                    if cluster is None:
                        c = by_account or labelled
                    elif by_account == cluster or (
                            by_account is None and inst.labels.get(key) == label_value(cluster)
                            and _metadata(inst, "hyper-cluster") in (None, cluster)):
                        c = cluster
                    else:
                        c = None
                    if c:
                        out.append((_last(scope), inst, c))
        return out

    def _gone(self, call, what: str):
        """Run a delete; returns its operation, or None when the resource is already gone
        (or, for a disk, still in use by an instance being deleted: the next round takes
        it)."""
        try:
            with _calls(what):
                return call()
        except CloudError as e:
            if e.code in (NOT_FOUND, IN_USE):
                return None
            raise

    def delete(self, resources: list[Resource]) -> list[str]:
        """Delete instances (all at once, then waiting for each), then disks, then firewall
        rules, then service accounts (unbound from their buckets first); kinds not made here
        are skipped. Returns ``"<kind> <id>"`` per resource
        removed. Raises CredentialsError, CloudError."""
        calls = {
            "instance": lambda r: self.instances.delete_unary(
                project=self.project, zone=r.region, instance=r.id),
            "disk": lambda r: self._client(compute_v1.DisksClient).delete_unary(
                project=self.project, zone=r.region, disk=r.id),
            "firewall": lambda r: self._client(compute_v1.FirewallsClient).delete_unary(
                project=self.project, firewall=r.id),
        }
        removed = []
        for kind, call in calls.items():
            ops = []
            for r in resources:
                if r.kind == kind:
                    op = self._gone(lambda: call(r), f"deleting {kind} {r.id}")
                    if op is not None:
                        ops.append((r, op))
            for r, op in ops:
                try:
                    self._wait(op, f"deleting {kind} {r.id}",
                               r.region if kind != "firewall" else None)
                except CloudError as e:
                    if e.code != "RESOURCE_NOT_FOUND":
                        raise
                removed.append(f"{kind} {r.id}")
        for r in resources:
            if r.kind == "service_account":
                self._delete_service_account(r.id)
                removed.append(f"service_account {r.id}")
        return removed

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        """Always ``{}``: the Compute API has no prices (the Cloud Billing Catalog API,
        cloudbilling.googleapis.com, is another service)."""
        return {}

    def find_image(self, spec: CloudSpec) -> str:
        """``spec.image`` when it is a link (``projects/P/global/images/NAME``, ``.../family/F``
        or a URL); an image name or family of the project (its link); else the newest image
        (``creationTimestamp``) labelled ``hyper-image=node``, ``hyper-variant=<variant>``
        that is READY and not deprecated.

        Raises:
            UsageError: no such image, or no baked image (how to bake one).
            CredentialsError, CloudError.
        """
        images = self._client(compute_v1.ImagesClient)
        if spec.image:
            if "/" in spec.image:
                return spec.image
            for how, call in (("image", lambda: images.get(
                                  project=self.project, image=spec.image)),
                              ("image family", lambda: images.get_from_family(
                                  project=self.project, family=spec.image))):
                try:
                    with _calls(f"finding the {how} {spec.image}"):
                        return call().self_link
                except CloudError as e:
                    if e.code != NOT_FOUND:
                        raise
            raise UsageError(f"no image or image family {spec.image} in project "
                             f"{self.project}",
                             "set cluster.image to an image name, family or link "
                             "(projects/P/global/images/NAME)")
        flt = (f'(labels.{label_key(TAG_IMAGE)} = "node") AND '
               f'(labels.{label_key(TAG_VARIANT)} = "{label_value(spec.variant)}")')
        with _calls("finding the baked image"):
            found = [i for i in images.list(request={"project": self.project, "filter": flt})
                     if i.status in ("", "READY") and i.deprecated.state in ("", "ACTIVE")]
        if not found:
            raise UsageError(f"no baked hypercli {spec.variant} image in project "
                             f"{self.project}",
                             "bake one: hyper image build --provider gcp "
                             "(or set image: projects/P/global/images/NAME)")
        return max(found, key=lambda i: _when(i.creation_timestamp)).self_link
