"""The one error hierarchy of hypercli.

Every error a user can cause or meet is a :class:`HyperError`. It carries the process exit
code the CLI should end with and an optional hint that tells the user what to do. Only
``hypercli.cli`` turns these into messages; library code raises, never prints.

Exit codes (documented in docs/cli.md, "Exit codes"):
    0  every task succeeded
    1  some task failed or was skipped
    2  bad input: recipe, arguments, unknown workflow or task
    3  infrastructure: a node, host, provider or the state file failed
"""

from __future__ import annotations


class HyperError(Exception):
    """Root of every hypercli error.

    Args:
        message: what went wrong, one sentence, naming the thing at fault.
        hint: optional next step for the user ("run `hyper status` to ...").
    Attributes:
        exit_code: the CLI's exit status for this error (see the module docstring).
    """

    exit_code = 3

    def __init__(self, message: str, hint: str | None = None):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return self.message


class UsageError(HyperError):
    """Bad input from the command line: unknown workflow, task, cluster, bad option value."""

    exit_code = 2


class RecipeError(UsageError):
    """A recipe file that cannot be used.

    Args:
        message: what is wrong with the field.
        path: the recipe file (str), or None for a recipe given as text.
        line: 1-based line of the offending field, or None when unknown.
        field: dotted field path such as ``experiments.search.samples``, or None.
        hint: optional fix, e.g. "did you mean 'samples'?".
    The string form is ``FILE:LINE: FIELD: MESSAGE (HINT)`` with absent parts left out.
    """

    def __init__(self, message: str, *, path: str | None = None, line: int | None = None,
                 field: str | None = None, hint: str | None = None):
        self.path, self.line, self.field = path, line, field
        where = ""
        if path:
            where = f"{path}:{line}: " if line else f"{path}: "
        elif line:
            where = f"line {line}: "
        text = f"{where}{field + ': ' if field else ''}{message}"
        if hint:
            text += f" ({hint})"
        super().__init__(text, None)
        self.reason = message
        self.suggestion = hint


class StateError(HyperError):
    """The state file cannot be opened, migrated or written (exit code 3)."""


class InfraError(HyperError):
    """A node, host or provider failed (exit code 3)."""


class NodeError(InfraError):
    """A node could not be reached or its agent failed.

    Args:
        node: the node's name.
        message: what failed.
    """

    def __init__(self, node: str, message: str, hint: str | None = None):
        super().__init__(f"node {node}: {message}", hint)
        self.node = node


def os_reason(e: OSError, where: str | None = None) -> str:
    """A short reason for a failed file operation, naming the path: ``no space left on
    /data`` (ENOSPC, EDQUOT), ``/data is on a read-only file system`` (EROFS), else
    ``/data/x: Permission denied``. ``where`` names the path when the error has none (a
    write's ENOSPC carries no file name)."""
    import errno
    path = e.filename if e.filename is not None else where
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return f"no space left on {path}" if path else "no space left on the device"
    if e.errno == errno.EROFS:
        return f"{path} is on a read-only file system" if path else "read-only file system"
    return f"{path}: {e.strerror or e}" if path else str(e.strerror or e)
