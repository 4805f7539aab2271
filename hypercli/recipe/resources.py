"""What an experiment's tasks need of a node: ``resources:`` (or the original Hyper recipe's
``hardware:``) and ``nodes:``.

    resources: {cpus: 4, memory: 16GB, gpus: 1, gpu_type: A100}   # all optional
    hardware: {gpu: K80, gpu_count: 2}     # Hyper's form: gpu_type and gpus
    nodes: 2                               # a multi-node (gang) task: 2 ranks, 2 nodes

Memory sizes follow Kubernetes' quantity suffixes (kubernetes.io, "Resource units in
Kubernetes"): ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` are powers of 1000;
``Ki``/``KiB`` ... ``Ti``/``TiB`` powers of 1024; case-insensitive, a space allowed. A bare
number is gigabytes, as in SkyPilot's ``memory:``.
"""

from __future__ import annotations

import re

from hypercli.recipe.specs import Resources
from hypercli.recipe.yamltree import (
    _check_keys,
    _Ctx,
    _finite,
    _get,
    _int,
    _is_number,
    _Item,
    _kind,
    _mapping,
    _show,
    _str,
    _value,
)

RESOURCE_KEYS = ("cpus", "memory", "gpus", "gpu_type")
HARDWARE_KEYS = ("gpu", "gpu_count")
MAX_NODES = 1000  #: most ranks of one multi-node task
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(I?)(B?)\s*", re.I)
_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}


def parse_size(text: str) -> int | None:
    """Bytes of a size such as ``16GB``, ``512 MiB``, ``1.5Ti`` or ``100`` (bytes); None when
    the text is not a size. See the module docstring for the units."""
    m = _SIZE.fullmatch(text)
    if not m or (m[3] and not m[2]):
        return None
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** _POWER[m[2].upper()])


def _memory(ctx: _Ctx, item: _Item, field: str) -> int:
    v = _value(ctx, item.node)
    if _is_number(v) and _finite(v) and v >= 0:
        return int(v * 10**9)
    size = parse_size(v) if isinstance(v, str) else None
    if size is None:
        ctx.fail(f"memory must be a size such as 16GB or 512MiB, not {_kind(v)}", item.line,
                 field, "a bare number is gigabytes")
    return size


def _cpus(ctx: _Ctx, item: _Item, field: str) -> float:
    v = _get(ctx, item, field, _is_number, "a number")
    if not (_finite(v) and v > 0):
        ctx.fail(f"cpus must be above 0, not {_show(v)}", item.line, field)
    return int(v) if float(v).is_integer() else float(v)


def resources(ctx: _Ctx, keys: dict, field: str) -> Resources:
    """The :class:`Resources` of one experiment from its ``resources``, ``hardware`` and
    ``nodes`` entries (``keys``: the experiment's key → _Item). Raises RecipeError."""
    if "resources" in keys and "hardware" in keys:
        ctx.fail("give resources or hardware, not both", keys["hardware"].line,
                 f"{field}.hardware", "hardware: {gpu, gpu_count} is resources: "
                 "{gpu_type, gpus}")
    out: dict = {}
    if "resources" in keys:
        f = f"{field}.resources"
        res = _mapping(ctx, keys["resources"], f, null_ok=True)
        _check_keys(ctx, res, RESOURCE_KEYS, f)
        if "cpus" in res:
            out["cpus"] = _cpus(ctx, res["cpus"], f"{f}.cpus")
        if "memory" in res:
            out["memory"] = _memory(ctx, res["memory"], f"{f}.memory")
        if "gpus" in res:
            out["gpus"] = _int(ctx, res["gpus"], f"{f}.gpus", lo=0, hi=64)
        if "gpu_type" in res:
            out["gpu_type"] = _str(ctx, res["gpu_type"], f"{f}.gpu_type")
    if "hardware" in keys:
        f = f"{field}.hardware"
        hw = _mapping(ctx, keys["hardware"], f, null_ok=True)
        _check_keys(ctx, hw, HARDWARE_KEYS, f)
        if "gpu" in hw:
            out["gpu_type"] = _str(ctx, hw["gpu"], f"{f}.gpu")
            out["gpus"] = 1
        if "gpu_count" in hw:
            out["gpus"] = _int(ctx, hw["gpu_count"], f"{f}.gpu_count", lo=0, hi=64)
    if out.get("gpu_type") and not out.get("gpus"):
        line = (keys.get("resources") or keys["hardware"]).line
        ctx.fail("a GPU type is named but no GPU is asked for", line, field,
                 "set gpus: 1 (or more)")
    if "nodes" in keys:
        out["nodes"] = _int(ctx, keys["nodes"], f"{field}.nodes", lo=1, hi=MAX_NODES)
    return Resources(**out)
