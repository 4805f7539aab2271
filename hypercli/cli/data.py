"""``hyper data``: push, list, pull and verify chunked datasets (hypercli.mount.pack).

Thin click commands: parse, call one function of :mod:`hypercli.mount.pack`, render with
rich. HyperErrors are left to the ``hyper`` group in ``hypercli.cli``, which turns them into a
message and an exit code (2 bad input, 3 the store failed); ``verify`` exits 1 when it finds
problems. Heavy modules (boto3, rich) are imported inside the commands, so ``hyper --help``
stays fast. ``mount``/``unmount`` call :mod:`hypercli.mount.fusefs`.
"""

from __future__ import annotations

import json
import stat
import sys
import time

import click

from hypercli.cli.common import console, plural, print_json, text

_ENDPOINT = click.option("--endpoint-url", metavar="URL",
                         help="S3-compatible endpoint (default $HYPER_S3_ENDPOINT_URL, "
                              "else AWS).")


@click.group()
def data():
    """Datasets packed into large chunks in object storage (s3://, gs://, az://, file://)."""


def _show(name: str) -> str:
    """A file name safe to print on one line (control characters escaped)."""
    return name if name.isprintable() else json.dumps(name, ensure_ascii=False)[1:-1]


@data.command()
@click.argument("src", metavar="DIR", type=click.Path(file_okay=False))
@click.argument("url")
@click.option("--chunk-size", type=int, default=64, show_default=True, metavar="MiB",
              help="Target chunk size in MiB (1-1024; 12-100 MB is best, paper fig. 2).")
@click.option("--jobs", type=int, default=16, show_default=True, metavar="N",
              help="Parallel uploads.")
@click.option("--image", is_flag=True,
              help="Push DIR as one EROFS image (mkfs.erofs): its mounts serve files from "
                   "the kernel, at local-disk speed for many readers (needs root on nodes).")
@_ENDPOINT
def push(src, url, chunk_size, jobs, endpoint_url, image):
    """Pack folder DIR into chunks at URL; upload only chunks the store lacks."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn,
                               TimeElapsedColumn, TransferSpeedColumn)

    from hypercli.mount import pack
    err = console(stderr=True)
    columns = (TextColumn("pushing"), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TextColumn("{task.fields[up]}"), TimeElapsedColumn())
    with Progress(*columns, console=err, transient=True,
                  disable=not err.is_terminal) as bar:
        task = bar.add_task("push", total=None, up="")

        def progress(done: int, total: int, uploaded: int) -> None:
            bar.update(task, completed=done, total=total,
                       up=f"{uploaded / 1e6:,.1f} MB uploaded")

        kw = dict(chunk_size=chunk_size * pack.MiB, jobs=jobs, endpoint_url=endpoint_url,
                  progress=progress)
        if image:
            from hypercli.mount import image as image_
            r, source = image_.push(src, url, **kw)
        else:
            r = pack.push(src, url, **kw)
    for w in r.warnings:
        err.print(text(("warning:", "yellow"), f" {_show(w)}"), soft_wrap=True)
    rate = r.bytes / 1e6 / r.seconds if r.seconds else 0.0
    if image:
        what = (f"pushed {plural(source['files'], 'file')}, "
                f"{plural(source['dirs'], 'folder')} ({source['bytes'] / 1e6:,.1f} MB) as "
                f"an image of {r.bytes / 1e6:,.1f} MB to {r.url}")
    else:
        what = (f"pushed {plural(r.files, 'file')}, {plural(r.dirs, 'folder')}, "
                f"{plural(r.symlinks, 'symlink')} ({r.bytes / 1e6:,.1f} MB) to {r.url}")
    if r.chunks_uploaded == 0:  # a speed of nothing would mean nothing
        click.echo(f"{what}: nothing new to upload (the store has all "
                   f"{plural(r.chunks, 'chunk')} already), {r.seconds:.1f} s")
        return
    click.echo(f"{what}: {r.chunks_uploaded}/{plural(r.chunks, 'chunk')} uploaded "
               f"({r.bytes_uploaded / 1e6:,.1f} MB), {r.seconds:.1f} s, {rate:,.1f} MB/s")


@data.command(name="ls")
@click.argument("url")
@click.argument("path", default="")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON list of entries.")
@_ENDPOINT
def ls_(url, path, as_json, endpoint_url):
    """List folder PATH of the dataset at URL (default its root), or one file."""
    from hypercli.mount import pack
    entries = pack.ls(url, path, endpoint_url=endpoint_url)
    if as_json:
        print_json([{"path": e.path, "kind": e.kind, "size": e.size, "mode": e.mode,
                     "mtime": e.mtime, "sha256": e.sha256, "target": e.target}
                    for e in entries])
        return
    from rich.table import Table
    table = Table(box=None, show_header=False)
    for col, just in (("mode", "left"), ("size", "right"), ("mtime", "left"),
                      ("name", "left")):
        table.add_column(col, justify=just, overflow="fold")
    for e in entries:
        name = _show(e.path.rsplit("/", 1)[-1]) + ("/" if e.kind == "d" else "")
        if e.kind == "l":
            name += f" -> {_show(e.target or '')}"
        table.add_row(stat.filemode(e.mode), f"{e.size:,}",
                      time.strftime("%Y-%m-%d %H:%M", time.localtime(e.mtime)), name)
    console().print(table)


@data.command()
@click.argument("url")
@click.argument("dest", metavar="DIR", type=click.Path(file_okay=False))
@click.option("--path", "path_prefix", default="", metavar="PATH",
              help="Pull only this file or folder of the dataset.")
@click.option("--jobs", type=int, default=16, show_default=True, metavar="N",
              help="Parallel downloads.")
@_ENDPOINT
def pull(url, dest, path_prefix, jobs, endpoint_url):
    """Download the dataset at URL into folder DIR (every chunk checked)."""
    from hypercli.mount import pack
    r = pack.pull(url, dest, jobs=jobs, path_prefix=path_prefix, endpoint_url=endpoint_url)
    rate = r.bytes / 1e6 / r.seconds if r.seconds else 0.0
    click.echo(f"pulled {plural(r.files, 'file')}, {plural(r.dirs, 'folder')}, "
               f"{plural(r.symlinks, 'symlink')} ({r.bytes / 1e6:,.1f} MB, "
               f"{plural(r.chunks, 'chunk')}) into {dest}: {r.seconds:.1f} s, "
               f"{rate:,.1f} MB/s")
    from hypercli.mount import image
    if image.dataset_is_image(url, endpoint_url=endpoint_url):
        img = f"{dest.rstrip('/')}/{image.IMAGE}"
        click.echo(f"note: {url} is an image dataset: {img} is its EROFS image; "
                   f"`fsck.erofs --extract=DIR {img}` unpacks its files, "
                   f"`mount -o ro {img} DIR` (as root) shows them", err=True)


@data.command()
@click.argument("url")
@click.option("--jobs", type=int, default=16, show_default=True, metavar="N",
              help="Parallel downloads.")
@_ENDPOINT
def verify(url, jobs, endpoint_url):
    """Check every chunk and the index of the dataset at URL (exit 1 on problems)."""
    from hypercli.mount import pack
    r = pack.verify(url, jobs=jobs, endpoint_url=endpoint_url)
    if r.ok:
        click.echo(f"{r.url}: {plural(r.chunks, 'chunk')} ({r.bytes / 1e6:,.1f} MB) verified, "
                   f"{r.seconds:.1f} s")
        return
    for p in r.problems:
        click.echo(f"problem: {_show(p)}")
    click.echo(f"{r.url}: {plural(len(r.problems), 'problem')} in {plural(r.chunks, 'chunk')}")
    sys.exit(1)


@data.command()
@click.argument("url")
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--cache-dir", type=click.Path(file_okay=False),
              help="Chunk cache folder (default $HYPER_HOME/cache; reused across mounts).")
@click.option("--cache-size", type=int, default=10240, show_default=True, metavar="MiB",
              help="Cap on cached chunk bytes.")
@click.option("--foreground/--daemon", default=False, show_default=True,
              help="Serve in this process until unmounted, or start a daemon and return.")
@click.option("--allow-other", is_flag=True, help="Let other users (containers) read it.")
@click.option("--endpoint-url", metavar="URL", help="S3-compatible endpoint.")
@click.option("--warm-entries", type=click.IntRange(min=0), default=100_000,
              show_default=True, metavar="N",
              help="Entries listed at mount time, so first reads skip a lookup (0: none).")
def mount(url, mountpoint, cache_dir, cache_size, foreground, allow_other, endpoint_url,
          warm_entries):
    """Mount the dataset at URL read-only at MOUNTPOINT (an existing folder)."""
    from hypercli.errors import UsageError
    from hypercli.mount import image
    from hypercli.mount.fusefs import mount as mount_
    from hypercli.state import folder
    cache = cache_dir or str(folder("cache"))
    if image.dataset_is_image(url, endpoint_url=endpoint_url):
        if foreground:
            raise UsageError(f"{url} is an image dataset: it is mounted as a daemon only",
                             "leave out --foreground")
        pid = image.mount(url, mountpoint, cache_dir=cache, cache_bytes=cache_size << 20,
                          endpoint_url=endpoint_url, allow_other=allow_other)
        click.echo(f"mounted the image dataset {url} at {mountpoint} (daemon pid {pid}); "
                   f"`hyper data unmount {mountpoint}` ends it")
        return
    pid = mount_(url, mountpoint, cache_dir=cache, cache_bytes=cache_size << 20,
                 endpoint_url=endpoint_url, foreground=foreground, allow_other=allow_other,
                 warm_entries=warm_entries)
    if not foreground:
        click.echo(f"mounted {url} at {mountpoint} (daemon pid {pid}); "
                   f"`hyper data unmount {mountpoint}` ends it")


@data.command()
@click.argument("mountpoint", type=click.Path(file_okay=False))
@click.option("--lazy", is_flag=True, help="Detach now even if programs still use it.")
def unmount(mountpoint, lazy):
    """Unmount a dataset mounted with `hyper data mount`."""
    from hypercli.mount import image
    from hypercli.mount.fusefs import unmount as unmount_
    if image.mounted_image(mountpoint):
        image.unmount(mountpoint, lazy=lazy)
    else:
        unmount_(mountpoint, lazy=lazy)
    click.echo(f"unmounted {mountpoint}")
