"""What every ``hyper`` command shares: the state file it opens, the console it prints
through, and the small formatters of times, durations and values.

Nothing here knows a command; the command modules import from here, never from each other.
"""

from __future__ import annotations

import time

import click

from hypercli.console import console, dumps, plural, shown, text  # noqa: F401  (re-exported)


def open_state():
    """The state file (``$HYPER_HOME/state.db``), with a background driver started for any
    detached workflow whose driver died (:func:`hypercli.driver.ensure`)."""
    from hypercli.driver import ensure
    from hypercli.state import State
    state = State()
    ensure(state)  # detached workflows with no driver alive: start one
    return state


def print_json(obj, **kw) -> None:
    """Print ``obj`` as indented, valid JSON: non-finite numbers as the strings ``"NaN"``,
    ``"Infinity"``, ``"-Infinity"``, anything else JSON cannot hold as its ``str``
    (:func:`hypercli.console.dumps`; ``kw`` such as ``sort_keys``)."""
    click.echo(dumps(obj, indent=2, ensure_ascii=False, **kw))


def fmt(v) -> str:
    """A value for a table cell: floats with 4 significant digits."""
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def ago(t: float | None) -> str:
    """How long ago unix time ``t`` (s) was: ``42s ago``, ``3m ago``, ``2.5h ago``; ``-``."""
    if not t:
        return "-"
    s = time.time() - t
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else \
        f"{s / 3600:.1f}h ago"


def duration(s: float | None) -> str:
    """``-``, ``4.2s``, ``42s``, ``3m05s``, ``2h07m``."""
    if s is None:
        return "-"
    if s < 10:
        return f"{s:.1f}s"
    s = int(s)
    return f"{s}s" if s < 60 else f"{s // 60}m{s % 60:02d}s" if s < 3600 else \
        f"{s // 3600}h{s % 3600 // 60:02d}m"


def when(t: float) -> str:
    """A time of day (with the date when not today) and how long ago."""
    fmt_ = "%H:%M:%S" if time.localtime(t)[:3] == time.localtime()[:3] else "%Y-%m-%d %H:%M:%S"
    return f"{time.strftime(fmt_, time.localtime(t))} ({ago(t)})"
