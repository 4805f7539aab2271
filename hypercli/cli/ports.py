"""``hyper port-forward``, ``hyper jupyter`` and ``hyper tensorboard``: a node's port, a
notebook server on a node, and TensorBoard over a workflow's outputs, reached from this
machine through the cluster's SSH connection (:mod:`hypercli.ports`)."""

from __future__ import annotations

import sys
import time

import click

from hypercli.cli.common import console, open_state, text


def _hold(served_or_forward, label: str, lines: list[str], check=None) -> None:
    """Print ``lines``, then keep a forward (and its server) until Ctrl-C, printing why a
    connection could not be carried, and ending when the server ends (``check() -> str |
    None``: why it ended). The forward and the server are closed however it ends."""
    err = console(stderr=True)
    shown = 0
    fwd = getattr(served_or_forward, "forward", served_or_forward)
    last_check = time.monotonic()
    try:
        for line in lines:
            click.echo(line)
        while True:
            time.sleep(0.2)
            errors = fwd.errors if fwd is not None else []
            for e in errors[shown:]:
                err.print(text(("not carried:", "yellow"), f" {e}"), soft_wrap=True)
            shown = len(errors)
            if check is not None and time.monotonic() - last_check > 2:
                last_check = time.monotonic()
                why = check()
                if why:
                    err.print(text(("error:", "bold red"), f" {why}"), soft_wrap=True)
                    sys.exit(3)
    except KeyboardInterrupt:
        click.echo(f"stopped {label}")
    finally:
        served_or_forward.close()


@click.command("port-forward")
@click.argument("cluster")
@click.argument("args", nargs=-1, required=True, metavar="[NODE] PORT[:LOCAL]")
@click.option("--bind", default="127.0.0.1", show_default=True,
              help="The address to listen on here (another than 127.0.0.1 lets other "
                   "machines in).")
def port_forward(cluster, args, bind):
    """Forward PORT of NODE (a name or an index; default the first node that is up) of
    CLUSTER to LOCAL on this machine (default a free port) through the cluster's SSH
    connection, until Ctrl-C. The node's port may listen on its loopback only; no port is
    opened in a firewall."""
    from hypercli.errors import UsageError
    from hypercli.ports import parse_ports, port_forward as forward
    if len(args) > 2:
        raise UsageError("too many arguments", "hyper port-forward CLUSTER [NODE] PORT[:LOCAL]")
    node, spec = (None, args[0]) if len(args) == 1 else args
    remote, local = parse_ports(spec)
    fwd = forward(open_state(), cluster, node, remote, local, bind)
    shown = f"[{bind}]" if ":" in bind else bind
    _hold(fwd, "forwarding", [f"forwarding {shown}:{fwd.port} to port {remote} of "
                              f"{fwd.conn.name} (http://{shown}:{fwd.port}/); Ctrl-C stops"])


def _server_check(served):
    def check():
        return None if served.server.alive() else "the server ended"
    return check


@click.command()
@click.argument("cluster")
@click.argument("node", required=False)
@click.option("--image", help="Run JupyterLab in this container image (it must have it).")
@click.option("--experiment", metavar="WORKFLOW/EXPERIMENT",
              help="Run it in that experiment's image.")
@click.option("--port", "local_port", type=int, default=0, metavar="LOCAL",
              help="The port here (default a free one).")
@click.option("--command", help="Start this server instead (it must print its URL).")
def jupyter(cluster, node, image, experiment, local_port, command):
    """Start JupyterLab on NODE of CLUSTER (default its first node that is up), in the
    node's ~/.hyper/work (each workflow's working folder), and print a URL of this machine
    with its token; until Ctrl-C, which stops the server."""
    from hypercli.ports import experiment_image, jupyter as start
    state = open_state()
    if experiment:
        image = experiment_image(state, experiment)
    served = start(state, cluster, node, image=image, command=command, local_port=local_port)
    _hold(served, "JupyterLab", [f"JupyterLab on {served.where}: {served.url}",
                                 "Ctrl-C stops it"], _server_check(served))


@click.command()
@click.argument("workflow")
@click.option("--port", "local_port", type=int, default=0, metavar="LOCAL",
              help="The port here when it runs on a node (default a free one).")
@click.option("--command", help="Start this server instead ({logdir}: the outputs).")
def tensorboard(workflow, local_port, command):
    """Serve TensorBoard over WORKFLOW's outputs (its tasks' HYPER_OUTPUT folders): on
    this machine when they are here, else on a node of its cluster, forwarded here. Prints
    its URL; until Ctrl-C, which stops it."""
    from hypercli.ports import tensorboard as start
    served = start(open_state(), workflow, command=command, local_port=local_port)
    _hold(served, "TensorBoard", [f"TensorBoard on {served.where}: {served.url}",
                                  "Ctrl-C stops it"], _server_check(served))
