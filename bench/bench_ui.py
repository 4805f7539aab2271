#!/usr/bin/env python3
"""Dashboard benchmark: ``hyper ui`` start-up, and the first render of a 4,096-task results
page in headless Chromium.

1. start-up: from spawning ``hyper ui`` to the first 200 answer of its index page (the token
   URL), median of ``--rounds``; beside it, the same for ``python -m http.server`` (the
   floor of starting any Python web server here) as the named peer.
2. results page: the paper's example (12 parameters x 2 values, grid = 4,096 tasks), planned
   and stored with a metric per task (no task is run: only the page is measured); from
   navigation start to the first render (the table with its 4,096 rows: the page's
   ``performance.mark("table")``), and to the moment both plots hold their 4,096 points,
   median of ``--rounds``; and the JSON of the results API alone. There is no peer installed here for this page (optuna-dashboard is not
   on this machine), so only our figures are printed, against the goal (< 1 s).

Usage (repo root, Chromium and chromedriver installed):
    .venv/bin/python bench/bench_ui.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
HYPER = [str(Path(sys.executable).parent / "hyper")]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_200(url: str, limit: float = 30) -> float:
    """When ``url`` first answered 200 (unix s), following the token's redirect with its
    cookie as a browser does."""
    import http.cookiejar
    opener = urllib.request.build_opener(
        urllib.request.HTTPCookieProcessor(http.cookiejar.CookieJar()))
    end = time.time() + limit
    while time.time() < end:
        try:
            with opener.open(url, timeout=2) as r:
                if r.status == 200:
                    return time.time()
        except OSError:
            time.sleep(0.005)
    raise RuntimeError(f"{url} never answered 200")


def start_ui(env) -> tuple[subprocess.Popen, str]:
    p = subprocess.Popen([*HYPER, "ui", "--port", "0"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.DEVNULL, text=True)
    line = ""
    while "http://" not in line:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            raise RuntimeError("hyper ui exited")
    return p, line.strip()


def startup(env, rounds: int) -> tuple[list, list]:
    ours, peer = [], []
    for _ in range(rounds):
        t0 = time.time()
        p, url = start_ui(env)
        try:
            ours.append(wait_200(url) - t0)
        finally:
            p.terminate()
            p.wait()
        port = free_port()
        t0 = time.time()
        q = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                              "127.0.0.1"], cwd=tempfile.gettempdir(),
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            peer.append(wait_200(f"http://127.0.0.1:{port}/") - t0)
        finally:
            q.terminate()
            q.wait()
    return ours, peer


def store_paper_workflow() -> str:
    from bench_plan import paper_recipe

    from hypercli.plan import build_plan
    from hypercli.recipe import parse_recipe
    from hypercli.state import State
    wf = build_plan(parse_recipe(paper_recipe()))
    st = State()
    wid = st.create_workflow(wf, cluster="paper", recipe_path=None, storage="file:///tmp/x",
                             workdir="/tmp")
    rnd = random.Random(1)
    st.set_tasks(wid, [{"id": t.id, "status": "succeeded", "ended_at": time.time(),
                        "metrics": {"accuracy": rnd.random()}} for t in wf.tasks])
    return wid


def results_render(base: str, token_url: str, wid: str, rounds: int) -> tuple[list, list]:
    os.environ.setdefault("SE_OFFLINE", "true")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1000"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    page, api, firsts, parts = [], [], [], []
    try:
        d.get(token_url)  # sets the cookie
        cookie = d.get_cookie("hyper_ui_token")["value"]
        for _ in range(rounds):
            d.get(f"{base}/w/{wid}/r/search")
            end = time.time() + 60
            t = None
            while time.time() < end:
                t = d.execute_script(
                    "const s = document.getElementById('scatter'),"
                    " p = document.getElementById('parcoords');"
                    "const rows = document.querySelectorAll('#results tr').length;"
                    "if (rows === 4097 && s && s.data && s.data[0].x.length === 4096 &&"
                    " p && p.data && p.data[0].dimensions[0].values.length === 4096)"
                    " return performance.now(); return null;")
                if t:
                    break
                time.sleep(0.01)
            marks = d.execute_script(
                "const m = {}; for (const e of performance.getEntriesByType('mark'))"
                " if (!(e.name in m)) m[e.name] = e.startTime; return m;")
            page.append(t / 1000)
            firsts.append(marks["table"] / 1000)
            parts.append({k: round(v) for k, v in marks.items()})
            req = urllib.request.Request(f"{base}/api/w/{wid}/r/search",
                                         headers={"Cookie": f"hyper_ui_token={cookie}"})
            t0 = time.time()
            with urllib.request.urlopen(req, timeout=30) as r:
                r.read()
            api.append(time.time() - t0)
    finally:
        d.quit()
    return page, api, firsts, parts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    home = tempfile.mkdtemp(prefix="hyper-bench-ui-")
    os.environ["HYPER_HOME"] = home
    env = dict(os.environ)
    ours, peer = startup(env, a.rounds)
    m, mp = statistics.median(ours), statistics.median(peer)
    print(f"start-up to the first 200: hyper ui {m * 1000:.0f} ms (rounds "
          f"{', '.join(f'{x * 1000:.0f}' for x in ours)}), python -m http.server "
          f"{mp * 1000:.0f} ms; ratio {m / mp:.2f}x; goal < 1 s: {'met' if m < 1 else 'NOT met'}")
    wid = store_paper_workflow()
    p, url = start_ui(env)
    try:
        base = url.split("/?", 1)[0]
        page, api, firsts, parts = results_render(base, url, wid, a.rounds)
    finally:
        p.terminate()
        p.wait()
    mpage, mfirst = statistics.median(page), statistics.median(firsts)
    print(f"results page of 4,096 tasks: first render (the table, all 4,096 rows) "
          f"{mfirst * 1000:.0f} ms after navigation (rounds "
          f"{', '.join(f'{x * 1000:.0f}' for x in firsts)}); goal < 1 s: "
          f"{'met' if mfirst < 1 else 'NOT met'}")
    print(f"  both plots drawn too: {mpage * 1000:.0f} ms (rounds "
          f"{', '.join(f'{x * 1000:.0f}' for x in page)}); its API alone "
          f"{statistics.median(api) * 1000:.0f} ms; marks of the first round (ms after "
          f"navigation): {parts[0]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
