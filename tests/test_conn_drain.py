"""Reading a command's output to its end over SSH (``hypercli.ssh.conn._drain``) when the
exit status arrives before the last of the output: SSH does not flow-control the exit status,
so a large stream can still be in flight (a 300 kB tar stream was once cut short that way).
The channel here is scripted, since a real sshd cannot be made to reorder on demand: it hands
out its output in chunks over time and reports the exit status from the start."""

from __future__ import annotations

import time

from hypercli.ssh import conn


class ScriptedChannel:
    """paramiko.Channel's reading side: ``chunks`` of stdout arrive one per ``every`` s;
    ``eof`` says whether EOF follows the last one (False: a background process holds the
    output open); the exit status is ready at once."""

    def __init__(self, chunks: list[bytes], every: float, eof: bool = True):
        self.chunks, self.every, self.eof = list(chunks), every, eof
        self.t0 = time.monotonic()
        self.given = 0
        self.closed = False

    def _arrived(self) -> int:
        return min(len(self.chunks), int((time.monotonic() - self.t0) / self.every) + 1)

    def recv_ready(self) -> bool:
        return self.given < self._arrived()

    def recv(self, n: int) -> bytes:
        self.given += 1
        return self.chunks[self.given - 1]

    def recv_stderr_ready(self) -> bool:
        return False

    def exit_status_ready(self) -> bool:
        return True

    @property
    def eof_received(self) -> bool:
        return self.eof and self.given == len(self.chunks)


def test_output_after_the_exit_status_is_read_to_eof():
    chunks = [bytes([i]) * 1000 for i in range(10)]
    out, err = conn._drain(ScriptedChannel(chunks, every=0.05), timeout=10)
    assert out == b"".join(chunks) and err == b""  # not only what came before the status


def test_output_held_open_after_exit_ends_the_read_after_the_grace(monkeypatch):
    monkeypatch.setattr(conn, "EXIT_GRACE", 0.3)
    t0 = time.monotonic()
    out, _ = conn._drain(ScriptedChannel([b"a", b"b"], every=0.05, eof=False), timeout=10)
    assert out == b"ab" and 0.3 <= time.monotonic() - t0 < 3
