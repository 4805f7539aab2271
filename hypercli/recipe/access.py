"""What object storage a cluster's nodes may touch, derived from the recipe: the grants a
cloud provider turns into the cluster's storage identity (an IAM role on AWS, a service
account on GCP, a managed identity's role assignments on Azure), least privilege.

Rules:

* every ``mounts:`` dataset is **read** (``chunks+s3://b/p``, ``s3://b/p``: its bucket and
  prefix), unless the recipe mounts a plain bucket ``rw``, then read and write; a mount of an
  earlier run's outputs (``chunks+s3://b/runs/<workflow>/<task>``) is read like any dataset;
* the ``storage:`` prefix itself gives nothing: it is a *per-workflow* grant
  (:attr:`Grant.per_workflow`), which becomes **read and write** on
  ``<storage>/<workflow>/`` for each workflow that runs on the cluster, from its start
  (:func:`for_workflows`, ``hypercli.cluster.grant``) until the next change of the cluster's
  grants after it ended: task outputs, checkpoints and the pulls of earlier experiments'
  outputs of one workflow all live there, and no workflow may write another's;
* ``file://`` storage and ``chunks+file://`` mounts need nothing of the cloud;
* a grant inside another one that already allows as much is dropped; the same prefix read
  and written is one write grant.

A prefix of ``""`` is the whole bucket. Azure's "bucket" is ``account/container``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: storage URL schemes a cloud identity can be scoped to
SCHEMES = ("s3", "gs", "az")


@dataclass(frozen=True, order=True)
class Grant:
    """Access to one bucket prefix.

    Attributes:
        scheme: ``s3`` | ``gs`` | ``az``.
        bucket: the bucket (``s3``, ``gs``) or ``account/container`` (``az``).
        prefix: the key prefix, without leading or trailing ``/``; ``""`` is the whole bucket.
        write: read and write (True) or read only.
        per_workflow: a template that gives nothing by itself: read and write under
            ``prefix/<workflow>/`` for each workflow the cluster runs (:func:`for_workflows`).
            It tells a provider that the cluster needs a storage identity on that cloud.
    """

    scheme: str
    bucket: str
    prefix: str
    write: bool = False
    per_workflow: bool = False

    @property
    def url(self) -> str:
        """``scheme://bucket/prefix`` (no trailing ``/``)."""
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def covers(self, other: "Grant") -> bool:
        """Whether this grant allows everything ``other`` does (a per-workflow template
        covers only itself and is covered by nothing else)."""
        if self.per_workflow or other.per_workflow:
            return self == other
        return (self.scheme, self.bucket) == (other.scheme, other.bucket) and \
            (self.write or not other.write) and \
            (not self.prefix or other.prefix == self.prefix
             or other.prefix.startswith(self.prefix + "/"))

    def as_dict(self) -> dict:
        d = {"scheme": self.scheme, "bucket": self.bucket, "prefix": self.prefix,
             "write": self.write}
        if self.per_workflow:
            d["per_workflow"] = True
        return d


def parse_url(url: str, write: bool = False) -> Grant | None:
    """The grant of one storage or mount URL (``chunks+`` stripped), or None for a URL that
    needs no cloud identity (``file://``)."""
    if url.startswith("chunks+"):
        url = url[len("chunks+"):]
    scheme, sep, rest = url.partition("://")
    if not sep or scheme not in SCHEMES:
        return None
    parts = [p for p in rest.split("/") if p]
    if not parts:
        return None
    n = 2 if scheme == "az" else 1
    return Grant(scheme, "/".join(parts[:n]), "/".join(parts[n:]), write)


def merge(grants) -> tuple[Grant, ...]:
    """The smallest sorted set of grants that allows what ``grants`` (an iterable of
    :class:`Grant`) do."""
    todo = sorted(set(grants), key=lambda g: (not g.write, len(g.prefix), g))
    kept: list[Grant] = []
    for g in todo:
        if not any(k.covers(g) for k in kept):
            kept.append(g)
    return tuple(sorted(kept))


def storage_grants(storage: str | None, mounts: dict, rw_mounts=()) -> tuple[Grant, ...]:
    """The grants a recipe's nodes need (module docstring).

    Args:
        storage: the recipe's ``storage:`` URL, or None.
        mounts: mount path → URL (the recipe's ``mounts:``).
        rw_mounts: mount paths the recipe mounts read-write.
    """
    found = [parse_url(url, write=path in rw_mounts) for path, url in mounts.items()]
    if storage:
        g = parse_url(storage, write=True)
        found.append(None if g is None else Grant(g.scheme, g.bucket, g.prefix, True, True))
    return merge(g for g in found if g is not None)


def workflow_grant(storage: str, workflow: str) -> Grant | None:
    """Read and write on ``<storage>/<workflow>/`` (None for ``file://`` storage)."""
    return parse_url(f"{storage.rstrip('/')}/{workflow}", write=True)


def for_workflows(grants, workflows) -> tuple[Grant, ...]:
    """``grants`` with each per-workflow template's workflows added: for every workflow
    (``{"id", "storage"}`` rows, e.g. the cluster's live ones) whose storage is a template's
    URL, read and write on ``<storage>/<workflow>/`` (the templates are kept)."""
    grants = tuple(grants)
    out = list(grants)
    for t in grants:
        if t.per_workflow:
            for wf in workflows:
                g = parse_url(wf["storage"])
                if g is not None and (g.scheme, g.bucket, g.prefix) == \
                        (t.scheme, t.bucket, t.prefix):
                    out.append(workflow_grant(wf["storage"], wf["id"]))
    return merge(out)


def rights(grants) -> tuple[Grant, ...]:
    """The grants that give something (per-workflow templates left out)."""
    return tuple(g for g in grants if not g.per_workflow)


def grants_from(rows) -> tuple[Grant, ...]:
    """Grants from their :meth:`Grant.as_dict` form (as kept in the state file)."""
    return merge(Grant(r["scheme"], r["bucket"], r.get("prefix", ""), bool(r.get("write")),
                       bool(r.get("per_workflow"))) for r in rows or ())
