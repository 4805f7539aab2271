"""``hyper ui`` in a real browser: the installed command serves the state file of a real
workflow on loopback, headless Chromium (Debian's chromium + chromium-driver, through
selenium) watches its progress advance, reads a task's log, and finds one point per finished
task in the results plots. Requests without the token are refused; nothing from a task is
run as markup."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import time
import urllib.error
import urllib.request
import zlib
from pathlib import Path

import pytest

from conftest import ROOT, hyper_cmd, wait_for

pytestmark = pytest.mark.slow
CHROMIUM, DRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
TASKS = 8
RECIPE = """\
name: uitest
experiments:
  search:
    parameters: {x: [1, 2, 3, 4], kind: [a, b], C: {min: 0.01, max: 1000, log: true}}
    samples: 8
    command: |
      echo 'line of {{x}}{{kind}} <img src=x onerror="window.__xss=1">'
      while [ ! -e @GATE@ ]; do sleep 0.05; done
      sleep 0.6
      echo '{"score": '$(( {{x}} * 3 ))'}' >> "$HYPER_METRICS"
"""


def _need_browser():
    missing = [p for p in (CHROMIUM, DRIVER) if not os.path.exists(p)]
    try:
        import selenium  # noqa: F401
    except ImportError:
        missing.append("selenium")
    if missing:
        if os.environ.get("CI"):
            pytest.fail(f"missing for the browser tests: {missing} (scripts/deps.sh)")
        pytest.skip(f"missing: {missing} (apt-get install chromium chromium-driver)")


def start_ui(extra=()) -> tuple[subprocess.Popen, str]:
    """``hyper ui`` as a process; (the process, the URL with its token)."""
    p = subprocess.Popen([*hyper_cmd(), "ui", "--port", "0", *extra], cwd=ROOT,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = ""
    end = time.time() + 20
    while "http://" not in line and time.time() < end:
        line = p.stdout.readline()
        if not line and p.poll() is not None:
            raise AssertionError(f"hyper ui exited {p.returncode}: {p.stderr.read()}")
    return p, line.strip()


def stop(p: subprocess.Popen) -> None:
    p.terminate()
    try:
        p.wait(timeout=10)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def not_blank(png: Path) -> int:
    """How many different byte values the decoded pixels of a PNG hold (a blank page: a
    handful)."""
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat = 8, b""
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    return len(set(zlib.decompress(idat)))


@pytest.fixture
def browser():
    _need_browser()
    os.environ.setdefault("SE_OFFLINE", "true")  # never fetch a driver: ours is given
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    opts = webdriver.ChromeOptions()
    opts.binary_location = CHROMIUM
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1000", "--no-first-run", "--disable-extensions"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield d
    finally:
        d.quit()


def test_dashboard_in_a_browser(browser, hyper_home, tmp_path, hyper):
    js = browser.execute_script
    gate = tmp_path / "go"  # the tasks end only once the page has shown the run
    (tmp_path / "r.yaml").write_text(RECIPE.replace("@GATE@", str(gate)))
    run = subprocess.Popen([*hyper_cmd(), "run", str(tmp_path / "r.yaml")], cwd=ROOT,
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    ui, url = start_ui()
    try:
        base = url.split("/?", 1)[0]
        assert base.startswith("http://127.0.0.1:")
        for path in ("/", "/api/workflows", "/static/plotly.min.js"):  # no token: refused
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(base + path, timeout=10)
            assert e.value.code == 403
        port = base.rsplit(":", 1)[1]
        listening = subprocess.run(["ss", "-ltnH", f"sport = :{port}"], capture_output=True,
                                   text=True).stdout
        assert [ln.split()[3] for ln in listening.splitlines()] == [f"127.0.0.1:{port}"]

        from hypercli.state import State
        st = State()  # an idle node: its newest sample (99.8% CPU) is 10 minutes old
        st.put_cluster("idle", "ssh", {})
        st.put_node("idle", "idle-0", slots=1)
        st.add_samples([{"node": "idle-0", "ts": time.time() - 600,
                         "data": {"cpu_pct": 99.8, "mem_used": 1, "mem_total": 2}}])
        st.close()
        browser.get(url)
        seen = []

        def done_counts():  # read in one script: the page redraws every 1.5 s
            cells = js("return [...document.querySelectorAll("
                       "'#workflows tr td:nth-child(5)')].map(e => e.textContent)")
            if cells:
                seen.append(cells[0])
                gate.touch()
            return seen and seen[-1] == f"{TASKS}/{TASKS}"
        wait_for(done_counts, timeout=60, interval=0.2, what="the workflow done on the page")
        assert seen[0] != seen[-1], seen  # the page followed the run as it advanced
        assert run.wait(timeout=30) == 0
        idle = wait_for(lambda: js(
            "const r = [...document.querySelectorAll('#nodes tr')].find("
            "r => r.textContent.includes('idle-0'));"
            "return r ? [...r.querySelectorAll('td')].map(e => e.textContent) : null"),
            timeout=10, what="the idle node's row")
        assert idle[3] == "" and "99.8" not in "".join(idle), idle  # not shown as current
        assert idle[-1] == "10 min ago", idle  # its age instead
        browser.save_screenshot(str(tmp_path / "index.png"))

        browser.get(f"{base}/w/uitest-1/t/search-0000")
        out = "return (document.getElementById('stdout') || {}).textContent || ''"
        wait_for(lambda: "line of 1a" in js(out), timeout=20, what="the task's log")
        assert '<img src=x onerror="window.__xss=1">' in js(out)  # shown as text ...
        assert browser.execute_script("return window.__xss") is None  # ... never run
        browser.save_screenshot(str(tmp_path / "task.png"))

        browser.get(f"{base}/w/uitest-1/r/search")
        points = wait_for(lambda: browser.execute_script(
            "const s = document.getElementById('scatter');"
            "return s && s.data ? s.data.map(t => t.x.length) : null"), timeout=20,
            what="the scatter plots")
        assert points == [TASKS] * 3  # one point per finished task, per parameter
        dims = browser.execute_script(
            "return document.getElementById('parcoords').data[0].dimensions"
            ".map(d => [d.label, d.values.length])")
        assert dims == [["x", TASKS], ["kind", TASKS], ["C (log)", TASKS], ["score", TASKS]]
        axes = js("const l = document.getElementById('scatter').layout;"
                  "return [l.xaxis.type, l.xaxis2.type, l.xaxis3.type]")
        assert axes[2] == "log" and axes[0] != "log", axes  # C was drawn with log: true
        assert js("return document.querySelectorAll('#results tr').length") == TASKS + 1
        click = ("[...document.querySelectorAll('#results th')]"
                 ".find(h => h.textContent === 'score').click()")
        js(click)  # sort by the metric, largest first ...
        assert js("return document.querySelector('#results tr td').textContent") in (
            "search-0006", "search-0007")  # x = 4
        js(click)  # ... then smallest first
        assert js("return document.querySelector('#results tr td').textContent") in (
            "search-0000", "search-0001")  # x = 1
        browser.save_screenshot(str(tmp_path / "results.png"))
        for shot in ("index.png", "task.png", "results.png"):
            assert not_blank(tmp_path / shot) > 20, shot
    finally:
        stop(ui)
        if run.poll() is None:
            run.kill()
        run.wait()


def test_host_option_and_missing_extra_message(hyper_home, hyper):
    """``--host`` is the only way off loopback; a port in use is a clear error."""
    ui, url = start_ui(["--host", "0.0.0.0"])
    try:
        assert url.startswith("http://0.0.0.0:")
        port = url.split(":")[2].split("/")[0]
        r = hyper("ui", "--port", port)
        assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr
    finally:
        stop(ui)
    assert shutil.which("ss")
