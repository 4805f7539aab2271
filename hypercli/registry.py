"""Credentials of private container registries: an experiment's ``registry_auth``.

``registry_auth: {username: NAME, password: ${VAR}}`` beside an experiment's ``image:``.
Each value is the text written, or ``${VAR}``: the variable VAR of the environment of the
``hyper run`` that submits the workflow (missing: exit 2 naming it). The values reach the node
on the SSH channel's stdin only (:mod:`hypercli.node.registry`), and the state file never
holds a password:

* what the state file keeps (the workflow's ``spec``) is :func:`stored`: the username as
  written, and of the password only its ``${VAR}`` reference, or a mark that it is written in
  the recipe file;
* the process that submits the workflow resolves them once (:func:`check`) and keeps them in
  memory (:func:`remember`); a process that drives the workflow later (a resumed ``hyper
  run``, the background driver) resolves them again from its own environment, or from the
  recipe file when it is written there and the file still plans the same workflow
  (:func:`for_workflow`).

This is the rule the issue's secrets (issue 27, item 1) follow: references are kept, values
are asked for again. Without ``registry_auth``, a node signs in to Amazon ECR, Google Artifact
Registry or Azure Container Registry with its own cloud identity.
"""

from __future__ import annotations

import os
import re
import threading

from hypercli.errors import UsageError

REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")
_CACHE: dict[str, dict[str, tuple[str, str]]] = {}
_LOCK = threading.Lock()


def reference(text: str) -> str | None:
    """The variable name of a ``${VAR}`` value, else None (a literal)."""
    m = REF.fullmatch(text)
    return m[1] if m else None


def _value(text: str, where: str, env) -> str:
    var = reference(text)
    if var is None:
        return text
    if env.get(var) is None:
        raise UsageError(f"{where} is ${{{var}}}, but {var} is not set in the environment",
                         f"export {var}=... before `hyper run`")
    return env[var]


def stored(auths: dict[str, dict], recipe_digest: str) -> dict[str, dict]:
    """What the state file keeps of experiment → registry_auth: the username as written and
    the password's ``${VAR}`` reference, or for a literal one ``"in_recipe": true`` and the
    digest of the recipe text that holds it."""
    out = {}
    for exp, a in auths.items():
        pw = a["password"]
        out[exp] = {"username": a["username"], "password": pw if reference(pw) else None,
                    "in_recipe": not reference(pw)}
        if not reference(pw):
            out[exp]["recipe_digest"] = recipe_digest
    return out


def check(auths: dict[str, dict], env=None) -> dict[str, tuple[str, str]]:
    """Resolve experiment → registry_auth (from the recipe) now: experiment → (username,
    password). Raises UsageError: a ``${VAR}`` whose variable is not set."""
    env = os.environ if env is None else env
    return {exp: (_value(a["username"], f"experiments.{exp}.registry_auth.username", env),
                  _value(a["password"], f"experiments.{exp}.registry_auth.password", env))
            for exp, a in auths.items()}


def of_recipe(recipe) -> dict[str, dict]:
    """experiment → registry_auth of a Recipe's experiments that have one."""
    return {n: e.registry_auth for n, e in recipe.experiments.items()
            if getattr(e, "registry_auth", None)}


def remember(wid: str, creds: dict[str, tuple[str, str]]) -> None:
    """Keep a workflow's resolved credentials in this process's memory."""
    with _LOCK:
        _CACHE[wid] = dict(creds)


def for_workflow(wf: dict, experiment: str) -> tuple[str, str] | None:
    """The credentials of a workflow's experiment (``wf``: its ``workflows`` row), or None
    when it has no registry_auth: from this process's memory, else resolved again (module
    docstring).

    Raises:
        UsageError: a ``${VAR}`` not set in this process's environment; a literal password
            whose recipe file is gone or no longer plans this workflow.
    """
    with _LOCK:
        hit = _CACHE.get(wf["id"], {}).get(experiment)
    if hit is not None:
        return hit
    kept = ((wf.get("spec") or {}).get("registry_auth") or {}).get(experiment)
    if not kept:
        return None
    if kept.get("in_recipe"):
        from hypercli.errors import HyperError
        from hypercli.recipe import load_recipe
        try:
            recipe = load_recipe(wf["recipe_path"] or "")
        except HyperError as e:
            raise UsageError(f"the registry password of {experiment} is written in the recipe "
                             f"{wf['recipe_path']}, which cannot be read now: {e}") from None
        if recipe.digest != kept.get("recipe_digest") or experiment not in of_recipe(recipe):
            raise UsageError(f"the registry password of {experiment} is written in the recipe "
                             f"{wf['recipe_path']}, which has changed since {wf['id']} began",
                             "write it as ${VAR} and export VAR")
        creds = check({experiment: of_recipe(recipe)[experiment]})[experiment]
    else:
        creds = check({experiment: {"username": kept["username"],
                                    "password": kept["password"]}})[experiment]
    with _LOCK:
        _CACHE.setdefault(wf["id"], {})[experiment] = creds
    return creds
