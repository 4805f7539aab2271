"""What object storage a cluster's nodes may touch, derived from the recipe: the grants a
cloud provider turns into the cluster's storage identity (an IAM role on AWS, a service
account on GCP, a managed identity's role assignments on Azure), least privilege.

Rules:

* every ``mounts:`` dataset is **read** (``chunks+s3://b/p``, ``s3://b/p``: its bucket and
  prefix), unless the recipe mounts a plain bucket ``rw``, then read and write;
* the ``storage:`` prefix is **read and write**: task outputs, checkpoints and the pulls of
  earlier experiments' outputs all live under ``<storage>/<workflow>/``;
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
    """

    scheme: str
    bucket: str
    prefix: str
    write: bool = False

    @property
    def url(self) -> str:
        """``scheme://bucket/prefix`` (no trailing ``/``)."""
        return f"{self.scheme}://{self.bucket}" + (f"/{self.prefix}" if self.prefix else "")

    def covers(self, other: "Grant") -> bool:
        """Whether this grant allows everything ``other`` does."""
        return (self.scheme, self.bucket) == (other.scheme, other.bucket) and \
            (self.write or not other.write) and \
            (not self.prefix or other.prefix == self.prefix
             or other.prefix.startswith(self.prefix + "/"))

    def as_dict(self) -> dict:
        return {"scheme": self.scheme, "bucket": self.bucket, "prefix": self.prefix,
                "write": self.write}


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
        found.append(parse_url(storage, write=True))
    return merge(g for g in found if g is not None)


def grants_from(rows) -> tuple[Grant, ...]:
    """Grants from their :meth:`Grant.as_dict` form (as kept in the state file)."""
    return merge(Grant(r["scheme"], r["bucket"], r.get("prefix", ""), bool(r.get("write")))
                 for r in rows or ())
