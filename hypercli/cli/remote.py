"""``hyper exec``, ``hyper ssh`` and ``hyper ssh-config``: ad-hoc work on a cluster's nodes
(:mod:`hypercli.remote`).

Thin click commands: parse, call one function of :mod:`hypercli.remote`, render. HyperErrors
are left to the ``hyper`` group in ``hypercli.cli``, which turns them into a message and an
exit code (2: unknown cluster or node; 3: no node up, no ``ssh`` client).
"""

from __future__ import annotations

import os
import sys

import click

from hypercli.cli.common import open_state


@click.command("exec")
@click.argument("cluster")
@click.argument("command", nargs=-1, required=True)
@click.option("--node", "nodes", multiple=True, metavar="NODE",
              help="Only this node: a name or an index from `hyper status` (repeat for more).")
def exec_(cluster, command, nodes):
    """Run COMMAND on every node of CLUSTER at once (or on --node), streaming each line as
    it comes, prefixed with its node's name: stdout to stdout, stderr to stderr.

    Put COMMAND after `--`. One argument is a shell line as it is
    (`hyper exec lab -- 'nvidia-smi | head -5'`); several are quoted word by word. It runs
    in the login folder of SSH and cloud nodes, with HYPER_NODE set to the node's name; on
    a local cluster it runs on this machine once per node, in the current folder, in the
    node's view (HYPER_NODE, its share of the GPUs in CUDA_VISIBLE_DEVICES).

    Exits with the worst node's exit code; a node that cannot be reached counts as 255 and
    is reported, the others go on. Nodes that are not up are skipped with a note.
    """
    from hypercli.remote import command_line, exec_on
    out, err = sys.stdout.buffer, sys.stderr.buffer

    def on_line(node: str, stream: str, line: bytes) -> None:
        f = out if stream == "stdout" else err
        f.write(node.encode() + b" | " + line + b"\n")
        f.flush()

    def on_note(node: str, kind: str, text: str) -> None:
        label = {"error": "unreachable: ", "skipped": "", "exit": ""}.get(kind, "")
        err.write(f"{node} | hyper: {label}{text}\n".encode())
        err.flush()

    try:
        result = exec_on(open_state(), cluster, command_line(command), nodes=nodes,
                         on_line=on_line, on_note=on_note)
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:  # `hyper exec ... | head`: the reader has gone
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    sys.exit(result.exit_code)


class _TrailingCommand(click.Command):
    """A command whose arguments after the first ``--`` are a remote command, kept apart
    from its optional positional arguments (``hyper ssh CLUSTER -- uptime`` has no NODE)."""

    def parse_args(self, ctx, args):
        if "--" in args:
            i = args.index("--")
            ctx.meta["remote_command"] = args[i + 1:]
            args = args[:i]
        return super().parse_args(ctx, args)

    def collect_usage_pieces(self, ctx):
        return super().collect_usage_pieces(ctx) + ["[-- COMMAND...]"]


@click.command(cls=_TrailingCommand)
@click.argument("cluster")
@click.argument("node", required=False)
@click.pass_context
def ssh(ctx, cluster, node):
    """Open a shell on NODE of CLUSTER (a name or an index; default: its first node that is
    up) with the system `ssh` client, in this terminal; after `--`, run COMMAND there
    instead. The node's key is used, and its host key is pinned: a host that shows another
    key is refused.
    """
    from hypercli.remote import command_line, ssh_argv
    rest = ctx.meta.get("remote_command")
    argv = ssh_argv(open_state(), cluster, node, command_line(rest) if rest else None)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvp(argv[0], argv)
    except OSError as e:
        from hypercli.errors import InfraError
        raise InfraError(f"cannot start {argv[0]}: {e.strerror or e}",
                         "install OpenSSH's client (apt-get install openssh-client)") from None


@click.command("ssh-config")
@click.argument("cluster")
def ssh_config(cluster):
    """Print OpenSSH `Host` blocks for the nodes of CLUSTER, so `ssh`, `scp`, `rsync` and
    editors reach them by node name with the pinned host keys (a known_hosts file of the
    cluster's own under $HYPER_HOME, StrictHostKeyChecking yes).

    Use it as `hyper ssh-config lab > ~/.ssh/hyper-lab.conf` and `Include hyper-lab.conf`
    at the top of ~/.ssh/config, or `ssh -F FILE`.
    """
    from hypercli.remote import ssh_config as config
    click.echo(config(open_state(), cluster), nl=False)
