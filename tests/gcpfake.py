"""A local stand-in for the Compute Engine REST API (v1), on 127.0.0.1, for the real
google-cloud-compute client (``HYPER_GCP_ENDPOINT``).

It keeps instances, disks, firewall rules, images and operations in memory and answers the
paths and JSON shapes of the real API (camelCase fields, ``selfLink``, ``kind``): inserts and
deletes return an operation that is RUNNING and becomes DONE on the client's
``operations/<op>/wait`` call (the real API's long-running operations); aggregated lists are
keyed ``zones/<zone>``; ``filter`` understands ``labels.K = "V"`` and ``labels.K:*`` joined by
``AND``. Faults: ``exhaust(zone)`` makes inserts there end in ZONE_RESOURCE_POOL_EXHAUSTED,
``quota = True`` makes them end in QUOTA_EXCEEDED, ``auth_fail = True`` answers 401 with the
real error body. ``requests`` records (method, path, body) of every call.
"""

from __future__ import annotations

import itertools
import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse

BASE = "/compute/v1/projects/"


def _match(obj: dict, flt: str | None) -> bool:
    if not flt:
        return True
    labels = obj.get("labels") or {}
    for part in re.split(r"\s+AND\s+", flt.strip()):
        m = re.fullmatch(r'\(?labels\.([\w-]+)\s*=\s*"([^"]*)"\)?', part.strip())
        if m:
            if labels.get(m[1]) != m[2]:
                return False
            continue
        m = re.fullmatch(r"\(?labels\.([\w-]+):\*\)?", part.strip())
        if m:
            if m[1] not in labels:
                return False
            continue
        raise ValueError(f"filter not understood: {part!r}")
    return True


class ComputeFake:
    """See the module docstring. ``url`` is the endpoint; ``close()`` stops it."""

    def __init__(self, project: str = "proj", zones=("us-central1-a", "us-central1-b",
                                                      "us-central1-c")):
        self.project = project
        self.zones = list(zones)
        self.instances: dict[str, dict[str, dict]] = {z: {} for z in self.zones}
        self.disks: dict[str, dict[str, dict]] = {z: {} for z in self.zones}
        self.firewalls: dict[str, dict] = {}
        self.images: dict[str, dict] = {}
        self.operations: dict[str, dict] = {}
        self.exhausted: set[str] = set()
        self.quota = False
        self.auth_fail = False
        self.requests: list[tuple[str, str, dict | None]] = []
        self._ids = itertools.count(1000)
        self._lock = threading.Lock()
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _body(self):
                n = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(n) or b"{}") if n else None

            def _answer(self, method):
                url = urlparse(self.path)
                body = self._body()
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                fake.requests.append((method, url.path, body))
                with fake._lock:
                    code, obj = fake.route(method, url.path, query, body)
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._answer("GET")

            def do_POST(self):
                self._answer("POST")

            def do_DELETE(self):
                self._answer("DELETE")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    # -- state helpers ---------------------------------------------------------------------------
    def link(self, rest: str) -> str:
        return f"https://www.googleapis.com{BASE}{self.project}/{rest}"

    def exhaust(self, zone: str) -> None:
        self.exhausted.add(zone)

    def add_image(self, name: str, labels: dict, created: str) -> None:
        self.images[name] = {"kind": "compute#image", "name": name, "id": str(next(self._ids)),
                             "labels": labels, "creationTimestamp": created,
                             "selfLink": self.link(f"global/images/{name}"),
                             "status": "READY"}

    def _op(self, kind: str, target: str, zone: str | None, error: tuple | None = None,
            done: callable = None) -> dict:
        name = f"operation-{next(self._ids)}"
        op = {"kind": "compute#operation", "id": str(next(self._ids)), "name": name,
              "operationType": kind, "targetLink": target, "status": "RUNNING",
              "progress": 0,
              "selfLink": self.link(f"zones/{zone}/operations/{name}" if zone
                                    else f"global/operations/{name}")}
        if zone:
            op["zone"] = self.link(f"zones/{zone}")
        self.operations[name] = {"op": op, "error": error, "done": done}
        return dict(op)

    def _finish(self, name: str) -> dict:
        entry = self.operations[name]
        op = entry["op"]
        if op["status"] != "DONE":
            op["status"], op["progress"] = "DONE", 100
            if entry["error"]:
                code, msg = entry["error"]
                op["error"] = {"errors": [{"code": code, "message": msg}]}
                op["httpErrorStatusCode"] = 403 if code == "QUOTA_EXCEEDED" else 503
            elif entry["done"]:
                entry["done"]()
        return dict(op)

    @staticmethod
    def _error(code: int, reason: str, message: str) -> tuple[int, dict]:
        status = {401: "UNAUTHENTICATED", 403: "PERMISSION_DENIED", 404: "NOT_FOUND",
                  409: "ALREADY_EXISTS", 400: "INVALID_ARGUMENT"}.get(code, "UNKNOWN")
        return code, {"error": {"code": code, "message": message, "status": status,
                                "errors": [{"message": message, "domain": "global",
                                            "reason": reason}]}}

    # -- routes ------------------------------------------------------------------------------------
    def route(self, method: str, path: str, query: dict, body) -> tuple[int, dict]:
        if self.auth_fail:
            return self._error(401, "authError", "Request had invalid authentication "
                               "credentials. Expected OAuth 2 access token, login cookie or "
                               "other valid authentication credential.")
        if not path.startswith(BASE + self.project + "/"):
            return self._error(404, "notFound", f"The resource '{path}' was not found")
        rest = path[len(BASE + self.project) + 1:]
        flt = query.get("filter")
        m = re.fullmatch(r"zones/([^/]+)/operations/([^/]+)(/wait)?", rest) or \
            re.fullmatch(r"global/operations/([^/]+)(/wait)?", rest)
        if m:
            name = m.groups()[-2]
            if name not in self.operations:
                return self._error(404, "notFound", f"operation {name} not found")
            return 200, self._finish(name) if m.groups()[-1] else \
                dict(self.operations[name]["op"])
        if rest == "zones" and method == "GET":
            return 200, {"kind": "compute#zoneList", "items": [
                {"kind": "compute#zone", "name": z, "status": "UP",
                 "region": self.link(f"regions/{z.rsplit('-', 1)[0]}"),
                 "selfLink": self.link(f"zones/{z}")} for z in self.zones]}
        if rest in ("aggregated/instances", "aggregated/disks") and method == "GET":
            kind = rest.split("/")[1]
            store = self.instances if kind == "instances" else self.disks
            items = {f"zones/{z}": ({kind: [o for o in objs.values() if _match(o, flt)]}
                                    if any(_match(o, flt) for o in objs.values()) else
                                    {"warning": {"code": "NO_RESULTS_ON_PAGE"}})
                     for z, objs in store.items()}
            return 200, {"kind": f"compute#{kind[:-1]}AggregatedList", "items": items}
        m = re.fullmatch(r"zones/([^/]+)/instances(?:/([^/]+))?", rest)
        if m:
            return self._instances(method, m[1], m[2], body)
        m = re.fullmatch(r"zones/([^/]+)/disks/([^/]+)", rest)
        if m and method == "DELETE":
            if self.disks.get(m[1], {}).pop(m[2], None) is None:
                return self._error(404, "notFound", f"disk {m[2]} not found")
            return 200, self._finish(self._op("delete", self.link(rest), m[1])["name"])
        m = re.fullmatch(r"global/firewalls(?:/([^/]+))?", rest)
        if m:
            return self._firewalls(method, m[1], body)
        m = re.fullmatch(r"global/images(?:/([^/]+))?", rest)
        if m:
            if m[1]:
                img = self.images.get(m[1])
                return (200, img) if img else self._error(404, "notFound",
                                                          f"image {m[1]} not found")
            return 200, {"kind": "compute#imageList",
                         "items": [i for i in self.images.values() if _match(i, flt)]}
        return self._error(404, "notFound", f"no route for {method} {path}")

    def _instances(self, method, zone, name, body):
        if zone not in self.instances:
            return self._error(404, "notFound", f"zone {zone} not found")
        zi = self.instances[zone]
        if method == "POST" and name is None:
            iname = body["name"]
            if iname in zi:
                return self._error(409, "alreadyExists", f"instance {iname} already exists")
            link = self.link(f"zones/{zone}/instances/{iname}")
            error = None
            if zone in self.exhausted:
                error = ("ZONE_RESOURCE_POOL_EXHAUSTED", f"The zone '{self.link('zones/' + zone)}'"
                         " does not have enough resources available to fulfill the request.")
            elif self.quota:
                error = ("QUOTA_EXCEEDED", "Quota 'CPUS' exceeded. Limit: 8.0 in region "
                         f"{zone.rsplit('-', 1)[0]}.")

            def made():
                n = len(zi) + 1
                inst = dict(body, kind="compute#instance", id=str(next(self._ids)),
                            status="RUNNING", selfLink=link, zone=self.link(f"zones/{zone}"))
                for nic in inst.get("networkInterfaces", []):
                    nic["networkIP"] = f"10.128.0.{n + 1}"
                    for ac in nic.get("accessConfigs", []):
                        ac["natIP"] = f"34.1.{len(self.zones)}.{n + 10}"
                zi[iname] = inst
                for d in body.get("disks", []):
                    params = d.get("initializeParams") or {}
                    self.disks[zone][iname] = {
                        "kind": "compute#disk", "name": iname, "zone": self.link(f"zones/{zone}"),
                        "sizeGb": params.get("diskSizeGb"), "labels": params.get("labels", {}),
                        "sourceImage": params.get("sourceImage"), "autoDelete": d.get("autoDelete")}
            return 200, self._op("insert", link, zone, error, made)
        if name is None:
            return 200, {"kind": "compute#instanceList", "items": list(zi.values())}
        if name not in zi:
            return self._error(404, "notFound", f"The resource '{name}' was not found")
        if method == "GET":
            return 200, zi[name]
        if method == "DELETE":
            inst = zi.pop(name)
            if any(d.get("autoDelete") for d in inst.get("disks", [])):
                self.disks[zone].pop(name, None)
            return 200, self._op("delete", inst["selfLink"], zone)
        return self._error(400, "badRequest", f"{method} not supported")

    def _firewalls(self, method, name, body):
        if method == "POST" and name is None:
            if body["name"] in self.firewalls:
                return self._error(409, "alreadyExists", f"firewall {body['name']} exists")
            link = self.link(f"global/firewalls/{body['name']}")

            def made():
                self.firewalls[body["name"]] = dict(body, kind="compute#firewall", selfLink=link,
                                                    id=str(next(self._ids)))
            return 200, self._op("insert", link, None, None, made)
        if name is None:
            return 200, {"kind": "compute#firewallList", "items": list(self.firewalls.values())}
        if name not in self.firewalls:
            return self._error(404, "notFound", f"The resource 'firewall {name}' was not found")
        if method == "GET":
            return 200, self.firewalls[name]
        if method == "DELETE":
            fw = self.firewalls.pop(name)
            return 200, self._op("delete", fw["selfLink"], None)
        return self._error(400, "badRequest", f"{method} not supported")
