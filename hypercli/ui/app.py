"""The dashboard's ASGI application and server (see :mod:`hypercli.ui`).

Pages: ``/`` workflows (live progress) and clusters (nodes with their latest utilisation);
``/w/{workflow}`` its experiments and tasks; ``/w/{workflow}/t/{task}`` a task's attempts,
logs (live while it runs) and CPU/memory/GPU charts; ``/w/{workflow}/r/{experiment}`` the
results: a table sortable by any column, a parallel-coordinates plot of the parameters and
the metric, and the metric against each parameter (the views of Optuna's and W&B's
dashboards). Each page is static HTML + JS that polls its ``/api`` twin.

Rules:
  * Handlers that read the state file or a log are plain functions, which Starlette runs in
    its thread pool: a slow disk, a locked state file or a log that does not answer holds
    one request, never the event loop that serves every other route. Each request opens the
    state file and closes it when done.
  * A log is read only when it is a regular file, opened without following a symlink
    (:func:`hypercli.workflows.log_chunks`): a FIFO or a symlink planted in an attempt
    folder is refused, with the reason in the page.
  * JSON answers are valid JSON: a non-finite metric (a diverged loss) is sent as the string
    ``"NaN"``, ``"Infinity"`` or ``"-Infinity"`` (:func:`hypercli.console.jsonable`), which
    the pages show as nan, inf and -inf.
"""

from __future__ import annotations

import hmac
import html
import secrets
import socket
import time
from pathlib import Path

from starlette.applications import Starlette
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import (FileResponse, HTMLResponse, PlainTextResponse,
                                 RedirectResponse, Response)
from starlette.routing import Route

from hypercli import state as S
from hypercli.console import dumps
from hypercli.errors import HyperError

COOKIE = "hyper_ui_token"
LOG_TAIL = 256 << 10  # bytes of each log stream a task page shows (the end)
POLL_MS = 1500  # ms between a page's looks at its /api twin
#: s after which a node's latest utilisation sample is not shown as current (agents sample
#: every 5 s by default, hypercli.usage.SAMPLE_EVERY, and stop when their node is idle)
SAMPLE_FRESH = 30.0
STATIC = Path(__file__).parent / "static"


def plotly_js() -> Path:
    """plotly.min.js as the plotly Python package ships it (raises UsageError without it)."""
    import plotly
    p = Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    if not p.exists():
        from hypercli.errors import UsageError
        raise UsageError(f"plotly.min.js is not in {p.parent}", "pip install 'hypercli[ui]'")
    return p


class TokenGate(BaseHTTPMiddleware):
    """403 unless the request carries the token (query ``token`` or the cookie); a good
    query token is turned into an HttpOnly cookie and the URL cleaned."""

    def __init__(self, app, token: str):
        super().__init__(app)
        self.token = token

    async def dispatch(self, request: Request, call_next) -> Response:
        given = request.query_params.get("token")
        if given is not None and hmac.compare_digest(given, self.token):
            url = request.url.remove_query_params("token")
            resp = RedirectResponse(str(url.path) + (f"?{url.query}" if url.query else ""),
                                    status_code=303)
            resp.set_cookie(COOKIE, self.token, httponly=True, samesite="strict")
            return resp
        cookie = request.cookies.get(COOKIE, "")
        if not hmac.compare_digest(cookie, self.token):
            return PlainTextResponse("403: open the URL with the token that `hyper ui` "
                                     "printed", status_code=403)
        return await call_next(request)


# -- data (JSON) -----------------------------------------------------------------------------
def _counts(tasks: list[dict]) -> dict:
    out: dict = {}
    for t in tasks:
        c = out.setdefault(t["experiment"], {})
        c[t["status"]] = c.get(t["status"], 0) + 1
    return out


def workflows_data(state: S.State) -> dict:
    """Workflows (newest first) with task counts per status and experiment; clusters with
    their nodes and each node's latest sample."""
    wfs = []
    for w in state.workflows(limit=50):
        tasks = state.tasks(w["id"])
        wfs.append({"id": w["id"], "name": w["name"], "cluster": w["cluster"],
                    "status": w["status"], "created_at": w["created_at"],
                    "ended_at": w["ended_at"], "experiments": _counts(tasks),
                    "total": len(tasks),
                    "done": sum(t["status"] == "succeeded" for t in tasks)})
    clusters = []
    for c in state.clusters():
        nodes = []
        for n in state.nodes(c["name"]):
            last = state.samples(node=n["name"], nodes_only=True,
                                 since=time.time() - 3600)[-1:]
            age = time.time() - last[0]["ts"] if last else None
            nodes.append({"name": n["name"], "status": n["status"], "slots": n["slots"],
                          "sample": last[0]["data"] if last else None,
                          # an idle node's agent stops sampling: its last sample is old news
                          "sample_age": age, "sample_fresh": age is not None and
                          age <= SAMPLE_FRESH})
        clusters.append({"name": c["name"], "provider": c["provider"],
                         "status": c["status"], "nodes": nodes})
    return {"workflows": wfs, "clusters": clusters}


def workflow_data(state: S.State, wid: str) -> dict:
    """One workflow: its counts and its tasks (status, node, attempts, start, duration)."""
    from hypercli.workflows import task_times
    w = state.workflow(wid)
    tasks = state.tasks(w["id"])
    times = task_times(state, w["id"])
    nodes = {a["task"]: a["node"] for a in state.attempts(w["id"])}
    rows = []
    now = time.time()
    for t in tasks:
        start, end = times.get(t["id"], (None, None))
        rows.append({"id": t["id"], "experiment": t["experiment"], "status": t["status"],
                     "node": nodes.get(t["id"]), "attempts": t["attempts"],
                     "started": start,
                     "duration": None if start is None else (end or now) - start})
    return {"id": w["id"], "status": w["status"], "experiments": _counts(tasks),
            "tasks": rows}


def task_data(state: S.State, wid: str, tid: str) -> dict:
    """A task: its attempts, the newest attempt's logs (the last LOG_TAIL bytes of each
    stream) and its utilisation samples."""
    from hypercli.workflows import log_chunks
    attempts = state.attempts(wid, tid)
    logs = {"stdout": b"", "stderr": b""}
    error = None
    if attempts:
        try:
            for stream, data in log_chunks(state, attempts[-1], merge=False):
                logs[stream] = (logs[stream] + data)[-LOG_TAIL:]
        except HyperError as e:
            error = e.message
    samples = [{"ts": s["ts"], **s["data"]} for a in attempts[-1:]
               for s in state.samples(attempt=a["id"])]
    from hypercli.envvars import shown_env
    return {"task": tid, "workflow": wid,
            "env": shown_env(state.workflow(wid), state.task(wid, tid)),  # a secret as ***
            "attempts": [{k: a[k] for k in ("id", "number", "node", "status", "exit_code",
                                             "error", "started_at", "ended_at")}
                         for a in attempts],
            "logs": {k: v.decode(errors="replace") for k, v in logs.items()},
            "log_error": error, "samples": samples}


def results_data(state: S.State, wid: str, exp: str) -> dict:
    """An experiment's finished tasks: parameters and metrics, for the results page."""
    from hypercli.workflows import results
    wid, metric, rows = results(state, wid)
    rows = [r for r in rows if r["experiment"] == exp]
    log = (state.workflow(wid).get("spec") or {}).get("log_params") or {}
    return {"workflow": wid, "experiment": exp, "metric": metric,
            "params": list(dict.fromkeys(k for r in rows for k in r["params"])),
            "log_params": log.get(exp, []),  # drawn with log: true: plotted on log axes
            "metrics": list(dict.fromkeys(k for r in rows for k in r["metrics"])),
            "rows": [{"task": r["task"], "status": r["status"], "params": r["params"],
                      "metrics": r["metrics"]} for r in rows]}


def _json(data, status: int = 200) -> Response:
    """A JSON answer that is valid JSON whatever the numbers in ``data`` (module
    docstring)."""
    return Response(dumps(data, ensure_ascii=False), status_code=status,
                    media_type="application/json")


# -- pages -------------------------------------------------------------------------------------
def _page(title: str, script: str, data: dict) -> HTMLResponse:
    """A page: the shared frame, its ``data`` as JSON (escaped for a script element) and
    its script from ``static/``."""
    blob = dumps(data).replace("<", "\\u003c").replace(">", "\\u003e")
    return HTMLResponse(f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)} · hyper</title>
<link rel="stylesheet" href="/static/ui.css">
<script src="/static/plotly.min.js"></script></head>
<body><header><a href="/">hyper</a> <span id="title">{html.escape(title)}</span></header>
<main id="main"></main>
<script id="page-data" type="application/json">{blob}</script>
<script>window.POLL_MS = {POLL_MS};</script>
<script src="/static/ui.js"></script><script src="/static/{script}"></script>
</body></html>""")


def make_app(token: str) -> Starlette:
    """The dashboard (module docstring) answering only requests with ``token``."""
    async def index(request):
        return _page("workflows", "index.js", {"api": "/api/workflows"})

    async def workflow(request):
        wid = request.path_params["wid"]
        return _page(wid, "workflow.js", {"api": f"/api/w/{wid}", "workflow": wid})

    async def task(request):
        wid, tid = request.path_params["wid"], request.path_params["tid"]
        return _page(f"{wid}/{tid}", "task.js",
                     {"api": f"/api/w/{wid}/t/{tid}", "workflow": wid, "task": tid})

    async def results(request):
        wid, exp = request.path_params["wid"], request.path_params["exp"]
        return _page(f"{wid} {exp} results", "results.js",
                     {"api": f"/api/w/{wid}/r/{exp}", "workflow": wid, "experiment": exp})

    def api(fn):
        def handler(request):  # not async: run in the thread pool (module docstring)
            try:
                state = S.State()
            except HyperError as e:
                return _json({"error": e.message}, 503)
            try:
                return _json(fn(state, **request.path_params))
            except HyperError as e:
                return _json({"error": e.message}, 404)
            finally:
                state.close()
        return handler

    def plotly(request):
        return FileResponse(plotly_js(), media_type="application/javascript")

    def static(request):
        name = request.path_params["name"]
        p = STATIC / name
        if "/" in name or not p.is_file():
            return PlainTextResponse("not found", status_code=404)
        return FileResponse(p)

    app = Starlette(routes=[
        Route("/", index), Route("/w/{wid}", workflow), Route("/w/{wid}/t/{tid}", task),
        Route("/w/{wid}/r/{exp}", results),
        Route("/api/workflows", api(lambda s: workflows_data(s))),
        Route("/api/w/{wid}", api(lambda s, wid: workflow_data(s, wid))),
        Route("/api/w/{wid}/t/{tid}", api(lambda s, wid, tid: task_data(s, wid, tid))),
        Route("/api/w/{wid}/r/{exp}", api(lambda s, wid, exp: results_data(s, wid, exp))),
        Route("/static/plotly.min.js", plotly), Route("/static/{name}", static)])
    app.add_middleware(TokenGate, token=token)
    return app


def serve(host: str = "127.0.0.1", port: int = 0, token: str | None = None,
          announce=print) -> None:
    """Run the dashboard until interrupted: binds ``host:port`` (port 0: a free one) and
    calls ``announce`` with the URL holding the token before it serves.

    Raises:
        UsageError: the address cannot be bound.
    """
    import uvicorn

    from hypercli.errors import UsageError
    token = token or secrets.token_urlsafe(24)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}: {e.strerror or e}",
                         "give another --port, or --host") from None
    sock.listen(128)  # connections wait from now on, before the server's loop runs
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host
    announce(f"http://{shown}:{port}/?token={token}")
    server = uvicorn.Server(uvicorn.Config(make_app(token), log_level="warning",
                                           lifespan="off"))
    server.run(sockets=[sock])
