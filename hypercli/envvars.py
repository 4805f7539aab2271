"""Where a task's environment variables come from, and where a secret's value never goes.

Sources, lowest precedence first (docs/recipes.md, "Environment and secrets"):

1. the recipe's ``env:`` (a ``${VAR}`` in a value, or a bare ``NAME`` in a list, is taken from
   the environment of the ``hyper run`` that submits the workflow, overlaid by 2 and 3);
2. ``--env-file FILE`` (dotenv format, read by python-dotenv), later files winning;
3. ``--env NAME=VALUE`` (or ``--env NAME``: this process's ``NAME``), applied to every
   experiment.

These are *recorded*: they are part of the plan and of the state file. A missing variable is
a :class:`~hypercli.errors.UsageError` (exit 2) naming it.

An experiment's ``secrets: [NAME, ...]`` are not: their values are taken from ``--env-file``
or this process's environment when the workflow is submitted (:func:`secret_values`), kept in
this process's memory only (:func:`remember`), and added to each attempt's launch spec when it
is sent to the node's agent (:func:`for_workflow`): on the SSH channel's stdin, or the local
agent's pipe. The agent puts them in the task's environment; a container reads them from
its stdin, which the agent fills and closes, before its command starts (not ``-e NAME``:
podman keeps ``-e`` values in its state database after the container is removed).
The state file keeps the names only (:func:`stored`). A process that drives the workflow later
(a resumed ``hyper run``, the background driver) asks its own environment again, and refuses
to go on, naming the variable, when it is not set. A secret's value on the command line
(``--env NAME=VALUE``) is refused: the process table would show it.
"""

from __future__ import annotations

import os
import re
import shlex
import threading
from typing import Iterable, Mapping

from hypercli.errors import UsageError

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_CACHE: dict[str, dict[str, str]] = {}
_LOCK = threading.Lock()
MASK = "***"  #: how a secret's value is shown
#: most bytes of one experiment's secrets, as the ``export NAME='value'`` lines a container
#: reads them in from a pipe the node's agent fills in one write, which must fit the pipe's
#: buffer (64 KiB on Linux, pipe(7))
MAX_BYTES = 32 << 10


def _check_name(name: str, where: str) -> None:
    if not _NAME.fullmatch(name):
        raise UsageError(f"{where}: {name!r} is not a variable name",
                         "letters, digits and '_', not starting with a digit")
    if name.startswith("HYPER_"):
        raise UsageError(f"{where}: {name} is reserved: hyper sets HYPER_ variables itself")


def from_options(env: Iterable[str] = (), env_files: Iterable[str] = (),
                 environ: Mapping[str, str] | None = None) -> tuple[dict, frozenset]:
    """``--env-file`` files then ``--env`` entries → (name → value, the names given with a
    value on the command line).

    Args:
        env: ``NAME=VALUE`` or ``NAME`` (the value of ``environ``'s NAME) items; or a
            mapping name → value (the Python API), whose values may be secrets.
        env_files: dotenv files (``NAME=value`` lines, ``#`` comments, quotes; python-dotenv's
            rules, ``${VAR}`` expanded from the file and the environment).
        environ: the environment ``--env NAME`` reads (default ``os.environ``).
    Raises:
        UsageError: a file that cannot be read or has a line that is not ``NAME=value``; a
            bad or reserved name; ``--env NAME`` of a variable that is not set.
    """
    from dotenv import dotenv_values
    environ = os.environ if environ is None else environ
    values: dict[str, str] = {}
    for path in env_files:
        if not os.path.isfile(path):
            raise UsageError(f"--env-file {path}: no such file")
        try:
            read = dotenv_values(path)
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"--env-file {path}: cannot be read: {e}") from None
        for name, value in read.items():
            _check_name(name, f"--env-file {path}")
            if value is None:
                raise UsageError(f"--env-file {path}: {name} has no value",
                                 f"write {name}=VALUE")
            values[name] = value
    literal = set()
    if isinstance(env, Mapping):  # the Python API: values not on any command line
        for name, value in env.items():
            _check_name(name, "env")
            values[name] = str(value)
        env = ()
    for item in env:
        name, eq, value = item.partition("=")
        _check_name(name, f"--env {item.split('=', 1)[0]}")
        if not eq:
            if environ.get(name) is None:
                raise UsageError(f"--env {name}: {name} is not set in the environment",
                                 f"export {name}=... or give --env {name}=VALUE")
            value = environ[name]
        else:
            literal.add(name)
        values[name] = value
    return values, frozenset(literal)


def secret_names(recipe) -> dict[str, tuple[str, ...]]:
    """experiment → its ``secrets:`` names, for the experiments that have any."""
    return {n: tuple(e.secrets) for n, e in recipe.experiments.items()
            if getattr(e, "secrets", ())}


def lookups(recipe, overrides: Mapping[str, str] | None = None,
            environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The values of every ``${VAR}`` the recipe's ``env:`` refers to: ``overrides``
    (``--env``/``--env-file``) over ``environ`` (default ``os.environ``).

    Raises:
        UsageError: a variable that is not set, naming it and the field that refers to it;
            a reference to a secret of another experiment.
    """
    from hypercli.recipe.environment import references
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    hidden = {s: e for e, names in secret_names(recipe).items() for s in names}
    out: dict[str, str] = {}
    for name, exp in recipe.experiments.items():
        for var, text in exp.env.items():
            for ref in references(text):
                if ref in hidden:  # the recipe check catches it within one experiment
                    raise UsageError(f"experiments.{name}.env.{var} refers to {ref}, a secret "
                                     f"of experiment {hidden[ref]}: its value would be "
                                     "recorded", f"add {ref} to the secrets of {name} instead")
                value = overrides.get(ref, environ.get(ref))
                if value is None:
                    how = (f"passes {ref} through" if text == "${%s}" % ref
                           else f"refers to ${{{ref}}}")
                    raise UsageError(f"experiments.{name}.env.{var} {how}, but {ref} is not "
                                     "set in the environment",
                                     f"export {ref}=... or give it with --env/--env-file")
                out[ref] = value
    return out


def recorded(recipe, overrides: Mapping[str, str]) -> dict[str, str]:
    """The ``--env``/``--env-file`` values that become part of every task's recorded
    environment: all but the names that are a secret of some experiment."""
    hidden = {s for names in secret_names(recipe).values() for s in names}
    return {k: v for k, v in overrides.items() if k not in hidden}


def secret_values(names: Mapping[str, Iterable[str]], overrides: Mapping[str, str] | None = None,
                  literal: Iterable[str] = (), environ: Mapping[str, str] | None = None
                  ) -> dict[str, dict[str, str]]:
    """experiment → {name: value} of the secrets ``names`` (experiment → names), from
    ``overrides`` (``--env-file``, ``--env NAME``) over ``environ`` (default ``os.environ``).

    Raises:
        UsageError: a secret that is not set (naming it and its experiment); a secret given
            with its value on the command line (``literal``).
    """
    environ = os.environ if environ is None else environ
    overrides = overrides or {}
    out: dict[str, dict[str, str]] = {}
    for exp, secrets in names.items():
        for s in secrets:
            if s in literal:
                raise UsageError(f"--env {s}=...: {s} is a secret of experiment {exp}; its "
                                 "value on the command line would show in the process table",
                                 f"export {s}=... (or put it in an --env-file) and give "
                                 f"--env {s} or nothing")
            value = overrides.get(s, environ.get(s))
            if value is None:
                raise UsageError(f"the secret {s} of experiment {exp} is not set in the "
                                 "environment",
                                 f"export {s}=... before `hyper run` (secrets are never "
                                 "stored: every run that drives the workflow asks for them)")
            out.setdefault(exp, {})[s] = value
        size = sum(len(("export %s=%s\n" % (k, shlex.quote(v))).encode(
            errors="surrogateescape")) for k, v in out.get(exp, {}).items())  # as the agent
        # writes them (shell-quoted: a quote in a value takes 5 bytes)
        if size > MAX_BYTES:
            raise UsageError(f"the secrets of experiment {exp} hold {size} bytes, more than "
                             f"{MAX_BYTES}", "put a large credential in a file the task "
                             "fetches, and its key in a secret")
    return out


def stored(recipe) -> dict[str, list[str]]:
    """What the state file keeps of the secrets: experiment → names, never a value."""
    return {exp: list(names) for exp, names in secret_names(recipe).items()}


def remember(wid: str, values: Mapping[str, Mapping[str, str]]) -> None:
    """Keep a workflow's secret values (experiment → {name: value}) in this process's
    memory, for :func:`for_workflow`."""
    with _LOCK:
        _CACHE[wid] = {"\0".join((e, k)): v for e, kv in values.items() for k, v in kv.items()}


def remembered(wid: str) -> dict[str, str]:
    """name → value of the secrets of ``wid`` this process holds (for a process it starts to
    drive the workflow)."""
    with _LOCK:
        return {k.split("\0", 1)[1]: v for k, v in _CACHE.get(wid, {}).items()}


def held() -> dict[str, str]:
    """name → value of every secret this process holds, of all its workflows."""
    with _LOCK:
        return {k.split("\0", 1)[1]: v for kv in _CACHE.values() for k, v in kv.items()}


def without_secrets(environ: Mapping[str, str], state=None) -> dict[str, str]:
    """``environ`` less every secret: the names this process holds (:func:`held`) and those
    the workflows in ``state`` (a :class:`hypercli.state.State`, or None) declare. For the
    environment a local agent passes on to all its tasks: a task gets its own experiment's
    secrets from its launch request only, never another's through the agent."""
    names = set(held())
    if state is not None:
        try:
            for wf in state.workflows(limit=10_000):
                for listed in ((wf.get("spec") or {}).get("secrets") or {}).values():
                    names.update(listed)
        except Exception:  # an unreadable state file: the held names still go
            pass
    return {k: v for k, v in environ.items() if k not in names}


def lacking(pid: int | str, values: Mapping[str, str]) -> list[str]:
    """The names of ``values`` that process ``pid`` (of this user: the background driver)
    does not have with that value in its environment (``/proc/PID/environ``); all of them
    when it cannot be read."""
    if not values:
        return []
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            raw = f.read()
    except (OSError, ValueError):
        return sorted(values)
    have = dict(item.partition(b"=")[::2] for item in raw.split(b"\0") if item)
    return sorted(k for k, v in values.items()
                  if have.get(os.fsencode(k)) != os.fsencode(v))


def for_workflow(wf: dict, environ: Mapping[str, str] | None = None
                 ) -> dict[str, dict[str, str]]:
    """experiment → {name: value} of a workflow's secrets (``wf``: its ``workflows`` row):
    from this process's memory, else from ``environ`` (default ``os.environ``).

    Raises:
        UsageError: a secret that is in neither, naming it.
    """
    names = (wf.get("spec") or {}).get("secrets") or {}
    with _LOCK:
        kept = dict(_CACHE.get(wf["id"], {}))
    environ = os.environ if environ is None else environ
    out: dict[str, dict[str, str]] = {}
    for exp, secrets in names.items():
        for s in secrets:
            value = kept.get(f"{exp}\0{s}", environ.get(s))
            if value is None:
                raise UsageError(f"the secret {s} of experiment {exp} of workflow {wf['id']} "
                                 "is not set in the environment",
                                 f"export {s}=... and run again: secrets are never stored, "
                                 "so every process that drives the workflow asks for them")
            out.setdefault(exp, {})[s] = value
    return out


def available(wf: dict, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process can drive workflow row ``wf``: it holds, or its environment has,
    every secret of it (:func:`for_workflow` would not raise)."""
    try:
        for_workflow(wf, environ)
        return True
    except UsageError:
        return False


def masked(env: Mapping[str, str], names: Iterable[str]) -> dict[str, str]:
    """``env`` with each of ``names`` (secrets) added as :data:`MASK`, for display."""
    return {**env, **{n: MASK for n in names}}


def shown_env(wf: dict, task: dict) -> dict[str, str]:
    """What a task's environment is shown as (``hyper ps --json``, the dashboard): its
    recorded ``env`` with each secret of its experiment (the ``wf`` row's names) as
    :data:`MASK`."""
    names = ((wf.get("spec") or {}).get("secrets") or {}).get(task["experiment"]) or ()
    return masked(task.get("env") or {}, names)
