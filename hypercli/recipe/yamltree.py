"""The YAML node tree of a recipe: parsing with line numbers, and the checks of single values.

Every recipe section (:mod:`.cluster`, :mod:`.experiments`, :mod:`.parameters`,
:mod:`.resources`) walks the tree through these helpers, so that each problem is one
:class:`~hypercli.errors.RecipeError` naming the line and the dotted field path.
"""

from __future__ import annotations

import datetime
import difflib
import math
import re
from typing import Any, Callable, NamedTuple, NoReturn

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from hypercli.errors import RecipeError

MAX_BYTES = 256 << 10  # a recipe is a few KiB; PyYAML parses ~60 KiB/s at worst
MAX_EXPANDED = 8 * MAX_BYTES  #: alias expansion budget: 8 per node plus 1 per scalar character
_INT64 = 2**63 - 1  # every integer must fit a SQLite INTEGER
_RECIPE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_EXPERIMENT_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}")
_IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_NUM = r"[+-]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?"
_RANGE = re.compile(rf"\s*({_NUM})\s*-\s*({_NUM})\s*")
_INT_TEXT = re.compile(r"[+-]?\d+")
_URL = re.compile(r"([a-z][a-z0-9+]*)://(.*)", re.S)
_HOST = re.compile(r"(?:[A-Za-z0-9_][A-Za-z0-9_.-]*@)?"
                   r"(?:[A-Za-z0-9](?:[A-Za-z0-9.-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\])"
                   r"(?::(?P<port>\d{1,5}))?")
_MAP_TAG, _SEQ_TAG = "tag:yaml.org,2002:map", "tag:yaml.org,2002:seq"
_MERGE_TAG = "tag:yaml.org,2002:merge"
_STR_TAG = "tag:yaml.org,2002:str"
_EXP_FLOAT = re.compile(r"[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)[eE][-+]?[0-9]+")
_HASHABLE_KEYS = (str, int, float, bytes, datetime.date, type(None))


class _Item(NamedTuple):
    """A value node and the line of its key (or of the list item itself)."""

    line: int
    node: Node


class _Ctx:
    """Per-parse state: the file for messages and one constructor for scalars."""

    def __init__(self, path: str | None):
        self.path = path
        self.constructor = yaml.constructor.SafeConstructor()

    def fail(self, message: str, line: int | None = None, field: str | None = None,
             hint: str | None = None) -> NoReturn:
        raise RecipeError(message, path=self.path, line=line, field=field or None, hint=hint)


def _line(node: Node) -> int:
    return node.start_mark.line + 1


def _yaml_message(e: Exception) -> tuple[str, int | None]:
    if isinstance(e, yaml.MarkedYAMLError):
        mark = e.problem_mark or e.context_mark
        text = " ".join(p for p in (e.context, e.problem) if p)
        return text or type(e).__name__, (mark.line + 1 if mark else None)
    if isinstance(e, RecursionError):
        return "nested too deeply", None
    return (str(e).splitlines() or [type(e).__name__])[0], None


_SURROGATE = re.compile("[\ud800-\udfff]")


def _compose(ctx: _Ctx, text: str) -> Node | None:
    try:
        return yaml.compose(text, Loader=yaml.SafeLoader)
    except Exception as e:  # PyYAML also raises ValueError, RecursionError, ...
        message, line = _yaml_message(e)
        ctx.fail(f"not valid YAML: {message}", line)


def _construct(ctx: _Ctx, node: ScalarNode) -> Any:
    if node.tag == _STR_TAG and node.style is None and _EXP_FLOAT.fullmatch(node.value):
        return float(node.value)  # YAML 1.2 reads 1e-4 as a number; PyYAML as a string
    try:
        return ctx.constructor.construct_object(node, deep=True)
    except Exception as e:  # e.g. ValueError for the timestamp 2024-13-45
        ctx.fail(f"not valid YAML: {_yaml_message(e)[0]}", _line(node))


def _value(ctx: _Ctx, node: Node) -> Any:
    """A scalar's Python value; a list or mapping node is returned as is."""
    return _construct(ctx, node) if isinstance(node, ScalarNode) else node


def _precheck(ctx: _Ctx, root: Node) -> None:
    """Refuse what ``yaml.safe_load`` would (bad scalars, odd tags), duplicate keys anywhere,
    and alias expansion beyond :data:`MAX_EXPANDED`. Visits each node once."""
    seen, stack = set(), [root]
    while stack:
        node = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, ScalarNode):
            if _SURROGATE.search(node.value):
                ctx.fail("not valid Unicode: a lone surrogate (a \\ud800-\\udfff escape "
                         "that is not half of a pair)", _line(node),
                         hint="write the character itself, or \\U0001F389 for one above "
                         "U+FFFF")
            if node.tag != _MERGE_TAG:
                _construct(ctx, node)
        elif node.tag not in (_MAP_TAG, _SEQ_TAG):
            ctx.fail(f"not valid YAML: the tag {node.tag} is not supported", _line(node))
        elif isinstance(node, SequenceNode):
            stack.extend(node.value)
        else:
            keys: dict = {}
            for k, v in node.value:
                stack += (k, v)
                if isinstance(k, ScalarNode):
                    key = "<<" if k.tag == _MERGE_TAG else _construct(ctx, k)
                    if not isinstance(key, _HASHABLE_KEYS):
                        continue
                    if key in keys:
                        ctx.fail(f"duplicate key {_show(key)} (first on line {keys[key]})",
                                 _line(k))
                    keys[key] = _line(k)
    if _expanded_size(root) > MAX_EXPANDED:
        ctx.fail("aliases expand to too large a document", hint="use fewer aliases (*name)")


def _children(node: Node) -> list:
    if isinstance(node, SequenceNode):
        return node.value
    return [n for pair in node.value for n in pair] if isinstance(node, MappingNode) else []


def _expanded_size(root: Node) -> int:
    """Size of the document with aliases expanded (a recursive alias counts once), stopping
    early past :data:`MAX_EXPANDED`."""
    memo: dict[int, int] = {}
    open_: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, done = stack.pop()
        if done:
            size = 8 + sum(memo.get(id(c), 8) for c in _children(node))
            memo[id(node)] = size
            open_.discard(id(node))
            if size > MAX_EXPANDED:
                return size
        elif id(node) not in memo and id(node) not in open_:
            if isinstance(node, ScalarNode):
                memo[id(node)] = 8 + len(node.value)
                continue
            open_.add(id(node))
            stack.append((node, True))
            stack.extend((c, False) for c in _children(node))
    return memo[id(root)]


def _entries(ctx: _Ctx, node: MappingNode, field: str, seen: set, depth: int = 0) -> dict:
    """key → _Item of a mapping node; merge keys (``<<``) expanded, explicit keys winning."""
    if depth > 50:
        ctx.fail("merge keys (<<) nested too deeply", _line(node), field)
    own: dict[str, _Item] = {}
    merged: dict[str, _Item] = {}
    for k, v in node.value:
        if k.tag == _MERGE_TAG:
            for src in v.value if isinstance(v, SequenceNode) else [v]:
                if not isinstance(src, MappingNode):
                    ctx.fail("<< must be given a mapping or a list of mappings", _line(k), field)
                if id(src) not in seen:
                    seen.add(id(src))
                    for key, item in _entries(ctx, src, field, seen, depth + 1).items():
                        merged.setdefault(key, item)
            continue
        key = _value(ctx, k)
        if not isinstance(key, str):
            if not isinstance(k, ScalarNode):
                ctx.fail(f"keys must be strings, not {_kind(key)}", _line(k), field)
            ctx.fail(f"key {_show(key)} must be a string", _line(k), field,
                     f"quote it: '{k.value}'")
        own[key] = _Item(_line(k), v)
    return {**merged, **own}


def _mapping(ctx: _Ctx, item: _Item, field: str, *, null_ok: bool = False) -> dict:
    """The entries of a mapping value; null counts as an empty mapping when ``null_ok``."""
    v = _value(ctx, item.node)
    if v is None and null_ok:
        return {}
    if not isinstance(v, MappingNode):
        ctx.fail(f"{_leaf(field)} must be a mapping, not {_kind(v)}", item.line, field)
    return _entries(ctx, v, field, {id(v)})


def _check_keys(ctx: _Ctx, entries: dict, allowed, field: str) -> None:
    for key, item in entries.items():
        if key not in allowed:
            ctx.fail(f"unknown key {_show(key)}", item.line, _join(field, key),
                     _suggest(key, list(allowed), "valid keys"))


# --- scalar fields ---------------------------------------------------------------------------

def _join(field: str, key: str) -> str:
    return f"{field}.{key}" if field else key


def _leaf(field: str) -> str:
    return field.rsplit(".", 1)[-1]


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(v: Any) -> str:
    if isinstance(v, MappingNode):
        return "a mapping"
    if isinstance(v, SequenceNode):
        return "a list"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"a boolean ({str(v).lower()})"
    if isinstance(v, int):
        return f"an integer ({_show(v)})"
    if isinstance(v, float):
        return f"a number ({v!r})"
    if isinstance(v, str):
        return f"a string ({_show(v)})"
    if isinstance(v, datetime.date):
        return f"a date ({v})"
    return f"a {type(v).__name__}"


def _suggest(word: str, choices: list, label: str) -> str | None:
    """'did you mean ...?' for a close match, else the list of choices (first 12)."""
    close = difflib.get_close_matches(word[:200], choices, n=1, cutoff=0.6)
    if close:
        return f"did you mean '{close[0]}'?"
    if not choices:
        return None
    more = ", ..." if len(choices) > 12 else ""
    return f"{label}: {', '.join(choices[:12])}{more}"


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _finite(x: Any) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:  # an int too large for a float
        return False


def _get(ctx: _Ctx, item: _Item, field: str, ok: Callable[[Any], bool], what: str) -> Any:
    v = _value(ctx, item.node)
    if not ok(v):
        ctx.fail(f"{_leaf(field)} must be {what}, not {_kind(v)}", item.line, field)
    return v


def _str(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _get(ctx, item, field, lambda v: isinstance(v, str), "a string")
    if not v.strip():
        ctx.fail(f"{_leaf(field)} must not be empty", item.line, field)
    if "\x00" in v:
        ctx.fail(f"{_leaf(field)} must not contain a NUL character", item.line, field)
    return v


def _int(ctx: _Ctx, item: _Item, field: str, lo: int | None = None, hi: int = _INT64) -> int:
    v = _get(ctx, item, field, _is_int, "an integer")
    if lo is not None and v < lo:
        ctx.fail(f"{_leaf(field)} must be at least {lo}", item.line, field)
    if v > hi:
        ctx.fail(f"{_leaf(field)} must be at most {hi}", item.line, field)
    return v


def _bool(ctx: _Ctx, item: _Item, field: str) -> bool:
    return _get(ctx, item, field, lambda v: isinstance(v, bool), "true or false")


def _strings(ctx: _Ctx, item: _Item, field: str, *, single_ok: bool, empty_ok: bool) -> list:
    """A list of non-empty strings (or one string when ``single_ok``), with item lines."""
    if single_ok and isinstance(item.node, ScalarNode):
        return [(_str(ctx, item, field), item.line)]
    if not isinstance(item.node, SequenceNode):
        what = "a string or a list of strings" if single_ok else "a list of strings"
        ctx.fail(f"{_leaf(field)} must be {what}, not {_kind(_value(ctx, item.node))}",
                 item.line, field)
    if not item.node.value and not empty_ok:
        ctx.fail(f"{_leaf(field)} must not be an empty list", item.line, field)
    return [(_str(ctx, _Item(_line(n), n), f"{field}[{i}]"), _line(n))
            for i, n in enumerate(item.node.value)]


def _name(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _str(ctx, item, field)
    if not _RECIPE_NAME.fullmatch(v):
        ctx.fail(f"{_leaf(field)} {_show(v)} is not a valid name", item.line, field,
                 "1-63 letters, digits, '_', '.', '-', starting with a letter or digit")
    return v

