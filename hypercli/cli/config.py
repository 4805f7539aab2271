"""``hyper config``: the defaults file ``$HYPER_HOME/config.yaml`` shown and edited
(:mod:`hypercli.config`)."""

from __future__ import annotations

import json

import click

from hypercli.cli.common import print_json


def _text(value) -> str:
    return "" if value is None else value if isinstance(value, str) else json.dumps(value)


@click.group()
def config():
    """Defaults for recipes: provider, storage, idle minutes, SSH key and each cloud's
    region and other cluster keys, kept in $HYPER_HOME/config.yaml.

    Precedence: a command-line flag > the recipe > config.yaml > the built-in default.
    """


@config.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def list_(as_json):
    """Every key, its value and where the value comes from."""
    from hypercli.config import listing
    rows = listing()
    if as_json:
        print_json([{"key": k, "value": v, "source": s} for k, v, s in rows])
        return
    for key, value, source in rows:
        if source != "unset":
            click.echo(f"{key:<24} {_text(value):<36} ({source})")
    unset = [k for k, _, s in rows if s == "unset"]
    if unset:
        click.echo(f"not set (the provider's own defaults): {', '.join(unset)}")


@config.command()
@click.argument("key")
def get(key):
    """Print KEY's value (nothing, exit 1, when it is not set)."""
    from hypercli.config import get as get_
    value, source = get_(key)
    if source == "unset":
        raise SystemExit(1)
    click.echo(_text(value))


@config.command("set")
@click.argument("key")
@click.argument("value")
def set_(key, value):
    """Set KEY to VALUE (written as in YAML: true, 30, eu-west-1), checked as a recipe's
    value would be."""
    from hypercli.config import path, set_value
    stored = set_value(key, value)
    click.echo(f"{key} = {_text(stored)} (in {path()})")


@config.command()
@click.argument("key")
def unset(key):
    """Remove KEY from the file (its built-in default applies again)."""
    from hypercli.config import unset as unset_
    click.echo(f"{key} removed" if unset_(key) else f"{key} was not set")
