"""An image pulled by a node from a registry that asks for credentials. Standard library
only (boto3 for Amazon ECR, from the node's Python).

``python3 -m hypercli.node.registry pull IMAGE`` reads ``{"username", "password"}`` (or
``{}``) on stdin. With credentials, they are used; without, a registry of a cloud is signed in
to with the node's own cloud identity:

* Amazon ECR (``ACCOUNT.dkr.ecr.REGION.amazonaws.com``): ``ecr:GetAuthorizationToken`` with
  the instance role (boto3), user ``AWS`` (docs.aws.amazon.com/AmazonECR/latest/userguide/
  registry_auth.html);
* Google Artifact Registry and Container Registry (``*-docker.pkg.dev``, ``gcr.io``,
  ``*.gcr.io``): the service account's access token from the metadata server, user
  ``oauth2accesstoken`` (cloud.google.com/artifact-registry/docs/docker/authentication);
* Azure Container Registry (``*.azurecr.io``): the managed identity's token from IMDS,
  exchanged at ``https://REGISTRY/oauth2/exchange`` for a registry refresh token, user
  ``00000000-0000-0000-0000-000000000000`` (learn.microsoft.com/azure/container-registry/
  container-registry-authentication-managed-identity).

The credentials go into a Docker config file (``{"auths": {REGISTRY: {"auth": ...}}}``, read
by docker through ``DOCKER_CONFIG`` and by podman through ``REGISTRY_AUTH_FILE``) in a folder
of mode 0700 on a RAM file system when there is one (``/dev/shm``), removed as soon as the
pull ends, whatever way it ends. No credential is ever on a command line, in the environment
of anything but the pull, or left on the node; nothing is printed but docker's output.
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request

ECR = re.compile(r"\d{12}\.dkr\.ecr(-fips)?\.([a-z0-9-]+)\.amazonaws\.com(\.cn)?")
GCP = re.compile(r"([a-z0-9-]+-docker\.pkg\.dev|gcr\.io|[a-z]+\.gcr\.io)")
ACR = re.compile(r"[a-z0-9]+\.azurecr\.io")
TIMEOUT = 10.0  #: s for each metadata or token request


def registry_of(image: str) -> str:
    """The registry host of an image reference (``docker.io`` when it names none): the
    first path component when it has a ``.`` or ``:`` or is ``localhost`` (the rule of
    github.com/distribution/reference, normalize.go)."""
    first, sep, _ = image.partition("/")
    if sep and ("." in first or ":" in first or first == "localhost"):
        return first
    return "docker.io"


def cloud_of(registry: str) -> str | None:
    """``"aws"``, ``"gcp"``, ``"azure"`` for a cloud's registry, else None."""
    for cloud, pattern in (("aws", ECR), ("gcp", GCP), ("azure", ACR)):
        if pattern.fullmatch(registry):
            return cloud
    return None


def _http(url: str, headers: dict, data: bytes | None = None) -> bytes:
    req = urllib.request.Request(url, data=data, headers=headers)
    with urllib.request.urlopen(req, timeout=TIMEOUT) as r:
        return r.read()


def cloud_credentials(registry: str, env=os.environ) -> tuple[str, str]:
    """(username, password) for a cloud's registry from the node's identity (module
    docstring). ``GCE_METADATA_HOST`` and ``AZURE_POD_IDENTITY_AUTHORITY_HOST`` name other
    metadata servers, as google-auth and azure-identity honour them.

    Raises:
        ValueError: not a cloud's registry; OSError or ImportError: the identity cannot be
            had (no metadata server, no role, no boto3).
    """
    cloud = cloud_of(registry)
    if cloud == "gcp":
        host = env.get("GCE_METADATA_HOST") or "metadata.google.internal"
        body = _http(f"http://{host}/computeMetadata/v1/instance/service-accounts/default/"
                     "token", {"Metadata-Flavor": "Google"})
        return "oauth2accesstoken", json.loads(body)["access_token"]
    if cloud == "azure":
        host = (env.get("AZURE_POD_IDENTITY_AUTHORITY_HOST") or "http://169.254.169.254")
        body = _http(f"{host.rstrip('/')}/metadata/identity/oauth2/token?api-version="
                     "2018-02-01&resource=https%3A%2F%2Fmanagement.azure.com%2F",
                     {"Metadata": "true"})
        aad = json.loads(body)["access_token"]
        base = env.get("HYPER_ACR_EXCHANGE_URL") or f"https://{registry}"
        form = urllib.parse.urlencode({"grant_type": "access_token", "service": registry,
                                       "access_token": aad}).encode()
        body = _http(f"{base}/oauth2/exchange",
                     {"Content-Type": "application/x-www-form-urlencoded"}, form)
        return "00000000-0000-0000-0000-000000000000", json.loads(body)["refresh_token"]
    if cloud == "aws":
        import boto3
        region = ECR.fullmatch(registry)[2]
        data = boto3.client("ecr", region_name=region).get_authorization_token()
        token = data["authorizationData"][0]["authorizationToken"]
        user, _, password = base64.b64decode(token).decode().partition(":")
        return user, password
    raise ValueError(f"{registry} is not a cloud's registry")


def auth_config(registry: str, username: str, password: str) -> dict:
    """The Docker config of one registry's credentials (docker.io under both its keys)."""
    auth = base64.b64encode(f"{username}:{password}".encode()).decode()
    keys = [registry] + (["https://index.docker.io/v1/"] if registry == "docker.io" else [])
    return {"auths": {k: {"auth": auth} for k in keys}}


def _secret_dir() -> str:
    for base in ("/dev/shm", os.environ.get("XDG_RUNTIME_DIR"), None):
        if base is None or (os.path.isdir(base) and os.access(base, os.W_OK)):
            return tempfile.mkdtemp(prefix="hyper-auth-", dir=base)
    return tempfile.mkdtemp(prefix="hyper-auth-")


def pull(image: str, creds: dict, docker: str = "docker") -> int:
    """Pull ``image`` with ``creds`` (``{"username", "password"}``; ``{}``: the node's
    cloud identity, or none for a registry of no cloud). Returns docker's exit code; its
    output goes to this process's stdout and stderr."""
    registry = registry_of(image)
    user, password = creds.get("username"), creds.get("password")
    if not (user and password) and cloud_of(registry):
        try:
            user, password = cloud_credentials(registry)
        except Exception as e:  # no identity: say why, then try without credentials
            print(f"no credentials for {registry} from the node's cloud identity: "
                  f"{type(e).__name__}: {e}", file=sys.stderr)
    if not (user and password):
        return subprocess.run([docker, "pull", image], stdin=subprocess.DEVNULL).returncode
    folder = _secret_dir()
    try:
        path = os.path.join(folder, "config.json")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(auth_config(registry, user, password), f)
        env = dict(os.environ, DOCKER_CONFIG=folder, REGISTRY_AUTH_FILE=path)
        return subprocess.run([docker, "pull", image], stdin=subprocess.DEVNULL,
                              env=env).returncode
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def main(argv: list[str]) -> int:
    import signal
    for sig in (signal.SIGHUP, signal.SIGTERM, signal.SIGINT):  # the folder goes, always
        signal.signal(sig, lambda signum, frame: sys.exit(128 + signum))
    if len(argv) != 2 or argv[0] != "pull":
        print("usage: python3 -m hypercli.node.registry pull IMAGE < credentials.json",
              file=sys.stderr)
        return 2
    try:
        creds = json.loads(sys.stdin.read() or "{}")
    except ValueError:
        print("credentials on stdin are not JSON", file=sys.stderr)
        return 2
    return pull(argv[1], creds)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
