"""Storage commands run *on* nodes, with no dependency beyond the standard library, boto3 and
mfusepy (a node may have hypercli's bundled runtime only, without click or rich):

    python3 -m hypercli.mount.node mount URL MOUNTPOINT --cache-dir D [--cache-mib N]
    python3 -m hypercli.mount.node copy URL MOUNTPOINT --root D [--budget-mib N]
    python3 -m hypercli.mount.node bucket-mount URL MOUNTPOINT --root D [--rw]
    python3 -m hypercli.mount.node push-output DIR URL
    python3 -m hypercli.mount.node pull-outputs STORAGE WORKFLOW DEST EXPERIMENT...
    python3 -m hypercli.mount.node checkpoint-save FOLDER URL ATTEMPT STATE [--stopped-at S]
    python3 -m hypercli.mount.node checkpoint-restore URL FOLDER STATE

Exit 0 on success; otherwise 1 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import os
import sys

from hypercli.console import plural
from hypercli.errors import HyperError


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m hypercli.mount.node")
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("mount")
    m.add_argument("url")
    m.add_argument("mountpoint")
    m.add_argument("--cache-dir", required=True)
    m.add_argument("--cache-mib", type=int, default=10240)
    k = sub.add_parser("copy")
    k.add_argument("url")
    k.add_argument("mountpoint")
    k.add_argument("--root", required=True)
    k.add_argument("--budget-mib", type=int, default=None)
    b = sub.add_parser("bucket-mount")
    b.add_argument("url")
    b.add_argument("mountpoint")
    b.add_argument("--root", required=True)
    b.add_argument("--rw", action="store_true")
    p = sub.add_parser("push-output")
    p.add_argument("src")
    p.add_argument("url")
    q = sub.add_parser("pull-outputs")
    q.add_argument("storage")
    q.add_argument("workflow")
    q.add_argument("dest")
    q.add_argument("experiments", nargs="+")
    c = sub.add_parser("checkpoint-save")
    c.add_argument("folder")
    c.add_argument("url")
    c.add_argument("attempt", type=int)
    c.add_argument("state")
    c.add_argument("--stopped-at", type=float, default=None,
                   help="the final save of an attempt that did not succeed: when it ended "
                        "(s since the epoch)")
    r = sub.add_parser("checkpoint-restore")
    r.add_argument("url")
    r.add_argument("folder")
    r.add_argument("state")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "mount":
            from hypercli.mount import image
            from hypercli.mount.fusefs import mount
            if image.dataset_is_image(a.url):
                pid = image.mount(a.url, a.mountpoint, cache_dir=a.cache_dir,
                                  cache_bytes=a.cache_mib << 20, allow_other=True)
                print(f"mounted the image dataset {a.url} at {a.mountpoint} (pid {pid})")
                return 0
            pid = mount(a.url, a.mountpoint, cache_dir=a.cache_dir, cache_bytes=a.cache_mib << 20,
                        foreground=False, allow_other=True)
            print(f"mounted {a.url} at {a.mountpoint} (pid {pid})")
        elif a.cmd == "copy":
            from hypercli.mount.copy import make_copy
            c = make_copy(a.url, a.root, mountpoint=a.mountpoint,
                          budget_bytes=None if a.budget_mib is None else a.budget_mib << 20)
            print(f"{'copied' if c.fetched else 'reused the copy of'} {a.url} at "
                  f"{a.mountpoint} ({plural(c.bytes, 'byte')}, {c.seconds:.1f} s)")
        elif a.cmd == "bucket-mount":
            from hypercli.mount.bucket import mount as bucket_mount
            from hypercli.mount.bucket import node_paths
            cache, pid_file = node_paths(a.root, a.mountpoint)
            os.makedirs(os.path.dirname(pid_file), exist_ok=True)
            pid = bucket_mount(a.url, a.mountpoint, cache_dir=cache, pid_file=pid_file,
                               rw=a.rw)
            print(f"mounted {a.url} at {a.mountpoint} {'read-write' if a.rw else 'read-only'} "
                  f"(rclone pid {pid})")
        elif a.cmd == "push-output":
            from hypercli.mount.outputs import push_output
            r = push_output(a.src, a.url)
            print(f"outputs saved to {a.url}: {plural(r.files, 'file')}, "
                  f"{plural(r.bytes, 'byte')}")
        elif a.cmd == "checkpoint-save":
            from hypercli.mount.checkpoint import save
            s = save(a.folder, a.url, a.attempt, a.state, stopped_at=a.stopped_at)
            for line in s.warnings:
                print(f"hyper: checkpoint: {line}", file=sys.stderr)
            if s.generation is None:
                print(f"checkpoint: unchanged ({plural(s.total, 'byte')})", file=sys.stderr)
            else:  # what was uploaded holds the manifest too: it is no part of the folder
                print(f"checkpoint: {s.generation} saved, {plural(s.read, 'byte')} changed of "
                      f"{plural(s.total, 'byte')} ({plural(s.uploaded, 'byte')} uploaded with "
                      "its manifest)", file=sys.stderr)
        elif a.cmd == "checkpoint-restore":
            from hypercli.mount.checkpoint import restore
            s = restore(a.url, a.folder, a.state)
            print(f"checkpoint: restored {s.generation or 'nothing (none saved yet)'}, "
                  f"{s.total} bytes", file=sys.stderr)
        else:
            from hypercli.mount.outputs import pull_outputs
            tasks = pull_outputs(a.storage, a.workflow, a.experiments, a.dest)
            print(f"pulled the outputs of {plural(len(tasks), 'task')} into {a.dest}")
    except HyperError as e:
        print(f"error: {e}" + (f" ({e.hint})" if e.hint else ""), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
