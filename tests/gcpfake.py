"""A local stand-in for the Compute Engine REST API (v1) on 127.0.0.1, for the real
google-cloud-compute client (``HYPER_GCP_ENDPOINT``).

It keeps the project's instances and disks per zone, firewall rules, images and operations in
memory, and answers the real paths (``/compute/v1/projects/{p}/zones/{z}/instances``,
``.../operations/{op}[/wait]``, ``/global/firewalls[/{name}]``, ``/global/images[/family/{f}]``,
``/aggregated/{instances,disks}``, ``/regions/{r}``, ``/zones``; the machine types, accelerator
types and Cloud Billing Catalog SKUs of tests/cloudcatalog.py at
``/aggregated/{machineTypes,acceleratorTypes}`` and ``/v1/services/{id}/skus``) with the real JSON shapes:
camelCase fields, ``kind``, ``id`` (int64 as a string), ``selfLink``, full-URL references,
errors as ``{"error": {"code", "message", "status", "errors": [{"reason", ...}]}}``.

Operations are long-running like the real ones: an insert, patch, update or delete answers an
operation that is RUNNING, and it becomes DONE (and takes effect) once it has been asked about
``slow_ops`` + 1 times (GET or ``/wait``; a ``/wait`` that answers RUNNING is the real API's
two-minute wait running out), or on its own after ``op_seconds``. An inserted instance is
listed as PROVISIONING at once and RUNNING, with its external IP, when its operation is DONE;
a deleted one is STOPPING until then. Inserts are validated as the real API does for names,
labels, the machine type's zone and the scheduling fields (HTTP 400 ``invalid``).

Firewall rules are validated as the real API does (names, protocols, ports only for TCP, UDP
and SCTP, ranges, tags, sources allowed by direction; an INGRESS rule with no source admits
0.0.0.0/0), inserted, patched (merged) or updated (replaced); ``firewall_verdict`` says which
rule, if any, lets a packet from an address or another instance into an instance.

Guest attributes: ``publish(zone, name, namespace, key, value)`` is the guest writing one
(``PUT .../computeMetadata/v1/instance/guest-attributes/...`` on the VM);
``getGuestAttributes?queryPath=ns/`` answers them, 404 while there are none. ``setLabels`` and
``setMetadata`` change an instance's labels or metadata.

Principals (tests/gcpiamfake.py): a request with a principal's token (``tokens``) may make a
Compute Engine call only when its member holds the permission that call needs
(:meth:`ComputeFake.compute_permission`) on the instance (its instance-level policy) or in the
project's IAM policy, where a binding's IAM condition is evaluated for the resource's name
(``resource.name``, ``extract``, ``startsWith``); anything else it asks, of Compute Engine or
of another API, is refused (HTTP 403 ``forbidden``, ``Required 'compute.instances.delete'
permission for ...``, as Compute Engine answers); an instance insert naming a service
account the member may not act as (``iam.serviceAccounts.actAs`` on that account:
:meth:`IAMFake.may_act_as`) is refused 403 as Compute Engine refuses it; Resource Manager's
``testIamPermissions`` answers it the permissions it holds on the project.

Faults: ``fail(zone, fault)`` with ``exhausted`` / ``exhausted-details`` (the insert operation
ends in ZONE_RESOURCE_POOL_EXHAUSTED[_WITH_DETAILS], HTTP 503), ``quota`` (it ends in
QUOTA_EXCEEDED, 403) or ``quota-http`` (the insert itself is refused: 403 ``quotaExceeded``);
``auth_fail = True`` answers every call 401 with the real body; ``preempt(zone, name)``
and ``power_off(zone, name)`` stop an instance with or without a
``compute.instances.preempted`` operation. ``requests`` records (method, path, body).
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import re
import socket
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, unquote, urlparse

import cloudcatalog
from gcpiamfake import IAMFake, cel_on_name

BASE = "/compute/v1/projects/"
LINK = "https://www.googleapis.com/compute/v1/projects/"
NAME_RE = r"[a-z](?:[-a-z0-9]{0,61}[a-z0-9])?"
LABEL_KEY_RE, LABEL_VALUE_RE = r"[a-z][a-z0-9_-]{0,62}", r"[a-z0-9_-]{0,63}"
PREEMPTED = "compute.instances.preempted"
FAULTS = ("exhausted", "exhausted-details", "quota", "quota-http")
#: firewall rule protocols by name (any other must be an IP protocol number)
PROTOCOLS = ("tcp", "udp", "icmp", "esp", "ah", "sctp", "ipip", "all")
STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED",
          404: "NOT_FOUND", 409: "ALREADY_EXISTS"}


def _now() -> str:
    return datetime.now(timezone.utc).astimezone().isoformat(timespec="milliseconds")


def _field(obj: dict, path: str):
    for part in path.split("."):
        obj = obj.get(part) if isinstance(obj, dict) else None
    return obj


def _covers(entry: dict, protocol: str, port: int | None) -> bool:
    """Whether a firewall rule's ``allowed``/``denied`` entry covers a protocol and port."""
    proto = str(entry.get("IPProtocol", "")).lower()
    if proto != "all" and proto != protocol.lower():
        return False
    ranges = [tuple(int(x) for x in (p.split("-") * 2)[:2]) for p in entry.get("ports") or []]
    return not ranges or (port is not None and any(a <= port <= b for a, b in ranges))


def matches(obj: dict, flt: str | None) -> bool:
    """The API's list ``filter``: ``field = "v"`` / ``field != "v"`` / ``field:*`` terms on
    (dotted) fields, each optionally in parentheses, joined by ``AND`` or spaces.

    Raises:
        ValueError: anything else in the filter (answered 400 like the real API).
    """
    if not flt:
        return True
    term = r'\(?\s*([\w.-]+)\s*(=|!=|:)\s*("[^"]*"|\*|[\w.-]+)\s*\)?'
    if re.sub(term, "", flt).replace("AND", "").strip():
        raise ValueError(f"filter not understood: {flt!r}")
    for name, op, value in re.findall(term, flt):
        got = _field(obj, name)
        want = value.strip('"')
        if op == ":" and (got is None if want == "*" else want not in str(got)):
            return False
        if op == "=" and str(got) != want:
            return False
        if op == "!=" and str(got) == want:
            return False
    return True


class ComputeFake(IAMFake):
    """See the module docstring. ``url`` is the endpoint; ``close()`` stops it.

    Args:
        project: the one project it serves.
        zones: zones of the region ``<zones[0] minus its suffix>``, in the API's order.
    """

    def __init__(self, project: str = "proj", zones=("us-central1-a", "us-central1-b",
                                                      "us-central1-c")):
        self.project = project
        self.zones = list(zones)
        self.region = self.zones[0].rsplit("-", 1)[0]
        self.instances: dict[str, dict[str, dict]] = {z: {} for z in self.zones}
        self.disks: dict[str, dict[str, dict]] = {z: {} for z in self.zones}
        self.firewalls: dict[str, dict] = {}
        self.images: dict[str, dict] = {}
        self.guest: dict[tuple[str, str], dict] = {}  # (zone, name) → {"ns/key": value}
        self.operations: dict[str, dict] = {}  # name → {"op", "zone", "asked", "t0", ...}
        self.faults: dict[str, str] = {}
        self.auth_fail = False
        self.slow_ops = 1
        self.op_seconds = 2.0
        self.requests: list[tuple[str, str, dict | None]] = []
        self._iam_init()  # service accounts and bucket policies (tests/gcpiamfake.py)
        self._ids = itertools.count(4_000_000_000_000_000_001)
        self._lock = threading.RLock()
        self._conns: list[socket.socket] = []
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def setup(self):
                super().setup()
                # headers and body go out in two writes: without this, Nagle's algorithm
                # and the client's delayed ACK hold every answer for ~40 ms
                self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                fake._conns.append(self.connection)

            def log_message(self, *a):
                pass

            def _answer(self):
                url = urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n) or b"null") if n else None
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                auth = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
                with fake._lock:
                    fake.requests.append((self.command, url.path, body))
                    try:
                        member = fake.tokens.get(auth)
                        code, obj = (member and fake.node_request(
                            member, self.command, url.path, query, body)) or \
                            fake.iam_route(self.command, unquote(url.path), query, body) or \
                            fake.route(self.command, url.path, query, body)
                    except ValueError as e:
                        code, obj = fake._error(400, "invalid", f"Invalid list filter "
                                                f"expression ({e})")
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json; charset=UTF-8")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_POST = do_DELETE = do_PATCH = do_PUT = _answer

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        """Stop serving and close every client connection."""
        self.server.shutdown()
        self.server.server_close()
        for c in self._conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.thread.join(5)

    # -- test controls ---------------------------------------------------------------------------
    def link(self, rest: str) -> str:
        return f"{LINK}{self.project}/{rest}"

    def fail(self, zone: str, fault: str) -> None:
        """Make inserts in ``zone`` fail with ``fault`` (one of :data:`FAULTS`)."""
        assert fault in FAULTS, fault
        self.faults[zone] = fault

    def exhaust(self, zone: str) -> None:
        self.fail(zone, "exhausted")

    def add_image(self, name: str, labels: dict, created: str, family: str | None = None,
                  deprecated: str | None = None) -> None:
        self.images[name] = {"kind": "compute#image", "id": str(next(self._ids)), "name": name,
                             "labels": labels, "creationTimestamp": created,
                             "family": family, "status": "READY", "diskSizeGb": "10",
                             "selfLink": self.link(f"global/images/{name}")}
        if deprecated:
            self.images[name]["deprecated"] = {"state": deprecated}

    def preempt(self, zone: str, name: str) -> None:
        """Take a SPOT instance back: STOPPING (DELETE action) or TERMINATED, and a DONE
        ``compute.instances.preempted`` operation in its zone, as GCE records it."""
        with self._lock:
            inst = self.instances[zone][name]
            delete = (inst.get("scheduling") or {}).get("instanceTerminationAction") == "DELETE"
            inst["status"] = "STOPPING" if delete else "TERMINATED"
            op = self._op(PREEMPTED, inst, zone)
            op.update(status="DONE", progress=100, endTime=_now(), user="system",
                      statusMessage="Instance was preempted.")

    def publish(self, zone: str, name: str, namespace: str, key: str, value: str) -> None:
        """The guest writes a guest attribute (module docstring)."""
        with self._lock:
            self.guest[(zone, name)][f"{namespace}/{key}"] = value

    def node_request(self, member: str, method: str, path: str, query: dict, body=None):
        """None when a principal's ``member`` may make this request (module docstring), else
        the 403 answer: the permission Compute Engine checks (:meth:`compute_permission`)
        held on the instance (its instance-level policy) or in the project's IAM policy
        (:meth:`may_in_project`, IAM conditions evaluated); any other API is refused."""
        if path == f"/v1/projects/{self.project}:testIamPermissions" and method == "POST":
            held = [p for p in (body or {}).get("permissions", [])  # anyone may ask
                    if self.may_in_project(member, p, f"projects/{self.project}")]
            return 200, {"permissions": held}
        rest = path[len(BASE + self.project) + 1:] if path.startswith(BASE) else path
        perm, resource = self.compute_permission(method, rest, body) \
            if path.startswith(BASE + self.project + "/") else (None, None)
        m = re.fullmatch(r"zones/([^/]+)/instances/([^/]+)(?:/([A-Za-z]+))?", rest)
        if perm and m and self.may_on_instance(member, m[1], m[2], perm):
            return None
        if perm and self.may_in_project(member, perm, resource):
            for sa in (body or {}).get("serviceAccounts") or [] \
                    if perm == "compute.instances.create" else []:
                if not self.may_act_as(member, sa.get("email", "")):
                    return self._error(403, "forbidden", "The user does not have access to "
                                       f"service account '{sa.get('email')}'.  User: "
                                       f"'{member.split(':', 1)[-1]}'.  Ask a project owner to "
                                       "grant you the iam.serviceAccountUser role on the "
                                       "service account")
            return None
        what = perm or "the permission"
        return self._error(403, "forbidden", f"Required '{what}' permission for "
                           f"'projects/{self.project}/{rest}'")

    def compute_permission(self, method: str, rest: str, body) -> tuple:
        """(the permission, the resource name IAM checks it on) of a Compute Engine call
        (``rest``: the path after ``/compute/v1/projects/P/``), as in
        cloud.google.com/compute/docs/reference/rest/v1 ("Authorization requires the
        following IAM permission"); list calls are checked on the project; (None, None) for
        a call not known here (refused)."""
        proj = f"projects/{self.project}"
        m = re.fullmatch(r"zones/([^/]+)/(instances|disks)/([^/]+)(?:/([A-Za-z]+))?", rest)
        if m:
            verb = {("GET", None): "get", ("DELETE", None): "delete",
                    ("GET", "getGuestAttributes"): "getGuestAttributes"}.get(
                (method, m[4])) or (m[4] if method == "POST" else None)
            return (f"compute.{m[2]}.{verb}" if verb else None,
                    f"{proj}/zones/{m[1]}/{m[2]}/{m[3]}")
        m = re.fullmatch(r"zones/([^/]+)/(instances|disks)", rest)
        if m:
            if method == "POST":
                return (f"compute.{m[2]}.create",
                        f"{proj}/zones/{m[1]}/{m[2]}/{(body or {}).get('name', '')}")
            return f"compute.{m[2]}.list", proj
        m = re.fullmatch(r"aggregated/(instances|disks)", rest)
        if m:
            return f"compute.{m[1]}.list", proj
        m = re.fullmatch(r"(zones/[^/]+|global)/operations(/[^/]+)?(?:/wait)?", rest)
        if m:
            kind = "zoneOperations" if m[1] != "global" else "globalOperations"
            return f"compute.{kind}.{'get' if m[2] else 'list'}", f"{proj}/{rest}"
        m = re.fullmatch(r"global/firewalls(?:/([^/]+))?", rest)
        if m:
            verb = {"GET": "get" if m[1] else "list", "POST": "create", "PUT": "update",
                    "PATCH": "update", "DELETE": "delete"}[method]
            return f"compute.firewalls.{verb}", f"{proj}/{rest}" if m[1] else proj
        if re.fullmatch(r"regions/[^/]+", rest):
            return "compute.regions.get", f"{proj}/{rest}"
        if rest == "zones":
            return "compute.zones.list", proj
        if rest.startswith("global/images"):
            return "compute.images.get" if method == "GET" else None, f"{proj}/{rest}"
        return None, None

    def may_in_project(self, member: str, permission: str, resource: str) -> bool:
        """Whether the project's IAM policy gives ``member`` ``permission`` on ``resource``
        (a binding's condition evaluated for that resource name: :func:`cel_on_name`)."""
        for b in self.project_policy.get("bindings") or []:
            if member not in b.get("members", []) or \
                    permission not in self.role_permissions(b.get("role", "")):
                continue
            cond = b.get("condition")
            if cond is None or cel_on_name(cond["expression"], resource):
                return True
        return False

    def power_off(self, zone: str, name: str) -> None:
        """The guest shut itself down (the idle watchdog's fallback): TERMINATED."""
        with self._lock:
            self.instances[zone][name]["status"] = "TERMINATED"

    # -- operations ------------------------------------------------------------------------------
    def _op(self, kind: str, target: dict, zone: str | None, effect=None,
            error: tuple | None = None) -> dict:
        name = f"operation-{int(time.time() * 1000)}-{next(self._ids):x}"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
              "operationType": kind, "targetLink": target["selfLink"],
              "targetId": target.get("id", ""), "status": "RUNNING", "progress": 0,
              "user": "tester@proj.iam.gserviceaccount.com", "insertTime": _now(),
              "startTime": _now(),
              "selfLink": self.link(f"zones/{zone}/operations/{name}" if zone
                                    else f"global/operations/{name}")}
        if zone:
            op["zone"] = self.link(f"zones/{zone}")
        self.operations[name] = {"op": op, "zone": zone, "asked": 0, "t0": time.monotonic(),
                                 "effect": effect, "error": error}
        return op

    def _finish(self, entry: dict) -> None:
        op = entry["op"]
        if op["status"] == "DONE":
            return
        op.update(status="DONE", progress=100, endTime=_now())
        if entry["error"]:
            code, message, http = entry["error"]
            op["error"] = {"errors": [{"code": code, "message": message}]}
            op["httpErrorStatusCode"] = http
            op["httpErrorMessage"] = {403: "FORBIDDEN", 503: "SERVICE UNAVAILABLE"}[http]
        if entry["effect"]:
            entry["effect"]()

    def _settle(self) -> None:
        """Operations finish on their own after ``op_seconds``."""
        now = time.monotonic()
        for entry in list(self.operations.values()):
            if now - entry["t0"] >= self.op_seconds:
                self._finish(entry)

    def _ask(self, name: str) -> dict:
        entry = self.operations[name]
        entry["asked"] += 1
        if entry["asked"] > self.slow_ops:
            self._finish(entry)
        return entry["op"]

    @staticmethod
    def _error(code: int, reason: str, message: str, domain: str = "global") -> tuple:
        return code, {"error": {"code": code, "message": message,
                                "status": STATUS.get(code, "UNKNOWN"),
                                "errors": [{"message": message, "domain": domain,
                                            "reason": reason}]}}

    def _not_found(self, rest: str) -> tuple:
        return self._error(404, "notFound",
                           f"The resource 'projects/{self.project}/{rest}' was not found")

    # -- routes ----------------------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        if self.auth_fail:
            return 401, {"error": {
                "code": 401, "status": "UNAUTHENTICATED",
                "message": "Request had invalid authentication credentials. Expected OAuth 2 "
                           "access token, login cookie or other valid authentication "
                           "credential. See https://developers.google.com/identity/sign-in/"
                           "web/devconsole-project.",
                "errors": [{"message": "Invalid Credentials", "domain": "global",
                            "reason": "authError", "location": "Authorization",
                            "locationType": "header"}]}}
        self._settle()
        if path.startswith("/v1/services/"):  # the Cloud Billing Catalog (tests/cloudcatalog.py)
            if path != f"/v1/services/{cloudcatalog.COMPUTE_SERVICE}/skus":
                return self._error(404, "notFound", f"no route for {method} {path}")
            return 200, {"skus": cloudcatalog.gcp_skus(), "nextPageToken": ""}
        if path.rstrip("/") == BASE + self.project:
            return 200, {"kind": "compute#project", "id": "4242", "name": self.project,
                         "selfLink": self.link("")[:-1]}
        if not path.startswith(BASE + self.project + "/"):
            return self._error(403, "forbidden", "Required 'compute.projects.get' "
                               f"permission for '{path[len('/compute/v1/'):]}'")
        rest = path[len(BASE + self.project) + 1:]
        flt = query.get("filter")
        m = re.fullmatch(r"(?:zones/([^/]+)|global)/operations(?:/([^/]+))?(/wait)?", rest)
        if m:
            zone, name, _ = m.groups()
            if name is None:
                ops = [e["op"] for e in self.operations.values()
                       if e["zone"] == zone and matches(e["op"], flt)]
                return 200, {"kind": "compute#operationList", "items": ops,
                             "selfLink": self.link(rest)}
            if name not in self.operations or self.operations[name]["zone"] != zone:
                return self._not_found(rest)
            return 200, self._ask(name)
        if rest == "zones":
            return 200, {"kind": "compute#zoneList", "items": [
                {"kind": "compute#zone", "id": str(2000 + i), "name": z, "status": "UP",
                 "region": self.link(f"regions/{self.region}"),
                 "selfLink": self.link(f"zones/{z}")} for i, z in enumerate(self.zones)]}
        m = re.fullmatch(r"regions/([^/]+)", rest)
        if m:
            if m[1] != self.region:
                return self._not_found(rest)
            return 200, {"kind": "compute#region", "id": "1000", "name": self.region,
                         "status": "UP", "selfLink": self.link(rest),
                         "zones": [self.link(f"zones/{z}") for z in self.zones]}
        m = re.fullmatch(r"aggregated/(machineTypes|acceleratorTypes)", rest)
        if m:  # the machines and GPUs of tests/cloudcatalog.py
            return 200, {**cloudcatalog.gcp_aggregated(m[1], self.link),
                         "selfLink": self.link(rest)}
        m = re.fullmatch(r"aggregated/(instances|disks)", rest)
        if m:
            kind = m[1]
            store = self.instances if kind == "instances" else self.disks
            items = {}
            for z, objs in store.items():
                found = [o for o in objs.values() if matches(o, flt)]
                items[f"zones/{z}"] = {kind: found} if found else {"warning": {
                    "code": "NO_RESULTS_ON_PAGE",
                    "message": "There are no results for scope 'zones/{z}' on this page.",
                    "data": [{"key": "scope", "value": f"zones/{z}"}]}}
            return 200, {"kind": f"compute#{kind[:-1]}AggregatedList",
                         "id": f"projects/{self.project}/aggregated/{kind}", "items": items,
                         "selfLink": self.link(rest)}
        m = re.fullmatch(r"zones/([^/]+)/instances/([^/]+)/(getGuestAttributes|setLabels|"
                         r"setMetadata)", rest)
        if m:
            return self._instance_call(m[1], m[2], m[3], query, body)
        m = re.fullmatch(r"zones/([^/]+)/instances(?:/([^/]+))?", rest)
        if m:
            if m[1] not in self.instances:
                return self._not_found(f"zones/{m[1]}")
            return self._instances(method, m[1], m[2], body, flt)
        m = re.fullmatch(r"zones/([^/]+)/disks/([^/]+)", rest)
        if m:
            disk = self.disks.get(m[1], {}).get(m[2])
            if disk is None:
                return self._not_found(rest)
            if method == "GET":
                return 200, disk
            if disk.get("users"):
                return self._error(400, "resourceInUseByAnotherResource",
                                   f"The disk resource '{rest}' is already being used by "
                                   f"'{disk['users'][0]}'")
            zone, dname = m[1], m[2]
            return 200, self._op("delete", disk, zone,
                                 lambda: self.disks[zone].pop(dname, None))
        m = re.fullmatch(r"global/firewalls(?:/([^/]+))?", rest)
        if m:
            return self._firewalls(method, m[1], body, flt)
        m = re.fullmatch(r"global/images(?:/family/([^/]+)|/([^/]+))?", rest)
        if m:
            return self._images(m[1], m[2], flt, rest)
        return self._error(404, "notFound", f"no route for {method} {path}")

    def _instance_call(self, zone, name, call, query, body):
        inst = self.instances.get(zone, {}).get(name)
        if inst is None:
            return self._not_found(f"zones/{zone}/instances/{name}")
        if call == "getGuestAttributes":
            q = query.get("queryPath", "")
            items = [{"namespace": k.split("/")[0], "key": k.split("/", 1)[1], "value": v}
                     for k, v in sorted(self.guest.get((zone, name), {}).items())
                     if k.startswith(q)]
            if not items:
                return self._not_found(f"zones/{zone}/instances/{name}/guestAttributes/{q}")
            return 200, {"kind": "compute#guestAttributes", "queryPath": q,
                         "queryValue": {"items": items},
                         "selfLink": inst["selfLink"] + f"/guestAttributes/{q}"}
        if call == "setLabels":
            if body.get("labelFingerprint") != inst["labelFingerprint"]:
                return self._error(412, "conditionNotMet", "Labels fingerprint either "
                                   "invalid or resource labels have changed")

            def relabel():
                inst["labels"] = dict(body.get("labels") or {})
                inst["labelFingerprint"] = f"{next(self._ids):x}="
            return 200, self._op("setLabels", inst, zone, relabel)
        if call == "setMetadata":
            def meta():
                inst["metadata"] = dict(body, kind="compute#metadata")
            return 200, self._op("setMetadata", inst, zone, meta)

    def _images(self, family, name, flt, rest):
        if name:
            img = self.images.get(name)
            return (200, img) if img else self._not_found(rest)
        if family:
            live = [i for i in self.images.values() if i.get("family") == family
                    and (i.get("deprecated") or {}).get("state") is None]
            if not live:
                return self._not_found(rest)
            return 200, max(live, key=lambda i: i["creationTimestamp"])
        return 200, {"kind": "compute#imageList", "selfLink": self.link(rest),
                     "items": [i for i in self.images.values() if matches(i, flt)]}

    def _invalid(self, field: str, value, why: str) -> tuple:
        return self._error(400, "invalid", f"Invalid value for field 'resource.{field}': "
                           f"'{value}'. {why}")

    def _validate(self, zone: str, body: dict):
        if not re.fullmatch(NAME_RE, body.get("name", "")):
            return self._invalid("name", body.get("name"), f"Must be a match of regex "
                                 f"'(?:{NAME_RE})'")
        mt = body.get("machineType", "")
        if not re.fullmatch(rf"(?:{re.escape(LINK)}{self.project}/)?zones/{zone}/"
                            r"machineTypes/[a-z0-9-]+", mt):
            return self._invalid("machineType", mt, "Invalid machine type for this zone.")
        labels = dict(body.get("labels") or {})
        for d in body.get("disks") or []:
            labels.update((d.get("initializeParams") or {}).get("labels") or {})
        for k, v in labels.items():
            if not re.fullmatch(LABEL_KEY_RE, k) or not re.fullmatch(LABEL_VALUE_RE, v):
                return self._invalid("labels", "", f"Label value '{v}' violates format "
                                     "constraints. The value can only contain lowercase "
                                     "letters, numeric characters, underscores and dashes. "
                                     "The value can be at most 63 characters long. "
                                     "International characters are allowed.")
        for sa in body.get("serviceAccounts") or []:
            if sa.get("email") != "default" and sa.get("email") not in self.service_accounts:
                return self._invalid("serviceAccounts.email", sa.get("email"),
                                     "The resource 'projects/{}/serviceAccounts/{}' was not "
                                     "found".format(self.project, sa.get("email")))
        sched = body.get("scheduling") or {}
        if sched.get("instanceTerminationAction") and sched.get("provisioningModel") != "SPOT":
            return self._invalid("scheduling.instanceTerminationAction",
                                 sched["instanceTerminationAction"],
                                 "Instance termination action can only be set for SPOT VMs.")
        if sched.get("provisioningModel") == "SPOT" and (
                sched.get("onHostMaintenance", "TERMINATE") != "TERMINATE"
                or sched.get("automaticRestart") is True):
            return self._invalid("scheduling", "", "Spot VMs must have onHostMaintenance "
                                 "TERMINATE and automaticRestart false.")
        for tag in (body.get("tags") or {}).get("items") or []:
            if not re.fullmatch(NAME_RE, tag):
                return self._invalid("tags.items", tag, "Must be a match of regex "
                                     f"'(?:{NAME_RE})'")
        return None

    def _instances(self, method, zone, name, body, flt):
        zi = self.instances[zone]
        if method == "POST" and name is None:
            bad = self._validate(zone, body)
            if bad:
                return bad
            iname = body["name"]
            if iname in zi:
                return self._error(409, "alreadyExists", f"The resource 'projects/"
                                   f"{self.project}/zones/{zone}/instances/{iname}' "
                                   "already exists")
            fault = self.faults.get(zone)
            zone_path = f"projects/{self.project}/zones/{zone}"
            if fault == "quota-http":
                return self._error(403, "quotaExceeded", "Quota 'CPUS' exceeded.  Limit: 8.0 "
                                   f"in region {self.region}.", domain="usageLimits")
            link = self.link(f"zones/{zone}/instances/{iname}")
            target = {"selfLink": link, "id": str(next(self._ids))}
            if fault:
                error = {"exhausted": ("ZONE_RESOURCE_POOL_EXHAUSTED", f"The zone "
                                       f"'{zone_path}' does not have enough resources "
                                       "available to fulfill the request.  Try a different "
                                       "zone, or try again later.", 503),
                         "exhausted-details": ("ZONE_RESOURCE_POOL_EXHAUSTED_WITH_DETAILS",
                                               f"The zone '{zone_path}' does not have enough "
                                               "resources available to fulfill the request.  "
                                               "'(resource type:compute)'.", 503),
                         "quota": ("QUOTA_EXCEEDED", "Quota 'CPUS' exceeded.  Limit: 8.0 in "
                                   f"region {self.region}.", 403)}[fault]
                return 200, self._op("insert", target, zone, error=error)
            inst = self._new_instance(zone, body, link, target["id"])
            zi[iname] = inst
            self.guest[(zone, iname)] = {}

            def running():
                inst["status"] = "RUNNING"
                inst["lastStartTimestamp"] = _now()
                for ac in inst["networkInterfaces"][0].get("accessConfigs", []):
                    ac["natIP"] = f"34.{len(zi)}.{self.zones.index(zone)}.{len(zi) + 10}"
            return 200, self._op("insert", target, zone, running)
        if name is None:
            return 200, {"kind": "compute#instanceList", "selfLink": self.link(
                f"zones/{zone}/instances"),
                "items": [i for i in zi.values() if matches(i, flt)]}
        if name not in zi:
            return self._not_found(f"zones/{zone}/instances/{name}")
        if method == "GET":
            return 200, zi[name]
        if method == "DELETE":
            inst = zi[name]
            inst["status"] = "STOPPING"

            def gone():
                zi.pop(name, None)
                for d in inst["disks"]:
                    disk = self.disks[zone].get(d["deviceName"])
                    if disk:
                        disk["users"] = []
                        if d.get("autoDelete"):
                            self.disks[zone].pop(d["deviceName"])
            return 200, self._op("delete", inst, zone, gone)
        return self._error(400, "badRequest", f"{method} not supported")

    def _new_instance(self, zone: str, body: dict, link: str, iid: str) -> dict:
        zone_link = self.link(f"zones/{zone}")
        disks = []
        for i, d in enumerate(body.get("disks") or []):
            params = d.get("initializeParams") or {}
            dname = body["name"] if i == 0 else f"{body['name']}-{i}"
            self.disks[zone][dname] = {
                "kind": "compute#disk", "id": str(next(self._ids)), "name": dname,
                "zone": zone_link, "status": "READY", "sizeGb": params.get("diskSizeGb", "10"),
                "sourceImage": params.get("sourceImage"), "labels": params.get("labels", {}),
                "type": f"{zone_link}/diskTypes/pd-balanced", "users": [link],
                "creationTimestamp": _now(), "selfLink": f"{zone_link}/disks/{dname}"}
            disks.append({"kind": "compute#attachedDisk", "type": "PERSISTENT",
                          "mode": "READ_WRITE", "source": f"{zone_link}/disks/{dname}",
                          "deviceName": dname, "index": i, "boot": bool(d.get("boot")),
                          "autoDelete": bool(d.get("autoDelete")), "interface": "SCSI",
                          "diskSizeGb": params.get("diskSizeGb", "10")})
        n = sum(len(z) for z in self.instances.values()) + 2
        nics = [{"kind": "compute#networkInterface", "name": f"nic{i}",
                 "network": self.link("global/networks/default"),
                 "subnetwork": self.link(f"regions/{self.region}/subnetworks/default"),
                 "networkIP": f"10.128.0.{n}", "stackType": "IPV4_ONLY",
                 "accessConfigs": [dict(ac, kind="compute#accessConfig", networkTier="PREMIUM")
                                   for ac in nic.get("accessConfigs") or []]}
                for i, nic in enumerate(body.get("networkInterfaces") or [])]
        mt = body["machineType"]
        return {**body, "kind": "compute#instance", "id": iid, "status": "PROVISIONING",
                "creationTimestamp": _now(), "zone": zone_link, "selfLink": link,
                "machineType": mt if mt.startswith("https:") else self.link(mt),
                "disks": disks, "networkInterfaces": nics, "cpuPlatform": "Unknown CPU Platform",
                "labelFingerprint": "42WmSpB8rSM=", "fingerprint": "Dd0Q3sIoBL8=",
                "metadata": {**(body.get("metadata") or {}), "kind": "compute#metadata",
                             "fingerprint": "IDbX3QoqCVs="},
                "deletionProtection": False, "canIpForward": False}

    def _check_firewall(self, body: dict):
        """Validate a firewall rule as the API does (HTTP 400 ``invalid``); None when it is
        good. An INGRESS rule with no source at all gets ``sourceRanges: [0.0.0.0/0]``, as
        GCE gives it."""
        if not re.fullmatch(NAME_RE, body.get("name") or ""):
            return self._invalid("name", body.get("name"), f"Must be a match of regex "
                                 f"'(?:{NAME_RE})'")
        network = body.get("network") or "global/networks/default"
        if network not in ("global/networks/default", self.link("global/networks/default")):
            return self._not_found(network.split(f"projects/{self.project}/")[-1])
        direction = body.get("direction") or "INGRESS"
        if direction not in ("INGRESS", "EGRESS"):
            return self._invalid("direction", direction, "Must be INGRESS or EGRESS.")
        if not 0 <= int(body.get("priority", 1000)) <= 65535:
            return self._invalid("priority", body["priority"], "Must be in [0, 65535].")
        if bool(body.get("allowed")) == bool(body.get("denied")):
            return self._invalid("allowed", "", "Exactly one of 'allowed' or 'denied' must "
                                 "be specified.")
        for action in ("allowed", "denied"):
            for i, entry in enumerate(body.get(action) or []):
                proto = str(entry.get("IPProtocol", "")).lower()
                if proto not in PROTOCOLS and not (proto.isdigit() and int(proto) < 256):
                    return self._invalid(f"{action}[{i}].IPProtocol", proto,
                                         "Invalid IP protocol.")
                for j, ports in enumerate(entry.get("ports") or []):
                    if proto not in ("tcp", "udp", "sctp"):
                        return self._invalid(f"{action}[{i}].ports[{j}]", ports,
                                             "Ports may only be specified on rules whose "
                                             "protocol is one of [TCP, UDP, SCTP].")
                    ends = ports.split("-")
                    if not (len(ends) <= 2 and all(e.isdigit() and int(e) <= 65535
                                                   for e in ends)):
                        return self._invalid(f"{action}[{i}].ports[{j}]", ports,
                                             "Invalid port range.")
        for r in body.get("sourceRanges") or []:
            try:
                ipaddress.ip_network(r, strict=False)
            except ValueError:
                return self._invalid("sourceRanges", r, "Invalid IPCidrRange.")
        for field in ("sourceTags", "targetTags"):
            for tag in body.get(field) or []:
                if not re.fullmatch(NAME_RE, tag):
                    return self._invalid(field, tag, f"Must be a match of regex "
                                         f"'(?:{NAME_RE})'")
        if direction == "EGRESS" and (body.get("sourceTags")
                                      or body.get("sourceServiceAccounts")):
            return self._invalid("sourceTags", "", "Source tags and source service accounts "
                                 "are not allowed for EGRESS rules.")
        for a, b in (("sourceTags", "sourceServiceAccounts"),
                     ("targetTags", "targetServiceAccounts")):
            if body.get(a) and body.get(b):
                return self._invalid(b, "", f"{b} cannot be used at the same time as {a}.")
        if direction == "INGRESS" and not (body.get("sourceRanges") or body.get("sourceTags")
                                           or body.get("sourceServiceAccounts")):
            body["sourceRanges"] = ["0.0.0.0/0"]
        return None

    def _firewalls(self, method, name, body, flt):
        if method == "POST" and name is None:
            bad = self._check_firewall(body)
            if bad:
                return bad
            if body["name"] in self.firewalls:
                return self._error(409, "alreadyExists", f"The resource 'projects/"
                                   f"{self.project}/global/firewalls/{body['name']}' already "
                                   "exists")
            rule = dict(body, kind="compute#firewall", id=str(next(self._ids)),
                        selfLink=self.link(f"global/firewalls/{body['name']}"),
                        network=self.link("global/networks/default"),
                        direction=body.get("direction") or "INGRESS",
                        priority=body.get("priority", 1000), creationTimestamp=_now(),
                        disabled=bool(body.get("disabled")))
            return 200, self._op("insert", rule, None,
                                 lambda: self.firewalls.__setitem__(body["name"], rule))
        if name is None:
            return 200, {"kind": "compute#firewallList", "selfLink": self.link(
                "global/firewalls"),
                "items": [f for f in self.firewalls.values() if matches(f, flt)]}
        if name not in self.firewalls:
            return self._not_found(f"global/firewalls/{name}")
        rule = self.firewalls[name]
        if method == "GET":
            return 200, rule
        if method in ("PATCH", "PUT"):  # PATCH merges; PUT (update) replaces every field
            new = dict(rule, **body) if method == "PATCH" else dict(body)
            if method == "PUT" and body.get("name") != name:
                return self._invalid("name", body.get("name"), "The name of a firewall "
                                     "cannot change.")
            bad = self._check_firewall(new)
            if bad:
                return bad
            new.update({k: rule[k] for k in ("kind", "id", "selfLink", "network",
                                             "creationTimestamp")})
            new.setdefault("direction", "INGRESS")
            new.setdefault("priority", 1000)

            def replace():
                rule.clear()
                rule.update(new)
            return 200, self._op(method.lower().replace("put", "update"), rule, None, replace)
        if method == "DELETE":
            return 200, self._op("delete", rule, None, lambda: self.firewalls.pop(name, None))
        return self._error(400, "badRequest", f"{method} not supported")

    def firewall_verdict(self, source, zone: str, name: str, protocol: str,
                         port: int | None = None) -> str | None:
        """Which INGRESS firewall rule lets a packet into instance ``zone/name``, decided as
        GCE does (cloud.google.com/firewall/docs/firewalls: of the rules that match the
        target, source, protocol and port, the lowest priority number wins, a deny before an
        allow of equal priority; with none, the implied deny-ingress rule drops it).

        Args:
            source: an address outside the network (``"198.51.100.9"``), or ``(zone, name)``
                of an instance of the network, whose packets come from its internal address
                with its network tags (source tags match such traffic only).
            protocol: ``tcp``, ``udp``, ``icmp``, ...; port: the destination port.
        Returns:
            the name of the rule that allows it, or None when it is dropped.
        """
        with self._lock:
            dst_tags = set((self.instances[zone][name].get("tags") or {}).get("items") or [])
            if isinstance(source, tuple):
                src = self.instances[source[0]][source[1]]
                ip = src["networkInterfaces"][0]["networkIP"]
                src_tags = set((src.get("tags") or {}).get("items") or [])
            else:
                ip, src_tags = source, set()
            best = None
            for rule in self.firewalls.values():
                targets = set(rule.get("targetTags") or [])
                if rule["direction"] != "INGRESS" or rule.get("disabled") or (
                        targets and not targets & dst_tags):
                    continue
                if not (any(ipaddress.ip_address(ip) in ipaddress.ip_network(r, strict=False)
                            for r in rule.get("sourceRanges") or [])
                        or set(rule.get("sourceTags") or []) & src_tags):
                    continue
                for action in ("denied", "allowed"):
                    if any(_covers(e, protocol, port) for e in rule.get(action) or []):
                        key = (int(rule["priority"]), action == "allowed")
                        if best is None or key < best[0]:
                            best = (key, action, rule["name"])
            return best[2] if best and best[1] == "allowed" else None
