"""The ``cluster:``, ``storage:``, ``workdir:`` and ``mounts:`` sections of a recipe."""

from __future__ import annotations

import ipaddress
import os
import re
from typing import Any, Callable

from yaml.nodes import MappingNode, ScalarNode

from hypercli.recipe.specs import ClusterSpec
from hypercli.recipe.yamltree import (
    _URL,
    _bool,
    _check_keys,
    _Ctx,
    _finite,
    _get,
    _int,
    _is_number,
    _Item,
    _leaf,
    _mapping,
    _name,
    _show,
    _str,
    _strings,
    _suggest,
)

PROVIDERS = ("local", "ssh", "aws", "gcp", "azure")
STORAGE_SCHEMES = ("file", "s3", "gs", "az")
#: plain bucket mounts: s3 with goofys/s3fs, gs and az with rclone (hypercli.mount.bucket)
MOUNT_SCHEMES = ("chunks+s3", "chunks+file", "chunks+gs", "chunks+az", "s3", "gs", "az",
                 "file")
#: the plain bucket mounts, which alone may be ``mode: rw``
BUCKET_SCHEMES = ("s3://", "gs://", "az://")

_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?"
                   r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                   r"(?::(?P<port>\d{1,5}))?")


def _hosts(ctx: _Ctx, item: _Item, field: str) -> list:
    out = []
    for host, line in _strings(ctx, item, field, single_ok=False, empty_ok=False):
        m = _HOST.fullmatch(host)
        if not m or not 0 < int(m["port"] or 22) < 65536:
            ctx.fail(f"host {_show(host)} is not of the form user@host:port", line, field,
                     "user and port are optional: 10.0.0.5, root@node1:2222")
        out.append(host)
    return out


def _controller(ctx: _Ctx, item: _Item, field: str) -> str:
    """``controller: user@host:port``: the host that drives the workflows of an ssh cluster
    while this machine is away (hypercli.controller)."""
    host = _str(ctx, item, field)
    m = _HOST.fullmatch(host)
    if not m or not 0 < int(m["port"] or 22) < 65536:
        ctx.fail(f"controller {_show(host)} is not of the form user@host:port", item.line,
                 field, "user and port are optional: root@10.0.0.4")
    return host


def _zone(ctx: _Ctx, item: _Item, field: str) -> str | list:
    zones = [z for z, _ in _strings(ctx, item, field, single_ok=True, empty_ok=False)]
    return zones[0] if isinstance(item.node, ScalarNode) else zones


def _cidr(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _str(ctx, item, field)
    try:
        ipaddress.ip_network(v, strict=False)
    except ValueError:
        ctx.fail(f"ssh_cidr {_show(v)} is not a network", item.line, field,
                 "write it as 203.0.113.0/24")
    return v


CLOUDS = ("aws", "gcp", "azure")


def _clouds(ctx: _Ctx, item: _Item, field: str) -> list:
    """``clouds: [aws, gcp]``: the clouds the optimizer may choose offers from."""
    out = []
    for cloud, line in _strings(ctx, item, field, single_ok=True, empty_ok=False):
        if cloud not in CLOUDS:
            ctx.fail(f"unknown cloud {_show(cloud)}", line, field,
                     _suggest(cloud, list(CLOUDS), "clouds"))
        out.append(cloud)
    return list(dict.fromkeys(out))


def _list(ctx: _Ctx, item: _Item, field: str) -> list:
    return [v for v, _ in _strings(ctx, item, field, single_ok=True, empty_ok=False)]


def _price(ctx: _Ctx, item: _Item, field: str) -> float:
    v = _get(ctx, item, field, _is_number, "a number")
    if not (_finite(v) and v > 0):
        ctx.fail(f"max_price must be a number above 0, not {_show(v)}", item.line, field)
    return v


def _cost(ctx: _Ctx, item: _Item, field: str) -> float:
    """``max_cost``: USD the cluster's nodes may cost in all (hypercli.offers.ledger)."""
    v = _get(ctx, item, field, _is_number, "a number of US dollars")
    if not (_finite(v) and v > 0):
        ctx.fail(f"max_cost must be a number of US dollars above 0, not {_show(v)}",
                 item.line, field)
    return v


def _minutes(ctx: _Ctx, item: _Item, field: str) -> float:
    """``pool_idle_minutes``: minutes above 0 (fractions allowed)."""
    v = _get(ctx, item, field, _is_number, "a number of minutes")
    if not (_finite(v) and v > 0):
        ctx.fail(f"{_leaf(field)} must be a number of minutes above 0, not {_show(v)}",
                 item.line, field)
    return v


def _spot(ctx: _Ctx, item: _Item, field: str) -> bool | str:
    """``spot``: true, false, or ``auto`` (spot, then on-demand when no spot capacity is
    left: hypercli.offers.failover)."""
    return _get(ctx, item, field, lambda v: isinstance(v, bool) or v == "auto",
                "true, false or auto")


_Check = Callable[[_Ctx, _Item, str], Any]
_CLOUD_KEYS: dict[str, _Check] = {
    "region": _str, "zone": _zone, "instance_type": _str, "spot": _spot, "image": _str,
    "disk_gb": lambda c, i, f: _int(c, i, f, lo=10), "max_price": _price, "max_cost": _cost,
    "idle_minutes": lambda c, i, f: _int(c, i, f, lo=1), "replace_preempted": _bool,
    "ssh_cidr": _cidr,
    # where the optimizer may look when an experiment says what it needs, not which
    # instance (hypercli.offers.optimizer): max_price above caps the price per node-hour
    "clouds": _clouds, "regions": _list, "zones": _list,
    # node pools, one per resource shape (hypercli.offers.pools): on or off (default: on
    # when the experiments ask for more than one shape), and the minutes a pool's node
    # may stay idle before it is terminated
    "pools": _bool, "pool_idle_minutes": _minutes,
}
_PROVIDER_KEYS: dict[str, dict[str, _Check]] = {
    "local": {},
    "ssh": {"hosts": _hosts, "identity_file": _str, "user": _str,
            "port": lambda c, i, f: _int(c, i, f, lo=1, hi=65535),
            # the host that drives its workflows, and the Python there (hypercli.controller)
            "controller": _controller, "controller_python": _str},
    # iam_role, service_account, identity: an existing storage identity for the nodes
    # instead of one made per cluster (hypercli.recipe.access)
    # controller: a controller instance of this user drives its workflows (hypercli.
    # controller.cloud), removed after controller_idle_minutes with nothing to drive
    "aws": {**_CLOUD_KEYS, "iam_role": _str, "controller": _bool,
            "controller_idle_minutes": _minutes, "controller_python": _str},
    "gcp": {**_CLOUD_KEYS, "project": _str, "service_account": _str, "controller": _bool,
            "controller_idle_minutes": _minutes, "controller_python": _str},
    # adopt_group: use a resource_group hypercli did not make (hypercli.providers.azure)
    "azure": {**_CLOUD_KEYS, "resource_group": _str, "identity": _str, "adopt_group": _bool,
              "controller": _bool, "controller_idle_minutes": _minutes,
              "controller_python": _str},
}
_CLUSTER_KEYS = ("provider", "name", "workers")


def _cluster(ctx: _Ctx, item: _Item | None, recipe_name: str) -> ClusterSpec:
    if item is None:
        return ClusterSpec(name=recipe_name, provider="local", workers=None, options={},
                           provider_given=False)
    keys = _mapping(ctx, item, "cluster", null_ok=True)
    provider = _str(ctx, keys["provider"], "cluster.provider") if "provider" in keys else "local"
    if provider not in PROVIDERS:
        ctx.fail(f"unknown provider {_show(provider)}", keys["provider"].line,
                 "cluster.provider", _suggest(provider, list(PROVIDERS), "providers"))
    own = _PROVIDER_KEYS[provider]
    for key, it in keys.items():
        owners = [p for p in PROVIDERS if key in _PROVIDER_KEYS[p]]
        if key not in own and owners:
            ctx.fail(f"'{key}' applies to provider{'s' if len(owners) > 1 else ''} "
                     f"{', '.join(owners)}, not {provider}", it.line, f"cluster.{key}",
                     f"set provider: {owners[0]}" if len(owners) == 1 else None)
    _check_keys(ctx, keys, _CLUSTER_KEYS + tuple(own), "cluster")
    name = _name(ctx, keys["name"], "cluster.name") if "name" in keys else recipe_name
    workers = _int(ctx, keys["workers"], "cluster.workers", lo=1) if "workers" in keys else None
    options = {k: own[k](ctx, it, f"cluster.{k}") for k, it in keys.items() if k in own}
    if provider == "ssh" and "hosts" not in options:
        ctx.fail("provider ssh needs hosts", item.line, "cluster.hosts",
                 "hosts: [user@10.0.0.5:22, ...]")
    return ClusterSpec(name=name, provider=provider, workers=workers, options=options,
                       provider_given="provider" in keys)


def _local_path(base_dir: str, text: str) -> str:
    return os.path.normpath(os.path.join(base_dir, os.path.expanduser(text)))


def _url(ctx: _Ctx, item: _Item, field: str, schemes: tuple, base_dir: str) -> str:
    """A URL with one of ``schemes``; the path of a ``file`` URL is made absolute."""
    v = _str(ctx, item, field)
    m = _URL.fullmatch(v)
    if not m or m[1] not in schemes:
        ctx.fail(f"{_leaf(field)} must be a URL starting with "
                 f"{', '.join(s + '://' for s in schemes)}, not {_show(v)}", item.line, field)
    if re.search(r"[\x00-\x1f\x7f]", v):
        ctx.fail(f"{_leaf(field)} must not contain control characters", item.line, field)
    scheme, rest = m[1], m[2]
    if scheme.endswith("file"):
        if not rest:
            ctx.fail(f"{_leaf(field)} {_show(v)} has no path", item.line, field)
        return f"{scheme}://{_local_path(base_dir, rest)}"
    if not rest or rest.startswith("/"):
        ctx.fail(f"{_leaf(field)} {_show(v)} has no bucket", item.line, field,
                 f"{scheme}://BUCKET/PREFIX")
    if scheme.endswith("az") and not rest.partition("/")[2].strip("/"):
        ctx.fail(f"{_leaf(field)} {_show(v)} has no container", item.line, field,
                 f"{scheme}://ACCOUNT/CONTAINER/PREFIX")
    return v


#: folders of a node's system: nothing is mounted on them or inside them
SYSTEM_TREES = ("/etc", "/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32",
                "/boot", "/proc", "/sys", "/dev", "/var", "/run", "/snap")
#: folders that hold others' folders: nothing is mounted on them (inside is fine)
SYSTEM_FOLDERS = ("/", "/tmp", "/home", "/root", "/opt", "/srv", "/mnt", "/media")


def _mount_path(ctx: _Ctx, path: str, line: int | None, field: str) -> None:
    """Refuse a mount path (absolute, normalised) on a system folder, inside one of the
    system trees, on the user's home or one of its parents, or with characters a mount
    table cannot show plainly (whitespace, backslash, control characters). Whether the
    path is free on a node (not a mount point, empty) is known only there
    (:func:`hypercli.providers.runtime.mount_guard`)."""
    home = os.path.normpath(os.path.expanduser("~"))
    under = next((t for t in SYSTEM_TREES if path == t or path.startswith(t + "/")), None)
    if re.search(r"[\s\\\x00-\x1f\x7f]", path):
        ctx.fail(f"mount path {_show(path)} must not contain whitespace, backslashes or "
                 "control characters", line, field, "for example /data")
    if under or path in SYSTEM_FOLDERS or re.fullmatch(r"/home/[^/]+", path):
        what = (f"inside the system folder {under}" if under and under != path else
                "a user's home folder" if path == "/root" or path.startswith("/home/") else
                "a system folder")
        ctx.fail(f"cannot mount over {path}: it is {what}", line, field,
                 "mount on a folder of its own, such as /data or /mnt/dataset")
    if path == home or home.startswith(path.rstrip("/") + "/"):
        ctx.fail(f"cannot mount over {path}: it is your home folder"
                 + (" or holds it" if path != home else ""), line, field,
                 "mount on a folder of its own, such as ~/data or /data")


def _mounts(ctx: _Ctx, item: _Item, base_dir: str) -> tuple[dict, frozenset, frozenset]:
    """(mount path → URL, the paths mounted read-write, the paths copied). A mount is
    ``PATH: URL`` or ``PATH: {url: URL, mode: ro|rw|copy}``; only a plain bucket mount
    (``s3://``, ``gs://``, ``az://``) may be ``rw`` (datasets of ``chunks+`` URLs are
    immutable); only a ``chunks+`` dataset may be ``copy`` (copied whole to each node's disk,
    :mod:`hypercli.mount.copy`)."""
    out: dict[str, str] = {}
    rw: set[str] = set()
    copy: set[str] = set()
    for target, it in _mapping(ctx, item, "mounts", null_ok=True).items():
        field = f"mounts.{target}"
        if not target.startswith("/") or ".." in target.split("/") or "\x00" in target:
            ctx.fail(f"mount path {_show(target)} must be absolute, without '..'", it.line,
                     field, "for example /data")
        norm = "/" + os.path.normpath(target).lstrip("/")
        _mount_path(ctx, norm, it.line, field)
        if norm in out:
            ctx.fail(f"mount path {norm} is given twice", it.line, field)
        mode = "ro"
        if isinstance(it.node, MappingNode):
            keys = _mapping(ctx, it, field)
            _check_keys(ctx, keys, ("url", "mode"), field)
            if "url" not in keys:
                ctx.fail(f"mount {norm} has no url", it.line, f"{field}.url",
                         "url: s3://BUCKET/PREFIX")
            if "mode" in keys:
                mode = _str(ctx, keys["mode"], f"{field}.mode")
                if mode not in ("ro", "rw", "copy"):
                    ctx.fail(f"mode must be ro, rw or copy, not {_show(mode)}",
                             keys["mode"].line, f"{field}.mode")
            it, field = keys["url"], f"{field}.url"
        out[norm] = _url(ctx, it, field, MOUNT_SCHEMES, base_dir)
        if mode == "rw":
            if not out[norm].startswith(BUCKET_SCHEMES):
                ctx.fail("only a plain bucket mount (s3://, gs://, az://) can be rw (chunks+ "
                         "datasets are immutable)", it.line, field,
                         "write outputs to $HYPER_OUTPUT")
            rw.add(norm)
        elif mode == "copy":
            if not out[norm].startswith("chunks+"):
                ctx.fail("only a chunks+ dataset can be copied (mode: copy)", it.line, field,
                         "push it with `hyper data push DIR URL` and mount chunks+URL")
            copy.add(norm)
    return out, frozenset(rw), frozenset(copy)


