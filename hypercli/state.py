"""The state file: one SQLite database under ``$HYPER_HOME`` holding everything hypercli knows.

Tables: clusters, nodes, workflows, experiments, tasks, attempts, events, samples
(utilisation), ledger (cost: each cloud instance's offer, price and lifetime),
controllers, and ``schema_migrations`` (numbered migrations, each applied once, in order). This is the only
module that writes SQL. JSON columns hold structured values (never pickle).

Concurrency: WAL journal, so ``hyper ps`` reads while ``hyper run`` writes; a 10 s busy
timeout for writers. The file is created with mode 0600 inside a 0700 folder: it names hosts,
addresses and commands.

A state file that cannot be written (its folder read-only, or its disk full) is opened
read-only, so the commands that only read it work: read-only mode, or SQLite's ``immutable``
open where a WAL file's shared memory cannot be made there either (sqlite.org, "Write-Ahead
Logging", section 5, "Read-Only Databases"; "URI filenames", ``immutable``). A write then
fails with a :class:`StateError` that says why (``no space left on /x``, ``/x is on a
read-only file system``).

Statuses:
    task:     pending → running → succeeded | failed ; or skipped / cancelled
    attempt:  launching → running → succeeded | failed | lost | cancelled | superseded;
              or refused (its node could not run it, e.g. no container runtime: no retry used)
    workflow: running → succeeded | failed | cancelled (cancelling while a cancel is under way)
    cluster:  up | down ;  node: up | lost | down
"""

from __future__ import annotations

import contextlib
import json
import os
import sqlite3
import time
from pathlib import Path
from typing import Iterable, Iterator

from hypercli.errors import StateError, UsageError, os_reason

TERMINAL_TASK = ("succeeded", "failed", "skipped", "cancelled")
LIVE_ATTEMPT = ("launching", "running")

MIGRATIONS: list = []


def migration(fn):
    """Register a migration; its number is its position (1-based) in this module."""
    MIGRATIONS.append(fn)
    return fn


@migration
def m001_initial(db: sqlite3.Connection) -> None:
    _script(db, """
    CREATE TABLE clusters (
        name TEXT PRIMARY KEY, provider TEXT NOT NULL, spec TEXT NOT NULL DEFAULT '{}',
        status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE TABLE nodes (
        name TEXT PRIMARY KEY, cluster TEXT NOT NULL REFERENCES clusters(name),
        provider_id TEXT, address TEXT NOT NULL DEFAULT '{}', slots INTEGER NOT NULL,
        status TEXT NOT NULL, info TEXT NOT NULL DEFAULT '{}',
        created_at REAL NOT NULL, updated_at REAL NOT NULL);
    CREATE INDEX nodes_cluster ON nodes(cluster);
    CREATE TABLE workflows (
        id TEXT PRIMARY KEY, name TEXT NOT NULL, seq INTEGER NOT NULL, cluster TEXT NOT NULL,
        recipe_path TEXT, digest TEXT NOT NULL, storage TEXT NOT NULL, workdir TEXT NOT NULL,
        status TEXT NOT NULL, created_at REAL NOT NULL, ended_at REAL, driver_pid INTEGER);
    CREATE INDEX workflows_name ON workflows(name, seq);
    CREATE TABLE experiments (
        workflow TEXT NOT NULL REFERENCES workflows(id), name TEXT NOT NULL,
        position INTEGER NOT NULL, after TEXT NOT NULL, retries INTEGER NOT NULL,
        image TEXT, workers INTEGER, PRIMARY KEY (workflow, name));
    CREATE TABLE tasks (
        workflow TEXT NOT NULL REFERENCES workflows(id), id TEXT NOT NULL,
        experiment TEXT NOT NULL, idx INTEGER NOT NULL, params TEXT NOT NULL,
        command TEXT NOT NULL, env TEXT NOT NULL, status TEXT NOT NULL,
        attempts INTEGER NOT NULL DEFAULT 0, metrics TEXT, ended_at REAL,
        PRIMARY KEY (workflow, id));
    CREATE TABLE attempts (
        id TEXT PRIMARY KEY, workflow TEXT NOT NULL, task TEXT NOT NULL,
        number INTEGER NOT NULL, node TEXT NOT NULL, status TEXT NOT NULL,
        exit_code INTEGER, error TEXT, metrics TEXT, created_at REAL NOT NULL,
        started_at REAL, ended_at REAL);
    CREATE INDEX attempts_task ON attempts(workflow, task);
    CREATE INDEX attempts_live ON attempts(status) WHERE status IN ('launching', 'running');
    CREATE TABLE events (
        id INTEGER PRIMARY KEY AUTOINCREMENT, ts REAL NOT NULL, workflow TEXT,
        task TEXT, attempt TEXT, node TEXT, kind TEXT NOT NULL, message TEXT NOT NULL);
    """)


@migration
def m002_workflow_spec(db: sqlite3.Connection) -> None:
    """Workflow settings the nodes need beyond the tasks: ``{"mounts": {path: url}}``."""
    db.execute("ALTER TABLE workflows ADD COLUMN spec TEXT NOT NULL DEFAULT '{}'")


@migration
def m003_resources(db: sqlite3.Connection) -> None:
    """Resources and multi-node tasks: what each task of an experiment needs
    (``Resources.as_dict()``); per attempt its rank in a multi-node task and its *claim* on
    its node (``{"cpus", "memory", "gpus": [indexes], "port"}``), which is the node's lease:
    a node's free capacity is what it has less the claims of its live attempts, whatever
    workflow they belong to; per task why it waits (``waiting for 1 GPU``)."""
    _script(db, """
    ALTER TABLE experiments ADD COLUMN resources TEXT NOT NULL DEFAULT '{}';
    ALTER TABLE attempts ADD COLUMN rank INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE attempts ADD COLUMN claim TEXT;
    ALTER TABLE tasks ADD COLUMN wait TEXT;
    CREATE INDEX attempts_node_live ON attempts(node) WHERE status IN ('launching', 'running')
    """)


@migration
def m004_detached(db: sqlite3.Connection) -> None:
    """``workflows.detached``: 1 while the background driver (:mod:`hypercli.driver`) is to
    drive the workflow."""
    db.execute("ALTER TABLE workflows ADD COLUMN detached INTEGER NOT NULL DEFAULT 0")


@migration
def m005_checkpoint_every(db: sqlite3.Connection) -> None:
    """``experiments.checkpoint_every``: seconds between saves of a task's checkpoint."""
    db.execute("ALTER TABLE experiments ADD COLUMN checkpoint_every REAL NOT NULL DEFAULT 60")


@migration
def m006_samples(db: sqlite3.Connection) -> None:
    """``samples``: utilisation of nodes and of the attempts on them (:mod:`hypercli.usage`):
    ``attempt`` NULL for a node's own sample; ``span`` 0 for a raw sample, else the seconds a
    mean covers (older samples are kept as 1-minute means); ``data`` the JSON values."""
    _script(db, """
    CREATE TABLE samples (
        node TEXT NOT NULL, attempt TEXT, ts REAL NOT NULL, span REAL NOT NULL DEFAULT 0,
        data TEXT NOT NULL);
    CREATE INDEX samples_node ON samples(node, ts);
    CREATE INDEX samples_attempt ON samples(attempt, ts) WHERE attempt IS NOT NULL;
    """)


@migration
def m007_engine(db: sqlite3.Connection) -> None:
    """``experiments.engine``: ``spark`` or ``ray`` started across each task's nodes, or NULL."""
    db.execute("ALTER TABLE experiments ADD COLUMN engine TEXT")


@migration
def m008_cluster_ids(db: sqlite3.Connection) -> None:
    """``cluster_ids``: a random id per cluster name (``uid``, 32 hex digits), made before the
    cluster's first launch and kept until it is forgotten. Cloud identities carry a short hash
    of it in their names (:func:`hypercli.providers.cloud.identity_tag`), so that clusters
    whose names differ only in case or after a cloud's length limit never share one, and a
    name made in advance by someone else is not guessed."""
    db.execute("CREATE TABLE cluster_ids (name TEXT PRIMARY KEY, uid TEXT NOT NULL, "
               "created_at REAL NOT NULL)")


@migration
def m009_ledger(db: sqlite3.Connection) -> None:
    """``ledger``: the cost ledger (:mod:`hypercli.offers.ledger`), one row per cloud instance
    launched: cluster, node, the cloud's instance id, the offer it was launched on (cloud,
    region, zone, instance type, spot), ``price`` in USD per node-hour (NULL when the cloud
    gave none), ``launched_at`` and ``ended_at`` (unix s; NULL while it runs; written once)
    and ``end_reason`` (``down``, ``preempted``, ``gone``, ``gc``). Rows outlive their cluster
    (``forget`` keeps them). ``events.cluster``: the cluster an event is about (launch
    failover steps)."""
    _script(db, """
    CREATE TABLE ledger (
        id INTEGER PRIMARY KEY AUTOINCREMENT, cluster TEXT NOT NULL, node TEXT NOT NULL,
        instance_id TEXT NOT NULL, cloud TEXT NOT NULL, region TEXT NOT NULL DEFAULT '',
        zone TEXT, instance_type TEXT NOT NULL DEFAULT '', spot INTEGER NOT NULL DEFAULT 0,
        price REAL, launched_at REAL NOT NULL, ended_at REAL, end_reason TEXT,
        UNIQUE (cloud, instance_id));
    CREATE INDEX ledger_cluster ON ledger(cluster, launched_at);
    ALTER TABLE events ADD COLUMN cluster TEXT
    """)


@migration
def m010_pools(db: sqlite3.Connection) -> None:
    """``pools``: a cloud cluster's node pools (:mod:`hypercli.offers.pools`), one row per
    (cluster, pool): the resource ``shape`` it holds and the ``offer`` it launches on (JSON),
    its ``experiments`` (JSON list), ``cap`` (most nodes), ``target`` (nodes it wants now),
    ``idle_s`` (s a node may stay idle), ``status`` (``growing``, ``steady``, ``shrinking``,
    ``done``) and ``why`` (the reason, for ``hyper status``). ``nodes.pool`` and
    ``ledger.pool``: the pool a node belongs to (NULL: a cluster without pools)."""
    _script(db, """
    CREATE TABLE pools (
        cluster TEXT NOT NULL, name TEXT NOT NULL, shape TEXT NOT NULL DEFAULT '{}',
        offer TEXT NOT NULL DEFAULT '{}', experiments TEXT NOT NULL DEFAULT '[]',
        cap INTEGER NOT NULL, target INTEGER NOT NULL DEFAULT 0, idle_s REAL NOT NULL,
        status TEXT NOT NULL DEFAULT 'steady', why TEXT, updated_at REAL NOT NULL,
        PRIMARY KEY (cluster, name));
    ALTER TABLE nodes ADD COLUMN pool TEXT;
    ALTER TABLE ledger ADD COLUMN pool TEXT
    """)


@migration
def m011_controllers(db: sqlite3.Connection) -> None:
    """``controllers``: hosts that drive workflows while this machine is away
    (:mod:`hypercli.controller`): ``name`` (its ``user@host:port``), ``spec`` (JSON: target,
    identity_file, python), ``status`` (``up`` | ``down``), times in unix s."""
    db.execute("CREATE TABLE controllers (name TEXT PRIMARY KEY, spec TEXT NOT NULL, "
               "status TEXT NOT NULL, created_at REAL NOT NULL, updated_at REAL NOT NULL)")


def _script(db: sqlite3.Connection, sql: str) -> None:
    """Run ``;``-separated statements inside the caller's transaction (``executescript``
    would commit it)."""
    for stmt in sql.split(";"):
        if stmt.strip():
            db.execute(stmt)


def home() -> Path:
    """The state folder: ``$HYPER_HOME``, else ``~/.hyper``. Created 0700 when missing."""
    p = Path(os.environ.get("HYPER_HOME") or Path.home() / ".hyper").expanduser()
    try:
        p.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as e:
        raise StateError(f"cannot use {p} as hypercli's state folder: {e.strerror or e}",
                         "set HYPER_HOME to a folder you can write") from None
    return p


def folder(name: str) -> Path:
    """``home() / name``, a folder of hypercli's own there (``local``, ``storage``,
    ``logs``, ``cache``...), made 0700 when missing: it holds logs and outputs."""
    p = home() / name
    try:
        p.mkdir(exist_ok=True, mode=0o700)
    except OSError as e:
        raise StateError(f"cannot make {p}: {os_reason(e, str(p))}",
                         "set HYPER_HOME to a folder you can write") from None
    return p


def open_to_others(path: Path) -> int | None:
    """The mode of folder ``path`` when users other than its owner may enter or read it
    (any of 0o077 set), else None (also when it cannot be looked at)."""
    try:
        mode = os.stat(path).st_mode & 0o7777
    except OSError:
        return None
    return mode if mode & 0o077 else None


def unwritable(path: Path) -> str | None:
    """Why the file at ``path`` or its folder cannot be written, as far as can be seen
    from here: ``/x is on a read-only file system``, ``/x is read-only to this user``,
    ``no space left on /x``; None when nothing is seen to stop a write."""
    folder = path.parent
    try:
        vfs = os.statvfs(folder)
    except OSError:
        return None
    if vfs.f_flag & os.ST_RDONLY:
        return f"{folder} is on a read-only file system"
    if not os.access(folder, os.W_OK):
        return f"{folder} is read-only to this user"
    if path.exists() and not os.access(path, os.W_OK):
        return f"{path} is read-only to this user"
    if (vfs.f_bavail if os.geteuid() else vfs.f_bfree) == 0:
        return f"no space left on {folder}"
    return None


_ENCODER = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False)  # one, not one per call


def _dumps(value) -> str:
    return _ENCODER.encode(value)


class State:
    """A connection to the state file.

    Args:
        path: the SQLite file; default ``home() / "state.db"``.
    Raises:
        StateError: the file cannot be created, is not a hypercli state file, or was written
            by a newer hypercli (more migrations than this one knows).
    """

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = Path(path) if path else home() / "state.db"
        #: why the file cannot be written (it was opened read-only), or None
        self.readonly: str | None = None
        self.db = None
        try:
            if not self.path.exists():
                try:
                    self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
                    os.close(os.open(self.path, os.O_CREAT | os.O_WRONLY, 0o600))
                except OSError as e:
                    raise StateError(f"cannot create the state file {self.path}: "
                                     f"{os_reason(e, str(self.path.parent))}",
                                     "set HYPER_HOME to a folder you can write") from None
            self.db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                                      check_same_thread=False)
            self.db.row_factory = sqlite3.Row
            self._open()
        except sqlite3.DatabaseError as e:
            why = unwritable(self.path) if isinstance(e, sqlite3.OperationalError) else None
            if why is None:
                raise StateError(f"state file {self.path}: {e}",
                                 "move it aside or set HYPER_HOME to another folder") from None
            if self.db is not None:
                self.db.close()
            self._open_readonly(why)

    def _open_readonly(self, why: str) -> None:
        """Open the file for reading only (module docstring); ``why``: what stops writes."""
        uri = self.path.absolute().as_uri()
        error = None
        for query in ("?mode=ro", "?mode=ro&immutable=1"):
            db = sqlite3.connect(uri + query, uri=True, timeout=10.0, isolation_level=None,
                                 check_same_thread=False)
            try:
                have = db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
                break
            except sqlite3.DatabaseError as e:
                db.close()
                error = e
        else:
            raise StateError(f"state file {self.path} cannot be opened ({error}): {why}",
                             "free space there, or set HYPER_HOME to another folder")
        self.db, self.readonly = db, why
        self.db.row_factory = sqlite3.Row
        if have != len(MIGRATIONS):
            db.close()
            newer = (have or 0) > len(MIGRATIONS)
            raise StateError(f"state file {self.path} is from a "
                             f"{'newer' if newer else 'older'} hypercli "
                             f"(schema {have}, this one knows {len(MIGRATIONS)})"
                             + ("" if newer else f" and cannot be upgraded: {why}"),
                             "upgrade hypercli" if newer else
                             "make its folder writable once, or set HYPER_HOME to another")

    def _write_error(self, e: Exception) -> StateError:
        """The StateError of a write that failed with ``e``, saying why when the folder
        cannot be written."""
        why = self.readonly or unwritable(self.path)
        if why is None and "disk is full" in str(e):  # SQLITE_FULL: less than a page free
            why = f"no space left on {self.path.parent}"
        if why is None:
            return StateError(f"state file {self.path}: {e}")
        return StateError(f"state file {self.path} cannot be written: {why}",
                          "commands that only read it (ps, results, logs, status, stats) "
                          "work; tasks already started go on, and `hyper run RECIPE` takes "
                          "them up again once it can be written")

    def _open(self, tries: int = 50) -> None:
        """Pragmas and migrations. Switching a new file to WAL takes an exclusive lock that
        SQLite does not wait for, so two processes opening a new state file at once may see
        "database is locked": retried for up to ~5 s."""
        for attempt in range(tries):
            try:
                if self.db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
                    self.db.execute("PRAGMA journal_mode=WAL")
                self.db.execute("PRAGMA synchronous=NORMAL")
                self.db.execute("PRAGMA foreign_keys=ON")
                self._migrate()
                return
            except sqlite3.OperationalError as e:
                if "locked" not in str(e) or attempt == tries - 1:
                    raise
                time.sleep(0.1)

    def _migrate(self) -> None:
        try:  # the common case, read-only: everything applied (no write lock taken)
            have = self.db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]
            if have == len(MIGRATIONS):
                return
        except sqlite3.OperationalError:  # a new file: no table yet
            pass
        with self.tx():
            self.db.execute("CREATE TABLE IF NOT EXISTS schema_migrations ("
                            "version INTEGER PRIMARY KEY, name TEXT, applied_at REAL)")
            done = {r[0] for r in self.db.execute("SELECT version FROM schema_migrations")}
            if done and max(done) > len(MIGRATIONS):
                raise StateError(f"state file {self.path} is from a newer hypercli "
                                 f"(schema {max(done)}, this one knows {len(MIGRATIONS)})",
                                 "upgrade hypercli")
            for n, fn in enumerate(MIGRATIONS, 1):
                if n not in done:
                    fn(self.db)
                    self.db.execute("INSERT INTO schema_migrations VALUES (?,?,?)",
                                    (n, fn.__name__, time.time()))

    @contextlib.contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (BEGIN IMMEDIATE); commits on success, rolls back on error.
        Nested use joins the outer transaction."""
        if self.db.in_transaction:
            yield self.db
            return
        if self.readonly:
            raise self._write_error(None)
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except sqlite3.OperationalError as e:  # locked for 10 s, disk full, read-only file
            raise self._write_error(e) from None
        try:
            yield self.db
        except sqlite3.OperationalError as e:
            self._rollback()
            raise self._write_error(e) from None
        except BaseException:
            self._rollback()
            raise
        try:
            self.db.execute("COMMIT")
        except sqlite3.OperationalError as e:
            self._rollback()
            raise self._write_error(e) from None

    def _rollback(self) -> None:
        """Roll back the open transaction (SQLite may have rolled it back itself after a
        full disk or an I/O error: then there is none)."""
        if self.db.in_transaction:
            try:
                self.db.execute("ROLLBACK")
            except sqlite3.OperationalError:
                pass

    def checkpoint_in_background(self, every: float = 1.0):
        """Move this connection's WAL checkpoints (the only writes SQLite syncs to disk here,
        with synchronous=NORMAL) to a thread of their own, every ``every`` seconds, so that a
        slow disk never stalls the caller's commits (a driver's dispatch). Returns stop(),
        which runs a last checkpoint. Source: sqlite.org, "Write-Ahead Logging", section 6
        (checkpointing in a separate thread)."""
        import threading
        self.db.execute("PRAGMA wal_autocheckpoint=0")
        done = threading.Event()

        def run() -> None:
            db = sqlite3.connect(self.path, timeout=10.0, isolation_level=None,
                                 check_same_thread=False)
            try:
                while not done.wait(every):
                    try:
                        db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                    except sqlite3.Error:
                        pass  # busy: the next round
                try:
                    db.execute("PRAGMA wal_checkpoint(PASSIVE)")
                except sqlite3.Error:
                    pass
            finally:
                db.close()
        t = threading.Thread(target=run, name="wal-checkpoint", daemon=True)
        t.start()

        def stop() -> None:
            done.set()
            t.join(timeout=30)
            self.db.execute("PRAGMA wal_autocheckpoint=1000")  # SQLite's default
        return stop

    def close(self) -> None:
        self.db.close()

    def schema_version(self) -> int:
        return self.db.execute("SELECT MAX(version) FROM schema_migrations").fetchone()[0]

    # -- clusters and nodes -------------------------------------------------------------
    def put_cluster(self, name: str, provider: str, spec: dict, status: str = "up") -> None:
        now = time.time()
        with self.tx() as db:
            db.execute("INSERT INTO clusters VALUES (?,?,?,?,?,?) ON CONFLICT(name) DO UPDATE "
                       "SET provider=excluded.provider, spec=excluded.spec, "
                       "status=excluded.status, updated_at=excluded.updated_at",
                       (name, provider, _dumps(spec), status, now, now))

    def cluster_uid(self, name: str) -> str:
        """The random id of cluster ``name`` (migration 8), made on first use."""
        import secrets
        with self.tx() as db:
            db.execute("INSERT OR IGNORE INTO cluster_ids VALUES (?,?,?)",
                       (name, secrets.token_hex(16), time.time()))
            return db.execute("SELECT uid FROM cluster_ids WHERE name=?", (name,)).fetchone()[0]

    def cluster(self, name: str) -> dict | None:
        r = self.db.execute("SELECT * FROM clusters WHERE name=?", (name,)).fetchone()
        return _row(r, "spec")

    def clusters(self) -> list[dict]:
        rows = self.db.execute("SELECT * FROM clusters ORDER BY created_at").fetchall()
        return [_row(r, "spec") for r in rows]

    def set_cluster_status(self, name: str, status: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE clusters SET status=?, updated_at=? WHERE name=?",
                       (status, time.time(), name))

    def put_node(self, cluster: str, name: str, *, slots: int, provider_id: str | None = None,
                 address: dict | None = None, status: str = "up", info: dict | None = None):
        now = time.time()
        with self.tx() as db:
            db.execute("INSERT INTO nodes (name, cluster, provider_id, address, slots, status, "
                       "info, created_at, updated_at) VALUES (?,?,?,?,?,?,?,?,?) "
                       "ON CONFLICT(name) DO UPDATE "
                       "SET cluster=excluded.cluster, provider_id=excluded.provider_id, "
                       "address=excluded.address, slots=excluded.slots, status=excluded.status, "
                       "info=excluded.info, updated_at=excluded.updated_at",
                       (name, cluster, provider_id, _dumps(address or {}), slots, status,
                        _dumps(info or {}), now, now))

    def nodes(self, cluster: str, status: str | None = None) -> list[dict]:
        q, args = "SELECT * FROM nodes WHERE cluster=?", [cluster]
        if status:
            q, args = q + " AND status=?", args + [status]
        rows = self.db.execute(q + " ORDER BY created_at, name", args).fetchall()
        return [_row(r, "address", "info") for r in rows]

    def set_node_status(self, name: str, status: str) -> None:
        with self.tx() as db:
            db.execute("UPDATE nodes SET status=?, updated_at=? WHERE name=?",
                       (status, time.time(), name))

    # -- workflows ----------------------------------------------------------------------
    def create_workflow(self, wf, *, cluster: str, recipe_path: str | None, storage: str,
                        workdir: str, spec: dict | None = None) -> str:
        """Store a planned workflow (``hypercli.plan.Workflow``) with all its tasks pending;
        ``spec`` holds settings for the nodes (``{"mounts": {path: url}}``).

        Returns:
            the new workflow id, ``<name>-<seq>`` with seq counting from 1 per recipe name.
        """
        now = time.time()
        with self.tx() as db:
            seq = db.execute("SELECT COALESCE(MAX(seq), 0) + 1 FROM workflows WHERE name=?",
                             (wf.name,)).fetchone()[0]
            wid = f"{wf.name}-{seq}"
            db.execute("INSERT INTO workflows (id, name, seq, cluster, recipe_path, digest, "
                       "storage, workdir, status, created_at, spec) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
                       (wid, wf.name, seq, cluster, recipe_path, wf.digest, storage, workdir,
                        "running", now, _dumps(spec or {})))
            db.executemany("INSERT INTO experiments (workflow, name, position, after, retries,"
                           " image, workers, resources, checkpoint_every, engine) VALUES "
                           "(?,?,?,?,?,?,?,?,?,?)",
                           [(wid, e.name, i, _dumps(list(e.after)), e.retries, e.image,
                             e.workers, _dumps(e.resources), e.checkpoint_every, e.engine)
                            for i, e in enumerate(wf.experiments)])
            db.executemany("INSERT INTO tasks (workflow, id, experiment, idx, params, command,"
                           " env, status) VALUES (?,?,?,?,?,?,?, 'pending')",
                           ((wid, t.id, t.experiment, t.index, _dumps(t.params), t.command,
                             _dumps(t.env) if t.env else "{}") for t in wf.tasks))
            self._event(db, "workflow", f"planned {len(wf.tasks)} tasks", workflow=wid)
        return wid

    def workflow(self, ref: str) -> dict:
        """A workflow by id (``quickstart-3``) or by recipe name (its newest workflow).

        Raises:
            UsageError: no workflow has that id or name.
        """
        r = self.db.execute("SELECT * FROM workflows WHERE id=?", (ref,)).fetchone()
        if r is None:
            r = self.db.execute("SELECT * FROM workflows WHERE name=? ORDER BY seq DESC LIMIT 1",
                                (ref,)).fetchone()
        if r is None:
            known = [x[0] for x in self.db.execute(
                "SELECT id FROM workflows ORDER BY created_at DESC LIMIT 5")]
            raise UsageError(f"no workflow named {ref!r}",
                             f"known: {', '.join(known)}" if known else "run `hyper run RECIPE`")
        return _row(r, "spec")

    def workflows(self, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT * FROM workflows ORDER BY created_at DESC LIMIT ?",
                               (limit,)).fetchall()
        return [_row(r, "spec") for r in rows]

    def live_workflows(self, cluster: str) -> list[dict]:
        """The workflows of ``cluster`` that have not ended (running or cancelling)."""
        rows = self.db.execute("SELECT * FROM workflows WHERE cluster=? AND status IN "
                               "('running', 'cancelling') ORDER BY created_at",
                               (cluster,)).fetchall()
        return [_row(r, "spec") for r in rows]

    def detached_workflows(self) -> list[str]:
        """Ids of the running workflows handed to the background driver, oldest first."""
        return [r[0] for r in self.db.execute(
            "SELECT id FROM workflows WHERE detached=1 AND status IN ('running', 'cancelling')"
            " ORDER BY created_at")]

    def latest_workflow(self, name: str) -> dict | None:
        r = self.db.execute("SELECT * FROM workflows WHERE name=? ORDER BY seq DESC LIMIT 1",
                            (name,)).fetchone()
        return _row(r, "spec")

    def set_workflow(self, wid: str, **fields) -> None:
        """Update workflow columns (status, ended_at, driver_pid, detached, cluster)."""
        cols = ", ".join(f"{k}=?" for k in fields)
        with self.tx() as db:
            db.execute(f"UPDATE workflows SET {cols} WHERE id=?", (*fields.values(), wid))

    def experiments(self, wid: str) -> list[dict]:
        rows = self.db.execute("SELECT * FROM experiments WHERE workflow=? ORDER BY position",
                               (wid,)).fetchall()
        return [_row(r, "after", "resources") for r in rows]

    # -- tasks and attempts -------------------------------------------------------------
    def tasks(self, wid: str, *, status: Iterable[str] | None = None) -> list[dict]:
        q, args = "SELECT * FROM tasks WHERE workflow=?", [wid]
        if status:
            status = list(status)
            q += f" AND status IN ({','.join('?' * len(status))})"
            args += status
        rows = self.db.execute(q + " ORDER BY rowid", args).fetchall()
        return [_row(r, "params", "env", "metrics") for r in rows]

    def task(self, wid: str, task_id: str) -> dict:
        r = self.db.execute("SELECT * FROM tasks WHERE workflow=? AND id=?",
                            (wid, task_id)).fetchone()
        if r is None:
            raise UsageError(f"workflow {wid} has no task {task_id!r}",
                             f"`hyper ps {wid}` lists its tasks")
        return _row(r, "params", "env", "metrics")

    def find_task(self, ref: str) -> tuple[str, str]:
        """Resolve ``TASK`` or ``WORKFLOW/TASK`` to (workflow id, task id); a bare task id
        means the newest workflow that has it.

        Raises:
            UsageError: no such task.
        """
        if "/" in ref:
            wref, tid = ref.rsplit("/", 1)
            wid = self.workflow(wref)["id"]
            one = self.db.execute("SELECT MIN(id), COUNT(*) FROM tasks WHERE workflow=? AND "
                                  "experiment=?", (wid, tid)).fetchone()
            if one[1] == 1:
                tid = one[0]
            self.task(wid, tid)
            return wid, tid
        r = self.db.execute("SELECT t.workflow, t.id FROM tasks t JOIN workflows w ON "
                            "w.id=t.workflow WHERE t.id=? ORDER BY w.created_at DESC LIMIT 1",
                            (ref,)).fetchone()
        if r is None:  # an experiment of one task may be named by the experiment
            r = self.db.execute("SELECT t.workflow, MIN(t.id), COUNT(*) AS n FROM tasks t JOIN "
                                "workflows w ON w.id=t.workflow WHERE t.experiment=? GROUP BY "
                                "t.workflow ORDER BY w.created_at DESC LIMIT 1", (ref,)).fetchone()
            if r is not None and r["n"] != 1:
                r = None
        if r is None:
            raise UsageError(f"no task {ref!r}", "give it as WORKFLOW/TASK, see `hyper ps`")
        return r[0], r[1]

    def counts(self, wid: str) -> dict[str, dict[str, int]]:
        """experiment → {status: number of tasks}."""
        out: dict[str, dict[str, int]] = {}
        for exp, status, n in self.db.execute(
                "SELECT experiment, status, COUNT(*) FROM tasks WHERE workflow=? "
                "GROUP BY experiment, status", (wid,)):
            out.setdefault(exp, {})[status] = n
        return out

    def attempts(self, wid: str, task: str | None = None, *,
                 status: Iterable[str] | None = None) -> list[dict]:
        q, args = "SELECT * FROM attempts WHERE workflow=?", [wid]
        if task:
            q, args = q + " AND task=?", args + [task]
        if status:
            status = list(status)
            q += f" AND status IN ({','.join('?' * len(status))})"
            args += status
        rows = self.db.execute(q + " ORDER BY created_at, number", args).fetchall()
        return [_row(r, "metrics", "claim") for r in rows]

    def live_attempts(self, node: str | None = None) -> list[dict]:
        q, args = "SELECT * FROM attempts WHERE status IN ('launching','running')", []
        if node:
            q, args = q + " AND node=?", [node]
        return [_row(r, "metrics", "claim") for r in self.db.execute(q, args).fetchall()]

    def claims(self, nodes: Iterable[str]) -> list[dict]:
        """The leases on these nodes: ``{"id", "workflow", "node", "claim"}`` of every live
        attempt there, of any workflow (one indexed read)."""
        nodes = list(nodes)
        if not nodes:
            return []
        rows = self.db.execute(
            "SELECT id, workflow, node, claim FROM attempts WHERE status IN "
            f"('launching','running') AND node IN ({','.join('?' * len(nodes))})", nodes)
        return [_row(r, "claim") for r in rows]

    def start_attempts(self, rows: list[tuple]) -> None:
        """Record attempts about to be launched, in one transaction, before the launch is sent
        (write-ahead: a resumed run re-sends launches the node never got).

        Args:
            rows: (attempt id, workflow id, task id, attempt number, node name[, rank,
                claim]) tuples; rank defaults to 0, claim (a dict, see migration 3) to none.
        """
        now = time.time()
        full = [(*r[:5], r[5] if len(r) > 5 else 0,
                 _dumps(r[6]) if len(r) > 6 and r[6] is not None else None) for r in rows]
        with self.tx() as db:
            db.executemany("INSERT INTO attempts (id, workflow, task, number, node, rank, claim,"
                           " status, created_at) VALUES (?,?,?,?,?,?,?,'launching',?)",
                           [(*r, now) for r in full])
            db.executemany("UPDATE tasks SET status='running', attempts=?, wait=NULL "
                           "WHERE workflow=? AND id=?", [(r[3], r[1], r[2]) for r in rows])

    def update_attempts(self, updates: list[dict]) -> None:
        """Apply attempt changes in one transaction.

        Args:
            updates: dicts with ``id`` and any of status, exit_code, error, metrics (dict),
                started_at, ended_at (unix seconds). A change to ``cancelled`` or ``lost``
                applies only to an attempt still live.
        """
        with self.tx() as db:
            for u in updates:
                u = dict(u)
                aid = u.pop("id")
                if "metrics" in u:
                    u["metrics"] = _dumps(u["metrics"]) if u["metrics"] is not None else None
                cols = ", ".join(f"{k}=?" for k in u)
                # an ended attempt's result is never relabelled by a later cancel or loss
                only_live = (" AND status IN ('launching','running')"
                             if u.get("status") in ("cancelled", "lost") else "")
                db.execute(f"UPDATE attempts SET {cols} WHERE id=?{only_live}",
                           (*u.values(), aid))

    def set_tasks(self, wid: str, updates: list[dict]) -> None:
        """Apply task changes (``id`` + status, metrics, ended_at) in one transaction. A task
        that has succeeded is never changed to another status, and a change to ``cancelled``
        applies only to a task not yet ended (a cancel recorded by another process keeps its
        time)."""
        with self.tx() as db:
            for u in updates:
                u = dict(u)
                tid = u.pop("id")
                if "metrics" in u:
                    u["metrics"] = _dumps(u["metrics"]) if u["metrics"] is not None else None
                cols = ", ".join(f"{k}=?" for k in u)
                # a task that succeeded stays succeeded (first success wins; cancel is late)
                keep = " AND status != 'succeeded'" if u.get("status") != "succeeded" else ""
                if u.get("status") == "cancelled":  # an ended task's record is left as it is
                    keep = f" AND status NOT IN ({','.join(repr(s) for s in TERMINAL_TASK)})"
                db.execute(f"UPDATE tasks SET {cols} WHERE workflow=? AND id=?{keep}",
                           (*u.values(), wid, tid))

    # -- events -------------------------------------------------------------------------
    @staticmethod
    def _event(db, kind: str, message: str, **ids) -> None:
        db.execute("INSERT INTO events (ts, workflow, task, attempt, node, kind, message, "
                   "cluster) VALUES (?,?,?,?,?,?,?,?)",
                   (time.time(), ids.get("workflow"), ids.get("task"), ids.get("attempt"),
                    ids.get("node"), kind, message, ids.get("cluster")))

    def event(self, kind: str, message: str, **ids) -> None:
        """Append to the event log (kind: workflow, attempt, node, cluster, launch; ids:
        workflow, task, attempt, node, cluster)."""
        with self.tx() as db:
            self._event(db, kind, message, **ids)

    def events(self, wid: str, limit: int = 200) -> list[dict]:
        rows = self.db.execute("SELECT * FROM events WHERE workflow=? ORDER BY id DESC LIMIT ?",
                               (wid, limit)).fetchall()
        return [dict(r) for r in reversed(rows)]

    def cluster_events(self, cluster: str, kinds: Iterable[str] = ("launch",),
                       since: float = 0.0, limit: int = 20) -> list[dict]:
        """The latest events about ``cluster`` of these kinds after ``since`` (unix s),
        oldest first (at most ``limit``)."""
        kinds = list(kinds)
        rows = self.db.execute(
            f"SELECT * FROM events WHERE cluster=? AND kind IN ({','.join('?' * len(kinds))})"
            " AND ts>=? ORDER BY id DESC LIMIT ?", (cluster, *kinds, since, limit)).fetchall()
        return [dict(r) for r in reversed(rows)]

    # -- cost ledger --------------------------------------------------------------------
    def ledger_launch(self, cluster: str, node: str, instance_id: str, info: dict) -> None:
        """Record a launched cloud instance (migration ``m009_ledger``) from its node ``info``
        (``cloud``, ``region``, ``zone``, ``instance_type``, ``spot``, ``price`` USD/h,
        ``launched_at`` unix s). Recorded once: a second call for the instance changes
        nothing."""
        with self.tx() as db:
            db.execute("INSERT OR IGNORE INTO ledger (cluster, node, instance_id, cloud, region,"
                       " zone, instance_type, spot, price, launched_at) "
                       "VALUES (?,?,?,?,?,?,?,?,?,?)",
                       (cluster, node, instance_id, info.get("cloud") or "",
                        info.get("region") or "", info.get("zone"),
                        info.get("instance_type") or "", 1 if info.get("spot") else 0,
                        info.get("price"), info.get("launched_at") or time.time()))

    def ledger_end(self, cluster: str, nodes: Iterable[str] | None, at: float | None = None,
                   reason: str = "down") -> int:
        """Record the end (unix s, default now) of the named nodes' instances (None: every
        instance of the cluster) that have none yet: a recorded end is never overwritten.
        Returns the rows ended."""
        only = ""
        args: list = []
        if nodes is not None:
            args = list(nodes)
            if not args:
                return 0
            only = f" AND node IN ({','.join('?' * len(args))})"
        with self.tx() as db:
            return db.execute(
                "UPDATE ledger SET ended_at=?, end_reason=? WHERE cluster=? AND ended_at IS "
                f"NULL{only}", (at or time.time(), reason, cluster, *args)).rowcount

    def ledger_end_instances(self, cloud: str, ids: Iterable[str], at: float | None = None,
                             reason: str = "gc") -> int:
        """Record the end of these instances of ``cloud`` (``hyper gc`` removed them) where
        none is recorded yet. Returns the rows ended."""
        ids = list(ids)
        if not ids:
            return 0
        with self.tx() as db:
            return db.execute(
                "UPDATE ledger SET ended_at=?, end_reason=? WHERE cloud=? AND ended_at IS NULL"
                f" AND instance_id IN ({','.join('?' * len(ids))})",
                (at or time.time(), reason, cloud, *ids)).rowcount

    def ledger(self, cluster: str | None = None, since: float = 0.0) -> list[dict]:
        """Ledger rows (of ``cluster``, launched at or after ``since``), oldest first."""
        q, args = "SELECT * FROM ledger WHERE launched_at>=?", [since]
        if cluster is not None:
            q, args = q + " AND cluster=?", args + [cluster]
        return [dict(r) for r in self.db.execute(q + " ORDER BY launched_at, id", args)]

    # -- node pools (migration m010_pools) ---------------------------------------------------
    def put_pool(self, cluster: str, name: str, *, shape: dict, offer: dict,
                 experiments: list[str], cap: int, idle_s: float) -> None:
        """Record a pool of a cluster (its target and status are kept when it exists)."""
        with self.tx() as db:
            db.execute("INSERT INTO pools (cluster, name, shape, offer, experiments, cap, "
                       "idle_s, updated_at) VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(cluster, name)"
                       " DO UPDATE SET shape=excluded.shape, offer=excluded.offer, "
                       "experiments=excluded.experiments, cap=excluded.cap, "
                       "idle_s=excluded.idle_s, updated_at=excluded.updated_at",
                       (cluster, name, _dumps(shape), _dumps(offer), _dumps(experiments), cap,
                        idle_s, time.time()))

    def set_pool(self, cluster: str, name: str, *, target: int, status: str,
                 why: str | None) -> None:
        """Record what a pool wants now: ``target`` nodes, ``status`` and why."""
        with self.tx() as db:
            db.execute("UPDATE pools SET target=?, status=?, why=?, updated_at=? "
                       "WHERE cluster=? AND name=?",
                       (target, status, why, time.time(), cluster, name))

    def pools(self, cluster: str) -> list[dict]:
        """The pools of a cluster, in the order they were made."""
        rows = self.db.execute("SELECT * FROM pools WHERE cluster=? ORDER BY rowid",
                               (cluster,)).fetchall()
        return [_row(r, "shape", "offer", "experiments") for r in rows]

    def set_node_pool(self, cluster: str, nodes: Iterable[str], pool: str) -> None:
        """Put these nodes (their ``nodes`` and ``ledger`` rows) in ``pool``."""
        nodes = list(nodes)
        if not nodes:
            return
        marks = ",".join("?" * len(nodes))
        with self.tx() as db:
            db.execute(f"UPDATE nodes SET pool=? WHERE cluster=? AND name IN ({marks})",
                       (pool, cluster, *nodes))
            db.execute(f"UPDATE ledger SET pool=? WHERE cluster=? AND node IN ({marks})",
                       (pool, cluster, *nodes))

    def cluster_since(self, name: str) -> float:
        """When the cluster's id (migration 8) was made (unix s; 0.0 without one): its
        ledger since it was last forgotten."""
        r = self.db.execute("SELECT created_at FROM cluster_ids WHERE name=?", (name,)).fetchone()
        return r[0] if r else 0.0

    def node_work(self, nodes: Iterable[str]) -> list[dict]:
        """Every attempt on these nodes: ``{"node", "workflow", "experiment", "start",
        "end", "status"}`` (start: started, else created; end NULL while it runs)."""
        nodes = list(nodes)
        if not nodes:
            return []
        rows = self.db.execute(
            "SELECT a.node, a.workflow, t.experiment, COALESCE(a.started_at, a.created_at) "
            "AS start, a.ended_at AS end, a.status FROM attempts a JOIN tasks t ON "
            f"t.workflow=a.workflow AND t.id=a.task WHERE a.node IN "
            f"({','.join('?' * len(nodes))})", nodes)
        return [dict(r) for r in rows]

    def task_matches(self, ref: str) -> list[dict]:
        """Every workflow that a bare task reference (``search-0007``, or the name of a
        one-task experiment) could mean: ``{"workflow", "task", "status"}`` (the workflow's
        status), newest workflow first."""
        rows = self.db.execute(
            "SELECT t.workflow, t.id, w.status FROM tasks t JOIN workflows w ON w.id=t.workflow"
            " WHERE t.id=? ORDER BY w.created_at DESC", (ref,)).fetchall()
        if not rows:
            rows = self.db.execute(
                "SELECT t.workflow, MIN(t.id), w.status FROM tasks t JOIN workflows w ON "
                "w.id=t.workflow WHERE t.experiment=? GROUP BY t.workflow HAVING COUNT(*)=1 "
                "ORDER BY w.created_at DESC", (ref,)).fetchall()
        return [{"workflow": r[0], "task": r[1], "status": r[2]} for r in rows]

    # -- controllers (hypercli.controller) ----------------------------------------------
    def put_controller(self, name: str, spec: dict, status: str = "up") -> None:
        """Record a controller (migration ``m011_controllers``) or update its spec/status."""
        now = time.time()
        with self.tx() as db:
            db.execute("INSERT INTO controllers VALUES (?,?,?,?,?) ON CONFLICT(name) DO UPDATE "
                       "SET spec=excluded.spec, status=excluded.status, "
                       "updated_at=excluded.updated_at", (name, _dumps(spec), status, now, now))

    def controllers(self) -> list[dict]:
        """Every controller row, oldest first (``spec`` decoded)."""
        return [_row(r, "spec") for r in
                self.db.execute("SELECT * FROM controllers ORDER BY created_at")]

    # -- a workflow's records, moved between state files (hypercli.controller) ----------
    def export_workflow(self, wid: str) -> dict:
        """Every record of workflow ``wid`` as stored (JSON columns left as their text):
        ``{"workflow": row, "experiments", "tasks", "attempts", "events": [rows],
        "cluster": row or None, "nodes": [rows of its cluster]}``, read in one transaction
        so the parts agree. Raises UsageError: unknown workflow."""
        self.workflow(wid)
        own = not self.db.in_transaction
        if own:
            self.db.execute("BEGIN")  # one read snapshot
        try:
            def rows(q: str, *a) -> list[dict]:
                return [dict(r) for r in self.db.execute(q, a)]
            wf = rows("SELECT * FROM workflows WHERE id=?", wid)[0]
            out = {"workflow": wf,
                   "experiments": rows("SELECT * FROM experiments WHERE workflow=?", wid),
                   "tasks": rows("SELECT * FROM tasks WHERE workflow=? ORDER BY rowid", wid),
                   "attempts": rows("SELECT * FROM attempts WHERE workflow=?", wid),
                   "events": [{k: v for k, v in e.items() if k != "id"} for e in
                              rows("SELECT * FROM events WHERE workflow=? ORDER BY id", wid)],
                   "cluster": (rows("SELECT * FROM clusters WHERE name=?", wf["cluster"])
                               or [None])[0],
                   "nodes": rows("SELECT * FROM nodes WHERE cluster=?", wf["cluster"])}
        finally:
            if own:
                self.db.execute("COMMIT")
        return out

    def import_workflow(self, data: dict, *, nodes: bool = True, **workflow) -> str:
        """Replace workflow ``data["workflow"]["id"]``'s records here by those of
        :meth:`export_workflow` ``data`` (from another state file), in one transaction;
        with ``nodes``, also its cluster's row and node rows. ``workflow``: columns of the
        workflow row to set instead of the exported values (``driver_pid=None``). Columns
        this file lacks are left out (another hypercli's newer schema). Returns the id."""
        wid = data["workflow"]["id"]
        wf = {**data["workflow"], **workflow}
        with self.tx() as db:
            have = {t: {r[1] for r in db.execute(f"PRAGMA table_info({t})")} for t in
                    ("workflows", "experiments", "tasks", "attempts", "events", "clusters",
                     "nodes")}

            def put(table: str, rows: list[dict], key: str | None = None) -> None:
                for r in rows:
                    cols = [c for c in r if c in have[table]]
                    upsert = (f" ON CONFLICT({key}) DO UPDATE SET " + ", ".join(
                        f"{c}=excluded.{c}" for c in cols if c != key)) if key else ""
                    db.execute(f"INSERT INTO {table} ({', '.join(cols)}) VALUES "
                               f"({', '.join('?' * len(cols))}){upsert}", [r[c] for c in cols])
            if nodes and data.get("cluster"):
                put("clusters", [data["cluster"]], "name")
                put("nodes", data.get("nodes") or [], "name")
            for table in ("events", "attempts", "tasks", "experiments"):
                db.execute(f"DELETE FROM {table} WHERE workflow=?", (wid,))
            put("workflows", [wf], "id")
            for table in ("experiments", "tasks", "attempts", "events"):
                put(table, data.get(table) or [])
        return wid

    # -- a change log of workflows' rows (a controller's backups, hypercli.controller) ------
    #: tables whose inserts and updates :meth:`track_changes` records: (table, workflow column)
    TRACKED = (("tasks", "workflow"), ("attempts", "workflow"), ("workflows", "id"))

    def track_changes(self) -> None:
        """Record every insert and update of a ``tasks``, ``attempts`` or ``workflows`` row,
        by any connection, in the table ``row_changes`` (SQLite triggers), so that
        :meth:`export_changes` gives a workflow's rows changed since a mark in O(changes).
        Idempotent; only a controller's state file gets them (each tracked write then
        inserts one small row more; :meth:`forget_changes` removes them)."""
        with self.tx() as db:
            db.execute("CREATE TABLE IF NOT EXISTS row_changes (seq INTEGER PRIMARY KEY "
                       "AUTOINCREMENT, tbl TEXT NOT NULL, workflow TEXT NOT NULL, "
                       "id TEXT NOT NULL)")
            for table, wcol in self.TRACKED:
                for op in ("INSERT", "UPDATE"):
                    db.execute(f"CREATE TRIGGER IF NOT EXISTS row_changes_{table}_{op.lower()} "
                               f"AFTER {op} ON {table} BEGIN INSERT INTO row_changes (tbl, "
                               f"workflow, id) VALUES ('{table}', NEW.{wcol}, NEW.id); END")

    def export_changes(self, wid: str, since: dict | None = None) -> dict:
        """Workflow ``wid``'s records in one read snapshot, with ``"mark": {"changes": the
        newest row_changes seq, "events": the newest event id}`` as of that snapshot. With
        ``since`` None, the whole records (:meth:`export_workflow`); with a mark, only what
        changed after it (:meth:`track_changes` on): ``{"workflow": row, "tasks",
        "attempts": rows inserted or updated since, "events": rows added since, with their
        ``id``, "mark"}``. Raises UsageError: unknown workflow."""
        self.workflow(wid)
        own = not self.db.in_transaction
        if own:
            self.db.execute("BEGIN")
        try:
            def rows(q: str, *a) -> list[dict]:
                return [dict(r) for r in self.db.execute(q, a)]
            tracked = bool(rows("SELECT name FROM sqlite_master WHERE name='row_changes'"))
            mark = {"changes": (rows("SELECT max(seq) AS m FROM row_changes")[0]["m"] or 0)
                    if tracked else 0,
                    "events": rows("SELECT max(id) AS m FROM events")[0]["m"] or 0}
            if since is None:
                return {**self.export_workflow(wid), "mark": mark}
            ids: dict = {"tasks": set(), "attempts": set(), "workflows": set()}
            for r in rows("SELECT tbl, id FROM row_changes WHERE seq > ? AND seq <= ? AND "
                          "workflow = ?", since["changes"], mark["changes"], wid):
                ids[r["tbl"]].add(r["id"])

            def these(table: str, extra: str, *a) -> list[dict]:
                got, want = [], sorted(ids[table])
                for i in range(0, len(want), 500):  # SQLite's limit on parameters
                    part = want[i:i + 500]
                    got += rows(f"SELECT * FROM {table} WHERE {extra} id IN "
                                f"({','.join('?' * len(part))})", *a, *part)
                return got
            return {"workflow": rows("SELECT * FROM workflows WHERE id=?", wid)[0],
                    "tasks": these("tasks", "workflow=? AND", wid),
                    "attempts": these("attempts", ""),
                    "events": rows("SELECT * FROM events WHERE id > ? AND id <= ? AND "
                                   "workflow=? ORDER BY id", since["events"],
                                   mark["events"], wid),
                    "mark": mark}
        finally:
            if own:
                self.db.execute("COMMIT")

    def forget_changes(self, wid: str, upto: int) -> None:
        """Remove the ``row_changes`` of workflow ``wid`` up to seq ``upto`` (written to a
        majority of its backups: no longer needed)."""
        with self.tx() as db:
            db.execute("DELETE FROM row_changes WHERE seq <= ? AND workflow = ?", (upto, wid))

    # -- utilisation samples (hypercli.usage) ------------------------------------------------
    def add_samples(self, rows: Iterable[dict]) -> int:
        """Store samples: each ``{"node": str, "attempt": str | None, "ts": unix s,
        "data": {...}}`` (``span`` optional, default 0: a raw sample). Returns how many."""
        vals = [(r["node"], r.get("attempt"), float(r["ts"]), float(r.get("span") or 0),
                 _dumps(r["data"])) for r in rows]
        if vals:
            with self.tx() as db:
                db.executemany("INSERT INTO samples VALUES (?,?,?,?,?)", vals)
        return len(vals)

    def samples(self, *, node: str | None = None, attempt: str | None = None,
                nodes_only: bool = False, since: float | None = None,
                until: float | None = None) -> list[dict]:
        """Samples, oldest first, as ``{"node", "attempt", "ts", "span", "data"}``: of one
        node (``node``; with ``nodes_only`` its own samples, not its attempts'), of one
        attempt, or all; ``since``/``until`` bound ``ts`` (unix s, inclusive)."""
        where, args = [], []
        for col, v in (("node", node), ("attempt", attempt)):
            if v is not None:
                where.append(f"{col}=?")
                args.append(v)
        if nodes_only:
            where.append("attempt IS NULL")
        if since is not None:
            where.append("ts>=?")
            args.append(since)
        if until is not None:
            where.append("ts<=?")
            args.append(until)
        sql = "SELECT * FROM samples" + (" WHERE " + " AND ".join(where) if where else "")
        rows = self.db.execute(sql + " ORDER BY ts, rowid", args).fetchall()
        return [_row(r, "data") for r in rows]

    def compact_samples(self, before: float, bucket: float = 60.0) -> int:
        """Replace the raw samples older than ``before`` (unix s) by one mean per node,
        attempt and ``bucket`` s (:func:`hypercli.usage.mean_of`); returns the number of raw
        samples replaced. Means are never compacted again."""
        from hypercli.usage import mean_of
        with self.tx() as db:
            rows = db.execute("SELECT rowid, * FROM samples WHERE span=0 AND ts<? "
                              "ORDER BY ts", (before,)).fetchall()
            if not rows:
                return 0
            groups: dict[tuple, list] = {}
            for r in rows:
                key = (r["node"], r["attempt"], int(r["ts"] // bucket))
                groups.setdefault(key, []).append(json.loads(r["data"]))
            db.executemany("DELETE FROM samples WHERE rowid=?", [(r["rowid"],) for r in rows])
            db.executemany("INSERT INTO samples VALUES (?,?,?,?,?)",
                           [(n, a, k * bucket, bucket, _dumps(mean_of(data)))
                            for (n, a, k), data in groups.items()])
        return len(rows)

    def forget_cluster(self, name: str) -> int:
        """Delete a cluster's row and its nodes' rows (its workflows, attempts and events are
        kept); returns the number of node rows deleted. The caller checks that it is down."""
        with self.tx() as db:
            n = db.execute("DELETE FROM nodes WHERE cluster=?", (name,)).rowcount
            db.execute("DELETE FROM clusters WHERE name=?", (name,))
            db.execute("DELETE FROM pools WHERE cluster=?", (name,))
            db.execute("DELETE FROM cluster_ids WHERE name=?", (name,))
            self._event(db, "cluster", f"{name} forgotten ({n} node rows deleted)")
        return n


def _row(r: sqlite3.Row | None, *json_cols: str) -> dict | None:
    if r is None:
        return None
    d = dict(r)
    for c in json_cols:
        if d.get(c) is not None:
            d[c] = json.loads(d[c])
    return d
