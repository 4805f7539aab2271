#!/usr/bin/env python3
"""Many data-loader workers over a dataset: PyTorch's ``DataLoader`` through the chunked mount,
through a ``mode: copy`` copy of the dataset, and on local disk, side by side in one run.

The dataset: N small files (default 10,000 × 10 KB of random bytes in 10 subfolders), pushed
with ``hypercli.mount.pack.push`` (64 MiB chunks) to a real S3 API server on loopback
(bench_storage.py's helper process: moto_server or npm s3rver behind a proxy that counts HTTP
requests and adds ``delay`` to each). A map-style ``Dataset`` whose item is one file (opened,
read whole, its size checked), read by ``torch.utils.data.DataLoader(shuffle=True,
batch_size=64, num_workers=W)``, W = 0, 2, 4, 8 (workers forked at the start of each epoch, as
by default: their start-up is part of the epoch, on every side alike). For each per-request
delay (0 and 20 ms) and each W, the sides take turns, ``--rounds`` times (medians):

    local   the source folder on local disk, page cache dropped (cold), then read again
    mount   a fresh ``fusefs.mount`` (daemon, empty chunk cache in a fresh folder; it returns
            once it has listed its entries) with the page cache dropped after it is up (cold),
            then the same mount read again (second epoch). The daemon's CPU seconds in the
            cold epoch are read from /proc/PID/stat and printed per file (what serving costs)
    lowmount  the same as mount, served by ``hypercli.mount.fuselow`` (the FUSE protocol read
            from /dev/fuse by ``--serving-processes`` processes) instead of libfuse's
            high-level API through mfusepy; its daemon CPU is that of all its processes
    image   the same files pushed as an image dataset (``hypercli.mount.image.push``: one
            EROFS image made by mkfs.erofs, 64 MiB chunks) and mounted by
            ``hypercli.mount.image.mount`` (the kernel's EROFS reading the image through a
            fresh chunked mount, empty chunk cache, whose daemon pushes each chunk into the
            page cache), page cache dropped after it is up; its daemon CPU printed as the
            mounts'. Needs root and erofs-utils
    copy    ``hypercli.mount.copy.make_copy`` into a fresh folder (chunks fetched in parallel,
            checked, unpacked to local disk): its time to ready is printed beside the mount's
            first epoch; then the page cache dropped and the copy read cold, and again

The mount and the copy are then read a third time after the page cache is dropped again: for
the mount, its chunk cache is full and the kernel's cache empty, the state of every epoch of a
dataset larger than the node's memory.

Cold means ``echo 1 > /proc/sys/vm/drop_caches`` (page cache only: the dentries a mount listed
at start stay, as the local folder's do); without the right to, ``posix_fadvise(DONTNEED)`` on
the local files. ``--cores 0`` or ``--cores 0,1`` pins this process, and so the daemons it starts
and the loader's workers, to those cores (``sched_setaffinity``, as ``taskset`` does), after the
S3 server has started on all of them.

Figures vary ±50% run to run on this 2-core shared machine: compare ratios within one run.

Usage (from the repo root, as root):
    .venv/bin/python bench/bench_loader.py [--files N] [--workers 0,2,4,8] [--delays 0,20]
        [--sides local,mount,lowmount,image,copy] [--serving-processes N] [--rounds 2]
        [--cores 0,1] [--store moto|s3rver] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import bench_storage as bs  # noqa: E402  (its S3 server helper, mounts and data)

import warnings  # noqa: E402

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402


class Files(Dataset):
    """Item i: the bytes of file i read whole (its size checked); returns its size."""

    def __init__(self, root: str, files: list[tuple[str, int]]):
        self.paths = [os.path.join(root, rel) for rel, _ in files]
        self.sizes = [size for _, size in files]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> int:
        with open(self.paths[i], "rb", buffering=0) as f:
            data = f.read()
        if len(data) != self.sizes[i]:
            raise RuntimeError(f"{self.paths[i]}: read {len(data)} bytes, "
                               f"expected {self.sizes[i]}")
        return len(data)


def _collate(batch: list[int]) -> tuple[int, int]:
    return len(batch), sum(batch)


def epoch(root: str, files, workers: int, seed: int) -> dict:
    """One shuffled epoch through a DataLoader: files/s (worker start-up included)."""
    g = torch.Generator()
    g.manual_seed(seed)
    dl = DataLoader(Files(root, files), batch_size=64, shuffle=True, num_workers=workers,
                    generator=g, collate_fn=_collate)
    n = nbytes = 0
    t0 = time.perf_counter()
    for k, b in dl:
        n += k
        nbytes += b
    dt = time.perf_counter() - t0
    if n != len(files):
        raise RuntimeError(f"{root}: {n} files read, expected {len(files)}")
    return {"files": n, "seconds": dt, "files_s": n / dt}


def cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process and of its children still running (a ``lowmount``'s
    serving processes), in seconds (proc(5): fields 4, 14 and 15)."""
    if pid is None:
        return None
    total = 0.0
    try:
        for name in [str(pid)] + [d for d in os.listdir("/proc") if d.isdigit()]:
            try:
                with open(f"/proc/{name}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if name == str(pid) or int(fields[1]) == pid:
                total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return total
    except OSError:
        return None


def drop(files: list[str]) -> str:
    """Page cache only (``echo 1``); fadvise(DONTNEED) on files without the right to."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches(1)"
    except OSError:
        for p in files:
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return "fadvise"


def run_local(src, files, w, seed, paths) -> dict:
    how = drop(paths)
    cold = epoch(src, files, w, seed)
    warm = epoch(src, files, w, seed + 1)
    return {"cold": cold["files_s"], "warm": warm["files_s"], "drop": how}


def run_mount(s3, url, files, w, seed, paths, **mount_kw) -> dict:
    cache = bs.tmpdir("bench-loader-cache-")
    t0 = time.perf_counter()
    m = bs.HyperMount(url, s3.endpoint, cache, **mount_kw)
    up = time.perf_counter() - t0
    try:
        drop(paths)
        c0 = cpu_s(m.pid)
        cold = epoch(m.mp, files, w, seed)
        c1 = cpu_s(m.pid)
        warm = epoch(m.mp, files, w, seed + 1)
        st = m.stats() or {}
        drop(paths)  # the chunk cache full, the page cache empty: a later epoch of a
        again = epoch(m.mp, files, w, seed + 2)  # dataset larger than the node's memory
    finally:
        m.close()
        shutil.rmtree(cache, ignore_errors=True)
    daemon = None if c0 is None or c1 is None else c1 - c0
    return {"cold": cold["files_s"], "warm": warm["files_s"], "mount_s": up,
            "dropped": again["files_s"],
            "cold_s": cold["seconds"], "daemon_cpu_s": daemon,
            "reads": st.get("ops", {}).get("read", {}).get("calls"),
            "read_us": st.get("ops", {}).get("read", {}).get("us"),
            "lookups": st.get("ops", {}).get("getattr", {}).get("calls")}


def run_image(s3, url, files, w, seed, paths) -> dict:
    from hypercli.mount import image
    cache = bs.tmpdir("bench-loader-cache-")
    mp = bs.tmpdir("bench-mnt-image-")
    t0 = time.perf_counter()
    pid = image.mount(url, mp, cache_dir=cache, cache_bytes=4 << 30, endpoint_url=s3.endpoint)
    up = time.perf_counter() - t0
    try:
        drop(paths)
        c0 = cpu_s(pid)
        cold = epoch(mp, files, w, seed)
        c1 = cpu_s(pid)
        warm = epoch(mp, files, w, seed + 1)
        drop(paths)
        again = epoch(mp, files, w, seed + 2)
    finally:
        image.unmount(mp)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        shutil.rmtree(cache, ignore_errors=True)
    daemon = None if c0 is None or c1 is None else c1 - c0
    return {"cold": cold["files_s"], "warm": warm["files_s"], "mount_s": up,
            "dropped": again["files_s"], "cold_s": cold["seconds"], "daemon_cpu_s": daemon,
            "reads": None, "read_us": None}


def run_copy(server, url, files, w, seed, paths) -> dict:
    from hypercli.mount.copy import make_copy
    root = bs.tmpdir("bench-loader-copy-")
    drop(paths)
    t0 = time.perf_counter()
    c = make_copy(url, root, endpoint_url=server.endpoint)
    ready = time.perf_counter() - t0
    try:
        drop(paths)
        cold = epoch(c.path, files, w, seed)
        warm = epoch(c.path, files, w, seed + 1)
        drop(paths)
        again = epoch(c.path, files, w, seed + 2)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"cold": cold["files_s"], "warm": warm["files_s"], "ready_s": ready,
            "dropped": again["files_s"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--files", type=int, default=10_000)
    p.add_argument("--workers", default="0,2,4,8")
    p.add_argument("--delays", default="0,20", help="ms added to each S3 request")
    p.add_argument("--sides", default="local,mount,copy")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--serving-processes", type=int, default=2,
                   help="processes serving the lowmount side")
    p.add_argument("--cores", help="pin the readers and daemons to these cores, e.g. 0")
    p.add_argument("--store", choices=["moto", "s3rver"], default="moto")
    p.add_argument("--json")
    a = p.parse_args()
    warnings.filterwarnings("ignore", message=".*worker processes in total")
    workers = [int(x) for x in a.workers.split(",")]
    delays = [float(x) / 1000 for x in a.delays.split(",")]
    sides = [x for x in a.sides.split(",") if x]
    if a.store == "s3rver":
        bs.STORE.update(name="s3rver", exe=shutil.which("s3rver") or "")
        bs.CREDS.update(AWS_ACCESS_KEY_ID="S3RVER", AWS_SECRET_ACCESS_KEY="S3RVER")
    else:
        bs.STORE.update(name="moto", exe=shutil.which("moto_server")
                        or str(Path(sys.executable).parent / "moto_server"))
    os.environ["HYPER_HOME"] = bs.tmpdir("bench-loader-home-")
    os.environ.update(bs.CREDS)
    os.environ.pop("HYPER_S3_ENDPOINT_URL", None)
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=bs.ROOT,
                         capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hypercli"], cwd=bs.ROOT,
                           capture_output=True, text=True).stdout.strip()
    print(f"bench_loader: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}, hypercli {rev}"
          f"{' + uncommitted changes' if dirty else ''}, {os.cpu_count()} cores, torch "
          f"{torch.__version__}, S3 server {a.store}, kernel {os.uname().release}")
    print("load average at start: " + " ".join(f"{x:.2f}" for x in os.getloadavg()))
    results: dict = {"args": vars(a), "runs": {}}
    try:
        src = bs.tmpdir("bench-loader-src-")
        files = bs.make_small(src, a.files, 10_000, 10, seed=1)
        paths = [os.path.join(src, rel) for rel, _ in files]
        server = bs.Server()
        server.bucket(bs.BUCKET)
        push = bs.push_hyper(server, src, "loader")
        url = f"s3://{bs.BUCKET}/loader"
        print(f"{len(files):,} files pushed: {push['chunks']} chunks, {push['seconds']:.1f} s")
        image_url = f"s3://{bs.BUCKET}/loader-image"
        if "image" in sides:
            from hypercli.mount import image
            t0 = time.perf_counter()
            rep, _ = image.push(src, image_url, endpoint_url=server.endpoint)
            print(f"the same as an image dataset: {rep.bytes:,} bytes of image, "
                  f"{rep.chunks} chunks, {time.perf_counter() - t0:.1f} s (mkfs.erofs included)")
        if a.cores:
            cores = {int(x) for x in a.cores.split(",")}
            os.sched_setaffinity(0, cores)
            print(f"readers and daemons pinned to cores {sorted(cores)}")
        for delay in delays:
            server.delay(delay)
            for w in workers:
                key = f"{delay * 1000:g} ms, {w} workers"
                runs: dict = {s: [] for s in sides}
                for r in range(a.rounds):
                    order = sides if r % 2 == 0 else sides[::-1]
                    for s in order:
                        seed = 100 * r + w
                        if s == "local":
                            runs[s].append(run_local(src, files, w, seed, paths))
                        elif s == "mount":
                            runs[s].append(run_mount(server, url, files, w, seed, paths,
                                                     server="mfusepy"))
                        elif s == "lowmount":
                            runs[s].append(run_mount(
                                server, url, files, w, seed, paths, server="low",
                                serving_processes=a.serving_processes))
                        elif s == "image":
                            runs[s].append(run_image(server, image_url, files, w, seed, paths))
                        else:
                            runs[s].append(run_copy(server, url, files, w, seed, paths))
                results["runs"][key] = runs
                line = [f"{key:>18}:"]
                med = {s: {k: statistics.median(x[k] for x in rs) for k in ("cold", "warm")}
                       for s, rs in runs.items()}
                for s in sides:
                    line.append(f"{s} cold {med[s]['cold']:7,.0f} warm {med[s]['warm']:7,.0f}")
                if "local" in med:
                    for s in sides:
                        if s != "local":
                            line.append(f"{s}/local cold {med[s]['cold'] / med['local']['cold']:.2f}"
                                        f" warm {med[s]['warm'] / med['local']['warm']:.2f}")
                print(" | ".join(line), flush=True)
                for side in ("mount", "lowmount", "image"):
                    if side not in runs:
                        continue
                    rs = runs[side]
                    d = [x["daemon_cpu_s"] for x in rs if x["daemon_cpu_s"] is not None]
                    print(f"{'':>19} {side}: up in {statistics.median(x['mount_s'] for x in rs):.2f}"
                          f" s, cold epoch {statistics.median(x['cold_s'] for x in rs):.2f} s, "
                          f"daemon CPU {statistics.median(d) if d else float('nan'):.2f} s "
                          f"({statistics.median(d) / len(files) * 1e6 if d else float('nan'):.0f}"
                          " µs a file)" + ("" if rs[-1]["reads"] is None else
                                           f", {rs[-1]['reads']} READs, "
                          f"{(rs[-1]['read_us'] or 0) / max(1, rs[-1]['reads'] or 0):.0f} µs "
                          "each in the READ handler"), flush=True)
                if "copy" in runs:
                    rs = runs["copy"]
                    print(f"{'':>19} copy: ready in "
                          f"{statistics.median(x['ready_s'] for x in rs):.2f} s", flush=True)
                drops = {s: statistics.median(x["dropped"] for x in rs)
                         for s, rs in runs.items() if s != "local"}
                if drops:
                    print(f"{'':>19} third epoch, page cache dropped again (the mount's chunk "
                          "cache full): " + ", ".join(
                              f"{s} {v:,.0f}" + (f" ({v / med['local']['cold']:.2f}× local "
                                                 "cold)" if "local" in med else "")
                              for s, v in drops.items()), flush=True)
        server.stop()
    finally:
        for fn in reversed(bs.CLEANUP):
            try:
                fn()
            except Exception as e:
                print(f"cleanup: {e}", file=sys.stderr)
        for d in bs.TEMP_DIRS:
            if not bs.mounted(d):
                shutil.rmtree(d, ignore_errors=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
