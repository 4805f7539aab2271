"""A stand-in for the EC2 instance metadata service as IMDSv2 serves an instance role's
credentials (docs.aws.amazon.com/AWSEC2/latest/UserGuide/instance-metadata-security-
credentials.html): a session token from ``PUT /latest/api/token`` (header
``X-aws-ec2-metadata-token-ttl-seconds``), then, with that token in
``X-aws-ec2-metadata-token``, ``GET /latest/meta-data/iam/security-credentials/`` (the role's
name) and ``.../<role>`` (the credentials JSON). A request without a valid token is answered
401, as with ``HttpTokens: required``. Runs in a thread (on loopback, or on the SSH test hosts'
bridge address ``10.213.0.1``); every request is kept in ``requests`` as (method, path, had a
valid token, client address).

    with IMDS("hyper-c1", credentials) as imds:   # credentials: STS's Credentials dict
        env["AWS_EC2_METADATA_SERVICE_ENDPOINT"] = imds.endpoint
"""

from __future__ import annotations

import json
import secrets
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class IMDS:
    """The stand-in (module docstring). ``credentials``: ``AccessKeyId``,
    ``SecretAccessKey``, ``SessionToken`` and ``Expiration`` (a datetime or ISO text)."""

    def __init__(self, role: str, credentials: dict, host: str = "127.0.0.1"):
        self.role, self.tokens, self.requests = role, set(), []
        exp = credentials["Expiration"]
        self.document = json.dumps({
            "Code": "Success", "Type": "AWS-HMAC", "LastUpdated": "2026-11-24T00:00:00Z",
            "AccessKeyId": credentials["AccessKeyId"],
            "SecretAccessKey": credentials["SecretAccessKey"],
            "Token": credentials["SessionToken"],
            "Expiration": exp if isinstance(exp, str) else exp.strftime("%Y-%m-%dT%H:%M:%SZ")})
        imds = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def _send(self, code: int, body: str = "") -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_PUT(self):
                ok = self.path == "/latest/api/token" and \
                    self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
                imds.requests.append(("PUT", self.path, False, self.client_address[0]))
                if not ok:
                    return self._send(400)
                token = secrets.token_urlsafe(16)
                imds.tokens.add(token)
                self._send(200, token)

            def do_GET(self):
                valid = self.headers.get("X-aws-ec2-metadata-token") in imds.tokens
                imds.requests.append(("GET", self.path, valid, self.client_address[0]))
                if not valid:
                    return self._send(401)
                base = "/latest/meta-data/iam/security-credentials/"
                if self.path == base:
                    return self._send(200, imds.role)
                if self.path == base + imds.role:
                    return self._send(200, imds.document)
                self._send(404)

        self.server = ThreadingHTTPServer((host, 0), Handler)
        self.endpoint = f"http://{host}:{self.server.server_address[1]}/"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> "IMDS":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
