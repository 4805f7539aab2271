"""An experiment's ``env:`` and ``secrets:``: the variables its tasks get, checked.

``env:`` is a mapping ``NAME: value`` or a list whose items are ``NAME`` (the caller's
variable passed through) or ``NAME=value``. A value may hold ``${VAR}`` references to the
environment of the ``hyper run`` that submits the workflow (``$${`` is a literal ``${``); a
bare ``NAME`` in a list is kept as the value ``${NAME}``. They are resolved at submit time by
:mod:`hypercli.envvars`, not here: the recipe layer only checks the text.

``secrets:`` is a list of variable names whose values come from the caller's environment and
are never recorded (:mod:`hypercli.envvars` says where they never go). A secret may not also
be in ``env:``, and no ``env:`` value may refer to a secret with ``${NAME}`` (its value would
be recorded as part of that variable).
"""

from __future__ import annotations

import datetime
import re

from yaml.nodes import SequenceNode

from hypercli.recipe.yamltree import (
    _IDENT,
    _Ctx,
    _Item,
    _kind,
    _mapping,
    _show,
    _strings,
    _value,
)

#: ``${NAME}`` in an env value (``$${`` escapes it); group 1 is the name, or None for ``$${``
REFERENCE = re.compile(r"\$\$\{|\$\{([^}]*)\}")


def references(text: str) -> list[str]:
    """The variable names ``text`` refers to with ``${NAME}``, in order (``$${`` skipped)."""
    return [m[1] for m in REFERENCE.finditer(text) if m[1] is not None]


def _name(ctx: _Ctx, var: str, line: int, field: str) -> None:
    if not _IDENT.fullmatch(var):
        ctx.fail(f"{_show(var)} is not a valid variable name", line, field,
                 "letters, digits and '_', not starting with a digit")
    if var.startswith("HYPER_"):
        ctx.fail(f"{var} is reserved: hyper sets HYPER_ variables itself", line, field,
                 "choose another name")


def _text(ctx: _Ctx, var: str, it: _Item, field: str) -> str:
    """A mapping value as text: numbers and dates as written (1.10 stays "1.10"), booleans
    "true"/"false"."""
    v = _value(ctx, it.node)
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float, datetime.date)):
        return it.node.value
    ctx.fail(f"{var} must be a string, number or boolean, not {_kind(v)}", it.line, field,
             'use "" for an empty value' if v is None else None)


def env(ctx: _Ctx, item: _Item, field: str) -> dict:
    """``env:`` → name → (value text, line); a bare list item ``NAME`` becomes ``${NAME}``.

    Fails (RecipeError through ``ctx``): a bad or reserved name, a name given twice in a list,
    a value that is not a scalar or holds NUL, a ``${...}`` that is not a variable name.
    """
    out: dict = {}
    if isinstance(item.node, SequenceNode):
        for i, (entry, line) in enumerate(_strings(ctx, item, field, single_ok=False,
                                                   empty_ok=True)):
            var, eq, text = entry.partition("=")
            f = f"{field}[{i}]"
            _name(ctx, var, line, f)
            if var in out:
                ctx.fail(f"{var} is given twice", line, f, "keep one")
            out[var] = (text if eq else "${%s}" % var, line)
    else:
        for var, it in _mapping(ctx, item, field, null_ok=True).items():
            f = f"{field}.{var}"
            _name(ctx, var, it.line, f)
            out[var] = (_text(ctx, var, it, f), it.line)
    for var, (text, line) in out.items():
        if "\x00" in text:
            ctx.fail(f"{var} must not contain a NUL character", line, f"{field}.{var}")
        for ref in references(text):
            if not _IDENT.fullmatch(ref):
                ctx.fail(f"${{{ref}}} does not name a variable", line, f"{field}.{var}",
                         "${NAME}: letters, digits and '_'; write $${ for a literal ${")
    return out


def secrets(ctx: _Ctx, item: _Item, field: str, env_: dict) -> tuple[str, ...]:
    """``secrets:`` → the variable names, in file order, checked against ``env_`` (what
    :func:`env` returned for the same experiment).

    Fails: not a list of names, a reserved name, a name also in ``env:``, an ``env:`` value
    that refers to a secret.
    """
    out: list[str] = []
    for i, (var, line) in enumerate(_strings(ctx, item, field, single_ok=False,
                                             empty_ok=True)):
        _name(ctx, var, line, f"{field}[{i}]")
        if var in env_:
            ctx.fail(f"{var} is both in env and in secrets", env_[var][1],
                     f"{field.rsplit('.', 1)[0]}.env.{var}",
                     "remove it from env: a secret's value comes from your environment")
        if var not in out:
            out.append(var)
    for var, (text, line) in env_.items():
        for ref in references(text):
            if ref in out:
                ctx.fail(f"{var} refers to the secret {ref}: its value would be recorded",
                         line, f"{field.rsplit('.', 1)[0]}.env.{var}",
                         f"build it in the command instead, e.g. {var}=\"...${ref}\"")
    return tuple(out)

