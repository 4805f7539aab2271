"""Capacity, claims and placement (pure), and the recipe keys that ask for resources."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hypercli.capacity import (BASE_PORT, free_of, gpus_of, never_fits, place, place_gang,
                               shortfall)
from hypercli.errors import RecipeError
from hypercli.recipe import Resources, parse_recipe
from hypercli.recipe.resources import parse_size


def node(name, cpus=8, gpus=0, memory=32 * 2**30, slots=None, gpu="NVIDIA A100"):
    return {"name": name, "slots": slots or cpus,
            "info": {"cpus": cpus, "memory_bytes": memory,
                     "gpus": [{"index": i, "name": gpu, "memory_mib": 40960}
                              for i in range(gpus)]}}


def need(**kw):
    return Resources(**kw).as_dict()


def test_each_gpu_task_gets_its_own_devices_until_none_is_left():
    free = {"a": free_of(node("a", gpus=2), []), "b": free_of(node("b", gpus=4), [])}
    got = []
    while (n := place(need(gpus=1), free)) is not None:
        got.append((n, free[n].take(need(gpus=1))["gpus"]))
    assert len(got) == 6
    assert sorted(got) == [("a", [0]), ("a", [1]), ("b", [0]), ("b", [1]), ("b", [2]),
                           ("b", [3])]
    assert shortfall(need(gpus=1), free) == "waiting for 1 GPU"


def test_claims_of_live_attempts_are_leases():
    claims = [{"cpus": 1, "memory": 0, "gpus": [0]}, {"cpus": 1, "memory": 0, "gpus": [2]}]
    f = free_of(node("a", gpus=4), claims)
    assert sorted(f.gpus) == [1, 3] and f.slots == 6 and f.cpus == 6
    assert f.take(need(gpus=2))["gpus"] == [1, 3]
    assert not f.fits(need(gpus=1))
    old = free_of(node("b", cpus=2, slots=2), [None, None])  # claims from before migration 3
    assert not old.fits(need())


def test_best_fit_for_gpus_spread_for_cpu_tasks():
    free = {"big": free_of(node("big", gpus=4), []),
            "half": free_of(node("half", gpus=4), [{"cpus": 1, "gpus": [0, 1]}])}
    assert place(need(gpus=2), free) == "half"  # keeps the whole node free
    assert place(need(), free) == "big"  # more free slots


def test_gpu_type_memory_and_cpu_limits():
    free = {"k": free_of(node("k", gpus=2, gpu="Tesla K80"), []),
            "a": free_of(node("a", gpus=1, memory=8 * 10**9), [])}
    assert place(need(gpus=1, gpu_type="a100"), free) == "a"
    assert place(need(gpus=2, gpu_type="K80"), free) == "k"
    assert place(need(gpus=1, memory=16 * 10**9, gpu_type="A100"), free) is None
    assert place(need(cpus=9), free) is None
    assert place(need(cpus=0.5), free) is not None


def test_gang_on_distinct_nodes_all_or_nothing_and_its_port():
    free = {n: free_of(node(n, gpus=1), []) for n in ("x", "y", "z")}
    assert place_gang(need(gpus=1, nodes=4), free) is None
    nodes = place_gang(need(gpus=1, nodes=3), free)
    assert sorted(nodes) == ["x", "y", "z"]
    f = free_of(node("x"), [{"cpus": 1, "port": BASE_PORT}, {"cpus": 1, "port": BASE_PORT + 1}])
    assert f.take(need(), port=True)["port"] == BASE_PORT + 2


def test_engine_claims_consecutive_ports_that_later_claims_skip():
    f = free_of(node("x", cpus=8), [{"cpus": 1, "port": BASE_PORT + 1}])
    c = f.take(need(), port=2)  # BASE_PORT is free, BASE_PORT + 1 is not: both must be
    assert (c["port"], c["ports"]) == (BASE_PORT + 2, 2)
    assert f.take(need(), port=True)["port"] == BASE_PORT  # the single one left below
    g = free_of(node("x", cpus=8), [c])  # as rebuilt from the state file's claims
    assert g.take(need(), port=True)["port"] == BASE_PORT
    assert g.take(need(), port=True)["port"] == BASE_PORT + 1
    assert g.take(need(), port=True)["port"] == BASE_PORT + 4


def test_never_fits_names_the_largest_node():
    free = {"s": free_of(node("s", cpus=2), []), "l": free_of(node("l", cpus=4, gpus=2), [])}
    assert never_fits(need(gpus=2), free) is None
    why = never_fits(need(gpus=4), free)
    assert "4 GPUs" in why and "l (4 CPUs, 32.0 GiB, 2 GPUs)" in why
    assert "3 ranks" in never_fits(need(gpus=1, nodes=3), free)
    assert never_fits(need(cpus=16), free) is not None


def test_gpu_facts_from_older_bootstraps():
    assert gpus_of({"gpus": ["Tesla T4, 15360 MiB", "Tesla T4, 15360 MiB"]}) == {
        0: {"name": "Tesla T4", "memory_mib": None}, 1: {"name": "Tesla T4", "memory_mib": None}}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 4), min_size=1, max_size=5),
       st.lists(st.integers(0, 3), min_size=1, max_size=30))
def test_placement_never_exceeds_a_node_and_never_shares_a_gpu(node_gpus, asks):
    free = {f"n{i}": free_of(node(f"n{i}", cpus=4, gpus=g), []) for i, g in enumerate(node_gpus)}
    held: dict = {n: [] for n in free}
    for g in asks:
        n = place(need(gpus=g), free)
        if n is None:
            continue
        held[n].append(free[n].take(need(gpus=g)))
    for i, g in enumerate(node_gpus):
        claims = held[f"n{i}"]
        devices = [d for c in claims for d in c["gpus"]]
        assert len(devices) == len(set(devices)) and set(devices) <= set(range(g))
        assert len(claims) <= 4


@pytest.mark.parametrize("text,size", [("16GB", 16 * 10**9), ("512 MiB", 512 * 2**20),
                                       ("1.5Ti", int(1.5 * 2**40)), ("100", 100),
                                       ("2g", 2 * 10**9), ("x", None), ("5i", None)])
def test_sizes(text, size):
    assert parse_size(text) == size


def test_recipe_resources_hardware_and_nodes():
    r = parse_recipe("""
name: t
experiments:
  a: {command: x, resources: {gpus: 2, memory: 16, cpus: 0.5}, nodes: 3}
  b: {command: x, hardware: {gpu: K80, gpu_count: 2}}
  c: {command: x}
""")
    assert r.experiments["a"].resources == Resources(cpus=0.5, memory=16 * 10**9, gpus=2,
                                                     nodes=3)
    assert r.experiments["b"].resources == Resources(gpus=2, gpu_type="K80")
    assert r.experiments["c"].resources == Resources()


@pytest.mark.parametrize("exp,message", [
    ("{command: x, resources: {gpu: 1}}", "did you mean 'gpus'"),
    ("{command: x, resources: {memory: lots}}", "memory must be a size"),
    ("{command: x, resources: {cpus: 0}}", "cpus must be above 0"),
    ("{command: x, nodes: 0}", "nodes must be at least 1"),
    ("{command: x, hardware: {gpu_count: 1}, resources: {}}", "not both"),
    ("{command: x, resources: {gpu_type: A100}}", "no GPU is asked for"),
])
def test_recipe_resource_errors(exp, message):
    with pytest.raises(RecipeError) as e:
        parse_recipe("name: t\nexperiments:\n  a: " + exp)
    assert message in str(e.value) and "line 3" in str(e.value)
