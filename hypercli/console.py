"""The rich console every command prints through (one place for its settings)."""

from __future__ import annotations

import os


def console(stderr: bool = False):
    """A rich Console for stdout (or stderr). Not a terminal (logs, CI): 160 columns unless
    ``COLUMNS`` says otherwise, so tables stay on one line instead of folding."""
    from rich.console import Console
    con = Console(stderr=stderr, highlight=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con.width = 160
    return con
