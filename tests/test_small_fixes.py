"""Small things found in daily use (issue 27, item 8): `hyper data --help` names every store
scheme it opens; the dashboard does not show an idle node's last sample as current; a
parameter drawn with ``log: true`` is marked for log axes. (The browser side of the last two
is in tests/test_ui.py.)"""

from __future__ import annotations

import time

from hypercli.mount.store import SCHEMES


def test_data_help_names_every_store_scheme(hyper):
    out = hyper("data", "--help", check=True).stdout
    for scheme in SCHEMES:
        assert f"{scheme}://" in out, (scheme, out)


def test_an_idle_nodes_old_sample_is_not_current(hyper_home):
    import pytest
    pytest.importorskip("starlette")
    from hypercli.state import State
    from hypercli.ui.app import SAMPLE_FRESH, workflows_data
    st = State()
    st.put_cluster("c", "ssh", {})
    st.put_node("c", "c-0", slots=1)
    st.put_node("c", "c-1", slots=1)
    now = time.time()
    st.add_samples([{"node": "c-0", "ts": now - 600, "data": {"cpu_pct": 99.8}},
                    {"node": "c-1", "ts": now - 1, "data": {"cpu_pct": 12.5}}])
    nodes = {n["name"]: n for n in workflows_data(st)["clusters"][0]["nodes"]}
    assert nodes["c-0"]["sample_fresh"] is False and nodes["c-0"]["sample_age"] > SAMPLE_FRESH
    assert nodes["c-1"]["sample_fresh"] is True and nodes["c-1"]["sample"]["cpu_pct"] == 12.5


def test_log_parameters_are_recorded_for_log_axes(hyper_home, write_recipe):
    import pytest
    pytest.importorskip("starlette")
    from hypercli.state import State
    from hypercli.ui.app import results_data
    from hypercli.workflows import load, start_or_resume
    path = write_recipe("""
        name: logs
        experiments:
          svm:
            parameters: {C: {min: 0.01, max: 1000, log: true}, gamma: "0.1-0.9",
                         k: [1, 2]}
            samples: 2
            command: "true"
          plain:
            command: "true"
    """)
    recipe, wf = load(str(path))
    st = State()
    wid, _ = start_or_resume(st, recipe, wf)
    assert results_data(st, wid, "svm")["log_params"] == ["C"]
    assert results_data(st, wid, "plain")["log_params"] == []
