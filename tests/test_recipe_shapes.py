"""Recipes that say what the work needs (issue 23, items 2 and 6): ``resources:`` with
``accelerators``, ``N+``, ``disk_gb``, ``spot``, ``instance_type``; Hyper's ``hardware:`` and
``commands:``; the cluster's ``clouds``, ``regions``, ``zones``; each refused input named with
its line and a did-you-mean."""

from __future__ import annotations

import textwrap

import pytest

from hypercli.errors import RecipeError
from hypercli.plan import build_plan
from hypercli.recipe import parse_recipe
from hypercli.recipe.resources import normalise_gpu


def recipe(exp: str, cluster: str = "provider: aws\n  instance_type: m5.large") -> str:
    return textwrap.dedent("""\
        name: r
        cluster:
          {cluster}
        experiments:
          train:
        {exp}
        """).format(cluster=cluster, exp=textwrap.indent(textwrap.dedent(exp), "    "))


def resources_of(exp: str):
    return parse_recipe(recipe(exp)).experiments["train"].resources


def test_accelerators_cpus_memory_at_least():
    r = resources_of("""\
        command: python train.py
        resources: {accelerators: "v100:4", cpus: "8+", memory: "32+", disk_gb: 200,
                    spot: auto, instance_type: p3.8xlarge}
        """)
    assert (r.gpu_type, r.gpus, r.cpus, r.memory) == ("V100", 4, 8, 32 * 10**9)
    assert (r.disk_gb, r.spot, r.instance_type) == (200, "auto", "p3.8xlarge")
    assert r.as_dict()["spot"] == "auto" and r.arch is None
    assert resources_of("command: x\nresources: {arch: arm64}\n").as_dict()["arch"] == "arm64"


def test_plain_numbers_stay_as_today():
    r = resources_of("command: x\nresources: {cpus: 2, memory: 16GB}\n")
    assert (r.cpus, r.memory, r.gpus) == (2, 16 * 10**9, 0)
    # a recipe without the new keys plans as before: no new keys in the plan's resources
    assert set(r.as_dict()) == {"cpus", "memory", "gpus", "gpu_type", "nodes"}


def test_hardware_is_the_same_as_accelerators():
    a = resources_of("command: x\nhardware: {gpu: V100, gpu_count: 4}\n")
    b = resources_of('command: x\nresources: {accelerators: "V100:4"}\n')
    assert (a.gpu_type, a.gpus) == (b.gpu_type, b.gpus) == ("V100", 4)


def test_accelerators_mapping_form_and_bare_name():
    assert resources_of("command: x\nresources: {accelerators: {A100-80GB: 8}}\n").gpus == 8
    r = resources_of("command: x\nresources: {accelerators: T4}\n")
    assert (r.gpu_type, r.gpus) == ("T4", 1)


@pytest.mark.parametrize("res, words, line", [
    ('{accelerators: "V10O:4"}', ["unknown GPU 'V10O'", "did you mean 'V100'?"], 8),
    ('{accelerators: "V100:0"}', ["0 GPUs"], 8),
    ('{accelerators: "V100:x"}', ["not NAME:COUNT"], 8),
    ('{accelerators: "V100:4", gpus: 2}', ["accelerators or gpus"], 8),
    ("{cpus: 8++}", ["cpus must be a number or N+"], 8),
    ("{memory: lots+}", ["memory must be a size"], 8),
    ("{spot: sometimes}", ["spot must be true, false or auto", "'sometimes'"], 8),
    ("{disk_gb: 5}", ["disk_gb must be at least 10"], 8),
    ("{acelerators: V100}", ["unknown key 'acelerators'", "did you mean 'accelerators'?"], 8),
    ("{arch: arm}", ["arch must be x86_64 or arm64, not 'arm'", "did you mean 'arm64'?"], 8),
])
def test_bad_resources_name_the_line(res, words, line):
    with pytest.raises(RecipeError) as e:
        parse_recipe(recipe(f"command: x\nresources: {res}\n"), path="r.yaml")
    for w in words:
        assert w in str(e.value)
    assert e.value.line == line


def test_cluster_clouds_regions_zones():
    r = parse_recipe(recipe("command: x\n",
                            "provider: gcp\n  clouds: [aws, gcp]\n  regions: [us-central1]\n"
                            "  zones: [us-central1-a]\n  max_price: 2.5"))
    o = r.cluster.options
    assert (o["clouds"], o["regions"], o["zones"], o["max_price"]) == (
        ["aws", "gcp"], ["us-central1"], ["us-central1-a"], 2.5)


def test_unknown_cloud_is_refused_with_did_you_mean():
    with pytest.raises(RecipeError) as e:
        parse_recipe(recipe("command: x\n", "provider: aws\n  clouds: [aws, gpc]"))
    assert "unknown cloud 'gpc'" in str(e.value) and "did you mean 'gcp'?" in str(e.value)
    assert e.value.line == 4
    with pytest.raises(RecipeError, match="'clouds' applies to providers aws, gcp, azure"):
        parse_recipe(recipe("command: x\n", "provider: local\n  clouds: [aws]"))


def test_commands_is_a_list_command():
    a = parse_recipe(recipe("commands: [echo a, echo b]\n")).experiments["train"]
    b = parse_recipe(recipe("command: [echo a, echo b]\n")).experiments["train"]
    assert a.command == b.command == "echo a\necho b"
    r = parse_recipe(recipe("commands: [echo a, echo b]\n"))
    assert build_plan(r).digest == build_plan(parse_recipe(recipe(
        "command: [echo a, echo b]\n"))).digest


@pytest.mark.parametrize("exp, words", [
    ("commands: [a]\ncommand: b\n", "give command or commands, not both"),
    ("commands: echo a\n", "commands must be a list of lines"),
    ('commands: ["echo {{x}}"]\n', "commands: placeholder {{x}} names no parameter"),
    ("command: x\nminutes: 0\n", "minutes must be a number of minutes above 0"),
])
def test_bad_commands(exp, words):
    with pytest.raises(RecipeError, match=None) as e:
        parse_recipe(recipe(exp))
    assert words in str(e.value)


def test_minutes_hint():
    assert parse_recipe(recipe("command: x\nminutes: 7.5\n")).experiments["train"].minutes == 7.5


@pytest.mark.parametrize("name, mib, want", [
    ("nvidia-tesla-v100", None, "V100"), ("nvidia-a100-80gb", None, "A100-80GB"),
    ("A100", 81920, "A100-80GB"), ("A100", 40960, "A100"), ("V100", 32768, "V100-32GB"),
    ("nvidia-l4", None, "L4"), ("nvidia-h100-80gb", None, "H100"),
    ("nvidia-h100-mega-80gb", None, "H100-MEGA"), ("nvidia-tesla-t4", None, "T4"),
    ("NVIDIA RTX 4090", None, "RTX 4090"), ("A10G", 24576, "A10G"),
])
def test_gpu_names_normalised(name, mib, want):
    assert normalise_gpu(name, mib) == want


def test_commands_run_in_order_and_stop_at_the_first_failure(hyper_home, write_recipe,
                                                             tmp_path):
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    log = tmp_path / "log"
    path = write_recipe(f"""
        name: steps
        experiments:
          steps:
            commands:
              - echo one >> {log}
              - echo two >> {log}; false
              - echo three >> {log}
    """)
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path))
    try:
        summary = Scheduler(state, wid, provider, nodes).run()
    finally:
        lock.release()
    assert summary.exit_code == 1
    assert log.read_text().split() == ["one", "two"]
    [task] = state.tasks(wid)
    assert task["status"] == "failed"
