"""The `hyper` entry point as a real subprocess: the quick start, errors, exit codes."""

from __future__ import annotations

import json
import os
import sqlite3
import stat

import yaml

from conftest import ROOT
from hypercli.errors import StateError
from hypercli.state import State


def small_quickstart(tmp_path, samples=4):
    recipe = yaml.safe_load((ROOT / "recipes" / "quickstart.yaml").read_text())
    recipe["experiments"]["search"]["samples"] = samples
    recipe["workdir"] = str(ROOT / "recipes")
    recipe["cluster"]["workers"] = 2
    path = tmp_path / "quickstart.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def test_quickstart_through_the_entry_point(hyper, hyper_home, tmp_path):
    path = small_quickstart(tmp_path)
    plan = json.loads(hyper("plan", path, "--json", check=True).stdout)
    assert [t["task"] for t in plan] == [f"search-000{i}" for i in range(4)] + ["report-0000"]
    r = hyper("run", path, timeout=170)
    assert r.returncode == 0, r.stdout + r.stderr
    rows = json.loads(hyper("results", "quickstart", "--json", check=True).stdout)
    search = [x for x in rows if x["experiment"] == "search"]
    assert len(search) == 4 and all(x["status"] == "succeeded" for x in search)
    accs = [x["metrics"]["accuracy"] for x in search]
    assert accs == sorted(accs, reverse=True) and all(0 < a <= 1 for a in accs)
    assert [p["params"] for p in search] != [] and {"kernel", "scaler", "C", "gamma"} == set(
        search[0]["params"])
    best = json.loads((hyper_home / "storage" / "quickstart-1" / "report-0000" /
                       "best.json").read_text())
    assert best["accuracy"] == accs[0] and best["task"] == search[0]["task"]
    table = hyper("results", "quickstart", check=True).stdout
    assert "accuracy" in table and search[0]["task"] in table
    assert table.index(search[0]["task"]) < table.index(search[-1]["task"])
    logs = hyper("logs", "quickstart-1/search-0000", check=True).stdout
    assert "accuracy" in logs
    assert "best of 4" in hyper("logs", "report", check=True).stdout
    status = json.loads(hyper("status", "--json", check=True).stdout)
    assert status[0]["cluster"] == "quickstart" and len(status[0]["nodes"]) == 2
    r = hyper("down", "quickstart", check=True)
    assert "cluster quickstart is down" in r.stdout
    assert json.loads(hyper("status", "--json").stdout) == []  # a cluster down: hidden
    assert json.loads(hyper("status", "--all", "--json").stdout)[0]["status"] == "down"


def test_version_and_help(hyper):
    from hypercli import __version__
    assert hyper("--version", check=True).stdout.strip().endswith(__version__)
    out = hyper("--help", check=True).stdout
    for cmd in ("run", "plan", "up", "down", "status", "ps", "logs", "results", "cancel"):
        assert f"  {cmd} " in out


def test_bad_recipe_is_a_clear_error_and_stores_nothing(hyper, write_recipe, hyper_home):
    good = write_recipe("""
        name: fine
        cluster: {workers: 1}
        experiments:
          x: {command: "true"}
    """, "good.yaml")
    assert hyper("run", good).returncode == 0
    before = json.loads(hyper("ps", "--json").stdout)
    bad = write_recipe("""
        name: broken
        experiments:
          search:
            samles: 3
            command: echo hi
    """, "bad.yaml")
    for args in (("run", bad), ("plan", bad), ("up", bad)):
        r = hyper(*args)
        assert r.returncode == 2, r.stderr
        assert "Traceback" not in r.stderr
        assert "bad.yaml:5" in r.stderr and "samples" in r.stderr
    assert json.loads(hyper("ps", "--json").stdout) == before


def test_usage_errors_exit_2(hyper, hyper_home):
    for args, text in ((["results", "nope"], "no workflow named 'nope'"),
                       (["logs", "nope-0001"], "no task 'nope-0001'"),
                       (["down", "nope"], "no cluster named 'nope'"),
                       (["run", "/no/such/recipe.yaml"], "recipe"),
                       (["ps", "--bogus"], "No such option")):
        r = hyper(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert text in r.stderr and "Traceback" not in r.stderr


def test_state_file_is_private_wal_and_migrated(hyper_home):
    s = State()
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(hyper_home).st_mode) == 0o700
    assert s.db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    from hypercli.state import MIGRATIONS
    assert s.schema_version() == len(MIGRATIONS) >= 2
    s.close()
    State().close()  # reopening applies nothing twice
    db = sqlite3.connect(hyper_home / "state.db")
    assert db.execute("SELECT COUNT(*) FROM schema_migrations").fetchone()[0] == len(MIGRATIONS)
    db.execute("INSERT INTO schema_migrations VALUES (99, 'future', 0)")
    db.commit()
    db.close()
    try:
        State()
        raise AssertionError("a newer schema was accepted")
    except StateError as e:
        assert "newer hypercli" in str(e)


def test_unusable_state_folder_and_bad_endpoint_are_clear_errors(hyper, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("HYPER_HOME", str(not_a_folder))
    r = hyper("ps")
    assert r.returncode == 3 and "HYPER_HOME" in r.stderr and "Traceback" not in r.stderr
    monkeypatch.setenv("HYPER_HOME", str(tmp_path / "home"))
    r = hyper("data", "ls", "s3://bucket/x", "--endpoint-url", "not a url")
    assert r.returncode == 2 and "endpoint" in r.stderr and "Traceback" not in r.stderr


def test_corrupt_state_file_is_an_infrastructure_error(hyper, hyper_home):
    hyper_home.mkdir(parents=True, exist_ok=True)
    (hyper_home / "state.db").write_bytes(b"this is not sqlite" * 100)
    r = hyper("ps")
    assert r.returncode == 3 and "state file" in r.stderr and "Traceback" not in r.stderr


def test_old_state_file_is_migrated_keeping_its_rows(hyper_home):
    from hypercli import state as S
    hyper_home.mkdir(parents=True)
    db = sqlite3.connect(hyper_home / "state.db")
    db.execute("CREATE TABLE schema_migrations (version INTEGER PRIMARY KEY, name TEXT, "
               "applied_at REAL)")
    S.m001_initial(db)
    db.execute("INSERT INTO schema_migrations VALUES (1, 'm001_initial', 0)")
    db.execute("INSERT INTO workflows (id, name, seq, cluster, digest, storage, workdir, status,"
               " created_at) VALUES ('old-1', 'old', 1, 'c', 'd', 'file:///x', '/w', 'succeeded',"
               " 1.0)")
    db.commit()
    db.close()
    s = State()
    assert s.schema_version() == len(S.MIGRATIONS)
    wf = s.workflow("old")
    assert wf["id"] == "old-1" and wf["status"] == "succeeded" and wf["spec"] == {}


def test_new_state_file_opened_by_many_at_once(tmp_path):
    import threading
    errors = []
    for n in range(20):
        path = tmp_path / f"s{n}.db"

        def open_():
            try:
                State(path).close()
            except Exception as e:  # collected: any error fails the test
                errors.append(e)
        threads = [threading.Thread(target=open_) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
