"""The README documents every CLI command, option and recipe key the code has."""

from __future__ import annotations

import re

import click

from conftest import ROOT
from hypercli.cli import cli

README = (ROOT / "README.md").read_text()


def _commands(group: click.Group, prefix: str = "hyper"):
    for name, cmd in group.commands.items():
        if cmd.hidden:
            continue
        yield f"{prefix} {name}", cmd
        if isinstance(cmd, click.Group):
            yield from _commands(cmd, f"{prefix} {name}")


def test_every_command_and_option_is_in_the_readme():
    names = [name for name, _ in _commands(cli)]
    assert "hyper data mount" in names  # the walk reaches sub-groups
    for name, cmd in _commands(cli):
        assert name in README, f"`{name}` is not documented"
        for p in cmd.params:
            if isinstance(p, click.Option):
                for opt in p.opts + p.secondary_opts:
                    if opt.startswith("--") and opt != "--help":
                        assert opt in README, f"`{name} {opt}` is not documented"


def test_readme_opens_with_the_two_commands():
    blocks = re.findall(r"```bash\n(.*?)```", README, re.S)
    assert "hyper run recipes/quickstart.yaml" in blocks[0]
    assert "scripts/test.sh" in blocks[1]
    assert "scripts/test.sh" in (ROOT / ".ci" / "run").read_text()


def test_every_recipe_key_is_in_the_readme():
    from hypercli import recipe
    keys = set(recipe._TOP_KEYS) | set(recipe._EXPERIMENT_KEYS) | set(recipe._CLUSTER_KEYS)
    keys |= set(recipe._RANGE_KEYS) - {"type"}
    for key in sorted(keys):
        assert re.search(rf"\b{key}:", README), f"recipe key {key!r} is not in the README"
