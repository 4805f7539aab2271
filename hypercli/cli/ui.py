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

    It prints a URL with a random token; open it in a browser. Ctrl-C stops it. Workflows
    that controllers drive are copied from them every few seconds while it serves.
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
    stop = _from_controllers()
    try:
        serve(host=host, port=port, announce=lambda url: (announce(url), _flush()))
    finally:
        stop()


#: s between copies of the records of workflows that controllers drive, while serving
CONTROLLER_EVERY = 3.0


def _from_controllers():
    """Copy the records and samples of the workflows controllers drive here every
    CONTROLLER_EVERY s, in a thread, over one connection per controller (the dashboard's
    pages read the state file only); returns the function that stops it."""
    import threading

    from hypercli.cli.tasks import _from_controller
    from hypercli.state import State
    stopping = threading.Event()
    said: set = set()

    def note(line: str) -> None:
        if line not in said:
            said.add(line)
            click.echo(f"note: {line}", err=True)

    def run() -> None:
        conns: dict = {}
        try:
            while True:
                try:
                    state = State()
                    try:
                        _from_controller(state, usage=True, conns=conns, note=note)
                    finally:
                        state.close()
                except Exception as e:  # the dashboard goes on with what is here
                    note(f"copying from controllers: {e}")
                if stopping.wait(CONTROLLER_EVERY):
                    return
        finally:
            for c in conns.values():
                c.close()
    t = threading.Thread(target=run, name="from-controllers", daemon=True)
    t.start()

    def stop() -> None:
        stopping.set()
        t.join(timeout=10)
    return stop


def _flush() -> None:
    import sys
    sys.stdout.flush()
