"""Datasets as chunks in object storage, read through a FUSE mount (see docs/datasets.md).

Modules: pack (chunk format, push), index (the file index), store (object-store access),
cache (chunk cache), fusefs (read-only FUSE file system), fuselow (its server of the FUSE
protocol, one or more processes), copy (a dataset copied whole to a
node's disk, ``mode: copy``), image (a dataset pushed as one EROFS image that the
kernel serves), node (node-side commands), outputs (task outputs in storage).
"""
