"""This machine's side of a controller: hand a workflow over, look at it there, take it back.

A workflow handed to a controller keeps its records here too (planned here, as any run's),
with ``spec["controller"]`` = ``{"name": "user@host:port", "holder": its lease holder,
"replicas": [node names]}``; while that link is open (neither ``done`` nor ``taken``), no
process here drives it, and ``ps``, ``logs``, ``results``, ``outputs``, ``attach`` first copy
the controller's records over this file's (:func:`refresh`), then show them as for any
workflow; ``cancel`` is done by the controller. When the workflow has ended there, its
records, log copies and ``file://`` outputs are copied here once and the link is closed
(``done``), so they stay readable after the controller is gone.

A controller that does not answer is taken over (:func:`takeover`): the newest backup is read
from a majority of the cluster's nodes (:mod:`hypercli.controller.backup`), the controller's
lease is waited out, this machine's lease (no expiry) is written in its place, and the
records go into this file; the workflow is then driven here, by ``hyper run`` or the
background driver, which re-attach to the running attempts.
"""

from __future__ import annotations

import base64
import io
import json
import os
import secrets
import shlex
import socket
import tarfile
import time
from pathlib import Path
from typing import Callable

from hypercli import state as S
from hypercli.errors import HyperError, InfraError, UsageError

REL_HOME = ".hyper/controller"  #: the controller's HYPER_HOME, under its user's home
NEEDS = ("paramiko", "yaml")  #: third-party modules the driver needs on the controller


def spec_of(cluster, asked: bool = False) -> dict | None:
    """A controller named by a recipe's ``cluster:`` (``ClusterSpec``): ``{"name":
    "user@host:port", "host", "port", "user", "identity_file", "python"}``; for a cloud
    cluster with ``controller: true`` (or ``asked``: ``hyper run --controller``),
    ``{"pending": the ClusterSpec}``, the controller instance to be found or launched
    (:func:`hypercli.controller.cloud.ensure`); else None.

    Raises:
        UsageError: a controller for a cluster whose provider is neither ssh nor a cloud
            with controllers; no ``identity_file`` (the controller needs the cluster's key).
    """
    from hypercli.controller.cloud import CLOUDS
    from hypercli.ssh.conn import Target
    o = cluster.options
    if cluster.provider in CLOUDS and (o.get("controller") or asked):
        return {"pending": cluster}
    if not o.get("controller"):
        return None
    if cluster.provider != "ssh":
        raise UsageError(f"a controller is for ssh clusters here, not {cluster.provider}",
                         "drop controller: from the recipe's cluster")
    if not o.get("identity_file"):
        raise UsageError("cluster.controller needs cluster.identity_file: the controller "
                         "reaches the nodes with that key", "set identity_file: ~/.ssh/KEY")
    t = Target.parse(o["controller"], user=o.get("user"))
    key = os.path.expanduser(o["identity_file"])
    return {"name": str(t), "host": t.host, "port": t.port, "user": t.user,
            "identity_file": key, "python": o.get("controller_python") or "python3"}


def link_of(wf: dict) -> dict | None:
    """A workflow's open controller link (module docstring), else None."""
    ctl = (wf.get("spec") or {}).get("controller")
    if not ctl or ctl.get("done") or ctl.get("taken"):
        return None
    return ctl


def _set_link(state: S.State, wid: str, **fields) -> None:
    wf = state.workflow(wid)
    spec = dict(wf.get("spec") or {})
    spec["controller"] = {**(spec.get("controller") or {}), **fields}
    state.set_workflow(wid, spec=json.dumps(spec))


class Controller:
    """One SSH connection to a controller host (pinned host key, in
    ``$HYPER_HOME/known_hosts/@controllers``) and the requests it answers.

    Raises (on creation):
        HostUnreachable, AuthFailed, HostKeyUnknown, HostKeyChanged.
    """

    def __init__(self, spec: dict, trust_new: bool = False):
        from hypercli.ssh.conn import Connection, Target
        from hypercli.ssh.hostkeys import KnownHosts
        self.spec = spec
        (S.home() / "known_hosts").mkdir(mode=0o700, exist_ok=True)
        known = KnownHosts(path=S.home() / "known_hosts" / "@controllers")
        self.conn = Connection(f"controller {spec['name']}",
                               Target(spec["host"], spec["port"], spec["user"],
                                      spec["identity_file"]), known, trust_new=trust_new)

    def _lib(self) -> str:
        from hypercli.node.bundle import bundle
        return f"$HOME/.hyper/lib/{bundle()[0]}"

    def installed(self) -> bool:
        """Whether hypercli's code is there (nothing of a controller runs there before)."""
        return self.conn.run(f"test -d {self._lib()}", check=False).exit_code == 0

    def install(self) -> None:
        """Copy hypercli's code there (the bundle nodes get, when missing) and check that
        its Python has the driver's other packages.

        Raises:
            UsageError: they are missing (the message names them and the fix).
        """
        from hypercli.node.bundle import bundle
        lib = self._lib()
        if self.conn.run(f"test -d {lib}", check=False).exit_code != 0:
            self.conn.run(f"test -d {lib} || {{ mkdir -p {lib}.tmp && tar -C {lib}.tmp -xf - "
                          f"&& mv {lib}.tmp {lib}; }}; cat >/dev/null", stdin=bundle()[1],
                          timeout=120)
        py = shlex.quote(self.spec["python"])
        r = self.conn.run(f"PYTHONPATH={lib} {py} -c 'import {', '.join(NEEDS)}; "
                          "import hypercli.controller.host'", check=False)
        if r.exit_code != 0:
            tail = r.stderr.decode(errors="replace").strip().splitlines()[-1:] or ["?"]
            raise UsageError(f"the controller {self.spec['name']} cannot run the driver with "
                             f"{self.spec['python']}: {tail[0]}",
                             "install hypercli's packages there (pip install paramiko pyyaml)"
                             ", or set cluster.controller_python to a Python that has them")

    def request(self, op: str, *args: str, stdin: bytes | None = None, raw: bool = False,
                timeout: float = 120.0):
        """Run ``python -m hypercli.controller OP ARGS`` there; its JSON answer (bytes with
        ``raw``). Raises the HyperError it answered with (as InfraError, with its hint);
        HostUnreachable."""
        py = shlex.quote(self.spec["python"])
        cmd = (f"cd && HYPER_HOME=$HOME/{REL_HOME} PYTHONPATH={self._lib()} exec {py} -m "
               f"hypercli.controller {op} " + " ".join(shlex.quote(a) for a in args))
        r = self.conn.run(cmd, stdin=stdin, timeout=timeout, check=False)
        if raw and r.exit_code == 0:
            return r.stdout
        try:
            out = json.loads(r.stdout or b"{}")
        except ValueError:
            out = {"error": (r.stderr or r.stdout).decode(errors="replace").strip()[-500:]
                   or f"exit code {r.exit_code}"}
        if r.exit_code != 0 or "error" in out:
            cls = UsageError if out.get("exit_code") == 2 else InfraError
            raise cls(f"controller {self.spec['name']}: {out.get('error')}", out.get("hint"))
        return out

    def stream(self, op: str, *args: str, timeout: float = 60.0):
        """Run ``python -m hypercli.controller OP ARGS`` there and yield each JSON line it
        writes, as it comes, until it ends.

        Raises:
            InfraError, UsageError: it answered an error (with its hint).
            HostUnreachable: the connection died, or no line came for ``timeout`` s.
        """
        from hypercli.ssh.conn import HostUnreachable
        py = shlex.quote(self.spec["python"])
        cmd = (f"cd && HYPER_HOME=$HOME/{REL_HOME} PYTHONPATH={self._lib()} exec {py} -m "
               f"hypercli.controller {op} " + " ".join(shlex.quote(a) for a in args))
        ch = self.conn.channel()
        ch.settimeout(timeout)
        try:
            ch.exec_command(cmd)
            ch.shutdown_write()
            f = ch.makefile("rb")
            while True:
                try:
                    line = f.readline()
                except Exception as e:  # a timeout, or paramiko's errors of a broken session
                    raise HostUnreachable(self.spec["name"], f"`{op}` stopped: {e}") from None
                if not line:
                    return
                try:
                    out = json.loads(line)
                except ValueError:
                    raise InfraError(f"controller {self.spec['name']}: `{op}` wrote "
                                     f"{line[:200]!r}") from None
                if "error" in out:
                    cls = UsageError if out.get("exit_code") == 2 else InfraError
                    raise cls(f"controller {self.spec['name']}: {out.get('error')}",
                              out.get("hint"))
                yield out
        finally:
            ch.close()

    def close(self) -> None:
        self.conn.close()


def connect(spec: dict, trust_new: bool = False) -> Controller:
    """:class:`Controller`, its failure to connect said in the user's words.

    Raises:
        InfraError: it cannot be reached (the hint says how to take its workflows over).
    """
    from hypercli.ssh.hostkeys import HostKeyChanged, HostKeyUnknown
    try:
        return Controller(spec, trust_new)
    except (HostKeyUnknown, HostKeyChanged):
        raise
    except HyperError as e:
        raise Unreachable(spec["name"], str(e)) from None


class Unreachable(InfraError):
    """The controller host does not answer."""

    def __init__(self, name: str, why: str):
        super().__init__(f"controller {name} does not answer: {why}",
                         "`hyper attach WORKFLOW` takes its workflow over from the backups "
                         "on the cluster's nodes")
        self.name = name


# -- hand over -------------------------------------------------------------------------------
def _workdir_tar(root: str) -> str | None:
    """base64 of a tar of the workdir's files as :mod:`hypercli.workdir` sends them."""
    if not root:
        return None
    from hypercli import workdir
    m = workdir.build(root, skip=S.home())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for rel, kind, *_ in m.entries:
            if kind in ("d", "f", "l"):
                tar.add(str(Path(m.root) / rel), arcname=rel, recursive=False)
    return base64.b64encode(buf.getvalue()).decode()


def handover(state: S.State, wid: str, spec: dict, *, trust_new: bool = False,
             log: Callable[[str], None] = lambda s: None) -> dict:
    """Hand workflow ``wid`` (recorded here, its cluster up) to the controller ``spec``
    (:func:`spec_of`): its records, the cluster's pinned host keys and key, its workdir.
    Returns the controller's answer ``{"workflow", "pid"}``; the workflow's link is open.

    Raises:
        UsageError: the workflow has secrets or private-registry credentials (they are
            never written anywhere, so a controller could not have them); the controller's
            Python lacks a package.
        Unreachable; LeaseLost (another driver holds the workflow).
    """
    from hypercli.controller.backup import KEY_FIELD, new_key
    wf = state.workflow(wid)
    wspec = wf.get("spec") or {}
    if wspec.get("secrets") or wspec.get("registry_auth"):
        raise UsageError(f"{wid} has secrets or registry credentials, which are never "
                         "stored, so a controller could not have them",
                         "run it without a controller (hyper run -d)")
    old = (wspec.get("controller") or {})
    holder = f"controller {spec['name']} {secrets.token_hex(4)}"
    if not wspec.get(KEY_FIELD):  # signs its backups (hypercli.controller.backup)
        state.set_workflow(wid, spec=json.dumps({**wspec, KEY_FIELD: new_key()}))
    export = state.export_workflow(wid)
    known = S.home() / "known_hosts" / wf["cluster"]
    data = {"export": export, "holder": holder, "handoff": old.get("taken"),
            "seq": old.get("seq", 0),
            "known_hosts": known.read_text() if known.exists() else "",
            "key": Path(spec["identity_file"]).read_text(),
            "workdir": _workdir_tar(wf["workdir"])}
    if (export.get("cluster") or {}).get("provider") not in (None, "ssh", "local"):
        from hypercli.controller.cloud import handover_data
        data.update(handover_data(state, wf["cluster"]))  # the cloud cluster's own key
    ctl = connect(spec, trust_new)
    try:
        ctl.install()
        log(f"handing {wid} to the controller {spec['name']}")
        out = ctl.request("submit", stdin=json.dumps(data, default=str).encode(), timeout=300)
    finally:
        ctl.close()
    replicas = [n["name"] for n in export["nodes"] if n["status"] == "up"]
    state.put_controller(spec["name"], spec)
    _set_link(state, wid, name=spec["name"], holder=holder, replicas=replicas, done=False,
              taken=None)
    state.set_workflow(wid, detached=0, driver_pid=None)
    state.event("workflow", f"handed to the controller {spec['name']}", workflow=wid)
    return out


#: what of a task's row is taken from a controller's records or a backup (the rest, the plan,
#: is this machine's own)
TASK_PROGRESS = ("status", "attempts", "metrics", "ended_at", "wait")


def _as_planned(state: S.State, wid: str, export: dict) -> dict:
    """A controller's records (or a backup, which any task on a node could have written)
    reduced to the progress of the workflow planned here: the workflow row, experiments and
    tasks' plans (commands, parameters, environment, cluster, storage) stay this machine's;
    only statuses, metrics and the attempts of its tasks on its cluster's nodes come in."""
    mine = state.export_workflow(wid)
    theirs = export.get("workflow") or {}
    wf = {**mine["workflow"], **{k: theirs[k] for k in ("status", "ended_at") if k in theirs}}
    got = {t.get("id"): t for t in export.get("tasks") or [] if t.get("workflow") == wid}
    tasks = [{**t, **{k: got[t["id"]][k] for k in TASK_PROGRESS if k in got.get(t["id"], {})}}
             for t in mine["tasks"]]
    ids, nodes = {t["id"] for t in tasks}, {n["name"] for n in mine["nodes"]}
    attempts = [a for a in export.get("attempts") or []
                if a.get("workflow") == wid and a.get("task") in ids and a.get("node") in nodes
                and str(a.get("id", "")).startswith(f"{wid}.")]
    events = [e for e in export.get("events") or [] if e.get("workflow") == wid]
    return {**mine, "workflow": wf, "tasks": tasks, "attempts": attempts, "events": events}


# -- look at it there ------------------------------------------------------------------------
def _spec(state: S.State, name: str) -> dict:
    row = next((c for c in state.controllers() if c["name"] == name), None)
    if row is None:
        raise UsageError(f"no controller {name!r} is known here", "`hyper status` lists them")
    if row["status"] != "up":
        raise Unreachable(name, "it was removed (`hyper down --controller`)")
    return row["spec"]


def refresh(state: S.State, wid: str, ctl: Controller | None = None,
            usage: bool = False) -> dict | None:
    """Copy the records of a workflow driven by a controller over this file's, and the cost
    ledger's rows of its cluster (:func:`_take_ledger`); with ``usage``, also the
    utilisation samples of its cluster's nodes taken since the last copy (``hyper top``,
    ``hyper ui``); when it has ended there, its log copies and outputs too, and close the
    link. Returns the controller's ``{"driven", "lost", "status"}``, or None for a workflow
    with no open link.

    Raises:
        Unreachable: the controller does not answer.
    """
    wf = state.workflow(wid)
    link = link_of(wf)
    if link is None:
        return None
    own = ctl is None
    if own:
        ctl = connect(_spec(state, link["name"]))
    try:
        since = link.get("samples_at") or 0.0
        return _take(state, wid, ctl, ctl.request("export", wid, *(
            [repr(float(since))] if usage else [])))
    finally:
        if own:
            ctl.close()


def _take(state: S.State, wid: str, ctl: Controller, out: dict) -> dict:
    """Copy one answer of the controller's ``export`` (:func:`refresh`) over this file's
    records of ``wid``; when the workflow has ended there, its log copies and outputs too
    (over ``ctl``), and close the link. Returns ``{"driven", "lost", "status"}``."""
    wf = state.workflow(wid)
    link = link_of(wf) or {}
    ended = out["export"]["workflow"]["status"] not in ("running", "cancelling")
    if ended:
        _copy_files(state, wf, ctl.request("logs", wid, raw=True, timeout=600))
    spec = dict(wf.get("spec") or {})
    spec["controller"] = {**link, "done": True} if ended else dict(link)
    names = {n["name"] for n in state.nodes(wf["cluster"])}
    samples = [r for r in out.get("samples") or [] if r.get("node") in names
               and isinstance(r.get("ts"), (int, float)) and isinstance(r.get("data"), dict)]
    if samples:  # the next copy asks for the ones after these
        spec["controller"]["samples_at"] = max(r["ts"] for r in samples) + 1e-6
        state.add_samples(samples)
    _take_ledger(state, wf["cluster"], out.get("ledger") or [])
    state.import_workflow(_as_planned(state, wid, out["export"]), nodes=False,
                          driver_pid=None, detached=0, spec=json.dumps(spec))
    if ended:  # a cloud controller may now remove itself when idle
        try:
            ctl.request("collected", wid)
        except HyperError:
            pass
    return {"driven": out["driven"], "lost": out["lost"],
            "status": out["export"]["workflow"]["status"]}


def _take_ledger(state: S.State, cluster: str, rows: list[dict]) -> None:
    """Add here the cost ledger's rows of ``cluster`` that a controller has (instances it
    launched: replacements, pool nodes), and the ends it recorded (``hyper cost``). A row
    recorded here already keeps its launch; an end recorded here is never overwritten."""
    for r in rows:
        if not isinstance(r, dict) or r.get("cluster") != cluster or not r.get("instance_id"):
            continue
        state.ledger_launch(cluster, str(r.get("node")), str(r["instance_id"]), r)
        if r.get("ended_at") is not None:
            state.ledger_end_instances(r.get("cloud") or "", [str(r["instance_id"])],
                                       at=float(r["ended_at"]),
                                       reason=r.get("end_reason") or "down")


def _copy_files(state: S.State, wf: dict, data: bytes) -> None:
    """Put the controller's log copies and ``file://`` outputs of a workflow here (each
    member checked by :func:`hypercli.untar.extract`; what is here already is kept)."""
    import shutil

    from hypercli.untar import extract
    if not data:
        return
    tmp = S.folder("logs") / f".from-controller-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        extract(data, tmp)
        for d in (tmp / "logs").glob("*") if (tmp / "logs").is_dir() else []:
            dest = S.folder("logs") / d.name
            if d.is_dir() and not dest.exists():
                os.replace(d, dest)
        out = tmp / "outputs"
        if out.is_dir() and wf["storage"].startswith("file://"):
            dest = Path(wf["storage"][7:]) / wf["id"]
            dest.mkdir(parents=True, exist_ok=True)
            for d in out.iterdir():
                if not (dest / d.name).exists():
                    os.replace(d, dest / d.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def refreshed(state: S.State, wid: str, note: Callable[[str], None]) -> None:
    """:func:`refresh` a workflow when a controller drives it; when that controller does not
    answer, ``note`` gets a line saying the states shown are as last copied here."""
    try:
        refresh(state, wid)
    except HyperError as e:
        note(f"{wid}: states as last copied from its controller ({e}); `hyper attach {wid}` "
             "takes it over")


def refresh_all(state: S.State, note: Callable[[str], None] = lambda s: None, *,
                usage: bool = False, conns: dict | None = None) -> None:
    """:func:`refresh` every workflow with an open link (with ``usage``: and the samples of
    its nodes); one that cannot be refreshed is named through ``note`` and shown as last
    known. ``conns``: controller name → :class:`Controller`, the connections to use and keep
    open for the next call (``hyper top`` and ``hyper ui`` refresh every few seconds over
    one connection per controller); the caller closes them. Without it, one connection per
    controller is opened and closed here."""
    own = conns is None
    conns = {} if own else conns
    try:
        for wf in state.workflows():
            link = link_of(wf)
            if link is None:
                continue
            try:
                if link["name"] not in conns:
                    conns[link["name"]] = connect(_spec(state, link["name"]))
                refresh(state, wf["id"], conns[link["name"]], usage=usage)
            except HyperError as e:
                bad = conns.pop(link["name"], None)  # opened again next time
                if bad is not None:
                    bad.close()
                note(f"{wf['id']}: states as last copied here ({e})")
    finally:
        if own:
            for c in conns.values():
                c.close()


def cancel(state: S.State, ref: str) -> tuple[str, int] | None:
    """Cancel a workflow (or ``WORKFLOW/TASK``) that a controller drives, there; None when
    no controller drives it. Returns (what, tasks cancelled)."""
    wid = state.workflow(ref.rsplit("/", 1)[0] if "/" in ref else ref)["id"]
    link = link_of(state.workflow(wid))
    if link is None:
        return None
    ctl = connect(_spec(state, link["name"]))
    try:
        out = ctl.request("cancel", ref)
        for _ in range(60):  # until its scheduler has confirmed the cancel
            if refresh(state, wid, ctl)["status"] != "cancelling" or "/" in ref:
                break
            time.sleep(0.5)
    finally:
        ctl.close()
    return out["what"], out["tasks"]


def follow(state: S.State, wid: str, *, interval: float = 1.0,
           on_change: Callable[[], None] = lambda: None) -> str:
    """Copy a controller's records of ``wid`` here every ``interval`` s, calling
    ``on_change`` when the task counts change, until the workflow ends; returns its final
    status. One process there writes them as they change (``python -m hypercli.controller
    follow``, :func:`hypercli.controller.host.follow`) over one connection.

    Raises:
        Unreachable: the controller stopped answering (the hint says how to take over).
        InfraError: the controller no longer drives it (its lease was lost).
    """
    link = link_of(state.workflow(wid))
    spec = _spec(state, link["name"])
    ctl = connect(spec)
    last = None
    try:
        answers = ctl.stream("follow", wid, repr(float(interval)),
                             timeout=max(60.0, 10 * interval))
        while True:
            try:
                out = next(answers, None)
                if out is None:  # the process there ended before the workflow did
                    raise InfraError("its follow stream ended")
                if not out:  # nothing changed: it still answers
                    continue
                r = _take(state, wid, ctl, out)
            except HyperError as e:
                raise Unreachable(spec["name"], str(e)) from None
            counts = state.counts(wid)
            if counts != last:
                last = counts
                on_change()
            if r["status"] not in ("running", "cancelling"):
                return state.workflow(wid)["status"]
            if r["lost"]:
                raise InfraError(f"the controller no longer drives {wid}: {r['lost']}",
                                 f"`hyper attach {wid}` takes it over")
    finally:
        ctl.close()


# -- take it back ----------------------------------------------------------------------------
def takeover(state: S.State, wid: str, *, wait: float | None = None,
             log: Callable[[str], None] = lambda s: None) -> int:
    """Take a workflow over from a controller that does not drive it any more (module
    docstring): waits up to ``wait`` s (default three lease times) for its lease to expire.
    A workflow that had ended there is then complete here, and the controller's backups of
    it are removed (:func:`drop_backups`). Returns the sequence number of the backup taken.

    Raises:
        UsageError: no open controller link.
        NoQuorum: too few of the cluster's nodes answer to know the newest backup.
        InfraError: no backup was found; the lease is still renewed (the controller is
            alive, only not reachable from here).
    """
    from hypercli.cluster import provider_of
    from hypercli.controller.backup import (LEASE_TTL, LeaseLost, NoQuorum, Replicas, pack,
                                            unpack, with_changes, with_intents)
    wf = state.workflow(wid)
    link = link_of(wf)
    if link is None:
        raise UsageError(f"{wid} is not driven by a controller")
    wait = LEASE_TTL * 3 if wait is None else wait
    nodes = [n for n in state.nodes(wf["cluster"]) if n["name"] in link["replicas"]]
    holder = f"here {socket.gethostname()} {secrets.token_hex(4)}"
    reps = Replicas(provider_of(state, wf["cluster"]), nodes, wf, holder, ttl=None)
    end = time.monotonic() + wait
    try:
        while True:
            answered = reps.read()  # a launch's witness may be on a node with no record yet
            found = [g for g in answered if g["found"]]
            kept = [g for g in found if g.get("blob")]  # HMACs verified (backup.trusted)
            if not kept:
                raise InfraError(f"no backup of {wid} is on its nodes",
                                 f"`hyper run {wf['recipe_path'] or wf['name']}` runs it here "
                                 "from its records as copied last")
            newest = max(kept, key=lambda g: g["seq"])
            live = reps.held(found)  # a lease on fewer than a majority is no holder's
            if live:
                left = max(float("inf") if g["left"] is None else g["left"] for g in live)
                if time.monotonic() + left > end:
                    raise InfraError(f"{live[0]['holder']} still holds the lease of {wid} "
                                     f"(renewed on {live[0]['node']}): it is alive, only not "
                                     "reachable from here", "try again once it can be "
                                     "reached; `hyper ps` then shows it")
                log(f"waiting {left:.0f} s for the controller's lease on {wid} to expire")
                time.sleep(min(left + 0.5, 5.0))
                continue
            try:
                export = with_intents(with_changes(unpack(newest["blob"]), newest["seq"],
                                                   found), newest["seq"], answered)
            except ValueError as e:
                raise InfraError(f"the backup of {wid} on {newest['node']} cannot be read: "
                                 f"{e}") from None
            reps.seq = max([newest["seq"]] + [i.get("seq", 0) for g in answered
                                              for i in (g.get("intents") or [])
                                              + (g.get("log") or [])])
            try:
                reps.write(pack(export))  # the intents in it: none is lost if this dies
            except (LeaseLost, NoQuorum) as e:  # renewed meanwhile, or held where a
                if time.monotonic() > end:      # replica did not answer: look again
                    raise InfraError(f"the lease of {wid} could not be taken: {e}",
                                     "try again once the cluster's nodes answer") from None
                time.sleep(1.0)
                continue
            break
    finally:
        reps.close()
    spec = dict(wf.get("spec") or {})
    spec["controller"] = {**link, "taken": holder, "seq": reps.seq}
    state.import_workflow(_as_planned(state, wid, export), nodes=False, driver_pid=None,
                          detached=0, spec=json.dumps(spec))
    state.event("workflow", f"taken over from the controller {link['name']} (backup "
                f"{newest['seq']} from {newest['node']})", workflow=wid)
    log(f"took {wid} over from the controller {link['name']} (its backup {newest['seq']})")
    if state.workflow(wid)["status"] in ("succeeded", "failed", "cancelled"):
        drop_backups(state, wid)  # it had ended there: nothing here will drive it to an end
    return newest["seq"]


def drop_backups(state: S.State, wid: str) -> int | None:
    """Remove a controller's backups of workflow ``wid`` from its replica nodes once the
    workflow was taken over here (:func:`takeover`) and has ended here: its records are in
    this state file then, and nothing else would remove them. Only the files the backups'
    server made for this workflow go (:meth:`~hypercli.controller.backup.Replicas.drop`,
    under this machine's lease, which the takeover wrote there); a node that does not answer
    keeps them (its instance is gone, or `hyper down` removes what it holds). Done once: the
    link records it (``dropped``). Returns how many replicas removed them, or None when
    there is nothing to do (not taken over, not ended, done before). Never raises for an
    unreachable node."""
    from hypercli.cluster import provider_of
    from hypercli.controller.backup import Replicas
    wf = state.workflow(wid)
    ctl = (wf.get("spec") or {}).get("controller") or {}
    if not ctl.get("taken") or ctl.get("dropped") or \
            wf["status"] not in ("succeeded", "failed", "cancelled"):
        return None
    nodes = [n for n in state.nodes(wf["cluster"]) if n["name"] in ctl.get("replicas", [])]
    try:
        reps = Replicas(provider_of(state, wf["cluster"]), nodes, wf, ctl["taken"], ttl=None)
        try:
            dropped = reps.drop()
        finally:
            reps.close()
    except HyperError as e:
        state.event("workflow", f"the controller's backups were not removed: {e}",
                    workflow=wid)
        return 0
    _set_link(state, wid, dropped=True)
    state.event("workflow", f"the controller's backups removed from {dropped} of "
                f"{len(nodes)} nodes", workflow=wid)
    return dropped


# -- status and down -------------------------------------------------------------------------
def controller_rows(state: S.State) -> list[dict]:
    """What ``hyper status`` shows of each controller known here: ``{"controller", "status"
    ("up", "not answering", "down"), "pid", "workflows": [ids it drives], "error", "cloud":
    its cluster's name or None, "cost": (USD so far, USD per hour now) of a cloud's
    instance (:mod:`hypercli.controller.cloud`), else None}``."""
    from hypercli.controller.cloud import cost
    rows = []
    for c in state.controllers():
        row = {"controller": c["name"], "status": c["status"], "pid": None, "workflows": [],
               "error": None, "cloud": (c["spec"].get("cloud") or {}).get("cluster"),
               "cost": cost(state, c["spec"])}
        if c["status"] == "up":
            try:
                ctl = connect(c["spec"])
                try:
                    st = ctl.request("status", timeout=30) if ctl.installed() else \
                        {"pid": None, "workflows": []}
                finally:
                    ctl.close()
                row["pid"] = st["pid"]
                row["workflows"] = [w["id"] for w in st["workflows"]
                                    if w["status"] in ("running", "cancelling")
                                    and not w["lost"]]
            except HyperError as e:
                row["status"], row["error"] = "not answering", str(e)
        rows.append(row)
    return rows


def find(state: S.State, ref: str) -> str:
    """The name of the controller ``ref`` names: its ``user@host:port`` (``user@host`` as
    :class:`~hypercli.ssh.conn.Target` reads it), or a cloud controller's cluster name
    (``ctl-aws-...``, as ``hyper status`` shows it). Raises UsageError: none such."""
    from hypercli.ssh.conn import Target
    for c in state.controllers():
        if c["status"] == "up" and (c["spec"].get("cloud") or {}).get("cluster") == ref:
            return c["name"]
    try:
        return str(Target.parse(ref))
    except ValueError:
        raise UsageError(f"no controller {ref!r} is known here",
                         "`hyper status` lists them") from None


def down(state: S.State, name: str, *, yes: bool = False,
         removed: Callable[[str], None] = lambda s: None) -> list[str]:
    """Stop a controller's service (its tasks stay on their nodes) and remove what hypercli
    made there (``~/.hyper/controller``); a cloud's controller (:mod:`hypercli.controller.
    cloud`) is then removed whole, instance and every resource tagged for it (one line per
    resource to ``removed``), also when it does not answer. Forget it here. Returns the
    workflows it drove.

    Raises:
        UsageError: no such controller; it drives a workflow and ``yes`` is not given.
        Unreachable: it does not answer (a named host).
        CloudError, CredentialsError: a cloud's controller could not be removed.
    """
    spec = _spec(state, name)
    driving: list[str] = []
    try:
        ctl = connect(spec)
    except Unreachable:
        if not spec.get("cloud"):
            raise
        ctl = None  # the instance is removed anyway
    if ctl is not None:
        try:
            if not ctl.installed():  # never handed a workflow: nothing runs there
                st = {"workflows": []}
            else:
                st = ctl.request("status", timeout=30)
            driving = [w["id"] for w in st["workflows"]
                       if w["status"] in ("running", "cancelling") and not w["lost"]]
            if driving and not yes:
                raise UsageError(f"controller {name} drives {', '.join(driving)}",
                                 "`hyper attach WORKFLOW` first, or --yes to stop it anyway "
                                 "(its tasks go on; `hyper attach` takes them over)")
            if "pid" in st:
                ctl.request("stop", timeout=60)
            ctl.conn.run(f"rm -rf -- $HOME/{REL_HOME}", timeout=120)
        finally:
            ctl.close()
    if spec.get("cloud"):
        from hypercli.controller.cloud import remove
        for line in remove(state, spec):
            removed(line)
    state.put_controller(name, spec, status="down")  # kept: its workflows' links name it
    return driving
