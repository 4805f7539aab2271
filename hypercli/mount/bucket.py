"""Plain bucket mounts of ``gs://bucket/prefix`` and ``az://account/container/prefix`` on a
node, through rclone (``rclone mount``, Debian's ``rclone`` package; written against 1.60).

    mount(url, mountpoint, cache_dir=..., pid_file=..., rw=False)   start rclone, return its PID

A mount is read-only unless ``rw``; a read-write mount keeps written files in a write-back
cache (``--vfs-cache-mode writes``, https://rclone.org/commands/rclone_mount/#vfs-file-caching)
under ``cache_dir`` and uploads each one :data:`WRITE_BACK_S` s after it was last closed.
The mount is ``nosuid,nodev`` (fusermount's default; checked after mounting, and taken down
again when it is not); mounted by root, other users (a container's) may use it within the
files' modes (``--allow-other --default-permissions``), as with the chunked mount. rclone
runs in its own session, its PID and start time written to ``pid_file``; it is stopped by
that PID (:func:`hypercli.providers.runtime.unmount_command`, which first waits for the
write-back cache to be empty, so no write is lost). A rclone that died with files not yet
uploaded leaves them in ``cache_dir``; the next mount of the path, over the same cache,
uploads them.

Credentials are the node's own, found the way the node's store clients find them
(:mod:`hypercli.mount.store_gcs`, :mod:`hypercli.mount.store_azure`), and reach rclone only
through its environment (``RCLONE_CONFIG_<REMOTE>_<OPTION>``, https://rclone.org/docs/#config-
file), never its command line:

* gs, with an endpoint (``HYPER_GCS_ENDPOINT_URL``, ``STORAGE_EMULATOR_HOST``: an emulator)
  and no ``GCE_METADATA_HOST``: anonymous. Otherwise no credentials are configured, and
  rclone falls back to Google application default credentials (``google.DefaultClient``):
  ``GOOGLE_APPLICATION_CREDENTIALS`` or the VM's service account from the metadata server
  (``GCE_METADATA_HOST`` honoured).
* az, with ``AZURE_STORAGE_CONNECTION_STRING``: its account key (or its SAS token). rclone 1.60
  takes a key only for ``https://ACCOUNT.<suffix>``; for another endpoint (Azurite, the
  connection string's ``BlobEndpoint``, ``HYPER_AZURE_STORAGE_ENDPOINT_URL``) the key signs a
  container SAS valid for :data:`SAS_DAYS` days (azure-storage-blob's
  ``generate_container_sas``). Without a connection string: the VM's managed identity
  (``use_msi``; ``AZURE_CLIENT_ID`` picks a user-assigned one).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from urllib.parse import urlparse

from hypercli.errors import UsageError
from hypercli.mount.store_base import StoreError

#: seconds after a file's last close before rclone uploads it (rclone's default is 5)
WRITE_BACK_S = 1
#: days a container SAS signed with an account key stays valid (custom Azure endpoints only)
SAS_DAYS = 30
#: seconds to wait for the mount to appear after rclone started
MOUNT_WAIT_S = 30.0
#: the remote's name in rclone's environment
REMOTE = "HYPERBUCKET"
_AZ_EMULATOR_HINT = "set AZURE_STORAGE_CONNECTION_STRING with the account's key"


def parse(url: str) -> tuple[str, str, str]:
    """``(scheme, bucket, prefix)`` of a plain bucket URL; for ``az://A/C/P`` the bucket is
    ``A/C`` (account and container). Raises UsageError for another scheme, no bucket, or an
    Azure account or container name Azure would refuse."""
    u = urlparse(url)
    if u.scheme == "gs" and u.netloc:
        return "gs", u.netloc, u.path.strip("/")
    if u.scheme == "az" and u.netloc:
        from hypercli.mount.store_azure import _ACCOUNT, _CONTAINER
        container, _, prefix = u.path.lstrip("/").partition("/")
        if not _ACCOUNT.fullmatch(u.netloc):
            raise UsageError(f"{url}: {u.netloc!r} is not a storage account name",
                             "3-24 lowercase letters and digits: az://ACCOUNT/CONTAINER/PREFIX")
        if not _CONTAINER.fullmatch(container) or "--" in container:
            raise UsageError(f"{url}: {container!r} is not a container name",
                             "3-63 lowercase letters, digits and single hyphens")
        return "az", f"{u.netloc}/{container}", prefix.strip("/")
    raise UsageError(f"{url}: not a gs://BUCKET/PREFIX or az://ACCOUNT/CONTAINER/PREFIX URL")


def _opt(name: str) -> str:
    return f"RCLONE_CONFIG_{REMOTE}_{name.upper()}"


def rclone_env(url: str, environ: dict | None = None,
               rw: bool = False) -> tuple[str, dict[str, str]]:
    """``(remote path, environment)`` for rclone to reach ``url`` with the node's identity
    (module docstring). ``environ`` (default ``os.environ``) is read, not changed; the
    environment returned is the whole one for rclone, credentials included. ``rw``: a SAS
    hypercli signs allows writing too (else reading and listing only).

    Raises:
        UsageError: a bad URL, a connection string of another account, or a managed identity
            asked to reach a custom endpoint (rclone 1.60 cannot).
    """
    env = dict(os.environ if environ is None else environ)
    for k in [k for k in env if k.startswith("RCLONE_")]:  # no setting of the user's leaks in
        del env[k]
    env["RCLONE_CONFIG"] = os.devnull  # and no config file of theirs
    scheme, bucket, prefix = parse(url)
    if scheme == "gs":
        env[_opt("type")] = "gcs"
        endpoint = env.get("HYPER_GCS_ENDPOINT_URL") or env.get("STORAGE_EMULATOR_HOST")
        if endpoint:
            if "://" not in endpoint:
                endpoint = "http://" + endpoint
            env[_opt("endpoint")] = endpoint.rstrip("/") + "/storage/v1/"
            if not env.get("GCE_METADATA_HOST"):
                env[_opt("anonymous")] = "true"
        env[_opt("bucket_policy_only")] = "true"  # uniform access: no per-object ACLs
        return f"{REMOTE}:{bucket}/{prefix}".rstrip("/"), env
    from hypercli.mount.store_azure import CONNECTION_STRING_ENV, connection_string_fields
    account, container = bucket.split("/")
    env[_opt("type")] = "azureblob"
    conn = env.get(CONNECTION_STRING_ENV) or ""
    fields = connection_string_fields(conn) if conn else {}
    if conn and fields.get("AccountName", account) != account:
        raise UsageError(f"{url}: {CONNECTION_STRING_ENV} is for account "
                         f"{fields['AccountName']!r}, not {account!r}",
                         "use that account's connection string, or unset it")
    custom = env.get("HYPER_AZURE_STORAGE_ENDPOINT_URL")
    endpoint = (f"{custom.rstrip('/')}/{account}" if custom else
                (fields.get("BlobEndpoint") or "").rstrip("/") or None)
    if fields.get("AccountKey") and endpoint is None:
        env[_opt("account")] = account
        env[_opt("key")] = fields["AccountKey"]
        env[_opt("endpoint")] = "blob." + fields.get("EndpointSuffix", "core.windows.net")
    elif fields.get("AccountKey") or fields.get("SharedAccessSignature"):
        base = endpoint or f"https://{account}.blob.core.windows.net"
        env[_opt("sas_url")] = f"{base}/{container}?{_sas(account, container, fields, rw)}"
    elif custom or endpoint:
        raise UsageError(f"{url}: rclone cannot reach {endpoint} with a managed identity",
                         _AZ_EMULATOR_HINT)
    else:
        env[_opt("account")] = account
        env[_opt("use_msi")] = "true"
        if env.get("AZURE_CLIENT_ID"):
            env[_opt("msi_client_id")] = env["AZURE_CLIENT_ID"]
    return f"{REMOTE}:{container}/{prefix}".rstrip("/"), env


def _sas(account: str, container: str, fields: dict, rw: bool) -> str:
    """The connection string's SAS token, else a container SAS signed with its account key
    for :data:`SAS_DAYS` days: read and list, and with ``rw`` add, create, write, delete."""
    if fields.get("SharedAccessSignature"):
        return fields["SharedAccessSignature"].lstrip("?")
    import datetime

    from hypercli.mount.store_azure import _sdk
    blob, _ = _sdk()
    # from midnight (UTC): the same SAS all day, so rclone's cache of a remount is the same
    # folder (its name hashes the remote's settings) and uploads what a dead rclone left
    today = datetime.datetime.now(datetime.timezone.utc).replace(hour=0, minute=0, second=0,
                                                                 microsecond=0)
    expiry = today + datetime.timedelta(SAS_DAYS)
    return blob.generate_container_sas(
        account, container, account_key=fields["AccountKey"],
        permission=blob.ContainerSasPermissions(read=True, list=True, add=rw, create=rw,
                                                write=rw, delete=rw),
        expiry=expiry)


def _rclone() -> str:
    path = shutil.which("rclone")
    if not path:
        raise UsageError("rclone is not installed on this node: gs:// and az:// bucket "
                         "mounts need it", "install it: apt-get install rclone")
    return path


def _last_lines(text: str, n: int = 3) -> str:
    return "\n".join(line.strip() for line in text.strip().splitlines()[-n:])


def _list(remote: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([_rclone(), "lsjson", "--max-depth", "1", "--low-level-retries", "2",
                           "--retries", "1", "--contimeout", "10s", "--timeout", "30s", remote],
                          env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)


#: a folder name under the mount's prefix that check_bucket lists: one cheap request, where
#: listing the prefix itself would fetch every page of a large one
PROBE = ".hyper-bucket-check"


def check_bucket(url: str, remote: str, env: dict) -> None:
    """Raise StoreError naming the bucket (or container) of ``url`` when it does not exist,
    or saying why when nothing under the mount's prefix can be listed with these
    credentials. One list request, for :data:`PROBE` under the prefix: an existing bucket
    answers it (with nothing), a missing one makes rclone exit 3, "directory not found"
    (https://rclone.org/docs/#exit-code)."""
    scheme, bucket, _ = parse(url)
    p = _list(f"{remote}/{PROBE}", env)
    if p.returncode == 3:
        what = (f"no such bucket {bucket}" if scheme == "gs" else
                f"no such container {bucket.split('/')[1]} in account {bucket.split('/')[0]}")
        raise StoreError(f"{url}: {what}", "create it, or check the name")
    if p.returncode != 0:
        raise StoreError(f"{url}: rclone cannot list it: {_last_lines(p.stderr)}",
                         "check the node's credentials and the endpoint")


def _mount_info(mountpoint: str) -> tuple[str, set[str]] | None:
    """``(file system type, mount options)`` of the mount on top at ``mountpoint``
    (/proc/self/mountinfo, proc(5)), or None."""
    esc = "".join({" ": "\\040", "\t": "\\011", "\n": "\\012", "\\": "\\134"}.get(c, c)
                  for c in mountpoint)
    found = None
    with open("/proc/self/mountinfo") as f:
        for line in f:
            fields = line.split()
            if fields[4] == esc:
                found = fields[fields.index("-", 6) + 1], set(fields[5].split(","))
    return found


def start_time(pid: int) -> str:
    """The start time of process ``pid`` (clock ticks since boot, proc(5) field 22): with the
    PID it names one process, not a later one given the same PID."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[19]


def node_paths(root: str, mountpoint: str) -> tuple[str, str]:
    """``(cache folder, PID file)`` of the bucket mount at ``mountpoint`` on a node whose
    hypercli folder is ``root``: ``ROOT/cache/rclone/H`` and ``ROOT/mounts/H.pid``, ``H``
    being 16 hex digits of the path's SHA-256, as :mod:`hypercli.providers.runtime` names
    its record of the mount."""
    h = hashlib.sha256(mountpoint.encode()).hexdigest()[:16]
    return f"{root}/cache/rclone/{h}", f"{root}/mounts/{h}.pid"


def mount(url: str, mountpoint: str, *, cache_dir: str, pid_file: str,
          rw: bool = False) -> int:
    """Mount the bucket of ``url`` at ``mountpoint`` (an existing empty folder) with rclone,
    read-only unless ``rw``; returns rclone's PID, also written to ``pid_file`` (mode 0600)
    as ``PID START_TIME``.

    Args:
        cache_dir: rclone's cache (the write-back cache of a rw mount); kept across mounts,
            so files a stopped rclone had not uploaded are uploaded by the next one.
    Raises:
        UsageError: rclone is not installed, or a bad URL.
        StoreError: the bucket does not exist or cannot be listed, or the mount did not come
            up (rclone's last lines say why).
    """
    remote, env = rclone_env(url, rw=rw)
    check_bucket(url, remote, env)
    mp = os.path.abspath(mountpoint)
    os.makedirs(cache_dir, mode=0o700, exist_ok=True)
    log = os.path.join(cache_dir, "rclone.log")
    argv = [_rclone(), "mount", remote, mp, "--cache-dir", cache_dir, "--log-file", log,
            "--log-level", "NOTICE", "--dir-cache-time", "10s"]
    argv += (["--vfs-cache-mode", "writes", "--vfs-write-back", f"{WRITE_BACK_S}s"] if rw
             else ["--read-only"])
    if os.geteuid() == 0:  # containers' users read it too, as the chunked mount lets them,
        argv += ["--allow-other", "--default-permissions"]  # by the kernel-checked modes
    with open(log, "a"):
        pass
    proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True, close_fds=True)
    deadline = time.monotonic() + MOUNT_WAIT_S
    while (info := _mount_info(mp)) is None or info[0] != "fuse.rclone":
        if proc.poll() is not None or time.monotonic() > deadline:
            _stop(proc)
            with open(log, errors="replace") as f:
                said = _last_lines(f.read())
            raise StoreError(f"{url}: rclone did not mount it at {mp}: {said or 'no reason given'}")
        time.sleep(0.05)
    opts = info[1]
    if not {"nosuid", "nodev"} <= opts:
        subprocess.run(["fusermount3", "-u", mp], capture_output=True)
        _stop(proc)
        raise StoreError(f"{url}: the mount at {mp} was not nosuid,nodev ({','.join(opts)}): "
                         "taken down")
    fd = os.open(pid_file + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{proc.pid} {start_time(proc.pid)}\n")
    os.replace(pid_file + ".tmp", pid_file)
    return proc.pid


def _stop(proc: subprocess.Popen) -> None:
    """Stop a rclone that failed to mount: SIGTERM, then SIGKILL after 5 s, by its PID."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            pass
