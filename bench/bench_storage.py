#!/usr/bin/env python3
"""Storage benchmarks of hypercli's chunked datasets against per-object peers, on a real S3 API
server on loopback (tests/s3server.py: moto_server behind a TCP proxy; needs root for FUSE and
for dropping the page cache).

The S3 server and its proxy run in a helper process of their own (multiprocessing, spawn), so
that the proxy's relay threads never share a GIL with the client being measured (boto3
threads, the reader loop). The proxy is tests/s3server.py's ``Proxy`` with two changes made in
a subclass here: it counts **HTTP requests** (client→server bursts that begin with an HTTP
request line; the plain ``requests`` counter counts every burst, so a 64 MiB upload counted
~1,000) and it adds ``delay`` once per HTTP request (not once per 64 KiB burst of an upload
body), which is what a cloud store's per-request latency looks like. Both counters are printed.

1. Push N small files (default 10,000 × 10 KB of random bytes in 10 subfolders), with 0 and
   with 20 ms added to every S3 request:
     hyper    ``hypercli.mount.pack.push(src, s3://..., chunk_size=64 MiB, jobs=16)``
     boto3    one ``put_object`` per file, 16 threads (client ``max_pool_connections=16``)
     rclone   ``rclone copy --transfers 16 --checkers 16 --s3-no-head SRC remote:bucket/prefix``
              (rclone 1.60, env remote)
   Each run goes to a fresh prefix (hyper skips chunks a prefix already has). files/s, ratio,
   HTTP requests of each.

2. One epoch over the same files, one reader thread (``os.open`` + ``os.read(1 MiB)`` until EOF
   + ``os.close`` for each file of a fixed list: no directory listing is timed), in sorted and
   in shuffled order, with the proxy delay at 0 and at 20 ms:
     hyper    ``fusefs.mount`` (daemon, 4 GiB chunk cache in a fresh folder) of the pushed
              dataset, which returns once it has listed its entries (``warm_entries``, the
              default 100,000: READDIRPLUS, so no file needs a LOOKUP; the mount time is
              printed apart); cold = fresh mount + fresh cache + dropped page cache; warm
              (same mount) = the same mount read again (kernel page cache, ``kernel_cache``); warm
              (remount) = unmounted, mounted again on the filled chunk cache; warm (remount,
              page cache dropped) = the same after ``drop_caches``
     s3fs     Debian s3fs 1.90 over the per-object upload (``-o ro,use_path_request_style,
              use_cache=DIR,enable_noobj_cache,stat_cache_expire=3600,kernel_cache``), run
              in the foreground (``-f``) as our child; warm = the same mount read again
     rclone   ``rclone mount --read-only --vfs-cache-mode full --dir-cache-time 1h
              --attr-timeout 1h --use-server-modtime``; warm = the same mount read again
     local    the source folder on local disk; cold after ``drop_caches``, warm = read again
   The per-object mounts are slow: their cold epoch is cut at a time cap and the figure is the
   rate over the files read (their per-file cost does not change along an epoch); their warm
   pass re-reads the same files. files/s, ratios vs the best per-object mount and vs local
   disk, HTTP requests per 1,000 files read. Each hyper run prints the FUSE operations its
   daemon answered (calls × µs spent in the handler per call, from the mount's stats).

3. Chunk-size sweep at 20 ms per request: ~1 MB files (default 320 MB in total) pushed with
   each chunk size (default 4, 16, 64, 128 MiB), then a cold sequential read (sorted = pack
   order) of every file through a fresh mount: MB/s, time to the first file, requests.

Figures vary ±50% run to run on this 2-core machine (other jobs run on it too): compare ratios
within a run. Hyper and local sides are repeated ``--rounds`` times (medians); the per-object
peers, ~100× slower, once (``--full``: 3 times).

Usage (from the repo root, as root):
    python bench/bench_storage.py [--quick | --full] [--only 1,2,3] [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for _p in (str(ROOT / "tests"), str(ROOT)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

MiB = 1 << 20
BUCKET = "bench"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}   # s3rver: S3RVER / S3RVER (set in main)
STORE = {"name": "s3rver", "exe": ""}           # which S3 server (--store)

TEMP_DIRS: list[str] = []
CLEANUP: list = []   # callables, run last-in first-out at exit


# ------------------------------------------------------------------------ S3 server process

_REQ_LINE = re.compile(rb"(GET|PUT|POST|HEAD|DELETE|OPTIONS|PATCH) (\S+) HTTP/1\.[01]\r\n")


def _kind(m) -> str:
    """A request's kind: LIST (GET with list-type/prefix/delimiter), GET, HEAD, PUT, POST..."""
    method, target = m.group(1).decode(), m.group(2)
    q = target.split(b"?", 1)[1] if b"?" in target else b""
    if method == "GET" and (b"list-type" in q or b"prefix=" in q or b"delimiter" in q):
        return "LIST"
    if method == "PUT" and b"partNumber" in q:
        return "PUT(part)"
    return method


def _counting_proxy_class():
    import select
    import socket
    import time as _time

    from s3server import Proxy

    class CountingProxy(Proxy):
        """tests/s3server.py's Proxy; also counts HTTP requests (``http``) and sleeps
        ``delay`` once per HTTP request instead of once per client→server burst."""

        http = 0
        kinds: dict = {}

        def _relay(self, client, server):
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
                            m = _REQ_LINE.match(data)
                            if m:
                                self.http += 1
                                k = _kind(m)
                                self.kinds[k] = self.kinds.get(k, 0) + 1
                                if self.delay:
                                    _time.sleep(self.delay)
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

    _ = socket  # (imported for the copied relay's names)
    return CountingProxy


def _s3rver_class():
    """S3rverServer: npm ``s3rver`` (Node.js, objects as files in a fresh folder) on a free
    loopback port, tests/s3server.py's ``S3Server`` otherwise (its proxy, stop, port)."""
    import socket

    from s3server import S3Server

    class S3rverServer(S3Server):
        def __init__(self, exe: str, workdir: str):
            super().__init__()
            self.exe, self.dir = exe, workdir

        def start(self):
            log = open(os.path.join(self.dir, "s3rver.log"), "ab")
            # s3rver 3.7 makes ListObjectsV2 continuation tokens with a cipher that Node 17+
            # (OpenSSL 3) refuses: without the legacy provider, listings past 1,000 keys fail
            env = dict(os.environ, NODE_OPTIONS="--openssl-legacy-provider")
            self.proc = subprocess.Popen(
                [self.exe, "-d", os.path.join(self.dir, "data"), "-a", "127.0.0.1", "-p",
                 str(self.port), "--silent"], stdin=subprocess.DEVNULL, stdout=log,
                stderr=log, env=env, start_new_session=True)
            log.close()
            end = time.monotonic() + 30
            while True:
                try:
                    socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                    break
                except OSError:
                    if self.proc.poll() is not None or time.monotonic() > end:
                        self.stop()
                        raise RuntimeError("s3rver did not start")
                    time.sleep(0.05)
            self.proxy.start()
            return self

        def stop(self):
            super().stop()
            shutil.rmtree(self.dir, ignore_errors=True)

    return S3rverServer


def _make_bucket(endpoint: str, creds: dict, name: str) -> None:
    import boto3
    boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=creds["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=creds["AWS_SECRET_ACCESS_KEY"],
        region_name=creds["AWS_DEFAULT_REGION"]).create_bucket(Bucket=name)


def _server_main(conn, store: str, exe: str, workdir: str, creds: dict) -> None:
    """The helper process: the S3 server with a CountingProxy, driven over a Pipe."""
    Counting = _counting_proxy_class()
    if store == "s3rver":
        s3 = _s3rver_class()(exe, workdir)
    else:
        from s3server import S3Server
        s3 = S3Server()
    s3.proxy = Counting(s3.port)
    s3.proxy.kinds = {}
    s3.endpoint = f"http://127.0.0.1:{s3.proxy.port}"
    try:
        s3.start()
        conn.send(("ok", s3.endpoint, s3.proc.pid))
        while True:
            cmd, arg = conn.recv()
            if cmd == "counts":
                conn.send((s3.proxy.http, s3.proxy.requests, dict(s3.proxy.kinds)))
            elif cmd == "delay":
                s3.proxy.delay = float(arg)
                conn.send(True)
            elif cmd == "bucket":
                _make_bucket(s3.endpoint, creds, arg)
                conn.send(True)
            elif cmd == "stop":
                break
    except Exception as e:  # report to the parent, then stop everything
        try:
            conn.send(("error", repr(e), None))
        except OSError:
            pass
    finally:
        s3.stop()
        try:
            conn.send(True)
        except OSError:
            pass


class Server:
    """The S3 server helper process (s3rver or moto_server + counting proxy on 127.0.0.1)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        workdir = tmpdir("bench-s3rver-")
        self.proc = ctx.Process(target=_server_main, args=(child, STORE["name"],
                                                           STORE["exe"], workdir, dict(CREDS)),
                                daemon=True)
        self.proc.start()
        self.stopped = False
        status, self.endpoint, self.server_pid = self.conn.recv()
        if status != "ok":
            raise RuntimeError(f"S3 server failed: {self.endpoint}")
        CLEANUP.append(self.stop)

    def _call(self, cmd, arg=None):
        self.conn.send((cmd, arg))
        return self.conn.recv()

    def counts(self) -> tuple[int, int, dict]:
        """(HTTP requests, client→server bursts, {kind: requests}) so far."""
        return tuple(self._call("counts"))

    def delay(self, seconds: float) -> None:
        self._call("delay", seconds)

    def bucket(self, name: str) -> None:
        self._call("bucket", name)

    def stop(self) -> None:
        if self.stopped:
            return
        self.stopped = True
        clean = False
        if self.proc.is_alive():
            try:
                self.conn.send(("stop", None))
                clean = self.conn.poll(20) and self.conn.recv() is True
            except (OSError, EOFError):
                pass
            self.proc.join(10)
            if self.proc.is_alive():
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.join(5)
        if not clean:  # the server leads its own session: if it outlived the helper, end it
            try:
                os.killpg(self.server_pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


class Counter:
    """HTTP requests (and bursts) between start and stop; ``kinds`` after stop."""

    def __init__(self, server: Server):
        self.server = server
        self.h0, self.b0, self.k0 = server.counts()
        self.kinds: dict = {}

    def stop(self) -> tuple[int, int]:
        h, b, k = self.server.counts()
        self.kinds = {x: n - self.k0.get(x, 0) for x, n in k.items() if n - self.k0.get(x, 0)}
        return h - self.h0, b - self.b0


def kinds_str(kinds: dict) -> str:
    return " ".join(f"{k} {v:,}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1]))


# ----------------------------------------------------------------------------- helpers

def tmpdir(prefix: str) -> str:
    d = tempfile.mkdtemp(prefix=prefix)
    TEMP_DIRS.append(d)
    return d


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=",.0f", none="—"):
    return none if x is None else format(x, spec)


def ratio(a, b, spec=".1f"):
    return "—" if a is None or not b else format(a / b, spec) + "×"


def load1() -> float:
    return os.getloadavg()[0]


DROP_OK: bool | None = None


def drop_caches(files: list[str] | None = None) -> str:
    """Drop the page cache (``sync; echo 3 > /proc/sys/vm/drop_caches``); without the right
    to, posix_fadvise(DONTNEED) on ``files``. Returns which was done."""
    global DROP_OK
    os.sync()
    if DROP_OK is not False:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            DROP_OK = True
            return "drop_caches"
        except OSError:
            DROP_OK = False
    for p in files or []:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "fadvise"


def mounted(mp_: str) -> bool:
    with open("/proc/mounts") as f:
        for line in f:
            p = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), line.split(" ")[1])
            if p == mp_:
                return True
    return False


def reap(pid: int, timeout: float) -> bool:
    """Wait for our child pid to exit; True when gone."""
    end = time.monotonic() + timeout
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
            if done == pid:
                return True
        except ChildProcessError:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return True
        if time.monotonic() > end:
            return False
        time.sleep(0.02)


def peer_env() -> dict:
    env = dict(os.environ, **CREDS)
    env.pop("AWS_CA_BUNDLE", None)  # rclone 1.60 fails on this machine's bundle
    return env


# ------------------------------------------------------------------------------- mounts

class Mount:
    """A FUSE mount whose daemon is our child (pid); close() unmounts and reaps it."""

    kind = "?"
    fusermount = "fusermount3"

    def __init__(self, mp_: str, pid: int, log: str | None = None):
        self.mp, self.pid, self.log = mp_, pid, log
        CLEANUP.append(self.close)

    def close(self) -> None:
        if self.pid is None:
            return
        if mounted(self.mp):
            r = subprocess.run([self.fusermount, "-u", self.mp], capture_output=True,
                               timeout=30)
            if r.returncode != 0:
                time.sleep(0.5)
                r = subprocess.run([self.fusermount, "-u", self.mp], capture_output=True,
                                   timeout=30)
                if r.returncode != 0:
                    subprocess.run([self.fusermount, "-uz", self.mp], capture_output=True,
                                   timeout=30)
        for sig, wait in ((None, 10), (signal.SIGTERM, 5), (signal.SIGKILL, 5)):
            if sig is not None:
                try:
                    os.kill(self.pid, sig)
                except ProcessLookupError:
                    pass
            if reap(self.pid, wait):
                break
        if mounted(self.mp):
            subprocess.run([self.fusermount, "-uz", self.mp], capture_output=True, timeout=30)
        self.pid = None

    def stats(self) -> dict | None:
        return None


def wait_mounted(mp_: str, proc: subprocess.Popen, timeout: float, log: str) -> None:
    end = time.monotonic() + timeout
    while not mounted(mp_):
        if proc.poll() is not None or time.monotonic() > end:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            tail = Path(log).read_text(errors="replace")[-1500:] if os.path.exists(log) else ""
            raise RuntimeError(f"mount at {mp_} failed: {tail}")
        time.sleep(0.02)


class HyperMount(Mount):
    kind = "hyper"

    warm_entries: int | None = None  # --warm-entries (None: the mount's default)

    def __init__(self, url: str, endpoint: str, cache_dir: str, cache_bytes: int = 4 << 30,
                 **mount_kw):
        from hypercli.mount import fusefs
        mp_ = tmpdir("bench-mnt-hyper-")
        kw = {} if self.warm_entries is None else {"warm_entries": self.warm_entries}
        kw.update(mount_kw)  # e.g. server="low", serving_processes=2
        pid = fusefs.mount(url, mp_, cache_dir=cache_dir, cache_bytes=cache_bytes,
                           endpoint_url=endpoint, foreground=False, timeout=60, **kw)
        super().__init__(mp_, pid, os.path.join(cache_dir, "mount.log"))

    def stats(self) -> dict | None:
        from hypercli.mount import fusefs
        s = fusefs.mount_stats(self.mp)
        out = {k: s[k] for k in ("hits", "misses", "downloads", "bytes_downloaded",
                                 "prefetches", "errors", "verify_failures")}
        out["ops"] = s.get("ops", {})
        return out


class S3fsMount(Mount):
    kind = "s3fs"
    fusermount = "fusermount"

    OPTS = ("ro,use_path_request_style,enable_noobj_cache,stat_cache_expire=3600,"
            "kernel_cache,dbglevel=warn")

    def __init__(self, prefix: str, endpoint: str):
        mp_ = tmpdir("bench-mnt-s3fs-")
        work = tmpdir("bench-s3fs-")
        pw = os.path.join(work, "passwd")
        with open(os.open(pw, os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
            f.write(f"{CREDS['AWS_ACCESS_KEY_ID']}:{CREDS['AWS_SECRET_ACCESS_KEY']}\n")
        cache = os.path.join(work, "cache")
        log = os.path.join(work, "s3fs.log")
        cmd = ["s3fs", f"{BUCKET}:/{prefix}", mp_, "-f", "-o",
               f"{self.OPTS},url={endpoint},passwd_file={pw},use_cache={cache}"]
        with open(log, "ab") as out:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                    env=peer_env(), start_new_session=True)
        super().__init__(mp_, proc.pid, log)
        self.proc = proc
        wait_mounted(mp_, proc, 30, log)


class RcloneMount(Mount):
    kind = "rclone"

    FLAGS = ["--read-only", "--vfs-cache-mode", "full", "--dir-cache-time", "1h",
             "--attr-timeout", "1h", "--use-server-modtime"]

    def __init__(self, prefix: str, endpoint: str):
        mp_ = tmpdir("bench-mnt-rclone-")
        work = tmpdir("bench-rclone-")
        log = os.path.join(work, "rclone.log")
        cmd = ["rclone", "mount", f"bench:{BUCKET}/{prefix}", mp_, *rclone_common(work),
               *self.FLAGS, "--cache-dir", os.path.join(work, "cache"),
               "--log-file", log, "--log-level", "NOTICE"]
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env=rclone_env(endpoint),
                                start_new_session=True)
        super().__init__(mp_, proc.pid, log)
        self.proc = proc
        wait_mounted(mp_, proc, 30, log)


def rclone_common(work: str) -> list[str]:
    conf = os.path.join(work, "rclone.conf")
    Path(conf).touch()
    return ["--config", conf]


def rclone_env(endpoint: str) -> dict:
    env = peer_env()
    env.update(RCLONE_CONFIG_BENCH_TYPE="s3", RCLONE_CONFIG_BENCH_PROVIDER="Other",
               RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=CREDS["AWS_ACCESS_KEY_ID"],
               RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=CREDS["AWS_SECRET_ACCESS_KEY"],
               RCLONE_CONFIG_BENCH_REGION=CREDS["AWS_DEFAULT_REGION"],
               RCLONE_CONFIG_BENCH_ENDPOINT=endpoint)
    return env


class LocalDir(Mount):
    """The source folder itself (nothing mounted)."""

    kind = "local"

    def __init__(self, path: str):
        self.mp, self.pid, self.log = path, None, None


# ------------------------------------------------------------------------------- data

def make_small(root: str, n: int, size: int, dirs: int, seed: int) -> list[tuple[str, int]]:
    """n files of `size` random bytes in `dirs` subfolders; returns sorted (rel, size)."""
    rng = random.Random(seed)
    out = []
    for d in range(dirs):
        os.makedirs(os.path.join(root, f"class{d:02d}"), exist_ok=True)
    for i in range(n):
        rel = f"class{i % dirs:02d}/img{i:06d}.bin"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(rng.randbytes(size))
        out.append((rel, size))
    return sorted(out)


def make_large(root: str, total: int, seed: int) -> list[tuple[str, int]]:
    """~1 MB files (768-1280 KiB) of random bytes, `total` bytes in all, in 4 subfolders."""
    rng = random.Random(seed)
    out, done, i = [], 0, 0
    for d in range(4):
        os.makedirs(os.path.join(root, f"part{d}"), exist_ok=True)
    while done < total:
        size = min(rng.randint(768 * 1024, 1280 * 1024), total - done)
        rel = f"part{i % 4}/blob{i:05d}.bin"
        with open(os.path.join(root, rel), "wb") as f:
            f.write(os.urandom(size))
        out.append((rel, size))
        done += size
        i += 1
    return sorted(out)


def read_epoch(root: str, files: list[tuple[str, int]], cap: float | None = None,
               min_files: int = 50, threads: int = 1) -> dict:
    """Read each file fully (os.read of 1 MiB until EOF), one thread, in the given order;
    stop after `cap` seconds (once min_files are read). Checks every file's size.
    threads > 1: that many threads take the next file of the list in turn."""
    if threads > 1:
        return _read_parallel(root, files, cap, min_files, threads)
    n = nbytes = 0
    first = None
    t0 = time.perf_counter()
    for rel, size in files:
        fd = os.open(os.path.join(root, rel), os.O_RDONLY)
        got = 0
        try:
            while True:
                b = os.read(fd, MiB)
                if not b:
                    break
                got += len(b)
        finally:
            os.close(fd)
        if got != size:
            raise RuntimeError(f"{root}/{rel}: read {got} bytes, expected {size}")
        nbytes += got
        n += 1
        if first is None:
            first = time.perf_counter() - t0
        if cap is not None and n >= min_files and n % 16 == 0 and \
                time.perf_counter() - t0 > cap:
            break
    dt = time.perf_counter() - t0
    return {"files": n, "bytes": nbytes, "seconds": dt, "files_s": n / dt,
            "mb_s": nbytes / dt / 1e6, "first_s": first}


def _read_one(path: str, size: int) -> int:
    fd = os.open(path, os.O_RDONLY)
    got = 0
    try:
        while True:
            b = os.read(fd, MiB)
            if not b:
                break
            got += len(b)
    finally:
        os.close(fd)
    if got != size:
        raise RuntimeError(f"{path}: read {got} bytes, expected {size}")
    return got


def _read_parallel(root, files, cap, min_files, threads) -> dict:
    import threading
    lock = threading.Lock()
    state = {"next": 0, "n": 0, "bytes": 0, "first": None}
    t0 = time.perf_counter()

    def work():
        while True:
            with lock:
                i = state["next"]
                if i >= len(files) or (cap is not None and state["n"] >= min_files and
                                       time.perf_counter() - t0 > cap):
                    return
                state["next"] = i + 1
            rel, size = files[i]
            got = _read_one(os.path.join(root, rel), size)
            with lock:
                state["n"] += 1
                state["bytes"] += got
                if state["first"] is None:
                    state["first"] = time.perf_counter() - t0

    with ThreadPoolExecutor(threads) as ex:
        for f in [ex.submit(work) for _ in range(threads)]:
            f.result()
    dt = time.perf_counter() - t0
    n = state["n"]
    return {"files": n, "bytes": state["bytes"], "seconds": dt, "files_s": n / dt,
            "mb_s": state["bytes"] / dt / 1e6, "first_s": state["first"]}


def check_sample(root: str, src: str, files: list[tuple[str, int]], k: int = 3) -> None:
    """The bytes of k files (first, middle, last) are those of the source."""
    for rel, _ in (files[0], files[len(files) // 2], files[-1]):
        a = Path(root, rel).read_bytes()
        b = Path(src, rel).read_bytes()
        if hashlib.sha256(a).digest() != hashlib.sha256(b).digest():
            raise RuntimeError(f"{root}/{rel}: bytes differ from the source")


# ---------------------------------------------------------------------- bench 1: push

def boto3_client(endpoint: str, pool: int):
    import boto3
    from botocore.config import Config
    return boto3.session.Session().client(
        "s3", endpoint_url=endpoint, aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
        region_name=CREDS["AWS_DEFAULT_REGION"],
        config=Config(max_pool_connections=pool, retries={"max_attempts": 3,
                                                          "mode": "standard"}))


def push_hyper(server: Server, src: str, prefix: str, chunk_size: int = 64 * MiB,
               jobs: int = 16) -> dict:
    from hypercli.mount import pack
    c = Counter(server)
    t0 = time.perf_counter()
    rep = pack.push(src, f"s3://{BUCKET}/{prefix}", chunk_size=chunk_size, jobs=jobs,
                    endpoint_url=server.endpoint)
    dt = time.perf_counter() - t0
    http, bursts = c.stop()
    return {"seconds": dt, "files": rep.files, "http": http, "bursts": bursts,
            "chunks": rep.chunks, "bytes": rep.bytes, "kinds": c.kinds}


def push_boto3(server: Server, src: str, files, prefix: str, threads: int = 16) -> dict:
    client = boto3_client(server.endpoint, threads)

    def put(item):
        rel, _ = item
        with open(os.path.join(src, rel), "rb") as f:
            client.put_object(Bucket=BUCKET, Key=f"{prefix}/{rel}", Body=f.read())

    c = Counter(server)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        for _ in ex.map(put, files):
            pass
    dt = time.perf_counter() - t0
    http, bursts = c.stop()
    return {"seconds": dt, "files": len(files), "http": http, "bursts": bursts,
            "kinds": c.kinds}


def push_rclone(server: Server, src: str, files, prefix: str, transfers: int = 16) -> dict:
    work = tmpdir("bench-rclone-copy-")
    cmd = ["rclone", "copy", *rclone_common(work), "--transfers", str(transfers),
           "--checkers", str(transfers), "--s3-no-head", src,
           f"bench:{BUCKET}/{prefix}"]
    c = Counter(server)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=rclone_env(server.endpoint), capture_output=True, text=True,
                       timeout=1800)
    dt = time.perf_counter() - t0
    http, bursts = c.stop()
    if p.returncode != 0:
        raise RuntimeError(f"rclone copy failed ({p.returncode}): {p.stderr[-1500:]}")
    n = sum(1 for _ in boto3_client(server.endpoint, 4).get_paginator(
        "list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix + "/")
        .search("Contents[]"))
    if n != len(files):
        raise RuntimeError(f"rclone copy: {n} objects under {prefix}/, expected {len(files)}")
    return {"seconds": dt, "files": len(files), "http": http, "bursts": bursts,
            "kinds": c.kinds}


def bench_push(a, server: Server, src: str, files, results: dict) -> dict:
    keep = {}
    results["push"] = {}
    for delay in a.push_delays:
        server.delay(delay)
        print(f"\n== 1. push {len(files):,} files of {files[0][1]:,} bytes "
              f"({sum(s for _, s in files) / 1e6:.0f} MB) to S3 ({STORE['name']} on loopback), "
              f"{delay * 1000:g} ms added per request ==")
        print("   hyper: pack.push(chunk_size=64 MiB, jobs=16); boto3: put_object per file, "
              "16 threads; rclone: copy --transfers 16 --checkers 16 --s3-no-head")
        runs: dict[str, list] = {"hyper": [], "boto3": [], "rclone": []}
        sides = ["hyper", "boto3", "rclone"]
        for r in range(a.rounds):
            order = sides[r % 3:] + sides[:r % 3]
            for side in order:
                if side != "hyper" and r >= a.peer_rounds:
                    continue
                prefix = f"push-{side}-{delay * 1000:g}ms-{r}"
                la = load1()
                if side == "hyper":
                    res = push_hyper(server, src, prefix)
                elif side == "boto3":
                    res = push_boto3(server, src, files, prefix)
                else:
                    res = push_rclone(server, src, files, prefix)
                res.update(round=r, load1=la, files_s=res["files"] / res["seconds"])
                runs[side].append(res)
                if delay == a.push_delays[0]:
                    keep.setdefault(side, prefix)
                extra = f", {res['chunks']} chunk(s)" if "chunks" in res else ""
                print(f"   round {r} {side:7s} {res['seconds']:7.2f} s  {res['files_s']:8,.0f} "
                      f"files/s  {res['http']:6,} HTTP requests ({res['bursts']:,} bursts)"
                      f"{extra}  load {la:.1f}  ({kinds_str(res['kinds'])})")
        m = {s: med([x["files_s"] for x in v]) for s, v in runs.items()}
        print("   median files/s: " + ", ".join(f"{s} {fmt(v)}" for s, v in m.items()))
        for s in ("boto3", "rclone"):
            print(f"   hyper / {s}: {ratio(m['hyper'], m[s])} (goal >= 10x)")
        results["push"][f"{delay * 1000:g} ms"] = {"runs": runs, "median_files_s": m}
    server.delay(0.0)
    return keep


# --------------------------------------------------------------------- bench 2: epochs

def open_side(side: str, server: Server, prefixes: dict, src: str, cache_dir: str | None):
    if side == "hyper":
        return HyperMount(f"s3://{BUCKET}/{prefixes['hyper']}", server.endpoint, cache_dir)
    if side == "s3fs":
        return S3fsMount(prefixes["obj"], server.endpoint)
    if side == "rclone":
        return RcloneMount(prefixes["obj"], server.endpoint)
    return LocalDir(src)


def one_side(side: str, a, server: Server, prefixes: dict, src: str, files, cap,
             srcpaths) -> dict:
    """Cold then warm epochs of one side; returns {label: run dict}."""
    out = {}
    cache_dir = tmpdir("bench-cache-") if side == "hyper" else None
    drop_caches(srcpaths)
    c = Counter(server)
    t0 = time.perf_counter()
    m = open_side(side, server, prefixes, src, cache_dir)
    mount_s = time.perf_counter() - t0
    mount_http, _ = c.stop()
    try:
        c = Counter(server)
        cold = read_epoch(m.mp, files, cap)
        cold["http"], _ = c.stop()
        cold["kinds"] = c.kinds
        cold["mount_s"], cold["mount_http"] = mount_s, mount_http
        cold["stats"] = m.stats()
        out["cold"] = cold
        part = files[:cold["files"]]
        check_sample(m.mp, src, part)
        c = Counter(server)
        warm = read_epoch(m.mp, part, cap)
        warm["http"], _ = c.stop()
        warm["kinds"] = c.kinds
        out["warm (same mount)" if side != "local" else "warm (page cache)"] = warm
    finally:
        m.close()
    if side == "hyper":  # remount on the filled chunk cache: with and without page cache
        for label, drop in (("warm (remount)", False),
                            ("warm (remount, page cache dropped)", True)):
            if drop:
                drop_caches(srcpaths)
            c = Counter(server)
            t0 = time.perf_counter()
            m = open_side(side, server, prefixes, src, cache_dir)
            ms = time.perf_counter() - t0
            mh, _ = c.stop()
            try:
                c = Counter(server)
                w = read_epoch(m.mp, files)
                w["http"], _ = c.stop()
                w["mount_s"], w["mount_http"] = ms, mh
                w["stats"] = m.stats()
                out[label] = w
            finally:
                m.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
    return out


def bench_epochs(a, server: Server, src: str, files, prefixes: dict, results: dict) -> None:
    srcpaths = [os.path.join(src, r) for r, _ in files]
    rng = random.Random(7)
    shuffled = files[:]
    rng.shuffle(shuffled)
    res = results.setdefault("epochs", {})
    print(f"\n== 2. one epoch over {len(files):,} files of {files[0][1]:,} bytes, one reader "
          f"thread (cache drop: {drop_caches(srcpaths)}) ==")
    sides = a.sides
    for delay in a.delays:
        server.delay(delay)
        for order_name in a.orders:
            order = files if order_name == "sorted" else shuffled
            key = f"delay {delay * 1000:g} ms, {order_name}"
            print(f"\n-- {key} (per-object mounts capped at {a.cap_for(delay, order_name)} s "
                  f"cold) --")
            runs: dict[str, list[dict]] = {s: [] for s in sides}
            rounds = a.rounds if order_name == "sorted" else a.shuffled_rounds
            for r in range(rounds):
                rot = sides[r % len(sides):] + sides[:r % len(sides)]
                for side in rot:
                    peer = side in ("s3fs", "rclone")
                    if peer and r >= a.peer_rounds:
                        continue
                    cap = a.cap_for(delay, order_name) if peer else None
                    la = load1()
                    o = one_side(side, a, server, prefixes, src, order, cap, srcpaths)
                    o["load1"] = la
                    runs[side].append(o)
                    for label, x in o.items():
                        if label == "load1":
                            continue
                        per_k = x["http"] / x["files"] * 1000
                        more = ""
                        if "mount_s" in x:
                            more += f"  mount {x['mount_s']:.2f} s/{x['mount_http']} req"
                        if x.get("stats"):
                            s = x["stats"]
                            more += (f"  [cache: {s['downloads']} downloads "
                                     f"{s['bytes_downloaded'] / 1e6:.0f} MB, {s['hits']} hits "
                                     f"{s['misses']} misses]")
                            if s.get("ops"):
                                more += "  [ops: " + ", ".join(
                                    f"{k} {v['calls']:,}×{v['us'] / max(1, v['calls']):.0f}µs"
                                    for k, v in sorted(s["ops"].items())) + "]"
                        if x.get("kinds"):
                            more += f"  ({kinds_str(x['kinds'])})"
                        print(f"   r{r} {side:6s} {label:36s} {x['files']:6,} files "
                              f"{x['seconds']:7.2f} s {x['files_s']:8,.0f} files/s "
                              f"{per_k:8.1f} req/1k files{more}  load {la:.1f}")
            summary = {}
            for side, lst in runs.items():
                labels = [k for k in (lst[0] if lst else {}) if k != "load1"]
                for label in labels:
                    xs = [o[label] for o in lst]
                    summary[(side, label)] = {
                        "files_s": med([x["files_s"] for x in xs]),
                        "req_per_1k": med([x["http"] / x["files"] * 1000 for x in xs]),
                        "files": med([x["files"] for x in xs]), "n": len(xs)}
            g = lambda s, lab: (summary.get((s, lab)) or {}).get("files_s")  # noqa: E731
            best_cold = max(filter(None, [g("s3fs", "cold"), g("rclone", "cold")]),
                            default=None)
            best_warm = max(filter(None, [g("s3fs", "warm (same mount)"),
                                          g("rclone", "warm (same mount)")]), default=None)
            local_cold, local_warm = g("local", "cold"), g("local", "warm (page cache)")
            print(f"   {'side':7s} {'run':36s} {'files/s':>9s} {'req/1k':>8s} "
                  f"{'vs best per-object':>19s} {'vs local':>9s}  (medians, n runs)")
            for (side, label), v in summary.items():
                cold = label == "cold"
                best = best_cold if cold else best_warm
                loc = local_cold if cold else local_warm
                print(f"   {side:7s} {label:36s} {fmt(v['files_s']):>9s} "
                      f"{v['req_per_1k']:8.1f} {ratio(v['files_s'], best):>19s} "
                      f"{ratio(v['files_s'], loc, '.2f'):>9s}  n={v['n']}")
            for lab in ("cold", "warm (remount)", "warm (remount, page cache dropped)"):
                h = g("hyper", lab)
                ok = h and local_cold and h / local_cold >= 0.7
                print(f"   goal first touch: hyper {lab} >= 0.7x local cold: "
                      f"{ratio(h, local_cold, '.2f')} -> {'met' if ok else 'NOT met'}")
            goal = 20 if delay > 0 else 5
            hc = g("hyper", "cold")
            print(f"   goal cold: hyper >= {goal}x best per-object mount: "
                  f"{ratio(hc, best_cold)} -> {'met' if hc and best_cold and hc / best_cold >= goal else 'NOT met'}")
            for lab in ("warm (same mount)", "warm (remount)",
                        "warm (remount, page cache dropped)"):
                hw = g("hyper", lab)
                ok = hw and local_warm and local_warm / hw <= 2
                print(f"   goal warm: hyper {lab} within 2x of local warm: local/hyper = "
                      f"{ratio(local_warm, hw, '.2f')} -> {'met' if ok else 'NOT met'}")
            res[key] = {"runs": runs, "summary": {f"{s}|{lab}": v for (s, lab), v
                                                  in summary.items()}}
    server.delay(0)


def bench_parallel(a, server: Server, src: str, files, prefixes: dict, results: dict) -> None:
    """2b: cold epochs with several reader threads at 20 ms per request (one run each)."""
    srcpaths = [os.path.join(src, r) for r, _ in files]
    server.delay(0.02)
    print(f"\n-- 2b. cold, sorted, delay 20 ms, {a.par_threads} reader threads (each takes the "
          f"next file of the list), cap {a.par_cap} s for every side, one run each --")
    out = {}
    for side in a.sides:
        cache_dir = tmpdir("bench-cache-") if side == "hyper" else None
        drop_caches(srcpaths)
        la = load1()
        m = open_side(side, server, prefixes, src, cache_dir)
        try:
            c = Counter(server)
            x = read_epoch(m.mp, files, a.par_cap, threads=a.par_threads)
            x["http"], _ = c.stop()
            x["kinds"] = c.kinds
        finally:
            m.close()
        if cache_dir:
            shutil.rmtree(cache_dir, ignore_errors=True)
        x["load1"] = la
        out[side] = x
        print(f"   {side:6s} {x['files']:6,} files {x['seconds']:6.2f} s {x['files_s']:8,.0f} "
              f"files/s {x['http'] / x['files'] * 1000:8.1f} req/1k files  "
              f"({kinds_str(x['kinds'])})  load {la:.1f}")
    best = max((out[p]["files_s"] for p in ("s3fs", "rclone") if p in out), default=None)
    h = (out.get("hyper") or {}).get("files_s")
    loc = (out.get("local") or {}).get("files_s")
    print(f"   hyper / best per-object: {ratio(h, best)} (goal >= 20x), hyper / local cold: "
          f"{ratio(h, loc, '.2f')}")
    results["parallel"] = out
    server.delay(0)


def _pin(pid: int, cpu: int | None) -> None:
    """Pin every thread of a process to one CPU (None: all CPUs)."""
    cpus = set(range(os.cpu_count() or 1)) if cpu is None else {cpu}
    for t in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(t), cpus)
        except OSError:
            pass


def bench_roundtrip(a, server: Server, prefixes: dict, results: dict) -> None:
    """2c: what one request to the mount's daemon costs, by where the reader and the daemon
    run: ``os.getxattr`` of a missing attribute on a folder of the mount (one request whose
    handler does a dict lookup), 20,000 times; the same on local disk for reference."""
    n = 20_000
    cpus = os.cpu_count() or 1
    print(f"\n-- 2c. one request's round trip: {n:,} getxattr of a missing attribute, reader "
          f"and daemon on the same CPU, on different CPUs, and unpinned --")
    cache_dir = tmpdir("bench-cache-")
    m = open_side("hyper", server, prefixes, "", cache_dir)
    out = {}
    me = os.getpid()
    try:
        folder = os.path.join(m.mp, os.listdir(m.mp)[0])
        for label, reader, daemon in (("same CPU", 0, 0), ("other CPU", 0, min(1, cpus - 1)),
                                      ("unpinned", None, None)):
            _pin(m.pid, daemon)
            _pin(me, reader)
            before = m.stats()["ops"].get("getxattr", {"calls": 0, "us": 0})
            dt = _getxattrs(folder, n)
            after = m.stats()["ops"]["getxattr"]
            handler = (after["us"] - before["us"]) / max(1, after["calls"] - before["calls"])
            out[label] = {"us": dt / n * 1e6, "handler_us": handler}
            print(f"   {label:9s} {dt / n * 1e6:6.1f} µs a request ({handler:.1f} µs of it in "
                  f"the handler)")
    finally:
        _pin(me, None)
        m.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
    local = tmpdir("bench-rt-local-")
    out["local disk"] = {"us": _getxattrs(local, n) / n * 1e6}
    print(f"   local disk {out['local disk']['us']:5.1f} µs a getxattr (no daemon)")
    results["roundtrip"] = out


def _getxattrs(path: str, n: int) -> float:
    """Seconds that ``n`` getxattr calls of a name ``path`` has not take (each a request
    to a FUSE daemon, or none on local disk)."""
    t0 = time.perf_counter()
    for _ in range(n):
        try:
            os.getxattr(path, "user.none")
        except OSError:
            pass
    return time.perf_counter() - t0


def bench_warm(a, server: Server, results: dict) -> None:
    """2d: the cost of warming at mount: a dataset of ``a.warm_files`` empty files in folders
    of 1,000, mounted with ``warm_entries=0`` and with the default (which lists them all):
    mount time, kernel slab memory added (``Slab`` of /proc/meminfo), and, against it, a cold
    ``os.scandir`` walk of the same tree on local disk (page cache dropped)."""
    from hypercli.mount import fusefs, pack
    src = tmpdir("bench-warm-src-")
    n = a.warm_files
    for i in range(n):
        d = os.path.join(src, f"f{i // 1000:04d}")
        if i % 1000 == 0:
            os.mkdir(d)
        open(os.path.join(d, f"e{i:07d}"), "wb").close()
    prefix = f"warm-{int(time.time())}"
    pack.push(src, f"s3://{BUCKET}/{prefix}", endpoint_url=server.endpoint)
    print(f"\n-- 2d. warming at mount: {n:,} entries in folders of 1,000 --")

    def slab() -> int:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("Slab:"):
                    return int(line.split()[1]) * 1024
        return 0
    out = {}
    for label, entries in (("warm_entries=0", 0), (f"warm_entries={fusefs.WARM_ENTRIES:,}",
                                                    fusefs.WARM_ENTRIES)):
        cache_dir = tmpdir("bench-cache-")
        url = f"s3://{BUCKET}/{prefix}"
        kw = dict(cache_dir=cache_dir, cache_bytes=1 << 30, endpoint_url=server.endpoint,
                  foreground=False)
        mp0 = tmpdir("bench-mnt-warm-")  # a first mount fetches the index (not timed)
        Mount(mp0, fusefs.mount(url, mp0, warm_entries=0, **kw)).close()
        for _ in range(2):  # slab objects are freed after an RCU grace period
            drop_caches()
            time.sleep(1.0)
        s0 = slab()
        mp_ = tmpdir("bench-mnt-warm-")
        t0 = time.perf_counter()
        pid = fusefs.mount(url, mp_, warm_entries=entries, **kw)
        dt = time.perf_counter() - t0
        m = Mount(mp_, pid)
        grown = slab() - s0
        ops = fusefs.mount_stats(mp_)["ops"]
        m.close()
        shutil.rmtree(cache_dir, ignore_errors=True)
        out[label] = {"mount_s": dt, "slab_bytes": grown, "ops": ops}
        print(f"   hyper mount, {label:22s} {dt:6.2f} s  kernel slab +{grown / 2**20:6.1f} MiB "
              f"({grown / n:5.0f} bytes an entry)")
    drop_caches()
    t0 = time.perf_counter()
    k = 0
    for d in sorted(os.listdir(src)):
        with os.scandir(os.path.join(src, d)) as it:
            k += sum(1 for _ in it)
    out["local cold walk"] = {"s": time.perf_counter() - t0, "entries": k}
    print(f"   local disk, os.scandir of every folder, cold: "
          f"{out['local cold walk']['s']:.2f} s")
    extra = out[f"warm_entries={fusefs.WARM_ENTRIES:,}"]["mount_s"] - out["warm_entries=0"][
        "mount_s"]
    print(f"   warming {n:,} entries adds {extra:.2f} s to the mount "
          f"({extra / n * 1e6:.1f} µs an entry)")
    results["warm"] = out
    shutil.rmtree(src, ignore_errors=True)


# -------------------------------------------------------------------- bench 3: sweep

def bench_sweep(a, results: dict) -> None:
    src = tmpdir("bench-sweep-src-")
    t0 = time.perf_counter()
    files = make_large(src, a.sweep_bytes, seed=3)
    total = sum(s for _, s in files)
    srcpaths = [os.path.join(src, r) for r, _ in files]
    print(f"\n== 3. chunk-size sweep: {len(files)} files of ~1 MB, {total / 1e6:.0f} MB "
          f"(made in {time.perf_counter() - t0:.1f} s), cold sequential read through the "
          f"mount at {a.sweep_delay * 1000:g} ms per request ==")
    server = Server()
    server.bucket(BUCKET)
    pushed = {}
    for cs in a.chunk_sizes:
        p = push_hyper(server, src, f"sweep-{cs}", chunk_size=cs * MiB)
        pushed[cs] = p
        print(f"   pushed {cs:4d} MiB chunks: {p['chunks']:4d} chunks (mean "
              f"{total / p['chunks'] / MiB:6.1f} MiB) in {p['seconds']:.1f} s, "
              f"{p['http']} HTTP requests")
    server.delay(a.sweep_delay)
    runs: dict[int, list] = {cs: [] for cs in a.chunk_sizes}
    local = []
    for r in range(a.sweep_rounds):
        sizes = a.chunk_sizes[r % len(a.chunk_sizes):] + a.chunk_sizes[:r % len(a.chunk_sizes)]
        for cs in sizes:
            cache_dir = tmpdir("bench-sweep-cache-")
            drop_caches(srcpaths)
            la = load1()
            c = Counter(server)
            t0 = time.perf_counter()
            m = HyperMount(f"s3://{BUCKET}/sweep-{cs}", server.endpoint, cache_dir)
            mount_s = time.perf_counter() - t0
            try:
                x = read_epoch(m.mp, files)
                x["stats"] = m.stats()
            finally:
                m.close()
            x["http"], _ = c.stop()
            x.update(mount_s=mount_s, load1=la)
            shutil.rmtree(cache_dir, ignore_errors=True)
            runs[cs].append(x)
            print(f"   r{r} {cs:4d} MiB: {x['mb_s']:7.1f} MB/s  {x['seconds']:6.2f} s  first "
                  f"file {x['first_s'] * 1000:6.0f} ms  mount {mount_s:.2f} s  "
                  f"{x['http']} requests ({x['stats']['downloads']} chunk downloads)  "
                  f"load {la:.1f}")
        drop_caches(srcpaths)
        x = read_epoch(src, files)
        local.append(x)
        print(f"   r{r} local disk cold: {x['mb_s']:7.1f} MB/s")
    server.stop()
    print(f"   {'chunk':>9s} {'chunks':>6s} {'MB/s':>8s} {'first file':>11s} "
          f"{'requests':>8s}  (medians over {a.sweep_rounds} runs)")
    summ = {}
    for cs in a.chunk_sizes:
        v = {"mb_s": med([x["mb_s"] for x in runs[cs]]),
             "first_ms": med([x["first_s"] * 1000 for x in runs[cs]]),
             "http": med([x["http"] for x in runs[cs]]), "chunks": pushed[cs]["chunks"]}
        summ[cs] = v
        print(f"   {cs:5d} MiB {v['chunks']:6d} {v['mb_s']:8.1f} {v['first_ms']:9.0f} ms "
              f"{v['http']:8.0f}")
    lm = med([x["mb_s"] for x in local])
    print(f"   local disk cold: {lm:.1f} MB/s")
    best = max(summ, key=lambda k: summ[k]["mb_s"])
    print(f"   best chunk size here: {best} MiB ({best * MiB / 1e6:.0f} MB); the paper's "
          f"figure 2: best between 12 and 100 MB")
    results["sweep"] = {"pushed": pushed, "runs": runs, "local": local,
                        "summary": summ, "total_bytes": total, "files": len(files)}


# -------------------------------------------------------------------------------- main

def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", action="store_true", help="smaller, ~3 minutes")
    g.add_argument("--full", action="store_true", help="bigger: peers repeated, no caps "
                   "at 0 ms, 600 MB sweep with 1-256 MiB chunks")
    p.add_argument("--only", default="1,2,3", help="benchmarks to run, e.g. 2 or 1,3")
    p.add_argument("--json", help="write the raw figures to this file")
    p.add_argument("--sides", default="hyper,s3fs,rclone,local",
                   help="the sides of benchmark 2, e.g. hyper,local (peers left out)")
    p.add_argument("--warm-entries", type=int, help="the hyper mounts' warm_entries "
                   "(default: the mount's own, 100,000; 0: no listing at mount)")
    p.add_argument("--delays", dest="delays_ms",
                   help="per-request delays of benchmark 2 in ms, e.g. 0,20")
    p.add_argument("--store", choices=["s3rver", "moto"], default="s3rver",
                   help="S3 API server on loopback: npm s3rver (default; faster per request "
                   "here) or moto_server")
    a = p.parse_args()
    only = {int(x) for x in a.only.split(",")}
    a.push_delays = [0.0, 0.02]
    a.sides = [x for x in a.sides.split(",") if x]
    HyperMount.warm_entries = a.warm_entries
    if not set(a.sides) <= {"hyper", "s3fs", "rclone", "local"}:
        p.error(f"--sides: one or more of hyper, s3fs, rclone, local, not {a.sides}")
    if a.quick:
        a.files, a.rounds, a.peer_rounds, a.shuffled_rounds = 3000, 1, 1, 1
        a.orders, a.delays = ["sorted"], [0.0, 0.02]
        caps = {0.0: 10, 0.02: 10}
        a.sweep_bytes, a.chunk_sizes, a.sweep_rounds = 96 * MiB, [1, 4, 16, 32], 1
    elif a.full:
        a.files, a.rounds, a.peer_rounds, a.shuffled_rounds = 10000, 3, 3, 3
        a.orders, a.delays = ["sorted", "shuffled"], [0.0, 0.02]
        caps = {0.0: 600, 0.02: 120}
        a.sweep_bytes, a.chunk_sizes, a.sweep_rounds = 600 * MiB, [1, 4, 16, 64, 128, 256], 3
    else:
        a.files, a.rounds, a.peer_rounds, a.shuffled_rounds = 10000, 3, 1, 1
        a.orders, a.delays = ["sorted", "shuffled"], [0.0, 0.02]
        caps = {0.0: 20, 0.02: 20}
        a.sweep_bytes, a.chunk_sizes, a.sweep_rounds = 320 * MiB, [4, 16, 64, 128], 2
    if a.delays_ms:
        a.delays = [float(x) / 1000 for x in a.delays_ms.split(",")]
    a.cap_for = lambda delay, order: caps[delay] if order == "sorted" else \
        max(5, caps[delay] // 2)
    a.sweep_delay = 0.02
    a.par_threads, a.par_cap = 8, (10 if not a.full else 60)
    a.warm_files = 20_000 if a.quick else 100_000
    if os.geteuid() != 0:
        print("warning: not root: FUSE mounts and drop_caches may fail", file=sys.stderr)
    for tool in ("s3fs", "rclone", "fusermount", "fusermount3"):
        if not shutil.which(tool):
            print(f"missing {tool}: apt-get install -y s3fs rclone fuse3", file=sys.stderr)
            return 2

    if a.store == "s3rver":
        exe = shutil.which("s3rver")
        if not exe:
            print("missing s3rver: npm install -g s3rver@3 (or --store moto)", file=sys.stderr)
            return 2
        CREDS.update(AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
    else:
        exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    STORE.update(name=a.store, exe=exe)
    import importlib.metadata as md
    store_v = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout.strip() \
        if a.store == "s3rver" else md.version("moto")

    home = tmpdir("hyper-bench-storage-home-")
    os.environ["HYPER_HOME"] = home
    os.environ.update(CREDS)
    os.environ.pop("HYPER_S3_ENDPOINT_URL", None)
    results: dict = {"args": {k: v for k, v in vars(a).items() if k != "cap_for"},
                     "caps": {str(k): v for k, v in caps.items()}}
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hypercli"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    rclone_v = subprocess.run(["rclone", "version"], capture_output=True,
                              text=True).stdout.splitlines()[0]
    s3fs_v = re.search(r"V[0-9.]+", subprocess.run(["s3fs", "--version"], capture_output=True,
                                                   text=True).stdout).group(0)
    print(f"bench_storage: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, hypercli {rev}"
          f"{' + uncommitted changes in hypercli/' if dirty else ''}, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}, boto3 {md.version('boto3')}")
    print(f"S3 server: {a.store} {store_v} on 127.0.0.1 behind a counting proxy; peers: "
          f"{rclone_v}, s3fs {s3fs_v}")
    print("load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    t_all = time.perf_counter()
    try:
        if only & {1, 2}:
            src = tmpdir("bench-src-")
            t0 = time.perf_counter()
            files = make_small(src, a.files, 10_000, 10, seed=1)
            print(f"made {len(files):,} files in {time.perf_counter() - t0:.1f} s")
            server = Server()
            server.bucket(BUCKET)
            prefixes = {}
            if 1 in only:
                keep = bench_push(a, server, src, files, results)
                prefixes = {"hyper": keep["hyper"], "obj": keep["boto3"]}
            if 2 in only:
                if not prefixes:
                    print("\n(setup for 2: hyper push and per-object upload, not timed)")
                    prefixes = {"hyper": "push-hyper-0", "obj": "push-boto3-0"}
                    push_hyper(server, src, prefixes["hyper"])
                    push_boto3(server, src, files, prefixes["obj"])
                bench_epochs(a, server, src, files, prefixes, results)
                if a.par_threads > 1:
                    bench_parallel(a, server, src, files, prefixes, results)
                if "hyper" in a.sides:
                    bench_roundtrip(a, server, prefixes, results)
                    bench_warm(a, server, results)
            server.stop()
            shutil.rmtree(src, ignore_errors=True)
        if 3 in only:
            bench_sweep(a, results)
    finally:
        for fn in reversed(CLEANUP):
            try:
                fn()
            except Exception as e:  # keep cleaning
                print(f"cleanup: {e}", file=sys.stderr)
        for d in TEMP_DIRS:
            if not mounted(d):
                shutil.rmtree(d, ignore_errors=True)
    print(f"\ntotal {time.perf_counter() - t_all:.0f} s, load {load1():.1f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
