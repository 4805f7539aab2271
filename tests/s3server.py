"""A real S3 API server on loopback for tests and benchmarks, behind a proxy that can fail.

``moto_server`` (moto's standalone S3 API server) runs as a subprocess on 127.0.0.1; clients
talk to it through :class:`Proxy`, a TCP relay in this process that a test can stop (the
store goes away mid-read: connections reset, new ones refused), start again (the data is still
there, because the server kept running), or slow down (``delay`` s added to each request, the
latency of a real cloud store). Everything is stopped by PID or by closing its own sockets.

    with S3Server() as s3:          # or the ``s3`` fixture
        s3.make_bucket("data")
        s3.endpoint                 # http://127.0.0.1:PORT (the proxy)
        s3.proxy.stop(); s3.proxy.start(); s3.proxy.delay = 0.02
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proxy:
    """A TCP relay 127.0.0.1:port → 127.0.0.1:upstream with fault injection.

    Attributes:
        delay: seconds to hold each client→server burst (≈ each request), default 0.
        requests: number of client→server bursts relayed (≈ HTTP requests).
    """

    def __init__(self, upstream: int, port: int | None = None, host: str = "127.0.0.1"):
        self.upstream, self.port, self.host = upstream, port or free_port(), host
        self.delay = 0.0
        self.requests = 0
        self._lock = threading.Lock()
        self._socks: set[socket.socket] = set()
        self._listener: socket.socket | None = None

    def start(self) -> None:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((self.host, self.port))
        ls.listen(128)
        self._listener = ls
        threading.Thread(target=self._accept, args=(ls,), daemon=True).start()

    def stop(self) -> None:
        """Close the listener and reset every relayed connection."""
        ls, self._listener = self._listener, None
        if ls is not None:
            try:
                ls.shutdown(socket.SHUT_RDWR)  # wakes the accept() blocked in another thread
            except OSError:
                pass
            ls.close()
        with self._lock:
            socks, self._socks = list(self._socks), set()
        for s in socks:
            try:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
                s.close()
            except OSError:
                pass

    def _accept(self, ls: socket.socket) -> None:
        while True:
            try:
                client, _ = ls.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(("127.0.0.1", self.upstream), timeout=5)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                s.settimeout(None)
            with self._lock:
                self._socks |= {client, server}
            threading.Thread(target=self._relay, args=(client, server), daemon=True).start()

    def _relay(self, client: socket.socket, server: socket.socket) -> None:
        try:
            while True:
                r, _, _ = select.select([client, server], [], [], 30)
                if not r:
                    continue
                for s in r:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is client:
                        self.requests += 1
                        if self.delay:
                            time.sleep(self.delay)
                        server.sendall(data)
                    else:
                        client.sendall(data)
        except OSError:
            return
        finally:
            for s in (client, server):
                with self._lock:
                    self._socks.discard(s)
                try:
                    s.close()
                except OSError:
                    pass


class S3Server:
    """moto_server on a free loopback port, with a :class:`Proxy` in front."""

    def __init__(self, host: str = "127.0.0.1"):
        """``host``: where the proxy listens: loopback, or the bridge address of the SSH test
        hosts (10.213.0.1) so that they can reach the store too."""
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.proxy = Proxy(self.port, host=host)
        self.endpoint = f"http://{host}:{self.proxy.port}"

    def start(self) -> "S3Server":
        exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        env = dict(os.environ, **CREDENTIALS)
        self.proc = subprocess.Popen([exe, "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        deadline = time.time() + 30
        while time.time() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                break
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError("moto_server exited at start")
                time.sleep(0.1)
        else:
            self.stop()
            raise RuntimeError("moto_server did not start in 30 s")
        self.proxy.start()
        return self

    def client(self):
        import boto3
        return boto3.client("s3", endpoint_url=self.endpoint, **{
            "aws_access_key_id": CREDENTIALS["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            "region_name": CREDENTIALS["AWS_DEFAULT_REGION"]})

    def make_bucket(self, name: str) -> str:
        self.client().create_bucket(Bucket=name)
        return name

    def stop(self) -> None:
        self.proxy.stop()
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> "S3Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@pytest.fixture
def s3(monkeypatch):
    """A running S3Server; the environment points boto3 at it (credentials, endpoint)."""
    for k, v in CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    server = S3Server().start()
    monkeypatch.setenv("HYPER_S3_ENDPOINT_URL", server.endpoint)
    try:
        yield server
    finally:
        server.stop()
