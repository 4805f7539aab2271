"""What a node does for a workflow besides running tasks, written once for every provider:
the recipe's ``mounts:`` (mounted before the first task, unmounted on ``hyper down``) and task
outputs kept in object storage (:mod:`hypercli.mount.outputs`).

A provider's session gives :class:`NodeRuntime` two things: ``sh`` (run a shell command on
the node) and ``hyper`` (the shell words that run hypercli there: this Python for the local
provider, the copied runtime of :mod:`hypercli.node.bundle` over SSH), used as
``<python> -m hypercli.mount.node ...``, which needs no package beyond boto3 and mfusepy.

Mount kinds (recipe ``mounts: {PATH: URL}``):
* ``chunks+s3://...``, ``chunks+file://...``: hypercli's chunked FUSE mount
  (``hyper data mount``), its chunk cache in ``<node root>/cache``;
* ``s3://bucket/prefix``: the bucket itself, with goofys, else s3fs, whichever the node has;
  read-only unless the recipe mounts it ``rw``;
* ``gs://bucket/prefix``, ``az://account/container/prefix``: the bucket itself, with rclone
  (:mod:`hypercli.mount.bucket`), read-only unless ``rw`` (then with a write-back cache);
  an attempt's end (:meth:`NodeRuntime.finish_command`) and ``hyper down`` wait for that
  cache to be uploaded; ``hyper down`` then unmounts and stops rclone by its PID.

hypercli mounts over, and unmounts, only what it made (:func:`guarded`): before mounting, a
path that is already a mount point hypercli did not make, that is not a folder, or that is a
folder with something in it is refused (the node command exits 2 with the reason on stderr;
the recipe's system paths are refused before, by :mod:`hypercli.recipe.cluster`). Each
mount made is recorded on the node in ``<node root>/mounts/<hash of the path>`` as its line
of ``/proc/self/mountinfo`` (mount id, device, type, source); ``hyper down`` unmounts a path
only when the mount on top there is the one recorded.
"""

from __future__ import annotations

import hashlib
import os
import shlex
from typing import Callable

from hypercli.errors import InfraError
from hypercli.mount.bucket import node_paths
from hypercli.mount.outputs import checkpoint_url, output_url
from hypercli.ssh.conn import CommandFailed


class NodeSetupError(InfraError):
    """Preparing a node for a workflow failed (a mount, pulling inputs): the attempts that
    needed it fail with this reason; the node itself is not lost. ``stderr``: what the
    failed command said, when one did."""

    def __init__(self, message: str, hint: str | None = None, *, stderr: str = ""):
        super().__init__(message, hint)
        self.stderr = stderr


def _said(e: Exception) -> str:
    """The reason of a failed node command: the last lines of its stderr, else the error
    (which names the command)."""
    err = e.result.stderr.decode(errors="replace") if isinstance(e, CommandFailed) \
        else getattr(e, "stderr", "")
    return "\n".join(err.strip().splitlines()[-5:]) or str(e)


#: environment passed to node-side hypercli commands when set here (an S3-compatible
#: endpoint is not a secret; credentials come from the node's own configuration)
FORWARD_ENV = ("HYPER_S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_DEFAULT_REGION",
               "HYPER_GCS_ENDPOINT_URL", "STORAGE_EMULATOR_HOST", "GOOGLE_CLOUD_PROJECT",
               "HYPER_AZURE_STORAGE_ENDPOINT_URL")


def forwarded_env() -> dict:
    return {k: os.environ[k] for k in FORWARD_ENV if os.environ.get(k)}


def env_prefix() -> str:
    return "".join(f"{k}={shlex.quote(v)} " for k, v in forwarded_env().items())


def _serving(p: str) -> str:
    """Shell test: a file system is mounted at quoted path ``p`` and answers. A FUSE mount
    whose daemon died stays in the mount table and may still pass ``stat`` from the kernel's
    cached attributes; ``statfs`` is never cached, so it fails there (ENOTCONN)."""
    return f"mountpoint -q {p} && stat -f {p} >/dev/null 2>&1"


def _detach(p: str) -> str:
    """Shell text that lazily unmounts a dead FUSE mount at quoted path ``p``; nothing, and
    no output, when none is there."""
    return (f"{{ fusermount3 -uz {p} || fusermount -uz {p} || umount -l {p}; }} "
            f">/dev/null 2>&1")


def mount_command(hyper: str, url: str, path: str, cache: str, rw: bool = False,
                  copy: bool = False, root: str | None = None) -> str:
    """Shell text that mounts ``url`` at ``path`` on a node (idempotent: nothing when a file
    system is mounted there and answers; a mount whose daemon died is detached and mounted
    again). A plain bucket is mounted read-only (goofys, s3fs, rclone alike) unless ``rw``.
    ``copy`` (a ``chunks+`` dataset in ``mode: copy``): the dataset is copied to the node's
    disk under ``cache/copies``, shared by its tasks (:mod:`hypercli.mount.copy`), and bound
    at ``path`` read-only. ``root``: the node's hypercli folder (default: ``cache``'s
    parent), where a gs:// or az:// mount keeps its rclone PID and cache."""
    p = shlex.quote(path)
    if copy:
        cmd = (f"{env_prefix()}{hyper} copy {shlex.quote(url[len('chunks+'):])} {p} "
               f"--root {shlex.quote(cache + '/copies')}")
    elif url.startswith(("gs://", "az://")):
        root = root or os.path.dirname(cache)  # a dead mount's rclone may still run: stopped
        cmd = (f"{_stop_rclone(path, root)}; {env_prefix()}{hyper} bucket-mount "
               f"{shlex.quote(url)} {p} --root {shlex.quote(root)}" + (" --rw" if rw else ""))
    elif url.startswith("chunks+"):
        cmd = (f"{env_prefix()}{hyper} mount {shlex.quote(url[len('chunks+'):])} {p} "
               f"--cache-dir {shlex.quote(cache)}")
    else:
        bucket_path = url[len("s3://"):]
        bucket, _, prefix = bucket_path.partition("/")
        endpoint = forwarded_env().get("HYPER_S3_ENDPOINT_URL")
        goofys = "goofys " + ("" if rw else "-o ro ") + \
            (f"--endpoint {shlex.quote(endpoint)} " if endpoint else "") + \
            f"{shlex.quote(bucket + (':' + prefix if prefix else ''))} {p}"
        s3fs = (f"s3fs {shlex.quote(bucket + (':/' + prefix if prefix else ''))} {p} "
                f"-o {'rw' if rw else 'ro'}"
                + (f",url={shlex.quote(endpoint)},use_path_request_style" if endpoint else ""))
        cmd = (f"if command -v goofys >/dev/null; then {goofys}; elif command -v s3fs "
               f">/dev/null; then {s3fs}; else echo 'neither goofys nor s3fs is installed' >&2; "
               "exit 127; fi")
    serving = _serving(p)
    if url.startswith("chunks+") and not copy:  # an image mount whose daemon died: again
        from hypercli.mount.image import pid_file
        pid = shlex.quote(str(pid_file(cache, path)))
        serving += (f" && {{ [ \"$(stat -f -c %T {p})\" != erofs ] || "
                    f"{{ {_daemon_alive(pid)}; }}; }}")  # grouped: && binds no tighter than ||
    return f"{serving} || {{ {_detach(p)}; mkdir -p {p} && {cmd}; }}"


def _daemon_alive(pidfile: str) -> str:
    """Shell test: the process named in quoted PID file ``pidfile`` runs (not a zombie: a
    daemon killed on a node whose PID 1 reaps no one stays one) and is a dataset mount's
    daemon (``python -m hypercli.mount.fusefs``), so a later process given the same PID is
    not taken for it."""
    return (f"{{ read pid < {pidfile}; }} 2>/dev/null && "
            "case \"$pid\" in ''|*[!0-9]*) false ;; esac && "
            "s=$(sed 's/.*) //' /proc/\"$pid\"/stat 2>/dev/null | cut -d' ' -f1) && "
            "[ -n \"$s\" ] && [ \"$s\" != Z ] && "
            "tr '\\0' '\\n' < /proc/\"$pid\"/cmdline 2>/dev/null | "
            "grep -qx hypercli.mount.fusefs")


def _record(path: str, root: str) -> str:
    """The node file recording the mount hypercli made at ``path`` (module docstring)."""
    return f"{root}/mounts/{hashlib.sha256(path.encode()).hexdigest()[:16]}"


def _top_mount(path: str) -> str:
    """Shell text printing ``ID MAJOR:MINOR TYPE SOURCE`` of the mount on top at ``path``
    from /proc/self/mountinfo (the last line for it; proc(5) for the fields, whose mount
    point has space, tab, newline and backslash written as octal escapes); nothing when
    none is there."""
    escaped = "".join({" ": "\\040", "\t": "\\011", "\n": "\\012", "\\": "\\134"}.get(c, c)
                      for c in path)
    return (f"HYPER_MP={shlex.quote(escaped)} awk '$5 == ENVIRON[\"HYPER_MP\"] {{ i = 7; "
            "while (i < NF && $i != \"-\") i++; top = $1 \" \" $3 \" \" $(i + 1) \" \" $(i + 2) } "
            "END { if (top != \"\") print top }' /proc/self/mountinfo")


def _refuse(why: str, p: str, *args: str) -> str:
    """Shell text: print ``hyper: <path> <why>`` on stderr (``%s`` in ``why`` filled by
    ``args``, shell words) and exit 2."""
    fmt = shlex.quote("hyper: %s " + why + "\\n")
    return f"printf {fmt} {p} {' '.join(args)} >&2; exit 2"


def mount_guard(path: str, root: str) -> str:
    """Shell text that exits 2, the reason on stderr, when nothing may be mounted at
    ``path`` (module docstring): a mount point other than the one hypercli recorded there,
    not a folder, or a folder with something in it. Nothing is changed."""
    p, rec = shlex.quote(path), shlex.quote(_record(path, root))
    mounted = _refuse("is already a mount point that hypercli did not make (%s): not mounted "
                      "over (the task would read it, and hyper down must not take it away)",
                      p, "\"$(echo \"$m\" | cut -d' ' -f3-)\"")
    not_dir = _refuse("is not a folder: nothing is mounted over it", p)
    full = _refuse("is a folder with files in it: nothing is mounted over it (they would be "
                   "hidden from the task)", p)
    return (f"m=$({_top_mount(path)}); "
            f"if [ -n \"$m\" ] && [ \"$m\" != \"$(cat {rec} 2>/dev/null)\" ]; then {mounted}; fi; "
            f"if [ -z \"$m\" ]; then "
            f"if [ -L {p} ] || {{ [ -e {p} ] && [ ! -d {p} ]; }}; then {not_dir}; fi; "
            f"if [ -d {p} ] && [ -n \"$(ls -A {p} 2>/dev/null | head -c 1)\" ]; then {full}; fi; "
            "fi")


def guarded(path: str, root: str, command: str) -> str:
    """Shell text that runs a mount ``command`` for ``path`` only when :func:`mount_guard`
    lets it, then records the mount it made (waiting up to 5 s for it to show in
    /proc/self/mountinfo, as a daemonising FUSE tool mounts after it returns)."""
    rec = shlex.quote(_record(path, root))
    return (f"{{ {mount_guard(path, root)}; }} && {{ {command}; }} && "
            f"{{ n=0; while m=$({_top_mount(path)}); [ -z \"$m\" ] && [ $n -lt 50 ]; do "
            f"sleep 0.1; n=$((n + 1)); done; [ -n \"$m\" ] && "
            f"mkdir -p {shlex.quote(root + '/mounts')} && "
            f"printf '%s\\n' \"$m\" > {rec}.tmp && mv {rec}.tmp {rec}; }}")


#: seconds ``hyper down`` waits for a rw bucket mount's write-back cache to be uploaded
DRAIN_S = 600


def _rclone_alive(pidfile: str, path: str) -> str:
    """Shell test: the rclone of quoted PID file ``pidfile`` (``PID START_TIME``, written by
    :func:`hypercli.mount.bucket.mount`) still runs the mount at ``path``: that PID (digits
    only) with that start time (proc(5) field 22), so a later process given the same PID is
    never taken for it, and whose command line is ``rclone mount REMOTE PATH ...``, so a PID
    file written by anyone else names no other process. Sets ``pid``."""
    cmdline = "tr '\\0' '\\n' < /proc/\"$pid\"/cmdline 2>/dev/null | sed -n"
    return (f"{{ read pid st < {pidfile}; }} 2>/dev/null && "
            f"case \"$pid\" in ''|*[!0-9]*) false ;; esac && "
            f"[ \"$(sed 's/.*) //' /proc/\"$pid\"/stat 2>/dev/null | cut -d' ' -f20)\" = \"$st\" ] "
            f"&& [ \"$({cmdline} 2p)\" = mount ] && "
            f"[ \"$({cmdline} 4p)\" = {shlex.quote(os.path.abspath(path))} ]")


def _drain(path: str, root: str) -> str:
    """Shell text that waits, up to :data:`DRAIN_S` s, while the live rclone of the bucket
    mount at ``path`` has files in its write-back cache not uploaded yet (rclone marks each
    such file ``"Dirty": true`` in its ``vfsMeta`` record until it is uploaded; the record
    is rewritten in place, so the cache counts as uploaded only when two looks 0.1 s apart
    find no such mark); nothing for any other mount."""
    cache, pidfile = map(shlex.quote, node_paths(root, path))
    return (f"n=0; c=0; while [ $c -lt 2 ] && [ $n -lt {DRAIN_S * 10} ] && "
            f"{_rclone_alive(pidfile, path)}; do "
            f"if grep -rqs '\"Dirty\": true' {cache}/vfsMeta; then c=0; else c=$((c + 1)); fi; "
            "sleep 0.1; n=$((n + 1)); done")


def _stop_rclone(path: str, root: str) -> str:
    """Shell text that stops the rclone of the bucket mount at ``path`` by its PID (SIGTERM,
    SIGKILL after 10 s; it has ended when its PID is gone or a zombie) and removes its PID
    file; nothing for any other mount."""
    pidfile = shlex.quote(node_paths(root, path)[1])
    return (f"if {_rclone_alive(pidfile, path)}; then kill -TERM \"$pid\"; n=0; "
            "while [ -d /proc/\"$pid\" ] && [ \"$(sed 's/.*) //' /proc/\"$pid\"/stat 2>/dev/null "
            "| cut -d' ' -f1)\" != Z ] && [ $n -lt 100 ]; do sleep 0.1; n=$((n + 1)); done; "
            f"{_rclone_alive(pidfile, path)} && kill -KILL \"$pid\"; fi; rm -f {pidfile}")


def unmount_command(path: str, root: str) -> str:
    """Shell text that unmounts the mount at ``path`` when it is the one hypercli recorded
    there (module docstring), a dead FUSE mount (its daemon gone) lazily if need be; exits
    0 when it unmounted, 1 when nothing of hypercli's was there (anything else mounted
    there is left as it is). A gs:// or az:// bucket mount's write-back cache is uploaded
    first (:func:`_drain`), and its rclone is stopped by its PID after."""
    p, rec = shlex.quote(path), shlex.quote(_record(path, root))
    return (f"m=$({_top_mount(path)}); "
            f"if [ -n \"$m\" ] && [ \"$m\" = \"$(cat {rec} 2>/dev/null)\" ]; then "
            f"{_drain(path, root)}; "
            f"{{ fusermount3 -u {p} || fusermount -u {p} || umount {p}; }} >/dev/null 2>&1 || "
            f"{_detach(p)}; {_stop_rclone(path, root)}; rm -f {rec}; exit 0; fi; "
            f"{_stop_rclone(path, root)}; rm -f {rec}; exit 1")


def checkpoint_name(wf: dict, spec: dict) -> str:
    """Whose checkpoint a launch spec's attempt keeps, as a path under the workflow's
    checkpoints: the task's id, or ``<task>/rank-<r>`` for rank ``r`` of a multi-node task
    (unless its experiment has ``checkpoint_ranks: rank0``, kept in the workflow's spec)."""
    env = spec["env"]
    task = env["HYPER_TASK_ID"]
    if int(env.get("HYPER_NUM_NODES") or 1) <= 1 or env.get("HYPER_EXPERIMENT") in (
            (wf.get("spec") or {}).get("checkpoint_rank0") or ()):
        return task
    return f"{task}/rank-{int(env.get('HYPER_NODE_RANK') or 0)}"


class NodeRuntime:
    """Mounts and object-store outputs for one workflow on one node.

    Args:
        node: node name (errors).
        wf: the ``workflows`` row (storage, spec with mounts).
        root: the node's hypercli folder (``~/.hyper`` there).
        hyper: shell words running ``hypercli.mount.node`` on the node.
        sh: ``sh(command) -> None``, raising CommandFailed/NodeSetupError when the command
            fails and NodeError when the node cannot be reached.
    """

    def __init__(self, node: str, wf: dict, root: str, hyper: str,
                 sh: Callable[[str], None]):
        self.node, self.wf, self.root, self.hyper, self.sh = node, wf, root, hyper, sh
        self.mounted = False
        self.staged: set[str] = set()

    @property
    def object_storage(self) -> bool:
        return not self.wf["storage"].startswith("file://")

    def ensure_mounts(self) -> None:
        """Mount every ``mounts:`` entry once per workflow. Raises NodeError."""
        if self.mounted:
            return
        spec = self.wf.get("spec") or {}
        for path, url in sorted(spec.get("mounts", {}).items()):
            try:
                self.sh(guarded(path, self.root, mount_command(
                    self.hyper, url, path, f"{self.root}/cache",
                    rw=path in spec.get("rw_mounts", ()),
                    copy=path in spec.get("copy_mounts", ()), root=self.root)))
            except (CommandFailed, NodeSetupError) as e:
                raise NodeSetupError(f"mounting {url} at {path} on {self.node} failed: "
                                     f"{_said(e)}") from None
        self.mounted = True

    def stage(self, experiments: set[str], outputs: str) -> None:
        """Pull the outputs of ``experiments`` into ``outputs`` (object storage only)."""
        todo = sorted(experiments - self.staged)
        if not todo or not self.object_storage:
            return
        try:
            self.sh(f"{env_prefix()}{self.hyper} pull-outputs "
                    f"{shlex.quote(self.wf['storage'])} {shlex.quote(self.wf['id'])} "
                    f"{shlex.quote(outputs)} " + " ".join(map(shlex.quote, todo)))
        except (CommandFailed, NodeSetupError) as e:
            raise NodeSetupError(f"pulling the outputs of {', '.join(todo)} onto {self.node} "
                                 f"failed: {_said(e)}") from None
        self.staged.update(todo)

    def finish_command(self, output: str, task: str) -> str | None:
        """The command the supervisor runs after a successful task: wait until what tasks
        wrote to the node's rw ``gs://``/``az://`` bucket mounts is uploaded (:func:`_drain`:
        an attempt that succeeded has its writes in the bucket, for a later experiment on
        another node to read), then push its outputs (object storage)."""
        spec = self.wf.get("spec") or {}
        drains = "".join(f"{_drain(p, self.root)}; " for p, u in sorted(
            spec.get("mounts", {}).items()) if p in spec.get("rw_mounts", ())
            and u.startswith(("gs://", "az://")))
        if not self.object_storage:
            return drains + "true" if drains else None
        url = output_url(self.wf["storage"], self.wf["id"], task)
        return (f"{drains}{env_prefix()}{self.hyper} push-output {shlex.quote(output)} "
                f"{shlex.quote(url)}")

    def checkpoint(self, spec: dict, every: float, url: str | None = None) -> None:
        """Give a launch spec its checkpoint (:mod:`hypercli.mount.checkpoint`): the folder
        ``<root>/ckpt/<workflow>/<name>`` as ``HYPER_CHECKPOINT`` (``name``:
        :func:`checkpoint_name`), and the node-side commands the agent runs around the task:
        restore (attempts after the first) and save (every ``every`` s, at a preemption
        notice, at the end). Each rank of a multi-node task saves its own folder and gets it
        back; with ``checkpoint_ranks: rank0`` only rank 0's is saved, and every rank gets it.

        Args:
            url: the checkpoint store as the node reaches it; default the workflow's storage.
        """
        wid, task = self.wf["id"], spec["env"]["HYPER_TASK_ID"]
        number = int(spec["env"]["HYPER_ATTEMPT"])
        name = checkpoint_name(self.wf, spec)
        folder = f"{self.root}/ckpt/{wid}/{name}"
        state = shlex.quote(f"{folder}.state.json")
        url = shlex.quote(url or checkpoint_url(self.wf["storage"], wid, name))
        q = shlex.quote(folder)
        spec["env"]["HYPER_CHECKPOINT"] = folder
        saves = name != task or spec["env"].get("HYPER_NODE_RANK", "0") == "0"
        spec["checkpoint"] = {
            "dir": folder, "every": every, "preempted": f"{self.root}/preempted",
            "save": (f"{env_prefix()}{self.hyper} checkpoint-save {q} {url} {number} {state}"
                     if saves else ""),
            "restore": (f"{env_prefix()}{self.hyper} checkpoint-restore {url} {q} {state}"
                        if number > 1 else None)}

    def binds(self) -> dict:
        """Mount paths to bind into containers at the same path."""
        return {p: p for p in (self.wf.get("spec") or {}).get("mounts", {})}
