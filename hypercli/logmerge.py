"""A task's stdout and stderr lines in the order they came, rebuilt from its logs.

A node's agent keeps each stream of an attempt exact in its own file (``stdout``,
``stderr``) and, when the task's lines switch from one stream to the other, appends one line
to ``order``: ``o N`` or ``e N``, "the run of stdout (stderr) lines that has just ended ends
at byte N of that file" (:class:`hypercli.node.agent._Pump`). So the records alternate
between the streams, the run after the last record is the other stream's, and no record at
all means one stream had lines alone. :class:`Merger` walks them with a reader of the three
files by offset (a node's agent, or a copy here), yielding each run's bytes to the stream it
came on, so one output can keep ``stdout`` and ``stderr`` apart and still in order.

What it reads is the task's (a task on the node itself can write ``order``): records that
do not parse end the ordering (the rest comes stream by stream); a record never makes a
stream's bytes come twice or go back; nothing held is larger than CHUNK bytes plus one
record.
"""

from __future__ import annotations

from typing import Callable, Iterator

STREAMS = ("stdout", "stderr")
_NAMES = {b"o": "stdout", b"e": "stderr"}
CHUNK = 1 << 20  #: bytes read at a time
RECORD_MAX = 32  #: bytes of one ``order`` line at most ("e " and 20 digits)
#: bytes of a line without its end that a follower shows as they are (as the agent's
#: LINE_MAX, where it counts them as a line in ``order``)
LINE_MAX = 1 << 16

#: reads ``limit`` bytes at ``offset`` (bytes) of one of an attempt's logs (``stdout``,
#: ``stderr``, ``order``): what is there, b"" past its end or when it does not exist
Reader = Callable[[str, int, int], bytes]


def _other(stream: str) -> str:
    return STREAMS[1 - STREAMS.index(stream)]


def _line_end(data: bytes) -> int:
    """Where the last complete line of ``data`` ends (``\\n`` or ``\\r``); all of it when it
    has none and is LINE_MAX bytes or more; else 0."""
    end = max(data.rfind(b"\n"), data.rfind(b"\r")) + 1
    return end if end or len(data) < LINE_MAX else len(data)


class Merger:
    """Yields an attempt's log bytes as (stream, bytes), lines in the order they came.

    ``read``: a :data:`Reader`. Call :meth:`step` once for an attempt that has ended (or
    for a look at what a running one has written so far); to follow a running attempt,
    call ``step(final=False)`` as often as wanted and ``step(final=True)`` once it has
    ended: together they yield every byte once, in order (a follower sees the open run's
    complete lines only, so it never shows a line before one that came earlier).
    """

    def __init__(self, read: Reader):
        self.read = read
        self.pos = dict.fromkeys(STREAMS, 0)  # bytes of each stream yielded
        self.order_at = 0  # bytes of ``order`` read
        self.buf = b""  # a record not ended yet
        self.peeked = b""  # ``order`` bytes read but not parsed yet
        self.last: str | None = None  # the stream of the last record
        self.broken = False  # ``order`` held something that is not a record

    def step(self, final: bool = True) -> Iterator[tuple[str, bytes]]:
        """Yield what can be shown now: with ``final``, everything (the attempt ended);
        else the runs that have ended and the complete lines of the one still open."""
        while True:
            for stream, end in self._records():
                yield from self._emit(stream, end)
                self.last = stream
            if final:
                first = _other(self.last) if self.last else self._first()
                yield from self._emit(first)
                yield from self._emit(_other(first))
                return
            open_ = [_other(self.last)] if self.last else list(STREAMS)
            got = {s: self.read(s, self.pos[s], CHUNK) for s in open_}
            if not self.broken:
                self.peeked = self.read("order", self.order_at, CHUNK)
                if self.peeked:  # a switch came while reading: its records come first
                    continue
            ends = {s: _line_end(d) for s, d in got.items() if _line_end(d)}
            if len(ends) != 1:  # no line yet, or both streams' lines and a record on its way
                return
            [(s, end)] = ends.items()
            self.pos[s] += end
            yield s, got[s][:end]
            if len(got[s]) < CHUNK:
                return

    def _records(self) -> Iterator[tuple[str, int]]:
        """The records of ``order`` not read yet, chunk by chunk."""
        while not self.broken:
            data, self.peeked = self.peeked or self.read("order", self.order_at, CHUNK), b""
            if not data:
                return
            self.order_at += len(data)
            *lines, self.buf = (self.buf + data).split(b"\n")
            for line in lines:
                kind, _, n = line.partition(b" ")
                if kind not in _NAMES or not n.isdigit() or len(n) > 20:
                    self.broken = True
                    return
                yield _NAMES[kind], int(n)
            if len(self.buf) > RECORD_MAX:
                self.broken = True
            if len(data) < CHUNK:
                return

    def _emit(self, stream: str, end: int | None = None) -> Iterator[tuple[str, bytes]]:
        """Yield ``stream`` from where it was left up to byte ``end`` (None: its end); a
        record pointing back yields nothing."""
        while end is None or self.pos[stream] < end:
            limit = CHUNK if end is None else min(CHUNK, end - self.pos[stream])
            data = self.read(stream, self.pos[stream], limit)
            if not data:
                break
            self.pos[stream] += len(data)
            yield stream, data
        if end is not None:  # (past the file's end: only a record the task wrote)
            self.pos[stream] = max(self.pos[stream], end)

    def _first(self) -> str:
        """With no record, the stream whose lines came: stderr when only it has a line."""
        if _line_end(self.read("stdout", self.pos["stdout"], LINE_MAX)):
            return "stdout"
        return "stderr" if _line_end(self.read("stderr", self.pos["stderr"], LINE_MAX)) \
            else "stdout"
