"""The estimate of ``hyper plan``: for each experiment of a recipe on a cloud, the optimizer's
choice and alternatives (hypercli.offers.optimizer), the instance-hours its tasks take and
their cost, from a ``minutes:`` hint or the durations measured in an earlier run.

node-hours = tasks × nodes × minutes / 60 / the tasks one instance holds at once (by vCPUs,
memory and GPUs, as hypercli.capacity places them); cost = node-hours × the offer's price per
node-hour. Start-up, idle time and preemptions are not counted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from hypercli.offers.catalog import CLOUDS, Catalog
from hypercli.offers.offer import Offer
from hypercli.offers.optimizer import NoOffer, Shape, choose, shape_of, where_of


def per_node(o: Offer, shape: Shape) -> int:
    """Tasks of ``shape`` one instance of ``o`` holds at once (at least 1), by vCPUs,
    memory and GPUs (hypercli.capacity's accounting)."""
    fits = [int(o.vcpus // shape.cpus) if shape.cpus else math.inf,
            int(o.memory_gib // shape.memory_gib) if shape.memory_gib else math.inf,
            o.accelerator_count // shape.accelerator_count if shape.accelerator_count
            else math.inf]
    n = min(fits)
    return 1 if n == math.inf or shape.nodes > 1 else max(1, int(n))


@dataclass(frozen=True)
class Choice:
    """The optimizer's answer for one experiment.

    Attributes:
        experiment: its name; shape: what a node needs; offers: the first few, cheapest
            first (``offers[0]`` is the choice); tasks: its task count.
        minutes: expected minutes of one task (``minutes:`` or an earlier run), or None.
        node_hours: instance-hours of the experiment (tasks × nodes × minutes / 60 / tasks
            one instance holds at once), or None without minutes.
        cost: node_hours × the choice's price, US dollars, or None.
        note: why there is no offer (an instance type named in the recipe that the
            catalog does not have there), or None.
    """

    experiment: str
    shape: Shape
    offers: tuple
    tasks: int
    minutes: float | None
    node_hours: float | None
    cost: float | None
    note: str | None = None


def plan(experiments, options: dict, provider: str, catalog: Catalog | None = None,
         minutes: dict | None = None, alternatives: int = 3) -> list[Choice]:
    """A :class:`Choice` per experiment (``hyper plan``).

    Args:
        experiments: ``ExperimentPlan``s (``name``, ``tasks``, ``resources`` dict).
        options: the cluster's options; provider: its provider name.
        catalog: default loaded for the allowed clouds.
        minutes: experiment → expected minutes of one task (``minutes:`` hints, or the mean
            of an earlier run's attempts).
        alternatives: offers shown after the choice.
    Raises:
        NoOffer: an experiment's shape has no offer (exit 2, naming the nearest); an
            instance type the recipe names is not an error (its Choice has a ``note``).
    """
    where = where_of(options, provider)
    catalog = catalog or Catalog(where["clouds"])
    out = []
    for e in experiments:
        shape = shape_of(e.resources, options)
        m = (minutes or {}).get(e.name)
        try:
            offers = choose(shape, catalog, what=f"experiment {e.name}",
                            limit=1 + alternatives, **where)
        except NoOffer as err:
            if not shape.instance_type:
                raise
            out.append(Choice(e.name, shape, (), e.tasks, m, None, None,
                              f"{shape.instance_type} is not in the catalog there "
                              f"({err.message})"))
            continue
        hours = cost = None
        if m is not None:
            hours = e.tasks * shape.nodes * m / 60 / per_node(offers[0], shape)
            cost = hours * offers[0].price
        out.append(Choice(e.name, shape, tuple(offers[:1 + alternatives]), e.tasks, m,
                          hours, cost))
    return out


def measured_minutes(state, name: str) -> dict:
    """experiment → mean minutes of the succeeded attempts of the newest workflow of recipe
    ``name`` in the state file (``{}`` when there is none)."""
    last = state.latest_workflow(name)
    if last is None:
        return {}
    exp_of = {t["id"]: t["experiment"] for t in state.tasks(last["id"])}
    spans: dict = {}
    for a in state.attempts(last["id"], status=["succeeded"]):
        if a.get("started_at") and a.get("ended_at") and a["task"] in exp_of:
            spans.setdefault(exp_of[a["task"]], []).append(a["ended_at"] - a["started_at"])
    return {e: sum(v) / len(v) / 60 for e, v in spans.items() if v}


def plan_recipe(recipe, workflow, state=None, catalog: Catalog | None = None) -> dict:
    """What ``hyper plan`` shows of machines for a recipe on a cloud (or with
    ``cluster.clouds``): ``{"choices": [Choice], "minutes_from": {experiment: "hint" |
    "earlier run"}, "stale": [cloud], "catalog": Catalog}`` (the catalog tells where each
    offer's price comes from), or ``{}`` for the local and ssh providers.

    Args:
        recipe: the validated Recipe; workflow: its plan (``build_plan``).
        state: the state file, for the durations of an earlier run of the recipe.
    Raises:
        NoOffer: an experiment's shape has no offer (exit 2).
    """
    o, provider = recipe.cluster.options, recipe.cluster.provider
    if provider not in CLOUDS and not o.get("clouds"):
        return {}
    measured = measured_minutes(state, workflow.name) if state is not None else {}
    minutes, source = {}, {}
    for name, e in recipe.experiments.items():
        if e.minutes is not None:
            minutes[name], source[name] = e.minutes, "hint"
        elif name in measured:
            minutes[name], source[name] = measured[name], "earlier run"
    catalog = catalog or Catalog(where_of(o, provider)["clouds"])
    return {"choices": plan(workflow.experiments, o, provider, catalog, minutes),
            "minutes_from": source, "stale": catalog.stale(), "catalog": catalog}
