"""How hypercli prints: the rich console every command prints through (one place for its
settings), user text made safe to show, and JSON that stays JSON.

Rules:
  * Text from recipes, tasks, logs and nodes (a parameter value, a metric key, a command, a
    log line, an error's reason) is never console markup: the console has markup and emoji
    codes off, so ``[/]`` cannot crash a command and ``[link=…]`` cannot make a live
    hyperlink. Styled words of hypercli's own are built with :func:`text` from
    ``(words, style)`` pairs; plain parts are shown as they are.
  * Control characters of user text (an escape sequence that would drive the terminal) are
    shown escaped (``\\x1b``) by :func:`shown`; newlines and tabs stay.
  * JSON output is valid JSON (RFC 8259 has no NaN or Infinity): a non-finite number, as a
    diverged loss reports it, is written as the string ``"NaN"``, ``"Infinity"`` or
    ``"-Infinity"`` (:func:`jsonable`), the spellings Python's ``float()`` and JavaScript's
    ``Number()`` read back.
"""

from __future__ import annotations

import json
import math
import os
import re

#: C0 controls but tab and newline, DEL, and C1 controls (CSI, OSC ... as one byte)
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def console(stderr: bool = False):
    """A rich Console for stdout (or stderr) that reads no markup and no emoji codes in what
    it prints (module docstring). Not a terminal (logs, CI): 160 columns unless ``COLUMNS``
    says otherwise, so tables stay on one line instead of folding."""
    from rich.console import Console
    con = Console(stderr=stderr, highlight=False, markup=False, emoji=False)
    if not con.is_terminal and "COLUMNS" not in os.environ:
        con.width = 160
    return con


def shown(value) -> str:
    """``str(value)`` with its control characters (but newline and tab) escaped as
    ``\\xNN``, so a terminal shows them instead of obeying them."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", str(value))


def text(*parts):
    """A rich ``Text`` from ``parts``: each a plain string (user text allowed: shown as it
    is, control characters escaped) or a ``(words, style)`` pair of hypercli's own, such as
    ``("error:", "bold red")``."""
    from rich.text import Text
    out = Text()
    for p in parts:
        if isinstance(p, tuple):
            out.append(shown(p[0]), style=p[1])
        else:
            out.append(shown(p))
    return out


def jsonable(value):
    """``value`` (dicts, lists, tuples, scalars) with every non-finite float replaced by
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (module docstring); other values as
    they are."""
    if isinstance(value, float) and not math.isfinite(value):
        return "NaN" if value != value else ("Infinity" if value > 0 else "-Infinity")
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def dumps(value, **kw) -> str:
    """``json.dumps`` of :func:`jsonable` ``(value)``: always valid JSON (``allow_nan`` is
    off, so a non-finite number that escaped the conversion is an error, not bad output);
    anything JSON cannot hold is written as its ``str``. ``kw`` as for ``json.dumps``."""
    kw.setdefault("default", str)
    return json.dumps(jsonable(value), allow_nan=False, **kw)


def plural(n: int, word: str, many: str | None = None) -> str:
    """``1 task``, ``2 tasks``: a count and its noun, plural unless the count is 1 (``many``
    for nouns whose plural is not ``word + "s"``)."""
    return f"{n:,} {word if n == 1 else many or word + 's'}"
