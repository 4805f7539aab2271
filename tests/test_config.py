"""The defaults file ``$HYPER_HOME/config.yaml`` and ``hyper config`` (issue 27, item 5):
values checked by the recipe's own rules, unknown keys refused with "did you mean", and the
precedence flag > recipe > config file > built-in, down to a real run."""

from __future__ import annotations

import json

import pytest

from hypercli import config
from hypercli.errors import RecipeError, UsageError
from hypercli.recipe import parse_recipe


def recipe(text: str):
    return parse_recipe(text, path="r.yaml", base_dir="/tmp")


BARE = "name: r\nexperiments: {e: {command: 'true'}}\n"


def test_set_get_unset_list_and_the_file(hyper, hyper_home):
    assert hyper("config", "set", "aws.region", "eu-west-1", check=True).returncode == 0
    hyper("config", "set", "aws.spot", "false", check=True)
    hyper("config", "set", "idle_minutes", "20", check=True)
    assert hyper("config", "get", "aws.region", check=True).stdout == "eu-west-1\n"
    assert hyper("config", "get", "aws.spot", check=True).stdout == "false\n"  # a bool
    assert hyper("config", "get", "provider", check=True).stdout == "local\n"  # built-in
    r = hyper("config", "get", "gcp.region")
    assert r.returncode == 1 and r.stdout == ""  # not set: the provider's own default
    rows = {r["key"]: r for r in json.loads(hyper("config", "list", "--json",
                                                  check=True).stdout)}
    assert rows["aws.region"] == {"key": "aws.region", "value": "eu-west-1",
                                  "source": "config.yaml"}
    assert rows["idle_minutes"]["value"] == 20 and rows["provider"]["source"] == "built-in"
    f = hyper_home / "config.yaml"
    assert (f.stat().st_mode & 0o777) == 0o600
    assert config.load() == {"idle_minutes": 20, "aws.region": "eu-west-1", "aws.spot": False}
    assert "aws.region removed" in hyper("config", "unset", "aws.region", check=True).stdout
    assert "aws.region" not in config.load() and config.load()["aws.spot"] is False


def test_unknown_keys_and_bad_values_are_refused_naming_them(hyper, hyper_home):
    r = hyper("config", "set", "aws.regin", "x")
    assert r.returncode == 2 and "did you mean 'aws.region'" in r.stderr, r.stderr
    r = hyper("config", "set", "idle_minute", "3")
    assert r.returncode == 2 and "did you mean 'idle_minutes'" in r.stderr
    r = hyper("config", "set", "aws.spot", "maybe")
    assert r.returncode == 2 and "aws.spot" in r.stderr and "true, false or auto" in r.stderr
    r = hyper("config", "set", "provider", "awz")
    assert r.returncode == 2 and "did you mean 'aws'" in r.stderr
    r = hyper("config", "set", "ssh.hosts", "[a]")  # a cluster's own, never a default
    assert r.returncode == 2 and "unknown config key" in r.stderr
    assert not (hyper_home / "config.yaml").exists()  # nothing written by a refused set
    (hyper_home / "config.yaml").write_text("provider: local\ngcp:\n  regoin: x\n")
    r = hyper("plan", "recipes/quickstart.yaml")  # a hand-edited file: file, line, key
    assert r.returncode == 2 and "config.yaml:3: gcp.regoin" in r.stderr, r.stderr
    assert "did you mean 'region'" in r.stderr and "Traceback" not in r.stderr


def test_recipe_values_win_over_the_file_which_wins_over_built_ins(hyper_home):
    config.set_value("provider", "aws")
    config.set_value("aws.region", "eu-west-1")
    config.set_value("aws.spot", "false")
    config.set_value("idle_minutes", "20")
    config.set_value("storage", "s3://defaults/out")
    config.set_value("gcp.project", "p1")
    r = config.apply(recipe(BARE))  # no cluster: everything from the file
    assert r.cluster.provider == "aws" and r.storage == "s3://defaults/out"
    assert r.cluster.options == {"region": "eu-west-1", "spot": False, "idle_minutes": 20}
    assert any(g.bucket == "defaults" for g in r.cluster.grants)  # nodes may write there
    r = config.apply(recipe(BARE + "cluster: {provider: aws, region: us-east-2, "
                            "idle_minutes: 5}\nstorage: s3://mine/x\n"))
    assert r.cluster.options == {"region": "us-east-2", "spot": False, "idle_minutes": 5}
    assert r.storage == "s3://mine/x"
    r = config.apply(recipe(BARE + "cluster: {provider: gcp}\n"))  # that cloud's section
    assert r.cluster.options == {"project": "p1", "idle_minutes": 20}
    r = config.apply(recipe(BARE + "cluster: {provider: local}\n"))  # named: stays local
    assert r.cluster.provider == "local" and r.cluster.options == {}
    config.unset("provider")
    assert config.apply(recipe(BARE)).cluster.provider == "local"  # the built-in


def test_flags_win_over_the_file_and_ssh_keys_come_from_it(hyper_home):
    from hypercli.workflows import cluster_spec
    config.set_value("ssh.identity_file", "~/.ssh/lab_key")
    config.set_value("ssh.user", "ubuntu")
    spec = cluster_spec("lab", "ssh", ["10.0.0.5"], user="admin")
    assert spec.options["user"] == "admin"  # the flag
    assert spec.options["identity_file"] == "~/.ssh/lab_key"  # the file
    config.set_value("provider", "ssh")  # a default that needs hosts the recipe lacks
    with pytest.raises(RecipeError, match="names no hosts"):
        config.apply(recipe(BARE))


def test_unset_of_an_unknown_key(hyper_home):
    with pytest.raises(UsageError, match="unknown config key") as e:
        config.unset("storge")
    assert e.value.hint == "did you mean 'storage'?"


def test_a_run_uses_the_storage_of_the_file(hyper, hyper_home, write_recipe, tmp_path):
    out = tmp_path / "kept-here"
    hyper("config", "set", "storage", f"file://{out}", check=True)
    path = write_recipe("""
        name: cfgrun
        experiments:
          one:
            command: echo hi > "$HYPER_OUTPUT/said"
    """)
    hyper("run", path, check=True)
    assert (out / "cfgrun-1" / "one-0000" / "said").read_text() == "hi\n"
