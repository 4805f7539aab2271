"""A local stand-in for Azure Resource Manager's REST API, over TLS on 127.0.0.1 (azure-core
sends bearer tokens over https only), for the real azure-mgmt clients (``HYPER_AZURE_ENDPOINT``
and ``HYPER_AZURE_CA_BUNDLE``).

In memory: resource groups and, inside them, virtual networks, network security groups, public
IPs, NICs and VMs (plus a list of images). Answers the real paths (``resourcegroups`` and
``resourceGroups`` alike) with JSON shaped like ARM's (``id``, ``name``, ``type``, ``location``,
``tags``, ``properties.provisioningState``). PUT and DELETE are long-running: 201/202 with an
``Azure-AsyncOperation`` header whose status reads ``InProgress`` first and ``Succeeded`` (or
``Failed`` with the error) on the next read. Faults: ``no_sku_in(zone)`` (``SkuNotAvailable``
for VMs in that zone; ``"*"`` for every zone), ``quota = True`` (``QuotaExceeded``),
``auth_fail = True`` (401 ``InvalidAuthenticationToken``). ``requests`` records (method, path,
body) of every call.
"""

from __future__ import annotations

import datetime
import ipaddress
import itertools
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlparse

TYPES = {"virtualnetworks": "Microsoft.Network/virtualNetworks",
         "networksecuritygroups": "Microsoft.Network/networkSecurityGroups",
         "publicipaddresses": "Microsoft.Network/publicIPAddresses",
         "networkinterfaces": "Microsoft.Network/networkInterfaces",
         "virtualmachines": "Microsoft.Compute/virtualMachines"}


def make_cert(folder: Path) -> tuple[Path, Path]:
    """A self-signed certificate for 127.0.0.1 (cert.pem, key.pem) in ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = folder / "cert.pem", folder / "key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                           serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return cert_path, key_path


class ArmFake:
    """See the module docstring. ``url``, ``ca`` (certificate file); ``close()`` stops it."""

    def __init__(self, folder: Path, subscription: str = "sub-1"):
        self.sub = subscription
        self.groups: dict[str, dict] = {}       # lower name → group
        self.res: dict[str, dict] = {}          # lower id → resource
        self.images: list[dict] = []
        self.role_assignments: list[dict] = []
        self.ops: dict[str, dict] = {}
        self.no_sku: set[str] = set()
        self.quota = False
        self.auth_fail = False
        self.requests: list[tuple[str, str, dict | None]] = []
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.ca, key = make_cert(folder)
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _go(self, method):
                url = urlparse(self.path)
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append((method, url.path, body))
                with fake._lock:
                    code, obj, headers = fake.route(method, url.path, body,
                                                    f"https://{self.headers['Host']}")
                data = json.dumps(obj).encode() if obj is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                self._go("GET")

            def do_PUT(self):
                self._go("PUT")

            def do_DELETE(self):
                self._go("DELETE")

            def do_POST(self):
                self._go("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.ca, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    def no_sku_in(self, zone: str) -> None:
        self.no_sku.add(zone)

    def add_image(self, name: str, tags: dict) -> None:
        self.images.append({"id": f"/subscriptions/{self.sub}/resourceGroups/img/providers/"
                                  f"Microsoft.Compute/images/{name}", "name": name,
                            "type": "Microsoft.Compute/images", "location": "eastus",
                            "tags": tags, "properties": {"provisioningState": "Succeeded"}})

    def resources_in(self, group: str) -> list[dict]:
        prefix = f"/subscriptions/{self.sub}/resourcegroups/{group.lower()}/"
        return [r for k, r in self.res.items() if k.startswith(prefix)]

    # -- routing ---------------------------------------------------------------------------------
    @staticmethod
    def _err(code: int, err: str, msg: str):
        return code, {"error": {"code": err, "message": msg}}, {}

    def _lro(self, base: str, error: dict | None, then=None) -> dict:
        op = f"op{next(self._ids)}"
        self.ops[op] = {"reads": 0, "error": error, "then": then}
        return {"Azure-AsyncOperation": f"{base}/subscriptions/{self.sub}/providers/"
                                        f"Microsoft.Fake/operations/{op}?api-version=2024-01-01"}

    def route(self, method, path, body, base):
        if self.auth_fail:
            return self._err(401, "InvalidAuthenticationToken",
                             "The access token is invalid.")
        p = path.rstrip("/")
        lp = p.lower()
        sub = f"/subscriptions/{self.sub.lower()}"
        if not lp.startswith(sub):
            return self._err(404, "SubscriptionNotFound", f"subscription of {path} not found")
        rest = lp[len(sub):]
        if rest.startswith("/providers/microsoft.fake/operations/"):
            op = self.ops.get(rest.rsplit("/", 1)[1])
            if op is None:
                return self._err(404, "NotFound", "operation not found")
            op["reads"] += 1
            if op["reads"] < 2:
                return 200, {"status": "InProgress"}, {}
            if op["error"]:
                return 200, {"status": "Failed", "error": op["error"]}, {}
            if op["then"]:
                op["then"]()
                op["then"] = None
            return 200, {"status": "Succeeded"}, {}
        if "/providers/microsoft.authorization/roleassignments/" in rest and method == "PUT":
            self.role_assignments.append(body)
            return 201, {"id": p, "properties": body["properties"]}, {}
        if rest == "/providers/microsoft.compute/images":
            return 200, {"value": self.images}, {}
        if rest == "/resourcegroups":
            return 200, {"value": list(self.groups.values())}, {}
        parts = p.split("/")
        # /subscriptions/S/resourcegroups/G[/resources | /providers/NS/TYPE/NAME[/instanceView]]
        if len(parts) < 5 or parts[3].lower() != "resourcegroups":
            return self._err(404, "NotFound", f"no route for {path}")
        group = parts[4]
        gid = f"/subscriptions/{self.sub}/resourceGroups/{group}"
        if len(parts) == 5:
            return self._group(method, group, gid, body, base)
        if group.lower() not in self.groups:
            return self._err(404, "ResourceGroupNotFound",
                             f"Resource group '{group}' could not be found.")
        if len(parts) == 6 and parts[5].lower() == "resources":
            return 200, {"value": [{"id": r["id"], "name": r["name"], "type": r["type"],
                                    "location": r.get("location")}
                                   for r in self.resources_in(group)]}, {}
        if len(parts) >= 8 and parts[5].lower() == "providers":
            kind = parts[7].lower()
            if kind not in TYPES:
                return self._err(404, "NotFound", f"type {parts[7]} not served")
            if len(parts) == 8:
                return 200, {"value": [r for r in self.resources_in(group)
                                       if r["type"] == TYPES[kind]]}, {}
            name = parts[8]
            rid = f"{gid}/providers/{TYPES[kind]}/{name}"
            if len(parts) == 10 and parts[9].lower() == "instanceview":
                r = self.res.get(rid.lower())
                if r is None:
                    return self._err(404, "ResourceNotFound", f"{name} not found")
                return 200, {"statuses": [
                    {"code": "ProvisioningState/succeeded"},
                    {"code": f"PowerState/{r.get('_power', 'running')}"}]}, {}
            return self._resource(method, kind, rid, name, body, base)
        return self._err(404, "NotFound", f"no route for {path}")

    def _group(self, method, group, gid, body, base):
        key = group.lower()
        if method == "PUT":
            self.groups[key] = {"id": gid, "name": group, "type":
                                "Microsoft.Resources/resourceGroups",
                                "location": body["location"], "tags": body.get("tags") or {},
                                "properties": {"provisioningState": "Succeeded"}}
            return 201, self.groups[key], {}
        if key not in self.groups:
            return self._err(404, "ResourceGroupNotFound",
                             f"Resource group '{group}' could not be found.")
        if method == "GET":
            return 200, self.groups[key], {}
        if method == "DELETE":
            def gone():
                self.groups.pop(key, None)
                for r in self.resources_in(group):
                    self.res.pop(r["id"].lower(), None)
            return 202, None, self._lro(base, None, gone)
        return self._err(405, "MethodNotAllowed", method)

    def _resource(self, method, kind, rid, name, body, base):
        key = rid.lower()
        if method == "GET":
            r = self.res.get(key)
            return (200, r, {}) if r else self._err(404, "ResourceNotFound",
                                                    f"The Resource '{name}' was not found.")
        if method == "DELETE":
            if key not in self.res:
                return 204, None, {}
            return 202, None, self._lro(base, None, lambda: self.res.pop(key, None))
        if method != "PUT":
            return self._err(405, "MethodNotAllowed", method)
        props = dict(body.get("properties") or {})
        error = None
        if kind == "virtualmachines":
            zone = (body.get("zones") or [None])[0]
            if "*" in self.no_sku or zone in self.no_sku:
                error = {"code": "SkuNotAvailable", "message": (
                    f"The requested VM size {props['hardwareProfile']['vmSize']} is currently "
                    f"not available in location '{body['location']}' zones '{zone}'.")}
            elif self.quota:
                error = {"code": "QuotaExceeded", "message": (
                    "Operation could not be completed as it results in exceeding approved "
                    "standardDSv5Family Cores quota.")}
        n = next(self._ids)
        if kind == "publicipaddresses":
            props["ipAddress"] = f"20.0.{n // 250}.{n % 250}"
        if kind == "virtualnetworks":
            for s in props.get("subnets", []):
                s["id"] = f"{rid}/subnets/{s['name']}"
        if kind == "networkinterfaces":
            for c in props.get("ipConfigurations", []):
                c["id"] = f"{rid}/ipConfigurations/{c['name']}"
                c.setdefault("properties", {})["privateIPAddress"] = f"10.77.0.{n % 250}"
        props["provisioningState"] = "Succeeded" if error is None else "Failed"
        obj = {"id": rid, "name": name, "type": TYPES[kind], "location": body.get("location"),
               "tags": body.get("tags") or {}, "properties": props}
        if body.get("zones"):
            obj["zones"] = body["zones"]
        if (body.get("identity") or {}).get("type") == "SystemAssigned":
            obj["identity"] = {"type": "SystemAssigned", "principalId": f"principal-{n}",
                               "tenantId": "tenant-1"}
        if error is None:
            self.res[key] = obj
        else:
            self.res.pop(key, None)
        return 201, dict(obj, properties=dict(props, provisioningState="Creating")), \
            self._lro(base, error)
