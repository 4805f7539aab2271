"""A local stand-in for Azure Resource Manager's REST API, over TLS on 127.0.0.1, for the real
azure-mgmt clients (``HYPER_AZURE_ENDPOINT`` and ``HYPER_AZURE_CA_BUNDLE``; azure-core sends
bearer tokens over https only, so the stand-in serves a self-signed certificate made here).

In memory: resource groups and, inside them, virtual networks, network security groups, public
IPs, NICs, VMs and their OS disks (plus a list of images and role assignments). Answers ARM's
paths (``resourcegroups`` in any case) with JSON shaped like ARM's (``id``, ``name``, ``type``,
``location``, ``tags``, ``properties.provisioningState``), lists in pages joined by
``nextLink``, and ARM's rules where a client could get them wrong: ``api-version`` and a bearer
token are required; a NIC's subnet, security group and public IP, and a VM's NIC, must exist;
a NIC in use by a VM, a public IP, security group or subnet in use by a NIC cannot be deleted;
a VM's zones cannot change; an admin user name like ``root`` is refused; eviction policy and
max price are for Spot VMs only. A VM whose NIC and OS disk have ``deleteOption: Delete``
takes them along when it is deleted. A security group's rules are checked as ARM checks them
(priorities, conflicts, protocols, address prefixes, port ranges) and it gets ARM's default
rules; ``nsg_verdict`` says which rule decides an inbound packet.

Long-running operations: a PUT or DELETE answers 201/202 with an ``Azure-AsyncOperation``
header (resource group deletes: a ``Location`` header, as ARM does) that reads ``InProgress``
on the first read and until ``lro_seconds`` have passed, then ``Succeeded`` (or ``Failed``
with the error); the change is made when the operation ends, whether anyone polls or not.

A request with a principal's token (a node's or a controller's identity:
tests/azureiamfake.py, ``principal_tokens``) may make a call only where that principal's role
assignments give the action ARM checks for it (:func:`arm_action`: read, write or delete of a
resource of a group, a listing of a group, a command on a VM, a storage account's keys; 403
``AuthorizationFailed`` otherwise, with ARM's text); its listings of the subscription's groups
and resources hold only what it may read. ``/subscriptions/S/resources`` lists resources of
every group (``$filter`` on a tag).
The machines of tests/cloudcatalog.py: Resource SKUs (``providers/Microsoft.Compute/skus``,
``$filter=location eq '...'``) and, with no token as the public API, the Retail Prices API
(``/api/retail/prices``, ``$filter`` of ``eq`` terms, 100 items a page).

Faults: ``no_sku_in(zone)`` (409 ``SkuNotAvailable`` at once, ``"*"``: every zone),
``no_capacity_in(zone)`` (the VM's operation fails with ``ZonalAllocationFailed``, or
``AllocationFailed`` without a zone, and the VM stays in state Failed, as ARM leaves it),
``vm_limit`` (VMs beyond it: 409 ``quota_code`` with ARM's quota text), ``vm_error`` (status,
code, message for every VM PUT), ``auth_fail`` (401 ``InvalidAuthenticationToken``). Records:
``requests`` (method, path with query, body), ``tokens`` (bearer tokens seen), ``polls``
(operation status → how often it was read).
"""

from __future__ import annotations

import base64
import binascii
import datetime
import ipaddress
import itertools
import json
import re
import ssl
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlencode, urlparse

import cloudcatalog
from azureiamfake import IdentityFake

TYPES = {"virtualnetworks": "Microsoft.Network/virtualNetworks",
         "networksecuritygroups": "Microsoft.Network/networkSecurityGroups",
         "publicipaddresses": "Microsoft.Network/publicIPAddresses",
         "networkinterfaces": "Microsoft.Network/networkInterfaces",
         "virtualmachines": "Microsoft.Compute/virtualMachines",
         "disks": "Microsoft.Compute/disks"}
#: security rule protocols and the service tags a rule may name (a part of them)
RULE_PROTOCOLS = ("Tcp", "Udp", "Icmp", "Esp", "Ah", "*")
SERVICE_TAGS = ("*", "virtualnetwork", "internet", "azureloadbalancer")
AZURE_LB = "168.63.129.16"
#: every network security group's default rules: name, priority, direction, source,
#: destination, access (learn.microsoft.com/azure/virtual-network/network-security-groups-overview)
DEFAULT_RULES = [
    ("AllowVnetInBound", 65000, "Inbound", "VirtualNetwork", "VirtualNetwork", "Allow"),
    ("AllowAzureLoadBalancerInBound", 65001, "Inbound", "AzureLoadBalancer", "*", "Allow"),
    ("DenyAllInBound", 65500, "Inbound", "*", "*", "Deny"),
    ("AllowVnetOutBound", 65000, "Outbound", "VirtualNetwork", "VirtualNetwork", "Allow"),
    ("AllowInternetOutBound", 65001, "Outbound", "*", "Internet", "Allow"),
    ("DenyAllOutBound", 65500, "Outbound", "*", "*", "Deny")]
#: user names Azure refuses for a Linux VM's admin (a part of the documented list)
RESERVED_USERS = {"root", "admin", "administrator", "guest", "owner", "sys", "test", "user"}


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


class ArmError(Exception):
    """An ARM error answer: HTTP status, error code, message."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message


def _ranges(props: dict, field: str) -> list[str]:
    """A security rule's values of ``field`` and its plural (``sourceAddressPrefix`` and
    ``sourceAddressPrefixes``, ...)."""
    plural = field + ("es" if field.endswith("x") else "s")
    return ([props[field]] if props.get(field) else []) + list(props.get(plural) or [])


def _check_rules(rules: list[dict]) -> None:
    """Validate a security group's rules as ARM does; raise ArmError (400) for the first
    bad one: priority outside 100-4096, two rules of one direction and priority, an unknown
    protocol, access or direction, not exactly one of ``xAddressPrefix`` and
    ``xAddressPrefixes``, a prefix that is neither ``*``, a service tag nor an address
    range, a bad port range."""
    seen: dict[tuple, str] = {}
    for r in rules:
        p, name = r.get("properties") or {}, r.get("name")
        prio = p.get("priority")
        if not isinstance(prio, int) or not 100 <= prio <= 4096:
            raise ArmError(400, "SecurityRuleInvalidPriority", "Security rule has invalid "
                           f"Priority. Value provided: {prio} Allowed range 100-4096.")
        if (prio, p.get("direction")) in seen:
            raise ArmError(400, "SecurityRuleConflict", f"Security rule "
                           f"{seen[prio, p.get('direction')]} conflicts with rule {name}. Rules "
                           "cannot have the same Priority and Direction.")
        seen[prio, p.get("direction")] = name
        for field, allowed in (("protocol", RULE_PROTOCOLS), ("access", ("Allow", "Deny")),
                               ("direction", ("Inbound", "Outbound"))):
            if str(p.get(field)).lower() not in {a.lower() for a in allowed}:
                raise ArmError(400, "InvalidRequestFormat", "Cannot parse the request: "
                               f"{field} '{p.get(field)}' of security rule {name}.")
        for end in ("source", "destination"):
            if bool(p.get(f"{end}AddressPrefix")) == bool(p.get(f"{end}AddressPrefixes")):
                raise ArmError(400, "SecurityRuleInvalidAddressPrefix", f"Security rule {name} "
                               f"needs exactly one of {end}AddressPrefix and "
                               f"{end}AddressPrefixes.")
            for prefix in _ranges(p, f"{end}AddressPrefix"):
                try:
                    if prefix.lower() not in SERVICE_TAGS:
                        ipaddress.ip_network(prefix, strict=False)
                except ValueError:
                    raise ArmError(400, "SecurityRuleInvalidAddressPrefix", "Security rule "
                                   f"has invalid Address prefix. Value provided: {prefix}"
                                   ) from None
            for ports in _ranges(p, f"{end}PortRange") or [None]:
                ends = str(ports).split("-")
                if ports != "*" and not (len(ends) <= 2 and all(
                        e.isdigit() and int(e) <= 65535 for e in ends)):
                    raise ArmError(400, "SecurityRuleInvalidPortRange", "Security rule has "
                                   f"invalid Port range. Value provided: {ports}. Value should "
                                   "be an integer OR integer range with '-' delimiter. Valid "
                                   "range 0-65535.")


def arm_action(method: str, path: str) -> tuple[str | None, str]:
    """(the action ARM checks, the resource or scope it checks it on) for a request
    (learn.microsoft.com/azure/role-based-access-control/resource-provider-operations):
    ``<namespace>/<type>/read|write|delete`` of a resource of a group (a listing: read on
    the group), ``.../runCommand/action``, ``.../listKeys/action``, the group's own read and
    its resources listing; (None, path) for anything else (refused)."""
    m = re.fullmatch(r"(/subscriptions/[^/]+/resourceGroups/[^/]+)(?:/providers/([^/]+)/"
                     r"([^/]+)(?:/([^/]+)(?:/([A-Za-z]+))?)?|/(resources))?", path, re.I)
    if not m:
        return None, path
    group = m[1]
    if m[6]:
        return "Microsoft.Resources/subscriptions/resourceGroups/resources/read", group
    if not m[2]:
        verb = {"GET": "read", "PUT": "write", "PATCH": "write",
                "DELETE": "delete"}.get(method)
        return (f"Microsoft.Resources/subscriptions/resourceGroups/{verb}" if verb else None,
                group)
    kind = f"{m[2]}/{m[3]}"
    if not m[4]:
        return (f"{kind}/read" if method == "GET" else None), group
    target = f"{group}/providers/{kind}/{m[4]}"
    if m[5]:
        sub = m[5].lower()
        if sub == "runcommand" and method == "POST":
            return f"{kind}/runCommand/action", target
        if sub == "listkeys" and method == "POST":
            return f"{kind}/listKeys/action", target
        if sub == "instanceview" and method == "GET":
            return f"{kind}/instanceView/read", target
        return None, target
    verb = {"GET": "read", "PUT": "write", "PATCH": "write", "DELETE": "delete"}.get(method)
    return (f"{kind}/{verb}" if verb else None), target


def _ref(obj: dict | None) -> str | None:
    """The lower-cased ``id`` of a reference object, or None."""
    return (obj or {}).get("id", "").lower() or None


class ArmFake(IdentityFake):
    """See the module docstring. ``url``, ``ca`` (certificate file); ``close()`` stops it."""

    def __init__(self, folder: Path, subscription: str = "sub-1"):
        self.sub = subscription
        self.groups: dict[str, dict] = {}       # lower name → group
        self.res: dict[str, dict] = {}          # lower id → resource (VMs keep customData)
        self.images: list[dict] = []
        self.role_assignments: list[dict] = []  # every role assignment PUT's body
        self._identity_init()  # identities, accounts, assignments (tests/azureiamfake.py)
        self.ops: dict[str, dict] = {}
        self.lro_seconds = 0.03
        self.page_size = 2
        self.no_sku: set[str] = set()
        self.no_capacity: set[str] = set()
        self.vm_limit: int | None = None
        self.quota_code = "QuotaExceeded"
        self.vm_error: tuple[int, str, str] | None = None
        self.auth_fail = False
        self.requests: list[tuple[str, str, dict | None]] = []
        self.tokens: set[str] = set()
        self.polls: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self.ca, key = make_cert(folder)
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(self.ca, key)
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            disable_nagle_algorithm = True  # headers and body leave in separate writes

            def log_message(self, *a):
                pass

            def _go(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(n)) if n else None
                fake.requests.append((self.command, self.path, body))
                with fake._lock:
                    try:
                        code, obj, headers = fake.handle(
                            self.command, self.path, body, self.headers.get("Authorization"),
                            f"https://{self.headers['Host']}")
                    except ArmError as e:
                        code, obj = e.status, {"error": {"code": e.code, "message": e.message}}
                        headers = {"WWW-Authenticate": 'Bearer authorization_uri="https://'
                                   'login.windows.net/", error="invalid_token"'} \
                            if e.status == 401 else {}
                data = json.dumps(obj).encode() if obj is not None else b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json; charset=utf-8")
                self.send_header("Content-Length", str(len(data)))
                self.send_header("x-ms-request-id", f"req-{next(fake._ids)}")
                for k, v in headers.items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            do_GET = do_PUT = do_DELETE = do_POST = do_PATCH = _go

        return Handler

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)

    # -- test controls ---------------------------------------------------------------------------
    def no_sku_in(self, zone: str) -> None:
        self.no_sku.add(zone)

    def no_capacity_in(self, zone: str | None) -> None:
        self.no_capacity.add(zone or "")

    def add_image(self, name: str, tags: dict, location: str = "eastus") -> str:
        rid = f"/subscriptions/{self.sub}/resourceGroups/img/providers/Microsoft.Compute/" \
              f"images/{name}"
        self.images.append({"id": rid, "name": name, "type": "Microsoft.Compute/images",
                            "location": location, "tags": tags,
                            "properties": {"provisioningState": "Succeeded"}})
        return rid

    def resources_in(self, group: str) -> list[dict]:
        prefix = f"/subscriptions/{self.sub}/resourcegroups/{group.lower()}/".lower()
        return [r for k, r in self.res.items() if k.startswith(prefix)]

    def vm(self, group: str, name: str) -> dict | None:
        return self.res.get(self._rid(group, "virtualmachines", name).lower())

    def set_power(self, group: str, name: str, state: str) -> None:
        """Set a VM's power state (``running``, ``deallocated``, ...)."""
        self.vm(group, name)["_power"] = state

    def wait(self) -> None:
        """Let every operation in flight end."""
        time.sleep(self.lro_seconds + 0.02)
        with self._lock:
            self._settle()

    def nsg_verdict(self, group: str, nsg: str, source: str, destination: str,
                    protocol: str, port: int | None = None) -> tuple[str, str]:
        """Which rule of the security group ``group/nsg`` decides an inbound packet, as Azure
        does (learn.microsoft.com/azure/virtual-network/network-security-groups-overview: the
        rules, then the default rules, lowest priority number first; the first that matches
        decides). ``VirtualNetwork`` is the address space of the group's virtual networks,
        ``Internet`` anything outside it.

        Args:
            source, destination: IPv4 addresses (the destination is the NIC's private
                address: Azure translates a public one before the NSG sees the packet).
            protocol: ``Tcp``, ``Udp``, ``Icmp``; port: the destination port (None: none).
        Returns:
            (``Allow`` or ``Deny``, the deciding rule's name).
        """
        with self._lock:
            g = self.groups[group.lower()]["name"]
            props = self._get(self._rid(g, "networksecuritygroups", nsg))["properties"]
            vnet = [ipaddress.ip_network(a) for v in self.resources_in(g)
                    if v["type"] == TYPES["virtualnetworks"]
                    for a in v["properties"]["addressSpace"]["addressPrefixes"]]

            def holds(prefix: str, ip: str) -> bool:
                addr, tag = ipaddress.ip_address(ip), prefix.lower()
                inside = any(addr in n for n in vnet)
                if tag in SERVICE_TAGS:
                    return {"*": True, "virtualnetwork": inside, "internet": not inside,
                            "azureloadbalancer": ip == AZURE_LB}[tag]
                return addr in ipaddress.ip_network(prefix, strict=False)

            def covers(ports: str) -> bool:
                a, b = (ports.split("-") * 2)[:2] if ports != "*" else ("0", "65535")
                return ports == "*" or (port is not None and int(a) <= port <= int(b))
            rules = props["securityRules"] + props["defaultSecurityRules"]
            for rule in sorted(rules, key=lambda r: r["properties"]["priority"]):
                p = rule["properties"]
                if (p["direction"] == "Inbound" and p["protocol"] in ("*", protocol)
                        and any(holds(x, source) for x in _ranges(p, "sourceAddressPrefix"))
                        and any(holds(x, destination)
                                for x in _ranges(p, "destinationAddressPrefix"))
                        and any(covers(x) for x in _ranges(p, "destinationPortRange"))):
                    return p["access"], rule["name"]
        raise AssertionError("no rule matched: the default rules match everything")

    # -- request handling ------------------------------------------------------------------------
    def _rid(self, group: str, kind: str, name: str) -> str:
        return f"/subscriptions/{self.sub}/resourceGroups/{group}/providers/{TYPES[kind]}/{name}"

    def handle(self, method, raw, body, auth, base):
        url = urlparse(raw)
        q = {k: v[0] for k, v in parse_qs(url.query).items()}
        if url.path == "/api/retail/prices":  # Retail Prices: public, no token, no api-version
            return self._retail_prices(q, base)
        if self.auth_fail or not (auth or "").startswith("Bearer "):
            raise ArmError(401, "InvalidAuthenticationToken", "The access token is invalid.")
        token = auth.split(" ", 1)[1]
        self.tokens.add(token)
        reader = self.principal_tokens.get(token)
        if reader is not None:
            self._node_request(reader, method, url.path.rstrip("/"))
        if "api-version" not in q:
            raise ArmError(400, "MissingApiVersionParameter",
                           "The api-version query parameter (?api-version=) is required for "
                           "all requests.")
        self._settle()
        p = url.path.rstrip("/")
        sub = f"/subscriptions/{self.sub}".lower()
        if not p.lower().startswith(sub):
            raise ArmError(404, "SubscriptionNotFound", f"The subscription of {p} was not found.")
        rest = p[len(sub):].lower()
        if rest.startswith("/operationresults/") or "/operations/" in rest:
            return self._operation(p.rsplit("/", 1)[1])
        answer = self.identity_handle(method, p, q, body)
        if answer is not None:
            return answer
        if rest == "/providers/microsoft.compute/skus":  # Resource SKUs, one page as ARM does
            m = re.fullmatch(r"location eq '([^']*)'", (q.get("$filter") or "").strip())
            return 200, {"value": cloudcatalog.azure_skus(m[1] if m else None)}, {}
        if rest == "/providers/microsoft.compute/images":
            return self._page(self.images, base, p, q)
        if rest == "/resourcegroups":
            return self._page(self._readable(self._filter_groups(q.get("$filter")), reader),
                              base, p, q)
        if rest == "/resources":
            return self._page([{k: r[k] for k in ("id", "name", "type", "location", "tags")}
                               for r in self._readable(self._filter_groups(
                                   q.get("$filter"), list(self.res.values())), reader)],
                              base, p, q)
        parts = p.split("/")  # '', subscriptions, S, resourcegroups, G, ...
        if len(parts) < 5 or parts[3].lower() != "resourcegroups":
            raise ArmError(404, "InvalidResourceType", f"no route for {p}")
        group = parts[4]
        if len(parts) == 5:
            return self._group(method, group, body, base, q)
        if group.lower() not in self.groups:
            raise ArmError(404, "ResourceGroupNotFound",
                           f"Resource group '{group}' could not be found.")
        if len(parts) == 6 and parts[5].lower() == "resources":
            return self._page([{k: r[k] for k in ("id", "name", "type", "location", "tags")}
                               for r in self.resources_in(group)], base, p, q)
        if len(parts) < 8 or parts[5].lower() != "providers" or parts[7].lower() not in TYPES:
            raise ArmError(404, "InvalidResourceType", f"no route for {p}")
        kind = parts[7].lower()
        if len(parts) == 8:
            items = [r for r in self.resources_in(group) if r["type"] == TYPES[kind]]
            return self._page([self._view(r, q.get("$expand") == "instanceView")
                               for r in items], base, p, q)
        rid = self._rid(self.groups[group.lower()]["name"], kind, parts[8])
        if len(parts) == 10 and parts[9].lower() == "instanceview":
            return 200, self._instance_view(self._get(rid)), {}
        if len(parts) != 9:
            raise ArmError(404, "InvalidResourceType", f"no route for {p}")
        if method == "GET":
            return 200, self._view(self._get(rid)), {}
        if method == "DELETE":
            return self._delete(kind, rid, base)
        if method == "PUT":
            return self._put(kind, rid, parts[8], body, base)
        raise ArmError(405, "MethodNotAllowed", f"{method} is not supported here")

    def _retail_prices(self, q: dict, base: str):
        """The Retail Prices API (prices.azure.com): the items of tests/cloudcatalog.py
        that match ``$filter`` (``field eq 'value'`` terms joined by ``and``), 100 a page
        with ``NextPageLink``, as the real API answers."""
        terms = re.findall(r"(\w+) eq '([^']*)'", q.get("$filter") or "")
        items = [i for i in cloudcatalog.azure_prices()
                 if all(str(i.get(k, "")).lower() == v.lower() for k, v in terms)]
        skip = int(q.get("$skip", 0))
        page = {"BillingCurrency": "USD", "CustomerEntityId": "Default",
                "CustomerEntityType": "Retail", "Items": items[skip:skip + 100],
                "NextPageLink": None, "Count": len(items[skip:skip + 100])}
        if skip + 100 < len(items):
            page["NextPageLink"] = f"{base}/api/retail/prices?" + urlencode(
                {**q, "$skip": skip + 100})
        return 200, page, {}

    def _page(self, items: list, base: str, path: str, q: dict):
        start = int(q.get("$skiptoken", 0))
        page = {"value": items[start:start + self.page_size]}
        if start + self.page_size < len(items):
            page["nextLink"] = f"{base}{path}?" + urlencode(
                {**q, "$skiptoken": start + self.page_size})
        return 200, page, {}

    def _node_request(self, principal: str, method: str, path: str) -> None:
        """Raise 403 unless a principal (a node's or a controller's identity) may make this
        request (module docstring): the action ARM checks (:func:`arm_action`) held on the
        resource through a role assignment whose scope holds it. The subscription's listings
        of groups and resources are let through and answered with what the principal may
        read (:meth:`_readable`), as ARM filters them."""
        if method == "GET" and (re.fullmatch(r"/subscriptions/[^/]+/(resourcegroups|resources)",
                                             path, re.I) or "/operationresults/" in path.lower()
                                or "/operations/" in path.lower()):
            return  # filtered listings; polling an operation
        action, target = arm_action(method, path)
        if action and self.may(principal, action, target):
            return
        raise ArmError(403, "AuthorizationFailed",
                       f"The client '{principal}' with object id '{principal}' does not have "
                       f"authorization to perform action '{action or method + ' ' + path}' "
                       f"over scope '{target}' or the scope is invalid.")

    def _readable(self, items: list[dict], principal: str | None) -> list[dict]:
        """``items`` (groups or resources), those ``principal`` may read when one asks."""
        if principal is None:
            return items
        out = []
        for r in items:
            kind = "Microsoft.Resources/subscriptions/resourceGroups" if \
                r["id"].count("/") == 4 else r["type"]
            if self.may(principal, f"{kind}/read", r["id"]):
                out.append(r)
        return out

    def _filter_groups(self, flt: str | None, items: list[dict] | None = None) -> list[dict]:
        groups = list(self.groups.values()) if items is None else items
        if not flt:
            return groups
        m = re.fullmatch(r"tagName eq '([^']*)'(?: and tagValue eq '([^']*)')?", flt.strip())
        if not m:
            raise ArmError(400, "InvalidFilterInQueryString", f"Invalid $filter '{flt}'.")
        name, value = m.groups()
        return [g for g in groups if name in (g.get("tags") or {})
                and (value is None or g["tags"][name] == value)]

    def _get(self, rid: str) -> dict:
        r = self.res.get(rid.lower())
        if r is None:
            raise ArmError(404, "ResourceNotFound",
                           f"The Resource '{rid.split('/providers/')[1]}' under resource group "
                           f"'{rid.split('/')[4]}' was not found.")
        return r

    @staticmethod
    def _view(r: dict, instance_view: bool = False) -> dict:
        """What ARM answers of a stored resource: no private fields, no VM custom data."""
        out = {k: v for k, v in r.items() if not k.startswith("_")}
        if r["type"] == TYPES["virtualmachines"]:
            props = json.loads(json.dumps(out["properties"]))
            props.get("osProfile", {}).pop("customData", None)
            if instance_view:
                props["instanceView"] = ArmFake._instance_view(r)
            out["properties"] = props
        return out

    @staticmethod
    def _instance_view(r: dict) -> dict:
        state = r["properties"]["provisioningState"].lower()
        statuses = [{"code": f"ProvisioningState/{state}", "level": "Info"}]
        if r.get("_power"):
            statuses.append({"code": f"PowerState/{r['_power']}", "level": "Info"})
        return {"statuses": statuses}

    # -- long-running operations -----------------------------------------------------------------
    def _lro(self, base: str, error: dict | None = None, then=None, location=False,
             provider: str = "Microsoft.Compute") -> dict:
        op = f"{next(self._ids):08d}-0000-4000-8000-000000000000"
        self.ops[op] = {"due": time.monotonic() + self.lro_seconds, "error": error,
                        "then": then, "location": location}
        if location:
            return {"Location": f"{base}/subscriptions/{self.sub}/operationresults/{op}"
                                "?api-version=2025-04-01", "Retry-After": "0"}
        return {"Azure-AsyncOperation": f"{base}/subscriptions/{self.sub}/providers/"
                f"{provider}/locations/eastus/operations/{op}?api-version=2024-11-01"}

    def _settle(self) -> None:
        """Apply the changes of operations that have ended."""
        now = time.monotonic()
        for op in self.ops.values():
            if op["then"] and now >= op["due"]:
                then, op["then"] = op["then"], None
                then()

    def _operation(self, op_id: str):
        op = self.ops.get(op_id)
        if op is None:
            raise ArmError(404, "NotFound", f"Operation {op_id} was not found.")
        op["reads"] = op.get("reads", 0) + 1
        status = "InProgress" if time.monotonic() < op["due"] or op["reads"] == 1 else \
            "Failed" if op["error"] else "Succeeded"
        self.polls[status] = self.polls.get(status, 0) + 1
        if op["location"]:
            return (202, None, {"Retry-After": "0"}) if status == "InProgress" else (200, None, {})
        out = {"name": op_id, "status": status}
        if status == "Failed":
            out["error"] = op["error"]
        return 200, out, {}

    # -- resource groups -------------------------------------------------------------------------
    def _group(self, method, group, body, base, q):
        key = group.lower()
        g = self.groups.get(key)
        if method == "PUT":
            if g and g["location"] != body["location"]:
                raise ArmError(409, "InvalidResourceGroupLocation",
                               f"Invalid resource group location '{body['location']}'. The "
                               f"Resource group already exists in location '{g['location']}'.")
            new = {"id": f"/subscriptions/{self.sub}/resourceGroups/{group}", "name": group,
                   "type": "Microsoft.Resources/resourceGroups", "location": body["location"],
                   "tags": body.get("tags") or {},
                   "properties": {"provisioningState": "Succeeded"}}
            self.groups[key] = new
            return (200 if g else 201), new, {}
        if g is None:
            raise ArmError(404, "ResourceGroupNotFound",
                           f"Resource group '{group}' could not be found.")
        if method == "GET":
            return 200, g, {}
        if method == "DELETE":
            g["properties"]["provisioningState"] = "Deleting"
            g["_force"] = q.get("forceDeletionTypes")

            def gone():
                self.groups.pop(key, None)
                for r in self.resources_in(group):
                    self.res.pop(r["id"].lower(), None)
            return 202, None, self._lro(base, None, gone, location=True)
        raise ArmError(405, "MethodNotAllowed", f"{method} is not supported here")

    # -- resources -------------------------------------------------------------------------------
    def _users(self, rid: str) -> list[str]:
        """Ids of the resources that reference ``rid`` (lower case)."""
        rid, out = rid.lower(), []
        for r in self.res.values():
            props = r["properties"]
            refs = [_ref(props.get("networkSecurityGroup")), _ref(props.get("virtualMachine"))]
            for c in props.get("ipConfigurations", []):
                cp = c.get("properties", {})
                refs += [_ref(cp.get("publicIPAddress")),
                         (_ref(cp.get("subnet")) or "").rsplit("/subnets/", 1)[0] or None,
                         _ref(cp.get("subnet"))]
            for n in props.get("networkProfile", {}).get("networkInterfaces", []):
                refs.append(_ref(n))
            if rid in refs:
                out.append(r["id"])
        return out

    def _delete(self, kind, rid, base):
        r = self.res.get(rid.lower())
        if r is None:
            return 204, None, {}
        users = [u for u in self._users(rid) if kind != "virtualmachines"]
        if kind == "networkinterfaces" and _ref(r["properties"].get("virtualMachine")):
            raise ArmError(400, "NicInUse", f"Network Interface {rid} is used by existing "
                           f"resource {r['properties']['virtualMachine']['id']}. In order to "
                           "delete the network interface, it must be dissociated from the "
                           "resource.")
        if users and kind != "networkinterfaces":
            code = {"publicipaddresses": "PublicIPAddressCannotBeDeleted",
                    "networksecuritygroups": "InUseNetworkSecurityGroupCannotBeDeleted",
                    "virtualnetworks": "InUseSubnetCannotBeDeleted"}.get(kind, "InUse")
            raise ArmError(400, code, f"{rid} can not be deleted since it is in use by "
                           f"{users[0]}.")
        r["properties"]["provisioningState"] = "Deleting"
        return 202, None, self._lro(base, None, lambda: self._remove(rid),
                                    provider=TYPES[kind].split("/")[0])

    def _remove(self, rid: str) -> None:
        r = self.res.pop(rid.lower(), None)
        if r is None or r["type"] != TYPES["virtualmachines"]:
            return
        props = r["properties"]
        for n in props["networkProfile"]["networkInterfaces"]:
            nic = self.res.get(_ref(n))
            if nic:
                nic["properties"].pop("virtualMachine", None)
                if (n.get("properties") or {}).get("deleteOption") == "Delete":
                    self.res.pop(_ref(n), None)
        disk = props["storageProfile"]["osDisk"]
        if _ref(disk.get("managedDisk")) and disk.get("deleteOption") == "Delete":
            self.res.pop(_ref(disk["managedDisk"]), None)

    def _put(self, kind, rid, name, body, base):
        props = json.loads(json.dumps(body.get("properties") or {}))
        old = self.res.get(rid.lower())
        n = next(self._ids)
        error = None
        if kind == "virtualmachines":
            error = self._check_vm(rid, name, body, props, old)
        elif kind == "virtualnetworks":
            for s in props.get("subnets", []):
                s["id"] = f"{rid}/subnets/{s['name']}"
        elif kind == "networksecuritygroups":
            _check_rules(props.get("securityRules", []))
            for s in props.get("securityRules", []):
                s["id"] = f"{rid}/securityRules/{s['name']}"
            props["defaultSecurityRules"] = [  # read-only: what a client sends is ignored
                {"name": name, "id": f"{rid}/defaultSecurityRules/{name}", "properties": {
                    "protocol": "*", "sourcePortRange": "*", "destinationPortRange": "*",
                    "sourceAddressPrefix": src, "destinationAddressPrefix": dst,
                    "access": access, "priority": prio, "direction": direction,
                    "provisioningState": "Succeeded"}}
                for name, prio, direction, src, dst, access in DEFAULT_RULES]
        elif kind == "publicipaddresses":
            if (body.get("sku") or {}).get("name") == "Standard" and \
                    props.get("publicIPAllocationMethod") != "Static":
                raise ArmError(400, "StandardSkuPublicIPAddressesCannotBeDynamic",
                               "Standard sku publicIp addresses cannot be dynamic.")
            props["ipAddress"] = (old or {}).get("properties", {}).get("ipAddress") or \
                f"20.0.{n // 250}.{n % 250 + 1}"
        elif kind == "networkinterfaces":
            self._check_nic(rid, props, n)
        obj = {"id": rid, "name": name, "type": TYPES[kind], "location": body.get("location"),
               "tags": body.get("tags") or {}, "properties": props}
        for k in ("zones", "sku"):
            if body.get(k):
                obj[k] = body[k]
        if kind == "virtualmachines":
            obj["_power"] = "running" if error is None else None
            for iid in ((body.get("identity") or {}).get("userAssignedIdentities") or {}):
                if iid.lower() not in self.res:
                    raise ArmError(400, "FailedIdentityOperation",
                                   f"Identity '{iid}' could not be found.")
            ident = body.get("identity") or {}
            kinds = {k.strip() for k in (ident.get("type") or "").split(",")}
            if ident.get("userAssignedIdentities") and "UserAssigned" not in kinds:
                raise ArmError(400, "InvalidIdentityType", "userAssignedIdentities need type "
                               "UserAssigned")
            if kinds - {"", "SystemAssigned", "UserAssigned"}:
                raise ArmError(400, "InvalidIdentityType", f"bad type {ident.get('type')}")
            if kinds & {"SystemAssigned", "UserAssigned"}:
                obj["identity"] = {"type": ident["type"]}
                if "UserAssigned" in kinds:
                    obj["identity"]["userAssignedIdentities"] = ident["userAssignedIdentities"]
                if "SystemAssigned" in kinds:
                    old_id = (old or {}).get("identity") or {}
                    obj["identity"].update(principalId=old_id.get("principalId") or
                                           f"principal-{n}", tenantId="tenant-1")
        props["provisioningState"] = "Updating" if old else "Creating"
        self.res[rid.lower()] = obj

        def done():
            props["provisioningState"] = "Failed" if error else "Succeeded"
        return (200 if old else 201), self._view(obj), self._lro(
            base, error, done, provider=TYPES[kind].split("/")[0])

    def _check_nic(self, rid, props, n):
        if _ref(props.get("networkSecurityGroup")) and \
                _ref(props["networkSecurityGroup"]) not in self.res:
            raise ArmError(400, "InvalidResourceReference",
                           f"Resource {props['networkSecurityGroup']['id']} referenced by "
                           f"resource {rid} was not found.")
        for c in props.get("ipConfigurations", []):
            cp = c.setdefault("properties", {})
            subnet = _ref(cp.get("subnet")) or ""
            vnet = self.res.get(subnet.rsplit("/subnets/", 1)[0])
            if vnet is None or subnet not in {s["id"].lower()
                                              for s in vnet["properties"]["subnets"]}:
                raise ArmError(400, "InvalidResourceReference",
                               f"Resource {subnet} referenced by resource {rid} was not found.")
            ip = _ref(cp.get("publicIPAddress"))
            if ip and ip not in self.res:
                raise ArmError(400, "InvalidResourceReference",
                               f"Resource {ip} referenced by resource {rid} was not found.")
            c["id"] = f"{rid}/ipConfigurations/{c['name']}"
            cp["privateIPAddress"] = f"10.77.0.{n % 250 + 4}"

    def _check_vm(self, rid, name, body, props, old) -> dict | None:
        """Validate a VM PUT; raise ArmError for answers given at once, return the error of
        the operation for failures found later (allocation), None for success."""
        if old and (old.get("zones") or None) != (body.get("zones") or None):
            raise ArmError(409, "PropertyChangeNotAllowed",
                           "Changing property 'zones' is not allowed.")
        osp = props.get("osProfile", {})
        if osp.get("adminUsername", "").lower() in RESERVED_USERS:
            raise ArmError(400, "InvalidParameter",
                           "The Admin Username specified is not allowed. Target: "
                           "'adminUsername'.")
        try:
            base64.b64decode(osp.get("customData", ""), validate=True)
        except binascii.Error:
            raise ArmError(400, "InvalidParameter", "Custom data in OSProfile must be in "
                           "Base64 encoding. Target: 'customData'.") from None
        if props.get("priority") != "Spot" and (props.get("evictionPolicy")
                                                or props.get("billingProfile")):
            raise ArmError(400, "InvalidParameter", "Eviction policy and max price can be set "
                           "only for Azure Spot Virtual Machines.")
        if props.get("priority") == "Spot" and not props.get("evictionPolicy"):
            raise ArmError(400, "InvalidParameter", "Eviction policy is required for Azure "
                           "Spot Virtual Machines.")
        for ref in props.get("networkProfile", {}).get("networkInterfaces", []):
            nic = self.res.get(_ref(ref))
            if nic is None:
                raise ArmError(400, "InvalidResourceReference",
                               f"Resource {ref['id']} referenced by resource {rid} was not "
                               "found.")
            used = _ref(nic["properties"].get("virtualMachine"))
            if used and used != rid.lower():
                raise ArmError(400, "NicInUse", f"Network Interface {ref['id']} is used by "
                               f"existing resource {used}.")
        zone = (body.get("zones") or [""])[0]
        size = props["hardwareProfile"]["vmSize"]
        if self.vm_error:
            raise ArmError(*self.vm_error)
        if "*" in self.no_sku or (zone and zone in self.no_sku):
            raise ArmError(409, "SkuNotAvailable",
                           f"The requested VM size for resource 'Following SKUs have failed for "
                           f"Capacity Restrictions: {size}' is currently not available in "
                           f"location '{body['location']}' zones '{zone}'. Please try another "
                           "size or deploy to a different location or zones. See "
                           "https://aka.ms/azureskunotavailable for details.")
        vms = [r for r in self.res.values() if r["type"] == TYPES["virtualmachines"]]
        if not old and self.vm_limit is not None and len(vms) >= self.vm_limit:
            raise ArmError(409, self.quota_code,
                           "Operation could not be completed as it results in exceeding "
                           f"approved standardDSv5Family Cores quota. Additional details - "
                           f"Location: {body['location']}, Current Limit: "
                           f"{4 * self.vm_limit}, Current Usage: {4 * len(vms)}, Additional "
                           "Required: 4. Submit a request for Quota increase at "
                           "https://aka.ms/ProdportalCRP.")
        for ref in props.get("networkProfile", {}).get("networkInterfaces", []):
            self.res[_ref(ref)]["properties"]["virtualMachine"] = {"id": rid}
        if zone in self.no_capacity or "*" in self.no_capacity:
            code = "ZonalAllocationFailed" if zone else "AllocationFailed"
            return {"code": code, "message": "Allocation failed. We do not have sufficient "
                    f"capacity for the requested VM size in this {'zone' if zone else 'region'}"
                    ". Read more about improving likelihood of allocation success at "
                    "http://aka.ms/allocation-guidance"}
        disk = props["storageProfile"]["osDisk"]
        disk_id = (f"{rid.split('/providers/')[0]}/providers/Microsoft.Compute/disks/"
                   f"{name}_OsDisk_1_{next(self._ids):032x}")
        disk.setdefault("name", disk_id.rsplit("/", 1)[1])
        disk["managedDisk"] = {**disk.get("managedDisk", {}), "id": disk_id}
        self.res[disk_id.lower()] = {
            "id": disk_id, "name": disk["name"], "type": TYPES["disks"],
            "location": body["location"], "tags": {}, "zones": body.get("zones"),
            "properties": {"diskSizeGB": disk.get("diskSizeGB"), "provisioningState":
                           "Succeeded", "diskState": "Attached"}}
        props["vmId"] = f"{next(self._ids):08x}-0000-4000-8000-000000000000"
        return None
