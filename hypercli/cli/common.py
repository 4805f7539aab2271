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
    detached workflow whose driver died (:func:`hypercli.driver.ensure`), unless the file
    could only be opened read-only (then a note says why on stderr, once)."""
    from hypercli.driver import ensure
    from hypercli.state import State, open_to_others
    state = State()
    mode = open_to_others(state.path.parent)
    if mode is not None:
        where = state.path.parent
        _note_once(f"{where} (HYPER_HOME) has mode {mode:04o}: other users of this machine "
                   f"can read the logs, outputs and state kept there; `chmod 700 {where}` "
                   "makes it private", "warning:")
    if state.readonly:
        _note_once(f"the state file is read-only here ({state.readonly}): showing what it "
                   "holds; nothing is changed or started")
    else:
        ensure(state)  # detached workflows with no driver alive: start one
    return state


_noted: set = set()


def _note_once(line: str, label: str = "note:") -> None:
    """Print a note (or a warning) on stderr, once per process."""
    if line not in _noted:
        _noted.add(line)
        style = "yellow" if label == "warning:" else "dim"
        console(stderr=True).print(text((label, style), f" {line}"), soft_wrap=True)


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
