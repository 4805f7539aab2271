"""Parameter specs, the paper's sampling rule, and shell-safe substitution into commands.

Source of the rule: Hyper paper (Snark AI, 2019), section II-C: "the Cartesian product of the
discrete parameters is drawn ``samples`` times with minimal repetition; each continuous range is
sampled ``samples`` times and matched at random with the discrete draws".

Two modes, chosen by the recipe's ``sampling`` key:

* ``grid`` (default): the discrete combinations are taken in product order. With no ``samples``
  and no continuous parameter this is the full product. With ``samples`` = N and P combinations,
  every combination appears ``N // P`` or ``N // P + 1`` times (minimal repetition); when N < P
  the N combinations are a seeded random subset, kept in product order. Continuous ranges are
  sampled by stratification (one uniform draw in each of N equal strata, Latin hypercube
  sampling, McKay et al. 1979) and the draws are shuffled before being matched.
* ``random``: the discrete draws are random with minimal repetition (shuffled copies of the
  product); continuous values are independent uniform draws (log-uniform with ``log: true``).

Everything is driven by one ``random.Random(seed)``, so a plan is reproducible.
Pure functions, no I/O.
"""

from __future__ import annotations

import functools
import json
import math
import random
import re
import shlex
from dataclasses import dataclass
from typing import Union

Scalar = Union[str, int, float, bool]

#: Significant digits kept for sampled floats, so the command, the stored params and
#: ``hyper results`` all show the same value.
FLOAT_DIGITS = 6

PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


@dataclass(frozen=True)
class Discrete:
    """A discrete parameter: a non-empty tuple of scalar values (str, int, float, bool)."""

    values: tuple


@dataclass(frozen=True)
class Continuous:
    """A continuous range [low, high) (inclusive of high for integers).

    Args:
        low, high: bounds, ``low < high``; both > 0 when ``log`` is true.
        log: sample uniformly in log space (for learning rates and the like).
        integer: round draws to ints (chosen when both bounds are written as integers).
    """

    low: float
    high: float
    log: bool = False
    integer: bool = False


@dataclass(frozen=True)
class Shards(Discrete):
    """A parameter drawn from a dataset or folder (:mod:`hypercli.shards`): its values are
    shard indexes 0..N-1 and it samples as a Discrete one.

    Args:
        source: ``("dataset", PATH_OR_URL, N)`` — the files of a mounted dataset (a mount
            path) or of a ``chunks+...`` dataset URL, split into N shards; or
            ``("glob", PATTERN, PER_TASK)`` — the files matching PATTERN, PER_TASK per task.
            Until the files are listed, ``values`` is a placeholder.
    """

    source: tuple = ()


ParamSpec = Union[Discrete, Continuous]


def grid_size(params: dict[str, ParamSpec]) -> int:
    """Number of combinations of the discrete parameters (1 when there are none)."""
    return math.prod(len(p.values) for p in params.values() if isinstance(p, Discrete))


def count_samples(params: dict[str, ParamSpec], sampling: str, samples: int | None) -> int:
    """How many tasks an experiment yields.

    Args:
        params: name → spec.
        sampling: ``"grid"`` or ``"random"``.
        samples: the recipe's ``samples``, or None when absent.
    Raises:
        ValueError: ``samples`` is absent but required (random sampling or a continuous range).
    """
    if samples is not None:
        return samples
    has_range = any(isinstance(p, Continuous) for p in params.values())
    if sampling == "random" or has_range:
        raise ValueError("samples is required with sampling: random or a continuous range")
    return grid_size(params)


def _combination(discrete: list[tuple[str, tuple]], index: int) -> dict[str, Scalar]:
    """The index-th combination of the Cartesian product, last parameter varying fastest."""
    out: dict[str, Scalar] = {}
    for name, values in reversed(discrete):
        index, r = divmod(index, len(values))
        out[name] = values[r]
    return dict(reversed(list(out.items())))


def _discrete_indices(total: int, n: int, sampling: str, rng: random.Random) -> list[int]:
    """n indices into a product of ``total`` combinations with minimal repetition."""
    full, rest = divmod(n, total)
    if sampling == "grid":
        extra = sorted(rng.sample(range(total), rest)) if rest else []
        if full == 0:
            return extra
        return [i for _ in range(full) for i in range(total)] + extra
    out: list[int] = []
    for _ in range(full):
        perm = list(range(total))
        rng.shuffle(perm)
        out.extend(perm)
    out.extend(rng.sample(range(total), rest))
    return out


def _round(x: float) -> float:
    return float(f"{x:.{FLOAT_DIGITS}g}")


def _continuous_draws(spec: Continuous, n: int, sampling: str, rng: random.Random) -> list:
    lo, hi = (math.log(spec.low), math.log(spec.high)) if spec.log else (spec.low, spec.high)
    if spec.integer:  # widen so that the top integer is as likely as the others
        hi = math.log(spec.high + 1) if spec.log else spec.high + 1
    if sampling == "grid":
        us = [(i + rng.random()) / n for i in range(n)]
        rng.shuffle(us)
    else:
        us = [rng.random() for _ in range(n)]
    out = []
    for u in us:
        x = lo + u * (hi - lo)
        x = math.exp(x) if spec.log else x
        if spec.integer:
            out.append(int(min(max(math.floor(x), spec.low), spec.high)))
        else:  # clamp after rounding, which can otherwise step outside [low, high]
            out.append(float(min(max(_round(x), spec.low), spec.high)))
    return out


def sample(params: dict[str, ParamSpec], *, sampling: str = "grid",
           samples: int | None = None, seed: int = 0) -> list[dict[str, Scalar]]:
    """Draw the parameter sets of one experiment (the module docstring gives the rule).

    Args:
        params: name → Discrete or Continuous, in recipe order.
        sampling: ``"grid"`` or ``"random"``.
        samples: number of draws N (≥ 1), or None for the full grid.
        seed: seed of the draws; the same inputs always give the same list.
    Returns:
        N dicts name → value, keys in recipe order.
    Raises:
        ValueError: bad sampling mode, samples < 1, or samples required but absent.
    """
    if sampling not in ("grid", "random"):
        raise ValueError(f"sampling must be grid or random, not {sampling!r}")
    n = count_samples(params, sampling, samples)
    if n < 1:
        raise ValueError("samples must be at least 1")
    rng = random.Random(seed)
    discrete = [(k, p.values) for k, p in params.items() if isinstance(p, Discrete)]
    total = grid_size(params)
    indices = _discrete_indices(total, n, sampling, rng)
    if total <= n:  # each combination is built once and shared by the draws that pick it
        table = [_combination(discrete, i) for i in range(total)]
        combos = [table[i] for i in indices]
    else:
        combos = [_combination(discrete, i) for i in indices]
    ranges = {k: _continuous_draws(p, n, sampling, rng)
              for k, p in params.items() if isinstance(p, Continuous)}
    order = list(params)
    return [{k: (combos[i][k] if k in combos[i] else ranges[k][i]) for k in order}
            for i in range(n)]


def format_value(value: Scalar) -> str:
    """The text a value takes in a command: ``true``/``false`` for booleans, ``repr``-free
    numbers (``0.05``, ``1e-05``), strings unchanged."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return (repr(value) if not math.isfinite(value) or value != int(value) or abs(value) >= 1e16
                else f"{value:.1f}")
    if value is None:
        return ""
    return str(value)


def placeholders(template: str) -> list[str]:
    """Names of the ``{{name}}`` placeholders in a command, in order of appearance."""
    return PLACEHOLDER.findall(template)


def render(template: str, values: dict[str, Scalar], *, quote: bool = True) -> str:
    """Substitute ``{{name}}`` placeholders.

    Args:
        template: command text.
        values: name → value; every placeholder must have a value.
        quote: shell-quote each value (``shlex.quote``), so a value such as ``x; rm -rf ~`` or
            ``$(id)`` reaches the program as that literal string. False for env values, which
            are data already.
    Raises:
        KeyError: a placeholder has no value (the recipe check reports this earlier).
    """
    out = []
    for part in _template(template):
        if part.__class__ is str:
            out.append(part)
        else:
            out.append(_quoted(values[part[0]]) if quote else format_value(values[part[0]]))
    return "".join(out)


@functools.lru_cache(maxsize=256)
def _template(template: str) -> tuple:
    """A command split once into literal text (str) and placeholders (``(name,)``), so that
    rendering 100,000 tasks is a join, not 100,000 regex substitutions."""
    parts: list = []
    pos = 0
    for m in PLACEHOLDER.finditer(template):
        parts += [template[pos:m.start()], (m.group(1),)]
        pos = m.end()
    parts.append(template[pos:])
    return tuple(p for p in parts if p != "")


def _quoted(value: Scalar) -> str:
    """``shlex.quote(format_value(value))``, remembered for the values that repeat across
    tasks (discrete ones: strings, ints, booleans); sampled floats are not remembered."""
    if value.__class__ is float:
        return shlex.quote(format_value(value))
    return _quoted_repeating(value.__class__, value)


@functools.lru_cache(maxsize=4096)
def _quoted_repeating(kind: type, value: Scalar) -> str:  # kind: True and 1 are equal keys
    return shlex.quote(format_value(value))


def to_json(values: dict[str, Scalar]) -> str:
    """Canonical JSON of a parameter set (``HYPER_PARAMS`` on the node, stored in state)."""
    return json.dumps(values, sort_keys=False, separators=(",", ":"), ensure_ascii=False)
