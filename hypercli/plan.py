"""Recipe → Workflow: the experiments DAG and its tasks with rendered commands.

Pure: no I/O, no clock. The same recipe always gives the same workflow (same task ids, same
parameter draws, same commands), which is what lets ``hyper plan`` preview a run and lets a
killed ``hyper run`` resume the workflow it started.

Task ids are ``<experiment>-<index>`` with the index zero-padded to at least 4 digits
(``search-0007``). Each experiment draws its parameters with its own seed, derived from the
recipe's ``seed`` and the experiment's name, so adding an experiment changes no other draws.
"""

from __future__ import annotations

import hashlib
import json
import dataclasses
from dataclasses import dataclass, field

from hypercli import params as P
from hypercli.errors import RecipeError
from hypercli.recipe import ExperimentSpec, Recipe, Resources
from hypercli.recipe.environment import REFERENCE


@dataclass(frozen=True)
class TaskPlan:
    """One task: an experiment's command with one parameter set.

    Attributes:
        id: ``search-0007``; unique within the workflow.
        experiment: experiment name.
        index: 0-based position within the experiment.
        params: name → value (str, int, float, bool).
        command: shell text with every ``{{placeholder}}`` replaced by a shell-quoted value.
        env: extra environment variables, placeholders replaced verbatim (not quoted),
            ``${VAR}`` references replaced by their values; never a secret.
    """

    id: str
    experiment: str
    index: int
    params: dict
    command: str
    env: dict


@dataclass(frozen=True)
class ExperimentPlan:
    """One experiment of a workflow: its DAG edges and run settings.

    Attributes:
        name, after, retries, image, workers: as in the recipe (workers = concurrency cap or None).
        tasks: number of tasks the experiment has.
        resources: what each task (each rank) needs of a node, ``Resources.as_dict()``.
        checkpoint_every: seconds between saves of ``HYPER_CHECKPOINT`` while a task runs.
        engine: ``"spark"`` or ``"ray"`` started across each task's nodes, or None.
        secrets: names of the variables its tasks get from the submitting environment,
            never recorded (:mod:`hypercli.envvars`).
    """

    name: str
    after: tuple
    retries: int
    image: str | None
    workers: int | None
    tasks: int
    resources: dict
    checkpoint_every: float = 60.0
    engine: str | None = None
    secrets: tuple = ()


@dataclass(frozen=True)
class Workflow:
    """The plan of a recipe.

    Attributes:
        name: recipe name.
        experiments: ExperimentPlan tuple in topological order of ``after``.
        tasks: every TaskPlan, experiments in that order.
        digest: SHA-256 hex over everything that decides what runs (settings, commands, env,
            the files of shard parameters); two recipes with the same digest run the same tasks.
        shards: experiment → :class:`~hypercli.shards.ShardPlan` of its shard parameter.
    """

    name: str
    experiments: tuple
    tasks: tuple
    digest: str
    shards: dict = field(default_factory=dict)


#: ``json.dumps(x, sort_keys=True)`` without a new encoder per call (same text)
_DIGEST_JSON = json.JSONEncoder(sort_keys=True)


def experiment_seed(seed: int, experiment: str) -> int:
    """The seed of one experiment's draws: 64 bits of SHA-256 over ``"<seed>:<name>"``."""
    h = hashlib.sha256(f"{seed}:{experiment}".encode()).digest()
    return int.from_bytes(h[:8], "big")


def _env_value(text: str, values: dict, lookups: dict) -> str:
    """An env value with its placeholders rendered and each ``${VAR}`` replaced by
    ``lookups[VAR]`` (``$${`` by ``${``). A variable's value is data: placeholders in it are
    not rendered."""
    if "${" not in text:
        return P.render(text, values, quote=False)
    out, pos = [], 0
    for m in REFERENCE.finditer(text):
        out.append(P.render(text[pos:m.start()], values, quote=False))
        if m[1] is not None and m[1] not in lookups:  # hypercli.envvars.lookups checks first
            raise RecipeError(f"${{{m[1]}}} has no value: {m[1]} is not set")
        out.append("${" if m[1] is None else lookups[m[1]])
        pos = m.end()
    out.append(P.render(text[pos:], values, quote=False))
    return "".join(out)


def _tasks_of(exp: ExperimentSpec, seed: int, lookups: dict, extra: dict) -> list[TaskPlan]:
    try:
        draws = P.sample(exp.parameters, sampling=exp.sampling, samples=exp.samples,
                         seed=experiment_seed(seed, exp.name))
    except ValueError as e:  # recipe.py checks this first; kept as a guard
        raise RecipeError(str(e), field=f"experiments.{exp.name}", line=exp.line) from None
    width = max(4, len(str(len(draws) - 1)))
    out = []
    for i, values in enumerate(draws):
        try:
            command = P.render(exp.command, values)
            env = {k: _env_value(v, values, lookups) for k, v in exp.env.items()}
            env.update(extra)
        except KeyError as e:
            raise RecipeError(f"placeholder {{{{{e.args[0]}}}}} names no parameter",
                              field=f"experiments.{exp.name}", line=exp.line) from None
        out.append(TaskPlan(f"{exp.name}-{i:0{width}d}", exp.name, i, values, command, env))
    return out


def build_plan(recipe: Recipe, shards: dict | None = None, lookups: dict | None = None,
               extra: dict | None = None) -> Workflow:
    """Expand a validated recipe into its workflow.

    Args:
        recipe: from ``hypercli.recipe.load_recipe`` (with shard parameters resolved by
            ``hypercli.shards.resolve`` when it has any).
        shards: experiment → ShardPlan, from that same call.
        lookups: VAR → value of every ``${VAR}`` the recipe's ``env:`` refers to
            (:func:`hypercli.envvars.lookups`).
        extra: variables every task gets over its ``env:`` (``--env``/``--env-file``,
            :func:`hypercli.envvars.recorded`: no secret).
    Returns:
        the Workflow (experiments in ``recipe.order``).
    Raises:
        RecipeError: a parameter rule the recipe check let through (should not happen).
    """
    experiments, tasks = [], []
    h = hashlib.sha256()
    for name in recipe.order:
        exp = recipe.experiments[name]
        exp_tasks = _tasks_of(exp, recipe.seed, lookups or {}, extra or {})
        res = exp.resources.as_dict()
        experiments.append(ExperimentPlan(name, tuple(exp.after), exp.retries, exp.image,
                                          exp.workers, len(exp_tasks), res,
                                          exp.checkpoint_every, exp.engine,
                                          tuple(exp.secrets)))
        settings = [name, list(exp.after), exp.retries, exp.image, exp.workers]
        if exp.resources != Resources():  # default resources keep older workflows' digests
            settings.append(res)
        if exp.engine:
            settings.append({"engine": exp.engine})
        if exp.secrets:  # names only: the values are never part of a plan
            settings.append({"secrets": list(exp.secrets)})
        if exp.timeout:  # kept in the workflow's record: a new value is a new workflow
            settings.append({"timeout": exp.timeout})
        if exp.checkpoint_ranks != "each":
            settings.append({"checkpoint_ranks": exp.checkpoint_ranks})
        h.update(json.dumps(settings, sort_keys=True).encode())
        plan = (shards or {}).get(name)
        if plan is not None:
            h.update(plan.digest.encode())
            exp_tasks = [dataclasses.replace(t, env={
                **t.env, "HYPER_SHARD": str(t.params[plan.param]),
                "HYPER_SHARDS": str(plan.count)}) for t in exp_tasks]
        encode = _DIGEST_JSON.encode
        for t in exp_tasks:
            h.update(encode([t.id, t.command, t.env]).encode())
        tasks.extend(exp_tasks)
    return Workflow(recipe.name, tuple(experiments), tuple(tasks), h.hexdigest(),
                    dict(shards or {}))
