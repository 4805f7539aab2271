"""What an experiment's tasks need of a node: ``resources:`` (or the original Hyper recipe's
``hardware:``) and ``nodes:``.

    resources: {cpus: 4, memory: 16GB, gpus: 1, gpu_type: A100}   # all optional
    resources: {accelerators: "V100:4", cpus: "8+", memory: "32+", disk_gb: 200,
                spot: auto, instance_type: p3.8xlarge, arch: x86_64}   # SkyPilot's form
    hardware: {gpu: K80, gpu_count: 2}     # Hyper's form: gpu_type and gpus
    nodes: 2                               # a multi-node (gang) task: 2 ranks, 2 nodes

``accelerators: "V100:4"`` is ``gpu_type: V100, gpus: 4`` (a bare name is one GPU), the name
written as SkyPilot's ``sky show-gpus`` writes it (:data:`GPU_NAMES`; case does not matter).
``cpus``/``memory`` ``"N+"`` mean at least N, as a plain number does: each is what one task
claims of a node, and on clouds the optimizer picks an instance with at least that much
(hypercli.offers.optimizer).

Memory sizes follow Kubernetes' quantity suffixes (kubernetes.io, "Resource units in
Kubernetes"): ``K``/``KB``, ``M``/``MB``, ``G``/``GB``, ``T``/``TB`` are powers of 1000;
``Ki``/``KiB`` ... ``Ti``/``TiB`` powers of 1024; case-insensitive, a space allowed. A bare
number is gigabytes, as in SkyPilot's ``memory:``.
"""

from __future__ import annotations

import re

from yaml.nodes import MappingNode

from hypercli.recipe.specs import Resources
from hypercli.recipe.yamltree import (
    _check_keys,
    _Ctx,
    _finite,
    _int,
    _is_number,
    _Item,
    _kind,
    _mapping,
    _show,
    _str,
    _suggest,
    _value,
)

RESOURCE_KEYS = ("cpus", "memory", "gpus", "gpu_type", "accelerators", "disk_gb", "spot",
                 "instance_type", "arch")
ARCHS = ("x86_64", "arm64")  #: CPU architectures of cloud instances
HARDWARE_KEYS = ("gpu", "gpu_count")
MAX_NODES = 1000  #: most ranks of one multi-node task
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([KMGT]?)(I?)(B?)\s*", re.I)
_POWER = {"": 0, "K": 1, "M": 2, "G": 3, "T": 4}
#: GPU model names as SkyPilot's ``sky show-gpus`` prints them (skypilot-org/skypilot,
#: ``sky/catalog/common.py`` and the catalogs' AcceleratorName column)
GPU_NAMES = ("B200", "H200", "H100", "H100-MEGA", "A100", "A100-80GB", "L40S", "L40", "L4",
             "A40", "A10", "A10G", "A6000", "RTX6000", "T4", "T4g", "V100", "V100-32GB",
             "P100", "P40", "P4", "K80", "M60", "K520", "MI300X", "Inferentia", "Trainium",
             "Gaudi")
_GPU_BY_KEY = {re.sub(r"[^a-z0-9]", "", n.lower()): n for n in GPU_NAMES}


def normalise_gpu(name: str, memory_mib: float | None = None) -> str:
    """A cloud's GPU name as in :data:`GPU_NAMES`: ``nvidia-tesla-v100`` → ``V100``,
    ``nvidia-a100-80gb`` → ``A100-80GB``, AWS's ``A100`` with 81920 MiB → ``A100-80GB``;
    a name it does not know comes back with its vendor words removed (``NVIDIA RTX 4090``
    → ``RTX 4090``).

    Args:
        name: the cloud's name (GCP accelerator type, AWS ``GpuInfo.Gpus[].Name``, ...).
        memory_mib: memory of one GPU, MiB, when the cloud gives it (tells V100 from
            V100-32GB, A100 from A100-80GB).
    """
    text = re.sub(r"(?i)\b(nvidia|tesla|amd|habana|aws)\b|^nvidia-tesla-|^nvidia-", " ", name)
    text = re.sub(r"\s+", " ", text).strip(" -") or name
    key = re.sub(r"[^a-z0-9]", "", text.lower())
    if key in _GPU_BY_KEY:
        out = _GPU_BY_KEY[key]
    elif m := re.search(r"(80|32|141|40|16|24|48)gb$", key):
        base = _GPU_BY_KEY.get(key[:m.start()])
        out = base and (base + "-" + m[0].upper())
        out = out if out in GPU_NAMES else base
    elif key.startswith("h100mega"):
        out = "H100-MEGA"
    else:
        out = None
    if out is None:
        return text
    if memory_mib and out in ("V100", "A100") and memory_mib >= (30000 if out == "V100"
                                                                    else 70000):
        out += "-32GB" if out == "V100" else "-80GB"
    return out


def gpu_name(text: str) -> str | None:
    """The :data:`GPU_NAMES` entry written as ``text`` up to case and punctuation
    (``v100``, ``a100_80gb``), or None."""
    return _GPU_BY_KEY.get(re.sub(r"[^a-z0-9]", "", text.lower()))


def parse_size(text: str) -> int | None:
    """Bytes of a size such as ``16GB``, ``512 MiB``, ``1.5Ti`` or ``100`` (bytes); None when
    the text is not a size. See the module docstring for the units."""
    m = _SIZE.fullmatch(text)
    if not m or (m[3] and not m[2]):
        return None
    base = 1024 if m[3] else 1000
    return int(float(m[1]) * base ** _POWER[m[2].upper()])


_AT_LEAST = re.compile(r"\s*(.*?)\s*\+\s*")


def _at_least(ctx: _Ctx, item: _Item):
    """The value of ``item`` with a trailing ``+`` (``"8+"``: at least 8) taken off."""
    v = _value(ctx, item.node)
    if isinstance(v, str) and (m := _AT_LEAST.fullmatch(v)):
        try:
            return float(m[1]) if re.fullmatch(r"[0-9.]+", m[1]) else m[1]
        except ValueError:
            return m[1]
    return v


def _memory_at_least(ctx: _Ctx, item: _Item, field: str) -> int:
    v = _at_least(ctx, item)
    if _is_number(v) and _finite(v) and v >= 0:
        return int(v * 10**9)
    size = parse_size(v) if isinstance(v, str) else None
    if size is None:
        ctx.fail(f"memory must be a size such as 16GB, 512MiB or 32+, not {_kind(v)}",
                 item.line, field, "a bare number is gigabytes; N+ means at least N")
    return size


def _cpus(ctx: _Ctx, item: _Item, field: str) -> float:
    v = _at_least(ctx, item)
    if not _is_number(v):
        ctx.fail(f"cpus must be a number or N+ (at least N), not {_kind(v)}", item.line,
                 field, "for example 4 or \"8+\"")
    if not (_finite(v) and v > 0):
        ctx.fail(f"cpus must be above 0, not {_show(v)}", item.line, field)
    return int(v) if float(v).is_integer() else float(v)


def _accelerators(ctx: _Ctx, item: _Item, field: str) -> tuple[str, int]:
    """``"V100:4"``, ``"V100"`` (one) or ``{V100: 4}`` → (GPU name, count)."""
    if isinstance(item.node, MappingNode):
        entries = _mapping(ctx, item, field)
        if len(entries) != 1:
            ctx.fail("accelerators names one GPU model", item.line, field,
                     "for example {V100: 4}")
        (name, it), = entries.items()
        count = _int(ctx, it, f"{field}.{name}", lo=0)
        text = f"{name}:{count}"
    elif isinstance(v := _value(ctx, item.node), str):
        text = v
    else:
        ctx.fail(f"accelerators must be NAME:COUNT such as \"V100:4\", not {_kind(v)}",
                 item.line, field)
    m = re.fullmatch(r"\s*([A-Za-z0-9][A-Za-z0-9_. -]*?)\s*(?::\s*([0-9]+))?\s*", text)
    if not m:
        ctx.fail(f"accelerators {_show(text)} is not NAME:COUNT", item.line, field,
                 "for example \"V100:4\" or \"A100-80GB:8\"")
    name, count = m[1], int(m[2]) if m[2] else 1
    if not 1 <= count <= 64:
        ctx.fail(f"accelerators asks for {count} GPUs: 1 to 64 per node", item.line, field)
    known = gpu_name(name)
    if known is None:
        hint = _suggest(name, list(GPU_NAMES), "known GPUs")
        if hint and hint.startswith("did you mean"):
            ctx.fail(f"unknown GPU {_show(name)}", item.line, field, hint)
    return known or name, count


def _spot(ctx: _Ctx, item: _Item, field: str) -> bool | str:
    v = _value(ctx, item.node)
    if isinstance(v, bool) or v == "auto":
        return v
    shown = _show(v) if isinstance(v, str) else _kind(v)
    ctx.fail(f"spot must be true, false or auto, not {shown}", item.line, field,
             "auto: spot offers first, then on-demand ones")


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
            out["memory"] = _memory_at_least(ctx, res["memory"], f"{f}.memory")
        if "accelerators" in res:
            both = [k for k in ("gpus", "gpu_type") if k in res]
            if both:
                ctx.fail(f"give accelerators or {' and '.join(both)}, not both",
                         res[both[0]].line, f"{f}.{both[0]}",
                         "accelerators: \"V100:4\" is gpu_type: V100, gpus: 4")
            out["gpu_type"], out["gpus"] = _accelerators(ctx, res["accelerators"],
                                                         f"{f}.accelerators")
        if "disk_gb" in res:
            out["disk_gb"] = _int(ctx, res["disk_gb"], f"{f}.disk_gb", lo=10, hi=65536)
        if "spot" in res:
            out["spot"] = _spot(ctx, res["spot"], f"{f}.spot")
        if "instance_type" in res:
            out["instance_type"] = _str(ctx, res["instance_type"], f"{f}.instance_type")
        if "arch" in res:
            arch = _str(ctx, res["arch"], f"{f}.arch")
            if arch not in ARCHS:
                ctx.fail(f"arch must be x86_64 or arm64, not {_show(arch)}", res["arch"].line,
                         f"{f}.arch", _suggest(arch, list(ARCHS), "choices"))
            out["arch"] = arch
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
