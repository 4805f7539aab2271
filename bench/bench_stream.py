#!/usr/bin/env python3
"""Large files through the mount: sequential reads against boto3's parallel download and local
disk, on a real S3 API server on loopback (npm s3rver behind bench_storage.py's counting proxy,
which can add a delay per HTTP request; needs root for FUSE and ``drop_caches``).

Data: ``--files`` (default 8) files of ``--file-mib`` (default 512) MiB of random bytes, pushed
once with ``hypercli.mount.pack.push`` (64 MiB chunks) and uploaded once per object with
boto3's ``upload_file`` (the peer's copy).

Per delay (0 and 20 ms per request) and reader count (1: the files one after the other; 8: one
thread per file, all at once), each side cold:
  hyper   a fresh ``fusefs.mount`` daemon over a fresh chunk cache whose cap is half the data
          (``--cap-mib``, default 2,048), page cache dropped; reads with ``os.read`` of 1 MiB
          to EOF. The mount's own settings (``prefetch`` chunks read ahead, ``jobs`` download
          threads) are its defaults. The cache folder's size is sampled every 0.1 s: its peak
          must stay under the cap.
  boto3   ``client.download_file(bucket, key, path, Config=TransferConfig(max_concurrency=J,
          multipart_chunksize=8 MiB))`` into a temp folder (deleted after), J = the mount's
          ``jobs`` (the same concurrency), the files in the same order / threads.
  local   the same files on local disk after ``drop_caches``, read like the mount.
Figures: MB/s per side, hyper / boto3 (goal >= 0.9x) and hyper / local; HTTP requests; the
CPU seconds used during each run by this process (the readers, or boto3's threads), the S3
server, the proxy and the mount daemon (``/proc/PID/stat``), which show where the cores went.

Usage (from the repo root, as root):
    python bench/bench_stream.py [--files 8] [--file-mib 512] [--cap-mib 2048] [--rounds 1]
                                 [--delays 0,20] [--readers 1,all]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import bench_storage as S  # noqa: E402  (S3 server, proxy, mounts, cache drop)

MiB = 1 << 20


def make_files(root: str, n: int, mib: int) -> list[tuple[str, int]]:
    out = []
    block = 8 * MiB
    for i in range(n):
        rel = f"big{i}.bin"
        with open(os.path.join(root, rel), "wb") as f:
            for _ in range(mib * MiB // block):
                f.write(os.urandom(block))
        out.append((rel, mib * MiB))
    return out


def read_all(root: str, files, readers: int) -> float:
    """Read every file to EOF (1 MiB reads), one after the other or one thread per file;
    returns seconds. Checks each file's size."""
    def one(rel, size):
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
            raise AssertionError(f"{rel}: read {got} bytes, expected {size}")
    t0 = time.perf_counter()
    if readers == 1:
        for rel, size in files:
            one(rel, size)
    else:
        errs = []

        def run(rel, size):
            try:
                one(rel, size)
            except Exception as e:  # reported below
                errs.append(e)
        ts = [threading.Thread(target=run, args=f) for f in files]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        if errs:
            raise errs[0]
    return time.perf_counter() - t0


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) a process has used so far, from /proc/PID/stat."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except OSError:
        return 0.0


class CpuMeter:
    """CPU seconds used during a side's run by: this process (its readers or boto3's
    threads), the S3 server, the counting proxy, and the mount's daemon (``daemon`` pid)."""

    def __init__(self, server):
        self.pids = {"bench": os.getpid(), "s3 server": server.server_pid,
                     "proxy": server.proc.pid}
        self.start = {k: cpu_s(p) for k, p in self.pids.items()}

    def stop(self, daemon: int | None = None, daemon_start: float = 0.0) -> dict:
        out = {k: cpu_s(p) - self.start[k] for k, p in self.pids.items()}
        if daemon is not None:
            out["mount daemon"] = cpu_s(daemon) - daemon_start
        return out


def du(path: str) -> int:
    total = 0
    for dp, _, fs in os.walk(path):
        for f in fs:
            try:
                total += os.lstat(os.path.join(dp, f)).st_blocks * 512
            except OSError:
                pass
    return total


def hyper_side(server, prefix, files, readers, cap) -> dict:
    cache = S.tmpdir("bench-stream-cache-")
    m = S.HyperMount(f"s3://{S.BUCKET}/{prefix}", server.endpoint, cache, cache_bytes=cap)
    peak = [0]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.1):
            peak[0] = max(peak[0], du(os.path.join(cache, "chunks")))
    try:
        S.drop_caches()
        c = S.Counter(server)
        cpu, d0 = CpuMeter(server), cpu_s(m.pid)
        th = threading.Thread(target=sample, daemon=True)
        th.start()
        dt = read_all(m.mp, files, readers)
        stop.set()
        th.join()
        http, _ = c.stop()
        cpu = cpu.stop(m.pid, d0)
        stats = m.stats()
    finally:
        stop.set()
        m.close()
        shutil.rmtree(cache, ignore_errors=True)
    return {"seconds": dt, "http": http, "peak_cache": peak[0], "stats": stats, "cpu": cpu}


def boto3_side(server, prefix, files, readers, jobs) -> dict:
    from boto3.s3.transfer import TransferConfig
    client = S.boto3_client(server.endpoint, max(10, jobs * readers))
    cfg = TransferConfig(max_concurrency=jobs, multipart_chunksize=8 * MiB,
                         multipart_threshold=8 * MiB)
    dest = S.tmpdir("bench-stream-boto3-")
    S.drop_caches()
    c = S.Counter(server)
    cpu = CpuMeter(server)

    def one(rel, _size):
        client.download_file(S.BUCKET, f"{prefix}/{rel}", os.path.join(dest, rel), Config=cfg)
    t0 = time.perf_counter()
    if readers == 1:
        for f in files:
            one(*f)
    else:
        ts = [threading.Thread(target=one, args=f) for f in files]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    os.sync()  # the bytes are on disk, as the mount's chunks are
    dt = time.perf_counter() - t0
    http, _ = c.stop()
    cpu = cpu.stop()
    for rel, size in files:
        assert os.path.getsize(os.path.join(dest, rel)) == size, rel
    shutil.rmtree(dest, ignore_errors=True)
    return {"seconds": dt, "http": http, "cpu": cpu}


def local_side(src, files, readers) -> dict:
    S.drop_caches()
    return {"seconds": read_all(src, files, readers), "http": 0}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--file-mib", type=int, default=512)
    ap.add_argument("--cap-mib", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--delays", default="0,20", help="ms added per request")
    ap.add_argument("--readers", default="1,all", help="reader counts: 1 and/or all "
                    "(one per file)")
    a = ap.parse_args()
    exe = shutil.which("s3rver")
    if not exe:
        print("missing s3rver: npm install -g s3rver@3", file=sys.stderr)
        return 2
    S.CREDS.update(AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
    S.STORE.update(name="s3rver", exe=exe)
    home = S.tmpdir("hyper-bench-stream-home-")
    os.environ["HYPER_HOME"] = home
    os.environ.update(S.CREDS)
    os.environ.pop("HYPER_S3_ENDPOINT_URL", None)
    from hypercli.mount import fusefs
    import inspect
    defaults = inspect.signature(fusefs.mount).parameters
    jobs = defaults["jobs"].default
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=S.ROOT,
                         capture_output=True, text=True).stdout.strip()
    counts = [1 if x == "1" else a.files for x in a.readers.split(",")]
    total = a.files * a.file_mib * MiB
    cap = a.cap_mib * MiB
    print(f"bench_stream: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, hypercli {rev}, "
          f"{os.cpu_count()} cores; {a.files} x {a.file_mib} MiB; mount prefetch "
          f"{defaults['prefetch'].default}, jobs {jobs}; cache cap {a.cap_mib} MiB; load "
          + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    res: dict = {}
    try:
        src = S.tmpdir("bench-stream-src-")
        files = make_files(src, a.files, a.file_mib)
        server = S.Server()
        server.bucket(S.BUCKET)
        S.push_hyper(server, src, "hyper")
        up = S.boto3_client(server.endpoint, 16)
        for rel, _ in files:
            up.upload_file(os.path.join(src, rel), S.BUCKET, f"obj/{rel}")
        print("pushed (not timed)", flush=True)
        for delay in [int(x) for x in a.delays.split(",")]:
            server.delay(delay / 1000)
            for readers in counts:
                for r in range(a.rounds):
                    for side in ("hyper", "boto3", "local"):
                        if side == "hyper":
                            x = hyper_side(server, "hyper", files, readers, cap)
                        elif side == "boto3":
                            x = boto3_side(server, "obj", files, readers, jobs)
                        else:
                            x = local_side(src, files, readers)
                        mbs = total / x["seconds"] / 1e6
                        res.setdefault((delay, readers, side), []).append((mbs, x))
                        extra = ""
                        if x.get("cpu"):
                            extra += ", CPU s: " + ", ".join(
                                f"{k} {v:.1f}" for k, v in x["cpu"].items())
                        if side == "hyper":
                            extra += (f", cache peak {x['peak_cache'] / MiB:,.0f} MiB (cap "
                                     f"{a.cap_mib:,}), {x['stats']}")
                        print(f"   {delay:2d} ms, {readers} reader(s), {side:5s}: "
                              f"{x['seconds']:6.2f} s {mbs:7.0f} MB/s, {x['http']} HTTP "
                              f"requests{extra}  load {S.load1():.1f}", flush=True)
        server.stop()
    finally:
        for fn in reversed(S.CLEANUP):
            try:
                fn()
            except Exception as e:  # keep cleaning
                print(f"cleanup: {e}", file=sys.stderr)
        for d in S.TEMP_DIRS:
            if not S.mounted(d):
                shutil.rmtree(d, ignore_errors=True)
    print("\n| delay | readers | hyper MB/s | boto3 MB/s | local MB/s | hyper/boto3 | "
          "hyper/local | cache peak / cap |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for delay in [int(x) for x in a.delays.split(",")]:
        for readers in counts:
            m = {s: statistics.median(v[0] for v in res[(delay, readers, s)])
                 for s in ("hyper", "boto3", "local")}
            peak = max(v[1]["peak_cache"] for v in res[(delay, readers, "hyper")])
            print(f"| {delay} ms | {readers} | {m['hyper']:,.0f} | {m['boto3']:,.0f} | "
                  f"{m['local']:,.0f} | {m['hyper'] / m['boto3']:.2f}× | "
                  f"{m['hyper'] / m['local']:.2f}× | {peak / cap:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
