#!/usr/bin/env python3
"""SSH benchmarks of hypercli against named peers, on real SSH test hosts (tests/sshhosts.py:
sshd in its own network/PID/mount namespaces on the 10.213.0.0/24 bridge; needs root).

1. Dispatch: N trivial tasks (``true``, default 500) over 4 hosts, one task at a time per host.
   Sides, every round on the same fresh 4-host pool, in a rotating order:
     hyper lib     recipe ``cluster: {provider: ssh, hosts: [4 hosts], identity_file: KEY}``,
                   ``experiments: {t: {sampling: grid, samples: N, command: "true"}}``, run in
                   this process: ``prepare_run(trust_new_hosts=True)`` (bootstrap) then
                   ``Scheduler(...).run()``; both times are reported, the rate is N / run().
     hyper CLI     ``python -m hypercli run RECIPE --trust-new-hosts --on-interrupt cancel``,
                   wall clock from spawn to exit (start-up, plan, bootstrap, run).
     parallel 1/   ``seq N | parallel -S 1/root@IP1,...,1/root@IP4 --ssh 'ssh -i KEY -o
                   UserKnownHostsFile=KNOWN -o StrictHostKeyChecking=yes -o BatchMode=yes' true``
                   (one job per host at a time, as hyper's nodes), wall clock.
     parallel dflt the same without ``1/``: GNU parallel's default jobs per host (one per remote
                   CPU core; the peak per host is measured from --joblog).
     parallel -M   (full mode only) ``1/`` plus ``-M`` (ssh ControlMaster: one persistent
                   connection per host, the closest parallel gets to hyper's design).
     raw exec      one persistent paramiko connection per host (socket from
                   ``hypercli.ssh.conn.make_socket``: TCP_NODELAY), one thread per host,
                   ``exec_command("true")`` N/4 times each, waiting for each exit status; the
                   connect is not timed.
   Every hyper run is checked from its state file (N attempts, all ``succeeded``); every
   parallel run from its exit code and --joblog (N distinct jobs, exit 0).
   Ratios per round, then the median over rounds: hyper CLI / parallel 1/ (goal >= 10),
   hyper run() / raw exec (goal >= 0.5). Then one extra, instrumented hyper run (not timed
   against anything) breaks a task's cycle down per node thread (launch, poll, log collection).

2. Recovery: 3 hosts; task 0 runs ``sleep 6``, the other 50 tasks ``sleep 0.5`` (so every host
   has a task running when the fault comes, and the survivors free a slot every ~0.5 s: the
   figure measures detection + re-queue, not waiting for a slot). One second after task 0 is
   running, its host is killed (``host.kill()``, power loss) or cut (``host.cut()``, silent link
   down). Measured from the fault to: the node's first error event, its ``lost`` event, the
   retry's ``attempts.created_at``, the retry's ``started_at`` (node side), and the moment this
   benchmark saw the retry ``running`` in the state file (polled every 10 ms) — the headline.
   Peer: GNU parallel ``--retries 2 --line-buffer -S 1/...`` running the same jobs (each prints
   ``START <job> <date +%s.%N> <hostname>`` first), ssh with ``-o ServerAliveInterval=1 -o
   ServerAliveCountMax=3 -o ConnectTimeout=3`` so that it can notice a silent link at all;
   measured from the fault to the retried job 0's START (its own timestamp). Full mode adds one
   cut trial of parallel with bench 1's plain ssh options, capped at 30 s.
   A fresh 3-host pool and HYPER_HOME per trial. A third fault, ``stall``, is a loaded host
   that is alive: 4 busy loops on it and its agent stopped for 4 s one second after task 0
   runs there; hypercli must not declare it lost (false losses counted; task 0 must end with
   one attempt).

3. Fan-out: bootstrap (connect, host key pinned with trust_new_hosts, agent upload, hello) of
   8 cold hosts (``~/.hyper`` removed on every host and a fresh HYPER_HOME before each
   measurement) with ``hypercli.cluster.up`` (what ``workflows.up`` calls, given our own
   provider instance so its connections can be closed), against 1 host with the same call, and
   against ``SSHProvider.bootstrap`` called for the 8 hosts one after another. Ratio
   up(8) / serial(8) (goal: ~ slowest single host, i.e. far below 1). The 8 hosts share this
   machine's cores with the driver, so the serial run's CPU (here and on the hosts) divided by
   the cores is also shown: a floor no schedule can beat here, which separate machines
   would not have.

Figures vary +-50% run to run on this 2-core machine (other jobs run on it too): compare ratios
within a round; each figure is the median of the rounds (3, or 1 with --quick).

Usage (from the repo root, as root):  python bench/bench_ssh.py [--quick] [--only 1,2,3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (str(ROOT / "tests"), str(ROOT)):
    if p not in sys.path:
        sys.path.insert(0, p)

import yaml  # noqa: E402

from sshhosts import HostPool, _keygen, _wait_all  # noqa: E402

TEMP_DIRS: list[str] = []


# ------------------------------------------------------------------------------ helpers

def tmpdir(prefix: str) -> str:
    d = tempfile.mkdtemp(prefix=prefix)
    TEMP_DIRS.append(d)
    return d


def fresh_home() -> str:
    """A fresh, empty HYPER_HOME for this process (and the subprocesses it starts)."""
    home = tmpdir("hyper-bench-ssh-home-")
    os.environ["HYPER_HOME"] = home
    return home


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def fmt(x, spec=".2f", none="—"):
    return none if x is None else format(x, spec)


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def code_version() -> str:
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "hypercli"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"
    if not dirty:
        return rev
    import hashlib
    h = hashlib.sha256()
    for f in sorted((ROOT / "hypercli").rglob("*.py")):
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes())
    return f"{rev} + uncommitted changes in hypercli/ (working tree *.py sha256 {h.hexdigest()[:12]})"


def kill_session(sid: int) -> int:
    """SIGKILL every process of session ``sid`` (a session this benchmark started with
    start_new_session=True: its leader's pid is ``sid``); returns how many there were."""
    n = 0
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
            try:
                os.kill(int(d), 9)
                n += 1
            except ProcessLookupError:
                pass
    return n


HZ = os.sysconf("SC_CLK_TCK")


def host_cpu(hosts) -> float:
    """CPU seconds used so far inside the hosts: each host's init (sshd -D, PID 1 of its PID
    namespace) plus every process it reaped (sshd reaps orphans too, e.g. an agent that
    detached from its connection, with its tasks' CPU), so processes still running are not
    counted yet."""
    total = 0
    for h in hosts:
        f = Path(f"/proc/{h.pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in f[11:15])  # utime stime cutime cstime
    return total / HZ


def own_cpu() -> float:
    """CPU seconds of this process and of its reaped children."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def write_recipe(home: str, name: str, hosts, key: Path, experiments: dict) -> Path:
    recipe = {"name": name,
              "cluster": {"provider": "ssh", "hosts": [h.address() for h in hosts],
                          "identity_file": str(key)},
              "experiments": experiments}
    path = Path(home) / f"{name}.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return path


def ssh_cmd(pool, extra: str = "") -> str:
    return (f"ssh -i {pool.client_key} -o UserKnownHostsFile={pool.known_hosts} "
            f"-o StrictHostKeyChecking=yes -o BatchMode=yes{extra}")


def parallel_env() -> dict:
    return dict(os.environ, PARALLEL_HOME=tmpdir("hyper-bench-parallel-"))


def check_attempts(state, wid: str, n: int) -> str:
    """'ok' when the workflow has n attempts, all succeeded, over n distinct tasks."""
    atts = state.attempts(wid)
    statuses = defaultdict(int)
    for a in atts:
        statuses[a["status"]] += 1
    tasks = {a["task"] for a in atts}
    if len(atts) == n and statuses.get("succeeded") == n and len(tasks) == n:
        return "ok"
    raise AssertionError(f"{wid}: {len(atts)} attempts over {len(tasks)} tasks, {dict(statuses)}")


def close_provider(prov, cluster: str, nodes) -> None:
    try:
        prov.terminate(cluster, nodes)
    except Exception:
        pass


# ----------------------------------------------------------------------------- 1. dispatch

def hyper_lib(pool, hosts, name: str, n: int) -> dict:
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    home = fresh_home()
    path = write_recipe(home, name, hosts, pool.client_key,
                        {"t": {"sampling": "grid", "samples": n, "command": "true"}})
    state = State()
    t0 = time.perf_counter()
    wid, _, prov, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
    t1 = time.perf_counter()
    try:
        summary = Scheduler(state, wid, prov, nodes).run()
    finally:
        t2 = time.perf_counter()
        lock.release()
        close_provider(prov, name, nodes)
    assert summary.exit_code == 0, summary
    check_attempts(state, wid, n)
    # where a node's time goes, from the attempts' own timestamps
    atts = state.attempts(wid)
    by_node = defaultdict(list)
    for a in atts:
        by_node[a["node"]].append(a)
    gaps = []
    for lst in by_node.values():
        lst.sort(key=lambda a: a["created_at"])
        gaps += [b["created_at"] - a["ended_at"] for a, b in zip(lst, lst[1:])]
    out = {"prepare": t1 - t0, "run": t2 - t1, "rate": n / (t2 - t1),
           "rate_e2e": n / (t2 - t0),
           "launch_ms": 1e3 * med([a["started_at"] - a["created_at"] for a in atts]),
           "task_ms": 1e3 * med([a["ended_at"] - a["started_at"] for a in atts]),
           "gap_ms": 1e3 * med(gaps)}
    state.close()
    return out


def hyper_cli(pool, hosts, name: str, n: int) -> dict:
    from hypercli.state import State
    home = fresh_home()
    path = write_recipe(home, name, hosts, pool.client_key,
                        {"t": {"sampling": "grid", "samples": n, "command": "true"}})
    cmd = [sys.executable, "-m", "hypercli", "run", str(path), "--trust-new-hosts",
           "--on-interrupt", "cancel"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, HYPER_HOME=home, COLUMNS="200"))
    dt = time.perf_counter() - t0
    if p.returncode != 0:
        raise AssertionError(f"hyper run exited {p.returncode}:\n{p.stdout[-2000:]}\n"
                             f"{p.stderr[-2000:]}")
    state = State(Path(home) / "state.db")
    check_attempts(state, f"{name}-1", n)
    state.close()
    return {"wall": dt, "rate": n / dt}


def parse_joblog(path: Path) -> tuple[int, dict]:
    """(jobs that ended with exit 0, peak concurrent jobs per host) from a --joblog."""
    rows = [ln.split("\t") for ln in path.read_text().splitlines()[1:] if ln.strip()]
    ok = {r[0] for r in rows if r[6] == "0" and r[7] == "0"}
    ev = []
    for r in rows:
        start, run = float(r[2]), float(r[3])
        ev += [(start, 1, r[1]), (start + run, -1, r[1])]
    ev.sort(key=lambda e: (e[0], e[1]))
    cur, peak = defaultdict(int), defaultdict(int)
    for _, d, h in ev:
        cur[h] += d
        peak[h] = max(peak[h], cur[h])
    return len(ok), dict(peak)


def gnu_parallel(pool, hosts, n: int, per_host: str = "1/", extra: str = "") -> dict:
    env = parallel_env()
    log = Path(env["PARALLEL_HOME"]) / "joblog"
    logins = ",".join(f"{per_host}{h.user}@{h.ip}" for h in hosts)
    cmd = (f"seq {n} | parallel {extra} --joblog {log} -S {logins} "
           f"--ssh {shlex.quote(ssh_cmd(pool))} true").replace("  ", " ")
    t0 = time.perf_counter()
    p = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=900,
                       env=env)
    dt = time.perf_counter() - t0
    ok, peak = parse_joblog(log)
    if p.returncode != 0 or ok != n:
        raise AssertionError(f"parallel exited {p.returncode}, {ok}/{n} jobs ok: "
                             f"{p.stderr[-1500:]}")
    return {"wall": dt, "rate": n / dt, "peak": max(peak.values()), "cmd": cmd}


def raw_exec(pool, hosts, n: int) -> dict:
    import paramiko

    from hypercli.ssh.conn import make_socket
    clients = []
    try:
        for h in hosts:
            c = paramiko.SSHClient()
            c.load_host_keys(str(pool.known_hosts))
            c.set_missing_host_key_policy(paramiko.RejectPolicy())
            c.connect(h.ip, h.port, username=h.user, key_filename=str(pool.client_key),
                      sock=make_socket(h.ip, h.port), allow_agent=False, look_for_keys=False)
            clients.append(c)
        per = [n // len(hosts) + (1 if i < n % len(hosts) else 0) for i in range(len(hosts))]
        codes: list[int] = []

        def worker(c, k):
            tr = c.get_transport()
            for _ in range(k):
                ch = tr.open_session()
                ch.exec_command("true")
                codes.append(ch.recv_exit_status())
                ch.close()
        threads = [threading.Thread(target=worker, args=(c, k)) for c, k in zip(clients, per)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        for c in clients:
            c.close()
    assert len(codes) == n and not any(codes), "raw exec: not every `true` exited 0"
    return {"wall": dt, "rate": n / dt}


def profile_hyper(pool, hosts, n: int) -> dict:
    """One instrumented in-process run: time spent per call kind, summed over node threads."""
    import hypercli.providers.ssh as P
    import hypercli.ssh.conn as C
    from hypercli.node.client import AgentClient
    from hypercli.scheduler import NodeWorker, Scheduler
    tim: dict[str, list] = defaultdict(list)
    patched = []

    def wrap(obj, attr, key):
        f = getattr(obj, attr)
        patched.append((obj, attr, f))

        def g(*a, **k):
            t, c = time.perf_counter(), time.thread_time()
            try:
                return f(*a, **k)
            finally:
                tim[key(a, k)].append((time.perf_counter() - t, time.thread_time() - c))
        setattr(obj, attr, g)
    wrap(AgentClient, "call", lambda a, k: f"agent {a[1]}")
    wrap(P.SSHSession, "after_end", lambda a, k: "SSHSession.after_end (all)")
    wrap(P.SSHSession, "before_launch", lambda a, k: "SSHSession.before_launch")
    wrap(C.Connection, "run", lambda a, k: "  of which Connection.run (every ssh exec)")
    wrap(P, "_untar", lambda a, k: "  of which _untar (local)")
    wrap(Scheduler, "_apply", lambda a, k: "Scheduler._apply (main thread)")
    wrap(Scheduler, "_dispatch", lambda a, k: "Scheduler._dispatch (main thread)")
    wrap(Scheduler, "run", lambda a, k: "Scheduler.run (main thread, whole run)")
    wrap(NodeWorker, "run", lambda a, k: "NodeWorker.run (4 node threads, whole run)")
    cpu0, t0 = os.times(), time.perf_counter()
    st0 = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    try:
        r = hyper_lib(pool, hosts, "disp-profile", n)
    finally:
        for obj, attr, f in reversed(patched):
            setattr(obj, attr, f)
    st1 = Path("/proc/stat").read_text().split("\n")[0].split()[1:]
    cpu1, wall = os.times(), time.perf_counter() - t0
    tot = sum(map(int, st1)) - sum(map(int, st0))
    idle = (int(st1[3]) + int(st1[4])) - (int(st0[3]) + int(st0[4]))
    rows = sorted(((k, len(v), med([w for w, _ in v]) * 1e3, sum(w for w, _ in v),
                    sum(c for _, c in v)) for k, v in tim.items()), key=lambda x: x[0])
    return {"run": r, "rows": rows,
            "driver_cpu": (cpu1.user - cpu0.user) + (cpu1.system - cpu0.system),
            "wall": wall, "machine_busy": 1 - idle / tot if tot else None}


def bench_dispatch(args, key: Path, out: list[str]) -> None:
    n = args.tasks
    print(f"\n== 1. dispatch: {n} x `true` over 4 SSH test hosts, {args.rounds} round(s) ==")
    print(f"   load average at start: {loadavg()}")
    sides = ["hyper lib", "hyper CLI", "parallel 1/", "parallel dflt", "raw exec"]
    if not args.quick:
        sides.append("parallel -M")
    res: dict[str, list] = defaultdict(list)
    ratios: dict[str, list] = defaultdict(list)
    cmds = {}
    for r in range(args.rounds):
        with HostPool(client_key=key) as pool:
            hosts = pool.start(4)
            order = sides[r % len(sides):] + sides[:r % len(sides)]
            got = {}
            for side in order:
                c0, h0 = own_cpu(), host_cpu(hosts)
                if side == "hyper lib":
                    got[side] = hyper_lib(pool, hosts, f"displib{r}", n)
                elif side == "hyper CLI":
                    got[side] = hyper_cli(pool, hosts, f"dispcli{r}", n)
                elif side == "parallel 1/":
                    got[side] = gnu_parallel(pool, hosts, n, "1/")
                elif side == "parallel dflt":
                    got[side] = gnu_parallel(pool, hosts, n, "")
                elif side == "parallel -M":
                    got[side] = gnu_parallel(pool, hosts, n, "1/", "-M")
                else:
                    got[side] = raw_exec(pool, hosts, n)
                g = got[side]
                time.sleep(0.5)  # let the hosts' sshd reap what the side left (agents)
                g["cpu_driver_ms"] = 1e3 * (own_cpu() - c0) / n
                g["cpu_hosts_ms"] = 1e3 * (host_cpu(hosts) - h0) / n
                res[side].append(g)
                if "cmd" in g:
                    cmds[side] = g["cmd"].replace(str(pool.client_key), "KEY").replace(
                        str(pool.known_hosts), "KNOWN")
                extra = ""
                if side == "hyper lib":
                    extra = (f" (prepare_run {g['prepare']:.2f} s + run() {g['run']:.2f} s; "
                             f"per attempt: launch {g['launch_ms']:.0f} ms, task "
                             f"{g['task_ms']:.0f} ms, end->next launch {g['gap_ms']:.0f} ms)")
                elif "peak" in g:
                    extra = f" (peak {g['peak']} jobs per host)"
                wall = g.get("wall", g.get("run"))
                print(f"   round {r + 1} {side:13s} {g['rate']:7.1f} tasks/s  "
                      f"{wall:6.2f} s  CPU/task: here {g['cpu_driver_ms']:5.1f} ms, hosts "
                      f"{g['cpu_hosts_ms']:5.1f} ms{extra}", flush=True)
            cli, lib = got["hyper CLI"]["rate"], got["hyper lib"]["rate"]
            par, raw = got["parallel 1/"]["rate"], got["raw exec"]["rate"]
            ratios["hyper CLI / parallel 1/"].append(cli / par)
            ratios["hyper CLI / parallel dflt"].append(cli / got["parallel dflt"]["rate"])
            ratios["hyper run() / parallel 1/"].append(lib / par)
            if "parallel -M" in got:
                ratios["hyper CLI / parallel -M"].append(cli / got["parallel -M"]["rate"])
            ratios["hyper run() / raw exec"].append(lib / raw)
            ratios["hyper CLI / raw exec"].append(cli / raw)
    prof = None
    if not args.no_profile:
        with HostPool(client_key=key) as pool:
            hosts = pool.start(4)
            prof = profile_hyper(pool, hosts, n)

    print("\n   medians:")
    lines = ["## 1. Dispatch: %d × `true` over 4 SSH hosts (one task per host at a time)" % n,
             "",
             f"Rounds: {args.rounds}, median shown (each round on a fresh 4-host pool, sides in "
             "a rotating order). Load average at start: " + loadavg() + ".",
             "",
             "| side | tasks/s (median) | per round | CPU ms per task, this side's processes "
             "| CPU ms per task, inside the hosts |", "|---|---|---|---|---|"]
    for side in sides:
        rates = [g["rate"] for g in res[side]]
        cd, ch = med([g["cpu_driver_ms"] for g in res[side]]), \
            med([g["cpu_hosts_ms"] for g in res[side]])
        s = f"   {side:13s} {med(rates):7.1f} tasks/s   CPU/task here {cd:5.1f} ms, hosts " \
            f"{ch:5.1f} ms   rounds: " + ", ".join(f"{x:.1f}" for x in rates)
        print(s)
        lines.append(f"| {side} | {med(rates):.1f} | {', '.join(f'{x:.1f}' for x in rates)} | "
                     f"{cd:.1f} | {ch:.1f} |")
    lib = res["hyper lib"]
    lines += ["", f"hyper lib details (medians): prepare_run (bootstrap of 4 hosts) "
              f"{med([g['prepare'] for g in lib]):.2f} s, Scheduler.run() "
              f"{med([g['run'] for g in lib]):.2f} s; end-to-end (prepare + run) "
              f"{med([g['rate_e2e'] for g in lib]):.1f} tasks/s. Per attempt, from the state "
              f"file: created→started (launch) {med([g['launch_ms'] for g in lib]):.0f} ms, "
              f"started→ended (`true` under bash) {med([g['task_ms'] for g in lib]):.0f} ms, "
              f"ended→next created on the same node "
              f"{med([g['gap_ms'] for g in lib]):.0f} ms.",
              "", "| ratio (per round, then median) | median | per round | goal | met |",
              "|---|---|---|---|---|"]
    print("\n   ratios (per round, median):")
    goals = {"hyper CLI / parallel 1/": 10.0, "hyper run() / raw exec": 0.5}
    for k, v in ratios.items():
        goal = goals.get(k)
        met = "" if goal is None else ("yes" if med(v) >= goal else "NO")
        print(f"   {k:28s} {med(v):6.2f}   rounds: {', '.join(f'{x:.2f}' for x in v)}"
              + (f"   goal >= {goal:g}: {met}" if goal else ""))
        lines.append(f"| {k} | {med(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} | "
                     f"{'≥ %g' % goal if goal else ''} | {met} |")
    lines += ["", "Commands (KEY = the pool's client key, KNOWN = its known_hosts):", ""]
    lines.append("- hyper lib: `prepare_run(State(), RECIPE, trust_new_hosts=True)` then "
                 "`Scheduler(state, wid, provider, nodes).run()` in the benchmark's process")
    lines.append("- hyper CLI: `python -m hypercli run RECIPE --trust-new-hosts "
                 "--on-interrupt cancel` (fresh HYPER_HOME)")
    lines.append("- RECIPE: `cluster: {provider: ssh, hosts: [root@IP1:22, ..., root@IP4:22], "
                 f"identity_file: KEY}}`, `experiments: {{t: {{sampling: grid, samples: {n}, "
                 "command: 'true'}}`")
    for side, c in cmds.items():
        lines.append(f"- {side}: `{c}`")
    lines.append("- raw exec: 4 `paramiko.SSHClient`s over `hypercli.ssh.conn.make_socket` "
                 f"sockets, one thread each, {n // 4} × `open_session(); exec_command('true'); "
                 "recv_exit_status()` (connect not timed)")
    if prof:
        print("\n   (the rest of this process's CPU is paramiko's transport threads, one per "
              "connection)")
        print(f"\n   profile run (instrumented, not compared): {prof['run']['rate']:.1f} tasks/s,"
              f" driver process CPU {prof['driver_cpu']:.1f} s over {prof['wall']:.1f} s wall,"
              f" machine busy {100 * prof['machine_busy']:.0f}%")
        lines += ["", "Profile (one extra instrumented in-process run, 4 node threads; "
                  f"{prof['run']['rate']:.1f} tasks/s; driver process CPU "
                  f"{prof['driver_cpu']:.1f} s over {prof['wall']:.1f} s wall; whole machine "
                  f"{100 * prof['machine_busy']:.0f}% busy):", "",
                  "| call | count | median wall ms | total wall s (summed over threads) | "
                  "total CPU s of the calling thread |", "|---|---|---|---|---|"]
        for k, cnt, m, tot, cpu in prof["rows"]:
            print(f"   {k:42s} n={cnt:5d} median {m:7.2f} ms  total {tot:6.2f} s  "
                  f"thread CPU {cpu:5.2f} s")
            lines.append(f"| {k.strip()} | {cnt} | {m:.2f} | {tot:.2f} | {cpu:.2f} |")
    out += lines + [""]


# ----------------------------------------------------------------------------- 2. recovery

SHORT_TASKS = 50
#: the ``stall`` fault, run inside the victim host: 4 busy loops on its (shared) CPUs for 6 s,
#: and its node agent stopped for 4 s in the middle (an answer 4 s late: longer than the
#: answer's grace and the TCP probe together)
STALL_CMD = ("for i in 1 2 3 4; do timeout 6 sh -c 'while :; do :; done' & done; "
             "pids=$(pgrep -f 'agent-.*[.]py serve'); kill -STOP $pids; sleep 4; "
             "kill -CONT $pids; wait")
RECOVERY_CMD = "if [ {{i}} -eq 0 ]; then sleep 6; else sleep 0.5; fi"


def hyper_recovery(key: Path, fault: str) -> dict:
    from hypercli.scheduler import Scheduler
    from hypercli.state import State
    from hypercli.workflows import prepare_run
    home = fresh_home()
    with HostPool(client_key=key) as pool:
        hosts = pool.start(3)
        by_ip = {h.ip: h for h in hosts}
        path = write_recipe(home, "rec", hosts, pool.client_key, {"work": {
            "parameters": {"i": list(range(SHORT_TASKS + 1))}, "retries": 2,
            "command": RECOVERY_CMD}})
        state = State()
        wid, _, prov, nodes, lock = prepare_run(state, str(path), trust_new_hosts=True)
        victim = next(t["id"] for t in state.tasks(wid) if t["params"]["i"] == 0)
        ip_of = {nd["name"]: nd["address"]["host"] for nd in nodes}
        seen: dict = {}

        def inject():
            try:
                st = State()
                end = time.time() + 60
                while time.time() < end:
                    run = [a for a in st.attempts(wid, victim) if a["status"] == "running"]
                    if run:
                        break
                    time.sleep(0.01)
                else:
                    seen["error"] = "task 0 never ran"
                    return
                seen["node"] = run[0]["node"]
                host = by_ip[ip_of[run[0]["node"]]]
                time.sleep(1.0)
                seen["fault"] = time.time()
                if fault == "stall":  # loaded but alive: must not be declared lost
                    host.run(STALL_CMD, check=True, timeout=30)
                    return
                host.kill() if fault == "kill" else host.cut()
                end = time.time() + 60
                while time.time() < end:
                    retry = [a for a in st.attempts(wid, victim)
                             if a["number"] >= 2 and a["status"] in ("running", "succeeded")]
                    if retry:
                        seen["seen_running"] = time.time()
                        break
                    time.sleep(0.01)
                st.close()
            except Exception as e:  # reported below
                seen["error"] = repr(e)
        th = threading.Thread(target=inject, daemon=True)
        th.start()
        try:
            summary = Scheduler(state, wid, prov, nodes).run()
        finally:
            lock.release()
            th.join(timeout=70)
            close_provider(prov, "rec", nodes)
        if "error" in seen:
            raise AssertionError(seen["error"])
        assert summary.exit_code == 0, summary
        for t in state.tasks(wid):
            sts = [a["status"] for a in state.attempts(wid, t["id"])]
            assert sts.count("succeeded") == 1, (t["id"], sts)
        atts = state.attempts(wid, victim)
        if fault == "stall":
            lost = [e for e in state.events(wid, limit=10000) if e["message"].startswith("lost")]
            late = [e for e in state.events(wid, limit=10000)
                    if e["node"] == seen["node"] and e["ts"] >= seen["fault"]]
            state.close()
            return {"lost_events": len(lost), "attempts": len(atts),
                    "status": atts[0]["status"], "events": len(late)}
        assert atts[0]["status"] == "lost" and atts[0]["node"] == seen["node"], atts
        retry = next(a for a in atts if a["number"] >= 2)
        assert retry["node"] != seen["node"]
        evs = [e for e in state.events(wid, limit=10000) if e["node"] == seen["node"]]
        first_err = next((e["ts"] for e in evs if e["message"].startswith("unreachable")
                          and e["ts"] >= seen["fault"]), None)
        lost = next((e["ts"] for e in evs if e["message"].startswith("lost")), None)
        f = seen["fault"]
        state.close()
        return {"noticed": first_err - f if first_err else None,
                "lost": lost - f if lost else None,
                "created": retry["created_at"] - f, "started": retry["started_at"] - f,
                "running": seen["seen_running"] - f if "seen_running" in seen else None}


def parallel_recovery(key: Path, fault: str, keepalive: bool, cap: float = 90) -> dict:
    with HostPool(client_key=key) as pool:
        hosts = pool.start(3)
        by_name = {h.name: h for h in hosts}
        extra = (" -o ServerAliveInterval=1 -o ServerAliveCountMax=3 -o ConnectTimeout=3"
                 if keepalive else "")
        logins = ",".join(f"1/{h.user}@{h.ip}" for h in hosts)
        job = ("echo START {} $(date +%s.%N) $(hostname); "
               "if [ {} -eq 0 ]; then sleep 6; else sleep 0.5; fi")
        cmd = (f"seq 0 {SHORT_TASKS} | parallel --line-buffer --retries 2 -S {logins} "
               f"--ssh {shlex.quote(ssh_cmd(pool, extra))} {shlex.quote(job)}")
        p = subprocess.Popen(["bash", "-c", cmd], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=parallel_env(),
                             start_new_session=True)
        seen: dict = {"starts": []}
        errs: list[str] = []

        def fault_later(h):
            time.sleep(1.0)
            seen["fault"] = time.time()
            h.kill() if fault == "kill" else h.cut()

        def read_out():
            for line in p.stdout:
                f = line.split()
                if len(f) == 4 and f[0] == "START" and f[1] == "0":
                    seen["starts"].append((time.time(), float(f[2]), f[3]))
                    if "victim" not in seen:
                        seen["victim"] = f[3]
                        threading.Thread(target=fault_later, args=(by_name[f[3]],),
                                         daemon=True).start()

        def read_err():
            errs.extend(p.stderr)
        readers = [threading.Thread(target=read_out, daemon=True),
                   threading.Thread(target=read_err, daemon=True)]
        for t in readers:
            t.start()
        timed_out = False
        try:
            p.wait(timeout=cap)
        except subprocess.TimeoutExpired:
            timed_out = True
        left = kill_session(p.pid)  # parallel and its ssh children, when still there
        p.wait()
        retry = [s for s in seen["starts"] if s[2] != seen.get("victim")]
        for t in readers:
            t.join(timeout=5)
        f = seen.get("fault")
        if f is None:
            raise AssertionError(f"parallel: no fault injected: {''.join(errs)[-1500:]}")
        out = {"rc": p.returncode, "timed_out": timed_out, "killed_left": left,
               "refused_or_timeout_lines": sum("ssh: connect" in e for e in errs)}
        if retry:
            out["running"] = retry[0][1] - f
            out["seen"] = retry[0][0] - f
        else:
            out["running"] = None
        out["cmd"] = cmd.replace(str(pool.client_key), "KEY").replace(str(pool.known_hosts),
                                                                      "KNOWN")
        return out


def bench_recovery(args, key: Path, out: list[str]) -> None:
    reps = args.rounds
    print(f"\n== 2. recovery: 3 hosts, {reps} trial(s) per fault ==")
    print(f"   load average at start: {loadavg()}")
    res: dict[str, list] = defaultdict(list)
    cmds = {}
    stalls = []
    for r in range(reps):
        st = hyper_recovery(key, "stall")
        stalls.append(st)
        print(f"   trial {r + 1} hyper    stall: lost events {st['lost_events']}, task 0 "
              f"attempts {st['attempts']} ({st['status']}), node events after the fault "
              f"{st['events']}", flush=True)
        for fault in ("kill", "cut"):
            h = hyper_recovery(key, fault)
            res[("hyper", fault)].append(h)
            print(f"   trial {r + 1} hyper    {fault:4s}: retry running (state file) "
                  f"{fmt(h['running'])} s; noticed {fmt(h['noticed'])} s, lost "
                  f"{fmt(h['lost'])} s, retry created {fmt(h['created'])} s, started on its "
                  f"node {fmt(h['started'])} s", flush=True)
            q = parallel_recovery(key, fault, keepalive=True)
            res[("parallel", fault)].append(q)
            cmds["parallel"] = q["cmd"]
            print(f"   trial {r + 1} parallel {fault:4s}: retry of job 0 running "
                  f"{fmt(q['running'])} s (exit {q['rc']}, {q['refused_or_timeout_lines']} "
                  "failed ssh connects to the dead host)", flush=True)
    plain = None
    if not args.quick:
        plain = parallel_recovery(key, "cut", keepalive=False, cap=30)
        cmds["parallel (plain ssh)"] = plain["cmd"]
        print(f"   parallel, plain ssh options, cut: retry running {fmt(plain['running'])} s"
              f"{' (gave up waiting after 30 s)' if plain['running'] is None else ''}")
    lines = ["## 2. Recovery: fault → the lost task running on another host (3 hosts)", "",
             f"Trials: {reps} per fault, a fresh 3-host pool and HYPER_HOME each. Task 0 runs "
             f"`sleep 6`, {SHORT_TASKS} others `sleep 0.5` (every host busy at the fault, a "
             "slot frees every ~0.5 s on the survivors); the fault comes 1 s after task 0 is "
             "running. Load average at start: " + loadavg() + ".", "",
             "| tool | fault | retry running: median s | max s | per trial | goal < 10 s |",
             "|---|---|---|---|---|---|"]
    print("\n   medians (max):")
    for (tool, fault), rows in res.items():
        vals = [x["running"] for x in rows]
        ok = [v for v in vals if v is not None]
        mx = max(ok) if len(ok) == len(vals) and ok else None
        goal = ("yes" if mx is not None and mx < 10 else "NO") if tool == "hyper" else ""
        print(f"   {tool:8s} {fault:4s} retry running: median {fmt(med(vals))} s, max "
              f"{fmt(mx, none='not recovered')} s  trials: "
              + ", ".join(fmt(v) for v in vals) + (f"  goal < 10 s: {goal}" if goal else ""))
        lines.append(f"| {tool} | {fault} | {fmt(med(vals))} | {fmt(mx, none='n/a')} | "
                     f"{', '.join(fmt(v) for v in vals)} | {goal} |")
        if tool == "hyper":
            parts = []
            for k, label in (("noticed", "first error event"), ("lost", "node lost event"),
                             ("created", "retry attempt created"),
                             ("started", "retry started on its node")):
                parts.append(f"{label} {fmt(med([x[k] for x in rows]))} s")
            print("      hyper medians: " + "; ".join(parts))
            lines.append(f"| ↳ hyper {fault}, medians | | | | {'; '.join(parts)} | |")
    for (tool, fault) in (("parallel", "kill"), ("parallel", "cut")):
        rows = res.get((tool, fault), [])
        if rows:
            r_vs = [x["running"] for x in rows]
            h_vs = [x["running"] for x in res[("hyper", fault)]]
            if all(v is not None for v in r_vs + h_vs):
                ratio = med(r_vs) / med(h_vs)
                print(f"   {fault}: parallel / hyper (medians) = {ratio:.1f}")
                lines.append(f"| parallel / hyper, {fault} | {ratio:.1f}× | | | | |")
    false = sum(1 for x in stalls if x["lost_events"] or x["attempts"] != 1)
    print(f"   stall (loaded host, agent stopped 4 s): false losses {false} of {len(stalls)}")
    lines.append(f"| hyper | stall (loaded, agent stopped 4 s) | false losses: {false} of "
                 f"{len(stalls)} | | task 0 attempts: "
                 f"{', '.join(str(x['attempts']) for x in stalls)} | |")
    if plain is not None:
        lines.append(f"| parallel, plain ssh options (no ServerAlive) | cut | "
                     f"{fmt(plain['running'], none='not recovered after 30 s')} | | 1 trial | |")
    lines += ["", "Commands:", "",
              "- hyper: `prepare_run(..., trust_new_hosts=True)` + `Scheduler(...).run()` in "
              "the benchmark's process; recipe `experiments: {work: {parameters: {i: [0..%d]}, "
              "retries: 2, command: '%s'}}` on `provider: ssh` with the 3 hosts"
              % (SHORT_TASKS, RECOVERY_CMD)]
    for k, c in cmds.items():
        lines.append(f"- {k}: `{c}`")
    out += lines + [""]


# ------------------------------------------------------------------------------ 3. fan-out

def bench_fanout(args, key: Path, out: list[str]) -> None:
    from hypercli import cluster as C
    from hypercli.providers.ssh import SSHProvider
    from hypercli.ssh.conn import Target
    from hypercli.state import State
    from hypercli.workflows import cluster_spec
    rounds = args.rounds
    print(f"\n== 3. fan-out: bootstrap of 8 cold hosts, {rounds} round(s) ==")
    print(f"   load average at start: {loadavg()}")
    res: dict[str, list] = defaultdict(list)
    with HostPool(client_key=key) as pool:
        hosts = pool.start(8)

        def cold():
            for h in hosts:
                h.run("rm -rf /root/.hyper", check=True)
            fresh_home()

        def up(hs, name):
            cold()
            state = State()
            prov = SSHProvider(trust_new_hosts=True)
            spec = cluster_spec(name, "ssh", [h.address() for h in hs],
                                identity_file=str(pool.client_key))
            c0, t0 = os.times(), time.perf_counter()
            nodes = C.up(state, spec, prov)
            dt, c1 = time.perf_counter() - t0, os.times()
            res[f"driver CPU, up {len(hs)}"].append(c1.user + c1.system - c0.user - c0.system)
            assert len(nodes) == len(hs), nodes
            close_provider(prov, name, nodes)
            state.close()
            return dt

        def serial():
            cold()
            prov = SSHProvider(trust_new_hosts=True)
            each = []
            c0, h0 = own_cpu(), host_cpu(hosts)
            t0 = time.perf_counter()
            for i, h in enumerate(hosts):
                t = time.perf_counter()
                prov.bootstrap(f"ser-{i}", Target.parse(h.address(),
                                                        identity_file=str(pool.client_key)),
                               "ser")
                each.append(time.perf_counter() - t)
            dt = time.perf_counter() - t0
            for i in range(len(hosts)):
                prov.drop(f"ser-{i}")
            time.sleep(0.5)  # the hosts' sshd connection processes exit and are reaped
            # all the CPU 8 bootstraps cost, here and on the hosts, over this machine's cores:
            # no schedule of them can take less wall time on this machine
            res["CPU floor of 8 bootstraps"].append(
                (own_cpu() - c0 + host_cpu(hosts) - h0) / (os.cpu_count() or 1))
            return dt, each

        up(hosts[:1], "warm")  # imports (paramiko, cryptography) and first-use costs
        res.clear()
        sides = ["up 8", "up 1", "serial 8"]
        for r in range(rounds):
            order = sides[r % 3:] + sides[:r % 3]
            for side in order:
                if side == "up 8":
                    res[side].append(up(hosts, f"fan{r}"))
                elif side == "up 1":
                    res[side].append(up([hosts[r % 8]], f"one{r}"))
                else:
                    dt, each = serial()
                    res[side].append(dt)
                    res["serial slowest single"].append(max(each))
                    res["serial median single"].append(med(each))
            print(f"   round {r + 1}: up(8) {res['up 8'][-1]:.3f} s, up(1) {res['up 1'][-1]:.3f}"
                  f" s, serial(8) {res['serial 8'][-1]:.3f} s (slowest single "
                  f"{res['serial slowest single'][-1]:.3f} s)", flush=True)
    ratio_ps = [a / b for a, b in zip(res["up 8"], res["serial 8"])]
    ratio_p1 = [a / b for a, b in zip(res["up 8"], res["up 1"])]
    ratio_pmax = [a / b for a, b in zip(res["up 8"], res["serial slowest single"])]
    ratio_floor = [a / b for a, b in zip(res["up 8"], res["CPU floor of 8 bootstraps"])]
    print("\n   medians:")
    lines = ["## 3. Fan-out: bootstrap of 8 cold hosts", "",
             f"Rounds: {rounds}, median shown; before every measurement `rm -rf /root/.hyper` on "
             "each host (agent uploaded again) and a fresh HYPER_HOME (host keys pinned again "
             "with trust_new_hosts). Load average at start: " + loadavg() + ".", "",
             "| measurement | median s | per round |", "|---|---|---|"]
    for k in ("up 8", "up 1", "serial 8", "serial slowest single", "serial median single",
              "CPU floor of 8 bootstraps", "driver CPU, up 8", "driver CPU, up 1"):
        v = res[k]
        print(f"   {k:22s} {med(v):.3f} s   rounds: {', '.join(f'{x:.3f}' for x in v)}")
        lines.append(f"| {k} | {med(v):.3f} | {', '.join(f'{x:.3f}' for x in v)} |")
    lines += ["", "| ratio (per round, then median) | median | per round |", "|---|---|---|"]
    for k, v in (("up(8) / serial(8)", ratio_ps), ("up(8) / up(1)", ratio_p1),
                 ("up(8) / slowest single of the serial run", ratio_pmax),
                 ("up(8) / CPU floor (all CPU / cores)", ratio_floor)):
        print(f"   {k:40s} {med(v):.2f}   rounds: {', '.join(f'{x:.2f}' for x in v)}")
        lines.append(f"| {k} | {med(v):.2f} | {', '.join(f'{x:.2f}' for x in v)} |")
    lines += ["", "Commands: `hypercli.cluster.up(State(), cluster_spec(NAME, 'ssh', HOSTS, "
              "identity_file=KEY), SSHProvider(trust_new_hosts=True))` for 8 and for 1 host; "
              "serial: `SSHProvider(trust_new_hosts=True).bootstrap(name, Target, 'ser')` for the "
              "8 hosts in a loop.", ""]
    out += lines


# ---------------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="1 round/trial each, no parallel -M side, no plain-ssh cut trial")
    ap.add_argument("--rounds", type=int, help="rounds (default 3, 1 with --quick)")
    ap.add_argument("--tasks", type=int, default=500, help="tasks of benchmark 1")
    ap.add_argument("--only", default="1,2,3", help="benchmarks to run, e.g. 1,3")
    ap.add_argument("--no-profile", action="store_true", help="skip the profile run")
    ap.add_argument("--out", help="also write the Markdown results here")
    args = ap.parse_args()
    args.rounds = args.rounds or (1 if args.quick else 3)
    if shutil.which("parallel") is None:
        print("GNU parallel is missing: apt-get install -y parallel", file=sys.stderr)
        return 2
    pv = subprocess.run(["parallel", "--version"], capture_output=True,
                        text=True).stdout.splitlines()[0]
    import paramiko
    print(f"hypercli {code_version()}; {pv}; paramiko {paramiko.__version__}; "
          f"Python {sys.version.split()[0]}; {os.cpu_count()} CPUs")
    keydir = tmpdir("hyper-bench-ssh-key-")
    key = Path(keydir) / "client_key"
    _wait_all([_keygen(key, "hyper-bench")], "ssh-keygen")
    out = ["# SSH benchmarks (bench/bench_ssh.py)", "",
           f"Code: {code_version()}. Peers: {pv}; paramiko {paramiko.__version__}. "
           f"Python {sys.version.split()[0]}, {os.cpu_count()} CPUs (shared with other jobs). "
           f"Command: `python bench/bench_ssh.py{' --quick' if args.quick else ''}`.", ""]
    only = {s.strip() for s in args.only.split(",")}
    try:
        if "1" in only:
            bench_dispatch(args, key, out)
        if "2" in only:
            bench_recovery(args, key, out)
        if "3" in only:
            bench_fanout(args, key, out)
    finally:
        for d in TEMP_DIRS:
            shutil.rmtree(d, ignore_errors=True)
    if args.out:
        Path(args.out).write_text("\n".join(out) + "\n")
        print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
