"""Stand-ins for the token side of a cloud VM, on 127.0.0.1, in this process:

* :class:`MetadataServer`: the GCE metadata server (``/computeMetadata/v1/instance/
  service-accounts/...``: the account's info with ``?recursive=true`` and its ``token``;
  requests without ``Metadata-Flavor: Google`` get 403, as on GCE) and Azure's IMDS
  (``/metadata/identity/oauth2/token?api-version=...&resource=...``; requests without
  ``Metadata: true`` get 400, as IMDS answers), each handing out ``token``. Reached through
  ``GCE_METADATA_HOST`` (google-auth) and ``AZURE_POD_IDENTITY_AUTHORITY_HOST``
  (azure-identity's IMDS host).
* :class:`BearerProxy`: a reverse proxy in front of a storage emulator that forwards a request
  only when it carries ``Authorization: Bearer <token>`` (else 401, the storage service's
  answer to a missing or wrong token); ``seen`` records the Authorization headers. With
  ``authorize``, the emulator becomes the cloud's storage service with IAM: each request is
  forwarded only when ``authorize(token, method, path, query, body)`` says its token may make
  it (else 403 with the service's body), the policy being the IAM stand-in's.

Both are stopped with ``close()``.
"""

from __future__ import annotations

import json
import threading
import time
from http.client import HTTPConnection
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlparse


class _Server:
    def _start(self, handler, tls=None) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        if tls:
            import ssl
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(*tls)
            self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, args=(0.05,),
                                       daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


class MetadataServer(_Server):
    """See the module docstring. ``host`` is ``127.0.0.1:PORT``; ``asked`` counts token
    requests by cloud (``gce``, ``imds``). ``instance`` describes the VM: GCE
    ``{"project", "zone", "name"}`` (``project/project-id``, ``instance/zone``,
    ``instance/name``) or Azure ``{"subscriptionId", "resourceGroupName", "name"}``
    (``/metadata/instance/compute``), what the node watcher asks before deleting itself."""

    def __init__(self, token: str, email: str = "hyper-c1@proj.iam.gserviceaccount.com",
                 instance: dict | None = None):
        self.token, self.email, self.instance = token, email, instance or {}
        self.asked = {"gce": 0, "imds": 0}
        me = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code: int, obj, headers: dict):
                data = (json.dumps(obj) if not isinstance(obj, str) else obj).encode()
                self.send_response(code)
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self):
                url = urlparse(self.path)
                q = {k: v[0] for k, v in parse_qs(url.query).items()}
                if url.path.startswith("/computeMetadata/v1/"):
                    gce = {"Metadata-Flavor": "Google", "Content-Type": "application/json"}
                    if self.headers.get("Metadata-Flavor") != "Google":
                        return self._send(403, "Missing Metadata-Flavor:Google header.", gce)
                    rest = url.path[len("/computeMetadata/v1/instance/service-accounts/"):]
                    if rest.endswith("/token"):
                        me.asked["gce"] += 1
                        return self._send(200, {"access_token": me.token, "expires_in": 3599,
                                                "token_type": "Bearer"}, gce)
                    if rest.rstrip("/") in ("default", me.email):
                        return self._send(200, {"aliases": ["default"], "email": me.email,
                                                "scopes": [
                            "https://www.googleapis.com/auth/compute",
                            "https://www.googleapis.com/auth/devstorage.read_write"]}, gce)
                    if url.path == "/computeMetadata/v1/" or url.path == "/":
                        return self._send(200, "instance/\nproject/\n", gce)
                    inst = me.instance
                    plain = {"/computeMetadata/v1/project/project-id": inst.get("project"),
                             "/computeMetadata/v1/instance/zone":
                                 f"projects/1234/zones/{inst.get('zone')}",
                             "/computeMetadata/v1/instance/name": inst.get("name")}
                    if url.path in plain and inst:
                        return self._send(200, plain[url.path], {"Metadata-Flavor": "Google"})
                    return self._send(404, "not found", gce)
                if url.path == "/metadata/identity/oauth2/token":
                    js = {"Content-Type": "application/json"}
                    if self.headers.get("Metadata") != "true":
                        return self._send(400, {"error": "invalid_request",
                                                "error_description": "Required metadata "
                                                "header not specified"}, js)
                    if "resource" not in q and "api-version" in q:  # the availability probe
                        return self._send(400, {"error": "invalid_request",
                                                "error_description": "Required audience "
                                                "parameter not specified"}, js)
                    me.asked["imds"] += 1
                    now = int(time.time())
                    return self._send(200, {
                        "access_token": me.token, "client_id": "msi-client-1",
                        "expires_in": "3599", "expires_on": str(now + 3599),
                        "ext_expires_in": "3599", "not_before": str(now),
                        "resource": q.get("resource", ""), "token_type": "Bearer"}, js)
                if url.path == "/metadata/instance/compute" and me.instance:
                    if self.headers.get("Metadata") != "true":
                        return self._send(400, {"error": "Bad request"}, {})
                    return self._send(200, me.instance, {"Content-Type": "application/json"})
                return self._send(404, {"error": "not found"}, {})

        self._start(Handler)
        self.host = f"127.0.0.1:{self.port}"


class BearerProxy(_Server):
    """See the module docstring. ``url`` is ``http://127.0.0.1:PORT``; ``upstream`` is the
    emulator's ``host:port``; ``add_query`` (e.g. the emulator's own SAS) is added to each
    forwarded request in place of the token; ``tls`` = (certificate, key) files serves https
    (azure-core sends bearer tokens over https only)."""

    def __init__(self, upstream: str, token: str, add_query: str = "", tls=None,
                 authorize=None, refused: bytes = b'{"error": {"code": 403, "message": '
                 b'"Forbidden", "errors": [{"reason": "forbidden", "domain": "global", '
                 b'"message": "Forbidden"}]}}', refused_type: str = "application/json"):
        self.token, self.upstream, self.add_query = token, upstream, add_query
        self.authorize, self.refused, self.refused_type = authorize, refused, refused_type
        self.seen: list[str | None] = []
        self.denied: list[tuple[str, str]] = []  # (method, path) refused by ``authorize``
        me = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _go(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                auth = self.headers.get("Authorization")
                me.seen.append(auth)
                if auth != f"Bearer {me.token}":
                    data = json.dumps({"error": {"code": 401, "message": "Invalid Credentials",
                                                 "errors": [{"reason": "authError",
                                                             "domain": "global",
                                                             "message": "Invalid Credentials"}]
                                                 }}).encode()
                    self.send_response(401)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                if me.authorize is not None:
                    url = urlparse(self.path)
                    q = {k: v[0] for k, v in parse_qs(url.query).items()}
                    if not me.authorize(me.token, self.command, url.path, q, body):
                        me.denied.append((self.command, self.path))
                        self.send_response(403)
                        self.send_header("Content-Type", me.refused_type)
                        self.send_header("Content-Length", str(len(me.refused)))
                        self.end_headers()
                        if self.command != "HEAD":
                            self.wfile.write(me.refused)
                        return
                conn = HTTPConnection(me.upstream, timeout=30)
                headers = {k: v for k, v in self.headers.items()
                           if k.lower() not in ("host", "authorization", "connection")}
                path = self.path
                if me.add_query:
                    path += ("&" if "?" in path else "?") + me.add_query
                conn.request(self.command, path, body=body, headers=headers)
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _go

        self._start(Handler, tls)
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
