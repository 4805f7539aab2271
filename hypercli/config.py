"""Defaults for recipes and commands: the file ``$HYPER_HOME/config.yaml``.

One job: read, check and write the defaults file, and fill a recipe's gaps from it. Where a
value comes from, first match wins (the precedence documented in docs/recipes.md, "Defaults"):

    a command-line flag  >  the recipe  >  config.yaml  >  hypercli's built-in default

The file is YAML; ``hyper config set/get/unset/list`` edit and show it. Keys::

    provider: aws                 # the provider of a recipe whose cluster names none
    storage: s3://bucket/hyper    # the storage of a recipe that names none
    idle_minutes: 20              # cloud nodes stop themselves after this long idle
    ssh: {identity_file: ~/.ssh/lab_key, user: ubuntu, port: 22}
    aws: {region: eu-west-1, spot: true, instance_type: g5.xlarge, ...}
    gcp: {project: my-project, region: europe-west4, ...}
    azure: {region: westeurope, resource_group: ml, ...}

A provider's section takes every ``cluster:`` key of that provider in a recipe except
``hosts`` (a cluster's own), and each value is checked by the recipe's own rules
(:mod:`hypercli.recipe.cluster`), so a value that a recipe would refuse is refused here too,
naming the file, line and key. Unknown keys are errors with "did you mean". The file is
written atomically with mode 0600. Nothing here reads a recipe file or opens the state file.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode

from hypercli import state as S
from hypercli.errors import RecipeError, UsageError
from hypercli.recipe.cluster import _PROVIDER_KEYS, PROVIDERS, STORAGE_SCHEMES, _url
from hypercli.recipe.specs import Recipe
from hypercli.recipe.yamltree import (
    _check_keys,
    _compose,
    _Ctx,
    _int,
    _Item,
    _line,
    _mapping,
    _precheck,
    _show,
    _str,
    _suggest,
)

#: the top-level keys and what they mean (``hyper config list`` shows these texts)
TOP_KEYS = {
    "provider": "provider of a recipe whose cluster: names none",
    "storage": "storage of a recipe that names none",
    "idle_minutes": "minutes a cloud node waits idle before it stops itself",
}
#: provider sections: every cluster: key of the provider but these
_NOT_DEFAULTS = ("hosts",)
#: built-in defaults shown by ``hyper config list`` (the others are the provider's own)
BUILT_IN = {"provider": "local", "idle_minutes": 30, "ssh.user": "root", "ssh.port": 22}


def path() -> Path:
    """``$HYPER_HOME/config.yaml`` (it need not exist)."""
    return S.home() / "config.yaml"


def known_keys() -> list[str]:
    """Every key the file may hold, dotted (``aws.region``), in a stable order."""
    keys = list(TOP_KEYS)
    for p in PROVIDERS:
        keys += [f"{p}.{k}" for k in _PROVIDER_KEYS[p] if k not in _NOT_DEFAULTS]
    return keys


def _check(ctx: _Ctx, root, base_dir: str) -> dict[str, Any]:
    """The checked values of a parsed file: dotted key → value."""
    out: dict[str, Any] = {}
    if root is None:
        return out
    _precheck(ctx, root)
    if not isinstance(root, MappingNode):
        ctx.fail("the top level must be a mapping of keys to values", _line(root),
                 hint="for example: provider: aws")
    top = _mapping(ctx, _Item(_line(root), root), "")
    sections = [p for p in PROVIDERS if _PROVIDER_KEYS[p]]
    for key, it in top.items():
        if key not in TOP_KEYS and key not in sections:
            ctx.fail(f"unknown key {_show(key)}", it.line, key,
                     _suggest(key, list(TOP_KEYS) + sections, "keys"))
    if "provider" in top:
        v = _str(ctx, top["provider"], "provider")
        if v not in PROVIDERS:
            ctx.fail(f"unknown provider {_show(v)}", top["provider"].line, "provider",
                     _suggest(v, list(PROVIDERS), "providers"))
        out["provider"] = v
    if "storage" in top:
        out["storage"] = _url(ctx, top["storage"], "storage", STORAGE_SCHEMES, base_dir)
    if "idle_minutes" in top:
        out["idle_minutes"] = _int(ctx, top["idle_minutes"], "idle_minutes", lo=1)
    for p in sections:
        if p not in top:
            continue
        own = {k: f for k, f in _PROVIDER_KEYS[p].items() if k not in _NOT_DEFAULTS}
        keys = _mapping(ctx, top[p], p, null_ok=True)
        _check_keys(ctx, keys, tuple(own), p)
        for k, it in keys.items():
            out[f"{p}.{k}"] = own[k](ctx, it, f"{p}.{k}")
    return out


def parse(text: str, where: str = "config.yaml", base_dir: str | None = None
          ) -> dict[str, Any]:
    """Check the text of a defaults file.

    Args:
        text: YAML.
        where: the file's name for messages.
        base_dir: folder a relative ``file://`` storage is resolved against (default
            ``$HYPER_HOME``).
    Returns:
        dotted key → checked value (``{"aws.region": "eu-west-1", "provider": "aws"}``).
    Raises:
        RecipeError: (a UsageError, exit code 2) naming the file, line and key; an unknown
            key with "did you mean".
    """
    ctx = _Ctx(where)
    base = base_dir or str(S.home())
    return _check(ctx, _compose(ctx, text), base)


def load() -> dict[str, Any]:
    """The checked values of ``config.yaml`` ({} when there is none). Raises RecipeError as
    :func:`parse`, UsageError when the file cannot be read."""
    p = path()
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read {p}: {getattr(e, 'strerror', None) or e}",
                         "fix or remove the file") from None
    return parse(text, str(p), str(p.parent))


def _nested(values: dict[str, Any]) -> dict:
    out: dict = {}
    for key, v in values.items():
        if "." in key:
            section, k = key.split(".", 1)
            out.setdefault(section, {})[k] = v
        else:
            out[key] = v
    return out


def _known(key: str) -> None:
    if key not in known_keys():
        raise UsageError(f"unknown config key {key!r}",
                         _suggest(key, known_keys(), "keys") or None)


def _write(values: dict[str, Any]) -> None:
    """Write the file atomically (mode 0600), keys in :func:`known_keys` order."""
    order = {k: i for i, k in enumerate(known_keys())}
    ordered = dict(sorted(values.items(), key=lambda kv: order.get(kv[0], len(order))))
    text = ("# hypercli defaults: `hyper config list` shows them; precedence: flag > recipe "
            "> this file > built-in\n"
            + (yaml.safe_dump(_nested(ordered), sort_keys=False) if ordered else ""))
    p = path()
    tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, p)


def set_value(key: str, text: str) -> Any:
    """Set ``key`` to the value written as ``text`` (YAML: ``true``, ``30``, ``eu-west-1``),
    checked by the rules of :func:`parse` before the file is written.

    Returns:
        the value as stored.
    Raises:
        UsageError: an unknown key (with "did you mean"), a bad value (naming the key).
    """
    _known(key)
    try:
        value = yaml.safe_load(text) if text.strip() else text
    except yaml.YAMLError:
        value = text
    values = load()
    values[key] = value
    doc = yaml.safe_dump(_nested(values), sort_keys=False)
    try:
        checked = parse(doc, "value", str(path().parent))
    except RecipeError as e:
        raise UsageError(f"{key}: {e.reason}", e.suggestion) from None
    _write(checked)
    return checked[key]


def unset(key: str) -> bool:
    """Remove ``key`` from the file; True when it was there. Raises UsageError: unknown key."""
    _known(key)
    values = load()
    if key not in values:
        return False
    del values[key]
    _write(values)
    return True


def get(key: str) -> tuple[Any, str]:
    """(value, where it comes from: ``"config.yaml"``, ``"built-in"`` or ``"unset"``).
    Raises UsageError: unknown key."""
    _known(key)
    values = load()
    if key in values:
        return values[key], "config.yaml"
    if key in BUILT_IN:
        return BUILT_IN[key], "built-in"
    if key == "storage":
        return "file://" + str(S.home() / "storage"), "built-in"
    return None, "unset"


def listing() -> list[tuple[str, Any, str]]:
    """Every key with its value and source (:func:`get`), the file's keys first."""
    rows = [(k, *get(k)) for k in known_keys()]
    return sorted(rows, key=lambda r: r[2] != "config.yaml")


def apply(recipe: Recipe, values: dict[str, Any] | None = None) -> Recipe:
    """Fill what ``recipe`` leaves out from the defaults (precedence in the module
    docstring): the provider when its cluster names none, the provider's cluster keys it does
    not set, ``idle_minutes`` of a cloud cluster, and the storage.

    Args:
        values: checked defaults (:func:`load`, the default).
    Raises:
        RecipeError: the defaults make a cluster the recipe cannot have (provider ssh from
            the defaults, but the recipe names no hosts).
    """
    values = load() if values is None else values
    if not values:
        return recipe
    spec = recipe.cluster
    provider = spec.provider
    if not spec.provider_given and values.get("provider"):
        provider = values["provider"]
        if provider == "ssh":
            raise RecipeError("the default provider is ssh (config.yaml), but the recipe's "
                              "cluster names no hosts", path=recipe.path, field="cluster",
                              hint="give cluster: {provider: ssh, hosts: [...]}, or another "
                                   "default: `hyper config set provider local`")
    options = {k.split(".", 1)[1]: v for k, v in values.items()
               if k.startswith(provider + ".")}
    if provider in ("aws", "gcp", "azure") and "idle_minutes" in values:
        options.setdefault("idle_minutes", values["idle_minutes"])
    options.update(spec.options)  # the recipe's own values win
    cluster = dataclasses.replace(spec, provider=provider, options=options)
    storage = recipe.storage or values.get("storage")
    if cluster == spec and storage == recipe.storage:
        return recipe
    if storage != recipe.storage:  # the nodes need access to it
        from hypercli.recipe.access import storage_grants
        cluster = dataclasses.replace(cluster, grants=storage_grants(
            storage, recipe.mounts, recipe.rw_mounts))
    return dataclasses.replace(recipe, cluster=cluster, storage=storage)
