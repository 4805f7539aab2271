"""Environment values and secrets: ``env:`` references and pass-through, ``--env`` and
``--env-file`` with their precedence, and ``secrets:`` whose values reach the task and nothing
else — not the state file (nor its WAL), ``$HYPER_HOME``, ``hyper plan``/``ps``/the dashboard
(shown as ***), the process table, or the node's files — on the local provider, on SSH test
hosts, and into a container; a resumed run asks for them again."""

from __future__ import annotations

import hashlib
import json
import os
import secrets as token
import signal
import subprocess
import threading
from pathlib import Path

import pytest

from conftest import ROOT, hyper_cmd, wait_for
from hypercli.errors import RecipeError, UsageError
from hypercli.recipe import parse_recipe
from test_ui import browser  # noqa: F401  (the headless Chromium fixture)


def _value() -> str:
    """A secret value found nowhere by chance."""
    return "sv-" + token.token_hex(12)


def _files_holding(root: Path, needle: bytes, skip: tuple = ()) -> list[str]:
    """Every regular file under ``root`` whose bytes contain ``needle`` (symlinks not
    followed; folders under ``skip`` left out)."""
    found = []
    for folder, dirs, files in os.walk(root):
        if any(folder.startswith(str(s)) for s in skip):
            dirs[:] = []
            continue
        for name in files:
            p = os.path.join(folder, name)
            try:
                if os.path.islink(p) or not os.path.isfile(p):
                    continue
                with open(p, "rb") as f:
                    if needle in f.read():
                        found.append(p)
            except OSError:
                pass
    return found


def _cmdlines_holding(needle: bytes) -> list[str]:
    """The pids whose ``/proc/PID/cmdline`` contains ``needle`` (every process of the
    machine: the test hosts' sshd, agents and containers are processes of this kernel)."""
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                if needle in Path(f"/proc/{d}/cmdline").read_bytes():
                    found.append(d)
            except OSError:
                pass
    return found


def _leaks(needle: str, *roots: Path, skip: tuple = ()) -> list[str]:
    b = needle.encode()
    out = _cmdlines_holding(b)
    for r in roots:
        out += _files_holding(r, b, skip)
    return out


def _sha(v: str) -> str:
    return hashlib.sha256(v.encode()).hexdigest()


# -- the recipe ---------------------------------------------------------------------------

def test_recipe_env_forms_and_secrets():
    r = parse_recipe("""
name: e
experiments:
  a:
    command: 'true'
    env: [HF_TOKEN, MODE=fast, EMPTY=]
    secrets: [API_KEY]
  b:
    command: 'true'
    env: {WANDB: '${WANDB_KEY}', LIT: 'a$${b}', NUM: 1.10}
""")
    a, b = r.experiments["a"], r.experiments["b"]
    assert a.env == {"HF_TOKEN": "${HF_TOKEN}", "MODE": "fast", "EMPTY": ""}
    assert a.secrets == ("API_KEY",)
    assert b.env == {"WANDB": "${WANDB_KEY}", "LIT": "a$${b}", "NUM": "1.10"} and not b.secrets


@pytest.mark.parametrize("experiment, field, words", [
    ("env: [X]\n    secrets: [X]", "experiments.a.env.X", "both in env and in secrets"),
    ("env: {AUTH: 'Bearer ${TOKEN}'}\n    secrets: [TOKEN]", "experiments.a.env.AUTH",
     "refers to the secret TOKEN"),
    ("env: {X: '${1BAD}'}", "experiments.a.env.X", "does not name a variable"),
    ("env: [HYPER_X]", "experiments.a.env[0]", "reserved"),
    ("env: [X, X=1]", "experiments.a.env[1]", "given twice"),
    ("secrets: [HYPER_TASK_ID]", "experiments.a.secrets[0]", "reserved"),
    ("secrets: {A: 1}", "experiments.a.secrets", "must be a list"),
    ("secrets: ['bad name']", "experiments.a.secrets[0]", "not a valid variable name"),
])
def test_bad_env_and_secrets_name_the_field(experiment, field, words):
    with pytest.raises(RecipeError) as e:
        parse_recipe(f"name: e\nexperiments:\n  a:\n    command: 'true'\n    {experiment}\n")
    assert e.value.field == field and words in e.value.reason, str(e.value)


# -- resolution: references, --env, --env-file ----------------------------------------------

RECIPE = """
name: envs
experiments:
  a:
    parameters: {p: [1]}
    command: 'true'
    env:
      FROM_CALLER: '${CALLER_VAR}'
      MIXED: 'x-{{p}}-${CALLER_VAR}-$${LIT}'
      LAYERED: recipe
      BRACES: '${BRACES_VAR}'
    secrets: [TOKEN]
"""


def test_references_and_precedence(tmp_path, hyper_home, monkeypatch):
    """recipe < --env-file (later files win) < --env; ``${VAR}`` sees the caller's
    environment overlaid by both; a variable's value is data (no placeholder rendered)."""
    from hypercli.workflows import load
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    monkeypatch.setenv("CALLER_VAR", "caller")
    monkeypatch.setenv("BRACES_VAR", "{{p}}")
    monkeypatch.setenv("PASSED", "through")
    f1, f2 = tmp_path / "one.env", tmp_path / "two.env"
    f1.write_text("LAYERED=file1\nFROM_FILE='quoted value'\n# a comment\nCALLER_VAR=file\n")
    f2.write_text("LAYERED=file2\n")
    _, wf = load(str(path))
    assert wf.tasks[0].env == {"FROM_CALLER": "caller", "MIXED": "x-1-caller-${LIT}",
                               "LAYERED": "recipe", "BRACES": "{{p}}"}
    _, wf2 = load(str(path), ["LAYERED=flag", "PASSED"], [str(f1), str(f2)])
    assert wf2.tasks[0].env == {"FROM_CALLER": "file", "MIXED": "x-1-file-${LIT}",
                                "LAYERED": "flag", "BRACES": "{{p}}",
                                "FROM_FILE": "quoted value", "PASSED": "through",
                                "CALLER_VAR": "file"}  # a file's variables go to every task
    assert wf2.digest != wf.digest  # values decide what runs
    _, wf3 = load(str(path), [], [str(f1), str(f2)])
    assert wf3.tasks[0].env["LAYERED"] == "file2"


def test_missing_variables_are_exit_2_naming_them(tmp_path, hyper_home, hyper, monkeypatch):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    monkeypatch.delenv("CALLER_VAR", raising=False)
    monkeypatch.setenv("BRACES_VAR", "b")
    r = hyper("plan", path)
    assert r.returncode == 2 and "CALLER_VAR" in r.stderr and "FROM_CALLER" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr
    monkeypatch.setenv("CALLER_VAR", "c")
    r = hyper("plan", path, "--env", "NOT_SET_ANYWHERE")
    assert r.returncode == 2 and "NOT_SET_ANYWHERE is not set" in r.stderr, r.stderr
    r = hyper("plan", path, "--env-file", tmp_path / "nope.env")
    assert r.returncode == 2 and "nope.env" in r.stderr
    bad = tmp_path / "bad.env"
    bad.write_text("HYPER_TASK_ID=x\n")
    r = hyper("plan", path, "--env-file", bad)
    assert r.returncode == 2 and "reserved" in r.stderr
    monkeypatch.delenv("TOKEN", raising=False)  # plan needs no secret
    assert hyper("plan", path).returncode == 0
    r = hyper("run", path)  # run does, before anything is started or recorded
    assert r.returncode == 2 and "secret TOKEN" in r.stderr and "experiment a" in r.stderr
    assert not (hyper_home / "state.db").exists() or "envs" not in hyper("ps").stdout


def test_a_secret_of_one_experiment_is_not_recorded_by_another(tmp_path, hyper_home,
                                                                monkeypatch):
    from hypercli.workflows import load
    path = tmp_path / "r.yaml"
    path.write_text("name: x\nexperiments:\n  a: {command: 'true', secrets: [TOKEN]}\n"
                    "  b: {command: 'true', env: [TOKEN]}\n")
    monkeypatch.setenv("TOKEN", _value())
    with pytest.raises(UsageError) as e:
        load(str(path))
    assert "experiments.b.env.TOKEN" in str(e.value) and "secret of experiment a" in str(e.value)
    path.write_text("name: x\nexperiments:\n  a: {command: 'true', secrets: [TOKEN]}\n"
                    "  b: {command: 'true'}\n")
    envf = tmp_path / "s.env"
    envf.write_text(f"TOKEN={os.environ['TOKEN']}\nOTHER=1\n")
    _, wf = load(str(path), [], [str(envf)])  # a file's secret is recorded for no task
    assert [t.env for t in wf.tasks] == [{"OTHER": "1"}, {"OTHER": "1"}]


def test_a_run_resumes_only_with_the_same_values(tmp_path, hyper_home, monkeypatch):
    """The recorded values are part of the plan: ``hyper run`` again with another ``--env``
    value is refused, naming the variables; with the same ones it resumes."""
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    path, gate = _local_recipe(tmp_path)
    monkeypatch.setenv("HF_TOKEN", _value())
    state = State()
    wid, resumed, _, _, lock = prepare_run(state, str(path), env=["PLAIN=one"])
    lock.release()
    with pytest.raises(UsageError) as e:
        prepare_run(state, str(path), env=["PLAIN=two"])
    assert e.value.exit_code == 2 and "--env" in str(e.value)
    monkeypatch.setenv("HF_TOKEN", _value())  # a secret is no part of the plan
    wid2, resumed, _, _, lock = prepare_run(state, str(path), env=["PLAIN=one"])
    lock.release()
    assert (wid2, resumed) == (wid, True)
    state.close()


def test_secret_value_on_the_command_line_is_refused(tmp_path, hyper_home, hyper,
                                                     monkeypatch):
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    monkeypatch.setenv("CALLER_VAR", "c")
    monkeypatch.setenv("BRACES_VAR", "b")
    r = hyper("run", path, "--env", "TOKEN=visible-in-ps")
    assert r.returncode == 2 and "process table" in r.stderr, r.stderr


def test_plan_shows_a_secret_as_stars(tmp_path, hyper_home, hyper, monkeypatch):
    secret = _value()
    path = tmp_path / "r.yaml"
    path.write_text(RECIPE)
    monkeypatch.setenv("CALLER_VAR", "c")
    monkeypatch.setenv("BRACES_VAR", "b")
    monkeypatch.setenv("TOKEN", secret)
    envf = tmp_path / "s.env"
    envf.write_text(f"TOKEN={secret}\n")
    for extra in ((), ("--env-file", envf), ("--env", "TOKEN")):
        rows = json.loads(hyper("plan", path, "--json", *extra, check=True).stdout)
        assert rows[0]["env"]["TOKEN"] == "***" and rows[0]["env"]["FROM_CALLER"] == "c"
        text = hyper("plan", path, *extra, check=True).stdout
        assert "TOKEN=***" in text and secret not in text


# -- a run on this machine ------------------------------------------------------------------

LOCAL = """
name: sec
cluster: {{workers: 1}}
experiments:
  work:
    parameters: {{i: [1, 2]}}
    env: [PLAIN]
    secrets: [HF_TOKEN]
    command: |
      printf %s "$HF_TOKEN" | sha256sum | cut -c1-64 > "$HYPER_OUTPUT/sha"
      printf %s "$PLAIN" > "$HYPER_OUTPUT/plain"
      touch "{gate}/started-{{{{i}}}}"
      while [ ! -e "{gate}/go" ]; do sleep 0.1; done
"""


def _local_recipe(tmp_path) -> tuple[Path, Path]:
    gate = tmp_path / "gate"
    gate.mkdir()
    path = tmp_path / "sec.yaml"
    path.write_text(LOCAL.format(gate=gate))
    return path, gate


def _assert_task_saw(home: Path, wid: str, secret: str, tasks=("work-0000", "work-0001")):
    for t in tasks:
        assert (home / "storage" / wid / t / "sha").read_text().strip() == _sha(secret), t


def test_local_run_secret_reaches_the_task_only(tmp_path, hyper_home, hyper, monkeypatch):
    secret = _value()
    path, gate = _local_recipe(tmp_path)
    env = dict(os.environ, HF_TOKEN=secret, PLAIN="plain-value")
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (gate / "started-1").exists(), timeout=90, what="task 1", proc=p)
        leaks = _leaks(secret, hyper_home)  # state.db, its -wal, logs, the attempt folders
        assert not leaks, leaks
        (gate / "go").touch()
        out, err = p.communicate(timeout=120)
    finally:
        (gate / "go").touch()
        if p.poll() is None:
            p.kill()
            p.communicate()
    assert p.returncode == 0, out + err
    assert secret not in out + err
    _assert_task_saw(hyper_home, "sec-1", secret)
    assert (hyper_home / "storage" / "sec-1" / "work-0000" / "plain").read_text() == \
        "plain-value"
    assert not _leaks(secret, hyper_home, tmp_path)
    rows = json.loads(hyper("ps", "sec-1", "--json", check=True).stdout)
    assert [r["env"] for r in rows] == [{"PLAIN": "plain-value", "HF_TOKEN": "***"}] * 2
    from hypercli.state import State
    from hypercli.ui.app import task_data
    assert task_data(State(), "sec-1", "work-0000")["env"]["HF_TOKEN"] == "***"
    assert State().workflow("sec-1")["spec"]["secrets"] == {"work": ["HF_TOKEN"]}


def test_secret_from_an_env_file_reaches_a_detached_run(tmp_path, hyper_home, hyper,
                                                        monkeypatch):
    """``hyper run -d --env-file``: the background driver gets the value in its environment
    (not its command line), the state file never."""
    from hypercli.driver import driver_pid
    secret = _value()
    path, gate = _local_recipe(tmp_path)
    envf = tmp_path / "s.env"
    envf.write_text(f"HF_TOKEN={secret}\nPLAIN=p\n")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("PLAIN", raising=False)
    try:
        r = hyper("run", "-d", path, "--env-file", envf)
        assert r.returncode == 0, r.stdout + r.stderr
        wait_for(lambda: (gate / "started-1").exists(), timeout=90, what="task 1")
        assert not _leaks(secret, hyper_home), _leaks(secret, hyper_home)
        (gate / "go").touch()
        r = hyper("attach", "sec-1", timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        _assert_task_saw(hyper_home, "sec-1", secret)
        assert not _leaks(secret, hyper_home)
    finally:
        (gate / "go").touch()
        pid = driver_pid()
        if pid:
            os.kill(pid, signal.SIGKILL)


def test_a_live_driver_without_the_secret_is_not_handed_the_workflow(tmp_path, hyper_home,
                                                                      hyper, monkeypatch):
    """``hyper run -d --env-file`` while a background driver started without the secret is
    alive: refused (exit 2), since it could not drive it; run in the foreground it runs."""
    from hypercli.driver import driver_pid
    secret = _value()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("PLAIN", "p")
    other = tmp_path / "other"
    other.mkdir()
    (other / "o.yaml").write_text(f"name: o\ncluster: {{workers: 1}}\nexperiments:\n"
                                  f"  w: {{command: 'while [ ! -e {other}/go ]; do sleep 0.1; "
                                  f"done'}}\n")
    path, gate = _local_recipe(tmp_path)
    (gate / "go").touch()
    envf = tmp_path / "s.env"
    envf.write_text(f"HF_TOKEN={secret}\n")
    try:
        assert hyper("run", "-d", other / "o.yaml").returncode == 0
        pid = wait_for(driver_pid, what="the background driver")
        r = hyper("run", "-d", path, "--env-file", envf)
        assert r.returncode == 2 and f"driver (pid {pid})" in r.stderr, r.stdout + r.stderr
        assert "HF_TOKEN" in r.stderr and secret not in r.stdout + r.stderr
        (other / "go").touch()
        r = hyper("run", path, "--env-file", envf, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        _assert_task_saw(hyper_home, "sec-1", secret)
        assert not _leaks(secret, hyper_home)
    finally:
        (other / "go").touch()
        pid = driver_pid()
        if pid:
            os.kill(pid, signal.SIGKILL)


def test_resumed_runs_ask_for_the_secret_again(tmp_path, hyper_home, hyper, monkeypatch):
    """A killed ``hyper run`` resumed, and ``hyper attach`` after the background driver was
    killed, read the secret from their own environment: missing, exit 2 naming it; given,
    the task started by the new driver sees it."""
    from hypercli.driver import driver_pid
    secret = _value()
    path, gate = _local_recipe(tmp_path)
    monkeypatch.setenv("PLAIN", "p")
    env = dict(os.environ, HF_TOKEN=secret)
    p = subprocess.Popen([*hyper_cmd(), "run", str(path)], cwd=ROOT, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (gate / "started-1").exists(), timeout=90, what="task 1", proc=p)
        p.kill()  # SIGKILL: the driver is gone, the task goes on
        p.communicate()
        monkeypatch.delenv("HF_TOKEN", raising=False)
        for args in (("run", path), ("run", "-d", path)):
            r = hyper(*args)
            assert r.returncode == 2 and "HF_TOKEN" in r.stderr, (args, r.stdout, r.stderr)
        r = subprocess.run([*hyper_cmd(), "run", "-d", str(path)], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stdout + r.stderr
        pid = wait_for(driver_pid, what="the background driver")
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: driver_pid() is None, what="driver gone")
        r = hyper("attach", "sec-1")  # would start a driver without the secret: refused
        assert r.returncode == 2 and "HF_TOKEN" in r.stderr, r.stdout + r.stderr
        assert driver_pid() is None
        r = hyper("ps")  # another command starts no driver that lacks it
        assert r.returncode == 0 and driver_pid() is None
        (gate / "go").touch()
        r = subprocess.run([*hyper_cmd(), "attach", "sec-1"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stdout + r.stderr
        _assert_task_saw(hyper_home, "sec-1", secret)
        assert not _leaks(secret, hyper_home)
    finally:
        (gate / "go").touch()
        if p.poll() is None:
            p.kill()
            p.communicate()
        pid = driver_pid()
        if pid:
            os.kill(pid, signal.SIGKILL)


def test_python_api_takes_env_and_secrets(tmp_path, hyper_home, monkeypatch):
    import hypercli
    secret = _value()
    path, gate = _local_recipe(tmp_path)
    (gate / "go").touch()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.delenv("PLAIN", raising=False)
    with pytest.raises(UsageError) as e:
        hypercli.run(path)
    assert e.value.exit_code == 2 and "PLAIN" in str(e.value)
    wf = hypercli.run(path, env={"PLAIN": "p", "HF_TOKEN": secret})
    assert wf.status == "succeeded"
    _assert_task_saw(hyper_home, wf.id, secret)
    assert not _leaks(secret, hyper_home)


# -- SSH test hosts, and a container on one ---------------------------------------------------

GATED = """d="$HYPER_OUTPUT"  # its own folder: a container can write no other of the node's
printf %s "$HF_TOKEN" | sha256sum | cut -c1-64 > "$HYPER_OUTPUT/sha"
touch "$d/started"
while [ ! -e "$d/go" ]; do sleep 0.1; done
"""


#: attempt 1 saves a checkpoint, waits, fails; attempt 2 restores it (the restore runs before
#: the container, which must still get its secrets on stdin) and succeeds
RETRIED = """d="$HYPER_OUTPUT"
printf %s "$HF_TOKEN" | sha256sum | cut -c1-64 > "$HYPER_OUTPUT/sha"
if [ "$HYPER_ATTEMPT" = 1 ]; then
  echo saved > "$HYPER_CHECKPOINT/state"
  touch "$d/started"
  while [ ! -e "$d/go" ]; do sleep 0.1; done
  exit 3
fi
[ "$(cat "$HYPER_CHECKPOINT/state")" = saved ]
"""


def _run_gated_on_host(tmp_path, ssh_hosts, host, experiment: dict, secret: str,
                       skip_during: tuple = ()) -> str:
    """Run one gated task of ``experiment`` on ``host`` in this process; while it waits,
    check that no file of the host (but ``skip_during``), of ``$HYPER_HOME`` and no process's
    command line holds the secret; then let it end. Returns the workflow id."""
    from test_ssh import ssh_recipe

    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    path = ssh_recipe(tmp_path, ssh_hosts, [host], {"box": experiment}, name="sec")
    state = State()
    wid, _, provider, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    done: dict = {}
    t = threading.Thread(target=lambda: done.update(s=Scheduler(state, wid, provider,
                                                                  nodes).run()))
    t.start()
    tasks = host.root / "home" / ".hyper" / "tasks"
    try:
        started = wait_for(lambda: list(tasks.parent.glob("**/started")), timeout=120,
                           what="the task waiting on its node")
        home = Path(os.environ["HYPER_HOME"])
        leaks = _leaks(secret, host.root, home, skip=skip_during)
        assert not leaks, leaks
    finally:
        for marker in tasks.parent.glob("**/started"):
            (marker.parent / "go").touch()
        t.join(timeout=180)
        lock.release()
    assert not t.is_alive() and done["s"].exit_code == 0, \
        [(a["id"], a["status"], a["error"]) for a in state.attempts(wid)]
    assert started
    return wid


def test_ssh_host_gets_the_secret_over_the_channel_only(ssh_hosts, tmp_path, hyper_home,
                                                       monkeypatch):
    secret = _value()
    monkeypatch.setenv("HF_TOKEN", secret)
    host = ssh_hosts.start(1)[0]
    wid = _run_gated_on_host(tmp_path, ssh_hosts, host,
                             {"secrets": ["HF_TOKEN"], "command": GATED}, secret)
    assert (hyper_home / "storage" / wid / "box-0000" / "sha").read_text().strip() == \
        _sha(secret)
    leaks = _leaks(secret, host.root, hyper_home)
    assert not leaks, leaks


def test_container_gets_the_secret_by_name_not_on_its_command_line(
        ssh_hosts, tiny_image, tmp_path, hyper_home, monkeypatch):
    """``docker run -e HF_TOKEN``: the value is in the runtime's environment; no command
    line holds it while the container runs, no file of the node outside the runtime's own
    store holds it then, and nothing at all on the node after (the container is removed)."""
    from sshhosts import TINY_IMAGE, load_image
    secret = _value() + "'$(id) \\n\n\"%s"  # quotes, a substitution, a line break: data
    monkeypatch.setenv("HF_TOKEN", secret)
    host = ssh_hosts.start(1)[0]
    load_image(host, tiny_image)
    wid = _run_gated_on_host(tmp_path, ssh_hosts, host,
                             {"image": TINY_IMAGE, "secrets": ["HF_TOKEN"], "retries": 1,
                              "command": RETRIED}, secret,
                             skip_during=(host.root / "containers",))
    from hypercli.state import State
    assert [a["status"] for a in State().attempts(wid)] == ["failed", "succeeded"]
    assert (hyper_home / "storage" / wid / "box-0000" / "sha").read_text().strip() == \
        _sha(secret)
    leaks = _leaks(secret, host.root, hyper_home)
    assert not leaks, leaks


# -- the dashboard ------------------------------------------------------------------------

def test_dashboard_shows_a_secret_as_stars(browser, tmp_path, hyper_home, hyper):
    from test_ui import start_ui, stop
    secret = _value()
    path, gate = _local_recipe(tmp_path)
    (gate / "go").touch()
    env = dict(os.environ, HF_TOKEN=secret, PLAIN="plain-value")
    r = subprocess.run([*hyper_cmd(), "run", str(path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout + r.stderr
    ui, url = start_ui()
    try:
        base = url.split("/?", 1)[0]
        browser.get(url)
        browser.get(f"{base}/w/sec-1/t/work-0000")
        rows = wait_for(lambda: browser.execute_script(
            "return [...document.querySelectorAll('#main table tr')].map("
            "r => [...r.querySelectorAll('td')].map(e => e.textContent))"
            ".filter(c => c.length == 2)"), timeout=30, what="the environment table")
        assert ["HF_TOKEN", "***"] in rows and ["PLAIN", "plain-value"] in rows, rows
        assert secret not in browser.page_source
    finally:
        stop(ui)
    assert not _leaks(secret, hyper_home)
