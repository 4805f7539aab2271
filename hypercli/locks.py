"""Who drives a workflow: exclusive flocks under ``$HYPER_HOME/locks``.

A workflow is driven by one process at a time (a ``hyper run``, or the background driver's
thread): it holds ``locks/<workflow>.lock``. The background driver holds ``locks/driver.lock``.
Each lock file holds its holder's pid as text; a lock is believed by its flock, never by the
pid (the kernel releases an flock when its process dies, even by SIGKILL, and reuses pids).
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from hypercli import state as S
from hypercli.errors import UsageError


def lock_folder() -> Path:
    """``$HYPER_HOME/locks`` (made 0700 when missing)."""
    d = S.home() / "locks"
    d.mkdir(exist_ok=True, mode=0o700)
    return d


class Driven(UsageError):
    """A workflow is driven by another process (a ``hyper run``, or the background driver).

    Attributes:
        workflow: its id; pid: the driving process's pid (text, "?" when unknown).
    """

    def __init__(self, workflow: str, pid: str):
        super().__init__(f"{workflow} is being run by another `hyper run` (pid {pid})",
                         f"`hyper attach {workflow}` shows its progress; wait for it, or stop "
                         "it first")
        self.workflow, self.pid = workflow, pid


class Lock:
    """An exclusive flock on ``$HYPER_HOME/locks/<name>.lock``; the holder's pid is inside.

    Raises (from acquire):
        Driven: another live process holds it (its pid is in the message).
    """

    def __init__(self, name: str):
        self.path = lock_folder() / f"{name}.lock"
        self.fd = None

    def acquire(self) -> "Lock":
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise Driven(self.path.stem, pid) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self.fd = fd
        return self

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def driver_lock_path() -> Path:
    """The background driver's lock file."""
    return lock_folder() / "driver.lock"


def driver_pid() -> int | None:
    """The pid of the live background driver of this ``$HYPER_HOME``, or None (tested with
    its flock, not by trusting the pid; -1 when it holds the lock but wrote no pid yet). A
    lock folder that cannot be written is read as it is (a read-only ``$HYPER_HOME``)."""
    try:
        fd = os.open(driver_lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        try:  # an flock needs no write access
            fd = os.open(S.home() / "locks" / "driver.lock", os.O_RDONLY)
        except FileNotFoundError:
            return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        return int(text) if text.isdigit() else -1
    os.close(fd)  # nobody holds it: no driver
    return None
