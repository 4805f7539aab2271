"""Cloud providers (aws, gcp, azure): a :class:`~hypercli.providers.cloud.CloudAPI` made into
a provider. Cloud nodes are SSH hosts a cloud created, so everything after boot is the ssh
provider's (:mod:`hypercli.providers.ssh`).

``launch`` (``hyper up``, or ``hyper run`` with no cluster up):

1. the cluster's SSH key (ed25519) is made once, in ``$HYPER_HOME/keys/<cluster>/``;
2. each new node gets a host key made here (AWS, Azure: their user data is readable only
   from the node itself and by the account) or, on GCP, makes its own at first boot and
   publishes the public half in its guest attributes (instance metadata is readable by anyone
   with ``compute.instances.get``, so no private key goes there); its boot document
   (:func:`boot_document`, cloud-config, which cloud-init runs on all three clouds' stock and
   baked Ubuntu images) installs that host key before ``sshd`` starts, authorizes the cluster
   key for root, keeps containers away from the metadata service (:func:`block_script`) and
   starts the node watcher (:mod:`hypercli.node.watch`: preemption notices, idle watchdog).
   The host key is pinned here as soon as the node's address (and, on GCP, its published key)
   is known, so the first contact is verified: no trust-on-first-use, and a changed key is
   refused like on any SSH host;
3. the cloud's shared resources are made (:meth:`CloudAPI.prepare`: key pair, firewall for port
   22 from the caller's address only and for all traffic between the cluster's own nodes),
   the instances are created along the launch's offers (:mod:`hypercli.offers.failover`:
   the next zone, region or cloud on capacity and quota errors, and for a spot instance left
   pending :data:`SPOT_WAIT` s; each (cloud, region) prepared is kept in
   ``keys/<cluster>/places.json`` for teardown), and each node is bootstrapped over SSH as
   soon as it is running, with retries while it boots; its ``info`` records its private
   address (:func:`node_info`), where the other nodes reach it, and for a node launched now
   its offer's price (USD/h) and launch time. Each instance is entered in the cost ledger
   (:mod:`hypercli.offers.ledger`) as soon as the cloud created it, whether or not it comes up.

``terminate`` (``hyper down``) terminates the instances, then lists everything tagged for the
cluster in each (cloud, region) it was launched in and deletes it, again and again until the
cloud reports nothing left (or a deadline), and says what it removed. :func:`gc` does the same
for every ``hyper:*`` resource that no live cluster of the state file owns.

Test seam: with ``HYPER_CLOUD_ADDRESSES`` naming a JSON file ``{instance id: "host:port"}``,
an instance listed there is reached at that address instead of its public IP (the test suite
points instances of moto, the AWS stand-in, at its SSH test hosts).
"""

from __future__ import annotations

import base64
import gzip
import json
import os
import threading
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

import yaml

from hypercli import state as S
from hypercli.errors import HyperError, NodeError, UsageError
from hypercli.providers.base import Instance, LaunchResult
from hypercli.providers.cloud import Boot, CloudAPI, CloudError, CloudSpec, VM
from hypercli.providers.ssh import SSHProvider
from hypercli.recipe import ClusterSpec
from hypercli.ssh.conn import Target
from hypercli.ssh.fanout import fan_out

BOOT_TIMEOUT = 600.0      # s from create until a node must answer over SSH
DESCRIBE_EVERY = 2.0      # s between looks at instances that are still pending
TEARDOWN_TIMEOUT = 600.0  # s that ``terminate`` keeps deleting until nothing is left
#: s a new spot instance may stay pending before its request counts as not fulfilled: it is
#: terminated and the launch goes on to the next offer. hypercli's choice, well above the
#: time a fulfilled instance stays pending (EC2, GCE, Azure: well under a minute).
SPOT_WAIT = 300.0
SSH_USER = "root"
_CREATING = threading.Lock()  # see CloudProvider.grow
CHECKIP_URL = "https://checkip.amazonaws.com"

#: provider name → (module, class) of its CloudAPI
APIS = {"aws": ("hypercli.providers.aws", "AWSAPI"),
        "gcp": ("hypercli.providers.gcp", "GCPAPI"),
        "azure": ("hypercli.providers.azure", "AzureAPI")}
EXTRAS = {"aws": "boto3", "gcp": "hypercli[gcp]", "azure": "hypercli[azure]"}


# -- keys ------------------------------------------------------------------------------------
def new_keypair(comment: str) -> tuple[str, str]:
    """A new ed25519 key pair: (private key in OpenSSH PEM form, public key one-liner)."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
    key = Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.OpenSSH,
                                serialization.NoEncryption()).decode()
    public = key.public_key().public_bytes(serialization.Encoding.OpenSSH,
                                           serialization.PublicFormat.OpenSSH).decode()
    return private, f"{public} {comment}"


def keys_dir(cluster: str) -> Path:
    return S.home() / "keys" / cluster


def cluster_key(cluster: str) -> tuple[Path, str]:
    """The cluster's SSH key: (private key file, public key line); made on first use (0600)."""
    d = keys_dir(cluster)
    path = d / "id_ed25519"
    if not path.exists():
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        private, public = new_keypair(f"hyper-{cluster}")
        tmp = d / ".id_ed25519.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(private)
        (d / "id_ed25519.pub").write_text(public + "\n")
        os.replace(tmp, path)
    return path, (d / "id_ed25519.pub").read_text().strip()


def host_key(cluster: str, node: str) -> tuple[str, str]:
    """A new host key for a node: (private PEM, public line); the public half is kept in
    ``keys/<cluster>/hosts/<node>.pub`` until the node's address is known and it is pinned."""
    private, public = new_keypair(f"hyper-{node}")
    d = keys_dir(cluster) / "hosts"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / f"{node}.pub").write_text(public + "\n")
    return private, public


#: addresses a task's container never reaches on a cloud node (module docstring of
#: :func:`block_script`): the metadata service of every cloud, and on Azure the WireServer's
#: HTTP ports (168.63.129.16:80 and :32526, which hand out extension settings; its port 53 is
#: the VM's DNS and stays open)
METADATA_IP = "169.254.169.254"
WIRESERVER = "168.63.129.16"


def block_script(provider: str) -> str:
    """Shell text, run as root at every boot of a cloud node before any container, that keeps
    containers on bridge networks (docker's and podman's default) away from the cloud's
    metadata service, so that a task's container cannot take the node's identity token (or,
    on GCP, write the node's guest attributes); processes of the node itself (the agent,
    mounts, output pushes, the watcher) still reach it. Two rules, each added once:

    * ``raw PREROUTING``: a packet that *arrives* at the node (not on ``lo``) for the
      metadata address can only come from a container (or another host) being routed
      through it, never from the node itself (whose own packets take OUTPUT); dropped before
      any FORWARD rule that docker or podman add, whatever their order;
    * ``DOCKER-USER``: docker's documented chain for such rules (docs.docker.com, "Packet
      filtering and firewalls"), made here when docker has not made it yet.

    On Azure the WireServer's HTTP ports are dropped the same way. On GCP the metadata
    server is also the VM's DNS resolver (cloud.google.com/dns/docs/vpc-name-res-order:
    every VM uses 169.254.169.254 as its name server, and docker and podman give containers
    the host's), so there its port 53 (UDP and TCP) stays open and only the rest is dropped."""
    if provider == "gcp":
        rules = [f"! -i lo -d {METADATA_IP}/32 -p {p} -m {p} ! --dport 53 -j DROP"
                 for p in ("tcp", "udp")]
    else:
        rules = [f"! -i lo -d {METADATA_IP}/32 -j DROP"]
    if provider == "azure":
        rules.append(f"! -i lo -d {WIRESERVER}/32 -p tcp -m multiport --dports 80,32526 "
                     "-j DROP")
    lines = ["#!/bin/sh", "# hypercli: containers never reach the cloud's metadata service",
             "command -v iptables >/dev/null || exit 0",
             "iptables -N DOCKER-USER 2>/dev/null"]
    for r in rules:
        lines += [f"iptables -t raw -C PREROUTING {r} 2>/dev/null || "
                  f"iptables -t raw -I PREROUTING {r}",
                  f"iptables -C DOCKER-USER {r} 2>/dev/null || iptables -I DOCKER-USER {r}"]
    return "\n".join(lines) + "\n"


#: GCP: the node publishes the public half of the host key it made itself in its guest
#: attributes (where GCE's guest agent also publishes host keys), which the caller reads with
#: ``instances.getGuestAttributes`` (:meth:`hypercli.providers.gcp.GCPAPI.host_key`)
PUBLISH_HOST_KEY = (
    "#!/bin/sh\nk=$(cut -d' ' -f1,2 /etc/ssh/ssh_host_ed25519_key.pub)\n"
    "curl -sf --retry 30 --retry-delay 2 --retry-connrefused -X PUT --data \"$k\" "
    "-H 'Metadata-Flavor: Google' http://169.254.169.254/computeMetadata/v1/instance/"
    "guest-attributes/hostkeys/ssh-ed25519\n")


def reserve_name(cluster: str, node: str) -> None:
    """Record a node name as used (``keys/<cluster>/hosts/<node>.pub``, empty until the node
    publishes its host key) so that no later node of the cluster gets it."""
    d = keys_dir(cluster) / "hosts"
    d.mkdir(parents=True, exist_ok=True, mode=0o700)
    (d / f"{node}.pub").touch()


def boot_document(spec: CloudSpec, provider: str, node: str, host_private: str | None,
                  host_public: str | None, cluster_public: str, env: dict | None = None
                  ) -> str:
    """The node's cloud-config (text starting ``#cloud-config``): host key, root's authorized
    key, the node watcher and its settings, the container rules of :func:`block_script`
    (in ``bootcmd``, in place before sshd starts, and as a unit for every later boot).
    Fits the smallest user-data limit (AWS: 16 KiB).

    Args:
        host_private, host_public: the node's host key made here; both None: the node makes
            its own at first boot (cloud-init) and publishes the public half
            (:data:`PUBLISH_HOST_KEY`, GCP), so no private key is ever in the instance's
            metadata.
        env: ``NAME=value`` lines for ``/etc/environment`` (Azure: ``AZURE_CLIENT_ID`` of the
            storage identity, which the node's Azure SDK reads).
    """
    from hypercli.node import watch
    settings = {"cloud": provider, "cluster": spec.cluster, "node": node,
                "idle_minutes": spec.idle_minutes}
    unit = ("[Unit]\nDescription=hypercli node watcher (preemption notices, idle watchdog)\n"
            "After=network-online.target\n[Service]\n"
            "ExecStart=/usr/bin/python3 /usr/local/lib/hyper/watch.py --config "
            "/etc/hyper/node.json\nRestart=always\nRestartSec=5\n"
            "[Install]\nWantedBy=multi-user.target\n")
    block = ("[Unit]\nDescription=hypercli: containers never reach the metadata service\n"
             "DefaultDependencies=no\nBefore=docker.service podman.service network-pre.target\n"
             "Wants=network-pre.target\n[Service]\nType=oneshot\n"
             "ExecStart=/bin/sh /usr/local/lib/hyper/block-metadata.sh\n"
             "[Install]\nWantedBy=multi-user.target\n")
    doc = {
        "disable_root": False,
        "ssh_pwauth": False,
        "ssh_deletekeys": True,
        # the container rules before sshd ever starts, so before any task: cloud-init runs
        # bootcmd first of all its modules (before write_files), at every boot
        # (cloudinit.readthedocs.io, module "Bootcmd"); runcmd comes after sshd is up
        "bootcmd": [["sh", "-c", block_script(provider)]],
    }
    if host_private:
        doc["ssh_genkeytypes"] = []
        doc["ssh_keys"] = {"ed25519_private": host_private, "ed25519_public": host_public}
    else:
        doc["ssh_genkeytypes"] = ["ed25519"]
    files = [
        {"path": "/root/.ssh/authorized_keys", "permissions": "0600",
         "content": cluster_public + "\n"},
        {"path": "/etc/hyper/node.json", "content": json.dumps(settings) + "\n"},
        {"path": "/usr/local/lib/hyper/watch.py", "encoding": "gz+b64",  # cloud-init's
         "content": base64.b64encode(gzip.compress(Path(watch.__file__).read_bytes(),
                                                   mtime=0)).decode()},
        {"path": "/etc/systemd/system/hyper-watch.service", "content": unit},
        {"path": "/usr/local/lib/hyper/block-metadata.sh", "permissions": "0755",
         "content": block_script(provider)},
        {"path": "/etc/systemd/system/hyper-block-metadata.service", "content": block},
    ]
    if env:
        files.append({"path": "/etc/environment", "append": True,
                      "content": "".join(f"{k}={v}\n" for k, v in sorted(env.items()))})
    runcmd = [["sh", "/usr/local/lib/hyper/block-metadata.sh"],
              ["systemctl", "daemon-reload"],
              ["systemctl", "enable", "hyper-block-metadata.service"],
              ["systemctl", "enable", "--now", "hyper-watch.service"]]
    if not host_private:
        files.append({"path": "/usr/local/lib/hyper/publish-hostkey.sh",
                      "permissions": "0755", "content": PUBLISH_HOST_KEY})
        runcmd.append(["sh", "/usr/local/lib/hyper/publish-hostkey.sh"])
    doc["write_files"] = files
    doc["runcmd"] = runcmd
    return "#cloud-config\n" + yaml.safe_dump(doc, sort_keys=False)


def caller_cidr() -> str:
    """This machine's public address as ``a.b.c.d/32`` (asks ``checkip.amazonaws.com``).

    Raises:
        UsageError: it cannot be found (offline, proxy): set ``ssh_cidr`` instead.
    """
    try:
        with urllib.request.urlopen(CHECKIP_URL, timeout=5) as r:
            ip = r.read().decode().strip()
        import ipaddress
        return f"{ipaddress.ip_address(ip)}/32"
    except (OSError, ValueError) as e:
        raise UsageError(f"cannot find this machine's public address for the SSH firewall "
                         f"rule ({e})", "set cluster.ssh_cidr, e.g. 203.0.113.0/24") from None


def cloud_spec(spec: ClusterSpec, count: int | None = None) -> CloudSpec:
    """The recipe's ``cluster:`` of a cloud provider as a :class:`CloudSpec` (``ssh_cidr``
    left None when not given; see :func:`caller_cidr`)."""
    o = spec.options
    zone = o.get("zone")
    zones = tuple(zone) if isinstance(zone, list) else ((zone,) if zone else ())
    image = o.get("image")
    variant = "cpu"
    if image in ("cpu", "gpu"):
        variant, image = image, None
    return CloudSpec(
        cluster=spec.name, count=count if count is not None else (spec.workers or 1),
        region=o.get("region", ""), zones=zones,
        instance_type=o.get("instance_type", ""), spot=o.get("spot", True) in (True, "auto"),
        image=image,
        variant=variant, disk_gb=o.get("disk_gb", 50), max_price=o.get("max_price"),
        ssh_cidr=o.get("ssh_cidr"), idle_minutes=o.get("idle_minutes", 30),
        replace_preempted=o.get("replace_preempted", o.get("spot", True)),
        project=o.get("project"), resource_group=o.get("resource_group"),
        grants=tuple(spec.grants),
        identity=o.get("iam_role") or o.get("service_account") or o.get("identity"),
        adopt_group=bool(o.get("adopt_group")))


def seam_addresses() -> dict:
    """``{instance id: "host:port"}`` from ``HYPER_CLOUD_ADDRESSES`` (module docstring)."""
    path = os.environ.get("HYPER_CLOUD_ADDRESSES")
    if not path:
        return {}
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}


def node_info(provider: str, cs: CloudSpec, vm: VM, target: Target, extra: dict) -> dict:
    """The ``info`` recorded for a cloud node: what bootstrap found (``extra``) and what
    the cloud says (provider, region, zone, instance type, spot, public and private IP).

    ``private_address`` is the address the cluster's other nodes reach it at (the ranks of
    a multi-node task): ``vm.private_ip`` (the cluster's firewall admits all traffic between
    its nodes there); with the test seam naming the instance, the seam's host instead (the
    test hosts reach each other there, not at the stand-in's made-up addresses); the SSH
    address when the cloud gave no private IP.

    Args:
        provider: ``aws``, ``gcp`` or ``azure``; cs: the cluster; vm: the instance;
        target: where it was reached over SSH; extra: ``Instance.extra`` from bootstrap.
    """
    seamed = vm.id in seam_addresses()
    return {**extra, "cloud": provider, "region": cs.region, "zone": vm.zone,
            "instance_type": vm.instance_type, "spot": vm.spot, "public_ip": vm.public_ip,
            "private_ip": vm.private_ip,
            "private_address": target.host if seamed else (vm.private_ip or target.host)}


#: an offer's extras that a cloud's API needs beyond the region (GCP project, Azure
#: subscription and resource group), kept with the places a cluster was launched in
PLACE_KEYS = ("project", "subscription_id", "resource_group")


def place_options(offer) -> dict:
    """What the API of an offer's cloud needs beyond its region: :data:`PLACE_KEYS` of its
    ``extra``."""
    return {k: v for k, v in offer.extra if k in PLACE_KEYS}


def make_api(provider: str, options: dict) -> CloudAPI:
    """The CloudAPI of ``provider`` for a cluster's options (``region``, ``project``, ...).

    Raises:
        UsageError: the provider's SDK is not installed (says which extra to install).
    """
    import importlib
    import importlib.util
    module, cls = APIS[provider]
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"provider {provider} is not available in this version of hypercli",
                         "use provider: aws, gcp, ssh or local")
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        if (e.name or "").startswith("hypercli"):
            raise
        raise UsageError(f"provider {provider} needs a package that is not installed ({e.name})",
                         f"pip install '{EXTRAS[provider]}'") from None
    api = getattr(mod, cls)
    region = options.get("region", "")
    if provider == "gcp":
        return api(options.get("project"), region)
    if provider == "azure":
        return api(options.get("subscription_id"), region)
    return api(region)


class CloudProvider(SSHProvider):
    """A cloud's instances as SSH nodes (module docstring).

    Args:
        name: ``aws``, ``gcp`` or ``azure``.
        options: the cluster's ``cluster:`` options (region, ...), when known before
            ``launch`` (``hyper down`` passes the recorded ones).
        api: a ready CloudAPI (tests); default: made from ``options`` on first use.
        apis: ready CloudAPIs by (cloud, region), for offers on other clouds or regions
            (tests); default: each made on first use (:meth:`api_for`).
        offers: the offers ``launch`` walks along (:mod:`hypercli.offers.failover`).
    """

    remote = True

    def __init__(self, name: str, options: dict | None = None, api: CloudAPI | None = None,
                 trust_new_hosts: bool = False, apis: dict | None = None,
                 offers: list | None = None):
        super().__init__(trust_new_hosts=False)  # cloud nodes' keys are known in advance
        self.name = name
        self.options = dict(options or {})
        self._api = api
        self._apis = dict(apis or {})
        self.offers = list(offers) if offers else None

    @staticmethod
    def cloud_spec(spec: ClusterSpec) -> CloudSpec:
        """:func:`cloud_spec` with the cluster's id from the state file (made on first use:
        the identities' names carry its hash, :func:`hypercli.providers.cloud.identity_tag`)."""
        cs = cloud_spec(spec)
        return replace(cs, cluster_id=S.State().cluster_uid(cs.cluster))

    def api(self, options: dict | None = None) -> CloudAPI:
        if self._api is None:
            self._api = make_api(self.name, options if options is not None else self.options)
        return self._api

    # -- up ----------------------------------------------------------------------------------
    def plan(self, spec: ClusterSpec) -> dict:
        """What ``launch`` would do, for ``hyper up --dry-run``: nodes there and to create,
        and a price estimate. Raises CredentialsError / CloudError."""
        cs = self.cloud_spec(spec)
        api = self.api(spec.options)
        live = [v for v in api.describe(cs.cluster) if v.state in ("pending", "running")]
        prices = api.spot_price(cs)
        best = min(prices.values()) if prices else None
        new = max(0, cs.count - len(live))
        return {"cluster": cs.cluster, "provider": self.name, "region": cs.region,
                "instance_type": cs.instance_type, "spot": cs.spot, "running": len(live),
                "to_create": new, "price_per_hour": best, "zone_prices": prices,
                "cost_per_hour": None if best is None else round(best * cs.count, 4)}

    def launch(self, spec: ClusterSpec, offers: list | None = None) -> LaunchResult:
        """Bring the cluster's nodes up (module docstring), launching what it lacks along
        ``offers`` (:mod:`hypercli.offers.failover`).

        Args:
            spec: the cluster.
            offers: :class:`~hypercli.offers.offer.Offer` values in the order to try (the
                optimizer's), kept for later launches (replacements); default: those given
                before (or to the constructor), else the recipe's own ``instance_type`` in
                each of its zones (:func:`hypercli.offers.failover.offers_from_options`).
        Returns:
            the nodes up and an error per node that is not: a
            :class:`~hypercli.offers.failover.FailoverError` listing every step when no
            offer had room, a budget error when ``max_cost`` stopped its launch.
        Raises:
            UsageError: no instance type; CredentialsError, CloudError from the cloud.
        """
        from hypercli.offers import failover, ledger
        cs = self.cloud_spec(spec)
        if offers:  # kept for the replacements this provider launches later
            self.offers = list(offers)
        offers = list(self.offers or failover.offers_from_options(self.name, spec.options))
        if not all(o.instance_type for o in offers):
            raise UsageError(f"provider {self.name} needs cluster.instance_type",
                             "e.g. instance_type: m5.large (aws), e2-standard-4 (gcp), "
                             "Standard_D4s_v5 (azure)")
        if cs.ssh_cidr is None:
            cs = replace(cs, ssh_cidr=caller_cidr())
        self.options = dict(spec.options)
        state = S.State()
        offers = failover.ordered(offers, ledger.preempted_regions(state))
        key_path, public = cluster_key(cs.cluster)
        where: dict[str, tuple] = {}  # instance id → (api, spec of its place, offer or None)
        live: list[VM] = []
        for cloud, region, opts in self._places(cs.cluster, offers):
            api = self.api_for(cloud, region, opts)
            for v in api.describe(cs.cluster):
                if v.state in ("pending", "running") and v.id not in where:
                    live.append(v)
                    where[v.id] = (api, replace(cs, region=region), None, None)
        errors: dict[str, Exception] = {}
        new_nodes = self._new_names(cs, live)
        if not new_nodes:  # a later recipe on the cluster may need other storage
            for api in {id(a): a for a, *_ in where.values()}.values() or [self.api_for(
                    offers[0].cloud, offers[0].region, place_options(offers[0]))]:
                api.identity(cs)
        if new_nodes and spec.options.get("max_cost") is not None:
            new_nodes, over = ledger.within_budget(state, cs.cluster, spec.options["max_cost"],
                                                   new_nodes, self._first_price(cs, offers))
            for node, err in over.items():
                errors[node] = err
            if over:
                state.event("cluster", str(next(iter(over.values()))), cluster=cs.cluster)
        if new_nodes:
            created, failed = self._create(cs, offers, new_nodes, state, where, public)
            errors.update(failed)
            live += created
        instances, more = self._bring_up(cs, live, key_path, where)
        errors.update(more)
        return LaunchResult(instances, errors)

    def _create(self, cs: CloudSpec, offers: list, new_nodes: list[str], state, where: dict,
                public: str) -> tuple[list[VM], dict[str, Exception]]:
        """Create the instances of ``new_nodes`` along ``offers`` (:func:`hypercli.offers.
        failover.walk`), each entered in the cost ledger and in ``where`` (instance id →
        (api, spec of its place, offer, launch time)). Returns (VMs created, {node: error})."""
        from hypercli.offers import failover
        prepared_at: dict = {}

        def launch_on(offer, nodes):
            api = self.api_for(offer.cloud, offer.region, place_options(offer))
            ocs = replace(cs, region=offer.region, instance_type=offer.instance_type,
                          zones=(offer.zone,) if offer.zone else (), spot=offer.spot,
                          image=self._image_for(cs, offer))
            try:
                if (offer.cloud, offer.region) not in prepared_at:
                    self._remember_place(cs.cluster, offer)
                    prepared_at[offer.cloud, offer.region] = api.prepare(ocs, public)
                prepared = prepared_at[offer.cloud, offer.region]
                docs = self._boot_docs(ocs, offer.cloud, api, nodes, public, prepared)
                created, failed = api.create(ocs, nodes, Boot(docs, SSH_USER, public),
                                             prepared)
                if offer.spot:
                    created, unfulfilled = self._fulfilled(api, ocs, created)
                    failed = {**failed, **unfulfilled}
            except CloudError as e:  # this place cannot be used: its nodes' error
                return [], {n: e for n in nodes}
            if created:
                offer = offer if offer.price else failover.with_price(
                    offer, self._prices(api, ocs))
            now = time.time()
            for vm in created:  # billed from now on, whether or not it comes up
                where[vm.id] = (api, ocs, offer, now)
                state.ledger_launch(cs.cluster, vm.node, vm.id, {
                    "cloud": offer.cloud, "region": offer.region,
                    "zone": vm.zone or offer.zone, "instance_type": offer.instance_type,
                    "spot": offer.spot, "price": offer.price or None, "launched_at": now})
            return created, failed

        created, failed, _ = failover.walk(
            offers, new_nodes, launch_on,
            step=lambda s: state.event("launch", s.line(), cluster=cs.cluster))
        return created, failed

    def grow(self, spec: ClusterSpec, offers: list, names: list[str],
             idle_minutes: float | None = None) -> LaunchResult:
        """Launch exactly the nodes ``names`` (new names, none the cluster had) along
        ``offers`` and bring each up (a node pool growing: :mod:`hypercli.offers.pools`);
        the nodes the cluster has already are left alone. ``idle_minutes``: the node
        watcher's idle limit on these nodes (default the cluster's).

        Returns:
            the nodes up and an error per node that is not.
        Raises:
            CredentialsError, CloudError from the cloud.
        """
        cs = self.cloud_spec(spec)
        if idle_minutes is not None:
            cs = replace(cs, idle_minutes=idle_minutes)
        if cs.ssh_cidr is None:
            cs = replace(cs, ssh_cidr=caller_cidr())
        state = S.State()
        from hypercli.offers import failover, ledger
        offers = failover.ordered(offers, ledger.preempted_regions(state))
        where: dict[str, tuple] = {}
        with _CREATING:  # pools growing at once: one makes the cluster's key, prepares a
            key_path, public = cluster_key(cs.cluster)  # place and creates at a time
            for name in names:
                reserve_name(cs.cluster, name)
            created, errors = self._create(cs, offers, list(names), state, where, public)
        instances, more = self._bring_up(cs, created, key_path, where) if created else ([], {})
        errors.update(more)
        failed = [v for v in created if v.node in more]
        for vm in failed:  # created but never up: not left running unused
            self.drop(vm.node)
            try:
                where[vm.id][0].terminate(cs.cluster, [vm.id])
            except HyperError as e:
                errors[vm.node] = NodeError(vm.node, f"{more[vm.node]}; terminating "
                                            f"{vm.id} failed too: {e}")
        state.ledger_end(cs.cluster, [v.node for v in failed], reason="gone")
        return LaunchResult(instances, errors)

    def release(self, cluster: str, nodes: list[dict]) -> list[str]:
        """Terminate these nodes' instances only (a pool shrinking); the cluster's other
        nodes and shared resources stay. Returns a line per instance terminated.
        Raises CloudError."""
        out = []
        for n in nodes:
            self.drop(n["name"])
            info = n.get("info") or {}
            cloud = info.get("cloud") or self.name
            region = info.get("region") or self.options.get("region", "")
            opts = next((o for c, r, o in self._places(cluster, []) if (c, r) == (cloud, region)),
                        {})
            if n.get("provider_id"):
                self.api_for(cloud, region, opts).terminate(cluster, [n["provider_id"]])
                out.append(f"instance {n['provider_id']} ({n['name']})")
        return out

    def _image_for(self, cs: CloudSpec, offer) -> str | None:
        """The image to boot on ``offer``: the recipe's ``image`` in the recipe's own cloud
        and region (an AMI, a GCP image or an Azure image is of one cloud, an AMI of one
        region); elsewhere the offer's ``image`` extra, else None: that cloud's newest baked
        image (:meth:`CloudAPI.find_image`)."""
        if offer.cloud == self.name and offer.region in ("", cs.region):
            return cs.image
        return dict(offer.extra).get("image")

    @staticmethod
    def _fulfilled(api: CloudAPI, cs: CloudSpec, created: list[VM]
                   ) -> tuple[list[VM], dict[str, Exception]]:
        """The spot VMs of ``created`` that left ``pending`` within :data:`SPOT_WAIT` s, and a
        CapacityError (code ``SpotNotFulfilled``) per node whose VM did not: those VMs are
        terminated, so the launch goes on to the next offer. Raises CloudError."""
        from hypercli.providers.cloud import CapacityError
        deadline = time.monotonic() + SPOT_WAIT
        pending = {v.id: v for v in created if v.state == "pending"}
        while pending:
            now = {v.id: v for v in api.describe(cs.cluster)}
            pending = {i: v for i, v in pending.items() if i in now
                       and now[i].state == "pending"}
            if not pending or time.monotonic() > deadline:
                break
            time.sleep(DESCRIBE_EVERY)
        if not pending:
            return created, {}
        api.terminate(cs.cluster, list(pending))
        return ([v for v in created if v.id not in pending],
                {v.node: CapacityError(f"spot request for {v.node} in {v.zone or cs.region} "
                                       f"not fulfilled in {SPOT_WAIT:.0f} s",
                                       code="SpotNotFulfilled") for v in pending.values()})

    def api_for(self, cloud: str, region: str, options: dict | None = None) -> CloudAPI:
        """The CloudAPI of ``cloud`` in ``region``, made on first use and kept (the one given
        to the constructor for this provider's own cloud and region; ``apis`` of the
        constructor first).

        Args:
            options: for another cloud than the provider's own, what its API needs beyond
                the region (``project``, ``subscription_id``: an offer's extras,
                :data:`PLACE_KEYS`); the provider's own cloud uses the cluster's options.
        """
        key = (cloud, region)
        if key in self._apis:
            return self._apis[key]
        if cloud == self.name and region in ("", self.options.get("region", "")):
            return self.api()
        opts = dict(self.options) if cloud == self.name else dict(options or {})
        self._apis[key] = make_api(cloud, {**opts, "region": region})
        return self._apis[key]

    def _boot_docs(self, cs: CloudSpec, cloud: str, api: CloudAPI, nodes: list[str],
                   cluster_public: str, prepared: dict) -> dict[str, str]:
        """Each new node's boot document for ``cloud`` (module docstring, step 2)."""
        docs = {}
        own_keys = getattr(api, "node_host_keys", False)
        for node in nodes:
            if own_keys:  # the node makes its own and publishes the public half
                private = host_public = None
                reserve_name(cs.cluster, node)
                # a key made for an offer of another cloud tried before is not this node's
                (keys_dir(cs.cluster) / "hosts" / f"{node}.pub").write_text("")
            else:
                private, host_public = host_key(cs.cluster, node)
            docs[node] = boot_document(cs, cloud, node, private, host_public, cluster_public,
                                       prepared.get("node_env"))
        return docs

    @staticmethod
    def _prices(api: CloudAPI, cs: CloudSpec) -> dict[str, float]:
        """``api.spot_price`` for the place, {} when the cloud gives none or fails."""
        try:
            return api.spot_price(cs)
        except HyperError:
            return {}

    def _first_price(self, cs: CloudSpec, offers: list) -> float:
        """USD per node-hour of the first offer (asked of the cloud when the offer has none;
        0.0 when it is not known): what ``max_cost`` counts for a node to launch."""
        from hypercli.offers.failover import with_price
        first = offers[0]
        if first.price:
            return first.price
        ocs = replace(cs, region=first.region, instance_type=first.instance_type,
                      zones=(first.zone,) if first.zone else (), spot=first.spot)
        api = self.api_for(first.cloud, first.region, place_options(first))
        return with_price(first, self._prices(api, ocs)).price

    def _places(self, cluster: str, offers: list) -> list[tuple[str, str, dict]]:
        """The (cloud, region, API options) where the cluster may have instances or
        resources: the provider's own, those of ``offers``, and those a launch prepared
        before (``keys/<cluster>/places.json``)."""
        out = {(self.name, self.options.get("region", "")): {}}
        for o in offers:
            out.setdefault((o.cloud, o.region), place_options(o))
        try:
            for cloud, region, opts in json.loads((keys_dir(cluster) / "places.json")
                                                  .read_text()):
                out.setdefault((cloud, region), opts)
        except (OSError, ValueError, TypeError):
            pass
        return [(c, r, o) for (c, r), o in out.items()]

    def _remember_place(self, cluster: str, offer) -> None:
        """Record that the cluster's resources are made in the offer's cloud and region
        (with what its API needs there), before they are made, so that ``terminate`` (also
        of a later ``hyper down``) looks there too."""
        path = keys_dir(cluster) / "places.json"
        try:
            places = json.loads(path.read_text())
        except (OSError, ValueError):
            places = []
        entry = [offer.cloud, offer.region, place_options(offer)]
        if entry not in places:
            places.append(entry)
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(places))
            os.replace(tmp, path)

    def grant(self, spec: ClusterSpec) -> None:
        """Give the nodes of an up cluster the storage ``spec.grants`` asks (``hyper run
        --cluster``, and each workflow's start: ``hypercli.cluster.grant``): exactly those,
        what it had beyond them is taken away, in the provider's own place and in each other
        cloud or region where the cluster has nodes up (a launch that failed over there
        made an identity there). Raises CredentialsError / CloudError."""
        cs = self.cloud_spec(spec)
        self.api(spec.options).identity(cs)
        own = (self.name, spec.options.get("region", ""))
        places = {((n.get("info") or {}).get("cloud") or self.name,
                   (n.get("info") or {}).get("region") or own[1])
                  for n in S.State().nodes(cs.cluster, status="up")} - {own}
        known = {(c, r): o for c, r, o in self._places(cs.cluster, [])}
        for cloud, region in sorted(places):
            self.api_for(cloud, region, known.get((cloud, region))).identity(
                replace(cs, region=region))

    def _new_names(self, cs: CloudSpec, live: list[VM]) -> list[str]:
        """Names for the nodes to create: never one the cluster had before (a replacement
        is a new node, with its own host key and state row)."""
        hosts = keys_dir(cs.cluster) / "hosts"
        used = {v.node for v in live} | ({p.stem for p in hosts.glob("*.pub")}
                                         if hosts.exists() else set())
        names, i = [], 0
        while len(names) < cs.count - len(live):
            name = f"{cs.cluster}-{i}"
            if name not in used:
                names.append(name)
            i += 1
        return names

    def _bring_up(self, cs: CloudSpec, vms: list[VM], key_path: Path,
                  where: dict | None = None) -> tuple[list[Instance], dict]:
        """Wait for each VM to run with an address, pin its host key and bootstrap it.

        Args:
            where: instance id → (its CloudAPI, the spec of its place, the offer it was
                launched on and when (unix s), or None, None for a node found running);
                default: the provider's own API and ``cs``.
        """
        where = where or {}

        def one(node: str) -> Instance:
            vm = next(v for v in vms if v.node == node)
            api, vcs, offer, launched = where.get(vm.id, (self.api(), cs, None, None))
            deadline = time.monotonic() + BOOT_TIMEOUT
            while vm.state != "running" or not self._reachable(vm):
                if vm.state in ("terminated", "preempted", "stopping"):
                    raise NodeError(node, f"instance {vm.id} is {vm.state} while booting")
                if time.monotonic() > deadline:
                    raise NodeError(node, f"instance {vm.id} not running after "
                                    f"{BOOT_TIMEOUT:.0f} s (state {vm.state})")
                time.sleep(DESCRIBE_EVERY)
                vm = next((v for v in api.describe(cs.cluster) if v.id == vm.id),
                          replace(vm, state="terminated"))
            if getattr(api, "node_host_keys", False):
                self._published_key(cs.cluster, vm, deadline, api)
            last: Exception | None = None
            while time.monotonic() < deadline:
                target = self._target(vm, key_path)
                self._pin(cs.cluster, node, target)
                try:
                    inst = self.bootstrap(node, target, cs.cluster)
                    break
                except HyperError as e:  # still booting: sshd not up, old host key, ...
                    last = e
                    self.drop(node)
                    time.sleep(DESCRIBE_EVERY)
            else:
                raise NodeError(node, f"instance {vm.id} did not answer over SSH within "
                                f"{BOOT_TIMEOUT:.0f} s: {last}")
            info = node_info(getattr(api, "name", self.name), vcs, vm, target, inst.extra)
            if offer is not None:  # launched now: what the cost ledger records
                info.update(price=offer.price or None, launched_at=launched)
            return Instance(node, vm.id, inst.slots, inst.address, info)
        res = fan_out([v.node for v in vms], one)
        return list(res.ok.values()), dict(res.failed)

    @staticmethod
    def _reachable(vm: VM) -> bool:
        """Whether the VM has an address to try (with the test seam on: its entry there)."""
        if os.environ.get("HYPER_CLOUD_ADDRESSES"):
            return vm.id in seam_addresses()
        return bool(vm.public_ip)

    def _target(self, vm: VM, key_path: Path) -> Target:
        seam = seam_addresses().get(vm.id)
        if seam:
            return Target.parse(seam, user=SSH_USER, identity_file=str(key_path))
        return Target(vm.public_ip, 22, SSH_USER, str(key_path))

    def _pin(self, cluster: str, node: str, target: Target) -> None:
        pub = keys_dir(cluster) / "hosts" / f"{node}.pub"
        key = pub.read_text().strip() if pub.exists() else ""
        if key:
            self.known_hosts(cluster).pin(target.host, target.port, key)

    def _published_key(self, cluster: str, vm: VM, deadline: float,
                       api: CloudAPI | None = None) -> None:
        """Wait for the host key a node made itself and published through its cloud
        (:meth:`hypercli.providers.gcp.GCPAPI.host_key`), and keep it to be pinned. Raises
        NodeError when none is there by ``deadline``. A key already kept is not asked again:
        the first one published is the one pinned."""
        pub = keys_dir(cluster) / "hosts" / f"{vm.node}.pub"
        if pub.exists() and pub.read_text().strip():
            return
        while True:
            key = (api or self.api()).host_key(vm)
            if key:
                d = keys_dir(cluster) / "hosts"
                d.mkdir(parents=True, exist_ok=True, mode=0o700)
                (d / f"{vm.node}.pub").write_text(f"{key} hyper-{vm.node}\n")
                return
            if time.monotonic() > deadline:
                raise NodeError(vm.node, f"instance {vm.id} published no SSH host key within "
                                f"{BOOT_TIMEOUT:.0f} s")
            time.sleep(DESCRIBE_EVERY)

    def replacement(self, node: dict) -> ClusterSpec | None:
        """The cluster spec to launch again after ``node`` was preempted or terminated: its
        ``launch`` creates what the cluster lacks (its recorded size); None when the cluster
        is no longer recorded. The caller launches and records it (``cluster.replace``)."""
        c = S.State().cluster(node["cluster"])
        if c is None:
            return None
        return ClusterSpec(c["name"], c["provider"], (c["spec"] or {}).get("workers"),
                           (c["spec"] or {}).get("options") or {})

    # -- health --------------------------------------------------------------------------------
    def probe(self, node: dict) -> str:
        """What the cloud says of a node that stopped answering: ``running``, ``preempted``,
        ``gone`` (terminated or unknown to the cloud) or ``unknown`` (the API failed)."""
        try:
            info = node.get("info") or {}
            cloud = info.get("cloud") or self.name
            region = info.get("region") or self.options.get("region", "")
            opts = next((o for c, r, o in self._places(node["cluster"], [])
                         if (c, r) == (cloud, region)), {})
            vms = self.api_for(cloud, region, opts).describe(node["cluster"])
        except HyperError:
            return "unknown"
        vm = next((v for v in vms if v.id == node["provider_id"]), None)
        if vm is None or vm.state == "terminated":
            return "gone"
        return "preempted" if vm.state == "preempted" else vm.state

    def _options_of(self, node: dict) -> dict:
        info = node.get("info") or {}
        return {**self.options, **({"region": info["region"]} if info.get("region") else {})}

    # -- down ----------------------------------------------------------------------------------
    def terminate(self, cluster: str, nodes: list[dict]) -> list[str]:
        """Terminate the nodes, then delete everything tagged for the cluster until the
        cloud lists nothing (at most TEARDOWN_TIMEOUT s). Returns a line per removed
        resource. Raises CloudError when something is still there at the deadline."""
        for n in nodes:
            self.drop(n["name"])
        if nodes and not self.options.get("region"):
            self.options = self._options_of(nodes[0])
        places = self._places(cluster, [])
        known = {(c, r) for c, r, _ in places}
        places += [(c, r, {}) for c, r in dict.fromkeys(
            ((n.get("info") or {}).get("cloud") or self.name,
             (n.get("info") or {}).get("region") or "") for n in nodes) if (c, r) not in known]
        removed: list[str] = []
        for cloud, region, opts in places:
            if cloud == self.name and not region and self.options.get("region"):
                continue  # the same place as the provider's own
            removed += remove_all(self.api_for(cloud, region, opts), cluster)
        import shutil
        shutil.rmtree(keys_dir(cluster), ignore_errors=True)
        return removed


def remove_all(api: CloudAPI, cluster: str | None, keep: set | None = None,
               timeout: float = TEARDOWN_TIMEOUT) -> list[str]:
    """Delete the resources tagged for ``cluster`` (every hyper cluster when None, except
    those in ``keep``), looking again until none is left.

    Returns:
        one line per removed resource.
    Raises:
        CloudError: resources are still listed after ``timeout`` s (they are named).
    """
    from hypercli.providers.cloud import CloudError
    removed: list[str] = []
    deadline = time.monotonic() + timeout
    while True:
        left = [r for r in api.resources(cluster) if keep is None or r.cluster not in keep]
        if cluster is None:
            left = [r for r in left if r.cluster]  # never an untagged resource
        if not left:
            return removed
        if time.monotonic() > deadline:
            raise CloudError(f"still there after {timeout:.0f} s: "
                             + ", ".join(str(r) for r in left),
                             "run `hyper down` again, or remove them in the cloud console")
        removed += api.delete(left)
        time.sleep(0.5 if removed else 2.0)


def make_provider(name: str, trust_new_hosts: bool = False, options: dict | None = None,
                  **_) -> CloudProvider:
    """The provider ``name`` (``aws``, ``gcp`` or ``azure``)."""
    return CloudProvider(name, options=options)
