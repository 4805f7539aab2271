"""The ``experiments:`` section of a recipe: each experiment's keys, and the ``after`` DAG."""

from __future__ import annotations

import heapq
import re
from typing import NoReturn

from yaml.nodes import SequenceNode

from hypercli import params
from hypercli.recipe import environment
from hypercli.recipe.parameters import _parameters
from hypercli.recipe.registry_auth import registry_auth
from hypercli.recipe.resources import resources
from hypercli.recipe.specs import ExperimentSpec
from hypercli.recipe.yamltree import (
    _EXPERIMENT_NAME,
    _check_keys,
    _Ctx,
    _finite,
    _get,
    _int,
    _is_number,
    _Item,
    _kind,
    _line,
    _mapping,
    _show,
    _str,
    _strings,
    _suggest,
    _value,
)

MAX_TASKS = 1_000_000        #: largest number of tasks one recipe may make

#: an image reference, ``[registry[:port]/]name[:tag][@digest]``, as the grammar of
#: github.com/distribution/reference (reference.go) writes it: lower-case path components
#: joined by ``.``, ``_``, ``__`` or dashes; a registry host of letters, digits, dots and
#: inner dashes (or ``[IPv6]``), with a port; a tag of at most 128 word characters, dots and
#: dashes; a digest ``algorithm:hex`` of at least 32 hex digits. Nothing in it can start
#: with ``-`` or hold a space, so no value can become an option of ``docker run``.
_PATH_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_HOST_COMPONENT = r"(?:[a-zA-Z0-9]|[a-zA-Z0-9][a-zA-Z0-9-]*[a-zA-Z0-9])"
IMAGE_REFERENCE = re.compile(
    rf"(?:(?:{_HOST_COMPONENT}(?:\.{_HOST_COMPONENT})*|\[[0-9a-fA-F:]+\])(?::[0-9]+)?/)?"
    rf"{_PATH_COMPONENT}(?:/{_PATH_COMPONENT})*"
    r"(?::[\w][\w.-]{0,127})?"
    r"(?:@[A-Za-z][A-Za-z0-9]*(?:[-_+.][A-Za-z][A-Za-z0-9]*)*:[0-9a-fA-F]{32,})?")
IMAGE_NAME_MAX = 255  #: characters of an image's name (its reference without tag and digest)

# --- experiments -----------------------------------------------------------------------------

_EXPERIMENT_KEYS = ("command", "commands", "image", "parameters", "sampling", "samples",
                    "after", "retries", "env", "workers", "resources", "hardware", "nodes",
                    "checkpoint_every", "checkpoint_ranks", "engine", "registry_auth", "minutes",
                    "secrets", "timeout")
ENGINES = ("spark", "ray")   #: what ``engine:`` may name (hypercli/node/engine.py starts them)
#: ``checkpoint_ranks:``: ``each`` keeps every rank's HYPER_CHECKPOINT and gives each rank its
#: own back; ``rank0`` keeps rank 0's and gives it to every rank (a folder the ranks share)
CHECKPOINT_RANKS = ("each", "rank0")


def _experiments(ctx: _Ctx, item: _Item) -> tuple[dict, tuple]:
    entries = _mapping(ctx, item, "experiments", null_ok=True)
    if not entries:
        ctx.fail("experiments must not be empty", item.line, "experiments",
                 "add an experiment with a command")
    experiments, counts, after_lines = {}, {}, {}
    for name, it in entries.items():
        if not _EXPERIMENT_NAME.fullmatch(name):
            ctx.fail(f"experiment name {_show(name)} is not valid", it.line,
                     f"experiments.{name}",
                     "1-64 letters, digits, '_', '.', '-', not starting with '.' or '-'")
        experiments[name], counts[name], after_lines[name] = _experiment(ctx, name, it)
    _check_after(ctx, experiments, after_lines)
    total = sum(counts.values())
    if total > MAX_TASKS:
        big = max(counts, key=counts.__getitem__)
        ctx.fail(f"the recipe makes {_count(total)} tasks, more than {MAX_TASKS:,}", item.line,
                 "experiments", f"experiment {big} alone makes {_count(counts[big])}")
    return experiments, _order(ctx, experiments, after_lines)


def _count(n: int) -> str:
    return f"{n:,}" if n < 10**18 else "over 10^18"


def _experiment(ctx: _Ctx, name: str, item: _Item) -> tuple[ExperimentSpec, int, list]:
    """One experiment → (spec, task count, [(after name, line), ...])."""
    f = f"experiments.{name}"
    keys = _mapping(ctx, item, f)
    _check_keys(ctx, keys, _EXPERIMENT_KEYS, f)
    if "command" in keys and "commands" in keys:
        ctx.fail("give command or commands, not both", keys["commands"].line,
                 f"{f}.commands", "commands: [a, b] is command: [a, b]")
    if "commands" in keys:  # Hyper's form: a list run in order, stopping at the first failure
        if not isinstance(keys["commands"].node, SequenceNode):
            ctx.fail("commands must be a list of lines", keys["commands"].line,
                     f"{f}.commands", "for a single line write command: ...")
        keys["command"] = keys["commands"]
    if "command" not in keys:
        ctx.fail("command is required", item.line, f"{f}.command", "add command: python ...")
    cfield = f"{f}.commands" if "commands" in keys else f"{f}.command"
    command = _command(ctx, keys["command"], cfield)
    minutes = None
    if "minutes" in keys:
        minutes = _get(ctx, keys["minutes"], f"{f}.minutes",
                       lambda v: _is_number(v) and _finite(v) and v > 0,
                       "a number of minutes above 0")
    parameters = _parameters(ctx, keys.get("parameters"), f"{f}.parameters")
    sampling = _sampling(ctx, keys["sampling"], f"{f}.sampling") if "sampling" in keys else "grid"
    samples = _int(ctx, keys["samples"], f"{f}.samples", lo=1) if "samples" in keys else None
    after = []
    if "after" in keys:
        after = _strings(ctx, keys["after"], f"{f}.after", single_ok=True, empty_ok=True)
    retries = _int(ctx, keys["retries"], f"{f}.retries", 0, 100) if "retries" in keys else 0
    image = _image(ctx, keys["image"], f"{f}.image") if "image" in keys else None
    env = environment.env(ctx, keys["env"], f"{f}.env") if "env" in keys else {}
    secrets = (environment.secrets(ctx, keys["secrets"], f"{f}.secrets", env)
               if "secrets" in keys else ())
    workers = _int(ctx, keys["workers"], f"{f}.workers", lo=1) if "workers" in keys else None
    sharded = [k for k, v in parameters.items() if isinstance(v, params.Shards)]
    if len(sharded) > 1:
        ctx.fail(f"only one parameter can split files across tasks, not {len(sharded)} "
                 f"({', '.join(sharded)})", keys["parameters"].line, f"{f}.parameters")
    every = 60.0
    if "checkpoint_every" in keys:
        every = _get(ctx, keys["checkpoint_every"], f"{f}.checkpoint_every",
                     lambda v: _is_number(v) and _finite(v) and v >= 1,
                     "a number of seconds, at least 1")
    timeout = _timeout(ctx, keys["timeout"], f"{f}.timeout") if "timeout" in keys else None
    ranks = "each"
    if "checkpoint_ranks" in keys:
        ranks = _str(ctx, keys["checkpoint_ranks"], f"{f}.checkpoint_ranks")
        if ranks not in CHECKPOINT_RANKS:
            ctx.fail(f"checkpoint_ranks must be each or rank0, not {_show(ranks)}",
                     keys["checkpoint_ranks"].line, f"{f}.checkpoint_ranks",
                     _suggest(ranks, list(CHECKPOINT_RANKS), "choices"))
    engine = None
    if "engine" in keys:
        engine = _str(ctx, keys["engine"], f"{f}.engine")
        if engine not in ENGINES:
            ctx.fail(f"engine must be spark or ray, not {_show(engine)}", keys["engine"].line,
                     f"{f}.engine", _suggest(engine, list(ENGINES), "choices"))
    _check_placeholders(ctx, command, parameters, keys["command"].line, cfield)
    for var, (value, line) in env.items():
        _check_placeholders(ctx, value, parameters, line, f"{f}.env.{var}")
    try:
        count = params.count_samples(parameters, sampling, samples)
    except ValueError as e:
        line = keys["samples"].line if "samples" in keys else item.line
        ctx.fail(str(e), line, f"{f}.samples", "add samples: N")
    spec = ExperimentSpec(
        name=name, command=command, parameters=parameters, sampling=sampling, samples=samples,
        after=tuple(dict.fromkeys(a for a, _ in after)), retries=retries, image=image,
        env={k: v for k, (v, _) in env.items()}, workers=workers, line=item.line,
        resources=resources(ctx, keys, f), checkpoint_every=every, checkpoint_ranks=ranks,
        engine=engine,
        registry_auth=registry_auth(ctx, keys, f), secrets=secrets,
        timeout=timeout, minutes=minutes)
    return spec, count, after


#: seconds per unit of a ``timeout:`` written as text ("90s", "30m", "2h")
_UNITS = {"s": 1, "m": 60, "h": 3600}
_TIMEOUT_MAX = 30 * 86400  #: s: a time limit longer than 30 days is a mistake


def _timeout(ctx: _Ctx, item: _Item, field: str) -> float:
    """``timeout:`` → seconds: a number of seconds, or a number followed by s, m or h."""
    v = _value(ctx, item.node)
    hint = "a number of seconds, or a number followed by s, m or h: 90, 90s, 30m, 2h"
    if isinstance(v, str):
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", v)
        unit = m.group(2).lower() if m else ""
        if not m or (unit and unit not in _UNITS):
            if m and unit[:1] in _UNITS:  # 30min, 2 hours, 90sec
                hint = f"did you mean {m.group(1)}{unit[:1]}? ({hint})"
            ctx.fail(f"timeout must be a duration, not {_show(v)}", item.line, field, hint)
        seconds = float(m.group(1)) * _UNITS.get(unit, 1)
    elif _is_number(v):
        seconds = float(v)
    else:
        ctx.fail(f"timeout must be a duration, not {_kind(v)}", item.line, field, hint)
    if not (_finite(seconds) and 0 < seconds <= _TIMEOUT_MAX):
        ctx.fail(f"timeout must be more than 0 and at most 30 days, not {_show(v)}", item.line,
                 field, hint)
    return seconds


def _image(ctx: _Ctx, item: _Item, field: str) -> str:
    """An ``image:`` value checked as an image reference (:data:`IMAGE_REFERENCE`)."""
    v = _str(ctx, item, field)
    name = v.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]  # a tag follows ':' in the last part (a port does not)
    name = name[:len(name) - len(last)] + last.split(":", 1)[0]
    if not IMAGE_REFERENCE.fullmatch(v) or len(name) > IMAGE_NAME_MAX:
        ctx.fail(f"image {_show(v)} is not an image reference", item.line, field,
                 "[registry[:port]/]name[:tag][@sha256:digest], e.g. python:3.11-slim; "
                 "lower-case name, no spaces, not starting with '-'")
    return v


def _command(ctx: _Ctx, item: _Item, field: str) -> str:
    if isinstance(item.node, SequenceNode):
        lines = [_get(ctx, _Item(_line(n), n), f"{field}[{i}]", lambda v: isinstance(v, str),
                      "a string") for i, n in enumerate(item.node.value)]
        text = "\n".join(lines)
    else:
        text = _get(ctx, item, field, lambda v: isinstance(v, str), "a string or a list of lines")
    if not text.strip():
        ctx.fail("command must not be empty", item.line, field)
    if "\x00" in text:
        ctx.fail("command must not contain a NUL character", item.line, field)
    return text


def _sampling(ctx: _Ctx, item: _Item, field: str) -> str:
    v = _str(ctx, item, field)
    if v not in ("grid", "random"):
        ctx.fail(f"sampling must be grid or random, not {_show(v)}", item.line, field,
                 _suggest(v, ["grid", "random"], "choices"))
    return v


def _check_placeholders(ctx: _Ctx, text: str, parameters: dict, line: int, field: str) -> None:
    for name in params.placeholders(text):
        if name not in parameters:
            hint = _suggest(name, list(parameters), "parameters") if parameters else None
            ctx.fail(f"placeholder {{{{{name}}}}} names no parameter", line, field,
                     hint or f"add {name} under parameters")


def _check_after(ctx: _Ctx, experiments: dict, after_lines: dict) -> None:
    for name, refs in after_lines.items():
        for ref, line in refs:
            field = f"experiments.{name}.after"
            if ref == name:
                ctx.fail(f"experiment {name} cannot run after itself", line, field)
            if ref not in experiments:
                others = [n for n in experiments if n != name]
                ctx.fail(f"after names no experiment {_show(ref)}", line, field,
                         _suggest(ref, others, "experiments"))


def _order(ctx: _Ctx, experiments: dict, after_lines: dict) -> tuple[str, ...]:
    """Kahn's algorithm, taking ready experiments in file order; a cycle is an error."""
    names = list(experiments)
    index = {n: i for i, n in enumerate(names)}
    waiting = {n: len(e.after) for n, e in experiments.items()}
    dependents: dict[str, list[str]] = {n: [] for n in names}
    for n, e in experiments.items():
        for dep in e.after:
            dependents[dep].append(n)
    ready = [index[n] for n in names if waiting[n] == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        name = names[heapq.heappop(ready)]
        order.append(name)
        for m in dependents[name]:
            waiting[m] -= 1
            if waiting[m] == 0:
                heapq.heappush(ready, index[m])
    if len(order) < len(names):
        _fail_cycle(ctx, experiments, set(order), index, after_lines)
    return tuple(order)


def _fail_cycle(ctx: _Ctx, experiments: dict, placed: set, index: dict,
                after_lines: dict) -> NoReturn:
    """Every unplaced experiment waits on another unplaced one: follow those edges to a cycle."""
    path = [min((n for n in experiments if n not in placed), key=index.__getitem__)]
    seen = {path[0]: 0}
    while True:
        nxt = next(d for d in experiments[path[-1]].after if d not in placed)
        if nxt in seen:
            cycle = path[seen[nxt]:]
            break
        seen[nxt] = len(path)
        path.append(nxt)
    start = cycle.index(min(cycle, key=index.__getitem__))
    cycle = cycle[start:] + cycle[:start]
    line = next(ln for ref, ln in after_lines[cycle[0]] if ref == cycle[1 % len(cycle)])
    shown = cycle + [cycle[0]] if len(cycle) <= 8 else cycle[:4] + ["..."] + cycle[-3:] + cycle[:1]
    ctx.fail(f"cycle in after: {' -> '.join(shown)}", line, f"experiments.{cycle[0]}.after",
             f"the cycle has {len(cycle)} experiments" if len(cycle) > 8 else None)


