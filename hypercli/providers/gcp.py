"""Google Compute Engine through google-cloud-compute: the CloudAPI of provider ``gcp``.

What a cluster gets:

* a firewall rule ``hyper-<cluster>-ssh`` on the ``default`` network: TCP 22 from
  ``ssh_cidr`` to instances with the network tag ``hyper-<cluster>`` (firewall rules take no
  labels: the rule's description carries ``hyper:cluster=<cluster>`` for ``hyper gc``);
* per node one instance named after the node (made a valid GCE name), SPOT with
  ``instanceTerminationAction: DELETE`` (or STANDARD), labels ``hyper-cluster``,
  ``hyper-node``, ``hyper-owner`` (label values made valid: lower case, ``[a-z0-9_-]``; the
  exact names are kept in metadata ``hyper-cluster``/``hyper-node``), metadata ``ssh-keys``
  and ``user-data`` (the cloud-config, which cloud-init reads from GCE metadata), a boot disk of
  ``disk_gb`` GiB deleted with the instance, an ephemeral external IP; zones are tried in
  ``zones`` order (default: every zone of the region) while the insert operation ends in
  ``ZONE_RESOURCE_POOL_EXHAUSTED``; the project's default service account with the compute
  scope, with which the node watcher deletes its own idle instance.

Every insert and delete waits for its zone or global operation (``operations.wait``).
A spot instance is reported ``preempted`` when it is TERMINATED (GCE deletes preempted
instances with the DELETE action, so usually it is simply gone). The Compute API has no prices:
:meth:`spot_price` returns nothing (the Cloud Billing Catalog is another API).

Credentials: Google application default credentials. Test seam: ``HYPER_GCP_ENDPOINT``
(``http://127.0.0.1:PORT``) sends every call there with anonymous credentials.
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager

from google.api_core import exceptions as gexc
from google.auth import exceptions as auth_exc
from google.cloud import compute_v1

from hypercli.errors import UsageError
from hypercli.providers.cloud import (TAG_CLUSTER, TAG_IMAGE, TAG_NODE, TAG_OWNER, TAG_VARIANT,
                                      VM, Boot, CapacityError, CloudError, CloudSpec,
                                      CredentialsError, QuotaError, Resource, label_key, owner)

CREDENTIALS_HINT = ("run `gcloud auth application-default login`, or set "
                    "GOOGLE_APPLICATION_CREDENTIALS to a service-account key file")
CAPACITY_CODES = {"ZONE_RESOURCE_POOL_EXHAUSTED", "ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                  "RESOURCE_POOL_EXHAUSTED", "UNSUPPORTED_OPERATION"}
QUOTA_CODES = {"QUOTA_EXCEEDED", "QUOTA_LIMIT"}
STATES = {"PROVISIONING": "pending", "STAGING": "pending", "RUNNING": "running",
          "STOPPING": "stopping", "SUSPENDING": "stopping", "SUSPENDED": "stopping",
          "REPAIRING": "stopping", "TERMINATED": "terminated"}
OP_TIMEOUT = 600.0  # s an operation may take


def gce_name(text: str) -> str:
    """A valid GCE resource name (``[a-z]([-a-z0-9]{0,61}[a-z0-9])?``) for ``text``."""
    s = re.sub(r"[^a-z0-9-]", "-", text.lower()).strip("-") or "x"
    if not s[0].isalpha():
        s = "h-" + s
    return s[:63].rstrip("-")


def label_value(text: str) -> str:
    """A valid label value (``[a-z0-9_-]{0,63}``) for ``text``."""
    return re.sub(r"[^a-z0-9_-]", "-", text.lower())[:63]


@contextmanager
def _calls(what: str):
    """Turn google-api-core's and google-auth's errors into hypercli's."""
    try:
        yield
    except (auth_exc.DefaultCredentialsError, auth_exc.RefreshError) as e:
        raise CredentialsError(f"no usable Google credentials ({e})", CREDENTIALS_HINT) from None
    except gexc.Unauthorized as e:
        raise CredentialsError(f"Google refused the credentials ({e.message})",
                               CREDENTIALS_HINT) from None
    except gexc.Forbidden as e:
        reasons = {getattr(d, "reason", "") or "" for d in (e.details or [])}
        text = f"{e.message} {' '.join(reasons)}".lower()
        if "quota" in text:
            raise QuotaError(f"{what}: {e.message}", code="QUOTA_EXCEEDED") from None
        raise CredentialsError(f"{what}: permission denied ({e.message})",
                               "give the account the Compute Admin role, or " +
                               CREDENTIALS_HINT) from None
    except gexc.GoogleAPICallError as e:
        raise CloudError(f"{what}: {e.message}", code=str(e.code)) from None
    except gexc.GoogleAPIError as e:
        raise CloudError(f"{what}: {e}") from None


def _metadata(inst, key: str) -> str | None:
    for item in (inst.metadata.items if inst.metadata else []):
        if item.key == key:
            return item.value
    return None


class GCPAPI:
    """Compute Engine in one project and region (see the module docstring).

    Args:
        project: project id, or None for the credentials' project / GOOGLE_CLOUD_PROJECT.
        region: e.g. ``us-central1``.
        credentials: google-auth credentials (default: application default credentials).
    """

    name = "gcp"

    def __init__(self, project: str | None, region: str, credentials=None):
        self.region = region
        self.endpoint = os.environ.get("HYPER_GCP_ENDPOINT") or None
        self._credentials = credentials
        self._project = project
        self._local = threading.local()
        self._lock = threading.Lock()

    # -- plumbing ------------------------------------------------------------------------------
    def _creds(self):
        with self._lock:
            if self._credentials is None:
                if self.endpoint:
                    from google.auth.credentials import AnonymousCredentials
                    self._credentials = AnonymousCredentials()
                else:
                    import google.auth
                    with _calls("loading credentials"):
                        self._credentials, found = google.auth.default(
                            scopes=["https://www.googleapis.com/auth/compute"])
                    self._project = self._project or found
            return self._credentials

    @property
    def project(self) -> str:
        self._creds()
        p = self._project or os.environ.get("GOOGLE_CLOUD_PROJECT")
        if not p:
            raise CredentialsError("no Google Cloud project",
                                   "set cluster.project, or GOOGLE_CLOUD_PROJECT")
        return p

    def _client(self, cls):
        key = cls.__name__
        c = getattr(self._local, key, None)
        if c is None:
            opts = {"api_endpoint": self.endpoint} if self.endpoint else None
            c = cls(credentials=self._creds(), client_options=opts, transport="rest")
            setattr(self._local, key, c)
        return c

    def _wait(self, op, what: str, zone: str | None = None) -> None:
        """Wait for a zone (or global) operation to be DONE; raise its error."""
        deadline = time.monotonic() + OP_TIMEOUT
        ops = self._client(compute_v1.ZoneOperationsClient if zone
                           else compute_v1.GlobalOperationsClient)
        while op.status != compute_v1.Operation.Status.DONE:
            if time.monotonic() > deadline:
                raise CloudError(f"{what}: operation {op.name} not done after {OP_TIMEOUT:.0f} s")
            with _calls(what):
                op = ops.wait(project=self.project, zone=zone, operation=op.name) if zone \
                    else ops.wait(project=self.project, operation=op.name)
        errors = list(op.error.errors) if op.error else []
        if errors:
            code, msg = errors[0].code, errors[0].message
            cls = CapacityError if code in CAPACITY_CODES else \
                QuotaError if code in QUOTA_CODES else CloudError
            raise cls(f"{what}: {code}: {msg}", code=code)

    # -- the contract --------------------------------------------------------------------------
    def check(self) -> str:
        with _calls("checking the credentials"):
            zones = [z.name for z in self._client(compute_v1.ZonesClient).list(
                project=self.project)]
        mine = [z for z in zones if z.startswith(self.region + "-")] if self.region else zones
        return f"project {self.project}, region {self.region or '?'} ({len(mine)} zones)"

    def _zones(self, spec: CloudSpec) -> list[str]:
        if spec.zones:
            return list(spec.zones)
        if not self.region:
            raise UsageError("provider gcp needs cluster.region or cluster.zone",
                             "e.g. region: us-central1")
        with _calls("listing zones"):
            zones = sorted(z.name for z in self._client(compute_v1.ZonesClient).list(
                project=self.project) if z.name.startswith(self.region + "-"))
        if not zones:
            raise UsageError(f"region {self.region} has no zones in project {self.project}")
        return zones

    def prepare(self, spec: CloudSpec, ssh_public_key: str) -> dict:
        name = f"{gce_name('hyper-' + spec.cluster)}-ssh"
        fw = self._client(compute_v1.FirewallsClient)
        try:
            with _calls("reading the firewall rule"):
                fw.get(project=self.project, firewall=name)
        except CloudError as e:
            if e.code != "404":
                raise
            rule = compute_v1.Firewall(
                name=name, network="global/networks/default", direction="INGRESS",
                description=f"{TAG_CLUSTER}={spec.cluster} {TAG_OWNER}={owner()}: SSH",
                source_ranges=[spec.ssh_cidr],
                target_tags=[gce_name("hyper-" + spec.cluster)],
                allowed=[compute_v1.Allowed(I_p_protocol="tcp", ports=["22"])])
            with _calls("creating the firewall rule"):
                op = fw.insert_unary(project=self.project, firewall_resource=rule)
            self._wait(op, "creating the firewall rule")
        return {"firewall": name, "network_tag": gce_name("hyper-" + spec.cluster)}

    def _labels(self, cluster: str, node: str | None = None) -> dict:
        labels = {label_key(TAG_CLUSTER): label_value(cluster),
                  label_key(TAG_OWNER): label_value(owner())}
        if node:
            labels[label_key(TAG_NODE)] = label_value(node)
        return labels

    def create(self, spec: CloudSpec, nodes: list[str], boot: Boot,
               prepared: dict) -> tuple[list[VM], dict[str, Exception]]:
        image = self.find_image(spec)
        zones = self._zones(spec)
        vms, errors = [], {}
        for node in nodes:
            last: Exception | None = None
            for zone in zones:
                try:
                    vms.append(self._insert(spec, node, zone, image, boot, prepared))
                    last = None
                    break
                except CapacityError as e:
                    last = e
                except CloudError as e:
                    last = e
                    break
            if last is not None:
                errors[node] = last
        return vms, errors

    def _insert(self, spec: CloudSpec, node: str, zone: str, image: str, boot: Boot,
                prepared: dict) -> VM:
        scheduling = compute_v1.Scheduling(
            provisioning_model="SPOT", instance_termination_action="DELETE",
            automatic_restart=False, on_host_maintenance="TERMINATE") if spec.spot else \
            compute_v1.Scheduling(provisioning_model="STANDARD")
        meta = {"ssh-keys": f"{boot.ssh_user}:{boot.ssh_public_key}",
                "user-data": boot.user_data[node], "hyper-cluster": spec.cluster,
                "hyper-node": node}
        inst = compute_v1.Instance(
            name=gce_name(node), machine_type=f"zones/{zone}/machineTypes/{spec.instance_type}",
            labels=self._labels(spec.cluster, node),
            tags=compute_v1.Tags(items=[prepared["network_tag"]]),
            disks=[compute_v1.AttachedDisk(
                boot=True, auto_delete=True,
                initialize_params=compute_v1.AttachedDiskInitializeParams(
                    source_image=image, disk_size_gb=spec.disk_gb,
                    labels=self._labels(spec.cluster, node)))],
            network_interfaces=[compute_v1.NetworkInterface(
                network="global/networks/default",
                access_configs=[compute_v1.AccessConfig(name="External NAT",
                                                        type_="ONE_TO_ONE_NAT")])],
            metadata=compute_v1.Metadata(items=[compute_v1.Items(key=k, value=v)
                                                for k, v in meta.items()]),
            # the default service account, scope compute: the node watcher's idle watchdog
            # deletes its own instance with it
            service_accounts=[compute_v1.ServiceAccount(
                email="default", scopes=["https://www.googleapis.com/auth/compute"])],
            scheduling=scheduling)
        what = f"launching {node} in {zone}"
        with _calls(what):
            op = self._client(compute_v1.InstancesClient).insert_unary(
                project=self.project, zone=zone, instance_resource=inst)
        self._wait(op, what, zone)
        with _calls(what):
            got = self._client(compute_v1.InstancesClient).get(
                project=self.project, zone=zone, instance=gce_name(node))
        return self._vm(got, zone)

    def _vm(self, inst, zone: str) -> VM:
        state = STATES.get(inst.status, "pending")
        spot = inst.scheduling.provisioning_model == "SPOT" if inst.scheduling else False
        if state == "terminated" and spot:
            state = "preempted"
        nic = inst.network_interfaces[0] if inst.network_interfaces else None
        public = nic.access_configs[0].nat_i_p if nic and nic.access_configs else None
        return VM(id=inst.name, node=_metadata(inst, "hyper-node") or inst.name,
                  zone=zone, state=state, public_ip=public or None,
                  private_ip=(nic.network_i_p or None) if nic else None,
                  instance_type=inst.machine_type.rsplit("/", 1)[-1], spot=spot,
                  extra={"zone": zone})

    def _instances(self, cluster: str | None) -> list[tuple[str, object]]:
        key = label_key(TAG_CLUSTER)
        flt = f'labels.{key} = "{label_value(cluster)}"' if cluster else f"labels.{key}:*"
        out = []
        with _calls("listing instances"):
            for scope, listing in self._client(compute_v1.InstancesClient).aggregated_list(
                    request={"project": self.project, "filter": flt}):
                for inst in listing.instances:
                    if cluster is None or _metadata(inst, "hyper-cluster") in (None, cluster):
                        out.append((scope.rsplit("/", 1)[-1], inst))
        return out

    def describe(self, cluster: str) -> list[VM]:
        return [self._vm(i, z) for z, i in self._instances(cluster)]

    def terminate(self, cluster: str, ids: list[str]) -> None:
        zones = {vm.id: vm.zone for vm in self.describe(cluster)}
        for i in ids:
            if i in zones:
                with _calls(f"deleting {i}"):
                    self._client(compute_v1.InstancesClient).delete_unary(
                        project=self.project, zone=zones[i], instance=i)

    def resources(self, cluster: str | None = None) -> list[Resource]:
        out = [Resource("instance", i.name, _metadata(i, "hyper-cluster") or
                        i.labels.get(label_key(TAG_CLUSTER)), z)
               for z, i in self._instances(cluster)]
        key = label_key(TAG_CLUSTER)
        flt = f'labels.{key} = "{label_value(cluster)}"' if cluster else f"labels.{key}:*"
        with _calls("listing disks"):
            for scope, listing in self._client(compute_v1.DisksClient).aggregated_list(
                    request={"project": self.project, "filter": flt}):
                out += [Resource("disk", d.name, cluster or d.labels.get(key),
                                 scope.rsplit("/", 1)[-1]) for d in listing.disks]
        with _calls("listing firewall rules"):
            for f in self._client(compute_v1.FirewallsClient).list(project=self.project):
                m = re.match(rf"{re.escape(TAG_CLUSTER)}=(\S+) ", f.description or "")
                if m and (cluster is None or m[1] == cluster):
                    out.append(Resource("firewall", f.name, m[1], "global"))
        return out

    def delete(self, resources: list[Resource]) -> list[str]:
        removed = []
        order = {"instance": 0, "disk": 1, "firewall": 2}
        for r in sorted(resources, key=lambda r: order.get(r.kind, 3)):
            what = f"deleting {r.kind} {r.id}"
            try:
                with _calls(what):
                    if r.kind == "instance":
                        op = self._client(compute_v1.InstancesClient).delete_unary(
                            project=self.project, zone=r.region, instance=r.id)
                    elif r.kind == "disk":
                        op = self._client(compute_v1.DisksClient).delete_unary(
                            project=self.project, zone=r.region, disk=r.id)
                    elif r.kind == "firewall":
                        op = self._client(compute_v1.FirewallsClient).delete_unary(
                            project=self.project, firewall=r.id)
                    else:
                        continue
                self._wait(op, what, r.region if r.kind != "firewall" else None)
            except CloudError as e:
                if e.code != "404":
                    raise
                continue  # already gone
            removed.append(f"{r.kind} {r.id}")
        return removed

    def spot_price(self, spec: CloudSpec) -> dict[str, float]:
        return {}

    def find_image(self, spec: CloudSpec) -> str:
        images = self._client(compute_v1.ImagesClient)
        if spec.image:
            if "/" in spec.image:
                return spec.image  # a link: projects/P/global/images/NAME or a family link
            try:
                with _calls("finding the image"):
                    return images.get(project=self.project, image=spec.image).self_link
            except CloudError as e:
                if e.code == "404":
                    raise UsageError(f"image {spec.image} does not exist in project "
                                     f"{self.project}",
                                     "set cluster.image to an image name or link") from None
                raise
        flt = (f'labels.{label_key(TAG_IMAGE)} = "node" AND '
               f'labels.{label_key(TAG_VARIANT)} = "{spec.variant}"')
        with _calls("finding the baked image"):
            found = list(images.list(request={"project": self.project, "filter": flt}))
        if not found:
            raise UsageError(f"no baked hypercli {spec.variant} image in project "
                             f"{self.project}",
                             "bake one: hyper image build --provider gcp "
                             "(or set image: projects/P/global/images/NAME)")
        return max(found, key=lambda i: i.creation_timestamp).self_link
