"""Tests of hypercli.recipe: a full round trip, one test per kind of error, and fuzzing that
allows only two outcomes, a Recipe or a RecipeError."""

from __future__ import annotations

import copy
import importlib.util
import os
import re
import tempfile
import textwrap

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hypercli import params
from hypercli.errors import RecipeError
from hypercli.params import Continuous, Discrete
from hypercli.recipe import PROVIDERS, Recipe, load_recipe, parse_recipe

FULL = """\
version: 1
seed: 7
cluster:
  provider: aws
  name: digits-cluster
  workers: 3
  region: us-east-1
  zone: [us-east-1a, us-east-1b]
  instance_type: g4dn.xlarge
  spot: true
  image: ami-123
  disk_gb: 50
  max_price: 0.5
  idle_minutes: 15
  replace_preempted: true
  ssh_cidr: 203.0.113.0/24
storage: file://.hyper/storage
workdir: work
mounts:
  /data: chunks+s3://bucket/datasets/coco
  /scratch/: file://scratch
experiments:
  prepare:
    command:
      - mkdir -p out
      - echo ready
  search:
    image: python:3.11-slim
    after: prepare
    parameters:
      max_depth: [3, 6, 9]
      learning_rate: "0.01-0.3"
      n_estimators: {min: 50, max: 400, log: true}
      width: "2-10"
      decay: {min: 1, max: 5, type: float}
      mode: fast
    sampling: random
    samples: 32
    command: python train.py --depth {{max_depth}} --lr {{learning_rate}} --n {{ n_estimators }}
    retries: 2
    workers: 4
    env:
      CUDA_VERSION: 1.10
      DEBUG: yes
      LR: "{{learning_rate}}"
      COUNT: 3
  report:
    after: [search, prepare]
    command: python report.py
"""


def line_of(text: str, needle: str) -> int:
    """1-based line of the first line containing needle."""
    return next(i for i, ln in enumerate(text.splitlines(), 1) if needle in ln)


def fail(text: str, **kw) -> RecipeError:
    with pytest.raises(RecipeError) as info:
        parse_recipe(textwrap.dedent(text), **kw)
    return info.value


def with_experiment(body: str, extra: str = "") -> str:
    """A text recipe with one experiment `search` whose keys are `body` (indented 4)."""
    return ("name: t\n" + extra + "experiments:\n  search:\n"
            + textwrap.indent(textwrap.dedent(body), "    "))


# --- the valid round trip --------------------------------------------------------------------

def test_full_recipe_from_file(tmp_path):
    path = tmp_path / "search.yaml"
    path.write_text(FULL)
    r = load_recipe(path)
    assert r.path == str(path) and r.name == "search"  # default name: the file stem
    assert (r.version, r.seed) == (1, 7)
    assert r.storage == f"file://{tmp_path}/.hyper/storage"
    assert r.workdir == str(tmp_path / "work")
    assert r.mounts == {"/data": "chunks+s3://bucket/datasets/coco",
                        "/scratch": f"file://{tmp_path}/scratch"}
    c = r.cluster
    assert (c.name, c.provider, c.workers) == ("digits-cluster", "aws", 3)
    assert c.options == {"region": "us-east-1", "zone": ["us-east-1a", "us-east-1b"],
                         "instance_type": "g4dn.xlarge", "spot": True, "image": "ami-123",
                         "disk_gb": 50, "max_price": 0.5, "idle_minutes": 15,
                         "replace_preempted": True, "ssh_cidr": "203.0.113.0/24"}
    assert list(r.experiments) == ["prepare", "search", "report"]
    assert r.order == ("prepare", "search", "report")
    import hashlib
    assert r.digest == hashlib.sha256(FULL.encode()).hexdigest()


def test_full_recipe_experiments():
    r = parse_recipe(FULL.replace("version: 1\n", "version: 1\nname: digits\n"), base_dir="/b")
    assert r.name == "digits" and r.path is None and r.workdir == "/b/work"
    prep, search, report = (r.experiments[n] for n in ("prepare", "search", "report"))
    assert prep.command == "mkdir -p out\necho ready"
    assert (prep.sampling, prep.samples, prep.retries, prep.image, prep.after) == \
        ("grid", None, 0, None, ())
    assert search.parameters == {
        "max_depth": Discrete((3, 6, 9)),
        "learning_rate": Continuous(0.01, 0.3, log=False, integer=False),
        "n_estimators": Continuous(50, 400, log=True, integer=True),
        "width": Continuous(2, 10, log=False, integer=True),
        "decay": Continuous(1.0, 5.0, log=False, integer=False),
        "mode": Discrete(("fast",)),
    }
    assert list(search.parameters) == ["max_depth", "learning_rate", "n_estimators", "width",
                                       "decay", "mode"]
    assert (search.sampling, search.samples, search.retries, search.workers) == \
        ("random", 32, 2, 4)
    assert search.image == "python:3.11-slim" and search.after == ("prepare",)
    # numbers keep the text as written (1.10, not 1.1); booleans become true/false
    assert search.env == {"CUDA_VERSION": "1.10", "DEBUG": "true", "LR": "{{learning_rate}}",
                          "COUNT": "3"}
    assert report.after == ("search", "prepare")
    text = FULL
    assert prep.line == line_of(text, "  prepare:") + 1  # one line added above
    assert search.line == line_of(text, "  search:") + 1
    assert report.line == line_of(text, "  report:") + 1


def test_text_form_defaults(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = parse_recipe("name: n\nexperiments:\n  a:\n    command: echo hi\n")
    assert r.workdir == str(tmp_path) and r.storage is None and r.mounts == {}
    assert (r.cluster.name, r.cluster.provider, r.cluster.workers, r.cluster.options) == \
        ("n", "local", None, {})
    assert r.seed == 0 and r.order == ("a",)
    assert r.experiments["a"].line == 3


def test_absolute_paths_kept_and_path_gives_name():
    r = parse_recipe("storage: file:///srv/st\nworkdir: /srv/w\nexperiments: {a: {command: x}}",
                     path="recipes/my-run.yml", base_dir="/elsewhere")
    assert (r.name, r.storage, r.workdir) == ("my-run", "file:///srv/st", "/srv/w")
    assert r.path == "recipes/my-run.yml"


def test_order_is_topological_and_stable():
    r = parse_recipe("name: n\nexperiments:\n  b: {command: x, after: c}\n"
                     "  a: {command: x}\n  c: {command: x}\n  d: {command: x, after: [b, a]}\n")
    assert r.order == ("a", "c", "b", "d")


def test_merge_keys_and_ssh_cluster():
    r = parse_recipe(textwrap.dedent("""\
        name: n
        cluster: {provider: ssh, hosts: [root@10.0.0.5:22, node2, "[::1]:2222"], port: 22}
        experiments:
          base: &base {command: "echo {{x}}", parameters: {x: [1, 2]}, retries: 3}
          other:
            <<: *base
            retries: 1
        """))
    other = r.experiments["other"]
    assert other.command == "echo {{x}}" and other.retries == 1
    assert other.parameters == {"x": Discrete((1, 2))}
    assert r.cluster.options == {"hosts": ["root@10.0.0.5:22", "node2", "[::1]:2222"],
                                 "port": 22}


def test_scalar_parameter_forms():
    r = parse_recipe(with_experiment("""\
        command: x
        samples: 3
        parameters:
          {a: "1e-4-1e-1", b: "-1-1", c: 5, d: true, e: "1-2-3", f: {min: 1, max: 9, type: int}}
        """))
    p = r.experiments["search"].parameters
    assert p["a"] == Continuous(1e-4, 1e-1, log=False, integer=False)
    assert p["b"] == Continuous(-1, 1, log=False, integer=True)
    assert p["c"] == Discrete((5,)) and p["d"] == Discrete((True,))
    assert p["e"] == Discrete(("1-2-3",))
    assert p["f"] == Continuous(1, 9, log=False, integer=True)


def test_exponent_numbers_are_floats():
    r = parse_recipe(with_experiment("""\
        command: x
        samples: 3
        parameters: {a: [1e-3, "1e-4"], b: {min: 1e-5, max: 1E-1, log: true}}
        """))
    p = r.experiments["search"].parameters
    assert p["a"] == Discrete((0.001, "1e-4"))  # quoted stays a string
    assert p["b"] == Continuous(1e-5, 0.1, log=True, integer=False)


def test_recursive_alias_outside_known_structure_is_harmless():
    e = fail("name: n\nx: &a [*a]\nexperiments: {a: {command: x}}\n")
    assert e.field == "x" and "unknown key 'x'" in str(e)


def test_recursive_alias_in_parameters():
    e = fail(with_experiment("command: x\nparameters: &p {a: *p}\n"))
    assert e.field == "experiments.search.parameters.a.a" and "unknown key" in str(e)


def test_alias_bomb_refused():
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, 9)]
    e = fail("\n".join(lines) + "\nexperiments: {a: {command: x}}\n")
    assert "aliases expand" in str(e)


# --- one test per kind of error --------------------------------------------------------------

def test_unknown_key_did_you_mean():
    text = with_experiment("command: x\nsamles: 3\n")
    e = fail(text)
    assert e.field == "experiments.search.samles" and e.line == line_of(text, "samles")
    assert "unknown key 'samles'" in str(e) and "did you mean 'samples'?" in str(e)


def test_engine_key():
    r = parse_recipe(with_experiment("command: x\nengine: ray\nnodes: 3\n"))
    assert r.experiments["search"].engine == "ray"
    assert parse_recipe(with_experiment("command: x\n")).experiments["search"].engine is None
    text = with_experiment("command: x\nengine: sprak\n")
    e = fail(text)
    assert "engine must be spark or ray, not 'sprak'" in str(e) and "did you mean 'spark'?" in str(e)
    assert e.field == "experiments.search.engine" and e.line == line_of(text, "sprak")
    assert "a string" in str(fail(with_experiment("command: x\nengine: [spark]\n")))


def test_unknown_key_lists_valid_keys():
    e = fail("name: n\nzzzzqq: 1\nexperiments: {a: {command: x}}\n")
    assert e.line == 2 and "valid keys: version, name, seed" in str(e)


def test_unknown_range_key():
    e = fail(with_experiment("command: x\nsamples: 2\nparameters: {lr: {min: 1, mxa: 2}}\n"))
    assert e.field == "experiments.search.parameters.lr.mxa" and "did you mean 'max'?" in str(e)


def test_cycle_in_after():
    text = "name: n\nexperiments:\n  a: {command: x, after: c}\n  b: {command: x, after: a}\n" \
           "  c: {command: x, after: b}\n  d: {command: x}\n"
    e = fail(text)
    assert "cycle in after: a -> c -> b -> a" in str(e)
    assert e.field == "experiments.a.after" and e.line == 3


def test_after_names_no_experiment():
    text = "name: n\nexperiments:\n  search: {command: x}\n  report:\n    after: [serch]\n" \
           "    command: x\n"
    e = fail(text)
    assert "after names no experiment 'serch'" in str(e) and "did you mean 'search'?" in str(e)
    assert e.field == "experiments.report.after" and e.line == 5


def test_after_itself():
    e = fail("name: n\nexperiments:\n  a: {command: x, after: a}\n")
    assert "cannot run after itself" in str(e) and e.field == "experiments.a.after"


def test_placeholder_without_parameter():
    text = with_experiment("parameters: {lr: [1]}\ncommand: train --lr {{lrr}}\n")
    e = fail(text)
    assert "placeholder {{lrr}} names no parameter" in str(e) and "did you mean 'lr'?" in str(e)
    assert e.field == "experiments.search.command" and e.line == line_of(text, "command")


def test_placeholder_in_env():
    e = fail(with_experiment("command: x\nenv: {A: '{{nope}}'}\n"))
    assert e.field == "experiments.search.env.A" and "{{nope}}" in str(e)


def test_empty_range():
    text = with_experiment("command: x\nsamples: 2\nparameters:\n  lr: '0.3-0.01'\n")
    e = fail(text)
    assert "empty range 0.3-0.01: min must be below max" in str(e)
    assert e.field == "experiments.search.parameters.lr" and e.line == line_of(text, "lr:")


def test_log_range_needs_positive_min():
    e = fail(with_experiment("command: x\nsamples: 2\nparameters: {lr: {min: 0, max: 1, log: on}}"))
    assert "needs min above 0" in str(e)


def test_samples_below_one():
    text = with_experiment("command: x\nsamples: 0\n")
    e = fail(text)
    assert "samples must be at least 1" in str(e)
    assert e.field == "experiments.search.samples" and e.line == line_of(text, "samples")


def test_samples_required_for_a_range():
    e = fail(with_experiment("command: x\nparameters: {lr: '0.1-1'}\n"))
    assert e.field == "experiments.search.samples" and "samples is required" in str(e)


def test_too_many_tasks_in_total():
    text = "name: n\nexperiments:\n  a: {command: x, samples: 600000}\n" \
           "  b: {command: x, samples: 600000}\n"
    e = fail(text)
    assert "more than 1,000,000" in str(e) and e.field == "experiments"


def test_not_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("name: n\nexperiments: [\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert "not valid YAML" in str(info.value) and str(info.value).startswith(str(path))


def test_bad_timestamp_is_not_yaml():
    e = fail("name: n\nwhen: 2024-13-45\nexperiments: {a: {command: x}}\n")
    assert "not valid YAML" in str(e) and e.line == 2


def test_deep_nesting_is_not_yaml():
    e = fail("a: " + "[" * 1500 + "]" * 1500)
    assert "not valid YAML" in str(e)


def test_missing_file(tmp_path):
    (tmp_path / "run.yaml").write_text("experiments: {a: {command: x}}\n")
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "run")
    assert "no such recipe file" in str(info.value) and "run.yaml" in str(info.value)


def test_folder_big_binary_and_empty_files(tmp_path):
    cases = {"dir": None, "big.yaml": b"# x\n" * (1 << 18) + b"\n", "bin.yaml": b"a: 1\n\xff\n",
             "empty.yaml": b"  \n# nothing\n"}
    expected = {"dir": "is a folder", "big.yaml": "larger than 256 KiB",
                "bin.yaml": "not UTF-8", "empty.yaml": "recipe is empty"}
    for name, data in cases.items():
        p = tmp_path / name
        p.mkdir() if data is None else p.write_bytes(data)
        with pytest.raises(RecipeError) as info:
            load_recipe(p)
        assert expected[name] in str(info.value), name
    with pytest.raises(RecipeError) as info:
        load_recipe(tmp_path / "bin.yaml")
    assert info.value.line == 2


def test_top_level_not_a_mapping():
    assert "top level must be a mapping" in str(fail("- a\n- b\n"))


def test_duplicate_key():
    text = "name: n\nexperiments:\n  a: {command: x}\n  b: {command: y}\n  a: {command: z}\n"
    e = fail(text)
    assert "duplicate key 'a' (first on line 3)" in str(e) and e.line == 5


def test_duplicate_key_deep_and_unused():
    e = fail("name: n\nexperiments: {a: {command: x}}\nz: {q: 1, q: 2}\n")
    assert "duplicate key 'q'" in str(e) and e.line == 3


@pytest.mark.parametrize("body, field, message", [
    ("command: x\nsamples: '3'", "samples", "samples must be an integer, not a string ('3')"),
    ("command: x\nsamples: true", "samples", "samples must be an integer, not a boolean"),
    ("command: x\nretries: 101", "retries", "retries must be at most 100"),
    ("command: [x, 3]", "command[1]", "command[1] must be a string, not an integer (3)"),
    ("command: ''", "command", "command must not be empty"),
    ("image: x", "command", "command is required"),
    ("command: x\nsampling: randm", "sampling", "did you mean 'random'?"),
    ("command: x\nparameters: {lr: []}", "parameters.lr", "empty list"),
    ("command: x\nparameters: {lr: null}", "parameters.lr", "lr has no value"),
    ("command: x\nparameters: {lr: [1, null]}", "parameters.lr[1]", "has no value"),
    ("command: x\nparameters: {lr: [.nan]}", "parameters.lr[0]", "finite"),
    ("command: x\nparameters: {lr: [[1]]}", "parameters.lr[0]", "not a list"),
    ("command: x\nparameters: {1x: [1]}", "parameters.1x", "parameter name '1x'"),
    ("command: x\nsamples: 2\nparameters: {lr: {min: 1.5, max: 3, type: int}}",
     "parameters.lr.min", "whole number"),
    ("command: x\nenv: {HYPER_X: a}", "env.HYPER_X", "reserved"),
    ("command: x\nenv: {A: [1]}", "env.A", "must be a string, number or boolean"),
    ("command: x\nenv: {A: null}", "env.A", "not null"),
    ("command: x\nworkers: 0", "workers", "workers must be at least 1"),
    ("command: x\nafter: {a: 1}", "after", "a string or a list of strings"),
])
def test_bad_experiment_fields(body, field, message):
    text = with_experiment(body + "\n")
    e = fail(text)
    assert e.field == f"experiments.search.{field}" and message in str(e)
    key = field.split(".")[0].split("[")[0]
    where = f"{key}:" if f"{key}:" in text else "search:"  # a missing key: the experiment's line
    assert e.line == line_of(text, where)


@pytest.mark.parametrize("top, field, message", [
    ("version: 2\n", "version", "unsupported version 2"),
    ("seed: 1.5\n", "seed", "seed must be an integer"),
    ("storage: ftp://x\n", "storage", "must be a URL starting with file://, s3://"),
    ("storage: s3:///x\n", "storage", "has no bucket"),
    ("mounts: {data: s3://b}\n", "mounts.data", "must be absolute"),
    ("mounts: {/a/../b: s3://b}\n", "mounts./a/../b", "without '..'"),
    ("mounts: {/data: http://b}\n", "mounts./data", "chunks+s3://"),
    ("mounts: {/data: 'az://acct'}\n", "mounts./data", "has no container"),
    ("mounts: {/data: 'az://acct/'}\n", "mounts./data", "az://ACCOUNT/CONTAINER/PREFIX"),
    ("cluster: {provider: gce}\n", "cluster.provider", "did you mean 'gcp'?"),
    ("cluster: {provider: ssh}\n", "cluster.hosts", "provider ssh needs hosts"),
    ("cluster: {provider: ssh, hosts: ['a b']}\n", "cluster.hosts", "user@host:port"),
    ("cluster: {provider: aws, disk_gb: 5}\n", "cluster.disk_gb", "at least 10"),
    ("cluster: {provider: aws, max_price: 0}\n", "cluster.max_price", "above 0"),
    ("cluster: {provider: aws, spot: 'yes'}\n", "cluster.spot", "true, false or auto"),
    ("cluster: {provider: aws, ssh_cidr: nope}\n", "cluster.ssh_cidr", "not a network"),
    ("cluster: {provider: aws, workers: 0}\n", "cluster.workers", "at least 1"),
    ("cluster: {provider: aws, regoin: x}\n", "cluster.regoin", "did you mean 'region'?"),
    ("cluster: [a]\n", "cluster", "cluster must be a mapping, not a list"),
    ("mounts: {/d: {url: s3://b/p, mode: rx}}\n", "mounts./d.mode", "ro, rw or copy"),
    ("mounts: {/d: {mode: rw}}\n", "mounts./d.url", "has no url"),
    ("mounts: {/d: {url: chunks+s3://b/p, mode: rw}}\n", "mounts./d.url", "immutable"),
    ("mounts: {/d: {url: s3://b/p, mdoe: rw}}\n", "mounts./d.mdoe", "did you mean 'mode'?"),
    ("cluster: {provider: gcp, iam_role: r}\n", "cluster.iam_role", "applies to provider aws"),
])
def test_bad_top_level_fields(top, field, message):
    e = fail("name: n\n" + top + "experiments: {a: {command: x}}\n")
    assert e.field == field and message in str(e) and e.line == 2


def test_bad_recipe_name():
    e = fail("name: -bad\nexperiments: {a: {command: x}}\n")
    assert e.field == "name" and e.line == 1 and "is not a valid name" in str(e)
    e = fail("experiments: {a: {command: x}}\n", path="my recipe.yaml")
    assert e.field == "name" and "'my recipe' is not a valid recipe name" in str(e)


def test_provider_specific_key_misuse():
    e = fail("name: n\ncluster:\n  provider: local\n  hosts: [a]\nexperiments: {a: {command: x}}")
    assert "'hosts' applies to provider ssh, not local" in str(e)
    assert e.field == "cluster.hosts" and e.line == 4
    e = fail("name: n\ncluster: {provider: aws, project: p}\nexperiments: {a: {command: x}}")
    assert "'project' applies to provider gcp, not aws" in str(e)
    e = fail("name: n\ncluster: {provider: ssh, hosts: [a], region: r}\n"
             "experiments: {a: {command: x}}")
    assert "'region' applies to providers aws, gcp, azure, not ssh" in str(e)


def test_error_string_form(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text(with_experiment("command: x\nsamples: 0\n"))
    with pytest.raises(RecipeError) as info:
        load_recipe(path)
    assert str(info.value) == f"{path}:5: experiments.search.samples: samples must be at least 1"


def test_non_string_key_and_empty_experiments():
    assert "quote it" in str(fail("name: n\nexperiments: {1: {command: x}}\n"))
    e = fail("name: n\nexperiments: {}\n")
    assert e.field == "experiments" and "must not be empty" in str(e)
    assert fail("name: n\n").field == "experiments"


# --- fuzzing ---------------------------------------------------------------------------------

BREAKS = re.compile(r"\r\n|[\r\n\x85\u2028\u2029]")
VOCAB = ["version", "name", "seed", "cluster", "storage", "workdir", "mounts", "experiments",
         "provider", "workers", "hosts", "region", "zone", "spot", "disk_gb", "max_price",
         "project", "resource_group", "command", "image", "parameters", "sampling", "samples",
         "after", "retries", "env", "min", "max", "log", "type", "lr", "search", "report",
         "samles", "HYPER_X", "/data", "<<"]
INTERESTING = st.sampled_from([
    None, True, False, 0, 1, -1, 2**70, 1e400, float("nan"), "", " ", "x", "0.3-0.01",
    "0.01-0.3", "1-10", "{{lr}}", "{{x}}", "search", "report", "grid", "random", "ssh",
    "aws", "local", "s3://b/p", "file://rel", "/abs", "../up", [], {}, ["search"],
    {"min": 1, "max": 2}, {"min": 0, "max": 1, "log": True}, "2024-13-45", "\x00"])
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20)
DOCS = st.recursive(SCALARS, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(VOCAB) | st.text(max_size=8), kids, max_size=4), max_leaves=25)
PLAN_EXISTS = importlib.util.find_spec("hypercli.plan") is not None


def check_outcome(text: str, path: str | None = "fuzz.yaml") -> None:
    """The only allowed outcomes: a consistent Recipe, or a RecipeError with a sane line."""
    try:
        r = parse_recipe(text, path=path, base_dir="/base")
    except RecipeError as e:
        assert str(e) and e.reason
        assert e.line is None or 1 <= e.line <= len(BREAKS.findall(text)) + 1
        return
    check_recipe(r)


def check_recipe(r: Recipe) -> None:
    assert isinstance(r, Recipe) and r.cluster.provider in PROVIDERS
    assert (r.workdir is None or os.path.isabs(r.workdir)) and r.experiments  # none: None
    assert sorted(r.order) == sorted(r.experiments)
    position = {n: i for i, n in enumerate(r.order)}
    total = 0
    for name, e in r.experiments.items():
        assert all(position[d] < position[name] for d in e.after)
        for text in [e.command, *e.env.values()]:
            assert set(params.placeholders(text)) <= set(e.parameters)
        for p in e.parameters.values():
            assert (isinstance(p, Discrete) and p.values) or (p.low < p.high)
        assert all(isinstance(v, str) for v in e.env.values())
        total += params.count_samples(e.parameters, e.sampling, e.samples)
    assert total <= 1_000_000
    if PLAN_EXISTS and total <= 5_000:  # keep fuzzing fast; plan is pure but not free
        from hypercli.plan import build_plan
        try:
            build_plan(r)
        except RecipeError:
            pass


FUZZ = settings(max_examples=250, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@FUZZ
@given(st.text(max_size=300))
def test_fuzz_random_text(text):
    check_outcome(text)
    check_outcome(text, path=None)


@FUZZ
@given(DOCS)
def test_fuzz_random_documents(doc):
    check_outcome(yaml.safe_dump(doc, allow_unicode=True))
    check_outcome(yaml.safe_dump({"name": "n", "experiments": doc}))


def paths(doc, prefix=()):
    """Every (path, container) in a nested dict/list document."""
    items = doc.items() if isinstance(doc, dict) else enumerate(doc)
    for k, v in list(items):
        yield prefix + (k,)
        if isinstance(v, (dict, list)):
            yield from paths(v, prefix + (k,))


def mutate(doc, data) -> None:
    all_paths = list(paths(doc))
    if not all_paths:
        return
    path = data.draw(st.sampled_from(all_paths))
    parent = doc
    for k in path[:-1]:
        parent = parent[k]
    key = path[-1]
    op = data.draw(st.sampled_from(["delete", "rename", "replace", "replace"]))
    if op == "delete":
        del parent[key]
    elif op == "rename" and isinstance(parent, dict):
        new = data.draw(st.sampled_from(VOCAB) | st.text(max_size=8))
        parent[new] = parent.pop(key)
    else:
        parent[key] = copy.deepcopy(data.draw(INTERESTING | DOCS))  # no shared state


BASE = yaml.safe_load(FULL)


@FUZZ
@given(st.data())
def test_fuzz_mutated_recipes(data):
    doc = copy.deepcopy(BASE)
    for _ in range(data.draw(st.integers(1, 4))):
        mutate(doc, data)
    check_outcome(yaml.safe_dump(doc, sort_keys=False, allow_unicode=True))


@FUZZ
@given(st.data())
def test_fuzz_mutated_lines(data):
    lines = FULL.splitlines()
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(lines) - 1))
        op = data.draw(st.sampled_from(["delete", "duplicate", "indent", "dedent", "insert"]))
        if op == "delete":
            del lines[i]
        elif op == "duplicate":
            lines.insert(i, lines[i])
        elif op == "indent":
            lines[i] = " " + lines[i]
        elif op == "dedent":
            lines[i] = lines[i][1:]
        else:
            lines.insert(i, data.draw(st.text(max_size=20)))
        if not lines:
            break
    check_outcome("\n".join(lines) + "\n")


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=200))
def test_fuzz_file_bytes(data):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "fuzz.yaml")
        with open(path, "wb") as f:
            f.write(data)
        try:
            check_recipe(load_recipe(path))
        except RecipeError as e:
            assert str(e).startswith(path)


def test_storage_grants_of_a_recipe():
    """Read on each mounted dataset, read/write on each workflow's own part of the storage
    prefix, rw on an rw bucket mount; a grant inside a wider one is dropped; file:// needs
    nothing."""
    from hypercli.recipe.access import (Grant, for_workflows, grants_from, merge, parse_url,
                                        rights)
    r = parse_recipe(textwrap.dedent("""\
        name: g
        storage: s3://out/runs
        cluster: {provider: aws, iam_role: my-profile}
        mounts:
          /data: chunks+s3://ds/imagenet
          /old: s3://out/runs/search-1
          /more: chunks+s3://ds/imagenet/val
          /scratch: {url: s3://tmp/x, mode: rw}
          /local: chunks+file:///srv/ds
        experiments: {a: {command: x}}
        """))
    assert r.rw_mounts == frozenset({"/scratch"})
    # plain gs:// and az:// bucket mounts: read, or read and write when rw
    g = parse_recipe(textwrap.dedent("""\
        name: g
        cluster: {provider: gcp}
        mounts:
          /raw: gs://lab/raw
          /tmp2: {url: gs://lab/tmp, mode: rw}
          /az: {url: az://acct/cont/p, mode: rw}
        experiments: {a: {command: x}}
        """))
    assert g.rw_mounts == frozenset({"/tmp2", "/az"})
    assert g.cluster.grants == (Grant("az", "acct/cont", "p", True), Grant("gs", "lab", "raw"),
                                Grant("gs", "lab", "tmp", True))
    assert r.cluster.options["iam_role"] == "my-profile"
    # the storage prefix is a per-workflow template, not a grant of its own; the earlier
    # run's outputs mounted under it are read
    assert r.cluster.grants == (Grant("s3", "ds", "imagenet"),
                                Grant("s3", "out", "runs", True, True),
                                Grant("s3", "out", "runs/search-1"),
                                Grant("s3", "tmp", "x", True))
    wfs = [{"id": "g-2", "storage": "s3://out/runs"}, {"id": "h-1", "storage": "s3://o2/x"}]
    assert for_workflows(r.cluster.grants, wfs) == r.cluster.grants[:2] + (
        Grant("s3", "out", "runs/g-2", True),) + r.cluster.grants[2:]
    assert rights(r.cluster.grants) == tuple(g for g in r.cluster.grants if not g.per_workflow)
    assert grants_from([g.as_dict() for g in r.cluster.grants]) == r.cluster.grants
    assert parse_url("az://acct/cont/p/q") == Grant("az", "acct/cont", "p/q")
    assert parse_url("gs://b") == Grant("gs", "b", "")
    assert parse_url("file:///x") is None
    # a whole-bucket read does not cover a write; the same prefix read and written is one
    assert merge([Grant("s3", "b", ""), Grant("s3", "b", "p", True)]) == \
        (Grant("s3", "b", "", False), Grant("s3", "b", "p", True))
    assert merge([Grant("s3", "b", "p"), Grant("s3", "b", "p", True)]) == \
        (Grant("s3", "b", "p", True),)
    assert merge([Grant("s3", "b", "pa"), Grant("s3", "b", "p", True)]) == \
        (Grant("s3", "b", "p", True), Grant("s3", "b", "pa"))  # "pa" is not inside "p"
