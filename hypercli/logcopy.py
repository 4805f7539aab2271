"""The local copy of a running attempt's logs, kept up to date while it runs on a remote node.

A node's thread (:class:`hypercli.scheduler.NodeWorker`) of a node that keeps its logs there
(an SSH host, a cloud VM) calls :func:`pull` about every STREAM_EVERY s with the ids of the
attempts it watches: what each wrote since the last look is read by offset (the agent's
``read``, one request per log) and appended to ``$HYPER_HOME/logs/<attempt id>/stdout``,
``stderr`` and ``order`` (read first, once both streams have something: each of its records
is then of lines copied by the same look, :mod:`hypercli.logmerge`), the copy ``hyper logs``
falls back to when the node cannot be reached. The offset is the copy's own size, so a
``hyper run`` that was restarted goes on where the last one stopped. ``streamed.json`` beside them records when the last look was and how many bytes the
node had then that were not copied yet, so a reader of the copy of a lost attempt is told how
much may be missing (:func:`note`). When the attempt ends and its node answers, its whole logs
replace the copy (the provider's session, ``after_end``).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from hypercli import state as S

#: s between two looks at the logs of a node's running attempts: at most about this much of
#: what a rank wrote is missing from the copy when its node is lost without warning
STREAM_EVERY = 1.0
READ_LIMIT = 1 << 20  #: bytes read per stream and look at most (a chatty task catches up)
MARK = "streamed.json"


def copy_dir(attempt_id: str) -> Path:
    """``$HYPER_HOME/logs/<attempt id>``: where an attempt's logs are kept here."""
    return S.folder("logs") / attempt_id


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except FileNotFoundError:
        return 0


def pull(client, ids: list[str]) -> None:
    """Append to the local copy of each attempt in ``ids`` what it wrote since the last look.

    Args:
        client: the node's :class:`~hypercli.node.client.AgentClient`.
        ids: attempt ids running on that node.
    Raises:
        NodeError: the node did not answer (the caller treats it as for any other request).
    """
    for aid in ids:
        d = copy_dir(aid)
        mark = {"at": None, "behind": 0}
        # ``order`` first, and only once both streams have something (it has no record
        # before): one request less per look for a task that writes one stream
        both = _size(d / "stdout") and _size(d / "stderr")
        for stream in ("order", "stdout", "stderr") if both else ("stdout", "stderr"):
            path = d / stream
            offset = _size(path)
            r = client.read(aid, stream, offset, READ_LIMIT)
            if r["data"]:
                d.mkdir(exist_ok=True, mode=0o700)
                fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW
                             | os.O_CLOEXEC, 0o600)
                try:
                    os.write(fd, r["data"])
                finally:
                    os.close(fd)
            if stream != "order":
                mark["behind"] += max(0, int(r.get("size") or 0) - r["offset"])
        if not d.is_dir():  # nothing written yet: nothing to keep
            continue
        mark["at"] = time.time()
        tmp = d / f".{MARK}.tmp"
        tmp.write_text(json.dumps(mark))
        os.replace(tmp, d / MARK)


def note(attempt: dict) -> str | None:
    """What a reader of a lost attempt's copy should know: when it was last brought up to date,
    and so how much of its logs may be missing; None when the copy is complete (the attempt
    ended and its logs were brought back) or was never streamed.

    Args:
        attempt: an ``attempts`` row (``id``, ``status``, ``node``, ``ended_at``).
    """
    try:
        mark = json.loads((copy_dir(attempt["id"]) / MARK).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(mark, dict) or not isinstance(mark.get("at"), (int, float)):
        return None
    at = mark["at"]
    when = time.strftime("%H:%M:%S", time.localtime(at))
    behind = int(mark.get("behind") or 0)
    lag = ""
    if attempt.get("ended_at") and attempt["ended_at"] >= at:
        lag = f", {attempt['ended_at'] - at:.1f} s before it was declared lost"
    more = f" and {behind} bytes it had written were not copied yet" if behind else ""
    return (f"node {attempt['node']} cannot be reached: this is the copy kept here while the "
            f"attempt ran, last brought up to date at {when}{lag}{more}; what it wrote after "
            "that is missing")


def complete(ids) -> None:
    """The whole logs of these attempts were brought back: their copies are complete (the
    record of the last look goes)."""
    for aid in ids:
        try:
            os.unlink(copy_dir(aid) / MARK)
        except FileNotFoundError:
            pass
