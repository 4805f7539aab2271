"""Late answers from a node's agent (hypercli/node/client.py): a host that no longer answers
TCP is cut off at once; a host that answers is waited for. Real pipes stand in for the SSH
channel; the agent's side is played by the test."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

from hypercli.node import client as C
from hypercli.node.client import AgentClient, NodeCutOff


def _client(silent):
    """An AgentClient on a pipe pair; returns (client, agent_reader, agent_writer fds)."""
    to_agent_r, to_agent_w = os.pipe()
    from_agent_r, from_agent_w = os.pipe()
    reader = os.fdopen(from_agent_r, "rb")
    closed = threading.Event()

    def close():
        closed.set()
        os.close(from_agent_w)  # the blocked readline sees EOF, as on a closed channel

    c = AgentClient("n1", lambda b: os.write(to_agent_w, b), reader.readline, close,
                    silent=silent)
    return c, os.fdopen(to_agent_r, "rb"), from_agent_w, closed


def test_late_answer_from_a_silent_host_is_a_cut_off():
    asked = []

    def silent():
        asked.append(time.monotonic())
        return "10.0.0.9:22 does not answer TCP"
    c, requests, _, closed = _client(silent)
    t0 = time.monotonic()
    with pytest.raises(NodeCutOff, match="does not answer TCP"):
        c.call("poll", wait=0.3)  # nobody answers
    took = time.monotonic() - t0
    assert len(asked) == 1 and asked[0] - t0 >= 0.3 + C.ANSWER_LATE - 0.05
    assert took < 0.3 + C.ANSWER_LATE + 1.0 and closed.is_set()
    assert json.loads(requests.readline())["op"] == "poll"


def test_late_answer_from_a_host_that_answers_is_waited_for():
    asked = []

    def silent():
        asked.append(time.monotonic())
        return None  # the host's TCP stack answers: loaded, not gone
    c, requests, answers, closed = _client(silent)

    def agent():
        req = json.loads(requests.readline())
        time.sleep(0.3 + C.ANSWER_LATE + 1.0)  # well past the answer's due time
        os.write(answers, json.dumps({"id": req["id"], "ok": True, "states": {}}).encode()
                 + b"\n")
    t = threading.Thread(target=agent)
    t.start()
    r = c.call("poll", wait=0.3)
    t.join()
    assert r == {"states": {}} and len(asked) == 1 and not closed.is_set()
    # an answer in time asks nothing
    t = threading.Thread(target=lambda: (requests.readline(), os.write(
        answers, b'{"id": 2, "ok": true}\n')))
    t.start()
    assert c.call("hello") == {}
    t.join()
    time.sleep(C.ANSWER_LATE + 0.2)
    assert len(asked) == 1
