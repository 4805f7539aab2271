"""``hyper up``, ``down``, ``check``, ``gc``, ``status`` and ``forget``: clusters brought up,
taken down, listed and cleaned (:mod:`hypercli.cluster`, :mod:`hypercli.workflows`).
"""

from __future__ import annotations

import sys

import click

from hypercli.cli.common import ago, console, open_state, plural, print_json, text


# -- clusters -----------------------------------------------------------------------------
@click.command()
@click.argument("recipe", type=click.Path(dir_okay=False), required=False)
@click.option("--provider", type=click.Choice(["local", "ssh"]),
              help="Without RECIPE: the provider of the cluster to bring up (cloud clusters "
                   "come from a recipe's cluster:).")
@click.option("--host", "hosts", multiple=True, metavar="[USER@]HOST[:PORT]",
              help="Without RECIPE: an SSH host (repeat for more).")
@click.option("--identity-file", type=click.Path(dir_okay=False),
              help="Without RECIPE: the SSH private key.")
@click.option("--user", help="Without RECIPE: the SSH user where a host names none.")
@click.option("--workers", type=int, help="Without RECIPE: number of local worker slots.")
@click.option("--name", default="default", show_default=True,
              help="Without RECIPE: the cluster's name.")
@click.option("--trust-new-hosts", is_flag=True,
              help="Pin the host key of SSH hosts seen for the first time (check them first).")
@click.option("--dry-run", is_flag=True,
              help="Cloud clusters: show what would be created and its price; create nothing.")
@click.option("--bootstrap", is_flag=True,
              help="Then run the node image's provisioning on every node over SSH "
                   "(hosts without the baked image; idempotent).")
@click.option("--offline", is_flag=True,
              help="With --bootstrap: skip the steps that download (packages, docker, "
                   "NVIDIA, goofys, pre-pulled images).")
def up(recipe, provider, hosts, identity_file, user, workers, name, trust_new_hosts, dry_run,
       bootstrap, offline):
    """Bring up the cluster of RECIPE, or one given by options (no tasks are run)."""
    from hypercli.errors import UsageError
    from hypercli.workflows import cluster_spec
    from hypercli.workflows import up as up_
    if recipe:
        from hypercli.workflows import load_with_defaults
        loaded = load_with_defaults(recipe)
        spec = loaded.cluster
        from hypercli.offers.pools import wants_pools
        if wants_pools(loaded, open_state()):
            raise UsageError(f"cluster {spec.name} runs as node pools, one per resource shape:"
                             " `hyper run` launches each pool when its experiments have work",
                             "`hyper plan` shows the pools; set cluster.pools: false to "
                             "bring one cluster up now")
        if dry_run:
            from hypercli.cluster import dry_run as dry_run_
            p = dry_run_(spec)
            kind = "spot" if p["spot"] else "on-demand"
            click.echo(f"cluster {p['cluster']} ({p['provider']} {p['region'] or 'default region'}"
                       f"): {p['running']} running, {p['to_create']} to create, "
                       f"{p['instance_type']} {kind}")
            for zone, price in sorted(p["zone_prices"].items(), key=lambda kv: kv[1]):
                click.echo(f"  {zone:<16} ${price:.4f}/h")
            if p["cost_per_hour"] is None:
                click.echo("  price: not available from this provider's API")
            else:
                click.echo(f"estimated cost: ${p['cost_per_hour']:.4f}/h for the whole cluster "
                           f"(cheapest zone, {plural(p['running'] + p['to_create'], 'node')})")
            return
    elif dry_run:
        raise UsageError("--dry-run needs a RECIPE with a cloud cluster")
    elif provider:
        spec = cluster_spec(name, provider, list(hosts), workers=workers,
                            identity_file=identity_file, user=user)
    else:
        raise UsageError("give a RECIPE or --provider", "e.g. `hyper up --provider ssh "
                         "--host root@10.0.0.5 --identity-file ~/.ssh/id_ed25519`")
    err = console(stderr=True)
    import time
    started = time.time()
    state = open_state()
    try:
        nodes = up_(state, spec, trust_new_hosts=trust_new_hosts,
                    log=lambda line: err.print(text(("not up:", "yellow"), f" {line}"),
                                              soft_wrap=True))
    finally:  # the launch's failover steps (a spot → on-demand move costs more)
        for e in state.cluster_events(spec.name, ("launch",), since=started):
            err.print(text(("failover:", "yellow"), f" {e['message']}"), soft_wrap=True)
    from hypercli.cluster import count_nodes
    click.echo(f"cluster {spec.name} is up: {count_nodes(nodes, spec.provider)}")
    for n in nodes:
        click.echo(f"  {n['name']}  {n['provider_id']}  {_node_facts(n['info'], spec.provider)}")
    if bootstrap:
        from hypercli.workflows import bootstrap_nodes
        for node, lines in bootstrap_nodes(open_state(), spec, nodes, offline=offline).items():
            for line in lines:
                click.echo(f"  {node}: {line}")


def _node_facts(info: dict, provider: str) -> str:
    """What a node holds, as its bootstrap measured it (a local node: its share of this
    machine)."""
    cpus = info.get("cpus")
    gpus = info.get("gpus") or []
    facts = [plural(cpus, "CPU") if isinstance(cpus, int) else f"{cpus or '?'} CPUs",
             f"{info.get('memory_bytes', 0) / 2**30:.1f} GiB"]
    if provider != "local":
        facts.append(f"{info.get('disk_free_bytes', 0) / 2**30:.0f} GiB free")
    facts.append(plural(len(gpus), "GPU") + (
        f" ({', '.join(str(g.get('name', g.get('index'))) for g in gpus)})" if gpus else ""))
    if provider == "local":
        facts.append(f"a share of this machine's {plural(info.get('machine_cpus') or 0, 'CPU')}")
    else:
        facts.append(f"docker: {'yes' if info.get('docker') else 'no'}")
    return ", ".join(facts)


@click.command()
@click.argument("cluster", required=False)
@click.option("-y", "--yes", is_flag=True,
              help="Cancel the cluster's running workflows without asking (with "
                   "--controller: remove it even while it drives a workflow).")
@click.option("--controller", metavar="USER@HOST|NAME",
              help="Remove this controller instead: stop it and delete what hypercli made "
                   "there (its tasks go on; `hyper attach` takes its workflows over); a "
                   "cloud's controller (NAME as `hyper status` shows it) is removed whole.")
def down(cluster, yes, controller):
    """Take CLUSTER down: cancel its tasks and remove its nodes.

    With workflows still running on it, asks first on a terminal; elsewhere refuses unless
    --yes is given.
    """
    from hypercli.cluster import down as down_
    from hypercli.cluster import work_on
    from hypercli.errors import UsageError
    state = open_state()
    if controller is not None:
        from hypercli.controller.client import down as remove
        from hypercli.controller.client import find
        name = find(state, controller)
        left = remove(state, name, yes=yes, removed=lambda line: click.echo(f"removed {line}"))
        for wid in left:
            click.echo(f"left {wid} running on its nodes (`hyper attach {wid}` takes it over)")
        click.echo(f"controller {name} removed")
        return
    if cluster is None:
        raise UsageError("give a CLUSTER (or --controller USER@HOST)", "`hyper status` lists "
                         "them")
    if state.cluster(cluster) is not None and state.cluster(cluster)["status"] == "up":
        work = work_on(state, cluster)
        if work and not yes:
            what = "; ".join(f"{w['workflow']} ({w['running']} running, {w['pending']} "
                             "pending)" for w in work)
            text = (f"cluster {cluster} has {plural(len(work), 'workflow')} not ended: "
                    f"{what}; taking it down cancels them")
            if not sys.stdin.isatty():
                raise UsageError(text, f"`hyper down {cluster} --yes` cancels them and takes "
                                 "it down")
            if not click.confirm(f"{text}. Go on?", default=False):
                raise UsageError(f"cluster {cluster} left up")
    removed = down_(state, cluster)
    for line in removed:
        click.echo(f"removed {line}")
    click.echo(f"cluster {cluster} is down")


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def check(as_json):
    """Show which cloud providers are ready (SDK installed, credentials accepted)."""
    from hypercli.cluster import check as check_
    rows = check_()
    if as_json:
        print_json(rows)
        return
    for r in rows:
        mark = "ready" if r["ready"] else "not ready"
        click.echo(f"{r['provider']:<6} {mark:<10} {r['detail']}")
        if r["hint"]:
            click.echo(f"{'':<17} hint: {r['hint']}")


@click.command()
@click.option("--provider", type=click.Choice(["aws", "gcp", "azure"]), required=True)
@click.option("--region", help="Region to clean (default: the SDK's configured one).")
@click.option("--project", help="GCP project.")
@click.option("--subscription", help="Azure subscription id.")
@click.option("--dry-run", is_flag=True, help="List what would be removed; remove nothing.")
def gc(provider, region, project, subscription, dry_run):
    """Remove every hyper:* resource in the cloud that no cluster that is up owns."""
    from hypercli.cluster import gc as gc_
    options = {k: v for k, v in (("region", region), ("project", project),
                                 ("subscription_id", subscription)) if v}
    lines = gc_(open_state(), provider, options, dry_run=dry_run)
    for line in lines:
        click.echo(f"{'orphan' if dry_run else 'removed'} {line}")
    click.echo(f"{plural(len(lines), 'orphan')} found" if dry_run else
               f"{plural(len(lines), 'resource')} removed")


@click.command()
@click.argument("cluster", required=False)
@click.option("--all", "show_all", is_flag=True, help="Also the clusters that are down.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def status(cluster, show_all, as_json):
    """Show clusters and their nodes (the clusters that are not down, or CLUSTER)."""
    from hypercli.offers.pools import pool_rows
    from hypercli.workflows import cluster_rows
    state = open_state()
    out, hidden = cluster_rows(state, cluster, show_all)
    for c in out:  # the offer each node runs on, and the latest launch failover steps
        offers = {r["node"]: r for r in state.ledger(c["cluster"]) if r["ended_at"] is None}
        for n in c["nodes"]:
            r = offers.get(n["name"])
            n["offer"] = None if r is None else {
                k: r[k] for k in ("cloud", "region", "zone", "instance_type", "price")}
            if r is not None:
                n["offer"]["spot"] = bool(r["spot"])
        c["pools"] = pool_rows(state, c["cluster"])
        c["launch"] = [{"ts": e["ts"], "step": e["message"]}
                       for e in state.cluster_events(c["cluster"], ("launch",), limit=5)]
    if as_json:
        print_json(out)
        return
    if not out and not hidden:
        click.echo("no clusters; `hyper up RECIPE` or `hyper run RECIPE` creates one")
    if cluster is None:
        _controllers(state)
    for c in out:
        up_nodes = sum(n["status"] == "up" for n in c["nodes"])
        click.echo(f"{c['cluster']}  {c['provider']}  {c['status']}  "
                   f"{up_nodes}/{len(c['nodes'])} nodes up")
        for n in c["nodes"]:
            o = n.get("offer")
            where = "" if not o else (
                f"  {o['cloud']} {o['zone'] or o['region']} {o['instance_type']} "
                f"{'spot' if o['spot'] else 'on-demand'}"
                + (f" ${o['price']:.4f}/h" if o["price"] else ""))
            click.echo(f"  {n['name']:<24} {n['status']:<6} slots {n['slots']}  "
                       f"{n['provider_id'] or ''}{where}")
        for p in c.get("pools", []):
            o = p["offer"]
            click.echo(f"  pool {p['pool']} ({', '.join(p['experiments'])}): {p['shape']}  "
                       f"{o['cloud']} {o['zone'] or o['region']} {o['instance_type']} "
                       f"{'spot' if o['spot'] else 'on-demand'} ${o['price']:.4f}/h  "
                       f"{p['size']}/{p['target']} nodes (cap {p['cap']})  {p['status']}"
                       + (f": {p['why']}" if p["why"] else ""))
        for e in c.get("launch", []):
            click.echo(f"  launch {ago(e['ts'])}: {e['step']}")
    if hidden:
        click.echo(f"{plural(hidden, 'cluster that is down', 'clusters that are down')} not "
                   f"shown (--all shows {'it' if hidden == 1 else 'them'}; `hyper forget "
                   "CLUSTER` removes one from the state file)")


def _controllers(state) -> None:
    """The controllers known here (hypercli.controller), each asked what it drives."""
    from hypercli.controller.client import controller_rows
    for c in controller_rows(state):
        if c["status"] == "down":
            continue
        drives = ", ".join(c["workflows"]) or "nothing"
        cost = ""
        if c["cost"] is not None:
            cost = f"  {c['cloud']} ${c['cost'][0]:.4f} so far, ${c['cost'][1]:.4f}/h"
        click.echo(f"controller {c['controller']}  {c['status']}  "
                   + (f"drives {drives}" if c["status"] == "up" else c["error"] or "") + cost)


@click.command()
@click.argument("cluster")
def forget(cluster):
    """Remove CLUSTER, which must be down, and its nodes from the state file; the records
    of its workflows are kept."""
    from hypercli.workflows import forget as forget_
    n = forget_(open_state(), cluster)
    click.echo(f"forgot cluster {cluster} ({plural(n, 'node')})")
