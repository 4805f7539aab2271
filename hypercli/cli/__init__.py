"""The ``hyper`` command line: each command parses, calls one library function, renders.

One module per command or group (``run``: plan, run, attach; ``tasks``: ps, results,
outputs, logs, cancel; ``cluster``: up, down, check, gc, status, forget; ``remote``: exec,
ssh, ssh-config; ``data``, ``image``, ``usage``: top, stats; ``ui``; ``config``; ``ports``:
port-forward, jupyter, tensorboard; ``offers``: offers, catalog; ``cost``), registered here and nowhere else. Imports run one way: this package imports the library below it and its own
``common`` module; the command modules never import each other or this module.

This package is the only one that imports click and the only place where a HyperError
becomes a message and an exit code (0 all tasks succeeded, 1 some task failed, 2 bad input,
3 infrastructure error, 130 interrupted with tasks left running).
"""

from __future__ import annotations

import click

from hypercli import __version__
from hypercli.cli import cluster, data, image, remote, run, tasks, ui, usage
from hypercli.cli import config, cost, offers, ports
from hypercli.cli.common import console, text
from hypercli.errors import HyperError


class HyperGroup(click.Group):
    """Turns HyperErrors into a one-line message, a hint and the error's exit code."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HyperError as e:
            err = console(stderr=True)  # the text may hold user values: never markup
            err.print(text(("error:", "bold red"), f" {e}"), soft_wrap=True)
            if e.hint:
                err.print(text(("hint:", "dim"), f" {e.hint}"), soft_wrap=True)
            ctx.exit(e.exit_code)


@click.group(cls=HyperGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hyper")
def cli():
    """Run recipes of container tasks on spot VMs, SSH hosts or this machine."""


for _command in (run.plan, run.run, run.attach,
                 cluster.up, cluster.down, cluster.check, cluster.gc, cluster.status,
                 cluster.forget,
                 tasks.ps, tasks.results, tasks.outputs, tasks.logs, tasks.cancel,
                 data.data, image.image, remote.exec_, remote.ssh, remote.ssh_config,
                 ui.ui, usage.top, usage.stats,
                 config.config, ports.port_forward, ports.jupyter, ports.tensorboard,
                 offers.offers, offers.catalog, cost.cost):
    cli.add_command(_command)


def main() -> None:
    """Entry point of the ``hyper`` console script."""
    cli(prog_name="hyper")
