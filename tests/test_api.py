"""The Python API (issue 27, item 6): ``hypercli.run/up/down/status/workflow`` and the
``Workflow`` handle on real runs of the local provider, the CLI's errors, no click or rich
imported, and the example notebook executed by nbclient in a real kernel."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT

import hypercli

RECIPE = """
    name: api
    cluster: {workers: 2}
    experiments:
      sq:
        parameters: {x: [1, 2, 3]}
        command: |
          echo "out {{x}}"; echo "err {{x}}" >&2
          echo '{"y": '$(( {{x}} * {{x}} ))', "x": 0}' >> "$HYPER_METRICS"
      bad:
        command: exit 3
"""


def test_run_results_logs_and_the_cli_sees_the_same(hyper_home, write_recipe, hyper):
    lines = []
    wf = hypercli.run(write_recipe(RECIPE), log=lines.append)
    assert isinstance(wf, hypercli.Workflow) and wf.id == "api-1"
    assert any("starting workflow api-1" in ln for ln in lines)
    assert wf.status == "failed"  # a failed task does not raise
    assert wf.counts == {"sq": {"succeeded": 3}, "bad": {"failed": 1}}
    rows = wf.results()
    assert [r["params"]["x"] for r in rows[:3]] == [3, 2, 1]  # best first
    assert rows == [{k: r[k] for k in ("task", "experiment", "status", "params", "metrics")}
                    for r in __import__("json").loads(
                        hyper("results", "api-1", "--json", check=True).stdout)]
    asc = wf.results(sort="y", ascending=True)
    assert [r["metrics"]["y"] for r in asc[:3]] == [1, 4, 9]
    log = wf.logs("sq-0001")
    assert (log.stdout, log.stderr, log.attempt) == ("out 2\n", "err 2\n", 1)
    assert [t["status"] for t in wf.tasks()] == ["succeeded"] * 3 + ["failed"]
    assert hypercli.workflow("api").id == "api-1"  # by recipe name: the newest
    assert hypercli.status("api")[0]["status"] == "up"


def test_errors_are_the_clis(hyper_home, write_recipe):
    with pytest.raises(hypercli.RecipeError, match="samles"):
        hypercli.run(write_recipe("name: r\nexperiments: {e: {command: x, samles: 2}}\n"))
    with pytest.raises(hypercli.UsageError, match="no workflow named 'nope'") as e:
        hypercli.workflow("nope")
    assert e.value.exit_code == 2
    wf = hypercli.run(write_recipe(RECIPE))
    with pytest.raises(hypercli.UsageError, match="no task of api-1 reported a metric 'z'"):
        wf.results(sort="z")
    with pytest.raises(hypercli.UsageError, match="has no task 'sq-0009'"):
        wf.logs("sq-0009")
    with pytest.raises(hypercli.UsageError, match="has already ended"):
        wf.cancel()
    with pytest.raises(hypercli.UsageError, match="give a recipe or a provider"):
        hypercli.up()
    with pytest.raises(hypercli.UsageError, match="no cluster named 'zz'"):
        hypercli.status("zz")


def test_detach_wait_cancel_and_down(hyper_home, write_recipe):
    path = write_recipe("""
        name: slow
        cluster: {workers: 1}
        experiments:
          nap:
            parameters: {i: [1, 2, 3]}
            command: sleep 30
    """)
    wf = hypercli.run(path, detach=True)  # handed to the background driver
    assert wf.status == "running"
    with pytest.raises(TimeoutError):
        wf.wait(timeout=0.5)
    with pytest.raises(hypercli.UsageError, match="workflows not ended: slow-1"):
        hypercli.down("slow")
    assert wf.cancel() >= 1
    assert wf.wait(timeout=60) == "cancelled"
    assert hypercli.down("slow") and hypercli.status("slow")[0]["status"] == "down"
    assert hypercli.status() == []  # down clusters only with all=True
    assert [c["cluster"] for c in hypercli.status(all=True)] == ["slow"]


def test_results_as_a_dataframe(hyper_home, write_recipe, monkeypatch):
    wf = hypercli.run(write_recipe(RECIPE))
    pd = pytest.importorskip("pandas")
    df = wf.results(frame=True)
    assert isinstance(df, pd.DataFrame)
    assert list(df.columns) == ["task", "experiment", "status", "x", "y", "metric.x"]
    assert df["y"].tolist()[:3] == [9, 4, 1] and df["metric.x"].tolist()[:3] == [0, 0, 0]
    monkeypatch.setitem(sys.modules, "pandas", None)  # pandas not installed
    with pytest.raises(hypercli.UsageError, match="needs pandas"):
        wf.results(frame=True)


def test_the_api_imports_neither_click_nor_rich():
    code = ("import sys, hypercli, hypercli.api, hypercli.workflows, hypercli.config; "
            "hypercli.run; print(sorted(m for m in ('click', 'rich') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
def test_the_example_notebook_runs(hyper_home):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "examples" / "api.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(ROOT)}}).execute()
    out = {i: "".join(o.get("text", "") + str(o.get("data", {}).get("text/plain", ""))
                      for o in c.get("outputs", [])) for i, c in enumerate(nb.cells)}
    assert "'succeeded'" in out[2] and "'square': {'succeeded': 4}" in out[2], out[2]
    assert out[3].startswith("[(4, 16), (3, 9), (2, 4), (1, 1)]"), out[3]
    assert "x=" in out[5] and "scale=" in out[5]
    assert "error: no workflow named 'no-such-workflow'" in out[6]
    assert out[7].strip() == "'down'"
    assert all(o.get("output_type") != "error" for c in nb.cells for o in c.get("outputs", []))
