"""``hyper cost``: what the cloud nodes cost, per cluster, workflow and experiment, from the
cost ledger (:mod:`hypercli.offers.ledger`).
"""

from __future__ import annotations

import click

from hypercli.cli.common import open_state, plural, print_json


def _usd(v: float | None) -> str:
    return "-" if v is None else f"${v:,.2f}" if v >= 0.01 or v == 0 else f"${v:.4f}"


@click.command()
@click.argument("ref", metavar="[WORKFLOW|CLUSTER]", required=False)
@click.option("--nodes", "show_nodes", is_flag=True, help="Also each node's offer and cost.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def cost(ref, show_nodes, as_json):
    """What the cloud nodes cost: per cluster, workflow and experiment (a node shared by
    workflows is split by their tasks' time on it; a running node counts up to now). The
    nodes a controller launched for the workflows it drives are asked of it first."""
    from hypercli.cli.tasks import _from_controller
    from hypercli.offers.ledger import costs
    state = open_state()
    # workflows a controller drives: their records and its ledger rows copied here first
    _from_controller(state)
    out = costs(state, ref)
    if as_json:
        print_json(out)
        return
    if not out["nodes"]:
        click.echo("no cloud nodes in the cost ledger" + (f" for {ref}" if ref else ""))
        return
    for c in out["clusters"]:
        line = (f"cluster {c['cluster']:<20} {_usd(c['cost']):>10}  "
                f"{c['node_hours']:.2f} node-hours, {plural(c['nodes'], 'node')}"
                + (f", {c['running']} running" if c["running"] else ""))
        if c["idle"]:
            line += f", idle {_usd(c['idle'])}"
        if c["unpriced"]:
            line += f" ({plural(c['unpriced'], 'node')} with no known price)"
        click.echo(line)
    for p in out.get("pools", []):
        click.echo(f"  pool {p['pool']:<21} {_usd(p['cost']):>10}  "
                   f"{p['node_hours']:.2f} node-hours, {plural(p['nodes'], 'node')}"
                   + (f", {p['running']} running" if p["running"] else ""))
    for w in out["workflows"]:
        click.echo(f"workflow {w['workflow']:<19} {_usd(w['cost']):>10}  on {w['cluster']}")
        for exp, usd in w["experiments"].items():
            click.echo(f"  {exp:<26} {_usd(usd):>10}")
    if show_nodes:
        for n in out["nodes"]:
            kind = "spot" if n["spot"] else "on-demand"
            price = "price ?" if n["price"] is None else f"${n['price']:.4f}/h"
            state = "running" if n["ended_at"] is None else "ended"
            click.echo(f"  {n['node']:<24} {n['cloud']} {n['zone'] or n['region']} "
                       f"{n['instance_type']} {kind} {price}  {n['hours']:.2f} h "
                       f"{_usd(n['cost'])} ({state})")
    click.echo(f"total {_usd(out['total'])}")
