"""The background driver: runs that go on without the terminal (``hyper run -d``).

One process per ``$HYPER_HOME`` (``python -m hypercli.driver``), started on demand in a
session of its own, so closing the terminal, or the SSH session to a laptop, does not stop
it. It holds an flock on ``$HYPER_HOME/locks/driver.lock`` (its pid is in that file), and logs
to ``$HYPER_HOME/driver.log``. It drives every *detached* workflow that is running and that no
foreground ``hyper run`` drives (the workflow's own lock tells), each in a thread of its own
with a :class:`~hypercli.scheduler.Scheduler`, which re-attaches to running attempts as a
resumed ``hyper run`` does. It exits when it has had nothing to drive for IDLE_EXIT seconds.

Rules:
  * A workflow is detached by ``hyper run -d`` / ``--wait``, or when a foreground ``hyper run``
    is left (Ctrl-C → leave, SIGTERM): it hands the workflow over instead of abandoning it.
  * Any ``hyper`` command that opens the state file starts the driver again when detached
    workflows are running and no driver is alive (:func:`ensure`).
  * A workflow with a secret its environment lacks is not driven (it stays detached): a
    driver gets the secrets in the environment of the command that starts it, and
    :func:`ensure` starts none that would lack them (``hypercli/envvars.py``).
  * SIGTERM to the driver leaves every task running (a later driver re-attaches); a workflow
    whose run fails with an infrastructure error is no longer driven (``detached`` cleared, the
    error in its events) until ``hyper run`` or ``hyper run -d`` takes it again.
"""

from __future__ import annotations

import fcntl
import logging
import os
import signal
import subprocess
import sys
import threading
import time

from hypercli import state as S
from hypercli.errors import HyperError, UsageError
from hypercli.locks import Lock, driver_lock_path, driver_pid

IDLE_EXIT = 2.0  # s with nothing to drive before the driver exits
LOOK_EVERY = 0.5  # s between looks for new detached workflows

log = logging.getLogger("hypercli.driver")


def start() -> int:
    """Start a driver process in a session of its own; returns its pid (it exits at once,
    harmlessly, when another driver won the race). Its environment is this process's, with
    the secrets this process holds (``--env-file`` values, :func:`hypercli.envvars.
    remembered`) added: in the environment, never on its command line or in a file."""
    from hypercli.envvars import held
    env = {**os.environ, **held()}
    out = open(S.home() / "driver.log", "ab")
    try:
        p = subprocess.Popen([sys.executable, "-m", "hypercli.driver"], stdin=subprocess.DEVNULL,
                             stdout=out, stderr=out, start_new_session=True, close_fds=True,
                             env=env)
    finally:
        out.close()
    return p.pid


def ensure(state: S.State) -> int | None:
    """Start the driver when detached workflows are running and none is alive; returns the
    live (or new) driver's pid, or None when there is nothing to drive (or nothing this
    process's environment has every secret of)."""
    from hypercli.envvars import available
    detached = state.detached_workflows()
    if not detached:
        return None
    pid = driver_pid()
    if pid or not any(available(state.workflow(w)) for w in detached):
        return pid  # a driver started here would lack a secret of each: left for later
    return start()


def detach(state: S.State, wid: str) -> int:
    """Hand a workflow to the background driver (started if need be); returns its pid.

    Raises:
        UsageError: a driver is alive whose environment lacks a secret of the workflow that
            this process holds (it could not drive it; secrets are never written anywhere it
            could read them from).
    """
    from hypercli.envvars import lacking, remembered
    pid = driver_pid()
    missing = lacking(pid, remembered(wid)) if pid else []
    if missing:
        raise UsageError(f"the background driver (pid {pid}) was started without the "
                         f"secret {missing[0]} of {wid}, so it cannot drive it",
                         f"export {missing[0]}=... and `hyper run` it again once the driver "
                         "has ended, or run it in the foreground")
    state.set_workflow(wid, detached=1)
    return pid or start()


class _Drive(threading.Thread):
    """Drives one workflow to its end in this process (one state connection of its own)."""

    def __init__(self, wid: str, lock):
        super().__init__(name=f"drive-{wid}", daemon=True)
        self.wid, self.lock, self.scheduler = wid, lock, None
        self.stopping = False

    def stop(self) -> None:
        self.stopping = True
        if self.scheduler is not None:
            self.scheduler.stop()

    def run(self) -> None:
        from hypercli.cluster import provider_of
        from hypercli.scheduler import Scheduler
        state = S.State()
        try:
            wf = state.workflow(self.wid)
            provider = provider_of(state, wf["cluster"])
            nodes = state.nodes(wf["cluster"], status="up")
            self.scheduler = Scheduler(state, self.wid, provider, nodes)
            if self.stopping:
                return
            log.info("driving %s on %d nodes of %s", self.wid, len(nodes), wf["cluster"])
            summary = self.scheduler.run()
            log.info("%s: %s%s", self.wid, summary.counts,
                     " (left running)" if summary.interrupted == "leave" else "")
            if summary.interrupted != "leave":  # a controller's backups, if taken over
                from hypercli.controller.client import drop_backups
                drop_backups(state, self.wid)
        except HyperError as e:
            log.error("%s: %s", self.wid, e)
            state.event("workflow", f"background driver stopped driving it: {e}",
                        workflow=self.wid)
            state.set_workflow(self.wid, detached=0, driver_pid=None)
        except Exception:  # a bug must not take the other workflows down
            log.exception("%s: driver thread failed", self.wid)
            state.set_workflow(self.wid, detached=0, driver_pid=None)
        finally:
            self.lock.release()
            state.close()


def serve() -> int:
    """The driver's main loop (see the module docstring). Returns the exit status."""
    fd = os.open(driver_lock_path(), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return 0  # another driver is alive
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s driver[%(process)d] %(message)s")
    stopping = []
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: stopping.append(signum))
    log.info("started for %s", S.home())
    from hypercli.envvars import available
    state = S.State()
    drives: dict[str, _Drive] = {}
    lacks: set[str] = set()  # workflows not driven for a secret not set here
    idle = time.monotonic()
    try:
        while not stopping:
            for wid in state.detached_workflows():
                if wid in drives and drives[wid].is_alive():
                    continue
                if not available(state.workflow(wid)):  # stays detached for a later driver
                    if wid not in lacks:
                        lacks.add(wid)
                        log.info("%s: not driven, a secret of it is not set here", wid)
                    continue
                try:
                    lock = Lock(wid).acquire()
                except HyperError:  # a foreground `hyper run` drives it
                    continue
                drives[wid] = _Drive(wid, lock)
                drives[wid].start()
            drives = {w: d for w, d in drives.items() if d.is_alive()}
            if drives:
                idle = time.monotonic()
            elif time.monotonic() - idle > IDLE_EXIT:
                break
            time.sleep(LOOK_EVERY)
    finally:
        for d in drives.values():
            d.stop()
        for d in drives.values():
            d.join(timeout=30)
        log.info("exiting (%s)", "signal" if stopping else "nothing left to drive")
        state.close()
        os.close(fd)
    return 0


if __name__ == "__main__":
    sys.exit(serve())
