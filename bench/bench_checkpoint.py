#!/usr/bin/env python3
"""Checkpoint cost: hypercli's checkpoint store against ``rclone sync``, on a real S3 API
server on loopback.

The workload is a task that writes a 200 MiB checkpoint every 10 s with 1 MiB changing between
saves. The folder looks like a torch training checkpoint (random bytes, incompressible like
float weights)::

    model.pt            192 MiB   weights
    optimizer.pt          8 MiB - 40 KiB   optimizer state (not rewritten between saves)
    rng_state.pth        ~15 KiB
    scheduler.pt          1 KiB
    trainer_state.json   ~200 B   step, loss, time: rewritten at every save

Between two saves 1 MiB of ``model.pt`` is overwritten in place, contiguous, at a random
offset (seeded, 4-byte aligned like a float32 tensor, not block-aligned), and
``trainer_state.json`` is rewritten. "Changed bytes" of a sync = 1 MiB + that file's size.

1. Saves: one first (full) save, then ``--saves`` saves (default 6) each after one change.
   The two sides alternate who goes first; they save the same folder state.
     ours    ``hypercli.mount.checkpoint.save(folder, s3://bench/ours, attempt=1, state)``
             (256 KiB blocks, one pack of the new blocks + one generation manifest per save)
     rclone  ``rclone sync FOLDER bench:bench/rclone`` (rclone 1.60 defaults: 4 transfers,
             size+modtime then MD5 check; a changed file is uploaded whole)
   Per sync: wall time; bytes uploaded as each side reports it (SaveReport.uploaded: the pack;
   rclone's final ``stats.bytes`` from ``--use-json-log``); and the bytes the server received,
   counted from the bucket: the sizes of the objects that are new or whose ETag changed
   since the previous listing (ours: pack + manifest). Ratio to the changed bytes.
   The 10 s cadence does not change what is measured (what is sent depends only on what
   changed), so saves run back to back unless ``--realtime`` (then one starts every 10 s).

2. Restore, the time an attempt waits at start: into an empty folder, ``--rounds`` times
   (default 3), sides alternating, medians:
     ours    ``hypercli.mount.checkpoint.restore(s3://bench/ours, EMPTY, fresh state file)``
             (a new node: no state, default 8 download threads)
     rclone  ``rclone copy bench:bench/rclone EMPTY`` (defaults: 4 transfers)
   Page cache dropped before each (``sync; echo 3 > /proc/sys/vm/drop_caches``, root) when
   that works; otherwise caches are warm for both, and the output says so. MB/s = folder
   bytes / wall time. Every restored folder is compared byte for byte with the source.

Goals: ours <= 1.2x the changed bytes uploaded per sync; restore at >= 0.8x ``rclone copy``'s
throughput.

The server is npm ``s3rver`` (``npm install -g s3rver@3``; objects as files in a temp folder)
or ``moto_server`` (``--store moto``, from the venv), started on 127.0.0.1 in its own session
and stopped by its PID; no proxy in between (all traffic is loopback).

Usage (from the repo root, as root for drop_caches):
    python bench/bench_checkpoint.py [--saves N] [--rounds N] [--realtime] [--store s3rver|moto]
                                     [--json FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

KiB, MiB = 1 << 10, 1 << 20
BUCKET = "bench"
CREDS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
         "AWS_DEFAULT_REGION": "us-east-1"}
MODEL_SIZE = 192 * MiB
CHANGE = 1 * MiB
CADENCE = 10.0

TEMP_DIRS: list[str] = []


def tmpdir(prefix: str) -> str:
    d = tempfile.mkdtemp(prefix=prefix)
    TEMP_DIRS.append(d)
    return d


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# ----------------------------------------------------------------------------- S3 server

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """s3rver or moto_server on a free loopback port, in its own session; stop() by PID."""

    def __init__(self, store: str, exe: str):
        self.store, self.exe = store, exe
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.dir = tmpdir("bench-ckpt-s3-")
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        log = open(os.path.join(self.dir, "server.log"), "ab")
        if self.store == "s3rver":
            # s3rver 3.7's listing continuation tokens need the legacy OpenSSL provider
            env = dict(os.environ, NODE_OPTIONS="--openssl-legacy-provider")
            cmd = [self.exe, "-d", os.path.join(self.dir, "data"), "-a", "127.0.0.1",
                   "-p", str(self.port), "--silent"]
        else:
            env = dict(os.environ, **CREDS)
            cmd = [self.exe, "-H", "127.0.0.1", "-p", str(self.port)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                     env=env, start_new_session=True)
        log.close()
        end = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return self
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > end:
                    self.stop()
                    raise RuntimeError(f"{self.store} did not start "
                                       f"(log: {os.path.join(self.dir, 'server.log')})")
                time.sleep(0.05)

    def stop(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)   # the server leads its own session
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    def client(self):
        import boto3
        return boto3.session.Session().client(
            "s3", endpoint_url=self.endpoint, aws_access_key_id=CREDS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDS["AWS_DEFAULT_REGION"])


def listing(client, prefix: str) -> dict[str, tuple[int, str]]:
    """key → (size, ETag) of every object under prefix/."""
    out = {}
    for page in client.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                 Prefix=prefix + "/"):
        for o in page.get("Contents", []):
            out[o["Key"]] = (o["Size"], o["ETag"])
    return out


def received(before: dict, after: dict) -> tuple[int, int]:
    """(bytes, objects) the server stored between two listings: new or changed objects."""
    new = [v for k, v in after.items() if before.get(k) != v]
    return sum(s for s, _ in new), len(new)


# ------------------------------------------------------------------------------ workload

def write_random(path: Path, size: int, rng: random.Random) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            n = min(left, 8 * MiB)
            f.write(rng.randbytes(n))
            left -= n


def step_state(step: int, rng: random.Random) -> bytes:
    return json.dumps({"global_step": step, "epoch": step // 100, "loss": round(
        2.5 * 0.999 ** step + rng.random() * 0.01, 6), "learning_rate": 3e-4,
        "time": time.time(), "checkpoint": f"step-{step:06d}",
        "best_metric": None}, indent=2).encode() + b"\n"


def make_checkpoint(folder: Path, rng: random.Random) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    write_random(folder / "model.pt", MODEL_SIZE, rng)
    write_random(folder / "optimizer.pt", 8 * MiB - 40 * KiB, rng)
    write_random(folder / "rng_state.pth", 15 * KiB + 333, rng)
    write_random(folder / "scheduler.pt", 1 * KiB + 63, rng)
    (folder / "trainer_state.json").write_bytes(step_state(0, rng))


def change(folder: Path, step: int, rng: random.Random) -> tuple[int, int]:
    """1 MiB of model.pt overwritten in place at a random 4-byte aligned offset, the step file
    rewritten. Returns (offset, bytes changed)."""
    off = rng.randrange(0, (MODEL_SIZE - CHANGE) // 4) * 4
    with open(folder / "model.pt", "r+b") as f:
        f.seek(off)
        f.write(rng.randbytes(CHANGE))
    data = step_state(step, rng)
    with open(folder / "trainer_state.json", "wb") as f:
        f.write(data)
    return off, CHANGE + len(data)


def folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def digests(folder: Path) -> dict[str, str]:
    out = {}
    for p in sorted(folder.rglob("*")):
        if p.is_file():
            h = hashlib.sha256()
            with open(p, "rb") as f:
                for b in iter(lambda: f.read(4 * MiB), b""):
                    h.update(b)
            out[p.relative_to(folder).as_posix()] = h.hexdigest()
    return out


# ---------------------------------------------------------------------------------- sides

def rclone_env(endpoint: str) -> dict:
    env = dict(os.environ, **CREDS)
    env.pop("AWS_CA_BUNDLE", None)  # rclone 1.60 fails on this machine's bundle
    env.update(RCLONE_CONFIG_BENCH_TYPE="s3", RCLONE_CONFIG_BENCH_PROVIDER="Other",
               RCLONE_CONFIG_BENCH_ACCESS_KEY_ID=CREDS["AWS_ACCESS_KEY_ID"],
               RCLONE_CONFIG_BENCH_SECRET_ACCESS_KEY=CREDS["AWS_SECRET_ACCESS_KEY"],
               RCLONE_CONFIG_BENCH_REGION=CREDS["AWS_DEFAULT_REGION"],
               RCLONE_CONFIG_BENCH_ENDPOINT=endpoint)
    return env


def rclone(args: list[str], endpoint: str, conf: str) -> tuple[float, dict]:
    """Run rclone; (wall seconds, the final stats object of its JSON log)."""
    cmd = ["rclone", "--config", conf, *args, "--use-json-log", "--stats-one-line", "-v"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=rclone_env(endpoint), capture_output=True, text=True,
                       stdin=subprocess.DEVNULL, timeout=600)
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise RuntimeError(f"rclone {args[0]} failed ({p.returncode}): {p.stderr[-1500:]}")
    stats = {}
    for line in p.stderr.splitlines():
        if line.startswith("{") and '"stats"' in line:
            try:
                stats = json.loads(line)["stats"]
            except (ValueError, KeyError):
                pass
    return dt, stats


def save_ours(folder: Path, url: str, state: Path) -> tuple[float, object]:
    from hypercli.mount.checkpoint import save
    t0 = time.perf_counter()
    rep = save(folder, url, 1, state)
    return time.perf_counter() - t0, rep


DROP: dict = {"ok": None}


def drop_caches() -> bool:
    os.sync()
    if DROP["ok"] is False:
        return False
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        DROP["ok"] = True
    except OSError:
        DROP["ok"] = False
    return DROP["ok"]


# ----------------------------------------------------------------------------------- main

def fmt_mb(n: float) -> str:
    return f"{n / MiB:8.3f}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--saves", type=int, default=6, help="saves after the first (default 6)")
    p.add_argument("--rounds", type=int, default=3, help="restores of each side (default 3)")
    p.add_argument("--realtime", action="store_true",
                   help=f"start a save every {CADENCE:.0f} s instead of back to back")
    p.add_argument("--store", choices=["s3rver", "moto"], default=None,
                   help="S3 server on loopback (default: s3rver when installed, else moto)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the raw figures to this file")
    a = p.parse_args()

    if not shutil.which("rclone"):
        print("missing rclone: apt-get install -y rclone", file=sys.stderr)
        return 2
    store = a.store or ("s3rver" if shutil.which("s3rver") else "moto")
    import importlib.metadata as md
    if store == "s3rver":
        exe = shutil.which("s3rver")
        if not exe:
            print("missing s3rver: npm install -g s3rver@3 (or --store moto)", file=sys.stderr)
            return 2
        CREDS.update(AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
        store_v = subprocess.run([exe, "--version"], capture_output=True,
                                 text=True).stdout.strip()
    else:
        exe = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
        store_v = md.version("moto")

    os.environ["HYPER_HOME"] = tmpdir("hyper-bench-ckpt-home-")
    os.environ.update(CREDS)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hypercli"], cwd=ROOT,
                           capture_output=True, text=True).stdout.strip()
    rclone_v = subprocess.run(["rclone", "version"], capture_output=True,
                              text=True).stdout.splitlines()[0]
    print(f"bench_checkpoint: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, hypercli {rev}"
          f"{' + uncommitted changes in hypercli/' if dirty else ''}, {os.cpu_count()} cores, "
          f"Python {sys.version.split()[0]}, boto3 {md.version('boto3')}, {rclone_v}")
    print(f"S3 server: {store} {store_v} on 127.0.0.1 (no proxy)")
    print(f"load average at start: {load()}")

    results: dict = {"args": vars(a), "store": f"{store} {store_v}", "rclone": rclone_v,
                     "hypercli": rev + ("+dirty" if dirty else ""), "cores": os.cpu_count(),
                     "load_start": os.getloadavg()}
    server = None
    t_all = time.perf_counter()
    try:
        server = Server(store, exe).start()
        s3 = server.client()
        s3.create_bucket(Bucket=BUCKET)
        os.environ["HYPER_S3_ENDPOINT_URL"] = server.endpoint
        from hypercli.mount.checkpoint import BLOCK, restore
        url = f"s3://{BUCKET}/ours"
        work = Path(tmpdir("bench-ckpt-"))
        src, state = work / "checkpoint", work / "node" / "ckpt.state"
        conf = str(work / "rclone.conf")
        Path(conf).touch()
        rng = random.Random(a.seed)
        t0 = time.perf_counter()
        make_checkpoint(src, rng)
        total = folder_bytes(src)
        print(f"checkpoint folder: {total / MiB:.2f} MiB in {len(list(src.iterdir()))} files "
              f"(made in {time.perf_counter() - t0:.1f} s); change per save: 1 MiB of model.pt "
              f"in place at a random offset + trainer_state.json rewritten; block "
              f"{BLOCK // KiB} KiB")
        print("cadence: " + (f"one save every {CADENCE:.0f} s (--realtime)" if a.realtime
                             else f"saves back to back (the {CADENCE:.0f} s cadence does not "
                             "change the bytes sent; --realtime to wait)"))

        # ------------------------------------------------------------------ 1. saves
        print(f"\n1. saves: first (full) save, then {a.saves} saves after a change; "
              "sides alternate who goes first")
        hdr = (f"{'save':>5} {'changed':>9} {'side':>7} {'time s':>7} {'reported MiB':>12} "
               f"{'server MiB':>10} {'objs':>4} {'server/changed':>14}  load1")
        print(hdr)
        rows = []
        lst = {"ours": listing(s3, "ours"), "rclone": listing(s3, "rclone")}
        t_cad = time.monotonic()
        for i in range(a.saves + 1):
            if a.realtime and i:
                wait = t_cad + CADENCE * i - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
            if i == 0:
                changed, off = total, None
            else:
                off, changed = change(src, i, rng)
            sides = ["ours", "rclone"] if i % 2 == 0 else ["rclone", "ours"]
            for side in sides:
                if side == "ours":
                    dt, rep = save_ours(src, url, state)
                    reported = rep.uploaded
                    extra = {"generation": rep.generation, "total": rep.total,
                             "read": rep.read}
                else:
                    dt, st = rclone(["sync", str(src), f"bench:{BUCKET}/rclone"],
                                    server.endpoint, conf)
                    reported = st.get("bytes")
                    extra = {"transfers": st.get("transfers"), "checks": st.get("checks")}
                after = listing(s3, side)
                got, nobj = received(lst[side], after)
                lst[side] = after
                row = {"save": i, "side": side, "changed": changed, "offset": off,
                       "seconds": dt, "reported": reported, "server_bytes": got,
                       "server_objects": nobj, "load1": os.getloadavg()[0], **extra}
                rows.append(row)
                print(f"{i:>5} {changed / MiB:9.3f} {side:>7} {dt:7.2f} "
                      f"{fmt_mb(reported or 0):>12} {fmt_mb(got):>10} {nobj:>4} "
                      f"{got / changed:13.3f}x  {row['load1']:.2f}")
        results["saves"] = rows

        def inc(side, key):
            return [r[key] for r in rows if r["side"] == side and r["save"] > 0]

        changed_med = statistics.median([r["changed"] for r in rows
                                         if r["side"] == "ours" and r["save"] > 0])
        summ = {}
        print(f"\n   medians over saves 1..{a.saves} (changed bytes {changed_med / MiB:.3f} "
              f"MiB per save):")
        for side in ("ours", "rclone"):
            srv, rep_, sec = (statistics.median(inc(side, "server_bytes")),
                              statistics.median(inc(side, "reported")),
                              statistics.median(inc(side, "seconds")))
            ratios = [r["server_bytes"] / r["changed"] for r in rows
                      if r["side"] == side and r["save"] > 0]
            summ[side] = {"server_bytes": srv, "reported": rep_, "seconds": sec,
                          "ratio_server": statistics.median(ratios),
                          "ratio_max": max(ratios),
                          "ratio_reported": rep_ / changed_med}
            print(f"   {side:>7}: {srv / MiB:8.3f} MiB to the server per sync "
                  f"({summ[side]['ratio_server']:.2f}x changed, worst "
                  f"{summ[side]['ratio_max']:.2f}x), reported {rep_ / MiB:.3f} MiB "
                  f"({summ[side]['ratio_reported']:.2f}x), {sec:.2f} s per sync")
        o, r = summ["ours"], summ["rclone"]
        manifest = [row["server_bytes"] - row["reported"] for row in rows
                    if row["side"] == "ours" and row["save"] > 0]
        summ["ours"]["manifest_bytes"] = statistics.median(manifest)
        print(f"   ours: pack (SaveReport.uploaded) {o['reported'] / MiB:.3f} MiB + generation "
              f"manifest {statistics.median(manifest) / KiB:.0f} KiB per sync")
        print(f"   rclone / ours bytes per sync: {r['server_bytes'] / o['server_bytes']:.1f}x; "
              f"time per sync rclone / ours: {r['seconds'] / o['seconds']:.2f}x")
        goal1 = o["ratio_server"] <= 1.2
        print(f"   goal ours <= 1.2x the changed bytes per sync: "
              f"{o['ratio_server']:.2f}x (median), {o['ratio_max']:.2f}x (worst) -> "
              f"{'MET' if goal1 else 'NOT MET'}")
        results["save_summary"] = summ
        results["goal_bytes_met"] = goal1

        # ---------------------------------------------------------------- 2. restore
        want = digests(src)
        print(f"\n2. restore into an empty folder, {a.rounds} rounds, sides alternating "
              f"({total / MiB:.1f} MiB)")
        runs: dict[str, list] = {"ours": [], "rclone": []}
        for rnd in range(a.rounds):
            for side in (["ours", "rclone"] if rnd % 2 == 0 else ["rclone", "ours"]):
                dest = Path(tmpdir(f"bench-ckpt-restore-{side}-"))
                cold = drop_caches()
                t0 = time.perf_counter()
                if side == "ours":
                    node = Path(tmpdir("bench-ckpt-node-"))
                    rep = restore(url, dest / "checkpoint", node / "ckpt.state")
                    dt = time.perf_counter() - t0
                    moved = rep.downloaded
                    out = dest / "checkpoint"
                else:
                    dt, st = rclone(["copy", f"bench:{BUCKET}/rclone", str(dest / "checkpoint")],
                                    server.endpoint, conf)
                    moved = st.get("bytes")
                    out = dest / "checkpoint"
                ok = digests(out) == want
                runs[side].append({"seconds": dt, "downloaded": moved, "identical": ok,
                                   "mb_s": total / 1e6 / dt, "cold": cold,
                                   "load1": os.getloadavg()[0]})
                print(f"   r{rnd} {side:>7}: {dt:6.2f} s  {total / 1e6 / dt:7.1f} MB/s  "
                      f"downloaded {moved / MiB:7.2f} MiB  identical to source: "
                      f"{'yes' if ok else 'NO'}  page cache "
                      f"{'dropped' if cold else 'warm'}  load {os.getloadavg()[0]:.2f}")
                shutil.rmtree(dest, ignore_errors=True)
                if side == "ours":
                    shutil.rmtree(node, ignore_errors=True)
        rs = {}
        for side in ("ours", "rclone"):
            sec = statistics.median(x["seconds"] for x in runs[side])
            rs[side] = {"seconds": sec, "mb_s": total / 1e6 / sec,
                        "identical": all(x["identical"] for x in runs[side])}
        ratio = rs["ours"]["mb_s"] / rs["rclone"]["mb_s"]
        goal2 = ratio >= 0.8
        print(f"   medians: ours {rs['ours']['seconds']:.2f} s {rs['ours']['mb_s']:.1f} MB/s, "
              f"rclone copy {rs['rclone']['seconds']:.2f} s {rs['rclone']['mb_s']:.1f} MB/s; "
              f"ours / rclone throughput {ratio:.2f}x")
        print(f"   goal restore >= 0.8x rclone copy's throughput: {ratio:.2f}x -> "
              f"{'MET' if goal2 else 'NOT MET'}")
        if not DROP["ok"]:
            print("   (drop_caches not permitted: the page cache was warm for both sides)")
        results["restore"] = {"runs": runs, "medians": rs, "ratio": ratio, "goal_met": goal2,
                              "page_cache_dropped": bool(DROP["ok"])}
        ident = rs["ours"]["identical"] and rs["rclone"]["identical"]
        print(f"   restored folders byte-identical to the source after the last save: "
              f"ours {'yes' if rs['ours']['identical'] else 'NO'}, rclone "
              f"{'yes' if rs['rclone']['identical'] else 'NO'}")

        # ---------------------------------------------------------------- summary
        print("\nsummary")
        print(f"   {'':>22} {'ours':>12} {'rclone':>12}")
        print(f"   {'MiB to server / sync':>22} {o['server_bytes'] / MiB:12.3f} "
              f"{r['server_bytes'] / MiB:12.3f}")
        print(f"   {'x changed bytes':>22} {o['ratio_server']:12.2f} {r['ratio_server']:12.2f}")
        print(f"   {'s per sync':>22} {o['seconds']:12.2f} {r['seconds']:12.2f}")
        print(f"   {'restore s':>22} {rs['ours']['seconds']:12.2f} "
              f"{rs['rclone']['seconds']:12.2f}")
        print(f"   {'restore MB/s':>22} {rs['ours']['mb_s']:12.1f} {rs['rclone']['mb_s']:12.1f}")
        print(f"   goals: bytes per sync <= 1.2x changed: {'MET' if goal1 else 'NOT MET'} "
              f"({o['ratio_server']:.2f}x); restore >= 0.8x rclone: "
              f"{'MET' if goal2 else 'NOT MET'} ({ratio:.2f}x)")
        results["identical"] = ident
        print(f"\ntotal {time.perf_counter() - t_all:.0f} s, load average at end: {load()}")
        results["load_end"] = os.getloadavg()
        if a.json:
            Path(a.json).write_text(json.dumps(results, indent=2, default=str))
        return 0 if ident else 1
    finally:
        if server is not None:
            server.stop()
        for d in TEMP_DIRS:
            shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
