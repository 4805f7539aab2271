"""The state folder inside a workdir (``HYPER_HOME=$PWD/state`` in a CI job): copying the
workdir to SSH nodes must not read the state file. Reading it in the driver drops the driver's
POSIX locks on it, and the next process to close a connection deletes the WAL the driver still
writes to: every later result was lost (seen as a run that printed "6/6 done" with its attempts
left ``launching`` in the state file)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hypercli.workdir import build
from hypercli.state import State, home

CLOSE_ELSEWHERE = ("import sqlite3, sys; db = sqlite3.connect(sys.argv[1]); "
                   "db.execute('SELECT COUNT(*) FROM clusters').fetchone(); db.close()")


def _wal_deleted() -> bool:
    """True when this process holds the state file's WAL open after it was unlinked."""
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if "state.db-wal" in target and target.endswith("(deleted)"):
            return True
    return False


def _committed_elsewhere(path: Path, name: str) -> bool:
    out = subprocess.run([sys.executable, "-c",
                          "import sqlite3, sys; print(sqlite3.connect(sys.argv[1]).execute("
                          "'SELECT COUNT(*) FROM clusters WHERE name=?', (sys.argv[2],))"
                          ".fetchone()[0])", str(path), name],
                         capture_output=True, text=True, check=True)
    return out.stdout.strip() == "1"


@pytest.mark.parametrize("skip_state", [True, False], ids=["state-skipped", "state-read"])
def test_workdir_copy_leaves_the_state_file_alone(tmp_path, monkeypatch, skip_state):
    work = tmp_path / "project"
    (work / "src").mkdir(parents=True)
    (work / "src" / "train.py").write_text("print('hi')\n")
    monkeypatch.setenv("HYPER_HOME", str(work / "state"))
    st = State()
    try:
        st.put_cluster("first", "local", {})
        m = build(work, skip=home() if skip_state else None)
        names = [e[0] for e in m.entries]
        assert "src/train.py" in names
        # another process (hyper ps, the dashboard) opens and closes the state file
        subprocess.run([sys.executable, "-c", CLOSE_ELSEWHERE, str(st.path)], check=True)
        st.put_cluster("second", "local", {})
        if skip_state:
            assert not any(n.startswith("state") for n in names)
            assert not _wal_deleted()
            assert _committed_elsewhere(st.path, "second")
        else:  # the fault this guards against, injected: reading the file in this process
            assert "state/state.db" in names
            assert _wal_deleted() and not _committed_elsewhere(st.path, "second")
    finally:
        st.close()
