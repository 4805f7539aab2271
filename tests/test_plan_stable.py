"""A recipe's plan never changes between versions: the same task ids, parameters, commands,
environment and workflow digest (a resumed `hyper run` finds its workflow by digest, and a
plan previewed with `hyper plan` must be the plan that runs). The expected values were taken
from the planner before its rendering was made faster; any change to them breaks resumes of
workflows already in users' state files."""

from __future__ import annotations

import hashlib
import json

import pytest

from hypercli.plan import build_plan
from hypercli.recipe import parse_recipe

RANDOM = """version: 1
name: big
cluster: {provider: local, workers: 4}
experiments:
  search:
    parameters:
      optimizer: [sgd, adam, rmsprop]
      depth: [2, 4, 8, 16]
      augment: [true, false]
      lr: {min: 0.00001, max: 0.3, log: true}
      dropout: "0.0-0.5"
      batch: "16-512"
    sampling: random
    samples: 100000
    command: >-
      python train.py --optimizer {{optimizer}} --depth {{depth}} --augment {{augment}}
      --lr {{lr}} --dropout {{dropout}} --batch {{batch}}
"""

PAPER = ("version: 1\nname: paper\ncluster: {provider: local, workers: 4}\n"
         "experiments:\n  search:\n    parameters:\n"
         + "\n".join(f"      p{i}: [lo{i}, hi{i}]" for i in range(12))
         + "\n    sampling: grid\n    command: python train.py "
         + " ".join(f"--p{i} {{{{p{i}}}}}" for i in range(12)) + "\n")

ODD = """version: 1
name: odd
cluster: {provider: local}
experiments:
  a:
    parameters:
      name: ["x; rm -rf ~", "$(id)", "it's", "plain"]
      flag: [true, false]
      n: "1-9"
      w: {min: 0.001, max: 1.0, log: true}
    sampling: grid
    samples: 50
    env: {NAME: "{{name}}-{{n}}", W: "{{ w }}"}
    command: echo {{name}} {{flag}} {{n}} {{w}} {{ name }}
"""


@pytest.mark.parametrize("text,digest,tasks_hash,count", [
    (RANDOM, "2011edf430dbf20d731ffe730a121a192772641e33f51eef290eab3b8991d727",
     "fc51fae92ddbb4e6", 100000),
    (PAPER, "26e9d1ff4067dd0c56d4e833ee7fa148ab346144dda9bf461840abc61f92c152",
     "ddf19d1117603151", 4096),
    (ODD, "7eb5cc9cdcdb11e416b101663ea930bf7e40fcf413f718385d68eb8296ca186d",
     "ae208102600fc76d", 50),
], ids=["random-100k", "paper-grid", "quoting-and-env"])
def test_a_recipes_plan_is_the_same_as_before(text, digest, tasks_hash, count):
    wf = build_plan(parse_recipe(text))
    h = hashlib.sha256()
    for t in wf.tasks:
        h.update(json.dumps([t.id, t.experiment, t.index, t.params, t.command, t.env]).encode())
    assert (wf.digest, h.hexdigest()[:16], len(wf.tasks)) == (digest, tasks_hash, count)


def test_values_reach_the_shell_as_literal_strings():
    wf = build_plan(parse_recipe(ODD))
    cmds = {t.params["name"]: t.command for t in wf.tasks}
    assert cmds["x; rm -rf ~"].startswith("echo 'x; rm -rf ~' ")
    assert cmds["$(id)"].startswith("echo '$(id)' ")
    assert cmds["it's"].startswith("echo 'it'\"'\"'s' ")
    t = wf.tasks[0]
    assert t.env["NAME"] == f"{t.params['name']}-{t.params['n']}"  # env: verbatim, not quoted
