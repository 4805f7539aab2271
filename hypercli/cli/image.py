"""``hyper image``: bake node images with Packer and list them (:mod:`hypercli.images`).

Thin click commands: parse, call one function of :mod:`hypercli.images`, print. HyperErrors
are left to the ``hyper`` group in ``hypercli.cli``, which turns them into a message and an
exit code (2: no Packer, missing credentials, a bad ``--var``; 3: Packer failed).
"""

from __future__ import annotations


import click

PROVIDERS = click.Choice(["aws", "gcp", "azure"])


@click.group()
def image():
    """Node images baked with Packer (images/packer)."""


@image.command()
@click.option("--provider", type=PROVIDERS, required=True, help="The cloud to bake it in.")
@click.option("--gpu", is_flag=True, help="The GPU variant (NVIDIA driver, container toolkit).")
@click.option("--var", "variables", multiple=True, metavar="NAME=VALUE",
              help="A template variable (aws_region, gcp_project, gcp_zone, "
                   "azure_subscription_id, azure_resource_group, azure_location, prepull, "
                   "disk_gb, ...); repeat for more.")
def build(provider, gpu, variables):
    """Bake the node image of a cloud with Packer and record it."""
    from hypercli.errors import UsageError
    from hypercli.images import build as build_image
    values = {}
    for item in variables:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise UsageError(f"--var {item!r} is not NAME=VALUE",
                             "e.g. --var aws_region=eu-west-1")
        values[name.strip()] = value
    row = build_image(provider, gpu=gpu, variables=values, log=click.echo)
    click.echo(f"baked {row['name']}: {row['id']}")


@image.command(name="ls")
@click.option("--provider", type=PROVIDERS, help="Only this cloud's images.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def ls(provider, as_json):
    """List the node images baked here, newest first."""
    import time

    from hypercli.images import list_images
    rows = list_images(provider)
    if as_json:
        from hypercli.console import dumps
        click.echo(dumps(rows, indent=2))
        return
    if not rows:
        click.echo("no images baked yet; `hyper image build --provider aws` bakes one")
    for r in rows:
        when = time.strftime("%Y-%m-%d %H:%M", time.gmtime(r.get("built", 0)))
        click.echo(f"{r.get('provider', '?'):<6} {r.get('variant', '?'):<4} "
                   f"{r.get('name', '?'):<44} {r.get('id', '?')}  {r.get('location') or ''}"
                   f"  {when}")
