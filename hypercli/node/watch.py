#!/usr/bin/env python3
"""hypercli node watcher: preemption notices and the idle watchdog, on every cloud node.

Standard library only (it is written to the node by its boot document and run by systemd as
``python3 watch.py --config /etc/hyper/node.json``). Two jobs:

* **Preemption.** Every ``--every`` s (default 2) it asks the cloud's metadata service whether
  the spot node is being taken back, and when it is, writes ``<root>/preempted`` (JSON
  ``{"cloud", "notice", "seen"}``, atomically). The node agent adds it to every poll answer, so
  the scheduler re-queues the node's tasks on its next poll, before the node vanishes.

  - AWS: ``GET /latest/meta-data/spot/instance-action`` (IMDSv2 token first): 404 until an
    interruption is scheduled, then ``{"action": "terminate", "time": ...}``
    (docs.aws.amazon.com/AWSEC2/latest/UserGuide/spot-instance-termination-notices.html).
  - GCP: ``GET /computeMetadata/v1/instance/preempted`` with ``Metadata-Flavor: Google``:
    ``TRUE`` once preemption started (cloud.google.com/compute/docs/instances/
    create-use-preemptible#detecting_if_an_instance_was_preempted).
  - Azure: ``GET /metadata/scheduledevents?api-version=2020-07-01`` with ``Metadata: true``:
    an event of type ``Preempt`` (learn.microsoft.com/azure/virtual-machines/linux/
    scheduled-events).

* **Idle watchdog.** When no attempt has been running and no request from ``hyper`` reached the
  node agent (it touches ``<root>/contact``) for ``idle_minutes``, it removes the node: on GCP
  and Azure it deletes its own instance through the cloud's API with the instance's own
  identity, which may delete nothing else (:func:`self_delete`); on AWS, or when that is
  refused, it powers the node off
  (``--shutdown-command``, default ``shutdown -h now``) — AWS instances are launched with
  shutdown behaviour *terminate*, so they are gone.
"""

import argparse
import fcntl
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

METADATA = "http://169.254.169.254"
TIMEOUT = 2.0  # s per metadata request


def _get(url, headers, method="GET"):
    """(status, body text) of a metadata request; (0, error) when it could not be made."""
    req = urllib.request.Request(url, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, ""
    except (OSError, ValueError) as e:
        return 0, str(e)


def preemption_notice(cloud, base=METADATA):
    """The cloud's notice that this node is being preempted (a short text), or None."""
    if cloud == "aws":
        status, token = _get(base + "/latest/api/token",
                             {"X-aws-ec2-metadata-token-ttl-seconds": "300"}, method="PUT")
        headers = {"X-aws-ec2-metadata-token": token} if status == 200 else {}
        status, body = _get(base + "/latest/meta-data/spot/instance-action", headers)
        if status == 200 and body.strip():
            return "aws spot instance-action: " + body.strip()
    elif cloud == "gcp":
        status, body = _get(base + "/computeMetadata/v1/instance/preempted",
                            {"Metadata-Flavor": "Google"})
        if status == 200 and body.strip().upper() == "TRUE":
            return "gcp instance/preempted: TRUE"
    elif cloud == "azure":
        status, body = _get(base + "/metadata/scheduledevents?api-version=2020-07-01",
                            {"Metadata": "true"})
        if status == 200:
            try:
                events = json.loads(body).get("Events") or []
            except ValueError:
                events = []
            for ev in events:
                if ev.get("EventType") == "Preempt":
                    return "azure scheduled event Preempt %s not before %s" % (
                        ev.get("EventId"), ev.get("NotBefore"))
    return None


def _json(status_body):
    status, body = status_body
    if status != 200:
        return None
    try:
        return json.loads(body)
    except ValueError:
        return None


def self_delete(cloud, base=METADATA, api=None):
    """Delete this instance through its cloud's API with the instance's own identity, which
    may delete this instance and no other (GCP: the node's own service account, the one
    metadata calls ``default``, holding a custom role of ``compute.instances.get`` and
    ``.delete`` on this instance only; Azure: the VM's system-assigned managed identity, whose
    token IMDS gives when no client id is asked, holding a custom role of
    ``virtualMachines/read`` and ``/delete`` on this VM only). True when the API accepted the
    delete; False elsewhere (AWS instances are launched to terminate on shutdown) or when the
    identity has no token or no right.

    Sources: cloud.google.com/compute/docs/access/authenticate-workloads#applications (token
    from ``instance/service-accounts/default/token``); learn.microsoft.com/entra/identity/
    managed-identities-azure-resources/how-to-use-vm-token (``/metadata/identity/oauth2/token``).
    """
    if cloud == "gcp":
        h = {"Metadata-Flavor": "Google"}
        tok = _json(_get(base + "/computeMetadata/v1/instance/service-accounts/default/token", h))
        if not tok or "access_token" not in tok:
            return False
        project = _get(base + "/computeMetadata/v1/project/project-id", h)[1].strip()
        zone = _get(base + "/computeMetadata/v1/instance/zone", h)[1].strip().rsplit("/", 1)[-1]
        name = _get(base + "/computeMetadata/v1/instance/name", h)[1].strip()
        url = "%s/compute/v1/projects/%s/zones/%s/instances/%s" % (
            api or "https://compute.googleapis.com", project, zone, name)
    elif cloud == "azure":
        h = {"Metadata": "true"}
        tok = _json(_get(base + "/metadata/identity/oauth2/token?api-version=2018-02-01"
                         "&resource=https://management.azure.com/", h))
        inst = _json(_get(base + "/metadata/instance/compute?api-version=2021-02-01", h))
        if not tok or "access_token" not in tok or not inst:
            return False
        url = ("%s/subscriptions/%s/resourceGroups/%s/providers/Microsoft.Compute/"
               "virtualMachines/%s?api-version=2023-03-01") % (
            api or "https://management.azure.com", inst.get("subscriptionId"),
            inst.get("resourceGroupName"), inst.get("name"))
    else:
        return False
    status, _ = _get(url, {"Authorization": "Bearer " + tok["access_token"]}, method="DELETE")
    return 200 <= status < 300


def _locked(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def running_attempts(root):
    """Attempt ids under ``root/tasks`` whose agent still holds their lock (``script.sh``,
    see agent.py) and that have no ``exit`` yet."""
    tasks = os.path.join(root, "tasks")
    try:
        names = os.listdir(tasks)
    except OSError:
        return []
    return [n for n in names
            if not os.path.exists(os.path.join(tasks, n, "exit"))
            and _locked(os.path.join(tasks, n, "script.sh"))]


def last_activity(root, now):
    """Unix time of the last sign of use: a running attempt (now), the agent's last contact,
    or the newest attempt's end; the watcher's own start when there is none."""
    if running_attempts(root):
        return now
    times = []
    for path in (os.path.join(root, "contact"),):
        try:
            times.append(os.path.getmtime(path))
        except OSError:
            pass
    tasks = os.path.join(root, "tasks")
    try:
        for n in os.listdir(tasks):
            try:
                times.append(os.path.getmtime(os.path.join(tasks, n, "exit")))
            except OSError:
                pass
    except OSError:
        pass
    return max(times) if times else None


def boot_time():
    """Unix time of the machine's boot (a restarted watcher keeps counting from there)."""
    try:
        with open("/proc/uptime") as f:
            return time.time() - float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return time.time()


def write_marker(root, notice):
    os.makedirs(root, exist_ok=True)
    path = os.path.join(root, "preempted")
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump({"notice": notice, "seen": time.time()}, f)
    os.replace(tmp, path)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", help="JSON: cloud, cluster, node, idle_minutes, root")
    ap.add_argument("--cloud", choices=["aws", "gcp", "azure", "none"])
    ap.add_argument("--root", help="node root (default ~/.hyper of root: /root/.hyper)")
    ap.add_argument("--idle-minutes", type=float)
    ap.add_argument("--metadata-url", default=METADATA)
    ap.add_argument("--api-url", help="the cloud API's base URL (default: the cloud's own)")
    ap.add_argument("--every", type=float, default=2.0, help="s between preemption checks")
    ap.add_argument("--shutdown-command", default="shutdown -h now")
    ap.add_argument("--once", action="store_true", help="one round, then exit (tests)")
    ap.add_argument("--since", type=float,
                    help="unix s counted as the last use when there is none (default: boot)")
    a = ap.parse_args(argv)
    cfg = {}
    if a.config:
        with open(a.config) as f:
            cfg = json.load(f)
    cloud = a.cloud or cfg.get("cloud", "none")
    root = a.root or cfg.get("root") or "/root/.hyper"
    idle = a.idle_minutes if a.idle_minutes is not None else cfg.get("idle_minutes", 30)
    started = a.since if a.since is not None else boot_time()
    marked = os.path.exists(os.path.join(root, "preempted"))
    while True:
        now = time.time()
        if not marked:
            notice = preemption_notice(cloud, a.metadata_url)
            if notice:
                write_marker(root, notice)
                marked = True
                print("hyper-watch: " + notice, flush=True)
        if idle and idle > 0:
            last = last_activity(root, now) or started
            if now - max(last, started) >= idle * 60:
                print("hyper-watch: idle for %.0f min" % ((now - last) / 60), flush=True)
                if self_delete(cloud, a.metadata_url, a.api_url):
                    print("hyper-watch: the cloud is deleting this instance", flush=True)
                    return 0
                print("hyper-watch: " + a.shutdown_command, flush=True)
                subprocess.call(a.shutdown_command, shell=True)
                return 0
        if a.once:
            return 0
        time.sleep(a.every)


if __name__ == "__main__":
    sys.exit(main())
