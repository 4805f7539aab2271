"""An experiment's ``registry_auth:``: credentials of the private registry of its image
(:mod:`hypercli.registry` says where their values come from and where they never go)."""

from __future__ import annotations

import re

from hypercli.recipe.yamltree import _check_keys, _Ctx, _Item, _mapping, _show, _str

_REF = re.compile(r"\$\{([^}]*)\}")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def registry_auth(ctx: _Ctx, keys: dict, f: str) -> dict | None:
    """``{"username": text, "password": text}`` (each a literal or ``${VAR}``) of an
    experiment's ``registry_auth``, or None. It needs ``image``."""
    if "registry_auth" not in keys:
        return None
    item: _Item = keys["registry_auth"]
    field = f"{f}.registry_auth"
    if "image" not in keys:
        ctx.fail("registry_auth needs an image: it signs in to the image's registry",
                 item.line, field, "add image: REGISTRY/NAME:TAG")
    entries = _mapping(ctx, item, field)
    _check_keys(ctx, entries, ("username", "password"), field)
    out = {}
    for k in ("username", "password"):
        if k not in entries:
            ctx.fail(f"registry_auth needs {k}", item.line, f"{field}.{k}",
                     "password: ${VAR} takes it from your environment when the run starts")
        v = _str(ctx, entries[k], f"{field}.{k}")
        m = _REF.fullmatch(v)
        if m and not _NAME.fullmatch(m[1]):
            ctx.fail(f"{_show(m[1])} is not a variable name", entries[k].line,
                     f"{field}.{k}", "${NAME}: letters, digits and '_'")
        out[k] = v
    return out
