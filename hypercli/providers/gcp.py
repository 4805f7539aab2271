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
  instance and labelled like it, the project's default service account with the compute scope
  (the node watcher deletes its own idle instance with it) or, when the recipe uses ``gs://``
  storage, the cluster's storage service account (below), and metadata ``ssh-keys`` =
  ``<ssh_user>:<public key>`` plus the boot document: a cloud-config (text starting
  ``#cloud-config``, what :mod:`hypercli.providers.cloud_provider` makes) goes to
  ``user-data``, which cloud-init reads on GCE; a shell script goes to ``startup-script``,
  which the guest agent runs as root at every boot.

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

Storage identity: when the recipe's ``storage`` / ``mounts`` name ``gs://`` buckets
(``spec.grants``), :meth:`GCPAPI.identity` makes a service account ``hyper-<cluster>`` (its
description carries ``hyper:cluster=<cluster>``; IAM service accounts take no labels) and binds
it on each of those buckets only (``buckets.setIamPolicy``, policy ``version: 3``):
``roles/storage.objectViewer`` for a read grant, ``roles/storage.objectUser`` for a read/write
one, each with an IAM Condition titled ``hyper-<cluster>`` that limits it to the grant's prefix
(``resource.name.startsWith("projects/_/buckets/B/objects/PREFIX/")``, or the bucket itself
when its object listing asks for that prefix, ``storage.googleapis.com/objectListPrefix``);
a whole-bucket grant has no condition. Conditions need uniform bucket-level access on the
bucket. Bindings are only added (a later recipe on the cluster may need more; nothing a
running task uses is taken away); :meth:`GCPAPI.delete` of the service account removes its
bindings from every bucket it was bound on (kept in the account's description) and then the
account. The nodes run as that account with the scopes ``compute`` and
``devstorage.read_write``; the bucket bindings, not the scope, decide what they may touch.
The account's only Compute permission is ``roles/compute.instanceAdmin.v1`` on each of the
cluster's own instances (instance-level IAM policy, set after the insert), which the node's
idle watchdog uses to delete its own instance.
With ``cluster.service_account`` set nothing is made or bound: the nodes run as that account
(it must already be allowed the buckets; the caller needs ``iam.serviceAccounts.actAs`` on
it). With no ``gs://`` grant the nodes keep the project's default service account, compute
scope only. A caller refused ``iam.serviceAccounts.create`` or
``storage.buckets.setIamPolicy`` gets a :class:`CredentialsError` naming that permission and
``cluster.service_account``, before any instance is made.

Credentials: Google application default credentials (``google.auth.default()``); the project is
the ``project`` argument, else the credentials' project, else ``GOOGLE_CLOUD_PROJECT``.
Test seam: ``HYPER_GCP_ENDPOINT`` (``http://127.0.0.1:PORT``) is given to every client as its
``api_endpoint`` (the REST transport keeps an ``http://`` scheme); with it set and no
``credentials`` passed, anonymous credentials are used (a local stand-in needs none).
"""

from __future__ import annotations

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
                                      CredentialsError, QuotaError, Resource, label_key, owner)

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
#: the cluster service account's role on each of its own instances (idle self-deletion)
INSTANCE_ROLE = "roles/compute.instanceAdmin.v1"
#: what making a cluster's service account asks of the caller, project-wide
IDENTITY_PERMISSIONS = ("iam.serviceAccounts.create", "iam.serviceAccounts.actAs")
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


def _sa_description(cluster: str, buckets: list[str]) -> str:
    """A cluster service account's description: its cluster and the buckets it is bound on
    (what :meth:`GCPAPI.delete` unbinds). At most 256 characters, the API's limit."""
    return f"{TAG_CLUSTER}={cluster} buckets={','.join(buckets)}"[:256]


def _sa_buckets(description: str) -> list[str]:
    m = re.search(r"buckets=(\S*)", description or "")
    return [b for b in (m[1].split(",") if m else []) if b]


def _cel(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def bucket_bindings(bucket: str, grants: list, cluster: str) -> list[dict]:
    """The IAM bindings (without members) that give one bucket's ``grants``
    (:class:`hypercli.recipe.access.Grant`, all of ``bucket``): ``roles/storage.objectViewer``
    per read grant, ``roles/storage.objectUser`` per read/write grant; a grant with a prefix
    gets a condition titled ``hyper-<cluster>`` allowing the objects under ``prefix/`` and
    listing the bucket with that prefix (module docstring)."""
    out = []
    for g in sorted(grants):
        b = {"role": WRITE_ROLE if g.write else READ_ROLE}
        if g.prefix:
            p = g.prefix + "/"
            b["condition"] = {
                "title": gce_name(f"hyper-{cluster}"),
                "description": f"{'read/write' if g.write else 'read'} gs://{bucket}/{p}",
                "expression": (
                    f"resource.name.startsWith({_cel(f'projects/_/buckets/{bucket}/objects/{p}')})"
                    f" || (resource.name == {_cel(f'projects/_/buckets/{bucket}')} && "
                    f"api.getAttribute(\"storage.googleapis.com/objectListPrefix\", \"\")"
                    f".startsWith({_cel(p)}))")}
        out.append(b)
    return out


class GCPAPI:
    """Compute Engine in one project and region (see the module docstring).

    Args:
        project: project id, or None for the credentials' project / ``GOOGLE_CLOUD_PROJECT``.
        region: e.g. ``us-central1`` (may be empty when every spec names its zones).
        credentials: google-auth credentials (default: application default credentials).
    """

    name = "gcp"

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
        return (f"storage identities: missing {', '.join(missing)}, so recipes with gs:// "
                "buckets need cluster.service_account")

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        """Make (or find, or correct) the cluster's two firewall rules (module docstring):
        ``hyper-<cluster>-ssh`` (TCP 22 from ``spec.ssh_cidr``) and ``hyper-<cluster>-internal``
        (every protocol from the tag ``hyper-<cluster>``), both to instances with the tag
        ``hyper-<cluster>``; waits for their global operations.

        Returns:
            ``{"firewall": SSH rule name, "internal_firewall": internal rule name,
            "network_tag": tag, "service_account", "scopes"}`` (the last two from
            :meth:`identity`, made first: a caller who may not make it gets its
            CredentialsError before anything else exists) for :meth:`create`.
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

    def service_account_email(self, cluster: str) -> str:
        """The e-mail of the cluster's own service account: ``hyper-<cluster>`` made a valid
        account id (6 to 30 characters) ``@<project>.iam.gserviceaccount.com``."""
        sid = gce_name(f"hyper-{cluster}")[:30].rstrip("-")
        return f"{sid.ljust(6, '0')}@{self.project}.iam.gserviceaccount.com"

    def _denied(self, e: CloudError, permission: str, where: str) -> None:
        if e.code == "forbidden":
            raise CredentialsError(
                f"the caller may not {where} (permission {permission} is missing)",
                f"grant it to the caller (e.g. roles/iam.serviceAccountAdmin, "
                f"roles/storage.admin on the bucket), {IDENTITY_HINT}") from None

    def identity(self, spec: CloudSpec) -> dict:
        """Make or update, idempotently, the cluster's storage identity (module docstring,
        "Storage identity"): the service account ``hyper-<cluster>`` bound on exactly the
        ``gs`` buckets of ``spec.grants``, each binding limited to its grant's prefix.

        Returns:
            ``{"service_account": e-mail or "default", "scopes": [scope URLs]}`` for the
            instances, and ``"own_account": True`` when the account is the cluster's own
            (:meth:`create` then binds it on each new instance, so that the node's idle
            watchdog may delete its own instance).
        Raises:
            CredentialsError: the caller may not create the service account
                (``iam.serviceAccounts.create``) or set a bucket's IAM policy
                (``storage.buckets.setIamPolicy``); the message names the permission and
                ``cluster.service_account``.
            CloudError: other API failures (e.g. a bucket that does not exist).
        """
        grants = [g for g in spec.grants if g.scheme == "gs"]
        if spec.identity:
            return {"service_account": spec.identity, "scopes": SCOPES + [STORAGE_SCOPE]}
        if not grants:
            return {"service_account": "default", "scopes": SCOPES}
        buckets = sorted({g.bucket for g in grants})
        email = self._service_account(spec.cluster, buckets)
        for bucket in buckets:
            self._bind(bucket, f"serviceAccount:{email}", spec.cluster,
                       [g for g in grants if g.bucket == bucket])
        return {"service_account": email, "scopes": SCOPES + [STORAGE_SCOPE],
                "own_account": True}

    def _sa_url(self, email: str = "") -> str:
        url = f"{self._base(IAM_URL)}/v1/projects/{self.project}/serviceAccounts"
        return f"{url}/{email}" if email else url

    def _service_account(self, cluster: str, buckets: list[str]) -> str:
        """Create (or find) the cluster's service account; its description lists the
        buckets it is bound on (merged with those already listed). Returns its e-mail."""
        email = self.service_account_email(cluster)
        try:
            found = self._rest("GET", self._sa_url(email), f"reading {email}")
        except CloudError as e:
            if e.code not in (NOT_FOUND, "forbidden"):
                raise
            found = None
        if found is not None:
            known = _sa_buckets(found.get("description", ""))
            if set(buckets) <= set(known):
                return email
            try:
                self._rest("PATCH", self._sa_url(email), f"updating {email}", {
                    "serviceAccount": {"description": _sa_description(
                        cluster, sorted(set(known) | set(buckets)))},
                    "updateMask": "description"})
            except CloudError as e:
                self._denied(e, "iam.serviceAccounts.update",
                             f"update the service account {email}")
                raise
            return email
        try:
            self._rest("POST", self._sa_url(), f"creating the service account {email}", {
                "accountId": email.split("@")[0],
                "serviceAccount": {"displayName": f"hypercli cluster {cluster}"[:100],
                                   "description": _sa_description(cluster, buckets)}})
        except CloudError as e:
            self._denied(e, "iam.serviceAccounts.create",
                         f"create the service account {email}")
            if e.code != "alreadyExists":
                raise
        return email

    def _policy_url(self, bucket: str) -> str:
        return f"{self._base(STORAGE_URL)}/storage/v1/b/{bucket}/iam"

    def _bind(self, bucket: str, member: str, cluster: str, grants: list) -> None:
        """Add ``member``'s bindings for ``grants`` (of one bucket) to its IAM policy
        (version 3, read-modify-write with the policy's etag); nothing is sent when every
        binding is there already."""
        for attempt in range(3):  # 412: someone else changed the policy in between
            try:
                return self._bind_once(bucket, member, cluster, grants)
            except CloudError as e:
                if e.code != "412" or attempt == 2:
                    raise

    def _bind_once(self, bucket: str, member: str, cluster: str, grants: list) -> None:
        what = f"setting the IAM policy of bucket {bucket}"
        try:
            policy = self._rest("GET", self._policy_url(bucket) +
                                "?optionsRequestedPolicyVersion=3",
                                f"reading the IAM policy of bucket {bucket}")
            bindings = policy.setdefault("bindings", [])
            changed = False
            for want in bucket_bindings(bucket, grants, cluster):
                same = [b for b in bindings if b.get("role") == want["role"]
                        and b.get("condition") == want.get("condition")]
                if same and member in same[0].get("members", []):
                    continue
                changed = True
                if same:
                    same[0].setdefault("members", []).append(member)
                else:
                    bindings.append(dict(want, members=[member]))
            if changed:
                policy["version"] = 3
                self._rest("PUT", self._policy_url(bucket), what, policy)
        except CloudError as e:
            self._denied(e, "storage.buckets.setIamPolicy",
                         f"set the IAM policy of bucket {bucket}")
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
        """Unbind a cluster's service account from the buckets its description lists, then
        delete it (one already gone is skipped)."""
        try:
            found = self._rest("GET", self._sa_url(email), f"reading {email}")
        except CloudError as e:
            if e.code == NOT_FOUND:
                return
            raise
        for bucket in _sa_buckets(found.get("description", "")):
            self._unbind(bucket, f"serviceAccount:{email}")
        try:
            self._rest("DELETE", self._sa_url(email), f"deleting {email}")
        except CloudError as e:
            if e.code != NOT_FOUND:
                raise

    def _service_accounts(self, cluster: str | None) -> list[Resource]:
        """The service accounts whose description says ``hyper:cluster=`` (= ``cluster``);
        none, with a warning, when the caller may not list service accounts (a caller who
        named ``cluster.service_account`` may lack that, and has none to remove)."""
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
            for a in page.get("accounts", []):
                m = re.match(rf"{re.escape(TAG_CLUSTER)}=(\S+)", a.get("description") or "")
                if m and (cluster is None or m[1] == cluster):
                    out.append(Resource("service_account", a["email"], m[1], "global"))
            token = page.get("nextPageToken")
            if not token:
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
        if prepared.get("own_account"):
            for vm in vms:
                self._let_delete_itself(vm, prepared["service_account"])
        return vms, errors

    def _let_delete_itself(self, vm: VM, email: str) -> None:
        """Bind the cluster's service account on one instance only
        (``roles/compute.instanceAdmin.v1``, instance-level IAM policy): the node's idle
        watchdog deletes its own instance with it; the account has no other Compute
        permission. Raises CredentialsError (``compute.instances.setIamPolicy``), CloudError."""
        policy = compute_v1.Policy(bindings=[compute_v1.Binding(
            role=INSTANCE_ROLE, members=[f"serviceAccount:{email}"])])
        with _calls(f"letting {vm.id} delete itself (compute.instances.setIamPolicy)"):
            self.instances.set_iam_policy(
                project=self.project, zone=vm.zone, resource=vm.id,
                zone_set_policy_request_resource=compute_v1.ZoneSetPolicyRequest(
                    policy=policy))

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
                "hyper-cluster": spec.cluster, "hyper-node": node}
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
                email=prepared.get("service_account", "default"),
                scopes=prepared.get("scopes", SCOPES))],
            scheduling=scheduling)
        with _calls(f"launching {node} in {zone}"):
            return self.instances.insert_unary(project=self.project, zone=zone,
                                               instance_resource=inst)

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
        out = [Resource("instance", i.name, _metadata(i, "hyper-cluster") or
                        i.labels.get(key), z) for z, i in self._instances(cluster)]
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
        return out + self._service_accounts(cluster)

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
