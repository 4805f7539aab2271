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


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 task``, ``2 tasks``: a count and its noun, plural unless the count is 1 (``many``
    for nouns whose plural is not ``word + "s"``)."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
