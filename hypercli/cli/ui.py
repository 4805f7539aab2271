"""``hyper ui``: the read-only dashboard (:mod:`hypercli.ui`), an optional extra.

Thin click command: check the extra is installed, then serve. Nothing of the dashboard is
imported before the command runs (``hyper --help`` stays fast).
"""

from __future__ import annotations

import click

from hypercli.errors import UsageError


@click.command("ui")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; anything but loopback lets others on the network "
                   "reach it (they still need the token).")
@click.option("--port", default=0, type=click.IntRange(0, 65535),
              help="Port to listen on (default: a free one).")
def ui(host, port):
    """Serve a read-only dashboard of workflows, tasks, logs, utilisation and results.

    It prints a URL with a random token; open it in a browser. Ctrl-C stops it.
    """
    try:
        import plotly  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise UsageError(f"the dashboard needs {e.name}", "pip install 'hypercli[ui]'") from None
    from hypercli.ui.app import serve

    def announce(url: str) -> None:
        click.echo(f"hyper ui: serving the dashboard (read-only) at\n    {url}", err=False)
        click.echo("press Ctrl-C to stop", err=True)
    serve(host=host, port=port, announce=lambda url: (announce(url), _flush()))


def _flush() -> None:
    import sys
    sys.stdout.flush()
