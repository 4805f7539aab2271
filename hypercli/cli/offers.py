"""``hyper offers`` and ``hyper catalog``: the machines the clouds sell, cheapest first, and the
catalog they come from (hypercli.offers)."""

from __future__ import annotations

import time

import click

from hypercli.cli.common import console, print_json, text

CLOUDS = ("aws", "gcp", "azure")


def _when(t: float) -> str:
    if not t:
        return "unknown date"
    return time.strftime("%Y-%m-%d", time.gmtime(t))


@click.command()
@click.argument("shape")
@click.option("--cloud", "clouds", multiple=True, type=click.Choice(CLOUDS),
              help="Only this cloud (repeat for more).")
@click.option("--region", "regions", multiple=True, metavar="REGION",
              help="Only this region (repeat for more).")
@click.option("--spot", "kind", flag_value="spot", help="Spot offers only.")
@click.option("--on-demand", "kind", flag_value="on-demand", help="On-demand offers only.")
@click.option("-n", "--limit", default=20, show_default=True, help="Rows shown (0: all).")
@click.option("--json", "as_json", is_flag=True, help="Print the offers as JSON.")
def offers(shape, clouds, regions, kind, limit, as_json):
    """List the offers of SHAPE, cheapest first: a GPU and count (V100:4, A100-80GB:8, T4)
    or an instance type (p3.8xlarge); one row per instance type and region, at the price
    of its cheapest zone."""
    from hypercli.offers.catalog import Catalog
    from hypercli.offers.optimizer import choose, parse_shape
    spot = {"spot": True, "on-demand": False}.get(kind, "auto")
    want = parse_shape(shape, spot)
    catalog = Catalog(list(clouds) or None)
    found = choose(want, catalog, clouds=list(clouds) or None, regions=list(regions) or None)
    rows: dict = {}
    for o in found:  # cheapest first: the first of each (type, region, kind) is its cheapest
        row = rows.setdefault((o.cloud, o.instance_type, o.region), {"offer": o})
        row.setdefault("spot" if o.spot else "price", o)
    ordered = sorted(rows.values(), key=lambda r: min(
        x.price for k, x in r.items() if k != "offer"))
    shown = ordered if limit == 0 else ordered[:limit]
    def source(r) -> str:  # where the row's prices come from (Catalog.price_source)
        return "+".join(sorted({catalog.price_source(o) for k, o in r.items() if k != "offer"}))

    if as_json:
        print_json([{"cloud": r["offer"].cloud, "instance_type": r["offer"].instance_type,
                     "accelerator": r["offer"].accelerator,
                     "accelerator_count": r["offer"].accelerator_count,
                     "vcpus": r["offer"].vcpus, "memory_gib": r["offer"].memory_gib,
                     "region": r["offer"].region,
                     "price": r["price"].price if "price" in r else None,
                     "price_zone": r["price"].where() if "price" in r else None,
                     "spot_price": r["spot"].price if "spot" in r else None,
                     "spot_zone": r["spot"].where() if "spot" in r else None,
                     "price_source": source(r)}
                    for r in shown])
        return
    from rich.table import Table
    table = Table(box=None)
    for col in ("GPU", "QTY", "CLOUD", "INSTANCE_TYPE", "vCPUs", "MEM_GiB", "REGION",
                "$/h", "SPOT $/h", "SPOT ZONE", "PRICES"):
        table.add_column(col, justify="right" if col in ("QTY", "vCPUs", "MEM_GiB", "$/h",
                                                          "SPOT $/h") else "left")
    for r in shown:
        o = r["offer"]
        table.add_row(o.accelerator or "-", str(o.accelerator_count or "-"), o.cloud,
                      text(o.instance_type), f"{o.vcpus:g}", f"{o.memory_gib:g}", o.region,
                      f"{r['price'].price:.4f}" if "price" in r else "-",
                      f"{r['spot'].price:.4f}" if "spot" in r else "-",
                      (r["spot"].zone or "") if "spot" in r else "", source(r))
    con = console()
    con.print(table)
    if len(shown) < len(ordered):
        con.print(f"… {len(ordered) - len(shown)} more (-n 0 shows all)")
    for cloud, t in catalog.tables.items():
        if cloud in catalog.stale():
            console(stderr=True).print(text(("note:", "dim"), f" the {cloud} catalog is from "
                                            f"{_when(t.read_at)} ({t.source}); `hyper catalog "
                                            f"refresh --cloud {cloud}` reads it again"))


@click.group()
def catalog():
    """The catalog of instance types and prices the optimizer ranks."""


@catalog.command("refresh")
@click.option("--cloud", "clouds", multiple=True, type=click.Choice(CLOUDS),
              help="Only this cloud (repeat for more; default all three).")
@click.option("--region", "regions", multiple=True, metavar="REGION",
              help="AWS/Azure: only this region (repeat for more; default every region).")
def refresh(clouds, regions):
    """Read instance types and prices from the clouds' APIs with your credentials into
    $HYPER_HOME/catalog/, with the date they were read."""
    from hypercli.offers.catalog import write
    con = console()
    for cloud in clouds or CLOUDS:
        t0 = time.time()
        if cloud == "aws":
            from hypercli.offers import read_aws
            table = read_aws.read(list(regions) or None)
        elif cloud == "gcp":
            from hypercli.offers import read_gcp
            table = read_gcp.read()
        else:
            from hypercli.offers import read_azure
            table = read_azure.read(regions=list(regions) or None)
        path = write(table)
        con.print(text((cloud, "bold"), f": {len(table.types)} instance types, "
                       f"{sum(len(v) for v in table.prices.values())} prices in "
                       f"{time.time() - t0:.0f}s → {path}"))


@catalog.command("show")
@click.option("--json", "as_json", is_flag=True, help="Print as JSON.")
def show(as_json):
    """Where each cloud's catalog comes from and its date."""
    from hypercli.offers.catalog import Catalog
    cat = Catalog()
    stale = cat.stale()
    rows = [{"cloud": c, "source": t.source, "read": _when(t.read_at),
             "types": len(t.types), "stale": c in stale,
             "prices": sum(len(v) for v in t.prices.values()),
             "public_prices": sum(1 for v in t.price_sources.values() if v == "public")}
            for c, t in cat.tables.items()]
    if as_json:
        print_json(rows)
        return
    con = console()
    for r in rows:
        note = ""
        if r["source"].startswith("snapshot"):  # data/NOTICE.md: which prices are public
            note = (f"; {r['public_prices']} of {r['prices']} prices from the public catalog"
                    f" (data/NOTICE.md), the rest illustrative")
        con.print(text((r["cloud"], "bold"), f": {r['types']} instance types, {r['source']}, "
                       f"read {r['read']}" + (" (older than a week)" if r["stale"] else "")
                       + note))
