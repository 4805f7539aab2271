"""The ``parameters:`` of an experiment: lists, ranges and constants (their meaning, and how
many tasks they make, is :mod:`hypercli.params`)."""

from __future__ import annotations

import datetime
import math
from typing import Any

from yaml.nodes import MappingNode, SequenceNode

from hypercli import params
from hypercli.params import Continuous, Discrete, Shards
from hypercli.recipe.yamltree import (
    _IDENT,
    _INT_TEXT,
    _RANGE,
    _bool,
    _check_keys,
    _Ctx,
    _finite,
    _get,
    _int,
    _is_int,
    _is_number,
    _Item,
    _kind,
    _leaf,
    _line,
    _mapping,
    _show,
    _str,
    _value,
)

_RANGE_KEYS = ("min", "max", "log", "type")
_SHARD_KEYS = ("shards", "of")
_FILES_KEYS = ("files", "per_task")


def _parameters(ctx: _Ctx, item: _Item | None, field: str) -> dict:
    if item is None:
        return {}
    out = {}
    for name, it in _mapping(ctx, item, field, null_ok=True).items():
        f = f"{field}.{name}"
        if not _IDENT.fullmatch(name):
            ctx.fail(f"parameter name {_show(name)} is not valid", it.line, f,
                     "letters, digits and '_', not starting with a digit")
        out[name] = _parameter(ctx, it, f)
    return out


def _parameter(ctx: _Ctx, item: _Item, field: str) -> params.ParamSpec:
    """A list → Discrete; "a-b" or {min, max, log, type} → Continuous; a scalar → constant."""
    node = item.node
    if isinstance(node, SequenceNode):
        if not node.value:
            ctx.fail("empty list", item.line, field, "give at least one value")
        return Discrete(tuple(_param_value(ctx, _Item(_line(n), n), f"{field}[{i}]")
                              for i, n in enumerate(node.value)))
    if isinstance(node, MappingNode):
        keys = _mapping(ctx, item, field)
        if "shards" in keys or "files" in keys:
            return _shards(ctx, item, keys, field)
        return _range_mapping(ctx, item, field)
    v = _value(ctx, node)
    m = _RANGE.fullmatch(v) if isinstance(v, str) else None
    if m:
        integer = bool(_INT_TEXT.fullmatch(m[1]) and _INT_TEXT.fullmatch(m[2]))
        low, high = (_number_text(t, integer) for t in (m[1], m[2]))
        shown = f"{m[1]}-{m[2]}"
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return _continuous(ctx, low, high, False, integer, item, field, shown)
    return Discrete((_param_value(ctx, item, field),))


def _shards(ctx: _Ctx, item: _Item, keys: dict, field: str) -> Shards:
    """``{shards: N, of: PATH_OR_URL}`` or ``{files: PATTERN, per_task: N}``."""
    if "shards" in keys:
        _check_keys(ctx, keys, _SHARD_KEYS, field)
        n = _int(ctx, keys["shards"], f"{field}.shards", lo=1, hi=1_000_000)
        if "of" not in keys:
            ctx.fail("shards needs of: a mount path or a chunks+ dataset URL", item.line,
                     f"{field}.of", "{shards: 300, of: /data}")
        of = _str(ctx, keys["of"], f"{field}.of")
        if not (of.startswith("/") or of.startswith("chunks+")):
            ctx.fail(f"of must be a mount path (/data) or a chunks+ dataset URL, not "
                     f"{_show(of)}", keys["of"].line, f"{field}.of")
        return Shards(tuple(range(n)), ("dataset", of, n))
    _check_keys(ctx, keys, _FILES_KEYS, field)
    pattern = _str(ctx, keys["files"], f"{field}.files")
    per = _int(ctx, keys["per_task"], f"{field}.per_task", lo=1) if "per_task" in keys else 1
    return Shards((0,), ("glob", pattern, per))


def _number_text(text: str, integer: bool) -> float | int:
    x = float(text)
    return int(text) if integer and math.isfinite(x) else x


def _param_value(ctx: _Ctx, item: _Item, field: str) -> Any:
    v = _value(ctx, item.node)
    if v is None:
        ctx.fail(f"{_leaf(field)} has no value", item.line, field,
                 'give a list, a range such as "0.01-0.3", or a constant')
    if not isinstance(v, (str, int, float)):
        ctx.fail(f"{_leaf(field)} must be a string, number or boolean, not {_kind(v)}",
                 item.line, field, "quote it" if isinstance(v, datetime.date) else None)
    if isinstance(v, float) and not math.isfinite(v):
        ctx.fail(f"{_leaf(field)} must be a finite number, not {v}", item.line, field)
    if isinstance(v, str) and "\x00" in v:
        ctx.fail(f"{_leaf(field)} must not contain a NUL character", item.line, field)
    return v


def _range_mapping(ctx: _Ctx, item: _Item, field: str) -> Continuous:
    keys = _mapping(ctx, item, field)
    _check_keys(ctx, keys, _RANGE_KEYS, field)
    for k in ("min", "max"):
        if k not in keys:
            ctx.fail(f"a range needs {k}", item.line, f"{field}.{k}", "{min: 1, max: 10}")
    low, high = (_get(ctx, keys[k], f"{field}.{k}", _is_number, "a number") for k in ("min", "max"))
    log = _bool(ctx, keys["log"], f"{field}.log") if "log" in keys else False
    kind = _str(ctx, keys["type"], f"{field}.type") if "type" in keys else None
    if kind not in (None, "int", "float"):
        ctx.fail(f"type must be int or float, not {_show(kind)}", keys["type"].line,
                 f"{field}.type")
    integer = kind == "int" if kind else _is_int(low) and _is_int(high)
    for k, b in (("min", low), ("max", high)):
        if not _finite(b):
            ctx.fail(f"{k} must be a finite number, not {_show(b)}", keys[k].line, f"{field}.{k}")
        if integer and b != int(b):
            ctx.fail(f"{k} must be a whole number with type int, not {b}", keys[k].line,
                     f"{field}.{k}")
    low, high = (int(low), int(high)) if integer else (float(low), float(high))
    shown = f"{params.format_value(low)}-{params.format_value(high)}"
    return _continuous(ctx, low, high, log, integer, item, field, shown)


def _continuous(ctx: _Ctx, low, high, log: bool, integer: bool, item: _Item, field: str,
                shown: str) -> Continuous:
    if not (_finite(low) and _finite(high) and _finite(high - low)):
        ctx.fail(f"range {shown} must have finite bounds", item.line, field)
    if not low < high:
        ctx.fail(f"empty range {shown}: min must be below max", item.line, field)
    if log and low <= 0:
        ctx.fail(f"log range {shown} needs min above 0", item.line, field)
    return Continuous(low, high, log=log, integer=integer)
