"""``hyper image``: bake node images with Packer and list them (:mod:`hypercli.images`)."""

from __future__ import annotations

import json

import click


@click.group()
def image():
    """Bake node images with Packer (images/packer) and list them."""


@image.command()
@click.option("--provider", type=click.Choice(["aws", "gcp", "azure"]), required=True)
@click.option("--gpu", is_flag=True, help="The GPU variant (NVIDIA driver, container toolkit).")
@click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
              help="A Packer variable (aws_region, gcp_project, gcp_zone, "
                   "azure_subscription_id, azure_resource_group, azure_location, prepull, "
                   "disk_gb); repeat for more.")
def build(provider, gpu, variables):
    """Bake the node image of a cloud and record it."""
    from hypercli.errors import UsageError
    from hypercli.images import build as build_
    vars_ = {}
    for item in variables:
        name, sep, value = item.partition("=")
        if not sep or not name:
            raise UsageError(f"--var {item!r} is not NAME=VALUE", "e.g. --var aws_region=eu-west-1")
        vars_[name] = value
    row = build_(provider, gpu=gpu, variables=vars_, log=click.echo)
    click.echo(f"baked {row['name']}: {row['id']}")


@image.command(name="ls")
@click.option("--provider", type=click.Choice(["aws", "gcp", "azure"]))
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls(provider, as_json):
    """List the node images baked here, newest first."""
    import time

    from hypercli.images import list_images
    rows = list_images(provider)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no images baked yet; `hyper image build --provider aws` bakes one")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r.get("built", 0)))
        click.echo(f"{r['provider']:<6} {r['variant']:<4} {r['name']:<44} {r['id']}  {when}")
